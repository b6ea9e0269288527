//! 8-bit block-wise Adam and AdamW (Dettmers et al., "8-bit Optimizers via Block-wise
//! Quantization", ICLR 2022): both moments stored as 8-bit codes into a 256-entry dynamic
//! quantization map, with one f32 absmax per block of [`BLOCK`] elements.
//!
//! Each step, per block: dequantize (`map[code] · absmax`), apply the Adam/AdamW update with the
//! formulas of `torch.optim.AdamW`'s single-tensor loop (decoupled or L2 weight decay, bias
//! correction), take the block's new absmax, re-quantize each moment to the *nearest* code.
//! The parameter update uses the freshly computed moments, before re-quantization, as
//! bitsandbytes does. Tensors with fewer than [`MIN_8BIT_NUMEL`] elements keep 32-bit moments.
//!
//! The CPU path works in place on the tensors' contiguous buffers, one fused pass per block,
//! blocks spread over `tch::get_num_threads()` threads. The CUDA path (feature `cuda`) launches
//! `csrc/adam8bit.cu`, compiled by NVRTC; it performs the same IEEE operations in the same order
//! (no FMA contraction), so both devices produce bit-identical states.
//!
//! State lives in libtorch tensors (`uint8` codes, `f32` absmax or 32-bit moments) on the
//! parameter's device, allocated on its first step as in PyTorch, so the CPU memory meter sees
//! exactly [`state_bytes_for`] bytes per parameter.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::LazyLock;

use tch::{Device, Kind, Tensor};

use crate::KernelError;

/// Elements per quantization block (one absmax each): the paper's block size, and what
/// bitsandbytes' block-wise 8-bit optimizers use.
pub const BLOCK: usize = 2048;

/// Tensors with fewer elements keep 32-bit moments (bitsandbytes' `min_8bit_size` default): their
/// state is negligible, and they are biases and norm scales, which a 2048-element block would
/// barely fill.
pub const MIN_8BIT_NUMEL: i64 = 4096;

// ---------------------------------------------------------------------------------------------
// Quantization maps
// ---------------------------------------------------------------------------------------------

/// The decades of the dynamic tree type: exponent `i` in 0..7 covers [0.1, 1] · 10^(i-6).
/// Written out, not `10f64.powi`, so every entry is the correctly rounded decimal.
const DECADES: [f64; 7] = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0];

/// bitsandbytes' `create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)`: for each decade
/// `i`, the midpoints of `2^i` (signed) or `2^(i+1)` (unsigned: the sign bit becomes one more
/// fraction bit) equal intervals of [0.1, 1], scaled by 10^(i-6); plus 0 and 1. Sorted.
///
/// Computed in f64 and rounded once to f32. bitsandbytes builds the intervals with an f32
/// `torch.linspace`, so its entries differ from these by at most 2 ulp (tested against its
/// construction in `tests/fixtures/dynamic_map.py`).
const fn dynamic_map(signed: bool) -> [f32; 256] {
    let mut positive = [0f32; 254];
    let mut k = 0;
    let mut i = 0;
    while i < 7 {
        let n = if signed { 1usize << i } else { 1usize << (i + 1) };
        let mut j = 0;
        while j < n {
            let lo = 0.1 + 0.9 * j as f64 / n as f64;
            let hi = 0.1 + 0.9 * (j + 1) as f64 / n as f64;
            positive[k] = (DECADES[i] * ((lo + hi) / 2.0)) as f32;
            k += 1;
            j += 1;
        }
        i += 1;
    }
    // Decades do not overlap and midpoints rise within each, so `positive[..k]` is sorted.
    let mut out = [0f32; 256];
    if signed {
        // 127 negatives (largest magnitude first), 0, 127 positives, 1.
        let mut j = 0;
        while j < 127 {
            out[j] = -positive[126 - j];
            out[128 + j] = positive[j];
            j += 1;
        }
        out[127] = 0.0;
    } else {
        // 0, 254 positives, 1.
        let mut j = 0;
        while j < 254 {
            out[1 + j] = positive[j];
            j += 1;
        }
    }
    out[255] = 1.0;
    out
}

/// A sorted 256-entry quantization map over [-1, 1] (signed) or [0, 1] (unsigned), with the
/// lookup table that makes nearest-code search fast on the CPU.
#[derive(Debug)]
pub struct QuantMap {
    values: [f32; 256],
    zero: u8,
    coder: LazyLock<Coder>,
}

/// The first moment's map: signed dynamic tree quantization.
pub static SIGNED: QuantMap = QuantMap {
    values: dynamic_map(true),
    zero: 127,
    coder: LazyLock::new(|| Coder::new(&dynamic_map(true))),
};
/// The second moment's map: unsigned dynamic quantization (v ≥ 0 needs no sign bit).
pub static UNSIGNED: QuantMap = QuantMap {
    values: dynamic_map(false),
    zero: 0,
    coder: LazyLock::new(|| Coder::new(&dynamic_map(false))),
};

impl QuantMap {
    /// The map's values, ascending.
    pub fn values(&self) -> &[f32; 256] {
        &self.values
    }
    /// The value a code stands for.
    pub fn value(&self, code: u8) -> f32 {
        self.values[usize::from(code)]
    }
    /// The code of 0 (what a fresh state holds).
    pub fn zero_code(&self) -> u8 {
        self.zero
    }
    /// The code nearest to `x` (ties to the lower code; NaN and values below the map to code 0).
    pub fn code(&self, x: f32) -> u8 {
        self.coder.code(x)
    }
    /// The same answer as [`QuantMap::code`] by plain binary search over the map, as the CUDA
    /// kernel and bitsandbytes find it (kept as the definition the fast path is tested against).
    pub fn code_by_binary_search(&self, x: f32) -> u8 {
        nearest_binary(&self.values, x)
    }
}

/// Nearest entry of a sorted 256-entry map: a branch-free binary search for the last entry
/// `<= x` (index 0 if none), then the closer of it and its upper neighbour, ties to the lower.
/// `csrc/adam8bit.cu`'s `ckpt_nearest` is this function; [`Coder`] computes the same result
/// faster.
fn nearest_binary(map: &[f32; 256], x: f32) -> u8 {
    let mut lo = 0usize;
    for half in [128, 64, 32, 16, 8, 4, 2, 1] {
        // lo + half <= 255 always (the halves sum to 255); the mask only spares a bounds check.
        if map[(lo + half) & 255] <= x {
            lo += half;
        }
    }
    let up = (lo + 1).min(255);
    // At lo == 255, up == lo and the test is false whatever x is: the same as the kernel's
    // `lo < 255 &&` guard.
    if (map[up] - x) < (x - map[lo]) {
        lo = up;
    }
    lo as u8
}

