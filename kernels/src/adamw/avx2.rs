//! The AVX2 + FMA + F16C AdamW kernels: 8 lanes of f32, packed square root and division
//! (`vsqrtps` / `vdivps`, far faster per element than scalar ones, which make a plain loop
//! compute-bound), and F16C conversions for fp16 gradients and working copies.
//!
//! Each loop handles whole vectors; the last partial vector is staged through stack
//! arrays padded with zeros, so there is no scalar tail with different rounding. The
//! 8-bit state kernel works block by block like the portable one, with the format's
//! integer encoding done in vector registers (same operations as [`q8`]'s scalar code).

use std::arch::x86_64::*;

use super::dispatch::{Kernels, Lane, LaneKind, Moment, Q8Block};
use super::portable::pairwise;
use super::{AdamStep, GradStats, q8};

const LANES: usize = 8;

pub(super) struct Avx2;

impl Kernels for Avx2 {
    const LANES: usize = LANES;

    unsafe fn vectors<S: Moment, G: Lane, O: Lane>(
        k: &AdamStep,
        p: &mut [f32],
        m: &mut [S],
        v: &mut [S],
        g: &[G],
        out: &mut [O],
    ) {
        // SAFETY: the caller guarantees the CPU has AVX2, FMA and F16C.
        unsafe { vectors(k, p, m, v, g, out) }
    }

    unsafe fn q8_block<G: Lane, O: Lane>(k: &AdamStep, block: Q8Block<'_, G, O>) {
        // SAFETY: as above.
        unsafe { q8_block(k, block) }
    }

    unsafe fn sum_squares<G: Lane>(g: &[G], scale: f32) -> GradStats {
        // SAFETY: as above.
        unsafe { sum_squares(g, scale) }
    }
}

/// The step's constants, broadcast once.
#[derive(Clone, Copy)]
struct Consts {
    grad_scale: __m256,
    decay: __m256,
    beta1: __m256,
    beta2: __m256,
    one_minus_beta1: __m256,
    one_minus_beta2: __m256,
    neg_step_size: __m256,
    inv_bias_correction2_sqrt: __m256,
    eps: __m256,
}

impl Consts {
    #[target_feature(enable = "avx2,fma,f16c")]
    fn new(k: &AdamStep) -> Self {
        Self {
            grad_scale: _mm256_set1_ps(k.grad_scale),
            decay: _mm256_set1_ps(k.decay),
            beta1: _mm256_set1_ps(k.beta1),
            beta2: _mm256_set1_ps(k.beta2),
            one_minus_beta1: _mm256_set1_ps(k.one_minus_beta1),
            one_minus_beta2: _mm256_set1_ps(k.one_minus_beta2),
            neg_step_size: _mm256_set1_ps(-k.step_size),
            inv_bias_correction2_sqrt: _mm256_set1_ps(k.inv_bias_correction2_sqrt),
            eps: _mm256_set1_ps(k.eps),
        }
    }
}

/// Eight gradients or moments as f32 (exactly: every fp16 and bf16 value is an f32).
///
/// # Safety
/// `g` is valid for 8 reads.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_lanes<G: Lane>(g: *const G) -> __m256 {
    // SAFETY: the caller guarantees 8 readable elements; loads are unaligned.
    unsafe {
        match G::KIND {
            LaneKind::F32 => _mm256_loadu_ps(g.cast()),
            LaneKind::F16 => _mm256_cvtph_ps(_mm_loadu_si128(g.cast())),
            LaneKind::Bf16 => {
                let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(g.cast()));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
            }
            LaneKind::Absent => unreachable!("gradients and moments always have a dtype"),
        }
    }
}

/// Writes eight values as `O` (the working copy or bf16 moments), rounded to
/// nearest even.
///
/// # Safety
/// Unless `O` is `NoCopy`, `out` is valid for 8 writes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_lanes<O: Lane>(out: *mut O, x: __m256) {
    // SAFETY: the caller guarantees 8 writable elements when anything is written.
    unsafe {
        match O::KIND {
            LaneKind::Absent => {}
            LaneKind::F16 => {
                _mm_storeu_si128(out.cast(), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x))
            }
            LaneKind::Bf16 => _mm_storeu_si128(out.cast(), to_bf16(x)),
            LaneKind::F32 => _mm256_storeu_ps(out.cast(), x),
        }
    }
}

