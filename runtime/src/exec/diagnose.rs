//! A backward that failed, told by the node at fault. The engine's words name an autograd
//! function (`SigmoidBackward0`) or a derivative (`'zeta'`), never a node of the user's program,
//! so the blocks whose backward failed run again and find the node themselves
//! ([`ckptune_models::Block::locate_backward_failure`]).

use ckptune_kernels::KernelError;
use ckptune_models::{Batch, Ctx};
use tch::Tensor;

use super::forward::Activations;
use super::session::Session;
use crate::error::RuntimeError;

impl Session {
    /// `error`, the failure of the backward of blocks `start..=i` (a fused run when
    /// `start < i`), as [`RuntimeError::Backward`] naming the node at fault when a block finds
    /// it; otherwise `error` unchanged. A fake step's operator without a meta kernel stays what
    /// it is: the step is refused as not measurable on the meta device, with that operator.
    pub(super) fn backward_failed(
        &self,
        (start, i): (usize, usize),
        acts: &Activations,
        batch: &Batch,
        ctx: &Ctx<'_>,
        error: RuntimeError,
    ) -> RuntimeError {
        let RuntimeError::Kernel(KernelError::Torch { message, .. }) = &error else {
            return error;
        };
        if self.is_fake() && ckptune_kernels::fake::meta_failure(message).is_some() {
            return error;
        }
        match self.locate(start, i, acts, batch, ctx) {
            Some((k, failure)) => RuntimeError::Backward {
                model: self.chain.name.clone(),
                block: self.chain.blocks[k].name.clone(),
                failure: Box::new(failure),
            },
            None => error,
        }
    }

    /// The first block of `start..=i` that finds the node whose backward fails, run forward as
    /// the step ran it (in the step's autocast), each on what the step handed it: the outputs
    /// before `start` the runtime still holds (it lets go of an output whose only reader ran
    /// plain: then nothing is found) and the further outputs' leaves, and within the run the
    /// outputs of this re-run, detached as leaves.
    fn locate(
        &self,
        start: usize,
        i: usize,
        acts: &Activations,
        batch: &Batch,
        ctx: &Ctx<'_>,
    ) -> Option<(usize, ckptune_models::BlockFailure)> {
        let _autocast = self.autocast_region().ok()?;
        // Per block of the run, its output and then its further outputs.
        let mut outs: Vec<Vec<Tensor>> = Vec::with_capacity(i + 1 - start);
        let input = |outs: &[Vec<Tensor>], (s, slot): (usize, usize)| -> Option<Tensor> {
            if s >= start {
                let t = outs.get(s - start)?.get(slot)?;
                Some(t.detach().set_requires_grad(t.is_floating_point()))
            } else if slot == 0 {
                let t = acts.outputs[s].as_ref()?;
                Some(t.detach().set_requires_grad(true))
            } else {
                acts.extra_leaves[s].get(slot - 1)?.as_ref().map(Tensor::shallow_clone)
            }
        };
        for k in start..=i {
            let block = &self.chain.blocks[k];
            let x = match k {
                0 => batch.input.shallow_clone(),
                _ => input(&outs, (k - 1, 0))?,
            };
            let skips = block
                .skip_reads()
                .map(|r| input(&outs, r))
                .collect::<Option<Vec<Tensor>>>()?;
            let bctx = ctx.with_skips(&skips);
            if let Some(failure) = block.block.locate_backward_failure(&x, &bctx) {
                return Some((k, failure));
            }
            let (out, more) = block.block.try_forward_all(&x, &bctx).ok()?;
            outs.push(std::iter::once(out).chain(more).collect());
        }
        None
    }
}
