//! The CUDA device: one GPU through cudarc (dynamic loading, always compiled), with four
//! streams ordered by events: compute, the update of device-homed optimizer state,
//! host-to-device copies and device-to-host copies.
//!
//! The device's memory budget is one `cuMemAlloc` when it opens, sub-allocated by a
//! [`DeviceArena`]. Copies go between arena buffers and pinned pool slots with
//! `cuMemcpy{HtoD,DtoH}Async` on the copy streams; a copy's [`Transfer`] keeps the slot
//! until the event recorded after the copy has completed.
//!
//! cudarc's automatic event tracking (a read and a write event per `CudaSlice`, waited on
//! by every stream that touches it) is switched off for this device's context handle: the
//! engine's memory is arena ranges, not `CudaSlice`s, and is ordered by the plan's own
//! events. Kernels written in the kernels crate run on [`CudaDevice::stream`]`(Lane::Compute)`
//! with raw device pointers from [`CudaDevice::device_ptr`], after
//! [`CudaDevice::wait_for`] the events they depend on.
//!
//! This file holds the `unsafe` of raw driver calls. It does not decide what to copy when;
//! the executor does.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError, result, sys};
use cudarc::nccl;
use strata_comm::Collective;
use strata_kernels::cuda::CudaKernels;
use strata_kernels::kernel::FoldRanks;
use strata_kernels::program::{Dtype, Kernel, Scalars, Target, TensorRef};
use strata_storage::IoBuf;

use super::bindings::{Bindings, Convert, DeviceRange, Program, check_program};
use super::event::{CudaEventRef, Event, retry_once};
use super::kernel_times::KernelTimes;
use super::ops::{DeviceOps, assert_gather_lengths, assert_scatter_lengths};
use super::transfer::{Transfer, assert_copy_fits};
use crate::error::EngineError;
use crate::lane::Lane;
use crate::memory::{DeviceArena, DeviceBuffer, HostArena, HostRange, Pinning, SlotLease};

/// How a CUDA device is opened.
#[derive(Debug, Clone)]
pub struct CudaDeviceConfig {
    /// Which GPU (0-based, in the driver's order).
    pub ordinal: usize,
    /// Bytes of GPU memory to allocate at start and sub-allocate from.
    pub memory_budget_bytes: usize,
    /// Whether strata's kernels will run on the device: they need NVRTC and cuBLAS
    /// besides the driver, so opening fails without them. Memory, streams and copies
    /// need only the driver (false, for `strata bench pcie`).
    pub needs_kernels: bool,
}

/// One GPU with its four streams and its memory arena.
pub struct CudaDevice {
    name: String,
    gpu_name: String,
    ctx: Arc<CudaContext>,
    /// Indexed by [`Lane::stream_index`].
    streams: [Arc<CudaStream>; 4],
    arena: DeviceArena,
    /// strata's kernels on the compute and the update stream, when the device was opened
    /// for them.
    kernels: Option<[CudaKernels; 2]>,
    /// Bytes copied host to device, device to host.
    copied: [AtomicU64; 2],
    /// Events, reused once nobody holds them: untimed (copies) and timed (the rest), so
    /// a warmed-up step creates no CUDA event and allocates nothing for one.
    events: Box<[EventPool; 2]>,
    /// The NCCL communicator of collectives over this GPU's memory, made by the first.
    nccl: std::sync::Mutex<Option<Nccl>>,
}

/// Whether NCCL (`libnccl.so.2`) can be loaded here, for collectives over GPU memory.
pub fn nccl_available() -> bool {
    // SAFETY: probing for the library runs no code of it.
    unsafe { nccl::sys::is_culib_present() }
}

/// An NCCL communicator; destroyed with the device.
struct Nccl(nccl::sys::ncclComm_t);

// SAFETY: NCCL lets any thread use a communicator as long as calls on it do not overlap;
// `CudaDevice` keeps it behind a mutex held for each call.
unsafe impl Send for Nccl {}

impl Drop for Nccl {
    fn drop(&mut self) {
        // SAFETY: the communicator came from ncclCommInitRank and is destroyed once.
        if let Err(e) = unsafe { nccl::result::comm_destroy(self.0) } {
            log::warn!("destroying the NCCL communicator failed: {e:?}");
        }
    }
}

