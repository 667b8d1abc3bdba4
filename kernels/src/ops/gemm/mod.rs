//! strata's f32 matrix product: `dst (m × n) = [dst +] scale · lhs (m × k) @ rhs (k × n)`
//! over strided views, the one routine behind the linear layers and attention.
//!
//! The design is BLIS's. The product is cut into blocks sized for the caches: NC columns
//! of the right operand (its packed KC × NC block stays in L2 or L3), KC steps of k, and
//! MC rows of the left operand (its MC × KC block stays in L2). The right operand's
//! block is packed into scratch in the order the register tiles ([`tile`]) read it
//! ([`pack`]), whatever its strides; so is the left operand's, unless its rows are
//! contiguous, in which case tiles read it where it lies (a tile reads MR short runs,
//! and packing would only copy them). A tile computes MR × NR elements of `dst` with
//! all its partial sums in registers. Tile shapes per instruction set ([`Isa`]): 6 × 16
//! with AVX2+FMA (12 of the 16 ymm registers hold sums), 12 × 32 with AVX-512F (24 of
//! the 32 zmm), 4 × 8 in portable Rust. Edges (m, n not multiples of the tile) are
//! zero-padded in the packed panels and computed by the same tile into a buffer; a k that
//! is not a multiple of KC ends with a shorter block.
//!
//! Scratch: each piece of a product borrows a 64-byte-aligned packing buffer of 1.2 MiB
//! (the size of the largest blocks) from a pool the first product fills with more
//! buffers than threads can run pieces at once, so after the first product no call
//! allocates, whichever thread runs it.
//!
//! Threads: with `threads > 1` the product is split over the worker pool
//! ([`crate::parallel::for_each_split`], which allocates nothing) into contiguous ranges of
//! whole tiles along n (or along m, when m has more tiles than n); each part packs its own
//! blocks. k is never split.
//!
//! Determinism: every element of `dst` is the same chain of operations wherever it falls
//! — its KC-long blocks of k in order, each summed from zero by multiply-adds in order
//! and added to `dst` (or to the previous blocks' total) once, times `scale` — so the
//! result depends on the shape and the instruction set only: not on the thread count,
//! the split, or the element's position in a tile. (The portable tile rounds the
//! multiply and the add separately, AVX2 and AVX-512 fuse them: the instruction sets
//! agree to rounding, not bit for bit.)

use std::sync::Mutex;

use super::simd;
use super::{Cpu, Isa};
use crate::parallel;

mod operand;
mod pack;
mod tile;

pub(crate) use operand::Operand;
use tile::Lanes;

/// One matrix product `dst (m, n) = [dst +] lhs (m, k) @ rhs (k, n) * scale`, over
/// strided views; `dst`'s column stride is 1.
#[derive(Clone, Copy)]
pub(crate) struct Product {
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) dst: *mut f32,
    pub(crate) dst_row_stride: isize,
    /// Add to `dst` rather than overwrite it.
    pub(crate) accumulate: bool,
    pub(crate) lhs: Operand,
    pub(crate) rhs: Operand,
    pub(crate) scale: f32,
}

// SAFETY: the pointers are used only inside `run`, which returns after the product is
// done, while its caller keeps the memory alive and unshared, as `run`'s contract says.
unsafe impl Send for Product {}

/// Below this many multiply-adds per thread, splitting a product costs more than it
/// saves (a part of 2^20 takes some 20 µs on one AVX2 core).
const FMA_PER_THREAD_MIN: usize = 1 << 20;

/// Cache block sizes and the tile's shape, for one instruction set.
#[derive(Clone, Copy)]
struct Blocking {
    /// Rows of a tile.
    mr: usize,
    /// Columns of a tile.
    nr: usize,
    /// Steps of k per packed block: a tile's two panels (KC × (MR + NR) f32, 22 KiB for
    /// AVX2) stay in L1 while it runs.
    kc: usize,
    /// Rows of the left operand per packed block (MC × KC, 144 KiB): stays in L2.
    mc: usize,
    /// Columns of the right operand per packed block (KC × NC, 1 MiB): stays in L2 and
    /// L3. Each block of NC columns repacks the left operand's blocks, which costs
    /// about 1/NC of the multiply-adds.
    nc: usize,
}

/// Every instruction set's blocks: the tile differs, the cache blocks do not.
const KC: usize = 256;
const MC: usize = 144;
const NC: usize = 1024;

/// f32 of scratch a thread packs into: one block of each operand.
const SCRATCH_LEN: usize = (MC + NC) * KC;

