//! `--emit torchtitan`: torchtitan's `activation_checkpoint` config for a Llama-family plan
//! (FullAC when the plan names every block, else a FullAC subclass on exactly the plan's
//! modules), its batch, precision and optimizer fields, and with a shard section its FSDP2
//! parallelism.

use std::fmt::Write as _;

use ckptune_solver::formats::{PlanJson, ShardJson};

use super::facts::Facts;
use super::header::{header, loss_note, step_note};
use super::literals::{policy_text, py, py_bool, py_str, unit_list};
use super::template::Template;
use crate::cli::error::UsageError;

pub(super) fn render(plan: &PlanJson, f: &Facts) -> Result<String, UsageError> {
    if f.layers.is_empty() || !f.layers[0].starts_with("model.layers.") {
        return Err(UsageError(format!(
            "--emit torchtitan: torchtitan trains its own decoder implementations (Llama 3, Qwen3, \
             DeepSeek-V3, …), and {} is not a Llama-family model; use --emit python, hf or lightning",
            plan.model.name
        )));
    }
    let names = torchtitan_names(&plan.checkpoint.modules)?;
    let (choice_comment, activation_checkpoint, selective_class) = if plan.checkpoint.selective.is_empty() {
        let (comment, config) = choice(f, &names);
        (comment.to_owned(), config, String::new())
    } else {
        selective_choice(plan, f)?
    };
    let c = &plan.config;
    // `optimizer_impl` (single, foreach, fused) as the plan's config names it, when it does.
    let optimizer_kwargs = match c.torch_optim_kwarg() {
        Some((key, on)) => format!("{{\"{key}\": {}}}", py_bool(on)),
        None => "{}".to_owned(),
    };
    let apply_plan = match &plan.shard {
        None => Template::new(include_str!("templates/torchtitan_apply.py")).fill_part(),
        Some(shard) => sharded_apply(plan, shard),
    };
    Ok(Template::new(include_str!("templates/torchtitan.py"))
        .set(
            "header",
            header(plan, "torchtitan")
                + &loss_note(plan, Some("torchtitan computes it whole from the model's logits"))
                + &step_note(plan, "torchtitan's train loop"),
        )
        .set("choice_comment", choice_comment)
        .set("selective_class", selective_class)
        .set("activation_checkpoint", activation_checkpoint)
        .set("training_fields", training_fields(plan))
        .set("optimizer", c.optimizer.clone())
        .set("optimizer_kwargs", optimizer_kwargs)
        .set("apply_plan", apply_plan)
        .fill())
}

/// What the plan asks of torchtitan's activation checkpointing, as a comment and a config:
/// nothing, every block (FullAC), or exactly the plan's modules.
fn choice(f: &Facts, names: &[String]) -> (&'static str, String) {
    let all_layers: Vec<String> = f.layers.iter().filter_map(|l| torchtitan_name(l)).collect();
    let mut sorted = names.to_vec();
    sorted.sort();
    let mut all_sorted = all_layers;
    all_sorted.sort();
    if names.is_empty() {
        ("# The plan checkpoints nothing.\n", "None".to_string())
    } else if sorted == all_sorted {
        (
            "# The plan checkpoints every block: FullAC is exactly that.\n",
            "FullAC.Config()".to_string(),
        )
    } else {
        ("", format!("CkptunePlanAC.Config(modules={})", py(&names.to_vec())))
    }
}

/// torchtitan's names of the plan's `modules`; a module torchtitan's Llama lacks is refused.
fn torchtitan_names(modules: &[String]) -> Result<Vec<String>, UsageError> {
    modules
        .iter()
        .map(|m| {
            torchtitan_name(m).ok_or_else(|| {
                UsageError(format!(
                    "--emit torchtitan: torchtitan's Llama has no module that corresponds to {m} (it has \
                     tok_embeddings, layers.N with attention and feed_forward, norm, output); use --emit python"
                ))
            })
        })
        .collect()
}

