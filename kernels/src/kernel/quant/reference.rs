//! The scalar reference of the quantised formats (`super`): dequantisation element by
//! element, straight from the format's definition (`super::format`), and quantisation by
//! an exhaustive search for the nearest level (exact, in f64), against which the
//! dequantising kernels and the quantisers are tested. Nothing here is tuned.

use super::format::{
    ABSMAX_GROUP, DYNAMIC_MAP, INT8_BLOCK, NF4_BLOCK, NF4_CODE, NF4_ZERO_CODE, absmax_value,
    int8_value, nf4_value,
};

/// The index of the entry of `code` (ascending) nearest `x`, distances exact in f64; on
/// a tie, the lower index.
pub fn nearest(code: &[f32], x: f32) -> u8 {
    let distance = |c: f32| (f64::from(x) - f64::from(c)).abs();
    let mut best = 0;
    for (i, &c) in code.iter().enumerate() {
        if distance(c) < distance(code[best]) {
            best = i;
        }
    }
    best as u8
}

/// The NF4 code of element `i` of the packed `codes`: the high nibble for even `i`.
pub fn nf4_code_at(codes: &[u8], i: usize) -> u8 {
    let byte = codes[i / 2];
    if i.is_multiple_of(2) {
        byte >> 4
    } else {
        byte & 0x0f
    }
}

/// out: (N) = the NF4 tensor's values: element `i` is its code's level times the
/// dequantised absmax of its block `i / 64`, whose code is scaled by group `i / 64 / 256`.
pub fn dequantize_nf4(
    out: &mut [f32],
    codes: &[u8],
    absmax_q: &[u8],
    absmax_scale: &[f32],
    absmax_offset: f32,
) {
    for (i, o) in out.iter_mut().enumerate() {
        let block = i / NF4_BLOCK;
        let absmax = absmax_value(
            absmax_q[block],
            absmax_scale[block / ABSMAX_GROUP],
            absmax_offset,
        );
        *o = nf4_value(nf4_code_at(codes, i), absmax);
    }
}

/// The NF4 codes of `x` given each block's absmax (exact, not double-quantised), packed
/// two per byte, the first element high, an odd length's last nibble 7: each the nearest
/// level to `x / absmax`, found by [`nearest`] (a zero block gives level 0.0).
pub fn quantize_nf4_codes(x: &[f32]) -> Vec<u8> {
    let mut codes = vec![NF4_ZERO_CODE << 4 | NF4_ZERO_CODE; x.len().div_ceil(2)];
    for (b, block) in x.chunks(NF4_BLOCK).enumerate() {
        let absmax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (k, &v) in block.iter().enumerate() {
            let code = if absmax == 0.0 {
                NF4_ZERO_CODE
            } else {
                nearest(&NF4_CODE, v / absmax)
            };
            let i = b * NF4_BLOCK + k;
            let byte = &mut codes[i / 2];
            *byte = if i.is_multiple_of(2) {
                code << 4 | (*byte & 0x0f)
            } else {
                (*byte & 0xf0) | code
            };
        }
    }
    codes
}

/// The dynamic-map code nearest `deviation / scale` (the absmax quantisation's).
pub fn absmax_code(deviation: f32, scale: f32) -> u8 {
    nearest(&DYNAMIC_MAP, deviation / scale)
}

/// out: (N) = the int8 tensor's values: element `i` is its code times block `i / 64`'s
/// scale.
pub fn dequantize_int8(out: &mut [f32], codes: &[u8], scales: &[f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        *o = int8_value(codes[i], scales[i / INT8_BLOCK]);
    }
}
