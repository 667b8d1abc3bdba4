//! The engine's one error enum. Every variant carries the context a user needs to act on
//! it (which pool, which budget, which lane) and, where there is one, says what to do.
//!
//! Operating errors are values of [`EngineError`]; broken invariants (a copy longer than
//! its slot, a buffer range outside its allocation) are `assert!`s, not variants.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::DriverError;
use strata_kernels::cuda::CudaUnavailable;

use crate::lane::Lane;

/// Everything that can go wrong in the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A pinned pool's configuration cannot be carved into slots.
    #[error("pinned pool '{pool}': {reason}")]
    PinnedPoolConfig {
        /// The pool's name.
        pool: String,
        /// What is wrong and what to change.
        reason: String,
    },

    /// Every slot of a pinned pool stayed in use for as long as an acquire may wait.
    #[error(
        "pinned pool '{pool}' is exhausted: all {slot_count} slots of {slot} (budget {budget}) \
         are in use ({in_use_slots} leased) after waiting {waited:?}; raise the pinned-memory \
         budget or lower the prefetch depth so fewer transfers are in flight",
        slot = Bytes(*slot_bytes),
        budget = Bytes(*budget_bytes)
    )]
    PinnedPoolExhausted {
        /// The pool's name.
        pool: String,
        /// Slots in the pool.
        slot_count: usize,
        /// Bytes per slot.
        slot_bytes: usize,
        /// The pool's byte budget.
        budget_bytes: usize,
        /// Slots leased when the wait gave up.
        in_use_slots: usize,
        /// How long the acquire waited.
        waited: Duration,
    },

    /// The operating system refused the pool's host memory.
    #[error("pinned pool '{pool}': could not map {size} of host memory: {source}; lower the pinned-memory budget", size = Bytes(*size_bytes))]
    HostMemory {
        /// The pool's name.
        pool: String,
        /// The size asked for.
        size_bytes: usize,
        /// The error from mmap.
        source: std::io::Error,
    },

    /// The CUDA driver could not page-lock the pool's memory.
    #[error(
        "pinned pool '{pool}': the CUDA driver could not page-lock {size} (cuMemHostRegister): \
         {source}; lower the pinned-memory budget",
        size = Bytes(*size_bytes)
    )]
    CudaHostRegister {
        /// The pool's name.
        pool: String,
        /// The size asked for.
        size_bytes: usize,
        /// The driver's error.
        source: DriverError,
    },

    /// A CUDA driver call failed.
    #[error("CUDA: {op} failed: {source}")]
    Cuda {
        /// The driver call or the operation it was part of.
        op: &'static str,
        /// The driver's error.
        source: DriverError,
    },

    /// The NVMe tier failed (its error names the extent, file and what to do).
    #[error(transparent)]
    Storage(#[from] strata_storage::StorageError),

    /// CUDA was asked for but cannot be used on this machine.
    #[error(transparent)]
    CudaUnavailable(#[from] CudaUnavailable),

    /// A device allocation does not fit in what is left of the device budget.
    #[error(
        "device '{device}' is out of its memory budget: asked for {requested}, budget {budget}, \
         {in_use} in use, largest free block {largest_free}; raise the device-memory budget or \
         choose a policy that keeps less on the device",
        requested = Bytes(*requested_bytes),
        budget = Bytes(*budget_bytes),
        in_use = Bytes(*in_use_bytes),
        largest_free = Bytes(*largest_free_bytes)
    )]
    DeviceOutOfBudget {
        /// The device's name.
        device: String,
        /// Bytes asked for.
        requested_bytes: usize,
        /// The device budget.
        budget_bytes: usize,
        /// Bytes allocated when the request failed.
        in_use_bytes: usize,
        /// The largest contiguous free block.
        largest_free_bytes: usize,
    },

    /// The device budget itself could not be allocated at start.
    #[error(
        "device '{device}': could not allocate its memory budget of {budget} at start: {reason}; \
         lower the device-memory budget",
        budget = Bytes(*budget_bytes)
    )]
    DeviceBudgetUnavailable {
        /// The device's name.
        device: String,
        /// The budget asked for.
        budget_bytes: usize,
        /// Why it failed.
        reason: String,
    },

    /// A buffer or event was handed to a device that did not make it.
    #[error("device '{device}' was given {what} that belongs to another device")]
    ForeignResource {
        /// The device that was called.
        device: String,
        /// What was foreign: "a buffer", "an event".
        what: &'static str,
    },

    /// Two operations touched the same bytes at once, one of them writing: the schedule
    /// is missing a dependency. The CPU device's memory and host arenas see this; a GPU's
    /// memory cannot.
    #[error(
        "ordering violation in the memory of '{device}': the {lane} lane {access} bytes \
         {start_bytes}..{end_bytes} while the {other_lane} lane {other_access} them; the later \
         operation is missing a dependency on the earlier one"
    )]
    OrderingViolation {
        /// The device.
        device: String,
        /// The lane whose access was refused.
        lane: Lane,
        /// "reads" or "writes".
        access: &'static str,
        /// First byte of the refused access, from the start of device memory.
        start_bytes: usize,
        /// One past its last byte.
        end_bytes: usize,
        /// The lane holding the conflicting access.
        other_lane: Lane,
        /// "is reading" or "is writing".
        other_access: &'static str,
    },

    /// An operation on a lane failed; waiting on its event reports why.
    #[error("an operation on the {lane} lane failed: {source}")]
    OperationFailed {
        /// The lane that ran it.
        lane: Lane,
        /// The operation's own error, shared by everyone waiting on its event.
        source: Arc<EngineError>,
    },

    /// An earlier operation on this device failed, so it runs nothing more: like a CUDA
    /// context after a fault, the device must be made again. Nothing computed after a
    /// failure can be trusted, so nothing is.
    #[error("device '{device}' runs no more operations since one failed: {first}")]
    DeviceFailed {
        /// The device.
        device: String,
        /// The first failure, shared by every operation refused since.
        first: Arc<EngineError>,
    },

    /// An operation on a lane panicked.
    #[error("an operation on the {lane} lane panicked: {message}")]
    OperationPanicked {
        /// The lane that ran it.
        lane: Lane,
        /// The panic's message.
        message: String,
    },

    /// A lane's worker has stopped (the device is shutting down).
    #[error("the {lane} lane of device '{device}' has stopped")]
    LaneStopped {
        /// The device.
        device: String,
        /// The lane.
        lane: Lane,
    },

    /// Elapsed time was asked of an event made without timing.
    #[error("the event was recorded without timing; record it with Device::record to time it")]
    EventNotTimed,

    /// strata's CUDA kernels could not be loaded (NVRTC, cuBLAS, the module).
    #[error("loading strata's CUDA kernels: {source}")]
    CudaKernels {
        /// Why.
        source: strata_kernels::cuda::CudaError,
    },

    /// A kernel of a program refused its tensors or failed.
    #[error("kernel {kernel}: {source}")]
    Kernel {
        /// The kernel's name.
        kernel: &'static str,
        /// Why.
        source: strata_kernels::program::KernelError,
    },

    /// A program's tensor lies outside the range bound for it (or nothing is bound): the
    /// program and the plan disagree on a buffer's size.
    #[error(
        "kernel {kernel}: tensor {tensor} does not fit the range bound for it ({})",
        bound.map_or("nothing bound".to_string(), |b| format!("{b} bytes"))
    )]
    ProgramBinding {
        /// The kernel's name.
        kernel: &'static str,
        /// The tensor.
        tensor: String,
        /// Bytes bound, if anything.
        bound: Option<usize>,
    },

    /// A collective over device memory failed (its group's error).
    #[error("device '{device}': {source}")]
    Collective {
        /// The device.
        device: String,
        /// The group's error.
        source: Box<strata_comm::CommError>,
    },

    /// The device cannot do what was asked (for example, run a host closure on a GPU).
    #[error("device '{device}' does not support {what}")]
    Unsupported {
        /// The device.
        device: String,
        /// What was asked.
        what: &'static str,
    },
}

