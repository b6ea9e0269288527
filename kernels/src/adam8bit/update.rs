//! The update maths: Adam/AdamW hyper-parameters, the f32 scalars of one step, and the update of
//! one element, of one 8-bit block (dequantize, update, re-quantize) and of 32-bit moments.

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::qmap::BLOCK;
use super::qmap::{abs_max, check_len, dequantize, inverse, SIGNED, UNSIGNED};
use crate::KernelError;

/// Adam/AdamW hyper-parameters (PyTorch's names and defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamHyper {
    pub lr: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    /// AdamW's decoupled decay (`p *= 1 - lr·wd`) rather than Adam's L2 term (`g += wd·p`).
    pub decoupled: bool,
}

impl AdamHyper {
    /// `torch.optim.AdamW(lr=lr)`: betas (0.9, 0.999), eps 1e-8, weight decay 1e-2.
    pub fn adamw(lr: f64) -> Self {
        Self {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 1e-2,
            decoupled: true,
        }
    }
    /// `torch.optim.Adam(lr=lr)`: betas (0.9, 0.999), eps 1e-8, no weight decay.
    pub fn adam(lr: f64) -> Self {
        Self {
            weight_decay: 0.0,
            decoupled: false,
            ..Self::adamw(lr)
        }
    }

    /// PyTorch's constructor checks, made here because a bad value would silently poison the
    /// state rather than fail.
    pub fn validate(&self) -> Result<(), KernelError> {
        let bad = |what: &str, v: f64| KernelError::Invalid {
            op: "checking 8-bit Adam hyper-parameters",
            message: format!("{what} {v} is invalid"),
        };
        for (what, v) in [
            ("learning rate", self.lr),
            ("eps", self.eps),
            ("weight decay", self.weight_decay),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(bad(what, v));
            }
        }
        for (what, b) in [("beta1", self.betas.0), ("beta2", self.betas.1)] {
            if !((0.0..1.0).contains(&b)) {
                return Err(bad(&format!("{what} (must lie in [0, 1))"), b));
            }
        }
        Ok(())
    }
}

/// The f32 scalars of one step, derived once per tensor per step. The same values are passed
/// to the CUDA kernel, so both devices compute with identical inputs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepScalars {
    /// Adam's `lerp` weight for the first moment.
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    pub eps: f32,
    /// Adam's L2 coefficient (`g += l2·p`); 0 for AdamW.
    pub l2: f32,
    /// AdamW's decay factor `1 - lr·wd`; 1 for Adam.
    pub decay: f32,
    /// `-lr / (1 - beta1^step)`.
    pub neg_step_size: f32,
    /// `sqrt(1 - beta2^step)`.
    pub bc2_sqrt: f32,
}

impl StepScalars {
    /// Scalars for the `step`-th update (1-based), computed in f64 as PyTorch's Python loop
    /// does and rounded to f32 as libtorch does when it applies them to f32 tensors.
    pub fn new(h: &AdamHyper, step: u64) -> Self {
        let t = step as f64;
        let bc1 = 1.0 - h.betas.0.powf(t);
        let bc2 = 1.0 - h.betas.1.powf(t);
        let (l2, decay) = if h.decoupled {
            (0.0, 1.0 - h.lr * h.weight_decay)
        } else {
            (h.weight_decay, 1.0)
        };
        Self {
            one_minus_beta1: (1.0 - h.betas.0) as f32,
            beta2: h.betas.1 as f32,
            one_minus_beta2: (1.0 - h.betas.1) as f32,
            eps: h.eps as f32,
            l2: l2 as f32,
            decay: decay as f32,
            neg_step_size: (-(h.lr / bc1)) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
        }
    }
}

/// One element's Adam/AdamW update from its moments `(m, v)`: returns `(p', m', v')`. Formulas
/// and order of `torch.optim.AdamW`'s single-tensor loop: `m.lerp_(g, 1-β1)`,
/// `v.mul_(β2).addcmul_(g, g, value=1-β2)`, `denom = v.sqrt() / sqrt(bc2) + eps`,
/// `p.addcdiv_(m, denom, value=-lr/bc1)`, after `p.mul_(1 - lr·wd)` (AdamW) or with
/// `g += wd·p` (Adam). The CUDA kernel repeats these lines operation for operation.
#[inline(always)]
fn adam_element(p: f32, g: f32, m: f32, v: f32, s: &StepScalars) -> (f32, f32, f32) {
    let g = g + s.l2 * p;
    let m = m + s.one_minus_beta1 * (g - m);
    let v = s.beta2 * v + s.one_minus_beta2 * (g * g);
    let denom = v.sqrt() / s.bc2_sqrt + s.eps;
    (p * s.decay + (s.neg_step_size * m) / denom, m, v)
}

