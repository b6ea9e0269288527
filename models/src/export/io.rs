//! What a program takes and what its loss is: the input's shape (images, features or token ids,
//! the batch dimension dynamic or matching `--batch`), the vocabulary of the embedding that
//! reads token ids, and the loss on the outputs — cross-entropy against random targets on the
//! first when it ends in a class dimension or the vocabulary, else its sum, plus the sum of
//! every further floating-point output.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value as Json;
use tch::{Kind, Tensor};

use super::archive::Archive;
use super::graph::{Graph, Input, Target};
use super::signature::Signature;
use crate::chain::{Batch, InputSpec, LossHead, TokenTargets};
use crate::error::{ModelError, Result};
use crate::options::ModelOptions;

/// The input spec and loss of a program.
pub(super) struct Io {
    /// The exported input's sizes, the batch dimension `None` when dynamic.
    pub in_sizes: Vec<Option<i64>>,
    pub spec: InputSpec,
    pub loss: ExportLoss,
}

pub(super) fn input_and_loss(
    path: &Path,
    ar: &Archive,
    graph: &Graph,
    sig: &Signature,
    opts: &ModelOptions,
) -> Result<Io> {
    let bad = |reason: String| ModelError::BadExport {
        path: path.to_path_buf(),
        reason,
    };
    let (input, output, mask_input) = (sig.input, sig.output, sig.mask_input);
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

    let vocab = token_vocab(graph, &sig.statics, input);
    let last = out_sizes.last().copied().flatten();
    let (first, classes) = match (out_sizes.len(), last) {
        (2, Some(c)) => (FirstTerm::CrossEntropy, c),
        (3, Some(v)) if Some(v) == vocab => (FirstTerm::CrossEntropy, v),
        _ => (FirstTerm::Sum, 1),
    };
    let mut outputs = vec![output];
    outputs.extend(
        sig.outputs.iter().copied().filter(|&v| {
            v != output && sizes_of(&ar.model, &graph.names[v]).is_some_and(|(_, dtype)| is_floating(dtype))
        }),
    );
    let loss = ExportLoss {
        first,
        outputs,
        reads: Vec::new(),
        extra_reads: Vec::new(),
        terms: Vec::new(),
    };
    let floating = is_floating(in_dtype);
    let spec = match (sample.as_slice(), floating) {
        ([c, h, w], true) if h == w => InputSpec::Image {
            channels: *c,
            size: *h,
            classes,
        },
        ([f], true) => InputSpec::Features { features: *f, classes },
        ([_, ..], true) => InputSpec::Tensor {
            sizes: sample.clone(),
            classes,
        },
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
                "input of sizes [batch, {sample:?}] is not supported (a floating-point tensor with a \
                 batch dimension and at least one more, or integer token ids [batch, seq])"
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
    Ok(Io { in_sizes, spec, loss })
}

/// The vocabulary of the embedding that reads the token ids `input`, directly or through
/// reshapes of them (transformers' GPT-2 embeds `input_ids.view(-1, seq)`).
fn token_vocab(graph: &Graph, statics: &[Option<Tensor>], input: usize) -> Option<i64> {
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
    graph.nodes.iter().find_map(|n| match &n.target {
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
    })
}

/// Whether a dtype of torch.export's serialized `ScalarType` is floating point (half, float,
/// double, bfloat16).
fn is_floating(dtype: i64) -> bool {
    matches!(dtype, 6 | 7 | 8 | 13)
}

/// The loss of an exported model: the first output's term, plus the sum of every further
/// floating-point output (a program with several outputs: BertModel's `pooler_output`, CLIP's
/// pooled output, GoogLeNet's auxiliary logits in training mode), summed in program order in
/// float32. A further output counts as a single output that is not logits counts, so each gets a
/// gradient of ones, and checkpointing has to recompute what makes it; one made in a block that
/// hands on another tensor is a further output of that block.
pub(super) struct ExportLoss {
    pub first: FirstTerm,
    /// The outputs the loss reads, in program order: the first output, then every further
    /// floating-point one.
    pub outputs: Vec<usize>,
    /// Blocks other than the last whose outputs the loss reads ([`LossHead::reads`]).
    pub reads: Vec<usize>,
    /// Further outputs the loss reads ([`LossHead::extra_reads`]).
    pub extra_reads: Vec<(usize, usize)>,
    /// Per output of `outputs`: `None` for the last block's output, else its index in `reads`
    /// followed by `extra_reads`.
    pub terms: Vec<Option<usize>>,
}

/// The first output's term of the loss (see the module docs).
#[derive(Debug, Clone, Copy)]
pub(super) enum FirstTerm {
    CrossEntropy,
    Sum,
}

impl FirstTerm {
    fn of(self, output: &Tensor, batch: &Batch) -> Tensor {
        match self {
            FirstTerm::CrossEntropy => {
                let classes = output.size().last().copied().unwrap_or(1);
                output
                    .reshape([-1, classes])
                    .to_kind(Kind::Float)
                    .cross_entropy_for_logits(&batch.target.reshape([-1]))
            }
            FirstTerm::Sum => output.to_kind(Kind::Float).sum(Kind::Float),
        }
    }
}

impl LossHead for ExportLoss {
    fn loss(&self, output: &Tensor, batch: &Batch) -> Tensor {
        self.loss_over(output, &[], batch)
    }

    fn reads(&self) -> &[usize] {
        &self.reads
    }

    fn extra_reads(&self) -> &[(usize, usize)] {
        &self.extra_reads
    }

    fn loss_over(&self, output: &Tensor, reads: &[Tensor], batch: &Batch) -> Tensor {
        let tensor = |term: Option<usize>| term.and_then(|j| reads.get(j)).unwrap_or(output);
        let mut terms = self.terms.iter().map(|&t| tensor(t));
        let first = self.first.of(terms.next().unwrap_or(output), batch);
        terms.fold(first, |loss, t| loss + t.to_kind(Kind::Float).sum(Kind::Float))
    }
}

/// A tensor's sizes from the graph's `tensor_values`; symbolic ones as `None`.
pub(super) fn sizes_of(model: &Json, name: &str) -> Option<(Vec<Option<i64>>, i64)> {
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
