//! strata-storage: bytes on SSD.
//!
//! Aligned buffers and an ownership-passing I/O API ([`buffer`]). Knows nothing of GPUs:
//! pinned host memory reaches it through the [`IoBuf`] trait.

pub mod buffer;

pub use buffer::{AlignedBuf, DIRECT_IO_ALIGN, IoBuf, IoRegion};
