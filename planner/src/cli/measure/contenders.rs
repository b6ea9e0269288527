//! Timing only the configs that can win, and each only as far as the plan needs. Under
//! `--measure auto`, memory comes from the meta device and times from real steps (BERT-large at
//! 512 tokens: 15-30 s a step here). A config's memory alone says whether it can fit the budget,
//! and the cost model says roughly how fast it can be, so `plan` estimates every config first,
//! then times for real the ones that fit, fastest estimate first, and stops timing once the next
//! estimate is more than [`MARGIN`] times the fastest step measured so far and than the cost
//! model's own estimate of that step: where the model's steps run below measured ones, such a
//! config's real step is slower still and cannot win; where they run above (ResNet-50 at two
//! threads on an AMD EPYC: 40-47% high in results/cost/amd-epyc/), the estimates compare with
//! each other, not with a measurement. Configs
//! not timed keep their estimated times, labelled as such in the plan's alternatives.
//!
//! A config being timed stops early where its own steps settle the plan (`staged`): after its
//! first step, when that step less its recompute is already no faster than the fastest measured
//! step ([`ruled_out`]), and after its steps with nothing checkpointed, when its fastest choice
//! checkpoints nothing ([`needs_checkpointed`]).

use anyhow::Result;
use ckptune_solver::formats::ProfileJson;

/// The plan's solve: per config of a profile, the step time of its fastest choice within the
/// budget, or `None` where no choice fits.
pub type Rank<'a> = &'a dyn Fn(&ProfileJson) -> Result<Vec<Option<f64>>>;

/// How far above the fastest measured step, and above the cost model's estimate of that step,
/// a config's estimate must be for it not to be timed: a margin for an estimate that errs more
/// on one config than on another.
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
    /// The fastest measured step, and the most an untimed config's estimate may be for it to
    /// be timed: [`MARGIN`] times that step or the cost model's estimate of it, whichever is
    /// higher.
    fn pace(&self) -> Option<(f64, f64)> {
        let (c, f) = (0..self.ranks.len())
            .filter(|&c| self.states[c] == State::Timed)
            .filter_map(|c| Some((c, self.ranks[c]?)))
            .min_by(|a, b| a.1.total_cmp(&b.1))?;
        Some((f, MARGIN * self.estimates[c].map_or(f, |e| e.max(f))))
    }

    fn fastest(&self) -> Option<f64> {
        self.pace().map(|(f, _)| f)
    }

    /// The timing policy: the next config to time is the untimed one that fits with the
    /// fastest estimate, unless that estimate is over the pace's bar.
    fn next_to_time(&self) -> Option<usize> {
        let bar = self.pace().map(|(_, bar)| bar);
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
/// fit, those whose estimate is too slow to win, and those their first step ruled out.
pub(super) fn untimed_notes(labels: &[String], t: &Timing) -> Vec<String> {
    let (ranks, states) = (&t.ranks, &t.states);
    let mut notes = Vec::new();
    let untimed = |c: usize| states[c] == State::Untimed;
    let unfit: Vec<&str> = (0..ranks.len())
        .filter(|&c| ranks[c].is_none() && untimed(c))
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
        .filter(|&c| untimed(c))
        .filter_map(|c| Some(format!("{} (estimated {:.3} s)", labels[c], ranks[c]?)))
        .collect();
    if let (false, Some((f, bar))) = (slow.is_empty(), t.pace()) {
        notes.push(format!(
            "not timed for real, as the cost model puts them over {bar:.3} s, {MARGIN}x the fastest measured \
             step ({f:.3} s) or the model's own estimate of it, whichever is higher: {}; --measure meta times \
             every config",
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
             fastest measured step{}: {} (their times are the cost model's estimates); --measure meta times \
             every config",
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
        let ranks = std::cell::RefCell::new(estimates.to_vec());
        let mut order = Vec::new();
        let _ = time_until_none_can_win(
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
        order
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
        // 10 s estimated, 12 s measured: 14.9 s may still win (under 1.25 x 12 = 15), 15.1 s cannot.
        let order = run(
            &[Some(15.1), Some(10.0), Some(14.9)],
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
    fn a_slower_measurement_lets_the_next_estimates_be_timed() {
        // The first config's real step is twice its estimate, so both others may still win
        // (under 1.25 x 2 = 2.5 s); with a step of 1 s measured they could not.
        assert_eq!(
            run(&[Some(1.0), Some(2.0), Some(2.4)], &[Some(2.0), Some(2.2), Some(3.0)]),
            vec![0, 1, 2]
        );
        assert_eq!(
            run(&[Some(1.0), Some(2.0), Some(2.4)], &[Some(1.0), Some(2.2), Some(3.0)]),
            vec![0]
        );
    }

    #[test]
    fn a_timed_config_that_no_longer_fits_hands_on_to_the_next() {
        // Learned scratch can lift a config's peak over the budget once it is timed.
        assert_eq!(run(&[Some(1.0), Some(3.0)], &[None, Some(3.5)]), vec![0, 1]);
    }

    #[test]
    fn a_config_ruled_out_by_its_first_step_is_not_timed_again_and_sets_no_pace() {
        // Config 0 measures 10 s; config 1's first step implies 12 s; config 2 (estimate 12 s,
        // within 1.25 x 10) is timed next, against config 0's 10 s, not config 1's.
        let ranks = std::cell::RefCell::new(vec![Some(8.0), Some(9.0), Some(12.0)]);
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
        let notes = untimed_notes(&labels, &t);
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].contains("b (at least 12.000 s)") && notes[0].contains("(10.000 s)"),
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
