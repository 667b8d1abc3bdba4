//! The two block formats of a frozen base weight (`super`): their constants, codebooks,
//! the encoding of one value, and quantisation of a whole tensor on the CPU (done once,
//! at load). Dequantisation, the part that runs every step, is the family's kernels.
//!
//! **NF4 with double quantisation** (QLoRA, Dettmers et al. 2023, as bitsandbytes
//! stores it with `quant_type="nf4", blocksize=64, compress_statistics=True`):
//! - each block of [`NF4_BLOCK`] consecutive values keeps its largest magnitude, its
//!   absmax `a`, and each value `x` as the 4-bit index of the [`NF4_CODE`] level nearest
//!   `x / a`: two codes per byte, **the first element in the high nibble** (element `2k`
//!   in bits 7..4 of byte `k`, element `2k + 1` in bits 3..0; an odd length pads the last
//!   low nibble with code 7, the level 0.0);
//! - the absmaxes are themselves quantised (the "double quantisation"): their mean, the
//!   offset, is subtracted, and each group of [`ABSMAX_GROUP`] of them keeps its largest
//!   magnitude `s` (f32) and each `a - offset` as the 8-bit index of the
//!   [`DYNAMIC_MAP`] entry nearest `(a - offset) / s`;
//! - storage: 4 bits per value + 8 bits per 64 values + 32 bits per 64 × 256 values =
//!   4 + 0.125 + 0.00195 ≈ **4.127 bits per parameter**, plus one f32 offset per tensor
//!   ([`Nf4Blocks::storage_bytes`]).
//!
//! Dequantisation is exact and defined by its order of f32 operations, two roundings then
//! one (bitsandbytes' order; no fused multiply-add anywhere):
//! `absmax = DYNAMIC_MAP[q] * s + offset` (the product rounded, then the sum), then
//! `value = NF4_CODE[c] * absmax` ([`absmax_value`], [`nf4_value`]).
//!
//! Which code a scaled value gets (both levels): `scaled = x * (1 / a)` in f32 (`1 / a`
//! rounded first; a zero absmax counts as 1e-38, so its block becomes code 7), then the
//! number of codebook midpoints `(c[i] + c[i + 1]) / 2` (f32) strictly below `scaled`:
//! the nearest level, **a value exactly on a midpoint taking the lower one**. This is
//! bitsandbytes' portable ("default") backend, and its CPU path for the 4-bit codes; for
//! the absmax codes its CPU library searches differently (a table-driven binary search
//! that is not always nearest: 2 of 384 codes in the golden data differ from ours, each
//! farther from its value than ours; see `tests/data/nf4/README.md`).
//!
//! **int8** (the alternative): blocks of [`INT8_BLOCK`] values, one f32 scale
//! `s = absmax / 127` per block and each value as `round(x / s)` (ties away from zero) in
//! -127..=127, two's complement in a byte; dequantised as `code * s`. Storage 8 + 32/64 =
//! **8.5 bits per parameter**. Block 64 as NF4's: a larger block saves at most 0.5 bit
//! per parameter and lets one outlier coarsen more values.

/// Values per NF4 block (one absmax each).
pub const NF4_BLOCK: usize = 64;

/// NF4 absmaxes per group of the double quantisation (one f32 scale each).
pub const ABSMAX_GROUP: usize = 256;

/// Values per int8 block (one f32 scale each).
pub const INT8_BLOCK: usize = 64;

/// The NF4 code of the level 0.0, which pads an odd length's last byte.
pub const NF4_ZERO_CODE: u8 = 7;

/// The absmax code of the offset itself (the dynamic map's 0.0).
const DYNAMIC_ZERO_CODE: u8 = 127;

