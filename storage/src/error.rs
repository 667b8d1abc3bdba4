//! The storage crate's one error type. Every variant carries what a user needs to act:
//! which file, which extent, which offset, how many bytes.

use std::path::PathBuf;

use crate::io::kind::OpKind;

/// Everything that can go wrong in the storage crate.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// An I/O system call failed; `errno` is named (EIO, ENOSPC, ...).
    #[error("{op} of {len_bytes} bytes at offset {offset_bytes} in {path} failed: {errno}")]
    Io {
        /// Read or write.
        op: OpKind,
        /// The swap file.
        path: PathBuf,
        /// Where in the file.
        offset_bytes: u64,
        /// How many bytes the failed call asked for.
        len_bytes: usize,
        /// The error the kernel returned.
        errno: Errno,
    },

    /// A read reached the end of the file before the extent's last byte.
    #[error(
        "read at offset {offset_bytes} in {path} hit the end of the file with {missing_bytes} bytes still to read: the swap file is shorter than the store expects"
    )]
    UnexpectedEof {
        /// The swap file.
        path: PathBuf,
        /// Where the read that returned nothing started.
        offset_bytes: u64,
        /// How many bytes were still expected.
        missing_bytes: usize,
    },

    /// An extent's bytes do not match the checksum written with them.
    #[error(
        "extent '{extent}' is corrupt: crc32c of its {len_bytes} bytes is {actual:#010x}, {expected:#010x} was written"
    )]
    Checksum {
        /// The extent's name.
        extent: String,
        /// Its length.
        len_bytes: u64,
        /// The checksum recorded when it was written.
        expected: u32,
        /// The checksum of what was read.
        actual: u32,
    },

    /// No extent has this name.
    #[error("no extent named '{0}' in this store")]
    NoSuchExtent(String),

    /// An extent with this name exists already.
    #[error("an extent named '{0}' exists already")]
    ExtentExists(String),

    /// A read of an extent whose contents are not known good.
    #[error("extent '{extent}' cannot be read: {reason}")]
    ExtentUnreadable {
        /// The extent's name.
        extent: String,
        /// Never written, or its last write failed.
        reason: &'static str,
    },

    /// An operation on an extent that another operation is using in a conflicting way.
    #[error("extent '{extent}' is busy: {reason}")]
    ExtentBusy {
        /// The extent's name.
        extent: String,
        /// What conflicts.
        reason: &'static str,
    },

    /// The store has no room for an extent of this size.
    #[error(
        "no room for extent '{extent}' of {len_bytes} bytes: the store holds {capacity_bytes} bytes, of which {free_bytes} are free (largest free run {largest_free_bytes}); create the store with a larger capacity"
    )]
    StoreFull {
        /// The extent asked for.
        extent: String,
        /// Its size.
        len_bytes: u64,
        /// The store's capacity.
        capacity_bytes: u64,
        /// Free bytes in all.
        free_bytes: u64,
        /// The largest contiguous free run.
        largest_free_bytes: u64,
    },

    /// A filesystem lacks the free space the store needs.
    #[error(
        "not enough free space in {path}: the store needs {needed_bytes} bytes ({needed}), {available_bytes} ({available}) are available; free space there, choose another path or a smaller size"
    )]
    InsufficientSpace {
        /// A folder on the filesystem in question.
        path: PathBuf,
        /// Bytes needed on that filesystem.
        needed_bytes: u64,
        /// The same, readable.
        needed: String,
        /// Bytes available to this user.
        available_bytes: u64,
        /// The same, readable.
        available: String,
    },

    /// A buffer cannot be used for this transfer.
    #[error("buffer unusable for extent '{extent}': {reason}")]
    BadBuffer {
        /// The extent.
        extent: String,
        /// Too small, or misaligned for O_DIRECT.
        reason: String,
    },

    /// A file could not be opened, created, sized or inspected.
    #[error("{action} {path}: {source}")]
    File {
        /// What was being done ("cannot create", "cannot preallocate", ...).
        action: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },

    /// The configuration is inconsistent.
    #[error("invalid storage configuration: {0}")]
    Config(String),

    /// io_uring was asked for and cannot be used.
    #[error("io_uring cannot be used: {0}")]
    UringUnavailable(String),

    /// Registering memory with the I/O backend failed.
    #[error(
        "cannot register {len_bytes} bytes of buffer memory with io_uring: {errno}; raise the locked-memory limit (ulimit -l) or run without registered buffers"
    )]
    Register {
        /// The size of the region.
        len_bytes: usize,
        /// The error the kernel returned.
        errno: Errno,
    },

    /// A store manifest could not be read or does not match the files.
    #[error("store manifest {path}: {reason}")]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// The I/O thread is gone (it panicked or the store is shutting down).
    #[error("the I/O backend has shut down")]
    BackendGone,
}

/// An operating-system error number with its name, so messages say `EIO`, not `5`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Errno(pub i32);

impl Errno {
    /// The symbolic name (`EIO`, `ENOSPC`, ...), or `errno N` for rarer ones.
    pub fn name(self) -> std::borrow::Cow<'static, str> {
        let name = match self.0 {
            libc::EIO => "EIO",
            libc::ENOSPC => "ENOSPC",
            libc::EDQUOT => "EDQUOT",
            libc::EINVAL => "EINVAL",
            libc::EBADF => "EBADF",
            libc::EFAULT => "EFAULT",
            libc::EINTR => "EINTR",
            libc::EAGAIN => "EAGAIN",
            libc::ENOMEM => "ENOMEM",
            libc::EPERM => "EPERM",
            libc::EACCES => "EACCES",
            libc::ENOSYS => "ENOSYS",
            libc::EOPNOTSUPP => "EOPNOTSUPP",
            libc::EROFS => "EROFS",
            libc::EFBIG => "EFBIG",
            libc::ENXIO => "ENXIO",
            libc::ENODEV => "ENODEV",
            libc::ECANCELED => "ECANCELED",
            libc::EBUSY => "EBUSY",
            libc::EOVERFLOW => "EOVERFLOW",
            libc::ENOENT => "ENOENT",
            other => return format!("errno {other}").into(),
        };
        name.into()
    }

    /// From an `std::io::Error`, when it carries an OS error number.
    pub fn from_io(error: &std::io::Error) -> Option<Self> {
        error.raw_os_error().map(Errno)
    }
}

impl std::fmt::Display for Errno {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = std::io::Error::from_raw_os_error(self.0);
        // io::Error's text ends with "(os error N)": keep the description only.
        let text = text.to_string();
        let description = text.split(" (os error").next().unwrap_or(&text);
        write!(f, "{} ({description})", self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_is_named() {
        assert_eq!(Errno(libc::EIO).name(), "EIO");
        assert_eq!(
            Errno(libc::ENOSPC).to_string(),
            "ENOSPC (No space left on device)"
        );
        assert_eq!(Errno(4242).name(), "errno 4242");
    }
}
