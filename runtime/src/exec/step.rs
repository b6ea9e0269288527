//! One training step: each micro-step's forward, loss and backward (the loop of
//! docs/memory-model.md, variable lifetimes included), then the optimizer.

use std::time::Instant;

use ckptune_kernels::optrace::{self, OpEvent};
use ckptune_models::{Batch, Ctx};
use tch::Tensor;

use super::in_backward;
use super::schedule::Schedule;
use super::scope::{self, Phase};
use super::session::Session;
use super::trace::{BlockTrace, MicroTrace, StepReport, StepTrace};
use crate::config::Precision;
use crate::error::{Result, RuntimeError};
use crate::load::CpuCounters;
use crate::optim;

impl Session {
    /// The operators of one step with the blocks flagged in `checkpoint` checkpointed (after an
    /// untraced step, so that lazily made state, the optimizer's among it, already exists).
    pub fn op_trace(&mut self, checkpoint: &[bool]) -> Result<Vec<OpEvent>> {
        self.step(checkpoint, None)?;
        optrace::start()?;
        let stepped = self.step(checkpoint, None);
        let events = optrace::stop()?;
        stepped.map(|_| events)
    }

    /// Runs one training step (all micro-steps, then the optimizer and `zero_grad`) with the
    /// blocks flagged in `checkpoint` checkpointed. With `trace`, records the meter.
    pub fn step(&mut self, checkpoint: &[bool], trace: Option<&mut StepTrace>) -> Result<StepReport> {
        let fake = self.is_fake();
        self.step_unchecked(checkpoint, trace)
            .map_err(|e| if fake { e.on_meta() } else { e })
    }

    fn step_unchecked(&mut self, checkpoint: &[bool], mut trace: Option<&mut StepTrace>) -> Result<StepReport> {
        self.check_mask(checkpoint)?;
        self.sync();
        self.probe.reset_step();
        let start_level = self.probe.current();
        let cpu0 = CpuCounters::read();
        let t0 = Instant::now();
        if let Some(t) = trace.as_deref_mut() {
            *t = StepTrace::default();
        }
        // The training loop this models (`docs/memory-model.md`): a micro-batch and its loss
        // are released after its backward, except the last micro-step's, which stay alive
        // through `opt.step()` and `zero_grad()`, as the variables of
        //     for x, y in loader: loss = f(model(x), y); loss.backward(); [opt.step(); opt.zero_grad()]; del x, y, loss
        // do; they are released at the end of the step.
        let mut loss_sum = 0.0;
        let mut last = None;
        for k in 0..self.cfg.grad_accum {
            let batch = self.make_batch();
            let mut micro = trace.as_ref().map(|_| MicroTrace::default());
            let (value, loss) = self.micro_step_keeping_loss(&batch, checkpoint, micro.as_mut())?;
            loss_sum += value;
            if k + 1 == self.cfg.grad_accum {
                last = Some((batch, loss));
            } else {
                drop((batch, loss));
            }
            if let (Some(t), Some(m)) = (trace.as_deref_mut(), micro) {
                t.micro.push(m);
            }
        }
        let applied = self.optimizer_step(trace)?;
        drop(last);
        self.sync();
        let seconds = t0.elapsed().as_secs_f64();
        let threads = usize::try_from(tch::get_num_threads()).unwrap_or(1);
        let load = cpu0.zip(CpuCounters::read()).map(|(a, b)| a.until(&b, threads));
        Ok(StepReport {
            loss: loss_sum / self.cfg.grad_accum as f64,
            seconds,
            applied,
            peak_bytes: self.probe.step_peak(),
            reserved_peak_bytes: self.probe.step_reserved_peak(),
            start_bytes: start_level,
            load,
        })
    }

    /// Runs forward and backward of one micro-batch, accumulating parameter gradients, and
    /// returns its (unscaled) loss. The building block of [`Session::step`]; the profiler also
    /// calls it on its own to measure the accumulation regime.
    ///
    /// `checkpoint` has one entry per block, then one per group ([`ckptune_models::Chain::units`]). A
    /// checkpointed segment (a block, or a group's run of blocks) runs forward under no-grad
    /// and keeps only its last output; inside it, an output is dropped as soon as the last
    /// block of the segment that reads it has run, as a PyTorch module's locals are. In
    /// backward the whole segment is recomputed from its input, block by block with detached
    /// boundaries, then differentiated block by block like a plain run.
    pub fn micro_step(&mut self, batch: &Batch, checkpoint: &[bool], tr: Option<&mut MicroTrace>) -> Result<f64> {
        let fake = self.is_fake();
        match self.micro_step_keeping_loss(batch, checkpoint, tr) {
            Ok((value, _)) => Ok(value),
            Err(e) if fake => Err(e.on_meta()),
            Err(e) => Err(e),
        }
    }

