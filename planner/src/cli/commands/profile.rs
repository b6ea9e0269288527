//! `ckptune profile`: per config, what checkpointing each candidate saves and costs.

use std::process::ExitCode;

use anyhow::Result;
use ckptune_runtime::Precision;
use ckptune_solver::budget::format_size;
use ckptune_solver::formats::{self, ProfileJson};
use ckptune_solver::profile::ConfigProfile;

use crate::cli::args::ProfileArgs;
use crate::cli::error::UsageError;
use crate::cli::measure::measure_profile;
use crate::cli::output::{group_digits, outln, print_json};
use crate::cli::setup::{parse_target, Setup};
use crate::cli::timing::contention_note;

pub fn profile_cmd(a: ProfileArgs) -> Result<ExitCode> {
    let mut setup = Setup::resolve(&a.model, &[Precision::Fp32])?;
    setup.set_selective(&a.selective.selective, &a.model.granularity)?;
    setup.gpu = match a.target.as_deref().map(parse_target).transpose()? {
        // A profile's target matters only for the rates its times are estimated over.
        Some((kind, None)) if kind == "cuda" => {
            return Err(UsageError(
                "profile --target cuda: name the GPU whose rates estimate the times (--target \
                 cuda:h100, ...)"
                    .into(),
            )
            .into())
        }
        target => target.and_then(|t| t.1),
    };
    if setup.gpu.is_some() {
        setup.for_cuda();
    }
    setup.fit_threads_to_load_announced();
    let p = measure_profile(&setup)?;
    if let Some(out) = &a.output {
        formats::write_atomic(out, &p)?;
    }
    if a.json {
        print_json(&p)?;
    } else {
        print_profile(&p);
        if let Some(out) = &a.output {
            outln!("wrote {}", out.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn print_profile(p: &ProfileJson) {
    outln!(
        "{} ({} parameters), {}",
        p.model.name,
        group_digits(p.model.params),
        p.device.label()
    );
    for c in &p.configs {
        let cfg = &c.config;
        outln!(
            "\n{} / {} / micro-batch {} × {} / {}: peak {} with nothing checkpointed, {} with everything; \
             step {:.3} s ({})",
            cfg.precision,
            cfg.optimizer_label(),
            cfg.micro_batch,
            cfg.grad_accum,
            if cfg.set_to_none { "set_to_none" } else { "zeroed grads" },
            format_size(c.peak_none as u64),
            format_size(c.peak_all as u64),
            c.seconds_none.median,
            match &c.estimated {
                Some(e) => e.describe(),
                None => format!(
                    "median of {}, {:.3}–{:.3}",
                    c.seconds_none.n, c.seconds_none.min, c.seconds_none.max
                ),
            }
        );
        let note = match c.is_estimated() {
            true => None,
            false => contention_note("this profile", &c.contention),
        };
        if let Some(n) = note {
            outln!("  note: {n}");
        }
        outln!(
            "  fixed: parameters {}, buffers {}, optimizer state {}, gradients {}, batch {}",
            format_size(c.fixed.parameters as u64),
            format_size(c.fixed.buffers as u64),
            format_size(c.fixed.optimizer_state as u64),
            format_size(c.fixed.gradients as u64),
            format_size(c.fixed.batch as u64)
        );
        for line in block_table(c) {
            outln!("{line}");
        }
        let n = c.regimes[0].blocks.len();
        // Groups: kept when run plain (fused, one graph) and when checkpointed whole.
        for (g, grp) in c.regimes[0].groups.iter().enumerate() {
            let rec = c.recompute_seconds.get(n + g).copied().unwrap_or(0.0);
            outln!(
                "  {:<28} {:>12} {:>12} {:>12} {:>8.1}ms",
                grp.name,
                format_size(grp.fused_kept.max(0) as u64),
                format_size(grp.kept.max(0) as u64),
                format_size((grp.fused_kept - grp.kept).max(0) as u64),
                rec * 1e3
            );
        }
    }
}

/// The first regime's candidate table: each block's kept bytes run plain, checkpointed in full
/// and the bytes that saves, and its recompute; with selective measurements, the same run
/// selective under each policy beside them (kept, saved, recompute: the operators its policy
/// does not save).
fn block_table(c: &ConfigProfile) -> Vec<String> {
    let blocks = &c.regimes[0].blocks;
    let policies: Vec<String> = blocks
        .iter()
        .find(|b| !b.selective.is_empty())
        .map_or_else(Vec::new, |b| b.selective.iter().map(|s| s.policy.clone()).collect());
    let mut head = format!(
        "  {:<28} {:>12} {:>12} {:>12} {:>10}",
        "block", "kept", "if ckpt", "saves", "recompute"
    );
    for policy in &policies {
        head += &format!(" {:>12} {:>12} {:>10}", format!("if {policy}"), "saves", "recompute");
    }
    let mut lines = vec![head];
    // Signed: a plain block whose input the runtime lets go of after its forward (one it keeps
    // only casts of) can keep less than nothing, and checkpointing it then costs memory.
    let size = |b: i64| match u64::try_from(b) {
        Ok(b) => format_size(b),
        Err(_) => format!("-{}", format_size(b.unsigned_abs())),
    };
    for (b, rec) in blocks.iter().zip(&c.recompute_seconds) {
        if !b.candidate {
            lines.push(format!("  {:<28} {:>12}", b.name, size(b.kept_grad)));
            continue;
        }
        let mut line = format!(
            "  {:<28} {:>12} {:>12} {:>12} {:>8.1}ms",
            b.name,
            size(b.kept_grad),
            size(b.kept_nograd),
            size(b.kept_grad - b.kept_nograd),
            rec * 1e3
        );
        for s in &b.selective {
            line += &format!(
                " {:>12} {:>12} {:>8.1}ms",
                size(s.kept),
                size(b.kept_grad - s.kept),
                s.rec_seconds * 1e3
            );
        }
        lines.push(line);
    }
    lines
}
