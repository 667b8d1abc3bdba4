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
    /// Multi-head attention (GPT-2's): `nh` heads of `c / nh` channels, as many
    /// key/value heads as query heads (channels per head 0 without heads).
    pub fn multi_head(b: usize, t: usize, c: usize, nh: usize) -> GqaDims {
        GqaDims {
            b,
            t,
            h: nh,
            kv: nh,
            d: c.checked_div(nh).unwrap_or(0),
        }
    }

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

/// Which keys each query sees, beyond causality: query `t` of sequence `b` sees keys
/// `first_key(b, t)..=t`, the later of its document's first position (packed sequences)
/// and the start of its sliding window. The default is plain causal attention.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttnMask<'a> {
    /// A query sees at most this many keys, itself included (Mistral's
    /// `sliding_window`: key `j` is seen by query `t` when `t - j < window`); `None`:
    /// every earlier key.
    pub window: Option<usize>,
    /// (B, T): the first position of each token's document, so that a token attends
    /// only within its document. Documents are runs of positions: each entry is its own
    /// position (a document starts there) or the entry before it. `None`: one document
    /// per sequence.
    pub doc_start: Option<&'a [u32]>,
}

impl AttnMask<'_> {
    /// Plain causal attention: every earlier key.
    pub const CAUSAL: AttnMask<'static> = AttnMask {
        window: None,
        doc_start: None,
    };

    /// The first key query `t` of sequence `b` (of `t_len` positions) sees.
    pub fn first_key(&self, b: usize, t: usize, t_len: usize) -> usize {
        let doc = self.doc_start.map_or(0, |d| d[b * t_len + t] as usize);
        let window = self.window.map_or(0, |w| (t + 1).saturating_sub(w));
        doc.max(window)
    }

    /// Panics unless the window is positive and the document starts are `b` × `t` runs
    /// of positions, as the fields' documentation says.
    pub fn check(&self, b: usize, t: usize) {
        assert_ne!(self.window, Some(0), "a sliding window of 0 keys");
        let Some(starts) = self.doc_start else {
            return;
        };
        assert_eq!(
            starts.len(),
            b * t,
            "document starts for {b} × {t} positions"
        );
        for row in starts.chunks_exact(t.max(1)) {
            for (i, &s) in row.iter().enumerate() {
                let s = s as usize;
                let ok = s == i || (i > 0 && s == row[i - 1] as usize);
                assert!(
                    ok,
                    "position {i} starts its document at {s}: not a run of positions"
                );
            }
        }
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

/// Query rows per tile of the fused kernels.
const FLASH_ROWS: usize = 96;
/// Keys per tile of the fused kernels.
const FLASH_COLS: usize = 256;

/// The fused kernels' tile for sequences of T positions: FLASH_ROWS query rows against
/// FLASH_COLS keys, or T of either when T is shorter (the same tiles, so the same
/// results, in a scratch no larger than the sequence needs).
#[derive(Debug, Clone, Copy)]
struct Tile {
    rows: usize,
    cols: usize,
}

impl Tile {
    fn of(t: usize) -> Tile {
        Tile {
            rows: FLASH_ROWS.min(t.max(1)),
            cols: FLASH_COLS.min(t.max(1)),
        }
    }

    /// f32 scratch one (batch, head) pair uses, for `d` channels per head: two tiles of
    /// scores (rows × cols), the forward's output rows (rows × d) and two values per
    /// row.
    fn pair_scratch(&self, d: usize) -> usize {
        2 * self.rows * self.cols + self.rows * d + 2 * self.rows
    }

    /// Query tiles of `0..t`.
    fn queries(&self, t: usize) -> impl Iterator<Item = Range<usize>> + use<> {
        let n = self.rows;
        (0..t.div_ceil(n)).map(move |i| i * n..((i + 1) * n).min(t))
    }

    /// The key tiles query rows `rows` see: from the first key of their first row (first
    /// keys never decrease along a sequence) to their last row, `cols` at a time.
    fn keys(
        &self,
        rows: &Range<usize>,
        first: usize,
    ) -> impl Iterator<Item = Range<usize>> + use<> {
        let (end, n) = (rows.end, self.cols);
        (first..end).step_by(n).map(move |c0| c0..(c0 + n).min(end))
    }
}

/// f32 elements of scratch [`gqa_flash_attention_forward`] and
/// [`gqa_flash_attention_backward`] (and GPT-2's, with `h` = `kv` heads) need: a fixed
/// amount per (batch, query head) pair, growing with T only up to one tile.
pub fn flash_scratch_len(dims: GqaDims) -> usize {
    elements(&[dims.b, dims.h, Tile::of(dims.t).pair_scratch(dims.d)])
}

/// One head's mask: the first key each of its queries sees.
type FirstKey<'a> = &'a (dyn Fn(usize) -> usize + Sync);

/// The rows of a matrix of row stride `ld` starting at `ptr`, as a product's operand.
fn rows_of(ptr: *const f32, ld: isize) -> Operand {
    Operand {
        ptr,
        row_stride: ld,
        col_stride: 1,
    }
}

/// The same matrix transposed: its rows become the operand's columns.
fn transposed(ptr: *const f32, ld: isize) -> Operand {
    Operand {
        ptr,
        row_stride: 1,
        col_stride: ld,
    }
}

/// `dst` (m × n, row stride `ld`) [+]= `lhs` (m × k) @ `rhs` (k × n) * `scale`, on one
/// thread.
///
/// # Safety
/// As [`Product::run`]'s: every element of the operands and of `dst` lies in memory the
/// caller may read (`dst`: write), `dst` overlapping neither operand.
#[allow(clippy::too_many_arguments)]
unsafe fn product(
    isa: crate::isa::Isa,
    dst: (*mut f32, isize),
    (m, n, k): (usize, usize, usize),
    lhs: Operand,
    rhs: Operand,
    scale: f32,
    accumulate: bool,
) {
    // SAFETY: as the caller promises.
    unsafe {
        Product {
            m,
            n,
            k,
            dst: dst.0,
            dst_row_stride: dst.1,
            accumulate,
            lhs,
            rhs,
            scale,
        }
        .run(isa, 1)
    }
}

/// `s` (rows × keys, row stride `ld`) = q[rows] @ k[keys]^T * scale.
///
/// # Safety
/// q's rows `rows` and k's rows `keys` (`hs` elements each) lie in memory the caller may
/// read.
unsafe fn tile_scores(
    isa: crate::isa::Isa,
    (s, ld): (&mut [f32], usize),
    view: &HeadView,
    (rows, keys): (&Range<usize>, &Range<usize>),
    hs: usize,
    scale: f32,
) {
    let ((q, ldq), (k, ldk)) = (view.q, view.k);
    assert!(keys.len() <= ld && s.len() >= rows.len() * ld);
    // SAFETY: as the caller promises, and the tile fits in `s` (asserted).
    unsafe {
        product(
            isa,
            (s.as_mut_ptr(), ld as isize),
            (rows.len(), keys.len(), hs),
            rows_of(q.offset(rows.start as isize * ldq), ldq),
            transposed(k.offset(keys.start as isize * ldk), ldk),
            scale,
            false,
        )
    }
}

/// The part of key tile `keys` query `r` sees, as a range of the tile's columns.
fn seen(r: usize, first: usize, keys: &Range<usize>) -> Range<usize> {
    // A row before the tile sees none of it: an empty range at its start.
    let end = (r + 1).clamp(keys.start, keys.end);
    (first.clamp(keys.start, end) - keys.start)..(end - keys.start)
}

/// One head's fused forward (FlashAttention-2's): for each tile of query rows, the key
/// tiles they see one after another, the softmax kept online (a running maximum and sum
/// per row, the output rows rescaled when the maximum grows). Writes the output rows at
/// `view.out` and each row's log-sum-exp of its scaled scores into `lse`.
///
/// # Safety
/// As for [`head_forward`]; `lse` holds T values; `scratch` holds
/// `Tile::of(t).pair_scratch(hs)`.
#[allow(clippy::too_many_arguments)]
unsafe fn flash_head_forward(
    cpu: &Cpu,
    scratch: &mut [f32],
    lse: &mut [f32],
    view: HeadView,
    first: FirstKey<'_>,
    t: usize,
    hs: usize,
    scale: f32,
) {
    let (v, ldv) = view.v;
    let (out, ldo) = (view.out.0.cast_mut(), view.out.1);
    let tile = Tile::of(t);
    let (s, rest) = scratch.split_at_mut(2 * tile.rows * tile.cols);
    let (o, rest) = rest.split_at_mut(tile.rows * hs);
    let (m, l) = rest.split_at_mut(tile.rows);
    for rows in tile.queries(t) {
        let n = rows.len();
        o[..n * hs].fill(0.0);
        m[..n].fill(f32::NEG_INFINITY);
        l[..n].fill(0.0);
        for keys in tile.keys(&rows, first(rows.start)) {
            let scores = (&mut *s, tile.cols);
            // SAFETY: the rows and keys lie in 0..T, as the caller promises for q and k.
            unsafe { tile_scores(cpu.isa, scores, &view, (&rows, &keys), hs, scale) };
            on_isa!(cpu.isa, {
                for i in 0..n {
                    let r = rows.start + i;
                    let row = &mut s[i * tile.cols..][..keys.len()];
                    let live = seen(r, first(r), &keys);
                    if live.is_empty() {
                        row.fill(0.0);
                        continue;
                    }
                    let top = m[i].max(simd::max(&row[live.clone()]));
                    // The first tile a row sees starts its sums; later ones rescale them.
                    let alpha = if m[i] == f32::NEG_INFINITY {
                        0.0
                    } else {
                        simd::exp(m[i] - top)
                    };
                    row[..live.start].fill(0.0);
                    row[live.end..].fill(0.0);
                    let sum = simd::exp_shifted_in_place(&mut row[live], top);
                    l[i] = l[i] * alpha + sum;
                    m[i] = top;
                    if alpha != 1.0 {
                        simd::scale_in_place(&mut o[i * hs..][..hs], alpha);
                    }
                }
            });
            // o[rows] += p[rows, keys] @ v[keys]
            // SAFETY: p and o are this call's scratch; v's rows `keys` lie in the
            // caller's memory.
            unsafe {
                product(
                    cpu.isa,
                    (o.as_mut_ptr(), hs as isize),
                    (n, hs, keys.len()),
                    rows_of(s.as_ptr(), tile.cols as isize),
                    rows_of(v.offset(keys.start as isize * ldv), ldv),
                    1.0,
                    true,
                )
            }
        }
        for i in 0..n {
            let r = rows.start + i;
            lse[r] = m[i] + l[i].ln();
            // SAFETY: output row r (hs elements) is the caller's, written by this call
            // alone.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.offset(r as isize * ldo), hs) };
            let inv = 1.0 / l[i];
            for (d, x) in dst.iter_mut().zip(&o[i * hs..][..hs]) {
                *d = x * inv;
            }
        }
    }
}

/// Zeroes rows 0..t (`hs` elements each, `ld` apart) at `ptr`.
///
/// # Safety
/// The rows lie in memory the caller may write and nothing else touches them.
unsafe fn zero_rows(ptr: *mut f32, ld: isize, t: usize, hs: usize) {
    for r in 0..t {
        // SAFETY: as the caller promises.
        unsafe { std::slice::from_raw_parts_mut(ptr.offset(r as isize * ld), hs).fill(0.0) };
    }
}

/// One head's fused backward (FlashAttention-2's): the probabilities recomputed tile by
/// tile from the forward's log-sum-exp, never held whole. `view.out` is the output's
/// gradient, `out` the forward's output rows. Writes dq, and dk and dv (added to when
/// `grads.accumulate_kv`).
///
/// # Safety
/// As for [`head_backward`], with `out`'s rows 0..T readable, `lse` the forward's T
/// values for this head and `scratch` of `Tile::of(t).pair_scratch(hs)`.
#[allow(clippy::too_many_arguments)]
unsafe fn flash_head_backward(
    cpu: &Cpu,
    scratch: &mut [f32],
    (out, lse): ((*const f32, isize), &[f32]),
    view: HeadView,
    grads: HeadGrads,
    first: FirstKey<'_>,
    t: usize,
    hs: usize,
    scale: f32,
) {
    let ((q, ldq), (k, ldk), (v, ldv), (dy, ldy)) = (view.q, view.k, view.v, view.out);
    let ((dq, ld_dq), (dk, ld_dk), (dv, ld_dv)) = (grads.dq, grads.dk, grads.dv);
    let tile = Tile::of(t);
    let (p, rest) = scratch.split_at_mut(tile.rows * tile.cols);
    let (ds, rest) = rest.split_at_mut(tile.rows * tile.cols);
    let dsum = &mut rest[..tile.rows];
    let isa = cpu.isa;
    // SAFETY: the gradients' rows 0..T are this call's, as the caller promises.
    unsafe {
        zero_rows(dq, ld_dq, t, hs);
        if !grads.accumulate_kv {
            zero_rows(dk, ld_dk, t, hs);
            zero_rows(dv, ld_dv, t, hs);
        }
    }
    for rows in tile.queries(t) {
        let n = rows.len();
        for (i, r) in rows.clone().enumerate() {
            // SAFETY: rows r of dout and of the output lie in the caller's memory.
            let (g, y) = unsafe {
                (
                    std::slice::from_raw_parts(dy.offset(r as isize * ldy), hs),
                    std::slice::from_raw_parts(out.0.offset(r as isize * out.1), hs),
                )
            };
            dsum[i] = on_isa!(isa, simd::dot(g, y));
        }
        for keys in tile.keys(&rows, first(rows.start)) {
            let w = keys.len();
            // SAFETY: every operand below is a row range of q, k, v, dout (read) or of
            // dq, dk, dv (written by this call alone) inside 0..T, or this call's scratch.
            unsafe {
                tile_scores(isa, (&mut *p, tile.cols), &view, (&rows, &keys), hs, scale);
                // ds = dout[rows] @ v[keys]^T, the probabilities' gradient for now.
                let dy_rows = rows_of(dy.offset(rows.start as isize * ldy), ldy);
                let ds_tile = (ds.as_mut_ptr(), tile.cols as isize);
                let v_keys = v.offset(keys.start as isize * ldv);
                product(
                    isa,
                    ds_tile,
                    (n, w, hs),
                    dy_rows,
                    transposed(v_keys, ldv),
                    1.0,
                    false,
                );
            }
            on_isa!(isa, {
                for i in 0..n {
                    let r = rows.start + i;
                    let (prow, drow) =
                        (&mut p[i * tile.cols..][..w], &mut ds[i * tile.cols..][..w]);
                    let live = seen(r, first(r), &keys);
                    prow[..live.start].fill(0.0);
                    prow[live.end..].fill(0.0);
                    for x in &mut prow[live] {
                        *x = simd::exp(*x - lse[r]);
                    }
                    for (d, &x) in drow.iter_mut().zip(prow.iter()) {
                        *d = x * (*d - dsum[i]) * scale;
                    }
                }
            });
            // SAFETY: as above.
            unsafe {
                let p_t = transposed(p.as_ptr(), tile.cols as isize);
                let (ds_rows, ds_t) = (
                    rows_of(ds.as_ptr(), tile.cols as isize),
                    transposed(ds.as_ptr(), tile.cols as isize),
                );
                let dy_rows = rows_of(dy.offset(rows.start as isize * ldy), ldy);
                let q_rows = rows_of(q.offset(rows.start as isize * ldq), ldq);
                let k_keys = rows_of(k.offset(keys.start as isize * ldk), ldk);
                let (at_q, at_k) = (rows.start as isize, keys.start as isize);
                // dv[keys] += p^T @ dout[rows], dq[rows] += ds @ k[keys],
                // dk[keys] += ds^T @ q[rows].
                for (dst, dims, lhs, rhs) in [
                    ((dv.offset(at_k * ld_dv), ld_dv), (w, hs, n), p_t, dy_rows),
                    (
                        (dq.offset(at_q * ld_dq), ld_dq),
                        (n, hs, w),
                        ds_rows,
                        k_keys,
                    ),
                    ((dk.offset(at_k * ld_dk), ld_dk), (w, hs, n), ds_t, q_rows),
                ] {
                    product(isa, dst, dims, lhs, rhs, 1.0, true);
                }
            }
        }
    }
}

/// Row strides (elements from one position to the next) of q and of k and v, which
/// their gradients share: 3C for all three in GPT-2's fused qkv, H·D and KV·D for
/// grouped-query attention's separate tensors. out and dout are (B, T, H·D) in both.
#[derive(Clone, Copy)]
struct Strides {
    q: usize,
    kv: usize,
}

impl Strides {
    /// GPT-2's fused qkv of `c` channels.
    fn fused(c: usize) -> Self {
        Strides {
            q: 3 * c,
            kv: 3 * c,
        }
    }

    /// Grouped-query attention's separate q, k and v.
    fn separate(dims: &GqaDims) -> Self {
        Strides {
            q: dims.h * dims.d,
            kv: dims.kv * dims.d,
        }
    }

    /// Panics unless buffers of `q_len` and `kv_len` elements hold every position's
    /// heads at these strides.
    fn check(&self, dims: &GqaDims, q_len: usize, kv_len: usize) {
        let rows = dims.b * dims.t;
        let fits = |len: usize, ld: usize, heads: usize| {
            rows == 0 || elements(&[rows - 1, ld]) + elements(&[heads, dims.d]) <= len
        };
        assert!(fits(q_len, self.q, dims.h), "q of {q_len} elements");
        assert!(fits(kv_len, self.kv, dims.kv), "k, v of {kv_len} elements");
    }
}

/// q, k and v.
type Qkv<'a> = (&'a [f32], &'a [f32], &'a [f32]);

