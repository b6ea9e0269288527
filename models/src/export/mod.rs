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
//! vocabulary of the embedding that reads the input (`[batch, seq, vocab]`), else its sum.

mod archive;
mod graph;

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};

use serde_json::Value as Json;
use tch::{nn, Kind, Tensor};

pub use archive::is_export_archive;
use graph::{Env, Graph, GraphError, Input, Target};

use crate::chain::{Batch, Block, Chain, ChainBlock, ChainGroup, Ctx, InputSpec, LossHead, TokenTargets};
use crate::error::{ModelError, Result};
use crate::options::{Granularity, ModelOptions};

/// The parsed program every block of a chain shares.
struct Program {
    graph: Graph,
    /// Per value: the parameter, buffer or constant it is (a var-store tensor), else `None`.
    statics: Vec<Option<Tensor>>,
    /// Values whose result the graph signature writes back to a buffer (`buffer_mutation`).
    mutations: HashMap<usize, Tensor>,
    syms: Mutex<Vec<Option<i64>>>,
    /// The program's attention-mask input, fed from the batch's mask, if it takes one.
    mask_input: Option<usize>,
    /// Nodes computed without the batch's data or the parameters (see `chain_from_export`): in
    /// no block; each block computes the ones it reads when it first reads them.
    side_nodes: Vec<bool>,
    side_values: Vec<bool>,
    /// Per value, the node that defines it.
    def: Vec<Option<usize>>,
}

// SAFETY: tensors are handles to refcounted libtorch tensors; the runtime runs blocks from one
// thread at a time (Block: Send, never Sync use), as it does for every chain.
unsafe impl Send for Program {}
unsafe impl Sync for Program {}

struct ExportBlock {
    prog: Arc<Program>,
    name: String,
    /// The value the block's input (`xs`) carries, if the block reads it.
    input: Option<usize>,
    /// The values the block's skips carry, in the order of its `ChainBlock::skips`.
    skips: Vec<usize>,
    output: usize,
    /// The nodes the block runs, in order: its own, and the side nodes inside its range that
    /// make what its own read (where the program computes them; side nodes of its range that
    /// only other blocks need are left to them).
    runs: Vec<usize>,
    /// Side values the nodes it runs read, with the last of those nodes that reads each: it is
    /// freed after that node, as a module's local would be. Those made outside the block are
    /// computed when first read (see [`ExportBlock::compute_side`]).
    side_reads: HashMap<usize, usize>,
    /// `(cast, source)`: no-op casts made in an earlier block that this block's nodes read; they
    /// read the source (see `alias_src` in `chain_from_export`).
    aliases: Vec<(usize, usize)>,
}

impl Block for ExportBlock {
    fn forward(&self, xs: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        let p = &self.prog;
        let mut env = Env {
            local: (0..p.graph.names.len()).map(|_| None).collect(),
            statics: &p.statics,
            syms: &p.syms,
        };
        if let Some(v) = self.input {
            env.local[v] = Some(ckptune_kernels::ops::Value::Tensor(xs.shallow_clone()));
        }
        for (k, &v) in self.skips.iter().enumerate() {
            env.local[v] = Some(ckptune_kernels::ops::Value::Tensor(ctx.skip(k).shallow_clone()));
        }
        for &(cast, src) in &self.aliases {
            if let Some(ckptune_kernels::ops::Value::Tensor(t)) = &env.local[src] {
                env.local[cast] = Some(ckptune_kernels::ops::Value::Tensor(t.shallow_clone()));
            }
        }
        let out = self.output;
        let keep = |v: usize| v == out || p.mutations.contains_key(&v);
        for &k in &self.runs {
            let reads = p.graph.nodes[k].reads();
            for &v in &reads {
                if p.side_values[v] && env.local[v].is_none() {
                    self.compute_side(v, k, &mut env, ctx);
                }
            }
            self.run(k, &mut env, &keep);
            for v in reads {
                if self.side_reads.get(&v) == Some(&k) {
                    env.local[v] = None;
                }
            }
        }
        // Buffer mutations (core ATen's functional batch norm returns the new running
        // statistics): the buffer takes the new value's storage with `set_data`, not `copy_`,
        // because the node's graph saved the old buffer for backward and an in-place copy would
        // bump its version and fail that backward (the runtime swaps snapshots the same way).
        for (v, buffer) in &p.mutations {
            let t = if *v == out {
                env.local[*v].as_ref().and_then(|t| match t {
                    ckptune_kernels::ops::Value::Tensor(t) => Some(t.shallow_clone()),
                    _ => None,
                })
            } else {
                match env.local[*v].take() {
                    Some(ckptune_kernels::ops::Value::Tensor(t)) => Some(t),
                    _ => None,
                }
            };
            if let Some(t) = t {
                buffer.shallow_clone().set_data(&t.detach());
            }
        }
        match env.local[out].take() {
            Some(ckptune_kernels::ops::Value::Tensor(t)) => t,
            other => panic!("block {} did not produce its output ({other:?})", self.name),
        }
    }
}

