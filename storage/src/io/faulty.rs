//! System calls that fail on purpose, for tests: the threaded backend runs over them.
//!
//! Each call draws from a hash of the plan's seed and the call's file, offset, length and
//! direction, so the same request meets the same fault whatever the thread interleaving.
//! Faults that the backend must absorb (short transfers, EINTR, delays) and faults that
//! must reach the caller (EIO, ENOSPC, end of file, silent bit flips that only the
//! checksum can catch) are both injected, and every one is logged in [`FaultPlan::log`]
//! so a test can check that each reached the caller.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::kind::{BackendKind, OpKind};
use super::threads::{Posix, Syscalls};
use crate::buffer::DIRECT_IO_ALIGN;

/// The kinds of fault the injector can cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// The call fails with EIO.
    Eio,
    /// A write fails with ENOSPC.
    Enospc,
    /// A read returns 0 bytes, as at the end of the file.
    Eof,
    /// The call moves only part of what was asked (the backend must continue it).
    Short,
    /// The call fails with EINTR (the backend must resubmit it).
    Eintr,
    /// The call sleeps before it runs.
    Delay,
    /// A read succeeds but one bit of its data is flipped (only a checksum catches it).
    BitFlip,
}

impl FaultKind {
    /// Whether the caller must see this fault as an error (the others are absorbed).
    pub fn must_reach_caller(self) -> bool {
        matches!(
            self,
            FaultKind::Eio | FaultKind::Enospc | FaultKind::Eof | FaultKind::BitFlip
        )
    }
}

/// One fault the injector caused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InjectedFault {
    /// What went wrong.
    pub kind: FaultKind,
    /// In a read or a write.
    pub op: OpKind,
    /// The file descriptor.
    pub fd: RawFd,
    /// Where the call started.
    pub offset_bytes: u64,
    /// How many bytes the call asked for.
    pub len_bytes: usize,
}

/// What the fault-injecting backend does wrong, and how often (per million calls).
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    /// Seeds every draw.
    pub seed: u64,
    /// Calls failing with EIO.
    pub eio_per_million: u32,
    /// Writes failing with ENOSPC.
    pub enospc_per_million: u32,
    /// Reads returning 0 bytes.
    pub eof_per_million: u32,
    /// Calls moving only part of their bytes (at least 8 KiB calls; continued).
    pub short_per_million: u32,
    /// Calls failing with EINTR (resubmitted).
    pub eintr_per_million: u32,
    /// Reads whose data gets one bit flipped.
    pub bitflip_per_million: u32,
    /// Calls delayed by up to `max_delay`.
    pub delay_per_million: u32,
    /// The longest injected delay.
    pub max_delay: Duration,
    /// Every fault injected so far, in the order they happened.
    pub log: Arc<Mutex<Vec<InjectedFault>>>,
    /// While set, no fault is injected (a test sets up data, then lets faults in).
    pub paused: Arc<AtomicBool>,
}

impl FaultPlan {
    /// A plan with this seed and no faults; set the rates you want.
    pub fn seeded(seed: u64) -> Self {
        Self {
            seed,
            ..Self::default()
        }
    }

    /// Stops (true) or resumes (false) injecting faults, for every store sharing this plan.
    pub fn pause(&self, paused: bool) {
        self.paused.store(paused, Ordering::SeqCst);
    }

    /// The faults injected so far.
    pub fn injected(&self) -> Vec<InjectedFault> {
        self.log.lock().expect("fault log poisoned").clone()
    }
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The system calls of the fault-injecting backend.
pub(crate) struct FaultySyscalls {
    plan: FaultPlan,
    /// Mixed into draws for transient faults only, so that a resubmitted call can pass.
    attempts: AtomicU64,
}

impl FaultySyscalls {
    pub fn new(plan: FaultPlan) -> Self {
        Self {
            plan,
            attempts: AtomicU64::new(0),
        }
    }

    fn draw(&self, salt: u64, op: OpKind, fd: RawFd, offset: u64, len: usize) -> u64 {
        let op_bit = match op {
            OpKind::Read => 0x5244,
            OpKind::Write => 0x5752,
        };
        let mut h = splitmix64(self.plan.seed ^ salt);
        for word in [op_bit, fd as u64, offset, len as u64] {
            h = splitmix64(h ^ word);
        }
        h
    }

    fn log(&self, kind: FaultKind, op: OpKind, fd: RawFd, offset: u64, len: usize) {
        self.plan
            .log
            .lock()
            .expect("fault log poisoned")
            .push(InjectedFault {
                kind,
                op,
                fd,
                offset_bytes: offset,
                len_bytes: len,
            });
    }

