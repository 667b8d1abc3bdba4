//! The fixed-order sums every transport ends with: rank 0's contribution first, then
//! rank 1's, and so on, each a plain f32 (or f64) add. The same order on every transport
//! and every rank is what makes N ranks bit-identical to one process that accumulates N
//! micro-batch gradients as a left fold. The plain per-element version of each stays in
//! [`crate::reference`]; these loop rank by rank (one streaming pass over each chunk)
//! but perform, for every element, exactly the same adds in the same order.

/// `acc: (m)`, `chunk(p): (m)` for `p in 0..count`, in rank order.
///
/// With `accumulate`, `acc[i] = ((acc[i] + x_0[i]) + x_1[i]) + ...`; without,
/// `acc[i] = (x_0[i] + x_1[i]) + ...`, starting from `x_0` itself (no added zero, so
/// `-0.0` survives).
pub(crate) fn fold_f32<'a>(
    acc: &mut [f32],
    accumulate: bool,
    count: usize,
    chunk: impl Fn(usize) -> &'a [f32],
) {
    debug_assert!(count >= 1);
    let mut first = 0;
    if !accumulate {
        acc.copy_from_slice(chunk(0));
        first = 1;
    }
    for p in first..count {
        let x = chunk(p);
        debug_assert_eq!(x.len(), acc.len());
        for (a, &v) in acc.iter_mut().zip(x) {
            *a += v;
        }
    }
}

/// `values: (m)`, `chunk(p): (m)` for `p in 0..count`, in rank order:
/// `values[i] = (x_0[i] + x_1[i]) + ...`.
pub(crate) fn fold_f64<'a>(values: &mut [f64], count: usize, chunk: impl Fn(usize) -> &'a [f64]) {
    debug_assert!(count >= 1);
    values.copy_from_slice(chunk(0));
    for p in 1..count {
        for (a, &v) in values.iter_mut().zip(chunk(p)) {
            *a += v;
        }
    }
}
