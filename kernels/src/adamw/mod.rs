//! AdamW on the CPU, at the memory-bandwidth limit (the optimizer step of ZeRO-Offload).
//!
//! Holds the API the engine calls per block as gradients arrive: hyper-parameters
//! ([`AdamW`]), the constants of one step ([`AdamStep`], derived in f64 and rounded once,
//! as torch does), the update itself ([`AdamStep::apply`]) over slices of fp32 master
//! parameters and fp32, bf16 or 8-bit ([`q8`]) state, and the fused gradient pass
//! ([`grad_stats`]: sum of squares and whether any value is not finite). It splits the
//! slices over the persistent worker pool ([`crate::parallel`]) and runs the kernel of the
//! chosen [`Isa`] on each piece: `portable.rs` (always compiled), `avx2.rs`, `avx512.rs`.
//! The plain scalar version every kernel is tested against is [`crate::reference::adamw`].
//!
//! Semantics are `torch.optim.AdamW`'s (step t counts from 1):
//! ```text
//! g  = grad * grad_scale
//! p  = p * (1 - lr * weight_decay)
//! m  = beta1 * m + (1 - beta1) * g
//! v  = beta2 * v + (1 - beta2) * g * g
//! p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//! ```
//! Every kernel reads and writes each array once per step; optionally it also writes the
//! updated parameters as fp16 or bf16 (round to nearest even) in the same pass.
//!
//! bf16 state ([`State::Bf16`]) is read as f32 (exactly), updated in f32 like fp32 state
//! (the parameter's update uses the new moments before rounding), and written back
//! rounded to nearest, ties to even (`half::bf16::from_f32`; NaN stays NaN). Its
//! reference, [`crate::reference::adamw::step_bf16`], follows the kernels' order of
//! operations, so kernel and reference agree bit for bit.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod dispatch;
mod portable;
pub mod q8;

/// The element types of fp16 and bf16 gradients and working copies (the `half` crate's).
pub use half::{bf16, f16};

use crate::isa::Isa;

/// Errors of the AdamW API: inputs that do not fit together. Each names the lengths.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AdamError {
    /// An array does not have one entry per parameter (or one scale per block).
    #[error("AdamW: {what} has {actual} entries but the {params} parameters need {expected}")]
    LengthMismatch {
        /// Which array.
        what: &'static str,
        /// How many parameters are being updated.
        params: usize,
        /// How many entries the array needs.
        expected: usize,
        /// How many it has.
        actual: usize,
    },
    /// A hyper-parameter is outside the range torch accepts.
    #[error("AdamW: {name} = {value} is invalid: it must be {rule}")]
    InvalidHyperParameter {
        /// The hyper-parameter's name.
        name: &'static str,
        /// Its value.
        value: f64,
        /// The range it must lie in.
        rule: &'static str,
    },
    /// Steps count from 1, as in torch (step 0 has no bias correction).
    #[error("AdamW: step numbers start at 1 (got 0)")]
    StepZero,
    /// The gradient scale is not finite.
    #[error("AdamW: the gradient scale {0} is not finite")]
    InvalidGradScale(f32),
    /// The chosen instruction set is not supported by this CPU.
    #[error("AdamW: this CPU cannot run the {0} kernels (use Isa::active())")]
    UnsupportedIsa(Isa),
}

/// AdamW hyper-parameters, as `torch.optim.AdamW` takes them (f64, like Python floats).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    /// Learning rate (a schedule sets it per step).
    pub lr: f64,
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay: parameters are multiplied by `1 - lr * weight_decay`.
    pub weight_decay: f64,
}

impl Default for AdamW {
    /// torch's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 1e-2.
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
        }
    }
}

