//! The plan's operations: what each does, typed by the lanes that run it.
//!
//! An [`OpKind`] is one of four families, each the work of its own lanes: NVMe transfers
//! and commits ([`NvmeOp`], the two NVMe lanes), device stream work ([`StreamOp`]: copies
//! and programs, the four streams), host arithmetic ([`HostOp`], the CPU lane) and
//! collectives among ranks ([`CommOp`], the collective lane). A lane's dispatch is
//! exhaustive over its family's operations: no lane is handed an operation it cannot run.
//!
//! Not here: when an operation runs (its [`Op::deps`], derived by the planner) or how (the
//! executor's lanes).

use std::fmt;

use super::buffers::Access;
use super::ids::{BufId, OpId};
use crate::lane::Lane;
use crate::model::{Dtype, Pass};
use crate::plan::shape::GradDtype;

/// The buffers a block program is bound to (see `crate::model::Bind`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Binds {
    /// The block's working parameters.
    pub params: Option<BufId>,
    /// The block's gradients.
    pub grads: Option<BufId>,
    /// The tied block's parameters.
    pub tied_params: Option<BufId>,
    /// The tied block's gradients.
    pub tied_grads: Option<BufId>,
    /// The input activation.
    pub input: Option<BufId>,
    /// The output activation.
    pub output: Option<BufId>,
    /// The gradient of the output.
    pub d_output: Option<BufId>,
    /// The gradient of the input.
    pub d_input: Option<BufId>,
    /// Token ids then target ids.
    pub tokens: Option<BufId>,
    /// Per-position losses.
    pub losses: Option<BufId>,
    /// The block's saved activations (a kept block's forward writes them, its backward
    /// reads them).
    pub saved: Option<BufId>,
}

/// Where the global norm takes a block's gradient statistics from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradSource {
    /// Computes them from host gradients (f32).
    Host(BufId),
    /// Reads the two f64 a device computed, copied to a host buffer.
    Stats(BufId),
}

/// An operation's label, shown as `fwd 3` or `h2d`: what it does and the block, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpLabel {
    /// What the operation does (`fwd`, `nvme read`).
    pub what: &'static str,
    /// The block it works on.
    pub block: Option<usize>,
}

impl fmt::Display for OpLabel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.block {
            Some(b) => write!(f, "{} {b}", self.what),
            None => f.write_str(self.what),
        }
    }
}

/// What an operation does, in the family of the lanes that run it.
#[derive(Debug, Clone, PartialEq)]
pub enum OpKind {
    /// An NVMe transfer or commit (the NVMe lanes).
    Nvme(NvmeOp),
    /// A copy or a program on one of the device's streams.
    Stream(StreamOp),
    /// Host arithmetic on the CPU lane.
    Host(HostOp),
    /// A collective among ranks (the collective lane).
    Collective(CommOp),
}

/// The work of the NVMe lanes: transfers between the host (or, on the CPU device, device
/// memory) and extents, and the commits that make an update's extents current.
#[derive(Debug, Clone, PartialEq)]
pub enum NvmeOp {
    /// Reads an extent into a host buffer, or (the CPU device) a device buffer. On the
    /// read lane, or (a delayed update's state reads) the write lane.
    Read {
        /// The extent (a buffer of kind [`BufKind::Extent`](super::BufKind::Extent)).
        from: BufId,
        /// Host buffer, or device buffer on the CPU device.
        into: BufId,
        /// Where in `into` the extent goes, in bytes (a multiple of 4 KiB): 0, or past a
        /// LoRA block's frozen base, read from an extent of its own.
        at: u64,
    },
    /// Writes a host buffer to an extent. Skipped with the update when a step is skipped
    /// (fp16 overflow) if `with_update`.
    Write {
        /// Host buffer.
        from: BufId,
        /// The extent.
        to: BufId,
        /// Part of the parameter update.
        with_update: bool,
    },
    /// Makes a block's update durable (NVMe write lane, after the block's NVMe writes):
    /// each shadow-paged group of the block the update wrote becomes current, its old
    /// extent a spare, and the block counts the step as applied when its optimizer state
    /// is on NVMe. Skipped with the update.
    Commit {
        /// Block.
        block: usize,
    },
}

impl NvmeOp {
    /// The extent a transfer reads or writes; none for a commit.
    pub fn extent(&self) -> Option<BufId> {
        match *self {
            NvmeOp::Read { from, .. } => Some(from),
            NvmeOp::Write { to, .. } => Some(to),
            NvmeOp::Commit { .. } => None,
        }
    }
}

