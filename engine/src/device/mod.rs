//! Devices: where the math runs and what the copies go to. A [`Device`] is either the
//! [`CpuDevice`] (a simulated accelerator: host memory with a hard budget, worker threads
//! as streams, completion flags as events) or a [`CudaDevice`] (one GPU through cudarc).
//!
//! Both have three lanes ([`Lane`]): compute, host-to-device and device-to-host. Work on a
//! lane runs in order; work on different lanes is ordered only by [`Event`]s: each
//! operation returns the event that completes with it and takes the events it must come
//! after. Copies move bytes between a device buffer from the device's arena and a pinned
//! pool slot; the slot is taken by value and comes back from the [`Transfer`] only once
//! the copy has completed, so no slot is reused while a copy still reads or writes it.
//!
//! Why an enum and not a trait: there are exactly two devices and the engine owns both,
//! so a `match` is all the dispatch needed (as in candle). Callers that need one kind's
//! own handles (the cudarc context and compute stream for CUDA kernels, closures with
//! memory views for the CPU) get them from [`Device::as_cuda`] / [`Device::as_cpu`]
//! without downcasting, and buffers and events need no associated types. Users extend
//! strata with swap policies, not with devices.
//!
//! Not here: what to copy when (the planner and executor), and kernels (the kernels crate).

mod cpu;
mod cuda;
mod event;

use std::fmt;

use strata_kernels::cuda::probe;

pub use cpu::{
    CpuAccess, CpuDevice, CpuDeviceConfig, Plain, ReadView, WriteView, bytes_of, bytes_of_mut,
    cast, cast_mut,
};
pub use cuda::{CudaDevice, CudaDeviceConfig};
pub use event::{CpuEvent, CudaEventRef, Event};

use crate::error::EngineError;
use crate::memory::{ArenaStats, DeviceArena, DeviceBuffer, Pinning, SlotLease};

/// A device's streams of work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lane {
    /// Kernels (or, on the CPU device, closures).
    Compute,
    /// Copies from pinned host slots into device memory.
    H2d,
    /// Copies from device memory into pinned host slots.
    D2h,
}

impl Lane {
    /// Every lane, in index order.
    pub const ALL: [Lane; 3] = [Lane::Compute, Lane::H2d, Lane::D2h];

    /// The lane's position in [`Lane::ALL`].
    pub fn index(self) -> usize {
        match self {
            Lane::Compute => 0,
            Lane::H2d => 1,
            Lane::D2h => 2,
        }
    }
}

impl fmt::Display for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Lane::Compute => "compute",
            Lane::H2d => "host-to-device",
            Lane::D2h => "device-to-host",
        })
    }
}

/// Which device to use, as the user says it (`--device auto|cpu|cuda`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DeviceChoice {
    /// A GPU when the CUDA libraries load and one is visible, else the CPU device.
    #[default]
    Auto,
    /// The CPU: host memory and the CPU kernels (where a GPU would be, a simulated one).
    Cpu,
    /// The configured GPU (`DeviceConfig::cuda_ordinal`, 0 by default) through CUDA; an
    /// error when it cannot be used.
    Cuda,
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceChoice::Auto => "auto",
            DeviceChoice::Cpu => "cpu",
            DeviceChoice::Cuda => "cuda",
        })
    }
}

/// Which kind a [`Device`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// The CPU device.
    Cpu,
    /// A CUDA GPU.
    Cuda,
}

/// What [`select`] needs to open a device.
#[derive(Debug, Clone)]
pub struct DeviceConfig {
    /// Device memory allocated at start (the arena's budget).
    pub memory_budget_bytes: usize,
    /// Which GPU, when CUDA is chosen.
    pub cuda_ordinal: usize,
    /// Whether strata's kernels will run on a GPU (training: true), which needs NVRTC and
    /// cuBLAS besides the driver; a copy benchmark needs only the driver (false).
    pub cuda_needs_kernels: bool,
}

/// A device: the simulated CPU accelerator or a GPU.
#[derive(Debug)]
pub enum Device {
    /// The CPU device.
    Cpu(CpuDevice),
    /// A CUDA GPU.
    Cuda(CudaDevice),
}

