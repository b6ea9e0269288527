//! Sizes, pools and blocks: `round_size` and `roundup_power2_divisions`, the small and large
//! pools and their segment sizes, best fit per stream, splitting and merging, and the oversize
//! rules of `max_split_size_mb`.

use super::*;

#[test]
fn round_size_rounds_to_k_min_block_size() {
    // round_size: below kMinBlockSize (512) → 512; else up to a multiple of 512.
    let mut s = sim("", None);
    for (id, bytes, block) in [
        (1, 1, 512),
        (2, 511, 512),
        (3, 512, 512),
        (4, 513, 1024),
        (5, 1000, 1024),
    ] {
        alloc(&mut s, id, bytes);
        assert_eq!(s.block_size(id), Some(block), "{bytes} bytes");
    }
    let st = s.stats();
    // All five share the small pool's first 2 MiB segment (each split off its front).
    assert_eq!(st.allocated_bytes.current, 512 + 512 + 512 + 1024 + 1024); // 3584
    assert_eq!(st.requested_bytes.current, 1 + 511 + 512 + 513 + 1000); // 2537, unrounded
    assert_eq!(st.reserved_bytes.current, 2 * MIB);
    assert_eq!(st.largest_free_block, 2 * MIB - 3584);
    assert_eq!(st.active_bytes.current, 3584);
}

#[test]
fn roundup_power2_divisions_single_value() {
    // roundup_power2_divisions:4 — every interval gets 4 divisions (parseRoundUpPower2Divisions).
    let c = AllocatorConfig::parse("roundup_power2_divisions:4").unwrap();
    // 1200 ≤ 512·4 = 2048: no power-of-two rounding, up to 512s → 1536.
    assert_eq!(round_size(1200, &c), 1536);
    // 3000 > 2048: between 2048 and 4096 in steps of 512 → 3072 (roundup_power2_next_division).
    assert_eq!(round_size(3000, &c), 3072);
    // 5 MiB + 1: between 4 and 8 MiB in steps of 1 MiB → 6 MiB.
    assert_eq!(round_size(5 * MIB + 1, &c), 6 * MIB);
    // 3 MiB is on a division (2 MiB + 2·512 KiB) and stays; a power of two stays.
    assert_eq!(round_size(3 * MIB, &c), 3 * MIB);
    assert_eq!(round_size(8 * MIB, &c), 8 * MIB);
    // Without the setting: 5 MiB + 1 → 5 MiB + 512.
    assert_eq!(round_size(5 * MIB + 1, &AllocatorConfig::default()), 5 * MIB + 512);
}

#[test]
fn roundup_power2_divisions_per_interval() {
    // [256:1,512:2,>:8]: index log2(256) = 8 gets 1 and, being the first named, so do 0..8;
    // index 9 ([512 MiB, 1 GiB)) gets 2; '>' fills 10..16 with 8.
    let c = AllocatorConfig::parse("roundup_power2_divisions:[256:1,512:2,>:8]").unwrap();
    assert_eq!(
        c.roundup_power2_divisions,
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 8, 8, 8, 8, 8, 8]
    );
    // 300 MiB + 1 is in interval 8: one division, so up to 512s.
    assert_eq!(round_size(300 * MIB + 1, &c), 300 * MIB + 512);
    // 600 MiB + 1 is in [512 MiB, 1 GiB) with 2 divisions of 256 MiB → 768 MiB.
    assert_eq!(round_size(600 * MIB + 1, &c), 768 * MIB);
    // 1.5 GiB + 1 is in [1 GiB, 2 GiB) with 8 divisions of 128 MiB → 1664 MiB.
    assert_eq!(round_size(1536 * MIB + 1, &c), 1664 * MIB);
    // A '>' before any interval fills from index last_index + 1 = 1, leaving index 0 at 0.
    let c = AllocatorConfig::parse("roundup_power2_divisions:[>:2]").unwrap();
    assert_eq!(c.roundup_power2_divisions[0], 0);
    assert_eq!(round_size(MIB + MIB / 2 + 1, &c), MIB + MIB / 2 + 512);
    // 3 MiB + 1 is in interval 1 with 2 divisions of 1 MiB → 4 MiB.
    assert_eq!(round_size(3 * MIB + 1, &c), 4 * MIB);
}

