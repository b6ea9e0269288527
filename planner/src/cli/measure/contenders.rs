//! Timing only the configs that can win, and each only as far as the plan needs. Under
//! `--measure auto`, memory comes from the meta device and times from real steps (BERT-large at
//! 512 tokens: 15-30 s a step here). A config's memory alone says whether it can fit the budget,
//! and the cost model says roughly how fast it can be, so `plan` estimates every config first,
//! then times for real the ones that fit, fastest estimate first, and stops timing once the next
//! estimate is more than [`MARGIN`] times the cost model's estimate of the fastest config
//! measured so far. Estimates are compared with estimates, not with a measurement: the
//! machine's pace when the steps run (a shared host ran BERT-large's steps at 15 s one hour and
//! 30 s the next, on one calibration) and the model's error on the model at hand (ResNet-50 at
//! two threads on an AMD EPYC: 40-47% high in results/cost/amd-epyc/) move every config's
//! real step alike, so the margin is left for what does differ: how differently the model errs
//! on two configs (bf16 over fp32, estimated against measured: -3% to -16% in results/cost/).
//! Configs not timed keep their estimated times, labelled as such and brought to that pace
//! ([`Timing::paces`]): scaled by the fastest timed config's measured step over its estimate, so
//! that none of them can undercut a measured step by an error the machine made.
//!
//! A config being timed stops early where its own steps settle the plan (`staged`): after its
//! first step, when that step less its recompute is already no faster than the fastest measured
//! step ([`ruled_out`]; its estimated times are then scaled to that step), and after its steps
//! with nothing checkpointed, when its fastest choice checkpoints nothing ([`needs_checkpointed`]).

use anyhow::Result;
use ckptune_solver::formats::ProfileJson;

/// The plan's solve: per config of a profile, the step time of its fastest choice within the
/// budget, or `None` where no choice fits.
pub type Rank<'a> = &'a dyn Fn(&ProfileJson) -> Result<Vec<Option<f64>>>;

/// How far above the cost model's estimate of the fastest measured config another config's
/// estimate must be for it not to be timed: a margin for an estimate that errs more on one
/// config than on another.
pub const MARGIN: f64 = 1.25;

/// Where a config stands in `plan`'s timing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum State {
    /// Its times are the cost model's.
    Untimed,
    /// Timed for real, as far as the plan needs (`staged`).
    Timed,
    /// Its first real step implied a step with nothing checkpointed of this many seconds, no
    /// faster than the fastest measured then: it cannot win, and keeps its estimated times.
    RuledOut(f64),
}

/// Where [`time_until_none_can_win`] ends: per config, its last rank (its fastest step within
/// the budget, `None` where it cannot fit; measured where timed, else estimated), where it
/// stands, and its last estimated rank (before it was timed, for a timed one).
pub(super) struct Timing {
    pub ranks: Vec<Option<f64>>,
    pub states: Vec<State>,
    pub estimates: Vec<Option<f64>>,
}

impl Timing {
    /// The fastest timed config, its measured step, and the most an untimed config's estimate
    /// may be for it to be timed: [`MARGIN`] times the cost model's estimate of that config's
    /// step (its measured step where it had none).
    fn pace(&self) -> Option<(usize, f64, f64)> {
        let (c, f) = (0..self.ranks.len())
            .filter(|&c| self.states[c] == State::Timed)
            .filter_map(|c| Some((c, self.ranks[c]?)))
            .min_by(|a, b| a.1.total_cmp(&b.1))?;
        Some((c, f, MARGIN * self.estimates[c].unwrap_or(f)))
    }

    fn fastest(&self) -> Option<f64> {
        self.pace().map(|(_, f, _)| f)
    }

    /// Per config whose times stay the cost model's, the factor that brings them to the pace
    /// of this machine's real steps, and why (for the profile's label; `labels` name the
    /// configs): an untimed config's is the fastest timed config's measured step over its
    /// estimate, a ruled-out config's its own first step's implied step with nothing
    /// checkpointed over its estimate of that step (`estimated_plain`). `None` for a timed
    /// config, and for every config where none was timed.
    pub(super) fn paces(&self, estimated_plain: &[f64], labels: &[String]) -> Vec<Option<(f64, String)>> {
        let timed = self.pace().and_then(|(c, f, _)| {
            let e = self.estimates[c].filter(|&e| e > 0.0)?;
            Some((
                f / e,
                format!(
                    "{}'s measured step took {:.2}x its estimate ({f:.3} s against {e:.3} s)",
                    labels[c],
                    f / e
                ),
            ))
        });
        (0..self.states.len())
            .map(|c| match self.states[c] {
                State::Timed => None,
                State::Untimed => timed.clone(),
                State::RuledOut(plain) => (estimated_plain[c] > 0.0).then(|| {
                    let factor = plain / estimated_plain[c];
                    let why = format!(
                        "its first real step implied {plain:.3} s with nothing checkpointed, {factor:.2}x its \
                         estimate ({:.3} s)",
                        estimated_plain[c]
                    );
                    (factor, why)
                }),
            })
            .collect()
    }

