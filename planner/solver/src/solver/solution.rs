//! What a solve returns: per configuration the choice, its exact peak and time, and how it
//! was found; for a set of configurations, the fastest that fits.

use crate::problem::{peak_of, ConfigProblem};

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

pub(super) fn finish(p: &ConfigProblem, x: Vec<bool>, status: SolveStatus, stats: SolveStats) -> ConfigSolution {
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
