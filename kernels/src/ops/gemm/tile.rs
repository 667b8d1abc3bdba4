//! The register tiles of the matrix product (its micro-kernels): MR rows × NR columns of
//! the destination, computed from one packed panel of the left operand (MR values per
//! step of k) and one of the right operand (NR values per step of k), with every
//! partial sum held in registers until the panel's last step.
//!
//! A tile is written once, generic over [`Lanes`] (one SIMD register of f32) and the
//! tile's shape; each instruction set supplies its register type: 8 plain f32 for the
//! portable path (which the compiler maps onto whatever vectors the baseline target
//! has), AVX2's `__m256` and AVX-512's `__m512`. The tile is inlined into the driver,
//! which [`super::super::simd::run`] compiles with the matching `#[target_feature]`, so
//! the register type's intrinsics become single instructions there. This file and
//! `simd.rs` are the CPU kernels' only SIMD intrinsics besides the fp16 casts.
//!
//! Every element of a tile is one chain of multiply-adds over k in increasing order,
//! the same chain whichever tile, thread or block holds it: that is what makes the
//! product's result independent of how its work is split.

/// One SIMD register of f32 lanes, and the few operations a tile performs on it.
///
/// Every method is `unsafe` for one shared reason, besides the pointer rules each
/// states: it may run an instruction of the register's instruction set, which the CPU
/// must support (the driver runs a tile only inside `simd::run` for that set).
pub(super) trait Lanes: Copy {
    /// f32 values per register.
    const WIDTH: usize;
    /// All lanes zero.
    ///
    /// # Safety
    /// The CPU supports the register's instruction set.
    unsafe fn zero() -> Self;
    /// All lanes `x`.
    ///
    /// # Safety
    /// As for [`Lanes::zero`].
    unsafe fn splat(x: f32) -> Self;
    /// [`Lanes::WIDTH`] values from `src` (no alignment needed).
    ///
    /// # Safety
    /// As for [`Lanes::zero`]; `src` points to `WIDTH` readable f32.
    unsafe fn load(src: *const f32) -> Self;
    /// Writes the lanes to `dst` (no alignment needed).
    ///
    /// # Safety
    /// As for [`Lanes::zero`]; `dst` points to `WIDTH` writable f32.
    unsafe fn store(self, dst: *mut f32);
    /// `self * b + c`, lane by lane (fused, one rounding, where the set has FMA).
    ///
    /// # Safety
    /// As for [`Lanes::zero`].
    unsafe fn mul_add(self, b: Self, c: Self) -> Self;
    /// `self * b`, lane by lane.
    ///
    /// # Safety
    /// As for [`Lanes::zero`].
    unsafe fn mul(self, b: Self) -> Self;

    /// Copies an 8 × 8 block transposed: for q and j in 0..8, `dst[q · stride + j] =
    /// src[j][q]`. (Packing uses it where the right operand's columns are contiguous.)
    /// Plain copies here; the x86-64 registers do it in AVX registers.
    ///
    /// # Safety
    /// As for [`Lanes::zero`]; each `src[j]` points to 8 readable f32, `dst` to 8
    /// writable f32 at each of 8 rows `stride` apart, none overlapping the sources.
    #[inline(always)]
    unsafe fn transpose8(src: [*const f32; 8], dst: *mut f32, stride: usize) {
        for (j, column) in src.iter().enumerate() {
            for q in 0..8 {
                // SAFETY: the caller vouches for src[j][..8] and dst's 8 rows of 8.
                unsafe { *dst.add(q * stride + j) = *column.add(q) };
            }
        }
    }
}

/// Asks the CPU to bring the cache line holding `p` into L1 ahead of its use (a hint:
/// nothing is read, so any address is allowed; a no-op off x86-64).
#[inline(always)]
fn prefetch(p: *const f32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing and cannot fault, whatever the address; SSE is
    // part of every x86-64 CPU.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Eight f32 in plain Rust: the portable register. Its multiply-add rounds twice (a
/// fused one would be a libm call on CPUs without FMA).
#[derive(Clone, Copy)]
pub(super) struct Portable([f32; 8]);

impl Lanes for Portable {
    const WIDTH: usize = 8;

    #[inline(always)]
    unsafe fn zero() -> Self {
        Portable([0.0; 8])
    }

    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Portable([x; 8])
    }

    #[inline(always)]
    unsafe fn load(src: *const f32) -> Self {
        // SAFETY: the caller guarantees 8 readable f32 at `src`; read_unaligned needs no
        // alignment beyond that of u8.
        Portable(unsafe { src.cast::<[f32; 8]>().read_unaligned() })
    }

    #[inline(always)]
    unsafe fn store(self, dst: *mut f32) {
        // SAFETY: the caller guarantees 8 writable f32 at `dst`.
        unsafe { dst.cast::<[f32; 8]>().write_unaligned(self.0) }
    }

    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        Portable(std::array::from_fn(|i| self.0[i] * b.0[i] + c.0[i]))
    }

    #[inline(always)]
    unsafe fn mul(self, b: Self) -> Self {
        Portable(std::array::from_fn(|i| self.0[i] * b.0[i]))
    }
}

