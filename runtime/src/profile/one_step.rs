//! Times from step B alone, for a profile whose memory was measured on the meta device: the step
//! with every candidate checkpointed gives, at once, the step's time with everything
//! checkpointed, each block's no-grad forward (what checkpointing it adds: its recompute
//! estimate) and, less those forwards, the step's time with nothing checkpointed. Its first run
//! warms the session up (optimizer state, oneDNN's primitives) and is traced; `repeats` more are
//! timed and re-timed as the profiler's are (docs/timing.md). Units doing the same work share one
//! estimate over all their samples, so a model of identical layers is timed as one class.

use std::time::Instant;

use ckptune_kernels::optrace::{self, OpEvent};
use ckptune_solver::profile::{Contention, Stats};

use super::timing::{self, ContentionTally, Retimer, Sample};
use super::{pooled_by_class, step_b, ConfigProfile, ProfileSettings};
use crate::error::Result;
use crate::exec::Session;

/// The times of a profile, from steps B.
#[derive(Debug, Clone, PartialEq)]
pub struct StepTimes {
    pub seconds_none: Stats,
    pub seconds_all: Stats,
    pub recompute_spread: Vec<Stats>,
    pub contention: Contention,
    pub steps_run: usize,
    pub wall_seconds: f64,
}

impl StepTimes {
    /// `profile`'s times replaced by these (its memory terms kept), and the steps counted.
    pub fn apply(self, profile: &mut ConfigProfile) {
        profile.seconds_none = self.seconds_none;
        profile.seconds_all = self.seconds_all;
        profile.recompute_seconds = self.recompute_spread.iter().map(|s| s.median).collect();
        profile.recompute_spread = self.recompute_spread;
        profile.contention = self.contention;
        profile.steps_run += self.steps_run;
        profile.wall_seconds += self.wall_seconds;
    }
}

/// Times `session` (real, fresh) with steps B, and returns the operators of its first step too
/// (what the kernels allocated, call by call: fake mode learns from them the scratch its meta
/// kernels do not allocate). `recompute_class` is the profile's: per unit (blocks, then
/// groups), the first unit doing the same work. A group's recompute is its blocks' no-grad
/// forwards.
pub fn times_from_steps(
    session: &mut Session,
    recompute_class: &[usize],
    settings: &ProfileSettings,
) -> Result<(StepTimes, Vec<OpEvent>)> {
    let t0 = Instant::now();
    let all = session.chain.every_candidate();
    optrace::start()?;
    let first = step_b(session, &all);
    let ops = optrace::stop()?;
    first?;
    let repeats = settings.repeats.max(1);
    let mut samples = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        samples.push(step_b(session, &all)?.0);
    }
    let mut retimer = Retimer::new(settings.retime);
    retimer.retime(&mut samples, || Ok(step_b(session, &all)?.0))?;
    let used = timing::used(&samples);
    let chain = &session.chain;
    let n = chain.blocks.len();
    // Per unit and used sample, its no-grad forward seconds; `None` for a block that is not a
    // candidate.
    let unit_seconds: Vec<Option<Vec<f64>>> = (0..chain.units())
        .map(|u| match chain.blocks.get(u) {
            Some(b) => b.candidate.then(|| used.iter().map(|s| s.extra[u]).collect()),
            None => {
                let g = &chain.groups[u - n];
                Some(used.iter().map(|s| s.extra[g.first..=g.last].iter().sum()).collect())
            }
        })
        .collect();
    let recompute_spread = pooled_by_class(&unit_seconds, recompute_class);
    let none: Vec<f64> = used.iter().map(|s| (s.seconds - forwards(s, chain)).max(0.0)).collect();
    let mut tally = ContentionTally::default();
    tally.add(&samples);
    let times = StepTimes {
        seconds_none: Stats::of(&none),
        seconds_all: timing::seconds(&samples),
        recompute_spread,
        contention: tally.finish(retimer.retimed),
        steps_run: 1 + repeats + retimer.retimed,
        wall_seconds: t0.elapsed().as_secs_f64(),
    };
    Ok((times, ops))
}

/// The candidate blocks' no-grad forward seconds of one step B.
fn forwards(sample: &Sample<Vec<f64>>, chain: &ckptune_models::Chain) -> f64 {
    (0..chain.blocks.len())
        .filter(|&i| chain.blocks[i].candidate)
        .map(|i| sample.extra[i])
        .sum()
}
