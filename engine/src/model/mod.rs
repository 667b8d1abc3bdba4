//! Models, through one seam: a [`Family`] says what a model computes, and nothing else
//! in the engine knows any model's operations.
//!
//! - A family supplies its blocks and tensors with their Hugging Face names
//!   ([`layout`]), parses and writes its `config.json`, initialises parameters, and gives
//!   each block's forward and backward as a *program*: a list of
//!   [`Kernel`]s over the buffers named by [`Bind`]
//!   (the block's parameters, its gradients, its input and output activations, the
//!   scratch, ...). The planner asks a family only for sizes and FLOPs; the executor
//!   binds the buffers of each operation and hands the program to the device.
//! - [`Model`] is a family behind a shared handle, with what every caller needs of it.
//! - GPT-2 is the first family ([`gpt2`]); the Llama family ([`llama`]: Llama, Mistral,
//!   Qwen2, Qwen3) the second.
//! - [`update`]: the programs every family shares (AdamW per tensor, gradient
//!   statistics, gradient accumulation), built from a block's layout alone;
//!   [`moments`]: the formats of AdamW's moments and where a block's optimizer state
//!   lies in its buffer.
//! - [`weights`]: Hugging Face `config.json` and safetensors weights (one file or
//!   shards); [`data`]: token files; [`tokenize`]: `tokenizer.json` and text into token
//!   files.
//!
//! Where buffers live, and when they move, is not decided here.

pub mod approx;
mod bind;
pub mod chat;
mod config_keys;
pub mod data;
mod error;
mod family;
pub mod gpt2;
mod head;
pub mod layout;
pub mod llama;
pub mod lora;
mod mapped;
pub mod moments;
pub mod quant_base;
pub mod tokenize;
pub mod update;
pub mod weights;

use std::fmt;
use std::sync::Arc;

pub use approx::ApproxBackward;
pub use bind::Bind;
pub use error::ModelError;
pub use family::{Family, Pass, Shape};
pub use gpt2::{Gpt2, Gpt2Config, PRESETS};
pub use layout::{BlockKind, BlockLayout, Slot, TensorSpec};
pub use llama::{Llama, LlamaConfig};
pub use lora::LoraConfig;
pub use moments::{OptimizerState, Piece, StateLayout};
pub use quant_base::{BaseQuant, QuantBlock};
pub use strata_kernels::program::{Dtype, IGNORE_TARGET, Kernel, Target, TensorRef};

/// A model: a family of one shape, cheap to clone.
#[derive(Clone)]
pub struct Model {
    family: Arc<dyn Family>,
    /// How a LoRA model's frozen base is stored, when quantised ([`Model::quantized`]).
    quant: Option<BaseQuant>,
}

impl fmt::Debug for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.family.describe())
    }
}

impl PartialEq for Model {
    /// Two models are the same when their configurations (and adapters' settings) are.
    fn eq(&self, other: &Model) -> bool {
        self.family.name() == other.family.name()
            && self.family.hf_config() == other.family.hf_config()
            && self.family.lora_config() == other.family.lora_config()
            && self.quant == other.quant
    }
}

impl Model {
    /// GPT-2 of shape `config`.
    pub fn new(config: Gpt2Config) -> Result<Self, ModelError> {
        Ok(Model::of(Gpt2::new(config)?))
    }

    /// A model of `family`.
    pub fn of(family: impl Family + 'static) -> Self {
        Model {
            family: Arc::new(family),
            quant: None,
        }
    }

    /// This model over packed batches whose documents end with the token `eos`
    /// ([`Family::packed`]); refused for a family that does not build it.
    pub fn packed(&self, eos: u32) -> Result<Model, ModelError> {
        match self.family.packed(eos) {
            Some(family) => Ok(Model {
                family,
                quant: self.quant,
            }),
            None => Err(ModelError::BadInput(format!(
                "packed batches (--pack) are built for the Llama family (Llama, Mistral, \
                 Qwen2, Qwen3), not for {}: its attention and learned positions do not know \
                 documents",
                self.family.name()
            ))),
        }
    }

    /// The id that ends a document, when this model runs packed batches.
    pub fn packing(&self) -> Option<u32> {
        self.family.packing()
    }

