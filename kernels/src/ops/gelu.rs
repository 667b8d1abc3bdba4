//! GELU with GPT-2's tanh approximation ("gelu_new"), forward and backward.
//!
//! Computed through the identity 0.5 (1 + tanh(u)) = sigmoid(2u), which keeps full
//! relative precision for large negative inputs, where 1 + tanh(u) cancels.

use super::simd::{self, on_isa};
use super::{Cpu, par_chunks};
use crate::reference::gpt2::GELU_SCALE;

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
