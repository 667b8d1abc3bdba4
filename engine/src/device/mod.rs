//! Devices: where the math runs and what the copies go to. A [`Device`] is either the
//! [`CpuDevice`] (a simulated accelerator: host memory with a hard budget, worker threads
//! as streams, completion flags as events, and the view checker that catches a missing
//! dependency) or a [`CudaDevice`] (one GPU through cudarc). Both implement [`DeviceOps`],
//! which is all the executor uses, and a `Device` dereferences to it:
//!
//! - memory: the device arena ([`DeviceArena`], one allocation of the budget); host
//!   memory is a [`HostArena`] (page-locked, registered with the GPU and io_uring);
//! - four streams ([`Lane::Compute`], [`Lane::Update`], [`Lane::H2d`], [`Lane::D2h`]),
//!   each running its work in order; work on different streams is ordered only by [`Event`]s: every
//!   operation takes the events it must come after and returns the one that completes
//!   with it;
//! - operations: a program of kernels over bound device ranges, on the compute or the
//!   update stream ([`DeviceOps::run_program`]),
//!   copies between host-arena and device ranges ([`DeviceOps::copy_to_device`],
//!   [`DeviceOps::copy_to_host`]), and copies through pinned pool slots held by a
//!   [`Transfer`] until they complete (the pinned-pool benchmarks);
//! - events: record, stream waits ([`DeviceOps::wait_for`]), host waits ([`Event::wait`]),
//!   queries ([`Event::is_complete`]).
//!
//! Why an enum over a trait: there are exactly two devices and the engine owns both, so
//! the enum says which one a run has ([`Device::kind`], [`Device::as_cuda`]) and holds
//! what only one of them does, each refused by the other with
//! [`EngineError::Unsupported`] ([`Device::run`], [`Device::direct`]); everything both do
//! is the trait's, dispatched once per operation. Users extend strata with swap policies
//! and model families, not with devices.
//!
//! This file is the table of contents and the enum. The shared types are in `bindings`
//! (ranges, programs, bindings) and `transfer`; choosing and opening a device in
//! `select`. Not here: what to copy when (the planner and executor), and kernels (the
//! kernels crate's programs).

pub(crate) mod access;
mod bindings;
mod cpu;
mod cuda;
mod event;
mod kernel_times;
mod ops;
mod select;
mod transfer;

use std::ops::Deref;

pub use bindings::{Bindings, Convert, DeviceRange, MAX_BINDINGS, Program};
pub use cpu::{
    CpuAccess, CpuDevice, CpuDeviceConfig, DirectAccess, Plain, ReadView, WriteView, bytes_of,
    bytes_of_mut, cast, cast_mut, chaos_from_env,
};
pub use cuda::{CudaDevice, CudaDeviceConfig, nccl_available};
pub use event::{CpuEvent, CudaEventRef, Event};
pub use kernel_times::{KernelTime, KernelTimes};
pub use ops::DeviceOps;
pub use select::{DeviceChoice, DeviceConfig, choose_target, select};
pub use transfer::Transfer;

use crate::error::EngineError;
use crate::lane::Lane;
#[cfg(doc)]
use crate::memory::{DeviceArena, HostArena};

/// Which kind a [`Device`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// The CPU device.
    Cpu,
    /// A CUDA GPU.
    Cuda,
}

/// A device: the simulated CPU accelerator or a GPU. Every operation both run is
/// [`DeviceOps`]'s, reached through `Deref`; the methods here are about which device this
/// is and what only one of them does.
#[derive(Debug)]
pub enum Device {
    /// The CPU device.
    Cpu(CpuDevice),
    /// A CUDA GPU.
    Cuda(CudaDevice),
}

impl Deref for Device {
    type Target = dyn DeviceOps;

    fn deref(&self) -> &Self::Target {
        match self {
            Device::Cpu(d) => d,
            Device::Cuda(d) => d,
        }
    }
}

impl Device {
    /// Which kind of device this is.
    pub fn kind(&self) -> DeviceKind {
        match self {
            Device::Cpu(_) => DeviceKind::Cpu,
            Device::Cuda(_) => DeviceKind::Cuda,
        }
    }

    /// Device memory lent to host work on `lane` until the returned view drops: the NVMe
    /// tier reading into it (`write`), the CPU optimizer reading gradients from it. The
    /// CPU device only, whose memory is host memory; a GPU's is reached through copies
    /// (the planner makes none of these for a CUDA plan).
    pub fn direct(
        &self,
        range: DeviceRange,
        lane: Lane,
        write: bool,
    ) -> Result<DirectAccess, EngineError> {
        match self {
            Device::Cpu(d) => d.direct(range, lane, write),
            Device::Cuda(d) => Err(EngineError::Unsupported {
                device: d.name().to_string(),
                what: "host access to its memory",
            }),
        }
    }

    /// Runs a host closure on the compute lane (CPU device only; CUDA kernels are launched
    /// on [`CudaDevice::stream`]).
    pub fn run<F>(&self, after: &[Event], work: F) -> Result<Event, EngineError>
    where
        F: FnOnce(&CpuAccess<'_>) -> Result<(), EngineError> + Send + 'static,
    {
        match self {
            Device::Cpu(d) => d.run(after, work),
            Device::Cuda(d) => Err(EngineError::Unsupported {
                device: d.name().to_string(),
                what: "host closures on its compute lane (launch kernels on its compute stream)",
            }),
        }
    }

    /// The CPU device, if this is one.
    pub fn as_cpu(&self) -> Option<&CpuDevice> {
        match self {
            Device::Cpu(d) => Some(d),
            Device::Cuda(_) => None,
        }
    }

    /// The CUDA device, if this is one.
    pub fn as_cuda(&self) -> Option<&CudaDevice> {
        match self {
            Device::Cuda(d) => Some(d),
            Device::Cpu(_) => None,
        }
    }
}
