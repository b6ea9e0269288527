//! GPT-2 as Hugging Face's `transformers/models/gpt2/modeling_gpt2.py` builds `GPT2Model`,
//! with `GPT2LMHeadModel`'s tied LM head and causal-LM loss, as a chain of named blocks.
//!
//! Attention is the **eager** path of transformers 4.x (`eager_attention_forward`, formerly
//! `GPT2Attention._attn`): `matmul`, divide by a 0-dim `sqrt(head_dim)` tensor, `torch.where`
//! with the layer's causal `bias` buffer (a non-persistent `[1, 1, n_positions, n_positions]`
//! bool tril per layer, as HF allocates it) and `finfo.min`, optional additive mask, softmax,
//! dropout, `matmul`. With [`crate::Attention::Sdpa`], attention is transformers 5's
//! `sdpa_attention_forward` instead ([`crate::sdpa`]; `is_causal` unless the batch pads, the
//! scaling `GPT2Attention.scaling`, `attn_pdrop` as SDPA's dropout in training), which keeps no
//! `[batch, heads, seq, seq]` scores for backward. `Conv1D` keeps HF's transposed `[in, out]` weight and `addmm`; `gelu_new` is the
//! written-out tanh formula. Each `forward` mirrors the Python statement by statement,
//! including which locals stay alive until the function returns.
//!
//! Chain: `wte+wpe+drop` (embedding group, not a candidate), `h.0` … `h.{N-1}`, `ln_f`. Under
//! SDPA, where the batch pads, the causal mask is made once per micro-batch and read by every
//! layer from [`Ctx::shared`], as `GPT2Model.forward` makes it once and hands it to each block: a
//! checkpointed layer keeps it as its input until its backward, as `torch.utils.checkpoint`
//! does (made by each attention, it died with the layer's forward, and PyTorch's peak of a plan
//! with `h.0` checkpointed was above the prediction by it: 8,192 B for tiny-GPT-2 at batch 8,
//! sequence 32). The chain holds it through the micro-step, one mask above PyTorch where no
//! checkpointed layer keeps it, as BERT's.
//! Deviation: GPT2Model keeps its locals `inputs_embeds` (`[batch, seq, n_embd]`) and
//! `position_embeds` (`[1, seq, n_embd]`) alive until the whole transformer returns; here they
//! die with the embedding group, so memory during the layers' forward is lower by those two
//! tensors — a chain cannot keep a block's locals alive. (ResNet and BERT have no such
//! cross-block locals.)
//!
//! Loss: `lm_head` (no bias, weight tied to `wte.weight`: no extra parameters) and HF's
//! `ForCausalLMLoss`: `logits.float()`, labels padded on the right with -100 and shifted by
//! one, mean cross entropy. The labels are the batch's per-token `target` (Hugging Face
//! passes `labels = input_ids`; the loss does the shifting).

use tch::{nn, Kind, Tensor};

use crate::causal_lm::CausalLm;
use crate::chain::{Block, Chain, ChainBlock, Ctx, InputSpec, SharedInputs, TokenTargets};
use crate::decoder::{push_layer, PreNormLayer};
use crate::error::{ModelError, Result};
use crate::layers::{dropout, finfo_min, Activation, Conv1D, Embedding, LayerNorm, Spec};
use crate::options::{Attention as Implementation, Granularity, ModelOptions};
use crate::sdpa::{Sdpa, SdpaMask};

/// The fields of HF's `GPT2Config` that shape `GPT2Model`.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub vocab_size: i64,
    pub n_positions: i64,
    pub n_embd: i64,
    pub n_layer: i64,
    pub n_head: i64,
    /// `None`: `4 * n_embd`.
    pub n_inner: Option<i64>,
    pub activation_function: Activation,
    pub resid_pdrop: f64,
    pub embd_pdrop: f64,
    pub attn_pdrop: f64,
    pub layer_norm_epsilon: f64,
    pub initializer_range: f64,
    pub scale_attn_weights: bool,
    pub scale_attn_by_inverse_layer_idx: bool,
}

