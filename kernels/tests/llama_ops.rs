//! The Llama family's CPU kernels (RMSNorm, RoPE, SwiGLU, grouped-query attention)
//! against their scalar references in f64, element by element with `atol + rtol * |ref|`,
//! on odd sizes, every instruction set this CPU has, one and several threads; the
//! references' backward passes against central finite differences of their forward
//! passes in f64; `run_cpu` on their program variants against the direct calls; and the
//! kernels' invariants (grouped-query attention with KV = H is
//! GPT-2's attention on the same heads; RoPE keeps each pair's norm and its table is
//! the cosines and sines of position × inverse frequency).

mod ops_support;

use ops_support::{check, cpus, random, wide};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use strata_kernels::kernel::{
    GqaAttention, GqaAttentionBackward, RmsNorm, RmsNormBackward, Rope, RopeBackward, SwiGlu,
    SwiGluBackward,
};
use strata_kernels::ops::{self, Cpu};
use strata_kernels::program::{
    CpuMemory, Dtype, Kernel, KernelError, Scalars, Target, TensorRef, gqa_attention_scratch_bytes,
    run_cpu,
};
use strata_kernels::reference::llama::{self as rl, GqaDims};

fn random64(rng: &mut StdRng, len: usize, scale: f64) -> Vec<f64> {
    (0..len).map(|_| rng.random_range(-scale..scale)).collect()
}