#[test]
fn pools_and_segment_sizes() {
    // get_pool: rounded size ≤ kSmallSize (1 MiB) → small pool; get_allocation_size:
    // small → kSmallBuffer (2 MiB); < kMinLargeAlloc (10 MiB) → kLargeBuffer (20 MiB);
    // otherwise rounded up to kRoundLarge (2 MiB). One request on a fresh allocator each.
    for (bytes, segment) in [
        (MIB, 2 * MIB),           // exactly 1 MiB: small
        (MIB + 1, 20 * MIB),      // 1 MiB + 512 after rounding: large, shared 20 MiB
        (9 * MIB, 20 * MIB),      // below 10 MiB
        (10 * MIB - 1, 10 * MIB), // rounds to 10 MiB, not below kMinLargeAlloc
        (11 * MIB + 1, 12 * MIB), // 11 MiB + 512 up to 2 MiB
        (100 * MIB, 100 * MIB),   // already a multiple of 2 MiB
    ] {
        let mut s = sim("", None);
        alloc(&mut s, 1, bytes);
        let st = s.stats();
        assert_eq!(st.reserved_bytes.current, segment, "{bytes} bytes");
        assert_eq!(st.segment.current, 1);
    }
}

#[test]
fn large_segment_size_mb_sets_the_shared_segment() {
    // large_segment_size_mb:32 → get_allocation_size gives 32 MiB for requests of 1–10 MiB.
    let mut s = sim("large_segment_size_mb:32", None);
    alloc(&mut s, 1, 5 * MIB);
    assert_eq!(levels(&s), (5 * MIB, 32 * MIB, 1, 27 * MIB));
}

#[test]
fn best_fit_per_stream() {
    // get_free_block: lower_bound over (stream, size, address) → the smallest cached block of
    // the same stream at least as large; other streams' blocks are never used.
    let mut s = sim("", None);
    for (id, mib) in [(1, 12), (2, 16), (3, 14)] {
        alloc(&mut s, id, mib * MIB); // segments of 12, 16, 14 MiB
    }
    for id in [1, 2, 3] {
        free(&mut s, id);
    }
    assert_eq!(levels(&s), (0, 42 * MIB, 3, 16 * MIB));
    // 13 MiB: best fit is the 14 MiB block; 1 MiB would remain, not > kSmallSize: no split.
    alloc(&mut s, 4, 13 * MIB);
    assert_eq!(s.block_size(4), Some(14 * MIB));
    assert_eq!(levels(&s), (14 * MIB, 42 * MIB, 3, 16 * MIB));
    // 12 MiB on stream 1: stream 0's free 12 MiB block is not reused, a new segment is made.
    s.malloc(5, 12 * MIB, 1).unwrap();
    assert_eq!(levels(&s), (26 * MIB, 54 * MIB, 4, 16 * MIB));
    // 12 MiB on stream 0 does take it.
    alloc(&mut s, 6, 12 * MIB);
    assert_eq!(levels(&s), (38 * MIB, 54 * MIB, 4, 16 * MIB));
}

#[test]
fn should_split_remainders() {
    // should_split, large pool: request < max_split_size and remaining > kSmallSize (1 MiB).
    let mut s = sim("", None);
    alloc(&mut s, 1, 19 * MIB); // segment 20 MiB; 1 MiB would remain: not > 1 MiB, no split
    assert_eq!(s.block_size(1), Some(20 * MIB));
    assert_eq!(s.stats().inactive_split_bytes.current, 0);

    let mut s = sim("", None);
    alloc(&mut s, 1, 5 * MIB); // 20 MiB segment, 15 MiB remain > 1 MiB: split
    let st = s.stats();
    assert_eq!((st.allocated_bytes.current, st.largest_free_block), (5 * MIB, 15 * MIB));
    // alloc_found_block: a new split inactive block of 15 MiB.
    assert_eq!(
        (st.inactive_split_bytes.current, st.inactive_split.current),
        (15 * MIB, 1)
    );
    // 13.5 MiB from the 15 MiB block leaves 1.5 MiB > 1 MiB: split again; the inactive split
    // block shrinks by 13.5 MiB.
    alloc(&mut s, 2, 14 * MIB - 512 * KIB);
    let st = s.stats();
    assert_eq!(st.allocated_bytes.current, 5 * MIB + 14 * MIB - 512 * KIB);
    assert_eq!(
        (st.inactive_split_bytes.current, st.inactive_split.current),
        (MIB + 512 * KIB, 1)
    );

    // Small pool: split when at least kMinBlockSize (512) remains.
    let mut s = sim("", None);
    alloc(&mut s, 1, MIB); // 2 MiB segment, 1 MiB left
    alloc(&mut s, 2, MIB - 512); // from the 1 MiB block: 512 remain ≥ 512, split
    assert_eq!(s.block_size(2), Some(MIB - 512));
    assert_eq!(s.stats().largest_free_block, 512);
    alloc(&mut s, 3, 512); // exactly the last 512 bytes
    assert_eq!(levels(&s), (2 * MIB, 2 * MIB, 1, 0));
}

