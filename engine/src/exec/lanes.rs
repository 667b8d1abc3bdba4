//! The lanes of a step: one thread each, taking its operations in plan order.
//!
//! A host lane (NVMe reads, NVMe writes, the CPU optimizer) waits for each operation's
//! dependencies to be done (on the host: a stream operation's event), then runs it. An
//! NVMe lane does not wait for a transfer to end before it starts the next one: it keeps
//! up to `nvme_in_flight` transfers in flight, and marks each done once it has ended and
//! been verified, in order. It starts a transfer early only when the transfer's
//! dependencies are already done and it touches no extent a transfer in flight touches;
//! otherwise it first finishes those in flight, so it never waits on another lane while
//! holding back operations that lane may need. A
//! stream lane (H2D, compute, update, D2H) waits only until each dependency has been *issued*
//! (a host operation done, a stream operation submitted), turns dependencies on other
//! streams into stream waits on their events, and submits its operation to the device;
//! dependencies on its own stream are kept by the stream's order. The compute lane keeps
//! at most `run_ahead` operations in flight on the device.
//!
//! An error or a panic in any operation marks the step failed: every lane stops at its
//! next wait (reporting an abort, which the step does not show), and the step returns
//! the first real error, naming the lane and the operation.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use half::{bf16, f16};
use strata_kernels::adamw::{AdamStep, AdamW, CopyOut, GradStats, Grads, State, grad_stats};
use strata_kernels::isa::Isa;
use strata_kernels::program::{Scalars, read_stats, write_stats};
use strata_storage::{IoBuf, Pending};

use super::{ExecError, Executor, Fault, Norm, StepShared, panic_message};
use crate::device::{Bindings, Device, DirectAccess, Event, cast, cast_mut};
use crate::lane::Lane;
use crate::memory::{HostLease, HostRange, HostRead};
use crate::model::{Bind, TensorSpec};
use crate::plan::{
    Binds, BufId, BufKind, CommOp, GradSource, HostOp, NvmeOp, OpId, OpKind, Precision, StreamOp,
    Tier,
};

/// Whether `e` only says the lane stopped for another's failure.
pub(super) fn is_abort(e: &ExecError) -> bool {
    matches!(e, ExecError::Aborted)
}

/// Seeded waits for chaos runs (xorshift64*).
struct Jitter(u64);

impl Jitter {
    fn delay(&mut self) -> Duration {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32;
        if r & 1 == 0 {
            Duration::ZERO
        } else {
            Duration::from_micros((r >> 1) % 2000)
        }
    }
}

/// What a lane thread reuses from operation to operation and from step to step, so the
/// hot path allocates nothing: the compute lane's operations in flight, and the events
/// an operation waits for.
#[derive(Default)]
pub(super) struct LaneScratch {
    in_flight: VecDeque<OpId>,
    after: Vec<Event>,
    transfers: VecDeque<Transfer>,
}

/// An NVMe transfer an NVMe lane started and has not yet marked done.
pub(super) struct Transfer {
    id: OpId,
    /// The extent group it reads or writes.
    group: usize,
    started: Instant,
    pending: Pending<Lent<HostLease>>,
}

/// Memory lent to host work: a view or lease `H` of the host arena, or (on the CPU
/// device, where the plan puts the buffer in device memory) device memory. The NVMe
/// lanes move it, the CPU optimizer reads gradients from it and writes parameters into
/// it.
pub(super) enum Lent<H> {
    Host(H),
    Device(DirectAccess),
}

impl<H: std::ops::Deref<Target = [u8]>> std::ops::Deref for Lent<H> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Lent::Host(v) => v,
            Lent::Device(v) => v,
        }
    }
}

impl<H: std::ops::DerefMut<Target = [u8]>> std::ops::DerefMut for Lent<H> {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Lent::Host(v) => v,
            Lent::Device(v) => v,
        }
    }
}

// SAFETY: each variant is an IoBuf; this only forwards to it.
unsafe impl<H: IoBuf> IoBuf for Lent<H> {
    fn as_ptr(&self) -> *const u8 {
        match self {
            Lent::Host(b) => b.as_ptr(),
            Lent::Device(b) => b.as_ptr(),
        }
    }
    fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            Lent::Host(b) => b.as_mut_ptr(),
            Lent::Device(b) => b.as_mut_ptr(),
        }
    }
    fn capacity_bytes(&self) -> usize {
        match self {
            Lent::Host(b) => b.capacity_bytes(),
            Lent::Device(b) => b.capacity_bytes(),
        }
    }
}

