//! The built-in models by CLI name (`resnet50`, `bert-base-uncased`, `gpt2`, …) and the
//! catalogue `ckptune models` prints.

use crate::architecture::{Architecture, Family};
use crate::chain::Chain;
use crate::error::{ModelError, Result};
use crate::options::{Granularity, ModelOptions};
use crate::{bert, gpt2, llama, resnet};

/// One line of `ckptune models`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    pub name: &'static str,
    pub family: Family,
    /// Candidate blocks at the default granularity, in execution order.
    pub candidates: Vec<String>,
    /// Parameter count of the reference model (torchvision `ResNet`, HF `BertModel`,
    /// HF `GPT2Model`, HF `LlamaForCausalLM` with its `lm_head`), heads added only for the
    /// loss excluded.
    pub reference_params: i64,
}

/// Every built-in name with its architecture, in `ckptune models` order.
fn catalogue() -> Vec<(&'static str, Architecture)> {
    vec![
        ("resnet18", Architecture::ResNet(resnet::Config::resnet18())),
        ("resnet34", Architecture::ResNet(resnet::Config::resnet34())),
        ("resnet50", Architecture::ResNet(resnet::Config::resnet50())),
        ("resnet101", Architecture::ResNet(resnet::Config::resnet101())),
        ("resnet152", Architecture::ResNet(resnet::Config::resnet152())),
        (
            "bert-base-uncased",
            Architecture::Bert(bert::Config::bert_base_uncased()),
        ),
        (
            "bert-large-uncased",
            Architecture::Bert(bert::Config::bert_large_uncased()),
        ),
        ("gpt2", Architecture::Gpt2(gpt2::Config::gpt2())),
        ("gpt2-medium", Architecture::Gpt2(gpt2::Config::gpt2_medium())),
        ("tinyllama-1.1b", Architecture::Llama(llama::Config::tinyllama_1_1b())),
        ("llama-3.2-1b", Architecture::Llama(llama::Config::llama_3_2_1b())),
        ("qwen2.5-0.5b", Architecture::Llama(llama::Config::qwen2_5_0_5b())),
        ("mistral-7b-v0.1", Architecture::Llama(llama::Config::mistral_7b_v0_1())),
        ("tiny-resnet", Architecture::ResNet(resnet::Config::tiny())),
        ("tiny-bert", Architecture::Bert(bert::Config::tiny())),
        ("tiny-gpt2", Architecture::Gpt2(gpt2::Config::tiny())),
        ("tiny-llama", Architecture::Llama(llama::Config::tiny())),
        ("tiny-qwen2", Architecture::Llama(llama::Config::tiny_qwen2())),
    ]
}

/// The built-in model names.
pub fn names() -> Vec<&'static str> {
    catalogue().into_iter().map(|(name, _)| name).collect()
}

/// Builds the built-in model `name` (random weights).
pub fn builtin(name: &str, opts: &ModelOptions) -> Result<Chain> {
    match name {
        "resnet18" => resnet::resnet18(opts),
        "resnet34" => resnet::resnet34(opts),
        "resnet50" => resnet::resnet50(opts),
        "resnet101" => resnet::resnet101(opts),
        "resnet152" => resnet::resnet152(opts),
        "bert-base-uncased" => bert::bert_base_uncased(opts),
        "bert-large-uncased" => bert::bert_large_uncased(opts),
        "gpt2" => gpt2::gpt2(opts),
        "gpt2-medium" => gpt2::gpt2_medium(opts),
        "tiny-resnet" => resnet::tiny(opts),
        "tiny-bert" => bert::tiny(opts),
        "tiny-gpt2" => gpt2::tiny(opts),
        "tinyllama-1.1b" => llama::tinyllama_1_1b(opts),
        "llama-3.2-1b" => llama::llama_3_2_1b(opts),
        "qwen2.5-0.5b" => llama::qwen2_5_0_5b(opts),
        "mistral-7b-v0.1" => llama::mistral_7b_v0_1(opts),
        "tiny-llama" => llama::tiny(opts),
        "tiny-qwen2" => llama::tiny_qwen2(opts),
        _ => Err(ModelError::UnknownModel {
            name: name.to_string(),
            known: names().into_iter().map(String::from).collect(),
        }),
    }
}

/// The catalogue, computed from the configurations without building any model.
pub fn list() -> Vec<ModelInfo> {
    catalogue()
        .into_iter()
        .map(|(name, arch)| {
            let blocks = match &arch {
                Architecture::ResNet(c) => c.block_names(Granularity::Layer),
                Architecture::Bert(c) => c.block_names(),
                Architecture::Gpt2(c) => c.block_names(),
                Architecture::Llama(c) => c.block_names(),
            };
            // Groups of several top-level modules are never candidates.
            let candidates = blocks.into_iter().filter(|b| !b.contains('+')).collect();
            ModelInfo {
                name,
                family: arch.family(),
                candidates,
                reference_params: arch.param_count(),
            }
        })
        .collect()
}
