//! I/O backends: how bytes move between memory and the swap files.
//!
//! A backend takes [`RawOp`]s (one contiguous transfer in one file), splits them into
//! block-size chunks, keeps at most `queue_depth` chunks in flight, continues short
//! transfers, resubmits EINTR/EAGAIN, and reports each op's end to its [`OpGroup`]. It
//! does not know about extents, checksums or buffer ownership: the tensor store above it
//! does.
//!
//! Backends: [`uring`] (one thread owning an io_uring ring, registered files and
//! buffers), [`threads`] (a pool of threads calling pread/pwrite, chosen automatically
//! when io_uring cannot start), and [`faulty`] (the threaded backend over system calls
//! that fail on purpose, for tests).

pub(crate) mod faulty;
pub(crate) mod threads;
pub(crate) mod uring;

use std::os::fd::RawFd;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use hdrhistogram::Histogram;

use crate::buffer::IoRegion;
use crate::error::{Errno, StorageError};

/// Whether a transfer reads from or writes to a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// File to memory.
    Read,
    /// Memory to file.
    Write,
}

impl std::fmt::Display for OpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OpKind::Read => "read",
            OpKind::Write => "write",
        })
    }
}

/// Which backend to use; `Auto` probes io_uring once and falls back to threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// io_uring when it works here, else threads (the reason is logged once).
    #[default]
    Auto,
    /// io_uring, or an error saying why it cannot start.
    Uring,
    /// The threaded pread/pwrite backend.
    Threads,
}

impl std::str::FromStr for BackendChoice {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "auto" => Ok(Self::Auto),
            "uring" | "io_uring" => Ok(Self::Uring),
            "threads" => Ok(Self::Threads),
            other => Err(format!(
                "unknown I/O backend '{other}': expected auto, uring or threads"
            )),
        }
    }
}

/// The backend a store actually runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    /// io_uring.
    Uring,
    /// Threads calling pread/pwrite.
    Threads,
    /// Threads over fault-injecting system calls (tests only).
    Faulty,
}

impl BackendKind {
    /// A short name for reports.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Uring => "io_uring",
            BackendKind::Threads => "threads",
            BackendKind::Faulty => "faulty",
        }
    }
}

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

/// Probes io_uring once per process: ring setup, the opcodes strata uses, and a trial
/// buffer registration. `Err` says why io_uring cannot be used and what to do.
pub fn probe_uring() -> Result<(), String> {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    PROBE.get_or_init(uring::probe).clone()
}

/// Decides the backend for `choice` given the io_uring probe's answer; `Auto` falls back
/// to threads with the reason logged once per process.
pub(crate) fn resolve_backend(
    choice: BackendChoice,
    uring_probe: &Result<(), String>,
) -> Result<BackendKind, StorageError> {
    match (choice, uring_probe) {
        (BackendChoice::Threads, _) => Ok(BackendKind::Threads),
        (BackendChoice::Uring | BackendChoice::Auto, Ok(())) => Ok(BackendKind::Uring),
        (BackendChoice::Uring, Err(reason)) => Err(StorageError::UringUnavailable(format!(
            "{reason}; or use the threaded backend (--backend threads)"
        ))),
        (BackendChoice::Auto, Err(reason)) => {
            static LOGGED: OnceLock<()> = OnceLock::new();
            LOGGED.get_or_init(|| {
                log::warn!(
                    "io_uring unavailable ({reason}); using the threaded pread/pwrite backend"
                )
            });
            Ok(BackendKind::Threads)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_choice_parses() {
        assert_eq!("auto".parse(), Ok(BackendChoice::Auto));
        assert_eq!("uring".parse(), Ok(BackendChoice::Uring));
        assert_eq!("threads".parse(), Ok(BackendChoice::Threads));
        assert!("spdk".parse::<BackendChoice>().is_err());
    }

    #[test]
    fn resolution_falls_back_only_under_auto() {
        let broken: Result<(), String> = Err("EPERM".into());
        assert_eq!(
            resolve_backend(BackendChoice::Auto, &broken).unwrap(),
            BackendKind::Threads
        );
        assert_eq!(
            resolve_backend(BackendChoice::Threads, &Ok(())).unwrap(),
            BackendKind::Threads
        );
        assert_eq!(
            resolve_backend(BackendChoice::Auto, &Ok(())).unwrap(),
            BackendKind::Uring
        );
        let error = resolve_backend(BackendChoice::Uring, &broken).unwrap_err();
        assert!(error.to_string().contains("--backend threads"), "{error}");
    }

    #[test]
    fn group_keeps_first_error_and_counts_parts() {
        let group = OpGroup::new(2);
        group.add_parts(1);
        group.finish_part(Ok(()));
        group.finish_part(Err(StorageError::BackendGone));
        assert!(!group.is_done());
        group.finish_part(Err(StorageError::Config("second".into())));
        assert!(group.is_done());
        assert!(matches!(group.wait(), Err(StorageError::BackendGone)));
        assert!(group.wait().is_ok(), "the error is reported once");
    }
}
