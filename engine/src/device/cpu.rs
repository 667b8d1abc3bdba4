//! The CPU device: a simulated accelerator, the GPU's twin and the test bed for every
//! schedule on machines without a GPU.
//!
//! Its "device memory" is one host mapping of the budget (backed lazily, as operations
//! touch it), sub-allocated by a [`DeviceArena`] exactly as GPU memory is. Its streams are
//! four worker threads (compute, update, host-to-device, device-to-host), each running
//! its lane's operations in order; its events are completion flags. Programs run the CPU
//! kernels (`strata_kernels::program::run_cpu`) on the compute and update streams; copies between a
//! [`HostArena`] and device ranges run on the copy streams (widening bf16 or fp16 host
//! parameters to the f32 the CPU computes in). Copies can be slowed down on purpose (a
//! fixed latency and a byte rate), so tests can hold a copy in flight.
//!
//! Chaos (`STRATA_DEVICE_CHAOS=<seed>`, or [`CpuDeviceConfig::chaos`]): every stream
//! operation is delayed by a seeded random 0 to 2 ms after its dependencies are met, so
//! the order in which streams complete is perturbed and a dependency missing from a
//! schedule shows as a wrong result or a view-checker error in tests with no GPU.
//!
//! Operations reach device memory only through views checked against every other
//! operation's (the access table of `super::access`; host-arena ranges through the
//! arena's own table): two overlapping accesses, one of them a write, fail the later
//! operation with [`EngineError::OrderingViolation`]. Failures are sticky, as a CUDA
//! context's are after a fault: once an operation fails, every later operation (and
//! `synchronize`) fails naming it, so nothing runs on memory an operation failed to fill.
//!
//! Not here: the GPU (`super::cuda`) and the kernels themselves (the kernels crate).

use std::ops::Range;
use std::ops::{Deref, DerefMut};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam::channel::{Receiver, Sender};
use half::{bf16, f16};
use strata_comm::Collective;
use strata_kernels::ops::{self, Cpu};
use strata_kernels::program::{Access, CpuMemory, Dtype, Scalars, Target, TensorRef, run_cpu};
use strata_storage::IoBuf;

use super::access::AccessTable;
use super::bindings::{Bindings, Convert, DeviceRange, Program, check_program};
use super::event::{CpuEvent, Event, EventPool};
use super::kernel_times::KernelTimes;
use super::ops::{DeviceOps, assert_gather_lengths, assert_scatter_lengths};
use super::transfer::{Transfer, assert_copy_fits};
use crate::error::EngineError;
use crate::lane::Lane;
use crate::memory::{
    DeviceArena, DeviceBuffer, HostArena, HostMapping, HostRange, Pinning, SlotLease,
};

/// How a CPU device is built.
#[derive(Debug, Clone)]
pub struct CpuDeviceConfig {
    /// Bytes of simulated device memory, allocated at start.
    pub memory_budget_bytes: usize,
    /// Operations a lane may have queued before submitting blocks.
    pub queue_depth: usize,
    /// Added to every copy, to simulate a link's latency (or to hold copies in flight in
    /// tests).
    pub copy_latency: Duration,
    /// When set, a copy of n bytes also takes n / rate seconds, to simulate a link's
    /// bandwidth.
    pub copy_bytes_per_second: Option<f64>,
    /// When set, every stream operation is delayed by a random amount drawn from this
    /// seed (see the module's documentation).
    pub chaos: Option<u64>,
    /// Instruction set and threads of the kernels.
    pub cpu: Cpu,
}

