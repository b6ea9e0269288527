//! The Llama family (Llama, Mistral, Qwen2) as Hugging Face's
//! `transformers/models/llama/modeling_llama.py` builds `LlamaForCausalLM`, as a chain of named
//! blocks. Mistral (`modeling_mistral.py`) is the same module tree; Qwen2 (`modeling_qwen2.py`)
//! differs only in biases on `q_proj`/`k_proj`/`v_proj` (not `o_proj`).
//!
//! Attention is HF's default, [`crate::Attention::Sdpa`], unless the options say otherwise:
//! `sdpa_attention_forward` ([`crate::sdpa`]), `is_causal` when nothing is padded (grouped-query
//! attention then through `enable_gqa`), else `sdpa_mask`'s boolean mask and `repeat_kv`. With
//! [`crate::Attention::Eager`] it is `eager_attention_forward`: `repeat_kv` for grouped-query
//! attention, `matmul(q, k^T) * scaling`, the additive causal mask, softmax in f32 cast back to
//! the query's dtype, dropout, `matmul`. RMSNorm computes in f32 and casts back before the weight multiplies; the MLP
//! is SwiGLU, `down_proj(silu(gate_proj(x)) * up_proj(x))`.
//!
//! Chain: `model.embed_tokens`, `model.layers.0` … `model.layers.{N-1}`, `model.norm`; the loss
//! head is `lm_head` (its own weight, or `model.embed_tokens.weight` when
//! `tie_word_embeddings`) and `ForCausalLMLoss`, as GPT-2's.
//!
//! What `LlamaModel.forward` computes once for all layers (`position_ids`, the causal mask,
//! `model.rotary_emb`'s `(cos, sin)`, `[1, seq, head_dim]` each, with autocast off as HF does)
//! is the chain's [`SharedInputs`]: the runtime computes it before the first block and holds it
//! through the micro-step's backward, and every attention reads it from [`Ctx::shared`]. So a
//! layer's graph saves the shared pair and mask, as HF's layers do, and a checkpointed layer
//! keeps nothing of its own for them, as `torch.utils.checkpoint` keeps only references to the
//! same tensors. PyTorch makes them after the embeddings and frees them after layer 0's
//! backward (`position_ids` already when the forward returns), so at the embedding's forward
//! and backward, and from the loss on for `position_ids`, the prediction holds them above
//! PyTorch: never below it.

use tch::{nn, Kind, Tensor};

use crate::causal_lm::CausalLm;
use crate::chain::{Block, Chain, ChainBlock, Ctx, InputSpec, SharedInputs, TokenTargets};
use crate::decoder::{push_layer, PreNormLayer};
use crate::error::{ModelError, Result};
use crate::layers::{dropout, finfo_min, param, Embedding, Init, Linear, Spec};
use crate::options::{Attention as Implementation, Granularity, ModelOptions};
use crate::rotary;
pub use crate::rotary::Llama3RopeScaling;
use crate::sdpa::{repeat_kv, Sdpa};

/// Which `model_type` a configuration reproduces: the module tree is the same, Qwen2 adds
/// biases to the query, key and value projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelType {
    Llama,
    Mistral,
    Qwen2,
}

impl ModelType {
    /// config.json's `model_type`.
    pub fn hf_name(self) -> &'static str {
        match self {
            ModelType::Llama => "llama",
            ModelType::Mistral => "mistral",
            ModelType::Qwen2 => "qwen2",
        }
    }
}

/// The fields of HF's `LlamaConfig` (also `MistralConfig`, `Qwen2Config`) that shape the model.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub model_type: ModelType,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub num_key_value_heads: i64,
    /// `None`: `hidden_size / num_attention_heads`.
    pub head_dim: Option<i64>,
    pub max_position_embeddings: i64,
    pub initializer_range: f64,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub rope_theta: f64,
    /// `None`: the default rotary embedding.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Biases on all four attention projections (Llama's flag; Qwen2 has q/k/v biases anyway).
    pub attention_bias: bool,
    pub attention_dropout: f64,
    pub mlp_bias: bool,
    /// Mistral's sliding-window attention span. Sequences longer than it would need the
    /// windowed mask, which is not modelled, so they are refused.
    pub sliding_window: Option<i64>,
}

