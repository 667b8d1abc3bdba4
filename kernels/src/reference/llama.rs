//! Scalar reference kernels of the Llama family's blocks (Llama, Qwen2, Qwen3, Mistral):
//! RMSNorm, rotary position embeddings in Hugging Face's "rotate_half" form, the SwiGLU
//! gate of the MLP, and causal grouped-query attention. Generic over the float type, as
//! [`super::gpt2`] is, so that the same code checks the fast kernels in f32 and the
//! backward passes against finite differences in f64.
//!
//! Conventions are those of [`super::gpt2`]: row-major tensors, forward kernels
//! overwrite, backward kernels accumulate (`+=`) into parameter gradients and overwrite
//! activation gradients, except RMSNorm's input gradient, which accumulates (the residual
//! stream joins there, as at LayerNorm).
//!
//! Layouts: activations are rows of B × T positions; attention's q is (B, T, H, D), k and
//! v are (B, T, KV, D) with KV dividing H (query head h reads key/value head
//! h / (H / KV)), as the q, k and v projections produce them. RoPE rotates every
//! D-element row of such a tensor by its position t; its table is (at least T, D/2) of
//! cosines and as many sines, row t for position t.
#![allow(clippy::needless_range_loop)]

use super::gpt2::Real;

fn r<R: Real>(x: f64) -> R {
    R::from_f64(x)
}

/// out: (N, C)  rstd: (N)  inp: (N, C)  weight: (C).
/// `out = inp * rstd * weight` with `rstd = 1 / sqrt(mean(inp^2) + eps)` per row.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_forward<R: Real>(
    out: &mut [R],
    rstd: &mut [R],
    inp: &[R],
    weight: &[R],
    eps: f64,
    n: usize,
    c: usize,
) {
    assert_eq!(
        (out.len(), inp.len(), rstd.len(), weight.len()),
        (n * c, n * c, n, c)
    );
    for row in 0..n {
        let x = &inp[row * c..][..c];
        let mut squares = R::default();
        for &v in x {
            squares += v * v;
        }
        let s = r::<R>(1.0) / (squares / r(c as f64) + r(eps)).sqrt();
        for i in 0..c {
            out[row * c + i] = x[i] * s * weight[i];
        }
        rstd[row] = s;
    }
}

/// dinp: (N, C) +=  dweight: (C) +=  dout: (N, C)  inp: (N, C)  weight: (C)
/// rstd: (N) from the forward pass.
/// With `norm = inp * rstd` and `g = weight * dout`:
/// `dinp += rstd * (g - norm * mean(g * norm))`, `dweight += sum over rows of norm * dout`.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward<R: Real>(
    dinp: &mut [R],
    dweight: &mut [R],
    dout: &[R],
    inp: &[R],
    weight: &[R],
    rstd: &[R],
    n: usize,
    c: usize,
) {
    assert_eq!((dinp.len(), dout.len(), inp.len()), (n * c, n * c, n * c));
    assert_eq!((dweight.len(), weight.len(), rstd.len()), (c, c, n));
    for row in 0..n {
        let x = &inp[row * c..][..c];
        let d = &dout[row * c..][..c];
        let s = rstd[row];
        let mut g_norm = R::default();
        for i in 0..c {
            g_norm += weight[i] * d[i] * x[i] * s;
        }
        let g_norm_mean = g_norm / r(c as f64);
        for i in 0..c {
            let norm = x[i] * s;
            dweight[i] += norm * d[i];
            dinp[row * c + i] += (weight[i] * d[i] - norm * g_norm_mean) * s;
        }
    }
}

/// The default inverse frequencies of rotary embeddings over a head of `d` channels:
/// `theta^(-2i/d)` for `i < d/2`. Scaled variants (Llama 3's `rope_scaling`) are the
/// caller's: every RoPE kernel takes its table, built from the inverse frequencies the
/// caller chose.
pub fn rope_inv_freq(theta: f64, d: usize) -> Vec<f64> {
    (0..d / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / d as f64))
        .collect()
}

/// Llama 3.1's `rope_scaling` (`rope_type: llama3`) applied to default inverse
/// frequencies, in f64, as transformers' `_compute_llama3_parameters` writes it:
/// wavelengths `2π / f` below `old / high` kept, above `old / low` divided by `factor`,
/// between them interpolated with `smooth = (old / wavelength - low) / (high - low)`.
pub fn rope_inv_freq_llama3(
    inv_freq: &[f64],
    factor: f64,
    low: f64,
    high: f64,
    old: f64,
) -> Vec<f64> {
    inv_freq
        .iter()
        .map(|&f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            let divided = if wavelen > old / low { f / factor } else { f };
            let smooth = (old / wavelen - low) / (high - low);
            let medium = wavelen >= old / high && wavelen <= old / low;
            if medium {
                (1.0 - smooth) * divided / factor + smooth * divided
            } else {
                divided
            }
        })
        .collect()
}

