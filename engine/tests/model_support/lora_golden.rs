//! The LoRA golden data (`tests/data/lora-tiny`, and `qlora-tiny` over the same base):
//! its settings, its optimizer, the model and parameters it starts from, its batches,
//! its steps through the executor and the checks of their losses and adapters.

use std::path::PathBuf;

use serde_json::Value;
use strata_engine::exec::{ExecConfig, Executor, StepParams};
use strata_engine::kernels::adamw::AdamW;
use strata_engine::model::data::{Batch, TokenData};
use strata_engine::model::lora::LoraAdapter;
use strata_engine::model::lora::layout::adapter_slots;
use strata_engine::model::weights::load_pretrained;
use strata_engine::model::{Model, Slot};
use strata_engine::plan::{Plan, PlanInput, Policy, StepShape};

use super::{data_dir, rel_err};

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

/// The golden's losses in `dir`'s meta.json.
pub fn golden_losses(dir: &std::path::Path) -> Vec<f64> {
    meta_of(dir)["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_f64().unwrap())
        .collect()
}

/// The golden's steps of `model` from `start` under `policy`, through the executor (its
/// NVMe in `nvme`): the executor after its flush, and each step's loss.
pub fn golden_steps(
    model: &Model,
    start: &[Vec<f32>],
    policy: &dyn Policy,
    nvme: &std::path::Path,
) -> (Executor, Vec<f32>) {
    let input = PlanInput::new(model, StepShape::cpu(B, T), super::UNLIMITED);
    let plan = Plan::build(&input, policy).unwrap();
    let config = ExecConfig {
        nvme_dirs: vec![nvme.to_path_buf()],
        ..ExecConfig::default()
    };
    let mut exec = Executor::on_cpu(model.clone(), plan, &config).unwrap();
    exec.load(start, None).unwrap();
    let losses = golden_batches(model)
        .iter()
        .map(|batch| {
            let refs = [(&batch.inputs[..], &batch.targets[..])];
            exec.step(&refs, &golden_params()).unwrap().loss
        })
        .collect();
    exec.flush(&golden_params()).unwrap();
    (exec, losses)
}

/// Asserts `losses` within [`TOLERANCE`] of `want`, and each adapter of `expected` of
/// `trained` (each block's trained tail, as the executor exports it), for `what`.
pub fn assert_golden(
    model: &Model,
    (losses, want): (&[f32], &[f64]),
    trained: &[Vec<f32>],
    expected: &LoraAdapter,
    what: &str,
) {
    for (k, (&got, &want)) in losses.iter().zip(want).enumerate() {
        let err = rel_err(&[got], &[want as f32]);
        assert!(err < TOLERANCE, "{what}: step {k} loss {got} vs {want}");
    }
    for w in &expected.layers {
        let block = &model.blocks()[w.layer.block];
        let slots = adapter_slots(block, &w.layer);
        let tail = &trained[w.layer.block];
        let part = |s: Slot| &tail[s.offset - block.frozen..][..s.len];
        let (ea, eb) = (rel_err(part(slots.a), &w.a), rel_err(part(slots.b), &w.b));
        assert!(
            ea < TOLERANCE && eb < TOLERANCE,
            "{what}: {} after {STEPS} steps: A off by {ea:.2e}, B by {eb:.2e}",
            w.layer.module
        );
    }
}
