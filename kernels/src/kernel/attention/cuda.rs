//! The attention kernels' CUDA launch sequences: q, k and v moved into per-head regions
//! of the scratch (`attention.cu`'s layout kernels), the scores and the weighted values as
//! cuBLAS batched products, the causal softmax and its backward between them. No kernel
//! allocates: each carves its scratch into the regions of [`attention_scratch_layout`].
//!
//! Taking the kernels' tensors rather than the kernels, so that the signatures (`super`)
//! use this file and not the reverse.

use super::cpu::GqaDims;
use super::shape::{
    AttentionScratchLayout, Heads, attention_scratch_layout, gqa_attention_scratch_layout,
};
use crate::cuda::launch::{Arg, Entry, Gemm, Launch, Operand, int, per_element, per_row_warp};
use crate::program::{KernelError, TensorRef};

/// q, k, v: (B, NH, T, HS) from qkv: (B, T, 3, NH, HS).
pub(super) const SPLIT: Entry = Entry::typed("attention_split");
/// dqkv: (B, T, 3, NH, HS) from dq, dk, dv: (B, NH, T, HS).
pub(super) const JOIN: Entry = Entry::typed("attention_join");
/// (B, T, NH, HS) from (B, NH, T, HS), or the reverse.
pub(super) const HEADS: Entry = Entry::typed("attention_heads");
/// The causal softmax of f32 scores.
pub(super) const SOFTMAX_FORWARD: Entry = Entry::typed("softmax_causal_forward");
/// The gradient of the scaled scores.
pub(super) const SOFTMAX_BACKWARD: Entry = Entry::typed("softmax_causal_backward");

/// The scratch's regions, carved, at their device addresses.
struct Regions {
    q: u64,
    k: u64,
    v: u64,
    y: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    scores: u64,
    dscores: u64,
}

/// Carves `scratch` into `l`'s regions: q, y and dq of `queries` working-type elements,
/// k, v, dk and dv of `keys`, the f32 scores and their working-type gradient of `scores`.
fn carve(
    q: &mut Launch<'_>,
    scratch: &TensorRef,
    l: &AttentionScratchLayout,
    [queries, keys, scores]: [usize; 3],
) -> Regions {
    let size = q.working().dtype.size();
    let mut at = |offset: usize, bytes: usize| q.carve(scratch, offset, bytes);
    Regions {
        q: at(l.q, queries * size),
        k: at(l.k, keys * size),
        v: at(l.v, keys * size),
        y: at(l.y, queries * size),
        dq: at(l.dq, queries * size),
        dk: at(l.dk, keys * size),
        dv: at(l.dv, keys * size),
        scores: at(l.scores, scores * 4),
        dscores: at(l.dscores, scores * size),
    }
}

/// GPT-2's scratch regions for `s`.
fn gpt2_regions(q: &mut Launch<'_>, scratch: &TensorRef, s: &Heads) -> Regions {
    let (b, t, c, nh) = (s.b, s.t, s.c, s.nh);
    let l = attention_scratch_layout(q.working().dtype, b, t, c, nh);
    carve(q, scratch, &l, [b * t * c, b * t * c, b * nh * t * t])
}

/// The arguments `b, t, nh, hs` of the layout kernels.
fn heads_args(b: usize, t: usize, nh: usize, hs: usize) -> [Arg; 4] {
    [int(b), int(t), int(nh), int(hs)]
}

/// Moves qkv (B, T, 3C) into the q, k and v regions (B, NH, T, HS): n elements each.
fn split(q: &Launch<'_>, qkv: &TensorRef, r: &Regions, s: &Heads) -> Result<(), KernelError> {
    let n = s.b * s.t * s.c;
    let [b, t, nh, hs] = heads_args(s.b, s.t, s.nh, s.hs());
    // attention_split_<T>(T* q, T* k, T* v, const T* qkv, int b, int t, int nh, int hs):
    // n elements of q, k, v and 3n of qkv.
    let args = [
        Arg::Ptr(r.q),
        Arg::Ptr(r.k),
        Arg::Ptr(r.v),
        q.ptr(qkv),
        b,
        t,
        nh,
        hs,
    ];
    Ok(q.launch(SPLIT, per_element(n), &args)?)
}