/// The chaos seed in `STRATA_DEVICE_CHAOS`, if it holds one.
pub fn chaos_from_env() -> Option<u64> {
    std::env::var("STRATA_DEVICE_CHAOS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
}

impl Default for CpuDeviceConfig {
    /// 256 MiB, no simulated link, chaos as `STRATA_DEVICE_CHAOS` says.
    fn default() -> Self {
        Self {
            memory_budget_bytes: 256 << 20,
            queue_depth: 1024,
            copy_latency: Duration::ZERO,
            copy_bytes_per_second: None,
            chaos: chaos_from_env(),
            cpu: Cpu::default(),
        }
    }
}

/// The simulated accelerator.
pub struct CpuDevice {
    name: String,
    shared: Arc<CpuShared>,
    lanes: Vec<LaneWorker>,
    copy_latency: Duration,
    copy_bytes_per_second: Option<f64>,
}

/// What the lanes share: the memory and the accesses in progress.
struct CpuShared {
    name: String,
    /// The first operation's failure: from then on the device refuses every operation,
    /// as CUDA does after a fault, so that no computation runs on memory an operation
    /// failed to fill and `synchronize` cannot report success.
    first_failure: Mutex<Option<Arc<EngineError>>>,
    /// The first byte of device memory; the arena owns (and keeps alive) the allocation.
    base: HostPtr,
    arena: DeviceArena,
    accesses: AccessTable,
    cpu: Cpu,
    /// Bytes copied host to device, device to host.
    copied: [AtomicU64; 2],
    /// Every kernel's seconds, as timed around it on its lane.
    kernels: Mutex<KernelTimes>,
}

/// Work of any kind, boxed ([`CpuDevice::run`]).
type Closure = Box<dyn FnOnce(&CpuAccess<'_>) -> Result<(), EngineError> + Send>;

/// An operation of a stream, as data: the hot path's kinds are variants, so submitting
/// one allocates nothing; [`Work::Closure`] (boxed) serves [`CpuDevice::run`], which
/// tests and benchmarks use.
// Unboxed on purpose: a box would be an allocation per operation.
#[allow(clippy::large_enum_variant)]
enum Work {
    /// Nothing to do: an event for the stream's position, or a wait.
    Marker,
    /// A program on a kernel stream.
    Program {
        program: Program,
        bindings: Bindings,
        scalars: Scalars,
    },
    /// Host arena to device range, converting as `convert` says.
    ToDevice {
        host: HostArena,
        src: HostRange,
        dst: DeviceRange,
        convert: Convert,
        delay: Duration,
    },
    /// Device range to host arena.
    ToHost {
        src: DeviceRange,
        host: HostArena,
        dst: HostRange,
        delay: Duration,
    },
    /// A pinned slot to a device buffer ([`CpuDevice::copy_h2d`]).
    SlotToDevice {
        from: HostPtr,
        to: DeviceBuffer,
        delay: Duration,
    },
    /// A device buffer to a pinned slot ([`CpuDevice::copy_d2h`]).
    DeviceToSlot {
        from: DeviceBuffer,
        to: HostPtr,
        delay: Duration,
    },
    /// Any work, boxed.
    Closure(Closure),
}

impl Work {
    fn run(self, access: &CpuAccess<'_>) -> Result<(), EngineError> {
        let copied = |direction: usize, bytes: usize| {
            access.shared.copied[direction].fetch_add(bytes as u64, Ordering::Relaxed);
        };
        match self {
            Work::Marker => Ok(()),
            Work::Program {
                program,
                bindings,
                scalars,
            } => program
                .iter()
                .try_for_each(|kernel| access.run_kernel(kernel, &bindings, &scalars)),
            Work::ToDevice {
                host,
                src,
                dst,
                convert,
                delay,
            } => {
                let from = host.read(Lane::H2d, src)?;
                let mut to = access.write_range(dst)?;
                simulate_link(delay);
                convert_into(&access.shared.cpu, convert, &from, &mut to);
                // What crosses the link is what the copy reads from the host (as the plan
                // counts it): with a conversion, fewer bytes than it writes.
                copied(0, src.len_bytes);
                Ok(())
            }
            Work::ToHost {
                src,
                host,
                dst,
                delay,
            } => {
                let from = access.read_range(src)?;
                let mut to = host.write(Lane::D2h, dst)?;
                simulate_link(delay);
                to.copy_from_slice(&from);
                copied(1, src.len_bytes);
                Ok(())
            }
            Work::SlotToDevice { from, to, delay } => {
                let mut device = access.write(&to)?;
                simulate_link(delay);
                // SAFETY: the Transfer copy_h2d returned owns the lease of the slot `from`
                // points into, and gives it up only after this operation's event has
                // completed; the slot holds at least `to.len_bytes()` bytes
                // (assert_copy_fits).
                let host = unsafe { std::slice::from_raw_parts(from.get(), device.len()) };
                device.copy_from_slice(host);
                copied(0, host.len());
                Ok(())
            }
            Work::DeviceToSlot { from, to, delay } => {
                let device = access.read(&from)?;
                simulate_link(delay);
                // SAFETY: as for SlotToDevice: the Transfer owns the slot's lease until
                // this operation's event completes, and nothing else can reach the slot.
                let host = unsafe { std::slice::from_raw_parts_mut(to.get(), device.len()) };
                host.copy_from_slice(&device);
                copied(1, host.len());
                Ok(())
            }
            Work::Closure(work) => work(access),
        }
    }
}

/// Dependencies a job carries inline; an operation with more is preceded on its stream
/// by markers that wait for the rest (the stream's order then covers them).
const INLINE_AFTER: usize = 6;

struct Job {
    after: [Option<Event>; INLINE_AFTER],
    event: CpuEvent,
    work: Work,
}

struct LaneWorker {
    jobs: Option<Sender<Job>>,
    /// The lane's events, reused once nothing else holds them.
    events: EventPool,
    thread: Option<JoinHandle<()>>,
}

impl CpuDevice {
    /// Allocates the memory budget and starts one worker thread per lane.
    pub fn new(config: CpuDeviceConfig) -> Result<Self, EngineError> {
        let name = "cpu".to_string();
        // Mapped lazily: a large budget costs nothing until operations touch it.
        let memory = HostMapping::map(config.memory_budget_bytes).map_err(|e| {
            EngineError::DeviceBudgetUnavailable {
                device: name.clone(),
                budget_bytes: config.memory_budget_bytes,
                reason: format!("mmap: {e}"),
            }
        })?;
        let base = HostPtr(memory.ptr().as_ptr());
        let arena = DeviceArena::new(
            name.clone(),
            config.memory_budget_bytes,
            base.get() as u64,
            Box::new(memory),
        );
        let shared = Arc::new(CpuShared {
            name: name.clone(),
            base,
            arena,
            accesses: AccessTable::new(name.clone()),
            first_failure: Mutex::new(None),
            cpu: config.cpu,
            copied: [AtomicU64::new(0), AtomicU64::new(0)],
            kernels: Mutex::new(KernelTimes::default()),
        });
        let mut lanes = Vec::with_capacity(Lane::STREAMS.len());
        for lane in Lane::STREAMS {
            let (jobs, receiver) = crossbeam::channel::bounded(config.queue_depth.max(1));
            let worker_shared = Arc::clone(&shared);
            let chaos = config
                .chaos
                .map(|seed| Chaos::new(seed ^ (lane.index() as u64 + 1).wrapping_mul(0x9e37_79b9)));
            let thread = std::thread::Builder::new()
                .name(format!("strata-cpu-{lane}"))
                .spawn(move || run_lane(lane, &worker_shared, receiver, chaos))
                .map_err(|e| EngineError::DeviceBudgetUnavailable {
                    device: name.clone(),
                    budget_bytes: config.memory_budget_bytes,
                    reason: format!("could not start the {lane} lane's thread: {e}"),
                })?;
            lanes.push(LaneWorker {
                jobs: Some(jobs),
                events: EventPool::new(lane),
                thread: Some(thread),
            });
        }
        Ok(Self {
            name,
            shared,
            lanes,
            copy_latency: config.copy_latency,
            copy_bytes_per_second: config.copy_bytes_per_second,
        })
    }

    /// Device memory lent to host work on `lane` (its memory is host memory): the NVMe
    /// tier reading into it (`write`), or the CPU optimizer reading gradients from it. The
    /// access is checked against every other operation's, as a copy's is, and ends when
    /// the returned view drops.
    pub fn direct(
        &self,
        range: DeviceRange,
        lane: Lane,
        write: bool,
    ) -> Result<DirectAccess, EngineError> {
        if let Some(first) = self
            .shared
            .first_failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            return Err(EngineError::DeviceFailed {
                device: self.shared.name.clone(),
                first,
            });
        }
        self.shared.arena.check_range(range.bytes())?;
        let id = self
            .shared
            .accesses
            .begin(lane, std::iter::once((range.bytes(), write)))?;
        Ok(DirectAccess {
            // SAFETY: check_range put the range inside the arena's allocation.
            ptr: HostPtr(unsafe { self.shared.base.get().add(range.offset_bytes) }),
            len_bytes: range.len_bytes,
            write,
            id,
            shared: Arc::clone(&self.shared),
        })
    }

    /// Runs `work` on the compute lane after every event in `after`; the returned event
    /// completes when it has, failing if it failed, panicked, or touched memory another
    /// operation was using.
    pub fn run<F>(&self, after: &[Event], work: F) -> Result<Event, EngineError>
    where
        F: FnOnce(&CpuAccess<'_>) -> Result<(), EngineError> + Send + 'static,
    {
        self.submit(Lane::Compute, after, Work::Closure(Box::new(work)))
            .map(Event::Cpu)
    }

    /// Access to device memory for a collective of the executor's collective lane.
    fn collective_access(
        &self,
        src: DeviceRange,
        dst: DeviceRange,
    ) -> Result<CpuAccess<'_>, EngineError> {
        self.shared.arena.check_range(src.bytes())?;
        self.shared.arena.check_range(dst.bytes())?;
        Ok(CpuAccess {
            shared: &self.shared,
            lane: Lane::Comm,
        })
    }

    /// Queues `work` on stream `lane` after `after`. Allocates nothing once the lane's
    /// event pool has warmed up: the work is an enum, the dependencies travel inline (in
    /// chunks of [`INLINE_AFTER`], all but the last as markers ahead of the work).
    fn submit(&self, lane: Lane, after: &[Event], work: Work) -> Result<CpuEvent, EngineError> {
        let stopped = || EngineError::LaneStopped {
            device: self.name.clone(),
            lane,
        };
        let stream = lane
            .stream_index()
            .unwrap_or_else(|| panic!("{lane} is not a stream of the CPU device"));
        let worker = &self.lanes[stream];
        let jobs = worker.jobs.as_ref().ok_or_else(stopped)?;
        let mut chunks = after.chunks(INLINE_AFTER).peekable();
        let mut work = Some(work);
        loop {
            let chunk = chunks.next().unwrap_or(&[]);
            let last = chunks.peek().is_none();
            let mut inline: [Option<Event>; INLINE_AFTER] = Default::default();
            for (slot, e) in inline.iter_mut().zip(chunk) {
                *slot = Some(e.clone());
            }
            let event = worker.events.take();
            let job = Job {
                after: inline,
                event: event.clone(),
                work: if last {
                    work.take().expect("the work goes with the last chunk")
                } else {
                    Work::Marker
                },
            };
            jobs.send(job).map_err(|_| stopped())?;
            if last {
                return Ok(event);
            }
        }
    }

    fn copy_time(&self, len_bytes: usize) -> Duration {
        let transfer = self
            .copy_bytes_per_second
            .filter(|rate| *rate > 0.0)
            .map_or(Duration::ZERO, |rate| {
                Duration::from_secs_f64(len_bytes as f64 / rate)
            });
        self.copy_latency + transfer
    }
}

impl DeviceOps for CpuDevice {
    /// The device's name.
    fn name(&self) -> &str {
        &self.name
    }

    /// How pinned pools for this device lock their memory: `mlock`.
    fn pinning(&self) -> Pinning {
        Pinning::Mlock
    }

    /// The device memory arena.
    fn arena(&self) -> &DeviceArena {
        &self.shared.arena
    }

    fn target(&self) -> Target {
        Target::Cpu
    }

    /// Runs `program` on kernel stream `lane` after `after`: each kernel's tensors are
    /// resolved through `bindings`, checked to lie inside their bound range, registered
    /// with the view checker for the kernel's run, and computed by the CPU kernels.
    fn run_program(
        &self,
        lane: Lane,
        program: &Program,
        bindings: &Bindings,
        scalars: &Scalars,
        after: &[Event],
    ) -> Result<Event, EngineError> {
        check_program(&self.shared.arena, lane, program, bindings)?;
        let work = Work::Program {
            program: Arc::clone(program),
            bindings: *bindings,
            scalars: *scalars,
        };
        self.submit(lane, after, work).map(Event::Cpu)
    }

    /// Copies `src` of `host` into `dst` on the host-to-device stream after `after`,
    /// converting bf16 or fp16 to f32 where `convert` says so.
    fn copy_to_device(
        &self,
        host: &HostArena,
        src: HostRange,
        dst: DeviceRange,
        convert: Convert,
        after: &[Event],
    ) -> Result<Event, EngineError> {
        self.shared.arena.check_range(dst.bytes())?;
        check_conversion(convert, src.len_bytes, dst.len_bytes);
        let work = Work::ToDevice {
            host: host.clone(),
            src,
            dst,
            convert,
            delay: self.copy_time(dst.len_bytes),
        };
        self.submit(Lane::H2d, after, work).map(Event::Cpu)
    }

    /// Copies `src` into `dst` of `host` on the device-to-host stream after `after`.
    fn copy_to_host(
        &self,
        src: DeviceRange,
        host: &HostArena,
        dst: HostRange,
        after: &[Event],
    ) -> Result<Event, EngineError> {
        self.shared.arena.check_range(src.bytes())?;
        assert_eq!(
            src.len_bytes, dst.len_bytes,
            "a copy between ranges of equal length"
        );
        let work = Work::ToHost {
            src,
            host: host.clone(),
            dst,
            delay: self.copy_time(src.len_bytes),
        };
        self.submit(Lane::D2h, after, work).map(Event::Cpu)
    }

    /// [`DeviceOps::all_gather`] on the calling thread: the host
    /// collective on device memory, the views checked against the streams' operations
    /// as theirs are against each other.
    fn all_gather(
        &self,
        comm: &dyn Collective,
        src: DeviceRange,
        dst: DeviceRange,
    ) -> Result<(), EngineError> {
        assert_gather_lengths(comm, src, dst);
        let access = self.collective_access(src, dst)?;
        let from = access.read_range(src)?;
        let mut to = access.write_range(dst)?;
        comm.all_gather(&from, &mut to)
            .map_err(|e| EngineError::collective(&self.name, e))
    }

    /// [`DeviceOps::reduce_scatter`] on the calling thread, as
    /// [`DeviceOps::all_gather`] runs.
    fn reduce_scatter(
        &self,
        comm: &dyn Collective,
        src: DeviceRange,
        dst: DeviceRange,
        _scratch: Option<DeviceRange>,
        accumulate: bool,
    ) -> Result<(), EngineError> {
        assert_scatter_lengths(comm, src, dst);
        let access = self.collective_access(src, dst)?;
        let from = access.read_range(src)?;
        let mut to = access.write_range(dst)?;
        comm.reduce_scatter_sum(cast::<f32>(&from), cast_mut::<f32>(&mut to), accumulate)
            .map_err(|e| EngineError::collective(&self.name, e))
    }

    /// Bytes copied host to device and device to host so far.
    fn copied_bytes(&self) -> [u64; 2] {
        [
            self.shared.copied[0].load(Ordering::Relaxed),
            self.shared.copied[1].load(Ordering::Relaxed),
        ]
    }

    /// Every kernel's seconds since the device opened, timed on its lane.
    fn kernel_times(&self) -> KernelTimes {
        *self
            .shared
            .kernels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Copies the first `dst.len_bytes()` bytes of `src` into `dst` on the host-to-device
    /// lane, after `after`. The slot stays with the returned [`Transfer`] until the copy
    /// has completed.
    fn copy_h2d(
        &self,
        dst: &DeviceBuffer,
        src: SlotLease,
        after: &[Event],
    ) -> Result<Transfer, EngineError> {
        self.shared.arena.check_owns(dst)?;
        assert_copy_fits(dst, &src);
        let from = HostPtr(src.as_ptr().cast_mut());
        let to = dst.clone();
        let delay = self.copy_time(dst.len_bytes());
        let event = self.submit(Lane::H2d, after, Work::SlotToDevice { from, to, delay })?;
        Ok(Transfer::new(Event::Cpu(event), src, dst.clone()))
    }

    /// Copies `src` into the first `src.len_bytes()` bytes of `dst` on the device-to-host
    /// lane, after `after`. [`Transfer::wait`] hands the slot back once it holds the data.
    fn copy_d2h(
        &self,
        dst: SlotLease,
        src: &DeviceBuffer,
        after: &[Event],
    ) -> Result<Transfer, EngineError> {
        self.shared.arena.check_owns(src)?;
        assert_copy_fits(src, &dst);
        let to = HostPtr(dst.as_ptr().cast_mut());
        let from = src.clone();
        let delay = self.copy_time(src.len_bytes());
        let event = self.submit(Lane::D2h, after, Work::DeviceToSlot { from, to, delay })?;
        Ok(Transfer::new(Event::Cpu(event), dst, src.clone()))
    }

    /// An event that completes when everything submitted to `lane` so far has.
    fn record(&self, lane: Lane) -> Result<Event, EngineError> {
        self.submit(lane, &[], Work::Marker).map(Event::Cpu)
    }

    /// Makes everything submitted to `lane` from now on wait for `events`.
    fn wait_for(&self, lane: Lane, events: &[Event]) -> Result<(), EngineError> {
        self.submit(lane, events, Work::Marker).map(drop)
    }

    /// Blocks until every stream has run everything submitted so far.
    fn synchronize(&self) -> Result<(), EngineError> {
        let markers = Lane::STREAMS.map(|lane| self.record(lane));
        for marker in markers {
            marker?.wait()?;
        }
        Ok(())
    }
}

impl Drop for CpuDevice {
    fn drop(&mut self) {
        // Closing the channels lets each worker finish what is queued and exit.
        for lane in &mut self.lanes {
            lane.jobs = None;
        }
        for lane in &mut self.lanes {
            if let Some(thread) = lane.thread.take()
                && thread.join().is_err()
            {
                log::error!("a lane thread of device '{}' panicked", self.name);
            }
        }
    }
}

impl std::fmt::Debug for CpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuDevice")
            .field("name", &self.name)
            .field("arena", &self.shared.arena)
            .field("copy_latency", &self.copy_latency)
            .field("copy_bytes_per_second", &self.copy_bytes_per_second)
            .finish()
    }
}