    /// The timing policy: the next config to time is the untimed one that fits with the
    /// fastest estimate, unless that estimate is over the pace's bar.
    fn next_to_time(&self) -> Option<usize> {
        let bar = self.pace().map(|(_, _, bar)| bar);
        (0..self.ranks.len())
            .filter(|&c| self.states[c] == State::Untimed)
            .filter_map(|c| Some((c, self.ranks[c]?)))
            .filter(|&(_, e)| bar.is_none_or(|b| e <= b))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(c, _)| c)
    }
}

/// Times configs one by one, as [`Timing::next_to_time`] says, until no config left untimed can
/// win: `rank()` solves the plan over the profile as it stands (a budget given as a share moves
/// with the fastest config, so it is solved again after each), `time(c, fastest)` times config
/// `c` for real, told the fastest step measured so far.
pub(super) fn time_until_none_can_win(
    configs: usize,
    mut rank: impl FnMut() -> Result<Vec<Option<f64>>>,
    mut time: impl FnMut(usize, Option<f64>) -> Result<State>,
) -> Result<Timing> {
    let mut t = Timing {
        ranks: Vec::new(),
        states: vec![State::Untimed; configs],
        estimates: vec![None; configs],
    };
    loop {
        t.ranks = rank()?;
        for c in (0..configs).filter(|&c| t.states[c] == State::Untimed) {
            t.estimates[c] = t.ranks[c];
        }
        let Some(c) = t.next_to_time() else {
            return Ok(t);
        };
        t.states[c] = time(c, t.fastest())?;
    }
}

/// The step with nothing checkpointed that a config's first real step implies (`first_plain`,
/// where that step could say: `StagedSteps::first_plain_seconds`), when it is no faster than
/// the `fastest` step measured: checkpointing only adds recompute to that step, so the config
/// cannot win.
pub(super) fn ruled_out(first_plain: Option<f64>, fastest: Option<f64>) -> Option<f64> {
    let (plain, fastest) = (first_plain?, fastest?);
    (plain >= fastest).then_some(plain)
}

/// Whether a config whose step with nothing checkpointed measured `plain` seconds needs its
/// steps B timed: its fastest choice within the budget (`rank`, solved with the first step's
/// recompute estimates) checkpoints something, and it is faster than the `fastest` step
/// measured, so it may still win. A config whose plain step fits the budget is settled by its
/// steps A: it checkpoints nothing, and its step is theirs.
pub(super) fn needs_checkpointed(rank: Option<f64>, plain: f64, fastest: Option<f64>) -> bool {
    rank.is_some_and(|r| r > plain) && fastest.is_none_or(|f| plain < f)
}

