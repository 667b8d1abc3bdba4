//! Why a step (or setting up the executor) failed: [`ExecError`], naming the lane and the
//! operation where there is one.
//!
//! Not here: the device's errors ([`EngineError`]) or the NVMe tier's ([`StorageError`]),
//! which it wraps.

use strata_comm::CommError;
use strata_kernels::adamw::AdamError;
use strata_storage::StorageError;

use crate::error::EngineError;
use crate::lane::Lane;
use crate::model::ModelError;

/// Why a step (or setting up the executor) failed.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// An NVMe transfer failed; blocks that committed before it keep their update
    /// ([`Executor::block_steps`](crate::exec::Executor::block_steps)), the others are as
    /// before the step.
    #[error("{op}: {source}")]
    Storage {
        /// The operation.
        op: String,
        /// The error from the tier.
        source: StorageError,
    },
    /// The device failed an operation (a kernel, a copy, an ordering violation).
    #[error("{op}: {source}")]
    Device {
        /// The operation.
        op: String,
        /// The device's error.
        source: EngineError,
    },
    /// The optimizer refused its inputs.
    #[error("{op}: {source}")]
    Adam {
        /// The operation.
        op: String,
        /// The error.
        source: AdamError,
    },
    /// Inputs that do not match the plan (batch shape, parameter buffers).
    #[error("{0}")]
    BadInput(String),
    /// Setting up the NVMe tier failed.
    #[error("NVMe tier: {0}")]
    Tier(StorageError),
    /// A lane panicked.
    #[error("the {lane} lane panicked in {op}: {message}")]
    Panicked {
        /// The lane.
        lane: Lane,
        /// The operation it was running.
        op: String,
        /// The panic's message.
        message: String,
    },
    /// The model refused something (a shape, a program).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A lane stopped because another failed (never the error a step returns: that is
    /// the other lane's).
    #[error("aborted after another lane failed")]
    Aborted,
    /// A failure injected by a [`FaultPlan`](crate::exec::FaultPlan).
    #[error("injected failure in {op}")]
    Injected {
        /// The operation.
        op: String,
    },
    /// The lanes' threads could not be started.
    #[error("starting the lane threads: {0}")]
    Threads(String),
    /// A collective among ranks failed (another rank aborted, a timeout, MPI).
    #[error("{op}: {source}")]
    Comm {
        /// The operation.
        op: String,
        /// The error from the group.
        source: CommError,
    },
}

impl ExecError {
    /// Whether it only says a lane stopped for another's failure.
    pub(super) fn is_abort(&self) -> bool {
        matches!(self, ExecError::Aborted)
    }
}

/// A failure's message from a panic payload.
pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}
