//! Invariant 3: no heap allocation on the hot path after the first steps. Alone in its
//! process: a counting global allocator sees every allocation of every thread, and other
//! tests would add theirs.
//!
//! Buffer memory (device slots, host slots, NVMe extents, pinned staging) is allocated
//! once when the executor is built; the pools of events, transfer groups and packing
//! buffers fill during the first step. After that a step allocates exactly one thing:
//! its report's per-operation records, which it hands to the caller. The check counts
//! every allocation and reallocation, of any size, on any thread, during steps 3 to 6
//! of each policy (and of NVMe offload with the delayed update, and with bf16 and 8-bit
//! moments), and requires one per step.

use std::sync::atomic::Ordering;

use strata_engine::exec::{ExecConfig, Executor, StepParams};
use strata_engine::kernels::adamw::AdamW;
use strata_engine::model::{Gpt2Config, Model, OptimizerState};
use strata_engine::plan::{CpuOffload, NvmeOffload, Plan, PlanInput, Policy, StepShape, Tier};

mod model_support;
use model_support::{UNLIMITED, each_policy};

#[path = "../../tests/support/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::{ALLOCATIONS, COUNTING, SIZES};

#[test]
fn a_step_after_the_first_allocates_only_its_report() {
    // Wide enough that every block buffer is well over 64 KiB, and the products split
    // over threads.
    let model = Model::new(Gpt2Config::new(2, 4, 128, 512, 64)).unwrap();
    let shape = StepShape {
        grad_accum: 2,
        needs_global_norm: true,
        ..StepShape::cpu(2, 64)
    };
    // Every built-in policy, then NVMe offload again with the delayed update, then
    // AdamW's moments in bf16 (in host memory) and 8-bit (on NVMe).
    let fp32 = OptimizerState::Fp32;
    let mut runs: Vec<(Box<dyn Policy>, bool, OptimizerState)> = each_policy()
        .into_iter()
        .map(|p| (p, false, fp32))
        .collect();
    let nvme = || {
        Box::new(NvmeOffload {
            depth: 2,
            checkpoints: Tier::Nvme,
        })
    };
    runs.push((nvme(), true, fp32));
    runs.push((Box::new(CpuOffload), false, OptimizerState::Bf16));
    runs.push((nvme(), false, OptimizerState::Q8));
    let n = 2 * 64;
    let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 7) % 512).collect();
    let targets: Vec<u32> = (0..n as u32).map(|i| (i * 13 + 1) % 512).collect();
    let batches = [(&tokens[..], &targets[..]), (&targets[..], &tokens[..])];
    let params = StepParams {
        adam: AdamW::default(),
        clip: 1.0,
        loss_scale: 1.0,
    };
    const COUNTED: usize = 4;
    for (policy, delayed_update, state) in runs {
        let input = PlanInput {
            model: &model,
            shape: StepShape {
                delayed_update,
                ..shape
            }
            .with_state(state),
            budgets: UNLIMITED,
            cost: Default::default(),
        };
        let plan = Plan::build(&input, policy.as_ref()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let config = ExecConfig {
            nvme_dirs: vec![dir.path().into()],
            ..ExecConfig::default()
        };
        let mut exec = Executor::on_cpu(model.clone(), plan, &config).unwrap();
        exec.load(&model.init_params(1), None).unwrap();
        for _ in 0..2 {
            exec.step(&batches, &params).unwrap();
        }
        let mut reports = Vec::with_capacity(COUNTED);
        ALLOCATIONS.store(0, Ordering::SeqCst);
        COUNTING.store(true, Ordering::SeqCst);
        for _ in 0..COUNTED {
            reports.push(exec.step(&batches, &params).unwrap());
        }
        COUNTING.store(false, Ordering::SeqCst);
        let ops = exec.plan().ops.len();
        let counted = ALLOCATIONS.load(Ordering::SeqCst);
        let sizes: Vec<usize> = SIZES
            .iter()
            .take(counted)
            .map(|s| s.load(Ordering::Relaxed))
            .collect();
        let name = format!(
            "{}{}, {state} moments",
            policy.name(),
            if delayed_update { ", delayed" } else { "" }
        );
        println!("{name}: {counted} allocations in {COUNTED} steps of {ops} operations");
        // The report's records: one vector of one record per operation.
        let records = reports[0].records.capacity() * size_of_val(&reports[0].records[0]);
        assert_eq!(
            counted, COUNTED,
            "{name}: {counted} allocations in {COUNTED} steps, where each step's only one is \
             its report's records ({records} bytes); the first sizes: {sizes:?}"
        );
        assert!(
            sizes.iter().all(|&s| s == records),
            "{name}: an allocation other than the report's records ({records} bytes): {sizes:?}"
        );
    }
}
