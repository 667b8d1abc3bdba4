//! The planner: (model, step shape, policy, budgets) -> a static schedule and its memory
//! plan.
//!
//! 1. Homes: the policy names a tier for every block's tensor classes; persistent
//!    buffers (device- or host-resident homes) and NVMe extents follow. Data homed on
//!    NVMe that a step rewrites (working parameters, optimizer state) has two extents, A
//!    and B: a step reads the current side and writes the other, and the sides swap only
//!    when the whole step succeeded, so a failed step leaves the previous state intact.
//! 2. Operations are emitted in one canonical order, a topological order of the step:
//!    the compute sequence (forward blocks, the head's forward and backward, backward
//!    blocks), with fetches placed `depth` compute operations ahead of their use and
//!    gradient copies, optimizer steps and write-backs right after the backward that
//!    completes a block's gradients (after a global-norm barrier when clipping, or
//!    spread over the next step's compute with a delayed update). Each lane runs its
//!    operations in this order.
//! 3. Dependencies are derived from each operation's reads and writes of logical buffers
//!    (read after write, write after read, write after write).
//! 4. Memory: each transient buffer is live from its first to its last use in the
//!    canonical order; buffers of one tier and kind whose lifetimes do not overlap share
//!    a physical slot (interval allocation, best fit within 2x), and the reuse adds dependencies
//!    from the previous occupant's users to the new occupant's first use. Every edge
//!    points backwards in the canonical order, so the lanes cannot deadlock.

use std::fmt;

use super::{Budgets, PlanError, PlanInput, Policy, Release, TensorClass, Tier};
use crate::model::BlockKind;
use crate::model::block::scratch_elements;

/// Index of an operation in [`Plan::ops`] (the canonical order).
pub type OpId = usize;
/// Index of a logical buffer in [`Plan::buffers`].
pub type BufId = usize;

/// The lanes that run concurrently; each runs its operations in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lane {
    /// NVMe reads (the io_uring thread does the I/O).
    NvmeRead,
    /// NVMe writes, beside the reads: reading block i-1's state and writing block i+1's
    /// overlap.
    NvmeWrite,
    /// Host to device copies.
    H2d,
    /// The device's kernels.
    Compute,
    /// Device to host copies.
    D2h,
    /// The CPU optimizer.
    Cpu,
}

impl Lane {
    /// Every lane.
    pub const ALL: [Lane; 6] = [
        Lane::NvmeRead,
        Lane::NvmeWrite,
        Lane::H2d,
        Lane::Compute,
        Lane::D2h,
        Lane::Cpu,
    ];

    /// Position in [`Lane::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Lane::NvmeRead => "nvme-read",
            Lane::NvmeWrite => "nvme-write",
            Lane::H2d => "h2d",
            Lane::Compute => "compute",
            Lane::D2h => "d2h",
            Lane::Cpu => "cpu-optimizer",
        })
    }
}

/// What a logical buffer holds, which decides how it is allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BufKind {
    /// A device parameter buffer (the backend's type), `elems` elements.
    DevParams,
    /// A device gradient buffer (f32), `elems` elements.
    DevGrads,
    /// A device activation buffer, `elems` elements.
    DevAct,
    /// The device's fixed working set: one block's scratch, two gradient-of-activation
    /// buffers and the token ids.
    DevFixed,
    /// Plain bytes (4096-aligned): host buffers, and optimizer state on a host device.
    Raw,
    /// One NVMe extent, or one side of an A/B pair.
    Extent {
        /// Index into [`Plan::extent_groups`].
        group: usize,
        /// Which side.
        side: ExtentSide,
    },
    /// Not memory: orders the optimizer after the global gradient norm.
    Flag,
}

/// Which extent of a group an operation touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExtentSide {
    /// The group has one extent.
    Single,
    /// The side holding the state before this step.
    Current,
    /// The side this step writes; current after the step commits.
    Next,
}

/// Extents on the NVMe tier that belong together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extent {
    /// Name (also the store's extent name, with `.a`/`.b` for pairs).
    pub name: String,
    /// Bytes of one extent.
    pub bytes: u64,
    /// A/B pair (state rewritten every step) or one extent (checkpoints).
    pub paired: bool,
    /// The block, and the class of its data.
    pub block: usize,
    /// The class of its data.
    pub class: TensorClass,
}

/// One logical buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct BufferPlan {
    /// Name for traces and messages (`params[3]@device`).
    pub name: String,
    /// Tier its memory counts against.
    pub tier: Tier,
    /// What it holds.
    pub kind: BufKind,
    /// Elements (device kinds) or bytes (raw).
    pub elems: usize,
    /// Bytes.
    pub bytes: u64,
    /// Lives across steps (homes, fixed buffers): never shares memory.
    pub persistent: bool,
    /// The physical slot that holds it (an index into [`Plan::slots`]), if memory.
    pub slot: Option<usize>,
    /// First and last operations that touch it.
    pub live: Option<(OpId, OpId)>,
}

/// A physical buffer: allocated once, shared by logical buffers with disjoint lifetimes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotPlan {
    /// Tier.
    pub tier: Tier,
    /// Kind (all of its logical buffers have it).
    pub kind: BufKind,
    /// Elements (device kinds) or bytes (raw): the largest of its logical buffers.
    pub elems: usize,
    /// Bytes.
    pub bytes: u64,
}

/// A read or a write of a logical buffer by an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Reads.
    Read(BufId),
    /// Writes (possibly after reading).
    Write(BufId),
}

