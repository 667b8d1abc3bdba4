//! What one step did ([`StepReport`]): its loss and norm, whether it updated, its time
//! and each lane's busy time, the bytes over each link, and when each operation ran
//! ([`OpRecord`]), and the seconds of each kernel the device ran ([`KernelTimes`]).
//!
//! Not here: how the records are measured (`step.rs`) or drawn (`trace.rs`).

use crate::device::KernelTimes;
use crate::lane::Lane;
use crate::plan::OpLabel;

/// What one step did.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// Mean loss over the step's tokens (before loss scaling).
    pub loss: f32,
    /// Global gradient norm (after unscaling, before clipping).
    pub grad_norm: f64,
    /// Whether the update was skipped (non-finite gradients).
    pub skipped: bool,
    /// Whether this call applied an update (not with a delayed update's first step, nor
    /// when skipped).
    pub updated: bool,
    /// Wall time.
    pub seconds: f64,
    /// Busy seconds per lane ([`Lane::index`]).
    pub lane_busy: [f64; Lane::COUNT],
    /// Seconds the compute lane's device stream sat idle between its operations.
    pub compute_stall: f64,
    /// Bytes this step moved over NVMe read, NVMe write, H2D and D2H, as the NVMe tier
    /// and the device's copies counted them.
    pub link_bytes: [u64; 4],
    /// NVMe chunks this step moved through io_uring's registered (fixed) buffers, and
    /// through plain ones.
    pub fixed_chunks: [u64; 2],
    /// Start and end of every operation the run ran, lane by lane, each lane's in plan
    /// order.
    pub records: Vec<OpRecord>,
    /// Seconds, calls and FLOPs of each kernel the device ran in this step, by name (the
    /// CPU device's; empty on a GPU).
    pub kernels: KernelTimes,
    /// Where the step had to fetch its first parameters alone before it ran (the first
    /// step of a plan that fetches the next step's at each step's end, or one after a
    /// failed step or a load): the seconds and the bytes per link of those fetches, not
    /// counted in `seconds` and `link_bytes`. Zero otherwise.
    pub head_fetch: (f64, [u64; 4]),
}

impl StepReport {
    /// Compute-lane stall as a fraction of the step.
    pub fn stall_fraction(&self) -> f64 {
        if self.seconds > 0.0 {
            self.compute_stall / self.seconds
        } else {
            0.0
        }
    }
}

/// When one operation ran, relative to the step's start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpRecord {
    /// What it did (`fwd 3`, `nvme read`).
    pub label: OpLabel,
    /// Its lane.
    pub lane: Lane,
    /// Start, nanoseconds after the step began.
    pub start_ns: u64,
    /// End.
    pub end_ns: u64,
    /// Bytes it moved (or the optimizer's bytes of state).
    pub bytes: u64,
}