impl EngineError {
    /// A collective over `device`'s memory that failed with the group's error `e`.
    pub(crate) fn collective(device: &str, e: strata_comm::CommError) -> EngineError {
        EngineError::Collective {
            device: device.to_string(),
            source: Box::new(e),
        }
    }

    /// A closure mapping a driver error to [`EngineError::Cuda`] for `op`.
    pub(crate) fn cuda(op: &'static str) -> impl FnOnce(DriverError) -> EngineError {
        move |source| EngineError::Cuda { op, source }
    }
}

/// A byte count printed in MiB (or GiB from 1 GiB up), exact bytes in parentheses, for
/// error messages where the user will compare it with a budget they typed.
struct Bytes(usize);

impl std::fmt::Display for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const MIB: f64 = (1u64 << 20) as f64;
        let mib = self.0 as f64 / MIB;
        if mib >= 1024.0 {
            write!(f, "{:.2} GiB ({} bytes)", mib / 1024.0, self.0)
        } else {
            write!(f, "{mib:.1} MiB ({} bytes)", self.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_budget_and_what_to_do() {
        let e = EngineError::PinnedPoolExhausted {
            pool: "h2d".into(),
            slot_count: 4,
            slot_bytes: 1 << 20,
            budget_bytes: 4 << 20,
            in_use_slots: 4,
            waited: Duration::from_millis(50),
        };
        let text = e.to_string();
        assert!(text.contains("'h2d'"), "{text}");
        assert!(text.contains("4.0 MiB (4194304 bytes)"), "{text}");
        assert!(text.contains("raise the pinned-memory budget"), "{text}");

        let e = EngineError::DeviceOutOfBudget {
            device: "cpu".into(),
            requested_bytes: 3 << 30,
            budget_bytes: 2 << 30,
            in_use_bytes: 0,
            largest_free_bytes: 2 << 30,
        };
        let text = e.to_string();
        assert!(text.contains("asked for 3.00 GiB"), "{text}");
        assert!(text.contains("budget 2.00 GiB"), "{text}");
    }
}