/// GPT-2's fused qkv (B, T, 3C) as q, k and v: the same rows from C and 2C on.
fn split_fused(qkv: &[f32], c: usize) -> Qkv<'_> {
    let from = |at: usize| qkv.get(at..).unwrap_or(&[]);
    (qkv, from(c), from(2 * c))
}

/// GPT-2's NH heads of C / NH channels as grouped-query attention's dimensions.
fn fused_dims(b: usize, t: usize, c: usize, nh: usize) -> GqaDims {
    assert!(
        nh > 0 && c.is_multiple_of(nh),
        "width {c} not divisible by {nh} heads"
    );
    GqaDims::multi_head(b, t, c, nh)
}

/// out: (B, T, C)  lse: (B, NH, T)  scratch: [`flash_scratch_len`] (with H = KV = NH)
/// qkv: (B, T, 3C). The fused form of [`attention_forward`], under `mask`: the same
/// output, to rounding, without the (B, NH, T, T) probabilities. `lse[b, h, t]` is the
/// log of the softmax's denominator, ln sum_j e^(q(t) . k(j) / sqrt(C/NH)) over the keys
/// `t` sees, which the backward recomputes the probabilities from.
pub fn flash_attention_forward(
    cpu: &Cpu,
    (out, lse, scratch): (&mut [f32], &mut [f32], &mut [f32]),
    qkv: &[f32],
    (b, t, c, nh): (usize, usize, usize, usize),
    mask: AttnMask<'_>,
) {
    let dims = fused_dims(b, t, c, nh);
    assert_eq!(qkv.len(), elements(&[3, b, t, c]), "qkv's length");
    let x = split_fused(qkv, c);
    flash_forward(cpu, (out, lse, scratch), x, Strides::fused(c), dims, mask);
}

