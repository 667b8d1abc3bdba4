//! Causal multi-head self-attention, forward and backward, one (batch, head) pair at a
//! time on the worker pool; the products inside a pair are `gemm` calls over strided
//! views of `qkv`, restricted to the lower triangle in blocks of [`BLOCK_ROWS`] rows.

use std::ops::Range;

use super::matmul::{Operand, Product};
use super::simd::on_isa;
use super::{Cpu, simd};
use crate::parallel;

/// Rows per block of the causal products: rows `r0..r1` only need columns `0..r1`.
const BLOCK_ROWS: usize = 64;

/// A raw pointer that may cross threads; each thread writes a disjoint part of it.
#[derive(Clone, Copy)]
struct SharedMut(*mut f32);
// SAFETY: the pointer is only dereferenced (through gemm and the softmax loops) by the
// one thread that owns a given (batch, head) pair, on elements no other pair touches.
unsafe impl Send for SharedMut {}
// SAFETY: as for Send: shared only to hand each thread its own disjoint elements.
unsafe impl Sync for SharedMut {}

/// Row blocks of `0..t`.
fn blocks(t: usize) -> impl Iterator<Item = Range<usize>> {
    (0..t.div_ceil(BLOCK_ROWS)).map(move |i| i * BLOCK_ROWS..((i + 1) * BLOCK_ROWS).min(t))
}

/// The shapes every attention call shares.
#[derive(Clone, Copy)]
struct Dims {
    t: usize,
    c: usize,
    hs: usize,
}

impl Dims {
    /// Offset of head `h`'s part `part` (0 = Q, 1 = K, 2 = V) of position 0 of batch `b`.
    fn qkv_at(&self, b: usize, h: usize, part: usize) -> usize {
        b * self.t * 3 * self.c + part * self.c + h * self.hs
    }
}

/// Runs `f(b, h)` for every (batch, head) pair, split over the pool.
fn for_each_pair(cpu: &Cpu, b: usize, nh: usize, work: usize, f: impl Fn(usize, usize) + Sync) {
    let threads = cpu.threads_for(work).min(b * nh);
    parallel::for_each_range(b * nh, threads, 1, |pairs| {
        for pair in pairs {
            f(pair / nh, pair % nh);
        }
    });
}

/// out: (B, T, C)  att: (B, NH, T, T)  qkv: (B, T, 3C) holding Q, K, V side by side.
/// `att[b, h, t]` is the causal softmax of `q(t) . k(t2) / sqrt(C/NH)` over `t2 <= t`
/// (zero beyond), and `out[b, t, head h] = att @ v`.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward(
    cpu: &Cpu,
    out: &mut [f32],
    att: &mut [f32],
    qkv: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    assert_eq!(c % nh, 0, "width {c} not divisible by {nh} heads");
    assert_eq!(qkv.len(), elements(&[b, t, 3, c]));
    assert_eq!(out.len(), elements(&[b, t, c]));
    assert_eq!(att.len(), elements(&[b, nh, t, t]));
    let d = Dims { t, c, hs: c / nh };
    let scale = 1.0 / (d.hs as f32).sqrt();
    let (out_ptr, att_ptr) = (SharedMut(out.as_mut_ptr()), SharedMut(att.as_mut_ptr()));
    for_each_pair(cpu, b, nh, b * t * t * c, |bi, h| {
        let (out_ptr, att_ptr) = (out_ptr, att_ptr);
        // SAFETY: this pair's T × T slab of att lies inside att (length asserted) and no
        // other pair touches it.
        let a =
            unsafe { std::slice::from_raw_parts_mut(att_ptr.0.add((bi * nh + h) * t * t), t * t) };
        let q = qkv[d.qkv_at(bi, h, 0)..].as_ptr();
        let k = qkv[d.qkv_at(bi, h, 1)..].as_ptr();
        let v = qkv[d.qkv_at(bi, h, 2)..].as_ptr();
        let ld = (3 * c) as isize;
        for rows in blocks(t) {
            // pre[r0..r1, 0..r1] = q[r0..r1] @ k[0..r1]^T * scale
            // SAFETY: q rows r0..r1 and k rows 0..r1 (hs columns at row stride 3C) lie in
            // qkv; the destination rows lie in this pair's slab of att.
            unsafe {
                Product {
                    m: rows.len(),
                    n: rows.end,
                    k: d.hs,
                    dst: a.as_mut_ptr().add(rows.start * t),
                    dst_row_stride: t as isize,
                    accumulate: false,
                    lhs: Operand {
                        ptr: q.offset(rows.start as isize * ld),
                        row_stride: ld,
                        col_stride: 1,
                    },
                    rhs: Operand {
                        ptr: k,
                        row_stride: 1,
                        col_stride: ld,
                    },
                    scale,
                }
                .run(1)
            }
        }
        on_isa!(cpu.isa, {
            for (ti, row) in a.chunks_exact_mut(t).enumerate() {
                let (live, masked) = row.split_at_mut(ti + 1);
                let max = simd::max(live);
                let sum = simd::exp_shifted_in_place(live, max);
                simd::scale_in_place(live, 1.0 / sum);
                masked.fill(0.0);
            }
        },);
        for rows in blocks(t) {
            // out[r0..r1, head h] = att[r0..r1, 0..r1] @ v[0..r1]
            // SAFETY: att rows are this pair's; v rows 0..r1 lie in qkv; the output rows
            // r0..r1 of head h's hs columns (row stride C) lie in out and belong to this
            // pair alone.
            unsafe {
                Product {
                    m: rows.len(),
                    n: d.hs,
                    k: rows.end,
                    dst: out_ptr.0.add((bi * t + rows.start) * c + h * d.hs),
                    dst_row_stride: c as isize,
                    accumulate: false,
                    lhs: Operand {
                        ptr: a.as_ptr().add(rows.start * t),
                        row_stride: t as isize,
                        col_stride: 1,
                    },
                    rhs: Operand {
                        ptr: v,
                        row_stride: ld,
                        col_stride: 1,
                    },
                    scale: 1.0,
                }
                .run(1)
            }
        }
    });
}

