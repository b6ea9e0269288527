//! `ckptune simulate-allocator`: span peaks and every event's state for a small trace, worked out
//! by hand; exit 1 and the stop recorded when a trace runs out of memory; exit 2 for input that
//! cannot be used; and `scripts/gpu_check`'s whole pipeline (synthetic traces, measurement by
//! its stand-in allocator, simulation by this binary, comparison) without a GPU.

mod common;

use std::path::Path;

use common::{ckptune, ok, read, refused};
use serde_json::Value;

const MIB: u64 = 1 << 20;

/// forward: 30,000,000 bytes on stream 0, 5,000,000 on stream 1 and freed; backward: 1000
/// bytes, the 30 MB freed, empty_cache, the 1000 bytes freed.
const TRACE: &str = r#"{"format": "ckptune.alloc-trace/1", "alloc_conf": "", "events": [
  ["m", "forward"], ["a", 1, 30000000], ["a", 2, 5000000, 1], ["f", 2],
  ["m", "backward"], ["a", 3, 1000], ["f", 1], ["e"], ["f", 3]]}"#;

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_string_lossy().into_owned()
}

fn json_stdout(args: &[&str]) -> Value {
    serde_json::from_slice(&ok(args).stdout).expect("--json prints JSON")
}

#[test]
fn span_peaks_of_a_small_trace() {
    let dir = tempfile::tempdir().unwrap();
    let trace = write(dir.path(), "t.json", TRACE);
    let doc = json_stdout(&["simulate-allocator", &trace, "--json"]);
    assert_eq!(doc["format"], "ckptune.alloc-replay/1");
    let spans = doc["spans"].as_array().unwrap();
    // forward: 30,000,000 → 30,000,128 (512s) in a 30 MiB segment (split: 1.39 MiB > 1 MiB
    // remain); 5,000,000 → 5,000,192 in stream 1's own 20 MiB segment: 35,000,320 allocated
    // and 50 MiB reserved at the peak; the freed 20 MiB segment is the largest free block.
    assert_eq!(spans[0]["name"], "forward");
    assert_eq!(spans[0]["peak_allocated_bytes"], 35_000_320);
    assert_eq!(spans[0]["peak_reserved_bytes"], 50 * MIB);
    assert_eq!(spans[0]["end"]["largest_free_block"], 20 * MIB);
    // backward: 1000 → a 1024-byte block of a new 2 MiB small segment; peak allocated
    // 30,000,128 + 1024, reserved 52 MiB; empty_cache then returns both large segments, the
    // small one is split by the live block and stays.
    assert_eq!(spans[1]["peak_allocated_bytes"], 30_001_152);
    assert_eq!(spans[1]["peak_reserved_bytes"], 52 * MIB);
    assert_eq!(doc["stats"]["reserved_bytes"]["current"], 2 * MIB);
    assert_eq!(doc["stats"]["segment"]["current"], 1);
    assert!(doc.get("every_event").is_none());
}

