//! Swap policies: the [`Policy`] trait a user implements, the built-ins ([`AllOnDevice`],
//! [`CpuOffload`], [`ParamOffload`], [`NvmeOffload`]) and [`BuiltinPolicy`], the one place
//! their names are written (the command line's `--policy`, reports, benchmarks all go
//! through it).
//!
//! Not here: [`super::Auto`], which plans every built-in and picks one, and the planner.

use std::fmt;
use std::str::FromStr;

use super::cost::CostModel;
use super::shape::StepShape;
use super::tier::{Budgets, TensorClass, Tier};
use crate::model::{BlockKind, Model};

/// When a device copy of a block's streamed parameters is released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// After each use (the forward, then fetched again for the backward): least memory.
    AfterUse,
    /// Kept from the forward's fetch to the backward's use: one fetch per step.
    AfterBackward,
}

/// What a policy is asked about: the model and the step.
#[derive(Debug, Clone, Copy)]
pub struct PlanInput<'a> {
    /// The model.
    pub model: &'a Model,
    /// The step.
    pub shape: StepShape,
    /// The budgets.
    pub budgets: Budgets,
    /// The rates the planner weighs its choices by where the budgets leave several
    /// (whether a block's activations are offloaded or recomputed, under
    /// [`Recompute::Auto`](super::Recompute::Auto)).
    pub cost: CostModel,
}

impl<'a> PlanInput<'a> {
    /// A step of `shape` of `model` under `budgets`, weighed by the default rates.
    pub fn new(model: &'a Model, shape: StepShape, budgets: Budgets) -> Self {
        PlanInput {
            model,
            shape,
            budgets,
            cost: CostModel::default(),
        }
    }

    /// The same input weighed by the rates of `cost`.
    pub fn with_cost(self, cost: CostModel) -> Self {
        PlanInput { cost, ..self }
    }

    /// Blocks of the model.
    pub fn block_count(&self) -> usize {
        self.model.blocks().len()
    }

    /// What block `block` computes.
    pub fn block_kind(&self, block: usize) -> BlockKind {
        self.model.blocks()[block].kind
    }
}

/// A swap policy: where each block's tensors live and how far ahead they move.
///
/// The planner asks [`Policy::home`] for every block and class, then builds the schedule
/// (see [`Plan::build`](super::Plan::build)). A policy only decides; it never allocates or moves anything,
/// so a user policy is a few lines (see `examples/custom_policy.rs`).
///
/// Rules the planner enforces, with an error naming the block: gradients live on the
/// device or the host, never on NVMe; optimizer state on the device needs gradients and
/// parameters there too (the device runs AdamW then).
pub trait Policy: fmt::Debug + Send + Sync {
    /// A short name for reports (`nvme-offload(depth 2)`).
    fn name(&self) -> String;
    /// The home tier of `class` of `block`.
    fn home(&self, input: &PlanInput<'_>, block: usize, class: TensorClass) -> Tier;
    /// How many blocks ahead of the compute lane parameters and checkpoints are fetched
    /// (at least 1).
    fn prefetch_depth(&self, _input: &PlanInput<'_>) -> usize {
        2
    }
    /// When a streamed block's device copy of parameters is released.
    fn release(&self, _input: &PlanInput<'_>, _block: usize) -> Release {
        Release::AfterUse
    }
    /// Whether the planner may keep the first and last blocks' parameters and optimizer
    /// state (the embedding's and the head's) in host memory where [`Policy::home`] puts
    /// them on NVMe, when the plan then fits every budget without spilling gradients
    /// ([`GradSpill`](super::GradSpill)). Their NVMe traffic cannot hide under compute: the first block is
    /// read before the step's first operation, and the embedding's update follows the
    /// step's last. See [`Plan::build`](super::Plan::build). Default: no.
    fn resident_edges(&self, _input: &PlanInput<'_>) -> bool {
        false
    }
    /// Which built-in policy this is, if one (a user's policy: `None`).
    fn builtin(&self) -> Option<BuiltinPolicy> {
        None
    }
}

/// `policy`, with the first and last blocks' optimizer state in host memory and their
/// parameters on `params` (the host, or the CPU device, whose optimizer then writes them
/// in place) where it puts them on NVMe ([`Policy::resident_edges`]); named as `policy`.
/// With `keep_first` (parameters on the host), the first block's device copy of
/// parameters, fetched for the embedding's forward, is also the one a tied output head
/// reads (released after the micro-batch's backward, [`Release::AfterBackward`]),
/// instead of a second copy of the whole embedding fetched for the head.
#[derive(Debug)]
pub(crate) struct EdgesOnHost<'a> {
    pub policy: &'a dyn Policy,
    pub params: Tier,
    pub keep_first: bool,
}