/// The work of the device's streams: copies each way, and programs on the compute and
/// update streams.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamOp {
    /// Copies a host buffer into a device buffer (parameters, checkpoints, tokens).
    H2d {
        /// Host buffer.
        from: BufId,
        /// Device buffer.
        to: BufId,
        /// Where in `to` the copy goes, in elements (0, or a LoRA block's `frozen`: its
        /// new adapters copied past its base).
        to_at: u64,
        /// Bytes the copy reads from the host buffer.
        bytes: u64,
        /// From the host's dtype to the device's (parameters on the CPU device).
        convert: Option<(Dtype, Dtype)>,
        /// Part of the parameter update (skipped with it).
        with_update: bool,
    },
    /// Copies a device buffer to a host buffer (gradients, checkpoints, losses,
    /// statistics).
    D2h {
        /// Device buffer.
        from: BufId,
        /// Host buffer.
        to: BufId,
        /// Bytes.
        bytes: u64,
    },
    /// A block's forward or backward program for one micro-batch.
    Compute {
        /// Block.
        block: usize,
        /// Micro-batch.
        micro: usize,
        /// Which program.
        pass: Pass,
        /// Its buffers.
        binds: Binds,
    },
    /// Adds a micro-batch's device gradients to the device-homed ones (compute stream).
    Accumulate {
        /// Block.
        block: usize,
        /// This micro-batch's gradients.
        from: BufId,
        /// The home.
        to: BufId,
    },
    /// Rounds a block's complete device gradients to bf16 in place (compute stream;
    /// [`GradDtype::Bf16`](crate::plan::GradDtype)).
    RoundGrads {
        /// Block.
        block: usize,
        /// The device gradients.
        grads: BufId,
    },
    /// The statistics of a block's device gradients (update stream), for the norm.
    DeviceStats {
        /// Block.
        block: usize,
        /// Device gradients.
        grads: BufId,
        /// Device buffer of 16 bytes.
        stats: BufId,
    },
    /// Writes a quantised block's frozen base into its device parameters from its packed
    /// image ([`QuantBlock`](crate::model::QuantBlock)), just fetched (update stream, which
    /// the step's compute does not queue behind).
    Dequantize {
        /// Block.
        block: usize,
        /// The packed image on the device.
        packed: BufId,
        /// The block's device parameters, whose base elements it writes.
        params: BufId,
    },
    /// AdamW on one block on the device (its optimizer state lives there).
    DeviceUpdate {
        /// Block.
        block: usize,
        /// Device gradients.
        grads: BufId,
        /// Device optimizer state.
        state: BufId,
        /// Device working parameters, written.
        params: BufId,
    },
}

impl StreamOp {
    /// The stream that runs it.
    pub fn lane(&self) -> Lane {
        match self {
            StreamOp::H2d { .. } => Lane::H2d,
            StreamOp::D2h { .. } => Lane::D2h,
            StreamOp::Compute { .. }
            | StreamOp::Accumulate { .. }
            | StreamOp::RoundGrads { .. } => Lane::Compute,
            StreamOp::DeviceStats { .. }
            | StreamOp::DeviceUpdate { .. }
            | StreamOp::Dequantize { .. } => Lane::Update,
        }
    }
}

/// Host arithmetic on gradients and optimizer state (the CPU lane).
#[derive(Debug, Clone, PartialEq)]
pub enum HostOp {
    /// Adds a micro-batch's gradients, copied to the host, to the host gradients.
    Accumulate {
        /// Block.
        block: usize,
        /// The copy.
        from: BufId,
        /// The host gradients.
        to: BufId,
    },
    /// Rounds a block's complete host gradients to bf16 in place
    /// ([`GradDtype::Bf16`](crate::plan::GradDtype)); where they spill, also writes
    /// them as bf16 into `out`, which the spill writes.
    RoundGrads {
        /// Block.
        block: usize,
        /// The host gradients (f32).
        grads: BufId,
        /// A host buffer of 2 bytes per gradient, for the spill.
        out: Option<BufId>,
    },
    /// The statistics of a block's host gradients, for the norm, before they are spilled
    /// to NVMe ([`GradSpill`](crate::plan::GradSpill)).
    Stats {
        /// Block.
        block: usize,
        /// Host gradients.
        grads: BufId,
        /// Host buffer of 16 bytes.
        stats: BufId,
    },
    /// The global gradient norm and overflow check of one process, over every block.
    GradNorm {
        /// Where each block's statistics come from, in block order.
        sources: Vec<(usize, GradSource)>,
    },
    /// AdamW on one block on the CPU: reads its gradients, updates master parameters, m
    /// and v, and writes the new working parameters into a host buffer.
    Optimizer {
        /// Block.
        block: usize,
        /// Host gradients: f32, or bf16 where they spilled as bf16.
        grads: BufId,
        /// The gradients' dtype.
        grads_dtype: GradDtype,
        /// Master parameters, m and v (12 bytes per element).
        state: BufId,
        /// Host buffer for the new working parameters (working dtype); none when the
        /// master copy is the working one on NVMe
        /// ([`Plan::shares_master`](crate::plan::Plan::shares_master)).
        params_out: Option<BufId>,
        /// The element of `params_out` the new parameters start at: the block's
        /// `frozen` where it is the whole block's home (a LoRA model's adapters lie past
        /// its base), else 0 (a stage or a shard of their own).
        params_at: u64,
    },
}

