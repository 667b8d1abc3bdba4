//! CUDA support: which CUDA libraries this machine has ([`probe`]) and what GPUs
//! ([`describe_driver`]), the kernel sources and their compilation by NVRTC
//! ([`program`]), and the runner of programs' kernels on a stream
//! ([`CudaKernels::run`]: its checks in `launch.rs`, each kernel's launch sequence in its
//! family in [`crate::kernel`], the CUDA calls they are made of in `ops.rs`).
//!
//! cudarc loads libcuda, libnvrtc and libcublas at run time and panics on the first call
//! into a library that is absent, so every GPU path asks [`probe`] first.

pub(crate) mod launch;
mod ops;
mod probe;
pub mod program;

pub use ops::CudaKernels;
pub use probe::{
    CUBLAS_LIBRARY, CudaLibraries, CudaUnavailable, DriverReport, GpuInfo, NVRTC_LIBRARY,
    describe_driver, probe,
};

/// Why a CUDA operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// CUDA cannot be used on this machine.
    #[error(transparent)]
    Unavailable(#[from] CudaUnavailable),
    /// NVRTC rejected the kernel sources (the message is its log).
    #[error("NVRTC could not compile strata's CUDA kernels:\n{0}")]
    Compile(String),
    /// A driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
}
