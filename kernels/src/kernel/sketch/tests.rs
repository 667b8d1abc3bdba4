//! What the emulator needs of the family's kernels, and their CUDA launch sequences
//! checked against the CPU through it, and the kernels' CPU runs against the reference
//! in both weight layouts, with the step's seed mixed in (the statistical and reference
//! tests of the math are in `cpu.rs`).

use super::*;
use crate::cuda::launch::tests::{
    Buffers, Emulated, Emulator, Layout, check_emulation, count_arg, ptr_arg, random_inputs,
    run_cpu_with, scalars,
};
use crate::kernel::Kernel;

/// `sketch.cu`'s `fill_sketch`, written again from the `.cu` text; false for another
/// entry point.
fn emulate_fill(name: &str, args: &[Arg], memory: &Emulator) -> bool {
    if name != "fill_sketch" {
        return false;
    }
    let (s, rows, k) = (
        ptr_arg(name, args, 0),
        count_arg(name, args, 1),
        count_arg(name, args, 2),
    );
    let (Arg::Long(seed), Arg::Float(scale)) = (args[3], args[4]) else {
        panic!("{name}: seed and scale are {:?}, {:?}", args[3], args[4]);
    };
    for i in 0..rows * k {
        let (row, col) = ((i / k) as u64, (i % k) as u64);
        let position = (row << 32) | (col & 0xffff_ffff);
        let mut z = (seed as u64)
            .wrapping_add(0x9e37_79b9_7f4a_7c15)
            .wrapping_mul(position.wrapping_add(1) | 1);
        z ^= position;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        memory.store(s, i, if z >> 63 == 1 { -scale } else { scale });
    }
    true
}

impl Emulated for SketchProject {
    fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
        // f32 only (see the family's notes).
        if w != Dtype::F32 {
            return Vec::new();
        }
        [(33, 7, 8), (5, 3, 16), (0, 4, 2)]
            .map(|(rows, cols, k)| SketchProject {
                out: l.tensor(k * cols, Dtype::F32),
                x: l.tensor(rows * cols, Dtype::F32),
                scratch: l.tensor(rows * k, Dtype::F32),
                rows,
                cols,
                k,
                seed: 3,
            })
            .to_vec()
    }

    fn dimensions(&self) -> Vec<(&'static str, usize)> {
        vec![
            ("rows", self.rows),
            ("k", self.k),
            // The launches' seed is the samples' scalars' step seed mixed in.
            ("seed", sketch_seed(scalars().sketch, self.seed) as usize),
        ]
    }

    fn floats(&self, _: &Scalars) -> Vec<(&'static str, f32)> {
        vec![("scale", sketch_scale(self.k))]
    }

    fn scratch_regions(&self) -> Vec<(&'static str, usize, usize)> {
        vec![("s", 0, 4 * self.rows * self.k)]
    }

    fn emulate(name: &str, args: &[Arg], memory: &Emulator) -> bool {
        emulate_fill(name, args, memory)
    }
}

impl Emulated for SketchWeightGrad {
    fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
        // f32 only (see the family's notes).
        if w != Dtype::F32 {
            return Vec::new();
        }
        let mut out = Vec::new();
        for (rows, ci, co, k, accumulate) in [
            (33, 7, 5, 8, false),
            (5, 3, 9, 16, true),
            (0, 4, 2, 2, true),
            (0, 4, 2, 2, false),
        ] {
            for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
                out.push(SketchWeightGrad {
                    dw: l.tensor(ci * co, Dtype::F32),
                    dy: l.tensor(rows * co, Dtype::F32),
                    x_proj: l.tensor(k * ci, Dtype::F32),
                    scratch: l.tensor(rows * k + k * co, Dtype::F32),
                    rows,
                    cols_in: ci,
                    cols_out: co,
                    k,
                    seed: 5,
                    layout,
                    accumulate,
                });
            }
        }
        out
    }

    fn dimensions(&self) -> Vec<(&'static str, usize)> {
        vec![
            ("rows", self.rows),
            ("k", self.k),
            // The launches' seed is the samples' scalars' step seed mixed in.
            ("seed", sketch_seed(scalars().sketch, self.seed) as usize),
        ]
    }

    fn floats(&self, _: &Scalars) -> Vec<(&'static str, f32)> {
        vec![("scale", sketch_scale(self.k))]
    }

    fn scratch_regions(&self) -> Vec<(&'static str, usize, usize)> {
        let s_bytes = 4 * self.rows * self.k;
        vec![
            ("s", 0, s_bytes),
            ("p", s_bytes, 4 * self.k * self.cols_out),
        ]
    }

    fn emulate(name: &str, args: &[Arg], memory: &Emulator) -> bool {
        emulate_fill(name, args, memory)
    }
}