/// Default sequence length: GPT-2's full context.
pub const DEFAULT_SEQ: i64 = 1024;

impl Config {
    /// `gpt2`'s config.json (124M).
    pub fn gpt2() -> Self {
        Config {
            vocab_size: 50257,
            n_positions: 1024,
            n_embd: 768,
            n_layer: 12,
            n_head: 12,
            n_inner: None,
            activation_function: Activation::GeluNew,
            resid_pdrop: 0.1,
            embd_pdrop: 0.1,
            attn_pdrop: 0.1,
            layer_norm_epsilon: 1e-5,
            initializer_range: 0.02,
            scale_attn_weights: true,
            scale_attn_by_inverse_layer_idx: false,
        }
    }

    /// `gpt2-medium`'s config.json (355M).
    pub fn gpt2_medium() -> Self {
        Config {
            n_embd: 1024,
            n_layer: 24,
            n_head: 16,
            ..Self::gpt2()
        }
    }

    /// A test model: 2 layers, 32 wide, 2 heads, vocab 100, 32 positions.
    pub fn tiny() -> Self {
        Config {
            vocab_size: 100,
            n_positions: 32,
            n_embd: 32,
            n_layer: 2,
            n_head: 2,
            ..Self::gpt2()
        }
    }

    pub fn describe(&self) -> String {
        if *self == Self::gpt2() {
            return "gpt2".into();
        }
        if *self == Self::gpt2_medium() {
            return "gpt2-medium".into();
        }
        format!(
            "GPT2Model(n_layer {}, n_embd {}, n_head {}, n_inner {}, vocab {}, n_positions {})",
            self.n_layer,
            self.n_embd,
            self.n_head,
            self.inner(),
            self.vocab_size,
            self.n_positions
        )
    }

    /// `GPT2Attention.scaling` of the layer with 1-based index `layer`: `head_dim ** -0.5` if
    /// `scale_attn_weights`, divided by `layer` if `scale_attn_by_inverse_layer_idx`.
    pub fn scaling(&self, layer: i64) -> f64 {
        let mut scaling = 1.0;
        if self.scale_attn_weights {
            scaling = ((self.n_embd / self.n_head) as f64).powf(-0.5);
        }
        if self.scale_attn_by_inverse_layer_idx {
            scaling /= layer as f64;
        }
        scaling
    }

    pub fn inner(&self) -> i64 {
        self.n_inner.unwrap_or(4 * self.n_embd)
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
            ("n_positions", self.n_positions),
            ("n_embd", self.n_embd),
            ("n_head", self.n_head),
            ("n_inner", self.inner()),
        ];
        if let Some((field, v)) = sizes.iter().find(|(_, v)| *v < 1) {
            return bad(format!("{field} must be positive, got {v}"));
        }
        if self.n_layer < 0 {
            return bad(format!("n_layer must not be negative, got {}", self.n_layer));
        }
        if self.n_embd % self.n_head != 0 {
            return bad(format!(
                "embed_dim must be divisible by num_heads (got embed_dim {} and num_heads {})",
                self.n_embd, self.n_head
            ));
        }
        Ok(())
    }

    /// Parameters of `GPT2Model` (the tied LM head adds none), from the configuration alone.
    pub fn param_count(&self) -> i64 {
        let (d, i) = (self.n_embd, self.inner());
        let layer = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * i + i) + (i * d + d);
        (self.vocab_size + self.n_positions) * d + self.n_layer * layer + 2 * d
    }

    pub fn block_names(&self) -> Vec<String> {
        let mut names = vec![EMBED.to_string()];
        names.extend((0..self.n_layer).map(|n| format!("h.{n}")));
        names.push("ln_f".into());
        names
    }

    /// `GPT2LMHeadModel.named_modules()` with the `transformer.` prefix removed: GPT2Model's
    /// modules, then `lm_head`.
    pub fn module_names(&self) -> Vec<String> {
        let mut names: Vec<String> = ["wte", "wpe", "drop", "h"].map(String::from).into();
        for n in 0..self.n_layer {
            let l = format!("h.{n}");
            names.push(l.clone());
            names.extend(
                [
                    "ln_1",
                    "attn",
                    "attn.c_attn",
                    "attn.c_proj",
                    "attn.attn_dropout",
                    "attn.resid_dropout",
                    "ln_2",
                    "mlp",
                    "mlp.c_fc",
                    "mlp.c_proj",
                    "mlp.act",
                    "mlp.dropout",
                ]
                .map(|s| format!("{l}.{s}")),
            );
        }
        names.extend(["ln_f", "lm_head"].map(String::from));
        names
    }
}

