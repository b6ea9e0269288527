//! `ckptune verify --pytorch` of a sharded plan (`plan --shard N`): the plan run by PyTorch
//! FSDP2 on its N ranks, one CPU process each (`python -m ckptune_harness.fsdp`: gloo on loopback,
//! ckptune's counting allocator in every rank, `fully_shard` on the plan's units and the root,
//! the plan's modules checkpointed), each rank's measured peak beside the plan's prediction for
//! that rank. Exit 1 when a rank peaks over the budget.
//!
//! ckptune's own runtime does not run a sharded plan: it runs one unsharded process, and what
//! that process allocates is not what any rank allocates; the report says so.
//!
//! No process outlives the command. The harness is this process's child and is waited on
//! whatever happens; it kills and reaps its ranks on every path out (a failed rank, a taken
//! port, its timeout, Ctrl-C, SIGTERM), and each rank dies with the harness (Linux parent-death
//! signal). Should this process be killed outright (SIGKILL), `--parent` makes the harness leave
//! the same way: it arms the parent-death signal on itself, because this binary cannot (that
//! takes an `unsafe` `pre_exec` hook, and `kernels/` is the only crate with native code).

use std::path::Path;
use std::process::ExitCode;

use anyhow::{anyhow, Context, Result};
use ckptune_solver::budget::format_size;
use ckptune_solver::formats::{self, FsdpRunJson, PlanJson, RankVerifyJson, ShardJson, VerifyShardJson};

use crate::cli::args::VerifyArgs;
use crate::cli::companion::{companion, harness_message, python, require_python, run_dir};
use crate::cli::error::UsageError;
use crate::cli::output::{group_digits, outln, print_json};

/// What the single-process runs would have been, and why they are not made.
const NO_SINGLE_PROCESS_RUN: &str = "ckptune's own run and the PyTorch eager run were skipped: \
    they run the model unsharded in one process, which allocates what no rank of the plan does";

/// `--shard N` and `--port` against the plan, before anything runs: `--shard` must be the
/// plan's rank count, and both need a plan with a shard section.
pub fn check_shard_flags(a: &VerifyArgs, plan: &PlanJson) -> Result<()> {
    let path = a.plan.display();
    match (a.shard, &plan.shard) {
        (Some(n), None) => Err(UsageError(format!(
            "verify --shard {n}: {path} is a plan for one process (it has no shard section); plan it \
             for {n} ranks first with `ckptune plan --shard {n}`, or verify it without --shard"
        ))
        .into()),
        (Some(n), Some(s)) if s.ranks != n => Err(UsageError(format!(
            "verify --shard {n}: {path} is planned for {} ranks; verify it with --shard {} (or without \
             --shard), or plan it for {n} ranks first with `ckptune plan --shard {n}`",
            s.ranks, s.ranks
        ))
        .into()),
        (None, None) if a.port.is_some() => Err(UsageError(format!(
            "verify --port sets the rendezvous port of a sharded plan's process group; {path} is a plan \
             for one process (plan with `ckptune plan --shard N` first, or drop --port)"
        ))
        .into()),
        _ => Ok(()),
    }
}

/// Refuses, as bad input, a shard section the FSDP run cannot follow or that contradicts itself
/// (`verify` has already run `plan_check::check_plan`: at least one rank, known units).
fn check_plan(path: &Path, plan: &PlanJson, s: &ShardJson) -> Result<()> {
    let bad =
        |why: String| -> Result<()> { Err(UsageError(format!("verify --pytorch: {}: {why}", path.display())).into()) };
    let listed: Vec<i64> = s.per_rank.iter().map(|r| r.rank).collect();
    if listed != (0..s.ranks).collect::<Vec<_>>() {
        return bad(format!(
            "the shard section is for {} ranks but predicts ranks {listed:?}; plan it again with `ckptune plan \
             --shard {}`",
            s.ranks, s.ranks
        ));
    }
    if s.collective != "gloo" {
        return bad(format!(
            "the plan's collective is {}; the FSDP run measures CPU processes over gloo",
            s.collective
        ));
    }
    let c = &plan.config;
    // The harness runs one micro-batch per step, sets gradients to None and builds the
    // single-tensor optimizer (foreach=False): other configs would be measured as something else.
    if c.grad_accum != 1 {
        return bad(format!(
            "the FSDP run accumulates no gradients; the plan's gradient accumulation is {}",
            c.grad_accum
        ));
    }
    if !c.set_to_none {
        return bad("the FSDP run zeroes gradients with set_to_none=True; the plan's set_to_none is false".into());
    }
    if c.optimizer_in_backward {
        return bad("the FSDP run steps the optimizer after backward; the plan steps it in backward".into());
    }
    if c.chunks() > 1 {
        return bad(format!(
            "the FSDP run computes the loss whole; the plan's loss is in {} chunks",
            c.chunks()
        ));
    }
    if let Some(imp) = c.optimizer_impl.as_deref().filter(|i| *i != "single") {
        return bad(format!(
            "the FSDP run builds the single-tensor optimizer (foreach=False); the plan's implementation is {imp}"
        ));
    }
    Ok(())
}

