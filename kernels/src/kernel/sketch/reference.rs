//! The scalar reference of randomized weight gradients (`super`): the
//! exact weight gradient `xᵀ dy` and its estimate `(Sᵀ x)ᵀ (Sᵀ dy)`, in f64, element by
//! element, with `S` made from the production [`sketch_sign`], both (cols_in ×
//! cols_out); [`laid_out`] stores one as a kernel's [`WeightLayout`] asks.

use super::cpu::sketch_sign;
use crate::ops::WeightLayout;

/// `xᵀ dy` (cols_in × cols_out) for `x` (rows × cols_in) and `dy` (rows × cols_out).
pub fn exact_weight_grad(
    x: &[f32],
    dy: &[f32],
    (rows, cols_in, cols_out): (usize, usize, usize),
) -> Vec<f64> {
    let mut dw = vec![0.0; cols_in * cols_out];
    for r in 0..rows {
        for i in 0..cols_in {
            for o in 0..cols_out {
                dw[i * cols_out + o] += x[r * cols_in + i] as f64 * dy[r * cols_out + o] as f64;
            }
        }
    }
    dw
}

/// `(Sᵀ x)ᵀ (Sᵀ dy)` with `S` (rows × k) the sketch of `seed`: entries
/// `sketch_sign(seed, row, column) / √k`.
pub fn estimate_weight_grad(
    x: &[f32],
    dy: &[f32],
    (rows, cols_in, cols_out, k): (usize, usize, usize, usize),
    seed: u64,
) -> Vec<f64> {
    let s = |r: usize, j: usize| sketch_sign(seed, r, j) as f64 / (k as f64).sqrt();
    let project = |m: &[f32], cols: usize| -> Vec<f64> {
        let mut out = vec![0.0; k * cols];
        for j in 0..k {
            for r in 0..rows {
                for c in 0..cols {
                    out[j * cols + c] += s(r, j) * m[r * cols + c] as f64;
                }
            }
        }
        out
    };
    let (xp, p) = (project(x, cols_in), project(dy, cols_out));
    let mut dw = vec![0.0; cols_in * cols_out];
    for j in 0..k {
        for i in 0..cols_in {
            for o in 0..cols_out {
                dw[i * cols_out + o] += xp[j * cols_in + i] * p[j * cols_out + o];
            }
        }
    }
    dw
}

/// `dw` (cols_in × cols_out, row-major) stored as `layout` asks: as it is for
/// [`WeightLayout::InOut`], transposed (cols_out × cols_in) for [`WeightLayout::OutIn`].
pub fn laid_out(dw: &[f64], (cols_in, cols_out): (usize, usize), layout: WeightLayout) -> Vec<f64> {
    assert_eq!(
        dw.len(),
        cols_in * cols_out,
        "a {cols_in} × {cols_out} gradient"
    );
    match layout {
        WeightLayout::InOut => dw.to_vec(),
        WeightLayout::OutIn => {
            let mut out = vec![0.0; dw.len()];
            for i in 0..cols_in {
                for o in 0..cols_out {
                    out[o * cols_in + i] = dw[i * cols_out + o];
                }
            }
            out
        }
    }
}
