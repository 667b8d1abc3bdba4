//! The planner: (model, step shape, policy, budgets) -> a static schedule and its memory
//! plan, in stages:
//!
//! 1. Homes ([`Planner::new`]): the policy names a tier for every block's tensor classes,
//!    checked against the engine's rules.
//! 2. Buffers ([`Planner::home_buffers`], [`Planner::step_buffers`]): persistent homes
//!    (device- or host-resident) and NVMe extents, and the step's transient buffers:
//!    device parameter copies per use group, checkpoints, the saved activations of the
//!    blocks the plan keeps, activation gradients, per-micro-batch gradients, staging. Data homed on NVMe that a step rewrites
//!    (working parameters, optimizer state) is shadow-paged ([`ExtentKind::Shadow`]): a
//!    block's update writes its new data to a spare extent of the same size, and the
//!    block's commit operation flips the group to it, the old extent becoming the spare;
//!    NVMe holds the state once plus a spare per size (an A/B pair only for working
//!    parameters a delayed update rewrites while the step still reads them).
//! 3. Emission ([`Planner::emit`]), in one canonical order, a topological order of the
//!    step: the compute sequence (forward blocks, the head's forward and backward,
//!    backward blocks), with fetches placed `depth` compute operations ahead of their use
//!    and gradient copies, updates and write-backs right after the backward that
//!    completes a block's gradients (after a global-norm barrier when clipping, or spread
//!    over the next step's compute with a delayed update). Each lane runs its operations
//!    in this order.
//! 4. Dependencies and memory ([`super::memory`]): edges from each operation's reads and
//!    writes of logical buffers; transient buffers of one tier share physical slots when
//!    their lifetimes do not overlap, each reuse adding edges from the previous
//!    occupant's users; slots get their offsets in the tier's arena.
//!
//! Which layer blocks keep their saved activations (and skip recomputing their forward
//! in the backward) is decided around these stages ([`Plan::build`]): all of them when
//! the device peak allows, else as many as fit, chosen by the FLOPs each saves per byte
//! it keeps.
//!
//! The planner knows blocks, tensor classes and tiers; what a block computes is the
//! model family's (it is asked for sizes and FLOPs only).

use std::fmt;

use super::{
    Budgets, GradSpill, PlanError, PlanInput, Policy, Precision, Recompute, Release, StepShape,
    TensorClass, Tier,
};
use crate::lane::Lane;
use crate::model::{BlockLayout, Dtype, Pass, Shape, update};

/// Index of an operation in [`Plan::ops`] (the canonical order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub u32);

/// Index of a logical buffer in [`Plan::buffers`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufId(pub u32);

/// Index of a physical slot in [`Plan::slots`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId(pub u32);

macro_rules! index_type {
    ($($t:ident),*) => {$(
        impl $t {
            /// The position in its table.
            pub fn index(self) -> usize {
                self.0 as usize
            }

            /// The id of position `i`.
            pub fn of(i: usize) -> Self {
                $t(u32::try_from(i).expect("a plan indexes fewer than 2^32 items"))
            }
        }

        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}", self.0)
            }
        }
    )*};
}
index_type!(OpId, BufId, SlotId);

/// Where a logical buffer's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BufKind {
    /// Bytes in the device arena.
    Device,
    /// Bytes in the pinned host arena (4096-aligned, for O_DIRECT).
    Host,
    /// One NVMe extent group, the side an operation touches.
    Extent {
        /// Index into [`Plan::extent_groups`].
        group: usize,
        /// Which side.
        side: ExtentSide,
    },
    /// Not memory: orders the updates after the global gradient norm.
    Flag,
}

/// Which extent of a group an operation touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExtentSide {
    /// The group has one extent.
    Single,
    /// The extent holding the data before this step's update.
    Current,
    /// The extent this step's update writes; current once the block commits (shadow) or
    /// the step ends (pair).
    Next,
}

/// How an extent group keeps its data from step to step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExtentKind {
    /// One extent, written and read within a step (activation checkpoints).
    Single,
    /// Two extents, A and B: a step reads one and writes the other, and they swap after
    /// a step that applied an update. For working parameters a delayed update rewrites
    /// while the same step's compute still reads the old ones.
    Pair,
    /// Shadow paging: the update writes the new data to a spare extent of the same size
    /// (from [`Plan::spares`]); the block's [`OpKind::Commit`] makes it current and the
    /// old one a spare. A failed step leaves every uncommitted block's old extent in place.
    Shadow,
}

/// Extents on the NVMe tier that belong together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extent {
    /// Name (also the store's extent name, with `.a`/`.b` for pairs).
    pub name: String,
    /// Bytes of one extent.
    pub bytes: u64,
    /// How it is kept across steps.
    pub kind: ExtentKind,
    /// The block.
    pub block: usize,
    /// The class of its data.
    pub class: TensorClass,
}

impl Extent {
    /// Bytes one extent of the group takes in a swap file (rounded up to 4096).
    pub fn allocated_bytes(&self) -> u64 {
        self.bytes.next_multiple_of(4096)
    }

    /// Bytes the group's own extents take (a pair two, spares not counted).
    pub fn stored_bytes(&self) -> u64 {
        self.allocated_bytes() * if self.kind == ExtentKind::Pair { 2 } else { 1 }
    }
}

/// The spares shadow paging needs: for each size of the shadow-paged groups, as many as
/// one block has groups of that size (a block's commit holds them until it flips; the
/// NVMe write lane commits block by block, in order). Sizes are exact: an extent keeps
/// the length it was allocated with.
fn spare_extents(groups: &[Extent]) -> Vec<(u64, usize)> {
    let mut per_block: std::collections::BTreeMap<(usize, u64), usize> = Default::default();
    for g in groups.iter().filter(|g| g.kind == ExtentKind::Shadow) {
        *per_block.entry((g.block, g.bytes)).or_default() += 1;
    }
    let mut spares: std::collections::BTreeMap<u64, usize> = Default::default();
    for ((_, bytes), n) in per_block {
        let most = spares.entry(bytes).or_default();
        *most = (*most).max(n);
    }
    spares.into_iter().collect()
}

/// One logical buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct BufferPlan {
    /// Name for traces and messages (`params[3]@device`).
    pub name: String,
    /// Tier its memory counts against.
    pub tier: Tier,
    /// Where its bytes are.
    pub kind: BufKind,
    /// Bytes.
    pub bytes: u64,
    /// Lives across steps (homes, fixed buffers): never shares memory.
    pub persistent: bool,
    /// The physical slot that holds it, if memory.
    pub slot: Option<SlotId>,
    /// First and last operations that touch it.
    pub live: Option<(OpId, OpId)>,
}

/// A physical buffer: allocated once, shared by logical buffers with disjoint lifetimes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotPlan {
    /// Tier (device or host).
    pub tier: Tier,
    /// Bytes: the largest of its logical buffers.
    pub bytes: u64,
    /// Where it starts in its tier's arena.
    pub offset_bytes: u64,
}

/// A read or a write of a logical buffer by an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Reads.
    Read(BufId),
    /// Writes (possibly after reading).
    Write(BufId),
}

impl Access {
    /// The buffer accessed.
    pub fn buf(self) -> BufId {
        match self {
            Access::Read(b) | Access::Write(b) => b,
        }
    }
}

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

/// What an operation does.
#[derive(Debug, Clone, PartialEq)]
pub enum OpKind {
    /// Reads an extent into a host buffer, or (the CPU device) a device buffer.
    NvmeRead {
        /// The extent (a buffer of kind [`BufKind::Extent`]).
        from: BufId,
        /// Host buffer, or device buffer on the CPU device.
        into: BufId,
    },
    /// Writes a host buffer to an extent. Skipped with the update when a step is skipped
    /// (fp16 overflow) if `with_update`.
    NvmeWrite {
        /// Host buffer.
        from: BufId,
        /// The extent.
        to: BufId,
        /// Part of the parameter update.
        with_update: bool,
    },
    /// Copies a host buffer into a device buffer (parameters, checkpoints, tokens).
    H2d {
        /// Host buffer.
        from: BufId,
        /// Device buffer.
        to: BufId,
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
    /// Adds a micro-batch's gradients, copied to the host, to the host gradients (CPU).
    HostAccumulate {
        /// Block.
        block: usize,
        /// The copy.
        from: BufId,
        /// The host gradients.
        to: BufId,
    },
    /// The statistics of a block's device gradients (compute stream), for the norm.
    DeviceStats {
        /// Block.
        block: usize,
        /// Device gradients.
        grads: BufId,
        /// Device buffer of 16 bytes.
        stats: BufId,
    },
    /// The statistics of a block's host gradients (CPU), for the norm, before they are
    /// spilled to NVMe ([`GradSpill`]).
    HostStats {
        /// Block.
        block: usize,
        /// Host gradients.
        grads: BufId,
        /// Host buffer of 16 bytes.
        stats: BufId,
    },
    /// The global gradient norm and overflow check (CPU), over every block.
    GradNorm {
        /// Where each block's statistics come from, in block order.
        sources: Vec<(usize, GradSource)>,
    },
    /// AdamW on one block on the CPU: reads its gradients, updates master parameters, m
    /// and v, and writes the new working parameters into a host buffer.
    Optimizer {
        /// Block.
        block: usize,
        /// Host gradients (f32).
        grads: BufId,
        /// Master parameters, m and v (12 bytes per element).
        state: BufId,
        /// Host buffer for the new working parameters (working dtype); none when the
        /// master copy is the working one on NVMe ([`Plan::shares_master`]).
        params_out: Option<BufId>,
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
    /// Assembles a block's working parameters from every rank's shard (collective
    /// lane): `from`, this rank's shard, gathered in rank order into `into`. Skipped with
    /// the update if `with_update` (every rank skips it alike: the norm is global).
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
    /// Gives each rank its shard of a micro-batch's gradients from every rank
    /// (collective lane), and adds them in rank order into this rank's shard of the host
    /// gradients: after the previous micro-batches' when `accumulate`, else in place of
    /// them. What lands in a shard's padding is never read.
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
    /// Makes a block's update durable (NVMe write lane, after the block's NVMe writes):
    /// each shadow-paged group of the block the update wrote becomes current, its old
    /// extent a spare, and the block counts the step as applied when its optimizer state
    /// is on NVMe. Skipped with the update.
    Commit {
        /// Block.
        block: usize,
    },
}

impl OpKind {
    /// The link the operation moves bytes over, as an index of `Plan::link_bytes` and
    /// `StepReport::link_bytes`: NVMe read 0, NVMe write 1, H2D 2, D2H 3.
    pub fn link(&self) -> Option<usize> {
        match self {
            OpKind::NvmeRead { .. } => Some(0),
            OpKind::NvmeWrite { .. } => Some(1),
            OpKind::H2d { .. } => Some(2),
            OpKind::D2h { .. } => Some(3),
            _ => None,
        }
    }

    /// A short label for traces and messages (`fwd 3`, `h2d`); made without allocating.
    pub fn label(&self) -> OpLabel {
        let (what, block) = match *self {
            OpKind::NvmeRead { .. } => ("nvme read", None),
            OpKind::NvmeWrite { .. } => ("nvme write", None),
            OpKind::H2d { .. } => ("h2d", None),
            OpKind::D2h { .. } => ("d2h", None),
            OpKind::Compute { block, pass, .. } if pass.is_forward() => ("fwd", Some(block)),
            OpKind::Compute { block, .. } => ("bwd", Some(block)),
            OpKind::Accumulate { block, .. } => ("accumulate grads", Some(block)),
            OpKind::HostAccumulate { block, .. } => ("host accumulate grads", Some(block)),
            OpKind::DeviceStats { block, .. } | OpKind::HostStats { block, .. } => {
                ("grad stats", Some(block))
            }
            OpKind::GradNorm { .. } => ("grad norm", None),
            OpKind::Optimizer { block, .. } => ("adamw", Some(block)),
            OpKind::DeviceUpdate { block, .. } => ("device adamw", Some(block)),
            OpKind::Commit { block } => ("commit", Some(block)),
            OpKind::AllGather { block, .. } => ("all-gather", Some(block)),
            OpKind::ReduceScatter { block, .. } => ("reduce-scatter", Some(block)),
        };
        OpLabel { what, block }
    }

    /// The kind's name, for per-kind histograms.
    pub fn kind_name(&self) -> &'static str {
        match self {
            OpKind::NvmeRead { .. } => "nvme-read",
            OpKind::NvmeWrite { .. } => "nvme-write",
            OpKind::H2d { .. } => "h2d",
            OpKind::D2h { .. } => "d2h",
            OpKind::Accumulate { .. } | OpKind::HostAccumulate { .. } => "accumulate",
            OpKind::Compute { pass, .. } if pass.is_forward() => "forward",
            OpKind::Compute { .. } => "backward",
            OpKind::DeviceStats { .. } | OpKind::HostStats { .. } | OpKind::GradNorm { .. } => {
                "grad-norm"
            }
            OpKind::Optimizer { .. } | OpKind::DeviceUpdate { .. } => "adamw",
            OpKind::Commit { .. } => "commit",
            OpKind::AllGather { .. } | OpKind::ReduceScatter { .. } => "collective",
        }
    }

    /// Every kind name [`OpKind::kind_name`] returns.
    pub const KIND_NAMES: [&'static str; 11] = [
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
    ];
}

/// One operation of the schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct Op {
    /// What it does.
    pub kind: OpKind,
    /// The lane that runs it.
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
}

