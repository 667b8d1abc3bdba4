//! The AVX2 + FMA + F16C AdamW kernels: 8 lanes of f32, packed square root and division
//! (`vsqrtps` / `vdivps`, far faster per element than scalar ones, which make a plain loop
//! compute-bound), and F16C conversions for fp16 gradients and working copies.
//!
//! Each loop handles whole vectors; the last partial vector is staged through stack
//! arrays padded with zeros, so there is no scalar tail with different rounding. The
//! 8-bit state kernel updates a run of whole blocks at a time, in two passes per block
//! ([`q8_blocks`]), with the format's integer encoding done in vector registers: the
//! scalar code's ([`q8`]) results, its clamps rearranged into fewer instructions on
//! 16-bit lanes (each encoder says why the result is the same).

use std::arch::x86_64::*;

use super::dispatch::{Kernels, Lane, LaneKind, Moment, Q8Block, Q8Blocks};
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

    unsafe fn q8_blocks<G: Lane, O: Lane>(k: &AdamStep, blocks: Q8Blocks<'_, G, O>) {
        // SAFETY: as above.
        unsafe { q8_blocks(k, blocks) }
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

/// Eight m codes, the low 8 bytes of `codes`, decoded with the block's scale (see
/// [`q8::decode_m`]).
///
/// The codes are sign-extended, so shifted into place each keeps its sign in bit 31
/// (copies of it fill bits 27..=30, which `keep` clears) and its magnitude in the top
/// mantissa bits; the exponent bias, whose bits lie above the magnitude's (so or-ing it
/// is adding it), is or-ed in where the magnitude is not zero (magnitude 0 is a signed
/// zero). Seven instructions with the load and the scaling, nine widening unsigned.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn decode_m(codes: __m128i, scale: __m256) -> __m256 {
    const BIAS: u32 = q8::EXP_BIAS << 23;
    const MAGNITUDE: u32 = 0x7f << q8::M_SHIFT;
    const _: () = assert!(BIAS & MAGNITUDE == 0 && BIAS < 1 << 31);
    let c = _mm256_cvtepi8_epi32(codes);
    let keep = _mm256_set1_epi32((0x8000_0000 | MAGNITUDE) as i32);
    let signed_magnitude = _mm256_and_si256(_mm256_slli_epi32::<{ q8::M_SHIFT as i32 }>(c), keep);
    // vpsignd keeps the bias where the magnitude (never negative) is not zero and zeroes
    // it where it is: one instruction for "code 0 is zero".
    let bias = _mm256_sign_epi32(
        _mm256_set1_epi32(BIAS as i32),
        _mm256_and_si256(c, _mm256_set1_epi32(0x7f)),
    );
    let bits = _mm256_or_si256(signed_magnitude, bias);
    _mm256_mul_ps(_mm256_castsi256_ps(bits), scale)
}

/// Eight sqrt(v) codes, the low 8 bytes of `codes`, decoded with the block's scale (see
/// [`q8::decode_r`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn decode_r(codes: __m128i, scale: __m256) -> __m256 {
    let c = _mm256_cvtepu8_epi32(codes);
    let value = _mm256_add_epi32(
        _mm256_slli_epi32::<{ q8::R_SHIFT as i32 }>(c),
        _mm256_set1_epi32((q8::EXP_BIAS << 23) as i32),
    );
    // Zero where the code is 0, as in decode_m.
    let value = _mm256_sign_epi32(value, c);
    _mm256_mul_ps(_mm256_castsi256_ps(value), scale)
}

/// Half an m code step, in f32 bits (the scalar encoder's rounding).
const M_HALF: u32 = 1 << (q8::M_SHIFT - 1);

/// The m encoder's index: `t = bits + M_HALF` (wrapping) shifted one bit less than the
/// scalar code's `t >> M_SHIFT`, so that the threshold of code 1 is a whole index.
const M_INDEX_SHIFT: i32 = q8::M_SHIFT as i32 - 1;

/// The index of [`q8::M_HALF_MIN`]: `t` is at least its `t` exactly where the index is at
/// least this (its `t` is a multiple of the index step).
const M_CODED: u32 = (q8::M_HALF_MIN.to_bits() + M_HALF) >> M_INDEX_SHIFT;

/// The index of magnitude 0, twice the scalar code's offset: from `M_FLOOR + 2` up, the
/// magnitude is `(index - M_FLOOR) >> 1` (clamped to 127).
const M_FLOOR: u32 = 2 * (q8::EXP_BIAS << 3);

