//! The solver benchmark's rows (`results/solver.json`, written by the `bench_solver` example).

use serde::{Deserialize, Serialize};

/// One engine on one problem size under one budget.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SolverBenchRow {
    pub blocks: usize,
    pub configs: usize,
    pub engine: String,
    pub budget_fraction: f64,
    pub seconds: f64,
    pub feasible_configs: usize,
    /// Solved by a proven-optimal method (always, unless the MILP timed out).
    pub optimal: bool,
}
