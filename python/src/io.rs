//! `strata.io`: the NVMe tier's tensor store from Python. A tensor is written to (read
//! from) an extent named by a string; each transfer returns a handle to wait on, with the
//! GIL released while it waits.
//!
//! A transfer uses the tensor's memory itself when O_DIRECT allows it: memory from
//! [`Store::pinned_empty`] (page-locked, registered with io_uring as fixed buffers,
//! padded to 4096 bytes), or any tensor that starts on a 4096-byte boundary and whose
//! size is a multiple of 4096. Other tensors go through an aligned bounce buffer: a copy
//! on the caller's thread before a write, on the waiting thread after a read.
//!
//! This module does not decide where extents go (the store does) and keeps no tensor
//! alive beyond its transfer.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};

use pyo3::exceptions::{PyKeyError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use strata::machine::swap_folder_refusal;
use strata_engine::EngineError;
use strata_engine::memory::{PinnedPool, PinnedPoolConfig, Pinning, SlotLease};
use strata_storage::{
    AlignedBuf, BackendChoice, DIRECT_IO_ALIGN, ExtentId, IoBuf, Pending, StorageError,
    StoreConfig, TensorStore,
};

use crate::view::{View, view, view_mut};

/// The memory one transfer owns while it is in flight.
enum Buf {
    /// A caller's tensor, used in place; the object keeps its memory alive.
    Tensor {
        addr: usize,
        capacity_bytes: usize,
        _owner: Py<PyAny>,
    },
    /// An aligned copy of a tensor that O_DIRECT cannot use in place.
    Bounce(AlignedBuf),
}

// SAFETY: `Tensor`'s address is the tensor's memory, which does not move while its owner
// (held here) lives, is valid for `capacity_bytes` (checked by `view` and, for padded
// pinned memory, by the pinned region's bounds), and the Python API documents that a
// tensor must not be used while its transfer is in flight. `Bounce` is AlignedBuf's
// contract. Py<PyAny> is Send.
unsafe impl IoBuf for Buf {
    fn as_ptr(&self) -> *const u8 {
        match self {
            Buf::Tensor { addr, .. } => *addr as *const u8,
            Buf::Bounce(b) => b.as_ptr(),
        }
    }

    fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            Buf::Tensor { addr, .. } => *addr as *mut u8,
            Buf::Bounce(b) => b.as_mut_ptr(),
        }
    }

    fn capacity_bytes(&self) -> usize {
        match self {
            Buf::Tensor { capacity_bytes, .. } => *capacity_bytes,
            Buf::Bounce(b) => IoBuf::capacity_bytes(b),
        }
    }
}

/// A transfer not yet waited for; after a bounced read, where to copy the bytes.
struct Transfer {
    pending: Pending<Buf>,
    name: String,
    copy_to: Option<(usize, usize, Py<PyAny>)>,
}

type Slot = Arc<Mutex<Option<Transfer>>>;

/// One transfer; `wait()` returns when it is done and raises its error.
#[pyclass(module = "strata._native")]
pub struct Handle {
    slot: Slot,
    name: String,
}

fn finish(py: Python<'_>, transfer: Transfer) -> PyResult<()> {
    let Transfer {
        pending,
        name,
        copy_to,
    } = transfer;
    let (result, buf) = py.detach(move || pending.wait());
    result.map_err(|e| storage_error(e, &name))?;
    if let (Some((addr, len, _owner)), Buf::Bounce(bounce)) = (copy_to, &buf) {
        let src = bounce.as_slice()[..len].as_ptr() as usize;
        py.detach(move || {
            // SAFETY: `addr` is the checked, writable memory of the read's target, at
            // least `len` bytes (checked when the read started), kept alive by `_owner`;
            // the bounce buffer is ours and holds at least `len` bytes.
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, addr as *mut u8, len) }
        });
    }
    Ok(())
}

#[pymethods]
impl Handle {
    /// Waits for the transfer; raises its error (once). Waiting again does nothing.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        let transfer = self.slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        match transfer {
            Some(t) => finish(py, t),
            None => Ok(()),
        }
    }

    /// Whether the transfer has ended (so `wait()` will not block).
    fn done(&self) -> bool {
        self.slot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_none_or(|t| t.pending.is_complete())
    }

    /// The extent's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    fn __repr__(&self) -> String {
        format!("<strata.io handle for '{}'>", self.name)
    }
}