/// f32 to bf16 with round to nearest even; NaN stays NaN (quiet, sign and top payload
/// kept), as `half::bf16::from_f32` does.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn to_bf16(x: __m256) -> __m128i {
    let bits = _mm256_castps_si256(x);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
    let bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(bits, bias));
    let quiet = _mm256_or_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(0x40));
    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
    let halves = _mm256_blendv_epi8(rounded, quiet, nan);
    // Every lane is below 2^16, so unsigned saturation packs without changing any.
    _mm_packus_epi32(
        _mm256_castsi256_si128(halves),
        _mm256_extracti128_si256::<1>(halves),
    )
}

/// The AdamW arithmetic on eight elements: returns (p, m, v, sqrt(v)).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn update(c: &Consts, p: __m256, m: __m256, v: __m256, g: __m256) -> [__m256; 4] {
    let [m, v, r] = moments(c, m, v, g);
    [param(c, p, m, r), m, v, r]
}

/// The moments' half of [`update`]: returns (m, v, sqrt(v)).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn moments(c: &Consts, m: __m256, v: __m256, g: __m256) -> [__m256; 3] {
    let g = _mm256_mul_ps(g, c.grad_scale);
    let m = _mm256_fmadd_ps(c.beta1, m, _mm256_mul_ps(c.one_minus_beta1, g));
    let g2 = _mm256_mul_ps(_mm256_mul_ps(c.one_minus_beta2, g), g);
    let v = _mm256_fmadd_ps(c.beta2, v, g2);
    [m, v, _mm256_sqrt_ps(v)]
}

/// The parameter's half of [`update`], from the new m and sqrt(v).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn param(c: &Consts, p: __m256, m: __m256, r: __m256) -> __m256 {
    let denom = _mm256_fmadd_ps(r, c.inv_bias_correction2_sqrt, c.eps);
    _mm256_fmadd_ps(
        c.neg_step_size,
        _mm256_div_ps(m, denom),
        _mm256_mul_ps(p, c.decay),
    )
}

/// AdamW over equal-length slices of whole vectors, with fp32 or bf16 moments (`S`:
/// read exactly, written rounded to nearest even, as a bf16 working copy is).
#[target_feature(enable = "avx2,fma,f16c")]
fn vectors<S: Moment, G: Lane, O: Lane>(
    k: &AdamStep,
    p: &mut [f32],
    m: &mut [S],
    v: &mut [S],
    g: &[G],
    out: &mut [O],
) {
    let n = p.len();
    assert!(m.len() == n && v.len() == n && g.len() == n && out.len() == n);
    assert_eq!(n % LANES, 0, "whole vectors only");
    let c = Consts::new(k);
    let (p, m, v) = (p.as_mut_ptr(), m.as_mut_ptr(), v.as_mut_ptr());
    let (g, out) = (g.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    while i < n {
        // SAFETY: i + 8 <= n and every slice has n elements (a `NoCopy` slice is
        // zero-sized and nothing is written through it).
        unsafe {
            let [pn, mn, vn, _] = update(
                &c,
                _mm256_loadu_ps(p.add(i)),
                load_lanes(m.add(i)),
                load_lanes(v.add(i)),
                load_lanes(g.add(i)),
            );
            _mm256_storeu_ps(p.add(i), pn);
            store_lanes(m.add(i), mn);
            store_lanes(v.add(i), vn);
            store_lanes(out.add(i), pn);
        }
        i += LANES;
    }
}

/// Eight m codes decoded with the block's scale (see [`q8::decode_m`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn decode_m(codes: __m256i, scale: __m256) -> __m256 {
    let u = _mm256_and_si256(codes, _mm256_set1_epi32(0x7f));
    let magnitude = _mm256_add_epi32(
        _mm256_slli_epi32::<{ q8::M_SHIFT as i32 }>(u),
        _mm256_set1_epi32((q8::EXP_BIAS << 23) as i32),
    );
    // vpsignd keeps a lane where u > 0 and zeroes it where u == 0 (u is never negative):
    // one instruction for "code 0 is zero".
    let magnitude = _mm256_sign_epi32(magnitude, u);
    let sign = _mm256_slli_epi32::<24>(_mm256_and_si256(codes, _mm256_set1_epi32(0x80)));
    let bits = _mm256_or_si256(magnitude, sign);
    _mm256_mul_ps(_mm256_castsi256_ps(bits), scale)
}

