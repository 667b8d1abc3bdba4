//! What the model tests share: the reference data's location, reading its tensors,
//! relative errors, a whole-model runner on a CPU device of a given instruction set and
//! thread count, and one forward and backward pass through a runner; for the executor's
//! tests, the chaos seeds, unlimited budgets and every built-in policy.
#![allow(dead_code)]

pub mod lora_golden;
pub mod training;

use std::collections::HashMap;
use std::path::PathBuf;

use strata_engine::device::{CpuDevice, CpuDeviceConfig, Device};
use strata_engine::exec::Runner;
use strata_engine::kernels::ops::Cpu;
use strata_engine::model::{Dtype, Model, Target};
use strata_engine::plan::{
    AllOnDevice, Budgets, CpuOffload, NvmeOffload, ParamOffload, PlanInput, Policy, Precision,
    Recompute, TensorClass, Tier,
};

/// `tests/data/gpt2-tiny` (see its README).
pub fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/gpt2-tiny")
}

/// `tests/data/NAME` (each folder's README says where it comes from).
pub fn data_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data")
        .join(name)
}

/// Every f64 tensor of a safetensors file, by name.
pub fn read_f64_tensors(path: &std::path::Path) -> HashMap<String, Vec<f64>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("a safetensors file");
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F64, "{name}");
            let data = view
                .data()
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (name, data)
        })
        .collect()
}

/// Every f32 tensor of a safetensors file, by name.
pub fn read_f32_tensors(path: &std::path::Path) -> HashMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("a safetensors file");
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let data = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (name, data)
        })
        .collect()
}

/// ‖got − want‖ / ‖want‖, in f64.
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        diff += (g as f64 - w as f64).powi(2);
        norm += (w as f64).powi(2);
    }
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// `model` on a CPU device of its own, sized for batches of `batch` × `seq`, whose
/// kernels use `cpu`'s instruction set and threads; fp32 throughout. Each layer's
/// backward recomputes its forward.
pub fn cpu_runner(model: &Model, batch: usize, seq: usize, cpu: Cpu) -> Runner {
    cpu_runner_recomputing(model, batch, seq, cpu, Recompute::All)
}

/// [`cpu_runner`], recomputing as `recompute` says: every layer's forward in its
/// backward ([`Recompute::All`]), or none, the backward reading the activations the
/// forward saved.
pub fn cpu_runner_recomputing(
    model: &Model,
    batch: usize,
    seq: usize,
    cpu: Cpu,
    recompute: Recompute,
) -> Runner {
    let bytes =
        Runner::device_bytes_recomputing(model, batch, seq, Target::Cpu, Dtype::F32, recompute)
            .unwrap();
    let device = CpuDevice::new(CpuDeviceConfig {
        memory_budget_bytes: bytes,
        cpu,
        ..CpuDeviceConfig::default()
    })
    .unwrap();
    Runner::new_recomputing(
        model.clone(),
        Device::Cpu(device),
        batch,
        seq,
        Precision::Fp32,
        recompute,
    )
    .unwrap()
}

/// Both ways a runner computes the backward: recomputing every layer's forward, and
/// reading the activations every layer's forward saved.
pub const RECOMPUTE: [Recompute; 2] = [Recompute::All, Recompute::None];

/// One forward and backward on `inputs` against `targets` through runners of `model`
/// loaded with `params` for batches of `batch` × `seq` on a CPU device of `cpu`'s, once
/// recomputing every layer's forward in the backward and once reading what the forward
/// saved; the two asserted bit-identical (`what` names the case), and the second
/// returned.
#[allow(clippy::too_many_arguments)]
pub fn forward_backward_both_ways(
    model: &Model,
    params: &[Vec<f32>],
    batch: usize,
    seq: usize,
    cpu: Cpu,
    inputs: &[u32],
    targets: &[u32],
    what: &str,
) -> PassOut {
    let [recomputed, saved] = RECOMPUTE.map(|recompute| {
        let mut runner = cpu_runner_recomputing(model, batch, seq, cpu, recompute);
        runner.load(params).unwrap();
        forward_backward(&mut runner, inputs, targets)
    });
    assert_same_pass(&recomputed, &saved, what);
    saved
}

/// Asserts that two passes gave the same loss, logits and gradients, bit for bit.
pub fn assert_same_pass(a: &PassOut, b: &PassOut, what: &str) {
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert!(bits(&a.logits) == bits(&b.logits), "{what}: logits");
    assert_same_gradients(&(a.loss, &a.grads), &(b.loss, &b.grads), what);
}

/// Asserts that two (loss, gradient per block) pairs are the same, bit for bit.
pub fn assert_same_gradients(a: &(f32, &Vec<Vec<f32>>), b: &(f32, &Vec<Vec<f32>>), what: &str) {
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(a.0.to_bits(), b.0.to_bits(), "{what}: loss");
    assert_eq!(a.1.len(), b.1.len(), "{what}: blocks");
    for (i, (x, y)) in a.1.iter().zip(b.1).enumerate() {
        assert!(bits(x) == bits(y), "{what}: gradients of block {i}");
    }
}

