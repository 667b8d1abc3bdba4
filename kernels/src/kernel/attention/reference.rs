//! The scalar reference of causal attention (`super`): grouped-query attention, where a
//! key/value head serves H / KV query heads, and GPT-2's multi-head attention over its
//! fused qkv as the case KV = H.
//!
//! Plain scalar loops, generic over [`Real`] so that the same code checks the fast
//! kernels in f32 and backward passes against finite differences in f64; nothing here is
//! tuned. Conventions are the fast kernels': row-major tensors, forward kernels
//! overwrite, backward kernels accumulate (`+=`) into parameter gradients.
#![allow(clippy::needless_range_loop)]

use super::cpu::{AttnMask, GqaDims};
use crate::reference::{Real, r};

/// out: (B, T, H, D)  att: (B, H, T, T)  q: (B, T, H, D)  k, v: (B, T, KV, D).
/// `att[b, h, t, :]` is the softmax over `t2 <= t` of `q(t) . k(t2) / sqrt(D)` (zero for
/// `t2 > t`), with k of head h / (H / KV); `out[b, t, h] = sum att * v` likewise.
pub fn gqa_attention_forward<R: Real>(
    out: &mut [R],
    att: &mut [R],
    q: &[R],
    k: &[R],
    v: &[R],
    dims: GqaDims,
) {
    gqa_attention_forward_masked(out, att, q, k, v, dims, AttnMask::CAUSAL);
}

/// As [`gqa_attention_forward`], query `t` seeing only keys `mask.first_key(b, t)..=t`
/// (a sliding window, documents of a packed sequence); the probabilities of the keys it
/// does not see are zero. [`gqa_attention_backward`] needs no mask: it reads them.
pub fn gqa_attention_forward_masked<R: Real>(
    out: &mut [R],
    att: &mut [R],
    q: &[R],
    k: &[R],
    v: &[R],
    dims: GqaDims,
    mask: AttnMask<'_>,
) {
    dims.check();
    mask.check(dims.b, dims.t);
    let GqaDims { b, t, h, kv, d } = dims;
    assert_eq!(
        (q.len(), out.len(), att.len()),
        (dims.q_len(), dims.q_len(), dims.att_len())
    );
    assert_eq!((k.len(), v.len()), (dims.kv_len(), dims.kv_len()));
    let scale = r::<R>(1.0) / r::<R>(d as f64).sqrt();
    for bi in 0..b {
        for hi in 0..h {
            let g = dims.kv_head(hi);
            for ti in 0..t {
                let first = mask.first_key(bi, ti, t);
                let qr = &q[((bi * t + ti) * h + hi) * d..][..d];
                let a = &mut att[((bi * h + hi) * t + ti) * t..][..t];
                let mut max = r::<R>(f64::NEG_INFINITY);
                for t2 in first..=ti {
                    let kr = &k[((bi * t + t2) * kv + g) * d..][..d];
                    let mut dot = R::default();
                    for i in 0..d {
                        dot += qr[i] * kr[i];
                    }
                    a[t2] = dot * scale;
                    if a[t2] > max {
                        max = a[t2];
                    }
                }
                let mut sum = R::default();
                for t2 in first..=ti {
                    a[t2] = (a[t2] - max).exp();
                    sum += a[t2];
                }
                for t2 in 0..t {
                    let seen = (first..=ti).contains(&t2);
                    a[t2] = if seen { a[t2] / sum } else { R::default() };
                }
                let o = &mut out[((bi * t + ti) * h + hi) * d..][..d];
                o.fill(R::default());
                for t2 in first..=ti {
                    let vr = &v[((bi * t + t2) * kv + g) * d..][..d];
                    for i in 0..d {
                        o[i] += a[t2] * vr[i];
                    }
                }
            }
        }
    }
}

