//! The loss of a micro-step: the loss head on a leaf of the last block's output, scaled for
//! accumulation (and fp16 loss scaling), and its backward, which leaves the gradient of that
//! output for the blocks' backward.

use ckptune_kernels::autocast::AutocastGuard;
use ckptune_kernels::autograd;
use ckptune_models::Batch;
use tch::Tensor;

use super::forward::Activations;
use super::scope::{self, Phase};
use super::session::Session;
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
        acts: &Activations,
        batch: &Batch,
        held: Option<AutocastGuard>,
        mut tr: Option<&mut MicroTrace>,
    ) -> Result<LossStep> {
        let n = self.chain.blocks.len();
        let y = acts.outputs[n - 1]
            .as_ref()
            .expect("the last output is kept")
            .detach()
            .set_requires_grad(true);
        if let Some(t) = tr.as_deref_mut() {
            t.loss_before = self.probe.current();
            self.probe.reset_window();
        }
        let (value, var, seed) = {
            let _scope = scope::open(Phase::Loss, None)?;
            let loss = {
                let _ac = self
                    .cfg
                    .precision
                    .autocast()
                    .map(|k| AutocastGuard::new(self.device, k, true))
                    .transpose()?;
                self.chain.head.loss(&y, batch)
            };
            // A fake loss has no value.
            let value = if self.is_fake() {
                f64::NAN
            } else {
                loss.double_value(&[])
            };
            let scale = self.loss_scale() / self.cfg.grad_accum as f64;
            let scaled = if scale == 1.0 { loss } else { loss * scale };
            if let Some(t) = tr.as_deref_mut() {
                t.loss_fwd_peak = self.probe.window_peak();
                t.casts_held = held.is_some();
            }
            drop(held);
            if tr.is_some() {
                self.probe.reset_window();
            }
            // `loss.backward()` seeds the engine with `ones_like(loss)`, alive until the whole
            // backward returns.
            let seed = scaled.f_ones_like().map_err(torch("loss backward"))?;
            if let Some(t) = tr.as_deref_mut() {
                t.loss_seeded = self.probe.current();
            }
            autograd::backward(scaled.shallow_clone(), seed.shallow_clone())?;
            // Detached: its storage only. Its graph would hold the last block's output leaf,
            // which eager PyTorch (no boundaries) does not have.
            (value, scaled.detach(), seed)
        };
        if !value.is_finite() && self.cfg.precision != Precision::Fp16 && !self.is_fake() {
            return Err(RuntimeError::Invalid(format!(
                "loss is {value} in {} for model {}: training diverged (lower the learning rate)",
                self.cfg.label(),
                self.chain.name
            )));
        }
        let grad = y.grad();
        drop(y);
        if let Some(t) = tr {
            t.loss_bwd_peak = self.probe.window_peak();
            t.loss_peak = t.loss_fwd_peak.max(t.loss_bwd_peak);
            t.loss_after = self.probe.current();
        }
        Ok(LossStep { value, var, seed, grad })
    }
}
