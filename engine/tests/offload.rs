//! The offload engine's invariants (DESIGN.md section 4), on the CPU device:
//! 1. parameters are bit-identical after 5 steps whatever the policy and prefetch depth,
//!    and whichever blocks recompute their forward in the backward;
//! 2. measured peak per tier <= plan <= budget, and a plan over budget is refused;
//! 4. a failure during a step (an NVMe fault, an operation's error, a lane's panic) is an
//!    error from the step, with every block wholly as before it or wholly updated, its
//!    step counter saying which, and a retry applying no update twice.
//!
//! Invariant 3 (no allocation after the first step) is in `offload_alloc.rs`, alone in
//! its process so that other tests' allocations do not count.

mod model_support;

use model_support::{
    CHAOS, NvmeOnly, UNLIMITED, all_policies, each_policy, golden_dir, read_f32_tensors, rel_err,
    token_ids,
};
use strata_engine::exec::Runner;
use strata_engine::exec::{ExecConfig, ExecError, Executor, Fault, StepParams, StepReport};
use strata_engine::kernels::adamw::AdamW;
use strata_engine::model::data::{Batch, TokenData};
use strata_engine::model::llama::{LlamaConfig, Variant};
use strata_engine::model::weights::load_pretrained;
use strata_engine::model::{Gpt2Config, Llama, Model, Target, gpt2};
use strata_engine::plan::{
    AllOnDevice, Auto, Budgets, CostModel, CpuOffload, GradSpill, HostOp, Lane, NvmeOffload,
    NvmeOp, OpId, OpKind, ParamOffload, Plan, PlanError, PlanInput, Policy, Precision, Recompute,
    Schedule, StepShape, StreamOp, Tier,
};
use strata_engine::storage::FaultPlan;

/// Deterministic token batches for `steps` steps of `micro` micro-batches.
fn batches(
    vocab: usize,
    n: usize,
    steps: usize,
    micro: usize,
    seed: u64,
) -> Vec<Vec<(Vec<u32>, Vec<u32>)>> {
    let mut next = token_ids(vocab, seed);
    (0..steps)
        .map(|_| {
            (0..micro)
                .map(|_| {
                    let t: Vec<u32> = (0..n).map(|_| next()).collect();
                    let y: Vec<u32> = (0..n).map(|_| next()).collect();
                    (t, y)
                })
                .collect()
        })
        .collect()
}

fn hyper(lr: f64) -> StepParams {
    StepParams {
        adam: AdamW {
            lr,
            weight_decay: 0.1,
            ..AdamW::default()
        },
        clip: 0.0,
        loss_scale: 1.0,
    }
}

/// Clipping at a global norm of 0.05, with loss scaling in fp16.
fn clipped(precision: Precision) -> StepParams {
    StepParams {
        clip: 0.05,
        loss_scale: if precision == Precision::Fp16 {
            1024.0
        } else {
            1.0
        },
        ..hyper(1e-3)
    }
}

struct Run {
    params: Vec<Vec<f32>>,
    m: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    losses: Vec<f32>,
    /// The executor's measured peak per tier.
    measured: [u64; 3],
}

fn train(
    model: &Model,
    shape: StepShape,
    policy: &dyn Policy,
    steps: usize,
    step_params: StepParams,
) -> Run {
    train_with(model, shape, policy, steps, step_params, None)
}

fn train_with(
    model: &Model,
    shape: StepShape,
    policy: &dyn Policy,
    steps: usize,
    step_params: StepParams,
    chaos: Option<u64>,
) -> Run {
    let input = PlanInput {
        model,
        shape,
        budgets: UNLIMITED,
        cost: Default::default(),
    };
    let plan = Plan::build(&input, policy).unwrap();
    train_plan(model, plan, steps, step_params, chaos)
}

/// `steps` steps of `plan` from the parameters `model.init_params(7)`, on one batch.
fn train_plan(
    model: &Model,
    plan: Plan,
    steps: usize,
    step_params: StepParams,
    chaos: Option<u64>,
) -> Run {
    let nvme = tempfile::tempdir().unwrap();
    let config = ExecConfig {
        nvme_dirs: vec![nvme.path().to_path_buf()],
        chaos,
        ..ExecConfig::default()
    };
    train_configured(model, plan, steps, step_params, &config).0
}

/// As [`train_plan`], with the executor set up by `config`; also returns each step's
/// report.
fn train_configured(
    model: &Model,
    plan: Plan,
    steps: usize,
    step_params: StepParams,
    config: &ExecConfig,
) -> (Run, Vec<StepReport>) {
    train_loaded(model, plan, steps, step_params, config, false)
}

/// As [`train_configured`]; `by_block`: the executor makes the initial parameters a
/// block at a time as it loads them (`load_blocks`), not from the whole model's.
fn train_loaded(
    model: &Model,
    plan: Plan,
    steps: usize,
    step_params: StepParams,
    config: &ExecConfig,
    by_block: bool,
) -> (Run, Vec<StepReport>) {
    let shape = plan.shape;
    let mut exec = Executor::on_cpu(model.clone(), plan, config).unwrap();
    if by_block {
        exec.load_blocks(&|b| Ok(model.init_block(b, 7))).unwrap();
    } else {
        exec.load(&model.init_params(7), None).unwrap();
    }
    // One batch, seen every step: the loss must fall.
    let data = vec![
        batches(
            model.vocab(),
            shape.batch * shape.seq,
            1,
            shape.grad_accum,
            11
        )
        .remove(0);
        steps
    ];
    let mut losses = Vec::new();
    let mut reports = Vec::new();
    for step in &data {
        let refs: Vec<(&[u32], &[u32])> = step.iter().map(|(t, y)| (&t[..], &y[..])).collect();
        let report = exec.step(&refs, &step_params).unwrap();
        losses.push(report.loss);
        reports.push(report);
    }
    // A delayed update's last gradients are applied at the end.
    let flushed = exec.flush(&step_params).unwrap();
    assert_eq!(flushed.is_some(), shape.delayed_update);
    assert_eq!(exec.steps(), steps as u64, "every step's update applied");
    let (params, m, v) = exec.export().unwrap();
    let run = Run {
        params,
        m,
        v,
        losses,
        measured: exec.peak_measured(),
    };
    (run, reports)
}

fn assert_bit_identical(reference: &Run, other: &Run, what: &str) {
    assert_eq!(reference.losses, other.losses, "{what}: losses differ");
    for (b, (x, y)) in reference.params.iter().zip(&other.params).enumerate() {
        let same = x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "{what}: parameters of block {b} differ from all-on-device"
        );
    }
    for (x, y) in reference
        .m
        .iter()
        .zip(&other.m)
        .chain(reference.v.iter().zip(&other.v))
    {
        assert!(
            x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}: optimizer state differs"
        );
    }
}

fn small() -> Gpt2Config {
    Gpt2Config::new(3, 4, 64, 96, 32)
}

/// The plan types each operation by the lanes that run it, so that each lane's dispatch
/// is exhaustive over its own family: every operation is on a lane its kind runs on
/// (stream work on its stream, NVMe transfers on an NVMe lane, commits on the write lane,
/// host arithmetic on the CPU lane, collectives on the collective lane), in every shape
/// of step and every policy.
#[test]
fn every_operation_is_on_a_lane_its_kind_runs_on() {
    let model = Model::new(small()).unwrap();
    let base = StepShape::cpu(2, 16);
    let shapes = [
        base,
        base.clipped().delayed(),
        base.clipped().spilling(GradSpill::Always),
        StepShape {
            grad_accum: 2,
            ..base
        },
        base.with_ranks(2),
        base.with_ranks(2)
            .with_device_collectives(false)
            .on(Target::Cuda),
    ];
    for shape in shapes {
        for policy in model_support::all_policies() {
            let input = PlanInput {
                model: &model,
                shape,
                budgets: UNLIMITED,
                cost: Default::default(),
            };
            let plan = Plan::build(&input, policy.as_ref()).unwrap();
            for (lane, ids) in Lane::ALL.iter().zip(&plan.lanes) {
                for &id in ids {
                    let op = plan.op(id);
                    assert_eq!(op.lane, *lane);
                    assert!(
                        op.kind.runs_on(op.lane),
                        "{}: {} on the {} lane",
                        policy.name(),
                        op.kind.label(),
                        op.lane
                    );
                }
            }
        }
    }
}

#[test]
fn every_policy_and_depth_trains_bit_identically() {
    for (config, batch, seq) in [(Gpt2Config::tiny(), 2, 16), (small(), 2, 32)] {
        let model = Model::new(config).unwrap();
        let shape = StepShape::cpu(batch, seq);
        let reference = train(&model, shape, &AllOnDevice, 5, hyper(1e-3));
        assert!(
            reference.losses[4] < reference.losses[0],
            "the loss should fall over 5 steps: {:?}",
            reference.losses
        );
        for policy in all_policies() {
            for chaos in CHAOS {
                let run = train_with(&model, shape, policy.as_ref(), 5, hyper(1e-3), chaos);
                let what = format!("{config:?} {} chaos {chaos:?}", policy.name());
                assert_bit_identical(&reference, &run, &what);
            }
        }
    }
}

#[test]
fn loading_a_block_at_a_time_trains_the_same_bits() {
    let mut qwen3 = LlamaConfig::llama(3, 48, 80, 4, 2, 96, 32);
    qwen3.variant = Variant::Qwen3;
    qwen3.qk_norm = true;
    for model in [
        Model::new(small()).unwrap(),
        Model::of(Llama::new(qwen3).unwrap()),
    ] {
        let shape = StepShape::cpu(2, 16);
        let policy = NvmeOffload {
            depth: 2,
            checkpoints: Tier::Host,
        };
        let plan = Plan::build(
            &PlanInput {
                model: &model,
                shape,
                budgets: UNLIMITED,
                cost: Default::default(),
            },
            &policy,
        )
        .unwrap();
        let nvme = tempfile::tempdir().unwrap();
        let config = ExecConfig {
            nvme_dirs: vec![nvme.path().to_path_buf()],
            ..ExecConfig::default()
        };
        let whole = train_loaded(&model, plan.clone(), 3, hyper(1e-3), &config, false).0;
        let blocks = train_loaded(&model, plan.clone(), 3, hyper(1e-3), &config, true).0;
        assert_bit_identical(&whole, &blocks, &model.describe());

        // A made block of the wrong size is refused, naming it.
        let mut exec = Executor::on_cpu(model.clone(), plan, &config).unwrap();
        let err = exec
            .load_blocks(&|b| Ok(vec![0.0; model.blocks()[b].len + usize::from(b == 1)]))
            .unwrap_err();
        assert!(err.to_string().contains("block 1's parameters"), "{err}");
    }
}