const EMBED: &str = "wte+wpe+drop";

/// The embedding part of `GPT2Model.forward`.
struct Embeddings {
    wte: Embedding,
    wpe: Embedding,
    p: f64,
    fused: bool,
}

impl Block for Embeddings {
    fn forward(&self, input_ids: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        let input_shape = input_ids.size();
        let seq = *input_shape.last().expect("input ids have a sequence dimension");
        let input_ids = input_ids.view([-1, seq]);
        let inputs_embeds = self.wte.forward(&input_ids);
        let cache_position = Tensor::arange(seq, (Kind::Int64, input_ids.device()));
        let position_ids = cache_position.unsqueeze(0);
        let position_embeds = self.wpe.forward(&position_ids);
        let mut hidden_states = &inputs_embeds + &position_embeds;
        hidden_states = dropout(&hidden_states, self.p, ctx.train, self.fused);
        hidden_states
    }
}

/// `GPT2Attention` (self-attention, no cache).
struct Attention {
    c_attn: Conv1D,
    c_proj: Conv1D,
    path: Path,
    n_embd: i64,
    head_dim: i64,
    /// 1-based layer index for `scale_attn_by_inverse_layer_idx`.
    layer_idx: i64,
    scale_attn_weights: bool,
    scale_attn_by_inverse_layer_idx: bool,
    attn_pdrop: f64,
    resid_pdrop: f64,
    fused: bool,
}

/// How `GPT2Attention` attends: transformers 4's eager path, with its causal `bias` buffer
/// (`tril(ones(n_positions, n_positions, bool)).view(1, 1, n, n)`), or transformers 5's SDPA
/// path, whose module has no such buffer.
enum Path {
    Eager { bias: Tensor },
    Sdpa(Sdpa),
}

impl Attention {
    /// `eager_attention_forward`: returns `(attn_output, attn_weights)` like HF, whose caller
    /// keeps the weights alive until the block returns.
    fn eager(
        &self,
        bias: &Tensor,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        mask: Option<&Tensor>,
        train: bool,
    ) -> (Tensor, Tensor) {
        let mut attn_weights = query.matmul(&key.transpose(-1, -2));
        if self.scale_attn_weights {
            let scale = Tensor::full(
                [],
                (value.size()[3] as f64).sqrt(),
                (attn_weights.kind(), attn_weights.device()),
            );
            attn_weights = &attn_weights / &scale;
        }
        if self.scale_attn_by_inverse_layer_idx {
            attn_weights = &attn_weights / (self.layer_idx as f64);
        }
        let (query_length, key_length) = (query.size()[2], key.size()[2]);
        let causal_mask = bias
            .slice(2, key_length - query_length, key_length, 1)
            .slice(3, 0, key_length, 1);
        let mask_value = Tensor::full(
            [],
            finfo_min(attn_weights.kind()),
            (attn_weights.kind(), attn_weights.device()),
        );
        attn_weights = attn_weights.where_self(&causal_mask, &mask_value);
        if let Some(mask) = mask {
            attn_weights = &attn_weights + mask;
        }
        attn_weights = attn_weights.softmax(-1, None::<Kind>);
        if attn_weights.kind() != value.kind() {
            attn_weights = attn_weights.to_kind(value.kind());
        }
        attn_weights = dropout(&attn_weights, self.attn_pdrop, train, self.fused);
        let mut attn_output = attn_weights.matmul(value);
        attn_output = attn_output.transpose(1, 2);
        (attn_output, attn_weights)
    }

