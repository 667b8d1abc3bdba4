//! The model against PyTorch: the reference data in `tests/data/gpt2-tiny` (made with
//! Hugging Face's GPT2LMHeadModel in float32) must be reproduced in fp32 on the CPU with
//! ‖out − ref‖ / ‖ref‖ < 1e-5 for the logits, the losses, the evaluation losses and every
//! gradient, on every instruction set this CPU has.

mod model_support;

use model_support::{golden_dir, read_f32_tensors, rel_err};
use strata_engine::kernels::isa::Isa;
use strata_engine::kernels::ops::Cpu;
use strata_engine::model::data::{Batch, TokenData};
use strata_engine::model::weights::{self, load_pretrained};
use strata_engine::model::{Backend, CpuBackend, Model};

const B: usize = 2;
const T: usize = 16;
const TOLERANCE: f64 = 1e-5;

fn batch(model: &Model, data: &TokenData, step: usize) -> Batch {
    let mut batch = Batch::default();
    data.read_batch(step, B, T, model.config().vocab, &mut batch)
        .unwrap();
    batch
}

/// Replaces every parameter by the tensor `prefix` + its `transformer.` name.
fn params_from(
    model: &Model,
    tensors: &std::collections::HashMap<String, Vec<f32>>,
    prefix: &str,
) -> Vec<Vec<f32>> {
    let mut params = model.zero_params();
    for (block, buffer) in model.blocks().iter().zip(&mut params) {
        for t in &block.tensors {
            let name = format!("{prefix}{}{}", weights::PREFIX, t.name);
            let src = tensors
                .get(&name)
                .unwrap_or_else(|| panic!("{name} missing"));
            buffer[t.slot.range()].copy_from_slice(src);
        }
    }
    params
}

#[test]
fn cpu_matches_pytorch_on_the_tiny_model() {
    let dir = golden_dir();
    let (model, params) = load_pretrained(&dir).unwrap();
    let expected = read_f32_tensors(&dir.join("expected.safetensors"));
    let data = TokenData::open(&dir.join("tokens.bin")).unwrap();
    let step0 = batch(&model, &data, 0);
    for isa in Isa::supported() {
        for threads in [1, 2] {
            let be = CpuBackend {
                cpu: Cpu { isa, threads },
            };
            let mut ws = model.workspace(&be, B, T).unwrap();
            let loss = model
                .forward(&be, &params, &mut ws, &step0.inputs, &step0.targets)
                .unwrap();
            let logits = be.download_act(&ws.scratch.logits).unwrap();
            let logits_err = rel_err(&logits, &expected["logits0"]);
            let loss_err = rel_err(&[loss], &expected["losses"][..1]);
            let mut grads = model.alloc_grads(&be).unwrap();
            model.backward(&be, &params, &mut grads, &mut ws).unwrap();
            let mut worst = (0.0f64, String::new());
            for (block, g) in model.blocks().iter().zip(&grads) {
                for t in &block.tensors {
                    let name = format!("grad0.{}{}", weights::PREFIX, t.name);
                    let err = rel_err(&g[t.slot.range()], &expected[&name]);
                    assert!(
                        err < TOLERANCE,
                        "{isa} x{threads}: {name} relative error {err:.3e}"
                    );
                    if err > worst.0 {
                        worst = (err, t.name.clone());
                    }
                }
            }
            println!(
                "{isa} x{threads}: logits {logits_err:.3e}, loss {loss_err:.3e}, \
                 worst gradient {:.3e} ({})",
                worst.0, worst.1
            );
            assert!(
                logits_err < TOLERANCE,
                "logits relative error {logits_err:.3e}"
            );
            assert!(
                loss_err < TOLERANCE,
                "loss {loss} vs {}",
                expected["losses"][0]
            );
        }
    }
}

