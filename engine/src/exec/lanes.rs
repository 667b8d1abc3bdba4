//! The lanes of a step: one thread each, taking its operations in plan order, each
//! operation dispatched by its family (the plan types operations by the lanes that run
//! them): stream work to `stream.rs`, host arithmetic to `host.rs`, collectives to
//! `comm.rs`, NVMe transfers and commits here.
//!
//! A host lane (NVMe reads, NVMe writes, the CPU optimizer, collectives) waits for each
//! operation's dependencies to be done (on the host: a stream operation's event), then
//! runs it. An NVMe lane does not wait for a transfer to end before it starts the next
//! one: it keeps up to `nvme_in_flight` transfers in flight, and marks each done once it
//! has ended and been verified, in order. It starts a transfer early only when the
//! transfer's dependencies are already done and it touches no extent a transfer in flight
//! touches; otherwise it first finishes those in flight, so it never waits on another
//! lane while holding back operations that lane may need. A stream lane (H2D, compute,
//! update, D2H) waits only until each dependency has been *issued* (a host operation
//! done, a stream operation submitted), turns dependencies on other streams into stream
//! waits on their events, and submits its operation to the device; dependencies on its
//! own stream are kept by the stream's order. The compute lane keeps at most `run_ahead`
//! operations in flight on the device.
//!
//! An error or a panic in any operation marks the step failed: every lane stops at its
//! next wait (reporting an abort, which the step does not show), and the step returns
//! the first real error, naming the lane and the operation.
//!
//! Not here: what each family's operations do, or the threads the lanes run on
//! (`workers.rs`).

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::error::{ExecError, panic_message};
use super::executor::Executor;
use super::fault::Fault;
use super::lent::Lent;
use super::scratch::{LaneScratch, Transfer};
use super::step_state::StepShared;
use crate::device::{Device, Event};
use crate::lane::Lane;
use crate::plan::{BufId, NvmeOp, OpId, OpKind, StreamOp, Tier};

/// Seeded waits for chaos runs (xorshift64*).
struct Jitter(u64);

