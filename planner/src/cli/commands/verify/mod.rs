//! `ckptune verify`: a plan run for real, every moment of an instrumented step compared with
//! the memory model to the byte (`cli::plan_run`). With `--pytorch`, the plan is also run in
//! PyTorch ([`pytorch`]), with `--trainer` also by a trainer through its snippet ([`trainer`]), or for a sharded plan on its N FSDP2 ranks ([`shard`]).

mod pytorch;
mod shard;
mod trainer;

use std::process::ExitCode;

use anyhow::{Context, Result};
use ckptune_solver::budget::format_size;
use ckptune_solver::formats::{self, PlanJson};

use crate::cli::args::VerifyArgs;
use crate::cli::error::UsageError;
use crate::cli::output::print_json;
use crate::cli::plan_run::{print_verify, verify_plan};

pub fn verify_cmd(a: VerifyArgs) -> Result<ExitCode> {
    let plan: PlanJson = formats::read_tagged(&a.plan, formats::PLAN_FORMAT)?;
    crate::cli::plan_check::check_plan(&plan).with_context(|| format!("verifying {}", a.plan.display()))?;
    if a.pytorch {
        return pytorch::verify_pytorch_cmd(&a, &plan);
    }
    if let Some(s) = &plan.shard {
        // ckptune's runtime runs one unsharded process: its peak is no rank's, so measuring it
        // against the per-rank budget would fail a plan that holds (or pass one that does not).
        return Err(UsageError(format!(
            "verify {}: a plan sharded over {} ranks is verified on {} real processes by PyTorch FSDP2; \
             run `ckptune verify --pytorch {}`",
            a.plan.display(),
            s.ranks,
            s.ranks,
            a.plan.display()
        ))
        .into());
    }
    let steps = a.steps.unwrap_or(plan.shape.repeats);
    let r = verify_plan(&plan, steps, a.quiet).with_context(|| format!("verifying {}", a.plan.display()))?;
    if let Some(out) = &a.output {
        formats::write_atomic(out, &r)?;
    }
    if a.json {
        print_json(&r)?;
    } else {
        print_verify(&r);
    }
    if !r.within_budget {
        eprintln!(
            "error: verification failed: measured peak {} is over the budget {}",
            format_size(r.measured.peak_bytes as u64),
            format_size(r.budget_bytes as u64)
        );
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}
