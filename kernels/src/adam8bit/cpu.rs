//! The CPU path: raw views of each parameter's buffers, and the threads that run their blocks
//! through the update in place (with AVX2 gathers where the CPU has them).

use std::sync::atomic::{AtomicUsize, Ordering};

use tch::Tensor;

use super::qmap::BLOCK;
use super::state::{Moments, ParamState};
use super::update::StepScalars;
use super::update::{block_kernel, full_kernel};
use crate::KernelError;

/// Raw views of one parameter's buffers for the CPU kernels.
pub(super) struct CpuJob {
    p: *mut f32,
    g: *const f32,
    n: usize,
    state: JobState,
    s: StepScalars,
}

enum JobState {
    Full {
        m: *mut f32,
        v: *mut f32,
    },
    Blockwise {
        mc: *mut u8,
        vc: *mut u8,
        am: *mut f32,
        av: *mut f32,
    },
}

// SAFETY: a job only carries pointers into tensors that outlive the scoped threads that use it
// (the parameters and states are borrowed by `Adam8bit::step`, the gradients held in `todo`),
// and the work items handed to different threads cover disjoint element ranges of those buffers
// (`run_cpu`); `check_disjoint` rules out parameters that alias each other or a gradient.
unsafe impl Sync for CpuJob {}
unsafe impl Send for CpuJob {}

impl CpuJob {
    /// `p` and `g` must be contiguous f32 CPU tensors of equal numel, `state` this parameter's.
    pub(super) fn new(p: &Tensor, g: &Tensor, state: &ParamState, s: StepScalars) -> Self {
        let ptr = |t: &Tensor| t.data_ptr();
        let state = match &state.moments {
            Moments::Full { m, v } => JobState::Full {
                m: ptr(m).cast(),
                v: ptr(v).cast(),
            },
            Moments::Blockwise {
                m_codes,
                v_codes,
                m_absmax,
                v_absmax,
            } => JobState::Blockwise {
                mc: ptr(m_codes).cast(),
                vc: ptr(v_codes).cast(),
                am: ptr(m_absmax).cast(),
                av: ptr(v_absmax).cast(),
            },
        };
        Self {
            p: ptr(p).cast(),
            g: ptr(g).cast_const().cast(),
            n: p.numel(),
            state,
            s,
        }
    }

    fn blocks(&self) -> usize {
        match self.state {
            JobState::Full { .. } => 1,
            JobState::Blockwise { .. } => self.n.div_ceil(BLOCK),
        }
    }

    /// Runs blocks `b0..b1` (for a 32-bit job, its one "block" is the whole tensor).
    ///
    /// # Safety
    /// No other thread may touch blocks `b0..b1` of this job meanwhile, and the job's buffers
    /// must be alive (see the `Sync` impl).
    unsafe fn run(&self, b0: usize, b1: usize) {
        let lo = b0 * BLOCK;
        let hi = match self.state {
            JobState::Full { .. } => self.n,
            JobState::Blockwise { .. } => (b1 * BLOCK).min(self.n),
        };
        let len = hi - lo;
        // SAFETY: [lo, hi) lies inside every buffer (each has n elements, absmax one per block);
        // the caller guarantees exclusive access to this range; `g` is never written and aliases
        // no parameter (checked). The element types match the tensors' dtypes.
        unsafe {
            let p = std::slice::from_raw_parts_mut(self.p.add(lo), len);
            let g = std::slice::from_raw_parts(self.g.add(lo), len);
            match self.state {
                JobState::Full { m, v } => {
                    let m = std::slice::from_raw_parts_mut(m.add(lo), len);
                    let v = std::slice::from_raw_parts_mut(v.add(lo), len);
                    // Below 4096 elements: not worth an AVX2 variant.
                    full_kernel(p, g, m, v, &self.s);
                }
                JobState::Blockwise { mc, vc, am, av } => {
                    let mc = std::slice::from_raw_parts_mut(mc.add(lo), len);
                    let vc = std::slice::from_raw_parts_mut(vc.add(lo), len);
                    let am = std::slice::from_raw_parts_mut(am.add(b0), b1 - b0);
                    let av = std::slice::from_raw_parts_mut(av.add(b0), b1 - b0);
                    dispatch_blocks(p, g, mc, vc, am, av, &self.s);
                }
            }
        }
    }
}

