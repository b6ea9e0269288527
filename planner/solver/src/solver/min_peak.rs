//! The smallest peak one configuration can reach, proven to the byte, and the fastest choice
//! that reaches it: by bisection over the limit with feasibility searches (the chain DP), or
//! by the MILP in three exact stages.

use super::error::SolveError;
use super::options::{Engine, SolveOptions};
use super::presolve::{presolve, Goal};
use super::search::search;
use super::solution::{finish, ConfigSolution, SolveStats, SolveStatus};
use crate::problem::{peak_of, ConfigProblem};

pub(super) fn min_peak_inner(
    p: &ConfigProblem,
    opts: SolveOptions,
    mut stats: SolveStats,
) -> Result<ConfigSolution, SolveError> {
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

/// [`super::min_peak`] by MILP in three exact stages.
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
