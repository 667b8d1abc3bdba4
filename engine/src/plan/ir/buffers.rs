//! The plan's memory: logical buffers ([`BufferPlan`]) and where their bytes are (a slot
//! of the device or host arena, an NVMe extent group, or no memory at all), the physical
//! slots they share ([`SlotPlan`]), the NVMe extent groups ([`Extent`]) and how each
//! keeps its data from step to step, and an operation's [`Access`] to a buffer.
//!
//! Not here: how the planner sizes and places them (`plan/build/`), or how the executor
//! reaches them (`exec`).

use super::ids::{BufId, OpId, SlotId};
use crate::plan::tier::{TensorClass, Tier};

/// Where a logical buffer's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BufKind {
    /// Bytes in the device arena.
    Device,
    /// Bytes in the pinned host arena (4096-aligned, for O_DIRECT).
    Host,
    /// One NVMe extent group, the side an operation touches.
    Extent {
        /// Index into [`Plan::extent_groups`](crate::plan::Plan::extent_groups).
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
    /// (from [`Plan::spares`](crate::plan::Plan::spares)); the block's
    /// [`NvmeOp::Commit`](crate::plan::NvmeOp::Commit) makes it current and the old one a
    /// spare. A failed step leaves every uncommitted block's old extent in place.
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
