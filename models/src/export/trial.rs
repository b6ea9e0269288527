//! A load-time trial run: a node that fails on a sample batch is bad input naming the node, not
//! a panic in the middle of profiling. In fake mode a node that needs values, or a meta kernel
//! libtorch lacks, is named as what keeps the model from being measured on the meta device.

use std::path::Path;

use tch::Tensor;

use crate::chain::{BlockFailure, Chain, Ctx};
use crate::error::{ModelError, Result};

/// [`trial_run`] with its failure as the models crate reports it. `meta_only`: the program was
/// exported on the meta device (it has no weights to run for real).
pub(super) fn check(path: &Path, chain: &Chain, batch: i64, meta_only: bool) -> Result<()> {
    let failure = match trial_run(chain, batch) {
        Ok(()) => return Ok(()),
        Err(Failed::Block(block, f)) => (block, f),
        Err(Failed::Setup(why)) => {
            return Err(ModelError::BadExport {
                path: path.to_path_buf(),
                reason: format!("running it on a sample batch of {batch}: {why}"),
            })
        }
    };
    let (block, BlockFailure { node, target, why }) = failure;
    let meta = ckptune_kernels::fake::active()
        .then(|| ckptune_kernels::fake::meta_failure(&why))
        .flatten();
    Err(match meta {
        Some(why) => ModelError::NotMeasurableOnMeta {
            path: path.to_path_buf(),
            node,
            target,
            why,
            meta_only,
        },
        None => ModelError::BadExport {
            path: path.to_path_buf(),
            reason: format!(
                "running it on a sample batch of {batch} failed: block {block}: node {node} ({target}): {why}"
            ),
        },
    })
}

enum Failed {
    /// A block's node, with the block's name.
    Block(String, BlockFailure),
    /// Saving or restoring the RNG state.
    Setup(String),
}

/// Runs the chain once on a sample batch, so that a node that fails (a dtype or shape the
/// operator rejects) is bad input at load time, named with its node, rather than an error in
/// the middle of profiling. Buffers and the RNG are put back: the trial leaves no trace.
fn trial_run(chain: &Chain, batch: i64) -> std::result::Result<(), Failed> {
    let rng = ckptune_kernels::rng::cpu_state().map_err(|e| Failed::Setup(e.to_string()))?;
    let buffers: Vec<(Tensor, Tensor)> = chain
        .vs
        .variables()
        .into_values()
        .filter(|t| !t.requires_grad())
        .map(|t| {
            let saved = t.copy();
            (t, saved)
        })
        .collect();
    let sample = chain.make_batch(batch, chain.vs.device(), 0);
    // As the runtime runs a block (in the caller's grad mode, training's), on leaves that
    // require grad detached from earlier outputs: a node that fails only there (an in-place
    // write of such a leaf did, under no-grad on the outputs themselves it passed) fails here.
    let leaf = |t: &Tensor| t.detach().set_requires_grad(t.is_floating_point());
    // Chain::forward_all, with the batch's raw mask in the context.
    let ctx = Ctx::new(None, true)
        .with_batch_mask(sample.attention_mask.as_ref(), sample.padded)
        .with_batch_input(&sample.input);
    // Per block, its output and then its further outputs.
    let mut outs: Vec<Vec<Tensor>> = Vec::with_capacity(chain.blocks.len());
    let mut result = Ok(());
    for (i, b) in chain.blocks.iter().enumerate() {
        let x = if i == 0 {
            sample.input.shallow_clone()
        } else {
            leaf(&outs[i - 1][0])
        };
        let skips: Vec<Tensor> = b.skip_reads().map(|(k, s)| leaf(&outs[k][s])).collect();
        match b.block.try_forward_all(&x, &ctx.with_skips(&skips)) {
            Ok((out, more)) => outs.push(std::iter::once(out).chain(more).collect()),
            Err(f) => {
                result = Err(Failed::Block(b.name.clone(), f));
                break;
            }
        }
    }
    drop(outs);
    tch::no_grad(|| {
        for (t, saved) in &buffers {
            t.shallow_clone().copy_(saved);
        }
    });
    ckptune_kernels::rng::set_cpu_state(&rng).map_err(|e| Failed::Setup(e.to_string()))?;
    result
}
