//! Randomized weight gradients for linear layers (Bershatsky et al., in the lecture
//! notes' "Approximate matrix multiplication: Randomized Backward"): the forward keeps
//! `X_proj = Sᵀ X` (k × in) in place of a layer's input `X` (rows × in), and the
//! backward estimates `dW = Xᵀ dY` as `X_projᵀ (Sᵀ dY)`, an unbiased estimate because
//! `E[S Sᵀ] = I`. The memory kept for the weight gradient shrinks by `k / rows`, the
//! projection ratio.
//!
//! `S` (rows × k) is never stored: each entry is `±1/√k`, its sign one bit of a
//! counter-based hash of (seed, row, column) ([`sketch_sign`]), so the backward
//! regenerates the forward's `S` from the seed alone. Rademacher entries make the
//! diagonal of `S Sᵀ` exactly 1, so only the cross terms between different rows add
//! variance: `E‖Ŵ − dW‖²_F = (1/k) Σ_{a≠b} (‖x_a‖² ‖dy_b‖² + ⟨x_a, x_b⟩⟨dy_a, dy_b⟩)`
//! ([`expected_squared_error`]).
//!
//! The CPU side, over the worker pool's matrix product ([`crate::ops::gemm()`]); the
//! program kernels that run it, and their CUDA launches, are in the family's `mod.rs`.

use crate::ops::{Cpu, MatrixMut, MatrixRef, WeightLayout, gemm};

/// One bit of a counter-based hash of `(seed, row, col)` as a sign, `+1.0` or `-1.0`:
/// the same for the same arguments on every machine and thread. The hash is SplitMix64's
/// finaliser over the seed mixed with the position (row in the high 32 bits).
pub fn sketch_sign(seed: u64, row: usize, col: usize) -> f32 {
    let position = ((row as u64) << 32) | (col as u64 & 0xffff_ffff);
    let mut z = seed
        .wrapping_add(0x9e37_79b9_7f4a_7c15)
        .wrapping_mul(position.wrapping_add(1) | 1)
        ^ position;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    if z >> 63 == 1 { -1.0 } else { 1.0 }
}

/// The seed a sketch kernel hands [`sketch_sign`]: its own seed `salt` (one per layer and
/// weight) mixed with `step`, the program's per-step and per-micro-batch
/// [`Scalars::sketch`](crate::program::Scalars::sketch), so each step draws a new `S` and a
/// micro-batch's forward and backward the same one. `sketch_seed(0, salt) == salt`.
pub fn sketch_seed(step: u64, salt: u64) -> u64 {
    // An odd constant (MurmurHash3's first finaliser multiplier), none of sketch_sign's.
    salt.wrapping_add(step.wrapping_mul(0xff51_afd7_ed55_8ccd))
}

/// `s` (rows × k, row-major) filled with the sketch of `seed`: `sketch_sign / √k`.
pub fn fill_sketch(s: &mut [f32], rows: usize, k: usize, seed: u64) {
    assert_eq!(s.len(), rows * k, "a {rows} × {k} sketch");
    let scale = 1.0 / (k as f32).sqrt();
    for (r, row) in s.chunks_exact_mut(k.max(1)).enumerate() {
        for (c, v) in row.iter_mut().enumerate() {
            *v = sketch_sign(seed, r, c) * scale;
        }
    }
}

/// The forward's projection: `out` (k × cols) = `Sᵀ x`, `x` (rows × cols), with `S` the
/// sketch of `seed`, made in `scratch` (rows × k).
pub fn project(
    cpu: &Cpu,
    out: &mut [f32],
    x: &[f32],
    (rows, cols, k): (usize, usize, usize),
    seed: u64,
    scratch: &mut [f32],
) {
    if rows == 0 {
        out.fill(0.0); // a sum of no terms
        return;
    }
    fill_sketch(scratch, rows, k, seed);
    let s = MatrixRef::row_major(scratch, rows, k).transposed();
    let x = MatrixRef::row_major(x, rows, cols);
    gemm(cpu, MatrixMut::row_major(out, k, cols), s, x, 1.0, false);
}

