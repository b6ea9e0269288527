//! Building an inferred architecture and copying a state dict's tensors into it: every
//! variable set (or one that may keep its initial value), every key used (or derived data), a
//! tied embedding a file left out restored from `lm_head.weight`. In fake mode the file gives
//! shapes only and nothing is copied: the chain's fake variables already have the shapes and
//! dtypes a copy would leave them with.

use std::collections::BTreeMap;
use std::path::Path;

use crate::architecture::Architecture;
use crate::chain::Chain;
use crate::error::{ModelError, Result};
use crate::infer::{outer, Inferred};
use crate::options::ModelOptions;
use crate::weights::{same_values, StateDict, Weight};

/// A model read from a state-dict file, with what loading it found.
#[derive(Debug)]
pub struct Loaded {
    pub chain: Chain,
    pub architecture: Architecture,
    /// Prefix stripped from the backbone's keys (`bert.`, `transformer.`, `module.`).
    pub prefix: Option<String>,
    /// Keys read but not needed: buffers that Hugging Face derives and older versions saved
    /// (`embeddings.position_ids`, GPT-2's `h.N.attn.bias` / `h.N.attn.masked_bias`) and
    /// `lm_head.weight`, checked equal to the `wte.weight` it is tied to.
    pub ignored: Vec<String>,
    /// Variables the file did not set, which keep their initial value: the loss head's
    /// (`classifier.*`, added only to have a loss) and `num_batches_tracked` missing from
    /// old torchvision checkpoints (0, as PyTorch's BatchNorm loads such files).
    pub defaulted: Vec<String>,
    /// Input embeddings a tied model's file left out, restored from its `lm_head.weight`.
    pub restored: Vec<String>,
    /// A Hugging Face config without weights: the model has seeded random weights (memory
    /// and time do not depend on the values), which the CLI can say.
    pub random_weights: bool,
}

/// Builds `inferred` and copies `tensors` (the file's, with their shapes `shapes`) into it:
/// every variable must be set (or be one that may keep its initial value) and every key used
/// (or be derived data), else [`ModelError::KeyMismatch`] lists them.
pub(crate) fn assemble(
    path: &Path,
    tensors: StateDict,
    shapes: &BTreeMap<String, Vec<i64>>,
    mut inferred: Inferred,
    restored: Vec<String>,
    opts: &ModelOptions,
) -> Result<Loaded> {
    // Options that contradict the file are errors; the head count is fixed by now.
    let file_classes = match &inferred.architecture {
        Architecture::ResNet(c) => Some(("fc.weight", c.num_classes)),
        Architecture::Bert(c) => {
            let outer = outer(inferred.prefix.as_deref().unwrap_or_default());
            shapes
                .contains_key(&format!("{outer}classifier.weight"))
                .then_some(("classifier.weight", c.num_labels))
        }
        Architecture::Gpt2(_) | Architecture::Llama(_) => None,
    };
    if let (Some(want), Some((key, have))) = (opts.classes, file_classes) {
        if want != have {
            return Err(ModelError::InvalidOption {
                model: path.display().to_string(),
                option: "classes",
                value: want.to_string(),
                why: format!("the state dict's {key} has {have} classes"),
            });
        }
    }
    if let (Architecture::Bert(c), None, Some(classes)) = (&mut inferred.architecture, file_classes, opts.classes) {
        // No classifier in the file: the head is new, sized by the option.
        c.num_labels = classes;
    }
    let arch = &inferred.architecture;
    // The architecture now carries the classes and heads; `build` takes them from it.
    let opts = ModelOptions {
        classes: None,
        heads: None,
        ..opts.clone()
    };
    let chain = arch.build(&path.display().to_string(), &opts)?;

    // Backbone keys lose the prefix; head keys (`classifier.*`, `lm_head.weight`) sit beside
    // the backbone and lose only what wraps both (DataParallel's `module.`).
    let prefix = inferred.prefix.clone().unwrap_or_default();
    let outer = outer(&prefix);
    let mut by_name: BTreeMap<String, (String, Weight)> = BTreeMap::new();
    for (key, t) in tensors {
        let name = key
            .strip_prefix(prefix.as_str())
            .or_else(|| key.strip_prefix(outer))
            .unwrap_or(&key)
            .to_string();
        by_name.insert(name, (key, t));
    }
    let variables = chain.vs.variables();
    let (mut missing, mut mismatched, mut defaulted) = (vec![], vec![], vec![]);
    for (name, var) in &variables {
        match by_name.get(name) {
            Some((key, src)) if src.size() != var.size() => {
                mismatched.push(format!("{key}: file {:?} vs model {:?}", src.size(), var.size()));
            }
            Some((key, Weight::Values(src))) => {
                let mut var = var.shallow_clone();
                tch::no_grad(|| var.f_copy_(src))
                    .map_err(|e| ModelError::torch(format!("copying {key} of {} into {name}", path.display()), e))?;
            }
            Some((_, Weight::Shape { .. })) => {}
            None if may_default(arch, name) => defaulted.push(name.clone()),
            None => missing.push(format!("{prefix}{name}")),
        }
    }
    let (mut unexpected, mut ignored) = (vec![], vec![]);
    for (name, (key, src)) in &by_name {
        if variables.contains_key(name) {
            continue;
        }
        match derived(arch, name) {
            Derived::No => unexpected.push(key.clone()),
            Derived::Yes => ignored.push(key.clone()),
            Derived::TiedTo(target) => {
                let tied = match src {
                    Weight::Values(src) => variables.get(target).is_some_and(|w| {
                        w.size() == src.size() && w.f_to_kind(src.kind()).and_then(|w| w.f_equal(src)).unwrap_or(false)
                    }),
                    // Fake variables have no values: the file's own tensor for the target.
                    Weight::Shape { .. } => match by_name.get(target) {
                        Some((_, w)) => same_values(path, w, src)?,
                        None => false,
                    },
                };
                if tied {
                    ignored.push(key.clone());
                } else {
                    mismatched.push(format!(
                        "{key}: not equal to {prefix}{target}; ckptune ties the LM head to {target} as \
                         GPT2LMHeadModel does"
                    ));
                }
            }
        }
    }
    if !(missing.is_empty() && unexpected.is_empty() && mismatched.is_empty()) {
        missing.sort();
        unexpected.sort();
        mismatched.sort();
        return Err(ModelError::KeyMismatch {
            path: path.to_path_buf(),
            arch: arch.describe(),
            missing,
            unexpected,
            mismatched,
        });
    }
    defaulted.sort();
    Ok(Loaded {
        chain,
        architecture: inferred.architecture,
        prefix: inferred.prefix,
        ignored,
        defaulted,
        restored,
        random_weights: false,
    })
}

