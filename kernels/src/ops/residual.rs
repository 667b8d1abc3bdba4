//! The residual connection: elementwise addition.

use super::simd::{self, on_isa};
use super::{Cpu, par_chunks};

/// out: (N)  a: (N)  b: (N).  `out = a + b`. Its backward passes `dout` to both inputs,
/// which callers do by reusing or adding `dout` ([`add_inplace`]).
pub fn residual_forward(cpu: &Cpu, out: &mut [f32], a: &[f32], b: &[f32]) {
    assert_eq!((a.len(), b.len()), (out.len(), out.len()));
    par_chunks(cpu, out, simd::LANES, |r, out| {
        let (a, b) = (&a[r.clone()], &b[r]);
        on_isa!(cpu.isa, {
            for i in 0..out.len() {
                out[i] = a[i] + b[i];
            }
        })
    });
}

/// dst: (N) +=  src: (N).
pub fn add_inplace(cpu: &Cpu, dst: &mut [f32], src: &[f32]) {
    assert_eq!(src.len(), dst.len());
    par_chunks(cpu, dst, simd::LANES, |r, dst| {
        on_isa!(cpu.isa, simd::add_assign(dst, &src[r]))
    });
}
