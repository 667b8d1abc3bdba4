//! The executor: runs a [`Plan`]'s schedule, step after step, on a [`Device`].
//!
//! - Memory is allocated once, in [`Executor::new`]: one range of the device arena of the
//!   plan's device peak, one pinned [`HostArena`] of its host peak (registered with
//!   io_uring, so NVMe reads land with ReadFixed where the host-to-device copies start),
//!   and the NVMe extents in a [`TensorStore`]. Every buffer of the plan is a range of
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

mod calibrate;
mod lanes;
mod runner;
mod trace;
mod workers;

pub use calibrate::calibrate;
pub use runner::Runner;
pub use trace::OpRecord;

use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use hdrhistogram::Histogram;
use strata_comm::{Collective, CommError, Solo};
use strata_kernels::adamw::{AdamError, GradStats};
use strata_kernels::ops::Cpu;
use strata_kernels::program::{Dtype, read_stats};
use strata_storage::{
    AlignedBuf, BackendChoice, ExtentId, IoStats, Pending, StorageError, StoreConfig, TensorStore,
};

use crate::device::{
    CpuDevice, CpuDeviceConfig, Device, DeviceRange, Event, Program, cast, cast_mut,
};
use crate::error::EngineError;
use crate::lane::Lane;
use crate::memory::{DeviceBuffer, HostArena, HostRange};
use crate::model::{IGNORE_TARGET, Model, ModelError, Pass, update};
use crate::plan::{
    BufId, BufKind, ExtentKind, ExtentSide, OpId, OpKind, Plan, Precision, SlotId, StreamOp, Tier,
};

/// Why a step (or setting up the executor) failed.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// An NVMe transfer failed; blocks that committed before it keep their update
    /// ([`Executor::block_steps`]), the others are as before the step.
    #[error("{op}: {source}")]
    Storage {
        /// The operation.
        op: String,
        /// The error from the tier.
        source: StorageError,
    },
    /// The device failed an operation (a kernel, a copy, an ordering violation).
    #[error("{op}: {source}")]
    Device {
        /// The operation.
        op: String,
        /// The device's error.
        source: EngineError,
    },
    /// The optimizer refused its inputs.
    #[error("{op}: {source}")]
    Adam {
        /// The operation.
        op: String,
        /// The error.
        source: AdamError,
    },
    /// Inputs that do not match the plan (batch shape, parameter buffers).
    #[error("{0}")]
    BadInput(String),
    /// Setting up the NVMe tier failed.
    #[error("NVMe tier: {0}")]
    Tier(StorageError),
    /// A lane panicked.
    #[error("the {lane} lane panicked in {op}: {message}")]
    Panicked {
        /// The lane.
        lane: Lane,
        /// The operation it was running.
        op: String,
        /// The panic's message.
        message: String,
    },
    /// The model refused something (a shape, a program).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A lane stopped because another failed (never the error a step returns: that is
    /// the other lane's).
    #[error("aborted after another lane failed")]
    Aborted,
    /// A failure injected by [`Executor::fail_next_at`].
    #[error("injected failure in {op}")]
    Injected {
        /// The operation.
        op: String,
    },
    /// The lanes' threads could not be started.
    #[error("starting the lane threads: {0}")]
    Threads(String),
    /// A collective among ranks failed (another rank aborted, a timeout, MPI).
    #[error("{op}: {source}")]
    Comm {
        /// The operation.
        op: String,
        /// The error from the group.
        source: CommError,
    },
}

/// AdamW's first and second moments, one buffer per block.
pub type Moments<'a> = (&'a [Vec<f32>], &'a [Vec<f32>]);

/// Master parameters, m and v, one f32 buffer per block each.
pub type TrainingState = (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<Vec<f32>>);

/// What [`Executor::load`] and [`Executor::load_shard`] write.
#[derive(Clone, Copy)]
enum Source<'a> {
    /// Whole blocks, of which each rank takes its shards.
    Whole {
        params: &'a [Vec<f32>],
        moments: Option<Moments<'a>>,
    },
    /// This rank's shards.
    Shard(&'a TrainingState),
    /// Whole blocks, each made when it is loaded (zero moments), so that no more than
    /// one block's parameters are held at once.
    Blocks(&'a dyn Fn(usize) -> Vec<f32>),
}

/// Extent transfers an NVMe lane keeps in flight by default ([`ExecConfig::nvme_in_flight`]):
/// two, so one extent's checksum and its last chunks overlap the next extent's reads or
/// writes. `strata bench nvme` measures the tier with the same number.
pub const NVME_IN_FLIGHT: usize = 2;

/// How the executor sets up its NVMe tier and its lanes.
#[derive(Debug, Clone)]
pub struct ExecConfig {
    /// Folders for swap files (several = striped over drives). Needed when the plan has
    /// NVMe extents.
    pub nvme_dirs: Vec<PathBuf>,
    /// I/O backend.
    pub io: BackendChoice,
    /// Fault injection (tests).
    pub faults: Option<strata_storage::FaultPlan>,
    /// Threads for the CPU optimizer's kernels.
    pub optimizer_threads: usize,
    /// How many operations the compute lane may have submitted and not yet completed
    /// (at least 1).
    pub run_ahead: usize,
    /// How many extent transfers each NVMe lane keeps in flight (at least 1): the next
    /// one starts, when its dependencies are done, while the last is still moving or
    /// being verified, so the drive's queue does not drain between extents. Default
    /// [`NVME_IN_FLIGHT`].
    pub nvme_in_flight: usize,
    /// Chaos (tests): when set, the host lanes wait a seeded random 0 to 2 ms before
    /// each operation, and a CPU device opened by [`Executor::on_cpu`] delays its stream
    /// operations the same way (see `crate::device`'s CPU device). The default is
    /// `STRATA_DEVICE_CHAOS`.
    pub chaos: Option<u64>,
    /// Fault injection (tests): the operation with this label (`adamw 2`, `fwd 1`)
    /// panics when its lane reaches it, as a bug in it would.
    pub panic_at: Option<String>,
    /// The group of ranks training together; its size must be the plan's
    /// `shape.ranks`. None: this process alone.
    pub comm: Option<Arc<dyn Collective>>,
    /// Tests: fill the host arena with 0xff bytes (NaN as f32) when it is made, so that
    /// a read of host memory that nothing wrote shows in the results.
    pub poison_host: bool,
}

impl Default for ExecConfig {
    fn default() -> Self {
        ExecConfig {
            nvme_dirs: vec![std::env::temp_dir()],
            io: BackendChoice::Auto,
            faults: None,
            optimizer_threads: strata_kernels::parallel::max_threads(),
            run_ahead: 4,
            nvme_in_flight: NVME_IN_FLIGHT,
            chaos: crate::device::chaos_from_env(),
            panic_at: None,
            comm: None,
            poison_host: false,
        }
    }
}

impl ExecConfig {
    /// The defaults, with swap files in `dirs`.
    pub fn with_nvme(dirs: Vec<PathBuf>) -> Self {
        ExecConfig {
            nvme_dirs: dirs,
            ..ExecConfig::default()
        }
    }
}

/// What one step needs beyond the plan: the update's hyper-parameters.
#[derive(Debug, Clone, Copy)]
pub struct StepParams {
    /// AdamW (the learning rate of this step included).
    pub adam: strata_kernels::adamw::AdamW,
    /// Global-norm clipping threshold (0: off). Needs a plan built with
    /// `needs_global_norm`.
    pub clip: f64,
    /// The loss is multiplied by this before the backward (fp16), and the gradients
    /// divided by it in the update.
    pub loss_scale: f32,
}

/// What one step did.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// Mean loss over the step's tokens (before loss scaling).
    pub loss: f32,
    /// Global gradient norm (after unscaling, before clipping).
    pub grad_norm: f64,
    /// Whether the update was skipped (non-finite gradients).
    pub skipped: bool,
    /// Whether this call applied an update (not with a delayed update's first step, nor
    /// when skipped).
    pub updated: bool,
    /// Wall time.
    pub seconds: f64,
    /// Busy seconds per lane ([`Lane::index`]).
    pub lane_busy: [f64; Lane::COUNT],
    /// Seconds the compute lane's device stream sat idle between its operations.
    pub compute_stall: f64,
    /// Bytes this step moved over NVMe read, NVMe write, H2D and D2H, as the NVMe tier
    /// and the device's copies counted them.
    pub link_bytes: [u64; 4],
    /// NVMe chunks this step moved through io_uring's registered (fixed) buffers, and
    /// through plain ones.
    pub fixed_chunks: [u64; 2],
    /// Start and end of every operation the run ran, lane by lane, each lane's in plan
    /// order.
    pub records: Vec<OpRecord>,
}

