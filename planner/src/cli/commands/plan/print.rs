//! What `plan` prints: the alternatives, the chosen plan and its notes, and why an 8-bit
//! optimizer was chosen.

use ckptune_solver::budget::format_size;
use ckptune_solver::formats::{CheckpointJson, CudaMemoryJson, PlanJson};
use ckptune_solver::profile::ConfigSpec;
use ckptune_solver::regex_emit::MATCH_NOTHING;

use super::solve::shard_label;
use crate::cli::output::outln;
use crate::cli::timing::range_text;

/// Why an 8-bit optimizer was chosen: the measured state saved and the measured step time
/// against the same config with the 32-bit optimizer, when both were profiled.
pub(super) fn eight_bit_note(p: &PlanJson) -> Option<String> {
    let name = p.config.optimizer.strip_suffix("8bit")?;
    let full = p.alternatives.iter().find(|a| {
        a.config.optimizer == name
            && a.config.precision == p.config.precision
            && a.config.micro_batch == p.config.micro_batch
            && a.config.set_to_none == p.config.set_to_none
            && a.config.chunks() == p.config.chunks()
            && a.config.optimizer_in_backward == p.config.optimizer_in_backward
    })?;
    let chosen = p.alternatives.iter().find(|a| a.config == p.config)?;
    let saved = full.baseline_peak_bytes - chosen.baseline_peak_bytes;
    let other = if full.feasible {
        format!(
            "{name}'s best plan that fits runs at {:.3} s",
            full.predicted.step_seconds
        )
    } else {
        format!(
            "{name} does not fit at all (its smallest peak is {})",
            format_size(full.predicted.peak_bytes as u64)
        )
    };
    Some(format!(
        "{} chosen over {name}: with nothing checkpointed it peaks {} lower (8-bit moments); \
         its plan runs at {:.3} s per step, and {other}",
        p.config.optimizer,
        format_size(saved.max(0) as u64),
        chosen.predicted.step_seconds,
    ))
}

/// The `--target` a CUDA plan's overheads were for: `cuda`, or `cuda:NAME` of a named GPU.
pub(super) fn cuda_target(key: &str) -> String {
    if key == "cuda" {
        key.to_string()
    } else {
        format!("cuda:{key}")
    }
}

pub(super) fn print_plan(p: &PlanJson) {
    let measured = p.device.label();
    // A plan for another device than the one measured on (`--target cuda:h100` from a CPU)
    // names both, as its numbers are the target's.
    let target = p
        .cuda_memory
        .as_ref()
        .map_or_else(|| p.target_device.clone(), |c| cuda_target(&c.gpu));
    let budget = format_size(p.budget_bytes as u64);
    if target.is_empty() || p.target_device == p.device.device {
        outln!("{} on {measured}, budget {budget}", p.model.name);
    } else {
        outln!("{} for {target}, measured on {measured}, budget {budget}", p.model.name);
    }
    if let Some(s) = &p.budget_share {
        outln!(
            "  ({}% of the way from the smallest peak checkpointing reaches, {}, to the unconstrained peak, {}, of {})",
            s.percent,
            format_size(s.smallest_peak_bytes as u64),
            format_size(s.unconstrained_peak_bytes as u64),
            s.config
        );
    }
    outln!();
    outln!(
        "  {:<32} {:>5} {:>12} {:>12} {:>9}  checkpoint",
        "config",
        "fits",
        "peak",
        if p.alternatives
            .iter()
            .any(|a| a.predicted.step_seconds_estimated.is_some())
        {
            "step (est.)"
        } else {
            "step"
        },
        "slowdown"
    );
    let chosen_raf = p.shard.as_ref().map(|s| s.reshard_after_forward);
    for a in &p.alternatives {
        let mark = if a.config == p.config && a.reshard_after_forward == chosen_raf {
            "*"
        } else {
            " "
        };
        // A sharded plan's rows come in pairs per config: FSDP2 resharding each unit after
        // its forward, and keeping it unsharded until its backward.
        let label = match (a.reshard_after_forward, &p.shard) {
            (Some(raf), Some(s)) => shard_label(&a.config, s.ranks, raf),
            _ => a.config.label(),
        };
        outln!(
            "{mark} {:<32} {:>5} {:>12} {:>10.3} s {:>8.1}%  {}",
            label,
            if a.feasible { "yes" } else { "no" },
            format_size(a.predicted.peak_bytes as u64),
            a.predicted.step_seconds,
            100.0 * (a.predicted.step_seconds / a.baseline_step_seconds - 1.0),
            checkpoint_column(&a.checkpoint)
        );
    }
    match &p.shard {
        Some(s) => outln!(
            "\nplan: {} on {} ranks, reshard_after_forward={}",
            p.config.label(),
            s.ranks,
            if s.reshard_after_forward { "True" } else { "False" }
        ),
        None => outln!("\nplan: {}", p.config.label()),
    }
    for n in &p.notes {
        outln!("  note: {n}");
    }

    // The never-matching pattern puzzles readers who have not seen it; say what it means.
    let meaning = if p.checkpoint.modules.is_empty() {
        " (matches no module: nothing needs checkpointing)"
    } else {
        ""
    };
    outln!("  checkpoint regex: {}{meaning}", p.checkpoint.regex);
    print_states(p);
    match &p.cuda_memory {
        Some(c) => print_cuda_memory(p, c),
        None => outln!(
            "  predicted peak:   {} of {} ({} to spare), at {}",
            format_size(p.predicted.peak_bytes as u64),
            format_size(p.budget_bytes as u64),
            format_size(p.margin_bytes.max(0) as u64),
            p.predicted.peak_moment
        ),
    }
    let how = match (&p.predicted.step_seconds_estimated, p.predicted.step_seconds_range) {
        (Some(e), _) => format!("{e}; "),
        (None, Some(r)) => format!("{} over the profile's samples; ", range_text(r)),
        (None, None) => String::new(),
    };
    outln!(
        "  predicted step:   {:.3} s ({how}{:.1}% throughput lost to recompute)",
        p.predicted.step_seconds,
        100.0 * p.predicted.throughput_loss
    );
    outln!(
        "  training config:  precision {}, optimizer {}, micro-batch {}, gradient accumulation {}, set_to_none {}{}{}",
        p.config.precision,
        optimizer_in_pytorch(&p.config),
        p.config.micro_batch,
        p.config.grad_accum,
        p.config.set_to_none,
        match p.config.chunks() {
            1 => String::new(),
            n => format!(", loss in {n} chunks (ckptune.chunked_causal_lm_loss)"),
        },
        if p.config.optimizer_in_backward {
            ", optimizer step in backward (ckptune.optimizer_in_backward)"
        } else {
            ""
        }
    );
}

