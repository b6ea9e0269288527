//! The Python numbers a block's operators take as tensors ([`crate::ops::call`] makes each a
//! 0-dim "wrapped number", as PyTorch's Python binding does): what a checkpointed module keeps of
//! them in PyTorch. An operator's backward may save such a number (`scores / 8.0` is `div.Tensor`,
//! whose backward divides by the saved 8.0), and autograd saves a wrapped number past any
//! saved-tensor hooks, so `torch.utils.checkpoint`'s forward, which drops every other tensor its
//! graph saves, keeps the 8 bytes of each until the module's backward: one per BERT layer under
//! eager attention. A forward run without grad saves nothing, so a checkpointed or selective
//! block's forward keeps, in a [`Scope`] told what the block's run with grad saved, the numbers
//! that run saved (`csrc/shim.cpp`, `NumberScope`).

use std::ffi::{c_int, c_void};
use std::marker::PhantomData;

use tch::Tensor;

use crate::{ffi, KernelError};

/// What a block's forward or recompute did with the wrapped numbers its operators took, in the
/// order they were made.
#[derive(Debug, Default)]
pub struct Numbers {
    /// In a run with grad: per number, whether autograd saved it. The answer a later no-grad forward of
    /// the same block is told.
    pub saved: Vec<bool>,
    /// In a run without grad: the numbers the block's run with grad saves (every number, when the scope
    /// was told nothing), kept alive as the checkpoint's forward graph keeps them.
    pub kept: Vec<Tensor>,
}

/// This thread's number scope while alive (one at a time); [`Scope::finish`] ends it.
#[derive(Debug)]
pub struct Scope {
    open: bool,
    with_grad: bool,
    _thread: PhantomData<*const ()>,
}

/// How the block whose numbers a [`Scope`] counts runs.
#[derive(Debug, Clone, Copy)]
pub enum BlockRun<'a> {
    /// With grad (a plain forward or a recompute): the scope learns which numbers autograd saves.
    WithGrad,
    /// Without grad (a checkpointed or selective forward): the scope keeps the numbers the
    /// block's run with grad saved ([`Numbers::saved`]), or every number when that is `None`
    /// (the block has not run with grad yet).
    WithoutGrad(Option<&'a [bool]>),
}

/// Opens a number scope on this thread for a block's forward or recompute, run as `run` says.
/// The block's run decides, not the grad mode of each operator: a number made where a block run
/// with grad turns grad off inside (transformers' rotary embedding is `@torch.no_grad()`) is
/// saved by nothing, and its place is learned as not saved.
pub fn scope(run: BlockRun<'_>) -> Result<Scope, KernelError> {
    let (grad, saved) = match run {
        BlockRun::WithGrad => (true, None),
        BlockRun::WithoutGrad(saved) => (false, saved),
    };
    let flags: Vec<u8> = saved.unwrap_or_default().iter().map(|&s| s as u8).collect();
    ffi::check("opening a block's number scope", |e| unsafe {
        ffi::ckpt_numbers_begin(
            grad as c_int,
            flags.as_ptr(),
            flags.len() as i64,
            saved.is_some() as c_int,
            e,
        )
    })?;
    Ok(Scope {
        open: true,
        with_grad: grad,
        _thread: PhantomData,
    })
}

extern "C" fn push_number(ctx: *mut c_void, saved: c_int, kept: ffi::CTensor) {
    // SAFETY: ctx is the `Numbers` passed by `finish`; a kept number is a fresh handle, ours.
    let out = unsafe { &mut *(ctx as *mut Numbers) };
    if saved < 0 {
        out.kept.push(ffi::from_raw(kept));
    } else {
        out.saved.push(saved != 0);
    }
}

impl Scope {
    /// Whether the scope counts a block's run with grad ([`BlockRun::WithGrad`]).
    pub fn with_grad(&self) -> bool {
        self.with_grad
    }

    /// Ends the scope: what it saw.
    pub fn finish(mut self) -> Numbers {
        self.open = false;
        let mut out = Numbers::default();
        // SAFETY: `out` outlives the call, which reports into it synchronously.
        unsafe { ffi::ckpt_numbers_end(&mut out as *mut Numbers as *mut c_void, Some(push_number)) };
        out
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        if self.open {
            // SAFETY: no callback: the scope's numbers are released in the shim.
            unsafe { ffi::ckpt_numbers_end(std::ptr::null_mut(), None) };
        }
    }
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    use super::*;
    use crate::ops::{call, Arg};

    /// `x / 8.0` as PyTorch runs it: `div.Tensor` with a wrapped number.
    fn div(x: &Tensor) {
        call(
            "aten::div",
            "Tensor",
            &[("self", Arg::Tensor(x)), ("other", Arg::Float(8.0))],
        )
        .unwrap();
    }

    #[test]
    fn a_run_without_grad_keeps_the_numbers_the_run_with_grad_saved() {
        let w = Tensor::ones([4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let b = Tensor::ones([4], (Kind::Float, Device::Cpu));
        // `w / 8.0`, `b / 8.0`, and `w / 8.0` where the block turns grad off inside.
        let block = || {
            div(&w);
            div(&b);
            tch::no_grad(|| div(&w));
        };
        let run = |how: BlockRun<'_>| {
            let s = scope(how).unwrap();
            match how {
                BlockRun::WithGrad => block(),
                BlockRun::WithoutGrad(_) => tch::no_grad(block),
            }
            s.finish()
        };
        // With grad, the first `w / 8.0`'s backward saves the 8.0; `b / 8.0` has no backward,
        // and neither has the `w / 8.0` run without grad inside the block.
        let learned = run(BlockRun::WithGrad);
        assert_eq!(learned.saved, [true, false, false]);
        assert!(learned.kept.is_empty());
        // Without grad, told that, the scope keeps the first number alone: 8 bytes of f64.
        let kept = run(BlockRun::WithoutGrad(Some(&learned.saved)));
        assert!(kept.saved.is_empty());
        assert_eq!(kept.kept.len(), 1);
        let n = &kept.kept[0];
        assert_eq!((n.kind(), n.dim(), n.double_value(&[])), (Kind::Double, 0, 8.0));
        // Told nothing (a block that has not run with grad yet), it keeps every number.
        assert_eq!(run(BlockRun::WithoutGrad(None)).kept.len(), 3);
        // A second scope on the thread is refused while one is open; a dropped one closes.
        let open = scope(BlockRun::WithGrad).unwrap();
        let e = scope(BlockRun::WithGrad).unwrap_err().to_string();
        assert!(e.contains("already open"), "{e}");
        drop(open);
        scope(BlockRun::WithGrad).unwrap().finish();
    }
}
