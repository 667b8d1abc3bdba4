//! LayerNorm (eps 1e-5, biased variance), forward and backward: the kernels' signatures,
//! CPU ops and CUDA launches; `layernorm.cu` holds the CUDA kernels, [`reference`](mod@reference) the
//! scalar reference.

use crate::cuda::launch::{
    CudaKernel, CudaSource, Entry, Launch, int, per_column_tile, per_row_warp,
};
use crate::ops::simd::on_isa;
use crate::ops::{Cpu, RowsMut, par_rows, simd};
use crate::program::{
    CpuKernel, CpuTensors, Dtype, DtypeRule, KernelError, LenRule, Param, Rows, Scalars, Signature,
    TensorRef,
};

pub mod reference;

/// LayerNorm's epsilon in GPT-2.
pub const LAYERNORM_EPS: f64 = 1e-5;

/// out: (N, C)  mean: (N)  rstd: (N)  inp: (N, C)  weight: (C)  bias: (C).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward(
    cpu: &Cpu,
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: &[f32],
    n: usize,
    c: usize,
) {
    assert_eq!(out.len(), n * c);
    assert_eq!(inp.len(), n * c);
    assert_eq!((mean.len(), rstd.len()), (n, n));
    assert_eq!((weight.len(), bias.len()), (c, c));
    let parts = (
        RowsMut::new(out, c),
        RowsMut::new(mean, 1),
        RowsMut::new(rstd, 1),
    );
    par_rows(
        cpu.threads_for(n * c),
        n,
        1,
        parts,
        |rows, (out, mean, rstd)| {
            on_isa!(cpu.isa, {
                for (i, row) in rows.enumerate() {
                    let x = &inp[row * c..][..c];
                    let m = simd::sum(x) / c as f32;
                    let var = simd::sum_squared_deviation(x, m) / c as f32;
                    let s = 1.0 / (var + LAYERNORM_EPS as f32).sqrt();
                    let o = &mut out.data[i * c..][..c];
                    for j in 0..c {
                        o[j] = (x[j] - m) * s * weight[j] + bias[j];
                    }
                    mean.data[i] = m;
                    rstd.data[i] = s;
                }
            },)
        },
    );
}

/// dinp: (N, C) +=  (dweight, dbias): (C) += (or none: frozen parameters)  dout: (N, C)
/// inp: (N, C)  weight: (C)  mean, rstd: (N) from the forward pass.
/// Two passes: rows in parallel for `dinp`, then column ranges in parallel for the
/// parameter gradients (each column adds its rows in order: no dependence on threads).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
    cpu: &Cpu,
    dinp: &mut [f32],
    params: Option<(&mut [f32], &mut [f32])>,
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    assert_eq!(dinp.len(), n * c);
    assert_eq!(dout.len(), n * c);
    assert_eq!(inp.len(), n * c);
    assert_eq!((mean.len(), rstd.len()), (n, n));
    assert_eq!(weight.len(), c);
    let threads = cpu.threads_for(n * c);
    par_rows(threads, n, 1, RowsMut::new(dinp, c), |rows, dinp| {
        on_isa!(cpu.isa, {
            for (i, row) in rows.enumerate() {
                let x = &inp[row * c..][..c];
                let d = &dout[row * c..][..c];
                let (m, s) = (mean[row], rstd[row]);
                // mean(w * d) and mean(w * d * norm), with norm = (x - m) * s.
                let mut acc_d = [0.0f32; simd::LANES];
                let mut acc_dn = [0.0f32; simd::LANES];
                let body = c - c % simd::LANES;
                for j0 in (0..body).step_by(simd::LANES) {
                    for l in 0..simd::LANES {
                        let j = j0 + l;
                        let dnorm = weight[j] * d[j];
                        acc_d[l] += dnorm;
                        acc_dn[l] += dnorm * (x[j] - m) * s;
                    }
                }
                let (mut sum_d, mut sum_dn) = (simd::sum(&acc_d), simd::sum(&acc_dn));
                for j in body..c {
                    let dnorm = weight[j] * d[j];
                    sum_d += dnorm;
                    sum_dn += dnorm * (x[j] - m) * s;
                }
                let (mean_d, mean_dn) = (sum_d / c as f32, sum_dn / c as f32);
                let di = &mut dinp.data[i * c..][..c];
                for j in 0..c {
                    let norm = (x[j] - m) * s;
                    di[j] += (weight[j] * d[j] - mean_d - norm * mean_dn) * s;
                }
            }
        },)
    });
    let Some((dweight, dbias)) = params else {
        return;
    };
    assert_eq!((dweight.len(), dbias.len()), (c, c));
    let parts = (RowsMut::new(dweight, 1), RowsMut::new(dbias, 1));
    par_rows(threads, c, simd::LANES, parts, |cols, (dw, db)| {
        on_isa!(cpu.isa, {
            for row in 0..n {
                let x = &inp[row * c..][cols.clone()];
                let d = &dout[row * c..][cols.clone()];
                let (m, s) = (mean[row], rstd[row]);
                for j in 0..cols.len() {
                    db.data[j] += d[j];
                    dw.data[j] += (x[j] - m) * s * d[j];
                }
            }
        },)
    });
}

