//! Plain scalar references for the collectives, written per element in the most obvious
//! way: what every transport is checked against bit for bit (the unit tests, the
//! [`crate::conformance`] check, the MPI check under `mpirun`). Not for the hot path:
//! these take every rank's input at once.

/// The reduce-scatter result rank `rank` must hold: `sends[p]` is rank p's whole send
/// buffer (`sends.len() * acc.len()` elements), chunk `rank` of it goes to `rank`.
///
/// With `accumulate`, `acc[i] = ((acc[i] + x_0[i]) + x_1[i]) + ...`; without, `acc[i] =
/// (x_0[i] + x_1[i]) + ...` (from `x_0`, no added zero).
///
/// # Panics
/// When a send buffer's length is not `sends.len() * acc.len()` or `rank` is out of range.
pub fn reduce_scatter_sum(rank: usize, sends: &[&[f32]], acc: &mut [f32], accumulate: bool) {
    let m = acc.len();
    assert!(rank < sends.len());
    for send in sends {
        assert_eq!(send.len(), sends.len() * m);
    }
    for (i, a) in acc.iter_mut().enumerate() {
        let mut sum = if accumulate {
            *a + sends[0][rank * m + i]
        } else {
            sends[0][rank * m + i]
        };
        for send in &sends[1..] {
            sum += send[rank * m + i];
        }
        *a = sum;
    }
}

/// The all-reduce result: `values[i] = (x_0[i] + x_1[i]) + ...` with `x_p = inputs[p]`.
///
/// # Panics
/// When `inputs` is empty or the inputs' lengths differ.
pub fn all_reduce_sum_f64(inputs: &[&[f64]]) -> Vec<f64> {
    let mut out = inputs[0].to_vec();
    for x in &inputs[1..] {
        assert_eq!(x.len(), out.len());
        for (o, v) in out.iter_mut().zip(x.iter()) {
            *o += v;
        }
    }
    out
}

/// The all-gather result: every input concatenated in rank order.
pub fn all_gather(inputs: &[&[u8]]) -> Vec<u8> {
    inputs.concat()
}
