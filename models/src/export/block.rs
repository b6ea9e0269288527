//! A block of an exported program at run time: the program every block shares, and one
//! block's nodes run through the interpreter, with what it reads from earlier blocks as its
//! input and skips, the side values it computes itself, and the buffers it writes back.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use tch::Tensor;

use ckptune_kernels::ops::Value;

use super::graph::{Graph, GraphError};
use super::interpret::Env;
use crate::chain::{Block, BlockFailure, Ctx};

/// The parsed program every block of a chain shares.
pub(super) struct Program {
    pub graph: Graph,
    /// Per value: the parameter, buffer or constant it is (a var-store tensor), else `None`.
    pub statics: Vec<Option<Tensor>>,
    /// Values whose result the graph signature writes back to a buffer (`buffer_mutation`).
    pub mutations: HashMap<usize, Tensor>,
    pub syms: Mutex<Vec<Option<i64>>>,
    /// The program's attention-mask input, fed from the batch's mask, if it takes one.
    pub mask_input: Option<usize>,
    /// Nodes computed without the batch's data or the parameters (see `chain_from_export`): in
    /// no block; each block computes the ones it reads when it first reads them.
    pub side_nodes: Vec<bool>,
    pub side_values: Vec<bool>,
    /// Per value, the node that defines it.
    pub def: Vec<Option<usize>>,
}

// SAFETY: tensors are handles to refcounted libtorch tensors; the runtime runs blocks from one
// thread at a time (Block: Send, never Sync use), as it does for every chain.
unsafe impl Send for Program {}
unsafe impl Sync for Program {}

pub(super) struct ExportBlock {
    pub prog: Arc<Program>,
    pub name: String,
    /// The value the block's input (`xs`) carries, if the block reads it.
    pub input: Option<usize>,
    /// The program's input, when a block after the first reads it: from [`Ctx::batch_input`].
    pub batch_input: Option<usize>,
    /// The values the block's skips carry, in the order of its `ChainBlock::skip_reads`.
    pub skips: Vec<usize>,
    /// What it hands on: its output, then its further outputs (slots 1..).
    pub outputs: Vec<usize>,
    /// The nodes the block runs, in order: its own, and the side nodes inside its range that
    /// make what its own read (where the program computes them; side nodes of its range that
    /// only other blocks need are left to them).
    pub runs: Vec<usize>,
    /// Side values the nodes it runs read, with the last of those nodes that reads each: it is
    /// freed after that node, as a module's local would be. Those made outside the block are
    /// computed when first read (see [`ExportBlock::compute_side`]).
    pub side_reads: HashMap<usize, usize>,
    /// `(cast, source)`: no-op casts made in an earlier block that this block's nodes read; they
    /// read the source (see `alias_src` in `chain_from_export`).
    pub aliases: Vec<(usize, usize)>,
    /// Values among its input and skips that its nodes write in place: it takes each as a
    /// writable alias (see [`ExportBlock::handle`]).
    pub writes: Vec<usize>,
}

impl Block for ExportBlock {
    fn forward(&self, xs: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        self.try_forward(xs, ctx)
            .unwrap_or_else(|e| panic!("block {}: {e}", self.name))
    }

    fn try_forward(&self, xs: &Tensor, ctx: &Ctx<'_>) -> Result<Tensor, BlockFailure> {
        self.try_forward_all(xs, ctx).map(|(out, _)| out)
    }

    fn try_forward_all(&self, xs: &Tensor, ctx: &Ctx<'_>) -> Result<(Tensor, Vec<Tensor>), BlockFailure> {
        let p = &self.prog;
        let mut env = self.bind(xs, ctx)?;
        let outs = &self.outputs;
        let keep = |v: usize| outs.contains(&v) || p.mutations.contains_key(&v);
        for &k in &self.runs {
            self.step(k, &mut env, ctx, &keep)?;
        }
        // Buffer mutations (core ATen's functional batch norm returns the new running
        // statistics): the buffer takes the new value's storage with `set_data`, not `copy_`,
        // because the node's graph saved the old buffer for backward and an in-place copy would
        // bump its version and fail that backward (the runtime swaps snapshots the same way).
        for (v, buffer) in &p.mutations {
            let t = if outs.contains(v) {
                env.local[*v].as_ref().and_then(|t| match t {
                    Value::Tensor(t) => Some(t.shallow_clone()),
                    _ => None,
                })
            } else {
                match env.local[*v].take() {
                    Some(Value::Tensor(t)) => Some(t),
                    _ => None,
                }
            };
            if let Some(t) = t {
                buffer.shallow_clone().set_data(&t.detach());
            }
        }
        let mut handed = outs.iter().map(|&v| match env.local[v].take() {
            Some(Value::Tensor(t)) => Ok(t),
            other => Err(self.value_failure(v, &format!("the block hands it on, but it is {other:?}, not a tensor"))),
        });
        let out = handed.next().expect("a block hands on at least one tensor")?;
        Ok((out, handed.collect::<Result<Vec<_>, _>>()?))
    }

