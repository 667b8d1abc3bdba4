//! LayerNorm (eps 1e-5, biased variance), forward and backward.

use super::simd::on_isa;
use super::{Cpu, RowsMut, par_rows, simd};
use crate::reference::gpt2::LAYERNORM_EPS;

/// out: (N, C)  mean: (N)  rstd: (N)  inp: (N, C)  weight: (C)  bias: (C).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward(
    cpu: &Cpu,
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: &[f32],
    n: usize,
    c: usize,
) {
    assert_eq!(out.len(), n * c);
    assert_eq!(inp.len(), n * c);
    assert_eq!((mean.len(), rstd.len()), (n, n));
    assert_eq!((weight.len(), bias.len()), (c, c));
    let parts = (
        RowsMut::new(out, c),
        RowsMut::new(mean, 1),
        RowsMut::new(rstd, 1),
    );
    par_rows(
        cpu.threads_for(n * c),
        n,
        1,
        parts,
        |rows, (out, mean, rstd)| {
            on_isa!(cpu.isa, {
                for (i, row) in rows.enumerate() {
                    let x = &inp[row * c..][..c];
                    let m = simd::sum(x) / c as f32;
                    let var = simd::sum_squared_deviation(x, m) / c as f32;
                    let s = 1.0 / (var + LAYERNORM_EPS as f32).sqrt();
                    let o = &mut out.data[i * c..][..c];
                    for j in 0..c {
                        o[j] = (x[j] - m) * s * weight[j] + bias[j];
                    }
                    mean.data[i] = m;
                    rstd.data[i] = s;
                }
            },)
        },
    );
}

/// dinp: (N, C) +=  dweight: (C) +=  dbias: (C) +=  dout: (N, C)  inp: (N, C)
/// weight: (C)  mean, rstd: (N) from the forward pass.
/// Two passes: rows in parallel for `dinp`, then column ranges in parallel for the
/// parameter gradients (each column adds its rows in order: no dependence on threads).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
    cpu: &Cpu,
    dinp: &mut [f32],
    dweight: &mut [f32],
    dbias: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    assert_eq!(dinp.len(), n * c);
    assert_eq!(dout.len(), n * c);
    assert_eq!(inp.len(), n * c);
    assert_eq!((mean.len(), rstd.len()), (n, n));
    assert_eq!((weight.len(), dweight.len(), dbias.len()), (c, c, c));
    let threads = cpu.threads_for(n * c);
    par_rows(threads, n, 1, RowsMut::new(dinp, c), |rows, dinp| {
        on_isa!(cpu.isa, {
            for (i, row) in rows.enumerate() {
                let x = &inp[row * c..][..c];
                let d = &dout[row * c..][..c];
                let (m, s) = (mean[row], rstd[row]);
                // mean(w * d) and mean(w * d * norm), with norm = (x - m) * s.
                let mut acc_d = [0.0f32; simd::LANES];
                let mut acc_dn = [0.0f32; simd::LANES];
                let body = c - c % simd::LANES;
                for j0 in (0..body).step_by(simd::LANES) {
                    for l in 0..simd::LANES {
                        let j = j0 + l;
                        let dnorm = weight[j] * d[j];
                        acc_d[l] += dnorm;
                        acc_dn[l] += dnorm * (x[j] - m) * s;
                    }
                }
                let (mut sum_d, mut sum_dn) = (simd::sum(&acc_d), simd::sum(&acc_dn));
                for j in body..c {
                    let dnorm = weight[j] * d[j];
                    sum_d += dnorm;
                    sum_dn += dnorm * (x[j] - m) * s;
                }
                let (mean_d, mean_dn) = (sum_d / c as f32, sum_dn / c as f32);
                let di = &mut dinp.data[i * c..][..c];
                for j in 0..c {
                    let norm = (x[j] - m) * s;
                    di[j] += (weight[j] * d[j] - mean_d - norm * mean_dn) * s;
                }
            }
        },)
    });
    let parts = (RowsMut::new(dweight, 1), RowsMut::new(dbias, 1));
    par_rows(threads, c, simd::LANES, parts, |cols, (dw, db)| {
        on_isa!(cpu.isa, {
            for row in 0..n {
                let x = &inp[row * c..][cols.clone()];
                let d = &dout[row * c..][cols.clone()];
                let (m, s) = (mean[row], rstd[row]);
                for j in 0..cols.len() {
                    db.data[j] += d[j];
                    dw.data[j] += (x[j] - m) * s * d[j];
                }
            }
        },)
    });
}