/// Pairs of one NVMe lane's transfers that were in flight at once, over `reports`.
fn overlapping_transfers(reports: &[StepReport]) -> usize {
    let mut pairs = 0;
    for report in reports {
        for lane in [Lane::NvmeRead, Lane::NvmeWrite] {
            let mut spans: Vec<(u64, u64)> = report
                .records
                .iter()
                .filter(|r| r.lane == lane)
                .map(|r| (r.start_ns, r.end_ns))
                .collect();
            spans.sort_unstable();
            pairs += spans.windows(2).filter(|w| w[1].0 < w[0].1).count();
        }
        let busy = report.lane_busy[Lane::NvmeRead.index()];
        assert!(
            busy <= report.seconds,
            "busy {busy} s in a {} s step",
            report.seconds
        );
    }
    pairs
}

#[test]
fn nvme_lanes_keep_transfers_in_flight_and_train_the_same_bits() {
    // Every block on NVMe and a deep prefetch: at a step's start several reads are
    // ready at once. One transfer at a time is the reference.
    let model = Model::new(small()).unwrap();
    let shape = StepShape::cpu(2, 16);
    let input = PlanInput {
        model: &model,
        shape,
        budgets: UNLIMITED,
        cost: Default::default(),
    };
    let policy = NvmeOnly(NvmeOffload {
        depth: 4,
        checkpoints: Tier::Nvme,
    });
    let plan = Plan::build(&input, &policy).unwrap();
    let nvme = tempfile::tempdir().unwrap();
    let run = |in_flight: usize, chaos: Option<u64>| {
        let config = ExecConfig {
            nvme_dirs: vec![nvme.path().to_path_buf()],
            nvme_in_flight: in_flight,
            chaos,
            ..ExecConfig::default()
        };
        train_configured(&model, plan.clone(), 4, hyper(1e-3), &config)
    };
    let (reference, reports) = run(1, None);
    assert_eq!(overlapping_transfers(&reports), 0, "one at a time");
    let runs = [2, 3].map(|n| (n, None)).into_iter();
    for (in_flight, chaos) in runs.chain(CHAOS[1..].iter().map(|&c| (2, c))) {
        let (other, reports) = run(in_flight, chaos);
        assert_bit_identical(&reference, &other, &format!("{in_flight} in flight"));
        if chaos.is_none() {
            assert!(
                overlapping_transfers(&reports) > 0,
                "{in_flight} in flight: no two transfers of a lane overlapped"
            );
        }
    }
}

#[test]
fn accumulation_clipping_and_bf16_are_policy_independent() {
    let model = Model::new(small()).unwrap();
    for precision in [Precision::Fp32, Precision::Bf16, Precision::Fp16] {
        let shape = StepShape {
            grad_accum: 2,
            precision,
            needs_global_norm: true,
            ..StepShape::cpu(2, 16)
        };
        let params = clipped(precision);
        let reference = train(&model, shape, &AllOnDevice, 4, params);
        for policy in [
            Box::new(CpuOffload) as Box<dyn Policy>,
            Box::new(ParamOffload {
                depth: 3,
                checkpoints: Tier::Host,
            }),
            Box::new(NvmeOffload {
                depth: 2,
                checkpoints: Tier::Nvme,
            }),
        ] {
            for chaos in CHAOS {
                let run = train_with(&model, shape, policy.as_ref(), 4, params, chaos);
                let what = format!("{precision} {} chaos {chaos:?}", policy.name());
                assert_bit_identical(&reference, &run, &what);
            }
        }
    }
}

/// Gradients that wait for the clipping norm on NVMe ([`GradSpill`]) give the same bits
/// as gradients held in host memory, with less host memory and 8 bytes per parameter
/// more NVMe traffic; auto spills exactly when the host budget needs it.
#[test]
fn gradients_spilled_for_the_norm_train_bit_identically_in_less_host_memory() {
    let model = Model::new(small()).unwrap();
    let params_total: u64 = model.blocks().iter().map(|b| b.len as u64).sum();
    // In each order of the micro-batches, the same traffic and the same bits.
    for (precision, grad_accum, depth, schedule) in [
        (Precision::Fp32, 1, 2, Schedule::Horizontal),
        (Precision::Fp32, 3, 2, Schedule::Horizontal),
        (Precision::Fp32, 3, 2, Schedule::Vertical),
        (Precision::Bf16, 2, 1, Schedule::Vertical),
        (Precision::Fp16, 2, 3, Schedule::Horizontal),
    ] {
        let shape = StepShape {
            grad_accum,
            precision,
            // The host budgets below are set from these plans' peaks, as in
            // `recompute_plans`.
            ..StepShape::cpu(2, 16)
                .clipped()
                .scheduled(schedule)
                .prefetching_next_step(false)
        };
        let params = clipped(precision);
        // Every block's state on NVMe, so that every block can spill.
        let policy = NvmeOnly(NvmeOffload {
            depth,
            checkpoints: Tier::Host,
        });
        let plan = |spill: GradSpill, host: u64| {
            let input = PlanInput {
                model: &model,
                shape: shape.spilling(spill),
                budgets: Budgets { host, ..UNLIMITED },
                cost: Default::default(),
            };
            Plan::build(&input, &policy).unwrap()
        };
        let held = plan(GradSpill::Never, u64::MAX);
        let spilled = plan(GradSpill::Always, u64::MAX);
        let what = format!("{precision}, grad-accum {grad_accum} ({schedule}), depth {depth}");
        assert_eq!(held.spilled(), 0, "{what}");
        assert_eq!(spilled.spilled(), model.blocks().len(), "{what}");
        let host = Tier::Host.index();
        assert!(
            spilled.peak[host] < held.peak[host],
            "{what}: spilling holds {} bytes of host, holding {}",
            spilled.peak[host],
            held.peak[host]
        );
        // Each micro-batch's sum written once and read back once (the last for the
        // update): 4 bytes per parameter each way, per micro-batch; vertically, where a
        // block's backwards follow one another, the sum waits in host memory between
        // them and only the step's is written and read.
        let sums = match schedule {
            Schedule::Vertical => 1,
            _ => grad_accum as u64,
        };
        let traffic = 4 * params_total * sums;
        assert_eq!(
            spilled.link_bytes[0] - held.link_bytes[0],
            traffic,
            "{what}"
        );
        assert_eq!(
            spilled.link_bytes[1] - held.link_bytes[1],
            traffic,
            "{what}"
        );
        // Auto: held while the host budget allows it, spilled when it does not.
        assert_eq!(
            plan(GradSpill::Auto, held.peak[host]).spilled(),
            0,
            "{what}"
        );
        assert_eq!(
            plan(GradSpill::Auto, held.peak[host] - 1).spilled(),
            model.blocks().len(),
            "{what}"
        );
        let reference = train_plan(&model, held, 4, params, None);
        assert!(
            reference.losses[3] < reference.losses[0],
            "{what}: {:?}",
            reference.losses
        );
        for chaos in CHAOS {
            let run = train_plan(&model, spilled.clone(), 4, params, chaos);
            assert_bit_identical(
                &reference,
                &run,
                &format!("{what}, spilled, chaos {chaos:?}"),
            );
            assert!(
                run.measured[host] <= spilled.peak[host],
                "{what}: measured host {} over the plan's {}",
                run.measured[host],
                spilled.peak[host]
            );
        }
    }
}

/// nvme-offload keeps the embedding's and the head's optimizer state in host memory, and
/// their parameters off NVMe, when the budgets have room (`Policy::resident_edges`),
/// and streams them from NVMe like the other blocks when they do not; the bits are the
/// same. On the CPU device their parameters live on the device, updated in place by
/// the optimizer; for a GPU in host memory, the embedding's device copy serving the
/// tied head too (one copy to the device per step, not two).
#[test]
fn nvme_offload_keeps_the_edges_in_host_memory_only_when_they_fit() {
    let model = Model::new(small()).unwrap();
    let shape = StepShape::cpu(2, 16);
    let policy = NvmeOffload {
        depth: 2,
        checkpoints: Tier::Host,
    };
    let plan_for = |shape: StepShape, host: u64| {
        let input = PlanInput {
            model: &model,
            shape,
            budgets: Budgets { host, ..UNLIMITED },
            cost: Default::default(),
        };
        Plan::build(&input, &policy).unwrap()
    };
    let roomy = plan_for(shape, u64::MAX);
    assert!(roomy.edges_on_host());
    let nb = model.blocks().len();
    let edge = |b: usize| b == 0 || b + 1 == nb;
    let copies_of_first = |p: &Plan| {
        p.ops
            .iter()
            .filter(|op| {
                matches!(op.kind, OpKind::Stream(StreamOp::H2d { to, .. }) if p.buffer(to).name.starts_with("params[0]"))
            })
            .count()
    };
    for b in 0..nb {
        let (params, state) = if edge(b) {
            (Tier::Device, Tier::Host)
        } else {
            (Tier::Nvme, Tier::Nvme)
        };
        assert_eq!(roomy.homes[b][0], params, "block {b} parameters");
        assert_eq!(roomy.homes[b][2], state, "block {b} optimizer state");
    }
    // Updated in place: nothing copies the embedding to the device.
    assert_eq!(copies_of_first(&roomy), 0);
    let gpu = plan_for(
        StepShape {
            target: Target::Cuda,
            ..shape
        },
        u64::MAX,
    );
    assert!(gpu.edges_on_host());
    for b in (0..nb).filter(|&b| edge(b)) {
        assert_eq!(gpu.homes[b][0], Tier::Host, "a GPU's block {b} parameters");
    }
    assert_eq!(model.tied(nb - 1), Some(0));
    assert_eq!(copies_of_first(&gpu), 1);
    // Host memory one byte short of the GPU's plan: every block streams, in less host
    // memory.
    let host = Tier::Host.index();
    let tight = plan_for(gpu.shape, gpu.peak[host] - 1);
    assert!(!tight.edges_on_host());
    assert!(
        tight
            .homes
            .iter()
            .all(|h| h[0] == Tier::Nvme && h[2] == Tier::Nvme)
    );
    assert!(tight.peak[host] < gpu.peak[host]);
    // The edges' NVMe traffic is gone: their state read and written, their parameters
    // read for the forward and the backward.
    let edges: u64 = [0, nb - 1]
        .iter()
        .map(|&b| model.blocks()[b].len as u64)
        .sum();
    for p in [&gpu, &roomy] {
        assert!(tight.link_bytes[0] - p.link_bytes[0] >= 12 * edges);
        assert_eq!(tight.link_bytes[1] - p.link_bytes[1], 12 * edges);
    }
    let streaming = Plan::build(
        &PlanInput {
            model: &model,
            shape,
            budgets: UNLIMITED,
            cost: Default::default(),
        },
        &NvmeOnly(policy),
    )
    .unwrap();
    let reference = train(&model, shape, &AllOnDevice, 4, hyper(1e-3));
    for (what, p) in [("edges off NVMe", roomy), ("all on NVMe", streaming)] {
        let run = train_plan(&model, p, 4, hyper(1e-3), None);
        assert_bit_identical(&reference, &run, what);
    }
}

