//! The comments every snippet opens with: what was planned, for what, with what prediction,
//! and which submodule of the user's model the plan's names are relative to.

use std::fmt::Write as _;

use ckptune_solver::budget::format_size;
use ckptune_solver::formats::{CudaMemoryJson, PlanJson, RankPredictionJson, ShardJson};

use super::facts::Facts;
use super::literals::{py_bool, py_str, unit_list};
use crate::cli::output::group_digits;

/// The comment every snippet opens with: what was planned, for what, with what prediction.
pub(super) fn header(plan: &PlanJson, trainer: &str) -> String {
    let c = &plan.config;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# {trainer} with the ckptune plan for {} (ckptune {}).",
        plan.model.name, plan.ckptune_version
    );
    let modules = if plan.checkpoint.modules.is_empty() {
        "nothing".to_string()
    } else {
        plan.checkpoint.modules.join(", ")
    };
    let _ = writeln!(s, "#   checkpoint: {modules} (regex {})", plan.checkpoint.regex);
    for sel in &plan.checkpoint.selective {
        let _ = writeln!(
            s,
            "#   of them selective (policy {}: {}): {}",
            sel.policy,
            super::literals::policy_text(&sel.policy),
            sel.modules.join(", ")
        );
    }
    let _ = writeln!(
        s,
        "#   config {}: precision {}, optimizer {}, micro-batch {}, gradient accumulation {}, set_to_none {}",
        c.label(),
        c.precision,
        c.optimizer,
        c.micro_batch,
        c.grad_accum,
        c.set_to_none
    );
    if c.optimizer_in_backward {
        let _ = writeln!(
            s,
            "#   optimizer step in backward: each parameter updated as soon as its gradient is complete, in its \
             post-accumulate-grad hook, its gradient freed there (ckptune.optimizer_in_backward)"
        );
    }
    let mut shape = Vec::new();
    if let Some(i) = plan.shape.image {
        shape.push(format!("images {i}x{i}"));
    }
    if let Some(q) = plan.shape.seq {
        shape.push(format!("sequences of {q} tokens"));
    }
    if !shape.is_empty() {
        let _ = writeln!(s, "#   inputs: {}", shape.join(", "));
    }
    if let Some(attention) = &plan.shape.attention {
        // Eager attention keeps [batch, heads, seq, seq] scores that SDPA does not: the plan's
        // bytes hold for the implementation it measured.
        let _ = writeln!(
            s,
            "#   attention: attn_implementation=\"{attention}\" (load the model with it: the plan's memory is that attention's)"
        );
    }
    let _ = writeln!(
        s,
        "#   predicted peak {} ({} B) of the budget {} ({} B), measured on {}, threads: {}",
        format_size(plan.predicted.peak_bytes.max(0) as u64),
        group_digits(plan.predicted.peak_bytes),
        format_size(plan.budget_bytes.max(0) as u64),
        group_digits(plan.budget_bytes),
        plan.device.device,
        plan.device.threads
    );
    if let Some(shard) = &plan.shard {
        s.push_str(&shard_header(shard, c.micro_batch));
    }
    if let Some(cuda) = &plan.cuda_memory {
        s.push_str(&alloc_conf_lines(cuda));
    }
    s
}

/// A CUDA plan's caching-allocator setting, set before anything allocates on the GPU: PyTorch
/// reads `PYTORCH_CUDA_ALLOC_CONF` once, when CUDA's allocator starts.
fn alloc_conf_lines(cuda: &CudaMemoryJson) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "#   on the GPU ({}): predicted {} allocated, {} reserved by the caching allocator, plus {} of CUDA context",
        cuda.gpu,
        format_size(cuda.predicted_allocated_peak_bytes.max(0) as u64),
        format_size(cuda.predicted_reserved_peak_bytes.max(0) as u64),
        format_size(cuda.context_bytes.max(0) as u64)
    );
    if cuda.alloc_conf.is_empty() {
        s.push_str("#   PyTorch's default PYTORCH_CUDA_ALLOC_CONF is the recommended setting: leave it unset.\n");
    } else {
        let _ = writeln!(
            s,
            "# The recommended allocator setting (docs/cuda-allocator.md), set before CUDA starts (PyTorch\n\
             # reads it once, at the first allocation on the GPU):\n\
             import os\n\
             os.environ[\"PYTORCH_CUDA_ALLOC_CONF\"] = {}",
            py_str(&cuda.alloc_conf)
        );
    }
    s
}

