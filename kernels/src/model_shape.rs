//! The shapes of the model families this crate holds a whole-model reference for:
//! [`Gpt2Shape`], GPT-2's five numbers, as the engine's GPT-2 family states them and the
//! reference model ([`crate::reference::gpt2_model`]) takes them. A description only: no
//! kernel reads it (kernels take their dimensions one by one).

/// The shape of a GPT-2 model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gpt2Shape {
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads per block.
    pub heads: usize,
    /// Channels (the embedding width, C).
    pub width: usize,
    /// Vocabulary size (V).
    pub vocab: usize,
    /// Longest sequence (rows of the position embedding).
    pub ctx: usize,
}
