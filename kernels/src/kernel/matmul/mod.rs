//! Linear layers, forward and backward: the kernels' signatures and their two runners'
//! dispatch — the CPU ops are in [`cpu`] (strata's own products), the CUDA launch
//! sequences here (cuBLAS products around `matmul.cu`'s bias kernels); [`reference`](mod@reference) holds
//! the scalar reference.

use crate::cuda::launch::{
    CudaKernel, CudaSource, Entry, Gemm, Launch, Operand, Working, int, per_column_tile,
    per_element,
};
use crate::ops::Cpu;
use crate::program::{
    CpuKernel, CpuTensors, Dtype, DtypeRule, KernelError, LenRule, Param, Scalars, Signature,
    TensorRef,
};

pub mod cpu;
pub mod reference;

pub use cpu::{
    WeightLayout, bias_grad_add, input_grad, matmul_backward, matmul_forward, weight_grad_add,
};

/// The family's CUDA kernels.
const SOURCE: CudaSource = ("matmul.cu", include_str!("matmul.cu"));

const BIAS_BROADCAST: Entry = Entry::typed("bias_broadcast");
const BIAS_BACKWARD: Entry = Entry::typed("bias_backward");

/// A linear layer's dimensions: rows, input and output channels, and how the weight is
/// stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatmulShape {
    /// Rows.
    pub n: usize,
    /// Input channels.
    pub c: usize,
    /// Output channels.
    pub oc: usize,
    /// How the weight is stored.
    pub layout: WeightLayout,
}

impl MatmulShape {
    /// The (C, OC) weight at `ptr` as a column-major cuBLAS operand whose op is the
    /// (OC, C) matrix `W^T`, transposed again when `transpose` is set.
    fn weight_operand(&self, w: Working, ptr: u64, transpose: bool) -> Operand {
        // Row-major (C, OC) is column-major (OC, C) = W^T; row-major (OC, C) is
        // column-major (C, OC) = W, which needs a transpose to become W^T.
        let (ld, transposed) = match self.layout {
            WeightLayout::InOut => (self.oc, false),
            WeightLayout::OutIn => (self.c, true),
        };
        Operand::of(w, ptr, ld, transposed != transpose)
    }
}

/// out: (N, OC) = inp: (N, C) @ W + bias; W is (C, OC) for [`WeightLayout::InOut`],
/// (OC, C) for [`WeightLayout::OutIn`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Matmul {
    /// (N, OC).
    pub out: TensorRef,
    /// (N, C).
    pub inp: TensorRef,
    /// (C, OC) or (OC, C).
    pub weight: TensorRef,
    /// (OC), or none.
    pub bias: Option<TensorRef>,
    /// How the weight is stored.
    pub layout: WeightLayout,
    /// Rows.
    pub n: usize,
    /// Input channels.
    pub c: usize,
    /// Output channels.
    pub oc: usize,
}

impl Signature for Matmul {
    const NAME: &'static str = "matmul";
    type Shape = MatmulShape;

    fn shape(&self) -> Result<MatmulShape, KernelError> {
        Ok(MatmulShape {
            n: self.n,
            c: self.c,
            oc: self.oc,
            layout: self.layout,
        })
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, (n, c, oc)) = (DtypeRule::Working, (self.n, self.c, self.oc));
        each(Param::write("out", &self.out, w, LenRule::Len(n * oc)));
        each(Param::read("inp", &self.inp, w, LenRule::Len(n * c)));
        each(Param::read("weight", &self.weight, w, LenRule::Len(c * oc)));
        if let Some(bias) = &self.bias {
            each(Param::read("bias", bias, w, LenRule::Len(oc)));
        }
    }

    fn flops(&self) -> f64 {
        2.0 * (self.n * self.c * self.oc) as f64
    }
}

impl CpuKernel for Matmul {
    fn run_cpu(
        &self,
        s: &MatmulShape,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let bias = self.bias.as_ref().map(|b| t.f32(b));
        let (out, inp, weight) = (t.f32_mut(&self.out), t.f32(&self.inp), t.f32(&self.weight));
        matmul_forward(cpu, out, inp, weight, bias, s.layout, s.n, s.c, s.oc);
        Ok(())
    }
}

impl CudaKernel for Matmul {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[BIAS_BROADCAST];

