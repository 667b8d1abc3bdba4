//! GPT-2 124M forward + backward time per token, on the CPU and (where present) a GPU.
//! A measurement, not a check: ignored by default, never asserted. Run it in release:
//!
//! ```text
//! cargo test --release -p strata-engine --test model_timing -- --ignored --nocapture
//! ```
//!
//! `STRATA_TIMING_BATCH` and `STRATA_TIMING_SEQ` set the batch shape (default 4 × 256 on
//! the CPU, 8 × 1024 on a GPU); `STRATA_TIMING_STEPS` the timed steps (default 3).

use std::time::Instant;

use strata_engine::device::{CudaDevice, CudaDeviceConfig};
use strata_engine::kernels::cuda::probe;
use strata_engine::model::cuda::CudaBackend;
use strata_engine::model::{Backend, CpuBackend, Gpt2Config, Model};

fn setting(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Seconds per token of forward + backward on `be`, after one warm-up step.
fn time_steps<Be: Backend>(be: &Be, batch: usize, seq: usize, sync: impl Fn()) -> f64 {
    let model = Model::new(Gpt2Config::gpt2()).unwrap();
    let host = model.init_params(1);
    let params: Vec<Be::Params> = host.iter().map(|p| be.upload_params(p).unwrap()).collect();
    let mut ws = model.workspace(be, batch, seq).unwrap();
    let mut grads = model.alloc_grads(be).unwrap();
    let vocab = model.config().vocab as u64;
    let tokens: Vec<u32> = (0..(batch * seq) as u64)
        .map(|i| (i * 7919 % vocab) as u32)
        .collect();
    let targets: Vec<u32> = tokens.iter().map(|&t| (t + 1) % vocab as u32).collect();
    let steps = setting("STRATA_TIMING_STEPS", 3);
    let mut run = || {
        model
            .forward(be, &params, &mut ws, &tokens, &targets)
            .unwrap();
        model.backward(be, &params, &mut grads, &mut ws).unwrap();
        sync();
    };
    run();
    let start = Instant::now();
    for _ in 0..steps {
        run();
    }
    let seconds = start.elapsed().as_secs_f64();
    let per_token = seconds / (steps * batch * seq) as f64;
    println!(
        "GPT-2 124M on {}: batch {batch} x {seq}, {steps} steps in {seconds:.2} s: forward + \
         backward {:.1} us/token ({:.0} tokens/s)",
        be.describe(),
        per_token * 1e6,
        1.0 / per_token
    );
    per_token
}

#[test]
#[ignore = "a measurement: run in release with --ignored --nocapture"]
fn gpt2_124m_forward_backward_time_per_token() {
    let be = CpuBackend::default();
    time_steps(
        &be,
        setting("STRATA_TIMING_BATCH", 4),
        setting("STRATA_TIMING_SEQ", 256),
        || {},
    );
    if let Err(e) = probe().require_all() {
        println!("GPU timing skipped: {e}");
        return;
    }
    let config = CudaDeviceConfig {
        ordinal: 0,
        memory_budget_bytes: 0,
        needs_kernels: true,
    };
    let device = CudaDevice::new(config).unwrap();
    let (batch, seq) = (
        setting("STRATA_TIMING_BATCH", 8),
        setting("STRATA_TIMING_SEQ", 1024),
    );
    let f32_be = CudaBackend::<f32>::on_device(&device).unwrap();
    time_steps(&f32_be, batch, seq, || f32_be.synchronize().unwrap());
    let bf16_be = CudaBackend::<half::bf16>::on_device(&device).unwrap();
    time_steps(&bf16_be, batch, seq, || bf16_be.synchronize().unwrap());
}
