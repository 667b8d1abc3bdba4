//! The pinned host pool: one page-locked mapping, allocated at start from a byte budget
//! and carved into equal slots, through which every byte moving between tiers passes.
//!
//! Free slots sit in a lock-free queue, so an acquire that finds a free slot takes no lock.
//! Only an acquire that finds the pool empty takes a mutex, to sleep on a condition
//! variable for at most its timeout; a release takes that mutex only when someone sleeps.
//! A [`SlotLease`] gives its slot back when dropped, and implements the storage crate's
//! [`IoBuf`] so an NVMe read can land in the slot the host-to-device copy starts from.
//!
//! Page-locking, in order of preference: with CUDA the driver registers the mapping
//! (`cuMemHostRegister`, never write-combined memory: the CPU reads that very slowly);
//! without CUDA `mlock`; when `mlock` is refused (RLIMIT_MEMLOCK without CAP_IPC_LOCK), plain
//! memory, pre-faulted, with one warning per process.
//!
//! This file holds the pool's `unsafe`: the mapping and its lifetime. It does not copy to
//! devices (that is `crate::device`) and does not do I/O (that is `strata_storage`).

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering, fence};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam::queue::ArrayQueue;
use hdrhistogram::Histogram;
use strata_storage::{DIRECT_IO_ALIGN, IoBuf, IoRegion, TensorStore};

use super::host::HostMapping;
use super::locking::{HostLocking, Pinning};
use crate::error::EngineError;

/// The size and limits of a pool, validated by [`PinnedPool::new`].
#[derive(Debug, Clone)]
pub struct PinnedPoolConfig {
    /// The pool's name, used in errors and stats ("prefetch", "grads").
    pub name: String,
    /// Bytes the pool may map. The pool holds `budget_bytes / slot_bytes` slots.
    pub budget_bytes: usize,
    /// Bytes per slot, rounded up to a multiple of [`DIRECT_IO_ALIGN`] so slots can take
    /// O_DIRECT reads.
    pub slot_bytes: usize,
    /// How long [`PinnedPool::acquire`] waits for a slot before failing.
    pub acquire_timeout: Duration,
}

/// A fixed set of page-locked slots, shared by cloning.
#[derive(Clone)]
pub struct PinnedPool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    name: String,
    budget_bytes: usize,
    slot_bytes: usize,
    slot_count: usize,
    acquire_timeout: Duration,
    mapping: HostMapping,
    /// Indices of free slots.
    free: ArrayQueue<u32>,
    /// Whether each slot is leased: checks that no slot is ever handed out twice.
    leased: Box<[AtomicBool]>,
    in_use_slots: AtomicUsize,
    high_water_slots: AtomicUsize,
    acquires: AtomicU64,
    waits: AtomicU64,
    timeouts: AtomicU64,
    wait_total_ns: AtomicU64,
    /// Acquirers asleep on `wakeup`; a release takes `sleep_lock` only when this is
    /// non-zero.
    sleepers: AtomicUsize,
    sleep_lock: Mutex<()>,
    wakeup: Condvar,
    /// Wait times of acquires that found the pool empty, in nanoseconds.
    wait_ns: Mutex<Histogram<u64>>,
}

/// A snapshot of a pool's counters.
#[derive(Debug, Clone)]
pub struct PoolStats {
    /// The pool's name.
    pub name: String,
    /// Bytes per slot.
    pub slot_bytes: usize,
    /// Slots in the pool.
    pub slot_count: usize,
    /// The configured budget (the mapping is `slot_bytes * slot_count`, at most this).
    pub budget_bytes: usize,
    /// How the memory is locked.
    pub locking: HostLocking,
    /// Slots leased now.
    pub in_use_slots: usize,
    /// The most slots ever leased at once.
    pub high_water_slots: usize,
    /// Successful acquires.
    pub acquires: u64,
    /// Acquires that found the pool empty and had to wait (successful or not).
    pub waits: u64,
    /// Acquires that gave up.
    pub timeouts: u64,
    /// Total time spent waiting.
    pub wait_total: Duration,
    /// Median wait of the acquires that waited.
    pub wait_p50: Duration,
    /// 99th percentile wait of the acquires that waited.
    pub wait_p99: Duration,
    /// Longest wait.
    pub wait_max: Duration,
}

