//! The AVX-512F AdamW kernels: 16 lanes of f32, packed square root and division on zmm
//! registers, AVX-512F conversions for fp16 (`vcvtph2ps` / `vcvtps2ph`) and narrowing
//! moves (`vpmovdw`, `vpmovdb`) for bf16 working copies and 8-bit codes. Only AVX-512
//! Foundation instructions (plus AVX2, FMA and F16C) are used, so any AVX-512 CPU runs it.
//!
//! Structure as in `avx2.rs`: whole vectors, the last partial vector (or 8-bit block)
//! staged through zero-padded stack arrays, the format's integer encoding in registers.

use std::arch::x86_64::*;

use super::dispatch::{Kernels, Lane, LaneKind, Moment, Q8Block};
use super::portable::pairwise;
use super::{AdamStep, GradStats, q8};

const LANES: usize = 16;

pub(super) struct Avx512;

impl Kernels for Avx512 {
    const LANES: usize = LANES;

    unsafe fn vectors<S: Moment, G: Lane, O: Lane>(
        k: &AdamStep,
        p: &mut [f32],
        m: &mut [S],
        v: &mut [S],
        g: &[G],
        out: &mut [O],
    ) {
        // SAFETY: the caller guarantees the CPU has AVX-512F (and AVX2, FMA, F16C).
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
    grad_scale: __m512,
    decay: __m512,
    beta1: __m512,
    beta2: __m512,
    one_minus_beta1: __m512,
    one_minus_beta2: __m512,
    neg_step_size: __m512,
    inv_bias_correction2_sqrt: __m512,
    eps: __m512,
}

impl Consts {
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn new(k: &AdamStep) -> Self {
        Self {
            grad_scale: _mm512_set1_ps(k.grad_scale),
            decay: _mm512_set1_ps(k.decay),
            beta1: _mm512_set1_ps(k.beta1),
            beta2: _mm512_set1_ps(k.beta2),
            one_minus_beta1: _mm512_set1_ps(k.one_minus_beta1),
            one_minus_beta2: _mm512_set1_ps(k.one_minus_beta2),
            neg_step_size: _mm512_set1_ps(-k.step_size),
            inv_bias_correction2_sqrt: _mm512_set1_ps(k.inv_bias_correction2_sqrt),
            eps: _mm512_set1_ps(k.eps),
        }
    }
}

/// Sixteen gradients or moments as f32 (exactly: every fp16 and bf16 value is an f32).
///
/// # Safety
/// `g` is valid for 16 reads.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn load_lanes<G: Lane>(g: *const G) -> __m512 {
    // SAFETY: the caller guarantees 16 readable elements; loads are unaligned.
    unsafe {
        match G::KIND {
            LaneKind::F32 => _mm512_loadu_ps(g.cast()),
            LaneKind::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(g.cast())),
            LaneKind::Bf16 => {
                let wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(g.cast()));
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(wide))
            }
            LaneKind::Absent => unreachable!("gradients and moments always have a dtype"),
        }
    }
}

/// Writes sixteen values as `O` (the working copy or bf16 moments), rounded to
/// nearest even.
///
/// # Safety
/// Unless `O` is `NoCopy`, `out` is valid for 16 writes.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn store_lanes<O: Lane>(out: *mut O, x: __m512) {
    // SAFETY: the caller guarantees 16 writable elements when anything is written.
    unsafe {
        match O::KIND {
            LaneKind::Absent => {}
            LaneKind::F16 => _mm256_storeu_si256(
                out.cast(),
                _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x),
            ),
            LaneKind::Bf16 => _mm256_storeu_si256(out.cast(), to_bf16(x)),
            LaneKind::F32 => _mm512_storeu_ps(out.cast(), x),
        }
    }
}

/// f32 to bf16 with round to nearest even; NaN stays NaN (quiet, sign and top payload
/// kept), as `half::bf16::from_f32` does. (AVX512_BF16's `vcvtneps2bf16` would flush
/// subnormals, and not every AVX-512 CPU has it.)
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn to_bf16(x: __m512) -> __m256i {
    let bits = _mm512_castps_si512(x);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
    let bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, bias));
    let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(0x40));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet))
}

/// The AdamW arithmetic on sixteen elements: returns (p, m, v, sqrt(v)).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn update(c: &Consts, p: __m512, m: __m512, v: __m512, g: __m512) -> [__m512; 4] {
    let g = _mm512_mul_ps(g, c.grad_scale);
    let m = _mm512_fmadd_ps(c.beta1, m, _mm512_mul_ps(c.one_minus_beta1, g));
    let g2 = _mm512_mul_ps(_mm512_mul_ps(c.one_minus_beta2, g), g);
    let v = _mm512_fmadd_ps(c.beta2, v, g2);
    let r = _mm512_sqrt_ps(v);
    let denom = _mm512_fmadd_ps(r, c.inv_bias_correction2_sqrt, c.eps);
    let p = _mm512_fmadd_ps(
        c.neg_step_size,
        _mm512_div_ps(m, denom),
        _mm512_mul_ps(p, c.decay),
    );
    [p, m, v, r]
}