impl ExportBlock {
    /// Runs node `k`. Load-time checks covered every operator and argument kind; what fails here
    /// is a shape or dtype the exported example did not cover, reported with the node.
    fn run(&self, k: usize, env: &mut Env<'_>, keep: &dyn Fn(usize) -> bool) {
        if let Err(e) = self.prog.graph.run(k..k + 1, env, keep) {
            panic!("block {}: {}", self.name, describe(&e));
        }
    }

    /// Computes side value `v` and what it needs that this block does not hold yet, in program
    /// order, before node `at` reads it; the intermediates die at once unless the block's own
    /// nodes read them later.
    fn compute_side(&self, v: usize, at: usize, env: &mut Env<'_>, ctx: &Ctx<'_>) {
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
                panic!("block {} reads the attention mask, but the batch has none", self.name);
            };
            env.local[m] = Some(ckptune_kernels::ops::Value::Tensor(mask.shallow_clone()));
        }
        for &d in &needed {
            self.run(d, env, &|_| true);
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
    }
}

fn describe(e: &GraphError) -> String {
    match e {
        GraphError::Format(s) => s.clone(),
        GraphError::Unsupported { node, target, why } => format!("node {node} ({target}): {why}"),
    }
}

fn graph_err(path: &Path) -> impl Fn(GraphError) -> ModelError + '_ {
    move |e| match e {
        GraphError::Format(reason) => ModelError::BadExport {
            path: path.to_path_buf(),
            reason,
        },
        GraphError::Unsupported { node, target, why } => ModelError::ExportNode {
            path: path.to_path_buf(),
            node,
            target,
            why,
        },
    }
}

/// The loss of an exported model (see the module docs).
enum ExportLoss {
    CrossEntropy,
    Sum,
}

impl LossHead for ExportLoss {
    fn loss(&self, output: &Tensor, batch: &Batch) -> Tensor {
        match self {
            ExportLoss::CrossEntropy => {
                let classes = output.size().last().copied().unwrap_or(1);
                output
                    .reshape([-1, classes])
                    .to_kind(Kind::Float)
                    .cross_entropy_for_logits(&batch.target.reshape([-1]))
            }
            ExportLoss::Sum => output.to_kind(Kind::Float).sum(Kind::Float),
        }
    }
}

/// A tensor's sizes from the graph's `tensor_values`; symbolic ones as `None`.
fn sizes_of(model: &Json, name: &str) -> Option<(Vec<Option<i64>>, i64)> {
    let tv = model
        .get("graph_module")?
        .get("graph")?
        .get("tensor_values")?
        .get(name)?;
    let sizes = tv
        .get("sizes")?
        .as_array()?
        .iter()
        .map(|d| d.get("as_int").and_then(Json::as_i64))
        .collect();
    Some((sizes, tv.get("dtype").and_then(Json::as_i64).unwrap_or(0)))
}

fn register(vs: &nn::VarStore, name: &str, t: Tensor, trainable: bool) -> Tensor {
    let mut parts: Vec<&str> = name.split('.').collect();
    let leaf = parts.pop().unwrap_or(name);
    let mut p = vs.root();
    for part in parts {
        p = p.sub(part);
    }
    p.add(leaf, t, trainable)
}

/// Every module with the node range it covers, if its nodes form one contiguous run.
fn module_runs(g: &Graph) -> (Vec<String>, HashMap<String, (usize, usize)>) {
    let mut order = Vec::new();
    let mut seen: HashMap<String, (usize, usize, usize)> = HashMap::new();
    for (k, n) in g.nodes.iter().enumerate() {
        for m in &n.modules {
            if !seen.contains_key(m) {
                // Containers whose forward never runs (a ModuleList such as BERT's
                // `encoder.layer`) appear only as prefixes; they are modules all the same.
                let mut missing: Vec<String> = Vec::new();
                let mut a = parent(m);
                while !a.is_empty() && !seen.contains_key(a) && !order.iter().any(|o| o == a) {
                    missing.push(a.to_owned());
                    a = parent(a);
                }
                order.extend(missing.into_iter().rev());
            }
            let e = seen.entry(m.clone()).or_insert_with(|| {
                order.push(m.clone());
                (k, k, 0)
            });
            e.1 = k;
            e.2 += 1;
        }
    }
    let runs = seen
        .into_iter()
        .filter(|(_, (a, b, count))| b - a + 1 == *count)
        .map(|(m, (a, b, _))| (m, (a, b)))
        .collect();
    (order, runs)
}

