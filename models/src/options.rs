//! The options every model constructor takes: how finely a model is cut into blocks, its
//! shapes, where and in which dtype its variables live.

use tch::{Device, Kind};

use crate::error::{ModelError, Result};
use crate::layers::Spec;
use crate::trace_kernels::TraceKernels;

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

/// How a transformer computes attention: Hugging Face's `attn_implementation`. The default is
/// transformers' own for BERT, GPT-2 and the Llama family, `sdpa`: what a user's
/// `from_pretrained` or `from_config` model runs unless told otherwise.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Attention {
    /// `eager`: the scores `softmax(QK^T)` materialized as `[batch, heads, seq, seq]`, as the
    /// family's `eager_attention_forward` writes it out.
    Eager,
    /// `sdpa`: `torch.nn.functional.scaled_dot_product_attention`, called as transformers'
    /// `sdpa_attention_forward` calls it; libtorch picks the kernel (on the CPU its flash
    /// attention without dropout; with dropout, in training, the math path, which keeps the
    /// `[batch, heads, seq, seq]` probabilities and dropout mask as eager does).
    #[default]
    Sdpa,
}

impl Attention {
    /// The name Hugging Face and `--attention` give it.
    pub fn hf_name(self) -> &'static str {
        match self {
            Attention::Eager => "eager",
            Attention::Sdpa => "sdpa",
        }
    }

    /// `eager` or `sdpa`; `None` for anything else.
    pub fn from_hf_name(name: &str) -> Option<Self> {
        [Attention::Eager, Attention::Sdpa]
            .into_iter()
            .find(|a| a.hf_name() == name)
    }
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
    /// The attention implementation of a transformer. `None`: what a Hugging Face
    /// `config.json` names (`attn_implementation`), else [`Attention::default`], sdpa, as
    /// transformers chooses. Models without attention refuse it.
    pub attention: Option<Attention>,
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
    /// The kernels SDPA calls (the device's unless a GPU is being traced for).
    pub trace_kernels: TraceKernels,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            image: None,
            seq: None,
            classes: None,
            heads: None,
            state_dict_key: None,
            attention: None,
            granularity: Granularity::default(),
            device: Device::Cpu,
            kind: Kind::Float,
            batch: None,
            candidates: None,
            trace_kernels: TraceKernels::Device,
        }
    }
}

impl ModelOptions {
    /// An error if `option` is set although it has no meaning for `model`.
    pub(crate) fn reject(
        &self,
        model: &str,
        option: &'static str,
        value: Option<impl std::fmt::Display>,
        why: &str,
    ) -> Result<()> {
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
                trace_kernels: self.trace_kernels,
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