impl StepReport {
    /// Compute-lane stall as a fraction of the step.
    pub fn stall_fraction(&self) -> f64 {
        if self.seconds > 0.0 {
            self.compute_stall / self.seconds
        } else {
            0.0
        }
    }
}

/// The programs of every block, built once.
struct Programs {
    /// Per block, its program of each [`Pass`] (by [`Pass::index`]).
    compute: Vec<[Program; 4]>,
    /// AdamW on the device, for blocks whose optimizer state lives there.
    update: Vec<Option<Program>>,
    stats: Vec<Program>,
    accumulate: Vec<Program>,
}

/// The outcome of the global norm (or of none: 1, false).
#[derive(Debug, Clone, Copy)]
struct Norm {
    norm: f64,
    coef: f32,
    skip: bool,
}

/// Per-step shared values.
struct StepShared<'a> {
    stamp: u64,
    /// Each operation's dependencies in this run (skipped operations replaced by theirs).
    deps: &'a [Vec<OpId>],
    params: StepParams,
    /// The positions whose loss counts in this step (the loss is their mean).
    counted_targets: usize,
    adam_step: u64,
    /// The loss scale of the gradients the update applies (with a delayed update, the
    /// last step's).
    update_loss_scale: f32,
    start: Instant,
    /// A timed event recorded on the compute stream at the start (a GPU times its
    /// operations against it).
    origin: Option<Event>,
    /// The operation that fails on purpose in this run ([`Executor::fail_next_at`]).
    fail_at: Option<(usize, Fault)>,
}

/// Per-operation state of the step being run.
struct OpState {
    /// The stamp of the step that issued it: a host operation when done, a stream
    /// operation when submitted.
    issued: AtomicU64,
    /// A stream operation's completion (none when it had nothing to do).
    event: Mutex<Option<Event>>,
    /// A stream operation's start, on a GPU (timing only).
    start: Mutex<Option<Event>>,
    /// Start and end, nanoseconds after the step began (0, 0: not run).
    span: [AtomicU64; 2],
}

/// Runs a plan on a device, step after step.
pub struct Executor {
    model: Model,
    plan: Plan,
    device: Device,
    host: HostArena,
    /// The plan's device memory (kept allocated).
    device_mem: DeviceBuffer,
    programs: Programs,
    cpu: Cpu,
    optimizer_threads: usize,
    run_ahead: usize,
    nvme_in_flight: usize,
    chaos: Option<u64>,
    panic_at: Option<String>,
    fail_at: Option<(usize, Fault)>,
    /// The positions whose loss counts in the last step given (its loss is their mean).
    counted_targets: usize,
    store: Option<TensorStore>,
    /// Where each NVMe extent group's data is, and the spares.
    extents: Mutex<ExtentTable>,
    /// Which side of each pair is current: A when even.
    generation: u64,
    /// Steps applied to every block (AdamW's step counter after a step that succeeded).
    steps: u64,
    /// Per block, the updates applied to its optimizer state: `steps`, or `steps + 1`
    /// for a block that committed the update of a step that then failed (a retry does
    /// not apply it again, and rewrites its working parameters from the master copy).
    applied: Vec<AtomicU64>,
    /// Dependencies for a whole step, a step without the update, and the update alone:
    /// a skipped operation's dependents wait for its own dependencies instead, so that
    /// orderings through it (slot reuse) still hold.
    deps: [Vec<Vec<OpId>>; 3],
    /// Each logical buffer's physical slot; delayed updates exchange pairs of them.
    slot_of: Vec<Option<SlotId>>,
    /// Delayed update: gradients of the last step wait to be applied, and the loss scale
    /// they were computed with.
    pending: Option<f32>,
    block_stats: Mutex<Vec<Option<GradStats>>>,
    norm: Mutex<Norm>,
    ops: Vec<OpState>,
    failed: AtomicBool,
    wake: (Mutex<()>, Condvar),
    stamp: u64,
    histograms: Mutex<Vec<(&'static str, Histogram<u64>)>>,
    /// The threads the lanes run on, started with the executor and reused by every step.
    lane_threads: workers::LaneThreads,
    /// The ranks training together (this process alone: a group of one).
    comm: Arc<dyn Collective>,
    /// With ranks: this rank's piece sums of the gradient statistics, every block's in
    /// block order, and every rank's gathered (reused by each step's norm).
    norm_pieces: Mutex<(Vec<f64>, Vec<f64>)>,
}

/// How an operation fails on purpose ([`Executor::fail_next_at`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// It returns an error.
    Error,
    /// Its lane panics.
    Panic,
}

/// Where each NVMe extent group's data is ([`crate::plan::ExtentKind`]), and the spares
/// shadow paging writes to.
#[derive(Debug, Default)]
struct ExtentTable {
    /// Per group: its extent (single, shadow-paged: the current one), or side A (pair).
    cur: Vec<ExtentId>,
    /// Per group: side B (pair), or the spare this step's update wrote (shadow-paged,
    /// until the block commits).
    other: Vec<Option<ExtentId>>,
    /// Free spares, per length.
    spares: Vec<(u64, Vec<ExtentId>)>,
}

impl ExtentTable {
    /// Allocates every group's extents and the plan's spares in `store`.
    fn allocate(store: &TensorStore, plan: &Plan) -> Result<Self, StorageError> {
        let mut table = ExtentTable::default();
        for g in &plan.extent_groups {
            let (a, b) = match g.kind {
                ExtentKind::Pair => (".a", Some(".b")),
                _ => ("", None),
            };
            table
                .cur
                .push(store.allocate(&format!("{}{a}", g.name), g.bytes)?);
            table.other.push(match b {
                Some(b) => Some(store.allocate(&format!("{}{b}", g.name), g.bytes)?),
                None => None,
            });
        }
        for (i, &(bytes, n)) in plan.spares.iter().enumerate() {
            let ids = (0..n)
                .map(|j| store.allocate(&format!("spare.{i}.{j}"), bytes))
                .collect::<Result<Vec<_>, _>>()?;
            table.spares.push((bytes, ids));
        }
        Ok(table)
    }

    fn take_spare(&mut self, bytes: u64) -> Option<ExtentId> {
        self.spares
            .iter_mut()
            .find(|(b, _)| *b == bytes)
            .and_then(|(_, ids)| ids.pop())
    }

