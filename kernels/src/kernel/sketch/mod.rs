//! Randomized weight gradients of linear layers (issue 32; Bershatsky et al.): the
//! forward keeps `X_proj = Sᵀ X` in place of the layer's input ([`SketchProject`]), and
//! the backward estimates the weight gradient from it ([`SketchWeightGrad`]), `S`
//! regenerated from a seed: the kernel's own `seed` mixed with the step's
//! [`Scalars::sketch`] ([`sketch_seed`]), so each step and micro-batch draws a new `S` and
//! a micro-batch's forward and backward the same one. The math and the CPU side are in
//! [`cpu`], the scalar
//! reference in [`reference`](mod@reference), the CUDA sketch in `sketch.cu` (the products
//! are cuBLAS's).
//!
//! f32 tensors only (the CPU device's working type); a GPU training in bf16 would hand
//! them bf16 activations, which these kernels do not take yet (the planner refuses
//! them there). Both model families' approximate backward uses them
//! (`--approx-backward attn:R,mlp:R`, `strata_engine::model::approx`).

use crate::cuda::launch::per_element;
use crate::cuda::launch::{Arg, CudaKernel, CudaSource, Entry, Gemm, Launch, Operand, long};
use crate::ops::{Cpu, WeightLayout};
use crate::program::{
    CpuKernel, CpuTensors, Dtype, DtypeRule, KernelError, LenRule, Param, Scalars, Signature,
    TensorRef,
};

pub mod cpu;
pub mod reference;

pub use cpu::{
    expected_squared_error, fill_sketch, project, sketch_seed, sketch_sign, weight_grad,
};

/// The family's CUDA kernel.
const SOURCE: CudaSource = ("sketch.cu", include_str!("sketch.cu"));

const FILL_SKETCH: Entry = Entry::untyped("fill_sketch");

/// Each entry of a sketch with `k` columns is `±1/√k`.
pub fn sketch_scale(k: usize) -> f32 {
    1.0 / (k as f32).sqrt()
}

/// A sketch's dimensions: rows (the layer's rows, tokens), its columns `k`, and the
/// channels on each side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SketchShape {
    /// Rows of the layer's input and output.
    pub rows: usize,
    /// The sketch's columns (rows of the projection).
    pub k: usize,
    /// Input channels.
    pub cols_in: usize,
    /// Output channels (the weight gradient's; 0 for a projection).
    pub cols_out: usize,
}

/// Enqueues `out` (k × cols) = `Sᵀ m`, `m` (rows × cols) at `m`, with `S` the sketch of
/// `seed` made first in the f32 scratch region at `s` (rows × k): the forward's
/// projection, and the first half of the weight gradient.
fn launch_project(
    q: &Launch<'_>,
    (m, s, out): (u64, u64, u64),
    (rows, cols, k): (usize, usize, usize),
    seed: u64,
) -> Result<(), KernelError> {
    // fill_sketch(float* s, long long rows, long long k, long long seed, float scale).
    let args = [
        Arg::Ptr(s),
        long(rows),
        long(k),
        Arg::Long(seed as i64),
        Arg::Float(sketch_scale(k)),
    ];
    q.launch(FILL_SKETCH, per_element(rows * k), &args)?;
    // Column-major: outᵀ (cols × k) = mᵀ (cols × rows, m as stored) · S (rows × k, the
    // stored row-major S read transposed).
    q.gemm(Gemm {
        m: cols,
        n: k,
        k: rows,
        a: Operand::f32(m, cols, false),
        b: Operand::f32(s, k, true),
        c: Operand::f32(out, cols, false),
        alpha: 1.0,
        beta: 0.0,
        batch: None,
    })?;
    Ok(())
}

