//! Swap files: created, preallocated and opened for O_DIRECT I/O.
//!
//! A swap file is opened with O_DIRECT so transfers bypass the page cache (the data is
//! already in strata's own pinned buffers; caching it twice would only take RAM the
//! training needs). Its alignment needs are checked at open with statx
//! (STATX_DIOALIGN, Linux 6.1+) against the 4096 bytes strata aligns everything to. A
//! filesystem that refuses O_DIRECT (tmpfs on older kernels) gets buffered I/O and one
//! warning. Free space is checked (statvfs) before anything is allocated.
//!
//! The same checks answer, before any store exists, what a folder offers swap files
//! ([`probe_direct_io`], [`filesystem_type`], [`available_bytes`]), for `strata doctor`.
//! And for files written through the page cache (checkpoints), [`write_back_and_drop`].

use std::collections::HashMap;
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::buffer::{AlignedBuf, DIRECT_IO_ALIGN};
use crate::error::StorageError;

/// An open swap file.
#[derive(Debug)]
pub(crate) struct SwapFile {
    pub file: File,
    pub path: PathBuf,
    pub len_bytes: u64,
    /// Whether I/O bypasses the page cache.
    pub direct: bool,
    /// Whether the file is deleted when this is dropped.
    pub remove_on_drop: bool,
}

impl Drop for SwapFile {
    fn drop(&mut self) {
        if self.remove_on_drop
            && let Err(e) = std::fs::remove_file(&self.path)
        {
            log::warn!("could not remove swap file {}: {e}", self.path.display());
        }
    }
}

/// Whether swap files use O_DIRECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirectIo {
    /// O_DIRECT where the filesystem accepts it, else buffered with one warning.
    #[default]
    Auto,
    /// Buffered I/O through the page cache (for comparisons; not for training).
    Off,
}

fn file_error(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> StorageError {
    let path = path.to_path_buf();
    move |source| StorageError::File {
        action,
        path,
        source,
    }
}

/// What becomes of a new swap file's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Name {
    /// The file keeps its name while open and is removed when dropped.
    Kept,
    /// The name is removed as soon as the file is open: its space belongs to the open
    /// descriptors, and the kernel frees it when the process ends, however it ends (a
    /// run killed with SIGKILL leaves nothing behind).
    Unlinked,
}

/// Creates a new swap file of `len_bytes` at `path` (which must not exist), preallocated.
pub(crate) fn create(
    path: &Path,
    len_bytes: u64,
    direct: DirectIo,
    name: Name,
) -> Result<SwapFile, StorageError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(file_error("cannot create swap file", path))?;
    // From here on the file exists: remove it again if anything below fails.
    let mut swap = SwapFile {
        file,
        path: path.to_path_buf(),
        len_bytes,
        direct: false,
        remove_on_drop: true,
    };
    // O_DIRECT reopens by name, so before the name goes; the blocks are allocated after,
    // so that only an empty file can ever be left behind by a kill in between.
    use_direct_io(&mut swap, direct)?;
    if name == Name::Unlinked {
        std::fs::remove_file(path).map_err(file_error("cannot unlink swap file", path))?;
        swap.remove_on_drop = false;
    }
    preallocate(&swap.file, path, len_bytes)?;
    Ok(swap)
}

/// Opens an existing swap file (of a persisted store) of at least `len_bytes`.
pub(crate) fn open_existing(
    path: &Path,
    len_bytes: u64,
    direct: DirectIo,
) -> Result<SwapFile, StorageError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(file_error("cannot open swap file", path))?;
    let actual = file
        .metadata()
        .map_err(file_error("cannot inspect swap file", path))?
        .len();
    if actual < len_bytes {
        return Err(StorageError::Manifest {
            path: path.to_path_buf(),
            reason: format!("the swap file holds {actual} bytes, the store expects {len_bytes}"),
        });
    }
    let mut swap = SwapFile {
        file,
        path: path.to_path_buf(),
        len_bytes,
        direct: false,
        remove_on_drop: false,
    };
    use_direct_io(&mut swap, direct)?;
    Ok(swap)
}

/// Switches the file to O_DIRECT when asked for and the filesystem allows it.
fn use_direct_io(swap: &mut SwapFile, direct: DirectIo) -> Result<(), StorageError> {
    if direct == DirectIo::Auto
        && let Some(file) = reopen_direct(&swap.path)?
    {
        swap.file = file;
        swap.direct = true;
    }
    Ok(())
}