const _: () = assert!(
    (q8::M_HALF_MIN.to_bits() + M_HALF).is_multiple_of(1 << M_INDEX_SHIFT)
        && 1 <= M_CODED
        && M_CODED <= M_FLOOR + 2
        && (u32::MAX >> M_INDEX_SHIFT) < 1 << 15
);

/// The offset of a sqrt(v) code's index `t >> R_SHIFT` (see [`q8::encode_r`]).
const R_FLOOR: u32 = q8::EXP_BIAS << 4;

const _: () = assert!((u32::MAX >> q8::R_SHIFT) < 1 << 15);

/// The 32 codes of four vectors, as bytes from `_mm256_packs_epi16` of two
/// `_mm256_packs_epi32` or `_mm256_packus_epi32` (4-byte groups [a0-3 b0-3 c0-3 d0-3 |
/// a4-7 b4-7 c4-7 d4-7]), put in element order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn in_order(bytes: __m256i) -> __m256i {
    _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// 32 m values (four vectors) encoded with the block's inverse scale, in element order
/// (see [`q8::encode_m`]).
///
/// The same integer arithmetic, rearranged to fewer operations, with the same result for
/// every bit pattern of `y = |m| * inv_scale`. With `t` its bits plus the rounding half
/// (wrapping, as the scalar sum does), the scalar magnitude is `(t >> 20) - 896` clamped
/// to 0..=127, and at least 1 where `y >= M_HALF_MIN`. Here the index is `t >> 19`
/// (below 2^13, so it packs into 16-bit lanes unchanged, where each operation does
/// sixteen values), and:
/// - `y >= M_HALF_MIN` is `index >= M_CODED` (for a NaN or negative `y` neither holds
///   in the scalar code, or the clamp at 127 decides: `t >> 20` is then at least 2040,
///   or `t` wrapped to below 2^19, a magnitude 0 either way, as here);
/// - `((index - (M_FLOOR + 2)) >> 1) + 1`, the difference saturated at zero, is 1 up to
///   `M_FLOOR + 2` and `(index - M_FLOOR) >> 1` (the scalar `(t >> 20) - 896`) from
///   there; below the threshold (below `M_FLOOR + 2`, so the shifted difference is 0)
///   the 1 is not added, which leaves 0;
/// - the clamp at 127 is the signed saturation of the pack to bytes.
///
/// The signs come from packing m itself with signed saturation, which keeps the sign of
/// each lane's bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn encode_m(m: [__m256; 4], inv_scale: __m256) -> __m256i {
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let index = |m: __m256| {
        let y = _mm256_mul_ps(_mm256_and_ps(m, abs_mask), inv_scale);
        let t = _mm256_add_epi32(_mm256_castps_si256(y), _mm256_set1_epi32(M_HALF as i32));
        _mm256_srli_epi32::<M_INDEX_SHIFT>(t)
    };
    let magnitude = |a: __m256, b: __m256| {
        let index = _mm256_packus_epi32(index(a), index(b));
        let above = _mm256_subs_epu16(index, _mm256_set1_epi16((M_FLOOR + 2) as i16));
        // The index is below 2^15, so the signed compare is the unsigned one.
        let coded = _mm256_cmpgt_epi16(index, _mm256_set1_epi16((M_CODED - 1) as i16));
        // Minus -1 where coded.
        _mm256_sub_epi16(_mm256_srli_epi16::<1>(above), coded)
    };
    let magnitudes = _mm256_packs_epi16(magnitude(m[0], m[1]), magnitude(m[2], m[3]));
    let bits = m.map(|m| _mm256_castps_si256(m));
    let signs = _mm256_packs_epi16(
        _mm256_packs_epi32(bits[0], bits[1]),
        _mm256_packs_epi32(bits[2], bits[3]),
    );
    let codes = _mm256_or_si256(
        magnitudes,
        _mm256_and_si256(signs, _mm256_set1_epi8(0x80u8 as i8)),
    );
    in_order(codes)
}

