//! Hugging Face model folders (`config.json` beside `model.safetensors`, a sharded
//! `model.safetensors.index.json`, or `pytorch_model.bin`), or a `config.json` alone: the
//! architecture comes from the config, not from shapes, so head counts, `rope_theta`,
//! `tie_word_embeddings` and biases are exact. Without weights the model gets seeded random
//! weights — what ckptune measures does not depend on their values — and the load report says
//! so ([`Loaded::random_weights`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::architecture::Architecture;
use crate::assemble::{assemble, restore_tied_embedding, Loaded};
use crate::error::{ModelError, Result};
use crate::infer::{infer, Inferred};
use crate::layers::Activation;
use crate::options::{Attention, ModelOptions};
use crate::state_dict::read_state_dict;
use crate::weights::StateDict;
use crate::{bert, gpt2, llama};

/// The `model_type`s ckptune builds.
pub const SUPPORTED_MODEL_TYPES: [&str; 5] = ["llama", "mistral", "qwen2", "bert", "gpt2"];

/// Loads the folder `path` (or the folder of the `config.json` it names).
pub fn load(path: &Path, opts: &ModelOptions) -> Result<Loaded> {
    let (dir, config_path) = if path.is_dir() {
        (path.to_path_buf(), path.join("config.json"))
    } else {
        (
            path.parent().unwrap_or(Path::new(".")).to_path_buf(),
            path.to_path_buf(),
        )
    };
    if path.is_dir() && !config_path.exists() {
        return Err(ModelError::NotAModelFolder { path: dir });
    }
    let text = std::fs::read_to_string(&config_path).map_err(|source| ModelError::Io {
        path: config_path.clone(),
        source,
    })?;
    let config: Value = serde_json::from_str(&text).map_err(|e| ModelError::BadFile {
        path: config_path.clone(),
        reason: format!("invalid JSON: {e}"),
    })?;
    let mut architecture = architecture(&config_path, &config)?;
    if let (Architecture::Bert(c), Some(classes)) = (&mut architecture, opts.classes) {
        c.num_labels = classes;
    }
    let attention = match opts.attention {
        Some(a) => Some(a),
        None => attention(&Fields {
            path: &config_path,
            json: &config,
        })?,
    };
    let opts = ModelOptions {
        classes: None,
        heads: None,
        attention,
        ..opts.clone()
    };
    let Some((weights_path, mut tensors)) = read_weights(&dir, &opts)? else {
        // Seeded so that two runs plan the same model; the caller's generator is left as it was.
        let saved = ckptune_kernels::rng::cpu_state().ok();
        tch::manual_seed(0);
        let chain = architecture.build(&dir.display().to_string(), &opts);
        if let Some(state) = saved {
            let _ = ckptune_kernels::rng::set_cpu_state(&state);
        }
        return Ok(Loaded {
            chain: chain?,
            architecture,
            prefix: None,
            ignored: Vec::new(),
            defaulted: Vec::new(),
            restored: Vec::new(),
            random_weights: true,
        });
    };
    let restored = restore_tied_embedding(&mut tensors);
    let shapes: BTreeMap<String, Vec<i64>> = tensors.iter().map(|(k, t)| (k.clone(), t.size())).collect();
    // The prefix (`transformer.`, `bert.`) from the key names; the architecture from the config.
    let heads = match &architecture {
        Architecture::Bert(c) => Some(c.num_attention_heads),
        Architecture::Gpt2(c) => Some(c.n_head),
        Architecture::Llama(c) => Some(c.num_attention_heads),
        Architecture::ResNet(_) => None,
    };
    let prefix = infer(&weights_path, &shapes, heads).ok().and_then(|i| i.prefix);
    let inferred = Inferred { architecture, prefix };
    assemble(&weights_path, tensors, &shapes, inferred, restored, &opts)
}

/// Weight files a Hugging Face folder may hold, single files first, then shard indexes.
const WEIGHT_FILES: [&str; 2] = ["model.safetensors", "pytorch_model.bin"];
const WEIGHT_INDEXES: [&str; 2] = ["model.safetensors.index.json", "pytorch_model.bin.index.json"];

