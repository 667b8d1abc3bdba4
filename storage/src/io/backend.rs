//! What every backend shares: the [`Backend`] trait the store drives, the op it takes
//! ([`RawOp`], one contiguous transfer in one file, in the files of a [`FileTable`]), the
//! group a store request's parts report to ([`OpGroup`], pooled by [`GroupPool`]), the
//! counters ([`IoStats`]), and the chunking and retry rules with the error of a failed
//! system call.
//!
//! This file holds the `unsafe` of sending a raw op's pointer to a backend thread and of
//! registering memory. Not here: the backends themselves (`uring`, `threads`, `faulty`)
//! and which one a store gets (the module's root).

use std::os::fd::RawFd;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use hdrhistogram::Histogram;

use super::kind::{BackendKind, OpKind};
use crate::buffer::IoRegion;
use crate::error::{Errno, StorageError};

/// The files a backend does I/O on, by index.
#[derive(Debug, Clone)]
pub(crate) struct FileTable {
    pub fds: Vec<RawFd>,
    pub paths: Vec<PathBuf>,
}

/// One contiguous transfer between memory and one file.
pub(crate) struct RawOp {
    pub kind: OpKind,
    pub file: usize,
    pub offset_bytes: u64,
    pub ptr: *mut u8,
    pub len_bytes: usize,
    pub group: Arc<OpGroup>,
}

// SAFETY: the pointer refers to a buffer the store keeps alive and untouched (it owns the
// buffer inside a `Pending`) until the op's group reports done; the backend thread is the
// only user of that memory meanwhile.
unsafe impl Send for RawOp {}

/// Counts the outstanding parts (ops, then chunks) of one store request and keeps its
/// first error; the caller waits on it.
#[derive(Debug)]
pub(crate) struct OpGroup {
    state: Mutex<GroupState>,
    done: Condvar,
}

#[derive(Debug)]
struct GroupState {
    remaining: usize,
    error: Option<StorageError>,
}

impl OpGroup {
    /// A group waiting for `parts` parts.
    pub fn new(parts: usize) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(GroupState {
                remaining: parts,
                error: None,
            }),
            done: Condvar::new(),
        })
    }

    /// A part split itself into `extra + 1` parts. Must be called before any of them can
    /// finish.
    pub fn add_parts(&self, extra: usize) {
        let mut state = self.state.lock().expect("op group lock poisoned");
        assert!(state.remaining > 0, "parts added to a finished group");
        state.remaining += extra;
    }

    /// One part ended; the first error is kept.
    pub fn finish_part(&self, result: Result<(), StorageError>) {
        let mut state = self.state.lock().expect("op group lock poisoned");
        assert!(state.remaining > 0, "more parts finished than were started");
        state.remaining -= 1;
        if let Err(error) = result {
            state.error.get_or_insert(error);
        }
        if state.remaining == 0 {
            self.done.notify_all();
        }
    }

    /// Whether every part has ended.
    pub fn is_done(&self) -> bool {
        self.state.lock().expect("op group lock poisoned").remaining == 0
    }

    /// Blocks until every part has ended; returns the first error, once.
    pub fn wait(&self) -> Result<(), StorageError> {
        let mut state = self.state.lock().expect("op group lock poisoned");
        while state.remaining > 0 {
            state = self.done.wait(state).expect("op group lock poisoned");
        }
        state.error.take().map_or(Ok(()), Err)
    }
}

/// Operation groups, reused: a group nobody holds any more (its transfer settled, every
/// part finished) serves the next transfer, so a warmed-up store starts transfers
/// without allocating.
pub(crate) struct GroupPool(Mutex<Vec<Arc<OpGroup>>>);

impl Default for GroupPool {
    /// A pool of 64 groups, more than the transfers a step keeps in flight, so that a
    /// step does not grow it.
    fn default() -> Self {
        GroupPool(Mutex::new((0..64).map(|_| OpGroup::new(0)).collect()))
    }
}

impl GroupPool {
    /// A group waiting for `parts` parts: a free one of the pool's, or a new one it keeps.
    pub fn take(&self, parts: usize) -> Arc<OpGroup> {
        let mut groups = self.0.lock().expect("op group pool lock poisoned");
        for group in groups.iter_mut() {
            // Unique: no transfer or backend holds it.
            if let Some(free) = Arc::get_mut(group) {
                *free.state.get_mut().expect("op group lock poisoned") = GroupState {
                    remaining: parts,
                    error: None,
                };
                return Arc::clone(group);
            }
        }
        let group = OpGroup::new(parts);
        groups.push(Arc::clone(&group));
        group
    }
}

