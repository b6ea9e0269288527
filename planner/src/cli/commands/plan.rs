//! `ckptune plan`: the fastest config and checkpoint set whose peak fits the budget, solved
//! exactly over a profile (measured here, or given with `--profile`), optionally verified by
//! running it.

use std::process::ExitCode;

use anyhow::{Context, Result};
use ckptune_runtime::{Precision, TrainConfig};
use ckptune_solver::budget::{format_size, parse_budget, parse_size, Budget};
use ckptune_solver::formats::{
    self, AlternativeJson, BudgetShareJson, CheckpointJson, CorrectionJson, ModelJson, PlanFailureJson, PlanJson,
    PredictedJson, ProfileJson, RankPredictionJson, ShapeJson, ShardJson, SolverJson,
};
use ckptune_solver::model::{seconds_range_at, shard_step, solver_problem, unit_order};
use ckptune_solver::problem::ConfigProblem;
use ckptune_solver::profile::ConfigSpec;
use ckptune_solver::shard::{is_default_unit, Collective, ShardError, ShardSpec, ShardStep};
use ckptune_solver::solver::{self, SolveError, SolveStatus};
use ckptune_solver::{chain_model, regex_emit};

use crate::cli::args::PlanArgs;
use crate::cli::error::UsageError;
use crate::cli::output::{outln, print_json};
use crate::cli::plan_run::{print_verify, verify_plan};
use crate::cli::setup::{cpu_identity, measure_profile, Setup};
use crate::cli::timing::{profile_notes, range_text};

/// Names of the checkpointed units of choice `x` (unit order), in execution order: a group
/// where its first block would be.
fn chosen_names(model: &ModelJson, x: &[bool]) -> Vec<String> {
    let n = model.blocks.len();
    let groups: Vec<(usize, usize)> = model.groups.iter().map(|g| (g.first, g.last)).collect();
    let names: Vec<&str> = model.unit_names().collect();
    chain_model::solver_order(n, &groups)
        .into_iter()
        .filter(|&u| x.get(u) == Some(&true))
        .map(|u| names[u].to_string())
        .collect()
}

fn checkpoint_json(model: &ModelJson, x: &[bool]) -> Result<CheckpointJson> {
    let modules = chosen_names(model, x);
    let regex = regex_emit::checkpoint_regex(&modules, &model.modules)?;
    Ok(CheckpointJson { regex, modules })
}

/// How `plan --shard N` shards: the ranks, the collectives, and which blocks are FSDP units.
#[derive(Debug, Clone)]
pub struct ShardRequest {
    pub ranks: i64,
    pub collective: Collective,
    /// Full match over block names; `None`: [`is_default_unit`].
    pub units: Option<regex::Regex>,
}

impl ShardRequest {
    fn is_unit(&self, model: &ModelJson, name: &str) -> bool {
        match &self.units {
            Some(re) => re.is_match(name),
            None => model
                .blocks
                .iter()
                .any(|b| b.name == name && is_default_unit(&b.name, b.candidate)),
        }
    }
}

/// One problem the solver sees: a profiled config, and for a sharded plan one
/// `reshard_after_forward` setting of it with its per-rank model.
struct Candidate {
    config: usize,
    problem: ConfigProblem,
    order: Vec<usize>,
    shard: Option<(ShardStep, ShardSpec)>,
}

/// A config sharded over `ranks` ranks: `fp32/adamw/mb8x1/fsdp4`, with `/keep` when FSDP2 keeps
/// each unit unsharded from its forward to its backward (`reshard_after_forward=False`).
fn shard_label(c: &ConfigSpec, ranks: i64, reshard_after_forward: bool) -> String {
    format!(
        "{}/fsdp{ranks}{}",
        c.label(),
        if reshard_after_forward { "" } else { "/keep" }
    )
}