impl Blocking {
    const PORTABLE: Blocking = Blocking {
        mr: 4,
        nr: 8,
        kc: KC,
        mc: MC,
        nc: NC,
    };
    const AVX2: Blocking = Blocking {
        mr: 6,
        nr: 16,
        kc: KC,
        mc: MC,
        nc: NC,
    };
    const AVX512: Blocking = Blocking {
        mr: 12,
        nr: 32,
        kc: KC,
        mc: MC,
        nc: NC,
    };

    fn of(isa: Isa) -> Blocking {
        match isa {
            Isa::Portable => Blocking::PORTABLE,
            Isa::Avx2 => Blocking::AVX2,
            Isa::Avx512 => Blocking::AVX512,
        }
    }
}

impl Product {
    /// Computes the product with `isa`'s tiles on up to `threads` threads of the pool.
    ///
    /// # Safety
    /// Every element addressed through the pointers and strides (m × n for `dst`, m × k
    /// for `lhs`, k × n for `rhs`) must lie inside one live allocation; `dst`'s row
    /// stride must be at least n (when m > 1); `dst`'s elements must not overlap `lhs`'s
    /// or `rhs`'s, and nothing else may access them during the call. The CPU must
    /// support `isa`.
    pub(crate) unsafe fn run(self, isa: Isa, threads: usize) {
        if self.m == 0 || self.n == 0 {
            return;
        }
        if self.k == 0 {
            if !self.accumulate {
                for i in 0..self.m {
                    // SAFETY: row i's n elements of dst are the caller's to write.
                    let row = unsafe {
                        std::slice::from_raw_parts_mut(
                            self.dst.offset(i as isize * self.dst_row_stride),
                            self.n,
                        )
                    };
                    row.fill(0.0);
                }
            }
            return;
        }
        let blocking = Blocking::of(isa);
        let work = self.m.saturating_mul(self.n).saturating_mul(self.k);
        let threads = threads.min(work / FMA_PER_THREAD_MIN).max(1);
        let part = |_, part: Product| {
            // SAFETY: each part is a disjoint piece of this product's dst, with the
            // operands' matching rows or columns; the caller's contract covers them.
            unsafe { part.run_here(isa, blocking) }
        };
        if self.n.div_ceil(blocking.nr) >= self.m.div_ceil(blocking.mr) {
            let split = |p: Product, cols| p.split_cols(cols);
            parallel::for_each_split(self.n, threads, blocking.nr, self, &split, &part);
        } else {
            let split = |p: Product, rows| p.split_rows(rows);
            parallel::for_each_split(self.m, threads, blocking.mr, self, &split, &part);
        }
    }

    /// The first `cols` columns of the product, and the rest.
    fn split_cols(self, cols: usize) -> (Product, Product) {
        let rest = Product {
            n: self.n - cols,
            dst: self.dst.wrapping_add(cols),
            rhs: self.rhs.at(0, cols),
            ..self
        };
        (Product { n: cols, ..self }, rest)
    }

    /// The first `rows` rows of the product, and the rest.
    fn split_rows(self, rows: usize) -> (Product, Product) {
        let rest = Product {
            m: self.m - rows,
            dst: self
                .dst
                .wrapping_offset(rows as isize * self.dst_row_stride),
            lhs: self.lhs.at(rows, 0),
            ..self
        };
        (Product { m: rows, ..self }, rest)
    }