impl Jitter {
    /// The jitter of `lane` in a run seeded `seed`.
    fn of(seed: u64, lane: Lane) -> Self {
        Jitter((seed ^ (lane.index() as u64 + 11).wrapping_mul(0x9e37_79b9)) | 1)
    }

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

/// A host lane's chaos wait before an operation, when the run has one.
fn pause(jitter: &mut Option<Jitter>) {
    if let Some(j) = jitter {
        std::thread::sleep(j.delay());
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
        scratch.in_flight.clear();
        scratch.after.clear();
        scratch.transfers.clear();
        let mut jitter = self.limits.chaos.map(|seed| Jitter::of(seed, lane));
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
            if self.progress.is_issued(id, shared) {
                continue; // not part of this run
            }
            let result = guarded(id, &mut || {
                self.injected_fault(id, shared)?;
                self.dispatch(id, shared, scratch, &mut jitter)
            });
            match result {
                // Done now; a transfer started is marked done when it is finished.
                Ok(true) => self.progress.mark_done(id, shared),
                Ok(false) => {}
                Err(e) => {
                    let e = self.fail(e);
                    scratch.transfers.clear(); // dropping a transfer waits for it
                    return Err(e);
                }
            }
        }
        let transfers = &mut scratch.transfers;
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

    /// Fails operation `id` as the step's fault plan says, if it does (tests): with an
    /// error, or by panicking as a bug in it would.
    fn injected_fault(&self, id: OpId, shared: &StepShared<'_>) -> Result<(), ExecError> {
        match shared.fault_at(id) {
            None => Ok(()),
            Some(Fault::Error) => Err(ExecError::Injected {
                op: self.plan.op(id).kind.label().to_string(),
            }),
            Some(Fault::Panic) => panic!("injected panic"),
        }
    }

    /// Runs, submits or starts operation `id`, by its family; whether it is done already
    /// (an NVMe transfer started is not, until it is finished).
    fn dispatch(
        &self,
        id: OpId,
        shared: &StepShared<'_>,
        scratch: &mut LaneScratch,
        jitter: &mut Option<Jitter>,
    ) -> Result<bool, ExecError> {
        let op = self.plan.op(id);
        let transfers = &mut scratch.transfers;
        match &op.kind {
            OpKind::Stream(stream_op) => {
                self.submit_op(op.lane, id, stream_op, shared, scratch)?;
                Ok(true)
            }
            OpKind::Nvme(nvme_op) => {
                pause(jitter);
                self.nvme_op(id, nvme_op, shared, transfers)
            }
            OpKind::Host(host_op) => {
                pause(jitter);
                self.run_host_op(id, shared, transfers, || self.host_op(id, host_op, shared))
            }
            OpKind::Collective(comm_op) => {
                pause(jitter);
                self.run_host_op(id, shared, transfers, || self.comm_op(id, comm_op, shared))
            }
        }
    }

    /// NVMe operation `id`: a transfer started, or a commit run.
    fn nvme_op(
        &self,
        id: OpId,
        op: &NvmeOp,
        shared: &StepShared<'_>,
        transfers: &mut VecDeque<Transfer>,
    ) -> Result<bool, ExecError> {
        match *op {
            NvmeOp::Read { from, into, at } => {
                self.start_read(id, from, (into, at as usize), shared, transfers)
            }
            NvmeOp::Write {
                from,
                to,
                with_update,
            } => self.start_write(id, from, to, with_update, shared, transfers),
            NvmeOp::Commit { block } => {
                self.run_host_op(id, shared, transfers, || self.commit(block, shared))
            }
        }
    }

    /// Marks the step failed with `e` (the first failure aborts the other ranks' too)
    /// and wakes every lane, so each stops at its next wait; returns `e`.
    fn fail(&self, e: ExecError) -> ExecError {
        let first = !self.progress.failed.swap(true, Ordering::SeqCst);
        if first && !e.is_abort() && self.comm.size() > 1 {
            // The other ranks would wait for this one's next collective forever.
            self.comm.abort(&e.to_string());
        }
        self.progress.notify();
        e
    }

    /// Makes room for NVMe transfer `id` of extent group `group` and waits for its
    /// dependencies: keeps at most `nvme_in_flight` transfers of this lane in flight
    /// once it starts.
    fn before_transfer(
        &self,
        id: OpId,
        group: usize,
        shared: &StepShared<'_>,
        transfers: &mut VecDeque<Transfer>,
    ) -> Result<(), ExecError> {
        // Waiting with transfers held back could wait for an operation that needs one
        // of them; two transfers of one extent keep the lane's order.
        let drain =
            !self.progress.deps_done(id, shared) || transfers.iter().any(|t| t.group == group);
        let keep = if drain {
            0
        } else {
            self.limits.nvme_in_flight - 1
        };
        self.finish_transfers(transfers, keep, shared)?;
        self.wait_deps(id, shared)
    }

    /// Starts NVMe read `id` of extent `from` into `into` once its dependencies are
    /// done; it is done when finished.
    fn start_read(
        &self,
        id: OpId,
        from: BufId,
        (into, at): (BufId, usize),
        shared: &StepShared<'_>,
        transfers: &mut VecDeque<Transfer>,
    ) -> Result<bool, ExecError> {
        let group = self.extent_group(from);
        self.before_transfer(id, group, shared, transfers)?;
        let started = Instant::now();
        let op = self.plan.op(id);
        let bytes = self.plan.buffer(into).bytes as usize - at;
        let target = self
            .lend_at(into, at, bytes, op.lane, true, |r| {
                self.host().lease(op.lane, r, true)
            })
            .map_err(self.device_error(op.kind.label()))?;
        let pending = self.read_extent(from, target, op.bytes)?;
        transfers.push_back(Transfer {
            id,
            group,
            started,
            pending,
        });
        Ok(false)
    }

    /// Starts NVMe write `id` of `from` to extent `to` once its dependencies are done;
    /// done at once when it is part of an update the step skipped (it moves nothing),
    /// else when finished.
    fn start_write(
        &self,
        id: OpId,
        from: BufId,
        to: BufId,
        with_update: bool,
        shared: &StepShared<'_>,
        transfers: &mut VecDeque<Transfer>,
    ) -> Result<bool, ExecError> {
        let group = self.extent_group(to);
        self.before_transfer(id, group, shared, transfers)?;
        let started = Instant::now();
        if with_update && self.norms.skipped() {
            self.progress
                .record_span(id, started, Instant::now(), shared);
            return Ok(true);
        }
        let op = self.plan.op(id);
        let lease = self
            .host()
            .lease(op.lane, self.host_range(from), false)
            .map_err(self.device_error(op.kind.label()))?;
        let pending = self.write_extent(to, Lent::Host(lease))?;
        transfers.push_back(Transfer {
            id,
            group,
            started,
            pending,
        });
        Ok(false)
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
        self.progress
            .record_span(t.id, t.started, Instant::now(), shared);
        result.map_err(|source| ExecError::Storage {
            op: self.plan.op(t.id).kind.label().to_string(),
            source,
        })?;
        self.progress.mark_done(t.id, shared);
        Ok(())
    }

    /// Runs host operation `id` (its work `run`) once its dependencies are done,
    /// recording its span. An operation of an NVMe lane that waits for a transfer of it
    /// (a commit after its write) would wait forever for it to be marked: the lane's
    /// transfers in flight are finished first.
    fn run_host_op(
        &self,
        id: OpId,
        shared: &StepShared<'_>,
        transfers: &mut VecDeque<Transfer>,
        run: impl FnOnce() -> Result<(), ExecError>,
    ) -> Result<bool, ExecError> {
        if !self.progress.deps_done(id, shared) {
            self.finish_transfers(transfers, 0, shared)?;
        }
        self.wait_deps(id, shared)?;
        let started = Instant::now();
        run()?;
        self.progress
            .record_span(id, started, Instant::now(), shared);
        Ok(true)
    }

    /// Makes block `block`'s update durable (an NVMe commit): the spares its update
    /// wrote become current, and it counts the step as applied when its optimizer state
    /// is on NVMe. Nothing when the step skipped its update.
    fn commit(&self, block: usize, shared: &StepShared<'_>) -> Result<(), ExecError> {
        if self.norms.skipped() {
            return Ok(());
        }
        self.nvme().commit(block);
        if self.plan.homes[block][2] == Tier::Nvme {
            self.applied[block].store(shared.adam_step, Ordering::Release);
        }
        Ok(())
    }

    /// Waits until every dependency of host operation `id` is done (a stream one's
    /// event, on the host).
    fn wait_deps(&self, id: OpId, shared: &StepShared<'_>) -> Result<(), ExecError> {
        for &d in &shared.deps[id.index()] {
            self.progress.wait_issued(d, shared)?;
            if self.plan.op(d).lane.is_stream()
                && let Some(e) = self.progress.event_of(d)
            {
                e.wait()
                    .map_err(self.device_error(self.plan.op(d).kind.label()))?;
            }
        }
        Ok(())
    }

    /// Submits stream operation `id` once its dependencies are issued.
    fn submit_op(
        &self,
        lane: Lane,
        id: OpId,
        op: &StreamOp,
        shared: &StepShared<'_>,
        scratch: &mut LaneScratch,
    ) -> Result<(), ExecError> {
        let LaneScratch {
            in_flight, after, ..
        } = scratch;
        after.clear();
        for &d in &shared.deps[id.index()] {
            let dep_lane = self.plan.op(d).lane;
            if dep_lane == lane {
                continue; // the stream's own order
            }
            self.progress.wait_issued(d, shared)?;
            if dep_lane.is_stream()
                && let Some(e) = self.progress.event_of(d)
            {
                after.push(e);
            }
        }
        if lane == Lane::Compute {
            while in_flight.len() >= self.limits.run_ahead {
                let oldest = in_flight.pop_front().expect("non-empty");
                if let Some(e) = self.progress.event_of(oldest) {
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
        let event: Option<Event> = self.submit(id, op, after, shared)?;
        let has_event = event.is_some();
        self.progress.set_events(id, start, event);
        if lane == Lane::Compute && has_event {
            in_flight.push_back(id);
        }
        Ok(())
    }
}