fn parent(m: &str) -> &str {
    m.rfind('.').map_or("", |i| &m[..i])
}

fn children<'a>(m: &str, modules: &'a [String]) -> Vec<&'a String> {
    modules
        .iter()
        .filter(|c| parent(c) == m && !c.is_empty() && c.as_str() != m)
        .collect()
}

/// The repeated layers of a model, by this rule: a *layer container* is a module with children
/// whose names end in a number (`layer1.0`, `encoder.layer.3`, `model.layers.7`,
/// `encoder.layers.encoder_layer_5`), taking the outermost ones. If two or more containers whose
/// own names end in a number are siblings (torchvision ResNet's `layer1` … `layer4`) they are the
/// layers, as ckptune's built-in ResNets have it; otherwise the numbered children of the container
/// with the most of them are (BERT's `encoder.layer.N`, Llama's `model.layers.N`, ViT's
/// `encoder.layers.encoder_layer_N` rather than its `heads.0`, MobileNet's and EfficientNet's
/// `features.N` rather than `features` and `classifier`). Without any container the top-level
/// modules are. Only modules whose nodes form one contiguous run qualify.
pub fn layers(modules: &[String], runs: &HashMap<String, (usize, usize)>) -> Vec<String> {
    let numbered = |c: &str| {
        c.rsplit('.')
            .next()
            .is_some_and(|s| s.ends_with(|ch: char| ch.is_ascii_digit()))
    };
    let mut containers: Vec<&String> = modules
        .iter()
        .filter(|m| children(m, modules).iter().any(|c| numbered(c)))
        .collect();
    containers.retain(|c| {
        !modules
            .iter()
            .any(|o| o != *c && c.starts_with(&format!("{o}.")) && children(o, modules).iter().any(|x| numbered(x)))
    });
    // Sibling layers: numbered containers (`layer1`, `layer2`) sharing a parent.
    let mut by_parent: HashMap<&str, usize> = HashMap::new();
    for c in containers.iter().filter(|c| numbered(c)) {
        *by_parent.entry(parent(c)).or_default() += 1;
    }
    let siblings = |c: &str| numbered(c) && by_parent.get(parent(c)).is_some_and(|&n| n >= 2);
    let numbered_children = |c: &str| children(c, modules).into_iter().filter(|x| numbered(x)).count();
    // Among lone containers, the one(s) with the most numbered children hold the layers (a ViT's
    // `encoder.layers`, not its one-entry `heads` Sequential).
    let most = containers
        .iter()
        .filter(|c| !siblings(c))
        .map(|c| numbered_children(c))
        .max()
        .unwrap_or(0);
    let mut out: Vec<String> = Vec::new();
    for c in &containers {
        if siblings(c) {
            out.push((*c).clone());
        } else if numbered_children(c) == most {
            out.extend(children(c, modules).into_iter().filter(|x| numbered(x)).cloned());
        }
    }
    if out.is_empty() {
        out = children("", modules).into_iter().cloned().collect();
    }
    out.retain(|m| runs.contains_key(m));
    out
}

/// A chain unit before it becomes a block: node range, name, whether it is a candidate.
struct Unit {
    name: String,
    first: usize,
    last: usize,
    candidate: bool,
}

