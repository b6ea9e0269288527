//! Hugging Face folders: the architecture from config.json (the published configs of the
//! built-in Llama-family names give the built-in configurations), weights from one safetensors
//! file, from shards, or none (seeded random weights, said in the report), and clear errors for
//! unsupported model types and keys that do not match the config.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use ckptune_models::hf;
use ckptune_models::llama::{self, Llama3RopeScaling, ModelType};
use ckptune_models::load;
use ckptune_models::Architecture;
use ckptune_models::{Attention, Batch, ModelError, ModelOptions};
use common::{fixture, max_abs_diff, run_blocks, tensors};
use serde_json::{json, Value};
use tch::Tensor;

/// Building a model draws from libtorch's global generator: tests that build hold this, so a
/// seeded build is not interleaved with another test's draws.
static RNG: Mutex<()> = Mutex::new(());

fn rng() -> MutexGuard<'static, ()> {
    RNG.lock().unwrap_or_else(|p| p.into_inner())
}

fn arch(config: &Value) -> Architecture {
    hf::architecture(Path::new("config.json"), config).unwrap_or_else(|e| panic!("{e}"))
}

/// The fields of the published config.json files that shape the models (values as published).
#[test]
fn published_configs_give_the_builtin_configurations() {
    let tinyllama = json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 2048, "intermediate_size": 5632, "initializer_range": 0.02,
        "max_position_embeddings": 2048, "num_attention_heads": 32, "num_hidden_layers": 22,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 32000
    });
    let llama32 = json!({
        "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": false,
        "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": true, "vocab_size": 128256
    });
    let qwen = json!({
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu",
        "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
        "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": true, "use_sliding_window": false, "vocab_size": 151936
    });
    let mistral = json!({
        "architectures": ["MistralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "sliding_window": 4096, "tie_word_embeddings": false, "vocab_size": 32000
    });
    for (config, expected, params) in [
        (tinyllama, llama::Config::tinyllama_1_1b(), 1_100_048_384),
        (llama32, llama::Config::llama_3_2_1b(), 1_235_814_400),
        (qwen, llama::Config::qwen2_5_0_5b(), 494_032_768),
        (mistral, llama::Config::mistral_7b_v0_1(), 7_241_732_096),
    ] {
        let got = arch(&config);
        assert_eq!(got, Architecture::Llama(expected.clone()), "{}", expected.describe());
        assert_eq!(got.param_count(), params, "{}", expected.describe());
    }
    let gpt2 = json!({"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12,
                      "n_positions": 1024, "vocab_size": 50257, "activation_function": "gelu_new"});
    assert_eq!(arch(&gpt2), Architecture::Gpt2(ckptune_models::gpt2::Config::gpt2()));
    let bert = json!({"model_type": "bert", "hidden_size": 768, "num_attention_heads": 12,
                      "num_hidden_layers": 12, "intermediate_size": 3072, "vocab_size": 30522,
                      "hidden_act": "gelu", "max_position_embeddings": 512, "type_vocab_size": 2});
    assert_eq!(
        arch(&bert),
        Architecture::Bert(ckptune_models::bert::Config::bert_base_uncased())
    );
}

