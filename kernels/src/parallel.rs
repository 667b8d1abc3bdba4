//! The persistent worker pool every multithreaded CPU kernel runs on.
//!
//! One pool of one thread per available core is built on first use and lives for the
//! process, so no kernel spawns a thread per call. Work reaches it by [`join`]: the
//! second closure is queued as a job that lives on the caller's stack (a pointer goes
//! through a bounded channel), the caller runs the first itself, then helps run queued
//! jobs until its own is done. Nothing is allocated per call, so kernels can run on the
//! training hot path, where the project's rule is no heap allocation per operation.
//! [`for_each_split`] and [`for_each_range`] cut a range into pieces and join them
//! pairwise.
//!
//! This module does not choose how many threads a kernel should use: callers do, since
//! the engine runs the optimizer beside other work and gives it a share of the cores.

use std::any::Any;
use std::cell::UnsafeCell;
use std::ops::Range;
use std::panic::{self, AssertUnwindSafe};
use std::sync::{Condvar, Mutex, OnceLock};

use crossbeam::channel::{Receiver, Sender, TrySendError};

/// The process-wide worker pool.
pub struct Pool {
    jobs: Sender<JobRef>,
    queued: Receiver<JobRef>,
    threads: usize,
}

static POOL: OnceLock<Pool> = OnceLock::new();

/// Jobs that may wait in the queue; a join finding it full runs both halves itself.
const QUEUE: usize = 256;

/// The process-wide worker pool, built on first use with one thread per available core.
pub fn pool() -> &'static Pool {
    POOL.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let (jobs, queued) = crossbeam::channel::bounded::<JobRef>(QUEUE);
        for i in 0..threads {
            let queued = queued.clone();
            std::thread::Builder::new()
                .name(format!("strata-cpu-{i}"))
                .spawn(move || {
                    for job in queued.iter() {
                        // SAFETY: a queued job stays alive until its latch is set, which
                        // `execute` does last (see `join`).
                        unsafe { job.execute() };
                    }
                })
                .expect("the CPU worker pool could not start its threads");
        }
        Pool {
            jobs,
            queued,
            threads,
        }
    })
}

/// How many threads the pool has: the most a kernel call can use at once.
pub fn max_threads() -> usize {
    pool().threads
}

