//! The loss of a micro-step: the loss head on a leaf of the last block's output (and on
//! readers' aliases of the earlier outputs it reads, a program with several outputs), scaled for
//! accumulation (and fp16 loss scaling), and its backward, which leaves the gradient of that
//! output for the blocks' backward (and theirs on their leaves).

use ckptune_kernels::autocast::AutocastGuard;
use ckptune_kernels::autograd;
use ckptune_models::Batch;
use tch::Tensor;

use super::boundary::boundary_leaf;
use super::forward::Activations;
use super::scope::{self, Phase};
use super::session::{chunks_refused, Session};
use super::trace::MicroTrace;
use crate::config::Precision;
use crate::error::{torch, Result, RuntimeError};

/// What the loss leaves: its value, the loss tensor and the engine's seed (both alive until
/// the micro-step ends, as the `loss` variable of a PyTorch loop is while `loss.backward()`
/// runs), and the gradient of the last block's output.
pub(super) struct LossStep {
    pub value: f64,
    pub var: Tensor,
    pub seed: Tensor,
    pub grad: Tensor,
}

impl Session {
    /// `held` is the region a loop that keeps autocast's cache on opened around the forward
    /// ([`Session::cast_region`]): it closes once the scaled loss exists, as
    /// `with torch.autocast(...): loss = loss_fn(model(x), y) / grad_accum` ends there, freeing
    /// the casts only the cache held before backward starts.
    pub(super) fn loss(
        &self,
        acts: &mut Activations,
        batch: &Batch,
        held: Option<AutocastGuard>,
        mut tr: Option<&mut MicroTrace>,
    ) -> Result<LossStep> {
        let n = self.chain.blocks.len();
        let last = acts.outputs[n - 1].as_ref().expect("the last output is kept");
        if self.cfg.loss_chunks > 1 {
            let head = self
                .chain
                .head
                .causal_lm()
                .ok_or_else(|| chunks_refused(&self.cfg, &self.chain))?;
            return self.chunked_loss(head, last, batch, held, tr);
        }
        let y = boundary_leaf(last);
        // Earlier outputs the loss reads (a program with several outputs) through aliases
        // feeding the sinks their other readers feed, so that the loss's gradient accumulates
        // with theirs.
        let reads: Vec<Tensor> = (self.chain.head.all_reads().into_iter())
            .map(|r| self.read_leaf(acts, r))
            .collect::<Result<_>>()?;
        if let Some(t) = tr.as_deref_mut() {
            t.loss_before = self.probe.current();
            self.probe.reset_window();
        }
        let (value, var, seed) = {
            let _scope = scope::open(Phase::Loss, None)?;
            let loss = {
                let _ac = self.autocast_region()?;
                self.chain.head.loss_over(&y, &reads, batch)
            };
            drop(reads);
            let (value, scaled) = self.scaled(loss);
            let seed = self.seed_after_forward(&scaled, held, tr.as_deref_mut())?;
            autograd::backward(scaled.shallow_clone(), seed.shallow_clone())?;
            // Detached: its storage only. Its graph would hold the last block's output leaf,
            // which eager PyTorch (no boundaries) does not have.
            (value, scaled.detach(), seed)
        };
        self.check_loss_value(value)?;
        let grad = y.grad();
        drop(y);
        if let Some(t) = tr {
            t.loss_bwd_peak = self.probe.window_peak();
            t.loss_peak = t.loss_fwd_peak.max(t.loss_bwd_peak);
            t.loss_after = self.probe.current();
        }
        Ok(LossStep { value, var, seed, grad })
    }

    /// The loop's autocast region, for the precisions that use one.
    pub(super) fn autocast_region(&self) -> Result<Option<AutocastGuard>> {
        Ok(self
            .cfg
            .precision
            .autocast()
            .map(|k| AutocastGuard::new(self.device, k, true))
            .transpose()?)
    }

    /// The loss's value (none for a fake loss) and the loss scaled for accumulation and fp16
    /// loss scaling, made inside the loop's autocast region.
    pub(super) fn scaled(&self, loss: Tensor) -> (f64, Tensor) {
        let value = if self.is_fake() {
            f64::NAN
        } else {
            loss.double_value(&[])
        };
        let scale = self.loss_scale() / self.cfg.grad_accum as f64;
        let scaled = if scale == 1.0 { loss } else { loss * scale };
        (value, scaled)
    }

    /// The end of the loss's forward moment and the start of its backward: the forward's peak
    /// recorded, `held` (the region holding autocast's cache) closed, freeing the casts only the
    /// cache held, and the seed `loss.backward()` gives the engine, `ones_like(loss)`, alive
    /// until the whole backward returns.
    pub(super) fn seed_after_forward(
        &self,
        scaled: &Tensor,
        held: Option<AutocastGuard>,
        mut tr: Option<&mut MicroTrace>,
    ) -> Result<Tensor> {
        if let Some(t) = tr.as_deref_mut() {
            t.loss_fwd_peak = self.probe.window_peak();
            t.casts_held = held.is_some();
        }
        drop(held);
        if tr.is_some() {
            self.probe.reset_window();
        }
        let seed = scaled.f_ones_like().map_err(torch("loss backward"))?;
        if let Some(t) = tr {
            t.loss_seeded = self.probe.current();
        }
        Ok(seed)
    }

    /// A loss that is not finite means training diverged (fp16 skips such steps instead).
    pub(super) fn check_loss_value(&self, value: f64) -> Result<()> {
        if !value.is_finite() && self.cfg.precision != Precision::Fp16 && !self.is_fake() {
            return Err(RuntimeError::Invalid(format!(
                "loss is {value} in {} for model {}: training diverged (lower the learning rate)",
                self.cfg.label(),
                self.chain.name
            )));
        }
        Ok(())
    }
}