    /// This model with the backward `approx` ([`Family::approximate`]); itself when
    /// `approx` is exact.
    pub fn approximate(&self, approx: ApproxBackward) -> Result<Model, ModelError> {
        if approx == self.family.approximation() {
            return Ok(self.clone());
        }
        Ok(Model {
            family: self.family.approximate(approx)?,
            quant: self.quant,
        })
    }

    /// The backward this model's programs compute.
    pub fn approximation(&self) -> ApproxBackward {
        self.family.approximation()
    }

    /// This model with LoRA adapters of `config` ([`Family::lora`]): the base frozen, the
    /// adapters trained. Refused: adapter dropout (not built), a model that already has
    /// adapters, an approximate backward (its sketches estimate the frozen weights'
    /// gradients, which a LoRA model does not compute), and families that do not build it.
    pub fn lora(&self, config: &LoraConfig) -> Result<Model, ModelError> {
        if config.dropout > 0.0 {
            return Err(ModelError::BadInput(format!(
                "LoRA dropout {} is not built yet: train with --lora-dropout 0",
                config.dropout
            )));
        }
        if self.family.lora_config().is_some() {
            return Err(ModelError::BadInput(
                "this model already has LoRA adapters: make the LoRA model from its base".into(),
            ));
        }
        let approx = self.family.approximation();
        if !approx.is_exact() {
            return Err(lora::adapted::approximate_refused(approx));
        }
        Ok(Model {
            family: self.family.lora(config)?,
            quant: self.quant,
        })
    }

    /// This LoRA model with its frozen base stored as `quant` (QLoRA): its matrices
    /// quantised once at load and computed with as dequantised ([`quant_base`]).
    /// Refused for a model without adapters, whose base trains.
    pub fn quantized(&self, quant: BaseQuant) -> Result<Model, ModelError> {
        if self.family.lora_config().is_none() {
            return Err(ModelError::BadInput(format!(
                "--quant {quant} stores a frozen base quantised, and this model trains all \
                 of its weights: add --lora RANK to train adapters over a quantised base"
            )));
        }
        Ok(Model {
            quant: Some(quant),
            ..self.clone()
        })
    }

    /// How the frozen base is stored, when quantised ([`Model::quantized`]).
    pub fn base_quant(&self) -> Option<BaseQuant> {
        self.quant
    }

    /// Block `b`'s `params` (f32) as a quantised base computes with them: each quantised
    /// matrix replaced by its dequantised values ([`quant_base::round_trip`]); unchanged
    /// for a model whose base is not quantised. For whatever reads a block's values
    /// outside the executor, which quantises them itself as it loads them.
    pub fn dequantise_base(&self, b: usize, params: &mut [f32]) {
        if let Some(quant) = self.quant {
            quant_base::round_trip(&self.blocks()[b], quant, params);
        }
    }

    /// Block `b`'s quantised base as a packed image whose other tensors are in `dtype`
    /// (the device's), for a quantised model's adapted transformer block.
    pub fn quant_block(&self, b: usize, dtype: Dtype) -> Option<QuantBlock> {
        QuantBlock::of(&self.blocks()[b], self.quant?, dtype)
    }

    /// The adapters' settings, for a LoRA model ([`Model::lora`]).
    pub fn lora_config(&self) -> Option<&LoraConfig> {
        self.family.lora_config()
    }

    /// The family.
    pub fn family(&self) -> &dyn Family {
        &*self.family
    }

    /// One line: the family and its shape.
    pub fn describe(&self) -> String {
        self.family.describe()
    }

    /// The blocks, in forward order: embedding, transformer blocks, head.
    pub fn blocks(&self) -> &[BlockLayout] {
        self.family.blocks()
    }

    /// Transformer blocks.
    pub fn layers(&self) -> usize {
        self.blocks().len() - 2
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        self.family.vocab()
    }

    /// The longest sequence.
    pub fn context(&self) -> usize {
        self.family.context()
    }

    /// Elements of the residual stream per token.
    pub fn width(&self) -> usize {
        self.family.width()
    }

    /// Every parameter.
    pub fn param_count(&self) -> usize {
        self.family.param_count()
    }

    /// The parameters that train: those of each block's trained elements
    /// ([`BlockLayout::trained`]; a LoRA model's adapters, else every one).
    pub fn trained_param_count(&self) -> usize {
        self.blocks()
            .iter()
            .flat_map(|b| b.tensors.iter().filter(|t| t.slot.offset >= b.frozen))
            .map(|t| t.slot.len)
            .sum()
    }