impl Policy for EdgesOnHost<'_> {
    fn name(&self) -> String {
        self.policy.name()
    }
    fn builtin(&self) -> Option<BuiltinPolicy> {
        self.policy.builtin()
    }
    fn home(&self, input: &PlanInput<'_>, block: usize, class: TensorClass) -> Tier {
        let tier = self.policy.home(input, block, class);
        let edge = block == 0 || block + 1 == input.block_count();
        match class {
            TensorClass::Params if edge && tier == Tier::Nvme => self.params,
            TensorClass::Optimizer if edge && tier == Tier::Nvme => Tier::Host,
            _ => tier,
        }
    }
    fn prefetch_depth(&self, input: &PlanInput<'_>) -> usize {
        self.policy.prefetch_depth(input)
    }
    fn release(&self, input: &PlanInput<'_>, block: usize) -> Release {
        if block == 0 && self.keep_first {
            return Release::AfterBackward;
        }
        self.policy.release(input, block)
    }
}

/// Everything on the device: parameters, gradients, optimizer state and checkpoints.
/// The fastest plan when it fits; the reference the others are compared with.
#[derive(Debug, Clone, Copy, Default)]
pub struct AllOnDevice;

impl Policy for AllOnDevice {
    fn name(&self) -> String {
        BuiltinPolicy::AllOnDevice.to_string()
    }
    fn builtin(&self) -> Option<BuiltinPolicy> {
        Some(BuiltinPolicy::AllOnDevice)
    }
    fn home(&self, _: &PlanInput<'_>, _: usize, _: TensorClass) -> Tier {
        Tier::Device
    }
}

/// ZeRO-Offload: working parameters and checkpoints on the device; master parameters
/// and optimizer state on the host, updated by the CPU AdamW as each block's gradients
/// arrive.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuOffload;

impl Policy for CpuOffload {
    fn name(&self) -> String {
        BuiltinPolicy::CpuOffload.to_string()
    }
    fn builtin(&self) -> Option<BuiltinPolicy> {
        Some(BuiltinPolicy::CpuOffload)
    }
    fn home(&self, _: &PlanInput<'_>, _: usize, class: TensorClass) -> Tier {
        match class {
            TensorClass::Params | TensorClass::Checkpoints => Tier::Device,
            TensorClass::Grads | TensorClass::Optimizer => Tier::Host,
        }
    }
}

/// [`CpuOffload`], and the working parameters streamed from the host block by block,
/// `depth` blocks ahead; checkpoints on `checkpoints` (the device or the host).
#[derive(Debug, Clone, Copy)]
pub struct ParamOffload {
    /// Prefetch depth in blocks.
    pub depth: usize,
    /// Where activation checkpoints go.
    pub checkpoints: Tier,
}

impl Default for ParamOffload {
    fn default() -> Self {
        ParamOffload {
            depth: 2,
            checkpoints: Tier::Device,
        }
    }
}

impl Policy for ParamOffload {
    fn name(&self) -> String {
        format!("{}(depth {})", BuiltinPolicy::ParamOffload, self.depth)
    }
    fn builtin(&self) -> Option<BuiltinPolicy> {
        Some(BuiltinPolicy::ParamOffload)
    }
    fn home(&self, _: &PlanInput<'_>, _: usize, class: TensorClass) -> Tier {
        match class {
            TensorClass::Params | TensorClass::Grads | TensorClass::Optimizer => Tier::Host,
            TensorClass::Checkpoints => self.checkpoints,
        }
    }
    fn prefetch_depth(&self, _: &PlanInput<'_>) -> usize {
        self.depth
    }
}

/// ZeRO-Infinity: working parameters, master parameters and optimizer state on NVMe,
/// read ahead `depth` blocks into host staging and on to the device; gradients to the
/// host; checkpoints on `checkpoints` (device, host or NVMe).
#[derive(Debug, Clone, Copy)]
pub struct NvmeOffload {
    /// Prefetch depth in blocks.
    pub depth: usize,
    /// Where activation checkpoints go.
    pub checkpoints: Tier,
}

impl Default for NvmeOffload {
    fn default() -> Self {
        NvmeOffload {
            depth: 2,
            checkpoints: Tier::Host,
        }
    }
}