impl Device {
    /// Which kind of device this is.
    pub fn kind(&self) -> DeviceKind {
        match self {
            Device::Cpu(_) => DeviceKind::Cpu,
            Device::Cuda(_) => DeviceKind::Cuda,
        }
    }

    /// The device's name (`cpu`, `cuda:0`).
    pub fn name(&self) -> &str {
        match self {
            Device::Cpu(d) => d.name(),
            Device::Cuda(d) => d.name(),
        }
    }

    /// How pinned pools feeding this device should lock their memory.
    pub fn pinning(&self) -> Pinning {
        match self {
            Device::Cpu(d) => d.pinning(),
            Device::Cuda(d) => d.pinning(),
        }
    }

    /// The device's memory arena.
    pub fn arena(&self) -> &DeviceArena {
        match self {
            Device::Cpu(d) => d.arena(),
            Device::Cuda(d) => d.arena(),
        }
    }

    /// `len_bytes` of device memory from the arena (no driver call).
    pub fn alloc(&self, len_bytes: usize) -> Result<DeviceBuffer, EngineError> {
        self.arena().alloc(len_bytes)
    }

    /// The arena's use.
    pub fn arena_stats(&self) -> ArenaStats {
        self.arena().stats()
    }

    /// Copies the first `dst.len_bytes()` bytes of `src` into `dst` on the
    /// host-to-device lane after `after`; the slot stays with the [`Transfer`] until the
    /// copy has completed.
    pub fn copy_h2d(
        &self,
        dst: &DeviceBuffer,
        src: SlotLease,
        after: &[Event],
    ) -> Result<Transfer, EngineError> {
        match self {
            Device::Cpu(d) => d.copy_h2d(dst, src, after),
            Device::Cuda(d) => d.copy_h2d(dst, src, after),
        }
    }