/// What an operation does.
#[derive(Debug, Clone, PartialEq)]
pub enum OpKind {
    /// Reads an extent into a host buffer.
    NvmeRead {
        /// The extent (a buffer of kind [`BufKind::Extent`]).
        from: BufId,
        /// Host buffer.
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
    /// Copies a block's working parameters from a host buffer to a device buffer.
    H2dParams {
        /// Block.
        block: usize,
        /// Host buffer (working dtype).
        from: BufId,
        /// Device buffer.
        to: BufId,
        /// Part of the parameter update (skipped with it).
        with_update: bool,
    },
    /// Copies a checkpoint from a host buffer to a device buffer.
    H2dAct {
        /// Host buffer.
        from: BufId,
        /// Device buffer.
        to: BufId,
    },
    /// Copies a block's gradients to a host buffer (adding to it after the first
    /// micro-batch).
    D2hGrads {
        /// Block.
        block: usize,
        /// Device buffer.
        from: BufId,
        /// Host buffer (f32).
        to: BufId,
        /// Add instead of overwrite.
        accumulate: bool,
    },
    /// Adds a micro-batch's gradients to the device-homed gradients.
    AccumulateGrads {
        /// Block.
        block: usize,
        /// This micro-batch's gradients.
        from: BufId,
        /// The home.
        to: BufId,
    },
    /// Copies a checkpoint from the device to a host buffer.
    D2hAct {
        /// Device buffer.
        from: BufId,
        /// Host buffer.
        to: BufId,
    },
    /// The embedding's forward (uploads the micro-batch's tokens and targets first).
    EmbeddingForward {
        /// Micro-batch.
        micro: usize,
        /// The embedding's parameters.
        params: BufId,
        /// Its output: checkpoint 0.
        output: BufId,
    },
    /// A transformer block's forward.
    LayerForward {
        /// Block index (layer + 1).
        block: usize,
        /// Micro-batch.
        micro: usize,
        /// Parameters.
        params: BufId,
        /// Input checkpoint.
        input: BufId,
        /// Output checkpoint.
        output: BufId,
    },
    /// The head's forward and backward in one (the loss and the gradient of its input).
    /// Zeroes both gradient buffers first: every micro-batch's gradients start from zero
    /// (later micro-batches of device-homed gradients are added to the home by
    /// `AccumulateGrads`, in the same order the host adds offloaded ones).
    Head {
        /// Micro-batch.
        micro: usize,
        /// The head's parameters.
        params: BufId,
        /// The embedding's parameters (tied `wte`).
        embedding: BufId,
        /// The head's gradients.
        grads: BufId,
        /// The embedding's gradients.
        embedding_grads: BufId,
        /// Input checkpoint.
        input: BufId,
    },
    /// A transformer block's backward (recomputing its forward), into zeroed gradients.
    LayerBackward {
        /// Block.
        block: usize,
        /// Micro-batch.
        micro: usize,
        /// Parameters.
        params: BufId,
        /// Gradients.
        grads: BufId,
        /// Input checkpoint.
        input: BufId,
    },
    /// The embedding's backward.
    EmbeddingBackward {
        /// Micro-batch.
        micro: usize,
        /// Gradients.
        grads: BufId,
    },
    /// The global gradient norm and overflow check, over every block's gradients.
    GradNorm {
        /// (block, gradient buffer) for every block.
        grads: Vec<(usize, BufId)>,
    },
    /// AdamW on one block: reads its gradients, updates master parameters, m and v, and
    /// writes the new working parameters.
    Optimizer {
        /// Block.
        block: usize,
        /// Gradients (host f32, or a device buffer on a host device).
        grads: BufId,
        /// Master parameters, m and v (raw, 12 bytes per element).
        state: BufId,
        /// Where the new working parameters go: a raw host buffer (working dtype) or a
        /// device parameter buffer on a host device.
        params_out: BufId,
    },
}

impl OpKind {
    /// A short label for traces (`fwd 3`, `h2d params 2`).
    pub fn label(&self) -> String {
        match self {
            OpKind::NvmeRead { .. } => "nvme read".into(),
            OpKind::NvmeWrite { .. } => "nvme write".into(),
            OpKind::H2dParams { block, .. } => format!("h2d params {block}"),
            OpKind::H2dAct { .. } => "h2d checkpoint".into(),
            OpKind::D2hGrads { block, .. } => format!("d2h grads {block}"),
            OpKind::D2hAct { .. } => "d2h checkpoint".into(),
            OpKind::AccumulateGrads { block, .. } => format!("accumulate grads {block}"),
            OpKind::EmbeddingForward { .. } => "fwd embedding".into(),
            OpKind::LayerForward { block, .. } => format!("fwd {block}"),
            OpKind::Head { .. } => "head fwd+bwd".into(),
            OpKind::LayerBackward { block, .. } => format!("bwd {block}"),
            OpKind::EmbeddingBackward { .. } => "bwd embedding".into(),
            OpKind::GradNorm { .. } => "grad norm".into(),
            OpKind::Optimizer { block, .. } => format!("adamw {block}"),
        }
    }

    /// The kind's name, for per-kind histograms.
    pub fn kind_name(&self) -> &'static str {
        match self {
            OpKind::NvmeRead { .. } => "nvme-read",
            OpKind::NvmeWrite { .. } => "nvme-write",
            OpKind::H2dParams { .. } | OpKind::H2dAct { .. } => "h2d",
            OpKind::D2hGrads { .. } | OpKind::D2hAct { .. } => "d2h",
            OpKind::AccumulateGrads { .. } => "accumulate",
            OpKind::EmbeddingForward { .. } | OpKind::LayerForward { .. } => "forward",
            OpKind::Head { .. } => "head",
            OpKind::LayerBackward { .. } | OpKind::EmbeddingBackward { .. } => "backward",
            OpKind::GradNorm { .. } => "grad-norm",
            OpKind::Optimizer { .. } => "adamw",
        }
    }
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
    /// Bytes it moves (copies and I/O) or the optimizer's parameter count × 4.
    pub bytes: u64,
    /// Floating-point operations (compute), for the cost model.
    pub flops: f64,
    /// Parameters it updates (optimizer), for the cost model.
    pub params: u64,
    /// Part of the parameter update (state reads, the norm, AdamW, write-backs): with a
    /// delayed update these run apart from the step's compute, and alone in a flush.
    pub update: bool,
}

/// The static schedule and memory plan of one training step.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The policy it was built from.
    pub policy: String,
    /// Home tier of every block's classes, indexed by [`TensorClass`] order
    /// (params, grads, optimizer; checkpoints: of the block's input).
    pub homes: Vec<[Tier; 4]>,
    /// Prefetch depth used.
    pub depth: usize,
    /// The step's shape.
    pub shape: super::StepShape,
    /// The budgets checked against.
    pub budgets: Budgets,
    /// Operations, in canonical order.
    pub ops: Vec<Op>,
    /// Each lane's operations, in order (indexed by [`Lane::index`]).
    pub lanes: [Vec<OpId>; 6],
    /// Logical buffers.
    pub buffers: Vec<BufferPlan>,
    /// Physical slots.
    pub slots: Vec<SlotPlan>,
    /// NVMe extent groups.
    pub extent_groups: Vec<Extent>,
    /// Peak bytes per tier ([`Tier::index`]): the sum of the tier's slots (and extents).
    pub peak: [u64; 3],
    /// Bytes per step over each link: NVMe read, NVMe write, H2D, D2H.
    pub link_bytes: [u64; 4],
    /// Delayed update: pairs of persistent buffers (gradients being filled, gradients
    /// being applied) whose memory the executor exchanges after every step.
    pub swap_each_step: Vec<(BufId, BufId)>,
    /// Delayed update: pairs of persistent homes (working parameters read by this step,
    /// written by its update) exchanged after every step that applied an update.
    pub swap_on_update: Vec<(BufId, BufId)>,
}

/// Bytes rounded up to the 4096 O_DIRECT needs.
fn raw_bytes(bytes: u64) -> u64 {
    bytes.next_multiple_of(4096)
}

struct Builder {
    ops: Vec<Op>,
    buffers: Vec<BufferPlan>,
    extent_groups: Vec<Extent>,
}

impl Builder {
    fn buffer(
        &mut self,
        name: String,
        tier: Tier,
        kind: BufKind,
        elems: usize,
        bytes: u64,
    ) -> BufId {
        self.buffers.push(BufferPlan {
            name,
            tier,
            kind,
            elems,
            bytes,
            persistent: false,
            slot: None,
            live: None,
        });
        self.buffers.len() - 1
    }

    fn persistent(
        &mut self,
        name: String,
        tier: Tier,
        kind: BufKind,
        elems: usize,
        bytes: u64,
    ) -> BufId {
        let id = self.buffer(name, tier, kind, elems, bytes);
        self.buffers[id].persistent = true;
        id
    }

