//! The state of the step being run that its lanes share: the step's values
//! ([`StepShared`]), the outcome of the global norm ([`Norm`]), and each operation's
//! progress ([`Progress`]: issued or done in this step, its device events, when it ran),
//! with the waits between lanes built on it.
//!
//! Not here: what the lanes do (`lanes.rs`), or how the step is started and reported
//! (`step.rs`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use strata_kernels::adamw::{AdamStep, AdamW, GradStats};

use super::config::StepParams;
use super::error::ExecError;
use super::fault::{Fault, FaultPlan};
use crate::device::Event;
use crate::plan::{Op, OpId, Plan};

/// The outcome of the global norm (or of none: 1, false).
#[derive(Debug, Clone, Copy)]
pub(super) struct Norm {
    pub(super) norm: f64,
    /// The clipping coefficient.
    pub(super) coef: f32,
    /// Whether the update is skipped (non-finite gradients).
    pub(super) skip: bool,
}

impl Norm {
    /// No norm yet: no clipping, no skip.
    pub(super) const NONE: Norm = Norm {
        norm: 0.0,
        coef: 1.0,
        skip: false,
    };
}

/// The gradient statistics of the step being run, which the lanes fill and the update and
/// the report read.
pub(super) struct NormState {
    /// Without a global norm: each block's statistics, as the CPU optimizer took them.
    pub(super) block_stats: Mutex<Vec<Option<GradStats>>>,
    /// The global norm's outcome.
    pub(super) norm: Mutex<Norm>,
    /// With ranks: this rank's piece sums of the gradient statistics, every block's in
    /// block order, and every rank's gathered (reused by each step's norm).
    pub(super) pieces: Mutex<(Vec<f64>, Vec<f64>)>,
}

impl NormState {
    /// For `blocks` blocks whose shards hold `pieces` pieces of statistics in all, among
    /// `ranks` ranks.
    pub(super) fn new(blocks: usize, pieces: usize, ranks: usize) -> Self {
        let pieces = if ranks > 1 {
            (vec![0.0; pieces], vec![0.0; pieces * ranks])
        } else {
            (Vec::new(), Vec::new())
        };
        NormState {
            block_stats: Mutex::new(vec![None; blocks]),
            norm: Mutex::new(Norm::NONE),
            pieces: Mutex::new(pieces),
        }
    }

    /// The global norm's outcome so far.
    pub(super) fn norm(&self) -> Norm {
        *self.norm.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the update is skipped (non-finite gradients).
    pub(super) fn skipped(&self) -> bool {
        self.norm().skip
    }

    /// Forgets the last step's: no norm, no block's statistics.
    pub(super) fn reset(&self) {
        *self.norm.lock().unwrap_or_else(|e| e.into_inner()) = Norm::NONE;
        self.block_stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .fill(None);
    }
}

/// Per-step shared values.
pub(super) struct StepShared<'a> {
    pub(super) stamp: u64,
    /// Each operation's dependencies in this run (skipped operations replaced by theirs).
    pub(super) deps: &'a [Vec<OpId>],
    pub(super) params: StepParams,
    /// The positions whose loss counts in this step (the loss is their mean).
    pub(super) counted_targets: usize,
    pub(super) adam_step: u64,
    /// The number of the batch this step computes, from 1 (with a delayed update, one
    /// past the update's): with the micro-batch, the seed of its sketches
    /// ([`Scalars::sketch`](strata_kernels::program::Scalars)).
    pub(super) batch: u64,
    /// The loss scale of the gradients the update applies (with a delayed update, the
    /// last step's).
    pub(super) update_loss_scale: f32,
    pub(super) start: Instant,
    /// A timed event recorded on the compute stream at the start (a GPU times its
    /// operations against it).
    pub(super) origin: Option<Event>,
    /// The operations that fail on purpose in this run (tests).
    pub(super) faults: Option<Box<FaultPlan>>,
}

impl StepShared<'_> {
    /// How operation `id` fails on purpose in this run, if it does.
    pub(super) fn fault_at(&self, id: OpId) -> Option<Fault> {
        self.faults.as_ref().and_then(|f| f.fault_at(id))
    }

    /// AdamW's constants for this step, with and without weight decay, gradients scaled
    /// by `coef / update_loss_scale`.
    pub(super) fn adam_steps(&self, coef: f32) -> Result<[AdamStep; 2], ExecError> {
        let hp = self.params.adam;
        let scale = coef / self.update_loss_scale;
        let adam_err = |source| ExecError::Adam {
            op: "AdamW constants".into(),
            source,
        };
        let decayed = AdamStep::new(&hp, self.adam_step, scale).map_err(adam_err)?;
        let plain = AdamStep::new(
            &AdamW {
                weight_decay: 0.0,
                ..hp
            },
            self.adam_step,
            scale,
        )
        .map_err(adam_err)?;
        Ok([decayed, plain])
    }

    /// Nanoseconds from the step's start to `t`.
    pub(super) fn since_start_ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.start).as_nanos() as u64
    }
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