    fn put_spare(&mut self, bytes: u64, id: ExtentId) {
        match self.spares.iter_mut().find(|(b, _)| *b == bytes) {
            Some((_, ids)) => ids.push(id),
            None => self.spares.push((bytes, vec![id])),
        }
    }

    /// Makes the spare block `block`'s update wrote to each of its shadow-paged groups
    /// current; the old extents become spares.
    fn commit(&mut self, plan: &Plan, block: usize) {
        for (g, e) in plan.extent_groups.iter().enumerate() {
            if e.block == block
                && e.kind == ExtentKind::Shadow
                && let Some(new) = self.other[g].take()
            {
                let old = std::mem::replace(&mut self.cur[g], new);
                self.put_spare(e.bytes, old);
            }
        }
    }

    /// Gives back the spares a failed step wrote to but never committed.
    fn unstage(&mut self, plan: &Plan) {
        for (g, e) in plan.extent_groups.iter().enumerate() {
            if e.kind == ExtentKind::Shadow
                && let Some(id) = self.other[g].take()
            {
                self.put_spare(e.bytes, id);
            }
        }
    }
}

/// A failure's message from a panic payload.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

impl Executor {
    /// Allocates every buffer of `plan` (and its NVMe extents) for `model` on `device`,
    /// whose arena must hold the plan's device peak. Parameters are zero until
    /// [`Executor::load`].
    pub fn new(
        model: Model,
        plan: Plan,
        device: Device,
        config: &ExecConfig,
    ) -> Result<Self, ExecError> {
        let shape = plan.shape;
        let dims = model.shape(shape.batch, shape.seq)?;
        let comm = config
            .comm
            .clone()
            .unwrap_or_else(|| Arc::new(Solo::new()) as Arc<dyn Collective>);
        if comm.size() != shape.ranks {
            return Err(ExecError::BadInput(format!(
                "plan {} is for {} rank(s), but the group has {}",
                plan.policy,
                shape.ranks,
                comm.size()
            )));
        }
        let (rank, ranks) = (comm.rank(), comm.size());
        let pieces: usize = plan
            .shard_len
            .iter()
            .map(|&s| (s as usize).div_ceil(strata_kernels::adamw::STATS_PIECE))
            .sum();
        let norm_pieces = if shape.ranks > 1 {
            (vec![0.0; pieces], vec![0.0; pieces * shape.ranks])
        } else {
            (Vec::new(), Vec::new())
        };
        if device.target() != shape.target {
            return Err(ExecError::BadInput(format!(
                "plan {} was made for the {:?} kernels, but the device is {}",
                plan.policy,
                shape.target,
                device.name()
            )));
        }
        let setup = |source| ExecError::Device {
            op: "allocating the plan's memory".into(),
            source,
        };
        let device_mem = device
            .alloc(plan.peak[Tier::Device.index()].max(1) as usize)
            .map_err(setup)?;
        let host = HostArena::new(
            "executor",
            plan.peak[Tier::Host.index()] as usize,
            &device.pinning(),
        )
        .map_err(setup)?;
        if config.poison_host && host.len_bytes() > 0 {
            host.write(Lane::Cpu, HostRange::new(0, host.len_bytes()))
                .map_err(setup)?
                .fill(0xff);
        }
        let (store, extents) = if plan.extent_groups.is_empty() {
            (None, ExtentTable::default())
        } else if config.nvme_dirs.is_empty() {
            return Err(ExecError::BadInput(format!(
                "plan {} keeps data on NVMe, but no folder for swap files was given",
                plan.policy
            )));
        } else {
            let capacity = plan.peak[Tier::Nvme.index()] + (1 << 20);
            let mut cfg = StoreConfig::new(config.nvme_dirs[0].clone(), capacity);
            cfg.dirs = config.nvme_dirs.clone();
            cfg.backend = config.io;
            cfg.faults = config.faults.clone();
            let store = TensorStore::create(cfg).map_err(ExecError::Tier)?;
            host.register_with(&store).map_err(setup)?;
            let extents = ExtentTable::allocate(&store, &plan).map_err(ExecError::Tier)?;
            (Some(store), extents)
        };
        let target = shape.target;
        let dtype = shape.device_dtype();
        let nb = model.blocks().len();
        let program = |b, pass| -> Program { model.program(b, pass, dims, target, dtype).into() };
        let programs = Programs {
            compute: (0..nb)
                .map(|b| Pass::ALL.map(|pass| program(b, pass)))
                .collect(),
            update: (0..nb)
                .map(|b| {
                    (plan.homes[b][2] == Tier::Device).then(|| {
                        let layout = &model.blocks()[b];
                        let precision = shape.precision.dtype();
                        if ranks > 1 {
                            // This rank's shard; its new parameters to be gathered over
                            // device memory (in the device's dtype) or on the host (in
                            // the host's precision).
                            let shard = plan.shard_len[b] as usize;
                            let lo = rank * shard;
                            let out = if plan.device_comm(b) {
                                dtype
                            } else {
                                precision
                            };
                            update::adamw_range_program(layout, lo, shard, out, precision).into()
                        } else {
                            update::adamw_program(layout, dtype, precision).into()
                        }
                    })
                })
                .collect(),
            stats: model
                .blocks()
                .iter()
                .map(|b| update::grad_stats_program(b, target).into())
                .collect(),
            accumulate: model
                .blocks()
                .iter()
                .map(|b| update::accumulate_program(b).into())
                .collect(),
        };
        let ops = (0..plan.ops.len())
            .map(|_| OpState {
                issued: AtomicU64::new(0),
                event: Mutex::new(None),
                start: Mutex::new(None),
                span: [AtomicU64::new(0), AtomicU64::new(0)],
            })
            .collect();
        let histograms = crate::plan::OpKind::KIND_NAMES
            .iter()
            .map(|k| {
                (
                    *k,
                    Histogram::new_with_bounds(1, 3_600_000_000, 2).expect("valid bounds"),
                )
            })
            .collect();
        Ok(Executor {
            cpu: Cpu::default(),
            optimizer_threads: config.optimizer_threads.max(1),
            run_ahead: config.run_ahead.max(1),
            nvme_in_flight: config.nvme_in_flight.max(1),
            chaos: config.chaos,
            panic_at: config.panic_at.clone(),
            fail_at: None,
            counted_targets: 1,
            store,
            extents: Mutex::new(extents),
            generation: 0,
            steps: 0,
            applied: (0..nb).map(|_| AtomicU64::new(0)).collect(),
            slot_of: plan.buffers.iter().map(|b| b.slot).collect(),
            deps: [
                effective_deps(&plan, |_| true),
                effective_deps(&plan, |op| !op.update),
                effective_deps(&plan, |op| op.update),
            ],
            pending: None,
            block_stats: Mutex::new(vec![None; nb]),
            norm: Mutex::new(Norm {
                norm: 0.0,
                coef: 1.0,
                skip: false,
            }),
            ops,
            failed: AtomicBool::new(false),
            wake: (Mutex::new(()), Condvar::new()),
            stamp: 0,
            lane_threads: workers::LaneThreads::start()?,
            comm,
            norm_pieces: Mutex::new(norm_pieces),
            histograms: Mutex::new(histograms),
            programs,
            host,
            device_mem,
            device,
            model,
            plan,
        })
    }

    /// A CPU device sized for `plan`, and the executor on it.
    pub fn on_cpu(model: Model, plan: Plan, config: &ExecConfig) -> Result<Self, ExecError> {
        let device = CpuDevice::new(CpuDeviceConfig {
            memory_budget_bytes: plan.peak[Tier::Device.index()].max(1) as usize,
            chaos: config.chaos,
            ..CpuDeviceConfig::default()
        })
        .map_err(|source| ExecError::Device {
            op: "opening the CPU device".into(),
            source,
        })?;
        Executor::new(model, plan, Device::Cpu(device), config)
    }