/// Page-locked memory registered with a store; numpy sees it through
/// `__array_interface__` (so does torch, through numpy).
#[pyclass(module = "strata._native")]
pub struct PinnedBuffer {
    lease: SlotLease,
    /// The pool of this one slot; the store sees it through a weak reference, so the
    /// memory (and its registration) goes when the last array viewing it goes.
    _pool: Arc<PinnedPool>,
    #[pyo3(get)]
    len_bytes: usize,
    typestr: String,
    shape: Vec<usize>,
}

#[pymethods]
impl PinnedBuffer {
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let d = pyo3::types::PyDict::new(py);
        d.set_item("version", 3)?;
        d.set_item("shape", pyo3::types::PyTuple::new(py, &self.shape)?)?;
        d.set_item("typestr", &self.typestr)?;
        d.set_item("data", (self.lease.as_ptr() as usize, false))?;
        Ok(d.into_any())
    }

    /// Whether the memory is page-locked (mlock was granted).
    #[getter]
    fn locked(&self) -> bool {
        matches!(
            self.lease.locking(),
            strata_engine::memory::HostLocking::Mlocked
                | strata_engine::memory::HostLocking::CudaRegistered
        )
    }
}

struct Pinned {
    start: usize,
    end: usize,
    /// Alive while some array views the memory.
    pool: Weak<PinnedPool>,
}

/// An NVMe store over one or more folders.
#[pyclass(module = "strata._native")]
pub struct Store {
    store: TensorStore,
    extents: Mutex<HashMap<String, ExtentId>>,
    in_flight: Mutex<Vec<Slot>>,
    pinned: Mutex<Vec<Pinned>>,
}

#[pymethods]
impl Store {
    #[new]
    #[pyo3(signature = (paths, capacity_bytes, queue_depth, block_bytes, checksums, backend))]
    fn new(
        py: Python<'_>,
        paths: Vec<PathBuf>,
        capacity_bytes: u64,
        queue_depth: usize,
        block_bytes: usize,
        checksums: bool,
        backend: &str,
    ) -> PyResult<Self> {
        if paths.is_empty() {
            return Err(PyValueError::new_err("strata.io needs at least one path"));
        }
        // The rule `strata train` applies to its swap folders, with its words.
        if let Some(why) = paths.iter().find_map(|p| swap_folder_refusal(p)) {
            return Err(PyValueError::new_err(why));
        }
        let mut config = StoreConfig::new(paths[0].clone(), capacity_bytes);
        config.dirs = paths;
        config.queue_depth = queue_depth;
        config.block_bytes = block_bytes;
        config.checksums = checksums;
        config.backend = match backend {
            "auto" => BackendChoice::Auto,
            "io_uring" => BackendChoice::Uring,
            "threads" => BackendChoice::Threads,
            other => {
                return Err(PyValueError::new_err(format!(
                    "backend '{other}' is not one of auto, io_uring, threads"
                )));
            }
        };
        let store = py
            .detach(move || TensorStore::create(config))
            .map_err(|e| storage_error(e, ""))?;
        Ok(Store {
            store,
            extents: Mutex::new(HashMap::new()),
            in_flight: Mutex::new(Vec::new()),
            pinned: Mutex::new(Vec::new()),
        })
    }

    /// Starts writing `tensor` to the extent `name` (created, or replaced when its size
    /// changed).
    fn write(&self, py: Python<'_>, name: &str, tensor: &Bound<'_, PyAny>) -> PyResult<Handle> {
        let v = view(tensor, "the tensor to write")?;
        if v.nbytes() == 0 {
            return Err(PyValueError::new_err(format!(
                "the tensor to write to '{name}' is empty"
            )));
        }
        let id = self.extent_for_write(name, v.nbytes() as u64)?;
        let buf = match self.in_place(&v) {
            Some(capacity_bytes) => Buf::Tensor {
                addr: v.addr,
                capacity_bytes,
                _owner: tensor.clone().unbind(),
            },
            None => {
                let (addr, len) = (v.addr, v.nbytes());
                let bounce = py.detach(move || {
                    let mut b = AlignedBuf::zeroed(len.next_multiple_of(DIRECT_IO_ALIGN));
                    // SAFETY: `addr` is the checked memory of `tensor` (len bytes), alive
                    // for this call, which borrows it.
                    let src = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
                    b.as_mut_slice()[..len].copy_from_slice(src);
                    b
                });
                Buf::Bounce(bounce)
            }
        };
        let pending = self.store.write(id, buf);
        Ok(self.track(name, pending, None))
    }

