//! Exact choice of checkpointed blocks (and of the configuration) that minimizes step
//! time while every moment of the step stays within a memory budget.
//!
//! Input is plain data ([`ConfigProblem`]: affine moments, times, candidates), output a
//! plain answer; no I/O, no libtorch. Pipeline per configuration:
//!
//! 1. *Presolve* fixes blocks by dominance and drops moments that can never bind.
//! 2. *Search* by one of three exact engines ([`Engine`]):
//!    - the chain dynamic program ([`dp`]), used whenever the moments have the
//!      prefix structure the chain memory model gives them (docs/memory-model.md); it is what makes 300 blocks × 12
//!      configurations take milliseconds;
//!    - a 0/1 MILP through good_lp (microlp by default, HiGHS with feature `highs`), the
//!      general path for any moment list;
//!    - enumeration, for at most [`MAX_ENUMERATE`] free blocks, as the MILP's fallback on
//!      numerical trouble.
//! 3. *Exact check*: every returned choice is re-evaluated in `i64` against every moment.
//!
//! Why not the MILP alone: microlp has no cutting planes, and chains of identical blocks
//! (every layer of BERT, every bottleneck of a ResNet stage, identical to the byte in a
//! real profile) leave thousands of near-equal-time choices to refute; on the synthetic
//! BERT-like chain it needed 72 s to prove optimality at 24 blocks. The DP's state there
//! is a handful of partial sums.

mod dp;
mod enumerate;
mod error;
mod milp;
mod min_peak;
mod options;
mod pool;
mod presolve;
mod search;
mod solution;
mod tie;

pub use error::SolveError;
pub use options::{Backend, Engine, SolveOptions, MAX_ENUMERATE};
pub use solution::{ConfigSolution, Plan, SolveStats, SolveStatus};

use crate::problem::{ConfigProblem, MAX_BYTES, UNDECIDED};
use min_peak::min_peak_inner;
use presolve::Goal;
use search::search;
use solution::finish;

/// Fastest choice of checkpointed blocks for one configuration whose peak fits `budget`.
///
/// Returns `status: Infeasible` (with the smallest-peak choice, as [`min_peak`]) when no
/// choice fits; errors are reserved for invalid input and solver failure.
///
/// Exactness: presolve only fixes blocks by dominance and drops moments that cannot
/// exceed the budget, so it preserves the optimum. The DP and enumeration compare bytes in
/// `i64`. The MILP sees byte counts exactly (below 2^53, see [`MAX_BYTES`], scaled by
/// powers of two) with half a byte of slack on each row; every point it returns is
/// re-checked in `i64` and, if it fails, cut off with a cover cut that removes only
/// infeasible points, then re-solved. A point that passes is optimal over a superset of
/// the exact feasible set. Time is optimal to within the engines' float tolerance
/// (relative 1e-9 for microlp's pruning; sums of `f64` elsewhere).
pub fn solve_config(p: &ConfigProblem, budget: i64) -> Result<ConfigSolution, SolveError> {
    solve_config_with(p, budget, SolveOptions::default())
}

/// [`solve_config`] with explicit options.
pub fn solve_config_with(p: &ConfigProblem, budget: i64, opts: SolveOptions) -> Result<ConfigSolution, SolveError> {
    validate(p)?;
    check_budget(budget)?;
    // Nested groups carry a covering moment of `UNDECIDED` bytes that must stay above the
    // limit; no real step comes near half of it (32 TiB), so larger budgets are capped there.
    let budget = budget.min(UNDECIDED / 2);
    let mut stats = SolveStats::default();
    match search(p, Goal::Time, budget, None, opts, &mut stats)? {
        Some(x) => Ok(finish(p, x, SolveStatus::Optimal, stats)),
        None => {
            let mut s = min_peak_inner(p, opts, stats)?;
            s.status = SolveStatus::Infeasible;
            Ok(s)
        }
    }
}

