//! The check every transport must pass: each collective on odd lengths, against the plain
//! references in [`crate::reference`], bit for bit, then the errors every rank must see
//! together. Every rank runs [`check`] with the same seed; each computes every rank's
//! input from the seed, so it knows the exact expected result without extra messages.
//!
//! The unit tests run it on [`Solo`](crate::Solo) and [`ThreadGroup`](crate::ThreadGroup);
//! `examples/mpi_check.rs` runs it under `mpirun`. Not a benchmark.

use crate::{Collective, CommError, reference};

/// Lengths (elements per rank's chunk, or bytes) that hit empty, single and tail cases.
const LENGTHS: [usize; 5] = [0, 1, 7, 22, 4097];

/// What the check ran, when everything matched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckReport {
    /// How many collective calls it made.
    pub call_count: usize,
    /// How many results it compared with the reference (bit for bit).
    pub compared_count: usize,
}

/// Runs every collective of `comm` on seeded inputs and compares each result with the
/// reference, then checks that mismatched calls fail on every rank and leave the group
/// usable. Every rank of the group must call it with the same `seed`.
///
/// Returns a description of the first difference, naming the rank, collective, length
/// and element.
pub fn check(comm: &dyn Collective, seed: u64) -> Result<CheckReport, String> {
    let (rank, size) = (comm.rank(), comm.size());
    let mut report = CheckReport {
        call_count: 0,
        compared_count: 0,
    };
    let fail = |what: String| format!("rank {rank} of {size}: {what}");
    let comm_err = |op: &str, e: CommError| fail(format!("{op} failed: {e}"));

    for (li, &m) in LENGTHS.iter().enumerate() {
        let salt = seed ^ ((li as u64) << 32);

        // all_gather, m bytes per rank.
        let inputs: Vec<Vec<u8>> = (0..size).map(|p| input_bytes(salt, p, m)).collect();
        let mut recv = vec![0xa5u8; size * m];
        comm.all_gather(&inputs[rank], &mut recv)
            .map_err(|e| comm_err("all_gather", e))?;
        report.call_count += 1;
        let views: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
        if let Some(i) = first_difference(&recv, &reference::all_gather(&views)) {
            return Err(fail(format!("all_gather of {m} bytes differs at byte {i}")));
        }
        report.compared_count += 1;

        // reduce_scatter_sum, m elements per chunk, both modes.
        for accumulate in [false, true] {
            let sends: Vec<Vec<f32>> = (0..size)
                .map(|p| input_f32(salt ^ 1, p, size * m, m))
                .collect();
            let start = input_f32(salt ^ 2, rank, m, m);
            let mut acc = start.clone();
            comm.reduce_scatter_sum(&sends[rank], &mut acc, accumulate)
                .map_err(|e| comm_err("reduce_scatter_sum", e))?;
            report.call_count += 1;
            let mut expected = start;
            let views: Vec<&[f32]> = sends.iter().map(Vec::as_slice).collect();
            reference::reduce_scatter_sum(rank, &views, &mut expected, accumulate);
            let (got, want) = (bits_f32(&acc), bits_f32(&expected));
            if let Some(i) = first_difference(&got, &want) {
                return Err(fail(format!(
                    "reduce_scatter_sum (accumulate={accumulate}, {m} elements) differs at element {i}: got {:e} ({:#010x}), expected {:e} ({:#010x})",
                    acc[i], got[i], expected[i], want[i]
                )));
            }
            report.compared_count += 1;
        }

        // all_reduce_sum_f64, m values.
        let inputs: Vec<Vec<f64>> = (0..size).map(|p| input_f64(salt ^ 3, p, m)).collect();
        let mut values = inputs[rank].clone();
        comm.all_reduce_sum_f64(&mut values)
            .map_err(|e| comm_err("all_reduce_sum_f64", e))?;
        report.call_count += 1;
        let views: Vec<&[f64]> = inputs.iter().map(Vec::as_slice).collect();
        let expected = reference::all_reduce_sum_f64(&views);
        let (got, want) = (bits_f64(&values), bits_f64(&expected));
        if let Some(i) = first_difference(&got, &want) {
            return Err(fail(format!(
                "all_reduce_sum_f64 of {m} values differs at element {i}: got {:e}, expected {:e}",
                values[i], expected[i]
            )));
        }
        report.compared_count += 1;

        // broadcast from every root.
        for root in 0..size {
            let payload = input_bytes(salt ^ 4, root, m);
            let mut buf = if rank == root {
                payload.clone()
            } else {
                vec![0x5au8; m]
            };
            comm.broadcast(root, &mut buf)
                .map_err(|e| comm_err("broadcast", e))?;
            report.call_count += 1;
            if let Some(i) = first_difference(&buf, &payload) {
                return Err(fail(format!(
                    "broadcast of {m} bytes from root {root} differs at byte {i}"
                )));
            }
            report.compared_count += 1;
        }

        comm.barrier().map_err(|e| comm_err("barrier", e))?;
        report.call_count += 1;
    }

    // Mismatches: every rank must get the error from the same call, and the group must
    // still work afterwards. The last rank is the odd one out.
    let odd = rank == size - 1;
    let send = vec![1u8; 4 + usize::from(odd && size > 1)];
    let mut recv = vec![0u8; size * send.len() + usize::from(odd && size == 1)];
    expect_error(
        comm.all_gather(&send, &mut recv),
        "all_gather with a different length",
        &fail,
        |e| {
            matches!(
                e,
                CommError::LengthMismatch {
                    op: "all_gather",
                    ..
                }
            )
        },
    )?;
    let send = vec![1.0f32; size * 3 + usize::from(odd)];
    let mut acc = vec![0.0f32; 3];
    expect_error(
        comm.reduce_scatter_sum(&send, &mut acc, false),
        "reduce_scatter_sum with a send of the wrong length",
        &fail,
        |e| {
            matches!(
                e,
                CommError::LengthMismatch {
                    op: "reduce_scatter_sum",
                    ..
                }
            )
        },
    )?;
    let mut buf = [0u8; 2];
    expect_error(
        comm.broadcast(size, &mut buf),
        "broadcast from a root outside the group",
        &fail,
        |e| matches!(e, CommError::InvalidRoot { .. }),
    )?;
    report.call_count += 3;
    comm.barrier()
        .map_err(|e| comm_err("barrier after the mismatches", e))?;
    report.call_count += 1;
    Ok(report)
}

