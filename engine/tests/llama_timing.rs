//! Tokens per second of forward + backward of a Llama-shaped model of about 124M
//! parameters against GPT-2 124M, on the CPU device through whole-model runners, the two
//! timed in alternation in one process so that both see the same machine. A
//! measurement, not a check: ignored by default, never asserted.
//!
//! ```text
//! cargo test -p strata-engine --test llama_timing -- --ignored --nocapture
//! ```
//!
//! The Llama-shaped model: 12 layers, 768 wide, 12 query heads and 4 key/value heads of
//! 64, SwiGLU MLP 2304 wide, GPT-2's vocabulary (50257) and a tied head: 121M parameters.
//! `STRATA_TIMING_BATCH`, `STRATA_TIMING_SEQ` (default 4 × 256) and
//! `STRATA_TIMING_STEPS` (default 3 rounds) set the run.

use std::time::Instant;

use strata_engine::exec::Runner;
use strata_engine::model::llama::{LlamaConfig, Variant};
use strata_engine::model::{Gpt2Config, Llama, Model};

fn setting(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One forward + backward of `runner` on a fixed batch; its seconds.
fn step(runner: &mut Runner, tokens: &[u32], targets: &[u32]) -> f64 {
    let start = Instant::now();
    let loss = runner.forward(tokens, targets).unwrap();
    assert!(loss.is_finite(), "loss {loss}");
    std::hint::black_box(runner.backward().unwrap());
    start.elapsed().as_secs_f64()
}

#[test]
#[ignore = "a measurement: run with --ignored --nocapture"]
fn llama_shaped_and_gpt2_124m_tokens_per_second_on_the_cpu() {
    let (batch, seq) = (
        setting("STRATA_TIMING_BATCH", 4),
        setting("STRATA_TIMING_SEQ", 256),
    );
    let rounds = setting("STRATA_TIMING_STEPS", 3);
    let mut llama = LlamaConfig::llama(12, 768, 2304, 12, 4, 50257, 1024);
    llama.variant = Variant::Llama;
    llama.tied = true;
    let models = [
        ("gpt2 124M", Model::new(Gpt2Config::gpt2()).unwrap()),
        ("llama-shaped", Model::of(Llama::new(llama).unwrap())),
    ];
    let mut runners: Vec<Runner> = models
        .iter()
        .map(|(_, m)| {
            let mut r = Runner::on_cpu(m.clone(), batch, seq).unwrap();
            r.load(&m.init_params(1)).unwrap();
            r
        })
        .collect();
    let vocab = 50257u64;
    let tokens: Vec<u32> = (0..(batch * seq) as u64)
        .map(|i| (i * 7919 % vocab) as u32)
        .collect();
    let targets: Vec<u32> = tokens.iter().map(|&t| (t + 1) % vocab as u32).collect();
    // One warm-up step each, then rounds alternating between the models.
    for r in &mut runners {
        step(r, &tokens, &targets);
    }
    let mut seconds = vec![Vec::new(); runners.len()];
    for _ in 0..rounds {
        for (r, s) in runners.iter_mut().zip(&mut seconds) {
            s.push(step(r, &tokens, &targets));
        }
    }
    for ((name, model), s) in models.iter().zip(&seconds) {
        let mut sorted = s.clone();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[sorted.len() / 2];
        println!(
            "{name}: {} params, batch {batch} x {seq}: median forward + backward {median:.2} s \
             over {rounds} steps ({s:.2?}), {:.0} tokens/s",
            model.param_count(),
            (batch * seq) as f64 / median
        );
    }
}
