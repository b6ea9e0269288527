//! The built-in models by CLI name (`resnet50`, `bert-base-uncased`, `gpt2`, …), the options
//! every constructor takes, and the catalogue `ckptune models` prints.

use std::fmt;

use tch::{Device, Kind};

use crate::chain::Chain;
use crate::error::{ModelError, Result};
use crate::layers::Spec;
use crate::{bert, gpt2, llama, resnet};

/// How finely a model is cut into chain blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Granularity {
    /// Layers: ResNet stages (`layer1` … `layer4`), BERT's `encoder.layer.N`, GPT-2's `h.N`.
    #[default]
    Layer,
    /// The modules inside layers: ResNet residual blocks (`layer1.0`, …, `layer3.35`),
    /// BERT's `encoder.layer.N.attention` / `.intermediate` / `.output`, GPT-2's `h.N.attn` /
    /// `h.N.mlp`.
    Block,
    /// Both levels as candidates: a layer or any of its children, never both (the layers are
    /// chain groups over their children's blocks).
    Nested,
}

/// Shape and placement options; `None` means the model's default.
#[derive(Debug, Clone)]
pub struct ModelOptions {
    /// Square image side (ResNet; default 224).
    pub image: Option<i64>,
    /// Sequence length in tokens (BERT default 128, GPT-2 default 1024, Llama 2048 or
    /// `max_position_embeddings` if shorter).
    pub seq: Option<i64>,
    /// Output classes: ResNet's `fc`, BERT's `classifier` (`num_labels`, default 2).
    pub classes: Option<i64>,
    /// Attention heads, for transformers read from a state dict (weights do not record the
    /// head count; the default there is `hidden / 64`, true of BERT and GPT-2 of all sizes).
    pub heads: Option<i64>,
    /// The entry of a `torch.save`d dict that holds the state dict (`model`, `state_dict`, …);
    /// `None`: found automatically.
    pub state_dict_key: Option<String>,
    pub granularity: Granularity,
    pub device: Device,
    /// Floating kind of parameters and floating buffers (f32 unless a pure-precision run asks
    /// otherwise). Integer buffers (`num_batches_tracked`) stay i64.
    pub kind: Kind,
    /// The micro-batch the model will run at, when the user chose one (`--batch`): a
    /// `torch.export` program with a static batch runs only at its exported one.
    pub batch: Option<i64>,
    /// `--candidates REGEX`: for `torch.export` programs, the modules that are candidates,
    /// instead of the granularity's rule.
    pub candidates: Option<String>,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            image: None,
            seq: None,
            classes: None,
            heads: None,
            state_dict_key: None,
            granularity: Granularity::default(),
            device: Device::Cpu,
            kind: Kind::Float,
            batch: None,
            candidates: None,
        }
    }
}

impl ModelOptions {
    /// An error if `option` is set although it has no meaning for `model`.
    pub(crate) fn reject(&self, model: &str, option: &'static str, value: Option<i64>, why: &str) -> Result<()> {
        match value {
            None => Ok(()),
            Some(v) => Err(ModelError::InvalidOption {
                model: model.to_string(),
                option,
                value: v.to_string(),
                why: why.to_string(),
            }),
        }
    }

    /// Kind and device for new variables; the kind must be floating.
    pub(crate) fn spec(&self, model: &str) -> Result<Spec> {
        match self.kind {
            Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16 => Ok(Spec {
                kind: self.kind,
                device: self.device,
            }),
            other => Err(ModelError::InvalidOption {
                model: model.to_string(),
                option: "kind",
                value: format!("{other:?}"),
                why: "parameters must be floating point (Float, Double, Half or BFloat16)".into(),
            }),
        }
    }
}

/// A model family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    ResNet,
    Bert,
    Gpt2,
    /// Llama, Mistral and Qwen2 (one module tree).
    Llama,
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::ResNet => "resnet",
            Family::Bert => "bert",
            Family::Gpt2 => "gpt2",
            Family::Llama => "llama",
        })
    }
}

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

/// A model architecture: a family and its configuration.
#[derive(Debug, Clone, PartialEq)]
pub enum Architecture {
    ResNet(resnet::Config),
    Bert(bert::Config),
    Gpt2(gpt2::Config),
    Llama(llama::Config),
}

impl Architecture {
    pub fn family(&self) -> Family {
        match self {
            Architecture::ResNet(_) => Family::ResNet,
            Architecture::Bert(_) => Family::Bert,
            Architecture::Gpt2(_) => Family::Gpt2,
            Architecture::Llama(_) => Family::Llama,
        }
    }

    /// The reference name of the configuration (`resnet50`) or its explicit shape.
    pub fn describe(&self) -> String {
        match self {
            Architecture::ResNet(c) => c.describe(),
            Architecture::Bert(c) => c.describe(),
            Architecture::Gpt2(c) => c.describe(),
            Architecture::Llama(c) => c.describe(),
        }
    }

    /// Parameter count of the reference model.
    pub fn param_count(&self) -> i64 {
        match self {
            Architecture::ResNet(c) => c.param_count(),
            Architecture::Bert(c) => c.param_count(),
            Architecture::Gpt2(c) => c.param_count(),
            Architecture::Llama(c) => c.param_count(),
        }
    }

    /// Builds the architecture as a chain named `name` with the family's default shapes.
    pub fn build(&self, name: &str, opts: &ModelOptions) -> Result<Chain> {
        match self {
            Architecture::ResNet(c) => resnet::build(name, c, opts),
            Architecture::Bert(c) => bert::build(name, c, opts),
            Architecture::Gpt2(c) => gpt2::build(name, c, opts),
            Architecture::Llama(c) => llama::build(name, c, opts),
        }
    }
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
