//! The tensor store end to end: round trips on every backend, striping, registered
//! buffers, persistence, and the errors a user can cause.

mod common;

use common::{backends, pattern, small_config, test_dir};
use strata_storage::{
    AlignedBuf, BackendChoice, BackendKind, IoBuf, IoRegion, StorageError, StoreConfig, TensorStore,
};

const ODD_SIZES: [usize; 8] = [0, 1, 7, 4095, 4096, 4097, (1 << 20) + 123, 5 << 20];

#[test]
fn round_trip_of_odd_sizes_on_every_backend() {
    for backend in backends() {
        let dir = test_dir();
        let store = TensorStore::create(small_config(dir.path(), 16 << 20, backend)).unwrap();
        println!(
            "backend {:?}, direct I/O {}",
            store.backend(),
            store.direct_io()
        );
        let mut ids = Vec::new();
        for (i, &len) in ODD_SIZES.iter().enumerate() {
            let id = store.allocate(&format!("t{i}"), len as u64).unwrap();
            let (result, _) = store.write(id, pattern(len, i as u64)).wait();
            result.unwrap();
            ids.push(id);
        }
        for (i, &len) in ODD_SIZES.iter().enumerate() {
            let (result, buf) = store.read(ids[i], AlignedBuf::zeroed(len)).wait();
            result.unwrap();
            assert_eq!(
                buf.as_slice(),
                pattern(len, i as u64).as_slice(),
                "extent of {len} bytes on {backend:?}"
            );
        }
        let stats = store.io_stats();
        assert!(stats.written_bytes >= ODD_SIZES.iter().sum::<usize>() as u64);
        assert!(!stats.read_latency_ns.is_empty());
    }
}

#[test]
fn striping_spreads_extents_over_every_file() {
    for backend in backends() {
        let dirs = [test_dir(), test_dir(), test_dir()];
        let config = StoreConfig {
            dirs: dirs.iter().map(|d| d.path().to_path_buf()).collect(),
            stripe_bytes: 64 << 10,
            ..small_config(dirs[0].path(), 8 << 20, backend)
        };
        let store = TensorStore::create(config).unwrap();
        assert_eq!(store.paths().len(), 3);
        let len: usize = (1 << 20) + 4096 * 3 + 5;
        let id = store.allocate("striped", len as u64).unwrap();
        let pieces = store.locate(id).unwrap();
        assert_eq!(pieces.len(), len.div_ceil(64 << 10));
        for (i, (path, offset, piece_len)) in pieces.iter().enumerate() {
            assert_eq!(path, &store.paths()[i % 3], "stripe {i} goes round-robin");
            assert_eq!(*offset, (i / 3) as u64 * (64 << 10));
            assert!(*piece_len <= 64 << 10);
        }
        let (result, _) = store.write(id, pattern(len, 99)).wait();
        result.unwrap();
        let (result, buf) = store.read(id, AlignedBuf::zeroed(len)).wait();
        result.unwrap();
        assert_eq!(buf.as_slice(), pattern(len, 99).as_slice());
    }
}

#[test]
fn registered_buffers_are_used_by_io_uring() {
    if !backends().contains(&BackendChoice::Uring) {
        return;
    }
    let dir = test_dir();
    let store =
        TensorStore::create(small_config(dir.path(), 4 << 20, BackendChoice::Uring)).unwrap();
    assert_eq!(store.backend(), BackendKind::Uring);
    let mut buf = pattern(1 << 20, 5);
    let region = IoRegion {
        ptr: buf.as_mut_ptr(),
        len_bytes: buf.capacity_bytes(),
    };
    // SAFETY: `buf`'s allocation stays alive (it is only moved) until it is unregistered
    // below, before it is dropped.
    unsafe { store.register_region(region) }.unwrap();
    let id = store.allocate("fixed", 1 << 20).unwrap();
    let (result, buf) = store.write(id, buf).wait();
    result.unwrap();
    let stats = store.io_stats();
    assert_eq!(
        stats.fixed_chunks, 16,
        "every 64 KiB chunk of the registered buffer"
    );
    assert_eq!(stats.plain_chunks, 0);
    // A buffer outside the region goes through plain reads, and the data is the same.
    let (result, copy) = store.read(id, AlignedBuf::zeroed(1 << 20)).wait();
    result.unwrap();
    assert_eq!(copy.as_slice(), buf.as_slice());
    assert_eq!(store.io_stats().plain_chunks, 16);
    store.unregister_region(region).unwrap();
    drop(buf);
}