/// In fp32 without a norm barrier, the backward that completes a block's gradients
/// takes its parameters from the state read for the block's update (the master copy
/// heads the state), not from a second read: NVMe reads per step, as the tier counted
/// them, are every block's state once (12 bytes per parameter) and the forward's
/// parameter reads (4), nothing for the backward. The bits are all-on-device's.
#[test]
fn the_backward_takes_its_parameters_from_the_state_read_for_the_update() {
    let model = Model::new(small()).unwrap();
    let shape = StepShape::cpu(2, 16);
    let policy = NvmeOnly(NvmeOffload {
        depth: 2,
        checkpoints: Tier::Device,
    });
    let input = PlanInput {
        model: &model,
        shape,
        budgets: UNLIMITED,
        cost: Default::default(),
    };
    let plan = Plan::build(&input, &policy).unwrap();
    let nb = model.blocks().len();
    let len = |b: usize| model.blocks()[b].len as u64;
    // The forward reads the embedding and every layer, and the head reads the block it
    // is tied to; the head's own parameters come with its state (its forward and
    // backward are one program, the one that completes its gradients).
    let head = nb - 1;
    let reads: Vec<u64> = (0..nb)
        .map(|b| 12 * len(b))
        .chain((0..head).chain(model.tied(head)).map(|b| 4 * len(b)))
        .collect();
    assert_eq!(plan.link_bytes[0], reads.iter().sum::<u64>(), "planned");
    let nvme = tempfile::tempdir().unwrap();
    let config = ExecConfig {
        nvme_dirs: vec![nvme.path().to_path_buf()],
        ..ExecConfig::default()
    };
    let (run, reports) = train_configured(&model, plan, 3, hyper(1e-3), &config);
    // Each read moves whole 4 KiB blocks.
    let moved: u64 = reads.iter().map(|r| r.next_multiple_of(4096)).sum();
    for (i, report) in reports.iter().enumerate() {
        assert_eq!(report.link_bytes[0], moved, "step {i}, measured");
    }
    let reference = train(&model, shape, &AllOnDevice, 3, hyper(1e-3));
    assert_bit_identical(&reference, &run, "nvme-offload, parameters from the state");
}

/// On the CPU device, whose memory is host memory, the NVMe tier reads the streamed
/// parameters of the forward (and of the tied head) straight into the device buffers
/// the computes read: no host staging, no host-to-device copy. The only parameter
/// copies left are the backward's, from the state staged on the host for the update.
/// The CPU optimizer reads the gradients from device memory: no copy out. The device's
/// memory checker sees each read from NVMe as a write of its range and each optimizer's
/// as a read of the gradients; the bits are all-on-device's, also with every stream
/// operation delayed at random (chaos).
#[test]
fn on_the_cpu_device_nvme_and_the_optimizer_reach_device_memory_without_copies() {
    // Six layers: with a prefetch depth of 2, the read of a layer's parameters takes
    // over the device slot of a layer three before it, and so waits for that layer's
    // forward to end (the dependency chaos would expose if the read did not wait).
    let model = Model::new(Gpt2Config::new(6, 4, 64, 96, 32)).unwrap();
    let shape = StepShape::cpu(2, 16);
    let policy = NvmeOnly(NvmeOffload {
        depth: 2,
        checkpoints: Tier::Host,
    });
    let input = PlanInput {
        model: &model,
        shape,
        budgets: UNLIMITED,
        cost: Default::default(),
    };
    let plan = Plan::build(&input, &policy).unwrap();
    let head = model.blocks().len() - 1;
    let direct: Vec<&str> = plan
        .ops
        .iter()
        .filter_map(|op| match op.kind {
            OpKind::Nvme(NvmeOp::Read { into, .. }) if plan.buffer(into).tier == Tier::Device => {
                Some(plan.buffer(into).name.as_str())
            }
            _ => None,
        })
        .collect();
    // The forward's fetches of the embedding and every layer, and the head's of the
    // block it is tied to.
    assert_eq!(
        direct.len(),
        head + usize::from(model.tied(head).is_some()),
        "{direct:?}"
    );
    assert!(direct.iter().all(|name| name.starts_with("params[")));
    let copied: Vec<&str> = plan
        .ops
        .iter()
        .filter_map(|op| match op.kind {
            OpKind::Stream(StreamOp::H2d { from, to, .. })
                if plan.buffer(to).name.starts_with("params[") =>
            {
                Some(plan.buffer(from).name.as_str())
            }
            _ => None,
        })
        .collect();
    // Every block but the embedding, whose backward reads no parameters.
    assert_eq!(copied.len(), head, "{copied:?}");
    assert!(
        copied.iter().all(|name| name.starts_with("adam[")),
        "{copied:?}"
    );
    // The CPU optimizer reads each block's gradients where the backward wrote them: no
    // copy to the host (with no norm to wait for).
    for op in &plan.ops {
        match op.kind {
            OpKind::Host(HostOp::Optimizer { grads, .. }) => {
                assert_eq!(
                    plan.buffer(grads).tier,
                    Tier::Device,
                    "{}",
                    plan.buffer(grads).name
                )
            }
            OpKind::Stream(StreamOp::D2h { from, .. }) => assert!(
                !plan.buffer(from).name.starts_with("grads["),
                "{}",
                plan.buffer(from).name
            ),
            _ => {}
        }
    }
    let reference = train(&model, shape, &AllOnDevice, 3, hyper(1e-3));
    for chaos in CHAOS {
        let nvme = tempfile::tempdir().unwrap();
        let config = ExecConfig {
            nvme_dirs: vec![nvme.path().to_path_buf()],
            chaos,
            ..ExecConfig::default()
        };
        let (run, reports) = train_configured(&model, plan.clone(), 3, hyper(1e-3), &config);
        for (i, report) in reports.iter().enumerate() {
            // The device's copies, as it counted them (NVMe moves whole 4 KiB blocks).
            assert_eq!(
                report.link_bytes[2..],
                plan.link_bytes[2..],
                "chaos {chaos:?}, step {i}: bytes copied to and from the device, measured \
                 against planned"
            );
        }
        assert_bit_identical(&reference, &run, &format!("direct reads, chaos {chaos:?}"));
    }
}

/// `export_block` (what `strata train --out` writes from, a block at a time) gives each
/// block's master parameters as `export` does, whatever tier holds the state: the
/// device, the host, or NVMe (whose head it reads alone); a block past the model's is
/// refused.
#[test]
fn exporting_a_block_gives_the_whole_export_s_parameters() {
    let model = Model::new(small()).unwrap();
    let shape = StepShape::cpu(2, 16);
    for policy in each_policy() {
        let input = PlanInput {
            model: &model,
            shape,
            budgets: UNLIMITED,
            cost: Default::default(),
        };
        let plan = Plan::build(&input, policy.as_ref()).unwrap();
        let nvme = tempfile::tempdir().unwrap();
        let config = ExecConfig {
            nvme_dirs: vec![nvme.path().to_path_buf()],
            ..ExecConfig::default()
        };
        let mut exec = Executor::on_cpu(model.clone(), plan, &config).unwrap();
        exec.load(&model.init_params(7), None).unwrap();
        let data = batches(model.vocab(), shape.batch * shape.seq, 2, 1, 3);
        for step in &data {
            let refs: Vec<(&[u32], &[u32])> = step.iter().map(|(t, y)| (&t[..], &y[..])).collect();
            exec.step(&refs, &hyper(1e-3)).unwrap();
        }
        let (params, _, _) = exec.export().unwrap();
        for (b, whole) in params.iter().enumerate() {
            let block = exec.export_block(b).unwrap();
            assert!(
                block.len() == whole.len()
                    && block
                        .iter()
                        .zip(whole)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{}: block {b}",
                policy.name()
            );
        }
        assert!(
            exec.export_block(params.len()).is_err(),
            "{}",
            policy.name()
        );
    }
}

