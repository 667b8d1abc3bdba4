//! A training step, as the executor runs it: checks the batch, writes it to the host
//! arena, starts every lane with work on its thread (`lanes.rs`), drains the device, and
//! reports: the mean loss, the gradient norm, each operation's span, lane busy times,
//! the compute lane's stall and the bytes each link moved. With a delayed update, the
//! step applies the last step's gradients while it computes; `flush` applies the last
//! ones alone. A failure on any lane ends the step with the first real error, the device
//! drained; every block is then wholly as before the step or wholly updated.
//!
//! Not here: the lanes' work (`lanes.rs` and the families of operations), or the faults a
//! test injects (`fault.rs`).

use std::sync::atomic::Ordering;
use std::time::Instant;

use strata_kernels::adamw::GradStats;
use strata_kernels::program::read_stats;

use super::config::StepParams;
use super::error::ExecError;
use super::executor::Executor;
use super::fault::{Fault, FaultPlan};
use super::report::{OpRecord, StepReport};
use super::scratch::LaneScratch;
use super::step_state::StepShared;
use crate::device::{Device, Event, KernelTimes, bytes_of, bytes_of_mut, cast, cast_mut};
use crate::lane::Lane;
use crate::model::IGNORE_TARGET;
use crate::plan::{BufId, OpId, OpKind, StreamOp};

