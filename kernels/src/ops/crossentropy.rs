//! Softmax cross-entropy over the vocabulary, per position.

use super::simd::on_isa;
use super::{Cpu, RowsMut, par_rows, simd};
use crate::program::IGNORE_TARGET;

/// losses: (N)  logits: (N, V)  targets: (N).
/// `losses[n] = log(sum(exp(logits[n]))) - logits[n, targets[n]]`, 0 where `targets[n]`
/// is [`IGNORE_TARGET`]. Panics on another target outside `0..V`.
pub fn crossentropy_forward(
    cpu: &Cpu,
    losses: &mut [f32],
    logits: &[f32],
    targets: &[u32],
    n: usize,
    v: usize,
) {
    assert_eq!(logits.len(), n * v);
    assert_eq!((losses.len(), targets.len()), (n, n));
    par_rows(
        cpu.threads_for(n * v),
        n,
        1,
        RowsMut::new(losses, 1),
        |rows, losses| {
            on_isa!(cpu.isa, {
                for (i, row) in rows.enumerate() {
                    let l = &logits[row * v..][..v];
                    if targets[row] == IGNORE_TARGET {
                        losses.data[i] = 0.0;
                        continue;
                    }
                    let target = targets[row] as usize;
                    assert!(
                        target < v,
                        "target {target} at {row} outside vocabulary {v}"
                    );
                    let max = simd::max(l);
                    let sum = simd::exp_shifted_sum(l, max);
                    losses.data[i] = sum.ln() + max - l[target];
                }
            },)
        },
    );
}

/// logits: (N, V), replaced by dlogits  targets: (N)  dloss: the gradient of the final
/// loss with respect to each position's loss (1/N for the mean).
/// `dlogits[n] = (softmax(logits[n]) - onehot(targets[n])) * dloss`, in place, so the
/// largest activation of the model is not held twice; zero where `targets[n]` is
/// [`IGNORE_TARGET`].
pub fn crossentropy_backward_inplace(
    cpu: &Cpu,
    logits: &mut [f32],
    targets: &[u32],
    dloss: f32,
    n: usize,
    v: usize,
) {
    assert_eq!(logits.len(), n * v);
    assert_eq!(targets.len(), n);
    par_rows(
        cpu.threads_for(n * v),
        n,
        1,
        RowsMut::new(logits, v),
        |rows, logits| {
            on_isa!(cpu.isa, {
                for (row, l) in rows.zip(logits.data.chunks_exact_mut(v)) {
                    if targets[row] == IGNORE_TARGET {
                        l.fill(0.0);
                        continue;
                    }
                    let target = targets[row] as usize;
                    assert!(
                        target < v,
                        "target {target} at {row} outside vocabulary {v}"
                    );
                    let max = simd::max(l);
                    let sum = simd::exp_shifted_in_place(l, max);
                    simd::scale_in_place(l, dloss / sum);
                    l[target] -= dloss;
                }
            },)
        },
    );
}
