//! The attention kernels' shapes ([`Heads`] for GPT-2's, [`GqaDims`] for
//! grouped-query attention, each checked), and the scratch each needs per target: on the
//! CPU the backward's softmax gradient, on CUDA the regions of
//! [`attention_scratch_layout`] that the launch sequences carve.

use super::cpu::GqaDims;
use crate::program::{Dtype, KernelError, Target};

/// GPT-2's attention: NH heads of C / NH channels over B × T positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    /// Batch.
    pub b: usize,
    /// Sequence.
    pub t: usize,
    /// Channels.
    pub c: usize,
    /// Heads.
    pub nh: usize,
}

impl Heads {
    /// The dimensions, when the heads divide the channels (both positive).
    pub fn checked(
        kernel: &'static str,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> Result<Self, KernelError> {
        if nh == 0 || c == 0 || !c.is_multiple_of(nh) {
            return Err(KernelError::Shape {
                kernel,
                what: "c (channels, a positive multiple of nh)",
                len: c,
                expected: c.next_multiple_of(nh.max(1)).max(nh.max(1)),
            });
        }
        Ok(Heads { b, t, c, nh })
    }

    /// Channels per head.
    pub fn hs(&self) -> usize {
        self.c / self.nh
    }
}

impl GqaDims {
    /// The dimensions, when `kv` divides `h` (both positive).
    pub fn checked(
        kernel: &'static str,
        b: usize,
        t: usize,
        h: usize,
        kv: usize,
        d: usize,
    ) -> Result<Self, KernelError> {
        if kv == 0 || !h.is_multiple_of(kv) {
            return Err(KernelError::Shape {
                kernel,
                what: "h (query heads, a positive multiple of kv)",
                len: h,
                expected: h.next_multiple_of(kv.max(1)).max(kv.max(1)),
            });
        }
        Ok(GqaDims { b, t, h, kv, d })
    }
}

/// Bytes of scratch [`Attention`](super::Attention) and [`AttentionBackward`](super::AttentionBackward) need on
/// `target` for a batch of `b` × `t` tokens, `c` channels in `nh` heads, activations of
/// `dtype`: on the CPU the backward's softmax gradient (B, NH, T, T) in f32; on CUDA the
/// regions of [`attention_scratch_layout`].
pub fn attention_scratch_bytes(
    target: Target,
    dtype: Dtype,
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> usize {
    match target {
        Target::Cpu => b * nh * t * t * 4,
        Target::Cuda => attention_scratch_layout(dtype, b, t, c, nh).total_bytes,
    }
}

/// Where each region of the CUDA attention kernels' scratch starts, in bytes from the
/// scratch's start (see [`attention_scratch_layout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionScratchLayout {
    /// Q per head, (B, NH, T, HS) in the working dtype.
    pub q: usize,
    /// K per head, likewise.
    pub k: usize,
    /// V per head, likewise.
    pub v: usize,
    /// The output per head (forward), or its gradient (backward), likewise.
    pub y: usize,
    /// The gradient of Q per head, likewise.
    pub dq: usize,
    /// The gradient of K per head, likewise.
    pub dk: usize,
    /// The gradient of V per head, likewise.
    pub dv: usize,
    /// The scaled scores Q K^T (forward) or the gradient of the probabilities (backward),
    /// (B, NH, T, T) in f32.
    pub scores: usize,
    /// The gradient of the scaled scores, (B, NH, T, T) in the working dtype.
    pub dscores: usize,
    /// Bytes of the whole scratch.
    pub total_bytes: usize,
}

