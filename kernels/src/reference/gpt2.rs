//! Scalar reference kernels of GPT-2's forward and backward passes, after llm.c's
//! `train_gpt2.c`, generic over the float type so that the same code runs in f32 (to
//! check the fast kernels element by element) and in f64 (to check backward passes
//! against finite differences).
//!
//! Conventions shared with the fast kernels in [`crate::ops`]:
//! - every tensor is row-major; the shapes are stated at the top of each kernel;
//! - a forward kernel overwrites its outputs;
//! - a backward kernel *accumulates* (`+=`) into parameter gradients, so that gradients
//!   of micro-batches add up; activation gradients are overwritten (`=`) except where a
//!   kernel says it accumulates (LayerNorm's input gradient, where the residual joins).
//!
//! Nothing here is tuned: loops are written for reading, with indices as in the math.
#![allow(clippy::needless_range_loop)]

use std::ops::{Add, AddAssign, Div, Mul, Neg, Sub};

use super::llama::{self, GqaDims};
use crate::ops::WeightLayout;

/// The float types the reference runs in: `f32` and `f64`.
pub trait Real:
    Copy
    + Default
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + std::fmt::Debug
    + Send
    + Sync
    + 'static
{
    /// Converts from f64 (rounding for f32).
    fn from_f64(x: f64) -> Self;
    /// Converts to f64 (exact).
    fn to_f64(self) -> f64;
    /// e^self.
    fn exp(self) -> Self;
    /// Natural logarithm.
    fn ln(self) -> Self;
    /// Hyperbolic tangent.
    fn tanh(self) -> Self;
    /// Square root.
    fn sqrt(self) -> Self;
}

macro_rules! impl_real {
    ($t:ty) => {
        impl Real for $t {
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
        }
    };
}
impl_real!(f32);
impl_real!(f64);

fn r<R: Real>(x: f64) -> R {
    R::from_f64(x)
}

/// LayerNorm's epsilon in GPT-2.
pub const LAYERNORM_EPS: f64 = 1e-5;

/// out: (B, T, C)  tokens: (B, T)  wte: (V, C)  wpe: (maxT, C), maxT >= T.
/// `out[b, t] = wte[tokens[b, t]] + wpe[t]`.
pub fn encoder_forward<R: Real>(
    out: &mut [R],
    tokens: &[u32],
    wte: &[R],
    wpe: &[R],
    b: usize,
    t: usize,
    c: usize,
) {
    assert_eq!(out.len(), b * t * c);
    assert_eq!(tokens.len(), b * t);
    for bi in 0..b {
        for ti in 0..t {
            let token = tokens[bi * t + ti] as usize;
            let o = &mut out[(bi * t + ti) * c..][..c];
            for i in 0..c {
                o[i] = wte[token * c + i] + wpe[ti * c + i];
            }
        }
    }
}

/// dwte: (V, C) +=  dwpe: (maxT, C) +=  dout: (B, T, C)  tokens: (B, T).
pub fn encoder_backward<R: Real>(
    dwte: &mut [R],
    dwpe: &mut [R],
    dout: &[R],
    tokens: &[u32],
    b: usize,
    t: usize,
    c: usize,
) {
    assert_eq!(dout.len(), b * t * c);
    assert_eq!(tokens.len(), b * t);
    for bi in 0..b {
        for ti in 0..t {
            let token = tokens[bi * t + ti] as usize;
            let d = &dout[(bi * t + ti) * c..][..c];
            for i in 0..c {
                dwte[token * c + i] += d[i];
                dwpe[ti * c + i] += d[i];
            }
        }
    }
}

/// out: (N, C)  mean: (N)  rstd: (N)  inp: (N, C)  weight: (C)  bias: (C).
/// Normalises each row of `inp` (biased variance, eps 1e-5), then scales and shifts.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward<R: Real>(
    out: &mut [R],
    mean: &mut [R],
    rstd: &mut [R],
    inp: &[R],
    weight: &[R],
    bias: &[R],
    n: usize,
    c: usize,
) {
    assert_eq!(inp.len(), n * c);
    assert_eq!(out.len(), n * c);
    for row in 0..n {
        let x = &inp[row * c..][..c];
        let mut m = R::default();
        for &v in x {
            m += v;
        }
        m = m / r(c as f64);
        let mut var = R::default();
        for &v in x {
            var += (v - m) * (v - m);
        }
        var = var / r(c as f64);
        let s = R::from_f64(1.0) / (var + r(LAYERNORM_EPS)).sqrt();
        let o = &mut out[row * c..][..c];
        for i in 0..c {
            o[i] = (x[i] - m) * s * weight[i] + bias[i];
        }
        mean[row] = m;
        rstd[row] = s;
    }
}

