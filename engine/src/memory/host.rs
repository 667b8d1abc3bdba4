//! Anonymous host memory the engine maps for itself: the pinned pool's slots and the CPU
//! device's simulated device memory. A mapping starts zeroed and lazily backed (the kernel
//! supplies pages on first touch, so a large budget costs nothing until it is used), and
//! can then be page-locked as a [`Pinning`] says.
//!
//! This file holds the `unsafe` of mmap, mlock and cuMemHostRegister. It knows nothing of
//! slots or arenas.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Once};

use cudarc::driver::{CudaContext, sys};
use strata_storage::{HUGE_PAGE_BYTES, IoRegion, TensorStore};

use super::locking::{HostLocking, Pinning};
use crate::error::EngineError;

/// An anonymous private mapping, unlocked (and unregistered) and unmapped on drop.
pub(crate) struct HostMapping {
    ptr: NonNull<u8>,
    len_bytes: usize,
    locking: HostLocking,
    /// The context the mapping is registered in, kept alive until it is unregistered.
    cuda: Option<Arc<CudaContext>>,
    /// Set when something may still use the memory after this value is gone (a
    /// registration that could not be undone): then it is left mapped, not unmapped.
    leak: bool,
    /// Stores the mapping is registered with; unregistered before it is unmapped.
    registered_with: Mutex<Vec<TensorStore>>,
}

// SAFETY: the mapping is plain memory owned by this value; its users hand out disjoint
// parts of it (pool slots, arena ranges) and say why each access is exclusive.
unsafe impl Send for HostMapping {}
// SAFETY: as above; HostMapping itself never reads or writes the bytes.
unsafe impl Sync for HostMapping {}

impl HostMapping {
    /// Maps `len_bytes` (rounded up to whole pages, at least one) of zeroed, not yet
    /// backed memory. From [`HUGE_PAGE_BYTES`] up the mapping starts on a huge-page
    /// boundary and asks for transparent huge pages: fewer TLB misses when the CPU
    /// streams through it, fewer pages for the driver to pin, and one DMA segment per
    /// 2 MiB for O_DIRECT (a refusal costs speed, not correctness).
    pub(crate) fn map(len_bytes: usize) -> std::io::Result<Self> {
        let len_bytes = len_bytes.max(1).next_multiple_of(page_bytes());
        let huge = len_bytes >= HUGE_PAGE_BYTES;
        // Over-map by one huge page so an aligned start lies inside, then trim.
        let mapped_bytes = if huge {
            len_bytes + HUGE_PAGE_BYTES
        } else {
            len_bytes
        };
        // SAFETY: an anonymous private mapping touches no existing memory.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let raw = raw.cast::<u8>();
        let start = if huge {
            let head = (raw as usize).next_multiple_of(HUGE_PAGE_BYTES) - raw as usize;
            let tail = mapped_bytes - head - len_bytes;
            // SAFETY: head and tail are page-aligned pieces of our own fresh mapping,
            // outside [raw + head, raw + head + len_bytes), which we keep.
            unsafe {
                if head > 0 {
                    libc::munmap(raw.cast(), head);
                }
                if tail > 0 {
                    libc::munmap(raw.add(head + len_bytes).cast(), tail);
                }
                let start = raw.add(head);
                // Advice only; a kernel without THP refuses harmlessly.
                libc::madvise(start.cast(), len_bytes, libc::MADV_HUGEPAGE);
                start
            }
        } else {
            raw
        };
        Ok(Self {
            ptr: NonNull::new(start).expect("mmap never returns null on success"),
            len_bytes,
            locking: HostLocking::Unlocked {
                reason: "not asked to be locked".into(),
            },
            cuda: None,
            leak: false,
            registered_with: Mutex::new(Vec::new()),
        })
    }

