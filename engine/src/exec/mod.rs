//! The executor: runs a [`Plan`]'s schedule, step after step, on a model backend.
//!
//! - Every physical slot of the plan is allocated once, in [`Executor::new`]: device
//!   buffers through the backend, host buffers as 4096-aligned (huge-page backed) memory
//!   the NVMe tier reads into directly, NVMe extents in a [`TensorStore`]. A step
//!   allocates no buffer memory.
//! - A step runs one thread per lane (NVMe reads, NVMe writes, H2D, compute, D2H, CPU
//!   optimizer). Each takes its operations in plan order and starts one when its
//!   dependencies have finished. A slot is locked by the operation using it; finding it locked means the
//!   plan's dependencies are wrong, which is reported as a bug rather than raced.
//! - Data homed on NVMe that a step rewrites has A/B extents; the step reads the current
//!   side and writes the other, and the sides swap only after every operation of the
//!   step succeeded. Host- and device-homed state is updated only after every NVMe
//!   transfer of the step when the plan has any (the planner orders it so). A step failed
//!   by the NVMe tier therefore returns an error with every parameter as it was.
//! - Every operation's start and end are recorded: busy time per lane, the compute
//!   lane's stall waiting for data, bytes per link, a latency histogram per kind, and a
//!   Chrome trace of a step ([`StepReport::chrome_trace`]).

mod calibrate;
mod trace;

pub use calibrate::calibrate;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use half::{bf16, f16};
use hdrhistogram::Histogram;
use strata_kernels::adamw::{AdamStep, AdamW, CopyOut, GradStats, Grads, State, grad_stats};
use strata_kernels::isa::Isa;
use strata_kernels::ops::Cpu;
use strata_storage::BackendChoice;
use strata_storage::{AlignedBuf, ExtentId, StorageError, StoreConfig, TensorStore};

pub use trace::OpRecord;

use crate::device::{cast, cast_mut};
use crate::model::{Backend, BlockScratch, HostParams, Model, ModelError};
use crate::plan::{BufId, BufKind, ExtentSide, Lane, OpId, OpKind, Plan, Precision, Tier};

/// Why a step (or setting up the executor) failed.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// An NVMe transfer failed; the step changed nothing.
    #[error("{op}: {source}")]
    Storage {
        /// The operation.
        op: String,
        /// The error from the tier.
        source: StorageError,
    },
    /// A kernel or copy failed.
    #[error("{op}: {source}")]
    Model {
        /// The operation.
        op: String,
        /// The error.
        source: ModelError,
    },
    /// The optimizer refused its inputs.
    #[error("{op}: {source}")]
    Adam {
        /// The operation.
        op: String,
        /// The error.
        source: strata_kernels::adamw::AdamError,
    },
    /// Inputs that do not match the plan (batch shape, parameter buffers).
    #[error("{0}")]
    BadInput(String),
    /// Setting up the NVMe tier failed.
    #[error("NVMe tier: {0}")]
    Tier(StorageError),
    /// The schedule ran into itself: a bug in the plan.
    #[error("schedule bug: {0}")]
    ScheduleBug(String),
}

/// AdamW's first and second moments, one buffer per block.
pub type Moments<'a> = (&'a [Vec<f32>], &'a [Vec<f32>]);

/// Master parameters, m and v, one f32 buffer per block each.
pub type TrainingState = (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<Vec<f32>>);

/// How the executor sets up its NVMe tier.
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
}

