//! Scalar reference casts between f32, bf16 and fp16, element by element.
//!
//! bf16 is written out with bit operations (round to nearest, ties to even; NaN stays a
//! quiet NaN of the same sign). fp16 uses the `half` crate's conversions, whose scalar
//! path is the software definition of IEEE binary16 rounding.

use half::{bf16, f16};

/// Rounds one f32 to bf16 (nearest, ties to even).
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        // Keep sign and the top of the payload, and force the quiet bit so the result
        // cannot become infinity.
        return ((bits >> 16) as u16) | 0x0040;
    }
    let lsb = (bits >> 16) & 1;
    (bits.wrapping_add(0x7fff + lsb) >> 16) as u16
}

/// Widens one bf16 (given as bits) to f32: exact.
pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// out: (N)  inp: (N).
pub fn f32_to_bf16(out: &mut [bf16], inp: &[f32]) {
    assert_eq!(out.len(), inp.len());
    for (o, &x) in out.iter_mut().zip(inp) {
        *o = bf16::from_bits(f32_to_bf16_bits(x));
    }
}

/// out: (N)  inp: (N).
pub fn bf16_to_f32(out: &mut [f32], inp: &[bf16]) {
    assert_eq!(out.len(), inp.len());
    for (o, &x) in out.iter_mut().zip(inp) {
        *o = bf16_bits_to_f32(x.to_bits());
    }
}

/// out: (N)  inp: (N).  Round to nearest, ties to even; overflow to infinity.
pub fn f32_to_f16(out: &mut [f16], inp: &[f32]) {
    assert_eq!(out.len(), inp.len());
    for (o, &x) in out.iter_mut().zip(inp) {
        *o = f16::from_f32(x);
    }
}

/// out: (N)  inp: (N).  Exact.
pub fn f16_to_f32(out: &mut [f32], inp: &[f16]) {
    assert_eq!(out.len(), inp.len());
    for (o, &x) in out.iter_mut().zip(inp) {
        *o = x.to_f32();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_bits_agree_with_half_crate() {
        let specials = [
            0.0f32,
            -0.0,
            1.0,
            -1.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1.0 + f32::EPSILON,
            3.140625,
        ];
        let mut x = 0x1234_5678u32;
        let values = specials.into_iter().chain((0..100_000).map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            f32::from_bits(x)
        }));
        for v in values {
            let ours = f32_to_bf16_bits(v);
            let theirs = bf16::from_f32(v).to_bits();
            if v.is_nan() {
                assert!(bf16_bits_to_f32(ours).is_nan(), "{v:e}");
            } else {
                assert_eq!(ours, theirs, "{v:e}");
            }
        }
        // Ties go to even: 1 + 2^-8 is halfway between two bf16 values.
        assert_eq!(f32_to_bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(f32_to_bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
    }
}