    /// [`Session::micro_step`], also handing back the loss tensor backward ran from, for a
    /// caller that keeps it alive longer (the last micro-step's, through the optimizer step).
    fn micro_step_keeping_loss(
        &mut self,
        batch: &Batch,
        checkpoint: &[bool],
        mut tr: Option<&mut MicroTrace>,
    ) -> Result<(f64, Tensor)> {
        self.check_mask(checkpoint)?;
        let mask = batch.attention_mask.as_ref().map(|m| self.chain.attention_bias(m));
        // What the model computes once for all its blocks (Llama's rotary pair and causal
        // mask), held with the bias until the micro-step's backward is done.
        let shared = self.chain.shared_inputs(&batch.input, mask.as_ref(), batch.padded);
        // The raw mask too: an exported program computes its own bias from it; SDPA asks
        // whether it pads.
        let ctx = Ctx::new(mask.as_ref(), true)
            .with_batch_mask(batch.attention_mask.as_ref(), batch.padded)
            .with_batch_input(&batch.input)
            .with_shared(&shared);
        if let Some(t) = tr.as_deref_mut() {
            t.start = self.probe.current();
            t.blocks = vec![BlockTrace::default(); self.chain.blocks.len()];
        }
        let schedule = Schedule::new(&self.chain, checkpoint, self.fuse_groups, &self.selective);
        let held = self.cast_region()?;
        let mut acts = self.forward(batch, &ctx, &schedule, tr.as_deref_mut())?;
        let (value, var, seed) = self.stepping_in_backward(|s| {
            if let Some(ib) = &s.in_backward {
                ib.loss_running();
            }
            let loss = s.loss(&mut acts, batch, held, tr.as_deref_mut())?;
            let grad = s.backward(&mut acts, loss.grad, batch, &ctx, &schedule, tr.as_deref_mut())?;
            drop(grad);
            Ok((loss.value, loss.var, loss.seed))
        })?;
        drop((mask, shared));
        if let Some(t) = tr.as_deref_mut() {
            t.bwd_end = self.probe.current();
        }
        drop(seed);
        if let Some(t) = tr {
            t.end = self.probe.current();
        }
        Ok((value, var))
    }

    /// Optimizer step and `zero_grad`. For fp16, unscales the gradients and skips the step on
    /// inf/nan (dynamic loss scaling: halve on overflow, double every 2000 good steps is
    /// PyTorch's GradScaler; here: halve on overflow, grow ×2 after each good step capped at
    /// 2^16, which converges to the same band).
    pub fn optimizer_step(&mut self, mut tr: Option<&mut StepTrace>) -> Result<bool> {
        let t0 = Instant::now();
        if let Some(t) = tr.as_deref_mut() {
            t.opt_before = self.probe.current();
            self.probe.reset_window();
        }
        let scope = scope::open(Phase::Optimizer, None)?;
        let mut applied = true;
        if self.cfg.precision == Precision::Fp16 {
            let inv = 1.0 / self.scale;
            let mut finite = true;
            // Fake gradients have no values: a fake step allocates what the check allocates and
            // takes the step as applied.
            let fake = self.is_fake();
            tch::no_grad(|| {
                for p in self.opt.params() {
                    let g = p.grad();
                    if g.defined() {
                        let _ = g.shallow_clone().f_mul_scalar_(inv);
                        let all = g.isfinite().all();
                        finite &= fake || all.int64_value(&[]) == 1;
                    }
                }
            });
            if finite {
                self.scale = (self.scale * 2.0).min(65536.0);
            } else {
                self.scale /= 2.0;
                applied = false;
            }
        }
        if self.in_backward.is_some() {
            // Every parameter stepped in its hook during backward.
            self.check_stepped_in_backward()?;
        } else if applied {
            self.opt.step()?;
        }
        self.opt.zero_grad(self.cfg.set_to_none)?;
        drop(scope);
        if let Some(t) = tr {
            t.opt_peak = self.probe.window_peak();
            t.opt_after = self.probe.current();
            t.opt_seconds = t0.elapsed().as_secs_f64();
        }
        Ok(applied)
    }

    /// Runs `f` (a micro-step's loss and backward) with the parameters' hooks stepping the
    /// optimizer, when the config steps it in backward (`in_backward`); otherwise just `f`.
    fn stepping_in_backward<R>(&mut self, f: impl FnOnce(&mut Session) -> Result<R>) -> Result<R> {
        let Some(ib) = self.in_backward.clone() else {
            return f(self);
        };
        // The hooks own the optimizer while backward runs; `f` has the session.
        let mut opt = std::mem::replace(&mut self.opt, optim::placeholder());
        let (out, failed) = ib.stepping(opt.as_mut(), || f(self));
        self.opt = opt;
        match failed {
            Some(why) => Err(RuntimeError::Invalid(format!(
                "model {}: the optimizer step in backward failed: {why}",
                self.chain.name
            ))),
            None => out,
        }
    }

    /// After a step in backward, that every gradient was stepped and freed.
    fn check_stepped_in_backward(&self) -> Result<()> {
        match in_backward::unstepped(&self.chain, self.opt.as_ref()) {
            None => Ok(()),
            Some(name) => Err(RuntimeError::Config(format!(
                "model {}: parameter {name} still has its gradient after backward: a block other than its owner \
                 adds to it after the owner's backward, so the optimizer step in backward cannot run on this \
                 model; step after backward instead",
                self.chain.name
            ))),
        }
    }
}
