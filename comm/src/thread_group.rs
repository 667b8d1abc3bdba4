//! [`ThreadGroup`]: N ranks in one process, one per thread, so the engine's data
//! parallelism is testable without MPI. Each collective is one round of a shared
//! rendezvous: every rank deposits its description and its data, the last to arrive
//! checks the descriptions, then every rank reads what it needs and leaves; the round
//! ends when the last one has left. Not a fast transport: data is copied under one lock.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::call::{Call, check_calls};
use crate::fold::{fold_f32, fold_f64};
use crate::{Collective, CommError};

/// One rank of a group of threads in one process.
///
/// [`ThreadGroup::new`] makes all N ranks; hand each to its own thread. A call that waits
/// longer than the group's timeout for the others returns [`CommError::Timeout`] naming
/// the ranks that did not arrive, and breaks the group: every pending and later call on
/// every rank then fails with that error. [`Collective::abort`] breaks it the same way
/// with [`CommError::Aborted`], waking every waiting rank at once.
///
/// Each rank's calls must be sequential: a rank that starts a collective while another
/// of its own is still in progress panics (it would otherwise mix the two calls' data).
pub struct ThreadGroup {
    rank: usize,
    shared: Arc<Shared>,
    /// Set while this rank is inside a collective: two at once from one rank is a bug in
    /// the caller that would otherwise deadlock or mix up two calls' data.
    in_call: AtomicBool,
}

struct Shared {
    size: usize,
    timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Ranks are depositing their calls; nobody has read yet.
    Gathering,
    /// Every rank has deposited; ranks are reading and leaving.
    Draining,
}

struct State {
    phase: Phase,
    /// `calls[p]` is rank p's description of the current call, valid where `arrived[p]`.
    calls: Vec<Call>,
    arrived: Vec<bool>,
    arrived_count: usize,
    departed: Vec<bool>,
    departed_count: usize,
    /// The check of every rank's call, made once by the last rank to arrive.
    verdict: Result<(), CommError>,
    /// Each rank's deposited data. Grow-only: after the first call of a given size no
    /// round allocates.
    bytes: Vec<Vec<u8>>,
    f32s: Vec<Vec<f32>>,
    f64s: Vec<Vec<f64>>,
    /// Set by a timeout or an abort; every call fails with it from then on.
    broken: Option<CommError>,
}