/// dqkv: (B, T, 3C) =  scratch: [`flash_scratch_len`]  dout: (B, T, C)  qkv: (B, T, 3C)
/// out: (B, T, C) and lse: (B, NH, T) from [`flash_attention_forward`] under the same
/// `mask`.
pub fn flash_attention_backward(
    cpu: &Cpu,
    dqkv: &mut [f32],
    scratch: &mut [f32],
    (dout, qkv): (&[f32], &[f32]),
    (out, lse): (&[f32], &[f32]),
    (b, t, c, nh): (usize, usize, usize, usize),
    mask: AttnMask<'_>,
) {
    let dims = fused_dims(b, t, c, nh);
    assert_eq!(qkv.len(), elements(&[3, b, t, c]), "qkv's length");
    assert_eq!(dqkv.len(), qkv.len(), "dqkv's length");
    let len = dqkv.len();
    let base = dqkv.as_mut_ptr();
    // dq, dk and dv are the same rows of dqkv from C and 2C on, as q, k and v of qkv.
    let grads = [0, c, 2 * c].map(|at| (base.wrapping_add(at), len.saturating_sub(at)));
    let x = split_fused(qkv, c);
    // SAFETY: the three regions lie in dqkv, which this call borrows mutably; the
    // elements the strides give dq, dk and dv (columns 0..C, C..2C, 2C..3C of each row)
    // are disjoint.
    unsafe {
        flash_backward(
            cpu,
            grads,
            scratch,
            (dout, x),
            (out, lse),
            Strides::fused(c),
            dims,
            mask,
        )
    }
}

