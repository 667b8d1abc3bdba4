//! The scalar reference of the SwiGLU gate (`super`).
//!
//! Plain scalar loops, generic over [`Real`] so that the same code checks the fast
//! kernels in f32 and backward passes against finite differences in f64; nothing here is
//! tuned. Conventions are the fast kernels': row-major tensors, forward kernels
//! overwrite, backward kernels accumulate (`+=`) into parameter gradients.
#![allow(clippy::needless_range_loop)]

use crate::reference::{Real, r};

/// out: (N) = `silu(gate) * up`, with `silu(x) = x / (1 + e^-x)`; gate, up: (N).
pub fn swiglu_forward<R: Real>(out: &mut [R], gate: &[R], up: &[R]) {
    assert_eq!((gate.len(), up.len()), (out.len(), out.len()));
    for i in 0..out.len() {
        let g = gate[i];
        out[i] = g / (r::<R>(1.0) + (-g).exp()) * up[i];
    }
}

/// dgate: (N) =  dup: (N) =  dout: (N)  gate, up: (N) the forward's inputs.
/// `dup = silu(gate) dout`, `dgate = silu'(gate) up dout` with
/// `silu'(x) = s (1 + x (1 - s))`, `s = sigmoid(x)`.
pub fn swiglu_backward<R: Real>(dgate: &mut [R], dup: &mut [R], dout: &[R], gate: &[R], up: &[R]) {
    let n = dout.len();
    assert_eq!((dgate.len(), dup.len(), gate.len(), up.len()), (n, n, n, n));
    for i in 0..n {
        let g = gate[i];
        let s = r::<R>(1.0) / (r::<R>(1.0) + (-g).exp());
        dup[i] = g * s * dout[i];
        dgate[i] = s * (r::<R>(1.0) + g * (r::<R>(1.0) - s)) * up[i] * dout[i];
    }
}
