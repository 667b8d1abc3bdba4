//! Events: the only way lanes are ordered. An operation returns the event that completes
//! when it has; a later operation names the events it must come after.
//!
//! On the CPU device an event is a completion flag with a condition variable, set by the
//! lane's worker thread, carrying the operation's error if it failed. On CUDA it is a
//! `CUevent` recorded on the lane's stream, waited for with one retry (`retry_once`,
//! which the CUDA device's stream waits share). This file does not submit work; the
//! devices do.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, DriverError};

use crate::error::EngineError;
use crate::lane::Lane;

/// A point in a lane's work; complete when everything submitted to that lane before it
/// has completed. Cheap to clone.
#[derive(Clone, Debug)]
pub enum Event {
    /// An event of the CPU device.
    Cpu(CpuEvent),
    /// An event of a CUDA device.
    Cuda(CudaEventRef),
}

impl Event {
    /// The lane the event was recorded on.
    pub fn lane(&self) -> Lane {
        match self {
            Event::Cpu(e) => e.inner.lane,
            Event::Cuda(e) => e.lane,
        }
    }

    /// Blocks until the event completes; an error if the operation behind it failed.
    pub fn wait(&self) -> Result<(), EngineError> {
        match self {
            Event::Cpu(e) => e.wait(),
            Event::Cuda(e) => {
                synchronize_event(&e.event).map_err(EngineError::cuda("cuEventSynchronize"))
            }
        }
    }

    /// Whether the event has completed, without blocking; an error if the operation
    /// behind it failed.
    pub fn is_complete(&self) -> Result<bool, EngineError> {
        match self {
            Event::Cpu(e) => e.is_complete(),
            Event::Cuda(e) => e
                .event
                .try_is_complete()
                .map_err(EngineError::cuda("cuEventQuery")),
        }
    }

    /// The time from `start` completing to `self` completing. Waits for both. CUDA events
    /// must have been made by `record` (copy events carry no timing, to stay cheap).
    pub fn elapsed_since(&self, start: &Event) -> Result<Duration, EngineError> {
        match (start, self) {
            (Event::Cpu(start), Event::Cpu(end)) => {
                start.wait()?;
                end.wait()?;
                let (s, e) = (start.completed_at(), end.completed_at());
                Ok(e.saturating_duration_since(s))
            }
            (Event::Cuda(start), Event::Cuda(end)) => {
                if !start.timed || !end.timed {
                    return Err(EngineError::EventNotTimed);
                }
                let ms = start
                    .event
                    .elapsed_ms(&end.event)
                    .map_err(EngineError::cuda("cuEventElapsedTime"))?;
                Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
            }
            _ => Err(EngineError::Unsupported {
                device: "cpu and cuda".into(),
                what: "timing between an event of the CPU device and a CUDA event",
            }),
        }
    }

    /// Whether this is an event of the CPU device, whose wait returns only once the
    /// operation has finished running, whatever its outcome.
    pub(crate) fn is_cpu(&self) -> bool {
        matches!(self, Event::Cpu(_))
    }
}

/// A CUDA event with the lane it was recorded on.
#[derive(Clone, Debug)]
pub struct CudaEventRef {
    pub(crate) event: Arc<CudaEvent>,
    pub(crate) lane: Lane,
    /// Made with timing enabled (`CU_EVENT_DEFAULT`).
    pub(crate) timed: bool,
}

impl CudaEventRef {
    /// The cudarc event, for code that records or waits on it itself.
    pub fn cuda_event(&self) -> &Arc<CudaEvent> {
        &self.event
    }
}

/// Completion flag of one operation on a CPU-device lane.
#[derive(Clone)]
pub struct CpuEvent {
    inner: Arc<CpuEventInner>,
}

struct CpuEventInner {
    lane: Lane,
    state: Mutex<CpuEventState>,
    done: Condvar,
}

impl CpuEventInner {
    fn queued(lane: Lane) -> Arc<Self> {
        Arc::new(CpuEventInner {
            lane,
            state: Mutex::new(CpuEventState::Queued),
            done: Condvar::new(),
        })
    }
}

enum CpuEventState {
    Queued,
    Running {
        started: Instant,
    },
    Done {
        started: Instant,
        ended: Instant,
        error: Option<Arc<EngineError>>,
    },
}

/// A lane's CPU events, reused: an event nobody holds any more (its operation done and
/// every clone dropped) goes back to the queued state and serves the next operation, so
/// a warmed-up lane makes events without allocating.
pub(crate) struct EventPool {
    lane: Lane,
    events: Mutex<PoolState>,
}

struct PoolState {
    events: Vec<Arc<CpuEventInner>>,
    /// Where the next search starts: events tend to be let go in the order they were
    /// taken, so the one after the last taken is the likeliest free.
    next: usize,
}

/// Events a lane's pool starts with, so that the first steps do not grow it one by one.
const POOL_START: usize = 256;

impl EventPool {
    pub(crate) fn new(lane: Lane) -> Self {
        EventPool {
            lane,
            events: Mutex::new(PoolState {
                events: (0..POOL_START)
                    .map(|_| CpuEventInner::queued(lane))
                    .collect(),
                next: 0,
            }),
        }
    }

