//! Running the Python companion's harness (`python/ckptune_harness/`) from this checkout:
//! which Python, with the checkout importable, a folder for its files, and its own message
//! when it fails, and a run read back. What `verify --pytorch` (eager, trainer and FSDP2 runs) shares.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use ckptune_solver::formats::{self, PytorchRunJson};

use crate::cli::error::UsageError;

/// The checkout this binary was built from: where the companion (`python/`), the references
/// (`models/fixtures/reference.py`) and the meter's source (`kernels/csrc/shim.cpp`) are.
pub fn checkout() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `--python`, else `$CKPTUNE_PYTHON`, else the venv `scripts/setup` links at `.venv`.
pub fn python(flag: Option<&Path>) -> PathBuf {
    flag.map(Path::to_path_buf)
        .or_else(|| std::env::var_os("CKPTUNE_PYTHON").map(PathBuf::from))
        .unwrap_or_else(|| checkout().join(".venv/bin/python"))
}

/// `python` with this checkout's companion importable and told where the checkout is.
pub fn companion(python: &Path) -> Command {
    let root = checkout();
    let mut cmd = Command::new(python);
    cmd.env("PYTHONPATH", root.join("python")).env("CKPTUNE_ROOT", &root);
    cmd
}

/// Bad input when the Python that runs `--pytorch` is not there.
pub fn require_python(python: &Path) -> Result<()> {
    if !python.exists() {
        return Err(UsageError(format!(
            "verify --pytorch: no Python at {}: run scripts/setup, or pass --python (or set CKPTUNE_PYTHON) \
             to a Python with torch",
            python.display()
        ))
        .into());
    }
    Ok(())
}

/// A fresh folder for one run's files, removed by the caller.
pub fn run_dir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!(
        "ckptune-verify-pytorch-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// A harness's own message from its stderr: from its last `error: ` line (its one-line
/// summary, then a failed rank's traceback) to the end, else the last lines.
pub fn harness_message(stderr: &str) -> String {
    let lines: Vec<&str> = stderr.trim_end().lines().collect();
    let start = lines
        .iter()
        .rposition(|l| l.starts_with("error: ") || l.contains(": error: "));
    let shown: Vec<&str> = match start {
        Some(i) => {
            let first = lines[i];
            let first = first.split_once("error: ").map_or(first, |(_, rest)| rest);
            // A traceback's end says what failed; its middle is frames.
            let rest = &lines[i + 1..];
            let tail = &rest[rest.len().saturating_sub(30)..];
            std::iter::once(first).chain(tail.iter().copied()).collect()
        }
        None => lines[lines.len().saturating_sub(15)..].to_vec(),
    };
    let text = shown.join("\n");
    if text.trim().is_empty() {
        "(no output)".into()
    } else {
        text
    }
}

/// Runs a harness command (`-o` and the step counts added here) and reads its
/// `ckptune.pytorch-run/1` output: exit 2 is bad input, with the harness's message.
pub fn harness_run(mut cmd: Command, steps: usize, python: &Path, what: &str) -> Result<PytorchRunJson> {
    require_python(python)?;
    let dir = run_dir()?;
    let out = dir.join("pytorch-run.json");
    let result = cmd
        .args(["--steps", &(steps + 2).to_string(), "--warmup", "2", "-o"])
        .arg(&out)
        .output()
        .with_context(|| format!("verify --pytorch: running {}", python.display()));
    let run = result.and_then(|o| {
        let message = harness_message(&String::from_utf8_lossy(&o.stderr));
        match o.status.code() {
            Some(0) => Ok(formats::read_tagged::<PytorchRunJson>(
                &out,
                formats::PYTORCH_RUN_FORMAT,
            )?),
            Some(2) => Err(UsageError(format!("verify --pytorch: {what} refused the plan: {message}")).into()),
            code => Err(anyhow::anyhow!(
                "verify --pytorch: {what} failed (exit {code:?}): {message}"
            )),
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
    run
}