#[test]
fn the_cuda_launches_compute_the_cpus_results() {
    let mut l = Layout::default();
    let mut kernels: Vec<Kernel> = SketchProject::samples(Dtype::F32, &mut l)
        .into_iter()
        .map(Kernel::SketchProject)
        .collect();
    kernels.extend(
        SketchWeightGrad::samples(Dtype::F32, &mut l)
            .into_iter()
            .map(Kernel::SketchWeightGrad),
    );
    let inputs = random_inputs(&l, &kernels, 9);
    // The products sum in another order on each side.
    check_emulation(&kernels, inputs, 1e-5);
}

const DIMS: (usize, usize, usize, usize) = (24, 6, 5, 8);

/// A layer's forward projection and backward weight gradient with seed `seed`, the
/// gradient stored as `layout` asks and accumulated.
fn layer_kernels(
    l: &mut Layout,
    seed: u64,
    layout: WeightLayout,
) -> (SketchProject, SketchWeightGrad) {
    let (rows, ci, co, k) = DIMS;
    let project_k = SketchProject {
        out: l.tensor(k * ci, Dtype::F32),
        x: l.tensor(rows * ci, Dtype::F32),
        scratch: l.tensor(rows * k, Dtype::F32),
        rows,
        cols: ci,
        k,
        seed,
    };
    let grad_k = SketchWeightGrad {
        dw: l.tensor(ci * co, Dtype::F32),
        dy: l.tensor(rows * co, Dtype::F32),
        x_proj: project_k.out,
        scratch: l.tensor(rows * k + k * co, Dtype::F32),
        rows,
        cols_in: ci,
        cols_out: co,
        k,
        seed,
        layout,
        accumulate: true,
    };
    (project_k, grad_k)
}

/// Runs the forward and then the backward kernel on the CPU with `scalars` from random
/// inputs; returns the memory before and after.
fn run_layer(kernels: [Kernel; 2], l: &Layout, scalars: &Scalars) -> (Buffers, Buffers) {
    let before = random_inputs(l, &kernels, 4);
    let mut after = before.clone();
    for kernel in &kernels {
        run_cpu_with(&mut after, kernel, scalars).unwrap();
    }
    (before, after)
}

/// The kernels, run as a program runs them on the CPU, give the reference's estimate for
/// the seed mixed from the step's and their own, in each weight layout, accumulated.
#[test]
fn the_kernels_give_the_references_estimate_for_the_mixed_seed() {
    let (_, ci, co, _) = DIMS;
    for step in [0, 1, 40] {
        let scalars = Scalars {
            sketch: step,
            ..Scalars::default()
        };
        for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
            let mut l = Layout::default();
            let (project_k, grad_k) = layer_kernels(&mut l, 11, layout);
            let kernels = [
                Kernel::SketchProject(project_k),
                Kernel::SketchWeightGrad(grad_k),
            ];
            let (before, after) = run_layer(kernels, &l, &scalars);
            let (x, dy, dw0) = (
                before.read_f32(&project_k.x),
                before.read_f32(&grad_k.dy),
                before.read_f32(&grad_k.dw),
            );
            let seed = sketch_seed(step, 11);
            let in_out = reference::estimate_weight_grad(&x, &dy, DIMS, seed);
            let want = reference::laid_out(&in_out, (ci, co), layout);
            let got = after.read_f32(&grad_k.dw);
            for (i, ((g, w), d0)) in got.iter().zip(&want).zip(&dw0).enumerate() {
                let w = w + *d0 as f64;
                assert!(
                    (*g as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()),
                    "step {step}, {layout:?}, element {i}: {g} vs {w}"
                );
            }
        }
    }
}

/// With the step's seed 0 a kernel projects with its own seed, as before the step's
/// seed existed; with step 1 it draws another sketch.
#[test]
fn the_steps_seed_changes_the_projection_and_zero_keeps_the_kernels() {
    let (rows, ci, _, k) = DIMS;
    let project_with = |step: u64| {
        let mut l = Layout::default();
        let (project_k, grad_k) = layer_kernels(&mut l, 11, WeightLayout::InOut);
        let kernels = [
            Kernel::SketchProject(project_k),
            Kernel::SketchWeightGrad(grad_k),
        ];
        let scalars = Scalars {
            sketch: step,
            ..Scalars::default()
        };
        let (before, after) = run_layer(kernels, &l, &scalars);
        (
            before.read_f32(&project_k.x),
            after.read_f32(&project_k.out),
        )
    };
    let (x, at_zero) = project_with(0);
    let mut own = vec![0.0; k * ci];
    let mut s = vec![0.0; rows * k];
    project(&Cpu::default(), &mut own, &x, (rows, ci, k), 11, &mut s);
    for (i, (a, b)) in at_zero.iter().zip(&own).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
            "element {i}: {a} vs {b}"
        );
    }
    let (x1, at_one) = project_with(1);
    assert_eq!(x, x1, "the same inputs");
    let differ = at_zero
        .iter()
        .zip(&at_one)
        .filter(|(a, b)| (*a - *b).abs() > 1e-3)
        .count();
    assert!(
        differ > at_zero.len() / 2,
        "{differ} of {} differ",
        at_zero.len()
    );
}