/// Smallest achievable peak for one configuration, and the fastest choice attaining it.
///
/// Two exact stages rather than one weighted objective (a tie-breaking epsilon is not
/// exact): find the minimal peak `P` — proven by `P − 1` bytes being infeasible — then
/// minimize time subject to every moment ≤ `P`. With the DP, `P` comes from bisecting the
/// limit with feasibility searches (about 40 cheap runs); with the MILP, from minimizing
/// an auxiliary `P ≥ every moment`, then lowering it by feasibility solves until `P − 1`
/// is infeasible, since the MILP's relative optimality tolerance is coarser than a byte.
pub fn min_peak(p: &ConfigProblem) -> Result<ConfigSolution, SolveError> {
    min_peak_with(p, SolveOptions::default())
}

/// [`min_peak`] with explicit options.
pub fn min_peak_with(p: &ConfigProblem, opts: SolveOptions) -> Result<ConfigSolution, SolveError> {
    validate(p)?;
    min_peak_inner(p, opts, SolveStats::default())
}

/// Solve every configuration and pick the fastest that fits `budget`.
///
/// One search per configuration is an exact decomposition of the joint MILP: the
/// configuration choice is a single one-of-k binary whose options share no variables or
/// constraints, so the joint optimum is the best of the per-configuration optima.
/// Configurations are solved on all available cores; results do not depend on that.
pub fn solve(problems: &[ConfigProblem], budget: i64) -> Result<Plan, SolveError> {
    solve_with(problems, budget, SolveOptions::default())
}

/// [`solve`] with explicit options.
pub fn solve_with(problems: &[ConfigProblem], budget: i64, opts: SolveOptions) -> Result<Plan, SolveError> {
    if problems.is_empty() {
        return Err(SolveError::NoConfigs);
    }
    check_budget(budget)?;
    let configs = pool::parallel_map(problems, |p| solve_config_with(p, budget, opts))?;
    // Fastest first; a smaller peak, then input order, breaks ties deterministically.
    let best = configs
        .iter()
        .enumerate()
        .filter(|(_, s)| s.status == SolveStatus::Optimal)
        .min_by(|(ia, a), (ib, b)| {
            a.seconds
                .total_cmp(&b.seconds)
                .then(a.peak.cmp(&b.peak))
                .then(ia.cmp(ib))
        })
        .map(|(i, _)| i);
    match best {
        Some(best) => Ok(Plan { budget, best, configs }),
        None => {
            // Every solution is a min-peak one here; report the lowest.
            let low = configs
                .iter()
                .min_by(|a, b| a.peak.cmp(&b.peak).then(a.seconds.total_cmp(&b.seconds)))
                .expect("problems is non-empty");
            Err(SolveError::Infeasible {
                budget,
                min_peak: low.peak,
                key: low.key.clone(),
                binding: low.binding.clone(),
                x: low.x.clone(),
            })
        }
    }
}

fn validate(p: &ConfigProblem) -> Result<(), SolveError> {
    let bad = |reason: String| SolveError::InvalidProblem {
        key: p.key.clone(),
        reason,
    };
    let n = p.candidate.len();
    if p.seconds_coef.len() != n {
        return Err(bad(format!(
            "{} time coefficients for {n} blocks",
            p.seconds_coef.len()
        )));
    }
    if !p.seconds_base.is_finite() {
        return Err(bad(format!("base step time {} is not finite", p.seconds_base)));
    }
    if let Some((i, t)) = p.seconds_coef.iter().enumerate().find(|(_, t)| !t.is_finite()) {
        return Err(bad(format!("time coefficient {t} of block {i} is not finite")));
    }
    if p.moments.is_empty() {
        return Err(bad("there are no moments to bound".to_string()));
    }
    for m in &p.moments {
        if m.coef.len() != n {
            return Err(bad(format!(
                "moment {:?} has {} coefficients for {n} blocks",
                m.label,
                m.coef.len()
            )));
        }
        let size = m
            .coef
            .iter()
            .fold(m.constant.unsigned_abs() as u128, |a, c| a + c.unsigned_abs() as u128);
        if size > MAX_BYTES as u128 {
            return Err(bad(format!(
                "moment {:?} reaches {size} bytes, beyond the exact range of 2^53",
                m.label
            )));
        }
    }
    for g in &p.exclusive {
        if let Some(&i) = g.iter().find(|&&i| i >= n) {
            return Err(bad(format!(
                "exclusive group {g:?} names block {i}, but there are {n} blocks"
            )));
        }
    }
    for c in &p.tied {
        if let Some(&i) = c.iter().find(|&&i| i >= n) {
            return Err(bad(format!(
                "tied class {c:?} names block {i}, but there are {n} blocks"
            )));
        }
    }
    Ok(())
}