/// The persistent buffers of one block that hold its state between steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHomes {
    /// The working parameters the next step reads (an extent's current side when on
    /// NVMe).
    pub params: BufId,
    /// Master parameters, m and v (an extent's current side when on NVMe).
    pub state: BufId,
}

/// The static schedule and memory plan of one training step.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The policy it was built from.
    pub policy: String,
    /// Home tier of every block's classes, indexed by [`TensorClass`] order
    /// (params, grads, optimizer; checkpoints: of the block's input).
    pub homes: Vec<[Tier; 4]>,
    /// Per block: whether its forward keeps its saved activations on the device for its
    /// backward, which then does not recompute the forward. False for the layer blocks
    /// that recompute, and for the blocks that save nothing (embedding, head).
    pub kept: Vec<bool>,
    /// Per block: bytes of the saved activations it keeps on the device, per
    /// micro-batch (0 where `kept` is false). Every kept block's are live at once, around
    /// the head; micro-batches reuse the first one's memory.
    pub saved_bytes: Vec<u64>,
    /// Per block: whether its gradients wait for the global norm on NVMe
    /// ([`GradSpill`]) rather than in host memory.
    pub grads_spilled: Vec<bool>,
    /// Prefetch depth used.
    pub depth: usize,
    /// The step's shape.
    pub shape: StepShape,
    /// The budgets checked against.
    pub budgets: Budgets,
    /// Operations, in canonical order.
    pub ops: Vec<Op>,
    /// Each lane's operations, in order (indexed by [`Lane::index`]).
    pub lanes: [Vec<OpId>; Lane::COUNT],
    /// Logical buffers.
    pub buffers: Vec<BufferPlan>,
    /// Physical slots.
    pub slots: Vec<SlotPlan>,
    /// NVMe extent groups.
    pub extent_groups: Vec<Extent>,
    /// Spare extents for shadow paging: (bytes of each, how many), one entry per length
    /// of the shadow-paged groups, as many as one block's commit can hold at once.
    pub spares: Vec<(u64, usize)>,
    /// Peak bytes per tier ([`Tier::index`]): the sum of the tier's slots (and extents).
    pub peak: [u64; 3],
    /// Bytes per step over each link: NVMe read, NVMe write, H2D, D2H.
    pub link_bytes: [u64; 4],
    /// Each block's persistent state buffers.
    pub block_homes: Vec<BlockHomes>,
    /// Per block: elements of this rank's shard of its parameters, gradients and
    /// optimizer state ([`super::shard_len`]; the block's length with one rank).
    pub shard_len: Vec<u64>,
    /// Per micro-batch: the host buffer the executor writes the tokens and targets into
    /// before a step.
    pub tokens_host: Vec<BufId>,
    /// Per micro-batch: the host buffer the step leaves the per-position losses in.
    pub losses_host: Vec<BufId>,
    /// Per block: the host buffer holding the statistics of its device gradients after
    /// an update, when the device computes them.
    pub stats_host: Vec<Option<BufId>>,
    /// The device scratch every program of the compute stream runs in.
    pub scratch: BufId,
    /// The device scratch of the gradient statistics on the update stream.
    pub stats_scratch: BufId,
    /// Delayed update: pairs of persistent buffers (gradients being filled, gradients
    /// being applied) whose memory the executor exchanges after every step.
    pub swap_each_step: Vec<(BufId, BufId)>,
    /// Delayed update: pairs of persistent homes (working parameters read by this step,
    /// written by its update) exchanged after every step that applied an update.
    pub swap_on_update: Vec<(BufId, BufId)>,
}

impl Plan {
    /// Operation `id`.
    pub fn op(&self, id: OpId) -> &Op {
        &self.ops[id.index()]
    }

    /// Buffer `id`.
    pub fn buffer(&self, id: BufId) -> &BufferPlan {
        &self.buffers[id.index()]
    }

    /// Whether block `b`'s working parameters are its fp32 master copy, kept once at the
    /// head of its NVMe optimizer state (master, m, v) and fetched from there: with
    /// both on NVMe in fp32 and no delayed update. Every write of NVMe optimizer state
    /// also checksums that head, so it can be read and verified alone.
    pub fn shares_master(&self, b: usize) -> bool {
        shares_master(
            self.homes[b][0],
            self.homes[b][2],
            self.shape.precision,
            self.shape.delayed_update,
        )
    }

    /// Whether block `b`'s collectives run over device memory
    /// ([`StepShape::device_collectives`]): then its device update writes its shard of
    /// the new parameters in the device's dtype, gathered there.
    pub fn device_comm(&self, b: usize) -> bool {
        device_comm(&self.shape, self.homes[b][2])
    }
}

/// Whether a block whose optimizer state lives on `state` has its collectives over
/// device memory in a step of `shape`: with ranks, its state (and so its gradients) on
/// the device, and device collectives asked for.
fn device_comm(shape: &StepShape, state: Tier) -> bool {
    shape.ranks > 1 && shape.device_collectives && state == Tier::Device
}

/// Whether a block whose optimizer state lives on `state` can have its gradients wait
/// for the norm on NVMe in a step of `shape` (see [`GradSpill`]).
fn can_spill(shape: &StepShape, state: Tier) -> bool {
    state == Tier::Nvme && shape.needs_global_norm && shape.ranks == 1 && !shape.delayed_update
}

/// Whether a block's working parameters are its master copy: both on NVMe, in fp32,
/// without a delayed update (which rewrites the state while the step still reads the
/// old parameters). Then the block's parameters are fetched from the head of its state
/// extent, and NVMe holds them once.
fn shares_master(params: Tier, state: Tier, precision: Precision, delayed: bool) -> bool {
    params == Tier::Nvme && state == Tier::Nvme && precision == Precision::Fp32 && !delayed
}

/// Bytes rounded up to the 4096 O_DIRECT needs.
fn host_bytes(bytes: u64) -> u64 {
    bytes.max(1).next_multiple_of(4096)
}

/// Per-block decisions, resolved and checked.
struct Homes {
    params: Tier,
    grads: Tier,
    state: Tier,
    /// Of the block's input checkpoint (transformer blocks only).
    ckpt: Tier,
}

/// One compute operation in the canonical sequence, before emission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Compute {
    /// The embedding's forward of a micro-batch.
    Embed(usize),
    /// Block `.0`'s forward.
    Layer(usize, usize),
    /// The head's forward and backward.
    Head(usize),
    /// Block `.0`'s backward.
    LayerBack(usize, usize),
    /// The embedding's backward.
    EmbedBack(usize),
}

impl Compute {
    fn micro(self) -> usize {
        match self {
            Compute::Embed(m) | Compute::Head(m) | Compute::EmbedBack(m) => m,
            Compute::Layer(_, m) | Compute::LayerBack(_, m) => m,
        }
    }
}

/// Checkpoint buffers of one boundary of one micro-batch: the forward's device copy,
/// where the backward reads it, and the host copy between.
struct Ckpt {
    fwd: BufId,
    bwd: BufId,
    host: Option<BufId>,
}

