//! The benchmarks behind `strata bench`: each measures one link or kernel and compares
//! it, in the same run, with its limit or a peer (docs/ARCHITECTURE.md, benchmarks).

pub mod adam;
pub mod fio;
pub mod nvme;
pub mod pcie;
pub mod peers;
pub mod step;
