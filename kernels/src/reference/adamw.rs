//! The scalar reference of AdamW (`crate::adamw`), element by element in torch's order of
//! operations: `torch.optim.AdamW`'s single-tensor path, with the same f32 constants.
//! bf16 state has a reference in the kernels' order instead ([`step_bf16`]), so that the
//! kernels can be held to it bit for bit.
//!
//! Not tuned and never dispatched to; the kernels are tested against it.

use half::{bf16, f16};

use crate::adamw::{AdamStep, CopyOut, GradStats, Grads, Q8State, q8};

fn grad_at(grads: &Grads<'_>, i: usize) -> f32 {
    match grads {
        Grads::F32(g) => g[i],
        Grads::F16(g) => g[i].to_f32(),
        Grads::Bf16(g) => g[i].to_f32(),
    }
}

fn write_copy(copy_out: &mut CopyOut<'_>, i: usize, p: f32) {
    match copy_out {
        CopyOut::None => {}
        CopyOut::F16(o) => o[i] = f16::from_f32(p),
        CopyOut::Bf16(o) => o[i] = bf16::from_f32(p),
    }
}

/// The moments and parameter after one step, as torch computes them:
/// `p.mul_(1 - lr*wd)`, `m.lerp_(g, 1 - beta1)`, `v.mul_(beta2).addcmul_(g, g, 1 - beta2)`,
/// `denom = v.sqrt() / bias_correction2_sqrt + eps`, `p.addcdiv_(m, denom, -step_size)`.
fn update(k: &AdamStep, p: f32, m: f32, v: f32, grad: f32) -> (f32, f32, f32) {
    let g = grad * k.grad_scale;
    let p = p * k.decay;
    let m = m + k.one_minus_beta1 * (g - m);
    let v = v * k.beta2 + k.one_minus_beta2 * g * g;
    let denom = v.sqrt() / k.bias_correction2_sqrt + k.eps;
    let p = p + (-k.step_size) * m / denom;
    (p, m, v)
}

/// One AdamW step with fp32 state. Panics if the lengths differ.
pub fn step(
    k: &AdamStep,
    params: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    grads: Grads<'_>,
    mut copy_out: CopyOut<'_>,
) {
    let n = params.len();
    assert!(m.len() == n && v.len() == n && grads.len() == n);
    assert!(copy_out.buffer_len().is_none_or(|len| len == n));
    for i in 0..n {
        let (p, mi, vi) = update(k, params[i], m[i], v[i], grad_at(&grads, i));
        params[i] = p;
        m[i] = mi;
        v[i] = vi;
        write_copy(&mut copy_out, i, p);
    }
}

/// How the kernels' order of operations rounds: the AVX2 and AVX-512 kernels fuse
/// multiply-adds (one rounding), the portable kernel does not (the baseline x86-64 target
/// has no FMA, and Rust never contracts `a * b + c` on its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arithmetic {
    /// `a * b + c` rounded once (`f32::mul_add`).
    Fused,
    /// The product rounded, then the sum.
    Unfused,
}

impl Arithmetic {
    fn mul_add(self, a: f32, b: f32, c: f32) -> f32 {
        match self {
            Arithmetic::Fused => a.mul_add(b, c),
            Arithmetic::Unfused => a * b + c,
        }
    }
}

/// The moments and parameter after one step in the kernels' order (see `avx2.rs`'s
/// `update`): `m = beta1 m + (1 - beta1) g`, `v = beta2 v + ((1 - beta2) g) g`,
/// `denom = sqrt(v) * (1 / sqrt(1 - beta2^t)) + eps`, `p = p decay - step_size (m / denom)`,
/// each `x * y + z` rounded as `arithmetic` says.
fn update_kernel_order(
    k: &AdamStep,
    arithmetic: Arithmetic,
    p: f32,
    m: f32,
    v: f32,
    grad: f32,
) -> (f32, f32, f32) {
    let fma = |a, b, c| arithmetic.mul_add(a, b, c);
    let g = grad * k.grad_scale;
    let m = fma(k.beta1, m, k.one_minus_beta1 * g);
    let v = fma(k.beta2, v, k.one_minus_beta2 * g * g);
    let denom = fma(v.sqrt(), k.inv_bias_correction2_sqrt, k.eps);
    let p = fma(-k.step_size, m / denom, p * k.decay);
    (p, m, v)
}