/// The planner's state while it builds one plan.
struct Planner<'a> {
    input: &'a PlanInput<'a>,
    policy: &'a dyn Policy,
    name: String,
    shape: StepShape,
    dims: Shape,
    depth: usize,
    blocks: &'a [BlockLayout],
    homes: Vec<Homes>,
    /// Index of the head block.
    head: usize,
    /// Transformer blocks.
    layers: usize,
    /// Processes training together, and each block's shard length (elements).
    ranks: usize,
    shard: Vec<u64>,
    /// Bytes of a working parameter on the host, and of a device element.
    pbytes: u64,
    dbytes: u64,
    ops: Vec<Op>,
    buffers: Vec<BufferPlan>,
    extent_groups: Vec<Extent>,
    // Stage 2: homes and fixed buffers.
    scratch: BufId,
    stats_scratch: BufId,
    /// (current, next) working-parameter homes; equal unless delayed or on NVMe.
    p_home: Vec<(BufId, BufId)>,
    /// (current, next) optimizer-state homes.
    s_home: Vec<(BufId, BufId)>,
    /// Device gradient homes, and the set the update reads.
    g_home_dev: Vec<Option<BufId>>,
    g_apply_dev: Vec<Option<BufId>>,
    /// Host gradients the backward fills, and the set the update reads.
    g_host: Vec<Option<BufId>>,
    g_apply_host: Vec<Option<BufId>>,
    /// Per block: whether its gradients are spilled to NVMe for the norm, and the
    /// extent they wait in.
    spill: Vec<bool>,
    g_spill: Vec<Option<BufId>>,
    /// Per spilled block: the host buffer its gradients' statistics wait in for the norm.
    stats_spill: Vec<Option<BufId>>,
    /// Tier of checkpoint i (the input of block i + 1).
    ckpt_tier: Vec<Tier>,
    ckpt_extent: Vec<Option<BufId>>,
    norm_flag: Option<BufId>,
    tokens_host: Vec<BufId>,
    losses_host: Vec<BufId>,
    stats_host: Vec<Option<BufId>>,
    // Stage 3: the step's buffers.
    seq: Vec<Compute>,
    /// Device parameter buffer of block b at compute k.
    dev_params: Vec<Vec<Option<BufId>>>,
    /// Fetches to emit before compute k: (block, device buffer, whether the parameters
    /// come from the block's state read, see [`Planner::state_feeds_backward`]).
    fetches: Vec<Vec<(usize, BufId, bool)>>,
    ckpts: Vec<Vec<Ckpt>>,
    /// Per block: whether it keeps its saved activations, and their bytes.
    kept: Vec<bool>,
    saved_bytes: Vec<u64>,
    /// Saved activations per micro-batch, per block (kept blocks only).
    saved: Vec<Vec<Option<BufId>>>,
    /// Checkpoint fetches before compute k: (boundary, micro-batch).
    ckpt_fetch: Vec<Vec<(usize, usize)>>,
    /// Activation gradients per micro-batch, per boundary.
    dact: Vec<Vec<BufId>>,
    /// Device tokens per micro-batch, and the compute before which they are copied.
    tokens_dev: Vec<BufId>,
    token_fetch: Vec<Vec<usize>>,
    losses_dev: Vec<BufId>,
    /// Device gradients per micro-batch, per block.
    g_dev: Vec<Vec<BufId>>,
    state_reads: Vec<Vec<usize>>,
    s_stage: Vec<Option<BufId>>,
    p_out_stage: Vec<Option<BufId>>,
    stats_dev: Vec<Option<BufId>>,
}

impl Plan {
    /// Plans one training step of `input.model` under `policy`. Allocates nothing.
    /// Does not check the budgets: see [`Plan::check_fits`].
    ///
    /// Which layer blocks keep their saved activations follows
    /// [`StepShape::recompute`]: none ([`Recompute::All`]), all ([`Recompute::None`]),
    /// or ([`Recompute::Auto`]) all when the device peak then fits its budget, else the
    /// most that fit, in [`Plan::keep_order`]: the device peak grows with every block
    /// kept, so the count is found by bisection between keeping none and keeping all.
    /// When even keeping none is over the device budget, the plan keeps none (and
    /// [`Plan::check_fits`] refuses it, as a plan that recomputes everything).
    ///
    /// Then gradients spill to NVMe as [`StepShape::grad_spill`] says: with
    /// [`GradSpill::Auto`], when the plan is over the host budget and some block can
    /// spill ([`Plan::can_spill`]), the same plan is made again with every such block
    /// spilled, and kept if its host peak is lower.
    ///
    /// First of all, when the policy allows it ([`Policy::resident_edges`]), the plan
    /// keeping the first and last blocks' optimizer state in host memory and their
    /// parameters off NVMe: it is the plan if it fits every budget without spilling
    /// gradients. Of such plans, the first of these that recomputes no more blocks than
    /// the others: on the CPU device, parameters on the device (updated in place); on
    /// the host, with the first block's device copy serving the whole micro-batch (one
    /// fetch of the embedding where a tied head reads it too, not two); on the host,
    /// fetched for each use.
    pub fn build(input: &PlanInput<'_>, policy: &dyn Policy) -> Result<Plan, PlanError> {
        if policy.resident_edges(input) {
            // In order of preference: on the CPU device the edges' parameters on the
            // device (its optimizer writes them in place: no copy at all), then on the
            // host with one device copy of the embedding per micro-batch, then with one
            // per use. The first that fits and recomputes no more blocks than the others.
            let mut candidates = Vec::new();
            if input.shape.target == crate::model::Target::Cpu {
                candidates.push((Tier::Device, false));
            }
            candidates.extend([(Tier::Host, true), (Tier::Host, false)]);
            let plans: Vec<Plan> = candidates
                .into_iter()
                .filter_map(|(params, keep_first)| {
                    let edges = super::EdgesOnHost {
                        policy,
                        params,
                        keep_first,
                    };
                    Self::build_spilling(input, &edges)
                        .ok()
                        .filter(|plan| plan.first_overflow().is_none() && plan.spilled() == 0)
                })
                .collect();
            let fewest = plans.iter().map(Plan::recomputed).min();
            if let Some(plan) = plans
                .into_iter()
                .find(|plan| Some(plan.recomputed()) == fewest)
            {
                return Ok(plan);
            }
        }
        Self::build_spilling(input, policy)
    }

    /// Whether the first and last blocks' optimizer state is in host memory and their
    /// parameters off NVMe while some other block's state is on NVMe
    /// ([`Policy::resident_edges`]).
    pub fn edges_on_host(&self) -> bool {
        let nb = self.homes.len();
        let off = |b: usize| self.homes[b][0] != Tier::Nvme && self.homes[b][2] == Tier::Host;
        off(0) && off(nb - 1) && self.homes.iter().any(|h| h[2] == Tier::Nvme)
    }

    /// What [`Plan::edges_on_host`] means for this plan, in words (none when it is not).
    pub fn edges_text(&self) -> Option<String> {
        self.edges_on_host().then(|| {
            let params = if self.homes[0][0] == Tier::Device {
                "their parameters on the device"
            } else {
                "their parameters too"
            };
            format!(
                "the embedding's and the head's optimizer state stay in host memory, \
                 {params} (their NVMe traffic could not hide under compute)"
            )
        })
    }

    /// [`Plan::build`] for `policy`'s homes as they are: recomputing and spilling as the
    /// step asks.
    fn build_spilling(input: &PlanInput<'_>, policy: &dyn Policy) -> Result<Plan, PlanError> {
        let always = input.shape.grad_spill == GradSpill::Always;
        let plan = Self::build_recomputing(input, policy, always)?;
        if input.shape.grad_spill != GradSpill::Auto
            || plan.peak[Tier::Host.index()] <= input.budgets.host
            || !(0..plan.homes.len()).any(|b| plan.can_spill(b))
        {
            return Ok(plan);
        }
        let spilled = Self::build_keeping(input, policy, plan.kept.clone(), true)?;
        Ok(
            if spilled.peak[Tier::Host.index()] < plan.peak[Tier::Host.index()] {
                spilled
            } else {
                plan
            },
        )
    }

    /// Whether block `b`'s gradients can wait for the norm on NVMe ([`GradSpill`]): its
    /// optimizer state is there, and the step has the norm barrier, one rank and no
    /// delayed update.
    pub fn can_spill(&self, b: usize) -> bool {
        can_spill(&self.shape, self.homes[b][2])
    }

    /// Blocks whose gradients wait for the norm on NVMe.
    pub fn spilled(&self) -> usize {
        self.grads_spilled.iter().filter(|&&s| s).count()
    }

    /// [`Plan::build`]'s choice of the blocks that keep their activations, with
    /// gradients spilled (where they can be) or not.
    fn build_recomputing(
        input: &PlanInput<'_>,
        policy: &dyn Policy,
        spill: bool,
    ) -> Result<Plan, PlanError> {
        let order = Self::keep_order(input);
        let keeping = |count: usize| {
            let mut kept = vec![false; input.block_count()];
            for &b in &order[..count] {
                kept[b] = true;
            }
            Self::build_keeping(input, policy, kept, spill)
        };
        match input.shape.recompute {
            Recompute::All => keeping(0),
            Recompute::None => keeping(order.len()),
            Recompute::Auto => {
                let device_fits =
                    |plan: &Plan| plan.peak[Tier::Device.index()] <= input.budgets.device;
                let all = keeping(order.len())?;
                if device_fits(&all) || order.is_empty() {
                    return Ok(all);
                }
                // Invariant: keeping `fits` blocks fits the device, keeping `over` does not.
                let mut best = keeping(0)?;
                if !device_fits(&best) {
                    return Ok(best);
                }
                let (mut fits, mut over) = (0, order.len());
                while over - fits > 1 {
                    let mid = (fits + over) / 2;
                    let plan = keeping(mid)?;
                    if device_fits(&plan) {
                        (fits, best) = (mid, plan);
                    } else {
                        over = mid;
                    }
                }
                Ok(best)
            }
        }
    }

    /// The layer blocks in the order [`Recompute::Auto`] keeps them, by the cost model's
    /// trade: keeping a block saves recomputing its forward (its backward's FLOPs less
    /// its saved backward's) and costs its saved activations' bytes on the device, so
    /// blocks that save the most FLOPs per byte come first; among equals (every layer of
    /// a family is the same), the later block first, whose saved activations live the
    /// shortest (from its forward to its backward, around the head).
    pub fn keep_order(input: &PlanInput<'_>) -> Vec<usize> {
        let model = input.model;
        let Ok(dims) = model.shape(input.shape.batch, input.shape.seq) else {
            return Vec::new();
        };
        let (target, dtype) = (input.shape.target, input.shape.device_dtype());
        let mut order: Vec<(usize, f64)> = (0..input.block_count())
            .filter_map(|b| {
                let bytes = model.saved_bytes(b, dims, target, dtype);
                (bytes > 0).then(|| (b, model.recompute_flops(b, dims) / bytes as f64))
            })
            .collect();
        order.sort_by(|(a, fa), (b, fb)| fb.total_cmp(fa).then(b.cmp(a)));
        order.into_iter().map(|(b, _)| b).collect()
    }

    /// Plans one step in which the layer blocks marked in `kept` keep their saved
    /// activations and the others recompute.
    fn build_keeping(
        input: &PlanInput<'_>,
        policy: &dyn Policy,
        kept: Vec<bool>,
        spill: bool,
    ) -> Result<Plan, PlanError> {
        let mut p = Planner::new(input, policy)?;
        p.kept = kept;
        if spill {
            p.spill = (0..p.nb())
                .map(|b| can_spill(&p.shape, p.homes[b].state))
                .collect();
        }
        p.home_buffers();
        p.step_buffers();
        p.emit();
        p.finish()
    }

