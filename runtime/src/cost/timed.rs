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
/// write into fresh memory (first-touch page faults included), not into the buffer the
/// previous call just freed. Measured here: an fp32 multiply over 12.6 MB took 1.0 ms writing
/// into a reused buffer, 1.8 ms with the last 16 results alive.
const KEEP: usize = 16;

/// Seconds per call of `f`: the median of [`BATCHES`] batches, each long enough to time, the
/// last [`KEEP`] results alive.
pub(super) fn time_call(mut f: impl FnMut() -> Result<Tensor>) -> Result<f64> {
    let mut kept = std::collections::VecDeque::with_capacity(KEEP + 1);
    let mut call = || -> Result<()> {
        kept.push_back(f()?);
        if kept.len() > KEEP {
            kept.pop_front();
        }
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