/// Implements [`Lanes`] for an x86-64 register type by its intrinsics: all zero, set
/// from one value, unaligned load, unaligned store, fused multiply-add, multiply.
#[cfg(target_arch = "x86_64")]
macro_rules! x86_lanes {
    ($register:ident, $width:literal: $zero:ident, $splat:ident, $load:ident, $store:ident,
     $mul_add:ident, $mul:ident) => {
        impl Lanes for std::arch::x86_64::$register {
            const WIDTH: usize = $width;

            #[inline(always)]
            unsafe fn zero() -> Self {
                // SAFETY: the caller runs this only where the CPU has the register's
                // instruction set (the trait's contract), as for every method here.
                unsafe { std::arch::x86_64::$zero() }
            }

            #[inline(always)]
            unsafe fn splat(x: f32) -> Self {
                // SAFETY: as in `zero`.
                unsafe { std::arch::x86_64::$splat(x) }
            }

            #[inline(always)]
            unsafe fn load(src: *const f32) -> Self {
                // SAFETY: as in `zero`; `WIDTH` readable f32 at `src`, as the caller
                // guarantees, are all the unaligned load needs.
                unsafe { std::arch::x86_64::$load(src) }
            }

            #[inline(always)]
            unsafe fn store(self, dst: *mut f32) {
                // SAFETY: as in `zero`; `WIDTH` writable f32 at `dst`, as the caller
                // guarantees.
                unsafe { std::arch::x86_64::$store(dst, self) }
            }

            #[inline(always)]
            unsafe fn mul_add(self, b: Self, c: Self) -> Self {
                // SAFETY: as in `zero` (the AVX2 set includes FMA).
                unsafe { std::arch::x86_64::$mul_add(self, b, c) }
            }

            #[inline(always)]
            unsafe fn mul(self, b: Self) -> Self {
                // SAFETY: as in `zero`.
                unsafe { std::arch::x86_64::$mul(self, b) }
            }

            #[inline(always)]
            unsafe fn transpose8(src: [*const f32; 8], dst: *mut f32, stride: usize) {
                // SAFETY: as in `zero` (both sets include AVX); the pointers are the
                // caller's promise.
                unsafe { transpose8_avx(src, dst, stride) }
            }
        }
    };
}

/// [`Lanes::transpose8`] in eight AVX registers: pairs of rows interleaved, then
/// pairs of pairs, then the 128-bit halves exchanged.
///
/// # Safety
/// As for [`Lanes::transpose8`], on a CPU with AVX.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn transpose8_avx(src: [*const f32; 8], dst: *mut f32, stride: usize) {
    use std::arch::x86_64::*;
    // SAFETY: AVX and the pointers as the caller promises; every load reads src[j][..8],
    // every store writes row q's 8 values.
    unsafe {
        let r: [__m256; 8] = std::array::from_fn(|j| _mm256_loadu_ps(src[j]));
        // t[2i] = r[2i], r[2i+1] interleaved by element: (0, 1) and (4, 5) of each
        // half; t[2i+1] the same of elements (2, 3) and (6, 7).
        let t: [__m256; 8] = std::array::from_fn(|i| {
            let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
            if i % 2 == 0 {
                _mm256_unpacklo_ps(a, b)
            } else {
                _mm256_unpackhi_ps(a, b)
            }
        });
        // u[q] for q in 0..4: element q of rows 0-3 in its low half, element q + 4 in
        // its high half; u[q + 4] the same of rows 4-7.
        let u = [
            _mm256_shuffle_ps::<0x44>(t[0], t[2]),
            _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
            _mm256_shuffle_ps::<0x44>(t[1], t[3]),
            _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
            _mm256_shuffle_ps::<0x44>(t[4], t[6]),
            _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
            _mm256_shuffle_ps::<0x44>(t[5], t[7]),
            _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
        ];
        for q in 0..4 {
            let low = _mm256_permute2f128_ps::<0x20>(u[q], u[q + 4]);
            let high = _mm256_permute2f128_ps::<0x31>(u[q], u[q + 4]);
            _mm256_storeu_ps(dst.add(q * stride), low);
            _mm256_storeu_ps(dst.add((q + 4) * stride), high);
        }
    }
}

#[cfg(target_arch = "x86_64")]
x86_lanes!(__m256, 8: _mm256_setzero_ps, _mm256_set1_ps, _mm256_loadu_ps, _mm256_storeu_ps,
    _mm256_fmadd_ps, _mm256_mul_ps);