    /// A queued event: a free one of the pool's, or a new one the pool keeps.
    pub(crate) fn take(&self) -> CpuEvent {
        let mut pool = self.events.lock().unwrap_or_else(|e| e.into_inner());
        let PoolState { events, next } = &mut *pool;
        let n = events.len();
        for i in (0..n).map(|i| (*next + i) % n) {
            // Unique: no operation, waiter or caller holds it any more.
            if let Some(inner) = Arc::get_mut(&mut events[i]) {
                *inner.state.get_mut().unwrap_or_else(|e| e.into_inner()) = CpuEventState::Queued;
                *next = (i + 1) % n;
                return CpuEvent {
                    inner: Arc::clone(&events[i]),
                };
            }
        }
        let inner = CpuEventInner::queued(self.lane);
        events.push(Arc::clone(&inner));
        *next = 0;
        CpuEvent { inner }
    }

    /// How many events the pool holds (free or in use).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .events
            .len()
    }
}

impl CpuEvent {
    fn state(&self) -> std::sync::MutexGuard<'_, CpuEventState> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks the operation as running.
    pub(crate) fn start(&self) {
        *self.state() = CpuEventState::Running {
            started: Instant::now(),
        };
    }

    /// Marks the operation as done, with its outcome, and wakes every waiter. Returns
    /// the error as its waiters will share it.
    pub(crate) fn finish(&self, result: Result<(), EngineError>) -> Option<Arc<EngineError>> {
        let ended = Instant::now();
        let mut state = self.state();
        let started = match *state {
            CpuEventState::Running { started } => started,
            _ => ended,
        };
        let error = result.err().map(Arc::new);
        *state = CpuEventState::Done {
            started,
            ended,
            error: error.clone(),
        };
        drop(state);
        self.inner.done.notify_all();
        error
    }

    /// Blocks until the operation is done.
    pub fn wait(&self) -> Result<(), EngineError> {
        let mut state = self.state();
        loop {
            if let CpuEventState::Done { error, .. } = &*state {
                return self.outcome(error);
            }
            state = self
                .inner
                .done
                .wait(state)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Whether the operation is done, without blocking.
    pub fn is_complete(&self) -> Result<bool, EngineError> {
        match &*self.state() {
            CpuEventState::Done { error, .. } => self.outcome(error).map(|()| true),
            _ => Ok(false),
        }
    }

    /// Whether a worker has started running the operation (or finished it).
    pub fn has_started(&self) -> bool {
        !matches!(*self.state(), CpuEventState::Queued)
    }

    /// When the operation started and ended, once it is done.
    pub fn run_time(&self) -> Option<(Instant, Instant)> {
        match *self.state() {
            CpuEventState::Done { started, ended, .. } => Some((started, ended)),
            _ => None,
        }
    }

    fn completed_at(&self) -> Instant {
        self.run_time().expect("waited for").1
    }

    fn outcome(&self, error: &Option<Arc<EngineError>>) -> Result<(), EngineError> {
        match error {
            None => Ok(()),
            Some(source) => Err(EngineError::OperationFailed {
                lane: self.inner.lane,
                source: Arc::clone(source),
            }),
        }
    }
}

impl std::fmt::Debug for CpuEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &*self.state() {
            CpuEventState::Queued => "queued",
            CpuEventState::Running { .. } => "running",
            CpuEventState::Done { error: None, .. } => "done",
            CpuEventState::Done { error: Some(_), .. } => "failed",
        };
        f.debug_struct("CpuEvent")
            .field("lane", &self.inner.lane)
            .field("state", &state)
            .finish()
    }
}

/// cudarc reports an error stored by an earlier failed call in the context (one made
/// from a `Drop`, which cannot return it) on the next call that binds the context, and
/// clears it. Such an error is about that earlier call, so it is logged and the wait is
/// tried once more; only a second failure is this wait's own.
pub(super) fn retry_once(
    what: &str,
    mut wait: impl FnMut() -> Result<(), DriverError>,
) -> Result<(), DriverError> {
    wait().or_else(|first| {
        log::error!("{what}: {first} (retrying once: it may be an earlier call's error)");
        wait()
    })
}

/// Waits for a CUDA event, retried once as a stream synchronize is.
fn synchronize_event(event: &CudaEvent) -> Result<(), DriverError> {
    retry_once("cuEventSynchronize", || event.synchronize())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pooled_event_is_reused_only_once_nobody_holds_it() {
        let pool = EventPool::new(Lane::Compute);
        let start = pool.len();
        // Every event held: each take must give a distinct one, growing the pool past
        // its start.
        let held: Vec<CpuEvent> = (0..start + 3).map(|_| pool.take()).collect();
        assert_eq!(pool.len(), start + 3);
        for (i, a) in held.iter().enumerate() {
            for b in &held[i + 1..] {
                assert!(
                    !Arc::ptr_eq(&a.inner, &b.inner),
                    "a held event was handed out again"
                );
            }
        }
        // A finished event, let go, comes back queued; the pool does not grow.
        held[1].start();
        held[1].finish(Ok(()));
        drop(held);
        let again = pool.take();
        assert_eq!(pool.len(), start + 3);
        assert!(!again.has_started(), "a reused event must be queued again");
        assert!(!again.is_complete().unwrap());
    }
}
