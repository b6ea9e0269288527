//! A config's profile with memory from the meta device and times from real steps, measured in
//! stages (`ckptune_runtime::profile::StagedSteps`): `plan` stops timing a config as soon as
//! what it has measured settles the plan (`contenders` decides), and `profile` times every kind
//! of step. Memory is exact for this CPU either way: the first real step is traced, and what its
//! kernels allocate beyond the meta kernels (oneDNN's scratch, by operator and inputs) is learned
//! against the first step of a fake session, the meta profile then measured with that scratch.

use anyhow::{Context, Result};
use ckptune_kernels::{fake, optrace};
use ckptune_runtime::profile::{ConfigProfile, FirstStep, ProfileSettings, StagedSteps, StepTimes};
use ckptune_runtime::TrainConfig;
use ckptune_solver::formats::ModelJson;

use super::{given_or_meta, meta_profile, read_cache, real_profile, write_cache, How};
use crate::cli::setup::{model_json, Setup};
use ckptune_models::TraceKernels;

/// Appended to a config's cache key for a profile whose steps B were not timed (`Kinds::Plain`).
const PLAIN_KEY: &str = "|measure=meta+steps-a";

/// What `plan` knows when it times a config.
pub(super) struct Stages<'a> {
    /// The fastest step measured so far, another config's.
    pub fastest: Option<f64>,
    /// Whether a profile whose steps A are timed (its recompute estimates the first step's) still
    /// needs its steps B: solved under the budget, its fastest choice checkpoints something and
    /// may still win.
    pub needs_checkpointed: &'a dyn Fn(&ConfigProfile) -> Result<bool>,
    /// Whether the config's estimated profile needs its steps B: where it does not, its timing
    /// starts with a step A ([`FirstStep::Plain`]), one of the steps that settle its plan.
    pub estimate_needs_checkpointed: bool,
}

/// Which kinds of step a measured profile's times come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kinds {
    /// Steps A and B, each settled.
    Full,
    /// Steps A settled; the times with every candidate checkpointed, and so the recompute
    /// estimates, from the first step alone.
    Plain,
}

/// A config's profile, the model it was measured on, and the kinds of step its times come from.
pub(super) struct Profiled {
    pub model: ModelJson,
    pub profile: ConfigProfile,
    pub kinds: Kinds,
}

/// What timing a config in stages came to.
pub(super) enum Staged {
    Measured(Box<Profiled>),
    /// Its first step already implies a plain step of this many seconds, no faster than the
    /// fastest one measured: it cannot win, and timing it stopped there.
    RuledOut(f64),
}

/// Every kind of step timed, A and B alternating (`profile`, `--measure meta`).
pub(super) fn full_profile(
    setup: &Setup,
    cfg: &TrainConfig,
    unlearned: Option<ConfigProfile>,
) -> Result<(ModelJson, ConfigProfile)> {
    match measured(setup, cfg, unlearned, None)? {
        Staged::Measured(m) => Ok((m.model, m.profile)),
        Staged::RuledOut(_) => anyhow::bail!("timing {} under {}: stopped with no stages", setup.model, cfg.label()),
    }
}

/// The cached profile of `cfg` that settles the plan (every kind timed, or steps A alone where
/// they settle it), else one measured in stages and cached.
pub(super) fn staged_profile(
    setup: &Setup,
    cfg: &TrainConfig,
    unlearned: Option<ConfigProfile>,
    stages: &Stages<'_>,
) -> Result<Staged> {
    let key = setup.cache_key(cfg);
    let quiet_cache = |k: &str| read_cache(setup, k).filter(|c| !c.profile.contention.contended());
    if let Some(c) = quiet_cache(&(key.clone() + &How::MetaTimed.key(setup))) {
        return Ok(measured_as(c.model, c.profile, Kinds::Full));
    }
    if let Some(c) = quiet_cache(&(key.clone() + PLAIN_KEY)) {
        if !(stages.needs_checkpointed)(&c.profile)? {
            return Ok(measured_as(c.model, c.profile, Kinds::Plain));
        }
    }
    let staged = measured(setup, cfg, unlearned, Some(stages))?;
    if let Staged::Measured(m) = &staged {
        let suffix = match m.kinds {
            Kinds::Full => How::MetaTimed.key(setup),
            Kinds::Plain => PLAIN_KEY.into(),
        };
        write_cache(setup, &(key + &suffix), &m.model, &m.profile)?;
    }
    Ok(staged)
}

/// A cached profile whose steps B were not timed, for `decide`'s look at what a config needs.
pub(super) fn cached_plain(setup: &Setup, cfg: &TrainConfig) -> Option<ConfigProfile> {
    read_cache(setup, &(setup.cache_key(cfg) + PLAIN_KEY)).map(|c| c.profile)
}

