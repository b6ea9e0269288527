//! The Python numbers a block's operators take as tensors (`kernels::numbers`): which of them the
//! block's graph saves, learned the first time it runs with grad, and the ones a checkpointed or
//! selective block's forward keeps until its segment's recompute is done, as the forward of
//! `torch.utils.checkpoint` keeps them (docs/memory-model.md, "The execution scheme").

use ckptune_kernels::numbers::{self, BlockRun, Scope};
use tch::Tensor;

use super::session::Session;
use crate::error::Result;

impl Session {
    /// Opens the number scope of block `i`'s forward or recompute. `grad`: whether it runs with
    /// grad; a run without grad keeps the numbers the block's run with grad saved (every one,
    /// before the block has run with grad).
    pub(super) fn open_numbers(&self, i: usize, grad: bool) -> Result<Scope> {
        let run = if grad {
            BlockRun::WithGrad
        } else {
            BlockRun::WithoutGrad(self.numbers_saved[i].get().map(Vec::as_slice))
        };
        Ok(numbers::scope(run)?)
    }

    /// Closes block `i`'s number scope: a run with grad teaches the block which numbers its
    /// graph saves, the first time; returns what a run without grad kept.
    pub(super) fn close_numbers(&self, i: usize, scope: Scope) -> Vec<Tensor> {
        let grad = scope.with_grad();
        let seen = scope.finish();
        if grad {
            let _ = self.numbers_saved[i].set(seen.saved);
        }
        seen.kept
    }
}
