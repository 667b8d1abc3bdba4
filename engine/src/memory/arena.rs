//! The device arena: a device's whole memory budget, allocated once when the device is
//! opened, and sub-allocated from then on without asking the driver (or the host
//! allocator, for the CPU device) for memory again.
//!
//! The arena only does bookkeeping over byte offsets: it never touches the memory, so the
//! same code serves GPU memory (addresses are `CUdeviceptr`s) and the CPU device's host
//! memory. A [`DeviceBuffer`] is a shared handle to one allocation (or a range of it);
//! the allocation goes back to the arena when its last handle drops. The memory itself
//! lives as long as the arena or any buffer does, so a handle can never point at freed
//! device memory.

use std::any::Any;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::EngineError;

/// Every allocation starts at a multiple of this many bytes: what CUDA's own allocator
/// guarantees, and enough for any vector load.
pub const ARENA_ALIGN: usize = 256;

/// A device's memory budget, sub-allocated first-fit with coalescing frees.
#[derive(Clone)]
pub struct DeviceArena {
    inner: Arc<ArenaInner>,
}

struct ArenaInner {
    device: String,
    budget_bytes: usize,
    /// The device address of byte 0 (a `CUdeviceptr`, or a host address on the CPU
    /// device).
    base_address: u64,
    /// Owns the memory; dropped (and the memory freed) after the last buffer.
    _memory: Box<dyn Any + Send + Sync>,
    /// The end of the highest range a kernel or copy has used ([`DeviceArena::check_range`]).
    used_high_water: AtomicUsize,
    state: Mutex<FreeList>,
}

struct FreeList {
    /// Free blocks: offset -> length.
    free: BTreeMap<usize, usize>,
    in_use_bytes: usize,
    high_water_bytes: usize,
    live_allocations: usize,
}

/// A snapshot of an arena's use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaStats {
    /// The device's name.
    pub device: String,
    /// The budget.
    pub budget_bytes: usize,
    /// Bytes allocated now (rounded up to [`ARENA_ALIGN`] per allocation).
    pub in_use_bytes: usize,
    /// The most bytes ever allocated at once.
    pub high_water_bytes: usize,
    /// Allocations alive now.
    pub live_allocations: usize,
    /// The largest contiguous free block.
    pub largest_free_bytes: usize,
}

impl DeviceArena {
    /// An arena over `budget_bytes` of memory starting at device address `base_address`.
    /// `memory` owns that memory and frees it when dropped, which happens only after the
    /// arena and every buffer from it are gone.
    pub(crate) fn new(
        device: String,
        budget_bytes: usize,
        base_address: u64,
        memory: Box<dyn Any + Send + Sync>,
    ) -> Self {
        let mut free = BTreeMap::new();
        if budget_bytes > 0 {
            free.insert(0, budget_bytes);
        }
        Self {
            inner: Arc::new(ArenaInner {
                device,
                budget_bytes,
                base_address,
                _memory: memory,
                used_high_water: AtomicUsize::new(0),
                state: Mutex::new(FreeList {
                    free,
                    in_use_bytes: 0,
                    high_water_bytes: 0,
                    live_allocations: 0,
                }),
            }),
        }
    }

    /// `Ok` when `range` (bytes from the arena's start) lies inside the arena.
    pub fn check_range(&self, range: std::ops::Range<usize>) -> Result<(), EngineError> {
        let budget = self.inner.budget_bytes;
        if range.start > range.end || range.end > budget {
            return Err(EngineError::ForeignResource {
                device: self.inner.device.clone(),
                what: "a range outside its memory",
            });
        }
        self.inner
            .used_high_water
            .fetch_max(range.end, Ordering::Relaxed);
        Ok(())
    }

    /// The end of the highest range any kernel or copy has used, in bytes from the
    /// arena's start: the memory the work really needed, counted as it was submitted
    /// (every kernel binding and copy is checked with [`DeviceArena::check_range`]).
    pub fn used_high_water_bytes(&self) -> usize {
        self.inner.used_high_water.load(Ordering::Relaxed)
    }

    /// The device address of the arena's first byte (a `CUdeviceptr`, or a host address
    /// on the CPU device).
    pub(crate) fn base_address(&self) -> u64 {
        self.inner.base_address
    }

