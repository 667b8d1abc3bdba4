//! The order of a step's micro-batches (`StepShape::schedule`), on the CPU device:
//! - vertical (every micro-batch through a block before the next block) trains bit for
//!   bit as horizontal (each micro-batch through the whole model in turn) under every
//!   built-in policy and prefetch depth, every chaos seed, with and without clipping,
//!   spilled gradients, recomputing or offloaded activations, bf16 and the delayed
//!   update;
//! - it reads each streamed block from NVMe once per pass whatever the accumulation, as
//!   the tier counts it, where horizontal reads it per micro-batch;
//! - auto takes vertical where it fits the budgets and is predicted faster, horizontal
//!   where vertical's live checkpoints do not fit, vertical where horizontal's partial
//!   gradient sums do not, and horizontal with one micro-batch; an order asked for that
//!   does not fit is refused naming the other where that fits.

mod model_support;

use model_support::training::{Run, adamw_clipped, assert_same, small_gpt2, train, train_plan};
use model_support::{CHAOS, NvmeOnly, UNLIMITED, all_policies};
use strata_engine::exec::StepParams;
use strata_engine::model::Model;
use strata_engine::plan::{
    AllOnDevice, Budgets, CostModel, GradSpill, NvmeOffload, Plan, PlanInput, Policy, Precision,
    Recompute, Schedule, StepShape, Tier,
};

/// The steps compared: (what, shape, step parameters). Each recomputes differently, so
/// that vertical's checkpoints, saved and offloaded activations are all exercised.
fn cases() -> Vec<(&'static str, StepShape, StepParams)> {
    let base = StepShape {
        grad_accum: 3,
        ..StepShape::cpu(2, 8)
    };
    vec![
        ("plain, activations kept", base, adamw_clipped(0.0)),
        (
            "clipped, recomputing",
            base.clipped().recomputing(Recompute::All),
            adamw_clipped(0.05),
        ),
        (
            "clipped bf16, gradients spilled, activations offloaded",
            StepShape {
                precision: Precision::Bf16,
                ..base
            }
            .clipped()
            .spilling(GradSpill::Always)
            .recomputing(Recompute::Offload),
            adamw_clipped(0.05),
        ),
        ("delayed update", base.delayed(), adamw_clipped(0.0)),
    ]
}

#[test]
fn vertical_trains_bit_identically_to_horizontal_under_every_policy() {
    let model = small_gpt2();
    for (what, shape, params) in cases() {
        let horizontal = shape.scheduled(Schedule::Horizontal);
        let reference = train(&model, horizontal, &AllOnDevice, 3, params, None);
        assert!(
            reference.losses[2] < reference.losses[0],
            "{what}: {:?}",
            reference.losses
        );
        for policy in all_policies() {
            let vertical = shape.scheduled(Schedule::Vertical);
            let plan = plan(&model, vertical, policy.as_ref(), UNLIMITED);
            assert_eq!(plan.shape.schedule, Schedule::Vertical);
            for chaos in CHAOS {
                let run = train_plan(&model, plan.clone(), 3, params, chaos);
                let case = format!("{what}, {}, chaos {chaos:?}", policy.name());
                assert_same(&reference, &run, &case);
                assert!(
                    (0..3).all(|t| run.measured[t] <= plan.peak[t]),
                    "{case}: measured {:?} over the plan's {:?}",
                    run.measured,
                    plan.peak
                );
            }
        }
    }
}

fn plan(model: &Model, shape: StepShape, policy: &dyn Policy, budgets: Budgets) -> Plan {
    let input = PlanInput::new(model, shape, budgets);
    Plan::build(&input, policy).unwrap()
}

/// Every block's parameters and optimizer state on NVMe, checkpoints on the device: in
/// fp32 the backward's parameters come with the state read for the update.
fn nvme_only() -> NvmeOnly {
    NvmeOnly(NvmeOffload {
        depth: 2,
        checkpoints: Tier::Device,
    })
}

fn nvme_read(run: &Run) -> u64 {
    run.link_bytes.last().unwrap()[0]
}

