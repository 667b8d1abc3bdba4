//! The 8-bit block-wise format of the optional quantized AdamW state (docs/adamw-8bit.md).
//!
//! Holds the format's definition: block size, the scalar encoding and decoding of one
//! value, block scales, and whole-slice conversions to and from f32 (for initialising
//! state, checkpoints and tests). The SIMD kernels re-implement `encode_*` / `decode_*`
//! with the same integer operations, so every path produces the same codes from the same
//! f32 values; tests check that against the functions here.
//!
//! Two tiny floating-point formats, each relative to a scale per block of [`BLOCK`] values:
//! - m, signed: a sign bit and a 7-bit magnitude with 4 exponent and 3 mantissa bits
//!   (E4M3), covering 2^-15 to 1.875 times the scale; magnitude code 0 is zero.
//! - sqrt(v), non-negative: 8 bits with 4 exponent and 4 mantissa bits (E4M4), covering
//!   2^-15 to 1.9375 times the scale. Code 0 is zero and appears only in fresh state:
//!   encoding never rounds a value down to zero, since a denominator rounded to zero
//!   would turn m / (sqrt(v) + eps) into m / eps.
//!
//! The scale of a block is its largest magnitude divided by the largest code's value, so
//! the largest element of every block is stored to within a rounding of the top code.

/// How many consecutive values share one scale.
pub const BLOCK: usize = 256;

/// The value of the largest m magnitude code (exponent 15, mantissa 7): 2^0 * (1 + 7/8).
pub const M_TOP: f32 = 1.875;

/// The value of the largest sqrt(v) code (exponent 15, mantissa 15): 2^0 * (1 + 15/16).
pub const R_TOP: f32 = 1.9375;

/// Half the smallest nonzero m magnitude code's value (2^-15 * 9/8): the rounding
/// threshold between zero and that code.
pub(crate) const M_HALF_MIN: f32 = 0.5625 / 32768.0;

/// Exponent field of a code's smallest octave (2^-15) as a biased f32 exponent.
pub(crate) const EXP_BIAS: u32 = 127 - 15;

/// The f32 bits a magnitude code's value is built from: code `u` (1..=127, E4M3) shifted
/// so its mantissa lands in the top 3 f32 mantissa bits, plus the exponent bias.
pub(crate) const M_SHIFT: u32 = 20;

/// As [`M_SHIFT`] for sqrt(v) codes (E4M4: the top 4 f32 mantissa bits).
pub(crate) const R_SHIFT: u32 = 19;

/// The scale and its inverse for a block whose largest m magnitude is `absmax`.
/// A block of zeros gets scale 0 and inverse 0 (so it encodes and decodes to zero).
pub fn m_scales(absmax: f32) -> (f32, f32) {
    scales(absmax, M_TOP)
}

/// The scale and its inverse for a block whose largest sqrt(v) is `max`.
pub fn r_scales(max: f32) -> (f32, f32) {
    scales(max, R_TOP)
}

fn scales(max: f32, top: f32) -> (f32, f32) {
    if max > 0.0 && max.is_finite() {
        let inverse = top / max;
        if inverse.is_finite() {
            (max / top, inverse)
        } else {
            // Below about 5.5e-39 (deep in the subnormals) the inverse overflows, and
            // every value would encode as the top code (zeros as NaN). Values that small
            // are zero to the arithmetic that reads them: store the block as zeros.
            (0.0, 0.0)
        }
    } else if max == 0.0 {
        (0.0, 0.0)
    } else {
        // NaN or infinity: the block is already lost (a non-finite gradient reached the
        // state); keep it visibly non-finite rather than pretending.
        (f32::NAN, f32::NAN)
    }
}

/// Encodes one m value, `inv_scale` being the block's inverse scale. Rounds to nearest
/// (ties away from zero); magnitudes below the smallest code become zero.
#[inline]
pub fn encode_m(x: f32, inv_scale: f32) -> u8 {
    let y = x.abs() * inv_scale;
    // Wrapping, as the SIMD kernels' integer adds do (only a NaN's bits can wrap).
    let rounded = y.to_bits().wrapping_add(1 << (M_SHIFT - 1)) >> M_SHIFT;
    let u = (rounded as i32 - (EXP_BIAS << 3) as i32).clamp(0, 127);
    // Code 0 is zero, not 2^-15: from half the smallest code up, round to that code.
    let u = u.max(i32::from(y >= M_HALF_MIN)) as u32;
    ((x.to_bits() >> 31 << 7) | u) as u8
}

