//! The AVX-512F AdamW kernels: 16 lanes of f32, packed square root and division on zmm
//! registers, AVX-512F conversions for fp16 (`vcvtph2ps` / `vcvtps2ph`) and narrowing
//! moves (`vpmovdw`, `vpmovdb`) for bf16 working copies and 8-bit codes. Only AVX-512
//! Foundation instructions (plus AVX2, FMA and F16C) are used, so any AVX-512 CPU runs it.
//!
//! Structure as in `avx2.rs`: whole vectors, the last partial vector (or 8-bit block)
//! staged through zero-padded stack arrays, the format's integer encoding in registers.
//! 8-bit state is updated a run of whole blocks at a time, software-pipelined
//! ([`q8_blocks`]), with the format's clamps rearranged into fewer instructions (each
//! encoder says why the result is the same).

use std::arch::x86_64::*;

use super::dispatch::{Kernels, Lane, LaneKind, Moment, Q8Block, Q8Blocks};
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

/// `x`, hidden from the optimiser. Seeing that a lane-wise test of widened codes only
/// depends on their bytes, LLVM rewrites it as a byte compare, whose result AVX-512F can
/// turn into a lane mask only by widening it again and testing that: three instructions
/// more than the one test.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn opaque(mut x: __m512i) -> __m512i {
    // SAFETY: no instructions; the register is read and written in place.
    unsafe {
        std::arch::asm!(
            "/* {x} */",
            x = inout(zmm_reg) x,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    x
}

/// Sixteen m codes decoded with the block's scale (see [`q8::decode_m`]).
///
/// The codes are sign-extended, so shifted into place each keeps its sign in bit 31
/// (copies of it fill bits 27..=30, outside the kept bits) and its magnitude in the top
/// mantissa bits; one bitwise select keeps those and adds the exponent bias where the
/// magnitude is not zero (magnitude 0 is a signed zero).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn decode_m(codes: __m128i, scale: __m512) -> __m512 {
    let c = opaque(_mm512_cvtepi8_epi32(codes));
    let nonzero = _mm512_test_epi32_mask(c, _mm512_set1_epi32(0x7f));
    let bias = _mm512_maskz_mov_epi32(nonzero, _mm512_set1_epi32((q8::EXP_BIAS << 23) as i32));
    let keep = _mm512_set1_epi32((0x8000_0000u32 | (0x7f << q8::M_SHIFT)) as i32);
    // (shifted & keep) | bias
    let bits =
        _mm512_ternarylogic_epi32::<0xea>(_mm512_slli_epi32::<{ q8::M_SHIFT }>(c), keep, bias);
    _mm512_mul_ps(_mm512_castsi512_ps(bits), scale)
}

/// Sixteen sqrt(v) codes decoded with the block's scale (see [`q8::decode_r`]).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn decode_r(codes: __m128i, scale: __m512) -> __m512 {
    let c = opaque(_mm512_cvtepu8_epi32(codes));
    let nonzero = _mm512_test_epi32_mask(c, c);
    let value = _mm512_maskz_add_epi32(
        nonzero,
        _mm512_slli_epi32::<{ q8::R_SHIFT }>(c),
        _mm512_set1_epi32((q8::EXP_BIAS << 23) as i32),
    );
    _mm512_mul_ps(_mm512_castsi512_ps(value), scale)
}

/// Sixteen m values encoded with the block's inverse scale (see [`q8::encode_m`]); the
/// codes are in the low byte of each lane (the bits above are not zero).
///
/// The same integer arithmetic, rearranged to fewer operations, with the same result for
/// every bit pattern of `|m| * inv_scale`. With `t` its bits plus the rounding half, the
/// scalar code's magnitude is `(t >> 20) - 896`, clamped to 0..=127, and at least 1 where
/// the value is at least [`q8::M_HALF_MIN`]. Here: the lanes whose `t`, an unsigned
/// integer wrapping as the scalar sum does, is below the threshold's `t` are zero (as
/// there: values below the threshold, and NaNs whose sum wraps to near zero); the
/// others have `t` clamped between the `t` of the smallest and of the largest code,
/// which is monotonic in `t` and so gives the same code. `(t >> 20) - 896` is then
/// 897..=1023 minus 896; since 896 is 128 modulo 256, its low seven bits are those of
/// `t >> 20`, and bit 7 is replaced by the sign.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn encode_m(m: __m512, inv_scale: __m512) -> __m512i {
    const HALF: u32 = 1 << (q8::M_SHIFT - 1);
    let t_of = |code_bits: u32| _mm512_set1_epi32(code_bits.wrapping_add(HALF) as i32);
    let y = _mm512_mul_ps(_mm512_abs_ps(m), inv_scale);
    let t = _mm512_add_epi32(_mm512_castps_si512(y), _mm512_set1_epi32(HALF as i32));
    let coded = _mm512_cmpge_epu32_mask(t, t_of(q8::M_HALF_MIN.to_bits()));
    let smallest = (1 << q8::M_SHIFT) + (q8::EXP_BIAS << 23);
    let t = _mm512_min_epu32(
        _mm512_max_epu32(t, t_of(smallest)),
        t_of(q8::M_TOP.to_bits()),
    );
    let magnitude = _mm512_maskz_srli_epi32::<{ q8::M_SHIFT }>(coded, t);
    let sign = _mm512_srli_epi32::<24>(_mm512_castps_si512(m));
    // Bit 7 from `sign`, the others from `magnitude`.
    _mm512_ternarylogic_epi32::<0xd8>(magnitude, sign, _mm512_set1_epi32(0x80))
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

