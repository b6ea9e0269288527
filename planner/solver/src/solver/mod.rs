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
mod milp;
mod pool;
mod presolve;

use crate::budget::format_size;
use crate::chain_model::{peak_of, Moment, UNDECIDED};
use enumerate::enumerate;
use milp::{milp_exact, min_peak_milp};
use presolve::{presolve, Goal};

/// Largest magnitude, in bytes, of any moment or budget. Below 2^53 every byte count and
/// every partial sum is an exact `f64`, so the MILP sees the data without rounding, and
/// `i64` sums cannot overflow. 2^53 B = 8 PiB.
pub const MAX_BYTES: i64 = 1 << 53;

/// Most free variables the exact enumeration fallback accepts (2^20 points).
pub const MAX_ENUMERATE: usize = 20;

/// One configuration (precision × optimizer × micro-batch …) to plan for.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigProblem {
    /// Opaque label naming the configuration, used in results and messages.
    pub key: String,
    /// Every moment of the step; the peak is their maximum.
    pub moments: Vec<Moment>,
    /// Step time with nothing checkpointed.
    pub seconds_base: f64,
    /// Per block: seconds added when it is checkpointed.
    pub seconds_coef: Vec<f64>,
    /// Per block: whether it may be checkpointed at all.
    pub candidate: Vec<bool>,
    /// Groups of blocks of which at most one may be checkpointed (nested candidates).
    pub exclusive: Vec<Vec<usize>>,
}

/// Whether a configuration fits the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SolveStatus {
    /// `x` is the fastest choice whose peak fits the budget.
    Optimal,
    /// Nothing fits; `x` is the choice with the smallest peak (fastest among those).
    Infeasible,
}

/// How a solution was obtained, for reports and benchmarks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SolveStats {
    /// Blocks left for the search after presolve fixed the others.
    pub free_vars: usize,
    /// Moments left as constraints after presolve dropped those that cannot bind.
    pub rows: usize,
    /// Runs of the chain dynamic program.
    pub dp_runs: u32,
    /// Times the dynamic program found the moments lacking chain structure and handed
    /// over to the MILP.
    pub dp_gave_up: u32,
    /// MILP solves, counting re-solves after exact-check rejections.
    pub milp_solves: u32,
    /// Cover cuts added after exact `i64` arithmetic rejected a point the MILP accepted.
    pub cover_cuts: u32,
    /// The MILP failure that sent a search to exact enumeration, if one did.
    pub enumerated: Option<String>,
}

/// The answer for one configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigSolution {
    pub key: String,
    pub status: SolveStatus,
    /// Per block: checkpointed or not.
    pub x: Vec<bool>,
    /// Exact peak bytes under `x` (maximum over all moments).
    pub peak: i64,
    /// Label of the first moment that attains `peak`.
    pub binding: String,
    /// Predicted step time under `x`.
    pub seconds: f64,
    pub stats: SolveStats,
}

/// The answer for a set of configurations under one budget.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub budget: i64,
    /// Index into `configs` of the fastest feasible configuration.
    pub best: usize,
    /// One solution per input configuration, in input order; infeasible ones carry their
    /// smallest-peak choice so alternatives can be shown.
    pub configs: Vec<ConfigSolution>,
}

impl Plan {
    /// The chosen configuration's solution.
    pub fn chosen(&self) -> &ConfigSolution {
        &self.configs[self.best]
    }
}

/// Which engine searches the reduced problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Engine {
    /// The chain dynamic program where the moments have chain structure (every profile
    /// from the chain memory model does), otherwise the MILP.
    #[default]
    Auto,
    /// Only the exact dynamic program over blocks in order (see `solver/dp.rs`); fails
    /// with [`SolveError::NoChainStructure`] when its state would be too large.
    Dp,
    /// good_lp MILP (the general path), falling back to enumeration on numerical
    /// trouble when at most [`MAX_ENUMERATE`] blocks are free.
    Milp,
    /// Exact enumeration of every subset of free blocks (at most [`MAX_ENUMERATE`]).
    Enumerate,
}

/// The MILP backend behind [`Engine::Milp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// microlp, pure Rust; always available.
    #[default]
    Microlp,
    /// HiGHS (feature `highs`).
    #[cfg(feature = "highs")]
    Highs,
}

/// Knobs of a solve; the defaults are what the planner uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SolveOptions {
    pub engine: Engine,
    pub backend: Backend,
}

