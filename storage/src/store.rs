//! `TensorStore`: named extents over one or more swap files, checksummed.
//!
//! The store lays one logical address space over its swap files, striped in fixed-size
//! stripes when there are several (several folders = several drives, read and written
//! in parallel). An extent is a named, 4096-aligned range of that space; it is written
//! and read whole, by passing a buffer in and getting it back from [`Pending::wait`]
//! with the result, also on error. A crc32c of each extent is computed as it is written
//! and checked on every read; an extent whose last write failed, or that was never
//! written, cannot be read. Different extents may be read and written concurrently;
//! conflicting uses of one extent (two writes, or a write beside a read) are refused.
//!
//! What this module does not do: decide what goes where (the engine's planner does),
//! or own the buffers' memory (callers do; see [`crate::IoBuf`]).

use std::collections::HashMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use crate::buffer::{DIRECT_IO_ALIGN, IoBuf, IoRegion};
use crate::crc;
use crate::error::StorageError;
use crate::file::{self, DirectIo, SwapFile};
use crate::io::faulty::{FaultPlan, FaultySyscalls};
use crate::io::threads::{Posix, ThreadIo};
use crate::io::uring::UringIo;
use crate::io::{
    Backend, BackendChoice, BackendKind, FileTable, GroupPool, IoStats, OpGroup, OpKind, RawOp,
    probe_uring, resolve_backend,
};

/// How a store is laid out and driven. Start from [`StoreConfig::new`].
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Folders for the swap files, one file each (several folders = several drives).
    pub dirs: Vec<PathBuf>,
    /// Bytes the extents may take in all.
    pub capacity_bytes: u64,
    /// With several folders, the logical space alternates between files every
    /// `stripe_bytes` (a multiple of 4096).
    pub stripe_bytes: u64,
    /// Transfers are split into chunks of at most this many bytes (a multiple of 4096).
    pub block_bytes: usize,
    /// At most this many chunks are in flight.
    pub queue_depth: usize,
    /// Which I/O backend to use.
    pub backend: BackendChoice,
    /// Whether to compute a crc32c per extent on write and verify it on read.
    pub checksums: bool,
    /// Whether to bypass the page cache.
    pub direct_io: DirectIo,
    /// The files' name stem (`<stem>.<i>.swap`); required to persist.
    pub name: Option<String>,
    /// Keep the files (and write a manifest) when the store is dropped.
    pub persist: bool,
    /// Run on the fault-injecting backend instead (tests).
    pub faults: Option<FaultPlan>,
}

impl StoreConfig {
    /// A store of `capacity_bytes` in `dir`, with the defaults: 1 MiB blocks, queue
    /// depth 32, 4 MiB stripes, backend chosen automatically, checksums on, O_DIRECT
    /// where possible, files removed on drop.
    pub fn new(dir: impl Into<PathBuf>, capacity_bytes: u64) -> Self {
        Self {
            dirs: vec![dir.into()],
            capacity_bytes,
            stripe_bytes: 4 << 20,
            block_bytes: 1 << 20,
            queue_depth: 32,
            backend: BackendChoice::Auto,
            checksums: true,
            direct_io: DirectIo::Auto,
            name: None,
            persist: false,
            faults: None,
        }
    }

    fn validate(&self) -> Result<(), StorageError> {
        let bad = |m: String| Err(StorageError::Config(m));
        let align = DIRECT_IO_ALIGN as u64;
        if self.dirs.is_empty() {
            return bad("at least one folder is needed for swap files".into());
        }
        if self.capacity_bytes == 0 {
            return bad("the capacity must be more than zero bytes".into());
        }
        if self.block_bytes == 0 || !self.block_bytes.is_multiple_of(DIRECT_IO_ALIGN) {
            return bad(format!(
                "block size {} is not a positive multiple of {DIRECT_IO_ALIGN}",
                self.block_bytes
            ));
        }
        if self.block_bytes > 256 << 20 {
            return bad(format!("block size {} exceeds 256 MiB", self.block_bytes));
        }
        if self.stripe_bytes == 0 || !self.stripe_bytes.is_multiple_of(align) {
            return bad(format!(
                "stripe size {} is not a positive multiple of {align}",
                self.stripe_bytes
            ));
        }
        if !(1..=4096).contains(&self.queue_depth) {
            return bad(format!(
                "queue depth {} is outside 1..=4096",
                self.queue_depth
            ));
        }
        if self.persist && self.name.is_none() {
            return bad("a persisted store needs a name for its files".into());
        }
        if let Some(name) = &self.name
            && (name.is_empty() || name.contains('/') || name.contains('\0'))
        {
            return bad(format!("'{name}' cannot be used as a file name"));
        }
        if self.faults.is_some() && self.backend == BackendChoice::Uring {
            return bad("fault injection runs on the threaded backend, not io_uring".into());
        }
        Ok(())
    }
}

