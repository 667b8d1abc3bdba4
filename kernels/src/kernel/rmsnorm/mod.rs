//! RMSNorm (Llama, Qwen, Mistral; eps the model's), forward and backward: the kernels'
//! signatures, CPU ops and CUDA launches; `rmsnorm.cu` holds the CUDA kernels,
//! [`reference`](mod@reference) the scalar reference. The same kernels normalise Qwen3's per-head q and
//! k: rows of a (B, T, H, D) tensor are its B × T × H heads of D channels.

use crate::cuda::launch::{
    Arg, CudaKernel, CudaSource, Entry, Launch, int, per_column_tile, per_row_warp,
};
use crate::ops::simd::on_isa;
use crate::ops::{Cpu, RowsMut, par_rows, simd};
use crate::program::{
    CpuKernel, CpuTensors, Dtype, DtypeRule, KernelError, LenRule, Param, Rows, Scalars, Signature,
    TensorRef,
};

pub mod reference;

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

/// dinp: (N, C) +=  dweight: (C) += (or none: a frozen weight)  dout: (N, C)  inp: (N, C)
/// weight: (C)  rstd: (N) from the forward pass.
/// Two passes, as LayerNorm's: rows in parallel for `dinp`, then column ranges in
/// parallel for `dweight` (each column adds its rows in order).
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward(
    cpu: &Cpu,
    dinp: &mut [f32],
    dweight: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    assert_eq!((dinp.len(), dout.len(), inp.len()), (n * c, n * c, n * c));
    assert_eq!((rstd.len(), weight.len()), (n, c));
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
    let Some(dweight) = dweight else {
        return;
    };
    assert_eq!(dweight.len(), c);
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

/// The family's CUDA kernels.
const SOURCE: CudaSource = ("rmsnorm.cu", include_str!("rmsnorm.cu"));

const RMSNORM_FORWARD: Entry = Entry::typed("rmsnorm_forward");
const RMSNORM_BACKWARD_INPUT: Entry = Entry::typed("rmsnorm_backward_input");
const RMSNORM_BACKWARD_WEIGHT: Entry = Entry::typed("rmsnorm_backward_weight");

/// out: (N, C) = `inp * rstd * weight`, `rstd = 1 / sqrt(mean(inp^2) + eps)` per row
/// (RMSNorm); rstd: (N) f32. Qwen3's per-head q/k norm is this kernel over the
/// B × T × H rows of D channels of q or k.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmsNorm {
    /// (N, C).
    pub out: TensorRef,
    /// (N) f32.
    pub rstd: TensorRef,
    /// (N, C).
    pub inp: TensorRef,
    /// (C).
    pub weight: TensorRef,
    /// Added to the mean square.
    pub eps: f32,
    /// Rows.
    pub n: usize,
    /// Channels.
    pub c: usize,
}

impl Signature for RmsNorm {
    const NAME: &'static str = "rmsnorm";
    type Shape = Rows;

    fn shape(&self) -> Result<Rows, KernelError> {
        Ok(Rows {
            n: self.n,
            c: self.c,
        })
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, f32_) = (DtypeRule::Working, DtypeRule::Exactly(Dtype::F32));
        let rows = LenRule::Len(self.n * self.c);
        each(Param::write("out", &self.out, w, rows));
        each(Param::write("rstd", &self.rstd, f32_, LenRule::Len(self.n)));
        each(Param::read("inp", &self.inp, w, rows));
        each(Param::read("weight", &self.weight, w, LenRule::Len(self.c)));
    }

    fn flops(&self) -> f64 {
        4.0 * (self.n * self.c) as f64
    }
}

impl CpuKernel for RmsNorm {
    fn run_cpu(
        &self,
        s: &Rows,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let (out, rstd) = (t.f32_mut(&self.out), t.f32_mut(&self.rstd));
        let (inp, weight) = (t.f32(&self.inp), t.f32(&self.weight));
        rmsnorm_forward(cpu, out, rstd, inp, weight, self.eps, s.n, s.c);
        Ok(())
    }
}

impl CudaKernel for RmsNorm {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[RMSNORM_FORWARD];

    fn launch(&self, s: &Rows, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        // rmsnorm_forward_<T>(T* out, float* rstd, const T* inp, const T* weight, float
        // eps, int n, int c): warp `row` < n touches row `row` (c elements) of out and
        // inp, rstd[row], and c of weight.
        let args = [
            q.ptr(&self.out),
            q.ptr(&self.rstd),
            q.ptr(&self.inp),
            q.ptr(&self.weight),
            Arg::Float(self.eps),
            int(s.n),
            int(s.c),
        ];
        Ok(q.launch(RMSNORM_FORWARD, per_row_warp(s.n), &args)?)
    }
}

