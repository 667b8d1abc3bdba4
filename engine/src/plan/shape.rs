//! The shape of one training step (batch, sequence, accumulation, precision, the device's
//! kernels, what recomputes, the micro-batches' order, whether gradients spill, ranks)
//! and the sizes that follow from it: a rank's shard of a block, the bytes a collective
//! moves.
//!
//! Not here: where tensors live ([`super::Policy`], [`super::Tier`]) or the plan made for
//! a shape ([`super::Plan`]).

use std::fmt;

use super::tier::Tier;
use crate::model::{BlockKind, Dtype, Model, OptimizerState, Target};

/// Elements of each rank's shard of a block of `len` parameters among `ranks` ranks: the
/// block's flat buffers (parameters, gradients, master, m and v) are cut into `ranks`
/// contiguous ranges of this length, rank r owning elements `r * shard .. (r + 1) *
/// shard`; the last ranges run past the block's end into padding (zero parameters and
/// gradients, never used). A shard is a whole number of the gradient statistics'
/// pieces ([`strata_kernels::adamw::STATS_PIECE`]), so each rank computes the same
/// piece sums one process would, and the global norm is bit-identical. One rank: the
/// block's length.
pub fn shard_len(len: usize, ranks: usize) -> usize {
    if ranks <= 1 {
        len
    } else {
        len.div_ceil(ranks)
            .next_multiple_of(strata_kernels::adamw::STATS_PIECE)
    }
}

/// Bytes of one rank's shard of a layer block's working parameters in a step of `shape`
/// ([`shard_len`] of the block among `shape.ranks`): what each rank sends in most of the
/// step's all-gathers (one per layer block and pass), so the size to time collectives at.
/// A model without layer blocks: its largest block's.
pub fn layer_shard_bytes(model: &Model, shape: StepShape) -> u64 {
    let blocks = model.blocks();
    let layers = blocks
        .iter()
        .filter(|b| matches!(b.kind, BlockKind::Transformer { .. }))
        .map(|b| b.len)
        .max();
    let len = layers
        .or_else(|| blocks.iter().map(|b| b.len).max())
        .unwrap_or(0);
    shard_len(len, shape.ranks) as u64 * shape.precision.param_bytes()
}

/// The dtype of the working parameters (master parameters are always fp32; AdamW's
/// moments are in [`OptimizerState`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Everything fp32.
    Fp32,
    /// bf16 working parameters.
    Bf16,
    /// fp16 working parameters, with dynamic loss scaling.
    Fp16,
}

impl Precision {
    /// Bytes of one working parameter.
    pub fn param_bytes(self) -> u64 {
        self.dtype().size() as u64
    }

    /// The dtype of the working parameters.
    pub fn dtype(self) -> Dtype {
        match self {
            Precision::Fp32 => Dtype::F32,
            Precision::Bf16 => Dtype::Bf16,
            Precision::Fp16 => Dtype::F16,
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        })
    }
}

/// Which layer blocks recompute their forward in the backward, from their input
/// checkpoint, instead of keeping the activations their backward reads (the family's
/// saved activations, from the block's forward to its backward: on the device, or
/// offloaded, copied out after the forward and back in before the backward). Results
/// are bit-identical whatever is chosen: only memory and time differ. How auto
/// chooses: [`Plan::build`](crate::plan::Plan::build).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep every layer's activations on the device when the device budget allows;
    /// else as many as fit, the others offloaded or recomputing, whichever the cost
    /// model predicts faster within the budgets.
    #[default]
    Auto,
    /// Every layer recomputes its forward in the backward: least device memory (only
    /// the checkpoints are kept).
    All,
    /// No layer recomputes: every layer's activations are kept, and a plan they do not
    /// fit the device budget of is refused.
    None,
    /// No layer recomputes: every layer's activations are offloaded between its forward
    /// and its backward, to host memory (to NVMe where the policy puts checkpoints
    /// there), copied back ahead of the backward (from host memory one compute ahead,
    /// from NVMe the prefetch depth); but the last layers', whose backward follows
    /// their forward too closely for that, stay on the device.
    Offload,
}

impl fmt::Display for Recompute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Recompute::Auto => "auto",
            Recompute::All => "all",
            Recompute::None => "none",
            Recompute::Offload => "offload",
        })
    }
}

/// The order in which a step's micro-batches pass through the blocks. Results are
/// bit-identical whatever is chosen (each block's gradients are summed over the
/// micro-batches in the same order): only memory, bytes moved and time differ. How auto
/// chooses: [`Plan::build`](crate::plan::Plan::build).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// Vertical where it fits every budget and the cost model predicts it faster;
    /// else horizontal. With one micro-batch per step the two are the same: horizontal.
    #[default]
    Auto,
    /// Each micro-batch runs its whole forward and backward before the next: a
    /// streamed block's parameters are fetched for every micro-batch, but only one
    /// micro-batch's activations are live at a time.
    Horizontal,
    /// Every micro-batch passes through a block before the next block runs (the
    /// forward block by block, then the backward): a streamed block's parameters are
    /// fetched once per step for the forward and once for the backward (or read with
    /// its optimizer state), but the checkpoints (and flowing activations and
    /// gradients) of all the step's micro-batches are live at once.
    Vertical,
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Schedule::Auto => "auto",
            Schedule::Horizontal => "horizontal",
            Schedule::Vertical => "vertical",
        })
    }
}

