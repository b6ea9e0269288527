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
    /// Steps A and B set aside as still growing the heap ([`warming`]).
    warming: (usize, usize),
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
            FirstStep::Plain if first_is_a_sample(&first) => {
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
            warming: (0, 0),
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
    /// forwards, either less the kernel's time in it. The first step grows the heap to the
    /// step's peak, every page faulted in fresh, where later steps reuse them (docs/timing.md,
    /// "Freed memory"); its system time, all threads', is at least that wall time, so what is
    /// left runs above a later step only by the first step's other one-time work, a small part
    /// of a long step.
    pub fn first_plain_seconds(&self) -> Option<f64> {
        implied_plain(&self.first, self.first_kind)
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
                let s = Sample::of(&self.session.step(&none_mask, None)?, ());
                keep_unless_warming(s, &mut self.samples_a, &mut self.warming.0);
            }
            if more_b {
                let s = step_b(self.session, &self.all)?.0;
                keep_unless_warming(s, &mut self.samples_b, &mut self.warming.1);
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
        let first_counted = usize::from(self.first_kind == FirstStep::Plain && first_is_a_sample(&self.first));
        StepTimes {
            seconds_none,
            seconds_all,
            recompute_spread: pooled_by_class(&unit_seconds, &self.recompute_class),
            contention: tally.finish(self.retimer.retimed),
            steps_run: 1 + self.samples_a.len() + self.samples_b.len() - first_counted
                + self.warming.0
                + self.warming.1
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

/// [`StagedSteps::first_plain_seconds`] of a `first` step of `kind`, whose extra holds its
/// blocks' no-grad forwards.
fn implied_plain(first: &Sample<Vec<f64>>, kind: FirstStep) -> Option<f64> {
    let recompute = match kind {
        FirstStep::Plain => 0.0,
        FirstStep::Checkpointed => first.extra.iter().sum::<f64>(),
    };
    let kernel = first.load.map_or(0.0, |l| l.own_system_seconds);
    bounds_plain(first).then_some((first.seconds - recompute - kernel).max(0.0))
}

/// Whether a first step was long and quiet enough to bound the step with nothing checkpointed.
fn bounds_plain<T>(first: &Sample<T>) -> bool {
    first.seconds >= FIRST_STEP_BOUNDS_SECONDS && !first.contended()
}

/// Whether a first step A counts as one of the steps A: it bounds the plain step, and it
/// already ran on the heap's pages rather than growing it.
fn first_is_a_sample<T>(first: &Sample<T>) -> bool {
    bounds_plain(first) && !warming(first)
}

/// A step whose kernel (system) time was over this share of its wall time was still growing
/// the heap: its pages were faulted in fresh, where the steps after it reuse them while freed
/// memory is held (docs/timing.md, "Freed memory"). A step on the heap's pages takes almost
/// none (0.00 s, the median step of every case of results/cost/intel-xeon-processor).
const WARMING_SYSTEM_SHARE: f64 = 0.05;
/// At most this many steps of a kind are set aside as warming, so that a host whose steps
/// fault every time (no hold: another C library) is still timed.
const MAX_WARMING: usize = 2;

/// Whether `step` was still growing the heap ([`WARMING_SYSTEM_SHARE`]).
fn warming<T>(step: &Sample<T>) -> bool {
    step.load
        .is_some_and(|l| l.own_system_seconds > WARMING_SYSTEM_SHARE * step.seconds)
}

/// Keeps `step` as a sample, unless it was still growing the heap and fewer than
/// [`MAX_WARMING`] steps of its kind were set aside (counted in `set_aside`): then one more
/// step of its kind runs in its place.
fn keep_unless_warming<T>(step: Sample<T>, samples: &mut Vec<Sample<T>>, set_aside: &mut usize) {
    if warming(&step) && *set_aside < MAX_WARMING {
        *set_aside += 1;
    } else {
        samples.push(step);
    }
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
    fn a_step_growing_the_heap_is_set_aside_at_most_twice_per_kind() {
        let step = |system: f64| Sample {
            seconds: 10.0,
            load: Some(crate::load::Load {
                wall_seconds: 10.0,
                other_cpu_seconds: 0.0,
                own_cpu_seconds: 10.0,
                own_system_seconds: system,
                cpus: 2,
                threads: 1,
            }),
            extra: (),
        };
        let (mut samples, mut aside) = (Vec::new(), 0);
        for system in [3.0, 0.01, 3.0, 3.0, 0.0] {
            keep_unless_warming(step(system), &mut samples, &mut aside);
        }
        let kept: Vec<f64> = samples.iter().map(|s| s.load.unwrap().own_system_seconds).collect();
        assert_eq!(
            (kept, aside),
            (vec![0.01, 3.0, 0.0], 2),
            "the third warming step is kept"
        );
        assert!(first_is_a_sample(&step(0.4)) && !first_is_a_sample(&step(0.6)));
        let unread = Sample {
            load: None,
            ..step(0.0)
        };
        assert!(first_is_a_sample(&unread));
    }

    #[test]
    fn a_first_step_implies_its_plain_step_less_its_forwards_and_its_kernel_time() {
        let first = |seconds: f64, other: f64, system: f64| Sample {
            seconds,
            load: Some(crate::load::Load {
                wall_seconds: seconds,
                other_cpu_seconds: other,
                own_cpu_seconds: seconds,
                own_system_seconds: system,
                cpus: 2,
                threads: 1,
            }),
            extra: vec![1.0, 2.0],
        };
        assert_eq!(
            implied_plain(&first(20.0, 0.0, 4.0), FirstStep::Checkpointed),
            Some(13.0)
        );
        assert_eq!(implied_plain(&first(20.0, 0.0, 4.0), FirstStep::Plain), Some(16.0));
        assert_eq!(implied_plain(&first(20.0, 0.0, 30.0), FirstStep::Plain), Some(0.0));
        // Too short for its one-time work to be a small part, or contended: no bound.
        assert_eq!(implied_plain(&first(5.0, 0.0, 0.0), FirstStep::Plain), None);
        assert_eq!(implied_plain(&first(20.0, 30.0, 0.0), FirstStep::Plain), None);
        let unread = Sample {
            load: None,
            ..first(20.0, 0.0, 0.0)
        };
        assert_eq!(implied_plain(&unread, FirstStep::Checkpointed), Some(17.0));
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
            own_system_seconds: 0.0,
            cpus: 2,
            threads: 1,
        });
        assert!(busy[1].contended());
        assert!(!settled(&busy));
    }
}