/// The fused 8-bit update of one block (at most [`BLOCK`] elements): dequantize both moments,
/// update `p`, re-quantize with the block's new absmax. Slices must have equal lengths.
pub fn update_block(
    p: &mut [f32],
    g: &[f32],
    m_codes: &mut [u8],
    v_codes: &mut [u8],
    m_absmax: &mut f32,
    v_absmax: &mut f32,
    s: &StepScalars,
) -> Result<(), KernelError> {
    const OP: &str = "8-bit Adam block update";
    if p.len() > BLOCK {
        return Err(KernelError::Invalid {
            op: OP,
            message: format!("a block holds at most {BLOCK} elements, got {}", p.len()),
        });
    }
    check_len(OP, "gradient", g.len(), p.len())?;
    check_len(OP, "first-moment codes", m_codes.len(), p.len())?;
    check_len(OP, "second-moment codes", v_codes.len(), p.len())?;
    block_kernel::<false>(p, g, m_codes, v_codes, m_absmax, v_absmax, s);
    Ok(())
}

/// The 32-bit-state update (tensors below [`MIN_8BIT_NUMEL`](super::state::MIN_8BIT_NUMEL)): same formulas, f32 moments.
pub fn update_full(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: &StepScalars) -> Result<(), KernelError> {
    const OP: &str = "32-bit Adam update";
    check_len(OP, "gradient", g.len(), p.len())?;
    check_len(OP, "first moment", m.len(), p.len())?;
    check_len(OP, "second moment", v.len(), p.len())?;
    full_kernel(p, g, m, v, s);
    Ok(())
}

#[inline(always)]
pub(super) fn full_kernel(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: &StepScalars) {
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        (*p, *m, *v) = adam_element(*p, g, *m, *v, s);
    }
}

/// The body of [`update_block`], lengths already checked (callers inside this module guarantee
/// them by construction).
///
/// `AVX2` selects the explicit AVX2 gathers for the dequantize and encode passes (LLVM does not
/// emit gathers on its own for generic x86-64 tuning); it must only be `true` when called from
/// an AVX2-enabled function on a CPU that has AVX2.
#[inline(always)]
pub(super) fn block_kernel<const AVX2: bool>(
    p: &mut [f32],
    g: &[f32],
    m_codes: &mut [u8],
    v_codes: &mut [u8],
    m_absmax: &mut f32,
    v_absmax: &mut f32,
    s: &StepScalars,
) {
    // The moments, dequantized and then updated in place, wait here (16 KiB of stack) between
    // the absmax and the re-quantization. Separate passes keep each loop simple enough to
    // vectorize: a gather pass, a pure-arithmetic pass, a max pass, two encode passes.
    let mut m_buf = [0f32; BLOCK];
    let mut v_buf = [0f32; BLOCK];
    let n = p.len();
    let (m, v) = (&mut m_buf[..n], &mut v_buf[..n]);
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: AVX2 is present (the caller's contract); the slices have equal lengths.
        unsafe {
            avx2::dequantize(m_codes, &SIGNED.values, *m_absmax, m);
            avx2::dequantize(v_codes, &UNSIGNED.values, *v_absmax, v);
        }
    }
    if !(AVX2 && cfg!(target_arch = "x86_64")) {
        dequantize(m_codes, &SIGNED.values, *m_absmax, m);
        dequantize(v_codes, &UNSIGNED.values, *v_absmax, v);
    }
    full_kernel(p, g, m, v, s);
    let (am, av) = (abs_max(m), abs_max(v));
    *m_absmax = am;
    *v_absmax = av;
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: as above.
        unsafe {
            avx2::encode(&SIGNED.coder, m, inverse(am), m_codes);
            avx2::encode(&UNSIGNED.coder, v, inverse(av), v_codes);
        }
        return;
    }
    SIGNED.coder.encode(m, inverse(am), m_codes);
    UNSIGNED.coder.encode(v, inverse(av), v_codes);
}
