//! How the calibration times a call and what it counts in one: batches of calls writing into
//! fresh memory as a step does, and the calls of one traced run that pay the overhead.

use std::time::Instant;

use ckptune_kernels::{autograd, optrace};
use tch::Tensor;

use super::work;
use crate::error::{torch, Result};

/// Each timed batch runs at least this long.
const BATCH_SECONDS: f64 = 0.015;
/// Batches per point; the median counts, as a profile's times are medians (docs/timing.md).
pub(super) const BATCHES: usize = 5;
/// Results kept alive while timing: a training step keeps its activations, so its operators
/// write into fresh memory, not into the buffer the previous call just freed. Measured here: an
/// fp32 multiply over 12.6 MB took 1.0 ms writing into a reused buffer, 1.8 ms with the last 16
/// results alive.
const KEEP: usize = 16;
/// At most these bytes of results are kept (at least one result), beyond a CPU's last-level
/// cache: a step reuses the pages its predecessor freed (freed host memory is held), where 16
/// results of 64 MiB would each be new pages to fault in. On an AMD EPYC an add of 64 MiB
/// tensors ran at 33-40 GB/s with the memory of its results reused, and was measured at 2-10
/// GB/s while every result faulted its pages in.
const KEEP_BYTES: i64 = 128 << 20;
/// The results of the last calls, as many as a step's activations would cover
/// ([`KEEP`], [`KEEP_BYTES`]).
#[derive(Default)]
struct Kept {
    results: std::collections::VecDeque<(Tensor, i64)>,
    bytes: i64,
}

impl Kept {
    fn push(&mut self, t: Tensor) {
        let bytes = if t.defined() {
            t.numel() as i64 * t.kind().elt_size_in_bytes() as i64
        } else {
            0
        };
        self.bytes += bytes;
        self.results.push_back((t, bytes));
        while self.results.len() > 1 && (self.results.len() > KEEP || self.bytes > KEEP_BYTES) {
            if let Some((_, b)) = self.results.pop_front() {
                self.bytes -= b;
            }
        }
    }
}

/// Seconds per call of `f`: the median of [`BATCHES`] batches, each long enough to time, the
/// last results alive ([`Kept`]).
pub(super) fn time_call(mut f: impl FnMut() -> Result<Tensor>) -> Result<f64> {
    let mut kept = Kept::default();
    let mut call = || -> Result<()> {
        kept.push(f()?);
        Ok(())
    };
    call()?;
    let t = Instant::now();
    call()?;
    let once = t.elapsed().as_secs_f64().max(1e-7);
    let calls = ((BATCH_SECONDS / once).ceil() as usize).clamp(1, 100_000);
    let mut batches = Vec::with_capacity(BATCHES);
    for _ in 0..BATCHES {
        let t = Instant::now();
        for _ in 0..calls {
            call()?;
        }
        batches.push(t.elapsed().as_secs_f64() / calls as f64);
    }
    batches.sort_by(f64::total_cmp);
    Ok(batches[BATCHES / 2])
}

/// What one call of a probe runs, traced once: the operators that do work and how many calls
/// pay the overhead.
pub(super) struct Traced {
    pub(super) counted: Vec<(String, work::Counted)>,
    pub(super) calls: usize,
}

pub(super) fn traced(f: &mut dyn FnMut() -> Result<Tensor>) -> Result<Traced> {
    optrace::start()?;
    let out = f();
    let events = optrace::stop()?;
    drop(out?);
    let counted = work::counted(&events, &mut work::traits)
        .into_iter()
        .map(|c| (work::base(&events[c.index].name).to_owned(), c))
        .collect();
    Ok(Traced {
        counted,
        calls: work::calls(&events).len(),
    })
}

/// Seconds per call of a forward over a fresh leaf of `x0`'s values, and of that forward and
/// its backward, in grad mode; with the forward's and both's traces.
pub(super) fn forward_backward(x0: &Tensor, forward: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<[(f64, Traced); 2]> {
    // A fresh leaf per call: its gradient is taken, never accumulated into the last one.
    let leaf = || x0.detach().set_requires_grad(true);
    let g = forward(&leaf())?
        .f_ones_like()
        .map_err(torch("calibration: ones_like"))?;
    let mut fwd = || forward(&leaf());
    let mut both = || -> Result<Tensor> {
        let x = leaf();
        autograd::backward(forward(&x)?, g.shallow_clone())?;
        Ok(x.grad())
    };
    let (f, b) = (traced(&mut fwd)?, traced(&mut both)?);
    Ok([(time_call(&mut fwd)?, f), (time_call(&mut both)?, b)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    fn kept_after(elements: i64, calls: usize) -> Kept {
        let mut kept = Kept::default();
        for _ in 0..calls {
            kept.push(Tensor::zeros([elements], (Kind::Uint8, Device::Cpu)));
        }
        kept
    }

    #[test]
    fn the_last_results_are_kept_up_to_a_count_and_a_size_and_always_one() {
        // Small results: the last KEEP.
        let small = kept_after(1024, KEEP + 5);
        assert_eq!((small.results.len(), small.bytes), (KEEP, KEEP as i64 * 1024));
        // Results of a quarter of the bytes each: the last four, the oldest let go so that the
        // next call writes into its memory.
        let quarter = kept_after(KEEP_BYTES / 4, 9);
        assert_eq!((quarter.results.len(), quarter.bytes), (4, KEEP_BYTES));
        // One result over the bytes is kept alone.
        let large = kept_after(KEEP_BYTES + 1, 3);
        assert_eq!((large.results.len(), large.bytes), (1, KEEP_BYTES + 1));
        // A call returning no tensor (an undefined gradient) counts no bytes.
        let mut kept = Kept::default();
        kept.push(Tensor::new());
        assert_eq!((kept.results.len(), kept.bytes), (1, 0));
    }
}