#[cfg(target_arch = "x86_64")]
x86_lanes!(__m512, 16: _mm512_setzero_ps, _mm512_set1_ps, _mm512_loadu_ps, _mm512_storeu_ps,
    _mm512_fmadd_ps, _mm512_mul_ps);

/// The most f32 a tile holds (AVX-512's 12 × 32): the size of the stack buffer an edge
/// tile is computed in.
pub(super) const TILE_MAX: usize = 12 * 32;

/// Where a tile reads its MR rows of the left operand: row i's value at step p is
/// `ptr[i · row_stride + p · step_stride]`. Packed, that is (1, MR); a row-major left
/// operand is read where it lies, at (its row stride, 1).
#[derive(Clone, Copy)]
pub(super) struct Rows {
    pub(super) ptr: *const f32,
    pub(super) row_stride: usize,
    pub(super) step_stride: usize,
}

/// One full tile: `c` (MR rows of NV·WIDTH, row stride `ldc`) = [`c` +] `scale` ·
/// Σ_p a_p b_pᵀ over the `kc` steps, where step p of `a` is MR values (one per row) and
/// step p of the packed panel `b` is NV·WIDTH values (one per column). Each element's
/// sum starts at zero and adds its k terms in order; `scale` is applied to the sum once.
///
/// # Safety
/// The CPU supports `V`'s instruction set; `a` addresses `kc` readable steps of MR
/// values and `b` holds `kc · NV · WIDTH` readable f32; the tile's elements of `c` are
/// writable, and readable when `add`.
#[inline(always)]
pub(super) unsafe fn full<V: Lanes, const MR: usize, const NV: usize>(
    kc: usize,
    a: Rows,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    scale: f32,
    add: bool,
) {
    // SAFETY: every pointer below stays inside the operands (step p < kc reads a's
    // rows at step p and b[p·NV·WIDTH..]) or inside the tile of `c`, all of which the
    // caller vouches for, as for the instruction set.
    unsafe {
        // The tile of dst is read (or written) only after the kc steps; ask for its lines
        // now, so that a dst far out of cache (the logits, say) costs no wait then.
        for i in 0..MR {
            prefetch(c.wrapping_add(i * ldc));
            prefetch(c.wrapping_add(i * ldc + NV * V::WIDTH - 1));
        }
        let mut acc = [[V::zero(); NV]; MR];
        let (mut a_step, mut b) = (a.ptr, b);
        for _ in 0..kc {
            let mut bv = [V::zero(); NV];
            for (v, lanes) in bv.iter_mut().enumerate() {
                *lanes = V::load(b.add(v * V::WIDTH));
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let ai = V::splat(*a_step.add(i * a.row_stride));
                for (sum, &bj) in row.iter_mut().zip(&bv) {
                    *sum = ai.mul_add(bj, *sum);
                }
            }
            a_step = a_step.add(a.step_stride);
            b = b.add(NV * V::WIDTH);
        }
        let s = V::splat(scale);
        for (i, row) in acc.iter().enumerate() {
            for (v, &sum) in row.iter().enumerate() {
                let dst = c.add(i * ldc + v * V::WIDTH);
                let out = if add {
                    sum.mul_add(s, V::load(dst))
                } else {
                    sum.mul(s)
                };
                out.store(dst);
            }
        }
    }
}

/// An edge tile: as [`full`] for the first `rows` rows and `cols` columns of the tile
/// only. The whole tile is computed into a buffer on the stack by [`full`] itself (the
/// panels are zero past the edge), so an edge element is the very same chain of
/// operations as an inner one; then only the valid part is copied out.
///
/// # Safety
/// As for [`full`], for the `rows × cols` elements of `c`; `rows <= MR`, `cols <= NV ·
/// WIDTH`, and `MR · NV · WIDTH <= TILE_MAX`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn edge<V: Lanes, const MR: usize, const NV: usize>(
    kc: usize,
    a: Rows,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    (rows, cols): (usize, usize),
    scale: f32,
    add: bool,
) {
    let nr = NV * V::WIDTH;
    debug_assert!(rows <= MR && cols <= nr && MR * nr <= TILE_MAX);
    let mut buffer = [0.0f32; TILE_MAX];
    // SAFETY: the caller vouches for rows × cols elements of `c` at row stride `ldc`
    // (read only when `add`); the buffer holds MR rows of nr, the tile [`full`] writes.
    unsafe {
        if add {
            for i in 0..rows {
                std::ptr::copy_nonoverlapping(
                    c.add(i * ldc),
                    buffer.as_mut_ptr().add(i * nr),
                    cols,
                );
            }
        }
        full::<V, MR, NV>(kc, a, b, buffer.as_mut_ptr(), nr, scale, add);
        for i in 0..rows {
            std::ptr::copy_nonoverlapping(buffer.as_ptr().add(i * nr), c.add(i * ldc), cols);
        }
    }
}