/// Decodes one m code with the block's scale.
#[inline]
pub fn decode_m(code: u8, scale: f32) -> f32 {
    let u = u32::from(code & 0x7f);
    let magnitude = if u == 0 {
        0
    } else {
        (u << M_SHIFT) + (EXP_BIAS << 23)
    };
    f32::from_bits((u32::from(code >> 7) << 31) | magnitude) * scale
}

/// Encodes one sqrt(v) value (non-negative), `inv_scale` being the block's inverse
/// scale. Rounds to nearest (ties up); never gives code 0, so values below the smallest
/// code are rounded up to it.
#[inline]
pub fn encode_r(x: f32, inv_scale: f32) -> u8 {
    let y = x * inv_scale;
    // Wrapping, as in `encode_m`.
    let rounded = y.to_bits().wrapping_add(1 << (R_SHIFT - 1)) >> R_SHIFT;
    (rounded as i32 - (EXP_BIAS << 4) as i32).clamp(1, 255) as u8
}

/// Decodes one sqrt(v) code with the block's scale.
#[inline]
pub fn decode_r(code: u8, scale: f32) -> f32 {
    let c = u32::from(code);
    let value = if c == 0 {
        0.0
    } else {
        f32::from_bits((c << R_SHIFT) + (EXP_BIAS << 23))
    };
    value * scale
}

/// How many scales a state of `len` values has.
pub fn scale_count(len: usize) -> usize {
    len.div_ceil(BLOCK)
}

/// Quantizes f32 m values into codes and one scale per block.
///
/// Panics unless `codes` has `m.len()` entries and `scales` [`scale_count`]`(m.len())`.
pub fn quantize_m(m: &[f32], codes: &mut [u8], scales: &mut [f32]) {
    check_lengths(m.len(), codes.len(), scales.len());
    for ((m, codes), scale) in m
        .chunks(BLOCK)
        .zip(codes.chunks_mut(BLOCK))
        .zip(scales.iter_mut())
    {
        let absmax = m.iter().fold(0.0f32, |a, x| a.max(x.abs()));
        let (s, inv) = m_scales(absmax);
        *scale = s;
        for (code, &x) in codes.iter_mut().zip(m) {
            *code = encode_m(x, inv);
        }
    }
}

/// Quantizes f32 v values (non-negative) into codes of sqrt(v) and one scale per block.
///
/// Panics unless `codes` has `v.len()` entries and `scales` [`scale_count`]`(v.len())`.
pub fn quantize_v(v: &[f32], codes: &mut [u8], scales: &mut [f32]) {
    check_lengths(v.len(), codes.len(), scales.len());
    for ((v, codes), scale) in v
        .chunks(BLOCK)
        .zip(codes.chunks_mut(BLOCK))
        .zip(scales.iter_mut())
    {
        let max = v.iter().fold(0.0f32, |a, &x| a.max(x.sqrt()));
        let (s, inv) = r_scales(max);
        *scale = s;
        for (code, &x) in codes.iter_mut().zip(v) {
            *code = encode_r(x.sqrt(), inv);
        }
    }
}

/// Decodes m codes into f32 values.
///
/// Panics unless `codes` has `m.len()` entries and `scales` [`scale_count`]`(m.len())`.
pub fn dequantize_m(codes: &[u8], scales: &[f32], m: &mut [f32]) {
    check_lengths(m.len(), codes.len(), scales.len());
    for ((m, codes), &scale) in m.chunks_mut(BLOCK).zip(codes.chunks(BLOCK)).zip(scales) {
        for (x, &code) in m.iter_mut().zip(codes) {
            *x = decode_m(code, scale);
        }
    }
}