    fn locate_backward_failure(&self, xs: &Tensor, ctx: &Ctx<'_>) -> Option<BlockFailure> {
        let p = &self.prog;
        let mut env = self.bind(xs, ctx).ok()?;
        // The probes differentiate with respect to what the block reads (its inputs and
        // parameters): the engine hands those gradients back instead of accumulating them in
        // `.grad`, so a probe leaves no trace on the step's gradients.
        let bound = env.local.iter().flatten().filter_map(|v| match v {
            Value::Tensor(t) => Some(t.shallow_clone()),
            _ => None,
        });
        let params = self
            .runs
            .iter()
            .flat_map(|&k| p.graph.nodes[k].reads())
            .collect::<BTreeSet<usize>>()
            .into_iter()
            .filter_map(|v| p.statics[v].as_ref().map(Tensor::shallow_clone));
        let wrt: Vec<Tensor> = bound.chain(params).filter(Tensor::requires_grad).collect();
        if wrt.is_empty() {
            return None;
        }
        for &k in &self.runs {
            // Nothing is freed: a later probe goes back through every node run so far.
            self.step(k, &mut env, ctx, &|_| true).ok()?;
            let made: Vec<Tensor> = p.graph.nodes[k]
                .defines()
                .into_iter()
                .filter_map(|v| match &env.local[v] {
                    Some(Value::Tensor(t)) if t.requires_grad() => Some(t.shallow_clone()),
                    _ => None,
                })
                .collect();
            // The first node after which backward fails is the one at fault: the operator
            // without a derivative, or the in-place write of a tensor an earlier node saved.
            if made.is_empty() {
                continue;
            }
            if let Err(e) = Tensor::f_run_backward(&made, &wrt, true, false) {
                let node = &p.graph.nodes[k];
                return Some(BlockFailure {
                    node: node.name.clone(),
                    target: node.target_text.clone(),
                    why: without_hint(&crate::error::first_line(&e.to_string())),
                });
            }
        }
        None
    }
}

impl ExportBlock {
    /// An environment holding what the block reads from earlier blocks and the batch.
    fn bind<'p>(&'p self, xs: &Tensor, ctx: &Ctx<'_>) -> Result<Env<'p>, BlockFailure> {
        let p = &self.prog;
        let mut env = Env {
            local: (0..p.graph.names.len()).map(|_| None).collect(),
            statics: &p.statics,
            syms: &p.syms,
        };
        if let Some(v) = self.input {
            env.local[v] = Some(Value::Tensor(self.handle(v, xs)?));
        }
        if let Some(v) = self.batch_input {
            let batch = ctx
                .batch_input
                .ok_or_else(|| self.value_failure(v, "the block reads the batch, but the step gave it none"))?;
            env.local[v] = Some(Value::Tensor(batch.shallow_clone()));
        }
        for (k, &v) in self.skips.iter().enumerate() {
            let skip = ctx
                .skips
                .get(k)
                .ok_or_else(|| self.value_failure(v, "no earlier block handed it on"))?;
            env.local[v] = Some(Value::Tensor(self.handle(v, skip)?));
        }
        for &(cast, src) in &self.aliases {
            if let Some(Value::Tensor(t)) = &env.local[src] {
                env.local[cast] = Some(Value::Tensor(t.shallow_clone()));
            }
        }
        Ok(env)
    }