/// Allocates the file's blocks now, so a full disk shows up before training, not in
/// the middle of a step.
fn preallocate(file: &File, path: &Path, len_bytes: u64) -> Result<(), StorageError> {
    let len = libc::off_t::try_from(len_bytes)
        .map_err(|_| StorageError::Config(format!("swap file size {len_bytes} too large")))?;
    // SAFETY: fallocate on an open descriptor we own; no memory is involved.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
    if rc == 0 {
        return Ok(());
    }
    let error = std::io::Error::last_os_error();
    if error.raw_os_error() == Some(libc::EOPNOTSUPP) {
        static WARNED: AtomicBool = AtomicBool::new(false);
        if !WARNED.swap(true, Ordering::Relaxed) {
            log::warn!(
                "{} does not support fallocate: the swap file is sized but not preallocated, \
                 so running out of space shows up only when it is written",
                path.display()
            );
        }
        return file
            .set_len(len_bytes)
            .map_err(file_error("cannot size swap file", path));
    }
    Err(file_error("cannot preallocate swap file", path)(error))
}

/// Opens `path` again with O_DIRECT. `None` (after one warning) when the filesystem
/// refuses O_DIRECT; an error when its alignment needs exceed 4096 bytes.
fn reopen_direct(path: &Path) -> Result<Option<File>, StorageError> {
    match open_direct(path)? {
        DirectOpen::Opened { file, .. } => Ok(Some(file)),
        DirectOpen::Refused(why) => {
            warn_buffered(path, why);
            Ok(None)
        }
    }
}

/// What opening an existing file with O_DIRECT gave.
enum DirectOpen {
    /// Opened; the alignment is what statx reports.
    Opened { file: File, alignment: DioAlignment },
    /// The filesystem refuses direct I/O for this file, for this reason.
    Refused(&'static str),
}

/// Opens `path` with O_DIRECT and checks its alignment needs against 4096 bytes; an
/// error when they exceed it. Says nothing: the caller decides whether a refusal warns.
fn open_direct(path: &Path) -> Result<DirectOpen, StorageError> {
    let opened = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path);
    let file = match opened {
        Ok(file) => file,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            return Ok(DirectOpen::Refused(
                "the filesystem refuses O_DIRECT (tmpfs does)",
            ));
        }
        Err(e) => return Err(file_error("cannot open for direct I/O", path)(e)),
    };
    let alignment = dio_alignment(path)?;
    match alignment {
        DioAlignment::Unknown => Ok(DirectOpen::Opened { file, alignment }),
        DioAlignment::Unsupported => Ok(DirectOpen::Refused(
            "statx reports no direct I/O support for this file",
        )),
        DioAlignment::Known {
            memory_bytes,
            offset_bytes,
        } => {
            let fits = |a: u32| a > 0 && DIRECT_IO_ALIGN.is_multiple_of(a as usize);
            if fits(memory_bytes) && fits(offset_bytes) {
                Ok(DirectOpen::Opened { file, alignment })
            } else {
                Err(StorageError::Config(format!(
                    "{} needs direct I/O aligned to {memory_bytes} bytes in memory and \
                     {offset_bytes} in the file; strata aligns to {DIRECT_IO_ALIGN}: put the \
                     swap files on another filesystem",
                    path.display()
                )))
            }
        }
    }
}

/// How swap files in a folder would do their I/O, as [`probe_direct_io`] found it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "mode")]
pub enum DirectIoSupport {
    /// O_DIRECT works: a 4 KiB aligned write and read bypassed the page cache.
    Direct {
        /// The alignment of buffer addresses statx reports (Linux 6.1+), if it does.
        memory_align_bytes: Option<u32>,
        /// The alignment of file offsets statx reports, if it does.
        offset_align_bytes: Option<u32>,
    },
    /// The filesystem refuses O_DIRECT, so swap files here use buffered I/O.
    Buffered {
        /// Why, in words.
        reason: String,
    },
}

