//! Times from real steps, for a profile whose memory was measured on the meta device: step B
//! (every candidate checkpointed) gives the step's time with everything checkpointed and each
//! block's no-grad forward (what checkpointing it adds: its recompute estimate); step A (nothing
//! checkpointed) the step's time with nothing checkpointed. That one is timed rather than taken
//! as B less its no-grad forwards: a step keeping every activation faults in fresh pages for
//! them and streams more memory, and BERT-large's came out 15-27% above B's difference. A first
//! step warms the session up (optimizer state, oneDNN's primitives) and is traced: a step B, or
//! for `plan` a step A where steps A alone are expected to settle the plan. Then A and B are
//! timed and re-timed as the profiler's are, until each settles (docs/timing.md): alternating
//! for `profile`, in stages for `plan`, which may stop after any stage ([`StagedSteps`]).
//! Units doing the same work share one estimate over all their samples, so a model of identical
//! layers is timed as one class. A profile offering selective checkpointing also runs steps S
//! for real, each block's selective recompute timed there.

use std::time::Instant;

use ckptune_kernels::optrace::{self, OpEvent};
use ckptune_solver::profile::{Contention, Stats};

use super::timing::{self, ContentionTally, Retimer, Sample};
use super::{pooled_by_class, step_b, unit_forwards, ConfigProfile, ProfileSettings};
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
    /// Per policy of `ProfileSettings::selective`, per block, its recompute seconds run
    /// selective under it: they replace the meta device's in the profile's selective terms.
    pub selective_seconds: Vec<Vec<f64>>,
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
        for (p, seconds) in self.selective_seconds.iter().enumerate() {
            for (i, &s) in seconds.iter().enumerate() {
                for r in &mut profile.regimes {
                    if let Some(sel) = r.blocks.get_mut(i).and_then(|b| b.selective.get_mut(p)) {
                        sel.rec_seconds = s;
                    }
                }
            }
        }
    }
}

/// Times `session` (real, fresh) with steps B, and returns the operators of its first step too
/// (what the kernels allocated, call by call: fake mode learns from them the scratch its meta
/// kernels do not allocate). `recompute_class` is the profile's: per unit (blocks, then
/// groups), the first unit doing the same work. A group's recompute is its blocks' no-grad
/// forwards. Steps A and B alternate, so a drift of the machine falls on both.
pub fn times_from_steps(
    session: &mut Session,
    recompute_class: &[usize],
    settings: &ProfileSettings,
) -> Result<(StepTimes, Vec<OpEvent>)> {
    let (mut steps, ops) = StagedSteps::start(session, recompute_class, settings, FirstStep::Checkpointed)?;
    steps.time(true, true)?;
    steps.time_selective()?;
    Ok((steps.times(), ops))
}

/// A session's real steps timed in stages, for a caller that may stop early: a first step
/// (traced; it warms the session up: optimizer state, oneDNN's primitives), then steps A until
/// they settle, then steps B until they settle. `plan` stops after the first step where that
/// step already shows the config cannot win, and after steps A where the config's fastest
/// choice checkpoints nothing (its step is step A; its recompute estimates then come from the
/// first step alone). The first step is a step B, unless the caller expects steps A to settle
/// the plan ([`FirstStep::Plain`]): then it is a step A, and a long one counts as one of them.
pub struct StagedSteps<'s> {
    session: &'s mut Session,
    recompute_class: Vec<usize>,
    repeats: usize,
    selective: Vec<ckptune_kernels::sac::SacPolicy>,
    all: Vec<bool>,
    first_kind: FirstStep,
    first: Sample<Vec<f64>>,
    samples_a: Vec<Sample<()>>,
    samples_b: Vec<Sample<Vec<f64>>>,
    retimer: Retimer,
    /// Per policy timed, per block; and the steps that took.
    selective_seconds: (Vec<Vec<f64>>, usize),
    t0: Instant,
}

impl<'s> StagedSteps<'s> {
    /// Runs the first step, traced: returns the timer and the step's operators.
    pub fn start(
        session: &'s mut Session,
        recompute_class: &[usize],
        settings: &ProfileSettings,
        first_kind: FirstStep,
    ) -> Result<(Self, Vec<OpEvent>)> {
        let t0 = Instant::now();
        let all = session.chain.every_candidate();
        optrace::start()?;
        let first = step_b(session, &first_kind.mask(&all));
        let ops = optrace::stop()?;
        let first = first?.0;
        // A long first step A is one more sample of steps A: its one-time work is a small part
        // of it (FIRST_STEP_BOUNDS_SECONDS), and the median of the samples outvotes it.
        let samples_a = match first_kind {
            FirstStep::Plain if bounds_plain(&first) => {
                vec![Sample {
                    seconds: first.seconds,
                    load: first.load,
                    extra: (),
                }]
            }
            _ => Vec::new(),
        };
        let steps = StagedSteps {
            session,
            recompute_class: recompute_class.to_vec(),
            repeats: settings.repeats.max(1),
            selective: settings.selective.clone(),
            all,
            first_kind,
            first,
            samples_a,
            samples_b: Vec::new(),
            retimer: Retimer::new(settings.retime),
            selective_seconds: (Vec::new(), 0),
            t0,
        };
        Ok((steps, ops))
    }

