//! Rotary position embeddings as Hugging Face's `LlamaRotaryEmbedding` computes them
//! (`transformers/modeling_rope_utils.py` for the frequencies, `modeling_llama.py` for
//! `(cos, sin)` and `rotate_half`), with the `"llama3"` frequency scaling: the one job of the
//! Llama family that is about positions rather than modules.

use ckptune_kernels::autocast::{self, AutocastGuard};
use tch::{Kind, Tensor};

/// `rope_scaling` of type `"llama3"` (Llama 3.1 and later): `_compute_llama3_parameters`.
#[derive(Debug, Clone, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: i64,
}

/// `LlamaRotaryEmbedding.inv_freq` for heads of `dim` with base `theta` (a non-persistent
/// buffer: not in the state dict).
pub(crate) fn inv_freq(dim: i64, theta: f64, scaling: Option<&Llama3RopeScaling>, device: tch::Device) -> Tensor {
    let exponent = Tensor::arange_start_step(0, dim, 2, (Kind::Int64, device)).to_kind(Kind::Float) / dim as f64;
    // `1.0 / (base ** exponent)`: Python's `float ** tensor` and `1.0 / tensor`.
    let inv_freq = Tensor::pow_scalar(theta, &exponent).reciprocal();
    let Some(s) = scaling else {
        return inv_freq;
    };
    // `_compute_llama3_parameters`, statement by statement.
    let old_context_len = s.original_max_position_embeddings as f64;
    let low_freq_wavelen = old_context_len / s.low_freq_factor;
    let high_freq_wavelen = old_context_len / s.high_freq_factor;
    let wavelen = inv_freq.reciprocal() * (2.0 * std::f64::consts::PI);
    let inv_freq_llama = (&inv_freq / s.factor).where_self(&wavelen.gt(low_freq_wavelen), &inv_freq);
    let smooth_factor =
        (wavelen.reciprocal() * old_context_len - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    let smoothed_inv_freq =
        (smooth_factor.ones_like() - &smooth_factor) * &inv_freq_llama / s.factor + &smooth_factor * &inv_freq_llama;
    let is_medium_freq = wavelen
        .lt(high_freq_wavelen)
        .logical_not()
        .logical_and(&wavelen.gt(low_freq_wavelen).logical_not());
    smoothed_inv_freq.where_self(&is_medium_freq, &inv_freq_llama)
}

/// `LlamaRotaryEmbedding.forward(x, position_ids)` for `position_ids` `[1, seq]`: `(cos, sin)`,
/// `[1, seq, head_dim]` each, in `kind` (the dtype of `x`, the embeddings').
pub(crate) fn cos_sin(inv_freq: &Tensor, position_ids: &Tensor, kind: Kind) -> (Tensor, Tensor) {
    let device = position_ids.device();
    let inv_freq_expanded = inv_freq
        .unsqueeze(0)
        .unsqueeze(-1)
        .to_kind(Kind::Float)
        .expand([position_ids.size()[0], -1, 1], false);
    let position_ids_expanded = position_ids.unsqueeze(1).to_kind(Kind::Float);
    // `with torch.autocast(device_type, enabled=False)`: the angles stay f32.
    let (cos, sin) = {
        let dtype = autocast::dtype(device).unwrap_or(Kind::BFloat16);
        let _off = AutocastGuard::new(device, dtype, false).expect("autocast regions exist on CPU and CUDA");
        let freqs = inv_freq_expanded
            .to_kind(Kind::Float)
            .matmul(&position_ids_expanded.to_kind(Kind::Float))
            .transpose(1, 2);
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        // `* self.attention_scaling`, which is 1.0 for the default and llama3 rope types.
        (emb.cos() * 1.0, emb.sin() * 1.0)
    };
    (cos.to_kind(kind), sin.to_kind(kind))
}

pub(crate) fn rotate_half(x: &Tensor) -> Tensor {
    let half = x.size().last().copied().expect("a head dimension") / 2;
    let x1 = x.slice(-1, 0, half, 1);
    let x2 = x.slice(-1, half, None, 1);
    Tensor::cat(&[&x2.neg(), &x1], -1)
}