#[test]
fn every_event_under_another_config() {
    let dir = tempfile::tempdir().unwrap();
    let trace = write(dir.path(), "t.json", TRACE);
    let out = dir.path().join("r.json");
    ok(&[
        "simulate-allocator",
        &trace,
        "--alloc-conf",
        "expandable_segments:True",
        "--every-event",
        "-o",
        out.to_str().unwrap(),
    ]);
    let doc = read(&out);
    assert_eq!(doc["alloc_conf"], "expandable_segments:True");
    let rows = doc["every_event"]["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 9);
    // After the first allocation: 30,000,128 bytes in two mapped 20 MiB pages, no cudaMalloc
    // segment counted, 40 MiB − 30,000,128 free after it.
    let expected: Vec<u64> = vec![30_000_128, 40 * MIB, 30_000_128, 30_000_000, 0, 40 * MIB - 30_000_128];
    assert_eq!(serde_json::from_value::<Vec<u64>>(rows[1].clone()).unwrap(), expected);
}

#[test]
fn running_out_of_memory_exits_1_with_the_stop_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let trace = write(dir.path(), "t.json", TRACE);
    let out = dir.path().join("r.json");
    let run = ckptune(&[
        "simulate-allocator",
        &trace,
        "--capacity",
        "40MiB",
        "-o",
        out.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    // Stream 1's 20 MiB segment does not fit beside stream 0's 30 MiB one, and stream 0's is
    // split by a live block, so releasing the cache cannot help.
    assert!(
        stderr.contains("runs out of memory at event 2: CUDA out of memory. Tried to allocate 20.00 MiB"),
        "{stderr}"
    );
    let doc = read(&out);
    assert_eq!(doc["stopped"]["event"], 2);
    assert_eq!(doc["stopped"]["out_of_memory"], true);
    assert_eq!(doc["replayed"], 3);
}

#[test]
fn a_closed_stdout_ends_it_quietly() {
    // As every subcommand (exit_codes.rs): printing stops, the output file is still written.
    let dir = tempfile::tempdir().unwrap();
    let trace = write(dir.path(), "t.json", TRACE);
    let out = dir.path().join("r.json");
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_ckptune"))
        .args([
            "simulate-allocator",
            &trace,
            "--every-event",
            "-o",
            out.to_str().unwrap(),
        ])
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(read(&out)["replayed"], 9);
}

#[test]
fn unusable_input_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let trace = write(dir.path(), "t.json", TRACE);
    let corrupt = write(dir.path(), "corrupt.json", "{ not json");
    let bad_free = write(
        dir.path(),
        "bad_free.json",
        r#"{"format": "ckptune.alloc-trace/1", "events": [["a", 1, 10], ["f", 2]]}"#,
    );
    for (args, names) in [
        (vec!["simulate-allocator", &corrupt], "corrupt.json"),
        (
            vec!["simulate-allocator", &trace, "--alloc-conf", "max_split_size_mb:5"],
            "max_split_size_mb:5",
        ),
        (
            vec!["simulate-allocator", &trace, "--alloc-conf", "backend:cudaMallocAsync"],
            "not simulated",
        ),
        (vec!["simulate-allocator", &trace, "--capacity", "12XB"], "--capacity"),
        (
            vec![
                "simulate-allocator",
                &trace,
                "--alloc-conf",
                "per_process_memory_fraction:0.5",
            ],
            "needs the device's capacity",
        ),
        (vec!["simulate-allocator", &bad_free], "event 1: freeing id 2"),
    ] {
        refused(&args, &[names]);
    }
}

#[test]
fn gpu_check_pipeline_runs_without_a_gpu() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("gpu");
    let run = std::process::Command::new(root.join("scripts/gpu_check"))
        .args([
            "--backend",
            "fake",
            "--out",
            out.to_str().unwrap(),
            "--ckptune",
            env!("CARGO_BIN_EXE_ckptune"),
            "--models",
            "tiny-resnet,tiny-bert,tiny-llama-selective",
        ])
        .output()
        .expect("runs scripts/gpu_check");
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let doc = read(&out.join("replay.json"));
    assert_eq!(doc["format"], "ckptune.gpu-replay/1");
    assert_eq!(doc["fake_backend"], true);
    // Every synthetic trace under every configuration, each simulated by this binary.
    let configs = doc["configs"].as_array().unwrap().len();
    let traces = std::fs::read_dir(out.join("work/traces")).unwrap().count();
    assert_eq!(doc["results"].as_array().unwrap().len(), configs * traces);
    assert!(configs >= 5 && traces >= 10, "{configs} configs, {traces} traces");
    for r in doc["results"].as_array().unwrap() {
        assert!(r["compared"].as_u64().unwrap() > 0, "{r}");
    }
    let md = std::fs::read_to_string(out.join("replay.md")).unwrap();
    assert!(md.contains("FAKE BACKEND"), "{md}");
    // The models, planned here for a GPU: their traces replayed with the others, their plans'
    // predictions in models.json, nothing measured on the stand-in.
    let models = read(&out.join("models.json"));
    assert_eq!(models["fake_backend"], true);
    for (row, name) in
        models["models"]
            .as_array()
            .unwrap()
            .iter()
            .zip(["tiny-resnet", "tiny-bert", "tiny-llama-selective"])
    {
        assert_eq!(row["model"], name);
        assert!(out.join(format!("work/traces/model-{name}.json")).exists());
        let replayed: Vec<_> = doc["results"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["trace"] == format!("model-{name}").as_str())
            .collect();
        assert_eq!(replayed.len(), configs, "{name}");
        let allocated = row["predicted_allocated_bytes"].as_i64().unwrap();
        assert!(row["predicted_reserved_bytes"].as_i64().unwrap() >= allocated, "{row}");
        assert!(
            row["measured_reserved_bytes"].is_null() && row["not_measured"].is_string(),
            "{row}"
        );
    }
    assert!(std::fs::read_to_string(out.join("models.md"))
        .unwrap()
        .contains("FAKE BACKEND"));
    // A model offered selective checkpointing is planned from the cost model too: every
    // candidate layer's selective recompute estimated, and the plan's times labelled so.
    let plan = read(&out.join("work/models/tiny-llama-selective.predicted.json"));
    assert!(
        plan["predicted"]["step_seconds_estimated"].is_string(),
        "{}",
        plan["predicted"]
    );
    let layers: Vec<_> = plan["profile"]["estimated"]["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|b| Some((b["selective_recompute"].as_f64()?, b["nograd_forward"].as_f64()?)))
        .collect();
    assert_eq!(layers.len(), 4, "{}", plan["profile"]["estimated"]);
    // The decoder layers' products are saved; the embedding and the norm have none to save.
    assert!(layers.iter().all(|&(s, full)| 0.0 < s && s <= full), "{layers:?}");
    assert_eq!(layers.iter().filter(|&&(s, full)| s < full).count(), 2, "{layers:?}");
}

/// Allocator histories recorded on an H200 (torch 2.11) while PyTorch trained ResNet-50 and
/// BERT-base (results/gpu/steps.md): every allocation and free of the run, in order, with the
/// reserved bytes the GPU's allocator held after each. The simulation must hold the same
/// reserved bytes after every event, under the setting the run used.
#[test]
fn real_gpu_histories_replay_to_the_byte() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpu");
    for name in [
        "resnet50.none.default",
        "resnet50.checkpointed.expandable-segments-True",
        "bert-base.none.expandable-segments-True",
    ] {
        let path = dir.join(format!("{name}.trace.json"));
        let trace = read(&path);
        let gpu: Vec<u64> = trace["gpu_reserved_after"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        let doc = json_stdout(&[
            "simulate-allocator",
            path.to_str().unwrap(),
            "--capacity",
            "150109880320",
            "--every-event",
            "--json",
        ]);
        let rows = doc["every_event"]["rows"].as_array().unwrap();
        assert_eq!(rows.len(), gpu.len(), "{name}");
        for (i, (row, expected)) in rows.iter().zip(&gpu).enumerate() {
            assert_eq!(
                row[1].as_u64().unwrap(),
                *expected,
                "{name}: reserved bytes after event {i}"
            );
        }
    }
}
