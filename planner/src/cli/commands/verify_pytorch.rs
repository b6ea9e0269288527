//! `ckptune verify --pytorch`: the plan run twice — by ckptune's runtime (as `verify` does) and
//! in PyTorch eager on the built-in model's plain-torch reference (`python -m ckptune_harness.eager`,
//! the companion's run with ckptune's counting allocator loaded into the Python process) — and
//! reported beside the prediction. Exit 1 when either run peaks over the budget. A plan with a
//! `shard` section goes to [`super::verify_shard`] instead: FSDP2 on its N ranks.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, Result};
use ckptune_solver::budget::format_size;
use ckptune_solver::formats::{self, PlanJson, PytorchRunJson, VerifyJson, VerifyPytorchJson};

use super::verify::verify_plan;
use crate::cli::args::VerifyArgs;
use crate::cli::error::UsageError;
use crate::cli::output::{group_digits, outln, print_json};

/// The checkout this binary was built from: where the companion (`python/`), the references
/// (`models/fixtures/reference.py`) and the meter's source (`kernels/csrc/shim.cpp`) are.
fn checkout() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `--python`, else `$CKPTUNE_PYTHON`, else the venv `scripts/setup` links at `.venv`.
pub(super) fn python(flag: Option<&Path>) -> PathBuf {
    flag.map(Path::to_path_buf)
        .or_else(|| std::env::var_os("CKPTUNE_PYTHON").map(PathBuf::from))
        .unwrap_or_else(|| checkout().join(".venv/bin/python"))
}

