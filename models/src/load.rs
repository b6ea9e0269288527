//! Models from state-dict files: `.safetensors`, and `.pt`/`.pth`/`.bin` archives written by
//! `torch.save` of a plain `dict` of tensors. The architecture is inferred from key names and
//! shapes, the chain is built, and every weight is copied in; a key the chain does not use or
//! a variable the file does not set is an error naming them.
//!
//! Files are recognised by content, not extension. TorchScript archives are recognised and
//! returned as [`ModelError::TorchScript`] so that the caller routes them to the TorchScript
//! loader. `torch.save(model.state_dict())` pickles a `collections.OrderedDict`, which
//! libtorch's unpickler cannot read: that case gets an error saying how to re-save the file.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use tch::{Device, Tensor};

use crate::chain::Chain;
use crate::error::{first_line, ModelError, Result};
use crate::zoo::{Architecture, ModelOptions};
use crate::{bert, gpt2, resnet};

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
}

/// What the key names and shapes say.
#[derive(Debug, Clone, PartialEq)]
pub struct Inferred {
    pub architecture: Architecture,
    /// Prefix in front of the backbone's keys, including its final dot.
    pub prefix: Option<String>,
}

/// Builds the model a state-dict file holds, weights included. The chain is named after the
/// path. See [`load`] for what was stripped, ignored or left at its initial value.
pub fn from_file(path: impl AsRef<Path>, opts: &ModelOptions) -> Result<Chain> {
    load(path, opts).map(|loaded| loaded.chain)
}

/// [`from_file`] with the loading report.
pub fn load(path: impl AsRef<Path>, opts: &ModelOptions) -> Result<Loaded> {
    let path = path.as_ref();
    let tensors = read_state_dict(path)?;
    let shapes: BTreeMap<String, Vec<i64>> = tensors.iter().map(|(k, t)| (k.clone(), t.size())).collect();
    let mut inferred = infer(path, &shapes, opts.heads)?;

    // Options that contradict the file are errors; the head count is fixed by now.
    let file_classes = match &inferred.architecture {
        Architecture::ResNet(c) => Some(("fc.weight", c.num_classes)),
        Architecture::Bert(c) => {
            let outer = outer(inferred.prefix.as_deref().unwrap_or_default());
            shapes
                .contains_key(&format!("{outer}classifier.weight"))
                .then_some(("classifier.weight", c.num_labels))
        }
        Architecture::Gpt2(_) => None,
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
    let mut by_name: BTreeMap<String, (String, Tensor)> = BTreeMap::new();
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
            Some((key, src)) => {
                let mut var = var.shallow_clone();
                tch::no_grad(|| var.f_copy_(src))
                    .map_err(|e| ModelError::torch(format!("copying {key} of {} into {name}", path.display()), e))?;
            }
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
                let tied = variables.get(target).is_some_and(|w| {
                    w.size() == src.size() && w.f_to_kind(src.kind()).and_then(|w| w.f_equal(src)).unwrap_or(false)
                });
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
    })
}

/// What wraps both the backbone and its head: the prefix without its last component
/// (`module.bert.` → `module.`, `bert.` → ``).
fn outer(prefix: &str) -> &str {
    let trimmed = prefix.strip_suffix('.').unwrap_or(prefix);
    trimmed.rfind('.').map_or("", |i| &prefix[..=i])
}

/// A variable the file may leave unset.
fn may_default(arch: &Architecture, name: &str) -> bool {
    match arch {
        Architecture::ResNet(_) => name.ends_with(".num_batches_tracked"),
        Architecture::Bert(_) => name.starts_with("classifier."),
        Architecture::Gpt2(_) => false,
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
        _ => Derived::No,
    }
}

/// All tensors of a state-dict file, on the CPU, in file order.
pub fn read_state_dict(path: &Path) -> Result<Vec<(String, Tensor)>> {
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let bad = |reason: String| ModelError::BadFile {
        path: path.to_path_buf(),
        reason,
    };
    let mut head = Vec::with_capacity(16);
    File::open(path)
        .and_then(|f| f.take(16).read_to_end(&mut head))
        .map_err(io)?;
    if head.is_empty() {
        return Err(bad("the file is empty".into()));
    }
    if head.starts_with(b"PK\x03\x04") {
        return read_torch_zip(path);
    }
    if head.len() > 8 && head[8] == b'{' {
        return Tensor::read_safetensors(path)
            .map_err(|e| bad(format!("invalid safetensors file: {}", first_line(&e.to_string()))));
    }
    if head[0] == 0x80 {
        return Err(bad(
            "this is the legacy (pre-1.6, non-zip) torch.save format, which libtorch cannot read; \
             re-save it with a current PyTorch as torch.save(dict(state_dict), path) or as safetensors"
                .into(),
        ));
    }
    Err(bad(format!(
        "neither a safetensors file nor a torch.save zip archive (it starts with bytes {:02x?})",
        &head[..head.len().min(8)]
    )))
}