/// Whether a block's gradients wait for the global norm on NVMe rather than in host
/// memory. With clipping (or fp16's overflow check) no update can start before the
/// whole backward ends, so every block's gradients are held at once: 4 bytes per
/// parameter. A spilled block's gradients are written to an NVMe extent as its backward
/// completes them, after their statistics for the norm are taken, and read back,
/// `depth` blocks ahead with its optimizer state, for its update: host memory then
/// holds a few blocks' gradients, for 8 bytes per parameter more NVMe traffic. Results
/// are bit-identical either way. Only blocks whose optimizer state is on NVMe spill,
/// in a step with the norm barrier, one rank and no delayed update. How auto chooses:
/// [`Plan::build`](crate::plan::Plan::build).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum GradSpill {
    /// Spill when the plan without it is over the host budget.
    #[default]
    Auto,
    /// Spill every block that can.
    Always,
    /// Never spill.
    Never,
}

impl fmt::Display for GradSpill {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GradSpill::Auto => "auto",
            GradSpill::Always => "always",
            GradSpill::Never => "never",
        })
    }
}

/// How a step's gradients are kept once complete (summed over the micro-batches, in
/// f32): as they are, or rounded to bf16 (round to nearest, ties to even) before their
/// statistics and the update read them. Rounded, they are the same bits under every
/// policy (each block's are rounded once, where its sum is complete), and those that wait
/// for the norm on NVMe ([`GradSpill`]) are written and read in 2 bytes each instead of
/// 4. Only when training in bf16 ([`Precision::Bf16`]), alone (one rank).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum GradDtype {
    /// f32, as the backward sums them.
    #[default]
    Fp32,
    /// Rounded to bf16 once complete.
    Bf16,
}

impl GradDtype {
    /// Bytes per gradient where the step keeps a complete one in its own dtype (spilled).
    pub const fn bytes(self) -> u64 {
        match self {
            GradDtype::Fp32 => 4,
            GradDtype::Bf16 => 2,
        }
    }
}

impl fmt::Display for GradDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GradDtype::Fp32 => "fp32",
            GradDtype::Bf16 => "bf16",
        })
    }
}

/// The shape of one training step and what the device offers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepShape {
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    /// Working dtype.
    pub precision: Precision,
    /// How AdamW's moments are stored (fp32, bf16 or 8-bit; the master parameters are
    /// fp32 in every format). Other than fp32 only where the CPU updates the block:
    /// the device's AdamW program keeps fp32 moments.
    pub optimizer_state: OptimizerState,
    /// Whether every update waits for the global gradient norm (clipping, or fp16's
    /// overflow check): then the optimizer cannot start before the whole backward ends.
    pub needs_global_norm: bool,
    /// One-step delayed update (ZeRO-Offload's DPU): step t's compute runs on the
    /// parameters before step t-1's update, which the CPU applies meanwhile, so the
    /// update overlaps the forward and backward instead of following them.
    pub delayed_update: bool,
    /// The device's kernels: the CPU device computes in f32 whatever the working dtype;
    /// a GPU computes in the working dtype.
    pub target: Target,
    /// Which blocks recompute their forward in the backward.
    pub recompute: Recompute,
    /// The order of the micro-batches through the blocks.
    pub schedule: Schedule,
    /// Whether gradients wait for the global norm on NVMe.
    pub grad_spill: GradSpill,
    /// How complete gradients are kept: f32, or rounded to bf16 ([`GradDtype`]).
    pub grad_dtype: GradDtype,
    /// Processes training together (ZeRO-3 data parallelism, 1: alone). Each rank runs
    /// `grad_accum` micro-batches of the step and owns one shard of every block's
    /// parameters, gradients and optimizer state
    /// ([`Plan::shard_len`](crate::plan::Plan::shard_len)).
    pub ranks: usize,
    /// With ranks: whether collectives of device-resident data (all-on-device's
    /// gradients and parameters) run over device memory ([`Device::all_gather`], NCCL on
    /// a GPU) rather than staged through host memory (copies out, the host collective,
    /// copies in). Ignored alone.
    ///
    /// [`Device::all_gather`]: crate::device::DeviceOps::all_gather
    pub device_collectives: bool,
    /// Whether each step ends by fetching the next step's first parameters (those its
    /// first `depth` computes read), so that the next step's compute starts at once: the
    /// fetches overlap the last backwards and updates, and their device buffers stay
    /// live across the step boundary (the plan counts them). With a delayed update, the
    /// parameters its update wrote (the next step's). One rank only; with ranks,
    /// ignored.
    /// [`Plan::build`](crate::plan::Plan::build) drops it where the plan would not fit
    /// its budgets with it but does without.
    pub prefetch_next_step: bool,
}