    /// Computes the whole product on this thread, in this thread's scratch.
    ///
    /// # Safety
    /// As for [`Product::run`], with m, n, k > 0 and `blocking` `isa`'s.
    unsafe fn run_here(self, isa: Isa, blocking: Blocking) {
        with_scratch(|scratch| match isa {
            // SAFETY: passed on from this function's contract; `blocking` matches each
            // tile's shape, and `simd::run` checks that the CPU supports the set.
            Isa::Portable => unsafe { self.blocked::<tile::Portable, 4, 1, 8>(blocking, scratch) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 => simd::run(
                isa,
                #[inline(always)]
                // SAFETY: as above.
                || unsafe {
                    use std::arch::x86_64::{__m256, __m512};
                    if isa == Isa::Avx2 {
                        self.blocked::<__m256, 6, 2, 16>(blocking, scratch)
                    } else {
                        self.blocked::<__m512, 12, 2, 32>(blocking, scratch)
                    }
                },
            ),
            #[cfg(not(target_arch = "x86_64"))]
            _ => panic!("{isa} kernels exist only on x86-64"),
        })
    }

    /// The blocked loops around tiles of `MR` rows and `NV` registers `V` (`NR` f32) of
    /// columns.
    ///
    /// # Safety
    /// As for [`Product::run_here`]; the CPU supports `V`'s instruction set.
    #[inline(always)]
    unsafe fn blocked<V: Lanes, const MR: usize, const NV: usize, const NR: usize>(
        &self,
        blocking: Blocking,
        scratch: &mut [f32],
    ) {
        let nr = NR;
        assert!(blocking.mr == MR && blocking.nr == NR && NR == NV * V::WIDTH);
        assert!(blocking.mc.is_multiple_of(MR) && blocking.nc.is_multiple_of(NR));
        let ldc = self.dst_row_stride as usize;
        let (a_packed, b_packed) = scratch.split_at_mut(blocking.mc * blocking.kc);
        for jc in (0..self.n).step_by(blocking.nc) {
            let nc = blocking.nc.min(self.n - jc);
            for pc in (0..self.k).step_by(blocking.kc) {
                let kc = blocking.kc.min(self.k - pc);
                // The first block of k overwrites dst unless the product accumulates;
                // later blocks add to what the earlier ones left.
                let add = self.accumulate || pc > 0;
                // SAFETY: rows pc..pc + kc, columns jc..jc + nc of rhs are inside it.
                unsafe { pack::panels::<V, NR>(b_packed, self.rhs.at(pc, jc), kc, nc) };
                for ic in (0..self.m).step_by(blocking.mc) {
                    let mc = blocking.mc.min(self.m - ic);
                    // A left operand whose rows are contiguous is read where it lies
                    // (a tile reads MR short runs of it, all from cache); one with
                    // any other strides is packed. So is a last panel short of MR
                    // rows, whose missing rows the panel fills with zeros.
                    let direct = self.lhs.col_stride == 1 && self.lhs.row_stride > 0;
                    let (pack_from, pack_rows) = if direct {
                        let short = mc % MR;
                        (mc - short, short)
                    } else {
                        (0, mc)
                    };
                    if pack_rows > 0 {
                        let lhs = self.lhs.at(ic + pack_from, pc).transposed();
                        let panels = &mut a_packed[pack_from * kc..];
                        // SAFETY: rows ic + pack_from..ic + mc, columns pc..pc + kc of
                        // lhs are inside it.
                        unsafe { pack::panels::<V, MR>(panels, lhs, kc, pack_rows) };
                    }
                    for jr in (0..nc).step_by(nr) {
                        let cols = nr.min(nc - jr);
                        let b = b_packed[jr * kc..].as_ptr();
                        for ir in (0..mc).step_by(MR) {
                            let rows = MR.min(mc - ir);
                            let a = if ir < pack_from {
                                tile::Rows {
                                    ptr: self.lhs.at(ic + ir, pc).ptr,
                                    row_stride: self.lhs.row_stride as usize,
                                    step_stride: 1,
                                }
                            } else {
                                tile::Rows {
                                    ptr: a_packed[ir * kc..].as_ptr(),
                                    row_stride: 1,
                                    step_stride: MR,
                                }
                            };
                            let c = self.dst.wrapping_add((ic + ir) * ldc + jc + jr);
                            // SAFETY: the left rows (in lhs or packed) hold kc steps of
                            // MR values, the packed panel of rhs kc steps of nr; the
                            // tile's rows × cols elements of dst are this product's, and
                            // the instruction set is the caller's promise.
                            unsafe {
                                if rows == MR && cols == nr {
                                    tile::full::<V, MR, NV>(kc, a, b, c, ldc, self.scale, add)
                                } else {
                                    tile::edge::<V, MR, NV>(
                                        kc,
                                        a,
                                        b,
                                        c,
                                        ldc,
                                        (rows, cols),
                                        self.scale,
                                        add,
                                    )
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Packing buffers, each [`SCRATCH_LEN`] f32 and 15 spare (for 64-byte alignment),
/// lent to one product piece at a time. The first product makes [`scratch_start`] of them
/// (zeroed memory the system maps lazily: a buffer costs resident memory only once
/// used), more than the threads that can run a product at once in the engine (the pool's
/// threads and the device's and the executor's lanes), so that after the first product
/// none allocates, whichever thread runs which piece.
static SCRATCH: Mutex<Vec<Box<[f32]>>> = Mutex::new(Vec::new());

/// Buffers beyond the pool's threads the first product makes.
const SCRATCH_LANES: usize = 8;

/// How many buffers the first product makes.
fn scratch_start() -> usize {
    crate::parallel::max_threads() + SCRATCH_LANES
}

fn new_scratch() -> Box<[f32]> {
    const SPARE: usize = 64 / size_of::<f32>() - 1;
    vec![0.0; SCRATCH_LEN + SPARE].into_boxed_slice()
}

/// Runs `f` on a packing buffer of the pool's ([`SCRATCH_LEN`] f32, 64-byte aligned),
/// taken for the call and given back after.
fn with_scratch<R>(f: impl FnOnce(&mut [f32]) -> R) -> R {
    let taken = {
        let mut pool = SCRATCH.lock().unwrap_or_else(|e| e.into_inner());
        if pool.capacity() == 0 {
            let start = scratch_start();
            pool.reserve_exact(start);
            pool.extend((0..start).map(|_| new_scratch()));
        }
        pool.pop()
    };
    // More pieces at once than the pool was made for: one more buffer, kept after.
    let mut buffer = taken.unwrap_or_else(new_scratch);
    let start = buffer.as_ptr().align_offset(64);
    let result = f(&mut buffer[start..start + SCRATCH_LEN]);
    SCRATCH
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(buffer);
    result
}

/// A read-only strided view of an f32 matrix: element (i, j) is
/// `data[i · row_stride + j · col_stride]`.
#[derive(Debug, Clone, Copy)]
pub struct MatrixRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a> MatrixRef<'a> {
    /// The view of `rows × cols` elements of `data` at these strides. Panics if an
    /// element lies outside `data`.
    pub fn new(
        data: &'a [f32],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Self {
        check_extent(data.len(), rows, cols, row_stride, col_stride);
        MatrixRef {
            data,
            rows,
            cols,
            row_stride,
            col_stride,
        }
    }

    /// `data` as a row-major `rows × cols` matrix.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        MatrixRef::new(data, rows, cols, cols, 1)
    }

    /// The same elements seen transposed (`cols × rows`), without copying.
    pub fn transposed(self) -> Self {
        MatrixRef {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    fn operand(&self) -> Operand {
        Operand {
            ptr: self.data.as_ptr(),
            row_stride: self.row_stride as isize,
            col_stride: self.col_stride as isize,
        }
    }
}

/// A writable view of an f32 matrix whose rows are contiguous: element (i, j) is
/// `data[i · row_stride + j]`.
#[derive(Debug)]
pub struct MatrixMut<'a> {
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
}

impl<'a> MatrixMut<'a> {
    /// The view of `rows × cols` elements of `data`, rows `row_stride` apart. Panics if
    /// an element lies outside `data` or rows overlap (`row_stride < cols`).
    pub fn new(data: &'a mut [f32], rows: usize, cols: usize, row_stride: usize) -> Self {
        assert!(
            rows <= 1 || row_stride >= cols,
            "rows of {cols} elements {row_stride} apart overlap"
        );
        check_extent(data.len(), rows, cols, row_stride, 1);
        MatrixMut {
            data,
            rows,
            cols,
            row_stride,
        }
    }

    /// `data` as a row-major `rows × cols` matrix.
    pub fn row_major(data: &'a mut [f32], rows: usize, cols: usize) -> Self {
        MatrixMut::new(data, rows, cols, cols)
    }
}

/// Panics unless every element of a `rows × cols` view at these strides lies in the
/// first `len` elements.
fn check_extent(len: usize, rows: usize, cols: usize, row_stride: usize, col_stride: usize) {
    if rows == 0 || cols == 0 {
        return;
    }
    let last = (rows - 1).checked_mul(row_stride).and_then(|r| {
        (cols - 1)
            .checked_mul(col_stride)
            .and_then(|c| r.checked_add(c))
    });
    assert!(
        last.is_some_and(|last| last < len),
        "a {rows} × {cols} view at strides ({row_stride}, {col_stride}) does not fit in {len} elements"
    );
}

/// dst: (M, N) = [dst +] `scale` · lhs: (M, K) @ rhs: (K, N), on `cpu`'s instruction
/// set and up to its thread count. The result does not depend on the thread count (see
/// the module's documentation). Panics if the shapes disagree.
pub fn gemm(
    cpu: &Cpu,
    dst: MatrixMut<'_>,
    lhs: MatrixRef<'_>,
    rhs: MatrixRef<'_>,
    scale: f32,
    accumulate: bool,
) {
    assert_eq!(
        lhs.cols, rhs.rows,
        "lhs is {} × {}, rhs {} × {}",
        lhs.rows, lhs.cols, rhs.rows, rhs.cols
    );
    assert_eq!(
        (dst.rows, dst.cols),
        (lhs.rows, rhs.cols),
        "dst's shape is not lhs's rows × rhs's columns"
    );
    // SAFETY: the views' constructors checked that every element lies in its slice;
    // dst is a &mut slice (so it overlaps neither operand, and nothing else touches
    // it), its rows do not overlap (checked by MatrixMut::new); `simd::run` checks the
    // instruction set.
    unsafe {
        Product {
            m: dst.rows,
            n: dst.cols,
            k: lhs.cols,
            dst: dst.data.as_mut_ptr(),
            dst_row_stride: dst.row_stride as isize,
            accumulate,
            lhs: lhs.operand(),
            rhs: rhs.operand(),
            scale,
        }
        .run(cpu.isa, cpu.threads)
    }
}