    /// Starts reading the extent `name` into `out` (at least the extent's size).
    fn read(&self, py: Python<'_>, name: &str, out: &Bound<'_, PyAny>) -> PyResult<Handle> {
        let v = view_mut(out, "the tensor to read into")?;
        let id = self
            .extents
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .copied()
            .ok_or_else(|| {
                PyKeyError::new_err(format!("nothing named '{name}' was written to this store"))
            })?;
        let len = self
            .store
            .info(id)
            .map_err(|e| storage_error(e, name))?
            .len_bytes as usize;
        if v.nbytes() < len {
            return Err(PyValueError::new_err(format!(
                "'{name}' holds {len} bytes; the tensor to read into has only {} bytes",
                v.nbytes()
            )));
        }
        let owner = out.clone().unbind();
        let (buf, copy_to) = match self.in_place(&v) {
            Some(capacity_bytes) if capacity_bytes >= len.next_multiple_of(DIRECT_IO_ALIGN) => (
                Buf::Tensor {
                    addr: v.addr,
                    capacity_bytes,
                    _owner: owner,
                },
                None,
            ),
            _ => {
                let bounce =
                    py.detach(move || AlignedBuf::zeroed(len.next_multiple_of(DIRECT_IO_ALIGN)));
                (Buf::Bounce(bounce), Some((v.addr, len, owner)))
            }
        };
        let pending = self.store.read(id, buf);
        Ok(self.track(name, pending, copy_to))
    }

    /// Waits for every transfer started and not yet waited for; raises the first error
    /// after waiting for all.
    fn wait_all(&self, py: Python<'_>) -> PyResult<()> {
        let slots: Vec<Slot> =
            std::mem::take(&mut *self.in_flight.lock().unwrap_or_else(|e| e.into_inner()));
        let mut first = None;
        for slot in slots {
            let transfer = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(t) = transfer
                && let Err(e) = finish(py, t)
            {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Page-locked memory of `len_bytes` (padded to 4096), registered with this store's
    /// io_uring as fixed buffers, seen as `shape` of `typestr` (numpy's type string).
    fn pinned_empty(
        &self,
        py: Python<'_>,
        len_bytes: usize,
        typestr: String,
        shape: Vec<usize>,
    ) -> PyResult<PinnedBuffer> {
        let slot_bytes = len_bytes.max(1).next_multiple_of(DIRECT_IO_ALIGN);
        let config = PinnedPoolConfig {
            name: "strata.io pinned_empty".into(),
            budget_bytes: slot_bytes,
            slot_bytes,
            acquire_timeout: std::time::Duration::from_secs(1),
        };
        let store = self.store.clone();
        let (pool, lease) = py
            .detach(move || {
                let pool = PinnedPool::new(config, &Pinning::Mlock)?;
                pool.register_with(&store)?;
                let lease = pool.acquire()?;
                Ok::<_, EngineError>((pool, lease))
            })
            .map_err(pinned_error)?;
        let start = lease.as_ptr() as usize;
        let pool = Arc::new(pool);
        let mut pinned = self.pinned.lock().unwrap_or_else(|e| e.into_inner());
        pinned.retain(|p| p.pool.strong_count() > 0);
        pinned.push(Pinned {
            start,
            end: start + slot_bytes,
            pool: Arc::downgrade(&pool),
        });
        Ok(PinnedBuffer {
            lease,
            _pool: pool,
            len_bytes,
            typestr,
            shape,
        })
    }

    /// The I/O backend in use (`io_uring` or `threads`).
    #[getter]
    fn backend(&self) -> &'static str {
        self.store.backend().name()
    }

    /// Whether the swap files bypass the page cache.
    #[getter]
    fn direct_io(&self) -> bool {
        self.store.direct_io()
    }

    /// Whether checksums are written and verified.
    #[getter]
    fn checksums(&self) -> bool {
        self.store.checksums()
    }

    /// The swap files' paths.
    #[getter]
    fn files(&self) -> Vec<PathBuf> {
        self.store.paths()
    }

    /// The names written so far.
    fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .extents
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect();
        names.sort();
        names
    }

    /// Chunks that went through registered (fixed) buffers, and through plain ones.
    fn io_counters(&self) -> (u64, u64) {
        let c = self.store.io_counters();
        (c.fixed_chunks, c.plain_chunks)
    }
}

impl Store {
    /// The bytes usable in place from `v`'s start, when O_DIRECT can use its memory
    /// directly: inside pinned memory of this store (up to its padded end), or aligned
    /// and a whole number of 4096-byte blocks.
    fn in_place(&self, v: &View) -> Option<usize> {
        if !v.addr.is_multiple_of(DIRECT_IO_ALIGN) {
            return None;
        }
        let pinned = self.pinned.lock().unwrap_or_else(|e| e.into_inner());
        let live = |p: &&Pinned| p.pool.strong_count() > 0;
        if let Some(p) = pinned
            .iter()
            .filter(live)
            .find(|p| p.start <= v.addr && v.addr < p.end)
        {
            return Some(p.end - v.addr);
        }
        v.nbytes()
            .is_multiple_of(DIRECT_IO_ALIGN)
            .then_some(v.nbytes())
    }

