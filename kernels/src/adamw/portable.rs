//! The portable AdamW kernels: plain Rust over fixed-size chunks, which the compiler
//! vectorises for the baseline target (SSE2 on x86-64: packed sqrt and division).
//! Always compiled; serves every CPU without a dedicated kernel. No `unsafe`.

use super::dispatch::{Kernels, Lane, Moment, Q8Block};
use super::{AdamStep, GradStats, q8};

/// Elements per chunk: wide enough for the compiler to fill any vector unit.
const CHUNK: usize = 16;

pub(super) struct Portable;

impl Kernels for Portable {
    const LANES: usize = CHUNK;

    unsafe fn vectors<S: Moment, G: Lane, O: Lane>(
        k: &AdamStep,
        p: &mut [f32],
        m: &mut [S],
        v: &mut [S],
        g: &[G],
        out: &mut [O],
    ) {
        moments(k, p, m, v, g, out);
    }

    unsafe fn q8_block<G: Lane, O: Lane>(k: &AdamStep, b: Q8Block<'_, G, O>) {
        let mut m = [0f32; q8::BLOCK];
        let mut v = [0f32; q8::BLOCK];
        for (j, (m, v)) in m.iter_mut().zip(&mut v).enumerate() {
            *m = q8::decode_m(b.m_codes[j], *b.m_scale);
            let r = q8::decode_r(b.v_codes[j], *b.v_scale);
            *v = r * r;
        }
        moments(k, b.p, &mut m, &mut v, b.g, b.out);
        // v becomes sqrt(v), the quantity stored. The maxima are taken in CHUNK lanes:
        // a single running maximum is one long dependency chain the compiler cannot
        // vectorise.
        for v in &mut v {
            *v = v.sqrt();
        }
        let mut m_lanes = [0f32; CHUNK];
        let mut r_lanes = [0f32; CHUNK];
        for (m, v) in m.chunks_exact(CHUNK).zip(v.chunks_exact(CHUNK)) {
            for l in 0..CHUNK {
                m_lanes[l] = m_lanes[l].max(m[l].abs());
                r_lanes[l] = r_lanes[l].max(v[l]);
            }
        }
        let m_absmax = m_lanes.iter().fold(0f32, |a, &b| a.max(b));
        let r_max = r_lanes.iter().fold(0f32, |a, &b| a.max(b));
        let (m_scale, m_inv) = q8::m_scales(m_absmax);
        let (v_scale, r_inv) = q8::r_scales(r_max);
        *b.m_scale = m_scale;
        *b.v_scale = v_scale;
        for j in 0..q8::BLOCK {
            b.m_codes[j] = q8::encode_m(m[j], m_inv);
            b.v_codes[j] = q8::encode_r(v[j], r_inv);
        }
    }

    unsafe fn sum_squares<G: Lane>(g: &[G], scale: f32) -> GradStats {
        let mut lanes = [0f64; super::STATS_LANES];
        for chunk in g.chunks(super::STATS_LANES) {
            for (acc, &x) in lanes.iter_mut().zip(chunk) {
                let x = f64::from(x.to_f32() * scale);
                *acc += x * x;
            }
        }
        GradStats::from_sum(pairwise(&lanes))
    }
}

/// AdamW over equal-length slices, chunk by chunk, with fp32 or bf16 moments (`S`):
/// conversions in their own loops, so the arithmetic loop has nothing in it that stops
/// the compiler vectorising it.
fn moments<S: Moment, G: Lane, O: Lane>(
    k: &AdamStep,
    p: &mut [f32],
    m: &mut [S],
    v: &mut [S],
    g: &[G],
    out: &mut [O],
) {
    let n = p.len();
    assert!(m.len() == n && v.len() == n && g.len() == n && out.len() == n);
    let mut start = 0;
    while start < n {
        let end = (start + CHUNK).min(n);
        let len = end - start;
        let mut grad = [0f32; CHUNK];
        let mut mf = [0f32; CHUNK];
        let mut vf = [0f32; CHUNK];
        G::to_f32_slice(&g[start..end], &mut grad[..len]);
        S::to_f32_slice(&m[start..end], &mut mf[..len]);
        S::to_f32_slice(&v[start..end], &mut vf[..len]);
        update_chunk(
            k,
            &mut p[start..end],
            &mut mf[..len],
            &mut vf[..len],
            &grad[..len],
        );
        S::from_f32_slice(&mf[..len], &mut m[start..end]);
        S::from_f32_slice(&vf[..len], &mut v[start..end]);
        O::from_f32_slice(&p[start..end], &mut out[start..end]);
        start = end;
    }
}

/// The arithmetic. The order of operations is the SIMD kernels' (multiply by
/// 1 / sqrt(1 - beta2^t) rather than divide by its inverse) without their fused
/// multiply-adds, which the baseline target lacks.
#[inline]
fn update_chunk(k: &AdamStep, p: &mut [f32], m: &mut [f32], v: &mut [f32], grad: &[f32]) {
    for (((p, m), v), &g) in p.iter_mut().zip(m).zip(v).zip(grad) {
        let g = g * k.grad_scale;
        *m = k.beta1 * *m + k.one_minus_beta1 * g;
        *v = k.beta2 * *v + k.one_minus_beta2 * g * g;
        let denom = v.sqrt() * k.inv_bias_correction2_sqrt + k.eps;
        *p = *p * k.decay - k.step_size * (*m / denom);
    }
}

/// Sums lanes pairwise: the order every kernel's horizontal sum uses.
pub(super) fn pairwise(lanes: &[f64]) -> f64 {
    if lanes.len() == 1 {
        return lanes[0];
    }
    let (a, b) = lanes.split_at(lanes.len() / 2);
    pairwise(a) + pairwise(b)
}
