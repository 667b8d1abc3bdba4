//! Memory lent to host work ([`Lent`]): a view or lease of the pinned host arena, or, on
//! the CPU device where the plan puts a buffer in device memory, a direct view of device
//! memory. The NVMe lanes move it, the CPU optimizer reads gradients from it and writes
//! parameters into it. Its `unsafe` forwards the I/O buffer contract to the memory it
//! holds, in a room of its own.
//!
//! Not here: how a buffer is lent (`Executor::lend`, `executor.rs`).

use strata_storage::IoBuf;

use crate::device::DirectAccess;

/// Memory lent to host work: a view or lease `H` of the host arena, or (on the CPU
/// device, where the plan puts the buffer in device memory) device memory. The NVMe
/// lanes move it, the CPU optimizer reads gradients from it and writes parameters into
/// it.
pub(super) enum Lent<H> {
    /// Host memory.
    Host(H),
    /// Device memory (the CPU device's).
    Device(DirectAccess),
}

impl<H: std::ops::Deref<Target = [u8]>> std::ops::Deref for Lent<H> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Lent::Host(v) => v,
            Lent::Device(v) => v,
        }
    }
}

impl<H: std::ops::DerefMut<Target = [u8]>> std::ops::DerefMut for Lent<H> {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Lent::Host(v) => v,
            Lent::Device(v) => v,
        }
    }
}

// SAFETY: each variant is an IoBuf; this only forwards to it.
unsafe impl<H: IoBuf> IoBuf for Lent<H> {
    fn as_ptr(&self) -> *const u8 {
        match self {
            Lent::Host(b) => b.as_ptr(),
            Lent::Device(b) => b.as_ptr(),
        }
    }
    fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            Lent::Host(b) => b.as_mut_ptr(),
            Lent::Device(b) => b.as_mut_ptr(),
        }
    }
    fn capacity_bytes(&self) -> usize {
        match self {
            Lent::Host(b) => b.capacity_bytes(),
            Lent::Device(b) => b.capacity_bytes(),
        }
    }
}
