//! `ckptune plan`: the fastest config and checkpoint set whose peak fits the budget, solved
//! exactly over a profile (measured here, or given with `--profile`), optionally verified by
//! running it.

mod cuda;
mod flags;
mod print;
mod solve;

use std::process::ExitCode;

use anyhow::{Context, Result};
use ckptune_runtime::Precision;
use ckptune_solver::budget::{format_size, parse_budget, Budget};
use ckptune_solver::cuda_overheads::{cuda_overheads, CudaOverheads};
use ckptune_solver::formats::{
    self, BudgetShareJson, CorrectionJson, CudaMemoryJson, PlanFailureJson, PlanJson, ProfileJson, ShapeJson,
    VerifyJson,
};

use cuda::{plan_within_reserved, NotRecorded};
use flags::{budget_share, check_shard_step, read_profile, reserve_bytes, shard_request};
use print::{cuda_target, eight_bit_note, print_plan};
use solve::{fastest_per_config, plan_from_profile, PlanFailure, ShardRequest};

use crate::cli::args::{EmitKind, PlanArgs};
use crate::cli::error::UsageError;
use crate::cli::measure::{check_fits_here, measure_profile, measure_profile_for_plan};
use crate::cli::output::{outln, print_json};
use crate::cli::plan_run::{print_verify, verify_plan};
use crate::cli::setup::{parse_target, Setup};
use crate::cli::timing::profile_notes;

pub fn plan_cmd(mut a: PlanArgs) -> Result<ExitCode> {
    // The Hugging Face Trainer enters autocast itself with its cache on: its plan counts the
    // casts (Lightning's turns it off).
    if a.emit == Some(EmitKind::Hf) {
        a.model.autocast_cache = true;
    }
    let requested = parse_budget(&a.budget).context("--budget")?;
    check_alloc_trace_flag(&a)?;
    check_shard_step(&a)?;
    let mut setup = Setup::resolve(&a.model, &[Precision::Fp32, Precision::Bf16])?;
    setup.set_selective(&a.selective.selective, &a.model.granularity)?;
    let target = a.target.as_deref().map(parse_target).transpose()?;
    setup.gpu = target.as_ref().and_then(|t| t.1);
    if target.as_ref().is_some_and(|t| t.0 == "cuda") {
        setup.for_cuda();
    }
    let mut notes: Vec<String> = setup.config_note.iter().cloned().collect();
    notes.extend(autocast_casts_note(&setup));
    if ckptune_models::hf::is_config_only(std::path::Path::new(&setup.model)) {
        notes.push(format!(
            "{} has a config but no weights: planned with seeded random weights (memory and time do \
             not depend on the weights' values)",
            setup.model
        ));
    }
    let mut profile: ProfileJson = match &a.profile {
        Some(p) => read_profile(p, &setup, &mut notes)?,
        None => {
            // Only a profile measured here runs the model: threads matter to it alone (and
            // not to times estimated for a GPU).
            if setup.gpu.is_none() {
                notes.extend(setup.fit_threads_to_load());
            }
            // What --device auto chose is the profile's device: said where it is measured.
            notes.extend(setup.device_note.clone());
            if a.shard.is_none() {
                let target = target.as_ref().map(|t| t.0.clone());
                let rank = |p: &ProfileJson| {
                    fastest_per_config(
                        p,
                        usable_bytes(&a, &requested, p, target.as_deref())?,
                        shape_json(&a, &setup, p),
                    )
                };
                measure_profile_for_plan(&setup, &rank)?
            } else {
                measure_profile(&setup)?
            }
        }
    };
    if let Some(g) = setup.gpu {
        check_estimated_for(&profile, &format!("cuda:{}", g.key))?;
    }
    // Estimated times are said per way of estimating, below.
    if !profile.device.measured.is_empty() && !profile.configs.iter().all(|c| c.is_estimated()) {
        notes.push(format!("measured: {}", profile.device.measured));
    }
    // Step times from a busy machine: said, not silently used (a cached profile was re-timed
    // already; one given with --profile is used as it is). No path in the note: plans from the
    // same profile read the same wherever it lies.
    notes.extend(profile_notes(&profile, "the profile"));
    let measured_on = profile.device.device.split(':').next().unwrap_or("cpu").to_owned();
    let target = target.map_or_else(|| measured_on.clone(), |t| t.0);
    let shard = match a.shard {
        None => None,
        Some(ranks) => Some(shard_request(&a, ranks, &target, &mut profile, &mut notes)?),
    };
    let shape = shape_json(&a, &setup, &profile);
    let (budget, share) = resolve_budget(&requested, &profile, shard.as_ref())?;
    let times = times_label(&profile, &measured_on);
    let cuda = simulated_gpu(&a, &target, &measured_on, shard.is_some())?;
    let mut reserve = 0;
    let mut simulated = None;
    if let Some(ov) = cuda {
        match plan_within_reserved(&profile, budget, ov, &shape, setup.quiet, a.alloc_trace.as_deref()) {
            // A step the meta device cannot run keeps the fixed reserve, said in the notes.
            Err(e) if a.alloc_trace.is_none() && e.downcast_ref::<NotRecorded>().is_some() => {
                notes.push(format!("{e:#}"));
            }
            solved => {
                notes.push(cuda_note(ov, &measured_on, &times));
                reserve = ov.context_bytes as i64;
                simulated = Some(solved.map(|(p, c)| (p, Some(c))));
            }
        }
    }
    let solved = match simulated {
        Some(solved) => solved,
        None => {
            reserve = reserve_bytes(&a, budget, &target, &measured_on, &times, &profile, &mut notes)?;
            plan_from_profile(&profile, budget - reserve, shape.clone(), shard.as_ref()).map(|p| (p, None))
        }
    };
    let (mut plan, cuda_memory) = match solved {
        Ok(p) => p,
        Err(e) => {
            // With --json, scripts get the failure as data too (stdout), not only as text.
            if let (true, Some(f)) = (a.json, e.downcast_ref::<PlanFailure>()) {
                print_json(&PlanFailureJson {
                    budget_bytes: budget,
                    checkpoint_regex: f.regex.clone(),
                    config: f.key.clone(),
                    format: formats::PLAN_FAILURE_FORMAT.into(),
                    message: f.to_string(),
                    min_peak_bytes: f.min_peak,
                    peak_moment: f.binding.clone(),
                    reserve_bytes: reserve,
                })?;
            }
            return Err(e);
        }
    };
    // What every plan of this command states besides the solve: the user's budget (the solve
    // may have used less), the reserve, and the notes.
    let facts = PlanFacts {
        budget,
        share,
        reserve,
        target,
        notes,
        cuda: cuda_memory,
    };
    plan = facts.finish(plan);
    let report = if a.verify && verifiable_here(&mut plan) {
        let (verified, report) = verified(plan, &facts, &profile, &shape, shard.as_ref(), &setup)?;
        plan = verified;
        Some(report)
    } else {
        None
    };
    write_and_print(&a, &plan, report.as_ref())?;
    Ok(ExitCode::SUCCESS)
}

