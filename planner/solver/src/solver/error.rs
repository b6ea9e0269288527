//! Why a solve failed: invalid input, nothing fits, or numerical trouble it could not
//! recover from.

use super::options::MAX_ENUMERATE;
use crate::budget::format_size;

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