impl AdamW {
    fn validate(&self) -> Result<(), AdamError> {
        let check = |name, value: f64, ok: bool, rule| {
            if ok {
                Ok(())
            } else {
                Err(AdamError::InvalidHyperParameter { name, value, rule })
            }
        };
        let finite_non_negative = |x: f64| x.is_finite() && x >= 0.0;
        check(
            "lr",
            self.lr,
            finite_non_negative(self.lr),
            "finite and >= 0",
        )?;
        let beta_ok = |b: f64| (0.0..1.0).contains(&b);
        check("beta1", self.beta1, beta_ok(self.beta1), "in [0, 1)")?;
        check("beta2", self.beta2, beta_ok(self.beta2), "in [0, 1)")?;
        check(
            "eps",
            self.eps,
            finite_non_negative(self.eps),
            "finite and >= 0",
        )?;
        check(
            "weight_decay",
            self.weight_decay,
            finite_non_negative(self.weight_decay),
            "finite and >= 0",
        )
    }
}

/// The constants of one AdamW step, derived once per step in f64 and rounded once to
/// f32 (as torch does: an f32 `1 - 0.999` would differ by 1.3e-5 relative and show in v).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamStep {
    pub(crate) step: u64,
    pub(crate) grad_scale: f32,
    /// `1 - lr * weight_decay`.
    pub(crate) decay: f32,
    pub(crate) beta1: f32,
    pub(crate) beta2: f32,
    pub(crate) one_minus_beta1: f32,
    pub(crate) one_minus_beta2: f32,
    /// `lr / (1 - beta1^t)`.
    pub(crate) step_size: f32,
    /// `sqrt(1 - beta2^t)`: torch divides `sqrt(v)` by it.
    pub(crate) bias_correction2_sqrt: f32,
    /// `1 / sqrt(1 - beta2^t)`: the SIMD kernels multiply instead of dividing.
    pub(crate) inv_bias_correction2_sqrt: f32,
    pub(crate) eps: f32,
}

impl AdamStep {
    /// The constants of step `step` (counting from 1), with every gradient multiplied by
    /// `grad_scale` as it is read (1 / loss scale, 1 / accumulation count, a clipping
    /// coefficient, or their product).
    pub fn new(hp: &AdamW, step: u64, grad_scale: f32) -> Result<Self, AdamError> {
        hp.validate()?;
        if step == 0 {
            return Err(AdamError::StepZero);
        }
        if !grad_scale.is_finite() {
            return Err(AdamError::InvalidGradScale(grad_scale));
        }
        // powi takes an i32; beyond 2^31 steps beta^t is 0 in f64 anyway.
        let t = i32::try_from(step).unwrap_or(i32::MAX);
        let bias_correction1 = 1.0 - hp.beta1.powi(t);
        let bias_correction2 = 1.0 - hp.beta2.powi(t);
        let bias_correction2_sqrt = bias_correction2.sqrt();
        Ok(Self {
            step,
            grad_scale,
            decay: (1.0 - hp.lr * hp.weight_decay) as f32,
            beta1: hp.beta1 as f32,
            beta2: hp.beta2 as f32,
            one_minus_beta1: (1.0 - hp.beta1) as f32,
            one_minus_beta2: (1.0 - hp.beta2) as f32,
            step_size: (hp.lr / bias_correction1) as f32,
            bias_correction2_sqrt: bias_correction2_sqrt as f32,
            inv_bias_correction2_sqrt: (1.0 / bias_correction2_sqrt) as f32,
            eps: hp.eps as f32,
        })
    }

    /// The step number these constants are for.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The factor every gradient is multiplied by.
    pub fn grad_scale(&self) -> f32 {
        self.grad_scale
    }

    /// Updates `params` and `state` from `grads`, and writes the updated parameters to
    /// `copy_out` if asked, using the kernels of `isa` on `threads` threads of the worker
    /// pool (at least one; more threads than the pool has just queue).
    ///
    /// Every slice has one entry per parameter (8-bit state: see [`Q8State`]). Each
    /// element (each block of 8-bit state) is updated independently, so the result
    /// depends on the inputs and `isa` only, not on `threads` or scheduling.
    pub fn apply(
        &self,
        isa: Isa,
        threads: usize,
        params: &mut [f32],
        state: State<'_>,
        grads: Grads<'_>,
        copy_out: CopyOut<'_>,
    ) -> Result<(), AdamError> {
        if !isa.is_supported() {
            return Err(AdamError::UnsupportedIsa(isa));
        }
        let n = params.len();
        check_len("gradients", n, n, grads.len())?;
        if let Some(len) = copy_out.buffer_len() {
            check_len("the copy-out buffer", n, n, len)?;
        }
        match &state {
            State::F32 { m, v } => {
                check_len("m", n, n, m.len())?;
                check_len("v", n, n, v.len())?;
            }
            State::Bf16 { m, v } => {
                check_len("m", n, n, m.len())?;
                check_len("v", n, n, v.len())?;
            }
            State::Q8(q) => q.check(n)?,
        }
        dispatch::step(isa, threads, self, params, state, grads, copy_out);
        Ok(())
    }
}

