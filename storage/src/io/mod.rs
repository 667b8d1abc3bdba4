//! I/O backends: how bytes move between memory and the swap files.
//!
//! A backend takes [`RawOp`]s (one contiguous transfer in one file), splits them into
//! block-size chunks, keeps at most `queue_depth` chunks in flight, continues short
//! transfers, resubmits EINTR/EAGAIN, and reports each op's end to its [`OpGroup`]. It
//! does not know about extents, checksums or buffer ownership: the tensor store above it
//! does.
//!
//! Backends: [`uring`] (one thread owning an io_uring ring, registered files and
//! buffers), [`threads`] (a pool of threads calling pread/pwrite, chosen automatically
//! when io_uring cannot start), and [`faulty`] (the threaded backend over system calls
//! that fail on purpose, for tests).

pub(crate) mod backend;
pub(crate) mod faulty;
pub(crate) mod kind;
pub(crate) mod threads;
pub(crate) mod uring;

use std::sync::OnceLock;

pub(crate) use backend::{Backend, FileTable, GroupPool, OpGroup, RawOp};
pub use backend::{IoCounters, IoStats};
pub use kind::{BackendKind, OpKind};

use crate::error::StorageError;

/// Which backend to use; `Auto` probes io_uring once and falls back to threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// io_uring when it works here, else threads (the reason is logged once).
    #[default]
    Auto,
    /// io_uring, or an error saying why it cannot start.
    Uring,
    /// The threaded pread/pwrite backend.
    Threads,
}

impl std::str::FromStr for BackendChoice {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "auto" => Ok(Self::Auto),
            "uring" | "io_uring" => Ok(Self::Uring),
            "threads" => Ok(Self::Threads),
            other => Err(format!(
                "unknown I/O backend '{other}': expected auto, uring or threads"
            )),
        }
    }
}

/// Probes io_uring once per process: ring setup, the opcodes strata uses, and a trial
/// buffer registration. `Err` says why io_uring cannot be used and what to do.
pub fn probe_uring() -> Result<(), String> {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    PROBE.get_or_init(uring::probe).clone()
}

/// Decides the backend for `choice` given the io_uring probe's answer; `Auto` falls back
/// to threads with the reason logged once per process.
pub(crate) fn resolve_backend(
    choice: BackendChoice,
    uring_probe: &Result<(), String>,
) -> Result<BackendKind, StorageError> {
    match (choice, uring_probe) {
        (BackendChoice::Threads, _) => Ok(BackendKind::Threads),
        (BackendChoice::Uring | BackendChoice::Auto, Ok(())) => Ok(BackendKind::Uring),
        (BackendChoice::Uring, Err(reason)) => Err(StorageError::UringUnavailable(format!(
            "{reason}; or use the threaded backend (--backend threads)"
        ))),
        (BackendChoice::Auto, Err(reason)) => {
            static LOGGED: OnceLock<()> = OnceLock::new();
            LOGGED.get_or_init(|| {
                log::warn!(
                    "io_uring unavailable ({reason}); using the threaded pread/pwrite backend"
                )
            });
            Ok(BackendKind::Threads)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_choice_parses() {
        assert_eq!("auto".parse(), Ok(BackendChoice::Auto));
        assert_eq!("uring".parse(), Ok(BackendChoice::Uring));
        assert_eq!("threads".parse(), Ok(BackendChoice::Threads));
        assert!("spdk".parse::<BackendChoice>().is_err());
    }

    #[test]
    fn resolution_falls_back_only_under_auto() {
        let broken: Result<(), String> = Err("EPERM".into());
        assert_eq!(
            resolve_backend(BackendChoice::Auto, &broken).unwrap(),
            BackendKind::Threads
        );
        assert_eq!(
            resolve_backend(BackendChoice::Threads, &Ok(())).unwrap(),
            BackendKind::Threads
        );
        assert_eq!(
            resolve_backend(BackendChoice::Auto, &Ok(())).unwrap(),
            BackendKind::Uring
        );
        let error = resolve_backend(BackendChoice::Uring, &broken).unwrap_err();
        assert!(error.to_string().contains("--backend threads"), "{error}");
    }

    #[test]
    fn group_keeps_first_error_and_counts_parts() {
        let group = OpGroup::new(2);
        group.add_parts(1);
        group.finish_part(Ok(()));
        group.finish_part(Err(StorageError::BackendGone));
        assert!(!group.is_done());
        group.finish_part(Err(StorageError::Config("second".into())));
        assert!(group.is_done());
        assert!(matches!(group.wait(), Err(StorageError::BackendGone)));
        assert!(group.wait().is_ok(), "the error is reported once");
    }
}
