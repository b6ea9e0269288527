//! What crosses the cuts between blocks: each block's output (the one tensor later nodes or the
//! loss read: a program may have several outputs) and what each block reads from earlier
//! blocks, as its input (the previous block's output) and its skips (older blocks' outputs);
//! no-op casts read through across cuts.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::Arc;

use super::archive::Archive;
use super::block::{ExportBlock, Program};
use super::candidates::Unit;
use super::graph::{Graph, Input, Target};
use super::inplace;
use super::io::sizes_of;
use super::side::Side;
use super::signature::Signature;
use crate::chain::ChainBlock;
use crate::error::{ModelError, Result};

/// Where the loss finds the outputs it reads (see [`Flow::loss_terms`]).
pub(super) struct LossReads {
    pub reads: Vec<usize>,
    pub extra_reads: Vec<(usize, usize)>,
    pub terms: Vec<Option<usize>>,
}

/// The dataflow of a program cut into `units`.
pub(super) struct Flow {
    /// Per value, the node that defines it.
    pub def: Vec<Option<usize>>,
    /// Per node, the unit it belongs to.
    block_of_node: Vec<usize>,
    /// Casts that were no-ops when the program was exported, with their source (see
    /// [`no_op_casts`]).
    alias_src: HashMap<usize, usize>,
    /// Per unit, the values it hands on: its output, then its further outputs (slots 1..).
    outputs_of: Vec<Vec<usize>>,
}

fn bad(path: &Path, reason: String) -> ModelError {
    ModelError::BadExport {
        path: path.to_path_buf(),
        reason,
    }
}

impl Flow {
    /// `outputs`: the program outputs the loss reads ([`super::io::ExportLoss::outputs`]).
    pub fn new(
        path: &Path,
        ar: &Archive,
        graph: &Graph,
        sig: &Signature,
        side: &Side,
        units: &[Unit],
        outputs: &[usize],
    ) -> Result<Flow> {
        let mut block_of_node = vec![0usize; graph.nodes.len()];
        for (i, u) in units.iter().enumerate() {
            block_of_node[u.first..=u.last].fill(i);
        }
        let mut flow = Flow {
            def: graph.definitions(),
            block_of_node,
            alias_src: no_op_casts(ar, graph, sig, side),
            outputs_of: Vec::new(),
        };
        flow.outputs_of = flow.outputs(path, graph, sig, side, units, outputs)?;
        Ok(flow)
    }

    /// Where the loss finds `outputs` (the program outputs it reads, in order): the blocks other
    /// than the last whose outputs it reads, the further outputs `(block, slot)` it reads, and
    /// per output `None` for the last block's output, else its index in those two lists, one
    /// after the other. A further output no block makes (the input returned, a value computed
    /// without the batch) is left out of the loss; such a first output is refused.
    pub fn loss_terms(&self, path: &Path, graph: &Graph, outputs: &[usize]) -> Result<LossReads> {
        let last = self.outputs_of.len() - 1;
        let mut found: Vec<(usize, usize)> = Vec::new();
        let mut at: Vec<Option<(usize, usize)>> = Vec::with_capacity(outputs.len());
        for (n, &v) in outputs.iter().enumerate() {
            let Some(slot) = self.slot_of(v) else {
                if n > 0 {
                    continue;
                }
                return Err(bad(
                    path,
                    format!(
                        "the program's first output {} is made by no block (the input or a value computed \
                         without the batch); ckptune's loss reads it: export a program whose first output \
                         is computed from the batch",
                        graph.names[v]
                    ),
                ));
            };
            at.push((slot != (last, 0)).then_some(slot));
            if slot != (last, 0) && !found.contains(&slot) {
                found.push(slot);
            }
        }
        let reads: Vec<usize> = found.iter().filter(|r| r.1 == 0).map(|r| r.0).collect();
        let extra_reads: Vec<(usize, usize)> = found.iter().copied().filter(|r| r.1 > 0).collect();
        let index = |r: (usize, usize)| match r.1 {
            0 => reads.iter().position(|&k| k == r.0),
            _ => extra_reads.iter().position(|&e| e == r).map(|p| reads.len() + p),
        };
        let terms = at.into_iter().map(|r| r.and_then(index)).collect();
        Ok(LossReads {
            reads,
            extra_reads,
            terms,
        })
    }

    /// The block that hands `v` on and its slot there (0: its output).
    fn slot_of(&self, v: usize) -> Option<(usize, usize)> {
        self.outputs_of
            .iter()
            .enumerate()
            .find_map(|(j, outs)| outs.iter().position(|&o| o == v).map(|s| (j, s)))
    }

