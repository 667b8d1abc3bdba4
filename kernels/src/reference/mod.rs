//! Plain scalar versions of every kernel, kept for good: the fast kernels are tested
//! element by element against these. Nothing here is tuned; clarity is the point.
//!
//! Each program kernel's reference lives beside it, in its family
//! (`crate::kernel::<family>::reference`); [`gpt2`] and [`llama`] gather them by model
//! family, as the tests use them, and [`gpt2_model`] runs a whole GPT-2 on them. The
//! reference depends on the production types (shapes, constants), never the reverse.

pub mod adamw;
pub mod cast;
pub mod gemm;
pub mod gpt2;
pub mod gpt2_model;
pub mod llama;
mod real;

pub use real::Real;
pub(crate) use real::r;