    /// The plan being run.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The pinned host arena.
    pub fn host_arena(&self) -> &HostArena {
        &self.host
    }

    /// The group of ranks this executor trains in (a group of one when alone).
    pub fn comm(&self) -> &Arc<dyn Collective> {
        &self.comm
    }

    /// This rank's shard of block `b`: its first element in the block, its length
    /// (the plan's), and how many of its elements are the block's (the rest is
    /// padding). Alone: `(0, len, len)`.
    pub fn shard(&self, b: usize) -> (usize, usize, usize) {
        let shard = self.plan.shard_len[b] as usize;
        let lo = self.comm.rank() * shard;
        let valid = self.model.blocks()[b].len.saturating_sub(lo).min(shard);
        (lo, shard, valid)
    }

    /// Optimizer steps applied so far (AdamW's step counter).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Sets the optimizer step counter (resuming from a checkpoint).
    pub fn set_steps(&mut self, steps: u64) {
        self.steps = steps;
        for a in &self.applied {
            a.store(steps, Ordering::Relaxed);
        }
    }

    /// Per block, the updates applied to its optimizer state. After a step that
    /// succeeded, each equals [`Executor::steps`]; after one that failed, a block whose
    /// update had committed counts one more (and a retry of the step skips its AdamW).
    pub fn block_steps(&self) -> Vec<u64> {
        self.applied
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .collect()
    }

    /// Bytes allocated per tier at setup ([`Tier::index`]): the device range, the host
    /// arena, the NVMe extents.
    pub fn allocated(&self) -> [u64; 3] {
        [
            self.device_mem.len_bytes() as u64,
            self.host.len_bytes() as u64,
            self.plan.peak[Tier::Nvme.index()],
        ]
    }

    /// Measured peaks per tier ([`Tier::index`]): for the device and the host arena, the
    /// end of the highest range a kernel, a copy or a host lane used, counted where each
    /// range was checked before use; for NVMe, the most bytes that extents written to
    /// held at once, counted by the store as writes started. Compare with the plan's
    /// `peak`, which these do not read.
    pub fn peak_measured(&self) -> [u64; 3] {
        let device = self
            .device
            .arena()
            .used_high_water_bytes()
            .saturating_sub(self.device_mem.arena_offset_bytes());
        let nvme = self
            .store
            .as_ref()
            .map_or(0, TensorStore::written_high_water_bytes);
        [
            device as u64,
            self.host.used_high_water_bytes() as u64,
            nvme,
        ]
    }

    /// The NVMe tier's I/O counters, if there is one.
    pub fn io_stats(&self) -> Option<IoStats> {
        self.store.as_ref().map(|s| s.io_stats())
    }

    /// Latency percentiles per operation kind: (kind, count, p50 µs, p99 µs, max µs).
    pub fn latency_summary(&self) -> Vec<(&'static str, u64, u64, u64, u64)> {
        let h = self.histograms.lock().unwrap_or_else(|e| e.into_inner());
        h.iter()
            .filter(|(_, h)| !h.is_empty())
            .map(|(k, h)| {
                (
                    *k,
                    h.len(),
                    h.value_at_quantile(0.5),
                    h.value_at_quantile(0.99),
                    h.max(),
                )
            })
            .collect()
    }

    /// The extent an operation on `buf` touches. The `Next` side of a shadow-paged group
    /// takes a spare (kept until the block commits or the next step starts).
    fn extent(&self, buf: BufId) -> Result<ExtentId, ExecError> {
        let BufKind::Extent { group, side } = self.plan.buffer(buf).kind else {
            panic!("buffer {} is not an extent", self.plan.buffer(buf).name);
        };
        let kind = self.plan.extent_groups[group].kind;
        let mut table = self.extents.lock().unwrap_or_else(|e| e.into_inner());
        let current_is_a = self.generation.is_multiple_of(2);
        let (cur, other) = (table.cur[group], table.other[group]);
        Ok(match (kind, side) {
            (ExtentKind::Pair, ExtentSide::Current) if !current_is_a => other.expect("pair"),
            (ExtentKind::Pair, ExtentSide::Next) if current_is_a => other.expect("pair"),
            (ExtentKind::Shadow, ExtentSide::Next) => match other {
                Some(staged) => staged,
                None => {
                    let bytes = self.plan.extent_groups[group].bytes;
                    let spare = table.take_spare(bytes).ok_or_else(|| {
                        ExecError::BadInput(format!(
                            "no spare extent of {bytes} bytes for {}: the plan's spares are \
                             all held (a planning error)",
                            self.plan.extent_groups[group].name
                        ))
                    })?;
                    table.other[group] = Some(spare);
                    spare
                }
            },
            _ => cur,
        })
    }

    /// The extent group of extent buffer `buf`.
    fn extent_group(&self, buf: BufId) -> &crate::plan::Extent {
        let BufKind::Extent { group, .. } = self.plan.buffer(buf).kind else {
            panic!("buffer {} is not an extent", self.plan.buffer(buf).name);
        };
        &self.plan.extent_groups[group]
    }

    /// Starts writing `buf` to the extent of `to`. Optimizer state (master, m, v) is written
    /// with its head, the master parameters, checksummed on its own, so that a block
    /// whose working parameters are the master copy can fetch them alone.
    fn write_extent<B: strata_storage::IoBuf>(
        &self,
        store: &TensorStore,
        to: BufId,
        buf: B,
    ) -> Result<Pending<B>, ExecError> {
        let extent = self.extent(to)?;
        let group = self.extent_group(to);
        Ok(if group.class == crate::plan::TensorClass::Optimizer {
            store.write_with_head(extent, buf, group.bytes / 3)
        } else {
            store.write(extent, buf)
        })
    }

    /// Reads the first `bytes` of the extent of `from` into `buf`: the whole extent, or
    /// the head of optimizer state (its master parameters).
    fn read_extent<B: strata_storage::IoBuf>(
        &self,
        store: &TensorStore,
        from: BufId,
        buf: B,
        bytes: u64,
    ) -> Result<Pending<B>, ExecError> {
        let extent = self.extent(from)?;
        Ok(if bytes < self.extent_group(from).bytes {
            store.read_head(extent, buf, bytes)
        } else {
            store.read(extent, buf)
        })
    }

    /// Where buffer `buf` lives in the device arena.
    fn device_range(&self, buf: BufId) -> DeviceRange {
        let b = self.plan.buffer(buf);
        debug_assert_eq!(b.tier, Tier::Device, "{} is not a device buffer", b.name);
        let slot = &self.plan.slots[self.slot_of[buf.index()].expect("memory").index()];
        DeviceRange::new(
            self.device_mem.arena_offset_bytes() + slot.offset_bytes as usize,
            b.bytes as usize,
        )
    }

    /// Where buffer `buf` lives in the host arena.
    fn host_range(&self, buf: BufId) -> HostRange {
        let b = self.plan.buffer(buf);
        debug_assert_eq!(b.tier, Tier::Host, "{} is not a host buffer", b.name);
        let slot = &self.plan.slots[self.slot_of[buf.index()].expect("memory").index()];
        HostRange::new(slot.offset_bytes as usize, b.bytes as usize)
    }

    /// Wraps a device error with the operation's name, made only if there is an error.
    fn device_error(&self, op: impl fmt::Display) -> impl FnOnce(EngineError) -> ExecError {
        move |source| ExecError::Device {
            op: op.to_string(),
            source,
        }
    }

