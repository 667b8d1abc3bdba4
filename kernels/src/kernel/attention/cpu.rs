//! Causal multi-head self-attention, forward and backward, one (batch, head) pair at a
//! time on the worker pool; the products inside a pair are strata's matrix products
//! (`ops::gemm`, one thread each) over strided views of the inputs, restricted to the
//! lower triangle in blocks of `BLOCK_ROWS` rows. Two layouts share the per-head code
//! (`head_forward`, `head_backward`): GPT-2's fused qkv (B, T, 3C), and
//! grouped-query attention's separate q (B, T, H, D) and k, v (B, T, KV, D) (Llama,
//! Qwen, Mistral), where a key/value head serves H / KV query heads and the backward
//! runs those heads one after the other on one thread, adding their key and value
//! gradients up.
//!
//! These are the CPU ops of the attention kernels (`super`); [`GqaDims`], their shape,
//! is the ops' own type, which the signatures and the reference take.

use std::ops::Range;

use crate::ops::gemm::{Operand, Product};
use crate::ops::simd::on_isa;
use crate::ops::{Cpu, simd};
use crate::parallel;

/// Rows per block of the causal products: rows `r0..r1` only need columns `0..r1`.
const BLOCK_ROWS: usize = 64;

/// The shapes of a grouped-query attention call: batch, sequence, query heads, key/value
/// heads (dividing `h`) and channels per head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GqaDims {
    /// Batch.
    pub b: usize,
    /// Sequence.
    pub t: usize,
    /// Query heads.
    pub h: usize,
    /// Key and value heads; divides `h`.
    pub kv: usize,
    /// Channels per head.
    pub d: usize,
}

impl GqaDims {
    /// Elements of q or out: B × T × H × D.
    pub fn q_len(&self) -> usize {
        self.b * self.t * self.h * self.d
    }

    /// Elements of k or v: B × T × KV × D.
    pub fn kv_len(&self) -> usize {
        self.b * self.t * self.kv * self.d
    }

    /// Elements of the probabilities: B × H × T × T.
    pub fn att_len(&self) -> usize {
        self.b * self.h * self.t * self.t
    }

    /// The key/value head query head `h` reads.
    pub fn kv_head(&self, h: usize) -> usize {
        h / (self.h / self.kv)
    }

    /// Panics unless `kv` divides `h` (both positive).
    pub fn check(&self) {
        assert!(
            self.kv > 0 && self.h.is_multiple_of(self.kv),
            "{} key/value heads do not divide {} query heads",
            self.kv,
            self.h
        );
    }
}

/// A raw pointer that may cross threads; each thread writes a disjoint part of it.
#[derive(Clone, Copy)]
struct SharedMut(*mut f32);
// SAFETY: the pointer is only dereferenced (through the products and the softmax loops) by the
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

/// One head's inputs and output: a base pointer and a row stride (elements) for each of
/// q, k, v (rows of HS channels at positions 0..T) and for the output (forward) or its
/// gradient (backward).
#[derive(Clone, Copy)]
struct HeadView {
    q: (*const f32, isize),
    k: (*const f32, isize),
    v: (*const f32, isize),
    out: (*const f32, isize),
}

/// Where one head's gradients go, with whether dk and dv are added to (a key/value head
/// shared with an earlier query head) rather than overwritten.
#[derive(Clone, Copy)]
struct HeadGrads {
    dq: (*mut f32, isize),
    dk: (*mut f32, isize),
    dv: (*mut f32, isize),
    accumulate_kv: bool,
}

