//! Every built-in model against the plain-PyTorch reference in `fixtures/reference.py`
//! (torchvision / Hugging Face code written out): the same `state_dict` keys with the same
//! shapes and dtypes, the same `named_modules()` in the same order, the same parameter counts
//! — which must also equal the published figures — and the architecture inferred back from
//! the shapes alone.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use ckptune_models::zoo;
use ckptune_models::Architecture;
use ckptune_models::{bert, builtin, gpt2, llama, resnet, ModelOptions};
use serde_json::Value;
use tch::Kind;

/// Parameter counts of the reference backbones as published (torchvision docs, the Hugging
/// Face model cards) and as `sum(p.numel() for p in model.parameters())` gives them.
const PUBLISHED: [(&str, i64); 13] = [
    ("resnet18", 11_689_512),
    ("resnet34", 21_797_672),
    ("resnet50", 25_557_032),
    ("resnet101", 44_549_160),
    ("resnet152", 60_192_808),
    ("bert-base-uncased", 109_482_240),
    ("bert-large-uncased", 335_141_888),
    ("gpt2", 124_439_808),
    ("gpt2-medium", 354_823_168),
    ("tinyllama-1.1b", 1_100_048_384),
    ("llama-3.2-1b", 1_235_814_400),
    ("qwen2.5-0.5b", 494_032_768),
    ("mistral-7b-v0.1", 7_241_732_096),
];

/// Models larger than this are checked from their configuration only (counts, the catalogue):
/// building them would take 2–29 GB. Their module tree is the tiny Llama's and Qwen2's.
const BUILD_AT_MOST: i64 = 400_000_000;

fn architecture(name: &str) -> Architecture {
    match name {
        "resnet18" => Architecture::ResNet(resnet::Config::resnet18()),
        "resnet34" => Architecture::ResNet(resnet::Config::resnet34()),
        "resnet50" => Architecture::ResNet(resnet::Config::resnet50()),
        "resnet101" => Architecture::ResNet(resnet::Config::resnet101()),
        "resnet152" => Architecture::ResNet(resnet::Config::resnet152()),
        "tiny-resnet" => Architecture::ResNet(resnet::Config::tiny()),
        "bert-base-uncased" => Architecture::Bert(bert::Config::bert_base_uncased()),
        "bert-large-uncased" => Architecture::Bert(bert::Config::bert_large_uncased()),
        "tiny-bert" => Architecture::Bert(bert::Config::tiny()),
        "gpt2" => Architecture::Gpt2(gpt2::Config::gpt2()),
        "gpt2-medium" => Architecture::Gpt2(gpt2::Config::gpt2_medium()),
        "tiny-gpt2" => Architecture::Gpt2(gpt2::Config::tiny()),
        "tinyllama-1.1b" => Architecture::Llama(llama::Config::tinyllama_1_1b()),
        "llama-3.2-1b" => Architecture::Llama(llama::Config::llama_3_2_1b()),
        "qwen2.5-0.5b" => Architecture::Llama(llama::Config::qwen2_5_0_5b()),
        "mistral-7b-v0.1" => Architecture::Llama(llama::Config::mistral_7b_v0_1()),
        "tiny-llama" => Architecture::Llama(llama::Config::tiny()),
        "tiny-qwen2" => Architecture::Llama(llama::Config::tiny_qwen2()),
        other => panic!("no architecture for {other}"),
    }
}

fn python_dtype(kind: Kind) -> &'static str {
    match kind {
        Kind::Float => "float32",
        Kind::Int64 => "int64",
        Kind::Bool => "bool",
        other => panic!("unexpected variable kind {other:?}"),
    }
}

