//! Plain scalar versions of every kernel, kept for good: the fast kernels are tested
//! element by element against these. Nothing here is tuned; clarity is the point.
//! Each kernel family has its own file.

pub mod adamw;
pub mod cast;
pub mod gemm;
pub mod gpt2;
pub mod gpt2_model;
pub mod llama;