    /// Layer blocks that recompute their forward in the backward.
    pub fn recomputed(&self) -> usize {
        (1..self.kept.len().saturating_sub(1))
            .filter(|&b| !self.kept[b])
            .count()
    }

    /// Bytes of saved activations the plan keeps on the device at once: every kept
    /// block's, of one micro-batch.
    pub fn saved_total_bytes(&self) -> u64 {
        self.saved_bytes.iter().sum()
    }

    /// "3 of 12 blocks": how many layer blocks recompute their forward, of how many.
    pub fn recomputed_of(&self) -> String {
        format!(
            "{} of {} blocks",
            self.recomputed(),
            self.kept.len().saturating_sub(2)
        )
    }

    /// "recompute: 3 of 12 blocks" (see [`Plan::recomputed_of`]).
    pub fn recompute_summary(&self) -> String {
        format!("recompute: {}", self.recomputed_of())
    }
}

impl<'a> Planner<'a> {
    /// Stage 1: the step's shape and every block's homes, checked.
    fn new(input: &'a PlanInput<'a>, policy: &'a dyn Policy) -> Result<Self, PlanError> {
        let name = policy.name();
        let mut shape = input.shape;
        // With ranks the norm is always the global one, computed with every rank's
        // shards (the reports' norm is the step's, not a shard's).
        if shape.ranks > 1 {
            shape.needs_global_norm = true;
        }
        if shape.batch == 0 || shape.seq == 0 || shape.grad_accum == 0 {
            return Err(PlanError::Invalid(
                "batch, sequence length and gradient accumulation must be at least 1".into(),
            ));
        }
        let dims = input
            .model
            .shape(shape.batch, shape.seq)
            .map_err(|e| PlanError::Invalid(e.to_string()))?;
        let blocks = input.model.blocks();
        let nb = blocks.len();
        let bad = |reason: String| PlanError::BadPolicy {
            policy: name.clone(),
            reason,
        };
        let mut homes = Vec::with_capacity(nb);
        for b in 0..nb {
            let h = Homes {
                params: policy.home(input, b, TensorClass::Params),
                grads: policy.home(input, b, TensorClass::Grads),
                state: policy.home(input, b, TensorClass::Optimizer),
                ckpt: policy.home(input, b, TensorClass::Checkpoints),
            };
            if h.grads == Tier::Nvme {
                return Err(bad(format!("block {b}: gradients cannot live on NVMe")));
            }
            if (h.state == Tier::Device) != (h.grads == Tier::Device) {
                return Err(bad(format!(
                    "block {b}: gradients must live with the optimizer state's tier when that \
                     is the device, and on the host otherwise (got gradients on {}, state on {})",
                    h.grads, h.state
                )));
            }
            if h.state == Tier::Device && h.params != Tier::Device {
                return Err(bad(format!(
                    "block {b}: optimizer state on the device needs the parameters there too"
                )));
            }
            homes.push(h);
        }
        if shape.ranks == 0 {
            return Err(PlanError::Invalid("ranks must be at least 1".into()));
        }
        Ok(Planner {
            input,
            policy,
            name,
            shape,
            dims,
            depth: policy.prefetch_depth(input).max(1),
            blocks,
            homes,
            head: nb - 1,
            layers: nb - 2,
            ranks: shape.ranks,
            shard: blocks
                .iter()
                .map(|b| super::shard_len(b.len, shape.ranks) as u64)
                .collect(),
            pbytes: shape.precision.param_bytes(),
            dbytes: shape.device_dtype().size() as u64,
            ops: Vec::new(),
            buffers: Vec::new(),
            extent_groups: Vec::new(),
            scratch: BufId(0),
            stats_scratch: BufId(0),
            p_home: Vec::new(),
            s_home: Vec::new(),
            g_home_dev: vec![None; nb],
            g_apply_dev: vec![None; nb],
            g_host: vec![None; nb],
            g_apply_host: vec![None; nb],
            spill: vec![false; nb],
            g_spill: vec![None; nb],
            stats_spill: vec![None; nb],
            ckpt_tier: Vec::new(),
            ckpt_extent: Vec::new(),
            norm_flag: None,
            tokens_host: Vec::new(),
            losses_host: Vec::new(),
            stats_host: vec![None; nb],
            seq: Vec::new(),
            dev_params: Vec::new(),
            fetches: Vec::new(),
            ckpts: Vec::new(),
            kept: vec![false; nb],
            saved_bytes: vec![0; nb],
            saved: Vec::new(),
            ckpt_fetch: Vec::new(),
            dact: Vec::new(),
            tokens_dev: Vec::new(),
            token_fetch: Vec::new(),
            losses_dev: Vec::new(),
            g_dev: Vec::new(),
            state_reads: Vec::new(),
            s_stage: vec![None; nb],
            p_out_stage: vec![None; nb],
            stats_dev: vec![None; nb],
        })
    }

    fn nb(&self) -> usize {
        self.blocks.len()
    }

    fn len(&self, b: usize) -> u64 {
        self.blocks[b].len as u64
    }

    /// Elements of this rank's shard of block `b` (its length with one rank).
    fn shard(&self, b: usize) -> u64 {
        self.shard[b]
    }

    /// Bytes of one activation (B, T, width) on the device.
    fn act_bytes(&self) -> u64 {
        (self.dims.rows() * self.input.model.width()) as u64 * self.dbytes
    }

    fn buffer(&mut self, name: String, tier: Tier, bytes: u64) -> BufId {
        let kind = match tier {
            Tier::Device => BufKind::Device,
            Tier::Host => BufKind::Host,
            Tier::Nvme => unreachable!("NVMe data lives in extents"),
        };
        let bytes = if tier == Tier::Host {
            host_bytes(bytes)
        } else {
            bytes
        };
        self.buffers.push(BufferPlan {
            name,
            tier,
            kind,
            bytes,
            persistent: false,
            slot: None,
            live: None,
        });
        BufId::of(self.buffers.len() - 1)
    }

    fn persistent(&mut self, name: String, tier: Tier, bytes: u64) -> BufId {
        let id = self.buffer(name, tier, bytes);
        self.buffers[id.index()].persistent = true;
        id
    }

    /// A home on `tier` (device or host), with a second one for the next step's copy
    /// when `pair`.
    fn home_pair(&mut self, name: &str, tier: Tier, bytes: u64, pair: bool) -> (BufId, BufId) {
        let cur = self.persistent(format!("{name}@{tier}"), tier, bytes);
        let next = if pair {
            self.persistent(format!("{name}@{tier}'"), tier, bytes)
        } else {
            cur
        };
        (cur, next)
    }

    /// An extent group: one buffer per side.
    fn extents(
        &mut self,
        name: String,
        bytes: u64,
        kind: ExtentKind,
        block: usize,
        class: TensorClass,
    ) -> (BufId, BufId) {
        self.extent_groups.push(Extent {
            name: name.clone(),
            bytes,
            kind,
            block,
            class,
        });
        let group = self.extent_groups.len() - 1;
        let mut side = |side, label: &str| {
            self.buffers.push(BufferPlan {
                name: format!("{name}{label}@nvme"),
                tier: Tier::Nvme,
                kind: BufKind::Extent { group, side },
                bytes: 0,
                persistent: true,
                slot: None,
                live: None,
            });
            BufId::of(self.buffers.len() - 1)
        };
        if kind == ExtentKind::Single {
            let id = side(ExtentSide::Single, "");
            (id, id)
        } else {
            (
                side(ExtentSide::Current, ".cur"),
                side(ExtentSide::Next, ".next"),
            )
        }
    }

    /// Stage 2a: homes of parameters, optimizer state and gradients, the checkpoint
    /// tiers and extents, and the fixed buffers (scratch, tokens, losses, the norm flag).
    fn home_buffers(&mut self) {
        let nb = self.nb();
        let model = self.input.model;
        let target = self.shape.target;
        let scratch = model.scratch_bytes(self.dims, target, self.shape.device_dtype());
        self.scratch = self.persistent("scratch@device".into(), Tier::Device, scratch as u64);
        // The update stream's own, so that statistics do not wait for the compute stream.
        let stats = update::grad_stats_scratch(self.blocks, target).max(8);
        self.stats_scratch =
            self.persistent("stats-scratch@device".into(), Tier::Device, stats as u64);
        let delayed = self.shape.delayed_update;
        for b in 0..nb {
            let (len, shard) = (self.len(b), self.shard(b));
            let (params, state, grads) = {
                let h = &self.homes[b];
                (h.params, h.state, h.grads)
            };
            let s = match state {
                Tier::Device | Tier::Host => {
                    self.home_pair(&format!("adam[{b}]"), state, 12 * shard, false)
                }
                Tier::Nvme => self.extents(
                    format!("adam.{b}"),
                    12 * shard,
                    ExtentKind::Shadow,
                    b,
                    TensorClass::Optimizer,
                ),
            };
            self.s_home.push(s);
            let p = if self.shares_master(b) {
                // fp32 on NVMe: the master copy at the head of the state is the working one.
                s
            } else {
                match params {
                    // Every rank's shard is gathered into it over device memory: room
                    // for their padding too.
                    Tier::Device => self.home_pair(
                        &format!("params[{b}]"),
                        Tier::Device,
                        if self.device_comm(b) {
                            self.ranks as u64 * shard
                        } else {
                            len
                        } * self.dbytes,
                        delayed,
                    ),
                    Tier::Host => self.home_pair(
                        &format!("params[{b}]"),
                        Tier::Host,
                        shard * self.pbytes,
                        delayed,
                    ),
                    Tier::Nvme => self.extents(
                        format!("params.{b}"),
                        shard * self.pbytes,
                        if delayed {
                            ExtentKind::Pair
                        } else {
                            ExtentKind::Shadow
                        },
                        b,
                        TensorClass::Params,
                    ),
                }
            };
            self.p_home.push(p);
            match grads {
                Tier::Device if self.ranks > 1 => {
                    // This rank's shard of the step's gradients on the device (reduced
                    // there, or on the host and copied in), and a host copy the norm
                    // reads.
                    let (fill, apply) =
                        self.home_pair(&format!("grads[{b}]"), Tier::Device, 4 * shard, delayed);
                    self.g_home_dev[b] = Some(fill);
                    self.g_apply_dev[b] = Some(apply);
                    self.host_grads(b);
                }
                Tier::Device => {
                    let (fill, apply) =
                        self.home_pair(&format!("grads[{b}]"), Tier::Device, 4 * len, delayed);
                    self.g_home_dev[b] = Some(fill);
                    self.g_apply_dev[b] = Some(apply);
                    self.stats_dev[b] =
                        Some(self.buffer(format!("stats[{b}]@device"), Tier::Device, 16));
                    self.stats_host[b] =
                        Some(self.persistent(format!("stats[{b}]@host"), Tier::Host, 16));
                }
                Tier::Host => self.host_grads(b),
                Tier::Nvme => unreachable!("refused in stage 1"),
            }
        }
        // Checkpoint i is the input of block i + 1; the head's input stays on the device
        // (its forward and backward are one operation).
        let layers = self.layers;
        self.ckpt_tier = (0..=layers)
            .map(|i| {
                if i == layers {
                    Tier::Device
                } else {
                    self.homes[i + 1].ckpt
                }
            })
            .collect();
        let act = self.act_bytes();
        self.ckpt_extent = (0..=layers)
            .map(|i| {
                (self.ckpt_tier[i] == Tier::Nvme).then(|| {
                    self.extents(
                        format!("ckpt.{i}"),
                        act,
                        ExtentKind::Single,
                        i + 1,
                        TensorClass::Checkpoints,
                    )
                    .0
                })
            })
            .collect();
        if self.shape.needs_global_norm {
            self.buffers.push(BufferPlan {
                name: "global-norm".into(),
                tier: Tier::Host,
                kind: BufKind::Flag,
                bytes: 0,
                persistent: true,
                slot: None,
                live: None,
            });
            self.norm_flag = Some(BufId::of(self.buffers.len() - 1));
        }
        let rows = self.dims.rows() as u64;
        for m in 0..self.shape.grad_accum {
            let tokens = self.persistent(format!("tokens#{m}@host"), Tier::Host, 8 * rows);
            let losses = self.persistent(format!("losses#{m}@host"), Tier::Host, 4 * rows);
            self.tokens_host.push(tokens);
            self.losses_host.push(losses);
        }
    }

