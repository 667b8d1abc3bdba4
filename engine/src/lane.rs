//! The lanes a training step runs on: the type every layer that schedules, runs or
//! reports work names them by (the planner, the executor, the devices, the errors), in a
//! module of its own so that none of them imports another for it.

use std::fmt;

/// The lanes a training step runs on. Four are a device's streams (compute, the update of
/// device-homed optimizer state, copies each way); three are the executor's host threads
/// (NVMe reads, NVMe writes, the CPU optimizer). Each runs its work in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Lane {
    /// NVMe reads (the io_uring thread does the I/O).
    NvmeRead,
    /// NVMe writes, beside the reads.
    NvmeWrite,
    /// The device's host-to-device copy stream.
    H2d,
    /// The device's compute stream: kernels.
    Compute,
    /// The device's device-to-host copy stream.
    D2h,
    /// The CPU optimizer (and other host arithmetic on gradients).
    Cpu,
    /// The device's second kernel stream: AdamW and gradient statistics of optimizer
    /// state that lives on the device, beside the backward of the blocks before.
    Update,
    /// Collectives among ranks (all-gathers of parameters, reduce-scatters of
    /// gradients, the global norm), on a host thread; empty with one rank.
    Comm,
}

impl Lane {
    /// How many lanes there are.
    pub const COUNT: usize = 8;

    /// Every lane, in index order.
    pub const ALL: [Lane; Lane::COUNT] = [
        Lane::NvmeRead,
        Lane::NvmeWrite,
        Lane::H2d,
        Lane::Compute,
        Lane::D2h,
        Lane::Cpu,
        Lane::Update,
        Lane::Comm,
    ];

    /// The device's streams.
    pub const STREAMS: [Lane; 4] = [Lane::Compute, Lane::H2d, Lane::D2h, Lane::Update];

    /// The lane's position in [`Lane::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Whether the lane is one of a device's streams.
    pub fn is_stream(self) -> bool {
        self.stream_index().is_some()
    }

    /// The lane's position in [`Lane::STREAMS`], if it is a stream.
    pub fn stream_index(self) -> Option<usize> {
        match self {
            Lane::Compute => Some(0),
            Lane::H2d => Some(1),
            Lane::D2h => Some(2),
            Lane::Update => Some(3),
            _ => None,
        }
    }
}

impl fmt::Display for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Lane::NvmeRead => "nvme-read",
            Lane::NvmeWrite => "nvme-write",
            Lane::H2d => "h2d",
            Lane::Compute => "compute",
            Lane::D2h => "d2h",
            Lane::Cpu => "cpu-optimizer",
            Lane::Update => "device-update",
            Lane::Comm => "collective",
        })
    }
}