/// AdamW over equal-length slices of whole vectors, with fp32 or bf16 moments (`S`:
/// read exactly, written rounded to nearest even, as a bf16 working copy is).
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
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
        // SAFETY: i + 16 <= n and every slice has n elements (a `NoCopy` slice is
        // zero-sized and nothing is written through it).
        unsafe {
            let [pn, mn, vn, _] = update(
                &c,
                _mm512_loadu_ps(p.add(i)),
                load_lanes(m.add(i)),
                load_lanes(v.add(i)),
                load_lanes(g.add(i)),
            );
            _mm512_storeu_ps(p.add(i), pn);
            store_lanes(m.add(i), mn);
            store_lanes(v.add(i), vn);
            store_lanes(out.add(i), pn);
        }
        i += LANES;
    }
}

/// Sixteen m codes decoded with the block's scale (see [`q8::decode_m`]).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn decode_m(codes: __m512i, scale: __m512) -> __m512 {
    let u = _mm512_and_si512(codes, _mm512_set1_epi32(0x7f));
    let magnitude = _mm512_add_epi32(
        _mm512_slli_epi32::<{ q8::M_SHIFT }>(u),
        _mm512_set1_epi32((q8::EXP_BIAS << 23) as i32),
    );
    let nonzero = _mm512_test_epi32_mask(u, u);
    let sign = _mm512_slli_epi32::<24>(_mm512_and_si512(codes, _mm512_set1_epi32(0x80)));
    let bits = _mm512_or_si512(_mm512_maskz_mov_epi32(nonzero, magnitude), sign);
    _mm512_mul_ps(_mm512_castsi512_ps(bits), scale)
}

/// Sixteen sqrt(v) codes decoded with the block's scale (see [`q8::decode_r`]).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn decode_r(codes: __m512i, scale: __m512) -> __m512 {
    let value = _mm512_add_epi32(
        _mm512_slli_epi32::<{ q8::R_SHIFT }>(codes),
        _mm512_set1_epi32((q8::EXP_BIAS << 23) as i32),
    );
    let nonzero = _mm512_test_epi32_mask(codes, codes);
    _mm512_mul_ps(
        _mm512_castsi512_ps(_mm512_maskz_mov_epi32(nonzero, value)),
        scale,
    )
}

/// Sixteen m values encoded with the block's inverse scale (see [`q8::encode_m`]).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn encode_m(m: __m512, inv_scale: __m512) -> __m512i {
    let y = _mm512_mul_ps(_mm512_abs_ps(m), inv_scale);
    let rounded = _mm512_srli_epi32::<{ q8::M_SHIFT }>(_mm512_add_epi32(
        _mm512_castps_si512(y),
        _mm512_set1_epi32(1 << (q8::M_SHIFT - 1)),
    ));
    let u = _mm512_sub_epi32(rounded, _mm512_set1_epi32((q8::EXP_BIAS << 3) as i32));
    let u = _mm512_min_epi32(
        _mm512_max_epi32(u, _mm512_setzero_si512()),
        _mm512_set1_epi32(127),
    );
    let at_least_one = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(y, _mm512_set1_ps(q8::M_HALF_MIN));
    let u = _mm512_max_epi32(
        u,
        _mm512_maskz_mov_epi32(at_least_one, _mm512_set1_epi32(1)),
    );
    let sign = _mm512_slli_epi32::<7>(_mm512_srli_epi32::<31>(_mm512_castps_si512(m)));
    _mm512_or_si512(u, sign)
}

/// Sixteen sqrt(v) values encoded with the block's inverse scale (see [`q8::encode_r`]).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn encode_r(r: __m512, inv_scale: __m512) -> __m512i {
    let y = _mm512_mul_ps(r, inv_scale);
    let rounded = _mm512_srli_epi32::<{ q8::R_SHIFT }>(_mm512_add_epi32(
        _mm512_castps_si512(y),
        _mm512_set1_epi32(1 << (q8::R_SHIFT - 1)),
    ));
    let c = _mm512_sub_epi32(rounded, _mm512_set1_epi32((q8::EXP_BIAS << 4) as i32));
    _mm512_min_epi32(
        _mm512_max_epi32(c, _mm512_set1_epi32(1)),
        _mm512_set1_epi32(255),
    )
}