/// CUDA events of one kind, reused: an event only the pool still holds is free (any
/// stream wait on it was captured when it was made, so recording it again is safe).
struct EventPool {
    flags: Option<sys::CUevent_flags>,
    events: std::sync::Mutex<Vec<Arc<CudaEvent>>>,
}

impl EventPool {
    fn new(flags: Option<sys::CUevent_flags>) -> Self {
        EventPool {
            flags,
            events: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// A free event of the pool's, or a new one it keeps.
    fn take(&self, ctx: &Arc<CudaContext>) -> Result<Arc<CudaEvent>, EngineError> {
        let mut events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        // Under the lock nobody can clone an event only the pool holds.
        if let Some(free) = events.iter().find(|e| Arc::strong_count(e) == 1) {
            return Ok(Arc::clone(free));
        }
        let event = Arc::new(
            ctx.new_event(self.flags)
                .map_err(EngineError::cuda("cuEventCreate"))?,
        );
        events.push(Arc::clone(&event));
        Ok(event)
    }
}

/// The arena's GPU memory; freed when the arena and every buffer from it are gone.
struct CudaMemory {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        // Work still queued may use the memory; let it finish first.
        if let Err(e) = self.ctx.synchronize() {
            log::error!("synchronizing before freeing GPU memory failed: {e}");
        }
        // SAFETY: `ptr` came from malloc_sync in CudaDevice::new and is freed once, after
        // the context finished every operation that could use it.
        if let Err(e) = unsafe { result::free_sync(self.ptr) } {
            log::error!("freeing the GPU memory budget failed: {e}");
        }
    }
}

impl CudaDevice {
    /// Opens GPU `config.ordinal`, creates its streams and allocates its memory budget.
    /// Probes the CUDA libraries first and fails with their reason when one it needs is
    /// missing.
    pub fn new(config: CudaDeviceConfig) -> Result<Self, EngineError> {
        let libraries = strata_kernels::cuda::probe();
        cuda_usable(config.needs_kernels)?;
        if config.ordinal >= libraries.device_count {
            return Err(strata_kernels::cuda::CudaUnavailable {
                reason: format!(
                    "GPU {} was asked for, but the driver reports {} GPU(s)",
                    config.ordinal, libraries.device_count
                ),
            }
            .into());
        }
        let ctx = CudaContext::new(config.ordinal)
            .map_err(EngineError::cuda("opening the primary context"))?;
        // SAFETY: this turns off cudarc's per-CudaSlice event tracking for slices made
        // through this context handle. The engine allocates no CudaSlice: its memory is
        // arena ranges, and every use of it is ordered by the plan's events (a copy or
        // kernel names the events it comes after, and Transfers keep slots until their
        // copy's event completed).
        unsafe { ctx.disable_event_tracking() };
        let gpu_name = ctx.name().map_err(EngineError::cuda("cuDeviceGetName"))?;
        let new_stream = || {
            ctx.new_stream()
                .map_err(EngineError::cuda("cuStreamCreate"))
        };
        let streams = [new_stream()?, new_stream()?, new_stream()?, new_stream()?];
        let name = format!("cuda:{}", config.ordinal);
        let ptr = if config.memory_budget_bytes == 0 {
            0
        } else {
            ctx.bind_to_thread()
                .map_err(EngineError::cuda("binding the context"))?;
            // SAFETY: a plain allocation in the bound context; the memory is uninitialised
            // and only reached through arena buffers.
            unsafe { result::malloc_sync(config.memory_budget_bytes) }.map_err(|e| {
                let free = result::mem_get_info().map_or_else(
                    |_| "free memory unknown".to_string(),
                    |(free, total)| format!("{free} of {total} bytes free"),
                );
                EngineError::DeviceBudgetUnavailable {
                    device: name.clone(),
                    budget_bytes: config.memory_budget_bytes,
                    reason: format!("cuMemAlloc: {e} ({free})"),
                }
            })?
        };
        let arena = DeviceArena::new(
            name.clone(),
            config.memory_budget_bytes,
            ptr,
            Box::new(CudaMemory {
                ctx: Arc::clone(&ctx),
                ptr,
            }),
        );
        let kernels = if config.needs_kernels {
            let on = |lane: Lane| {
                let index = lane.stream_index().expect("a stream");
                CudaKernels::new(Arc::clone(&streams[index]))
                    .map_err(|source| EngineError::CudaKernels { source })
            };
            Some([on(Lane::Compute)?, on(Lane::Update)?])
        } else {
            None
        };
        Ok(Self {
            name,
            gpu_name,
            ctx,
            streams,
            arena,
            kernels,
            copied: [AtomicU64::new(0), AtomicU64::new(0)],
            events: Box::new([
                EventPool::new(None),
                EventPool::new(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)),
            ]),
            nccl: std::sync::Mutex::new(None),
        })
    }