/// Whether `path` is a Hugging Face folder (or its `config.json`) with no weights beside the
/// config: such a model is built with seeded random weights, which callers should say.
pub fn is_config_only(path: &Path) -> bool {
    let dir = if path.is_dir() {
        path
    } else if path.file_name().is_some_and(|n| n == "config.json") {
        path.parent().unwrap_or(Path::new("."))
    } else {
        return false;
    };
    !WEIGHT_FILES
        .iter()
        .chain(&WEIGHT_INDEXES)
        .any(|f| dir.join(f).is_file())
}

/// The folder's weights, if any: `model.safetensors`, the shards of
/// `model.safetensors.index.json`, `pytorch_model.bin` or the shards of
/// `pytorch_model.bin.index.json`. Returns the path errors should name.
fn read_weights(dir: &Path, opts: &ModelOptions) -> Result<Option<(PathBuf, StateDict)>> {
    let key = opts.state_dict_key.as_deref();
    for single in WEIGHT_FILES {
        let path = dir.join(single);
        if path.is_file() {
            return Ok(Some((path.clone(), read_state_dict(&path, key)?)));
        }
    }
    for index in WEIGHT_INDEXES {
        let path = dir.join(index);
        if !path.is_file() {
            continue;
        }
        let bad = |reason: String| ModelError::BadFile {
            path: path.clone(),
            reason,
        };
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        let json: Value = serde_json::from_str(&text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        let Some(map) = json.get("weight_map").and_then(Value::as_object) else {
            return Err(bad("no weight_map object".into()));
        };
        let mut shards = BTreeSet::new();
        for (name, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| bad(format!("weight_map[{name:?}] is not a file name")))?;
            shards.insert(file.to_string());
        }
        let mut tensors = Vec::new();
        for shard in shards {
            let shard_path = dir.join(&shard);
            for (name, t) in read_state_dict(&shard_path, key)? {
                // A key the index assigns to another shard would be loaded twice.
                if map.get(&name).and_then(Value::as_str) != Some(shard.as_str()) {
                    return Err(bad(format!(
                        "shard {shard} holds {name}, which the index assigns to {}",
                        map.get(&name).and_then(Value::as_str).unwrap_or("no shard")
                    )));
                }
                tensors.push((name, t));
            }
        }
        let read: BTreeSet<&str> = tensors.iter().map(|(k, _)| k.as_str()).collect();
        if let Some(absent) = map.keys().find(|k| !read.contains(k.as_str())) {
            return Err(bad(format!("{absent} is in the index but in none of its shards")));
        }
        return Ok(Some((path, tensors)));
    }
    Ok(None)
}

/// Reads config.json fields by name with the reference config class's defaults.
struct Fields<'a> {
    path: &'a Path,
    json: &'a Value,
}

impl Fields<'_> {
    fn bad(&self, what: String) -> ModelError {
        ModelError::BadFile {
            path: self.path.to_path_buf(),
            reason: what,
        }
    }

    fn present(&self, name: &str) -> Option<&Value> {
        self.json.get(name).filter(|v| !v.is_null())
    }

    fn int(&self, name: &str, default: Option<i64>) -> Result<i64> {
        match self.present(name) {
            Some(v) => v
                .as_i64()
                .ok_or_else(|| self.bad(format!("{name} is {v}, not an integer"))),
            None => default.ok_or_else(|| self.bad(format!("{name} is missing"))),
        }
    }

    fn opt_int(&self, name: &str) -> Result<Option<i64>> {
        self.present(name).map(|_| self.int(name, None)).transpose()
    }

    fn float(&self, name: &str, default: f64) -> Result<f64> {
        match self.present(name) {
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.bad(format!("{name} is {v}, not a number"))),
            None => Ok(default),
        }
    }

    fn bool(&self, name: &str, default: bool) -> Result<bool> {
        match self.present(name) {
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.bad(format!("{name} is {v}, not a boolean"))),
            None => Ok(default),
        }
    }

    fn str(&self, name: &str, default: &str) -> Result<String> {
        match self.present(name) {
            Some(v) => v
                .as_str()
                .map(String::from)
                .ok_or_else(|| self.bad(format!("{name} is {v}, not a string"))),
            None => Ok(default.to_string()),
        }
    }

    fn activation(&self, name: &str, default: &str) -> Result<Activation> {
        let act = self.str(name, default)?;
        [Activation::Gelu, Activation::GeluNew, Activation::Relu]
            .into_iter()
            .find(|a| a.hf_name() == act)
            .ok_or_else(|| self.bad(format!("{name} {act:?} is not one of gelu, gelu_new, relu")))
    }
}

