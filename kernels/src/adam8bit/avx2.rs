//! AVX2 versions of the two table-lookup passes, 8 elements at a time; remainders go through
//! the scalar code, which computes the same values.

use std::arch::x86_64::*;

use super::qmap::{Coder, EXP_LO, EXP_SPAN, LUT_LEN, MANT_BITS};

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
    super::qmap::dequantize(&codes[full..n], map, absmax, &mut out[full..n]);
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

#[cfg(test)]
mod tests {
    use crate::adam8bit::avx2;
    use crate::adam8bit::cpu::has_avx2;
    use crate::adam8bit::qmap::{dequantize, SIGNED, UNSIGNED};

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
}