/// What `plan` was asked to plan for: the model's shapes and how it was cut.
fn shape_json(a: &PlanArgs, setup: &Setup, profile: &ProfileJson) -> ShapeJson {
    ShapeJson {
        model: setup.model.clone(),
        image: setup.opts.image,
        seq: setup.opts.seq,
        classes: setup.opts.classes,
        granularity: a.model.granularity.clone(),
        repeats: setup.repeats,
        candidates: a.model.candidates.clone(),
        state_dict_key: a.model.state_dict_key.clone(),
        heads: a.model.heads,
        attention: profile.model.attention.clone(),
    }
}

/// The budget in bytes, and its share of the profile's peaks where it was given as a share.
fn resolve_budget(
    requested: &Budget,
    profile: &ProfileJson,
    shard: Option<&ShardRequest>,
) -> Result<(i64, Option<BudgetShareJson>)> {
    let share = match requested {
        Budget::Bytes(_) => None,
        Budget::Percent(percent) => Some(budget_share(*percent, profile, shard)?),
    };
    let budget = match &share {
        Some(s) => requested.resolve(s.smallest_peak_bytes, s.unconstrained_peak_bytes),
        None => requested.resolve(0, 0),
    };
    Ok((budget, share))
}

/// Whose times a profile's are, for the reserve's note.
fn times_label(profile: &ProfileJson, measured_on: &str) -> String {
    match profile.configs.first().and_then(|c| c.estimated.as_ref()) {
        Some(e) => format!("estimated for {}", e.rates.device),
        None => format!("{measured_on} times"),
    }
}

/// The bytes an unsharded plan from `profile` may use: the budget less the reserve (the
/// reserve's notes are the main solve's to make).
fn usable_bytes(a: &PlanArgs, requested: &Budget, profile: &ProfileJson, target: Option<&str>) -> Result<i64> {
    let (budget, _) = resolve_budget(requested, profile, None)?;
    let measured_on = profile.device.device.split(':').next().unwrap_or("cpu");
    let target = target.unwrap_or(measured_on);
    // A simulated CUDA plan's tensors share the budget with the context and cuBLAS's workspaces.
    if let Some(ov) = simulated_gpu(a, target, measured_on, false)? {
        return Ok(budget - ov.fixed_bytes());
    }
    let times = times_label(profile, measured_on);
    Ok(budget - reserve_bytes(a, budget, target, measured_on, &times, profile, &mut Vec::new())?)
}

