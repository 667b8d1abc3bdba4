//! The swap-policy API: where every tensor of a training step lives and when it moves.
//!
//! - A [`Policy`] decides, per block and [`TensorClass`], the home [`Tier`] (device,
//!   host, NVMe), how many blocks ahead parameters and checkpoints are prefetched, and
//!   when a device copy of a block's parameters is released.
//! - Built-ins: [`AllOnDevice`], [`CpuOffload`] (ZeRO-Offload), [`ParamOffload`],
//!   [`NvmeOffload`] (ZeRO-Infinity), and [`Auto`], which picks the fastest plan that fits
//!   the budgets by the [`CostModel`].
//! - [`Plan::build`] turns (model, step shape, policy, budgets) into a static schedule:
//!   per lane an ordered list of operations with their dependencies, and a memory plan by
//!   liveness analysis in which buffers whose lifetimes do not overlap share memory. Its
//!   peak bytes per tier are known before anything is allocated, and [`Plan::check_fits`]
//!   refuses a plan that does not fit, naming the tier, the shortfall and what would fit.
//! - Per layer block the plan keeps the activations its backward needs (saved by the
//!   forward, on the device until the backward) or recomputes them from the block's
//!   input checkpoint, as [`Recompute`] asks: keep all when the device budget allows,
//!   recompute more blocks as it tightens ([`Plan::kept`]).

mod build;
mod cost;
mod fit;
mod memory;
mod policy;

use std::fmt;

pub use crate::lane::Lane;
pub use build::{
    Access, Binds, BufId, BufKind, BufferPlan, Extent, ExtentKind, ExtentSide, GradSource, Op,
    OpId, OpKind, OpLabel, Plan, SlotId, SlotPlan,
};
pub use cost::{CostModel, Prediction};
pub(crate) use policy::EdgesOnHost;
pub use policy::{
    AllOnDevice, BuiltinPolicy, CpuOffload, NvmeOffload, ParamOffload, PlanInput, Policy,
    PolicyChoice, Release, UnknownPolicy,
};

use crate::model::{BlockKind, Dtype, Model, Target};

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

/// A tier of strata's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// The accelerator's memory (on the CPU device, host memory counted against the
    /// device budget).
    Device,
    /// Host RAM.
    Host,
    /// The NVMe tier (swap files through io_uring).
    Nvme,
}

impl Tier {
    /// Every tier, in order.
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Nvme];

    /// Position in [`Tier::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Nvme => "nvme",
        })
    }
}

/// The kinds of tensor a block owns during a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorClass {
    /// The working copy of the parameters the forward and backward read (fp32, bf16 or
    /// fp16).
    Params,
    /// Gradients, f32. They leave the device as each block's backward ends, unless the
    /// optimizer state lives on the device.
    Grads,
    /// fp32 master parameters with AdamW's m and v: 12 bytes per parameter.
    Optimizer,
    /// The block's input saved by the forward for the backward's recomputation.
    Checkpoints,
}

impl TensorClass {
    /// Every class.
    pub const ALL: [TensorClass; 4] = [
        TensorClass::Params,
        TensorClass::Grads,
        TensorClass::Optimizer,
        TensorClass::Checkpoints,
    ];
}

impl fmt::Display for TensorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TensorClass::Params => "params",
            TensorClass::Grads => "grads",
            TensorClass::Optimizer => "optimizer",
            TensorClass::Checkpoints => "checkpoints",
        })
    }
}

/// The dtype of the working parameters (master parameters and optimizer state are always
/// fp32).
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

/// Bytes each tier may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budgets {
    /// Device memory.
    pub device: u64,
    /// Host memory for strata's buffers (homes, staging, gradients).
    pub host: u64,
    /// Space on the NVMe tier (0: no NVMe tier).
    pub nvme: u64,
}

impl Budgets {
    /// Budgets of `device`, `host` and `nvme` bytes.
    pub fn new(device: u64, host: u64, nvme: u64) -> Self {
        Budgets { device, host, nvme }
    }
}

/// Which layer blocks recompute their forward in the backward, from their input
/// checkpoint, instead of keeping the activations their backward reads (the family's
/// saved activations, on the device from the block's forward to its backward).
/// Results are bit-identical whatever is chosen: only memory and time differ. How auto
/// chooses: [`Plan::build`].
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
    /// Keep every layer's activations when the device budget allows; else as many as
    /// fit, the others recomputing.
    #[default]
    Auto,
    /// Every layer recomputes its forward in the backward: least device memory (only
    /// the checkpoints are kept).
    All,
    /// No layer recomputes: every layer's activations are kept, and a plan they do not
    /// fit the device budget of is refused.
    None,
}

impl fmt::Display for Recompute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Recompute::Auto => "auto",
            Recompute::All => "all",
            Recompute::None => "none",
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
/// [`Plan::build`].
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
    /// Whether gradients wait for the global norm on NVMe.
    pub grad_spill: GradSpill,
    /// Processes training together (ZeRO-3 data parallelism, 1: alone). Each rank runs
    /// `grad_accum` micro-batches of the step and owns one shard of every block's
    /// parameters, gradients and optimizer state ([`Plan::shard_len`]).
    pub ranks: usize,
    /// With ranks: whether collectives of device-resident data (all-on-device's
    /// gradients and parameters) run over device memory ([`Device::all_gather`], NCCL on
    /// a GPU) rather than staged through host memory (copies out, the host collective,
    /// copies in). Ignored alone.
    ///
    /// [`Device::all_gather`]: crate::device::DeviceOps::all_gather
    pub device_collectives: bool,
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
            needs_global_norm: false,
            delayed_update: false,
            target: Target::Cpu,
            recompute: Recompute::Auto,
            grad_spill: GradSpill::Auto,
            ranks: 1,
            device_collectives: true,
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

    /// The same step spilling gradients as `grad_spill` says.
    pub fn spilling(self, grad_spill: GradSpill) -> Self {
        StepShape { grad_spill, ..self }
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
}

