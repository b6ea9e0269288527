//! Forward outputs on the committed fixtures (written by `fixtures/make_fixtures.py` from
//! the plain-PyTorch references) equal PyTorch's, in eval mode, for weights read from
//! safetensors and from `torch.save`d state dicts (plain dicts, `OrderedDict`s, nested training
//! checkpoints, read through pytorch-reader).
//!
//! Tolerance: max |ours - PyTorch| ≤ 1e-5 on outputs of order 1. Both sides run the same
//! libtorch kernels; the slack covers thread-count-dependent reduction order.

mod common;

use ckptune_models::load;
use ckptune_models::resnet::{self, BlockKind};
use ckptune_models::Architecture;
use ckptune_models::Loaded;
use ckptune_models::{Attention, Batch, Granularity, ModelOptions};
use common::{fixture, max_abs_diff, run_blocks, tensors};
use tch::Tensor;

const TOL: f64 = 1e-5;

fn load(file: &str, opts: &ModelOptions) -> Loaded {
    load::load(fixture(file), opts).unwrap_or_else(|e| panic!("loading {file}: {e}"))
}

#[test]
fn tiny_resnet_matches_pytorch() {
    tch::set_num_threads(1);
    let io = tensors("tiny_resnet_io.safetensors");
    for (file, granularity) in [
        ("tiny_resnet.safetensors", Granularity::Layer),
        ("tiny_resnet.pt", Granularity::Layer),
        ("tiny_resnet.safetensors", Granularity::Block),
    ] {
        let opts = ModelOptions {
            image: Some(16),
            granularity,
            ..Default::default()
        };
        let loaded = load(file, &opts);
        let expected = resnet::Config {
            block: BlockKind::Basic,
            layers: [1, 1, 1, 1],
            num_classes: 10,
            zero_init_residual: false,
            groups: 1,
            width_per_group: 64,
            inplanes: 2,
        };
        assert_eq!(loaded.architecture, Architecture::ResNet(expected));
        assert_eq!(
            (loaded.prefix.as_deref(), loaded.ignored.len(), loaded.defaulted.len()),
            (None, 0, 0)
        );
        let chain = &loaded.chain;
        let nbt = &chain.vs.variables()["layer3.0.downsample.1.num_batches_tracked"];
        assert_eq!(
            (nbt.kind(), nbt.int64_value(&[])),
            (tch::Kind::Int64, 7),
            "buffers are loaded"
        );

        let input = &io["input"];
        let before = input.copy();
        let outs = run_blocks(chain, input, None, false, false);
        assert!(input.equal(&before), "a block wrote to its input");
        let logits = outs.last().unwrap();
        let diff = max_abs_diff(logits, &io["logits"]);
        assert!(diff <= TOL, "{file} {granularity:?}: logits differ by {diff}");

        let batch = Batch {
            input: input.shallow_clone(),
            target: io["target"].shallow_clone(),
            attention_mask: None,
            padded: false,
        };
        let loss = chain.head.loss(logits, &batch);
        let diff = max_abs_diff(&loss.reshape([1]), &io["loss"]);
        assert!(diff <= TOL, "{file}: loss differs by {diff}");
    }
}

#[test]
fn tiny_bert_matches_pytorch() {
    tch::set_num_threads(1);
    let io = tensors("tiny_bert_io.safetensors");
    // 32 wide with 2 heads: not the hidden/64 convention, so the head count is given.
    let opts = ModelOptions {
        heads: Some(2),
        attention: Some(Attention::Eager),
        ..Default::default()
    };
    for (file, prefix, defaulted) in [
        // BertForSequenceClassification: `bert.` backbone and the trained classifier.
        ("tiny_bert.safetensors", Some("bert."), vec![]),
        // BertModel alone: the loss head keeps its initial weights.
        ("tiny_bert.pt", None, vec!["classifier.bias", "classifier.weight"]),
    ] {
        let loaded = load(file, &opts);
        let Architecture::Bert(cfg) = &loaded.architecture else {
            panic!("{file}: not BERT")
        };
        assert_eq!(
            (
                cfg.num_hidden_layers,
                cfg.hidden_size,
                cfg.num_attention_heads,
                cfg.intermediate_size
            ),
            (2, 32, 2, 4)
        );
        assert_eq!(
            (
                cfg.vocab_size,
                cfg.max_position_embeddings,
                cfg.type_vocab_size,
                cfg.num_labels
            ),
            (100, 8, 2, 2)
        );
        assert_eq!(loaded.prefix.as_deref(), prefix, "{file}");
        assert_eq!(loaded.defaulted, defaulted, "{file}");

        let chain = &loaded.chain;
        let batch = Batch {
            input: io["input_ids"].shallow_clone(),
            target: Tensor::from_slice(&[0i64, 1]),
            attention_mask: Some(io["attention_mask"].shallow_clone()),
            padded: true,
        };
        let bias = chain.attention_bias(batch.attention_mask.as_ref().unwrap());
        let outs = run_blocks(chain, &batch.input, Some(&bias), false, false);
        let layers = cfg.num_hidden_layers as usize;
        let diff = max_abs_diff(&outs[layers], &io["last_hidden_state"]);
        assert!(diff <= TOL, "{file}: last_hidden_state differs by {diff}");
        let diff = max_abs_diff(&outs[layers + 1], &io["pooler_output"]);
        assert!(diff <= TOL, "{file}: pooler_output differs by {diff}");
    }
}

