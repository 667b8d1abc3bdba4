//! Devices: where the math runs and what the copies go to. A [`Device`] is either the
//! [`CpuDevice`] (a simulated accelerator: host memory with a hard budget, worker threads
//! as streams, completion flags as events, and the view checker that catches a missing
//! dependency) or a [`CudaDevice`] (one GPU through cudarc). Both implement the same
//! interface, which is all the executor uses:
//!
//! - memory: the device arena ([`DeviceArena`], one allocation of the budget); host
//!   memory is a [`HostArena`] (page-locked, registered with the GPU and io_uring);
//! - four streams ([`Lane::Compute`], [`Lane::Update`], [`Lane::H2d`], [`Lane::D2h`]),
//!   each running its work in order; work on different streams is ordered only by [`Event`]s: every
//!   operation takes the events it must come after and returns the one that completes
//!   with it;
//! - operations: a program of kernels over bound device ranges, on the compute or the
//!   update stream ([`Device::run_program`]),
//!   copies between host-arena and device ranges ([`Device::copy_to_device`],
//!   [`Device::copy_to_host`]), and copies through pinned pool slots held by a
//!   [`Transfer`] until they complete (the pinned-pool benchmarks);
//! - events: record, stream waits ([`Device::wait_for`]), host waits ([`Event::wait`]),
//!   queries ([`Event::is_complete`]).
//!
//! Why an enum and not a trait: there are exactly two devices and the engine owns both,
//! so a `match` is all the dispatch needed (as in candle), and buffers and events need no
//! associated types. Users extend strata with swap policies and model families, not with
//! devices.
//!
//! Not here: what to copy when (the planner and executor), and kernels (the kernels
//! crate's programs).

pub(crate) mod access;
mod cpu;
mod cuda;
mod event;

use std::fmt;
use std::sync::Arc;

use strata_comm::Collective;
use strata_kernels::cuda::probe;
use strata_kernels::program::{Dtype, Kernel, Scalars, Target};

pub use cpu::{
    CpuAccess, CpuDevice, CpuDeviceConfig, DirectAccess, Plain, ReadView, WriteView, bytes_of,
    bytes_of_mut, cast, cast_mut, chaos_from_env,
};
pub use cuda::{CudaDevice, CudaDeviceConfig, nccl_available};
pub use event::{CpuEvent, CudaEventRef, Event};

use crate::error::EngineError;
use crate::lane::Lane;
use crate::memory::{
    ArenaStats, DeviceArena, DeviceBuffer, HostArena, HostRange, Pinning, SlotLease,
};

/// A range of a device's memory, in bytes from the start of its arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceRange {
    /// First byte.
    pub offset_bytes: usize,
    /// Length.
    pub len_bytes: usize,
}

impl DeviceRange {
    /// `len_bytes` bytes from `offset_bytes`.
    pub const fn new(offset_bytes: usize, len_bytes: usize) -> Self {
        DeviceRange {
            offset_bytes,
            len_bytes,
        }
    }

    /// The range of `buffer`.
    pub fn of(buffer: &DeviceBuffer) -> Self {
        DeviceRange::new(buffer.arena_offset_bytes(), buffer.len_bytes())
    }

    /// The bytes as a range.
    pub fn bytes(&self) -> std::ops::Range<usize> {
        self.offset_bytes..self.offset_bytes + self.len_bytes
    }

    /// `len_bytes` bytes starting `offset_bytes` into this range.
    pub fn sub(&self, offset_bytes: usize, len_bytes: usize) -> DeviceRange {
        assert!(
            offset_bytes + len_bytes <= self.len_bytes,
            "a sub-range of {len_bytes} bytes at {offset_bytes} of a range of {}",
            self.len_bytes
        );
        DeviceRange::new(self.offset_bytes + offset_bytes, len_bytes)
    }
}

