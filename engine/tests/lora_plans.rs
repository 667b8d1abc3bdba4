//! LoRA training through the executor: three AdamW steps on `tests/data/lora-tiny` give
//! peft's losses and trained adapters under every plan that can hold a LoRA model, the
//! frozen base never changes, and a LoRA model trains bit for bit alike under every
//! policy, recomputation and schedule, its adapted blocks' parameters on NVMe split into
//! an extent of the frozen base, written once, and one of the adapters, rewritten by each
//! update.

mod model_support;

use model_support::lora_golden::{
    B, T, assert_golden, golden_batches, golden_losses, golden_params, golden_start, golden_steps,
    lora_dir,
};
use model_support::training::{Run, assert_same, clipped_shapes, train, train_plan};
use model_support::{UNLIMITED, all_policies};
use strata_engine::exec::Runner;
use strata_engine::model::lora::{LoraAdapter, LoraConfig};
use strata_engine::model::{Llama, LlamaConfig, Model};
use strata_engine::plan::{AllOnDevice, Plan, PlanInput, Policy, StepShape};

/// Each block's parameters as the executor left them: the master copy of the adapters
/// in their slots over `start`'s base (which the executor must not have changed: the
/// runner's loss of them is compared with the executor's next step).
fn whole(model: &Model, start: &[Vec<f32>], tails: &[Vec<f32>]) -> Vec<Vec<f32>> {
    start
        .iter()
        .zip(tails)
        .zip(model.blocks())
        .map(|((p, tail), block)| {
            let mut p = p.clone();
            p[block.frozen..].copy_from_slice(&tail[..block.trained_len()]);
            p
        })
        .collect()
}

#[test]
fn three_lora_steps_through_the_executor_give_peft_losses_and_adapters() {
    let (base, lora, start, _) = golden_start();
    let expected = LoraAdapter::read(&lora_dir().join("expected"), &base).unwrap();
    let want = golden_losses(&lora_dir());
    let batches = golden_batches(&lora);
    let mut ran = 0;
    let mut reference: Option<Run> = None;
    for policy in all_policies() {
        let nvme = tempfile::tempdir().unwrap();
        let (mut exec, losses) = golden_steps(&lora, &start, policy.as_ref(), nvme.path());
        let (params, m, v) = exec.export().unwrap();
        let name = policy.name();
        assert_golden(&lora, (&losses, &want), &params, &expected, &name);
        // The base is as loaded: the runner's loss of the base with the trained adapters
        // is the executor's own loss of the next batch.
        let trained = whole(&lora, &start, &params);
        let mut runner = Runner::on_cpu(lora.clone(), B, T).unwrap();
        runner.load(&trained).unwrap();
        let next = runner
            .forward(&batches[0].inputs, &batches[0].targets)
            .unwrap();
        let refs = [(&batches[0].inputs[..], &batches[0].targets[..])];
        let exec_next = exec.step(&refs, &golden_params()).unwrap().loss;
        assert_eq!(
            next.to_bits(),
            exec_next.to_bits(),
            "{name}: the base moved"
        );
        let run = Run {
            losses,
            params,
            m,
            v,
            link_bytes: Vec::new(),
            measured: Default::default(),
        };
        match &reference {
            None => reference = Some(run),
            Some(r) => assert_same(r, &run, &name),
        }
        ran += 1;
    }
    assert_eq!(ran, all_policies().len());
}

fn small_lora() -> Model {
    let base = Model::of(Llama::new(LlamaConfig::llama(2, 48, 80, 4, 2, 96, 32)).unwrap());
    let config = LoraConfig::new(4, 8.0, 0.0, vec!["all-linear".into()]).unwrap();
    base.lora(&config).unwrap()
}

#[test]
fn a_lora_model_trains_bit_identically_under_every_plan() {
    let model = small_lora();
    let params = model_support::training::adamw_clipped(1.0);
    let mut split = 0;
    for (what, shape) in clipped_shapes() {
        let reference = train(&model, shape, &AllOnDevice, 3, params, None);
        assert!(
            reference.losses[2] < reference.losses[0],
            "{what}: {:?}",
            reference.losses
        );
        let policies: Vec<Box<dyn Policy>> = all_policies();
        for policy in &policies {
            let input = PlanInput::new(&model, shape, UNLIMITED);
            let plan = Plan::build(&input, policy.as_ref()).unwrap();
            split += plan
                .block_homes
                .iter()
                .filter(|h| h.params_base.is_some())
                .count();
            for chaos in [None, Some(3)] {
                let run = train_plan(&model, plan.clone(), 3, params, chaos);
                let case = format!("{what}, {}, chaos {chaos:?}", policy.name());
                // The device's copies, as it counted them, are the plan's (NVMe moves
                // whole 4 KiB blocks, which the plan does not count).
                for (step, moved) in run.link_bytes.iter().enumerate() {
                    let what = format!("{case}, step {step}: bytes copied each way");
                    assert_eq!(moved[2..], plan.link_bytes[2..], "{what}");
                }
                assert_same(&reference, &run, &case);
            }
        }
    }
    assert!(
        split > 0,
        "no plan put a trained block's parameters on NVMe"
    );
}

#[test]
fn only_the_adapters_train_and_the_gradients_hold_them_alone() {
    let model = small_lora();
    let plan = Plan::build(
        &PlanInput::new(&model, StepShape::cpu(2, 8), UNLIMITED),
        &AllOnDevice,
    )
    .unwrap();
    let blocks = model.blocks();
    let (first, last) = (&blocks[0], &blocks[blocks.len() - 1]);
    assert!(
        !first.trains() && !last.trains(),
        "embedding and head are frozen"
    );
    for (b, block) in blocks.iter().enumerate() {
        assert_eq!(plan.shard_len[b] as usize, block.trained_len(), "block {b}");
        for t in &block.tensors {
            let trained = t.slot.offset >= block.frozen;
            assert_eq!(t.name.contains(".lora_"), trained, "{}", t.name);
        }
    }
}
