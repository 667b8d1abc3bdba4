//! Where bytes are held between moves: the pinned host arena a plan places its host
//! buffers in, the pinned pool of equal slots (benchmarks), and the arena that holds a
//! device's whole memory budget.
//!
//! Both are allocated once, at start, from a byte budget, and never grow: a step that does
//! not fit fails with an error naming the budget, instead of allocating on the hot path.
//! Their counters (slots in use, high-water marks, waits) are in [`PoolStats`] and
//! [`ArenaStats`]. [`MemlockLimit`] says how much memory this process may page-lock.

mod arena;
mod host;
mod host_arena;
mod locking;
mod pinned;

pub use arena::{ARENA_ALIGN, ArenaStats, DeviceArena, DeviceBuffer};
pub(crate) use host::HostMapping;
pub use host::MemlockLimit;
pub use host_arena::{HostArena, HostLease, HostRange, HostRead, HostWrite};
pub use locking::{HostLocking, Pinning};
pub use pinned::{PinnedPool, PinnedPoolConfig, PoolStats, SlotLease};
