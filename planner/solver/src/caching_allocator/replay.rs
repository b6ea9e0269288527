//! Replaying an allocation trace: every allocation and free of a training step in order, with
//! marks naming its moments ("forward layer1", "optimizer"). Gives the state after every
//! event and, per span between marks, the peaks `max_memory_allocated()` and
//! `max_memory_reserved()` would report had `reset_peak_memory_stats()` been called at the mark.

use super::config::{AllocatorConfig, ConfigError};
use super::error::SimError;
use super::simulator::Simulator;
use super::stats::Stats;

/// One step of a trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TraceEvent {
    /// `torch.empty(bytes, dtype=torch.uint8, device="cuda")` on `stream`, kept as `id`.
    Alloc { id: u64, bytes: u64, stream: u32 },
    /// The last reference to allocation `id` dropped.
    Free { id: u64 },
    /// `torch.cuda.empty_cache()`.
    EmptyCache,
    /// The start of a named moment of the step; it ends at the next mark.
    Mark(String),
}

/// What the GPU check reads from `memory_stats()` after an event, and the largest cached
/// free block.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
    pub active_bytes: u64,
    pub requested_bytes: u64,
    pub segments: u64,
    pub largest_free_block: u64,
}

impl Snapshot {
    pub fn of(stats: &Stats) -> Snapshot {
        Snapshot {
            allocated_bytes: stats.allocated_bytes.current,
            reserved_bytes: stats.reserved_bytes.current,
            active_bytes: stats.active_bytes.current,
            requested_bytes: stats.requested_bytes.current,
            segments: stats.segment.current,
            largest_free_block: stats.largest_free_block,
        }
    }
}

/// A span of the trace between two marks (or before the first, named `start`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpanPeaks {
    pub name: String,
    /// The span's events are `first_event..end_event` (the mark itself excluded).
    pub first_event: usize,
    pub end_event: usize,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub peak_active_bytes: u64,
    pub peak_requested_bytes: u64,
    /// The state when the span ended.
    pub end: Snapshot,
}

/// Where a replay stopped early: an out-of-memory error (the step would crash there) or a
/// trace that frees what it did not allocate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stop {
    pub event: usize,
    pub error: SimError,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replay {
    /// The state after each event replayed (marks included), one per event up to the stop.
    pub after_event: Vec<Snapshot>,
    pub spans: Vec<SpanPeaks>,
    /// The statistics at the end (peaks since the last mark).
    pub stats: Stats,
    pub stopped: Option<Stop>,
}

/// Replays `events` on a fresh allocator; stops at the first event that fails.
pub fn replay(events: &[TraceEvent], config: AllocatorConfig, capacity: Option<u64>) -> Result<Replay, ConfigError> {
    let mut sim = Simulator::new(config, capacity)?;
    let mut after_event = Vec::with_capacity(events.len());
    let mut spans = Vec::new();
    let mut open: Option<(String, usize)> = None;
    let mut stopped = None;
    for (i, event) in events.iter().enumerate() {
        let result = match event {
            TraceEvent::Mark(name) => {
                if let Some((span, first)) = open.take() {
                    spans.push(close(span, first, i, &sim));
                }
                sim.reset_peak();
                open = Some((name.clone(), i + 1));
                Ok(())
            }
            _ => {
                open.get_or_insert_with(|| ("start".to_string(), i));
                apply(&mut sim, event)
            }
        };
        after_event.push(Snapshot::of(&sim.stats()));
        if let Err(error) = result {
            stopped = Some(Stop { event: i, error });
            break;
        }
    }
    if let Some((span, first)) = open {
        spans.push(close(span, first, after_event.len(), &sim));
    }
    Ok(Replay {
        after_event,
        spans,
        stats: sim.stats(),
        stopped,
    })
}

fn apply(sim: &mut Simulator, event: &TraceEvent) -> Result<(), SimError> {
    match event {
        TraceEvent::Alloc { id, bytes, stream } => sim.malloc(*id, *bytes, *stream),
        TraceEvent::Free { id } => sim.free(*id),
        TraceEvent::EmptyCache => {
            sim.empty_cache();
            Ok(())
        }
        TraceEvent::Mark(_) => Ok(()),
    }
}

fn close(name: String, first_event: usize, end_event: usize, sim: &Simulator) -> SpanPeaks {
    let stats = sim.stats();
    SpanPeaks {
        name,
        first_event,
        end_event,
        peak_allocated_bytes: stats.allocated_bytes.peak,
        peak_reserved_bytes: stats.reserved_bytes.peak,
        peak_active_bytes: stats.active_bytes.peak,
        peak_requested_bytes: stats.requested_bytes.peak,
        end: Snapshot::of(&stats),
    }
}
