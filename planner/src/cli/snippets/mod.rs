//! The plan as a ready snippet for a trainer (`ckptune plan --emit KIND`, `ckptune emit KIND
//! plan.json`) — plain PyTorch, PyTorch FSDP2 on N ranks (`plan --shard N`), Hugging Face
//! `Trainer`, Lightning, torchtitan. Each trainer's code is a template in `templates/`, one
//! file per part; every value filled in comes from the plan (its checkpoint regex and modules,
//! its config, its shape), and where a trainer's own checkpointing option cannot express the
//! plan, the snippet says so and uses the companion. `planner/tests/snippets.rs` holds each
//! trainer's output as a snapshot.

mod facts;
mod fsdp2;
mod header;
mod hf;
mod lightning;
mod literals;
mod python;
mod template;
mod torchtitan;

use facts::Facts;

use crate::cli::args::EmitKind;
use crate::cli::error::UsageError;
use crate::cli::plan_check::{check_plan, check_shard};
use ckptune_solver::formats::PlanJson;

/// Checks that the plan means what it says, then renders the snippet.
pub fn snippet(plan: &PlanJson, kind: EmitKind) -> Result<String, UsageError> {
    check_plan(plan)?;
    if let Some(shard) = &plan.shard {
        check_shard(plan, shard)?;
    }
    if matches!(kind, EmitKind::Hf | EmitKind::Lightning) {
        check_autocast_cache(plan, kind)?;
    }
    let facts = Facts::of(plan);
    Ok(match kind {
        EmitKind::Python => python::render(plan, &facts),
        EmitKind::Fsdp2 => fsdp2::render(plan, &facts)?,
        EmitKind::Hf => hf::render(plan, &facts),
        EmitKind::Lightning => lightning::render(plan, &facts),
        EmitKind::Torchtitan => torchtitan::render(plan, &facts)?,
    })
}

/// The trainers enter autocast themselves: the Hugging Face `Trainer` (accelerate) with its
/// weight-cast cache on, which keeps the casts of weights (checkpointed layers' too) until the loss
/// is made, Lightning's `bf16-mixed`/`16-mixed` with it off (`MixedPrecision` passes
/// `cache_enabled=False`). A mixed-precision plan must have been made for that loop
/// (`--autocast-cache` or not), or its peak is not the trainer's.
fn check_autocast_cache(plan: &PlanJson, kind: EmitKind) -> Result<(), UsageError> {
    let mixed = matches!(plan.config.precision.as_str(), "bf16" | "fp16");
    let (trainer, flag, keeps) = match kind {
        EmitKind::Hf => ("the Hugging Face Trainer", "hf", true),
        _ => ("Lightning", "lightning", false),
    };
    if !mixed || plan.config.autocast_cache == keeps {
        return Ok(());
    }
    Err(UsageError(if keeps {
        format!(
            "emit {flag}: the plan ({}) was made for a loop that turns autocast's cache off \
             (cache_enabled=False), but {trainer} keeps it on, and the cached casts of the weights live \
             until the loss is made, which can exceed the plan's budget; re-plan with `ckptune plan \
             --emit {flag}` (or `--autocast-cache`), or use `--emit python`",
            plan.config.label()
        )
    } else {
        format!(
            "emit {flag}: the plan ({}) counts autocast's cache of weight casts (--autocast-cache), but \
             {trainer} turns the cache off (cache_enabled=False), so the plan's peak is not its loop's; \
             re-plan without --autocast-cache (`ckptune plan --emit {flag}`), or use `--emit python` or `hf`",
            plan.config.label()
        )
    }))
}