fn read_torch_zip(path: &Path) -> Result<Vec<(String, Tensor)>> {
    let bad = |reason: String| ModelError::BadFile {
        path: path.to_path_buf(),
        reason,
    };
    let file = File::open(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| bad(format!("corrupt zip archive: {e}")))?;
    let names: Vec<String> = zip.file_names().map(String::from).collect();
    // torch.jit.save writes `<archive>/constants.pkl` and `<archive>/code/…`; torch.save never does.
    if names
        .iter()
        .any(|n| n.ends_with("/constants.pkl") || n.contains("/code/"))
    {
        return Err(ModelError::TorchScript(path.to_path_buf()));
    }
    let Some(pickle) = names
        .iter()
        .find(|n| n.ends_with("/data.pkl") && n.matches('/').count() == 1)
        .cloned()
    else {
        return Err(bad("a zip archive without data.pkl: not written by torch.save".into()));
    };
    match Tensor::loadz_multi_with_device(path, Device::Cpu) {
        Ok(tensors) => Ok(tensors),
        Err(e) => {
            let message = first_line(&e.to_string());
            let mut data = Vec::new();
            let read = zip
                .by_name(&pickle)
                .map_err(std::io::Error::from)
                .and_then(|mut f| f.read_to_end(&mut data));
            if read.is_ok() && pickles_ordered_dict(&data) {
                return Err(ModelError::OrderedDict(path.to_path_buf()));
            }
            if message.contains("Expected Tensor but got") {
                return Err(bad(format!(
                    "it holds a dict whose values are not all tensors (a training checkpoint such as \
                     {{'model': ..., 'optimizer': ...}}?); save the model's weights alone with \
                     torch.save(dict(model.state_dict()), path) ({message})"
                )));
            }
            Err(bad(format!("libtorch cannot read it as a dict of tensors: {message}")))
        }
    }
}

/// Whether a pickle's top-level object is a `collections.OrderedDict`. (Every torch.save
/// pickle mentions OrderedDict somewhere — each tensor's empty backward-hooks dict — so only
/// the first object counts.) Protocol 2, torch.save's default, opens with PROTO then the
/// GLOBAL opcode `c` and `collections\nOrderedDict\n`; protocols 4 and 5 add a FRAME and name
/// the class with two SHORT_BINUNICODE strings (each maybe memoized) and STACK_GLOBAL.
fn pickles_ordered_dict(data: &[u8]) -> bool {
    let mut rest = data;
    if let [0x80, _, tail @ ..] = rest {
        rest = tail; // PROTO n
    }
    if let [0x95, tail @ ..] = rest {
        rest = tail.get(8..).unwrap_or_default(); // FRAME with an 8-byte length
    }
    if rest.starts_with(b"ccollections\nOrderedDict\n") {
        return true;
    }
    let short_unicode = |rest: &[u8], s: &[u8]| -> Option<usize> {
        let mut head = vec![0x8c, s.len() as u8];
        head.extend_from_slice(s);
        rest.starts_with(&head)
            .then(|| head.len() + usize::from(rest.get(head.len()) == Some(&0x94)))
    };
    match short_unicode(rest, b"collections") {
        Some(n) => short_unicode(&rest[n..], b"OrderedDict").is_some(),
        None => false,
    }
}

/// Infers the architecture from key names and shapes. `heads` is the attention head count
/// of a transformer (weights do not record it); `None` assumes the head size 64 of every
/// released BERT and GPT-2 (`hidden / 64`).
pub fn infer(path: &Path, shapes: &BTreeMap<String, Vec<i64>>, heads: Option<i64>) -> Result<Inferred> {
    let unknown = |reason: String| ModelError::UnknownArchitecture {
        path: path.to_path_buf(),
        reason,
    };
    // Each family by a key only it has; the prefix is what precedes it.
    let anchors: [(&str, &str); 3] = [
        ("ResNet", "layer1.0.conv1.weight"),
        ("BERT", "embeddings.word_embeddings.weight"),
        ("GPT-2", "wte.weight"),
    ];
    let mut found = vec![];
    for (family, anchor) in anchors {
        let prefix = shapes
            .keys()
            .filter_map(|k| k.strip_suffix(anchor))
            .filter(|p| p.is_empty() || p.ends_with('.'))
            .min_by_key(|p| p.len());
        if let Some(prefix) = prefix {
            found.push((family, prefix.to_string()));
        }
    }
    let (family, prefix) = match found.as_slice() {
        [one] => one.clone(),
        [] => {
            let sample = shapes.keys().take(5).cloned().collect::<Vec<_>>().join(", ");
            return Err(unknown(format!(
                "no key names a torchvision ResNet (layer1.0.conv1.weight), a BERT \
                 (embeddings.word_embeddings.weight) or a GPT-2 (wte.weight); the {} keys start: {sample}",
                shapes.len()
            )));
        }
        several => {
            let which = several
                .iter()
                .map(|(f, p)| format!("{f} under {p:?}"))
                .collect::<Vec<_>>()
                .join(", ");
            return Err(unknown(format!("keys of several models: {which}")));
        }
    };
    let keys = Keys {
        shapes,
        prefix: &prefix,
        path,
    };
    let architecture = match family {
        "ResNet" => Architecture::ResNet(infer_resnet(&keys)?),
        "BERT" => Architecture::Bert(infer_bert(&keys, heads)?),
        _ => Architecture::Gpt2(infer_gpt2(&keys, heads)?),
    };
    Ok(Inferred {
        architecture,
        prefix: (!prefix.is_empty()).then_some(prefix),
    })
}

