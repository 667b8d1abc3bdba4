//! The io_uring backend: one thread owns the ring and takes requests from a channel.
//!
//! The thread splits each op into block-size chunks and keeps at most `queue_depth` of
//! them in flight. Each pass fills the submission queue with every chunk it may start and
//! submits them with one system call (batched submission), then reaps what completed.
//! Files are registered once; a chunk whose memory lies inside a registered region uses
//! ReadFixed/WriteFixed, which spares the kernel pinning the pages of every request (on
//! this project's reference disk that is the difference between 2 and 4 GiB/s). Short
//! transfers are continued, EINTR/EAGAIN resubmitted a bounded number of times, and any
//! other errno fails the chunk with a named error. SQPOLL is not used: it burns a core,
//! and the optimizer needs the cores.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam::channel::{Receiver, Sender};
use io_uring::{IoUring, Probe, opcode, squeue, types};

use super::backend::{
    Backend, FileTable, IoStats, MAX_RETRIES, OpGroup, RawOp, chunk_count, io_error, is_transient,
};
use super::kind::{BackendKind, OpKind};
use crate::buffer::{AlignedBuf, IoBuf, IoRegion};
use crate::error::{Errno, StorageError};

/// The largest buffer io_uring registers as one fixed buffer.
const MAX_FIXED_BUFFER_BYTES: usize = 1 << 30;

/// What the ring thread is asked to do.
enum Request {
    Op(RawOp),
    Register(IoRegion, Sender<Result<(), StorageError>>),
    Unregister(IoRegion, Sender<Result<(), StorageError>>),
}

// SAFETY: RawOp is Send (see its impl); IoRegion is an address range.
unsafe impl Send for Request {}

/// The most transfers the channel to the ring thread holds, and the most the thread
/// keeps waiting for ring slots.
fn queue_limit(queue_depth: usize) -> usize {
    queue_depth.max(64)
}

/// The io_uring backend's handle, held by the store.
pub(crate) struct UringIo {
    sender: Option<Sender<Request>>,
    thread: Option<JoinHandle<()>>,
    stats: Arc<Mutex<IoStats>>,
}

impl UringIo {
    /// Starts the ring thread over `files`; fails if the ring cannot be set up.
    pub fn start(
        files: FileTable,
        block_bytes: usize,
        queue_depth: usize,
    ) -> Result<Self, StorageError> {
        assert!(block_bytes > 0 && queue_depth > 0);
        let block_bytes = block_bytes.min(u32::MAX as usize & !4095);
        let stats = Arc::new(Mutex::new(IoStats::default()));
        let (sender, receiver) = crossbeam::channel::bounded::<Request>(queue_limit(queue_depth));
        let (ready_tx, ready_rx) = crossbeam::channel::bounded(1);
        let thread_stats = Arc::clone(&stats);
        let thread = std::thread::Builder::new()
            .name("strata-uring".into())
            .spawn(move || {
                // The ring is made on the thread that uses it (single issuer).
                let ring = match RingThread::new(files, block_bytes, queue_depth, thread_stats) {
                    Ok(ring) => {
                        let _ = ready_tx.send(Ok(()));
                        ring
                    }
                    Err(error) => {
                        let _ = ready_tx.send(Err(error));
                        return;
                    }
                };
                ring.run(receiver);
            })
            .map_err(|e| StorageError::UringUnavailable(format!("cannot start its thread: {e}")))?;
        ready_rx
            .recv()
            .map_err(|_| StorageError::BackendGone)
            .and_then(|r| r)?;
        Ok(Self {
            sender: Some(sender),
            thread: Some(thread),
            stats,
        })
    }

    fn control(
        &self,
        make: impl FnOnce(Sender<Result<(), StorageError>>) -> Request,
    ) -> Result<(), StorageError> {
        let (tx, rx) = crossbeam::channel::bounded(1);
        let sender = self.sender.as_ref().ok_or(StorageError::BackendGone)?;
        sender
            .send(make(tx))
            .map_err(|_| StorageError::BackendGone)?;
        rx.recv().map_err(|_| StorageError::BackendGone)?
    }
}

