//! How the executor is set up ([`ExecConfig`]: the NVMe tier's folders and backend, the
//! lanes' limits, the ranks) and what each step takes beyond the plan ([`StepParams`]).
//!
//! Not here: the faults a test injects into a step (`fault.rs`).

use std::path::PathBuf;
use std::sync::Arc;

use strata_comm::Collective;
use strata_storage::BackendChoice;

/// Extent transfers an NVMe lane keeps in flight by default ([`ExecConfig::nvme_in_flight`]):
/// two, so one extent's checksum and its last chunks overlap the next extent's reads or
/// writes. `strata bench nvme` measures the tier with the same number.
pub const NVME_IN_FLIGHT: usize = 2;

/// How the executor sets up its NVMe tier and its lanes.
#[derive(Debug, Clone)]
pub struct ExecConfig {
    /// Folders for swap files (several = striped over drives). Needed when the plan has
    /// NVMe extents.
    pub nvme_dirs: Vec<PathBuf>,
    /// I/O backend.
    pub io: BackendChoice,
    /// Fault injection (tests).
    pub faults: Option<strata_storage::FaultPlan>,
    /// Threads for the CPU optimizer's kernels.
    pub optimizer_threads: usize,
    /// How many operations the compute lane may have submitted and not yet completed
    /// (at least 1).
    pub run_ahead: usize,
    /// How many extent transfers each NVMe lane keeps in flight (at least 1): the next
    /// one starts, when its dependencies are done, while the last is still moving or
    /// being verified, so the drive's queue does not drain between extents. Default
    /// [`NVME_IN_FLIGHT`].
    pub nvme_in_flight: usize,
    /// Chaos (tests): when set, the host lanes wait a seeded random 0 to 2 ms before
    /// each operation, and a CPU device opened by
    /// [`Executor::on_cpu`](super::Executor::on_cpu) delays its stream operations the
    /// same way (see `crate::device`'s CPU device). The default is `STRATA_DEVICE_CHAOS`.
    pub chaos: Option<u64>,
    /// The group of ranks training together; its size must be the plan's
    /// `shape.ranks`. None: this process alone.
    pub comm: Option<Arc<dyn Collective>>,
    /// Tests: fill the host arena with 0xff bytes (NaN as f32) when it is made, so that
    /// a read of host memory that nothing wrote shows in the results.
    pub poison_host: bool,
}

impl Default for ExecConfig {
    fn default() -> Self {
        ExecConfig {
            nvme_dirs: vec![std::env::temp_dir()],
            io: BackendChoice::Auto,
            faults: None,
            optimizer_threads: strata_kernels::parallel::max_threads(),
            run_ahead: 4,
            nvme_in_flight: NVME_IN_FLIGHT,
            chaos: crate::device::chaos_from_env(),
            comm: None,
            poison_host: false,
        }
    }
}

impl ExecConfig {
    /// The defaults, with swap files in `dirs`.
    pub fn with_nvme(dirs: Vec<PathBuf>) -> Self {
        ExecConfig {
            nvme_dirs: dirs,
            ..ExecConfig::default()
        }
    }
}

/// What one step needs beyond the plan: the update's hyper-parameters.
#[derive(Debug, Clone, Copy)]
pub struct StepParams {
    /// AdamW (the learning rate of this step included).
    pub adam: strata_kernels::adamw::AdamW,
    /// Global-norm clipping threshold (0: off). Needs a plan built with
    /// `needs_global_norm`.
    pub clip: f64,
    /// The loss is multiplied by this before the backward (fp16), and the gradients
    /// divided by it in the update.
    pub loss_scale: f32,
}

/// What bounds a step's lanes, from [`ExecConfig`] (each at least 1).
#[derive(Debug, Clone, Copy)]
pub(super) struct LaneLimits {
    /// Threads for the CPU optimizer's kernels.
    pub(super) optimizer_threads: usize,
    /// Operations the compute lane may have submitted and not yet completed.
    pub(super) run_ahead: usize,
    /// Extent transfers each NVMe lane keeps in flight.
    pub(super) nvme_in_flight: usize,
    /// Chaos: the seed of the host lanes' random waits.
    pub(super) chaos: Option<u64>,
}

impl LaneLimits {
    /// The limits `config` sets.
    pub(super) fn of(config: &ExecConfig) -> Self {
        LaneLimits {
            optimizer_threads: config.optimizer_threads.max(1),
            run_ahead: config.run_ahead.max(1),
            nvme_in_flight: config.nvme_in_flight.max(1),
            chaos: config.chaos,
        }
    }
}
