//! The forward pass of a micro-step, block by block: a checkpointed segment runs under no-grad
//! keeping only its last output (and the RNG state at its start), a fused group runs as one
//! graph, every other block reads aliases of the outputs it reads (`boundary`).

use std::time::Instant;

use ckptune_kernels::rng;
use ckptune_kernels::sac::{self, SacCache};
use ckptune_kernels::sink::{storage_shared, GradSink, OutputEdge};
use ckptune_models::{Batch, Ctx};
use tch::Tensor;

use super::boundary::{block_input, further_leaf, reader_alias, release_output};
use super::schedule::Schedule;
use super::scope::{self, Phase};
use super::session::Session;
use super::trace::MicroTrace;
use crate::error::Result;

/// What the forward pass leaves for the loss and the backward pass, per block: its output while
/// the runtime holds it (the last block's is the loss's input; see [`Schedule::single_reader`]
/// for when it lets go), its gradient edge once it let go, the sink its readers' gradients flow
/// into (created when its first reader started), for a segment's first block, the RNG state at
/// its start, for a selective block, the outputs its forward kept for the recompute, and for a
/// checkpointed or selective block, the Python numbers its forward kept (`numbers`). A block
/// that hands on several tensors has its further outputs (slot `s` at index `s - 1`) with their
/// leaves, and once every reader's backward ran, their gradients.
pub(super) struct Activations {
    pub outputs: Vec<Option<Tensor>>,
    pub edges: Vec<Option<OutputEdge>>,
    pub sinks: Vec<Option<GradSink>>,
    pub extras: Vec<Vec<Option<Tensor>>>,
    pub extra_leaves: Vec<Vec<Option<Tensor>>>,
    pub extra_grads: Vec<Vec<Tensor>>,
    pub rng_states: Vec<Option<Tensor>>,
    pub sac: Vec<Option<SacCache>>,
    /// Per block run without grad (checkpointed or selective): the wrapped numbers its forward
    /// kept, which its graph with grad saves; they go when its segment's recompute is done.
    pub numbers: Vec<Vec<Tensor>>,
    /// Per block run selective in this step: whether its cache keeps its output (shared the
    /// output's storage right after its forward, before any reader); false for the others.
    pub sac_keeps_output: Vec<bool>,
}

impl Session {
    pub(super) fn forward(
        &self,
        batch: &Batch,
        ctx: &Ctx<'_>,
        schedule: &Schedule,
        mut tr: Option<&mut MicroTrace>,
    ) -> Result<Activations> {
        let n = self.chain.blocks.len();
        let mut acts = Activations {
            outputs: (0..n).map(|_| None).collect(),
            edges: (0..n).map(|_| None).collect(),
            sinks: (0..n).map(|_| None).collect(),
            extras: (0..n).map(|_| Vec::new()).collect(),
            extra_leaves: (0..n).map(|_| Vec::new()).collect(),
            extra_grads: (0..n).map(|_| Vec::new()).collect(),
            rng_states: (0..n).map(|_| None).collect(),
            sac: (0..n).map(|_| None).collect(),
            numbers: (0..n).map(|_| Vec::new()).collect(),
            sac_keeps_output: vec![false; n],
        };
        for i in 0..n {
            self.forward_block(i, batch, ctx, schedule, &mut acts, tr.as_deref_mut())?;
        }
        Ok(acts)
    }