    /// `len_bytes` of device memory, or [`EngineError::DeviceOutOfBudget`] when no free
    /// block is large enough. The contents are whatever the last user left.
    pub fn alloc(&self, len_bytes: usize) -> Result<DeviceBuffer, EngineError> {
        // A request near usize::MAX would round up past it (to 0 in release builds) and
        // be handed a buffer overlapping others: anything over the budget is refused
        // before it is rounded.
        let rounded = (len_bytes <= self.inner.budget_bytes)
            .then(|| len_bytes.max(1).checked_next_multiple_of(ARENA_ALIGN))
            .flatten();
        let mut state = self.inner.lock();
        let found = rounded.and_then(|rounded| {
            state
                .free
                .iter()
                .find(|&(_, &len)| len >= rounded)
                .map(|(&offset, &len)| (offset, len))
        });
        let Some((offset, block_len)) = found else {
            return Err(EngineError::DeviceOutOfBudget {
                device: self.inner.device.clone(),
                requested_bytes: len_bytes,
                budget_bytes: self.inner.budget_bytes,
                in_use_bytes: state.in_use_bytes,
                largest_free_bytes: state.largest_free(),
            });
        };
        let rounded = rounded.expect("a block was found for a rounded size");
        state.free.remove(&offset);
        if block_len > rounded {
            state.free.insert(offset + rounded, block_len - rounded);
        }
        state.in_use_bytes += rounded;
        state.high_water_bytes = state.high_water_bytes.max(state.in_use_bytes);
        state.live_allocations += 1;
        drop(state);
        Ok(DeviceBuffer {
            allocation: Arc::new(Allocation {
                arena: Arc::clone(&self.inner),
                offset_bytes: offset,
                reserved_bytes: rounded,
            }),
            offset_bytes: 0,
            len_bytes,
        })
    }

    /// A snapshot of the arena's use.
    pub fn stats(&self) -> ArenaStats {
        let state = self.inner.lock();
        ArenaStats {
            device: self.inner.device.clone(),
            budget_bytes: self.inner.budget_bytes,
            in_use_bytes: state.in_use_bytes,
            high_water_bytes: state.high_water_bytes,
            live_allocations: state.live_allocations,
            largest_free_bytes: state.largest_free(),
        }
    }

    /// Whether `buffer` was allocated from this arena.
    pub fn owns(&self, buffer: &DeviceBuffer) -> bool {
        Arc::ptr_eq(&self.inner, &buffer.allocation.arena)
    }

    /// [`EngineError::ForeignResource`] unless `buffer` was allocated from this arena.
    pub fn check_owns(&self, buffer: &DeviceBuffer) -> Result<(), EngineError> {
        if self.owns(buffer) {
            Ok(())
        } else {
            Err(EngineError::ForeignResource {
                device: self.inner.device.clone(),
                what: "a buffer",
            })
        }
    }

    /// The device's name.
    pub fn device(&self) -> &str {
        &self.inner.device
    }
}

impl std::fmt::Debug for DeviceArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceArena")
            .field("device", &self.inner.device)
            .field("budget_bytes", &self.inner.budget_bytes)
            .finish()
    }
}

impl ArenaInner {
    fn lock(&self) -> std::sync::MutexGuard<'_, FreeList> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl FreeList {
    fn largest_free(&self) -> usize {
        self.free.values().copied().max().unwrap_or(0)
    }
}

/// One block taken from an arena; returned to it on drop.
struct Allocation {
    arena: Arc<ArenaInner>,
    offset_bytes: usize,
    reserved_bytes: usize,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        let mut state = self.arena.lock();
        let mut offset = self.offset_bytes;
        let mut len = self.reserved_bytes;
        // Coalesce with the free block just before and just after, so fragmentation does
        // not accumulate across steps.
        if let Some((&prev_offset, &prev_len)) = state.free.range(..offset).next_back()
            && prev_offset + prev_len == offset
        {
            state.free.remove(&prev_offset);
            offset = prev_offset;
            len += prev_len;
        }
        if let Some(next_len) = state.free.remove(&(offset + len)) {
            len += next_len;
        }
        state.free.insert(offset, len);
        state.in_use_bytes -= self.reserved_bytes;
        state.live_allocations -= 1;
    }
}

/// A range of device memory from a [`DeviceArena`]. Clones share the same allocation,
/// which goes back to the arena when the last clone drops; operations in flight hold a
/// clone, so memory is never reallocated under a copy.
///
/// Reading and writing the bytes goes through the device: views inside a CPU-device
/// operation, or the raw address from `CudaDevice::device_ptr` for CUDA kernels.
#[derive(Clone)]
pub struct DeviceBuffer {
    allocation: Arc<Allocation>,
    /// Start of this view inside the allocation.
    offset_bytes: usize,
    len_bytes: usize,
}