    /// Page-locks the whole mapping as `pinning` says; `owner` names it in messages.
    /// With `Mlock`, a refusal is not an error: the memory is pre-faulted instead, the
    /// process warns once, and [`HostMapping::locking`] says why.
    pub(crate) fn lock(&mut self, owner: &str, pinning: &Pinning) -> Result<(), EngineError> {
        let raw = self.ptr.as_ptr().cast::<libc::c_void>();
        match pinning {
            Pinning::Cuda(ctx) => {
                ctx.bind_to_thread()
                    .map_err(EngineError::cuda("binding the context"))?;
                // SAFETY: registers our own live mapping, page-aligned, for its whole
                // length; it is unregistered in Drop before it is unmapped.
                unsafe {
                    sys::cuMemHostRegister_v2(raw, self.len_bytes, sys::CU_MEMHOSTREGISTER_PORTABLE)
                }
                .result()
                .map_err(|source| EngineError::CudaHostRegister {
                    pool: owner.to_string(),
                    size_bytes: self.len_bytes,
                    source,
                })?;
                self.locking = HostLocking::CudaRegistered;
                self.cuda = Some(Arc::clone(ctx));
            }
            Pinning::Mlock => {
                // SAFETY: locks our own live mapping; mlock also faults every page in.
                if unsafe { libc::mlock(raw, self.len_bytes) } == 0 {
                    self.locking = HostLocking::Mlocked;
                } else {
                    let reason = mlock_refusal(self.len_bytes, std::io::Error::last_os_error());
                    warn_unlocked_once(owner, &reason);
                    self.prefault();
                    self.locking = HostLocking::Unlocked { reason };
                }
            }
        }
        Ok(())
    }

    /// The first byte.
    pub(crate) fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// The whole mapping, as the storage crate registers it.
    pub(crate) fn io_region(&self) -> IoRegion {
        IoRegion {
            ptr: self.ptr.as_ptr(),
            len_bytes: self.len_bytes,
        }
    }

    /// Registers the whole mapping with `store`'s io_uring backend as fixed buffers (the
    /// threaded backend accepts and ignores this); it is unregistered before the mapping
    /// is unmapped, and left mapped if that fails.
    pub(crate) fn register_with(&self, store: &TensorStore) -> Result<(), EngineError> {
        let mut registered = self
            .registered_with
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        // SAFETY: the region is this mapping, which stays mapped until Drop, and Drop
        // unregisters it from every store in `registered_with` first (leaking the mapping
        // when one cannot be undone).
        unsafe { store.register_region(self.io_region()) }?;
        registered.push(store.clone());
        Ok(())
    }

    /// How the memory is locked.
    pub(crate) fn locking(&self) -> &HostLocking {
        &self.locking
    }

    /// Touches every page so unlocked memory does not fault on the hot path.
    fn prefault(&mut self) {
        let page = page_bytes();
        let mut offset = 0;
        while offset < self.len_bytes {
            // SAFETY: offset < len_bytes, inside our own writable mapping, which `&mut
            // self` shows nobody else is using.
            unsafe { self.ptr.as_ptr().add(offset).write_volatile(0) };
            offset += page;
        }
    }
}

impl Drop for HostMapping {
    fn drop(&mut self) {
        // Whoever owns the mapping holds every lease of it, so no I/O into it is in
        // flight; io_uring still holds its pages until each store unregisters them.
        let region = self.io_region();
        let stores = self
            .registered_with
            .get_mut()
            .unwrap_or_else(|e| e.into_inner());
        for store in stores.drain(..) {
            if let Err(e) = store.unregister_region(region) {
                log::error!(
                    "unregistering {} bytes of host memory from a store failed: {e}; leaving \
                     them mapped, since io_uring may still hold them",
                    self.len_bytes
                );
                self.leak = true;
            }
        }
        let raw = self.ptr.as_ptr().cast::<libc::c_void>();
        if let Some(ctx) = &self.cuda {
            // The mapping's owner outlives every copy from or into it (pool leases hold
            // the pool, and copies hand leases back only after their event completed).
            // cudarc's bind reports (and clears) an error an earlier call left behind;
            // one retry binds for real.
            let result = ctx
                .bind_to_thread()
                .or_else(|_| ctx.bind_to_thread())
                .and_then(|()| {
                    // SAFETY: `raw` was registered in `lock` and is unregistered once.
                    unsafe { sys::cuMemHostUnregister(raw) }.result()
                });
            if let Err(e) = result {
                log::error!(
                    "cuMemHostUnregister failed: {e}; leaving {} bytes mapped, since the \
                     driver may still use them",
                    self.len_bytes
                );
                self.leak = true;
            }
        }
        if self.leak {
            return;
        }
        // SAFETY: our own mapping, of exactly this length, unmapped once, with nothing
        // registered on it any more; munmap also drops any mlock.
        unsafe { libc::munmap(raw, self.len_bytes) };
    }
}

