//! The [`Executor`]: what it holds (the plan, its memory, its NVMe tier, its programs, its
//! lane threads, the update's counters), what it tells (its plan, model, device, peaks,
//! counters), and how a buffer of the plan is reached (its device or host range, its
//! extent, memory lent to host work).
//!
//! Not here: making one (`setup.rs`), loading and exporting state (`state.rs`), running a
//! step (`step.rs`, `lanes.rs` and the lanes' families of operations).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use hdrhistogram::Histogram;
use strata_comm::Collective;
use strata_kernels::ops::Cpu;
use strata_storage::{IoBuf, IoStats, Pending};

use super::arenas::Arenas;
use super::config::LaneLimits;
use super::error::ExecError;
use super::extents::NvmeTier;
use super::fault::FaultPlan;
use super::lent::Lent;
use super::programs::Programs;
use super::scratch::LaneScratch;
use super::step_state::{NormState, Progress};
use super::workers::LaneThreads;
use crate::device::{Device, DeviceRange};
use crate::error::EngineError;
use crate::lane::Lane;
use crate::memory::{HostArena, HostRange, HostRead};
use crate::model::{Model, StateLayout};
use crate::plan::{BufId, BufKind, ExtentSide, OpId, Plan, Tier};

/// Runs a plan on a device, step after step.
pub struct Executor {
    pub(super) model: Model,
    pub(super) plan: Plan,
    pub(super) device: Device,
    /// Where the plan's device and host buffers are.
    pub(super) arenas: Arenas,
    /// The NVMe tier, when the plan keeps data there.
    pub(super) nvme: Option<NvmeTier>,
    pub(super) programs: Programs,
    pub(super) cpu: Cpu,
    pub(super) limits: LaneLimits,
    /// The positions whose loss counts in the last step given (its loss is their mean).
    pub(super) counted_targets: usize,
    /// Steps applied to every block (AdamW's step counter after a step that succeeded).
    pub(super) steps: u64,
    /// Per block, the updates applied to its optimizer state: `steps`, or `steps + 1`
    /// for a block that committed the update of a step that then failed (a retry does
    /// not apply it again, and rewrites its working parameters from the master copy).
    pub(super) applied: Vec<AtomicU64>,
    /// Per block, where the parts of this rank's shard of its optimizer state lie in its
    /// buffer (made once: the CPU optimizer reads them every step).
    pub(super) state_layouts: Vec<StateLayout>,
    /// Dependencies for a whole step, a step without the update, the update alone, and
    /// the next step's first fetches alone: a skipped operation's dependents wait for
    /// its own dependencies instead, so that orderings through it (slot reuse) still
    /// hold.
    pub(super) deps: [Vec<Vec<OpId>>; 4],
    /// Whether the last run was a step (or the fetches alone) that ended well having
    /// fetched the next step's first parameters ([`Plan::fetches_next_step`]), and
    /// nothing has been loaded since.
    pub(super) head_fetched: bool,
    /// Delayed update: gradients of the last step wait to be applied, and the loss scale
    /// they were computed with.
    pub(super) pending: Option<f32>,
    /// The step's gradient statistics and norm.
    pub(super) norms: NormState,
    /// Each operation's progress in the step being run.
    pub(super) progress: Progress,
    pub(super) histograms: Mutex<Vec<(&'static str, Histogram<u64>)>>,
    /// The threads the lanes run on, started with the executor and reused by every step.
    pub(super) lane_threads: LaneThreads<LaneScratch>,
    /// The ranks training together (this process alone: a group of one).
    pub(super) comm: Arc<dyn Collective>,
    /// The faults the next step or flush injects (tests).
    pub(super) faults: Option<Box<FaultPlan>>,
}

impl Executor {
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
        &self.arenas.host
    }

    /// The group of ranks this executor trains in (a group of one when alone).
    pub fn comm(&self) -> &Arc<dyn Collective> {
        &self.comm
    }

    /// This rank's shard of block `b`'s trained elements (its gradients, optimizer state
    /// and master parameters): its first element in the block, its length (the plan's),
    /// and how many of its elements are the block's (the rest is padding). Alone:
    /// `(frozen, len - frozen, len - frozen)`, the whole block but a LoRA model's frozen
    /// base ([`BlockLayout::frozen`](crate::model::BlockLayout::frozen)).
    pub fn shard(&self, b: usize) -> (usize, usize, usize) {
        let shard = self.plan.shard_len[b] as usize;
        let lo = self.model.blocks()[b].frozen + self.comm.rank() * shard;
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
            self.arenas.device_mem.len_bytes() as u64,
            self.arenas.host.len_bytes() as u64,
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
            .saturating_sub(self.arenas.device_mem.arena_offset_bytes());
        let nvme = self
            .nvme
            .as_ref()
            .map_or(0, |n| n.store().written_high_water_bytes());
        [
            device as u64,
            self.arenas.host.used_high_water_bytes() as u64,
            nvme,
        ]
    }

