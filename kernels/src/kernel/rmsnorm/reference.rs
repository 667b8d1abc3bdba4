//! The scalar reference of RMSNorm (`super`).
//!
//! Plain scalar loops, generic over [`Real`] so that the same code checks the fast
//! kernels in f32 and backward passes against finite differences in f64; nothing here is
//! tuned. Conventions are the fast kernels': row-major tensors, forward kernels
//! overwrite, backward kernels accumulate (`+=`) into parameter gradients.
#![allow(clippy::needless_range_loop)]

use crate::reference::{Real, r};

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