/// The header's lines for a sharded plan: the ranks, the units, each rank's predicted peak.
pub(super) fn shard_header(shard: &ShardJson, micro_batch: i64) -> String {
    let mut s = String::new();
    let units = if shard.units.is_empty() {
        "on the root only (every parameter)".to_string()
    } else {
        format!(
            "on {} (reshard_after_forward={}), then on the root (every other parameter)",
            unit_list(&shard.units),
            py_bool(shard.reshard_after_forward)
        )
    };
    let _ = writeln!(
        s,
        "#   sharded over {n} ranks with FSDP2 ({}): fully_shard {units}; micro-batch {micro_batch} per rank, \
         {} samples per micro-step over the {n} ranks",
        shard.collective,
        micro_batch * shard.ranks,
        n = shard.ranks,
    );
    // Ranks with the same prediction in one entry: `ranks 0–2 …; rank 3 …`.
    let mut groups: Vec<(i64, i64, &RankPredictionJson)> = Vec::new();
    for r in &shard.per_rank {
        match groups.last_mut() {
            Some((_, last, g)) if g.peak_bytes == r.peak_bytes && g.peak_moment == r.peak_moment => *last = r.rank,
            _ => groups.push((r.rank, r.rank, r)),
        }
    }
    let entries: Vec<String> = groups
        .iter()
        .map(|(first, last, r)| {
            let who = if first == last {
                format!("rank {first}")
            } else {
                format!("ranks {first}–{last}")
            };
            format!(
                "{who} {} ({} B) at {}",
                format_size(r.peak_bytes.max(0) as u64),
                group_digits(r.peak_bytes),
                r.peak_moment
            )
        })
        .collect();
    if !entries.is_empty() {
        let _ = writeln!(s, "#   predicted peak per rank: {}", entries.join("; "));
    }
    s
}

/// For a plan whose loss is chunked: how the snippet computes it, or, where `unexpressed` names
/// what the trainer does instead, that it does not.
pub(super) fn loss_note(plan: &PlanJson, unexpressed: Option<&str>) -> String {
    let n = plan.config.chunks();
    if n == 1 {
        return String::new();
    }
    match unexpressed {
        None => format!(
            "# The plan computes the loss in {n} chunks of tokens (`ckptune.chunked_causal_lm_loss`); \
             `lm_loss` below does, pass it as `loss_fn`.\n"
        ),
        Some(instead) => format!(
            "# NOT EXPRESSED: the plan computes the loss in {n} chunks of tokens \
             (`ckptune.chunked_causal_lm_loss`); {instead}, holding the [tokens, vocab] logits and \
             their gradient at once, so it can peak above the plan's prediction.\n"
        ),
    }
}

/// For a plan that steps the optimizer in backward, in a trainer that steps it after backward
/// (`trainer` says how): that the snippet does not express it.
pub(super) fn step_note(plan: &PlanJson, trainer: &str) -> String {
    if !plan.config.optimizer_in_backward {
        return String::new();
    }
    format!(
        "# NOT EXPRESSED: the plan steps the optimizer in backward (`ckptune.optimizer_in_backward`); {trainer} \
         steps it after backward, holding every parameter gradient at once, so it can peak above the plan's \
         prediction. `ckptune emit python` writes a loop that steps in backward.\n"
    )
}

/// For the one-process snippets of a sharded plan: what they leave out.
pub(super) fn one_process_note(plan: &PlanJson) -> &'static str {
    if plan.shard.is_some() {
        "# This snippet trains on one process, without the plan's sharding: `ckptune emit fsdp2` writes that.\n"
    } else {
        ""
    }
}

/// What `ckptune.apply` does with the user's whole model: the plan records the backbone its
/// names are relative to, and apply looks there.
pub(super) fn root_comment(f: &Facts) -> String {
    if f.backbone.is_empty() {
        format!(
            "# The plan's module names are those of {}.\n\
             # ckptune.apply refuses, naming the closest modules, a model whose names differ.\n",
            f.task_model
        )
    } else {
        let layer = f.layers.first().map(String::as_str).unwrap_or("…");
        format!(
            "# ckptune plans the backbone: the plan's `{layer}` is `{}.{layer}` of\n\
             # {}. The plan records that, so ckptune.apply takes\n\
             # the whole model (or the backbone, or a module holding either) and refuses, naming the\n\
             # closest modules, a model whose names differ.\n",
            f.backbone, f.task_model
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_header_groups_ranks_with_the_same_prediction() {
        let rank = |rank, peak_bytes, moment: &str| RankPredictionJson {
            rank,
            peak_bytes,
            peak_moment: moment.into(),
        };
        let units: Vec<String> = (0..12).map(|i| format!("model.layers.{i}")).collect();
        let shard = ShardJson {
            ranks: 4,
            reshard_after_forward: false,
            collective: "nccl".into(),
            units,
            per_rank: vec![
                rank(0, 2048, "forward layer4"),
                rank(1, 2048, "forward layer4"),
                rank(2, 2048, "forward layer4"),
                rank(3, 1024, "optimizer"),
            ],
        };
        assert_eq!(
            shard_header(&shard, 2),
            "#   sharded over 4 ranks with FSDP2 (nccl): fully_shard on model.layers.0, model.layers.1, …, \
             model.layers.11 (12 units) (reshard_after_forward=False), then on the root (every other \
             parameter); micro-batch 2 per rank, 8 samples per micro-step over the 4 ranks\n\
             #   predicted peak per rank: ranks 0–2 2.00 KiB (2,048 B) at forward layer4; rank 3 1.00 KiB \
             (1,024 B) at optimizer\n"
        );
    }
}
