//! GPT-2 124M forward + backward time per token, through a whole-model
//! [`Runner`] on the CPU device, and on a GPU in f32 and in bf16 (a test of its own,
//! which fails without a GPU). Measurements, not checks: ignored by default, never
//! asserted. Run them in release:
//!
//! ```text
//! cargo test --release -p strata-engine --test model_timing -- --ignored --nocapture
//! ```
//!
//! `STRATA_TIMING_BATCH` and `STRATA_TIMING_SEQ` set the batch shape (default 4 × 256 on
//! the CPU, 8 × 1024 on a GPU); `STRATA_TIMING_STEPS` the timed steps (default 3).
//!
//! The runner's passes wait for the device, and its backward returns the gradients on
//! the host: the forward + backward time includes copying every gradient (4 bytes per
//! parameter) off the device once a step, which the report says. The forward alone is
//! timed too (it copies only the per-position losses back).

use std::time::Instant;

use strata_engine::device::{Device, DeviceChoice, DeviceConfig, select};
use strata_engine::exec::Runner;
use strata_engine::model::{Gpt2Config, Model, Target};
use strata_engine::plan::Precision;

mod support;

fn setting(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// GPT-2 124M on the device `choice` names, sized for `batch` × `seq`, in `precision`.
fn runner(choice: DeviceChoice, batch: usize, seq: usize, precision: Precision) -> Runner {
    let model = Model::new(Gpt2Config::gpt2()).unwrap();
    let target = match choice {
        DeviceChoice::Cuda => Target::Cuda,
        _ => Target::Cpu,
    };
    let dtype = match target {
        Target::Cpu => strata_engine::model::Dtype::F32,
        Target::Cuda => precision.dtype(),
    };
    let bytes = Runner::device_bytes(&model, batch, seq, target, dtype).unwrap();
    let config = DeviceConfig {
        memory_budget_bytes: bytes,
        cuda_ordinal: 0,
        cuda_needs_kernels: true,
    };
    let (device, why): (Device, String) = select(choice, &config).unwrap();
    println!("device: {why}");
    let mut runner = Runner::new(model, device, batch, seq, precision).unwrap();
    runner.load(&runner.model().init_params(1)).unwrap();
    runner
}

/// Seconds per token of forward + backward on `runner`, after one warm-up step.
fn time_steps(mut runner: Runner, batch: usize, seq: usize, precision: Precision) -> f64 {
    let vocab = runner.model().vocab() as u64;
    let grad_bytes = 4 * runner.model().param_count();
    let tokens: Vec<u32> = (0..(batch * seq) as u64)
        .map(|i| (i * 7919 % vocab) as u32)
        .collect();
    let targets: Vec<u32> = tokens.iter().map(|&t| (t + 1) % vocab as u32).collect();
    let steps = setting("STRATA_TIMING_STEPS", 3);
    let mut forward_s = 0.0;
    let mut run = |forward_s: &mut f64| {
        let start = Instant::now();
        let loss = runner.forward(&tokens, &targets).unwrap();
        *forward_s += start.elapsed().as_secs_f64();
        assert!(loss.is_finite(), "loss {loss}");
        let grads = runner.backward().unwrap();
        std::hint::black_box(grads);
    };
    run(&mut forward_s);
    forward_s = 0.0;
    let start = Instant::now();
    for _ in 0..steps {
        run(&mut forward_s);
    }
    let seconds = start.elapsed().as_secs_f64();
    let tokens_timed = (steps * batch * seq) as f64;
    let per_token = seconds / tokens_timed;
    println!(
        "GPT-2 124M on {} {precision:?}: batch {batch} x {seq}, {steps} steps in {seconds:.2} s: \
         forward {:.1} us/token; forward + backward (with {:.0} MB of gradients copied to \
         the host per step) {:.1} us/token ({:.0} tokens/s)",
        runner.device().name(),
        forward_s / tokens_timed * 1e6,
        grad_bytes as f64 / 1e6,
        per_token * 1e6,
        1.0 / per_token
    );
    per_token
}

#[test]
#[ignore = "a measurement: run in release with --ignored --nocapture"]
fn gpt2_124m_forward_backward_time_per_token_on_the_cpu() {
    let (batch, seq) = (
        setting("STRATA_TIMING_BATCH", 4),
        setting("STRATA_TIMING_SEQ", 256),
    );
    let cpu = runner(DeviceChoice::Cpu, batch, seq, Precision::Fp32);
    time_steps(cpu, batch, seq, Precision::Fp32);
}

#[test]
#[ignore = "a measurement, and needs a GPU: run in release with --ignored --nocapture"]
fn gpt2_124m_forward_backward_time_per_token_on_a_gpu() {
    support::require_gpu(true);
    let (batch, seq) = (
        setting("STRATA_TIMING_BATCH", 8),
        setting("STRATA_TIMING_SEQ", 1024),
    );
    for precision in [Precision::Fp32, Precision::Bf16] {
        // One runner at a time: each holds its own device memory.
        let gpu = runner(DeviceChoice::Cuda, batch, seq, precision);
        time_steps(gpu, batch, seq, precision);
    }
}
