//! Vector math for the elementwise kernels, and running a kernel body under an [`Isa`].
//!
//! Kernel bodies are written once, in plain Rust over [`LANES`] independent f32 lanes
//! (separate accumulators, no branches in the loop body, no calls into libm), so that
//! the compiler vectorises them. [`run`] calls a body inside a function compiled with
//! `#[target_feature]` for the chosen instruction set; the body and the helpers here are
//! inlined into it, so the same source becomes SSE2, AVX2+FMA or AVX-512 code. This is
//! the only file of the CPU kernels that selects instruction sets; the fp16 casts, which
//! need the F16C instructions by name, and the matrix product's register tiles
//! (`gemm/tile.rs`, run through [`run`] like every body here) are the other places with
//! `unsafe` SIMD.
//!
//! The helpers' results differ from libm's in the last bits ([`exp`] is within 2 ulp);
//! the tests compare kernels with the reference with a tolerance.

use crate::isa::Isa;

/// Lanes per step of a vectorised loop: one AVX-512 register of f32, two AVX2 ones.
pub const LANES: usize = 16;

/// Runs `body` compiled for `isa`. Panics if this CPU does not support `isa` (callers
/// get their `Isa` from [`Isa::active`] or [`Isa::supported`]).
///
/// Mark the closure `#[inline(always)]` (or use `on_isa!`, which does): a closure is
/// called from three places here, and without the mark the compiler keeps it as one
/// out-of-line function built for the baseline target, so no `isa` would take effect.
#[inline(always)]
pub fn run<R>(isa: Isa, body: impl FnOnce() -> R) -> R {
    match isa {
        Isa::Portable => body(),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            assert!(isa.is_supported(), "this CPU lacks AVX2, FMA or F16C");
            // SAFETY: the CPU supports every feature `run_avx2` is compiled for (checked
            // just above).
            unsafe { run_avx2(body) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            assert!(isa.is_supported(), "this CPU lacks AVX-512F");
            // SAFETY: the CPU supports every feature `run_avx512` is compiled for
            // (checked just above).
            unsafe { run_avx512(body) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        _ => panic!("{isa} kernels exist only on x86-64"),
    }
}

/// `on_isa!(isa, body)`: evaluates the expression `body` compiled for `isa`, through
/// [`run`] with the closure marked `#[inline(always)]` as it must be.
macro_rules! on_isa {
    ($isa:expr, $body:expr $(,)?) => {
        $crate::ops::simd::run(
            $isa,
            #[inline(always)]
            || $body,
        )
    };
}
pub(crate) use on_isa;

/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_avx2<R>(body: impl FnOnce() -> R) -> R {
    body()
}

/// # Safety
/// The CPU must support AVX-512F, AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn run_avx512<R>(body: impl FnOnce() -> R) -> R {
    body()
}

/// e^x, branch-free (Cephes' polynomial on a range-reduced argument). Inputs are clamped
/// to [-87.3, 88]: below, the result is about 1.2e-38 rather than 0 or a subnormal;
/// above, about 1.65e38 rather than infinity. Both are harmless for softmax and tanh.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer.
    let x = x.clamp(-87.3, 88.0);
    let t = x * std::f32::consts::LOG2_E + MAGIC;
    let n = t - MAGIC;
    // x - n ln 2, with ln 2 split in two so that the product is exact.
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let y = p * r * r + r + 1.0;
    // n is in the low mantissa bits of t; 2^n is built from it as an exponent field.
    let n_int = t.to_bits().wrapping_sub(MAGIC.to_bits());
    y * f32::from_bits(n_int.wrapping_add(127) << 23)
}

/// The logistic function 1 / (1 + e^-x), accurate in relative terms for very negative x
/// (where 1 + tanh(x / 2), its other form, cancels).
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// Adds up lanes in a fixed order.
#[inline(always)]
fn reduce_add(acc: [f32; LANES]) -> f32 {
    let mut half = [0.0f32; LANES / 2];
    for i in 0..LANES / 2 {
        half[i] = acc[i] + acc[i + LANES / 2];
    }
    let mut quarter = [0.0f32; LANES / 4];
    for i in 0..LANES / 4 {
        quarter[i] = half[i] + half[i + LANES / 4];
    }
    (quarter[0] + quarter[2]) + (quarter[1] + quarter[3])
}