// The fast nearest-code search. Binary search costs 8 dependent loads per element (measured:
// 15.6 ns per element and map on this project's CPU, nine times a whole fp32 AdamW element), so:
//  - `nearest_binary` is a monotone step function of x: it rises by one at 255 thresholds
//    T_k = the smallest float whose code exceeds k (found once, by bisection over the floats
//    between neighbouring entries), so code(x) = #{k : T_k <= x}.
//  - A table indexed by the float's top 16 bits (sign, exponent clamped to the range in use,
//    top 7 mantissa bits) gives that count at each such bucket's smallest x. No bucket holds more
//    than one threshold (asserted when the table is built), and a threshold inside a bucket
//    shares its top 16 bits with every x there, so comparing the low 16 bits decides it: the
//    table entry packs the count and those bits, and code(x) = count + (low bits passed).
// One table load per element: the AVX2 loop does 8 elements with one gather, and a whole 8-bit
// step went from 35 to 2.5 ns per element on one thread of this project's CPU. The result
// equals `nearest_binary` for every x, NaN included (tested over sampled bit patterns and every
// entry's neighbourhood), so CPU codes equal the CUDA kernel's.

/// Exponents below 2^-24 share the bottom bucket; 2 and above the top one. (|x| ≤ 1 in use:
/// moments divided by their block's absmax.)
const EXP_LO: u32 = 103;
const EXP_SPAN: u32 = 26;
const MANT_BITS: u32 = 7;
const LUT_LEN: usize = (2 * EXP_SPAN as usize) << MANT_BITS;

#[derive(Debug)]
struct Coder {
    /// Per bucket: bits 0..8, the number of thresholds <= the bucket's smallest x; bits 8..25,
    /// the low 16 bits of the threshold inside the bucket, oriented so larger means larger x
    /// (complemented for negative x), or 0x10000 — never reached — when there is none. u32 so
    /// the vectorized loop can gather it directly.
    lut: Box<[u32; LUT_LEN]>,
}

/// No threshold in the bucket: larger than any 16-bit value.
const NO_THRESHOLD: u32 = 0x1_0000;

/// The low 16 bits of `x`, increasing with x's value within a bucket (the bits of a negative
/// float grow with its magnitude, so they are complemented).
#[inline(always)]
fn oriented_low_bits(x: f32) -> u32 {
    let b = x.to_bits();
    let flip = ((b as i32) >> 31) as u32 & 0xffff;
    (b & 0xffff) ^ flip
}

/// The bucket of `x`: sign, clamped exponent, top mantissa bits.
#[inline(always)]
fn bucket(x: f32) -> usize {
    let b = x.to_bits();
    let exp = (b >> 23) & 0xff;
    let exp_hi = EXP_LO + EXP_SPAN - 1;
    let mant = if exp < EXP_LO {
        0
    } else if exp > exp_hi {
        (1 << MANT_BITS) - 1
    } else {
        (b >> (23 - MANT_BITS)) & ((1 << MANT_BITS) - 1)
    };
    let e = exp.clamp(EXP_LO, exp_hi) - EXP_LO;
    ((((b >> 31) * EXP_SPAN + e) << MANT_BITS) | mant) as usize
}

/// The smallest and largest x of bucket `k` (the inverse of [`bucket`]).
fn bucket_range(k: usize) -> (f32, f32) {
    let per_sign = (EXP_SPAN as usize) << MANT_BITS;
    let (negative, rest) = (k >= per_sign, k % per_sign);
    let (e, m) = ((rest >> MANT_BITS) as u32, (rest & ((1 << MANT_BITS) - 1)) as u32);
    let base = ((EXP_LO + e) << 23) | (m << (23 - MANT_BITS));
    let lo = if e == 0 && m == 0 { 0.0 } else { f32::from_bits(base) };
    let hi = if e == EXP_SPAN - 1 && m == (1 << MANT_BITS) - 1 {
        f32::INFINITY
    } else {
        f32::from_bits(base | ((1 << (23 - MANT_BITS)) - 1))
    };
    if negative {
        (-hi, -lo)
    } else {
        (lo, hi)
    }
}

/// Floats in value order as integers (-0.0 just below +0.0), for bisection over floats.
fn ordered_key(x: f32) -> i32 {
    let i = x.to_bits() as i32;
    if i < 0 {
        i ^ i32::MAX
    } else {
        i
    }
}

fn from_ordered_key(k: i32) -> f32 {
    f32::from_bits(if k < 0 { k ^ i32::MAX } else { k } as u32)
}

impl Coder {
    fn new(map: &[f32; 256]) -> Self {
        let mut thresholds = [f32::NAN; 256];
        for (k, t) in thresholds.iter_mut().take(255).enumerate() {
            // code(map[k]) = k and code(map[k + 1]) = k + 1: bisect the floats in between for
            // the first one coded above k.
            let (mut lo, mut hi) = (ordered_key(map[k]), ordered_key(map[k + 1]));
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if usize::from(nearest_binary(map, from_ordered_key(mid))) > k {
                    hi = mid;
                } else {
                    lo = mid;
                }
            }
            *t = from_ordered_key(hi);
        }
        let mut lut = Box::new([0u32; LUT_LEN]);
        let count_le = |x: f32| thresholds[..255].iter().filter(|&&t| t <= x).count();
        let per_sign = (EXP_SPAN as usize) << MANT_BITS;
        for (k, slot) in lut.iter_mut().enumerate() {
            let (lo, hi) = bucket_range(k);
            let below = count_le(lo);
            let inside = count_le(hi) - below;
            // The two end buckets of each sign also hold the clamped exponents, whose x do not
            // share the bucket's top bits: no threshold may sit there.
            let clamped = k % per_sign == 0 || k % per_sign == per_sign - 1;
            assert!(
                inside == 0 || (inside == 1 && !clamped && bucket(thresholds[below]) == k),
                "quantization map too dense for a {MANT_BITS}-bit bucket table at bucket {k} [{lo:e}, {hi:e}]"
            );
            let t = if inside == 1 {
                oriented_low_bits(thresholds[below])
            } else {
                NO_THRESHOLD
            };
            *slot = below as u32 | t << 8;
        }
        Self { lut }
    }

    #[inline(always)]
    fn code(&self, x: f32) -> u8 {
        let entry = self.lut[bucket(x).min(LUT_LEN - 1)];
        let code = (entry & 0xff) + u32::from(oriented_low_bits(x) >= entry >> 8);
        // NaN compares false everywhere, so binary search ends at code 0. (A count of 255 has no
        // threshold above it, so the sum stays within a byte.)
        if x.is_nan() {
            0
        } else {
            code as u8
        }
    }

    /// `codes[i] = code(x[i] · scale)`.
    #[inline(always)]
    fn encode(&self, x: &[f32], scale: f32, codes: &mut [u8]) {
        for (c, &v) in codes.iter_mut().zip(x) {
            *c = self.code(v * scale);
        }
    }
}