/// One AdamW step with bf16 state, in the kernels' order of operations: each moment is
/// widened to f32 (exactly), updated, and rounded back to bf16 to nearest, ties to even
/// (`half::bf16::from_f32`, NaN kept NaN); the parameter update uses the new moments
/// before that rounding. Panics if the lengths differ.
pub fn step_bf16(
    k: &AdamStep,
    arithmetic: Arithmetic,
    params: &mut [f32],
    m: &mut [bf16],
    v: &mut [bf16],
    grads: Grads<'_>,
    mut copy_out: CopyOut<'_>,
) {
    let n = params.len();
    assert!(m.len() == n && v.len() == n && grads.len() == n);
    assert!(copy_out.buffer_len().is_none_or(|len| len == n));
    for i in 0..n {
        let (p, mi, vi) = update_kernel_order(
            k,
            arithmetic,
            params[i],
            m[i].to_f32(),
            v[i].to_f32(),
            grad_at(&grads, i),
        );
        params[i] = p;
        m[i] = bf16::from_f32(mi);
        v[i] = bf16::from_f32(vi);
        write_copy(&mut copy_out, i, p);
    }
}

/// One AdamW step with 8-bit state ([`q8`]): per block, decode m and sqrt(v), update in
/// f32 as [`step`] does, then encode the new moments with the block's new scales.
/// Panics if the lengths do not fit.
pub fn step_q8(
    k: &AdamStep,
    params: &mut [f32],
    state: Q8State<'_>,
    grads: Grads<'_>,
    mut copy_out: CopyOut<'_>,
) {
    let n = params.len();
    assert!(state.m_codes.len() == n && state.v_codes.len() == n && grads.len() == n);
    assert!(state.m_scales.len() == q8::scale_count(n));
    assert!(state.v_scales.len() == q8::scale_count(n));
    assert!(copy_out.buffer_len().is_none_or(|len| len == n));
    let mut m_new = [0f32; q8::BLOCK];
    let mut r_new = [0f32; q8::BLOCK];
    for block in 0..q8::scale_count(n) {
        let start = block * q8::BLOCK;
        let end = (start + q8::BLOCK).min(n);
        let (m_scale, v_scale) = (state.m_scales[block], state.v_scales[block]);
        let (mut m_absmax, mut r_max) = (0f32, 0f32);
        for i in start..end {
            let m = q8::decode_m(state.m_codes[i], m_scale);
            let r = q8::decode_r(state.v_codes[i], v_scale);
            let (p, m, v) = update(k, params[i], m, r * r, grad_at(&grads, i));
            params[i] = p;
            write_copy(&mut copy_out, i, p);
            let r = v.sqrt();
            m_new[i - start] = m;
            r_new[i - start] = r;
            m_absmax = m_absmax.max(m.abs());
            r_max = r_max.max(r);
        }
        let (m_scale, m_inv) = q8::m_scales(m_absmax);
        let (v_scale, r_inv) = q8::r_scales(r_max);
        state.m_scales[block] = m_scale;
        state.v_scales[block] = v_scale;
        for i in start..end {
            state.m_codes[i] = q8::encode_m(m_new[i - start], m_inv);
            state.v_codes[i] = q8::encode_r(r_new[i - start], r_inv);
        }
    }
}

/// Sum of squares of `grads * scale` (the product in f32, as the step computes it; the
/// square and sum in f64) and whether any product is not finite.
pub fn grad_stats(grads: Grads<'_>, scale: f32) -> GradStats {
    let mut sum = 0f64;
    let mut non_finite = false;
    for i in 0..grads.len() {
        let g = grad_at(&grads, i) * scale;
        non_finite |= !g.is_finite();
        sum += f64::from(g) * f64::from(g);
    }
    GradStats {
        sum_squares: sum,
        non_finite,
    }
}
