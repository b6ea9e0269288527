//! What the solver is given: one configuration's step as affine moments of the checkpoint
//! choice, its step times and which blocks may be checkpointed. The chain memory model
//! ([`crate::chain_model`]) and the sharded model ([`crate::shard`]) build problems; the solver
//! ([`crate::solver`]) takes them. Plain data, no I/O.

/// Largest magnitude, in bytes, of any moment or budget. Below 2^53 every byte count and
/// every partial sum is an exact `f64`, so the MILP sees the data without rounding, and
/// `i64` sums cannot overflow. 2^53 B = 8 PiB.
pub const MAX_BYTES: i64 = 1 << 53;

/// Height of the covering moment that rules out a group with none of `z_g`, `f_g` or its
/// blocks on: 64 TiB, above any budget the planner passes (it clamps budgets below this), and
/// small enough that a covering moment over a group of 120 blocks stays within 2^53.
pub const UNDECIDED: i64 = 1 << 46;

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
    /// Classes of variables that are checkpointed together or not at all: the calls of a module
    /// that runs several times (ALBERT's shared layer), each call a block of its own, which
    /// `torch.utils.checkpoint` on that module checkpoints every one of ([`ties_by_name`]).
    pub tied: Vec<Vec<usize>>,
}

impl ConfigProblem {
    /// Whether `x` gives every variable of each tied class the same value.
    pub fn ties_hold(&self, x: &[bool]) -> bool {
        self.tied
            .iter()
            .all(|class| class.iter().all(|&v| x.get(v) == class.first().and_then(|&f| x.get(f))))
    }
}

/// The classes of variables sharing a name, among `(variable, name)` pairs: a module's calls,
/// which the plan's regex (a set of names) can only select together. Names met once tie nothing.
pub fn ties_by_name<'a>(vars: impl IntoIterator<Item = (usize, &'a str)>) -> Vec<Vec<usize>> {
    let mut classes: Vec<(&str, Vec<usize>)> = Vec::new();
    for (v, name) in vars {
        match classes.iter_mut().find(|(n, _)| *n == name) {
            Some((_, class)) => class.push(v),
            None => classes.push((name, vec![v])),
        }
    }
    classes.into_iter().map(|(_, c)| c).filter(|c| c.len() > 1).collect()
}

/// One moment of the step: `constant + Σ_i coef[i] · x_i`, in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Moment {
    /// Where in the step, e.g. `forward layer2`, `loss`, `recompute layer1`.
    pub label: String,
    pub constant: i64,
    /// Per block: bytes added when that block is checkpointed.
    pub coef: Vec<i64>,
    /// Under which choices the step passes through this moment. The solver needs only the
    /// values (a moment that does not occur is encoded below one that does), but comparing
    /// the model with a measured step moment by moment needs to know which ones happen.
    pub occurs: Occurs,
}

/// When a [`Moment`] happens in the step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Occurs {
    /// Under every choice.
    Always,
    /// When every listed variable has the listed value (`x[v] == on`).
    When(Vec<(usize, bool)>),
    /// Never: a constraint for the solver only (a group's covering moment).
    Never,
}

impl Occurs {
    /// Whether the moment happens under choice `x`.
    pub fn under(&self, x: &[bool]) -> bool {
        match self {
            Occurs::Always => true,
            Occurs::When(conds) => conds.iter().all(|&(v, on)| x.get(v).copied().unwrap_or(false) == on),
            Occurs::Never => false,
        }
    }
}

impl Moment {
    /// Exact value under checkpoint choice `x` (one entry per block).
    ///
    /// Saturates instead of wrapping; the solver rejects any moment whose magnitude
    /// exceeds 2^53 bytes, far below where saturation could start.
    pub fn eval(&self, x: &[bool]) -> i64 {
        assert_eq!(
            x.len(),
            self.coef.len(),
            "moment {:?} has {} coefficients but the choice has {} entries",
            self.label,
            self.coef.len(),
            x.len()
        );
        self.coef
            .iter()
            .zip(x)
            .filter(|(_, &on)| on)
            .fold(self.constant, |acc, (&c, _)| acc.saturating_add(c))
    }
}

/// Index and value of the largest moment under `x`; the first one on ties, so the
/// earliest moment of the step is reported as binding. `None` when `moments` is empty.
pub fn peak_of(moments: &[Moment], x: &[bool]) -> Option<(i64, usize)> {
    moments
        .iter()
        .enumerate()
        .map(|(k, m)| (m.eval(x), k))
        .fold(None, |best, (v, k)| match best {
            Some((bv, _)) if bv >= v => best,
            _ => Some((v, k)),
        })
}