/// One whole block of 8-bit state: decode, update, re-encode with new scales.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn q8_block<G: Lane, O: Lane>(k: &AdamStep, b: Q8Block<'_, G, O>) {
    let c = Consts::new(k);
    let (p, g, out) = (b.p.as_mut_ptr(), b.g.as_ptr(), b.out.as_mut_ptr());
    let (m_codes, v_codes) = (b.m_codes.as_mut_ptr(), b.v_codes.as_mut_ptr());
    let mut m_new = [_mm512_setzero_ps(); q8::BLOCK / LANES];
    let mut r_new = [_mm512_setzero_ps(); q8::BLOCK / LANES];
    let (ms, vs) = (_mm512_set1_ps(*b.m_scale), _mm512_set1_ps(*b.v_scale));
    let mut m_absmax = _mm512_setzero_ps();
    let mut r_max = _mm512_setzero_ps();
    for (j, (m_slot, r_slot)) in m_new.iter_mut().zip(&mut r_new).enumerate() {
        let i = j * LANES;
        // SAFETY: i + 16 <= BLOCK, and every array holds a block (a `NoCopy` one is
        // zero-sized and nothing is written through it).
        unsafe {
            let m = decode_m(
                _mm512_cvtepu8_epi32(_mm_loadu_si128(m_codes.add(i).cast())),
                ms,
            );
            let r = decode_r(
                _mm512_cvtepu8_epi32(_mm_loadu_si128(v_codes.add(i).cast())),
                vs,
            );
            let [pn, mn, _, rn] = update(
                &c,
                _mm512_loadu_ps(p.add(i)),
                m,
                _mm512_mul_ps(r, r),
                load_lanes(g.add(i)),
            );
            _mm512_storeu_ps(p.add(i), pn);
            store_lanes(out.add(i), pn);
            *m_slot = mn;
            *r_slot = rn;
            m_absmax = _mm512_max_ps(m_absmax, _mm512_abs_ps(mn));
            r_max = _mm512_max_ps(r_max, rn);
        }
    }
    let (m_scale_new, m_inv) = q8::m_scales(_mm512_reduce_max_ps(m_absmax));
    let (v_scale_new, r_inv) = q8::r_scales(_mm512_reduce_max_ps(r_max));
    *b.m_scale = m_scale_new;
    *b.v_scale = v_scale_new;
    let (m_inv, r_inv) = (_mm512_set1_ps(m_inv), _mm512_set1_ps(r_inv));
    for (j, (m, r)) in m_new.iter().zip(&r_new).enumerate() {
        let i = j * LANES;
        // SAFETY: i + 16 <= BLOCK, and the code arrays hold a block.
        unsafe {
            _mm_storeu_si128(
                m_codes.add(i).cast(),
                _mm512_cvtepi32_epi8(encode_m(*m, m_inv)),
            );
            _mm_storeu_si128(
                v_codes.add(i).cast(),
                _mm512_cvtepi32_epi8(encode_r(*r, r_inv)),
            );
        }
    }
}

/// Sum of squares of `g * scale`: products in f32, squares summed in f64, in the
/// [`super::STATS_LANES`] lanes every kernel sums in (one vector of 16 per step, two
/// accumulators of 8).
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn sum_squares<G: Lane>(g: &[G], scale: f32) -> GradStats {
    let s = _mm512_set1_ps(scale);
    let mut acc = [_mm512_setzero_pd(); 2];
    let mut add = |x: __m512| {
        let x = _mm512_mul_ps(x, s);
        let lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
        let hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
            _mm512_castps_pd(x),
        )));
        acc[0] = _mm512_fmadd_pd(lo, lo, acc[0]);
        acc[1] = _mm512_fmadd_pd(hi, hi, acc[1]);
    };
    let mut chunks = g.chunks_exact(LANES);
    for chunk in &mut chunks {
        // SAFETY: the chunk holds 16 elements.
        add(unsafe { load_lanes(chunk.as_ptr()) });
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut padded = [G::default(); LANES];
        padded[..rest.len()].copy_from_slice(rest);
        // SAFETY: `padded` holds 16 elements; the padding is zero and adds nothing.
        add(unsafe { load_lanes(padded.as_ptr()) });
    }
    let mut lanes = [0f64; super::STATS_LANES];
    // SAFETY: `lanes` holds two vectors of 8 f64; the stores are unaligned.
    unsafe {
        _mm512_storeu_pd(lanes.as_mut_ptr(), acc[0]);
        _mm512_storeu_pd(lanes.as_mut_ptr().add(8), acc[1]);
    }
    GradStats::from_sum(pairwise(&lanes))
}
