//! Set-up shared by the binary's integration tests: running `ckptune`, its refusals, reading and
//! editing its JSON, the fixtures' paths. Each test file uses what it needs.
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