/// Identifies an extent; stale once the extent is freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExtentId {
    index: u32,
    generation: u32,
}

/// What the store knows about an extent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtentInfo {
    /// Its name.
    pub name: String,
    /// Its length in bytes.
    pub len_bytes: u64,
    /// The bytes it takes in the swap files (its length rounded up to 4096).
    pub allocated_bytes: u64,
    /// Whether its last write succeeded (it can be read).
    pub readable: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum ExtentState {
    Unwritten,
    Written,
    WriteFailed,
}

#[derive(Debug)]
struct Extent {
    name: String,
    offset_bytes: u64,
    len_bytes: u64,
    allocated_bytes: u64,
    state: ExtentState,
    crc: Option<u32>,
    /// The length and checksum of a head the last write also checksummed on its own
    /// ([`TensorStore::write_with_head`]).
    head: Option<(u64, Option<u32>)>,
    readers: u32,
    writing: bool,
    /// Whether a write to it ever started (its bytes on the drive hold data).
    used: bool,
}

#[derive(Debug, Default)]
struct Table {
    slots: Vec<(u32, Option<Extent>)>,
    free_indexes: Vec<u32>,
    by_name: HashMap<String, u32>,
    /// Free runs of the logical space as (start, length), sorted, never adjacent.
    free_runs: Vec<(u64, u64)>,
    /// Allocated bytes of the live extents that were ever written to.
    used_bytes: u64,
    /// The most `used_bytes` ever were.
    used_high_water_bytes: u64,
}

impl Table {
    fn get(&self, id: ExtentId) -> Option<&Extent> {
        match self.slots.get(id.index as usize) {
            Some((generation, Some(extent))) if *generation == id.generation => Some(extent),
            _ => None,
        }
    }

    fn get_mut(&mut self, id: ExtentId) -> Option<&mut Extent> {
        match self.slots.get_mut(id.index as usize) {
            Some((generation, Some(extent))) if *generation == id.generation => Some(extent),
            _ => None,
        }
    }

    fn insert(&mut self, extent: Extent) -> ExtentId {
        let name = extent.name.clone();
        let index = match self.free_indexes.pop() {
            Some(index) => {
                let slot = &mut self.slots[index as usize];
                slot.0 += 1;
                slot.1 = Some(extent);
                index
            }
            None => {
                self.slots.push((0, Some(extent)));
                u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 extents")
            }
        };
        self.by_name.insert(name, index);
        ExtentId {
            index,
            generation: self.slots[index as usize].0,
        }
    }

    /// First fit: the lowest free run that holds `len` bytes.
    fn take_space(&mut self, len: u64) -> Option<u64> {
        let i = self.free_runs.iter().position(|&(_, l)| l >= len)?;
        let (start, run) = self.free_runs[i];
        if run == len {
            self.free_runs.remove(i);
        } else {
            self.free_runs[i] = (start + len, run - len);
        }
        Some(start)
    }

    fn give_back(&mut self, start: u64, len: u64) {
        let i = self.free_runs.partition_point(|&(s, _)| s < start);
        self.free_runs.insert(i, (start, len));
        // Merge with the next run, then with the previous one.
        if i + 1 < self.free_runs.len() && start + len == self.free_runs[i + 1].0 {
            self.free_runs[i].1 += self.free_runs[i + 1].1;
            self.free_runs.remove(i + 1);
        }
        if i > 0 && self.free_runs[i - 1].0 + self.free_runs[i - 1].1 == start {
            self.free_runs[i - 1].1 += self.free_runs[i].1;
            self.free_runs.remove(i);
        }
    }

    fn free_bytes(&self) -> u64 {
        self.free_runs.iter().map(|r| r.1).sum()
    }
}

struct Inner {
    // Declared before `files`: the backend (and its threads) must stop before the files
    // close.
    backend: Box<dyn Backend>,
    files: Vec<SwapFile>,
    table: Mutex<Table>,
    capacity_bytes: u64,
    stripe_bytes: u64,
    checksums: bool,
    all_direct: bool,
    manifest_path: Option<PathBuf>,
    /// The transfers' completion groups, reused.
    groups: GroupPool,
}

/// Named, checksummed extents over one or more swap files. Cheap to clone: clones share
/// the files.
#[derive(Clone)]
pub struct TensorStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for TensorStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorStore")
            .field("backend", &self.inner.backend.kind())
            .field("files", &self.paths())
            .field("capacity_bytes", &self.inner.capacity_bytes)
            .finish()
    }
}

