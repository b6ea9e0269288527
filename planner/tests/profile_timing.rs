//! `ckptune profile` and its times through the real binary: the profile cache (one file per
//! config, an interrupted run resumed), one recompute estimate for identical layers, the thread
//! count a busy machine leaves, and step times from a busy machine in plans, verifications and
//! the cache (docs/timing.md).

mod common;

use std::process::Command;

use common::{ckptune, ok, plan_tiny_bert, profile_tiny_bert, read, verify, COMMON};
use serde_json::Value;

#[test]
fn profiles_are_cached_per_config_and_an_interrupted_run_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let run = |name: &str| {
        let out = dir.path().join(name);
        let status = Command::new(env!("CARGO_BIN_EXE_ckptune"))
            .args([
                "profile",
                "tiny-resnet",
                "--image",
                "32",
                "--precision",
                "fp32,bf16",
                "--threads",
                "1",
                "--quiet",
            ])
            .args(["--cache-dir", cache.to_str().unwrap(), "-o", out.to_str().unwrap()])
            .status()
            .unwrap();
        assert!(status.success());
        read(&out)
    };
    let first = run("a.json");
    let mut files: Vec<_> = std::fs::read_dir(&cache).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    assert_eq!(files.len(), 2, "one cache file per config");
    // Cached: the same measurements again, not new ones (timings would differ).
    assert_eq!(run("b.json")["configs"], first["configs"]);
    // As if the run had been interrupted after the first config: only the second is measured.
    let keep = read(&files[0]);
    std::fs::remove_file(&files[1]).unwrap();
    let resumed = run("c.json");
    let configs = resumed["configs"].as_array().unwrap();
    assert_eq!(configs.len(), 2);
    assert!(
        configs.contains(&keep["profile"]),
        "the finished config is reused as it was"
    );
    assert!(files[1].exists(), "the missing config is measured and cached again");
}

