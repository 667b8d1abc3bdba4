//! The persistent worker pool every multithreaded CPU kernel runs on.
//!
//! One pool of one thread per available core is built on first use and lives for the
//! process, so no kernel spawns a thread per call. It is rayon's pool, wrapped so that a
//! kernel asks for a thread count and gets contiguous, aligned pieces of its range.
//!
//! This module does not choose how many threads a kernel should use: callers do, since
//! the engine runs the optimizer beside other work and gives it a share of the cores.

use std::ops::Range;
use std::sync::OnceLock;

static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();

/// The process-wide worker pool, built on first use with one thread per available core.
pub fn pool() -> &'static rayon::ThreadPool {
    POOL.get_or_init(|| {
        let thread_count = std::thread::available_parallelism().map_or(1, |n| n.get());
        rayon::ThreadPoolBuilder::new()
            .num_threads(thread_count)
            .thread_name(|i| format!("strata-cpu-{i}"))
            .build()
            .expect("the CPU worker pool could not start its threads")
    })
}

/// How many threads the pool has: the most a kernel call can use at once.
pub fn max_threads() -> usize {
    pool().current_num_threads()
}

/// Runs `f` inside the pool's scope: tasks spawned on the scope run on the pool's threads
/// and have all finished when this returns.
pub fn scope<'scope, F, R>(f: F) -> R
where
    F: FnOnce(&rayon::Scope<'scope>) -> R + Send,
    R: Send,
{
    pool().scope(f)
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
/// The ranges are halved recursively with `rayon::join` inside the pool, whose jobs live
/// on the stack: a call allocates nothing (a scope's spawned jobs are boxed, one heap
/// allocation each, thousands per training step). With one range it runs on the calling
/// thread.
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
        _ => pool().install(|| halves(0, parts, step, len, data, split, f)),
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
    rayon::join(
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
}