    /// `GPT2Attention.forward`: returns `(attn_output, attn_weights)` (no weights under SDPA).
    fn forward(&self, hidden_states: &Tensor, ctx: &Ctx<'_>) -> (Tensor, Option<Tensor>) {
        let train = ctx.train;
        let qkv = self.c_attn.forward(hidden_states).split(self.n_embd, 2);
        let heads = |t: &Tensor| {
            let mut shape = t.size();
            shape.pop();
            shape.extend([-1, self.head_dim]);
            t.view(shape.as_slice()).transpose(1, 2)
        };
        let query_states = heads(&qkv[0]);
        let key_states = heads(&qkv[1]);
        let value_states = heads(&qkv[2]);
        drop(qkv);
        let (mut attn_output, attn_weights) = match &self.path {
            Path::Eager { bias } => {
                let (output, weights) = self.eager(
                    bias,
                    &query_states,
                    &key_states,
                    &value_states,
                    ctx.attention_mask,
                    train,
                );
                (output, Some(weights))
            }
            Path::Sdpa(sdpa) => {
                let mut own = None;
                let mask = sdpa.mask_in(ctx, &mut own);
                let p = if train { self.attn_pdrop } else { 0.0 };
                let output = sdpa.forward(&query_states, &key_states, &value_states, mask, p);
                (output, None)
            }
        };
        let mut shape = attn_output.size();
        shape.truncate(shape.len() - 2);
        shape.push(-1);
        attn_output = attn_output.reshape(shape.as_slice()).contiguous();
        attn_output = self.c_proj.forward(&attn_output);
        attn_output = dropout(&attn_output, self.resid_pdrop, train, self.fused);
        (attn_output, attn_weights)
    }
}

/// `GPT2MLP`.
struct Mlp {
    c_fc: Conv1D,
    c_proj: Conv1D,
    act: Activation,
    p: f64,
    fused: bool,
}

impl Mlp {
    fn forward(&self, hidden_states: &Tensor, train: bool) -> Tensor {
        let mut hidden_states = self.c_fc.forward(hidden_states);
        hidden_states = self.act.forward(&hidden_states, self.fused);
        hidden_states = self.c_proj.forward(&hidden_states);
        hidden_states = dropout(&hidden_states, self.p, train, self.fused);
        hidden_states
    }
}

/// `GPT2Block` (no cross-attention).
struct Layer {
    ln_1: LayerNorm,
    attn: Attention,
    ln_2: LayerNorm,
    mlp: Mlp,
}

impl Block for Layer {
    fn forward(&self, input: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        // `residual = hidden_states` is the block input.
        let mut hidden_states = self.ln_1.forward(input);
        // `attn_outputs` (output and weights) lives until the block returns.
        let attn_outputs = self.attn.forward(&hidden_states, ctx);
        hidden_states = &attn_outputs.0 + input;
        let residual = hidden_states.shallow_clone();
        hidden_states = self.ln_2.forward(&residual);
        let feed_forward_hidden_states = self.mlp.forward(&hidden_states, ctx.train);
        hidden_states = &residual + &feed_forward_hidden_states;
        hidden_states
    }
}

