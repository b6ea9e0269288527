//! Solving a plan from a profile: one solver problem per config (per `reshard_after_forward`
//! setting for a sharded plan), the fastest that fits, every config's best as an alternative,
//! and when nothing fits, what would and what else could help.

use anyhow::Result;
use ckptune_solver::budget::format_size;
use ckptune_solver::formats::{
    self, AlternativeJson, CheckpointJson, ModelJson, PlanJson, PredictedJson, ProfileJson, RankPredictionJson,
    SelectiveJson, ShapeJson, ShardJson, SolverJson,
};
use ckptune_solver::model::{
    policy_name, runtime_choice, seconds_range_at_selective, shard_step, solver_problem, unit_order,
};
use ckptune_solver::problem::ConfigProblem;
use ckptune_solver::profile::{ConfigProfile, ConfigSpec};
use ckptune_solver::shard::{is_default_unit, Collective, ShardSpec, ShardStep};
use ckptune_solver::solver::{self, SolveError, SolveStatus};
use ckptune_solver::{chain_model, regex_emit};

use crate::cli::error::UsageError;

/// Names of the checkpointed units of choice `x` (unit order), in execution order: a group
/// where its first block would be, a module called several times once, at its first call.
fn chosen_names(model: &ModelJson, x: &[bool]) -> Vec<String> {
    let n = model.blocks.len();
    let groups: Vec<(usize, usize)> = model.groups.iter().map(|g| (g.first, g.last)).collect();
    let names: Vec<&str> = model.unit_names().collect();
    let mut out: Vec<String> = Vec::new();
    for u in chain_model::solver_order(n, &groups) {
        if x.get(u) == Some(&true) && !out.iter().any(|o| o == names[u]) {
            out.push(names[u].to_string());
        }
    }
    out
}

/// The plan's checkpoint section for the runtime's choice (`runtime_choice`) of config `c`: the
/// regex over every checkpointed module, and those of them run selective, grouped by the
/// policy `selective` gives each (in the order of the profile's policies).
fn checkpoint_json(
    model: &ModelJson,
    c: &ConfigProfile,
    mask: &[bool],
    selective: &[Option<usize>],
) -> Result<CheckpointJson> {
    let modules = chosen_names(model, mask);
    let regex = regex_emit::checkpoint_regex(&modules, &model.modules)?;
    let policies = c.regimes[0].blocks.iter().map(|b| b.selective.len()).max().unwrap_or(0);
    let mut groups = Vec::new();
    for p in 0..policies {
        let on: Vec<bool> = selective.iter().map(|&s| s == Some(p)).collect();
        let Some(j) = on.iter().position(|&o| o) else {
            continue;
        };
        groups.push(SelectiveJson {
            policy: policy_name(c, j, p).unwrap_or_default().to_owned(),
            modules: chosen_names(model, &on),
        });
    }
    Ok(CheckpointJson {
        regex,
        modules,
        selective: groups,
    })
}

/// How `plan --shard N` shards: the ranks, the collectives, and which blocks are FSDP units.
#[derive(Debug, Clone)]
pub(super) struct ShardRequest {
    pub ranks: i64,
    pub collective: Collective,
    /// Full match over block names; `None`: [`is_default_unit`].
    pub units: Option<regex::Regex>,
}

impl ShardRequest {
    pub(super) fn is_unit(&self, model: &ModelJson, name: &str) -> bool {
        match &self.units {
            Some(re) => re.is_match(name),
            None => model
                .blocks
                .iter()
                .any(|b| b.name == name && is_default_unit(&b.name, b.candidate)),
        }
    }
}

/// An FSDP unit of `req` that is several blocks of one name (a module called several times).
fn called_repeatedly<'a>(model: &'a ModelJson, req: &ShardRequest) -> Option<&'a str> {
    let names: Vec<&str> = model.blocks.iter().map(|b| b.name.as_str()).collect();
    (names.iter().enumerate())
        .find(|&(i, n)| names[..i].contains(n) && req.is_unit(model, n))
        .map(|(_, n)| *n)
}

