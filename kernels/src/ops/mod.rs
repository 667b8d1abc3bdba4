//! Fast CPU kernels of GPT-2's and the Llama family's forward and backward passes, in
//! f32, and casts between f32, bf16 and fp16, as functions over slices. Each has a scalar
//! twin in [`crate::reference`] that tests compare it with, element by element, on odd
//! sizes. The program kernels' ops live in their families ([`crate::kernel`]) and are
//! gathered here; this module holds what they share: [`Cpu`], the row splitting, the
//! SIMD lanes ([`simd`]), the matrix product ([`gemm()`]) and the casts.
//!
//! - Matrix products are strata's own ([`gemm()`]: packed cache blocks and register
//!   tiles per instruction set, scratch reused per thread so no call allocates), on the
//!   worker pool of [`crate::parallel`].
//! - Elementwise and row-wise kernels are written once over fixed-width lanes and
//!   compiled per instruction set ([`simd`]); a [`Cpu`] says which one and how many
//!   threads a call may use.
//! - Work is split on row (or column) boundaries in a fixed way, so results do not
//!   depend on thread timing.
//!
//! Conventions, shared with the reference: row-major tensors with shapes stated at the
//! top of each kernel; forward kernels overwrite their outputs; backward kernels
//! accumulate (`+=`) into parameter gradients and overwrite activation gradients, except
//! LayerNorm's and RMSNorm's input gradients, which accumulate (the residual stream
//! joins there).
//!
//! This module holds no CUDA code and no model logic.

use std::ops::Range;

use crate::isa::Isa;
use crate::parallel;

mod cast;
pub(crate) mod gemm;
pub mod simd;

pub use cast::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16, round_to_bf16};
pub use gemm::{MatrixMut, MatrixRef, gemm};

// The CPU ops of the program's kernels, each in its family (`crate::kernel`).
pub use crate::kernel::attention::{
    AttnMask, GqaDims, attention_backward, attention_forward, flash_attention_backward,
    flash_attention_forward, flash_scratch_len, gqa_attention_backward, gqa_attention_forward,
    gqa_flash_attention_backward, gqa_flash_attention_forward,
};
pub use crate::kernel::crossentropy::{crossentropy_backward_inplace, crossentropy_forward};
pub use crate::kernel::elementwise::{add_inplace, residual_forward};
pub use crate::kernel::encoder::{encoder_backward, encoder_forward};
pub use crate::kernel::gelu::{gelu_backward, gelu_forward};
pub use crate::kernel::layernorm::{layernorm_backward, layernorm_forward};
pub use crate::kernel::matmul::{WeightLayout, matmul_backward, matmul_forward};
pub use crate::kernel::rmsnorm::{rmsnorm_backward, rmsnorm_forward};
pub use crate::kernel::rope::{
    Llama3Scaling, RopeFreqs, rope_backward, rope_forward, rope_inv_freq, rope_table, rope_table_of,
};
pub use crate::kernel::swiglu::{swiglu_backward, swiglu_forward};

/// Where a CPU kernel runs: which instruction set, and at most how many threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cpu {
    /// The instruction set the elementwise kernels are compiled for.
    pub isa: Isa,
    /// The most threads of [`parallel::pool`] one call may use (at least 1).
    pub threads: usize,
}

impl Default for Cpu {
    /// The active instruction set and every thread of the pool.
    fn default() -> Self {
        Cpu {
            isa: Isa::active(),
            threads: parallel::max_threads(),
        }
    }
}

/// Below this many elements of work per thread, splitting costs more than it saves.
const WORK_PER_THREAD_MIN: usize = 16 * 1024;

impl Cpu {
    /// One thread, this instruction set: for tests and callers that parallelise above.
    pub fn single(isa: Isa) -> Self {
        Cpu { isa, threads: 1 }
    }

    /// How many threads to use for `work` elements of work.
    pub(crate) fn threads_for(&self, work: usize) -> usize {
        (work / WORK_PER_THREAD_MIN).clamp(1, self.threads.max(1))
    }
}

/// A set of mutable buffers that can be cut in two at a row boundary, so that threads
/// can work on disjoint rows of several outputs at once.
pub(crate) trait SplitRows: Send + Sized {
    /// Splits after the first `rows` rows.
    fn split_rows(self, rows: usize) -> (Self, Self);
}

/// A mutable buffer seen as rows of `row_len` elements.
pub(crate) struct RowsMut<'a, T> {
    pub(crate) data: &'a mut [T],
    pub(crate) row_len: usize,
}

impl<'a, T> RowsMut<'a, T> {
    pub(crate) fn new(data: &'a mut [T], row_len: usize) -> Self {
        RowsMut { data, row_len }
    }
}

impl<T: Send> SplitRows for RowsMut<'_, T> {
    fn split_rows(self, rows: usize) -> (Self, Self) {
        let (a, b) = self.data.split_at_mut(rows * self.row_len);
        let row_len = self.row_len;
        (RowsMut { data: a, row_len }, RowsMut { data: b, row_len })
    }
}

impl<A: SplitRows, B: SplitRows> SplitRows for (A, B) {
    fn split_rows(self, rows: usize) -> (Self, Self) {
        let (a0, a1) = self.0.split_rows(rows);
        let (b0, b1) = self.1.split_rows(rows);
        ((a0, b0), (a1, b1))
    }
}

impl<A: SplitRows, B: SplitRows, C: SplitRows> SplitRows for (A, B, C) {
    fn split_rows(self, rows: usize) -> (Self, Self) {
        let (a0, a1) = self.0.split_rows(rows);
        let (b0, b1) = self.1.split_rows(rows);
        let (c0, c1) = self.2.split_rows(rows);
        ((a0, b0, c0), (a1, b1, c1))
    }
}

/// Runs `f(rows, part)` on up to `threads` threads, where `rows` is a contiguous range of
/// `0..row_count` starting at a multiple of `align` and `part` the matching rows of
/// `parts`. Returns when all have finished; with one range, runs on the calling thread.
pub(crate) fn par_rows<S, F>(threads: usize, row_count: usize, align: usize, parts: S, f: F)
where
    S: SplitRows,
    F: Fn(Range<usize>, S) + Sync,
{
    parallel::for_each_split(
        row_count,
        threads,
        align,
        parts,
        &|parts: S, rows| parts.split_rows(rows),
        &f,
    );
}

/// Runs `f(range, &mut out[range])` over contiguous pieces of `out` that start at
/// multiples of `align`, on as many threads as its length warrants.
pub(crate) fn par_chunks<T: Send>(
    cpu: &Cpu,
    out: &mut [T],
    align: usize,
    f: impl Fn(Range<usize>, &mut [T]) + Sync,
) {
    let n = out.len();
    par_rows(
        cpu.threads_for(n),
        n,
        align,
        RowsMut::new(out, 1),
        |r, out| f(r, out.data),
    );
}
