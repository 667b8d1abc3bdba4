//! What a lane thread reuses from operation to operation and from step to step, so the
//! hot path allocates nothing ([`LaneScratch`]): the compute lane's operations in flight,
//! the events an operation waits for, and an NVMe lane's transfers in flight
//! ([`Transfer`]).
//!
//! Not here: the lanes that use it (`lanes.rs`) or the threads that keep it
//! (`workers.rs`).

use std::collections::VecDeque;
use std::time::Instant;

use strata_storage::Pending;

use super::lent::Lent;
use crate::device::Event;
use crate::memory::HostLease;
use crate::plan::OpId;

/// A lane thread's reusable buffers.
#[derive(Default)]
pub(super) struct LaneScratch {
    /// The compute lane's operations submitted and maybe not yet complete.
    pub(super) in_flight: VecDeque<OpId>,
    /// The events of other streams an operation waits for.
    pub(super) after: Vec<Event>,
    /// An NVMe lane's transfers in flight, oldest first.
    pub(super) transfers: VecDeque<Transfer>,
}

/// An NVMe transfer an NVMe lane started and has not yet marked done.
pub(super) struct Transfer {
    pub(super) id: OpId,
    /// The extent group it reads or writes.
    pub(super) group: usize,
    pub(super) started: Instant,
    pub(super) pending: Pending<Lent<HostLease>>,
}