/// Default sequence length, capped at `max_position_embeddings`.
pub const DEFAULT_SEQ: i64 = 2048;

impl Config {
    /// `LlamaConfig()`'s defaults (Llama-2-7B's shape), also what a checkpoint's shapes do
    /// not say.
    pub fn llama_defaults() -> Self {
        Config {
            model_type: ModelType::Llama,
            vocab_size: 32000,
            hidden_size: 4096,
            intermediate_size: 11008,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 32,
            head_dim: None,
            max_position_embeddings: 2048,
            initializer_range: 0.02,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: false,
            rope_theta: 10000.0,
            rope_scaling: None,
            attention_bias: false,
            attention_dropout: 0.0,
            mlp_bias: false,
            sliding_window: None,
        }
    }

    /// `TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T`'s config.json.
    pub fn tinyllama_1_1b() -> Self {
        Config {
            hidden_size: 2048,
            intermediate_size: 5632,
            num_hidden_layers: 22,
            num_attention_heads: 32,
            num_key_value_heads: 4,
            rms_norm_eps: 1e-5,
            ..Self::llama_defaults()
        }
    }

    /// `meta-llama/Llama-3.2-1B`'s config.json.
    pub fn llama_3_2_1b() -> Self {
        Config {
            vocab_size: 128256,
            hidden_size: 2048,
            intermediate_size: 8192,
            num_hidden_layers: 16,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: Some(64),
            max_position_embeddings: 131072,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: true,
            rope_theta: 500000.0,
            rope_scaling: Some(Llama3RopeScaling {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            }),
            ..Self::llama_defaults()
        }
    }

    /// `Qwen/Qwen2.5-0.5B`'s config.json.
    pub fn qwen2_5_0_5b() -> Self {
        Config {
            model_type: ModelType::Qwen2,
            vocab_size: 151936,
            hidden_size: 896,
            intermediate_size: 4864,
            num_hidden_layers: 24,
            num_attention_heads: 14,
            num_key_value_heads: 2,
            max_position_embeddings: 32768,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: true,
            rope_theta: 1000000.0,
            ..Self::llama_defaults()
        }
    }

    /// `mistralai/Mistral-7B-v0.1`'s config.json (its `sliding_window` of 4096 changes
    /// nothing for sequences up to 4096 tokens, the longest [`build`] accepts for it).
    pub fn mistral_7b_v0_1() -> Self {
        Config {
            model_type: ModelType::Mistral,
            hidden_size: 4096,
            intermediate_size: 14336,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            max_position_embeddings: 32768,
            rms_norm_eps: 1e-5,
            sliding_window: Some(4096),
            ..Self::llama_defaults()
        }
    }

    /// A test model: 2 layers, 32 wide, 2 heads sharing 1 key/value head (grouped-query
    /// attention), vocab 100, untied head; the rest `LlamaConfig`'s defaults.
    pub fn tiny() -> Self {
        Config {
            vocab_size: 100,
            hidden_size: 32,
            intermediate_size: 64,
            num_hidden_layers: 2,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            ..Self::llama_defaults()
        }
    }

    /// [`Config::tiny`] as Qwen2: q/k/v biases and a tied head.
    pub fn tiny_qwen2() -> Self {
        Config {
            model_type: ModelType::Qwen2,
            tie_word_embeddings: true,
            ..Self::tiny()
        }
    }

    pub fn describe(&self) -> String {
        for (name, cfg) in [
            ("tinyllama-1.1b", Self::tinyllama_1_1b()),
            ("llama-3.2-1b", Self::llama_3_2_1b()),
            ("qwen2.5-0.5b", Self::qwen2_5_0_5b()),
            ("mistral-7b-v0.1", Self::mistral_7b_v0_1()),
        ] {
            if *self == cfg {
                return name.into();
            }
        }
        format!(
            "{}(num_hidden_layers {}, hidden_size {}, num_attention_heads {}, num_key_value_heads {}, \
             intermediate_size {}, vocab {}, tie_word_embeddings {})",
            self.model_type.hf_name(),
            self.num_hidden_layers,
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.intermediate_size,
            self.vocab_size,
            self.tie_word_embeddings
        )
    }