/// Refuses parameters that overlap each other or a gradient (`(tensor, written)` pairs): the
/// threads would race on them. Gradients may overlap each other: they are only read.
pub(super) fn check_disjoint<'a>(tensors: impl Iterator<Item = (&'a Tensor, bool)>) -> Result<(), KernelError> {
    let mut ranges: Vec<(usize, usize, bool)> = tensors
        .map(|(t, written)| {
            let start = t.data_ptr() as usize;
            (start, start + t.numel() * 4, written)
        })
        .collect();
    ranges.sort_unstable();
    let (mut p_end, mut g_end) = (0usize, 0usize);
    for (start, end, written) in ranges {
        // Ranges arrive by start, so overlap with an earlier one means starting before its end.
        if start < p_end || (written && start < g_end) {
            return Err(KernelError::Invalid {
                op: "8-bit Adam step",
                message: format!(
                    "a parameter's memory at {start:#x} overlaps another parameter or a gradient; \
                     each parameter must own its storage"
                ),
            });
        }
        if written {
            p_end = p_end.max(end);
        } else {
            g_end = g_end.max(end);
        }
    }
    Ok(())
}

/// Blocks per work item: 16 K elements, large enough to amortize the queue, small enough to
/// balance two to a few dozen threads over a ResNet's tensors.
const CHUNK_BLOCKS: usize = 8;
/// Below this many elements in a step, threads cost more than they save.
const PARALLEL_MIN: usize = 1 << 16;

/// Runs all jobs over `tch::get_num_threads()` threads (libtorch's intra-op setting, so the
/// user's one thread knob governs both): work items are chunks of blocks, taken from a shared
/// counter so big and small tensors balance.
pub(super) fn run_cpu(jobs: &[CpuJob]) {
    let items: Vec<(usize, usize, usize)> = jobs
        .iter()
        .enumerate()
        .flat_map(|(j, job)| {
            let blocks = job.blocks();
            (0..blocks)
                .step_by(CHUNK_BLOCKS)
                .map(move |b| (j, b, (b + CHUNK_BLOCKS).min(blocks)))
        })
        .collect();
    let total: usize = jobs.iter().map(|j| j.n).sum();
    let threads = usize::try_from(tch::get_num_threads())
        .unwrap_or(1)
        .clamp(1, items.len().max(1));
    let next = AtomicUsize::new(0);
    let work = || loop {
        let k = next.fetch_add(1, Ordering::Relaxed);
        let Some(&(j, b0, b1)) = items.get(k) else { break };
        // SAFETY: each item index is claimed by exactly one thread (fetch_add), and items
        // cover disjoint block ranges; the buffers outlive this function (see `CpuJob`).
        unsafe { jobs[j].run(b0, b1) };
    };
    if threads == 1 || total < PARALLEL_MIN {
        work();
        return;
    }
    std::thread::scope(|scope| {
        for _ in 1..threads {
            scope.spawn(work);
        }
        work();
    });
}

/// Whether the running CPU has AVX2, for the explicit-gather passes (the macro caches).
#[cfg(target_arch = "x86_64")]
pub(super) fn has_avx2() -> bool {
    std::is_x86_feature_detected!("avx2")
}

fn dispatch_blocks(
    p: &mut [f32],
    g: &[f32],
    mc: &mut [u8],
    vc: &mut [u8],
    am: &mut [f32],
    av: &mut [f32],
    s: &StepScalars,
) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 (checked above).
        unsafe { blocks_avx2(p, g, mc, vc, am, av, s) };
        return;
    }
    blocks_generic(p, g, mc, vc, am, av, s);
}

/// The same code compiled for AVX2, with explicit gathers. No FMA is enabled and Rust never
/// contracts `a * b + c`, so the results are bit-identical to [`blocks_generic`] (and to the
/// CUDA kernel).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn blocks_avx2(
    p: &mut [f32],
    g: &[f32],
    mc: &mut [u8],
    vc: &mut [u8],
    am: &mut [f32],
    av: &mut [f32],
    s: &StepScalars,
) {
    blocks::<true>(p, g, mc, vc, am, av, s);
}

fn blocks_generic(
    p: &mut [f32],
    g: &[f32],
    mc: &mut [u8],
    vc: &mut [u8],
    am: &mut [f32],
    av: &mut [f32],
    s: &StepScalars,
) {
    blocks::<false>(p, g, mc, vc, am, av, s);
}

#[inline(always)]
fn blocks<const AVX2: bool>(
    p: &mut [f32],
    g: &[f32],
    mc: &mut [u8],
    vc: &mut [u8],
    am: &mut [f32],
    av: &mut [f32],
    s: &StepScalars,
) {
    for (((((p, g), mc), vc), am), av) in p
        .chunks_mut(BLOCK)
        .zip(g.chunks(BLOCK))
        .zip(mc.chunks_mut(BLOCK))
        .zip(vc.chunks_mut(BLOCK))
        .zip(am.iter_mut())
        .zip(av.iter_mut())
    {
        block_kernel::<AVX2>(p, g, mc, vc, am, av, s);
    }
}
