//! `--emit hf`: a Hugging Face `Trainer`, with transformers' per-layer checkpointing flags when
//! the plan names only layers, else `ckptune.apply` before the `Trainer` is built.

use ckptune_solver::formats::PlanJson;

use super::facts::Facts;
use super::header::{header, loss_note, one_process_note, root_comment, step_note};
use super::literals::{plan_literal, policy_text};
use super::template::Template;

pub(super) fn render(plan: &PlanJson, f: &Facts) -> String {
    // transformers' flag checkpoints a layer whole: selective layers need the companion.
    let native = f.only_layers(plan) && plan.checkpoint.selective.is_empty();
    let checkpoint_plan = if native {
        include_str!("templates/hf_checkpoint_layers.py")
    } else {
        include_str!("templates/hf_checkpoint_apply.py")
    };
    let layer_import = if native {
        "from transformers.modeling_layers import GradientCheckpointingLayer\n"
    } else {
        ""
    };
    // (bf16, fp16) TrainingArguments flags: HF's mixed precision is autocast, as ckptune's.
    let (bf16, fp16) = match plan.config.precision.as_str() {
        "bf16" => ("True", "False"),
        "fp16" => ("False", "True"),
        _ => ("False", "False"),
    };
    let zero_grad_comment = if plan.config.set_to_none {
        ""
    } else {
        "    # The plan zeroes gradients in place (set_to_none=False); Trainer frees them after each\n\
         \x20   # step (model.zero_grad()), which keeps no more gradient bytes alive than the plan.\n"
    };
    Template::new(include_str!("templates/hf.py"))
        .set(
            "header",
            header(plan, "Hugging Face Trainer")
                + one_process_note(plan)
                + &loss_note(plan, Some("Trainer computes it whole from the model's logits"))
                + &step_note(plan, "the Trainer (its `optimizers` argument takes one optimizer)"),
        )
        .set("checkpointing_comment", checkpointing_comment(plan, f, native))
        .set("layer_import", layer_import)
        .set("plan", plan_literal(plan))
        .set("root_comment", root_comment(f))
        .set("checkpoint_plan", Template::new(checkpoint_plan).fill_part())
        .set("micro_batch", plan.config.micro_batch.to_string())
        .set("grad_accum", plan.config.grad_accum.to_string())
        .set("zero_grad_comment", zero_grad_comment)
        .set("bf16", bf16)
        .set("fp16", fp16)
        .fill()
}

/// Why the snippet checkpoints the way it does: transformers' own flag (`native`) or the
/// companion.
fn checkpointing_comment(plan: &PlanJson, f: &Facts, native: bool) -> String {
    let n = plan.checkpoint.modules.len();
    if native {
        let mut s = format!(
            "# The plan checkpoints {n} of the {} layers, each a transformers GradientCheckpointingLayer, so\n\
             # transformers' own per-layer flag expresses it exactly: activation checkpointing is enabled\n\
             # (non-reentrant, as ckptune measured) and then switched off on the layers the plan keeps.\n",
            f.layers.len()
        );
        s.push_str(if n == f.layers.len() {
            "# It names every layer, so TrainingArguments(activation_checkpointing=True) would be the same.\n"
        } else {
            "# TrainingArguments(activation_checkpointing=True) (gradient_checkpointing_enable()) would\n\
             # checkpoint every layer and recompute more than the plan needs, so it stays False here.\n"
        });
        s
    } else if plan.checkpoint.modules.is_empty() {
        "# The plan checkpoints nothing: activation checkpointing stays off.\n".into()
    } else if !plan.checkpoint.selective.is_empty() {
        let policies: Vec<&str> = plan
            .checkpoint
            .selective
            .iter()
            .map(|s| policy_text(&s.policy))
            .collect();
        format!(
            "# The plan runs some modules selective ({}).\n\
             # transformers' activation checkpointing cannot express that (it recomputes a layer\n\
             # whole): ckptune.apply wraps exactly the plan's modules, the selective ones with\n\
             # create_selective_checkpoint_contexts, before the Trainer is built, and\n\
             # TrainingArguments(activation_checkpointing=False) keeps transformers from adding more.\n",
            policies.join("; ")
        )
    } else {
        "# The plan checkpoints modules that are not whole layers (or not only layers), which\n\
         # transformers' activation checkpointing cannot express (it checkpoints every layer, or\n\
         # every n-th): ckptune.apply wraps exactly the plan's modules before the Trainer is built,\n\
         # and TrainingArguments(activation_checkpointing=False) keeps transformers from adding more.\n"
            .into()
    }
}
