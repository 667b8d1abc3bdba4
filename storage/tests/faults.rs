//! Faults injected below the store reach the caller as errors, and only those.
//!
//! The fault-injecting backend logs every fault it causes. For each extent, a transfer
//! must fail exactly when a fault that must reach the caller (EIO, ENOSPC, end of file,
//! a flipped bit) hit its byte range, and must succeed with the right bytes when only
//! absorbable faults (short transfers, EINTR, delays) did.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{pattern, test_dir};
use strata_storage::{
    AlignedBuf, BackendKind, ExtentId, FaultKind, FaultPlan, InjectedFault, OpKind, StorageError,
    StoreConfig, TensorStore,
};

const EXTENTS: usize = 48;

fn extent_len(i: usize) -> usize {
    // 100 KiB to about 500 KiB, odd sizes, several 16 KiB chunks each.
    100_000 + i * 8_377
}

/// Which extents had a must-reach fault of `op` in their byte range.
fn hit_extents(
    faults: &[InjectedFault],
    op: OpKind,
    ranges: &[(u64, u64)],
) -> HashMap<usize, Vec<FaultKind>> {
    let mut hits: HashMap<usize, Vec<FaultKind>> = HashMap::new();
    for f in faults
        .iter()
        .filter(|f| f.op == op && f.kind.must_reach_caller())
    {
        let i = ranges
            .iter()
            .position(|&(start, len)| f.offset_bytes >= start && f.offset_bytes < start + len)
            .expect("every fault lies in some extent");
        hits.entry(i).or_default().push(f.kind);
    }
    hits
}

#[test]
fn every_injected_fault_reaches_the_caller_and_nothing_else_fails() {
    let dir = test_dir();
    let plan = FaultPlan {
        eio_per_million: 15_000,
        enospc_per_million: 15_000,
        eof_per_million: 15_000,
        bitflip_per_million: 15_000,
        short_per_million: 150_000,
        eintr_per_million: 60_000,
        delay_per_million: 30_000,
        max_delay: Duration::from_millis(2),
        ..FaultPlan::seeded(20261122)
    };
    let config = StoreConfig {
        block_bytes: 16 << 10,
        queue_depth: 6,
        faults: Some(plan.clone()),
        ..StoreConfig::new(dir.path(), 32 << 20)
    };
    let store = TensorStore::create(config).unwrap();
    assert_eq!(store.backend(), BackendKind::Faulty);

    let ids: Vec<ExtentId> = (0..EXTENTS)
        .map(|i| {
            store
                .allocate(&format!("e{i}"), extent_len(i) as u64)
                .unwrap()
        })
        .collect();
    let ranges: Vec<(u64, u64)> = ids
        .iter()
        .map(|&id| {
            let pieces = store.locate(id).unwrap();
            assert_eq!(pieces.len(), 1, "one file: one piece per extent");
            (pieces[0].1, pieces[0].2)
        })
        .collect();

    // Write every extent at once, then check each result against the fault log.
    let pending: Vec<_> = (0..EXTENTS)
        .map(|i| store.write(ids[i], pattern(extent_len(i), i as u64)))
        .collect();
    let write_results: Vec<Result<(), StorageError>> =
        pending.into_iter().map(|p| p.wait().0).collect();
    let write_faults = hit_extents(&plan.injected(), OpKind::Write, &ranges);
    for (i, result) in write_results.iter().enumerate() {
        match (result, write_faults.get(&i)) {
            (Ok(()), None) => {}
            (Err(StorageError::Io { errno, .. }), Some(kinds)) => {
                assert!(
                    ["EIO", "ENOSPC"].contains(&errno.name().as_ref()),
                    "extent {i}: {errno} for {kinds:?}"
                );
            }
            (result, kinds) => panic!("extent {i}: write gave {result:?} with faults {kinds:?}"),
        }
    }
    assert!(!write_faults.is_empty(), "the plan caused write faults");
    assert!(write_faults.len() < EXTENTS, "and some writes got through");

    // Read every extent back: unwritten ones are refused; the others fail exactly where a
    // read fault hit them and otherwise return the bytes written.
    let logged_before_reads = plan.injected().len();
    let pending: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(i, &id)| store.read(id, AlignedBuf::zeroed(extent_len(i))))
        .collect();
    let read_log: Vec<InjectedFault> = {
        let results: Vec<_> = pending.into_iter().map(|p| p.wait()).collect();
        let log = plan.injected()[logged_before_reads..].to_vec();
        let read_faults = hit_extents(&log, OpKind::Read, &ranges);
        for (i, (result, buf)) in results.into_iter().enumerate() {
            if write_results[i].is_err() {
                assert!(
                    matches!(result, Err(StorageError::ExtentUnreadable { .. })),
                    "extent {i}: a failed write leaves it unreadable, got {result:?}"
                );
                continue;
            }
            match (&result, read_faults.get(&i)) {
                (Ok(()), None) => assert_eq!(
                    buf.as_slice(),
                    pattern(extent_len(i), i as u64).as_slice(),
                    "extent {i} reads back what was written"
                ),
                (Err(error), Some(kinds)) => {
                    let expected = match error {
                        StorageError::Io { .. } => kinds.contains(&FaultKind::Eio),
                        StorageError::UnexpectedEof { .. } => kinds.contains(&FaultKind::Eof),
                        StorageError::Checksum { .. } => kinds.contains(&FaultKind::BitFlip),
                        _ => false,
                    };
                    assert!(
                        expected,
                        "extent {i}: {error} does not match faults {kinds:?}"
                    );
                }
                (result, kinds) => {
                    panic!("extent {i}: read gave {result:?} with faults {kinds:?}")
                }
            }
        }
        log
    };
    assert!(
        read_log.iter().any(|f| f.kind == FaultKind::BitFlip),
        "the plan flipped a bit, which only the checksum can catch"
    );

    // The absorbable faults happened, and were absorbed.
    let all = plan.injected();
    for kind in [FaultKind::Short, FaultKind::Eintr, FaultKind::Delay] {
        assert!(
            all.iter().any(|f| f.kind == kind),
            "no {kind:?} was injected"
        );
    }
    let stats = store.io_stats();
    assert!(stats.short_transfers > 0 && stats.retries > 0, "{stats:?}");
}

#[test]
fn a_failed_write_can_be_retried() {
    let dir = test_dir();
    let plan = FaultPlan {
        eio_per_million: 1_000_000,
        ..FaultPlan::seeded(1)
    };
    let config = StoreConfig {
        faults: Some(plan),
        ..StoreConfig::new(dir.path(), 1 << 20)
    };
    let store = TensorStore::create(config).unwrap();
    let id = store.allocate("a", 4096).unwrap();
    let (result, buf) = store.write(id, pattern(4096, 1)).wait();
    let error = result.unwrap_err();
    let text = error.to_string();
    assert!(text.contains("EIO") && text.contains("offset 0"), "{text}");
    assert!(!store.info(id).unwrap().readable);
    // The buffer came back intact and the extent is free to be written again.
    assert_eq!(buf.as_slice(), pattern(4096, 1).as_slice());
    assert!(matches!(
        store.write(id, buf).wait().0,
        Err(StorageError::Io { .. })
    ));
}