fn candidates(profile: &ProfileJson, shard: Option<&ShardRequest>) -> Result<Vec<Candidate>> {
    let mut out = Vec::new();
    for (i, c) in profile.configs.iter().enumerate() {
        let Some(req) = shard else {
            out.push(Candidate {
                config: i,
                problem: solver_problem(c.config.label(), c),
                order: unit_order(c),
                shard: None,
            });
            continue;
        };
        let step = shard_step(
            c,
            &profile.model.parameters,
            |name| req.is_unit(&profile.model, name),
            &profile.model.name,
        )
        .map_err(|e| UsageError(e.to_string()))?;
        for reshard_after_forward in [true, false] {
            let spec = ShardSpec {
                ranks: req.ranks,
                reshard_after_forward,
                collective: req.collective,
            };
            let key = shard_label(&c.config, req.ranks, reshard_after_forward);
            out.push(Candidate {
                config: i,
                problem: step.config_problem(key, spec),
                order: (0..c.regimes[0].blocks.len()).collect(),
                shard: Some((step.clone(), spec)),
            });
        }
    }
    Ok(out)
}

/// Solves a plan for `profile` under `budget` (for each rank of a sharded plan). `Err` of
/// [`PlanFailure`] when nothing fits.
pub fn plan_from_profile(
    profile: &ProfileJson,
    budget: i64,
    shape: ShapeJson,
    shard: Option<&ShardRequest>,
) -> Result<PlanJson> {
    let cands = candidates(profile, shard)?;
    let problems: Vec<ConfigProblem> = cands.iter().map(|c| c.problem.clone()).collect();
    let t0 = std::time::Instant::now();
    let result = solver::solve(&problems, budget);
    let solve_seconds = t0.elapsed().as_secs_f64();
    let mut plan = match result {
        Ok(p) => p,
        Err(SolveError::Infeasible {
            min_peak,
            key,
            binding,
            x,
            ..
        }) => {
            let k = problems.iter().position(|p| p.key == key).unwrap_or(0);
            let mut x = chain_model::unpermute(&x, &cands[k].order);
            x.truncate(profile.model.blocks.len() + profile.model.groups.len());
            let regex = checkpoint_json(&profile.model, &x)?.regex;
            return Err(PlanFailure {
                budget,
                min_peak,
                key,
                binding,
                regex,
                profile: profile.clone(),
                ranks: shard.map(|r| r.ranks),
            }
            .into());
        }
        Err(e) => return Err(e.into()),
    };
    let units = profile.model.blocks.len() + profile.model.groups.len();
    for (sol, cand) in plan.configs.iter_mut().zip(&cands) {
        // Back in unit order, without the fused variables (the runtime fuses by itself).
        sol.x = chain_model::unpermute(&sol.x, &cand.order);
        sol.x.truncate(units);
    }
    let mut alternatives = Vec::new();
    for (sol, cand) in plan.configs.iter().zip(&cands) {
        let c = &profile.configs[cand.config];
        let base = c.seconds_none.median;
        alternatives.push(AlternativeJson {
            config: c.config.clone(),
            feasible: sol.status == SolveStatus::Optimal,
            checkpoint: checkpoint_json(&profile.model, &sol.x)?,
            predicted: PredictedJson {
                peak_bytes: sol.peak,
                step_seconds: sol.seconds,
                step_seconds_range: seconds_range_at(c, &sol.x).map(|(lo, hi)| [lo, hi]),
                throughput_loss: if sol.seconds > 0.0 {
                    1.0 - base / sol.seconds
                } else {
                    0.0
                },
                peak_moment: sol.binding.clone(),
            },
            baseline_peak_bytes: match &cand.shard {
                Some((step, spec)) => rank_max(step, *spec, &vec![false; sol.x.len()]).0,
                None => c.peak_none,
            },
            baseline_step_seconds: base,
            reshard_after_forward: cand.shard.as_ref().map(|(_, spec)| spec.reshard_after_forward),
        });
    }
    let best = alternatives[plan.best].clone();
    let chosen = &cands[plan.best];
    let shard_json = chosen.shard.as_ref().map(|(step, spec)| ShardJson {
        ranks: spec.ranks,
        reshard_after_forward: spec.reshard_after_forward,
        collective: spec.collective.name().to_owned(),
        units: step.unit_names(),
        per_rank: step
            .rank_peaks(*spec, &plan.configs[plan.best].x)
            .into_iter()
            .enumerate()
            .map(|(r, (peak_bytes, peak_moment))| RankPredictionJson {
                rank: r as i64,
                peak_bytes,
                peak_moment,
            })
            .collect(),
    });
    Ok(PlanJson {
        format: formats::PLAN_FORMAT.into(),
        ckptune_version: env!("CARGO_PKG_VERSION").into(),
        model: profile.model.clone(),
        device: profile.device.clone(),
        budget_bytes: budget,
        budget_share: None,
        config: best.config.clone(),
        checkpoint: best.checkpoint.clone(),
        predicted: best.predicted.clone(),
        margin_bytes: budget - best.predicted.peak_bytes,
        solver: SolverJson {
            status: "optimal".into(),
            backend: "chain dynamic program / good_lp microlp".into(),
            seconds: solve_seconds,
        },
        alternatives,
        shape,
        profile: profile.configs[chosen.config].clone(),
        corrections: Vec::new(),
        target_device: profile.device.device.clone(),
        reserve_bytes: 0,
        notes: Vec::new(),
        shard: shard_json,
    })
}