#[test]
fn every_builtin_matches_the_pytorch_reference() {
    tch::set_num_threads(2);
    let out = common::python()
        .args(["reference.py", "describe"])
        .output()
        .expect("starting CKPTUNE_PYTHON");
    assert!(
        out.status.success(),
        "reference.py failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reference: Value = serde_json::from_slice(&out.stdout).expect("reference.py prints JSON");

    let published: BTreeMap<&str, i64> = PUBLISHED.into_iter().collect();
    let listed: BTreeMap<&str, zoo::ModelInfo> = zoo::list().into_iter().map(|i| (i.name, i)).collect();
    for name in zoo::names() {
        let theirs = &reference[name];
        let reference_params = theirs["reference_params"].as_i64().expect("a parameter count");
        if let Some(&count) = published.get(name) {
            assert_eq!(
                reference_params, count,
                "{name}: reference.py disagrees with the published count"
            );
        }

        let arch = architecture(name);
        assert_eq!(
            arch.param_count(),
            reference_params,
            "{name}: the configuration's formula"
        );
        assert_eq!(listed[name].reference_params, reference_params, "{name}: zoo::list");
        if reference_params > BUILD_AT_MOST {
            continue;
        }

        // One model at a time: bert-large and gpt2-medium take 1.4 GB each.
        let chain = builtin(name, &ModelOptions::default()).unwrap_or_else(|e| panic!("building {name}: {e}"));

        // state_dict keys, shapes and dtypes. A tied `lm_head.weight` (GPT2LMHeadModel's, a
        // Llama with tie_word_embeddings) is the embedding and has no variable of its own here.
        let ours: BTreeMap<String, (Vec<i64>, String)> = chain
            .vs
            .variables()
            .into_iter()
            .map(|(k, t)| (k, (t.size(), python_dtype(t.kind()).to_string())))
            .collect();
        let expected: BTreeMap<String, (Vec<i64>, String)> = theirs["state_dict"]
            .as_array()
            .expect("a state_dict list")
            .iter()
            .map(|e| {
                let shape = e[1].as_array().unwrap().iter().map(|d| d.as_i64().unwrap()).collect();
                (
                    e[0].as_str().unwrap().to_string(),
                    (shape, e[2].as_str().unwrap().to_string()),
                )
            })
            .filter(|(k, _)| k != "lm_head.weight" || ours.contains_key(k))
            .collect();
        assert_eq!(ours, expected, "{name}: state_dict differs from the reference");

        let modules: Vec<String> = theirs["modules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            chain.modules, modules,
            "{name}: named_modules() differs from the reference"
        );
        // Every block is a module of the reference, or a group of top-level ones.
        for block in &chain.blocks {
            for part in block.name.split('+') {
                assert!(
                    chain.modules.iter().any(|m| m == part),
                    "{name}: block part {part} is not a module"
                );
            }
            assert_eq!(block.candidate, !block.name.contains('+'), "{name}: {}", block.name);
        }

        assert_eq!(
            chain.reference_params, reference_params,
            "{name}: Chain::reference_params"
        );
        assert_eq!(
            listed[name].candidates,
            chain.candidates().into_iter().map(String::from).collect::<Vec<_>>(),
            "{name}: zoo::list candidates"
        );
        let head: i64 = chain
            .vs
            .variables()
            .iter()
            .filter(|(k, t)| k.starts_with("classifier.") && t.requires_grad())
            .map(|(_, t)| t.numel() as i64)
            .sum();
        assert_eq!(
            chain.param_count() - head,
            reference_params,
            "{name}: trainable variables"
        );

        // The architecture comes back from the shapes alone (head counts of the 32-wide test
        // transformers are not the hidden/64 convention, so they are given).
        let shapes: BTreeMap<String, Vec<i64>> = chain.vs.variables().into_iter().map(|(k, t)| (k, t.size())).collect();
        let heads = name.starts_with("tiny-").then_some(2);
        let inferred =
            ckptune_models::infer::infer(Path::new(name), &shapes, heads).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(inferred.architecture, arch, "{name}: inferred architecture");
        assert_eq!(inferred.prefix, None);
        drop(chain);
    }
}

#[test]
fn published_names_describe_themselves() {
    for (name, _) in PUBLISHED {
        assert_eq!(architecture(name).describe(), name);
    }
}