/// dqkv: (B, T, 3C) =  scratch: (B, NH, T, T), overwritten  dout: (B, T, C)
/// qkv: (B, T, 3C)  att: (B, NH, T, T) from the forward pass.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    cpu: &Cpu,
    dqkv: &mut [f32],
    scratch: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    att: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    assert_eq!(c % nh, 0, "width {c} not divisible by {nh} heads");
    assert_eq!(dqkv.len(), elements(&[b, t, 3, c]));
    assert_eq!(qkv.len(), elements(&[b, t, 3, c]));
    assert_eq!(dout.len(), elements(&[b, t, c]));
    assert_eq!(att.len(), elements(&[b, nh, t, t]));
    assert_eq!(scratch.len(), elements(&[b, nh, t, t]));
    let d = Dims { t, c, hs: c / nh };
    let scale = 1.0 / (d.hs as f32).sqrt();
    let (dqkv_ptr, scratch_ptr) = (
        SharedMut(dqkv.as_mut_ptr()),
        SharedMut(scratch.as_mut_ptr()),
    );
    let ld = (3 * c) as isize;
    for_each_pair(cpu, b, nh, b * t * t * c, |bi, h| {
        let (dqkv_ptr, scratch_ptr) = (dqkv_ptr, scratch_ptr);
        let slab = (bi * nh + h) * t * t;
        let a = &att[slab..][..t * t];
        // SAFETY: this pair's T × T slab of scratch lies inside it (length asserted) and
        // no other pair touches it.
        let datt = unsafe { std::slice::from_raw_parts_mut(scratch_ptr.0.add(slab), t * t) };
        let q = qkv[d.qkv_at(bi, h, 0)..].as_ptr();
        let k = qkv[d.qkv_at(bi, h, 1)..].as_ptr();
        let v = qkv[d.qkv_at(bi, h, 2)..].as_ptr();
        // SAFETY: offsets of this pair's Q, K, V columns in dqkv.
        let (dq, dk, dv) = unsafe {
            (
                dqkv_ptr.0.add(d.qkv_at(bi, h, 0)),
                dqkv_ptr.0.add(d.qkv_at(bi, h, 1)),
                dqkv_ptr.0.add(d.qkv_at(bi, h, 2)),
            )
        };
        let dout_h = dout[bi * t * c + h * d.hs..].as_ptr();
        let ldo = c as isize;
        for rows in blocks(t) {
            let (r0, r1) = (rows.start, rows.end);
            // SAFETY: in all products of this block, every operand is this pair's rows of
            // qkv, dout, att (read) or of its scratch slab and its Q, K, V columns of
            // dqkv (written, disjoint from every other pair's), within the asserted
            // lengths.
            unsafe {
                // datt[r0..r1, 0..r1] = dout[r0..r1] @ v[0..r1]^T
                Product {
                    m: r1 - r0,
                    n: r1,
                    k: d.hs,
                    dst: datt.as_mut_ptr().add(r0 * t),
                    dst_row_stride: t as isize,
                    accumulate: false,
                    lhs: Operand {
                        ptr: dout_h.offset(r0 as isize * ldo),
                        row_stride: ldo,
                        col_stride: 1,
                    },
                    rhs: Operand {
                        ptr: v,
                        row_stride: 1,
                        col_stride: ld,
                    },
                    scale: 1.0,
                }
                .run(1);
                // dv[r0..r1] = att[r0..T, r0..r1]^T @ dout[r0..T]  (att is zero above the
                // diagonal, so rows before r0 contribute nothing).
                Product {
                    m: r1 - r0,
                    n: d.hs,
                    k: t - r0,
                    dst: dv.offset(r0 as isize * ld),
                    dst_row_stride: ld,
                    accumulate: false,
                    lhs: Operand {
                        ptr: a.as_ptr().add(r0 * t + r0),
                        row_stride: 1,
                        col_stride: t as isize,
                    },
                    rhs: Operand {
                        ptr: dout_h.offset(r0 as isize * ldo),
                        row_stride: ldo,
                        col_stride: 1,
                    },
                    scale: 1.0,
                }
                .run(1);
            }
        }
        // Softmax backward in place: dpre = att * (datt - sum(att * datt)) * scale.
        on_isa!(cpu.isa, {
            for (ti, (drow, arow)) in datt.chunks_exact_mut(t).zip(a.chunks_exact(t)).enumerate() {
                let (live, masked) = drow.split_at_mut(ti + 1);
                let arow = &arow[..ti + 1];
                let dot = simd::dot(live, arow);
                for j in 0..live.len() {
                    live[j] = arow[j] * (live[j] - dot) * scale;
                }
                masked.fill(0.0);
            }
        },);
        for rows in blocks(t) {
            let (r0, r1) = (rows.start, rows.end);
            // SAFETY: as for the first loop; dpre is zero above the diagonal.
            unsafe {
                // dq[r0..r1] = dpre[r0..r1, 0..r1] @ k[0..r1]
                Product {
                    m: r1 - r0,
                    n: d.hs,
                    k: r1,
                    dst: dq.offset(r0 as isize * ld),
                    dst_row_stride: ld,
                    accumulate: false,
                    lhs: Operand {
                        ptr: datt.as_ptr().add(r0 * t),
                        row_stride: t as isize,
                        col_stride: 1,
                    },
                    rhs: Operand {
                        ptr: k,
                        row_stride: ld,
                        col_stride: 1,
                    },
                    scale: 1.0,
                }
                .run(1);
                // dk[r0..r1] = dpre[r0..T, r0..r1]^T @ q[r0..T]
                Product {
                    m: r1 - r0,
                    n: d.hs,
                    k: t - r0,
                    dst: dk.offset(r0 as isize * ld),
                    dst_row_stride: ld,
                    accumulate: false,
                    lhs: Operand {
                        ptr: datt.as_ptr().add(r0 * t + r0),
                        row_stride: 1,
                        col_stride: t as isize,
                    },
                    rhs: Operand {
                        ptr: q.offset(r0 as isize * ld),
                        row_stride: ld,
                        col_stride: 1,
                    },
                    scale: 1.0,
                }
                .run(1);
            }
        }
    });
}

/// The element count of a tensor of these dimensions. Panics on overflow, so the length
/// asserts the `unsafe` slab arithmetic relies on cannot pass by wrapping around.
fn elements(dims: &[usize]) -> usize {
    dims.iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .unwrap_or_else(|| {
            panic!("a tensor of dimensions {dims:?} has more elements than usize holds")
        })
}
