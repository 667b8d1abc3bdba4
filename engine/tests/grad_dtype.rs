//! Gradients kept in bf16 once complete (`StepShape::grad_dtype`, `GradDtype::Bf16`), on
//! the CPU device, training in bf16:
//! - every block's gradients are rounded once, after the last write to their sum and
//!   before anything reads them (statistics, the norm, the update, the spill), in every
//!   policy's plan, and not at all with fp32 gradients;
//! - steps train bit for bit alike under every policy and depth, every chaos seed, plain,
//!   clipped with gradients spilled to NVMe or held in host memory, with 2 micro-batches
//!   in each order, and with the delayed update;
//! - they train differently from fp32 gradients, and spilled gradients cost 2 bytes per
//!   parameter each way on NVMe instead of 4, as the store counted them;
//! - refused, with the fix named, where the step does not train in bf16 or has ranks.

mod model_support;

use model_support::training::{Run, adamw_clipped, assert_same, small_gpt2, train, train_plan};
use model_support::{CHAOS, NvmeOnly, UNLIMITED, all_policies};
use strata_engine::model::Model;
use strata_engine::plan::{
    Access, AllOnDevice, BufId, GradDtype, GradSpill, HostOp, NvmeOffload, OpId, OpKind, Plan,
    PlanError, PlanInput, Policy, Precision, Schedule, StepShape, StreamOp, Tier,
};
use strata_storage::DIRECT_IO_ALIGN;

fn plan(model: &Model, shape: StepShape, policy: &dyn Policy) -> Result<Plan, PlanError> {
    Plan::build(&PlanInput::new(model, shape, UNLIMITED), policy)
}

/// A step of 2 × 8 tokens in bf16 with bf16 gradients.
fn bf16_step() -> StepShape {
    StepShape {
        precision: Precision::Bf16,
        ..StepShape::cpu(2, 8)
    }
    .with_grad_dtype(GradDtype::Bf16)
}

/// The steps compared: (what, shape, clipping).
fn cases() -> Vec<(&'static str, StepShape, f64)> {
    let base = bf16_step();
    let two = |schedule| {
        StepShape {
            grad_accum: 2,
            ..base
        }
        .clipped()
        .spilling(GradSpill::Always)
        .scheduled(schedule)
    };
    vec![
        ("plain", base, 0.0),
        (
            "clipped, gradients spilled",
            base.clipped().spilling(GradSpill::Always),
            0.05,
        ),
        (
            "clipped, gradients held",
            base.clipped().spilling(GradSpill::Never),
            0.05,
        ),
        (
            "2 micro-batches horizontally, spilled",
            two(Schedule::Horizontal),
            0.05,
        ),
        (
            "2 micro-batches vertically, spilled",
            two(Schedule::Vertical),
            0.05,
        ),
        ("delayed update", base.delayed(), 0.0),
    ]
}

/// The block an operation reads or writes the complete gradients of, if it does.
fn gradient_op(kind: &OpKind) -> Option<(usize, &'static str)> {
    match *kind {
        OpKind::Stream(StreamOp::RoundGrads { block, .. })
        | OpKind::Host(HostOp::RoundGrads { block, .. }) => Some((block, "round")),
        OpKind::Stream(StreamOp::DeviceStats { block, .. })
        | OpKind::Stream(StreamOp::DeviceUpdate { block, .. })
        | OpKind::Host(HostOp::Stats { block, .. })
        | OpKind::Host(HostOp::Optimizer { block, .. }) => Some((block, "read")),
        _ => None,
    }
}

/// The gradients rounding operation `id` rounds.
fn round_buffer(plan: &Plan, id: OpId) -> BufId {
    match plan.op(id).kind {
        OpKind::Stream(StreamOp::RoundGrads { grads, .. })
        | OpKind::Host(HostOp::RoundGrads { grads, .. }) => grads,
        _ => unreachable!("not a rounding"),
    }
}

/// Whether `to` waits for `from`, directly or through other operations.
fn waits_for(plan: &Plan, to: OpId, from: OpId) -> bool {
    let mut stack = vec![to];
    let mut seen = vec![false; plan.ops.len()];
    while let Some(id) = stack.pop() {
        if id == from {
            return true;
        }
        for &d in &plan.op(id).deps {
            if !std::mem::replace(&mut seen[d.index()], true) {
                stack.push(d);
            }
        }
    }
    false
}

