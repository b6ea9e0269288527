//! Attention through `torch.nn.functional.scaled_dot_product_attention`, called as transformers'
//! `integrations/sdpa_attention.py` (`sdpa_attention_forward`) calls it for self-attention
//! without a cache, and the boolean mask `masking_utils.sdpa_mask` builds for it when a batch
//! pads. libtorch picks the kernel as for any SDPA call: on the CPU its flash attention
//! (`_scaled_dot_product_flash_attention_for_cpu`), or the math path when dropout is on; neither
//! keeps `[batch, heads, seq, seq]` scores for backward. `repeat_kv` is here because both
//! attention implementations of the Llama family use it. A model traced for a GPU calls CUDA's
//! memory-efficient attention instead, as PyTorch's SDPA hands it its inputs (`cuda_efficient`).

use ckptune_kernels::autocast;
use tch::{Kind, Tensor};

use crate::chain::{Ctx, SharedInputs};
use crate::trace_kernels::TraceKernels;

/// `repeat_kv`: `[b, kv, s, d]` → `[b, kv * n_rep, s, d]` (the same tensor when `n_rep` is 1).
pub(crate) fn repeat_kv(hidden_states: &Tensor, n_rep: i64) -> Tensor {
    if n_rep == 1 {
        return hidden_states.shallow_clone();
    }
    let s = hidden_states.size();
    let (batch, kv, slen, head_dim) = (s[0], s[1], s[2], s[3]);
    hidden_states
        .unsqueeze(2)
        .expand([batch, kv, n_rep, slen, head_dim], false)
        .reshape([batch, kv * n_rep, slen, head_dim])
}

/// What an attention module hands `sdpa_attention_forward` besides its tensors.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sdpa {
    /// `module.scaling`.
    pub scaling: f64,
    /// `module.is_causal`: decoders; an encoder (BERT) is not.
    pub causal: bool,
    /// `module.num_key_value_groups` (1 without grouped-query attention).
    pub kv_groups: i64,
    /// The device's kernels, or CUDA's memory-efficient attention (a trace for a GPU).
    pub kernels: TraceKernels,
}

impl Sdpa {
    /// The mask the model hands SDPA (`create_causal_mask`, or `create_bidirectional_mask` for
    /// an encoder): `None` when the batch pads nothing, the case `_ignore_causal_mask_sdpa`
    /// skips; else `sdpa_mask`'s `[batch, 1, seq, seq]` bool, true where a query may attend (a
    /// key that is no padding, and for a decoder not ahead of it), built with its broadcasts
    /// so that it allocates what HF's does. `bias` is the chain's additive `[batch, 1, 1,
    /// seq]` mask: its zeros are HF's `attention_mask.to(bool)`.
    pub fn mask(&self, bias: Option<&Tensor>, padded: bool) -> Option<Tensor> {
        let bias = bias.filter(|_| padded)?;
        let s = bias.size();
        let (batch, seq, device) = (s[0], s[3], bias.device());
        let padding_mask = bias.eq(0.0).view([batch, seq]);
        let arange = |n: i64| Tensor::arange(n, (Kind::Int64, device));
        let batch_idx = arange(batch).view([batch, 1, 1, 1]);
        let _head_idx = arange(1).view([1, 1, 1, 1]);
        let q_idx = (arange(seq) + 0).view([1, 1, seq, 1]);
        let kv_idx = (arange(seq) + 0).view([1, 1, 1, seq]);
        // `and_masks(pattern, padding_mask_function(padding_mask))`.
        let mut result = Tensor::ones([], (Kind::Bool, device));
        let pattern = if self.causal {
            kv_idx.le_tensor(&q_idx)
        } else {
            q_idx.ge(0)
        };
        result = result.bitwise_and_tensor(&pattern);
        drop(pattern);
        let padding = padding_mask.index(&[Some(&batch_idx), Some(&kv_idx)]);
        result = result.bitwise_and_tensor(&padding);
        Some(result.expand([batch, -1, seq, seq], false))
    }

    /// `sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling)`:
    /// `query` `[batch, heads, seq, head_dim]`, `key` and `value` with the key/value heads.
    /// Returns the output as `[batch, seq, heads, head_dim]`, contiguous. `dropout` is the
    /// module's probability in training and 0 otherwise, as the families pass it. The locals
    /// (a repeated key and value among them) live until it returns, as Python's do.
    pub fn forward(&self, query: &Tensor, key: &Tensor, value: &Tensor, mask: Option<&Tensor>, dropout: f64) -> Tensor {
        let q_length = query.size()[2];
        let (mut query, mut key, mut value) = (query.shallow_clone(), key.shallow_clone(), value.shallow_clone());
        let mut mask = mask.map(Tensor::shallow_clone);
        let mut enable_gqa = false;
        if self.kv_groups > 1 {
            let head_dim = value.size()[3];
            // `use_gqa_in_sdpa` on the CPU: no mask and a head size libtorch's kernels take.
            if mask.is_none() && key.size()[3] == head_dim && head_dim <= 256 {
                enable_gqa = true;
            } else if q_length == 1 {
                // `pack_gqa`: one query token attends on the key/value heads.
                let s = query.size();
                query = query.reshape([s[0], s[1] / self.kv_groups, self.kv_groups, s[3]]);
                mask = mask.map(|m| {
                    let ms = m.size();
                    if ms[1] == 1 {
                        m
                    } else {
                        m.reshape([ms[0], ms[1] / self.kv_groups, self.kv_groups, ms[3]])
                    }
                });
            } else {
                key = repeat_kv(&key, self.kv_groups);
                value = repeat_kv(&value, self.kv_groups);
            }
        }
        let is_causal = q_length > 1 && mask.is_none() && self.causal;
        let attn_output = if self.kernels == TraceKernels::Cuda {
            if enable_gqa {
                // The efficient kernel takes no grouped heads: repeated as the eager path does.
                key = repeat_kv(&key, self.kv_groups);
                value = repeat_kv(&value, self.kv_groups);
            }
            cuda_efficient(&query, &key, &value, mask.as_ref(), dropout, is_causal, self.scaling)
        } else {
            Tensor::scaled_dot_product_attention(
                &query,
                &key,
                &value,
                mask.as_ref(),
                dropout,
                is_causal,
                self.scaling,
                enable_gqa,
            )
        };
        let out_batch = attn_output.size()[0];
        attn_output
            .reshape([out_batch, -1, q_length, value.size()[3]])
            .transpose(1, 2)
            .contiguous()
    }
}