fn check_len(
    what: &'static str,
    params: usize,
    expected: usize,
    actual: usize,
) -> Result<(), AdamError> {
    if expected == actual {
        Ok(())
    } else {
        Err(AdamError::LengthMismatch {
            what,
            params,
            expected,
            actual,
        })
    }
}

/// Gradients, in the dtype the device produced them in.
#[derive(Debug, Clone, Copy)]
pub enum Grads<'a> {
    /// fp32 gradients.
    F32(&'a [f32]),
    /// fp16 gradients (usually with a loss scale, undone by the step's grad scale).
    F16(&'a [f16]),
    /// bf16 gradients.
    Bf16(&'a [bf16]),
}

impl<'a> Grads<'a> {
    /// How many gradients.
    pub fn len(&self) -> usize {
        match self {
            Grads::F32(g) => g.len(),
            Grads::F16(g) => g.len(),
            Grads::Bf16(g) => g.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes per gradient.
    pub fn element_bytes(&self) -> usize {
        match self {
            Grads::F32(_) => 4,
            Grads::F16(_) | Grads::Bf16(_) => 2,
        }
    }

    /// The first `mid` gradients and the rest.
    pub fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            Grads::F32(g) => {
                let (a, b) = g.split_at(mid);
                (Grads::F32(a), Grads::F32(b))
            }
            Grads::F16(g) => {
                let (a, b) = g.split_at(mid);
                (Grads::F16(a), Grads::F16(b))
            }
            Grads::Bf16(g) => {
                let (a, b) = g.split_at(mid);
                (Grads::Bf16(a), Grads::Bf16(b))
            }
        }
    }
}

/// Where the step writes the updated parameters in the working dtype, if anywhere.
#[derive(Debug)]
pub enum CopyOut<'a> {
    /// No working copy.
    None,
    /// fp16, rounded to nearest even (overflow gives infinity, as a cast does).
    F16(&'a mut [f16]),
    /// bf16, rounded to nearest even.
    Bf16(&'a mut [bf16]),
}

impl<'a> CopyOut<'a> {
    /// The buffer's length, or `None` without one.
    pub fn buffer_len(&self) -> Option<usize> {
        match self {
            CopyOut::None => None,
            CopyOut::F16(o) => Some(o.len()),
            CopyOut::Bf16(o) => Some(o.len()),
        }
    }

    /// Bytes written per parameter.
    pub fn element_bytes(&self) -> usize {
        match self {
            CopyOut::None => 0,
            CopyOut::F16(_) | CopyOut::Bf16(_) => 2,
        }
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            CopyOut::None => (CopyOut::None, CopyOut::None),
            CopyOut::F16(o) => {
                let (a, b) = o.split_at_mut(mid);
                (CopyOut::F16(a), CopyOut::F16(b))
            }
            CopyOut::Bf16(o) => {
                let (a, b) = o.split_at_mut(mid);
                (CopyOut::Bf16(a), CopyOut::Bf16(b))
            }
        }
    }
}

/// The optimizer state of the parameters being updated.
#[derive(Debug)]
pub enum State<'a> {
    /// fp32 first and second moments, one per parameter.
    F32 {
        /// First moment.
        m: &'a mut [f32],
        /// Second moment.
        v: &'a mut [f32],
    },
    /// bf16 first and second moments, one per parameter, rounded to nearest even when
    /// written (half the bytes of fp32 state; see the module's notes for the rounding).
    Bf16 {
        /// First moment.
        m: &'a mut [bf16],
        /// Second moment.
        v: &'a mut [bf16],
    },
    /// 8-bit block-wise quantized moments (docs/adamw-8bit.md).
    Q8(Q8State<'a>),
}

impl<'a> State<'a> {
    /// Bytes of state per parameter, read once and written once per step (scales of
    /// 8-bit state included).
    pub fn bytes_per_param(&self) -> f64 {
        match self {
            State::F32 { .. } => 8.0,
            State::Bf16 { .. } => 4.0,
            State::Q8(_) => 2.0 + 8.0 / q8::BLOCK as f64,
        }
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            State::F32 { m, v } => {
                let (m0, m1) = m.split_at_mut(mid);
                let (v0, v1) = v.split_at_mut(mid);
                (State::F32 { m: m0, v: v0 }, State::F32 { m: m1, v: v1 })
            }
            State::Bf16 { m, v } => {
                let (m0, m1) = m.split_at_mut(mid);
                let (v0, v1) = v.split_at_mut(mid);
                (State::Bf16 { m: m0, v: v0 }, State::Bf16 { m: m1, v: v1 })
            }
            State::Q8(q) => {
                let (a, b) = q.split_at(mid);
                (State::Q8(a), State::Q8(b))
            }
        }
    }
}

/// 8-bit AdamW state (format in [`q8`]): per parameter a code for m and one for sqrt(v),
/// and per block of [`q8::BLOCK`] parameters a scale for each. A fresh state is all zeros.
///
/// A slice must start at a block boundary of its tensor; only the last block of a
/// tensor may be partial. This is the caller's contract, not checked here (a slice
/// carries its own scales, so a misplaced cut cannot be seen): a slice cut elsewhere
/// would be updated with scales that belong to other parameters. All-zero codes and
/// scales are the initial (zero) state.
#[derive(Debug)]
pub struct Q8State<'a> {
    /// First-moment codes: sign and E4M3 magnitude.
    pub m_codes: &'a mut [u8],
    /// One scale per block for `m_codes`.
    pub m_scales: &'a mut [f32],
    /// Codes of sqrt(v): E4M4.
    pub v_codes: &'a mut [u8],
    /// One scale per block for `v_codes`.
    pub v_scales: &'a mut [f32],
}

