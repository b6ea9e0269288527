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
    let facts = Facts::of(plan);
    Ok(match kind {
        EmitKind::Python => python::render(plan, &facts),
        EmitKind::Fsdp2 => fsdp2::render(plan, &facts)?,
        EmitKind::Hf => hf::render(plan, &facts),
        EmitKind::Lightning => lightning::render(plan, &facts),
        EmitKind::Torchtitan => torchtitan::render(plan, &facts)?,
    })
}
