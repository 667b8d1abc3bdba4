//! The programs every block runs, built once when the executor is made: each block's
//! forward and backward (both variants: with and without saved activations) from the
//! model family, and the shared update programs (`crate::model::update`): AdamW on the
//! device, gradient statistics, gradient accumulation, the rounding of gradients to bf16.
//!
//! Not here: when they run (the compute and update streams, `stream.rs`).

use crate::device::Program;
use crate::model::{Dtype, Model, Pass, Shape, update};
use crate::plan::{Plan, Tier};

/// The programs of every block.
pub(super) struct Programs {
    /// Per block, its program of each [`Pass`] (by [`Pass::index`]).
    pub(super) compute: Vec<[Program; 4]>,
    /// AdamW on the device, for blocks whose optimizer state lives there.
    pub(super) update: Vec<Option<Program>>,
    /// Per block, the statistics of its gradients (the update stream's).
    pub(super) stats: Vec<Program>,
    /// Per block, the addition of a micro-batch's gradients to the device-homed ones.
    pub(super) accumulate: Vec<Program>,
    /// Per block, its gradients rounded to bf16 in place.
    pub(super) round: Vec<Program>,
    /// Per block whose base is fetched packed, its dequantisation into the block's
    /// device parameters ([`QuantBlock::program`](crate::model::QuantBlock::program)).
    pub(super) dequantize: Vec<Option<Program>>,
}

impl Programs {
    /// The programs of `model`'s blocks for `plan`'s step (of `dims`), as rank `rank` of
    /// `ranks`.
    pub(super) fn build(
        model: &Model,
        plan: &Plan,
        dims: Shape,
        rank: usize,
        ranks: usize,
    ) -> Self {
        let shape = plan.shape;
        let target = shape.target;
        let dtype = shape.device_dtype();
        let nb = model.blocks().len();
        let program = |b, pass| -> Program { model.program(b, pass, dims, target, dtype).into() };
        Programs {
            compute: (0..nb)
                .map(|b| Pass::ALL.map(|pass| program(b, pass)))
                .collect(),
            update: (0..nb)
                .map(|b| {
                    (plan.homes[b][2] == Tier::Device)
                        .then(|| device_update(model, plan, b, rank, ranks))
                })
                .collect(),
            stats: model
                .blocks()
                .iter()
                .map(|b| update::grad_stats_program(b, target).into())
                .collect(),
            accumulate: model
                .blocks()
                .iter()
                .map(|b| update::accumulate_program(b).into())
                .collect(),
            round: model
                .blocks()
                .iter()
                .map(|b| update::round_program(b).into())
                .collect(),
            dequantize: (0..nb)
                .map(|b| {
                    plan.block_homes[b].packed?;
                    // The CPU device computes in f32 what a GPU holds in bf16: rounded
                    // as a bf16 home's values are when copied there.
                    let round_bf16 = dtype == Dtype::F32 && shape.precision.dtype() == Dtype::Bf16;
                    let quant = model
                        .quant_block(b, dtype)
                        .expect("a packed block is quantised");
                    Some(quant.program(round_bf16).into())
                })
                .collect(),
        }
    }
}

/// AdamW on the device over block `b` (whose optimizer state lives there), as rank
/// `rank` of `ranks`.
fn device_update(model: &Model, plan: &Plan, b: usize, rank: usize, ranks: usize) -> Program {
    let shape = plan.shape;
    let dtype = shape.device_dtype();
    let layout = &model.blocks()[b];
    let precision = shape.precision.dtype();
    if ranks > 1 {
        // This rank's shard; its new parameters to be gathered over device memory (in the
        // device's dtype) or on the host (in the host's precision).
        let shard = plan.shard_len[b] as usize;
        let lo = layout.frozen + rank * shard;
        let out = if plan.device_comm(b) {
            dtype
        } else {
            precision
        };
        update::adamw_range_program(layout, lo, shard, 0, out, precision).into()
    } else {
        update::adamw_program(layout, dtype, precision).into()
    }
}