    /// Decides this call's fault (at most one besides a delay). `None` means run it.
    fn decide(&self, op: OpKind, fd: RawFd, offset: u64, len: usize) -> Option<FaultKind> {
        let p = &self.plan;
        if p.paused.load(Ordering::SeqCst) {
            return None;
        }
        let delay_draw = self.draw(0xde1a, op, fd, offset, len);
        if (delay_draw % 1_000_000) < u64::from(p.delay_per_million) && !p.max_delay.is_zero() {
            let nanos = (delay_draw >> 20) % (p.max_delay.as_nanos() as u64).max(1);
            self.log(FaultKind::Delay, op, fd, offset, len);
            std::thread::sleep(Duration::from_nanos(nanos));
        }
        let transient = self.draw(
            0x7ea5
                ^ self
                    .attempts
                    .fetch_add(1, Ordering::Relaxed)
                    .rotate_left(17),
            op,
            fd,
            offset,
            len,
        ) % 1_000_000;
        if transient < u64::from(p.eintr_per_million) {
            return Some(FaultKind::Eintr);
        }
        let r = self.draw(0xfa17, op, fd, offset, len) % 1_000_000;
        let mut threshold = 0u64;
        let candidates = [
            (FaultKind::Eio, p.eio_per_million, true),
            (FaultKind::Enospc, p.enospc_per_million, op == OpKind::Write),
            (FaultKind::Eof, p.eof_per_million, op == OpKind::Read),
            (
                FaultKind::BitFlip,
                p.bitflip_per_million,
                op == OpKind::Read,
            ),
            (
                FaultKind::Short,
                p.short_per_million,
                len >= 2 * DIRECT_IO_ALIGN,
            ),
        ];
        for (kind, rate, applies) in candidates {
            if !applies {
                continue;
            }
            threshold += u64::from(rate);
            if r < threshold {
                return Some(kind);
            }
        }
        None
    }

    /// A shorter length for a short transfer: whole 4 KiB blocks (O_DIRECT needs them),
    /// at least one, fewer than `len` holds.
    fn short_len(&self, op: OpKind, fd: RawFd, offset: u64, len: usize) -> usize {
        let blocks = len / DIRECT_IO_ALIGN;
        let draw = self.draw(0x5407, op, fd, offset, len);
        (1 + (draw as usize % (blocks - 1))) * DIRECT_IO_ALIGN
    }
}

impl Syscalls for FaultySyscalls {
    unsafe fn pread(&self, fd: RawFd, buf: *mut u8, len: usize, offset: u64) -> Result<usize, i32> {
        let op = OpKind::Read;
        let fault = self.decide(op, fd, offset, len);
        if let Some(kind) = fault {
            self.log(kind, op, fd, offset, len);
        }
        match fault {
            Some(FaultKind::Eio) => Err(libc::EIO),
            Some(FaultKind::Eintr) => Err(libc::EINTR),
            Some(FaultKind::Eof) => Ok(0),
            Some(FaultKind::Short) => {
                let short = self.short_len(op, fd, offset, len);
                // SAFETY: short < len; the caller's guarantee covers it.
                unsafe { Posix.pread(fd, buf, short, offset) }
            }
            Some(FaultKind::BitFlip) => {
                // SAFETY: the caller guarantees buf is valid for len bytes.
                let n = unsafe { Posix.pread(fd, buf, len, offset) }?;
                if n > 0 {
                    let bit = self.draw(0xb17, op, fd, offset, len) as usize % (n * 8);
                    // SAFETY: bit / 8 < n <= len, inside the buffer just read into.
                    unsafe { *buf.add(bit / 8) ^= 1 << (bit % 8) };
                }
                Ok(n)
            }
            // SAFETY: the caller's guarantee.
            _ => unsafe { Posix.pread(fd, buf, len, offset) },
        }
    }

    unsafe fn pwrite(
        &self,
        fd: RawFd,
        buf: *const u8,
        len: usize,
        offset: u64,
    ) -> Result<usize, i32> {
        let op = OpKind::Write;
        let fault = self.decide(op, fd, offset, len);
        if let Some(kind) = fault {
            self.log(kind, op, fd, offset, len);
        }
        match fault {
            Some(FaultKind::Eio) => Err(libc::EIO),
            Some(FaultKind::Enospc) => Err(libc::ENOSPC),
            Some(FaultKind::Eintr) => Err(libc::EINTR),
            Some(FaultKind::Short) => {
                let short = self.short_len(op, fd, offset, len);
                // SAFETY: short < len; the caller's guarantee covers it.
                unsafe { Posix.pwrite(fd, buf, short, offset) }
            }
            // SAFETY: the caller's guarantee.
            _ => unsafe { Posix.pwrite(fd, buf, len, offset) },
        }
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Faulty
    }
}
