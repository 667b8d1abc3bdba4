//! The scalar reference of the token and position embedding (`super`).
//!
//! Plain scalar loops, generic over [`Real`] so that the same code checks the fast
//! kernels in f32 and backward passes against finite differences in f64; nothing here is
//! tuned. Conventions are the fast kernels': row-major tensors, forward kernels
//! overwrite, backward kernels accumulate (`+=`) into parameter gradients.
#![allow(clippy::needless_range_loop)]

use crate::reference::Real;

/// out: (B, T, C)  tokens: (B, T)  wte: (V, C)  wpe: (maxT, C), maxT >= T.
/// `out[b, t] = wte[tokens[b, t]] + wpe[t]`.
pub fn encoder_forward<R: Real>(
    out: &mut [R],
    tokens: &[u32],
    wte: &[R],
    wpe: &[R],
    b: usize,
    t: usize,
    c: usize,
) {
    assert_eq!(out.len(), b * t * c);
    assert_eq!(tokens.len(), b * t);
    for bi in 0..b {
        for ti in 0..t {
            let token = tokens[bi * t + ti] as usize;
            let o = &mut out[(bi * t + ti) * c..][..c];
            for i in 0..c {
                o[i] = wte[token * c + i] + wpe[ti * c + i];
            }
        }
    }
}

/// dwte: (V, C) +=  dwpe: (maxT, C) +=  dout: (B, T, C)  tokens: (B, T).
pub fn encoder_backward<R: Real>(
    dwte: &mut [R],
    dwpe: &mut [R],
    dout: &[R],
    tokens: &[u32],
    b: usize,
    t: usize,
    c: usize,
) {
    assert_eq!(dout.len(), b * t * c);
    assert_eq!(tokens.len(), b * t);
    for bi in 0..b {
        for ti in 0..t {
            let token = tokens[bi * t + ti] as usize;
            let d = &dout[(bi * t + ti) * c..][..c];
            for i in 0..c {
                dwte[token * c + i] += d[i];
                dwpe[ti * c + i] += d[i];
            }
        }
    }
}
