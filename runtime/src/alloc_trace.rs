//! A training step's allocation trace: every allocation and free of a session's steps in
//! order, with their bytes, recorded by the meter's allocation log on the CPU or the meta
//! device, and turned into the caching-allocator simulation's trace events.
//!
//! CPU and meta runs have one stream, so every event is on stream 0, as a plain PyTorch step
//! on the default CUDA stream is.

use ckptune_kernels::alloc_log::{AllocEvent, AllocLog, Recording};
use ckptune_solver::caching_allocator::TraceEvent;

use crate::error::Result;
use crate::exec::{Session, StepReport};

/// The marks [`record_steps`] puts before each step.
pub const WARM_UP_MARK: &str = "step 1 (warm-up)";
pub const STEP_MARK: &str = "step 2";

/// Runs two steps of `s` with `checkpoint` (the first makes the optimizer state, as a first
/// training step does), each after a mark, and returns what `rec` recorded — everything from
/// its start, so a session built after it started is in the log with its parameters — and the
/// second step's report.
pub fn record_steps(s: &mut Session, checkpoint: &[bool], mut rec: Recording) -> Result<(AllocLog, StepReport)> {
    rec.mark(WARM_UP_MARK);
    s.step(checkpoint, None)?;
    rec.mark(STEP_MARK);
    let report = s.step(checkpoint, None)?;
    Ok((rec.finish(), report))
}

/// `log` as the simulation's events, after `resident` allocations that live through the whole
/// trace (what the step allocates outside the log's view, such as cuBLAS's workspaces).
pub fn trace_events(log: &AllocLog, resident: &[u64]) -> Vec<TraceEvent> {
    let first = log
        .events
        .iter()
        .filter_map(|e| match e {
            AllocEvent::Alloc { id, .. } => Some(id + 1),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    let resident = resident.iter().enumerate().map(|(k, &bytes)| TraceEvent::Alloc {
        id: first + k as u64,
        bytes,
        stream: 0,
    });
    resident
        .chain(log.events.iter().map(|e| match e {
            AllocEvent::Alloc { id, bytes } => TraceEvent::Alloc {
                id: *id,
                bytes: *bytes,
                stream: 0,
            },
            AllocEvent::Free { id } => TraceEvent::Free { id: *id },
            AllocEvent::Mark(name) => TraceEvent::Mark(name.clone()),
        }))
        .collect()
}