/// out: (B, T, H, D)  lse: (B, H, T)  scratch: [`flash_scratch_len`]  q: (B, T, H, D)
/// k, v: (B, T, KV, D). The fused form of [`gqa_attention_forward`], under `mask`, as
/// [`flash_attention_forward`] is of GPT-2's.
pub fn gqa_flash_attention_forward(
    cpu: &Cpu,
    (out, lse, scratch): (&mut [f32], &mut [f32], &mut [f32]),
    (q, k, v): (&[f32], &[f32], &[f32]),
    dims: GqaDims,
    mask: AttnMask<'_>,
) {
    assert_eq!(q.len(), dims.q_len(), "q's length");
    assert_eq!(
        (k.len(), v.len()),
        (dims.kv_len(), dims.kv_len()),
        "k's and v's lengths"
    );
    let strides = Strides::separate(&dims);
    flash_forward(cpu, (out, lse, scratch), (q, k, v), strides, dims, mask);
}

/// dq: (B, T, H, D) =  dk, dv: (B, T, KV, D) =  scratch: [`flash_scratch_len`]
/// dout: (B, T, H, D)  q, k, v: as in [`gqa_flash_attention_forward`]  out, lse: from it
/// under the same `mask`. One (batch, key/value head) pair per task, its query heads in
/// order, as [`gqa_attention_backward`].
#[allow(clippy::too_many_arguments)]
pub fn gqa_flash_attention_backward(
    cpu: &Cpu,
    (dq, dk, dv): (&mut [f32], &mut [f32], &mut [f32]),
    scratch: &mut [f32],
    dout: &[f32],
    (q, k, v): (&[f32], &[f32], &[f32]),
    (out, lse): (&[f32], &[f32]),
    dims: GqaDims,
    mask: AttnMask<'_>,
) {
    assert_eq!(
        (q.len(), dq.len()),
        (dims.q_len(), dims.q_len()),
        "q's and dq's lengths"
    );
    let kv_len = dims.kv_len();
    assert_eq!(
        [k.len(), v.len(), dk.len(), dv.len()],
        [kv_len; 4],
        "k's, v's, dk's and dv's lengths"
    );
    let grads = [dq, dk, dv].map(|g| (g.as_mut_ptr(), g.len()));
    // SAFETY: the three regions are the three slices, which this call borrows mutably.
    unsafe {
        flash_backward(
            cpu,
            grads,
            scratch,
            (dout, (q, k, v)),
            (out, lse),
            Strides::separate(&dims),
            dims,
            mask,
        )
    }
}

