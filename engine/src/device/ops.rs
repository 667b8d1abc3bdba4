//! What every device does ([`DeviceOps`]): memory, programs on its kernel streams, copies
//! between the host arena (or a pinned slot) and its memory, collectives over its memory,
//! and events. The CPU device and the CUDA device implement it; [`Device`](super::Device)
//! dispatches to it, one virtual call per operation (never per element), so the
//! executor's calls read the same on either.
//!
//! Not here: what only one device does. Host closures on the compute lane and host access
//! to device memory are the CPU device's (`CpuDevice::run`, `CpuDevice::direct`, reached
//! through `Device::run` and `Device::direct`, which a GPU refuses); raw streams, device
//! pointers and timed copies are the CUDA device's.

use strata_comm::Collective;
use strata_kernels::program::{Scalars, Target};

use super::bindings::{Bindings, Convert, DeviceRange, Program};
use super::event::Event;
use super::kernel_times::KernelTimes;
use super::transfer::Transfer;
use crate::error::EngineError;
use crate::lane::Lane;
use crate::memory::{
    ArenaStats, DeviceArena, DeviceBuffer, HostArena, HostRange, Pinning, SlotLease,
};

/// The operations both devices run. Work on one stream runs in order; work on different
/// streams is ordered only by [`Event`]s: every operation takes the events it must come
/// after and returns the one that completes with it.
pub trait DeviceOps: Send + Sync {
    /// The device's name (`cpu`, `cuda:0`).
    fn name(&self) -> &str;

    /// How pinned pools and host arenas feeding this device should lock their memory.
    fn pinning(&self) -> Pinning;

    /// The device's memory arena (one allocation of its budget).
    fn arena(&self) -> &DeviceArena;

    /// Which kernels run here.
    fn target(&self) -> Target;

    /// `len_bytes` of device memory from the arena (no driver call).
    fn alloc(&self, len_bytes: usize) -> Result<DeviceBuffer, EngineError> {
        self.arena().alloc(len_bytes)
    }

    /// The arena's use.
    fn arena_stats(&self) -> ArenaStats {
        self.arena().stats()
    }

    /// Runs `program` on kernel stream `lane` ([`Lane::Compute`] or [`Lane::Update`])
    /// after `after`, each tensor resolved through `bindings` (checked to lie inside its
    /// bound range before anything runs), with `scalars`; the event completes when the
    /// last kernel has.
    fn run_program(
        &self,
        lane: Lane,
        program: &Program,
        bindings: &Bindings,
        scalars: &Scalars,
        after: &[Event],
    ) -> Result<Event, EngineError>;

    /// Copies `src` of `host` into `dst` on the host-to-device stream after `after`,
    /// converting as `convert` says (the CPU device only; a GPU refuses a conversion).
    /// `host` must outlive the copy: wait for the event (or synchronize) before dropping
    /// it.
    fn copy_to_device(
        &self,
        host: &HostArena,
        src: HostRange,
        dst: DeviceRange,
        convert: Convert,
        after: &[Event],
    ) -> Result<Event, EngineError>;

    /// Copies `src` into `dst` of `host` on the device-to-host stream after `after`.
    /// `host` must outlive the copy.
    fn copy_to_host(
        &self,
        src: DeviceRange,
        host: &HostArena,
        dst: HostRange,
        after: &[Event],
    ) -> Result<Event, EngineError>;

    /// Gathers every rank's `src` into `dst` (`comm.size()` times `src`'s bytes, in rank
    /// order) over device memory: a collective of `comm`'s group, called by the
    /// executor's collective lane (one host thread taking a step's collectives in plan
    /// order, so every rank issues them in the same order) once the operations writing
    /// `src` completed; returns when `dst` holds the result. The CPU device runs the
    /// host collective on its memory; a GPU, NCCL over a communicator of its own,
    /// waited for.
    fn all_gather(
        &self,
        comm: &dyn Collective,
        src: DeviceRange,
        dst: DeviceRange,
    ) -> Result<(), EngineError>;

    /// Reduce-scatters f32 `src` (`comm.size()` chunks of `dst`'s length) into `dst`
    /// over device memory: `dst = ((dst + x_0) + x_1) + ...` with `x_p` rank p's chunk of
    /// this rank's index (without `accumulate`, starting from `x_0`), the fixed order of
    /// [`Collective::reduce_scatter_sum`], so every device gives the same bits. Called
    /// as [`DeviceOps::all_gather`] is. `scratch` (`src`'s length) receives the chunks
    /// where the device needs room for them (a GPU); the CPU device needs none.
    fn reduce_scatter(
        &self,
        comm: &dyn Collective,
        src: DeviceRange,
        dst: DeviceRange,
        scratch: Option<DeviceRange>,
        accumulate: bool,
    ) -> Result<(), EngineError>;

    /// Bytes the copy streams have moved since the device opened: host to device, then
    /// device to host, counted by the copies themselves.
    fn copied_bytes(&self) -> [u64; 2];

    /// Seconds, calls and FLOPs of every kernel the device has run since it opened, by
    /// kernel name: timed by the CPU device, empty on a GPU (see [`KernelTimes`]).
    fn kernel_times(&self) -> KernelTimes;

    /// Copies the first `dst.len_bytes()` bytes of `src` into `dst` on the
    /// host-to-device stream after `after`; the slot stays with the [`Transfer`] until
    /// the copy has completed.
    fn copy_h2d(
        &self,
        dst: &DeviceBuffer,
        src: SlotLease,
        after: &[Event],
    ) -> Result<Transfer, EngineError>;

    /// Copies `src` into the start of `dst` on the device-to-host stream after `after`;
    /// [`Transfer::wait`] hands the slot back once it holds the data.
    fn copy_d2h(
        &self,
        dst: SlotLease,
        src: &DeviceBuffer,
        after: &[Event],
    ) -> Result<Transfer, EngineError>;

    /// An event that completes when everything submitted to stream `lane` so far has
    /// (timed on CUDA).
    fn record(&self, lane: Lane) -> Result<Event, EngineError>;

    /// Makes everything submitted to stream `lane` from now on wait for `events`.
    fn wait_for(&self, lane: Lane, events: &[Event]) -> Result<(), EngineError>;

    /// Blocks until every stream has finished everything submitted so far.
    fn synchronize(&self) -> Result<(), EngineError>;
}

/// An all-gather's output holds every rank's input.
pub(super) fn assert_gather_lengths(comm: &dyn Collective, src: DeviceRange, dst: DeviceRange) {
    assert_eq!(
        dst.len_bytes,
        src.len_bytes * comm.size(),
        "an all-gather's output holds every rank's input"
    );
}

/// A reduce-scatter's input holds a chunk for every rank.
pub(super) fn assert_scatter_lengths(comm: &dyn Collective, src: DeviceRange, dst: DeviceRange) {
    assert_eq!(
        src.len_bytes,
        dst.len_bytes * comm.size(),
        "a reduce-scatter's input holds a chunk for every rank"
    );
}