fn simulate_link(delay: Duration) {
    if !delay.is_zero() {
        std::thread::sleep(delay);
    }
}

/// Seeded delays for chaos runs: xorshift64*, one stream per lane.
struct Chaos(u64);

impl Chaos {
    fn new(seed: u64) -> Self {
        Chaos(seed | 1)
    }

    /// 0 half of the time, else 0 to 2 ms.
    fn delay(&mut self) -> Duration {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32;
        if r & 1 == 0 {
            Duration::ZERO
        } else {
            Duration::from_micros((r >> 1) % 2000)
        }
    }
}

/// One lane's worker: runs jobs in submission order, each after its dependencies.
fn run_lane(lane: Lane, shared: &CpuShared, jobs: Receiver<Job>, mut chaos: Option<Chaos>) {
    for job in jobs.iter() {
        let dependencies = job.after.iter().flatten().try_for_each(Event::wait);
        if let Some(chaos) = &mut chaos {
            simulate_link(chaos.delay());
        }
        job.event.start();
        let first_failure = shared
            .first_failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(first) = first_failure {
            job.event.finish(Err(EngineError::DeviceFailed {
                device: shared.name.clone(),
                first,
            }));
            continue;
        }
        let result = dependencies.and_then(|()| {
            let access = CpuAccess { shared, lane };
            std::panic::catch_unwind(AssertUnwindSafe(|| job.work.run(&access))).unwrap_or_else(
                |panic| {
                    let message = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "a panic without a message".into());
                    Err(EngineError::OperationPanicked { lane, message })
                },
            )
        });
        if let Some(error) = job.event.finish(result) {
            shared
                .first_failure
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(error);
        }
    }
}