/// make_fixtures.py's tiny Llama as a Hugging Face folder: its config.json.
fn tiny_llama_config() -> Value {
    json!({
        "model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": false,
        "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    })
}

fn folder(config: &Value) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    dir
}

fn write(path: &Path, sd: &BTreeMap<String, Tensor>) {
    let named: Vec<(&str, &Tensor)> = sd.iter().map(|(k, t)| (k.as_str(), t)).collect();
    Tensor::write_safetensors(&named, path).unwrap();
}

fn opts() -> ModelOptions {
    ModelOptions {
        seq: Some(8),
        // The io fixture is the eager reference's.
        attention: Some(Attention::Eager),
        ..Default::default()
    }
}

/// Forward and loss of the loaded folder against PyTorch's (the llama3 rope scaling comes
/// from the config: no option needed).
fn assert_matches_pytorch(loaded: &ckptune_models::Loaded) {
    let io = tensors("tiny_llama_io.safetensors");
    let chain = &loaded.chain;
    let batch = Batch {
        input: io["input_ids"].shallow_clone(),
        target: io["input_ids"].shallow_clone(),
        attention_mask: Some(io["attention_mask"].shallow_clone()),
        padded: true,
    };
    let bias = chain.attention_bias(batch.attention_mask.as_ref().unwrap());
    let outs = tch::no_grad(|| run_blocks(chain, &batch.input, Some(&bias), false, false));
    let hidden = outs.last().unwrap();
    let diff = max_abs_diff(hidden, &io["last_hidden_state"]);
    assert!(diff <= 1e-5, "last_hidden_state differs by {diff}");
    let loss = chain.head.loss(hidden, &batch);
    let diff = max_abs_diff(&loss.reshape([1]), &io["loss"]);
    assert!(diff <= 1e-5, "loss differs by {diff}");
}

#[test]
fn a_folder_with_one_file_or_shards_loads_as_pytorch_runs_it() {
    let _rng = rng();
    tch::set_num_threads(1);
    let config = tiny_llama_config();
    let expected = llama::Config {
        vocab_size: 32,
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        rms_norm_eps: 1e-5,
        rope_scaling: Some(Llama3RopeScaling {
            factor: 4.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8,
        }),
        ..llama::Config::llama_defaults()
    };
    let sd: BTreeMap<String, Tensor> = tensors("tiny_llama.safetensors").into_iter().collect();

    // One file; the folder or its config.json as MODEL.
    let one = folder(&config);
    std::fs::copy(fixture("tiny_llama.safetensors"), one.path().join("model.safetensors")).unwrap();
    for path in [one.path().to_path_buf(), one.path().join("config.json")] {
        let loaded = load::load(&path, &opts()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(loaded.architecture, Architecture::Llama(expected.clone()));
        assert!(!loaded.random_weights);
        assert_matches_pytorch(&loaded);
    }

    // Two shards and model.safetensors.index.json, as save_pretrained writes them.
    let sharded = folder(&config);
    let (mut a, mut b) = (BTreeMap::new(), BTreeMap::new());
    let mut weight_map = serde_json::Map::new();
    for (k, t) in &sd {
        let (shard, name) = if k.contains("layers.1") || k.starts_with("lm_head") {
            (&mut b, "model-00002-of-00002.safetensors")
        } else {
            (&mut a, "model-00001-of-00002.safetensors")
        };
        shard.insert(k.clone(), t.shallow_clone());
        weight_map.insert(k.clone(), json!(name));
    }
    write(&sharded.path().join("model-00001-of-00002.safetensors"), &a);
    write(&sharded.path().join("model-00002-of-00002.safetensors"), &b);
    let index = json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(sharded.path().join("model.safetensors.index.json"), index.to_string()).unwrap();
    let loaded = load::load(sharded.path(), &opts()).unwrap();
    assert_matches_pytorch(&loaded);

    // A key the index does not list in the shard that holds it is an error naming both.
    let mut index = index.clone();
    index["weight_map"]["model.norm.weight"] = json!("model-00002-of-00002.safetensors");
    std::fs::write(sharded.path().join("model.safetensors.index.json"), index.to_string()).unwrap();
    let e = load::load(sharded.path(), &opts()).unwrap_err();
    assert!(
        e.to_string()
            .contains("holds model.norm.weight, which the index assigns to model-00002-of-00002.safetensors"),
        "{e}"
    );
}

#[test]
fn a_config_alone_plans_with_seeded_random_weights() {
    let _rng = rng();
    let mut config = tiny_llama_config();
    config["model_type"] = json!("qwen2");
    config["tie_word_embeddings"] = json!(true);
    let dir = folder(&config);
    let a = load::load(dir.path(), &opts()).unwrap();
    assert!(a.random_weights, "the report says the weights are random");
    let Architecture::Llama(cfg) = &a.architecture else {
        panic!()
    };
    assert_eq!((cfg.model_type, cfg.tie_word_embeddings), (ModelType::Qwen2, true));
    // Seeded: the same weights each time, whatever the caller's generator did.
    tch::manual_seed(123);
    let b = load::load(dir.path().join("config.json"), &opts()).unwrap();
    let vb = b.chain.vs.variables();
    for (name, t) in a.chain.vs.variables() {
        assert!(t.equal(&vb[&name]), "{name}");
    }
    assert!(
        vb.contains_key("model.layers.0.self_attn.q_proj.bias"),
        "Qwen2's biases"
    );
    assert!(!vb.contains_key("model.layers.0.self_attn.o_proj.bias"));
}

#[test]
fn unsupported_types_and_mismatched_keys_are_named() {
    let _rng = rng();
    let dir = folder(&json!({"model_type": "t5", "d_model": 512}));
    let e = load::load(dir.path(), &opts()).unwrap_err();
    assert!(
        matches!(e, ModelError::UnsupportedModelType { ref model_type, .. } if model_type == "t5"),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("llama, mistral, qwen2, bert, gpt2") && msg.contains(".pt2"),
        "{msg}"
    );

    // The config says 3 layers; the weights have 2 and an extra tensor.
    let mut config = tiny_llama_config();
    config["num_hidden_layers"] = json!(3);
    let dir = folder(&config);
    let mut sd: BTreeMap<String, Tensor> = tensors("tiny_llama.safetensors").into_iter().collect();
    sd.insert(
        "model.extra".into(),
        Tensor::zeros([1], (tch::Kind::Float, tch::Device::Cpu)),
    );
    write(&dir.path().join("model.safetensors"), &sd);
    let e = load::load(dir.path(), &opts()).unwrap_err();
    let ModelError::KeyMismatch {
        missing, unexpected, ..
    } = &e
    else {
        panic!("{e:?}")
    };
    assert_eq!(missing.len(), 9, "{missing:?}");
    assert!(missing.iter().all(|k| k.starts_with("model.layers.2.")), "{missing:?}");
    assert_eq!(unexpected, &["model.extra"]);
}

#[test]
fn a_tied_embedding_left_out_is_restored_with_the_config() {
    let _rng = rng();
    let mut config = tiny_llama_config();
    config["tie_word_embeddings"] = json!(true);
    let dir = folder(&config);
    let mut sd: BTreeMap<String, Tensor> = tensors("tiny_llama.safetensors").into_iter().collect();
    // The head becomes the embedding, saved only as model.embed_tokens.weight's twin.
    let embed = sd.remove("model.embed_tokens.weight").unwrap();
    sd.insert("lm_head.weight".into(), embed.copy());
    write(&dir.path().join("model.safetensors"), &sd);
    let loaded = load::load(dir.path(), &opts()).unwrap();
    assert_eq!(loaded.restored, ["model.embed_tokens.weight"]);
    assert_eq!(loaded.ignored, ["lm_head.weight"]);
    assert!(loaded.chain.vs.variables()["model.embed_tokens.weight"].equal(&embed));
}