/// Eight sqrt(v) codes decoded with the block's scale (see [`q8::decode_r`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn decode_r(codes: __m256i, scale: __m256) -> __m256 {
    let value = _mm256_add_epi32(
        _mm256_slli_epi32::<{ q8::R_SHIFT as i32 }>(codes),
        _mm256_set1_epi32((q8::EXP_BIAS << 23) as i32),
    );
    // Zero where the code is 0, as in decode_m.
    let value = _mm256_sign_epi32(value, codes);
    _mm256_mul_ps(_mm256_castsi256_ps(value), scale)
}

/// The rounded code index of eight non-negative values: `(bits + half a code step) >>
/// SHIFT` (see [`q8::encode_m`]), at most 4095, so it packs into 16 bits unchanged.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn rounded_index<const SHIFT: i32>(y: __m256) -> __m256i {
    _mm256_srli_epi32::<SHIFT>(_mm256_add_epi32(
        _mm256_castps_si256(y),
        _mm256_set1_epi32(1 << (SHIFT - 1)),
    ))
}

/// Sixteen m values (two vectors) encoded with the block's inverse scale, as sixteen
/// 16-bit lanes in `_mm256_packus_epi32` order (see [`q8::encode_m`]). The f32 bit
/// arithmetic is done on 32-bit lanes, the clamping on 16-bit ones after one pack, so
/// each clamp is one instruction for sixteen values: `subs_epu16` is the `max(.., 0)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn encode_m16(m: [__m256; 2], inv_scale: __m256) -> __m256i {
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let y0 = _mm256_mul_ps(_mm256_and_ps(m[0], abs_mask), inv_scale);
    let y1 = _mm256_mul_ps(_mm256_and_ps(m[1], abs_mask), inv_scale);
    let rounded = _mm256_packus_epi32(
        rounded_index::<{ q8::M_SHIFT as i32 }>(y0),
        rounded_index::<{ q8::M_SHIFT as i32 }>(y1),
    );
    let u = _mm256_subs_epu16(rounded, _mm256_set1_epi16((q8::EXP_BIAS << 3) as i16));
    let u = _mm256_min_epu16(u, _mm256_set1_epi16(127));
    let half_min = _mm256_set1_ps(q8::M_HALF_MIN);
    let at_least_one = _mm256_packs_epi32(
        _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(y0, half_min)),
        _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(y1, half_min)),
    );
    let u = _mm256_max_epu16(u, _mm256_and_si256(at_least_one, _mm256_set1_epi16(1)));
    let sign = _mm256_packs_epi32(
        _mm256_srai_epi32::<31>(_mm256_castps_si256(m[0])),
        _mm256_srai_epi32::<31>(_mm256_castps_si256(m[1])),
    );
    _mm256_or_si256(u, _mm256_and_si256(sign, _mm256_set1_epi16(0x80)))
}

/// Sixteen sqrt(v) values (two vectors) encoded with the block's inverse scale, as
/// sixteen 16-bit lanes in `_mm256_packus_epi32` order (see [`q8::encode_r`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn encode_r16(r: [__m256; 2], inv_scale: __m256) -> __m256i {
    let rounded = _mm256_packus_epi32(
        rounded_index::<{ q8::R_SHIFT as i32 }>(_mm256_mul_ps(r[0], inv_scale)),
        rounded_index::<{ q8::R_SHIFT as i32 }>(_mm256_mul_ps(r[1], inv_scale)),
    );
    let c = _mm256_subs_epu16(rounded, _mm256_set1_epi16((q8::EXP_BIAS << 4) as i16));
    _mm256_min_epu16(
        _mm256_max_epu16(c, _mm256_set1_epi16(1)),
        _mm256_set1_epi16(255),
    )
}

/// Eight bytes widened to i32 lanes.
///
/// # Safety
/// `codes` is valid for 8 reads.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_codes(codes: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 8 readable bytes; the load is unaligned.
    _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(codes.cast()) })
}

