//! The buffers a block's program names ([`Bind`]): each kernel tensor's binding index,
//! which the executor binds to memory for every operation.
//!
//! Not here: the passes and the family interface (`family`), the layouts (`layout`).

/// The buffers a block program reads and writes, by the index its
/// [`TensorRef::buf`](strata_kernels::program::TensorRef) holds. The executor binds each
/// to memory for every operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Bind {
    /// The block's working parameters (the device's dtype).
    Params = 0,
    /// The block's parameter gradients (f32).
    Grads,
    /// The parameters of the block this one ties to ([`Family::tied`](super::Family::tied)).
    TiedParams,
    /// The gradients of the block this one ties to.
    TiedGrads,
    /// The block's input activation (B, T, width).
    Input,
    /// The block's output activation.
    Output,
    /// The gradient of the output activation.
    DOutput,
    /// The gradient of the input activation (written).
    DInput,
    /// Token ids (B, T), u32.
    Tokens,
    /// Target ids (B, T), u32.
    Targets,
    /// Per-position losses (B, T), f32.
    Losses,
    /// The device's scratch for the running block.
    Scratch,
    /// fp32 master parameters, then AdamW's m, then v (each the block's length).
    State,
    /// Gradient statistics: two f64 (sum of squares, non-finite flag).
    Stats,
    /// Gradients to add (accumulation).
    GradsIn,
    /// The block's saved activations: written by
    /// [`Pass::ForwardSave`](super::Pass::ForwardSave), read by
    /// [`Pass::BackwardSaved`](super::Pass::BackwardSaved)
    /// ([`Family::saved_bytes`](super::Family::saved_bytes) bytes).
    Saved,
    /// A block's frozen base as stored quantised (bytes; see
    /// [`QuantBlock`](super::quant_base::QuantBlock)), which its dequantisation reads.
    Packed,
}

impl Bind {
    /// How many there are.
    pub const COUNT: usize = 17;
}