/// out: (B, T, C)  att: (B, NH, T, T)  qkv: (B, T, 3C)  scratch: the regions of
/// [`attention_scratch_layout`].
pub(super) fn attention_forward(
    [out, att, qkv, scratch]: [&TensorRef; 4],
    s: &Heads,
    q: &mut Launch<'_>,
) -> Result<(), KernelError> {
    let (b, t, nh, hs) = (s.b, s.t, s.nh, s.hs());
    let n = b * t * s.c;
    if n == 0 {
        return Ok(());
    }
    let (w, r) = (q.working(), gpt2_regions(q, scratch, s));
    split(q, qkv, &r, s)?;
    let batch = b * nh;
    // Per head, column-major: scores^T (T, T) = k (T, HS) @ q^T (HS, T), scaled, in f32.
    q.gemm(Gemm {
        m: t,
        n: t,
        k: hs,
        a: Operand::of(w, r.k, hs, true),
        b: Operand::of(w, r.q, hs, false),
        c: Operand::f32(r.scores, t, false),
        alpha: 1.0 / (hs as f32).sqrt(),
        beta: 0.0,
        batch: Some((batch, t * hs, t * hs, t * t)),
    })?;
    let rows = b * nh * t;
    // softmax_causal_forward_<T>(T* att, const float* scores, int rows, int t): warp
    // `row` < rows touches row `row` (t elements) of att and scores.
    let args = [q.ptr(att), Arg::Ptr(r.scores), int(rows), int(t)];
    q.launch(SOFTMAX_FORWARD, per_row_warp(rows), &args)?;
    // Per head, column-major: y^T (HS, T) = v^T (HS, T) @ att^T (T, T).
    q.gemm(Gemm {
        m: hs,
        n: t,
        k: t,
        a: Operand::of(w, r.v, hs, false),
        b: Operand::of(w, q.address(att), t, false),
        c: Operand::of(w, r.y, hs, false),
        alpha: 1.0,
        beta: 0.0,
        batch: Some((batch, t * hs, t * t, t * hs)),
    })?;
    // attention_heads_<T>(T* out, const T* inp, int b, int t, int nh, int hs, int
    // to_heads): with to_heads = 0, out (B, T, C) from inp = y (B, NH, T, HS), n elements
    // each.
    let [b, t, nh, hs] = heads_args(b, t, nh, hs);
    let args = [q.ptr(out), Arg::Ptr(r.y), b, t, nh, hs, Arg::Int(0)];
    Ok(q.launch(HEADS, per_element(n), &args)?)
}

/// dqkv: (B, T, 3C) =  dout: (B, T, C)  qkv: (B, T, 3C)  att: (B, NH, T, T)
/// scratch: the regions of [`attention_scratch_layout`].
pub(super) fn attention_backward(
    [dqkv, dout, qkv, att, scratch]: [&TensorRef; 5],
    s: &Heads,
    q: &mut Launch<'_>,
) -> Result<(), KernelError> {
    let n = s.b * s.t * s.c;
    if n == 0 {
        return Ok(());
    }
    let r = gpt2_regions(q, scratch, s);
    split(q, qkv, &r, s)?;
    // attention_heads_<T>(T* out, const T* inp, int b, int t, int nh, int hs, int
    // to_heads): with to_heads = 1, out = dy (the y region, B, NH, T, HS) from inp = dout
    // (B, T, C), n elements each.
    let [b, t, nh, hs] = heads_args(s.b, s.t, s.nh, s.hs());
    let args = [Arg::Ptr(r.y), q.ptr(dout), b, t, nh, hs, Arg::Int(1)];
    q.launch(HEADS, per_element(n), &args)?;
    attention_backward_products(q, q.address(att), &r, s)?;
    // attention_join_<T>(T* dqkv, const T* dq, const T* dk, const T* dv, int b, int t,
    // int nh, int hs): 3n elements of dqkv, n of dq, dk, dv.
    let args = [
        q.ptr(dqkv),
        Arg::Ptr(r.dq),
        Arg::Ptr(r.dk),
        Arg::Ptr(r.dv),
        b,
        t,
        nh,
        hs,
    ];
    Ok(q.launch(JOIN, per_element(n), &args)?)
}

