//! Allocation traces (`ckptune.alloc-trace/1`) and their replays through the caching-allocator
//! simulation (`ckptune.alloc-replay/1`).
//!
//! A trace holds the `PYTORCH_CUDA_ALLOC_CONF` it was recorded under, the device capacity if
//! known, and the events in order, each a short array: `["a", id, bytes, stream]` (an
//! allocation; `stream` may be left out for the default stream 0), `["f", id]` (a free),
//! `["e"]` (`torch.cuda.empty_cache()`) and `["m", name]` (a mark: a named moment of the step
//! starts).

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::FormatError;
use crate::caching_allocator::{Replay, Snapshot, SpanPeaks, Stat, Stats, TraceEvent};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AllocTraceJson {
    pub format: String,
    /// The allocator configuration the trace ran under ("": PyTorch's defaults).
    #[serde(default)]
    pub alloc_conf: String,
    /// What cudaMalloc could hand out, when known; without it the device never runs out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_bytes: Option<u64>,
    #[serde(with = "events_json")]
    pub events: Vec<TraceEvent>,
}

/// The state after an event: allocated, reserved, active and requested bytes, cudaMalloc'd
/// segments, largest cached free block (the order of `EveryEventJson::columns`).
pub const EVERY_EVENT_COLUMNS: [&str; 6] = [
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "requested_bytes",
    "segments",
    "largest_free_block",
];

/// `ckptune simulate-allocator`'s result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AllocReplayJson {
    pub format: String,
    pub trace: String,
    pub alloc_conf: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_bytes: Option<u64>,
    /// Events in the trace, and how many were replayed (fewer when it stopped).
    pub events: usize,
    pub replayed: usize,
    pub spans: Vec<AllocSpanJson>,
    /// The statistics at the end, peaks since the last mark.
    pub stats: AllocStatsJson,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped: Option<AllocStopJson>,
    /// With `--every-event`: one row per replayed event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every_event: Option<EveryEventJson>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AllocSpanJson {
    pub name: String,
    pub first_event: usize,
    pub end_event: usize,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub peak_active_bytes: u64,
    pub peak_requested_bytes: u64,
    pub end: AllocSnapshotJson,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AllocSnapshotJson {
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
    pub active_bytes: u64,
    pub requested_bytes: u64,
    pub segments: u64,
    pub largest_free_block: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatJson {
    pub current: u64,
    pub peak: u64,
}

/// `torch.cuda.memory_stats()`'s `.all.` statistics, named as it names them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AllocStatsJson {
    pub allocated_bytes: StatJson,
    pub reserved_bytes: StatJson,
    pub active_bytes: StatJson,
    pub requested_bytes: StatJson,
    pub inactive_split_bytes: StatJson,
    pub allocation: StatJson,
    pub active: StatJson,
    pub segment: StatJson,
    pub inactive_split: StatJson,
    pub oversize_allocations: StatJson,
    pub oversize_segments: StatJson,
    pub num_alloc_retries: u64,
    pub num_ooms: u64,
    pub num_oom_rejections: u64,
    pub num_device_alloc: u64,
    pub num_device_free: u64,
    pub largest_free_block: u64,
}

/// Where the replay stopped: an out-of-memory error, with PyTorch's message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AllocStopJson {
    pub event: usize,
    pub error: String,
    pub out_of_memory: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EveryEventJson {
    /// [`EVERY_EVENT_COLUMNS`].
    pub columns: Vec<String>,
    pub rows: Vec<[u64; 6]>,
}

impl AllocReplayJson {
    /// The document of `replay` of trace `trace` (shown as given), with every event's state
    /// when `every_event`.
    pub fn new(trace: &str, conf: &str, capacity: Option<u64>, events: usize, r: &Replay, every_event: bool) -> Self {
        AllocReplayJson {
            format: super::ALLOC_REPLAY_FORMAT.to_string(),
            trace: trace.to_string(),
            alloc_conf: conf.to_string(),
            capacity_bytes: capacity,
            events,
            replayed: r.after_event.len(),
            spans: r.spans.iter().map(AllocSpanJson::from).collect(),
            stats: AllocStatsJson::from(&r.stats),
            stopped: r.stopped.as_ref().map(|s| AllocStopJson {
                event: s.event,
                error: s.error.to_string(),
                out_of_memory: matches!(s.error, crate::caching_allocator::SimError::OutOfMemory(_)),
            }),
            every_event: every_event.then(|| EveryEventJson {
                columns: EVERY_EVENT_COLUMNS.iter().map(|c| c.to_string()).collect(),
                rows: r.after_event.iter().map(row).collect(),
            }),
        }
    }
}

fn row(s: &Snapshot) -> [u64; 6] {
    [
        s.allocated_bytes,
        s.reserved_bytes,
        s.active_bytes,
        s.requested_bytes,
        s.segments,
        s.largest_free_block,
    ]
}

impl From<&Snapshot> for AllocSnapshotJson {
    fn from(s: &Snapshot) -> Self {
        AllocSnapshotJson {
            allocated_bytes: s.allocated_bytes,
            reserved_bytes: s.reserved_bytes,
            active_bytes: s.active_bytes,
            requested_bytes: s.requested_bytes,
            segments: s.segments,
            largest_free_block: s.largest_free_block,
        }
    }
}