/// Block-wise quantization of `x` with `map`: per block of [`BLOCK`] elements, `absmax` = the
/// largest |x|, `codes` = nearest code of `x / absmax` (an all-zero block gets absmax 0 and the
/// zero code).
pub fn quantize_blockwise(x: &[f32], map: &QuantMap, codes: &mut [u8], absmax: &mut [f32]) -> Result<(), KernelError> {
    const OP: &str = "block-wise quantization";
    check_len(OP, "codes", codes.len(), x.len())?;
    check_len(OP, "absmax", absmax.len(), x.len().div_ceil(BLOCK))?;
    for ((xb, cb), a) in x.chunks(BLOCK).zip(codes.chunks_mut(BLOCK)).zip(absmax.iter_mut()) {
        *a = abs_max(xb);
        map.coder.encode(xb, inverse(*a), cb);
    }
    Ok(())
}

/// Inverse of [`quantize_blockwise`]: `out[i] = map[codes[i]] · absmax[i / BLOCK]`.
pub fn dequantize_blockwise(codes: &[u8], absmax: &[f32], map: &QuantMap, out: &mut [f32]) -> Result<(), KernelError> {
    const OP: &str = "block-wise dequantization";
    check_len(OP, "output", out.len(), codes.len())?;
    check_len(OP, "absmax", absmax.len(), codes.len().div_ceil(BLOCK))?;
    for ((cb, ob), &a) in codes.chunks(BLOCK).zip(out.chunks_mut(BLOCK)).zip(absmax) {
        dequantize(cb, &map.values, a, ob);
    }
    Ok(())
}

fn check_len(op: &'static str, what: &str, got: usize, want: usize) -> Result<(), KernelError> {
    if got == want {
        Ok(())
    } else {
        Err(KernelError::Invalid {
            op,
            message: format!("{what} has {got} elements, expected {want}"),
        })
    }
}

#[inline(always)]
fn abs_max(x: &[f32]) -> f32 {
    // f32::max ignores NaN, like CUDA's fmaxf; max is exact, so the order of reduction does not
    // matter and the GPU's tree reduction gives the same bits.
    x.iter().fold(0f32, |a, v| a.max(v.abs()))
}

#[inline(always)]
fn inverse(absmax: f32) -> f32 {
    // 0 · (1/0) would be NaN; an all-zero block quantizes to the zero code instead.
    if absmax > 0.0 {
        1.0 / absmax
    } else {
        0.0
    }
}

// ---------------------------------------------------------------------------------------------
// The update
// ---------------------------------------------------------------------------------------------

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

/// The 32-bit-state update (tensors below [`MIN_8BIT_NUMEL`]): same formulas, f32 moments.
pub fn update_full(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: &StepScalars) -> Result<(), KernelError> {
    const OP: &str = "32-bit Adam update";
    check_len(OP, "gradient", g.len(), p.len())?;
    check_len(OP, "first moment", m.len(), p.len())?;
    check_len(OP, "second moment", v.len(), p.len())?;
    full_kernel(p, g, m, v, s);
    Ok(())
}

