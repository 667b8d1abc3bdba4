//! strata-kernels: the math of a training step.
//!
//! Holds the CPU kernels (SIMD, chosen once at run time by [`isa`], with a portable path
//! that is always compiled), the CUDA kernel sources compiled at run time by NVRTC, and
//! in [`reference`](mod@reference) a plain scalar version of every kernel that tests compare against.
//! It knows nothing of where tensors live: callers hand it slices.

pub mod adamw;
pub mod cuda;
pub mod isa;
pub mod ops;
pub mod parallel;
pub mod program;
pub mod reference;