/// One problem the solver sees: a profiled config, and for a sharded plan one
/// `reshard_after_forward` setting of it with its per-rank model.
pub(super) struct Candidate {
    config: usize,
    pub problem: ConfigProblem,
    order: Vec<usize>,
    shard: Option<(ShardStep, ShardSpec)>,
}

/// A config sharded over `ranks` ranks: `fp32/adamw/mb8x1/fsdp4`, with `/keep` when FSDP2 keeps
/// each unit unsharded from its forward to its backward (`reshard_after_forward=False`).
pub(super) fn shard_label(c: &ConfigSpec, ranks: i64, reshard_after_forward: bool) -> String {
    format!(
        "{}/fsdp{ranks}{}",
        c.label(),
        if reshard_after_forward { "" } else { "/keep" }
    )
}

pub(super) fn candidates(profile: &ProfileJson, shard: Option<&ShardRequest>) -> Result<Vec<Candidate>> {
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
        if let Some(name) = called_repeatedly(&profile.model, req) {
            return Err(UsageError(format!(
                "--shard: unit {name:?} is a module the model calls several times (a block per call); \
                 FSDP2 on such a module is not modelled: name other units with --shard-units REGEX"
            ))
            .into());
        }
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

/// Per config of an unsharded `profile`, the step time of its fastest checkpoint set within
/// `limit`, or `None` where none fits: what `--measure auto` ranks configs by before timing them.
pub(super) fn fastest_per_config(profile: &ProfileJson, limit: i64, shape: ShapeJson) -> Result<Vec<Option<f64>>> {
    match plan_from_profile(profile, limit, shape, None) {
        Ok(plan) => Ok(plan
            .alternatives
            .iter()
            .map(|alt| alt.feasible.then_some(alt.predicted.step_seconds))
            .collect()),
        Err(e) if e.downcast_ref::<PlanFailure>().is_some() => Ok(vec![None; profile.configs.len()]),
        Err(e) => Err(e),
    }
}

/// Solves a plan for `profile` under `budget` (for each rank of a sharded plan). `Err` of
/// [`PlanFailure`] when nothing fits.
pub(super) fn plan_from_profile(
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
            let c = &profile.configs[cands[k].config];
            let (mask, selective) = runtime_choice(c, &chain_model::unpermute(&x, &cands[k].order));
            let regex = checkpoint_json(&profile.model, c, &mask, &selective)?.regex;
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
    let mut selective = Vec::new();
    for (sol, cand) in plan.configs.iter_mut().zip(&cands) {
        // Back in unit order as the runtime runs it: the checkpoint mask (the runtime fuses by
        // itself) and the blocks run selective.
        let full = chain_model::unpermute(&sol.x, &cand.order);
        let (mut mask, sel) = runtime_choice(&profile.configs[cand.config], &full);
        // A sharded problem has a variable per block only.
        mask.truncate(full.len());
        sol.x = mask;
        selective.push(sel);
    }
    let mut alternatives = Vec::new();
    for ((sol, cand), sel) in plan.configs.iter().zip(&cands).zip(&selective) {
        let c = &profile.configs[cand.config];
        let base = c.seconds_none.median;
        alternatives.push(AlternativeJson {
            config: c.config.clone(),
            feasible: sol.status == SolveStatus::Optimal,
            checkpoint: checkpoint_json(&profile.model, c, &sol.x, sel)?,
            predicted: PredictedJson {
                peak_bytes: sol.peak,
                step_seconds: sol.seconds,
                // An estimate has no samples to spread over.
                step_seconds_range: seconds_range_at_selective(c, &sol.x, sel)
                    .filter(|_| !c.is_estimated())
                    .map(|(lo, hi)| [lo, hi]),
                throughput_loss: if sol.seconds > 0.0 {
                    1.0 - base / sol.seconds
                } else {
                    0.0
                },
                peak_moment: sol.binding.clone(),
                step_seconds_estimated: c.estimated.as_ref().map(|e| e.describe()),
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
        cuda_memory: None,
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
