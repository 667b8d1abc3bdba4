//! The Llama family's backward against float64 finite differences, on tiny models of
//! each variant the golden data does not cover alone: Qwen3 (per-head q/k RMSNorm),
//! Qwen2 (q/k/v biases, tied head) and Llama 3.1 (`rope_scaling` llama3, untied head).
//!
//! The reference is a whole-model forward written here over the scalar kernels of
//! `strata_kernels::reference` in f64 (embedding lookup, RMSNorm, products with
//! `nn.Linear`'s (out, in) weights, rotary embeddings, grouped-query attention, SwiGLU,
//! cross-entropy), as transformers' modeling files compose them. The engine's model
//! (its block programs on the CPU device through a whole-model runner: fast f32 kernels,
//! the backward recomputing each block, and bit-identically reading what each block's
//! forward saved) must match its loss, and central differences of its loss on sampled
//! elements of every parameter tensor.

mod model_support;

use std::collections::HashMap;

use model_support::{RECOMPUTE, assert_same_gradients, rel_err};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use strata_engine::exec::Runner;
use strata_engine::kernels::ops::{Llama3Scaling, WeightLayout};
use strata_engine::kernels::reference::gpt2 as g;
use strata_engine::kernels::reference::llama::{self as rl, GqaDims};
use strata_engine::model::llama::{LlamaConfig, Variant};
use strata_engine::model::{Llama, Model};

type Weights = HashMap<String, Vec<f64>>;

/// `out = inp @ W^T (+ bias)`, W (oc, c).
fn linear(inp: &[f64], w: &[f64], bias: Option<&[f64]>, n: usize, c: usize, oc: usize) -> Vec<f64> {
    let mut out = vec![0.0; n * oc];
    g::matmul_forward(&mut out, inp, w, bias, WeightLayout::OutIn, n, c, oc);
    out
}

fn rmsnorm(inp: &[f64], w: &[f64], eps: f64, n: usize, c: usize) -> Vec<f64> {
    let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
    rl::rmsnorm_forward(&mut out, &mut rstd, inp, w, eps, n, c);
    out
}

