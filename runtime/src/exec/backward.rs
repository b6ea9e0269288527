//! The backward pass of a micro-step, last block first: a checkpointed segment is recomputed
//! from its input (block by block, with the RNG state of its forward and its buffers restored
//! afterwards), then every block's VJP runs from its output's gradient edge and gradient to its
//! input's sink, whose gradient — complete once every reader ran — is the previous block's
//! output gradient.

use std::time::Instant;

use ckptune_kernels::autocast::AutocastGuard;
use ckptune_kernels::sink::{backward_edges, output_edge, GradSink, OutputEdge};
use ckptune_kernels::{rng, sac};
use ckptune_models::{Batch, Ctx};
use tch::Tensor;

use super::boundary::{block_input, release_output};
use super::forward::Activations;
use super::schedule::Schedule;
use super::scope::{self, Phase};
use super::session::{nbytes, Session};
use super::trace::MicroTrace;
use crate::error::{Result, RuntimeError};

impl Session {
    /// Runs every block's backward from `grad`, the gradient of the last block's output, and
    /// returns the gradient left at the batch (undefined: the batch needs none).
    pub(super) fn backward(
        &mut self,
        acts: &mut Activations,
        mut grad: Tensor,
        batch: &Batch,
        ctx: &Ctx<'_>,
        schedule: &Schedule,
        mut tr: Option<&mut MicroTrace>,
    ) -> Result<Tensor> {
        // The RNG state of the checkpointed segment being differentiated: kept until the
        // segment's backward is done, as `torch.utils.checkpoint` keeps it.
        let mut segment_rng: Option<(usize, Tensor)> = None;
        let mut next = self.chain.blocks.len();
        // The loss was the last reader of the last block's further outputs.
        acts.extra_grads[next - 1] = further_grads(acts, next - 1);
        while next > 0 {
            let i = next - 1;
            // A fused group is one VJP, from its last block's output to its input's sink.
            let start = schedule.fused[i].map_or(i, |(first, _)| first);
            next = start;
            if let Some((first, last)) = schedule.segments[i].filter(|&(_, last)| last == i) {
                segment_rng = Some(self.recompute_segment((first, last), acts, batch, ctx, tr.as_deref_mut())?);
            }
            if let Some(ib) = &self.in_backward {
                ib.blocks_running(start, i);
            }
            grad = self
                .block_backward((start, i), grad, acts, schedule, &mut segment_rng, tr.as_deref_mut())
                .map_err(|e| self.backward_failed((start, i), acts, batch, ctx, e))?;
        }
        Ok(grad)
    }

