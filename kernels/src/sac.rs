//! Selective activation checkpointing (`csrc/sac.cpp`): a checkpointed block whose forward keeps
//! the outputs of the operators a [`SacPolicy`] saves and whose recompute takes them from there
//! instead of computing them again, as `torch.utils.checkpoint` does with
//! `context_fn=partial(create_selective_checkpoint_contexts, policy)`. Everything else the block
//! computes is recomputed; autograd records every operator of the recompute as in a plain
//! forward, so the backward (and every gradient, bit for bit) is the plain block's.

use std::ffi::c_int;
use std::marker::PhantomData;

use crate::{ffi, KernelError};

/// Which operators' outputs a selective block keeps from its forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SacPolicy {
    /// torchtitan's `op` policy: matrix products (`mm`, `addmm`, `bmm`, `baddbmm`, so every
    /// `linear` and `matmul`) and the scaled-dot-product attention kernels; the cheap operators
    /// between them (norms, activations, rotary, residual adds, casts) are recomputed.
    Matmul,
    /// Megatron's selective recompute of the attention core: recomputed are the attention
    /// kernels, every operator reading or writing a tensor of the score shape `[..., s, s]`
    /// (three dimensions or more, the last two equal: q@k^T, its scale, the mask's add, softmax
    /// and its casts, dropout, probabilities@v), random, pointwise and factory operators, views,
    /// and in-place writes into recomputed tensors; every other output is kept (projections,
    /// norms, reductions, concatenations), in-place writes into kept ones too.
    Attention,
}

impl SacPolicy {
    /// Every policy, in the order the CLI and the plan name them.
    pub const ALL: [SacPolicy; 2] = [SacPolicy::Matmul, SacPolicy::Attention];

    /// The name plans, the CLI and the companion use: `matmul`, `attention`.
    pub fn name(self) -> &'static str {
        match self {
            SacPolicy::Matmul => "matmul",
            SacPolicy::Attention => "attention",
        }
    }

    /// The policy named `name` ([`SacPolicy::name`]).
    pub fn from_name(name: &str) -> Option<SacPolicy> {
        SacPolicy::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Whether this policy saves every call of operator `name` (`aten::addmm`,
    /// `aten::add.Tensor`: with its overload, as [`crate::optrace::OpEvent::name`] has it): a
    /// selective block's recompute returns its cached outputs instead of running it. Answered by
    /// the test the recompute applies (`csrc/sac.cpp`) for `matmul`, whose test reads the name
    /// alone; `None` for `attention`, whose test reads each call's shapes and tags.
    pub fn saves(self, name: &str) -> Option<bool> {
        let c = std::ffi::CString::new(name).ok()?;
        // SAFETY: `c` is a NUL-terminated string alive for the call; the shim only reads it.
        match unsafe { ffi::ckpt_sac_saves(self.code(), c.as_ptr()) } {
            -1 => None,
            answer => Some(answer != 0),
        }
    }

    /// Whether the cost model can tell which calls this policy's recompute takes from the cache
    /// by their operator's name alone ([`SacPolicy::saves`]).
    pub fn saves_by_name(self) -> bool {
        self == SacPolicy::Matmul
    }

    fn code(self) -> c_int {
        match self {
            SacPolicy::Matmul => 0,
            SacPolicy::Attention => 1,
        }
    }
}

/// What sac.cpp says when a recompute calls an operator more often than its forward did: the
/// forward's decisions cannot be replayed.
pub const REPLAY_MISMATCH: &str = "ran in a selective block's recompute more often than in its forward";

/// The outputs a selective block's forward kept, until its recompute takes them.
#[derive(Debug)]
pub struct SacCache {
    raw: *mut ffi::CSacCache,
}

impl Drop for SacCache {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `ckpt_sac_record` and is freed once, here.
        unsafe { ffi::ckpt_sac_free(self.raw) }
    }
}

impl SacCache {
    /// Cached outputs no recompute has taken yet.
    pub fn left(&self) -> i64 {
        // SAFETY: `raw` is alive while `self` is.
        unsafe { ffi::ckpt_sac_left(self.raw) }
    }
}

/// A selective block's forward recording on this thread while alive; [`Recording::finish`]
/// hands back what it kept.
#[derive(Debug)]
pub struct Recording {
    cache: Option<SacCache>,
    _thread: PhantomData<*const ()>,
}

/// Starts recording a selective block's forward under `policy`.
pub fn record(policy: SacPolicy) -> Result<Recording, KernelError> {
    let mut raw: *mut ffi::CSacCache = std::ptr::null_mut();
    ffi::check("starting a selective block's forward", |e| unsafe {
        ffi::ckpt_sac_record(policy.code(), &mut raw, e)
    })?;
    Ok(Recording {
        cache: Some(SacCache { raw }),
        _thread: PhantomData,
    })
}

impl Recording {
    /// Stops recording; the cache keeps the saved outputs.
    pub fn finish(mut self) -> SacCache {
        unsafe { ffi::ckpt_sac_stop() };
        self.cache.take().expect("a recording's cache is taken once")
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        if self.cache.is_some() {
            unsafe { ffi::ckpt_sac_stop() };
        }
    }
}

/// A selective block's recompute replaying `cache` on this thread while alive.
#[derive(Debug)]
pub struct Replay<'a> {
    _cache: PhantomData<&'a mut SacCache>,
    _thread: PhantomData<*const ()>,
}

/// Starts the recompute of the block that recorded `cache`.
pub fn replay(cache: &mut SacCache) -> Result<Replay<'_>, KernelError> {
    let raw = cache.raw;
    ffi::check("starting a selective block's recompute", |e| unsafe {
        ffi::ckpt_sac_replay(raw, e)
    })?;
    Ok(Replay {
        _cache: PhantomData,
        _thread: PhantomData,
    })
}

impl Drop for Replay<'_> {
    fn drop(&mut self) {
        unsafe { ffi::ckpt_sac_stop() }
    }
}