/// `Ok` when every bound range lies in `arena` and every tensor of `kernel` inside the
/// range bound for it; else an error naming the kernel and the tensor. Both devices check
/// a program with this before it touches memory.
pub(crate) fn check_bindings(
    arena: &DeviceArena,
    kernel: &Kernel,
    bindings: &Bindings,
) -> Result<(), EngineError> {
    for b in bindings.0.iter().flatten() {
        arena.check_range(b.bytes())?;
    }
    let mut unbound = None;
    kernel.for_each_tensor(|t, _| {
        let fits = bindings.get(t.buf).is_some_and(|r| {
            t.offset_bytes
                .checked_add(t.bytes())
                .is_some_and(|end| end <= r.len_bytes)
        });
        if !fits && unbound.is_none() {
            unbound = Some(*t);
        }
    });
    match unbound {
        None => Ok(()),
        Some(t) => Err(EngineError::ProgramBinding {
            kernel: kernel.name(),
            tensor: format!("{t:?}"),
            bound: bindings.get(t.buf).map(|r| r.len_bytes),
        }),
    }
}

/// Most buffers a program may bind.
pub const MAX_BINDINGS: usize = 16;

/// The device ranges a program's tensors refer to, by binding index
/// ([`TensorRef::buf`](strata_kernels::program::TensorRef)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bindings(pub [Option<DeviceRange>; MAX_BINDINGS]);

impl Bindings {
    /// Binds `range` at `index`.
    pub fn set(&mut self, index: u8, range: DeviceRange) {
        self.0[index as usize] = Some(range);
    }

    /// The range bound at `index`.
    pub fn get(&self, index: u8) -> Option<DeviceRange> {
        self.0.get(index as usize).copied().flatten()
    }
}

/// A program: kernels run in order on the compute stream, shared cheaply.
pub type Program = Arc<[Kernel]>;

