//! Backward passes against f64 finite differences on tiny models.
//!
//! 1. The scalar reference model, run in f64, against central differences of its own
//!    forward pass, on sampled elements of every parameter tensor: checks the backward
//!    math.
//! 2. The engine's model (its block programs on the CPU device through a whole-model
//!    [`Runner`](strata_engine::exec::Runner): fast f32 kernels, backward recomputing each
//!    block from its input, and bit-identically reading what each block's forward saved)
//!    against those same finite differences, and whole tensors against the f64 reference
//!    gradient: checks the fast kernels, the block wiring and the tied head.

mod model_support;

use model_support::{RECOMPUTE, assert_same_gradients, golden_dir, rel_err};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use strata_engine::exec::Runner;
use strata_engine::kernels::reference::gpt2_model::{self as reference, Gpt2Shape, Weights};
use strata_engine::model::data::{Batch, TokenData};
use strata_engine::model::weights::load_pretrained;
use strata_engine::model::{Gpt2Config, Model};

/// The reference model's shape of `model`, a GPT-2: its five numbers, the heads read
/// from the `config.json` the family writes (a [`Model`] does not expose them).
fn reference_shape(model: &Model) -> Gpt2Shape {
    let hf = model.family().hf_config();
    let heads = hf["n_head"]
        .as_u64()
        .expect("a GPT-2 config.json has n_head") as usize;
    let config = Gpt2Config::new(
        model.layers(),
        heads,
        model.width(),
        model.vocab(),
        model.context(),
    );
    assert_eq!(&Model::new(config).unwrap(), model, "{config:?}");
    config.shape()
}

/// The model's parameters as the reference model's f64 tensors.
fn to_reference(model: &Model, params: &[Vec<f32>]) -> Weights<f64> {
    let mut w = Weights::zeros(reference_shape(model));
    for (block, buffer) in model.blocks().iter().zip(params) {
        for t in &block.tensors {
            let dst = w
                .get_mut(&t.name)
                .unwrap_or_else(|| panic!("{} missing", t.name));
            *dst = buffer[t.slot.range()].iter().map(|&v| v as f64).collect();
        }
    }
    w
}

/// The model's parameters as the reference model's f32 tensors.
fn to_reference32(model: &Model, params: &[Vec<f32>]) -> Weights<f32> {
    let mut w = Weights::zeros(reference_shape(model));
    for (block, buffer) in model.blocks().iter().zip(params) {
        for t in &block.tensors {
            *w.get_mut(&t.name).unwrap() = buffer[t.slot.range()].to_vec();
        }
    }
    w
}

