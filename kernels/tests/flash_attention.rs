//! The fused attention kernels (FlashAttention-2's algorithm on the CPU: no T × T
//! probabilities, a fixed scratch per head) against the materialised scalar reference
//! in f64, element by element: output, log-sum-exp and the gradients of q, k and v, on
//! odd sizes (T = 1, 7, 129 and 1000, across the tiles' edges), grouped-query heads,
//! sliding windows and packed documents, every instruction set this CPU has, one and
//! several threads; GPT-2's fused-qkv form against the same reference; and the fused
//! output against the materialised CPU kernel's.

mod ops_support;

use ops_support::{check, cpus, random, wide};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use strata_kernels::ops;
use strata_kernels::reference::llama::{self as rl, AttnMask, GqaDims};

/// Document starts for `b` sequences of `t` positions, documents of random lengths
/// (1 to `longest`).
fn documents(rng: &mut StdRng, b: usize, t: usize, longest: usize) -> Vec<u32> {
    let mut starts = Vec::with_capacity(b * t);
    for _ in 0..b {
        let mut start = 0;
        while start < t {
            let len = rng.random_range(1..=longest).min(t - start);
            starts.extend(std::iter::repeat_n(start as u32, len));
            start += len;
        }
    }
    starts
}

/// What the reference gives: out, lse, dq, dk, dv.
struct Want {
    out: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

fn reference(
    (q, k, v, dout): (&[f32], &[f32], &[f32], &[f32]),
    dims: GqaDims,
    mask: AttnMask<'_>,
) -> Want {
    let (q, k, v) = (wide(q), wide(k), wide(v));
    let mut out = vec![0.0; dims.q_len()];
    let mut att = vec![0.0; dims.att_len()];
    rl::gqa_attention_forward_masked(&mut out, &mut att, &q, &k, &v, dims, mask);
    let mut dq = vec![0.0; dims.q_len()];
    let (mut dk, mut dv) = (vec![0.0; dims.kv_len()], vec![0.0; dims.kv_len()]);
    let dout = wide(dout);
    rl::gqa_attention_backward(&mut dq, &mut dk, &mut dv, &dout, &q, &k, &v, &att, dims);
    let GqaDims { b, t, h, kv, d } = dims;
    let scale = 1.0 / (d as f64).sqrt();
    let mut lse = vec![0.0; b * h * t];
    for bi in 0..b {
        for hi in 0..h {
            for ti in 0..t {
                let qr = &q[((bi * t + ti) * h + hi) * d..][..d];
                let scores: Vec<f64> = (mask.first_key(bi, ti, t)..=ti)
                    .map(|j| {
                        let kr = &k[((bi * t + j) * kv + dims.kv_head(hi)) * d..][..d];
                        qr.iter().zip(kr).map(|(a, b)| a * b).sum::<f64>() * scale
                    })
                    .collect();
                let top = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|s| (s - top).exp()).sum();
                lse[(bi * h + hi) * t + ti] = top + sum.ln();
            }
        }
    }
    Want {
        out,
        lse,
        dq,
        dk,
        dv,
    }
}

#[test]
fn fused_attention_matches_the_reference_on_odd_sizes_windows_and_documents() {
    let mut rng = StdRng::seed_from_u64(30);
    for (b, t, h, kv, d) in [
        (1, 1, 2, 1, 4),
        (2, 7, 6, 2, 12),
        (1, 129, 4, 2, 16),
        (1, 1000, 2, 1, 8),
    ] {
        let dims = GqaDims { b, t, h, kv, d };
        let q = random(&mut rng, dims.q_len(), 2.0);
        let k = random(&mut rng, dims.kv_len(), 2.0);
        let v = random(&mut rng, dims.kv_len(), 2.0);
        let dout = random(&mut rng, dims.q_len(), 1.0);
        let docs = documents(&mut rng, b, t, t.div_ceil(3).max(1));
        let masks = [
            ("causal", AttnMask::CAUSAL),
            (
                "window 5",
                AttnMask {
                    window: Some(5),
                    doc_start: None,
                },
            ),
            (
                "window 200",
                AttnMask {
                    window: Some(200),
                    doc_start: None,
                },
            ),
            (
                "documents",
                AttnMask {
                    window: None,
                    doc_start: Some(&docs),
                },
            ),
            (
                "documents, window 5",
                AttnMask {
                    window: Some(5),
                    doc_start: Some(&docs),
                },
            ),
        ];
        for (name, mask) in masks {
            let want = reference((&q, &k, &v, &dout), dims, mask);
            for cpu in cpus() {
                let what = |x: &str| format!("{x} ({b}, {t}, {h}, {kv}, {d}), {name}, {cpu:?}");
                let mut out = vec![f32::NAN; dims.q_len()];
                let mut lse = vec![f32::NAN; b * h * t];
                let mut scratch = vec![f32::NAN; ops::flash_scratch_len(dims)];
                let qkv = (&q[..], &k[..], &v[..]);
                ops::gqa_flash_attention_forward(
                    &cpu,
                    (&mut out, &mut lse, &mut scratch),
                    qkv,
                    dims,
                    mask,
                );
                check(&what("out"), &out, &want.out, 1e-5, 1e-5);
                check(&what("lse"), &lse, &want.lse, 1e-5, 1e-5);
                let mut dq = vec![f32::NAN; dims.q_len()];
                let (mut dk, mut dv) =
                    (vec![f32::NAN; dims.kv_len()], vec![f32::NAN; dims.kv_len()]);
                scratch.fill(f32::NAN);
                ops::gqa_flash_attention_backward(
                    &cpu,
                    (&mut dq, &mut dk, &mut dv),
                    &mut scratch,
                    &dout,
                    qkv,
                    (&out, &lse),
                    dims,
                    mask,
                );
                check(&what("dq"), &dq, &want.dq, 1e-5, 1e-4);
                check(&what("dk"), &dk, &want.dk, 1e-5, 1e-4);
                check(&what("dv"), &dv, &want.dv, 1e-5, 1e-4);
            }
        }
    }
}