    /// An extent group: one buffer per side.
    fn extents(
        &mut self,
        name: String,
        bytes: u64,
        paired: bool,
        block: usize,
        class: TensorClass,
    ) -> (BufId, BufId) {
        self.extent_groups.push(Extent {
            name: name.clone(),
            bytes,
            paired,
            block,
            class,
        });
        let group = self.extent_groups.len() - 1;
        let mut side = |side, label: &str| {
            self.persistent(
                format!("{name}{label}@nvme"),
                Tier::Nvme,
                BufKind::Extent { group, side },
                0,
                0,
            )
        };
        if paired {
            (
                side(ExtentSide::Current, ".cur"),
                side(ExtentSide::Next, ".next"),
            )
        } else {
            let id = side(ExtentSide::Single, "");
            (id, id)
        }
    }

    fn op(
        &mut self,
        lane: Lane,
        kind: OpKind,
        access: Vec<Access>,
        bytes: u64,
        flops: f64,
        params: u64,
    ) -> OpId {
        self.ops.push(Op {
            kind,
            lane,
            deps: Vec::new(),
            access,
            bytes,
            flops,
            params,
            update: false,
        });
        self.ops.len() - 1
    }

    /// Marks the operations from `first` on as part of the update.
    fn mark_update(&mut self, first: OpId) {
        for op in &mut self.ops[first..] {
            op.update = true;
        }
    }
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
    Embed(usize),
    Layer(usize, usize),
    Head(usize),
    LayerBack(usize, usize),
    EmbedBack(usize),
}

impl Compute {
    fn micro(self) -> usize {
        match self {
            Compute::Embed(m) | Compute::Head(m) | Compute::EmbedBack(m) => m,
            Compute::Layer(_, m) | Compute::LayerBack(_, m) => m,
        }
    }

    /// Blocks whose parameters it reads.
    fn param_blocks(self, head: usize) -> Vec<usize> {
        match self {
            Compute::Embed(_) => vec![0],
            Compute::Layer(b, _) | Compute::LayerBack(b, _) => vec![b],
            Compute::Head(_) => vec![head, 0],
            Compute::EmbedBack(_) => vec![],
        }
    }
}