/// Asserts an analytic gradient equals central differences of `loss` at `x`, within
/// `1e-6 + 1e-5 |fd|`.
#[track_caller]
fn check_fd(what: &str, x: &[f64], analytic: &[f64], mut loss: impl FnMut(&[f64]) -> f64) {
    let step = 1e-6;
    let mut x = x.to_vec();
    for i in 0..x.len() {
        let keep = x[i];
        x[i] = keep + step;
        let up = loss(&x);
        x[i] = keep - step;
        let down = loss(&x);
        x[i] = keep;
        let fd = (up - down) / (2.0 * step);
        assert!(
            (analytic[i] - fd).abs() <= 1e-6 + 1e-5 * fd.abs(),
            "{what}: element {i}: analytic {} but finite differences {fd}",
            analytic[i]
        );
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[test]
fn rmsnorm_matches_reference() {
    let mut rng = StdRng::seed_from_u64(11);
    // (3, 67): a row tail; (48, 12): Qwen3's per-head q/k norm, rows of head_dim 12;
    // (5, 1): one channel.
    for (n, c, eps) in [(3, 67, 1e-6), (48, 12, 1e-6), (5, 1, 1e-5), (40, 130, 1e-5)] {
        let inp = random(&mut rng, n * c, 2.0);
        let weight = random(&mut rng, c, 1.5);
        let dout = random(&mut rng, n * c, 1.0);
        let dinp0 = random(&mut rng, n * c, 0.5);
        let dweight0 = random(&mut rng, c, 0.5);
        let (mut out_w, mut rstd_w) = (vec![0.0; n * c], vec![0.0; n]);
        rl::rmsnorm_forward(
            &mut out_w,
            &mut rstd_w,
            &wide(&inp),
            &wide(&weight),
            eps,
            n,
            c,
        );
        let (mut dinp_w, mut dweight_w) = (wide(&dinp0), wide(&dweight0));
        rl::rmsnorm_backward(
            &mut dinp_w,
            &mut dweight_w,
            &wide(&dout),
            &wide(&inp),
            &wide(&weight),
            &rstd_w,
            n,
            c,
        );
        for cpu in cpus() {
            let (mut out, mut rstd) = (vec![f32::NAN; n * c], vec![f32::NAN; n]);
            ops::rmsnorm_forward(&cpu, &mut out, &mut rstd, &inp, &weight, eps as f32, n, c);
            check("rmsnorm_forward out", &out, &out_w, 1e-6, 1e-5);
            check("rmsnorm_forward rstd", &rstd, &rstd_w, 0.0, 1e-5);
            let (mut dinp, mut dweight) = (dinp0.clone(), dweight0.clone());
            ops::rmsnorm_backward(
                &cpu,
                &mut dinp,
                Some(&mut dweight),
                &dout,
                &inp,
                &weight,
                &rstd,
                n,
                c,
            );
            // A frozen weight: the same input gradient, bit for bit, and no weight gradient.
            let mut frozen = dinp0.clone();
            ops::rmsnorm_backward(&cpu, &mut frozen, None, &dout, &inp, &weight, &rstd, n, c);
            assert_eq!(frozen, dinp, "rmsnorm_backward without dweight, {n}x{c}");
            check(
                "rmsnorm_backward dinp (accumulated)",
                &dinp,
                &dinp_w,
                1e-5,
                1e-5,
            );
            check(
                "rmsnorm_backward dweight (accumulated)",
                &dweight,
                &dweight_w,
                1e-5,
                1e-5,
            );
        }
    }
}

/// The table a family's programs build ([`ops::rope_table_of`], the `RopeTable` kernel)
/// against the f64 reference: default frequencies, and Llama 3.1's scaling (which
/// divides the low frequencies by 8, keeps the high ones and interpolates between).
#[test]
fn rope_tables_of_default_and_llama3_frequencies_match_reference() {
    let scaling = ops::Llama3Scaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_context: 8192.0,
    };
    for (theta, d, t, llama3) in [
        (10_000.0f32, 16, 9, false),
        (500_000.0, 128, 40, true),
        (500_000.0, 64, 3, true),
        (1_000_000.0, 2, 5, false),
    ] {
        let half = d / 2;
        let freqs = ops::RopeFreqs {
            theta,
            llama3: llama3.then_some(scaling),
        };
        let mut inv = rl::rope_inv_freq(theta as f64, d);
        if llama3 {
            inv = rl::rope_inv_freq_llama3(&inv, 8.0, 1.0, 4.0, 8192.0);
            // The scaling moves some frequencies, keeps others and interpolates some.
            let base = rl::rope_inv_freq(theta as f64, d);
            let ratios: Vec<f64> = inv.iter().zip(&base).map(|(a, b)| a / b).collect();
            assert!(ratios.contains(&1.0), "{ratios:?}");
            assert!(
                ratios.iter().any(|&r| (r - 0.125).abs() < 1e-12),
                "{ratios:?}"
            );
            assert!(ratios.iter().any(|&r| r > 0.126 && r < 0.999), "{ratios:?}");
        }
        let fast: Vec<f32> = (0..half).map(|i| freqs.inv_freq(i, d)).collect();
        check("inv_freq", &fast, &inv, 0.0, 3e-7);
        let (mut cos, mut sin) = (vec![f32::NAN; t * half], vec![f32::NAN; t * half]);
        ops::rope_table_of(&mut cos, &mut sin, &freqs, t, d);
        let (mut cos_w, mut sin_w) = (vec![0.0f64; t * half], vec![0.0f64; t * half]);
        rl::rope_table(&mut cos_w, &mut sin_w, &inv, t);
        // The angle t * f is an f32 product, as Hugging Face forms it: up to t * 2^-24
        // radians off.
        let atol = 1e-6 + t as f64 * 1.2e-7;
        check("rope_table_of cos", &cos, &cos_w, atol, 0.0);
        check("rope_table_of sin", &sin, &sin_w, atol, 0.0);
    }
}

#[test]
fn rope_matches_reference() {
    let mut rng = StdRng::seed_from_u64(12);
    for (b, t, h, d) in [(2, 13, 6, 12), (1, 5, 2, 2), (3, 70, 3, 64), (1, 1, 1, 8)] {
        let half = d / 2;
        let theta = 10_000.0;
        let mut inv_freq = vec![0.0f32; half];
        ops::rope_inv_freq(&mut inv_freq, theta, d);
        let inv_freq_w = rl::rope_inv_freq(theta, d);
        check("rope_inv_freq", &inv_freq, &inv_freq_w, 0.0, 1e-7);
        // A table with rows past T, as a model's maximum context gives.
        let rows = t + 3;
        let positions: Vec<u32> = (0..rows as u32).collect();
        let (mut cos, mut sin) = (vec![0.0f32; rows * half], vec![0.0f32; rows * half]);
        ops::rope_table(&mut cos, &mut sin, &inv_freq, &positions);
        let (mut cos_w, mut sin_w) = (vec![0.0f64; rows * half], vec![0.0f64; rows * half]);
        rl::rope_table(&mut cos_w, &mut sin_w, &wide(&inv_freq), rows);
        check("rope_table cos", &cos, &cos_w, 1e-5, 0.0);
        check("rope_table sin", &sin, &sin_w, 1e-5, 0.0);
        let inp = random(&mut rng, b * t * h * d, 2.0);
        let dout = random(&mut rng, b * t * h * d, 1.0);
        let (cos64, sin64) = (wide(&cos), wide(&sin));
        let mut out_w = vec![0.0; inp.len()];
        rl::rope_forward(&mut out_w, &wide(&inp), &cos64, &sin64, b, t, h, d);
        let mut dinp_w = vec![0.0; inp.len()];
        rl::rope_backward(&mut dinp_w, &wide(&dout), &cos64, &sin64, b, t, h, d);
        // A rotation keeps each pair's length.
        for (i, (&x, &y)) in wide(&inp).iter().zip(&out_w).enumerate() {
            let row = i / d;
            let j = i % d;
            if j < half {
                let (x2, y2) = (inp[row * d + j + half] as f64, out_w[row * d + j + half]);
                let (before, after) = (x * x + x2 * x2, y * y + y2 * y2);
                assert!((before - after).abs() < 1e-5 * (1.0 + before), "rope norm");
            }
        }
        for cpu in cpus() {
            let mut out = vec![f32::NAN; inp.len()];
            ops::rope_forward(&cpu, &mut out, &inp, &cos, &sin, None, b, t, h, d);
            check("rope_forward", &out, &out_w, 1e-6, 1e-5);
            let mut dinp = vec![f32::NAN; inp.len()];
            ops::rope_backward(&cpu, &mut dinp, &dout, &cos, &sin, None, b, t, h, d);
            check("rope_backward", &dinp, &dinp_w, 1e-6, 1e-5);
        }
    }
}

#[test]
fn packed_rope_restarts_positions_at_each_document() {
    // A packed row of documents of 3, 1 and 5 tokens rotates each document as a sequence
    // of its own would be rotated, from position 0; so does the transpose.
    let mut rng = StdRng::seed_from_u64(21);
    let (h, d, lens) = (2, 8, [3usize, 1, 5]);
    let t: usize = lens.iter().sum();
    let mut inv_freq = vec![0.0f32; d / 2];
    ops::rope_inv_freq(&mut inv_freq, 10_000.0, d);
    let positions: Vec<u32> = (0..t as u32).collect();
    let (mut cos, mut sin) = (vec![0.0f32; t * d / 2], vec![0.0f32; t * d / 2]);
    ops::rope_table(&mut cos, &mut sin, &inv_freq, &positions);
    let x = random(&mut rng, t * h * d, 1.0);
    let mut tokens = Vec::new();
    for &len in &lens {
        tokens.extend(std::iter::repeat_n(7, len - 1));
        tokens.push(2);
    }
    let mut starts = vec![0u32; t];
    strata_kernels::kernel::attention::doc_starts(&mut starts, &tokens, 2, t);
    for cpu in cpus() {
        let (mut packed, mut packed_back) = (vec![f32::NAN; x.len()], vec![f32::NAN; x.len()]);
        ops::rope_forward(&cpu, &mut packed, &x, &cos, &sin, Some(&starts), 1, t, h, d);
        ops::rope_backward(
            &cpu,
            &mut packed_back,
            &x,
            &cos,
            &sin,
            Some(&starts),
            1,
            t,
            h,
            d,
        );
        let mut at = 0;
        for &len in &lens {
            let part = &x[at * h * d..(at + len) * h * d];
            let (mut alone, mut alone_back) = (vec![0.0; part.len()], vec![0.0; part.len()]);
            ops::rope_forward(&cpu, &mut alone, part, &cos, &sin, None, 1, len, h, d);
            ops::rope_backward(&cpu, &mut alone_back, part, &cos, &sin, None, 1, len, h, d);
            assert_eq!(&packed[at * h * d..(at + len) * h * d], &alone[..]);
            assert_eq!(
                &packed_back[at * h * d..(at + len) * h * d],
                &alone_back[..]
            );
            at += len;
        }
    }
}

#[test]
fn swiglu_matches_reference() {
    let mut rng = StdRng::seed_from_u64(13);
    for n in [67, 1, 16, 40_003] {
        let mut gate = random(&mut rng, n, 6.0);
        if n > 2 {
            // Far out on both sides, where sigmoid saturates.
            gate[0] = -95.0;
            gate[1] = 40.0;
        }
        let up = random(&mut rng, n, 2.0);
        let dout = random(&mut rng, n, 1.0);
        let mut out_w = vec![0.0; n];
        rl::swiglu_forward(&mut out_w, &wide(&gate), &wide(&up));
        let (mut dgate_w, mut dup_w) = (vec![0.0; n], vec![0.0; n]);
        rl::swiglu_backward(
            &mut dgate_w,
            &mut dup_w,
            &wide(&dout),
            &wide(&gate),
            &wide(&up),
        );
        for cpu in cpus() {
            let mut out = vec![f32::NAN; n];
            ops::swiglu_forward(&cpu, &mut out, &gate, &up);
            check("swiglu_forward", &out, &out_w, 1e-6, 1e-5);
            let (mut dgate, mut dup) = (vec![f32::NAN; n], vec![f32::NAN; n]);
            ops::swiglu_backward(&cpu, &mut dgate, &mut dup, &dout, &gate, &up);
            check("swiglu_backward dgate", &dgate, &dgate_w, 1e-6, 1e-5);
            check("swiglu_backward dup", &dup, &dup_w, 1e-6, 1e-5);
        }
    }
}

#[test]
fn gqa_attention_matches_reference() {
    let mut rng = StdRng::seed_from_u64(14);
    // T above 64 crosses the block boundary of the causal products.
    for (b, t, h, kv, d) in [
        (2, 13, 6, 2, 12),
        (2, 13, 6, 6, 12),
        (1, 70, 4, 1, 16),
        (1, 1, 2, 1, 4),
        (3, 9, 3, 3, 5),
    ] {
        let dims = GqaDims { b, t, h, kv, d };
        let q = random(&mut rng, dims.q_len(), 2.0);
        let k = random(&mut rng, dims.kv_len(), 2.0);
        let v = random(&mut rng, dims.kv_len(), 2.0);
        let dout = random(&mut rng, dims.q_len(), 1.0);
        let (mut out_w, mut att_w) = (vec![0.0; dims.q_len()], vec![0.0; dims.att_len()]);
        let (q64, k64, v64) = (wide(&q), wide(&k), wide(&v));
        rl::gqa_attention_forward(&mut out_w, &mut att_w, &q64, &k64, &v64, dims);
        let mut dq_w = vec![0.0; dims.q_len()];
        let (mut dk_w, mut dv_w) = (vec![0.0; dims.kv_len()], vec![0.0; dims.kv_len()]);
        let dout64 = wide(&dout);
        rl::gqa_attention_backward(
            &mut dq_w, &mut dk_w, &mut dv_w, &dout64, &q64, &k64, &v64, &att_w, dims,
        );
        for cpu in cpus() {
            let mut out = vec![f32::NAN; dims.q_len()];
            let mut att = vec![f32::NAN; dims.att_len()];
            ops::gqa_attention_forward(&cpu, &mut out, &mut att, &q, &k, &v, dims);
            check("gqa_attention_forward out", &out, &out_w, 1e-5, 1e-5);
            check("gqa_attention_forward att", &att, &att_w, 1e-6, 1e-5);
            let mut dq = vec![f32::NAN; dims.q_len()];
            let (mut dk, mut dv) = (vec![f32::NAN; dims.kv_len()], vec![f32::NAN; dims.kv_len()]);
            let mut scratch = vec![f32::NAN; dims.att_len()];
            ops::gqa_attention_backward(
                &cpu,
                &mut dq,
                &mut dk,
                &mut dv,
                &mut scratch,
                &dout,
                &q,
                &k,
                &v,
                &att,
                dims,
            );
            check("gqa_attention_backward dq", &dq, &dq_w, 1e-5, 1e-5);
            check("gqa_attention_backward dk", &dk, &dk_w, 1e-5, 1e-5);
            check("gqa_attention_backward dv", &dv, &dv_w, 1e-5, 1e-5);
        }
    }
}

#[test]
fn gqa_attention_with_as_many_kv_heads_is_gpt2_attention() {
    let mut rng = StdRng::seed_from_u64(15);
    let (b, t, nh, hs) = (2, 13, 3, 8);
    let c = nh * hs;
    let dims = GqaDims {
        b,
        t,
        h: nh,
        kv: nh,
        d: hs,
    };
    let qkv = random(&mut rng, b * t * 3 * c, 2.0);
    let part = |p: usize| -> Vec<f32> {
        qkv.chunks_exact(3 * c)
            .flat_map(|row| row[p * c..][..c].to_vec())
            .collect()
    };
    let (q, k, v) = (part(0), part(1), part(2));
    let cpu = Cpu::default();
    let (mut out_g, mut att_g) = (vec![0.0; b * t * c], vec![0.0; b * nh * t * t]);
    ops::attention_forward(&cpu, &mut out_g, &mut att_g, &qkv, b, t, c, nh);
    let (mut out, mut att) = (vec![0.0; b * t * c], vec![0.0; b * nh * t * t]);
    ops::gqa_attention_forward(&cpu, &mut out, &mut att, &q, &k, &v, dims);
    assert_eq!(out, out_g);
    assert_eq!(att, att_g);
}

#[test]
fn backward_passes_match_finite_differences() {
    let mut rng = StdRng::seed_from_u64(16);
    // RMSNorm: loss = w . out.
    let (n, c, eps) = (3, 5, 1e-6);
    let inp = random64(&mut rng, n * c, 1.5);
    let weight = random64(&mut rng, c, 1.5);
    let w = random64(&mut rng, n * c, 1.0);
    let forward = |inp: &[f64], weight: &[f64]| {
        let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
        rl::rmsnorm_forward(&mut out, &mut rstd, inp, weight, eps, n, c);
        (out, rstd)
    };
    let (_, rstd) = forward(&inp, &weight);
    let (mut dinp, mut dweight) = (vec![0.0; n * c], vec![0.0; c]);
    rl::rmsnorm_backward(&mut dinp, &mut dweight, &w, &inp, &weight, &rstd, n, c);
    check_fd("rmsnorm dinp", &inp, &dinp, |x| {
        dot(&w, &forward(x, &weight).0)
    });
    check_fd("rmsnorm dweight", &weight, &dweight, |x| {
        dot(&w, &forward(&inp, x).0)
    });

    // RoPE: loss = w . out.
    let (b, t, h, d) = (2, 3, 2, 4);
    let (mut cos, mut sin) = (vec![0.0; t * d / 2], vec![0.0; t * d / 2]);
    rl::rope_table(&mut cos, &mut sin, &rl::rope_inv_freq(100.0, d), t);
    let x = random64(&mut rng, b * t * h * d, 1.0);
    let w = random64(&mut rng, x.len(), 1.0);
    let mut dx = vec![0.0; x.len()];
    rl::rope_backward(&mut dx, &w, &cos, &sin, b, t, h, d);
    check_fd("rope dinp", &x, &dx, |x| {
        let mut out = vec![0.0; x.len()];
        rl::rope_forward(&mut out, x, &cos, &sin, b, t, h, d);
        dot(&w, &out)
    });

    // SwiGLU: loss = w . out.
    let gate = random64(&mut rng, 9, 4.0);
    let up = random64(&mut rng, 9, 2.0);
    let w = random64(&mut rng, 9, 1.0);
    let (mut dgate, mut dup) = (vec![0.0; 9], vec![0.0; 9]);
    rl::swiglu_backward(&mut dgate, &mut dup, &w, &gate, &up);
    let swiglu = |g: &[f64], u: &[f64]| {
        let mut out = vec![0.0; 9];
        rl::swiglu_forward(&mut out, g, u);
        dot(&w, &out)
    };
    check_fd("swiglu dgate", &gate, &dgate, |x| swiglu(x, &up));
    check_fd("swiglu dup", &up, &dup, |x| swiglu(&gate, x));

    // Grouped-query attention, two query heads per key/value head: loss = w . out.
    let dims = GqaDims {
        b: 1,
        t: 4,
        h: 4,
        kv: 2,
        d: 3,
    };
    let q = random64(&mut rng, dims.q_len(), 1.0);
    let k = random64(&mut rng, dims.kv_len(), 1.0);
    let v = random64(&mut rng, dims.kv_len(), 1.0);
    let w = random64(&mut rng, dims.q_len(), 1.0);
    let attention = |q: &[f64], k: &[f64], v: &[f64]| {
        let (mut out, mut att) = (vec![0.0; dims.q_len()], vec![0.0; dims.att_len()]);
        rl::gqa_attention_forward(&mut out, &mut att, q, k, v, dims);
        (out, att)
    };
    let (_, att) = attention(&q, &k, &v);
    let mut dq = vec![0.0; dims.q_len()];
    let (mut dk, mut dv) = (vec![0.0; dims.kv_len()], vec![0.0; dims.kv_len()]);
    rl::gqa_attention_backward(&mut dq, &mut dk, &mut dv, &w, &q, &k, &v, &att, dims);
    check_fd("attention dq", &q, &dq, |x| {
        dot(&w, &attention(x, &k, &v).0)
    });
    check_fd("attention dk", &k, &dk, |x| {
        dot(&w, &attention(&q, x, &v).0)
    });
    check_fd("attention dv", &v, &dv, |x| {
        dot(&w, &attention(&q, &k, x).0)
    });
}

/// Memory for [`run_cpu`]: one f32 vector per binding, each tensor at its offset.
struct Buffers(Vec<Vec<f32>>);

impl CpuMemory for Buffers {
    fn address(&self, t: &TensorRef) -> *mut u8 {
        let buf = &self.0[t.buf as usize];
        assert!(t.offset_bytes + t.bytes() <= buf.len() * 4);
        // SAFETY: inside the vector (checked above).
        unsafe { buf.as_ptr().cast::<u8>().cast_mut().add(t.offset_bytes) }
    }
}

impl Buffers {
    /// A new binding holding `values` after `pad` elements of padding (so that offsets
    /// are exercised), and the tensor of `values` in it.
    fn add(&mut self, values: &[f32], pad: usize) -> TensorRef {
        let mut buf = vec![f32::NAN; pad];
        buf.extend_from_slice(values);
        self.0.push(buf);
        TensorRef::new((self.0.len() - 1) as u8, pad * 4, values.len(), Dtype::F32)
    }

    fn get(&self, t: &TensorRef) -> &[f32] {
        &self.0[t.buf as usize][t.offset_bytes / 4..][..t.len]
    }

    fn run(&self, kernel: &Kernel, cpu: &Cpu) -> Result<(), KernelError> {
        // SAFETY: every tensor lies inside its own vector; nothing else touches them.
        unsafe { run_cpu(kernel, cpu, &Scalars::default(), self) }
    }
}

#[test]
fn run_cpu_runs_the_llama_kernels_as_the_direct_calls() {
    let mut rng = StdRng::seed_from_u64(17);
    let cpu = Cpu::default();
    let mut m = Buffers(Vec::new());

    // RMSNorm, forward then backward (accumulating into non-zero gradients).
    let (n, c, eps) = (6, 67, 1e-6f32);
    let inp = random(&mut rng, n * c, 2.0);
    let weight = random(&mut rng, c, 1.0);
    let dout = random(&mut rng, n * c, 1.0);
    let dinp0 = random(&mut rng, n * c, 1.0);
    let dweight0 = random(&mut rng, c, 1.0);
    let (out_t, rstd_t) = (m.add(&vec![0.0; n * c], 3), m.add(&vec![0.0; n], 1));
    let (inp_t, weight_t) = (m.add(&inp, 0), m.add(&weight, 5));
    let (dout_t, dinp_t, dweight_t) = (m.add(&dout, 2), m.add(&dinp0, 0), m.add(&dweight0, 7));
    m.run(
        &Kernel::RmsNorm(RmsNorm {
            out: out_t,
            rstd: rstd_t,
            inp: inp_t,
            weight: weight_t,
            eps,
            n,
            c,
        }),
        &cpu,
    )
    .unwrap();
    let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
    ops::rmsnorm_forward(&cpu, &mut out, &mut rstd, &inp, &weight, eps, n, c);
    assert_eq!((m.get(&out_t), m.get(&rstd_t)), (&out[..], &rstd[..]));
    m.run(
        &Kernel::RmsNormBackward(RmsNormBackward {
            dinp: dinp_t,
            dweight: Some(dweight_t),
            dout: dout_t,
            inp: inp_t,
            weight: weight_t,
            rstd: rstd_t,
            n,
            c,
        }),
        &cpu,
    )
    .unwrap();
    let (mut dinp, mut dweight) = (dinp0.clone(), dweight0.clone());
    ops::rmsnorm_backward(
        &cpu,
        &mut dinp,
        Some(&mut dweight),
        &dout,
        &inp,
        &weight,
        &rstd,
        n,
        c,
    );
    assert_eq!(
        (m.get(&dinp_t), m.get(&dweight_t)),
        (&dinp[..], &dweight[..])
    );

    // RoPE, the tables side by side in one binding.
    let (b, t, h, d) = (2, 13, 6, 12);
    let half = d / 2;
    let mut inv_freq = vec![0.0; half];
    ops::rope_inv_freq(&mut inv_freq, 500_000.0, d);
    let positions: Vec<u32> = (0..t as u32).collect();
    let (mut cos, mut sin) = (vec![0.0; t * half], vec![0.0; t * half]);
    ops::rope_table(&mut cos, &mut sin, &inv_freq, &positions);
    let tables = m.add(&[cos.clone(), sin.clone()].concat(), 4);
    let (cos_t, sin_t) = (tables.slice(0, t * half), tables.slice(t * half, t * half));
    let x = random(&mut rng, b * t * h * d, 2.0);
    let (x_t, y_t, dx_t) = (
        m.add(&x, 1),
        m.add(&vec![0.0; x.len()], 0),
        m.add(&vec![0.0; x.len()], 0),
    );
    let rope = Kernel::Rope(Rope {
        out: y_t,
        inp: x_t,
        cos: cos_t,
        sin: sin_t,
        doc_start: None,
        b,
        t,
        h,
        d,
    });
    m.run(&rope, &cpu).unwrap();
    let back = Kernel::RopeBackward(RopeBackward {
        dinp: dx_t,
        dout: x_t,
        cos: cos_t,
        sin: sin_t,
        doc_start: None,
        b,
        t,
        h,
        d,
    });
    m.run(&back, &cpu).unwrap();
    let (mut y, mut dx) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    ops::rope_forward(&cpu, &mut y, &x, &cos, &sin, None, b, t, h, d);
    ops::rope_backward(&cpu, &mut dx, &x, &cos, &sin, None, b, t, h, d);
    assert_eq!((m.get(&y_t), m.get(&dx_t)), (&y[..], &dx[..]));

    // SwiGLU.
    let len = 1001;
    let (gate, up, dout) = (
        random(&mut rng, len, 5.0),
        random(&mut rng, len, 2.0),
        random(&mut rng, len, 1.0),
    );
    let (gate_t, up_t, dout_t) = (m.add(&gate, 0), m.add(&up, 3), m.add(&dout, 1));
    let (out_t, dgate_t, dup_t) = (
        m.add(&vec![0.0; len], 0),
        m.add(&vec![0.0; len], 2),
        m.add(&vec![0.0; len], 0),
    );
    m.run(
        &Kernel::SwiGlu(SwiGlu {
            out: out_t,
            gate: gate_t,
            up: up_t,
        }),
        &cpu,
    )
    .unwrap();
    m.run(
        &Kernel::SwiGluBackward(SwiGluBackward {
            dgate: dgate_t,
            dup: dup_t,
            dout: dout_t,
            gate: gate_t,
            up: up_t,
        }),
        &cpu,
    )
    .unwrap();
    let (mut out, mut dgate, mut dup) = (vec![0.0; len], vec![0.0; len], vec![0.0; len]);
    ops::swiglu_forward(&cpu, &mut out, &gate, &up);
    ops::swiglu_backward(&cpu, &mut dgate, &mut dup, &dout, &gate, &up);
    assert_eq!(m.get(&out_t), &out[..]);
    assert_eq!((m.get(&dgate_t), m.get(&dup_t)), (&dgate[..], &dup[..]));

    // Grouped-query attention, forward and backward.
    let dims = GqaDims {
        b: 2,
        t: 13,
        h: 6,
        kv: 2,
        d: 12,
    };
    let (q, k, v) = (
        random(&mut rng, dims.q_len(), 2.0),
        random(&mut rng, dims.kv_len(), 2.0),
        random(&mut rng, dims.kv_len(), 2.0),
    );
    let dout = random(&mut rng, dims.q_len(), 1.0);
    let (q_t, k_t, v_t, dout_t) = (m.add(&q, 0), m.add(&k, 1), m.add(&v, 2), m.add(&dout, 3));
    let (out_t, att_t) = (
        m.add(&vec![0.0; dims.q_len()], 0),
        m.add(&vec![0.0; dims.att_len()], 0),
    );
    let (dq_t, dk_t, dv_t) = (
        m.add(&vec![0.0; dims.q_len()], 0),
        m.add(&vec![0.0; dims.kv_len()], 1),
        m.add(&vec![0.0; dims.kv_len()], 0),
    );
    let GqaDims { b, t, h, kv, d } = dims;
    let bytes = gqa_attention_scratch_bytes(Target::Cpu, Dtype::F32, b, t, h, kv, d);
    let scratch = m.add(&vec![f32::NAN; bytes / 4], 0);
    let scratch = TensorRef {
        dtype: Dtype::U8,
        len: bytes,
        ..scratch
    };
    m.run(
        &Kernel::GqaAttention(GqaAttention {
            out: out_t,
            att: att_t,
            q: q_t,
            k: k_t,
            v: v_t,
            scratch,
            b,
            t,
            h,
            kv,
            d,
        }),
        &cpu,
    )
    .unwrap();
    let gqa_backward = |h: usize, kv: usize, scratch: TensorRef| {
        Kernel::GqaAttentionBackward(GqaAttentionBackward {
            dq: dq_t,
            dk: dk_t,
            dv: dv_t,
            dout: dout_t,
            q: q_t,
            k: k_t,
            v: v_t,
            att: att_t,
            scratch,
            b,
            t,
            h,
            kv,
            d,
        })
    };
    let backward = gqa_backward(h, kv, scratch);
    m.run(&backward, &cpu).unwrap();
    let (mut out, mut att) = (vec![0.0; dims.q_len()], vec![0.0; dims.att_len()]);
    ops::gqa_attention_forward(&cpu, &mut out, &mut att, &q, &k, &v, dims);
    let mut dq = vec![0.0; dims.q_len()];
    let (mut dk, mut dv) = (vec![0.0; dims.kv_len()], vec![0.0; dims.kv_len()]);
    let mut scratch_direct = vec![0.0; dims.att_len()];
    ops::gqa_attention_backward(
        &cpu,
        &mut dq,
        &mut dk,
        &mut dv,
        &mut scratch_direct,
        &dout,
        &q,
        &k,
        &v,
        &att,
        dims,
    );
    assert_eq!((m.get(&out_t), m.get(&att_t)), (&out[..], &att[..]));
    assert_eq!(m.get(&dq_t), &dq[..]);
    assert_eq!((m.get(&dk_t), m.get(&dv_t)), (&dk[..], &dv[..]));

    // Refusals: key/value heads that do not divide the query heads, and a scratch too
    // small, are errors naming what is wrong.
    let e = m.run(&gqa_backward(6, 4, scratch), &cpu).unwrap_err();
    assert!(e.to_string().contains("query heads"), "{e}");
    let e = m
        .run(&gqa_backward(6, 2, scratch.slice(0, bytes - 4)), &cpu)
        .unwrap_err();
    assert!(e.to_string().contains("scratch"), "{e}");
    assert!(
        Kernel::GqaAttention(GqaAttention {
            out: out_t,
            att: att_t,
            q: q_t,
            k: k_t,
            v: v_t,
            scratch,
            b,
            t,
            h,
            kv,
            d
        })
        .flops()
            > 0.0
    );
}
