//! The comm crate's one error type. Every variant names the collective it came from and
//! what a user needs to act: the lengths each rank passed, the ranks that did not arrive,
//! the rank that aborted and why, the MPI error code.

/// Everything a collective call can fail with.
///
/// Errors that come from comparing the ranks' calls (`LengthMismatch`, `OpMismatch`,
/// `InvalidRoot`) are computed by every rank from the same data, so every rank of the
/// group returns the same error from the same call and none is left waiting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    /// Buffer lengths that disagree: across ranks (each rank passed a different length)
    /// or within one rank (a receive buffer that is not `size` times the send buffer).
    #[error("{op}: {detail}")]
    LengthMismatch {
        /// The collective (`all_gather`, `reduce_scatter_sum`, ...).
        op: &'static str,
        /// Which lengths, on which rank: "send lengths differ across ranks: [4, 4, 5]
        /// bytes in rank order".
        detail: String,
    },

    /// Ranks called different collectives at the same position of their call sequences.
    #[error(
        "ranks called different collectives at the same point (in rank order: {ops:?}); every rank must make the same collective calls in the same order"
    )]
    OpMismatch {
        /// Each rank's collective, in rank order.
        ops: Vec<&'static str>,
    },

    /// A broadcast whose root differs across ranks or is not a rank of the group.
    #[error(
        "{op}: roots must be equal on every rank and below the group size {size}; got {roots:?} in rank order"
    )]
    InvalidRoot {
        /// The collective.
        op: &'static str,
        /// Each rank's root, in rank order.
        roots: Vec<usize>,
        /// The group's size.
        size: usize,
    },

    /// A rank waited longer than the group's timeout for the others.
    #[error(
        "{op} timed out after {waited_ms} ms waiting for {}",
        describe_missing(missing_ranks)
    )]
    Timeout {
        /// The collective that was waiting.
        op: &'static str,
        /// The ranks that had not arrived; empty when the transport cannot tell.
        missing_ranks: Vec<usize>,
        /// How long the call waited.
        waited_ms: u64,
    },

    /// A rank ended the group with [`Collective::abort`](crate::Collective::abort).
    #[error("the group was aborted by rank {rank}: {why}")]
    Aborted {
        /// The rank that called `abort`.
        rank: usize,
        /// The reason it gave.
        why: String,
    },

    /// The transport's library (MPI, or NCCL for collectives over GPU memory) returned an
    /// error.
    #[error("{op} failed with error code {code}: {message}")]
    Transport {
        /// The function (`MPI_Allgather`, `ncclSend`, ...).
        op: &'static str,
        /// The library's error code.
        code: i32,
        /// The library's own description of the code (`MPI_Error_string`, NCCL's result name).
        message: String,
    },

    /// The transport could not start (an MPI library without the thread support strata
    /// needs, MPI initialised twice); the text says what to do.
    #[error("{detail}")]
    Init {
        /// What went wrong and what to do about it.
        detail: String,
    },
}

fn describe_missing(missing_ranks: &[usize]) -> String {
    match missing_ranks {
        [] => "the other ranks (which ones is not known)".to_string(),
        [rank] => format!("rank {rank}, which never called it"),
        ranks => format!("ranks {ranks:?}, which never called it"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_op_and_ranks() {
        let e = CommError::Timeout {
            op: "barrier",
            missing_ranks: vec![1],
            waited_ms: 50,
        };
        assert_eq!(
            e.to_string(),
            "barrier timed out after 50 ms waiting for rank 1, which never called it"
        );
        let e = CommError::Timeout {
            op: "barrier",
            missing_ranks: vec![],
            waited_ms: 50,
        };
        assert!(e.to_string().contains("not known"));
        let e = CommError::Aborted {
            rank: 2,
            why: "loss is NaN".into(),
        };
        assert_eq!(
            e.to_string(),
            "the group was aborted by rank 2: loss is NaN"
        );
    }
}