/// Access to device memory from inside an operation; views are checked against every
/// other operation's views.
pub struct CpuAccess<'a> {
    shared: &'a CpuShared,
    lane: Lane,
}

impl CpuAccess<'_> {
    /// The lane running this operation.
    pub fn lane(&self) -> Lane {
        self.lane
    }

    /// Reads `buffer`; fails if another operation is writing any of its bytes.
    pub fn read<'b>(&'b self, buffer: &'b DeviceBuffer) -> Result<ReadView<'b>, EngineError> {
        let release = self.begin(buffer, false)?;
        // SAFETY: the range lies inside the arena's live allocation (the arena owns it and
        // `buffer` was checked to come from it), and the access table guarantees no
        // overlapping write is active until `release` drops with this view.
        let bytes = unsafe { std::slice::from_raw_parts(release.start_ptr(), buffer.len_bytes()) };
        Ok(ReadView {
            bytes,
            _release: release,
        })
    }

    /// Writes `buffer`; fails if another operation is reading or writing any of its bytes.
    pub fn write<'b>(&'b self, buffer: &'b DeviceBuffer) -> Result<WriteView<'b>, EngineError> {
        let release = self.begin(buffer, true)?;
        // SAFETY: as in `read`, and the access table guarantees no overlapping access of
        // any kind is active until this view drops.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(release.start_ptr(), buffer.len_bytes()) };
        Ok(WriteView {
            bytes,
            _release: release,
        })
    }

    fn begin(&self, buffer: &DeviceBuffer, write: bool) -> Result<AccessRelease<'_>, EngineError> {
        self.shared.arena.check_owns(buffer)?;
        self.begin_range(DeviceRange::of(buffer), write)
    }

    fn begin_range(
        &self,
        range: DeviceRange,
        write: bool,
    ) -> Result<AccessRelease<'_>, EngineError> {
        let id = self
            .shared
            .accesses
            .begin(self.lane, std::iter::once((range.bytes(), write)))?;
        Ok(AccessRelease {
            shared: self.shared,
            id,
            start: range.offset_bytes,
        })
    }

    /// Reads a device range (checked as [`CpuAccess::read`] is).
    fn read_range(&self, range: DeviceRange) -> Result<ReadView<'_>, EngineError> {
        let release = self.begin_range(range, false)?;
        // SAFETY: the range lies inside the arena's allocation (checked when the operation
        // was submitted) and the access table guarantees no overlapping write until
        // `release` drops with this view.
        let bytes = unsafe { std::slice::from_raw_parts(release.start_ptr(), range.len_bytes) };
        Ok(ReadView {
            bytes,
            _release: release,
        })
    }

    /// Writes a device range (checked as [`CpuAccess::write`] is).
    fn write_range(&self, range: DeviceRange) -> Result<WriteView<'_>, EngineError> {
        let release = self.begin_range(range, true)?;
        // SAFETY: as in `read_range`, and no overlapping access of any kind is active
        // until this view drops.
        let bytes = unsafe { std::slice::from_raw_parts_mut(release.start_ptr(), range.len_bytes) };
        Ok(WriteView {
            bytes,
            _release: release,
        })
    }

    /// Runs one kernel of a program: resolves and bounds-checks its tensors, registers
    /// them all with the view checker, then calls the CPU kernel.
    fn run_kernel(
        &self,
        kernel: &strata_kernels::program::Kernel,
        bindings: &Bindings,
        scalars: &Scalars,
    ) -> Result<(), EngineError> {
        let resolve = |t: &TensorRef| {
            let r = bindings.get(t.buf).expect("checked at submission");
            r.offset_bytes + t.offset_bytes
        };
        // On the stack: a kernel names a handful of tensors, and this runs for every
        // kernel of every step (a Vec here was an allocation per kernel).
        const ON_STACK: usize = 16;
        let mut ranges: [(Range<usize>, bool); ON_STACK] = Default::default();
        let (mut n, mut more) = (0, Vec::new());
        kernel.for_each_tensor(|t, a| {
            let start = resolve(t);
            let range = (start..start + t.bytes(), a == Access::Write);
            if n < ON_STACK {
                ranges[n] = range;
                n += 1;
            } else {
                more.push(range);
            }
        });
        let id = self
            .shared
            .accesses
            .begin(self.lane, ranges[..n].iter().chain(&more).cloned())?;
        let memory = Resolved {
            base: self.shared.base,
            bindings,
        };
        let start = Instant::now();
        // SAFETY: every tensor lies inside its bound range and every bound range inside the
        // arena's allocation (both checked at submission), and the view
        // checker holds every tensor's bytes for this kernel: no other operation writes
        // them, nor reads those this kernel writes, until `end` below. The kernel's own
        // written tensors overlap none of its others (programs are built so; the CPU
        // kernels assert their shapes).
        let result = unsafe { run_cpu(kernel, &self.shared.cpu, scalars, &memory) };
        let seconds = start.elapsed().as_secs_f64();
        self.shared.accesses.end(id);
        self.shared
            .kernels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add(kernel.name(), seconds, kernel.flops());
        result.map_err(|source| EngineError::Kernel {
            kernel: kernel.name(),
            source,
        })
    }
}