    /// A host staging arena for loading and exporting: `bytes`, pinned as the device
    /// pins.
    fn staging(&self, bytes: usize) -> Result<HostArena, ExecError> {
        HostArena::new("staging", bytes, &self.device.pinning())
            .map_err(self.device_error("allocating host staging"))
    }

    /// Writes `params` (one f32 buffer per block) as the master and working parameters,
    /// and `moments` as AdamW's m and v (zero when `None`), to their homes. With ranks,
    /// each rank takes its shards from them.
    pub fn load(
        &mut self,
        params: &[Vec<f32>],
        moments: Option<Moments<'_>>,
    ) -> Result<(), ExecError> {
        let blocks = self.model.blocks();
        if params.len() != blocks.len() || params.iter().zip(blocks).any(|(p, b)| p.len() != b.len)
        {
            return Err(ExecError::BadInput(format!(
                "parameters do not match the model's {} blocks",
                blocks.len()
            )));
        }
        if let Some((m, v)) = moments
            && (m.len() != blocks.len()
                || v.len() != blocks.len()
                || m.iter()
                    .chain(v)
                    .zip(blocks.iter().chain(blocks))
                    .any(|(x, b)| x.len() != b.len))
        {
            return Err(ExecError::BadInput(
                "optimizer moments do not match the model's blocks".into(),
            ));
        }
        self.load_from(Source::Whole { params, moments })
    }

    /// As [`Executor::load`] with zero moments, the parameters of block `b` being
    /// `make(b)`, called once per block in order and dropped once written: loading holds
    /// one block's parameters, not the model's (`Model::init_block` initialises a model
    /// larger than the memory its whole parameters would take beside the executor's).
    pub fn load_blocks(&mut self, make: &dyn Fn(usize) -> Vec<f32>) -> Result<(), ExecError> {
        self.load_from(Source::Blocks(make))
    }

    /// Writes this rank's shards (per block, [`Executor::shard`]'s length of the master
    /// parameters, m and v, as [`Executor::export_shard`] returns them) to their homes.
    /// With ranks it is a collective where working parameters live whole on the device
    /// (every rank calls it; the blocks' parameters are gathered).
    pub fn load_shard(&mut self, shard: &TrainingState) -> Result<(), ExecError> {
        let (p, m, v) = shard;
        let blocks = self.model.blocks().len();
        let fits = |x: &Vec<Vec<f32>>| {
            x.len() == blocks && (0..blocks).all(|b| x[b].len() == self.plan.shard_len[b] as usize)
        };
        if !(fits(p) && fits(m) && fits(v)) {
            return Err(ExecError::BadInput(format!(
                "the shards do not match this plan's {blocks} blocks of {} ranks",
                self.comm.size()
            )));
        }
        self.load_from(Source::Shard(shard))
    }

    fn load_from(&mut self, source: Source<'_>) -> Result<(), ExecError> {
        let blocks = self.model.blocks().to_vec();
        let precision = self.plan.shape.precision;
        let pbytes = precision.param_bytes() as usize;
        // Fresh parameters: no delayed update is waiting.
        self.pending = None;
        let largest = blocks.iter().map(|b| b.len).max().unwrap_or(0);
        let staging = self.staging((12 * largest).next_multiple_of(4096))?;
        for (b, block) in blocks.iter().enumerate() {
            let len = block.len;
            let homes = self.plan.block_homes[b];
            let made;
            let whole_params: Option<&[f32]> = match source {
                Source::Whole { params, .. } => Some(&params[b]),
                Source::Blocks(make) => {
                    made = make(b);
                    if made.len() != len {
                        return Err(ExecError::BadInput(format!(
                            "block {b}'s parameters have {} values, not the model's {len}",
                            made.len()
                        )));
                    }
                    Some(&made)
                }
                Source::Shard(_) => None,
            };
            // With ranks, this rank's shard of the state (and of host or NVMe working
            // parameters), zero past the block's end.
            let (lo, shard, valid) = self.shard(b);
            let part = lo.min(len)..lo.min(len) + valid;
            let state_range = HostRange::new(0, 12 * shard);
            {
                let mut bytes = staging
                    .write(Lane::Cpu, state_range)
                    .map_err(self.device_error("loading"))?;
                let f = cast_mut::<f32>(&mut bytes);
                f.fill(0.0);
                let (p, rest) = f.split_at_mut(shard);
                let (m, v) = rest.split_at_mut(shard);
                match (source, whole_params) {
                    (Source::Shard((pp, mm, vv)), _) => {
                        p[..valid].copy_from_slice(&pp[b][..valid]);
                        m[..valid].copy_from_slice(&mm[b][..valid]);
                        v[..valid].copy_from_slice(&vv[b][..valid]);
                    }
                    (_, Some(whole)) => {
                        p[..valid].copy_from_slice(&whole[part.clone()]);
                        if let Source::Whole {
                            moments: Some((mm, vv)),
                            ..
                        } = source
                        {
                            m[..valid].copy_from_slice(&mm[b][part.clone()]);
                            v[..valid].copy_from_slice(&vv[b][part.clone()]);
                        }
                    }
                    (_, None) => unreachable!("whole sources have the block's parameters"),
                }
            }
            self.put_home(&staging, state_range, homes.state, None)?;
            if homes.params == homes.state {
                continue; // the working parameters are the master copy
            }
            let whole = self.plan.buffer(homes.params).tier == Tier::Device;
            let gathered;
            let master: &[f32] = match (source, whole_params, whole) {
                (_, Some(params), true) => params,
                (_, Some(params), false) => &params[part.clone()],
                (Source::Shard((pp, _, _)), _, false) => &pp[b][..valid],
                (Source::Shard((pp, _, _)), _, true) => {
                    // The whole block, from every rank's shard.
                    gathered = self.gather_block(b, &pp[b])?;
                    &gathered
                }
                (_, None, _) => unreachable!("whole sources have the block's parameters"),
            };
            let working = HostRange::new(0, if whole { len } else { shard } * pbytes);
            {
                let mut bytes = staging
                    .write(Lane::Cpu, working)
                    .map_err(self.device_error("loading"))?;
                bytes.fill(0);
                write_working(precision, master, &mut bytes[..master.len() * pbytes]);
            }
            let convert = (precision.dtype() != self.plan.shape.device_dtype())
                .then(|| (precision.dtype(), self.plan.shape.device_dtype()));
            self.put_home(&staging, working, homes.params, convert)?;
        }
        Ok(())
    }

    /// Block `b` whole, from every rank's `shard` of it (rank order; a collective).
    fn gather_block(&self, b: usize, shard: &[f32]) -> Result<Vec<f32>, ExecError> {
        let ranks = self.comm.size();
        let mut all = vec![0f32; ranks * shard.len()];
        self.comm
            .all_gather(
                crate::device::bytes_of(shard),
                crate::device::bytes_of_mut(&mut all),
            )
            .map_err(|source| ExecError::Comm {
                op: format!("gathering block {b}"),
                source,
            })?;
        all.truncate(self.model.blocks()[b].len);
        Ok(all)
    }

