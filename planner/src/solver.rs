//! Exact choice of checkpointed blocks (and of the configuration) that minimizes step
//! time while every moment of the step stays within a memory budget.
//!
//! Input is plain data ([`ConfigProblem`]: affine moments, times, candidates), output a
//! plain answer; no I/O, no libtorch. Pipeline per configuration:
//!
//! 1. *Presolve* fixes blocks by dominance and drops moments that can never bind.
//! 2. *Search* by one of three exact engines ([`Engine`]):
//!    - the chain dynamic program (`solver/dp.rs`), used whenever the moments have the
//!      prefix structure DESIGN.md's chain gives them; it is what makes 300 blocks × 12
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

use std::sync::atomic::{AtomicUsize, Ordering};

use good_lp::{
    variable, Expression, ProblemVariables, ResolutionError, Solution, SolverModel, Variable, WithInitialSolution,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod dp;

use crate::budget::format_size;
use crate::chain_model::{config_problem, peak_of, BlockTerms, Moment, StepTerms};

/// Largest magnitude, in bytes, of any moment or budget. Below 2^53 every byte count and
/// every partial sum is an exact `f64`, so the MILP sees the data without rounding, and
/// `i64` sums cannot overflow. 2^53 B = 8 PiB.
pub const MAX_BYTES: i64 = 1 << 53;

/// Most free variables the exact enumeration fallback accepts (2^20 points).
pub const MAX_ENUMERATE: usize = 20;

/// Rounds of cover cuts before a MILP that keeps returning points the exact check rejects
/// is treated as numerical trouble.
const MAX_CUT_ROUNDS: usize = 64;

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
    /// from DESIGN.md's model does), otherwise the MILP.
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
    let configs = parallel_map(problems, |p| solve_config_with(p, budget, opts))?;
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

/// Map `f` over `items` on up to `available_parallelism` threads, keeping input order and
/// returning the first error in input order.
fn parallel_map<T: Sync, R: Send>(
    items: &[T],
    f: impl Fn(&T) -> Result<R, SolveError> + Sync,
) -> Result<Vec<R>, SolveError> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(items.len());
    if threads <= 1 {
        return items.iter().map(f).collect();
    }
    let next = AtomicUsize::new(0);
    let mut slots: Vec<Option<Result<R, SolveError>>> = (0..items.len()).map(|_| None).collect();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = items.get(i) else { break };
                        done.push((i, f(item)));
                    }
                    done
                })
            })
            .collect();
        for w in workers {
            // A panic in a worker is a bug in this module; propagate it unchanged.
            let done = w.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
            for (i, r) in done {
                slots[i] = Some(r);
            }
        }
    });
    slots
        .into_iter()
        .map(|r| r.expect("every index is claimed by exactly one worker"))
        .collect()
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
// Presolve

/// What a search optimizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Goal {
    /// Minimize time subject to every moment ≤ limit.
    Time,
    /// Any point with every moment ≤ limit.
    Feasible,
    /// Minimize the peak (the limit is ignored).
    Peak,
}

/// A moment restricted to the free blocks: `offset + Σ coef·x_free`.
#[derive(Debug, Clone)]
struct Row {
    offset: i64,
    /// (position among free blocks, bytes); zero coefficients are left out.
    coef: Vec<(usize, i64)>,
}

