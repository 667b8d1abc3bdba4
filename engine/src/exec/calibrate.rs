//! A short measurement of this machine's rates at start, for the cost model: the
//! device's compute (a one-layer model's forward, on the device the run will use), its
//! copies between the pinned host arena and device memory, the CPU AdamW, and the NVMe
//! tier's reads and writes ([`calibrate`]); with ranks, the group's all-gather
//! ([`CostModel::calibrate_collective`], a collective every rank calls). About half a
//! second; sizes are capped so a 13B model's shape costs no more.
//!
//! Not here: the cost model the rates feed (`plan::CostModel`).

use std::path::Path;
use std::time::Instant;

use strata_comm::Collective;
use strata_kernels::adamw::{AdamStep, AdamW, CopyOut, Grads, State};
use strata_kernels::isa::Isa;
use strata_storage::{AlignedBuf, StoreConfig, TensorStore};

use super::{ExecError, Runner};
use crate::device::{Device, DeviceChoice, DeviceConfig, DeviceRange, select};
use crate::error::EngineError;
use crate::memory::{ARENA_ALIGN, HostArena, HostRange};
use crate::model::{Dtype, Gpt2Config, Model, Pass, Target};
use crate::plan::{CostModel, Precision};

/// The best of `runs` timings of `f`, in seconds.
fn best_of(runs: usize, mut f: impl FnMut() -> Result<(), ExecError>) -> Result<f64, ExecError> {
    let mut best = f64::INFINITY;
    for _ in 0..runs {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Measures the rates of `target`'s device for steps of `model`'s width and `batch` ×
/// `seq` tokens, with the NVMe tier in `nvme_dir` (skipped, keeping the defaults' NVMe
/// rates, when `None`).
pub fn calibrate(
    model: &Model,
    batch: usize,
    seq: usize,
    target: Target,
    nvme_dir: Option<&Path>,
) -> Result<CostModel, ExecError> {
    let mut cost = CostModel::default();
    device_rates(model, batch, seq, target, &mut cost)?;
    cost.adam_params_per_s = adam_params_per_s()?;
    if let Some(dir) = nvme_dir {
        nvme_rates(dir, &mut cost)?;
    }
    cost.source = "measured at start";
    Ok(cost)
}

/// The device's compute and copy rates into `cost`: the forward of a one-layer model of
/// `model`'s width (at most 1024 wide and 512 rows), its FLOPs counted from its programs,
/// and 64 MiB copied each way between the pinned host arena and device memory.
fn device_rates(
    model: &Model,
    batch: usize,
    seq: usize,
    target: Target,
    cost: &mut CostModel,
) -> Result<(), ExecError> {
    let model_err = ExecError::Model;
    let width = model.width().min(1024);
    let heads = (1..=width.min(64))
        .rev()
        .find(|h| width.is_multiple_of(*h) && width / h >= 16)
        .unwrap_or(1);
    let seq = seq.min(512);
    let batch = batch.clamp(1, (512 / seq).max(1));
    let small = Model::new(Gpt2Config::new(1, heads, width, 256, seq)).map_err(model_err)?;
    let shape = small.shape(batch, seq).map_err(model_err)?;
    let flops: f64 = (0..small.blocks().len())
        .map(|b| small.flops(b, Pass::Forward, shape))
        .sum();
    let copy_bytes = 64 << 20;
    let (dtype, precision) = if target == Target::Cpu {
        (Dtype::F32, Precision::Fp32)
    } else {
        (Dtype::Bf16, Precision::Bf16)
    };
    let budget = Runner::device_bytes(&small, batch, seq, target, dtype).map_err(model_err)?;
    let choice = match target {
        Target::Cpu => DeviceChoice::Cpu,
        Target::Cuda => DeviceChoice::Cuda,
    };
    let config = DeviceConfig {
        memory_budget_bytes: budget + copy_bytes + ARENA_ALIGN,
        cuda_ordinal: 0,
        cuda_needs_kernels: true,
    };
    let (device, _) = select(choice, &config).map_err(device_err)?;
    let (h2d, d2h) = copy_seconds(&device, copy_bytes)?;
    cost.h2d_bytes_per_s = copy_bytes as f64 / h2d;
    cost.d2h_bytes_per_s = copy_bytes as f64 / d2h;
    // Made after the copies' buffers are freed and dropped once loaded: the process's
    // memory overhead (the CLI's `PROCESS_OVERHEAD_BYTES`) counts the largest of these
    // moments, not their sum.
    let params = small.init_params(1);
    let mut runner = Runner::new(small, device, batch, seq, precision).map_err(model_err)?;
    runner.load(&params).map_err(model_err)?;
    drop(params);
    let tokens: Vec<u32> = (0..batch * seq).map(|i| (i % 256) as u32).collect();
    let seconds = best_of(3, || {
        runner
            .forward(&tokens, &tokens)
            .map(drop)
            .map_err(model_err)
    })?;
    cost.compute_flops = flops / seconds;
    Ok(())
}

/// A device error while calibrating.
fn device_err(source: EngineError) -> ExecError {
    ExecError::Device {
        op: "calibrating".into(),
        source,
    }
}

/// The best seconds of copying `bytes` to `device` and back, from and to a pinned host
/// arena.
fn copy_seconds(device: &Device, bytes: usize) -> Result<(f64, f64), ExecError> {
    let host = HostArena::new("calibration", bytes, &device.pinning()).map_err(device_err)?;
    let buffer = device.alloc(bytes).map_err(device_err)?;
    let (src, dst) = (HostRange::new(0, bytes), DeviceRange::of(&buffer));
    let h2d = best_of(3, || {
        device
            .copy_to_device(&host, src, dst, None, &[])
            .and_then(|e| e.wait())
            .map_err(device_err)
    })?;
    let d2h = best_of(3, || {
        device
            .copy_to_host(dst, &host, src, &[])
            .and_then(|e| e.wait())
            .map_err(device_err)
    })?;
    Ok((h2d, d2h))
}

/// The CPU AdamW's rate over 4M parameters, on all cores. That the CPU device's compute
/// shares those cores with the optimizer is the cost model's to say
/// (`CPU_DEVICE_SHARES_CORES`), not this rate's.
fn adam_params_per_s() -> Result<f64, ExecError> {
    let len = 4 << 20;
    let (mut p, mut m, mut v, g) = (
        vec![0.5f32; len],
        vec![0.0; len],
        vec![0.0; len],
        vec![1e-3f32; len],
    );
    let adam_err = |source| ExecError::Adam {
        op: "calibrating".into(),
        source,
    };
    let step = AdamStep::new(&AdamW::default(), 1, 1.0).map_err(adam_err)?;
    let threads = strata_kernels::parallel::max_threads();
    let adam = best_of(3, || {
        step.apply(
            Isa::active(),
            threads,
            &mut p,
            State::F32 {
                m: &mut m,
                v: &mut v,
            },
            Grads::F32(&g),
            CopyOut::None,
        )
        .map_err(adam_err)
    })?;
    Ok(len as f64 / adam)
}

/// The NVMe tier's rates in `dir` into `cost`: one 64 MiB extent written and read back,
/// the better of two each.
fn nvme_rates(dir: &Path, cost: &mut CostModel) -> Result<(), ExecError> {
    let bytes = 64 << 20;
    let store =
        TensorStore::create(StoreConfig::new(dir, bytes as u64)).map_err(ExecError::Tier)?;
    let id = store
        .allocate("calibration", bytes as u64)
        .map_err(ExecError::Tier)?;
    let mut buf = Some(AlignedBuf::zeroed(bytes));
    let mut io = |write: bool| -> Result<f64, ExecError> {
        let data = buf.take().expect("the buffer between transfers");
        let t = Instant::now();
        let (r, data) = if write {
            store.write(id, data).wait()
        } else {
            store.read(id, data).wait()
        };
        let s = t.elapsed().as_secs_f64();
        buf = Some(data);
        r.map_err(ExecError::Tier)?;
        Ok(s)
    };
    let w = io(true)?.min(io(true)?);
    let r = io(false)?.min(io(false)?);
    cost.nvme_write_bytes_per_s = bytes as f64 / w;
    cost.nvme_read_bytes_per_s = bytes as f64 / r;
    Ok(())
}

/// The largest message per rank [`CostModel::calibrate_collective`] times: 16 MiB, so a
/// 13B model's shard (hundreds of MiB) costs no more than GPT-2's.
const COLLECTIVE_CALIBRATION_BYTES_MAX: usize = 16 << 20;

/// Timed all-gathers after the warm-up; the best counts.
const COLLECTIVE_CALIBRATION_RUNS: usize = 5;

impl CostModel {
    /// The rate of `comm`'s collectives, bytes per second, for
    /// [`CostModel::collective_bytes_per_s`]: an all-gather of `bytes` per rank (the
    /// plan's shard of a block, [`crate::plan::layer_shard_bytes`]; at most 16 MiB, at
    /// least 1) timed after a warm-up, the best of a few runs each started together
    /// after a barrier.
    ///
    /// Its bytes are counted as the plan counts a collective operation's: an `AllGather`
    /// is the whole gathered buffer, every rank's shard (`ranks * bytes` here), as a
    /// `ReduceScatter` is the whole block's gradients it sends, so the cost model's
    /// `op.bytes / collective_bytes_per_s` is the time measured here for that size.
    ///
    /// A collective: every rank calls it, with the same `bytes`, and every rank gets the
    /// same rate, the slowest rank's (its best time gathered from every rank), since a
    /// collective ends for all when the last rank is done. One rank has nothing to time:
    /// the default rate, without a call on `comm`.
    ///
    /// (A method of the cost model rather than a free function so that it is reachable
    /// beside [`calibrate`] without another re-export from `exec`.)
    pub fn calibrate_collective(comm: &dyn Collective, bytes: usize) -> Result<f64, ExecError> {
        let ranks = comm.size();
        if ranks <= 1 {
            return Ok(CostModel::default().collective_bytes_per_s);
        }
        let err = |source| ExecError::Comm {
            op: "calibrating collectives".into(),
            source,
        };
        let bytes = bytes.clamp(1, COLLECTIVE_CALIBRATION_BYTES_MAX);
        // Each rank's bytes differ, so the gathered buffer shows every rank's arrived.
        let mark = |rank: usize| (rank % 251) as u8 + 1;
        let send = vec![mark(comm.rank()); bytes];
        let mut recv = vec![0u8; ranks * bytes];
        // The warm-up touches every page of both buffers (and sets up the transport).
        comm.all_gather(&send, &mut recv).map_err(err)?;
        for (p, chunk) in recv.chunks_exact(bytes).enumerate() {
            assert!(
                chunk.iter().all(|&b| b == mark(p)),
                "rank {p}'s bytes did not arrive in the calibrating all-gather"
            );
        }
        let mut best = f64::INFINITY;
        for _ in 0..COLLECTIVE_CALIBRATION_RUNS {
            comm.barrier().map_err(err)?;
            let t = Instant::now();
            comm.all_gather(&send, &mut recv).map_err(err)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        let mut all = vec![0u8; 8 * ranks];
        comm.all_gather(&best.to_le_bytes(), &mut all)
            .map_err(err)?;
        let slowest = all
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
            .fold(0.0, f64::max);
        // A clock that did not tick counts as one nanosecond: finite, if large.
        Ok((ranks * bytes) as f64 / slowest.max(1e-9))
    }
}