    /// The GPU's product name, as the driver reports it.
    pub fn gpu_name(&self) -> &str {
        &self.gpu_name
    }

    /// The GPU's PCI address as the driver reports it (`0000:3B:00.0`).
    pub fn pci_bus_id(&self) -> Result<String, EngineError> {
        let mut text: [std::ffi::c_char; 64] = [0; 64];
        // SAFETY: the driver writes a NUL-terminated string of at most `len` bytes into
        // our buffer.
        unsafe { sys::cuDeviceGetPCIBusId(text.as_mut_ptr(), 64, self.ctx.cu_device()) }
            .result()
            .map_err(EngineError::cuda("cuDeviceGetPCIBusId"))?;
        // SAFETY: NUL-terminated (the buffer was zeroed and the driver writes less than
        // its length).
        let id = unsafe { CStr::from_ptr(text.as_ptr()) };
        Ok(id.to_string_lossy().into_owned())
    }

    /// The cudarc context, for the kernels crate (modules, cuBLAS handles). Its event
    /// tracking is off: order work by events.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream of `lane` (one of [`Lane::STREAMS`]); kernels run on the compute
    /// lane's.
    pub fn stream(&self, lane: Lane) -> &Arc<CudaStream> {
        let index = lane
            .stream_index()
            .unwrap_or_else(|| panic!("{lane} is not a stream of a CUDA device"));
        &self.streams[index]
    }

    /// Runs `f` with this device's NCCL communicator, made on first use: rank 0's
    /// unique id broadcast over `comm`, every rank joining with its rank in `comm`. The
    /// first device collective is one every rank reaches at the same point of the plan,
    /// so making it there is a collective too.
    fn with_nccl<R>(
        &self,
        comm: &dyn Collective,
        f: impl FnOnce(nccl::sys::ncclComm_t) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        let mut held = self.nccl.lock().unwrap_or_else(|e| e.into_inner());
        self.ctx
            .bind_to_thread()
            .map_err(EngineError::cuda("binding the context"))?;
        if held.is_none() {
            let present = nccl_available();
            // Rank 0's id, and whether every rank can go on, in one broadcast: a rank
            // that cannot must not leave the others waiting in ncclCommInitRank.
            let mut id = [0u8; 129];
            if comm.rank() == 0
                && present
                && let Ok(unique) = nccl::result::get_uniqueid()
            {
                for (b, c) in id.iter_mut().zip(unique.internal) {
                    *b = c as u8;
                }
                id[128] = 1;
            }
            comm.broadcast(0, &mut id)
                .map_err(|e| EngineError::collective(&self.name, e))?;
            let mut ready = [u8::from(present && id[128] == 1)];
            let mut all = vec![0u8; comm.size()];
            comm.all_gather(&ready, &mut all)
                .map_err(|e| EngineError::collective(&self.name, e))?;
            ready[0] = u8::from(all.iter().all(|&r| r == 1));
            if ready[0] == 0 {
                return Err(EngineError::Unsupported {
                    device: self.name.clone(),
                    what: "collectives over GPU memory on every rank: NCCL (libnccl.so.2) \
                           could not be loaded or could not make an id on some rank; \
                           install NCCL, or plan with device collectives off",
                });
            }
            let unique = nccl::sys::ncclUniqueId {
                internal: std::array::from_fn(|i| id[i] as c_char),
            };
            let mut c: nccl::sys::ncclComm_t = std::ptr::null_mut();
            // SAFETY: `c` is a valid place for the communicator; every rank passes the
            // same id and size and its own rank.
            unsafe {
                nccl::result::comm_init_rank(
                    &mut c,
                    comm.size() as c_int,
                    unique,
                    comm.rank() as c_int,
                )
            }
            .map_err(|e| self.nccl_error("ncclCommInitRank", e))?;
            *held = Some(Nccl(c));
        }
        f(held.as_ref().expect("made above").0)
    }