/// Decodes sqrt(v) codes into f32 values of v.
///
/// Panics unless `codes` has `v.len()` entries and `scales` [`scale_count`]`(v.len())`.
pub fn dequantize_v(codes: &[u8], scales: &[f32], v: &mut [f32]) {
    check_lengths(v.len(), codes.len(), scales.len());
    for ((v, codes), &scale) in v.chunks_mut(BLOCK).zip(codes.chunks(BLOCK)).zip(scales) {
        for (x, &code) in v.iter_mut().zip(codes) {
            let r = decode_r(code, scale);
            *x = r * r;
        }
    }
}

fn check_lengths(values: usize, codes: usize, scales: usize) {
    assert_eq!(codes, values, "need one code per value");
    assert_eq!(
        scales,
        scale_count(values),
        "need one scale per block of {BLOCK} values"
    );
}

/// Checks of a SIMD kernel's encoders and decoders against this file's scalar
/// definition, shared by every instruction set's tests.
#[cfg(test)]
pub(crate) mod simd_check {
    use super::*;

    /// `encode(x, inv)` gives the m and sqrt(v) codes of `lanes` values at once: they
    /// must agree with [`encode_m`] and [`encode_r`] on every f32, here a sweep over all
    /// bit patterns (both signs, zeros, subnormals, infinities, NaNs with any payload)
    /// and every pattern near each code's rounding edge, with inverse scales that give
    /// the negative default NaN (0 times infinity).
    pub(crate) fn encoders(
        lanes: usize,
        mut encode: impl FnMut(&[f32], f32) -> (Vec<u8>, Vec<u8>),
    ) {
        let edges = (0..=255u32).flat_map(|c| {
            let bits = (c << R_SHIFT) + (EXP_BIAS << 23);
            [bits, bits + (1 << (R_SHIFT - 1)), M_HALF_MIN.to_bits()]
        });
        let near = edges.flat_map(|b| (b - 2..=b + 2).flat_map(|b| [b, b | 0x8000_0000]));
        let sweep = (0..=u32::MAX).step_by(4099).chain(0xfff7_fff0..=u32::MAX);
        let bits: Vec<u32> = sweep.chain(near).collect();
        for inv in [1.0, 0.3, 0.0, f32::NAN, 1e30] {
            for chunk in bits.chunks(lanes) {
                let mut x = vec![0f32; lanes];
                for (x, &b) in x.iter_mut().zip(chunk) {
                    *x = f32::from_bits(b);
                }
                let (m, r) = encode(&x, inv);
                for (i, x) in x.iter().enumerate() {
                    if x.is_nan() && inv.is_nan() {
                        // NaN times NaN is either NaN, by the compiler's choice of
                        // operand order, in the SIMD code as in the scalar code.
                        continue;
                    }
                    assert_eq!(m[i], encode_m(*x, inv), "m {:#x} inv {inv}", x.to_bits());
                    assert_eq!(r[i], encode_r(*x, inv), "r {:#x} inv {inv}", x.to_bits());
                }
            }
        }
    }

