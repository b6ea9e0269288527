//! BERT as Hugging Face's `transformers/models/bert/modeling_bert.py` builds `BertModel`, with
//! a `BertForSequenceClassification` head for the loss, as a chain of named blocks.
//!
//! Attention is the **eager** path by default (`attn_implementation="eager"`, the classic
//! `BertSelfAttention` of transformers 4.x: `matmul`, divide by `sqrt(head_size)`, add the
//! additive mask, softmax, dropout, `matmul`). With [`crate::Attention::Sdpa`] it is
//! transformers 5's `BertSelfAttention` under SDPA, HF's default ([`crate::sdpa`]): no mask
//! when nothing is padded, else `sdpa_mask`'s bidirectional `[batch, 1, seq, seq]` bool, built
//! once per micro-batch as HF builds it once per forward (the chain's [`SharedInputs`], held by
//! the runtime through the micro-step, as a checkpointed layer keeps it as its input in
//! PyTorch), and `attention_probs_dropout_prob` as SDPA's dropout in training. Every `forward` mirrors the Python statement by statement,
//! including which locals stay alive until the function returns (e.g. the masked scores
//! beside the softmax output), so transient memory matches.
//!
//! Chain: `embeddings`, `encoder.layer.0` … `encoder.layer.{N-1}`, `pooler` — all candidates.
//! The loss head is BertForSequenceClassification's `dropout` + `classifier` + cross entropy;
//! its parameters (`classifier.weight`, `classifier.bias`) live in the var store but are not
//! part of [`Chain::reference_params`]. The attention mask reaches the layers through
//! [`Ctx::attention_mask`] as the additive `[batch, 1, 1, seq]` mask that
//! [`Chain::attention_bias`] builds (`(1 - mask) * finfo(dtype).min`, as HF's
//! `get_extended_attention_mask`). Token type ids are all zero, as when HF is not given any.

use tch::{nn, Kind, Tensor};

use crate::chain::{Batch, Block, Chain, ChainBlock, ChainGroup, Ctx, InputSpec, LossHead, SharedInputs, TokenTargets};
use crate::error::{ModelError, Result};
use crate::layers::{div_by_python_float, dropout, Activation, Embedding, LayerNorm, Linear, Spec};
use crate::options::{Attention as Implementation, Granularity, ModelOptions};
use crate::sdpa::{Sdpa, SdpaMask};

/// The fields of HF's `BertConfig` that shape `BertModel` (absolute position embeddings,
/// encoder only), plus `num_labels` / `classifier_dropout` of the classification head.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub intermediate_size: i64,
    pub hidden_act: Activation,
    pub hidden_dropout_prob: f64,
    pub attention_probs_dropout_prob: f64,
    pub max_position_embeddings: i64,
    pub type_vocab_size: i64,
    pub initializer_range: f64,
    pub layer_norm_eps: f64,
    pub pad_token_id: i64,
    pub num_labels: i64,
    /// `None`: the head uses `hidden_dropout_prob`, as HF does.
    pub classifier_dropout: Option<f64>,
}

/// Default sequence length (a typical fine-tuning length).
pub const DEFAULT_SEQ: i64 = 128;

impl Config {
    /// `bert-base-uncased`'s config.json.
    pub fn bert_base_uncased() -> Self {
        Config {
            vocab_size: 30522,
            hidden_size: 768,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            intermediate_size: 3072,
            hidden_act: Activation::Gelu,
            hidden_dropout_prob: 0.1,
            attention_probs_dropout_prob: 0.1,
            max_position_embeddings: 512,
            type_vocab_size: 2,
            initializer_range: 0.02,
            layer_norm_eps: 1e-12,
            pad_token_id: 0,
            num_labels: 2,
            classifier_dropout: None,
        }
    }

    /// `bert-large-uncased`'s config.json.
    pub fn bert_large_uncased() -> Self {
        Config {
            hidden_size: 1024,
            num_hidden_layers: 24,
            num_attention_heads: 16,
            intermediate_size: 4096,
            ..Self::bert_base_uncased()
        }
    }