/// The 16 NF4 levels, ascending, exactly the float32 values bitsandbytes uses (the
/// literals of `get_4bit_type("nf4")` in `bitsandbytes/functional.py`, 0.50.2, and its
/// CUDA and CPU kernels' `dDequantizeNF4`), written as the published f64 digits of each
/// f32 value (so the cast is exact).
///
/// Their definition (`create_normal_map(offset=0.9677083, use_extra_value=True)`): with
/// Φ⁻¹ the standard normal quantile function, the 8 positive levels are Φ⁻¹(p) at
/// `p = linspace(0.9677083, 0.5, 9)` without its last point, the 7 negative ones
/// -Φ⁻¹(p) at `linspace(0.9677083, 0.5, 8)` without its last, plus 0; all divided by the
/// largest, Φ⁻¹(0.9677083) ≈ 1.848. So the code is asymmetric (one more positive level),
/// holds an exact zero, and its levels are equal-probability quantiles of N(0, 1): the
/// paper's information-theoretically motivated code for normally distributed weights.
/// The tests recompute them from this definition.
pub const NF4_CODE: [f32; 16] = [
    -1.0,
    -0.696_192_800_998_687_7_f64 as f32,
    -0.525_073_051_452_636_7_f64 as f32,
    -0.394_917_488_098_144_53_f64 as f32,
    -0.284_441_381_692_886_35_f64 as f32,
    -0.184_773_430_228_233_34_f64 as f32,
    -0.091_050_036_251_544_95_f64 as f32,
    0.0,
    0.079_580_299_556_255_34_f64 as f32,
    0.160_930_201_411_247_25_f64 as f32,
    0.246_112_301_945_686_34_f64 as f32,
    0.337_915_241_718_292_24_f64 as f32,
    0.440_709_829_330_444_34_f64 as f32,
    0.562_617_003_917_694_1_f64 as f32,
    0.722_956_836_223_602_3_f64 as f32,
    1.0,
];

/// The positive half of bitsandbytes' signed "dynamic" 8-bit map below 1.0, ascending:
/// `create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8)` in
/// `bitsandbytes/functional.py` (0.50.2), the map `quantize_blockwise` uses by default
/// and so the one of the nested absmax quantisation. Decade `i` (0..7) holds `2^i`
/// values, `10^(i - 6)` times the midpoints of `linspace(0.1, 1, 2^i + 1)`, computed in
/// float32 (the tests recompute them). Copied from the map bitsandbytes builds (the
/// golden data holds it whole and a test compares every bit).
const DYNAMIC_POSITIVE: [f32; 127] = [
    5.500_000_4e-7,
    3.250_000_2e-6,
    7.75e-6,
    2.124_999_8e-5,
    4.375e-5,
    6.625e-5,
    8.875e-5,
    0.000_156_250_01,
    0.000_268_750_04,
    0.000_381_250_02,
    0.000_493_750_03,
    0.000_606_250_1,
    0.000_718_750_06,
    0.000_831_25,
    0.000_943_750_1,
    0.001_281_249_9,
    0.001_843_75,
    0.002_406_25,
    0.002_968_75,
    0.003_531_249_7,
    0.004_093_75,
    0.004_656_249_7,
    0.005_218_750_3,
    0.005_781_25,
    0.006_343_75,
    0.006_906_25,
    0.007_468_75,
    0.008_031_25,
    0.008_593_75,
    0.009_156_249,
    0.009_718_75,
    0.011_406_25,
    0.014_218_75,
    0.017_031_25,
    0.019_843_752,
    0.022_656_25,
    0.025_468_75,
    0.028_281_251,
    0.031_093_75,
    0.033_906_25,
    0.036_718_752,
    0.039_531_25,
    0.042_343_747,
    0.045_156_25,
    0.047_968_75,
    0.050_781_25,
    0.053_593_75,
    0.056_406_25,
    0.059_218_753,
    0.062_031_25,
    0.064_843_75,
    0.067_656_256,
    0.070_468_746,
    0.073_281_25,
    0.076_093_75,
    0.078_906_25,
    0.081_718_76,
    0.084_531_25,
    0.087_343_75,
    0.090_156_25,
    0.092_968_754,
    0.095_781_26,
    0.098_593_75,
    0.107_031_256,
    0.121_093_75,
    0.135_156_24,
    0.149_218_75,
    0.163_281_25,
    0.177_343_76,
    0.191_406_25,
    0.205_468_74,
    0.219_531_25,
    0.233_593_75,
    0.247_656_24,
    0.261_718_75,
    0.275_781_27,
    0.289_843_74,
    0.303_906_26,
    0.317_968_73,
    0.332_031_25,
    0.346_093_74,
    0.360_156_24,
    0.374_218_76,
    0.388_281_23,
    0.402_343_75,
    0.416_406_24,
    0.430_468_74,
    0.444_531_26,
    0.458_593_73,
    0.472_656_25,
    0.486_718_7,
    0.500_781_24,
    0.514_843_7,
    0.528_906_2,
    0.542_968_75,
    0.557_031_3,
    0.571_093_8,
    0.585_156_26,
    0.599_218_7,
    0.613_281_25,
    0.627_343_8,
    0.641_406_3,
    0.655_468_76,
    0.669_531_2,
    0.683_593_75,
    0.697_656_3,
    0.711_718_8,
    0.725_781_26,
    0.739_843_7,
    0.753_906_25,
    0.767_968_8,
    0.782_031_24,
    0.796_093_76,
    0.810_156_2,
    0.824_218_75,
    0.838_281_3,
    0.852_343_74,
    0.866_406_26,
    0.880_468_7,
    0.894_531_25,
    0.908_593_8,
    0.922_656_24,
    0.936_718_76,
    0.950_781_2,
    0.964_843_75,
    0.978_906_3,
    0.992_968_74,
];