    /// Copies `src` of `staging` to home buffer `home` (device, host or NVMe).
    fn put_home(
        &self,
        staging: &HostArena,
        src: HostRange,
        home: BufId,
        convert: Option<(Dtype, Dtype)>,
    ) -> Result<(), ExecError> {
        let name = &self.plan.buffer(home).name;
        match self.plan.buffer(home).tier {
            Tier::Device => {
                let dst = self.device_range(home);
                let dst = match convert {
                    Some((a, b)) => {
                        DeviceRange::new(dst.offset_bytes, src.len_bytes / a.size() * b.size())
                    }
                    None => DeviceRange::new(dst.offset_bytes, src.len_bytes),
                };
                self.device
                    .copy_to_device(staging, src, dst, convert, &[])
                    .and_then(|e| e.wait())
                    .map_err(self.device_error(format!("loading {name}")))
            }
            Tier::Host => {
                let from = staging
                    .read(Lane::Cpu, src)
                    .map_err(self.device_error("loading"))?;
                let mut to = self
                    .host
                    .write(Lane::Cpu, self.host_range(home).prefix(src.len_bytes))
                    .map_err(self.device_error(format!("loading {name}")))?;
                to.copy_from_slice(&from);
                Ok(())
            }
            Tier::Nvme => {
                let store = self
                    .store
                    .as_ref()
                    .expect("a plan with extents has a store");
                let mut buf = AlignedBuf::zeroed(src.len_bytes.next_multiple_of(4096));
                buf.as_mut_slice()[..src.len_bytes].copy_from_slice(
                    &staging
                        .read(Lane::Cpu, src)
                        .map_err(self.device_error("loading"))?,
                );
                let (r, _) = self.write_extent(store, home, buf)?.wait();
                r.map_err(|source| ExecError::Storage {
                    op: format!("writing {name}"),
                    source,
                })
            }
        }
    }

    /// Reads the master parameters and AdamW's m and v of every block from their homes.
    /// With ranks it is a collective: every rank calls it, and every rank gets the
    /// whole state (its shards gathered).
    pub fn export(&self) -> Result<TrainingState, ExecError> {
        let (sp, sm, sv) = self.export_shard()?;
        let ranks = self.comm.size();
        if ranks == 1 {
            return Ok((sp, sm, sv));
        }
        let (mut p, mut m, mut v) = (Vec::new(), Vec::new(), Vec::new());
        for (b, block) in self.model.blocks().iter().enumerate() {
            let shard = self.plan.shard_len[b] as usize;
            // Every rank's shard, in rank order: rank r's (master, m, v) of `shard` each.
            let mut mine = Vec::with_capacity(3 * shard);
            for class in [&sp[b], &sm[b], &sv[b]] {
                mine.extend_from_slice(class);
            }
            let mut all = vec![0f32; ranks * 3 * shard];
            self.comm
                .all_gather(
                    crate::device::bytes_of(&mine),
                    crate::device::bytes_of_mut(&mut all),
                )
                .map_err(|source| ExecError::Comm {
                    op: format!(
                        "gathering {}",
                        self.plan.buffer(self.plan.block_homes[b].state).name
                    ),
                    source,
                })?;
            let class = |c: usize| -> Vec<f32> {
                let mut out = Vec::with_capacity(ranks * shard);
                for r in 0..ranks {
                    let at = (3 * r + c) * shard;
                    out.extend_from_slice(&all[at..at + shard]);
                }
                out.truncate(block.len);
                out
            };
            p.push(class(0));
            m.push(class(1));
            v.push(class(2));
        }
        Ok((p, m, v))
    }

    /// Reads this rank's shard of the master parameters and AdamW's m and v of every
    /// block from their homes: per block, [`Executor::shard`]'s length of each, zero past
    /// the block's end (alone: the whole blocks). Not a collective.
    pub fn export_shard(&self) -> Result<TrainingState, ExecError> {
        let (mut p, mut m, mut v) = (Vec::new(), Vec::new(), Vec::new());
        let mut staging = None;
        for b in 0..self.model.blocks().len() {
            let shard = self.plan.shard_len[b] as usize;
            let mut f = self.read_state(b, 3, &mut staging)?;
            v.push(f.split_off(2 * shard));
            m.push(f.split_off(shard));
            p.push(f);
        }
        Ok((p, m, v))
    }

    /// Block `b`'s master parameters, read from their home: one block of what
    /// [`Executor::export`] returns, for writing a model a block at a time. Alone only:
    /// with ranks each holds a shard, and `export` gathers them (a collective).
    pub fn export_block(&self, b: usize) -> Result<Vec<f32>, ExecError> {
        if self.comm.size() != 1 {
            return Err(ExecError::BadInput(format!(
                "export_block reads one process's blocks; with {} ranks, export gathers \
                 every rank's shards",
                self.comm.size()
            )));
        }
        let Some(block) = self.model.blocks().get(b) else {
            return Err(ExecError::BadInput(format!(
                "block {b} is not one of the model's {}",
                self.model.blocks().len()
            )));
        };
        let mut f = self.read_state(b, 1, &mut None)?;
        f.truncate(block.len);
        Ok(f)
    }

    /// The first `classes` of this rank's shard of block `b`'s master parameters, m and
    /// v (1: the master parameters alone; 3: all three, one after another), read from
    /// their home (`staging`: host memory for device-homed state, made when first needed,
    /// remade larger when a read needs more, and kept for the next call). NVMe state's
    /// master parameters are read and verified on their own (the head of the extent,
    /// checksummed apart).
    fn read_state(
        &self,
        b: usize,
        classes: usize,
        staging: &mut Option<HostArena>,
    ) -> Result<Vec<f32>, ExecError> {
        let shard = self.plan.shard_len[b] as usize;
        let home = self.plan.block_homes[b].state;
        let name = &self.plan.buffer(home).name;
        let bytes = 4 * classes * shard;
        let range = HostRange::new(0, bytes);
        let mut f = vec![0f32; classes * shard];
        match self.plan.buffer(home).tier {
            Tier::Nvme => {
                let store = self.store.as_ref().expect("store");
                let (r, buf) = self
                    .read_extent(
                        store,
                        home,
                        AlignedBuf::zeroed(bytes.next_multiple_of(4096)),
                        bytes as u64,
                    )?
                    .wait();
                r.map_err(|source| ExecError::Storage {
                    op: format!("reading {name}"),
                    source,
                })?;
                crate::device::bytes_of_mut(&mut f).copy_from_slice(&buf.as_slice()[..bytes]);
            }
            Tier::Host => {
                let bytes = self
                    .host
                    .read(Lane::Cpu, self.host_range(home).prefix(bytes))
                    .map_err(self.device_error(format!("reading {name}")))?;
                crate::device::bytes_of_mut(&mut f).copy_from_slice(&bytes);
            }
            Tier::Device => {
                if staging.as_ref().is_none_or(|s| s.len_bytes() < bytes) {
                    *staging = None; // freed before the larger one is made
                    *staging = Some(self.staging(bytes.next_multiple_of(4096))?);
                }
                let staging = staging.as_ref().expect("made above");
                let src = self.device_range(home);
                self.device
                    .copy_to_host(
                        DeviceRange::new(src.offset_bytes, bytes),
                        staging,
                        range,
                        &[],
                    )
                    .and_then(|e| e.wait())
                    .map_err(self.device_error(format!("reading {name}")))?;
                let bytes = staging
                    .read(Lane::Cpu, range)
                    .map_err(self.device_error("exporting"))?;
                crate::device::bytes_of_mut(&mut f).copy_from_slice(&bytes);
            }
        }
        Ok(f)
    }