    /// A test model: 2 layers, hidden 32, 2 heads, intermediate 64, vocab 100, 32 positions.
    pub fn tiny() -> Self {
        Config {
            vocab_size: 100,
            hidden_size: 32,
            num_hidden_layers: 2,
            num_attention_heads: 2,
            intermediate_size: 64,
            max_position_embeddings: 32,
            ..Self::bert_base_uncased()
        }
    }

    pub fn describe(&self) -> String {
        if *self == Self::bert_base_uncased() {
            return "bert-base-uncased".into();
        }
        if *self == Self::bert_large_uncased() {
            return "bert-large-uncased".into();
        }
        format!(
            "BertModel(layers {}, hidden {}, heads {}, intermediate {}, vocab {}, positions {})",
            self.num_hidden_layers,
            self.hidden_size,
            self.num_attention_heads,
            self.intermediate_size,
            self.vocab_size,
            self.max_position_embeddings
        )
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
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("type_vocab_size", self.type_vocab_size),
            ("num_labels", self.num_labels),
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
        if self.hidden_size % self.num_attention_heads != 0 {
            return bad(format!(
                "the hidden size ({}) is not a multiple of the number of attention heads ({})",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if !(0..self.vocab_size).contains(&self.pad_token_id) {
            return bad(format!(
                "pad_token_id {} is outside the vocabulary 0..{}",
                self.pad_token_id, self.vocab_size
            ));
        }
        Ok(())
    }

    /// Parameters of `BertModel` (the head excluded), from the configuration alone.
    pub fn param_count(&self) -> i64 {
        let (h, i) = (self.hidden_size, self.intermediate_size);
        let embeddings = (self.vocab_size + self.max_position_embeddings + self.type_vocab_size) * h + 2 * h;
        let layer = 4 * (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h;
        let pooler = h * h + h;
        embeddings + self.num_hidden_layers * layer + pooler
    }

    pub fn block_names(&self) -> Vec<String> {
        let mut names = vec!["embeddings".to_string()];
        names.extend((0..self.num_hidden_layers).map(|n| format!("encoder.layer.{n}")));
        names.push("pooler".into());
        names
    }

    /// `BertForSequenceClassification.named_modules()` with the `bert.` prefix removed:
    /// BertModel's modules, then the head's `dropout` and `classifier`.
    pub fn module_names(&self) -> Vec<String> {
        let mut names: Vec<String> = [
            "embeddings",
            "embeddings.word_embeddings",
            "embeddings.position_embeddings",
            "embeddings.token_type_embeddings",
            "embeddings.LayerNorm",
            "embeddings.dropout",
            "encoder",
            "encoder.layer",
        ]
        .map(String::from)
        .into();
        for n in 0..self.num_hidden_layers {
            let l = format!("encoder.layer.{n}");
            names.push(l.clone());
            names.extend(
                [
                    "attention",
                    "attention.self",
                    "attention.self.query",
                    "attention.self.key",
                    "attention.self.value",
                    "attention.self.dropout",
                    "attention.output",
                    "attention.output.dense",
                    "attention.output.LayerNorm",
                    "attention.output.dropout",
                    "intermediate",
                    "intermediate.dense",
                    "intermediate.intermediate_act_fn",
                    "output",
                    "output.dense",
                    "output.LayerNorm",
                    "output.dropout",
                ]
                .map(|s| format!("{l}.{s}")),
            );
        }
        names.extend(["pooler", "pooler.dense", "pooler.activation", "dropout", "classifier"].map(String::from));
        names
    }

    fn head_size(&self) -> i64 {
        self.hidden_size / self.num_attention_heads
    }
}

/// `BertEmbeddings`, with its non-persistent `position_ids` / `token_type_ids` buffers (not
/// in the state dict, so not in the var store; allocated once, as HF does).
struct Embeddings {
    word_embeddings: Embedding,
    position_embeddings: Embedding,
    token_type_embeddings: Embedding,
    layer_norm: LayerNorm,
    position_ids: Tensor,
    token_type_ids: Tensor,
    p: f64,
    fused: bool,
}

impl Block for Embeddings {
    fn forward(&self, input_ids: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        let input_shape = input_ids.size();
        let seq_length = input_shape[1];
        let position_ids = self.position_ids.slice(1, 0, seq_length, 1);
        let buffered_token_type_ids = self.token_type_ids.slice(1, 0, seq_length, 1);
        let token_type_ids = buffered_token_type_ids.expand([input_shape[0], seq_length], false);

        let inputs_embeds = self.word_embeddings.forward(input_ids);
        let token_type_embeddings = self.token_type_embeddings.forward(&token_type_ids);
        let mut embeddings = &inputs_embeds + &token_type_embeddings;
        let position_embeddings = self.position_embeddings.forward(&position_ids);
        let _ = embeddings.g_add_(&position_embeddings);
        embeddings = self.layer_norm.forward(&embeddings);
        embeddings = dropout(&embeddings, self.p, ctx.train, self.fused);
        embeddings
    }
}

/// `BertSelfAttention` (absolute positions, not a decoder).
struct SelfAttention {
    query: Linear,
    key: Linear,
    value: Linear,
    heads: i64,
    head_size: i64,
    p: f64,
    fused: bool,
    /// `None`: eager.
    sdpa: Option<Sdpa>,
}

impl SelfAttention {
    fn transpose_for_scores(&self, x: &Tensor) -> Tensor {
        let mut shape = x.size();
        shape.pop();
        shape.extend([self.heads, self.head_size]);
        x.view(shape.as_slice()).permute([0, 2, 1, 3])
    }

    fn forward(&self, hidden_states: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        match &self.sdpa {
            None => self.eager(hidden_states, ctx.attention_mask, ctx.train),
            Some(sdpa) => self.sdpa(sdpa, hidden_states, ctx),
        }
    }

    /// Transformers 5's `BertSelfAttention.forward` with `sdpa_attention_forward`.
    fn sdpa(&self, sdpa: &Sdpa, hidden_states: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        let mut input_shape = hidden_states.size();
        input_shape.pop();
        let mut hidden_shape = input_shape.clone();
        hidden_shape.extend([-1, self.head_size]);
        let heads = |t: Tensor| t.view(hidden_shape.as_slice()).transpose(1, 2);
        let query_layer = heads(self.query.forward(hidden_states));
        let key_layer = heads(self.key.forward(hidden_states));
        let value_layer = heads(self.value.forward(hidden_states));
        let mut own = None;
        let mask = sdpa.mask_in(ctx, &mut own);
        let p = if ctx.train { self.p } else { 0.0 };
        let attn_output = sdpa.forward(&query_layer, &key_layer, &value_layer, mask, p);
        input_shape.push(-1);
        attn_output.reshape(input_shape.as_slice()).contiguous()
    }

    /// The eager `BertSelfAttention.forward` of transformers 4.
    fn eager(&self, hidden_states: &Tensor, attention_mask: Option<&Tensor>, train: bool) -> Tensor {
        let mixed_query_layer = self.query.forward(hidden_states);
        let key_layer = self.transpose_for_scores(&self.key.forward(hidden_states));
        let value_layer = self.transpose_for_scores(&self.value.forward(hidden_states));
        let query_layer = self.transpose_for_scores(&mixed_query_layer);

        let mut attention_scores = query_layer.matmul(&key_layer.transpose(-1, -2));
        attention_scores = div_by_python_float(&attention_scores, (self.head_size as f64).sqrt());
        if let Some(mask) = attention_mask {
            attention_scores = &attention_scores + mask;
        }
        // `attention_scores` stays alive until the function returns, as the Python local does.
        let mut attention_probs = attention_scores.softmax(-1, None::<Kind>);
        attention_probs = dropout(&attention_probs, self.p, train, self.fused);

        let mut context_layer = attention_probs.matmul(&value_layer);
        context_layer = context_layer.permute([0, 2, 1, 3]).contiguous();
        let mut new_shape = context_layer.size();
        new_shape.truncate(new_shape.len() - 2);
        new_shape.push(self.heads * self.head_size);
        context_layer = context_layer.view(new_shape.as_slice());
        context_layer
    }
}

/// `BertSelfOutput` / `BertOutput`: dense, dropout, LayerNorm of the residual sum.
struct Output {
    dense: Linear,
    layer_norm: LayerNorm,
    p: f64,
    fused: bool,
}

impl Output {
    fn forward(&self, hidden_states: &Tensor, input_tensor: &Tensor, train: bool) -> Tensor {
        let mut hidden_states = self.dense.forward(hidden_states);
        hidden_states = dropout(&hidden_states, self.p, train, self.fused);
        hidden_states = self.layer_norm.forward(&(&hidden_states + input_tensor));
        hidden_states
    }
}

/// `BertAttention`: `self` + `output` (the residual is its own input).
struct Attention {
    attention_self: SelfAttention,
    output: Output,
}

impl Block for Attention {
    /// `BertAttention.forward`: the self-attention output tuple lives until it returns.
    fn forward(&self, hidden_states: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        let self_outputs = self.attention_self.forward(hidden_states, ctx);
        self.output.forward(&self_outputs, hidden_states, ctx.train)
    }
}

/// `BertIntermediate`: dense + activation.
struct Intermediate {
    dense: Linear,
    intermediate_act_fn: Activation,
    /// Traced for a GPU ([`crate::TraceKernels::Cuda`]): the activation follows CUDA's autocast.
    cuda: bool,
}

impl Block for Intermediate {
    fn forward(&self, hidden_states: &Tensor, _ctx: &Ctx<'_>) -> Tensor {
        let mut hidden_states = self.dense.forward(hidden_states);
        hidden_states = self.intermediate_act_fn.forward(&hidden_states, self.cuda);
        hidden_states
    }
}

/// `BertOutput` as a chain block of its own: its input is the intermediate output and its
/// residual the attention output, which the chain hands over as skip 0.
struct LayerOutput(Output);

impl Block for LayerOutput {
    fn forward(&self, intermediate_output: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        self.0.forward(intermediate_output, ctx.skip(0), ctx.train)
    }
}

/// `BertLayer`: `attention`, `intermediate`, `output` as one block.
struct Layer {
    attention: Attention,
    intermediate: Intermediate,
    output: Output,
}

impl Block for Layer {
    fn forward(&self, hidden_states: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        let attention_output = self.attention.forward(hidden_states, ctx);
        // `feed_forward_chunk` (chunk_size_feed_forward is 0: called once).
        let intermediate_output = self.intermediate.forward(&attention_output, ctx);
        self.output.forward(&intermediate_output, &attention_output, ctx.train)
    }
}

/// `BertPooler`: dense + tanh of the first token.
struct Pooler {
    dense: Linear,
}

impl Block for Pooler {
    fn forward(&self, hidden_states: &Tensor, _ctx: &Ctx<'_>) -> Tensor {
        let first_token_tensor = hidden_states.select(1, 0);
        let mut pooled_output = self.dense.forward(&first_token_tensor);
        pooled_output = pooled_output.tanh();
        pooled_output
    }
}

/// BertForSequenceClassification's head: `dropout`, `classifier`, cross entropy over
/// `num_labels`. Training mode (dropout active): the loss head only runs in training steps.
struct SequenceClassification {
    classifier: Linear,
    p: f64,
    fused: bool,
    num_labels: i64,
}

impl LossHead for SequenceClassification {
    fn loss(&self, pooled_output: &Tensor, batch: &Batch) -> Tensor {
        let pooled_output = dropout(pooled_output, self.p, true, self.fused);
        let logits = self.classifier.forward(&pooled_output);
        logits.view([-1, self.num_labels]).cross_entropy_loss(
            &batch.target.view([-1]),
            None::<&Tensor>,
            tch::Reduction::Mean,
            -100,
            0.0,
        )
    }
}

/// Builds `cfg` as a chain named `name` for sequences of `opts.seq` tokens (default 128).
pub fn build(name: &str, cfg: &Config, opts: &ModelOptions) -> Result<Chain> {
    build_with_default_seq(name, cfg, opts, DEFAULT_SEQ)
}

pub(crate) fn build_with_default_seq(name: &str, cfg: &Config, opts: &ModelOptions, default_seq: i64) -> Result<Chain> {
    opts.reject(name, "image", opts.image, "BERT takes token sequences; use --seq")?;
    let spec = opts.spec(name)?;
    let mut cfg = cfg.clone();
    if let Some(classes) = opts.classes {
        cfg.num_labels = classes;
    }
    if let Some(heads) = opts.heads {
        cfg.num_attention_heads = heads;
    }
    cfg.validate()?;
    let seq = opts.seq.unwrap_or(default_seq.min(cfg.max_position_embeddings));
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
    let mut groups = Vec::new();
    let mut blocks = vec![ChainBlock {
        extra_reads: Vec::new(),
        name: "embeddings".into(),
        candidate: true,
        skips: Vec::new(),
        block: Box::new(embeddings(name, &root, cfg, spec)?),
    }];
    for n in 0..cfg.num_hidden_layers {
        let layer = layer(&(&root / "encoder" / "layer" / n), cfg, spec, attention)?;
        push_layer(
            &mut blocks,
            &mut groups,
            format!("encoder.layer.{n}"),
            layer,
            granularity,
        );
    }
    let (h, std) = (cfg.hidden_size, cfg.initializer_range);
    let pooler = Pooler {
        dense: Linear::hf(&(&root / "pooler" / "dense"), h, h, std, spec)?,
    };
    blocks.push(ChainBlock {
        extra_reads: Vec::new(),
        name: "pooler".into(),
        candidate: true,
        skips: Vec::new(),
        block: Box::new(pooler),
    });
    let head = SequenceClassification {
        classifier: Linear::hf(&(&root / "classifier"), h, cfg.num_labels, std, spec)?,
        p: cfg.classifier_dropout.unwrap_or(cfg.hidden_dropout_prob),
        fused: spec.fused_dropout(),
        num_labels: cfg.num_labels,
    };

    Ok(Chain {
        name: name.to_string(),
        vs,
        blocks,
        groups,
        head: Box::new(head),
        modules: cfg.module_names(),
        input: InputSpec::Tokens {
            seq,
            vocab: cfg.vocab_size,
            targets: TokenTargets::Classes(cfg.num_labels),
        },
        reference_params: cfg.param_count(),
        attention: Some(attention),
        shared: (attention == Implementation::Sdpa)
            .then(|| Box::new(SdpaMask(bert_sdpa(cfg, spec))) as Box<dyn SharedInputs>),
    })
}

/// `bert.embeddings` under `root`, its non-persistent buffers made first.
fn embeddings(name: &str, root: &nn::Path<'_>, cfg: &Config, spec: Spec) -> Result<Embeddings> {
    let (h, std, device) = (cfg.hidden_size, cfg.initializer_range, spec.device);
    let e = root / "embeddings";
    let buffers = |op: &str| -> Result<(Tensor, Tensor)> {
        let err = |e| ModelError::torch(format!("{op} for {name}"), e);
        let pos = Tensor::f_arange(cfg.max_position_embeddings, (Kind::Int64, device))
            .and_then(|t| t.f_expand([1, -1], false))
            .map_err(err)?;
        let types = Tensor::f_zeros([1, cfg.max_position_embeddings], (Kind::Int64, device)).map_err(err)?;
        Ok((pos, types))
    };
    let (position_ids, token_type_ids) = buffers("creating position_ids/token_type_ids")?;
    Ok(Embeddings {
        word_embeddings: Embedding::hf(
            &(&e / "word_embeddings"),
            cfg.vocab_size,
            h,
            Some(cfg.pad_token_id),
            std,
            spec,
        )?,
        position_embeddings: Embedding::hf(
            &(&e / "position_embeddings"),
            cfg.max_position_embeddings,
            h,
            None,
            std,
            spec,
        )?,
        token_type_embeddings: Embedding::hf(&(&e / "token_type_embeddings"), cfg.type_vocab_size, h, None, std, spec)?,
        layer_norm: LayerNorm::new(&(&e / "LayerNorm"), h, cfg.layer_norm_eps, spec)?,
        position_ids,
        token_type_ids,
        p: cfg.hidden_dropout_prob,
        fused: spec.fused_dropout(),
    })
}

/// SDPA as BERT's attention runs it (bidirectional, one key/value head per head).
fn bert_sdpa(cfg: &Config, spec: Spec) -> Sdpa {
    Sdpa {
        scaling: (cfg.head_size() as f64).powf(-0.5),
        causal: false,
        kv_groups: 1,
        kernels: spec.trace_kernels,
    }
}

/// `BertLayer` at `l` (`encoder.layer.N`).
fn layer(l: &nn::Path<'_>, cfg: &Config, spec: Spec, attention: Implementation) -> Result<Layer> {
    let (h, std) = (cfg.hidden_size, cfg.initializer_range);
    let output = |p: &nn::Path<'_>, in_dim: i64| -> Result<Output> {
        Ok(Output {
            dense: Linear::hf(&(p / "dense"), in_dim, h, std, spec)?,
            layer_norm: LayerNorm::new(&(p / "LayerNorm"), h, cfg.layer_norm_eps, spec)?,
            p: cfg.hidden_dropout_prob,
            fused: spec.fused_dropout(),
        })
    };
    let s = l / "attention" / "self";
    Ok(Layer {
        attention: Attention {
            attention_self: SelfAttention {
                query: Linear::hf(&(&s / "query"), h, h, std, spec)?,
                key: Linear::hf(&(&s / "key"), h, h, std, spec)?,
                value: Linear::hf(&(&s / "value"), h, h, std, spec)?,
                heads: cfg.num_attention_heads,
                head_size: cfg.head_size(),
                p: cfg.attention_probs_dropout_prob,
                fused: spec.fused_dropout(),
                sdpa: (attention == Implementation::Sdpa).then(|| bert_sdpa(cfg, spec)),
            },
            output: output(&(l / "attention" / "output"), h)?,
        },
        intermediate: Intermediate {
            dense: Linear::hf(&(l / "intermediate" / "dense"), h, cfg.intermediate_size, std, spec)?,
            intermediate_act_fn: cfg.hidden_act,
            cuda: spec.trace_kernels == crate::TraceKernels::Cuda,
        },
        output: output(&(l / "output"), cfg.intermediate_size)?,
    })
}

/// Layer `name` as one block, or finer as its three children: `output` reads `attention`'s
/// output for its residual. With nesting the layer itself is a group over them.
fn push_layer(
    blocks: &mut Vec<ChainBlock>,
    groups: &mut Vec<ChainGroup>,
    name: String,
    layer: Layer,
    granularity: Granularity,
) {
    if granularity == Granularity::Layer {
        blocks.push(ChainBlock::new(name, true, Box::new(layer)));
        return;
    }
    let first = blocks.len();
    blocks.push(ChainBlock::new(
        format!("{name}.attention"),
        true,
        Box::new(layer.attention),
    ));
    blocks.push(ChainBlock::new(
        format!("{name}.intermediate"),
        true,
        Box::new(layer.intermediate),
    ));
    blocks.push(ChainBlock {
        extra_reads: Vec::new(),
        name: format!("{name}.output"),
        candidate: true,
        skips: vec![first],
        block: Box::new(LayerOutput(layer.output)),
    });
    if granularity == Granularity::Nested {
        groups.push(ChainGroup {
            name,
            first,
            last: first + 2,
        });
    }
}

pub fn bert_base_uncased(opts: &ModelOptions) -> Result<Chain> {
    build("bert-base-uncased", &Config::bert_base_uncased(), opts)
}

pub fn bert_large_uncased(opts: &ModelOptions) -> Result<Chain> {
    build("bert-large-uncased", &Config::bert_large_uncased(), opts)
}

/// [`Config::tiny`] on 16-token sequences unless `opts.seq` says otherwise.
pub fn tiny(opts: &ModelOptions) -> Result<Chain> {
    build_with_default_seq("tiny-bert", &Config::tiny(), opts, 16)
}