/// Where each operation of the step being run is, and the wake-ups of lanes waiting for
/// one: an operation counts as issued in a step when its state holds the step's stamp.
pub(super) struct Progress {
    ops: Vec<OpState>,
    /// Whether a lane failed in this step: every other lane stops at its next wait.
    pub(super) failed: AtomicBool,
    wake: (Mutex<()>, Condvar),
    stamp: u64,
}

impl Progress {
    /// The progress of `ops` operations, none run yet.
    pub(super) fn new(ops: usize) -> Self {
        Progress {
            ops: (0..ops)
                .map(|_| OpState {
                    issued: AtomicU64::new(0),
                    event: Mutex::new(None),
                    start: Mutex::new(None),
                    span: [AtomicU64::new(0), AtomicU64::new(0)],
                })
                .collect(),
            failed: AtomicBool::new(false),
            wake: (Mutex::new(()), Condvar::new()),
            stamp: 0,
        }
    }

    /// Starts a run of `plan`'s operations, those `wanted` to run, the others counting as
    /// done; returns the run's stamp.
    pub(super) fn begin(&mut self, plan: &Plan, wanted: impl Fn(&Op) -> bool) -> u64 {
        self.stamp += 1;
        self.failed.store(false, Ordering::SeqCst);
        for (state, op) in self.ops.iter().zip(&plan.ops) {
            state.span[0].store(0, Ordering::Relaxed);
            state.span[1].store(0, Ordering::Relaxed);
            *state.event.lock().unwrap_or_else(|e| e.into_inner()) = None;
            *state.start.lock().unwrap_or_else(|e| e.into_inner()) = None;
            if !wanted(op) {
                state.issued.store(self.stamp, Ordering::Release);
            }
        }
        self.stamp
    }

    /// Whether operation `d` is done (a host one) or issued (a stream one) in this step.
    pub(super) fn is_issued(&self, d: OpId, shared: &StepShared<'_>) -> bool {
        self.ops[d.index()].issued.load(Ordering::Acquire) == shared.stamp
    }

    /// Whether every dependency of `id` is done (or, on a stream, issued) already.
    pub(super) fn deps_done(&self, id: OpId, shared: &StepShared<'_>) -> bool {
        shared.deps[id.index()]
            .iter()
            .all(|&d| self.is_issued(d, shared))
    }

    /// Marks operation `id` done (a host operation) or issued (a stream one) in this
    /// step, and wakes the lanes waiting for it.
    pub(super) fn mark_done(&self, id: OpId, shared: &StepShared<'_>) {
        self.ops[id.index()]
            .issued
            .store(shared.stamp, Ordering::Release);
        self.notify();
    }

    /// Wakes every lane waiting.
    pub(super) fn notify(&self) {
        drop(self.wake.0.lock().unwrap_or_else(|e| e.into_inner()));
        self.wake.1.notify_all();
    }

    /// Waits until operation `d` has been issued in this step (done, for a host
    /// operation; submitted, for a stream one); an abort when another lane failed.
    pub(super) fn wait_issued(&self, d: OpId, shared: &StepShared<'_>) -> Result<(), ExecError> {
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
    pub(super) fn event_of(&self, d: OpId) -> Option<Event> {
        self.ops[d.index()]
            .event
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The start event of stream operation `d` (a GPU's), if recorded.
    pub(super) fn start_of(&self, d: OpId) -> Option<Event> {
        self.ops[d.index()]
            .start
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Records stream operation `id`'s start (a GPU's) and completion events.
    pub(super) fn set_events(&self, id: OpId, start: Option<Event>, event: Option<Event>) {
        let state = &self.ops[id.index()];
        *state.start.lock().unwrap_or_else(|e| e.into_inner()) = start;
        *state.event.lock().unwrap_or_else(|e| e.into_inner()) = event;
    }

    /// Whether stream operation `id` ran in this step (it has an event).
    pub(super) fn has_event(&self, id: OpId) -> bool {
        self.ops[id.index()]
            .event
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Records that host operation `id` ran from `started` to `ended`.
    pub(super) fn record_span(
        &self,
        id: OpId,
        started: Instant,
        ended: Instant,
        shared: &StepShared<'_>,
    ) {
        let ns = |t: Instant| shared.since_start_ns(t);
        let span = &self.ops[id.index()].span;
        span[0].store(ns(started), Ordering::Relaxed);
        span[1].store(ns(ended).max(ns(started) + 1), Ordering::Relaxed);
    }

    /// When host operation `id` ran, if it did: (start, end) in nanoseconds after the
    /// step's start.
    pub(super) fn host_span(&self, id: OpId) -> Option<(u64, u64)> {
        let span = &self.ops[id.index()].span;
        let (s, e) = (
            span[0].load(Ordering::Relaxed),
            span[1].load(Ordering::Relaxed),
        );
        (e > 0).then_some((s, e))
    }
}