/// The attention implementation a config.json names, as `PreTrainedConfig.__init__` reads it:
/// `_attn_implementation` (older configs) over `attn_implementation`. `None` when it names
/// none: the default then, sdpa, as `from_config` gives.
fn attention(f: &Fields<'_>) -> Result<Option<Attention>> {
    let Some(key) = ["_attn_implementation", "attn_implementation"]
        .into_iter()
        .find(|k| f.present(k).is_some())
    else {
        return Ok(None);
    };
    let name = f.str(key, "")?;
    Attention::from_hf_name(&name).map(Some).ok_or_else(|| {
        f.bad(format!(
            "{key} {name:?} is not one ckptune models (eager, sdpa); --attention eager|sdpa chooses one"
        ))
    })
}

/// The architecture a config.json describes.
pub fn architecture(path: &Path, json: &Value) -> Result<Architecture> {
    let f = Fields { path, json };
    let model_type = f.str("model_type", "")?;
    match model_type.as_str() {
        "llama" | "mistral" | "qwen2" => Ok(Architecture::Llama(llama_config(&f, &model_type)?)),
        "gpt2" => {
            let d = gpt2::Config::gpt2();
            Ok(Architecture::Gpt2(gpt2::Config {
                vocab_size: f.int("vocab_size", Some(d.vocab_size))?,
                n_positions: f.int("n_positions", Some(d.n_positions))?,
                n_embd: f.int("n_embd", Some(d.n_embd))?,
                n_layer: f.int("n_layer", Some(d.n_layer))?,
                n_head: f.int("n_head", Some(d.n_head))?,
                n_inner: f.opt_int("n_inner")?,
                activation_function: f.activation("activation_function", "gelu_new")?,
                resid_pdrop: f.float("resid_pdrop", d.resid_pdrop)?,
                embd_pdrop: f.float("embd_pdrop", d.embd_pdrop)?,
                attn_pdrop: f.float("attn_pdrop", d.attn_pdrop)?,
                layer_norm_epsilon: f.float("layer_norm_epsilon", d.layer_norm_epsilon)?,
                initializer_range: f.float("initializer_range", d.initializer_range)?,
                scale_attn_weights: f.bool("scale_attn_weights", d.scale_attn_weights)?,
                scale_attn_by_inverse_layer_idx: f
                    .bool("scale_attn_by_inverse_layer_idx", d.scale_attn_by_inverse_layer_idx)?,
            }))
        }
        "bert" => {
            let d = bert::Config::bert_base_uncased();
            let labels = json
                .get("id2label")
                .and_then(Value::as_object)
                .map_or(d.num_labels, |m| m.len() as i64);
            Ok(Architecture::Bert(bert::Config {
                vocab_size: f.int("vocab_size", Some(d.vocab_size))?,
                hidden_size: f.int("hidden_size", Some(d.hidden_size))?,
                num_hidden_layers: f.int("num_hidden_layers", Some(d.num_hidden_layers))?,
                num_attention_heads: f.int("num_attention_heads", Some(d.num_attention_heads))?,
                intermediate_size: f.int("intermediate_size", Some(d.intermediate_size))?,
                hidden_act: f.activation("hidden_act", "gelu")?,
                hidden_dropout_prob: f.float("hidden_dropout_prob", d.hidden_dropout_prob)?,
                attention_probs_dropout_prob: f
                    .float("attention_probs_dropout_prob", d.attention_probs_dropout_prob)?,
                max_position_embeddings: f.int("max_position_embeddings", Some(d.max_position_embeddings))?,
                type_vocab_size: f.int("type_vocab_size", Some(d.type_vocab_size))?,
                initializer_range: f.float("initializer_range", d.initializer_range)?,
                layer_norm_eps: f.float("layer_norm_eps", d.layer_norm_eps)?,
                pad_token_id: f.int("pad_token_id", Some(d.pad_token_id))?,
                num_labels: labels,
                classifier_dropout: f.present("classifier_dropout").and_then(Value::as_f64),
            }))
        }
        other => Err(ModelError::UnsupportedModelType {
            path: path.to_path_buf(),
            model_type: other.to_string(),
            supported: &SUPPORTED_MODEL_TYPES,
        }),
    }
}

