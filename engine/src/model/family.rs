//! The seam between the engine and a model family: the [`Family`] trait (blocks, tensors,
//! files, each block's programs), the [`Pass`] a program computes and the batch
//! [`Shape`] it computes it for.
//!
//! Not here: a family's own code (`gpt2`, `llama`), the model handle (`Model`, in the
//! module's root), the buffers programs name (`bind`).

use std::fmt;
use std::sync::Arc;

use strata_kernels::program::{Dtype, Kernel, Target, TensorRef};

use super::approx::ApproxBackward;
use super::error::ModelError;
use super::layout::BlockLayout;
use super::lora::LoraConfig;
#[cfg(doc)]
use super::{bind::Bind, layout::BlockKind};

/// Which pass of a block a program computes.
///
/// A layer block's backward either recomputes the block's forward from its input
/// ([`Pass::Backward`], after a [`Pass::Forward`] that kept only the block's output) or
/// reads what a [`Pass::ForwardSave`] left in the block's saved-activations buffer
/// ([`Bind::Saved`], of [`Family::saved_bytes`]) ([`Pass::BackwardSaved`]). The two pairs
/// compute the same values bit for bit: the saved intermediates are the ones the
/// recomputation would produce, by the same kernels on the same inputs. Blocks that save
/// nothing (the embedding, the head) run the same programs for both variants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pass {
    /// The forward: the embedding's output from tokens, a layer's output from its input,
    /// the head's per-position losses from its input and the targets.
    Forward,
    /// The forward that also writes into [`Bind::Saved`] the intermediates its block's
    /// [`Pass::BackwardSaved`] reads.
    ForwardSave,
    /// The backward into zeroed gradients (a family zeroes each gradient buffer in the
    /// first program that writes it in a micro-batch): a layer recomputes its forward
    /// from its input, then writes the gradient of its input ([`Bind::DInput`]) given
    /// that of its output ([`Bind::DOutput`]); the head computes its forward, the loss
    /// gradient (with [`Scalars::dloss`](strata_kernels::program::Scalars)) and the
    /// gradient of its input; the embedding adds to its gradients only.
    Backward,
    /// [`Pass::Backward`] without the recomputation: a layer reads the intermediates its
    /// [`Pass::ForwardSave`] left in [`Bind::Saved`] (recomputing at most cheap
    /// elementwise ones into the scratch, as its family documents).
    BackwardSaved,
}

impl Pass {
    /// Every pass.
    pub const ALL: [Pass; 4] = [
        Pass::Forward,
        Pass::ForwardSave,
        Pass::Backward,
        Pass::BackwardSaved,
    ];

    /// Its position in [`Pass::ALL`].
    pub fn index(self) -> usize {
        match self {
            Pass::Forward => 0,
            Pass::ForwardSave => 1,
            Pass::Backward => 2,
            Pass::BackwardSaved => 3,
        }
    }

    /// Whether it is one of the forward passes.
    pub fn is_forward(self) -> bool {
        matches!(self, Pass::Forward | Pass::ForwardSave)
    }

    /// Whether it writes or reads [`Bind::Saved`].
    pub fn uses_saved(self) -> bool {
        matches!(self, Pass::ForwardSave | Pass::BackwardSaved)
    }
}

/// The batch shape of a step: `batch` sequences of `seq` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
}

impl Shape {
    /// Positions: batch × seq.
    pub fn rows(&self) -> usize {
        self.batch * self.seq
    }

    /// Refuses a batch whose largest activations could not be addressed in bytes: the
    /// logits (rows × `vocab`), the widest per-row activation (rows × `widest`) and the
    /// attention probabilities (batch × `heads` × seq × seq), each of up to 8 bytes.
    pub(crate) fn check_addressable(
        &self,
        vocab: usize,
        widest: usize,
        heads: usize,
    ) -> Result<(), ModelError> {
        let fits = self
            .batch
            .checked_mul(self.seq)
            .and_then(|rows| {
                rows.checked_mul(vocab)?.checked_mul(8)?;
                rows.checked_mul(widest)?.checked_mul(8)
            })
            .and_then(|_| {
                self.batch
                    .checked_mul(heads)?
                    .checked_mul(self.seq)?
                    .checked_mul(self.seq)?
                    .checked_mul(8)
            });
        match fits {
            Some(_) => Ok(()),
            None => Err(ModelError::BadInput(format!(
                "a batch of {} x {} tokens is too large: its activations would have more \
                 elements than this machine can address",
                self.batch, self.seq
            ))),
        }
    }
}