/// Collectives among ranks (the collective lane).
#[derive(Debug, Clone, PartialEq)]
pub enum CommOp {
    /// Assembles a block's working parameters from every rank's shard: `from`, this
    /// rank's shard, gathered in rank order into `into`. Skipped with the update if
    /// `with_update` (every rank skips it alike: the norm is global).
    AllGather {
        /// Block.
        block: usize,
        /// This rank's shard (host, or device for a collective over device memory).
        from: BufId,
        /// Every rank's shard, in rank order (on `from`'s tier).
        into: BufId,
        /// Part of the parameter update.
        with_update: bool,
    },
    /// Gives each rank its shard of a micro-batch's gradients from every rank, and adds
    /// them in rank order into this rank's shard of the host gradients: after the
    /// previous micro-batches' when `accumulate`, else in place of them. What lands in a
    /// shard's padding is never read.
    ReduceScatter {
        /// Block.
        block: usize,
        /// This rank's gradients of the whole block (host, or device for a collective
        /// over device memory).
        from: BufId,
        /// This rank's shard of the block's gradients (on `from`'s tier).
        into: BufId,
        /// Room for every rank's chunk, where the device needs it (a GPU).
        scratch: Option<BufId>,
        /// Whether the micro-batch adds to earlier ones.
        accumulate: bool,
    },
    /// The global gradient norm and overflow check over every rank's shards of every
    /// block: each rank's piece sums of its host gradients, gathered and folded in the
    /// order of one process.
    GradNorm {
        /// Each block's host gradients (this rank's shard), in block order.
        grads: Vec<(usize, BufId)>,
    },
}

impl OpKind {
    /// Whether `lane` can run it: an NVMe operation on an NVMe lane (a transfer on
    /// either, a commit after the writes on the write lane), a stream operation on its
    /// stream, host arithmetic on the CPU lane, a collective on the collective lane.
    pub fn runs_on(&self, lane: Lane) -> bool {
        match self {
            OpKind::Nvme(NvmeOp::Read { .. }) => matches!(lane, Lane::NvmeRead | Lane::NvmeWrite),
            OpKind::Nvme(_) => lane == Lane::NvmeWrite,
            OpKind::Stream(op) => op.lane() == lane,
            OpKind::Host(_) => lane == Lane::Cpu,
            OpKind::Collective(_) => lane == Lane::Comm,
        }
    }

    /// The link the operation moves bytes over, as an index of `Plan::link_bytes` and
    /// `StepReport::link_bytes`: NVMe read 0, NVMe write 1, H2D 2, D2H 3.
    pub fn link(&self) -> Option<usize> {
        match self {
            OpKind::Nvme(NvmeOp::Read { .. }) => Some(0),
            OpKind::Nvme(NvmeOp::Write { .. }) => Some(1),
            OpKind::Stream(StreamOp::H2d { .. }) => Some(2),
            OpKind::Stream(StreamOp::D2h { .. }) => Some(3),
            _ => None,
        }
    }

    /// A short label for traces and messages (`fwd 3`, `h2d`); made without allocating.
    pub fn label(&self) -> OpLabel {
        let (what, block) = match self {
            OpKind::Nvme(op) => op.label(),
            OpKind::Stream(op) => op.label(),
            OpKind::Host(op) => op.label(),
            OpKind::Collective(op) => op.label(),
        };
        OpLabel { what, block }
    }