impl ThreadGroup {
    /// The `size` ranks of a new group, rank p at index p. A call waits at most `timeout`
    /// for the other ranks (`Duration::MAX`: forever).
    ///
    /// # Panics
    /// When `size` is 0.
    pub fn new(size: usize, timeout: Duration) -> Vec<ThreadGroup> {
        assert!(size >= 1, "a group needs at least one rank");
        let state = State {
            phase: Phase::Gathering,
            calls: vec![Call::barrier(); size],
            arrived: vec![false; size],
            arrived_count: 0,
            departed: vec![false; size],
            departed_count: 0,
            verdict: Ok(()),
            bytes: vec![Vec::new(); size],
            f32s: vec![Vec::new(); size],
            f64s: vec![Vec::new(); size],
            broken: None,
        };
        let shared = Arc::new(Shared {
            size,
            timeout,
            state: Mutex::new(state),
            changed: Condvar::new(),
        });
        (0..size)
            .map(|rank| ThreadGroup {
                rank,
                shared: Arc::clone(&shared),
                in_call: AtomicBool::new(false),
            })
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock (lengths are checked before any copy), so
        // a poisoned lock still holds consistent state.
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until `ready`, the group breaks, or the call's time is up; a timeout breaks
    /// the group, naming the ranks `missing` returns.
    fn wait_for<'a>(
        &self,
        mut state: MutexGuard<'a, State>,
        op: &'static str,
        started: Instant,
        ready: impl Fn(&State) -> bool,
        missing: impl Fn(&State) -> Vec<usize>,
    ) -> Result<MutexGuard<'a, State>, CommError> {
        loop {
            if let Some(e) = &state.broken {
                return Err(e.clone());
            }
            if ready(&state) {
                return Ok(state);
            }
            let waited = started.elapsed();
            if waited >= self.shared.timeout {
                let e = CommError::Timeout {
                    op,
                    missing_ranks: missing(&state),
                    waited_ms: u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
                };
                log::error!("rank {}: {e}", self.rank);
                state.broken = Some(e.clone());
                self.shared.changed.notify_all();
                return Err(e);
            }
            let left = self.shared.timeout - waited;
            state = self
                .shared
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// One round: deposit `call` and this rank's data, wait for every rank, and when the
    /// calls agree, `collect` this rank's result from every rank's deposit. `buf` is the
    /// caller's buffer, lent to `deposit` to read and to `collect` to write.
    fn round<B: ?Sized>(
        &self,
        call: Call,
        buf: &mut B,
        deposit: impl FnOnce(&mut State, &B),
        collect: impl FnOnce(&State, &mut B),
    ) -> Result<(), CommError> {
        let was_in_call = self.in_call.swap(true, Ordering::Acquire);
        assert!(
            !was_in_call,
            "rank {} started a collective while another of its own was in progress; calls from one rank must be sequential",
            self.rank
        );
        let result = self.round_inner(call, buf, deposit, collect);
        self.in_call.store(false, Ordering::Release);
        result
    }

    fn round_inner<B: ?Sized>(
        &self,
        call: Call,
        buf: &mut B,
        deposit: impl FnOnce(&mut State, &B),
        collect: impl FnOnce(&State, &mut B),
    ) -> Result<(), CommError> {
        let (rank, size) = (self.rank, self.shared.size);
        let op = call.op.name();
        let started = Instant::now();
        // The previous round may still be draining: a fast rank waits for the slow ones
        // to read before overwriting its deposit.
        let not_departed = |s: &State| (0..size).filter(|&p| !s.departed[p]).collect();
        let not_arrived = |s: &State| (0..size).filter(|&p| !s.arrived[p]).collect();
        let mut state = self.lock();
        state = self.wait_for(
            state,
            op,
            started,
            |s| s.phase == Phase::Gathering,
            not_departed,
        )?;

        state.calls[rank] = call;
        state.arrived[rank] = true;
        state.arrived_count += 1;
        deposit(&mut state, buf);
        if state.arrived_count == size {
            state.verdict = check_calls(&state.calls);
            state.phase = Phase::Draining;
            self.shared.changed.notify_all();
        }
        // Draining can only be this round's: it cannot end before this rank departs.
        state = self.wait_for(
            state,
            op,
            started,
            |s| s.phase == Phase::Draining,
            not_arrived,
        )?;

        let verdict = state.verdict.clone();
        if verdict.is_ok() {
            collect(&state, buf);
        }
        state.departed[rank] = true;
        state.departed_count += 1;
        if state.departed_count == size {
            state.arrived.fill(false);
            state.departed.fill(false);
            state.arrived_count = 0;
            state.departed_count = 0;
            state.phase = Phase::Gathering;
            self.shared.changed.notify_all();
        }
        verdict
    }
}

impl fmt::Debug for ThreadGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThreadGroup")
            .field("rank", &self.rank)
            .field("size", &self.shared.size)
            .field("timeout", &self.shared.timeout)
            .finish()
    }
}