    fn launch(&self, s: &MatmulShape, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        let (n, c, oc) = (s.n, s.c, s.oc);
        if n == 0 || oc == 0 {
            return Ok(());
        }
        let (w, out) = (q.working(), q.address(&self.out));
        if let Some(bias) = &self.bias {
            // bias_broadcast_<T>(T* out, const T* bias, int n, int oc): out[..n·oc] and
            // bias[..oc].
            let args = [q.ptr(&self.out), q.ptr(bias), int(n), int(oc)];
            q.launch(BIAS_BROADCAST, per_element(n * oc), &args)?;
        }
        if c == 0 {
            // A product over no terms: out is the bias, or zero.
            if self.bias.is_none() {
                q.zero(out, n * oc * w.dtype.size())?;
            }
            return Ok(());
        }
        // Column-major: out^T (OC, N) = W^T (OC, C) @ inp^T (C, N).
        Ok(q.gemm(Gemm {
            m: oc,
            n,
            k: c,
            a: s.weight_operand(w, q.address(&self.weight), false),
            b: Operand::of(w, q.address(&self.inp), c, false),
            c: Operand::of(w, out, oc, false),
            alpha: 1.0,
            beta: if self.bias.is_some() { 1.0 } else { 0.0 },
            batch: None,
        })?)
    }
}

/// A linear layer's weight gradient from the forward's input: dweight += inp^T dout.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WeightGrad {
    /// f32, shaped as the weight, accumulated.
    pub dweight: TensorRef,
    /// (N, C): the forward's input.
    pub inp: TensorRef,
}

/// dinp: (N, C) = (overwritten), dweight +=, dbias += (f32), given dout: (N, OC).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MatmulBackward {
    /// (N, C), overwritten.
    pub dinp: TensorRef,
    /// The weight's gradient, or none where another kernel estimates it from less than
    /// the forward's whole input (a randomized sketch, `kernel::sketch`).
    pub weight_grad: Option<WeightGrad>,
    /// (OC) f32, accumulated, or none.
    pub dbias: Option<TensorRef>,
    /// (N, OC).
    pub dout: TensorRef,
    /// As in [`Matmul`].
    pub weight: TensorRef,
    /// How the weight is stored.
    pub layout: WeightLayout,
    /// Rows.
    pub n: usize,
    /// Input channels.
    pub c: usize,
    /// Output channels.
    pub oc: usize,
}

impl Signature for MatmulBackward {
    const NAME: &'static str = "matmul-backward";
    type Shape = MatmulShape;

    fn shape(&self) -> Result<MatmulShape, KernelError> {
        Ok(MatmulShape {
            n: self.n,
            c: self.c,
            oc: self.oc,
            layout: self.layout,
        })
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, f32_) = (DtypeRule::Working, DtypeRule::Exactly(Dtype::F32));
        let (n, c, oc) = (self.n, self.c, self.oc);
        each(Param::write("dinp", &self.dinp, w, LenRule::Len(n * c)));
        if let Some(g) = &self.weight_grad {
            each(Param::write(
                "dweight",
                &g.dweight,
                f32_,
                LenRule::Len(c * oc),
            ));
        }
        if let Some(dbias) = &self.dbias {
            each(Param::write("dbias", dbias, f32_, LenRule::Len(oc)));
        }
        each(Param::read("dout", &self.dout, w, LenRule::Len(n * oc)));
        if let Some(g) = &self.weight_grad {
            each(Param::read("inp", &g.inp, w, LenRule::Len(n * c)));
        }
        each(Param::read("weight", &self.weight, w, LenRule::Len(c * oc)));
    }

    fn flops(&self) -> f64 {
        // The input gradient, and the weight gradient where this kernel computes it: a
        // product each.
        let products = 1 + usize::from(self.weight_grad.is_some());
        2.0 * (products * self.n * self.c * self.oc) as f64
    }
}

impl CpuKernel for MatmulBackward {
    fn run_cpu(
        &self,
        s: &MatmulShape,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let (dout, weight) = (t.f32(&self.dout), t.f32(&self.weight));
        let (layout, n, c, oc) = (s.layout, s.n, s.c, s.oc);
        input_grad(cpu, t.f32_mut(&self.dinp), dout, weight, layout, n, c, oc);
        if let Some(g) = &self.weight_grad {
            let (dweight, inp) = (t.f32_mut(&g.dweight), t.f32(&g.inp));
            weight_grad_add(cpu, dweight, dout, inp, layout, n, c, oc);
        }
        if let Some(dbias) = &self.dbias {
            bias_grad_add(cpu, t.f32_mut(dbias), dout, n, oc);
        }
        Ok(())
    }
}

impl CudaKernel for MatmulBackward {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[BIAS_BACKWARD];

    fn launch(&self, s: &MatmulShape, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        let (n, c, oc) = (s.n, s.c, s.oc);
        if n == 0 {
            return Ok(());
        }
        let w = q.working();
        if oc == 0 {
            // No output channels: the input gradient is zero; nothing else to add.
            return Ok(q.zero(q.address(&self.dinp), n * c * w.dtype.size())?);
        }
        if c > 0 {
            self.products(s, w, q)?;
        }
        if let Some(dbias) = &self.dbias {
            // bias_backward_<T>(float* dbias, const T* dout, int n, int oc): block (32, 32)
            // per 32 columns; touches dbias[..oc] and the n rows of dout.
            let args = [q.ptr(dbias), q.ptr(&self.dout), int(n), int(oc)];
            q.launch(BIAS_BACKWARD, per_column_tile(oc), &args)?;
        }
        Ok(())
    }
}

