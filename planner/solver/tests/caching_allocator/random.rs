//! Randomized checks against references computed independently of the allocator's counters.

use super::*;
use ckptune_solver::caching_allocator::SegmentInfo;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const CONFIGS: [&str; 6] = [
    "",
    "max_split_size_mb:24",
    "roundup_power2_divisions:[1:4,16:2,>:8]",
    "expandable_segments:True",
    "expandable_segments:True,large_segment_size_mb:12",
    "max_split_size_mb:30,max_non_split_rounding_mb:30,roundup_power2_divisions:2",
];

/// A size drawn to hit every pool and segment rule: tiny, small, 1–10 MiB, large.
fn size(rng: &mut StdRng, small_only: bool) -> u64 {
    match rng.random_range(0..if small_only { 2 } else { 5 }) {
        0 => rng.random_range(1..4 * KIB),
        1 => rng.random_range(1..=MIB),
        2 => rng.random_range(MIB..10 * MIB),
        3 => rng.random_range(10 * MIB..64 * MIB),
        _ => [0, 512, 20 * MIB, 40 * MIB][rng.random_range(0..4)],
    }
}

/// A trace of allocations, frees and the odd empty_cache over up to three streams.
fn trace(seed: u64, steps: usize, small_only: bool) -> Vec<TraceEvent> {
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut live, mut next, mut out) = (Vec::new(), 0u64, Vec::new());
    for _ in 0..steps {
        let roll = rng.random_range(0..100);
        if roll < 2 {
            out.push(TraceEvent::EmptyCache);
        } else if roll < 45 && !live.is_empty() {
            let id = live.swap_remove(rng.random_range(0..live.len()));
            out.push(TraceEvent::Free { id });
        } else {
            next += 1;
            live.push(next);
            let (bytes, stream) = (size(&mut rng, small_only), rng.random_range(0..3));
            out.push(TraceEvent::Alloc {
                id: next,
                bytes,
                stream,
            });
        }
    }
    out.extend(live.into_iter().map(|id| TraceEvent::Free { id }));
    out.push(TraceEvent::EmptyCache);
    out
}

/// round_size by search instead of bit tricks: the smallest candidate at least `size` —
/// multiples of 512, or with d > 1 divisions and size > 512·d, the d equal steps of
/// size's power-of-two interval.
fn reference_round(size: u64, c: &AllocatorConfig) -> u64 {
    let multiple = size.max(1).div_ceil(512) * 512;
    let d = c.roundup_power2_divisions_for(size);
    if d <= 1 || size <= 512 * d || size.is_power_of_two() {
        return multiple;
    }
    let floor = 1u64 << size.ilog2();
    let step = floor / d;
    (0..=d).map(|k| floor + k * step).find(|v| *v >= size).unwrap()
}

fn check_layout(segments: &[SegmentInfo]) {
    let mut end_of_previous = 0;
    for seg in segments {
        assert!(seg.address >= end_of_previous, "segments overlap");
        let mut at = seg.address;
        for b in &seg.blocks {
            assert_eq!(b.address, at, "blocks of a segment are contiguous");
            assert!(b.size > 0 && b.size % 512 == 0, "block sizes are multiples of 512");
            at += b.size;
        }
        assert_eq!(at - seg.address, seg.total_size);
        end_of_previous = at;
    }
}