    pub fn head_dim(&self) -> i64 {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Whether q/k/v carry biases (`attention_bias`, or Qwen2's fixed `bias=True`).
    pub fn qkv_bias(&self) -> bool {
        self.attention_bias || self.model_type == ModelType::Qwen2
    }

    /// Whether o_proj carries a bias (Qwen2's never does).
    pub fn o_bias(&self) -> bool {
        self.attention_bias && self.model_type != ModelType::Qwen2
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| {
            Err(ModelError::InvalidConfig {
                model: self.describe(),
                what,
            })
        };
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("max_position_embeddings", self.max_position_embeddings),
            ("head_dim", self.head_dim()),
        ];
        if let Some((field, v)) = sizes.iter().find(|(_, v)| *v < 1) {
            return bad(format!("{field} must be positive, got {v}"));
        }
        if self.num_hidden_layers < 0 {
            return bad(format!(
                "num_hidden_layers must not be negative, got {}",
                self.num_hidden_layers
            ));
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return bad(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if self.head_dim() % 2 != 0 {
            return bad(format!(
                "head_dim {} must be even for rotary embeddings",
                self.head_dim()
            ));
        }
        Ok(())
    }

    /// Parameters of `LlamaForCausalLM` (a tied `lm_head` counted once, as
    /// `model.parameters()` does), from the configuration alone.
    pub fn param_count(&self) -> i64 {
        let (d, i, hd) = (self.hidden_size, self.intermediate_size, self.head_dim());
        let (q, kv) = (self.num_attention_heads * hd, self.num_key_value_heads * hd);
        let qkv_bias = if self.qkv_bias() { q + 2 * kv } else { 0 };
        let o_bias = if self.o_bias() { d } else { 0 };
        let mlp_bias = if self.mlp_bias { 2 * i + d } else { 0 };
        let attn = d * q + 2 * d * kv + q * d + qkv_bias + o_bias;
        let layer = attn + 3 * d * i + mlp_bias + 2 * d;
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * d
        };
        self.vocab_size * d + self.num_hidden_layers * layer + d + head
    }

    pub fn block_names(&self) -> Vec<String> {
        let mut names = vec!["model.embed_tokens".to_string()];
        names.extend((0..self.num_hidden_layers).map(|n| format!("model.layers.{n}")));
        names.push("model.norm".into());
        names
    }

    /// `LlamaForCausalLM.named_modules()` (root excluded).
    pub fn module_names(&self) -> Vec<String> {
        let mut names: Vec<String> = ["model", "model.embed_tokens", "model.layers"].map(String::from).into();
        for n in 0..self.num_hidden_layers {
            let l = format!("model.layers.{n}");
            names.push(l.clone());
            names.extend(
                [
                    "self_attn",
                    "self_attn.q_proj",
                    "self_attn.k_proj",
                    "self_attn.v_proj",
                    "self_attn.o_proj",
                    "mlp",
                    "mlp.gate_proj",
                    "mlp.up_proj",
                    "mlp.down_proj",
                    "mlp.act_fn",
                    "input_layernorm",
                    "post_attention_layernorm",
                ]
                .map(|s| format!("{l}.{s}")),
            );
        }
        names.extend(["model.norm", "model.rotary_emb", "lm_head"].map(String::from));
        names
    }

    /// `LlamaRotaryEmbedding.inv_freq` (a non-persistent buffer: not in the state dict).
    fn inv_freq(&self, device: tch::Device) -> Tensor {
        rotary::inv_freq(self.head_dim(), self.rope_theta, self.rope_scaling.as_ref(), device)
    }
}

/// `LlamaRMSNorm` (`Qwen2RMSNorm`, `MistralRMSNorm`).
struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    fn new(path: &nn::Path<'_>, dim: i64, eps: f64, spec: Spec) -> Result<Self> {
        Ok(RmsNorm {
            weight: param(path, "weight", &[dim], Init::Ones, spec)?,
            eps,
        })
    }

    fn forward(&self, hidden_states: &Tensor) -> Tensor {
        // Reassignments (not shadowing) free what Python's rebinding frees.
        let input_dtype = hidden_states.kind();
        let mut hidden_states = hidden_states.to_kind(Kind::Float);
        let variance = hidden_states.pow_tensor_scalar(2).mean_dim(-1, true, None::<Kind>);
        hidden_states = &hidden_states * (&variance + self.eps).rsqrt();
        &self.weight * hidden_states.to_kind(input_dtype)
    }
}

/// What `LlamaModel.forward` computes once before its layers, in its order, and hands every
/// attention: `position_ids` (`[1, seq]`, a local of the forward), the causal mask (eager:
/// `create_causal_mask`'s additive one; SDPA: `sdpa_mask`'s bool one, only where the batch
/// pads), then `model.rotary_emb`'s `(cos, sin)`. The runtime holds them through the
/// micro-step ([`SharedInputs`]), so a checkpointed layer keeps the ones PyTorch's
/// `torch.utils.checkpoint` saves as its inputs, and a plain layer's graph saves these, not a
/// pair of its own.
struct Positions {
    inv_freq: Tensor,
    /// `None`: eager.
    sdpa: Option<Sdpa>,
}

/// Where [`Positions`] puts each tensor; the mask is last and absent where SDPA needs none.
const COS: usize = 1;
const SIN: usize = 2;
const MASK: usize = 3;

impl SharedInputs for Positions {
    fn compute(&self, seq: i64, kind: Kind, device: tch::Device, bias: Option<&Tensor>, padded: bool) -> Vec<Tensor> {
        let position_ids = Tensor::arange(seq, (Kind::Int64, device)).unsqueeze(0);
        let mask = match &self.sdpa {
            Some(sdpa) => sdpa.mask(bias, padded),
            None => Some(Attention::causal_mask(bias, seq, kind, device)),
        };
        let (cos, sin) = rotary::cos_sin(&self.inv_freq, &position_ids, kind);
        let mut shared = vec![position_ids, cos, sin];
        shared.extend(mask);
        shared
    }
}

/// `LlamaAttention` (self-attention, no cache), reading the rotary embedding and causal mask
/// `LlamaModel` hands it from [`Ctx::shared`] (computing them itself when called alone).
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    positions: Positions,
    head_dim: i64,
    num_key_value_groups: i64,
    attention_dropout: f64,
    fused: bool,
    /// `None`: eager.
    sdpa: Option<Sdpa>,
}