/// bitsandbytes' signed dynamic 8-bit map, ascending: the negated `DYNAMIC_POSITIVE`
/// values (codes 0..127, from -0.99296874 up), 0.0 (code 127), the positive ones (codes
/// 128..255) and 1.0 (code 255). Its most negative entry is -0.99296874, not -1: a
/// group's most negative deviation comes back 0.7% smaller in magnitude, as in
/// bitsandbytes.
pub const DYNAMIC_MAP: [f32; 256] = dynamic_map();

const fn dynamic_map() -> [f32; 256] {
    let mut map = [0.0f32; 256];
    let mut k = 0;
    while k < DYNAMIC_POSITIVE.len() {
        map[128 + k] = DYNAMIC_POSITIVE[k];
        map[126 - k] = -DYNAMIC_POSITIVE[k];
        k += 1;
    }
    map[255] = 1.0;
    map
}

/// Midpoints of a sorted codebook, each `(c[i] + c[i + 1]) / 2` in f32.
const fn midpoints<const N: usize, const M: usize>(code: &[f32; N]) -> [f32; M] {
    assert!(M + 1 == N);
    let mut out = [0.0f32; M];
    let mut i = 0;
    while i < M {
        out[i] = (code[i] + code[i + 1]) / 2.0;
        i += 1;
    }
    out
}

/// The 15 boundaries between NF4 levels.
pub const NF4_MIDPOINTS: [f32; 15] = midpoints(&NF4_CODE);

/// The 255 boundaries between dynamic-map entries.
pub const DYNAMIC_MIDPOINTS: [f32; 255] = midpoints(&DYNAMIC_MAP);

/// The code of `scaled` in the codebook whose midpoints are `midpoints`: how many of them
/// lie strictly below it (the nearest level; on a midpoint, the lower one).
#[inline]
pub fn code_of(scaled: f32, midpoints: &[f32]) -> u8 {
    midpoints.partition_point(|&m| m < scaled) as u8
}

/// What a block's values are multiplied by before coding: `1 / absmax`, a zero (or
/// subnormal) absmax counting as 1e-38, as bitsandbytes clamps it.
#[inline]
pub fn inverse_absmax(absmax: f32) -> f32 {
    1.0 / absmax.max(1e-38)
}

