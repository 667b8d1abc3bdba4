//! The threaded backend: a fixed pool of threads calling pread/pwrite, one chunk each.
//!
//! It is what strata runs on where io_uring cannot start (seccomp, io_uring_disabled,
//! old kernels). It is generic over its [`Syscalls`] so that tests run the same chunking,
//! continuation and retry logic over system calls that fail on purpose
//! ([`super::faulty`]). The number of threads is the queue depth, up to
//! [`MAX_THREADS`]: at most that many chunks are in flight.

use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam::channel::{Receiver, Sender};

use super::backend::{
    Backend, FileTable, IoStats, MAX_RETRIES, OpGroup, RawOp, chunk_count, io_error, is_transient,
};
use super::kind::{BackendKind, OpKind};
use crate::buffer::IoRegion;
use crate::error::StorageError;

/// The most threads the backend starts, whatever the queue depth: beyond this, more
/// threads only add scheduling cost on the few cores a training machine spares for I/O.
pub(crate) const MAX_THREADS: usize = 128;

/// The system calls a threaded backend makes; errors are errno values.
pub(crate) trait Syscalls: Send + Sync + 'static {
    /// Reads up to `len` bytes at `offset` into `buf`.
    ///
    /// # Safety
    /// `buf` must be valid for writes of `len` bytes and not used by anyone else.
    unsafe fn pread(&self, fd: RawFd, buf: *mut u8, len: usize, offset: u64) -> Result<usize, i32>;

    /// Writes up to `len` bytes from `buf` at `offset`.
    ///
    /// # Safety
    /// `buf` must be valid for reads of `len` bytes.
    unsafe fn pwrite(
        &self,
        fd: RawFd,
        buf: *const u8,
        len: usize,
        offset: u64,
    ) -> Result<usize, i32>;

    /// Which backend these calls make.
    fn kind(&self) -> BackendKind;
}

/// The real system calls.
pub(crate) struct Posix;

fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

impl Syscalls for Posix {
    unsafe fn pread(&self, fd: RawFd, buf: *mut u8, len: usize, offset: u64) -> Result<usize, i32> {
        let offset = libc::off_t::try_from(offset).map_err(|_| libc::EOVERFLOW)?;
        // SAFETY: the caller guarantees buf is valid for len bytes of writes.
        let n = unsafe { libc::pread(fd, buf.cast(), len, offset) };
        usize::try_from(n).map_err(|_| errno())
    }

    unsafe fn pwrite(
        &self,
        fd: RawFd,
        buf: *const u8,
        len: usize,
        offset: u64,
    ) -> Result<usize, i32> {
        let offset = libc::off_t::try_from(offset).map_err(|_| libc::EOVERFLOW)?;
        // SAFETY: the caller guarantees buf is valid for len bytes of reads.
        let n = unsafe { libc::pwrite(fd, buf.cast(), len, offset) };
        usize::try_from(n).map_err(|_| errno())
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Threads
    }
}

/// One chunk of an op, handed to a worker.
struct Chunk {
    kind: OpKind,
    file: usize,
    offset_bytes: u64,
    ptr: *mut u8,
    len_bytes: usize,
    group: Arc<OpGroup>,
}

// SAFETY: see RawOp: the memory is owned by a Pending that outlives the chunk.
unsafe impl Send for Chunk {}

struct Shared<S> {
    syscalls: S,
    files: FileTable,
    stats: Mutex<IoStats>,
}

/// A pool of threads doing pread/pwrite.
pub(crate) struct ThreadIo<S: Syscalls> {
    sender: Option<Sender<Chunk>>,
    workers: Vec<JoinHandle<()>>,
    shared: Arc<Shared<S>>,
    block_bytes: usize,
}

impl<S: Syscalls> ThreadIo<S> {
    /// Starts `queue_depth` worker threads (at most [`MAX_THREADS`]) over `files`.
    pub fn start(
        syscalls: S,
        files: FileTable,
        block_bytes: usize,
        queue_depth: usize,
    ) -> Result<Self, StorageError> {
        assert!(block_bytes > 0 && queue_depth > 0);
        let shared = Arc::new(Shared {
            syscalls,
            files,
            stats: Mutex::new(IoStats::default()),
        });
        let thread_count = queue_depth.min(MAX_THREADS);
        let (sender, receiver) = crossbeam::channel::bounded::<Chunk>(thread_count);
        let mut workers = Vec::with_capacity(thread_count);
        for i in 0..thread_count {
            let receiver: Receiver<Chunk> = receiver.clone();
            let worker_shared = Arc::clone(&shared);
            let worker = std::thread::Builder::new()
                .name(format!("strata-io-{i}"))
                .spawn(move || {
                    for chunk in receiver {
                        let result = transfer(&worker_shared, &chunk);
                        chunk.group.finish_part(result);
                    }
                })
                .map_err(|source| StorageError::File {
                    action: "cannot start I/O thread for",
                    path: shared_path(&shared.files),
                    source,
                })?;
            workers.push(worker);
        }
        Ok(Self {
            sender: Some(sender),
            workers,
            shared,
            block_bytes,
        })
    }
}