#[test]
fn buffer_comes_back_on_every_error() {
    let dir = test_dir();
    let store =
        TensorStore::create(small_config(dir.path(), 1 << 20, BackendChoice::Threads)).unwrap();
    let id = store.allocate("a", 10_000).unwrap();

    // Too small: the extent needs 12288 bytes (10000 rounded up to 4096).
    let small = AlignedBuf::zeroed(4096);
    let small_ptr = small.as_ptr();
    let (result, back) = store.write(id, small).wait();
    assert!(
        matches!(result, Err(StorageError::BadBuffer { .. })),
        "{result:?}"
    );
    assert_eq!(back.as_ptr(), small_ptr, "the same buffer comes back");

    // Never written.
    let (result, _) = store.read(id, AlignedBuf::zeroed(10_000)).wait();
    let text = result.unwrap_err().to_string();
    assert!(text.contains("never written"), "{text}");

    // Unknown name, duplicate name, full store.
    assert!(store.id("missing").is_none());
    assert!(matches!(
        store.allocate("a", 1),
        Err(StorageError::ExtentExists(_))
    ));
    let full = store.allocate("b", 2 << 20).unwrap_err();
    assert!(full.to_string().contains("no room"), "{full}");

    // A freed extent's id is stale; its space is reusable.
    store.free(id).unwrap();
    let (result, _) = store.read(id, AlignedBuf::zeroed(12_288)).wait();
    assert!(
        matches!(result, Err(StorageError::NoSuchExtent(_))),
        "{result:?}"
    );
    assert_eq!(store.free_bytes(), 1 << 20);
    store.allocate("c", 1 << 20).unwrap();
}

#[test]
fn misaligned_buffer_is_refused_for_direct_io() {
    struct Offset(AlignedBuf);
    // SAFETY: points 512 bytes into an owned AlignedBuf, inside its allocation.
    unsafe impl IoBuf for Offset {
        fn as_ptr(&self) -> *const u8 {
            // SAFETY: 512 < capacity.
            unsafe { self.0.as_ptr().add(512) }
        }
        fn as_mut_ptr(&mut self) -> *mut u8 {
            // SAFETY: 512 < capacity.
            unsafe { self.0.as_mut_ptr().add(512) }
        }
        fn capacity_bytes(&self) -> usize {
            self.0.capacity_bytes() - 512
        }
    }
    let dir = test_dir();
    let store =
        TensorStore::create(small_config(dir.path(), 1 << 20, BackendChoice::Threads)).unwrap();
    if !store.direct_io() {
        println!("skipping: this filesystem has no O_DIRECT");
        return;
    }
    let id = store.allocate("a", 4096).unwrap();
    let (result, _) = store.write(id, Offset(AlignedBuf::zeroed(16384))).wait();
    let text = result.unwrap_err().to_string();
    assert!(text.contains("not aligned"), "{text}");
}

#[test]
fn conflicting_transfers_of_one_extent_are_refused() {
    let dir = test_dir();
    let store =
        TensorStore::create(small_config(dir.path(), 4 << 20, BackendChoice::Threads)).unwrap();
    let id = store.allocate("a", 1 << 20).unwrap();
    let first = store.write(id, pattern(1 << 20, 1));
    let (second, _) = store.write(id, pattern(1 << 20, 2)).wait();
    assert!(
        matches!(second, Err(StorageError::ExtentBusy { .. })),
        "{second:?}"
    );
    let (read, _) = store.read(id, AlignedBuf::zeroed(1 << 20)).wait();
    assert!(
        matches!(read, Err(StorageError::ExtentBusy { .. })),
        "{read:?}"
    );
    assert!(matches!(
        store.free(id),
        Err(StorageError::ExtentBusy { .. })
    ));
    first.wait().0.unwrap();
    // Two reads of one extent may overlap.
    let a = store.read(id, AlignedBuf::zeroed(1 << 20));
    let b = store.read(id, AlignedBuf::zeroed(1 << 20));
    let (ra, ba) = a.wait();
    let (rb, bb) = b.wait();
    ra.unwrap();
    rb.unwrap();
    assert_eq!(ba.as_slice(), pattern(1 << 20, 1).as_slice());
    assert_eq!(bb.as_slice(), ba.as_slice());
}

