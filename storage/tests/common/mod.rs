//! Helpers shared by the storage tests.

#![allow(dead_code)]

use std::path::PathBuf;

use strata_storage::{AlignedBuf, BackendChoice, StoreConfig, probe_uring};

/// A fresh folder on a real filesystem (O_DIRECT needs one): under `STRATA_TEST_DIR` if
/// set, else under cargo's per-target temporary folder.
pub fn test_dir() -> tempfile::TempDir {
    let base = std::env::var_os("STRATA_TEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    std::fs::create_dir_all(&base).unwrap();
    tempfile::tempdir_in(base).unwrap()
}

/// The backends to test here: threads always, io_uring where it starts (with the
/// reason printed where it does not).
pub fn backends() -> Vec<BackendChoice> {
    let mut list = vec![BackendChoice::Threads];
    match probe_uring() {
        Ok(()) => list.push(BackendChoice::Uring),
        Err(reason) => println!("skipping io_uring: {reason}"),
    }
    list
}

/// A config for small tests: 64 KiB blocks so that even small extents split into
/// several chunks, queue depth 8.
pub fn small_config(
    dir: &std::path::Path,
    capacity_bytes: u64,
    backend: BackendChoice,
) -> StoreConfig {
    StoreConfig {
        block_bytes: 64 << 10,
        queue_depth: 8,
        backend,
        ..StoreConfig::new(dir, capacity_bytes)
    }
}

/// Deterministic bytes that differ between seeds and positions.
pub fn pattern(len: usize, seed: u64) -> AlignedBuf {
    let mut buf = AlignedBuf::zeroed(len);
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in buf.as_mut_slice().chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let bytes = x.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
    buf
}
