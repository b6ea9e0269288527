//! `--emit python`: `ckptune.apply` and a `ckptune.training_config` loop in plain PyTorch.

use ckptune_solver::formats::PlanJson;

use super::facts::Facts;
use super::header::{header, loss_note, one_process_note, root_comment};
use super::literals::plan_literal;
use super::template::Template;

pub(super) fn render(plan: &PlanJson, f: &Facts) -> String {
    Template::new(include_str!("templates/python.py"))
        .set(
            "header",
            header(plan, "Plain PyTorch training") + one_process_note(plan) + &loss_note(plan, None),
        )
        .set("loss_helper", loss_helper(plan))
        .set("plan", plan_literal(plan))
        .set("root_comment", root_comment(f))
        .set("micro_batch", plan.config.micro_batch.to_string())
        .set("optimizer", optimizer_line(plan))
        .set("training_loop", loop_for(plan))
        .fill()
}

/// How the snippet builds the optimizer: one per parameter stepped in backward where the plan
/// says so, else `torch.optim`'s over all of them.
fn optimizer_line(plan: &PlanJson) -> &'static str {
    if plan.config.optimizer_in_backward {
        "    # The plan steps the optimizer in backward: one optimizer per parameter, stepped in its\n\
         \x20   # post-accumulate-grad hook as soon as its gradient is complete (no opt.step() below).\n\
         \x20   opt = ckptune.optimizer_in_backward(model.parameters(), cfg.optimizer_class, lr=lr, **cfg.optimizer_kwargs)\n"
    } else {
        "    opt = cfg.optimizer_class(model.parameters(), lr=lr, **cfg.optimizer_kwargs)\n"
    }
}

/// The plain loop, or for a plan that steps the optimizer in backward the loop without a step.
fn loop_for(plan: &PlanJson) -> String {
    if plan.config.optimizer_in_backward {
        Template::new(include_str!("templates/training_loop_in_backward.py"))
            .set("device_type", "device")
            .set("loss", "loss_fn(model, batch)")
            .fill_part()
    } else {
        training_loop("device", "loss_fn(model, batch)")
    }
}

/// The loop of every plain-PyTorch snippet, one step per batch: `device_type` names the
/// autocast device, `loss` computes one micro-batch's loss.
pub(super) fn training_loop(device_type: &str, loss: &str) -> String {
    Template::new(include_str!("templates/training_loop.py"))
        .set("device_type", device_type)
        .set("loss", loss)
        .fill_part()
}

/// For a plan whose loss is chunked, `lm_loss`: the companion's chunked loss as a `loss_fn`.
fn loss_helper(plan: &PlanJson) -> String {
    match plan.config.chunks() {
        1 => String::new(),
        n => Template::new(include_str!("templates/lm_loss.py"))
            .set("chunks", n.to_string())
            .fill(),
    }
}
