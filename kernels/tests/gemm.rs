//! strata's matrix product (`ops::gemm`) against the scalar reference run in f64 on the
//! same f32 inputs: every (m, n, k) up to 33, the GPT-2 shapes and odd ones across the
//! cache blocks, both layouts of each operand, overwrite and accumulate, scales other
//! than 1, rows of dst further apart than n, one and several threads, and every
//! instruction set this CPU has (each forced in turn, the portable one always).
//!
//! The tolerance is the error bound of a dot product summed in f32 in any order:
//! |got - want| <= (k + 2) · eps · (|scale| · Σ_p |a_ip| |b_pj| + |dst_ij|), the last
//! term only when accumulating. A wrong, missing or repeated term of the sum is far
//! above it (a term is about Σ/k, the bound about k · eps · Σ).

// The shared helpers; this file needs only some of them.
#[allow(dead_code)]
mod ops_support;

use std::ops::Range;

use ops_support::{random, wide};
use rand::SeedableRng;
use rand::rngs::StdRng;
use strata_kernels::isa::Isa;
use strata_kernels::ops::{Cpu, MatrixMut, MatrixRef, gemm};
use strata_kernels::reference::gemm::{self as reference, View};

/// A value no product writes: it marks the elements between dst's rows.
const PADDING: f32 = 1234.5;

/// One product to check.
#[derive(Debug, Clone, Copy)]
struct Case {
    m: usize,
    n: usize,
    k: usize,
    /// lhs stored as (k, m) row-major and read transposed.
    lhs_transposed: bool,
    /// rhs stored as (n, k) row-major and read transposed.
    rhs_transposed: bool,
    accumulate: bool,
    scale: f32,
    /// Elements between the end of a row of dst and the start of the next.
    dst_padding: usize,
}

impl Case {
    /// The case of shape (m, n, k) whose layout, mode, scale and padding are picked by
    /// `variant` (so that a sweep over shapes also sweeps them).
    fn of((m, n, k): (usize, usize, usize), variant: usize) -> Case {
        Case {
            m,
            n,
            k,
            lhs_transposed: variant % 2 == 1,
            rhs_transposed: variant / 2 % 2 == 1,
            accumulate: variant / 4 % 2 == 1,
            scale: [1.0, -0.75, 1.0, 2.5][variant / 3 % 4],
            dst_padding: variant % 3,
        }
    }

    fn dst_row_stride(&self) -> usize {
        self.n + self.dst_padding
    }
}

/// (row, column) strides of a `rows × cols` operand stored row-major, or stored as its
/// transpose and read transposed.
fn strides(rows: usize, cols: usize, transposed: bool) -> (usize, usize) {
    if transposed { (1, rows) } else { (cols, 1) }
}

/// A case's inputs, and dst as it is before the product.
struct Inputs {
    case: Case,
    lhs: Vec<f32>,
    rhs: Vec<f32>,
    /// Random where the product accumulates, NaN where it overwrites (so that reading
    /// it would show), [`PADDING`] between rows.
    dst: Vec<f32>,
}

impl Inputs {
    fn new(case: Case, rng: &mut StdRng) -> Inputs {
        let ld = case.dst_row_stride();
        let mut dst = random(rng, case.m * ld, 1.0);
        for (i, x) in dst.iter_mut().enumerate() {
            if i % ld >= case.n {
                *x = PADDING;
            } else if !case.accumulate {
                *x = f32::NAN;
            }
        }
        Inputs {
            case,
            lhs: random(rng, case.m * case.k, 1.0),
            rhs: random(rng, case.k * case.n, 1.0),
            dst,
        }
    }

    fn lhs_strides(&self) -> (usize, usize) {
        strides(self.case.m, self.case.k, self.case.lhs_transposed)
    }

    fn rhs_strides(&self) -> (usize, usize) {
        strides(self.case.k, self.case.n, self.case.rhs_transposed)
    }

    /// dst after the product, by `ops::gemm` on `cpu`.
    fn run(&self, cpu: &Cpu) -> Vec<f32> {
        let c = self.case;
        let mut dst = self.dst.clone();
        let (lrs, lcs) = self.lhs_strides();
        let (rrs, rcs) = self.rhs_strides();
        gemm(
            cpu,
            MatrixMut::new(&mut dst, c.m, c.n, c.dst_row_stride()),
            MatrixRef::new(&self.lhs, c.m, c.k, lrs, lcs),
            MatrixRef::new(&self.rhs, c.k, c.n, rrs, rcs),
            c.scale,
            c.accumulate,
        );
        dst
    }