/// A conversion a host-to-device copy makes on the way (the CPU device computes in f32
/// while host working parameters may be bf16 or fp16): from the host's dtype to the
/// device's. A GPU copies bytes as they are and refuses a conversion.
pub type Convert = Option<(Dtype, Dtype)>;

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

    /// Which kernels run here.
    pub fn target(&self) -> Target {
        match self {
            Device::Cpu(_) => Target::Cpu,
            Device::Cuda(_) => Target::Cuda,
        }
    }

    /// Runs `program` on kernel stream `lane` ([`Lane::Compute`] or [`Lane::Update`])
    /// after `after`, each tensor resolved through `bindings`, with `scalars`; the event
    /// completes when the last kernel has.
    pub fn run_program(
        &self,
        lane: Lane,
        program: &Program,
        bindings: &Bindings,
        scalars: &Scalars,
        after: &[Event],
    ) -> Result<Event, EngineError> {
        assert!(
            matches!(lane, Lane::Compute | Lane::Update),
            "programs run on the compute or the update stream, not {lane}"
        );
        match self {
            Device::Cpu(d) => d.run_program(lane, program, bindings, scalars, after),
            Device::Cuda(d) => d.run_program(lane, program, bindings, scalars, after),
        }
    }

    /// Copies `src` of `host` into `dst` on the host-to-device stream after `after`,
    /// converting as `convert` says (CPU device only). `host` must outlive the copy: wait
    /// for the event (or synchronize) before dropping it.
    pub fn copy_to_device(
        &self,
        host: &HostArena,
        src: HostRange,
        dst: DeviceRange,
        convert: Convert,
        after: &[Event],
    ) -> Result<Event, EngineError> {
        match self {
            Device::Cpu(d) => d.copy_to_device(host, src, dst, convert, after),
            Device::Cuda(d) => d.copy_to_device(host, src, dst, convert, after),
        }
    }

    /// Copies `src` into `dst` of `host` on the device-to-host stream after `after`.
    /// `host` must outlive the copy.
    pub fn copy_to_host(
        &self,
        src: DeviceRange,
        host: &HostArena,
        dst: HostRange,
        after: &[Event],
    ) -> Result<Event, EngineError> {
        match self {
            Device::Cpu(d) => d.copy_to_host(src, host, dst, after),
            Device::Cuda(d) => d.copy_to_host(src, host, dst, after),
        }
    }

    /// Gathers every rank's `src` into `dst` (`comm.size()` times `src`'s bytes, in rank
    /// order) over device memory: a collective of `comm`'s group, called by the
    /// executor's collective lane (one host thread taking a step's collectives in plan
    /// order, so every rank issues them in the same order) once the operations writing
    /// `src` completed; returns when `dst` holds the result. The CPU device runs the
    /// host collective on its memory; a GPU, NCCL over a communicator of its own,
    /// waited for.
    pub fn all_gather(
        &self,
        comm: &dyn Collective,
        src: DeviceRange,
        dst: DeviceRange,
    ) -> Result<(), EngineError> {
        assert_eq!(
            dst.len_bytes,
            src.len_bytes * comm.size(),
            "an all-gather's output holds every rank's input"
        );
        match self {
            Device::Cpu(d) => d.all_gather(comm, src, dst),
            Device::Cuda(d) => d.all_gather(comm, src, dst),
        }
    }

    /// Reduce-scatters f32 `src` (`comm.size()` chunks of `dst`'s length) into `dst`
    /// over device memory: `dst = ((dst + x_0) + x_1) + ...` with `x_p` rank p's chunk of
    /// this rank's index (without `accumulate`, starting from `x_0`), the fixed order of
    /// [`Collective::reduce_scatter_sum`], so every device gives the same bits. Called
    /// as [`Device::all_gather`] is. `scratch` (`src`'s length) receives the chunks
    /// where the device needs room for them (a GPU); the CPU device needs none.
    pub fn reduce_scatter(
        &self,
        comm: &dyn Collective,
        src: DeviceRange,
        dst: DeviceRange,
        scratch: Option<DeviceRange>,
        accumulate: bool,
    ) -> Result<(), EngineError> {
        assert_eq!(
            src.len_bytes,
            dst.len_bytes * comm.size(),
            "a reduce-scatter's input holds a chunk for every rank"
        );
        match self {
            Device::Cpu(d) => d.reduce_scatter(comm, src, dst, accumulate),
            Device::Cuda(d) => d.reduce_scatter(comm, src, dst, scratch, accumulate),
        }
    }

    /// Bytes the copy streams have moved since the device opened: host to device, then
    /// device to host, counted by the copies themselves.
    pub fn copied_bytes(&self) -> [u64; 2] {
        match self {
            Device::Cpu(d) => d.copied_bytes(),
            Device::Cuda(d) => d.copied_bytes(),
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

    /// An event that completes when everything submitted to stream `lane` so far has
    /// (timed on CUDA).
    pub fn record(&self, lane: Lane) -> Result<Event, EngineError> {
        match self {
            Device::Cpu(d) => d.record(lane),
            Device::Cuda(d) => d.record(lane),
        }
    }

    /// Makes everything submitted to stream `lane` from now on wait for `events`.
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

/// Which kernels a run on the device `choice` names would use, before any device is
/// opened (a plan is made for its target): `Cuda` when the CUDA driver, NVRTC, cuBLAS
/// and a GPU are all there, which `Auto` asks and `Cuda` requires (failing with one line
/// naming what is missing); else the CPU's.
pub fn choose_target(choice: DeviceChoice) -> Result<Target, EngineError> {
    match choice {
        DeviceChoice::Cpu => Ok(Target::Cpu),
        DeviceChoice::Cuda => {
            cuda::cuda_usable(true)?;
            Ok(Target::Cuda)
        }
        DeviceChoice::Auto => Ok(if cuda::cuda_usable(true).is_ok() {
            Target::Cuda
        } else {
            Target::Cpu
        }),
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
