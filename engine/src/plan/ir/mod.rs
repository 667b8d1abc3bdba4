//! The plan's intermediate representation: what the planner makes and the executor, the
//! cost model and the reports read. Typed ids (`ids.rs`), buffers, slots and extents
//! (`buffers.rs`), operations typed by the lanes that run them (`ops.rs`), and the
//! [`Plan`] with its read-only queries (`schedule.rs`).
//!
//! Not here: how a plan is made (`plan/build/`).

mod buffers;
mod ids;
mod ops;
mod schedule;

pub use buffers::{Access, BufKind, BufferPlan, Extent, ExtentKind, ExtentSide, SlotPlan};
pub use ids::{BufId, OpId, SlotId};
pub use ops::{Binds, CommOp, GradSource, HostOp, NvmeOp, Op, OpKind, OpLabel, StreamOp};
pub use schedule::{BlockHomes, Plan};