    /// Recomputes the checkpointed segment `first..=last` with grad from its input, in the RNG
    /// state of its forward, each block in its own autocast region; returns that RNG state,
    /// which stays alive until the segment's backward is done. The numbers the segment's forward
    /// kept go once its last block is recomputed, as `torch.utils.checkpoint` frees the
    /// recompute's own graph, which holds the same numbers, before the backward goes on.
    fn recompute_segment(
        &mut self,
        (first, last): (usize, usize),
        acts: &mut Activations,
        batch: &Batch,
        ctx: &Ctx<'_>,
        mut tr: Option<&mut MicroTrace>,
    ) -> Result<(usize, Tensor)> {
        // The stored no-grad output is dead: the recompute produces it again.
        let before = tr.as_ref().map(|_| self.probe.current());
        acts.outputs[last] = None;
        acts.extras[last].clear();
        if let (Some(t), Some(before)) = (tr.as_deref_mut(), before) {
            t.blocks[last].ckpt_out_released = before - self.probe.current();
        }
        // The first recompute's window opens here: swapping the RNG state holds two states at
        // once and the buffer snapshot is allocated, and every allocation of the step must fall
        // inside some moment's window, or the step's peak could sit in a gap no moment reports
        // (on AVX2 CPUs it does, for a checkpointed pooler).
        let prelude = Instant::now();
        if let Some(t) = tr.as_deref_mut() {
            t.blocks[first].rec_before = self.probe.current();
            self.probe.reset_window();
        }
        let saved_rng = acts.rng_states[first]
            .take()
            .expect("rng state of a checkpointed segment");
        let current_rng = rng::cpu_state()?;
        rng::set_cpu_state(&saved_rng)?;
        // The forward's RNG state stays alive until the segment's backward is done, as
        // `torch.utils.checkpoint` keeps it (its recompute closure holds it while the
        // checkpointed graph lives): two states are alive during the recompute.
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
            let x = block_input(k, &batch.input, &acts.outputs, &mut acts.sinks)?;
            let skips: Vec<Tensor> = block
                .skip_reads()
                .map(|r| self.read_leaf(acts, r))
                .collect::<Result<_>>()?;
            // A selective block's recompute takes the outputs its forward kept.
            let mut kept = acts.sac[k].take();
            let out = {
                let _scope = scope::open(Phase::Recompute, Some((k, &block.name)))?;
                let _ac = self
                    .cfg
                    .precision
                    .autocast()
                    .map(|a| AutocastGuard::new(self.device, a, true))
                    .transpose()?;
                let _replay = kept.as_mut().map(sac::replay).transpose()?;
                let numbers = self.open_numbers(k, true)?;
                let out = block.block.try_forward_all(&x, &ctx.with_skips(&skips));
                self.close_numbers(k, numbers);
                out
            }
            .map_err(|failure| self.block_failed(k, failure))?;
            let (out, extras) = out;
            if let Some(left) = kept.as_ref().map(|c| c.left()).filter(|&n| n != 0) {
                return Err(RuntimeError::Invalid(format!(
                    "selective block {} of {}: its recompute used {left} fewer saved outputs than its forward kept \
                     (the block computes differently under no-grad and with grad)",
                    block.name, self.chain.name
                )));
            }
            self.learn_output_saved(k, &out);
            drop((x, skips, kept));
            self.learn_input_saved(k, &acts.outputs, &acts.sac_keeps_output);
            acts.outputs[k] = Some(out);
            acts.extras[k] = extras.into_iter().map(Some).collect();
            if k == last {
                acts.numbers[first..=last].iter_mut().for_each(Vec::clear);
            }
            if let Some(t) = tr.as_deref_mut() {
                let b = &mut t.blocks[k];
                b.rec_peak = self.probe.window_peak();
                b.rec_after = self.probe.current();
                b.rec_seconds = t0.elapsed().as_secs_f64();
            }
        }
        // Swap the snapshot in as the buffers' storage instead of copying it back: the
        // recompute's graph saved these buffers (batch_norm's backward takes the running
        // statistics), and an in-place copy would bump their version counter and fail that
        // backward. Training-mode backward never reads them, so the swap is safe.
        for (bs, ss) in self.buffers[first..=last].iter().zip(snapshot) {
            for (b, s) in bs.iter().zip(ss) {
                b.shallow_clone().set_data(&s);
            }
        }
        rng::set_cpu_state(&current_rng)?;
        Ok((first, saved_rng))
    }

    /// The VJP of block `i` (of the fused run `start..=i` when `start < i`) from its output's
    /// gradient edge and `grad`; returns the gradient of its input, taken from the input's sink
    /// once every reader of that input has run its backward. The segment's RNG state goes when
    /// its first block's backward is done, inside this block's window.
    fn block_backward(
        &mut self,
        (start, i): (usize, usize),
        grad: Tensor,
        acts: &mut Activations,
        schedule: &Schedule,
        segment_rng: &mut Option<(usize, Tensor)>,
        mut tr: Option<&mut MicroTrace>,
    ) -> Result<Tensor> {
        let block = &self.chain.blocks[i];
        let t0 = Instant::now();
        if let Some(t) = tr.as_deref_mut() {
            t.blocks[i].bwd_before = self.probe.current();
            self.probe.reset_window();
        }
        let vjp = scope::open(Phase::Backward, Some((i, &block.name)))?;
        // The output (if the runtime still holds it) goes here, its edge kept.
        release_output(i, &mut acts.outputs, &mut acts.edges)?;
        let roots = vjp_roots(acts.edges[i].take(), grad, further_roots(acts, i)?).map_err(|()| {
            RuntimeError::Invalid(format!(
                "block {} of {}: no gradient reached its output",
                block.name, self.chain.name
            ))
        })?;
        let sink: Option<GradSink> = if start > 0 { acts.sinks[start - 1].take() } else { None };
        if !roots.is_empty() {
            // One backward from every output, the input's pending gradient (later readers')
            // fed in first, as one fused graph sums it.
            backward_edges(roots, &sink.iter().collect::<Vec<_>>())?;
            if let (Some(t), Some(begun)) = (tr.as_deref_mut(), self.probe.backward_start()) {
                t.blocks[i].out_released = t.blocks[i].bwd_before - begun;
            }
        }
        // Every reader of the input has now run its backward: its sink's gradient is complete
        // and is the previous block's output gradient.
        let grad_in = match sink {
            Some(sink) => sink.take_grad()?,
            None => Tensor::new(),
        };
        if start > 0 {
            acts.extra_grads[start - 1] = further_grads(acts, start - 1);
            // A checkpointed only reader kept its input until now, for its recompute.
            if self.releasable(start - 1, schedule) {
                release_output(start - 1, &mut acts.outputs, &mut acts.edges)?;
            }
        }
        if segment_rng.as_ref().is_some_and(|(first, _)| start <= *first) {
            drop(segment_rng.take());
        }
        drop(vjp);
        if let Some(t) = tr {
            let b = &mut t.blocks[i];
            b.bwd_peak = self.probe.window_peak();
            b.bwd_after = self.probe.current();
            b.bwd_seconds = t0.elapsed().as_secs_f64();
            b.grad_in_bytes = nbytes(&grad_in);
        }
        Ok(grad_in)
    }
}