#[test]
fn tiny_gpt2_matches_pytorch() {
    tch::set_num_threads(1);
    let io = tensors("tiny_gpt2_io.safetensors");
    let loaded = load(
        "tiny_gpt2.safetensors",
        &ModelOptions {
            heads: Some(2),
            attention: Some(Attention::Eager),
            ..Default::default()
        },
    );
    assert_eq!(loaded.prefix.as_deref(), Some("transformer."));
    // GPT2LMHeadModel's state dict lists the tied head; it is checked equal to wte and skipped.
    assert_eq!(loaded.ignored, vec!["lm_head.weight"]);
    let chain = &loaded.chain;
    let ids = &io["input_ids"];
    let outs = run_blocks(chain, ids, None, false, false);
    let hidden = outs.last().unwrap();
    let diff = max_abs_diff(hidden, &io["last_hidden_state"]);
    assert!(diff <= TOL, "last_hidden_state differs by {diff}");
    // The causal-LM loss with labels = input_ids, shifted inside the loss as HF does.
    let batch = Batch {
        input: ids.shallow_clone(),
        target: ids.shallow_clone(),
        attention_mask: None,
        padded: false,
    };
    let loss = chain.head.loss(hidden, &batch);
    let diff = max_abs_diff(&loss.reshape([1]), &io["loss"]);
    assert!(diff <= TOL, "loss differs by {diff}");
}

#[test]
fn both_file_formats_hold_the_same_weights() {
    for (a, b, opts) in [
        ("tiny_resnet.safetensors", "tiny_resnet.pt", ModelOptions::default()),
        (
            "tiny_bert.safetensors",
            "tiny_bert.pt",
            ModelOptions {
                heads: Some(2),
                attention: Some(Attention::Eager),
                ..Default::default()
            },
        ),
    ] {
        let (a, b) = (load(a, &opts).chain, load(b, &opts).chain);
        let vb = b.vs.variables();
        for (name, t) in a.vs.variables() {
            if !name.starts_with("classifier.") {
                assert!(t.equal(&vb[&name]), "{name} differs between the two files");
            }
        }
    }
}