    /// Which step the session's first was, and so what `ops` from [`StagedSteps::start`] trace.
    pub fn first_kind(&self) -> FirstStep {
        self.first_kind
    }

    /// The step with nothing checkpointed that the first step implies, where it was long and
    /// quiet enough to say so: a first step A itself, a first step B less its blocks' no-grad
    /// forwards. The latter runs below the measured step A (which faults in fresh pages for
    /// every activation it keeps: 15-27% below on BERT-large, docs/timing.md); either runs
    /// above it only by the first step's one-time work, a small part of a long step.
    pub fn first_plain_seconds(&self) -> Option<f64> {
        let s = &self.first;
        let recompute = match self.first_kind {
            FirstStep::Plain => 0.0,
            FirstStep::Checkpointed => s.extra.iter().sum::<f64>(),
        };
        bounds_plain(s).then_some(s.seconds - recompute)
    }

    /// Times steps A (`plain`) and B (`checkpointed`), alternating where both, until each kind
    /// has settled or run `repeats` times; then re-times their contended samples.
    pub fn time(&mut self, plain: bool, checkpointed: bool) -> Result<()> {
        let none_mask = vec![false; self.session.chain.units()];
        loop {
            let more_a = plain && self.samples_a.len() < self.repeats && !settled(&self.samples_a);
            let more_b = checkpointed && self.samples_b.len() < self.repeats && !settled(&self.samples_b);
            if !more_a && !more_b {
                break;
            }
            if more_a {
                self.samples_a
                    .push(Sample::of(&self.session.step(&none_mask, None)?, ()));
            }
            if more_b {
                self.samples_b.push(step_b(self.session, &self.all)?.0);
            }
        }
        let (session, all) = (&mut *self.session, &self.all);
        if plain {
            self.retimer.retime(&mut self.samples_a, || {
                Ok(Sample::of(&session.step(&none_mask, None)?, ()))
            })?;
        }
        if checkpointed {
            self.retimer
                .retime(&mut self.samples_b, || Ok(step_b(session, all)?.0))?;
        }
        Ok(())
    }

    /// Times each block's selective recompute under each policy the profile offers (steps S).
    pub fn time_selective(&mut self) -> Result<()> {
        let (mut seconds, mut steps) = (Vec::new(), 0);
        for &policy in &self.selective {
            let (s, n) = super::selective::real_seconds(self.session, policy, &self.all, self.repeats)?;
            seconds.push(s);
            steps += n;
        }
        self.selective_seconds = (seconds, steps);
        Ok(())
    }

    /// Whether steps B were timed after the first: without them, the times with everything
    /// checkpointed and the recompute estimates are the first step's.
    pub fn checkpointed_timed(&self) -> bool {
        !self.samples_b.is_empty()
    }

    /// The times measured so far (steps A must have been timed). Without steps B, the times
    /// with every candidate checkpointed and the recompute estimates are the first step's: a
    /// step B's no-grad forwards, or a step A's forwards with grad (no faster than without,
    /// which do the same work and save nothing) added to the step A measured.
    pub fn times(&self) -> StepTimes {
        let first = std::slice::from_ref(&self.first);
        let samples_b = match self.samples_b.is_empty() {
            true => first,
            false => &self.samples_b[..],
        };
        let used: Vec<&[f64]> = timing::used(samples_b).iter().map(|s| s.extra.as_slice()).collect();
        let unit_seconds = unit_forwards(&self.session.chain, &used);
        let seconds_none = timing::seconds(&self.samples_a);
        let from_plain_first = self.first_kind == FirstStep::Plain && self.samples_b.is_empty();
        let seconds_all = match from_plain_first {
            true => {
                let candidates = self.session.chain.blocks.iter().zip(&self.first.extra);
                let recompute: f64 = candidates.filter(|(b, _)| b.candidate).map(|(_, s)| s).sum();
                Stats::of(&[seconds_none.median + recompute])
            }
            false => timing::seconds(samples_b),
        };
        let mut tally = ContentionTally::default();
        tally.add(&self.samples_a);
        if !from_plain_first {
            tally.add(samples_b);
        }
        let (selective_seconds, selective_steps) = self.selective_seconds.clone();
        // A long first step A is among `samples_a`.
        let first_counted = usize::from(self.first_kind == FirstStep::Plain && bounds_plain(&self.first));
        StepTimes {
            seconds_none,
            seconds_all,
            recompute_spread: pooled_by_class(&unit_seconds, &self.recompute_class),
            contention: tally.finish(self.retimer.retimed),
            steps_run: 1 + self.samples_a.len() + self.samples_b.len() - first_counted
                + self.retimer.retimed
                + selective_steps,
            wall_seconds: self.t0.elapsed().as_secs_f64(),
            selective_seconds,
        }
    }
}