    /// Stage 2b: the compute sequence, and the step's transient buffers: device
    /// parameter copies per use group with their fetch positions, checkpoints, activation
    /// gradients, tokens and losses, gradients per micro-batch, optimizer-state staging.
    fn step_buffers(&mut self) {
        let (nb, layers) = (self.nb(), self.layers);
        let micros = self.shape.grad_accum;
        for m in 0..micros {
            self.seq.push(Compute::Embed(m));
            for b in 1..=layers {
                self.seq.push(Compute::Layer(b, m));
            }
            self.seq.push(Compute::Head(m));
            for b in (1..=layers).rev() {
                self.seq.push(Compute::LayerBack(b, m));
            }
            self.seq.push(Compute::EmbedBack(m));
        }
        let n = self.seq.len();
        self.dev_params = vec![vec![None; nb]; n];
        self.fetches = vec![Vec::new(); n];
        self.ckpt_fetch = vec![Vec::new(); n];
        self.token_fetch = vec![Vec::new(); n];
        self.state_reads = vec![Vec::new(); n];
        self.param_groups();
        self.checkpoints();
        let (model, target, dtype) = (
            self.input.model,
            self.shape.target,
            self.shape.device_dtype(),
        );
        self.saved_bytes = (0..nb)
            .map(|b| {
                if self.kept[b] {
                    model.saved_bytes(b, self.dims, target, dtype) as u64
                } else {
                    0
                }
            })
            .collect();
        for m in 0..micros {
            let saved = (0..nb)
                .map(|b| {
                    let bytes = self.saved_bytes[b];
                    self.kept[b]
                        .then(|| self.buffer(format!("saved[{b}]#{m}@device"), Tier::Device, bytes))
                })
                .collect();
            self.saved.push(saved);
        }
        let act = self.act_bytes();
        let rows = self.dims.rows() as u64;
        for m in 0..micros {
            let dact: Vec<BufId> = (0..=layers)
                .map(|i| self.buffer(format!("dact[{i}]#{m}@device"), Tier::Device, act))
                .collect();
            self.dact.push(dact);
            let tokens = self.buffer(format!("tokens#{m}@device"), Tier::Device, 8 * rows);
            self.tokens_dev.push(tokens);
            let embed = self.position(Compute::Embed(m));
            self.token_fetch[embed.saturating_sub(self.depth)].push(m);
            let losses = self.buffer(format!("losses#{m}@device"), Tier::Device, 4 * rows);
            self.losses_dev.push(losses);
            // Gradients: a device buffer per micro-batch (or the device home).
            let grads: Vec<BufId> = (0..nb)
                .map(|b| match self.g_home_dev[b] {
                    Some(id) if m == 0 && self.ranks == 1 => id,
                    None if self.homes[b].grads == Tier::Host && self.grads_stay_on_device(b) => {
                        self.g_host[b].expect("gradients the update reads on the device")
                    }
                    // Reduce-scattered over device memory: a chunk for every rank.
                    _ => self.buffer(
                        format!("grads[{b}]#{m}@device"),
                        Tier::Device,
                        4 * if self.device_comm(b) {
                            self.ranks as u64 * self.shard(b)
                        } else {
                            self.len(b)
                        },
                    ),
                })
                .collect();
            self.g_dev.push(grads);
        }
        // Optimizer state reads (NVMe homes), emitted `depth` computes before the
        // backward that completes the block's gradients.
        for b in 0..nb {
            let len = self.shard(b);
            if self.homes[b].state == Tier::Nvme {
                // With a global-norm barrier the reads are emitted with the updates, after
                // the norm, so that only `depth` blocks are staged at once.
                if self.norm_flag.is_none() && !self.shape.delayed_update {
                    let at = self.completes(b).saturating_sub(self.depth);
                    self.state_reads[at].push(b);
                }
                self.s_stage[b] =
                    Some(self.buffer(format!("adam[{b}]@host"), Tier::Host, 12 * len));
            }
            // With ranks and collectives staged through the host, a device update's new
            // parameters (a shard) are gathered there.
            if ((self.homes[b].params == Tier::Nvme && !self.shares_master(b))
                || (self.homes[b].params == Tier::Device
                    && (self.homes[b].state != Tier::Device
                        || (self.ranks > 1 && !self.shape.device_collectives))))
                && !self.update_writes_device(b)
            {
                self.p_out_stage[b] =
                    Some(self.buffer(format!("params[{b}]>@host"), Tier::Host, len * self.pbytes));
            }
        }
    }

    /// The position of `c` in the compute sequence.
    fn position(&self, c: Compute) -> usize {
        self.seq
            .iter()
            .position(|&x| x == c)
            .expect("in the sequence")
    }

    /// The compute that completes block `b`'s gradients (its last micro-batch's
    /// backward).
    fn completes(&self, b: usize) -> usize {
        let last = self.shape.grad_accum - 1;
        self.position(if b == self.head {
            Compute::Head(last)
        } else if b == 0 {
            Compute::EmbedBack(last)
        } else {
            Compute::LayerBack(b, last)
        })
    }

    /// Blocks whose parameters compute `c` reads: its own, and the tied one's.
    fn param_blocks(&self, c: Compute) -> Vec<usize> {
        let own = match c {
            Compute::Embed(_) => Some(0),
            Compute::Layer(b, _) | Compute::LayerBack(b, _) => Some(b),
            Compute::Head(_) => Some(self.head),
            // The embedding's backward reads no parameters.
            Compute::EmbedBack(_) => None,
        };
        own.into_iter()
            .chain(own.and_then(|b| self.input.model.tied(b)))
            .collect()
    }

    /// Device parameter buffers per use group: consecutive uses of a streamed block
    /// share one fetch; with [`Release::AfterBackward`] one fetch serves a micro-batch.
    fn param_groups(&mut self) {
        for b in 0..self.nb() {
            let uses: Vec<usize> = (0..self.seq.len())
                .filter(|&k| self.param_blocks(self.seq[k]).contains(&b))
                .collect();
            if self.homes[b].params == Tier::Device {
                for &k in &uses {
                    self.dev_params[k][b] = Some(self.p_home[b].0);
                }
                continue;
            }
            let keep = self.policy.release(self.input, b) == Release::AfterBackward;
            let mut group: Vec<usize> = Vec::new();
            for &k in &uses {
                let joins = group.last().is_some_and(|&prev| {
                    k == prev + 1 || (keep && self.seq[prev].micro() == self.seq[k].micro())
                });
                if !joins {
                    self.param_group(b, &mut group);
                }
                group.push(k);
            }
            self.param_group(b, &mut group);
        }
    }

    fn param_group(&mut self, b: usize, group: &mut Vec<usize>) {
        if group.is_empty() {
            return;
        }
        // The state read for the update is emitted at this same position (`completes`
        // less the depth), before the fetch.
        let from_state = group[0] == self.completes(b) && self.state_feeds_backward(b);
        let bytes = self.len(b) * self.dbytes;
        let id = self.buffer(
            format!("params[{b}]@device"),
            Tier::Device,
            if self.reads_into_device(b, from_state) {
                // The read moves whole 4 KiB blocks (O_DIRECT).
                bytes.next_multiple_of(4096)
            } else {
                bytes
            },
        );
        for &k in group.iter() {
            self.dev_params[k][b] = Some(id);
        }
        self.fetches[group[0].saturating_sub(self.depth)].push((b, id, from_state));
        group.clear();
    }

    /// Checkpoint buffers per micro-batch, and their fetches for the backward.
    fn checkpoints(&mut self) {
        let act = self.act_bytes();
        for m in 0..self.shape.grad_accum {
            let mut row = Vec::new();
            for i in 0..=self.layers {
                let fwd = self.buffer(format!("ckpt[{i}]#{m}@device"), Tier::Device, act);
                row.push(match self.ckpt_tier[i] {
                    Tier::Device => Ckpt {
                        fwd,
                        bwd: fwd,
                        host: None,
                    },
                    _ => Ckpt {
                        fwd,
                        bwd: self.buffer(format!("ckpt[{i}]#{m}<@device"), Tier::Device, act),
                        host: Some(self.buffer(format!("ckpt[{i}]#{m}@host"), Tier::Host, act)),
                    },
                });
            }
            self.ckpts.push(row);
        }
        // Fetched `depth` computes ahead of the backward, not before the forward that
        // produces them.
        for k in 0..self.seq.len() {
            if let Compute::LayerBack(b, m) = self.seq[k] {
                let i = b - 1;
                if self.ckpt_tier[i] != Tier::Device {
                    let producer = if i == 0 {
                        Compute::Embed(m)
                    } else {
                        Compute::Layer(i, m)
                    };
                    let made = self.position(producer);
                    self.ckpt_fetch[k.saturating_sub(self.depth).max(made + 1)].push((i, m));
                }
            }
        }
    }

    fn op(&mut self, lane: Lane, kind: OpKind, access: Vec<Access>) -> OpId {
        self.ops.push(Op {
            kind,
            lane,
            deps: Vec::new(),
            access,
            bytes: 0,
            flops: 0.0,
            params: 0,
            update: false,
        });
        OpId::of(self.ops.len() - 1)
    }

