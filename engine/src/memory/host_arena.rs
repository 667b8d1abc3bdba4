//! The pinned host arena: one page-locked mapping of a plan's host peak, in which the
//! plan places every host buffer at a fixed offset (staging for NVMe reads and device
//! copies, host-homed optimizer state, gradients, checkpoints).
//!
//! Page-locking follows the pinned pool's rules (`super::pinned`): registered with the
//! CUDA driver when a GPU is used (never write-combined memory), else `mlock`, else plain
//! pre-faulted memory with one warning. The arena registers itself with the NVMe tier's
//! io_uring ([`HostArena::register_with`]), so an NVMe read lands, with ReadFixed, in the
//! very bytes a host-to-device copy starts from.
//!
//! Every access goes through the view checker ([`super::super::device`]'s access table):
//! [`HostArena::read`] and [`HostArena::write`] for the host lanes, [`HostArena::lease`]
//! for I/O (an [`IoBuf`] the NVMe tier owns while it runs), and the CPU device's copies.
//! Overlapping accesses, one of them a write, fail with an ordering violation.
//!
//! This file holds the arena's `unsafe`: views of the mapping and the I/O lease.

use std::ops::{Deref, DerefMut, Range};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use strata_storage::{IoBuf, TensorStore};

use super::host::HostMapping;
use super::locking::{HostLocking, Pinning};
use crate::device::access::AccessTable;
use crate::error::EngineError;
use crate::lane::Lane;

/// A range of a [`HostArena`], in bytes from its start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HostRange {
    /// First byte.
    pub offset_bytes: usize,
    /// Length.
    pub len_bytes: usize,
}

impl HostRange {
    /// `len_bytes` bytes from `offset_bytes`.
    pub const fn new(offset_bytes: usize, len_bytes: usize) -> Self {
        HostRange {
            offset_bytes,
            len_bytes,
        }
    }

    /// The bytes as a range.
    pub fn bytes(&self) -> Range<usize> {
        self.offset_bytes..self.offset_bytes + self.len_bytes
    }

    /// `len_bytes` bytes of this range from its byte `at`.
    pub fn sub(&self, at: usize, len_bytes: usize) -> HostRange {
        assert!(
            at + len_bytes <= self.len_bytes,
            "a part past the end of its range"
        );
        HostRange::new(self.offset_bytes + at, len_bytes)
    }

    /// The first `len_bytes` bytes of this range.
    pub fn prefix(&self, len_bytes: usize) -> HostRange {
        assert!(
            len_bytes <= self.len_bytes,
            "a prefix longer than its range"
        );
        HostRange { len_bytes, ..*self }
    }
}

/// One page-locked host mapping, shared by cloning.
#[derive(Clone)]
pub struct HostArena {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    mapping: HostMapping,
    len_bytes: usize,
    accesses: AccessTable,
    /// The end of the highest range any lane has used.
    used_high_water: AtomicUsize,
}

impl HostArena {
    /// Maps `len_bytes` (at least one page) and page-locks it as `pinning` says.
    pub fn new(name: &str, len_bytes: usize, pinning: &Pinning) -> Result<Self, EngineError> {
        let mut mapping =
            HostMapping::map(len_bytes.max(1)).map_err(|source| EngineError::HostMemory {
                pool: name.to_string(),
                size_bytes: len_bytes,
                source,
            })?;
        mapping.lock(name, pinning)?;
        Ok(HostArena {
            inner: Arc::new(Inner {
                name: name.to_string(),
                mapping,
                len_bytes,
                accesses: AccessTable::new(format!("host arena '{name}'")),
                used_high_water: AtomicUsize::new(0),
            }),
        })
    }

    /// Usable bytes.
    pub fn len_bytes(&self) -> usize {
        self.inner.len_bytes
    }

    /// How the memory is locked.
    pub fn locking(&self) -> &HostLocking {
        self.inner.mapping.locking()
    }

    /// Registers the arena with `store`'s io_uring backend, so that NVMe transfers of its
    /// ranges use fixed buffers (the threaded backend accepts and ignores this). The
    /// arena keeps a clone of the store and unregisters before its memory is unmapped.
    pub fn register_with(&self, store: &TensorStore) -> Result<(), EngineError> {
        self.inner.mapping.register_with(store)
    }

    fn check(&self, range: HostRange) {
        assert!(
            range.offset_bytes <= self.inner.len_bytes
                && range.len_bytes <= self.inner.len_bytes - range.offset_bytes,
            "{range:?} is outside host arena '{}' of {} bytes",
            self.inner.name,
            self.inner.len_bytes
        );
        self.inner
            .used_high_water
            .fetch_max(range.offset_bytes + range.len_bytes, Ordering::Relaxed);
    }

    /// The end of the highest range any lane has read, written or leased, in bytes from
    /// the arena's start: the memory the work really needed, counted as it was used.
    pub fn used_high_water_bytes(&self) -> usize {
        self.inner.used_high_water.load(Ordering::Relaxed)
    }

    /// The address of `range`'s first byte, after checking it lies in the arena.
    pub(crate) fn address(&self, range: HostRange) -> *mut u8 {
        self.check(range);
        // SAFETY: inside the mapping (checked above).
        unsafe { self.inner.mapping.ptr().as_ptr().add(range.offset_bytes) }
    }