/// 32 sqrt(v) values (four vectors) encoded with the block's inverse scale, in element
/// order (see [`q8::encode_r`]): the index `t >> 19` (below 2^13) packed into 16-bit
/// lanes, clamped below and offset there, and clamped at 255 by the unsigned saturation
/// of the pack to bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn encode_r(r: [__m256; 4], inv_scale: __m256) -> __m256i {
    let index = |r: __m256| {
        let y = _mm256_mul_ps(r, inv_scale);
        let t = _mm256_add_epi32(
            _mm256_castps_si256(y),
            _mm256_set1_epi32(1 << (q8::R_SHIFT - 1)),
        );
        _mm256_srli_epi32::<{ q8::R_SHIFT as i32 }>(t)
    };
    let code = |a: __m256, b: __m256| {
        let index = _mm256_packus_epi32(index(a), index(b));
        _mm256_sub_epi16(
            _mm256_max_epu16(index, _mm256_set1_epi16((R_FLOOR + 1) as i16)),
            _mm256_set1_epi16(R_FLOOR as i16),
        )
    };
    in_order(_mm256_packus_epi16(code(r[0], r[1]), code(r[2], r[3])))
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

/// Vectors encoded together: 32 codes, one store.
const GROUP: usize = 4;

/// Groups per block.
const BLOCK_GROUPS: usize = BLOCK_VECTORS / GROUP;

/// How many blocks ahead the 8-bit kernel prefetches its inputs: measured on a 16M
/// parameter state, one thread, against none and 4 ahead (8% faster than none; 4 was
/// no better than 2).
const PREFETCH_BLOCKS: usize = 2;

/// A run of 8-bit blocks' arrays as raw pointers, taken once for the whole run: a
/// block's codes are read through them in the first pass and written in the second.
struct Run<G, O> {
    p: *mut f32,
    m_codes: *mut u8,
    v_codes: *mut u8,
    g: *const G,
    out: *mut O,
}

impl<G: Lane, O: Lane> Run<G, O> {
    fn new(b: &mut Q8Blocks<'_, G, O>) -> Self {
        Run {
            p: b.p.as_mut_ptr(),
            m_codes: b.m_codes.as_mut_ptr(),
            v_codes: b.v_codes.as_mut_ptr(),
            g: b.g.as_ptr(),
            out: b.out.as_mut_ptr(),
        }
    }

    /// Block `i`'s first pass, with its scales.
    ///
    /// # Safety
    /// The run has more than `i` blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn moments(&self, i: usize, m_scale: f32, v_scale: f32) -> Moments<G> {
        let at = i * q8::BLOCK;
        // SAFETY: the caller guarantees block i lies in the arrays.
        unsafe {
            Moments {
                p: self.p.add(at),
                m_codes: self.m_codes.add(at),
                v_codes: self.v_codes.add(at),
                g: self.g.add(at),
                m_scale: _mm256_set1_ps(m_scale),
                v_scale: _mm256_set1_ps(v_scale),
            }
        }
    }

    /// Block `i`'s second pass, with its inverse scales.
    ///
    /// # Safety
    /// The run has more than `i` blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn finish(&self, i: usize, m_inv: f32, r_inv: f32) -> Finish<O> {
        let at = i * q8::BLOCK;
        // SAFETY: the caller guarantees block i lies in the arrays.
        unsafe {
            Finish {
                p: self.p.add(at),
                out: self.out.add(at),
                m_codes: self.m_codes.add(at),
                v_codes: self.v_codes.add(at),
                m_inv: _mm256_set1_ps(m_inv),
                r_inv: _mm256_set1_ps(r_inv),
            }
        }
    }
}

/// Where the first pass over one block of 8-bit state reads, and the block's scales.
struct Moments<G> {
    /// Only prefetched from (the second pass updates the parameters).
    p: *const f32,
    m_codes: *const u8,
    v_codes: *const u8,
    g: *const G,
    m_scale: __m256,
    v_scale: __m256,
}