/// Tensor addresses for the CPU kernels: the arena's base plus the binding's offset.
struct Resolved<'a> {
    base: HostPtr,
    bindings: &'a Bindings,
}

impl CpuMemory for Resolved<'_> {
    fn address(&self, t: &TensorRef) -> *mut u8 {
        let r = self.bindings.get(t.buf).expect("bound (checked)");
        // SAFETY: inside the arena's allocation (checked before the kernel runs).
        unsafe { self.base.get().add(r.offset_bytes + t.offset_bytes) }
    }
}

/// Panics unless `convert` maps `src_bytes` onto `dst_bytes` (a plan bug otherwise).
fn check_conversion(convert: Convert, src_bytes: usize, dst_bytes: usize) {
    let (from, to) = convert.map_or((1, 1), |(a, b)| (a.size(), b.size()));
    assert!(
        src_bytes.is_multiple_of(from) && src_bytes / from * to == dst_bytes,
        "a copy of {src_bytes} bytes as {convert:?} into {dst_bytes} bytes"
    );
}

/// Copies `from` into `to`, converting as `convert` says.
fn convert_into(cpu: &Cpu, convert: Convert, from: &[u8], to: &mut [u8]) {
    match convert {
        Some((Dtype::Bf16, Dtype::F32)) => {
            ops::bf16_to_f32(cpu, cast_mut::<f32>(to), cast::<bf16>(from))
        }
        Some((Dtype::F16, Dtype::F32)) => {
            ops::f16_to_f32(cpu, cast_mut::<f32>(to), cast::<f16>(from))
        }
        Some((a, b)) if a != b => {
            panic!("the CPU device converts bf16 and fp16 to f32 only, not {a} to {b}")
        }
        _ => to.copy_from_slice(from),
    }
}

