//! Property: whatever the interleaving of concurrent reads and writes of different
//! extents, every read returns what the last write of that extent put there.
//!
//! Several threads share one store, each driving its own extents with a generated
//! sequence of writes and reads, keeping several transfers in flight at once. It runs on
//! every backend, and on the fault-injecting one with only the faults a backend must
//! absorb (short transfers, EINTR, delays), where every transfer must still succeed.

mod common;

use std::collections::VecDeque;
use std::time::Duration;

use common::{backends, pattern, small_config, test_dir};
use proptest::prelude::*;
use strata_storage::{AlignedBuf, ExtentId, FaultPlan, Pending, StoreConfig, TensorStore};

#[derive(Debug, Clone)]
enum Op {
    Write { extent: usize, seed: u64 },
    Read { extent: usize },
}

#[derive(Debug, Clone)]
struct ThreadPlan {
    sizes: Vec<usize>,
    ops: Vec<Op>,
    in_flight: usize,
}

fn thread_plan() -> impl Strategy<Value = ThreadPlan> {
    (
        prop::collection::vec(1usize..300_000, 1..4),
        1usize..5,
        prop::collection::vec((any::<bool>(), 0usize..4, any::<u64>()), 1..24),
    )
        .prop_map(|(sizes, in_flight, raw)| {
            let n = sizes.len();
            let ops = raw
                .into_iter()
                .map(|(write, e, seed)| {
                    if write {
                        Op::Write {
                            extent: e % n,
                            seed,
                        }
                    } else {
                        Op::Read { extent: e % n }
                    }
                })
                .collect();
            ThreadPlan {
                sizes,
                ops,
                in_flight,
            }
        })
}

enum InFlight {
    Write(usize, Pending<AlignedBuf>),
    Read(usize, Option<u64>, Pending<AlignedBuf>),
}

impl InFlight {
    fn extent(&self) -> usize {
        match self {
            InFlight::Write(e, _) | InFlight::Read(e, _, _) => *e,
        }
    }

    /// Waits and checks the outcome against the model.
    fn finish(self, sizes: &[usize]) {
        match self {
            InFlight::Write(e, pending) => {
                let (result, _) = pending.wait();
                result.unwrap_or_else(|err| panic!("write of extent {e}: {err}"));
            }
            InFlight::Read(e, expected, pending) => {
                let (result, buf) = pending.wait();
                match expected {
                    Some(seed) => {
                        result.unwrap_or_else(|err| panic!("read of extent {e}: {err}"));
                        assert!(
                            buf.as_slice() == pattern(sizes[e], seed).as_slice(),
                            "extent {e} read back other bytes than written"
                        );
                    }
                    None => assert!(result.is_err(), "an unwritten extent was readable"),
                }
            }
        }
    }
}

fn run_thread(store: &TensorStore, thread: usize, plan: &ThreadPlan) {
    let ids: Vec<ExtentId> = plan
        .sizes
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            store
                .allocate(&format!("t{thread}e{i}"), len as u64)
                .unwrap()
        })
        .collect();
    let mut last_written: Vec<Option<u64>> = vec![None; ids.len()];
    let mut in_flight: VecDeque<InFlight> = VecDeque::new();
    for op in &plan.ops {
        let extent = match op {
            Op::Write { extent, .. } | Op::Read { extent } => *extent,
        };
        // One extent's transfers do not overlap (the store refuses that); others may.
        while let Some(i) = in_flight.iter().position(|f| f.extent() == extent) {
            in_flight.remove(i).unwrap().finish(&plan.sizes);
        }
        while in_flight.len() >= plan.in_flight {
            in_flight.pop_front().unwrap().finish(&plan.sizes);
        }
        match *op {
            Op::Write { extent, seed } => {
                let pending = store.write(ids[extent], pattern(plan.sizes[extent], seed));
                last_written[extent] = Some(seed);
                in_flight.push_back(InFlight::Write(extent, pending));
            }
            Op::Read { extent } => {
                let pending = store.read(ids[extent], AlignedBuf::zeroed(plan.sizes[extent]));
                in_flight.push_back(InFlight::Read(extent, last_written[extent], pending));
            }
        }
    }
    for f in in_flight {
        f.finish(&plan.sizes);
    }
}

fn check(config: StoreConfig, plans: &[ThreadPlan]) {
    let store = TensorStore::create(config).unwrap();
    std::thread::scope(|s| {
        for (t, plan) in plans.iter().enumerate() {
            let store = &store;
            s.spawn(move || run_thread(store, t, plan));
        }
    });
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn reads_return_the_last_write_under_any_interleaving(
        plans in prop::collection::vec(thread_plan(), 1..4),
    ) {
        for backend in backends() {
            let dir = test_dir();
            check(small_config(dir.path(), 8 << 20, backend), &plans);
        }
        let dir = test_dir();
        let absorbable = FaultPlan {
            short_per_million: 200_000,
            eintr_per_million: 100_000,
            delay_per_million: 50_000,
            max_delay: Duration::from_micros(500),
            ..FaultPlan::seeded(7)
        };
        let config = StoreConfig {
            faults: Some(absorbable),
            ..small_config(dir.path(), 8 << 20, strata_storage::BackendChoice::Threads)
        };
        check(config, &plans);
    }
}
