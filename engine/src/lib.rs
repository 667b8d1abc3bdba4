//! strata-engine: where the bytes of a training step live and when they move.
//!
//! The engine sits on [`strata_storage`] (bytes on SSD) and [`strata_kernels`] (the
//! math). Later modules hold the memory pools, the devices, the model, the swap
//! policies and the executor.

pub use strata_kernels as kernels;
pub use strata_storage as storage;

pub mod model;