impl<G: Lane> Moments<G> {
    /// Group `k` of the block (vectors `GROUP * k` on): decodes the moments and updates
    /// them; returns the new m and sqrt(v), and takes them into the block's maxima
    /// (`max`: of |m|, of sqrt(v)).
    ///
    /// # Safety
    /// The pointers hold a whole block, and `k < BLOCK_GROUPS`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group(&self, c: &Consts, k: usize, max: &mut [__m256; 2]) -> [[__m256; 2]; GROUP] {
        let at = k * GROUP * LANES;
        self.prefetch(at);
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let mut out = [[_mm256_setzero_ps(); 2]; GROUP];
        for (q, out) in out.iter_mut().enumerate() {
            let i = at + q * LANES;
            // SAFETY: i + 8 <= BLOCK, and the caller guarantees whole blocks.
            unsafe {
                let m = decode_m(_mm_loadl_epi64(self.m_codes.add(i).cast()), self.m_scale);
                let r = decode_r(_mm_loadl_epi64(self.v_codes.add(i).cast()), self.v_scale);
                let g = load_lanes(self.g.add(i));
                let [mn, _, rn] = moments(c, m, _mm256_mul_ps(r, r), g);
                max[0] = _mm256_max_ps(max[0], _mm256_and_ps(mn, abs_mask));
                max[1] = _mm256_max_ps(max[1], rn);
                *out = [mn, rn];
            }
        }
        out
    }

    /// Asks for the cache lines of each input array of the block [`PREFETCH_BLOCKS`]
    /// ahead (blocks run in address order) that hold the elements a group from `at` on
    /// holds there: each line of the parameters and gradients once, the codes' line
    /// twice (a group has half a line of each). A fixed number per group, without
    /// branches (one per vector and array, as before, cost a compare and a branch each).
    /// A prefetch never faults, and `wrapping_add` makes no claim that the address lies
    /// in the allocation, so the lines past a slice's end cost a wasted hint, nothing
    /// more.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn prefetch(&self, at: usize) {
        const LINE: usize = 64;
        let at = at + PREFETCH_BLOCKS * q8::BLOCK;
        let (p, g) = (self.p.wrapping_add(at), self.g.wrapping_add(at));
        for line in (0..GROUP * LANES * size_of::<f32>()).step_by(LINE) {
            _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>().wrapping_add(line));
        }
        for line in (0..GROUP * LANES * size_of::<G>()).step_by(LINE) {
            _mm_prefetch::<_MM_HINT_T0>(g.cast::<i8>().wrapping_add(line));
        }
        _mm_prefetch::<_MM_HINT_T0>(self.m_codes.wrapping_add(at).cast());
        _mm_prefetch::<_MM_HINT_T0>(self.v_codes.wrapping_add(at).cast());
    }
}

/// Where the second pass over one block of 8-bit state writes, and the block's inverse
/// scales.
struct Finish<O> {
    p: *mut f32,
    out: *mut O,
    m_codes: *mut u8,
    v_codes: *mut u8,
    m_inv: __m256,
    r_inv: __m256,
}

impl<O: Lane> Finish<O> {
    /// Group `k` of the block (vectors `GROUP * k` on), from its new m and sqrt(v):
    /// updates and writes the parameters, and writes the codes.
    ///
    /// # Safety
    /// The pointers hold a whole block (a `NoCopy` one is zero-sized and nothing is
    /// written through it), and `k < BLOCK_GROUPS`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group(&self, c: &Consts, k: usize, group: &[[__m256; 2]; GROUP]) {
        let at = k * GROUP * LANES;
        for (q, &[m, r]) in group.iter().enumerate() {
            let i = at + q * LANES;
            // SAFETY: i + 8 <= BLOCK, and the caller guarantees whole blocks.
            unsafe {
                let pn = param(c, _mm256_loadu_ps(self.p.add(i)), m, r);
                _mm256_storeu_ps(self.p.add(i), pn);
                store_lanes(self.out.add(i), pn);
            }
        }
        let codes = [
            encode_m(group.map(|[m, _]| m), self.m_inv),
            encode_r(group.map(|[_, r]| r), self.r_inv),
        ];
        // SAFETY: at + 32 <= BLOCK, and the caller guarantees whole blocks; the stores
        // are unaligned.
        unsafe {
            _mm256_storeu_si256(self.m_codes.add(at).cast(), codes[0]);
            _mm256_storeu_si256(self.v_codes.add(at).cast(), codes[1]);
        }
    }
}

/// One whole block of 8-bit state: decode, update, re-encode with new scales.
#[target_feature(enable = "avx2,fma,f16c")]
fn q8_block<G: Lane, O: Lane>(k: &AdamStep, b: Q8Block<'_, G, O>) {
    let blocks = Q8Blocks {
        p: b.p,
        m_codes: b.m_codes,
        m_scales: std::slice::from_mut(b.m_scale),
        v_codes: b.v_codes,
        v_scales: std::slice::from_mut(b.v_scale),
        g: b.g,
        out: b.out,
    };
    q8_blocks(k, blocks);
}