/// An alternative's checkpointed modules, those run selective marked with their policy
/// (`[selective matmul]`).
fn checkpoint_column(c: &CheckpointJson) -> String {
    if c.modules.is_empty() {
        return "(nothing)".into();
    }
    c.modules
        .iter()
        .map(|m| match c.policy_of(m) {
            Some(p) => format!("{m}[selective {p}]"),
            None => m.clone(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Where the plan offered selective checkpointing (`plan --selective`): each candidate's state,
/// keep, selective (under its policy) or full, in execution order.
fn print_states(p: &PlanJson) {
    let offered = p
        .profile
        .regimes
        .first()
        .is_some_and(|r| r.blocks.iter().any(|b| !b.selective.is_empty()));
    if !offered {
        return;
    }
    let ck = &p.checkpoint;
    let states: Vec<String> = p
        .model
        .blocks
        .iter()
        .filter(|b| b.candidate)
        .map(|b| {
            let state = match ck.policy_of(&b.name) {
                Some(p) => format!("selective ({p})"),
                None if ck.modules.contains(&b.name) => "full".into(),
                None => "keep".into(),
            };
            format!("{} {state}", b.name)
        })
        .collect();
    outln!("  per candidate:    {}", states.join(", "));
}

/// A CUDA plan's memory: allocated and reserved peaks of its simulated step, the context, the
/// allocator setting recommended, and the plans tightened on the way.
fn print_cuda_memory(p: &PlanJson, c: &CudaMemoryJson) {
    outln!(
        "  predicted peak:   {} allocated, {} reserved + {} CUDA context = {} of {} ({} to spare); tensors peak at {}",
        format_size(c.predicted_allocated_peak_bytes as u64),
        format_size(c.predicted_reserved_peak_bytes as u64),
        format_size(c.context_bytes as u64),
        format_size((c.predicted_reserved_peak_bytes + c.context_bytes) as u64),
        format_size(p.budget_bytes as u64),
        format_size(p.margin_bytes.max(0) as u64),
        p.predicted.peak_moment
    );
    let others: Vec<String> = c
        .candidates
        .iter()
        .map(|k| {
            format!(
                "{} {}",
                conf_name(&k.alloc_conf),
                format_size(k.reserved_peak_bytes as u64)
            )
        })
        .collect();
    outln!(
        "  allocator:        PYTORCH_CUDA_ALLOC_CONF={} (simulated reserved peaks: {})",
        conf_name(&c.alloc_conf),
        others.join(", ")
    );
    for r in c.rounds.iter().take(c.rounds.len().saturating_sub(1)) {
        outln!(
            "  tightened:        {} checkpointing {} allocates {} but reserves {}: planned again below it",
            r.config,
            if r.regex == MATCH_NOTHING { "nothing" } else { &r.regex },
            format_size(r.allocated_peak_bytes as u64),
            format_size(r.reserved_peak_bytes as u64)
        );
    }
}

fn conf_name(conf: &str) -> &str {
    if conf.is_empty() {
        "(default)"
    } else {
        conf
    }
}

/// The optimizer as the user builds it: `adamw (foreach=False)`, naming the torch.optim
/// implementation the plan measured, which the user must select too (PyTorch's default differs
/// by device).
fn optimizer_in_pytorch(c: &ConfigSpec) -> String {
    match c.torch_optim_kwarg() {
        Some((key, on)) => format!("{} ({key}={})", c.optimizer, if on { "True" } else { "False" }),
        None => c.optimizer.clone(),
    }
}
