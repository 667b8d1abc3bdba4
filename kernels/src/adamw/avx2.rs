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
    let g = _mm256_mul_ps(g, c.grad_scale);
    let m = _mm256_fmadd_ps(c.beta1, m, _mm256_mul_ps(c.one_minus_beta1, g));
    let g2 = _mm256_mul_ps(_mm256_mul_ps(c.one_minus_beta2, g), g);
    let v = _mm256_fmadd_ps(c.beta2, v, g2);
    let r = _mm256_sqrt_ps(v);
    let denom = _mm256_fmadd_ps(r, c.inv_bias_correction2_sqrt, c.eps);
    let p = _mm256_fmadd_ps(
        c.neg_step_size,
        _mm256_div_ps(m, denom),
        _mm256_mul_ps(p, c.decay),
    );
    [p, m, v, r]
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
    let nonzero = _mm256_cmpgt_epi32(u, _mm256_setzero_si256());
    let sign = _mm256_slli_epi32::<24>(_mm256_and_si256(codes, _mm256_set1_epi32(0x80)));
    let bits = _mm256_or_si256(_mm256_and_si256(magnitude, nonzero), sign);
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
    let nonzero = _mm256_cmpgt_epi32(codes, _mm256_setzero_si256());
    _mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(value, nonzero)), scale)
}

/// Eight m values encoded with the block's inverse scale (see [`q8::encode_m`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn encode_m(m: __m256, inv_scale: __m256) -> __m256i {
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let y = _mm256_mul_ps(_mm256_and_ps(m, abs_mask), inv_scale);
    let rounded = _mm256_srli_epi32::<{ q8::M_SHIFT as i32 }>(_mm256_add_epi32(
        _mm256_castps_si256(y),
        _mm256_set1_epi32(1 << (q8::M_SHIFT - 1)),
    ));
    let u = _mm256_sub_epi32(rounded, _mm256_set1_epi32((q8::EXP_BIAS << 3) as i32));
    let u = _mm256_min_epi32(
        _mm256_max_epi32(u, _mm256_setzero_si256()),
        _mm256_set1_epi32(127),
    );
    let at_least_one = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(
        y,
        _mm256_set1_ps(q8::M_HALF_MIN),
    ));
    let u = _mm256_max_epi32(u, _mm256_and_si256(at_least_one, _mm256_set1_epi32(1)));
    let sign = _mm256_slli_epi32::<7>(_mm256_srli_epi32::<31>(_mm256_castps_si256(m)));
    _mm256_or_si256(u, sign)
}

