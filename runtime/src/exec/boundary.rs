//! The tensors between blocks: each output's detached leaf, created when its first reader
//! runs, which every reader takes as input so that their gradients accumulate in one `.grad`.
//! A block that hands on several tensors has a leaf per tensor.

use ckptune_models::Chain;
use tch::Tensor;

/// Block `i`'s input: the batch for the first block, else the leaf of the previous output
/// (created on first use).
pub(super) fn block_input(
    chain: &Chain,
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
        leaves[i - 1] = Some(boundary(chain, i - 1, i, out).set_requires_grad(true));
    }
    leaf(leaves, i - 1)
}

/// The leaf of block `k`'s further output `slot` (1 and up) that block `reader` (or the loss,
/// `reader` past the last block) reads, created on first use.
pub(super) fn further_leaf(
    chain: &Chain,
    (k, slot): (usize, usize),
    reader: usize,
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
        leaves[slot - 1] = Some(boundary(chain, k, reader, out).set_requires_grad(out.is_floating_point()));
    }
    leaf(leaves, slot - 1)
}

/// The boundary of `out`, made by block `producer` and first read by block `reader`: the
/// tensor that becomes its leaf.
fn boundary(chain: &Chain, producer: usize, reader: usize, out: &Tensor) -> Tensor {
    // Inside a layer run as its children the boundary is a view: autocast caches the
    // bf16 cast of a leaf that requires grad (meant for weights) but not of a view, so a
    // child that casts its input more than once (Llama's q/k/v projections, gate and
    // up) makes the casts the fused layer makes, and their gradients are summed as
    // there, in f32. Between layers the boundary is the plain leaf both runs share.
    let detached = out.detach();
    let inside = chain.groups.iter().any(|g| g.first <= producer && reader <= g.last);
    if inside {
        detached.view_as(&detached)
    } else {
        detached
    }
}

/// A handle on leaf `k`, which must exist.
pub(super) fn leaf(leaves: &[Option<Tensor>], k: usize) -> Tensor {
    leaves[k]
        .as_ref()
        .expect("a leaf is alive while a reader runs")
        .shallow_clone()
}