/// The tiny Llama of `make_fixtures.py`: grouped-query attention, llama3 rope scaling (which a
/// state dict does not record, so the configuration is written here and the weights are copied
/// in by name), untied head, a padded second sequence.
#[test]
fn tiny_llama_matches_pytorch() {
    use ckptune_models::llama::{self, Llama3RopeScaling};
    tch::set_num_threads(1);
    let io = tensors("tiny_llama_io.safetensors");
    let cfg = llama::Config {
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
    for granularity in [Granularity::Layer, Granularity::Block] {
        let opts = ModelOptions {
            seq: Some(8),
            granularity,
            attention: Some(Attention::Eager),
            ..Default::default()
        };
        let chain = llama::build("tiny-llama fixture", &cfg, &opts).unwrap();
        let weights = tensors("tiny_llama.safetensors");
        let mut vars = chain.vs.variables();
        assert_eq!(
            vars.keys().collect::<std::collections::BTreeSet<_>>(),
            weights.keys().collect(),
            "variables are the state dict's keys"
        );
        for (name, var) in vars.iter_mut() {
            tch::no_grad(|| var.copy_(&weights[name]));
        }
        let batch = Batch {
            input: io["input_ids"].shallow_clone(),
            target: io["input_ids"].shallow_clone(),
            attention_mask: Some(io["attention_mask"].shallow_clone()),
            padded: true,
        };
        let bias = chain.attention_bias(batch.attention_mask.as_ref().unwrap());
        let outs = run_blocks(&chain, &batch.input, Some(&bias), false, false);
        let hidden = outs.last().unwrap();
        let diff = max_abs_diff(hidden, &io["last_hidden_state"]);
        assert!(diff <= TOL, "{granularity:?}: last_hidden_state differs by {diff}");
        let loss = chain.head.loss(hidden, &batch);
        let diff = max_abs_diff(&loss.reshape([1]), &io["loss"]);
        assert!(diff <= TOL, "{granularity:?}: loss differs by {diff}");
    }
}

/// The tiny Qwen2 of `make_fixtures.py`, loaded as a state-dict file: q/k/v biases and a tied
/// head whose `lm_head.weight` the file leaves out, inferred from the keys alone.
#[test]
fn tiny_qwen2_matches_pytorch() {
    use ckptune_models::llama::{self, ModelType};
    tch::set_num_threads(1);
    let io = tensors("tiny_qwen2_io.safetensors");
    let loaded = load(
        "tiny_qwen2.safetensors",
        &ModelOptions {
            heads: Some(2),
            attention: Some(Attention::Eager),
            seq: Some(8),
            ..Default::default()
        },
    );
    let expected = llama::Config {
        model_type: ModelType::Qwen2,
        vocab_size: 32,
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        tie_word_embeddings: true,
        ..llama::Config::llama_defaults()
    };
    assert_eq!(loaded.architecture, Architecture::Llama(expected));
    assert_eq!((loaded.prefix.as_deref(), loaded.ignored.len()), (None, 0));
    let chain = &loaded.chain;
    let ids = &io["input_ids"];
    let outs = run_blocks(chain, ids, None, false, false);
    let hidden = outs.last().unwrap();
    let diff = max_abs_diff(hidden, &io["last_hidden_state"]);
    assert!(diff <= TOL, "last_hidden_state differs by {diff}");
    let batch = Batch {
        input: ids.shallow_clone(),
        target: ids.shallow_clone(),
        attention_mask: None,
        padded: false,
    };
    let loss = chain.head.loss(hidden, &batch);
    let diff = max_abs_diff(&loss.reshape([1]), &io["loss"]);
    assert!(diff <= TOL, "loss differs by {diff}");
}

/// The tiny Qwen2's weights saved by `make_torch_save.py` as users save them load through
/// pytorch-reader into the same variables as the safetensors file.
#[test]
fn torch_save_files_load_as_the_safetensors_does() {
    let base = ModelOptions {
        heads: Some(2),
        attention: Some(Attention::Eager),
        seq: Some(8),
        ..Default::default()
    };
    let reference = load("tiny_qwen2.safetensors", &base).chain.vs.variables();
    for (file, key) in [
        // torch.save(model.state_dict()): an OrderedDict.
        ("tiny_qwen2_ordered.pt", None),
        // A training checkpoint: found under model_state_dict.
        ("tiny_qwen2_ckpt.pt", None),
        // Under a key of the user's own.
        ("tiny_qwen2_weights.pt", Some("weights")),
    ] {
        let opts = ModelOptions {
            state_dict_key: key.map(String::from),
            ..base.clone()
        };
        let loaded = load(file, &opts);
        let Architecture::Llama(cfg) = &loaded.architecture else {
            panic!("{file}: not a Llama")
        };
        assert!(cfg.tie_word_embeddings, "{file}: the tie is recognised");
        let vars = loaded.chain.vs.variables();
        assert_eq!(vars.len(), reference.len(), "{file}");
        for (name, t) in &reference {
            assert!(t.equal(&vars[name]), "{file}: {name} differs");
        }
    }
}

/// A tied model's file without the input embedding (kept as `lm_head.weight` only) loads with
/// the tie restored, for GPT-2 and Qwen2.
#[test]
fn a_tied_embedding_left_out_is_restored_from_the_head() {
    use std::collections::BTreeMap;
    let dir = tempfile::tempdir().unwrap();
    for (file, embed, head) in [
        ("tiny_gpt2.safetensors", "transformer.wte.weight", "lm_head.weight"),
        ("tiny_qwen2.safetensors", "model.embed_tokens.weight", "lm_head.weight"),
    ] {
        let mut sd: BTreeMap<String, Tensor> = tensors(file).into_iter().collect();
        let weight = sd.remove(embed).unwrap();
        sd.insert(head.into(), weight.copy());
        let path = dir.path().join(file);
        let named: Vec<(&str, &Tensor)> = sd.iter().map(|(k, t)| (k.as_str(), t)).collect();
        Tensor::write_safetensors(&named, &path).unwrap();
        let opts = ModelOptions {
            heads: Some(2),
            attention: Some(Attention::Eager),
            seq: Some(8),
            ..Default::default()
        };
        let loaded = load::load(&path, &opts).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(loaded.restored, vec![embed.to_string()], "{file}");
        let name = embed.strip_prefix("transformer.").unwrap_or(embed);
        assert!(loaded.chain.vs.variables()[name].equal(&weight), "{file}: {name}");
        assert_eq!(
            loaded.chain.param_count(),
            load(file, &opts).chain.param_count(),
            "{file}"
        );
    }
}