#[test]
fn a_delayed_update_is_one_step_stale_and_policy_independent() {
    let model = Model::new(small()).unwrap();
    let normal = train(&model, StepShape::cpu(2, 16), &AllOnDevice, 5, hyper(1e-3));
    let shapes = [
        StepShape::cpu(2, 16).delayed(),
        StepShape {
            grad_accum: 2,
            precision: Precision::Bf16,
            ..StepShape::cpu(2, 16).clipped().delayed()
        },
    ];
    for shape in shapes {
        let params = StepParams {
            clip: if shape.needs_global_norm { 0.05 } else { 0.0 },
            ..hyper(1e-3)
        };
        let reference = train(&model, shape, &AllOnDevice, 5, params);
        if !shape.needs_global_norm {
            // One batch every step: step 2 still sees the initial parameters, and step 3
            // the parameters after the first update, as the undelayed step 2 does.
            assert_eq!(reference.losses[1].to_bits(), reference.losses[0].to_bits());
            assert_eq!(reference.losses[2].to_bits(), normal.losses[1].to_bits());
            assert_ne!(reference.losses[3].to_bits(), normal.losses[2].to_bits());
        }
        for policy in [
            Box::new(CpuOffload) as Box<dyn Policy>,
            Box::new(ParamOffload {
                depth: 2,
                checkpoints: Tier::Host,
            }),
            Box::new(NvmeOffload {
                depth: 1,
                checkpoints: Tier::Host,
            }),
            Box::new(NvmeOffload {
                depth: 3,
                checkpoints: Tier::Nvme,
            }),
        ] {
            for chaos in CHAOS {
                let run = train_with(&model, shape, policy.as_ref(), 5, params, chaos);
                let what = format!("delayed {} chaos {chaos:?}", policy.name());
                assert_bit_identical(&reference, &run, &what);
            }
        }
    }
}