/// cos, sin: (T, D/2) with `cos[t, i] = cos(t * inv_freq[i])`, likewise sin, in f64.
pub fn rope_table<R: Real>(cos: &mut [R], sin: &mut [R], inv_freq: &[f64], t: usize) {
    let half = inv_freq.len();
    assert_eq!((cos.len(), sin.len()), (t * half, t * half));
    for ti in 0..t {
        for i in 0..half {
            let angle = ti as f64 * inv_freq[i];
            cos[ti * half + i] = r(angle.cos());
            sin[ti * half + i] = r(angle.sin());
        }
    }
}

/// out: (B, T, H, D)  inp: (B, T, H, D)  cos, sin: (at least T, D/2), D even.
/// Each row `x` of D channels at position t, split in halves x1 = x[..D/2] and
/// x2 = x[D/2..], becomes `(x1 cos - x2 sin, x2 cos + x1 sin)` with row t of the table
/// (`x * cos + rotate_half(x) * sin`, Hugging Face's form).
#[allow(clippy::too_many_arguments)]
pub fn rope_forward<R: Real>(
    out: &mut [R],
    inp: &[R],
    cos: &[R],
    sin: &[R],
    b: usize,
    t: usize,
    h: usize,
    d: usize,
) {
    rope_rotate(out, inp, cos, sin, b, t, h, d, false);
}

/// dinp: (B, T, H, D) =  dout: (B, T, H, D)  cos, sin: as in [`rope_forward`].
/// The rotation's transpose: `(d1 cos + d2 sin, d2 cos - d1 sin)`.
#[allow(clippy::too_many_arguments)]
pub fn rope_backward<R: Real>(
    dinp: &mut [R],
    dout: &[R],
    cos: &[R],
    sin: &[R],
    b: usize,
    t: usize,
    h: usize,
    d: usize,
) {
    rope_rotate(dinp, dout, cos, sin, b, t, h, d, true);
}

/// Rotates each row by its position's angles, or by their negatives when `inverse`.
#[allow(clippy::too_many_arguments)]
fn rope_rotate<R: Real>(
    out: &mut [R],
    inp: &[R],
    cos: &[R],
    sin: &[R],
    b: usize,
    t: usize,
    h: usize,
    d: usize,
    inverse: bool,
) {
    assert_eq!(d % 2, 0, "an odd head dimension {d}");
    let half = d / 2;
    assert_eq!((out.len(), inp.len()), (b * t * h * d, b * t * h * d));
    assert!(cos.len() >= t * half && sin.len() >= t * half);
    for bi in 0..b {
        for ti in 0..t {
            for hi in 0..h {
                let at = ((bi * t + ti) * h + hi) * d;
                for i in 0..half {
                    let (c, s) = (cos[ti * half + i], sin[ti * half + i]);
                    let s = if inverse { -s } else { s };
                    let (x1, x2) = (inp[at + i], inp[at + half + i]);
                    out[at + i] = x1 * c - x2 * s;
                    out[at + half + i] = x2 * c + x1 * s;
                }
            }
        }
    }
}

/// out: (N) = `silu(gate) * up`, with `silu(x) = x / (1 + e^-x)`; gate, up: (N).
pub fn swiglu_forward<R: Real>(out: &mut [R], gate: &[R], up: &[R]) {
    assert_eq!((gate.len(), up.len()), (out.len(), out.len()));
    for i in 0..out.len() {
        let g = gate[i];
        out[i] = g / (r::<R>(1.0) + (-g).exp()) * up[i];
    }
}

/// dgate: (N) =  dup: (N) =  dout: (N)  gate, up: (N) the forward's inputs.
/// `dup = silu(gate) dout`, `dgate = silu'(gate) up dout` with
/// `silu'(x) = s (1 + x (1 - s))`, `s = sigmoid(x)`.
pub fn swiglu_backward<R: Real>(dgate: &mut [R], dup: &mut [R], dout: &[R], gate: &[R], up: &[R]) {
    let n = dout.len();
    assert_eq!((dgate.len(), dup.len(), gate.len(), up.len()), (n, n, n, n));
    for i in 0..n {
        let g = gate[i];
        let s = r::<R>(1.0) / (r::<R>(1.0) + (-g).exp());
        dup[i] = g * s * dout[i];
        dgate[i] = s * (r::<R>(1.0) + g * (r::<R>(1.0) - s)) * up[i] * dout[i];
    }
}

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
    dims.check();
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
                let qr = &q[((bi * t + ti) * h + hi) * d..][..d];
                let a = &mut att[((bi * h + hi) * t + ti) * t..][..t];
                let mut max = r::<R>(f64::NEG_INFINITY);
                for t2 in 0..=ti {
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
                for t2 in 0..=ti {
                    a[t2] = (a[t2] - max).exp();
                    sum += a[t2];
                }
                for t2 in 0..t {
                    a[t2] = if t2 <= ti { a[t2] / sum } else { R::default() };
                }
                let o = &mut out[((bi * t + ti) * h + hi) * d..][..d];
                o.fill(R::default());
                for t2 in 0..=ti {
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
