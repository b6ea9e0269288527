//! The architecture a state dict holds, inferred from its key names and shapes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use crate::architecture::Architecture;
use crate::error::{ModelError, Result};
use crate::{bert, gpt2, llama, resnet};

/// What the key names and shapes say.
#[derive(Debug, Clone, PartialEq)]
pub struct Inferred {
    pub architecture: Architecture,
    /// Prefix in front of the backbone's keys, including its final dot.
    pub prefix: Option<String>,
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

/// What wraps both the backbone and its head: the prefix without its last component
/// (`module.bert.` → `module.`, `bert.` → ``).
pub(crate) fn outer(prefix: &str) -> &str {
    let trimmed = prefix.strip_suffix('.').unwrap_or(prefix);
    trimmed.rfind('.').map_or("", |i| &prefix[..=i])
}

#[cfg(test)]
mod tests {
    #[test]
    fn outer_prefix_drops_the_last_component() {
        assert_eq!(super::outer("module.bert."), "module.");
        assert_eq!(super::outer("bert."), "");
        assert_eq!(super::outer(""), "");
    }
}