#[derive(Debug, thiserror::Error)]
pub enum SolveError {
    #[error("solving config {key:?}: {reason}")]
    InvalidProblem { key: String, reason: String },
    #[error("solving with budget {budget} B: a budget must lie between 0 and 2^53 bytes")]
    InvalidBudget { budget: i64 },
    #[error("solving a plan: no configurations were given")]
    NoConfigs,
    #[error(
        "budget {} is below the smallest achievable peak {} for {key} (binding moment: {binding})",
        show_bytes(*.budget),
        show_bytes(*.min_peak)
    )]
    Infeasible {
        budget: i64,
        min_peak: i64,
        key: String,
        binding: String,
        /// The choice that attains `min_peak`.
        x: Vec<bool>,
    },
    #[error("solving config {key:?}: {operation} with {free} free blocks failed: {detail}")]
    Numerical {
        key: String,
        operation: &'static str,
        free: usize,
        detail: String,
    },
    #[error("solving config {key:?} by enumeration: {free} free blocks exceed the limit of {MAX_ENUMERATE}")]
    TooLargeToEnumerate { key: String, free: usize },
    #[error("solving config {key:?} by the chain dynamic program: the moments lack chain structure: {detail}")]
    NoChainStructure { key: String, detail: String },
}

/// `12.00 GiB (12884901888 B)`: readable, and exact for comparisons by hand.
fn show_bytes(b: i64) -> String {
    if b < 0 {
        format!("-{} ({b} B)", format_size(b.unsigned_abs()))
    } else {
        format!("{} ({b} B)", format_size(b as u64))
    }
}

// ---------------------------------------------------------------------------------------
// Public entry points

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

// ---------------------------------------------------------------------------------------
// Validation

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
    Ok(())
}

fn check_budget(budget: i64) -> Result<(), SolveError> {
    if (0..=MAX_BYTES).contains(&budget) {
        Ok(())
    } else {
        Err(SolveError::InvalidBudget { budget })
    }
}

fn finish(p: &ConfigProblem, x: Vec<bool>, status: SolveStatus, stats: SolveStats) -> ConfigSolution {
    let (peak, k) = peak_of(&p.moments, &x).expect("validated: moments is non-empty");
    let seconds = seconds_of(p, &x);
    ConfigSolution {
        key: p.key.clone(),
        status,
        peak,
        binding: p.moments[k].label.clone(),
        seconds,
        x,
        stats,
    }
}

fn seconds_of(p: &ConfigProblem, x: &[bool]) -> f64 {
    p.seconds_base
        + p.seconds_coef
            .iter()
            .zip(x)
            .filter(|(_, &on)| on)
            .map(|(t, _)| t)
            .sum::<f64>()
}

/// Exact check that `x` is allowed (candidates, exclusive groups) and fits `limit`.
fn fits(p: &ConfigProblem, x: &[bool], limit: i64) -> bool {
    x.iter().zip(&p.candidate).all(|(&on, &c)| !on || c)
        && p.exclusive
            .iter()
            .all(|g| dedup(g).iter().filter(|&&i| x[i]).count() <= 1)
        && p.moments.iter().all(|m| m.eval(x) <= limit)
}

fn dedup(g: &[usize]) -> Vec<usize> {
    let mut g = g.to_vec();
    g.sort_unstable();
    g.dedup();
    g
}

// ---------------------------------------------------------------------------------------
// Search