    /// The reference's rows `rows` of dst (row-major, n wide), and each element's
    /// tolerance.
    fn expected(&self, rows: Range<usize>) -> (Vec<f64>, Vec<f64>) {
        let c = self.case;
        let (ld, m) = (c.dst_row_stride(), rows.len());
        let (lrs, lcs) = self.lhs_strides();
        let (rrs, rcs) = self.rhs_strides();
        let lhs = wide(&self.lhs);
        let rhs = wide(&self.rhs);
        let start = rows.start * ld;
        let before: Vec<f64> = (0..m * c.n)
            .map(|e| self.dst[start + e / c.n * ld + e % c.n] as f64)
            .collect();
        let mut want = before.clone();
        let view = |data, rs, cs| View {
            data,
            row_stride: rs,
            col_stride: cs,
        };
        let lhs_rows = &lhs[rows.start * lrs..];
        reference::gemm(
            &mut want,
            c.n,
            view(lhs_rows, lrs, lcs),
            view(&rhs, rrs, rcs),
            (m, c.n, c.k),
            c.scale as f64,
            c.accumulate,
        );
        let (lhs_abs, rhs_abs): (Vec<f64>, Vec<f64>) = (
            lhs.iter().map(|x| x.abs()).collect(),
            rhs.iter().map(|x| x.abs()).collect(),
        );
        let mut magnitude = vec![0.0; m * c.n];
        reference::gemm(
            &mut magnitude,
            c.n,
            view(&lhs_abs[rows.start * lrs..], lrs, lcs),
            view(&rhs_abs, rrs, rcs),
            (m, c.n, c.k),
            c.scale.abs() as f64,
            false,
        );
        let eps = f32::EPSILON as f64;
        let tolerance = magnitude
            .iter()
            .zip(&before)
            .map(|(&sum, &old)| {
                let old = if c.accumulate { old.abs() } else { 0.0 };
                (c.k + 2) as f64 * eps * (sum + old) + f64::from(f32::MIN_POSITIVE)
            })
            .collect();
        (want, tolerance)
    }
}

/// The reference's rows of dst, with their tolerances.
struct Expected {
    rows: Range<usize>,
    want: Vec<f64>,
    tolerance: Vec<f64>,
}

impl Inputs {
    fn expect(&self, rows: Range<usize>) -> Expected {
        let (want, tolerance) = self.expected(rows.clone());
        Expected {
            rows,
            want,
            tolerance,
        }
    }
}

/// Asserts that the rows of `got` that `expected` holds match it and that no element
/// between rows of dst was written.
#[track_caller]
fn check(what: &str, inputs: &Inputs, got: &[f32], expected: &Expected) {
    let c = inputs.case;
    let ld = c.dst_row_stride();
    let rows = &expected.rows;
    for (e, (&w, &tol)) in expected.want.iter().zip(&expected.tolerance).enumerate() {
        let (i, j) = (rows.start + e / c.n, e % c.n);
        let g = got[i * ld + j] as f64;
        assert!(
            (g - w).abs() <= tol,
            "{what} {c:?}: dst[{i}, {j}] is {g} but the reference says {w} (tolerance {tol:e})"
        );
    }
    for (e, &x) in got.iter().enumerate() {
        if e % ld >= c.n {
            assert_eq!(x, PADDING, "{what} {c:?}: wrote between rows, element {e}");
        }
    }
}

/// One thread on every instruction set this CPU has.
fn single_threaded() -> Vec<Cpu> {
    Isa::supported().into_iter().map(Cpu::single).collect()
}

#[test]
fn every_shape_up_to_33_matches_reference() {
    let mut rng = StdRng::seed_from_u64(11);
    let cpus = single_threaded();
    let mut variant = 0;
    for m in 1..=33 {
        for n in 1..=33 {
            for k in 1..=33 {
                variant += 1;
                let inputs = Inputs::new(Case::of((m, n, k), variant), &mut rng);
                let expected = inputs.expect(0..m);
                for cpu in &cpus {
                    let got = inputs.run(cpu);
                    check(cpu.isa.name(), &inputs, &got, &expected);
                }
            }
        }
    }
}