    fn nccl_error(&self, op: &'static str, e: nccl::result::NcclError) -> EngineError {
        EngineError::collective(
            &self.name,
            strata_comm::CommError::Transport {
                op,
                code: e.0 as i32,
                message: format!("{:?}", e.0),
            },
        )
    }

    /// The device address of the arena's first byte.
    fn arena_base(&self) -> u64 {
        self.arena.base_address()
    }

    /// The device address of `buffer`'s first byte, for kernel arguments.
    pub fn device_ptr(&self, buffer: &DeviceBuffer) -> Result<sys::CUdeviceptr, EngineError> {
        self.arena.check_owns(buffer)?;
        Ok(buffer.address())
    }

    fn copy(
        &self,
        lane: Lane,
        buffer: &DeviceBuffer,
        slot: SlotLease,
        after: &[Event],
    ) -> Result<Transfer, EngineError> {
        self.arena.check_owns(buffer)?;
        assert_copy_fits(buffer, &slot);
        let stream = self.stream(lane);
        self.wait_events(stream, after)?;
        // Made before the copy is queued, so that after a successful enqueue only the
        // record can fail.
        let event = self.events[0].take(&self.ctx)?;
        self.ctx
            .bind_to_thread()
            .map_err(EngineError::cuda("binding the context"))?;
        let len = buffer.len_bytes();
        let host = IoBuf::as_ptr(&slot).cast::<std::ffi::c_void>();
        // SAFETY: the device range lies inside the arena's live allocation (checked owner;
        // the Transfer keeps a clone of the buffer); the host range is the start of the
        // slot, at least `len` bytes (assert_copy_fits), page-locked by the pool, and
        // owned by the Transfer until the event recorded after this copy completes.
        let enqueued = unsafe {
            match lane {
                Lane::H2d => {
                    sys::cuMemcpyHtoDAsync_v2(buffer.address(), host, len, stream.cu_stream())
                }
                Lane::D2h => sys::cuMemcpyDtoHAsync_v2(
                    host.cast_mut(),
                    buffer.address(),
                    len,
                    stream.cu_stream(),
                ),
                _ => unreachable!("copies run on the copy lanes"),
            }
        };
        enqueued.result().map_err(EngineError::cuda(match lane {
            Lane::H2d => "cuMemcpyHtoDAsync",
            _ => "cuMemcpyDtoHAsync",
        }))?;
        if let Err(e) = event.record(stream) {
            // The copy is queued but nothing marks its end: the slot may go back only
            // once the whole stream has drained.
            release_after_stream(stream, slot);
            return Err(EngineError::Cuda {
                op: "cuEventRecord",
                source: e,
            });
        }
        let event = Event::Cuda(CudaEventRef {
            event,
            lane,
            timed: false,
        });
        Ok(Transfer::new(event, slot, buffer.clone()))
    }

