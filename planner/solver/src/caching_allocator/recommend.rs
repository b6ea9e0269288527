//! Which `PYTORCH_CUDA_ALLOC_CONF` gives a trace the lowest reserved peak: the trace replayed
//! under each of a small set of settings (docs/cuda-allocator.md, "Recommending a setting").

use super::config::{AllocatorConfig, ConfigError};
use super::replay::{replay, TraceEvent};

/// The settings a plan chooses among, PyTorch's defaults first: the allocator's documented
/// remedies for fragmentation. `expandable_segments` grows one segment instead of caching
/// many; `roundup_power2_divisions` rounds requests to fewer sizes, so freed blocks fit later
/// requests; `max_split_size_mb` keeps large cached blocks whole for large requests.
pub const CANDIDATE_CONFS: [&str; 4] = [
    "",
    "expandable_segments:True",
    "roundup_power2_divisions:4",
    "max_split_size_mb:256",
];

/// A trace's peaks under one setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfPeaks {
    pub conf: String,
    pub allocated_peak: u64,
    pub reserved_peak: u64,
}

/// The peaks of `events` under each of `confs` (on a device that never runs out), in the
/// order given, and the index of the lowest reserved peak (the first of equals).
pub fn peaks_by_conf(events: &[TraceEvent], confs: &[&str]) -> Result<(Vec<ConfPeaks>, usize), ConfigError> {
    let mut out = Vec::with_capacity(confs.len());
    for conf in confs {
        let r = replay(events, AllocatorConfig::parse(conf)?, None)?;
        out.push(ConfPeaks {
            conf: conf.to_string(),
            allocated_peak: r.after_event.iter().map(|s| s.allocated_bytes).max().unwrap_or(0),
            reserved_peak: r.after_event.iter().map(|s| s.reserved_bytes).max().unwrap_or(0),
        });
    }
    let best = (0..out.len()).min_by_key(|&i| (out[i].reserved_peak, i)).unwrap_or(0);
    Ok((out, best))
}