impl PinnedPool {
    /// Maps `config.budget_bytes` (rounded down to whole slots), locks it as `pinning`
    /// says, and makes every slot free.
    pub fn new(config: PinnedPoolConfig, pinning: &Pinning) -> Result<Self, EngineError> {
        let invalid = |reason: String| EngineError::PinnedPoolConfig {
            pool: config.name.clone(),
            reason,
        };
        if config.slot_bytes == 0 {
            return Err(invalid("the slot size is zero".into()));
        }
        let Some(slot_bytes) = config.slot_bytes.checked_next_multiple_of(DIRECT_IO_ALIGN) else {
            return Err(invalid(format!(
                "the slot size of {} bytes cannot be rounded up to whole pages",
                config.slot_bytes
            )));
        };
        let slot_count = config.budget_bytes / slot_bytes;
        if slot_count == 0 {
            return Err(invalid(format!(
                "the budget of {} bytes is smaller than one slot of {slot_bytes} bytes; raise \
                 the pinned-memory budget or lower the slot size",
                config.budget_bytes
            )));
        }
        if u32::try_from(slot_count).is_err() {
            return Err(invalid(format!(
                "{slot_count} slots is more than a pool can index; use larger slots"
            )));
        }
        let mut mapping = HostMapping::map(slot_bytes * slot_count).map_err(|source| {
            EngineError::HostMemory {
                pool: config.name.clone(),
                size_bytes: slot_bytes * slot_count,
                source,
            }
        })?;
        mapping.lock(&config.name, pinning)?;
        let free = ArrayQueue::new(slot_count);
        for index in 0..slot_count {
            free.push(index as u32).expect("the queue holds every slot");
        }
        // One hour in nanoseconds bounds the histogram; longer waits saturate.
        let wait_ns = Histogram::new_with_bounds(1, 3_600_000_000_000, 3)
            .expect("constant histogram bounds are valid");
        Ok(Self {
            inner: Arc::new(PoolInner {
                name: config.name,
                budget_bytes: config.budget_bytes,
                slot_bytes,
                slot_count,
                acquire_timeout: config.acquire_timeout,
                mapping,
                free,
                leased: (0..slot_count).map(|_| AtomicBool::new(false)).collect(),
                in_use_slots: AtomicUsize::new(0),
                high_water_slots: AtomicUsize::new(0),
                acquires: AtomicU64::new(0),
                waits: AtomicU64::new(0),
                timeouts: AtomicU64::new(0),
                wait_total_ns: AtomicU64::new(0),
                sleepers: AtomicUsize::new(0),
                sleep_lock: Mutex::new(()),
                wakeup: Condvar::new(),
                wait_ns: Mutex::new(wait_ns),
            }),
        })
    }

    /// A free slot, waiting up to the configured timeout for one.
    pub fn acquire(&self) -> Result<SlotLease, EngineError> {
        self.acquire_timeout(self.inner.acquire_timeout)
    }

    /// A free slot now, or `None` when every slot is leased. Never blocks.
    pub fn try_acquire(&self) -> Option<SlotLease> {
        let index = self.inner.free.pop()?;
        Some(self.lease(index))
    }

