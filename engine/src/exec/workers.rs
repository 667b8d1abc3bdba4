//! The executor's lane threads: one per lane, started with the executor and reused by
//! every step, so that a step starts no thread.
//!
//! A step hands each lane that has work a [`LaneJob`] (two pointers and the lane: no
//! allocation) and then waits for every job's result before it returns. The jobs borrow
//! the executor and the step's shared values; that wait is what makes the borrow sound,
//! so nothing between sending and the last result may return early or unwind.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;

use crossbeam::channel::{Receiver, Sender};

use super::lanes::LaneScratch;
use super::{ExecError, Executor, StepShared, panic_message};
use crate::lane::Lane;

/// One lane's share of a step.
struct LaneJob {
    exec: *const Executor,
    shared: *const StepShared<'static>,
    lane: Lane,
}

// SAFETY: the pointers are only dereferenced while `LaneThreads::run_step` waits for the
// job's result, during which both referents are alive; `Executor` and `StepShared` are
// shared between the lane threads by reference (both are `Sync`).
unsafe impl Send for LaneJob {}

/// The lane threads of one executor.
pub(super) struct LaneThreads {
    jobs: Vec<Sender<LaneJob>>,
    done: Receiver<(Lane, Result<(), ExecError>)>,
    threads: Vec<JoinHandle<()>>,
}

impl LaneThreads {
    /// Starts one thread per lane.
    pub(super) fn start() -> Result<Self, ExecError> {
        let (done_tx, done) = crossbeam::channel::bounded(Lane::COUNT);
        let mut jobs = Vec::with_capacity(Lane::COUNT);
        let mut threads = Vec::with_capacity(Lane::COUNT);
        for lane in Lane::ALL {
            let (tx, rx) = crossbeam::channel::bounded::<LaneJob>(1);
            let done_tx = done_tx.clone();
            let thread = std::thread::Builder::new()
                .name(format!("strata-{lane}"))
                .spawn(move || serve(&rx, &done_tx))
                .map_err(|e| ExecError::Threads(format!("the {lane} lane: {e}")))?;
            jobs.push(tx);
            threads.push(thread);
        }
        Ok(LaneThreads {
            jobs,
            done,
            threads,
        })
    }

    /// Runs `lanes` of a step, each on its thread, and returns their errors by lane
    /// order once every one has finished.
    pub(super) fn run_step(
        &self,
        exec: &Executor,
        shared: &StepShared<'_>,
        lanes: impl Iterator<Item = Lane>,
    ) -> Vec<ExecError> {
        let shared = std::ptr::from_ref(shared).cast::<StepShared<'static>>();
        let mut sent = 0;
        let mut broken = false;
        for lane in lanes {
            let job = LaneJob {
                exec: std::ptr::from_ref(exec),
                shared,
                lane,
            };
            if self.jobs[lane.index()].send(job).is_err() {
                // Its thread is gone (it never exits while the executor lives): the jobs
                // already sent must still be waited for, so stop sending.
                exec.failed.store(true, Ordering::SeqCst);
                broken = true;
                break;
            }
            sent += 1;
        }
        let mut errors: Vec<(usize, ExecError)> = Vec::new();
        for _ in 0..sent {
            // Returning before every job sent has finished would leave threads reading
            // the step's values after they are gone: no result can only mean a thread
            // died, which `serve` does not allow, so give up the process rather than that.
            let Ok((lane, result)) = self.done.recv() else {
                log::error!("a lane thread ended in the middle of a step");
                std::process::abort();
            };
            if let Err(e) = result {
                errors.push((lane.index(), e));
            }
        }
        if broken {
            errors.push((
                0,
                ExecError::Threads("a lane thread is gone; the executor cannot run".into()),
            ));
        }
        errors.sort_by_key(|(lane, _)| *lane);
        errors.into_iter().map(|(_, e)| e).collect()
    }
}

/// A lane thread's loop: run each job, always answer.
fn serve(jobs: &Receiver<LaneJob>, done: &Sender<(Lane, Result<(), ExecError>)>) {
    let mut scratch = LaneScratch::default();
    while let Ok(job) = jobs.recv() {
        // SAFETY: `run_step` keeps both alive until it has this job's result.
        let (exec, shared) = unsafe { (&*job.exec, &*job.shared) };
        let lane = job.lane;
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            exec.run_lane(lane, shared, &mut scratch)
        }))
        .unwrap_or_else(|panic| {
            exec.failed.store(true, Ordering::SeqCst);
            Err(ExecError::Panicked {
                lane,
                op: "its loop".into(),
                message: panic_message(&*panic),
            })
        });
        if done.send((lane, result)).is_err() {
            break;
        }
    }
}

impl Drop for LaneThreads {
    fn drop(&mut self) {
        // Closing the job channels ends the threads' loops.
        self.jobs.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}
