//! Fetching the next step's first parameters at the end of each step
//! (`StepShape::prefetch_next_step`), on the CPU device:
//! - the plan moves the fetches its first computes wait for to the end of the step, each
//!   after its block's update is durable, so a step's first compute waits on no fetch;
//!   their buffers are persistent and the planned device peak counts them;
//! - steps train bit for bit as without it, under every streaming policy and depth,
//!   every chaos seed, plain, clipped with spilled gradients, with the vertical order
//!   and with the delayed update (whose fetches read the parameters it wrote);
//! - the first step, a step after a failed one and a step after a load fetch the head
//!   anew: a fault in an end-of-step fetch, or parameters loaded between steps, give
//!   the same training as a run without them.

mod model_support;

use model_support::training::{
    Run, adamw_clipped, assert_same, bits, small_gpt2, train, train_plan,
};
use model_support::{CHAOS, NvmeOnly, UNLIMITED, all_policies, random_batch};
use strata_engine::exec::{ExecConfig, Executor, Fault, StepParams};
use strata_engine::model::Model;
use strata_engine::plan::{
    AllOnDevice, GradSpill, NvmeOffload, NvmeOp, OpId, OpKind, Plan, PlanInput, Policy, Schedule,
    StepShape, StreamOp, Tier,
};

fn plan(model: &Model, shape: StepShape, policy: &dyn Policy) -> Plan {
    Plan::build(&PlanInput::new(model, shape, UNLIMITED), policy).unwrap()
}

/// Every block's parameters and state on NVMe: the embedding is fetched too.
fn nvme_only(depth: usize) -> NvmeOnly {
    NvmeOnly(NvmeOffload {
        depth,
        checkpoints: Tier::Nvme,
    })
}

/// The steps compared: (what, shape, step parameters).
fn cases() -> Vec<(&'static str, StepShape, StepParams)> {
    let base = StepShape::cpu(2, 8);
    vec![
        ("plain", base, adamw_clipped(0.0)),
        (
            "clipped, gradients spilled",
            base.clipped().spilling(GradSpill::Always),
            adamw_clipped(0.05),
        ),
        (
            "vertical, 3 micro-batches",
            StepShape {
                grad_accum: 3,
                ..base
            }
            .scheduled(Schedule::Vertical),
            adamw_clipped(0.0),
        ),
        ("delayed update", base.delayed(), adamw_clipped(0.0)),
    ]
}

/// The operations of `plan` that fetch the next step's head, and the first compute.
fn next_step_ops(plan: &Plan) -> (Vec<OpId>, OpId) {
    let ids = (0..plan.ops.len()).map(OpId::of);
    let next: Vec<OpId> = ids.clone().filter(|&id| plan.op(id).next_step).collect();
    let first = ids
        .into_iter()
        .find(|&id| matches!(plan.op(id).kind, OpKind::Stream(StreamOp::Compute { .. })))
        .unwrap();
    (next, first)
}

#[test]
fn the_first_fetches_end_the_step_before_after_their_blocks_updates() {
    let model = small_gpt2();
    for depth in 1..=3 {
        let policy = nvme_only(depth);
        let on = plan(&model, StepShape::cpu(2, 8), &policy);
        let off = plan(
            &model,
            StepShape::cpu(2, 8).prefetching_next_step(false),
            &policy,
        );
        assert!(on.fetches_next_step() && !off.fetches_next_step());
        let (next, first) = next_step_ops(&on);
        // The embedding and the layers its first computes read: depth + 1 blocks.
        let fetched = |p: &Plan, ids: &[OpId]| {
            ids.iter()
                .filter(|&&id| matches!(p.op(id).kind, OpKind::Nvme(NvmeOp::Read { .. })))
                .count()
        };
        assert_eq!(fetched(&on, &next), depth + 1, "depth {depth}");
        // The first compute waits only for its tokens; without, for parameters too.
        let tokens_only = |p: &Plan, id: OpId| {
            p.op(id).deps.iter().all(|&d| {
                matches!(p.op(d).kind,
                    OpKind::Stream(StreamOp::H2d { from, .. }) if from == p.tokens_host[0])
            })
        };
        assert!(
            tokens_only(&on, first),
            "depth {depth}: {:?}",
            on.op(first).deps
        );
        let (_, first_off) = next_step_ops(&off);
        assert!(!tokens_only(&off, first_off), "depth {depth}");
        // After every compute.
        let last_compute = (0..on.ops.len())
            .rev()
            .find(|&i| matches!(on.ops[i].kind, OpKind::Stream(StreamOp::Compute { .. })))
            .unwrap();
        assert!(
            next.iter().all(|id| id.index() > last_compute),
            "depth {depth}"
        );
        let commits: Vec<(usize, OpId)> = (0..on.ops.len())
            .map(OpId::of)
            .filter_map(|id| match on.op(id).kind {
                OpKind::Nvme(NvmeOp::Commit { block }) => Some((block, id)),
                _ => None,
            })
            .collect();
        // Each read waits for the commit of a block of its own: the embedding's and the
        // first layers'.
        let on_ref = &on;
        let mut waited: Vec<usize> = next
            .iter()
            .filter(|&&id| matches!(on_ref.op(id).kind, OpKind::Nvme(NvmeOp::Read { .. })))
            .flat_map(|&id| {
                commits
                    .iter()
                    .filter(move |(_, c)| on_ref.op(id).deps.contains(c))
                    .map(|&(b, _)| b)
            })
            .collect();
        waited.sort_unstable();
        assert_eq!(waited, (0..=depth).collect::<Vec<_>>(), "depth {depth}");
        // The buffers live across the boundary, and the plan counts them.
        assert!(
            on.peak[Tier::Device.index()] > off.peak[Tier::Device.index()],
            "depth {depth}: device peak {} against {} without",
            on.peak[0],
            off.peak[0]
        );
    }
}

