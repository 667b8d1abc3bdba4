//! The planner: (model, step shape, policy, budgets) -> a static schedule and its memory
//! plan ([`Plan`](crate::plan::Plan)), in stages, each a file that takes what the earlier
//! ones made and returns what it adds:
//!
//! 1. Homes (`frame.rs`): the policy names a tier for every block's tensor classes,
//!    checked against the engine's rules; the step's shape, sizes and the rules the
//!    tiers imply, which every later stage reads.
//! 2. Buffers: persistent homes (device- or host-resident) and NVMe extents, the fixed
//!    buffers (`homes.rs`); the step's transient buffers: device parameter copies per use
//!    group, checkpoints, the saved activations of the blocks the plan keeps, activation
//!    gradients, per-micro-batch gradients, staging, with the positions of their fetches
//!    (`step_buffers.rs`, over the compute sequence of `sequence.rs`). Both add to one
//!    table of buffers (`table.rs`).
//! 3. Emission (`emit.rs`, `emit_update.rs`), in one canonical order, a topological
//!    order of the step: the compute sequence, with fetches placed `depth` compute
//!    operations ahead of their use and gradient copies, updates and write-backs right
//!    after the backward that completes a block's gradients (after a global-norm barrier
//!    when clipping, or spread over the next step's compute with a delayed update). Each
//!    lane runs its operations in this order.
//! 4. Dependencies and memory (`memory.rs`, assembled into the plan by `assemble.rs`):
//!    edges from each operation's reads and writes of logical buffers; transient buffers
//!    of one tier share physical slots when their lifetimes do not overlap, each reuse
//!    adding edges from the previous occupant's users; slots get their offsets in the
//!    tier's arena.
//!
//! Around these stages, `search.rs` ([`Plan::build`](crate::plan::Plan::build)) decides
//! which layer blocks keep their saved activations (and skip recomputing their forward in
//! the backward), whether gradients wait for the norm on NVMe, and whether the first and
//! last blocks' state stays in host memory, planning once per choice it weighs.
//!
//! The planner knows blocks, tensor classes and tiers; what a block computes is the
//! model family's (it is asked for sizes and FLOPs only).
//!
//! Not here: the plan it makes, readable on its own (`plan/ir/`), or whether it fits
//! (`plan/fit.rs`). This module only names the stages.

mod assemble;
mod emit;
mod emit_update;
mod frame;
mod homes;
mod memory;
mod search;
mod sequence;
mod step_buffers;
mod table;