/// Runs `python -m ckptune_harness.eager` on the plan file. Its exit code 2 (a plan the PyTorch run
/// cannot follow: names that differ from the reference's, a model without a reference) is bad
/// input here too, with its message.
fn pytorch_run(plan_path: &Path, steps: usize, python: &Path) -> Result<PytorchRunJson> {
    require_python(python)?;
    let dir = tempfile_dir()?;
    let out = dir.join("pytorch-run.json");
    let result = companion(python)
        .args(["-m", "ckptune_harness.eager", "--plan"])
        .arg(plan_path)
        .args(["--steps", &(steps + 2).to_string(), "--warmup", "2", "-o"])
        .arg(&out)
        .output()
        .with_context(|| format!("verify --pytorch: running {}", python.display()));
    let run = result.and_then(|o| {
        let stderr = String::from_utf8_lossy(&o.stderr);
        let last = stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim();
        let last = last.strip_prefix("error: ").unwrap_or(last).to_owned();
        match o.status.code() {
            Some(0) => Ok(formats::read_tagged::<PytorchRunJson>(
                &out,
                formats::PYTORCH_RUN_FORMAT,
            )?),
            Some(2) => Err(UsageError(format!("verify --pytorch: the PyTorch run refused the plan: {last}")).into()),
            code => Err(anyhow::anyhow!(
                "verify --pytorch: the PyTorch run failed (exit {code:?}): {}",
                stderr
                    .trim_end()
                    .lines()
                    .rev()
                    .take(15)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n")
            )),
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
    run
}

/// `python` with this checkout's companion importable and told where the checkout is.
pub(super) fn companion(python: &Path) -> Command {
    let root = checkout();
    let mut cmd = Command::new(python);
    cmd.env("PYTHONPATH", root.join("python")).env("CKPTUNE_ROOT", &root);
    cmd
}

/// Bad input when the Python that runs `--pytorch` is not there.
pub(super) fn require_python(python: &Path) -> Result<()> {
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

pub(super) fn tempfile_dir() -> Result<PathBuf> {
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

/// The PyTorch run first (a plan it refuses is bad input, before minutes of ckptune's run),
/// then ckptune's.
pub fn verify_pytorch_cmd(a: &VerifyArgs, plan: &PlanJson) -> Result<ExitCode> {
    super::verify_shard::check_shard_flags(a, plan)?;
    if !plan.device.device.starts_with("cpu") {
        return Err(UsageError(format!(
            "verify --pytorch measures the CPU peak with ckptune's counting allocator; the plan is for {}",
            plan.device.device
        ))
        .into());
    }
    if Path::new(&plan.shape.model).exists() {
        return Err(UsageError(format!(
            "verify --pytorch runs the plain-torch reference of a built-in model; {} is a file (plan the \
             built-in name, or apply the plan in your own loop with ckptune.apply)",
            plan.shape.model
        ))
        .into());
    }
    if let Some(shard) = &plan.shard {
        return super::verify_shard::verify_shard_cmd(a, plan, shard);
    }
    let steps = a.steps.unwrap_or(plan.shape.repeats);
    let pytorch = pytorch_run(&a.plan, steps, &python(a.python.as_deref()))?;
    let ckptune = verify_plan(plan, steps, a.quiet).with_context(|| format!("verifying {}", a.plan.display()))?;
    let report = VerifyPytorchJson {
        format: formats::VERIFY_PYTORCH_FORMAT.into(),
        budget_bytes: plan.budget_bytes,
        predicted: ckptune.predicted.clone(),
        pytorch_peak_error_bytes: pytorch.peak_bytes - ckptune.predicted.peak_bytes,
        pytorch_within_budget: pytorch.peak_bytes <= plan.budget_bytes,
        ckptune,
        pytorch,
    };
    if let Some(out) = &a.output {
        formats::write_atomic(out, &report)?;
    }
    if a.json {
        print_json(&report)?;
    } else {
        print_side_by_side(&report);
    }
    let over: Vec<String> = [
        ("PyTorch's", report.pytorch.peak_bytes, report.pytorch_within_budget),
        (
            "ckptune's",
            report.ckptune.measured.peak_bytes,
            report.ckptune.within_budget,
        ),
    ]
    .iter()
    .filter(|(_, _, ok)| !ok)
    .map(|(who, peak, _)| format!("{who} peak {} ({} B)", format_size(*peak as u64), group_digits(*peak)))
    .collect();
    if !over.is_empty() {
        eprintln!(
            "error: verification failed: {} over the budget {} ({} B)",
            over.join(" and "),
            format_size(report.budget_bytes as u64),
            group_digits(report.budget_bytes)
        );
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

fn print_side_by_side(r: &VerifyPytorchJson) {
    let c: &VerifyJson = &r.ckptune;
    let p = &r.pytorch;
    outln!(
        "verify {} ({} / {} / micro-batch {} × {}), checkpoint {}",
        c.model,
        c.config.precision,
        c.config.optimizer,
        c.config.micro_batch,
        c.config.grad_accum,
        c.regex
    );
    outln!(
        "  {:<15} {:>12} {:>18} {:>14} {:>10}",
        "",
        "peak",
        "bytes",
        "vs predicted",
        "step"
    );
    let row = |label: &str, peak: i64, secs: f64, note: String| {
        outln!(
            "  {:<15} {:>12} {:>18} {:>14} {:>8.3} s{}",
            label,
            format_size(peak.max(0) as u64),
            group_digits(peak),
            if label == "predicted" {
                String::new()
            } else {
                let d = peak - r.predicted.peak_bytes;
                format!("{}{} B", if d >= 0 { "+" } else { "" }, group_digits(d))
            },
            secs,
            note
        );
    };
    row(
        "predicted",
        r.predicted.peak_bytes,
        r.predicted.step_seconds,
        String::new(),
    );
    row(
        "ckptune run",
        c.measured.peak_bytes,
        c.measured.step_seconds.median,
        format!("  (median of {})", c.measured.step_seconds.n),
    );
    row(
        "PyTorch eager",
        p.peak_bytes,
        p.median_seconds,
        format!(
            "  (median of {}; torch {}, {})",
            p.steps.len().saturating_sub(p.warmup),
            p.torch,
            p.optimizer_class
        ),
    );
    if c.mismatches.is_empty() {
        outln!("  ckptune's run matched every moment of the model to the byte");
    } else {
        outln!(
            "  MODEL DEFECT: {} moments of ckptune's run differ from the model",
            c.mismatches.len()
        );
    }
    let verdict = |ok: bool, peak: i64| {
        if ok {
            "within".to_string()
        } else {
            format!("OVER by {}", format_size((peak - r.budget_bytes) as u64))
        }
    };
    outln!(
        "  budget {}: ckptune {}, PyTorch {}",
        format_size(r.budget_bytes as u64),
        verdict(c.within_budget, c.measured.peak_bytes),
        verdict(r.pytorch_within_budget, p.peak_bytes)
    );
}