#[test]
fn eval_losses_and_the_loss_after_one_step_match_pytorch() {
    let dir = golden_dir();
    let (model, params) = load_pretrained(&dir).unwrap();
    let expected = read_f32_tensors(&dir.join("expected.safetensors"));
    let data = TokenData::open(&dir.join("tokens.bin")).unwrap();
    assert_eq!(data.batch_count(B, T), 3);
    let be = CpuBackend::default();
    let mut ws = model.workspace(&be, B, T).unwrap();
    for (step, &want) in expected["eval_losses"].iter().enumerate() {
        let b = batch(&model, &data, step);
        let loss = model
            .forward(&be, &params, &mut ws, &b.inputs, &b.targets)
            .unwrap();
        let err = rel_err(&[loss], &[want]);
        println!("eval step {step}: loss {loss} (PyTorch {want}), relative error {err:.3e}");
        assert!(err < TOLERANCE);
    }
    // losses[1] is the loss of batch 1 under the parameters after the first AdamW step,
    // which the reference data holds as step1.*; losses[2] needs the parameters after two
    // steps, which it does not (that check belongs to the optimizer's tests).
    let step1 = params_from(&model, &expected, "step1.");
    let b = batch(&model, &data, 1);
    let loss = model
        .forward(&be, &step1, &mut ws, &b.inputs, &b.targets)
        .unwrap();
    let want = expected["losses"][1];
    let err = rel_err(&[loss], &[want]);
    println!("training step 1: loss {loss} (PyTorch {want}), relative error {err:.3e}");
    assert!(err < TOLERANCE);
}

#[test]
fn gradients_accumulate_and_runs_are_deterministic() {
    let dir = golden_dir();
    let (model, params) = load_pretrained(&dir).unwrap();
    let data = TokenData::open(&dir.join("tokens.bin")).unwrap();
    let step0 = batch(&model, &data, 0);
    let be = CpuBackend::default();
    let mut ws = model.workspace(&be, B, T).unwrap();
    let mut once = model.alloc_grads(&be).unwrap();
    model
        .forward(&be, &params, &mut ws, &step0.inputs, &step0.targets)
        .unwrap();
    model.backward(&be, &params, &mut once, &mut ws).unwrap();
    // Backward without a new forward is refused: the head's logits now hold gradients.
    assert!(
        model
            .backward(&be, &params, &mut once.clone(), &mut ws)
            .is_err()
    );
    let mut twice = model.alloc_grads(&be).unwrap();
    for _ in 0..2 {
        model
            .forward(&be, &params, &mut ws, &step0.inputs, &step0.targets)
            .unwrap();
        model.backward(&be, &params, &mut twice, &mut ws).unwrap();
    }
    // Adding into a gradient rounds differently from computing it afresh, so the sum of
    // two passes is 2x one pass up to rounding, not bit for bit.
    let doubled: Vec<f32> = once.iter().flatten().map(|g| 2.0 * g).collect();
    let summed: Vec<f32> = twice.iter().flatten().copied().collect();
    assert!(rel_err(&summed, &doubled) < 1e-6);
    // A second run from zeroed gradients is bit-identical to the first.
    let mut again = model.alloc_grads(&be).unwrap();
    model
        .forward(&be, &params, &mut ws, &step0.inputs, &step0.targets)
        .unwrap();
    model.backward(&be, &params, &mut again, &mut ws).unwrap();
    for (a, b) in once.iter().flatten().zip(again.iter().flatten()) {
        assert_eq!(a.to_bits(), b.to_bits());
    }
    let mut bad = step0.inputs.clone();
    bad[5] = 64;
    let err = model
        .forward(&be, &params, &mut ws, &bad, &step0.targets)
        .unwrap_err();
    assert!(err.to_string().contains("token 64 at position 5"), "{err}");
}

#[test]
fn a_failed_forward_leaves_nothing_for_backward() {
    let (model, params) = load_pretrained(&golden_dir()).unwrap();
    let data = TokenData::open(&golden_dir().join("tokens.bin")).unwrap();
    let be = CpuBackend::default();
    let mut ws = model.workspace(&be, 2, 16).unwrap();
    let mut grads = model.alloc_grads(&be).unwrap();
    let good = batch(&model, &data, 0);
    model
        .forward(&be, &params, &mut ws, &good.inputs, &good.targets)
        .unwrap();
    // A second forward fails on a token outside the vocabulary: the workspace must not
    // still offer the first batch's pass to backward.
    let mut bad = good.inputs.clone();
    bad[3] = 64;
    assert!(
        model
            .forward(&be, &params, &mut ws, &bad, &good.targets)
            .is_err()
    );
    let error = model
        .backward(&be, &params, &mut grads, &mut ws)
        .unwrap_err();
    assert!(error.to_string().contains("forward"), "{error}");
}
