//! How host memory is page-locked: what a device asks ([`Pinning`]: registered with the
//! CUDA driver, or `mlock`) and what a mapping got ([`HostLocking`]). The pinned pool and
//! the host arena lock their mappings by these rules (`host`).
//!
//! Not here: the locking itself (`host`), and the pools and arenas (`pinned`,
//! `host_arena`).

use std::sync::Arc;

use cudarc::driver::CudaContext;

/// How a pool's memory gets page-locked.
#[derive(Debug, Clone)]
pub enum Pinning {
    /// Registered with the CUDA driver in this context (`cuMemHostRegister`, portable to
    /// every context), so device copies from and to it are DMA without staging.
    Cuda(Arc<CudaContext>),
    /// `mlock`, falling back to unlocked memory with one warning when it is refused.
    Mlock,
}

/// How a pool's memory ended up locked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostLocking {
    /// Page-locked and registered with the CUDA driver.
    CudaRegistered,
    /// Page-locked by `mlock`.
    Mlocked,
    /// Not locked: the kernel may move or swap these pages.
    Unlocked {
        /// Why `mlock` was refused.
        reason: String,
    },
}

impl std::fmt::Display for HostLocking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostLocking::CudaRegistered => f.write_str("page-locked by the CUDA driver"),
            HostLocking::Mlocked => f.write_str("page-locked by mlock"),
            HostLocking::Unlocked { reason } => write!(f, "not locked ({reason})"),
        }
    }
}
