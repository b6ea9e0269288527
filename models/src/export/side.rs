//! Side nodes: what a program computes without the batch's data, from the mask input,
//! parameters, constant buffers, sizes and literals alone (an attention bias, a causal mask,
//! position ids, rotary cos/sin, T5's relative position bias from its embedding table). Models
//! compute these once and every layer reads them; here each block that reads one computes it
//! (see `ExportBlock::forward`), so they never cross a cut: a cut carries one tensor, and the
//! bias T5's first layer hands every layer would be a second. A parameter read so gets its
//! gradient from each reading block, summed in its `.grad`. Nodes reading a buffer the program
//! mutates are never side nodes (the value depends on when it is read).

use super::graph::{Graph, Target};
use super::signature::Signature;

/// Per node and per value, whether it is a side node or a side value.
pub(super) struct Side {
    pub nodes: Vec<bool>,
    pub values: Vec<bool>,
}

pub(super) fn side_nodes(graph: &Graph, sig: &Signature) -> Side {
    let (statics, mutations, mutated, mask_input) = (&sig.statics, &sig.mutations, &sig.mutated, sig.mask_input);
    let mut side_values = vec![false; graph.names.len()];
    let mut side_nodes = vec![false; graph.nodes.len()];
    if let Some(m) = mask_input {
        side_values[m] = true;
    }
    for (k, node) in graph.nodes.iter().enumerate() {
        let defines = node.defines();
        let makes_tensors = !defines.is_empty() && defines.iter().all(|&v| graph.is_tensor[v]);
        // Random operators would be redrawn by every block; those whose result the signature
        // writes back to a buffer (`num_batches_tracked + 1`), and in-place ones on anything but
        // a side value (`detach_` of a fresh constant is fine), must run once, in their block.
        let reads = node.reads();
        let once = defines.iter().any(|v| mutations.contains_key(v))
            || match &node.target {
                Target::Op { name, .. } => {
                    (name.ends_with('_') && !reads.first().is_some_and(|&v| side_values[v]))
                        || [
                            "dropout",
                            "rand",
                            "bernoulli",
                            "normal",
                            "uniform",
                            "multinomial",
                            "exponential",
                        ]
                        .iter()
                        .any(|r| name.contains(r))
                }
                _ => false,
            };
        let free = |v: usize| {
            side_values[v] || !graph.is_tensor[v] || statics[v].as_ref().is_some_and(|_| !mutated.contains(&v))
        };
        if makes_tensors && !once && reads.into_iter().all(free) {
            side_nodes[k] = true;
            for v in defines {
                side_values[v] = true;
            }
        }
    }
    // Symbolic sizes count as free: a side value is computed when a block's node first reads
    // it, so the sizes it needs (`sym_size(input_ids, 0)`, made by an earlier node) are this
    // batch's by then.
    Side {
        nodes: side_nodes,
        values: side_values,
    }
}
