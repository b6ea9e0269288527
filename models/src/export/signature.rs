//! The program's signature: its parameters, buffers and tensor constants registered in the
//! chain's var store under their PyTorch names (a tied tensor once), its user inputs (the batch,
//! and for token ids their attention mask), its outputs, and the buffers it writes back.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use serde_json::Value as Json;
use tch::{nn, Tensor};

use super::archive::Archive;
use super::graph::{Graph, Input};
use crate::error::{ModelError, Result};
use crate::options::ModelOptions;

/// What the signature says, with the tensors registered.
pub(super) struct Signature {
    pub vs: nn::VarStore,
    /// Per value: the parameter, buffer or constant it is, else `None`.
    pub statics: Vec<Option<Tensor>>,
    /// Parameters of the program (a tied tensor counted once).
    pub reference_params: i64,
    /// Values whose result the signature writes back to a buffer, with the buffer.
    pub mutations: HashMap<usize, Tensor>,
    /// The input values of the buffers the program mutates.
    pub mutated: BTreeSet<usize>,
    /// The batch's input, its attention mask input if the program takes one, and the first
    /// user output.
    pub input: usize,
    pub mask_input: Option<usize>,
    pub output: usize,
    /// Every tensor user output in program order, each once, the first `output`: what the loss
    /// reads (its floating-point ones, `io.rs`).
    pub outputs: Vec<usize>,
}

/// Reads the signature `sig` of `graph`, registering tensors from `ar` in a new var store.
pub(super) fn read(path: &Path, ar: &Archive, graph: &Graph, sig: &Json, opts: &ModelOptions) -> Result<Signature> {
    let vs = nn::VarStore::new(opts.device);
    let inputs = register_inputs(path, ar, graph, sig, &vs, opts)?;
    let outputs = read_outputs(path, graph, sig, &inputs.by_fqn)?;
    let (input, mask_input, output) = which_inputs(path, &inputs.user_inputs, &outputs.user_outputs)?;
    let mut tensor_outputs: Vec<usize> = Vec::new();
    for o in &outputs.user_outputs {
        if let Input::Tensor(v) = o {
            if !tensor_outputs.contains(v) {
                tensor_outputs.push(*v);
            }
        }
    }
    Ok(Signature {
        vs,
        statics: inputs.statics,
        reference_params: inputs.reference_params,
        mutations: outputs.mutations,
        mutated: outputs.mutated,
        input,
        mask_input,
        output,
        outputs: tensor_outputs,
    })
}

fn bad(path: &Path, reason: String) -> ModelError {
    ModelError::BadExport {
        path: path.to_path_buf(),
        reason,
    }
}

/// The input specs' tensors as registered, and the user inputs.
struct Inputs {
    statics: Vec<Option<Tensor>>,
    /// Each parameter, buffer and constant by its qualified name, with its input value.
    by_fqn: HashMap<String, (Tensor, usize)>,
    user_inputs: Vec<usize>,
    reference_params: i64,
}

fn register_inputs(
    path: &Path,
    ar: &Archive,
    graph: &Graph,
    sig: &Json,
    vs: &nn::VarStore,
    opts: &ModelOptions,
) -> Result<Inputs> {
    let bad = |reason: String| bad(path, reason);
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
    let meta_ties = if ar.on_meta {
        tied_on_meta(ar, graph, &specs)
    } else {
        HashMap::new()
    };
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
        let place = match meta_ties.get(&fqn) {
            Some(tied) => tied.clone(),
            None => ar.storage.get(&fqn).cloned().unwrap_or_default(),
        };
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
            register(vs, &fqn, t, true)
        } else if kind == "buffer" {
            let t = if t.is_floating_point() { t.to_kind(opts.kind) } else { t };
            register(vs, &fqn, t, false)
        } else {
            t
        };
        by_fqn.insert(fqn, (t.shallow_clone(), v));
        tied.insert(place, t.shallow_clone());
        statics[v] = Some(t);
    }
    Ok(Inputs {
        statics,
        by_fqn,
        user_inputs,
        reference_params,
    })
}

/// Ties in a program exported on the meta device, as the places of the parameters tied to
/// another: there every tensor's data file is the same empty one, so the archive's places do
/// not say which parameters share a tensor. torch.export reads a tied parameter through one
/// placeholder and never reads the other (GPT-2's `transformer.wte.weight` beside
/// `lm_head.weight`), so a parameter no node reads is taken as tied to a read one of the same
/// dtype, sizes and strides. (A parameter of a module that forward never calls, untied, would
/// be counted once too few.) Buffers and constants are never taken as tied: an unread buffer
/// is common (transformers' `original_inv_freq`) and a tied one rare.
fn tied_on_meta(ar: &Archive, graph: &Graph, specs: &[Json]) -> HashMap<String, String> {
    let params: Vec<(&str, bool)> = specs
        .iter()
        .zip(&graph.inputs)
        .filter_map(|(spec, &v)| {
            let fqn = spec.get("parameter")?.get("parameter_name")?.as_str()?;
            Some((fqn, graph.last_use[v].is_some()))
        })
        .collect();
    let layout = |fqn: &str| ar.tensors.get(fqn).map(|t| (t.kind(), t.size(), t.stride()));
    let mut ties = HashMap::new();
    for &(fqn, read) in &params {
        if read || layout(fqn).is_none() {
            continue;
        }
        let partner = params
            .iter()
            .find(|&&(other, other_read)| other_read && layout(other) == layout(fqn));
        if let Some(place) = partner.and_then(|(other, _)| ar.storage.get(*other)) {
            ties.insert(fqn.to_owned(), place.clone());
        }
    }
    ties
}

/// The output specs: the user outputs, and the buffers written back.
struct Outputs<'g> {
    user_outputs: Vec<&'g Input>,
    mutations: HashMap<usize, Tensor>,
    mutated: BTreeSet<usize>,
}

fn read_outputs<'g>(
    path: &Path,
    graph: &'g Graph,
    sig: &Json,
    by_fqn: &HashMap<String, (Tensor, usize)>,
) -> Result<Outputs<'g>> {
    let bad = |reason: String| bad(path, reason);
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
    Ok(Outputs {
        user_outputs,
        mutations,
        mutated,
    })
}

/// The batch's input and the mask input among the user inputs, and the first user output.
fn which_inputs(path: &Path, user_inputs: &[usize], user_outputs: &[&Input]) -> Result<(usize, Option<usize>, usize)> {
    let bad = |reason: String| bad(path, reason);
    let (input, mask_input) = match user_inputs {
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
    Ok((input, mask_input, *output))
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