/// Finds out whether swap files in folder `dir` get O_DIRECT, the way the tensor store
/// opens them: creates a small file there, opens it with O_DIRECT (checking statx
/// STATX_DIOALIGN), writes and reads back one aligned 4 KiB block, and removes the file.
/// An error when no file can be created there, when direct I/O needs more than strata's
/// 4096-byte alignment (the store would refuse the folder), or when O_DIRECT opens but
/// its I/O fails (the store would fail mid-run).
pub fn probe_direct_io(dir: &Path) -> Result<DirectIoSupport, StorageError> {
    static PROBES: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        ".strata-probe-{}-{}",
        std::process::id(),
        PROBES.fetch_add(1, Ordering::Relaxed)
    );
    let block = DIRECT_IO_ALIGN as u64;
    // Removed again when `swap` drops, whatever happens below.
    let swap = create(&dir.join(name), block, DirectIo::Off, Name::Kept)?;
    let path = &swap.path;
    let (file, alignment) = match open_direct(path)? {
        DirectOpen::Opened { file, alignment } => (file, alignment),
        DirectOpen::Refused(reason) => {
            return Ok(DirectIoSupport::Buffered {
                reason: reason.to_string(),
            });
        }
    };
    let mut written = AlignedBuf::zeroed(DIRECT_IO_ALIGN);
    for (i, byte) in written.as_mut_slice().iter_mut().enumerate() {
        *byte = i as u8;
    }
    file.write_all_at(written.as_slice(), 0)
        .map_err(file_error("cannot write with O_DIRECT to", path))?;
    let mut read = AlignedBuf::zeroed(DIRECT_IO_ALIGN);
    file.read_exact_at(read.as_mut_slice(), 0)
        .map_err(file_error("cannot read with O_DIRECT from", path))?;
    if read.as_slice() != written.as_slice() {
        return Err(StorageError::File {
            action: "read back other bytes than were written with O_DIRECT to",
            path: path.clone(),
            source: std::io::Error::other("data mismatch"),
        });
    }
    let (memory_align_bytes, offset_align_bytes) = match alignment {
        DioAlignment::Known {
            memory_bytes,
            offset_bytes,
        } => (Some(memory_bytes), Some(offset_bytes)),
        DioAlignment::Unknown | DioAlignment::Unsupported => (None, None),
    };
    Ok(DirectIoSupport::Direct {
        memory_align_bytes,
        offset_align_bytes,
    })
}

fn warn_buffered(path: &Path, why: &str) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if !WARNED.swap(true, Ordering::Relaxed) {
        log::warn!(
            "{}: {why}; using buffered I/O, which goes through the page cache (slower, and \
             its speed measures RAM, not the drive)",
            path.display()
        );
    }
}

/// What statx says about a file's direct-I/O alignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DioAlignment {
    /// The kernel does not report it (before Linux 6.1): try and see.
    Unknown,
    /// The file does not support direct I/O.
    Unsupported,
    /// Required alignments of memory and file offsets.
    Known {
        /// Of buffer addresses (and lengths).
        memory_bytes: u32,
        /// Of file offsets.
        offset_bytes: u32,
    },
}

pub(crate) fn dio_alignment(path: &Path) -> Result<DioAlignment, StorageError> {
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| StorageError::Config(format!("{} contains a NUL byte", path.display())))?;
    // SAFETY: statx is plain data; zeroes are a valid value of it.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: c_path is a valid C string and stx a valid out-pointer for the call.
    let rc = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c_path.as_ptr(),
            0,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if rc != 0 {
        let error = std::io::Error::last_os_error();
        if error.raw_os_error() == Some(libc::ENOSYS) {
            return Ok(DioAlignment::Unknown);
        }
        return Err(file_error("cannot statx", path)(error));
    }
    if stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return Ok(DioAlignment::Unknown);
    }
    if stx.stx_dio_offset_align == 0 {
        return Ok(DioAlignment::Unsupported);
    }
    Ok(DioAlignment::Known {
        memory_bytes: stx.stx_dio_mem_align,
        offset_bytes: stx.stx_dio_offset_align,
    })
}

/// Bytes available to this user on the filesystem holding `dir` (statvfs: free blocks
/// not reserved for root).
pub fn available_bytes(dir: &Path) -> Result<u64, StorageError> {
    let c_path = CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| StorageError::Config(format!("{} contains a NUL byte", dir.display())))?;
    // SAFETY: statvfs is plain data; zeroes are a valid value of it.
    let mut vfs: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c_path is a valid C string and vfs a valid out-pointer.
    if unsafe { libc::statvfs(c_path.as_ptr(), &mut vfs) } != 0 {
        return Err(file_error("cannot check free space in", dir)(
            std::io::Error::last_os_error(),
        ));
    }
    Ok((vfs.f_bavail as u64).saturating_mul(vfs.f_frsize as u64))
}

/// Checks that every filesystem has room for the files planned on it (several files on
/// one filesystem add up). `plan` pairs a folder with the bytes to put there.
pub(crate) fn check_free_space(plan: &[(PathBuf, u64)]) -> Result<(), StorageError> {
    let mut per_device: HashMap<u64, (PathBuf, u64)> = HashMap::new();
    for (dir, bytes) in plan {
        let device = std::fs::metadata(dir)
            .map_err(file_error("cannot use swap folder", dir))?
            .dev();
        per_device
            .entry(device)
            .or_insert_with(|| (dir.clone(), 0))
            .1 += bytes;
    }
    for (dir, needed_bytes) in per_device.into_values() {
        let available = available_bytes(&dir)?;
        if available < needed_bytes {
            return Err(StorageError::InsufficientSpace {
                needed: format_bytes(needed_bytes),
                available: format_bytes(available),
                path: dir,
                needed_bytes,
                available_bytes: available,
            });
        }
    }
    Ok(())
}