/// The absmax of a block whose code is `q` in a group scaled by `scale`, in a tensor
/// whose absmaxes' mean is `offset`: `DYNAMIC_MAP[q] * scale + offset`, two roundings.
#[inline(always)]
pub fn absmax_value(q: u8, scale: f32, offset: f32) -> f32 {
    DYNAMIC_MAP[q as usize] * scale + offset
}

/// One dequantised NF4 value: `NF4_CODE[code] * absmax`.
#[inline(always)]
pub fn nf4_value(code: u8, absmax: f32) -> f32 {
    NF4_CODE[code as usize] * absmax
}

/// The largest magnitude of `x` (0 for an empty slice; NaN if `x` holds one).
fn absmax_of(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| {
        if v.is_nan() || m.is_nan() {
            f32::NAN
        } else {
            m.max(v.abs())
        }
    })
}

/// A tensor in NF4 with double-quantised absmaxes (layout in the module's documentation).
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4Blocks {
    /// Values.
    pub len: usize,
    /// `len.div_ceil(2)` bytes, two 4-bit codes each, the first element high.
    pub codes: Vec<u8>,
    /// One 8-bit code per block of [`NF4_BLOCK`] values: its absmax minus the offset.
    pub absmax_q: Vec<u8>,
    /// One f32 scale per [`ABSMAX_GROUP`] blocks: the largest `|absmax - offset|`.
    pub absmax_scale: Vec<f32>,
    /// The mean of the blocks' absmaxes.
    pub absmax_offset: f32,
}

/// Borrowed parts of an NF4 tensor, as the dequantisers take them.
#[derive(Debug, Clone, Copy)]
pub struct Nf4Parts<'a> {
    /// Packed codes, `len.div_ceil(2)` bytes.
    pub codes: &'a [u8],
    /// One absmax code per block.
    pub absmax_q: &'a [u8],
    /// One scale per group of absmaxes.
    pub absmax_scale: &'a [f32],
    /// The absmaxes' mean.
    pub absmax_offset: f32,
}

impl Nf4Blocks {
    /// Blocks of a tensor of `len` values.
    pub const fn block_count(len: usize) -> usize {
        len.div_ceil(NF4_BLOCK)
    }

    /// Absmax groups of a tensor of `len` values.
    pub const fn group_count(len: usize) -> usize {
        Self::block_count(len).div_ceil(ABSMAX_GROUP)
    }

    /// Bytes a tensor of `len` values takes: codes, absmax codes, scales and the offset.
    pub const fn storage_bytes(len: usize) -> usize {
        len.div_ceil(2) + Self::block_count(len) + 4 * Self::group_count(len) + 4
    }

    /// `x` quantised: its blocks' absmaxes, their codes, then the absmaxes' double
    /// quantisation (offset their mean, as f64 rounded to f32). A NaN makes its block's
    /// absmax, and so the offset and every value, NaN: the tensor is visibly lost rather
    /// than quietly coded.
    pub fn quantize(x: &[f32]) -> Nf4Blocks {
        let absmax: Vec<f32> = x.chunks(NF4_BLOCK).map(absmax_of).collect();
        let offset = mean(&absmax);
        Nf4Blocks::quantize_with_offset(x, offset)
    }

    /// As [`Nf4Blocks::quantize`] with a given offset (bitsandbytes takes its float32
    /// `mean()`, whose summation order may differ from ours in the last bit).
    pub fn quantize_with_offset(x: &[f32], absmax_offset: f32) -> Nf4Blocks {
        let mut codes = vec![NF4_ZERO_CODE << 4 | NF4_ZERO_CODE; x.len().div_ceil(2)];
        let mut absmax = Vec::with_capacity(Self::block_count(x.len()));
        for (b, block) in x.chunks(NF4_BLOCK).enumerate() {
            let a = absmax_of(block);
            absmax.push(a);
            let inverse = inverse_absmax(a);
            let bytes = &mut codes[b * NF4_BLOCK / 2..];
            for (k, &v) in block.iter().enumerate() {
                let code = code_of((v * inverse).clamp(-1.0, 1.0), &NF4_MIDPOINTS);
                let byte = &mut bytes[k / 2];
                *byte = if k.is_multiple_of(2) {
                    code << 4 | (*byte & 0x0f)
                } else {
                    (*byte & 0xf0) | code
                };
            }
        }
        let (absmax_q, absmax_scale) = quantize_absmax(&absmax, absmax_offset);
        Nf4Blocks {
            len: x.len(),
            codes,
            absmax_q,
            absmax_scale,
            absmax_offset,
        }
    }