#[test]
fn dropping_a_pending_transfer_waits_for_it() {
    for backend in backends() {
        let dir = test_dir();
        let store = TensorStore::create(small_config(dir.path(), 4 << 20, backend)).unwrap();
        let id = store.allocate("a", 3 << 20).unwrap();
        drop(store.write(id, pattern(3 << 20, 7)));
        assert!(
            store.info(id).unwrap().readable,
            "the write finished before drop returned"
        );
        let (result, buf) = store.read(id, AlignedBuf::zeroed(3 << 20)).wait();
        result.unwrap();
        assert_eq!(buf.as_slice(), pattern(3 << 20, 7).as_slice());
    }
}

#[test]
fn corrupted_extent_is_caught_by_its_checksum() {
    use std::os::unix::fs::FileExt;
    for backend in backends() {
        let dir = test_dir();
        // Persisted, so that its file has a name to corrupt it through.
        let config = StoreConfig {
            name: Some("corrupt".into()),
            persist: true,
            ..small_config(dir.path(), 4 << 20, backend)
        };
        let store = TensorStore::create(config).unwrap();
        let id = store.allocate("weights", 100_000).unwrap();
        store.write(id, pattern(100_000, 3)).wait().0.unwrap();
        let (path, offset, _) = store.locate(id).unwrap()[0].clone();
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.write_at(&[0xff], offset + 54_321).unwrap();
        file.sync_all().unwrap();
        let (result, _) = store.read(id, AlignedBuf::zeroed(100_000)).wait();
        match result {
            Err(StorageError::Checksum { extent, .. }) => assert_eq!(extent, "weights"),
            other => panic!("expected a checksum error on {backend:?}, got {other:?}"),
        }
    }
}

#[test]
fn checksums_can_be_turned_off() {
    let dir = test_dir();
    let config = StoreConfig {
        checksums: false,
        ..small_config(dir.path(), 1 << 20, BackendChoice::Threads)
    };
    let store = TensorStore::create(config).unwrap();
    assert!(!store.checksums());
    let id = store.allocate("a", 8192).unwrap();
    store.write(id, pattern(8192, 1)).wait().0.unwrap();
    let (result, buf) = store.read(id, AlignedBuf::zeroed(8192)).wait();
    result.unwrap();
    assert_eq!(buf.as_slice(), pattern(8192, 1).as_slice());
}

#[test]
fn a_store_that_is_not_persisted_leaves_no_file_even_while_open() {
    for backend in backends() {
        let dir = test_dir();
        let store = TensorStore::create(small_config(dir.path(), 1 << 20, backend)).unwrap();
        // The files have no name from the start, so a killed process leaves nothing; the
        // store still works through its open descriptors.
        assert!(!store.paths()[0].exists());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        let id = store.allocate("x", 8192).unwrap();
        store.write(id, pattern(8192, 3)).wait().0.unwrap();
        let clone = store.clone();
        drop(store);
        let (result, buf) = clone.read(id, AlignedBuf::zeroed(8192)).wait();
        result.unwrap();
        assert_eq!(buf.as_slice(), pattern(8192, 3).as_slice());
    }
}

#[test]
fn persisted_store_reopens_with_its_extents() {
    for backend in backends() {
        let dir = test_dir();
        let config = StoreConfig {
            name: Some("state".into()),
            persist: true,
            ..small_config(dir.path(), 8 << 20, backend)
        };
        let (manifest, paths) = {
            let store = TensorStore::create(config.clone()).unwrap();
            let a = store.allocate("a", 300_000).unwrap();
            let b = store.allocate("b", 5).unwrap();
            store.allocate("never", 4096).unwrap();
            store.write(a, pattern(300_000, 11)).wait().0.unwrap();
            store.write(b, pattern(5, 12)).wait().0.unwrap();
            (store.save_manifest().unwrap(), store.paths())
        };
        assert!(paths[0].exists(), "a persisted store keeps its files");
        let store = TensorStore::open(&manifest, config.clone()).unwrap();
        for (name, len, seed) in [("a", 300_000, 11), ("b", 5, 12)] {
            let id = store.id(name).unwrap();
            let (result, buf) = store.read(id, AlignedBuf::zeroed(len)).wait();
            result.unwrap();
            assert_eq!(buf.as_slice(), pattern(len, seed).as_slice());
        }
        let never = store.id("never").unwrap();
        assert!(
            store
                .read(never, AlignedBuf::zeroed(4096))
                .wait()
                .0
                .is_err()
        );
        // The free space is what the three extents leave.
        assert_eq!(store.free_bytes(), (8 << 20) - 303_104 - 4096 - 4096);
        drop(store);
        for p in paths {
            std::fs::remove_file(p).unwrap();
        }
    }
}

