//! LoRA training's programs (`Model::lora`) against peft, on `tests/data/lora-tiny` (a
//! Llama base with a rank-4 adapter on q_proj and v_proj; see its README):
//!
//! 1. The base read from its folder into the LoRA model, adapter0 put into its blocks:
//!    one forward and backward on step 0's batch (2 × 16 tokens) gives peft's loss
//!    (`meta.json`'s `losses[0]`) and every `lora_A` and `lora_B` gradient of
//!    `grads0.safetensors` within 1e-5 relative; recomputing and saved activations give
//!    the same bits; the frozen blocks have no gradients.
//! 2. Started as peft starts (B zero), the LoRA model computes its base's loss bit for
//!    bit, and only the B matrices get a gradient.
//! 3. The adapter read back from the blocks is adapter0, and writes as peft's folder.
//! 4. GPT-2 (`tests/data/gpt2-tiny`, Conv1D weights (in, out); no peft golden): with a
//!    random adapter on c_attn, c_proj (attention and MLP) and c_fc, the LoRA model's
//!    loss is the merged model's, and its adapter gradients follow from the merged
//!    weights' gradients `G` by the chain rule (`W' = W + s (B A)ᵀ`: `dA = s Bᵀ Gᵀ`,
//!    `dB = s Gᵀ Aᵀ`), within 1e-5; saved and recomputed alike.

mod model_support;

use std::path::PathBuf;

use model_support::{data_dir, read_f32_tensors, rel_err};
use strata_engine::exec::Runner;
use strata_engine::model::data::{Batch, TokenData};
use strata_engine::model::lora::{
    LoraAdapter, LoraConfig, LoraWeights, adapter_names, init_block_adapters, merge_params,
    peft_names, select_layers,
};
use strata_engine::model::weights::{FileDtype, PretrainedBlocks, load_config, load_pretrained};
use strata_engine::model::{BlockKind, Model};
use strata_engine::plan::Recompute;

const B: usize = 2;
const T: usize = 16;
const TOLERANCE: f64 = 1e-5;

fn lora_dir() -> PathBuf {
    data_dir("lora-tiny")
}

fn base_model() -> Model {
    load_config(&lora_dir().join("base/config.json")).unwrap()
}

fn adapter0(base: &Model) -> LoraAdapter {
    LoraAdapter::read(&lora_dir().join("adapter0"), base).unwrap()
}

/// The base folder's weights read into `model`'s blocks (a LoRA model's adapters zero).
fn read_base(model: &Model) -> Vec<Vec<f32>> {
    let blocks = PretrainedBlocks::open(&lora_dir().join("base"), model).unwrap();
    (0..model.blocks().len())
        .map(|b| blocks.read_block(b).unwrap())
        .collect()
}

fn step0_batch(model: &Model) -> Batch {
    batch_of(&lora_dir(), model)
}

/// The first batch of `dir`'s `tokens.bin`.
fn batch_of(dir: &std::path::Path, model: &Model) -> Batch {
    let data = TokenData::open(&dir.join("tokens.bin")).unwrap();
    let mut batch = Batch::default();
    data.read_batch(0, B, T, model.vocab(), &mut batch).unwrap();
    batch
}

/// The loss and the gradients of one forward and backward of step 0's batch.
fn step0(model: &Model, params: &[Vec<f32>], recompute: Recompute) -> (f32, Vec<Vec<f32>>) {
    step(model, params, &step0_batch(model), recompute)
}