/// Shape look-ups in the backbone's key space.
struct Keys<'a> {
    shapes: &'a BTreeMap<String, Vec<i64>>,
    prefix: &'a str,
    path: &'a Path,
}

impl Keys<'_> {
    fn unknown(&self, reason: String) -> ModelError {
        ModelError::UnknownArchitecture {
            path: self.path.to_path_buf(),
            reason,
        }
    }

    fn get(&self, name: &str) -> Option<&Vec<i64>> {
        self.shapes.get(&format!("{}{name}", self.prefix))
    }

    /// The shape of `name`, which must have `rank` dimensions.
    fn shape(&self, name: &str, rank: usize) -> Result<&[i64]> {
        let key = format!("{}{name}", self.prefix);
        match self.shapes.get(&key) {
            Some(s) if s.len() == rank => Ok(s),
            Some(s) => Err(self.unknown(format!("{key} has shape {s:?}, expected {rank} dimensions"))),
            None => Err(self.unknown(format!("key {key} is missing"))),
        }
    }

    /// The number of numbered children `{stem}.N.` (0..count must all exist).
    fn count(&self, stem: &str) -> Result<i64> {
        let lead = format!("{}{stem}.", self.prefix);
        let indices: BTreeSet<i64> = self
            .shapes
            .keys()
            .filter_map(|k| k.strip_prefix(lead.as_str()))
            .filter_map(|rest| rest.split('.').next()?.parse().ok())
            .collect();
        let count = indices.len() as i64;
        if let Some(gap) = (0..count).find(|i| !indices.contains(i)) {
            return Err(self.unknown(format!(
                "{lead}{gap} is missing although {count} entries of {lead}N exist"
            )));
        }
        Ok(count)
    }

    fn heads(&self, hidden: i64, heads: Option<i64>) -> Result<i64> {
        match heads {
            Some(h) => Ok(h),
            None if hidden % 64 == 0 => Ok(hidden / 64),
            None => Err(self.unknown(format!(
                "the attention head count is not stored in the weights and the hidden size {hidden} is not a \
                 multiple of 64 (the head size of every released BERT and GPT-2); set ModelOptions::heads"
            ))),
        }
    }
}

fn infer_resnet(k: &Keys<'_>) -> Result<resnet::Config> {
    let conv1 = k.shape("conv1.weight", 4)?;
    if conv1[1] != 3 || conv1[2..] != [7, 7] {
        return Err(k.unknown(format!(
            "conv1.weight has shape {conv1:?}; torchvision's stem is [C, 3, 7, 7]"
        )));
    }
    let mut layers = [0; 4];
    for (i, n) in layers.iter_mut().enumerate() {
        *n = k.count(&format!("layer{}", i + 1))?;
        if *n == 0 {
            return Err(k.unknown(format!("no residual block under layer{}", i + 1)));
        }
    }
    let inplanes = conv1[0];
    let block = if k.get("layer1.0.conv3.weight").is_some() {
        resnet::BlockKind::Bottleneck
    } else {
        resnet::BlockKind::Basic
    };
    let (mut groups, mut width_per_group) = (1, 64);
    if block == resnet::BlockKind::Bottleneck {
        // conv2 is [width, width / groups, 3, 3] with width = int(planes * wpg / 64) * groups.
        let conv2 = k.shape("layer1.0.conv2.weight", 4)?;
        let (width, per_group) = (conv2[0], conv2[1]);
        if per_group < 1 || width % per_group != 0 {
            return Err(k.unknown(format!(
                "layer1.0.conv2.weight has shape {conv2:?}: its groups do not divide its width"
            )));
        }
        groups = width / per_group;
        if (per_group * 64) % inplanes != 0 {
            return Err(k.unknown(format!(
                "layer1.0.conv2.weight has shape {conv2:?}: {per_group} channels per group is not a whole \
                 width_per_group for {inplanes} planes"
            )));
        }
        width_per_group = per_group * 64 / inplanes;
    }
    let fc = k.shape("fc.weight", 2)?;
    Ok(resnet::Config {
        block,
        layers,
        num_classes: fc[0],
        zero_init_residual: false,
        groups,
        width_per_group,
        inplanes,
    })
}