#[inline(always)]
fn full_kernel(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: &StepScalars) {
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
fn block_kernel<const AVX2: bool>(
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

#[inline(always)]
fn dequantize(codes: &[u8], map: &[f32; 256], absmax: f32, out: &mut [f32]) {
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = map[usize::from(c)] * absmax;
    }
}

// ---------------------------------------------------------------------------------------------
// State and the optimizer
// ---------------------------------------------------------------------------------------------

/// Bytes of optimizer state for a parameter of `numel` elements: 8-bit codes for both moments
/// plus two f32 absmax per block, or two f32 moments below [`MIN_8BIT_NUMEL`].
pub fn state_bytes_for(numel: i64) -> i64 {
    if numel < MIN_8BIT_NUMEL {
        2 * 4 * numel
    } else {
        2 * numel + 2 * 4 * blocks_of(numel)
    }
}

/// Quantization blocks of a tensor of `numel` (≥ 0) elements.
fn blocks_of(numel: i64) -> i64 {
    (numel + BLOCK as i64 - 1) / BLOCK as i64
}

/// One parameter's moments.
#[derive(Debug)]
pub enum Moments {
    /// 32-bit moments (small tensors), flat f32.
    Full { m: Tensor, v: Tensor },
    /// 8-bit codes (flat uint8) and one f32 absmax per block for each moment.
    Blockwise {
        m_codes: Tensor,
        v_codes: Tensor,
        m_absmax: Tensor,
        v_absmax: Tensor,
    },
}

/// One parameter's optimizer state.
#[derive(Debug)]
pub struct ParamState {
    /// Updates applied so far (PyTorch's per-parameter `state['step']`).
    pub step: u64,
    pub moments: Moments,
}

fn torch_err(op: &'static str) -> impl Fn(tch::TchError) -> KernelError {
    move |e| KernelError::Torch {
        op,
        message: crate::ffi::first_line(&e.to_string()),
    }
}

impl ParamState {
    /// Zero state for a parameter of `numel` elements on `device`.
    pub fn zeros(numel: i64, device: Device) -> Result<Self, KernelError> {
        let op = "allocating 8-bit Adam state";
        let e = torch_err(op);
        let moments = if numel < MIN_8BIT_NUMEL {
            Moments::Full {
                m: Tensor::f_zeros([numel], (Kind::Float, device)).map_err(&e)?,
                v: Tensor::f_zeros([numel], (Kind::Float, device)).map_err(&e)?,
            }
        } else {
            let blocks = blocks_of(numel);
            Moments::Blockwise {
                m_codes: Tensor::f_full([numel], i64::from(SIGNED.zero), (Kind::Uint8, device)).map_err(&e)?,
                v_codes: Tensor::f_full([numel], i64::from(UNSIGNED.zero), (Kind::Uint8, device)).map_err(&e)?,
                m_absmax: Tensor::f_zeros([blocks], (Kind::Float, device)).map_err(&e)?,
                v_absmax: Tensor::f_zeros([blocks], (Kind::Float, device)).map_err(&e)?,
            }
        };
        Ok(Self { step: 0, moments })
    }

    /// Bytes of the state's tensors.
    pub fn bytes(&self) -> i64 {
        let b = |t: &Tensor| t.numel() as i64 * t.kind().elt_size_in_bytes() as i64;
        match &self.moments {
            Moments::Full { m, v } => b(m) + b(v),
            Moments::Blockwise {
                m_codes,
                v_codes,
                m_absmax,
                v_absmax,
            } => b(m_codes) + b(v_codes) + b(m_absmax) + b(v_absmax),
        }
    }

    /// Both moments as f32 on the CPU (dequantized where 8-bit), for inspection and tests.
    pub fn moments_f32(&self) -> Result<(Vec<f32>, Vec<f32>), KernelError> {
        let e = torch_err("reading 8-bit Adam state");
        let f32s = |t: &Tensor| -> Result<Vec<f32>, KernelError> {
            Vec::<f32>::try_from(&t.f_to_device(Device::Cpu).map_err(&e)?).map_err(&e)
        };
        let u8s = |t: &Tensor| -> Result<Vec<u8>, KernelError> {
            Vec::<u8>::try_from(&t.f_to_device(Device::Cpu).map_err(&e)?).map_err(&e)
        };
        match &self.moments {
            Moments::Full { m, v } => Ok((f32s(m)?, f32s(v)?)),
            Moments::Blockwise {
                m_codes,
                v_codes,
                m_absmax,
                v_absmax,
            } => {
                let (mc, vc) = (u8s(m_codes)?, u8s(v_codes)?);
                let (mut m, mut v) = (vec![0f32; mc.len()], vec![0f32; vc.len()]);
                dequantize_blockwise(&mc, &f32s(m_absmax)?, &SIGNED, &mut m)?;
                dequantize_blockwise(&vc, &f32s(v_absmax)?, &UNSIGNED, &mut v)?;
                Ok((m, v))
            }
        }
    }
}

/// 8-bit block-wise Adam/AdamW over a fixed list of parameters, updated from their `.grad`.
#[derive(Debug)]
pub struct Adam8bit {
    params: Vec<Tensor>,
    hyper: AdamHyper,
    states: Vec<Option<ParamState>>,
}

impl Adam8bit {
    /// No state is allocated until a parameter's first step (PyTorch's lazy state).
    pub fn new(params: Vec<Tensor>, hyper: AdamHyper) -> Self {
        let states = params.iter().map(|_| None).collect();
        Self { params, hyper, states }
    }

    pub fn hyper(&self) -> &AdamHyper {
        &self.hyper
    }
    pub fn params(&self) -> &[Tensor] {
        &self.params
    }
    /// Parameter `i`'s state, once it has had a step.
    pub fn state(&self, i: usize) -> Option<&ParamState> {
        self.states.get(i).and_then(Option::as_ref)
    }
    /// Bytes of optimizer state allocated.
    pub fn state_bytes(&self) -> i64 {
        self.states.iter().flatten().map(ParamState::bytes).sum()
    }

    /// One update of every parameter that has a gradient (others are skipped, as in PyTorch).
    ///
    /// f32 contiguous CPU parameters with f32 contiguous gradients are updated in place with no
    /// allocation; others (bf16 parameters, strided tensors) go through an f32 copy, one tensor
    /// at a time so the transient stays one tensor's size.
    pub fn step(&mut self) -> Result<(), KernelError> {
        const OP: &str = "8-bit Adam step";
        self.hyper.validate()?;
        let e = torch_err(OP);
        let _no_grad = tch::no_grad_guard();
        // Validate every parameter before touching any state, so an error leaves the optimizer
        // as it was. `todo` also keeps the gradients alive while jobs point into them.
        let mut todo: Vec<(usize, Tensor, Path)> = Vec::new();
        for (i, p) in self.params.iter().enumerate() {
            let g = p.grad();
            if !g.defined() {
                continue;
            }
            check_pair(p, &g)?;
            let path = match p.device() {
                Device::Cpu if is_f32_contiguous(p) && is_f32_contiguous(&g) => Path::Direct,
                Device::Cpu => Path::Staged,
                Device::Cuda(_) => Path::Cuda,
                other => {
                    return Err(KernelError::Invalid {
                        op: OP,
                        message: format!("parameter {i} is on {other:?}; 8-bit Adam runs on CPU and CUDA"),
                    })
                }
            };
            todo.push((i, g, path));
        }
        check_disjoint(
            todo.iter()
                .filter(|(_, _, path)| *path == Path::Direct)
                .flat_map(|(i, g, _)| [(&self.params[*i], true), (g, false)]),
        )?;

        let mut direct: Vec<CpuJob> = Vec::new();
        let mut staged: Vec<(usize, StepScalars)> = Vec::new();
        for (i, g, path) in &todo {
            let p = &self.params[*i];
            let state = match &mut self.states[*i] {
                Some(s) => s,
                slot @ None => slot.insert(ParamState::zeros(p.numel() as i64, p.device())?),
            };
            state.step += 1;
            let s = StepScalars::new(&self.hyper, state.step);
            if p.numel() == 0 {
                continue;
            }
            match path {
                Path::Direct => direct.push(CpuJob::new(p, g, state, s)),
                Path::Staged => staged.push((*i, s)),
                Path::Cuda => {
                    let (pw, gw) = (f32_contiguous(p).map_err(&e)?, f32_contiguous(g).map_err(&e)?);
                    gpu_step(&pw, &gw, state, &s)?;
                    if pw.data_ptr() != p.data_ptr() {
                        p.shallow_clone().f_copy_(&pw).map_err(&e)?;
                    }
                }
            }
        }
        run_cpu(&direct);
        drop(direct);

        for (i, s) in staged {
            let (p, Some(state)) = (&self.params[i], self.states[i].as_ref()) else {
                continue;
            };
            // Fresh f32 copies (or `p` itself when only the gradient needed one): no aliasing,
            // and run one at a time, after the direct jobs, so nothing races.
            let (pw, gw) = (f32_contiguous(p).map_err(&e)?, f32_contiguous(&p.grad()).map_err(&e)?);
            run_cpu(&[CpuJob::new(&pw, &gw, state, s)]);
            if pw.data_ptr() != p.data_ptr() {
                p.shallow_clone().f_copy_(&pw).map_err(&e)?;
            }
        }
        Ok(())
    }
}

/// How a parameter is updated this step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// In place on its f32 contiguous CPU buffer, with every other such parameter in one
    /// parallel pass.
    Direct,
    /// Through an f32 contiguous copy (bf16/f16 or strided CPU tensors).
    Staged,
    /// The CUDA kernel.
    Cuda,
}