/// What one forward and backward pass gives.
pub struct PassOut {
    /// The mean loss.
    pub loss: f32,
    /// The logits (B × T × vocab), read after the forward.
    pub logits: Vec<f32>,
    /// The gradient of the mean loss, one f32 buffer per block.
    pub grads: Vec<Vec<f32>>,
}

/// One forward on `inputs` against `targets`, the logits, then the backward, on the
/// parameters `runner` holds.
pub fn forward_backward(runner: &mut Runner, inputs: &[u32], targets: &[u32]) -> PassOut {
    let loss = runner.forward(inputs, targets).unwrap();
    // The head's backward overwrites the logits with their gradient: read them first.
    let logits = runner
        .logits()
        .unwrap()
        .expect("GPT-2 keeps its logits in the scratch");
    let grads = runner.backward().unwrap();
    PassOut {
        loss,
        logits,
        grads,
    }
}

/// No chaos, then three seeds of it: the CPU device delays every stream operation, and
/// the executor every host operation, by a seeded random 0 to 2 ms, so that a dependency
/// missing from a plan shows as a wrong result or an ordering violation.
pub const CHAOS: [Option<u64>; 4] = [None, Some(1), Some(2), Some(3)];

/// Token ids below `vocab`, the same sequence for the same `seed` (a linear congruential
/// generator, its high bits).
pub fn token_ids(vocab: usize, seed: u64) -> impl FnMut() -> u32 {
    let mut x = seed;
    move || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((x >> 33) % vocab as u64) as u32
    }
}

/// `n` token ids and `n` target ids below `vocab`, the same for the same `seed`
/// ([`token_ids`]).
pub fn random_batch(vocab: usize, n: usize, seed: u64) -> (Vec<u32>, Vec<u32>) {
    let mut next = token_ids(vocab, seed);
    let t = (0..n).map(|_| next()).collect();
    let y = (0..n).map(|_| next()).collect();
    (t, y)
}

/// Budgets no plan reaches.
pub const UNLIMITED: Budgets = Budgets {
    device: u64::MAX / 4,
    host: u64::MAX / 4,
    nvme: u64::MAX / 4,
};

/// Each built-in policy once: all-on-device, cpu-offload, param-offload (depth 2,
/// checkpoints on the host) and nvme-offload (depth 2, checkpoints on NVMe).
pub fn each_policy() -> Vec<Box<dyn Policy>> {
    vec![
        Box::new(AllOnDevice),
        Box::new(CpuOffload),
        Box::new(ParamOffload {
            depth: 2,
            checkpoints: Tier::Host,
        }),
        Box::new(NvmeOffload {
            depth: 2,
            checkpoints: Tier::Nvme,
        }),
        Box::new(NvmeOnly(NvmeOffload {
            depth: 2,
            checkpoints: Tier::Host,
        })),
    ]
}

/// [`NvmeOffload`] with every block's parameters and optimizer state on NVMe: the plan
/// a tight host budget gets (with room, the built-in keeps the first and last blocks' in
/// host memory, `Policy::resident_edges`).
#[derive(Debug)]
pub struct NvmeOnly(pub NvmeOffload);

impl Policy for NvmeOnly {
    fn name(&self) -> String {
        format!("{}, all on NVMe", self.0.name())
    }
    fn home(&self, input: &PlanInput<'_>, block: usize, class: TensorClass) -> Tier {
        self.0.home(input, block, class)
    }
    fn prefetch_depth(&self, input: &PlanInput<'_>) -> usize {
        self.0.prefetch_depth(input)
    }
}

/// Every built-in policy at every prefetch depth from 1 to 4, with checkpoints on each
/// tier they support.
pub fn all_policies() -> Vec<Box<dyn Policy>> {
    let mut out: Vec<Box<dyn Policy>> = vec![Box::new(AllOnDevice), Box::new(CpuOffload)];
    for depth in 1..=4 {
        for checkpoints in [Tier::Device, Tier::Host] {
            out.push(Box::new(ParamOffload { depth, checkpoints }));
        }
        for checkpoints in [Tier::Host, Tier::Nvme] {
            out.push(Box::new(NvmeOffload { depth, checkpoints }));
        }
        out.push(Box::new(NvmeOnly(NvmeOffload {
            depth,
            checkpoints: Tier::Nvme,
        })));
    }
    out
}

/// The resident bytes of this process's mappings of `path` (/proc/self/smaps).
pub fn resident_bytes_of(path: &std::path::Path) -> u64 {
    let path = path.canonicalize().unwrap();
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut total = 0;
    let mut ours = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            ours = line.ends_with(path.to_str().unwrap());
        } else if ours && line.starts_with("Rss:") {
            let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
            total += kib * 1024;
        }
    }
    total
}