/// The CUDA attention kernels' scratch, for activations of `dtype` (f32, bf16 or f16):
/// seven (B, T, C) tensors of `dtype` (q, k, v, y, dq, dk, dv), the f32 scores
/// (B, NH, T, T), then the scores' gradient (B, NH, T, T) of `dtype`, in that order, each
/// starting at a multiple of 256 bytes from the scratch's start. The forward uses q, k,
/// v, y and the scores; the backward all of them. The scratch itself must start at a
/// multiple of 4 bytes (256 is best: cuBLAS is fastest on aligned operands).
pub fn attention_scratch_layout(
    dtype: Dtype,
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> AttentionScratchLayout {
    scratch_layout(dtype, b * t * c, b * t * c, b * nh * t * t)
}

/// The CUDA grouped-query attention kernels' scratch ([`GqaAttention`](super::GqaAttention),
/// [`GqaAttentionBackward`](super::GqaAttentionBackward)) for activations of `dtype`: the regions and order of
/// [`attention_scratch_layout`], with q, y and dq per query head (B, H, T, D), k, v, dk
/// and dv per key/value head (B, KV, T, D), the scores and their gradient (B, H, T, T).
pub fn gqa_attention_scratch_layout(
    dtype: Dtype,
    b: usize,
    t: usize,
    h: usize,
    kv: usize,
    d: usize,
) -> AttentionScratchLayout {
    scratch_layout(dtype, b * t * h * d, b * t * kv * d, b * h * t * t)
}

/// Bytes of scratch [`GqaAttention`](super::GqaAttention) and [`GqaAttentionBackward`](super::GqaAttentionBackward) need
/// on `target`: on the CPU the backward's softmax gradient (B, H, T, T) in f32; on CUDA
/// the regions of [`gqa_attention_scratch_layout`].
pub fn gqa_attention_scratch_bytes(
    target: Target,
    dtype: Dtype,
    b: usize,
    t: usize,
    h: usize,
    kv: usize,
    d: usize,
) -> usize {
    match target {
        Target::Cpu => b * h * t * t * 4,
        Target::Cuda => gqa_attention_scratch_layout(dtype, b, t, h, kv, d).total_bytes,
    }
}

/// The attention scratch's regions in order, q, y and dq of `queries` elements of
/// `dtype`, k, v, dk and dv of `keys` elements, the f32 scores and their `dtype` gradient
/// of `scores` elements, each aligned to [`ATTENTION_SCRATCH_ALIGN`].
fn scratch_layout(
    dtype: Dtype,
    queries: usize,
    keys: usize,
    scores: usize,
) -> AttentionScratchLayout {
    let align = |x: usize| x.next_multiple_of(ATTENTION_SCRATCH_ALIGN);
    let (q_bytes, k_bytes) = (align(queries * dtype.size()), align(keys * dtype.size()));
    let sizes = [
        q_bytes, k_bytes, k_bytes, q_bytes, q_bytes, k_bytes, k_bytes,
    ];
    let mut starts = [0usize; 7];
    let mut end = 0;
    for (start, size) in starts.iter_mut().zip(sizes) {
        *start = end;
        end += size;
    }
    let [q, k, v, y, dq, dk, dv] = starts;
    AttentionScratchLayout {
        q,
        k,
        v,
        y,
        dq,
        dk,
        dv,
        scores: end,
        dscores: end + align(scores * 4),
        total_bytes: end + align(scores * 4) + align(scores * dtype.size()),
    }
}

/// The alignment, in bytes, of each region of [`attention_scratch_layout`].
pub const ATTENTION_SCRATCH_ALIGN: usize = 256;

/// The probabilities' (and the CPU backward's scratch's) element count: B × heads × T × T.
pub(super) fn scores(b: usize, heads: usize, t: usize) -> usize {
    b * heads * t * t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adamw::STATS_PIECE;
    use crate::kernel::optimizer::{
        GRAD_STATS_PIECES_PER_BLOCK, grad_stats_blocks, grad_stats_scratch_bytes,
    };

    /// Each (start, bytes) region aligned, after the one before, and inside `total`.
    fn check_regions(regions: &[(usize, usize)], total: usize) {
        let mut end = 0;
        for &(start, bytes) in regions {
            assert_eq!(start % ATTENTION_SCRATCH_ALIGN, 0);
            assert!(start >= end, "regions overlap");
            end = start + bytes;
        }
        assert!(end <= total);
    }

    #[test]
    fn attention_scratch_regions_are_aligned_disjoint_and_inside() {
        for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            for (b, t, c, nh) in [(1, 1, 4, 1), (2, 7, 22, 2), (3, 37, 48, 3)] {
                let l = attention_scratch_layout(dtype, b, t, c, nh);
                let (heads, scores) = (b * t * c * dtype.size(), b * nh * t * t);
                let regions = [
                    (l.q, heads),
                    (l.k, heads),
                    (l.v, heads),
                    (l.y, heads),
                    (l.dq, heads),
                    (l.dk, heads),
                    (l.dv, heads),
                    (l.scores, scores * 4),
                    (l.dscores, scores * dtype.size()),
                ];
                check_regions(&regions, l.total_bytes);
                assert_eq!(
                    attention_scratch_bytes(Target::Cuda, dtype, b, t, c, nh),
                    l.total_bytes
                );
            }
        }
        // Grouped-query attention: q, y, dq per query head, k, v, dk, dv per key/value
        // head; with as many of each, GPT-2's layout exactly.
        for dtype in [Dtype::F32, Dtype::Bf16] {
            for (b, t, h, kv, d) in [(1, 1, 1, 1, 4), (2, 13, 6, 2, 12), (3, 37, 4, 1, 16)] {
                let l = gqa_attention_scratch_layout(dtype, b, t, h, kv, d);
                let (queries, keys) = (b * t * h * d * dtype.size(), b * t * kv * d * dtype.size());
                let scores = b * h * t * t;
                let regions = [
                    (l.q, queries),
                    (l.k, keys),
                    (l.v, keys),
                    (l.y, queries),
                    (l.dq, queries),
                    (l.dk, keys),
                    (l.dv, keys),
                    (l.scores, scores * 4),
                    (l.dscores, scores * dtype.size()),
                ];
                check_regions(&regions, l.total_bytes);
                assert_eq!(
                    gqa_attention_scratch_bytes(Target::Cuda, dtype, b, t, h, kv, d),
                    l.total_bytes
                );
                assert_eq!(
                    gqa_attention_scratch_bytes(Target::Cpu, dtype, b, t, h, kv, d),
                    scores * 4
                );
                assert_eq!(
                    gqa_attention_scratch_layout(dtype, b, t, h, h, d),
                    attention_scratch_layout(dtype, b, t, h * d, h)
                );
            }
        }
        assert_eq!(grad_stats_blocks(0), 1);
        assert_eq!(grad_stats_blocks(257), 1);
        let per_block = GRAD_STATS_PIECES_PER_BLOCK * STATS_PIECE;
        assert_eq!(grad_stats_blocks(per_block), 1);
        assert_eq!(grad_stats_blocks(per_block + 1), 2);
        assert_eq!(grad_stats_scratch_bytes(Target::Cuda, 0), 8);
        assert_eq!(grad_stats_scratch_bytes(Target::Cuda, 257), 8);
        assert_eq!(
            grad_stats_scratch_bytes(Target::Cuda, 2 * STATS_PIECE + 1),
            24
        );
    }
}
