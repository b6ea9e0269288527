//! The allocation-trace format (`ckptune.alloc-trace/1`): events as short arrays, read back
//! to the same events; malformed events named; and the replay document's rows.

use ckptune_solver::caching_allocator::{replay, AllocatorConfig, TraceEvent};
use ckptune_solver::formats::{self, AllocReplayJson, AllocTraceJson, ALLOC_TRACE_FORMAT};

fn read(text: &str) -> Result<AllocTraceJson, String> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.json");
    std::fs::write(&path, text).unwrap();
    formats::read_tagged(&path, ALLOC_TRACE_FORMAT).map_err(|e| e.to_string())
}

#[test]
fn events_are_short_arrays_and_read_back() {
    let trace = AllocTraceJson {
        format: ALLOC_TRACE_FORMAT.to_string(),
        alloc_conf: "expandable_segments:True".into(),
        capacity_bytes: Some(1 << 30),
        events: vec![
            TraceEvent::Mark("forward layer1".into()),
            TraceEvent::Alloc {
                id: 1,
                bytes: 4096,
                stream: 2,
            },
            TraceEvent::Free { id: 1 },
            TraceEvent::EmptyCache,
        ],
    };
    let text = serde_json::to_string(&trace).unwrap();
    assert_eq!(
        text,
        r#"{"format":"ckptune.alloc-trace/1","alloc_conf":"expandable_segments:True","capacity_bytes":1073741824,"events":[["m","forward layer1"],["a",1,4096,2],["f",1],["e"]]}"#
    );
    assert_eq!(read(&text).unwrap(), trace);
}

#[test]
fn stream_config_and_capacity_may_be_left_out() {
    let t = read(r#"{"format": "ckptune.alloc-trace/1", "events": [["a", 7, 100]]}"#).unwrap();
    assert_eq!(
        t.events,
        [TraceEvent::Alloc {
            id: 7,
            bytes: 100,
            stream: 0
        }]
    );
    assert_eq!((t.alloc_conf.as_str(), t.capacity_bytes), ("", None));
}

#[test]
fn malformed_events_are_named() {
    for (events, expected) in [
        (r#"[["x", 1]]"#, r#"invalid value: string "x""#),
        (r#"[["f"]]"#, "invalid length 1"),
        (r#"[["f", 1, 2]]"#, r#"too many values in a "f" event"#),
        (r#"[["a", 1, -5]]"#, "invalid value: integer `-5`"),
        (r#"[{"op": "a"}]"#, r#"expected an event: ["a", id, bytes, stream]"#),
    ] {
        let e = read(&format!(r#"{{"format": "ckptune.alloc-trace/1", "events": {events}}}"#)).unwrap_err();
        assert!(
            e.contains("trace.json is not valid") && e.contains(expected),
            "{events}: {e}"
        );
    }
    let e = read(r#"{"format": "ckptune.profile/1", "events": []}"#).unwrap_err();
    assert!(e.contains("expected \"ckptune.alloc-trace/1\""), "{e}");
}

#[test]
fn replay_document_rows_follow_the_columns() {
    let events = [
        TraceEvent::Alloc {
            id: 1,
            bytes: 1000,
            stream: 0,
        },
        TraceEvent::Free { id: 1 },
    ];
    let r = replay(&events, AllocatorConfig::default(), None).unwrap();
    let doc = AllocReplayJson::new("t.json", "", None, events.len(), &r, true);
    let rows = &doc.every_event.as_ref().unwrap().rows;
    // 1000 bytes → a 1024-byte block of a 2 MiB small segment; freed, the segment stays cached.
    assert_eq!(
        rows,
        &[
            [1024, 2 << 20, 1024, 1000, 1, (2 << 20) - 1024],
            [0, 2 << 20, 0, 0, 1, 2 << 20]
        ]
    );
    // With rows the document is one line; without, pretty.
    assert_eq!(formats::replay_text(&doc).unwrap().lines().count(), 1);
    let plain = AllocReplayJson::new("t.json", "", None, events.len(), &r, false);
    assert!(formats::replay_text(&plain).unwrap().lines().count() > 10);
}
