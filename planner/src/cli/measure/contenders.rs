//! Timing only the configs that can win. Under `--measure auto`, memory comes from the meta
//! device and times from real steps, a warm-up and at least two steps of each kind per config
//! (BERT-large at 512 tokens: 15-30 s a step here). A config's memory alone says whether it can
//! fit the budget, and the cost model says roughly how fast it can be, so `plan` estimates
//! every config first, then times for real the ones that fit, fastest estimate first, and stops
//! timing once the next estimate is more than [`MARGIN`] times the fastest step measured so
//! far: the cost model's steps run 6-19% *below* measured ones on this CPU's larger models
//! (results/cost), so such a config's real step is slower still and cannot win. Configs not
//! timed keep their estimated times, labelled as such in the plan's alternatives.

use anyhow::Result;
use ckptune_solver::formats::ProfileJson;

/// The plan's solve: per config of a profile, the step time of its fastest choice within the
/// budget, or `None` where no choice fits.
pub type Rank<'a> = &'a dyn Fn(&ProfileJson) -> Result<Vec<Option<f64>>>;

/// How far above the fastest measured step a config's estimate must be for it not to be timed.
/// The estimates err low, so this only guards against the rarer estimate that errs high.
pub const MARGIN: f64 = 1.25;

/// Times configs one by one, as [`next_to_time`] says, until no config left untimed can win:
/// `rank()` solves the plan over the profile as it stands (a budget given as a share moves with
/// the fastest config, so it is solved again after each), `time(c)` times config `c` for real.
/// Returns the last ranks and which configs were timed.
pub(super) fn time_until_none_can_win(
    configs: usize,
    mut rank: impl FnMut() -> Result<Vec<Option<f64>>>,
    mut time: impl FnMut(usize) -> Result<()>,
) -> Result<(Vec<Option<f64>>, Vec<bool>)> {
    let mut timed = vec![false; configs];
    loop {
        let ranks = rank()?;
        let Some(c) = next_to_time(&ranks, &timed) else {
            return Ok((ranks, timed));
        };
        time(c)?;
        timed[c] = true;
    }
}

/// The timing policy: `ranks[c]` is config `c`'s fastest step within the budget (`None`: it
/// cannot fit), measured where `timed[c]`, else estimated. The next config to time is the
/// untimed one that fits with the fastest estimate, unless that estimate is over [`MARGIN`]
/// times the fastest measured step.
fn next_to_time(ranks: &[Option<f64>], timed: &[bool]) -> Option<usize> {
    let fastest = fastest_timed(ranks, timed);
    (0..ranks.len())
        .filter(|&c| !timed[c])
        .filter_map(|c| Some((c, ranks[c]?)))
        .filter(|&(_, e)| fastest.is_none_or(|f| e <= MARGIN * f))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(c, _)| c)
}

fn fastest_timed(ranks: &[Option<f64>], timed: &[bool]) -> Option<f64> {
    (0..ranks.len())
        .filter(|&c| timed[c])
        .filter_map(|c| ranks[c])
        .min_by(f64::total_cmp)
}

/// What `plan` says of the configs not timed for real (`labels` name them): those that cannot
/// fit, and those whose estimate is too slow to win.
pub(super) fn untimed_notes(labels: &[String], ranks: &[Option<f64>], timed: &[bool]) -> Vec<String> {
    let mut notes = Vec::new();
    let unfit: Vec<&str> = (0..ranks.len())
        .filter(|&c| ranks[c].is_none() && !timed[c])
        .map(|c| labels[c].as_str())
        .collect();
    if !unfit.is_empty() {
        notes.push(format!(
            "not timed for real, as no checkpoint set fits them in the budget: {} (their times are the \
             cost model's estimates)",
            unfit.join(", ")
        ));
    }
    let slow: Vec<String> = (0..ranks.len())
        .filter(|&c| !timed[c])
        .filter_map(|c| Some(format!("{} (estimated {:.3} s)", labels[c], ranks[c]?)))
        .collect();
    if let (false, Some(f)) = (slow.is_empty(), fastest_timed(ranks, timed)) {
        notes.push(format!(
            "not timed for real, as the cost model puts them over {MARGIN}x the fastest measured step \
             ({f:.3} s): {}; --measure meta times every config",
            slow.join(", ")
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
        time_until_none_can_win(
            estimates.len(),
            || Ok(ranks.borrow().clone()),
            |c| {
                assert!(!order.contains(&c), "config {c} timed twice");
                ranks.borrow_mut()[c] = measured[c];
                order.push(c);
                Ok(())
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
}