fn is_f32_contiguous(t: &Tensor) -> bool {
    t.f_kind().ok() == Some(Kind::Float) && t.is_contiguous()
}

/// `t` as a contiguous f32 tensor: `t` itself when it already is one, else a copy.
fn f32_contiguous(t: &Tensor) -> Result<Tensor, tch::TchError> {
    t.f_to_kind(Kind::Float)?.f_contiguous()
}

fn check_pair(p: &Tensor, g: &Tensor) -> Result<(), KernelError> {
    const OP: &str = "8-bit Adam step";
    if p.numel() != g.numel() || p.device() != g.device() {
        return Err(KernelError::Invalid {
            op: OP,
            message: format!(
                "gradient {:?} on {:?} does not match its parameter {:?} on {:?}",
                g.size(),
                g.device(),
                p.size(),
                p.device()
            ),
        });
    }
    for (what, t) in [("parameter", p), ("gradient", g)] {
        match t.f_kind() {
            Ok(Kind::Float | Kind::BFloat16 | Kind::Half) => {}
            other => {
                return Err(KernelError::Invalid {
                    op: OP,
                    message: format!("{what} of dtype {other:?}; 8-bit Adam updates f32, bf16 and f16 tensors"),
                })
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// CPU execution
// ---------------------------------------------------------------------------------------------

/// Raw views of one parameter's buffers for the CPU kernels.
struct CpuJob {
    p: *mut f32,
    g: *const f32,
    n: usize,
    state: JobState,
    s: StepScalars,
}

enum JobState {
    Full {
        m: *mut f32,
        v: *mut f32,
    },
    Blockwise {
        mc: *mut u8,
        vc: *mut u8,
        am: *mut f32,
        av: *mut f32,
    },
}

// SAFETY: a job only carries pointers into tensors that outlive the scoped threads that use it
// (the parameters and states are borrowed by `Adam8bit::step`, the gradients held in `todo`),
// and the work items handed to different threads cover disjoint element ranges of those buffers
// (`run_cpu`); `check_disjoint` rules out parameters that alias each other or a gradient.
unsafe impl Sync for CpuJob {}
unsafe impl Send for CpuJob {}

impl CpuJob {
    /// `p` and `g` must be contiguous f32 CPU tensors of equal numel, `state` this parameter's.
    fn new(p: &Tensor, g: &Tensor, state: &ParamState, s: StepScalars) -> Self {
        let ptr = |t: &Tensor| t.data_ptr();
        let state = match &state.moments {
            Moments::Full { m, v } => JobState::Full {
                m: ptr(m).cast(),
                v: ptr(v).cast(),
            },
            Moments::Blockwise {
                m_codes,
                v_codes,
                m_absmax,
                v_absmax,
            } => JobState::Blockwise {
                mc: ptr(m_codes).cast(),
                vc: ptr(v_codes).cast(),
                am: ptr(m_absmax).cast(),
                av: ptr(v_absmax).cast(),
            },
        };
        Self {
            p: ptr(p).cast(),
            g: ptr(g).cast_const().cast(),
            n: p.numel(),
            state,
            s,
        }
    }

    fn blocks(&self) -> usize {
        match self.state {
            JobState::Full { .. } => 1,
            JobState::Blockwise { .. } => self.n.div_ceil(BLOCK),
        }
    }

    /// Runs blocks `b0..b1` (for a 32-bit job, its one "block" is the whole tensor).
    ///
    /// # Safety
    /// No other thread may touch blocks `b0..b1` of this job meanwhile, and the job's buffers
    /// must be alive (see the `Sync` impl).
    unsafe fn run(&self, b0: usize, b1: usize) {
        let lo = b0 * BLOCK;
        let hi = match self.state {
            JobState::Full { .. } => self.n,
            JobState::Blockwise { .. } => (b1 * BLOCK).min(self.n),
        };
        let len = hi - lo;
        // SAFETY: [lo, hi) lies inside every buffer (each has n elements, absmax one per block);
        // the caller guarantees exclusive access to this range; `g` is never written and aliases
        // no parameter (checked). The element types match the tensors' dtypes.
        unsafe {
            let p = std::slice::from_raw_parts_mut(self.p.add(lo), len);
            let g = std::slice::from_raw_parts(self.g.add(lo), len);
            match self.state {
                JobState::Full { m, v } => {
                    let m = std::slice::from_raw_parts_mut(m.add(lo), len);
                    let v = std::slice::from_raw_parts_mut(v.add(lo), len);
                    // Below 4096 elements: not worth an AVX2 variant.
                    full_kernel(p, g, m, v, &self.s);
                }
                JobState::Blockwise { mc, vc, am, av } => {
                    let mc = std::slice::from_raw_parts_mut(mc.add(lo), len);
                    let vc = std::slice::from_raw_parts_mut(vc.add(lo), len);
                    let am = std::slice::from_raw_parts_mut(am.add(b0), b1 - b0);
                    let av = std::slice::from_raw_parts_mut(av.add(b0), b1 - b0);
                    dispatch_blocks(p, g, mc, vc, am, av, &self.s);
                }
            }
        }
    }
}

/// Refuses parameters that overlap each other or a gradient (`(tensor, written)` pairs): the
/// threads would race on them. Gradients may overlap each other: they are only read.
fn check_disjoint<'a>(tensors: impl Iterator<Item = (&'a Tensor, bool)>) -> Result<(), KernelError> {
    let mut ranges: Vec<(usize, usize, bool)> = tensors
        .map(|(t, written)| {
            let start = t.data_ptr() as usize;
            (start, start + t.numel() * 4, written)
        })
        .collect();
    ranges.sort_unstable();
    let (mut p_end, mut g_end) = (0usize, 0usize);
    for (start, end, written) in ranges {
        // Ranges arrive by start, so overlap with an earlier one means starting before its end.
        if start < p_end || (written && start < g_end) {
            return Err(KernelError::Invalid {
                op: "8-bit Adam step",
                message: format!(
                    "a parameter's memory at {start:#x} overlaps another parameter or a gradient; \
                     each parameter must own its storage"
                ),
            });
        }
        if written {
            p_end = p_end.max(end);
        } else {
            g_end = g_end.max(end);
        }
    }
    Ok(())
}

/// Blocks per work item: 16 K elements, large enough to amortize the queue, small enough to
/// balance two to a few dozen threads over a ResNet's tensors.
const CHUNK_BLOCKS: usize = 8;
/// Below this many elements in a step, threads cost more than they save.
const PARALLEL_MIN: usize = 1 << 16;

/// Runs all jobs over `tch::get_num_threads()` threads (libtorch's intra-op setting, so the
/// user's one thread knob governs both): work items are chunks of blocks, taken from a shared
/// counter so big and small tensors balance.
fn run_cpu(jobs: &[CpuJob]) {
    let items: Vec<(usize, usize, usize)> = jobs
        .iter()
        .enumerate()
        .flat_map(|(j, job)| {
            let blocks = job.blocks();
            (0..blocks)
                .step_by(CHUNK_BLOCKS)
                .map(move |b| (j, b, (b + CHUNK_BLOCKS).min(blocks)))
        })
        .collect();
    let total: usize = jobs.iter().map(|j| j.n).sum();
    let threads = usize::try_from(tch::get_num_threads())
        .unwrap_or(1)
        .clamp(1, items.len().max(1));
    let next = AtomicUsize::new(0);
    let work = || loop {
        let k = next.fetch_add(1, Ordering::Relaxed);
        let Some(&(j, b0, b1)) = items.get(k) else { break };
        // SAFETY: each item index is claimed by exactly one thread (fetch_add), and items
        // cover disjoint block ranges; the buffers outlive this function (see `CpuJob`).
        unsafe { jobs[j].run(b0, b1) };
    };
    if threads == 1 || total < PARALLEL_MIN {
        work();
        return;
    }
    std::thread::scope(|scope| {
        for _ in 1..threads {
            scope.spawn(work);
        }
        work();
    });
}

/// Whether the running CPU has AVX2, for the explicit-gather passes (the macro caches).
#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    std::is_x86_feature_detected!("avx2")
}

fn dispatch_blocks(
    p: &mut [f32],
    g: &[f32],
    mc: &mut [u8],
    vc: &mut [u8],
    am: &mut [f32],
    av: &mut [f32],
    s: &StepScalars,
) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 (checked above).
        unsafe { blocks_avx2(p, g, mc, vc, am, av, s) };
        return;
    }
    blocks_generic(p, g, mc, vc, am, av, s);
}