/// Ends an access when the view holding it drops.
struct AccessRelease<'a> {
    shared: &'a CpuShared,
    id: u64,
    start: usize,
}

impl AccessRelease<'_> {
    fn start_ptr(&self) -> *mut u8 {
        // SAFETY: `start` is an offset inside the arena's allocation.
        unsafe { self.shared.base.get().add(self.start) }
    }
}

impl Drop for AccessRelease<'_> {
    fn drop(&mut self) {
        self.shared.accesses.end(self.id);
    }
}

/// Device bytes being read by one operation.
pub struct ReadView<'a> {
    bytes: &'a [u8],
    _release: AccessRelease<'a>,
}

/// Device bytes being written by one operation.
pub struct WriteView<'a> {
    bytes: &'a mut [u8],
    _release: AccessRelease<'a>,
}

impl Deref for ReadView<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes
    }
}

impl Deref for WriteView<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes
    }
}

impl DerefMut for WriteView<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.bytes
    }
}

impl ReadView<'_> {
    /// The bytes as elements of `T`. Panics if the buffer is not aligned for `T` or its
    /// length is not a whole number of elements (a layout bug, not an operating error).
    pub fn typed<T: Plain>(&self) -> &[T] {
        let len = element_count::<T>(self.bytes);
        // SAFETY: element_count checked alignment and length; T accepts any bit pattern
        // (Plain); the view's lifetime bounds the borrow.
        unsafe { std::slice::from_raw_parts(self.bytes.as_ptr().cast::<T>(), len) }
    }
}

