//! `ckptune verify --pytorch` of a sharded plan against the real binary and the real FSDP2
//! harness (`python -m ckptune_harness.fsdp`, the venv `scripts/setup` links at `.venv`): each rank's
//! measured peak is the harness's, the exit code follows the budget, `--shard` must be the
//! plan's, a failed process group is exit 1, and no harness or rank process outlives the
//! command, even when the command is killed.
//!
//! The plans are `ckptune plan` plans with a shard section added here: the predictions in it
//! are placeholders, so nothing below compares measured with predicted bytes.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::{ckptune, edited, ok, read, refused, COMMON};
use serde_json::{json, Value};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

const UNITS: [&str; 4] = ["layer1", "layer2", "layer3", "layer4"];

/// A tiny-resnet plan (fp32, AdamW, micro-batch 4 at 32 px, a budget far above its peak), made
/// once per test process.
fn unsharded() -> &'static (tempfile::TempDir, Value) {
    static PLAN: OnceLock<(tempfile::TempDir, Value)> = OnceLock::new();
    PLAN.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let plan = dir.path().join("plan.json");
        let mut args = vec![
            "plan",
            "--budget",
            "10MiB",
            "tiny-resnet",
            "--image",
            "32",
            "--batch",
            "4",
            "--precision",
            "fp32",
            "-o",
            plan.to_str().unwrap(),
        ];
        args.extend(COMMON);
        ok(&args);
        let doc = read(&plan);
        (dir, doc)
    })
}

/// The plan sharded over `ranks` ranks with `UNITS` as the FSDP units and `layer2`
/// checkpointed (so the run is given a checkpoint regex too), written to `dir/name`.
fn sharded(dir: &Path, name: &str, ranks: i64, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let mut doc = unsharded().1.clone();
    doc["checkpoint"] = json!({"regex": "^(?:layer2)$", "modules": ["layer2"]});
    let peak = doc["predicted"]["peak_bytes"].clone();
    doc["shard"] = json!({
        "ranks": ranks,
        "reshard_after_forward": true,
        "collective": "gloo",
        "units": UNITS,
        "per_rank": (0..ranks)
            .map(|r| json!({"rank": r, "peak_bytes": peak, "peak_moment": "placeholder"}))
            .collect::<Vec<_>>(),
    });
    edited(dir, name, &doc, edit)
}

/// Live processes (zombies excluded) as (pid, parent pid, command line arguments).
fn processes() -> Vec<(u32, u32, Vec<String>)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let (Ok(stat), Ok(cmdline)) = (
            std::fs::read_to_string(entry.path().join("stat")),
            std::fs::read(entry.path().join("cmdline")),
        ) else {
            continue; // exited while we looked
        };
        // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
        let Some(after) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
            continue;
        };
        let mut fields = after.split(' ');
        let state = fields.next().unwrap_or("");
        let ppid = fields.next().and_then(|p| p.parse().ok()).unwrap_or(0);
        if state == "Z" || state == "X" {
            continue;
        }
        let args = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        out.push((pid, ppid, args));
    }
    out
}

/// The harness processes started with `--port port`.
fn harnesses_on(port: u16) -> Vec<u32> {
    let port = port.to_string();
    processes()
        .into_iter()
        .filter(|(_, _, a)| {
            a.iter().any(|x| x == "ckptune_harness.fsdp") && a.windows(2).any(|w| w[0] == "--port" && w[1] == port)
        })
        .map(|(pid, _, _)| pid)
        .collect()
}

fn alive(pid: u32) -> bool {
    processes().iter().any(|(p, _, _)| *p == pid)
}