/// dinp: (N, C) +=  dweight: (C) +=  dbias: (C) +=  dout: (N, C)  inp: (N, C)
/// weight: (C)  mean, rstd: (N) from the forward pass.
/// `dinp` accumulates: in a transformer block it already holds the residual's gradient.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<R: Real>(
    dinp: &mut [R],
    dweight: &mut [R],
    dbias: &mut [R],
    dout: &[R],
    inp: &[R],
    weight: &[R],
    mean: &[R],
    rstd: &[R],
    n: usize,
    c: usize,
) {
    assert_eq!(dinp.len(), n * c);
    for row in 0..n {
        let x = &inp[row * c..][..c];
        let d = &dout[row * c..][..c];
        let (m, s) = (mean[row], rstd[row]);
        // Two reductions over the row: mean of dnorm and mean of dnorm * norm.
        let mut dnorm_mean = R::default();
        let mut dnorm_norm_mean = R::default();
        for i in 0..c {
            let norm = (x[i] - m) * s;
            let dnorm = weight[i] * d[i];
            dnorm_mean += dnorm;
            dnorm_norm_mean += dnorm * norm;
        }
        dnorm_mean = dnorm_mean / r(c as f64);
        dnorm_norm_mean = dnorm_norm_mean / r(c as f64);
        let di = &mut dinp[row * c..][..c];
        for i in 0..c {
            let norm = (x[i] - m) * s;
            let dnorm = weight[i] * d[i];
            dbias[i] += d[i];
            dweight[i] += norm * d[i];
            di[i] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
        }
    }
}

/// The weight element that multiplies input channel `i` into output channel `o`.
fn weight_at<R: Real>(
    weight: &[R],
    layout: WeightLayout,
    i: usize,
    o: usize,
    c: usize,
    oc: usize,
) -> R {
    match layout {
        WeightLayout::InOut => weight[i * oc + o],
        WeightLayout::OutIn => weight[o * c + i],
    }
}

/// out: (N, OC)  inp: (N, C)  weight: (C, OC) for [`WeightLayout::InOut`] or (OC, C) for
/// [`WeightLayout::OutIn`]  bias: (OC) or none.  `out = inp @ W + bias`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward<R: Real>(
    out: &mut [R],
    inp: &[R],
    weight: &[R],
    bias: Option<&[R]>,
    layout: WeightLayout,
    n: usize,
    c: usize,
    oc: usize,
) {
    assert_eq!(out.len(), n * oc);
    assert_eq!(inp.len(), n * c);
    assert_eq!(weight.len(), c * oc);
    for row in 0..n {
        for o in 0..oc {
            let mut acc = bias.map_or(R::default(), |b| b[o]);
            for i in 0..c {
                acc += inp[row * c + i] * weight_at(weight, layout, i, o, c, oc);
            }
            out[row * oc + o] = acc;
        }
    }
}

/// dinp: (N, C) =  dweight: shaped as weight, +=  dbias: (OC) +=  dout: (N, OC)
/// inp: (N, C)  weight: as in [`matmul_forward`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward<R: Real>(
    dinp: &mut [R],
    dweight: &mut [R],
    dbias: Option<&mut [R]>,
    dout: &[R],
    inp: &[R],
    weight: &[R],
    layout: WeightLayout,
    n: usize,
    c: usize,
    oc: usize,
) {
    assert_eq!(dinp.len(), n * c);
    assert_eq!(dweight.len(), c * oc);
    for row in 0..n {
        for i in 0..c {
            let mut acc = R::default();
            for o in 0..oc {
                acc += dout[row * oc + o] * weight_at(weight, layout, i, o, c, oc);
            }
            dinp[row * c + i] = acc;
        }
    }
    for i in 0..c {
        for o in 0..oc {
            let mut acc = R::default();
            for row in 0..n {
                acc += inp[row * c + i] * dout[row * oc + o];
            }
            match layout {
                WeightLayout::InOut => dweight[i * oc + o] += acc,
                WeightLayout::OutIn => dweight[o * c + i] += acc,
            }
        }
    }
    if let Some(dbias) = dbias {
        for o in 0..oc {
            for row in 0..n {
                dbias[o] += dout[row * oc + o];
            }
        }
    }
}

/// out: (B, T, C)  att: (B, NH, T, T)  qkv: (B, T, 3C) holding Q, K, V side by side, each
/// split into NH heads of C/NH channels.
/// Causal self-attention: `att[b, h, t, :]` is the softmax over `t2 <= t` of
/// `q(t) . k(t2) / sqrt(hs)` (zero for `t2 > t`), and `out[b, t, h] = sum att * v`:
/// grouped-query attention ([`llama::gqa_attention_forward`]) with as many key/value
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
    llama::gqa_attention_forward(out, att, &q, &k, &v, heads(b, t, c, nh));
}