    /// The value node `k` reads for `v`: through no-op casts made in another block.
    fn read_as(&self, v: usize, k: usize) -> usize {
        let mut v = v;
        while let Some(&src) = self.alias_src.get(&v) {
            if self.def[v].map(|d| self.block_of_node[d]) == Some(self.block_of_node[k]) {
                break;
            }
            v = src;
        }
        v
    }

    /// Per unit, the tensors it hands to later nodes or to the loss (program outputs): its
    /// output first, then its further outputs.
    fn outputs(
        &self,
        path: &Path,
        graph: &Graph,
        sig: &Signature,
        side: &Side,
        units: &[Unit],
        loss_outputs: &[usize],
    ) -> Result<Vec<Vec<usize>>> {
        // The last node reading each value (the graph's output node is none).
        let mut last_read: Vec<Option<usize>> = vec![None; graph.names.len()];
        for (k, node) in graph.nodes.iter().enumerate() {
            for v in node.reads() {
                last_read[self.read_as(v, k)] = Some(k);
            }
        }
        let mut outputs_of: Vec<Vec<usize>> = Vec::with_capacity(units.len());
        for u in units {
            let outs: BTreeSet<usize> = (u.first..=u.last)
                .filter(|&k| !side.nodes[k])
                .flat_map(|k| graph.nodes[k].defines())
                // A buffer's new value (core ATen's functional batch norm) is written back by the
                // block that makes it, not handed on.
                .filter(|&v| {
                    graph.is_tensor[v]
                        && !sig.mutations.contains_key(&v)
                        && (loss_outputs.contains(&v) || last_read[v].is_some_and(|l| l > u.last))
                })
                .collect();
            let mut outs: Vec<usize> = outs.into_iter().collect();
            if outs.is_empty() {
                return Err(bad(
                    path,
                    format!(
                        "block {} (nodes {}..{}) hands 0 tensors to later nodes and the loss; every block \
                         hands on what it computes: choose other candidates with --candidates REGEX",
                        u.name, graph.nodes[u.first].name, graph.nodes[u.last].name,
                    ),
                ));
            }
            // Its output (slot 0, the tensor the next block takes as input): the last block's is
            // the program's first output it makes, any other's the first value a later node
            // reads; the rest are its further outputs, in value order.
            let primary = if outputs_of.len() + 1 == units.len() {
                loss_outputs.iter().copied().find(|v| outs.contains(v))
            } else {
                outs.iter().copied().find(|&v| last_read[v].is_some_and(|l| l > u.last))
            };
            if let Some(p) = primary.and_then(|p| outs.iter().position(|&v| v == p)) {
                let v = outs.remove(p);
                outs.insert(0, v);
            }
            outputs_of.push(outs);
        }
        if let Some(v) = outputs_of.last().map(|o| o[0]).filter(|v| !loss_outputs.contains(v)) {
            return Err(bad(
                path,
                format!(
                    "the last block hands on {}, which is not an output of the model ({})",
                    graph.names[v], graph.names[sig.output]
                ),
            ));
        }
        Ok(outputs_of)
    }
}

/// Casts that were no-ops when the program was exported (`x.to(torch.float32)` of a float32
/// `x` returns `x` itself): tracing then has later readers of `x` read the cast, such as the
/// residual sum after a Llama RMSNorm, which casts its input first. A reader in another block
/// than the cast's reads the source instead, as the model's code does (`residual =
/// hidden_states` before the norm), so the cast is not handed on besides the norm's output.
fn no_op_casts(ar: &Archive, graph: &Graph, sig: &Signature, side: &Side) -> HashMap<usize, usize> {
    graph
        .nodes
        .iter()
        .filter_map(|node| {
            let Target::Op { name, .. } = &node.target else {
                return None;
            };
            if !matches!(name.as_str(), "aten::to" | "aten::alias" | "aten::type_as") {
                return None;
            }
            if node
                .args
                .iter()
                .any(|(a, i)| a == "copy" && matches!(i, Input::Bool(true)))
            {
                return None;
            }
            let src = match node.args.first() {
                Some((_, Input::Tensor(v))) if sig.statics[*v].is_none() && !side.values[*v] => *v,
                _ => return None,
            };
            let [out] = node.defines()[..] else {
                return None;
            };
            let same = sizes_of(&ar.model, &graph.names[src])
                .is_some_and(|a| sizes_of(&ar.model, &graph.names[out]).is_some_and(|b| a == b));
            same.then_some((out, src))
        })
        .collect()
}