    /// The kind's name, for per-kind histograms.
    pub fn kind_name(&self) -> &'static str {
        match self {
            OpKind::Nvme(NvmeOp::Read { .. }) => "nvme-read",
            OpKind::Nvme(NvmeOp::Write { .. }) => "nvme-write",
            OpKind::Nvme(NvmeOp::Commit { .. }) => "commit",
            OpKind::Stream(StreamOp::H2d { .. }) => "h2d",
            OpKind::Stream(StreamOp::D2h { .. }) => "d2h",
            // Forming a block's complete gradients: summing, and rounding to bf16.
            OpKind::Stream(StreamOp::Accumulate { .. } | StreamOp::RoundGrads { .. })
            | OpKind::Host(HostOp::Accumulate { .. } | HostOp::RoundGrads { .. }) => "accumulate",
            OpKind::Stream(StreamOp::Compute { pass, .. }) if pass.is_forward() => "forward",
            OpKind::Stream(StreamOp::Compute { .. }) => "backward",
            OpKind::Stream(StreamOp::DeviceStats { .. })
            | OpKind::Host(HostOp::Stats { .. } | HostOp::GradNorm { .. })
            | OpKind::Collective(CommOp::GradNorm { .. }) => "grad-norm",
            OpKind::Host(HostOp::Optimizer { .. })
            | OpKind::Stream(StreamOp::DeviceUpdate { .. }) => "adamw",
            OpKind::Collective(CommOp::AllGather { .. } | CommOp::ReduceScatter { .. }) => {
                "collective"
            }
            OpKind::Stream(StreamOp::Dequantize { .. }) => "dequantize",
        }
    }

    /// Every kind name [`OpKind::kind_name`] returns.
    pub const KIND_NAMES: [&'static str; 12] = [
        "nvme-read",
        "nvme-write",
        "h2d",
        "d2h",
        "accumulate",
        "forward",
        "backward",
        "grad-norm",
        "adamw",
        "commit",
        "collective",
        "dequantize",
    ];
}

/// What each family's operations are called in labels: (what, block).
type LabelParts = (&'static str, Option<usize>);

impl NvmeOp {
    fn label(&self) -> LabelParts {
        match *self {
            NvmeOp::Read { .. } => ("nvme read", None),
            NvmeOp::Write { .. } => ("nvme write", None),
            NvmeOp::Commit { block } => ("commit", Some(block)),
        }
    }
}

impl StreamOp {
    fn label(&self) -> LabelParts {
        match *self {
            StreamOp::H2d { .. } => ("h2d", None),
            StreamOp::D2h { .. } => ("d2h", None),
            StreamOp::Compute { block, pass, .. } if pass.is_forward() => ("fwd", Some(block)),
            StreamOp::Compute { block, .. } => ("bwd", Some(block)),
            StreamOp::Accumulate { block, .. } => ("accumulate grads", Some(block)),
            StreamOp::RoundGrads { block, .. } => ("round grads", Some(block)),
            StreamOp::DeviceStats { block, .. } => ("grad stats", Some(block)),
            StreamOp::DeviceUpdate { block, .. } => ("device adamw", Some(block)),
            StreamOp::Dequantize { block, .. } => ("dequantize", Some(block)),
        }
    }
}

impl HostOp {
    fn label(&self) -> LabelParts {
        match *self {
            HostOp::Accumulate { block, .. } => ("host accumulate grads", Some(block)),
            HostOp::RoundGrads { block, .. } => ("host round grads", Some(block)),
            HostOp::Stats { block, .. } => ("grad stats", Some(block)),
            HostOp::GradNorm { .. } => ("grad norm", None),
            HostOp::Optimizer { block, .. } => ("adamw", Some(block)),
        }
    }
}

impl CommOp {
    fn label(&self) -> LabelParts {
        match *self {
            CommOp::AllGather { block, .. } => ("all-gather", Some(block)),
            CommOp::ReduceScatter { block, .. } => ("reduce-scatter", Some(block)),
            CommOp::GradNorm { .. } => ("grad norm", None),
        }
    }
}

/// One operation of the schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct Op {
    /// What it does.
    pub kind: OpKind,
    /// The lane that runs it (one its kind [`OpKind::runs_on`]).
    pub lane: Lane,
    /// Operations that must finish before it starts (all earlier in canonical order).
    pub deps: Vec<OpId>,
    /// Its buffer accesses.
    pub access: Vec<Access>,
    /// Bytes it moves (copies and I/O) or reads and writes (passes over gradients).
    pub bytes: u64,
    /// Floating-point operations (compute), for the cost model.
    pub flops: f64,
    /// Parameters it updates (optimizer) or reduces (norm), for the cost model.
    pub params: u64,
    /// Part of the parameter update (statistics, state reads, the norm, AdamW,
    /// write-backs): with a delayed update these run apart from the step's compute, and
    /// alone in a flush.
    pub update: bool,
    /// Fetches the next step's first parameters ([`StepShape::prefetch_next_step`]):
    /// runs at the end of every step, and alone before a step whose head was not
    /// fetched by the step before it (the first, or after a failure or a load).
    ///
    /// [`StepShape::prefetch_next_step`]: crate::plan::StepShape::prefetch_next_step
    pub next_step: bool,
}