    /// The block block `block` ties to, if any.
    pub fn tied(&self, block: usize) -> Option<usize> {
        self.family.tied(block)
    }

    /// Which block holds the tensor called `name` (without the family's file prefix),
    /// and where.
    pub fn find_tensor(&self, name: &str) -> Option<(usize, &TensorSpec)> {
        self.blocks()
            .iter()
            .enumerate()
            .find_map(|(i, b)| b.tensor(name).map(|t| (i, t)))
    }

    /// One zeroed f32 buffer per block.
    pub fn zero_params(&self) -> Vec<Vec<f32>> {
        self.blocks().iter().map(|b| vec![0.0; b.len]).collect()
    }

    /// Parameters for training from scratch (the family's rule), deterministic in `seed`.
    pub fn init_params(&self, seed: u64) -> Vec<Vec<f32>> {
        (0..self.blocks().len())
            .map(|b| self.family.init_block(b, seed))
            .collect()
    }

    /// Block `block`'s share of [`Model::init_params`], made alone.
    pub fn init_block(&self, block: usize, seed: u64) -> Vec<f32> {
        self.family.init_block(block, seed)
    }

    /// The batch shape of `batch` sequences of `seq` tokens, checked against the model.
    pub fn shape(&self, batch: usize, seq: usize) -> Result<Shape, ModelError> {
        if batch == 0 || seq == 0 {
            return Err(ModelError::BadInput(
                "batch and sequence length must be at least 1".into(),
            ));
        }
        if seq > self.context() {
            return Err(ModelError::BadInput(format!(
                "sequence length {seq} exceeds the model's context of {} tokens",
                self.context()
            )));
        }
        let shape = Shape { batch, seq };
        self.family.check_shape(shape)?;
        Ok(shape)
    }

    /// The program of `pass` of `block` for `shape` on `target` in `dtype`.
    pub fn program(
        &self,
        block: usize,
        pass: Pass,
        shape: Shape,
        target: Target,
        dtype: Dtype,
    ) -> Vec<Kernel> {
        self.family.program(block, pass, shape, target, dtype)
    }

    /// Floating-point operations of `pass` of `block` (the sum over its program's
    /// kernels: the one formula there is).
    pub fn flops(&self, block: usize, pass: Pass, shape: Shape) -> f64 {
        strata_kernels::program::program_flops(&self.program(
            block,
            pass,
            shape,
            Target::Cpu,
            Dtype::F32,
        ))
    }

    /// Bytes of scratch the programs of `shape` need on `target` in `dtype`.
    pub fn scratch_bytes(&self, shape: Shape, target: Target, dtype: Dtype) -> usize {
        self.family.scratch_bytes(shape, target, dtype)
    }

    /// Bytes of block `block`'s saved activations for `shape` on `target` in `dtype`
    /// (see [`Family::saved_bytes`]).
    pub fn saved_bytes(&self, block: usize, shape: Shape, target: Target, dtype: Dtype) -> usize {
        self.family.saved_bytes(block, shape, target, dtype)
    }

    /// Floating-point operations block `block`'s backward spends recomputing its forward:
    /// what keeping its saved activations saves per micro-batch.
    pub fn recompute_flops(&self, block: usize, shape: Shape) -> f64 {
        self.flops(block, Pass::Backward, shape) - self.flops(block, Pass::BackwardSaved, shape)
    }

    /// Errors naming the first id of `tokens` outside the vocabulary.
    pub fn check_tokens(&self, tokens: &[u32]) -> Result<(), ModelError> {
        self.check_ids(tokens, false)
    }

    /// Errors naming the first id of `targets` outside the vocabulary;
    /// [`IGNORE_TARGET`] (a position the loss does not count) is allowed.
    pub fn check_targets(&self, targets: &[u32]) -> Result<(), ModelError> {
        self.check_ids(targets, true)
    }

    fn check_ids(&self, tokens: &[u32], targets: bool) -> Result<(), ModelError> {
        let bad = |t: u32| t as usize >= self.vocab() && !(targets && t == IGNORE_TARGET);
        match tokens.iter().position(|&t| bad(t)) {
            Some(position) => Err(ModelError::TokenOutOfVocab {
                origin: "the batch given".into(),
                position: position as u64,
                token: tokens[position],
                vocab: self.vocab(),
            }),
            None => Ok(()),
        }
    }
}