/// The loss and the gradients of one forward and backward of `batch`.
fn step(
    model: &Model,
    params: &[Vec<f32>],
    batch: &Batch,
    recompute: Recompute,
) -> (f32, Vec<Vec<f32>>) {
    let mut runner = Runner::on_cpu_recomputing(model.clone(), B, T, recompute).unwrap();
    runner.load(params).unwrap();
    let loss = runner.forward(&batch.inputs, &batch.targets).unwrap();
    (loss, runner.backward().unwrap())
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn adapter_gradients_are_pefts_on_lora_tiny() {
    let base = base_model();
    let adapter = adapter0(&base);
    let lora = base.lora(&adapter.config).unwrap();
    let mut params = read_base(&lora);
    adapter.into_blocks(&lora, &mut params).unwrap();
    let (loss, grads) = step0(&lora, &params, Recompute::All);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(lora_dir().join("meta.json")).unwrap())
            .unwrap();
    let want_loss = meta["losses"][0].as_f64().unwrap() as f32;
    assert!(
        rel_err(&[loss], &[want_loss]) < TOLERANCE,
        "{loss} vs {want_loss}"
    );
    // Each block's gradients are its trained tail: none for the embedding and the head.
    for (block, g) in lora.blocks().iter().zip(&grads) {
        assert_eq!(g.len(), block.trained_len(), "{:?}", block.kind);
        let trains = matches!(block.kind, BlockKind::Transformer { .. });
        assert_eq!(block.trains(), trains, "{:?}", block.kind);
    }
    let want = read_f32_tensors(&lora_dir().join("grads0.safetensors"));
    assert_eq!(want.len(), 2 * adapter.layers.len(), "the golden's tensors");
    for w in &adapter.layers {
        let block = &lora.blocks()[w.layer.block];
        for (layout_name, peft_name) in adapter_names(&w.layer).iter().zip(peft_names(&w.layer)) {
            let slot = block.tensor(layout_name).unwrap().slot;
            let at = slot.offset - block.frozen;
            let got = &grads[w.layer.block][at..at + slot.len];
            let err = rel_err(got, &want[&peft_name]);
            println!("{peft_name}: relative error {err:.3e}");
            assert!(err < TOLERANCE, "{peft_name}: relative error {err:.3e}");
        }
    }
    // Saved activations instead of recomputation: the same bits.
    let (saved_loss, saved_grads) = step0(&lora, &params, Recompute::None);
    assert_eq!(saved_loss.to_bits(), loss.to_bits());
    for (s, g) in saved_grads.iter().zip(&grads) {
        assert_eq!(bits(s), bits(g));
    }
}

#[test]
fn started_as_peft_starts_the_lora_model_is_its_base_and_only_b_learns_first() {
    let base = base_model();
    let lora = base.lora(&adapter0(&base).config).unwrap();
    let mut params = read_base(&lora);
    for (b, block) in params.iter_mut().enumerate() {
        init_block_adapters(&lora, b, 7, block).unwrap();
    }
    let (base_loss, _) = step0(&base, &read_base(&base), Recompute::All);
    let (loss, grads) = step0(&lora, &params, Recompute::All);
    assert_eq!(
        loss.to_bits(),
        base_loss.to_bits(),
        "B = 0 adds exactly nothing"
    );
    let layers = select_layers(&base, lora.lora_config().unwrap()).unwrap();
    assert_eq!(layers.len(), 4);
    for layer in &layers {
        let block = &lora.blocks()[layer.block];
        let [a, b] = adapter_names(layer).map(|n| block.tensor(&n).unwrap().slot);
        // A kaiming-uniform in ±1/sqrt(in), deterministic in the seed; B zero.
        let values = &params[layer.block][a.range()];
        let bound = 1.0 / (layer.in_features as f32).sqrt();
        assert!(values.iter().all(|v| v.abs() <= bound && *v != 0.0));
        let spread = values.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
        assert!(spread > 0.9 * bound, "{spread} of {bound}");
        assert!(params[layer.block][b.range()].iter().all(|&v| v == 0.0));
        let again = lora.init_block(layer.block, 7);
        assert_eq!(bits(&again[a.range()]), bits(values));
        assert_ne!(
            bits(&lora.init_block(layer.block, 8)[a.range()]),
            bits(values)
        );
        // dA = s Bᵀ (...) is zero while B is; dB is not.
        let grad = |slot: strata_engine::model::Slot| {
            let at = slot.offset - block.frozen;
            grads[layer.block][at..at + slot.len].to_vec()
        };
        assert!(grad(a).iter().all(|&g| g == 0.0));
        assert!(grad(b).iter().any(|&g| g != 0.0));
    }
}

#[test]
fn the_adapter_read_back_from_the_blocks_is_the_one_put_in_and_writes_as_pefts() {
    let base = base_model();
    let adapter = adapter0(&base);
    let lora = base.lora(&adapter.config).unwrap();
    let mut params = lora.zero_params();
    adapter.into_blocks(&lora, &mut params).unwrap();
    let back = LoraAdapter::from_blocks(&lora, &params).unwrap();
    assert_eq!(back, adapter);
    let dir = tempfile::tempdir().unwrap();
    back.write(dir.path(), "base", FileDtype::F32).unwrap();
    assert_eq!(LoraAdapter::read(dir.path(), &base).unwrap(), adapter);
    // The base model has no adapters to put it into or read it from.
    let e = adapter.into_blocks(&base, &mut base.zero_params());
    assert!(e.unwrap_err().to_string().contains("Model::lora"));
    let e = LoraAdapter::from_blocks(&base, &base.zero_params());
    assert!(e.unwrap_err().to_string().contains("no LoRA adapters"));
}

