//! A LoRA run's trained adapter written as a peft adapter folder ([`save_adapter`]):
//! what `--out` writes for a LoRA run, and what a failing one keeps.
//!
//! Not here: the LoRA model (`strata_engine::model::lora`) or the adapter's format
//! (`LoraAdapter::write`).

use std::path::Path;

use strata_engine::exec::Executor;
use strata_engine::model::Slot;
use strata_engine::model::lora::LoraAdapter;
use strata_engine::model::lora::layout::adapter_slots;
use strata_engine::model::weights::FileDtype;

use crate::train_config::TrainConfig;

type Error = Box<dyn std::error::Error>;

/// Writes a LoRA run's trained adapters to `dir` as a peft adapter folder for the base
/// `--model` names, in `--save-dtype` (f32 by default): each adapted layer's `A` and `B`,
/// read from the master parameters of its block's trained elements (alone).
pub fn save_adapter(cfg: &TrainConfig, exec: &Executor, dir: &Path) -> Result<(), Error> {
    let model = exec.model();
    let config = model
        .family()
        .lora_config()
        .ok_or("the model has no LoRA adapters")?
        .clone();
    let tails = (0..model.blocks().len())
        .map(|b| {
            let block = &model.blocks()[b];
            block.trains().then(|| exec.export_trained(b)).transpose()
        })
        .collect::<Result<Vec<_>, _>>()?;
    let adapter = LoraAdapter::new(model, config, |layer| {
        let block = &model.blocks()[layer.block];
        let tail = tails[layer.block]
            .as_ref()
            .expect("an adapted layer's block trains");
        let slots = adapter_slots(block, layer);
        let part = |s: Slot| tail[s.offset - block.frozen..][..s.len].to_vec();
        (part(slots.a), part(slots.b))
    })?;
    let dtype = cfg.save_dtype.map_or(FileDtype::F32, |d| d.file_dtype());
    adapter.write(dir, &cfg.model, dtype)?;
    Ok(())
}
