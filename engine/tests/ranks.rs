//! The invariant of ZeRO-3 data parallelism: N ranks, each owning a shard of every
//! block's parameters, gradients and optimizer state, give bit-identical master
//! parameters, m and v to one process running all of their micro-batches with N-fold
//! gradient accumulation. Rank r takes micro-batches r, r + N, ... of each step.
//!
//! The ranks here are threads of one process (`strata_comm::ThreadGroup`), each with its
//! own CPU device and executor, so the test needs no MPI; the collectives have the fixed
//! summation order every transport shares (`strata-comm`'s tests hold MPI to it).

use std::sync::Arc;
use std::time::Duration;

use strata_comm::{Collective, ThreadGroup};
use strata_engine::exec::{ExecConfig, ExecError, Executor, Fault, StepParams, TrainingState};
use strata_engine::kernels::adamw::AdamW;
use strata_engine::model::{Gpt2Config, Model, ModelError, OptimizerState};
use strata_engine::plan::{
    AllOnDevice, CpuOffload, HostOp, NvmeOffload, OpId, OpKind, Plan, PlanInput, Policy, Precision,
    Schedule, StepShape, Tier,
};

mod model_support;
use model_support::{CHAOS, UNLIMITED, each_policy};

/// Three blocks' worth of parameters at least a few statistics pieces long, so shards
/// split tensors in the middle and the last rank's shard is mostly padding.
fn model() -> Model {
    Model::new(Gpt2Config::new(2, 4, 128, 512, 64)).unwrap()
}

const BATCH: usize = 2;
const SEQ: usize = 32;

/// Micro-batch `i` of step `s`: tokens and targets, every few targets masked out so that
/// micro-batches count different numbers of targets.
fn micro(s: usize, i: usize) -> (Vec<u32>, Vec<u32>) {
    let n = BATCH * SEQ;
    let seed = (s * 31 + i * 7) as u32;
    let tokens = (0..n as u32).map(|j| (j * 11 + seed * 5) % 512).collect();
    let targets = (0..n as u32)
        .map(|j| {
            if (j + seed).is_multiple_of(9) {
                strata_engine::model::IGNORE_TARGET
            } else {
                (j * 13 + seed + 1) % 512
            }
        })
        .collect();
    (tokens, targets)
}

fn params(clip: f64) -> StepParams {
    StepParams {
        adam: AdamW {
            lr: 1e-2,
            ..AdamW::default()
        },
        clip,
        loss_scale: 1.0,
    }
}

/// What a run ends with: the state, and each step's loss and norm.
type Outcome = (TrainingState, Vec<(u32, u64)>);

/// `steps` steps of `shape` (ranks and grad-accum as given) of `policy` on this rank,
/// micro-batch k of a step being the step's k * ranks + rank.
fn run(
    policy: &dyn Policy,
    shape: StepShape,
    comm: Option<Arc<dyn Collective>>,
    steps: usize,
    clip: f64,
    chaos: Option<u64>,
) -> Result<Outcome, ExecError> {
    let model = model();
    let input = PlanInput::new(&model, shape, UNLIMITED);
    let plan = Plan::build(&input, policy).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (rank, ranks) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.size()));
    let config = ExecConfig {
        nvme_dirs: vec![dir.path().into()],
        chaos,
        comm,
        // Memory nothing wrote is NaN: the gradients' padding must be zeroed to be sent.
        poison_host: true,
        ..ExecConfig::default()
    };
    let mut exec = Executor::on_cpu(model.clone(), plan, &config)?;
    exec.load(&model.init_params(3), None)?;
    let mut seen = Vec::new();
    for s in 0..steps {
        let data: Vec<_> = (0..shape.grad_accum)
            .map(|k| micro(s, k * ranks + rank))
            .collect();
        let batches: Vec<_> = data.iter().map(|(t, y)| (&t[..], &y[..])).collect();
        let report = exec.step(&batches, &params(clip))?;
        seen.push((report.loss.to_bits(), report.grad_norm.to_bits()));
    }
    if let Some(report) = exec.flush(&params(clip))? {
        seen.push((report.loss.to_bits(), report.grad_norm.to_bits()));
    }
    Ok((exec.export()?, seen))
}

