//! LoRA adapters in peft's format, and the family-independent half of LoRA training
//! (issue 33); `strata eval --adapter` evaluates a base with an adapter merged in.
//!
//! - [`config`]: [`LoraConfig`] (rank, alpha, dropout, target module names, rsLoRA) and
//!   peft's `adapter_config.json`, read with one refusal for each peft feature strata
//!   does not apply (DoRA, trained biases, `modules_to_save`, per-layer ranks, ...) and
//!   written with every key peft 0.21 writes.
//! - [`targets`]: which linear layers of a model the target names select (peft's rule:
//!   a name matches the end of a module's path), with their features and layout
//!   (`(out, in)` for the Llama family, Conv1D's `(in, out)` for GPT-2).
//! - [`adapter`]: [`LoraAdapter`], each selected layer's `A` and `B` in f32, read from
//!   and written to a peft adapter folder.
//! - [`merge`]: `W + scale · B A` into a model's parameters, and a merged Hugging Face
//!   model folder.
//! - [`layout`]: a LoRA model's blocks (the base's tensors, then the adapters, its
//!   trained tail) and the adapters' starting values; [`blocks`]: an adapter started
//!   in, put into and read from a LoRA model's block parameters; `kernels`: the
//!   kernels of one adapted product and its backward, and `adapted`: which products of
//!   each layer carry an adapter, both for the families' programs.
//!
//! The programs that apply and train the adapters are each family's
//! ([`crate::model::Model::lora`]).

pub(crate) mod adapted;
pub mod adapter;
pub mod blocks;
pub mod config;
pub(crate) mod kernels;
pub mod layout;
pub mod merge;
pub mod targets;

pub use adapter::{ADAPTER_WEIGHTS_FILE, LoraAdapter, LoraWeights, peft_names};
pub use blocks::init_block_adapters;
pub use config::{ADAPTER_CONFIG_FILE, ALL_LINEAR, LoraConfig};
pub use layout::AdapterSlots;
pub use merge::{check_layers, merge_block, merge_in_place, merge_params, save_merged};
pub use targets::{LoraLayer, WeightLayout, adapter_names, select_family_layers};

use crate::model::{Model, ModelError};

/// The layers of `model` that `config`'s targets select, in block and layout order
/// ([`select_family_layers`] of its family); an error for a target that selects nothing,
/// or selects a layer outside the transformer blocks (the embeddings, the output head),
/// which strata does not adapt.
pub fn select_layers(model: &Model, config: &LoraConfig) -> Result<Vec<LoraLayer>, ModelError> {
    select_family_layers(model.family(), config)
}