/// The chain blocks of the program's units.
pub(super) fn blocks(
    path: &Path,
    prog: &Arc<Program>,
    flow: &Flow,
    units: &[Unit],
    input: usize,
) -> Result<Vec<ChainBlock>> {
    units
        .iter()
        .enumerate()
        .map(|(i, u)| block(path, prog, flow, i, u, input))
        .collect()
}

/// Unit `i` as a chain block: the nodes it runs, what it reads from earlier blocks (its input
/// and skips) and from the batch, the side values it reads.
fn block(path: &Path, prog: &Arc<Program>, flow: &Flow, i: usize, u: &Unit, input: usize) -> Result<ChainBlock> {
    let g = &prog.graph;
    let runs = runs(prog, flow, u);
    let mut reads: BTreeSet<usize> = BTreeSet::new();
    let mut side_reads: HashMap<usize, usize> = HashMap::new();
    let mut aliases: BTreeSet<(usize, usize)> = BTreeSet::new();
    for &k in &runs {
        for v in g.nodes[k].reads() {
            let v = match flow.read_as(v, k) {
                src if src != v => {
                    aliases.insert((v, src));
                    src
                }
                _ => v,
            };
            if prog.side_values[v] {
                side_reads.insert(v, k);
            } else if !prog.side_nodes[k]
                && g.is_tensor[v]
                && prog.statics[v].is_none()
                && flow.def[v].is_none_or(|d| d < u.first)
            {
                reads.insert(v);
            }
        }
    }
    let mut block_input = None;
    let mut batch_input = None;
    let mut skips = Vec::new();
    let mut skip_vals = Vec::new();
    let mut extra_reads: Vec<((usize, usize), usize)> = Vec::new();
    for v in reads {
        if v == input {
            // A later block reads the batch itself (it needs no gradient and lives all step).
            if i == 0 {
                block_input = Some(v);
            } else {
                batch_input = Some(v);
            }
            continue;
        }
        let (j, slot) = flow.slot_of(v).ok_or_else(|| {
            bad(
                path,
                format!("block {} reads {}, which no earlier block hands on", u.name, g.names[v]),
            )
        })?;
        match slot {
            0 if i > 0 && j == i - 1 => block_input = Some(v),
            0 => {
                skips.push(j);
                skip_vals.push(v);
            }
            s => extra_reads.push(((j, s), v)),
        }
    }
    let extra_reads: Vec<(usize, usize)> = extra_reads
        .into_iter()
        .map(|(r, v)| {
            skip_vals.push(v);
            r
        })
        .collect();
    // What it writes in place of what earlier blocks hand it (`nn.ReLU(inplace=True)` first).
    let written: BTreeSet<usize> = runs
        .iter()
        .flat_map(|&k| {
            inplace::written(&g.nodes[k])
                .into_iter()
                .map(move |v| flow.read_as(v, k))
        })
        .collect();
    if let Some(v) = batch_input.filter(|v| written.contains(v)) {
        return Err(bad(
            path,
            format!(
                "block {} writes the model's input {} in place, which an earlier block read and a \
                 recompute reads again; export a model that writes a copy (`x = x.clone()` first)",
                u.name, g.names[v]
            ),
        ));
    }
    let writes = block_input
        .iter()
        .chain(&skip_vals)
        .copied()
        .filter(|v| written.contains(v))
        .collect();
    let mut cb = ChainBlock::new(
        u.name.clone(),
        u.candidate,
        Box::new(ExportBlock {
            prog: prog.clone(),
            name: u.name.clone(),
            input: block_input,
            batch_input,
            skips: skip_vals,
            outputs: flow.outputs_of[i].clone(),
            runs,
            side_reads,
            aliases: aliases.into_iter().collect(),
            writes,
        }),
    );
    cb.skips = skips;
    cb.extra_reads = extra_reads;
    Ok(cb)
}

/// The nodes unit `u` runs, in order: its own, and the side nodes inside its range that its own
/// nodes need, transitively.
fn runs(prog: &Program, flow: &Flow, u: &Unit) -> Vec<usize> {
    let g = &prog.graph;
    let mut local_side: BTreeSet<usize> = BTreeSet::new();
    let mut stack: Vec<usize> = (u.first..=u.last)
        .filter(|&k| !prog.side_nodes[k])
        .flat_map(|k| g.nodes[k].reads())
        .collect();
    while let Some(v) = stack.pop() {
        if let Some(d) = flow.def[v].filter(|&d| prog.side_nodes[d] && (u.first..=u.last).contains(&d)) {
            if local_side.insert(d) {
                stack.extend(g.nodes[d].reads());
            }
        }
    }
    (u.first..=u.last)
        .filter(|&k| !prog.side_nodes[k] || local_side.contains(&k))
        .collect()
}
