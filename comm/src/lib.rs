//! strata-comm: ranks and collectives for ZeRO-3 data parallelism.
//!
//! Each of N ranks owns 1/N of every block's parameters, gradients and optimizer state;
//! per block the engine all-gathers the parameters and reduce-scatters the gradients. The
//! invariant this crate exists for: N ranks give **bit-identical** parameters to one
//! process with N-fold gradient accumulation. One process sums micro-batch gradients as a
//! left fold `((g0 + g1) + g2) + ...` in f32, so the reduce-scatter here has a fixed
//! summation order: an all-to-all exchange (chunk q of each rank's buffer to rank q),
//! then a local left fold in rank order on the owner. Never `MPI_Reduce_scatter` with
//! `MPI_SUM`, whose order is unspecified.
//!
//! - [`Collective`]: the interface the engine codes against.
//! - [`Solo`]: one process, size 1.
//! - [`ThreadGroup`]: N ranks in one process, one per thread, for tests without MPI.
//! - `Mpi` (feature `mpi`): one rank per process under `mpirun`, through rsmpi.
//! - [`launched_by_mpirun`], [`LaunchEnv`]: what the launcher says, with or without the
//!   `mpi` feature, so a build without MPI can tell the user to rebuild.
//! - [`reference`](mod@reference): plain scalar references every transport is checked against;
//!   [`conformance`]: that check, runnable on any transport.
//!
//! Holds no model, no device memory and no schedule: the engine decides what to gather
//! and when.

mod call;
pub mod conformance;
mod error;
mod fold;
mod launch;
#[cfg(feature = "mpi")]
mod mpi;
pub mod reference;
mod solo;
mod thread_group;

pub use error::CommError;
pub use launch::{BUILT_WITH_MPI, LaunchEnv, launched_by_mpirun, mpi_missing_message};
#[cfg(feature = "mpi")]
pub use mpi::Mpi;
pub use solo::Solo;
pub use thread_group::ThreadGroup;

/// A group of ranks and the collectives the engine's ZeRO-3 step needs.
///
/// Rules for every implementation:
/// - Every rank makes the same collective calls in the same order; lengths that the
///   method says must be equal are equal on every rank. Both are checked before any data
///   moves, and a violation is the same error on every rank (no rank is left waiting).
/// - Calls from one rank are sequential (one at a time); an implementation may be called
///   from any thread.
/// - Sums have a fixed order: rank 0's value first, then rank 1's, ..., each a plain
///   scalar add, so every transport and every rank gets the same bits.
pub trait Collective: Send + Sync + std::fmt::Debug {
    /// This rank, `0..size()`.
    fn rank(&self) -> usize;

    /// How many ranks the group has.
    fn size(&self) -> usize;

    /// Every rank's `send` concatenated in rank order into `recv`: rank p's bytes land at
    /// `recv[p * send.len() .. (p + 1) * send.len()]`. `send.len()` is equal on every
    /// rank and `recv.len() == size * send.len()`.
    fn all_gather(&self, send: &[u8], recv: &mut [u8]) -> Result<(), CommError>;

    /// Reduce-scatter with a fixed summation order. `send.len() == size * acc.len()`,
    /// `acc.len()` equal on every rank; chunk q of `send` (elements `q * acc.len() ..
    /// (q + 1) * acc.len()`) goes to rank q.
    ///
    /// On return, for each i, with `x_p` = rank p's chunk for this rank: if `accumulate`,
    /// `acc[i] = (((acc[i] + x_0[i]) + x_1[i]) + ... + x_{size-1}[i])`; else `acc[i] =
    /// ((x_0[i] + x_1[i]) + ...)`, starting from `x_0[i]` (no added zero: `-0.0`
    /// survives). Plain scalar f32 adds in that order, as [`reference::reduce_scatter_sum`].
    fn reduce_scatter_sum(
        &self,
        send: &[f32],
        acc: &mut [f32],
        accumulate: bool,
    ) -> Result<(), CommError>;

    /// Element-wise sum over ranks in rank order, `values[i] = (x_0[i] + x_1[i]) + ...`,
    /// the same bits on every rank. `values.len()` is equal on every rank.
    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<(), CommError>;

    /// Copies `root`'s `buf` into every other rank's `buf`. `root` and `buf.len()` are
    /// equal on every rank.
    fn broadcast(&self, root: usize, buf: &mut [u8]) -> Result<(), CommError>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), CommError>;

    /// Ends the group, from any thread, without waiting for the others: what a rank does
    /// when it cannot go on, so that its peers do not wait for it forever. What that
    /// means depends on the transport (see each one); on every one, no collective
    /// succeeds afterwards.
    fn abort(&self, why: &str);
}