#[test]
fn vertical_reads_each_streamed_block_once_per_pass() {
    let model = small_gpt2();
    let policy = nvme_only();
    let shape = |grad_accum: usize, schedule: Schedule| {
        StepShape {
            grad_accum,
            ..StepShape::cpu(2, 8)
        }
        .scheduled(schedule)
    };
    // One micro-batch: the two orders are one.
    let one = train(
        &model,
        shape(1, Schedule::Vertical),
        &policy,
        2,
        adamw_clipped(0.0),
        None,
    );
    let one_h = train(
        &model,
        shape(1, Schedule::Horizontal),
        &policy,
        2,
        adamw_clipped(0.0),
        None,
    );
    assert_eq!(nvme_read(&one), nvme_read(&one_h));
    let layers: u64 = model.blocks()[1..=model.layers()]
        .iter()
        .map(|b| b.len as u64)
        .sum();
    for k in [2, 4] {
        let vertical = train(
            &model,
            shape(k, Schedule::Vertical),
            &policy,
            2,
            adamw_clipped(0.0),
            None,
        );
        let horizontal = train(
            &model,
            shape(k, Schedule::Horizontal),
            &policy,
            2,
            adamw_clipped(0.0),
            None,
        );
        assert_same(&horizontal, &vertical, &format!("grad-accum {k}"));
        // Vertically, a step of k micro-batches reads what a step of one does.
        assert_eq!(nvme_read(&vertical), nvme_read(&one), "grad-accum {k}");
        // Horizontally, every layer's parameters again for each further micro-batch's
        // forward and backward (4 bytes each way; the last backward reads the state).
        let more = nvme_read(&horizontal) - nvme_read(&one);
        assert!(
            more >= 8 * (k as u64 - 1) * layers,
            "grad-accum {k}: horizontal reads {more} bytes more than one micro-batch"
        );
    }
}

/// Rates under which the step waits for NVMe: what vertical saves.
fn slow_nvme() -> CostModel {
    let d = CostModel::default();
    CostModel {
        nvme_read_bytes_per_s: 1e-3 * d.nvme_read_bytes_per_s,
        ..d
    }
}

#[test]
fn auto_takes_vertical_where_it_fits_and_is_predicted_faster() {
    let model = small_gpt2();
    let policy = nvme_only();
    // Recomputing every layer (the least device memory either order can take), with
    // activations larger than a block's parameters.
    let shape = StepShape {
        grad_accum: 4,
        ..StepShape::cpu(8, 32)
    }
    .recomputing(Recompute::All);
    let input = |schedule: Schedule, budgets: Budgets| {
        PlanInput::new(&model, shape.scheduled(schedule), budgets).with_cost(slow_nvme())
    };
    let build = |schedule: Schedule, budgets: Budgets| {
        Plan::build(&input(schedule, budgets), &policy).unwrap()
    };
    // Why the plan in `schedule` does not fit `budgets`.
    let refusal = |schedule: Schedule, budgets: Budgets| {
        build(schedule, budgets)
            .check_fits(&input(schedule, budgets))
            .unwrap_err()
            .to_string()
    };
    let vertical = build(Schedule::Vertical, UNLIMITED);
    let horizontal = build(Schedule::Horizontal, UNLIMITED);
    let cost = slow_nvme();
    assert!(
        cost.predict(&vertical).step_seconds < cost.predict(&horizontal).step_seconds,
        "vertical should be predicted faster when NVMe is slow"
    );
    assert_eq!(
        build(Schedule::Auto, UNLIMITED).shape.schedule,
        Schedule::Vertical
    );
    // Every micro-batch's checkpoints live at once: more device memory than horizontal
    // takes at its least.
    let device = Tier::Device.index();
    assert!(
        vertical.peak[device] > horizontal.peak[device],
        "vertical device peak {} vs horizontal {}",
        vertical.peak[device],
        horizontal.peak[device]
    );
    // A device budget that holds horizontal's peak but not vertical's.
    let tight = Budgets {
        device: horizontal.peak[device],
        ..UNLIMITED
    };
    let chosen = build(Schedule::Auto, tight);
    assert_eq!(chosen.shape.schedule, Schedule::Horizontal);
    assert!(chosen.first_overflow().is_none());
    // Vertical asked for under that budget is refused, naming the order that fits.
    let refused = refusal(Schedule::Vertical, tight);
    assert!(refused.contains("--schedule horizontal"), "{refused}");
    // Horizontally every block's partial sums wait in host memory from the first
    // micro-batch's backward to the last one's; vertically one block's at a time. A host
    // budget that holds vertical's peak but not horizontal's: auto takes vertical, and
    // horizontal asked for is refused, naming vertical.
    let host = Tier::Host.index();
    assert!(
        vertical.peak[host] < horizontal.peak[host],
        "vertical host peak {} vs horizontal {}",
        vertical.peak[host],
        horizontal.peak[host]
    );
    let narrow = Budgets {
        host: vertical.peak[host],
        ..UNLIMITED
    };
    assert_eq!(
        build(Schedule::Auto, narrow).shape.schedule,
        Schedule::Vertical
    );
    let refused = refusal(Schedule::Horizontal, narrow);
    assert!(refused.contains("--schedule vertical"), "{refused}");
    // One micro-batch: horizontal.
    let input = PlanInput::new(&model, StepShape::cpu(8, 32), UNLIMITED).with_cost(slow_nvme());
    let single = Plan::build(&input, &policy).unwrap();
    assert_eq!(single.shape.schedule, Schedule::Horizontal);
}