impl DeviceBuffer {
    /// Bytes in this buffer (or view).
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len_bytes == 0
    }

    /// The buffer's first byte, counted from the start of the device's memory.
    pub fn arena_offset_bytes(&self) -> usize {
        self.allocation.offset_bytes + self.offset_bytes
    }

    /// The buffer's bytes as a range from the start of the device's memory.
    pub fn arena_range(&self) -> Range<usize> {
        let start = self.arena_offset_bytes();
        start..start + self.len_bytes
    }

    /// A view of `range` (in bytes, relative to this buffer), sharing the allocation.
    pub fn slice(&self, range: Range<usize>) -> DeviceBuffer {
        assert!(
            range.start <= range.end && range.end <= self.len_bytes,
            "range {range:?} is outside a device buffer of {} bytes",
            self.len_bytes
        );
        DeviceBuffer {
            allocation: Arc::clone(&self.allocation),
            offset_bytes: self.offset_bytes + range.start,
            len_bytes: range.end - range.start,
        }
    }

    /// The device address of the first byte.
    pub(crate) fn address(&self) -> u64 {
        self.allocation.arena.base_address + self.arena_offset_bytes() as u64
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("device", &self.allocation.arena.device)
            .field("arena_range", &self.arena_range())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arena(budget: usize) -> DeviceArena {
        DeviceArena::new("test".into(), budget, 0x1000_0000, Box::new(()))
    }

    #[test]
    fn allocations_are_aligned_disjoint_and_within_budget() {
        let arena = arena(4096);
        let a = arena.alloc(1).unwrap();
        let b = arena.alloc(300).unwrap();
        let c = arena.alloc(256).unwrap();
        for buf in [&a, &b, &c] {
            assert_eq!(buf.arena_offset_bytes() % ARENA_ALIGN, 0);
            assert!(buf.arena_range().end <= 4096);
        }
        assert!(a.arena_range().end <= b.arena_offset_bytes());
        assert!(b.arena_range().end <= c.arena_offset_bytes());
        assert_eq!(b.address(), 0x1000_0000 + b.arena_offset_bytes() as u64);
        let stats = arena.stats();
        assert_eq!(stats.in_use_bytes, 256 + 512 + 256);
        assert_eq!(stats.live_allocations, 3);
    }

    #[test]
    fn out_of_budget_is_an_error_that_names_the_budget() {
        let arena = arena(1024);
        let _held = arena.alloc(768).unwrap();
        match arena.alloc(512) {
            Err(EngineError::DeviceOutOfBudget {
                requested_bytes,
                budget_bytes,
                in_use_bytes,
                largest_free_bytes,
                ..
            }) => {
                assert_eq!(requested_bytes, 512);
                assert_eq!(budget_bytes, 1024);
                assert_eq!(in_use_bytes, 768);
                assert_eq!(largest_free_bytes, 256);
            }
            other => panic!("expected DeviceOutOfBudget, got {other:?}"),
        }
    }

    #[test]
    fn sizes_near_usize_max_are_out_of_budget_not_wrapped() {
        let arena = arena(4096);
        let _held = arena.alloc(100).unwrap();
        for len in [
            usize::MAX,
            usize::MAX - 100,
            usize::MAX - ARENA_ALIGN + 1,
            4097,
        ] {
            assert!(
                matches!(arena.alloc(len), Err(EngineError::DeviceOutOfBudget { .. })),
                "{len}"
            );
        }
        assert_eq!(arena.stats().in_use_bytes, 256, "nothing was handed out");
    }

    #[test]
    fn frees_coalesce_so_the_whole_budget_comes_back() {
        let arena = arena(4 * ARENA_ALIGN);
        let bufs: Vec<_> = (0..4).map(|_| arena.alloc(ARENA_ALIGN).unwrap()).collect();
        assert!(arena.alloc(1).is_err());
        // Free in an order that needs both backward and forward merges.
        let mut bufs: Vec<Option<DeviceBuffer>> = bufs.into_iter().map(Some).collect();
        for i in [1, 3, 0, 2] {
            bufs[i] = None;
        }
        let stats = arena.stats();
        assert_eq!(stats.in_use_bytes, 0);
        assert_eq!(stats.largest_free_bytes, 4 * ARENA_ALIGN);
        assert_eq!(stats.high_water_bytes, 4 * ARENA_ALIGN);
        let whole = arena.alloc(4 * ARENA_ALIGN).unwrap();
        assert_eq!(whole.arena_offset_bytes(), 0);
    }

    #[test]
    fn a_slice_keeps_the_allocation_alive() {
        let arena = arena(1024);
        let buf = arena.alloc(512).unwrap();
        let view = buf.slice(128..384);
        assert_eq!(view.len_bytes(), 256);
        assert_eq!(view.arena_offset_bytes(), buf.arena_offset_bytes() + 128);
        drop(buf);
        assert_eq!(arena.stats().live_allocations, 1);
        drop(view);
        assert_eq!(arena.stats().live_allocations, 0);
        assert!(arena.owns(&arena.alloc(1).unwrap()));
        assert!(!self::arena(1024).owns(&arena.alloc(1).unwrap()));
    }
}