fn infer_bert(k: &Keys<'_>, heads: Option<i64>) -> Result<bert::Config> {
    let words = k.shape("embeddings.word_embeddings.weight", 2)?;
    let (vocab_size, hidden_size) = (words[0], words[1]);
    let max_position_embeddings = k.shape("embeddings.position_embeddings.weight", 2)?[0];
    let type_vocab_size = k.shape("embeddings.token_type_embeddings.weight", 2)?[0];
    let num_hidden_layers = k.count("encoder.layer")?;
    let intermediate_size = if num_hidden_layers > 0 {
        k.shape("encoder.layer.0.intermediate.dense.weight", 2)?[0]
    } else {
        4 * hidden_size
    };
    // The classification head sits beside the backbone (`bert.`), if present.
    let num_labels = k
        .shapes
        .get(&format!("{}classifier.weight", outer(k.prefix)))
        .map_or(2, |s| s[0]);
    Ok(bert::Config {
        vocab_size,
        hidden_size,
        num_hidden_layers,
        num_attention_heads: k.heads(hidden_size, heads)?,
        intermediate_size,
        max_position_embeddings,
        type_vocab_size,
        num_labels,
        ..bert::Config::bert_base_uncased()
    })
}

fn infer_gpt2(k: &Keys<'_>, heads: Option<i64>) -> Result<gpt2::Config> {
    let wte = k.shape("wte.weight", 2)?;
    let (vocab_size, n_embd) = (wte[0], wte[1]);
    let n_positions = k.shape("wpe.weight", 2)?[0];
    let n_layer = k.count("h")?;
    let n_inner = if n_layer > 0 {
        // Conv1D stores [in, out].
        let inner = k.shape("h.0.mlp.c_fc.weight", 2)?[1];
        (inner != 4 * n_embd).then_some(inner)
    } else {
        None
    };
    Ok(gpt2::Config {
        vocab_size,
        n_positions,
        n_embd,
        n_layer,
        n_head: k.heads(n_embd, heads)?,
        n_inner,
        ..gpt2::Config::gpt2()
    })
}

/// Writes `chain`'s variables as a safetensors state dict, keys prefixed by `prefix`
/// (`""` for none). Used to round-trip models; the format is what `safetensors.torch`
/// writes and reads.
pub fn write_safetensors(chain: &Chain, prefix: &str, path: &Path) -> Result<()> {
    let mut named: Vec<(String, Tensor)> = chain
        .vs
        .variables()
        .into_iter()
        .map(|(k, v)| {
            let t = v
                .f_detach()
                .and_then(|t| t.f_to_device(Device::Cpu))
                .and_then(|t| t.f_contiguous());
            t.map(|t| (format!("{prefix}{k}"), t))
                .map_err(|e| ModelError::torch(format!("reading variable {k}"), e))
        })
        .collect::<Result<_>>()?;
    named.sort_by(|a, b| a.0.cmp(&b.0));
    Tensor::write_safetensors(&named, path)
        .map_err(|e| ModelError::torch(format!("writing {}", PathBuf::from(path).display()), e))
}

#[cfg(test)]
mod tests {
    use super::pickles_ordered_dict;

    #[test]
    fn outer_prefix_drops_the_last_component() {
        assert_eq!(super::outer("module.bert."), "module.");
        assert_eq!(super::outer("bert."), "");
        assert_eq!(super::outer(""), "");
    }

    #[test]
    fn ordered_dict_is_recognised_only_at_the_top() {
        // `torch.save(OrderedDict(...))`, protocol 2.
        assert!(pickles_ordered_dict(b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01"));
        // Protocol 4: FRAME, then memoized SHORT_BINUNICODE names and STACK_GLOBAL.
        let mut p4 = b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00".to_vec();
        p4.extend_from_slice(b"\x8c\x0bcollections\x94\x8c\x0bOrderedDict\x94\x93");
        assert!(pickles_ordered_dict(&p4));
        // A plain dict whose tensors carry OrderedDict backward hooks further on.
        assert!(!pickles_ordered_dict(
            b"\x80\x02}q\x00(X\x01\x00\x00\x00actorch._utils\n_rebuild_tensor_v2\nccollections\nOrderedDict\n"
        ));
        assert!(!pickles_ordered_dict(b""));
    }
}