    /// Runs one optimizer step over `batches` (one (tokens, targets) pair per
    /// micro-batch, each batch × seq ids).
    pub fn step(
        &mut self,
        batches: &[(&[u32], &[u32])],
        params: &StepParams,
    ) -> Result<StepReport, ExecError> {
        let shape = self.plan.shape;
        let n = shape.batch * shape.seq;
        if batches.len() != shape.grad_accum
            || batches.iter().any(|(t, y)| t.len() != n || y.len() != n)
        {
            return Err(ExecError::BadInput(format!(
                "a step takes {} micro-batches of {} x {} tokens and targets",
                shape.grad_accum, shape.batch, shape.seq
            )));
        }
        for (t, y) in batches {
            self.model.check_tokens(t)?;
            self.model.check_targets(y)?;
        }
        // The loss is the mean over the positions whose target counts (not masked out by
        // IGNORE_TARGET), across the micro-batches; at least one, so that a step whose
        // every target is masked has a zero loss and zero gradients rather than NaNs.
        // With ranks, across every rank's micro-batches (a step is the same computation
        // as one process's with all of them).
        let mut counted = [batches
            .iter()
            .map(|(_, y)| y.iter().filter(|&&t| t != IGNORE_TARGET).count())
            .sum::<usize>() as f64];
        if shape.ranks > 1 {
            self.comm
                .all_reduce_sum_f64(&mut counted)
                .map_err(|source| ExecError::Comm {
                    op: "counting the step's targets".into(),
                    source,
                })?;
        }
        self.counted_targets = (counted[0] as usize).max(1);
        if params.clip > 0.0 && !shape.needs_global_norm {
            return Err(ExecError::BadInput(
                "clipping needs a plan built with needs_global_norm".into(),
            ));
        }
        for (m, (t, y)) in batches.iter().enumerate() {
            let range = self.host_range(self.plan.tokens_host[m]).prefix(8 * n);
            let mut bytes = self
                .host
                .write(Lane::Cpu, range)
                .map_err(self.device_error("writing the batch"))?;
            let ids = cast_mut::<u32>(&mut bytes);
            ids[..n].copy_from_slice(t);
            ids[n..].copy_from_slice(y);
        }
        let delayed = shape.delayed_update;
        let run_update = !delayed || self.pending.is_some();
        let update_scale = if delayed {
            self.pending.unwrap_or(params.loss_scale)
        } else {
            params.loss_scale
        };
        let mut report = self.run(params, true, run_update, update_scale)?;
        if delayed {
            for &(fill, apply) in &self.plan.swap_each_step {
                self.slot_of.swap(fill.index(), apply.index());
            }
            self.pending = Some(params.loss_scale);
        }
        report.updated = run_update && !report.skipped;
        if report.updated {
            self.commit_update();
        }
        Ok(report)
    }

    /// With a delayed update, applies the last step's gradients now (at the end of a run,
    /// before a checkpoint or an export). Returns what the update did, or `None` when
    /// nothing was pending.
    pub fn flush(&mut self, params: &StepParams) -> Result<Option<StepReport>, ExecError> {
        let Some(scale) = self.pending else {
            return Ok(None);
        };
        let mut report = self.run(params, false, true, scale)?;
        self.pending = None;
        report.loss = f32::NAN;
        report.updated = !report.skipped;
        if report.updated {
            self.commit_update();
        }
        Ok(Some(report))
    }

    /// Fault injection (tests): in the next step or flush only, the operation at index
    /// `op` of the plan fails when its lane reaches it, instead of running: with
    /// [`ExecError::Injected`], or by panicking ([`Fault::Panic`]; the step returns
    /// [`ExecError::Panicked`]).
    pub fn fail_next_at(&mut self, op: usize, fault: Fault) {
        self.fail_at = Some((op, fault));
    }

    /// Whether a delayed update is waiting to be applied.
    pub fn has_pending_update(&self) -> bool {
        self.pending.is_some()
    }

    /// After an applied update: its outputs become current.
    fn commit_update(&mut self) {
        for &(cur, next) in &self.plan.swap_on_update {
            self.slot_of.swap(cur.index(), next.index());
        }
        self.generation += 1;
        self.steps += 1;
    }

    /// Runs the plan's operations, the compute part and the update part as asked (the
    /// others count as done).
    fn run(
        &mut self,
        params: &StepParams,
        run_compute: bool,
        run_update: bool,
        update_loss_scale: f32,
    ) -> Result<StepReport, ExecError> {
        let shape = self.plan.shape;
        *self.norm.lock().unwrap_or_else(|e| e.into_inner()) = Norm {
            norm: 0.0,
            coef: 1.0,
            skip: false,
        };
        self.block_stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .fill(None);
        self.stamp += 1;
        self.failed.store(false, Ordering::SeqCst);
        self.extents
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .unstage(&self.plan);
        for (id, op) in self.plan.ops.iter().enumerate() {
            let state = &self.ops[id];
            state.span[0].store(0, Ordering::Relaxed);
            state.span[1].store(0, Ordering::Relaxed);
            *state.event.lock().unwrap_or_else(|e| e.into_inner()) = None;
            *state.start.lock().unwrap_or_else(|e| e.into_inner()) = None;
            let wanted = if op.update { run_update } else { run_compute };
            if !wanted {
                state.issued.store(self.stamp, Ordering::Release);
            }
        }
        let deps = match (run_compute, run_update) {
            (true, true) => &self.deps[0],
            (true, false) => &self.deps[1],
            _ => &self.deps[2],
        };
        let io_before = self.store.as_ref().map(TensorStore::io_counters);
        let copied_before = self.device.copied_bytes();
        let origin = match self.device {
            Device::Cuda(_) => Some(
                self.device
                    .record(Lane::Compute)
                    .map_err(self.device_error("starting the step"))?,
            ),
            Device::Cpu(_) => None,
        };
        let shared = StepShared {
            deps,
            stamp: self.stamp,
            params: *params,
            counted_targets: self.counted_targets,
            adam_step: self.steps + 1,
            update_loss_scale,
            start: Instant::now(),
            origin,
            fail_at: self.fail_at.take(),
        };
        let lanes = Lane::ALL
            .into_iter()
            .filter(|lane| !self.plan.lanes[lane.index()].is_empty());
        let errors = self.lane_threads.run_step(self, &shared, lanes);
        // Whatever happened, nothing the step queued may still run when it returns.
        let drained = self.device.synchronize();
        let skipped = self.norm.lock().unwrap_or_else(|e| e.into_inner()).skip;
        if drained.is_ok() && !skipped {
            // The device's updates that ran are applied, whatever failed after them.
            for (id, op) in self.plan.ops.iter().enumerate() {
                if let OpKind::Stream(StreamOp::DeviceUpdate { block, .. }) = op.kind
                    && self.ops[id]
                        .event
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .is_some()
                {
                    self.applied[block].store(shared.adam_step, Ordering::Relaxed);
                }
            }
        }
        let seconds = shared.start.elapsed().as_secs_f64();
        if let Some(first) = errors.into_iter().find(|e| !lanes::is_abort(e)) {
            return Err(first);
        }
        drained.map_err(self.device_error("finishing the step"))?;
        let norm = *self.norm.lock().unwrap_or_else(|e| e.into_inner());
        let grad_norm = if !run_update {
            f64::NAN
        } else if shape.needs_global_norm {
            norm.norm
        } else {
            self.merged_block_stats()?.norm()
        };
        let loss = if run_compute {
            self.mean_loss()?
        } else {
            f32::NAN
        };
        let mut report = self.report(loss, grad_norm, norm.skip, seconds, &shared)?;
        let io_after = self.store.as_ref().map(TensorStore::io_counters);
        let copied = self.device.copied_bytes();
        if let (Some(before), Some(after)) = (io_before, io_after) {
            report.link_bytes[0] = after.read_bytes - before.read_bytes;
            report.link_bytes[1] = after.written_bytes - before.written_bytes;
            report.fixed_chunks = [
                after.fixed_chunks - before.fixed_chunks,
                after.plain_chunks - before.plain_chunks,
            ];
        }
        report.link_bytes[2] = copied[0] - copied_before[0];
        report.link_bytes[3] = copied[1] - copied_before[1];
        Ok(report)
    }