/// `n` values in ±0.1 from `seed` (xorshift), deterministic.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
        })
        .collect()
}

/// `dA = s Bᵀ Gᵀ` and `dB = s Gᵀ Aᵀ` for the gradient `g` of a Conv1D weight (in, out)
/// with `w`'s update merged in, in f64.
fn chain_rule(g: &[f32], w: &LoraWeights, rank: usize, scale: f64) -> [Vec<f32>; 2] {
    let (n_in, n_out) = (w.layer.in_features, w.layer.out_features);
    let at = |i: usize, o: usize| f64::from(g[i * n_out + o]);
    let mut da = vec![0f32; rank * n_in];
    for k in 0..rank {
        for i in 0..n_in {
            let sum: f64 = (0..n_out)
                .map(|o| f64::from(w.b[o * rank + k]) * at(i, o))
                .sum();
            da[k * n_in + i] = (scale * sum) as f32;
        }
    }
    let mut db = vec![0f32; n_out * rank];
    for o in 0..n_out {
        for k in 0..rank {
            let sum: f64 = (0..n_in)
                .map(|i| at(i, o) * f64::from(w.a[k * n_in + i]))
                .sum();
            db[o * rank + k] = (scale * sum) as f32;
        }
    }
    [da, db]
}

#[test]
fn gpt2_adapter_gradients_follow_from_the_merged_weights_gradient() {
    let dir = data_dir("gpt2-tiny");
    let (base, params) = load_pretrained(&dir).unwrap();
    let targets = ["c_attn", "c_proj", "c_fc"].map(String::from).to_vec();
    let config = LoraConfig::new(3, 6.0, 0.0, targets).unwrap();
    let mut seed = 0;
    let adapter = LoraAdapter::new(&base, config.clone(), |layer| {
        seed += 2;
        let a = values(3 * layer.in_features, seed);
        (a, values(layer.out_features * 3, seed + 1))
    })
    .unwrap();
    assert_eq!(
        adapter.layers.len(),
        8,
        "c_attn, both c_proj and c_fc of 2 layers"
    );
    let batch = batch_of(&dir, &base);
    let merged = merge_params(&base, &params, &adapter).unwrap();
    let (merged_loss, merged_grads) = step(&base, &merged, &batch, Recompute::All);
    let lora = base.lora(&config).unwrap();
    let mut lora_params = lora.zero_params();
    for (p, b) in lora_params.iter_mut().zip(&params) {
        p[..b.len()].copy_from_slice(b);
    }
    adapter.into_blocks(&lora, &mut lora_params).unwrap();
    let (loss, grads) = step(&lora, &lora_params, &batch, Recompute::All);
    assert!(
        rel_err(&[loss], &[merged_loss]) < TOLERANCE,
        "{loss} vs {merged_loss}"
    );
    for w in &adapter.layers {
        let block = &lora.blocks()[w.layer.block];
        let weight = base.blocks()[w.layer.block]
            .tensor(&w.layer.weight)
            .unwrap();
        let want = chain_rule(
            &merged_grads[w.layer.block][weight.slot.range()],
            w,
            3,
            config.scale(),
        );
        for (name, want) in adapter_names(&w.layer).iter().zip(want) {
            let slot = block.tensor(name).unwrap().slot;
            let at = slot.offset - block.frozen;
            let err = rel_err(&grads[w.layer.block][at..at + slot.len], &want);
            println!("{name}: relative error {err:.3e}");
            assert!(err < TOLERANCE, "{name}: relative error {err:.3e}");
        }
    }
    let (saved_loss, saved_grads) = step(&lora, &lora_params, &batch, Recompute::None);
    assert_eq!(saved_loss.to_bits(), loss.to_bits());
    for (s, g) in saved_grads.iter().zip(&grads) {
        assert_eq!(bits(s), bits(g));
    }
}
