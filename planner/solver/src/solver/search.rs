//! One search of a reduced problem for a goal (fastest under a limit, any choice under it, or
//! the smallest peak) by the engine the options name, and the exact `i64` check of its answer.

use super::dp;
use super::enumerate::enumerate;
use super::error::SolveError;
use super::milp::milp_exact;
use super::options::{Engine, SolveOptions, MAX_ENUMERATE};
use super::presolve::{dedup, presolve, Goal};
use super::solution::SolveStats;
use super::tie::{retie, untie};
use crate::problem::ConfigProblem;

/// Presolve and search for `goal`; `Some(x)` (full length) or `None` if nothing fits.
pub(super) fn search(
    p: &ConfigProblem,
    goal: Goal,
    limit: i64,
    warm: Option<&[bool]>,
    opts: SolveOptions,
    stats: &mut SolveStats,
) -> Result<Option<Vec<bool>>, SolveError> {
    if !p.tied.is_empty() {
        let (q, rep) = untie(p);
        let x = search(&q, goal, limit, warm, opts, stats)?.map(|y| retie(&y, &rep));
        if let Some(x) = &x {
            if goal != Goal::Peak && !fits(p, x, limit) {
                return Err(SolveError::Numerical {
                    key: p.key.clone(),
                    operation: goal.operation(),
                    free: stats.free_vars,
                    detail: "a returned choice failed the exact check of the tied problem".to_string(),
                });
            }
        }
        return Ok(x);
    }
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

/// Exact check that `x` is allowed (candidates, exclusive groups) and fits `limit`.
fn fits(p: &ConfigProblem, x: &[bool], limit: i64) -> bool {
    x.iter().zip(&p.candidate).all(|(&on, &c)| !on || c)
        && p.ties_hold(x)
        && p.exclusive
            .iter()
            .all(|g| dedup(g).iter().filter(|&&i| x[i]).count() <= 1)
        && p.moments.iter().all(|m| m.eval(x) <= limit)
}
