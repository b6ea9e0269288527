//! Traces: sizes at the edges, mistakes in a trace, and a replay's span peaks up to an
//! out-of-memory stop.

use super::*;

#[test]
fn zero_bytes_and_one_exabyte() {
    // NativeCachingAllocator::allocate: size 0 allocates nothing; ≥ 1 EiB is refused outright.
    let mut s = sim("", None);
    alloc(&mut s, 1, 0);
    assert_eq!(levels(&s), (0, 0, 0, 0));
    free(&mut s, 1);
    let e = oom(&mut s, 2, 1 << 60);
    assert_eq!(e.kind, OomKind::OverOneExabyte);
    assert_eq!(
        e.to_string(),
        "CUDA out of memory. Tried to allocate more than 1EB memory."
    );
}

#[test]
fn trace_mistakes_are_errors() {
    let mut s = sim("", None);
    assert_eq!(s.free(7), Err(SimError::UnknownId { id: 7 }));
    alloc(&mut s, 7, 10);
    assert_eq!(s.malloc(7, 10, 0), Err(SimError::LiveId { id: 7 }));
}

#[test]
fn replay_gives_span_peaks_and_stops_at_out_of_memory() {
    let events = vec![
        TraceEvent::Alloc {
            id: 1,
            bytes: 30 * MIB,
            stream: 0,
        },
        TraceEvent::Mark("forward".into()),
        TraceEvent::Alloc {
            id: 2,
            bytes: 40 * MIB,
            stream: 0,
        },
        TraceEvent::Free { id: 2 },
        TraceEvent::Mark("backward".into()),
        TraceEvent::Alloc {
            id: 3,
            bytes: 20 * MIB,
            stream: 0,
        },
        TraceEvent::EmptyCache,
        TraceEvent::Alloc {
            id: 4,
            bytes: 200 * MIB,
            stream: 0,
        },
        TraceEvent::Free { id: 3 },
    ];
    let r = replay(&events, AllocatorConfig::default(), Some(100 * MIB)).unwrap();
    let names: Vec<_> = r.spans.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["start", "forward", "backward"]);
    // start: 30 MiB. forward: 30 + 40 allocated at the peak; reserved 70, kept after the free.
    assert_eq!(
        (r.spans[0].peak_allocated_bytes, r.spans[0].peak_reserved_bytes),
        (30 * MIB, 30 * MIB)
    );
    assert_eq!(
        (r.spans[1].peak_allocated_bytes, r.spans[1].peak_reserved_bytes),
        (70 * MIB, 70 * MIB)
    );
    assert_eq!((r.spans[1].first_event, r.spans[1].end_event), (2, 4));
    // backward: 20 MiB reuses the cached 40 MiB block (split: 20 remain > 1 MiB); empty_cache
    // cannot return the split segment; 200 MiB cannot fit in 100: stop at event 7.
    assert_eq!(
        (r.spans[2].peak_allocated_bytes, r.spans[2].peak_reserved_bytes),
        (50 * MIB, 70 * MIB)
    );
    assert_eq!(r.spans[2].end_event, 8);
    let stop = r.stopped.as_ref().expect("stops at the out-of-memory event");
    assert_eq!(stop.event, 7);
    assert!(matches!(stop.error, SimError::OutOfMemory(_)));
    assert_eq!(r.after_event.len(), 8);
    assert_eq!(
        r.after_event[3],
        Snapshot {
            allocated_bytes: 30 * MIB,
            reserved_bytes: 70 * MIB,
            active_bytes: 30 * MIB,
            requested_bytes: 30 * MIB,
            segments: 2,
            largest_free_block: 40 * MIB,
        }
    );
}
