//! Timed samples of steps, re-timed when the machine was busy, and the statistic the step-time
//! estimates use (docs/timing.md): the median of the quiet samples, or of all samples where a
//! kind of step had no quiet one (and then the profile says so).

use std::time::Duration;

use ckptune_solver::profile::{Contention, Stats};

use crate::error::Result;
use crate::exec::{Session, StepReport};
use crate::load::Load;

/// One timed step, with what it measured besides its total (per-unit seconds, for instance).
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<T> {
    pub seconds: f64,
    pub load: Option<Load>,
    pub extra: T,
}

impl<T> Sample<T> {
    pub fn of(report: &StepReport, extra: T) -> Self {
        Sample {
            seconds: report.seconds,
            load: report.load,
            extra,
        }
    }

    pub fn contended(&self) -> bool {
        self.load.is_some_and(|l| l.contended())
    }

    fn other_cores(&self) -> f64 {
        self.load.map_or(0.0, |l| l.other_cores())
    }
}

/// How contended samples are re-timed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetimePolicy {
    /// Re-timings of one sample at most.
    pub per_sample: usize,
    /// Stop re-timing after this many contended re-timings in a row: the load is steady and
    /// waiting does not help.
    pub in_a_row: usize,
    /// The wait before a re-timing: at least this, and at least the contended step's time.
    pub min_wait: Duration,
}

impl Default for RetimePolicy {
    fn default() -> Self {
        Self {
            per_sample: 2,
            in_a_row: 3,
            min_wait: Duration::from_millis(250),
        }
    }
}

impl RetimePolicy {
    /// No re-timing (tests that only need memory).
    pub fn never() -> Self {
        Self {
            per_sample: 0,
            ..Self::default()
        }
    }
}

/// Re-times contended samples across the kinds of step of one measurement, counting contended
/// re-timings in a row over all of them.
#[derive(Debug)]
pub struct Retimer {
    policy: RetimePolicy,
    in_a_row: usize,
    /// Re-timings run so far.
    pub retimed: usize,
}

impl Retimer {
    pub fn new(policy: RetimePolicy) -> Self {
        Retimer {
            policy,
            in_a_row: 0,
            retimed: 0,
        }
    }

    /// Re-times each contended sample of `samples` with `run` (after a wait), as the policy
    /// allows. A quiet re-timing replaces the sample; a contended one replaces it only when the
    /// rest of the machine took less CPU during it.
    pub fn retime<T>(&mut self, samples: &mut [Sample<T>], mut run: impl FnMut() -> Result<Sample<T>>) -> Result<()> {
        for s in samples.iter_mut() {
            let mut tries = 0;
            while s.contended() && tries < self.policy.per_sample && self.in_a_row < self.policy.in_a_row {
                std::thread::sleep(self.policy.min_wait.max(Duration::from_secs_f64(s.seconds.max(0.0))));
                let new = run()?;
                tries += 1;
                self.retimed += 1;
                if new.contended() {
                    self.in_a_row += 1;
                    if new.other_cores() < s.other_cores() {
                        *s = new;
                    }
                } else {
                    self.in_a_row = 0;
                    *s = new;
                }
            }
        }
        Ok(())
    }
}

/// The samples an estimate uses: the quiet ones, or all when none is quiet.
pub fn used<T>(samples: &[Sample<T>]) -> Vec<&Sample<T>> {
    let quiet: Vec<&Sample<T>> = samples.iter().filter(|s| !s.contended()).collect();
    if quiet.is_empty() {
        samples.iter().collect()
    } else {
        quiet
    }
}

/// Median, min and max of the seconds of the samples an estimate uses.
pub fn seconds<T>(samples: &[Sample<T>]) -> Stats {
    Stats::of(&used(samples).iter().map(|s| s.seconds).collect::<Vec<_>>())
}

/// Adds the samples an estimate uses to a contention summary; `finish` completes it.
#[derive(Debug, Default)]
pub struct ContentionTally {
    samples: usize,
    contended: usize,
    unchecked: usize,
    other_cores: Vec<f64>,
}

