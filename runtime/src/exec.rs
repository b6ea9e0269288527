//! Checkpointed execution of a chain: one training step with any set of blocks checkpointed.
//!
//! The scheme (docs/memory-model.md, "The execution scheme the model assumes"):
//! - every block boundary is `h.detach().set_requires_grad(true)`, a leaf sharing storage with
//!   the producer's output, so each block's backward is a separate graph run from its output;
//! - a checkpointed block runs forward under no-grad, keeping only its output (its input is
//!   the previous block's output, already kept); in backward it is recomputed with grad from
//!   its input leaf, with the RNG state of its forward (dropout replays bitwise) and inside
//!   its own autocast region;
//! - backward runs block by block, last to first, through the shim's VJP, which consumes the
//!   output and its gradient so neither outlives its use; the input leaf's `.grad` becomes the
//!   previous block's output gradient and the leaf is dropped at once;
//! - each block's forward runs in its own autocast region: the region's cache of bf16 weight
//!   casts then lives for one block, not for the whole forward (same results bitwise, since a
//!   cast is deterministic, and less memory than one region around the model);
//! - BatchNorm running statistics are snapshotted before a recompute and restored after it, so
//!   a checkpointed step leaves the model in exactly the state a plain step does
//!   (`torch.utils.checkpoint` instead updates them twice).
//!
//! An instrumented step records the memory meter at each moment into a [`StepTrace`]; reading
//! the meter allocates nothing, so an instrumented step allocates exactly what a plain one does.

use std::time::Instant;

use ckptune_kernels::{autocast::AutocastGuard, autograd, rng};
use ckptune_models::{Batch, Chain, Ctx};
use ckptune_solver::names::closest;
use ckptune_solver::regex_emit::MATCH_NOTHING;
use tch::{Device, Kind, Tensor};

use crate::config::{Precision, TrainConfig};
use crate::error::{torch, Result, RuntimeError};
use crate::load::{CpuCounters, Load};
use crate::memory::Probe;
use crate::optim::{self, Optimizer};

/// Meter readings around one block in one micro-step (bytes; levels are absolute).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BlockTrace {
    pub checkpointed: bool,
    /// Ran inside a fused group (one graph, no boundaries inside; see [`Session::fuse_groups`]).
    /// The group's single backward is recorded on its last block.
    pub fused: bool,
    /// Level before the block's forward, highest level during it, level after it (autocast
    /// region closed).
    pub fwd_before: i64,
    pub fwd_peak: i64,
    pub fwd_after: i64,
    pub fwd_seconds: f64,
    /// Checkpointed blocks: level at the recompute's start (for a segment's first block, once
    /// the stored output is dropped and before the RNG swap and buffer snapshot, which its
    /// window covers), highest level during recompute, level after it.
    pub rec_before: i64,
    pub rec_peak: i64,
    pub rec_after: i64,
    pub rec_seconds: f64,
    /// Level when the block's VJP starts, highest level during it, level once the input leaf
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
    pub loss_peak: i64,
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
    /// CPU the rest of the machine took while the step ran (`None` where it cannot be read).
    pub load: Option<Load>,
}

/// A chain prepared for training under one config.
pub struct Session {
    pub chain: Chain,
    pub cfg: TrainConfig,
    pub device: Device,
    opt: Box<dyn Optimizer>,
    /// Per block: its buffers (BatchNorm statistics), restored after a recompute.
    buffers: Vec<Vec<Tensor>>,
    /// fp16 dynamic loss scale.
    scale: f64,
    /// Seed of the next batch, so runs are reproducible.
    next_seed: i64,
    probe: Probe,
    /// Run a group none of whose units is checkpointed as one graph, without boundaries inside
    /// (what PyTorch does with the module: an output no later op saved dies with the module's
    /// locals, where a boundary would keep it until backward). On by default; the profiler
    /// turns it off once to measure the blocks' own terms.
    pub fuse_groups: bool,
}