/// One head's forward: `a` (T × T) = the causal softmax of `q k^T * scale`, and the
/// output rows (at `view.out`) = `a @ v`.
///
/// # Safety
/// Every row 0..T (HS elements) of q, k, v and of the output lies in memory the caller
/// may read (the output: write), the output overlapping none of the others, and nothing
/// else touches the output or `a` during the call.
unsafe fn head_forward(cpu: &Cpu, a: &mut [f32], view: HeadView, t: usize, hs: usize, scale: f32) {
    let (q, ldq) = view.q;
    let (k, ldk) = view.k;
    let (v, ldv) = view.v;
    let (out, ldo) = (view.out.0.cast_mut(), view.out.1);
    for rows in blocks(t) {
        // pre[r0..r1, 0..r1] = q[r0..r1] @ k[0..r1]^T * scale
        // SAFETY: q rows r0..r1 and k rows 0..r1 lie in the caller's memory; the
        // destination rows lie in `a`.
        unsafe {
            Product {
                m: rows.len(),
                n: rows.end,
                k: hs,
                dst: a.as_mut_ptr().add(rows.start * t),
                dst_row_stride: t as isize,
                accumulate: false,
                lhs: Operand {
                    ptr: q.offset(rows.start as isize * ldq),
                    row_stride: ldq,
                    col_stride: 1,
                },
                rhs: Operand {
                    ptr: k,
                    row_stride: 1,
                    col_stride: ldk,
                },
                scale,
            }
            .run(cpu.isa, 1)
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
        // out[r0..r1] = att[r0..r1, 0..r1] @ v[0..r1]
        // SAFETY: att rows are `a`'s; v rows 0..r1 and output rows r0..r1 lie in the
        // caller's memory, the output rows this call's alone.
        unsafe {
            Product {
                m: rows.len(),
                n: hs,
                k: rows.end,
                dst: out.offset(rows.start as isize * ldo),
                dst_row_stride: ldo,
                accumulate: false,
                lhs: Operand {
                    ptr: a.as_ptr().add(rows.start * t),
                    row_stride: t as isize,
                    col_stride: 1,
                },
                rhs: Operand {
                    ptr: v,
                    row_stride: ldv,
                    col_stride: 1,
                },
                scale: 1.0,
            }
            .run(cpu.isa, 1)
        }
    }
}

/// One head's backward: with `view.out` the output's gradient and `a` the forward's
/// probabilities, writes dq and dv, dk (added to when `grads.accumulate_kv`), using
/// `datt` (T × T) as scratch.
///
/// # Safety
/// As for [`head_forward`], for the inputs of `view`, `a`, and the gradients' rows 0..T
/// (written, overlapping nothing else of the call and touched by nothing else).
#[allow(clippy::too_many_arguments)]
unsafe fn head_backward(
    cpu: &Cpu,
    datt: &mut [f32],
    a: &[f32],
    view: HeadView,
    grads: HeadGrads,
    t: usize,
    hs: usize,
    scale: f32,
) {
    let (q, ldq) = view.q;
    let (k, ldk) = view.k;
    let (v, ldv) = view.v;
    let (dout_h, ldo) = view.out;
    let (dq, ld_dq) = grads.dq;
    let (dk, ld_dk) = grads.dk;
    let (dv, ld_dv) = grads.dv;
    for rows in blocks(t) {
        let (r0, r1) = (rows.start, rows.end);
        // SAFETY: in all products of this block, every operand is this head's rows of
        // q, k, v, dout, a (read) or of datt and its gradients (written, disjoint from
        // every other thread's), as the caller promises.
        unsafe {
            // datt[r0..r1, 0..r1] = dout[r0..r1] @ v[0..r1]^T
            Product {
                m: r1 - r0,
                n: r1,
                k: hs,
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
                    col_stride: ldv,
                },
                scale: 1.0,
            }
            .run(cpu.isa, 1);
            // dv[r0..r1] (+)= att[r0..T, r0..r1]^T @ dout[r0..T]  (att is zero above the
            // diagonal, so rows before r0 contribute nothing).
            Product {
                m: r1 - r0,
                n: hs,
                k: t - r0,
                dst: dv.offset(r0 as isize * ld_dv),
                dst_row_stride: ld_dv,
                accumulate: grads.accumulate_kv,
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
            .run(cpu.isa, 1);
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
                n: hs,
                k: r1,
                dst: dq.offset(r0 as isize * ld_dq),
                dst_row_stride: ld_dq,
                accumulate: false,
                lhs: Operand {
                    ptr: datt.as_ptr().add(r0 * t),
                    row_stride: t as isize,
                    col_stride: 1,
                },
                rhs: Operand {
                    ptr: k,
                    row_stride: ldk,
                    col_stride: 1,
                },
                scale: 1.0,
            }
            .run(cpu.isa, 1);
            // dk[r0..r1] (+)= dpre[r0..T, r0..r1]^T @ q[r0..T]
            Product {
                m: r1 - r0,
                n: hs,
                k: t - r0,
                dst: dk.offset(r0 as isize * ld_dk),
                dst_row_stride: ld_dk,
                accumulate: grads.accumulate_kv,
                lhs: Operand {
                    ptr: datt.as_ptr().add(r0 * t + r0),
                    row_stride: 1,
                    col_stride: t as isize,
                },
                rhs: Operand {
                    ptr: q.offset(r0 as isize * ldq),
                    row_stride: ldq,
                    col_stride: 1,
                },
                scale: 1.0,
            }
            .run(cpu.isa, 1);
        }
    }
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
    let ld = (3 * c) as isize;
    for_each_pair(cpu, b, nh, b * t * t * c, |bi, h| {
        let (out_ptr, att_ptr) = (out_ptr, att_ptr);
        // SAFETY: this pair's T × T slab of att lies inside att (length asserted) and no
        // other pair touches it; the pair's q, k, v columns (row stride 3C) lie in qkv,
        // and its output columns (row stride C) in out, touched by no other pair.
        unsafe {
            let a = std::slice::from_raw_parts_mut(att_ptr.0.add((bi * nh + h) * t * t), t * t);
            let view = HeadView {
                q: (qkv[d.qkv_at(bi, h, 0)..].as_ptr(), ld),
                k: (qkv[d.qkv_at(bi, h, 1)..].as_ptr(), ld),
                v: (qkv[d.qkv_at(bi, h, 2)..].as_ptr(), ld),
                out: (out_ptr.0.add(bi * t * c + h * d.hs), c as isize),
            };
            head_forward(cpu, a, view, t, d.hs, scale);
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
        // SAFETY: this pair's T × T slab of scratch lies inside it (length asserted) and
        // no other pair touches it; its Q, K, V columns of dqkv are its own; its inputs
        // lie in qkv, dout and att.
        unsafe {
            let datt = std::slice::from_raw_parts_mut(scratch_ptr.0.add(slab), t * t);
            let view = HeadView {
                q: (qkv[d.qkv_at(bi, h, 0)..].as_ptr(), ld),
                k: (qkv[d.qkv_at(bi, h, 1)..].as_ptr(), ld),
                v: (qkv[d.qkv_at(bi, h, 2)..].as_ptr(), ld),
                out: (dout[bi * t * c + h * d.hs..].as_ptr(), c as isize),
            };
            let grads = HeadGrads {
                dq: (dqkv_ptr.0.add(d.qkv_at(bi, h, 0)), ld),
                dk: (dqkv_ptr.0.add(d.qkv_at(bi, h, 1)), ld),
                dv: (dqkv_ptr.0.add(d.qkv_at(bi, h, 2)), ld),
                accumulate_kv: false,
            };
            head_backward(
                cpu,
                datt,
                &att[slab..][..t * t],
                view,
                grads,
                t,
                d.hs,
                scale,
            );
        }
    });
}

/// out: (B, T, H, D)  att: (B, H, T, T)  q: (B, T, H, D)  k, v: (B, T, KV, D), KV
/// dividing H. Causal grouped-query attention scaled by 1/sqrt(D): query head h reads
/// key/value head h / (H / KV); `att[b, h, t]` is the softmax over `t2 <= t` (zero
/// beyond), `out[b, t, h] = att @ v`.
#[allow(clippy::too_many_arguments)]
pub fn gqa_attention_forward(
    cpu: &Cpu,
    out: &mut [f32],
    att: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: GqaDims,
) {
    dims.check();
    let GqaDims { b, t, h, kv, d } = dims;
    assert_eq!(q.len(), elements(&[b, t, h, d]));
    assert_eq!(out.len(), q.len());
    assert_eq!(k.len(), elements(&[b, t, kv, d]));
    assert_eq!(v.len(), k.len());
    assert_eq!(att.len(), elements(&[b, h, t, t]));
    if t == 0 {
        return;
    }
    let scale = 1.0 / (d as f32).sqrt();
    let (out_ptr, att_ptr) = (SharedMut(out.as_mut_ptr()), SharedMut(att.as_mut_ptr()));
    let (ldq, ldkv) = ((h * d) as isize, (kv * d) as isize);
    for_each_pair(cpu, b, h, b * t * t * h * d, |bi, hi| {
        let (out_ptr, att_ptr) = (out_ptr, att_ptr);
        let g = dims.kv_head(hi);
        let (q_at, kv_at) = (bi * t * h * d + hi * d, bi * t * kv * d + g * d);
        // SAFETY: this pair's T × T slab of att and its head's columns of out (row
        // stride H·D) lie inside them (lengths asserted) and no other pair touches them;
        // its q, k, v columns lie in q, k, v.
        unsafe {
            let a = std::slice::from_raw_parts_mut(att_ptr.0.add((bi * h + hi) * t * t), t * t);
            let view = HeadView {
                q: (q[q_at..].as_ptr(), ldq),
                k: (k[kv_at..].as_ptr(), ldkv),
                v: (v[kv_at..].as_ptr(), ldkv),
                out: (out_ptr.0.add(q_at), ldq),
            };
            head_forward(cpu, a, view, t, d, scale);
        }
    });
}

/// dq: (B, T, H, D) =  dk, dv: (B, T, KV, D) =  scratch: (B, H, T, T), overwritten
/// dout: (B, T, H, D)  q, k, v: as in [`gqa_attention_forward`]  att: (B, H, T, T) from
/// the forward pass. One (batch, key/value head) pair per task: its H / KV query heads
/// in order, the first overwriting dk and dv, the others adding to them.
#[allow(clippy::too_many_arguments)]
pub fn gqa_attention_backward(
    cpu: &Cpu,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    scratch: &mut [f32],
    dout: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    att: &[f32],
    dims: GqaDims,
) {
    dims.check();
    let GqaDims { b, t, h, kv, d } = dims;
    assert_eq!(q.len(), elements(&[b, t, h, d]));
    assert_eq!((dq.len(), dout.len()), (q.len(), q.len()));
    assert_eq!(k.len(), elements(&[b, t, kv, d]));
    assert_eq!((v.len(), dk.len(), dv.len()), (k.len(), k.len(), k.len()));
    assert_eq!(att.len(), elements(&[b, h, t, t]));
    assert_eq!(scratch.len(), att.len());
    if t == 0 {
        return;
    }
    let scale = 1.0 / (d as f32).sqrt();
    let group = h / kv;
    let ptrs = [dq, dk, dv, scratch].map(|x| SharedMut(x.as_mut_ptr()));
    let (ldq, ldkv) = ((h * d) as isize, (kv * d) as isize);
    for_each_pair(cpu, b, kv, b * t * t * h * d, |bi, g| {
        let [dq_ptr, dk_ptr, dv_ptr, scratch_ptr] = ptrs;
        let kv_at = bi * t * kv * d + g * d;
        for j in 0..group {
            let hi = g * group + j;
            let q_at = bi * t * h * d + hi * d;
            let slab = (bi * h + hi) * t * t;
            // SAFETY: this pair's query heads' slabs of scratch and columns of dq, and
            // its key/value head's columns of dk and dv, lie inside them (lengths
            // asserted) and belong to this pair alone; the inputs lie in q, k, v, dout
            // and att.
            unsafe {
                let datt = std::slice::from_raw_parts_mut(scratch_ptr.0.add(slab), t * t);
                let view = HeadView {
                    q: (q[q_at..].as_ptr(), ldq),
                    k: (k[kv_at..].as_ptr(), ldkv),
                    v: (v[kv_at..].as_ptr(), ldkv),
                    out: (dout[q_at..].as_ptr(), ldq),
                };
                let grads = HeadGrads {
                    dq: (dq_ptr.0.add(q_at), ldq),
                    dk: (dk_ptr.0.add(kv_at), ldkv),
                    dv: (dv_ptr.0.add(kv_at), ldkv),
                    accumulate_kv: j > 0,
                };
                head_backward(cpu, datt, &att[slab..][..t * t], view, grads, t, d, scale);
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