fn check_budget(budget: i64) -> Result<(), SolveError> {
    if (0..=MAX_BYTES).contains(&budget) {
        Ok(())
    } else {
        Err(SolveError::InvalidBudget { budget })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Moment, Occurs};

    fn tiny() -> ConfigProblem {
        // Two blocks, peak = 100 − 30·x0 − 20·x1 (loss) and 60 + 25·x0 (recompute 0).
        ConfigProblem {
            key: "tiny".into(),
            moments: vec![
                Moment {
                    label: "loss".into(),
                    constant: 100,
                    coef: vec![-30, -20],
                    occurs: Occurs::Always,
                },
                Moment {
                    label: "recompute a".into(),
                    constant: 60,
                    coef: vec![25, 0],
                    occurs: Occurs::When(vec![(0, true)]),
                },
            ],
            seconds_base: 1.0,
            seconds_coef: vec![0.5, 0.25],
            candidate: vec![true, true],
            exclusive: vec![],
            tied: vec![],
        }
    }

    #[test]
    fn tiny_budgets() {
        let p = tiny();
        let s = solve_config(&p, 100).unwrap();
        assert_eq!(
            (s.x.clone(), s.peak, s.status),
            (vec![false, false], 100, SolveStatus::Optimal)
        );
        let s = solve_config(&p, 80).unwrap();
        assert_eq!((s.x.clone(), s.peak), (vec![false, true], 80));
        let s = solve_config(&p, 85).unwrap();
        assert_eq!(
            (s.x.clone(), s.peak),
            (vec![false, true], 80),
            "cheaper than (1, 0) at 85"
        );
        // Nothing fits 79: (1,1) peaks at max(50, 85), (1,0) at max(70, 85), (0,1) at 80.
        let s = solve_config(&p, 79).unwrap();
        assert_eq!(s.status, SolveStatus::Infeasible);
        assert_eq!(
            (s.x.clone(), s.peak, s.binding.as_str()),
            (vec![false, true], 80, "loss")
        );
        let m = min_peak(&p).unwrap();
        assert_eq!(m.peak, 80);
    }

    #[test]
    fn plan_reports_smallest_peak_when_nothing_fits() {
        let mut q = tiny();
        q.key = "other".into();
        q.moments[0].constant = 120;
        let err = solve(&[tiny(), q], 10).unwrap_err();
        match err {
            SolveError::Infeasible { min_peak, key, x, .. } => {
                assert_eq!((min_peak, key.as_str(), x), (80, "tiny", vec![false, true]));
            }
            e => panic!("unexpected {e}"),
        }
    }

    #[test]
    fn invalid_input_is_an_error() {
        let mut p = tiny();
        p.moments[1].coef.pop();
        let e = solve_config(&p, 100).unwrap_err().to_string();
        assert!(e.contains("\"recompute a\" has 1 coefficients for 2 blocks"), "{e}");
        let e = solve_config(&tiny(), -1).unwrap_err().to_string();
        assert!(e.contains("budget -1 B"), "{e}");
        let mut p = tiny();
        p.exclusive = vec![vec![0, 7]];
        assert!(solve_config(&p, 100).is_err());
        let mut p = tiny();
        p.moments[0].constant = MAX_BYTES;
        assert!(solve_config(&p, 100).is_err());
    }
}
