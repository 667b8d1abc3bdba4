//! The scalar reference of LayerNorm (`super`).
//!
//! Plain scalar loops, generic over [`Real`] so that the same code checks the fast
//! kernels in f32 and backward passes against finite differences in f64; nothing here is
//! tuned. Conventions are the fast kernels': row-major tensors, forward kernels
//! overwrite, backward kernels accumulate (`+=`) into parameter gradients.
#![allow(clippy::needless_range_loop)]

use super::LAYERNORM_EPS;
use crate::reference::{Real, r};

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
