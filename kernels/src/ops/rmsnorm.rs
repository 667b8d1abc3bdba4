//! RMSNorm (Llama, Qwen, Mistral; eps the model's), forward and backward. The same
//! kernels normalise Qwen3's per-head q and k: rows of a (B, T, H, D) tensor are its
//! B × T × H heads of D channels.

use super::simd::on_isa;
use super::{Cpu, RowsMut, par_rows, simd};

/// out: (N, C)  rstd: (N)  inp: (N, C)  weight: (C).
/// `out = inp * rstd * weight`, `rstd = 1 / sqrt(mean(inp^2) + eps)` per row.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_forward(
    cpu: &Cpu,
    out: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    eps: f32,
    n: usize,
    c: usize,
) {
    assert_eq!((out.len(), inp.len()), (n * c, n * c));
    assert_eq!((rstd.len(), weight.len()), (n, c));
    let parts = (RowsMut::new(out, c), RowsMut::new(rstd, 1));
    par_rows(cpu.threads_for(n * c), n, 1, parts, |rows, (out, rstd)| {
        on_isa!(cpu.isa, {
            for (i, row) in rows.enumerate() {
                let x = &inp[row * c..][..c];
                let s = 1.0 / (simd::dot(x, x) / c as f32 + eps).sqrt();
                let o = &mut out.data[i * c..][..c];
                for j in 0..c {
                    o[j] = x[j] * s * weight[j];
                }
                rstd.data[i] = s;
            }
        },)
    });
}

/// dinp: (N, C) +=  dweight: (C) +=  dout: (N, C)  inp: (N, C)  weight: (C)
/// rstd: (N) from the forward pass.
/// Two passes, as LayerNorm's: rows in parallel for `dinp`, then column ranges in
/// parallel for `dweight` (each column adds its rows in order).
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward(
    cpu: &Cpu,
    dinp: &mut [f32],
    dweight: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    assert_eq!((dinp.len(), dout.len(), inp.len()), (n * c, n * c, n * c));
    assert_eq!((rstd.len(), weight.len(), dweight.len()), (n, c, c));
    let threads = cpu.threads_for(n * c);
    par_rows(threads, n, 1, RowsMut::new(dinp, c), |rows, dinp| {
        on_isa!(cpu.isa, {
            for (i, row) in rows.enumerate() {
                let x = &inp[row * c..][..c];
                let d = &dout[row * c..][..c];
                let s = rstd[row];
                // mean(weight * dout * norm), with norm = x * s.
                // Over LANES independent accumulators, which the compiler vectorises.
                let mut acc = [0.0f32; simd::LANES];
                let body = c - c % simd::LANES;
                for j0 in (0..body).step_by(simd::LANES) {
                    for (l, a) in acc.iter_mut().enumerate() {
                        let j = j0 + l;
                        *a += weight[j] * d[j] * x[j];
                    }
                }
                let mut sum = simd::sum(&acc);
                for j in body..c {
                    sum += weight[j] * d[j] * x[j];
                }
                let mean_gn = sum * s / c as f32;
                let di = &mut dinp.data[i * c..][..c];
                for j in 0..c {
                    di[j] += (weight[j] * d[j] - x[j] * s * mean_gn) * s;
                }
            }
        },)
    });
    par_rows(
        threads,
        c,
        simd::LANES,
        RowsMut::new(dweight, 1),
        |cols, dw| {
            on_isa!(cpu.isa, {
                for row in 0..n {
                    let x = &inp[row * c..][cols.clone()];
                    let d = &dout[row * c..][cols.clone()];
                    let s = rstd[row];
                    for j in 0..cols.len() {
                        dw.data[j] += x[j] * s * d[j];
                    }
                }
            },)
        },
    );
}