    /// The mean of the per-position losses the step left in the host arena (with
    /// ranks, of every rank's: each micro-batch's sum added in the order of one process
    /// running them all, micro-batch k of rank r being its k × ranks + r).
    fn mean_loss(&self) -> Result<f32, ExecError> {
        let rows = self.plan.shape.batch * self.plan.shape.seq;
        let ranks = self.comm.size();
        let micro_sum = |buf: BufId| -> Result<f64, ExecError> {
            let bytes = self
                .host
                .read(Lane::Cpu, self.host_range(buf).prefix(4 * rows))
                .map_err(self.device_error("reading the losses"))?;
            Ok(cast::<f32>(&bytes)
                .iter()
                .map(|&l| f64::from(l))
                .sum::<f64>())
        };
        let mut sum = 0.0f64;
        if ranks == 1 {
            for &buf in &self.plan.losses_host {
                sum += micro_sum(buf)?;
            }
        } else {
            let mine = self
                .plan
                .losses_host
                .iter()
                .map(|&b| micro_sum(b))
                .collect::<Result<Vec<f64>, _>>()?;
            let mut all = vec![0f64; ranks * mine.len()];
            self.comm
                .all_gather(
                    crate::device::bytes_of(&mine),
                    crate::device::bytes_of_mut(&mut all),
                )
                .map_err(|source| ExecError::Comm {
                    op: "gathering the losses".into(),
                    source,
                })?;
            for k in 0..mine.len() {
                for r in 0..ranks {
                    sum += all[r * mine.len() + k];
                }
            }
        }
        Ok((sum / self.counted_targets as f64) as f32)
    }

    /// Every block's gradient statistics, merged in block order: the CPU optimizer's, or
    /// the device's copied to the host.
    fn merged_block_stats(&self) -> Result<GradStats, ExecError> {
        let cpu = self.block_stats.lock().unwrap_or_else(|e| e.into_inner());
        let mut total = GradStats::default();
        for (b, s) in cpu.iter().enumerate() {
            let stats = match (s, self.plan.stats_host[b]) {
                (Some(s), _) => *s,
                (None, Some(buf)) => {
                    let bytes = self
                        .host
                        .read(Lane::Cpu, self.host_range(buf).prefix(16))
                        .map_err(self.device_error("reading gradient statistics"))?;
                    read_stats(&bytes)
                }
                (None, None) => GradStats::default(),
            };
            total = total.merge(stats);
        }
        Ok(total)
    }

    /// Timings of the run: spans, lane busy times, the compute stall, per-kind
    /// histograms, and the measured peaks of live buffers.
    fn report(
        &self,
        loss: f32,
        grad_norm: f64,
        skipped: bool,
        seconds: f64,
        shared: &StepShared<'_>,
    ) -> Result<StepReport, ExecError> {
        let mut lane_busy = [0.0; Lane::COUNT];
        let mut records = Vec::with_capacity(self.plan.ops.len());
        let mut hist = self.histograms.lock().unwrap_or_else(|e| e.into_inner());
        let mut stall = 0.0;
        // Lane by lane, each operation's span taken once. Busy time is the union of a
        // lane's spans: an NVMe lane's transfers overlap (ExecConfig::nvme_in_flight),
        // and start in the lane's order.
        for lane in Lane::ALL {
            let mut covered = 0u64;
            for &id in &self.plan.lanes[lane.index()] {
                let Some((s, e)) = self.span(id, shared)? else {
                    continue;
                };
                let op = self.plan.op(id);
                lane_busy[lane.index()] += e.saturating_sub(s.max(covered)) as f64 * 1e-9;
                if lane == Lane::Compute {
                    stall += s.saturating_sub(covered) as f64 * 1e-9;
                }
                covered = covered.max(e);
                if let Some((_, h)) = hist.iter_mut().find(|(k, _)| *k == op.kind.kind_name()) {
                    // Durations beyond the histogram's hour saturate rather than fail.
                    h.saturating_record(((e - s) / 1000).max(1));
                }
                records.push(OpRecord {
                    label: op.kind.label(),
                    lane,
                    start_ns: s,
                    end_ns: e,
                    bytes: op.bytes,
                });
            }
        }
        drop(hist);
        Ok(StepReport {
            loss,
            grad_norm,
            skipped,
            updated: false,
            seconds,
            lane_busy,
            compute_stall: stall,
            link_bytes: [0; 4],
            fixed_chunks: [0; 2],
            records,
        })
    }

    /// When operation `id` ran (ns after the step's start), if it ran.
    fn span(&self, id: OpId, shared: &StepShared<'_>) -> Result<Option<(u64, u64)>, ExecError> {
        let state = &self.ops[id.index()];
        let host = [
            state.span[0].load(Ordering::Relaxed),
            state.span[1].load(Ordering::Relaxed),
        ];
        if host[1] > 0 {
            return Ok(Some((host[0], host[1])));
        }
        let event = state
            .event
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let Some(event) = event else {
            return Ok(None);
        };
        match (&event, &shared.origin) {
            (Event::Cpu(e), _) => Ok(e.run_time().map(|(s, e)| {
                let since =
                    |t: Instant| t.saturating_duration_since(shared.start).as_nanos() as u64;
                (since(s), since(e).max(since(s) + 1))
            })),
            (Event::Cuda(_), Some(origin)) => {
                let start = state
                    .start
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                let at = |e: &Event| -> Result<u64, ExecError> {
                    let d = e
                        .elapsed_since(origin)
                        .map_err(self.device_error("timing the step"))?;
                    Ok(d.as_nanos() as u64)
                };
                let end = at(&event)?;
                let begin = match start {
                    Some(s) => at(&s)?,
                    None => end,
                };
                Ok(Some((begin, end.max(begin + 1))))
            }
            (Event::Cuda(_), None) => Ok(None),
        }
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        // Copies may still read or write the host arena; let them finish first.
        if let Err(e) = self.device.synchronize() {
            log::error!("draining the device before dropping the executor failed: {e}");
        }
    }
}

/// Each operation's dependencies among the operations `kept`, a skipped dependency
/// replaced by its own (transitively). Dependencies point backwards in plan order.
fn effective_deps(plan: &Plan, kept: impl Fn(&crate::plan::Op) -> bool) -> Vec<Vec<OpId>> {
    let mut out: Vec<Vec<OpId>> = Vec::with_capacity(plan.ops.len());
    for op in &plan.ops {
        let mut deps = Vec::new();
        for &d in &op.deps {
            if kept(plan.op(d)) {
                deps.push(d);
            } else {
                deps.extend_from_slice(&out[d.index()]);
            }
        }
        deps.sort_unstable();
        deps.dedup();
        out.push(deps);
    }
    out
}

/// The working copy of `master` in `precision`, rounded to nearest even, into `out`.
fn write_working(precision: Precision, master: &[f32], out: &mut [u8]) {
    let cpu = Cpu::default();
    match precision {
        Precision::Fp32 => cast_mut::<f32>(out).copy_from_slice(master),
        Precision::Bf16 => {
            strata_kernels::ops::f32_to_bf16(&cpu, cast_mut::<half::bf16>(out), master)
        }
        Precision::Fp16 => {
            strata_kernels::ops::f32_to_f16(&cpu, cast_mut::<half::f16>(out), master)
        }
    }
}
