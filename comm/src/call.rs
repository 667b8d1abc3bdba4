//! What one rank says about a collective call before any data moves (which collective,
//! its lengths, its root), and the check every rank runs on all ranks' descriptions.
//!
//! Every transport exchanges these descriptions first (the thread group through its
//! shared state, MPI through one small allgather) and runs [`check_calls`] on the same
//! list in rank order, so a mismatch becomes the same error on every rank instead of a
//! hang, a truncated message or silently wrong data. Holds no data movement itself.

use crate::CommError;

/// The collectives of [`Collective`](crate::Collective).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    AllGather,
    ReduceScatterSum,
    AllReduceSumF64,
    Broadcast,
    Barrier,
}

impl Op {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::AllGather => "all_gather",
            Op::ReduceScatterSum => "reduce_scatter_sum",
            Op::AllReduceSumF64 => "all_reduce_sum_f64",
            Op::Broadcast => "broadcast",
            Op::Barrier => "barrier",
        }
    }

    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    fn code(self) -> u64 {
        match self {
            Op::AllGather => 1,
            Op::ReduceScatterSum => 2,
            Op::AllReduceSumF64 => 3,
            Op::Broadcast => 4,
            Op::Barrier => 5,
        }
    }

    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    fn from_code(code: u64) -> Option<Op> {
        [
            Op::AllGather,
            Op::ReduceScatterSum,
            Op::AllReduceSumF64,
            Op::Broadcast,
            Op::Barrier,
        ]
        .into_iter()
        .find(|op| op.code() == code)
    }
}

/// One rank's description of one collective call.
///
/// `len` must be equal on every rank; `local_len` is this rank's other buffer, which must
/// be `size * len` where the collective has one (0 otherwise).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Call {
    pub(crate) op: Op,
    /// all_gather: send bytes; reduce_scatter_sum: acc elements; all_reduce_sum_f64:
    /// values; broadcast: bytes; barrier: 0.
    pub(crate) len: usize,
    /// all_gather: recv bytes; reduce_scatter_sum: send elements; otherwise 0.
    pub(crate) local_len: usize,
    /// broadcast's root; otherwise 0.
    pub(crate) root: usize,
}

/// How many `u64` words one [`Call`] takes on the wire.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) const CALL_WORDS: usize = 4;

impl Call {
    pub(crate) fn all_gather(send_bytes: usize, recv_bytes: usize) -> Call {
        Call {
            op: Op::AllGather,
            len: send_bytes,
            local_len: recv_bytes,
            root: 0,
        }
    }

    pub(crate) fn reduce_scatter_sum(send_len: usize, acc_len: usize) -> Call {
        Call {
            op: Op::ReduceScatterSum,
            len: acc_len,
            local_len: send_len,
            root: 0,
        }
    }

    pub(crate) fn all_reduce_sum_f64(len: usize) -> Call {
        Call {
            op: Op::AllReduceSumF64,
            len,
            local_len: 0,
            root: 0,
        }
    }

    pub(crate) fn broadcast(root: usize, len_bytes: usize) -> Call {
        Call {
            op: Op::Broadcast,
            len: len_bytes,
            local_len: 0,
            root,
        }
    }

    pub(crate) fn barrier() -> Call {
        Call {
            op: Op::Barrier,
            len: 0,
            local_len: 0,
            root: 0,
        }
    }

    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn to_words(self) -> [u64; CALL_WORDS] {
        [
            self.op.code(),
            self.len as u64,
            self.local_len as u64,
            self.root as u64,
        ]
    }

    /// `None` for words no [`Call::to_words`] wrote (a peer built from other code).
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn from_words(words: &[u64]) -> Option<Call> {
        let [op, len, local_len, root] = words else {
            return None;
        };
        Some(Call {
            op: Op::from_code(*op)?,
            len: usize::try_from(*len).ok()?,
            local_len: usize::try_from(*local_len).ok()?,
            root: usize::try_from(*root).ok()?,
        })
    }
}

