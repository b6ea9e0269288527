//! A language model's loss in chunks of tokens (`--loss-chunks`): per chunk, the head's logits,
//! their summed cross entropy and its gradient with respect to the chunk's hidden states and
//! the head's weight, all freed before the next chunk, so the `[tokens, vocab]` logits and
//! their gradient exist for one chunk at a time. These are the operators, in the same order and
//! with the same lifetimes, of the companion's `ckptune.chunked_causal_lm_loss`
//! (python/ckptune/loss.py), an autograd Function whose forward computes the gradients and
//! whose backward scales them: what the meter sees here is what PyTorch allocates there.

use ckptune_kernels::autocast::AutocastGuard;
use ckptune_kernels::autograd;
use ckptune_models::causal_lm::IGNORE_INDEX;
use ckptune_models::chain::LmHead;
use ckptune_models::Batch;
use tch::{Kind, Tensor};

use super::loss::LossStep;
use super::scope::{self, Phase};
use super::session::Session;
use super::trace::MicroTrace;
use crate::error::{torch, Result};

/// What the Function's forward leaves for its backward: the summed loss, the unscaled
/// gradients of the hidden states (`[tokens, hidden]`) and of the head's weight, and the number
/// of labelled tokens.
struct ChunkGrads {
    total: Tensor,
    grad_hidden: Tensor,
    grad_weight: Tensor,
    count: Tensor,
}

impl Session {
    /// The loss of `y`, the last block's output, in `cfg.loss_chunks` chunks, and its backward,
    /// metered as the whole loss's; `held` as for [`Session::loss`].
    pub(super) fn chunked_loss(
        &self,
        head: &dyn LmHead,
        y: &Tensor,
        batch: &Batch,
        held: Option<AutocastGuard>,
        mut tr: Option<&mut MicroTrace>,
    ) -> Result<LossStep> {
        let e = || torch("chunked loss");
        if let Some(t) = tr.as_deref_mut() {
            t.loss_before = self.probe.current();
            self.probe.reset_window();
        }
        let _scope = scope::open(Phase::Loss, None)?;
        let ChunkGrads {
            total,
            grad_hidden,
            grad_weight,
            count,
        } = {
            // The Function runs inside the loop's autocast region, its gradients included.
            let _ac = self.autocast_region()?;
            self.chunk_grads(head, y, batch)?
        };
        // `return total / count`: the Function's output; `total` dies as the forward returns.
        let loss = total.f_div(&count).map_err(e())?;
        drop(total);
        let (value, scaled) = self.scaled(loss);
        // The chunks cast views, which autocast's cache never holds: a held region frees only
        // the blocks' casts, as for the whole loss.
        let seed = self.seed_after_forward(&scaled, held, tr.as_deref_mut())?;
        // The engine's backward: the scale's backward hands the Function `seed * scale`, whose
        // backward scales both gradients in place by `grad_output / count`.
        let scale = self.loss_scale() / self.cfg.grad_accum as f64;
        let grad_output = if scale == 1.0 {
            seed.shallow_clone()
        } else {
            &seed * scale
        };
        let factor = grad_output.f_div(&count).map_err(e())?;
        drop(grad_output);
        let mut grad_hidden = grad_hidden;
        let mut grad_weight = grad_weight;
        let _ = grad_hidden.f_mul_(&factor).map_err(e())?;
        let _ = grad_weight.f_mul_(&factor).map_err(e())?;
        drop((factor, count));
        // The weight's gradient reaches its `.grad` as the engine's AccumulateGrad does it
        // (taken over when there is none, added in place otherwise).
        autograd::backward(autograd::writable_alias(head.weight())?, grad_weight)?;
        let grad = grad_hidden.f_view(y.size().as_slice()).map_err(e())?;
        drop(grad_hidden);
        self.check_loss_value(value)?;
        if let Some(t) = tr {
            t.loss_bwd_peak = self.probe.window_peak();
            t.loss_peak = t.loss_fwd_peak.max(t.loss_bwd_peak);
            t.loss_after = self.probe.current();
        }
        Ok(LossStep {
            value,
            var: scaled.detach(),
            seed,
            grad,
        })
    }

    /// The Function's forward: per chunk of tokens, the loss and its gradients, the chunk's
    /// hidden-state gradient copied into one buffer and the weight's summed into the first.
    fn chunk_grads(&self, head: &dyn LmHead, y: &Tensor, batch: &Batch) -> Result<ChunkGrads> {
        let e = || torch("chunked loss");
        let shift = head.shift_labels(batch);
        let width = *y.size().last().expect("the last output has a hidden dimension");
        let flat = y.detach().f_view([-1, width]).map_err(e())?;
        let grad_hidden = flat.f_empty_like().map_err(e())?;
        let mut grad_weight: Option<Tensor> = None;
        let mut total = Tensor::f_zeros([], (Kind::Float, y.device())).map_err(e())?;
        let mut start = 0;
        let chunks = self.cfg.loss_chunks;
        let rows_of = flat.f_chunk(chunks, 0).map_err(e())?;
        let labels_of = shift.f_chunk(chunks, 0).map_err(e())?;
        for (rows, labels) in rows_of.iter().zip(&labels_of) {
            let rows = rows.detach().set_requires_grad(true);
            let loss = head.chunk_loss(&rows, labels);
            let mut grads = Tensor::f_run_backward(&[&loss], &[&rows, head.weight()], false, false).map_err(e())?;
            total += loss.detach();
            drop(loss);
            let len = rows.size()[0];
            let grad_w = grads.pop().expect("two gradients");
            let grad_rows = grads.pop().expect("two gradients");
            grad_hidden
                .f_narrow(0, start, len)
                .and_then(|mut dst| dst.f_copy_(&grad_rows))
                .map_err(e())?;
            start += len;
            drop((rows, grad_rows));
            grad_weight = Some(match grad_weight {
                None => grad_w,
                Some(mut sum) => {
                    sum += grad_w;
                    sum
                }
            });
        }
        let count = shift.f_ne(IGNORE_INDEX).and_then(|m| m.f_sum(None)).map_err(e())?;
        Ok(ChunkGrads {
            total,
            grad_hidden,
            grad_weight: grad_weight.expect("at least one chunk"),
            count,
        })
    }
}
