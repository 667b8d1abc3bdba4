//! Packed batches against documents run one by one: `tests/data/llama-packed-tiny` holds
//! five documents that tile a batch of 2 × 16, each ending with the model's eos id, and
//! the loss and gradients transformers gives running each document alone (see its
//! README). The packed batch, each token attending only within its document and its
//! positions restarting there, the target after each eos not counted, must give the same
//! loss and gradients: through the whole-model runner on every ISA and thread count,
//! recomputing and reading saved activations alike (bit-identical), and through the
//! executor's step under every policy and chaos seed (the same loss, bit for bit).

mod model_support;

use model_support::{
    CHAOS, UNLIMITED, all_policies, data_dir, forward_backward_both_ways, read_f32_tensors, rel_err,
};
use strata_engine::exec::{ExecConfig, Executor, StepParams};
use strata_engine::kernels::adamw::AdamW;
use strata_engine::kernels::isa::Isa;
use strata_engine::kernels::ops::Cpu;
use strata_engine::model::Model;
use strata_engine::model::data::{Batch, TokenData};
use strata_engine::model::weights::load_pretrained;
use strata_engine::plan::{Plan, PlanInput, Recompute, StepShape};

const B: usize = 2;
const T: usize = 16;
const TOLERANCE: f64 = 1e-5;

/// The golden data's end-of-document id (its `meta.json`).
fn eos() -> u32 {
    let meta = std::fs::read_to_string(data_dir("llama-packed-tiny").join("meta.json")).unwrap();
    let meta: serde_json::Value = serde_json::from_str(&meta).unwrap();
    meta["eos"].as_u64().unwrap() as u32
}

/// Batch 0 of the golden tokens, packed when `eos` is given.
fn batch(model: &Model, eos: Option<u32>) -> Batch {
    let data = TokenData::open(&data_dir("llama-packed-tiny").join("tokens.bin")).unwrap();
    let data = match eos {
        Some(eos) => data.packed(eos),
        None => data,
    };
    let mut batch = Batch::default();
    data.read_batch(0, B, T, model.vocab(), &mut batch).unwrap();
    batch
}

#[test]
fn a_packed_batch_gives_each_documents_own_loss_and_gradients() {
    let dir = data_dir("llama-packed-tiny");
    let (model, params) = load_pretrained(&dir).unwrap();
    let expected = read_f32_tensors(&dir.join("expected.safetensors"));
    let eos = eos();
    let packed = model.packed(eos).unwrap();
    let b = batch(&packed, Some(eos));
    let ignored = b
        .targets
        .iter()
        .filter(|&&t| t == strata_engine::model::IGNORE_TARGET);
    assert_eq!(
        ignored.count(),
        5,
        "one target after each of the five documents"
    );
    for isa in Isa::supported() {
        for threads in [1, 2] {
            let cpu = Cpu { isa, threads };
            let what = format!("{isa} x{threads}");
            let out = forward_backward_both_ways(
                &packed, &params, B, T, cpu, &b.inputs, &b.targets, &what,
            );
            let loss_err = rel_err(&[out.loss], &expected["loss"]);
            assert!(
                loss_err < TOLERANCE,
                "{what}: loss {} vs {:?}",
                out.loss,
                expected["loss"]
            );
            let mut worst = 0.0f64;
            for (block, g) in model.blocks().iter().zip(&out.grads) {
                for t in &block.tensors {
                    let err = rel_err(&g[t.slot.range()], &expected[&format!("grad.{}", t.name)]);
                    assert!(
                        err < TOLERANCE,
                        "{what}: {} relative error {err:.3e}",
                        t.name
                    );
                    worst = worst.max(err);
                }
            }
            println!("{what}: loss {loss_err:.3e}, worst gradient {worst:.3e}");
        }
    }
    // Unpacked, the same tokens attend across documents with running positions, and
    // the loss is another: the comparison above sees the packing.
    let plain = batch(&model, None);
    let cpu = Cpu {
        isa: Isa::best(),
        threads: 2,
    };
    let out = forward_backward_both_ways(
        &model,
        &params,
        B,
        T,
        cpu,
        &plain.inputs,
        &plain.targets,
        "plain",
    );
    let gap = rel_err(&[out.loss], &expected["loss"]);
    println!(
        "unpacked: loss {} against the documents' {:?}",
        out.loss, expected["loss"]
    );
    assert!(gap > 1e-3, "unpacked loss {} is the documents'", out.loss);
}

#[test]
fn the_executor_steps_a_packed_batch_alike_under_every_policy() {
    let dir = data_dir("llama-packed-tiny");
    let (model, params) = load_pretrained(&dir).unwrap();
    let expected = read_f32_tensors(&dir.join("expected.safetensors"));
    let packed = model.packed(eos()).unwrap();
    let b = batch(&packed, Some(eos()));
    let params_of_step = StepParams {
        adam: AdamW::default(),
        clip: 0.0,
        loss_scale: 1.0,
    };
    let mut runs = Vec::new();
    // Every block keeping its activations on the device, and offloading them.
    for policy in all_policies() {
        for recompute in [Recompute::Auto, Recompute::Offload] {
            let shape = StepShape::cpu(B, T).recomputing(recompute);
            let input = PlanInput::new(&packed, shape, UNLIMITED);
            for chaos in CHAOS {
                let plan = Plan::build(&input, policy.as_ref()).unwrap();
                let nvme = tempfile::tempdir().unwrap();
                let config = ExecConfig {
                    nvme_dirs: vec![nvme.path().into()],
                    chaos,
                    ..ExecConfig::default()
                };
                let mut exec = Executor::on_cpu(packed.clone(), plan, &config).unwrap();
                exec.load(&params, None).unwrap();
                let report = exec
                    .step(&[(&b.inputs, &b.targets)], &params_of_step)
                    .unwrap();
                let updated = exec.export().unwrap().0;
                let what = format!("{} --recompute {recompute}", policy.name());
                runs.push((what, chaos, report.loss, updated));
            }
        }
    }
    let (_, _, loss, updated) = &runs[0];
    assert!(rel_err(&[*loss], &expected["loss"]) < TOLERANCE, "{loss}");
    assert_ne!(updated, &params, "the step updated nothing");
    for (policy, chaos, l, u) in &runs {
        let what = format!("{policy} chaos {chaos:?}");
        assert_eq!(l.to_bits(), loss.to_bits(), "{what}: loss {l} vs {loss}");
        assert!(u == updated, "{what}: parameters after the step differ");
    }
}
