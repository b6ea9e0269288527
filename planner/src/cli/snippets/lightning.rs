//! `--emit lightning`: a callback that applies the plan in `setup`, the plan's precision string
//! and accumulation, and a mix-in for the plan's optimizer and `zero_grad`.

use ckptune_solver::formats::PlanJson;

use super::facts::Facts;
use super::header::{header, loss_note, one_process_note, root_comment, step_note};
use super::literals::{plan_literal, py_str};
use super::template::Template;

pub(super) fn render(plan: &PlanJson, f: &Facts) -> String {
    let precision = match plan.config.precision.as_str() {
        "bf16" => "bf16-mixed",
        "fp16" => "16-mixed",
        "bf16-pure" => "bf16-true",
        _ => "32-true",
    };
    Template::new(include_str!("templates/lightning.py"))
        .set(
            "header",
            header(plan, "Lightning")
                + one_process_note(plan)
                + &loss_note(plan, Some("this module computes it whole from the model's logits"))
                + &step_note(plan, "this module's automatic optimization"),
        )
        .set("plan", plan_literal(plan))
        .set("root_comment", root_comment(f))
        .set("micro_batch", plan.config.micro_batch.to_string())
        .set("grad_accum", plan.config.grad_accum.to_string())
        .set("precision", py_str(precision))
        .fill()
}