fn expect_error(
    result: Result<(), CommError>,
    what: &str,
    fail: &impl Fn(String) -> String,
    expected: impl Fn(&CommError) -> bool,
) -> Result<(), String> {
    match result {
        Err(e) if expected(&e) => Ok(()),
        Err(e) => Err(fail(format!("{what} gave the wrong error: {e}"))),
        Ok(()) => Err(fail(format!(
            "{what} succeeded; every rank must get an error"
        ))),
    }
}

fn first_difference<T: PartialEq>(got: &[T], want: &[T]) -> Option<usize> {
    if got.len() != want.len() {
        return Some(got.len().min(want.len()));
    }
    got.iter().zip(want).position(|(g, w)| g != w)
}

fn bits_f32(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

fn bits_f64(values: &[f64]) -> Vec<u64> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// SplitMix64: a seeded generator small enough to live here, so every rank (and every
/// process) derives every rank's input from `(seed, rank)` alone.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn generator(seed: u64, rank: usize) -> u64 {
    let mut state = seed ^ (rank as u64).wrapping_mul(0xd6e8_feb8_6659_fd93);
    splitmix64(&mut state)
}

/// Rank `rank`'s bytes.
pub(crate) fn input_bytes(seed: u64, rank: usize, len: usize) -> Vec<u8> {
    let mut state = generator(seed, rank);
    (0..len).map(|_| splitmix64(&mut state) as u8).collect()
}

/// Rank `rank`'s f32s, mostly values whose sum depends on the order of the adds (1e8
/// beside 1.0 beside -1e8), and `-0.0` at the start of every chunk of `chunk_len`, so a
/// fold that starts from `+0.0` instead of the first term shows.
pub(crate) fn input_f32(seed: u64, rank: usize, len: usize, chunk_len: usize) -> Vec<f32> {
    const TRICKY: [f32; 10] = [
        1e8,
        -1e8,
        1.0,
        -1.0,
        0.5,
        3.0e-8,
        16_777_216.0,
        -0.0,
        0.0,
        1e-30,
    ];
    let mut state = generator(seed, rank);
    (0..len)
        .map(|i| {
            let r = splitmix64(&mut state);
            if chunk_len > 0 && i.is_multiple_of(chunk_len) {
                -0.0
            } else if r.is_multiple_of(4) {
                ((r >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
            } else {
                TRICKY[(r >> 8) as usize % TRICKY.len()]
            }
        })
        .collect()
}

/// Rank `rank`'s f64s, with large and small values so the order of the adds shows.
pub(crate) fn input_f64(seed: u64, rank: usize, len: usize) -> Vec<f64> {
    const TRICKY: [f64; 6] = [1e16, -1e16, 1.0, -1.0, 0.25, 3.0e-17];
    let mut state = generator(seed, rank);
    (0..len)
        .map(|_| {
            let r = splitmix64(&mut state);
            if r.is_multiple_of(3) {
                (r >> 11) as f64 / (1u64 << 53) as f64
            } else {
                TRICKY[(r >> 8) as usize % TRICKY.len()]
            }
        })
        .collect()
}