/// Every rank's outcome, run on threads of one group.
fn run_ranks(
    policy: &dyn Policy,
    shape: StepShape,
    ranks: usize,
    steps: usize,
    clip: f64,
    chaos: Option<u64>,
) -> Vec<Result<Outcome, ExecError>> {
    let group = ThreadGroup::new(ranks, Duration::from_secs(60));
    std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .map(|g| {
                let comm: Arc<dyn Collective> = Arc::new(g);
                s.spawn(move || {
                    run(
                        policy,
                        shape.with_ranks(ranks),
                        Some(comm),
                        steps,
                        clip,
                        chaos,
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn assert_same_state(a: &TrainingState, b: &TrainingState, what: &str) {
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for (class, (x, y)) in [(&a.0, &b.0), (&a.1, &b.1), (&a.2, &b.2)]
        .into_iter()
        .enumerate()
    {
        assert_eq!(x.len(), y.len());
        for (blk, (p, q)) in x.iter().zip(y).enumerate() {
            assert!(
                bits(p) == bits(q),
                "{what}: {} of block {blk} differ",
                ["master parameters", "m", "v"][class]
            );
        }
    }
}

/// Every built-in policy: all-on-device (the state's shard on the device, its
/// collectives staged through the host), cpu-offload, parameters streamed from the host,
/// and on NVMe (fp32: fetched from the master copy's head).
fn policies() -> Vec<Box<dyn Policy>> {
    each_policy()
}

fn check(policy: &dyn Policy, shape: StepShape, ranks: usize, clip: f64, chaos: Option<u64>) {
    let steps = 3;
    // One process runs its micro-batches horizontally, whatever order the ranks take.
    let alone = StepShape {
        grad_accum: shape.grad_accum * ranks,
        ..shape.scheduled(Schedule::Horizontal)
    };
    let (want, want_seen) = run(policy, alone, None, steps, clip, None).unwrap();
    let what = format!(
        "{} with {ranks} ranks, grad-accum {} ({}), {:?}, clip {clip}, delayed {}, chaos {chaos:?}",
        policy.name(),
        shape.grad_accum,
        shape.schedule,
        shape.precision,
        shape.delayed_update
    );
    for (rank, got) in run_ranks(policy, shape, ranks, steps, clip, chaos)
        .into_iter()
        .enumerate()
    {
        let (state, seen) = got.unwrap_or_else(|e| panic!("{what}: rank {rank}: {e}"));
        assert_same_state(&state, &want, &format!("{what}, rank {rank}"));
        // The loss is every rank's, and the norm the step's: the same bits as alone.
        assert_eq!(seen, want_seen, "{what}, rank {rank}: losses and norms");
    }
}

#[test]
fn two_and_three_ranks_equal_one_process_with_their_micro_batches() {
    let shape = StepShape {
        needs_global_norm: true,
        ..StepShape::cpu(BATCH, SEQ)
    };
    for policy in policies() {
        for ranks in [2, 3] {
            check(policy.as_ref(), shape, ranks, 1.0, None);
        }
    }
    // All-on-device with its collectives staged through host memory (a GPU without
    // NCCL) rather than over device memory.
    for ranks in [2, 3] {
        check(
            &AllOnDevice,
            shape.with_device_collectives(false),
            ranks,
            1.0,
            None,
        );
    }
}

#[test]
fn ranks_with_accumulation_clipping_off_and_chaos() {
    let base = StepShape::cpu(BATCH, SEQ);
    let accum = StepShape {
        grad_accum: 2,
        ..base
    };
    for policy in policies() {
        // Two micro-batches per rank: the sums interleave ranks, as one process's do;
        // in either order of the micro-batches through the blocks.
        check(policy.as_ref(), accum, 2, 0.0, None);
        check(
            policy.as_ref(),
            accum.scheduled(Schedule::Vertical),
            2,
            0.0,
            None,
        );
        // The norm is still global (computed by every rank) when nothing clips.
        check(policy.as_ref(), base, 3, 0.0, None);
    }
    for &chaos in &CHAOS[1..] {
        check(
            &NvmeOffload {
                depth: 1,
                checkpoints: Tier::Host,
            },
            StepShape {
                needs_global_norm: true,
                ..accum
            },
            2,
            0.5,
            chaos,
        );
        // Collectives over the device's memory beside its streams.
        check(&AllOnDevice, accum.clipped(), 2, 0.5, chaos);
    }
}

#[test]
fn ranks_with_bf16_and_a_delayed_update() {
    let bf16 = StepShape {
        precision: Precision::Bf16,
        needs_global_norm: true,
        ..StepShape::cpu(BATCH, SEQ)
    };
    for policy in policies() {
        check(policy.as_ref(), bf16, 2, 1.0, None);
        check(
            policy.as_ref(),
            StepShape::cpu(BATCH, SEQ).clipped().delayed(),
            2,
            1.0,
            None,
        );
    }
}

/// bf16 moments are elementwise, so ranks give one process's bits; 8-bit moments have
/// a scale per block of each tensor's part of a shard, so where a shard cuts a tensor
/// the blocks differ from one process's: every rank still ends with the same state, and
/// the parameters stay near one process's.
#[test]
fn ranks_with_compact_moments() {
    let shape = StepShape::cpu(BATCH, SEQ).clipped();
    let host_or_nvme: [Box<dyn Policy>; 2] = [
        Box::new(CpuOffload),
        Box::new(NvmeOffload {
            depth: 2,
            checkpoints: Tier::Host,
        }),
    ];
    for policy in &host_or_nvme {
        for ranks in [2, 3] {
            check(
                policy.as_ref(),
                shape.with_state(OptimizerState::Bf16),
                ranks,
                1.0,
                None,
            );
        }
        let q8 = shape.with_state(OptimizerState::Q8);
        let alone = StepShape {
            grad_accum: 2,
            ..q8
        };
        let (want, _) = run(policy.as_ref(), alone, None, 3, 1.0, None).unwrap();
        let got: Vec<Outcome> = run_ranks(policy.as_ref(), q8, 2, 3, 1.0, None)
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let what = format!("{} with 2 ranks, q8 moments", policy.name());
        assert_same_state(&got[0].0, &got[1].0, &what);
        assert_eq!(got[0].1, got[1].1, "{what}: losses and norms");
        for (p, q) in got[0].0.0.iter().flatten().zip(want.0.iter().flatten()) {
            assert!(
                (p - q).abs() <= 1e-4 * q.abs().max(1e-2),
                "{what}: {p} against {q}"
            );
        }
    }
}

#[test]
fn a_rank_that_fails_ends_every_rank_with_an_error_naming_it() {
    let group = ThreadGroup::new(2, Duration::from_secs(60));
    let model = model();
    let shape = StepShape::cpu(BATCH, SEQ).clipped().with_ranks(2);
    let policy = CpuOffload;
    let started = std::time::Instant::now();
    let results: Vec<Result<(), ExecError>> = std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .map(|g| {
                let model = model.clone();
                let policy = &policy;
                s.spawn(move || {
                    let rank = g.rank();
                    let plan =
                        Plan::build(&PlanInput::new(&model, shape, UNLIMITED), policy).unwrap();
                    // Rank 1's CPU AdamW of block 1 panics, as a bug in it would.
                    let adamw_1 = (0..plan.ops.len())
                        .map(OpId::of)
                        .find(|&id| {
                            matches!(
                                plan.op(id).kind,
                                OpKind::Host(HostOp::Optimizer { block: 1, .. })
                            )
                        })
                        .expect("block 1's CPU update");
                    let config = ExecConfig {
                        comm: Some(Arc::new(g)),
                        ..ExecConfig::default()
                    };
                    let mut exec = Executor::on_cpu(model.clone(), plan, &config)?;
                    exec.load(&model.init_params(3), None)?;
                    if rank == 1 {
                        exec.fail_next_at(adamw_1, Fault::Panic);
                    }
                    let (t, y) = micro(0, rank);
                    exec.step(&[(&t, &y)], &params(1.0)).map(|_| ())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Well before the group's 60 s timeout: the failing rank aborted the group.
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    let e1 = results[1].as_ref().unwrap_err().to_string();
    assert!(e1.contains("adamw 1") && e1.contains("panicked"), "{e1}");
    let e0 = results[0].as_ref().unwrap_err().to_string();
    assert!(e0.contains("rank 1"), "rank 0 should name rank 1: {e0}");
}

/// Steps `from..to` of `exec` (rank `rank` of `ranks`, `accum` micro-batches each).
fn steps(exec: &mut Executor, from: usize, to: usize, rank: usize, ranks: usize, accum: usize) {
    for s in from..to {
        let data: Vec<_> = (0..accum).map(|k| micro(s, k * ranks + rank)).collect();
        let batches: Vec<_> = data.iter().map(|(t, y)| (&t[..], &y[..])).collect();
        exec.step(&batches, &params(1.0)).unwrap();
    }
}

/// A fresh executor of `policy` for `ranks` ranks (this one `comm`'s), its NVMe in `dir`.
fn executor(
    policy: &dyn Policy,
    ranks: usize,
    accum: usize,
    comm: Option<Arc<dyn Collective>>,
    dir: &std::path::Path,
) -> Executor {
    let model = model();
    let shape = StepShape {
        grad_accum: accum,
        ..StepShape::cpu(BATCH, SEQ).clipped().with_ranks(ranks)
    };
    let plan = Plan::build(&PlanInput::new(&model, shape, UNLIMITED), policy).unwrap();
    let config = ExecConfig {
        nvme_dirs: vec![dir.into()],
        comm,
        poison_host: true,
        ..ExecConfig::default()
    };
    Executor::on_cpu(model, plan, &config).unwrap()
}

/// A sharded checkpoint (each rank writes its own shard a block at a time, lent from
/// its tier; no rank holds the whole state, or its whole shard) resumes bit for bit: by
/// the same number of ranks, each reading its own shard a block at a time, and whole by
/// one process with the ranks' micro-batches, as `strata checkpoint export` and a resume
/// by another number of ranks read it. Rank 0 reads whole blocks, in any order, while
/// the other ranks serve their shards (as `--out` and `--eval-every` do).
#[test]
fn a_sharded_checkpoint_resumes_bit_identically() {
    use strata_engine::checkpoint::{self, PutBlock, TrainerState};
    let (saved_at, total, ranks) = (2, 4, 2);
    for policy in [
        Box::new(AllOnDevice) as Box<dyn Policy>,
        Box::new(CpuOffload),
        Box::new(NvmeOffload {
            depth: 1,
            checkpoints: Tier::Host,
        }),
    ] {
        let policy = policy.as_ref();
        let root = tempfile::tempdir().unwrap();
        let root = root.path();
        // Per rank: (the state when saved, after all steps straight on, after all steps
        // resumed from its shard).
        let outcomes: Vec<(TrainingState, TrainingState, TrainingState)> =
            std::thread::scope(|s| {
                let group = ThreadGroup::new(ranks, Duration::from_secs(60));
                let handles: Vec<_> = group
                    .into_iter()
                    .map(|g| {
                        s.spawn(move || {
                            let rank = g.rank();
                            let comm: Arc<dyn Collective> = Arc::new(g);
                            let nvme = tempfile::tempdir().unwrap();
                            let model = model();
                            let mut exec =
                                executor(policy, ranks, 1, Some(comm.clone()), nvme.path());
                            exec.load(&model.init_params(3), None).unwrap();
                            steps(&mut exec, 0, saved_at, rank, ranks, 1);
                            let shard_len: Vec<usize> =
                                (0..model.blocks().len()).map(|b| exec.shard(b).1).collect();
                            let mut read = |b: usize, put: &mut PutBlock<'_>| {
                                exec.with_shard_state(b, put).map_err(|e| {
                                    Box::new(e) as Box<dyn std::error::Error + Send + Sync>
                                })
                            };
                            checkpoint::save_sharded_blocks(
                                root,
                                comm.as_ref(),
                                &model,
                                &shard_len,
                                &TrainerState::after(saved_at as u64, 0, 0),
                                &mut read,
                                2,
                            )
                            .unwrap();
                            let at_save = exec.export().unwrap();
                            // Rank 0 asks for blocks out of order and twice; each is the
                            // whole block of the gathered state.
                            let last = model.blocks().len() - 1;
                            let asked = exec
                                .with_whole_blocks(|read| {
                                    [last, 0, last, 1].map(|b| (b, read(b).unwrap()))
                                })
                                .unwrap();
                            assert_eq!(asked.is_some(), rank == 0);
                            for (b, got) in asked.into_iter().flatten() {
                                assert_eq!(got, at_save.0[b], "block {b} read by rank 0");
                            }
                            steps(&mut exec, saved_at, total, rank, ranks, 1);
                            let straight = exec.export().unwrap();
                            drop(exec);

                            let mut again =
                                executor(policy, ranks, 1, Some(comm.clone()), nvme.path());
                            let back = checkpoint::open_shard(root, rank, ranks).unwrap();
                            assert_eq!(back.state().step, saved_at as u64);
                            assert!(back.own_shard_len().is_some());
                            again
                                .load_shard_blocks(&|b| {
                                    back.block(b).map_err(|e| ModelError::Source {
                                        what: format!("block {b}"),
                                        source: Box::new(e),
                                    })
                                })
                                .unwrap();
                            again.set_steps(saved_at as u64);
                            steps(&mut again, saved_at, total, rank, ranks, 1);
                            (at_save, straight, again.export().unwrap())
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
        let name = policy.name();
        let dir = root.join(checkpoint::dir_name(saved_at as u64));
        assert_eq!(checkpoint::written_by_ranks(&dir).unwrap(), Some(ranks));
        for r in 0..ranks {
            assert!(dir.join(checkpoint::shard_file(r, ranks)).is_file());
        }
        for (rank, (_, straight, resumed)) in outcomes.iter().enumerate() {
            assert_same_state(resumed, straight, &format!("{name}: rank {rank} resumed"));
        }
        // Whole: the shards put together are the state when saved, and one process
        // resuming from them with both ranks' micro-batches ends as the ranks did.
        let whole = checkpoint::load(root).unwrap();
        let (at_save, straight, _) = &outcomes[0];
        assert_same_state(
            &(whole.params.clone(), whole.m.clone(), whole.v.clone()),
            at_save,
            &format!("{name}: the checkpoint loaded whole"),
        );
        let nvme = tempfile::tempdir().unwrap();
        let mut alone = executor(policy, 1, ranks, None, nvme.path());
        alone
            .load(&whole.params, Some((&whole.m, &whole.v)))
            .unwrap();
        alone.set_steps(saved_at as u64);
        steps(&mut alone, saved_at, total, 0, 1, ranks);
        assert_same_state(
            &alone.export().unwrap(),
            straight,
            &format!("{name}: one process resumed from the shards"),
        );
        // Another number of ranks may not read the shards as its own.
        let err = checkpoint::load_shard(root, 0, 3).unwrap_err().to_string();
        assert!(err.contains("written by 2 ranks"), "{err}");
    }
}

/// Rank `rank`'s shard of a made-up state of [`model`] for `ranks` ranks at `step`.
fn made_up_shard(rank: usize, ranks: usize, step: u64) -> strata_engine::checkpoint::Shard {
    let model = model();
    let shard_len: Vec<usize> = model
        .blocks()
        .iter()
        .map(|b| strata_engine::plan::shard_len(b.len, ranks))
        .collect();
    let fill = |salt: f32| -> Vec<Vec<f32>> {
        shard_len
            .iter()
            .zip(model.blocks())
            .map(|(&s, b)| {
                (0..s)
                    .map(|i| {
                        let at = rank * s + i;
                        if at < b.len { salt + at as f32 } else { 0.0 }
                    })
                    .collect()
            })
            .collect()
    };
    strata_engine::checkpoint::Shard {
        model: model.clone(),
        ranks,
        rank,
        params: fill(step as f32),
        m: fill(0.5),
        v: fill(0.25),
        shard_len,
        state: strata_engine::checkpoint::TrainerState::after(step, 7, 1),
    }
}

/// Each rank's `save_sharded` of `shards(rank)` into `root`, on threads of one group.
fn save_on_ranks(
    root: &std::path::Path,
    ranks: usize,
    shards: impl Fn(usize) -> strata_engine::checkpoint::Shard + Sync,
) -> Vec<Result<std::path::PathBuf, strata_engine::checkpoint::CheckpointError>> {
    std::thread::scope(|s| {
        let shards = &shards;
        let handles: Vec<_> = ThreadGroup::new(ranks, Duration::from_secs(60))
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    strata_engine::checkpoint::save_sharded(root, &g, &shards(g.rank()), 3)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A rank whose shard cannot be saved fails the save on every rank (naming it), and the
/// previous checkpoint stays the latest; a damaged shard is refused by the rank that
/// reads it, naming the file.
#[test]
fn a_sharded_save_fails_whole_and_a_damaged_shard_is_refused() {
    use strata_engine::checkpoint;
    let root = tempfile::tempdir().unwrap();
    let root = root.path();
    for r in save_on_ranks(root, 3, |rank| made_up_shard(rank, 3, 1)) {
        r.unwrap();
    }
    let results = save_on_ranks(root, 3, |rank| {
        let mut shard = made_up_shard(rank, 3, 2);
        if rank == 2 {
            shard.m[0].pop(); // not the layout's length
        }
        shard
    });
    for (rank, r) in results.iter().enumerate() {
        let text = r.as_ref().unwrap_err().to_string();
        if rank == 2 {
            assert!(text.contains("m shard"), "{text}");
        } else {
            assert!(text.contains("rank 2") && text.contains("step 2"), "{text}");
        }
    }
    assert_eq!(
        checkpoint::list(root).unwrap().len(),
        1,
        "nothing of step 2 is published"
    );
    let whole = checkpoint::load(root).unwrap();
    assert_eq!(whole.state.step, 1);
    for (b, block) in whole.model.blocks().iter().enumerate() {
        // The ranks' shards, put together in rank order.
        let want: Vec<f32> = (0..block.len).map(|i| 1.0 + i as f32).collect();
        assert_eq!(whole.params[b], want, "block {b}");
    }

    // A byte of rank 1's file flipped: rank 1 refuses it; rank 0 checks only its length.
    let dir = root.join(checkpoint::dir_name(1));
    let file = dir.join(checkpoint::shard_file(1, 3));
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() - 5;
    bytes[at] ^= 1;
    std::fs::write(&file, &bytes).unwrap();
    let text = checkpoint::load_shard(root, 1, 3).unwrap_err().to_string();
    assert!(
        text.contains("shard-00002-of-00003.safetensors") && text.contains("crc32c"),
        "{text}"
    );
    checkpoint::load_shard(root, 0, 3).unwrap();
    let text = checkpoint::load(root).err().unwrap().to_string();
    assert!(text.contains("crc32c"), "{text}");
}
