//! The measured terms the chain model is written over: per block, per selective block, per
//! nested group and fused group, and the step's (docs/memory-model.md names each).

/// Measured terms of one block, all bytes as `i64` (they are differences of allocator
/// counters), named as in docs/memory-model.md.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockTerms {
    /// Qualified module name, e.g. `layer1` or `encoder.layer.3`.
    pub name: String,
    /// Whether the planner may checkpoint this block; others keep `x = 0`.
    pub candidate: bool,
    /// Kept after the grad-mode forward (output included).
    pub kg: i64,
    /// Transient peak of the grad-mode forward above its start.
    pub fg: i64,
    /// Kept after the no-grad forward (output, plus autocast casts in bf16).
    pub kng: i64,
    /// Transient peak of the no-grad forward.
    pub fng: i64,
    /// Output bytes.
    pub out: i64,
    /// Bytes of the output's gradient.
    pub gout: i64,
    /// Kept after the recompute in backward.
    pub krec: i64,
    /// Transient peak of the recompute.
    pub frec: i64,
    /// Backward transient when not checkpointed (step A).
    pub bta: i64,
    /// Backward transient after a recompute (step B).
    pub btb: i64,
    /// Parameter-gradient bytes.
    pub g: i64,
    /// Extra seconds per step when this block is checkpointed.
    pub recompute_seconds: f64,
    /// The block run selective (its forward keeps the outputs of the operators a policy saves,
    /// its recompute computes the rest), one entry per policy measured; empty otherwise.
    pub sel: Vec<SelTerms>,
}

/// Measured terms of a block run selective under one policy, a state beside plain and
/// checkpointed: `s_jp = 1` replaces the checkpointed block's `kng`, `fng`, `out`, `frec`, `btb`
/// and recompute time by these. Each policy's variable comes after every block and group
/// variable (`selective_vars`); the block's `x_j` and its policies' variables exclude each
/// other, so the solver picks one state per block.
#[derive(Debug, Clone, PartialEq)]
pub struct SelTerms {
    /// Kept while the forward's autocast region is open (its output, the saved operators'
    /// outputs, and the casts autocast's cache holds), and after it closed.
    pub kf: i64,
    pub kb: i64,
    /// Forward transient above its start.
    pub fwd: i64,
    /// Recompute transient above the backward base.
    pub frec: i64,
    /// Backward transient after the recompute, above `base + krec` (as `btb`).
    pub btb: i64,
    /// Bytes of the block's output its selective cache keeps where a plain next block's `kg`
    /// and `krec` count them as let go: the next block holds them when it runs plain after
    /// this one ran selective (`h_j`, see [`super::moments`]).
    pub held: i64,
    pub recompute_seconds: f64,
}

/// Measured terms of a group: a candidate module over blocks `first..=last`
/// (`encoder.layer.3` over its attention, intermediate and output). A choice has two
/// variables per group after the blocks': `z_g` (index `n + g`), the group checkpointed as a
/// whole, and `f_g` (index `n + m + g`), the group fused: nothing in it checkpointed, run as
/// one graph as PyTorch runs the module (the runtime fuses exactly then). Of `z_g`, `f_g` and
/// the group's blocks, `z_g` and `f_g` exclude each other and every block; a covering moment
/// makes "none of them" infeasible, so `f_g = 1` exactly when nothing in the group is
/// checkpointed.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupTerms {
    pub name: String,
    pub first: usize,
    pub last: usize,
    /// Kept after the group's no-grad forward (its output), during forward and backward.
    pub kept: i64,
    /// Kept on top of `kept` from the group's forward until the loss is made: weight casts
    /// autocast's cache holds (0 unless the loop keeps the cache on).
    pub cache: i64,
    /// Per block of the group: its forward peak above the level earlier blocks leave.
    pub fwd: Vec<i64>,
    /// Bytes alive when the group's recompute starts, above what earlier blocks keep and
    /// the gradients of blocks after the group (`Σ g`): like `gout` of a block.
    pub carry: i64,
    /// Per block: recompute peak and VJP peak above the group's backward base
    /// (`F + Σ_{i>last} g_i + Σ_{i<first} kb_i + carry`).
    pub rec: Vec<i64>,
    pub bwd: Vec<i64>,
    pub recompute_seconds: f64,
    /// Terms of the fused run; `None` when the group never runs fused (then `f_g` is not a
    /// candidate and the blocks' plain terms apply with nothing checkpointed).
    pub fused: Option<FusedTerms>,
}

/// A group run fused: one graph from its input to its output, one VJP.
#[derive(Debug, Clone, PartialEq)]
pub struct FusedTerms {
    /// Kept after its forward.
    pub kept: i64,
    /// As [`GroupTerms::cache`], for the fused run.
    pub cache: i64,
    /// Per block: forward peak above the level earlier blocks leave.
    pub fwd: Vec<i64>,
    /// Bytes alive when its VJP starts above what earlier blocks keep, `Σ_{i>last} g_i` and
    /// `kept`.
    pub carry: i64,
    /// Peak of its VJP above the VJP's start.
    pub bwd: i64,
}

/// Measured terms of one training step in one configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct StepTerms {
    /// `F`: level at step start (parameters, buffers, optimizer state, batch).
    pub fixed: i64,
    /// Bytes the loss keeps.
    pub lk: i64,
    /// Transient of the loss forward.
    pub lf: i64,
    /// Transient of the loss backward.
    pub lb: i64,
    /// Transient of the optimizer step.
    pub otmp: i64,
    /// Step time with nothing checkpointed.
    pub base_seconds: f64,
    /// Blocks in execution order.
    pub blocks: Vec<BlockTerms>,
    /// Groups over runs of blocks, ordered and disjoint (empty for a plain chain).
    pub groups: Vec<GroupTerms>,
}
