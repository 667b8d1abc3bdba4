//! A LoRA run's trained adapter written as a peft adapter folder ([`save_adapter`]):
//! what `--out` writes for a LoRA run, and what a failing one keeps; or with `--merge`,
//! merged into the base as a Hugging Face model folder ([`save_merged_model`]).
//!
//! Not here: the LoRA model (`strata_engine::model::lora`) or the adapter's format
//! (`LoraAdapter::write`).

use std::path::Path;

use strata_engine::exec::Executor;
use strata_engine::model::ModelError;
use strata_engine::model::lora::{LoraAdapter, merge_block};
use strata_engine::model::weights::{self, FileDtype};

use crate::model_source::{model_shape, pretrained_source};
use crate::train_config::TrainConfig;

type Error = Box<dyn std::error::Error>;

/// Writes a LoRA run's trained adapters to `dir` as a peft adapter folder for the base
/// `--model` names, in `--save-dtype` (f32 by default): each adapted layer's `A` and `B`,
/// read from the master parameters of its block's trained elements (alone).
pub fn save_adapter(cfg: &TrainConfig, exec: &Executor, dir: &Path) -> Result<(), Error> {
    let dtype = cfg.save_dtype.map_or(FileDtype::F32, |d| d.file_dtype());
    trained_adapter(exec)?.write(dir, &cfg.model, dtype)?;
    Ok(())
}

/// Writes the base `--model` names with a LoRA run's trained adapters merged in
/// (`W + scale · B A`) to `dir` as a Hugging Face model folder, in the base's dtype and
/// sharding (or `--save-dtype`), with its config and tokenizer files: a block at a time,
/// each read from the base's files and merged as the file reaches it.
pub fn save_merged_model(cfg: &TrainConfig, exec: &Executor, dir: &Path) -> Result<(), Error> {
    let adapter = trained_adapter(exec)?;
    let folder = Path::new(&cfg.model);
    let source = pretrained_source(&cfg.model)?.ok_or_else(|| {
        format!(
            "--merge writes the base's weights with the adapters merged in, and {} has none \
             (a preset or a shape); give a model folder with weights, or leave --merge out \
             to write the adapter",
            cfg.model
        )
    })?;
    let base = model_shape(&cfg.model)?;
    let blocks = weights::PretrainedBlocks::open(folder, &base)?;
    let mut options = source.save_options();
    if let Some(dtype) = cfg.save_dtype {
        options.dtype = dtype.file_dtype();
    }
    let read = |b: usize| -> Result<Vec<f32>, ModelError> {
        let mut params = blocks.read_block(b)?;
        merge_block(&base, b, &mut params, &adapter)?;
        Ok(params)
    };
    weights::save_pretrained_blocks(&base, &read, dir, &options)?;
    Ok(())
}

/// The adapter a LoRA run trained: each adapted layer's `A` and `B`, from the master
/// parameters of its block's trained elements (alone).
fn trained_adapter(exec: &Executor) -> Result<LoraAdapter, Error> {
    let model = exec.model();
    // export_trained gives an empty master copy for a block that trains nothing.
    let trained = (0..model.blocks().len())
        .map(|b| exec.export_trained(b))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(LoraAdapter::from_trained(model, &trained)?)
}