#[test]
fn free_merges_neighbours() {
    // free_block → try_merge_blocks with the previous and the next block when they are free.
    let mut s = sim("", None);
    for id in [1, 2, 3] {
        alloc(&mut s, id, 256 * KIB); // a, b, c from one 2 MiB segment; 1.25 MiB free after them
    }
    let split = |s: &Simulator| {
        let st = s.stats();
        (st.inactive_split_bytes.current, st.inactive_split.current)
    };
    assert_eq!(split(&s), (MIB + 256 * KIB, 1));
    free(&mut s, 2); // b: between a and c, both allocated: no merge
    assert_eq!(split(&s), (MIB + 512 * KIB, 2));
    assert_eq!(s.stats().largest_free_block, MIB + 256 * KIB);
    free(&mut s, 3); // c merges with b before it and the 1.25 MiB after: 1.75 MiB
    assert_eq!(split(&s), (MIB + 768 * KIB, 1));
    assert_eq!(s.stats().largest_free_block, MIB + 768 * KIB);
    free(&mut s, 1); // a merges with the rest: the whole segment, no longer split
    assert_eq!(split(&s), (0, 0));
    assert_eq!(levels(&s), (0, 2 * MIB, 1, 2 * MIB));
}

#[test]
fn max_split_size_oversize_blocks() {
    // max_split_size_mb:40. get_free_block: a request below 40 MiB never gets a cached block of
    // 40 MiB or more; should_split: a request of 40 MiB or more is never split off.
    let mut s = sim("max_split_size_mb:40", None);
    alloc(&mut s, 1, 50 * MIB);
    let st = s.stats();
    assert_eq!((st.oversize_segments.current, st.oversize_allocations.current), (1, 1));
    free(&mut s, 1);
    alloc(&mut s, 2, 30 * MIB); // the cached 50 MiB block is oversize: a new 30 MiB segment
    assert_eq!(levels(&s), (30 * MIB, 80 * MIB, 2, 50 * MIB));
    alloc(&mut s, 3, 45 * MIB); // 45 ≥ 40 and 50 < 45 + 20 (max_non_split_rounding): reused whole
    assert_eq!(s.block_size(3), Some(50 * MIB));
    assert_eq!(levels(&s), (80 * MIB, 80 * MIB, 2, 0));
    assert_eq!(s.stats().oversize_allocations.current, 1);
}

#[test]
fn oversize_block_not_used_for_much_smaller_request() {
    // get_free_block: for a request ≥ max_split_size, a cached block ≥ request +
    // max_non_split_rounding_size (default large_segment_size, kLargeBuffer = 20 MiB) is refused.
    let mut s = sim("max_split_size_mb:40", None);
    alloc(&mut s, 1, 100 * MIB);
    free(&mut s, 1);
    alloc(&mut s, 2, 45 * MIB); // 100 ≥ 45 + 20: refused, new segment of 46 MiB
    assert_eq!(levels(&s), (46 * MIB, 146 * MIB, 2, 100 * MIB));
    // With max_non_split_rounding_mb:60, 100 < 45 + 60: the cached block is taken whole.
    let mut s = sim("max_split_size_mb:40,max_non_split_rounding_mb:60", None);
    alloc(&mut s, 1, 100 * MIB);
    free(&mut s, 1);
    alloc(&mut s, 2, 45 * MIB);
    assert_eq!(levels(&s), (100 * MIB, 100 * MIB, 1, 0));
}