    fn extent_for_write(&self, name: &str, len_bytes: u64) -> PyResult<ExtentId> {
        let mut extents = self.extents.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&id) = extents.get(name) {
            let info = self.store.info(id).map_err(|e| storage_error(e, name))?;
            if info.len_bytes == len_bytes {
                return Ok(id);
            }
            self.store.free(id).map_err(|e| storage_error(e, name))?;
            extents.remove(name);
        }
        let id = self
            .store
            .allocate(name, len_bytes)
            .map_err(|e| storage_error(e, name))?;
        extents.insert(name.to_string(), id);
        Ok(id)
    }

    fn track(
        &self,
        name: &str,
        pending: Pending<Buf>,
        copy_to: Option<(usize, usize, Py<PyAny>)>,
    ) -> Handle {
        let slot = Arc::new(Mutex::new(Some(Transfer {
            pending,
            name: name.to_string(),
            copy_to,
        })));
        let mut in_flight = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        // Forget transfers already waited for through their handle.
        in_flight.retain(|s| s.lock().unwrap_or_else(|e| e.into_inner()).is_some());
        in_flight.push(Arc::clone(&slot));
        Handle {
            slot,
            name: name.to_string(),
        }
    }
}

/// A storage error as the Python exception that fits: OSError with the errno and the
/// file for failed system calls, KeyError for unknown names, ValueError for bad input.
fn storage_error(e: StorageError, name: &str) -> PyErr {
    let message = e.to_string();
    match &e {
        StorageError::Io { path, errno, .. } => {
            PyOSError::new_err((errno.0, message, path.display().to_string()))
        }
        StorageError::File { path, source, .. } => PyOSError::new_err((
            source.raw_os_error().unwrap_or(0),
            message,
            path.display().to_string(),
        )),
        StorageError::InsufficientSpace { path, .. } => {
            PyOSError::new_err((libc_enospc(), message, path.display().to_string()))
        }
        StorageError::Register { errno, .. } => PyOSError::new_err((errno.0, message)),
        StorageError::NoSuchExtent(_) => PyKeyError::new_err(message),
        StorageError::Config(_) | StorageError::BadBuffer { .. } => PyValueError::new_err(message),
        StorageError::ExtentBusy { .. } | StorageError::ExtentExists(_) => {
            PyRuntimeError::new_err(message)
        }
        _ if name.is_empty() => PyOSError::new_err(message),
        _ => PyOSError::new_err(format!("{message} (extent '{name}')")),
    }
}

/// A failure to make pinned memory: OSError with the errno for what the system refused
/// (the mapping, the registration with io_uring), RuntimeError for the rest.
fn pinned_error(e: EngineError) -> PyErr {
    let message = format!("pinned_empty: {e}");
    match e {
        EngineError::HostMemory { source, .. } => {
            PyOSError::new_err((source.raw_os_error().unwrap_or(0), message))
        }
        EngineError::Storage(e) => storage_error(e, ""),
        _ => PyRuntimeError::new_err(message),
    }
}

fn libc_enospc() -> i32 {
    28
}
