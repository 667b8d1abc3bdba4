//! A short measurement of this machine's rates at start, for the cost model: the CPU
//! device's compute (one transformer layer's forward), memory copies (the CPU device's
//! host-to-device and device-to-host), the CPU AdamW, and the NVMe tier's reads and
//! writes. About half a second; sizes are capped so a 13B model's shape costs no more.

use std::path::Path;
use std::time::Instant;

use strata_kernels::adamw::{AdamStep, AdamW, CopyOut, Grads, State};
use strata_kernels::isa::Isa;
use strata_storage::{AlignedBuf, StoreConfig, TensorStore};

use super::ExecError;
use crate::model::{BlockScratch, CpuBackend, Gpt2Config, Model};
use crate::plan::CostModel;

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

/// Measures the rates of the CPU device for steps of `config`'s width and `batch` ×
/// `seq` tokens, with the NVMe tier in `nvme_dir` (skipped, keeping the defaults' NVMe
/// rates, when `None`).
pub fn calibrate(
    config: &Gpt2Config,
    batch: usize,
    seq: usize,
    nvme_dir: Option<&Path>,
) -> Result<CostModel, ExecError> {
    let model_err = |source| ExecError::Model {
        op: "calibrating".into(),
        source,
    };
    let mut cost = CostModel::default();

    // Compute: one transformer layer forward, at most 1024 wide and 512 rows.
    let width = config.width.min(1024);
    let heads = (1..=config.heads.min(width))
        .rev()
        .find(|h| width.is_multiple_of(*h))
        .unwrap_or(1);
    let seq = seq.min(512);
    let batch = batch.clamp(1, (512 / seq).max(1));
    let shape = Gpt2Config::new(1, heads, width, 256, seq);
    let model = Model::new(shape).map_err(model_err)?;
    let be = CpuBackend::default();
    let dims = model.dims(batch, seq).map_err(model_err)?;
    let params = model.init_params(1);
    let mut scratch = BlockScratch::new(&be, dims).map_err(model_err)?;
    let x: Vec<f32> = (0..dims.rows() * width)
        .map(|i| (i % 7) as f32 * 0.1)
        .collect();
    let mut out = vec![0.0; x.len()];
    let seconds = best_of(3, || {
        model
            .layer_forward(&be, &params[1], &x, &mut out, &mut scratch)
            .map_err(model_err)
    })?;
    let (n, c) = (dims.rows() as f64, width as f64);
    let flops = 2.0 * n * 12.0 * c * c + 4.0 * batch as f64 * (seq * seq) as f64 * c;
    cost.compute_flops = flops / seconds;

    // Copies: 64 MiB, as the CPU device's transfers are.
    let src = vec![1.0f32; 16 << 20];
    let mut dst = vec![0.0f32; 16 << 20];
    let copy = best_of(3, || {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        Ok(())
    })?;
    cost.h2d_bytes_per_s = (64 << 20) as f64 / copy;
    cost.d2h_bytes_per_s = cost.h2d_bytes_per_s;

    // AdamW: 4M parameters.
    let len = 4 << 20;
    let (mut p, mut m, mut v, g) = (
        vec![0.5f32; len],
        vec![0.0; len],
        vec![0.0; len],
        vec![1e-3f32; len],
    );
    let step = AdamStep::new(&AdamW::default(), 1, 1.0).map_err(|source| ExecError::Adam {
        op: "calibrating".into(),
        source,
    })?;
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
        .map_err(|source| ExecError::Adam {
            op: "calibrating".into(),
            source,
        })
    })?;
    // The executor's AdamW shares the cores with the compute lane.
    cost.adam_params_per_s = len as f64 / adam / 2.0;

    // NVMe: one 64 MiB extent written and read back.
    if let Some(dir) = nvme_dir {
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
    }
    cost.source = "measured at start";
    Ok(cost)
}