impl Executor {
    /// Runs `lane`'s operations of this step.
    pub(super) fn run_lane(
        &self,
        lane: Lane,
        shared: &StepShared<'_>,
        scratch: &mut LaneScratch,
    ) -> Result<(), ExecError> {
        let LaneScratch {
            in_flight,
            after,
            transfers,
        } = scratch;
        in_flight.clear();
        after.clear();
        transfers.clear();
        let mut jitter = self
            .chaos
            .map(|seed| Jitter((seed ^ (lane.index() as u64 + 11).wrapping_mul(0x9e37_79b9)) | 1));
        let guarded = |id: OpId, f: &mut dyn FnMut() -> Result<bool, ExecError>| {
            std::panic::catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
                Err(ExecError::Panicked {
                    lane,
                    op: self.plan.op(id).kind.label().to_string(),
                    message: panic_message(&*panic),
                })
            })
        };
        for &id in &self.plan.lanes[lane.index()] {
            if self.is_issued(id, shared) {
                continue; // not part of this run
            }
            let result = guarded(id, &mut || {
                if let Some(label) = &self.panic_at
                    && *label == self.plan.op(id).kind.label().to_string()
                {
                    panic!("injected panic");
                }
                match shared.fail_at {
                    Some((at, Fault::Error)) if at == id.index() => {
                        return Err(ExecError::Injected {
                            op: self.plan.op(id).kind.label().to_string(),
                        });
                    }
                    Some((at, Fault::Panic)) if at == id.index() => panic!("injected panic"),
                    _ => {}
                }
                if lane.is_stream() {
                    self.submit_op(lane, id, shared, in_flight, after)?;
                    return Ok(true);
                }
                if let Some(j) = &mut jitter {
                    std::thread::sleep(j.delay());
                }
                if self.transfer_group(id).is_some() {
                    self.start_transfer(id, shared, transfers)
                } else {
                    // An operation of this lane that waits for a transfer of it (a
                    // commit after its write) would wait forever for it to be marked.
                    if !self.deps_done(id, shared) {
                        self.finish_transfers(transfers, 0, shared)?;
                    }
                    self.run_host_op(id, shared).map(|()| true)
                }
            });
            match result {
                // Done now; a transfer started is marked done when it is finished.
                Ok(true) => self.mark_done(id, shared),
                Ok(false) => {}
                Err(e) => {
                    let e = self.fail(e);
                    transfers.clear(); // dropping a transfer waits for it
                    return Err(e);
                }
            }
        }
        while let Some(id) = transfers.front().map(|t| t.id) {
            let finished = guarded(id, &mut || {
                let keep = transfers.len() - 1;
                self.finish_transfers(transfers, keep, shared)
                    .map(|()| false)
            });
            if let Err(e) = finished {
                let e = self.fail(e);
                transfers.clear();
                return Err(e);
            }
        }
        Ok(())
    }

    /// Marks operation `id` done (a host operation) or issued (a stream one) in this
    /// step, and wakes the lanes waiting for it.
    fn mark_done(&self, id: OpId, shared: &StepShared<'_>) {
        self.ops[id.index()]
            .issued
            .store(shared.stamp, Ordering::Release);
        self.notify();
    }

    /// Marks the step failed with `e` (the first failure aborts the other ranks' too)
    /// and wakes every lane, so each stops at its next wait; returns `e`.
    fn fail(&self, e: ExecError) -> ExecError {
        let first = !self.failed.swap(true, Ordering::SeqCst);
        if first && !is_abort(&e) && self.comm.size() > 1 {
            // The other ranks would wait for this one's next collective forever.
            self.comm.abort(&e.to_string());
        }
        self.notify();
        e
    }

    /// The extent group an NVMe transfer operation reads or writes; none for every
    /// other operation.
    fn transfer_group(&self, id: OpId) -> Option<usize> {
        let extent = match self.plan.op(id).kind {
            OpKind::Nvme(NvmeOp::Read { from, .. }) => from,
            OpKind::Nvme(NvmeOp::Write { to, .. }) => to,
            _ => return None,
        };
        match self.plan.buffer(extent).kind {
            BufKind::Extent { group, .. } => Some(group),
            _ => None,
        }
    }

    /// Starts NVMe transfer `id` once its dependencies are done, keeping at most
    /// `nvme_in_flight` transfers of this lane in flight. Returns whether it is done
    /// already (a write of an update the step skipped moves nothing).
    fn start_transfer(
        &self,
        id: OpId,
        shared: &StepShared<'_>,
        transfers: &mut VecDeque<Transfer>,
    ) -> Result<bool, ExecError> {
        let group = self.transfer_group(id).expect("an NVMe transfer");
        // Waiting with transfers held back could wait for an operation that needs one
        // of them; two transfers of one extent keep the lane's order.
        let drain = !self.deps_done(id, shared) || transfers.iter().any(|t| t.group == group);
        let keep = if drain { 0 } else { self.nvme_in_flight - 1 };
        self.finish_transfers(transfers, keep, shared)?;
        self.wait_deps(id, shared)?;
        let started = Instant::now();
        let op = self.plan.op(id);
        let device = self.device_error(op.kind.label());
        let store = self
            .store
            .as_ref()
            .expect("a plan with extents has a store");
        let pending = match op.kind {
            OpKind::Nvme(NvmeOp::Read { from, into }) => {
                let bytes = self.plan.buffer(into).bytes as usize;
                let target = self
                    .lend(into, bytes, op.lane, true, |r| {
                        self.host.lease(op.lane, r, true)
                    })
                    .map_err(device)?;
                self.read_extent(store, from, target, op.bytes)?
            }
            OpKind::Nvme(NvmeOp::Write {
                from,
                to,
                with_update,
            }) => {
                if with_update && self.skipped() {
                    self.record_span(id, started, Instant::now(), shared);
                    return Ok(true);
                }
                let lease = self
                    .host
                    .lease(op.lane, self.host_range(from), false)
                    .map_err(device)?;
                self.write_extent(store, to, Lent::Host(lease))?
            }
            _ => unreachable!("{} is not an NVMe transfer", op.kind.label()),
        };
        transfers.push_back(Transfer {
            id,
            group,
            started,
            pending,
        });
        Ok(false)
    }

    /// Whether operation `d` is done (a host one) or issued (a stream one) in this step.
    fn is_issued(&self, d: OpId, shared: &StepShared<'_>) -> bool {
        self.ops[d.index()].issued.load(Ordering::Acquire) == shared.stamp
    }

    /// Whether every dependency of `id` is done (or, on a stream, issued) already.
    fn deps_done(&self, id: OpId, shared: &StepShared<'_>) -> bool {
        shared.deps[id.index()]
            .iter()
            .all(|&d| self.is_issued(d, shared))
    }

    /// Finishes the oldest transfers in flight until at most `keep` are.
    fn finish_transfers(
        &self,
        transfers: &mut VecDeque<Transfer>,
        keep: usize,
        shared: &StepShared<'_>,
    ) -> Result<(), ExecError> {
        while transfers.len() > keep {
            let t = transfers.pop_front().expect("a transfer in flight");
            self.finish_transfer(t, shared)?;
        }
        Ok(())
    }

    /// Waits for transfer `t` to end (and its checksum to be verified), records its span
    /// and marks it done.
    fn finish_transfer(&self, t: Transfer, shared: &StepShared<'_>) -> Result<(), ExecError> {
        let (result, lease) = t.pending.wait();
        drop(lease);
        self.record_span(t.id, t.started, Instant::now(), shared);
        result.map_err(|source| ExecError::Storage {
            op: self.plan.op(t.id).kind.label().to_string(),
            source,
        })?;
        self.mark_done(t.id, shared);
        Ok(())
    }

    /// Records that operation `id` ran from `started` to `ended`.
    fn record_span(&self, id: OpId, started: Instant, ended: Instant, shared: &StepShared<'_>) {
        let ns = |t: Instant| t.saturating_duration_since(shared.start).as_nanos() as u64;
        let span = &self.ops[id.index()].span;
        span[0].store(ns(started), Ordering::Relaxed);
        span[1].store(ns(ended).max(ns(started) + 1), Ordering::Relaxed);
    }

    /// Waits until every dependency of host operation `id` is done (a stream one's
    /// event, on the host).
    fn wait_deps(&self, id: OpId, shared: &StepShared<'_>) -> Result<(), ExecError> {
        for &d in &shared.deps[id.index()] {
            self.wait_issued(d, shared)?;
            if self.plan.op(d).lane.is_stream()
                && let Some(e) = self.event_of(d)
            {
                e.wait()
                    .map_err(self.device_error(self.plan.op(d).kind.label()))?;
            }
        }
        Ok(())
    }

    fn notify(&self) {
        drop(self.wake.0.lock().unwrap_or_else(|e| e.into_inner()));
        self.wake.1.notify_all();
    }

    /// Waits until operation `d` has been issued in this step (done, for a host
    /// operation; submitted, for a stream one); an abort when another lane failed.
    fn wait_issued(&self, d: OpId, shared: &StepShared<'_>) -> Result<(), ExecError> {
        let issued = || self.is_issued(d, shared);
        if issued() {
            return Ok(());
        }
        let mut guard = self.wake.0.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if self.failed.load(Ordering::SeqCst) {
                return Err(ExecError::Aborted);
            }
            if issued() {
                return Ok(());
            }
            guard = self
                .wake
                .1
                .wait_timeout(guard, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The event of stream operation `d`, once issued (none when it had nothing to do).
    fn event_of(&self, d: OpId) -> Option<Event> {
        self.ops[d.index()]
            .event
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Submits stream operation `id` once its dependencies are issued.
    fn submit_op(
        &self,
        lane: Lane,
        id: OpId,
        shared: &StepShared<'_>,
        in_flight: &mut VecDeque<OpId>,
        after: &mut Vec<Event>,
    ) -> Result<(), ExecError> {
        after.clear();
        for &d in &shared.deps[id.index()] {
            let dep_lane = self.plan.op(d).lane;
            if dep_lane == lane {
                continue; // the stream's own order
            }
            self.wait_issued(d, shared)?;
            if dep_lane.is_stream()
                && let Some(e) = self.event_of(d)
            {
                after.push(e);
            }
        }
        if lane == Lane::Compute {
            while in_flight.len() >= self.run_ahead {
                let oldest = in_flight.pop_front().expect("non-empty");
                if let Some(e) = self.event_of(oldest) {
                    e.wait()
                        .map_err(self.device_error(self.plan.op(oldest).kind.label()))?;
                }
            }
        }
        let label = || self.plan.op(id).kind.label();
        let start = match self.device {
            Device::Cuda(_) => Some(
                self.device
                    .record(lane)
                    .map_err(self.device_error(label()))?,
            ),
            Device::Cpu(_) => None,
        };
        let event = self.submit(id, after, shared)?;
        let state = &self.ops[id.index()];
        *state.start.lock().unwrap_or_else(|e| e.into_inner()) = start;
        let has_event = event.is_some();
        *state.event.lock().unwrap_or_else(|e| e.into_inner()) = event;
        if lane == Lane::Compute && has_event {
            in_flight.push_back(id);
        }
        Ok(())
    }

    fn skipped(&self) -> bool {
        self.norm.lock().unwrap_or_else(|e| e.into_inner()).skip
    }

    /// Binds a compute operation's buffers.
    fn bindings(&self, binds: &Binds) -> Bindings {
        let rows = self.plan.shape.batch * self.plan.shape.seq;
        let mut out = Bindings::default();
        let mut bind = |at: Bind, buf: Option<BufId>| {
            if let Some(buf) = buf {
                out.set(at as u8, self.device_range(buf));
            }
        };
        bind(Bind::Params, binds.params);
        bind(Bind::Grads, binds.grads);
        bind(Bind::TiedParams, binds.tied_params);
        bind(Bind::TiedGrads, binds.tied_grads);
        bind(Bind::Input, binds.input);
        bind(Bind::Output, binds.output);
        bind(Bind::DOutput, binds.d_output);
        bind(Bind::DInput, binds.d_input);
        bind(Bind::Losses, binds.losses);
        bind(Bind::Saved, binds.saved);
        bind(Bind::Scratch, Some(self.plan.scratch));
        if let Some(tokens) = binds.tokens {
            let r = self.device_range(tokens);
            out.set(Bind::Tokens as u8, r.sub(0, 4 * rows));
            out.set(Bind::Targets as u8, r.sub(4 * rows, 4 * rows));
        }
        out
    }

    /// AdamW's constants for this step, with and without weight decay, gradients scaled
    /// by `coef / update_loss_scale`.
    fn adam_steps(&self, shared: &StepShared<'_>, coef: f32) -> Result<[AdamStep; 2], ExecError> {
        let hp = shared.params.adam;
        let scale = coef / shared.update_loss_scale;
        let adam_err = |source| ExecError::Adam {
            op: "AdamW constants".into(),
            source,
        };
        let decayed = AdamStep::new(&hp, shared.adam_step, scale).map_err(adam_err)?;
        let plain = AdamStep::new(
            &AdamW {
                weight_decay: 0.0,
                ..hp
            },
            shared.adam_step,
            scale,
        )
        .map_err(adam_err)?;
        Ok([decayed, plain])
    }

    /// Submits stream operation `id` after `after`; its event, or none when it had
    /// nothing to do (an update's copy in a skipped step).
    fn submit(
        &self,
        id: OpId,
        after: &[Event],
        shared: &StepShared<'_>,
    ) -> Result<Option<Event>, ExecError> {
        let op = self.plan.op(id);
        let err = self.device_error(op.kind.label());
        let event = match op.kind {
            OpKind::Stream(StreamOp::H2d {
                from,
                to,
                bytes,
                convert,
                with_update,
            }) => {
                if with_update && self.skipped() {
                    return Ok(None);
                }
                let bytes = bytes as usize;
                let device_bytes = convert.map_or(bytes, |(a, b)| bytes / a.size() * b.size());
                let src = self.host_range(from).prefix(bytes);
                let dst = self.device_range(to).sub(0, device_bytes);
                self.device
                    .copy_to_device(&self.host, src, dst, convert, after)
            }
            OpKind::Stream(StreamOp::D2h { from, to, bytes }) => {
                let bytes = bytes as usize;
                let src = self.device_range(from).sub(0, bytes);
                let dst = self.host_range(to).prefix(bytes);
                self.device.copy_to_host(src, &self.host, dst, after)
            }
            OpKind::Stream(StreamOp::Compute {
                block,
                pass,
                ref binds,
                ..
            }) => {
                let scalars = Scalars {
                    dloss: shared.params.loss_scale / shared.counted_targets as f32,
                    ..Scalars::default()
                };
                let program = &self.programs.compute[block][pass.index()];
                self.device
                    .run_program(op.lane, program, &self.bindings(binds), &scalars, after)
            }
            OpKind::Stream(StreamOp::Accumulate { block, from, to }) => {
                let mut b = Bindings::default();
                b.set(Bind::Grads as u8, self.device_range(to));
                b.set(Bind::GradsIn as u8, self.device_range(from));
                self.device.run_program(
                    op.lane,
                    &self.programs.accumulate[block],
                    &b,
                    &Scalars::default(),
                    after,
                )
            }
            OpKind::Stream(StreamOp::DeviceStats {
                block,
                grads,
                stats,
            }) => {
                let mut b = Bindings::default();
                b.set(Bind::Grads as u8, self.device_range(grads));
                b.set(Bind::Stats as u8, self.device_range(stats));
                b.set(
                    Bind::Scratch as u8,
                    self.device_range(self.plan.stats_scratch),
                );
                let scalars = Scalars {
                    stats_scale: 1.0 / shared.update_loss_scale,
                    ..Scalars::default()
                };
                self.device
                    .run_program(op.lane, &self.programs.stats[block], &b, &scalars, after)
            }
            OpKind::Stream(StreamOp::DeviceUpdate {
                block,
                grads,
                state,
                params,
            }) => {
                if self.applied[block].load(Ordering::Acquire) >= shared.adam_step {
                    return Ok(None); // committed before a failure: a retry skips it
                }
                let Norm { coef, skip, .. } = *self.norm.lock().unwrap_or_else(|e| e.into_inner());
                let [decayed, plain] = self.adam_steps(shared, coef)?;
                let scalars = Scalars {
                    adam: Some(decayed),
                    adam_no_decay: Some(plain),
                    skip_update: skip,
                    ..Scalars::default()
                };
                let mut b = Bindings::default();
                b.set(Bind::Grads as u8, self.device_range(grads));
                b.set(Bind::State as u8, self.device_range(state));
                b.set(Bind::Params as u8, self.device_range(params));
                let program = self.programs.update[block]
                    .as_ref()
                    .expect("an update program for a block whose state is on the device");
                self.device
                    .run_program(op.lane, program, &b, &scalars, after)
            }
            _ => unreachable!("{} is not a stream operation", op.kind.label()),
        };
        event.map(Some).map_err(err)
    }

    /// Waits for host operation `id`'s dependencies, then runs it, recording its span.
    fn run_host_op(&self, id: OpId, shared: &StepShared<'_>) -> Result<(), ExecError> {
        self.wait_deps(id, shared)?;
        let started = Instant::now();
        self.host_op(id, shared)?;
        self.record_span(id, started, Instant::now(), shared);
        Ok(())
    }

    /// A host operation itself.
    fn host_op(&self, id: OpId, shared: &StepShared<'_>) -> Result<(), ExecError> {
        let op = self.plan.op(id);
        let label = || op.kind.label().to_string();
        let lane = op.lane;
        let err = |source| ExecError::Device {
            op: label(),
            source,
        };
        match op.kind {
            OpKind::Host(HostOp::Accumulate { block, from, to }) => {
                let bytes = 4 * self.model.blocks()[block].len;
                let src = self
                    .host
                    .read(lane, self.host_range(from).prefix(bytes))
                    .map_err(err)?;
                let mut dst = self
                    .host
                    .write(lane, self.host_range(to).prefix(bytes))
                    .map_err(err)?;
                strata_kernels::ops::add_inplace(
                    &self.cpu,
                    cast_mut::<f32>(&mut dst),
                    cast::<f32>(&src),
                );
                Ok(())
            }
            OpKind::Host(HostOp::Stats {
                block,
                grads,
                stats,
            }) => {
                let scale = 1.0 / shared.update_loss_scale;
                let s = self.host_stats(id, block, grads, scale)?;
                let mut out = self
                    .host
                    .write(lane, self.host_range(stats).prefix(16))
                    .map_err(err)?;
                write_stats(&mut out, s);
                Ok(())
            }
            OpKind::Collective(CommOp::GradNorm { ref grads }) => {
                let total = self.ranks_norm(grads, shared)?;
                self.set_norm(total, shared);
                Ok(())
            }
            OpKind::Host(HostOp::GradNorm { ref sources }) => {
                let scale = 1.0 / shared.update_loss_scale;
                let mut total = GradStats::default();
                for &(block, source) in sources {
                    let stats = match source {
                        GradSource::Host(grads) => self.host_stats(id, block, grads, scale)?,
                        GradSource::Stats(stats) => {
                            let bytes = self
                                .host
                                .read(lane, self.host_range(stats).prefix(16))
                                .map_err(err)?;
                            read_stats(&bytes)
                        }
                    };
                    total = total.merge(stats);
                }
                self.set_norm(total, shared);
                Ok(())
            }
            OpKind::Collective(CommOp::AllGather {
                from,
                into,
                with_update,
                block,
            }) => {
                if with_update && self.skipped() {
                    return Ok(()); // every rank skips alike: the norm is global
                }
                if self.plan.buffer(from).tier == Tier::Device {
                    // Over device memory: the device's collective.
                    let shard =
                        self.plan.shard_len[block] as usize * self.plan.shape.device_dtype().size();
                    let src = self.device_range(from).sub(0, shard);
                    let dst = self.device_range(into).sub(0, shard * self.comm.size());
                    return self
                        .device
                        .all_gather(self.comm.as_ref(), src, dst)
                        .map_err(|e| self.device_collective_error(label(), e));
                }
                let bytes = self.plan.shard_len[block] as usize
                    * self.plan.shape.precision.param_bytes() as usize;
                let src = self
                    .host
                    .read(lane, self.host_range(from).prefix(bytes))
                    .map_err(err)?;
                let mut dst = self
                    .host
                    .write(lane, self.host_range(into).prefix(bytes * self.comm.size()))
                    .map_err(err)?;
                self.comm
                    .all_gather(&src, &mut dst)
                    .map_err(|e| self.comm_error(label(), e))
            }
            OpKind::Collective(CommOp::ReduceScatter {
                block,
                from,
                into,
                scratch,
                accumulate,
            }) => {
                let shard = self.plan.shard_len[block] as usize;
                if self.plan.buffer(from).tier == Tier::Device {
                    // Over device memory: the device's collective. What the backward did
                    // not write (past the block's end) lands in padding no one reads.
                    let full = 4 * shard * self.comm.size();
                    let src = self.device_range(from).sub(0, full);
                    let dst = self.device_range(into).sub(0, 4 * shard);
                    let scratch = scratch.map(|s| self.device_range(s).sub(0, full));
                    return self
                        .device
                        .reduce_scatter(self.comm.as_ref(), src, dst, scratch, accumulate)
                        .map_err(|e| self.device_collective_error(label(), e));
                }
                // The copy from the device filled the block's elements; what is past them
                // goes as it is, and lands in padding no one reads (the optimizer and the
                // norm read a shard's elements of the block only).
                let send = self
                    .host
                    .read(
                        lane,
                        self.host_range(from).prefix(4 * shard * self.comm.size()),
                    )
                    .map_err(err)?;
                let mut acc = self
                    .host
                    .write(lane, self.host_range(into).prefix(4 * shard))
                    .map_err(err)?;
                self.comm
                    .reduce_scatter_sum(cast::<f32>(&send), cast_mut::<f32>(&mut acc), accumulate)
                    .map_err(|e| self.comm_error(label(), e))
            }
            OpKind::Host(HostOp::Optimizer {
                block,
                grads,
                state,
                params_out,
            }) => self.host_adamw(block, grads, state, params_out, shared),
            OpKind::Nvme(NvmeOp::Commit { block }) => {
                if self.skipped() {
                    return Ok(());
                }
                self.extents
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .commit(&self.plan, block);
                if self.plan.homes[block][2] == Tier::Nvme {
                    self.applied[block].store(shared.adam_step, Ordering::Release);
                }
                Ok(())
            }
            _ => unreachable!("{} is not a host operation", label()),
        }
    }

    /// The first `bytes` of buffer `buf` lent to host work on `lane` (`write`: to write
    /// it): device memory where the plan put `buf` there (the CPU device), else what
    /// `host` makes of its host-arena range.
    fn lend<H>(
        &self,
        buf: BufId,
        bytes: usize,
        lane: Lane,
        write: bool,
        host: impl FnOnce(HostRange) -> Result<H, crate::EngineError>,
    ) -> Result<Lent<H>, crate::EngineError> {
        Ok(if self.plan.buffer(buf).tier == Tier::Device {
            let range = self.device_range(buf).sub(0, bytes);
            Lent::Device(self.device.direct(range, lane, write)?)
        } else {
            Lent::Host(host(self.host_range(buf).prefix(bytes))?)
        })
    }

    /// The first `bytes` of gradient buffer `grads`, for host work on `lane`.
    fn read_grads(
        &self,
        lane: Lane,
        grads: BufId,
        bytes: usize,
    ) -> Result<Lent<HostRead<'_>>, crate::EngineError> {
        self.lend(grads, bytes, lane, false, |r| self.host.read(lane, r))
    }

    /// The statistics of block `block`'s host gradients `grads`, scaled by `scale`
    /// (operation `id`'s work: the norm's, or a spill's).
    fn host_stats(
        &self,
        id: OpId,
        block: usize,
        grads: BufId,
        scale: f32,
    ) -> Result<GradStats, ExecError> {
        let op = self.plan.op(id);
        let label = || op.kind.label().to_string();
        let bytes = 4 * self.model.blocks()[block].len;
        let g = self
            .read_grads(op.lane, grads, bytes)
            .map_err(|source| ExecError::Device {
                op: label(),
                source,
            })?;
        grad_stats(
            self.cpu.isa,
            self.optimizer_threads,
            Grads::F32(cast::<f32>(&g)),
            scale,
        )
        .map_err(|source| ExecError::Adam {
            op: label(),
            source,
        })
    }

    /// Records the global norm of `total` and what it means for the update: the
    /// clipping coefficient, and whether the step is skipped (non-finite gradients).
    fn set_norm(&self, total: GradStats, shared: &StepShared<'_>) {
        let norm = total.norm();
        let clip = shared.params.clip;
        let coef = if clip > 0.0 && norm > clip {
            (clip / (norm + 1e-6)) as f32
        } else {
            1.0
        };
        *self.norm.lock().unwrap_or_else(|e| e.into_inner()) = Norm {
            norm,
            coef,
            skip: total.non_finite,
        };
    }

    /// The global gradient statistics with ranks: each rank's piece sums of its shards
    /// ([`strata_kernels::adamw::STATS_PIECE`]), gathered, and folded in the order one
    /// process folds them (block by block, each block's pieces in order), so the norm
    /// is the same bits as one process's.
    fn ranks_norm(
        &self,
        grads: &[(usize, BufId)],
        shared: &StepShared<'_>,
    ) -> Result<GradStats, ExecError> {
        use strata_kernels::adamw::{STATS_PIECE, grad_stats_pieces};
        let label = || "grad norm".to_string();
        let scale = 1.0 / shared.update_loss_scale;
        let mut pieces = self.norm_pieces.lock().unwrap_or_else(|e| e.into_inner());
        let (mine, all) = &mut *pieces;
        mine.fill(0.0);
        let mut at = 0;
        for &(block, buf) in grads {
            let (_, shard, valid) = self.shard(block);
            let g = self
                .host
                .read(Lane::Comm, self.host_range(buf).prefix(4 * valid))
                .map_err(|source| ExecError::Device {
                    op: label(),
                    source,
                })?;
            let mut i = at;
            grad_stats_pieces(
                self.cpu.isa,
                self.optimizer_threads,
                Grads::F32(cast::<f32>(&g)),
                scale,
                &mut |s| {
                    mine[i] = s.sum_squares;
                    i += 1;
                },
            )
            .map_err(|source| ExecError::Adam {
                op: label(),
                source,
            })?;
            at += shard.div_ceil(STATS_PIECE);
        }
        self.comm
            .all_gather(
                crate::device::bytes_of(mine),
                crate::device::bytes_of_mut(all),
            )
            .map_err(|e| self.comm_error(label(), e))?;
        let per_rank = mine.len();
        let mut total = GradStats::default();
        let mut at = 0;
        for &(block, _) in grads {
            let n = (self.plan.shard_len[block] as usize).div_ceil(STATS_PIECE);
            let mut sum = GradStats::default();
            for r in 0..self.comm.size() {
                for &x in &all[r * per_rank + at..r * per_rank + at + n] {
                    sum = sum.merge(GradStats {
                        sum_squares: x,
                        non_finite: !x.is_finite(),
                    });
                }
            }
            total = total.merge(sum);
            at += n;
        }
        Ok(total)
    }

    /// A collective's failure: this rank's own abort (after another lane failed) is an
    /// abort, anything else names the operation.
    /// A device collective's error: the group's, as `comm_error` gives it, or
    /// the device's.
    fn device_collective_error(&self, op: String, e: crate::EngineError) -> ExecError {
        match e {
            crate::EngineError::Collective { source, .. } => self.comm_error(op, *source),
            source => ExecError::Device { op, source },
        }
    }

    fn comm_error(&self, op: String, source: strata_comm::CommError) -> ExecError {
        if self.failed.load(Ordering::SeqCst) {
            ExecError::Aborted
        } else {
            ExecError::Comm { op, source }
        }
    }

    /// AdamW on the CPU over block `block`: gradients, state and the new working
    /// parameters in the host arena.
    fn host_adamw(
        &self,
        block: usize,
        grads: BufId,
        state: BufId,
        params_out: Option<BufId>,
        shared: &StepShared<'_>,
    ) -> Result<(), ExecError> {
        let label = || format!("adamw {block}");
        let Norm { coef, skip, .. } = *self.norm.lock().unwrap_or_else(|e| e.into_inner());
        if skip {
            return Ok(());
        }
        // With ranks, this rank's shard: `valid` of its `len` elements are the block's,
        // from element `lo` on (the rest is padding, left alone).
        let (lo, len, valid) = self.shard(block);
        let err = |source| ExecError::Device {
            op: label(),
            source,
        };
        let adam_err = |source| ExecError::Adam {
            op: label(),
            source,
        };
        let g = self.read_grads(Lane::Cpu, grads, 4 * len).map_err(err)?;
        let gslice = cast::<f32>(&g);
        if !self.plan.shape.needs_global_norm {
            let s = grad_stats(
                self.cpu.isa,
                self.optimizer_threads,
                Grads::F32(gslice),
                1.0 / shared.update_loss_scale,
            )
            .map_err(adam_err)?;
            self.block_stats.lock().unwrap_or_else(|e| e.into_inner())[block] = Some(s);
        }
        let steps = self.adam_steps(shared, coef)?;
        let mut st = self
            .host
            .write(Lane::Cpu, self.host_range(state).prefix(12 * len))
            .map_err(err)?;
        let f = cast_mut::<f32>(&mut st);
        let (master, rest) = f.split_at_mut(len);
        let (m, v) = rest.split_at_mut(len);
        let precision = self.plan.shape.precision;
        let pbytes = precision.param_bytes() as usize;
        let mut out = match params_out {
            Some(buf) => Some(
                self.lend(buf, len * pbytes, Lane::Cpu, true, |r| {
                    self.host.write(Lane::Cpu, r)
                })
                .map_err(err)?,
            ),
            None => None,
        };
        if self.applied[block].load(Ordering::Acquire) >= shared.adam_step {
            // Committed before a failure of this step: the retry applies nothing again,
            // and writes the working parameters anew from the master copy.
            if let Some(out) = &mut out {
                super::write_working(precision, master, out);
            }
            return Ok(());
        }
        let tensors = &self.model.blocks()[block].tensors;
        let (isa, threads) = (self.cpu.isa, self.optimizer_threads);
        let update = |out: WorkingOut<'_>, master: &mut [f32], m: &mut [f32], v: &mut [f32]| {
            update_block(
                tensors,
                lo..lo + valid,
                [&steps[0], &steps[1]],
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
        let out = out.as_deref_mut();
        match (precision, out) {
            (Precision::Fp32, out) => {
                update(WorkingOut::None, master, m, v)?;
                if let Some(out) = out {
                    cast_mut::<f32>(out).copy_from_slice(master);
                }
            }
            (Precision::Bf16, Some(out)) => {
                update(WorkingOut::Bf16(cast_mut::<bf16>(out)), master, m, v)?
            }
            (Precision::Fp16, Some(out)) => {
                update(WorkingOut::F16(cast_mut::<f16>(out)), master, m, v)?
            }
            (_, None) => unreachable!("only fp32 working parameters share the master copy"),
        }
        if self.plan.homes[block][2] == Tier::Host {
            // Updated in place: applied now (NVMe-homed state counts at its commit).
            self.applied[block].store(shared.adam_step, Ordering::Release);
        }
        Ok(())
    }
}

/// Where the optimizer writes a block's new working parameters, if anywhere.
enum WorkingOut<'a> {
    None,
    Bf16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

/// AdamW over the elements `range` of one block (the whole block, or a rank's shard of
/// it, whose slices start at `range.start`), tensor by tensor: `steps[0]` (with weight
/// decay) for tensors that decay, `steps[1]` for the others. Alignment gaps and a
/// shard's padding are left alone (zero). AdamW is elementwise, so a shard's update is
/// the same bits as those elements' in the whole block's.
#[allow(clippy::too_many_arguments)]
fn update_block(
    tensors: &[TensorSpec],
    range: std::ops::Range<usize>,
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
        let start = t.slot.offset.max(range.start);
        let end = (t.slot.offset + t.slot.len).min(range.end);
        if start >= end {
            continue;
        }
        let (skip, take) = (start - range.start - done, end - start);
        done = end - range.start;
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
