//! How the pinned pool locks its memory: by mlock where allowed, and, where mlock is
//! refused, unlocked memory that still works, with one warning per process.
//!
//! A file of its own, so that it runs in its own process: the warning is logged once per
//! process, and a test that counts it must not share the process with other pools whose
//! mlock may have been refused first.

use std::sync::atomic::Ordering;
use std::time::Duration;

use strata_engine::memory::{HostLocking, MemlockLimit, PinnedPool, PinnedPoolConfig, Pinning};

fn pool(name: &str, slot_bytes: usize, slot_count: usize, timeout: Duration) -> PinnedPool {
    PinnedPool::new(
        PinnedPoolConfig {
            name: name.into(),
            budget_bytes: slot_bytes * slot_count,
            slot_bytes,
            acquire_timeout: timeout,
        },
        &Pinning::Mlock,
    )
    .expect("pool")
}

/// Whether this thread holds CAP_IPC_LOCK, which lets mlock ignore RLIMIT_MEMLOCK.
fn has_cap_ipc_lock() -> bool {
    MemlockLimit::current().expect("getrlimit").cap_ipc_lock
}

const CAP_IPC_LOCK: u32 = 14;

#[test]
fn mlock_locks_the_pool_when_allowed() {
    let pool = pool("locked", 1 << 20, 1, Duration::ZERO);
    match pool.locking() {
        HostLocking::Mlocked => {}
        other if has_cap_ipc_lock() => {
            panic!("with CAP_IPC_LOCK mlock must succeed, got {other}")
        }
        other => println!("no CAP_IPC_LOCK here; the pool is {other}"),
    }
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Drops CAP_IPC_LOCK from the calling thread's effective set (capabilities are per
/// thread in Linux, so the rest of the test process keeps it).
fn drop_cap_ipc_lock_in_this_thread() -> Result<(), std::io::Error> {
    let mut header = CapHeader {
        version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget writes two CapData into `data`, as version 3 defines.
    if unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    data[0].effective &= !(1 << CAP_IPC_LOCK);
    // SAFETY: capset reads the header and two CapData; pid 0 is the calling thread.
    if unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Counts warnings about pinned pools logged by this test process.
struct WarningCounter(std::sync::atomic::AtomicUsize);

impl WarningCounter {
    fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

impl log::Log for WarningCounter {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }
    fn log(&self, record: &log::Record) {
        if record.level() == log::Level::Warn && record.args().to_string().contains("pinned pool") {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    fn flush(&self) {}
}

static WARNINGS: WarningCounter = WarningCounter(std::sync::atomic::AtomicUsize::new(0));

#[test]
fn a_refused_mlock_gives_unlocked_memory_that_still_works() {
    log::set_logger(&WARNINGS).expect("the only logger in this test binary");
    log::set_max_level(log::LevelFilter::Debug);
    let Some(limit_bytes) = MemlockLimit::current().expect("getrlimit").soft_bytes else {
        println!("skipping: RLIMIT_MEMLOCK is unlimited here, so mlock cannot be refused");
        return;
    };
    // Each pool maps (and, unlocked, touches) a little more than the limit, so a large
    // limit would make this test touch a lot of memory: skip it there.
    let limit_bytes = limit_bytes as usize;
    if limit_bytes > 1 << 30 {
        println!("skipping: RLIMIT_MEMLOCK is {limit_bytes} bytes, too large to exceed cheaply");
        return;
    }
    // Two slots of just over half the limit: mlock must fail without CAP_IPC_LOCK.
    let slot_bytes = limit_bytes / 2 + 4096;
    let outcome = std::thread::spawn(move || {
        if let Err(e) = drop_cap_ipc_lock_in_this_thread() {
            return Err(format!("could not drop CAP_IPC_LOCK: {e}"));
        }
        assert!(!has_cap_ipc_lock());
        let pool = pool("unlocked", slot_bytes, 2, Duration::ZERO);
        let locking = pool.locking().clone();
        // A second refused pool must not warn again.
        let second = self::pool("unlocked-too", slot_bytes, 2, Duration::ZERO);
        assert_eq!(second.locking(), &locking);
        let mut a = pool.acquire().unwrap();
        let mut b = pool.acquire().unwrap();
        a.as_mut_slice().fill(0xA5);
        b.as_mut_slice().fill(0x5A);
        assert!(a.as_slice().iter().all(|&x| x == 0xA5));
        assert!(b.as_slice().iter().all(|&x| x == 0x5A));
        Ok(locking)
    })
    .join()
    .unwrap();
    match outcome {
        Ok(HostLocking::Unlocked { reason }) => {
            assert_eq!(WARNINGS.count(), 1, "one warning for all refused pools");
            assert!(reason.contains("RLIMIT_MEMLOCK"), "{reason}");
            assert!(reason.contains("ulimit -l"), "{reason}");
            println!("refused mlock handled: {reason}");
        }
        Ok(other) => panic!("mlock over the limit without CAP_IPC_LOCK gave {other}"),
        Err(skip) => println!("skipping: {skip}"),
    }
}