/// The kind of step a session's staged timing starts with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirstStep {
    /// A step B, every candidate checkpointed: its no-grad forwards are the recompute
    /// estimates, and its operators cover every kind of forward.
    Checkpointed,
    /// A step A, nothing checkpointed, for a config whose plan the caller expects to checkpoint
    /// nothing: a long one is one of the steps A that settle that plan, so the config's
    /// timing takes one step fewer, and a shorter one (BERT-large's first step B took 48 s on
    /// an Intel Xeon, its steps A 25-29 s).
    Plain,
}

impl FirstStep {
    /// The step's checkpoint mask, given the mask with every candidate (`Chain::every_candidate`).
    pub fn mask(self, all: &[bool]) -> Vec<bool> {
        match self {
            FirstStep::Checkpointed => all.to_vec(),
            FirstStep::Plain => vec![false; all.len()],
        }
    }
}

/// A first step at least this long bounds the config's step with nothing checkpointed
/// ([`StagedSteps::first_plain_seconds`]): its one-time work (oneDNN's primitives, the
/// optimizer's state, a few hundred milliseconds) is then a small part of it.
const FIRST_STEP_BOUNDS_SECONDS: f64 = 10.0;

/// Whether a first step was long and quiet enough to bound the step with nothing checkpointed,
/// and, as a step A, to count as one.
fn bounds_plain<T>(first: &Sample<T>) -> bool {
    first.seconds >= FIRST_STEP_BOUNDS_SECONDS && !first.contended()
}

/// Steps at least this long settle early: two agreeing samples are the statistic's median.
const LONG_STEP_SECONDS: f64 = 2.0;
/// How close two long steps must be to settle: a third step could move the median of the three
/// by at most half their difference, 2%, inside the few percent by which the fastest of three
/// steps lies below their median (docs/timing.md, "The statistic").
const AGREEMENT: f64 = 0.04;

/// Whether the last two quiet samples are long steps agreeing within [`AGREEMENT`], so that more
/// steps would not move the median: a step of tens of seconds is timed twice, not `repeats`
/// times (its recompute estimates pool every identical layer's samples of those two steps).
fn settled<T>(samples: &[Sample<T>]) -> bool {
    let quiet: Vec<f64> = samples.iter().filter(|s| !s.contended()).map(|s| s.seconds).collect();
    let [.., a, b] = quiet[..] else {
        return false;
    };
    let shorter = a.min(b);
    shorter >= LONG_STEP_SECONDS && (a - b).abs() <= AGREEMENT * shorter
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quiet(seconds: &[f64]) -> Vec<Sample<Vec<f64>>> {
        seconds
            .iter()
            .map(|&seconds| Sample {
                seconds,
                load: None,
                extra: Vec::new(),
            })
            .collect()
    }

    #[test]
    fn only_long_steps_that_agree_settle_early() {
        assert!(!settled(&quiet(&[])));
        assert!(!settled(&quiet(&[30.0])));
        // Long and within 2%: a third step would not move the median.
        assert!(settled(&quiet(&[30.0, 31.0])));
        assert!(!settled(&quiet(&[30.0, 31.5])));
        // Short steps are timed `repeats` times, however close.
        assert!(!settled(&quiet(&[0.5, 0.5])));
        // The last two decide.
        assert!(settled(&quiet(&[40.0, 30.0, 30.2])));
        // A contended sample does not count.
        let mut busy = quiet(&[30.0, 30.1]);
        // The rest of the machine took both of 2 CPUs for the whole 30 s step of 1 thread.
        busy[1].load = Some(crate::load::Load {
            wall_seconds: 30.1,
            other_cpu_seconds: 60.2,
            own_cpu_seconds: 30.1,
            cpus: 2,
            threads: 1,
        });
        assert!(busy[1].contended());
        assert!(!settled(&busy));
    }
}
