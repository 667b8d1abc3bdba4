//! strata-kernels: the math of a training step.
//!
//! Holds the program's kernels ([`kernel`]: one family per folder, each kernel's signature,
//! CPU op, CUDA launch sequence and `.cu` file, and its scalar reference, registered once
//! in [`kernel::Kernel`]), the machinery that runs them ([`program`] on the CPU, [`cuda`]
//! on a GPU, with NVRTC compiling the sources at run time), the CPU kernels' shared SIMD
//! and product code ([`ops`], with the instruction set chosen once at run time by [`isa`]
//! and a portable path that is always compiled), the AdamW step ([`adamw`]), and in
//! [`reference`](mod@reference) a plain scalar version of every kernel that tests compare
//! against. It knows nothing of where tensors live: callers hand it slices or addresses.

pub mod adamw;
pub mod cuda;
pub mod isa;
pub mod kernel;
pub mod model_shape;
pub mod ops;
pub mod parallel;
pub mod program;
pub mod reference;