#[test]
fn prefetching_the_next_step_trains_bit_identically_under_every_policy() {
    let model = small_gpt2();
    for (what, shape, params) in cases() {
        let reference = train(
            &model,
            shape.prefetching_next_step(false),
            &AllOnDevice,
            3,
            params,
            None,
        );
        let mut streamed = 0;
        for policy in all_policies() {
            let plan = plan(&model, shape, policy.as_ref());
            streamed += usize::from(plan.fetches_next_step());
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
        assert!(
            streamed >= 8,
            "{what}: {streamed} plans fetch the next head"
        );
    }
}

/// An executor on `plan`, loaded with `model.init_params(7)`, and its NVMe folder.
fn started(model: &Model, plan: &Plan) -> (Executor, tempfile::TempDir) {
    let nvme = tempfile::tempdir().unwrap();
    let config = ExecConfig {
        nvme_dirs: vec![nvme.path().to_path_buf()],
        ..ExecConfig::default()
    };
    let mut exec = Executor::on_cpu(model.clone(), plan.clone(), &config).unwrap();
    exec.load(&model.init_params(7), None).unwrap();
    (exec, nvme)
}

fn batches(model: &Model, shape: StepShape, step: u64) -> Vec<(Vec<u32>, Vec<u32>)> {
    (0..shape.grad_accum)
        .map(|k| {
            random_batch(
                model.vocab(),
                shape.batch * shape.seq,
                100 * step + k as u64,
            )
        })
        .collect()
}

/// `steps` steps from `exec`'s state, on batches of their own; the losses.
fn steps(exec: &mut Executor, model: &Model, from: u64, steps: u64) -> Vec<f32> {
    let shape = exec.plan().shape;
    (from..from + steps)
        .map(|t| {
            let data = batches(model, shape, t);
            let refs: Vec<(&[u32], &[u32])> = data.iter().map(|(a, b)| (&a[..], &b[..])).collect();
            exec.step(&refs, &adamw_clipped(0.0)).unwrap().loss
        })
        .collect()
}

fn ended(exec: &Executor, losses: Vec<f32>) -> Run {
    let (params, m, v) = exec.export().unwrap();
    Run {
        losses,
        params,
        m,
        v,
        link_bytes: Vec::new(),
        measured: exec.peak_measured(),
    }
}

#[test]
fn a_failed_step_or_a_load_fetches_the_head_anew() {
    let model = small_gpt2();
    let plan = plan(&model, StepShape::cpu(2, 8), &nvme_only(2));
    let (next, _) = next_step_ops(&plan);
    let (mut exec, _nvme) = started(&model, &plan);
    let losses = steps(&mut exec, &model, 0, 4);
    let reference = ended(&exec, losses);
    // Undisturbed: steps on batches 0 and 1, then a third on batch 1 again.
    let (mut undisturbed, _nvme2) = started(&model, &plan);
    steps(&mut undisturbed, &model, 0, 2);
    let after_two = undisturbed.export().unwrap();
    let again = steps(&mut undisturbed, &model, 1, 1)[0];
    // Step 1 fails at its last fetch for step 2, the one after every update's commit.
    let last = *next.last().unwrap();
    let (mut exec, _nvme) = started(&model, &plan);
    steps(&mut exec, &model, 0, 1);
    exec.fail_next_at(last, Fault::Error);
    let data = batches(&model, plan.shape, 1);
    let refs: Vec<(&[u32], &[u32])> = data.iter().map(|(a, b)| (&a[..], &b[..])).collect();
    assert!(exec.step(&refs, &adamw_clipped(0.0)).is_err());
    let failed = exec.export().unwrap();
    assert!(
        bits(&failed.0) == bits(&after_two.0),
        "every update committed before the failure"
    );
    // Its retry (its updates, applied already, are skipped) computes with the updated
    // parameters, the head fetched again.
    let retry = exec.step(&refs, &adamw_clipped(0.0)).unwrap().loss;
    assert_eq!(retry.to_bits(), again.to_bits(), "{retry} against {again}");
    // Parameters loaded between steps are the ones the next step computes with.
    let (mut exec, _nvme) = started(&model, &plan);
    steps(&mut exec, &model, 0, 2);
    exec.load(&model.init_params(7), None).unwrap();
    exec.set_steps(0);
    let losses = steps(&mut exec, &model, 0, 4);
    assert_same(&reference, &ended(&exec, losses), "loaded after 2 steps");
}
