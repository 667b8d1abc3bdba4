//! CUDA support shared by every GPU code path: which CUDA libraries this machine has.
//!
//! cudarc loads libcuda, libnvrtc and libcublas at run time and panics on the first call
//! into a library that is absent, so every GPU path asks [`probe`] first. This module
//! holds no kernels; they come with the model's CUDA half.

mod probe;

pub use probe::{CudaLibraries, CudaUnavailable, probe};