    /// Registers accesses of `ranges` by `lane` with the view checker (see
    /// [`AccessTable::begin`]).
    pub(crate) fn begin(
        &self,
        lane: Lane,
        ranges: impl Iterator<Item = (HostRange, bool)> + Clone,
    ) -> Result<u64, EngineError> {
        self.inner
            .accesses
            .begin(lane, ranges.map(|(r, w)| (r.bytes(), w)))
    }

    /// Ends accesses registered by [`HostArena::begin`].
    pub(crate) fn end(&self, id: u64) {
        self.inner.accesses.end(id);
    }

    /// Reads `range` for `lane`; refused while anyone writes any of its bytes.
    pub fn read(&self, lane: Lane, range: HostRange) -> Result<HostRead<'_>, EngineError> {
        let ptr = self.address(range);
        let id = self.begin(lane, std::iter::once((range, false)))?;
        // SAFETY: inside the mapping; the view checker guarantees no overlapping write
        // until this view drops.
        let bytes = unsafe { std::slice::from_raw_parts(ptr, range.len_bytes) };
        Ok(HostRead {
            arena: self,
            id,
            bytes,
        })
    }

    /// Writes `range` for `lane`; refused while anyone reads or writes any of its bytes.
    pub fn write(&self, lane: Lane, range: HostRange) -> Result<HostWrite<'_>, EngineError> {
        let ptr = self.address(range);
        let id = self.begin(lane, std::iter::once((range, true)))?;
        // SAFETY: inside the mapping; the view checker guarantees no overlapping access
        // until this view drops.
        let bytes = unsafe { std::slice::from_raw_parts_mut(ptr, range.len_bytes) };
        Ok(HostWrite {
            arena: self,
            id,
            bytes,
        })
    }

    /// `range` as a buffer the NVMe tier may own while it transfers: `write` when the
    /// transfer writes into it (a read from NVMe), else shared with other readers.
    pub fn lease(
        &self,
        lane: Lane,
        range: HostRange,
        write: bool,
    ) -> Result<HostLease, EngineError> {
        let ptr = self.address(range);
        let id = self.begin(lane, std::iter::once((range, write)))?;
        Ok(HostLease {
            arena: self.clone(),
            id,
            ptr,
            len_bytes: range.len_bytes,
        })
    }
}

impl std::fmt::Debug for HostArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostArena")
            .field("name", &self.inner.name)
            .field("len_bytes", &self.inner.len_bytes)
            .field("locking", self.inner.mapping.locking())
            .finish()
    }
}

/// Host bytes being read.
pub struct HostRead<'a> {
    arena: &'a HostArena,
    id: u64,
    bytes: &'a [u8],
}

/// Host bytes being written.
pub struct HostWrite<'a> {
    arena: &'a HostArena,
    id: u64,
    bytes: &'a mut [u8],
}

impl Deref for HostRead<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes
    }
}

impl Deref for HostWrite<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes
    }
}

impl DerefMut for HostWrite<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.bytes
    }
}

impl Drop for HostRead<'_> {
    fn drop(&mut self) {
        self.arena.end(self.id);
    }
}

impl Drop for HostWrite<'_> {
    fn drop(&mut self) {
        self.arena.end(self.id);
    }
}

/// A range of a host arena lent to I/O; its access ends when it drops.
pub struct HostLease {
    arena: HostArena,
    id: u64,
    ptr: *mut u8,
    len_bytes: usize,
}

// SAFETY: the lease is an address in memory the arena (held by the lease) keeps mapped;
// the view checker makes the access exclusive (or shared among readers only).
unsafe impl Send for HostLease {}

impl Drop for HostLease {
    fn drop(&mut self) {
        self.arena.end(self.id);
    }
}

// SAFETY: the address is fixed for the lease's life and does not move with the value;
// the arena it points into lives at least as long (the lease holds it); the view checker
// registered this access, so no other operation writes the bytes meanwhile (a lease
// taken for reading shares them only with other readers, which is all an NVMe write
// does with them).
unsafe impl IoBuf for HostLease {
    fn as_ptr(&self) -> *const u8 {
        self.ptr
    }
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
    fn capacity_bytes(&self) -> usize {
        self.len_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_are_checked_and_leases_hold_their_range() {
        let arena = HostArena::new("test", 1 << 16, &Pinning::Mlock).unwrap();
        let a = HostRange::new(0, 4096);
        let b = HostRange::new(4096, 4096);
        {
            let mut w = arena.write(Lane::Cpu, a).unwrap();
            w.fill(7);
            assert!(arena.read(Lane::H2d, a).is_err());
            assert!(arena.read(Lane::H2d, b).is_ok());
        }
        assert!(arena.read(Lane::H2d, a).unwrap().iter().all(|&x| x == 7));
        let lease = arena.lease(Lane::NvmeRead, b, true).unwrap();
        assert_eq!(lease.capacity_bytes(), 4096);
        assert!(arena.write(Lane::Cpu, b).is_err());
        drop(lease);
        assert!(arena.write(Lane::Cpu, b).is_ok());
    }
}