/// Bytes of a tensor's elements.
pub fn nbytes(t: &Tensor) -> i64 {
    if !t.defined() {
        return 0;
    }
    t.numel() as i64 * t.kind().elt_size_in_bytes() as i64
}

impl Session {
    pub fn new(mut chain: Chain, cfg: TrainConfig, device: Device) -> Result<Self> {
        cfg.validate(device)?;
        chain
            .validate()
            .map_err(|e| RuntimeError::Invalid(format!("model {}: {e}", chain.name)))?;
        if cfg.precision == Precision::Bf16Pure {
            chain.vs.bfloat16();
        }
        let vars = chain.vs.variables();
        let buffers = chain
            .blocks
            .iter()
            .map(|b| {
                let prefixes: Vec<String> = b.name.split('+').map(|n| format!("{n}.")).collect();
                let mut names: Vec<&String> = vars
                    .iter()
                    .filter(|(n, t)| !t.requires_grad() && prefixes.iter().any(|p| n.starts_with(p)))
                    .map(|(n, _)| n)
                    .collect();
                names.sort();
                names.into_iter().map(|n| vars[n].shallow_clone()).collect()
            })
            .collect();
        let opt = optim::build(
            cfg.optimizer,
            cfg.optimizer_impl,
            chain.vs.trainable_variables(),
            cfg.lr,
        );
        let probe = Probe::new(device)?;
        Ok(Self {
            chain,
            cfg,
            device,
            opt,
            buffers,
            scale: 65536.0,
            next_seed: 0,
            probe,
            fuse_groups: true,
        })
    }

    /// Bytes of optimizer state now allocated.
    pub fn optimizer_state_bytes(&self) -> i64 {
        self.opt.state_bytes()
    }

    /// Bytes of parameters and of buffers.
    pub fn param_and_buffer_bytes(&self) -> (i64, i64) {
        let mut p = 0;
        let mut b = 0;
        for t in self.chain.vs.variables().values() {
            if t.requires_grad() {
                p += nbytes(t);
            } else {
                b += nbytes(t);
            }
        }
        (p, b)
    }

    /// Bytes of parameter gradients now allocated.
    pub fn grad_bytes(&self) -> i64 {
        self.opt.params().iter().map(|p| nbytes(&p.grad())).sum()
    }

    /// Which blocks a regex selects: it must match (the whole name, as Python's `re.fullmatch`
    /// of the emitted anchored regexes) only candidate blocks.
    pub fn select(&self, pattern: &str) -> Result<Vec<bool>> {
        select(&self.chain, pattern)
    }

    /// A fresh batch of the config's micro-batch size.
    pub fn make_batch(&mut self) -> Batch {
        let seed = self.next_seed;
        self.next_seed += 1;
        let mut batch = self.chain.make_batch(self.cfg.micro_batch, self.device, seed);
        if self.cfg.precision == Precision::Bf16Pure && batch.input.is_floating_point() {
            batch.input = batch.input.to_kind(Kind::BFloat16);
        }
        batch
    }