/// A plan running some modules selective: its full modules and its selective modules with each
/// one's policy as a `CkptuneSelectivePlanAC` config (torchtitan's own `SelectiveAC` runs every
/// block under its own policy, so it is named as the nearest mode, not used), with a comment
/// saying so and the class.
fn selective_choice(plan: &PlanJson, f: &Facts) -> Result<(String, String, String), UsageError> {
    let ck = &plan.checkpoint;
    let full: Vec<String> = ck
        .modules
        .iter()
        .filter(|m| ck.policy_of(m).is_none())
        .cloned()
        .collect();
    let full = torchtitan_names(&full)?;
    let mut comment = String::new();
    // torchtitan name → policy, in the plan's order.
    let mut selective: Vec<(String, String)> = Vec::new();
    for sel in &ck.selective {
        let names = torchtitan_names(&sel.modules)?;
        comment.push_str(&format!(
            "# The plan runs these modules selective under its {} policy\n# ({}): {}.\n",
            sel.policy,
            policy_text(&sel.policy),
            unit_list(&names)
        ));
        selective.extend(names.into_iter().map(|n| (n, sel.policy.clone())));
    }
    let every_block = {
        let mut all: Vec<String> = f.layers.iter().filter_map(|l| torchtitan_name(l)).collect();
        let mut s: Vec<String> = selective.iter().map(|(n, _)| n.clone()).collect();
        all.sort();
        s.sort();
        full.is_empty() && s == all
    };
    if !full.is_empty() {
        comment.push_str(&format!("# It checkpoints these whole: {}.\n", unit_list(&full)));
    }
    comment.push_str(
        "# torchtitan's SelectiveAC runs every block under its own op policy (saving every other\n\
         # matmul), so CkptuneSelectivePlanAC below wraps the plan's selective modules with ckptune's\n\
         # policy instead. torchtitan's Llama attends with flex attention by default, a higher-order\n\
         # operator either policy recomputes.\n",
    );
    if every_block {
        comment.push_str(
            "# It names every block: SelectiveAC.Config() is torchtitan's nearest own mode, with its\n\
             # policy's memory, not the plan's.\n",
        );
    }
    let pairs: Vec<String> = selective
        .iter()
        .map(|(n, p)| format!("{}: {}", py_str(n), py_str(p)))
        .collect();
    let config = format!(
        "CkptuneSelectivePlanAC.Config(modules={}, selective={{{}}})",
        py(&full),
        pairs.join(", ")
    );
    let class = Template::new(include_str!("templates/torchtitan_selective.py")).fill_part();
    Ok((comment, config, class))
}

/// The `TrainingConfig` fields for the plan's batch, sequence and precision, one per line.
fn training_fields(plan: &PlanJson) -> String {
    let c = &plan.config;
    let (dtype, mp) = match c.precision.as_str() {
        "bf16-pure" => ("bfloat16", "float32"),
        "bf16" => ("float32", "bfloat16"),
        _ => ("float32", "float32"),
    };
    let (ranks, over) = match &plan.shard {
        None => (1, "on one data-parallel rank: x the DP degree".to_owned()),
        Some(shard) => (shard.ranks, format!("over the {} data-parallel ranks", shard.ranks)),
    };
    let mut training = format!(
        "    \"local_batch_size\": {mb},\n    \"global_batch_size\": {gb},  # {over}\n",
        mb = c.micro_batch,
        gb = c.micro_batch * c.grad_accum * ranks
    );
    if let Some(q) = plan.shape.seq {
        let _ = writeln!(training, "    \"seq_len\": {q},");
    }
    let _ = writeln!(training, "    \"dtype\": {},", py_str(dtype));
    let _ = writeln!(training, "    \"mixed_precision_param\": {},", py_str(mp));
    training
}

/// The parallelism fields and `apply_plan` of a sharded plan.
fn sharded_apply(plan: &PlanJson, shard: &ShardJson) -> String {
    let plan_units = if shard.units.is_empty() {
        "none (the root holds every parameter)".to_string()
    } else {
        let mapped: Vec<String> = shard
            .units
            .iter()
            .map(|u| torchtitan_name(u).unwrap_or_else(|| u.clone()))
            .collect();
        unit_list(&mapped)
    };
    let mixed_precision_comment = if plan.config.precision == "bf16" {
        "# Under FSDP torchtitan casts through MixedPrecisionPolicy (mixed_precision_param: bf16\n\
         # all-gathers), where the plan counted fp32 parameters under autocast.\n"
    } else {
        ""
    };
    Template::new(include_str!("templates/torchtitan_apply_sharded.py"))
        .set("ranks", shard.ranks.to_string())
        .set("reshard_after_forward", py_bool(shard.reshard_after_forward))
        .set("plan_units", plan_units)
        .set("mixed_precision_comment", mixed_precision_comment)
        .set(
            "policy",
            py_str(if shard.reshard_after_forward { "always" } else { "never" }),
        )
        .fill_part()
}

/// torchtitan's Llama 3 module names for ckptune's (Hugging Face's) Llama names.
fn torchtitan_name(name: &str) -> Option<String> {
    let map_child = |rest: &str| match rest {
        "self_attn" => Some("attention"),
        "mlp" => Some("feed_forward"),
        _ => None,
    };
    match name {
        "model.embed_tokens" => return Some("tok_embeddings".into()),
        "model.norm" => return Some("norm".into()),
        _ => {}
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (index, child) = match rest.split_once('.') {
        Some((i, c)) => (i, Some(c)),
        None => (rest, None),
    };
    if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    match child {
        None => Some(format!("layers.{index}")),
        Some(c) => map_child(c).map(|t| format!("layers.{index}.{t}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torchtitan_names() {
        assert_eq!(torchtitan_name("model.layers.3").as_deref(), Some("layers.3"));
        assert_eq!(
            torchtitan_name("model.layers.12.mlp").as_deref(),
            Some("layers.12.feed_forward")
        );
        assert_eq!(
            torchtitan_name("model.layers.0.self_attn").as_deref(),
            Some("layers.0.attention")
        );
        assert_eq!(torchtitan_name("model.embed_tokens").as_deref(), Some("tok_embeddings"));
        assert_eq!(torchtitan_name("model.layers.0.input_layernorm"), None);
        assert_eq!(torchtitan_name("model.layers.x"), None);
        assert_eq!(torchtitan_name("layer1"), None);
    }
}
