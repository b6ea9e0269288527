//! The tensors between blocks: each output's detached leaf (a view, which autocast does not
//! cache), created when its first reader runs, which every reader takes as input so that their
//! gradients accumulate in one `.grad`.
//! A block that hands on several tensors has a leaf per tensor.

use tch::Tensor;

/// Block `i`'s input: the batch for the first block, else the leaf of the previous output
/// (created on first use).
pub(super) fn block_input(
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
        leaves[i - 1] = Some(boundary_leaf(out));
    }
    leaf(leaves, i - 1)
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
    leaf(leaves, slot - 1)
}

/// The leaf readers of `t` take as input: a view of `t` detached, which requires grad. Autocast
/// caches the bf16 cast of a leaf that requires grad (meant for weights) but not of a view, so
/// a reader that casts its input in several operators (BERT's query, key and value, Llama's gate
/// and up) makes one cast per operator, as PyTorch does of the previous layer's output, each
/// freed when its operator is done with it, and their gradients are summed in f32 as there.
/// It is still a leaf (a view of a tensor that needs no grad has no graph), so every reader's
/// gradient accumulates in its `.grad`, in the order one fused graph sums them.
pub(super) fn boundary_leaf(t: &Tensor) -> Tensor {
    let detached = t.detach();
    detached.view_as(&detached).set_requires_grad(true)
}

/// A handle on leaf `k`, which must exist.
pub(super) fn leaf(leaves: &[Option<Tensor>], k: usize) -> Tensor {
    leaves[k]
        .as_ref()
        .expect("a leaf is alive while a reader runs")
        .shallow_clone()
}