impl Default for ExecConfig {
    fn default() -> Self {
        ExecConfig {
            nvme_dirs: vec![std::env::temp_dir()],
            io: BackendChoice::Auto,
            faults: None,
            optimizer_threads: strata_kernels::parallel::max_threads(),
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
    pub adam: AdamW,
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
    pub lane_busy: [f64; 6],
    /// Seconds the compute lane waited for other lanes between its operations.
    pub compute_stall: f64,
    /// Bytes per step over NVMe read, NVMe write, H2D, D2H.
    pub link_bytes: [u64; 4],
    /// Start and end of every operation the run ran, in plan order.
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

/// A physical slot's memory.
enum SlotData<B: Backend> {
    Params(B::Params),
    Grads(B::Grads),
    Act(B::Act),
    /// Raw bytes; `None` while an NVMe transfer owns the buffer.
    Raw(Option<AlignedBuf>),
    Fixed,
}

/// The device's fixed working set.
struct Fixed<B: Backend> {
    scratch: BlockScratch<B>,
    grad_a: B::Act,
    grad_b: B::Act,
    tokens: B::Tokens,
    targets: B::Tokens,
}

/// Per-step shared values.
struct StepShared<'a> {
    stamp: u64,
    /// Each operation's dependencies in this run (skipped operations replaced by theirs).
    deps: &'a [Vec<OpId>],
    params: StepParams,
    adam_step: u64,
    /// The loss scale of the gradients the update applies (with a delayed update, the
    /// last step's).
    update_loss_scale: f32,
}

/// Runs a plan on a backend, step after step.
pub struct Executor<B: Backend> {
    model: Model,
    plan: Plan,
    backend: B,
    cpu: Cpu,
    optimizer_threads: usize,
    slots: Vec<RwLock<SlotData<B>>>,
    fixed: Mutex<Fixed<B>>,
    store: Option<TensorStore>,
    /// Per extent group: (side A, side B) (equal for single extents).
    extents: Vec<(ExtentId, ExtentId)>,
    /// Which side of each pair is current: A when even.
    generation: u64,
    /// Steps applied (AdamW's step counter).
    steps: u64,
    /// Dependencies for a whole step, a step without the update, and the update alone:
    /// a skipped operation's dependents wait for its own dependencies instead, so that
    /// orderings through it (slot reuse) still hold.
    deps: [Vec<Vec<OpId>>; 3],
    /// Each logical buffer's physical slot; delayed updates exchange pairs of them.
    slot_of: Vec<Option<usize>>,
    /// Delayed update: gradients of the last step wait to be applied, and the loss scale
    /// they were computed with.
    pending: Option<f32>,
    /// Host batches, per micro-batch: tokens and targets.
    batches: Mutex<Vec<(Vec<u32>, Vec<u32>)>>,
    losses: Mutex<Vec<f32>>,
    block_stats: Mutex<Vec<GradStats>>,
    norm: Mutex<(f64, f32, bool)>,
    convert: Mutex<Vec<u16>>,
    done: Vec<AtomicU64>,
    records: Vec<[AtomicU64; 2]>,
    failed: AtomicBool,
    wake: (Mutex<()>, Condvar),
    stamp: u64,
    live: [AtomicU64; 3],
    peak_live: [AtomicU64; 3],
    allocated: [u64; 3],
    histograms: Mutex<Vec<(&'static str, Histogram<u64>)>>,
}

/// A lane's view of the step being run.
struct Ctx<'a> {
    shared: &'a StepShared<'a>,
    start: Instant,
}

impl<B> Executor<B>
where
    B: Backend + Sync,
    B::Params: Send + Sync,
    B::Grads: Send + Sync,
    B::Act: Send + Sync,
    B::Stats: Send,
    B::Tokens: Send,
    B::AttentionScratch: Send,
{
    /// Allocates every slot of `plan` (and its NVMe extents) for `model` on `backend`.
    /// Parameters are zero until [`Executor::load`].
    pub fn new(
        model: Model,
        plan: Plan,
        backend: B,
        config: &ExecConfig,
    ) -> Result<Self, ExecError> {
        let shape = plan.shape;
        let dims = model
            .dims(shape.batch, shape.seq)
            .map_err(|e| ExecError::BadInput(e.to_string()))?;
        let modelerr = |source| ExecError::Model {
            op: "allocating the plan's buffers".into(),
            source,
        };
        let mut allocated = [0u64; 3];
        let mut slots = Vec::with_capacity(plan.slots.len());
        for s in &plan.slots {
            allocated[s.tier.index()] += s.bytes;
            slots.push(RwLock::new(match s.kind {
                BufKind::DevParams => {
                    SlotData::Params(backend.alloc_params(s.elems).map_err(modelerr)?)
                }
                BufKind::DevGrads => {
                    SlotData::Grads(backend.alloc_grads(s.elems).map_err(modelerr)?)
                }
                BufKind::DevAct => SlotData::Act(backend.alloc_act(s.elems).map_err(modelerr)?),
                BufKind::Raw => SlotData::Raw(Some(AlignedBuf::zeroed(s.elems))),
                BufKind::DevFixed => SlotData::Fixed,
                BufKind::Extent { .. } | BufKind::Flag => unreachable!("not memory"),
            }));
        }
        let nc = dims.rows() * dims.width;
        let fixed = Fixed {
            scratch: BlockScratch::new(&backend, dims).map_err(modelerr)?,
            grad_a: backend.alloc_act(nc).map_err(modelerr)?,
            grad_b: backend.alloc_act(nc).map_err(modelerr)?,
            tokens: backend.alloc_tokens(dims.rows()).map_err(modelerr)?,
            targets: backend.alloc_tokens(dims.rows()).map_err(modelerr)?,
        };
        let (store, extents) = if plan.extent_groups.is_empty() {
            (None, Vec::new())
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
            let mut extents = Vec::new();
            for g in &plan.extent_groups {
                let a = store
                    .allocate(&format!("{}.a", g.name), g.bytes)
                    .map_err(ExecError::Tier)?;
                let b = if g.paired {
                    store
                        .allocate(&format!("{}.b", g.name), g.bytes)
                        .map_err(ExecError::Tier)?
                } else {
                    a
                };
                extents.push((a, b));
            }
            (Some(store), extents)
        };
        let max_block = model.blocks().iter().map(|b| b.len).max().unwrap_or(0);
        let ops = plan.ops.len();
        let micro = shape.grad_accum;
        let kinds = [
            "nvme-read",
            "nvme-write",
            "h2d",
            "d2h",
            "accumulate",
            "forward",
            "head",
            "backward",
            "grad-norm",
            "adamw",
        ];
        let nb = model.blocks().len();
        Ok(Executor {
            optimizer_threads: config.optimizer_threads.max(1),
            cpu: Cpu::default(),
            slots,
            fixed: Mutex::new(fixed),
            store,
            extents,
            generation: 0,
            steps: 0,
            slot_of: plan.buffers.iter().map(|b| b.slot).collect(),
            deps: [
                effective_deps(&plan, |_| true),
                effective_deps(&plan, |op| !op.update),
                effective_deps(&plan, |op| op.update),
            ],
            pending: None,
            batches: Mutex::new(vec![(vec![0; dims.rows()], vec![0; dims.rows()]); micro]),
            losses: Mutex::new(vec![0.0; dims.rows() * micro]),
            block_stats: Mutex::new(vec![
                GradStats {
                    sum_squares: 0.0,
                    non_finite: false
                };
                nb
            ]),
            norm: Mutex::new((0.0, 1.0, false)),
            convert: Mutex::new(if shape.precision == Precision::Fp32 {
                Vec::new()
            } else {
                vec![0; max_block]
            }),
            done: (0..ops).map(|_| AtomicU64::new(0)).collect(),
            records: (0..ops)
                .map(|_| [AtomicU64::new(0), AtomicU64::new(0)])
                .collect(),
            failed: AtomicBool::new(false),
            wake: (Mutex::new(()), Condvar::new()),
            stamp: 0,
            live: Default::default(),
            peak_live: Default::default(),
            allocated,
            histograms: Mutex::new(
                kinds
                    .iter()
                    .map(|k| {
                        (
                            *k,
                            Histogram::new_with_bounds(1, 3_600_000_000, 2).expect("valid bounds"),
                        )
                    })
                    .collect(),
            ),
            model,
            plan,
            backend,
        })
    }

    /// The plan being run.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Optimizer steps applied so far (AdamW's step counter).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Sets the optimizer step counter (resuming from a checkpoint).
    pub fn set_steps(&mut self, steps: u64) {
        self.steps = steps;
    }

    /// Bytes allocated per tier at setup ([`Tier::index`]): the plan's slots and extents.
    pub fn allocated(&self) -> [u64; 3] {
        let mut out = self.allocated;
        out[Tier::Nvme.index()] = self.plan.peak[Tier::Nvme.index()];
        out
    }

    /// The most bytes of logical buffers live at once per tier, as measured while steps
    /// ran (persistent buffers included).
    pub fn peak_live(&self) -> [u64; 3] {
        let mut out: [u64; 3] = std::array::from_fn(|t| self.peak_live[t].load(Ordering::Relaxed));
        // The NVMe tier: what the store has handed out to extents.
        if let Some(store) = &self.store {
            out[Tier::Nvme.index()] = store.capacity_bytes() - store.free_bytes();
        }
        out
    }

    /// The NVMe tier's I/O counters, if there is one.
    pub fn io_stats(&self) -> Option<strata_storage::IoStats> {
        self.store.as_ref().map(|s| s.io_stats())
    }

    /// Latency percentiles per operation kind: (kind, count, p50 µs, p99 µs, max µs).
    pub fn latency_summary(&self) -> Vec<(&'static str, u64, u64, u64, u64)> {
        let h = self.histograms.lock().expect("histograms");
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

    fn extent(&self, buf: BufId) -> ExtentId {
        let BufKind::Extent { group, side } = self.plan.buffers[buf].kind else {
            panic!("buffer {} is not an extent", self.plan.buffers[buf].name);
        };
        let (a, b) = self.extents[group];
        let current_is_a = self.generation.is_multiple_of(2);
        match side {
            ExtentSide::Single => a,
            ExtentSide::Current => {
                if current_is_a {
                    a
                } else {
                    b
                }
            }
            ExtentSide::Next => {
                if current_is_a {
                    b
                } else {
                    a
                }
            }
        }
    }

    fn slot(&self, buf: BufId) -> (&RwLock<SlotData<B>>, &str) {
        let b = &self.plan.buffers[buf];
        (
            &self.slots[self.slot_of[buf].expect("a memory buffer has a slot")],
            &b.name,
        )
    }

    /// Shares a buffer's slot for reading; finding it written means the plan is wrong.
    fn read(&self, buf: BufId) -> Result<RwLockReadGuard<'_, SlotData<B>>, ExecError> {
        let (slot, name) = self.slot(buf);
        slot.try_read().map_err(|_| {
            ExecError::ScheduleBug(format!("{name} is being written by another operation"))
        })
    }

    /// Takes a buffer's slot for writing; finding it in use means the plan is wrong.
    fn write(&self, buf: BufId) -> Result<RwLockWriteGuard<'_, SlotData<B>>, ExecError> {
        let (slot, name) = self.slot(buf);
        slot.try_write()
            .map_err(|_| ExecError::ScheduleBug(format!("{name} is in use by another operation")))
    }

    /// Writes `params` (one f32 buffer per block) as the master and working parameters,
    /// and `moments` as AdamW's m and v (zero when `None`), to their homes.
    pub fn load(
        &mut self,
        params: &[Vec<f32>],
        moments: Option<Moments<'_>>,
    ) -> Result<(), ExecError> {
        let blocks = self.model.blocks().to_vec();
        if params.len() != blocks.len() || params.iter().zip(&blocks).any(|(p, b)| p.len() != b.len)
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
                    .zip(blocks.iter().chain(&blocks))
                    .any(|(x, b)| x.len() != b.len))
        {
            return Err(ExecError::BadInput(
                "optimizer moments do not match the model's blocks".into(),
            ));
        }
        let precision = self.plan.shape.precision;
        // Fresh parameters: no delayed update is waiting.
        self.pending = None;
        for (b, block) in blocks.iter().enumerate() {
            let len = block.len;
            let mut state = AlignedBuf::zeroed((12 * len).next_multiple_of(4096));
            {
                let f = cast_mut::<f32>(&mut state.as_mut_slice()[..12 * len]);
                f[..len].copy_from_slice(&params[b]);
                if let Some((m, v)) = moments {
                    f[len..2 * len].copy_from_slice(&m[b]);
                    f[2 * len..].copy_from_slice(&v[b]);
                }
            }
            let mut working =
                AlignedBuf::zeroed((len * precision.param_bytes() as usize).next_multiple_of(4096));
            write_working(
                precision,
                &params[b],
                &mut working.as_mut_slice()[..len * precision.param_bytes() as usize],
            );
            let homes = self.plan.homes[b];
            let state_home = self.home_buffer(b, "adam");
            let params_home = self.home_buffer(b, "params");
            self.put_home(state_home, homes[2], state, 12 * len)?;
            self.put_home_params(params_home, homes[0], b, working)?;
        }
        Ok(())
    }