/// The same code compiled for AVX2, with explicit gathers. No FMA is enabled and Rust never
/// contracts `a * b + c`, so the results are bit-identical to [`blocks_generic`] (and to the
/// CUDA kernel).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn blocks_avx2(
    p: &mut [f32],
    g: &[f32],
    mc: &mut [u8],
    vc: &mut [u8],
    am: &mut [f32],
    av: &mut [f32],
    s: &StepScalars,
) {
    blocks::<true>(p, g, mc, vc, am, av, s);
}

fn blocks_generic(
    p: &mut [f32],
    g: &[f32],
    mc: &mut [u8],
    vc: &mut [u8],
    am: &mut [f32],
    av: &mut [f32],
    s: &StepScalars,
) {
    blocks::<false>(p, g, mc, vc, am, av, s);
}

#[inline(always)]
fn blocks<const AVX2: bool>(
    p: &mut [f32],
    g: &[f32],
    mc: &mut [u8],
    vc: &mut [u8],
    am: &mut [f32],
    av: &mut [f32],
    s: &StepScalars,
) {
    for (((((p, g), mc), vc), am), av) in p
        .chunks_mut(BLOCK)
        .zip(g.chunks(BLOCK))
        .zip(mc.chunks_mut(BLOCK))
        .zip(vc.chunks_mut(BLOCK))
        .zip(am.iter_mut())
        .zip(av.iter_mut())
    {
        block_kernel::<AVX2>(p, g, mc, vc, am, av, s);
    }
}

