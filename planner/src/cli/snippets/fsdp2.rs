//! `--emit fsdp2`: the `python` snippet's loop on N ranks, each a torchrun process, the model
//! sharded as the plan was modelled (docs/fsdp.md, python/ckptune_harness/fsdp/): the plan's
//! modules checkpointed by `ckptune.apply`, `fully_shard` on every unit with the plan's
//! `reshard_after_forward`, then on a root whose forward is the loss.

use std::fmt::Write as _;

use ckptune_solver::formats::{PlanJson, ShardJson};

use super::facts::Facts;
use super::header::{header, loss_note, root_comment};
use super::literals::{plan_literal, py_bool, py_str};
use super::python::training_loop;
use super::template::Template;
use crate::cli::error::UsageError;

pub(super) fn render(plan: &PlanJson, f: &Facts) -> Result<String, UsageError> {
    let shard = plan.shard.as_ref().ok_or_else(|| {
        UsageError(format!(
            "--emit fsdp2: the plan for {} is for one device (it has no shard section); plan for N \
             ranks with `ckptune plan --shard N`, or use --emit python",
            plan.model.name
        ))
    })?;
    let c = &plan.config;
    // The device and process group follow the plan's collective: the plan counted gloo's
    // temporaries for a CPU target and none for NCCL's.
    let init = if shard.collective == "nccl" {
        include_str!("templates/fsdp2_init_nccl.py")
    } else {
        include_str!("templates/fsdp2_init_gloo.py")
    };
    let optimizer = match c.torch_optim_kwarg() {
        Some((key, on)) => format!("{} with {key}={}", c.optimizer, py_bool(on)),
        None => c.optimizer.clone(),
    };
    Ok(Template::new(include_str!("templates/fsdp2.py"))
        .set("header", header(plan, "Plain PyTorch FSDP2 training") + &loss_note(plan, Some("this snippet computes it as `loss_fn` does, and ckptune has not measured the chunked loss under FSDP2")))
        .set("ranks", shard.ranks.to_string())
        .set("plan", plan_literal(plan))
        .set("root_comment", root_comment(f))
        .set("init_process_group", Template::new(init).fill_part())
        .set("units_doc", units_doc(shard))
        .set("fully_shard_units", fully_shard_units(shard))
        .set("micro_batch", c.micro_batch.to_string())
        .set("optimizer", optimizer)
        .set("training_loop", training_loop("device.type", "root(batch)"))
        .fill())
}

/// One `fully_shard` call per unit, in the plan's order.
fn fully_shard_units(shard: &ShardJson) -> String {
    let mut calls = String::new();
    for unit in &shard.units {
        let _ = writeln!(
            calls,
            "    fully_shard(backbone.get_submodule({}), mesh=mesh, reshard_after_forward={})",
            py_str(unit),
            py_bool(shard.reshard_after_forward)
        );
    }
    calls
}

/// What the units do with their gathered parameters, for `shard`'s docstring.
fn units_doc(shard: &ShardJson) -> String {
    match (shard.units.len(), shard.reshard_after_forward) {
        (0, _) => "The plan has no units: the root holds every parameter.".to_string(),
        (k, true) => format!(
            "Each of the {k} units frees its gathered parameters after its forward\n    \
             (reshard_after_forward=True) and gathers them again for its backward."
        ),
        (k, false) => format!(
            "Each of the {k} units keeps its gathered parameters from its forward to its\n    \
             backward (reshard_after_forward=False)."
        ),
    }
}