fn shared_path(files: &FileTable) -> std::path::PathBuf {
    files.paths.first().cloned().unwrap_or_default()
}

/// Moves one chunk, continuing short transfers and resubmitting EINTR/EAGAIN.
fn transfer<S: Syscalls>(shared: &Shared<S>, chunk: &Chunk) -> Result<(), StorageError> {
    let started = Instant::now();
    let fd = shared.files.fds[chunk.file];
    let mut done = 0usize;
    let mut retries = 0u32;
    let mut short_transfers = 0u64;
    while done < chunk.len_bytes {
        let remaining = chunk.len_bytes - done;
        let offset = chunk.offset_bytes + done as u64;
        // SAFETY: [ptr, ptr + len) is the chunk's part of a buffer the store keeps alive
        // and untouched until the group finishes; done < len keeps the pointer inside.
        let result = unsafe {
            let ptr = chunk.ptr.add(done);
            match chunk.kind {
                OpKind::Read => shared.syscalls.pread(fd, ptr, remaining, offset),
                OpKind::Write => shared.syscalls.pwrite(fd, ptr, remaining, offset),
            }
        };
        match result {
            Ok(0) if chunk.kind == OpKind::Read => {
                return Err(StorageError::UnexpectedEof {
                    path: shared.files.paths[chunk.file].clone(),
                    offset_bytes: offset,
                    missing_bytes: remaining,
                });
            }
            Ok(0) => {
                // A write that makes no progress: give it the same bounded patience as
                // EAGAIN, then fail rather than spin.
                retries += 1;
                if retries > MAX_RETRIES {
                    return Err(io_error(
                        &shared.files,
                        chunk.kind,
                        chunk.file,
                        offset,
                        remaining,
                        libc::EIO,
                    ));
                }
            }
            Ok(n) => {
                done += n.min(remaining);
                if done < chunk.len_bytes {
                    short_transfers += 1;
                }
            }
            Err(errno) if is_transient(errno) && retries < MAX_RETRIES => retries += 1,
            Err(errno) => {
                return Err(io_error(
                    &shared.files,
                    chunk.kind,
                    chunk.file,
                    offset,
                    remaining,
                    errno,
                ));
            }
        }
    }
    let mut stats = shared.stats.lock().expect("stats lock poisoned");
    stats.record_chunk(chunk.kind, chunk.len_bytes, started.elapsed());
    stats.retries += u64::from(retries);
    stats.short_transfers += short_transfers;
    stats.plain_chunks += 1;
    Ok(())
}

impl<S: Syscalls> Backend for ThreadIo<S> {
    fn submit(&self, op: RawOp) {
        let sender = self.sender.as_ref().expect("submit after shutdown");
        assert!(op.len_bytes > 0, "empty transfers are not submitted");
        let chunks = chunk_count(op.len_bytes, self.block_bytes);
        op.group.add_parts(chunks - 1);
        for start in (0..op.len_bytes).step_by(self.block_bytes) {
            let chunk = Chunk {
                kind: op.kind,
                file: op.file,
                offset_bytes: op.offset_bytes + start as u64,
                // SAFETY: start < len_bytes, inside the op's buffer.
                ptr: unsafe { op.ptr.add(start) },
                len_bytes: (op.len_bytes - start).min(self.block_bytes),
                group: Arc::clone(&op.group),
            };
            if let Err(failed) = sender.send(chunk) {
                failed.0.group.finish_part(Err(StorageError::BackendGone));
            }
        }
    }

    unsafe fn register_region(&self, _region: IoRegion) -> Result<(), StorageError> {
        Ok(())
    }

    fn unregister_region(&self, _region: IoRegion) -> Result<(), StorageError> {
        Ok(())
    }

    fn kind(&self) -> BackendKind {
        self.shared.syscalls.kind()
    }

    fn stats(&self) -> IoStats {
        self.shared
            .stats
            .lock()
            .expect("stats lock poisoned")
            .clone()
    }

    fn counters(&self) -> super::backend::IoCounters {
        self.shared
            .stats
            .lock()
            .expect("stats lock poisoned")
            .counters()
    }

    fn reset_stats(&self) {
        *self.shared.stats.lock().expect("stats lock poisoned") = IoStats::default();
    }
}

impl<S: Syscalls> Drop for ThreadIo<S> {
    fn drop(&mut self) {
        // Closing the channel lets each worker finish what it holds and exit.
        self.sender.take();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}