/// What `plan` says of the configs not timed for real (`labels` name them): those that cannot
/// fit, those whose estimate is too slow to win, and those their first step ruled out. Whether
/// a config fits is `fits`, judged over the profile the plan is solved from (its untimed configs
/// brought to the pace): a budget given as a share follows the fastest config, which an untimed
/// config's estimate, not yet brought to the pace, could be while the configs were timed (tiny-BERT
/// at `--budget 0%`: bf16's estimate under fp32's measured step there, over it once scaled, and
/// bf16's smallest peak over the budget fp32's then sets).
pub(super) fn untimed_notes(labels: &[String], t: &Timing, fits: &[bool]) -> Vec<String> {
    let (ranks, states) = (&t.ranks, &t.states);
    let mut notes = Vec::new();
    let untimed = |c: usize| states[c] == State::Untimed;
    let unfit: Vec<&str> = (0..ranks.len())
        .filter(|&c| !fits[c] && untimed(c))
        .map(|c| labels[c].as_str())
        .collect();
    if !unfit.is_empty() {
        notes.push(format!(
            "not timed for real, as no checkpoint set fits them in the budget: {} (their times are the \
             cost model's estimates)",
            unfit.join(", ")
        ));
    }
    let fastest = t.fastest();
    let slow: Vec<String> = (0..ranks.len())
        .filter(|&c| fits[c] && untimed(c))
        .filter_map(|c| Some(format!("{} (estimated {:.3} s)", labels[c], ranks[c]?)))
        .collect();
    if let (false, Some((f, measured, bar))) = (slow.is_empty(), t.pace()) {
        notes.push(format!(
            "not timed for real, as the cost model puts them over {bar:.3} s, {MARGIN}x its estimate of the \
             fastest measured config, {} (measured {measured:.3} s): {}; their estimated times are scaled by \
             that config's measured step over its estimate; --measure meta times every config",
            labels[f],
            slow.join(", ")
        ));
    }
    let ruled: Vec<String> = (0..ranks.len())
        .filter_map(|c| match states[c] {
            State::RuledOut(plain) => Some(format!("{} (at least {plain:.3} s)", labels[c])),
            _ => None,
        })
        .collect();
    if !ruled.is_empty() {
        notes.push(format!(
            "timed for one step only, as that step, less its recompute, was already no faster than the \
             fastest measured step{}: {} (their times are the cost model's estimates, scaled by that step \
             over its estimate); --measure meta times every config",
            fastest.map_or(String::new(), |f| format!(" ({f:.3} s)")),
            ruled.join(", ")
        ));
    }
    notes
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The configs timed, in order, when timing config `c` turns its rank into `measured[c]`
    /// (the budget held fixed, so the other ranks stay).
    fn run(estimates: &[Option<f64>], measured: &[Option<f64>]) -> Vec<usize> {
        timed(estimates, measured).0
    }

    /// As [`run`], with where the timing ended.
    fn timed(estimates: &[Option<f64>], measured: &[Option<f64>]) -> (Vec<usize>, Timing) {
        let ranks = std::cell::RefCell::new(estimates.to_vec());
        let mut order = Vec::new();
        let t = time_until_none_can_win(
            estimates.len(),
            || Ok(ranks.borrow().clone()),
            |c, _| {
                assert!(!order.contains(&c), "config {c} timed twice");
                ranks.borrow_mut()[c] = measured[c];
                order.push(c);
                Ok(State::Timed)
            },
        )
        .unwrap();
        (order, t)
    }

    #[test]
    fn configs_that_cannot_fit_are_never_timed() {
        assert_eq!(
            run(&[None, Some(2.0), None], &[Some(1.0), Some(2.5), Some(1.0)]),
            vec![1]
        );
    }

    #[test]
    fn a_config_estimated_over_the_margin_is_not_timed() {
        // 10 s estimated, 12 s measured: 12.4 s may still win (under 1.25 x 10 = 12.5), 12.6 s
        // cannot, whatever the 12 s measured.
        let order = run(
            &[Some(12.6), Some(10.0), Some(12.4)],
            &[Some(16.0), Some(12.0), Some(13.0)],
        );
        assert_eq!(order, vec![1, 2]);
    }

    #[test]
    fn where_the_model_errs_high_estimates_compare_with_its_estimate_of_the_fastest() {
        // Config 0: 2.0 s estimated, 1.4 s measured. Config 1's 2.0 s estimate is the model's
        // for config 0 too: it may win, though over 1.25 x 1.4 = 1.75 s; 2.6 s cannot (over
        // 1.25 x 2.0 = 2.5 s).
        assert_eq!(
            run(&[Some(2.0), Some(2.0), Some(2.6)], &[Some(1.4), Some(1.3), Some(1.8)]),
            vec![0, 1]
        );
    }

    #[test]
    fn the_machine_s_pace_moves_no_estimate_over_or_under_the_margin() {
        // Config 0's real step at half, once, and twice its estimate: the others are timed or
        // not by their estimates against its estimate alone.
        for measured in [0.5, 1.0, 2.0] {
            let (order, t) = timed(
                &[Some(1.0), Some(1.2), Some(1.3)],
                &[Some(measured), Some(1.2 * measured), Some(1.3 * measured)],
            );
            assert_eq!(order, vec![0, 1], "config 0 measured {measured} s");
            // The one not timed is scaled to that pace, and says by what.
            let labels: Vec<String> = ["a", "b", "c"].map(String::from).into();
            let paces = t.paces(&[1.0, 1.2, 1.3], &labels);
            assert_eq!(paces[..2], [None, None]);
            let (factor, why) = paces[2].clone().unwrap();
            assert_eq!(factor, measured);
            assert!(why.starts_with("a's measured step took"), "{why}");
        }
    }

    #[test]
    fn no_estimate_left_untimed_undercuts_a_measured_step_once_scaled() {
        // Whatever the machine's pace (the measured step over its estimate, k) and the other
        // configs' estimates, a config left untimed, scaled by k, is over MARGIN times the
        // fastest measured step: the plan never prefers an estimate to a measurement.
        let estimates = [0.9, 1.0, 1.1, 1.24, 1.26, 1.5, 3.0];
        for k in [0.3, 0.8, 1.0, 1.7, 4.0] {
            let est: Vec<Option<f64>> = estimates.iter().map(|&e| Some(e)).collect();
            let measured: Vec<Option<f64>> = estimates.iter().map(|&e| Some(e * k * 1.1)).collect();
            let (_, t) = timed(&est, &measured);
            let fastest = t.fastest().unwrap();
            let labels: Vec<String> = (0..est.len()).map(|c| c.to_string()).collect();
            for (c, pace) in t.paces(&estimates, &labels).into_iter().enumerate() {
                if let Some((factor, _)) = pace {
                    assert!(
                        estimates[c] * factor > MARGIN * fastest,
                        "k {k}: config {c} scaled to {} against {fastest}",
                        estimates[c] * factor
                    );
                }
            }
        }
    }

    #[test]
    fn a_timed_config_that_no_longer_fits_hands_on_to_the_next() {
        // Learned scratch can lift a config's peak over the budget once it is timed.
        assert_eq!(run(&[Some(1.0), Some(3.0)], &[None, Some(3.5)]), vec![0, 1]);
    }

    #[test]
    fn a_config_ruled_out_by_its_first_step_is_not_timed_again_and_sets_no_pace() {
        // Config 0 measures 10 s; config 1's first step implies 12 s; config 2 (estimate 9.5 s,
        // within 1.25 x 8) is timed next, against config 0's 10 s, not config 1's.
        let ranks = std::cell::RefCell::new(vec![Some(8.0), Some(9.0), Some(9.5)]);
        let mut told = Vec::new();
        let t = time_until_none_can_win(
            3,
            || Ok(ranks.borrow().clone()),
            |c, fastest| {
                told.push((c, fastest));
                Ok(match c {
                    1 => State::RuledOut(12.0),
                    _ => {
                        ranks.borrow_mut()[c] = Some(10.0 + c as f64);
                        State::Timed
                    }
                })
            },
        )
        .unwrap();
        assert_eq!(told, vec![(0, None), (1, Some(10.0)), (2, Some(10.0))]);
        assert_eq!(t.states, vec![State::Timed, State::RuledOut(12.0), State::Timed]);
        let labels: Vec<String> = ["a", "b", "c"].map(String::from).into();
        let notes = untimed_notes(&labels, &t, &[true; 3]);
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].contains("b (at least 12.000 s)") && notes[0].contains("(10.000 s)"),
            "{notes:?}"
        );
        // Its estimated times are scaled to its own first step: 12 s with nothing checkpointed
        // against the 6 s estimated.
        let paces = t.paces(&[6.0, 6.0, 6.0], &labels);
        assert_eq!(paces[0], None);
        assert_eq!(paces[2], None);
        let (factor, why) = paces[1].clone().unwrap();
        assert_eq!(factor, 2.0);
        assert!(why.contains("implied 12.000 s"), "{why}");
    }

    #[test]
    fn an_untimed_config_over_the_plans_budget_is_said_not_to_fit_whatever_it_was_ranked() {
        // Config 1 fit the budget a share set while config 0 was timed (its estimate then the
        // fastest), and is over the budget the plan is solved with.
        let t = Timing {
            ranks: vec![Some(10.0), Some(9.0)],
            states: vec![State::Timed, State::Untimed],
            estimates: vec![Some(5.0), Some(9.0)],
        };
        let labels: Vec<String> = ["a", "b"].map(String::from).into();
        let notes = untimed_notes(&labels, &t, &[true, false]);
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].contains("no checkpoint set fits them in the budget: b "),
            "{notes:?}"
        );
        // Where it fits, its estimate is what kept it untimed: over 1.25 x 5 s.
        let notes = untimed_notes(&labels, &t, &[true, true]);
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].contains("over 6.250 s") && notes[0].contains("b (estimated 9.000 s)"),
            "{notes:?}"
        );
    }

    #[test]
    fn a_first_step_rules_out_only_against_a_measured_step_it_does_not_beat() {
        assert_eq!(ruled_out(Some(12.0), Some(10.0)), Some(12.0));
        assert_eq!(ruled_out(Some(10.0), Some(10.0)), Some(10.0));
        assert_eq!(ruled_out(Some(9.9), Some(10.0)), None);
        // The first config has nothing to lose to; a short or busy first step says nothing.
        assert_eq!(ruled_out(Some(12.0), None), None);
        assert_eq!(ruled_out(None, Some(10.0)), None);
    }

    #[test]
    fn steps_b_are_timed_only_where_the_plan_checkpoints_and_may_win() {
        // The plain step fits: the fastest choice is the plain step itself.
        assert!(!needs_checkpointed(Some(10.0), 10.0, None));
        // Checkpointing is needed, and nothing measured is faster.
        assert!(needs_checkpointed(Some(11.0), 10.0, None));
        assert!(needs_checkpointed(Some(11.0), 10.0, Some(10.5)));
        // Its plain step already loses: checkpointing only adds to it.
        assert!(!needs_checkpointed(Some(11.0), 10.0, Some(10.0)));
        // Nothing fits (learned scratch lifted the peak): no choice to time.
        assert!(!needs_checkpointed(None, 10.0, None));
    }
}