impl Policy for NvmeOffload {
    fn name(&self) -> String {
        format!("{}(depth {})", BuiltinPolicy::NvmeOffload, self.depth)
    }
    fn builtin(&self) -> Option<BuiltinPolicy> {
        Some(BuiltinPolicy::NvmeOffload)
    }
    fn resident_edges(&self, _: &PlanInput<'_>) -> bool {
        true
    }
    fn home(&self, _: &PlanInput<'_>, _: usize, class: TensorClass) -> Tier {
        match class {
            TensorClass::Params | TensorClass::Optimizer => Tier::Nvme,
            TensorClass::Grads => Tier::Host,
            TensorClass::Checkpoints => self.checkpoints,
        }
    }
    fn prefetch_depth(&self, _: &PlanInput<'_>) -> usize {
        self.depth
    }
}

/// The built-in policies, by the names the command line gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum)]
pub enum BuiltinPolicy {
    /// [`AllOnDevice`].
    AllOnDevice,
    /// [`CpuOffload`].
    CpuOffload,
    /// [`ParamOffload`].
    ParamOffload,
    /// [`NvmeOffload`].
    NvmeOffload,
}

impl BuiltinPolicy {
    /// Every built-in, from the most resident to the least.
    pub const ALL: [BuiltinPolicy; 4] = [
        BuiltinPolicy::AllOnDevice,
        BuiltinPolicy::CpuOffload,
        BuiltinPolicy::ParamOffload,
        BuiltinPolicy::NvmeOffload,
    ];

    /// The name the command line and reports use.
    pub const fn name(self) -> &'static str {
        match self {
            BuiltinPolicy::AllOnDevice => "all-on-device",
            BuiltinPolicy::CpuOffload => "cpu-offload",
            BuiltinPolicy::ParamOffload => "param-offload",
            BuiltinPolicy::NvmeOffload => "nvme-offload",
        }
    }

    /// The policy, prefetching `depth` blocks ahead where it streams, with checkpoints
    /// where its default puts them.
    pub fn policy(self, depth: usize) -> Box<dyn Policy> {
        match self {
            BuiltinPolicy::AllOnDevice => Box::new(AllOnDevice),
            BuiltinPolicy::CpuOffload => Box::new(CpuOffload),
            BuiltinPolicy::ParamOffload => Box::new(ParamOffload {
                depth,
                ..ParamOffload::default()
            }),
            BuiltinPolicy::NvmeOffload => Box::new(NvmeOffload {
                depth,
                ..NvmeOffload::default()
            }),
        }
    }
}

impl fmt::Display for BuiltinPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is not a built-in policy's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown policy '{0}' (expected one of {names})", names = PolicyChoice::names().join(", "))]
pub struct UnknownPolicy(pub String);

impl FromStr for BuiltinPolicy {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        BuiltinPolicy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| UnknownPolicy(s.to_string()))
    }
}

/// What `--policy` asks for: the planner's choice ([`super::Auto`]) or a built-in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum PolicyChoice {
    /// The fastest built-in plan that fits ([`super::Auto`]).
    #[default]
    Auto,
    /// This built-in.
    Builtin(BuiltinPolicy),
}

impl PolicyChoice {
    /// Every choice's name: `auto`, then the built-ins'.
    pub fn names() -> Vec<&'static str> {
        std::iter::once("auto")
            .chain(BuiltinPolicy::ALL.map(BuiltinPolicy::name))
            .collect()
    }
}

impl fmt::Display for PolicyChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicyChoice::Auto => f.write_str("auto"),
            PolicyChoice::Builtin(p) => p.fmt(f),
        }
    }
}

impl FromStr for PolicyChoice {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "auto" {
            Ok(PolicyChoice::Auto)
        } else {
            s.parse().map(PolicyChoice::Builtin)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_match_the_policies_names() {
        for p in BuiltinPolicy::ALL {
            assert_eq!(p.to_string().parse::<BuiltinPolicy>(), Ok(p));
            assert_eq!(p.policy(2).builtin(), Some(p));
            assert!(p.policy(2).name().starts_with(p.name()));
            let choice = PolicyChoice::Builtin(p);
            assert_eq!(choice.to_string().parse::<PolicyChoice>(), Ok(choice));
            let value = <BuiltinPolicy as clap::ValueEnum>::to_possible_value(&p).unwrap();
            assert_eq!(value.get_name(), p.name(), "clap's name is the policy's");
        }
        assert_eq!("auto".parse::<PolicyChoice>(), Ok(PolicyChoice::Auto));
        let err = "zero-3".parse::<PolicyChoice>().unwrap_err().to_string();
        assert!(
            err.contains("zero-3") && err.contains("nvme-offload"),
            "{err}"
        );
    }
}
