//! The scalar reference kernels of the Llama family's blocks (Llama, Qwen2, Qwen3,
//! Mistral), gathered from their families (`crate::kernel::*::reference`): RMSNorm,
//! rotary position embeddings in Hugging Face's "rotate_half" form, the SwiGLU gate of the
//! MLP, and causal grouped-query attention.
//!
//! Conventions are those of [`super::gpt2`]: row-major tensors, forward kernels
//! overwrite, backward kernels accumulate (`+=`) into parameter gradients and overwrite
//! activation gradients, except RMSNorm's input gradient, which accumulates (the residual
//! stream joins there, as at LayerNorm).
//!
//! Layouts: activations are rows of B × T positions; attention's q is (B, T, H, D), k and
//! v are (B, T, KV, D) with KV dividing H (query head h reads key/value head
//! h / (H / KV)), as the q, k and v projections produce them. RoPE rotates every
//! D-element row of such a tensor by its position t; its table is (at least T, D/2) of
//! cosines and as many sines, row t for position t.

pub use crate::kernel::attention::reference::{
    gqa_attention_backward, gqa_attention_forward, gqa_attention_forward_masked,
};
pub use crate::kernel::attention::{AttnMask, GqaDims};
pub use crate::kernel::rmsnorm::reference::{rmsnorm_backward, rmsnorm_forward};
pub use crate::kernel::rope::reference::{
    rope_backward, rope_forward, rope_inv_freq, rope_inv_freq_llama3, rope_table,
};
pub use crate::kernel::swiglu::reference::{swiglu_backward, swiglu_forward};