#[test]
fn one_step_equals_the_whole_model_pass_and_adamw() {
    // The executor's block-by-block step against Model::forward/backward and one AdamW
    // call per tensor, on resident buffers.
    use strata_engine::kernels::adamw::{AdamStep, CopyOut, Grads, State};
    use strata_engine::kernels::isa::Isa;
    let model = Model::new(small()).unwrap();
    let (b, t) = (2, 16);
    let run = train(
        &model,
        StepShape::cpu(b, t),
        &NvmeOffload::default(),
        1,
        hyper(1e-3),
    );
    let mut params = model.init_params(7);
    let data = batches(model.vocab(), b * t, 1, 1, 11);
    let mut runner = Runner::on_cpu(model.clone(), b, t).unwrap();
    runner.load(&params).unwrap();
    let loss = runner.forward(&data[0][0].0, &data[0][0].1).unwrap();
    let grads = runner.backward().unwrap();
    let hp = hyper(1e-3).adam;
    for (block, (p, g)) in model.blocks().iter().zip(params.iter_mut().zip(&grads)) {
        for tensor in &block.tensors {
            let r = tensor.slot.range();
            let wd = if tensor.decays() {
                hp.weight_decay
            } else {
                0.0
            };
            let step = AdamStep::new(
                &AdamW {
                    weight_decay: wd,
                    ..hp
                },
                1,
                1.0,
            )
            .unwrap();
            let (mut m, mut v) = (vec![0.0; r.len()], vec![0.0; r.len()]);
            step.apply(
                Isa::active(),
                2,
                &mut p[r.clone()],
                State::F32 {
                    m: &mut m,
                    v: &mut v,
                },
                Grads::F32(&g[r.clone()]),
                CopyOut::None,
            )
            .unwrap();
        }
    }
    assert_eq!(run.losses[0].to_bits(), loss.to_bits(), "loss");
    for (x, y) in run.params.iter().zip(&params) {
        assert!(x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

#[test]
fn three_steps_match_pytorch_adamw_on_the_tiny_model() {
    let dir = golden_dir();
    let (model, params) = load_pretrained(&dir).unwrap();
    let expected = read_f32_tensors(&dir.join("expected.safetensors"));
    let data = TokenData::open(&dir.join("tokens.bin")).unwrap();
    for policy in [
        Box::new(AllOnDevice) as Box<dyn Policy>,
        Box::new(NvmeOffload::default()),
    ] {
        let input = PlanInput {
            model: &model,
            shape: StepShape::cpu(2, 16),
            budgets: UNLIMITED,
            cost: Default::default(),
        };
        let plan = Plan::build(&input, policy.as_ref()).unwrap();
        let nvme = tempfile::tempdir().unwrap();
        let config = ExecConfig {
            nvme_dirs: vec![nvme.path().into()],
            ..ExecConfig::default()
        };
        let mut exec = Executor::on_cpu(model.clone(), plan, &config).unwrap();
        exec.load(&params, None).unwrap();
        let mut losses = Vec::new();
        for step in 0..3 {
            let mut batch = Batch::default();
            data.read_batch(step, 2, 16, 64, &mut batch).unwrap();
            let r = exec
                .step(&[(&batch.inputs, &batch.targets)], &hyper(1e-3))
                .unwrap();
            losses.push(r.loss);
        }
        let expect_losses = &expected["losses"];
        assert!(
            rel_err(&losses, expect_losses) < 1e-5,
            "{losses:?} vs {expect_losses:?}"
        );
        let (final_params, _, _) = exec.export().unwrap();
        for (block, p) in model.blocks().iter().zip(&final_params) {
            for t in &block.tensors {
                let name = format!("final.{}{}", gpt2::PREFIX, t.name);
                let (got, want) = (&p[t.slot.range()], &expected[&name]);
                if t.name.ends_with("attn.c_attn.bias") {
                    // The key bias's gradient is zero in exact arithmetic (softmax ignores a
                    // constant per query), so both sides update it by AdamW's normalised
                    // rounding noise: about ±lr per step, in directions neither controls.
                    // Its values are bounded by 3 steps of lr; q and v are held to 1e-5.
                    let c = got.len() / 3;
                    for part in [0..c, 2 * c..3 * c] {
                        let err = rel_err(&got[part.clone()], &want[part]);
                        assert!(err < 1e-5, "{}: {name} (q, v) rel err {err}", policy.name());
                    }
                    for (g, w) in got[c..2 * c].iter().zip(&want[c..2 * c]) {
                        assert!(
                            (g - w).abs() <= 6.0 * 1e-3 + 1e-6,
                            "{name} key bias {g} vs {w}"
                        );
                    }
                    continue;
                }
                let err = rel_err(got, want);
                assert!(err < 1e-5, "{}: {name} rel err {err}", policy.name());
            }
        }
    }
}

#[test]
fn measured_peaks_and_bytes_agree_with_the_plan() {
    let model = Model::new(small()).unwrap();
    let base = StepShape {
        grad_accum: 2,
        ..StepShape::cpu(2, 32)
    };
    // The largest block's parameters, from the model alone: any policy holds at least
    // one block's parameters on the device to compute it.
    let largest_block = model
        .blocks()
        .iter()
        .map(|b| b.len as u64 * 4)
        .max()
        .unwrap();
    for (shape, policy) in all_policies().into_iter().map(|p| (base, p)).chain(
        all_policies()
            .into_iter()
            .step_by(3)
            .map(|p| (base.delayed(), p)),
    ) {
        let input = PlanInput {
            model: &model,
            shape,
            budgets: UNLIMITED,
            cost: Default::default(),
        };
        let plan = Plan::build(&input, policy.as_ref()).unwrap();
        for chaos in CHAOS {
            let nvme = tempfile::tempdir().unwrap();
            let config = ExecConfig {
                nvme_dirs: vec![nvme.path().into()],
                chaos,
                ..ExecConfig::default()
            };
            let mut exec = Executor::on_cpu(model.clone(), plan.clone(), &config).unwrap();
            exec.load(&model.init_params(3), None).unwrap();
            let data = batches(96, 64, 3, 2, 5);
            for (i, step) in data.iter().enumerate() {
                let refs: Vec<(&[u32], &[u32])> =
                    step.iter().map(|(t, y)| (&t[..], &y[..])).collect();
                let report = exec.step(&refs, &hyper(1e-3)).unwrap();
                // Bytes counted where they were copied or transferred, against the
                // plan's bytes of the operations that ran (a delayed update's first step
                // runs no update): an unplanned copy shows here.
                let mut planned = [0u64; 4];
                let mut ops = [0u64; 4];
                for r in &report.records {
                    // By what the operation did (an NVMe read may run on the H2D lane,
                    // chained to its copy).
                    let link = match r.label.what {
                        "nvme read" => 0,
                        "nvme write" => 1,
                        "h2d" => 2,
                        "d2h" => 3,
                        _ => continue,
                    };
                    planned[link] += r.bytes;
                    ops[link] += 1;
                }
                assert_eq!(
                    report.link_bytes[2..],
                    planned[2..],
                    "{}: h2d/d2h bytes of step {i}",
                    policy.name()
                );
                for link in 0..2 {
                    let got = report.link_bytes[link];
                    // NVMe transfers move whole 4 KiB blocks.
                    assert!(
                        got >= planned[link] && got <= planned[link] + 4095 * ops[link],
                        "{}: nvme link {link} moved {got} bytes, planned {} in {} ops",
                        policy.name(),
                        planned[link],
                        ops[link]
                    );
                }
            }
            let (measured, allocated) = (exec.peak_measured(), exec.allocated());
            for tier in Tier::ALL {
                let i = tier.index();
                assert!(
                    measured[i] <= plan.peak[i] && measured[i] <= allocated[i],
                    "{}: measured {tier} {} > plan {} or allocated {}",
                    policy.name(),
                    measured[i],
                    plan.peak[i],
                    allocated[i]
                );
            }
            assert!(measured[0] >= largest_block, "{}", policy.name());
            if policy.name().starts_with("nvme") {
                // Streaming really shares memory: the device holds less than all the
                // params, and the NVMe tier held data.
                let all_params: u64 = model.blocks().iter().map(|b| b.len as u64 * 4).sum();
                assert!(measured[0] < 16 * all_params, "{}", policy.name());
                assert!(
                    measured[1] > 0 && measured[2] >= all_params,
                    "{}",
                    policy.name()
                );
            }
        }
    }
}

#[test]
fn a_plan_chosen_for_budgets_stays_within_them() {
    let model = Model::new(small()).unwrap();
    let shape = StepShape::cpu(1, 16);
    // Budgets from the model's size alone, not from any plan: its fp32 training state
    // (parameters, gradients, m, v: 16 B/param) fits in neither the device budget nor,
    // with the host's own buffers, the host budget.
    let state = model.param_count() as u64 * 16;
    let budgets = Budgets {
        device: state / 2,
        host: state * 3 / 4,
        nvme: state * 8,
    };
    let input = PlanInput {
        model: &model,
        shape,
        budgets,
        cost: Default::default(),
    };
    let (_, plan, _) = Auto::default().choose(&input).unwrap();
    let nvme = tempfile::tempdir().unwrap();
    let mut exec = Executor::on_cpu(
        model.clone(),
        plan.clone(),
        &ExecConfig::with_nvme(vec![nvme.path().into()]),
    )
    .unwrap();
    exec.load(&model.init_params(3), None).unwrap();
    for step in &batches(96, 16, 2, 1, 5) {
        let refs: Vec<(&[u32], &[u32])> = step.iter().map(|(t, y)| (&t[..], &y[..])).collect();
        exec.step(&refs, &hyper(1e-3)).unwrap();
    }
    let measured = exec.peak_measured();
    let budget = [budgets.device, budgets.host, budgets.nvme];
    for tier in Tier::ALL {
        let i = tier.index();
        assert!(
            measured[i] <= budget[i],
            "{}: measured {tier} {} over the budget {}",
            plan.policy,
            measured[i],
            budget[i]
        );
    }
    assert!(measured[2] > 0, "{}: the state went to NVMe", plan.policy);
}

#[test]
fn a_plan_over_budget_is_refused_naming_the_tier_and_what_fits() {
    let model = Model::new(small()).unwrap();
    // Every block recomputes: the device need is the plan's whatever the budget.
    let shape = StepShape::cpu(2, 32).recomputing(Recompute::All);
    let full = Plan::build(
        &PlanInput {
            model: &model,
            shape,
            budgets: UNLIMITED,
            cost: Default::default(),
        },
        &AllOnDevice,
    )
    .unwrap();
    let budgets = Budgets {
        device: full.peak[0] / 2,
        host: u64::MAX / 4,
        nvme: u64::MAX / 4,
    };
    let input = PlanInput {
        model: &model,
        shape,
        budgets,
        cost: Default::default(),
    };
    let plan = Plan::build(&input, &AllOnDevice).unwrap();
    let err = plan.check_fits(&input).unwrap_err();
    let PlanError::DoesNotFit {
        ref short,
        ref suggestions,
        ..
    } = err
    else {
        panic!("{err}");
    };
    assert_eq!(short.len(), 1, "{err}");
    assert_eq!(short[0].tier, Tier::Device);
    assert_eq!(
        (short[0].need_bytes, short[0].budget_bytes),
        (full.peak[0], full.peak[0] / 2)
    );
    let msg = err.to_string();
    assert!(
        msg.contains("device tier") && msg.contains("short"),
        "{msg}"
    );
    assert!(
        suggestions.iter().any(|s| s.contains("policies that fit")),
        "{msg}"
    );
    // Auto picks a policy that fits, and everything-on-device when it fits.
    let auto = Auto::default();
    let (_, chosen, _) = auto.choose(&input).unwrap();
    assert!(
        chosen.first_overflow().is_none() && chosen.policy != "all-on-device",
        "{}",
        chosen.policy
    );
    let (_, roomy, _) = auto
        .choose(&PlanInput {
            budgets: UNLIMITED,
            ..input
        })
        .unwrap();
    assert_eq!(roomy.policy, "all-on-device");
    // Nothing fits: the refusal says so.
    let none = PlanInput {
        budgets: Budgets {
            device: 1 << 10,
            host: 1 << 10,
            nvme: 0,
        },
        ..input
    };
    let Err(PlanError::DoesNotFit { short, .. }) = auto.choose(&none) else {
        panic!("nothing fits 1 KiB budgets");
    };
    // Every tier that is short is named in the one refusal.
    assert!(short.len() >= 2, "{short:?}");
}

/// Rates under which the cost model prefers offloading activations to recomputing
/// them: copies and NVMe a thousand times the defaults.
fn fast_links() -> CostModel {
    let d = CostModel::default();
    CostModel {
        h2d_bytes_per_s: 1e3 * d.h2d_bytes_per_s,
        d2h_bytes_per_s: 1e3 * d.d2h_bytes_per_s,
        nvme_read_bytes_per_s: 1e3 * d.nvme_read_bytes_per_s,
        nvme_write_bytes_per_s: 1e3 * d.nvme_write_bytes_per_s,
        ..d
    }
}

/// Plans of `model` under `policy` in which every layer block recomputes its forward in
/// the backward (`--recompute all`), none of them (`none`), none but offloading their
/// saved activations (`offload`: all but the last, whose backward follows too closely),
/// and some (`auto` under a device budget halfway between the first two's device peaks,
/// with no host room to offload), each checked to be what it says.
fn recompute_plans(model: &Model, shape: StepShape, policy: &dyn Policy) -> [Plan; 4] {
    // Horizontally, the last layer's backward follows its forward too closely for an
    // offload (vertically it does not: tests/schedule.rs offloads every layer). The
    // budgets below are set from these plans' peaks: without the next step's head
    // fetched at each step's end, whose buffers would let auto weigh another peak.
    let shape = shape
        .scheduled(Schedule::Horizontal)
        .prefetching_next_step(false);
    let plan = |recompute, budgets| {
        let input = PlanInput {
            model,
            shape: shape.recomputing(recompute),
            budgets,
            cost: Default::default(),
        };
        Plan::build(&input, policy).unwrap()
    };
    let all = plan(Recompute::All, UNLIMITED);
    let none = plan(Recompute::None, UNLIMITED);
    let offload = plan(Recompute::Offload, UNLIMITED);
    let layers = model.layers();
    assert_eq!((all.recomputed(), none.recomputed()), (layers, 0));
    assert_eq!(offload.recomputed(), 0);
    assert!(
        (1..layers).contains(&offload.offloaded()),
        "{}",
        offload.recompute_summary()
    );
    let (low, high) = (all.peak[0], none.peak[0]);
    assert!(low < high, "{}: device {low} vs {high}", policy.name());
    let budgets = Budgets {
        device: (low + high) / 2,
        host: all.peak[1],
        ..UNLIMITED
    };
    let mixed = plan(Recompute::Auto, budgets);
    let what = format!(
        "{} under a device budget of {}",
        policy.name(),
        budgets.device
    );
    assert!(mixed.peak[0] <= budgets.device, "{what}: {}", mixed.peak[0]);
    assert!(
        (1..layers).contains(&mixed.recomputed()) && mixed.offloaded() == 0,
        "{what}: {}",
        mixed.recompute_summary()
    );
    [all, none, offload, mixed]
}

#[test]
fn recomputing_every_block_none_or_some_trains_bit_identically() {
    // GPT-2, and a Qwen3-shaped model of the Llama family (grouped-query attention with
    // per-head q/k norms: every intermediate its saved backward reads).
    let mut qwen3 = LlamaConfig::llama(3, 48, 80, 4, 2, 96, 32);
    qwen3.head_dim = 16;
    qwen3.variant = Variant::Qwen3;
    qwen3.qk_norm = true;
    let models = [
        Model::new(small()).unwrap(),
        Model::of(Llama::new(qwen3).unwrap()),
    ];
    for (model, grad_accum) in models.iter().flat_map(|m| [(m, 1), (m, 2)]) {
        let shape = StepShape {
            grad_accum,
            ..StepShape::cpu(2, 16)
        };
        let everything = shape.recomputing(Recompute::All);
        let reference = train(model, everything, &AllOnDevice, 3, hyper(1e-3));
        for policy in each_policy() {
            for plan in recompute_plans(model, shape, policy.as_ref()) {
                for chaos in [None, Some(1)] {
                    let what = format!(
                        "{}, accumulating {grad_accum}, {} ({}), chaos {chaos:?}",
                        model.family().name(),
                        plan.policy,
                        plan.recompute_summary()
                    );
                    let run = train_plan(model, plan.clone(), 3, hyper(1e-3), chaos);
                    assert_bit_identical(&reference, &run, &what);
                }
            }
        }
    }
}

#[test]
fn the_planner_keeps_what_fits_and_charges_recomputing_only_where_it_happens() {
    use strata_engine::model::{Dtype, Pass};
    let layers = 6;
    let model = Model::new(Gpt2Config::new(layers, 4, 64, 96, 32)).unwrap();
    let dims = model.shape(2, 32).unwrap();
    let shape = StepShape::cpu(2, 32);
    let plan_under = |recompute, budgets| {
        let input = PlanInput {
            model: &model,
            shape: shape.recomputing(recompute),
            budgets,
            cost: Default::default(),
        };
        (Plan::build(&input, &AllOnDevice).unwrap(), input)
    };
    // No host room for offloaded activations: the blocks not kept recompute.
    let host = plan_under(Recompute::All, UNLIMITED).0.peak[1];
    let plan = |recompute, device| {
        plan_under(
            recompute,
            Budgets {
                device,
                host,
                ..UNLIMITED
            },
        )
    };
    let (all, _) = plan(Recompute::All, UNLIMITED.device);
    let (none, _) = plan(Recompute::None, UNLIMITED.device);
    // Room for everything: auto keeps every block.
    let (roomy, _) = plan(Recompute::Auto, UNLIMITED.device);
    assert_eq!(roomy.kept, none.kept);
    assert_eq!(roomy.recompute_summary(), "recompute: 0 of 6 blocks");
    assert_eq!(all.recompute_summary(), "recompute: 6 of 6 blocks");
    // The saved activations are in the device peak: every kept block's are live at once.
    let per_block = model.saved_bytes(1, dims, Target::Cpu, Dtype::F32) as u64;
    assert_eq!(none.saved_total_bytes(), layers as u64 * per_block);
    assert!(
        none.peak[0] >= all.peak[0] + none.saved_total_bytes(),
        "keeping {} of saved activations raised the device peak from {} to {} only",
        none.saved_total_bytes(),
        all.peak[0],
        none.peak[0]
    );
    // Between the two peaks auto keeps what fits, the last blocks first.
    for device in [
        all.peak[0] + per_block,
        (all.peak[0] + none.peak[0]) / 2,
        none.peak[0] - 1,
    ] {
        let (mixed, _) = plan(Recompute::Auto, device);
        let kept = layers - mixed.recomputed();
        assert!(mixed.peak[0] <= device, "{} over {device}", mixed.peak[0]);
        assert!((1..layers).contains(&kept), "{}", mixed.recompute_summary());
        let last: Vec<bool> = (0..layers + 2)
            .map(|b| b > layers - kept && b <= layers)
            .collect();
        assert_eq!(mixed.kept, last, "under {device}");
    }
    // Too tight to keep any: every block recomputes.
    let (tight, _) = plan(Recompute::Auto, all.peak[0]);
    assert_eq!(tight.recomputed(), layers);
    // The cost model charges the forward's FLOPs again for recomputed blocks only.
    let cost = CostModel::default();
    let compute = |p: &Plan| cost.predict(p).compute_seconds;
    let again = model.recompute_flops(1, dims);
    let forward = model.flops(1, Pass::Forward, dims);
    assert!(
        again > 0.95 * forward && again < forward,
        "{again} vs {forward}"
    );
    let (mixed, _) = plan(Recompute::Auto, (all.peak[0] + none.peak[0]) / 2);
    for p in [&all, &mixed] {
        let charged = compute(p) - compute(&none);
        let want = p.recomputed() as f64 * again / cost.compute_flops;
        assert!(
            (charged - want).abs() <= 1e-9 * compute(p),
            "{}: {charged} s charged for recomputing, {want} s expected",
            p.recompute_summary()
        );
    }
    assert!(cost.predict(&none).step_seconds < cost.predict(&mixed).step_seconds);
    assert!(cost.predict(&mixed).step_seconds < cost.predict(&all).step_seconds);
    // --recompute none under that budget: refused, naming the device shortfall, what
    // the kept activations take, and that auto fits.
    let (refused, input) = plan(Recompute::None, (all.peak[0] + none.peak[0]) / 2);
    let err = refused.check_fits(&input).unwrap_err();
    let PlanError::DoesNotFit { ref short, .. } = err else {
        panic!("{err}");
    };
    assert_eq!(short.len(), 1, "{err}");
    assert_eq!(short[0].tier, Tier::Device);
    assert_eq!(short[0].need_bytes, none.peak[0]);
    let msg = err.to_string();
    assert!(
        msg.contains("--recompute none")
            && msg.contains(&format!(
                "with --recompute auto it fits, recomputing {} of 6 blocks",
                mixed.recomputed()
            )),
        "{msg}"
    );
}

#[test]
fn the_planner_offloads_activations_where_the_cost_model_says_copies_beat_recomputing() {
    use strata_engine::model::Dtype;
    let layers = 6;
    let model = Model::new(Gpt2Config::new(layers, 4, 64, 96, 32)).unwrap();
    let dims = model.shape(2, 32).unwrap();
    let per_block = model.saved_bytes(1, dims, Target::Cpu, Dtype::F32) as u64;
    // Budgets are set from these plans' peaks, as in `recompute_plans`.
    let shape = StepShape::cpu(2, 32).prefetching_next_step(false);
    let policy = ParamOffload {
        depth: 2,
        checkpoints: Tier::Host,
    };
    let plan = |recompute, budgets, cost| {
        let input = PlanInput {
            model: &model,
            shape: shape.recomputing(recompute),
            budgets,
            cost,
        };
        Plan::build(&input, &policy).unwrap()
    };
    let unlimited = |recompute| plan(recompute, UNLIMITED, CostModel::default());
    let (all, none, offload) = (
        unlimited(Recompute::All),
        unlimited(Recompute::None),
        unlimited(Recompute::Offload),
    );
    // Layers 1 to 5 are far enough from their backward (more than depth + 1 computes:
    // layer 5's is 4 after it, behind layer 6's forward, the head and layer 6's
    // backward) to offload; layer 6 keeps its on the device.
    let offloaded: Vec<bool> = (0..layers + 2)
        .map(|b| offload.saved_tier[b] == Tier::Host)
        .collect();
    let want: Vec<bool> = (0..layers + 2).map(|b| (1..=5).contains(&b)).collect();
    assert_eq!(offloaded, want, "{}", offload.recompute_summary());
    assert_eq!(
        offload.recompute_summary(),
        "recompute: 0 of 6 blocks, 5 offloaded to host"
    );
    assert_eq!(offload.saved_in(Tier::Host), 5 * per_block);
    assert_eq!(offload.saved_total_bytes(), per_block);
    // Each offloaded block's activations cross each way once per step, and wait in
    // host memory all at once (every forward ends before the first backward).
    let links = |p: &Plan| (p.link_bytes[2], p.link_bytes[3]);
    assert_eq!(
        links(&offload),
        (
            links(&none).0 + 5 * per_block,
            links(&none).1 + 5 * per_block
        )
    );
    assert!(
        offload.peak[1] >= none.peak[1] + 5 * per_block,
        "host {} vs {} + 5 x {per_block}",
        offload.peak[1],
        none.peak[1]
    );
    // On the device they are no longer all live at once.
    assert!(
        offload.peak[0] + per_block <= none.peak[0],
        "device {} offloading vs {} keeping",
        offload.peak[0],
        none.peak[0]
    );
    // Under a device budget that keeping every block's does not fit, auto offloads
    // where copies are cheap, and recomputes where they are dear or the host is full.
    let device = Budgets {
        device: offload.peak[0],
        ..UNLIMITED
    };
    let fast = plan(Recompute::Auto, device, fast_links());
    assert_eq!(fast.recomputed(), 0, "{}", fast.recompute_summary());
    assert!(fast.offloaded() >= 1, "{}", fast.recompute_summary());
    assert!(fast.peak[0] <= device.device);
    let d = CostModel::default();
    let dear = CostModel {
        h2d_bytes_per_s: 1e-3 * d.h2d_bytes_per_s,
        d2h_bytes_per_s: 1e-3 * d.d2h_bytes_per_s,
        ..d
    };
    let slow = plan(Recompute::Auto, device, dear);
    assert!(
        slow.recomputed() >= 1 && slow.offloaded() == 0,
        "{}",
        slow.recompute_summary()
    );
    let full_host = Budgets {
        host: all.peak[1],
        ..device
    };
    let no_room = plan(Recompute::Auto, full_host, fast_links());
    assert!(
        no_room.recomputed() >= 1 && no_room.offloaded() == 0,
        "{}",
        no_room.recompute_summary()
    );
    // Host room for some of them: those offload, the rest recompute.
    let some_room = Budgets {
        host: all.peak[1] + 5 * per_block / 2,
        ..device
    };
    let partly = plan(Recompute::Auto, some_room, fast_links());
    assert!(
        partly.recomputed() >= 1 && partly.offloaded() >= 1,
        "{}",
        partly.recompute_summary()
    );
    assert!(partly.first_overflow().is_none(), "{:?}", partly.peak);
    // What the choice was weighed by: the fast links predict the offloading plan
    // faster than the recomputing one, the dear ones the reverse.
    let step = |cost: &CostModel, p: &Plan| cost.predict(p).step_seconds;
    assert!(step(&fast_links(), &fast) < step(&fast_links(), &slow));
    assert!(step(&dear, &slow) < step(&dear, &fast));
    // Where the policy puts checkpoints on NVMe, offloaded activations go there too:
    // an extent each, NVMe traffic instead of host memory.
    let nvme_policy = NvmeOffload {
        depth: 2,
        checkpoints: Tier::Nvme,
    };
    let on_nvme = |recompute| {
        let input = PlanInput::new(&model, shape.recomputing(recompute), UNLIMITED);
        Plan::build(&input, &nvme_policy).unwrap()
    };
    let (kept, to_nvme) = (on_nvme(Recompute::None), on_nvme(Recompute::Offload));
    assert_eq!(to_nvme.saved_in(Tier::Nvme), 5 * per_block);
    assert_eq!(to_nvme.saved_in(Tier::Host), 0);
    assert!(
        to_nvme.peak[2] >= kept.peak[2] + 5 * per_block,
        "nvme {} vs {}",
        to_nvme.peak[2],
        kept.peak[2]
    );
    assert_eq!(to_nvme.link_bytes[0], kept.link_bytes[0] + 5 * per_block);
    assert_eq!(to_nvme.link_bytes[1], kept.link_bytes[1] + 5 * per_block);
}

/// Master parameters, m and v of every block.
type State = strata_engine::exec::TrainingState;

/// An executor for `plan` on the CPU device (swap files in a fresh folder, kept alive by
/// the returned guard), loaded with `init`, after `steps` steps over `data`'s batches
/// at lr 1e-2.
fn started(
    model: &Model,
    plan: &Plan,
    init: &[Vec<f32>],
    data: &[Vec<(Vec<u32>, Vec<u32>)>],
    steps: usize,
) -> (Executor, tempfile::TempDir) {
    let nvme = tempfile::tempdir().unwrap();
    let mut exec = Executor::on_cpu(
        model.clone(),
        plan.clone(),
        &ExecConfig::with_nvme(vec![nvme.path().into()]),
    )
    .unwrap();
    exec.load(init, None).unwrap();
    for batch in &data[..steps] {
        let refs: Vec<(&[u32], &[u32])> = batch.iter().map(|(t, y)| (&t[..], &y[..])).collect();
        exec.step(&refs, &hyper(1e-2)).unwrap();
    }
    (exec, nvme)
}

/// Invariant 4 after a failed step: every block is wholly as before the step (`before`)
/// or wholly as the step leaves it in a run without the failure (`clean`), and its step
/// counter says which; the executor's own counter did not move. Returns which blocks
/// committed.
fn assert_blocks_whole(
    what: &str,
    exec: &Executor,
    before: &State,
    clean: &State,
    steps: u64,
) -> Vec<bool> {
    assert_eq!(exec.steps(), steps, "{what}: the failed step was counted");
    let after = exec.export().unwrap();
    let counts = exec.block_steps();
    counts
        .iter()
        .enumerate()
        .map(|(b, &n)| {
            let (want, when) = match n {
                n if n == steps => (before, "before"),
                n if n == steps + 1 => (clean, "after"),
                n => panic!("{what}: block {b} counts {n} steps, the executor {steps}"),
            };
            assert!(
                after.0[b] == want.0[b],
                "{what}: block {b}'s parameters are not those {when} the step its counter says"
            );
            assert!(
                after.1[b] == want.1[b],
                "{what}: block {b}'s m is not that {when} the step"
            );
            assert!(
                after.2[b] == want.2[b],
                "{what}: block {b}'s v is not that {when} the step"
            );
            n == steps + 1
        })
        .collect()
}

/// After a retry of a failed step: every block counts the step once, the blocks that had
/// committed kept their update (not applied twice), and with none committed the retry
/// gives exactly the clean step. Then one more step must equal that of a fresh executor
/// loaded with the exported state: the working copies (on whatever tier) were rewritten
/// from the masters.
#[allow(clippy::too_many_arguments)]
fn assert_retry_applies_once(
    what: &str,
    exec: &mut Executor,
    committed: &[bool],
    clean: &State,
    steps: u64,
    model: &Model,
    plan: &Plan,
    next: &[(&[u32], &[u32])],
) {
    assert_eq!(exec.steps(), steps + 1, "{what}");
    assert!(
        exec.block_steps().iter().all(|&n| n == steps + 1),
        "{what}: {:?}",
        exec.block_steps()
    );
    let retried = exec.export().unwrap();
    if committed.iter().any(|&c| c) {
        for (b, _) in committed.iter().enumerate().filter(|(_, c)| **c) {
            assert!(
                retried.0[b] == clean.0[b]
                    && retried.1[b] == clean.1[b]
                    && retried.2[b] == clean.2[b],
                "{what}: block {b}, committed before the failure, changed in the retry"
            );
        }
    } else {
        assert!(
            &retried == clean,
            "{what}: the retried step differs from a clean one"
        );
    }
    if exec.has_pending_update() {
        return; // a delayed update's working copies are checked by the clean comparison
    }
    let nvme = tempfile::tempdir().unwrap();
    let mut fresh = Executor::on_cpu(
        model.clone(),
        plan.clone(),
        &ExecConfig::with_nvme(vec![nvme.path().into()]),
    )
    .unwrap();
    fresh
        .load(&retried.0, Some((&retried.1, &retried.2)))
        .unwrap();
    fresh.set_steps(steps + 1);
    exec.step(next, &hyper(1e-2)).unwrap();
    fresh.step(next, &hyper(1e-2)).unwrap();
    assert!(
        exec.export().unwrap() == fresh.export().unwrap(),
        "{what}: the step after the retry differs from one on the exported state (stale working parameters)"
    );
}

#[test]
fn an_nvme_fault_fails_the_step_and_commits_each_block_whole() {
    let model = Model::new(small()).unwrap();
    let data = batches(96, 32, 3, 1, 5);
    let refs = |s: usize| -> Vec<(&[u32], &[u32])> {
        data[s].iter().map(|(t, y)| (&t[..], &y[..])).collect()
    };
    let cases = [
        (
            "bit flips",
            FaultPlan {
                bitflip_per_million: 500_000,
                ..FaultPlan::seeded(1)
            },
            false,
        ),
        (
            "EIO",
            FaultPlan {
                eio_per_million: 300_000,
                ..FaultPlan::seeded(2)
            },
            false,
        ),
        (
            "ENOSPC",
            FaultPlan {
                enospc_per_million: 600_000,
                ..FaultPlan::seeded(4)
            },
            false,
        ),
        (
            "EIO, delayed update",
            FaultPlan {
                eio_per_million: 300_000,
                ..FaultPlan::seeded(3)
            },
            true,
        ),
    ];
    for ((kind, faults, delayed), chaos) in cases
        .into_iter()
        .flat_map(|case| CHAOS.map(|chaos| (case.clone(), chaos)))
    {
        let kind = format!("{kind}, chaos {chaos:?}");
        let shape = if delayed {
            StepShape::cpu(2, 16).delayed()
        } else {
            StepShape::cpu(2, 16)
        };
        let input = PlanInput {
            model: &model,
            shape,
            budgets: UNLIMITED,
            cost: Default::default(),
        };
        let plan = Plan::build(
            &input,
            &NvmeOffload {
                depth: 2,
                checkpoints: Tier::Nvme,
            },
        )
        .unwrap();
        let init = model.init_params(9);
        // A clean run of the same plan: the state before and after the second step.
        let clean = |steps: usize| {
            started(&model, &plan, &init, &data, steps)
                .0
                .export()
                .unwrap()
        };
        let (before, after) = (clean(1), clean(2));
        let nvme = tempfile::tempdir().unwrap();
        faults.pause(true);
        let config = ExecConfig {
            nvme_dirs: vec![nvme.path().into()],
            faults: Some(faults.clone()),
            io: strata_engine::storage::BackendChoice::Threads,
            chaos,
            ..ExecConfig::default()
        };
        let mut exec = Executor::on_cpu(model.clone(), plan.clone(), &config).unwrap();
        exec.load(&init, None).unwrap();
        // A first good step, so the fault hits a step with state to lose.
        exec.step(&refs(0), &hyper(1e-2)).unwrap();
        faults.pause(false);
        let result = exec.step(&refs(1), &hyper(1e-2));
        let Err(err) = result else {
            panic!("{kind}: no failure; injected {:?}", faults.injected());
        };
        assert!(matches!(err, ExecError::Storage { .. }), "{kind}: {err}");
        assert!(!faults.injected().is_empty());
        faults.pause(true);
        // A delayed update applies the first step's gradients during the second step.
        let steps = if delayed { 0 } else { 1 };
        let committed = assert_blocks_whole(&kind, &exec, &before, &after, steps);
        // The same step, retried without faults.
        exec.step(&refs(1), &hyper(1e-2)).unwrap();
        assert_retry_applies_once(
            &kind,
            &mut exec,
            &committed,
            &after,
            steps,
            &model,
            &plan,
            &refs(2),
        );
    }
}

#[test]
fn a_step_exports_as_a_chrome_trace_with_every_lane() {
    let model = Model::new(small()).unwrap();
    let shape = StepShape::cpu(2, 16);
    let input = PlanInput {
        model: &model,
        shape,
        budgets: UNLIMITED,
        cost: Default::default(),
    };
    let plan = Plan::build(&input, &NvmeOffload::default()).unwrap();
    let nvme = tempfile::tempdir().unwrap();
    let config = ExecConfig {
        nvme_dirs: vec![nvme.path().into()],
        ..ExecConfig::default()
    };
    let mut exec = Executor::on_cpu(model.clone(), plan.clone(), &config).unwrap();
    exec.load(&model.init_params(1), None).unwrap();
    let data = batches(96, 32, 1, 1, 5);
    let refs: Vec<(&[u32], &[u32])> = data[0].iter().map(|(t, y)| (&t[..], &y[..])).collect();
    let report = exec.step(&refs, &hyper(1e-3)).unwrap();
    assert_eq!(report.records.len(), plan.ops.len());
    for r in &report.records {
        assert!(r.end_ns >= r.start_ns);
    }
    let trace = report.chrome_trace(1);
    let events = trace["traceEvents"].as_array().unwrap();
    for lane in [
        "nvme-read",
        "nvme-write",
        "h2d",
        "compute",
        "d2h",
        "cpu-optimizer",
    ] {
        assert!(
            events.iter().any(|e| e["ph"] == "X" && e["cat"] == lane),
            "no {lane} slices"
        );
    }
    assert!(
        report.link_bytes.iter().all(|&b| b > 0),
        "{:?}",
        report.link_bytes
    );
    assert!(exec.latency_summary().iter().any(|(k, ..)| *k == "adamw"));
    // The prediction is in the right ballpark's units (seconds, positive).
    let p = strata_engine::plan::CostModel::default().predict(&plan);
    assert!(p.step_seconds > 0.0 && p.overlap_efficiency() <= 1.0);
}

#[test]
fn calibration_measures_every_rate_and_plans_with_them() {
    let dir = tempfile::tempdir().unwrap();
    let config = Gpt2Config::gpt2();
    let cost = strata_engine::exec::calibrate(
        &Model::new(config).unwrap(),
        4,
        128,
        strata_engine::model::Target::Cpu,
        Some(dir.path()),
    )
    .unwrap();
    assert_eq!(cost.source, "measured at start");
    for (what, rate) in [
        ("compute", cost.compute_flops),
        ("copies", cost.h2d_bytes_per_s),
        ("adamw", cost.adam_params_per_s),
        ("nvme read", cost.nvme_read_bytes_per_s),
        ("nvme write", cost.nvme_write_bytes_per_s),
    ] {
        assert!(rate.is_finite() && rate > 0.0, "{what}: {rate}");
    }
    // Plausible for any machine this runs on: a GFLOP/s to a PFLOP/s, 100 MB/s copies.
    assert!(
        (1e9..1e15).contains(&cost.compute_flops),
        "{}",
        cost.compute_flops
    );
    assert!(cost.h2d_bytes_per_s > 1e8, "{}", cost.h2d_bytes_per_s);
    let model = Model::new(small()).unwrap();
    let input = PlanInput {
        model: &model,
        shape: StepShape::cpu(2, 16),
        budgets: UNLIMITED,
        cost: Default::default(),
    };
    let (_, plan, _) = Auto { cost }.choose(&input).unwrap();
    assert!(cost.predict(&plan).step_seconds > 0.0);
}

/// Invariant 4 at every position of a step, for the policy whose state is homed on NVMe
/// (A/B extents that swap only when a whole step succeeded): whichever operation fails,
/// the parameters, m and v are as before the step, no step is counted, and the same step
/// retried gives what a run without the failure gives. (With state homed on the host or
/// the device, a failure after an earlier block's in-place update leaves that block
/// updated: per-block commit is not built yet.)
#[test]
fn a_failure_at_any_operation_commits_each_block_whole_under_every_policy() {
    let model = Model::new(small()).unwrap();
    let data = batches(96, 32, 5, 1, 7);
    let refs = |s: usize| -> Vec<(&[u32], &[u32])> {
        data[s].iter().map(|(t, y)| (&t[..], &y[..])).collect()
    };
    let policies: [Box<dyn Policy>; 5] = [
        Box::new(AllOnDevice),
        Box::new(CpuOffload),
        Box::new(ParamOffload {
            depth: 2,
            checkpoints: Tier::Host,
        }),
        Box::new(NvmeOffload {
            depth: 2,
            checkpoints: Tier::Host,
        }),
        Box::new(NvmeOnly(NvmeOffload {
            depth: 1,
            checkpoints: Tier::Nvme,
        })),
    ];
    let init = model.init_params(9);
    // Plain, delayed, and (NVMe state) with gradients spilled for the norm.
    let variants = policies.iter().flat_map(|p| {
        let spill = p.name().starts_with("nvme");
        [(p, false, false), (p, true, false)]
            .into_iter()
            .chain(spill.then_some((p, false, true)))
    });
    for (policy, delayed, spilled) in variants {
        let shape = match (delayed, spilled) {
            (true, _) => StepShape::cpu(2, 16).delayed(),
            (false, true) => StepShape::cpu(2, 16).clipped().spilling(GradSpill::Always),
            (false, false) => StepShape::cpu(2, 16),
        };
        let input = PlanInput {
            model: &model,
            shape,
            budgets: UNLIMITED,
            cost: Default::default(),
        };
        let plan = Plan::build(&input, policy.as_ref()).unwrap();
        // Steps before the one that fails: two, so a delayed update has one pending.
        let good = 2;
        let start = |steps: usize| started(&model, &plan, &init, &data, steps);
        let (before, after) = (
            start(good).0.export().unwrap(),
            start(good + 1).0.export().unwrap(),
        );
        let steps = start(good).0.steps();
        // Outcomes by position: (no block committed, some, all).
        let mut outcomes = [0usize; 3];
        for op in (0..plan.ops.len()).map(OpId::of) {
            // Every operation returns an error; the update's also panic.
            let faults: &[Fault] = if plan.op(op).update {
                &[Fault::Error, Fault::Panic]
            } else {
                &[Fault::Error]
            };
            for &fault in faults {
                let what = format!(
                    "{}, delayed {delayed}, spilled {spilled}: {fault:?} at {} ({op})",
                    plan.policy,
                    plan.op(op).kind.label()
                );
                let (mut exec, _nvme) = start(good);
                exec.fail_next_at(op, fault);
                let err = exec.step(&refs(good), &hyper(1e-2)).unwrap_err();
                match fault {
                    Fault::Error => {
                        assert!(matches!(err, ExecError::Injected { .. }), "{what}: {err}")
                    }
                    Fault::Panic => {
                        assert!(matches!(err, ExecError::Panicked { .. }), "{what}: {err}")
                    }
                }
                let committed = assert_blocks_whole(&what, &exec, &before, &after, steps);
                let n = committed.iter().filter(|&&c| c).count();
                outcomes[if n == 0 {
                    0
                } else if n < committed.len() {
                    1
                } else {
                    2
                }] += 1;
                exec.step(&refs(good), &hyper(1e-2)).unwrap();
                assert_retry_applies_once(
                    &what,
                    &mut exec,
                    &committed,
                    &after,
                    steps,
                    &model,
                    &plan,
                    &refs(good + 1),
                );
            }
        }
        // The table of outcomes in the note (`--nocapture` shows it).
        eprintln!(
            "{}, delayed {delayed}, spilled {spilled}: {} operations; failures leaving no block committed {}, some {}, all {}",
            plan.policy,
            plan.ops.len(),
            outcomes[0],
            outcomes[1],
            outcomes[2]
        );
    }
}

#[test]
fn a_panic_in_any_lane_ends_the_step_with_an_error_naming_it() {
    let model = Model::new(small()).unwrap();
    let data = batches(96, 32, 1, 1, 5);
    let shape = StepShape::cpu(2, 16);
    let input = PlanInput {
        model: &model,
        shape,
        budgets: UNLIMITED,
        cost: Default::default(),
    };
    let plan = Plan::build(
        &input,
        &NvmeOffload {
            depth: 2,
            checkpoints: Tier::Nvme,
        },
    )
    .unwrap();
    // One operation of every lane of the plan: the first of each.
    let mut firsts = Vec::new();
    for lane in strata_engine::plan::Lane::ALL {
        if let Some(&id) = plan.lanes[lane.index()].first() {
            firsts.push((lane, id, plan.op(id).kind.label().to_string()));
        }
    }
    assert_eq!(firsts.len(), 6, "the plan uses every lane");
    for (lane, id, label) in firsts {
        let (model, plan, refs) = (model.clone(), plan.clone(), data[0].clone());
        let (send, recv) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let nvme = tempfile::tempdir().unwrap();
            let config = ExecConfig::with_nvme(vec![nvme.path().into()]);
            let mut exec = Executor::on_cpu(model.clone(), plan, &config).unwrap();
            exec.load(&model.init_params(1), None).unwrap();
            exec.fail_next_at(id, Fault::Panic);
            let refs: Vec<(&[u32], &[u32])> = refs.iter().map(|(t, y)| (&t[..], &y[..])).collect();
            let _ = send.send(exec.step(&refs, &hyper(1e-3)).map(|_| ()));
        });
        // The other lanes stop: the step ends, it does not hang.
        let err = recv
            .recv_timeout(std::time::Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("{lane} {label}: the step hung after a panic"))
            .unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(&err, ExecError::Panicked { lane: l, op, .. } if *l == lane && *op == label),
            "{lane} {label}: {text}"
        );
        assert!(
            text.contains(&lane.to_string()) && text.contains(&label),
            "{text}"
        );
    }
}

