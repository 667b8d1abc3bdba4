//! strata: train neural networks larger than GPU memory on one machine.
//!
//! GPU memory, pinned host RAM and NVMe SSDs are treated as tiers of one memory. This
//! crate is the facade: it re-exports the member crates and holds what the `strata`
//! command line and the benchmarks share. The work itself lives in
//! [`storage`] (bytes on SSD), [`kernels`] (the math) and [`engine`] (where bytes live
//! and when they move).

pub use strata_engine as engine;
pub use strata_kernels as kernels;
pub use strata_storage as storage;

pub mod bench;
pub mod checkpoint_cmd;
pub mod corpus;
pub mod doctor;
pub mod eval;
pub mod logging;
pub mod machine;
pub mod model_info;
pub mod model_source;
pub mod out_paths;
pub mod plan_cmd;
pub mod process_memory;
pub mod report;
pub mod run_setup;
pub mod size;
pub mod tokenize;
pub mod train;
pub mod train_config;
