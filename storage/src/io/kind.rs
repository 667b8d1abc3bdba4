//! Which way a transfer goes ([`OpKind`]) and which backend moves it ([`BackendKind`]):
//! names every backend, the store and its errors share.
//!
//! Not here: the backends (`uring`, `threads`, `faulty`) and what they share (`backend`).

/// Whether a transfer reads from or writes to a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// File to memory.
    Read,
    /// Memory to file.
    Write,
}

impl std::fmt::Display for OpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OpKind::Read => "read",
            OpKind::Write => "write",
        })
    }
}

/// The backend a store actually runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    /// io_uring.
    Uring,
    /// Threads calling pread/pwrite.
    Threads,
    /// Threads over fault-injecting system calls (tests only).
    Faulty,
}

impl BackendKind {
    /// A short name for reports.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Uring => "io_uring",
            BackendKind::Threads => "threads",
            BackendKind::Faulty => "faulty",
        }
    }
}