/// The backward's products and softmax, per head: from q, k, v, dy (the y region) and
/// att into dq, dk and dv, through the probabilities' gradient (f32, the scores region)
/// and the scaled scores' gradient (the dscores region).
fn attention_backward_products(
    q: &Launch<'_>,
    att: u64,
    r: &Regions,
    s: &Heads,
) -> Result<(), KernelError> {
    let (w, (b, t, nh, hs)) = (q.working(), (s.b, s.t, s.nh, s.hs()));
    let batch = b * nh;
    let op = |ptr, ld, transposed| Operand::of(w, ptr, ld, transposed);
    // datt^T (T, T) = v (T, HS) @ dy^T (HS, T), in f32.
    q.gemm(Gemm {
        m: t,
        n: t,
        k: hs,
        a: op(r.v, hs, true),
        b: op(r.y, hs, false),
        c: Operand::f32(r.scores, t, false),
        alpha: 1.0,
        beta: 0.0,
        batch: Some((batch, t * hs, t * hs, t * t)),
    })?;
    // dv^T (HS, T) = dy^T (HS, T) @ att (T, T).
    q.gemm(Gemm {
        m: hs,
        n: t,
        k: t,
        a: op(r.y, hs, false),
        b: op(att, t, true),
        c: op(r.dv, hs, false),
        alpha: 1.0,
        beta: 0.0,
        batch: Some((batch, t * hs, t * t, t * hs)),
    })?;
    let rows = b * nh * t;
    softmax_backward(
        q,
        [r.dscores, r.scores, att],
        rows,
        t,
        1.0 / (hs as f32).sqrt(),
    )?;
    let strides = Some((batch, t * hs, t * t, t * hs));
    // dq^T (HS, T) = k^T (HS, T) @ dpre^T (T, T).
    q.gemm(Gemm {
        m: hs,
        n: t,
        k: t,
        a: op(r.k, hs, false),
        b: op(r.dscores, t, false),
        c: op(r.dq, hs, false),
        alpha: 1.0,
        beta: 0.0,
        batch: strides,
    })?;
    // dk^T (HS, T) = q^T (HS, T) @ dpre (T, T).
    Ok(q.gemm(Gemm {
        m: hs,
        n: t,
        k: t,
        a: op(r.q, hs, false),
        b: op(r.dscores, t, true),
        c: op(r.dk, hs, false),
        alpha: 1.0,
        beta: 0.0,
        batch: strides,
    })?)
}

/// The gradient of the scaled scores, `dpre = att * (datt - sum(att * datt)) * scale`.
fn softmax_backward(
    q: &Launch<'_>,
    [dpre, datt, att]: [u64; 3],
    rows: usize,
    t: usize,
    scale: f32,
) -> Result<(), KernelError> {
    // softmax_causal_backward_<T>(T* dpre, const float* datt, const T* att, int rows, int
    // t, float scale): warp `row` < rows touches row `row` (t elements) of dpre, datt and
    // att.
    let args = [
        Arg::Ptr(dpre),
        Arg::Ptr(datt),
        Arg::Ptr(att),
        int(rows),
        int(t),
        Arg::Float(scale),
    ];
    Ok(q.launch(SOFTMAX_BACKWARD, per_row_warp(rows), &args)?)
}

