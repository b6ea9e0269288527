//! Models from state-dict files: `.safetensors`, and `.pt`/`.pth`/`.bin` files written by
//! `torch.save` of a state dict (`OrderedDict` or `dict`), alone or nested in a checkpoint
//! dict (`{"model": …, "optimizer": …}`), read with the `pytorch-reader` crate — libtorch's
//! unpickler cannot read an `OrderedDict`. The architecture is inferred from key names and
//! shapes, the chain is built, and every weight is copied in; a key the chain does not use or
//! a variable the file does not set is an error naming them.
//!
//! Files are recognised by content, not extension. TorchScript archives are recognised and
//! returned as [`ModelError::TorchScript`] so that the caller routes them to the TorchScript
//! loader. A pickled module (`torch.save(model)`) gets an error saying to save
//! `model.state_dict()`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

use crate::chain::Chain;
use crate::error::{first_line, ModelError, Result};
use crate::zoo::{Architecture, ModelOptions};
use crate::{bert, gpt2, llama, resnet};

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
    if path.is_dir() || path.file_name().is_some_and(|n| n == "config.json") {
        return crate::hf::load(path, opts);
    }
    let mut tensors = read_state_dict(path, opts.state_dict_key.as_deref())?;
    let restored = restore_tied_embedding(&mut tensors);
    let shapes: BTreeMap<String, Vec<i64>> = tensors.iter().map(|(k, t)| (k.clone(), t.size())).collect();
    let mut inferred = infer(path, &shapes, opts.heads)?;
    if let Architecture::Llama(c) = &mut inferred.architecture {
        // A tied model's `state_dict()` lists `lm_head.weight` beside the embedding it is;
        // equal values mean tied (an untied head never equals the embedding bit for bit).
        let get = |name: &str| tensors.iter().find(|(k, _)| k == name).map(|(_, t)| t);
        let prefix = inferred.prefix.as_deref().unwrap_or_default();
        if let (Some(head), Some(embed)) = (
            get(&format!("{prefix}lm_head.weight")),
            get(&format!("{prefix}model.embed_tokens.weight")),
        ) {
            if !c.tie_word_embeddings && head.size() == embed.size() && head.equal(embed) {
                c.tie_word_embeddings = true;
            }
        }
    }

    assemble(path, tensors, &shapes, inferred, restored, opts)
}

/// Builds `inferred` and copies `tensors` (the file's, with their shapes `shapes`) into it:
/// every variable must be set (or be one that may keep its initial value) and every key used
/// (or be derived data), else [`ModelError::KeyMismatch`] lists them.
pub(crate) fn assemble(
    path: &Path,
    tensors: Vec<(String, Tensor)>,
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
        restored,
        random_weights: false,
    })
}

/// Puts back an input embedding that a file of a tied model left out because it equals
/// `lm_head.weight` (GPT-2's `wte.weight`, Llama's `model.embed_tokens.weight`; savers that
/// drop one of two shared tensors may drop either). Returns the keys it added.
pub(crate) fn restore_tied_embedding(tensors: &mut Vec<(String, Tensor)>) -> Vec<String> {
    let has = |tensors: &[(String, Tensor)], k: &str| tensors.iter().any(|(key, _)| key == k);
    let Some((head_key, head)) = tensors
        .iter()
        .find(|(k, _)| k == "lm_head.weight" || k.ends_with(".lm_head.weight"))
        .map(|(k, t)| (k.clone(), t.shallow_clone()))
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

/// All tensors of a state-dict file, on the CPU: safetensors in file order, torch.save files
/// sorted by name. `state_dict_key` picks the entry of a torch.save dict that holds the state
/// dict (`None`: the top level, or the first of `state_dict`, `model_state_dict`, `model`,
/// `module`, `net` that holds one).
pub fn read_state_dict(path: &Path, state_dict_key: Option<&str>) -> Result<Vec<(String, Tensor)>> {
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
        return read_torch_zip(path, state_dict_key);
    }
    if head.len() > 8 && head[8] == b'{' {
        if let Some(key) = state_dict_key {
            return Err(ModelError::InvalidOption {
                model: path.display().to_string(),
                option: "state_dict_key",
                value: key.to_string(),
                why: "a safetensors file is a flat state dict; the key picks an entry of a torch.save dict".into(),
            });
        }
        return Tensor::read_safetensors(path)
            .map_err(|e| bad(format!("invalid safetensors file: {}", first_line(&e.to_string()))));
    }
    if head[0] == 0x80 {
        return read_torch_pickle(path, state_dict_key, "a legacy (pre-1.6, non-zip) torch.save file: ");
    }
    Err(bad(format!(
        "neither a safetensors file nor a torch.save zip archive (it starts with bytes {:02x?})",
        &head[..head.len().min(8)]
    )))
}