    /// The parts the dequantisers read.
    pub fn parts(&self) -> Nf4Parts<'_> {
        Nf4Parts {
            codes: &self.codes,
            absmax_q: &self.absmax_q,
            absmax_scale: &self.absmax_scale,
            absmax_offset: self.absmax_offset,
        }
    }
}

/// The mean of `values` (f64 sum, rounded to f32 once); 0 for none.
fn mean(values: &[f32]) -> f32 {
    if values.is_empty() {
        return 0.0;
    }
    let sum: f64 = values.iter().map(|&v| f64::from(v)).sum();
    (sum / values.len() as f64) as f32
}

/// The double quantisation of blocks' absmaxes: each `absmax - offset` (f32) as its
/// dynamic-map code, per group of [`ABSMAX_GROUP`] scaled by the group's largest
/// magnitude (a group of zeros has scale 0 and codes of 0.0). Returns (codes, scales).
pub fn quantize_absmax(absmax: &[f32], offset: f32) -> (Vec<u8>, Vec<f32>) {
    let mut codes = Vec::with_capacity(absmax.len());
    let mut scales = Vec::with_capacity(absmax.len().div_ceil(ABSMAX_GROUP));
    for group in absmax.chunks(ABSMAX_GROUP) {
        let centred: Vec<f32> = group.iter().map(|&a| a - offset).collect();
        let scale = absmax_of(&centred);
        scales.push(scale);
        if scale == 0.0 {
            codes.extend(centred.iter().map(|_| DYNAMIC_ZERO_CODE));
            continue;
        }
        let inverse = inverse_absmax(scale);
        codes.extend(
            centred
                .iter()
                .map(|&d| code_of((d * inverse).clamp(-1.0, 1.0), &DYNAMIC_MIDPOINTS)),
        );
    }
    (codes, scales)
}

/// A tensor in blockwise int8 (layout in the module's documentation).
#[derive(Debug, Clone, PartialEq)]
pub struct Int8Blocks {
    /// One byte per value: its code, two's complement, -127..=127.
    pub codes: Vec<u8>,
    /// One f32 scale per block of [`INT8_BLOCK`] values: its absmax / 127.
    pub scales: Vec<f32>,
}

impl Int8Blocks {
    /// Bytes a tensor of `len` values takes: codes and scales.
    pub const fn storage_bytes(len: usize) -> usize {
        len + 4 * len.div_ceil(INT8_BLOCK)
    }

    /// `x` quantised.
    pub fn quantize(x: &[f32]) -> Int8Blocks {
        let mut codes = Vec::with_capacity(x.len());
        let mut scales = Vec::with_capacity(x.len().div_ceil(INT8_BLOCK));
        for block in x.chunks(INT8_BLOCK) {
            let scale = absmax_of(block) / 127.0;
            scales.push(scale);
            codes.extend(block.iter().map(|&v| int8_code(v, scale) as u8));
        }
        Int8Blocks { codes, scales }
    }
}

/// The int8 code of `x` in a block of scale `scale`: `round(x / scale)` (ties away from
/// zero) clamped to -127..=127; 0 when the scale is 0.
#[inline]
pub fn int8_code(x: f32, scale: f32) -> i8 {
    if scale == 0.0 {
        return 0;
    }
    (x / scale).round().clamp(-127.0, 127.0) as i8
}

/// One dequantised int8 value: `code * scale`.
#[inline(always)]
pub fn int8_value(code: u8, scale: f32) -> f32 {
    f32::from(code as i8) * scale
}