/// Cuts nodes `lo..=hi` into units: the given (disjoint, sorted) candidate runs inside it and the
/// glue between them, named after the modules its nodes belong to (`conv1+bn1+relu+maxpool`).
fn cut(g: &Graph, lo: usize, hi: usize, cands: &[(String, usize, usize)], depth: usize) -> Vec<Unit> {
    let mut units = Vec::new();
    let mut k = lo;
    let glue = |a: usize, b: usize| -> Unit {
        let mut names: Vec<String> = Vec::new();
        for n in &g.nodes[a..=b] {
            if let Some(m) = n.modules.get(depth) {
                if !names.contains(m) {
                    names.push(m.clone());
                }
            }
        }
        let name = if names.is_empty() {
            // Nodes of the enclosing module itself (a layer's residual sums): named after it.
            match g.nodes[a].modules.last() {
                Some(m) => format!("{m} ({})", g.nodes[a].name),
                None => format!("<{}>", g.nodes[a].name),
            }
        } else {
            names.join("+")
        };
        Unit {
            name,
            first: a,
            last: b,
            candidate: false,
        }
    };
    for (m, a, b) in cands.iter().filter(|(_, a, b)| *a >= lo && *b <= hi) {
        if *a > k {
            units.push(glue(k, a - 1));
        }
        units.push(Unit {
            name: m.clone(),
            first: *a,
            last: *b,
            candidate: true,
        });
        k = b + 1;
    }
    if k <= hi {
        units.push(glue(k, hi));
    }
    units
}

fn disjoint(mut cands: Vec<(String, usize, usize)>) -> Vec<(String, usize, usize)> {
    // Outermost first where runs nest: longer runs win, then order by position.
    cands.sort_by_key(|(_, a, b)| (*a, std::cmp::Reverse(*b)));
    let mut out: Vec<(String, usize, usize)> = Vec::new();
    for c in cands {
        if out.last().is_none_or(|l| c.1 > l.2) {
            out.push(c);
        }
    }
    out
}

