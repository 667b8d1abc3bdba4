//! The programs every family shares, built from a block's layout alone: AdamW over a
//! block's tensors (on the device, where its optimizer state lives there), the
//! statistics of a block's gradients (for the global norm and the overflow check), the
//! accumulation of one micro-batch's gradients into another's, and the rounding of a
//! step's gradients to bf16.
//!
//! The device's AdamW keeps fp32 state ([`OptimizerState::Fp32`](super::OptimizerState)):
//! one f32 buffer per block, the master parameters, then m, then v, each the block's
//! length (alignment gaps included, and left zero); see [`super::moments`].

use strata_kernels::kernel::{AdamWKernel, AddF32, GradStatsKernel, RoundBf16};
use strata_kernels::program::{Dtype, Kernel, TensorRef, grad_stats_scratch_bytes};

use super::moments::pieces;
use super::{Bind, BlockLayout, Target};

/// AdamW over every tensor of `block` that trains ([`BlockLayout::trained`]): master
/// parameters, m and v in [`Bind::State`], gradients in [`Bind::Grads`] (each of the
/// trained elements), the new working parameters written to their place in the whole
/// block's [`Bind::Params`] in `params_dtype`, rounded to `precision`. Tensors that decay
/// ([`TensorSpec::decays`](super::TensorSpec::decays)) use the constants with weight decay.
pub fn adamw_program(block: &BlockLayout, params_dtype: Dtype, precision: Dtype) -> Vec<Kernel> {
    let lo = block.frozen;
    adamw_range_program(block, lo, block.trained_len(), lo, params_dtype, precision)
}

/// AdamW over elements `lo .. lo + len` of `block`'s flat buffer (a rank's shard, or
/// the elements that train), as [`adamw_program`] over the whole: the state and
/// gradient buffers hold that range only (the state master, m and v of `len` elements
/// each), and each tensor is cut to it; [`Bind::Params`] holds the range from element
/// `params_at` (0 for a shard's own buffer, `lo` for the whole block's). Elements of the
/// range past the block's end are not touched.
pub fn adamw_range_program(
    block: &BlockLayout,
    lo: usize,
    len: usize,
    params_at: usize,
    params_dtype: Dtype,
    precision: Dtype,
) -> Vec<Kernel> {
    let state = |part: usize, at: usize, n: usize| {
        TensorRef::new(Bind::State as u8, (part * len + at) * 4, n, Dtype::F32)
    };
    pieces(&block.tensors, lo, len)
        .into_iter()
        .map(|p| {
            let (at, n) = (p.at, p.len);
            Kernel::AdamW(AdamWKernel {
                params: state(0, at, n),
                m: state(1, at, n),
                v: state(2, at, n),
                grads: TensorRef::new(Bind::Grads as u8, at * 4, n, Dtype::F32),
                copy_out: Some(TensorRef::new(
                    Bind::Params as u8,
                    (params_at + at) * params_dtype.size(),
                    n,
                    params_dtype,
                )),
                round: precision,
                decay: block.tensors[p.tensor].decays(),
            })
        })
        .collect()
}

/// The statistics of `block`'s gradients ([`Bind::Grads`], its trained elements) into
/// [`Bind::Stats`], with the reduction's scratch at the start of [`Bind::Scratch`].
pub fn grad_stats_program(block: &BlockLayout, target: Target) -> Vec<Kernel> {
    let len = block.trained_len();
    vec![Kernel::GradStats(GradStatsKernel {
        grads: TensorRef::new(Bind::Grads as u8, 0, len, Dtype::F32),
        out: TensorRef::new(Bind::Stats as u8, 0, 16, Dtype::U8),
        scratch: TensorRef::new(
            Bind::Scratch as u8,
            0,
            grad_stats_scratch_bytes(target, len),
            Dtype::U8,
        ),
    })]
}

/// Bytes of scratch [`grad_stats_program`] needs for the largest of `blocks`.
pub fn grad_stats_scratch(blocks: &[BlockLayout], target: Target) -> usize {
    blocks
        .iter()
        .map(|b| grad_stats_scratch_bytes(target, b.trained_len()))
        .max()
        .unwrap_or(0)
}

/// `Grads += GradsIn` over `block`'s gradients (its trained elements, f32).
pub fn accumulate_program(block: &BlockLayout) -> Vec<Kernel> {
    let len = block.trained_len();
    vec![Kernel::AddF32(AddF32 {
        dst: TensorRef::new(Bind::Grads as u8, 0, len, Dtype::F32),
        src: TensorRef::new(Bind::GradsIn as u8, 0, len, Dtype::F32),
    })]
}

/// `Grads` rounded to bf16 in place over `block`'s gradients (f32 kept).
pub fn round_program(block: &BlockLayout) -> Vec<Kernel> {
    vec![Kernel::RoundBf16(RoundBf16 {
        x: TensorRef::new(Bind::Grads as u8, 0, block.trained_len(), Dtype::F32),
    })]
}