/// Checks all ranks' calls (`calls[p]` is rank p's) against each other. A pure function
/// of its input: every rank, given the same list, returns the same verdict.
pub(crate) fn check_calls(calls: &[Call]) -> Result<(), CommError> {
    let size = calls.len();
    let first = calls[0];
    let op = first.op.name();
    if calls.iter().any(|c| c.op != first.op) {
        return Err(CommError::OpMismatch {
            ops: calls.iter().map(|c| c.op.name()).collect(),
        });
    }
    let (len_what, unit) = match first.op {
        Op::AllGather => ("send lengths", "bytes"),
        Op::ReduceScatterSum => ("acc lengths", "f32 elements"),
        Op::AllReduceSumF64 => ("lengths", "f64 elements"),
        Op::Broadcast => ("buffer lengths", "bytes"),
        Op::Barrier => return Ok(()),
    };
    if calls.iter().any(|c| c.len != first.len) {
        let lens: Vec<usize> = calls.iter().map(|c| c.len).collect();
        return Err(CommError::LengthMismatch {
            op,
            detail: format!("{len_what} differ across ranks: {lens:?} {unit} in rank order"),
        });
    }
    if first.op == Op::Broadcast && calls.iter().any(|c| c.root != first.root || c.root >= size) {
        return Err(CommError::InvalidRoot {
            op,
            roots: calls.iter().map(|c| c.root).collect(),
            size,
        });
    }
    let (local_what, len_name) = match first.op {
        Op::AllGather => ("recv", "send"),
        Op::ReduceScatterSum => ("send", "acc"),
        Op::AllReduceSumF64 | Op::Broadcast | Op::Barrier => return Ok(()),
    };
    for (rank, call) in calls.iter().enumerate() {
        // A product that overflows cannot equal any buffer's length.
        if size.checked_mul(call.len) != Some(call.local_len) {
            return Err(CommError::LengthMismatch {
                op,
                detail: format!(
                    "rank {rank}'s {local_what} has {} {unit}, must be size ({size}) x {len_name} ({}) = {}",
                    call.local_len,
                    call.len,
                    size.saturating_mul(call.len),
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip() {
        for call in [
            Call::all_gather(3, 9),
            Call::reduce_scatter_sum(8, 4),
            Call::all_reduce_sum_f64(2),
            Call::broadcast(1, 5),
            Call::barrier(),
        ] {
            assert_eq!(Call::from_words(&call.to_words()), Some(call));
        }
        assert_eq!(Call::from_words(&[99, 0, 0, 0]), None);
        assert_eq!(Call::from_words(&[1, 0, 0]), None);
    }

    #[test]
    fn verdicts() {
        assert_eq!(
            check_calls(&[Call::all_gather(2, 4), Call::all_gather(2, 4)]),
            Ok(())
        );
        let e = check_calls(&[Call::all_gather(2, 4), Call::all_gather(3, 6)]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "all_gather: send lengths differ across ranks: [2, 3] bytes in rank order"
        );
        let e = check_calls(&[Call::all_gather(2, 4), Call::all_gather(2, 5)]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "all_gather: rank 1's recv has 5 bytes, must be size (2) x send (2) = 4"
        );
        let e = check_calls(&[
            Call::reduce_scatter_sum(6, 2),
            Call::reduce_scatter_sum(4, 2),
        ]);
        assert!(matches!(
            e,
            Err(CommError::LengthMismatch {
                op: "reduce_scatter_sum",
                ..
            })
        ));
        let e = check_calls(&[Call::barrier(), Call::all_gather(0, 0)]).unwrap_err();
        assert_eq!(
            e,
            CommError::OpMismatch {
                ops: vec!["barrier", "all_gather"]
            }
        );
        let e = check_calls(&[Call::broadcast(2, 1), Call::broadcast(2, 1)]).unwrap_err();
        assert_eq!(
            e,
            CommError::InvalidRoot {
                op: "broadcast",
                roots: vec![2, 2],
                size: 2
            }
        );
        let e = check_calls(&[Call::broadcast(0, 1), Call::broadcast(1, 1)]);
        assert!(matches!(e, Err(CommError::InvalidRoot { .. })));
        let huge = Call::all_gather(usize::MAX, 0);
        assert!(check_calls(&[huge, huge]).is_err());
    }
}