/// Loads a `torch.export` archive as a chain.
pub fn chain_from_export(path: &Path, opts: &ModelOptions) -> Result<Chain> {
    let bad = |reason: String| ModelError::BadExport {
        path: path.to_path_buf(),
        reason,
    };
    let ar = archive::read(path)?;
    let gm = ar
        .model
        .get("graph_module")
        .ok_or_else(|| bad("model.json has no graph_module".into()))?;
    let graph = Graph::parse(gm.get("graph").ok_or_else(|| bad("no graph".into()))?).map_err(graph_err(path))?;
    graph.check_ops().map_err(graph_err(path))?;
    let sig = gm.get("signature").ok_or_else(|| bad("no graph signature".into()))?;

    // ---- parameters, buffers, constants, user inputs ----------------------------------------
    let vs = nn::VarStore::new(opts.device);
    let mut statics: Vec<Option<Tensor>> = (0..graph.names.len()).map(|_| None).collect();
    // Each parameter, buffer and constant by its qualified name, with its input value.
    let mut by_fqn: HashMap<String, (Tensor, usize)> = HashMap::new();
    // Each registered tensor by where its data lies in the archive.
    let mut tied: HashMap<String, Tensor> = HashMap::new();
    let mut user_inputs = Vec::new();
    let mut reference_params = 0i64;
    let specs = sig
        .get("input_specs")
        .and_then(Json::as_array)
        .cloned()
        .unwrap_or_default();
    if specs.len() != graph.inputs.len() {
        return Err(bad(format!(
            "{} input specs for {} graph inputs",
            specs.len(),
            graph.inputs.len()
        )));
    }
    for (spec, &v) in specs.iter().zip(&graph.inputs) {
        let (kind, body) = spec
            .as_object()
            .and_then(|o| o.iter().next())
            .ok_or_else(|| bad(format!("input spec {spec}")))?;
        let fqn_key = match kind.as_str() {
            "parameter" => "parameter_name",
            "buffer" => "buffer_name",
            "tensor_constant" => "tensor_constant_name",
            "user_input" => {
                user_inputs.push(v);
                continue;
            }
            // Specialized into the graph (see Graph::parse); nothing to feed.
            "constant_input" => continue,
            other => {
                return Err(bad(format!(
                    "input {} is a {other}, which ckptune does not support (parameters, buffers, tensor \
                     constants and tensor inputs are)",
                    graph.names[v]
                )))
            }
        };
        let fqn = body.get(fqn_key).and_then(Json::as_str).unwrap_or_default().to_owned();
        let t = ar
            .tensors
            .get(&fqn)
            .ok_or_else(|| bad(format!("{kind} {fqn} has no data in the archive")))?;
        // A tied tensor (the same data under two names) is one tensor, registered under the
        // first name, as `model.parameters()` yields it once: one parameter, one gradient, one
        // optimizer state, whichever name the graph reads it by.
        let place = ar.storage.get(&fqn).cloned().unwrap_or_default();
        if let Some(shared) = tied.get(&place) {
            let shared: &Tensor = shared;
            by_fqn.insert(fqn, (shared.shallow_clone(), v));
            statics[v] = Some(shared.shallow_clone());
            continue;
        }
        let t = t.to_device(opts.device);
        let t = if kind == "parameter" {
            reference_params += t.numel() as i64;
            let t = if t.is_floating_point() { t.to_kind(opts.kind) } else { t };
            register(&vs, &fqn, t, true)
        } else if kind == "buffer" {
            let t = if t.is_floating_point() { t.to_kind(opts.kind) } else { t };
            register(&vs, &fqn, t, false)
        } else {
            t
        };
        by_fqn.insert(fqn, (t.shallow_clone(), v));
        tied.insert(place, t.shallow_clone());
        statics[v] = Some(t);
    }
    let mut mutations = HashMap::new();
    // The input values of the buffers the program mutates.
    let mut mutated: BTreeSet<usize> = BTreeSet::new();
    let mut user_outputs = Vec::new();
    let mut graph_out = graph.outputs.iter();
    for spec in sig.get("output_specs").and_then(Json::as_array).into_iter().flatten() {
        let out = graph_out.next();
        let (kind, body) = spec
            .as_object()
            .and_then(|o| o.iter().next())
            .ok_or_else(|| bad(format!("output spec {spec}")))?;
        match (kind.as_str(), out) {
            ("user_output", Some(o)) => user_outputs.push(o),
            ("buffer_mutation", Some(Input::Tensor(v))) => {
                let fqn = body.get("buffer_name").and_then(Json::as_str).unwrap_or_default();
                let (buf, input) = by_fqn
                    .get(fqn)
                    .ok_or_else(|| bad(format!("buffer mutation of unknown buffer {fqn}")))?;
                mutations.insert(*v, buf.shallow_clone());
                mutated.insert(*input);
            }
            (other, _) => {
                return Err(bad(format!(
                    "output kind {other} is not supported (user outputs and buffer mutations are); \
                     export the model in training mode without mutating its inputs"
                )))
            }
        }
    }
    let (input, mask_input) = match user_inputs.as_slice() {
        [input] => (*input, None),
        [input, mask] => (*input, Some(*mask)),
        _ => {
            return Err(bad(format!(
                "the program takes {} tensor inputs; ckptune feeds one (export with args=(batch,)), or \
                 token ids and their attention mask (args=(input_ids, attention_mask))",
                user_inputs.len()
            )))
        }
    };
    let Some(Input::Tensor(output)) = user_outputs.first() else {
        return Err(bad("the program's first output is not a tensor".into()));
    };
    let output = *output;

    // ---- batch dimension ----------------------------------------------------------------------
    let (in_sizes, in_dtype) =
        sizes_of(&ar.model, &graph.names[input]).ok_or_else(|| bad("no shape for the input".into()))?;
    if let Some(Some(exported)) = in_sizes.first() {
        if opts.batch != Some(*exported) {
            return Err(ModelError::StaticBatch {
                path: path.to_path_buf(),
                exported: *exported,
                requested: opts.batch,
            });
        }
    }
    if in_sizes.iter().skip(1).any(Option::is_none) {
        return Err(bad(
            "only the batch dimension (dim 0) of the input may be dynamic".into()
        ));
    }
    let sample: Vec<i64> = in_sizes.iter().skip(1).map(|s| s.unwrap_or(1)).collect();
    let (out_sizes, _) = sizes_of(&ar.model, &graph.names[output]).unwrap_or_default();

    // ---- input and loss -------------------------------------------------------------------------
    // The embedding that reads the token ids, directly or through reshapes of them
    // (transformers' GPT-2 embeds `input_ids.view(-1, seq)`).
    let reshape_of: HashMap<usize, usize> = graph
        .nodes
        .iter()
        .filter_map(|n| match (&n.target, n.args.first(), &n.defines()[..]) {
            (Target::Op { name, .. }, Some((_, Input::Tensor(src))), [out])
                if matches!(
                    name.as_str(),
                    "aten::view"
                        | "aten::reshape"
                        | "aten::_unsafe_view"
                        | "aten::unsqueeze"
                        | "aten::squeeze"
                        | "aten::flatten"
                        | "aten::contiguous"
                        | "aten::alias"
                ) =>
            {
                Some((*out, *src))
            }
            _ => None,
        })
        .collect();
    let is_input = |mut v: usize| {
        while let Some(&src) = reshape_of.get(&v) {
            v = src;
        }
        v == input
    };
    let vocab = graph.nodes.iter().find_map(|n| match &n.target {
        Target::Op { name, .. } if name == "aten::embedding" => {
            let reads_input = n
                .args
                .iter()
                .any(|(a, i)| a == "indices" && matches!(i, Input::Tensor(v) if is_input(*v)));
            let weight = n.args.iter().find_map(|(a, i)| match i {
                Input::Tensor(w) if a == "weight" => statics[*w].as_ref().map(|t| t.size()[0]),
                _ => None,
            });
            reads_input.then_some(weight).flatten()
        }
        _ => None,
    });
    let last = out_sizes.last().copied().flatten();
    let (loss, classes) = match (out_sizes.len(), last) {
        (2, Some(c)) => (ExportLoss::CrossEntropy, c),
        (3, Some(v)) if Some(v) == vocab => (ExportLoss::CrossEntropy, v),
        _ => (ExportLoss::Sum, 1),
    };
    let floating = matches!(in_dtype, 6 | 7 | 8 | 13);
    let spec = match (sample.as_slice(), floating) {
        ([c, h, w], true) if h == w => InputSpec::Image {
            channels: *c,
            size: *h,
            classes,
        },
        ([f], true) => InputSpec::Features { features: *f, classes },
        ([s], false) => InputSpec::Tokens {
            seq: *s,
            vocab: vocab.ok_or_else(|| bad("an integer input that no aten.embedding reads".into()))?,
            targets: if out_sizes.len() == 3 {
                TokenTargets::PerToken
            } else {
                TokenTargets::Classes(classes)
            },
        },
        _ => {
            return Err(bad(format!(
                "input of sizes [batch, {sample:?}] is not supported (images [batch, c, h, h], features \
                 [batch, f] or token ids [batch, seq])"
            )))
        }
    };

    if let Some(m) = mask_input {
        let (mask_sizes, mask_dtype) =
            sizes_of(&ar.model, &graph.names[m]).ok_or_else(|| bad("no shape for the second input".into()))?;
        let is_int = matches!(mask_dtype, 1..=5);
        if !matches!(spec, InputSpec::Tokens { .. }) || !is_int || mask_sizes.len() != 2 || mask_sizes[1] != in_sizes[1]
        {
            return Err(bad(format!(
                "a second input {} is taken to be the attention mask of token ids: it must be an \
                 integer [batch, seq] like the first, which must be token ids",
                graph.names[m]
            )));
        }
    }
    // Side nodes: what the program computes without the batch's data or the parameters, from
    // the mask input, constant buffers, sizes and literals alone (an attention bias, a causal
    // mask, position ids, rotary cos/sin). Models compute these once and every layer reads them;
    // here each block that reads one computes it (see `ExportBlock::forward`), so blocks hand
    // on one tensor. Nodes reading a buffer the program mutates are never side nodes (the value
    // depends on when it is read).
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
            side_values[v]
                || !graph.is_tensor[v]
                || statics[v]
                    .as_ref()
                    .is_some_and(|t| !t.requires_grad() && !mutated.contains(&v))
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

    // ---- candidates and blocks ----------------------------------------------------------------
    let (modules, runs) = module_runs(&graph);
    let run_of = |m: &String| runs.get(m).map(|&(a, b)| (m.clone(), a, b));
    let n = graph.nodes.len();
    let mut units: Vec<Unit>;
    let mut group_units: Vec<(String, usize, usize)> = Vec::new(); // (name, first unit, last unit)
    if let Some(re) = &opts.candidates {
        let re = regex::Regex::new(&format!("^(?:{re})$")).map_err(|e| ModelError::InvalidOption {
            model: path.display().to_string(),
            option: "candidates",
            value: re.clone(),
            why: e.to_string(),
        })?;
        let chosen: Vec<_> = modules.iter().filter(|m| re.is_match(m)).filter_map(run_of).collect();
        if chosen.is_empty() {
            return Err(ModelError::InvalidOption {
                model: path.display().to_string(),
                option: "candidates",
                value: re.to_string(),
                why: "no module whose nodes form one contiguous run matches it".into(),
            });
        }
        units = cut(&graph, 0, n - 1, &disjoint(chosen), 0);
    } else {
        let layer_runs: Vec<_> = layers(&modules, &runs).iter().filter_map(run_of).collect();
        let layer_runs = disjoint(layer_runs);
        match opts.granularity {
            Granularity::Layer => units = cut(&graph, 0, n - 1, &layer_runs, 0),
            Granularity::Block | Granularity::Nested => {
                units = Vec::new();
                let outer = cut(&graph, 0, n - 1, &layer_runs, 0);
                for u in outer {
                    if !u.candidate {
                        units.push(u);
                        continue;
                    }
                    let kids: Vec<_> = children(&u.name, &modules).into_iter().filter_map(run_of).collect();
                    let depth = u.name.split('.').count();
                    let inner = cut(&graph, u.first, u.last, &disjoint(kids), depth);
                    // A layer of one child is not a group (a group spans two blocks or more):
                    // its child is the candidate, as in the built-in models.
                    let nested = opts.granularity == Granularity::Nested && inner.len() >= 2;
                    if inner.iter().any(|i| i.candidate) {
                        if nested {
                            group_units.push((u.name.clone(), units.len(), units.len() + inner.len() - 1));
                        }
                        units.extend(inner);
                    } else {
                        units.push(u);
                    }
                }
            }
        }
    }

    units.retain(|u| (u.first..=u.last).any(|k| !side_nodes[k]));

    // ---- dataflow between blocks ----------------------------------------------------------------
    let def = graph.definitions();
    let block_of_node = {
        let mut b = vec![0usize; n];
        for (i, u) in units.iter().enumerate() {
            b[u.first..=u.last].fill(i);
        }
        b
    };
    // Casts that were no-ops when the program was exported (`x.to(torch.float32)` of a float32
    // `x` returns `x` itself): tracing then has later readers of `x` read the cast, such as the
    // residual sum after a Llama RMSNorm, which casts its input first. A reader in another block
    // than the cast's reads the source instead, as the model's code does (`residual =
    // hidden_states` before the norm), so the cast is not handed on besides the norm's output.
    let alias_src: HashMap<usize, usize> = graph
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
                Some((_, Input::Tensor(v))) if statics[*v].is_none() && !side_values[*v] => *v,
                _ => return None,
            };
            let [out] = node.defines()[..] else {
                return None;
            };
            let same = sizes_of(&ar.model, &graph.names[src])
                .is_some_and(|a| sizes_of(&ar.model, &graph.names[out]).is_some_and(|b| a == b));
            same.then_some((out, src))
        })
        .collect();
    let read_as = |v: usize, k: usize| -> usize {
        let mut v = v;
        while let Some(&src) = alias_src.get(&v) {
            if def[v].map(|d| block_of_node[d]) == Some(block_of_node[k]) {
                break;
            }
            v = src;
        }
        v
    };
    // The last node reading each value: outputs other than the first (a model returning
    // `(logits, hidden)`) are computed but not handed on, as the loss reads only the first.
    let mut last_read: Vec<Option<usize>> = vec![None; graph.names.len()];
    for (k, node) in graph.nodes.iter().enumerate() {
        for v in node.reads() {
            last_read[read_as(v, k)] = Some(k);
        }
    }
    let mut outputs_of: Vec<usize> = Vec::with_capacity(units.len());
    for u in &units {
        let outs: BTreeSet<usize> = (u.first..=u.last)
            .filter(|&k| !side_nodes[k])
            .flat_map(|k| graph.nodes[k].defines())
            // A buffer's new value (core ATen's functional batch norm) is written back by the
            // block that makes it, not handed on.
            .filter(|&v| {
                graph.is_tensor[v]
                    && !mutations.contains_key(&v)
                    && (v == output || last_read[v].is_some_and(|l| l > u.last))
            })
            .collect();
        let outs: Vec<usize> = outs.into_iter().collect();
        match outs.as_slice() {
            [v] => outputs_of.push(*v),
            _ => {
                return Err(bad(format!(
                    "block {} (nodes {}..{}) hands {} tensors to later nodes ({}); ckptune passes one \
                     tensor between blocks: choose other candidates with --candidates REGEX",
                    u.name,
                    graph.nodes[u.first].name,
                    graph.nodes[u.last].name,
                    outs.len(),
                    outs.iter()
                        .map(|&v| graph.names[v].as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )))
            }
        }
    }
    if outputs_of.last() != Some(&output) {
        return Err(bad(format!(
            "the model's output {} is not made by its last block",
            graph.names[output]
        )));
    }
    let prog = Arc::new(Program {
        syms: Mutex::new(vec![None; graph.names.len()]),
        graph,
        statics,
        mutations,
        mask_input,
        side_nodes,
        side_values,
        def: def.clone(),
    });
    let g = &prog.graph;
    let mut blocks = Vec::with_capacity(units.len());
    for (i, u) in units.iter().enumerate() {
        let mut reads: BTreeSet<usize> = BTreeSet::new();
        // The side nodes of the range that the block's own nodes need, transitively.
        let mut local_side: BTreeSet<usize> = BTreeSet::new();
        let mut stack: Vec<usize> = (u.first..=u.last)
            .filter(|&k| !prog.side_nodes[k])
            .flat_map(|k| g.nodes[k].reads())
            .collect();
        while let Some(v) = stack.pop() {
            if let Some(d) = def[v].filter(|&d| prog.side_nodes[d] && (u.first..=u.last).contains(&d)) {
                if local_side.insert(d) {
                    stack.extend(g.nodes[d].reads());
                }
            }
        }
        let runs: Vec<usize> = (u.first..=u.last)
            .filter(|&k| !prog.side_nodes[k] || local_side.contains(&k))
            .collect();
        let mut side_reads: HashMap<usize, usize> = HashMap::new();
        let mut aliases: BTreeSet<(usize, usize)> = BTreeSet::new();
        for &k in &runs {
            for v in g.nodes[k].reads() {
                let v = match read_as(v, k) {
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
                    && def[v].is_none_or(|d| d < u.first)
                {
                    reads.insert(v);
                }
            }
        }
        let mut block_input = None;
        let mut skips = Vec::new();
        let mut skip_vals = Vec::new();
        for v in reads {
            if v == input {
                if i != 0 {
                    return Err(bad(format!(
                        "block {} reads the model's input {} although it is not the first block; \
                         ckptune feeds the input to the first block only",
                        u.name, g.names[v]
                    )));
                }
                block_input = Some(v);
                continue;
            }
            let j = def[v]
                .map(|d| block_of_node[d])
                .ok_or_else(|| bad(format!("block {} reads {}, which no node makes", u.name, g.names[v])))?;
            if i > 0 && j == i - 1 {
                block_input = Some(v);
            } else {
                skips.push(j);
                skip_vals.push(v);
            }
        }
        let mut cb = ChainBlock::new(
            u.name.clone(),
            u.candidate,
            Box::new(ExportBlock {
                prog: prog.clone(),
                name: u.name.clone(),
                input: block_input,
                skips: skip_vals,
                output: outputs_of[i],
                runs,
                side_reads,
                aliases: aliases.into_iter().collect(),
            }),
        );
        cb.skips = skips;
        blocks.push(cb);
    }
    let groups = group_units
        .into_iter()
        .map(|(name, first, last)| ChainGroup { name, first, last })
        .collect();
    let chain = Chain {
        name: path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string()),
        vs,
        blocks,
        groups,
        head: Box::new(loss),
        modules,
        input: spec,
        reference_params,
    };
    chain.validate().map_err(bad)?;
    trial_run(&chain, in_sizes.first().copied().flatten().unwrap_or(2)).map_err(bad)?;
    Ok(chain)
}