/// The backward's weight gradient from the projection: `dw` = (or, with `accumulate`,
/// +=) `x_projᵀ (Sᵀ dy)`, stored (cols_in × cols_out) for [`WeightLayout::InOut`] and
/// transposed, (cols_out × cols_in), for [`WeightLayout::OutIn`]; `x_proj` (k × cols_in)
/// is [`project`]'s output for the same `seed` and `dy` is (rows × cols_out). `s`
/// (rows × k) and `p` (k × cols_out) are scratch.
#[allow(clippy::too_many_arguments)]
pub fn weight_grad(
    cpu: &Cpu,
    dw: &mut [f32],
    dy: &[f32],
    x_proj: &[f32],
    (rows, cols_in, cols_out, k): (usize, usize, usize, usize),
    seed: u64,
    (s, p): (&mut [f32], &mut [f32]),
    layout: WeightLayout,
    accumulate: bool,
) {
    if rows == 0 || k == 0 {
        // A sum of no terms.
        if !accumulate {
            dw.fill(0.0);
        }
        return;
    }
    project(cpu, p, dy, (rows, cols_out, k), seed, s);
    let x_proj = MatrixRef::row_major(x_proj, k, cols_in);
    let p = MatrixRef::row_major(p, k, cols_out);
    match layout {
        // (cols_in × cols_out) = x_projᵀ P.
        WeightLayout::InOut => {
            let dw = MatrixMut::row_major(dw, cols_in, cols_out);
            gemm(cpu, dw, x_proj.transposed(), p, 1.0, accumulate);
        }
        // (cols_out × cols_in) = Pᵀ x_proj, the transpose.
        WeightLayout::OutIn => {
            let dw = MatrixMut::row_major(dw, cols_out, cols_in);
            gemm(cpu, dw, p.transposed(), x_proj, 1.0, accumulate);
        }
    }
}

