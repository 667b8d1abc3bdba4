//! Buffers that I/O owns while it is in flight.
//!
//! I/O takes a buffer by value and hands it back with the result, also on error (the
//! tokio-uring convention), so no one can touch memory the kernel is writing into.
//! [`IoBuf`] is the contract a buffer type signs to take part; [`AlignedBuf`] is the one
//! this crate allocates, and the engine's pinned-pool slots implement it for memory this
//! crate did not allocate.
//!
//! This module does not do I/O and does not know about io_uring registration: a buffer
//! is used as a registered one when its bytes lie inside a region registered with the
//! store ([`crate::TensorStore::register_region`]).

use std::alloc::Layout;
use std::ptr::NonNull;

/// The alignment O_DIRECT I/O needs for memory, file offsets and lengths.
pub const DIRECT_IO_ALIGN: usize = 4096;

/// Buffers of at least this size are backed by transparent huge pages (2 MiB).
///
/// Why: a block device accepts a limited number of memory segments per request (254 on
/// the virtio disk this project is measured on), and every physically separate 4 KiB
/// page is a segment, so a 1 MiB transfer from scattered pages is split into two or
/// three requests. Huge pages are physically contiguous: one segment per 2 MiB.
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// Memory that I/O may read from or write into while it owns the value.
///
/// # Safety
/// An implementation promises that, for as long as the value lives:
/// - `as_ptr`/`as_mut_ptr` return the same address every time, valid for reads and
///   writes of `capacity_bytes()` bytes, and that address does not change when the value
///   is moved (the bytes live behind a pointer, not inside the value);
/// - nothing else reads or writes those bytes while the I/O layer owns the value, so the
///   kernel or an I/O thread may write into them from another thread.
pub unsafe trait IoBuf: Send + 'static {
    /// The first byte.
    fn as_ptr(&self) -> *const u8;
    /// The first byte, for writing into.
    fn as_mut_ptr(&mut self) -> *mut u8;
    /// How many bytes, from [`IoBuf::as_ptr`], I/O may use.
    fn capacity_bytes(&self) -> usize;
}

/// A zero-filled heap buffer aligned to [`DIRECT_IO_ALIGN`] (or more), usable for
/// O_DIRECT I/O. Its length is fixed at allocation.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: AlignedBuf owns its allocation exclusively (like a Box<[u8]>); moving it to
// another thread moves that ownership.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only read through `as_slice`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zero-filled buffer of `len_bytes`, aligned to 4096 bytes (large ones to huge
    /// pages, see [`HUGE_PAGE_BYTES`]). The allocation is rounded up to a multiple of
    /// 4096 so O_DIRECT may transfer whole blocks; `len()` reports the length asked for.
    pub fn zeroed(len_bytes: usize) -> Self {
        Self::zeroed_aligned(len_bytes, DIRECT_IO_ALIGN)
    }

    /// A zero-filled buffer of `len_bytes` aligned to `align` (a power of two, at least
    /// 4096). Buffers of [`HUGE_PAGE_BYTES`] or more are aligned to and rounded up to
    /// whole huge pages and asked to be backed by them (`MADV_HUGEPAGE`; the kernel may
    /// still decline, which costs speed, not correctness).
    pub fn zeroed_aligned(len_bytes: usize, align: usize) -> Self {
        assert!(
            align.is_power_of_two() && align >= DIRECT_IO_ALIGN,
            "alignment {align} must be a power of two of at least {DIRECT_IO_ALIGN}"
        );
        let huge = len_bytes >= HUGE_PAGE_BYTES;
        let (size, align) = if huge {
            (
                len_bytes.next_multiple_of(HUGE_PAGE_BYTES),
                align.max(HUGE_PAGE_BYTES),
            )
        } else {
            (
                len_bytes
                    .next_multiple_of(DIRECT_IO_ALIGN)
                    .max(DIRECT_IO_ALIGN),
                align,
            )
        };
        let layout = Layout::from_size_align(size, align).expect("buffer size overflows");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        if huge {
            // SAFETY: [ptr, ptr + size) is our own allocation, huge-page aligned; the
            // advice only changes how its (not yet touched) pages are backed.
            unsafe { libc::madvise(raw.cast(), size, libc::MADV_HUGEPAGE) };
        }
        // Zero after the advice, so the first touch faults in huge pages.
        // SAFETY: ptr is valid for writes of size bytes.
        unsafe { std::ptr::write_bytes(raw, 0, size) };
        Self {
            ptr,
            len: len_bytes,
            layout,
        }
    }

    /// A buffer holding a copy of `bytes`.
    pub fn from_slice(bytes: &[u8]) -> Self {
        let mut buf = Self::zeroed(bytes.len());
        buf.as_mut_slice().copy_from_slice(bytes);
        buf
    }

    /// The length asked for at allocation.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for layout.size() >= len initialised (zeroed) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, for writing.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and &mut self makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: ptr was allocated with exactly this layout and is freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("align", &self.layout.align())
            .finish()
    }
}

// SAFETY: the allocation is owned by the value, behind a pointer that never changes, and
// is valid for layout.size() bytes; &mut self gives exclusive access.
unsafe impl IoBuf for AlignedBuf {
    fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn capacity_bytes(&self) -> usize {
        self.layout.size()
    }
}

/// A range of memory registered with the I/O layer, so that io_uring can use fixed
/// buffers (ReadFixed/WriteFixed) for any buffer inside it. See
/// [`crate::TensorStore::register_region`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoRegion {
    /// The first byte.
    pub ptr: *mut u8,
    /// Length in bytes.
    pub len_bytes: usize,
}

// SAFETY: an IoRegion is an address range, not access to it; whoever registers it
// promises (in `register_region`'s contract) that the memory stays valid.
unsafe impl Send for IoRegion {}
// SAFETY: as above.
unsafe impl Sync for IoRegion {}

impl IoRegion {
    /// Whether `[ptr, ptr + len)` lies inside this region.
    pub fn contains(&self, ptr: *const u8, len: usize) -> bool {
        let start = self.ptr as usize;
        let p = ptr as usize;
        p >= start
            && p.checked_add(len)
                .is_some_and(|end| end <= start + self.len_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        for len in [0, 1, 4095, 4096, 4097, 1 << 20] {
            let buf = AlignedBuf::zeroed(len);
            assert_eq!(buf.as_ptr() as usize % DIRECT_IO_ALIGN, 0);
            assert_eq!(buf.len(), len);
            assert!(buf.capacity_bytes() >= len);
            assert_eq!(buf.capacity_bytes() % DIRECT_IO_ALIGN, 0);
            assert!(buf.as_slice().iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn region_contains() {
        let mut buf = AlignedBuf::zeroed(8192);
        let region = IoRegion {
            ptr: buf.as_mut_ptr(),
            len_bytes: 8192,
        };
        assert!(region.contains(buf.as_ptr(), 8192));
        // SAFETY: offsets inside (or one past) the same allocation.
        unsafe {
            assert!(region.contains(buf.as_ptr().add(4096), 4096));
            assert!(!region.contains(buf.as_ptr().add(4096), 4097));
        }
        assert!(!region.contains(std::ptr::null(), 1));
    }
}