/// A port nobody listens on now (the OS's choice, released at once).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn a_sharded_plan_runs_on_its_ranks_and_fails_over_budget() {
    let dir = tempfile::tempdir().unwrap();
    let plan = sharded(dir.path(), "sharded.json", 2, |_| {});
    let report = dir.path().join("report.json");
    let out = ok(&[
        "verify",
        plan.to_str().unwrap(),
        "--pytorch",
        "--steps",
        "2",
        "-o",
        report.to_str().unwrap(),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("on 2 ranks"), "{text}");
    assert!(
        text.contains("ckptune's own run and the PyTorch eager run were skipped"),
        "{text}"
    );
    assert!(text.contains("every rank within"), "{text}");

    let r = read(&report);
    assert_eq!(r["format"], "ckptune.verify-shard/1");
    assert_eq!(r["ranks"], 2);
    assert_eq!(r["within_budget"], true);
    assert_eq!(r["limit_bytes"], r["budget_bytes"], "a CPU plan reserves nothing");
    let f = &r["fsdp"];
    assert_eq!(f["format"], "ckptune.fsdp-run/1");
    // The run followed the plan: its ranks, units, checkpoint, config and shape.
    assert_eq!(f["world_size"], 2);
    assert_eq!(f["units"], json!(UNITS));
    assert_eq!(f["checkpointed"], json!(["layer2"]));
    assert_eq!(f["regex"], "^(?:layer2)$");
    for key in ["precision", "optimizer", "micro_batch"] {
        assert_eq!(f[key], r["config"][key], "{key}");
    }
    assert_eq!(f["optimizer_class"], "torch.optim.adamw.AdamW");
    assert_eq!((f["steps"].as_i64(), f["warmup"].as_i64()), (Some(3), Some(1)));
    let rows = r["per_rank"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    let mut measured = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let m = row["measured_peak_bytes"].as_i64().unwrap();
        assert!(m > 0, "rank {i}: {row}");
        assert_eq!(row["rank"], i);
        assert_eq!(m, f["peak_bytes"][i].as_i64().unwrap(), "rank {i}: the harness's peak");
        assert_eq!(m, f["ranks"][i]["peak_bytes"].as_i64().unwrap(), "rank {i}");
        assert_eq!(f["ranks"][i]["process_group_destroyed"], true);
        let p = row["predicted_peak_bytes"].as_i64().unwrap();
        assert_eq!(p, r["predicted_peak_bytes"].as_i64().unwrap(), "the plan's placeholder");
        assert_eq!(row["error_bytes"].as_i64().unwrap(), m - p);
        assert_eq!(row["within_budget"], true);
        measured.push(m);
    }
    assert_eq!(r["measured_peak_bytes"].as_i64(), measured.iter().copied().max());

    // The harness run by hand with the plan's settings measures the same peaks (its
    // collectives are settled, so peaks repeat run to run): verify passed the plan's settings.
    let by_hand = dir.path().join("by-hand.json");
    let out = Command::new(root().join(".venv/bin/python"))
        .args([
            "-m",
            "ckptune_harness.fsdp",
            "--model",
            "tiny-resnet",
            "--image",
            "32",
            "--micro-batch",
            "4",
        ])
        .args([
            "--nproc",
            "2",
            "--regex",
            "layer2",
            "--shard-regex",
            "layer[1-4]",
            "--steps",
            "3",
            "-o",
        ])
        .arg(&by_hand)
        .env("PYTHONPATH", root().join("python"))
        .output()
        .expect("runs the venv's python");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(read(&by_hand)["peak_bytes"], json!(measured));

    // A budget one byte below the highest rank's peak: exit 1, naming that rank.
    let highest = *measured.iter().max().unwrap();
    let tight = sharded(dir.path(), "tight.json", 2, |d| {
        d["budget_bytes"] = (highest - 1).into()
    });
    let tight_report = dir.path().join("tight-report.json");
    let out = ckptune(&[
        "verify",
        tight.to_str().unwrap(),
        "--pytorch",
        "--steps",
        "2",
        "-o",
        tight_report.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("verification failed") && err.contains("rank "), "{err}");
    let t = read(&tight_report);
    assert_eq!(t["within_budget"], false, "the report is written before the exit code");
    assert!(String::from_utf8_lossy(&out.stdout).contains("OVER"));
}

#[test]
fn shard_must_be_the_plans_rank_count() {
    let dir = tempfile::tempdir().unwrap();
    let plan = sharded(dir.path(), "sharded.json", 2, |_| {});
    let plan = plan.to_str().unwrap();
    refused(
        &["verify", plan, "--pytorch", "--shard", "3"],
        &["--shard 3", "planned for 2 ranks", "plan --shard 3"],
    );
    let single = dir.path().join("single.json");
    std::fs::write(&single, serde_json::to_string(&unsharded().1).unwrap()).unwrap();
    let single = single.to_str().unwrap();
    refused(
        &["verify", single, "--pytorch", "--shard", "2"],
        &["plan for one process", "plan --shard 2"],
    );
    refused(
        &["verify", single, "--pytorch", "--port", "1234"],
        &["--port", "plan --shard N"],
    );
    // --shard and --port belong to --pytorch.
    refused(&["verify", plan, "--shard", "2"], &["--pytorch"]);
    // ckptune's own run is one unsharded process, which no rank's budget describes.
    refused(&["verify", plan], &["sharded over 2 ranks", "verify --pytorch"]);
    // A shard section the harness cannot follow.
    let nccl = sharded(dir.path(), "nccl.json", 2, |d| d["shard"]["collective"] = "nccl".into());
    refused(
        &["verify", nccl.to_str().unwrap(), "--pytorch"],
        &["collective is nccl"],
    );
    let short = sharded(dir.path(), "short.json", 2, |d| {
        d["shard"]["per_rank"].as_array_mut().unwrap().pop();
    });
    refused(
        &["verify", short.to_str().unwrap(), "--pytorch"],
        &["predicts ranks [0]"],
    );
    // A unit the reference lacks: the harness wraps the others, and the run is refused.
    let unknown = sharded(dir.path(), "unknown.json", 2, |d| {
        d["shard"]["units"][3] = "layer9".into()
    });
    refused(&["verify", unknown.to_str().unwrap(), "--pytorch"], &["layer9"]);
}

#[test]
fn a_taken_port_fails_the_process_group_with_exit_1_and_leaves_no_process() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let plan = sharded(dir.path(), "sharded.json", 2, |_| {});
    let report = dir.path().join("report.json");
    let out = ckptune(&[
        "verify",
        plan.to_str().unwrap(),
        "--pytorch",
        "--port",
        &port.to_string(),
        "-o",
        report.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("127.0.0.1:{port}")),
        "the message names the port: {err}"
    );
    assert!(!report.exists(), "a failed run writes no report");
    assert_eq!(harnesses_on(port), Vec::<u32>::new(), "no harness left on port {port}");
    drop(taken);
}