/// Eight sqrt(v) values encoded with the block's inverse scale (see [`q8::encode_r`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn encode_r(r: __m256, inv_scale: __m256) -> __m256i {
    let y = _mm256_mul_ps(r, inv_scale);
    let rounded = _mm256_srli_epi32::<{ q8::R_SHIFT as i32 }>(_mm256_add_epi32(
        _mm256_castps_si256(y),
        _mm256_set1_epi32(1 << (q8::R_SHIFT - 1)),
    ));
    let c = _mm256_sub_epi32(rounded, _mm256_set1_epi32((q8::EXP_BIAS << 4) as i32));
    _mm256_min_epi32(
        _mm256_max_epi32(c, _mm256_set1_epi32(1)),
        _mm256_set1_epi32(255),
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

/// Eight i32 lanes in 0..=255 narrowed to bytes and stored.
///
/// # Safety
/// `codes` is valid for 8 writes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_codes(codes: *mut u8, lanes: __m256i) {
    let words = _mm_packus_epi32(
        _mm256_castsi256_si128(lanes),
        _mm256_extracti128_si256::<1>(lanes),
    );
    // SAFETY: the caller guarantees 8 writable bytes; the store is unaligned.
    unsafe { _mm_storel_epi64(codes.cast(), _mm_packus_epi16(words, words)) };
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

/// One whole block of 8-bit state: decode, update, re-encode with new scales.
#[target_feature(enable = "avx2,fma,f16c")]
fn q8_block<G: Lane, O: Lane>(k: &AdamStep, b: Q8Block<'_, G, O>) {
    let c = Consts::new(k);
    let (p, g, out) = (b.p.as_mut_ptr(), b.g.as_ptr(), b.out.as_mut_ptr());
    let (m_codes, v_codes) = (b.m_codes.as_mut_ptr(), b.v_codes.as_mut_ptr());
    let mut m_new = [_mm256_setzero_ps(); q8::BLOCK / LANES];
    let mut r_new = [_mm256_setzero_ps(); q8::BLOCK / LANES];
    let (ms, vs) = (_mm256_set1_ps(*b.m_scale), _mm256_set1_ps(*b.v_scale));
    let mut m_absmax = _mm256_setzero_ps();
    let mut r_max = _mm256_setzero_ps();
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    for (j, (m_slot, r_slot)) in m_new.iter_mut().zip(&mut r_new).enumerate() {
        let i = j * LANES;
        // SAFETY: i + 8 <= BLOCK, and every array holds a block (a `NoCopy` one is
        // zero-sized and nothing is written through it).
        unsafe {
            let m = decode_m(load_codes(m_codes.add(i)), ms);
            let r = decode_r(load_codes(v_codes.add(i)), vs);
            let [pn, mn, _, rn] = update(
                &c,
                _mm256_loadu_ps(p.add(i)),
                m,
                _mm256_mul_ps(r, r),
                load_lanes(g.add(i)),
            );
            _mm256_storeu_ps(p.add(i), pn);
            store_lanes(out.add(i), pn);
            *m_slot = mn;
            *r_slot = rn;
            m_absmax = _mm256_max_ps(m_absmax, _mm256_and_ps(mn, abs_mask));
            r_max = _mm256_max_ps(r_max, rn);
        }
    }
    let (m_scale_new, m_inv) = q8::m_scales(max_lane(m_absmax));
    let (v_scale_new, r_inv) = q8::r_scales(max_lane(r_max));
    *b.m_scale = m_scale_new;
    *b.v_scale = v_scale_new;
    let (m_inv, r_inv) = (_mm256_set1_ps(m_inv), _mm256_set1_ps(r_inv));
    for (j, (m, r)) in m_new.iter().zip(&r_new).enumerate() {
        let i = j * LANES;
        // SAFETY: i + 8 <= BLOCK, and the code arrays hold a block.
        unsafe {
            store_codes(m_codes.add(i), encode_m(*m, m_inv));
            store_codes(v_codes.add(i), encode_r(*r, r_inv));
        }
    }
}

/// Sum of squares of `g * scale`: products in f32, squares summed in f64.
#[target_feature(enable = "avx2,fma,f16c")]
fn sum_squares<G: Lane>(g: &[G], scale: f32) -> GradStats {
    let s = _mm256_set1_ps(scale);
    let mut acc = [_mm256_setzero_pd(); 2];
    let mut add = |x: __m256| {
        let x = _mm256_mul_ps(x, s);
        let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
        let hi = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x));
        acc[0] = _mm256_fmadd_pd(lo, lo, acc[0]);
        acc[1] = _mm256_fmadd_pd(hi, hi, acc[1]);
    };
    let mut chunks = g.chunks_exact(LANES);
    for chunk in &mut chunks {
        // SAFETY: the chunk holds 8 elements.
        add(unsafe { load_lanes(chunk.as_ptr()) });
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut padded = [G::default(); LANES];
        padded[..rest.len()].copy_from_slice(rest);
        // SAFETY: `padded` holds 8 elements; the padding is zero and adds nothing.
        add(unsafe { load_lanes(padded.as_ptr()) });
    }
    let mut lanes = [0f64; 2 * 4];
    // SAFETY: `lanes` holds two vectors of 4 f64; the stores are unaligned.
    unsafe {
        _mm256_storeu_pd(lanes.as_mut_ptr(), acc[0]);
        _mm256_storeu_pd(lanes.as_mut_ptr().add(4), acc[1]);
    }
    GradStats::from_sum(pairwise(&lanes))
}