impl<'a> Q8State<'a> {
    fn check(&self, n: usize) -> Result<(), AdamError> {
        let blocks = q8::scale_count(n);
        check_len("m codes", n, n, self.m_codes.len())?;
        check_len("v codes", n, n, self.v_codes.len())?;
        check_len("m scales", n, blocks, self.m_scales.len())?;
        check_len("v scales", n, blocks, self.v_scales.len())
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        assert_eq!(mid % q8::BLOCK, 0, "8-bit state splits only between blocks");
        let (mc0, mc1) = self.m_codes.split_at_mut(mid);
        let (vc0, vc1) = self.v_codes.split_at_mut(mid);
        let (ms0, ms1) = self.m_scales.split_at_mut(mid / q8::BLOCK);
        let (vs0, vs1) = self.v_scales.split_at_mut(mid / q8::BLOCK);
        (
            Q8State {
                m_codes: mc0,
                m_scales: ms0,
                v_codes: vc0,
                v_scales: vs0,
            },
            Q8State {
                m_codes: mc1,
                m_scales: ms1,
                v_codes: vc1,
                v_scales: vs1,
            },
        )
    }
}

/// What [`grad_stats`] finds in gradients (after scaling).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GradStats {
    /// Sum of the squares, accumulated in f64 (so finite gradients never overflow it).
    pub sum_squares: f64,
    /// Whether any scaled gradient is infinite or NaN (fp16 loss scaling skips the step).
    pub non_finite: bool,
}

impl GradStats {
    /// Combines the statistics of two sets of gradients (e.g. two blocks).
    pub fn merge(self, other: GradStats) -> GradStats {
        GradStats {
            sum_squares: self.sum_squares + other.sum_squares,
            non_finite: self.non_finite || other.non_finite,
        }
    }