/// Two vectors of sixteen 16-bit codes, each in `_mm256_packus_epi32` order of its
/// two source vectors, narrowed to 32 bytes in element order and stored.
///
/// # Safety
/// `codes` is valid for 32 writes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_codes(codes: *mut u8, words: [__m256i; 2]) {
    // Words [a0-3 b0-3 | a4-7 b4-7] and [c0-3 d0-3 | c4-7 d4-7] give bytes
    // [a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7] (every code fits in a byte, so the
    // saturating pack changes none); a permutation of 4-byte groups puts them in order.
    let bytes = _mm256_packus_epi16(words[0], words[1]);
    let ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // SAFETY: the caller guarantees 32 writable bytes; the store is unaligned.
    unsafe { _mm256_storeu_si256(codes.cast(), ordered) };
}

/// The largest lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn max_lane(x: __m256) -> f32 {
    let mut lanes = [0f32; LANES];
    // SAFETY: `lanes` holds 8 f32; the store is unaligned.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), x) };
    lanes.iter().fold(0f32, |a, &b| a.max(b))
}

/// Vectors per block of 8-bit state.
const BLOCK_VECTORS: usize = q8::BLOCK / LANES;

/// How many blocks ahead [`q8_block`] prefetches its next inputs: measured on a 16M
/// parameter state, one thread, against none and 4 ahead (8% faster than none; 4 was
/// no better than 2).
const PREFETCH_BLOCKS: usize = 2;

/// One whole block of 8-bit state, in two passes over it. The first decodes the
/// moments, updates them and takes their maxima (the new scales); the second updates
/// the parameters from the new moments and encodes them, sixteen values per clamp
/// (`encode_m16`, `encode_r16`) and 32 codes per store. The parameter's division sits
/// in the second pass, not after the square root in the first, so each pass has one
/// long-latency instruction per vector in its chain. The arithmetic is [`update`]'s,
/// operation for operation, and the codes the format's (docs/adamw-8bit.md has the
/// profile this layout came from).
#[target_feature(enable = "avx2,fma,f16c")]
fn q8_block<G: Lane, O: Lane>(k: &AdamStep, b: Q8Block<'_, G, O>) {
    const GROUP: usize = 4;
    let c = Consts::new(k);
    let (p, g, out) = (b.p.as_mut_ptr(), b.g.as_ptr(), b.out.as_mut_ptr());
    let (m_codes, v_codes) = (b.m_codes.as_mut_ptr(), b.v_codes.as_mut_ptr());
    // Written in the first pass before the second reads them, so left uninitialised:
    // zeroing them was a 2 KiB memset per block, 5% of the kernel's time.
    let mut m_new = [std::mem::MaybeUninit::<__m256>::uninit(); BLOCK_VECTORS];
    let mut r_new = [std::mem::MaybeUninit::<__m256>::uninit(); BLOCK_VECTORS];
    let (ms, vs) = (_mm256_set1_ps(*b.m_scale), _mm256_set1_ps(*b.v_scale));
    let mut m_absmax = _mm256_setzero_ps();
    let mut r_max = _mm256_setzero_ps();
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    for (j, (m_slot, r_slot)) in m_new.iter_mut().zip(&mut r_new).enumerate() {
        let i = j * LANES;
        // One cache line per vector of each array of the block PREFETCH_BLOCKS ahead
        // (the dispatcher runs blocks in address order). A prefetch never faults, and
        // `wrapping_add` makes no claim that the address lies in the allocation, so
        // the lines past a slice's end cost a wasted hint, nothing more.
        let (ahead, line) = (PREFETCH_BLOCKS * q8::BLOCK, j * 64);
        if line < q8::BLOCK * size_of::<f32>() {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(ahead).cast::<i8>().wrapping_add(line));
        }
        if line < q8::BLOCK * size_of::<G>() {
            _mm_prefetch::<_MM_HINT_T0>(g.wrapping_add(ahead).cast::<i8>().wrapping_add(line));
        }
        if line < q8::BLOCK {
            _mm_prefetch::<_MM_HINT_T0>(m_codes.wrapping_add(ahead + line).cast::<i8>());
            _mm_prefetch::<_MM_HINT_T0>(v_codes.wrapping_add(ahead + line).cast::<i8>());
        }
        // SAFETY: i + 8 <= BLOCK, and the code and gradient arrays hold a block.
        unsafe {
            let m = decode_m(load_codes(m_codes.add(i)), ms);
            let r = decode_r(load_codes(v_codes.add(i)), vs);
            let [mn, _, rn] = moments(&c, m, _mm256_mul_ps(r, r), load_lanes(g.add(i)));
            m_slot.write(mn);
            r_slot.write(rn);
            m_absmax = _mm256_max_ps(m_absmax, _mm256_and_ps(mn, abs_mask));
            r_max = _mm256_max_ps(r_max, rn);
        }
    }
    let (m_scale_new, m_inv) = q8::m_scales(max_lane(m_absmax));
    let (v_scale_new, r_inv) = q8::r_scales(max_lane(r_max));
    *b.m_scale = m_scale_new;
    *b.v_scale = v_scale_new;
    let (m_inv, r_inv) = (_mm256_set1_ps(m_inv), _mm256_set1_ps(r_inv));
    for j0 in (0..BLOCK_VECTORS).step_by(GROUP) {
        let mut m_out = [_mm256_setzero_ps(); GROUP];
        let mut r_out = [_mm256_setzero_ps(); GROUP];
        for q in 0..GROUP {
            let (j, i) = (j0 + q, (j0 + q) * LANES);
            // SAFETY: the first pass wrote every slot; i + 8 <= BLOCK, and the parameter
            // array holds a block (a `NoCopy` one is zero-sized and nothing is written
            // through it).
            unsafe {
                let (mn, rn) = (m_new[j].assume_init(), r_new[j].assume_init());
                let pn = param(&c, _mm256_loadu_ps(p.add(i)), mn, rn);
                _mm256_storeu_ps(p.add(i), pn);
                store_lanes(out.add(i), pn);
                m_out[q] = mn;
                r_out[q] = rn;
            }
        }
        let m_words = [
            encode_m16([m_out[0], m_out[1]], m_inv),
            encode_m16([m_out[2], m_out[3]], m_inv),
        ];
        let r_words = [
            encode_r16([r_out[0], r_out[1]], r_inv),
            encode_r16([r_out[2], r_out[3]], r_inv),
        ];
        let i = j0 * LANES;
        // SAFETY: i + 32 <= BLOCK, and the code arrays hold a block.
        unsafe {
            store_codes(m_codes.add(i), m_words);
            store_codes(v_codes.add(i), r_words);
        }
    }
}

