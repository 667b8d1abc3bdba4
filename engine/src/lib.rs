//! strata-engine: where the bytes of a training step live and when they move.
//!
//! The engine sits on [`strata_storage`] (bytes on SSD) and [`strata_kernels`] (the
//! math). [`memory`] holds the pinned host pool and the device arena, [`device`] the CPU
//! and CUDA devices with their lanes and events, [`error`] the engine's error enum,
//! [`model`] the built-in GPT-2. Later modules hold the swap policies and the executor.

pub use strata_kernels as kernels;
pub use strata_storage as storage;

pub mod checkpoint;
pub mod device;
pub mod error;
pub mod exec;
pub mod lane;
pub mod memory;
pub mod model;
pub mod plan;

pub use error::EngineError;
pub use lane::Lane;