#[test]
fn identical_layers_share_one_recompute_estimate_over_all_their_samples() {
    let dir = tempfile::tempdir().unwrap();
    // tiny-bert: embeddings, two identical encoder layers, pooler.
    // Every step for real: steps A and B both timed (`--measure auto` times steps B alone and
    // pools them the same way: measure.rs).
    let mut flags = COMMON.to_vec();
    flags.extend(["--measure", "run"]);
    let p = profile_tiny_bert(&dir.path().join("bert.json"), &flags);
    let c = &p["configs"][0];
    assert_eq!(c["recompute_class"], serde_json::json!([0, 1, 1, 3]));
    let t = c["recompute_seconds"].as_array().unwrap();
    assert_eq!(t[1], t[2], "one estimate for both layers");
    let spread = c["recompute_spread"].as_array().unwrap();
    assert_eq!(spread[1], spread[2]);
    let repeats = c["contention"]["samples"].as_u64().unwrap() / 2; // steps A and B
    assert_eq!(
        spread[1]["n"].as_u64().unwrap(),
        2 * repeats,
        "both layers' samples: {}",
        spread[1]
    );
    assert_eq!(spread[0]["n"].as_u64().unwrap(), repeats);

    // Nested: the layers as groups over their children are identical too, and each child is
    // identical to its counterpart in the other layer; no group shares a class with a block.
    let nested = profile_tiny_bert(
        &dir.path().join("nested.json"),
        &[&["--granularity", "nested"], &COMMON[..]].concat(),
    );
    let blocks: Vec<String> = nested["model"]["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["name"].as_str().unwrap().to_owned())
        .collect();
    let groups = nested["model"]["groups"].as_array().unwrap();
    let class: Vec<usize> = nested["configs"][0]["recompute_class"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    assert_eq!(class.len(), blocks.len() + groups.len());
    let n = blocks.len();
    let (g0, g1) = (n, n + 1);
    assert_eq!(groups[0]["name"], "encoder.layer.0");
    assert_eq!((class[g0], class[g1]), (g0, g0));
    for (i, name) in blocks.iter().enumerate() {
        if let Some(child) = name.strip_prefix("encoder.layer.1.") {
            let twin = blocks
                .iter()
                .position(|b| *b == format!("encoder.layer.0.{child}"))
                .unwrap();
            assert_eq!(class[i], twin, "{name}");
        } else if !name.starts_with("encoder.layer.0.") {
            assert_eq!(class[i], i, "{name} is like no other block");
        }
    }

    // tiny-resnet: every layer differs from the others.
    let path = dir.path().join("resnet.json");
    let mut args = vec![
        "profile",
        "tiny-resnet",
        "--image",
        "32",
        "--batch",
        "2",
        "-o",
        path.to_str().unwrap(),
    ];
    args.extend(COMMON);
    ok(&args);
    let class = read(&path)["configs"][0]["recompute_class"].clone();
    let units = class.as_array().unwrap().len();
    assert_eq!(class, serde_json::json!((0..units).collect::<Vec<_>>()));
}

#[test]
fn without_threads_a_busy_machine_gets_the_cores_it_leaves() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus < 2 {
        return; // one CPU: one thread whatever the load
    }
    // One process keeping a core busy for the whole command, killed however the test ends.
    struct Busy(std::process::Child);
    impl Drop for Busy {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _busy = Busy(
        Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .expect("sh runs"),
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.json");
    let out = ckptune(&[
        "profile",
        "tiny-resnet",
        "--image",
        "32",
        "--batch",
        "2",
        "--precision",
        "fp32",
        "--repeats",
        "1",
        "--no-cache",
        "-o",
        path.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let threads = read(&path)["device"]["threads"].as_u64().unwrap() as usize;
    assert!(threads < cpus, "{threads} threads on {cpus} CPUs, one of them busy");
    assert!(err.contains("busy") && err.contains("pass --threads"), "{err}");
}

/// What a profile whose steps ran while another process took the CPUs holds (docs/timing.md).
fn contended() -> Value {
    serde_json::json!({
        "samples": 6, "contended": 2, "unchecked": 0, "retimed": 3,
        "other_cores_median": 0.9, "other_cores_max": 1.25
    })
}

#[test]
fn step_times_from_a_busy_machine_are_noted_in_plan_and_verify_and_carry_their_spread() {
    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("profile.json");
    let p = profile_tiny_bert(&profile, &COMMON);
    let c = &p["configs"][0];
    let recorded = &c["contention"];
    assert!(
        recorded["samples"].as_u64().unwrap() >= 2,
        "every timed sample is checked: {recorded}"
    );
    let units = c["recompute_seconds"].as_array().unwrap().len();
    assert_eq!(c["recompute_spread"].as_array().unwrap().len(), units);
    let (none, all) = (c["peak_none"].as_i64().unwrap(), c["peak_all"].as_i64().unwrap());
    let budget = ((all + none) / 2).to_string();

    // A quiet profile: the plan carries the spread around its estimate; notes say nothing of
    // contention when there was none.
    let plan = dir.path().join("plan.json");
    plan_tiny_bert(&budget, &profile, &["-o", plan.to_str().unwrap()]);
    let v = read(&plan);
    let t = v["predicted"]["step_seconds"].as_f64().unwrap();
    let range = &v["predicted"]["step_seconds_range"];
    let (lo, hi) = (range[0].as_f64().unwrap(), range[1].as_f64().unwrap());
    assert!(lo <= t && t <= hi, "{t} in [{lo}, {hi}]");
    for a in v["alternatives"].as_array().unwrap() {
        assert!(a["predicted"]["step_seconds_range"].is_array(), "{a}");
    }
    let quiet = recorded["contended"] == 0;
    let noted = |v: &Value, what: &str| {
        v["notes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n.as_str().unwrap().contains(what))
    };
    if quiet {
        assert!(!noted(&v, "quiet samples"), "{}", v["notes"]);
    }

    // The same profile as if its steps had been timed on a busy machine.
    let mut busy = p.clone();
    busy["configs"][0]["contention"] = contended();
    let busy_file = dir.path().join("busy.json");
    std::fs::write(&busy_file, serde_json::to_string(&busy).unwrap()).unwrap();
    plan_tiny_bert(&budget, &busy_file, &["-o", plan.to_str().unwrap()]);
    let v = read(&plan);
    assert!(
        noted(
            &v,
            "of fp32/adamw/mb4x1 could not get quiet samples: 2 of the 6 timed steps"
        ),
        "{}",
        v["notes"]
    );
    assert_eq!(
        v["profile"]["contention"],
        contended(),
        "the plan keeps its profile's record"
    );
    let r = verify(&plan, dir.path());
    assert!(noted(&r, "the plan's profile could not get quiet samples"), "{r}");
    assert_eq!(r["peak_error_bytes"], 0, "memory stays byte-exact: {r}");
    assert!(r["measured"]["contention"]["samples"].as_u64().unwrap() >= 1, "{r}");
    assert_eq!(
        r["predicted"]["step_seconds_range"],
        v["predicted"]["step_seconds_range"]
    );

    // A profile written before the load was recorded still reads, and the plan says what it
    // cannot know.
    let mut old = p.clone();
    for c in old["configs"].as_array_mut().unwrap() {
        let c = c.as_object_mut().unwrap();
        c.remove("contention");
        c.remove("recompute_spread");
    }
    let old_file = dir.path().join("old.json");
    std::fs::write(&old_file, serde_json::to_string(&old).unwrap()).unwrap();
    plan_tiny_bert(&budget, &old_file, &["-o", plan.to_str().unwrap()]);
    let v = read(&plan);
    assert!(
        noted(&v, "was measured before ckptune checked step times for contention"),
        "{}",
        v["notes"]
    );
    assert!(
        v["predicted"].get("step_seconds_range").is_none(),
        "no samples, no range: {v}"
    );
}

#[test]
fn a_cached_profile_timed_on_a_busy_machine_is_profiled_again() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let flags = ["--threads", "1", "--quiet", "--cache-dir", cache.to_str().unwrap()];
    let run = || profile_tiny_bert(&dir.path().join("p.json"), &flags);
    run();
    let file = std::fs::read_dir(&cache).unwrap().next().unwrap().unwrap().path();
    // Mark the cached step time so reuse shows: 1000 s is no real tiny-BERT step.
    let mark = |contention: Value| {
        let mut cached = read(&file);
        cached["profile"]["seconds_none"]["median"] = Value::from(1000.0);
        cached["profile"]["contention"] = contention;
        std::fs::write(&file, serde_json::to_string(&cached).unwrap()).unwrap();
    };
    // Quiet: reused as it is.
    let mut quiet = contended();
    quiet["contended"] = Value::from(0);
    mark(quiet);
    assert_eq!(run()["configs"][0]["seconds_none"]["median"], 1000.0);
    // Contended: measured again, and the new measurement replaces the cached one.
    mark(contended());
    let again = run();
    assert_ne!(again["configs"][0]["seconds_none"]["median"], 1000.0, "re-timed");
    assert_eq!(
        read(&file)["profile"],
        again["configs"][0],
        "the cache holds the new profile"
    );
}
