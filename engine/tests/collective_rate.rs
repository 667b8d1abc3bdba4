//! `CostModel::calibrate_collective`: the group's all-gather rate, measured by every rank
//! together, counted as the plan counts a collective's bytes, the same on every rank.

use std::sync::Arc;
use std::time::Duration;

use strata_comm::{Collective, CommError, Solo, ThreadGroup};
use strata_engine::plan::CostModel;

/// Each rank's rate, measured on threads of one group of `ranks`; `slow` wraps a rank.
fn measure(
    ranks: usize,
    bytes: usize,
    slow: impl Fn(ThreadGroup) -> Arc<dyn Collective>,
) -> Vec<f64> {
    let group = ThreadGroup::new(ranks, Duration::from_secs(60));
    let comms: Vec<Arc<dyn Collective>> = group.into_iter().map(slow).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| s.spawn(move || CostModel::calibrate_collective(comm.as_ref(), bytes)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect()
    })
}

#[test]
fn two_ranks_measure_one_finite_rate() {
    let rates = measure(2, 1 << 20, |g| Arc::new(g));
    println!(
        "2 ranks as threads, 1 MiB per rank: {:.2} GB/s",
        rates[0] / 1e9
    );
    assert!(rates[0].is_finite() && rates[0] > 0.0, "{rates:?}");
    assert_eq!(rates[0].to_bits(), rates[1].to_bits(), "{rates:?}");
}

/// A rank that takes `delay` longer than the others over each all-gather of `bytes`,
/// after its data has gone: the others' all-gathers are as fast as ever.
#[derive(Debug)]
struct Late {
    inner: ThreadGroup,
    bytes: usize,
    delay: Duration,
}

impl Collective for Late {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_gather(&self, send: &[u8], recv: &mut [u8]) -> Result<(), CommError> {
        self.inner.all_gather(send, recv)?;
        if send.len() == self.bytes {
            std::thread::sleep(self.delay);
        }
        Ok(())
    }
    fn reduce_scatter_sum(
        &self,
        send: &[f32],
        acc: &mut [f32],
        accumulate: bool,
    ) -> Result<(), CommError> {
        self.inner.reduce_scatter_sum(send, acc, accumulate)
    }
    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<(), CommError> {
        self.inner.all_reduce_sum_f64(values)
    }
    fn broadcast(&self, root: usize, buf: &mut [u8]) -> Result<(), CommError> {
        self.inner.broadcast(root, buf)
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.inner.barrier()
    }
    fn abort(&self, why: &str) {
        self.inner.abort(why)
    }
}

#[test]
fn the_rate_counts_every_ranks_bytes_at_the_slowest_ranks_time() {
    // Rank 1 takes at least 40 ms per gather of 256 KiB; a gather of 256 KiB on threads
    // takes well under a millisecond, so the group's time is 40 ms and a little more.
    let (bytes, delay) = (256 << 10, Duration::from_millis(40));
    let rates = measure(2, bytes, |g| {
        if g.rank() == 1 {
            Arc::new(Late {
                inner: g,
                bytes,
                delay,
            })
        } else {
            Arc::new(g)
        }
    });
    assert_eq!(rates[0].to_bits(), rates[1].to_bits(), "{rates:?}");
    // Counted as the plan's AllGather bytes: the whole gathered buffer, both shards.
    let at_most = (2 * bytes) as f64 / delay.as_secs_f64();
    assert!(
        rates[0] <= at_most && rates[0] > 0.6 * at_most,
        "{} B/s, expected about {at_most} B/s",
        rates[0]
    );
}

#[test]
fn one_rank_keeps_the_default_rate() {
    let default = CostModel::default().collective_bytes_per_s;
    assert_eq!(
        CostModel::calibrate_collective(&Solo::new(), 1 << 20).unwrap(),
        default
    );
    let one = ThreadGroup::new(1, Duration::from_secs(1));
    assert_eq!(
        CostModel::calibrate_collective(&one[0], 1 << 20).unwrap(),
        default
    );
}