/// The forward of both layouts: q, k, v at `strides`, out (B, T, H·D), lse (B, H, T).
fn flash_forward(
    cpu: &Cpu,
    (out, lse, scratch): (&mut [f32], &mut [f32], &mut [f32]),
    (q, k, v): Qkv<'_>,
    strides: Strides,
    dims: GqaDims,
    mask: AttnMask<'_>,
) {
    check_flash(&dims, mask, [out.len(), lse.len(), scratch.len()]);
    strides.check(&dims, q.len(), k.len().min(v.len()));
    let GqaDims { b, t, h, d, .. } = dims;
    let scale = 1.0 / (d as f32).sqrt();
    let ptrs = [out, lse, scratch].map(|x| SharedMut(x.as_mut_ptr()));
    let (ldq, ldkv, ldo) = (strides.q, strides.kv, h * d);
    let per_pair = Tile::of(t).pair_scratch(d);
    for_each_pair(cpu, b, h, b * t * t * h * d, |bi, hi| {
        let [out_ptr, lse_ptr, scratch_ptr] = ptrs;
        let first = |r| mask.first_key(bi, r, t);
        let pair = bi * h + hi;
        let (q_at, kv_at) = (bi * t * ldq + hi * d, bi * t * ldkv + dims.kv_head(hi) * d);
        // SAFETY: this pair's scratch, its T values of lse and its head's columns of out
        // (row stride H·D) lie inside them (lengths checked) and no other pair touches
        // them; its q, k, v columns lie in q, k, v (extents checked).
        unsafe {
            let scratch =
                std::slice::from_raw_parts_mut(scratch_ptr.0.add(pair * per_pair), per_pair);
            let lse = std::slice::from_raw_parts_mut(lse_ptr.0.add(pair * t), t);
            let view = HeadView {
                q: (q[q_at..].as_ptr(), ldq as isize),
                k: (k[kv_at..].as_ptr(), ldkv as isize),
                v: (v[kv_at..].as_ptr(), ldkv as isize),
                out: (out_ptr.0.add(bi * t * ldo + hi * d), ldo as isize),
            };
            flash_head_forward(cpu, scratch, lse, view, &first, t, d, scale);
        }
    });
}