    /// Times one copy, or two at once: `h2d` copies host bytes into a device buffer on the
    /// host-to-device stream while `d2h` copies a device buffer into host bytes on the
    /// device-to-host stream, both starting at one event. Returns the time from that
    /// event to the later of the two ends, measured by CUDA events. The host memory may be
    /// pinned (a slot) or pageable; this returns only after both copies have finished.
    pub fn time_copies(
        &self,
        h2d: Option<(&[u8], &DeviceBuffer)>,
        d2h: Option<(&DeviceBuffer, &mut [u8])>,
    ) -> Result<Duration, EngineError> {
        for (host_len, buffer) in h2d
            .iter()
            .map(|(h, b)| (h.len(), *b))
            .chain(d2h.iter().map(|(b, h)| (h.len(), *b)))
        {
            self.arena.check_owns(buffer)?;
            assert_eq!(
                host_len,
                buffer.len_bytes(),
                "a timed copy moves whole buffers"
            );
        }
        let lanes: Vec<Lane> = [(h2d.is_some(), Lane::H2d), (d2h.is_some(), Lane::D2h)]
            .into_iter()
            .filter_map(|(used, lane)| used.then_some(lane))
            .collect();
        let Some(&first) = lanes.first() else {
            return Ok(Duration::ZERO);
        };
        let start = self.timed_event()?;
        start
            .record(self.stream(first))
            .map_err(EngineError::cuda("cuEventRecord"))?;
        for &lane in &lanes[1..] {
            self.stream(lane)
                .wait(&start)
                .map_err(EngineError::cuda("cuStreamWaitEvent"))?;
        }
        // From here copies from and into borrowed memory may be queued: the guard drains
        // the streams before this function returns, on every path.
        let _drain = DrainOnDrop {
            streams: lanes.iter().map(|&lane| self.stream(lane)).collect(),
        };
        self.ctx
            .bind_to_thread()
            .map_err(EngineError::cuda("binding the context"))?;
        let mut ends = Vec::with_capacity(2);
        if let Some((host, buffer)) = h2d {
            let stream = self.stream(Lane::H2d);
            // SAFETY: the device range is inside the live arena (checked owner); `host`
            // is borrowed for this whole call and the guard drains the stream before the
            // borrow ends.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    buffer.address(),
                    host.as_ptr().cast(),
                    host.len(),
                    stream.cu_stream(),
                )
            }
            .result()
            .map_err(EngineError::cuda("cuMemcpyHtoDAsync"))?;
            ends.push(self.record_timed_on(stream)?);
        }
        if let Some((buffer, host)) = d2h {
            let stream = self.stream(Lane::D2h);
            // SAFETY: as above; `host` is borrowed mutably for this whole call.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    host.as_mut_ptr().cast(),
                    buffer.address(),
                    host.len(),
                    stream.cu_stream(),
                )
            }
            .result()
            .map_err(EngineError::cuda("cuMemcpyDtoHAsync"))?;
            ends.push(self.record_timed_on(stream)?);
        }
        let mut longest_ms = 0.0f32;
        for end in &ends {
            let ms = start
                .elapsed_ms(end)
                .map_err(EngineError::cuda("cuEventElapsedTime"))?;
            longest_ms = longest_ms.max(ms);
        }
        Ok(Duration::from_secs_f64(f64::from(longest_ms) / 1e3))
    }

    fn timed_event(&self) -> Result<CudaEvent, EngineError> {
        self.ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(EngineError::cuda("cuEventCreate"))
    }

    fn record_timed_on(&self, stream: &CudaStream) -> Result<CudaEvent, EngineError> {
        let event = self.timed_event()?;
        event
            .record(stream)
            .map_err(EngineError::cuda("cuEventRecord"))?;
        Ok(event)
    }

    fn wait_events(&self, stream: &CudaStream, events: &[Event]) -> Result<(), EngineError> {
        for event in events {
            match event {
                Event::Cuda(e) => stream
                    .wait(&e.event)
                    .map_err(EngineError::cuda("cuStreamWaitEvent"))?,
                Event::Cpu(_) => {
                    return Err(EngineError::ForeignResource {
                        device: self.name.clone(),
                        what: "an event of the CPU device",
                    });
                }
            }
        }
        Ok(())
    }
}

impl DeviceOps for CudaDevice {
    /// The device's name in the engine (`cuda:0`).
    fn name(&self) -> &str {
        &self.name
    }

    /// How pinned pools for this device lock their memory: registered with the driver.
    fn pinning(&self) -> Pinning {
        Pinning::Cuda(Arc::clone(&self.ctx))
    }

    /// The device memory arena.
    fn arena(&self) -> &DeviceArena {
        &self.arena
    }

    fn target(&self) -> Target {
        Target::Cuda
    }

