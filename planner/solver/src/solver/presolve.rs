//! Presolve: fixes blocks by dominance and drops moments that can never bind, leaving the
//! engines a smaller exact problem.

use crate::problem::ConfigProblem;

/// What a search optimizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Goal {
    /// Minimize time subject to every moment ≤ limit.
    Time,
    /// Any point with every moment ≤ limit.
    Feasible,
    /// Minimize the peak (the limit is ignored).
    Peak,
}

/// A moment restricted to the free blocks: `offset + Σ coef·x_free`.
#[derive(Debug, Clone)]
pub(super) struct Row {
    pub(super) offset: i64,
    /// (position among free blocks, bytes); zero coefficients are left out.
    pub(super) coef: Vec<(usize, i64)>,
}

/// The problem after presolve.
#[derive(Debug, Clone)]
pub(super) struct Reduced {
    /// Original indices of the blocks left to the search.
    pub(super) free: Vec<usize>,
    /// Full-length choice holding presolve's fixed values (false at free positions).
    pub(super) base: Vec<bool>,
    pub(super) rows: Vec<Row>,
    /// Exclusive groups as positions among free blocks (only groups with ≥ 2 free).
    pub(super) groups: Vec<Vec<usize>>,
    /// Lower bound on the peak of any allowed choice (max over moments of their minimum).
    pub(super) peak_lower: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fix {
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
pub(super) fn presolve(p: &ConfigProblem, goal: Goal, limit: i64) -> Option<Reduced> {
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
    pub(super) fn expand(&self, y: &[bool]) -> Vec<bool> {
        let mut x = self.base.clone();
        for (&i, &on) in self.free.iter().zip(y) {
            x[i] = on;
        }
        x
    }

    /// Exact check of a point over free blocks against rows (≤ limit) and groups.
    pub(super) fn fits(&self, y: &[bool], limit: i64) -> bool {
        self.groups.iter().all(|g| g.iter().filter(|&&q| y[q]).count() <= 1)
            && self
                .rows
                .iter()
                .all(|r| r.coef.iter().filter(|&&(q, _)| y[q]).fold(r.offset, |a, &(_, c)| a + c) <= limit)
    }
}

impl Goal {
    pub(super) fn operation(self) -> &'static str {
        match self {
            Goal::Time => "time minimization",
            Goal::Feasible => "the minimal-peak proof",
            Goal::Peak => "peak minimization",
        }
    }
}

/// The distinct members of an exclusive group.
pub(super) fn dedup(g: &[usize]) -> Vec<usize> {
    let mut g = g.to_vec();
    g.sort_unstable();
    g.dedup();
    g
}