/// Moves `heads` heads of D channels between a (B, T, heads, D) tensor at `rows` and a
/// (B, heads, T, D) region at `heads_ptr`: `to_heads` gathers the rows into the region,
/// otherwise scatters the region into the rows.
fn move_heads(
    q: &Launch<'_>,
    [rows, heads_ptr]: [u64; 2],
    dims: GqaDims,
    heads: usize,
    to_heads: bool,
) -> Result<(), KernelError> {
    let (dst, src) = if to_heads {
        (heads_ptr, rows)
    } else {
        (rows, heads_ptr)
    };
    // attention_heads_<T>(T* out, const T* inp, int b, int t, int nh, int hs, int
    // to_heads): B·T·heads·D elements of each.
    let args = [
        Arg::Ptr(dst),
        Arg::Ptr(src),
        int(dims.b),
        int(dims.t),
        int(heads),
        int(dims.d),
        Arg::Int(i32::from(to_heads)),
    ];
    let elements = dims.b * dims.t * heads * dims.d;
    Ok(q.launch(HEADS, per_element(elements), &args)?)
}

/// The start of both directions of grouped-query attention: the scratch carved into its
/// regions, with q, k, v (B, T, heads, D) moved into theirs (B, heads, T, D); `None`
/// when there is nothing to compute.
fn gqa_heads(
    q: &mut Launch<'_>,
    [qt, kt, vt]: [&TensorRef; 3],
    scratch: &TensorRef,
    dims: GqaDims,
) -> Result<Option<Regions>, KernelError> {
    let GqaDims { b, t, h, kv, d } = dims;
    if dims.q_len() == 0 || dims.att_len() == 0 {
        return Ok(None);
    }
    let l = gqa_attention_scratch_layout(q.working().dtype, b, t, h, kv, d);
    let r = carve(
        q,
        scratch,
        &l,
        [dims.q_len(), dims.kv_len(), dims.att_len()],
    );
    move_heads(q, [q.address(qt), r.q], dims, h, true)?;
    move_heads(q, [q.address(kt), r.k], dims, kv, true)?;
    move_heads(q, [q.address(vt), r.v], dims, kv, true)?;
    Ok(Some(r))
}

/// out: (B, T, H, D)  att: (B, H, T, T)  q: (B, T, H, D)  k, v: (B, T, KV, D)
/// scratch: the regions of [`gqa_attention_scratch_layout`]. Per (batch, key/value
/// head), the G = H / KV query heads that share it are one (G·T, D) matrix of the
/// per-head q, so each product is one batched cuBLAS call over B·KV groups.
pub(super) fn gqa_attention_forward(
    [out, att]: [&TensorRef; 2],
    inputs: [&TensorRef; 3],
    scratch: &TensorRef,
    dims: GqaDims,
    q: &mut Launch<'_>,
) -> Result<(), KernelError> {
    let GqaDims { b, t, h, kv, d } = dims;
    let Some(r) = gqa_heads(q, inputs, scratch, dims)? else {
        return Ok(());
    };
    let (w, g, att) = (q.working(), h / kv, q.address(att));
    // Per group, column-major: scores^T (T, G·T) = k (T, D) @ q^T (D, G·T), scaled.
    q.gemm(Gemm {
        m: t,
        n: g * t,
        k: d,
        a: Operand::of(w, r.k, d, true),
        b: Operand::of(w, r.q, d, false),
        c: Operand::f32(r.scores, t, false),
        alpha: 1.0 / (d as f32).sqrt(),
        beta: 0.0,
        batch: Some((b * kv, t * d, g * t * d, g * t * t)),
    })?;
    let rows = b * h * t;
    // softmax_causal_forward_<T>(T* att, const float* scores, int rows, int t): warp
    // `row` < rows touches row `row` (t elements) of att and scores.
    let args = [Arg::Ptr(att), Arg::Ptr(r.scores), int(rows), int(t)];
    q.launch(SOFTMAX_FORWARD, per_row_warp(rows), &args)?;
    // Per group, column-major: y^T (D, G·T) = v^T (D, T) @ att^T (T, G·T).
    q.gemm(Gemm {
        m: d,
        n: g * t,
        k: t,
        a: Operand::of(w, r.v, d, false),
        b: Operand::of(w, att, t, false),
        c: Operand::of(w, r.y, d, false),
        alpha: 1.0,
        beta: 0.0,
        batch: Some((b * kv, t * d, g * t * t, g * t * d)),
    })?;
    // y (B, H, T, D) into out (B, T, H, D).
    move_heads(q, [q.address(out), r.y], dims, h, false)
}