/// The estimate's expected squared Frobenius error for a Rademacher sketch with `k`
/// columns, from `x` (rows × cols_in) and `dy` (rows × cols_out): see the module's notes.
pub fn expected_squared_error(
    x: &[f32],
    dy: &[f32],
    (rows, cols_in, cols_out, k): (usize, usize, usize, usize),
) -> f64 {
    let row = |m: &[f32], n: usize, a: usize| -> Vec<f64> {
        m[a * n..(a + 1) * n].iter().map(|&v| v as f64).collect()
    };
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let xs: Vec<Vec<f64>> = (0..rows).map(|a| row(x, cols_in, a)).collect();
    let ds: Vec<Vec<f64>> = (0..rows).map(|a| row(dy, cols_out, a)).collect();
    let mut total = 0.0;
    for a in 0..rows {
        for b in 0..rows {
            if a != b {
                total += dot(&xs[a], &xs[a]) * dot(&ds[b], &ds[b])
                    + dot(&xs[a], &xs[b]) * dot(&ds[a], &ds[b]);
            }
        }
    }
    total / k as f64
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{RngExt, SeedableRng};

    use super::super::reference;
    use super::*;
    use crate::isa::Isa;

    const SHAPE: (usize, usize, usize, usize) = (48, 12, 10, 16);

    fn random(n: usize, rng: &mut StdRng) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// The layer's inputs and output gradients, and the exact weight gradient `xᵀ dy`.
    fn layer() -> (Vec<f32>, Vec<f32>, Vec<f64>) {
        let (rows, cols_in, cols_out, _) = SHAPE;
        let mut rng = StdRng::seed_from_u64(5);
        let (x, dy) = (
            random(rows * cols_in, &mut rng),
            random(rows * cols_out, &mut rng),
        );
        let exact = reference::exact_weight_grad(&x, &dy, (rows, cols_in, cols_out));
        (x, dy, exact)
    }

    /// One estimate of the weight gradient through the CPU functions, as a layer's
    /// forward and backward make it (the backward regenerating `S` from `seed`), stored
    /// as `layout` asks.
    fn estimate(cpu: &Cpu, x: &[f32], dy: &[f32], seed: u64, layout: WeightLayout) -> Vec<f32> {
        let (rows, cols_in, cols_out, k) = SHAPE;
        let mut s = vec![0.0; rows * k];
        let mut x_proj = vec![0.0; k * cols_in];
        project(cpu, &mut x_proj, x, (rows, cols_in, k), seed, &mut s);
        let mut p = vec![0.0; k * cols_out];
        let mut dw = vec![0.0; cols_in * cols_out];
        weight_grad(
            cpu,
            &mut dw,
            dy,
            &x_proj,
            SHAPE,
            seed,
            (&mut s, &mut p),
            layout,
            false,
        );
        dw
    }

    fn squared_error(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum()
    }

    #[test]
    fn the_cpu_estimate_is_the_references_on_every_isa() {
        let (x, dy, _) = layer();
        let (_, cols_in, cols_out, _) = SHAPE;
        for seed in [0, 1, 77] {
            let in_out = reference::estimate_weight_grad(&x, &dy, SHAPE, seed);
            for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
                let want = reference::laid_out(&in_out, (cols_in, cols_out), layout);
                for isa in Isa::supported() {
                    for threads in [1, 3] {
                        let got = estimate(&Cpu { isa, threads }, &x, &dy, seed, layout);
                        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                            assert!(
                                (*g as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()),
                                "seed {seed}, {layout:?}, {isa} on {threads} threads, \
                                 element {i}: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Step 0 keeps a kernel's own seed; every (step, salt) of a small grid, as a run's
    /// steps and layers make them, gives another seed.
    #[test]
    fn each_step_and_salt_mix_to_their_own_seed() {
        for salt in [0, 5, u64::MAX] {
            assert_eq!(sketch_seed(0, salt), salt);
        }
        let mut seeds: Vec<u64> = (0..64u64)
            .flat_map(|step| (0..64u64).map(move |salt| sketch_seed(step, salt)))
            .collect();
        seeds.sort_unstable();
        seeds.dedup();
        assert_eq!(seeds.len(), 64 * 64);
    }

    #[test]
    fn the_sketch_is_regenerated_from_its_seed_alone() {
        let (rows, _, _, k) = SHAPE;
        let (mut a, mut b) = (vec![0.0; rows * k], vec![0.0; rows * k]);
        fill_sketch(&mut a, rows, k, 9);
        fill_sketch(&mut b, rows, k, 9);
        assert_eq!(a, b);
        fill_sketch(&mut b, rows, k, 10);
        let differ = a.iter().zip(&b).filter(|(x, y)| x != y).count();
        // Independent signs: about half differ.
        assert!(
            (rows * k / 3..rows * k * 2 / 3).contains(&differ),
            "{differ}"
        );
        // Balanced signs, and E[S Sᵀ]'s diagonal exactly 1.
        let plus = a.iter().filter(|&&v| v > 0.0).count();
        assert!(
            (rows * k * 2 / 5..rows * k * 3 / 5).contains(&plus),
            "{plus}"
        );
        for r in 0..rows {
            let norm: f32 = a[r * k..(r + 1) * k].iter().map(|v| v * v).sum();
            assert!((norm - 1.0).abs() < 1e-5, "row {r}: {norm}");
        }
    }

    /// Unbiased, at the expected rate: one estimate's mean squared error over seeds is
    /// the closed form's, and the mean of n estimates' is 1/n of it, so the average over
    /// seeds converges to the exact gradient.
    #[test]
    fn the_estimate_is_unbiased_with_the_expected_variance() {
        let (x, dy, exact) = layer();
        let cpu = Cpu::default();
        let expected = expected_squared_error(&x, &dy, SHAPE);
        let seeds = 2000u64;
        let estimates: Vec<Vec<f64>> = (0..seeds)
            .map(|seed| {
                let e = estimate(&cpu, &x, &dy, 1000 + seed, WeightLayout::InOut);
                e.iter().map(|&v| v as f64).collect()
            })
            .collect();
        let single = estimates
            .iter()
            .map(|e| squared_error(e, &exact))
            .sum::<f64>()
            / seeds as f64;
        assert!(
            (single / expected - 1.0).abs() < 0.1,
            "one estimate's mean squared error {single}, expected {expected}"
        );
        for n in [10usize, 100] {
            let groups = seeds as usize / n;
            let mean_error = (0..groups)
                .map(|g| {
                    let mut mean = vec![0.0; exact.len()];
                    for e in &estimates[g * n..(g + 1) * n] {
                        for (m, v) in mean.iter_mut().zip(e) {
                            *m += v / n as f64;
                        }
                    }
                    squared_error(&mean, &exact)
                })
                .sum::<f64>()
                / groups as f64;
            let ratio = mean_error / (expected / n as f64);
            assert!(
                (0.6..1.5).contains(&ratio),
                "mean of {n}: squared error {mean_error}, expected {} ({ratio:.2}x)",
                expected / n as f64
            );
        }
        // All of them together are close to the exact gradient.
        let mut mean = vec![0.0; exact.len()];
        for e in &estimates {
            for (m, v) in mean.iter_mut().zip(e) {
                *m += v / seeds as f64;
            }
        }
        let relative =
            (squared_error(&mean, &exact) / exact.iter().map(|v| v * v).sum::<f64>()).sqrt();
        assert!(
            relative < 0.05,
            "mean of {seeds}: relative error {relative}"
        );
    }
}
