//! The pinned host pool: slots are disjoint and never handed out twice, many threads can
//! share a pool, an empty pool waits with a bound and then fails naming its budget, and stats
//! count what happened. How the memory is locked is tested in pinned_pool_locking.rs.
//! The slot layout and an NVMe read into a registered slot are written once for each
//! device's pinning (`test_device!`: mlock for the CPU device, registered with the
//! driver for a GPU, whose test is ignored unless asked for and fails without one).

mod support;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use strata_engine::EngineError;
use strata_engine::device::Device;
use strata_engine::memory::{PinnedPool, PinnedPoolConfig, Pinning};
use strata_engine::storage::{DIRECT_IO_ALIGN, IoBuf};
use support::{DeviceSpec, test_device};

fn pool(name: &str, slot_bytes: usize, slot_count: usize, timeout: Duration) -> PinnedPool {
    pool_pinned(name, slot_bytes, slot_count, timeout, &Pinning::Mlock)
}

fn pool_pinned(
    name: &str,
    slot_bytes: usize,
    slot_count: usize,
    timeout: Duration,
    pinning: &Pinning,
) -> PinnedPool {
    PinnedPool::new(
        PinnedPoolConfig {
            name: name.into(),
            budget_bytes: slot_bytes * slot_count,
            slot_bytes,
            acquire_timeout: timeout,
        },
        pinning,
    )
    .expect("pool")
}

/// The device is opened for its pinning only.
const PINNING_ONLY: DeviceSpec = DeviceSpec::new(1 << 20).copies_only();

test_device!(
    slots_are_aligned_disjoint_and_inside_the_registered_region,
    PINNING_ONLY
);

fn slots_are_aligned_disjoint_and_inside_the_registered_region(device: &Device) {
    let pool = PinnedPool::new(
        PinnedPoolConfig {
            name: "layout".into(),
            // Not a whole number of slots: the remainder is left unmapped.
            budget_bytes: 10 * 65536 + 1000,
            // Rounded up to the O_DIRECT alignment.
            slot_bytes: 65000,
            acquire_timeout: Duration::from_millis(10),
        },
        &device.pinning(),
    )
    .unwrap();
    assert_eq!(pool.slot_bytes(), 65536);
    assert_eq!(pool.slot_count(), 10);
    let region = pool.io_region();
    assert_eq!(region.len_bytes, 10 * 65536);
    let mut leases: Vec<_> = (0..10).map(|_| pool.try_acquire().unwrap()).collect();
    assert!(pool.try_acquire().is_none());
    let mut starts = HashSet::new();
    for lease in &mut leases {
        assert_eq!(lease.as_ptr() as usize % DIRECT_IO_ALIGN, 0);
        assert_eq!(lease.capacity_bytes(), 65536);
        assert!(region.contains(lease.as_ptr(), lease.capacity_bytes()));
        assert!(starts.insert(lease.as_ptr() as usize));
        // Fresh memory is zeroed, and the whole slot is writable.
        assert!(lease.as_slice().iter().all(|&b| b == 0));
        let index = lease.index() as u8;
        lease.as_mut_slice().fill(index);
    }
    for lease in &leases {
        let index = lease.index() as u8;
        assert!(lease.as_slice().iter().all(|&b| b == index));
    }
    let indices: HashSet<usize> = leases.iter().map(|l| l.index()).collect();
    assert_eq!(indices.len(), 10);
    drop(leases);
    assert_eq!(pool.stats().in_use_slots, 0);
}