/// dinp: (N, C) +=, dweight: (C) f32 += the gradients given dout (the input gradient
/// accumulates, as LayerNorm's: zero it first where nothing joins there, as for
/// Qwen3's q/k norm). Without `dweight` (a frozen weight, as a LoRA model's base) only
/// the input gradient is computed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmsNormBackward {
    /// (N, C), accumulated.
    pub dinp: TensorRef,
    /// (C) f32, accumulated; none for a frozen weight.
    pub dweight: Option<TensorRef>,
    /// (N, C).
    pub dout: TensorRef,
    /// (N, C).
    pub inp: TensorRef,
    /// (C).
    pub weight: TensorRef,
    /// (N) f32, from [`RmsNorm`].
    pub rstd: TensorRef,
    /// Rows.
    pub n: usize,
    /// Channels.
    pub c: usize,
}

impl Signature for RmsNormBackward {
    const NAME: &'static str = "rmsnorm-backward";
    type Shape = Rows;

    fn shape(&self) -> Result<Rows, KernelError> {
        Ok(Rows {
            n: self.n,
            c: self.c,
        })
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, f32_) = (DtypeRule::Working, DtypeRule::Exactly(Dtype::F32));
        let (rows, row) = (LenRule::Len(self.n * self.c), LenRule::Len(self.c));
        each(Param::write("dinp", &self.dinp, w, rows));
        if let Some(dweight) = &self.dweight {
            each(Param::write("dweight", dweight, f32_, row));
        }
        each(Param::read("dout", &self.dout, w, rows));
        each(Param::read("inp", &self.inp, w, rows));
        each(Param::read("weight", &self.weight, w, row));
        each(Param::read("rstd", &self.rstd, f32_, LenRule::Len(self.n)));
    }

    fn flops(&self) -> f64 {
        // The input gradient's 6 per element, and the weight gradient's 2 where computed.
        let per_element = if self.dweight.is_some() { 8.0 } else { 6.0 };
        per_element * (self.n * self.c) as f64
    }
}

impl CpuKernel for RmsNormBackward {
    fn run_cpu(
        &self,
        s: &Rows,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let dinp = t.f32_mut(&self.dinp);
        let dweight = self.dweight.as_ref().map(|d| t.f32_mut(d));
        let (dout, inp) = (t.f32(&self.dout), t.f32(&self.inp));
        let (weight, rstd) = (t.f32(&self.weight), t.f32(&self.rstd));
        rmsnorm_backward(cpu, dinp, dweight, dout, inp, weight, rstd, s.n, s.c);
        Ok(())
    }
}

impl CudaKernel for RmsNormBackward {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[RMSNORM_BACKWARD_INPUT, RMSNORM_BACKWARD_WEIGHT];

    fn launch(&self, s: &Rows, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        // rmsnorm_backward_input_<T>(T* dinp, const T* dout, const T* inp, const T*
        // weight, const float* rstd, int n, int c): warp `row` < n touches row `row` of
        // dinp, dout and inp, c of weight and rstd[row].
        let input = [
            q.ptr(&self.dinp),
            q.ptr(&self.dout),
            q.ptr(&self.inp),
            q.ptr(&self.weight),
            q.ptr(&self.rstd),
            int(s.n),
            int(s.c),
        ];
        q.launch(RMSNORM_BACKWARD_INPUT, per_row_warp(s.n), &input)?;
        let Some(dweight) = &self.dweight else {
            return Ok(());
        };
        // rmsnorm_backward_weight_<T>(float* dweight, const T* dout, const T* inp, const
        // float* rstd, int n, int c): block (32, 32) per 32 columns; touches columns below
        // c of dweight and of the n rows of dout and inp, and n of rstd.
        let weight = [
            q.ptr(dweight),
            q.ptr(&self.dout),
            q.ptr(&self.inp),
            q.ptr(&self.rstd),
            int(s.n),
            int(s.c),
        ];
        Ok(q.launch(RMSNORM_BACKWARD_WEIGHT, per_column_tile(s.c), &weight)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::launch::tests::{Emulated, Layout};

    /// (N, C) of the samples.
    const SIZES: [(usize, usize); 3] = [(7, 22), (1, 1), (0, 5)];

    impl Emulated for RmsNorm {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            SIZES
                .map(|(n, c)| RmsNorm {
                    out: l.tensor(n * c, w),
                    rstd: l.tensor(n, Dtype::F32),
                    inp: l.tensor(n * c, w),
                    weight: l.tensor(c, w),
                    eps: 1e-6,
                    n,
                    c,
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            vec![("n", self.n), ("c", self.c)]
        }

        fn floats(&self, _: &Scalars) -> Vec<(&'static str, f32)> {
            vec![("eps", self.eps)]
        }
    }

    impl Emulated for RmsNormBackward {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            // Each size with the weight gradient, and without it (a frozen weight).
            let mut out = Vec::new();
            for (n, c) in SIZES {
                for with_weight in [true, false] {
                    out.push(RmsNormBackward {
                        dinp: l.tensor(n * c, w),
                        dweight: with_weight.then(|| l.tensor(c, Dtype::F32)),
                        dout: l.tensor(n * c, w),
                        inp: l.tensor(n * c, w),
                        weight: l.tensor(c, w),
                        rstd: l.tensor(n, Dtype::F32),
                        n,
                        c,
                    });
                }
            }
            out
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            vec![("n", self.n), ("c", self.c)]
        }
    }
}