impl Collective for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_gather(&self, send: &[u8], recv: &mut [u8]) -> Result<(), CommError> {
        let rank = self.rank;
        self.round(
            Call::all_gather(send.len(), recv.len()),
            recv,
            |s, _| {
                s.bytes[rank].clear();
                s.bytes[rank].extend_from_slice(send);
            },
            |s, recv| {
                for (p, deposit) in s.bytes.iter().enumerate() {
                    recv[p * send.len()..(p + 1) * send.len()].copy_from_slice(deposit);
                }
            },
        )
    }

    fn reduce_scatter_sum(
        &self,
        send: &[f32],
        acc: &mut [f32],
        accumulate: bool,
    ) -> Result<(), CommError> {
        let (rank, size) = (self.rank, self.shared.size);
        let m = acc.len();
        self.round(
            Call::reduce_scatter_sum(send.len(), m),
            acc,
            |s, _| {
                s.f32s[rank].clear();
                s.f32s[rank].extend_from_slice(send);
            },
            |s, acc| {
                fold_f32(acc, accumulate, size, |p| {
                    &s.f32s[p][rank * m..(rank + 1) * m]
                })
            },
        )
    }

    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<(), CommError> {
        let (rank, size) = (self.rank, self.shared.size);
        self.round(
            Call::all_reduce_sum_f64(values.len()),
            values,
            |s, values| {
                s.f64s[rank].clear();
                s.f64s[rank].extend_from_slice(values);
            },
            |s, values| fold_f64(values, size, |p| &s.f64s[p]),
        )
    }

    fn broadcast(&self, root: usize, buf: &mut [u8]) -> Result<(), CommError> {
        let rank = self.rank;
        self.round(
            Call::broadcast(root, buf.len()),
            buf,
            |s, buf| {
                if rank == root {
                    s.bytes[rank].clear();
                    s.bytes[rank].extend_from_slice(buf);
                }
            },
            |s, buf| {
                if rank != root {
                    buf.copy_from_slice(&s.bytes[root]);
                }
            },
        )
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.round(Call::barrier(), &mut (), |_, _| {}, |_, _| {})
    }

    fn abort(&self, why: &str) {
        let mut state = self.lock();
        if state.broken.is_none() {
            state.broken = Some(CommError::Aborted {
                rank: self.rank,
                why: why.to_string(),
            });
        }
        self.shared.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Solo, conformance, reference};

    const LONG: Duration = Duration::from_secs(30);

    /// Runs `f` on every rank of a new group of `size`, one thread each; results in rank
    /// order.
    fn on_ranks<R: Send>(
        size: usize,
        timeout: Duration,
        f: impl Fn(&ThreadGroup) -> R + Sync,
    ) -> Vec<R> {
        let group = ThreadGroup::new(size, timeout);
        std::thread::scope(|scope| {
            let handles: Vec<_> = group
                .iter()
                .map(|rank| {
                    scope.spawn(|| {
                        // A rank whose assertion fails ends the group, so the others
                        // fail at once instead of waiting out the timeout.
                        let result =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(rank)));
                        result.unwrap_or_else(|panic| {
                            rank.abort("this rank's test panicked");
                            std::panic::resume_unwind(panic)
                        })
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn conformance_on_solo_and_every_size() {
        let report = conformance::check(&Solo::new(), 7).unwrap();
        assert!(report.compared_count > 0);
        for size in 1..=4 {
            for seed in [1, 2] {
                for result in on_ranks(size, LONG, |c| conformance::check(c, seed)) {
                    let report = result.unwrap();
                    assert_eq!(report.compared_count, conformance_compared(size));
                }
            }
        }
    }

    fn conformance_compared(size: usize) -> usize {
        // per length: all_gather, two reduce-scatters, all-reduce, one broadcast per root
        5 * (4 + size)
    }

    #[test]
    fn all_gather_is_in_rank_order() {
        for size in 1..=4 {
            let recvs = on_ranks(size, LONG, |c| {
                let send = [c.rank() as u8 * 10, c.rank() as u8 * 10 + 1];
                let mut recv = vec![0u8; 2 * size];
                c.all_gather(&send, &mut recv).unwrap();
                recv
            });
            let want: Vec<u8> = (0..size as u8).flat_map(|p| [p * 10, p * 10 + 1]).collect();
            assert!(recvs.iter().all(|r| *r == want), "size {size}: {recvs:?}");
        }
    }

    /// Rank p sends `terms[p]` in every element of every chunk: the order of the adds
    /// decides the result (1e8 + -1e8 + 1 is 1; 1 + -1e8 + 1e8 is 0 in f32).
    #[test]
    fn reduce_scatter_sums_in_rank_order_bit_for_bit() {
        let terms = [1e8f32, -1e8, 1.0, 0.5];
        for size in 1..=4 {
            for accumulate in [false, true] {
                let m = 5;
                let start = 3.0e-8f32;
                let sends: Vec<Vec<f32>> = (0..size).map(|p| vec![terms[p]; size * m]).collect();
                let accs = on_ranks(size, LONG, |c| {
                    let mut acc = vec![start; m];
                    c.reduce_scatter_sum(&sends[c.rank()], &mut acc, accumulate)
                        .unwrap();
                    acc
                });
                let views: Vec<&[f32]> = sends.iter().map(Vec::as_slice).collect();
                for (rank, acc) in accs.iter().enumerate() {
                    let mut want = vec![start; m];
                    reference::reduce_scatter_sum(rank, &views, &mut want, accumulate);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(acc),
                        bits(&want),
                        "size {size} accumulate {accumulate}"
                    );
                }
                if size == 3 && !accumulate {
                    assert_eq!(accs[0][0], 1.0, "((1e8 + -1e8) + 1) in rank order");
                }
            }
        }
    }

    #[test]
    fn reduce_scatter_without_accumulate_keeps_negative_zero() {
        for size in 1..=4 {
            let accs = on_ranks(size, LONG, |c| {
                let send = vec![-0.0f32; size * 2];
                let mut acc = vec![7.0f32; 2];
                c.reduce_scatter_sum(&send, &mut acc, false).unwrap();
                acc
            });
            for acc in accs {
                assert!(
                    acc.iter().all(|v| v.to_bits() == (-0.0f32).to_bits()),
                    "size {size}: {acc:?}"
                );
            }
        }
    }

    #[test]
    fn all_reduce_f64_sums_in_rank_order() {
        let terms = [1e16f64, -1e16, 1.0, 0.25];
        for size in 1..=4 {
            let results = on_ranks(size, LONG, |c| {
                let mut values = vec![terms[c.rank()]; 3];
                c.all_reduce_sum_f64(&mut values).unwrap();
                values
            });
            let want = terms[..size].iter().copied().reduce(|a, b| a + b).unwrap();
            for values in &results {
                assert!(
                    values.iter().all(|v| v.to_bits() == want.to_bits()),
                    "size {size}: {values:?}"
                );
            }
        }
        let results = on_ranks(3, LONG, |c| {
            let mut v = [terms[c.rank()]];
            c.all_reduce_sum_f64(&mut v).unwrap();
            v[0]
        });
        assert_eq!(results, [1.0; 3], "((1e16 + -1e16) + 1) in rank order");
    }

    #[test]
    fn mismatched_lengths_fail_on_every_rank_and_the_group_goes_on() {
        for size in 2..=4 {
            let results = on_ranks(size, LONG, |c| {
                let send = vec![0u8; if c.rank() == 1 { 3 } else { 2 }];
                let mut recv = vec![0u8; size * send.len()];
                let gathered = c.all_gather(&send, &mut recv);
                (gathered, c.barrier())
            });
            for (rank, (gathered, barrier)) in results.into_iter().enumerate() {
                let e = gathered.unwrap_err();
                assert!(
                    e.to_string()
                        .starts_with("all_gather: send lengths differ across ranks: ["),
                    "rank {rank}: {e}"
                );
                barrier.unwrap();
            }
        }
    }

    #[test]
    fn different_collectives_fail_on_every_rank() {
        let results = on_ranks(2, LONG, |c| {
            if c.rank() == 0 {
                c.barrier()
            } else {
                c.all_reduce_sum_f64(&mut [1.0])
            }
        });
        for r in results {
            assert_eq!(
                r,
                Err(CommError::OpMismatch {
                    ops: vec!["barrier", "all_reduce_sum_f64"]
                })
            );
        }
    }

    #[test]
    fn timeout_names_the_rank_that_never_came() {
        let results = on_ranks(3, Duration::from_millis(200), |c| {
            if c.rank() == 1 {
                return None;
            }
            let started = Instant::now();
            let first = c.barrier();
            Some((first, started.elapsed(), c.barrier()))
        });
        for (rank, r) in results.into_iter().enumerate() {
            let Some((first, elapsed, later)) = r else {
                continue;
            };
            match first {
                Err(CommError::Timeout {
                    op: "barrier",
                    missing_ranks,
                    ..
                }) => {
                    assert_eq!(missing_ranks, [1], "rank {rank}")
                }
                other => panic!("rank {rank}: {other:?}"),
            }
            assert!(
                elapsed < Duration::from_secs(10),
                "rank {rank} waited {elapsed:?}"
            );
            assert!(
                matches!(later, Err(CommError::Timeout { .. })),
                "rank {rank}: {later:?}"
            );
        }
    }

    #[test]
    fn abort_wakes_every_waiter_at_once() {
        let results = on_ranks(3, LONG, |c| {
            let started = Instant::now();
            if c.rank() == 2 {
                std::thread::sleep(Duration::from_millis(50));
                c.abort("loss is NaN");
                return (c.barrier(), started.elapsed());
            }
            let mut acc = [0.0f32; 1];
            (
                c.reduce_scatter_sum(&[1.0; 3], &mut acc, true),
                started.elapsed(),
            )
        });
        for (rank, (result, elapsed)) in results.into_iter().enumerate() {
            assert_eq!(
                result,
                Err(CommError::Aborted {
                    rank: 2,
                    why: "loss is NaN".into()
                }),
                "rank {rank}"
            );
            assert!(
                elapsed < Duration::from_secs(10),
                "rank {rank} waited {elapsed:?}"
            );
        }
    }

    #[test]
    fn solo_aborts_and_checks_lengths() {
        let solo = Solo::new();
        let mut acc = [1.0f32, -0.0];
        solo.reduce_scatter_sum(&[-0.0, -0.0], &mut acc, false)
            .unwrap();
        assert_eq!(acc.map(f32::to_bits), [(-0.0f32).to_bits(); 2]);
        solo.reduce_scatter_sum(&[1e8, 2.0], &mut acc, true)
            .unwrap();
        assert_eq!(acc, [1e8, 2.0]);
        assert!(matches!(
            solo.all_gather(&[1, 2], &mut [0; 3]),
            Err(CommError::LengthMismatch {
                op: "all_gather",
                ..
            })
        ));
        assert!(matches!(
            solo.broadcast(1, &mut [0]),
            Err(CommError::InvalidRoot { .. })
        ));
        solo.abort("stop");
        assert_eq!(
            solo.barrier(),
            Err(CommError::Aborted {
                rank: 0,
                why: "stop".into()
            })
        );
    }

    #[test]
    fn many_rounds_back_to_back() {
        // Ranks racing through many rounds: a fast rank must not overwrite a deposit a
        // slow rank is still reading.
        let results = on_ranks(4, LONG, |c| {
            let mut sums = Vec::new();
            for round in 0..500u32 {
                let send = vec![(c.rank() as u32 * 1000 + round) as f32; 4];
                let mut acc = [0.0f32];
                c.reduce_scatter_sum(&send, &mut acc, false).unwrap();
                sums.push(acc[0]);
            }
            sums
        });
        for sums in results {
            for (round, sum) in sums.into_iter().enumerate() {
                assert_eq!(sum, (6000 + 4 * round) as f32);
            }
        }
    }
}
