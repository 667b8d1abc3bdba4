//! What goes wrong saving, finding or loading a checkpoint ([`CheckpointError`]): one
//! line each, naming the folder and file and saying what to do.
//!
//! Not here: finding the earlier checkpoint an error advises (`folder::advice`).

use std::path::{Path, PathBuf};

use strata_storage::format_bytes;

use crate::model::ModelError;

/// What went wrong saving, finding or loading a checkpoint. Each message is one line that
/// names the folder and file and says what to do.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The path given does not exist.
    #[error(
        "no checkpoint at {path}: it does not exist; check the path to resume from, or start \
         without --resume"
    )]
    MissingDir {
        /// The path given.
        path: PathBuf,
    },
    /// A checkpoint root with no complete checkpoint in it.
    #[error(
        "{root} holds no complete checkpoint (a step-NNNNNNNN folder with a manifest.json){skipped}; \
         start without --resume, or give the folder of a checkpoint"
    )]
    NoCheckpoint {
        /// The root.
        root: PathBuf,
        /// What was passed over and why, as `" (skipped: …)"`, or empty.
        skipped: String,
    },
    /// A file of the checkpoint is not there.
    #[error("checkpoint {dir} is incomplete: {file} is missing; {advice}")]
    MissingFile {
        /// The checkpoint's folder.
        dir: PathBuf,
        /// The file's name.
        file: Box<str>,
        /// What to do instead.
        advice: String,
    },
    /// A file is shorter (truncated) or longer than the manifest says.
    #[error(
        "checkpoint {dir} is corrupted: {file} is {how}, {len_bytes} bytes where the manifest \
         says {expected_bytes}; {advice}",
        how = if len_bytes < expected_bytes { "truncated" } else { "too long" }
    )]
    Length {
        /// The checkpoint's folder.
        dir: PathBuf,
        /// The file's name.
        file: Box<str>,
        /// Its length.
        len_bytes: u64,
        /// The length the manifest records.
        expected_bytes: u64,
        /// What to do instead.
        advice: String,
    },
    /// A file's bytes are not those that were written.
    #[error(
        "checkpoint {dir} is corrupted: {file} crc32c {actual:#010x} != manifest {expected:#010x}; \
         {advice}"
    )]
    Checksum {
        /// The checkpoint's folder.
        dir: PathBuf,
        /// The file's name.
        file: Box<str>,
        /// The crc32c of its bytes.
        actual: u32,
        /// The crc32c the manifest records.
        expected: u32,
        /// What to do instead.
        advice: String,
    },
    /// A JSON file that does not parse, or lacks a field.
    #[error("checkpoint {dir} is corrupted: {file} is not valid: {message}; {advice}")]
    BadJson {
        /// The checkpoint's folder.
        dir: PathBuf,
        /// The file's name.
        file: Box<str>,
        /// The parser's complaint.
        message: String,
        /// What to do instead.
        advice: String,
    },
    /// A tensor whose shape is not the one `config.json` implies.
    #[error(
        "checkpoint {dir} is inconsistent: {file} tensor `{tensor}` has shape {found:?}, \
         config.json implies {expected:?}; {advice}"
    )]
    Shape {
        /// The checkpoint's folder.
        dir: PathBuf,
        /// The file's name.
        file: Box<str>,
        /// The tensor's name in the file.
        tensor: Box<str>,
        /// The shape `config.json` implies.
        expected: Box<[usize]>,
        /// The shape in the file.
        found: Box<[usize]>,
        /// What to do instead.
        advice: String,
    },
    /// A tensor that is not f32 (a checkpoint holds exact fp32 state).
    #[error(
        "checkpoint {dir} is inconsistent: {file} tensor `{tensor}` is {found}, a checkpoint \
         holds F32; {advice}"
    )]
    Dtype {
        /// The checkpoint's folder.
        dir: PathBuf,
        /// The file's name.
        file: Box<str>,
        /// The tensor's name in the file.
        tensor: Box<str>,
        /// Its dtype.
        found: String,
        /// What to do instead.
        advice: String,
    },
    /// A checkpoint of another layout version.
    #[error(
        "checkpoint {dir} has format version {found}, this strata reads version {supported}; \
         resume with the strata that wrote it, or start without --resume"
    )]
    Version {
        /// The checkpoint's folder.
        dir: PathBuf,
        /// The version in its manifest.
        found: u64,
        /// [`FORMAT_VERSION`](super::FORMAT_VERSION).
        supported: u32,
    },
    /// Any other inconsistency: a tensor missing, files that disagree on the step.
    #[error("checkpoint {dir} is corrupted: {message}; {advice}")]
    Invalid {
        /// The checkpoint's folder.
        dir: PathBuf,
        /// What is wrong, naming the file.
        message: String,
        /// What to do instead.
        advice: String,
    },
    /// The filesystem cannot hold the checkpoint.
    #[error(
        "not enough free space in {dir} for checkpoint step {step}: it needs {needed_bytes} bytes \
         ({needed}), {available_bytes} bytes ({available}) are available; free space there, \
         lower the number of checkpoints kept, or save to another folder",
        needed = format_bytes(*needed_bytes),
        available = format_bytes(*available_bytes)
    )]
    NoSpace {
        /// The checkpoint root.
        dir: PathBuf,
        /// The step being saved.
        step: u64,
        /// Bytes the checkpoint needs (an estimate from above).
        needed_bytes: u64,
        /// Bytes available to this user there.
        available_bytes: u64,
    },
    /// A file or folder operation failed.
    #[error("cannot {action} {path}: {source}")]
    Io {
        /// What was being done: "create", "read", "rename", ….
        action: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The free space of the filesystem could not be read (its error names the folder).
    #[error(transparent)]
    Storage(#[from] strata_storage::StorageError),
    /// Writing the model's or optimizer's tensors failed.
    #[error("cannot save a checkpoint in {dir}: {source}")]
    Write {
        /// The temporary folder being written.
        dir: PathBuf,
        /// The error writing the tensors.
        source: ModelError,
    },
    /// What supplied a block's state to a save failed (the executor reading it from its
    /// tier, say); the previous checkpoint is kept.
    #[error(
        "checkpoint step {step} was not saved: {what}: {source}; the previous checkpoint is kept"
    )]
    Source {
        /// The step being saved.
        step: u64,
        /// What was being read.
        what: String,
        /// Its error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// What was given to save does not fit together.
    #[error("cannot save a checkpoint: {0}")]
    BadInput(String),
    /// Another rank's part of a sharded save failed (its own error is in its output).
    #[error(
        "checkpoint step {step} was not saved: rank {rank} could not {what} (its error is in \
         its output); the previous checkpoint is kept"
    )]
    Rank {
        /// The step being saved.
        step: u64,
        /// The first rank that failed.
        rank: usize,
        /// What it was doing.
        what: &'static str,
    },
    /// A sharded checkpoint written by a different number of ranks than load it.
    #[error(
        "checkpoint {dir} was written by {written} ranks and is being resumed by {ranks}: \
         resume it under `mpirun -np {written}`, or resume from it whole (every rank reads \
         every shard)"
    )]
    Ranks {
        /// The checkpoint's folder.
        dir: PathBuf,
        /// Ranks that wrote it.
        written: usize,
        /// Ranks loading it.
        ranks: usize,
    },
    /// The group's collectives failed during a sharded save.
    #[error("saving a sharded checkpoint: {0}")]
    Comm(Box<strata_comm::CommError>),
}

impl From<strata_comm::CommError> for CheckpointError {
    fn from(e: strata_comm::CommError) -> Self {
        CheckpointError::Comm(Box::new(e))
    }
}

pub(super) fn io_error(
    action: &'static str,
    path: &Path,
) -> impl FnOnce(std::io::Error) -> CheckpointError {
    let path = path.to_path_buf();
    move |source| CheckpointError::Io {
        action,
        path,
        source,
    }
}