    /// The persistent buffer (or current extent) homing `what` ("params" or "adam") of
    /// block `b`.
    fn home_buffer(&self, b: usize, what: &str) -> BufId {
        let names = [
            format!("{what}[{b}]@device"),
            format!("{what}[{b}]@host"),
            format!("{what}.{b}.cur@nvme"),
        ];
        self.plan
            .buffers
            .iter()
            .position(|x| x.persistent && names.contains(&x.name))
            .unwrap_or_else(|| panic!("the plan homes {what} of block {b}"))
    }

    fn put_home(
        &mut self,
        buf: BufId,
        tier: Tier,
        data: AlignedBuf,
        len: usize,
    ) -> Result<(), ExecError> {
        match tier {
            Tier::Nvme => {
                let id = self.extent(buf);
                let store = self
                    .store
                    .as_ref()
                    .expect("a plan with extents has a store");
                let (r, _) = store.write(id, data).wait();
                r.map_err(|source| ExecError::Storage {
                    op: format!("writing {}", self.plan.buffers[buf].name),
                    source,
                })
            }
            _ => {
                let mut g = self.write(buf)?;
                let SlotData::Raw(Some(raw)) = &mut *g else {
                    unreachable!("raw home")
                };
                raw.as_mut_slice()[..len].copy_from_slice(&data.as_slice()[..len]);
                Ok(())
            }
        }
    }

