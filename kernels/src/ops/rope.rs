//! Rotary position embeddings in Hugging Face's "rotate_half" form (Llama, Qwen,
//! Mistral), forward and backward, over a table of cosines and sines the caller builds
//! ([`rope_table`], from the inverse frequencies of [`rope_inv_freq`] or of a scaled
//! variant such as Llama 3's `rope_scaling`, which stays the caller's choice).
//!
//! Layout: x is (B, T, H, D) (q with H query heads, k with KV heads), each row of D
//! channels rotated by the angles of its position t; cos and sin are (at least T, D/2),
//! row t for position t (Hugging Face's `cat(freqs, freqs)` halves are equal, so one half
//! is kept).

use super::simd::on_isa;
use super::{Cpu, RowsMut, par_rows};

/// inv_freq: (D/2) = `theta^(-2i/D)`, Hugging Face's default (computed in f64, rounded
/// to f32 as its f32 tensor holds them).
pub fn rope_inv_freq(inv_freq: &mut [f32], theta: f64, d: usize) {
    assert_eq!(inv_freq.len(), d / 2);
    for (i, f) in inv_freq.iter_mut().enumerate() {
        *f = (1.0 / theta.powf((2 * i) as f64 / d as f64)) as f32;
    }
}

/// cos, sin: (positions.len(), D/2) with `cos[p, i] = cos(positions[p] * inv_freq[i])`,
/// likewise sin; inv_freq: (D/2). The angle is the f32 product, as Hugging Face forms it;
/// its cosine and sine are taken in f64 and rounded.
pub fn rope_table(cos: &mut [f32], sin: &mut [f32], inv_freq: &[f32], positions: &[u32]) {
    let half = inv_freq.len();
    let rows = positions.len();
    assert_eq!((cos.len(), sin.len()), (rows * half, rows * half));
    for (p, &pos) in positions.iter().enumerate() {
        for (i, &f) in inv_freq.iter().enumerate() {
            let angle = f64::from(pos as f32 * f);
            cos[p * half + i] = angle.cos() as f32;
            sin[p * half + i] = angle.sin() as f32;
        }
    }
}

/// How a model forms its rotary inverse frequencies: Hugging Face's default
/// `theta^(-2i/D)`, optionally rescaled as Llama 3.1's `rope_scaling` (`rope_type`
/// `llama3`) does. The numbers are f32: every published theta and scaling factor is an
/// integer below 2^24 or a small power of two, so f32 holds them exactly.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeFreqs {
    /// The base of the default frequencies (`rope_theta`).
    pub theta: f32,
    /// Llama 3.1's rescaling of the low frequencies, if the model uses it.
    pub llama3: Option<Llama3Scaling>,
}

/// Llama 3.1's `rope_scaling` (`rope_type: llama3`): wavelengths longer than
/// `original_context / low_freq_factor` are stretched by `factor`, shorter than
/// `original_context / high_freq_factor` kept, and those between interpolated smoothly.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    /// `factor` (8 for Llama 3.1, 32 for Llama 3.2).
    pub factor: f32,
    /// `low_freq_factor` (1).
    pub low_freq_factor: f32,
    /// `high_freq_factor` (4).
    pub high_freq_factor: f32,
    /// `original_max_position_embeddings` (8192).
    pub original_context: f32,
}

impl RopeFreqs {
    /// The inverse frequency of channel pair `i` of a head of `d` channels: the default
    /// [`rope_inv_freq`]'s value (f64, rounded to f32), then, with Llama 3 scaling, its
    /// rescaling computed in f64 from that f32 value and rounded again (Hugging Face
    /// computes both in f32 tensors; the two agree to an f32 rounding).
    pub fn inv_freq(&self, i: usize, d: usize) -> f32 {
        let base = (1.0 / f64::from(self.theta).powf((2 * i) as f64 / d as f64)) as f32;
        let Some(s) = self.llama3 else {
            return base;
        };
        let inv = f64::from(base);
        let (factor, low, high, old) = (
            f64::from(s.factor),
            f64::from(s.low_freq_factor),
            f64::from(s.high_freq_factor),
            f64::from(s.original_context),
        );
        let wavelen = 2.0 * std::f64::consts::PI / inv;
        let scaled = if wavelen < old / high {
            inv
        } else if wavelen > old / low {
            inv / factor
        } else {
            let smooth = (old / wavelen - low) / (high - low);
            (1.0 - smooth) * inv / factor + smooth * inv
        };
        scaled as f32
    }
}