    /// Runs one training step (all micro-steps, then the optimizer and `zero_grad`) with the
    /// blocks flagged in `checkpoint` checkpointed. With `trace`, records the meter.
    pub fn step(&mut self, checkpoint: &[bool], mut trace: Option<&mut StepTrace>) -> Result<StepReport> {
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
            start_bytes: start_level,
            load,
        })
    }

    /// Runs forward and backward of one micro-batch, accumulating parameter gradients, and
    /// returns its (unscaled) loss. The building block of [`Session::step`]; the profiler also
    /// calls it on its own to measure the accumulation regime.
    ///
    /// `checkpoint` has one entry per block, then one per group ([`Chain::units`]). A
    /// checkpointed segment (a block, or a group's run of blocks) runs forward under no-grad
    /// and keeps only its last output; inside it, an output is dropped as soon as the last
    /// block of the segment that reads it has run, as a PyTorch module's locals are. In
    /// backward the whole segment is recomputed from its input, block by block with detached
    /// boundaries, then differentiated block by block like a plain run.
    pub fn micro_step(&mut self, batch: &Batch, checkpoint: &[bool], tr: Option<&mut MicroTrace>) -> Result<f64> {
        Ok(self.micro_step_keeping_loss(batch, checkpoint, tr)?.0)
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
        let n = self.chain.blocks.len();
        let autocast = self.cfg.precision.autocast();
        let device = self.device;
        let mask = match &batch.attention_mask {
            Some(m) => Some(self.chain.attention_bias(m)),
            None => None,
        };
        // The raw mask too: an exported program computes its own bias from it.
        let ctx = Ctx::new(mask.as_ref(), true).with_batch_mask(batch.attention_mask.as_ref());
        if let Some(t) = tr.as_deref_mut() {
            t.start = self.probe.current();
            t.blocks = vec![BlockTrace::default(); n];
        }
        let segments = segments(&self.chain, checkpoint);
        let fused = if self.fuse_groups {
            fused_groups(&self.chain, checkpoint)
        } else {
            vec![None; n]
        };
        // Inside a segment: the block after which each output is dead during the no-grad
        // forward (its last reader within the segment).
        let mut last_reader: Vec<usize> = (0..n).map(|k| k + 1).collect();
        for (i, b) in self.chain.blocks.iter().enumerate() {
            for &s in &b.skips {
                last_reader[s] = last_reader[s].max(i);
            }
        }

        // ---- forward --------------------------------------------------------------------
        // Per block: its output, and the detached leaf of that output (created when the next
        // block starts) that every reader of the output takes as input, so the gradients of
        // all readers accumulate in one `.grad`. Per segment (by first block): the RNG state.
        let mut outputs: Vec<Option<Tensor>> = (0..n).map(|_| None).collect();
        let mut leaves: Vec<Option<Tensor>> = (0..n).map(|_| None).collect();
        let mut rng_states: Vec<Option<Tensor>> = (0..n).map(|_| None).collect();
        for i in 0..n {
            let block = &self.chain.blocks[i];
            let seg = segments[i];
            // Inside a fused group, blocks read the raw outputs of the group's earlier blocks
            // (one graph); everything else reads leaves.
            let inner = |s: usize| fused[i].is_some_and(|(first, _)| s >= first);
            let x = if i > 0 && inner(i - 1) {
                outputs[i - 1]
                    .as_ref()
                    .expect("a fused block's input is alive")
                    .shallow_clone()
            } else {
                self.block_input(i, &batch.input, &outputs, &mut leaves)
            };
            let skips: Vec<Tensor> = block
                .skips
                .iter()
                .map(|&s| {
                    if inner(s) {
                        outputs[s]
                            .as_ref()
                            .expect("a fused block's skip is alive")
                            .shallow_clone()
                    } else {
                        leaf(&leaves, s)
                    }
                })
                .collect();
            let t0 = Instant::now();
            if let Some(t) = tr.as_deref_mut() {
                t.blocks[i].checkpointed = seg.is_some();
                t.blocks[i].fused = fused[i].is_some();
                t.blocks[i].fwd_before = self.probe.current();
                self.probe.reset_window();
            }
            if seg.is_some_and(|(first, _)| first == i) {
                rng_states[i] = Some(rng::cpu_state()?);
            }
            let out = {
                let _ac = autocast.map(|k| AutocastGuard::new(device, k, true)).transpose()?;
                let bctx = ctx.with_skips(&skips);
                if seg.is_some() {
                    tch::no_grad(|| block.block.forward(&x, &bctx))
                } else {
                    block.block.forward(&x, &bctx)
                }
            };
            drop((x, skips));
            outputs[i] = Some(out);
            // Inside a checkpointed or fused run, an output dies after its last reader there
            // (the graph keeps whatever it saved).
            if let Some((first, last)) = seg.or(fused[i]) {
                for k in first..last {
                    if last_reader[k] == i {
                        outputs[k] = None;
                        leaves[k] = None;
                    }
                }
            }
            if let Some(t) = tr.as_deref_mut() {
                let b = &mut t.blocks[i];
                b.fwd_peak = self.probe.window_peak();
                b.fwd_after = self.probe.current();
                b.fwd_seconds = t0.elapsed().as_secs_f64();
            }
        }

        // ---- loss ---------------------------------------------------------------------------
        let y = outputs[n - 1]
            .as_ref()
            .expect("the last output is kept")
            .detach()
            .set_requires_grad(true);
        if let Some(t) = tr.as_deref_mut() {
            t.loss_before = self.probe.current();
            self.probe.reset_window();
        }
        let loss_value = {
            let loss = {
                let _ac = autocast.map(|k| AutocastGuard::new(device, k, true)).transpose()?;
                self.chain.head.loss(&y, batch)
            };
            let value = loss.double_value(&[]);
            let scale = self.loss_scale() / self.cfg.grad_accum as f64;
            let scaled = if scale == 1.0 { loss } else { loss * scale };
            // `loss.backward()` seeds the engine with `ones_like(loss)`, alive until the whole
            // backward returns.
            let seed = scaled.f_ones_like().map_err(torch("loss backward"))?;
            if let Some(t) = tr.as_deref_mut() {
                t.loss_fwd_peak = self.probe.window_peak();
                t.loss_seeded = self.probe.current();
            }
            autograd::backward(scaled.shallow_clone(), seed.shallow_clone())?;
            // Detached: its storage only. Its graph would hold the last block's output leaf,
            // which eager PyTorch (no boundaries) does not have.
            (value, scaled.detach(), seed)
        };
        // The loss's 4 bytes stay alive through the whole backward, as the `loss` variable of
        // a PyTorch loop does while `loss.backward()` runs, and so does the seed.
        let (loss_value, loss_var, seed) = loss_value;
        if !loss_value.is_finite() && self.cfg.precision != Precision::Fp16 {
            return Err(RuntimeError::Invalid(format!(
                "loss is {loss_value} in {} for model {}: training diverged (lower the learning rate)",
                self.cfg.label(),
                self.chain.name
            )));
        }
        let mut grad = y.grad();
        drop(y);
        if let Some(t) = tr.as_deref_mut() {
            t.loss_peak = self.probe.window_peak();
            t.loss_after = self.probe.current();
        }

        // ---- backward, last block first -------------------------------------------------------
        let mut segment_rng: Option<(usize, Tensor)> = None;
        let mut next = n;
        while next > 0 {
            let i = next - 1;
            // A fused group is one VJP, from its last block's output to its input leaf.
            let start = fused[i].map_or(i, |(first, _)| first);
            next = start;
            if let Some((first, last)) = segments[i].filter(|&(_, last)| last == i) {
                // The stored no-grad output is dead: the recompute produces it again.
                let before = tr.as_ref().map(|_| self.probe.current());
                outputs[i] = None;
                if let (Some(t), Some(before)) = (tr.as_deref_mut(), before) {
                    t.blocks[i].ckpt_out_released = before - self.probe.current();
                }
                // The first recompute's window opens here: swapping the RNG state holds two
                // states at once and the buffer snapshot is allocated, and every allocation of
                // the step must fall inside some moment's window, or the step's peak could sit
                // in a gap no moment reports (on AVX2 CPUs it does, for a checkpointed pooler).
                let prelude = Instant::now();
                if let Some(t) = tr.as_deref_mut() {
                    t.blocks[first].rec_before = self.probe.current();
                    self.probe.reset_window();
                }
                let saved_rng = rng_states[first].take().expect("rng state of a checkpointed segment");
                let current_rng = rng::cpu_state()?;
                rng::set_cpu_state(&saved_rng)?;
                // The forward's RNG state stays alive until the segment's backward is done, as
                // `torch.utils.checkpoint` keeps it (its recompute closure holds it while the
                // checkpointed graph lives): two states are alive during the recompute.
                segment_rng = Some((first, saved_rng));
                let snapshot: Vec<Vec<Tensor>> = self.buffers[first..=last]
                    .iter()
                    .map(|bs| bs.iter().map(|b| b.copy()).collect())
                    .collect();
                for k in first..=last {
                    let t0 = if k == first { prelude } else { Instant::now() };
                    if let Some(t) = tr.as_deref_mut().filter(|_| k > first) {
                        t.blocks[k].rec_before = self.probe.current();
                        self.probe.reset_window();
                    }
                    let block = &self.chain.blocks[k];
                    let x = self.block_input(k, &batch.input, &outputs, &mut leaves);
                    let skips: Vec<Tensor> = block.skips.iter().map(|&s| leaf(&leaves, s)).collect();
                    let out = {
                        let _ac = autocast.map(|a| AutocastGuard::new(device, a, true)).transpose()?;
                        block.block.forward(&x, &ctx.with_skips(&skips))
                    };
                    drop((x, skips));
                    outputs[k] = Some(out);
                    if let Some(t) = tr.as_deref_mut() {
                        let b = &mut t.blocks[k];
                        b.rec_peak = self.probe.window_peak();
                        b.rec_after = self.probe.current();
                        b.rec_seconds = t0.elapsed().as_secs_f64();
                    }
                }
                // Swap the snapshot in as the buffers' storage instead of copying it back: the
                // recompute's graph saved these buffers (batch_norm's backward takes the running
                // statistics), and an in-place copy would bump their version counter and fail
                // that backward. Training-mode backward never reads them, so the swap is safe.
                for (bs, ss) in self.buffers[first..=last].iter().zip(snapshot) {
                    for (b, s) in bs.iter().zip(ss) {
                        b.shallow_clone().set_data(&s);
                    }
                }
                rng::set_cpu_state(&current_rng)?;
            }
            let block = &self.chain.blocks[i];
            let out = outputs[i].take().expect("output kept until the block's backward");
            let t0 = Instant::now();
            if let Some(t) = tr.as_deref_mut() {
                t.blocks[i].bwd_before = self.probe.current();
                self.probe.reset_window();
            }
            if out.requires_grad() {
                let g = std::mem::replace(&mut grad, Tensor::new());
                if !g.defined() {
                    return Err(RuntimeError::Invalid(format!(
                        "block {} of {}: no gradient reached its output",
                        block.name, self.chain.name
                    )));
                }
                match (start > 0).then(|| leaves[start - 1].as_ref()).flatten() {
                    Some(x) => autograd::backward_seeded(out, g, x)?,
                    None => autograd::backward(out, g)?,
                }
                if let (Some(t), Some(start)) = (tr.as_deref_mut(), self.probe.backward_start()) {
                    t.blocks[i].out_released = t.blocks[i].bwd_before - start;
                }
            } else {
                drop(out);
            }
            // Every reader of the input has now run its backward: its leaf's gradient is
            // complete and is the previous block's output gradient.
            grad = match (start > 0).then(|| leaves[start - 1].take()).flatten() {
                Some(x) => {
                    let g = x.grad();
                    drop(x);
                    g
                }
                None => Tensor::new(),
            };
            if segment_rng.as_ref().is_some_and(|(first, _)| start <= *first) {
                drop(segment_rng.take());
            }
            let grad_in_bytes = nbytes(&grad);
            if let Some(t) = tr.as_deref_mut() {
                let b = &mut t.blocks[i];
                b.bwd_peak = self.probe.window_peak();
                b.bwd_after = self.probe.current();
                b.bwd_seconds = t0.elapsed().as_secs_f64();
                b.grad_in_bytes = grad_in_bytes;
            }
        }
        drop(grad);
        drop(mask);
        if let Some(t) = tr.as_deref_mut() {
            t.bwd_end = self.probe.current();
        }
        drop(seed);
        if let Some(t) = tr {
            t.end = self.probe.current();
        }
        Ok((loss_value, loss_var))
    }

    /// Block `i`'s input: the batch for the first block, else the leaf of the previous output
    /// (created on first use).
    fn block_input(
        &self,
        i: usize,
        input: &Tensor,
        outputs: &[Option<Tensor>],
        leaves: &mut [Option<Tensor>],
    ) -> Tensor {
        if i == 0 {
            return input.shallow_clone();
        }
        if leaves[i - 1].is_none() {
            let out = outputs[i - 1].as_ref().expect("a block's input is alive when it runs");
            // Inside a layer run as its children the boundary is a view: autocast caches the
            // bf16 cast of a leaf that requires grad (meant for weights) but not of a view, so a
            // child that casts its input more than once (Llama's q/k/v projections, gate and
            // up) makes the casts the fused layer makes, and their gradients are summed as
            // there, in f32. Between layers the boundary is the plain leaf both runs share.
            let detached = out.detach();
            let inside = self.chain.groups.iter().any(|g| g.first < i && i <= g.last);
            let boundary = if inside { detached.view_as(&detached) } else { detached };
            leaves[i - 1] = Some(boundary.set_requires_grad(true));
        }
        leaf(leaves, i - 1)
    }

    fn loss_scale(&self) -> f64 {
        if self.cfg.precision == Precision::Fp16 {
            self.scale
        } else {
            1.0
        }
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
        let mut applied = true;
        if self.cfg.precision == Precision::Fp16 {
            let inv = 1.0 / self.scale;
            let mut finite = true;
            tch::no_grad(|| {
                for p in self.opt.params() {
                    let g = p.grad();
                    if g.defined() {
                        let _ = g.shallow_clone().f_mul_scalar_(inv);
                        finite &= g.isfinite().all().int64_value(&[]) == 1;
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
        if applied {
            self.opt.step()?;
        }
        self.opt.zero_grad(self.cfg.set_to_none)?;
        if let Some(t) = tr {
            t.opt_peak = self.probe.window_peak();
            t.opt_after = self.probe.current();
            t.opt_seconds = t0.elapsed().as_secs_f64();
        }
        Ok(applied)
    }

    fn check_mask(&self, checkpoint: &[bool]) -> Result<()> {
        let chain = &self.chain;
        if checkpoint.len() != chain.units() {
            return Err(RuntimeError::Invalid(format!(
                "checkpoint mask has {} entries but {} has {} blocks and {} groups",
                checkpoint.len(),
                chain.name,
                chain.blocks.len(),
                chain.groups.len()
            )));
        }
        for (i, &c) in checkpoint.iter().enumerate() {
            if c && !chain.unit_candidate(i) {
                return Err(RuntimeError::Invalid(format!(
                    "block {} of {} is not a checkpoint candidate",
                    chain.unit_name(i),
                    chain.name
                )));
            }
        }
        if let Some((g, k)) = chain.nested_conflict(checkpoint) {
            return Err(RuntimeError::Invalid(format!(
                "{} and its child {} of {} are both checkpointed; checkpoint one or the other",
                chain.groups[g].name, chain.blocks[k].name, chain.name
            )));
        }
        Ok(())
    }

    /// Waits for queued device work (CUDA), so wall-clock times are honest.
    pub fn sync(&self) {
        if let Device::Cuda(i) = self.device {
            tch::Cuda::synchronize(i as i64);
        }
    }

    /// All parameters with their names, for comparing runs.
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v: Vec<(String, Tensor)> = self.chain.vs.variables().into_iter().collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Parameter gradients by name (undefined tensors for parameters without one).
    pub fn named_grads(&self) -> Vec<(String, Tensor)> {
        self.named_parameters()
            .into_iter()
            .filter(|(_, t)| t.requires_grad())
            .map(|(n, t)| {
                let g = t.grad();
                (n, if g.defined() { g.copy() } else { g })
            })
            .collect()
    }
}

/// Per block: the group `(first, last)` it runs fused in, if any: a group that is not
/// checkpointed and none of whose blocks is.
fn fused_groups(chain: &Chain, checkpoint: &[bool]) -> Vec<Option<(usize, usize)>> {
    let n = chain.blocks.len();
    let mut out = vec![None; n];
    for (g, grp) in chain.groups.iter().enumerate() {
        if !checkpoint[n + g] && !checkpoint[grp.first..=grp.last].contains(&true) {
            for s in &mut out[grp.first..=grp.last] {
                *s = Some((grp.first, grp.last));
            }
        }
    }
    out
}

/// Per block: the checkpointed segment `(first, last)` it belongs to, if any.
fn segments(chain: &Chain, checkpoint: &[bool]) -> Vec<Option<(usize, usize)>> {
    let n = chain.blocks.len();
    let mut seg: Vec<Option<(usize, usize)>> = (0..n).map(|i| checkpoint[i].then_some((i, i))).collect();
    for (g, grp) in chain.groups.iter().enumerate() {
        if checkpoint[n + g] {
            for s in &mut seg[grp.first..=grp.last] {
                *s = Some((grp.first, grp.last));
            }
        }
    }
    seg
}

/// A handle on leaf `k`, which must exist.
fn leaf(leaves: &[Option<Tensor>], k: usize) -> Tensor {
    leaves[k]
        .as_ref()
        .expect("a leaf is alive while a reader runs")
        .shallow_clone()
}

/// Which blocks and groups of `chain` a checkpoint regex selects, as a mask over
/// [`Chain::units`]. The regex is applied to each name as a full match (Python's
/// `re.fullmatch` of the emitted anchored regexes); a match on a non-candidate block, or on a
/// group and one of its blocks, is an error, since it cannot be honoured.
pub fn select(chain: &Chain, pattern: &str) -> Result<Vec<bool>> {
    let full = format!("^(?:{pattern})$");
    let re = regex::Regex::new(&full).map_err(|e| RuntimeError::Regex {
        pattern: pattern.to_owned(),
        message: e.to_string(),
    })?;
    let mask = (0..chain.units())
        .map(|i| {
            let name = chain.unit_name(i);
            let hit = re.is_match(name);
            if hit && !chain.unit_candidate(i) {
                Err(RuntimeError::NotCandidate {
                    pattern: pattern.to_owned(),
                    name: name.to_owned(),
                    model: chain.name.clone(),
                    candidates: chain.candidates().join(", "),
                })
            } else {
                Ok(hit)
            }
        })
        .collect::<Result<Vec<bool>>>()?;
    if !mask.contains(&true) {
        // A regex naming modules that exist but are not units of this chain (sub-modules at
        // layer granularity) would silently checkpoint nothing, and so would a mistyped one.
        // Only the empty regex and the one plans emit for "checkpoint nothing" say that.
        let modules: Vec<&str> = chain
            .modules
            .iter()
            .filter(|m| re.is_match(m))
            .map(|m| m.as_str())
            .collect();
        if !modules.is_empty() {
            return Err(RuntimeError::Selection(format!(
                "checkpoint regex {pattern:?} matches {} of {}, which this chain does not run as a checkpoint \
                 unit; candidates: {} (--granularity block or nested makes the modules inside layers candidates)",
                modules.join(", "),
                chain.name,
                chain.candidates().join(", ")
            )));
        }
        if !pattern.is_empty() && pattern != MATCH_NOTHING {
            let close = closest(pattern, &chain.modules, 3);
            return Err(RuntimeError::Selection(format!(
                "checkpoint regex {pattern:?} matches no module of {}, so it would checkpoint nothing{}; \
                 candidates: {} (to checkpoint nothing on purpose, pass an empty regex)",
                chain.name,
                if close.is_empty() {
                    String::new()
                } else {
                    format!(" (closest module names: {})", close.join(", "))
                },
                chain.candidates().join(", ")
            )));
        }
    }
    if let Some((g, k)) = chain.nested_conflict(&mask) {
        return Err(RuntimeError::Selection(format!(
            "checkpoint regex {pattern:?} selects both {} and its child {} of {}; a module and its child \
             are never both checkpointed (the child's recompute would run inside the parent's): select one",
            chain.groups[g].name, chain.blocks[k].name, chain.name
        )));
    }
    Ok(mask)
}
