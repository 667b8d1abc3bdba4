//! Why a kernel could not run ([`KernelError`]): a tensor of the wrong dtype, length or
//! alignment, missing step constants, or a failed CUDA call. Each names the kernel and
//! the tensor.

use super::tensor::{Dtype, Target};
use crate::adamw::AdamError;

/// Why a kernel could not run.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The kernel needs a dtype this target does not compute in.
    #[error("{kernel}: {dtype} is not supported on {target:?} (tensor {what})")]
    Dtype {
        /// The kernel.
        kernel: &'static str,
        /// Which tensor.
        what: &'static str,
        /// Its dtype.
        dtype: Dtype,
        /// Where it ran.
        target: Target,
    },
    /// A tensor's length does not fit the kernel's shape.
    #[error("{kernel}: tensor {what} has {len} elements, {expected} expected")]
    Shape {
        /// The kernel.
        kernel: &'static str,
        /// Which tensor.
        what: &'static str,
        /// Its length.
        len: usize,
        /// What the shape needs.
        expected: usize,
    },
    /// AdamW ran without its constants, or refused its inputs.
    #[error("{0}")]
    Adam(#[from] AdamError),
    /// AdamW ran without constants in the scalars.
    #[error("AdamW ran without its step constants")]
    NoAdamStep,
    /// A tensor's address is not a multiple of what the kernel needs.
    #[error("{kernel}: tensor {what} starts at {address:#x}, not a multiple of {align} bytes")]
    Misaligned {
        /// The kernel.
        kernel: &'static str,
        /// Which tensor.
        what: &'static str,
        /// Its address.
        address: u64,
        /// The alignment it needs, in bytes.
        align: usize,
    },
    /// A CUDA call failed.
    #[error(transparent)]
    Cuda(#[from] crate::cuda::CudaError),
}