impl WriteView<'_> {
    /// The bytes as elements of `T`, for writing. Panics as [`ReadView::typed`] does.
    pub fn typed_mut<T: Plain>(&mut self) -> &mut [T] {
        let len = element_count::<T>(self.bytes);
        // SAFETY: as in ReadView::typed, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.bytes.as_mut_ptr().cast::<T>(), len) }
    }
}

/// Bytes as elements of `T`. Panics if they are not aligned for `T` or not a whole
/// number of them (a layout bug).
pub fn cast<T: Plain>(bytes: &[u8]) -> &[T] {
    let len = element_count::<T>(bytes);
    // SAFETY: element_count checked alignment and length; T accepts any bit pattern.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), len) }
}

/// Bytes as elements of `T`, for writing. Panics as [`cast`] does.
pub fn cast_mut<T: Plain>(bytes: &mut [u8]) -> &mut [T] {
    let len = element_count::<T>(bytes);
    // SAFETY: as in `cast`; the exclusive borrow of the bytes moves to the result.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<T>(), len) }
}

/// Elements as their bytes.
pub fn bytes_of<T: Plain>(values: &[T]) -> &[u8] {
    // SAFETY: Plain types have no padding, so every byte is initialised; u8 has
    // alignment 1; the length is the slice's size in bytes.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), size_of_val(values)) }
}