/// Runs `a` and `b`, possibly at the same time (`b` on a pool thread, `a` on the
/// caller's), and returns both results once both have finished. A panic in either is
/// resumed on the caller once both are done. Allocates nothing.
pub fn join<A, B, RA, RB>(a: A, b: B) -> (RA, RB)
where
    A: FnOnce() -> RA + Send,
    B: FnOnce() -> RB + Send,
    RA: Send,
    RB: Send,
{
    let pool = pool();
    let job = StackJob {
        work: UnsafeCell::new(Some(b)),
        result: UnsafeCell::new(None),
        latch: Latch::default(),
    };
    let erased: *const (dyn Job + '_) = &job;
    // SAFETY: only the lifetime is erased; the job outlives every use of the pointer,
    // because this function does not return (nor unwind) before the job's latch is set,
    // and `execute` touches the job last when it sets the latch.
    let job_ref = JobRef(unsafe {
        std::mem::transmute::<*const (dyn Job + '_), *const (dyn Job + 'static)>(erased)
    });
    match pool.jobs.try_send(job_ref) {
        Ok(()) => {}
        Err(TrySendError::Full(job_ref) | TrySendError::Disconnected(job_ref)) => {
            // SAFETY: never queued: run here, while `job` is alive.
            unsafe { job_ref.execute() }
        }
    }
    let ra = panic::catch_unwind(AssertUnwindSafe(a));
    // Help with queued jobs (this one or others) until ours is done.
    while !job.latch.is_set() {
        match pool.queued.try_recv() {
            // SAFETY: as for the pool threads.
            Ok(other) => unsafe { other.execute() },
            Err(_) => {
                job.latch.wait();
                break;
            }
        }
    }
    // SAFETY: the latch is set, so `execute` has written the result and will not touch
    // the job again.
    let rb = unsafe { (*job.result.get()).take() }.expect("a set latch has a result");
    match (ra, rb) {
        (Ok(ra), Ok(rb)) => (ra, rb),
        (Err(p), _) | (_, Err(p)) => panic::resume_unwind(p),
    }
}

/// A job of [`join`]'s, type-erased.
trait Job {
    /// Runs the job and sets its latch; called once.
    ///
    /// # Safety
    /// The job must be alive; after this returns the caller must not touch it.
    unsafe fn execute(&self);
}

/// A queued job's pointer.
struct JobRef(*const (dyn Job + 'static));

// SAFETY: the job behind the pointer is `Send` work (its closure and result are) and is
// executed exactly once, by whichever thread takes it.
unsafe impl Send for JobRef {}

impl JobRef {
    /// # Safety
    /// As for [`Job::execute`].
    unsafe fn execute(self) {
        // SAFETY: passed on.
        unsafe { (*self.0).execute() }
    }
}

struct StackJob<F, R> {
    work: UnsafeCell<Option<F>>,
    result: UnsafeCell<Option<Result<R, Box<dyn Any + Send>>>>,
    latch: Latch,
}

impl<F: FnOnce() -> R + Send, R: Send> Job for StackJob<F, R> {
    unsafe fn execute(&self) {
        // SAFETY: one execution (the job is queued once, or run in place), and its owner
        // reads these cells only after the latch is set.
        let work = unsafe { (*self.work.get()).take() }.expect("a job runs once");
        let result = panic::catch_unwind(AssertUnwindSafe(work));
        // SAFETY: as above.
        unsafe { *self.result.get() = Some(result) };
        self.latch.set();
    }
}

/// Set once by a job; its owner waits for it.
#[derive(Default)]
struct Latch {
    done: Mutex<bool>,
    woken: Condvar,
}

impl Latch {
    /// Marks the job done and wakes its owner. The owner sees `done` only under the lock,
    /// after this has released it, so nothing here touches the latch after the owner may
    /// have dropped it.
    fn set(&self) {
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        *done = true;
        self.woken.notify_all();
    }

    fn is_set(&self) -> bool {
        *self.done.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait(&self) {
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        while !*done {
            done = self.woken.wait(done).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Splits `0..len` into at most `parts` contiguous ranges, each starting at a multiple of
/// `align` (so SIMD kernels see aligned bodies and only the last range has a tail).
/// Empty ranges are never produced; `len == 0` gives none.
pub fn split_ranges(len: usize, parts: usize, align: usize) -> SplitRanges {
    assert!(align > 0, "alignment must be positive");
    let parts = parts.max(1);
    let units = len.div_ceil(align);
    let units_per_part = units.div_ceil(parts).max(1);
    SplitRanges {
        next_start: 0,
        len,
        step: units_per_part * align,
    }
}

/// The iterator [`split_ranges`] returns.
#[derive(Debug, Clone)]
pub struct SplitRanges {
    next_start: usize,
    len: usize,
    step: usize,
}

impl Iterator for SplitRanges {
    type Item = Range<usize>;

    fn next(&mut self) -> Option<Range<usize>> {
        if self.next_start >= self.len {
            return None;
        }
        let start = self.next_start;
        let end = (start + self.step).min(self.len);
        self.next_start = end;
        Some(start..end)
    }
}

/// Runs `f(range)` for each range of [`split_ranges`]`(len, threads, align)` on the pool
/// and returns when all have finished. With one range it runs on the calling thread.
pub fn for_each_range<F>(len: usize, threads: usize, align: usize, f: F)
where
    F: Fn(Range<usize>) + Sync,
{
    for_each_split(len, threads, align, (), &|(), _| ((), ()), &|r, ()| f(r));
}

/// Runs `f(range, piece)` for each range of [`split_ranges`]`(len, threads, align)`, where
/// `piece` is the part of `data` that `split` cuts out for it (`split(data, n)` gives the
/// first `n` of `data`'s rows and the rest), and returns when all have finished.
///
/// The ranges are halved recursively with [`join`]: a call allocates nothing. With one
/// range it runs on the calling thread.
pub fn for_each_split<S, F>(
    len: usize,
    threads: usize,
    align: usize,
    data: S,
    split: &(dyn Fn(S, usize) -> (S, S) + Sync),
    f: &F,
) where
    S: Send,
    F: Fn(Range<usize>, S) + Sync,
{
    let step = split_ranges(len, threads, align).step.max(1);
    let parts = len.div_ceil(step);
    match parts {
        0 => {}
        1 => f(0..len, data),
        _ => halves(0, parts, step, len, data, split, f),
    }
}

/// Parts `a..b` of `step` elements (the last ends at `len`), halved until one is left.
fn halves<S, F>(
    a: usize,
    b: usize,
    step: usize,
    len: usize,
    data: S,
    split: &(dyn Fn(S, usize) -> (S, S) + Sync),
    f: &F,
) where
    S: Send,
    F: Fn(Range<usize>, S) + Sync,
{
    let start = a * step;
    if b - a == 1 {
        return f(start..(b * step).min(len), data);
    }
    let m = (a + b) / 2;
    let (left, right) = split(data, m * step - start);
    join(
        || halves(a, m, step, len, left, split, f),
        || halves(m, b, step, len, right, split, f),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn ranges_cover_exactly_once_and_are_aligned() {
        for len in [0, 1, 7, 22, 4097, 1_000_003] {
            for parts in 1..6 {
                for align in [1, 8, 16, 64] {
                    let ranges: Vec<_> = split_ranges(len, parts, align).collect();
                    assert!(ranges.len() <= parts);
                    let mut expect_start = 0;
                    for r in &ranges {
                        assert_eq!(r.start, expect_start);
                        assert_eq!(r.start % align, 0);
                        assert!(!r.is_empty());
                        expect_start = r.end;
                    }
                    assert_eq!(expect_start, len);
                }
            }
        }
    }

    #[test]
    fn for_each_range_visits_every_index() {
        let len = 100_003;
        let hits: Vec<AtomicUsize> = (0..len).map(|_| AtomicUsize::new(0)).collect();
        for threads in [1, 2, 3, 8] {
            for_each_range(len, threads, 16, |r| {
                for i in r {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 4));
    }

    #[test]
    fn join_returns_both_results_and_nests() {
        fn sum(v: &[u64]) -> u64 {
            if v.len() <= 64 {
                return v.iter().sum();
            }
            let (l, r) = v.split_at(v.len() / 2);
            let (a, b) = join(|| sum(l), || sum(r));
            a + b
        }
        let v: Vec<u64> = (0..100_000).collect();
        assert_eq!(sum(&v), 100_000 * 99_999 / 2);
    }

    #[test]
    fn a_panic_in_either_half_reaches_the_caller_after_both_finish() {
        for left in [true, false] {
            let other_finished = std::sync::atomic::AtomicBool::new(false);
            let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
                join(
                    || {
                        if left {
                            panic!("left half");
                        }
                        std::thread::sleep(std::time::Duration::from_millis(20));
                        other_finished.store(true, Ordering::SeqCst);
                    },
                    || {
                        if !left {
                            panic!("right half");
                        }
                        std::thread::sleep(std::time::Duration::from_millis(20));
                        other_finished.store(true, Ordering::SeqCst);
                    },
                )
            }));
            let message = result.unwrap_err();
            let message = message.downcast_ref::<&str>().copied().unwrap_or("");
            assert_eq!(message, if left { "left half" } else { "right half" });
            assert!(
                other_finished.load(Ordering::SeqCst),
                "returned before the other half ended"
            );
        }
    }

    #[test]
    fn callers_on_many_threads_share_the_pool() {
        std::thread::scope(|s| {
            for t in 0..8u64 {
                s.spawn(move || {
                    for round in 0..50u64 {
                        let hits: Vec<AtomicUsize> =
                            (0..1000).map(|_| AtomicUsize::new(0)).collect();
                        for_each_range(1000, 4, 8, |r| {
                            for i in r {
                                hits[i].fetch_add(1, Ordering::Relaxed);
                            }
                        });
                        assert!(
                            hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                            "{t} {round}"
                        );
                    }
                });
            }
        });
    }
}