    /// Runs `program` on kernel stream `lane` (compute or update) after `after`, each
    /// tensor at the address of its binding plus its offset; the event (timed) completes
    /// with the last kernel.
    fn run_program(
        &self,
        lane: Lane,
        program: &Program,
        bindings: &Bindings,
        scalars: &Scalars,
        after: &[Event],
    ) -> Result<Event, EngineError> {
        let kernels = self.kernels.as_ref().ok_or(EngineError::Unsupported {
            device: self.name.clone(),
            what: "programs (it was opened for copies only, without NVRTC and cuBLAS)",
        })?;
        check_program(&self.arena, lane, program, bindings)?;
        let kernels = &kernels[usize::from(lane == Lane::Update)];
        let stream = self.stream(lane);
        self.wait_events(stream, after)?;
        self.ctx
            .bind_to_thread()
            .map_err(EngineError::cuda("binding the context"))?;
        let base = self.arena_base();
        for kernel in program.iter() {
            let address = |t: &TensorRef| {
                let r = bindings.get(t.buf).expect("bound (checked)");
                base + (r.offset_bytes + t.offset_bytes) as u64
            };
            // SAFETY: every tensor lies inside its bound range and every bound range inside
            // the arena's allocation (both checked above), which lives as long as
            // this device; the plan orders every other access to those ranges by events
            // the compute stream waited for above, and the kernel reads and writes only
            // its tensors.
            unsafe { kernels.run(kernel, scalars, &address) }.map_err(|source| {
                EngineError::Kernel {
                    kernel: kernel.name(),
                    source,
                }
            })?;
        }
        self.record(lane)
    }