fn add(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

/// The mean cross-entropy of the model `c` with weights `w` on a batch, in f64.
fn forward(c: &LlamaConfig, w: &Weights, x: &[u32], y: &[u32], b: usize, t: usize) -> f64 {
    let (n, cw, d, v) = (b * t, c.width, c.head_dim, c.vocab);
    let (qd, kd, i) = (c.q_dim(), c.kv_dim(), c.intermediate);
    let eps = c.eps as f64;
    let embed = &w["model.embed_tokens.weight"];
    let mut h: Vec<f64> = x
        .iter()
        .flat_map(|&tok| embed[tok as usize * cw..][..cw].to_vec())
        .collect();
    let mut inv = rl::rope_inv_freq(c.rope.theta as f64, d);
    if let Some(s) = c.rope.llama3 {
        inv = rl::rope_inv_freq_llama3(
            &inv,
            s.factor as f64,
            s.low_freq_factor as f64,
            s.high_freq_factor as f64,
            s.original_context as f64,
        );
    }
    let (mut cos, mut sin) = (vec![0.0; t * d / 2], vec![0.0; t * d / 2]);
    rl::rope_table(&mut cos, &mut sin, &inv, t);
    let dims = GqaDims {
        b,
        t,
        h: c.heads,
        kv: c.kv_heads,
        d,
    };
    for l in 0..c.layers {
        let p = |name: &str| &w[&format!("model.layers.{l}.{name}")];
        let bias = |name: &str| {
            c.qkv_bias
                .then(|| w[&format!("model.layers.{l}.self_attn.{name}_proj.bias")].as_slice())
        };
        let xn = rmsnorm(&h, p("input_layernorm.weight"), eps, n, cw);
        let mut q = linear(&xn, p("self_attn.q_proj.weight"), bias("q"), n, cw, qd);
        let mut k = linear(&xn, p("self_attn.k_proj.weight"), bias("k"), n, cw, kd);
        let vv = linear(&xn, p("self_attn.v_proj.weight"), bias("v"), n, cw, kd);
        if c.qk_norm {
            q = rmsnorm(&q, p("self_attn.q_norm.weight"), eps, n * c.heads, d);
            k = rmsnorm(&k, p("self_attn.k_norm.weight"), eps, n * c.kv_heads, d);
        }
        let (mut qr, mut kr) = (vec![0.0; n * qd], vec![0.0; n * kd]);
        rl::rope_forward(&mut qr, &q, &cos, &sin, b, t, c.heads, d);
        rl::rope_forward(&mut kr, &k, &cos, &sin, b, t, c.kv_heads, d);
        let (mut y_att, mut att) = (vec![0.0; n * qd], vec![0.0; dims.att_len()]);
        rl::gqa_attention_forward(&mut y_att, &mut att, &qr, &kr, &vv, dims);
        let o = linear(&y_att, p("self_attn.o_proj.weight"), None, n, qd, cw);
        let h2 = add(&h, &o);
        let xn2 = rmsnorm(&h2, p("post_attention_layernorm.weight"), eps, n, cw);
        let gate = linear(&xn2, p("mlp.gate_proj.weight"), None, n, cw, i);
        let up = linear(&xn2, p("mlp.up_proj.weight"), None, n, cw, i);
        let mut act = vec![0.0; n * i];
        rl::swiglu_forward(&mut act, &gate, &up);
        let down = linear(&act, p("mlp.down_proj.weight"), None, n, i, cw);
        h = add(&h2, &down);
    }
    let xf = rmsnorm(&h, &w["model.norm.weight"], eps, n, cw);
    let head = if c.tied { embed } else { &w["lm_head.weight"] };
    let logits = linear(&xf, head, None, n, cw, v);
    let mut losses = vec![0.0; n];
    g::crossentropy_forward(&mut losses, &logits, y, n, v);
    losses.iter().sum::<f64>() / n as f64
}

fn check(c: LlamaConfig, b: usize, t: usize, seed: u64) {
    let model = Model::of(Llama::new(c.clone()).unwrap());
    let mut rng = StdRng::seed_from_u64(seed);
    let mut params = model.init_params(seed);
    // Larger weights than the 0.02 of an initialisation, and norm gains away from 1, so
    // that every path carries a sizeable gradient.
    for (block, buffer) in model.blocks().iter().zip(&mut params) {
        for spec in &block.tensors {
            for v in &mut buffer[spec.slot.range()] {
                *v = if spec.shape.len() == 1 && !spec.name.ends_with(".bias") {
                    rng.random_range(0.5..1.5)
                } else {
                    *v * 5.0 + rng.random_range(-0.05..0.05)
                };
            }
        }
    }
    let tokens: Vec<u32> = (0..b * t + 1)
        .map(|_| rng.random_range(0..c.vocab as u32))
        .collect();
    let (x, y) = (&tokens[..b * t], &tokens[1..]);
    let mut w: Weights = HashMap::new();
    for (block, buffer) in model.blocks().iter().zip(&params) {
        for spec in &block.tensors {
            w.insert(
                spec.name.clone(),
                buffer[spec.slot.range()]
                    .iter()
                    .map(|&v| v as f64)
                    .collect(),
            );
        }
    }
    let loss64 = forward(&c, &w, x, y, b, t);
    let [(loss, grads), saved] = RECOMPUTE.map(|recompute| {
        let mut runner = Runner::on_cpu_recomputing(model.clone(), b, t, recompute).unwrap();
        runner.load(&params).unwrap();
        let loss = runner.forward(x, y).unwrap();
        (loss, runner.backward().unwrap())
    });
    assert_same_gradients(
        &(loss, &grads),
        &(saved.0, &saved.1),
        &format!("{:?}: recomputing vs saved activations", c.variant),
    );
    assert!(
        rel_err(&[loss], &[loss64 as f32]) < 1e-5,
        "{:?}: loss {loss} vs f64 {loss64}",
        c.variant
    );
    let mut worst = 0.0f64;
    let mut checked = 0;
    for (block, gr) in model.blocks().iter().zip(&grads) {
        for spec in &block.tensors {
            let fast = &gr[spec.slot.range()];
            for _ in 0..4 {
                let i = rng.random_range(0..spec.slot.len);
                let h = 1e-5;
                let keep = w[&spec.name][i];
                w.get_mut(&spec.name).unwrap()[i] = keep + h;
                let plus = forward(&c, &w, x, y, b, t);
                w.get_mut(&spec.name).unwrap()[i] = keep - h;
                let minus = forward(&c, &w, x, y, b, t);
                w.get_mut(&spec.name).unwrap()[i] = keep;
                let fd = (plus - minus) / (2.0 * h);
                let err = (fast[i] as f64 - fd).abs();
                assert!(
                    err < 1e-6 + 1e-4 * fd.abs(),
                    "{:?} {}[{i}]: fast backward {} vs finite difference {fd}",
                    c.variant,
                    spec.name,
                    fast[i]
                );
                worst = worst.max(err);
                checked += 1;
            }
        }
    }
    println!(
        "{:?}: loss {loss} (f64 {loss64:.7}); {checked} elements, fast backward vs finite \
         differences max abs error {worst:.2e}",
        c.variant
    );
}

fn tiny(variant: Variant) -> LlamaConfig {
    // 2 layers, 24 wide, 3 query heads and 1 key/value head of 8, MLP 40, vocab 37,
    // context 16; batch 2 of 7 tokens.
    let mut c = LlamaConfig::llama(2, 24, 40, 3, 1, 37, 16);
    c.variant = variant;
    c.qkv_bias = variant == Variant::Qwen2;
    c.qk_norm = variant == Variant::Qwen3;
    c.tied = variant == Variant::Qwen2;
    c.eps = 1e-6;
    c
}

#[test]
fn qwen3_per_head_qk_norm_gradients_match_finite_differences() {
    check(tiny(Variant::Qwen3), 2, 7, 1);
}

#[test]
fn qwen2_bias_and_tied_head_gradients_match_finite_differences() {
    check(tiny(Variant::Qwen2), 2, 7, 2);
}

#[test]
fn llama3_scaled_rope_gradients_match_finite_differences() {
    let mut c = tiny(Variant::Llama);
    // A short original context, so that 7 positions reach every band of the scaling.
    c.rope.theta = 500.0;
    c.rope.llama3 = Some(Llama3Scaling {
        factor: 4.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_context: 16.0,
    });
    check(c, 2, 7, 3);
}