impl PreNormLayer for Layer {
    const CHILDREN: [&'static str; 4] = ["ln_1", "attn", "ln_2", "mlp"];

    fn split(self) -> [Box<dyn Block>; 4] {
        [
            Box::new(Norm(self.ln_1)),
            Box::new(AttnBlock(self.attn)),
            Box::new(Norm(self.ln_2)),
            Box::new(MlpBlock(self.mlp)),
        ]
    }

    fn residual() -> Box<dyn Block> {
        Box::new(ResidualAdd)
    }
}

/// A LayerNorm child (`h.N.ln_1`, `h.N.ln_2`) as a block of its own.
struct Norm(LayerNorm);

impl Block for Norm {
    fn forward(&self, hidden_states: &Tensor, _ctx: &Ctx<'_>) -> Tensor {
        self.0.forward(hidden_states)
    }
}

/// `h.N.attn` as a block of its own: the attention output (the weights die with the call).
struct AttnBlock(Attention);

impl Block for AttnBlock {
    fn forward(&self, hidden_states: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        self.0.forward(hidden_states, ctx).0
    }
}

/// `h.N.mlp` as a block of its own.
struct MlpBlock(Mlp);

impl Block for MlpBlock {
    fn forward(&self, hidden_states: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        self.0.forward(hidden_states, ctx.train)
    }
}

/// A residual sum of `GPT2Block.forward` (not a module): its input plus skip 0.
struct ResidualAdd;

impl Block for ResidualAdd {
    fn forward(&self, hidden_states: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        hidden_states + ctx.skip(0)
    }
}

/// `ln_f` (then `hidden_states.view(output_shape)`, a no-op view here).
struct FinalNorm {
    ln_f: LayerNorm,
}

impl Block for FinalNorm {
    fn forward(&self, hidden_states: &Tensor, _ctx: &Ctx<'_>) -> Tensor {
        self.ln_f.forward(hidden_states)
    }
}

/// Builds `cfg` as a chain named `name` for sequences of `opts.seq` tokens (default 1024,
/// capped at `n_positions`).
pub fn build(name: &str, cfg: &Config, opts: &ModelOptions) -> Result<Chain> {
    opts.reject(name, "image", opts.image, "GPT-2 takes token sequences; use --seq")?;
    opts.reject(
        name,
        "classes",
        opts.classes,
        "GPT-2's targets are next tokens over the vocabulary",
    )?;
    let spec = opts.spec(name)?;
    let mut cfg = cfg.clone();
    if let Some(heads) = opts.heads {
        cfg.n_head = heads;
    }
    cfg.validate()?;
    let seq = opts.seq.unwrap_or(DEFAULT_SEQ.min(cfg.n_positions));
    if !(1..=cfg.n_positions).contains(&seq) {
        return Err(ModelError::InvalidOption {
            model: name.to_string(),
            option: "seq",
            value: seq.to_string(),
            why: format!("the sequence length must be in 1..={} (n_positions)", cfg.n_positions),
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
    let (d, std) = (cfg.n_embd, cfg.initializer_range);
    // HF `_init_weights`: c_proj weights get std / sqrt(2 * n_layer) ("scaled init").
    let proj_std = std / ((2 * cfg.n_layer.max(1)) as f64).sqrt();
    let wte = Embedding::hf(&(&root / "wte"), cfg.vocab_size, d, None, std, spec)?;
    let tied = wte.weight.shallow_clone();
    let embeddings = Embeddings {
        wte,
        wpe: Embedding::hf(&(&root / "wpe"), cfg.n_positions, d, None, std, spec)?,
        p: cfg.embd_pdrop,
        fused: spec.fused_dropout(),
    };
    let mut groups = Vec::new();
    let mut blocks = vec![ChainBlock {
        extra_reads: Vec::new(),
        name: EMBED.into(),
        candidate: false,
        skips: Vec::new(),
        block: Box::new(embeddings),
    }];
    for n in 0..cfg.n_layer {
        let h = &root / "h" / n;
        let path = match attention {
            Implementation::Eager => {
                let n_pos = cfg.n_positions;
                let bias = Tensor::f_ones([n_pos, n_pos], (Kind::Bool, spec.device))
                    .and_then(|t| t.f_tril(0))
                    .and_then(|t| t.f_view([1, 1, n_pos, n_pos]))
                    .map_err(|e| {
                        ModelError::torch(format!("creating the causal mask buffer h.{n}.attn.bias of {name}"), e)
                    })?;
                Path::Eager { bias }
            }
            Implementation::Sdpa => Path::Sdpa(gpt2_sdpa(cfg, spec, n + 1)),
        };
        let layer = Layer {
            ln_1: LayerNorm::new(&(&h / "ln_1"), d, cfg.layer_norm_epsilon, spec)?,
            attn: Attention {
                c_attn: Conv1D::new(&(&h / "attn" / "c_attn"), 3 * d, d, std, spec)?,
                c_proj: Conv1D::new(&(&h / "attn" / "c_proj"), d, d, proj_std, spec)?,
                path,
                n_embd: d,
                head_dim: d / cfg.n_head,
                layer_idx: n + 1,
                scale_attn_weights: cfg.scale_attn_weights,
                scale_attn_by_inverse_layer_idx: cfg.scale_attn_by_inverse_layer_idx,
                attn_pdrop: cfg.attn_pdrop,
                resid_pdrop: cfg.resid_pdrop,
                fused: spec.fused_dropout(),
            },
            ln_2: LayerNorm::new(&(&h / "ln_2"), d, cfg.layer_norm_epsilon, spec)?,
            mlp: Mlp {
                c_fc: Conv1D::new(&(&h / "mlp" / "c_fc"), cfg.inner(), d, std, spec)?,
                c_proj: Conv1D::new(&(&h / "mlp" / "c_proj"), d, cfg.inner(), proj_std, spec)?,
                act: cfg.activation_function,
                p: cfg.resid_pdrop,
                fused: spec.fused_dropout(),
            },
        };
        push_layer(&mut blocks, &mut groups, format!("h.{n}"), layer, granularity);
    }
    let ln_f = LayerNorm::new(&(&root / "ln_f"), d, cfg.layer_norm_epsilon, spec)?;
    blocks.push(ChainBlock {
        extra_reads: Vec::new(),
        name: "ln_f".into(),
        candidate: true,
        skips: Vec::new(),
        block: Box::new(FinalNorm { ln_f }),
    });

    Ok(Chain {
        name: name.to_string(),
        vs,
        blocks,
        groups,
        head: Box::new(CausalLm::new(tied, cfg.vocab_size)),
        modules: cfg.module_names(),
        input: InputSpec::Tokens {
            seq,
            vocab: cfg.vocab_size,
            targets: TokenTargets::PerToken,
        },
        reference_params: cfg.param_count(),
        attention: Some(attention),
        shared: (attention == Implementation::Sdpa)
            .then(|| Box::new(SdpaMask(gpt2_sdpa(cfg, spec, 1))) as Box<dyn SharedInputs>),
    })
}

/// SDPA as GPT-2's attention at `layer_idx` (from 1) runs it: causal, one key/value head per
/// head, `GPT2Attention.scaling`.
fn gpt2_sdpa(cfg: &Config, spec: Spec, layer_idx: i64) -> Sdpa {
    Sdpa {
        scaling: cfg.scaling(layer_idx),
        causal: true,
        kv_groups: 1,
        kernels: spec.trace_kernels,
    }
}

pub fn gpt2(opts: &ModelOptions) -> Result<Chain> {
    build("gpt2", &Config::gpt2(), opts)
}

pub fn gpt2_medium(opts: &ModelOptions) -> Result<Chain> {
    build("gpt2-medium", &Config::gpt2_medium(), opts)
}

/// [`Config::tiny`] on 16-token sequences unless `opts.seq` says otherwise.
pub fn tiny(opts: &ModelOptions) -> Result<Chain> {
    let opts = ModelOptions {
        seq: opts.seq.or(Some(16)),
        ..opts.clone()
    };
    build("tiny-gpt2", &Config::tiny(), &opts)
}