/// Presolve and search for `goal`; `Some(x)` (full length) or `None` if nothing fits.
fn search(
    p: &ConfigProblem,
    goal: Goal,
    limit: i64,
    warm: Option<&[bool]>,
    opts: SolveOptions,
    stats: &mut SolveStats,
) -> Result<Option<Vec<bool>>, SolveError> {
    let Some(red) = presolve(p, goal, limit) else {
        return Ok(None);
    };
    stats.free_vars = stats.free_vars.max(red.free.len());
    stats.rows = stats.rows.max(red.rows.len());
    let y = if red.free.is_empty() {
        // Nothing left to decide; presolve dropped every row (max ≤ limit) or failed.
        (goal == Goal::Peak || red.fits(&[], limit)).then(Vec::new)
    } else {
        let warm_y: Option<Vec<bool>> = warm.map(|x| red.free.iter().map(|&i| x[i]).collect());
        let dp_first = matches!(opts.engine, Engine::Auto | Engine::Dp) && goal != Goal::Peak;
        let mut dp_result = None;
        if dp_first {
            stats.dp_runs += 1;
            let t: Vec<f64> = red.free.iter().map(|&i| p.seconds_coef[i]).collect();
            match dp::solve(&red, &t, limit, goal == Goal::Time) {
                dp::Outcome::Found(y) => dp_result = Some(Some(y)),
                dp::Outcome::Infeasible => dp_result = Some(None),
                dp::Outcome::TooLarge(detail) => {
                    if opts.engine == Engine::Dp {
                        return Err(SolveError::NoChainStructure {
                            key: p.key.clone(),
                            detail,
                        });
                    }
                    stats.dp_gave_up += 1;
                }
            }
        }
        match (dp_result, opts.engine) {
            (Some(y), _) => y,
            (None, Engine::Enumerate) => {
                if red.free.len() > MAX_ENUMERATE {
                    return Err(SolveError::TooLargeToEnumerate {
                        key: p.key.clone(),
                        free: red.free.len(),
                    });
                }
                enumerate(p, &red, goal, limit)
            }
            (None, _) => match milp_exact(p, &red, goal, limit, warm_y.as_deref(), opts, stats) {
                Ok(y) => y,
                Err(detail) if red.free.len() <= MAX_ENUMERATE => {
                    // Numerical trouble; enumeration is exact and small enough here.
                    stats.enumerated = Some(detail);
                    enumerate(p, &red, goal, limit)
                }
                Err(detail) => {
                    return Err(SolveError::Numerical {
                        key: p.key.clone(),
                        operation: goal.operation(),
                        free: red.free.len(),
                        detail: format!("the MILP solver reported: {detail} (too many blocks to enumerate instead)"),
                    })
                }
            },
        }
    };
    let x = y.map(|y| red.expand(&y));
    // The exact check that makes every returned plan trustworthy, whatever the engine.
    if let Some(x) = &x {
        if goal != Goal::Peak && !fits(p, x, limit) {
            return Err(SolveError::Numerical {
                key: p.key.clone(),
                operation: goal.operation(),
                free: red.free.len(),
                detail: "a returned choice failed the exact check".to_string(),
            });
        }
    }
    Ok(x)
}

impl Goal {
    fn operation(self) -> &'static str {
        match self {
            Goal::Time => "time minimization",
            Goal::Feasible => "the minimal-peak proof",
            Goal::Peak => "peak minimization",
        }
    }
}

fn min_peak_inner(p: &ConfigProblem, opts: SolveOptions, mut stats: SolveStats) -> Result<ConfigSolution, SolveError> {
    if opts.engine == Engine::Milp {
        return min_peak_milp(p, opts, stats);
    }
    // Bisection on the limit with exact feasibility searches: the smallest feasible limit
    // is the minimal peak. Bounds: no choice has a peak below presolve's lower bound, and
    // nothing checkpointed is one choice.
    let mut lo = presolve(p, Goal::Peak, 0)
        .expect("peak presolve never fails")
        .peak_lower;
    let mut x = vec![false; p.candidate.len()];
    let mut hi = peak_of(&p.moments, &x).expect("validated").0;
    // Invariant: `x` fits `hi`; no choice fits `lo − 1`.
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let gave_up = stats.dp_gave_up;
        let found = search(p, Goal::Feasible, mid, None, opts, &mut stats)?;
        if stats.dp_gave_up > gave_up && opts.engine == Engine::Auto {
            // No chain structure: three MILP solves beat a bisection of MILP solves.
            return min_peak_milp(
                p,
                SolveOptions {
                    engine: Engine::Milp,
                    ..opts
                },
                stats,
            );
        }
        match found {
            Some(y) => {
                hi = peak_of(&p.moments, &y).expect("validated").0;
                x = y;
            }
            None => lo = mid + 1,
        }
    }
    let fastest = search(p, Goal::Time, hi, Some(&x), opts, &mut stats)?.ok_or_else(|| SolveError::Numerical {
        key: p.key.clone(),
        operation: Goal::Time.operation(),
        free: p.candidate.len(),
        detail: format!("no choice found within the minimal peak {hi} B"),
    })?;
    Ok(finish(p, fastest, SolveStatus::Optimal, stats))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain_model::Occurs;

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
