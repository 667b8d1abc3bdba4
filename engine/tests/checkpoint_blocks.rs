//! Checkpoints written and read a block at a time, from and to the tiers the plan gives
//! each block's state (device, host, NVMe extents), on the CPU device: a resume is
//! bit-identical to an uninterrupted run under every policy, and a save or a load holds a
//! few blocks' state, never the model's. Alone in its process: a counting global
//! allocator measures the bytes held, and other tests would add theirs.

use std::path::Path;
use std::sync::atomic::Ordering;

use strata_engine::checkpoint::{self, TrainerState};
use strata_engine::exec::{ExecConfig, Executor, StepParams};
use strata_engine::kernels::adamw::AdamW;
use strata_engine::model::{Gpt2Config, Model, ModelError};
use strata_engine::plan::{NvmeOffload, Plan, PlanInput, Policy, StepShape, Tier};

mod model_support;
use model_support::{UNLIMITED, each_policy};

#[path = "../../tests/support/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::{LIVE_BYTES, PEAK_BYTES};

/// Held by every test of this file: the allocator's counts are the process's, so the
/// tests run one at a time.
static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn alone() -> std::sync::MutexGuard<'static, ()> {
    ALONE.lock().unwrap_or_else(|e| e.into_inner())
}

fn hyper() -> StepParams {
    StepParams {
        adam: AdamW {
            lr: 1e-3,
            weight_decay: 0.1,
            ..AdamW::default()
        },
        clip: 0.0,
        loss_scale: 1.0,
    }
}

/// An executor of `model` under `policy` (its NVMe extents in `nvme`), with the
/// parameters `init_block(b, 7)`.
fn executor(model: &Model, policy: &dyn Policy, shape: StepShape, nvme: &Path) -> Executor {
    let input = PlanInput {
        model,
        shape,
        budgets: UNLIMITED,
        cost: Default::default(),
    };
    let plan = Plan::build(&input, policy).unwrap();
    let config = ExecConfig {
        nvme_dirs: vec![nvme.to_path_buf()],
        ..ExecConfig::default()
    };
    let mut exec = Executor::on_cpu(model.clone(), plan, &config).unwrap();
    exec.load_blocks(&|b| Ok(model.init_block(b, 7))).unwrap();
    exec
}

/// Steps `from..to` of a run, each on its own batch.
fn steps(exec: &mut Executor, shape: StepShape, vocab: usize, from: u64, to: u64) {
    let n = shape.batch * shape.seq;
    for step in from..to {
        let tokens: Vec<u32> = (0..n as u64)
            .map(|i| ((i * 7 + step * 13) % vocab as u64) as u32)
            .collect();
        let targets: Vec<u32> = (0..n as u64)
            .map(|i| ((i * 11 + step * 5 + 1) % vocab as u64) as u32)
            .collect();
        exec.step(&[(&tokens[..], &targets[..])], &hyper()).unwrap();
    }
}

/// Saves `exec`'s state after `step` in `root` a block at a time.
fn save(exec: &Executor, root: &Path, step: u64) -> checkpoint::SaveReport {
    let state = TrainerState::after(step, step, 7);
    let mut read = |b: usize, put: &mut checkpoint::PutBlock<'_>| {
        exec.with_block_state(b, put)
            .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
    };
    checkpoint::save_blocks(root, exec.model(), &state, &mut read, 2).unwrap()
}

/// Loads the checkpoint `opened` into `exec` a block at a time.
fn load(exec: &mut Executor, opened: &checkpoint::Opened) {
    exec.load_state_blocks(&|b| {
        opened.block(b).map_err(|e| ModelError::Source {
            what: format!("block {b}"),
            source: Box::new(e),
        })
    })
    .unwrap();
    exec.set_steps(opened.state().step);
}

fn assert_same_state(what: &str, a: &Executor, b: &Executor) {
    let (a, b) = (a.export().unwrap(), b.export().unwrap());
    for (class, (x, y)) in [(&a.0, &b.0), (&a.1, &b.1), (&a.2, &b.2)]
        .into_iter()
        .enumerate()
    {
        for (block, (x, y)) in x.iter().zip(y).enumerate() {
            let same =
                x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(
                same,
                "{what}: class {class} (params, m, v) of block {block} differs"
            );
        }
    }
}

