//! Which `PYTORCH_CUDA_ALLOC_CONF` to recommend for a trace (the lowest reserved peak, or the
//! expandable setting near it): the trace replayed
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

/// How far under `expandable_segments:True`'s predicted reserved peak, in percent of its own,
/// another setting's must be to be recommended instead. Under the other settings the reserved
/// bytes depend on the order of allocations and on which of equally good free blocks the
/// allocator takes (it breaks ties by address), which a step traced here does not always share
/// with PyTorch's: on an H200 two plans whose default-setting prediction was 1.9% and 6.2% under
/// the expandable setting's reserved 9.3% and 13.8% more than that under the default, while
/// every run under the expandable setting, one segment that grows, came within 0.88%
/// (results/gpu/README.md).
pub const EXPANDABLE_MARGIN_PERCENT: u64 = 15;

/// The peaks of `events` under each of `confs` (on a device that never runs out), in the
/// order given, and the index of the one to recommend ([`recommended`]).
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
    let best = recommended(&out);
    Ok((out, best))
}

/// The setting to recommend among `peaks`: the lowest reserved peak (the first of equals), but
/// `expandable_segments:True` wherever its peak is within [`EXPANDABLE_MARGIN_PERCENT`] of that one.
pub fn recommended(peaks: &[ConfPeaks]) -> usize {
    let lowest = (0..peaks.len())
        .min_by_key(|&i| (peaks[i].reserved_peak, i))
        .unwrap_or(0);
    let within = |p: &ConfPeaks| {
        u128::from(p.reserved_peak) * 100
            <= u128::from(peaks[lowest].reserved_peak) * u128::from(100 + EXPANDABLE_MARGIN_PERCENT)
    };
    match peaks.iter().position(|p| p.conf == EXPANDABLE) {
        Some(e) if within(&peaks[e]) => e,
        _ => lowest,
    }
}

const EXPANDABLE: &str = "expandable_segments:True";

#[cfg(test)]
mod tests {
    use super::*;

    fn peaks(reserved: &[(&str, u64)]) -> Vec<ConfPeaks> {
        reserved
            .iter()
            .map(|&(conf, reserved_peak)| ConfPeaks {
                conf: conf.into(),
                allocated_peak: 0,
                reserved_peak,
            })
            .collect()
    }

    #[test]
    fn the_expandable_setting_is_recommended_within_the_margin_of_the_lowest_peak() {
        // 15% over the default's peak is within the margin; one byte more is not.
        let at_margin = peaks(&[("", 100_000), (EXPANDABLE, 115_000), ("max_split_size_mb:256", 120_000)]);
        assert_eq!(recommended(&at_margin), 1);
        let beyond = peaks(&[("", 100_000), (EXPANDABLE, 115_001), ("max_split_size_mb:256", 120_000)]);
        assert_eq!(recommended(&beyond), 0);
        // The lowest wins where it is the expandable setting itself, and the first of equals
        // where the expandable setting is not a candidate.
        assert_eq!(recommended(&peaks(&[("", 100), (EXPANDABLE, 90)])), 1);
        assert_eq!(
            recommended(&peaks(&[("", 100), ("roundup_power2_divisions:4", 100)])),
            0
        );
        assert_eq!(recommended(&peaks(&[("", 100), ("roundup_power2_divisions:4", 99)])), 1);
    }
}