    /// Copies `src` into the start of `dst` on the device-to-host lane after `after`;
    /// [`Transfer::wait`] hands the slot back once it holds the data.
    pub fn copy_d2h(
        &self,
        dst: SlotLease,
        src: &DeviceBuffer,
        after: &[Event],
    ) -> Result<Transfer, EngineError> {
        match self {
            Device::Cpu(d) => d.copy_d2h(dst, src, after),
            Device::Cuda(d) => d.copy_d2h(dst, src, after),
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

    /// An event that completes when everything submitted to `lane` so far has (timed on
    /// CUDA).
    pub fn record(&self, lane: Lane) -> Result<Event, EngineError> {
        match self {
            Device::Cpu(d) => d.record(lane),
            Device::Cuda(d) => d.record(lane),
        }
    }

    /// Makes everything submitted to `lane` from now on wait for `events`.
    pub fn wait_for(&self, lane: Lane, events: &[Event]) -> Result<(), EngineError> {
        match self {
            Device::Cpu(d) => d.wait_for(lane, events),
            Device::Cuda(d) => d.wait_for(lane, events),
        }
    }

    /// Blocks until every lane has finished everything submitted so far.
    pub fn synchronize(&self) -> Result<(), EngineError> {
        match self {
            Device::Cpu(d) => d.synchronize(),
            Device::Cuda(d) => d.synchronize(),
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

/// Opens the device `choice` names and says which it is and why, in a sentence for the
/// user. `Auto` takes a GPU when the CUDA probe finds the libraries the config needs and
/// a GPU, else the CPU device with the probe's reason; `Cuda` fails with that reason
/// instead.
pub fn select(
    choice: DeviceChoice,
    config: &DeviceConfig,
) -> Result<(Device, String), EngineError> {
    let cpu = || {
        CpuDevice::new(CpuDeviceConfig {
            memory_budget_bytes: config.memory_budget_bytes,
            ..CpuDeviceConfig::default()
        })
        .map(Device::Cpu)
    };
    let cuda = || {
        CudaDevice::new(CudaDeviceConfig {
            ordinal: config.cuda_ordinal,
            memory_budget_bytes: config.memory_budget_bytes,
            needs_kernels: config.cuda_needs_kernels,
        })
    };
    const CPU: &str = "cpu (a simulated accelerator in host memory)";
    match choice {
        DeviceChoice::Cpu => Ok((cpu()?, format!("{CPU}: asked for with device 'cpu'"))),
        DeviceChoice::Cuda => {
            let device = cuda()?;
            let reason = format!(
                "{} ({}): asked for with device 'cuda'",
                device.name(),
                device.gpu_name()
            );
            Ok((Device::Cuda(device), reason))
        }
        DeviceChoice::Auto => match cuda::cuda_usable(config.cuda_needs_kernels) {
            Ok(()) => {
                let device = cuda()?;
                let libraries = if config.cuda_needs_kernels {
                    "the CUDA driver, NVRTC and cuBLAS"
                } else {
                    "the CUDA driver"
                };
                let reason = format!(
                    "{} ({}): device 'auto' found {libraries} and {} GPU(s)",
                    device.name(),
                    device.gpu_name(),
                    probe().device_count
                );
                Ok((Device::Cuda(device), reason))
            }
            Err(unavailable) => Ok((
                cpu()?,
                format!(
                    "{CPU}: device 'auto' found no usable GPU ({})",
                    unavailable.reason
                ),
            )),
        },
    }
}

/// A copy in flight, holding its pinned slot until the copy has completed.
///
/// [`Transfer::wait`] returns the slot (with the data, for a device-to-host copy).
/// Dropping a Transfer also waits for the copy before the slot goes back to its pool, so
/// a slot is never reused under a copy; the executor waits explicitly, where it chooses.
#[must_use = "a Transfer holds its slot until the copy completes; dropping it blocks until then"]
pub struct Transfer {
    event: Event,
    slot: Option<SlotLease>,
    /// Keeps the device range allocated while the copy may touch it.
    _buffer: DeviceBuffer,
}

impl Transfer {
    pub(crate) fn new(event: Event, slot: SlotLease, buffer: DeviceBuffer) -> Self {
        Self {
            event,
            slot: Some(slot),
            _buffer: buffer,
        }
    }

    /// The copy's event, for ordering other lanes after it.
    pub fn event(&self) -> &Event {
        &self.event
    }

    /// Whether the copy has completed, without blocking.
    pub fn is_complete(&self) -> Result<bool, EngineError> {
        self.event.is_complete()
    }

    /// Blocks until the copy has completed and returns the slot. If the copy failed the
    /// error is returned and the slot goes back to its pool, unless the device cannot say
    /// the copy has stopped (a CUDA failure), in which case the slot is leaked instead.
    pub fn wait(mut self) -> Result<SlotLease, EngineError> {
        let slot = self
            .slot
            .take()
            .expect("the slot is taken only by wait or drop");
        settle(&self.event, slot)
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take()
            && let Err(e) = settle(&self.event, slot)
        {
            log::error!("a dropped transfer failed: {e}");
        }
    }
}

impl fmt::Debug for Transfer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transfer")
            .field("event", &self.event)
            .field("slot", &self.slot)
            .finish()
    }
}

fn settle(event: &Event, slot: SlotLease) -> Result<SlotLease, EngineError> {
    match event.wait() {
        Ok(()) => Ok(slot),
        Err(e) => {
            if event.is_cpu() {
                // A CPU event reports failure only once its operation has stopped.
                drop(slot);
            } else {
                log::error!(
                    "slot {} of pool '{}' is leaked: the GPU failed before its copy was known \
                     to be finished",
                    slot.index(),
                    slot.pool_name()
                );
                std::mem::forget(slot);
            }
            Err(e)
        }
    }
}

/// A copy moves `buffer.len_bytes()` bytes to or from the start of the slot; a buffer
/// longer than the slot is a plan bug.
fn assert_copy_fits(buffer: &DeviceBuffer, slot: &SlotLease) {
    assert!(
        buffer.len_bytes() <= slot.len_bytes(),
        "a copy of {} bytes does not fit slot {} of pool '{}' ({} bytes)",
        buffer.len_bytes(),
        slot.index(),
        slot.pool_name(),
        slot.len_bytes()
    );
}