/// Puts back an input embedding that a file of a tied model left out because it equals
/// `lm_head.weight` (GPT-2's `wte.weight`, Llama's `model.embed_tokens.weight`; savers that
/// drop one of two shared tensors may drop either). Returns the keys it added.
pub(crate) fn restore_tied_embedding(tensors: &mut StateDict) -> Vec<String> {
    let has = |tensors: &[(String, Weight)], k: &str| tensors.iter().any(|(key, _)| key == k);
    let Some((head_key, head)) = tensors
        .iter()
        .find(|(k, _)| k == "lm_head.weight" || k.ends_with(".lm_head.weight"))
        .map(|(k, t)| (k.clone(), t.share()))
    else {
        return Vec::new();
    };
    let outer = &head_key[..head_key.len() - "lm_head.weight".len()];
    // The family's embedding, named from a key only it has: GPT-2's `wpe.weight` (under any
    // backbone prefix), Llama's `model.norm.weight`.
    let embed = if let Some(wpe) = tensors.iter().map(|(k, _)| k).find(|k| k.ends_with("wpe.weight")) {
        format!("{}wte.weight", &wpe[..wpe.len() - "wpe.weight".len()])
    } else if has(tensors, &format!("{outer}model.norm.weight")) {
        format!("{outer}model.embed_tokens.weight")
    } else {
        return Vec::new();
    };
    if has(tensors, &embed) {
        return Vec::new();
    }
    tensors.push((embed.clone(), head));
    vec![embed]
}

/// A variable the file may leave unset.
fn may_default(arch: &Architecture, name: &str) -> bool {
    match arch {
        Architecture::ResNet(_) => name.ends_with(".num_batches_tracked"),
        Architecture::Bert(_) => name.starts_with("classifier."),
        Architecture::Gpt2(_) | Architecture::Llama(_) => false,
    }
}

enum Derived {
    No,
    Yes,
    TiedTo(&'static str),
}

/// Whether a key the chain has no variable for is one that carries no information.
fn derived(arch: &Architecture, name: &str) -> Derived {
    match arch {
        Architecture::Bert(_) if name == "embeddings.position_ids" => Derived::Yes,
        Architecture::Gpt2(_) if name == "lm_head.weight" => Derived::TiedTo("wte.weight"),
        Architecture::Gpt2(_) => {
            let is_buffer = name
                .strip_prefix("h.")
                .and_then(|rest| rest.split_once('.'))
                .is_some_and(|(n, field)| {
                    n.parse::<u32>().is_ok() && (field == "attn.bias" || field == "attn.masked_bias")
                });
            if is_buffer {
                Derived::Yes
            } else {
                Derived::No
            }
        }
        Architecture::Llama(c) if c.tie_word_embeddings && name == "lm_head.weight" => {
            Derived::TiedTo("model.embed_tokens.weight")
        }
        // Older transformers saved each attention's rotary `inv_freq`, derived from the config.
        Architecture::Llama(_) if name.ends_with("rotary_emb.inv_freq") => Derived::Yes,
        _ => Derived::No,
    }
}