    /// Copies `src` of `host` into `dst` on the host-to-device stream after `after`. The
    /// host arena is page-locked by this device (its pinning), so the copy is DMA; a
    /// conversion is refused (a GPU computes in the working dtype the host holds).
    fn copy_to_device(
        &self,
        host: &HostArena,
        src: HostRange,
        dst: DeviceRange,
        convert: Convert,
        after: &[Event],
    ) -> Result<Event, EngineError> {
        if let Some((from, to)) = convert
            && from != to
        {
            return Err(EngineError::Unsupported {
                device: self.name.clone(),
                what: "converting copies (host and device hold the same dtype on a GPU)",
            });
        }
        assert_eq!(
            src.len_bytes, dst.len_bytes,
            "a copy between ranges of equal length"
        );
        self.arena.check_range(dst.bytes())?;
        let host_ptr = host.address(src);
        let stream = self.stream(Lane::H2d);
        self.wait_events(stream, after)?;
        self.ctx
            .bind_to_thread()
            .map_err(EngineError::cuda("binding the context"))?;
        // SAFETY: the device range lies inside the arena's allocation (checked); the host
        // range inside the arena's page-locked mapping (checked by `address`), which the
        // caller keeps alive until this copy's event has completed.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                self.arena_base() + dst.offset_bytes as u64,
                host_ptr.cast(),
                dst.len_bytes,
                stream.cu_stream(),
            )
        }
        .result()
        .map_err(EngineError::cuda("cuMemcpyHtoDAsync"))?;
        self.copied[0].fetch_add(dst.len_bytes as u64, Ordering::Relaxed);
        self.record(Lane::H2d)
    }

    /// Copies `src` into `dst` of `host` on the device-to-host stream after `after`.
    fn copy_to_host(
        &self,
        src: DeviceRange,
        host: &HostArena,
        dst: HostRange,
        after: &[Event],
    ) -> Result<Event, EngineError> {
        assert_eq!(
            src.len_bytes, dst.len_bytes,
            "a copy between ranges of equal length"
        );
        self.arena.check_range(src.bytes())?;
        let host_ptr = host.address(dst);
        let stream = self.stream(Lane::D2h);
        self.wait_events(stream, after)?;
        self.ctx
            .bind_to_thread()
            .map_err(EngineError::cuda("binding the context"))?;
        // SAFETY: as in copy_to_device, the other way.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                host_ptr.cast(),
                self.arena_base() + src.offset_bytes as u64,
                src.len_bytes,
                stream.cu_stream(),
            )
        }
        .result()
        .map_err(EngineError::cuda("cuMemcpyDtoHAsync"))?;
        self.copied[1].fetch_add(src.len_bytes as u64, Ordering::Relaxed);
        self.record(Lane::D2h)
    }

    /// [`DeviceOps::all_gather`]: `ncclAllGather` on the update
    /// stream (after its AdamW, which wrote the shard), waited for.
    fn all_gather(
        &self,
        comm: &dyn Collective,
        src: DeviceRange,
        dst: DeviceRange,
    ) -> Result<(), EngineError> {
        assert_gather_lengths(comm, src, dst);
        self.arena.check_range(src.bytes())?;
        self.arena.check_range(dst.bytes())?;
        let base = self.arena_base();
        let stream = self.stream(Lane::Update);
        self.with_nccl(comm, |c| {
            // SAFETY: both ranges lie inside the arena (checked above) and do not overlap
            // (the plan's buffers); the collective lane waited for their writers.
            unsafe {
                nccl::result::all_gather(
                    (base + src.offset_bytes as u64) as *const c_void,
                    (base + dst.offset_bytes as u64) as *mut c_void,
                    src.len_bytes,
                    nccl::sys::ncclDataType_t::ncclUint8,
                    c,
                    stream.cu_stream() as nccl::sys::cudaStream_t,
                )
            }
            .map(|_| ())
            .map_err(|e| self.nccl_error("ncclAllGather", e))
        })?;
        self.record(Lane::Update)?.wait()
    }

    /// [`DeviceOps::reduce_scatter`]: every rank's chunk
    /// exchanged with `ncclSend`/`ncclRecv` into `scratch`, then folded in rank order by
    /// [`Kernel::FoldRanks`](strata_kernels::program::Kernel::FoldRanks) on the update
    /// stream, waited for. Not `ncclReduceScatter`, whose summation order NCCL picks.
    fn reduce_scatter(
        &self,
        comm: &dyn Collective,
        src: DeviceRange,
        dst: DeviceRange,
        scratch: Option<DeviceRange>,
        accumulate: bool,
    ) -> Result<(), EngineError> {
        assert_scatter_lengths(comm, src, dst);
        let scratch = scratch.ok_or_else(|| EngineError::Unsupported {
            device: self.name.clone(),
            what: "a reduce-scatter without scratch for every rank's chunk",
        })?;
        for r in [src, dst, scratch] {
            self.arena.check_range(r.bytes())?;
        }
        let (ranks, n) = (comm.size(), dst.len_bytes / 4);
        let base = self.arena_base();
        let stream = self.stream(Lane::Update);
        self.with_nccl(comm, |c| {
            let call = |what, r: Result<nccl::result::NcclStatus, nccl::result::NcclError>| {
                r.map(|_| ()).map_err(|e| self.nccl_error(what, e))
            };
            call("ncclGroupStart", nccl::result::group_start())?;
            for peer in 0..ranks {
                let at = (peer * dst.len_bytes) as u64;
                // SAFETY: chunk `peer` of `src` and of `scratch` lie inside them (each
                // `ranks` chunks long, checked inside the arena above); the collective
                // lane waited for `src`'s writers and nothing else uses `scratch`.
                let (sent, received) = unsafe {
                    (
                        nccl::result::send(
                            (base + src.offset_bytes as u64 + at) as *const c_void,
                            n,
                            nccl::sys::ncclDataType_t::ncclFloat32,
                            peer as c_int,
                            c,
                            stream.cu_stream() as nccl::sys::cudaStream_t,
                        ),
                        nccl::result::recv(
                            (base + scratch.offset_bytes as u64 + at) as *mut c_void,
                            n,
                            nccl::sys::ncclDataType_t::ncclFloat32,
                            peer as c_int,
                            c,
                            stream.cu_stream() as nccl::sys::cudaStream_t,
                        ),
                    )
                };
                call("ncclSend", sent)?;
                call("ncclRecv", received)?;
            }
            call("ncclGroupEnd", nccl::result::group_end())
        })?;
        let program: Program = vec![Kernel::FoldRanks(FoldRanks {
            acc: TensorRef::new(0, 0, n, Dtype::F32),
            chunks: TensorRef::new(1, 0, ranks * n, Dtype::F32),
            ranks,
            accumulate,
        })]
        .into();
        let mut bindings = Bindings::default();
        bindings.set(0, dst);
        bindings.set(1, scratch);
        self.run_program(Lane::Update, &program, &bindings, &Scalars::default(), &[])?
            .wait()
    }

    /// Bytes copied host to device and device to host so far.
    fn copied_bytes(&self) -> [u64; 2] {
        [
            self.copied[0].load(Ordering::Relaxed),
            self.copied[1].load(Ordering::Relaxed),
        ]
    }

    /// Empty: the GPU's kernels run asynchronously and are not timed one by one.
    fn kernel_times(&self) -> KernelTimes {
        KernelTimes::default()
    }

    /// Copies the first `dst.len_bytes()` bytes of the slot into `dst` on the
    /// host-to-device stream, after `after`. The slot stays with the returned
    /// [`Transfer`] until the copy has completed.
    fn copy_h2d(
        &self,
        dst: &DeviceBuffer,
        src: SlotLease,
        after: &[Event],
    ) -> Result<Transfer, EngineError> {
        self.copy(Lane::H2d, dst, src, after)
    }

    /// Copies `src` into the start of the slot on the device-to-host stream, after
    /// `after`. [`Transfer::wait`] hands the slot back once it holds the data.
    fn copy_d2h(
        &self,
        dst: SlotLease,
        src: &DeviceBuffer,
        after: &[Event],
    ) -> Result<Transfer, EngineError> {
        self.copy(Lane::D2h, src, dst, after)
    }

    /// A timed event that completes when everything queued on `lane` so far has.
    fn record(&self, lane: Lane) -> Result<Event, EngineError> {
        let event = self.events[1].take(&self.ctx)?;
        event
            .record(self.stream(lane))
            .map_err(EngineError::cuda("cuEventRecord"))?;
        Ok(Event::Cuda(CudaEventRef {
            event,
            lane,
            timed: true,
        }))
    }

    /// Makes everything queued on `lane` from now on wait for `events` (on the GPU; the
    /// host does not block).
    fn wait_for(&self, lane: Lane, events: &[Event]) -> Result<(), EngineError> {
        self.wait_events(self.stream(lane), events)
    }

    /// Blocks until every stream has finished everything queued so far.
    fn synchronize(&self) -> Result<(), EngineError> {
        for stream in &self.streams {
            synchronize_stream(stream).map_err(EngineError::cuda("cuStreamSynchronize"))?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("name", &self.name)
            .field("gpu_name", &self.gpu_name)
            .field("arena", &self.arena)
            .finish()
    }
}