/// The backward of both layouts: dq, dk, dv written at q's, k's and v's `strides`
/// (each a pointer and the elements it may write), dout and out (B, T, H·D).
///
/// # Safety
/// Each of `grads` may be written for its length, and nothing else touches them during
/// the call; where they overlap (GPT-2's dqkv), the elements `strides` gives each are
/// disjoint.
#[allow(clippy::too_many_arguments)]
unsafe fn flash_backward(
    cpu: &Cpu,
    grads: [(*mut f32, usize); 3],
    scratch: &mut [f32],
    (dout, (q, k, v)): (&[f32], Qkv<'_>),
    (out, lse): (&[f32], &[f32]),
    strides: Strides,
    dims: GqaDims,
    mask: AttnMask<'_>,
) {
    check_flash(&dims, mask, [out.len(), lse.len(), scratch.len()]);
    assert_eq!(dout.len(), out.len(), "dout's length");
    strides.check(&dims, q.len().min(grads[0].1), k.len().min(v.len()));
    strides.check(&dims, q.len(), grads[1].1.min(grads[2].1));
    let GqaDims { b, t, h, kv, d } = dims;
    let scale = 1.0 / (d as f32).sqrt();
    let group = h / kv;
    let [dq, dk, dv] = grads.map(|(p, _)| p);
    let ptrs = [dq, dk, dv, scratch.as_mut_ptr()].map(SharedMut);
    let (ldq, ldkv, ldo) = (strides.q, strides.kv, h * d);
    let per_pair = Tile::of(t).pair_scratch(d);
    for_each_pair(cpu, b, kv, b * t * t * h * d, |bi, g| {
        let [dq_ptr, dk_ptr, dv_ptr, scratch_ptr] = ptrs;
        let first = |r| mask.first_key(bi, r, t);
        let kv_at = bi * t * ldkv + g * d;
        for j in 0..group {
            let hi = g * group + j;
            let (q_at, o_at, pair) = (bi * t * ldq + hi * d, bi * t * ldo + hi * d, bi * h + hi);
            // SAFETY: this pair's query heads' scratch and columns of dq, and its
            // key/value head's columns of dk and dv, lie inside them (extents checked)
            // and belong to this pair alone (the caller promises the gradients' regions
            // are otherwise untouched); the inputs lie in q, k, v, dout, out, lse.
            unsafe {
                let scratch =
                    std::slice::from_raw_parts_mut(scratch_ptr.0.add(pair * per_pair), per_pair);
                let view = HeadView {
                    q: (q[q_at..].as_ptr(), ldq as isize),
                    k: (k[kv_at..].as_ptr(), ldkv as isize),
                    v: (v[kv_at..].as_ptr(), ldkv as isize),
                    out: (dout[o_at..].as_ptr(), ldo as isize),
                };
                let grads = HeadGrads {
                    dq: (dq_ptr.0.add(q_at), ldq as isize),
                    dk: (dk_ptr.0.add(kv_at), ldkv as isize),
                    dv: (dv_ptr.0.add(kv_at), ldkv as isize),
                    accumulate_kv: j > 0,
                };
                let fwd = ((out[o_at..].as_ptr(), ldo as isize), &lse[pair * t..][..t]);
                flash_head_backward(cpu, scratch, fwd, view, grads, &first, t, d, scale);
            }
        }
    });
}

/// Panics unless `mask` suits `dims` and the lengths `[out, lse, scratch]` are theirs.
fn check_flash(dims: &GqaDims, mask: AttnMask<'_>, lens: [usize; 3]) {
    dims.check();
    mask.check(dims.b, dims.t);
    let GqaDims { b, t, h, d, .. } = *dims;
    assert_eq!(
        lens,
        [
            elements(&[b, t, h, d]),
            elements(&[b, h, t]),
            flash_scratch_len(*dims),
        ],
        "lengths of out, lse and scratch"
    );
}