#[test]
fn gpt2_fused_attention_matches_the_reference() {
    let mut rng = StdRng::seed_from_u64(31);
    let (b, t, c, nh) = (2, 97, 24, 3);
    let hs = c / nh;
    let dims = GqaDims {
        b,
        t,
        h: nh,
        kv: nh,
        d: hs,
    };
    let qkv = random(&mut rng, b * t * 3 * c, 2.0);
    let dout = random(&mut rng, b * t * c, 1.0);
    let part = |p: usize| -> Vec<f32> {
        qkv.chunks_exact(3 * c)
            .flat_map(|row| row[p * c..][..c].to_vec())
            .collect()
    };
    let (q, k, v) = (part(0), part(1), part(2));
    let docs = documents(&mut rng, b, t, 40);
    for mask in [
        AttnMask::CAUSAL,
        AttnMask {
            window: Some(17),
            doc_start: Some(&docs),
        },
    ] {
        let want = reference((&q, &k, &v, &dout), dims, mask);
        for cpu in cpus() {
            let mut out = vec![f32::NAN; b * t * c];
            let mut lse = vec![f32::NAN; b * nh * t];
            let mut scratch = vec![f32::NAN; ops::flash_scratch_len(dims)];
            ops::flash_attention_forward(
                &cpu,
                (&mut out, &mut lse, &mut scratch),
                &qkv,
                (b, t, c, nh),
                mask,
            );
            check("gpt-2 out", &out, &want.out, 1e-5, 1e-5);
            check("gpt-2 lse", &lse, &want.lse, 1e-5, 1e-5);
            let mut dqkv = vec![f32::NAN; qkv.len()];
            ops::flash_attention_backward(
                &cpu,
                &mut dqkv,
                &mut scratch,
                (&dout, &qkv),
                (&out, &lse),
                (b, t, c, nh),
                mask,
            );
            let grads: Vec<f64> = (0..b * t)
                .flat_map(|row| {
                    [&want.dq, &want.dk, &want.dv]
                        .into_iter()
                        .flat_map(move |g| g[row * c..][..c].to_vec())
                })
                .collect();
            check("gpt-2 dqkv", &dqkv, &grads, 1e-5, 1e-4);
        }
    }
}

#[test]
fn fused_attention_gives_the_materialised_kernels_output() {
    let mut rng = StdRng::seed_from_u64(32);
    let dims = GqaDims {
        b: 2,
        t: 300,
        h: 4,
        kv: 2,
        d: 32,
    };
    let q = random(&mut rng, dims.q_len(), 2.0);
    let k = random(&mut rng, dims.kv_len(), 2.0);
    let v = random(&mut rng, dims.kv_len(), 2.0);
    for cpu in cpus() {
        let mut want = vec![0.0; dims.q_len()];
        let mut att = vec![0.0; dims.att_len()];
        ops::gqa_attention_forward(&cpu, &mut want, &mut att, &q, &k, &v, dims);
        let mut out = vec![f32::NAN; dims.q_len()];
        let mut lse = vec![f32::NAN; dims.b * dims.h * dims.t];
        let mut scratch = vec![0.0; ops::flash_scratch_len(dims)];
        let qkv = (&q[..], &k[..], &v[..]);
        ops::gqa_flash_attention_forward(
            &cpu,
            (&mut out, &mut lse, &mut scratch),
            qkv,
            dims,
            AttnMask::CAUSAL,
        );
        check("fused against materialised", &out, &wide(&want), 1e-5, 1e-5);
    }
}

#[test]
#[should_panic(expected = "not a run of positions")]
fn document_starts_that_are_not_runs_are_refused() {
    // Position 2 claims its document starts at 0, but position 1 started a new one.
    let starts = [0, 1, 0, 3];
    AttnMask {
        window: None,
        doc_start: Some(&starts),
    }
    .check(1, 4);
}