/// dq: (B, T, H, D) =  dk, dv: (B, T, KV, D) =  dout: (B, T, H, D)  q, k, v and att as
/// in [`gqa_attention_forward`]  scratch: the regions of
/// [`gqa_attention_scratch_layout`]. The products over a group's G·T rows add the key
/// and value gradients of its query heads up.
pub(super) fn gqa_attention_backward(
    [dq, dk, dv]: [&TensorRef; 3],
    [dout, att]: [&TensorRef; 2],
    inputs: [&TensorRef; 3],
    scratch: &TensorRef,
    dims: GqaDims,
    q: &mut Launch<'_>,
) -> Result<(), KernelError> {
    let Some(r) = gqa_heads(q, inputs, scratch, dims)? else {
        return Ok(());
    };
    // The per-head output gradient goes in the y region, the probabilities' gradient
    // (f32) in the scores region.
    move_heads(q, [q.address(dout), r.y], dims, dims.h, true)?;
    gqa_backward_products(q, q.address(att), &r, dims)?;
    // The per-head gradients (B, heads, T, D) into dq, dk, dv (B, T, heads, D).
    move_heads(q, [q.address(dq), r.dq], dims, dims.h, false)?;
    move_heads(q, [q.address(dk), r.dk], dims, dims.kv, false)?;
    move_heads(q, [q.address(dv), r.dv], dims, dims.kv, false)
}

/// Grouped-query attention's backward products and softmax, per group of G = H / KV
/// query heads, from the per-head regions into dq, dk and dv.
fn gqa_backward_products(
    q: &Launch<'_>,
    att: u64,
    r: &Regions,
    dims: GqaDims,
) -> Result<(), KernelError> {
    let GqaDims { b, t, h, kv, d } = dims;
    let (w, g) = (q.working(), h / kv);
    let op = |ptr, ld, transposed| Operand::of(w, ptr, ld, transposed);
    // datt^T (T, G·T) = v (T, D) @ dy^T (D, G·T), in f32.
    q.gemm(Gemm {
        m: t,
        n: g * t,
        k: d,
        a: op(r.v, d, true),
        b: op(r.y, d, false),
        c: Operand::f32(r.scores, t, false),
        alpha: 1.0,
        beta: 0.0,
        batch: Some((b * kv, t * d, g * t * d, g * t * t)),
    })?;
    // dv^T (D, T) = dy^T (D, G·T) @ att (G·T, T): the group's heads add up.
    q.gemm(Gemm {
        m: d,
        n: t,
        k: g * t,
        a: op(r.y, d, false),
        b: op(att, t, true),
        c: op(r.dv, d, false),
        alpha: 1.0,
        beta: 0.0,
        batch: Some((b * kv, g * t * d, g * t * t, t * d)),
    })?;
    softmax_backward(
        q,
        [r.dscores, r.scores, att],
        b * h * t,
        t,
        1.0 / (d as f32).sqrt(),
    )?;
    // dq^T (D, G·T) = k^T (D, T) @ dpre^T (T, G·T).
    q.gemm(Gemm {
        m: d,
        n: g * t,
        k: t,
        a: op(r.k, d, false),
        b: op(r.dscores, t, false),
        c: op(r.dq, d, false),
        alpha: 1.0,
        beta: 0.0,
        batch: Some((b * kv, t * d, g * t * t, g * t * d)),
    })?;
    // dk^T (D, T) = q^T (D, G·T) @ dpre (G·T, T): the group's heads add up.
    Ok(q.gemm(Gemm {
        m: d,
        n: t,
        k: g * t,
        a: op(r.q, d, false),
        b: op(r.dscores, t, true),
        c: op(r.dk, d, false),
        alpha: 1.0,
        beta: 0.0,
        batch: Some((b * kv, g * t * d, g * t * t, t * d)),
    })?)
}
