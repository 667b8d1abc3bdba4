//! Fault injection (tests): which operations of the next step fail on purpose, and how.
//! A [`FaultPlan`] names operations by their [`OpId`] in the plan, found from the plan
//! by what they are, so that a test can fail each operation of a step in turn and check
//! that the step fails whole: every block as before it or wholly updated.
//!
//! Not here: faults of the NVMe tier's I/O (`strata_storage::FaultPlan`, through
//! [`ExecConfig::faults`](crate::exec::ExecConfig::faults)), which fail reads and writes
//! underneath the operations.

use crate::plan::OpId;

/// How an operation fails on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// It returns an error ([`ExecError::Injected`](crate::exec::ExecError::Injected)).
    Error,
    /// Its lane panics, as a bug in it would (the step returns
    /// [`ExecError::Panicked`](crate::exec::ExecError::Panicked)).
    Panic,
}

/// The operations that fail on purpose in a step, and how each fails; given to
/// [`Executor::inject`](crate::exec::Executor::inject), it applies to the next step or
/// flush only.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultPlan {
    at: Vec<(OpId, Fault)>,
}

impl FaultPlan {
    /// No faults.
    pub fn new() -> Self {
        FaultPlan::default()
    }

    /// The same plan with operation `op` failing as `fault` says (in place of a fault
    /// it had).
    pub fn with(mut self, op: OpId, fault: Fault) -> Self {
        self.at.retain(|&(id, _)| id != op);
        self.at.push((op, fault));
        self
    }

    /// How operation `op` fails, if it does.
    pub fn fault_at(&self, op: OpId) -> Option<Fault> {
        self.at
            .iter()
            .find_map(|&(id, fault)| (id == op).then_some(fault))
    }
}
