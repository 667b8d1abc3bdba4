//! GELU with GPT-2's tanh approximation ("gelu_new"), forward and backward: the kernels'
//! signatures, CPU ops and CUDA launches; `gelu.cu` holds the CUDA kernels, [`reference`](mod@reference)
//! the scalar reference.
//!
//! Computed through the identity 0.5 (1 + tanh(u)) = sigmoid(2u), which keeps full
//! relative precision for large negative inputs, where 1 + tanh(u) cancels.

use crate::cuda::launch::{CudaKernel, CudaSource, Entry, Launch, long, per_element};
use crate::ops::simd::{self, on_isa};
use crate::ops::{Cpu, par_chunks};
use crate::program::{
    CpuKernel, CpuTensors, DtypeRule, KernelError, LenRule, Param, Scalars, Signature, TensorRef,
};

pub mod reference;

/// sqrt(2 / pi), the constant of GPT-2's tanh-approximated GELU.
pub const GELU_SCALE: f64 = 0.797_884_560_802_865_4;

const S: f32 = GELU_SCALE as f32;
const A: f32 = 0.044715;

/// out: (N)  inp: (N).  `out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub fn gelu_forward(cpu: &Cpu, out: &mut [f32], inp: &[f32]) {
    assert_eq!(inp.len(), out.len());
    par_chunks(cpu, out, simd::LANES, |r, out| {
        on_isa!(cpu.isa, {
            for (o, &x) in out.iter_mut().zip(&inp[r]) {
                *o = x * simd::sigmoid(2.0 * S * (x + A * x * x * x));
            }
        })
    });
}

/// dinp: (N) =  inp: (N) the forward input  dout: (N).
pub fn gelu_backward(cpu: &Cpu, dinp: &mut [f32], inp: &[f32], dout: &[f32]) {
    assert_eq!((inp.len(), dout.len()), (dinp.len(), dinp.len()));
    par_chunks(cpu, dinp, simd::LANES, |r, dinp| {
        let (inp, dout) = (&inp[r.clone()], &dout[r]);
        on_isa!(cpu.isa, {
            for i in 0..dinp.len() {
                let x = inp[i];
                // With s = sigmoid(2u): d/dx [x s] = s + x * 2 s (1 - s) * du/dx.
                let s = simd::sigmoid(2.0 * S * (x + A * x * x * x));
                let grad = s + 2.0 * x * s * (1.0 - s) * S * (1.0 + 3.0 * A * x * x);
                dinp[i] = grad * dout[i];
            }
        })
    });
}

/// The family's CUDA kernels.
const SOURCE: CudaSource = ("gelu.cu", include_str!("gelu.cu"));

const GELU_FORWARD: Entry = Entry::typed("gelu_forward");
const GELU_BACKWARD: Entry = Entry::typed("gelu_backward");

/// out = gelu(inp) (tanh approximation), elementwise.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gelu {
    /// Output.
    pub out: TensorRef,
    /// Input, same length.
    pub inp: TensorRef,
}

impl Signature for Gelu {
    const NAME: &'static str = "gelu";
    /// Elements.
    type Shape = usize;

    fn shape(&self) -> Result<usize, KernelError> {
        Ok(self.out.len)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, n) = (DtypeRule::Working, LenRule::Len(self.out.len));
        each(Param::write("out", &self.out, w, n));
        each(Param::read("inp", &self.inp, w, n));
    }

    fn flops(&self) -> f64 {
        10.0 * self.out.len as f64
    }
}

impl CpuKernel for Gelu {
    fn run_cpu(
        &self,
        _: &usize,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        gelu_forward(cpu, t.f32_mut(&self.out), t.f32(&self.inp));
        Ok(())
    }
}

impl CudaKernel for Gelu {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[GELU_FORWARD];

    fn launch(&self, &n: &usize, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        // gelu_forward_<T>(T* out, const T* inp, long long n).
        let args = [q.ptr(&self.out), q.ptr(&self.inp), long(n)];
        Ok(q.launch(GELU_FORWARD, per_element(n), &args)?)
    }
}

/// dinp = gelu'(inp) * dout, elementwise.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GeluBackward {
    /// Output.
    pub dinp: TensorRef,
    /// The forward's input.
    pub inp: TensorRef,
    /// The gradient of the forward's output.
    pub dout: TensorRef,
}

impl Signature for GeluBackward {
    const NAME: &'static str = "gelu-backward";
    /// Elements.
    type Shape = usize;

    fn shape(&self) -> Result<usize, KernelError> {
        Ok(self.dinp.len)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, n) = (DtypeRule::Working, LenRule::Len(self.dinp.len));
        each(Param::write("dinp", &self.dinp, w, n));
        each(Param::read("inp", &self.inp, w, n));
        each(Param::read("dout", &self.dout, w, n));
    }

    fn flops(&self) -> f64 {
        16.0 * self.dinp.len as f64
    }
}

impl CpuKernel for GeluBackward {
    fn run_cpu(
        &self,
        _: &usize,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let dinp = t.f32_mut(&self.dinp);
        gelu_backward(cpu, dinp, t.f32(&self.inp), t.f32(&self.dout));
        Ok(())
    }
}

impl CudaKernel for GeluBackward {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[GELU_BACKWARD];

    fn launch(&self, &n: &usize, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        // gelu_backward_<T>(T* dinp, const T* inp, const T* dout, long long n).
        let args = [
            q.ptr(&self.dinp),
            q.ptr(&self.inp),
            q.ptr(&self.dout),
            long(n),
        ];
        Ok(q.launch(GELU_BACKWARD, per_element(n), &args)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::launch::tests::{Emulated, Layout};
    use crate::program::Dtype;

    impl Emulated for Gelu {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            [4097, 0]
                .map(|len| Gelu {
                    out: l.tensor(len, w),
                    inp: l.tensor(len, w),
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            vec![("n", self.out.len)]
        }
    }

    impl Emulated for GeluBackward {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            [4097, 0]
                .map(|len| GeluBackward {
                    dinp: l.tensor(len, w),
                    inp: l.tensor(len, w),
                    dout: l.tensor(len, w),
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            vec![("n", self.dinp.len)]
        }
    }
}