/// Checks of a family's programs that hold for every family, for its unit tests.
#[cfg(test)]
pub(crate) mod checks {
    use strata_kernels::program::Access;

    use super::{Bind, BlockKind, Dtype, Family, Pass, Shape, Target};

    /// Every tensor of every program of `family` (each block, each [`Pass`]) lies inside
    /// the buffer it is bound to (gradients: the block's trained tail, so a frozen
    /// tensor's gradient is never written); every program reads from the scratch only bytes it
    /// wrote itself, earlier (nothing is left to it by another block's program); a
    /// layer's [`Pass::BackwardSaved`] reads from its saved buffer only what its
    /// [`Pass::ForwardSave`] wrote there (so it needs no recomputation it does not do),
    /// and reads every tensor that forward saved (so nothing is kept for nothing).
    pub(crate) fn check_programs(family: &dyn Family, shape: Shape, target: Target, dtype: Dtype) {
        let scratch = family.scratch_bytes(shape, target, dtype);
        let tied = family.blocks()[0].len;
        let tied_grads = family.blocks()[0].trained_len();
        for (b, block) in family.blocks().iter().enumerate() {
            let saved = family.saved_bytes(b, shape, target, dtype);
            let is_layer = matches!(block.kind, BlockKind::Transformer { .. });
            assert_eq!(saved > 0, is_layer, "block {b}: saved bytes {saved}");
            let mut saved_by_forward = vec![false; saved];
            // Tensors the saved forward wrote to Saved, and those the saved backward read.
            let (mut kept, mut used) = (Vec::new(), Vec::new());
            for pass in [
                Pass::Forward,
                Pass::Backward,
                Pass::ForwardSave,
                Pass::BackwardSaved,
            ] {
                let mut wrote = [vec![false; scratch], vec![false; saved]];
                for k in family.program(b, pass, shape, target, dtype) {
                    let what = format!("block {b} {pass:?} {}", k.name());
                    let mut writes = Vec::new();
                    k.for_each_tensor(|t, access| {
                        let range = t.offset_bytes..t.offset_bytes + t.bytes();
                        let limit = match t.buf {
                            x if x == Bind::Scratch as u8 => scratch,
                            x if x == Bind::Saved as u8 => {
                                assert!(pass.uses_saved(), "{what}: {t:?} in Saved");
                                saved
                            }
                            x if x == Bind::Params as u8 => block.len * dtype.size(),
                            x if x == Bind::Grads as u8 => block.trained_len() * 4,
                            x if x == Bind::TiedParams as u8 => tied * dtype.size(),
                            x if x == Bind::TiedGrads as u8 => tied_grads * 4,
                            _ => usize::MAX,
                        };
                        assert!(range.end <= limit, "{what}: {t:?} past {limit}");
                        let region = match t.buf {
                            x if x == Bind::Scratch as u8 => 0,
                            x if x == Bind::Saved as u8 => 1,
                            _ => return,
                        };
                        if region == 1 {
                            match pass {
                                Pass::ForwardSave if access == Access::Write => kept.push(*t),
                                Pass::BackwardSaved => used.push(*t),
                                _ => {}
                            }
                        }
                        match access {
                            Access::Write => writes.push((region, range)),
                            Access::Read => {
                                let from_forward = region == 1 && pass == Pass::BackwardSaved;
                                let known = if from_forward {
                                    &saved_by_forward
                                } else {
                                    &wrote[region]
                                };
                                assert!(
                                    known[range.clone()].iter().all(|&w| w),
                                    "{what} reads {t:?}, which {}",
                                    if from_forward {
                                        "the saved forward did not write"
                                    } else {
                                        "no earlier kernel of the program wrote"
                                    }
                                );
                            }
                        }
                    });
                    for (region, range) in writes {
                        wrote[region][range].fill(true);
                    }
                }
                if pass == Pass::ForwardSave {
                    saved_by_forward = wrote[1].clone();
                }
            }
            for t in kept {
                assert!(
                    used.contains(&t),
                    "block {b}: the saved forward keeps {t:?}, which the saved backward \
                     never reads"
                );
            }
        }
    }
}