/// Vectors in an 8-bit block.
const VECTORS: usize = q8::BLOCK / LANES;

/// How many blocks ahead the 8-bit kernel prefetches its inputs (as `avx2.rs` does).
const PREFETCH_BLOCKS: usize = 2;

/// A run of 8-bit blocks' arrays as raw pointers, taken once for the whole run: one
/// block's codes are read through them while the block before's are written.
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

    /// Block `i`'s update, with its scales.
    ///
    /// # Safety
    /// The run has more than `i` blocks.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn update(&self, i: usize, m_scale: f32, v_scale: f32) -> Update<G, O> {
        let at = i * q8::BLOCK;
        // SAFETY: the caller guarantees block i lies in the arrays.
        unsafe {
            Update {
                p: self.p.add(at),
                m_codes: self.m_codes.add(at),
                v_codes: self.v_codes.add(at),
                g: self.g.add(at),
                out: self.out.add(at),
                m_scale: _mm512_set1_ps(m_scale),
                v_scale: _mm512_set1_ps(v_scale),
            }
        }
    }

    /// Block `i`'s encoding, with its inverse scales.
    ///
    /// # Safety
    /// The run has more than `i` blocks.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn encode(&self, i: usize, m_inv: f32, r_inv: f32) -> Encode {
        let at = i * q8::BLOCK;
        // SAFETY: the caller guarantees block i lies in the arrays.
        unsafe {
            Encode {
                m_codes: self.m_codes.add(at),
                v_codes: self.v_codes.add(at),
                m_inv: _mm512_set1_ps(m_inv),
                r_inv: _mm512_set1_ps(r_inv),
            }
        }
    }
}

/// Where one block of 8-bit state is read and its parameters written, and its scales.
struct Update<G, O> {
    p: *mut f32,
    m_codes: *const u8,
    v_codes: *const u8,
    g: *const G,
    out: *mut O,
    m_scale: __m512,
    v_scale: __m512,
}

impl<G: Lane, O: Lane> Update<G, O> {
    /// Vector `j` of the block: decodes the state, updates it and writes the parameters;
    /// returns the new m and sqrt(v), and takes them into the block's maxima (`max`:
    /// of |m|, of sqrt(v)).
    ///
    /// # Safety
    /// The pointers hold a whole block (a `NoCopy` one is zero-sized and nothing is
    /// written through it), and `j < VECTORS`.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn vector(&self, c: &Consts, j: usize, max: &mut [__m512; 2]) -> [__m512; 2] {
        self.prefetch(j);
        let i = j * LANES;
        // SAFETY: i + 16 <= BLOCK, and the caller guarantees whole blocks.
        unsafe {
            let m = decode_m(_mm_loadu_si128(self.m_codes.add(i).cast()), self.m_scale);
            let r = decode_r(_mm_loadu_si128(self.v_codes.add(i).cast()), self.v_scale);
            let [pn, mn, _, rn] = update(
                c,
                _mm512_loadu_ps(self.p.add(i)),
                m,
                _mm512_mul_ps(r, r),
                load_lanes(self.g.add(i)),
            );
            _mm512_storeu_ps(self.p.add(i), pn);
            store_lanes(self.out.add(i), pn);
            max[0] = _mm512_max_ps(max[0], _mm512_abs_ps(mn));
            max[1] = _mm512_max_ps(max[1], rn);
            [mn, rn]
        }
    }

    /// Asks for cache line `j` of each input array of the block [`PREFETCH_BLOCKS`]
    /// ahead (blocks run in address order): on 64M parameters, two threads, 21.4 ms a
    /// step against 25.3 without, 22.2 four ahead and 23.4 eight ahead. A prefetch
    /// never faults, and `wrapping_add` makes no claim that the address lies in the
    /// allocation, so the lines past a slice's end cost a wasted hint, nothing more.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn prefetch(&self, j: usize) {
        let (ahead, line) = (PREFETCH_BLOCKS * q8::BLOCK, j * 64);
        if line < q8::BLOCK * size_of::<f32>() {
            let p = self.p.wrapping_add(ahead).cast::<i8>();
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(line));
        }
        if line < q8::BLOCK * size_of::<G>() {
            let g = self.g.wrapping_add(ahead).cast::<i8>();
            _mm_prefetch::<_MM_HINT_T0>(g.wrapping_add(line));
        }
        if line < q8::BLOCK {
            _mm_prefetch::<_MM_HINT_T0>(self.m_codes.wrapping_add(ahead + line).cast());
            _mm_prefetch::<_MM_HINT_T0>(self.v_codes.wrapping_add(ahead + line).cast());
        }
    }
}