impl ContentionTally {
    pub fn add<T>(&mut self, samples: &[Sample<T>]) {
        for s in used(samples) {
            self.samples += 1;
            self.contended += usize::from(s.contended());
            match s.load {
                Some(l) => {
                    self.other_cores.push(l.other_cores());
                    // Proven neither way: too short to show one busy core, and not contended.
                    self.unchecked += usize::from(!l.judged() && !l.contended());
                }
                None => self.unchecked += 1,
            }
        }
    }

    pub fn finish(self, retimed: usize) -> Contention {
        let other = Stats::of(&self.other_cores);
        Contention {
            samples: self.samples,
            contended: self.contended,
            unchecked: self.unchecked,
            retimed,
            other_cores_median: other.median,
            other_cores_max: other.max,
        }
    }
}

/// `repeats` timed steps of `mask` (at least one), contended ones re-timed as `policy` allows;
/// `each` sees every step's report, re-timings included (peaks, losses, progress). Returns the
/// samples and their contention summary; [`seconds`] gives the estimate.
pub fn timed_steps(
    s: &mut Session,
    mask: &[bool],
    repeats: usize,
    policy: RetimePolicy,
    mut each: impl FnMut(&StepReport),
) -> Result<(Vec<Sample<()>>, Contention)> {
    let mut samples = Vec::new();
    for _ in 0..repeats.max(1) {
        let r = s.step(mask, None)?;
        each(&r);
        samples.push(Sample::of(&r, ()));
    }
    let mut retimer = Retimer::new(policy);
    retimer.retime(&mut samples, || {
        let r = s.step(mask, None)?;
        each(&r);
        Ok(Sample::of(&r, ()))
    })?;
    let mut tally = ContentionTally::default();
    tally.add(&samples);
    Ok((samples, tally.finish(retimer.retimed)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sample whose load reading covered one second (the rule's arithmetic; `seconds` is
    /// what the estimate sees, 0 where the re-timing's wait should be none).
    fn sample(seconds: f64, other_cores: f64) -> Sample<()> {
        Sample {
            seconds,
            load: Some(Load {
                wall_seconds: 1.0,
                other_cpu_seconds: other_cores,
                own_cpu_seconds: 2.0,
                own_system_seconds: 0.0,
                cpus: 2,
                threads: 2,
            }),
            extra: (),
        }
    }

    #[test]
    fn estimates_use_the_quiet_samples_or_all_when_none_is_quiet() {
        let mixed = [sample(1.0, 0.0), sample(3.0, 1.0), sample(1.2, 0.05)];
        let s = seconds(&mixed);
        assert_eq!((s.n, s.min, s.max), (2, 1.0, 1.2));
        let busy = [sample(2.0, 1.0), sample(3.0, 1.0), sample(2.5, 0.9)];
        assert_eq!(seconds(&busy).median, 2.5);
        let mut t = ContentionTally::default();
        t.add(&mixed);
        t.add(&busy);
        let c = t.finish(4);
        assert_eq!((c.samples, c.contended, c.unchecked, c.retimed), (5, 3, 0, 4));
        assert_eq!(c.other_cores_max, 1.0);
        assert!(c.contended());
    }

    #[test]
    fn a_quiet_retiming_replaces_a_contended_sample_and_steady_load_stops_retiming() {
        let policy = RetimePolicy {
            per_sample: 2,
            in_a_row: 3,
            min_wait: Duration::ZERO,
        };
        // The first re-timing is quiet.
        let mut samples = vec![sample(0.0, 0.0), sample(0.0, 1.0)];
        let mut r = Retimer::new(policy);
        r.retime(&mut samples, || Ok(sample(0.0, 0.1))).unwrap();
        assert_eq!(r.retimed, 1);
        assert!(samples.iter().all(|s| !s.contended()));
        // Steady load: three contended re-timings in a row, then no more, though two samples
        // were allowed two each; the least contended reading is kept.
        let mut samples = vec![sample(0.0, 1.5), sample(0.0, 1.5)];
        let mut r = Retimer::new(policy);
        let mut other = 1.4;
        r.retime(&mut samples, || {
            other -= 0.1;
            Ok(sample(0.0, other))
        })
        .unwrap();
        assert_eq!(r.retimed, 3);
        assert!((samples[0].other_cores() - 1.2).abs() < 1e-9);
        assert!((samples[1].other_cores() - 1.1).abs() < 1e-9);
    }
}