    fn put_home_params(
        &mut self,
        buf: BufId,
        tier: Tier,
        b: usize,
        working: AlignedBuf,
    ) -> Result<(), ExecError> {
        let len = self.model.blocks()[b].len;
        let bytes = len * self.plan.shape.precision.param_bytes() as usize;
        match tier {
            Tier::Device => {
                let mut g = self.write(buf)?;
                let SlotData::Params(p) = &mut *g else {
                    unreachable!("device params home")
                };
                let src = host_params(self.plan.shape.precision, &working.as_slice()[..bytes]);
                self.backend
                    .write_params(p, src)
                    .map_err(|source| ExecError::Model {
                        op: format!("loading params[{b}]"),
                        source,
                    })
            }
            _ => self.put_home(buf, tier, working, bytes),
        }
    }

    /// Reads the master parameters and AdamW's m and v of every block from their homes.
    pub fn export(&self) -> Result<TrainingState, ExecError> {
        let blocks = self.model.blocks();
        let (mut p, mut m, mut v) = (Vec::new(), Vec::new(), Vec::new());
        for (b, block) in blocks.iter().enumerate() {
            let len = block.len;
            let home = self.home_buffer(b, "adam");
            let bytes: Vec<u8> = match self.plan.homes[b][2] {
                Tier::Nvme => {
                    let store = self.store.as_ref().expect("store");
                    let (r, buf) = store
                        .read(
                            self.extent(home),
                            AlignedBuf::zeroed((12 * len).next_multiple_of(4096)),
                        )
                        .wait();
                    r.map_err(|source| ExecError::Storage {
                        op: format!("reading adam[{b}]"),
                        source,
                    })?;
                    buf.as_slice()[..12 * len].to_vec()
                }
                _ => {
                    let g = self.read(home)?;
                    let SlotData::Raw(Some(raw)) = &*g else {
                        unreachable!("raw home")
                    };
                    raw.as_slice()[..12 * len].to_vec()
                }
            };
            let mut f = vec![0f32; 3 * len];
            crate::device::bytes_of_mut(&mut f).copy_from_slice(&bytes);
            p.push(f[..len].to_vec());
            m.push(f[len..2 * len].to_vec());
            v.push(f[2 * len..].to_vec());
        }
        Ok((p, m, v))
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
            self.model
                .check_tokens(t)
                .map_err(|e| ExecError::BadInput(e.to_string()))?;
            self.model
                .check_tokens(y)
                .map_err(|e| ExecError::BadInput(e.to_string()))?;
        }
        if params.clip > 0.0 && !shape.needs_global_norm {
            return Err(ExecError::BadInput(
                "clipping needs a plan built with needs_global_norm".into(),
            ));
        }
        {
            let mut host = self.batches.lock().expect("batches");
            for (slot, (t, y)) in host.iter_mut().zip(batches) {
                slot.0.copy_from_slice(t);
                slot.1.copy_from_slice(y);
            }
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
                self.slot_of.swap(fill, apply);
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

    /// Whether a delayed update is waiting to be applied.
    pub fn has_pending_update(&self) -> bool {
        self.pending.is_some()
    }

    /// After an applied update: its outputs become current.
    fn commit_update(&mut self) {
        for &(cur, next) in &self.plan.swap_on_update {
            self.slot_of.swap(cur, next);
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
        *self.norm.lock().expect("norm") = (0.0, 1.0, false);
        self.stamp += 1;
        self.failed.store(false, Ordering::SeqCst);
        for (id, op) in self.plan.ops.iter().enumerate() {
            let wanted = if op.update { run_update } else { run_compute };
            if !wanted {
                self.done[id].store(self.stamp, Ordering::Release);
                self.records[id][0].store(0, Ordering::Relaxed);
                self.records[id][1].store(0, Ordering::Relaxed);
            }
        }
        let deps = match (run_compute, run_update) {
            (true, true) => &self.deps[0],
            (true, false) => &self.deps[1],
            _ => &self.deps[2],
        };
        let shared = StepShared {
            deps,
            stamp: self.stamp,
            params: *params,
            adam_step: self.steps + 1,
            update_loss_scale,
        };
        if self.stamp == 1 {
            self.count_persistent();
        }
        let start = Instant::now();
        let this = &*self;
        let errors: Vec<ExecError> = std::thread::scope(|scope| {
            let handles: Vec<_> = Lane::ALL
                .iter()
                .map(|&lane| {
                    let ctx = Ctx {
                        shared: &shared,
                        start,
                    };
                    std::thread::Builder::new()
                        .name(format!("strata-{lane}"))
                        .spawn_scoped(scope, move || this.run_lane(lane, &ctx))
                        .expect("spawning a lane thread")
                })
                .collect();
            handles
                .into_iter()
                .filter_map(|h| h.join().expect("a lane thread panicked").err())
                .collect()
        });
        let seconds = start.elapsed().as_secs_f64();
        if let Some(first) = errors
            .into_iter()
            .find(|e| !matches!(e, ExecError::ScheduleBug(s) if s == ABORTED))
        {
            return Err(first);
        }
        let (grad_norm, _, skipped) = *self.norm.lock().expect("norm");
        let grad_norm = if !run_update {
            f64::NAN
        } else if shape.needs_global_norm {
            grad_norm
        } else {
            let stats = self.block_stats.lock().expect("stats");
            stats
                .iter()
                .copied()
                .fold(
                    GradStats {
                        sum_squares: 0.0,
                        non_finite: false,
                    },
                    GradStats::merge,
                )
                .norm()
                / f64::from(update_loss_scale)
        };
        let losses = self.losses.lock().expect("losses");
        let loss = (losses.iter().map(|&l| f64::from(l)).sum::<f64>() / losses.len() as f64) as f32;
        drop(losses);
        Ok(self.report(loss, grad_norm, skipped, seconds))
    }

    fn count_persistent(&self) {
        for b in &self.plan.buffers {
            if b.persistent && b.slot.is_some() {
                self.live[b.tier.index()].fetch_add(b.bytes, Ordering::Relaxed);
            }
        }
        for t in 0..3 {
            self.peak_live[t].fetch_max(self.live[t].load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }

    fn report(&self, loss: f32, grad_norm: f64, skipped: bool, seconds: f64) -> StepReport {
        let mut lane_busy = [0.0; 6];
        let mut records = Vec::with_capacity(self.plan.ops.len());
        let mut hist = self.histograms.lock().expect("histograms");
        for (id, op) in self.plan.ops.iter().enumerate() {
            let [s, e] = &self.records[id];
            let (s, e) = (s.load(Ordering::Relaxed), e.load(Ordering::Relaxed));
            if e == 0 {
                continue; // not part of this run (a delayed update's first step, a flush)
            }
            lane_busy[op.lane.index()] += (e - s) as f64 * 1e-9;
            if let Some((_, h)) = hist.iter_mut().find(|(k, _)| *k == op.kind.kind_name()) {
                // Durations beyond the histogram's hour saturate rather than fail.
                h.saturating_record(((e - s) / 1000).max(1));
            }
            records.push(OpRecord {
                label: op.kind.label(),
                lane: op.lane,
                start_ns: s,
                end_ns: e,
                bytes: op.bytes,
            });
        }
        let compute = &self.plan.lanes[Lane::Compute.index()];
        let mut stall = 0.0;
        let mut prev_end = 0u64;
        for &id in compute {
            let s = self.records[id][0].load(Ordering::Relaxed);
            stall += s.saturating_sub(prev_end) as f64 * 1e-9;
            prev_end = self.records[id][1].load(Ordering::Relaxed);
        }
        StepReport {
            loss,
            grad_norm,
            skipped,
            updated: false,
            seconds,
            lane_busy,
            compute_stall: stall,
            link_bytes: self.plan.link_bytes,
            records,
        }
    }

    fn run_lane(&self, lane: Lane, ctx: &Ctx<'_>) -> Result<(), ExecError> {
        for &id in &self.plan.lanes[lane.index()] {
            if self.done[id].load(Ordering::Acquire) == ctx.shared.stamp {
                continue; // not part of this run
            }
            if !self.wait_deps(id, ctx.shared.stamp, ctx.shared.deps) {
                return Err(ExecError::ScheduleBug(ABORTED.into()));
            }
            let started = ctx.start.elapsed().as_nanos() as u64;
            self.records[id][0].store(started, Ordering::Relaxed);
            self.meter(id, true);
            let result = self.run_op(id, ctx);
            self.meter(id, false);
            self.records[id][1].store(ctx.start.elapsed().as_nanos() as u64, Ordering::Relaxed);
            if let Err(e) = result {
                self.failed.store(true, Ordering::SeqCst);
                self.notify();
                return Err(e);
            }
            self.done[id].store(ctx.shared.stamp, Ordering::Release);
            self.notify();
        }
        Ok(())
    }

    fn notify(&self) {
        drop(self.wake.0.lock().expect("wake"));
        self.wake.1.notify_all();
    }

    /// Waits for `id`'s dependencies; false when another lane failed.
    fn wait_deps(&self, id: OpId, stamp: u64, deps: &[Vec<OpId>]) -> bool {
        let deps = &deps[id];
        let ready = || {
            deps.iter()
                .all(|&d| self.done[d].load(Ordering::Acquire) == stamp)
        };
        if ready() {
            return true;
        }
        let mut guard = self.wake.0.lock().expect("wake");
        loop {
            if self.failed.load(Ordering::SeqCst) {
                return false;
            }
            if ready() {
                return true;
            }
            guard = self
                .wake
                .1
                .wait_timeout(guard, Duration::from_millis(50))
                .expect("wake")
                .0;
        }
    }

    /// Counts buffers whose lifetime starts (`starting`) or ends at `id`.
    fn meter(&self, id: OpId, starting: bool) {
        for a in &self.plan.ops[id].access {
            let (crate::plan::Access::Read(b) | crate::plan::Access::Write(b)) = *a;
            let buf = &self.plan.buffers[b];
            if buf.persistent || buf.slot.is_none() {
                continue;
            }
            let Some((first, last)) = buf.live else {
                continue;
            };
            let t = buf.tier.index();
            if starting && first == id {
                let now = self.live[t].fetch_add(buf.bytes, Ordering::Relaxed) + buf.bytes;
                self.peak_live[t].fetch_max(now, Ordering::Relaxed);
            } else if !starting && last == id {
                self.live[t].fetch_sub(buf.bytes, Ordering::Relaxed);
            }
        }
    }

    fn run_op(&self, id: OpId, ctx: &Ctx<'_>) -> Result<(), ExecError> {
        let op = &self.plan.ops[id];
        let label = || op.kind.label();
        let model_err = |source| ExecError::Model {
            op: label(),
            source,
        };
        let skipped = || self.norm.lock().expect("norm").2;
        let precision = self.plan.shape.precision;
        let blocks = self.model.blocks();
        match op.kind {
            OpKind::NvmeRead { from, into } => {
                let extent = self.extent(from);
                self.nvme(into, |store, buf| store.read(extent, buf).wait(), &label)
            }
            OpKind::NvmeWrite {
                from,
                to,
                with_update,
            } => {
                if with_update && skipped() {
                    return Ok(());
                }
                let extent = self.extent(to);
                self.nvme(from, |store, buf| store.write(extent, buf).wait(), &label)
            }
            OpKind::H2dParams {
                block,
                from,
                to,
                with_update,
            } => {
                if with_update && skipped() {
                    return Ok(());
                }
                let bytes = blocks[block].len * precision.param_bytes() as usize;
                let src = self.read(from)?;
                let mut dst = self.write(to)?;
                let (SlotData::Raw(Some(raw)), SlotData::Params(p)) = (&*src, &mut *dst) else {
                    unreachable!("h2d params: raw to device params")
                };
                let hp = host_params(precision, &raw.as_slice()[..bytes]);
                self.backend.write_params(p, hp).map_err(model_err)
            }
            OpKind::H2dAct { from, to } => {
                let bytes = self.plan.buffers[to].bytes as usize;
                let src = self.read(from)?;
                let mut dst = self.write(to)?;
                let (SlotData::Raw(Some(raw)), SlotData::Act(a)) = (&*src, &mut *dst) else {
                    unreachable!("h2d checkpoint: raw to device act")
                };
                self.backend
                    .write_act(a, &raw.as_slice()[..bytes])
                    .map_err(model_err)
            }
            OpKind::D2hGrads {
                block,
                from,
                to,
                accumulate,
            } => {
                let len = blocks[block].len;
                let src = self.read(from)?;
                let mut dst = self.write(to)?;
                let (SlotData::Grads(g), SlotData::Raw(Some(raw))) = (&*src, &mut *dst) else {
                    unreachable!("d2h grads: device grads to raw")
                };
                let out = cast_mut::<f32>(&mut raw.as_mut_slice()[..4 * len]);
                self.backend
                    .read_grads(g, out, accumulate)
                    .map_err(model_err)
            }
            OpKind::AccumulateGrads { from, to, .. } => {
                let src = self.read(from)?;
                let mut dst = self.write(to)?;
                let (SlotData::Grads(s), SlotData::Grads(d)) = (&*src, &mut *dst) else {
                    unreachable!("accumulate: device grads")
                };
                self.backend.add_grads(d, s).map_err(model_err)
            }
            OpKind::D2hAct { from, to } => {
                let bytes = self.plan.buffers[from].bytes as usize;
                let src = self.read(from)?;
                let mut dst = self.write(to)?;
                let (SlotData::Act(a), SlotData::Raw(Some(raw))) = (&*src, &mut *dst) else {
                    unreachable!("d2h checkpoint: device act to raw")
                };
                self.backend
                    .read_act(a, &mut raw.as_mut_slice()[..bytes])
                    .map_err(model_err)
            }
            OpKind::EmbeddingForward {
                micro,
                params,
                output,
            } => {
                let mut fixed = self.fixed.lock().expect("fixed");
                let f = &mut *fixed;
                {
                    let host = self.batches.lock().expect("batches");
                    self.backend
                        .upload_tokens(&mut f.tokens, &host[micro].0)
                        .map_err(model_err)?;
                    self.backend
                        .upload_tokens(&mut f.targets, &host[micro].1)
                        .map_err(model_err)?;
                }
                let p = self.read(params)?;
                let mut out = self.write(output)?;
                let (SlotData::Params(p), SlotData::Act(out)) = (&*p, &mut *out) else {
                    unreachable!("embedding forward buffers")
                };
                let dims = f.scratch.dims;
                self.model
                    .embedding_forward(&self.backend, p, &f.tokens, out, dims)
                    .map_err(model_err)
            }
            OpKind::LayerForward {
                params,
                input,
                output,
                ..
            } => {
                let mut fixed = self.fixed.lock().expect("fixed");
                let p = self.read(params)?;
                let x = self.read(input)?;
                let mut out = self.write(output)?;
                let (SlotData::Params(p), SlotData::Act(x), SlotData::Act(out)) =
                    (&*p, &*x, &mut *out)
                else {
                    unreachable!("layer forward buffers")
                };
                self.model
                    .layer_forward(&self.backend, p, x, out, &mut fixed.scratch)
                    .map_err(model_err)
            }
            OpKind::Head {
                micro,
                params,
                embedding,
                grads,
                embedding_grads,
                input,
            } => {
                let mut fixed = self.fixed.lock().expect("fixed");
                let f = &mut *fixed;
                let p = self.read(params)?;
                let e = self.read(embedding)?;
                let x = self.read(input)?;
                let mut g = self.write(grads)?;
                let mut eg = self.write(embedding_grads)?;
                let (
                    SlotData::Params(p),
                    SlotData::Params(e),
                    SlotData::Act(x),
                    SlotData::Grads(g),
                    SlotData::Grads(eg),
                ) = (&*p, &*e, &*x, &mut *g, &mut *eg)
                else {
                    unreachable!("head buffers")
                };
                self.backend.zero_grads(g).map_err(model_err)?;
                self.backend.zero_grads(eg).map_err(model_err)?;
                let shape = self.plan.shape;
                let rows = shape.batch * shape.seq;
                let dloss = ctx.shared.params.loss_scale / (rows * shape.grad_accum) as f32;
                self.model
                    .head_backward(
                        &self.backend,
                        p,
                        g,
                        e,
                        eg,
                        x,
                        &f.targets,
                        dloss,
                        &mut f.grad_a,
                        &mut f.scratch,
                    )
                    .map_err(model_err)?;
                let mut losses = self.losses.lock().expect("losses");
                self.backend
                    .read_stats(
                        &f.scratch.losses,
                        &mut losses[micro * rows..(micro + 1) * rows],
                    )
                    .map_err(model_err)
            }
            OpKind::LayerBackward {
                params,
                grads,
                input,
                ..
            } => {
                let mut fixed = self.fixed.lock().expect("fixed");
                let f = &mut *fixed;
                let p = self.read(params)?;
                let x = self.read(input)?;
                let mut g = self.write(grads)?;
                let (SlotData::Params(p), SlotData::Act(x), SlotData::Grads(g)) =
                    (&*p, &*x, &mut *g)
                else {
                    unreachable!("layer backward buffers")
                };
                self.backend.zero_grads(g).map_err(model_err)?;
                self.model
                    .layer_backward(
                        &self.backend,
                        p,
                        g,
                        x,
                        &f.grad_a,
                        &mut f.grad_b,
                        &mut f.scratch,
                    )
                    .map_err(model_err)?;
                std::mem::swap(&mut f.grad_a, &mut f.grad_b);
                Ok(())
            }
            OpKind::EmbeddingBackward { grads, .. } => {
                let fixed = self.fixed.lock().expect("fixed");
                let mut g = self.write(grads)?;
                let SlotData::Grads(g) = &mut *g else {
                    unreachable!("embedding grads")
                };
                let dims = fixed.scratch.dims;
                self.model
                    .embedding_backward(&self.backend, g, &fixed.tokens, &fixed.grad_a, dims)
                    .map_err(model_err)
            }
            OpKind::GradNorm { ref grads } => {
                let scale = 1.0 / ctx.shared.update_loss_scale;
                let mut total = GradStats {
                    sum_squares: 0.0,
                    non_finite: false,
                };
                for &(block, buf) in grads {
                    let g = self.read(buf)?;
                    let slice = self.grads_slice(&g, blocks[block].len);
                    let s = grad_stats(
                        self.cpu.isa,
                        self.optimizer_threads,
                        Grads::F32(slice),
                        scale,
                    )
                    .map_err(|source| ExecError::Adam {
                        op: label(),
                        source,
                    })?;
                    total = total.merge(s);
                }
                let norm = total.norm();
                let clip = ctx.shared.params.clip;
                let coef = if clip > 0.0 && norm > clip {
                    (clip / (norm + 1e-6)) as f32
                } else {
                    1.0
                };
                *self.norm.lock().expect("norm") = (norm, coef, total.non_finite);
                Ok(())
            }
            OpKind::Optimizer {
                block,
                grads,
                state,
                params_out,
            } => {
                let (_, coef, skip) = *self.norm.lock().expect("norm");
                if skip {
                    return Ok(());
                }
                let len = blocks[block].len;
                let g = self.read(grads)?;
                let gslice = self.grads_slice(&g, len);
                let adam_err = |source| ExecError::Adam {
                    op: label(),
                    source,
                };
                if !self.plan.shape.needs_global_norm {
                    let s = grad_stats(
                        self.cpu.isa,
                        self.optimizer_threads,
                        Grads::F32(gslice),
                        1.0,
                    )
                    .map_err(adam_err)?;
                    self.block_stats.lock().expect("stats")[block] = s;
                }
                let hp = ctx.shared.params.adam;
                let scale = coef / ctx.shared.update_loss_scale;
                let decayed = AdamStep::new(&hp, ctx.shared.adam_step, scale).map_err(adam_err)?;
                let plain = AdamStep::new(
                    &AdamW {
                        weight_decay: 0.0,
                        ..hp
                    },
                    ctx.shared.adam_step,
                    scale,
                )
                .map_err(adam_err)?;
                let mut st = self.write(state)?;
                let SlotData::Raw(Some(raw)) = &mut *st else {
                    unreachable!("optimizer state is raw")
                };
                let f = cast_mut::<f32>(&mut raw.as_mut_slice()[..12 * len]);
                let (master, rest) = f.split_at_mut(len);
                let (m, v) = rest.split_at_mut(len);
                let mut out = self.write(params_out)?;
                let isa = self.cpu.isa;
                let threads = self.optimizer_threads;
                // Weight decay applies to matrices and embeddings only (GPT-2 practice):
                // one call per tensor, with or without it.
                let tensors = &blocks[block].tensors;
                let update =
                    |out: WorkingOut<'_>, master: &mut [f32], m: &mut [f32], v: &mut [f32]| {
                        update_block(
                            tensors,
                            [&decayed, &plain],
                            isa,
                            threads,
                            master,
                            m,
                            v,
                            gslice,
                            out,
                        )
                        .map_err(adam_err)
                    };
                match &mut *out {
                    SlotData::Raw(Some(raw)) => {
                        let pb = precision.param_bytes() as usize;
                        let bytes = &mut raw.as_mut_slice()[..len * pb];
                        match precision {
                            Precision::Fp32 => {
                                update(WorkingOut::None, master, m, v)?;
                                cast_mut::<f32>(bytes).copy_from_slice(master);
                            }
                            Precision::Bf16 => {
                                update(WorkingOut::Bf16(cast_mut::<bf16>(bytes)), master, m, v)?
                            }
                            Precision::Fp16 => {
                                update(WorkingOut::F16(cast_mut::<f16>(bytes)), master, m, v)?
                            }
                        }
                        Ok(())
                    }
                    SlotData::Params(p) => {
                        update(WorkingOut::None, master, m, v)?;
                        match precision {
                            Precision::Fp32 => self
                                .backend
                                .write_params(p, HostParams::F32(master))
                                .map_err(model_err),
                            _ => {
                                let mut conv = self.convert.lock().expect("convert");
                                let bytes = crate::device::bytes_of_mut(&mut conv[..len]);
                                write_working(precision, master, bytes);
                                self.backend
                                    .write_params(p, host_params(precision, bytes))
                                    .map_err(model_err)
                            }
                        }
                    }
                    _ => unreachable!("optimizer output"),
                }
            }
        }
    }

    fn grads_slice<'a>(&self, g: &'a SlotData<B>, len: usize) -> &'a [f32] {
        match g {
            SlotData::Raw(Some(raw)) => cast::<f32>(&raw.as_slice()[..4 * len]),
            SlotData::Grads(g) => &self
                .backend
                .host_grads(g)
                .expect("the planner keeps gradients on the device only on a host device")[..len],
            _ => unreachable!("gradient buffer"),
        }
    }

    /// An NVMe transfer of a raw buffer, which the store owns while it runs.
    fn nvme(
        &self,
        buf: BufId,
        io: impl FnOnce(&TensorStore, AlignedBuf) -> (Result<(), StorageError>, AlignedBuf),
        label: &dyn Fn() -> String,
    ) -> Result<(), ExecError> {
        let store = self
            .store
            .as_ref()
            .expect("a plan with extents has a store");
        let mut g = self.write(buf)?;
        let SlotData::Raw(slot) = &mut *g else {
            unreachable!("nvme transfers use raw buffers")
        };
        let data = slot.take().expect("a raw buffer between transfers");
        let (result, data) = io(store, data);
        *slot = Some(data);
        result.map_err(|source| ExecError::Storage {
            op: label(),
            source,
        })
    }
}

/// Where the optimizer writes a block's new working parameters, if anywhere.
enum WorkingOut<'a> {
    None,
    Bf16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

/// AdamW over one block, tensor by tensor: `steps[0]` (with weight decay) for tensors
/// that decay, `steps[1]` for the others. Alignment gaps are left alone (zero).
#[allow(clippy::too_many_arguments)]
fn update_block(
    tensors: &[crate::model::TensorSpec],
    steps: [&AdamStep; 2],
    isa: Isa,
    threads: usize,
    mut master: &mut [f32],
    mut m: &mut [f32],
    mut v: &mut [f32],
    mut grads: &[f32],
    mut out: WorkingOut<'_>,
) -> Result<(), strata_kernels::adamw::AdamError> {
    fn cut<'a, T>(s: &mut &'a mut [T], skip: usize, take: usize) -> &'a mut [T] {
        let (_, rest) = std::mem::take(s).split_at_mut(skip);
        let (now, rest) = rest.split_at_mut(take);
        *s = rest;
        now
    }
    let mut done = 0;
    for t in tensors {
        let (skip, take) = (t.slot.offset - done, t.slot.len);
        done = t.slot.offset + take;
        let (_, g) = grads.split_at(skip);
        let (g_now, g_rest) = g.split_at(take);
        grads = g_rest;
        let copy = match &mut out {
            WorkingOut::None => CopyOut::None,
            WorkingOut::Bf16(o) => CopyOut::Bf16(cut(o, skip, take)),
            WorkingOut::F16(o) => CopyOut::F16(cut(o, skip, take)),
        };
        let step = if t.decays() { steps[0] } else { steps[1] };
        step.apply(
            isa,
            threads,
            cut(&mut master, skip, take),
            State::F32 {
                m: cut(&mut m, skip, take),
                v: cut(&mut v, skip, take),
            },
            Grads::F32(g_now),
            copy,
        )?;
    }
    Ok(())
}

