//! The tensors between blocks. A block's output reaches its readers as aliases feeding one
//! gradient sink (`kernels::sink`), made when its first reader runs: non-leaves, as the previous
//! layer's output is in PyTorch, so autocast casts them once per operator and nothing but the
//! runtime's handle and what a reader's graph saved holds the output's storage. The runtime lets
//! go of an output whose only reader is the next block once that block's forward is done (once
//! its backward is done, when it is checkpointed and recomputes from it), keeping the output's
//! gradient edge to run the producer's backward from: the output then lives as long as PyTorch
//! keeps the previous layer's output (docs/memory-model.md, "The execution scheme").
//! A block that hands on several tensors has a leaf per further tensor.

use ckptune_kernels::sink::{output_edge, sink_alias, storage_shared, GradSink, OutputEdge};
use tch::Tensor;

use super::schedule::Schedule;
use super::session::{nbytes, Session};
use crate::error::Result;

impl Session {
    /// Records, the first time block `k` runs with grad, whether its output `out` (just made)
    /// is held by more than itself: its graph saved it ([`Session::output_saved`]).
    pub(super) fn learn_output_saved(&self, k: usize, out: &Tensor) {
        let known = &self.output_saved[k];
        if known.get().is_none() {
            known.set(Some(storage_shared(out)));
        }
    }

    /// Records, the first time block `j` ran with grad (its handles on its input dropped),
    /// whether its graph keeps its input: whether anything but the runtime's handle holds the
    /// input's storage, when its producer's graph is known not to and the producer's selective
    /// cache, if it ran selective, does not keep it either.
    /// `sac_keeps_output`: per block, whether its selective cache keeps its output.
    pub(super) fn learn_input_saved(&self, j: usize, outputs: &[Option<Tensor>], sac_keeps_output: &[bool]) {
        let Some(k) = j.checked_sub(1) else { return };
        let known = &self.input_saved[j];
        if known.get().is_some() || self.output_saved[k].get() != Some(false) || sac_keeps_output[k] {
            return;
        }
        if let Some(out) = &outputs[k] {
            known.set(Some(storage_shared(out)));
        }
    }

    /// Whether the runtime lets go of block `k`'s output once its only reader ran (its forward,
    /// or its backward when it recomputes): the next block is its only reader, and neither its
    /// own graph nor the reader's (plain) keeps it. Otherwise the output is held until its
    /// block's backward whichever blocks are checkpointed, so that what it holds stays linear
    /// in the choice: a checkpointed block's output whose plain graph would save it is held as
    /// the plain one is.
    pub(super) fn releasable(&self, k: usize, schedule: &Schedule) -> bool {
        schedule.single_reader[k]
            && self.output_saved[k].get() == Some(false)
            && self.input_saved[k + 1].get() == Some(false)
    }

    /// Bytes of block `k`'s output, just made by a selective forward, that its selective cache
    /// keeps (the policy saved the operator that made it) where the runtime would let go of the
    /// output after a plain reader's forward: they then live until `k`'s backward whatever the
    /// reader does, so a plain reader's kept bytes, measured with the output let go, miss them.
    /// 0 for a block not run selective, or whose output is held anyway.
    pub(super) fn held_by_cache(
        &self,
        k: usize,
        schedule: &Schedule,
        outputs: &[Option<Tensor>],
        sac_keeps_output: &[bool],
    ) -> i64 {
        match &outputs[k] {
            Some(out) if sac_keeps_output[k] && self.releasable(k, schedule) => nbytes(out),
            _ => 0,
        }
    }
}

/// Block `i`'s input: the batch for the first block, else a reader's alias of the previous
/// output (its sink created on first use).
pub(super) fn block_input(
    i: usize,
    input: &Tensor,
    outputs: &[Option<Tensor>],
    sinks: &mut [Option<GradSink>],
) -> Result<Tensor> {
    if i == 0 {
        return Ok(input.shallow_clone());
    }
    reader_alias(i - 1, outputs, sinks)
}

/// One more reader's alias of block `k`'s output, feeding the output's sink (created on first
/// use). The output must still be held: its readers run before the runtime lets go of it.
pub(super) fn reader_alias(k: usize, outputs: &[Option<Tensor>], sinks: &mut [Option<GradSink>]) -> Result<Tensor> {
    let out = outputs[k].as_ref().expect("a block output is held while a reader runs");
    Ok(match &sinks[k] {
        Some(sink) => sink.alias(out)?,
        None => {
            let (alias, sink) = sink_alias(out)?;
            sinks[k] = Some(sink);
            alias
        }
    })
}

/// Lets go of block `k`'s output, keeping its gradient edge (when it has one) for the block's
/// backward: the storage goes unless a reader's graph or the producer's saved it.
pub(super) fn release_output(k: usize, outputs: &mut [Option<Tensor>], edges: &mut [Option<OutputEdge>]) -> Result<()> {
    if let Some(out) = outputs[k].take() {
        if out.requires_grad() {
            edges[k] = Some(output_edge(out)?);
        }
    }
    Ok(())
}

/// The leaf of block `k`'s further output `slot` (1 and up) that its readers take, created on
/// first use.
pub(super) fn further_leaf(
    (k, slot): (usize, usize),
    extras: &[Vec<Option<Tensor>>],
    extra_leaves: &mut [Vec<Option<Tensor>>],
) -> Tensor {
    let leaves = &mut extra_leaves[k];
    if leaves.len() < slot {
        leaves.resize_with(slot, || None);
    }
    if leaves[slot - 1].is_none() {
        let out = extras[k][slot - 1]
            .as_ref()
            .expect("a further output is alive when a reader runs");
        // A further output may be an integer tensor (indices), which has no gradient.
        leaves[slot - 1] = Some(if out.is_floating_point() {
            boundary_leaf(out)
        } else {
            out.detach()
        });
    }
    leaves[slot - 1]
        .as_ref()
        .expect("a leaf is alive while a reader runs")
        .shallow_clone()
}

/// The leaf readers of `t` take as input: a view of `t` detached, which requires grad. Autocast
/// caches the bf16 cast of a leaf that requires grad (meant for weights) but not of a view, so
/// a reader that casts its input in several operators makes one cast per operator, as PyTorch
/// does of the previous layer's output, and their gradients are summed in f32 as there. It is
/// still a leaf (a view of a tensor that needs no grad has no graph), so every reader's gradient
/// accumulates in its `.grad`, in the order one fused graph sums them.
pub(super) fn boundary_leaf(t: &Tensor) -> Tensor {
    let detached = t.detach();
    detached.view_as(&detached).set_requires_grad(true)
}