impl From<&SpanPeaks> for AllocSpanJson {
    fn from(s: &SpanPeaks) -> Self {
        AllocSpanJson {
            name: s.name.clone(),
            first_event: s.first_event,
            end_event: s.end_event,
            peak_allocated_bytes: s.peak_allocated_bytes,
            peak_reserved_bytes: s.peak_reserved_bytes,
            peak_active_bytes: s.peak_active_bytes,
            peak_requested_bytes: s.peak_requested_bytes,
            end: AllocSnapshotJson::from(&s.end),
        }
    }
}

impl From<Stat> for StatJson {
    fn from(s: Stat) -> Self {
        StatJson {
            current: s.current,
            peak: s.peak,
        }
    }
}

impl From<&Stats> for AllocStatsJson {
    fn from(s: &Stats) -> Self {
        AllocStatsJson {
            allocated_bytes: s.allocated_bytes.into(),
            reserved_bytes: s.reserved_bytes.into(),
            active_bytes: s.active_bytes.into(),
            requested_bytes: s.requested_bytes.into(),
            inactive_split_bytes: s.inactive_split_bytes.into(),
            allocation: s.allocation.into(),
            active: s.active.into(),
            segment: s.segment.into(),
            inactive_split: s.inactive_split.into(),
            oversize_allocations: s.oversize_allocations.into(),
            oversize_segments: s.oversize_segments.into(),
            num_alloc_retries: s.num_alloc_retries,
            num_ooms: s.num_ooms,
            num_oom_rejections: s.num_oom_rejections,
            num_device_alloc: s.num_device_alloc,
            num_device_free: s.num_device_free,
            largest_free_block: s.largest_free_block,
        }
    }
}

/// The replay document as text: pretty, except with every event's rows, where one row per
/// line of pretty JSON would make a million-event trace several hundred megabytes.
pub fn replay_text(doc: &AllocReplayJson) -> Result<String, FormatError> {
    let text = if doc.every_event.is_some() {
        serde_json::to_string(doc)
    } else {
        serde_json::to_string_pretty(doc)
    };
    text.map_err(|e| FormatError::Write {
        path: "a replay document".into(),
        source: std::io::Error::other(e),
    })
}

/// Writes the replay document atomically, as [`replay_text`] words it.
pub fn write_replay(path: &Path, doc: &AllocReplayJson) -> Result<(), FormatError> {
    let mut text = replay_text(doc)?;
    text.push('\n');
    super::write_bytes_atomic(path, text.as_bytes())
}

/// Writes a trace atomically, one line of JSON (a step's trace has up to millions of events).
pub fn write_trace(path: &Path, doc: &AllocTraceJson) -> Result<(), FormatError> {
    let mut text = serde_json::to_string(doc).map_err(|e| FormatError::Write {
        path: path.display().to_string(),
        source: std::io::Error::other(e),
    })?;
    text.push('\n');
    super::write_bytes_atomic(path, text.as_bytes())
}

/// Events as the short arrays of the module docs.
mod events_json {
    use serde::de::{self, IgnoredAny, SeqAccess, Visitor};
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use super::fmt;
    use crate::caching_allocator::TraceEvent;

    struct Out<'a>(&'a TraceEvent);

    impl Serialize for Out<'_> {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            match self.0 {
                TraceEvent::Alloc { id, bytes, stream } => ("a", id, bytes, stream).serialize(s),
                TraceEvent::Free { id } => ("f", id).serialize(s),
                TraceEvent::EmptyCache => ("e",).serialize(s),
                TraceEvent::Mark(name) => ("m", name).serialize(s),
            }
        }
    }

    struct In(TraceEvent);

    impl<'de> Deserialize<'de> for In {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_seq(EventVisitor)
        }
    }

    struct EventVisitor;

    const EXPECTED: &str = r#"an event: ["a", id, bytes, stream], ["f", id], ["e"] or ["m", name]"#;

    impl<'de> Visitor<'de> for EventVisitor {
        type Value = In;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(EXPECTED)
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<In, A::Error> {
            let op: String = next(&mut seq, 0)?;
            let event = match op.as_str() {
                "a" => TraceEvent::Alloc {
                    id: next(&mut seq, 1)?,
                    bytes: next(&mut seq, 2)?,
                    stream: seq.next_element()?.unwrap_or(0),
                },
                "f" => TraceEvent::Free { id: next(&mut seq, 1)? },
                "e" => TraceEvent::EmptyCache,
                "m" => TraceEvent::Mark(next(&mut seq, 1)?),
                other => return Err(de::Error::invalid_value(de::Unexpected::Str(other), &EXPECTED)),
            };
            if seq.next_element::<IgnoredAny>()?.is_some() {
                return Err(de::Error::custom(format!(
                    "too many values in a {op:?} event; expected {EXPECTED}"
                )));
            }
            Ok(In(event))
        }
    }

    fn next<'de, T: Deserialize<'de>, A: SeqAccess<'de>>(seq: &mut A, at: usize) -> Result<T, A::Error> {
        seq.next_element()?
            .ok_or_else(|| de::Error::invalid_length(at, &EXPECTED))
    }

    pub fn serialize<S: Serializer>(events: &[TraceEvent], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(events.iter().map(Out))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<TraceEvent>, D::Error> {
        Ok(Vec::<In>::deserialize(d)?.into_iter().map(|e| e.0).collect())
    }
}