const ABORTED: &str = "aborted after another lane failed";

/// Each operation's dependencies among the operations `kept`, a skipped dependency
/// replaced by its own (transitively). Dependencies point backwards in plan order.
fn effective_deps(plan: &Plan, kept: impl Fn(&crate::plan::Op) -> bool) -> Vec<Vec<OpId>> {
    let mut out: Vec<Vec<OpId>> = Vec::with_capacity(plan.ops.len());
    for op in &plan.ops {
        let mut deps = Vec::new();
        for &d in &op.deps {
            if kept(&plan.ops[d]) {
                deps.push(d);
            } else {
                deps.extend_from_slice(&out[d]);
            }
        }
        deps.sort_unstable();
        deps.dedup();
        out.push(deps);
    }
    out
}

/// Host working parameters of `precision` from their bytes.
fn host_params(precision: Precision, bytes: &[u8]) -> HostParams<'_> {
    match precision {
        Precision::Fp32 => HostParams::F32(cast::<f32>(bytes)),
        Precision::Bf16 => HostParams::Bf16(cast::<bf16>(bytes)),
        Precision::Fp16 => HostParams::F16(cast::<f16>(bytes)),
    }
}

/// The working copy of `master` in `precision`, rounded to nearest even, into `out`.
fn write_working(precision: Precision, master: &[f32], out: &mut [u8]) {
    let cpu = Cpu::default();
    match precision {
        Precision::Fp32 => cast_mut::<f32>(out).copy_from_slice(master),
        Precision::Bf16 => strata_kernels::ops::f32_to_bf16(&cpu, cast_mut::<bf16>(out), master),
        Precision::Fp16 => strata_kernels::ops::f32_to_f16(&cpu, cast_mut::<f16>(out), master),
    }
}