impl Attention {
    /// `create_causal_mask` for the eager path: 0 where a query may attend (causal and, if a
    /// padding bias is given, not padding), `finfo(dtype).min` elsewhere.
    fn causal_mask(padding: Option<&Tensor>, seq: i64, kind: Kind, device: tch::Device) -> Tensor {
        let causal = Tensor::ones([seq, seq], (Kind::Bool, device))
            .tril(0)
            .view([1, 1, seq, seq]);
        let min = Tensor::full([], finfo_min(kind), (kind, device));
        match padding {
            // The padding bias is `[batch, 1, 1, seq]` with 0 / min already.
            Some(bias) => bias.to_kind(kind).where_self(&causal, &min),
            None => Tensor::zeros([], (kind, device)).where_self(&causal, &min),
        }
    }

    /// `LlamaAttention.forward`: returns `(attn_output, attn_weights)` (no weights under SDPA).
    /// Locals live as long as Python's: `query_states`, `key_states`, `value_states` (after the
    /// rotary embedding) and `cos`, `sin` until the return; `eager_attention_forward`'s
    /// repeated keys and values until it returns.
    fn forward(&self, hidden_states: &Tensor, ctx: &Ctx<'_>) -> (Tensor, Option<Tensor>) {
        let mut input_shape = hidden_states.size();
        input_shape.pop();
        let seq = input_shape[1];
        let mut hidden_shape = input_shape.clone();
        hidden_shape.extend([-1, self.head_dim]);
        let heads = |t: Tensor| t.view(hidden_shape.as_slice()).transpose(1, 2);
        let mut query_states = heads(self.q_proj.forward(hidden_states));
        let mut key_states = heads(self.k_proj.forward(hidden_states));
        let value_states = heads(self.v_proj.forward(hidden_states));
        let own;
        let shared = if ctx.shared.is_empty() {
            let (kind, device) = (hidden_states.kind(), hidden_states.device());
            own = self
                .positions
                .compute(seq, kind, device, ctx.attention_mask, ctx.padded);
            &own[..]
        } else {
            ctx.shared
        };
        let (cos, sin) = (&shared[COS], &shared[SIN]);
        // apply_rotary_pos_emb(unsqueeze_dim=1); the by-value operators drop their operands
        // as soon as consumed, as Python frees its temporaries.
        let (cos_u, sin_u) = (cos.unsqueeze(1), sin.unsqueeze(1));
        let q_embed = &query_states * &cos_u + rotary::rotate_half(&query_states) * &sin_u;
        let k_embed = &key_states * &cos_u + rotary::rotate_half(&key_states) * &sin_u;
        query_states = q_embed;
        key_states = k_embed;
        let (attn_output, attn_weights) = match &self.sdpa {
            None => {
                let (output, weights) = self.eager(&query_states, &key_states, &value_states, &shared[MASK], ctx.train);
                (output, Some(weights))
            }
            Some(sdpa) => {
                let p = if ctx.train { self.attention_dropout } else { 0.0 };
                let output = sdpa.forward(&query_states, &key_states, &value_states, shared.get(MASK), p);
                (output, None)
            }
        };
        let mut out_shape = input_shape;
        out_shape.push(-1);
        let attn_output = attn_output.reshape(out_shape.as_slice()).contiguous();
        (self.o_proj.forward(&attn_output), attn_weights)
    }