/// The family's CUDA kernels.
const SOURCE: CudaSource = ("layernorm.cu", include_str!("layernorm.cu"));

const LAYERNORM_FORWARD: Entry = Entry::typed("layernorm_forward");
const LAYERNORM_BACKWARD_INPUT: Entry = Entry::typed("layernorm_backward_input");
const LAYERNORM_BACKWARD_PARAMS: Entry = Entry::typed("layernorm_backward_params");

/// out: (N, C) = LayerNorm(inp) (eps 1e-5); mean, rstd: (N) f32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerNorm {
    /// (N, C).
    pub out: TensorRef,
    /// (N) f32.
    pub mean: TensorRef,
    /// (N) f32.
    pub rstd: TensorRef,
    /// (N, C).
    pub inp: TensorRef,
    /// (C).
    pub weight: TensorRef,
    /// (C).
    pub bias: TensorRef,
    /// Rows.
    pub n: usize,
    /// Channels.
    pub c: usize,
}

impl Signature for LayerNorm {
    const NAME: &'static str = "layernorm";
    type Shape = Rows;

    fn shape(&self) -> Result<Rows, KernelError> {
        Ok(Rows {
            n: self.n,
            c: self.c,
        })
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, f32_) = (DtypeRule::Working, DtypeRule::Exactly(Dtype::F32));
        let (rows, row, stats) = (
            LenRule::Len(self.n * self.c),
            LenRule::Len(self.c),
            LenRule::Len(self.n),
        );
        each(Param::write("out", &self.out, w, rows));
        each(Param::write("mean", &self.mean, f32_, stats));
        each(Param::write("rstd", &self.rstd, f32_, stats));
        each(Param::read("inp", &self.inp, w, rows));
        each(Param::read("weight", &self.weight, w, row));
        each(Param::read("bias", &self.bias, w, row));
    }

    fn flops(&self) -> f64 {
        8.0 * (self.n * self.c) as f64
    }
}

impl CpuKernel for LayerNorm {
    fn run_cpu(
        &self,
        s: &Rows,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let (out, mean, rstd) = (
            t.f32_mut(&self.out),
            t.f32_mut(&self.mean),
            t.f32_mut(&self.rstd),
        );
        let (inp, weight, bias) = (t.f32(&self.inp), t.f32(&self.weight), t.f32(&self.bias));
        layernorm_forward(cpu, out, mean, rstd, inp, weight, bias, s.n, s.c);
        Ok(())
    }
}

impl CudaKernel for LayerNorm {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[LAYERNORM_FORWARD];

    fn launch(&self, s: &Rows, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        // layernorm_forward_<T>(T* out, float* mean, float* rstd, const T* inp, const T*
        // weight, const T* bias, int n, int c): warp `row` < n touches row `row` (c
        // elements) of out and inp, mean[row], rstd[row], and c of weight and bias.
        let args = [
            q.ptr(&self.out),
            q.ptr(&self.mean),
            q.ptr(&self.rstd),
            q.ptr(&self.inp),
            q.ptr(&self.weight),
            q.ptr(&self.bias),
            int(s.n),
            int(s.c),
        ];
        Ok(q.launch(LAYERNORM_FORWARD, per_row_warp(s.n), &args)?)
    }
}

/// The parameters' gradients of a [`LayerNormBackward`]: (C) f32 each, accumulated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerNormGrads {
    /// The weight's.
    pub dweight: TensorRef,
    /// The bias's.
    pub dbias: TensorRef,
}

/// dinp: (N, C) +=, dweight, dbias: (C) f32 += the gradients given dout; without
/// `params` (frozen parameters, as a LoRA model's) only the input gradient.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerNormBackward {
    /// (N, C), accumulated.
    pub dinp: TensorRef,
    /// The parameters' gradients, accumulated; none where they are frozen.
    pub params: Option<LayerNormGrads>,
    /// (N, C).
    pub dout: TensorRef,
    /// (N, C).
    pub inp: TensorRef,
    /// (C).
    pub weight: TensorRef,
    /// (N) f32.
    pub mean: TensorRef,
    /// (N) f32.
    pub rstd: TensorRef,
    /// Rows.
    pub n: usize,
    /// Channels.
    pub c: usize,
}

impl Signature for LayerNormBackward {
    const NAME: &'static str = "layernorm-backward";
    type Shape = Rows;