/// The sum of `x`.
#[inline(always)]
pub fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for i in 0..LANES {
            acc[i] += chunk[i];
        }
    }
    let mut s = reduce_add(acc);
    for &v in tail {
        s += v;
    }
    s
}

/// The sum of `(x - center)^2`.
#[inline(always)]
pub fn sum_squared_deviation(x: &[f32], center: f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for i in 0..LANES {
            let d = chunk[i] - center;
            acc[i] += d * d;
        }
    }
    let mut s = reduce_add(acc);
    for &v in tail {
        s += (v - center) * (v - center);
    }
    s
}

/// The dot product of `a` and `b` (equal lengths).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = reduce_add(acc);
    for (x, y) in ta.iter().zip(tb) {
        s += x * y;
    }
    s
}

/// The largest element of `x` (negative infinity for an empty slice; NaNs are skipped).
#[inline(always)]
pub fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for i in 0..LANES {
            acc[i] = acc[i].max(chunk[i]);
        }
    }
    let mut m = f32::NEG_INFINITY;
    for a in acc.into_iter().chain(tail.iter().copied()) {
        m = m.max(a);
    }
    m
}

/// Replaces each `x` by `e^(x - shift)` and returns their sum.
///
/// Two simple loops rather than one: the compiler vectorises an elementwise loop over
/// [`exp`] but not a lane-array loop around it.
#[inline(always)]
pub fn exp_shifted_in_place(x: &mut [f32], shift: f32) -> f32 {
    for v in x.iter_mut() {
        *v = exp(*v - shift);
    }
    sum(x)
}

/// The sum of `e^(x - shift)`, leaving `x` as it is (through a small buffer on the
/// stack, for the reason given at [`exp_shifted_in_place`]).
#[inline(always)]
pub fn exp_shifted_sum(x: &[f32], shift: f32) -> f32 {
    let mut buffer = [0.0f32; 256];
    let mut total = 0.0;
    for chunk in x.chunks(buffer.len()) {
        let part = &mut buffer[..chunk.len()];
        for (b, &v) in part.iter_mut().zip(chunk) {
            *b = exp(v - shift);
        }
        total += sum(part);
    }
    total
}

/// Multiplies each element by `factor`.
#[inline(always)]
pub fn scale_in_place(x: &mut [f32], factor: f32) {
    for v in x {
        *v *= factor;
    }
}

/// `dst += src`, element by element.
#[inline(always)]
pub fn add_assign(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len());
    for (d, s) in dst.iter_mut().zip(src) {
        *d += s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_and_sigmoid_match_libm_on_every_isa() {
        let xs: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.043).collect();
        for isa in Isa::supported() {
            run(
                isa,
                #[inline(always)]
                || {
                    for &x in &xs {
                        let (ours, libm) = (exp(x), x.exp());
                        if x > -87.0 && x < 88.0 {
                            let rel = ((ours - libm) / libm).abs();
                            assert!(rel < 2.5e-7, "{isa} exp({x}) = {ours}, libm {libm}");
                        }
                        let (ours, libm) = (sigmoid(x), 1.0 / (1.0 + (-x as f64).exp()));
                        let rel = ((ours as f64 - libm) / libm).abs();
                        assert!(
                            rel < 5e-7 || x < -87.0,
                            "{isa} sigmoid({x}) = {ours}, libm {libm}"
                        );
                    }
                },
            );
        }
        assert!(exp(-1000.0) < 1.3e-38 && exp(-1000.0) >= 0.0);
        assert!(exp(1000.0).is_finite());
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn reductions_match_plain_loops() {
        for len in [0usize, 1, 7, 15, 16, 17, 22, 100, 4097] {
            let a: Vec<f32> = (0..len)
                .map(|i| ((i * 37) % 101) as f32 * 0.01 - 0.4)
                .collect();
            let b: Vec<f32> = (0..len)
                .map(|i| ((i * 53) % 97) as f32 * 0.02 - 0.9)
                .collect();
            let plain_sum: f64 = a.iter().map(|&x| x as f64).sum();
            let plain_dot: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            let plain_max = a.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert!((sum(&a) as f64 - plain_sum).abs() < 1e-4);
            assert!((dot(&a, &b) as f64 - plain_dot).abs() < 1e-4);
            assert_eq!(max(&a), plain_max);
        }
    }
}