    /// A copy or I/O of `bytes`.
    fn transfer(&mut self, lane: Lane, kind: OpKind, access: Vec<Access>, bytes: u64) -> OpId {
        let id = self.op(lane, kind, access);
        self.ops[id.index()].bytes = bytes;
        id
    }

    /// Marks the operations from `first` on as part of the update.
    fn mark_update(&mut self, first: usize) {
        for op in &mut self.ops[first..] {
            op.update = true;
        }
    }

    /// Stage 3: every operation, in canonical order.
    fn emit(&mut self) {
        let nb = self.nb();
        let delayed = self.shape.delayed_update;
        let last_micro = self.shape.grad_accum - 1;
        let mut pending: Vec<usize> = Vec::new();
        // A delayed update applies the last step's gradients block by block in forward
        // order, spread evenly over this step's compute sequence, which it overlaps.
        let delayed_order: Vec<usize> = if delayed {
            (0..nb).collect()
        } else {
            Vec::new()
        };
        let steps = self.seq.len();
        let updates_before = |k: usize| -> std::ops::Range<usize> {
            let n = delayed_order.len();
            let at = |i: usize| i * steps / n.max(1);
            (0..n).filter(|&i| at(i) == k).fold(n..n, |r, i| {
                if r.is_empty() {
                    i..i + 1
                } else {
                    r.start..i + 1
                }
            })
        };
        for k in 0..steps {
            if delayed {
                if k == 0 {
                    self.emit_norm();
                    for &b in delayed_order.iter().take(self.depth) {
                        self.read_state(b);
                    }
                }
                for i in updates_before(k) {
                    self.emit_update(delayed_order[i]);
                    if let Some(&next) = delayed_order.get(i + self.depth) {
                        self.read_state(next);
                    }
                }
            }
            for b in std::mem::take(&mut self.state_reads[k]) {
                self.read_state(b);
            }
            for (i, m) in std::mem::take(&mut self.ckpt_fetch[k]) {
                self.fetch_checkpoint(i, m);
            }
            for m in std::mem::take(&mut self.token_fetch[k]) {
                let (from, to) = (self.tokens_host[m], self.tokens_dev[m]);
                let bytes = 8 * self.dims.rows() as u64;
                self.copy_in(from, to, bytes, None, false);
            }
            for (b, to, from_state) in std::mem::take(&mut self.fetches[k]) {
                self.fetch_params(b, to, from_state);
            }
            let step = self.seq[k];
            self.emit_compute(k, step);
            // After the compute: checkpoint copies out, gradient copies out, updates.
            let m = step.micro();
            match step {
                Compute::Embed(_) => self.save_checkpoint(0, m),
                Compute::Layer(b, _) => self.save_checkpoint(b, m),
                _ => {}
            }
            let finished = match step {
                Compute::Head(_) => Some(self.head),
                Compute::LayerBack(b, _) => Some(b),
                Compute::EmbedBack(_) => Some(0),
                _ => None,
            };
            // The head also completes (its part of) the tied block's gradients, but the
            // tied block finishes with its own backward.
            if let Some(b) = finished {
                self.gradients_out(b, m);
                if m == last_micro {
                    self.spill_gradients(b);
                    if delayed {
                        // Applied during the next step.
                    } else if self.norm_flag.is_some() {
                        pending.push(b);
                    } else {
                        self.emit_update(b);
                    }
                }
            }
        }
        if !delayed {
            self.emit_norm();
        }
        for &b in pending.iter().take(self.depth) {
            self.read_state(b);
        }
        for (i, &b) in pending.iter().enumerate() {
            self.emit_update(b);
            if let Some(&next) = pending.get(i + self.depth) {
                self.read_state(next);
            }
        }
    }

    /// A host-to-device copy of `bytes` from `from` into `to`.
    fn copy_in(
        &mut self,
        from: BufId,
        to: BufId,
        bytes: u64,
        convert: Option<(Dtype, Dtype)>,
        with_update: bool,
    ) {
        self.transfer(
            Lane::H2d,
            OpKind::H2d {
                from,
                to,
                bytes,
                convert,
                with_update,
            },
            vec![Access::Read(from), Access::Write(to)],
            bytes,
        );
    }

    /// A device-to-host copy of `bytes` from `from` into `to`.
    fn copy_out(&mut self, from: BufId, to: BufId, bytes: u64) {
        self.transfer(
            Lane::D2h,
            OpKind::D2h { from, to, bytes },
            vec![Access::Read(from), Access::Write(to)],
            bytes,
        );
    }

    fn nvme_read(&mut self, lane: Lane, from: BufId, into: BufId, bytes: u64) {
        self.transfer(
            lane,
            OpKind::NvmeRead { from, into },
            vec![Access::Read(from), Access::Write(into)],
            bytes,
        );
    }

    fn nvme_write(&mut self, from: BufId, to: BufId, bytes: u64, with_update: bool) {
        self.transfer(
            Lane::NvmeWrite,
            OpKind::NvmeWrite {
                from,
                to,
                with_update,
            },
            vec![Access::Read(from), Access::Write(to)],
            bytes,
        );
    }

    /// Whether block `b`'s working parameters are its fp32 master copy, read from the
    /// head of its NVMe optimizer state (see [`Plan::shares_master`]).
    fn shares_master(&self, b: usize) -> bool {
        shares_master(
            self.homes[b].params,
            self.homes[b].state,
            self.shape.precision,
            self.shape.delayed_update,
        )
    }

    /// Block `b`'s host gradients (this rank's shard): transient, or (delayed) two
    /// persistent sets, one filled by this step's backward while the update applies the
    /// other.
    fn host_grads(&mut self, b: usize) {
        let bytes = 4 * self.shard(b);
        let (fill, apply) = if self.shape.delayed_update {
            self.home_pair(&format!("grads[{b}]"), Tier::Host, bytes, true)
        } else if self.spill[b] {
            // Filled by the backward and written out; read back for the update.
            let (extent, _) = self.extents(
                format!("grads.{b}"),
                bytes,
                ExtentKind::Single,
                b,
                TensorClass::Grads,
            );
            self.g_spill[b] = Some(extent);
            self.stats_spill[b] = Some(self.buffer(format!("stats[{b}]@host"), Tier::Host, 16));
            (
                self.buffer(format!("grads[{b}]@host"), Tier::Host, bytes),
                self.buffer(format!("grads[{b}]<@host"), Tier::Host, bytes),
            )
        } else if self.grads_stay_on_device(b) {
            // The backward's own buffer, which the update reads where it is.
            let id = self.buffer(format!("grads[{b}]#0@device"), Tier::Device, bytes);
            (id, id)
        } else {
            let id = self.buffer(format!("grads[{b}]@host"), Tier::Host, bytes);
            (id, id)
        };
        self.g_host[b] = Some(fill);
        self.g_apply_host[b] = Some(apply);
    }

    /// Whether the CPU optimizer writes block `b`'s new working parameters straight into
    /// their device home, with no host staging and no copy: on the CPU device, whose
    /// memory is host memory, for a device-homed block whose state the CPU updates, when
    /// the working parameters are the bytes the device computes with (no conversion) and
    /// the whole block's (alone).
    fn update_writes_device(&self, b: usize) -> bool {
        self.shape.target == crate::model::Target::Cpu
            && self.homes[b].params == Tier::Device
            && self.homes[b].state != Tier::Device
            && self.ranks == 1
            && self.param_conversion().is_none()
    }

    /// Whether the CPU optimizer reads block `b`'s host-homed gradients from the device
    /// buffer the backward wrote them into, with no copy to the host: on the CPU device,
    /// whose memory is host memory, when that buffer holds the step's whole gradients
    /// (one micro-batch, alone) and the update follows the backward (no global-norm
    /// barrier, which would hold every block's gradients in device memory until the
    /// backward ends; no delayed update). The buffer then lives until the update. A
    /// GPU's are copied.
    fn grads_stay_on_device(&self, b: usize) -> bool {
        self.shape.target == crate::model::Target::Cpu
            && self.ranks == 1
            && self.shape.grad_accum == 1
            && !self.shape.needs_global_norm
            && !self.shape.delayed_update
            && !self.spill[b]
    }

    /// Whether block `b`'s collectives run over device memory (see [`Plan::device_comm`]).
    fn device_comm(&self, b: usize) -> bool {
        device_comm(&self.shape, self.homes[b].state)
    }

    /// How working parameters convert on their way to the device.
    fn param_conversion(&self) -> Option<(Dtype, Dtype)> {
        let (host, device) = (self.shape.precision.dtype(), self.shape.device_dtype());
        (host != device).then_some((host, device))
    }

    /// Block `b`'s working parameters from their home to the device buffer `to`, or
    /// (`from_state`) from the head of its optimizer state, staged on the host for the
    /// update by a read emitted just before. With ranks, the home holds this rank's
    /// shard: the shards are gathered on the host first.
    fn fetch_params(&mut self, b: usize, to: BufId, from_state: bool) {
        let bytes = self.len(b) * self.pbytes;
        let shard_bytes = self.shard(b) * self.pbytes;
        if self.reads_into_device(b, from_state) {
            self.nvme_read(Lane::NvmeRead, self.p_home[b].0, to, shard_bytes);
            return;
        }
        let from = match self.homes[b].params {
            _ if from_state => self.s_stage[b].expect("the state's host stage"),
            Tier::Host => self.p_home[b].0,
            Tier::Nvme => {
                let stage = self.buffer(format!("params[{b}]<@host"), Tier::Host, shard_bytes);
                self.nvme_read(Lane::NvmeRead, self.p_home[b].0, stage, shard_bytes);
                stage
            }
            Tier::Device => unreachable!("device-resident parameters are not fetched"),
        };
        let from = self.gathered(b, from, "<", false);
        self.copy_in(from, to, bytes, self.param_conversion(), false);
    }

    /// Whether block `b`'s parameters go from NVMe straight into the device buffer of a
    /// fetch (`from_state`: whether the fetch takes them from the state read instead),
    /// with no host staging and no host-to-device copy: on the CPU device, whose memory
    /// is host memory that the NVMe tier can read into, when the bytes on NVMe are the
    /// bytes the device computes with (no conversion) and this rank's shard is the whole
    /// block (alone). On a GPU, which the NVMe tier cannot reach, they are staged.
    fn reads_into_device(&self, b: usize, from_state: bool) -> bool {
        !from_state
            && self.homes[b].params == Tier::Nvme
            && self.ranks == 1
            && self.param_conversion().is_none()
            && self.shape.target == crate::model::Target::Cpu
    }