fn page_bytes() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).unwrap_or(4096).max(1)
}

/// How much memory this process may page-lock: RLIMIT_MEMLOCK, which bounds `mlock` and
/// io_uring's registered buffers, and whether CAP_IPC_LOCK lifts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemlockLimit {
    /// The soft limit in bytes, the one in force; `None` when unlimited.
    pub soft_bytes: Option<u64>,
    /// The hard limit in bytes, up to which `ulimit -l` raises the soft one without
    /// privilege; `None` when unlimited.
    pub hard_bytes: Option<u64>,
    /// Whether the calling thread holds CAP_IPC_LOCK, with which the limit does not apply.
    pub cap_ipc_lock: bool,
}

/// The bit of CAP_IPC_LOCK in the capability sets of /proc/*/status.
const CAP_IPC_LOCK: u32 = 14;

impl MemlockLimit {
    /// Reads the limit (getrlimit) and the calling thread's effective capabilities
    /// (/proc/thread-self/status: capabilities belong to threads).
    pub fn current() -> std::io::Result<Self> {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit into the struct we pass.
        if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let bytes = |value: libc::rlim_t| (value != libc::RLIM_INFINITY).then_some(value);
        let status = std::fs::read_to_string("/proc/thread-self/status").unwrap_or_default();
        let cap_ipc_lock = status
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
            .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0);
        Ok(Self {
            soft_bytes: bytes(limit.rlim_cur),
            hard_bytes: bytes(limit.rlim_max),
            cap_ipc_lock,
        })
    }

    /// The most bytes `mlock` will lock for this thread; `None` when nothing limits it.
    pub fn lockable_bytes(&self) -> Option<u64> {
        if self.cap_ipc_lock {
            None
        } else {
            self.soft_bytes
        }
    }
}

/// Why mlock said no, with the limit in force and what to do.
fn mlock_refusal(len_bytes: usize, error: std::io::Error) -> String {
    let limit_text = match MemlockLimit::current() {
        Ok(MemlockLimit {
            soft_bytes: Some(bytes),
            ..
        }) => format!("{bytes} bytes"),
        Ok(MemlockLimit {
            soft_bytes: None, ..
        }) => "unlimited".to_string(),
        Err(_) => "unknown".to_string(),
    };
    format!(
        "mlock of {len_bytes} bytes failed: {error} (RLIMIT_MEMLOCK {limit_text}); raise it \
         with `ulimit -l` or in /etc/security/limits.conf, or grant CAP_IPC_LOCK"
    )
}

fn warn_unlocked_once(owner: &str, reason: &str) {
    static WARNED: Once = Once::new();
    let mut first = false;
    WARNED.call_once(|| first = true);
    if first {
        log::warn!(
            "pinned pool '{owner}': {reason}; using unlocked host memory, so transfers may be \
             slower and pages may be swapped out (further pools say this only at debug level)"
        );
    } else {
        log::debug!("pinned pool '{owner}': {reason}; using unlocked host memory");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_mappings_start_on_a_huge_page_and_all_are_whole_pages() {
        for len in [1, 5000, HUGE_PAGE_BYTES, 3 * HUGE_PAGE_BYTES + 4096] {
            let mut mapping = HostMapping::map(len).unwrap();
            assert!(mapping.len_bytes >= len);
            assert!(mapping.len_bytes.is_multiple_of(page_bytes()));
            if len >= HUGE_PAGE_BYTES {
                assert!((mapping.ptr.as_ptr() as usize).is_multiple_of(HUGE_PAGE_BYTES));
            }
            // Every byte is mapped, writable and starts zeroed.
            let region = mapping.io_region();
            // SAFETY: the mapping is ours, `len_bytes` long, and nothing else uses it.
            let bytes = unsafe { std::slice::from_raw_parts_mut(region.ptr, region.len_bytes) };
            assert!(bytes.iter().all(|&b| b == 0));
            bytes.fill(0xEE);
            mapping.lock("test", &Pinning::Mlock).unwrap();
            assert!(matches!(
                mapping.locking(),
                HostLocking::Mlocked | HostLocking::Unlocked { .. }
            ));
        }
    }
}