/// Sum of squares of `g * scale`: products in f32, squares summed in f64, in the
/// [`super::STATS_LANES`] lanes every kernel sums in (two vectors of 8 per step, four
/// accumulators of 4), so that the sum is the other instruction sets' bit for bit.
#[target_feature(enable = "avx2,fma,f16c")]
fn sum_squares<G: Lane>(g: &[G], scale: f32) -> GradStats {
    const STEP: usize = super::STATS_LANES;
    let s = _mm256_set1_ps(scale);
    let mut acc = [_mm256_setzero_pd(); STEP / 4];
    let mut add = |x: __m256, half: usize| {
        let x = _mm256_mul_ps(x, s);
        let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
        let hi = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x));
        acc[2 * half] = _mm256_fmadd_pd(lo, lo, acc[2 * half]);
        acc[2 * half + 1] = _mm256_fmadd_pd(hi, hi, acc[2 * half + 1]);
    };
    let mut chunks = g.chunks_exact(STEP);
    for chunk in &mut chunks {
        // SAFETY: the chunk holds 16 elements, two vectors of 8.
        unsafe {
            add(load_lanes(chunk.as_ptr()), 0);
            add(load_lanes(chunk.as_ptr().add(LANES)), 1);
        }
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut padded = [G::default(); STEP];
        padded[..rest.len()].copy_from_slice(rest);
        // SAFETY: `padded` holds 16 elements; the padding is zero and adds nothing.
        unsafe {
            add(load_lanes(padded.as_ptr()), 0);
            add(load_lanes(padded.as_ptr().add(LANES)), 1);
        }
    }
    let mut lanes = [0f64; STEP];
    for (j, acc) in acc.iter().enumerate() {
        // SAFETY: `lanes` holds four vectors of 4 f64; the stores are unaligned.
        unsafe { _mm256_storeu_pd(lanes.as_mut_ptr().add(4 * j), *acc) };
    }
    GradStats::from_sum(pairwise(&lanes))
}
