//! The elementwise part of the SiLU-gated MLP (SwiGLU): `silu(gate) * up`, forward and
//! backward: the kernels' signatures, CPU ops and CUDA launches; `swiglu.cu` holds the
//! CUDA kernels, [`reference`](mod@reference) the scalar reference. The three projections around it are
//! matrix products ([`super::matmul`]).

use crate::cuda::launch::{CudaKernel, CudaSource, Entry, Launch, long, per_element};
use crate::ops::simd::{self, on_isa};
use crate::ops::{Cpu, RowsMut, par_chunks, par_rows};
use crate::program::{
    CpuKernel, CpuTensors, DtypeRule, KernelError, LenRule, Param, Scalars, Signature, TensorRef,
};

pub mod reference;

/// out: (N) = `silu(gate) * up`, `silu(x) = x sigmoid(x)`; gate, up: (N).
pub fn swiglu_forward(cpu: &Cpu, out: &mut [f32], gate: &[f32], up: &[f32]) {
    assert_eq!((gate.len(), up.len()), (out.len(), out.len()));
    par_chunks(cpu, out, simd::LANES, |r, out| {
        let (gate, up) = (&gate[r.clone()], &up[r]);
        on_isa!(cpu.isa, {
            for i in 0..out.len() {
                let g = gate[i];
                out[i] = g * simd::sigmoid(g) * up[i];
            }
        })
    });
}

/// dgate: (N) =  dup: (N) =  dout: (N)  gate, up: (N) the forward's inputs.
/// `dup = silu(gate) dout`, `dgate = s (1 + gate (1 - s)) up dout`, `s = sigmoid(gate)`.
pub fn swiglu_backward(
    cpu: &Cpu,
    dgate: &mut [f32],
    dup: &mut [f32],
    dout: &[f32],
    gate: &[f32],
    up: &[f32],
) {
    let n = dout.len();
    assert_eq!((dgate.len(), dup.len(), gate.len(), up.len()), (n, n, n, n));
    let parts = (RowsMut::new(dgate, 1), RowsMut::new(dup, 1));
    par_rows(
        cpu.threads_for(n),
        n,
        simd::LANES,
        parts,
        |r, (dgate, dup)| {
            let (dout, gate, up) = (&dout[r.clone()], &gate[r.clone()], &up[r]);
            let (dgate, dup) = (dgate.data, dup.data);
            on_isa!(cpu.isa, {
                for i in 0..dgate.len() {
                    let g = gate[i];
                    let s = simd::sigmoid(g);
                    dup[i] = g * s * dout[i];
                    dgate[i] = s * (1.0 + g * (1.0 - s)) * up[i] * dout[i];
                }
            })
        },
    );
}

/// The family's CUDA kernels.
const SOURCE: CudaSource = ("swiglu.cu", include_str!("swiglu.cu"));

const SWIGLU_FORWARD: Entry = Entry::typed("swiglu_forward");
const SWIGLU_BACKWARD: Entry = Entry::typed("swiglu_backward");

/// out = silu(gate) * up, elementwise (the SiLU-gated MLP between its products).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SwiGlu {
    /// Output.
    pub out: TensorRef,
    /// The gate projection, same length.
    pub gate: TensorRef,
    /// The up projection, same length.
    pub up: TensorRef,
}

impl Signature for SwiGlu {
    const NAME: &'static str = "swiglu";
    /// Elements.
    type Shape = usize;

    fn shape(&self) -> Result<usize, KernelError> {
        Ok(self.out.len)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, n) = (DtypeRule::Working, LenRule::Len(self.out.len));
        each(Param::write("out", &self.out, w, n));
        each(Param::read("gate", &self.gate, w, n));
        each(Param::read("up", &self.up, w, n));
    }

    fn flops(&self) -> f64 {
        8.0 * self.out.len as f64
    }
}

impl CpuKernel for SwiGlu {
    fn run_cpu(
        &self,
        _: &usize,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        swiglu_forward(
            cpu,
            t.f32_mut(&self.out),
            t.f32(&self.gate),
            t.f32(&self.up),
        );
        Ok(())
    }
}

impl CudaKernel for SwiGlu {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[SWIGLU_FORWARD];

    fn launch(&self, &n: &usize, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        // swiglu_forward_<T>(T* out, const T* gate, const T* up, long long n).
        let args = [
            q.ptr(&self.out),
            q.ptr(&self.gate),
            q.ptr(&self.up),
            long(n),
        ];
        Ok(q.launch(SWIGLU_FORWARD, per_element(n), &args)?)
    }
}

/// dgate, dup = (overwritten) the gradients of [`SwiGlu`] given dout.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SwiGluBackward {
    /// Overwritten.
    pub dgate: TensorRef,
    /// Overwritten.
    pub dup: TensorRef,
    /// The gradient of the forward's output.
    pub dout: TensorRef,
    /// The forward's gate input.
    pub gate: TensorRef,
    /// The forward's up input.
    pub up: TensorRef,
}

impl Signature for SwiGluBackward {
    const NAME: &'static str = "swiglu-backward";
    /// Elements.
    type Shape = usize;

    fn shape(&self) -> Result<usize, KernelError> {
        Ok(self.dout.len)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, n) = (DtypeRule::Working, LenRule::Len(self.dout.len));
        each(Param::write("dgate", &self.dgate, w, n));
        each(Param::write("dup", &self.dup, w, n));
        each(Param::read("dout", &self.dout, w, n));
        each(Param::read("gate", &self.gate, w, n));
        each(Param::read("up", &self.up, w, n));
    }

    fn flops(&self) -> f64 {
        14.0 * self.dout.len as f64
    }
}

impl CpuKernel for SwiGluBackward {
    fn run_cpu(
        &self,
        _: &usize,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let (dgate, dup) = (t.f32_mut(&self.dgate), t.f32_mut(&self.dup));
        let (dout, gate, up) = (t.f32(&self.dout), t.f32(&self.gate), t.f32(&self.up));
        swiglu_backward(cpu, dgate, dup, dout, gate, up);
        Ok(())
    }
}

impl CudaKernel for SwiGluBackward {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[SWIGLU_BACKWARD];

    fn launch(&self, &n: &usize, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        // swiglu_backward_<T>(T* dgate, T* dup, const T* dout, const T* gate, const T* up,
        // long long n).
        let args = [
            q.ptr(&self.dgate),
            q.ptr(&self.dup),
            q.ptr(&self.dout),
            q.ptr(&self.gate),
            q.ptr(&self.up),
            long(n),
        ];
        Ok(q.launch(SWIGLU_BACKWARD, per_element(n), &args)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::launch::tests::{Emulated, Layout};
    use crate::program::Dtype;

    impl Emulated for SwiGlu {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            [4097, 0]
                .map(|len| SwiGlu {
                    out: l.tensor(len, w),
                    gate: l.tensor(len, w),
                    up: l.tensor(len, w),
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            vec![("n", self.out.len)]
        }
    }

    impl Emulated for SwiGluBackward {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            [4097, 0]
                .map(|len| SwiGluBackward {
                    dgate: l.tensor(len, w),
                    dup: l.tensor(len, w),
                    dout: l.tensor(len, w),
                    gate: l.tensor(len, w),
                    up: l.tensor(len, w),
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            vec![("n", self.dout.len)]
        }
    }
}