impl Plan {
    /// Plans one training step of `input.model` under `policy`. Allocates nothing.
    /// Does not check the budgets: see [`Plan::check_fits`].
    pub fn build(input: &PlanInput<'_>, policy: &dyn Policy) -> Result<Plan, PlanError> {
        let name = policy.name();
        let shape = input.shape;
        if shape.batch == 0 || shape.seq == 0 || shape.grad_accum == 0 {
            return Err(PlanError::Invalid(
                "batch, sequence length and gradient accumulation must be at least 1".into(),
            ));
        }
        let dims = input
            .model
            .dims(shape.batch, shape.seq)
            .map_err(|e| PlanError::Invalid(e.to_string()))?;
        let depth = policy.prefetch_depth(input).max(1);
        let blocks = input.model.blocks();
        let nb = blocks.len();
        let head = nb - 1;
        let layers = nb - 2;
        let bad = |reason: String| PlanError::BadPolicy {
            policy: name.clone(),
            reason,
        };

        // 1. Homes.
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
            if h.state == Tier::Device && !shape.device_is_host {
                return Err(bad(format!(
                    "block {b}: optimizer state on the device needs the CPU device (the \
                     optimizer runs on the CPU); use cpu-offload on a GPU"
                )));
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

        let mut bld = Builder {
            ops: Vec::new(),
            buffers: Vec::new(),
            extent_groups: Vec::new(),
        };
        let pbytes = shape.precision.param_bytes();
        let ebytes = shape.device_elem_bytes;
        let (n, c) = (dims.rows(), dims.width);

        // Fixed device working set.
        let (act, stats, att) = scratch_elements(dims);
        let fixed =
            (act + 2 * n * c) as u64 * ebytes + (stats * 4 + att * 4) as u64 + 2 * n as u64 * 4;
        bld.persistent(
            "scratch@device".into(),
            Tier::Device,
            BufKind::DevFixed,
            0,
            fixed,
        );

        // Homes of parameters and optimizer state.
        let mut p_home = Vec::with_capacity(nb);
        let mut s_home = Vec::with_capacity(nb);
        let mut g_home_dev = vec![None; nb];
        // Gradients the update reads: the ones this step fills, or (delayed) the last step's.
        let mut g_apply_dev: Vec<Option<BufId>> = vec![None; nb];
        for (b, h) in homes.iter().enumerate() {
            let len = blocks[b].len;
            p_home.push(match h.params {
                Tier::Device => {
                    let mut home = |suffix: &str| {
                        bld.persistent(
                            format!("params[{b}]@device{suffix}"),
                            Tier::Device,
                            BufKind::DevParams,
                            len,
                            len as u64 * ebytes,
                        )
                    };
                    let cur = home("");
                    let next = if shape.delayed_update { home("'") } else { cur };
                    (cur, next)
                }
                Tier::Host => {
                    let bytes = raw_bytes(len as u64 * pbytes);
                    let mut home = |suffix: &str| {
                        bld.persistent(
                            format!("params[{b}]@host{suffix}"),
                            Tier::Host,
                            BufKind::Raw,
                            bytes as usize,
                            bytes,
                        )
                    };
                    let cur = home("");
                    let next = if shape.delayed_update { home("'") } else { cur };
                    (cur, next)
                }
                Tier::Nvme => bld.extents(
                    format!("params.{b}"),
                    len as u64 * pbytes,
                    true,
                    b,
                    TensorClass::Params,
                ),
            });
            s_home.push(match h.state {
                Tier::Device | Tier::Host => {
                    let bytes = raw_bytes(12 * len as u64);
                    let id = bld.persistent(
                        format!("adam[{b}]@{}", h.state),
                        h.state,
                        BufKind::Raw,
                        bytes as usize,
                        bytes,
                    );
                    (id, id)
                }
                Tier::Nvme => bld.extents(
                    format!("adam.{b}"),
                    12 * len as u64,
                    true,
                    b,
                    TensorClass::Optimizer,
                ),
            });
            if h.grads == Tier::Device {
                let mut home = |suffix: &str| {
                    bld.persistent(
                        format!("grads[{b}]@device{suffix}"),
                        Tier::Device,
                        BufKind::DevGrads,
                        len,
                        4 * len as u64,
                    )
                };
                let fill = home("");
                g_home_dev[b] = Some(fill);
                g_apply_dev[b] = Some(if shape.delayed_update {
                    home("'")
                } else {
                    fill
                });
            }
        }
        // Host gradients: transient, or (delayed) two persistent sets, one filled by this
        // step's backward while the update applies the other.
        let mut g_apply_host: Vec<Option<BufId>> = vec![None; nb];
        let g_host: Vec<Option<BufId>> = (0..nb)
            .map(|b| {
                (homes[b].grads == Tier::Host).then(|| {
                    let bytes = raw_bytes(4 * blocks[b].len as u64);
                    if shape.delayed_update {
                        let mut home = |suffix: &str| {
                            bld.persistent(
                                format!("grads[{b}]@host{suffix}"),
                                Tier::Host,
                                BufKind::Raw,
                                bytes as usize,
                                bytes,
                            )
                        };
                        let fill = home("");
                        g_apply_host[b] = Some(home("'"));
                        fill
                    } else {
                        let id = bld.buffer(
                            format!("grads[{b}]@host"),
                            Tier::Host,
                            BufKind::Raw,
                            bytes as usize,
                            bytes,
                        );
                        g_apply_host[b] = Some(id);
                        id
                    }
                })
            })
            .collect();
        // Checkpoint i is the input of block i + 1; the head's input stays on the device
        // (its forward and backward are one operation).
        let ckpt_tier: Vec<Tier> = (0..=layers)
            .map(|i| {
                if i == layers {
                    Tier::Device
                } else {
                    homes[i + 1].ckpt
                }
            })
            .collect();
        let ckpt_elems = n * c;
        let ckpt_raw = raw_bytes(ckpt_elems as u64 * ebytes);
        let ckpt_extent: Vec<Option<BufId>> = (0..=layers)
            .map(|i| {
                (ckpt_tier[i] == Tier::Nvme).then(|| {
                    bld.extents(
                        format!("ckpt.{i}"),
                        ckpt_elems as u64 * ebytes,
                        false,
                        i + 1,
                        TensorClass::Checkpoints,
                    )
                    .0
                })
            })
            .collect();
        let norm_flag = shape
            .needs_global_norm
            .then(|| bld.persistent("global-norm".into(), Tier::Host, BufKind::Flag, 0, 0));

        // 2. The compute sequence.
        let mut seq = Vec::new();
        for m in 0..shape.grad_accum {
            seq.push(Compute::Embed(m));
            for b in 1..=layers {
                seq.push(Compute::Layer(b, m));
            }
            seq.push(Compute::Head(m));
            for b in (1..=layers).rev() {
                seq.push(Compute::LayerBack(b, m));
            }
            seq.push(Compute::EmbedBack(m));
        }
        let last_micro = shape.grad_accum - 1;

        // Device parameter buffers per use group: consecutive uses of a streamed block
        // share one fetch; with Release::AfterBackward one fetch serves a micro-batch.
        // fetch_at[k]: fetches to emit before compute k.
        let mut dev_params: Vec<Vec<BufId>> = vec![vec![usize::MAX; nb]; seq.len()];
        let mut fetches: Vec<Vec<(usize, BufId)>> = vec![Vec::new(); seq.len()];
        for b in 0..nb {
            let uses: Vec<usize> = (0..seq.len())
                .filter(|&k| seq[k].param_blocks(head).contains(&b))
                .collect();
            if homes[b].params == Tier::Device {
                for &k in &uses {
                    dev_params[k][b] = p_home[b].0;
                }
                continue;
            }
            let keep = policy.release(input, b) == Release::AfterBackward;
            let mut group: Vec<usize> = Vec::new();
            let flush = |group: &mut Vec<usize>,
                         bld: &mut Builder,
                         dev_params: &mut Vec<Vec<BufId>>,
                         fetches: &mut Vec<Vec<(usize, BufId)>>| {
                if group.is_empty() {
                    return;
                }
                let len = blocks[b].len;
                let id = bld.buffer(
                    format!("params[{b}]@device"),
                    Tier::Device,
                    BufKind::DevParams,
                    len,
                    len as u64 * ebytes,
                );
                for &k in group.iter() {
                    dev_params[k][b] = id;
                }
                fetches[group[0].saturating_sub(depth)].push((b, id));
                group.clear();
            };
            for &k in &uses {
                let joins = group.last().is_some_and(|&prev| {
                    k == prev + 1 || (keep && seq[prev].micro() == seq[k].micro())
                });
                if !joins {
                    flush(&mut group, &mut bld, &mut dev_params, &mut fetches);
                }
                group.push(k);
            }
            flush(&mut group, &mut bld, &mut dev_params, &mut fetches);
        }

        // Checkpoint buffers per micro-batch: the forward's device copy, and where the
        // backward reads it.
        struct Ckpt {
            fwd: BufId,
            bwd: BufId,
            host: Option<BufId>,
        }
        let mut ckpts: Vec<Vec<Ckpt>> = Vec::new();
        for m in 0..shape.grad_accum {
            let mut row = Vec::new();
            for (i, &tier) in ckpt_tier.iter().enumerate() {
                let fwd = bld.buffer(
                    format!("ckpt[{i}]#{m}@device"),
                    Tier::Device,
                    BufKind::DevAct,
                    ckpt_elems,
                    ckpt_elems as u64 * ebytes,
                );
                row.push(match tier {
                    Tier::Device => Ckpt {
                        fwd,
                        bwd: fwd,
                        host: None,
                    },
                    _ => Ckpt {
                        fwd,
                        bwd: bld.buffer(
                            format!("ckpt[{i}]#{m}<@device"),
                            Tier::Device,
                            BufKind::DevAct,
                            ckpt_elems,
                            ckpt_elems as u64 * ebytes,
                        ),
                        host: Some(bld.buffer(
                            format!("ckpt[{i}]#{m}@host"),
                            Tier::Host,
                            BufKind::Raw,
                            ckpt_raw as usize,
                            ckpt_raw,
                        )),
                    },
                });
            }
            ckpts.push(row);
        }
        // Checkpoint fetches for the backward, emitted `depth` computes ahead.
        let mut ckpt_fetch: Vec<Vec<(usize, usize)>> = vec![Vec::new(); seq.len()];
        for (k, op) in seq.iter().enumerate() {
            if let Compute::LayerBack(b, m) = *op {
                let i = b - 1;
                if ckpt_tier[i] != Tier::Device {
                    // Not before the forward that produces it has been emitted.
                    let producer = if i == 0 {
                        Compute::Embed(m)
                    } else {
                        Compute::Layer(i, m)
                    };
                    let made = seq
                        .iter()
                        .position(|&x| x == producer)
                        .expect("in the sequence");
                    ckpt_fetch[k.saturating_sub(depth).max(made + 1)].push((i, m));
                }
            }
        }
        // Gradients: a device buffer per micro-batch (or the device home).
        let mut g_dev: Vec<Vec<BufId>> = Vec::new();
        for m in 0..shape.grad_accum {
            g_dev.push(
                (0..nb)
                    .map(|b| match g_home_dev[b] {
                        Some(id) if m == 0 => id,
                        _ => bld.buffer(
                            format!("grads[{b}]#{m}@device"),
                            Tier::Device,
                            BufKind::DevGrads,
                            blocks[b].len,
                            4 * blocks[b].len as u64,
                        ),
                    })
                    .collect(),
            );
        }
        // Optimizer state reads (NVMe homes), emitted `depth` computes before the backward
        // that completes the block's gradients.
        let completes = |b: usize| -> usize {
            let target = if b == head {
                Compute::Head(last_micro)
            } else if b == 0 {
                Compute::EmbedBack(last_micro)
            } else {
                Compute::LayerBack(b, last_micro)
            };
            seq.iter()
                .position(|&x| x == target)
                .expect("in the sequence")
        };
        let mut state_reads: Vec<Vec<usize>> = vec![Vec::new(); seq.len()];
        let mut s_stage = vec![None; nb];
        let mut p_out_stage = vec![None; nb];
        for b in 0..nb {
            let len = blocks[b].len as u64;
            if homes[b].state == Tier::Nvme {
                // With a global-norm barrier the reads are emitted with the updates,
                // after the norm (below), so that only `depth` blocks are staged at once.
                if norm_flag.is_none() && !shape.delayed_update {
                    state_reads[completes(b).saturating_sub(depth)].push(b);
                }
                let bytes = raw_bytes(12 * len);
                s_stage[b] = Some(bld.buffer(
                    format!("adam[{b}]@host"),
                    Tier::Host,
                    BufKind::Raw,
                    bytes as usize,
                    bytes,
                ));
            }
            if matches!(homes[b].params, Tier::Nvme)
                || (homes[b].params == Tier::Device && homes[b].state != Tier::Device)
            {
                let bytes = raw_bytes(len * pbytes);
                p_out_stage[b] = Some(bld.buffer(
                    format!("params[{b}]>@host"),
                    Tier::Host,
                    BufKind::Raw,
                    bytes as usize,
                    bytes,
                ));
            }
        }

        // Blocks whose optimizer state is updated in place (host or device homes) wait for
        // every NVMe transfer of the step when there are any, so that a failed transfer
        // leaves every block as it was (NVMe homes are protected by their A/B sides).
        let any_nvme = homes
            .iter()
            .any(|h| h.params == Tier::Nvme || h.state == Tier::Nvme)
            || ckpt_tier.contains(&Tier::Nvme);
        let deferred = |b: usize| any_nvme && homes[b].state != Tier::Nvme;

        // 3. Emission in canonical order.
        let fl = flops(dims);
        let mut opt_pending: Vec<usize> = Vec::new();
        let mut deferred_opts: Vec<usize> = Vec::new();
        let emit_fetch_params = |bld: &mut Builder, b: usize, to: BufId| {
            let len = blocks[b].len as u64;
            let from = match homes[b].params {
                Tier::Host => p_home[b].0,
                Tier::Nvme => {
                    let bytes = raw_bytes(len * pbytes);
                    let stage = bld.buffer(
                        format!("params[{b}]<@host"),
                        Tier::Host,
                        BufKind::Raw,
                        bytes as usize,
                        bytes,
                    );
                    bld.op(
                        Lane::NvmeRead,
                        OpKind::NvmeRead {
                            from: p_home[b].0,
                            into: stage,
                        },
                        vec![Access::Read(p_home[b].0), Access::Write(stage)],
                        len * pbytes,
                        0.0,
                        0,
                    );
                    stage
                }
                Tier::Device => unreachable!("device-resident parameters are not fetched"),
            };
            bld.op(
                Lane::H2d,
                OpKind::H2dParams {
                    block: b,
                    from,
                    to,
                    with_update: false,
                },
                vec![Access::Read(from), Access::Write(to)],
                len * pbytes,
                0.0,
                0,
            );
        };
        let emit_optimizer = |bld: &mut Builder, b: usize| {
            let len = blocks[b].len as u64;
            let h = &homes[b];
            let first = bld.ops.len();
            let grads = g_apply_host[b].or(g_apply_dev[b]).unwrap_or(g_dev[0][b]);
            let state = s_stage[b].unwrap_or(s_home[b].0);
            let params_out = p_out_stage[b].unwrap_or(p_home[b].1);
            let mut access = vec![
                Access::Read(grads),
                Access::Write(state),
                Access::Write(params_out),
            ];
            if let Some(flag) = norm_flag {
                access.push(Access::Read(flag));
            }
            bld.op(
                Lane::Cpu,
                OpKind::Optimizer {
                    block: b,
                    grads,
                    state,
                    params_out,
                },
                access,
                16 * len,
                0.0,
                len,
            );
            if h.state == Tier::Nvme {
                let next = s_home[b].1;
                bld.op(
                    Lane::NvmeWrite,
                    OpKind::NvmeWrite {
                        from: state,
                        to: next,
                        with_update: true,
                    },
                    vec![Access::Read(state), Access::Write(next)],
                    12 * len,
                    0.0,
                    0,
                );
            }
            match h.params {
                Tier::Nvme => {
                    let next = p_home[b].1;
                    bld.op(
                        Lane::NvmeWrite,
                        OpKind::NvmeWrite {
                            from: params_out,
                            to: next,
                            with_update: true,
                        },
                        vec![Access::Read(params_out), Access::Write(next)],
                        len * pbytes,
                        0.0,
                        0,
                    );
                }
                Tier::Device if h.state != Tier::Device => {
                    let to = p_home[b].1;
                    bld.op(
                        Lane::H2d,
                        OpKind::H2dParams {
                            block: b,
                            from: params_out,
                            to,
                            with_update: true,
                        },
                        vec![Access::Read(params_out), Access::Write(to)],
                        len * pbytes,
                        0.0,
                        0,
                    );
                }
                _ => {}
            }
            bld.mark_update(first);
        };
        // A state read of an NVMe-homed block into its host staging, `depth` blocks ahead
        // of its update (wherever the updates are placed). With a delayed update, nothing this step computes waits for the update's I/O,
        // so its reads go on the write lane, behind nothing the compute lane needs.
        let update_read_lane = if shape.delayed_update {
            Lane::NvmeWrite
        } else {
            Lane::NvmeRead
        };
        let read_state = |bld: &mut Builder, b: usize| {
            if let Some(stage) = s_stage[b] {
                let len = blocks[b].len as u64;
                let first = bld.ops.len();
                bld.op(
                    update_read_lane,
                    OpKind::NvmeRead {
                        from: s_home[b].0,
                        into: stage,
                    },
                    vec![Access::Read(s_home[b].0), Access::Write(stage)],
                    12 * len,
                    0.0,
                    0,
                );
                bld.mark_update(first);
            }
        };
        let emit_norm = |bld: &mut Builder| {
            if let Some(flag) = norm_flag {
                let grads: Vec<(usize, BufId)> = (0..nb)
                    .map(|b| (b, g_apply_host[b].or(g_apply_dev[b]).unwrap_or(g_dev[0][b])))
                    .collect();
                let mut access: Vec<Access> = grads.iter().map(|&(_, g)| Access::Read(g)).collect();
                access.push(Access::Write(flag));
                let total: u64 = blocks.iter().map(|b| b.len as u64).sum();
                let first = bld.op(
                    Lane::Cpu,
                    OpKind::GradNorm { grads },
                    access,
                    4 * total,
                    0.0,
                    total / 4,
                );
                bld.mark_update(first);
            }
        };
        // A delayed update applies the last step's gradients block by block in forward
        // order, spread evenly over this step's compute sequence, which it overlaps.
        let delayed_order: Vec<usize> = if shape.delayed_update {
            (0..nb).filter(|&b| !deferred(b)).collect()
        } else {
            Vec::new()
        };
        let updates_before = |k: usize| -> std::ops::Range<usize> {
            let n = delayed_order.len();
            let at = |i: usize| i * seq.len() / n.max(1);
            (0..n).filter(|&i| at(i) == k).fold(n..n, |r, i| {
                if r.is_empty() {
                    i..i + 1
                } else {
                    r.start..i + 1
                }
            })
        };
        for k in 0..seq.len() {
            if shape.delayed_update {
                if k == 0 {
                    emit_norm(&mut bld);
                    for &b in delayed_order.iter().take(depth) {
                        read_state(&mut bld, b);
                    }
                }
                for i in updates_before(k) {
                    emit_optimizer(&mut bld, delayed_order[i]);
                    if let Some(&next) = delayed_order.get(i + depth) {
                        read_state(&mut bld, next);
                    }
                }
            }
            for b in std::mem::take(&mut state_reads[k]) {
                read_state(&mut bld, b);
            }
            for (i, m) in std::mem::take(&mut ckpt_fetch[k]) {
                let ck = &ckpts[m][i];
                let host = ck.host.expect("offloaded");
                let from = match ckpt_extent[i] {
                    Some(extent) => {
                        let stage = bld.buffer(
                            format!("ckpt[{i}]#{m}<@host"),
                            Tier::Host,
                            BufKind::Raw,
                            ckpt_raw as usize,
                            ckpt_raw,
                        );
                        bld.op(
                            Lane::NvmeRead,
                            OpKind::NvmeRead {
                                from: extent,
                                into: stage,
                            },
                            vec![Access::Read(extent), Access::Write(stage)],
                            ckpt_elems as u64 * ebytes,
                            0.0,
                            0,
                        );
                        stage
                    }
                    None => host,
                };
                bld.op(
                    Lane::H2d,
                    OpKind::H2dAct { from, to: ck.bwd },
                    vec![Access::Read(from), Access::Write(ck.bwd)],
                    ckpt_elems as u64 * ebytes,
                    0.0,
                    0,
                );
            }
            for (b, to) in std::mem::take(&mut fetches[k]) {
                emit_fetch_params(&mut bld, b, to);
            }
            let step = seq[k];
            let m = step.micro();
            let params_of = |b: usize| dev_params[k][b];
            match step {
                Compute::Embed(m) => {
                    let (params, output) = (params_of(0), ckpts[m][0].fwd);
                    bld.op(
                        Lane::Compute,
                        OpKind::EmbeddingForward {
                            micro: m,
                            params,
                            output,
                        },
                        vec![Access::Read(params), Access::Write(output)],
                        0,
                        fl.embedding,
                        0,
                    );
                }
                Compute::Layer(b, m) => {
                    let (params, input, output) =
                        (params_of(b), ckpts[m][b - 1].fwd, ckpts[m][b].fwd);
                    bld.op(
                        Lane::Compute,
                        OpKind::LayerForward {
                            block: b,
                            micro: m,
                            params,
                            input,
                            output,
                        },
                        vec![
                            Access::Read(params),
                            Access::Read(input),
                            Access::Write(output),
                        ],
                        0,
                        fl.layer_forward,
                        0,
                    );
                }
                Compute::Head(m) => {
                    let (params, embedding) = (params_of(head), params_of(0));
                    let (grads, embedding_grads) = (g_dev[m][head], g_dev[m][0]);
                    let input = ckpts[m][layers].fwd;
                    bld.op(
                        Lane::Compute,
                        OpKind::Head {
                            micro: m,
                            params,
                            embedding,
                            grads,
                            embedding_grads,
                            input,
                        },
                        vec![
                            Access::Read(params),
                            Access::Read(embedding),
                            Access::Read(input),
                            Access::Write(grads),
                            Access::Write(embedding_grads),
                        ],
                        0,
                        fl.head,
                        0,
                    );
                }
                Compute::LayerBack(b, m) => {
                    let (params, grads, input) = (params_of(b), g_dev[m][b], ckpts[m][b - 1].bwd);
                    bld.op(
                        Lane::Compute,
                        OpKind::LayerBackward {
                            block: b,
                            micro: m,
                            params,
                            grads,
                            input,
                        },
                        vec![
                            Access::Read(params),
                            Access::Read(input),
                            Access::Write(grads),
                        ],
                        0,
                        fl.layer_backward,
                        0,
                    );
                }
                Compute::EmbedBack(m) => {
                    let grads = g_dev[m][0];
                    bld.op(
                        Lane::Compute,
                        OpKind::EmbeddingBackward { micro: m, grads },
                        vec![Access::Write(grads)],
                        0,
                        fl.embedding,
                        0,
                    );
                }
            }
            // After the compute: checkpoint copies out, gradient copies out, updates.
            if let Compute::Embed(_) | Compute::Layer(..) = step {
                let i = match step {
                    Compute::Embed(_) => 0,
                    Compute::Layer(b, _) => b,
                    _ => unreachable!(),
                };
                let ck = &ckpts[m][i];
                if let Some(host) = ck.host {
                    bld.op(
                        Lane::D2h,
                        OpKind::D2hAct {
                            from: ck.fwd,
                            to: host,
                        },
                        vec![Access::Read(ck.fwd), Access::Write(host)],
                        ckpt_elems as u64 * ebytes,
                        0.0,
                        0,
                    );
                    if let Some(extent) = ckpt_extent[i] {
                        bld.op(
                            Lane::NvmeWrite,
                            OpKind::NvmeWrite {
                                from: host,
                                to: extent,
                                with_update: false,
                            },
                            vec![Access::Read(host), Access::Write(extent)],
                            ckpt_elems as u64 * ebytes,
                            0.0,
                            0,
                        );
                    }
                }
            }
            let finished: Vec<usize> = match step {
                Compute::Head(_) => vec![head],
                Compute::LayerBack(b, _) => vec![b],
                Compute::EmbedBack(_) => vec![0],
                _ => vec![],
            };
            for b in finished {
                if let (Some(home), true) = (g_home_dev[b], m > 0) {
                    let from = g_dev[m][b];
                    bld.op(
                        Lane::Compute,
                        OpKind::AccumulateGrads {
                            block: b,
                            from,
                            to: home,
                        },
                        vec![Access::Read(from), Access::Write(home)],
                        4 * blocks[b].len as u64,
                        blocks[b].len as f64,
                        0,
                    );
                }
                if let Some(host) = g_host[b] {
                    let from = g_dev[m][b];
                    bld.op(
                        Lane::D2h,
                        OpKind::D2hGrads {
                            block: b,
                            from,
                            to: host,
                            accumulate: m > 0,
                        },
                        vec![Access::Read(from), Access::Write(host)],
                        4 * blocks[b].len as u64,
                        0.0,
                        0,
                    );
                }
                if m == last_micro && shape.delayed_update {
                    if deferred(b) {
                        deferred_opts.push(b);
                    }
                } else if m == last_micro {
                    if deferred(b) {
                        deferred_opts.push(b);
                    } else if norm_flag.is_some() {
                        opt_pending.push(b);
                    } else {
                        emit_optimizer(&mut bld, b);
                    }
                }
            }
        }
        if !shape.delayed_update {
            emit_norm(&mut bld);
        }
        for &b in opt_pending.iter().take(depth) {
            read_state(&mut bld, b);
        }
        for (i, &b) in opt_pending.iter().enumerate() {
            emit_optimizer(&mut bld, b);
            if let Some(&next) = opt_pending.get(i + depth) {
                read_state(&mut bld, next);
            }
        }
        if !deferred_opts.is_empty() {
            // After every NVMe transfer of the step.
            let nvme_ops: Vec<OpId> = (0..bld.ops.len())
                .filter(|&o| matches!(bld.ops[o].lane, Lane::NvmeRead | Lane::NvmeWrite))
                .collect();
            for b in deferred_opts {
                let first = bld.ops.len();
                emit_optimizer(&mut bld, b);
                bld.ops[first].deps.extend(&nvme_ops);
            }
        }

        let swap_on_update: Vec<(BufId, BufId)> = p_home
            .iter()
            .enumerate()
            .filter(|&(b, &(cur, next))| cur != next && homes[b].params != Tier::Nvme)
            .map(|(_, &pair)| pair)
            .collect();
        let swap_each_step: Vec<(BufId, BufId)> = (0..nb)
            .flat_map(|b| {
                [
                    g_host[b].zip(g_apply_host[b]),
                    g_home_dev[b].zip(g_apply_dev[b]),
                ]
            })
            .flatten()
            .filter(|(fill, apply)| fill != apply)
            .collect();

        // 4. Dependencies from accesses, then the memory plan.
        let mut ops = bld.ops;
        let mut buffers = bld.buffers;
        derive_dependencies(&mut ops, buffers.len());
        let slots = allocate(&mut ops, &mut buffers)?;
        let mut peak = [0u64; 3];
        for s in &slots {
            peak[s.tier.index()] += s.bytes;
        }
        for e in &bld.extent_groups {
            peak[Tier::Nvme.index()] +=
                e.bytes.next_multiple_of(4096) * if e.paired { 2 } else { 1 };
        }
        let mut lanes: [Vec<OpId>; 6] = Default::default();
        let mut link_bytes = [0u64; 4];
        for (id, op) in ops.iter().enumerate() {
            lanes[op.lane.index()].push(id);
            match op.kind {
                OpKind::NvmeRead { .. } => link_bytes[0] += op.bytes,
                OpKind::NvmeWrite { .. } => link_bytes[1] += op.bytes,
                OpKind::H2dParams { .. } | OpKind::H2dAct { .. } => link_bytes[2] += op.bytes,
                OpKind::D2hGrads { .. } | OpKind::D2hAct { .. } => link_bytes[3] += op.bytes,
                _ => {}
            }
        }
        let homes = (0..nb)
            .map(|b| {
                let h = &homes[b];
                [
                    h.params,
                    h.grads,
                    h.state,
                    if b >= 1 && b <= layers {
                        ckpt_tier[b - 1]
                    } else {
                        Tier::Device
                    },
                ]
            })
            .collect();
        Ok(Plan {
            policy: name,
            homes,
            depth,
            shape,
            budgets: input.budgets,
            ops,
            lanes,
            buffers,
            slots,
            extent_groups: bld.extent_groups,
            peak,
            link_bytes,
            swap_each_step,
            swap_on_update,
        })
    }

    /// The first tier whose peak exceeds its budget, if any.
    pub fn first_overflow(&self) -> Option<Tier> {
        Tier::ALL
            .into_iter()
            .find(|t| self.peak[t.index()] > self.budget(*t))
    }

    fn budget(&self, tier: Tier) -> u64 {
        match tier {
            Tier::Device => self.budgets.device,
            Tier::Host => self.budgets.host,
            Tier::Nvme => self.budgets.nvme,
        }
    }

    /// How many tiers are over budget.
    pub fn overflow_count(&self) -> usize {
        Tier::ALL
            .into_iter()
            .filter(|t| self.peak[t.index()] > self.budget(*t))
            .count()
    }

    /// Total bytes over budget, across tiers (0 when it fits).
    pub fn shortfall(&self) -> u64 {
        Tier::ALL
            .into_iter()
            .map(|t| self.peak[t.index()].saturating_sub(self.budget(t)))
            .sum()
    }

    /// Bytes a tier holds for a class, summed over blocks (what `strata plan` reports):
    /// homes and per-step buffers of that class at their largest.
    pub fn bytes_by_class(&self) -> Vec<(TensorClass, [u64; 3])> {
        let mut out: Vec<(TensorClass, [u64; 3])> =
            TensorClass::ALL.iter().map(|&c| (c, [0; 3])).collect();
        for b in &self.buffers {
            let class = if b.name.starts_with("params") {
                TensorClass::Params
            } else if b.name.starts_with("grads") {
                TensorClass::Grads
            } else if b.name.starts_with("adam") {
                TensorClass::Optimizer
            } else if b.name.starts_with("ckpt") {
                TensorClass::Checkpoints
            } else {
                continue;
            };
            let bytes = match b.kind {
                BufKind::Extent { group, side } => {
                    let e = &self.extent_groups[group];
                    if side == ExtentSide::Next {
                        0
                    } else {
                        e.bytes.next_multiple_of(4096) * if e.paired { 2 } else { 1 }
                    }
                }
                _ => b.bytes,
            };
            out.iter_mut().find(|(c, _)| *c == class).expect("listed").1[b.tier.index()] += bytes;
        }
        out
    }

    /// `Ok` when every tier's peak is within its budget; otherwise the refusal, naming
    /// the tier, the shortfall, and what would fit: a lower prefetch depth, a smaller
    /// micro-batch, or another built-in policy.
    pub fn check_fits(&self, input: &PlanInput<'_>) -> Result<(), PlanError> {
        let Some(tier) = self.first_overflow() else {
            return Ok(());
        };
        let mut suggestions = Vec::new();
        let fits = |shape: super::StepShape, policy: &dyn Policy| {
            let alt = PlanInput { shape, ..*input };
            Plan::build(&alt, policy)
                .ok()
                .filter(|p| p.first_overflow().is_none())
        };
        // Same policy family, lower depth.
        if self.depth > 1 {
            for depth in (1..self.depth).rev() {
                let fixed = FixedDepth {
                    name: self.policy.clone(),
                    homes: self.homes.clone(),
                    depth,
                };
                if fits(input.shape, &fixed).is_some() {
                    suggestions.push(format!("prefetch depth {depth} fits (--prefetch {depth})"));
                    break;
                }
            }
        }
        // Smaller micro-batch (with more accumulation, the same tokens per step).
        let mut batch = input.shape.batch;
        while batch > 1 {
            batch /= 2;
            let shape = super::StepShape {
                batch,
                grad_accum: input.shape.grad_accum * (input.shape.batch / batch).max(1),
                ..input.shape
            };
            let fixed = FixedDepth {
                name: self.policy.clone(),
                homes: self.homes.clone(),
                depth: self.depth,
            };
            if fits(shape, &fixed).is_some() {
                suggestions.push(format!(
                    "batch {batch} with --grad-accum {} fits (same tokens per step)",
                    shape.grad_accum
                ));
                break;
            }
        }
        // Other policies.
        let mut others = Vec::new();
        for policy in super::Auto::candidates(input) {
            if policy.name() != self.policy && fits(input.shape, policy.as_ref()).is_some() {
                let name = policy.name();
                let family = name.split('(').next().unwrap_or(&name).to_string();
                if !others.contains(&family) {
                    others.push(family);
                }
            }
        }
        if !others.is_empty() {
            suggestions.push(format!("policies that fit: {}", others.join(", ")));
        }
        if suggestions.is_empty() {
            suggestions.push(format!(
                "raise the {tier} budget to at least {}",
                super::fmt_bytes(self.peak[tier.index()])
            ));
        }
        Err(PlanError::DoesNotFit {
            policy: self.policy.clone(),
            tier,
            need_bytes: self.peak[tier.index()],
            budget_bytes: self.budget(tier),
            suggestions,
        })
    }
}

/// A plan's homes with another prefetch depth (for suggestions).
#[derive(Debug)]
struct FixedDepth {
    name: String,
    homes: Vec<[Tier; 4]>,
    depth: usize,
}

impl Policy for FixedDepth {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn home(&self, input: &PlanInput<'_>, block: usize, class: TensorClass) -> Tier {
        let h = self.homes[block];
        match class {
            TensorClass::Params => h[0],
            TensorClass::Grads => h[1],
            TensorClass::Optimizer => h[2],
            TensorClass::Checkpoints => {
                if matches!(input.block_kind(block), BlockKind::Transformer { .. }) {
                    h[3]
                } else {
                    Tier::Device
                }
            }
        }
    }
    fn prefetch_depth(&self, _: &PlanInput<'_>) -> usize {
        self.depth
    }
}

/// Floating-point operations of each compute operation.
struct Flops {
    embedding: f64,
    layer_forward: f64,
    layer_backward: f64,
    head: f64,
}

fn flops(dims: crate::model::Dims) -> Flops {
    let (n, c, v) = (dims.rows() as f64, dims.width as f64, dims.vocab as f64);
    let (b, t) = (dims.batch as f64, dims.seq as f64);
    // Matrix products: qkv 3c², proj c², fc 4c², proj 4c² -> 12c² multiply-adds per row;
    // attention: two T×T×C products per sequence.
    let fwd = 2.0 * n * 12.0 * c * c + 2.0 * 2.0 * b * t * t * c;
    Flops {
        embedding: n * c,
        layer_forward: fwd,
        // Backward: recompute the forward, then twice the forward's products.
        layer_backward: 3.0 * fwd,
        // The head's forward (n×c×v) and backward (two such products).
        head: 2.0 * n * c * v * 3.0,
    }
}

/// Read-after-write, write-after-read and write-after-write edges, from the accesses.
fn derive_dependencies(ops: &mut [Op], buffers: usize) {
    let mut last_writer: Vec<Option<OpId>> = vec![None; buffers];
    let mut readers: Vec<Vec<OpId>> = vec![Vec::new(); buffers];
    for (id, op) in ops.iter_mut().enumerate() {
        let mut deps = std::mem::take(&mut op.deps);
        for a in op.access.iter().copied() {
            match a {
                Access::Read(b) => {
                    deps.extend(last_writer[b]);
                    readers[b].push(id);
                }
                Access::Write(b) => {
                    deps.extend(last_writer[b]);
                    deps.append(&mut readers[b]);
                    last_writer[b] = Some(id);
                }
            }
        }
        deps.retain(|&d| d != id);
        deps.sort_unstable();
        deps.dedup();
        op.deps = deps;
    }
}

/// Interval allocation of transient buffers into shared slots; persistent buffers get a
/// slot each. Adds the reuse edges.
fn allocate(ops: &mut [Op], buffers: &mut [BufferPlan]) -> Result<Vec<SlotPlan>, PlanError> {
    let mut users: Vec<Vec<OpId>> = vec![Vec::new(); buffers.len()];
    for (id, op) in ops.iter().enumerate() {
        for a in &op.access {
            let (Access::Read(b) | Access::Write(b)) = *a;
            if users[b].last() != Some(&id) {
                users[b].push(id);
            }
        }
    }
    for (b, u) in users.iter().enumerate() {
        if let (Some(&first), Some(&last)) = (u.first(), u.last()) {
            buffers[b].live = Some((first, last));
            if !buffers[b].persistent {
                let first_access = ops[first]
                    .access
                    .iter()
                    .find(|a| matches!(a, Access::Read(x) | Access::Write(x) if *x == b));
                assert!(
                    matches!(first_access, Some(Access::Write(_))),
                    "planner bug: transient buffer {} is read before it is written",
                    buffers[b].name
                );
            }
        }
    }
    let mut slots: Vec<SlotPlan> = Vec::new();
    // Current occupant of each slot.
    let mut occupant: Vec<Option<BufId>> = Vec::new();
    let mut order: Vec<BufId> = (0..buffers.len()).collect();
    order.sort_by_key(|&b| buffers[b].live.map_or(usize::MAX, |l| l.0));
    for b in order {
        let buf = &buffers[b];
        if matches!(buf.kind, BufKind::Extent { .. } | BufKind::Flag) {
            continue;
        }
        if buf.persistent || buf.live.is_none() {
            slots.push(SlotPlan {
                tier: buf.tier,
                kind: buf.kind,
                elems: buf.elems,
                bytes: buf.bytes,
            });
            occupant.push(None);
            buffers[b].slot = Some(slots.len() - 1);
            continue;
        }
        let (first, _) = buf.live.expect("live");
        let free: Vec<usize> = (0..slots.len())
            .filter(|&s| {
                slots[s].tier == buf.tier
                    && slots[s].kind == buf.kind
                    && occupant[s].is_some_and(|o| buffers[o].live.expect("live").1 < first)
            })
            .collect();
        // Share only between buffers of similar size (within 2x), so that a small
        // long-lived buffer never pins a large slot and a large one never inflates a
        // small slot many times over.
        let similar = |s: usize| slots[s].elems <= 2 * buf.elems && 2 * slots[s].elems >= buf.elems;
        let fitting = free
            .iter()
            .copied()
            .filter(|&s| similar(s) && slots[s].elems >= buf.elems)
            .min_by_key(|&s| slots[s].elems);
        let chosen = fitting.or_else(|| {
            free.iter()
                .copied()
                .filter(|&s| similar(s))
                .max_by_key(|&s| slots[s].elems)
        });
        let slot = match chosen {
            Some(s) => {
                let prev = occupant[s].expect("occupied");
                for &u in &users[prev] {
                    if u < first && !ops[first].deps.contains(&u) {
                        ops[first].deps.push(u);
                    }
                }
                if slots[s].elems < buf.elems {
                    slots[s].elems = buf.elems;
                    slots[s].bytes = buf.bytes;
                }
                s
            }
            None => {
                slots.push(SlotPlan {
                    tier: buf.tier,
                    kind: buf.kind,
                    elems: buf.elems,
                    bytes: buf.bytes,
                });
                occupant.push(None);
                slots.len() - 1
            }
        };
        occupant[slot] = Some(b);
        buffers[b].slot = Some(slot);
    }
    for op in ops.iter_mut() {
        op.deps.sort_unstable();
        op.deps.dedup();
    }
    Ok(slots)
}