fn default_stem() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    format!(
        "strata-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// How the logical space maps to files: bytes per file for a capacity.
fn file_bytes(capacity_bytes: u64, stripe_bytes: u64, file_count: usize) -> u64 {
    let align = DIRECT_IO_ALIGN as u64;
    if file_count == 1 {
        return capacity_bytes.next_multiple_of(align);
    }
    let stripes = capacity_bytes.div_ceil(stripe_bytes);
    stripes.div_ceil(file_count as u64) * stripe_bytes
}

fn start_backend(
    choice: BackendChoice,
    faults: Option<FaultPlan>,
    files: FileTable,
    block_bytes: usize,
    queue_depth: usize,
) -> Result<Box<dyn Backend>, StorageError> {
    if let Some(plan) = faults {
        let io = ThreadIo::start(FaultySyscalls::new(plan), files, block_bytes, queue_depth)?;
        return Ok(Box::new(io));
    }
    let probe = match choice {
        BackendChoice::Threads => Ok(()),
        _ => probe_uring(),
    };
    Ok(match resolve_backend(choice, &probe)? {
        BackendKind::Uring => Box::new(UringIo::start(files, block_bytes, queue_depth)?),
        _ => Box::new(ThreadIo::start(Posix, files, block_bytes, queue_depth)?),
    })
}

impl TensorStore {
    /// Creates the swap files (checking free space first) and starts the I/O backend.
    pub fn create(config: StoreConfig) -> Result<Self, StorageError> {
        config.validate()?;
        let file_count = config.dirs.len();
        let stripe_bytes = if file_count == 1 {
            config
                .capacity_bytes
                .next_multiple_of(DIRECT_IO_ALIGN as u64)
        } else {
            config.stripe_bytes
        };
        let per_file = file_bytes(config.capacity_bytes, stripe_bytes, file_count);
        let plan: Vec<(PathBuf, u64)> = config.dirs.iter().map(|d| (d.clone(), per_file)).collect();
        file::check_free_space(&plan)?;

        let stem = config.name.clone().unwrap_or_else(default_stem);
        let mut files = Vec::with_capacity(file_count);
        for (i, dir) in config.dirs.iter().enumerate() {
            let path = dir.join(format!("{stem}.{i}.swap"));
            let name = if config.persist {
                file::Name::Kept
            } else {
                file::Name::Unlinked
            };
            let mut swap = file::create(&path, per_file, config.direct_io, name)?;
            // A persisted store's files outlive it; the others have no name left.
            swap.remove_on_drop = false;
            files.push(swap);
        }
        let manifest_path = config
            .persist
            .then(|| config.dirs[0].join(format!("{stem}.manifest.json")));
        let capacity_bytes = config
            .capacity_bytes
            .next_multiple_of(DIRECT_IO_ALIGN as u64);
        let table = Table {
            free_runs: vec![(0, capacity_bytes)],
            ..Table::default()
        };
        Self::start(
            config,
            files,
            table,
            capacity_bytes,
            stripe_bytes,
            manifest_path,
        )
    }

    fn start(
        config: StoreConfig,
        files: Vec<SwapFile>,
        table: Table,
        capacity_bytes: u64,
        stripe_bytes: u64,
        manifest_path: Option<PathBuf>,
    ) -> Result<Self, StorageError> {
        use std::os::fd::AsRawFd;
        let table_files = FileTable {
            fds: files.iter().map(|f| f.file.as_raw_fd()).collect(),
            paths: files.iter().map(|f| f.path.clone()).collect(),
        };
        let backend = start_backend(
            config.backend,
            config.faults,
            table_files,
            config.block_bytes,
            config.queue_depth,
        )?;
        let all_direct = files.iter().all(|f| f.direct);
        Ok(Self {
            inner: Arc::new(Inner {
                backend,
                files,
                table: Mutex::new(table),
                capacity_bytes,
                stripe_bytes,
                checksums: config.checksums,
                all_direct,
                manifest_path,
                groups: GroupPool::default(),
            }),
        })
    }

    /// Opens a store persisted earlier, from the manifest [`TensorStore::save_manifest`]
    /// wrote. `config` gives the I/O settings (its folders, capacity and name are taken
    /// from the manifest).
    pub fn open(manifest_path: &Path, config: StoreConfig) -> Result<Self, StorageError> {
        let manifest_error = |reason: String| StorageError::Manifest {
            path: manifest_path.to_path_buf(),
            reason,
        };
        let text = std::fs::read_to_string(manifest_path).map_err(|source| StorageError::File {
            action: "cannot read store manifest",
            path: manifest_path.to_path_buf(),
            source,
        })?;
        let manifest: Manifest =
            serde_json::from_str(&text).map_err(|e| manifest_error(e.to_string()))?;
        if manifest.format != MANIFEST_FORMAT {
            return Err(manifest_error(format!(
                "format '{}' is not '{MANIFEST_FORMAT}'",
                manifest.format
            )));
        }
        if manifest.files.is_empty() {
            return Err(manifest_error("it lists no swap files".into()));
        }
        let config = StoreConfig {
            dirs: manifest
                .files
                .iter()
                .map(|f| f.path.parent().map(Path::to_path_buf).unwrap_or_default())
                .collect(),
            capacity_bytes: manifest.capacity_bytes,
            persist: true,
            ..config
        };
        config.validate()?;
        let mut files = Vec::new();
        for f in &manifest.files {
            files.push(file::open_existing(&f.path, f.len_bytes, config.direct_io)?);
        }
        let mut table = Table::default();
        let mut used: Vec<(u64, u64)> = Vec::new();
        for e in &manifest.extents {
            let allocated_bytes = e.len_bytes.next_multiple_of(DIRECT_IO_ALIGN as u64);
            if e.offset_bytes % DIRECT_IO_ALIGN as u64 != 0
                || e.offset_bytes + allocated_bytes > manifest.capacity_bytes
            {
                return Err(manifest_error(format!(
                    "extent '{}' lies outside the store",
                    e.name
                )));
            }
            if table.by_name.contains_key(&e.name) {
                return Err(manifest_error(format!(
                    "extent '{}' is listed twice",
                    e.name
                )));
            }
            let state = e.state;
            used.push((e.offset_bytes, allocated_bytes));
            table.insert(Extent {
                name: e.name.clone(),
                offset_bytes: e.offset_bytes,
                len_bytes: e.len_bytes,
                allocated_bytes,
                state,
                crc: e.crc32c,
                head: None,
                readers: 0,
                writing: false,
                used: state != ExtentState::Unwritten,
            });
            if state != ExtentState::Unwritten {
                table.used_bytes += allocated_bytes;
            }
        }
        table.used_high_water_bytes = table.used_bytes;
        used.sort_unstable();
        let mut cursor = 0;
        for (start, len) in used {
            if start < cursor {
                return Err(manifest_error(format!("extents overlap at byte {start}")));
            }
            if start > cursor {
                table.free_runs.push((cursor, start - cursor));
            }
            cursor = start + len;
        }
        if cursor < manifest.capacity_bytes {
            table
                .free_runs
                .push((cursor, manifest.capacity_bytes - cursor));
        }
        Self::start(
            config,
            files,
            table,
            manifest.capacity_bytes,
            manifest.stripe_bytes,
            Some(manifest_path.to_path_buf()),
        )
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.inner.table.lock().expect("extent table lock poisoned")
    }

    /// Reserves `len_bytes` (rounded up to 4096 on disk) under `name`.
    pub fn allocate(&self, name: &str, len_bytes: u64) -> Result<ExtentId, StorageError> {
        let allocated_bytes = len_bytes.next_multiple_of(DIRECT_IO_ALIGN as u64);
        let mut table = self.table();
        if table.by_name.contains_key(name) {
            return Err(StorageError::ExtentExists(name.to_string()));
        }
        let offset_bytes = if allocated_bytes == 0 {
            0
        } else {
            table
                .take_space(allocated_bytes)
                .ok_or_else(|| StorageError::StoreFull {
                    extent: name.to_string(),
                    len_bytes,
                    capacity_bytes: self.inner.capacity_bytes,
                    free_bytes: table.free_bytes(),
                    largest_free_bytes: table.free_runs.iter().map(|r| r.1).max().unwrap_or(0),
                })?
        };
        Ok(table.insert(Extent {
            name: name.to_string(),
            offset_bytes,
            len_bytes,
            allocated_bytes,
            state: ExtentState::Unwritten,
            crc: None,
            head: None,
            readers: 0,
            writing: false,
            used: false,
        }))
    }

    /// Releases an extent's space. Refused while it is being read or written.
    pub fn free(&self, id: ExtentId) -> Result<(), StorageError> {
        let mut table = self.table();
        let extent = table.get(id).ok_or_else(|| stale(id))?;
        if extent.readers > 0 || extent.writing {
            return Err(StorageError::ExtentBusy {
                extent: extent.name.clone(),
                reason: "it cannot be freed while a transfer is in flight",
            });
        }
        let (name, offset, allocated, used) = (
            extent.name.clone(),
            extent.offset_bytes,
            extent.allocated_bytes,
            extent.used,
        );
        if used {
            table.used_bytes -= allocated;
        }
        table.by_name.remove(&name);
        table.slots[id.index as usize].1 = None;
        table.free_indexes.push(id.index);
        if allocated > 0 {
            table.give_back(offset, allocated);
        }
        Ok(())
    }

    /// The extent with this name.
    pub fn id(&self, name: &str) -> Option<ExtentId> {
        let table = self.table();
        let index = *table.by_name.get(name)?;
        Some(ExtentId {
            index,
            generation: table.slots[index as usize].0,
        })
    }

    /// What the store knows about an extent.
    pub fn info(&self, id: ExtentId) -> Result<ExtentInfo, StorageError> {
        let table = self.table();
        let e = table.get(id).ok_or_else(|| stale(id))?;
        Ok(ExtentInfo {
            name: e.name.clone(),
            len_bytes: e.len_bytes,
            allocated_bytes: e.allocated_bytes,
            readable: e.state == ExtentState::Written,
        })
    }

    /// Where an extent's bytes lie: (file, offset, length) pieces, in order.
    pub fn locate(&self, id: ExtentId) -> Result<Vec<(PathBuf, u64, u64)>, StorageError> {
        let table = self.table();
        let e = table.get(id).ok_or_else(|| stale(id))?;
        Ok(self
            .segments(e.offset_bytes, e.allocated_bytes)
            .map(|s| {
                (
                    self.inner.files[s.file].path.clone(),
                    s.file_offset,
                    s.len_bytes,
                )
            })
            .collect())
    }

    fn segments(&self, offset_bytes: u64, len_bytes: u64) -> Segments {
        Segments {
            origin: offset_bytes,
            logical: offset_bytes,
            end: offset_bytes + len_bytes,
            stripe_bytes: self.inner.stripe_bytes,
            file_count: self.inner.files.len() as u64,
        }
    }

    /// Writes `buf`'s first `len_bytes` (the extent's length; the buffer must hold at
    /// least that rounded up to 4096) to the extent. The buffer comes back from
    /// [`Pending::wait`], also on error.
    pub fn write<B: IoBuf>(&self, id: ExtentId, buf: B) -> Pending<B> {
        self.start_transfer(OpKind::Write, id, buf, None)
    }

    /// Like [`TensorStore::write`], and also checksums the first `head_bytes` on their
    /// own, so that [`TensorStore::read_head`] can read and verify them alone (the
    /// master parameters at the head of a block's optimizer state).
    pub fn write_with_head<B: IoBuf>(&self, id: ExtentId, buf: B, head_bytes: u64) -> Pending<B> {
        self.start_transfer(OpKind::Write, id, buf, Some(head_bytes))
    }

    /// Reads the extent into `buf` (which must hold its length rounded up to 4096) and
    /// verifies its checksum. The buffer comes back from [`Pending::wait`].
    pub fn read<B: IoBuf>(&self, id: ExtentId, buf: B) -> Pending<B> {
        self.start_transfer(OpKind::Read, id, buf, None)
    }

    /// Reads the first `head_bytes` of the extent (rounded up to 4096: `buf` must hold
    /// that) and verifies them against the checksum of the head its last write took
    /// ([`TensorStore::write_with_head`], with the same length).
    pub fn read_head<B: IoBuf>(&self, id: ExtentId, buf: B, head_bytes: u64) -> Pending<B> {
        self.start_transfer(OpKind::Read, id, buf, Some(head_bytes))
    }

    fn start_transfer<B: IoBuf>(
        &self,
        kind: OpKind,
        id: ExtentId,
        mut buf: B,
        head: Option<u64>,
    ) -> Pending<B> {
        let mut pending = Pending {
            buf: None,
            group: None,
            early_error: None,
            store: Arc::clone(&self.inner),
            id,
            kind,
            crc: None,
            head: None,
            len_bytes: 0,
        };
        let claimed = self.claim(kind, id, &buf, head);
        let (offset_bytes, allocated_bytes, len_bytes, expected_crc) = match claimed {
            Ok(claim) => claim,
            Err(error) => {
                pending.early_error = Some(error);
                pending.buf = Some(buf);
                return pending;
            }
        };
        pending.len_bytes = len_bytes;
        if kind == OpKind::Read {
            pending.crc = expected_crc;
        }
        let segments = self.segments(offset_bytes, allocated_bytes);
        let group = self.inner.groups.take(segments.clone().count());
        let base = buf.as_mut_ptr();
        for segment in segments {
            self.inner.backend.submit(RawOp {
                kind,
                file: segment.file,
                offset_bytes: segment.file_offset,
                // SAFETY: buffer_offset + len <= allocated_bytes <= the buffer's capacity.
                ptr: unsafe { base.add(segment.buffer_offset as usize) },
                len_bytes: segment.len_bytes as usize,
                group: Arc::clone(&group),
            });
        }
        if kind == OpKind::Write {
            // Checksummed while the drive writes: a write only reads the buffer, which
            // this transfer owns and nobody changes until it settles, so the bytes
            // summed are the bytes written, and the sum costs no time on the critical
            // path when the drive is the slower of the two. The head's sum is taken
            // once and continued over the rest, so the head's bytes are read once.
            // SAFETY: claim checked the buffer holds at least len_bytes (and head_bytes
            // <= len_bytes); the backend only reads it.
            let bytes = unsafe { std::slice::from_raw_parts(base.cast_const(), len_bytes) };
            let (whole, head_crc) = write_checksums(bytes, head, self.inner.checksums);
            pending.crc = whole;
            pending.head = head.map(|h| (h, head_crc));
        }
        pending.group = Some(group);
        pending.buf = Some(buf);
        pending
    }

    /// Checks a transfer may start and marks the extent busy; returns its offset,
    /// allocated length, length, and (for reads) the checksum to expect.
    fn claim<B: IoBuf>(
        &self,
        kind: OpKind,
        id: ExtentId,
        buf: &B,
        head: Option<u64>,
    ) -> Result<(u64, u64, usize, Option<u32>), StorageError> {
        let mut table = self.table();
        let all_direct = self.inner.all_direct;
        let e = table.get_mut(id).ok_or_else(|| stale(id))?;
        let mut newly_used = false;
        if head.is_some_and(|h| h > e.len_bytes) {
            return Err(StorageError::BadBuffer {
                extent: e.name.clone(),
                reason: format!(
                    "a head of {} bytes is longer than the extent's {}",
                    head.unwrap_or(0),
                    e.len_bytes
                ),
            });
        }
        // A head read moves the head rounded up to the O_DIRECT granule.
        let (moved_bytes, moved_len) = match (kind, head) {
            (OpKind::Read, Some(h)) => (
                h.next_multiple_of(DIRECT_IO_ALIGN as u64)
                    .min(e.allocated_bytes),
                h,
            ),
            _ => (e.allocated_bytes, e.len_bytes),
        };
        if (buf.capacity_bytes() as u64) < moved_bytes {
            return Err(StorageError::BadBuffer {
                extent: e.name.clone(),
                reason: format!(
                    "it holds {} bytes; the transfer needs {} (its {} bytes rounded up to {DIRECT_IO_ALIGN})",
                    buf.capacity_bytes(),
                    moved_bytes,
                    moved_len
                ),
            });
        }
        if all_direct && !(buf.as_ptr() as usize).is_multiple_of(DIRECT_IO_ALIGN) {
            return Err(StorageError::BadBuffer {
                extent: e.name.clone(),
                reason: format!(
                    "its address {:p} is not aligned to {DIRECT_IO_ALIGN} bytes, as O_DIRECT needs",
                    buf.as_ptr()
                ),
            });
        }
        match kind {
            OpKind::Write => {
                if e.writing || e.readers > 0 {
                    return Err(StorageError::ExtentBusy {
                        extent: e.name.clone(),
                        reason: "a write must not overlap another transfer of the same extent",
                    });
                }
                e.writing = true;
                e.state = ExtentState::Unwritten;
                newly_used = !e.used;
                e.used = true;
            }
            OpKind::Read => {
                if e.writing {
                    return Err(StorageError::ExtentBusy {
                        extent: e.name.clone(),
                        reason: "it is being written",
                    });
                }
                match e.state {
                    ExtentState::Written => {}
                    ExtentState::Unwritten => {
                        return Err(StorageError::ExtentUnreadable {
                            extent: e.name.clone(),
                            reason: "it was never written",
                        });
                    }
                    ExtentState::WriteFailed => {
                        return Err(StorageError::ExtentUnreadable {
                            extent: e.name.clone(),
                            reason: "its last write failed, so its contents are unknown",
                        });
                    }
                }
                e.readers += 1;
            }
        }
        let expected = match (kind, head) {
            (OpKind::Read, Some(h)) => match e.head {
                Some((len, crc)) if len == h => crc,
                _ if !self.inner.checksums => None,
                _ => {
                    e.readers -= 1;
                    return Err(StorageError::ExtentUnreadable {
                        extent: e.name.clone(),
                        reason: "its last write did not checksum a head of that length",
                    });
                }
            },
            _ => e.crc,
        };
        let claimed = (e.offset_bytes, moved_bytes, moved_len as usize, expected);
        if newly_used {
            table.used_bytes += claimed.1;
            table.used_high_water_bytes = table.used_high_water_bytes.max(table.used_bytes);
        }
        Ok(claimed)
    }

    /// Registers memory so that transfers of buffers inside it use io_uring's fixed
    /// buffers (the threaded backend accepts and ignores it).
    ///
    /// # Safety
    /// The memory must stay allocated and mapped until [`TensorStore::unregister_region`]
    /// is called for it or every clone of the store is dropped: io_uring keeps its pages
    /// pinned and writes to them directly.
    pub unsafe fn register_region(&self, region: IoRegion) -> Result<(), StorageError> {
        // SAFETY: the caller's promise is the backend's contract.
        unsafe { self.inner.backend.register_region(region) }
    }

    /// Undoes [`TensorStore::register_region`].
    pub fn unregister_region(&self, region: IoRegion) -> Result<(), StorageError> {
        self.inner.backend.unregister_region(region)
    }

    /// The backend this store runs on.
    pub fn backend(&self) -> BackendKind {
        self.inner.backend.kind()
    }

    /// Whether every swap file bypasses the page cache.
    pub fn direct_io(&self) -> bool {
        self.inner.all_direct
    }

    /// Whether checksums are written and verified.
    pub fn checksums(&self) -> bool {
        self.inner.checksums
    }

    /// The swap files' paths. A store that is not persisted removed these names as it
    /// opened the files (so that nothing is left if the process is killed): the paths
    /// then only say where the space is, for messages.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.inner.files.iter().map(|f| f.path.clone()).collect()
    }

    /// Bytes extents may take in all.
    pub fn capacity_bytes(&self) -> u64 {
        self.inner.capacity_bytes
    }

    /// Bytes not taken by any extent.
    pub fn free_bytes(&self) -> u64 {
        self.table().free_bytes()
    }

    /// The most bytes that extents written to held at once, measured as writes start:
    /// the drive space the store really used, where the extents handed out may be more.
    pub fn written_high_water_bytes(&self) -> u64 {
        self.table().used_high_water_bytes
    }

    /// The backend's byte and chunk counters (cheap: no histogram is copied).
    pub fn io_counters(&self) -> crate::IoCounters {
        self.inner.backend.counters()
    }

    /// A copy of the backend's counters and latency histograms.
    pub fn io_stats(&self) -> IoStats {
        self.inner.backend.stats()
    }

    /// Zeroes the backend's counters.
    pub fn reset_io_stats(&self) {
        self.inner.backend.reset_stats();
    }

    /// Flushes written data to the drives (fdatasync on every file).
    pub fn sync(&self) -> Result<(), StorageError> {
        for f in &self.inner.files {
            f.file.sync_data().map_err(|source| StorageError::File {
                action: "cannot sync",
                path: f.path.clone(),
                source,
            })?;
        }
        Ok(())
    }

    /// For a persisted store: flushes the data, then writes the manifest that
    /// [`TensorStore::open`] reads (to a temporary name, synced, then renamed, so a crash
    /// leaves the previous manifest). Returns its path.
    pub fn save_manifest(&self) -> Result<PathBuf, StorageError> {
        self.inner.save_manifest()
    }
}