    /// A free slot, waiting up to `timeout` for one; then
    /// [`EngineError::PinnedPoolExhausted`].
    pub fn acquire_timeout(&self, timeout: Duration) -> Result<SlotLease, EngineError> {
        if let Some(lease) = self.try_acquire() {
            return Ok(lease);
        }
        let inner = &*self.inner;
        let start = Instant::now();
        // A timeout too long to add (Duration::MAX, "wait for ever") has no deadline.
        let deadline = start.checked_add(timeout);
        inner.waits.fetch_add(1, Ordering::Relaxed);
        let mut guard = inner.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
        inner.sleepers.fetch_add(1, Ordering::SeqCst);
        // Pairs with the fence in `release`: either the releaser sees this sleeper and
        // notifies under the lock, or this pop sees the slot it pushed.
        fence(Ordering::SeqCst);
        let found = loop {
            if let Some(index) = inner.free.pop() {
                break Some(index);
            }
            let now = Instant::now();
            guard = match deadline {
                Some(deadline) if now >= deadline => break None,
                Some(deadline) => {
                    inner
                        .wakeup
                        .wait_timeout(guard, deadline - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                None => inner.wakeup.wait(guard).unwrap_or_else(|e| e.into_inner()),
            };
        };
        inner.sleepers.fetch_sub(1, Ordering::SeqCst);
        drop(guard);
        let waited = start.elapsed();
        let waited_ns = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
        inner.wait_total_ns.fetch_add(waited_ns, Ordering::Relaxed);
        inner
            .wait_ns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .saturating_record(waited_ns.max(1));
        match found {
            Some(index) => Ok(self.lease(index)),
            None => {
                inner.timeouts.fetch_add(1, Ordering::Relaxed);
                Err(EngineError::PinnedPoolExhausted {
                    pool: inner.name.clone(),
                    slot_count: inner.slot_count,
                    slot_bytes: inner.slot_bytes,
                    budget_bytes: inner.budget_bytes,
                    in_use_slots: inner.in_use_slots.load(Ordering::Relaxed),
                    waited,
                })
            }
        }
    }

    fn lease(&self, index: u32) -> SlotLease {
        let inner = &*self.inner;
        let was_leased = inner.leased[index as usize].swap(true, Ordering::AcqRel);
        assert!(
            !was_leased,
            "pinned pool '{}': slot {index} handed out twice",
            inner.name
        );
        let in_use = inner.in_use_slots.fetch_add(1, Ordering::Relaxed) + 1;
        inner.high_water_slots.fetch_max(in_use, Ordering::Relaxed);
        inner.acquires.fetch_add(1, Ordering::Relaxed);
        // SAFETY: index < slot_count, so the offset stays inside the mapping.
        let ptr = unsafe { inner.mapping.ptr().add(index as usize * inner.slot_bytes) };
        SlotLease {
            pool: Arc::clone(&self.inner),
            index,
            ptr,
        }
    }

    /// The pool's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Bytes per slot (a multiple of [`DIRECT_IO_ALIGN`]).
    pub fn slot_bytes(&self) -> usize {
        self.inner.slot_bytes
    }

    /// Slots in the pool.
    pub fn slot_count(&self) -> usize {
        self.inner.slot_count
    }

    /// How the pool's memory is locked.
    pub fn locking(&self) -> &HostLocking {
        self.inner.mapping.locking()
    }

    /// Registers the whole pool with `store`'s io_uring backend, so NVMe reads into and
    /// writes from any slot use fixed buffers: the read lands in the slot the
    /// host-to-device copy starts from, with no per-I/O page pinning. (The threaded
    /// backend accepts this and ignores it.) The pool keeps a clone of the store and
    /// unregisters from it before its memory is unmapped.
    pub fn register_with(&self, store: &TensorStore) -> Result<(), EngineError> {
        self.inner.mapping.register_with(store)
    }

    /// The whole mapping as an I/O region. It stays mapped while this pool or any of
    /// its leases lives; [`PinnedPool::register_with`] registers it safely.
    pub fn io_region(&self) -> IoRegion {
        self.inner.mapping.io_region()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> PoolStats {
        let inner = &*self.inner;
        let histogram = inner.wait_ns.lock().unwrap_or_else(|e| e.into_inner());
        let quantile = |q: f64| {
            if histogram.is_empty() {
                Duration::ZERO
            } else {
                Duration::from_nanos(histogram.value_at_quantile(q))
            }
        };
        PoolStats {
            name: inner.name.clone(),
            slot_bytes: inner.slot_bytes,
            slot_count: inner.slot_count,
            budget_bytes: inner.budget_bytes,
            locking: inner.mapping.locking().clone(),
            in_use_slots: inner.in_use_slots.load(Ordering::Relaxed),
            high_water_slots: inner.high_water_slots.load(Ordering::Relaxed),
            acquires: inner.acquires.load(Ordering::Relaxed),
            waits: inner.waits.load(Ordering::Relaxed),
            timeouts: inner.timeouts.load(Ordering::Relaxed),
            wait_total: Duration::from_nanos(inner.wait_total_ns.load(Ordering::Relaxed)),
            wait_p50: quantile(0.5),
            wait_p99: quantile(0.99),
            wait_max: if histogram.is_empty() {
                Duration::ZERO
            } else {
                Duration::from_nanos(histogram.max())
            },
        }
    }
}

impl std::fmt::Debug for PinnedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedPool")
            .field("name", &self.inner.name)
            .field("slot_bytes", &self.inner.slot_bytes)
            .field("slot_count", &self.inner.slot_count)
            .field("locking", self.inner.mapping.locking())
            .finish()
    }
}

impl PoolInner {
    fn release(&self, index: u32) {
        let was_leased = self.leased[index as usize].swap(false, Ordering::AcqRel);
        assert!(
            was_leased,
            "pinned pool '{}': slot {index} released twice",
            self.name
        );
        self.in_use_slots.fetch_sub(1, Ordering::Relaxed);
        self.free
            .push(index)
            .expect("a released slot always has room in the free queue");
        // Pairs with the fence in `acquire_timeout` (see there).
        fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = self.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            self.wakeup.notify_one();
        }
    }
}

