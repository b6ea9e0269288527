//! Getting and returning device memory: `empty_cache`, `release_available_cached_blocks`, the
//! retries before an out-of-memory error and its figures, `per_process_memory_fraction`,
//! `throw_on_cudamalloc_oom` and garbage collection.

use super::*;

#[test]
fn empty_cache_releases_only_whole_free_segments() {
    // release_cached_blocks → release_blocks: cudaFree of cached blocks with no prev and no
    // next; a segment with a live block keeps its free part (inactive split).
    let mut s = sim("", None);
    alloc(&mut s, 1, 5 * MIB); // 20 MiB segment, split
    alloc(&mut s, 2, 30 * MIB); // 30 MiB segment
    free(&mut s, 2);
    s.empty_cache();
    let st = s.stats();
    assert_eq!(levels(&s), (5 * MIB, 20 * MIB, 1, 15 * MIB));
    assert_eq!((st.num_device_alloc, st.num_device_free), (2, 1));
    free(&mut s, 1);
    s.empty_cache();
    assert_eq!(levels(&s), (0, 0, 0, 0));
}

#[test]
fn release_available_cached_blocks_frees_one_large_enough_oversize_block() {
    // max_split_size_mb:40, capacity 180 MiB. The 30 MiB request cannot use the cached 60 MiB
    // block (oversize); cudaMalloc of 30 MiB fails (160 + 30 > 180);
    // release_available_cached_blocks looks up max(30, 40) = 40 MiB and frees the 60 MiB block;
    // the retry fits (100 + 30 ≤ 180). No final retry is counted.
    let mut s = sim("max_split_size_mb:40", Some(180 * MIB));
    alloc(&mut s, 1, 100 * MIB);
    alloc(&mut s, 2, 60 * MIB);
    free(&mut s, 1);
    free(&mut s, 2);
    alloc(&mut s, 3, 30 * MIB);
    assert_eq!(levels(&s), (30 * MIB, 130 * MIB, 2, 100 * MIB));
    assert_eq!(s.stats().num_alloc_retries, 0);
}

#[test]
fn release_available_cached_blocks_frees_several_from_the_largest() {
    // No single cached block reaches the 60 MiB key: from the largest down, 46 (46 < 60),
    // then 44 (90 ≥ 60) are freed; the retry fits: 50 (live) + 60 ≤ 150.
    let mut s = sim("max_split_size_mb:40", Some(150 * MIB));
    alloc(&mut s, 1, 44 * MIB);
    alloc(&mut s, 2, 46 * MIB);
    alloc(&mut s, 3, 50 * MIB);
    free(&mut s, 1);
    free(&mut s, 2);
    alloc(&mut s, 4, 60 * MIB); // 140 + 60 > 150 at first
    assert_eq!(levels(&s), (110 * MIB, 110 * MIB, 2, 0));
}

#[test]
fn release_cached_blocks_then_retry_before_out_of_memory() {
    // Without max_split_size, release_available_cached_blocks does nothing; then
    // release_cached_blocks (empty_cache) frees the cached 40 MiB segment and the final retry
    // (num_alloc_retries) fits 70 MiB in 100.
    let mut s = sim("", Some(100 * MIB));
    alloc(&mut s, 1, 40 * MIB);
    free(&mut s, 1);
    alloc(&mut s, 2, 70 * MIB);
    assert_eq!(levels(&s), (70 * MIB, 70 * MIB, 1, 0));
    assert_eq!(s.stats().num_alloc_retries, 1);
}

#[test]
fn out_of_memory_reports_pytorchs_figures() {
    // 60 MiB live, 50 more in a 100 MiB device: nothing cached to release, the final retry
    // fails: OOM with allocated 60, reserved 60.
    let mut s = sim("", Some(100 * MIB));
    alloc(&mut s, 1, 60 * MIB);
    let e = oom(&mut s, 2, 50 * MIB);
    assert_eq!(
        (e.kind, e.tried_to_allocate, e.allocated_bytes, e.reserved_bytes),
        (OomKind::Device, 50 * MIB, 60 * MIB, 60 * MIB)
    );
    assert_eq!(
        e.to_string(),
        "CUDA out of memory. Tried to allocate 50.00 MiB. GPU 0 has a total capacity of 100.00 MiB of which \
         40.00 MiB is free. Of the allocated memory 60.00 MiB is allocated by PyTorch, and 0 bytes is reserved by \
         PyTorch but unallocated."
    );
    let st = s.stats();
    assert_eq!((st.num_ooms, st.num_alloc_retries), (1, 1));

    // A split segment with a live block cannot be released: 5 MiB live in a 20 MiB segment,
    // 26 MiB more do not fit in 40; "Tried to allocate" is the segment, 26 MiB.
    let mut s = sim("", Some(40 * MIB));
    alloc(&mut s, 1, 5 * MIB);
    alloc(&mut s, 2, 5 * MIB);
    free(&mut s, 1);
    let e = oom(&mut s, 3, 25 * MIB + 1);
    assert_eq!(
        (e.tried_to_allocate, e.allocated_bytes, e.reserved_bytes),
        (26 * MIB, 5 * MIB, 20 * MIB)
    );
    assert!(
        e.to_string()
            .contains("15.00 MiB is reserved by PyTorch but unallocated"),
        "{e}"
    );
}