/// `^(?:a|b)$` of the module names, each escaped: the FSDP units as the harness's
/// `--shard-regex`, which it matches against whole module names. No units (every parameter the
/// root's) is the empty regex, which the harness takes as none.
fn names_regex(names: &[String]) -> String {
    if names.is_empty() {
        return String::new();
    }
    let alternatives: Vec<String> = names.iter().map(|n| regex::escape(n)).collect();
    format!("^(?:{})$", alternatives.join("|"))
}

/// The harness's command line for the plan: model, config, units, checkpoint and shape.
fn harness_args(plan: &PlanJson, s: &ShardJson, steps: usize, port: Option<u16>) -> Vec<String> {
    let c = &plan.config;
    let mut args: Vec<String> = [
        "-m",
        "ckptune_harness.fsdp",
        "--model",
        &plan.shape.model,
        "--nproc",
        &s.ranks.to_string(),
        "--shard-regex",
        &names_regex(&s.units),
        "--precision",
        &c.precision,
        "--optimizer",
        &c.optimizer,
        "--micro-batch",
        &c.micro_batch.to_string(),
        // The timed steps after one warm-up step (the optimizer state is made in the first).
        "--steps",
        &(steps + 1).to_string(),
        "--warmup",
        "1",
        "--parent",
        &std::process::id().to_string(),
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    // The plan's regex when it names modules; the regex of a plan that checkpoints nothing
    // matches nothing, which the harness refuses, so none is passed.
    if !plan.checkpoint.modules.is_empty() {
        args.extend(["--regex".into(), plan.checkpoint.regex.clone()]);
    }
    if let Some(image) = plan.shape.image {
        args.extend(["--image".into(), image.to_string()]);
    }
    if let Some(seq) = plan.shape.seq {
        args.extend(["--seq".into(), seq.to_string()]);
    }
    if let Some(classes) = plan.shape.classes {
        // The reference's own config field: a ResNet's `num_classes`, BERT's `num_labels`.
        let field = if plan.model.input.starts_with("Image") {
            "num_classes"
        } else {
            "num_labels"
        };
        args.extend(["--config".into(), format!("{field}={classes}")]);
    }
    if let Some(attention) = &plan.shape.attention {
        args.extend(["--config".into(), format!("attn_implementation={attention}")]);
    }
    if c.precision != "fp32" {
        // The loop ckptune plans enters autocast with `cache_enabled=False` (docs/memory-model.md,
        // the `--emit python` snippet): with the cache, bf16 weight casts outlive their layers.
        args.push("--no-autocast-cache".into());
    }
    if !s.reshard_after_forward {
        args.push("--no-reshard-after-forward".into());
    }
    if let Some(port) = port {
        args.extend(["--port".into(), port.to_string()]);
    }
    args
}

/// Runs `python -m ckptune_harness.fsdp` for the plan and reads its result. Its exit code 2 (a plan it
/// cannot follow, no gloo) is bad input here too; 1 (a rank failed, the port was taken, the
/// timeout) is the work failing; both with its message.
fn fsdp_run(plan: &PlanJson, s: &ShardJson, steps: usize, port: Option<u16>, python: &Path) -> Result<FsdpRunJson> {
    require_python(python)?;
    let dir = run_dir()?;
    let out = dir.join("fsdp-run.json");
    // `output` waits for the harness whatever it returns: no zombie, and its ranks are gone
    // when it has exited.
    let result = companion(python)
        .args(harness_args(plan, s, steps, port))
        .arg("-o")
        .arg(&out)
        .output()
        .with_context(|| format!("verify --pytorch: running {}", python.display()));
    let run = result.and_then(|o| {
        let stderr = String::from_utf8_lossy(&o.stderr);
        let message = harness_message(&stderr);
        match o.status.code() {
            // A harness result that does not read is this checkout's companion at odds with the
            // binary, not the user's input: exit 1 (FormatError would say 2).
            Some(0) => formats::read_tagged::<FsdpRunJson>(&out, formats::FSDP_RUN_FORMAT)
                .map_err(|e| anyhow!("verify --pytorch: the FSDP run's result: {e}")),
            Some(2) => Err(UsageError(format!("verify --pytorch: the FSDP run refused the plan: {message}")).into()),
            _ if stderr.contains("No module named 'torch'") => Err(UsageError(format!(
                "verify --pytorch: {} has no torch: run scripts/setup, or pass --python (or set \
                 CKPTUNE_PYTHON) to a Python with torch",
                python.display()
            ))
            .into()),
            Some(130) => Err(anyhow!(
                "verify --pytorch: the FSDP run was interrupted; its ranks were killed"
            )),
            Some(code) => Err(anyhow!(
                "verify --pytorch: the FSDP run on {} ranks failed (exit {code}): {message}",
                s.ranks
            )),
            None => Err(anyhow!(
                "verify --pytorch: the FSDP harness was killed by a signal: {message}"
            )),
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
    run
}

/// The run must be the plan's: its ranks, units, checkpointed modules and parameters (names and
/// shapes in `parameters()` order), else the reference differs from the model ckptune planned.
fn check_run(plan: &PlanJson, s: &ShardJson, run: &FsdpRunJson) -> Result<()> {
    let differs = |what: &str, planned: String, ran: String| -> Result<()> {
        Err(UsageError(format!(
            "verify --pytorch: the FSDP run's {what} differ from the plan's (the reference \
             models/fixtures/reference.py is not the model ckptune planned): plan {planned}, run {ran}"
        ))
        .into())
    };
    if run.world_size != s.ranks || run.peak_bytes.len() as i64 != s.ranks || run.ranks.len() as i64 != s.ranks {
        return Err(anyhow!(
            "verify --pytorch: the FSDP run reports {} ranks ({} peaks), the plan has {}",
            run.world_size,
            run.peak_bytes.len(),
            s.ranks
        ));
    }
    if run.units != s.units {
        return differs("units", s.units.join(", "), run.units.join(", "));
    }
    if run.checkpointed != plan.checkpoint.modules {
        return differs(
            "checkpointed modules",
            plan.checkpoint.modules.join(", "),
            run.checkpointed.join(", "),
        );
    }
    let planned = &plan.model.parameters;
    if !planned.is_empty() {
        let strip = |n: &str| n.strip_prefix("<head>.").unwrap_or(n).to_owned();
        let ran: Vec<(String, &[i64])> = run.params.iter().map(|p| (strip(&p.name), &p.shape[..])).collect();
        let want: Vec<(String, &[i64])> = planned.iter().map(|p| (p.name.clone(), &p.shape[..])).collect();
        if ran != want {
            let first = ran
                .iter()
                .zip(&want)
                .position(|(r, w)| r != w)
                .unwrap_or(ran.len().min(want.len()));
            let show = |v: &[(String, &[i64])]| {
                let at = v
                    .get(first)
                    .map_or("nothing".to_owned(), |(n, sh)| format!("{n} {sh:?}"));
                format!("{at} ({} parameters)", v.len())
            };
            return differs(
                &format!("parameters (the first difference is parameter #{first})"),
                show(&want),
                show(&ran),
            );
        }
    }
    Ok(())
}

pub fn verify_shard_cmd(a: &VerifyArgs, plan: &PlanJson, s: &ShardJson) -> Result<ExitCode> {
    check_plan(&a.plan, plan, s)?;
    let steps = a.steps.unwrap_or(plan.shape.repeats).max(1);
    let run = fsdp_run(plan, s, steps, a.port, &python(a.python.as_deref()))?;
    check_run(plan, s, &run)?;

    let limit = plan.budget_bytes - plan.reserve_bytes;
    let per_rank: Vec<RankVerifyJson> = s
        .per_rank
        .iter()
        .zip(&run.peak_bytes)
        .map(|(p, &measured)| RankVerifyJson {
            rank: p.rank,
            predicted_peak_bytes: p.peak_bytes,
            predicted_peak_moment: p.peak_moment.clone(),
            measured_peak_bytes: measured,
            error_bytes: measured - p.peak_bytes,
            within_budget: measured <= limit,
        })
        .collect();
    let mut notes = vec![NO_SINGLE_PROCESS_RUN.to_owned()];
    if plan.device.threads != 1 {
        notes.push(format!(
            "every rank ran 1 thread; the plan was profiled with {}",
            plan.device.threads
        ));
    }
    for r in run.ranks.iter().filter(|r| r.peak_varies.is_some()) {
        notes.push(format!(
            "rank {}'s timed steps peaked differently: {:?} (the highest is reported)",
            r.rank,
            r.peak_varies.as_deref().unwrap_or_default()
        ));
    }
    let report = VerifyShardJson {
        format: formats::VERIFY_SHARD_FORMAT.into(),
        model: plan.model.name.clone(),
        device: plan.device.device.clone(),
        config: plan.config.clone(),
        regex: plan.checkpoint.regex.clone(),
        modules: plan.checkpoint.modules.clone(),
        ranks: s.ranks,
        reshard_after_forward: s.reshard_after_forward,
        collective: s.collective.clone(),
        units: s.units.clone(),
        budget_bytes: plan.budget_bytes,
        reserve_bytes: plan.reserve_bytes,
        limit_bytes: limit,
        predicted_peak_bytes: plan.predicted.peak_bytes,
        measured_peak_bytes: run.peak_bytes.iter().copied().max().unwrap_or(0),
        within_budget: per_rank.iter().all(|r| r.within_budget),
        per_rank,
        notes,
        fsdp: run,
    };
    if let Some(out) = &a.output {
        formats::write_atomic(out, &report)?;
    }
    if a.json {
        print_json(&report)?;
    } else {
        print_ranks(&report);
    }
    if !report.within_budget {
        let over: Vec<String> = report
            .per_rank
            .iter()
            .filter(|r| !r.within_budget)
            .map(|r| {
                format!(
                    "rank {} peak {} ({} B)",
                    r.rank,
                    format_size(r.measured_peak_bytes as u64),
                    group_digits(r.measured_peak_bytes)
                )
            })
            .collect();
        eprintln!(
            "error: verification failed: {} over the budget {} ({} B)",
            over.join(", "),
            format_size(report.limit_bytes.max(0) as u64),
            group_digits(report.limit_bytes)
        );
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

fn print_ranks(r: &VerifyShardJson) {
    let c = &r.config;
    outln!(
        "verify {} on {} ranks, FSDP2 over {} ({} / {} / micro-batch {} per rank × {}), checkpoint {}",
        r.model,
        r.ranks,
        r.collective,
        c.precision,
        c.optimizer,
        c.micro_batch,
        c.grad_accum,
        r.regex
    );
    outln!(
        "  units: {} (the rest is the root's), reshard after forward: {}",
        if r.units.is_empty() {
            "none".to_owned()
        } else {
            r.units.join(", ")
        },
        if r.reshard_after_forward { "yes" } else { "no" }
    );
    outln!(
        "  {:>4} {:>12} {:>14} {:>12} {:>14} {:>14}  {}",
        "rank",
        "predicted",
        "bytes",
        "measured",
        "bytes",
        "vs predicted",
        "budget"
    );
    for k in &r.per_rank {
        let d = k.error_bytes;
        outln!(
            "  {:>4} {:>12} {:>14} {:>12} {:>14} {:>14}  {}",
            k.rank,
            format_size(k.predicted_peak_bytes.max(0) as u64),
            group_digits(k.predicted_peak_bytes),
            format_size(k.measured_peak_bytes.max(0) as u64),
            group_digits(k.measured_peak_bytes),
            format!("{}{} B", if d >= 0 { "+" } else { "" }, group_digits(d)),
            if k.within_budget {
                "within".to_owned()
            } else {
                format!(
                    "OVER by {}",
                    format_size((k.measured_peak_bytes - r.limit_bytes) as u64)
                )
            }
        );
    }
    let f = &r.fsdp;
    let timed = f.steps.saturating_sub(f.warmup);
    outln!(
        "  PyTorch FSDP2: torch {}, {}, one process per rank; peaks of {timed} timed step{} after {} warm-up",
        f.torch,
        f.optimizer_class,
        if timed == 1 { "" } else { "s" },
        f.warmup
    );
    for n in &r.notes {
        outln!("  note: {n}");
    }
    let budget = if r.reserve_bytes != 0 {
        format!(
            "budget {} less the reserve {}",
            format_size(r.budget_bytes.max(0) as u64),
            format_size(r.reserve_bytes.max(0) as u64)
        )
    } else {
        format!("budget {}", format_size(r.budget_bytes.max(0) as u64))
    };
    let over = r.per_rank.iter().filter(|k| !k.within_budget).count();
    outln!(
        "  {budget}: {}",
        if over == 0 {
            "every rank within".to_owned()
        } else {
            format!("{over} of {} ranks OVER", r.ranks)
        }
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_regex_escapes_each_name_and_anchors_the_alternation() {
        let names = ["encoder.layer.0".to_owned(), "encoder.layer.1".to_owned()];
        assert_eq!(names_regex(&names), r"^(?:encoder\.layer\.0|encoder\.layer\.1)$");
        assert_eq!(names_regex(&[]), "");
    }

    #[test]
    fn the_harness_message_is_its_error_line_and_what_follows() {
        let stderr = "some warning\nerror: rank 1 of 2 failed (exit 1):\nTraceback\n  File x\nRuntimeError: boom\n";
        assert_eq!(
            harness_message(stderr),
            "rank 1 of 2 failed (exit 1):\nTraceback\n  File x\nRuntimeError: boom"
        );
        let argparse =
            "usage: ...\npython -m ckptune_harness.fsdp: error: argument --precision: invalid choice: 'fp16'\n";
        assert_eq!(
            harness_message(argparse),
            "argument --precision: invalid choice: 'fp16'"
        );
        assert_eq!(harness_message(""), "(no output)");
    }
}