/// AVX2 versions of the two table-lookup passes, 8 elements at a time; remainders go through
/// the scalar code, which computes the same values.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Coder, EXP_LO, EXP_SPAN, LUT_LEN, MANT_BITS};

    /// `out[i] = map[codes[i]] · absmax`.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn dequantize(codes: &[u8], map: &[f32; 256], absmax: f32, out: &mut [f32]) {
        let n = out.len().min(codes.len());
        let full = n / 8 * 8;
        let scale = _mm256_set1_ps(absmax);
        let mut i = 0;
        while i < full {
            // SAFETY: i + 8 <= n, so both the 8-byte load and the 8-float store are in bounds;
            // each index is a u8, so the gather stays inside the 256-entry map.
            unsafe {
                let c = _mm_loadl_epi64(codes.as_ptr().add(i).cast());
                let v = _mm256_i32gather_ps::<4>(map.as_ptr(), _mm256_cvtepu8_epi32(c));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(v, scale));
            }
            i += 8;
        }
        super::dequantize(&codes[full..n], map, absmax, &mut out[full..n]);
    }

    /// `codes[i] = coder.code(x[i] · scale)`, step for step as [`Coder::code`].
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn encode(coder: &Coder, x: &[f32], scale: f32, codes: &mut [u8]) {
        let n = x.len().min(codes.len());
        let full = n / 8 * 8;
        let lut = coder.lut.as_ptr().cast::<i32>();
        let scale_v = _mm256_set1_ps(scale);
        let exp_lo = _mm256_set1_epi32(EXP_LO as i32);
        let exp_hi = _mm256_set1_epi32((EXP_LO + EXP_SPAN - 1) as i32);
        let mant_mask = _mm256_set1_epi32((1 << MANT_BITS) - 1);
        let byte = _mm256_set1_epi32(0xff);
        let low16 = _mm256_set1_epi32(0xffff);
        let span = _mm256_set1_epi32(EXP_SPAN as i32);
        let last_key = _mm256_set1_epi32(LUT_LEN as i32 - 1);
        let mut i = 0;
        while i < full {
            // SAFETY: i + 8 <= n bounds the load and the 8-byte store; `key` is clamped to the
            // table, so the gather stays in bounds.
            unsafe {
                let xv = _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(i)), scale_v);
                let b = _mm256_castps_si256(xv);
                // bucket(): sign, clamped exponent, top mantissa bits.
                let exp = _mm256_and_si256(_mm256_srli_epi32::<23>(b), byte);
                let below = _mm256_cmpgt_epi32(exp_lo, exp);
                let above = _mm256_cmpgt_epi32(exp, exp_hi);
                let mant = _mm256_and_si256(_mm256_srli_epi32::<{ 23 - MANT_BITS as i32 }>(b), mant_mask);
                let mant = _mm256_or_si256(_mm256_andnot_si256(below, mant), _mm256_and_si256(above, mant_mask));
                let e = _mm256_sub_epi32(_mm256_min_epi32(_mm256_max_epi32(exp, exp_lo), exp_hi), exp_lo);
                let row = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_srli_epi32::<31>(b), span), e);
                let key = _mm256_min_epi32(
                    _mm256_or_si256(_mm256_slli_epi32::<{ MANT_BITS as i32 }>(row), mant),
                    last_key,
                );
                // Coder::code(): the bucket's count, plus one if its threshold is passed.
                let entry = _mm256_i32gather_epi32::<4>(lut, key);
                let flip = _mm256_and_si256(_mm256_srai_epi32::<31>(b), low16);
                let oriented = _mm256_xor_si256(_mm256_and_si256(b, low16), flip);
                // oriented >= threshold, i.e. not (threshold > oriented); both fit in 17 bits.
                let short = _mm256_cmpgt_epi32(_mm256_srli_epi32::<8>(entry), oriented);
                // A false `short` mask is 0 and a true one -1: count + 1 + mask.
                let code = _mm256_add_epi32(
                    _mm256_and_si256(entry, byte),
                    _mm256_add_epi32(_mm256_set1_epi32(1), short),
                );
                let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(xv, xv));
                let code = _mm256_andnot_si256(nan, code);
                // 8 × i32 in 0..=255 -> 8 bytes.
                let words = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256::<1>(code));
                _mm_storel_epi64(codes.as_mut_ptr().add(i).cast(), _mm_packus_epi16(words, words));
            }
            i += 8;
        }
        coder.encode(&x[full..n], scale, &mut codes[full..n]);
    }
}

// ---------------------------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------------------------