#[test]
fn killing_ckptune_mid_run_kills_the_harness_and_its_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let plan = sharded(dir.path(), "sharded.json", 2, |_| {});
    let port = free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ckptune"))
        .args(["verify", plan.to_str().unwrap(), "--pytorch", "--steps", "50"])
        .args(["--port", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Wait until the harness runs and has started both ranks.
    let deadline = Instant::now() + Duration::from_secs(120);
    let (harness, ranks) = loop {
        let harness = harnesses_on(port);
        if let [h] = harness[..] {
            let ranks: Vec<u32> = processes()
                .into_iter()
                .filter(|(_, ppid, a)| *ppid == h && a.iter().any(|x| x == "--worker"))
                .map(|(pid, _, _)| pid)
                .collect();
            if ranks.len() == 2 {
                break (h, ranks);
            }
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("ckptune ended ({status}) before its ranks were seen");
        }
        assert!(Instant::now() < deadline, "the harness did not start 2 ranks in 120 s");
        std::thread::sleep(Duration::from_millis(50));
    };
    child.kill().unwrap(); // SIGKILL: ckptune cleans nothing up itself
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while [harness].iter().chain(&ranks).any(|&p| alive(p)) {
        assert!(
            Instant::now() < deadline,
            "60 s after ckptune was killed, harness {harness} or ranks {ranks:?} still run"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
