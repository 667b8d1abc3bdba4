//! The optimiser that made the few-bit tables ([`super::GELU_TABLES`],
//! [`super::SILU_TABLES`]): the piecewise-constant approximation of an activation's
//! derivative with `2^bits` intervals that has the least mean squared error when the
//! activation's input is standard normal, N(0, 1).
//!
//! It is one-dimensional optimal quantisation, solved exactly on a grid, as Novikov et
//! al. solve it ("Few-Bit Backward", a dynamic programme over a fine grid):
//!
//! - the candidate breakpoints are the edges of [`CELLS`] cells of width 1/128 over
//!   [-[`LIMIT`], [`LIMIT`]] (multiples of 1/128, so exact in f32); the mass of N(0, 1)
//!   outside it, 2e-9, is left out;
//! - each cell's weight is the normal density integrated over it, and its first and
//!   second moments of the derivative likewise, by the midpoint rule on [`SAMPLES`]
//!   points per cell, in f64;
//! - given the breakpoints, the best level of an interval is the weighted mean of the
//!   derivative over it, and its error is the weighted variance there; so the best
//!   breakpoints are those of the least total variance over contiguous runs of cells,
//!   which the dynamic programme finds exactly: `E[k][j] = min_i E[k-1][i] + cost(i, j)`
//!   over the first `j` cells cut into `k` runs. One programme for 16 runs answers 2, 4
//!   and 8 on the way.
//!
//! The error reported is the root mean square of `f'(x) - level(x)` under N(0, 1).
//! Nothing here runs in training: the tables are constants; a test runs this again and
//! finds them.

use crate::kernel::gelu::GELU_SCALE;

/// Half the width of the grid: candidate breakpoints lie in [-LIMIT, LIMIT].
pub const LIMIT: f64 = 6.0;
/// Cells per unit of x.
pub const CELLS_PER_UNIT: usize = 128;
/// Cells of the grid.
pub const CELLS: usize = 2 * 6 * CELLS_PER_UNIT;
/// Midpoint-rule samples per cell.
pub const SAMPLES: usize = 8;
/// The most intervals a table has (4 bits).
const RUNS_MAX: usize = 16;

/// One fitted table, in f64, as the optimiser found it.
#[derive(Debug, Clone, PartialEq)]
pub struct Fitted {
    /// The `2^bits - 1` breakpoints, increasing.
    pub breakpoints: Vec<f64>,
    /// The `2^bits` levels, one per interval.
    pub levels: Vec<f64>,
    /// Root mean square error of the approximation under N(0, 1).
    pub rms_error: f64,
}

/// Per-cell sums (weight, weight f', weight f'^2) as prefix sums: entry `j` covers the
/// first `j` cells.
struct Moments {
    w: Vec<f64>,
    wf: Vec<f64>,
    wff: Vec<f64>,
}

impl Moments {
    fn of(derivative: fn(f64) -> f64) -> Self {
        let mut m = Moments {
            w: vec![0.0],
            wf: vec![0.0],
            wff: vec![0.0],
        };
        let h = 1.0 / CELLS_PER_UNIT as f64;
        for cell in 0..CELLS {
            let (mut w, mut wf, mut wff) = (0.0, 0.0, 0.0);
            for s in 0..SAMPLES {
                let x = -LIMIT + h * (cell as f64 + (s as f64 + 0.5) / SAMPLES as f64);
                let (d, f) = (normal_density(x) * h / SAMPLES as f64, derivative(x));
                (w, wf, wff) = (w + d, wf + d * f, wff + d * f * f);
            }
            m.w.push(m.w[cell] + w);
            m.wf.push(m.wf[cell] + wf);
            m.wff.push(m.wff[cell] + wff);
        }
        m
    }

    /// Weight and weighted mean of f' over cells `i..j`.
    fn mean(&self, i: usize, j: usize) -> (f64, f64) {
        let w = self.w[j] - self.w[i];
        (w, (self.wf[j] - self.wf[i]) / w)
    }

    /// The weighted squared error of the best level over cells `i..j`.
    fn cost(&self, i: usize, j: usize) -> f64 {
        let (w, mean) = self.mean(i, j);
        (self.wff[j] - self.wff[i]) - mean * mean * w
    }
}

/// The standard normal density.
pub fn normal_density(x: f64) -> f64 {
    (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

/// The optimal tables of `derivative` for 1, 2, 3 and 4 bits, in that order.
pub fn fit(derivative: fn(f64) -> f64) -> [Fitted; 4] {
    let m = Moments::of(derivative);
    let cuts = best_cuts(&m);
    [1, 2, 3, 4].map(|bits| table_of(&m, &cuts, 1 << bits))
}

/// `cut[k][j]`: where the last of the best `k + 1` runs over the first `j` cells starts.
fn best_cuts(m: &Moments) -> Vec<Vec<usize>> {
    let one_run = |j| if j == 0 { f64::INFINITY } else { m.cost(0, j) };
    let mut error: Vec<f64> = (0..=CELLS).map(one_run).collect();
    let mut cuts = vec![vec![0; CELLS + 1]];
    for k in 1..RUNS_MAX {
        let mut next = vec![f64::INFINITY; CELLS + 1];
        let mut cut = vec![0; CELLS + 1];
        for j in k + 1..=CELLS {
            for (i, &before) in error.iter().enumerate().take(j).skip(k) {
                let e = before + m.cost(i, j);
                if e < next[j] {
                    (next[j], cut[j]) = (e, i);
                }
            }
        }
        (error, cuts) = (next, [cuts, vec![cut]].concat());
    }
    cuts
}

/// The best `runs` runs over all cells, as a table.
fn table_of(m: &Moments, cuts: &[Vec<usize>], runs: usize) -> Fitted {
    let mut edges = vec![CELLS];
    for k in (1..runs).rev() {
        edges.push(cuts[k][*edges.last().unwrap()]);
    }
    edges.push(0);
    edges.reverse();
    let h = 1.0 / CELLS_PER_UNIT as f64;
    let breakpoints = edges[1..runs]
        .iter()
        .map(|&e| -LIMIT + h * e as f64)
        .collect();
    let pairs: Vec<(usize, usize)> = edges.windows(2).map(|w| (w[0], w[1])).collect();
    let levels = pairs.iter().map(|&(i, j)| m.mean(i, j).1).collect();
    let squared: f64 = pairs.iter().map(|&(i, j)| m.cost(i, j)).sum();
    Fitted {
        breakpoints,
        levels,
        rms_error: (squared / m.w[CELLS]).max(0.0).sqrt(),
    }
}

/// GPT-2's tanh-approximated GELU's derivative, in f64.
pub fn gelu_derivative(x: f64) -> f64 {
    let (s, a) = (GELU_SCALE, 0.044715);
    let t = (s * (x + a * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * s * (1.0 + 3.0 * a * x * x)
}

/// SiLU's derivative, `s (1 + x (1 - s))` with `s = sigmoid(x)`, in f64.
pub fn silu_derivative(x: f64) -> f64 {
    let s = 1.0 / (1.0 + (-x).exp());
    s * (1.0 + x * (1.0 - s))
}