impl Inner {
    /// The name of extent `id`, for an error message.
    fn extent_name(&self, id: ExtentId) -> String {
        let table = self.table.lock().expect("extent table lock poisoned");
        table
            .get(id)
            .map_or_else(|| format!("{id:?}"), |e| e.name.clone())
    }

    fn save_manifest(&self) -> Result<PathBuf, StorageError> {
        let path = self.manifest_path.clone().ok_or_else(|| {
            StorageError::Config("only a store created with persist can save a manifest".into())
        })?;
        for f in &self.files {
            f.file.sync_data().map_err(|source| StorageError::File {
                action: "cannot sync",
                path: f.path.clone(),
                source,
            })?;
        }
        let manifest = {
            let table = self.table.lock().expect("extent table lock poisoned");
            Manifest {
                format: MANIFEST_FORMAT.into(),
                capacity_bytes: self.capacity_bytes,
                stripe_bytes: self.stripe_bytes,
                files: self
                    .files
                    .iter()
                    .map(|f| ManifestFile {
                        path: f.path.clone(),
                        len_bytes: f.len_bytes,
                    })
                    .collect(),
                extents: table
                    .slots
                    .iter()
                    .filter_map(|(_, e)| e.as_ref())
                    .map(|e| ManifestExtent {
                        name: e.name.clone(),
                        offset_bytes: e.offset_bytes,
                        len_bytes: e.len_bytes,
                        crc32c: e.crc,
                        // A write still in flight has not succeeded yet.
                        state: if e.writing {
                            ExtentState::WriteFailed
                        } else {
                            e.state
                        },
                    })
                    .collect(),
            }
        };
        let text = serde_json::to_string_pretty(&manifest).expect("manifest serialises");
        let temporary = path.with_extension("json.tmp");
        let io_error = |action: &'static str, p: &Path| {
            let p = p.to_path_buf();
            move |source| StorageError::File {
                action,
                path: p,
                source,
            }
        };
        let mut out = std::fs::File::create(&temporary)
            .map_err(io_error("cannot write manifest", &temporary))?;
        out.write_all(text.as_bytes())
            .and_then(|()| out.sync_all())
            .map_err(io_error("cannot write manifest", &temporary))?;
        std::fs::rename(&temporary, &path).map_err(io_error("cannot rename manifest to", &path))?;
        if let Some(dir) = path.parent()
            && let Ok(d) = std::fs::File::open(dir)
        {
            let _ = d.sync_all();
        }
        Ok(path)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if self.manifest_path.is_some()
            && let Err(e) = self.save_manifest()
        {
            log::error!("could not save the store manifest: {e}");
        }
    }
}