/// A run of whole blocks of 8-bit state, each in two passes. The first decodes the
/// moments, updates them and takes their maxima (the new scales); the second updates the
/// parameters from the new moments and encodes these, 32 values per encoding (clamps on
/// 16-bit lanes, one store). The parameter's division sits in the second pass, the
/// square root in the first, so each pass keeps the divider busy beside its integer
/// work. Not software-pipelined as the AVX-512 kernel is (block i's second pass in the
/// loop of block i + 1's first): measured on a Zen 4 running these kernels, that was 3%
/// slower in cache (one thread, 256K parameters: 1.64 against 1.68 G params/s) and no
/// different from memory; the two passes' constants do not fit in sixteen registers
/// together. The scratch between the passes is zeroed once per run, not per block. The
/// arithmetic is [`update`]'s, operation for operation, and the codes the format's
/// (docs/adamw-8bit.md has the profile the two passes came from).
#[target_feature(enable = "avx2,fma,f16c")]
fn q8_blocks<G: Lane, O: Lane>(k: &AdamStep, mut b: Q8Blocks<'_, G, O>) {
    let blocks = b.count();
    let c = Consts::new(k);
    let run = Run::new(&mut b);
    // The new m and sqrt(v) of the block, from the first pass to the second.
    let mut kept = [[[_mm256_setzero_ps(); 2]; GROUP]; BLOCK_GROUPS];
    for i in 0..blocks {
        // SAFETY: i < blocks, and `count` checked that every array holds them.
        let u = unsafe { run.moments(i, b.m_scales[i], b.v_scales[i]) };
        let mut max = [_mm256_setzero_ps(); 2];
        for (k, group) in kept.iter_mut().enumerate() {
            // SAFETY: `u` points at a whole block, and k < BLOCK_GROUPS.
            *group = unsafe { u.group(&c, k, &mut max) };
        }
        let (m_scale, m_inv) = q8::m_scales(max_lane(max[0]));
        let (v_scale, r_inv) = q8::r_scales(max_lane(max[1]));
        b.m_scales[i] = m_scale;
        b.v_scales[i] = v_scale;
        // SAFETY: as above.
        let f = unsafe { run.finish(i, m_inv, r_inv) };
        for (k, group) in kept.iter().enumerate() {
            // SAFETY: `f` points at a whole block, and k < BLOCK_GROUPS.
            unsafe { f.group(&c, k, group) };
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::Isa;

    /// The codes of 32 values of `|m| * inv` or `r * inv` by `encode` (one of this file's
    /// encoders).
    fn encoded(
        encode: unsafe fn([__m256; 4], __m256) -> __m256i,
        x: &[f32; 32],
        inv: f32,
    ) -> [u8; 32] {
        let mut codes = [0u8; 32];
        // SAFETY: the caller checked the CPU has AVX2, FMA and F16C; `x` and `codes` hold
        // 32 lanes.
        unsafe {
            let v: [__m256; 4] = std::array::from_fn(|j| _mm256_loadu_ps(x.as_ptr().add(8 * j)));
            let c = encode(v, _mm256_set1_ps(inv));
            _mm256_storeu_si256(codes.as_mut_ptr().cast(), c);
        }
        codes
    }

    /// The encoders' integer arithmetic is rearranged from `q8::encode_*`: they must agree
    /// on every f32 ([`q8::simd_check::encoders`]).
    #[test]
    fn simd_encoding_matches_the_scalar_definition_on_every_kind_of_value() {
        if !Isa::Avx2.is_supported() {
            return;
        }
        q8::simd_check::encoders(32, |x, inv| {
            let x: &[f32; 32] = x.try_into().unwrap();
            (
                encoded(encode_m, x, inv).to_vec(),
                encoded(encode_r, x, inv).to_vec(),
            )
        });
    }

    #[test]
    fn simd_decoding_matches_the_scalar_definition_on_every_code() {
        if !Isa::Avx2.is_supported() {
            return;
        }
        q8::simd_check::decoders(8, |codes, scale| {
            let (mut m, mut r) = (vec![0f32; 8], vec![0f32; 8]);
            // SAFETY: the CPU has AVX2, FMA and F16C; the vectors hold 8 lanes.
            unsafe {
                let c = _mm_loadl_epi64(codes.as_ptr().cast());
                _mm256_storeu_ps(m.as_mut_ptr(), decode_m(c, _mm256_set1_ps(scale)));
                _mm256_storeu_ps(r.as_mut_ptr(), decode_r(c, _mm256_set1_ps(scale)));
            }
            (m, r)
        });
    }
}
