//! The general engine: a 0/1 MILP through good_lp (microlp, or HiGHS with feature `highs`),
//! made exact by an `i64` re-check of every returned point and cover cuts.

use good_lp::{
    variable, Expression, ProblemVariables, ResolutionError, Solution, SolverModel, Variable, WithInitialSolution,
};

use super::options::{Backend, SolveOptions};
use super::presolve::{Goal, Reduced, Row};
use super::solution::SolveStats;
use crate::problem::ConfigProblem;

/// Rounds of cover cuts before a MILP that keeps returning points the exact check rejects
/// is treated as numerical trouble.
const MAX_CUT_ROUNDS: usize = 64;

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
pub(super) fn milp_exact(
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