    /// Runs node `k` of the block, computing first the side values it reads that are not there
    /// yet and freeing after it those it read last.
    fn step(
        &self,
        k: usize,
        env: &mut Env<'_>,
        ctx: &Ctx<'_>,
        keep: &dyn Fn(usize) -> bool,
    ) -> Result<(), BlockFailure> {
        let p = &self.prog;
        let reads = p.graph.nodes[k].reads();
        for &v in &reads {
            if p.side_values[v] && env.local[v].is_none() {
                self.compute_side(v, k, env, ctx)?;
            }
        }
        self.run(k, env, keep)?;
        for v in reads {
            if self.side_reads.get(&v) == Some(&k) {
                env.local[v] = None;
            }
        }
        Ok(())
    }

    /// The block's handle on `t`, what an earlier block handed it for value `v`: a writable alias
    /// where its nodes write `v` in place. The runtime hands a block a leaf that requires grad
    /// (its input gradient collects there), which PyTorch refuses to write in place under grad
    /// mode; in the model the block reads the previous layer's output, a non-leaf it may write.
    /// The alias is that non-leaf: same storage, gradient passed through unchanged.
    fn handle(&self, v: usize, t: &Tensor) -> Result<Tensor, BlockFailure> {
        if !self.writes.contains(&v) {
            return Ok(t.shallow_clone());
        }
        ckptune_kernels::autograd::writable_alias(t)
            .map_err(|e| self.value_failure(v, &format!("written in place, but no writable alias: {e}")))
    }

    /// A failure about value `v` rather than an operator: named by the node that makes it (the
    /// program's input placeholder where no node does).
    fn value_failure(&self, v: usize, why: &str) -> BlockFailure {
        let g = &self.prog.graph;
        let (node, target) = match self.prog.def[v] {
            Some(d) => (g.nodes[d].name.clone(), g.nodes[d].target_text.clone()),
            None => (g.names[v].clone(), "input".to_string()),
        };
        BlockFailure {
            node,
            target,
            why: why.to_string(),
        }
    }

    /// Runs node `k`. Load-time checks covered every operator and argument kind; what fails here
    /// is a shape or dtype the exported example did not cover, reported with the node.
    fn run(&self, k: usize, env: &mut Env<'_>, keep: &dyn Fn(usize) -> bool) -> Result<(), BlockFailure> {
        self.prog.graph.run(k..k + 1, env, keep).map_err(|e| match e {
            GraphError::Unsupported { node, target, why } => BlockFailure { node, target, why },
            GraphError::Format(why) => BlockFailure {
                node: self.prog.graph.nodes[k].name.clone(),
                target: self.prog.graph.nodes[k].target_text.clone(),
                why,
            },
        })
    }

    /// Computes side value `v` and what it needs that this block does not hold yet, in program
    /// order, before node `at` reads it; the intermediates die at once unless the block's own
    /// nodes read them later.
    fn compute_side(&self, v: usize, at: usize, env: &mut Env<'_>, ctx: &Ctx<'_>) -> Result<(), BlockFailure> {
        let p = &self.prog;
        let mut needed: BTreeSet<usize> = BTreeSet::new();
        let mut stack = vec![v];
        while let Some(w) = stack.pop() {
            let Some(d) = p.def[w].filter(|&d| p.side_nodes[d]) else {
                continue;
            };
            if env.local[w].is_none() && needed.insert(d) {
                stack.extend(p.graph.nodes[d].reads().into_iter().filter(|&r| p.side_values[r]));
            }
        }
        if let Some(m) = p.mask_input {
            let Some(mask) = ctx.batch_mask else {
                return Err(self.value_failure(m, "the program reads an attention mask, but the batch has none"));
            };
            env.local[m] = Some(Value::Tensor(mask.shallow_clone()));
        }
        for &d in &needed {
            self.run(d, env, &|_| true)?;
        }
        for w in needed
            .iter()
            .flat_map(|&d| p.graph.nodes[d].defines())
            .chain(p.mask_input)
        {
            if w != v && self.side_reads.get(&w).is_none_or(|&last| last < at) {
                env.local[w] = None;
            }
        }
        Ok(())
    }
}

/// An engine error without its closing hint: it suggests anomaly detection to find the
/// operation, which the node the error now names has done.
fn without_hint(why: &str) -> String {
    let why = why.split(" Hint: ").next().unwrap_or(why);
    why.trim_end_matches('.').to_string()
}
