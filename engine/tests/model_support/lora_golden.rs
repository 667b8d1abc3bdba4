//! The LoRA golden data (`tests/data/lora-tiny`, and `qlora-tiny` over the same base):
//! its settings, its optimizer, the model and parameters it starts from and its batches.

use std::path::PathBuf;

use serde_json::Value;
use strata_engine::exec::StepParams;
use strata_engine::kernels::adamw::AdamW;
use strata_engine::model::Model;
use strata_engine::model::data::{Batch, TokenData};
use strata_engine::model::lora::LoraAdapter;
use strata_engine::model::weights::load_pretrained;

use super::data_dir;

/// The golden's micro-batch, steps and tolerance (relative).
pub const B: usize = 2;
pub const T: usize = 16;
pub const STEPS: usize = 3;
pub const TOLERANCE: f64 = 1e-5;

/// `tests/data/lora-tiny`.
pub fn lora_dir() -> PathBuf {
    data_dir("lora-tiny")
}

/// lora-tiny's meta.json.
pub fn meta() -> Value {
    meta_of(&lora_dir())
}

/// `dir`'s meta.json.
pub fn meta_of(dir: &std::path::Path) -> Value {
    let text = std::fs::read_to_string(dir.join("meta.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The golden's optimizer: torch's AdamW at lr 1e-3, no weight decay, no clipping.
pub fn golden_params() -> StepParams {
    StepParams {
        adam: AdamW {
            lr: 1e-3,
            weight_decay: 0.0,
            ..AdamW::default()
        },
        clip: 0.0,
        loss_scale: 1.0,
    }
}

/// The LoRA model over lora-tiny's base with adapter0's settings, and its parameters:
/// the base's, then adapter0's `A` and `B` in the adapters' slots.
pub fn golden_start() -> (Model, Model, Vec<Vec<f32>>, LoraAdapter) {
    let (base, base_params) = load_pretrained(&lora_dir().join("base")).unwrap();
    let adapter = LoraAdapter::read(&lora_dir().join("adapter0"), &base).unwrap();
    let lora = base.lora(&adapter.config).unwrap();
    let mut params: Vec<Vec<f32>> = base_params
        .iter()
        .zip(lora.blocks())
        .map(|(p, block)| {
            let mut p = p.clone();
            p.resize(block.len, 0.0);
            p
        })
        .collect();
    adapter.into_blocks(&lora, &mut params).unwrap();
    (base, lora, params, adapter)
}

/// The golden's batches, one per step.
pub fn golden_batches(model: &Model) -> Vec<Batch> {
    let data = TokenData::open(&lora_dir().join("tokens.bin")).unwrap();
    (0..STEPS)
        .map(|k| {
            let mut batch = Batch::default();
            data.read_batch(k, B, T, model.vocab(), &mut batch).unwrap();
            batch
        })
        .collect()
}
