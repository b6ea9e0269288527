//! What an instrumented step records (meter levels around every moment) and what every step
//! reports.

use crate::load::Load;

/// Meter readings around one block in one micro-step (bytes; levels are absolute).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BlockTrace {
    pub checkpointed: bool,
    /// Ran inside a fused group (one graph, no boundaries inside; see [`Session::fuse_groups`]).
    /// The group's single backward is recorded on its last block.
    pub fused: bool,
    /// Level before the block's forward, highest level during it, level after it (autocast
    /// region closed), and the level just before its autocast region closed: the difference
    /// is the weight casts only autocast's cache held.
    pub fwd_before: i64,
    pub fwd_peak: i64,
    pub fwd_after: i64,
    pub fwd_open: i64,
    pub fwd_seconds: f64,
    /// Checkpointed blocks: level at the recompute's start (for a segment's first block, once
    /// the stored output is dropped and before the RNG swap and buffer snapshot, which its
    /// window covers), highest level during recompute, level after it.
    pub rec_before: i64,
    pub rec_peak: i64,
    pub rec_after: i64,
    pub rec_seconds: f64,
    /// Level when the block's VJP starts, highest level during it, level once the input's sink
    /// is dropped (its gradient taken).
    pub bwd_before: i64,
    pub bwd_peak: i64,
    pub bwd_after: i64,
    pub bwd_seconds: f64,
    /// Bytes of the gradient this block's backward hands to the previous block.
    pub grad_in_bytes: i64,
    /// Bytes freed when the block's backward let go of its output (0 when its own graph saved
    /// it), and when a checkpointed block's stored no-grad output was dropped for the
    /// recompute: eager PyTorch frees an unsaved output as soon as its readers' backward ran.
    pub out_released: i64,
    pub ckpt_out_released: i64,
    /// A selective block: bytes of its output that its selective cache holds and that the
    /// runtime would otherwise let go after a plain reader's forward (0 when the cache does not
    /// keep the output, or the output is held until its backward anyway).
    pub sel_held: i64,
}

/// Meter readings for one micro-step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MicroTrace {
    pub start: i64,
    pub blocks: Vec<BlockTrace>,
    pub loss_before: i64,
    /// Peak of the loss head's forward (the loss made, before backward starts), and the level
    /// once backward's seed exists: what FSDP's root sees at its pre-backward.
    pub loss_fwd_peak: i64,
    pub loss_seeded: i64,
    /// Peak of the loss's backward alone (from the seed on), and of the whole loss window.
    pub loss_bwd_peak: i64,
    pub loss_peak: i64,
    /// Autocast's casts were held over the forward and freed between the loss's forward and
    /// its backward ([`crate::exec::Session::hold_casts`]): the two are separate moments.
    pub casts_held: bool,
    pub loss_after: i64,
    /// Level when the last block's backward is done, with the loss and the seed alive: what
    /// FSDP's end-of-backward callback sees.
    pub bwd_end: i64,
    pub end: i64,
}

/// Meter readings for one whole step (all micro-steps and the optimizer).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepTrace {
    pub micro: Vec<MicroTrace>,
    pub opt_before: i64,
    pub opt_peak: i64,
    pub opt_after: i64,
    pub opt_seconds: f64,
}

/// What a step reports.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// Mean loss over the micro-steps.
    pub loss: f64,
    pub seconds: f64,
    /// Whether the optimizer step was applied (fp16 loss scaling skips steps with inf/nan).
    pub applied: bool,
    /// CPU: the meter's highest level during the step, and its level when the step started
    /// (parameters, buffers, optimizer state, and whatever else the process holds).
    pub peak_bytes: i64,
    pub start_bytes: i64,
    /// CUDA: the caching allocator's reserved peak during the step; `None` on the CPU.
    pub reserved_peak_bytes: Option<i64>,
    /// CPU the rest of the machine took while the step ran (`None` where it cannot be read).
    pub load: Option<Load>,
}