/// Times `cfg` for real, in stages where `stages` is given, with its memory learned from the
/// first step (`unlearned`: the meta profile `decide` measured, if any). Where the meta device's
/// step does not line up with the real one, every step runs for real.
fn measured(
    setup: &Setup,
    cfg: &TrainConfig,
    unlearned: Option<ConfigProfile>,
    stages: Option<&Stages<'_>>,
) -> Result<Staged> {
    let unlearned = given_or_meta(setup, cfg, unlearned)?;
    let Steps {
        model,
        times,
        ops,
        first,
        kinds,
    } = match timed(setup, cfg, &unlearned, stages)? {
        Timed::Steps(steps) => *steps,
        Timed::RuledOut(plain) => return Ok(Staged::RuledOut(plain)),
        // Its steps B are needed after all, and its first step traced only a step A's operators.
        Timed::Again => return measured(setup, cfg, Some(unlearned), None),
    };
    // Learned with the real session gone: the meter counts every live tensor, and the meta
    // profile's fixed bytes are those of its own session.
    let Some(mut p) = learned_memory(setup, cfg, unlearned.clone(), &ops, first)? else {
        let (model, p) = real_profile(setup, cfg)?;
        return Ok(measured_as(model, p, Kinds::Full));
    };
    times.apply(&mut p);
    if let (Kinds::Plain, Some(s)) = (kinds, stages) {
        // The scratch learned can lift the peak of the plain step over the budget.
        if (s.needs_checkpointed)(&p)? {
            return measured(setup, cfg, Some(unlearned), None);
        }
    }
    Ok(measured_as(model, p, kinds))
}

fn measured_as(model: ModelJson, profile: ConfigProfile, kinds: Kinds) -> Staged {
    Staged::Measured(Box::new(Profiled { model, profile, kinds }))
}

/// A session's real steps: the model, the times, the first step's operators and kind, and the
/// kinds of step timed.
struct Steps {
    model: ModelJson,
    times: StepTimes,
    ops: Vec<optrace::OpEvent>,
    first: FirstStep,
    kinds: Kinds,
}

/// What a session's real steps came to.
enum Timed {
    Steps(Box<Steps>),
    RuledOut(f64),
    /// Started with a step A, it turned out to need its steps B: to be timed again in full.
    Again,
}

/// Runs `cfg`'s real steps: every kind, or in `stages`, deciding on `unlearned`'s memory (the
/// meta device's, before the scratch the real steps allocate is learned).
fn timed(setup: &Setup, cfg: &TrainConfig, unlearned: &ConfigProfile, stages: Option<&Stages<'_>>) -> Result<Timed> {
    let mut real = setup.session(cfg)?;
    let mj = model_json(&real.chain);
    let settings = ProfileSettings {
        repeats: setup.repeats,
        quiet: setup.quiet,
        selective: setup.selective.clone(),
        ..Default::default()
    };
    let timing = || format!("timing {} under {}", setup.model, cfg.label());
    let first = match stages {
        Some(s) if setup.selective.is_empty() && !s.estimate_needs_checkpointed => FirstStep::Plain,
        _ => FirstStep::Checkpointed,
    };
    let (mut steps, real_ops) =
        StagedSteps::start(&mut real, &unlearned.recompute_class, &settings, first).with_context(timing)?;
    let kinds = match stages {
        None => {
            steps.time(true, true).with_context(timing)?;
            Kinds::Full
        }
        Some(s) => {
            if let Some(plain) = super::contenders::ruled_out(steps.first_plain_seconds(), s.fastest) {
                return Ok(Timed::RuledOut(plain));
            }
            steps.time(true, false).with_context(timing)?;
            let mut plain = unlearned.clone();
            steps.times().apply(&mut plain);
            // A selective recompute is timed only in steps S, after steps B: a profile offering it
            // is timed whole.
            if setup.selective.is_empty() && !(s.needs_checkpointed)(&plain)? {
                return Ok(timed_as(mj, steps.times(), real_ops, first, Kinds::Plain));
            }
            if first == FirstStep::Plain {
                return Ok(Timed::Again);
            }
            steps.time(false, true).with_context(timing)?;
            Kinds::Full
        }
    };
    steps.time_selective().with_context(timing)?;
    Ok(timed_as(mj, steps.times(), real_ops, first, kinds))
}

fn timed_as(model: ModelJson, times: StepTimes, ops: Vec<optrace::OpEvent>, first: FirstStep, kinds: Kinds) -> Timed {
    Timed::Steps(Box::new(Steps {
        model,
        times,
        ops,
        first,
        kinds,
    }))
}

/// The memory profile of `cfg` with the scratch the real step `real_ops` (of kind `first`)
/// allocated beyond the meta kernels, or `None` (said) where the two steps do not line up. A
/// step traced for a GPU learns nothing from the CPU's: it runs CUDA's kernels where the CPU's
/// differ, and the meta profile already made (`unlearned`) is the GPU's.
fn learned_memory(
    setup: &Setup,
    cfg: &TrainConfig,
    unlearned: ConfigProfile,
    real_ops: &[optrace::OpEvent],
    first: FirstStep,
) -> Result<Option<ConfigProfile>> {
    if setup.fake_kernels() == TraceKernels::Cuda {
        return Ok(Some(unlearned));
    }
    let fake_ops = {
        let mut fake = setup.fake_session(cfg)?;
        let mask = first.mask(&fake.chain.every_candidate());
        optrace::start()?;
        let stepped = fake.step(&mask, None);
        let ops = optrace::stop()?;
        stepped?;
        ops
    };
    let scratch = match optrace::learned_scratch(real_ops, &fake_ops) {
        Ok(s) => s,
        Err(why) => {
            if !setup.quiet {
                eprintln!(
                    "note: {} under {}: the meta device's step does not line up with the real one ({why}); \
                     measuring every step for real",
                    setup.model,
                    cfg.label()
                );
            }
            return Ok(None);
        }
    };
    fake::set_scratch(&scratch)?;
    let measured = meta_profile(setup, cfg);
    fake::set_scratch(&[])?;
    Ok(Some(measured?.1))
}
