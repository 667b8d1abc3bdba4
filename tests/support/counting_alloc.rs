//! A global allocator that counts the allocations (and reallocations) every thread makes
//! while [`COUNTING`] is set, remembering the sizes of the first few, keeps the bytes
//! live and their high-water mark ([`LIVE_BYTES`], [`PEAK_BYTES`]), and forwards
//! everything to the system allocator. One file for every crate's no-allocation check
//! (each alone in its process), included with `#[path]`: the engine's step, the
//! kernels' matrix product, strata-comm's transports and its MPI check.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Whether allocations are counted now.
pub static COUNTING: AtomicBool = AtomicBool::new(false);
/// Allocations counted so far.
pub static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
/// The sizes of the first allocations counted (since [`ALLOCATIONS`] was last 0), for a
/// failure message.
#[allow(dead_code)] // read by the checks that print them
pub static SIZES: [AtomicUsize; 8] = [const { AtomicUsize::new(0) }; 8];

/// Bytes allocated and not yet freed, by every thread.
#[allow(dead_code)] // read by the checks of memory held
pub static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);
/// The most [`LIVE_BYTES`] since it was last set to the bytes live then.
#[allow(dead_code)] // read by the checks of memory held
pub static PEAK_BYTES: AtomicUsize = AtomicUsize::new(0);

fn grow(bytes: usize) {
    let live = LIVE_BYTES.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK_BYTES.fetch_max(live, Ordering::Relaxed);
}

fn shrink(bytes: usize) {
    LIVE_BYTES.fetch_sub(bytes, Ordering::Relaxed);
}

fn count(size: usize) {
    if COUNTING.load(Ordering::Relaxed) {
        let n = ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        if let Some(slot) = SIZES.get(n) {
            slot.store(size, Ordering::Relaxed);
        }
    }
}

struct Counting;

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        grow(layout.size());
        // SAFETY: the caller's layout goes to the system allocator unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        grow(layout.size());
        // SAFETY: as for alloc.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        shrink(layout.size());
        // SAFETY: ptr came from System.alloc with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        grow(new_size);
        shrink(layout.size());
        // SAFETY: as for alloc and dealloc.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;