impl Backend for UringIo {
    fn submit(&self, op: RawOp) {
        assert!(op.len_bytes > 0, "empty transfers are not submitted");
        let sender = self.sender.as_ref().expect("submit after shutdown");
        if let Err(failed) = sender.send(Request::Op(op))
            && let Request::Op(op) = failed.0
        {
            op.group.finish_part(Err(StorageError::BackendGone));
        }
    }

    unsafe fn register_region(&self, region: IoRegion) -> Result<(), StorageError> {
        self.control(|tx| Request::Register(region, tx))
    }

    fn unregister_region(&self, region: IoRegion) -> Result<(), StorageError> {
        self.control(|tx| Request::Unregister(region, tx))
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Uring
    }

    fn stats(&self) -> IoStats {
        self.stats.lock().expect("stats lock poisoned").clone()
    }

    fn counters(&self) -> super::backend::IoCounters {
        self.stats.lock().expect("stats lock poisoned").counters()
    }

    fn reset_stats(&self) {
        *self.stats.lock().expect("stats lock poisoned") = IoStats::default();
    }
}

impl Drop for UringIo {
    fn drop(&mut self) {
        // Closing the channel tells the thread to finish what is in flight and exit.
        self.sender.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A chunk in flight (or waiting to be resubmitted).
struct Chunk {
    kind: OpKind,
    file: usize,
    offset_bytes: u64,
    ptr: *mut u8,
    len_bytes: usize,
    /// Bytes already moved by earlier (short) completions.
    done_bytes: usize,
    fixed_index: Option<u16>,
    retries: u32,
    short_transfers: u32,
    started: Instant,
    group: Arc<OpGroup>,
}

/// An op whose chunks have not all been started.
struct Pending {
    op: RawOp,
    next_bytes: usize,
}

/// One registered fixed buffer: a piece of at most 1 GiB of a registered region.
#[derive(Clone, Copy)]
struct FixedBuffer {
    start: usize,
    len_bytes: usize,
}

struct RingThread {
    ring: IoUring,
    files: FileTable,
    files_registered: bool,
    block_bytes: usize,
    queue_depth: usize,
    stats: Arc<Mutex<IoStats>>,
    /// Regions as registered by callers.
    regions: Vec<IoRegion>,
    /// The fixed buffers those regions became, by buffer index.
    fixed: Vec<FixedBuffer>,
    /// In-flight chunks by slot; a chunk's slot is its user_data.
    slots: Vec<Option<Chunk>>,
    free_slots: Vec<usize>,
    in_flight: usize,
    /// Transfers taken from the channel and not yet wholly submitted; at most
    /// [`queue_limit`], so that the queue is bounded end to end: past it, the ring
    /// thread stops taking requests and submitters wait on the channel.
    pending: VecDeque<Pending>,
    /// Slots whose chunk must be submitted again (short transfer or EINTR/EAGAIN).
    resubmit: VecDeque<usize>,
    /// Control requests wait until nothing is in flight.
    control: VecDeque<Request>,
    /// Reaped completions (user_data, result), kept to reuse its allocation.
    completions: Vec<(u64, i32)>,
}

impl RingThread {
    fn new(
        files: FileTable,
        block_bytes: usize,
        queue_depth: usize,
        stats: Arc<Mutex<IoStats>>,
    ) -> Result<Self, StorageError> {
        let entries = u32::try_from(queue_depth.next_power_of_two())
            .map_err(|_| StorageError::Config(format!("queue depth {queue_depth} too large")))?;
        let ring = build_ring(entries)
            .map_err(|e| StorageError::UringUnavailable(describe_setup_error(&e)))?;
        // Registered files spare the kernel a file-table lookup per request; without
        // them (old kernels) plain descriptors work the same.
        let files_registered = ring.submitter().register_files(&files.fds).is_ok();
        Ok(Self {
            ring,
            files,
            files_registered,
            block_bytes,
            queue_depth,
            stats,
            regions: Vec::new(),
            fixed: Vec::new(),
            slots: (0..queue_depth).map(|_| None).collect(),
            free_slots: (0..queue_depth).rev().collect(),
            in_flight: 0,
            pending: VecDeque::with_capacity(queue_limit(queue_depth)),
            resubmit: VecDeque::new(),
            control: VecDeque::new(),
            completions: Vec::with_capacity(queue_depth),
        })
    }

    fn run(mut self, receiver: Receiver<Request>) {
        let mut open = true;
        loop {
            let idle = self.in_flight == 0 && self.pending.is_empty() && self.resubmit.is_empty();
            if idle {
                self.run_control();
                if !open {
                    break;
                }
                match receiver.recv() {
                    Ok(request) => self.take(request),
                    Err(_) => {
                        open = false;
                        continue;
                    }
                }
            }
            // Take everything already queued, so one submission carries as much as the
            // queue depth allows.
            while open && self.pending.len() < queue_limit(self.queue_depth) {
                match receiver.try_recv() {
                    Ok(request) => self.take(request),
                    Err(crossbeam::channel::TryRecvError::Empty) => break,
                    Err(crossbeam::channel::TryRecvError::Disconnected) => open = false,
                }
            }
            if self.control.is_empty() {
                self.fill();
            } else if self.in_flight == 0 {
                // A registration change waits for the ring to drain, then goes first.
                self.run_control();
                self.fill();
            }
            if self.in_flight == 0 {
                continue;
            }
            // EINTR, EAGAIN and EBUSY (completions to reap first) mean: reap, try again.
            // Anything else means the ring itself is broken; buffers the kernel may still
            // write into cannot be handed back, so stopping is the only safe answer.
            if let Err(e) = self.ring.submit_and_wait(1) {
                match e.raw_os_error() {
                    Some(libc::EINTR | libc::EAGAIN | libc::EBUSY) => {}
                    _ => {
                        log::error!(
                            "io_uring_enter failed: {e}; stopping, since in-flight buffers cannot be recovered"
                        );
                        std::process::abort();
                    }
                }
            }
            self.reap();
        }
    }

    fn take(&mut self, request: Request) {
        match request {
            Request::Op(op) => {
                op.group
                    .add_parts(chunk_count(op.len_bytes, self.block_bytes) - 1);
                self.pending.push_back(Pending { op, next_bytes: 0 });
            }
            control => self.control.push_back(control),
        }
    }

    fn run_control(&mut self) {
        debug_assert_eq!(self.in_flight, 0);
        while let Some(request) = self.control.pop_front() {
            match request {
                Request::Register(region, reply) => {
                    let mut regions = self.regions.clone();
                    regions.push(region);
                    let _ = reply.send(self.reregister(regions));
                }
                Request::Unregister(region, reply) => {
                    let mut regions = self.regions.clone();
                    regions.retain(|r| *r != region);
                    let _ = reply.send(self.reregister(regions));
                }
                Request::Op(_) => unreachable!("ops are never queued as control"),
            }
        }
    }

    /// Replaces the registered buffers with `regions`, split into pieces of at most 1 GiB.
    fn reregister(&mut self, regions: Vec<IoRegion>) -> Result<(), StorageError> {
        if !self.fixed.is_empty() {
            let _ = self.ring.submitter().unregister_buffers();
            self.fixed.clear();
        }
        let mut fixed = Vec::new();
        for region in &regions {
            let mut start = region.ptr as usize;
            let end = start + region.len_bytes;
            while start < end {
                let len_bytes = (end - start).min(MAX_FIXED_BUFFER_BYTES);
                fixed.push(FixedBuffer { start, len_bytes });
                start += len_bytes;
            }
        }
        if fixed.len() > usize::from(u16::MAX) {
            return Err(StorageError::Config(format!(
                "{} registered buffers exceed io_uring's limit",
                fixed.len()
            )));
        }
        if fixed.is_empty() {
            self.regions = regions;
            return Ok(());
        }
        let iovecs: Vec<libc::iovec> = fixed
            .iter()
            .map(|b| libc::iovec {
                iov_base: b.start as *mut libc::c_void,
                iov_len: b.len_bytes,
            })
            .collect();
        // SAFETY: each iovec lies in a region whose registrant promised (register_region's
        // contract) it stays valid until unregistered or the backend is dropped; the
        // ring unregisters on drop.
        match unsafe { self.ring.submitter().register_buffers(&iovecs) } {
            Ok(()) => {
                self.fixed = fixed;
                self.regions = regions;
                Ok(())
            }
            Err(e) => {
                let len_bytes = fixed.iter().map(|b| b.len_bytes).sum();
                // Nothing is registered now; keep the old list of regions out, so
                // transfers fall back to plain buffers rather than naming stale indexes.
                self.regions.clear();
                Err(StorageError::Register {
                    len_bytes,
                    errno: Errno(e.raw_os_error().unwrap_or(libc::EIO)),
                })
            }
        }
    }

    fn fixed_index(&self, ptr: *const u8, len: usize) -> Option<u16> {
        let p = ptr as usize;
        self.fixed
            .iter()
            .position(|b| p >= b.start && p + len <= b.start + b.len_bytes)
            .map(|i| i as u16)
    }

    /// Queues every chunk the queue depth allows, resubmissions first.
    fn fill(&mut self) {
        while self.in_flight < self.queue_depth {
            if let Some(slot) = self.resubmit.pop_front() {
                self.push(slot);
                continue;
            }
            let Some(front) = self.pending.front_mut() else {
                break;
            };
            let op = &front.op;
            let start = front.next_bytes;
            let len_bytes = (op.len_bytes - start).min(self.block_bytes);
            // SAFETY: start < op.len_bytes: inside the op's buffer.
            let ptr = unsafe { op.ptr.add(start) };
            let chunk = Chunk {
                kind: op.kind,
                file: op.file,
                offset_bytes: op.offset_bytes + start as u64,
                ptr,
                len_bytes,
                done_bytes: 0,
                fixed_index: None,
                retries: 0,
                short_transfers: 0,
                started: Instant::now(),
                group: Arc::clone(&op.group),
            };
            front.next_bytes += len_bytes;
            if front.next_bytes == front.op.len_bytes {
                self.pending.pop_front();
            }
            let fixed_index = self.fixed_index(ptr, len_bytes);
            let slot = self
                .free_slots
                .pop()
                .expect("a free slot while under queue depth");
            self.slots[slot] = Some(Chunk {
                fixed_index,
                ..chunk
            });
            self.push(slot);
        }
    }

    /// Puts the (remaining part of the) chunk in `slot` on the submission queue.
    fn push(&mut self, slot: usize) {
        let chunk = self.slots[slot]
            .as_ref()
            .expect("pushed slot holds a chunk");
        let remaining = chunk.len_bytes - chunk.done_bytes;
        // SAFETY: done_bytes < len_bytes: inside the chunk.
        let ptr = unsafe { chunk.ptr.add(chunk.done_bytes) };
        let offset = chunk.offset_bytes + chunk.done_bytes as u64;
        let len = remaining as u32;
        let entry = if self.files_registered {
            types::Fixed(chunk.file as u32).entry(chunk.kind, chunk.fixed_index, ptr, len, offset)
        } else {
            types::Fd(self.files.fds[chunk.file]).entry(
                chunk.kind,
                chunk.fixed_index,
                ptr,
                len,
                offset,
            )
        };
        let entry = entry.user_data(slot as u64);
        // SAFETY: the entry points at memory that stays valid until its completion is
        // reaped (the Pending that owns it waits on the group), and the submission queue
        // has room: it holds queue_depth.next_power_of_two() entries and at most
        // queue_depth are in flight.
        unsafe {
            self.ring
                .submission()
                .push(&entry)
                .expect("submission queue sized to the queue depth");
        }
        self.in_flight += 1;
    }

    fn reap(&mut self) {
        // The completion queue borrows the ring; copy the entries out (into a vector kept
        // for reuse, so reaping allocates nothing) before acting on them.
        let mut completions = std::mem::take(&mut self.completions);
        completions.extend(
            self.ring
                .completion()
                .map(|cqe| (cqe.user_data(), cqe.result())),
        );
        for &(user_data, result) in &completions {
            self.in_flight -= 1;
            self.complete(user_data as usize, result);
        }
        completions.clear();
        self.completions = completions;
    }

    fn complete(&mut self, slot: usize, result: i32) {
        let chunk = self.slots[slot]
            .as_mut()
            .expect("completion for an empty slot");
        let remaining = chunk.len_bytes - chunk.done_bytes;
        let offset = chunk.offset_bytes + chunk.done_bytes as u64;
        let outcome: Option<Result<(), StorageError>> = if result < 0 {
            let errno = -result;
            if is_transient(errno) && chunk.retries < MAX_RETRIES {
                chunk.retries += 1;
                None
            } else {
                Some(Err(io_error(
                    &self.files,
                    chunk.kind,
                    chunk.file,
                    offset,
                    remaining,
                    errno,
                )))
            }
        } else if result == 0 && chunk.kind == OpKind::Read {
            Some(Err(StorageError::UnexpectedEof {
                path: self.files.paths[chunk.file].clone(),
                offset_bytes: offset,
                missing_bytes: remaining,
            }))
        } else if result == 0 {
            chunk.retries += 1;
            (chunk.retries > MAX_RETRIES).then(|| {
                Err(io_error(
                    &self.files,
                    chunk.kind,
                    chunk.file,
                    offset,
                    remaining,
                    libc::EIO,
                ))
            })
        } else {
            chunk.done_bytes += (result as usize).min(remaining);
            if chunk.done_bytes < chunk.len_bytes {
                chunk.short_transfers += 1;
                None
            } else {
                Some(Ok(()))
            }
        };
        let Some(outcome) = outcome else {
            self.resubmit.push_back(slot);
            return;
        };
        let chunk = self.slots[slot].take().expect("slot holds the chunk");
        self.free_slots.push(slot);
        {
            let mut stats = self.stats.lock().expect("stats lock poisoned");
            stats.retries += u64::from(chunk.retries);
            stats.short_transfers += u64::from(chunk.short_transfers);
            if outcome.is_ok() {
                stats.record_chunk(chunk.kind, chunk.len_bytes, chunk.started.elapsed());
                if chunk.fixed_index.is_some() {
                    stats.fixed_chunks += 1;
                } else {
                    stats.plain_chunks += 1;
                }
            }
        }
        chunk.group.finish_part(outcome);
    }
}

impl Drop for RingThread {
    fn drop(&mut self) {
        if !self.fixed.is_empty() {
            let _ = self.ring.submitter().unregister_buffers();
        }
    }
}

/// Builds read/write entries for either a registered or a plain file descriptor.
trait IntoFd {
    fn entry(
        self,
        kind: OpKind,
        fixed: Option<u16>,
        ptr: *mut u8,
        len: u32,
        offset: u64,
    ) -> squeue::Entry;
}

macro_rules! into_fd {
    ($t:ty) => {
        impl IntoFd for $t {
            fn entry(
                self,
                kind: OpKind,
                fixed: Option<u16>,
                ptr: *mut u8,
                len: u32,
                offset: u64,
            ) -> squeue::Entry {
                match (kind, fixed) {
                    (OpKind::Read, Some(index)) => opcode::ReadFixed::new(self, ptr, len, index)
                        .offset(offset)
                        .build(),
                    (OpKind::Read, None) => {
                        opcode::Read::new(self, ptr, len).offset(offset).build()
                    }
                    (OpKind::Write, Some(index)) => opcode::WriteFixed::new(self, ptr, len, index)
                        .offset(offset)
                        .build(),
                    (OpKind::Write, None) => {
                        opcode::Write::new(self, ptr, len).offset(offset).build()
                    }
                }
            }
        }
    };
}

into_fd!(types::Fixed);
into_fd!(types::Fd);

/// Sets up a ring with the cheapest completion mode the kernel offers: single issuer
/// with deferred task running (6.1+), else cooperative task running (5.19+), else plain.
fn build_ring(entries: u32) -> std::io::Result<IoUring> {
    let cq = entries * 2;
    IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_cqsize(cq)
        .build(entries)
        .or_else(|_| {
            IoUring::builder()
                .setup_coop_taskrun()
                .setup_cqsize(cq)
                .build(entries)
        })
        .or_else(|_| IoUring::builder().setup_cqsize(cq).build(entries))
}

fn describe_setup_error(error: &std::io::Error) -> String {
    match error.raw_os_error() {
        Some(libc::EPERM) => "ring setup was refused (EPERM): io_uring is disabled by \
            kernel.io_uring_disabled or a seccomp filter (common in containers); set \
            sysctl kernel.io_uring_disabled=0 or allow io_uring_setup"
            .into(),
        Some(libc::ENOSYS) => {
            "this kernel has no io_uring (ENOSYS): Linux 5.6 or newer is needed".into()
        }
        Some(libc::ENOMEM) => "ring setup ran out of locked memory (ENOMEM): raise the \
            locked-memory limit (ulimit -l, or LimitMEMLOCK= for a service)"
            .into(),
        Some(errno) => format!("ring setup failed: {}", Errno(errno)),
        None => format!("ring setup failed: {error}"),
    }
}

/// The one-time probe behind [`super::probe_uring`]: ring setup, the four opcodes
/// strata uses, and a trial buffer registration.
pub(super) fn probe() -> Result<(), String> {
    let ring = build_ring(8).map_err(|e| describe_setup_error(&e))?;
    let mut probe = Probe::new();
    ring.submitter()
        .register_probe(&mut probe)
        .map_err(|e| format!("the opcode probe failed: {e}; the kernel's io_uring is too old"))?;
    for (name, code) in [
        ("READ", opcode::Read::CODE),
        ("WRITE", opcode::Write::CODE),
        ("READ_FIXED", opcode::ReadFixed::CODE),
        ("WRITE_FIXED", opcode::WriteFixed::CODE),
    ] {
        if !probe.is_supported(code) {
            return Err(format!("the kernel's io_uring lacks the {name} opcode"));
        }
    }
    let mut trial = AlignedBuf::zeroed(4096);
    let iovec = libc::iovec {
        iov_base: trial.as_mut_ptr().cast(),
        iov_len: trial.capacity_bytes(),
    };
    // SAFETY: `trial` outlives the registration, which is undone just below (and by the
    // ring's drop in any case).
    unsafe { ring.submitter().register_buffers(&[iovec]) }.map_err(|e| match e.raw_os_error() {
        Some(libc::ENOMEM) => "registering a 4 KiB buffer failed with ENOMEM: the \
            locked-memory limit is too low; raise it (ulimit -l)"
            .to_string(),
        Some(errno) => format!("a trial buffer registration failed: {}", Errno(errno)),
        None => format!("a trial buffer registration failed: {e}"),
    })?;
    let _ = ring.submitter().unregister_buffers();
    drop(trial);
    Ok(())
}