impl Executor {
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
        self.counted_targets = self.count_targets(batches)?;
        if params.clip > 0.0 && !shape.needs_global_norm {
            return Err(ExecError::BadInput(
                "clipping needs a plan built with needs_global_norm".into(),
            ));
        }
        self.write_batches(batches)?;
        let delayed = shape.delayed_update;
        let run_update = !delayed || self.pending.is_some();
        let update_scale = if delayed {
            self.pending.unwrap_or(params.loss_scale)
        } else {
            params.loss_scale
        };
        let head = self.fetch_head(params)?;
        let mut report = self.run(params, Parts::step(run_update), update_scale)?;
        if let Some(head) = head {
            report.head_fetch = (head.seconds, head.link_bytes);
        }
        if delayed {
            for &(fill, apply) in &self.plan.swap_each_step {
                self.arenas.swap(fill, apply);
            }
            self.pending = Some(params.loss_scale);
        }
        report.updated = run_update && !report.skipped;
        if report.updated {
            self.commit_update();
        }
        // The end-of-step fetches ran with the update, and read what the next step
        // computes with: the homes (without a delayed update, whether or not it was
        // skipped), or the parameters a delayed update wrote, current only once applied.
        self.head_fetched =
            self.plan.fetches_next_step() && run_update && (!delayed || report.updated);
        Ok(report)
    }

    /// The positions whose loss counts in a step of `batches`: those whose target is not
    /// masked out by [`IGNORE_TARGET`], across the micro-batches; at least one, so that a
    /// step whose every target is masked has a zero loss and zero gradients rather than
    /// NaNs. With ranks, across every rank's micro-batches (a step is the same
    /// computation as one process's with all of them).
    fn count_targets(&self, batches: &[(&[u32], &[u32])]) -> Result<usize, ExecError> {
        let mut counted = [batches
            .iter()
            .map(|(_, y)| y.iter().filter(|&&t| t != IGNORE_TARGET).count())
            .sum::<usize>() as f64];
        if self.plan.shape.ranks > 1 {
            self.comm
                .all_reduce_sum_f64(&mut counted)
                .map_err(|source| ExecError::Comm {
                    op: "counting the step's targets".into(),
                    source,
                })?;
        }
        Ok((counted[0] as usize).max(1))
    }

    /// Writes each micro-batch's token ids then target ids into its host buffer.
    fn write_batches(&self, batches: &[(&[u32], &[u32])]) -> Result<(), ExecError> {
        let n = self.plan.shape.batch * self.plan.shape.seq;
        for (m, (t, y)) in batches.iter().enumerate() {
            let range = self.host_range(self.plan.tokens_host[m]).prefix(8 * n);
            let mut bytes = self
                .host()
                .write(Lane::Cpu, range)
                .map_err(self.device_error("writing the batch"))?;
            let ids = cast_mut::<u32>(&mut bytes);
            ids[..n].copy_from_slice(t);
            ids[n..].copy_from_slice(y);
        }
        Ok(())
    }

    /// With a delayed update, applies the last step's gradients now (at the end of a run,
    /// before a checkpoint or an export). Returns what the update did, or `None` when
    /// nothing was pending.
    pub fn flush(&mut self, params: &StepParams) -> Result<Option<StepReport>, ExecError> {
        let Some(scale) = self.pending else {
            return Ok(None);
        };
        let mut report = self.run(params, Parts::UPDATE, scale)?;
        self.pending = None;
        report.loss = f32::NAN;
        report.updated = !report.skipped;
        if report.updated {
            self.commit_update();
        }
        Ok(Some(report))
    }

    /// Fault injection (tests): in the next step or flush only, the operations `faults`
    /// names fail when their lanes reach them, instead of running: with
    /// [`ExecError::Injected`], or by panicking ([`Fault::Panic`]; the step returns
    /// [`ExecError::Panicked`]).
    pub fn inject(&mut self, faults: FaultPlan) {
        self.faults = Some(Box::new(faults));
    }

    /// Fault injection (tests): in the next step or flush only, operation `op` of the
    /// plan fails as `fault` says ([`Executor::inject`] of that one fault).
    pub fn fail_next_at(&mut self, op: OpId, fault: Fault) {
        self.inject(FaultPlan::new().with(op, fault));
    }

    /// Whether a delayed update is waiting to be applied.
    pub fn has_pending_update(&self) -> bool {
        self.pending.is_some()
    }

    /// After an applied update: its outputs become current.
    fn commit_update(&mut self) {
        self.exchange_homes();
        self.steps += 1;
    }

    /// Delayed update: the pairs of working-parameter homes exchange sides (the side
    /// written by the update becomes the one read).
    fn exchange_homes(&mut self) {
        for &(cur, next) in &self.plan.swap_on_update {
            self.arenas.swap(cur, next);
        }
        if let Some(nvme) = &mut self.nvme {
            nvme.swap_pairs();
        }
    }

    /// Where the plan fetches the next step's first parameters at the end of each step
    /// and the last step did not (this is the first, or it failed, or parameters were
    /// loaded since): those fetches alone, now (their time and bytes are the step's
    /// [`StepReport::head_fetch`]).
    fn fetch_head(&mut self, params: &StepParams) -> Result<Option<StepReport>, ExecError> {
        if self.head_fetched || !self.plan.fetches_next_step() {
            return Ok(None);
        }
        // With a delayed update the fetches read the side of each home pair the update
        // writes: now, the current parameters are there only with the sides exchanged.
        let delayed = self.plan.shape.delayed_update;
        if delayed {
            self.exchange_homes();
        }
        let head = self.run(params, Parts::NEXT_STEP, params.loss_scale);
        if delayed {
            self.exchange_homes();
        }
        head.map(Some)
    }

    /// Runs the plan's operations of the parts `parts` names (the others count as done).
    fn run(
        &mut self,
        params: &StepParams,
        parts: Parts,
        update_loss_scale: f32,
    ) -> Result<StepReport, ExecError> {
        // Until this run has ended well, the next step's head is not known to be
        // fetched.
        self.head_fetched = false;
        let Parts {
            compute: run_compute,
            update: run_update,
            next_step: run_next_step,
        } = parts;
        self.norms.reset();
        if let Some(nvme) = &self.nvme {
            nvme.unstage();
        }
        let stamp = self.progress.begin(&self.plan, |op| {
            if op.next_step {
                run_next_step
            } else if op.update {
                run_update
            } else {
                run_compute
            }
        });
        let deps = match (run_compute, run_update) {
            (true, true) => &self.deps[0],
            (true, false) => &self.deps[1],
            (false, true) => &self.deps[2],
            (false, false) => &self.deps[3],
        };
        let io_before = self.nvme.as_ref().map(|n| n.store().io_counters());
        let copied_before = self.device.copied_bytes();
        let kernels_before = self.device.kernel_times();
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
            stamp,
            params: *params,
            counted_targets: self.counted_targets,
            adam_step: self.steps + 1,
            batch: self.steps + 1 + u64::from(self.pending.is_some()),
            update_loss_scale,
            start: Instant::now(),
            origin,
            // A test's faults are for the step it names, not the fetches before it.
            faults: if run_compute || run_update {
                self.faults.take()
            } else {
                None
            },
        };
        let errors = self.run_lanes(&shared);
        // Whatever happened, nothing the step queued may still run when it returns.
        let drained = self.device.synchronize();
        if drained.is_ok() && !self.norms.skipped() {
            self.count_device_updates(&shared);
        }
        let seconds = shared.start.elapsed().as_secs_f64();
        if let Some(first) = errors.into_iter().find(|e| !e.is_abort()) {
            return Err(first);
        }
        drained.map_err(self.device_error("finishing the step"))?;
        let mut report = self.outcome(run_compute, run_update, seconds, &shared)?;
        if let (Some(before), Some(nvme)) = (io_before, &self.nvme) {
            let after = nvme.store().io_counters();
            report.link_bytes[0] = after.read_bytes - before.read_bytes;
            report.link_bytes[1] = after.written_bytes - before.written_bytes;
            report.fixed_chunks = [
                after.fixed_chunks - before.fixed_chunks,
                after.plain_chunks - before.plain_chunks,
            ];
        }
        let copied = self.device.copied_bytes();
        report.link_bytes[2] = copied[0] - copied_before[0];
        report.link_bytes[3] = copied[1] - copied_before[1];
        report.kernels = self.device.kernel_times().since(&kernels_before);
        Ok(report)
    }

    /// Runs every lane that has operations, each on its thread, until all have finished;
    /// their errors, by lane order.
    fn run_lanes(&self, shared: &StepShared<'_>) -> Vec<ExecError> {
        let lanes = Lane::ALL
            .into_iter()
            .filter(|lane| !self.plan.lanes[lane.index()].is_empty());
        let work = |lane: Lane, scratch: &mut LaneScratch| self.run_lane(lane, shared, scratch);
        self.lane_threads
            .run_step(&work, &self.progress.failed, lanes)
    }

    /// The device's updates that ran are applied, whatever failed after them.
    fn count_device_updates(&self, shared: &StepShared<'_>) {
        for (id, op) in self.plan.ops.iter().enumerate() {
            if let OpKind::Stream(StreamOp::DeviceUpdate { block, .. }) = op.kind
                && self.progress.has_event(OpId::of(id))
            {
                self.applied[block].store(shared.adam_step, Ordering::Relaxed);
            }
        }
    }

    /// The step's loss, norm and timings, once its lanes have finished.
    fn outcome(
        &self,
        run_compute: bool,
        run_update: bool,
        seconds: f64,
        shared: &StepShared<'_>,
    ) -> Result<StepReport, ExecError> {
        let norm = self.norms.norm();
        let grad_norm = if !run_update {
            f64::NAN
        } else if self.plan.shape.needs_global_norm {
            norm.norm
        } else {
            self.merged_block_stats()?.norm()
        };
        let loss = if run_compute {
            self.mean_loss()?
        } else {
            f32::NAN
        };
        self.report(loss, grad_norm, norm.skip, seconds, shared)
    }

    /// The mean of the per-position losses the step left in the host arena (with
    /// ranks, of every rank's: each micro-batch's sum added in the order of one process
    /// running them all, micro-batch k of rank r being its k × ranks + r).
    fn mean_loss(&self) -> Result<f32, ExecError> {
        let rows = self.plan.shape.batch * self.plan.shape.seq;
        let ranks = self.comm.size();
        let micro_sum = |buf: BufId| -> Result<f64, ExecError> {
            let bytes = self
                .host()
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
                .all_gather(bytes_of(&mine), bytes_of_mut(&mut all))
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
        let cpu = self
            .norms
            .block_stats
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut total = GradStats::default();
        for (b, s) in cpu.iter().enumerate() {
            let stats = match (s, self.plan.stats_host[b]) {
                (Some(s), _) => *s,
                (None, Some(buf)) => {
                    let bytes = self
                        .host()
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
            kernels: KernelTimes::default(),
            head_fetch: (0.0, [0; 4]),
        })
    }

    /// When operation `id` ran (ns after the step's start), if it ran.
    fn span(&self, id: OpId, shared: &StepShared<'_>) -> Result<Option<(u64, u64)>, ExecError> {
        if let Some(span) = self.progress.host_span(id) {
            return Ok(Some(span));
        }
        let Some(event) = self.progress.event_of(id) else {
            return Ok(None);
        };
        match (&event, &shared.origin) {
            (Event::Cpu(e), _) => Ok(e.run_time().map(|(s, e)| {
                let since = |t: Instant| shared.since_start_ns(t);
                (since(s), since(e).max(since(s) + 1))
            })),
            (Event::Cuda(_), Some(origin)) => {
                let start = self.progress.start_of(id);
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

/// Which parts of the plan's operations a run takes ([`Op::update`], [`Op::next_step`],
/// the rest being the compute part).
///
/// [`Op::update`]: crate::plan::Op::update
/// [`Op::next_step`]: crate::plan::Op::next_step
#[derive(Clone, Copy)]
struct Parts {
    compute: bool,
    update: bool,
    next_step: bool,
}

impl Parts {
    /// A delayed update's last update, alone.
    const UPDATE: Parts = Parts {
        compute: false,
        update: true,
        next_step: false,
    };

    /// The next step's first fetches, alone.
    const NEXT_STEP: Parts = Parts {
        compute: false,
        update: false,
        next_step: true,
    };

    /// A step: its compute, the update if `update`, and with the update the next step's
    /// first fetches (with a delayed update, of the parameters it writes).
    fn step(update: bool) -> Parts {
        Parts {
            compute: true,
            update,
            next_step: update,
        }
    }
}