/// One slot of a [`PinnedPool`], held exclusively; the slot goes back to the pool when
/// this is dropped.
///
/// A device copy takes the lease by value and hands it back only once the copy has
/// completed, so a slot is never reused while a copy still reads or writes it.
pub struct SlotLease {
    pool: Arc<PoolInner>,
    index: u32,
    ptr: NonNull<u8>,
}

// SAFETY: a lease is exclusive access to its slot (the `leased` flags assert no slot is
// handed out twice); moving it to another thread moves that access.
unsafe impl Send for SlotLease {}
// SAFETY: shared references only read the slot.
unsafe impl Sync for SlotLease {}

impl SlotLease {
    /// The slot's index in its pool.
    pub fn index(&self) -> usize {
        self.index as usize
    }

    /// Bytes in the slot.
    pub fn len_bytes(&self) -> usize {
        self.pool.slot_bytes
    }

    /// The name of the pool the slot belongs to.
    pub fn pool_name(&self) -> &str {
        &self.pool.name
    }

    /// How the slot's memory is locked.
    pub fn locking(&self) -> &HostLocking {
        self.pool.mapping.locking()
    }

    /// The slot's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the slot lies inside the live mapping (the lease holds the pool), its
        // bytes are initialised (anonymous mappings are zero-filled), and the lease is the
        // only way to reach them.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.pool.slot_bytes) }
    }

    /// The slot's bytes, for writing.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.pool.slot_bytes) }
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        self.pool.release(self.index);
    }
}

impl std::fmt::Debug for SlotLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotLease")
            .field("pool", &self.pool.name)
            .field("index", &self.index)
            .field("len_bytes", &self.pool.slot_bytes)
            .finish()
    }
}

// SAFETY: the slot's address is fixed for the lease's life (it points into the pool's
// mapping, which the lease keeps alive), valid for `slot_bytes` reads and writes, and the
// lease is exclusive, so whoever owns it may let the kernel write into it.
unsafe impl IoBuf for SlotLease {
    fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn capacity_bytes(&self) -> usize {
        self.pool.slot_bytes
    }
}