/// What every plan of this command states besides the solve: the user's budget (the solve may
/// have used less) and its share, the reserve, the target, and the notes.
struct PlanFacts {
    budget: i64,
    share: Option<BudgetShareJson>,
    reserve: i64,
    target: String,
    notes: Vec<String>,
    /// A CUDA plan judged on simulated reserved memory: how (for the plan it was made for).
    cuda: Option<CudaMemoryJson>,
}

impl PlanFacts {
    fn finish(&self, mut plan: PlanJson) -> PlanJson {
        plan.budget_bytes = self.budget;
        plan.budget_share = self.share.clone();
        plan.margin_bytes = self.budget - self.reserve - plan.predicted.peak_bytes;
        plan.target_device = self.target.clone();
        plan.reserve_bytes = self.reserve;
        plan.notes = self.notes.clone();
        plan.notes.extend(eight_bit_note(&plan));
        // The simulation holds for the plan it replayed (a `--verify` correction may choose another).
        let replayed = self.cuda.as_ref().filter(|c| {
            c.rounds
                .last()
                .is_some_and(|r| r.regex == plan.checkpoint.regex && r.config == plan.config.label())
        });
        if let Some(c) = replayed {
            plan.margin_bytes = self.budget - self.reserve - c.predicted_reserved_peak_bytes;
            plan.cuda_memory = Some(c.clone());
        }
        plan
    }
}

/// The GPU whose caching allocator a plan is judged on: a CUDA target planned from another
/// device's profile, unless `--reserve` fixes the reserve or the plan is sharded (FSDP's step
/// is not recorded here).
fn simulated_gpu(a: &PlanArgs, target: &str, measured_on: &str, sharded: bool) -> Result<Option<CudaOverheads>> {
    let simulated = target == "cuda" && measured_on != "cuda" && a.reserve.is_none() && !sharded;
    if a.alloc_trace.is_some() && !simulated {
        return Err(UsageError(format!(
            "--alloc-trace: the profile was measured on {measured_on}, where reserved memory is measured, not simulated"
        ))
        .into());
    }
    let gpu = a.target.as_deref().and_then(|t| t.strip_prefix("cuda:"));
    Ok(simulated.then(|| cuda_overheads(gpu)))
}

/// `--alloc-trace` asks for what only a simulated CUDA plan has: refused before any profiling.
fn check_alloc_trace_flag(a: &PlanArgs) -> Result<()> {
    let cuda = a
        .target
        .as_deref()
        .is_some_and(|t| t == "cuda" || t.starts_with("cuda:"));
    if a.alloc_trace.is_some() && (!cuda || a.reserve.is_some() || a.shard.is_some()) {
        return Err(UsageError(
            "--alloc-trace: only a plan for --target cuda[:NAME] without --reserve or --shard has a simulated \
             step trace to write"
                .into(),
        )
        .into());
    }
    Ok(())
}

fn cuda_note(ov: CudaOverheads, measured_on: &str, times: &str) -> String {
    format!(
        "planned for {} from a {measured_on} profile: judged on the CUDA caching allocator's reserved peak, \
         simulated on the plan's step trace (recorded on the meta device, with two cuBLAS workspaces of {}), \
         plus {} of CUDA context ({}; --reserve to give a figure of your own \
         instead); step times are {times}",
        cuda_target(ov.key),
        format_size(ov.workspace_bytes),
        format_size(ov.context_bytes),
        ov.context_source
    )
}