    /// Whether the backward that completes block `b`'s gradients takes its parameters
    /// from the state read for the block's update instead of reading them from NVMe
    /// again: when the fp32 master copy heads the NVMe state ([`Self::shares_master`])
    /// and that read is emitted `depth` computes before that backward, as the backward's
    /// fetch is (no global-norm barrier, no delayed update). Each such block's backward
    /// then reads 12 bytes per parameter from NVMe instead of 4 + 12.
    fn state_feeds_backward(&self, b: usize) -> bool {
        self.shares_master(b) && self.norm_flag.is_none()
    }

    /// With ranks: block `b`'s working parameters gathered from every rank's shard,
    /// `shard` being this rank's, into a new host buffer (returned). Alone: `shard`.
    fn gathered(&mut self, b: usize, shard: BufId, dir: &str, with_update: bool) -> BufId {
        if self.ranks == 1 {
            return shard;
        }
        let bytes = self.ranks as u64 * self.shard(b) * self.pbytes;
        let into = self.buffer(format!("params[{b}]*{dir}@host"), Tier::Host, bytes);
        let first = self.ops.len();
        let id = self.op(
            Lane::Comm,
            OpKind::AllGather {
                block: b,
                from: shard,
                into,
                with_update,
            },
            vec![Access::Read(shard), Access::Write(into)],
        );
        self.ops[id.index()].bytes = bytes;
        if with_update {
            self.mark_update(first);
        }
        into
    }

    /// Checkpoint `i` of micro-batch `m` back to the device for the backward.
    fn fetch_checkpoint(&mut self, i: usize, m: usize) {
        let act = self.act_bytes();
        let (host, bwd) = {
            let ck = &self.ckpts[m][i];
            (ck.host.expect("offloaded"), ck.bwd)
        };
        let from = match self.ckpt_extent[i] {
            Some(extent) => {
                let stage = self.buffer(format!("ckpt[{i}]#{m}<@host"), Tier::Host, act);
                self.nvme_read(Lane::NvmeRead, extent, stage, act);
                stage
            }
            None => host,
        };
        self.copy_in(from, bwd, act, None, false);
    }

    /// After the forward producing checkpoint `i` of micro-batch `m`: its copy out (and
    /// on to NVMe) when it does not stay on the device.
    fn save_checkpoint(&mut self, i: usize, m: usize) {
        let act = self.act_bytes();
        let (fwd, host) = {
            let ck = &self.ckpts[m][i];
            (ck.fwd, ck.host)
        };
        if let Some(host) = host {
            self.copy_out(fwd, host, act);
            if let Some(extent) = self.ckpt_extent[i] {
                self.nvme_write(host, extent, act, false);
            }
        }
    }

    /// Compute `k` of the sequence, with its buffers bound.
    fn emit_compute(&mut self, k: usize, step: Compute) {
        let (head, layers) = (self.head, self.layers);
        let m = step.micro();
        let params = |p: &Self, b: usize| p.dev_params[k][b].expect("fetched for this compute");
        let (block, pass, binds, losses_out) = match step {
            Compute::Embed(_) => (
                0,
                Pass::Forward,
                Binds {
                    params: Some(params(self, 0)),
                    output: Some(self.ckpts[m][0].fwd),
                    tokens: Some(self.tokens_dev[m]),
                    ..Binds::default()
                },
                false,
            ),
            Compute::Layer(b, _) => (
                b,
                if self.kept[b] {
                    Pass::ForwardSave
                } else {
                    Pass::Forward
                },
                Binds {
                    params: Some(params(self, b)),
                    input: Some(self.ckpts[m][b - 1].fwd),
                    output: Some(self.ckpts[m][b].fwd),
                    saved: self.saved[m][b],
                    ..Binds::default()
                },
                false,
            ),
            Compute::Head(_) => {
                let tied = self.input.model.tied(head);
                (
                    head,
                    Pass::Backward,
                    Binds {
                        params: Some(params(self, head)),
                        grads: Some(self.g_dev[m][head]),
                        tied_params: tied.map(|t| params(self, t)),
                        tied_grads: tied.map(|t| self.g_dev[m][t]),
                        input: Some(self.ckpts[m][layers].fwd),
                        d_input: Some(self.dact[m][layers]),
                        tokens: Some(self.tokens_dev[m]),
                        losses: Some(self.losses_dev[m]),
                        ..Binds::default()
                    },
                    true,
                )
            }
            Compute::LayerBack(b, _) => (
                b,
                if self.kept[b] {
                    Pass::BackwardSaved
                } else {
                    Pass::Backward
                },
                Binds {
                    params: Some(params(self, b)),
                    grads: Some(self.g_dev[m][b]),
                    input: Some(self.ckpts[m][b - 1].bwd),
                    d_output: Some(self.dact[m][b]),
                    d_input: Some(self.dact[m][b - 1]),
                    saved: self.saved[m][b],
                    ..Binds::default()
                },
                false,
            ),
            Compute::EmbedBack(_) => (
                0,
                Pass::Backward,
                Binds {
                    grads: Some(self.g_dev[m][0]),
                    d_output: Some(self.dact[m][0]),
                    tokens: Some(self.tokens_dev[m]),
                    ..Binds::default()
                },
                false,
            ),
        };
        // The saved forward writes the saved activations; the saved backward reads them.
        let (saved_read, saved_written) = if pass.is_forward() {
            (None, binds.saved)
        } else {
            (binds.saved, None)
        };
        let mut access: Vec<Access> = Vec::new();
        for r in [
            binds.params,
            binds.tied_params,
            binds.input,
            binds.d_output,
            binds.tokens,
            saved_read,
        ]
        .into_iter()
        .flatten()
        {
            access.push(Access::Read(r));
        }
        for w in [
            binds.grads,
            binds.tied_grads,
            binds.output,
            binds.d_input,
            binds.losses,
            saved_written,
        ]
        .into_iter()
        .flatten()
        {
            access.push(Access::Write(w));
        }
        access.push(Access::Write(self.scratch));
        let id = self.op(
            Lane::Compute,
            OpKind::Compute {
                block,
                micro: m,
                pass,
                binds,
            },
            access,
        );
        self.ops[id.index()].flops = self.input.model.flops(block, pass, self.dims);
        if losses_out {
            let rows = self.dims.rows() as u64;
            self.copy_out(self.losses_dev[m], self.losses_host[m], 4 * rows);
        }
    }

    /// After micro-batch `m`'s backward finished block `b`'s gradients: accumulation on
    /// the device, or the copy to the host (added to the host gradients after the first
    /// micro-batch).
    fn gradients_out(&mut self, b: usize, m: usize) {
        let bytes = 4 * self.len(b);
        if let (Some(home), true) = (self.g_home_dev[b], m > 0 && self.ranks == 1) {
            let from = self.g_dev[m][b];
            let id = self.op(
                Lane::Compute,
                OpKind::Accumulate {
                    block: b,
                    from,
                    to: home,
                },
                vec![Access::Read(from), Access::Write(home)],
            );
            self.ops[id.index()].flops = self.len(b) as f64;
        }
        if self.device_comm(b) {
            // Over device memory into the shard's device gradients, then (after the last
            // micro-batch) a host copy for the norm.
            let from = self.g_dev[m][b];
            let into = self.g_home_dev[b].expect("device gradients");
            let full = 4 * self.ranks as u64 * self.shard(b);
            let scratch = (self.shape.target == crate::model::Target::Cuda)
                .then(|| self.buffer(format!("grads[{b}]#{m}<@device"), Tier::Device, full));
            self.reduce_scatter(b, m, from, into, scratch);
            if m + 1 == self.shape.grad_accum {
                let host = self.g_host[b].expect("a host copy of the gradients");
                self.copy_out(into, host, 4 * self.shard(b));
            }
        } else if let (Some(host), true) = (self.g_host[b], self.ranks > 1) {
            // Every micro-batch's gradients go to every rank, a shard to each, and are
            // added there in rank order: the order of one process's micro-batches.
            let from = self.g_dev[m][b];
            let full = 4 * self.ranks as u64 * self.shard(b);
            let stage = self.buffer(format!("grads[{b}]#{m}>@host"), Tier::Host, full);
            self.copy_out(from, stage, bytes);
            self.reduce_scatter(b, m, stage, host, None);
            if let (Some(dev), true) = (self.g_home_dev[b], m + 1 == self.shape.grad_accum) {
                // The step's sum of this rank's shard, to the device for its AdamW.
                self.copy_in(host, dev, 4 * self.shard(b), None, false);
            }
        } else if let Some(host) = self.g_host[b] {
            let from = self.g_dev[m][b];
            // Spilled: the earlier micro-batches' sum waits on NVMe, read back to add this
            // one's, and written out again until the last (see `spill_gradients`).
            let spill = self.g_spill[b];
            let last = m + 1 == self.shape.grad_accum;
            let host = match spill {
                Some(_) if !last => self.buffer(format!("grads[{b}]#{m}@host"), Tier::Host, bytes),
                _ => host,
            };
            if m == 0 {
                if from != host {
                    self.copy_out(from, host, bytes);
                }
            } else {
                if let Some(extent) = spill {
                    self.nvme_read(Lane::NvmeRead, extent, host, bytes);
                }
                let stage = self.buffer(format!("grads[{b}]#{m}>@host"), Tier::Host, bytes);
                self.copy_out(from, stage, bytes);
                let id = self.op(
                    Lane::Cpu,
                    OpKind::HostAccumulate {
                        block: b,
                        from: stage,
                        to: host,
                    },
                    vec![Access::Read(stage), Access::Write(host)],
                );
                // Reads both, writes one.
                self.ops[id.index()].bytes = 3 * bytes;
            }
            if let (Some(extent), false) = (spill, last) {
                self.nvme_write(host, extent, bytes, false);
            }
        }
    }

    /// Micro-batch `m`'s gradients of block `b`, whole in `from` (room for every rank's
    /// chunk), reduce-scattered into this rank's shard `into` on the collective lane,
    /// added to the earlier micro-batches' after the first; `scratch` where the device
    /// needs room for the chunks it receives.
    fn reduce_scatter(
        &mut self,
        b: usize,
        m: usize,
        from: BufId,
        into: BufId,
        scratch: Option<BufId>,
    ) {
        let mut access = vec![Access::Read(from), Access::Write(into)];
        access.extend(scratch.map(Access::Write));
        let id = self.op(
            Lane::Comm,
            OpKind::ReduceScatter {
                block: b,
                from,
                into,
                scratch,
                accumulate: m > 0,
            },
            access,
        );
        self.ops[id.index()].bytes = 4 * self.ranks as u64 * self.shard(b);
    }