/// The roots of a block's backward: its output's edge with `grad` (none when the output needs no
/// gradient), then its further outputs'. `Err` when the output needs one and none reached it.
fn vjp_roots(
    edge: Option<OutputEdge>,
    grad: Tensor,
    further: Vec<(OutputEdge, Tensor)>,
) -> std::result::Result<Vec<(OutputEdge, Tensor)>, ()> {
    let mut roots = Vec::with_capacity(further.len() + 1);
    match edge {
        Some(e) if grad.defined() => roots.push((e, grad)),
        // A block that hands on several tensors runs from those that got a gradient.
        Some(_) if !further.is_empty() => {}
        Some(_) => return Err(()),
        None => {}
    }
    roots.extend(further);
    Ok(roots)
}

/// The gradients of block `k`'s further outputs, taken off their leaves once every reader's
/// backward ran (undefined for one no reader differentiated), the leaves dropped.
fn further_grads(acts: &mut Activations, k: usize) -> Vec<Tensor> {
    std::mem::take(&mut acts.extra_leaves[k])
        .into_iter()
        .map(|l| l.map_or_else(Tensor::new, |l| l.grad()))
        .collect()
}

/// Block `i`'s further outputs that take part in its backward, each as its gradient edge with
/// its gradient (those without one are dropped here).
fn further_roots(acts: &mut Activations, i: usize) -> Result<Vec<(OutputEdge, Tensor)>> {
    let mut grads = std::mem::take(&mut acts.extra_grads[i]).into_iter();
    std::mem::take(&mut acts.extras[i])
        .into_iter()
        .filter_map(|e| {
            let g = grads.next().unwrap_or_default();
            e.filter(|e| e.requires_grad() && g.defined()).map(|e| (e, g))
        })
        .map(|(e, g)| Ok((output_edge(e)?, g)))
        .collect()
}
