//! The scalar reference of rotary position embeddings (`super`): their inverse
//! frequencies (the default and Llama 3's scaling, in f64), tables and rotations.
//!
//! Plain scalar loops, generic over [`Real`] so that the same code checks the fast
//! kernels in f32 and backward passes against finite differences in f64; nothing here is
//! tuned. Conventions are the fast kernels': row-major tensors, forward kernels
//! overwrite, backward kernels accumulate (`+=`) into parameter gradients.
#![allow(clippy::needless_range_loop)]

use crate::reference::{Real, r};

/// The default inverse frequencies of rotary embeddings over a head of `d` channels:
/// `theta^(-2i/d)` for `i < d/2`. Scaled variants (Llama 3's `rope_scaling`) are the
/// caller's: every RoPE kernel takes its table, built from the inverse frequencies the
/// caller chose.
pub fn rope_inv_freq(theta: f64, d: usize) -> Vec<f64> {
    (0..d / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / d as f64))
        .collect()
}

/// Llama 3.1's `rope_scaling` (`rope_type: llama3`) applied to default inverse
/// frequencies, in f64, as transformers' `_compute_llama3_parameters` writes it:
/// wavelengths `2π / f` below `old / high` kept, above `old / low` divided by `factor`,
/// between them interpolated with `smooth = (old / wavelength - low) / (high - low)`.
pub fn rope_inv_freq_llama3(
    inv_freq: &[f64],
    factor: f64,
    low: f64,
    high: f64,
    old: f64,
) -> Vec<f64> {
    inv_freq
        .iter()
        .map(|&f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            let divided = if wavelen > old / low { f / factor } else { f };
            let smooth = (old / wavelen - low) / (high - low);
            let medium = wavelen >= old / high && wavelen <= old / low;
            if medium {
                (1.0 - smooth) * divided / factor + smooth * divided
            } else {
                divided
            }
        })
        .collect()
}

/// cos, sin: (T, D/2) with `cos[t, i] = cos(t * inv_freq[i])`, likewise sin, in f64.
pub fn rope_table<R: Real>(cos: &mut [R], sin: &mut [R], inv_freq: &[f64], t: usize) {
    let half = inv_freq.len();
    assert_eq!((cos.len(), sin.len()), (t * half, t * half));
    for ti in 0..t {
        for i in 0..half {
            let angle = ti as f64 * inv_freq[i];
            cos[ti * half + i] = r(angle.cos());
            sin[ti * half + i] = r(angle.sin());
        }
    }
}

/// out: (B, T, H, D)  inp: (B, T, H, D)  cos, sin: (at least T, D/2), D even.
/// Each row `x` of D channels at position t, split in halves x1 = x[..D/2] and
/// x2 = x[D/2..], becomes `(x1 cos - x2 sin, x2 cos + x1 sin)` with row t of the table
/// (`x * cos + rotate_half(x) * sin`, Hugging Face's form).
#[allow(clippy::too_many_arguments)]
pub fn rope_forward<R: Real>(
    out: &mut [R],
    inp: &[R],
    cos: &[R],
    sin: &[R],
    b: usize,
    t: usize,
    h: usize,
    d: usize,
) {
    rope_rotate(out, inp, cos, sin, b, t, h, d, false);
}

/// dinp: (B, T, H, D) =  dout: (B, T, H, D)  cos, sin: as in [`rope_forward`].
/// The rotation's transpose: `(d1 cos + d2 sin, d2 cos - d1 sin)`.
#[allow(clippy::too_many_arguments)]
pub fn rope_backward<R: Real>(
    dinp: &mut [R],
    dout: &[R],
    cos: &[R],
    sin: &[R],
    b: usize,
    t: usize,
    h: usize,
    d: usize,
) {
    rope_rotate(dinp, dout, cos, sin, b, t, h, d, true);
}

/// Rotates each row by its position's angles, or by their negatives when `inverse`.
#[allow(clippy::too_many_arguments)]
fn rope_rotate<R: Real>(
    out: &mut [R],
    inp: &[R],
    cos: &[R],
    sin: &[R],
    b: usize,
    t: usize,
    h: usize,
    d: usize,
    inverse: bool,
) {
    assert_eq!(d % 2, 0, "an odd head dimension {d}");
    let half = d / 2;
    assert_eq!((out.len(), inp.len()), (b * t * h * d, b * t * h * d));
    assert!(cos.len() >= t * half && sin.len() >= t * half);
    for bi in 0..b {
        for ti in 0..t {
            for hi in 0..h {
                let at = ((bi * t + ti) * h + hi) * d;
                for i in 0..half {
                    let (c, s) = (cos[ti * half + i], sin[ti * half + i]);
                    let s = if inverse { -s } else { s };
                    let (x1, x2) = (inp[at + i], inp[at + half + i]);
                    out[at + i] = x1 * c - x2 * s;
                    out[at + half + i] = x2 * c + x1 * s;
                }
            }
        }
    }
}