impl StepShape {
    /// A micro-batch of `batch` × `seq` tokens, fp32, one micro-batch per step, on the
    /// CPU device, without clipping, keeping activations as the budget allows
    /// ([`Recompute::Auto`]).
    pub fn cpu(batch: usize, seq: usize) -> Self {
        StepShape {
            batch,
            seq,
            grad_accum: 1,
            precision: Precision::Fp32,
            optimizer_state: OptimizerState::Fp32,
            needs_global_norm: false,
            delayed_update: false,
            target: Target::Cpu,
            recompute: Recompute::Auto,
            schedule: Schedule::Auto,
            grad_spill: GradSpill::Auto,
            grad_dtype: GradDtype::Fp32,
            ranks: 1,
            device_collectives: true,
            prefetch_next_step: true,
        }
    }

    /// The same step as one of `ranks` processes training together.
    pub fn with_ranks(self, ranks: usize) -> Self {
        StepShape { ranks, ..self }
    }

    /// The same step with device collectives on or off ([`StepShape::device_collectives`]).
    pub fn with_device_collectives(self, device_collectives: bool) -> Self {
        StepShape {
            device_collectives,
            ..self
        }
    }

    /// The same step recomputing as `recompute` says.
    pub fn recomputing(self, recompute: Recompute) -> Self {
        StepShape { recompute, ..self }
    }

    /// The same step in the micro-batch order `schedule` says.
    pub fn scheduled(self, schedule: Schedule) -> Self {
        StepShape { schedule, ..self }
    }

    /// The same step spilling gradients as `grad_spill` says.
    pub fn spilling(self, grad_spill: GradSpill) -> Self {
        StepShape { grad_spill, ..self }
    }

    /// The same step keeping its complete gradients in `grad_dtype`.
    pub fn with_grad_dtype(self, grad_dtype: GradDtype) -> Self {
        StepShape { grad_dtype, ..self }
    }

    /// The same step keeping AdamW's moments in `optimizer_state`.
    pub fn with_state(self, optimizer_state: OptimizerState) -> Self {
        StepShape {
            optimizer_state,
            ..self
        }
    }

    /// The same step fetching the next step's first parameters at its end, or not
    /// ([`StepShape::prefetch_next_step`]).
    pub fn prefetching_next_step(self, prefetch_next_step: bool) -> Self {
        StepShape {
            prefetch_next_step,
            ..self
        }
    }

    /// The same step on `target`'s kernels.
    pub fn on(self, target: Target) -> Self {
        StepShape { target, ..self }
    }

    /// The dtype of the device's parameters and activations.
    pub fn device_dtype(&self) -> Dtype {
        match self.target {
            Target::Cpu => Dtype::F32,
            Target::Cuda => self.precision.dtype(),
        }
    }

    /// The same step with clipping (a global-norm barrier before the updates).
    pub fn clipped(self) -> Self {
        StepShape {
            needs_global_norm: true,
            ..self
        }
    }

    /// The same step with the one-step delayed update.
    pub fn delayed(self) -> Self {
        StepShape {
            delayed_update: true,
            ..self
        }
    }

    /// Tokens per optimizer step, of this rank.
    pub fn tokens(&self) -> u64 {
        (self.batch * self.seq * self.grad_accum) as u64
    }

    /// Whether a block whose optimizer state lives on `state` has its collectives over
    /// device memory in this step: with ranks, its state (and so its gradients) on the
    /// device, and device collectives asked for.
    pub(super) fn device_comm(&self, state: Tier) -> bool {
        self.ranks > 1 && self.device_collectives && state == Tier::Device
    }

    /// Whether a block whose optimizer state lives on `state` can have its gradients wait
    /// for the norm on NVMe in this step (see [`GradSpill`]).
    pub(super) fn can_spill(&self, state: Tier) -> bool {
        state == Tier::Nvme && self.needs_global_norm && self.ranks == 1 && !self.delayed_update
    }

    /// Whether the step's first parameter fetches move to the end of the step before
    /// ([`StepShape::prefetch_next_step`], where it applies: one rank).
    pub(super) fn prefetches_next_head(&self) -> bool {
        self.prefetch_next_step && self.ranks == 1
    }

    /// Whether a block's working parameters (on `params`) are its master copy (in its
    /// optimizer state, on `state`): both on NVMe, in fp32, without a delayed update
    /// (which rewrites the state while the step still reads the old parameters). Then the
    /// block's parameters are fetched from the head of its state extent, and NVMe holds
    /// them once.
    pub(super) fn shares_master(&self, params: Tier, state: Tier) -> bool {
        params == Tier::Nvme
            && state == Tier::Nvme
            && self.precision == Precision::Fp32
            && !self.delayed_update
    }
}
