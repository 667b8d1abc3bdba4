//! The scalar reference of the elementwise kernels (`super`): the residual add, the
//! elementwise product and the scaled add.
//!
//! Plain scalar loops, generic over [`Real`] so that the same code checks the fast
//! kernels in f32 and backward passes against finite differences in f64; nothing here is
//! tuned. Conventions are the fast kernels': row-major tensors, forward kernels
//! overwrite, backward kernels accumulate (`+=`) into parameter gradients.
#![allow(clippy::needless_range_loop)]

use crate::reference::Real;

/// out: (N)  a: (N)  b: (N).  `out = a + b`; its backward passes `dout` to both inputs.
pub fn residual_forward<R: Real>(out: &mut [R], a: &[R], b: &[R]) {
    assert_eq!(out.len(), a.len());
    assert_eq!(out.len(), b.len());
    for i in 0..out.len() {
        out[i] = a[i] + b[i];
    }
}

/// out: (N)  a: (N)  b: (N).  `out = a * b`.
pub fn mul_forward<R: Real>(out: &mut [R], a: &[R], b: &[R]) {
    assert_eq!(out.len(), a.len());
    assert_eq!(out.len(), b.len());
    for i in 0..out.len() {
        out[i] = a[i] * b[i];
    }
}

/// dst: (N) +=  `factor * src`: (N).
pub fn add_scaled<R: Real>(dst: &mut [R], src: &[R], factor: R) {
    assert_eq!(dst.len(), src.len());
    for i in 0..dst.len() {
        dst[i] += factor * src[i];
    }
}