#[test]
fn resuming_a_block_at_a_time_is_bit_identical_under_every_policy() {
    let _alone = alone();
    let model = Model::new(Gpt2Config::new(3, 4, 64, 96, 32)).unwrap();
    let shape = StepShape::cpu(2, 16);
    for policy in each_policy() {
        let what = policy.name();
        let dir = tempfile::tempdir().unwrap();
        let (nvme_a, nvme_b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::create_dir_all(&nvme_a).unwrap();
        std::fs::create_dir_all(&nvme_b).unwrap();
        let root = dir.path().join("ck");
        let mut straight = executor(&model, policy.as_ref(), shape, &nvme_a);
        steps(&mut straight, shape, model.vocab(), 0, 2);
        let saved = save(&straight, &root, 2);
        // The checkpoint holds the state the executor exports whole.
        let ckpt = checkpoint::load(&saved.dir).unwrap();
        let (p, m, v) = straight.export().unwrap();
        assert!(
            [(&p, &ckpt.params), (&m, &ckpt.m), (&v, &ckpt.v)]
                .iter()
                .all(|(x, y)| x == y),
            "{what}: the checkpoint is not the executor's state"
        );
        // Files the safetensors crate (transformers' reader) takes.
        for file in ["model.safetensors", "optimizer.safetensors"] {
            let bytes = std::fs::read(saved.dir.join(file)).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let per_block: usize = model.blocks().iter().map(|b| b.tensors.len()).sum();
            let classes = if file == "model.safetensors" { 1 } else { 2 };
            assert_eq!(st.len(), classes * per_block, "{what}: {file}");
        }
        steps(&mut straight, shape, model.vocab(), 2, 4);

        let mut resumed = executor(&model, policy.as_ref(), shape, &nvme_b);
        load(&mut resumed, &checkpoint::open(&root).unwrap());
        steps(&mut resumed, shape, model.vocab(), 2, 4);
        assert_same_state(&what, &straight, &resumed);
    }
}

#[test]
fn a_failed_read_mid_save_keeps_the_previous_checkpoint_and_leaves_nothing() {
    let _alone = alone();
    let model = Model::new(Gpt2Config::new(3, 4, 64, 96, 32)).unwrap();
    let shape = StepShape::cpu(2, 16);
    let policy = NvmeOffload {
        depth: 2,
        checkpoints: Tier::Nvme,
    };
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ck");
    let nvme = dir.path().join("nvme");
    std::fs::create_dir_all(&nvme).unwrap();
    let mut exec = executor(&model, &policy, shape, &nvme);
    steps(&mut exec, shape, model.vocab(), 0, 1);
    let first = save(&exec, &root, 1).dir;
    let before = checkpoint::load(&first).unwrap();
    steps(&mut exec, shape, model.vocab(), 1, 2);
    for failing in 0..model.blocks().len() {
        let mut read = |b: usize, put: &mut checkpoint::PutBlock<'_>| {
            if b == failing {
                return Err("an injected read error".into());
            }
            exec.with_block_state(b, put)
                .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
        };
        let state = TrainerState::after(2, 2, 7);
        let e = checkpoint::save_blocks(&root, &model, &state, &mut read, 2).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains(&format!("block {failing}")) && text.contains("injected"),
            "{text}"
        );
        // Only the first checkpoint is there, loadable and unchanged.
        let names: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        assert_eq!(names, ["step-00000001"], "failing at block {failing}");
        let again = checkpoint::load(&root).unwrap();
        assert!(again.params == before.params && again.v == before.v);
    }
}

/// The bytes of one block's state: its master parameters, m and v.
fn block_state_bytes(model: &Model) -> usize {
    12 * model.blocks().iter().map(|b| b.len).max().unwrap()
}

#[test]
fn a_save_and_a_load_hold_a_few_blocks_state_not_the_model_s() {
    let _alone = alone();
    // 24 layers: the state is 25 times the largest block's.
    let model = Model::new(Gpt2Config::new(24, 4, 128, 96, 32)).unwrap();
    let shape = StepShape::cpu(1, 16);
    let whole = 12 * model.param_count();
    let block = block_state_bytes(&model);
    assert!(whole > 20 * block, "{whole} {block}");
    for policy in [
        Box::new(NvmeOffload {
            depth: 2,
            checkpoints: Tier::Nvme,
        }) as Box<dyn Policy>,
        Box::new(strata_engine::plan::CpuOffload),
    ] {
        let what = policy.name();
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("ck");
        let (nvme_a, nvme_b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::create_dir_all(&nvme_a).unwrap();
        std::fs::create_dir_all(&nvme_b).unwrap();
        let mut exec = executor(&model, policy.as_ref(), shape, &nvme_a);
        steps(&mut exec, shape, model.vocab(), 0, 1);

        // Saving: the block as the tier's read puts it (the NVMe read's buffer; nothing
        // for state in the host arena, which is lent) and the files' write buffers.
        let start = LIVE_BYTES.load(Ordering::Relaxed);
        PEAK_BYTES.store(start, Ordering::Relaxed);
        let report = save(&exec, &root, 1);
        let held = PEAK_BYTES.load(Ordering::Relaxed) - start;
        let bound = block + (4 << 20);
        println!(
            "{what}: saving held {held} bytes ({:.2} blocks)",
            held as f64 / block as f64
        );
        assert!(
            held <= bound,
            "{what}: saving held {held} bytes, over one block's state and the buffers, \
             {bound} (the whole state is {whole})"
        );
        assert_eq!(report.staged_bytes_max as usize, 2 << 20, "{what}");

        // Loading: the block read, the executor's staging of it, and an NVMe write's
        // buffer: measured 2.8 blocks under nvme-offload.
        let opened = checkpoint::open(&root).unwrap();
        let mut resumed = executor(&model, policy.as_ref(), shape, &nvme_b);
        let start = LIVE_BYTES.load(Ordering::Relaxed);
        PEAK_BYTES.store(start, Ordering::Relaxed);
        load(&mut resumed, &opened);
        let held = PEAK_BYTES.load(Ordering::Relaxed) - start;
        let bound = 3 * block + (4 << 20);
        assert!(
            held <= bound,
            "{what}: loading held {held} bytes, over three blocks' state, {bound} (the \
             whole state is {whole})"
        );
        assert_same_state(&what, &exec, &resumed);
    }
}