/// A model family: its blocks, tensors and files, and each block's programs.
///
/// Blocks come in forward order: first the embedding ([`BlockKind::Embedding`]: tokens
/// in, the residual stream out), then the transformer blocks (stream in and out), last
/// the head ([`BlockKind::Head`]: stream and targets in, losses out). Implement it in one
/// module over the shared kernels (`strata_kernels::program`).
pub trait Family: Send + Sync + fmt::Debug {
    /// The family's name (`gpt2`), as `config.json`'s `model_type` says it.
    fn name(&self) -> &'static str;
    /// One line for reports: the family and its shape.
    fn describe(&self) -> String;
    /// The blocks, in forward order.
    fn blocks(&self) -> &[BlockLayout];
    /// Vocabulary size.
    fn vocab(&self) -> usize;
    /// The longest sequence.
    fn context(&self) -> usize;
    /// Elements of the residual stream per token (the activation between blocks).
    fn width(&self) -> usize;
    /// Every parameter (tied tensors counted once).
    fn param_count(&self) -> usize;
    /// The block whose parameters block `block` also reads, and whose gradients it adds
    /// to (a head tied to the embedding), if any.
    fn tied(&self, block: usize) -> Option<usize>;
    /// Refuses a batch shape this family cannot address.
    fn check_shape(&self, shape: Shape) -> Result<(), ModelError>;
    /// Bytes of scratch every program of this shape needs on `target`, with activations
    /// and parameters of `dtype`.
    fn scratch_bytes(&self, shape: Shape, target: Target, dtype: Dtype) -> usize;
    /// Bytes of block `block`'s saved activations ([`Bind::Saved`]) for this shape on
    /// `target` with activations of `dtype`: what its [`Pass::ForwardSave`] keeps for its
    /// [`Pass::BackwardSaved`]. 0 for a block whose backward recomputes nothing (the
    /// embedding, the head).
    fn saved_bytes(&self, block: usize, shape: Shape, target: Target, dtype: Dtype) -> usize;
    /// The program of `pass` of `block` (see [`Pass`] and [`Bind`]).
    fn program(
        &self,
        block: usize,
        pass: Pass,
        shape: Shape,
        target: Target,
        dtype: Dtype,
    ) -> Vec<Kernel>;
    /// Where the head's forward leaves the logits (B, T, vocab) in the scratch, if it
    /// keeps them there.
    fn logits(&self, _shape: Shape, _target: Target, _dtype: Dtype) -> Option<TensorRef> {
        None
    }
    /// Block `block`'s parameters for training from scratch, deterministic in `seed` and
    /// independent of the other blocks' (so a model can be initialised a block at a
    /// time).
    fn init_block(&self, block: usize, seed: u64) -> Vec<f32>;
    /// The prefix Hugging Face files put before the names of block `block`'s tensors.
    fn hf_prefix(&self, block: usize) -> &'static str;
    /// Whether a tensor a Hugging Face file holds is not a parameter (buffers, tied
    /// copies) and is skipped without a warning.
    fn hf_ignored(&self, name: &str) -> bool;
    /// The `config.json` transformers reads for this model.
    fn hf_config(&self) -> serde_json::Value;
    /// This model over packed batches: documents that end with the token `eos` (the
    /// token after it starts the next), each attending only within itself, its
    /// positions restarting at 0; `None` where the family does not build it.
    fn packed(&self, _eos: u32) -> Option<Arc<dyn Family>> {
        None
    }
    /// The id that ends a document when this model runs packed batches.
    fn packing(&self) -> Option<u32> {
        None
    }
    /// This model with the backward `approx` ([`ApproxBackward`]): its kept blocks keep
    /// what that backward reads, and it estimates what it approximates. Refused where the
    /// family does not build an approximation `approx` names.
    fn approximate(&self, approx: ApproxBackward) -> Result<Arc<dyn Family>, ModelError> {
        Err(ModelError::BadInput(format!(
            "--approx-backward {approx} is not built for {}",
            self.name()
        )))
    }
    /// The backward this model's programs compute.
    fn approximation(&self) -> ApproxBackward {
        ApproxBackward::EXACT
    }
    /// This model with LoRA adapters of `config` on the layers its targets select
    /// ([`select_layers`](super::lora::select_layers)): every base tensor frozen, each
    /// block's adapters its trained tail ([`BlockLayout::frozen`]; see
    /// [`lora_blocks`](super::lora::layout::lora_blocks)), each adapted product `x Wᵀ`
    /// plus `scale · (x Aᵀ) Bᵀ`. Refused where the family does not build it.
    /// [`Model::lora`](super::Model::lora) refuses what no family builds first.
    fn lora(&self, _config: &LoraConfig) -> Result<Arc<dyn Family>, ModelError> {
        Err(ModelError::BadInput(format!(
            "LoRA training (--lora) is not built for {}",
            self.name()
        )))
    }
    /// The adapters' settings of a LoRA model ([`Family::lora`]); `None` for a model
    /// trained whole.
    fn lora_config(&self) -> Option<&LoraConfig> {
        None
    }
}
