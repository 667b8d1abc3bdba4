//! A LoRA model's adapters in its block parameters: started as peft starts them
//! ([`init_block_adapters`]), or put in from a [`LoraAdapter`] (a peft folder read) and
//! read back out of trained blocks, for [`LoraAdapter::write`].
//!
//! Not here: where the adapters lie ([`super::layout`]), peft's files (`adapter.rs`).

use crate::model::{Model, ModelError};

use super::adapter::{LoraAdapter, LoraWeights};
use super::layout::{adapter_slots, init_adapters};
use super::select_layers;
use super::targets::LoraLayer;

/// The layers `model` (a LoRA model) adapts, with its settings' rank; an error naming
/// the fix for a model without adapters.
fn adapted_layers(model: &Model) -> Result<(Vec<LoraLayer>, usize), ModelError> {
    let config = model.family().lora_config().ok_or_else(|| {
        ModelError::BadInput(format!(
            "this {} model has no LoRA adapters: make it with Model::lora",
            model.family().name()
        ))
    })?;
    Ok((select_layers(model, config)?, config.rank))
}

/// [`init_adapters`] of block `b` of the LoRA model `model`: the adapters of a block
/// whose base was read from a model folder.
pub fn init_block_adapters(
    model: &Model,
    b: usize,
    seed: u64,
    params: &mut [f32],
) -> Result<(), ModelError> {
    let (layers, _) = adapted_layers(model)?;
    init_adapters((b, &model.blocks()[b]), &layers, seed, params);
    Ok(())
}

impl LoraAdapter {
    /// Writes each layer's `A` and `B` into the block parameters `params` (one whole
    /// buffer per block) of `model`, a LoRA model of this adapter's settings.
    pub fn into_blocks(&self, model: &Model, params: &mut [Vec<f32>]) -> Result<(), ModelError> {
        self.check_model(model)?;
        for w in &self.layers {
            let slots = adapter_slots(&model.blocks()[w.layer.block], &w.layer);
            let block = &mut params[w.layer.block];
            block[slots.a.range()].copy_from_slice(&w.a);
            block[slots.b.range()].copy_from_slice(&w.b);
        }
        Ok(())
    }

    /// The adapter the LoRA model `model` holds in its block parameters `params` (one
    /// whole buffer per block, as trained): what [`LoraAdapter::write`] saves as peft's
    /// folder.
    pub fn from_blocks(model: &Model, params: &[Vec<f32>]) -> Result<Self, ModelError> {
        Self::from_parts(model, params, |_| 0)
    }

    /// As [`LoraAdapter::from_blocks`], from each block's trained elements alone
    /// ([`BlockLayout::trained`](crate::model::BlockLayout::trained): the master copy an
    /// executor or a checkpoint holds of a LoRA model; empty for a block that trains
    /// nothing).
    pub fn from_trained(model: &Model, trained: &[Vec<f32>]) -> Result<Self, ModelError> {
        Self::from_parts(model, trained, |block| block.frozen)
    }

    /// The adapter in `params`, block `b`'s buffer holding its elements from
    /// `start(block)` on.
    fn from_parts(
        model: &Model,
        params: &[Vec<f32>],
        start: impl Fn(&crate::model::BlockLayout) -> usize,
    ) -> Result<Self, ModelError> {
        let (layers, _) = adapted_layers(model)?;
        let config = model
            .family()
            .lora_config()
            .expect("adapted_layers checked");
        if params.len() != model.blocks().len() {
            return Err(ModelError::BadInput(format!(
                "{} block buffers given for a model of {} blocks",
                params.len(),
                model.blocks().len()
            )));
        }
        let layers = layers
            .into_iter()
            .map(|layer| {
                let block = &model.blocks()[layer.block];
                let slots = adapter_slots(block, &layer);
                let at = start(block);
                let part =
                    |s: crate::model::Slot| params[layer.block][s.offset - at..][..s.len].to_vec();
                LoraWeights {
                    a: part(slots.a),
                    b: part(slots.b),
                    layer,
                }
            })
            .collect();
        Ok(LoraAdapter {
            config: config.clone(),
            layers,
        })
    }

    /// Refuses a model that is not a LoRA model of this adapter's settings.
    fn check_model(&self, model: &Model) -> Result<(), ModelError> {
        match model.family().lora_config() {
            Some(config) if *config == self.config => Ok(()),
            Some(config) => Err(ModelError::BadInput(format!(
                "the adapter's settings (rank {}, targets {:?}) are not the model's (rank \
                 {}, targets {:?}): make the model with the adapter's LoraConfig",
                self.config.rank, self.config.targets, config.rank, config.targets
            ))),
            None => Err(ModelError::BadInput(format!(
                "this {} model has no LoRA adapters: make it with Model::lora and the \
                 adapter's LoraConfig",
                model.family().name()
            ))),
        }
    }
}