#[test]
fn per_process_memory_fraction_limits_reserved() {
    // setMemoryFraction(0.5) of 100 MiB: allowed_memory_maximum 50 MiB; alloc_block refuses
    // 40 + 20 > 50 even though the device has room.
    let mut s = sim("per_process_memory_fraction:0.5", Some(100 * MIB));
    alloc(&mut s, 1, 40 * MIB);
    let e = oom(&mut s, 2, 20 * MIB);
    assert_eq!(e.allowed, Some(50 * MIB));
    assert!(e.to_string().contains(" 50.00 MiB allowed;"), "{e}");
}

#[test]
fn throw_on_cudamalloc_oom_rejects_without_releasing() {
    // alloc_block with throw_on_cudamalloc_oom: 60 cached + 70 > 1.0 × 100 MiB → rejected at
    // once (num_oom_rejections), the retry chain skipped: the cached 60 MiB stay reserved.
    let mut s = sim("throw_on_cudamalloc_oom:True", Some(100 * MIB));
    alloc(&mut s, 1, 60 * MIB);
    free(&mut s, 1);
    let e = oom(&mut s, 2, 70 * MIB);
    assert_eq!(e.kind, OomKind::Rejected);
    let st = s.stats();
    assert_eq!(
        (st.reserved_bytes.current, st.num_oom_rejections, st.num_ooms),
        (60 * MIB, 1, 0)
    );
    // Without it, release_cached_blocks frees the 60 MiB and the retry succeeds.
    let mut s = sim("", Some(100 * MIB));
    alloc(&mut s, 1, 60 * MIB);
    free(&mut s, 1);
    alloc(&mut s, 2, 70 * MIB);
    assert_eq!(levels(&s), (70 * MIB, 70 * MIB, 1, 0));
}

#[test]
fn garbage_collection_frees_the_oldest_cached_segments() {
    // per_process_memory_fraction 0.5 of 400 MiB: allowed 200 MiB; threshold 0.5 → collect
    // when reserved > 100 MiB. get_free_block ticks the large pool's clock on every search.
    let conf = "per_process_memory_fraction:0.5,garbage_collection_threshold:0.5";
    let mut s = sim(conf, Some(400 * MIB));
    alloc(&mut s, 1, 30 * MIB); // clock 1, reserved 30
    alloc(&mut s, 2, 30 * MIB); // clock 2, reserved 60
    free(&mut s, 1); // A cached at clock 2
    alloc(&mut s, 3, 32 * MIB); // clock 3, 30 < 32: miss; 60 ≤ 100, no GC; reserved 92
    free(&mut s, 2); // B cached at clock 3
    alloc(&mut s, 4, 34 * MIB); // clock 4, miss, 92 ≤ 100; reserved 126
                                // clock 5, miss; 126 > 100: reclaim 26. Ages A 3, B 2, average 2.5: only A (30 MiB) goes,
                                // which is enough; then 96 + 36.
    alloc(&mut s, 5, 36 * MIB);
    assert_eq!(levels(&s), (102 * MIB, 132 * MIB, 4, 30 * MIB));
    // PyTorch collects only under a memory fraction: the same requests without one keep A.
    let mut s = sim("garbage_collection_threshold:0.5", Some(400 * MIB));
    for (id, mib) in [(1, 30), (2, 30)] {
        alloc(&mut s, id, mib * MIB);
    }
    free(&mut s, 1);
    alloc(&mut s, 3, 32 * MIB);
    free(&mut s, 2);
    alloc(&mut s, 4, 34 * MIB);
    alloc(&mut s, 5, 36 * MIB);
    assert_eq!(levels(&s), (102 * MIB, 162 * MIB, 5, 30 * MIB));
}