/// What a backend has done since it started (or since [`crate::TensorStore::reset_io_stats`]).
#[derive(Debug, Clone)]
pub struct IoStats {
    /// Latency of each read chunk, submission to completion, in nanoseconds.
    pub read_latency_ns: Histogram<u64>,
    /// Latency of each write chunk, in nanoseconds.
    pub write_latency_ns: Histogram<u64>,
    /// Bytes read.
    pub read_bytes: u64,
    /// Bytes written.
    pub written_bytes: u64,
    /// Transfers the kernel completed only in part, then continued.
    pub short_transfers: u64,
    /// Transfers resubmitted after EINTR or EAGAIN.
    pub retries: u64,
    /// Chunks that used registered (fixed) buffers.
    pub fixed_chunks: u64,
    /// Chunks that used plain buffers.
    pub plain_chunks: u64,
}

impl Default for IoStats {
    fn default() -> Self {
        let histogram = || Histogram::new_with_bounds(1, 600_000_000_000, 3).expect("valid bounds");
        Self {
            read_latency_ns: histogram(),
            write_latency_ns: histogram(),
            read_bytes: 0,
            written_bytes: 0,
            short_transfers: 0,
            retries: 0,
            fixed_chunks: 0,
            plain_chunks: 0,
        }
    }
}

/// The byte and chunk counters of [`IoStats`] without its histograms: cheap to take
/// between steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoCounters {
    /// Bytes read.
    pub read_bytes: u64,
    /// Bytes written.
    pub written_bytes: u64,
    /// Chunks that used registered (fixed) buffers.
    pub fixed_chunks: u64,
    /// Chunks that used plain buffers.
    pub plain_chunks: u64,
}

impl IoStats {
    /// The counters alone.
    pub fn counters(&self) -> IoCounters {
        IoCounters {
            read_bytes: self.read_bytes,
            written_bytes: self.written_bytes,
            fixed_chunks: self.fixed_chunks,
            plain_chunks: self.plain_chunks,
        }
    }

    pub(crate) fn record_chunk(&mut self, kind: OpKind, len_bytes: usize, latency: Duration) {
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX).max(1);
        match kind {
            OpKind::Read => {
                self.read_bytes += len_bytes as u64;
                self.read_latency_ns.saturating_record(ns);
            }
            OpKind::Write => {
                self.written_bytes += len_bytes as u64;
                self.write_latency_ns.saturating_record(ns);
            }
        }
    }
}

/// What every backend offers the store.
pub(crate) trait Backend: Send + Sync {
    /// Queues an op. It blocks only while the backend's intake queue is full.
    fn submit(&self, op: RawOp);

    /// Registers a memory region so transfers inside it use fixed buffers. Backends
    /// without registration accept and ignore it.
    ///
    /// # Safety
    /// The memory must stay valid (allocated, mapped) until it is unregistered or the
    /// backend is dropped.
    unsafe fn register_region(&self, region: IoRegion) -> Result<(), StorageError>;

    /// Forgets a region registered before; unknown regions are ignored.
    fn unregister_region(&self, region: IoRegion) -> Result<(), StorageError>;

    /// Which backend this is.
    fn kind(&self) -> BackendKind;

    /// A copy of the counters.
    fn stats(&self) -> IoStats;

    /// The byte and chunk counters alone (no histogram is copied).
    fn counters(&self) -> IoCounters;

    /// Zeroes the counters.
    fn reset_stats(&self);
}

/// How many chunks of at most `block_bytes` a transfer of `len_bytes` splits into.
pub(crate) fn chunk_count(len_bytes: usize, block_bytes: usize) -> usize {
    len_bytes.div_ceil(block_bytes).max(1)
}

/// How many times a transfer is resubmitted after EINTR/EAGAIN before it fails.
pub(crate) const MAX_RETRIES: u32 = 64;

/// Whether an errno means "try again".
pub(crate) fn is_transient(errno: i32) -> bool {
    errno == libc::EINTR || errno == libc::EAGAIN
}

/// Builds the error for a failed system call on a chunk.
pub(crate) fn io_error(
    files: &FileTable,
    kind: OpKind,
    file: usize,
    offset_bytes: u64,
    len_bytes: usize,
    errno: i32,
) -> StorageError {
    StorageError::Io {
        op: kind,
        path: files.paths[file].clone(),
        offset_bytes,
        len_bytes,
        errno: Errno(errno),
    }
}