/// `plan --verify`: runs the plan, and while the run peaks above the budget, plans again with
/// the measured excess taken off the budget — a measured correction, not a fudge factor (on CPU
/// the model is exact and this ends after one verification). Returns the verified plan, with
/// its corrections, and its run.
fn verified(
    mut plan: PlanJson,
    facts: &PlanFacts,
    profile: &ProfileJson,
    shape: &ShapeJson,
    shard: Option<&ShardRequest>,
    setup: &Setup,
) -> Result<(PlanJson, VerifyJson)> {
    let budget = facts.budget;
    let mut corrections = Vec::new();
    let mut planning_budget = budget;
    for round in 0..4 {
        let r = verify_plan(&plan, setup.repeats, setup.quiet)?;
        if r.within_budget {
            plan.corrections = corrections;
            return Ok((plan, r));
        }
        // The model's error at this plan; planning `error` below the budget makes a plan
        // with the same error fit. If a round repeats an error, step down again. On CUDA the
        // budget holds the allocator's reserved bytes, of which the reserve was planned for.
        let error = match r.measured.reserved_peak_bytes {
            Some(reserved) => reserved - r.predicted.peak_bytes - facts.reserve,
            None => r.measured.peak_bytes - r.predicted.peak_bytes,
        }
        .max(1);
        let next = (budget - error).min(planning_budget);
        planning_budget = if next < planning_budget {
            next
        } else {
            planning_budget - error
        };
        corrections.push(CorrectionJson {
            regex: plan.checkpoint.regex.clone(),
            predicted_peak_bytes: r.predicted.peak_bytes,
            measured_peak_bytes: r.measured.peak_bytes,
            moment: r.peak_moment.clone(),
            planning_budget_bytes: planning_budget,
        });
        if round == 3 {
            return Err(anyhow::anyhow!(
                "plan --verify: the measured peak {} still exceeds the budget {} after {} corrections",
                format_size(r.measured.peak_bytes as u64),
                format_size(budget as u64),
                corrections.len()
            ));
        }
        plan = facts.finish(plan_from_profile(
            profile,
            planning_budget - facts.reserve,
            shape.clone(),
            shard,
        )?);
    }
    unreachable!("the fourth round returns")
}

/// Writes the plan (`-o`) and prints it: the snippet (`--emit`), the JSON (`--json`) or the
/// summary with the verification. The snippet is rendered before anything is written: a plan
/// the snippet cannot express is bad input that leaves no file behind.
/// Whether the plan's step fits in this machine's memory to be run for verification; where it
/// does not, the plan says so (the kernel's OOM killer would end the run without a word).
fn verifiable_here(plan: &mut PlanJson) -> bool {
    match check_fits_here(
        plan.predicted.peak_bytes,
        "running the plan for real",
        "verify it where it will train (ckptune verify PLAN)",
    ) {
        Ok(()) => true,
        Err(e) => {
            plan.notes.push(format!("not verified here: {e}"));
            false
        }
    }
}

fn write_and_print(a: &PlanArgs, plan: &PlanJson, report: Option<&VerifyJson>) -> Result<()> {
    let snippet = a
        .emit
        .map(|kind| crate::cli::snippets::snippet(plan, kind))
        .transpose()?;
    if let Some(out) = &a.output {
        formats::write_atomic(out, plan).with_context(|| "writing the plan")?;
    }
    if let Some(text) = snippet {
        // stdout is the snippet alone, ready to redirect into a file.
        outln!("{}", text.trim_end());
        if let Some(out) = &a.output {
            eprintln!("wrote {}", out.display());
        }
    } else if a.json {
        print_json(plan)?;
    } else {
        print_plan(plan);
        if let Some(r) = report {
            outln!();
            print_verify(r);
        }
        if let Some(out) = &a.output {
            outln!("\nwrote {}", out.display());
        }
    }
    Ok(())
}

/// Refuses a profile given with `--profile` whose times are not the cost model's for `device`
/// (`--target cuda:NAME`): a plan for that GPU would otherwise rank configs by another device's
/// times.
fn check_estimated_for(profile: &ProfileJson, device: &str) -> Result<()> {
    for c in &profile.configs {
        let over = c.estimated.as_ref().map(|e| e.rates.device.as_str());
        if over != Some(device) {
            return Err(UsageError(format!(
                "--target {device}: the profile's times of {} are {}, not estimated for {device}; \
                 profile with --target {device} (or plan without --profile)",
                c.config.label(),
                over.map_or("measured".into(), |d| format!("estimated for {d}"))
            ))
            .into());
        }
    }
    Ok(())
}

/// Under autocast (bf16, or fp16 for a GPU), a program traced in fp32 that fixed the dtypes of
/// its casts: ckptune runs a cast that was a no-op when traced as the cast eager PyTorch makes
/// (Qwen3's `q_norm` and Gemma-2's norms upcast a bf16 projection), but a cast back to a dtype
/// the traced code read from a tensor (`x.to(input_dtype)`) keeps the traced fp32.
fn autocast_casts_note(setup: &Setup) -> Option<String> {
    let program = std::path::Path::new(&setup.model);
    let autocast = setup.configs.iter().any(|c| c.precision.autocast().is_some());
    (autocast && ckptune_models::export::pins_fp32(program)).then(|| {
        format!(
            "{} was traced in fp32 and fixes the dtypes of its casts: under autocast a cast back \
             to a dtype the code read from a tensor (RMSNorm's x.to(input_dtype)) stays fp32 here, \
             where PyTorch eager casts to the autocast dtype, so the bytes such a cast holds may \
             differ from eager's",
            program.display()
        )
    })
}