/// The keys a training checkpoint commonly nests its weights under, tried in this order when
/// the file's top-level dict is not itself a state dict.
const NESTING_KEYS: [&str; 5] = ["state_dict", "model_state_dict", "model", "module", "net"];

fn read_torch_zip(path: &Path, state_dict_key: Option<&str>) -> Result<Vec<(String, Tensor)>> {
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
    let mut data = Vec::new();
    zip.by_name(&pickle)
        .map_err(std::io::Error::from)
        .and_then(|mut f| f.read_to_end(&mut data))
        .map_err(|e| bad(format!("cannot read {pickle}: {e}")))?;
    // `torch.save(model)` pickles the module object itself, whose class lives in the user's
    // code; pytorch-reader would read its parameters, but the file is not what ckptune asks
    // for and the class's forward is unknown, so say what to save instead.
    if let Some(class) = top_level_class(&data).filter(|c| c != "collections.OrderedDict") {
        return Err(ModelError::PickledObject {
            path: path.to_path_buf(),
            class,
        });
    }
    read_torch_pickle(path, state_dict_key, "")
}

/// The state dict of a torch.save file (zip or legacy container) through pytorch-reader, from
/// the top-level dict or the entry `state_dict_key` (found automatically when `None`).
/// `what` prefixes read errors with what the file was taken to be.
fn read_torch_pickle(path: &Path, state_dict_key: Option<&str>, what: &str) -> Result<Vec<(String, Tensor)>> {
    let bad = |reason: String| ModelError::BadFile {
        path: path.to_path_buf(),
        reason,
    };
    let reader_err = |e: pytorch_reader::PytorchError| {
        // Observed with pytorch-reader 0.23.0-pre.1 (zip 9): torch.save archives whose root
        // folder (the stem of the name they were saved under) has 21 or more characters fail
        // so, although zip 0.6 and Python's zipfile read them.
        let hint = if matches!(&e, pytorch_reader::PytorchError::Zip(_)) {
            "; pytorch-reader fails so on torch.save archives saved under a name longer than 20 \
             characters before .pt: re-save it under a shorter name, or as safetensors"
        } else {
            ""
        };
        bad(format!("{what}pytorch-reader cannot read it: {e}{hint}"))
    };
    let key = match state_dict_key {
        Some(key) => Some(key.to_string()),
        None => find_state_dict_key(path).map_err(|e| match e {
            ModelError::BadFile { path, reason } => ModelError::BadFile {
                path,
                reason: format!("{what}{reason}"),
            },
            other => other,
        })?,
    };
    let reader = match &key {
        Some(key) => pytorch_reader::PytorchReader::with_top_level_key(path, key),
        None => pytorch_reader::PytorchReader::new(path),
    }
    .map_err(reader_err)?;
    let mut tensors: Vec<(String, pytorch_reader::Tensor)> = reader.into_tensors().into_iter().collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    if tensors.is_empty() {
        return Err(bad(match &key {
            Some(key) => format!("its entry {key:?} holds no tensors"),
            None => "it holds no tensors".into(),
        }));
    }
    tensors
        .into_iter()
        .map(|(name, t)| to_tch(path, &name, &t).map(|t| (name, t)))
        .collect()
}

/// Where the state dict sits in a torch.save dict: `None` when the top-level dict maps names
/// to tensors, else the first of [`NESTING_KEYS`] that holds such a dict.
fn find_state_dict_key(path: &Path) -> Result<Option<String>> {
    use pytorch_reader::PickleValue;
    let bad = |reason: String| ModelError::BadFile {
        path: path.to_path_buf(),
        reason,
    };
    let root = match pytorch_reader::PytorchReader::read_pickle_data(path, None) {
        Ok(root) => root,
        // Reported with its hint by the caller's read.
        Err(pytorch_reader::PytorchError::Zip(_)) => return Ok(None),
        Err(e) => return Err(bad(format!("pytorch-reader cannot read it: {e}"))),
    };
    let is_tensor = |v: &PickleValue| matches!(v, PickleValue::Unsupported(t) if t == "torch.Tensor");
    // `model.state_dict()` is an OrderedDict carrying a `_metadata` attribute (module
    // versions), which pytorch-reader shows as one more entry.
    let is_state_dict = |v: &PickleValue| match v {
        PickleValue::Dict(d) => {
            d.keys().any(|k| k != "_metadata") && d.iter().all(|(k, v)| k == "_metadata" || is_tensor(v))
        }
        _ => false,
    };
    let PickleValue::Dict(top) = &root else {
        return Err(bad("its top-level object is not a dict of tensors".into()));
    };
    if is_state_dict(&root) {
        return Ok(None);
    }
    if let Some(key) = NESTING_KEYS.iter().find(|k| top.get(**k).is_some_and(is_state_dict)) {
        return Ok(Some(key.to_string()));
    }
    let mut keys: Vec<&str> = top.keys().map(String::as_str).filter(|k| *k != "_metadata").collect();
    keys.sort_unstable();
    Err(bad(format!(
        "it holds a dict whose values are not all tensors and none of the usual entries ({}) is a \
         state dict; its top-level keys are [{}]: choose one with --state-dict-key",
        NESTING_KEYS.join(", "),
        keys.join(", ")
    )))
}