/// Runs the chain once on a sample batch, so that a node that fails (a dtype or shape the
/// operator rejects) is bad input at load time, named with its node, rather than a panic in
/// the middle of profiling. Buffers and the RNG are put back: the trial leaves no trace.
fn trial_run(chain: &Chain, batch: i64) -> std::result::Result<(), String> {
    let rng = ckptune_kernels::rng::cpu_state().map_err(|e| e.to_string())?;
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
    // A failing node is reported as an error below; the default hook would also print it as a
    // panic to stderr.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        tch::no_grad(|| {
            // Chain::forward_all, with the batch's raw mask in the context.
            let ctx = Ctx::new(None, true).with_batch_mask(sample.attention_mask.as_ref());
            let mut outs: Vec<Tensor> = Vec::with_capacity(chain.blocks.len());
            for (i, b) in chain.blocks.iter().enumerate() {
                let x = if i == 0 { &sample.input } else { &outs[i - 1] };
                let skips: Vec<Tensor> = b.skips.iter().map(|&s| outs[s].shallow_clone()).collect();
                let out = b.block.forward(x, &ctx.with_skips(&skips));
                outs.push(out);
            }
        })
    }))
    .map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        format!("running it on a sample batch of {batch} failed: {msg}")
    });
    std::panic::set_hook(hook);
    tch::no_grad(|| {
        for (t, saved) in &buffers {
            t.shallow_clone().copy_(saved);
        }
    });
    ckptune_kernels::rng::set_cpu_state(&rng).map_err(|e| e.to_string())?;
    result
}