/// Whether CUDA can be used, for kernels or only for memory and copies, and if not why.
pub(crate) fn cuda_usable(
    needs_kernels: bool,
) -> Result<(), strata_kernels::cuda::CudaUnavailable> {
    let libraries = strata_kernels::cuda::probe();
    if needs_kernels {
        libraries.require_all()
    } else {
        libraries.require_driver()
    }
}

fn synchronize_stream(stream: &CudaStream) -> Result<(), DriverError> {
    retry_once("cuStreamSynchronize", || stream.synchronize())
}

/// Returns `slot` to its pool once `stream` has drained; if the driver cannot say that it
/// has, the slot is leaked rather than reused under a copy.
fn release_after_stream(stream: &CudaStream, slot: SlotLease) {
    match synchronize_stream(stream) {
        Ok(()) => drop(slot),
        Err(e) => {
            log::error!(
                "could not confirm a copy on slot {} of pool '{}' finished ({e}); the slot is \
                 leaked rather than reused",
                slot.index(),
                slot.pool_name()
            );
            std::mem::forget(slot);
        }
    }
}

/// Drains streams that copies from or into borrowed host memory were queued on.
struct DrainOnDrop<'a> {
    streams: Vec<&'a Arc<CudaStream>>,
}

impl Drop for DrainOnDrop<'_> {
    fn drop(&mut self) {
        for stream in &self.streams {
            if let Err(e) = synchronize_stream(stream) {
                // The borrowed host memory may still be in use by a copy, and the caller
                // is about to get it back: the only safe way out is to stop.
                eprintln!("strata: fatal: could not drain a copy stream ({e}); aborting");
                std::process::abort();
            }
        }
    }
}