/// The highest rank's peak under `x` and its moment.
fn rank_max(step: &ShardStep, spec: ShardSpec, x: &[bool]) -> (i64, String) {
    step.rank_peaks(spec, x)
        .into_iter()
        .fold((i64::MIN, String::new()), |best, p| if p.0 > best.0 { p } else { best })
}

/// No plan fits: what would, and what else could help.
#[derive(Debug)]
pub struct PlanFailure {
    pub budget: i64,
    pub min_peak: i64,
    pub key: String,
    pub binding: String,
    pub regex: String,
    pub profile: ProfileJson,
    /// The rank count of a sharded plan: its hints are the ones `--shard` accepts.
    pub ranks: Option<i64>,
}

impl std::fmt::Display for PlanFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "no configuration of {} fits the budget {}: the smallest achievable peak is {} ({} bytes), \
             with config {} and checkpoint regex {} (peak at: {}).",
            self.profile.model.name,
            format_size(self.budget as u64),
            format_size(self.min_peak as u64),
            self.min_peak,
            self.key,
            self.regex,
            self.binding
        )?;
        let has = |p: &str| self.profile.configs.iter().any(|c| c.config.precision == p);
        let opt = |o: &str| self.profile.configs.iter().any(|c| c.config.optimizer == o);
        let min_mb = self
            .profile
            .configs
            .iter()
            .map(|c| c.config.micro_batch)
            .min()
            .unwrap_or(1);
        write!(f, " What else could help:")?;
        if let Some(n) = self.ranks {
            // Sharded plans are fp32, one micro-step per optimizer step, AdamW or SGD with
            // momentum: the other levers are refused with --shard.
            write!(f, " more ranks (--shard {});", 2 * n)?;
            if min_mb > 1 {
                write!(f, " a smaller micro-batch per rank (--batch {});", min_mb / 2)?;
            }
            if !opt("sgd-momentum") {
                write!(f, " an optimizer with less state (--optimizer adamw,sgd-momentum);")?;
            }
            return write!(f, " a larger budget.");
        }
        if min_mb > 1 {
            write!(
                f,
                " a smaller micro-batch with gradient accumulation (--batch {} --global-batch N);",
                min_mb / 2
            )?;
        }
        if !has("bf16") {
            write!(f, " bf16 autocast (--precision fp32,bf16);")?;
        }
        if !has("bf16-pure") {
            write!(f, " bf16 parameters and optimizer state (--precision bf16-pure);")?;
        }
        if !opt("sgd") && !opt("lion") {
            write!(
                f,
                " an optimizer with less state (--optimizer adamw,lion,sgd-momentum);"
            )?;
        }
        write!(f, " a larger budget.")
    }
}

impl std::error::Error for PlanFailure {}

