//! The scalar reference of the softmax cross-entropy (`super`).
//!
//! Plain scalar loops, generic over [`Real`] so that the same code checks the fast
//! kernels in f32 and backward passes against finite differences in f64; nothing here is
//! tuned. Conventions are the fast kernels': row-major tensors, forward kernels
//! overwrite, backward kernels accumulate (`+=`) into parameter gradients.
#![allow(clippy::needless_range_loop)]

use super::IGNORE_TARGET;
use crate::reference::{Real, r};

/// losses: (N)  logits: (N, V)  targets: (N).
/// `losses[n] = -log softmax(logits[n])[targets[n]]`; 0 where `targets[n]` is
/// [`IGNORE_TARGET`].
pub fn crossentropy_forward<R: Real>(
    losses: &mut [R],
    logits: &[R],
    targets: &[u32],
    n: usize,
    v: usize,
) {
    assert_eq!(logits.len(), n * v);
    assert_eq!(targets.len(), n);
    for row in 0..n {
        let l = &logits[row * v..][..v];
        let max = l
            .iter()
            .copied()
            .fold(l[0], |m, x| if x > m { x } else { m });
        let mut sum = R::default();
        for &x in l {
            sum += (x - max).exp();
        }
        losses[row] = if targets[row] == IGNORE_TARGET {
            R::default()
        } else {
            sum.ln() + max - l[targets[row] as usize]
        };
    }
}

/// dlogits: (N, V) =  logits: (N, V)  targets: (N)  dloss: the gradient of the final loss
/// with respect to each position's loss (1/N for the mean).
/// `dlogits[n] = (softmax(logits[n]) - onehot(targets[n])) * dloss`; 0 where
/// `targets[n]` is [`IGNORE_TARGET`].
pub fn crossentropy_backward<R: Real>(
    dlogits: &mut [R],
    logits: &[R],
    targets: &[u32],
    dloss: R,
    n: usize,
    v: usize,
) {
    assert_eq!(dlogits.len(), n * v);
    for row in 0..n {
        let l = &logits[row * v..][..v];
        let max = l
            .iter()
            .copied()
            .fold(l[0], |m, x| if x > m { x } else { m });
        let mut sum = R::default();
        for &x in l {
            sum += (x - max).exp();
        }
        let d = &mut dlogits[row * v..][..v];
        if targets[row] == IGNORE_TARGET {
            d.fill(R::default());
            continue;
        }
        for i in 0..v {
            let p = (l[i] - max).exp() / sum;
            let onehot = if i == targets[row] as usize {
                r(1.0)
            } else {
                R::default()
            };
            d[i] = (p - onehot) * dloss;
        }
    }
}