#[test]
fn a_bad_configuration_is_refused_with_the_reason() {
    let config = |budget_bytes, slot_bytes| PinnedPoolConfig {
        name: "tiny".into(),
        budget_bytes,
        slot_bytes,
        acquire_timeout: Duration::ZERO,
    };
    match PinnedPool::new(config(4096, 8192), &Pinning::Mlock) {
        Err(EngineError::PinnedPoolConfig { pool, reason }) => {
            assert_eq!(pool, "tiny");
            assert!(reason.contains("smaller than one slot"), "{reason}");
        }
        other => panic!("expected a configuration error, got {other:?}"),
    }
    assert!(PinnedPool::new(config(4096, 0), &Pinning::Mlock).is_err());
    // A slot size that cannot be rounded up to whole pages is refused, not wrapped.
    match PinnedPool::new(config(4096, usize::MAX - 10), &Pinning::Mlock) {
        Err(EngineError::PinnedPoolConfig { reason, .. }) => {
            assert!(reason.contains("cannot be rounded"), "{reason}")
        }
        other => panic!("expected a configuration error, got {other:?}"),
    }
}

#[test]
fn an_endless_timeout_waits_for_a_release() {
    // Duration::MAX means "wait for ever": no deadline to compute, no panic.
    let pool = pool("endless", 4096, 1, Duration::MAX);
    let held = pool.acquire().unwrap();
    let waiter = {
        let pool = pool.clone();
        std::thread::spawn(move || pool.acquire().map(|lease| lease.index()))
    };
    while pool.stats().waits == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let index = held.index();
    drop(held);
    assert_eq!(waiter.join().unwrap().unwrap(), index);
}

