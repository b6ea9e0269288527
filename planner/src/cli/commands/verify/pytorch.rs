//! `ckptune verify --pytorch`: the plan run twice — by ckptune's runtime (as `verify` does) and
//! in PyTorch eager on the plain-torch reference of the built-in model or of the Llama-family
//! `config.json` (`python -m ckptune_harness.eager`,
//! the companion's run with ckptune's counting allocator loaded into the Python process) — and
//! reported beside the prediction. Exit 1 when either run peaks over the budget. A plan with a
//! `shard` section goes to [`super::shard`] instead: FSDP2 on its N ranks.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};
use ckptune_solver::budget::format_size;
use ckptune_solver::formats::{self, PlanJson, PytorchRunJson, SelectiveJson, VerifyJson, VerifyPytorchJson};

use super::shard::{check_shard_flags, verify_shard_cmd};
use super::trainer::{compare, print_trainer, trainer_label, trainer_run};
use crate::cli::args::VerifyArgs;
use crate::cli::companion::{companion, harness_run, python};
use crate::cli::error::UsageError;
use crate::cli::output::{group_digits, outln, print_json};
use crate::cli::plan_run::{print_verify_heading, selective_text, verify_plan};

/// Runs `python -m ckptune_harness.eager` on the plan file. Its exit code 2 (a plan the PyTorch run
/// cannot follow: names that differ from the reference's, a model without a reference) is bad
/// input here too, with its message.
fn pytorch_run(plan_path: &Path, steps: usize, python: &Path) -> Result<PytorchRunJson> {
    let mut cmd = companion(python);
    cmd.args(["-m", "ckptune_harness.eager", "--plan"]).arg(plan_path);
    harness_run(cmd, steps, python, "the PyTorch run")
}

/// Fails unless `run` (the documented loop's, or a trainer's) ran the plan's selective modules
/// each under the plan's policy for it, as read back from the wrapped modules.
fn check_selective(what: &str, run: &PytorchRunJson, plan: &PlanJson) -> Result<()> {
    let pairs = |sel: &[SelectiveJson]| -> BTreeSet<(String, String)> {
        sel.iter()
            .flat_map(|s| s.modules.iter().map(|m| (m.clone(), s.policy.clone())))
            .collect()
    };
    if pairs(&run.selective) != pairs(&plan.checkpoint.selective) {
        anyhow::bail!(
            "the {what} did not run the plan's selective modules: it ran {}, the plan says {} \
             (is the ckptune package on its path this checkout's?)",
            or_none(&selective_text(&run.selective)),
            or_none(&selective_text(&plan.checkpoint.selective))
        );
    }
    Ok(())
}

/// A Hugging Face folder holding a `config.json`, or the file itself: the harness builds the
/// reference of a Llama-family one from its fields (`models/fixtures/reference.py`,
/// `build_config`) and says which model types it cannot.
fn is_hf_config(path: &Path) -> bool {
    let file = if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    };
    file.file_name().is_some_and(|n| n == "config.json") && file.is_file()
}

fn or_none(text: &str) -> &str {
    match text.trim() {
        "" => "none",
        t => t,
    }
}

/// The PyTorch run first (a plan it refuses is bad input, before minutes of ckptune's run),
/// then ckptune's.
pub fn verify_pytorch_cmd(a: &VerifyArgs, plan: &PlanJson) -> Result<ExitCode> {
    check_shard_flags(a, plan)?;
    if !plan.device.device.starts_with("cpu") {
        return Err(UsageError(format!(
            "verify --pytorch measures the CPU peak with ckptune's counting allocator; the plan is for {}",
            plan.device.device
        ))
        .into());
    }
    if Path::new(&plan.shape.model).exists() && !is_hf_config(Path::new(&plan.shape.model)) {
        return Err(UsageError(format!(
            "verify --pytorch runs the plain-torch reference of a built-in model or of a Hugging Face \
             config.json; {} is another file (plan the built-in name, or apply the plan in your own loop \
             with ckptune.apply)",
            plan.shape.model
        ))
        .into());
    }
    if let Some(shard) = &plan.shard {
        return verify_shard_cmd(a, plan, shard);
    }
    let steps = a.steps.unwrap_or(plan.shape.repeats);
    let py = python(a.python.as_deref());
    let pytorch = pytorch_run(&a.plan, steps, &py)?;
    check_selective("PyTorch run", &pytorch, plan)?;
    if pytorch.optimizer_in_backward != plan.config.optimizer_in_backward {
        anyhow::bail!(
            "the PyTorch run stepped the optimizer {}, the plan says {} (is the ckptune package on its path \
             this checkout's?)",
            step_text(pytorch.optimizer_in_backward),
            step_text(plan.config.optimizer_in_backward)
        );
    }
    let trainer_run = trainer_run(a.trainer, plan, &a.plan, steps, &py)?;
    if let Some(run) = &trainer_run {
        check_selective(&format!("{} run", trainer_label(run)), run, plan)?;
    }
    let ckptune = verify_plan(plan, steps, a.quiet).with_context(|| format!("verifying {}", a.plan.display()))?;
    let trainer = trainer_run.map(|run| compare(run, &pytorch, ckptune.predicted.peak_bytes, plan.budget_bytes));
    let report = VerifyPytorchJson {
        format: formats::VERIFY_PYTORCH_FORMAT.into(),
        budget_bytes: plan.budget_bytes,
        predicted: ckptune.predicted.clone(),
        pytorch_peak_error_bytes: pytorch.peak_bytes - ckptune.predicted.peak_bytes,
        pytorch_within_budget: pytorch.peak_bytes <= plan.budget_bytes,
        ckptune,
        pytorch,
        trainer,
    };
    if let Some(out) = &a.output {
        formats::write_atomic(out, &report)?;
    }
    if a.json {
        print_json(&report)?;
    } else {
        print_side_by_side(&report);
    }
    let mut peaks = vec![
        (
            "PyTorch's".to_string(),
            report.pytorch.peak_bytes,
            report.pytorch_within_budget,
        ),
        (
            "ckptune's".to_string(),
            report.ckptune.measured.peak_bytes,
            report.ckptune.within_budget,
        ),
    ];
    if let Some(t) = &report.trainer {
        peaks.push((
            format!("{}'s", trainer_label(&t.run)),
            t.run.peak_bytes,
            t.within_budget,
        ));
    }
    let over: Vec<String> = peaks
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
    print_verify_heading(c);
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
    if let Some(t) = &r.trainer {
        print_trainer(t, p, &row);
    }
    if !c.selective.is_empty() || !p.selective.is_empty() {
        // What PyTorch ran, from the wrapped modules themselves, not the plan.
        let ran = match selective_text(&p.selective) {
            t if t.is_empty() => "no module selective".to_owned(),
            t => format!("{t} (ckptune.apply)"),
        };
        outln!("  PyTorch ran {ran}");
    }
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
    let trainer = r.trainer.as_ref().map_or(String::new(), |t| {
        format!(
            ", {} {}",
            trainer_label(&t.run),
            verdict(t.within_budget, t.run.peak_bytes)
        )
    });
    outln!(
        "  budget {}: ckptune {}, PyTorch {}{trainer}",
        format_size(r.budget_bytes as u64),
        verdict(c.within_budget, c.measured.peak_bytes),
        verdict(r.pytorch_within_budget, p.peak_bytes)
    );
}

/// When a run stepped the optimizer, in words.
fn step_text(in_backward: bool) -> &'static str {
    if in_backward {
        "in backward"
    } else {
        "after backward"
    }
}
