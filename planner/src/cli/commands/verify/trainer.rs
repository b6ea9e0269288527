//! `verify --pytorch --trainer hf|lightning`: the plan run by the trainer its snippet targets.
//! The snippet is the one `ckptune emit` writes (so a plan the snippet refuses, such as an
//! autocast-cache plan for Lightning, is refused here), run by `python -m ckptune_harness.trainers`
//! on the reference the documented loop runs, with the trainers of `.trainers` importable.

use std::path::Path;

use anyhow::{Context, Result};
use ckptune_solver::formats::{PlanJson, PytorchRunJson, TrainerRunJson};

use crate::cli::args::{EmitKind, VerifyTrainer};
use crate::cli::companion::{checkout, companion, harness_run, run_dir};
use crate::cli::output::{group_digits, outln};
use crate::cli::snippets::snippet;

/// The trainer's run, or None for `--trainer eager` (the documented loop runs anyway).
pub(super) fn trainer_run(
    trainer: VerifyTrainer,
    plan: &PlanJson,
    plan_path: &Path,
    steps: usize,
    python: &Path,
) -> Result<Option<PytorchRunJson>> {
    let (kind, name) = match trainer {
        VerifyTrainer::Eager => return Ok(None),
        VerifyTrainer::Hf => (EmitKind::Hf, "hf"),
        VerifyTrainer::Lightning => (EmitKind::Lightning, "lightning"),
    };
    if plan.config.optimizer_in_backward {
        return Err(crate::cli::error::UsageError(format!(
            "verify --pytorch --trainer {name}: the plan steps the optimizer in backward, which the {} \
             snippet cannot express (the trainer steps after backward); verify it with --trainer eager",
            label(name)
        ))
        .into());
    }
    let text = snippet(plan, kind)
        .map_err(|e| crate::cli::error::UsageError(format!("verify --pytorch --trainer {name}: {}", e.0)))?;
    let dir = run_dir()?;
    let path = dir.join(format!("{name}.py"));
    let run = std::fs::write(&path, text)
        .with_context(|| format!("writing {}", path.display()))
        .and_then(|()| {
            let mut cmd = companion(python);
            // The trainers scripts/setup installs, after the companion; a Python that has its own
            // finds them without.
            let root = checkout();
            let paths = [root.join("python"), root.join(".trainers")];
            cmd.env("PYTHONPATH", std::env::join_paths(paths).context("PYTHONPATH")?);
            cmd.args(["-m", "ckptune_harness.trainers", "--trainer", name, "--snippet"])
                .arg(&path)
                .arg("--plan")
                .arg(plan_path);
            harness_run(cmd, steps, python, &format!("the {} run", label(name)))
        });
    let _ = std::fs::remove_dir_all(&dir);
    run.map(Some)
}

fn label(trainer: &str) -> &'static str {
    match trainer {
        "hf" => "HF Trainer",
        "lightning" => "Lightning",
        _ => "trainer",
    }
}

/// The row label of a trainer's run.
pub(super) fn trainer_label(run: &PytorchRunJson) -> &'static str {
    label(run.trainer.as_deref().unwrap_or(""))
}

/// The trainer's peak against the prediction and the budget, and what of its difference from the
/// documented loop's peak its explained bytes leave.
pub(super) fn compare(run: PytorchRunJson, eager: &PytorchRunJson, predicted: i64, budget: i64) -> TrainerRunJson {
    let explained: i64 = run.explained.iter().map(|e| e.bytes).sum();
    TrainerRunJson {
        peak_error_bytes: run.peak_bytes - predicted,
        unexplained_bytes: run.peak_bytes - eager.peak_bytes - explained,
        within_budget: run.peak_bytes <= budget,
        run,
    }
}

/// The trainer's row in the side-by-side table, and its explained bytes below it.
pub(super) fn print_trainer(t: &TrainerRunJson, eager: &PytorchRunJson, row: &dyn Fn(&str, i64, f64, String)) {
    let r = &t.run;
    row(
        trainer_label(r),
        r.peak_bytes,
        r.median_seconds,
        format!(
            "  (median of {}; {})",
            r.steps.len().saturating_sub(r.warmup),
            r.optimizer_class
        ),
    );
    outln!(
        "  {} − PyTorch eager = {} B:",
        trainer_label(r),
        group_digits(r.peak_bytes - eager.peak_bytes)
    );
    for e in &r.explained {
        outln!("    {:>12} B  {}", group_digits(e.bytes), e.why);
    }
    outln!("    {:>12} B  not explained", group_digits(t.unexplained_bytes));
}