    /// The L2 norm: the square root of [`GradStats::sum_squares`].
    pub fn norm(&self) -> f64 {
        self.sum_squares.sqrt()
    }

    /// Statistics from a sum of squares: in f64 a sum of squares of finite f32 values
    /// cannot overflow, so it is non-finite exactly when some value was.
    pub(crate) fn from_sum(sum_squares: f64) -> GradStats {
        GradStats {
            sum_squares,
            non_finite: !sum_squares.is_finite(),
        }
    }
}

/// Elements of one piece of the gradient statistics. [`grad_stats`] is the left fold, in
/// order, of the statistics of consecutive pieces of this many elements (the last may be
/// shorter), each computed whole by one thread: so the sum does not depend on the thread
/// count, and gradients split at multiples of it (the shards of ranks) give the same
/// piece sums wherever each part is computed ([`grad_stats_pieces`]).
pub const STATS_PIECE: usize = 16384;

/// Lanes of one piece's sum of squares, the order every instruction set's kernel and
/// the CUDA kernel (`grad_stats_partials` in adamw.cu) sum in: lane `l` adds the squares
/// of the piece's elements `l`, `l + 16`, `l + 32`, ... in order, from zero, in f64; the
/// piece's sum is the lanes summed pairwise (halves first, recursively: adjacent lanes
/// first). So the statistics, and the clipping coefficient drawn from them, are the same
/// bits on every CPU and on a GPU.
pub const STATS_LANES: usize = 16;

/// One read-only pass over gradients, each multiplied by `scale` in f32 as the step does:
/// the sum of squares (for global-norm clipping) and whether any is not finite.
///
/// The sum is deterministic for given inputs and `isa`, whatever `threads` (see
/// [`STATS_PIECE`]).
pub fn grad_stats(
    isa: Isa,
    threads: usize,
    grads: Grads<'_>,
    scale: f32,
) -> Result<GradStats, AdamError> {
    if !isa.is_supported() {
        return Err(AdamError::UnsupportedIsa(isa));
    }
    Ok(dispatch::grad_stats(isa, threads, grads, scale))
}

/// The statistics of each [`STATS_PIECE`]-element piece of `grads` in order, given to
/// `each` (on the calling thread): [`grad_stats`] is their left fold from zero.
pub fn grad_stats_pieces(
    isa: Isa,
    threads: usize,
    grads: Grads<'_>,
    scale: f32,
    each: &mut dyn FnMut(GradStats),
) -> Result<(), AdamError> {
    if !isa.is_supported() {
        return Err(AdamError::UnsupportedIsa(isa));
    }
    dispatch::grad_stats_pieces(isa, threads, grads, scale, each);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_are_derived_in_f64_and_rounded_once() {
        let k = AdamStep::new(&AdamW::default(), 3, 0.5).unwrap();
        assert_eq!(k.one_minus_beta2, (1.0f64 - 0.999) as f32);
        assert_ne!(k.one_minus_beta2, 1.0f32 - 0.999f32);
        assert_eq!(k.decay, (1.0f64 - 1e-3 * 1e-2) as f32);
        assert_eq!(k.step_size, (1e-3 / (1.0 - 0.9f64.powi(3))) as f32);
        assert_eq!(
            k.bias_correction2_sqrt,
            (1.0 - 0.999f64.powi(3)).sqrt() as f32
        );
        assert_eq!(k.grad_scale(), 0.5);
        assert_eq!(k.step(), 3);
    }

    #[test]
    fn bad_hyper_parameters_and_steps_are_named() {
        let hp = AdamW {
            beta2: 1.0,
            ..AdamW::default()
        };
        let e = AdamStep::new(&hp, 1, 1.0).unwrap_err();
        assert!(e.to_string().contains("beta2"), "{e}");
        assert_eq!(
            AdamStep::new(&AdamW::default(), 0, 1.0),
            Err(AdamError::StepZero)
        );
        assert!(AdamStep::new(&AdamW::default(), 1, f32::NAN).is_err());
    }
}