/// The forward's projection: out (k, cols) = Sᵀ x, x (rows, cols), with `S` the sketch
/// of `sketch_seed(scalars.sketch, seed)`, made in `scratch` (rows × k f32).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SketchProject {
    /// (k, cols), written.
    pub out: TensorRef,
    /// (rows, cols).
    pub x: TensorRef,
    /// (rows × k) f32, written: the sketch.
    pub scratch: TensorRef,
    /// Rows of `x`.
    pub rows: usize,
    /// Columns of `x` (and of `out`).
    pub cols: usize,
    /// Columns of the sketch.
    pub k: usize,
    /// This layer's seed, mixed with the step's ([`sketch_seed`]).
    pub seed: u64,
}

impl Signature for SketchProject {
    const NAME: &'static str = "sketch-project";
    type Shape = SketchShape;

    fn shape(&self) -> Result<SketchShape, KernelError> {
        Ok(SketchShape {
            rows: self.rows,
            k: self.k,
            cols_in: self.cols,
            cols_out: 0,
        })
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let f32_ = DtypeRule::Exactly(Dtype::F32);
        let cols = self.cols;
        each(Param::write(
            "out",
            &self.out,
            f32_,
            LenRule::Len(self.k * cols),
        ));
        each(Param::read(
            "x",
            &self.x,
            f32_,
            LenRule::Len(self.rows * cols),
        ));
        each(Param::write(
            "scratch",
            &self.scratch,
            f32_,
            LenRule::Len(self.rows * self.k),
        ));
    }

    fn flops(&self) -> f64 {
        2.0 * self.k as f64 * self.x.len as f64
    }
}

impl CpuKernel for SketchProject {
    fn run_cpu(
        &self,
        s: &SketchShape,
        cpu: &Cpu,
        scalars: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let (out, x, scratch) = (
            t.f32_mut(&self.out),
            t.f32(&self.x),
            t.f32_mut(&self.scratch),
        );
        let seed = sketch_seed(scalars.sketch, self.seed);
        project(cpu, out, x, (s.rows, s.cols_in, s.k), seed, scratch);
        Ok(())
    }
}

impl CudaKernel for SketchProject {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[FILL_SKETCH];

    fn launch(
        &self,
        s: &SketchShape,
        scalars: &Scalars,
        q: &mut Launch<'_>,
    ) -> Result<(), KernelError> {
        if s.k == 0 || s.cols_in == 0 {
            return Ok(());
        }
        if s.rows == 0 {
            // A sum of no terms.
            q.zero(q.address(&self.out), 4 * s.k * s.cols_in)?;
            return Ok(());
        }
        let sk = q.carve(&self.scratch, 0, 4 * s.rows * s.k);
        let (x, out) = (q.address(&self.x), q.address(&self.out));
        let seed = sketch_seed(scalars.sketch, self.seed);
        launch_project(q, (x, sk, out), (s.rows, s.cols_in, s.k), seed)?;
        Ok(())
    }
}

/// The backward's weight gradient: dw = (or, `accumulate`, +=) x_projᵀ (Sᵀ dy), stored
/// (cols_in, cols_out) for [`WeightLayout::InOut`] (GPT-2's Conv1D) or (cols_out,
/// cols_in) for [`WeightLayout::OutIn`] (`nn.Linear`, the Llama family); x_proj (k,
/// cols_in) is [`SketchProject`]'s output for the same `seed` and [`Scalars::sketch`], dy
/// (rows, cols_out); `scratch` holds S (rows × k) and then Sᵀ dy (k × cols_out).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SketchWeightGrad {
    /// (cols_in, cols_out) or (cols_out, cols_in) as `layout` says, written or
    /// accumulated.
    pub dw: TensorRef,
    /// (rows, cols_out).
    pub dy: TensorRef,
    /// (k, cols_in).
    pub x_proj: TensorRef,
    /// (rows × k + k × cols_out) f32, written.
    pub scratch: TensorRef,
    /// Rows of `dy`.
    pub rows: usize,
    /// Input channels.
    pub cols_in: usize,
    /// Output channels (columns of `dy`).
    pub cols_out: usize,
    /// Columns of the sketch.
    pub k: usize,
    /// The seed the forward projected with (mixed with the step's, as there).
    pub seed: u64,
    /// How `dw` is stored.
    pub layout: WeightLayout,
    /// Add to `dw` rather than overwrite it.
    pub accumulate: bool,
}

