//! How the calibration times a call and what it counts in one: batches of calls writing into
//! fresh memory as a step does, and the calls of one traced run that pay the overhead.

use std::time::Instant;

use ckptune_kernels::optrace;
use tch::Tensor;

use super::work;
use crate::error::Result;

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
