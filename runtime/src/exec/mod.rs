//! Checkpointed execution of a chain: one training step with any set of blocks checkpointed.
//!
//! The scheme (docs/memory-model.md, "The execution scheme the model assumes"):
//! - every block reads the previous block's output through an alias feeding a gradient sink
//!   (`kernels::sink`): a non-leaf, as the previous layer's output is in PyTorch (autocast casts
//!   it once per operator), whose storage nothing but the runtime's handle and what a graph
//!   saved holds. The runtime lets go of an output whose only reader is the next block after
//!   that block's forward (after its backward when it is checkpointed), keeping the output's
//!   gradient edge, so the output lives as long as PyTorch keeps it; an output with several
//!   readers (skips, the loss) is held until its block's backward;
//! - a checkpointed block runs forward under no-grad, keeping only its output; in backward it is
//!   recomputed with grad from its input (held for it), with the RNG state of its forward
//!   (dropout replays bitwise) and inside its own autocast region;
//! - backward runs block by block, last to first, through the shim's VJP from the output's
//!   gradient edge and its gradient, neither outliving its use; the input sink's gradient, the
//!   sum of every reader's, becomes the previous block's output gradient;
//! - each block's forward runs in its own autocast region: the region's cache of bf16 weight
//!   casts then lives for one block, not for the whole forward (same results bitwise, since a
//!   cast is deterministic, and less memory than one region around the model);
//! - BatchNorm running statistics are snapshotted before a recompute and restored after it, so
//!   a checkpointed step leaves the model in exactly the state a plain step does
//!   (`torch.utils.checkpoint` instead updates them twice).
//!
//! An instrumented step records the memory meter at each moment into a [`StepTrace`]; reading
//! the meter allocates nothing, so an instrumented step allocates exactly what a plain one does.

//!
//! Files: [`session`] holds a chain prepared for training; `step` runs a step (micro-steps,
//! then the optimizer, or the optimizer inside backward: `in_backward`) as `forward`, `loss`
//! (`chunked_loss` for a language model's loss in chunks) and `backward`, following the `schedule` a
//! checkpoint mask gives; `boundary` makes the aliases between blocks; `numbers` keeps what a checkpointed forward keeps of the Python numbers its operators take; `diagnose` names the node of a backward that failed; [`trace`] is what an
//! instrumented step records; `select` turns a checkpoint regex into a mask; [`scope`] names the
//! user scopes a step opens around each block's forward, recompute and backward, the loss and
//! the optimizer, which say in an operator trace what each operator was part of.

mod backward;
mod boundary;
mod chunked_loss;
mod diagnose;
mod forward;
mod in_backward;
mod loss;
mod numbers;
mod schedule;
pub mod scope;
mod select;
pub mod session;
mod step;
pub mod trace;

pub use select::select;
pub use session::{nbytes, Session};
pub use trace::{BlockTrace, MicroTrace, StepReport, StepTrace};
