//! The knobs of a solve: which exact engine searches, and which MILP backend.

/// Most free variables the exact enumeration fallback accepts (2^20 points).
pub const MAX_ENUMERATE: usize = 20;

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
