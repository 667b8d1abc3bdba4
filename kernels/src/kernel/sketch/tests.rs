//! What the emulator needs of the family's kernels, and their CUDA launch sequences
//! checked against the CPU through it (the statistical and reference tests of the math
//! are in `cpu.rs`).

use super::*;
use crate::cuda::launch::tests::{
    Emulated, Emulator, Layout, check_emulation, count_arg, ptr_arg, random_inputs, run_cpu_on,
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
            ("seed", self.seed as usize),
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
        [
            (33, 7, 5, 8, false),
            (5, 3, 9, 16, true),
            (0, 4, 2, 2, true),
        ]
        .map(|(rows, ci, co, k, accumulate)| SketchWeightGrad {
            dw: l.tensor(ci * co, Dtype::F32),
            dy: l.tensor(rows * co, Dtype::F32),
            x_proj: l.tensor(k * ci, Dtype::F32),
            scratch: l.tensor(rows * k + k * co, Dtype::F32),
            rows,
            cols_in: ci,
            cols_out: co,
            k,
            seed: 5,
            accumulate,
        })
        .to_vec()
    }

    fn dimensions(&self) -> Vec<(&'static str, usize)> {
        vec![
            ("rows", self.rows),
            ("k", self.k),
            ("seed", self.seed as usize),
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

/// The kernels, run as a program runs them on the CPU, give the functions' results: the
/// projection, and from it the weight gradient, accumulated where asked.
#[test]
fn the_kernels_run_the_cpu_functions() {
    let mut l = Layout::default();
    let (rows, ci, co, k) = (24, 6, 5, 8);
    let project_k = SketchProject {
        out: l.tensor(k * ci, Dtype::F32),
        x: l.tensor(rows * ci, Dtype::F32),
        scratch: l.tensor(rows * k, Dtype::F32),
        rows,
        cols: ci,
        k,
        seed: 11,
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
        seed: 11,
        accumulate: true,
    };
    let kernels = [
        Kernel::SketchProject(project_k),
        Kernel::SketchWeightGrad(grad_k),
    ];
    let mut memory = random_inputs(&l, &kernels, 4);
    let (x, dy, dw0) = (
        memory.read_f32(&project_k.x),
        memory.read_f32(&grad_k.dy),
        memory.read_f32(&grad_k.dw),
    );
    for kernel in &kernels {
        run_cpu_on(&mut memory, kernel).unwrap();
    }
    let want = reference::estimate_weight_grad(&x, &dy, (rows, ci, co, k), 11);
    let got = memory.read_f32(&grad_k.dw);
    for (i, ((g, w), d0)) in got.iter().zip(&want).zip(&dw0).enumerate() {
        let w = w + *d0 as f64;
        assert!(
            (*g as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "element {i}: {g} vs {w}"
        );
    }
}
