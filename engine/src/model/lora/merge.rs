//! Merging a LoRA adapter into its base: `W' = W + scale · B A` for each adapted layer,
//! `B A` computed in f32 (`out × in`, summed over the rank in order) and scaled before
//! it is added, as peft's `merge` does, and added in the base's layout (`(in, out)`
//! for GPT-2's Conv1D, where peft transposes the update for `fan_in_fan_out`). A merged
//! model is written with the base folder's dtype, configuration and carried files.

use std::path::Path;

use crate::model::weights::{open_pretrained, save_pretrained_with};
use crate::model::{Model, ModelError};

use super::adapter::{LoraAdapter, LoraWeights};
use super::targets::WeightLayout;

/// `params` (one f32 buffer per block of `model`) with `adapter` merged in; an error
/// when the adapter's layers are not `model`'s.
pub fn merge_params(
    model: &Model,
    params: &[Vec<f32>],
    adapter: &LoraAdapter,
) -> Result<Vec<Vec<f32>>, ModelError> {
    let mut merged = params.to_vec();
    merge_in_place(model, &mut merged, adapter)?;
    Ok(merged)
}

/// [`merge_params`] into `params` itself.
pub fn merge_in_place(
    model: &Model,
    params: &mut [Vec<f32>],
    adapter: &LoraAdapter,
) -> Result<(), ModelError> {
    check_layers(model, adapter)?;
    for (b, block) in params.iter_mut().enumerate() {
        merge_block(model, b, block, adapter)?;
    }
    Ok(())
}

/// Merges `adapter`'s layers of block `b` into that block's parameters `block` alone
/// (f32), for a caller that reads a model a block at a time (`strata eval --adapter`);
/// call [`check_layers`] once first, so that no adapted layer is missed.
pub fn merge_block(
    model: &Model,
    b: usize,
    block: &mut [f32],
    adapter: &LoraAdapter,
) -> Result<(), ModelError> {
    let scale = adapter.config.scale() as f32;
    for w in adapter.layers.iter().filter(|w| w.layer.block == b) {
        let spec = model.blocks()[b]
            .tensor(&w.layer.weight)
            .ok_or_else(|| not_a_layer(model, w))?;
        add_update(&mut block[spec.slot.range()], w, adapter.config.rank, scale);
    }
    Ok(())
}

/// Refuses an adapter with a layer that is not one of `model`'s.
pub fn check_layers(model: &Model, adapter: &LoraAdapter) -> Result<(), ModelError> {
    for w in &adapter.layers {
        let found = model
            .blocks()
            .get(w.layer.block)
            .and_then(|b| b.tensor(&w.layer.weight));
        if found.is_none() {
            return Err(not_a_layer(model, w));
        }
    }
    Ok(())
}

fn not_a_layer(model: &Model, w: &LoraWeights) -> ModelError {
    ModelError::BadInput(format!(
        "the adapter's layer `{}` is not a layer of this {} model",
        w.layer.module,
        model.family().name()
    ))
}

/// `weight += scale · B A` in the layer's layout.
fn add_update(weight: &mut [f32], w: &LoraWeights, rank: usize, scale: f32) {
    let (n_in, n_out) = (w.layer.in_features, w.layer.out_features);
    assert_eq!(weight.len(), n_in * n_out, "{}", w.layer.weight);
    let mut row = vec![0f32; n_in];
    for o in 0..n_out {
        row.fill(0.0);
        for (k, &b) in w.b[o * rank..(o + 1) * rank].iter().enumerate() {
            for (r, &a) in row.iter_mut().zip(&w.a[k * n_in..(k + 1) * n_in]) {
                *r += b * a;
            }
        }
        for (i, &delta) in row.iter().enumerate() {
            let at = match w.layer.layout {
                WeightLayout::OutIn => o * n_in + i,
                WeightLayout::InOut => i * n_out + o,
            };
            weight[at] += delta * scale;
        }
    }
}

/// Writes the model of folder `base` with the peft adapter of folder `adapter` merged
/// in as a Hugging Face model folder `out`, in the base's dtype and sharding, with its
/// `config.json` and carried files ([`save_pretrained_with`]).
pub fn save_merged(base: &Path, adapter: &Path, out: &Path) -> Result<(), ModelError> {
    let (model, mut params, pretrained) = open_pretrained(base)?;
    let lora = LoraAdapter::read(adapter, &model)?;
    merge_in_place(&model, &mut params, &lora)?;
    save_pretrained_with(&model, &params, out, &pretrained.save_options())
}
