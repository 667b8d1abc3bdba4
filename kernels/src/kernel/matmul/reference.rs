//! The scalar reference of the linear layers (`super`): the products as triple loops.
//!
//! Plain scalar loops, generic over [`Real`] so that the same code checks the fast
//! kernels in f32 and backward passes against finite differences in f64; nothing here is
//! tuned. Conventions are the fast kernels': row-major tensors, forward kernels
//! overwrite, backward kernels accumulate (`+=`) into parameter gradients.
#![allow(clippy::needless_range_loop)]

use super::cpu::WeightLayout;
use crate::reference::Real;

/// The weight element that multiplies input channel `i` into output channel `o`.
fn weight_at<R: Real>(
    weight: &[R],
    layout: WeightLayout,
    i: usize,
    o: usize,
    c: usize,
    oc: usize,
) -> R {
    match layout {
        WeightLayout::InOut => weight[i * oc + o],
        WeightLayout::OutIn => weight[o * c + i],
    }
}

/// out: (N, OC)  inp: (N, C)  weight: (C, OC) for [`WeightLayout::InOut`] or (OC, C) for
/// [`WeightLayout::OutIn`]  bias: (OC) or none.  `out = inp @ W + bias`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward<R: Real>(
    out: &mut [R],
    inp: &[R],
    weight: &[R],
    bias: Option<&[R]>,
    layout: WeightLayout,
    n: usize,
    c: usize,
    oc: usize,
) {
    assert_eq!(out.len(), n * oc);
    assert_eq!(inp.len(), n * c);
    assert_eq!(weight.len(), c * oc);
    for row in 0..n {
        for o in 0..oc {
            let mut acc = bias.map_or(R::default(), |b| b[o]);
            for i in 0..c {
                acc += inp[row * c + i] * weight_at(weight, layout, i, o, c, oc);
            }
            out[row * oc + o] = acc;
        }
    }
}

/// dinp: (N, C) =  dweight: shaped as weight, +=  dbias: (OC) +=  dout: (N, OC)
/// inp: (N, C)  weight: as in [`matmul_forward`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward<R: Real>(
    dinp: &mut [R],
    dweight: &mut [R],
    dbias: Option<&mut [R]>,
    dout: &[R],
    inp: &[R],
    weight: &[R],
    layout: WeightLayout,
    n: usize,
    c: usize,
    oc: usize,
) {
    assert_eq!(dinp.len(), n * c);
    assert_eq!(dweight.len(), c * oc);
    for row in 0..n {
        for i in 0..c {
            let mut acc = R::default();
            for o in 0..oc {
                acc += dout[row * oc + o] * weight_at(weight, layout, i, o, c, oc);
            }
            dinp[row * c + i] = acc;
        }
    }
    for i in 0..c {
        for o in 0..oc {
            let mut acc = R::default();
            for row in 0..n {
                acc += inp[row * c + i] * dout[row * oc + o];
            }
            match layout {
                WeightLayout::InOut => dweight[i * oc + o] += acc,
                WeightLayout::OutIn => dweight[o * c + i] += acc,
            }
        }
    }
    if let Some(dbias) = dbias {
        for o in 0..oc {
            for row in 0..n {
                dbias[o] += dout[row * oc + o];
            }
        }
    }
}