    /// `eager_attention_forward`. The mask is in the model's float dtype (HF builds it from
    /// `inputs_embeds`), so under autocast the bf16 scores are promoted to f32 by the
    /// addition, as in PyTorch.
    fn eager(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        causal_mask: &Tensor,
        train: bool,
    ) -> (Tensor, Tensor) {
        let key_states = repeat_kv(key, self.num_key_value_groups);
        let value_states = repeat_kv(value, self.num_key_value_groups);
        let scaling = (self.head_dim as f64).powf(-0.5);
        let mut attn_weights = query.matmul(&key_states.transpose(2, 3)) * scaling;
        // Out of place, as Python's `+`: tch's `+=` is `add_`, which would keep bf16 scores
        // bf16 instead of promoting them to the mask's f32.
        attn_weights = attn_weights.g_add(causal_mask);
        attn_weights = attn_weights.softmax(-1, Some(Kind::Float)).to_kind(query.kind());
        attn_weights = dropout(&attn_weights, self.attention_dropout, train, self.fused);
        let mut attn_output = attn_weights.matmul(&value_states);
        attn_output = attn_output.transpose(1, 2).contiguous();
        (attn_output, attn_weights)
    }
}

/// `LlamaMLP` with `hidden_act = "silu"`.
struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    /// `down_proj(act_fn(gate_proj(x)) * up_proj(x))`, each temporary dropped when Python
    /// frees it (a Rust temporary would live to the end of the statement).
    fn forward(&self, x: &Tensor) -> Tensor {
        let gate = self.gate_proj.forward(x);
        let act = gate.silu();
        drop(gate);
        let up = self.up_proj.forward(x);
        let product = act * up;
        self.down_proj.forward(&product)
    }
}

/// `LlamaDecoderLayer`.
struct Layer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl Block for Layer {
    fn forward(&self, input: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        // `residual = hidden_states` is the block input. `hidden_states, _ = self.self_attn(…)`
        // keeps the attention weights in `_` until the layer returns.
        let mut hidden_states = self.input_layernorm.forward(input);
        let (attn_output, _attn_weights) = self.self_attn.forward(&hidden_states, ctx);
        hidden_states = attn_output;
        hidden_states = input + hidden_states;
        let residual = hidden_states.shallow_clone();
        hidden_states = self.post_attention_layernorm.forward(&hidden_states);
        hidden_states = self.mlp.forward(&hidden_states);
        residual + hidden_states
    }
}