/// The fastest of the built-in plans that fits the budgets, by the cost model.
#[derive(Debug, Clone, Default)]
pub struct Auto {
    /// The rates the choice is predicted with.
    pub cost: CostModel,
}

/// What [`Auto::choose`] picked, its plan, and every candidate it considered.
pub type Choice = (Box<dyn Policy>, Plan, Vec<Candidate>);

/// One candidate [`Auto`] considered.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The policy's name.
    pub policy: String,
    /// Peak bytes per tier.
    pub peak: [u64; 3],
    /// Whether it fits the budgets (else the first tier it overflows).
    pub fits: Result<(), Tier>,
    /// Predicted step time.
    pub predicted: Prediction,
}

impl Auto {
    /// The candidates, in order of preference when predicted equal: everything on the
    /// device first, then less and less resident.
    pub fn candidates(input: &PlanInput<'_>) -> Vec<Box<dyn Policy>> {
        let mut out: Vec<Box<dyn Policy>> = vec![Box::new(AllOnDevice), Box::new(CpuOffload)];
        let ckpt_tiers: &[Tier] = if input.budgets.nvme > 0 {
            &[Tier::Device, Tier::Host, Tier::Nvme]
        } else {
            &[Tier::Device, Tier::Host]
        };
        for depth in [2, 1, 3] {
            for &checkpoints in &ckpt_tiers[..2] {
                out.push(Box::new(ParamOffload { depth, checkpoints }));
            }
        }
        if input.budgets.nvme > 0 {
            for depth in [2, 1, 3, 4] {
                for &checkpoints in ckpt_tiers {
                    out.push(Box::new(NvmeOffload { depth, checkpoints }));
                }
            }
        }
        out
    }

    /// Plans every candidate, and returns the fastest that fits with every candidate's
    /// figures; the error is the best candidate's refusal (with its suggestions) when
    /// none fits.
    pub fn choose(&self, input: &PlanInput<'_>) -> Result<Choice, PlanError> {
        let mut best: Option<(Box<dyn Policy>, Plan, f64)> = None;
        // The refusal to report when none fits: the candidate closest to fitting, with
        // the fewest tiers over budget, and among those the most offloaded (the last).
        let mut closest: Option<Plan> = None;
        let mut seen = Vec::new();
        let mut first_error = None;
        for policy in Self::candidates(input) {
            let plan = match Plan::build(input, policy.as_ref()) {
                Ok(plan) => plan,
                Err(e) => {
                    first_error.get_or_insert(e);
                    continue;
                }
            };
            let predicted = self.cost.predict(&plan);
            let fits = plan.first_overflow();
            seen.push(Candidate {
                policy: plan.policy.clone(),
                peak: plan.peak,
                fits: fits.map_or(Ok(()), Err),
                predicted,
            });
            if fits.is_some() {
                if closest
                    .as_ref()
                    .is_none_or(|c| plan.overflow_count() <= c.overflow_count())
                {
                    closest = Some(plan);
                }
            } else if best
                .as_ref()
                .is_none_or(|(_, _, t)| predicted.step_seconds < *t * 0.999)
            {
                best = Some((policy, plan, predicted.step_seconds));
            }
        }
        match (best, closest) {
            (Some((policy, plan, _)), _) => Ok((policy, plan, seen)),
            (None, Some(plan)) => Err(plan.check_fits(input).expect_err("no candidate fits")),
            (None, None) => Err(first_error.unwrap_or(PlanError::Invalid(
                "no built-in policy can plan this model".into(),
            ))),
        }
    }
}

/// Why a plan cannot be built or run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// The policy asked for something the engine cannot do.
    #[error("policy {policy}: {reason}")]
    BadPolicy {
        /// The policy's name.
        policy: String,
        /// What is wrong, naming the block.
        reason: String,
    },
    /// The plan needs more of one or more tiers than their budgets.
    #[error(
        "plan {policy} does not fit: {tiers}{suggestions}",
        tiers = short.iter().map(ToString::to_string).collect::<Vec<_>>().join(", and "),
        suggestions = if suggestions.is_empty() { String::new() } else { format!("; {}", suggestions.join("; ")) }
    )]
    DoesNotFit {
        /// The policy's name.
        policy: String,
        /// Every tier over budget, fastest tier first.
        short: Vec<Shortfall>,
        /// What would fit instead.
        suggestions: Vec<String>,
    },
    /// The step cannot be planned at all (bad shape).
    #[error("{0}")]
    Invalid(String),
}

/// A tier a plan needs more of than its budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shortfall {
    /// The tier.
    pub tier: Tier,
    /// Bytes the plan needs there.
    pub need_bytes: u64,
    /// The budget.
    pub budget_bytes: u64,
}

impl fmt::Display for Shortfall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the {} tier needs {} but the budget is {} ({} short)",
            self.tier,
            fmt_bytes(self.need_bytes),
            fmt_bytes(self.budget_bytes),
            fmt_bytes(self.need_bytes.saturating_sub(self.budget_bytes))
        )
    }
}

/// Bytes in binary units, for messages.
pub fn fmt_bytes(bytes: u64) -> String {
    strata_storage::format_bytes(bytes)
}