    fn shape(&self) -> Result<Rows, KernelError> {
        Ok(Rows {
            n: self.n,
            c: self.c,
        })
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, f32_) = (DtypeRule::Working, DtypeRule::Exactly(Dtype::F32));
        let (rows, row, stats) = (
            LenRule::Len(self.n * self.c),
            LenRule::Len(self.c),
            LenRule::Len(self.n),
        );
        each(Param::write("dinp", &self.dinp, w, rows));
        if let Some(g) = &self.params {
            each(Param::write("dweight", &g.dweight, f32_, row));
            each(Param::write("dbias", &g.dbias, f32_, row));
        }
        each(Param::read("dout", &self.dout, w, rows));
        each(Param::read("inp", &self.inp, w, rows));
        each(Param::read("weight", &self.weight, w, row));
        each(Param::read("mean", &self.mean, f32_, stats));
        each(Param::read("rstd", &self.rstd, f32_, stats));
    }

    fn flops(&self) -> f64 {
        // The input gradient's 9 per element, and the parameters' 3 where computed.
        let per_element = if self.params.is_some() { 12.0 } else { 9.0 };
        per_element * (self.n * self.c) as f64
    }
}

impl CpuKernel for LayerNormBackward {
    fn run_cpu(
        &self,
        s: &Rows,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let dinp = t.f32_mut(&self.dinp);
        let params = self
            .params
            .as_ref()
            .map(|g| (t.f32_mut(&g.dweight), t.f32_mut(&g.dbias)));
        let (dout, inp, weight) = (t.f32(&self.dout), t.f32(&self.inp), t.f32(&self.weight));
        let (mean, rstd) = (t.f32(&self.mean), t.f32(&self.rstd));
        layernorm_backward(cpu, dinp, params, dout, inp, weight, mean, rstd, s.n, s.c);
        Ok(())
    }
}

impl CudaKernel for LayerNormBackward {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[LAYERNORM_BACKWARD_INPUT, LAYERNORM_BACKWARD_PARAMS];

    fn launch(&self, s: &Rows, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        // layernorm_backward_input_<T>(T* dinp, const T* dout, const T* inp, const T*
        // weight, const float* mean, const float* rstd, int n, int c): warp `row` < n
        // touches row `row` of dinp, dout and inp, c of weight, mean[row] and rstd[row].
        let input = [
            q.ptr(&self.dinp),
            q.ptr(&self.dout),
            q.ptr(&self.inp),
            q.ptr(&self.weight),
            q.ptr(&self.mean),
            q.ptr(&self.rstd),
            int(s.n),
            int(s.c),
        ];
        q.launch(LAYERNORM_BACKWARD_INPUT, per_row_warp(s.n), &input)?;
        let Some(g) = &self.params else {
            return Ok(());
        };
        // layernorm_backward_params_<T>(float* dweight, float* dbias, const T* dout,
        // const T* inp, const float* mean, const float* rstd, int n, int c): block
        // (32, 32) per 32 columns; touches columns below c of dweight and dbias and of
        // the n rows of dout and inp, and n of mean and rstd.
        let params = [
            q.ptr(&g.dweight),
            q.ptr(&g.dbias),
            q.ptr(&self.dout),
            q.ptr(&self.inp),
            q.ptr(&self.mean),
            q.ptr(&self.rstd),
            int(s.n),
            int(s.c),
        ];
        Ok(q.launch(LAYERNORM_BACKWARD_PARAMS, per_column_tile(s.c), &params)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::launch::tests::{Emulated, Layout};

    /// (N, C) of the samples.
    const SIZES: [(usize, usize); 3] = [(7, 22), (1, 1), (0, 5)];

    impl Emulated for LayerNorm {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            SIZES
                .map(|(n, c)| LayerNorm {
                    out: l.tensor(n * c, w),
                    mean: l.tensor(n, Dtype::F32),
                    rstd: l.tensor(n, Dtype::F32),
                    inp: l.tensor(n * c, w),
                    weight: l.tensor(c, w),
                    bias: l.tensor(c, w),
                    n,
                    c,
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            vec![("n", self.n), ("c", self.c)]
        }
    }

    impl Emulated for LayerNormBackward {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            // Each size with the parameters' gradients, and without them (frozen).
            let mut out = Vec::new();
            for (n, c) in SIZES {
                for with_params in [true, false] {
                    out.push(LayerNormBackward {
                        dinp: l.tensor(n * c, w),
                        params: with_params.then(|| LayerNormGrads {
                            dweight: l.tensor(c, Dtype::F32),
                            dbias: l.tensor(c, Dtype::F32),
                        }),
                        dout: l.tensor(n * c, w),
                        inp: l.tensor(n * c, w),
                        weight: l.tensor(c, w),
                        mean: l.tensor(n, Dtype::F32),
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
