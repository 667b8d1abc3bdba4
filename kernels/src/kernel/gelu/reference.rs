//! The scalar reference of GELU (`super`), in its tanh form: `0.5 x (1 + tanh(u))`.
//!
//! Plain scalar loops, generic over [`Real`] so that the same code checks the fast
//! kernels in f32 and backward passes against finite differences in f64; nothing here is
//! tuned. Conventions are the fast kernels': row-major tensors, forward kernels
//! overwrite, backward kernels accumulate (`+=`) into parameter gradients.
#![allow(clippy::needless_range_loop)]

use super::GELU_SCALE;
use crate::reference::{Real, r};

/// out: (N)  inp: (N).  `out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub fn gelu_forward<R: Real>(out: &mut [R], inp: &[R]) {
    assert_eq!(out.len(), inp.len());
    for (o, &x) in out.iter_mut().zip(inp) {
        let inner = r::<R>(GELU_SCALE) * (x + r::<R>(0.044715) * x * x * x);
        *o = r::<R>(0.5) * x * (r::<R>(1.0) + inner.tanh());
    }
}

/// dinp: (N) =  inp: (N) the forward input  dout: (N).
pub fn gelu_backward<R: Real>(dinp: &mut [R], inp: &[R], dout: &[R]) {
    assert_eq!(dinp.len(), inp.len());
    assert_eq!(dout.len(), inp.len());
    for i in 0..inp.len() {
        let x = inp[i];
        let inner = r::<R>(GELU_SCALE) * (x + r::<R>(0.044715) * x * x * x);
        let th = inner.tanh();
        let sech2 = r::<R>(1.0) - th * th;
        let dinner = r::<R>(GELU_SCALE) * (r::<R>(1.0) + r::<R>(3.0 * 0.044715) * x * x);
        let grad = r::<R>(0.5) * (r::<R>(1.0) + th) + r::<R>(0.5) * x * sech2 * dinner;
        dinp[i] = grad * dout[i];
    }
}