pub fn plan_cmd(a: PlanArgs) -> Result<ExitCode> {
    let requested = parse_budget(&a.budget).context("--budget")?;
    let mut setup = Setup::resolve(&a.model, &[Precision::Fp32, Precision::Bf16])?;
    let mut notes = Vec::new();
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
            // Only a profile measured here runs the model: threads matter to it alone.
            notes.extend(setup.fit_threads_to_load());
            measure_profile(&setup)?
        }
    };
    // Step times from a busy machine: said, not silently used (a cached profile was re-timed
    // already; one given with --profile is used as it is). No path in the note: plans from the
    // same profile read the same wherever it lies.
    notes.extend(profile_notes(&profile, "the profile"));
    let measured_on = profile.device.device.split(':').next().unwrap_or("cpu").to_owned();
    let target = a.target.clone().unwrap_or_else(|| measured_on.clone());
    if target != "cpu" && target != "cuda" {
        return Err(UsageError(format!("--target {target:?}: expected cpu or cuda")).into());
    }
    let shard = match a.shard {
        None => None,
        Some(ranks) => Some(shard_request(&a, ranks, &target, &mut profile, &mut notes)?),
    };
    let shape = ShapeJson {
        model: setup.model.clone(),
        image: setup.opts.image,
        seq: setup.opts.seq,
        classes: setup.opts.classes,
        granularity: a.model.granularity.clone(),
        repeats: setup.repeats,
        candidates: a.model.candidates.clone(),
        state_dict_key: a.model.state_dict_key.clone(),
        heads: a.model.heads,
    };
    let share = match requested {
        Budget::Bytes(_) => None,
        Budget::Percent(percent) => Some(budget_share(percent, &profile, shard.as_ref())?),
    };
    let budget = match &share {
        Some(s) => requested.resolve(s.smallest_peak_bytes, s.unconstrained_peak_bytes),
        None => requested.resolve(0, 0),
    };
    let reserve = reserve_bytes(&a, budget, &target, &measured_on, &mut notes)?;
    let mut plan = match plan_from_profile(&profile, budget - reserve, shape.clone(), shard.as_ref()) {
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
    let finish = |mut plan: PlanJson| {
        plan.budget_bytes = budget;
        plan.budget_share = share.clone();
        plan.margin_bytes = budget - reserve - plan.predicted.peak_bytes;
        plan.target_device = target.clone();
        plan.reserve_bytes = reserve;
        plan.notes = notes.clone();
        plan.notes.extend(eight_bit_note(&plan));
        plan
    };
    plan = finish(plan);
    let mut report = None;
    if a.verify {
        // A measured correction, not a fudge factor: if the run peaks above the budget, plan
        // again with the measured excess taken off the budget (on CPU the model is exact and
        // this loop ends after one verification).
        let mut corrections = Vec::new();
        let mut planning_budget = budget;
        for round in 0..4 {
            let r = verify_plan(&plan, setup.repeats, setup.quiet)?;
            if r.within_budget {
                plan.corrections = corrections;
                report = Some(r);
                break;
            }
            // The model's error at this plan; planning `error` below the budget makes a plan
            // with the same error fit. If a round repeats an error, step down again.
            let error = (r.measured.peak_bytes - r.predicted.peak_bytes).max(1);
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
            plan = finish(plan_from_profile(
                &profile,
                planning_budget - reserve,
                shape.clone(),
                shard.as_ref(),
            )?);
        }
    }
    // Rendered before anything is written: a plan the snippet cannot express is bad input that
    // leaves no file behind.
    let snippet = a
        .emit
        .map(|kind| crate::cli::snippets::snippet(&plan, kind))
        .transpose()?;
    if let Some(out) = &a.output {
        formats::write_atomic(out, &plan).with_context(|| "writing the plan")?;
    }
    if let Some(text) = snippet {
        // stdout is the snippet alone, ready to redirect into a file.
        outln!("{}", text.trim_end());
        if let Some(out) = &a.output {
            eprintln!("wrote {}", out.display());
        }
    } else if a.json {
        print_json(&plan)?;
    } else {
        print_plan(&plan);
        if let Some(r) = &report {
            outln!();
            print_verify(r);
        }
        if let Some(out) = &a.output {
            outln!("\nwrote {}", out.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A profile given with `--profile`, cut to the configs the flags allow; what it lacks, or a
/// CPU other than this one that measured it, goes into `notes`.
fn read_profile(path: &std::path::Path, setup: &Setup, notes: &mut Vec<String>) -> Result<ProfileJson> {
    let mut prof: ProfileJson = formats::read_tagged(path, formats::PROFILE_FORMAT)?;
    // The flags say which configs are allowed; a profile may hold more (or fewer).
    let allowed: Vec<ConfigSpec> = setup.configs.iter().map(TrainConfig::spec).collect();
    let measured: Vec<String> = prof.configs.iter().map(|c| c.config.label()).collect();
    prof.configs.retain(|c| allowed.iter().any(|a| a.same_as(&c.config)));
    if prof.configs.is_empty() {
        return Err(UsageError(format!(
            "profile {} holds none of the configs allowed by the flags ({}); it has: {}",
            path.display(),
            allowed.iter().map(ConfigSpec::label).collect::<Vec<_>>().join(", "),
            measured.join(", ")
        ))
        .into());
    }
    let missing: Vec<String> = allowed
        .iter()
        .filter(|c| !prof.configs.iter().any(|pc| pc.config.same_as(c)))
        .map(ConfigSpec::label)
        .collect();
    if !missing.is_empty() {
        notes.push(format!(
            "not in profile {}, so not considered: {}",
            path.display(),
            missing.join(", ")
        ));
    }
    let here = cpu_identity();
    if !prof.device.cpu.is_empty() && prof.device.cpu != here {
        notes.push(format!(
            "profile {} was measured on CPU {:?}, this is {here:?}: libtorch's CPU \
             kernels (and their workspaces) differ between CPUs, so profile here for \
             byte-exact predictions",
            path.display(),
            prof.device.cpu
        ));
    }
    Ok(prof)
}

/// What a budget given as a share lies between: the config the plan of an unlimited budget
/// runs (the fastest; for a sharded plan with its `reshard_after_forward`), its peak there, and
/// the smallest peak checkpointing reaches in that config (per rank, the highest rank's).
fn budget_share(percent: f64, profile: &ProfileJson, shard: Option<&ShardRequest>) -> Result<BudgetShareJson> {
    // The solver takes budgets up to 2^53 B (8 PiB), exact in f64.
    const UNLIMITED: i64 = 1 << 53;
    let problems: Vec<ConfigProblem> = candidates(profile, shard)?.into_iter().map(|c| c.problem).collect();
    let unconstrained = solver::solve(&problems, UNLIMITED)?;
    let fastest = &problems[unconstrained.best];
    Ok(BudgetShareJson {
        percent,
        config: fastest.key.clone(),
        smallest_peak_bytes: solver::min_peak(fastest)?.peak,
        unconstrained_peak_bytes: unconstrained.chosen().peak,
    })
}

/// Bytes of the budget kept out of planning: `--reserve`, or when a CUDA budget is planned
/// from a CPU profile, a guess at what a CPU cannot see (said in `notes`).
fn reserve_bytes(a: &PlanArgs, budget: i64, target: &str, measured_on: &str, notes: &mut Vec<String>) -> Result<i64> {
    // What a CPU profile cannot see of a CUDA step: the CUDA context and cuBLAS/cuDNN
    // workspaces (hundreds of MiB, outside the caching allocator's statistics but on the
    // card) and the caching allocator's rounding and fragmentation (reserved above allocated,
    // commonly 5-15% of the peak). 1 GiB + 10% covers both on current GPUs; `--reserve`
    // replaces it with a figure measured on the user's own card.
    let reserve: i64 = match (&a.reserve, target != measured_on) {
        (Some(r), _) => {
            let r = parse_size(r).context("--reserve")?;
            i64::try_from(r).map_err(|_| UsageError("--reserve: too large".into()))?
        }
        (None, true) => (1i64 << 30) + budget / 10,
        (None, false) => 0,
    };
    if reserve >= budget {
        return Err(UsageError(format!(
            "--budget {} leaves nothing to plan with after the reserve of {} for {target}",
            format_size(budget.max(0) as u64),
            format_size(reserve as u64)
        ))
        .into());
    }
    if target != measured_on {
        notes.push(format!(
            "planned for {target} from a {measured_on} profile: tensor bytes carry over between devices, but \
             {} of the budget is kept in reserve for the CUDA context, library workspaces and allocator \
             fragmentation (--reserve to change it); step times are {measured_on} times",
            format_size(reserve as u64)
        ));
    }
    Ok(reserve)
}

/// `--shard N` checked and resolved; configs the sharded model does not cover are dropped
/// from `profile`, said in `notes` (none left is bad input, with each config's reason).
fn shard_request(
    a: &PlanArgs,
    ranks: i64,
    target: &str,
    profile: &mut ProfileJson,
    notes: &mut Vec<String>,
) -> Result<ShardRequest> {
    if ranks & (ranks - 1) != 0 {
        return Err(UsageError(format!(
            "--shard {ranks}: sharded plans are modelled for powers of two ranks (1, 2, 4, 8, ...): gloo \
             reduce-scatters over other counts with another algorithm, whose buffers ckptune does not model \
             (docs/fsdp.md, section 11)"
        ))
        .into());
    }
    if a.verify {
        return Err(UsageError(
            "plan --shard --verify: a sharded plan is verified on N real processes: write it with -o, \
             then run `ckptune verify --pytorch plan.json`"
                .into(),
        )
        .into());
    }
    let units = a
        .shard_units
        .as_deref()
        .map(|u| regex::Regex::new(&format!("^(?:{u})$")))
        .transpose()
        .map_err(|e| UsageError(format!("--shard-units: not a regex: {e}")))?;
    notes.push(format!(
        "sharded over {ranks} rank{} with FSDP2: the budget and the peaks are per rank, --batch is each \
         rank's micro-batch (global batch {ranks} x {}); step times are one process's compute, FSDP's \
         all-gathers and reduce-scatters are not timed",
        if ranks == 1 { "" } else { "s" },
        profile.configs.first().map_or(0, |c| c.config.micro_batch)
    ));
    if target == "cuda" {
        notes.push(
            "NCCL's communicator buffers and the caching allocator's rounding of FSDP's all-gather \
             and reduce-scatter buffers are not seen on CPU: they are part of the reserve; NCCL \
             collectives allocate no temporaries (gloo's are left out of the model)"
                .into(),
        );
    }
    let req = ShardRequest {
        ranks,
        collective: if target == "cuda" {
            Collective::Nccl
        } else {
            Collective::Gloo
        },
        units,
    };
    let mut reasons = Vec::new();
    profile.configs.retain(|c| {
        match shard_step(
            c,
            &profile.model.parameters,
            |n| req.is_unit(&profile.model, n),
            &profile.model.name,
        ) {
            Err(ShardError::Unsupported(why)) => {
                reasons.push(why);
                false
            }
            _ => true,
        }
    });
    if profile.configs.is_empty() {
        return Err(UsageError(format!("--shard: no config can be sharded: {}", reasons.join("; "))).into());
    }
    if !reasons.is_empty() {
        notes.push(format!("left out of the sharded plan: {}", reasons.join("; ")));
    }
    Ok(req)
}

/// Why an 8-bit optimizer was chosen: the measured state saved and the measured step time
/// against the same config with the 32-bit optimizer, when both were profiled.
pub fn eight_bit_note(p: &PlanJson) -> Option<String> {
    let name = p.config.optimizer.strip_suffix("8bit")?;
    let full = p.alternatives.iter().find(|a| {
        a.config.optimizer == name
            && a.config.precision == p.config.precision
            && a.config.micro_batch == p.config.micro_batch
            && a.config.set_to_none == p.config.set_to_none
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
        "{} chosen over {name} (measured): with nothing checkpointed it peaks {} lower (8-bit moments); \
         its plan runs at {:.3} s per step, and {other}",
        p.config.optimizer,
        format_size(saved.max(0) as u64),
        chosen.predicted.step_seconds,
    ))
}

pub fn print_plan(p: &PlanJson) {
    outln!(
        "{} on {} ({} thread{}), budget {}",
        p.model.name,
        p.device.device,
        p.device.threads,
        if p.device.threads == 1 { "" } else { "s" },
        format_size(p.budget_bytes as u64)
    );
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
        "step",
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
            if a.checkpoint.modules.is_empty() {
                "(nothing)".into()
            } else {
                a.checkpoint.modules.join(",")
            }
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
    outln!(
        "  predicted peak:   {} of {} ({} to spare), at {}",
        format_size(p.predicted.peak_bytes as u64),
        format_size(p.budget_bytes as u64),
        format_size(p.margin_bytes.max(0) as u64),
        p.predicted.peak_moment
    );
    outln!(
        "  predicted step:   {:.3} s ({}{:.1}% throughput lost to recompute)",
        p.predicted.step_seconds,
        p.predicted
            .step_seconds_range
            .map(|r| format!("{} over the profile's samples; ", range_text(r)))
            .unwrap_or_default(),
        100.0 * p.predicted.throughput_loss
    );
    outln!(
        "  training config:  precision {}, optimizer {}, micro-batch {}, gradient accumulation {}, set_to_none {}",
        p.config.precision,
        optimizer_in_pytorch(&p.config),
        p.config.micro_batch,
        p.config.grad_accum,
        p.config.set_to_none
    );
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