#[test]
fn each_blocks_gradients_are_rounded_once_before_anything_reads_them() {
    let model = small_gpt2();
    let nb = model.blocks().len();
    for (what, shape, _) in cases() {
        for policy in all_policies() {
            let case = format!("{what}, {}", policy.name());
            let plan = plan(&model, shape, policy.as_ref()).unwrap();
            let ids: Vec<OpId> = (0..plan.ops.len()).map(OpId::of).collect();
            let ops = |b: usize, role: &str| -> Vec<OpId> {
                ids.iter()
                    .copied()
                    .filter(|&id| gradient_op(&plan.op(id).kind) == Some((b, role)))
                    .collect::<Vec<_>>()
            };
            for b in 0..nb {
                let rounds = ops(b, "round");
                assert_eq!(rounds.len(), 1, "{case}: block {b} is rounded {rounds:?}");
                let round = rounds[0];
                // After the last write to its gradients: the last backward of the block
                // (and of the head, whose backward writes the tied embedding's).
                let last_backward = ids
                    .iter()
                    .copied()
                    .filter(|&id| match plan.op(id).kind {
                        OpKind::Stream(StreamOp::Compute { block, pass, .. }) => {
                            !pass.is_forward() && (block == b || (b == 0 && block == nb - 1))
                        }
                        _ => false,
                    })
                    .max()
                    .unwrap();
                assert!(
                    waits_for(&plan, round, last_backward),
                    "{case}: block {b}'s rounding does not wait for its last backward"
                );
                let readers = ops(b, "read");
                assert!(!readers.is_empty(), "{case}: block {b}: nothing reads");
                for r in readers {
                    // With the delayed update, the update and its statistics read the
                    // other set: the step before's, rounded in that step.
                    let rounded = round_buffer(&plan, round);
                    let reads = plan.op(r).access.contains(&Access::Read(rounded));
                    assert!(
                        waits_for(&plan, r, round) || (shape.delayed_update && !reads),
                        "{case}: block {b}: {} reads before the rounding",
                        plan.op(r).kind.label()
                    );
                }
            }
            // The norm reads every block's, rounded.
            for id in ids.iter().copied() {
                if matches!(plan.op(id).kind, OpKind::Host(HostOp::GradNorm { .. })) {
                    for b in 0..nb {
                        let round = ops(b, "round")[0];
                        assert!(waits_for(&plan, id, round), "{case}: norm before {b}");
                    }
                }
            }
            let fp32 = plan_fp32(&model, shape, policy.as_ref());
            assert!(
                (0..nb).all(|b| fp32
                    .ops
                    .iter()
                    .all(|op| gradient_op(&op.kind) != Some((b, "round")))),
                "{case}: fp32 gradients are rounded"
            );
        }
    }
}

fn plan_fp32(model: &Model, shape: StepShape, policy: &dyn Policy) -> Plan {
    plan(model, shape.with_grad_dtype(GradDtype::Fp32), policy).unwrap()
}

#[test]
fn bf16_gradients_train_bit_identically_under_every_policy() {
    let model = small_gpt2();
    for (what, shape, clip) in cases() {
        let params = adamw_clipped(clip);
        let reference = train(&model, shape, &AllOnDevice, 3, params, None);
        let mut spilled = 0;
        for policy in all_policies() {
            let plan = plan(&model, shape, policy.as_ref()).unwrap();
            spilled += usize::from(plan.spilled() > 0);
            for chaos in CHAOS {
                let run = train_plan(&model, plan.clone(), 3, params, chaos);
                let case = format!("{what}, {}, chaos {chaos:?}", policy.name());
                assert_same(&reference, &run, &case);
            }
        }
        if shape.grad_spill == GradSpill::Always {
            assert!(spilled >= 8, "{what}: {spilled} plans spill");
        }
    }
}

/// bf16 and fp32 gradients under one policy, clipped, every block's gradients spilled.
fn spilled_pair(model: &Model) -> (Run, Run) {
    let policy = NvmeOnly(NvmeOffload {
        depth: 2,
        checkpoints: Tier::Nvme,
    });
    let shape = bf16_step().clipped().spilling(GradSpill::Always);
    let run = |shape: StepShape| {
        let plan = plan(model, shape, &policy).unwrap();
        assert!(plan.spilled() == model.blocks().len(), "every block spills");
        train_plan(model, plan, 3, adamw_clipped(0.05), None)
    };
    (run(shape.with_grad_dtype(GradDtype::Fp32)), run(shape))
}

#[test]
fn bf16_gradients_train_otherwise_than_fp32_and_halve_the_spills_bytes() {
    let model = small_gpt2();
    let (fp32, bf16) = spilled_pair(&model);
    assert_eq!(
        fp32.losses[0], bf16.losses[0],
        "the first loss is before any update"
    );
    assert_ne!(
        fp32.losses[2], bf16.losses[2],
        "the updates used the same gradients"
    );
    // Each block's spill: written once and read once per step, 2 bytes per parameter
    // fewer each way, counted by the NVMe lanes. The store moves whole extents, each
    // rounded up to the O_DIRECT granule.
    let whole = |bytes: u64| bytes.next_multiple_of(DIRECT_IO_ALIGN as u64);
    let saved: u64 = model
        .blocks()
        .iter()
        .map(|b| whole(4 * b.len as u64) - whole(2 * b.len as u64))
        .sum();
    let params: u64 = model.blocks().iter().map(|b| b.len as u64).sum();
    assert!(
        saved >= 2 * params - 4096,
        "{saved} for {params} parameters"
    );
    for step in 0..3 {
        for (lane, i) in [("read", 0), ("write", 1)] {
            assert_eq!(
                fp32.link_bytes[step][i] - bf16.link_bytes[step][i],
                saved,
                "step {step}: NVMe {lane}, for {params} parameters"
            );
        }
    }
}

#[test]
fn bf16_gradients_are_refused_outside_bf16_training_alone() {
    let model = small_gpt2();
    let fp32 = StepShape::cpu(2, 8).with_grad_dtype(GradDtype::Bf16);
    let err = plan(&model, fp32, &AllOnDevice).unwrap_err().to_string();
    assert!(
        err.contains("--dtype bf16") && err.contains("--grad-dtype fp32"),
        "{err}"
    );
    let ranks = bf16_step().with_ranks(2);
    let err = plan(&model, ranks, &AllOnDevice).unwrap_err().to_string();
    assert!(
        err.contains("one process") && err.contains("--grad-dtype fp32"),
        "{err}"
    );
}