/// The problem after presolve.
#[derive(Debug, Clone)]
struct Reduced {
    /// Original indices of the blocks left to the search.
    free: Vec<usize>,
    /// Full-length choice holding presolve's fixed values (false at free positions).
    base: Vec<bool>,
    rows: Vec<Row>,
    /// Exclusive groups as positions among free blocks (only groups with ≥ 2 free).
    groups: Vec<Vec<usize>>,
    /// Lower bound on the peak of any allowed choice (max over moments of their minimum).
    peak_lower: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fix {
    Free,
    Zero,
    One,
}

/// Fix blocks by dominance and drop moments that cannot bind; `None` if some moment
/// exceeds `limit` whatever is chosen (only for limit-bounded goals).
///
/// Fixing x_i = 0 is safe when no remaining moment decreases with x_i (and, when time is
/// minimized, time does not decrease either): switching it off never hurts. Fixing
/// x_i = 1 mirrors that, but only outside exclusive groups, where switching on could
/// block a partner. A moment whose maximum over the remaining box is ≤ the limit (for
/// `Peak`: ≤ the lower bound on the peak) can never bind and is dropped.
fn presolve(p: &ConfigProblem, goal: Goal, limit: i64) -> Option<Reduced> {
    let n = p.candidate.len();
    let mut fix: Vec<Fix> = p
        .candidate
        .iter()
        .map(|&c| if c { Fix::Free } else { Fix::Zero })
        .collect();
    let mut grouped = vec![false; n];
    for g in &p.exclusive {
        for &i in g {
            grouped[i] = true;
        }
    }
    let mut active: Vec<usize> = (0..p.moments.len()).collect();
    let mut peak_lower = i64::MIN;
    loop {
        // Offsets and box bounds of every active moment under the current fixing.
        let bounds: Vec<(i64, i64)> = active
            .iter()
            .map(|&k| {
                let m = &p.moments[k];
                let mut lo = m.constant;
                let mut hi = m.constant;
                for (i, &c) in m.coef.iter().enumerate() {
                    match fix[i] {
                        Fix::One => {
                            lo += c;
                            hi += c;
                        }
                        Fix::Free => {
                            lo += c.min(0);
                            hi += c.max(0);
                        }
                        Fix::Zero => {}
                    }
                }
                (lo, hi)
            })
            .collect();
        let lower = bounds.iter().map(|b| b.0).max().unwrap_or(i64::MIN);
        peak_lower = peak_lower.max(lower);
        let threshold = match goal {
            Goal::Peak => peak_lower,
            Goal::Time | Goal::Feasible => {
                if lower > limit {
                    return None;
                }
                limit
            }
        };
        let before = active.len();
        let mut keep = Vec::with_capacity(active.len());
        for (&k, &(_, hi)) in active.iter().zip(&bounds) {
            if hi > threshold {
                keep.push(k);
            }
        }
        active = keep;

        let mut changed = active.len() != before;
        for i in 0..n {
            if fix[i] != Fix::Free {
                continue;
            }
            let coefs = || active.iter().map(|&k| p.moments[k].coef[i]);
            let t = p.seconds_coef[i];
            let time_ok_off = goal != Goal::Time || t >= 0.0;
            let time_ok_on = goal != Goal::Time || t <= 0.0;
            if time_ok_off && coefs().all(|c| c >= 0) {
                fix[i] = Fix::Zero;
                changed = true;
            } else if time_ok_on && !grouped[i] && coefs().all(|c| c <= 0) {
                fix[i] = Fix::One;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }

    let free: Vec<usize> = (0..n).filter(|&i| fix[i] == Fix::Free).collect();
    let mut pos = vec![usize::MAX; n];
    for (k, &i) in free.iter().enumerate() {
        pos[i] = k;
    }
    let base: Vec<bool> = fix.iter().map(|&f| f == Fix::One).collect();
    let rows = active
        .iter()
        .map(|&k| {
            let m = &p.moments[k];
            let offset = m
                .coef
                .iter()
                .zip(&base)
                .filter(|(_, &on)| on)
                .fold(m.constant, |a, (&c, _)| a + c);
            let coef = free
                .iter()
                .enumerate()
                .map(|(q, &i)| (q, m.coef[i]))
                .filter(|&(_, c)| c != 0)
                .collect();
            Row { offset, coef }
        })
        .collect();
    let groups = p
        .exclusive
        .iter()
        .map(|g| {
            dedup(g)
                .into_iter()
                .filter(|&i| fix[i] == Fix::Free)
                .map(|i| pos[i])
                .collect::<Vec<_>>()
        })
        .filter(|g| g.len() >= 2)
        .collect();
    Some(Reduced {
        free,
        base,
        rows,
        groups,
        peak_lower,
    })
}

impl Reduced {
    fn expand(&self, y: &[bool]) -> Vec<bool> {
        let mut x = self.base.clone();
        for (&i, &on) in self.free.iter().zip(y) {
            x[i] = on;
        }
        x
    }

    /// Exact check of a point over free blocks against rows (≤ limit) and groups.
    fn fits(&self, y: &[bool], limit: i64) -> bool {
        self.groups.iter().all(|g| g.iter().filter(|&&q| y[q]).count() <= 1)
            && self
                .rows
                .iter()
                .all(|r| r.coef.iter().filter(|&&(q, _)| y[q]).fold(r.offset, |a, &(_, c)| a + c) <= limit)
    }
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

/// [`min_peak`] by MILP in three exact stages.
fn min_peak_milp(p: &ConfigProblem, opts: SolveOptions, mut stats: SolveStats) -> Result<ConfigSolution, SolveError> {
    // Stage 1: a choice of (nearly) minimal peak. The MILP's optimality tolerance is
    // relative, so its peak may exceed the true minimum by a few bytes; stage 1b closes
    // that gap exactly.
    let mut x = search(p, Goal::Peak, 0, None, opts, &mut stats)?.expect("peak minimization always has a solution");
    let mut best = peak_of(&p.moments, &x).expect("validated").0;
    // Stage 1b: prove `best` minimal by showing `best − 1` infeasible (each success lowers
    // `best` strictly, so this ends).
    while let Some(better) = search(p, Goal::Feasible, best - 1, None, opts, &mut stats)? {
        best = peak_of(&p.moments, &better).expect("validated").0;
        x = better;
    }
    // Stage 2: fastest choice at that peak; `x` is a known feasible start.
    let fastest = search(p, Goal::Time, best, Some(&x), opts, &mut stats)?.ok_or_else(|| SolveError::Numerical {
        key: p.key.clone(),
        operation: Goal::Time.operation(),
        free: p.candidate.len(),
        detail: format!("no choice found within the proven minimal peak {best} B"),
    })?;
    Ok(finish(p, fastest, SolveStatus::Optimal, stats))
}

/// A cut `Σ_{q∈on} (1 − x_q) + Σ_{q∈off} x_q ≥ 1`: at least one listed block must flip.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Cut {
    on: Vec<usize>,
    off: Vec<usize>,
}

/// Cover cut from a point `y` that violates row `r`: every point agreeing with `y` on the
/// blocks with positive coefficients that `y` takes and the blocks with negative
/// coefficients that `y` leaves has a row value ≥ `y`'s, so it violates the row too, and
/// the cut removes exactly those points — never a feasible one. Much stronger than cutting
/// `y` alone, since flipping blocks the row does not see cannot repair it.
fn cover_cut(row: &Row, y: &[bool]) -> Cut {
    Cut {
        on: row
            .coef
            .iter()
            .filter(|&&(q, c)| c > 0 && y[q])
            .map(|&(q, _)| q)
            .collect(),
        off: row
            .coef
            .iter()
            .filter(|&&(q, c)| c < 0 && !y[q])
            .map(|&(q, _)| q)
            .collect(),
    }
}

/// MILP over the free blocks, repeated with cover cuts until the returned point passes
/// the exact check. `Ok(None)`: infeasible. `Err`: numerical trouble (caller decides).
///
/// Why this is exact: the solver works on a superset of the exact feasible set (half a
/// byte of slack on each row, tolerances that only admit more), cuts remove only exactly
/// infeasible points, and the loop ends with a point that passes the `i64` check — so it
/// is optimal over a superset that contains it. An "infeasible" answer is exact for the
/// same reason.
fn milp_exact(
    p: &ConfigProblem,
    red: &Reduced,
    goal: Goal,
    limit: i64,
    warm: Option<&[bool]>,
    opts: SolveOptions,
    stats: &mut SolveStats,
) -> Result<Option<Vec<bool>>, String> {
    let mut cuts: Vec<Cut> = Vec::new();
    for _ in 0..=MAX_CUT_ROUNDS {
        stats.milp_solves += 1;
        let y = match milp_once(p, red, goal, limit, warm, &cuts, opts.backend)? {
            None => return Ok(None),
            Some(y) => y,
        };
        if goal == Goal::Peak || red.fits(&y, limit) {
            return Ok(Some(y));
        }
        if red.groups.iter().any(|g| g.iter().filter(|&&q| y[q]).count() > 1) {
            return Err("the solver returned a point that breaks an exclusive group".to_string());
        }
        for row in &red.rows {
            let v = row
                .coef
                .iter()
                .filter(|&&(q, _)| y[q])
                .fold(row.offset, |a, &(_, c)| a + c);
            if v > limit {
                let cut = cover_cut(row, &y);
                if cut.on.is_empty() && cut.off.is_empty() {
                    // The row exceeds the limit at its minimum: nothing fits.
                    return Ok(None);
                }
                if !cuts.contains(&cut) {
                    cuts.push(cut);
                    stats.cover_cuts += 1;
                }
            }
        }
    }
    Err(format!(
        "{MAX_CUT_ROUNDS} successive points failed the exact byte check"
    ))
}

/// Largest power of two not above `v` (for v > 0): scaling by it is exact in f64.
fn pow2_floor(v: f64) -> f64 {
    if v > 0.0 && v.is_finite() {
        2f64.powi(v.log2().floor() as i32)
    } else {
        1.0
    }
}

/// One MILP solve.
///
/// Units: rows are written in units of `2^s` bytes chosen so the largest coefficient is
/// about 2^10 units. Scaling by a power of two is exact, so the data stay exact. The point
/// is microlp's two tolerances: its simplex works to 1e-10 after scaling each row's
/// largest coefficient to ~1, while the check it applies before accepting an integral
/// point is 1e-7 *in these units*. In bytes with coefficients of 1e11 the first is ~10
/// bytes and the second 1e-7 bytes, and microlp aborts on an integral vertex that the
/// simplex accepts and the check rejects ("exactly integral solution failed feasibility
/// validation"). With the largest coefficient at 2^10 units the check is the looser one,
/// so such points come back to [`milp_exact`], whose exact check and cover cuts deal with
/// them.
fn milp_once(
    p: &ConfigProblem,
    red: &Reduced,
    goal: Goal,
    limit: i64,
    warm: Option<&[bool]>,
    cuts: &[Cut],
    backend: Backend,
) -> Result<Option<Vec<bool>>, String> {
    let k = red.free.len();
    let mut vars = ProblemVariables::new();
    let xs: Vec<Variable> = (0..k).map(|_| vars.add(variable().binary())).collect();

    let max_coef = red
        .rows
        .iter()
        .flat_map(|r| r.coef.iter().map(|&(_, c)| c.unsigned_abs()))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let unit = pow2_floor(max_coef / 1024.0).max(1.0);
    // Peak goal: P = peak_lower + 1024·unit·d, so d's column is scaled like the x columns.
    let d_scale = 1024.0;
    let d = (goal == Goal::Peak).then(|| vars.add(variable().min(0.0)));

    let mut objective = Expression::with_capacity(k + 1);
    match goal {
        Goal::Time => {
            // Scale time to O(1) so microlp's absolute 1e-9 pruning floor stays relative.
            let tmax = red.free.iter().map(|&i| p.seconds_coef[i].abs()).fold(0.0, f64::max);
            let s = 1.0 / pow2_floor(tmax);
            for (q, &i) in red.free.iter().enumerate() {
                objective.add_mul(p.seconds_coef[i] * s, xs[q]);
            }
        }
        Goal::Feasible => {}
        Goal::Peak => objective.add_mul(1.0, d.expect("peak goal has d")),
    }

    let mut constraints = Vec::with_capacity(red.rows.len() + red.groups.len() + cuts.len());
    for r in &red.rows {
        let mut e = Expression::with_capacity(r.coef.len() + 1);
        for &(q, c) in &r.coef {
            e.add_mul(c as f64 / unit, xs[q]);
        }
        // Half a byte of slack: every row value is an integer, so this admits exactly the
        // integer-feasible points, and rounding noise smaller than that cannot cut off
        // any of them.
        let rhs = match goal {
            Goal::Peak => {
                e.add_mul(-d_scale, d.expect("peak goal has d"));
                ((red.peak_lower - r.offset) as f64 + 0.5) / unit
            }
            Goal::Time | Goal::Feasible => ((limit - r.offset) as f64 + 0.5) / unit,
        };
        constraints.push(e.leq(rhs));
    }
    for g in &red.groups {
        let mut e = Expression::with_capacity(g.len());
        for &q in g {
            e.add_mul(1.0, xs[q]);
        }
        constraints.push(e.leq(1.0));
    }
    for cut in cuts {
        let mut e = Expression::with_capacity(cut.on.len() + cut.off.len());
        for &q in &cut.on {
            e.add_mul(-1.0, xs[q]);
        }
        for &q in &cut.off {
            e.add_mul(1.0, xs[q]);
        }
        constraints.push(e.geq(1.0 - cut.on.len() as f64));
    }
    let warm_start: Vec<(Variable, f64)> = warm
        .map(|w| {
            xs.iter()
                .zip(w)
                .map(|(&v, &on)| (v, if on { 1.0 } else { 0.0 }))
                .collect()
        })
        .unwrap_or_default();

    let unsolved = vars.minimise(objective);
    let values = match backend {
        Backend::Microlp => {
            let mut model = unsolved.using(good_lp::microlp);
            for c in constraints {
                model.add_constraint(c);
            }
            if !warm_start.is_empty() {
                model = model.with_initial_solution(warm_start);
            }
            read_values(model.solve(), &xs, false)
        }
        #[cfg(feature = "highs")]
        Backend::Highs => {
            let mut model = unsolved.using(good_lp::highs);
            for c in constraints {
                model.add_constraint(c);
            }
            // HiGHS stops at a 1e-4 relative and 1e-6 absolute gap by default; exactness
            // needs a proof. With both at zero it still reports its last gap, often a
            // rounding-level positive number, which good_lp turns into `GapLimit`; HiGHS's
            // own status was Optimal then, so that is accepted below.
            model = model
                .set_mip_rel_gap(0.0)
                .and_then(|m| m.set_mip_abs_gap(0.0))
                .map_err(|e| format!("setting HiGHS's MIP gaps: {e}"))?;
            if !warm_start.is_empty() {
                model = model.with_initial_solution(warm_start);
            }
            read_values(model.solve(), &xs, true)
        }
    }?;
    Ok(values)
}

fn read_values<S: Solution>(
    result: Result<S, ResolutionError>,
    xs: &[Variable],
    gap_limit_is_optimal: bool,
) -> Result<Option<Vec<bool>>, String> {
    use good_lp::solvers::SolutionStatus as Status;
    match result {
        Ok(sol) => match sol.status() {
            Status::Optimal => Ok(Some(xs.iter().map(|&v| sol.value(v) > 0.5).collect())),
            Status::GapLimit if gap_limit_is_optimal => Ok(Some(xs.iter().map(|&v| sol.value(v) > 0.5).collect())),
            other => Err(format!("solver stopped with status {other:?}")),
        },
        Err(ResolutionError::Infeasible) => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// Exact search over every subset of free blocks (Gray code: one block flips per step, so
/// each step costs one pass over the rows).
fn enumerate(p: &ConfigProblem, red: &Reduced, goal: Goal, limit: i64) -> Option<Vec<bool>> {
    let k = red.free.len();
    // Column-wise coefficients for the incremental update.
    let mut cols: Vec<Vec<(usize, i64)>> = vec![Vec::new(); k];
    for (r, row) in red.rows.iter().enumerate() {
        for &(q, c) in &row.coef {
            cols[q].push((r, c));
        }
    }
    let mut group_of: Vec<Vec<usize>> = vec![Vec::new(); k];
    for (g, members) in red.groups.iter().enumerate() {
        for &q in members {
            group_of[q].push(g);
        }
    }
    let t: Vec<f64> = red.free.iter().map(|&i| p.seconds_coef[i]).collect();
    let mut vals: Vec<i64> = red.rows.iter().map(|r| r.offset).collect();
    let mut counts = vec![0usize; red.groups.len()];
    let mut y = vec![false; k];
    let mut over = counts.iter().filter(|&&c| c > 1).count();

    // Ranking key: (peak, time) for Peak, (time) for Time; Feasible stops at the first.
    let mut best: Option<(i64, f64, Vec<bool>)> = None;
    for step in 0u64..(1u64 << k) {
        if step > 0 {
            let q = step.trailing_zeros() as usize;
            let sign = if y[q] { -1 } else { 1 };
            y[q] = !y[q];
            for &(r, c) in &cols[q] {
                vals[r] += sign * c;
            }
            for &g in &group_of[q] {
                let was = counts[g] > 1;
                counts[g] = (counts[g] as isize + sign as isize) as usize;
                match (was, counts[g] > 1) {
                    (false, true) => over += 1,
                    (true, false) => over -= 1,
                    _ => {}
                }
            }
        }
        if over > 0 {
            continue;
        }
        // Dropped moments never exceed peak_lower, so this is the exact peak (Peak goal).
        let peak = vals.iter().copied().max().unwrap_or(i64::MIN).max(red.peak_lower);
        if goal != Goal::Peak && vals.iter().any(|&v| v > limit) {
            continue;
        }
        if goal == Goal::Feasible {
            return Some(y);
        }
        // Recompute time from scratch: no drift between points that tie.
        let time: f64 = t.iter().zip(&y).filter(|(_, &on)| on).map(|(t, _)| t).sum();
        let key_peak = if goal == Goal::Peak { peak } else { 0 };
        let better = match &best {
            None => true,
            Some((bp, bt, _)) => key_peak < *bp || (key_peak == *bp && time < *bt),
        };
        if better {
            best = Some((key_peak, time, y.clone()));
        }
    }
    best.map(|b| b.2)
}

// ---------------------------------------------------------------------------------------
// Synthetic instances

/// A realistic configuration of `n_blocks` blocks built from random [`BlockTerms`] through
/// DESIGN.md's formulas, for tests and the benchmark command. Even seeds give a
/// ResNet-like chain (activations halve and parameters quadruple over four stages, blocks
/// within a stage identical to the byte, as measured profiles are), odd seeds a BERT-like
/// one (identical layers between an embedding and a head). Some seeds use bf16 autocast
/// terms (no-grad forwards keep weight casts). Recompute times vary by a few percent per
/// block, as measured times do.
pub fn synthetic_problem(n_blocks: usize, seed: u64) -> ConfigProblem {
    let step = synthetic_step(n_blocks, seed);
    config_problem(format!("synthetic-{n_blocks}-seed{seed}"), &step)
}

fn synthetic_step(n: usize, seed: u64) -> StepTerms {
    let mut rng = StdRng::seed_from_u64(seed);
    let resnet = seed.is_multiple_of(2);
    let bf16 = rng.random_bool(0.5);
    let mut blocks = Vec::with_capacity(n);
    // Terms of the current "stage"; blocks repeat them until the stage changes.
    let mut proto: Option<(usize, BlockTerms)> = None;
    // Index of the block within its stage, for names like `layer3.7`.
    let mut within = 0;
    let act0: i64 = if resnet { 205_520_896 } else { 67_108_864 };
    for i in 0..n {
        let stage = if resnet {
            i * 4 / n.max(1)
        } else {
            usize::from(i > 0) + usize::from(i + 1 == n && n > 2)
        };
        let fresh = match &proto {
            Some((s, _)) => *s != stage || (!resnet && stage != 1),
            None => true,
        };
        if fresh {
            let out = (act0 >> if resnet { stage } else { 0 }) / 64 * 64;
            let out = (out as f64 * rng.random_range(0.9..1.1)) as i64 / 64 * 64;
            let g = if resnet {
                (280_000.0 * 4f64.powi(stage as i32) * rng.random_range(0.8..1.2)) as i64 * 4
            } else {
                (12_600_000.0 * rng.random_range(0.95..1.05)) as i64 * 4
            };
            let kg = (out as f64 * rng.random_range(3.0..12.0)) as i64;
            let kng = if bf16 {
                out + (g as f64 / 2.0 * rng.random_range(0.5..1.0)) as i64
            } else {
                out
            };
            let fg = kg + (out as f64 * rng.random_range(0.3..1.5)) as i64;
            let fng = (out as f64 * rng.random_range(1.0..2.5)) as i64;
            let krec = kg;
            let frec = fg - kg + (out as f64 * rng.random_range(0.0..0.5)) as i64;
            let bta = g + (out as f64 * rng.random_range(1.0..3.0)) as i64;
            let btb = (bta as f64 * rng.random_range(0.9..1.1)) as i64;
            let t = rng.random_range(0.002..0.01);
            proto = Some((
                stage,
                BlockTerms {
                    name: String::new(),
                    candidate: true,
                    kg,
                    fg,
                    kng,
                    fng,
                    out,
                    gout: out,
                    krec,
                    frec,
                    bta,
                    btb,
                    g,
                    recompute_seconds: t,
                },
            ));
        }
        let (_, p) = proto.as_ref().expect("set above");
        let mut b = p.clone();
        within = if fresh { 0 } else { within + 1 };
        b.name = match (resnet, stage) {
            (true, s) => format!("layer{}.{within}", s + 1),
            (false, 0) => "embeddings".to_string(),
            (false, 1) => format!("encoder.layer.{within}"),
            (false, _) => "cls".to_string(),
        };
        b.recompute_seconds = p.recompute_seconds * rng.random_range(0.97..1.03);
        blocks.push(b);
    }
    let grads: i64 = blocks.iter().map(|b| b.g).sum();
    let fwd: f64 = blocks.iter().map(|b| b.recompute_seconds).sum();
    StepTerms {
        // Parameters + Adam's two moments + the batch.
        fixed: 3 * grads + act0 / 4,
        lk: 4096,
        lf: 1 << 20,
        lb: 1 << 20,
        otmp: grads / 8,
        base_seconds: 3.0 * fwd + 0.01,
        blocks,
        groups: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> ConfigProblem {
        // Two blocks, peak = 100 − 30·x0 − 20·x1 (loss) and 60 + 25·x0 (recompute 0).
        ConfigProblem {
            key: "tiny".into(),
            moments: vec![
                Moment {
                    label: "loss".into(),
                    constant: 100,
                    coef: vec![-30, -20],
                },
                Moment {
                    label: "recompute a".into(),
                    constant: 60,
                    coef: vec![25, 0],
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
