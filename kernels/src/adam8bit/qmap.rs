//! The quantization maps (bitsandbytes' dynamic maps, signed and unsigned), the bucket table
//! that finds a value's nearest code in one load, and block-wise (de)quantization with them.

use std::sync::LazyLock;

use crate::KernelError;

/// The decades of the dynamic tree type: exponent `i` in 0..7 covers [0.1, 1] · 10^(i-6).
/// Written out, not `10f64.powi`, so every entry is the correctly rounded decimal.
/// Elements per quantization block (one absmax each): the paper's block size, and what
/// bitsandbytes' block-wise 8-bit optimizers use.
pub const BLOCK: usize = 2048;

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
    pub(super) values: [f32; 256],
    pub(super) zero: u8,
    pub(super) coder: LazyLock<Coder>,
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
pub(super) const EXP_LO: u32 = 103;
pub(super) const EXP_SPAN: u32 = 26;
pub(super) const MANT_BITS: u32 = 7;
pub(super) const LUT_LEN: usize = (2 * EXP_SPAN as usize) << MANT_BITS;

#[derive(Debug)]
pub(super) struct Coder {
    /// Per bucket: bits 0..8, the number of thresholds <= the bucket's smallest x; bits 8..25,
    /// the low 16 bits of the threshold inside the bucket, oriented so larger means larger x
    /// (complemented for negative x), or 0x10000 — never reached — when there is none. u32 so
    /// the vectorized loop can gather it directly.
    pub(super) lut: Box<[u32; LUT_LEN]>,
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
    pub(super) fn encode(&self, x: &[f32], scale: f32, codes: &mut [u8]) {
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

pub(super) fn check_len(op: &'static str, what: &str, got: usize, want: usize) -> Result<(), KernelError> {
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
pub(super) fn abs_max(x: &[f32]) -> f32 {
    // f32::max ignores NaN, like CUDA's fmaxf; max is exact, so the order of reduction does not
    // matter and the GPU's tree reduction gives the same bits.
    x.iter().fold(0f32, |a, v| a.max(v.abs()))
}

#[inline(always)]
pub(super) fn inverse(absmax: f32) -> f32 {
    // 0 · (1/0) would be NaN; an all-zero block quantizes to the zero code instead.
    if absmax > 0.0 {
        1.0 / absmax
    } else {
        0.0
    }
}

#[inline(always)]
pub(super) fn dequantize(codes: &[u8], map: &[f32; 256], absmax: f32, out: &mut [f32]) {
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = map[usize::from(c)] * absmax;
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
    fn buckets_round_trip() {
        for k in 0..LUT_LEN {
            let (lo, hi) = bucket_range(k);
            assert!(lo <= hi);
            assert_eq!(bucket(lo), k, "bucket {k} starts at {lo:e}");
            assert_eq!(bucket(hi), k, "bucket {k} ends at {hi:e}");
        }
    }
}