fn check_model(model: &Model, params: &[Vec<f32>], batch: usize, seq: usize, tokens: &Batch) {
    let shape = reference_shape(model);
    let (x, y) = (&tokens.inputs, &tokens.targets);
    let w = to_reference(model, params);
    let (out, ref_grads) = reference::backward(shape, &w, x, y, batch, seq);
    // The same reference run in f32: how much f32 rounding alone moves each gradient.
    let w32 = to_reference32(model, params);
    let (_, mut ref32_grads) = reference::backward(shape, &w32, x, y, batch, seq);

    let [(loss, grads), saved] = RECOMPUTE.map(|recompute| {
        let mut runner = Runner::on_cpu_recomputing(model.clone(), batch, seq, recompute).unwrap();
        runner.load(params).unwrap();
        let loss = runner.forward(x, y).unwrap();
        (loss, runner.backward().unwrap())
    });
    assert_same_gradients(
        &(loss, &grads),
        &(saved.0, &saved.1),
        "recomputing vs saved activations",
    );
    assert!(
        (loss as f64 - out.loss).abs() < 1e-5 * out.loss.abs(),
        "loss {loss} vs {}",
        out.loss
    );
    assert_eq!(grads.len(), model.blocks().len());

    let mut rng = StdRng::seed_from_u64(11);
    let (mut worst_ref, mut worst_fast, mut worst_tensor) = (0.0f64, 0.0f64, 0.0f64);
    let mut ref_grads = ref_grads;
    let mut probe = w.clone();
    for (block, g) in model.blocks().iter().zip(&grads) {
        for t in &block.tensors {
            let fast = &g[t.slot.range()];
            let analytic: Vec<f64> = ref_grads.get_mut(&t.name).unwrap().clone();
            let analytic32: Vec<f32> = analytic.iter().map(|&v| v as f32).collect();
            let tensor_err = rel_err(fast, &analytic32);
            let rounding = rel_err(ref32_grads.get_mut(&t.name).unwrap(), &analytic32);
            // As close as 1e-5, or within a few times what plain f32 rounding costs.
            assert!(
                tensor_err < f64::max(1e-5, 4.0 * rounding),
                "{}: fast vs f64 reference {tensor_err:.3e} (plain f32: {rounding:.3e})",
                t.name
            );
            worst_tensor = worst_tensor.max(tensor_err);
            for _ in 0..4 {
                let i = rng.random_range(0..t.slot.len);
                let h = 1e-5;
                let original = probe.get_mut(&t.name).unwrap()[i];
                probe.get_mut(&t.name).unwrap()[i] = original + h;
                let plus = reference::forward(shape, &probe, x, y, batch, seq).loss;
                probe.get_mut(&t.name).unwrap()[i] = original - h;
                let minus = reference::forward(shape, &probe, x, y, batch, seq).loss;
                probe.get_mut(&t.name).unwrap()[i] = original;
                let fd = (plus - minus) / (2.0 * h);
                let err_ref = (analytic[i] - fd).abs();
                assert!(
                    err_ref < 1e-8 + 1e-6 * fd.abs(),
                    "{}[{i}]: f64 backward {} vs finite difference {fd}",
                    t.name,
                    analytic[i]
                );
                let err_fast = (fast[i] as f64 - fd).abs();
                assert!(
                    err_fast < 1e-6 + 1e-4 * fd.abs(),
                    "{}[{i}]: fast backward {} vs finite difference {fd}",
                    t.name,
                    fast[i]
                );
                worst_ref = worst_ref.max(err_ref);
                worst_fast = worst_fast.max(err_fast);
            }
        }
    }
    println!(
        "f64 reference vs finite differences: max abs error {worst_ref:.2e}; fast f32 model vs \
         finite differences: max abs error {worst_fast:.2e}; fast vs f64 reference, worst \
         tensor relative error {worst_tensor:.2e}"
    );
}

#[test]
fn gradients_match_finite_differences_on_the_golden_model() {
    let dir = golden_dir();
    let (model, params) = load_pretrained(&dir).unwrap();
    let data = TokenData::open(&dir.join("tokens.bin")).unwrap();
    let mut batch = Batch::default();
    data.read_batch(0, 2, 16, model.vocab(), &mut batch)
        .unwrap();
    check_model(&model, &params, 2, 16, &batch);
}

#[test]
fn gradients_match_finite_differences_on_an_odd_shape() {
    // 3 layers, 3 heads of 8, vocabulary 50, context 20; batch 3 of 7 tokens.
    let model = Model::new(Gpt2Config::new(3, 3, 24, 50, 20)).unwrap();
    let mut params = model.init_params(5);
    // Larger weights than GPT-2's 0.02, so every path carries a sizeable gradient.
    let mut rng = StdRng::seed_from_u64(6);
    for buffer in &mut params {
        for v in buffer.iter_mut().filter(|v| **v != 0.0) {
            *v = *v * 4.0 + rng.random_range(-0.02..0.02);
        }
    }
    let (b, t) = (3, 7);
    let tokens: Vec<u32> = (0..b * t + 1).map(|_| rng.random_range(0..50)).collect();
    let batch = Batch {
        inputs: tokens[..b * t].to_vec(),
        targets: tokens[1..].to_vec(),
    };
    check_model(&model, &params, b, t, &batch);
}