fn stale(id: ExtentId) -> StorageError {
    StorageError::NoSuchExtent(format!("#{} (freed, or from another store)", id.index))
}

/// A piece of an extent that lies in one file.
struct Segment {
    file: usize,
    file_offset: u64,
    buffer_offset: u64,
    len_bytes: u64,
}

/// Splits a logical range at stripe boundaries.
#[derive(Clone)]
struct Segments {
    /// Where the extent starts: buffer offsets count from here.
    origin: u64,
    logical: u64,
    end: u64,
    stripe_bytes: u64,
    file_count: u64,
}

impl Iterator for Segments {
    type Item = Segment;

    fn next(&mut self) -> Option<Segment> {
        if self.logical >= self.end {
            return None;
        }
        let start = self.logical;
        let stripe = start / self.stripe_bytes;
        let within = start % self.stripe_bytes;
        let len_bytes = (self.stripe_bytes - within).min(self.end - start);
        self.logical += len_bytes;
        Some(Segment {
            file: (stripe % self.file_count) as usize,
            file_offset: (stripe / self.file_count) * self.stripe_bytes + within,
            buffer_offset: start - self.origin,
            len_bytes,
        })
    }
}

/// The checksums a write records: of its whole `bytes` and, when it has a head of
/// `head` bytes, of the head on its own (both `None` with checksums off). The head is
/// summed once and the rest appended to that sum.
fn write_checksums(bytes: &[u8], head: Option<u64>, checksums: bool) -> (Option<u32>, Option<u32>) {
    if !checksums {
        return (None, None);
    }
    match head {
        Some(h) => {
            let (head, tail) = bytes.split_at(h as usize);
            let head_crc = crc::crc32c(head);
            (Some(crc::crc32c_combine(head_crc, tail)), Some(head_crc))
        }
        None => (Some(crc::crc32c(bytes)), None),
    }
}

