//! `cargo bench -p strata-kernels --bench llama_kernels`: CPU throughput of the Llama
//! family's RMSNorm and grouped-query attention at a Llama-ish size (Llama 3 8B's
//! attention shapes, one sequence of 1024 tokens; RMSNorm over 4096 rows of 4096), on
//! every thread of the pool and the active instruction set. Prints the best of a few
//! runs of each kernel: GB/s moved for RMSNorm, GFLOP/s for attention (counting the
//! causal products as the kernels compute them, about half of the full T × T).

use std::time::Instant;

use strata_kernels::ops::{self, Cpu, GqaDims};

/// The best time of `runs` runs of `f`, in seconds.
fn best(runs: usize, mut f: impl FnMut()) -> f64 {
    (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Deterministic values in [-1, 1).
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn main() {
    let cpu = Cpu::default();
    println!("{} threads, {}", cpu.threads, cpu.isa);

    let (n, c) = (4096, 4096);
    let inp = values(n * c, 1);
    let weight = values(c, 2);
    let dout = values(n * c, 3);
    let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
    let secs = best(5, || {
        ops::rmsnorm_forward(&cpu, &mut out, &mut rstd, &inp, &weight, 1e-5, n, c)
    });
    // Reads inp, writes out.
    let gb = (2 * n * c * 4) as f64 / 1e9;
    println!(
        "rmsnorm forward  {n}x{c}: {:.2} ms, {:.1} GB/s",
        secs * 1e3,
        gb / secs
    );
    let (mut dinp, mut dweight) = (vec![0.0; n * c], vec![0.0; c]);
    let secs = best(5, || {
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
        )
    });
    // Two passes over inp and dout, one read and write of dinp.
    let gb = (6 * n * c * 4) as f64 / 1e9;
    println!(
        "rmsnorm backward {n}x{c}: {:.2} ms, {:.1} GB/s",
        secs * 1e3,
        gb / secs
    );

    let dims = GqaDims {
        b: 1,
        t: 1024,
        h: 32,
        kv: 8,
        d: 128,
    };
    let q = values(dims.q_len(), 4);
    let k = values(dims.kv_len(), 5);
    let v = values(dims.kv_len(), 6);
    let dy = values(dims.q_len(), 7);
    let (mut y, mut att) = (vec![0.0; dims.q_len()], vec![0.0; dims.att_len()]);
    let causal_flops = |products: f64| {
        let GqaDims { b, t, h, d, .. } = dims;
        products * (b * h * d) as f64 * (t * (t + 1)) as f64
    };
    let secs = best(3, || {
        ops::gqa_attention_forward(&cpu, &mut y, &mut att, &q, &k, &v, dims)
    });
    println!(
        "gqa attention forward  {dims:?}: {:.1} ms, {:.1} GFLOP/s",
        secs * 1e3,
        causal_flops(2.0) / secs / 1e9
    );
    let mut dq = vec![0.0; dims.q_len()];
    let (mut dk, mut dv) = (vec![0.0; dims.kv_len()], vec![0.0; dims.kv_len()]);
    let mut scratch = vec![0.0; dims.att_len()];
    let secs = best(3, || {
        ops::gqa_attention_backward(
            &cpu,
            &mut dq,
            &mut dk,
            &mut dv,
            &mut scratch,
            &dy,
            &q,
            &k,
            &v,
            &att,
            dims,
        )
    });
    println!(
        "gqa attention backward {dims:?}: {:.1} ms, {:.1} GFLOP/s",
        secs * 1e3,
        causal_flops(4.0) / secs / 1e9
    );
}