impl PreNormLayer for Layer {
    const CHILDREN: [&'static str; 4] = ["input_layernorm", "self_attn", "post_attention_layernorm", "mlp"];

    fn split(self) -> [Box<dyn Block>; 4] {
        [
            Box::new(Norm(self.input_layernorm)),
            Box::new(AttnBlock(self.self_attn)),
            Box::new(Norm(self.post_attention_layernorm)),
            Box::new(MlpBlock(self.mlp)),
        ]
    }

    fn residual() -> Box<dyn Block> {
        Box::new(ResidualAdd)
    }
}

/// `model.embed_tokens`.
struct Embed(Embedding);

impl Block for Embed {
    fn forward(&self, input_ids: &Tensor, _ctx: &Ctx<'_>) -> Tensor {
        self.0.forward(input_ids)
    }
}

/// An RMSNorm (`model.norm`, a layer's `input_layernorm` / `post_attention_layernorm`) as a
/// block of its own.
struct Norm(RmsNorm);

impl Block for Norm {
    fn forward(&self, hidden_states: &Tensor, _ctx: &Ctx<'_>) -> Tensor {
        self.0.forward(hidden_states)
    }
}

/// `model.layers.N.self_attn` as a block of its own: the output (the weights die with it).
struct AttnBlock(Attention);

impl Block for AttnBlock {
    fn forward(&self, hidden_states: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        self.0.forward(hidden_states, ctx).0
    }
}

/// `model.layers.N.mlp` as a block of its own.
struct MlpBlock(Mlp);

impl Block for MlpBlock {
    fn forward(&self, hidden_states: &Tensor, _ctx: &Ctx<'_>) -> Tensor {
        self.0.forward(hidden_states)
    }
}

/// A residual sum of `LlamaDecoderLayer.forward` (not a module): skip 0 plus its input, in
/// HF's operand order (`residual + hidden_states`).
struct ResidualAdd;

impl Block for ResidualAdd {
    fn forward(&self, hidden_states: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        ctx.skip(0) + hidden_states
    }
}

/// Builds `cfg` as a chain named `name` for sequences of `opts.seq` tokens (default 2048,
/// capped at `max_position_embeddings`).
pub fn build(name: &str, cfg: &Config, opts: &ModelOptions) -> Result<Chain> {
    opts.reject(name, "image", opts.image, "Llama takes token sequences; use --seq")?;
    opts.reject(
        name,
        "classes",
        opts.classes,
        "Llama's targets are next tokens over the vocabulary",
    )?;
    let spec = opts.spec(name)?;
    let mut cfg = cfg.clone();
    if let Some(heads) = opts.heads {
        cfg.num_attention_heads = heads;
    }
    cfg.validate()?;
    let seq = opts.seq.unwrap_or(DEFAULT_SEQ.min(cfg.max_position_embeddings));
    if !(1..=cfg.max_position_embeddings).contains(&seq) {
        return Err(ModelError::InvalidOption {
            model: name.to_string(),
            option: "seq",
            value: seq.to_string(),
            why: format!(
                "the sequence length must be in 1..={} (max_position_embeddings)",
                cfg.max_position_embeddings
            ),
        });
    }
    if let Some(window) = cfg.sliding_window.filter(|w| seq > *w) {
        return Err(ModelError::InvalidOption {
            model: name.to_string(),
            option: "seq",
            value: seq.to_string(),
            why: format!(
                "sequences longer than sliding_window {window} need Mistral's windowed attention mask, \
                 which ckptune does not model"
            ),
        });
    }
    build_chain(
        name,
        &cfg,
        seq,
        spec,
        opts.granularity,
        opts.attention.unwrap_or_default(),
    )
}

fn build_chain(
    name: &str,
    cfg: &Config,
    seq: i64,
    spec: Spec,
    granularity: Granularity,
    attention: Implementation,
) -> Result<Chain> {
    let vs = nn::VarStore::new(spec.device);
    let root = vs.root();
    let model = &root / "model";
    let (d, std, hd) = (cfg.hidden_size, cfg.initializer_range, cfg.head_dim());
    let linear = |path: nn::Path<'_>, i: i64, o: i64, bias: bool| {
        Linear::new(&path, i, o, Init::Normal { std }, bias.then_some(Init::Zeros), spec)
    };
    let embed_tokens = Embedding::hf(&(&model / "embed_tokens"), cfg.vocab_size, d, None, std, spec)?;
    let tied = embed_tokens.weight.shallow_clone();
    let inv_freq = cfg.inv_freq(spec.device);
    let sdpa = (attention == Implementation::Sdpa).then_some(Sdpa {
        scaling: (hd as f64).powf(-0.5),
        causal: true,
        kv_groups: cfg.num_attention_heads / cfg.num_key_value_heads,
        kernels: spec.trace_kernels,
    });
    let mut groups = Vec::new();
    let mut blocks = vec![ChainBlock::new(
        "model.embed_tokens",
        true,
        Box::new(Embed(embed_tokens)),
    )];
    for n in 0..cfg.num_hidden_layers {
        let l = &model / "layers" / n;
        let a = &l / "self_attn";
        let m = &l / "mlp";
        let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        let layer = Layer {
            input_layernorm: RmsNorm::new(&(&l / "input_layernorm"), d, cfg.rms_norm_eps, spec)?,
            self_attn: Attention {
                q_proj: linear(&a / "q_proj", d, q, cfg.qkv_bias())?,
                k_proj: linear(&a / "k_proj", d, kv, cfg.qkv_bias())?,
                v_proj: linear(&a / "v_proj", d, kv, cfg.qkv_bias())?,
                o_proj: linear(&a / "o_proj", q, d, cfg.o_bias())?,
                positions: Positions {
                    inv_freq: inv_freq.shallow_clone(),
                    sdpa,
                },
                head_dim: hd,
                num_key_value_groups: cfg.num_attention_heads / cfg.num_key_value_heads,
                attention_dropout: cfg.attention_dropout,
                fused: spec.fused_dropout(),
                sdpa,
            },
            post_attention_layernorm: RmsNorm::new(&(&l / "post_attention_layernorm"), d, cfg.rms_norm_eps, spec)?,
            mlp: Mlp {
                gate_proj: linear(&m / "gate_proj", d, cfg.intermediate_size, cfg.mlp_bias)?,
                up_proj: linear(&m / "up_proj", d, cfg.intermediate_size, cfg.mlp_bias)?,
                down_proj: linear(&m / "down_proj", cfg.intermediate_size, d, cfg.mlp_bias)?,
            },
        };
        push_layer(
            &mut blocks,
            &mut groups,
            format!("model.layers.{n}"),
            layer,
            granularity,
        );
    }
    let norm = RmsNorm::new(&(&model / "norm"), d, cfg.rms_norm_eps, spec)?;
    blocks.push(ChainBlock::new("model.norm", true, Box::new(Norm(norm))));
    let lm_head = if cfg.tie_word_embeddings {
        tied
    } else {
        linear(&root / "lm_head", d, cfg.vocab_size, false)?.weight
    };