#[test]
fn bad_manifest_and_bad_config_are_clear_errors() {
    let dir = test_dir();
    let manifest = dir.path().join("m.json");
    std::fs::write(&manifest, "{\"format\": \"other\"}").unwrap();
    let error = TensorStore::open(&manifest, StoreConfig::new(dir.path(), 1)).unwrap_err();
    assert!(error.to_string().contains("m.json"), "{error}");

    let config = StoreConfig {
        block_bytes: 1000,
        ..StoreConfig::new(dir.path(), 1 << 20)
    };
    let error = TensorStore::create(config).unwrap_err();
    assert!(error.to_string().contains("block size 1000"), "{error}");

    let error =
        TensorStore::create(StoreConfig::new(dir.path().join("missing"), 4096)).unwrap_err();
    assert!(error.to_string().contains("missing"), "{error}");

    let error = TensorStore::create(StoreConfig::new(dir.path(), u64::MAX / 4)).unwrap_err();
    assert!(
        matches!(error, StorageError::InsufficientSpace { .. }),
        "{error}"
    );
}

#[test]
fn a_head_is_read_and_verified_alone() {
    use std::os::unix::fs::FileExt;
    for backend in backends() {
        let dir = test_dir();
        let config = StoreConfig {
            name: Some("head".into()),
            persist: true,
            ..small_config(dir.path(), 4 << 20, backend)
        };
        let store = TensorStore::create(config).unwrap();
        // A head that ends inside a 4096-byte granule, as a block's master parameters do.
        let (len, head) = (300_000usize, 100_003u64);
        let id = store.allocate("state", len as u64).unwrap();
        let data = pattern(len, 5);
        store.write_with_head(id, data, head).wait().0.unwrap();
        let (result, buf) = store
            .read_head(id, AlignedBuf::zeroed(head as usize), head)
            .wait();
        result.unwrap();
        assert_eq!(
            &buf.as_slice()[..head as usize],
            &pattern(len, 5).as_slice()[..head as usize],
            "{backend:?}"
        );
        // The whole extent still reads and verifies.
        store.read(id, AlignedBuf::zeroed(len)).wait().0.unwrap();
        // Another head length was not checksummed: refused, not read unverified.
        let (result, _) = store.read_head(id, AlignedBuf::zeroed(4096), 4096).wait();
        assert!(
            matches!(result, Err(StorageError::ExtentUnreadable { .. })),
            "{result:?}"
        );
        // A byte flipped inside the head is caught by the head's own checksum, one past
        // it (in the granule the head read also moves) is not the head's business.
        let (path, offset, segment) = store.locate(id).unwrap()[0].clone();
        assert!(segment > head, "the test flips bytes of the first segment");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let original = {
            let mut b = [0u8; 1];
            file.read_at(&mut b, offset + head).unwrap();
            b[0]
        };
        file.write_at(&[!original], offset + head).unwrap();
        file.sync_all().unwrap();
        let (result, _) = store
            .read_head(id, AlignedBuf::zeroed(head as usize), head)
            .wait();
        result.unwrap();
        file.write_at(&[0xff ^ pattern(len, 5).as_slice()[777]], offset + 777)
            .unwrap();
        file.sync_all().unwrap();
        let (result, _) = store
            .read_head(id, AlignedBuf::zeroed(head as usize), head)
            .wait();
        assert!(
            matches!(result, Err(StorageError::Checksum { .. })),
            "{backend:?}: {result:?}"
        );
        // A plain write forgets the head.
        store.write(id, pattern(len, 6)).wait().0.unwrap();
        let (result, _) = store
            .read_head(id, AlignedBuf::zeroed(head as usize), head)
            .wait();
        assert!(result.is_err(), "{backend:?}");
    }
}
