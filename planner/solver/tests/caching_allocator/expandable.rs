//! Expandable segments: pages mapped and unmapped, and best fit among blocks that can grow.

use super::*;

#[test]
fn expandable_segments_map_pages() {
    // expandable_segments:True — try_allocate_expandable_block / map_block: the large pool's
    // segment grows in 20 MiB pages; reserved bytes are the mapped pages, segment count 0.
    let mut s = sim("expandable_segments:True", None);
    alloc(&mut s, 1, 5 * MIB); // maps page 0: [0, 20); A = [0, 5), free [5, 20)
    assert_eq!(levels(&s), (5 * MIB, 20 * MIB, 0, 15 * MIB));
    // 30 MiB: no cached block fits; find_expandable_block starts at the free [5, 20) before the
    // unmapped tail, maps 15 MiB more (one page, [20, 40)), merges: [5, 40); B = [5, 35).
    // Without expandable segments B would be a new 30 MiB segment (reserved 50).
    alloc(&mut s, 2, 30 * MIB);
    assert_eq!(levels(&s), (35 * MIB, 40 * MIB, 0, 5 * MIB));
    free(&mut s, 1);
    // empty_cache → unmap_block: no page lies wholly inside [0, 5) or [35, 40).
    s.empty_cache();
    assert_eq!(levels(&s), (30 * MIB, 40 * MIB, 0, 5 * MIB));
    free(&mut s, 2); // [0, 40) free: both pages unmapped, the segment released
    s.empty_cache();
    assert_eq!(levels(&s), (0, 0, 0, 0));
    let st = s.stats();
    assert_eq!((st.num_device_alloc, st.num_device_free), (2, 1));
    assert_eq!(st.inactive_split_bytes.peak, 0); // expandable blocks are left out of it
}

#[test]
fn expandable_segments_small_pool_maps_2mib_pages() {
    // find_expandable_block: the small pool's segment maps kSmallBuffer (2 MiB) pages.
    let mut s = sim("expandable_segments:True", None);
    alloc(&mut s, 1, 100 * KIB);
    assert_eq!(levels(&s), (100 * KIB, 2 * MIB, 0, 2 * MIB - 100 * KIB));
    alloc(&mut s, 2, MIB); // 1.9 MiB free at the tail: 1 MiB fits, nothing mapped
    alloc(&mut s, 3, MIB); // 0.9 MiB left + one more 2 MiB page
    assert_eq!(levels(&s), (2 * MIB + 100 * KIB, 4 * MIB, 0, 2 * MIB - 100 * KIB));
}

#[test]
fn expandable_best_fit_prefers_blocks_that_cannot_grow() {
    // get_free_block with expandable segments: a block ending at the unmapped tail counts as
    // what it could grow to, so the search moves past it to the next block of the stream.
    let mut s = sim("expandable_segments:True", None);
    alloc(&mut s, 1, 8 * MIB); // [0, 8), free [8, 20)
    alloc(&mut s, 2, 7 * MIB); // [8, 15), free tail block [15, 20)
    free(&mut s, 1); // free [0, 8), bounded by block 2
                     // 4 MiB: lower_bound finds the 5 MiB tail block, whose expandable size is 5 MiB + the
                     // unmapped rest; the 8 MiB block after it in size order can only be 8: take that.
    alloc(&mut s, 3, 4 * MIB);
    // Free: [4, 8) 4 MiB and the 5 MiB tail (taking the tail would have left 1 MiB and 8 MiB).
    assert_eq!(levels(&s), (11 * MIB, 20 * MIB, 0, 5 * MIB));
}