    /// `decode(codes, scale)` gives the m and sqrt(v) values of `lanes` codes at once:
    /// they must be [`decode_m`]'s and [`decode_r`]'s bits on every code, with special
    /// scales.
    pub(crate) fn decoders(
        lanes: usize,
        mut decode: impl FnMut(&[u8], f32) -> (Vec<f32>, Vec<f32>),
    ) {
        for scale in [1.0, 0.3, 0.0, f32::NAN, f32::INFINITY, 1e-39] {
            for first in (0..=255u8).step_by(lanes) {
                let codes: Vec<u8> = (0..lanes).map(|i| first + i as u8).collect();
                let (m, r) = decode(&codes, scale);
                for (i, &code) in codes.iter().enumerate() {
                    let (want_m, want_r) = (decode_m(code, scale), decode_r(code, scale));
                    assert_eq!(m[i].to_bits(), want_m.to_bits(), "m {code} scale {scale}");
                    assert_eq!(r[i].to_bits(), want_r.to_bits(), "r {code} scale {scale}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_m_code_round_trips() {
        for code in 0..=255u8 {
            let x = decode_m(code, 1.0);
            let back = encode_m(x, 1.0);
            // Magnitude code 0 is zero, whatever its sign bit.
            if code & 0x7f == 0 {
                assert_eq!(x, 0.0);
                assert_eq!(back & 0x7f, 0);
            } else {
                assert_eq!(back, code, "code {code:#04x} decodes to {x}");
            }
        }
        assert_eq!(decode_m(0x7f, 1.0), M_TOP);
        assert_eq!(decode_m(0x01, 1.0), 2f32.powi(-15) * 1.125);
    }

    #[test]
    fn a_block_of_subnormal_magnitudes_is_stored_as_zeros_not_as_its_top_code() {
        let block = [1e-39f32, 0.0, -5e-40, 3e-40];
        let absmax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
        let (scale, inverse) = m_scales(absmax);
        assert!(scale.is_finite() && inverse.is_finite());
        for x in block {
            let back = decode_m(encode_m(x, inverse), scale);
            assert!(back.abs() <= x.abs(), "{x} came back as {back}");
        }
        let (scale, inverse) = r_scales(1e-39);
        assert_eq!(decode_r(encode_r(1e-39, inverse), scale), 0.0);
        // Just above the threshold, the block keeps its values.
        let (scale, inverse) = m_scales(1e-37);
        assert!(inverse.is_finite() && scale > 0.0);
        let back = decode_m(encode_m(1e-37, inverse), scale);
        assert!((back - 1e-37).abs() < 1e-38, "{back}");
    }

    #[test]
    fn every_r_code_round_trips_and_nothing_rounds_to_zero() {
        for code in 1..=255u8 {
            let x = decode_r(code, 1.0);
            assert_eq!(encode_r(x, 1.0), code, "code {code} decodes to {x}");
        }
        assert_eq!(decode_r(255, 1.0), R_TOP);
        assert_eq!(decode_r(0, 1.0), 0.0);
        assert_eq!(encode_r(0.0, 1.0), 1);
        assert_eq!(encode_r(1e-30, 1.0), 1);
        assert_eq!(encode_r(f32::from_bits(1), 1.0), 1);
    }

    #[test]
    fn encoding_rounds_to_the_nearest_code() {
        // Exhaustive over a range of mantissas in two octaves: the chosen code is the
        // nearest in value (ties may go either way by at most the tie itself).
        let m_values: Vec<f32> = (1..=127u8).map(|c| decode_m(c, 1.0)).collect();
        let r_values: Vec<f32> = (1..=255u8).map(|c| decode_r(c, 1.0)).collect();
        let mut x = 2f32.powi(-16);
        while x < 1.9 {
            let m = decode_m(encode_m(x, 1.0), 1.0);
            let best = m_values
                .iter()
                .chain([&0.0])
                .fold(f32::INFINITY, |b, &c| b.min((c - x).abs()));
            assert!((m - x).abs() <= best * (1.0 + 1e-6), "m {x} -> {m}");
            let r = decode_r(encode_r(x, 1.0), 1.0);
            let best = r_values
                .iter()
                .fold(f32::INFINITY, |b, &c| b.min((c - x).abs()));
            assert!((r - x).abs() <= best * (1.0 + 1e-6), "r {x} -> {r}");
            x *= 1.0007;
        }
    }

    #[test]
    fn negative_m_keeps_its_sign_and_relative_error_is_bounded() {
        let (scale, inv) = m_scales(3.0);
        for i in 1..1000 {
            let x = -3.0 * (i as f32 / 1000.0);
            let y = decode_m(encode_m(x, inv), scale);
            assert!(y <= 0.0);
            // E4M3: half a mantissa step of 1/8 at the bottom of an octave.
            assert!((y - x).abs() <= x.abs() / 16.0 * 1.0001, "{x} -> {y}");
        }
        // The block's largest magnitude is kept to within a rounding.
        let y = decode_m(encode_m(-3.0, inv), scale);
        assert!((y + 3.0).abs() <= 3.0 * 1e-6);
    }

    /// What a checkpoint does to 8-bit moments: decode them to f32 (v as sqrt(v)
    /// squared) and quantize those again. The codes and scales come back bit for bit,
    /// so a resumed run continues the same run: the largest element of a block decodes
    /// to the top code's value times the scale, and `scales` divides that by the top
    /// code's value back to the same scale (checked here over many magnitudes); every
    /// other decoded value lies within a few ulps of its code's value, far inside its
    /// rounding interval; and sqrt of a square is exact in binary floating point while
    /// the square is a normal number. Where a block's largest sqrt(v) is below about
    /// 2^-58 (3.5e-18), its smallest codes square to subnormal f32 values, which lose
    /// bits: those blocks are not promised (tested here from 2^-58 up).
    #[test]
    fn decoded_blocks_quantize_back_to_the_same_codes_and_scales() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut uniform = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32
        };
        let n = 4000 * BLOCK;
        let mut m = vec![0f32; n];
        let mut v = vec![0f32; n];
        for (b, (mb, vb)) in m.chunks_mut(BLOCK).zip(v.chunks_mut(BLOCK)).enumerate() {
            // Each block its own magnitude: m from 2^-60 to 2^20, sqrt(v) from 2^-58 to
            // 2^20; some elements zero, a few blocks all zero.
            let (me, re) = ((b % 81) as i32 - 60, (b % 79) as i32 - 58);
            for (x, y) in mb.iter_mut().zip(vb.iter_mut()) {
                let (u, w, z) = (uniform(), uniform(), uniform());
                let sign = if u < 0.5 { -1.0 } else { 1.0 };
                let keep = b % 97 != 0 && z > 0.05;
                *x = if keep { sign * w * 2f32.powi(me) } else { 0.0 };
                let r = (0.001 + u) * 2f32.powi(re);
                *y = if keep { r * r } else { 0.0 };
            }
        }
        let round_trip = |values: &[f32],
                          quantize: fn(&[f32], &mut [u8], &mut [f32]),
                          dequantize: fn(&[u8], &[f32], &mut [f32])| {
            let mut codes = vec![0u8; n];
            let mut scales = vec![0f32; scale_count(n)];
            quantize(values, &mut codes, &mut scales);
            let mut decoded = vec![0f32; n];
            dequantize(&codes, &scales, &mut decoded);
            let mut again = (vec![0u8; n], vec![0f32; scale_count(n)]);
            quantize(&decoded, &mut again.0, &mut again.1);
            let first = (0..n).find(|&i| codes[i] != again.0[i]);
            assert_eq!(
                first.map(|i| (i, values[i], decoded[i])),
                None,
                "a code changed"
            );
            let first = (0..scales.len()).find(|&i| scales[i].to_bits() != again.1[i].to_bits());
            assert_eq!(
                first,
                None,
                "a scale changed: {:?}",
                first.map(|i| (scales[i], again.1[i]))
            );
        };
        round_trip(&m, quantize_m, dequantize_m);
        round_trip(&v, quantize_v, dequantize_v);
    }

    #[test]
    fn slices_round_trip_per_block() {
        let n = 3 * BLOCK + 5;
        let m: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1001) as f32 / 1000.0 - 0.5)
            .collect();
        let v: Vec<f32> = (0..n)
            .map(|i| (((i * 104729) % 997) as f32 / 997.0).powi(4))
            .collect();
        let mut codes = vec![0u8; n];
        let mut scales = vec![0f32; scale_count(n)];
        let mut back = vec![0f32; n];
        quantize_m(&m, &mut codes, &mut scales);
        dequantize_m(&codes, &scales, &mut back);
        for (a, b) in m.iter().zip(&back) {
            assert!(
                (a - b).abs() <= a.abs() / 16.0 + 0.5 * 2f32.powi(-15),
                "{a} {b}"
            );
        }
        quantize_v(&v, &mut codes, &mut scales);
        dequantize_v(&codes, &scales, &mut back);
        for (a, b) in v.iter().zip(&back) {
            // sqrt(v) within 1/32 relative, so v within about 1/16, or in the lowest code.
            let floor = (scales.iter().fold(0f32, |x, &s| x.max(s)) * 2f32.powi(-14)).powi(2);
            assert!((a - b).abs() <= a * 0.0635 + floor, "{a} {b}");
        }
    }
}