/// A pytorch-reader tensor as a CPU tch tensor (the bytes are read here).
fn to_tch(path: &Path, name: &str, t: &pytorch_reader::Tensor) -> Result<Tensor> {
    use pytorch_reader::DType;
    let kind = match t.dtype() {
        DType::F64 => Kind::Double,
        DType::F32 => Kind::Float,
        DType::F16 => Kind::Half,
        DType::BF16 => Kind::BFloat16,
        DType::I64 => Kind::Int64,
        DType::I32 => Kind::Int,
        DType::I16 => Kind::Int16,
        DType::I8 => Kind::Int8,
        DType::U8 => Kind::Uint8,
        DType::Bool => Kind::Bool,
        other => {
            return Err(ModelError::BadFile {
                path: path.to_path_buf(),
                reason: format!("tensor {name} has dtype {other:?}, which libtorch's CPU tensors do not hold"),
            })
        }
    };
    let bytes = t.read().map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let shape: Vec<i64> = t.shape().iter().map(|&d| d as i64).collect();
    Tensor::f_from_data_size(&bytes, &shape, kind)
        .map_err(|e| ModelError::torch(format!("building tensor {name} of {}", path.display()), e))
}

/// The class of a pickle's top-level object when it is an instance built from a global
/// (`collections.OrderedDict` for `torch.save(model.state_dict())`, the model's own class for
/// `torch.save(model)`), `None` for a plain dict or anything else. Protocol 2, torch.save's
/// default, opens with PROTO then the GLOBAL opcode `c` and `module\nname\n`; protocols 4 and
/// 5 add a FRAME and name the class with two SHORT_BINUNICODE strings (each maybe memoized)
/// and STACK_GLOBAL. (Every torch.save pickle names classes further on — tensors' rebuild
/// functions, their backward-hooks OrderedDict — so only the first object counts.)
fn top_level_class(data: &[u8]) -> Option<String> {
    let mut rest = data;
    if let [0x80, _, tail @ ..] = rest {
        rest = tail; // PROTO n
    }
    if let [0x95, tail @ ..] = rest {
        rest = tail.get(8..).unwrap_or_default(); // FRAME with an 8-byte length
    }
    if let [b'c', tail @ ..] = rest {
        let mut lines = tail.splitn(3, |&b| b == b'\n');
        let (module, name) = (lines.next()?, lines.next()?);
        lines.next()?;
        return Some(format!(
            "{}.{}",
            String::from_utf8_lossy(module),
            String::from_utf8_lossy(name)
        ));
    }
    let short_unicode = |rest: &[u8]| -> Option<(String, usize)> {
        let [0x8c, len, tail @ ..] = rest else { return None };
        let s = tail.get(..*len as usize)?;
        let used = 2 + s.len();
        Some((
            String::from_utf8_lossy(s).into_owned(),
            used + usize::from(rest.get(used) == Some(&0x94)),
        ))
    };
    let (module, n) = short_unicode(rest)?;
    let (name, m) = short_unicode(&rest[n..])?;
    (rest.get(n + m) == Some(&0x93)).then(|| format!("{module}.{name}"))
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
    let anchors: [(&str, &str); 4] = [
        ("ResNet", "layer1.0.conv1.weight"),
        ("BERT", "embeddings.word_embeddings.weight"),
        ("GPT-2", "wte.weight"),
        ("Llama", "model.embed_tokens.weight"),
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
                 (embeddings.word_embeddings.weight), a GPT-2 (wte.weight) or a Llama \
                 (model.embed_tokens.weight); the {} keys start: {sample}",
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
        "GPT-2" => Architecture::Gpt2(infer_gpt2(&keys, heads)?),
        _ => Architecture::Llama(infer_llama(&keys, heads)?),
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
                 multiple of 64 (the head size of every released BERT and GPT-2); pass --heads N (ModelOptions::heads), \
                 or plan the model's Hugging Face folder, whose config.json records it"
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

/// Llama, Mistral or Qwen2 from shapes. What weights do not record takes `LlamaConfig`'s
/// defaults (rope_theta 10000, rms_norm_eps 1e-6, 2048 positions); a Hugging Face folder's
/// config.json says it exactly. Without `heads`, the head size is taken to be 64, true of
/// Llama 2 and 3, TinyLlama, Mistral 7B and Qwen2.5 up to 72B.
fn infer_llama(k: &Keys<'_>, heads: Option<i64>) -> Result<llama::Config> {
    let embed = k.shape("model.embed_tokens.weight", 2)?;
    let (vocab_size, hidden_size) = (embed[0], embed[1]);
    let num_hidden_layers = k.count("model.layers")?;
    let defaults = llama::Config {
        vocab_size,
        hidden_size,
        num_hidden_layers,
        tie_word_embeddings: k.get("lm_head.weight").is_none(),
        ..llama::Config::llama_defaults()
    };
    if num_hidden_layers == 0 {
        return Ok(llama::Config {
            num_attention_heads: heads.unwrap_or((hidden_size / 64).max(1)),
            num_key_value_heads: heads.unwrap_or((hidden_size / 64).max(1)),
            intermediate_size: 4 * hidden_size,
            ..defaults
        });
    }
    let q = k.shape("model.layers.0.self_attn.q_proj.weight", 2)?[0];
    let kv = k.shape("model.layers.0.self_attn.k_proj.weight", 2)?[0];
    let intermediate_size = k.shape("model.layers.0.mlp.gate_proj.weight", 2)?[0];
    let head_dim = match heads {
        Some(h) if h > 0 && q % h == 0 => q / h,
        Some(h) => {
            return Err(k.unknown(format!(
                "q_proj has {q} outputs, which {h} attention heads do not divide"
            )))
        }
        None if q % 64 == 0 && kv % 64 == 0 => 64,
        None => {
            return Err(k.unknown(format!(
                "the attention head count is not stored in the weights and q_proj's {q} outputs are not \
                 heads of size 64; pass --heads N (ModelOptions::heads), or plan the model's Hugging Face \
                 folder, whose config.json records it"
            )))
        }
    };
    if kv % head_dim != 0 {
        return Err(k.unknown(format!(
            "k_proj has {kv} outputs, not a whole number of heads of size {head_dim}"
        )));
    }
    let num_attention_heads = q / head_dim;
    let qkv_bias = k.get("model.layers.0.self_attn.q_proj.bias").is_some();
    let o_bias = k.get("model.layers.0.self_attn.o_proj.bias").is_some();
    Ok(llama::Config {
        // Biases on q/k/v but not o are Qwen2's; on all four, Llama's `attention_bias`.
        model_type: if qkv_bias && !o_bias {
            llama::ModelType::Qwen2
        } else {
            llama::ModelType::Llama
        },
        intermediate_size,
        num_attention_heads,
        num_key_value_heads: kv / head_dim,
        head_dim: (hidden_size != q || hidden_size % num_attention_heads != 0).then_some(head_dim),
        attention_bias: qkv_bias && o_bias,
        mlp_bias: k.get("model.layers.0.mlp.gate_proj.bias").is_some(),
        ..defaults
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
    use super::top_level_class;

    #[test]
    fn outer_prefix_drops_the_last_component() {
        assert_eq!(super::outer("module.bert."), "module.");
        assert_eq!(super::outer("bert."), "");
        assert_eq!(super::outer(""), "");
    }

    #[test]
    fn the_top_level_class_is_read_only_at_the_top() {
        let ordered = Some("collections.OrderedDict".to_string());
        // `torch.save(OrderedDict(...))`, protocol 2.
        assert_eq!(
            top_level_class(b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01"),
            ordered
        );
        // Protocol 4: FRAME, then memoized SHORT_BINUNICODE names and STACK_GLOBAL.
        let mut p4 = b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00".to_vec();
        p4.extend_from_slice(b"\x8c\x0bcollections\x94\x8c\x0bOrderedDict\x94\x93");
        assert_eq!(top_level_class(&p4), ordered);
        // `torch.save(model)`: the model's class, then NEWOBJ.
        assert_eq!(
            top_level_class(b"\x80\x02c__main__\nNet\nq\x00)\x81q\x01}"),
            Some("__main__.Net".to_string())
        );
        // A plain dict whose tensors carry OrderedDict backward hooks further on.
        assert_eq!(
            top_level_class(
                b"\x80\x02}q\x00(X\x01\x00\x00\x00actorch._utils\n_rebuild_tensor_v2\nccollections\nOrderedDict\n"
            ),
            None
        );
        assert_eq!(top_level_class(b""), None);
    }
}