    Ok(Chain {
        name: name.to_string(),
        vs,
        blocks,
        groups,
        head: Box::new(CausalLm::new(lm_head, cfg.vocab_size)),
        modules: cfg.module_names(),
        input: InputSpec::Tokens {
            seq,
            vocab: cfg.vocab_size,
            targets: TokenTargets::PerToken,
        },
        reference_params: cfg.param_count(),
        attention: Some(attention),
        shared: Some(Box::new(Positions { inv_freq, sdpa })),
    })
}

pub fn tinyllama_1_1b(opts: &ModelOptions) -> Result<Chain> {
    build("tinyllama-1.1b", &Config::tinyllama_1_1b(), opts)
}

pub fn llama_3_2_1b(opts: &ModelOptions) -> Result<Chain> {
    build("llama-3.2-1b", &Config::llama_3_2_1b(), opts)
}

pub fn qwen2_5_0_5b(opts: &ModelOptions) -> Result<Chain> {
    build("qwen2.5-0.5b", &Config::qwen2_5_0_5b(), opts)
}

pub fn mistral_7b_v0_1(opts: &ModelOptions) -> Result<Chain> {
    build("mistral-7b-v0.1", &Config::mistral_7b_v0_1(), opts)
}

/// [`Config::tiny`] on 16-token sequences unless `opts.seq` says otherwise.
pub fn tiny(opts: &ModelOptions) -> Result<Chain> {
    let opts = ModelOptions {
        seq: opts.seq.or(Some(16)),
        ..opts.clone()
    };
    build("tiny-llama", &Config::tiny(), &opts)
}

/// [`Config::tiny_qwen2`] on 16-token sequences unless `opts.seq` says otherwise.
pub fn tiny_qwen2(opts: &ModelOptions) -> Result<Chain> {
    let opts = ModelOptions {
        seq: opts.seq.or(Some(16)),
        ..opts.clone()
    };
    build("tiny-qwen2", &Config::tiny_qwen2(), &opts)
}
