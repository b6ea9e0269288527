//! `torch.export` programs (`.pt2` files from `torch.export.save`) as chains, run node by node.
//!
//! The graph is cut into blocks, each a contiguous run of nodes: candidate modules (found from
//! each node's `nn_module_stack`, see [`candidates`]) and the glue between them. A block runs
//! its nodes through libtorch's dispatcher ([`graph`]); what it reads from earlier blocks
//! arrives as its input (the previous block's output) and its skips (older blocks' outputs),
//! and it hands on the one tensor later nodes read. Parameters live in the chain's var store
//! under their PyTorch names (`layer1.0.conv1.weight`), leaves that require grad.
//!
//! Inputs are random tensors shaped like the exported example; the loss is cross-entropy against
//! random targets when the first output ends in a class dimension (`[batch, classes]`) or in the
//! vocabulary of the embedding that reads the input (`[batch, seq, vocab]`), else its sum, plus
//! the sum of every further floating-point output (their blocks hand them to the loss).

mod archive;
mod autocast;
mod block;
mod candidates;
mod dataflow;
mod errors;
mod graph;
mod inplace;
mod interpret;
mod io;
mod side;
mod signature;
mod trial;
mod unbacked;

use std::path::Path;
use std::sync::{Arc, Mutex};

use serde_json::Value as Json;

pub use archive::{exported_on_meta, is_export_archive, pins_fp32};
pub use candidates::layers;

use crate::chain::{Chain, ChainGroup};
use crate::error::{ModelError, Result};
use crate::options::ModelOptions;
use block::Program;
use errors::graph_err;
use graph::Graph;

/// Loads a `torch.export` archive as a chain: its signature read and its tensors registered,
/// its input and loss, the side nodes every block may compute, the cut into blocks and the
/// dataflow between them, then one trial run on a sample batch.
pub fn chain_from_export(path: &Path, opts: &ModelOptions) -> Result<Chain> {
    opts.reject(
        &path.display().to_string(),
        "attention",
        opts.attention.map(|a| a.hf_name()),
        "an exported program's attention is the one it was exported with",
    )?;
    let bad = |reason: String| ModelError::BadExport {
        path: path.to_path_buf(),
        reason,
    };
    let ar = archive::read(path)?;
    let ar_on_meta = ar.on_meta;
    let gm = ar
        .model
        .get("graph_module")
        .ok_or_else(|| bad("model.json has no graph_module".into()))?;
    let graph_json = gm.get("graph").ok_or_else(|| bad("no graph".into()))?;
    unbacked::refuse(graph_json).map_err(graph_err(path))?;
    let graph = Graph::parse(graph_json).map_err(graph_err(path))?;
    graph.check_ops().map_err(graph_err(path))?;
    let sig_json: &Json = gm.get("signature").ok_or_else(|| bad("no graph signature".into()))?;
    let sig = signature::read(path, &ar, &graph, sig_json, opts)?;
    let io = io::input_and_loss(path, &ar, &graph, &sig, opts)?;
    let side = side::side_nodes(&graph, &sig);
    let cut = candidates::cut_into_units(path, &graph, opts, &side.nodes)?;
    let flow = dataflow::Flow::new(path, &ar, &graph, &sig, &side, &cut.units, &io.loss.outputs)?;
    let mut loss = io.loss;
    let found = flow.loss_terms(path, &graph, &loss.outputs)?;
    (loss.reads, loss.extra_reads, loss.terms) = (found.reads, found.extra_reads, found.terms);
    let prog = Arc::new(Program {
        syms: Mutex::new(vec![None; graph.names.len()]),
        graph,
        statics: sig.statics,
        mutations: sig.mutations,
        mask_input: sig.mask_input,
        side_nodes: side.nodes,
        side_values: side.values,
        def: flow.def.clone(),
    });
    let blocks = dataflow::blocks(path, &prog, &flow, &cut.units, sig.input)?;
    let chain = Chain {
        name: path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string()),
        vs: sig.vs,
        blocks,
        groups: cut
            .groups
            .into_iter()
            .map(|(name, first, last)| ChainGroup { name, first, last })
            .collect(),
        head: Box::new(loss),
        modules: cut.modules,
        input: io.spec,
        reference_params: sig.reference_params,
        attention: None,
        shared: None,
    };
    chain.validate().map_err(bad)?;
    let batch = io.in_sizes.first().copied().flatten().unwrap_or(2);
    trial::check(path, &chain, batch, ar_on_meta)?;
    Ok(chain)
}