/// Whether the filesystem holding `dir` is tmpfs (RAM, not a drive).
pub fn is_tmpfs(dir: &Path) -> bool {
    let Ok(c_path) = CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: statfs is plain data; zeroes are a valid value of it.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c_path is a valid C string and fs a valid out-pointer.
    let rc = unsafe { libc::statfs(c_path.as_ptr(), &mut fs) };
    rc == 0 && fs.f_type as i64 == libc::TMPFS_MAGIC
}

/// The type of the filesystem holding `path` (`ext4`, `xfs`, `tmpfs`, `overlay`...), from
/// the longest mount point in /proc/mounts that contains it; `None` when `path` does not
/// exist or the mounts cannot be read.
pub fn filesystem_type(path: &Path) -> Option<String> {
    let path = path.canonicalize().ok()?;
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    mounts
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (_, mount, fs) = (fields.next()?, fields.next()?, fields.next()?);
            path.starts_with(mount)
                .then(|| (mount.len(), fs.to_string()))
        })
        .max()
        .map(|(_, fs)| fs)
}

/// Formats a byte count with a binary unit for messages and reports: `4 GiB`,
/// `1.50 GiB`, `64 KiB`, `512 B`. The one formatter of sizes in the workspace.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if value.fract() == 0.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

/// Writes bytes `from..from + len` of `file` (written through the page cache) out to the
/// device, waits for them, and drops them from the page cache, so that a long sequential
/// write (a checkpoint larger than memory) leaves neither dirty nor cached pages behind,
/// which a memory cgroup would charge to the writer. The dropping is advice: a kernel
/// that ignores it loses nothing, the data being written.
pub fn write_back_and_drop(file: &File, from: u64, len: u64) -> std::io::Result<()> {
    let fd = file.as_raw_fd();
    let (from, len) = (from as libc::off64_t, len as libc::off64_t);
    let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
        | libc::SYNC_FILE_RANGE_WRITE
        | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    // SAFETY: `fd` is an open file borrowed for the call; neither call reads or writes
    // memory of this process.
    if unsafe { libc::sync_file_range(fd, from, len, flags) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    unsafe { libc::posix_fadvise(fd, from, len, libc::POSIX_FADV_DONTNEED) };
    Ok(())
}

/// Drops bytes `from..from + len` of `file` from the page cache after they have been
/// read, so that a long sequential read (verifying or resuming a checkpoint larger than
/// memory) leaves no cached pages behind, which a memory cgroup would charge to the
/// reader until it reclaimed them. Advice: a kernel that ignores it loses nothing, the
/// pages being clean.
pub fn drop_read_pages(file: &File, from: u64, len: u64) {
    // SAFETY: `fd` is an open file borrowed for the call, which reads or writes no
    // memory of this process.
    unsafe {
        libc::posix_fadvise(
            file.as_raw_fd(),
            from as libc::off64_t,
            len as libc::off64_t,
            libc::POSIX_FADV_DONTNEED,
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_space_check_names_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let error = check_free_space(&[(dir.path().to_path_buf(), u64::MAX / 2)]).unwrap_err();
        let text = error.to_string();
        assert!(text.contains("not enough free space"), "{text}");
        assert!(text.contains(&(u64::MAX / 2).to_string()), "{text}");
        check_free_space(&[(dir.path().to_path_buf(), 4096)]).unwrap();
    }

    #[test]
    fn created_file_is_preallocated_and_removed_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.swap");
        let swap = create(&path, 1 << 20, DirectIo::Auto, Name::Kept).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.len(), 1 << 20);
        assert!(
            meta.blocks() * 512 >= 1 << 20,
            "blocks are allocated, not sparse"
        );
        assert!(
            create(&path, 4096, DirectIo::Auto, Name::Kept).is_err(),
            "never overwrites"
        );
        drop(swap);
        assert!(!path.exists());
    }

    #[test]
    fn filesystem_of_root_is_known() {
        assert!(filesystem_type(Path::new("/")).is_some());
        assert_eq!(filesystem_type(Path::new("/no/such/folder/here")), None);
    }

    #[test]
    fn direct_io_probe_answers_and_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        match probe_direct_io(dir.path()).unwrap() {
            DirectIoSupport::Direct { .. } => {}
            DirectIoSupport::Buffered { reason } => assert!(!reason.is_empty()),
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        let missing = dir.path().join("missing");
        assert!(probe_direct_io(&missing).is_err());
    }

    #[test]
    fn dio_alignment_is_read_or_unknown() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.swap");
        let _swap = create(&path, 8192, DirectIo::Auto, Name::Kept).unwrap();
        match dio_alignment(&path).unwrap() {
            DioAlignment::Known {
                memory_bytes,
                offset_bytes,
            } => {
                assert!(memory_bytes.is_power_of_two() && offset_bytes.is_power_of_two());
            }
            DioAlignment::Unknown | DioAlignment::Unsupported => {}
        }
    }
}