    /// A state read of an NVMe-homed block into its host staging, `depth` blocks ahead of
    /// its update. With a delayed update nothing this step computes waits for the
    /// update's I/O, so its reads go on the write lane, behind nothing the compute lane
    /// needs.
    fn read_state(&mut self, b: usize) {
        if let Some(stage) = self.s_stage[b] {
            let lane = if self.shape.delayed_update {
                Lane::NvmeWrite
            } else {
                Lane::NvmeRead
            };
            let first = self.ops.len();
            self.nvme_read(lane, self.s_home[b].0, stage, 12 * self.shard(b));
            if let Some(extent) = self.g_spill[b] {
                let into = self.g_apply_host[b].expect("host gradients");
                self.nvme_read(lane, extent, into, 4 * self.shard(b));
            }
            self.mark_update(first);
        }
    }

    /// Spilled block `b`'s gradients, complete on the host: their statistics for the
    /// norm (CPU), then the write to their extent, which frees the host buffer.
    fn spill_gradients(&mut self, b: usize) {
        let Some(extent) = self.g_spill[b] else {
            return;
        };
        let (grads, stats) = (
            self.g_host[b].expect("host gradients"),
            self.stats_spill[b].expect("a statistics buffer"),
        );
        let bytes = 4 * self.shard(b);
        let id = self.op(
            Lane::Cpu,
            OpKind::HostStats {
                block: b,
                grads,
                stats,
            },
            vec![Access::Read(grads), Access::Write(stats)],
        );
        self.ops[id.index()].bytes = bytes;
        self.nvme_write(grads, extent, bytes, false);
    }

    /// The statistics of device-homed block `b`'s gradients, computed on the device and
    /// copied to the host (part of the update).
    fn device_stats(&mut self, b: usize) {
        let (Some(stats), Some(host)) = (self.stats_dev[b], self.stats_host[b]) else {
            return;
        };
        let first = self.ops.len();
        let grads = self.g_apply_dev[b].expect("device gradients");
        let id = self.op(
            Lane::Update,
            OpKind::DeviceStats {
                block: b,
                grads,
                stats,
            },
            vec![
                Access::Read(grads),
                Access::Write(stats),
                Access::Write(self.stats_scratch),
            ],
        );
        self.ops[id.index()].bytes = 4 * self.len(b);
        self.copy_out(stats, host, 16);
        self.mark_update(first);
    }

    /// The global norm over every block, when the step needs it (part of the update);
    /// the device-homed blocks' statistics first.
    fn emit_norm(&mut self) {
        let Some(flag) = self.norm_flag else {
            return;
        };
        let nb = self.nb();
        for b in 0..nb {
            self.device_stats(b);
        }
        let sources: Vec<(usize, GradSource)> = (0..nb)
            .map(|b| match (self.g_apply_host[b], self.stats_host[b]) {
                _ if self.spill[b] => (b, GradSource::Stats(self.stats_spill[b].expect("spilled"))),
                (Some(grads), _) => (b, GradSource::Host(grads)),
                (None, Some(stats)) => (b, GradSource::Stats(stats)),
                (None, None) => unreachable!("every block's gradients are on the host or device"),
            })
            .collect();
        let mut access: Vec<Access> = sources
            .iter()
            .map(|&(_, s)| match s {
                GradSource::Host(g) | GradSource::Stats(g) => Access::Read(g),
            })
            .collect();
        access.push(Access::Write(flag));
        let total: u64 = (0..nb).map(|b| self.shard(b)).sum();
        let first = self.ops.len();
        // With ranks the norm is a collective (every rank's pieces, summed in order).
        let lane = if self.ranks > 1 {
            Lane::Comm
        } else {
            Lane::Cpu
        };
        let id = self.op(lane, OpKind::GradNorm { sources }, access);
        self.ops[id.index()].bytes = 4 * total;
        self.mark_update(first);
    }

    /// AdamW on block `b` and the write-backs of its state and parameters.
    fn emit_update(&mut self, b: usize) {
        let len = self.shard(b);
        let first = self.ops.len();
        let flag = self.norm_flag;
        if self.homes[b].state == Tier::Device {
            if flag.is_none() {
                self.device_stats(b);
            }
            let grads = self.g_apply_dev[b].expect("device gradients");
            let state = self.s_home[b].0;
            // With ranks the update writes this rank's shard of the new parameters, which
            // every rank's are gathered with: over device memory (in the device's dtype),
            // or on the host (in the host's precision).
            let device_comm = self.device_comm(b);
            let out = (self.ranks > 1).then(|| {
                let bytes = len
                    * if device_comm {
                        self.dbytes
                    } else {
                        self.pbytes
                    };
                self.buffer(format!("params[{b}]>@device"), Tier::Device, bytes)
            });
            let params = out.unwrap_or(self.p_home[b].1);
            let mut access = vec![
                Access::Read(grads),
                Access::Write(state),
                Access::Write(params),
            ];
            access.extend(flag.map(Access::Read));
            let id = self.op(
                Lane::Update,
                OpKind::DeviceUpdate {
                    block: b,
                    grads,
                    state,
                    params,
                },
                access,
            );
            self.ops[id.index()].params = len;
            if let (Some(out), true) = (out, device_comm) {
                let into = self.p_home[b].1;
                let id = self.op(
                    Lane::Comm,
                    OpKind::AllGather {
                        block: b,
                        from: out,
                        into,
                        with_update: true,
                    },
                    vec![Access::Read(out), Access::Write(into)],
                );
                self.ops[id.index()].bytes = self.ranks as u64 * len * self.dbytes;
            } else if let Some(out) = out {
                let stage = self.p_out_stage[b].expect("a host stage for the new shard");
                self.copy_out(out, stage, len * self.pbytes);
                let from = self.gathered(b, stage, ">", true);
                let to = self.p_home[b].1;
                self.copy_in(
                    from,
                    to,
                    self.len(b) * self.pbytes,
                    self.param_conversion(),
                    true,
                );
            }
            self.mark_update(first);
            return;
        }
        let grads = self.g_apply_host[b].expect("host gradients");
        let state = self.s_stage[b].unwrap_or(self.s_home[b].0);
        let params_out = if self.shares_master(b) {
            None
        } else {
            Some(self.p_out_stage[b].unwrap_or(self.p_home[b].1))
        };
        let mut access = vec![Access::Read(grads), Access::Write(state)];
        access.extend(params_out.map(Access::Write));
        access.extend(flag.map(Access::Read));
        let id = self.op(
            Lane::Cpu,
            OpKind::Optimizer {
                block: b,
                grads,
                state,
                params_out,
            },
            access,
        );
        self.ops[id.index()].params = len;
        if flag.is_none() {
            // With no norm it also takes the gradients' statistics, a pass over them (as
            // a device-homed block's `DeviceStats` does).
            self.ops[id.index()].bytes = 4 * len;
        }
        if self.homes[b].state == Tier::Nvme {
            self.nvme_write(state, self.s_home[b].1, 12 * len, true);
        }
        let mut commit = Vec::new();
        if self.homes[b].state == Tier::Nvme {
            commit.push(self.s_home[b].1);
        }
        match (self.homes[b].params, params_out) {
            (_, None) => {} // written with the state
            (Tier::Nvme, Some(params_out)) => {
                self.nvme_write(params_out, self.p_home[b].1, len * self.pbytes, true);
                if !self.shape.delayed_update {
                    commit.push(self.p_home[b].1);
                }
            }
            (Tier::Device, Some(params_out)) if params_out == self.p_home[b].1 => {
                // Written in place by the optimizer (`update_writes_device`).
            }
            (Tier::Device, Some(params_out)) => {
                let to = self.p_home[b].1;
                let from = self.gathered(b, params_out, ">", true);
                self.copy_in(
                    from,
                    to,
                    self.len(b) * self.pbytes,
                    self.param_conversion(),
                    true,
                );
            }
            (Tier::Host, _) => {}
        }
        if !commit.is_empty() {
            // After the block's writes (write after write on their extents).
            let access = commit.into_iter().map(Access::Write).collect();
            self.op(Lane::NvmeWrite, OpKind::Commit { block: b }, access);
        }
        self.mark_update(first);
    }

    /// Stage 4: dependencies, the memory plan, peaks, lanes and link bytes.
    fn finish(self) -> Result<Plan, PlanError> {
        let nb = self.nb();
        let swap_on_update: Vec<(BufId, BufId)> = self
            .p_home
            .iter()
            .enumerate()
            .filter(|&(b, &(cur, next))| cur != next && self.homes[b].params != Tier::Nvme)
            .map(|(_, &pair)| pair)
            .collect();
        let swap_each_step: Vec<(BufId, BufId)> = (0..nb)
            .flat_map(|b| {
                [
                    self.g_host[b].zip(self.g_apply_host[b]),
                    self.g_home_dev[b].zip(self.g_apply_dev[b]),
                ]
            })
            .flatten()
            .filter(|(fill, apply)| fill != apply)
            .collect();
        let mut ops = self.ops;
        let mut buffers = self.buffers;
        super::memory::derive_dependencies(&mut ops, buffers.len());
        let slots = super::memory::allocate(&mut ops, &mut buffers);
        let mut peak = [0u64; 3];
        for tier in [Tier::Device, Tier::Host] {
            peak[tier.index()] = super::memory::arena_bytes(&slots, tier);
        }
        let spares = spare_extents(&self.extent_groups);
        peak[Tier::Nvme.index()] = self
            .extent_groups
            .iter()
            .map(Extent::stored_bytes)
            .chain(
                spares
                    .iter()
                    .map(|&(bytes, n)| bytes.next_multiple_of(4096) * n as u64),
            )
            .sum();
        let mut lanes: [Vec<OpId>; Lane::COUNT] = Default::default();
        let mut link_bytes = [0u64; 4];
        for (id, op) in ops.iter().enumerate() {
            lanes[op.lane.index()].push(OpId::of(id));
            if let Some(link) = op.kind.link() {
                link_bytes[link] += op.bytes;
            }
        }
        let layers = self.layers;
        let homes = (0..nb)
            .map(|b| {
                let h = &self.homes[b];
                let ckpt = if b >= 1 && b <= layers {
                    self.ckpt_tier[b - 1]
                } else {
                    Tier::Device
                };
                [h.params, h.grads, h.state, ckpt]
            })
            .collect();
        let block_homes = (0..nb)
            .map(|b| BlockHomes {
                params: self.p_home[b].0,
                state: self.s_home[b].0,
            })
            .collect();
        Ok(Plan {
            policy: self.name,
            homes,
            grads_spilled: self.spill,
            kept: self.kept,
            saved_bytes: self.saved_bytes,
            depth: self.depth,
            shape: self.shape,
            budgets: self.input.budgets,
            ops,
            lanes,
            buffers,
            slots,
            extent_groups: self.extent_groups,
            spares,
            peak,
            link_bytes,
            block_homes,
            shard_len: self.shard,
            tokens_host: self.tokens_host,
            losses_host: self.losses_host,
            stats_host: self.stats_host,
            scratch: self.scratch,
            stats_scratch: self.stats_scratch,
            swap_each_step,
            swap_on_update,
        })
    }
}
