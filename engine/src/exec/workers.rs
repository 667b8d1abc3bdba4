//! The executor's lane threads: one per lane, started with the executor and reused by
//! every step, so that a step starts no thread.
//!
//! A step hands each lane that has work a [`LaneJob`] (two pointers and the lane: no
//! allocation) and then waits for every job's result before it returns. The jobs borrow
//! the step's work (a closure over the executor and the step's shared values) and its
//! failure flag; that wait is what makes the borrow sound, so nothing between sending and
//! the last result may return early or unwind. Each thread keeps a scratch `S` of its
//! own from step to step (the lanes' [`LaneScratch`](super::scratch::LaneScratch)).
//!
//! Not here: what a lane does (`lanes.rs`); this module knows lanes only by name.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use crossbeam::channel::{Receiver, Sender};

use super::error::{ExecError, panic_message};
use crate::lane::Lane;

/// A step's work for its lanes: runs lane `lane` with its thread's scratch.
pub(super) type LaneWork<'a, S> = dyn Fn(Lane, &mut S) -> Result<(), ExecError> + Sync + 'a;

/// One lane's share of a step.
struct LaneJob<S> {
    work: *const LaneWork<'static, S>,
    failed: *const AtomicBool,
    lane: Lane,
}

// SAFETY: the pointers are only dereferenced while `LaneThreads::run_step` waits for the
// job's result, during which both referents are alive; the work and the flag are shared
// between the lane threads by reference (the work is `Sync`, the flag atomic).
unsafe impl<S> Send for LaneJob<S> {}

/// The lane threads of one executor, each with its scratch `S`.
pub(super) struct LaneThreads<S> {
    jobs: Vec<Sender<LaneJob<S>>>,
    done: Receiver<(Lane, Result<(), ExecError>)>,
    threads: Vec<JoinHandle<()>>,
}

impl<S: Default + 'static> LaneThreads<S> {
    /// Starts one thread per lane.
    pub(super) fn start() -> Result<Self, ExecError> {
        let (done_tx, done) = crossbeam::channel::bounded(Lane::COUNT);
        let mut jobs = Vec::with_capacity(Lane::COUNT);
        let mut threads = Vec::with_capacity(Lane::COUNT);
        for lane in Lane::ALL {
            let (tx, rx) = crossbeam::channel::bounded::<LaneJob<S>>(1);
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

    /// Runs `work` for `lanes` of a step, each on its thread, and returns their errors
    /// by lane order once every one has finished. A thread whose work panics sets
    /// `failed`, so that the other lanes stop at their next wait.
    pub(super) fn run_step(
        &self,
        work: &LaneWork<'_, S>,
        failed: &AtomicBool,
        lanes: impl Iterator<Item = Lane>,
    ) -> Vec<ExecError> {
        // SAFETY: only the trait object's lifetime bound changes (the pointers have the
        // same layout); the jobs dereference it only while this call waits for them, so
        // within the borrow of `work`.
        let work: *const LaneWork<'static, S> = unsafe {
            std::mem::transmute::<*const LaneWork<'_, S>, *const LaneWork<'static, S>>(
                std::ptr::from_ref(work),
            )
        };
        let mut sent = 0;
        let mut broken = false;
        for lane in lanes {
            let job = LaneJob {
                work,
                failed: std::ptr::from_ref(failed),
                lane,
            };
            if self.jobs[lane.index()].send(job).is_err() {
                // Its thread is gone (it never exits while the executor lives): the jobs
                // already sent must still be waited for, so stop sending.
                failed.store(true, Ordering::SeqCst);
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
fn serve<S: Default>(jobs: &Receiver<LaneJob<S>>, done: &Sender<(Lane, Result<(), ExecError>)>) {
    let mut scratch = S::default();
    while let Ok(job) = jobs.recv() {
        // SAFETY: `run_step` keeps both alive until it has this job's result.
        let (work, failed) = unsafe { (&*job.work, &*job.failed) };
        let lane = job.lane;
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| work(lane, &mut scratch)))
            .unwrap_or_else(|panic| {
                failed.store(true, Ordering::SeqCst);
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

impl<S> Drop for LaneThreads<S> {
    fn drop(&mut self) {
        // Closing the job channels ends the threads' loops.
        self.jobs.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}