/// What autocast hands SDPA for `t`: SDPA is a lower-precision operator, so inside an autocast
/// region its floating inputs (query, key, value, a float mask; not a boolean one) are cast to
/// the region's dtype before a kernel is chosen. The efficient kernel called by name is on no
/// autocast list, so the casts are made here, in libtorch's order; without it a Llama's rotated
/// f32 query and repeated f32 key reach the kernel, which keeps them for backward in f32.
fn autocast_input(t: &Tensor) -> Tensor {
    let device = t.device();
    match autocast::dtype(device) {
        Some(dtype)
            if autocast::is_enabled(device) && t.is_floating_point() && ![dtype, Kind::Double].contains(&t.kind()) =>
        {
            t.to_kind(dtype)
        }
        _ => t.shallow_clone(),
    }
}

/// PyTorch's SDPA on CUDA when it picks the memory-efficient kernel (fp32 on an H200, with or
/// without a mask or dropout): a boolean mask becomes an additive bias in the query's dtype
/// (`convert_boolean_attn_mask`: two scalar tensors, then `where`), padded to a multiple of 8
/// keys and sliced back (`preprocess_mask`), broadcast over the heads; the kernel keeps the
/// log-sum-exp only when a gradient is needed. On the meta device only (kernels/csrc/
/// meta_attention.cpp): libtorch has no CPU kernel for it.
pub fn cuda_efficient(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    mask: Option<&Tensor>,
    dropout: f64,
    is_causal: bool,
    scaling: f64,
) -> Tensor {
    // libtorch's autocast wrapper casts the mask first, then query, key and value.
    let mask = mask.map(autocast_input);
    let (query, key, value) = (&autocast_input(query), &autocast_input(key), &autocast_input(value));
    let bias = mask.as_ref().map(|m| {
        let bias = if m.kind() == Kind::Bool {
            let options = (query.kind(), query.device());
            let zero = Tensor::scalar_tensor(0.0, options);
            let minus_inf = Tensor::scalar_tensor(f64::NEG_INFINITY, options);
            zero.where_self(m, &minus_inf)
        } else {
            m.shallow_clone()
        };
        let s = bias.size();
        let keys = s[s.len() - 1];
        let bias = if keys % 8 == 0 {
            bias
        } else {
            bias.constant_pad_nd([0, 8 - keys % 8]).narrow(-1, 0, keys)
        };
        let q = query.size();
        bias.expand([q[0], q[1], q[2], keys], false)
    });
    let grad = query.requires_grad() || key.requires_grad() || value.requires_grad();
    let (output, _, _, _) = Tensor::internal_scaled_dot_product_efficient_attention(
        query,
        key,
        value,
        bias.as_ref(),
        grad,
        dropout,
        is_causal,
        scaling,
    );
    output
}

/// What a model's forward builds once under SDPA and hands every layer, where the batch pads:
/// `sdpa_mask`'s mask (BertModel's bidirectional one, GPT2Model's causal one). A layer's graph
/// saves it, and a checkpointed layer keeps it as an input until its backward, as PyTorch's do
/// ([`SharedInputs`]).
pub struct SdpaMask(pub Sdpa);

impl Sdpa {
    /// The mask of an attention call under `ctx`: the chain's shared one ([`SdpaMask`]), else
    /// one of its own made into `own` (the attention called alone, outside its chain).
    pub fn mask_in<'a>(&self, ctx: &'a Ctx<'_>, own: &'a mut Option<Tensor>) -> Option<&'a Tensor> {
        if ctx.shared.is_empty() {
            *own = self.mask(ctx.attention_mask, ctx.padded);
            own.as_ref()
        } else {
            ctx.shared.first()
        }
    }
}

impl SharedInputs for SdpaMask {
    fn compute(
        &self,
        _seq: i64,
        _kind: Kind,
        _device: tch::Device,
        bias: Option<&Tensor>,
        padded: bool,
    ) -> Vec<Tensor> {
        self.0.mask(bias, padded).into_iter().collect()
    }
}