/// The CUDA source as compiled: a generated prelude (block length, the two maps as f32 bit
/// patterns) followed by `csrc/adam8bit.cu`.
pub fn cuda_source() -> String {
    let bits = |m: &QuantMap| {
        m.values
            .iter()
            .map(|v| format!("0x{:08x}u", v.to_bits()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "// Generated by kernels/src/adam8bit.rs.\n#define CKPT_QBLOCK {BLOCK}\n\
         __constant__ unsigned int ckpt_map_m_bits[256] = {{{}}};\n\
         __constant__ unsigned int ckpt_map_v_bits[256] = {{{}}};\n{}",
        bits(&SIGNED),
        bits(&UNSIGNED),
        include_str!("../csrc/adam8bit.cu")
    )
}

/// NVRTC flags for [`cuda_source`]: no FMA contraction, so the GPU rounds as the CPU does.
pub const NVRTC_OPTIONS: &[&str] = &["--fmad=false"];

/// The kernels `csrc/adam8bit.cu` defines.
pub const CUDA_KERNELS: [&str; 2] = [gpu_names::BLOCKWISE, gpu_names::FULL];

mod gpu_names {
    pub const BLOCKWISE: &str = "ckpt_adam8bit_blockwise_f32";
    pub const FULL: &str = "ckpt_adam32_f32";
}

#[cfg(not(feature = "cuda"))]
fn gpu_step(p: &Tensor, _g: &Tensor, _state: &ParamState, _s: &StepScalars) -> Result<(), KernelError> {
    Err(KernelError::Cuda {
        op: "8-bit Adam step",
        message: format!(
            "parameter on {:?}, but ckptune was built without the `cuda` feature",
            p.device()
        ),
    })
}

#[cfg(feature = "cuda")]
fn gpu_step(p: &Tensor, g: &Tensor, state: &ParamState, s: &StepScalars) -> Result<(), KernelError> {
    gpu::step(p, g, state, s)
}

/// Launches `csrc/adam8bit.cu` on libtorch's CUDA tensors through the cudarc driver API.
#[cfg(feature = "cuda")]
pub mod gpu {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};

    use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, PushKernelArg};
    use cudarc::nvrtc::Ptx;
    use tch::{Device, Tensor};

    use super::{gpu_names, Moments, ParamState, StepScalars, BLOCK};
    use crate::KernelError;

    const OP: &str = "8-bit Adam CUDA step";
    /// Threads per CUDA block; `csrc/adam8bit.cu`'s `CKPT_THREADS`.
    const THREADS: u32 = 256;

    fn err(message: impl std::fmt::Display) -> KernelError {
        KernelError::Cuda {
            op: OP,
            message: message.to_string(),
        }
    }

    /// The PTX of [`super::cuda_source`], compiled once per process.
    pub fn ptx() -> Result<Ptx, KernelError> {
        static PTX: OnceLock<Result<Ptx, String>> = OnceLock::new();
        PTX.get_or_init(|| {
            crate::nvrtc::compile("adam8bit.cu", &super::cuda_source(), super::NVRTC_OPTIONS).map_err(|e| e.to_string())
        })
        .clone()
        .map_err(|message| KernelError::Nvrtc {
            op: "compiling csrc/adam8bit.cu",
            message,
        })
    }

    struct Loaded {
        ctx: Arc<CudaContext>,
        blockwise: CudaFunction,
        full: CudaFunction,
    }

    /// The module loaded into device `ordinal`'s primary context (libtorch's context), once.
    fn loaded(ordinal: usize) -> Result<Arc<Loaded>, KernelError> {
        static LOADED: OnceLock<Mutex<HashMap<usize, Arc<Loaded>>>> = OnceLock::new();
        let mut map = LOADED
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(l) = map.get(&ordinal) {
            return Ok(l.clone());
        }
        if !crate::cuda::driver_present() {
            return Err(err("libcuda (the NVIDIA driver library) is not present"));
        }
        let ctx = CudaContext::new(ordinal).map_err(err)?;
        let module = ctx.load_module(ptx()?).map_err(err)?;
        let l = Arc::new(Loaded {
            blockwise: module.load_function(gpu_names::BLOCKWISE).map_err(err)?,
            full: module.load_function(gpu_names::FULL).map_err(err)?,
            ctx,
        });
        map.insert(ordinal, l.clone());
        Ok(l)
    }

    /// One update of `p` (contiguous f32 CUDA tensor) from `g` with `state`, on the legacy
    /// default stream — libtorch's current stream unless a caller set another, which ckptune
    /// never does; the legacy stream orders the launch after libtorch's pending work.
    pub(super) fn step(p: &Tensor, g: &Tensor, state: &ParamState, s: &StepScalars) -> Result<(), KernelError> {
        let Device::Cuda(ordinal) = p.device() else {
            return Err(err(format!("parameter on {:?}, not a CUDA device", p.device())));
        };
        let l = loaded(ordinal)?;
        let n = p.numel() as i64;
        let ptr = |t: &Tensor| t.data_ptr() as u64;
        let (pp, gp) = (ptr(p), ptr(g));
        let stream = l.ctx.default_stream();
        match &state.moments {
            Moments::Blockwise {
                m_codes,
                v_codes,
                m_absmax,
                v_absmax,
            } => {
                let (mc, vc, am, av) = (ptr(m_codes), ptr(v_codes), ptr(m_absmax), ptr(v_absmax));
                let blocks = u32::try_from(p.numel().div_ceil(BLOCK))
                    .map_err(|_| err(format!("{n} elements exceed one launch's grid")))?;
                let mut b = stream.launch_builder(&l.blockwise);
                b.arg(&pp).arg(&gp).arg(&mc).arg(&vc).arg(&am).arg(&av).arg(&n);
                push_scalars(&mut b, s);
                let cfg = LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: the argument list matches the kernel's signature (8 pointers/ints, then
                // 8 f32); every pointer is a live device allocation of this device with n
                // elements (absmax: one per block), owned by tensors that outlive the stream-
                // ordered launch (libtorch's caching allocator reuses freed memory only in
                // stream order).
                unsafe { b.launch(cfg) }.map_err(err)?;
            }
            Moments::Full { m, v } => {
                let (mp, vp) = (ptr(m), ptr(v));
                let blocks = u32::try_from(p.numel().div_ceil(THREADS as usize))
                    .map_err(|_| err(format!("{n} elements exceed one launch's grid")))?;
                let mut b = stream.launch_builder(&l.full);
                b.arg(&pp).arg(&gp).arg(&mp).arg(&vp).arg(&n);
                push_scalars(&mut b, s);
                let cfg = LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: as above, for the 32-bit kernel's 5 + 8 arguments.
                unsafe { b.launch(cfg) }.map_err(err)?;
            }
        }
        Ok(())
    }

    fn push_scalars<'a>(b: &mut cudarc::driver::LaunchArgs<'a>, s: &'a StepScalars) {
        b.arg(&s.one_minus_beta1)
            .arg(&s.beta2)
            .arg(&s.one_minus_beta2)
            .arg(&s.eps)
            .arg(&s.l2)
            .arg(&s.decay)
            .arg(&s.neg_step_size)
            .arg(&s.bc2_sqrt);
    }

    /// Waits for device `ordinal`'s queued work (tests compare results after this).
    pub fn synchronize(ordinal: usize) -> Result<(), KernelError> {
        loaded(ordinal)?.ctx.synchronize().map_err(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table-driven search equals binary search for every x: sampled across all bit
    /// patterns, and at every map entry, its float neighbours and the midpoints between entries.
    #[test]
    fn fast_nearest_equals_binary_search() {
        for map in [&SIGNED, &UNSIGNED] {
            let check = |x: f32| {
                assert_eq!(
                    map.code(x),
                    nearest_binary(&map.values, x),
                    "x = {x:e} ({:#010x})",
                    x.to_bits()
                );
            };
            // Every 4099th bit pattern (prime stride: all exponents and mantissa mixes).
            let mut bits = 0u32;
            while let Some(next) = bits.checked_add(4099) {
                check(f32::from_bits(bits));
                bits = next;
            }
            for w in map.values.windows(2) {
                let mid = (w[0] + w[1]) / 2.0;
                for c in [w[0], w[1], mid] {
                    for d in -3i32..=3 {
                        let b = c.to_bits() as i32 + d;
                        check(f32::from_bits(b as u32));
                        check(-f32::from_bits(b as u32));
                    }
                }
            }
            for x in [
                0.0,
                -0.0,
                f32::NAN,
                -f32::NAN,
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::MIN_POSITIVE,
                1.0,
                -1.0,
            ] {
                check(x);
            }
        }
    }

    #[test]
    fn avx2_passes_equal_the_scalar_ones() {
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            let n = 1003; // not a multiple of 8: the scalar remainder runs too
            let x: Vec<f32> = (0..n)
                .map(|i| ((i as f32 * 0.37).sin() * 1.3).powi(5))
                .chain([f32::NAN, -0.0])
                .collect();
            for (map, scale) in [(&SIGNED, 1.0f32 / 1.3f32.powi(5)), (&UNSIGNED, 0.77)] {
                let (mut fast, mut slow) = (vec![0u8; x.len()], vec![0u8; x.len()]);
                // SAFETY: AVX2 is present.
                unsafe { avx2::encode(&map.coder, &x, scale, &mut fast) };
                map.coder.encode(&x, scale, &mut slow);
                assert_eq!(fast, slow);
                let (mut fast_d, mut slow_d) = (vec![0f32; x.len()], vec![0f32; x.len()]);
                // SAFETY: AVX2 is present.
                unsafe { avx2::dequantize(&fast, &map.values, 0.25, &mut fast_d) };
                dequantize(&slow, &map.values, 0.25, &mut slow_d);
                assert_eq!(fast_d, slow_d);
            }
        }
    }

    #[test]
    fn buckets_round_trip() {
        for k in 0..LUT_LEN {
            let (lo, hi) = bucket_range(k);
            assert!(lo <= hi);
            assert_eq!(bucket(lo), k, "bucket {k} starts at {lo:e}");
            assert_eq!(bucket(hi), k, "bucket {k} ends at {hi:e}");
        }
    }
}