/// After every event: the counters against sums over the segment layout and the live
/// requests, and the layout itself.
fn check(s: &Simulator, live: &std::collections::BTreeMap<u64, u64>, config: &AllocatorConfig) {
    let st = s.stats();
    let segments = s.memory_snapshot();
    check_layout(&segments);
    let blocks = || segments.iter().flat_map(|seg| seg.blocks.iter().map(move |b| (seg, b)));
    let allocated: u64 = blocks().filter(|(_, b)| b.allocated).map(|(_, b)| b.size).sum();
    let live_blocks: u64 = live.keys().map(|id| s.block_size(*id).unwrap()).sum();
    assert_eq!(st.allocated_bytes.current, allocated);
    assert_eq!(st.allocated_bytes.current, live_blocks);
    assert_eq!(st.active_bytes.current, allocated);
    assert_eq!(st.requested_bytes.current, live.values().sum::<u64>());
    assert_eq!(st.allocation.current, live.values().filter(|b| **b > 0).count() as u64);
    assert_eq!(
        st.reserved_bytes.current,
        segments.iter().map(|seg| seg.total_size).sum::<u64>()
    );
    let cudamalloc = segments.iter().filter(|seg| !seg.is_expandable).count() as u64;
    assert_eq!(st.segment.current, cudamalloc);
    let largest = blocks().filter(|(_, b)| !b.allocated).map(|(_, b)| b.size).max();
    assert_eq!(st.largest_free_block, largest.unwrap_or(0));
    let inactive_split: u64 = blocks()
        .filter(|(seg, b)| !seg.is_expandable && seg.blocks.len() > 1 && !b.allocated)
        .map(|(_, b)| b.size)
        .sum();
    assert_eq!(st.inactive_split_bytes.current, inactive_split);
    for (id, bytes) in live {
        let block = s.block_size(*id).unwrap();
        let rounded = if *bytes == 0 {
            0
        } else {
            reference_round(*bytes, config)
        };
        assert!(block >= rounded, "a block holds its rounded request");
        if config.expandable_segments {
            assert_eq!(
                block, rounded,
                "expandable segments split every remainder of 512 or more"
            );
        }
    }
}

/// Replays `events`, checking after each; returns allocated bytes after each event.
fn run(events: &[TraceEvent], conf: &str) -> Vec<u64> {
    let config = AllocatorConfig::parse(conf).unwrap();
    let mut s = Simulator::new(config.clone(), None).unwrap();
    let mut live = std::collections::BTreeMap::new();
    let mut allocated = Vec::new();
    for e in events {
        match e {
            TraceEvent::Alloc { id, bytes, stream } => {
                s.malloc(*id, *bytes, *stream).unwrap();
                live.insert(*id, *bytes);
            }
            TraceEvent::Free { id } => {
                s.free(*id).unwrap();
                live.remove(id);
            }
            TraceEvent::EmptyCache => s.empty_cache(),
            TraceEvent::Mark(_) => {}
        }
        check(&s, &live, &config);
        allocated.push(s.stats().allocated_bytes.current);
    }
    let st = s.stats();
    assert_eq!(
        (st.reserved_bytes.current, st.segment.current),
        (0, 0),
        "{conf}: all returned"
    );
    allocated
}

#[test]
fn counters_match_the_layout_on_random_traces() {
    for seed in 0..12 {
        let events = trace(seed, 400, false);
        for conf in CONFIGS {
            run(&events, conf);
        }
    }
}

#[test]
fn expandable_allocates_what_blocks_allocate_on_small_traces() {
    // should_split is the same in the small pool with or without expandable segments
    // (remaining ≥ 512), so allocated bytes agree event by event; in the large pool
    // they need not (a cudaMalloc'd block keeps a remainder of up to 1 MiB).
    for seed in 100..110 {
        let events = trace(seed, 400, true);
        assert_eq!(
            run(&events, ""),
            run(&events, "expandable_segments:True"),
            "seed {seed}"
        );
    }
}

#[test]
fn rounding_matches_the_reference_search() {
    let mut rng = StdRng::seed_from_u64(7);
    for conf in CONFIGS {
        let c = AllocatorConfig::parse(conf).unwrap();
        for _ in 0..5000 {
            let bits = rng.random_range(1..36);
            let bytes = rng.random_range(1..1u64 << bits);
            assert_eq!(round_size(bytes, &c), reference_round(bytes, &c), "{conf}: {bytes}");
        }
    }
}
