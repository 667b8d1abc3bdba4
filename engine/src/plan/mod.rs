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
//! - With several micro-batches per step, [`Schedule`] orders them: each through the
//!   whole model before the next (horizontal), or all through one block before the next
//!   block (vertical: a streamed block is fetched once per pass, not once per
//!   micro-batch).
//!
//! The files: the words every layer uses (`tier.rs`: tiers, tensor classes, budgets;
//! `shape.rs`: the step's shape; `error.rs`), the policies (`policy.rs`, `auto.rs`), the
//! plan itself, readable on its own (`ir/`: ids, buffers, typed operations, [`Plan`]),
//! the planner's stages that make it (`build/`), whether it fits (`fit.rs`) and what it
//! costs (`cost.rs`). This module only names them.

mod auto;
mod build;
mod cost;
mod error;
mod fit;
mod ir;
mod policy;
mod shape;
mod tier;

pub use crate::lane::Lane;
pub use crate::model::OptimizerState;
pub use auto::{Auto, Candidate, Choice};
pub use cost::{CostModel, DEFAULT_SOURCE, Prediction};
pub use error::{PlanError, Shortfall, fmt_bytes};
pub use ir::{
    Access, Binds, BlockHomes, BufId, BufKind, BufferPlan, CommOp, Extent, ExtentKind, ExtentSide,
    GradSource, HostOp, NvmeOp, Op, OpId, OpKind, OpLabel, Plan, SlotId, SlotPlan, StreamOp,
};
pub use policy::{
    AllOnDevice, BuiltinPolicy, CpuOffload, NvmeOffload, ParamOffload, PlanInput, Policy,
    PolicyChoice, Release, UnknownPolicy,
};
pub use shape::{
    GradDtype, GradSpill, Precision, Recompute, Schedule, StepShape, layer_shard_bytes, shard_len,
};
pub use tier::{Budgets, TensorClass, Tier};