impl MatmulBackward {
    /// The input gradient and, where this kernel computes it, the weight gradient: a
    /// cuBLAS product each (n, c, oc > 0).
    fn products(&self, s: &MatmulShape, w: Working, q: &Launch<'_>) -> Result<(), KernelError> {
        let (n, c, oc) = (s.n, s.c, s.oc);
        let dout = q.address(&self.dout);
        // Column-major: dinp^T (C, N) = W (C, OC) @ dout^T (OC, N).
        q.gemm(Gemm {
            m: c,
            n,
            k: oc,
            a: s.weight_operand(w, q.address(&self.weight), true),
            b: Operand::of(w, dout, oc, false),
            c: Operand::of(w, q.address(&self.dinp), c, false),
            alpha: 1.0,
            beta: 0.0,
            batch: None,
        })?;
        let Some(g) = &self.weight_grad else {
            return Ok(());
        };
        let inp = q.address(&g.inp);
        let dout_op = |transposed| Operand::of(w, dout, oc, transposed);
        let inp_op = |transposed| Operand::of(w, inp, c, transposed);
        let (m, nn, a, b, ld) = match s.layout {
            // Row-major (C, OC) is column-major (OC, C) = dout^T (OC, N) @ inp (N, C).
            WeightLayout::InOut => (oc, c, dout_op(false), inp_op(true), oc),
            // Row-major (OC, C) is column-major (C, OC) = inp^T (C, N) @ dout (N, OC).
            WeightLayout::OutIn => (c, oc, inp_op(false), dout_op(true), c),
        };
        Ok(q.gemm(Gemm {
            m,
            n: nn,
            k: n,
            a,
            b,
            c: Operand::f32(q.address(&g.dweight), ld, false),
            alpha: 1.0,
            beta: 1.0,
            batch: None,
        })?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::launch::Arg;
    use crate::cuda::launch::tests::{Emulated, Emulator, Layout, count_arg, ptr_arg};

    /// Every sample's (N, C, OC, layout, with a bias): odd sizes and each empty one.
    fn sizes() -> Vec<(usize, usize, usize, WeightLayout, bool)> {
        let mut out = Vec::new();
        for (n, c, oc) in [(7, 22, 13), (0, 3, 2), (3, 0, 2), (3, 2, 0)] {
            for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
                for with_bias in [true, false] {
                    out.push((n, c, oc, layout, with_bias));
                }
            }
        }
        out
    }

    impl Emulated for Matmul {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            let sample = |(n, c, oc, layout, with_bias): (_, _, _, _, bool)| Matmul {
                out: l.tensor(n * oc, w),
                inp: l.tensor(n * c, w),
                weight: l.tensor(c * oc, w),
                bias: with_bias.then(|| l.tensor(oc, w)),
                layout,
                n,
                c,
                oc,
            };
            sizes().into_iter().map(sample).collect()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            vec![("n", self.n), ("oc", self.oc)]
        }

        fn emulate(name: &str, args: &[Arg], memory: &Emulator) -> bool {
            if name != "bias_broadcast_f32" {
                return false;
            }
            let (p, n) = (|i| ptr_arg(name, args, i), |i| count_arg(name, args, i));
            let (out, bias, rows, oc) = (p(0), p(1), n(2), n(3));
            for i in 0..rows * oc {
                memory.store(out, i, memory.load(bias, i % oc));
            }
            true
        }
    }

    impl Emulated for MatmulBackward {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            // Each size with the weight gradient, and without it (a sketch's layer).
            let mut sample = |(n, c, oc, layout, with_bias): (_, _, _, _, bool),
                              with_weight: bool| MatmulBackward {
                dinp: l.tensor(n * c, w),
                weight_grad: with_weight.then(|| WeightGrad {
                    dweight: l.tensor(c * oc, Dtype::F32),
                    inp: l.tensor(n * c, w),
                }),
                dbias: with_bias.then(|| l.tensor(oc, Dtype::F32)),
                dout: l.tensor(n * oc, w),
                weight: l.tensor(c * oc, w),
                layout,
                n,
                c,
                oc,
            };
            let mut out = Vec::new();
            for size in sizes() {
                out.push(sample(size, true));
                out.push(sample(size, false));
            }
            out
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            vec![("n", self.n), ("oc", self.oc)]
        }

        fn emulate(name: &str, args: &[Arg], memory: &Emulator) -> bool {
            if name != "bias_backward_f32" {
                return false;
            }
            let (p, n) = (|i| ptr_arg(name, args, i), |i| count_arg(name, args, i));
            let (dbias, dout, rows, oc) = (p(0), p(1), n(2), n(3));
            for col in 0..oc {
                let sum: f32 = (0..rows).map(|r| memory.load(dout, r * oc + col)).sum();
                memory.store(dbias, col, memory.load(dbias, col) + sum);
            }
            true
        }
    }
}