/// cos, sin: (T, D/2): the table of positions 0..T for the inverse frequencies of
/// `freqs` (as [`rope_table`] forms it: the f32 angle `t * inv_freq[i]`, its cosine and
/// sine taken in f64 and rounded). Fills the pairs' columns one after another, so each
/// inverse frequency is computed once.
pub fn rope_table_of(cos: &mut [f32], sin: &mut [f32], freqs: &RopeFreqs, t: usize, d: usize) {
    let half = d / 2;
    assert!(d.is_multiple_of(2), "an odd head dimension {d}");
    assert_eq!((cos.len(), sin.len()), (t * half, t * half));
    for i in 0..half {
        let f = freqs.inv_freq(i, d);
        for pos in 0..t {
            let angle = f64::from(pos as f32 * f);
            cos[pos * half + i] = angle.cos() as f32;
            sin[pos * half + i] = angle.sin() as f32;
        }
    }
}

/// out: (B, T, H, D)  inp: (B, T, H, D)  cos, sin: (at least T, D/2), D even.
/// Each row x at position t becomes `(x1 cos - x2 sin, x2 cos + x1 sin)` with x1, x2 its
/// halves and row t of the table.
#[allow(clippy::too_many_arguments)]
pub fn rope_forward(
    cpu: &Cpu,
    out: &mut [f32],
    inp: &[f32],
    cos: &[f32],
    sin: &[f32],
    b: usize,
    t: usize,
    h: usize,
    d: usize,
) {
    rotate(cpu, out, inp, cos, sin, b, t, h, d, 1.0);
}

/// dinp: (B, T, H, D) =  dout: (B, T, H, D)  cos, sin: as in [`rope_forward`].
/// The transpose of the forward's rotation: `(d1 cos + d2 sin, d2 cos - d1 sin)`.
#[allow(clippy::too_many_arguments)]
pub fn rope_backward(
    cpu: &Cpu,
    dinp: &mut [f32],
    dout: &[f32],
    cos: &[f32],
    sin: &[f32],
    b: usize,
    t: usize,
    h: usize,
    d: usize,
) {
    rotate(cpu, dinp, dout, cos, sin, b, t, h, d, -1.0);
}

/// Rotates every row by its position's angles, the sines multiplied by `sign`.
#[allow(clippy::too_many_arguments)]
fn rotate(
    cpu: &Cpu,
    out: &mut [f32],
    inp: &[f32],
    cos: &[f32],
    sin: &[f32],
    b: usize,
    t: usize,
    h: usize,
    d: usize,
    sign: f32,
) {
    assert!(d.is_multiple_of(2), "an odd head dimension {d}");
    let (half, rows) = (d / 2, b * t * h);
    assert_eq!((out.len(), inp.len()), (rows * d, rows * d));
    assert!(
        cos.len() >= t * half && sin.len() >= t * half,
        "a table of fewer than {t} rows"
    );
    if d == 0 {
        return;
    }
    par_rows(
        cpu.threads_for(rows * d),
        rows,
        1,
        RowsMut::new(out, d),
        |range, out| {
            on_isa!(cpu.isa, {
                for (i, row) in range.enumerate() {
                    let pos = (row / h) % t;
                    let (c, s) = (&cos[pos * half..][..half], &sin[pos * half..][..half]);
                    let (x1, x2) = inp[row * d..][..d].split_at(half);
                    let (o1, o2) = out.data[i * d..][..d].split_at_mut(half);
                    for j in 0..half {
                        let sj = sign * s[j];
                        o1[j] = x1[j] * c[j] - x2[j] * sj;
                        o2[j] = x2[j] * c[j] + x1[j] * sj;
                    }
                }
            },)
        },
    );
}