/// `LlamaConfig`, `MistralConfig` or `Qwen2Config` (their defaults where a field is absent).
fn llama_config(f: &Fields<'_>, model_type: &str) -> Result<llama::Config> {
    let d = llama::Config::llama_defaults();
    let act = f.str("hidden_act", "silu")?;
    if act != "silu" {
        return Err(f.bad(format!("hidden_act {act:?}: ckptune's Llama MLP is SwiGLU (silu)")));
    }
    let heads = f.int("num_attention_heads", Some(d.num_attention_heads))?;
    let rope_scaling = match f.present("rope_scaling") {
        None => None,
        Some(v) => {
            let kind = v
                .get("rope_type")
                .or_else(|| v.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("");
            if kind == "default" {
                None
            } else if kind == "llama3" {
                let sub = Fields { path: f.path, json: v };
                Some(llama::Llama3RopeScaling {
                    factor: sub.float("factor", 8.0)?,
                    low_freq_factor: sub.float("low_freq_factor", 1.0)?,
                    high_freq_factor: sub.float("high_freq_factor", 4.0)?,
                    original_max_position_embeddings: sub.int("original_max_position_embeddings", Some(8192))?,
                })
            } else {
                return Err(f.bad(format!(
                    "rope_scaling type {kind:?} is not supported (default and llama3 are)"
                )));
            }
        }
    };
    let (model_type, sliding_window) = match model_type {
        "mistral" => (llama::ModelType::Mistral, f.opt_int("sliding_window")?),
        "qwen2" => {
            let on = f.bool("use_sliding_window", false)?;
            (
                llama::ModelType::Qwen2,
                if on { f.opt_int("sliding_window")? } else { None },
            )
        }
        _ => (llama::ModelType::Llama, None),
    };
    Ok(llama::Config {
        model_type,
        vocab_size: f.int("vocab_size", Some(d.vocab_size))?,
        hidden_size: f.int("hidden_size", Some(d.hidden_size))?,
        intermediate_size: f.int("intermediate_size", Some(d.intermediate_size))?,
        num_hidden_layers: f.int("num_hidden_layers", Some(d.num_hidden_layers))?,
        num_attention_heads: heads,
        num_key_value_heads: f.int("num_key_value_heads", Some(heads))?,
        head_dim: f.opt_int("head_dim")?,
        max_position_embeddings: f.int("max_position_embeddings", Some(d.max_position_embeddings))?,
        initializer_range: f.float("initializer_range", d.initializer_range)?,
        rms_norm_eps: f.float("rms_norm_eps", d.rms_norm_eps)?,
        tie_word_embeddings: f.bool("tie_word_embeddings", d.tie_word_embeddings)?,
        rope_theta: f.float("rope_theta", d.rope_theta)?,
        rope_scaling,
        attention_bias: f.bool("attention_bias", false)?,
        attention_dropout: f.float("attention_dropout", 0.0)?,
        mlp_bias: f.bool("mlp_bias", false)?,
        sliding_window,
    })
}