    /// The NVMe tier's I/O counters, if there is one.
    pub fn io_stats(&self) -> Option<IoStats> {
        self.nvme.as_ref().map(|n| n.store().io_stats())
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

    /// The NVMe tier (the plan has extents).
    pub(super) fn nvme(&self) -> &NvmeTier {
        self.nvme
            .as_ref()
            .expect("a plan with extents has an NVMe tier")
    }

    /// The extent group and side of extent buffer `buf`.
    fn extent_of(&self, buf: BufId) -> (usize, ExtentSide) {
        let BufKind::Extent { group, side } = self.plan.buffer(buf).kind else {
            panic!("buffer {} is not an extent", self.plan.buffer(buf).name);
        };
        (group, side)
    }

    /// The extent group an NVMe transfer of extent buffer `buf` moves.
    pub(super) fn extent_group(&self, buf: BufId) -> usize {
        self.extent_of(buf).0
    }

    /// Starts writing `buf` to the extent of `to` (see [`NvmeTier::write`]).
    pub(super) fn write_extent<B: IoBuf>(
        &self,
        to: BufId,
        buf: B,
    ) -> Result<Pending<B>, ExecError> {
        let (group, side) = self.extent_of(to);
        self.nvme().write(group, side, buf)
    }

    /// Starts reading the first `bytes` of the extent of `from` into `buf` (see
    /// [`NvmeTier::read`]).
    pub(super) fn read_extent<B: IoBuf>(
        &self,
        from: BufId,
        buf: B,
        bytes: u64,
    ) -> Result<Pending<B>, ExecError> {
        let (group, side) = self.extent_of(from);
        self.nvme().read(group, side, buf, bytes)
    }

    /// Where buffer `buf` lives in the device arena.
    pub(super) fn device_range(&self, buf: BufId) -> DeviceRange {
        self.arenas.device_range(&self.plan, buf)
    }

    /// Where buffer `buf` lives in the host arena.
    pub(super) fn host_range(&self, buf: BufId) -> HostRange {
        self.arenas.host_range(&self.plan, buf)
    }

    /// The pinned host arena.
    pub(super) fn host(&self) -> &HostArena {
        &self.arenas.host
    }

    /// Wraps a device error with the operation's name, made only if there is an error.
    pub(super) fn device_error(
        &self,
        op: impl fmt::Display,
    ) -> impl FnOnce(EngineError) -> ExecError {
        move |source| ExecError::Device {
            op: op.to_string(),
            source,
        }
    }

    /// A host staging arena for loading and exporting: `bytes`, pinned as the device
    /// pins.
    pub(super) fn staging(&self, bytes: usize) -> Result<HostArena, ExecError> {
        HostArena::new("staging", bytes, &self.device.pinning())
            .map_err(self.device_error("allocating host staging"))
    }

    /// The first `bytes` of buffer `buf` lent to host work on `lane` (`write`: to write
    /// it): device memory where the plan put `buf` there (the CPU device), else what
    /// `host` makes of its host-arena range.
    pub(super) fn lend<H>(
        &self,
        buf: BufId,
        bytes: usize,
        lane: Lane,
        write: bool,
        host: impl FnOnce(HostRange) -> Result<H, EngineError>,
    ) -> Result<Lent<H>, EngineError> {
        self.lend_at(buf, 0, bytes, lane, write, host)
    }

    /// [`Executor::lend`] of `bytes` of `buf` from its byte `at`.
    pub(super) fn lend_at<H>(
        &self,
        buf: BufId,
        at: usize,
        bytes: usize,
        lane: Lane,
        write: bool,
        host: impl FnOnce(HostRange) -> Result<H, EngineError>,
    ) -> Result<Lent<H>, EngineError> {
        Ok(if self.plan.buffer(buf).tier == Tier::Device {
            let range = self.device_range(buf).sub(at, bytes);
            Lent::Device(self.device.direct(range, lane, write)?)
        } else {
            Lent::Host(host(self.host_range(buf).sub(at, bytes))?)
        })
    }

    /// The first `bytes` of gradient buffer `grads`, for host work on `lane`.
    pub(super) fn read_grads(
        &self,
        lane: Lane,
        grads: BufId,
        bytes: usize,
    ) -> Result<Lent<HostRead<'_>>, EngineError> {
        self.lend(grads, bytes, lane, false, |r| self.host().read(lane, r))
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
