//! Training through the executor on the CPU device, for the tests that compare runs bit
//! for bit: a few steps of a plan on fixed micro-batches, and the state exported after.

use strata_engine::exec::{ExecConfig, Executor, StepParams};
use strata_engine::kernels::adamw::AdamW;
use strata_engine::model::{Gpt2Config, Model};
use strata_engine::plan::{Plan, PlanInput, Policy, Precision, Recompute, Schedule, StepShape};

use super::{UNLIMITED, random_batch};

/// A 3-layer GPT-2 of width 48 (4 heads, vocabulary 96, context 32): small enough to
/// train under every policy, chaos seed and case in a test.
pub fn small_gpt2() -> Model {
    Model::new(Gpt2Config::new(3, 4, 48, 96, 32)).unwrap()
}

/// A step of 2 x 8 on the CPU device that waits for the global gradient norm (clipping).
pub fn clipped_step() -> StepShape {
    StepShape {
        needs_global_norm: true,
        ..StepShape::cpu(2, 8)
    }
}

/// A clipped step of 2 x 8 (the global norm: a LoRA model's covers its adapters'
/// gradients alone) in the shapes the LoRA tests train alike under every plan, by name:
/// bf16 (on the CPU device a device home's new adapters are staged on the host and
/// copied past the base, converted), kept, recomputed, offloaded, and two micro-batches
/// horizontally and vertically.
pub fn clipped_shapes() -> [(&'static str, StepShape); 6] {
    let one = clipped_step();
    let two = StepShape {
        grad_accum: 2,
        ..one
    };
    let bf16 = StepShape {
        precision: Precision::Bf16,
        ..one
    };
    [
        ("bf16, kept", bf16.recomputing(Recompute::None)),
        ("kept", one.recomputing(Recompute::None)),
        ("recomputed", one.recomputing(Recompute::All)),
        ("offloaded", one.recomputing(Recompute::Offload)),
        (
            "2 horizontal",
            two.scheduled(Schedule::Horizontal)
                .recomputing(Recompute::All),
        ),
        (
            "2 vertical, offloaded",
            two.scheduled(Schedule::Vertical)
                .recomputing(Recompute::Offload),
        ),
    ]
}

/// AdamW at lr 1e-2 with weight decay 0.1, clipping at `clip` (0: none), no loss scale.
pub fn adamw_clipped(clip: f64) -> StepParams {
    StepParams {
        adam: AdamW {
            lr: 1e-2,
            weight_decay: 0.1,
            ..AdamW::default()
        },
        clip,
        loss_scale: 1.0,
    }
}

/// What a run ends with, and what its steps moved.
pub struct Run {
    pub losses: Vec<f32>,
    pub params: Vec<Vec<f32>>,
    pub m: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
    /// Per step: bytes over NVMe read, NVMe write, H2D and D2H, as counted where they
    /// moved.
    pub link_bytes: Vec<[u64; 4]>,
    /// The executor's measured peak per tier.
    pub measured: [u64; 3],
}

/// `steps` steps of `shape` under `policy` (within unlimited budgets) from
/// `model.init_params(7)`, each on the same micro-batches; the state exported at the end.
pub fn train(
    model: &Model,
    shape: StepShape,
    policy: &dyn Policy,
    steps: usize,
    step_params: StepParams,
    chaos: Option<u64>,
) -> Run {
    let input = PlanInput::new(model, shape, UNLIMITED);
    let plan = Plan::build(&input, policy).unwrap();
    train_plan(model, plan, steps, step_params, chaos)
}

/// [`train`] of a plan made already.
pub fn train_plan(
    model: &Model,
    plan: Plan,
    steps: usize,
    step_params: StepParams,
    chaos: Option<u64>,
) -> Run {
    train_from(
        model,
        plan,
        &model.init_params(7),
        steps,
        step_params,
        chaos,
    )
}

/// [`train_plan`] from the parameters `start`.
pub fn train_from(
    model: &Model,
    plan: Plan,
    start: &[Vec<f32>],
    steps: usize,
    step_params: StepParams,
    chaos: Option<u64>,
) -> Run {
    let shape = plan.shape;
    let nvme = tempfile::tempdir().unwrap();
    let config = ExecConfig {
        nvme_dirs: vec![nvme.path().to_path_buf()],
        chaos,
        ..ExecConfig::default()
    };
    let mut exec = Executor::on_cpu(model.clone(), plan, &config).unwrap();
    exec.load(start, None).unwrap();
    let data: Vec<_> = (0..shape.grad_accum)
        .map(|k| random_batch(model.vocab(), shape.batch * shape.seq, 11 + k as u64))
        .collect();
    let refs: Vec<(&[u32], &[u32])> = data.iter().map(|(t, y)| (&t[..], &y[..])).collect();
    let (mut losses, mut link_bytes) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let report = exec.step(&refs, &step_params).unwrap();
        losses.push(report.loss);
        link_bytes.push(report.link_bytes);
    }
    exec.flush(&step_params).unwrap();
    let measured = exec.peak_measured();
    let (params, m, v) = exec.export().unwrap();
    Run {
        losses,
        params,
        m,
        v,
        link_bytes,
        measured,
    }
}

/// Each value's bits, block by block.
pub fn bits(x: &[Vec<f32>]) -> Vec<Vec<u32>> {
    x.iter()
        .map(|b| b.iter().map(|v| v.to_bits()).collect())
        .collect()
}

/// Asserts two runs' losses, parameters and moments equal bit for bit.
pub fn assert_same(a: &Run, b: &Run, what: &str) {
    assert_eq!(a.losses, b.losses, "{what}: losses");
    assert!(bits(&a.params) == bits(&b.params), "{what}: parameters");
    assert!(bits(&a.m) == bits(&b.m), "{what}: m");
    assert!(bits(&a.v) == bits(&b.v), "{what}: v");
}