/// A transient buffer that takes over a slot waits for every use of the slot's previous
/// occupant, so among slots of the size it needs the planner picks the one whose
/// occupant was last used earliest. The case that showed it: GPT-2's embedding
/// gradients (copied to the host after the last backward, for the embedding's update)
/// are about twice a layer's optimizer state, and their host buffer took over the state
/// staging slot of the last layer updated, so that copy, and the embedding's update
/// after it, waited for that layer's state to be written to NVMe. Here the embedding's
/// gradients are 1.3x a layer's state; their copy may wait for no state write issued
/// after the backward before the last one began.
#[test]
fn the_gradients_copied_after_the_last_backward_wait_for_no_late_state_write() {
    // 3 layers of 64 channels: 49,920 parameters each (599,040 bytes of state); the
    // embedding 3,000 x 64 + 32 x 64: 194,048 (776,192 bytes of gradients).
    let model = Model::new(Gpt2Config::new(3, 4, 64, 3000, 32)).unwrap();
    // A GPU's plan: the CPU device's optimizer reads the gradients where the backward
    // left them, so there is no copy to wait.
    let input = PlanInput {
        model: &model,
        shape: StepShape {
            target: Target::Cuda,
            ..StepShape::cpu(2, 16)
        },
        budgets: UNLIMITED,
        cost: Default::default(),
    };
    let policy = NvmeOffload {
        depth: 2,
        checkpoints: Tier::Host,
    };
    let plan = Plan::build(&input, &policy).unwrap();
    assert!(plan.edges_on_host());
    let copy = plan
        .ops
        .iter()
        .position(|op| {
            matches!(op.kind, OpKind::Stream(StreamOp::D2h { to, .. }) if plan.buffer(to).name == "grads[0]@host")
        })
        .expect("the embedding's gradients are copied to the host");
    // Every operation `op` waits for, directly or through others.
    let waits = |op: usize| {
        let mut waits = vec![false; plan.ops.len()];
        let mut stack = vec![op];
        while let Some(i) = stack.pop() {
            for d in &plan.ops[i].deps {
                if !waits[d.index()] {
                    waits[d.index()] = true;
                    stack.push(d.index());
                }
            }
        }
        waits
    };
    // The backward that completes the gradients (the copy's last compute dependency),
    // and the one before it on the compute lane.
    let producer = plan.ops[copy]
        .deps
        .iter()
        .map(|d| d.index())
        .filter(|&d| plan.ops[d].lane == Lane::Compute)
        .max()
        .expect("the copy waits for a backward");
    let before = (0..producer)
        .rev()
        .find(|&i| plan.ops[i].lane == Lane::Compute)
        .expect("a compute before the last backward");
    // State writes issued after that compute are in flight while the last backward
    // runs: the copy must not wait for one.
    let copy_waits = waits(copy);
    let writes: Vec<String> = (before..plan.ops.len())
        .filter(|&i| copy_waits[i])
        .filter_map(|i| match plan.ops[i].kind {
            OpKind::Nvme(NvmeOp::Write { from, .. }) => Some(plan.buffer(from).name.clone()),
            _ => None,
        })
        .collect();
    assert!(
        writes.is_empty(),
        "the copy of the embedding's gradients waits for NVMe writes of {writes:?}"
    );
}

