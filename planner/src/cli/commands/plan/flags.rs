//! `plan`'s own flags resolved against the profile: a profile given with `--profile`, a budget
//! given as a share, the reserve for another device, and `--shard N`.

use anyhow::{Context, Result};
use ckptune_runtime::TrainConfig;
use ckptune_solver::budget::{format_size, parse_size};
use ckptune_solver::formats::{self, BudgetShareJson, ProfileJson};
use ckptune_solver::model::shard_step;
use ckptune_solver::problem::ConfigProblem;
use ckptune_solver::profile::ConfigSpec;
use ckptune_solver::shard::{Collective, ShardError};
use ckptune_solver::solver;

use super::solve::{candidates, ShardRequest};
use crate::cli::args::PlanArgs;
use crate::cli::error::UsageError;
use crate::cli::setup::{cpu_identity, Setup};

/// A profile given with `--profile`, cut to the configs the flags allow; what it lacks, or a
/// CPU other than this one that measured it, goes into `notes`.
pub(super) fn read_profile(path: &std::path::Path, setup: &Setup, notes: &mut Vec<String>) -> Result<ProfileJson> {
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
    selective_terms(&mut prof, path, setup)?;
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

/// A profile's selective terms are planned with exactly when `--selective` names their policy:
/// the terms of a policy the flag does not name are dropped (without the flag, the plan is the
/// one whole-layer checkpointing gives), the rest kept in the flag's order, and a profile that
/// lacks a named policy's terms on some candidate (measured without its step S) is refused.
fn selective_terms(prof: &mut ProfileJson, path: &std::path::Path, setup: &Setup) -> Result<()> {
    let names: Vec<&str> = setup.selective.iter().map(|p| p.name()).collect();
    let blocks = prof
        .configs
        .iter_mut()
        .flat_map(|c| &mut c.regimes)
        .flat_map(|r| &mut r.blocks);
    let (mut candidates, mut lacking) = (0, Vec::new());
    for b in blocks {
        let mut kept = Vec::with_capacity(names.len());
        for &name in &names {
            match b.selective.iter().find(|s| s.policy == name) {
                Some(s) => kept.push(s.clone()),
                None if b.candidate && !lacking.contains(&name) => lacking.push(name),
                None => {}
            }
        }
        candidates += usize::from(b.candidate);
        b.selective = kept;
    }
    if !names.is_empty() && (candidates == 0 || !lacking.is_empty()) {
        let lacking = if candidates == 0 {
            names.join(",")
        } else {
            lacking.join(",")
        };
        return Err(UsageError(format!(
            "--selective {}: profile {} was not measured with every candidate selective under {lacking}; \
             profile again with `ckptune profile ... --selective {}` (or plan without --profile)",
            setup.selective_names(),
            path.display(),
            setup.selective_names()
        ))
        .into());
    }
    Ok(())
}

/// What a budget given as a share lies between: the config the plan of an unlimited budget
/// runs (the fastest; for a sharded plan with its `reshard_after_forward`), its peak there, and
/// the smallest peak checkpointing reaches in that config (per rank, the highest rank's).
pub(super) fn budget_share(
    percent: f64,
    profile: &ProfileJson,
    shard: Option<&ShardRequest>,
) -> Result<BudgetShareJson> {
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

/// Bytes of the budget kept out of planning: `--reserve`; for a profile measured on CUDA, how
/// far the caching allocator's reserved bytes rose above the allocated peak in its steps; or
/// when a sharded CUDA budget is planned from a CPU profile, a guess at what a CPU cannot see
/// (said in `notes`).
pub(super) fn reserve_bytes(
    a: &PlanArgs,
    budget: i64,
    target: &str,
    measured_on: &str,
    times: &str,
    profile: &ProfileJson,
    notes: &mut Vec<String>,
) -> Result<i64> {
    let measured_excess = profile.configs.iter().filter_map(|c| c.reserved_excess()).max();
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
        (None, false) => measured_excess.unwrap_or(0),
    };
    if let (None, Some(excess)) = (&a.reserve, measured_excess) {
        notes.push(format!(
            "measured on {measured_on}: the caching allocator reserved up to {} above the allocated peak in the \
             profile's steps, kept in reserve (--reserve to change it)",
            format_size(excess.max(0) as u64)
        ));
    }
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
             fragmentation (--reserve to change it); step times are {times}",
            format_size(reserve as u64)
        ));
    }
    Ok(reserve)
}

/// `--shard N` checked and resolved; configs the sharded model does not cover are dropped
/// from `profile`, said in `notes` (none left is bad input, with each config's reason).
pub(super) fn shard_request(
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
    if !a.selective.selective.is_empty() {
        return Err(UsageError(
            "plan --shard --selective: sharded plans model whole-layer checkpointing only; drop one of them".into(),
        )
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

/// `--shard` with `--optimizer-step in-backward`, refused before anything is measured.
pub(super) fn check_shard_step(a: &PlanArgs) -> Result<()> {
    let in_backward = a
        .model
        .optimizer_step
        .iter()
        .any(|s| s.trim().eq_ignore_ascii_case("in-backward"));
    if a.shard.is_some() && in_backward {
        return Err(UsageError(
            "plan --shard --optimizer-step in-backward: FSDP2's step in backward (each rank stepping its \
             shard of a parameter after its reduce-scatter) is not modelled; drop one of them"
                .into(),
        )
        .into());
    }
    Ok(())
}
