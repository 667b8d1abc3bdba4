//! The executor: runs a [`Plan`](crate::plan::Plan)'s schedule, step after step, on a
//! [`Device`](crate::device::Device).
//!
//! - Memory is allocated once, in [`Executor::new`]: one range of the device arena of the
//!   plan's device peak, one pinned [`HostArena`](crate::memory::HostArena) of its host
//!   peak (registered with io_uring, so NVMe reads land with ReadFixed where the
//!   host-to-device copies start), and the NVMe extents in a
//!   [`TensorStore`](strata_storage::TensorStore). Every buffer of the plan is a range of
//!   one of them, at the offset the plan gave its slot. A step allocates no buffer.
//! - The programs are built once: each block's forward and backward (both variants: with
//!   and without saved activations) from the model family, and the shared update
//!   programs (`crate::model::update`).
//! - A step runs each lane on its thread (module `lanes`; the threads live as long as the
//!   executor, module `workers`). The host lanes (NVMe reads, NVMe writes, the CPU
//!   optimizer) run their operations; the stream lanes (H2D, compute, update, D2H) submit
//!   theirs to the device's streams and go on. An NVMe lane starts a transfer and goes on
//!   to the next whose dependencies are done, keeping up to [`ExecConfig::nvme_in_flight`]
//!   in flight; a transfer is done once it has ended and been verified. Completion is an
//!   event, never a return:
//!   a dependency on another stream is a stream wait on its event; a host operation that
//!   needs a stream's result waits on the event on the host; a stream operation that
//!   needs a host operation's result is submitted only once it is done. The compute lane
//!   runs at most [`ExecConfig::run_ahead`] operations ahead of the device.
//! - Each block's update commits on its own. NVMe-homed data is shadow-paged: the update
//!   writes the block's new state (and working parameters) to spare extents, checksummed,
//!   and the block's commit operation makes them current (a pair of extents swapped at
//!   the step's end only for working parameters a delayed update rewrites). Host- and
//!   device-homed state is updated in place by one operation. Each block counts the
//!   updates applied to it ([`Executor::block_steps`]): a step that fails leaves every
//!   block wholly as before it or wholly updated, and a retry of the step applies no
//!   block's update twice (a block that committed only rewrites its working parameters
//!   from its master copy, in case they were not written).
//! - A failure or a panic on any lane ends the step with an error naming the lane and
//!   the operation; the other lanes stop at their next wait, and the device is drained
//!   before the step returns.
//! - Every operation's start and end are recorded: busy time per lane, the compute
//!   lane's stall, bytes per link as the device and the NVMe tier counted them, a
//!   latency histogram per kind, and a Chrome trace of a step
//!   ([`StepReport::chrome_trace`]).
//!
//! The files, after DeepSpeed's swap_tensor, keep *what* moves apart from *how* bytes
//! move. What: loading and exporting the training state (`state.rs`; AdamW's moments in
//! their format, `moments.rs`), the step and its
//! report (`step.rs`), the lanes and each family of operations they run (`lanes.rs`;
//! `stream.rs`, `host.rs`, `comm.rs`). How: the arenas a buffer lives in (`arenas.rs`),
//! the NVMe tier's extents, checksummed I/O and shadow paging (`extents.rs`), memory lent
//! to host work (`lent.rs`). Around them: the executor's fields and accessors
//! (`executor.rs`), its setup (`setup.rs`, `programs.rs`), the lane threads
//! (`workers.rs`, `scratch.rs`), the state its lanes share during a step
//! (`step_state.rs`), its configuration, errors, reports and test faults (`config.rs`,
//! `error.rs`, `report.rs`, `trace.rs`, `fault.rs`). The whole-model [`Runner`], the
//! [`BlockForward`] that evaluates a block at a time, and the [`calibrate`] of the cost
//! model sit beside it. This module only names them.

mod arenas;
mod block_forward;
mod calibrate;
mod comm;
mod config;
mod error;
mod executor;
mod extents;
mod fault;
mod host;
mod lanes;
mod lent;
mod moments;
mod programs;
mod report;
mod runner;
mod scratch;
mod setup;
mod state;
mod step;
mod step_state;
mod stream;
mod trace;
mod workers;

pub use block_forward::BlockForward;
pub use calibrate::calibrate;
pub use config::{ExecConfig, NVME_IN_FLIGHT, StepParams};
pub use error::ExecError;
pub use executor::Executor;
pub use fault::{Fault, FaultPlan};
pub use report::{OpRecord, StepReport};
pub use runner::Runner;
pub use state::{Moments, TrainingState, load_staging_bytes};
