//! strata-storage: bytes on SSD.
//!
//! - [`buffer`]: aligned buffers and the [`IoBuf`] contract, by which I/O owns a buffer
//!   while it is in flight and hands it back with the result, also on error.
//! - [`TensorStore`]: named, checksummed extents over one or more preallocated swap files
//!   (several = several drives, striped), on an io_uring backend with registered files
//!   and buffers, or a threaded pread/pwrite backend where io_uring cannot start.
//! - A seeded fault-injecting backend ([`FaultPlan`]) for tests.
//!
//! Knows nothing of GPUs: pinned host memory reaches it through [`IoBuf`] and
//! [`TensorStore::register_region`].

pub mod buffer;
pub mod crc;
mod error;
mod file;
mod io;
mod store;

pub use buffer::{AlignedBuf, DIRECT_IO_ALIGN, HUGE_PAGE_BYTES, IoBuf, IoRegion};
pub use error::{Errno, StorageError};
pub use file::{
    DirectIo, DirectIoSupport, available_bytes, drop_read_pages, filesystem_type, format_bytes,
    is_tmpfs, probe_direct_io, write_back_and_drop,
};
pub use io::faulty::{FaultKind, FaultPlan, InjectedFault};
pub use io::{BackendChoice, BackendKind, IoCounters, IoStats, OpKind, probe_uring};
pub use store::{ExtentId, ExtentInfo, Pending, StoreConfig, TensorStore};
