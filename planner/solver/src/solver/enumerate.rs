//! Exact enumeration of every subset of free blocks, the MILP's fallback on numerical trouble.

use super::presolve::{Goal, Reduced};
use crate::problem::ConfigProblem;

/// Exact search over every subset of free blocks (Gray code: one block flips per step, so
/// each step costs one pass over the rows).
pub(super) fn enumerate(p: &ConfigProblem, red: &Reduced, goal: Goal, limit: i64) -> Option<Vec<bool>> {
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