/// On the CPU device a block's update reads its gradients from the device buffer the
/// backward wrote, and runs beside the next block's backward. The canonical order puts
/// that update between the two backwards, so a slot freed by the update must not go to
/// the next backward's gradients (which would make every backward wait for the update
/// before it): gradients alternate between slots, and no backward waits for the
/// update of the block just before it.
#[test]
fn a_backward_does_not_wait_for_the_update_of_the_block_before_it() {
    let model = Model::new(Gpt2Config::new(6, 4, 64, 96, 32)).unwrap();
    let input = PlanInput {
        model: &model,
        shape: StepShape::cpu(2, 16),
        budgets: UNLIMITED,
        cost: Default::default(),
    };
    for policy in [
        Box::new(CpuOffload) as Box<dyn Policy>,
        Box::new(NvmeOnly(NvmeOffload {
            depth: 2,
            checkpoints: Tier::Host,
        })),
    ] {
        let plan = Plan::build(&input, policy.as_ref()).unwrap();
        let mut last_update: Option<(usize, usize)> = None;
        for (i, op) in plan.ops.iter().enumerate() {
            match op.kind {
                OpKind::Host(HostOp::Optimizer { block, grads, .. }) => {
                    assert_eq!(plan.buffer(grads).tier, Tier::Device, "{}", policy.name());
                    last_update = Some((i, block));
                }
                OpKind::Stream(StreamOp::Compute { .. }) if op.kind.label().what == "bwd" => {
                    if let Some((update, block)) = last_update {
                        assert!(
                            !op.deps.iter().any(|d| d.index() == update),
                            "{}: {} waits for the update of block {block}",
                            policy.name(),
                            op.kind.label()
                        );
                    }
                }
                _ => {}
            }
        }
        assert!(last_update.is_some());
    }
}