/// dqkv: (B, T, 3C) =  dout: (B, T, C)  qkv: (B, T, 3C)  att: (B, NH, T, T) from the
/// forward pass ([`llama::gqa_attention_backward`], its gradients put side by side).
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
    let dims = heads(b, t, c, nh);
    llama::gqa_attention_backward(&mut dq, &mut dk, &mut dv, dout, &q, &k, &v, att, dims);
    for (row, d) in dqkv.chunks_exact_mut(3 * c).enumerate() {
        for (part, grad) in [&dq, &dk, &dv].into_iter().enumerate() {
            d[part * c..][..c].copy_from_slice(&grad[row * c..][..c]);
        }
    }
}

/// GPT-2's NH heads of C/NH channels as grouped-query attention's dimensions.
fn heads(b: usize, t: usize, c: usize, nh: usize) -> GqaDims {
    GqaDims {
        b,
        t,
        h: nh,
        kv: nh,
        d: c / nh,
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

/// sqrt(2 / pi), the constant of GPT-2's tanh-approximated GELU.
pub const GELU_SCALE: f64 = 0.797_884_560_802_865_4;

/// out: (N)  inp: (N).  `out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub fn gelu_forward<R: Real>(out: &mut [R], inp: &[R]) {
    assert_eq!(out.len(), inp.len());
    for (o, &x) in out.iter_mut().zip(inp) {
        let inner = r::<R>(GELU_SCALE) * (x + r::<R>(0.044715) * x * x * x);
        *o = r::<R>(0.5) * x * (r::<R>(1.0) + inner.tanh());
    }
}

/// dinp: (N) =  inp: (N) the forward input  dout: (N).
pub fn gelu_backward<R: Real>(dinp: &mut [R], inp: &[R], dout: &[R]) {
    assert_eq!(dinp.len(), inp.len());
    assert_eq!(dout.len(), inp.len());
    for i in 0..inp.len() {
        let x = inp[i];
        let inner = r::<R>(GELU_SCALE) * (x + r::<R>(0.044715) * x * x * x);
        let th = inner.tanh();
        let sech2 = r::<R>(1.0) - th * th;
        let dinner = r::<R>(GELU_SCALE) * (r::<R>(1.0) + r::<R>(3.0 * 0.044715) * x * x);
        let grad = r::<R>(0.5) * (r::<R>(1.0) + th) + r::<R>(0.5) * x * sech2 * dinner;
        dinp[i] = grad * dout[i];
    }
}

/// out: (N)  a: (N)  b: (N).  `out = a + b`; its backward passes `dout` to both inputs.
pub fn residual_forward<R: Real>(out: &mut [R], a: &[R], b: &[R]) {
    assert_eq!(out.len(), a.len());
    assert_eq!(out.len(), b.len());
    for i in 0..out.len() {
        out[i] = a[i] + b[i];
    }
}

/// losses: (N)  logits: (N, V)  targets: (N).
/// `losses[n] = -log softmax(logits[n])[targets[n]]`; 0 where `targets[n]` is
/// [`IGNORE_TARGET`](crate::program::IGNORE_TARGET).
pub fn crossentropy_forward<R: Real>(
    losses: &mut [R],
    logits: &[R],
    targets: &[u32],
    n: usize,
    v: usize,
) {
    assert_eq!(logits.len(), n * v);
    assert_eq!(targets.len(), n);
    for row in 0..n {
        let l = &logits[row * v..][..v];
        let max = l
            .iter()
            .copied()
            .fold(l[0], |m, x| if x > m { x } else { m });
        let mut sum = R::default();
        for &x in l {
            sum += (x - max).exp();
        }
        losses[row] = if targets[row] == crate::program::IGNORE_TARGET {
            R::default()
        } else {
            sum.ln() + max - l[targets[row] as usize]
        };
    }
}

/// dlogits: (N, V) =  logits: (N, V)  targets: (N)  dloss: the gradient of the final loss
/// with respect to each position's loss (1/N for the mean).
/// `dlogits[n] = (softmax(logits[n]) - onehot(targets[n])) * dloss`; 0 where
/// `targets[n]` is [`IGNORE_TARGET`](crate::program::IGNORE_TARGET).
pub fn crossentropy_backward<R: Real>(
    dlogits: &mut [R],
    logits: &[R],
    targets: &[u32],
    dloss: R,
    n: usize,
    v: usize,
) {
    assert_eq!(dlogits.len(), n * v);
    for row in 0..n {
        let l = &logits[row * v..][..v];
        let max = l
            .iter()
            .copied()
            .fold(l[0], |m, x| if x > m { x } else { m });
        let mut sum = R::default();
        for &x in l {
            sum += (x - max).exp();
        }
        let d = &mut dlogits[row * v..][..v];
        if targets[row] == crate::program::IGNORE_TARGET {
            d.fill(R::default());
            continue;
        }
        for i in 0..v {
            let p = (l[i] - max).exp() / sum;
            let onehot = if i == targets[row] as usize {
                r(1.0)
            } else {
                R::default()
            };
            d[i] = (p - onehot) * dloss;
        }
    }
}