/// dq: (B, T, H, D) =  dk, dv: (B, T, KV, D) =  dout: (B, T, H, D)  q, k, v as in
/// [`gqa_attention_forward`]  att: (B, H, T, T) from the forward pass. The gradients of
/// a key/value head add up over the query heads that share it.
#[allow(clippy::too_many_arguments)]
pub fn gqa_attention_backward<R: Real>(
    dq: &mut [R],
    dk: &mut [R],
    dv: &mut [R],
    dout: &[R],
    q: &[R],
    k: &[R],
    v: &[R],
    att: &[R],
    dims: GqaDims,
) {
    dims.check();
    let GqaDims { b, t, h, kv, d } = dims;
    assert_eq!(
        (dq.len(), dout.len(), att.len()),
        (dims.q_len(), dims.q_len(), dims.att_len())
    );
    assert_eq!((dk.len(), dv.len()), (dims.kv_len(), dims.kv_len()));
    let scale = r::<R>(1.0) / r::<R>(d as f64).sqrt();
    dq.fill(R::default());
    dk.fill(R::default());
    dv.fill(R::default());
    let mut datt = vec![R::default(); t];
    for bi in 0..b {
        for hi in 0..h {
            let g = dims.kv_head(hi);
            for ti in 0..t {
                let a = &att[((bi * h + hi) * t + ti) * t..][..t];
                let q_at = ((bi * t + ti) * h + hi) * d;
                let dy = &dout[q_at..][..d];
                for t2 in 0..=ti {
                    let kv_at = ((bi * t + t2) * kv + g) * d;
                    let mut acc = R::default();
                    for i in 0..d {
                        acc += v[kv_at + i] * dy[i];
                        dv[kv_at + i] += a[t2] * dy[i];
                    }
                    datt[t2] = acc;
                }
                let mut dot = R::default();
                for t2 in 0..=ti {
                    dot += a[t2] * datt[t2];
                }
                for t2 in 0..=ti {
                    let dpre = a[t2] * (datt[t2] - dot) * scale;
                    let kv_at = ((bi * t + t2) * kv + g) * d;
                    for i in 0..d {
                        dq[q_at + i] += dpre * k[kv_at + i];
                        dk[kv_at + i] += dpre * q[q_at + i];
                    }
                }
            }
        }
    }
}

/// out: (B, T, C)  att: (B, NH, T, T)  qkv: (B, T, 3C) holding Q, K, V side by side, each
/// split into NH heads of C/NH channels.
/// Causal self-attention: `att[b, h, t, :]` is the softmax over `t2 <= t` of
/// `q(t) . k(t2) / sqrt(hs)` (zero for `t2 > t`), and `out[b, t, h] = sum att * v`:
/// grouped-query attention ([`gqa_attention_forward`]) with as many key/value
/// heads as query heads, on Q, K and V taken apart.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward<R: Real>(
    out: &mut [R],
    att: &mut [R],
    qkv: &[R],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    assert_eq!(c % nh, 0);
    assert_eq!(qkv.len(), b * t * 3 * c);
    let [q, k, v] = split_qkv(qkv, c);
    gqa_attention_forward(out, att, &q, &k, &v, GqaDims::multi_head(b, t, c, nh));
}

/// dqkv: (B, T, 3C) =  dout: (B, T, C)  qkv: (B, T, 3C)  att: (B, NH, T, T) from the
/// forward pass ([`gqa_attention_backward`], its gradients put side by side).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<R: Real>(
    dqkv: &mut [R],
    dout: &[R],
    qkv: &[R],
    att: &[R],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    assert_eq!(c % nh, 0);
    assert_eq!((dqkv.len(), qkv.len()), (b * t * 3 * c, b * t * 3 * c));
    let [q, k, v] = split_qkv(qkv, c);
    let [mut dq, mut dk, mut dv] = [0, 1, 2].map(|_| vec![R::default(); b * t * c]);
    let dims = GqaDims::multi_head(b, t, c, nh);
    gqa_attention_backward(&mut dq, &mut dk, &mut dv, dout, &q, &k, &v, att, dims);
    for (row, d) in dqkv.chunks_exact_mut(3 * c).enumerate() {
        for (part, grad) in [&dq, &dk, &dv].into_iter().enumerate() {
            d[part * c..][..c].copy_from_slice(&grad[row * c..][..c]);
        }
    }
}

/// Q, K and V, each (B, T, C), from qkv: (B, T, 3C).
fn split_qkv<R: Real>(qkv: &[R], c: usize) -> [Vec<R>; 3] {
    [0, 1, 2].map(|part| {
        qkv.chunks_exact(3 * c)
            .flat_map(|row| row[part * c..][..c].iter().copied())
            .collect()
    })
}
