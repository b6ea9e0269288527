//! Set-up shared by the binary's integration tests: running `ckptune`, its refusals, reading and
//! editing its JSON, the fixtures' paths, the fp32 tiny-BERT several files profile, plan and
//! verify, and a trainer snippet run by python/tests/snippet_harness.py. Each test file uses what it needs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// Runs the binary with a per-process profile cache, so tests never share cached profiles.
pub fn ckptune(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ckptune"))
        .args(args)
        .env(
            "CKPTUNE_CACHE",
            std::env::temp_dir().join(format!("ckptune-test-cache-{}", std::process::id())),
        )
        .output()
        .expect("runs ckptune")
}

pub fn ok(args: &[&str]) -> Output {
    let out = ckptune(args);
    assert!(
        out.status.success(),
        "ckptune {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    out
}

/// Runs the binary and checks it refused `args` as bad input: exit 2, no panic, and each of
/// `fragments` in what it said. Returns its standard error.
pub fn refused(args: &[&str], fragments: &[&str]) -> String {
    let out = ckptune(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "ckptune {args:?} should exit 2: {err}");
    for f in fragments {
        assert!(err.contains(f), "ckptune {args:?}: {f:?} not in {err}");
    }
    assert!(!err.contains("panicked"), "ckptune {args:?} panicked: {err}");
    err
}

pub fn read(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("file written")).expect("valid JSON")
}

/// `doc` changed by `edit`, written to `dir/name`.
pub fn edited(dir: &Path, name: &str, doc: &Value, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let mut doc = doc.clone();
    edit(&mut doc);
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
    path
}

pub fn fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/fixtures")
        .join(name)
        .to_string_lossy()
        .into_owned()
}

/// Flags every test run passes: one thread, no progress bars, no cache.
pub const COMMON: [&str; 4] = ["--threads", "1", "--quiet", "--no-cache"];

/// The fp32 tiny-BERT at batch 4, sequence 16.
pub const TINY_BERT: [&str; 7] = ["tiny-bert", "--batch", "4", "--seq", "16", "--precision", "fp32"];

/// A profile of the fp32 tiny-BERT (batch 4, sequence 16) written to `path`, with `flags`.
pub fn profile_tiny_bert(path: &Path, flags: &[&str]) -> Value {
    let mut args = vec!["profile"];
    args.extend(TINY_BERT);
    args.extend(["-o", path.to_str().unwrap()]);
    args.extend(flags);
    ok(&args);
    read(path)
}

/// `plan` for the fp32 tiny-BERT (batch 4, sequence 16) from a saved profile, plus `extra`.
pub fn plan_tiny_bert(budget: &str, profile: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["plan", "--budget", budget];
    args.extend(TINY_BERT);
    args.extend(["--profile", profile.to_str().unwrap()]);
    args.extend(extra);
    args.extend(COMMON);
    ok(&args)
}

/// `verify` of `plan`, its report written in `dir` and read back.
pub fn verify(plan: &Path, dir: &Path) -> Value {
    let report = dir.join("verify.json");
    ok(&[
        "verify",
        plan.to_str().unwrap(),
        "-o",
        report.to_str().unwrap(),
        "--quiet",
    ]);
    read(&report)
}

/// The checkout this test binary was built from.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs the harness on the snippet; the JSON line it prints.
pub fn execute_snippet(kind: &str, snippet: &str, model: &str, steps: usize, watch: &[String]) -> Value {
    let trainers = root().join(".trainers");
    // The plain-PyTorch snippets run with torch and the companion alone.
    let plain = kind == "python" || kind == "fsdp2";
    assert!(
        plain || trainers.exists(),
        "{} missing: scripts/setup installs the trainers of python/requirements-trainers.txt there",
        trainers.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("snippet.py");
    std::fs::write(&path, snippet).unwrap();
    let mut pythonpath = root().join("python").into_os_string();
    if !plain {
        pythonpath.push(":");
        pythonpath.push(&trainers);
    }
    let out: Output = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("python/tests/snippet_harness.py"))
        .args([kind])
        .arg(&path)
        .args([model, &steps.to_string(), &serde_json::to_string(watch).unwrap()])
        .env("PYTHONPATH", pythonpath)
        .env("TOKENIZERS_PARALLELISM", "false")
        .current_dir(dir.path())
        .output()
        .expect("runs the venv's python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{kind} snippet failed:\n{snippet}\n--- stderr\n{}\n--- stdout\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .unwrap_or_else(|| panic!("no RESULT line: {stdout}"));
    serde_json::from_str(line).unwrap()
}

/// `profile` with its selective recomputes made nearly free in the blocks whose names contain
/// `layers` and dear (1 s) elsewhere, so the fastest plan under a budget that forces some
/// saving runs a layer selective rather than a small block (a final norm).
pub fn selective_made_cheap(dir: &Path, name: &str, profile: &Value, layers: &str) -> PathBuf {
    edited(dir, name, profile, |d| {
        for r in d["configs"][0]["regimes"].as_array_mut().unwrap() {
            for b in r["blocks"].as_array_mut().unwrap() {
                let layer = b["name"].as_str().is_some_and(|n| n.contains(layers));
                // One policy's terms are an object, several policies' an array.
                let one = |s: &mut Value| s["rec_seconds"] = (if layer { 1e-9 } else { 1.0 }).into();
                match b.get_mut("selective") {
                    Some(Value::Array(all)) => all.iter_mut().for_each(one),
                    Some(s) if !s.is_null() => one(s),
                    _ => {}
                }
            }
        }
    })
}