/// Elements as their bytes, for writing: any bytes written are valid elements (Plain).
pub fn bytes_of_mut<T: Plain>(values: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `bytes_of`, and every bit pattern written back is a valid T.
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast::<u8>(), size_of_val(values)) }
}

/// How many `T` the bytes hold, after checking they are aligned for `T` and hold a whole
/// number of them.
fn element_count<T: Plain>(bytes: &[u8]) -> usize {
    let size = std::mem::size_of::<T>();
    assert!(
        bytes.as_ptr().cast::<T>().is_aligned(),
        "device bytes at {:p} are not aligned for {}",
        bytes.as_ptr(),
        std::any::type_name::<T>()
    );
    assert!(
        bytes.len().is_multiple_of(size),
        "{} device bytes are not a whole number of {}",
        bytes.len(),
        std::any::type_name::<T>()
    );
    bytes.len() / size
}

/// Element types device memory can be viewed as.
///
/// # Safety
/// Every bit pattern of `size_of::<Self>()` bytes must be a valid value (no padding, no
/// pointers, no niches).
pub unsafe trait Plain: Copy + Send + Sync + 'static {}

macro_rules! plain {
    ($($t:ty),*) => {$(
        // SAFETY: a primitive number type: every bit pattern is a value.
        unsafe impl Plain for $t {}
    )*};
}
plain!(
    u8,
    i8,
    u16,
    i16,
    u32,
    i32,
    u64,
    i64,
    f32,
    f64,
    half::f16,
    half::bf16
);

/// CPU device memory lent to host work ([`CpuDevice::direct`]); the access it holds
/// ends when it drops.
pub struct DirectAccess {
    ptr: HostPtr,
    len_bytes: usize,
    write: bool,
    id: u64,
    shared: Arc<CpuShared>,
}

// SAFETY: the range is the holder's while the access is held (the access table refuses
// every overlapping write, and every overlapping access to a written range), and
// `shared` keeps the arena's memory alive. I/O writes into it only through an access
// taken for writing (`Executor` reads from NVMe into `direct(.., true)` alone).
unsafe impl IoBuf for DirectAccess {
    fn as_ptr(&self) -> *const u8 {
        self.ptr.get()
    }
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.get()
    }
    fn capacity_bytes(&self) -> usize {
        self.len_bytes
    }
}

impl Deref for DirectAccess {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: inside the arena's allocation (checked when lent); no overlapping write
        // while the access is held, unless this access is the write.
        unsafe { std::slice::from_raw_parts(self.ptr.get(), self.len_bytes) }
    }
}

impl DerefMut for DirectAccess {
    fn deref_mut(&mut self) -> &mut [u8] {
        assert!(self.write, "a write through device memory lent for reading");
        // SAFETY: as for `deref`, and the access was taken for writing: no other access
        // overlaps it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.get(), self.len_bytes) }
    }
}

impl Drop for DirectAccess {
    fn drop(&mut self) {
        self.shared.accesses.end(self.id);
    }
}

/// A host address that may cross to a lane thread.
#[derive(Clone, Copy)]
struct HostPtr(*mut u8);

// SAFETY: only an address; every dereference states its own reason.
unsafe impl Send for HostPtr {}
// SAFETY: as above.
unsafe impl Sync for HostPtr {}

impl HostPtr {
    /// The address (a method, so closures capture the whole Send wrapper).
    fn get(self) -> *mut u8 {
        self.0
    }
}