impl Signature for SketchWeightGrad {
    const NAME: &'static str = "sketch-weight-grad";
    type Shape = SketchShape;

    fn shape(&self) -> Result<SketchShape, KernelError> {
        Ok(SketchShape {
            rows: self.rows,
            k: self.k,
            cols_in: self.cols_in,
            cols_out: self.cols_out,
        })
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let f32_ = DtypeRule::Exactly(Dtype::F32);
        let (rows, k, ci, co) = (self.rows, self.k, self.cols_in, self.cols_out);
        each(Param::write("dw", &self.dw, f32_, LenRule::Len(ci * co)));
        each(Param::read("dy", &self.dy, f32_, LenRule::Len(rows * co)));
        each(Param::read(
            "x_proj",
            &self.x_proj,
            f32_,
            LenRule::Len(k * ci),
        ));
        each(Param::write(
            "scratch",
            &self.scratch,
            f32_,
            LenRule::Len(rows * k + k * co),
        ));
    }

    fn flops(&self) -> f64 {
        let (rows, k, ci, co) = (self.rows, self.k, self.cols_in, self.cols_out);
        2.0 * (k * rows * co + ci * k * co) as f64
    }
}

impl CpuKernel for SketchWeightGrad {
    fn run_cpu(
        &self,
        s: &SketchShape,
        cpu: &Cpu,
        scalars: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let scratch = t.f32_mut(&self.scratch);
        let (sk, p) = scratch.split_at_mut(s.rows * s.k);
        weight_grad(
            cpu,
            t.f32_mut(&self.dw),
            t.f32(&self.dy),
            t.f32(&self.x_proj),
            (s.rows, s.cols_in, s.cols_out, s.k),
            sketch_seed(scalars.sketch, self.seed),
            (sk, p),
            self.layout,
            self.accumulate,
        );
        Ok(())
    }
}

impl CudaKernel for SketchWeightGrad {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[FILL_SKETCH];

    fn launch(
        &self,
        s: &SketchShape,
        scalars: &Scalars,
        q: &mut Launch<'_>,
    ) -> Result<(), KernelError> {
        if s.cols_in == 0 || s.cols_out == 0 {
            return Ok(());
        }
        let dw = q.address(&self.dw);
        if s.rows == 0 || s.k == 0 {
            // No terms: the gradient adds nothing, or is zero.
            if !self.accumulate {
                q.zero(dw, 4 * s.cols_in * s.cols_out)?;
            }
            return Ok(());
        }
        let s_bytes = 4 * s.rows * s.k;
        let sk = q.carve(&self.scratch, 0, s_bytes);
        let p = q.carve(&self.scratch, s_bytes, 4 * s.k * s.cols_out);
        let dy = q.address(&self.dy);
        let seed = sketch_seed(scalars.sketch, self.seed);
        launch_project(q, (dy, sk, p), (s.rows, s.cols_out, s.k), seed)?;
        let (ci, co) = (s.cols_in, s.cols_out);
        let p_op = |transposed| Operand::f32(p, co, transposed);
        let x_op = |transposed| Operand::f32(q.address(&self.x_proj), ci, transposed);
        let (m, n, a, b, ld) = match self.layout {
            // Row-major (ci, co) is column-major dwᵀ (co × ci) = Pᵀ (co × k, P as stored) ·
            // x_proj (k × ci, the stored row-major x_proj read transposed).
            WeightLayout::InOut => (co, ci, p_op(false), x_op(true), co),
            // Row-major (co, ci) is column-major dw (ci × co) = x_projᵀ (ci × k, x_proj as
            // stored) · P (k × co, the stored row-major P read transposed).
            WeightLayout::OutIn => (ci, co, x_op(false), p_op(true), ci),
        };
        q.gemm(Gemm {
            m,
            n,
            k: s.k,
            a,
            b,
            c: Operand::f32(dw, ld, false),
            alpha: 1.0,
            beta: if self.accumulate { 1.0 } else { 0.0 },
            batch: None,
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
