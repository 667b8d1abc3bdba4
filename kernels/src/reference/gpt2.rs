//! The scalar reference kernels of GPT-2's forward and backward passes, after llm.c's
//! `train_gpt2.c`, gathered from their families (`crate::kernel::*::reference`), with the
//! constants the fast kernels share with them.
//!
//! Conventions shared with the fast kernels in [`crate::ops`]:
//! - every tensor is row-major; the shapes are stated at the top of each kernel;
//! - a forward kernel overwrites its outputs;
//! - a backward kernel *accumulates* (`+=`) into parameter gradients, so that gradients
//!   of micro-batches add up; activation gradients are overwritten (`=`) except where a
//!   kernel says it accumulates (LayerNorm's input gradient, where the residual joins).

pub use super::Real;
pub use crate::kernel::attention::reference::{attention_backward, attention_forward};
pub use crate::kernel::crossentropy::reference::{crossentropy_backward, crossentropy_forward};
pub use crate::kernel::elementwise::reference::residual_forward;
pub use crate::kernel::encoder::reference::{encoder_backward, encoder_forward};
pub use crate::kernel::gelu::GELU_SCALE;
pub use crate::kernel::gelu::reference::{gelu_backward, gelu_forward};
pub use crate::kernel::layernorm::LAYERNORM_EPS;
pub use crate::kernel::layernorm::reference::{layernorm_backward, layernorm_forward};
pub use crate::kernel::matmul::reference::{matmul_backward, matmul_forward};