#[test]
fn model_and_odd_shapes_match_reference() {
    let mut rng = StdRng::seed_from_u64(12);
    // GPT-2's fused QKV weight gradient; odd sizes everywhere; m split across threads
    // rather than n; one row past a block of rows (144), one column past a block of
    // columns (1024), one step past a block of k (256).
    let shapes = [
        (768, 2304, 768),
        (513, 97, 1031),
        (1031, 33, 513),
        (145, 1025, 257),
    ];
    for (s, &shape) in shapes.iter().enumerate() {
        // Each layout of the two operands, with the mode, scale and padding varying.
        for layout in 0..4 {
            let inputs = Inputs::new(Case::of(shape, layout + 4 * (s + layout)), &mut rng);
            let m = shape.0;
            // The reference is slow at these sizes: check whole rows at the start, at
            // the middle, across the first boundary of row blocks, and at the end.
            let mut row_ranges = vec![0..8, m / 2 - 3..m / 2 + 3, m - 8..m];
            if m > 150 {
                row_ranges.push(140..150);
            }
            let expected: Vec<Expected> =
                row_ranges.into_iter().map(|r| inputs.expect(r)).collect();
            // One and two threads in turn, so each instruction set runs both on each
            // shape (the result does not depend on the thread count: tested below).
            for (i, isa) in Isa::supported().into_iter().enumerate() {
                let threads = 1 + (layout + i) % 2;
                let got = inputs.run(&Cpu { isa, threads });
                for rows in &expected {
                    check(&format!("{isa} {threads}t"), &inputs, &got, rows);
                }
            }
        }
    }
}

#[test]
fn result_does_not_depend_on_thread_count() {
    let mut rng = StdRng::seed_from_u64(13);
    // Split along n, and along m (more row tiles than column tiles).
    for (variant, shape) in [(300, 1500, 300), (1031, 33, 513)].into_iter().enumerate() {
        let inputs = Inputs::new(Case::of(shape, variant + 5), &mut rng);
        for isa in Isa::supported() {
            let one = inputs.run(&Cpu::single(isa));
            for threads in [2, 3] {
                let got = inputs.run(&Cpu { isa, threads });
                let same = one
                    .iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{isa}: {threads} threads differ from one for {shape:?}"
                );
            }
        }
    }
}

#[test]
fn empty_products_and_k_zero() {
    for isa in Isa::supported() {
        let cpu = Cpu::single(isa);
        // k = 0: the product is zero, so dst becomes 0 or stays as it was.
        for accumulate in [false, true] {
            let mut dst = vec![3.0f32; 6];
            gemm(
                &cpu,
                MatrixMut::row_major(&mut dst, 2, 3),
                MatrixRef::row_major(&[], 2, 0),
                MatrixRef::row_major(&[], 0, 3),
                2.0,
                accumulate,
            );
            let want = if accumulate { 3.0 } else { 0.0 };
            assert!(dst.iter().all(|&x| x == want), "{isa} k = 0: {dst:?}");
        }
        // m = 0 or n = 0: nothing to write.
        let mut dst: Vec<f32> = vec![];
        gemm(
            &cpu,
            MatrixMut::row_major(&mut dst, 0, 3),
            MatrixRef::row_major(&[], 0, 4),
            MatrixRef::row_major(&[1.0; 12], 4, 3),
            1.0,
            false,
        );
        gemm(
            &cpu,
            MatrixMut::row_major(&mut dst, 2, 0),
            MatrixRef::row_major(&[1.0; 8], 2, 4),
            MatrixRef::row_major(&[], 4, 0),
            1.0,
            false,
        );
    }
}

#[test]
#[should_panic(expected = "does not fit")]
fn a_view_past_its_slice_is_refused() {
    let data = [0.0f32; 11];
    // Element (2, 3) of a 3 × 4 row-major view is data[11].
    MatrixRef::row_major(&data, 3, 4);
}

#[test]
#[should_panic(expected = "overlap")]
fn overlapping_dst_rows_are_refused() {
    let mut data = [0.0f32; 12];
    MatrixMut::new(&mut data, 3, 4, 3);
}