    /// Block `i`'s forward, its output stored in `acts`; inside a checkpointed or fused run, the
    /// outputs whose last reader there it was are dropped after it (the graph keeps whatever it
    /// saved), as a module's locals die.
    fn forward_block(
        &self,
        i: usize,
        batch: &Batch,
        ctx: &Ctx<'_>,
        schedule: &Schedule,
        acts: &mut Activations,
        tr: Option<&mut MicroTrace>,
    ) -> Result<()> {
        let block = &self.chain.blocks[i];
        let seg = schedule.segments[i];
        let fused = schedule.fused[i];
        // Inside a fused group, blocks read the raw outputs of the group's earlier blocks (one
        // graph); everything else reads leaves.
        let inner = |s: usize| fused.is_some_and(|(first, _)| s >= first);
        let raw = |acts: &Activations, (s, slot): (usize, usize)| {
            let t = match slot {
                0 => acts.outputs[s].as_ref(),
                slot => acts.extras[s][slot - 1].as_ref(),
            };
            t.expect("a fused block's inputs are alive").shallow_clone()
        };
        let x = if i > 0 && inner(i - 1) {
            raw(acts, (i - 1, 0))
        } else {
            block_input(i, &batch.input, &acts.outputs, &mut acts.sinks)?
        };
        let skips: Vec<Tensor> = block
            .skip_reads()
            .map(|r| {
                if inner(r.0) {
                    Ok(raw(acts, r))
                } else {
                    self.read_leaf(acts, r)
                }
            })
            .collect::<Result<_>>()?;
        let t0 = Instant::now();
        let mut tr = tr;
        if let Some(t) = tr.as_deref_mut() {
            let b = &mut t.blocks[i];
            b.checkpointed = seg.is_some();
            b.fused = fused.is_some();
            b.fwd_before = self.probe.current();
            self.probe.reset_window();
        }
        if seg.is_some_and(|(first, _)| first == i) {
            acts.rng_states[i] = Some(rng::cpu_state()?);
        }
        let (out, open) = {
            let _scope = scope::open(Phase::Forward, Some((i, &block.name)))?;
            let ac = self.autocast_region()?;
            let bctx = ctx.with_skips(&skips);
            // A checkpointed or selective block runs without grad and keeps the numbers its
            // graph with grad saves; a plain one learns which those are.
            let numbers = self.open_numbers(i, seg.is_none())?;
            let out = if let Some(policy) = schedule.selective[i] {
                let recording = sac::record(policy)?;
                let out = tch::no_grad(|| block.block.try_forward_all(&x, &bctx));
                acts.sac[i] = Some(recording.finish());
                acts.sac_keeps_output[i] = out.as_ref().is_ok_and(|(o, _)| storage_shared(o));
                out
            } else if seg.is_some() {
                tch::no_grad(|| block.block.try_forward_all(&x, &bctx))
            } else {
                block.block.try_forward_all(&x, &bctx)
            };
            acts.numbers[i] = self.close_numbers(i, numbers);
            if let (Ok((o, _)), None) = (&out, seg) {
                // Before anything it read goes, as in the recompute.
                self.learn_output_saved(i, o);
            }
            drop((x, skips));
            if i > 0 && !inner(i - 1) && seg.is_none() {
                self.learn_input_saved(i, &acts.outputs, &acts.sac_keeps_output);
                // The input's only reader ran plain and did not keep it: the runtime lets go
                // of it, as `h = layer(h)` does.
                if self.releasable(i - 1, schedule) {
                    release_output(i - 1, &mut acts.outputs, &mut acts.edges)?;
                }
            }
            let open = self.probe.current();
            drop(ac);
            (out.map_err(|failure| self.block_failed(i, failure))?, open)
        };
        let (out, extras) = out;
        acts.outputs[i] = Some(out);
        acts.extras[i] = extras.into_iter().map(Some).collect();
        if let Some((first, last)) = seg.or(fused) {
            for k in first..last {
                if schedule.last_reader[k] == i {
                    acts.outputs[k] = None;
                    acts.sinks[k] = None;
                }
            }
            for &((k, slot), _) in schedule
                .further_last_reader
                .iter()
                .filter(|&&((k, _), r)| r == i && k >= first)
            {
                acts.extras[k][slot - 1] = None;
                if let Some(l) = acts.extra_leaves[k].get_mut(slot - 1) {
                    *l = None;
                }
            }
        }
        if let Some(t) = tr {
            let b = &mut t.blocks[i];
            b.fwd_peak = self.probe.window_peak();
            b.fwd_after = self.probe.current();
            b.fwd_open = open;
            b.fwd_seconds = t0.elapsed().as_secs_f64();
            b.sel_held = self.held_by_cache(i, schedule, &acts.outputs, &acts.sac_keeps_output);
        }
        Ok(())
    }

    /// What a block or the loss reads `(k, slot)` through: an alias of block `k`'s output
    /// (slot 0), which the runtime still holds, or the leaf of its further output `slot`.
    pub(super) fn read_leaf(&self, acts: &mut Activations, (k, slot): (usize, usize)) -> Result<Tensor> {
        match slot {
            0 => reader_alias(k, &acts.outputs, &mut acts.sinks),
            _ => Ok(further_leaf((k, slot), &acts.extras, &mut acts.extra_leaves)),
        }
    }
}