/// Where one block's new codes go, and its inverse scales.
struct Encode {
    m_codes: *mut u8,
    v_codes: *mut u8,
    m_inv: __m512,
    r_inv: __m512,
}

impl Encode {
    /// Writes the codes of vector `j` of the block, its new m and sqrt(v).
    ///
    /// # Safety
    /// The pointers hold a whole block, and `j < VECTORS`.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn vector(&self, [m, r]: [__m512; 2], j: usize) {
        let i = j * LANES;
        // SAFETY: i + 16 <= BLOCK, and the caller guarantees whole blocks.
        unsafe {
            _mm_storeu_si128(
                self.m_codes.add(i).cast(),
                _mm512_cvtepi32_epi8(encode_m(m, self.m_inv)),
            );
            _mm_storeu_si128(
                self.v_codes.add(i).cast(),
                _mm512_cvtepi32_epi8(encode_r(r, self.r_inv)),
            );
        }
    }
}

/// One whole block of 8-bit state: decode, update, re-encode with new scales.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
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

/// A run of whole blocks of 8-bit state, each decoded, updated and re-encoded with its
/// new scales, as one block after the other would be, but software-pipelined: block i
/// is encoded in the same loop that updates block i + 1. The encoding has to wait for
/// the block's new scales, its maxima reduced over all lanes; one block after the other,
/// the divider (square root and division) would idle through that and through the
/// encoding, which uses none (34% faster in cache).
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn q8_blocks<G: Lane, O: Lane>(k: &AdamStep, mut b: Q8Blocks<'_, G, O>) {
    let blocks = b.count();
    let c = Consts::new(k);
    let run = Run::new(&mut b);
    // The new m and sqrt(v) of the block last updated, kept until it is encoded.
    let mut kept = [[_mm512_setzero_ps(); 2]; VECTORS];
    let mut pending: Option<Encode> = None;
    for i in 0..blocks {
        // SAFETY: i < blocks, and `count` checked that every array holds them.
        let u = unsafe { run.update(i, b.m_scales[i], b.v_scales[i]) };
        let mut max = [_mm512_setzero_ps(); 2];
        // SAFETY: `u` and `e` point at whole blocks, and j < VECTORS.
        unsafe {
            match &pending {
                Some(e) => {
                    for (j, slot) in kept.iter_mut().enumerate() {
                        e.vector(*slot, j);
                        *slot = u.vector(&c, j, &mut max);
                    }
                }
                None => {
                    for (j, slot) in kept.iter_mut().enumerate() {
                        *slot = u.vector(&c, j, &mut max);
                    }
                }
            }
        }
        let (m_scale, m_inv) = q8::m_scales(_mm512_reduce_max_ps(max[0]));
        let (v_scale, r_inv) = q8::r_scales(_mm512_reduce_max_ps(max[1]));
        b.m_scales[i] = m_scale;
        b.v_scales[i] = v_scale;
        // SAFETY: as above.
        pending = Some(unsafe { run.encode(i, m_inv, r_inv) });
    }
    if let Some(e) = pending {
        for (j, slot) in kept.iter().enumerate() {
            // SAFETY: `e` points at a whole block, and j < VECTORS.
            unsafe { e.vector(*slot, j) };
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::Isa;

    /// The codes of sixteen values of `|m| * inv` or `r * inv` by `encode` (one of this
    /// file's encoders), as bytes.
    fn encoded(encode: unsafe fn(__m512, __m512) -> __m512i, x: &[f32; 16], inv: f32) -> [u8; 16] {
        let mut codes = [0u8; 16];
        // SAFETY: the caller checked the CPU has AVX-512F; `x` and `codes` hold 16 lanes.
        unsafe {
            let c = encode(_mm512_loadu_ps(x.as_ptr()), _mm512_set1_ps(inv));
            _mm_storeu_si128(codes.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(c));
        }
        codes
    }

    /// The encoders' integer arithmetic is rearranged from `q8::encode_*`: they must agree
    /// on every f32 ([`q8::simd_check::encoders`]).
    #[test]
    fn simd_encoding_matches_the_scalar_definition_on_every_kind_of_value() {
        if !Isa::Avx512.is_supported() {
            return;
        }
        q8::simd_check::encoders(16, |x, inv| {
            let x: &[f32; 16] = x.try_into().unwrap();
            (
                encoded(encode_m, x, inv).to_vec(),
                encoded(encode_r, x, inv).to_vec(),
            )
        });
    }

    #[test]
    fn simd_decoding_matches_the_scalar_definition_on_every_code() {
        if !Isa::Avx512.is_supported() {
            return;
        }
        q8::simd_check::decoders(16, |codes, scale| {
            let (mut m, mut r) = (vec![0f32; 16], vec![0f32; 16]);
            // SAFETY: the CPU has AVX-512F; the vectors hold 16 lanes.
            unsafe {
                let c = _mm_loadu_si128(codes.as_ptr().cast());
                _mm512_storeu_ps(m.as_mut_ptr(), decode_m(c, _mm512_set1_ps(scale)));
                _mm512_storeu_ps(r.as_mut_ptr(), decode_r(c, _mm512_set1_ps(scale)));
            }
            (m, r)
        });
    }
}
