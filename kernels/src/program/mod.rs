//! Kernels as data: what a model's block computes, as a list of
//! [`Kernel`]s over tensors that name a bound buffer and a byte
//! range in it ([`TensorRef`]), so that one list runs on any device: [`run_cpu`] calls
//! the kernels' CPU ops; the CUDA kernels run the same list on a stream
//! (`crate::cuda::CudaKernels::run`). Each kernel's signature ([`Signature`]) is checked
//! once ([`check`]) for both.
//!
//! A program never allocates: every buffer a kernel touches, scratch included, is a
//! [`TensorRef`] into memory the caller planned ([`attention_scratch_bytes`],
//! [`gqa_attention_scratch_bytes`] and [`grad_stats_scratch_bytes`] say how much the
//! kernels that need scratch need, per [`Target`]). Values that change from step to step
//! (the loss gradient, AdamW's step constants) are not in the program but in the
//! [`Scalars`] passed with it.
//!
//! This module holds the machinery every kernel shares; the kernels are in
//! [`crate::kernel`], re-exported here where programs name them. It knows nothing of
//! models or of where buffers live.

mod cpu;
mod error;
mod scalars;
pub mod signature;
mod tensor;

pub use cpu::{CpuKernel, CpuMemory, CpuTensors, RunOnCpu, TrustedMemory, run_cpu};
pub use error::KernelError;
pub use scalars::Scalars;
pub use signature::{ByteRule, Checked, DtypeRule, LenRule, Param, Rows, Signature, check};
pub use tensor::{Access, Dtype, Target, TensorRef};

pub use crate::kernel::attention::{
    ATTENTION_SCRATCH_ALIGN, AttentionScratchLayout, attention_scratch_bytes,
    attention_scratch_layout, gqa_attention_scratch_bytes, gqa_attention_scratch_layout,
};
pub use crate::kernel::crossentropy::IGNORE_TARGET;
pub use crate::kernel::optimizer::{
    GRAD_STATS_PIECES_PER_BLOCK, GRAD_STATS_THREADS, grad_stats_blocks, grad_stats_pieces,
    grad_stats_scratch_bytes, read_stats, round_into_f32, write_stats,
};
pub use crate::kernel::{Kernel, program_flops};