#[test]
fn many_threads_never_share_a_slot() {
    const THREADS: usize = 8;
    const ROUNDS: usize = 2000;
    const SLOTS: usize = 3;
    let pool = pool("contended", 4096, SLOTS, Duration::from_secs(30));
    // An independent record of which slots are out, kept by the test itself.
    let held: Arc<Vec<AtomicBool>> = Arc::new((0..SLOTS).map(|_| AtomicBool::new(false)).collect());
    let start = Arc::new(Barrier::new(THREADS));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let pool = pool.clone();
            let held = Arc::clone(&held);
            let start = Arc::clone(&start);
            std::thread::spawn(move || {
                start.wait();
                for round in 0..ROUNDS {
                    let mut lease = pool.acquire().expect("a slot within 30 s");
                    let was_held = held[lease.index()].swap(true, Ordering::SeqCst);
                    assert!(!was_held, "slot {} handed to two threads", lease.index());
                    let stamp = ((t * ROUNDS + round) % 251) as u8;
                    lease.as_mut_slice().fill(stamp);
                    std::thread::yield_now();
                    assert!(
                        lease.as_slice().iter().all(|&b| b == stamp),
                        "another thread wrote into slot {}",
                        lease.index()
                    );
                    held[lease.index()].store(false, Ordering::SeqCst);
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("worker");
    }
    let stats = pool.stats();
    assert_eq!(stats.acquires, (THREADS * ROUNDS) as u64);
    assert_eq!(stats.in_use_slots, 0);
    assert_eq!(stats.timeouts, 0);
    assert!(stats.high_water_slots <= SLOTS && stats.high_water_slots >= 1);
    assert!(stats.waits <= stats.acquires);
    println!(
        "{THREADS} threads x {ROUNDS} rounds on {SLOTS} slots: high water {}, {} waits, wait p50 \
         {:?} p99 {:?} max {:?}",
        stats.high_water_slots, stats.waits, stats.wait_p50, stats.wait_p99, stats.wait_max
    );
}

#[test]
fn an_empty_pool_waits_its_timeout_then_names_the_budget() {
    let pool = pool("exhausted", 8192, 2, Duration::from_millis(40));
    let _a = pool.acquire().unwrap();
    let _b = pool.acquire().unwrap();
    let started = Instant::now();
    let error = pool.acquire().unwrap_err();
    assert!(started.elapsed() >= Duration::from_millis(40));
    match &error {
        EngineError::PinnedPoolExhausted {
            pool,
            slot_count,
            slot_bytes,
            budget_bytes,
            in_use_slots,
            waited,
        } => {
            assert_eq!(pool, "exhausted");
            assert_eq!(*slot_count, 2);
            assert_eq!(*slot_bytes, 8192);
            assert_eq!(*budget_bytes, 16384);
            assert_eq!(*in_use_slots, 2);
            assert!(*waited >= Duration::from_millis(40));
        }
        other => panic!("expected PinnedPoolExhausted, got {other:?}"),
    }
    assert!(error.to_string().contains("budget"));
    let stats = pool.stats();
    assert_eq!(stats.waits, 1);
    assert_eq!(stats.timeouts, 1);
    assert_eq!(stats.acquires, 2);
    assert_eq!(stats.high_water_slots, 2);
    assert!(stats.wait_max >= Duration::from_millis(40));
    assert!(stats.wait_total >= Duration::from_millis(40));
}

#[test]
fn a_release_wakes_a_waiting_acquire() {
    let pool = pool("handoff", 4096, 1, Duration::from_secs(30));
    let held = pool.acquire().unwrap();
    let held_index = held.index();
    let waiter = {
        let pool = pool.clone();
        std::thread::spawn(move || {
            let started = Instant::now();
            let lease = pool.acquire().expect("woken by the release");
            (lease.index(), started.elapsed())
        })
    };
    // Let the waiter go to sleep on the empty pool, then hand the slot over.
    while pool.stats().waits == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(20));
    drop(held);
    let (index, waited) = waiter.join().unwrap();
    assert_eq!(index, held_index);
    assert!(waited >= Duration::from_millis(20));
    // Woken by the release, not by the 30 s timeout.
    assert!(waited < Duration::from_secs(20), "waited {waited:?}");
    let stats = pool.stats();
    assert_eq!((stats.waits, stats.timeouts, stats.acquires), (1, 0, 2));
    assert!(stats.wait_p50 >= Duration::from_millis(20));
}

test_device!(an_nvme_read_lands_in_a_registered_slot, PINNING_ONLY);

fn an_nvme_read_lands_in_a_registered_slot(device: &Device) {
    use strata_engine::storage::{BackendKind, StoreConfig, TensorStore};

    const LEN: usize = 3 << 20;
    // On disk, not tmpfs, so O_DIRECT can be used where the filesystem allows it.
    let dir = tempfile::tempdir_in(std::env::current_dir().unwrap()).unwrap();
    let store = TensorStore::create(StoreConfig::new(dir.path(), 4 * LEN as u64)).unwrap();
    let pool = pool_pinned("nvme", LEN, 2, Duration::from_secs(1), &device.pinning());
    pool.register_with(&store).unwrap();

    let extent = store.allocate("block0.params", LEN as u64).unwrap();
    let mut source = pool.acquire().unwrap();
    for (i, b) in source.as_mut_slice().iter_mut().enumerate() {
        *b = (i % 253) as u8;
    }
    let (written, source) = store.write(extent, source).wait();
    written.unwrap();
    let source_index = source.index();
    drop(source);
    // Read into the other slot: the one a host-to-device copy would start from.
    let mut target = pool.acquire().unwrap();
    if target.index() == source_index {
        let other = pool.acquire().unwrap();
        drop(target);
        target = other;
    }
    target.as_mut_slice().fill(0);
    let (read, target) = store.read(extent, target).wait();
    read.unwrap();
    assert!(
        target
            .as_slice()
            .iter()
            .enumerate()
            .all(|(i, &b)| b == (i % 253) as u8)
    );
    let stats = store.io_stats();
    match store.backend() {
        BackendKind::Uring => {
            assert!(stats.fixed_chunks > 0, "no chunk used the registered slots");
            assert_eq!(stats.plain_chunks, 0, "a chunk missed the registered slots");
            println!(
                "io_uring: {} fixed chunks, {} plain (direct I/O: {})",
                stats.fixed_chunks,
                stats.plain_chunks,
                store.direct_io()
            );
        }
        other => println!(
            "io_uring is not available here ({other:?} backend): fixed buffers not checked"
        ),
    }
    // The pool unregisters itself before unmapping; the store lives on and still works.
    drop((target, pool));
    let after = store.allocate("after", 4096).unwrap();
    let plain = strata_engine::storage::AlignedBuf::from_slice(&[7u8; 4096]);
    store.write(after, plain).wait().0.unwrap();
}