/// A transfer in flight. [`Pending::wait`] returns its result and the buffer; dropping
/// it without waiting still waits (the buffer may not be freed while the kernel uses it).
#[must_use = "a transfer's result and buffer come back from wait()"]
pub struct Pending<B: IoBuf> {
    buf: Option<B>,
    group: Option<Arc<OpGroup>>,
    early_error: Option<StorageError>,
    store: Arc<Inner>,
    id: ExtentId,
    kind: OpKind,
    /// Write: the checksum of the data written. Read: the checksum to expect.
    crc: Option<u32>,
    /// Write: the head's length and checksum, when asked for.
    head: Option<(u64, Option<u32>)>,
    len_bytes: usize,
}

impl<B: IoBuf> Pending<B> {
    /// Whether the transfer has ended (so [`Pending::wait`] will not block).
    pub fn is_complete(&self) -> bool {
        self.group.as_ref().is_none_or(|g| g.is_done())
    }

    /// Waits for the transfer; returns its result and the buffer.
    pub fn wait(mut self) -> (Result<(), StorageError>, B) {
        let result = self.settle();
        (
            result,
            self.buf
                .take()
                .expect("a pending transfer holds its buffer"),
        )
    }

    fn settle(&mut self) -> Result<(), StorageError> {
        if let Some(error) = self.early_error.take() {
            return Err(error);
        }
        let Some(group) = self.group.take() else {
            return Ok(());
        };
        let mut result = group.wait();
        drop(group);
        {
            let mut table = self.store.table.lock().expect("extent table lock poisoned");
            let extent = table
                .get_mut(self.id)
                .expect("an extent in use cannot be freed");
            match self.kind {
                OpKind::Write => {
                    extent.writing = false;
                    if result.is_ok() {
                        extent.state = ExtentState::Written;
                        extent.crc = self.crc;
                        extent.head = self.head;
                    } else {
                        extent.state = ExtentState::WriteFailed;
                    }
                }
                OpKind::Read => extent.readers -= 1,
            }
        }
        if let (OpKind::Read, Ok(()), Some(expected)) = (self.kind, &result, self.crc) {
            let buf = self
                .buf
                .as_ref()
                .expect("a pending transfer holds its buffer");
            // SAFETY: the read has completed; the buffer holds at least len_bytes.
            let bytes = unsafe { std::slice::from_raw_parts(buf.as_ptr(), self.len_bytes) };
            let actual = crc::crc32c(bytes);
            if actual != expected {
                result = Err(StorageError::Checksum {
                    extent: self.store.extent_name(self.id),
                    len_bytes: self.len_bytes as u64,
                    expected,
                    actual,
                });
            }
        }
        result
    }
}

impl<B: IoBuf> Drop for Pending<B> {
    fn drop(&mut self) {
        if self.buf.is_some()
            && let Err(error) = self.settle()
        {
            log::debug!("a transfer dropped without waiting failed: {error}");
        }
    }
}

const MANIFEST_FORMAT: &str = "strata-store/1";

#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    format: String,
    capacity_bytes: u64,
    stripe_bytes: u64,
    files: Vec<ManifestFile>,
    extents: Vec<ManifestExtent>,
}

#[derive(Debug, Serialize, Deserialize)]
struct ManifestFile {
    path: PathBuf,
    len_bytes: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct ManifestExtent {
    name: String,
    offset_bytes: u64,
    len_bytes: u64,
    crc32c: Option<u32>,
    state: ExtentState,
}
