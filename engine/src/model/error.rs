//! The model's errors: bad files, bad shapes, bad tokens, and failures of the device a
//! model runs on (the device layer's [`EngineError`](crate::error::EngineError) and the
//! CUDA kernels' errors, wrapped).

use std::path::PathBuf;

/// What went wrong loading, saving or running a model, with the file, tensor or
/// position it concerns.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be opened, read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A model shape that cannot be built.
    #[error("invalid model shape: {0}")]
    InvalidConfig(String),
    /// A `config.json` that is not a GPT-2 configuration strata can run.
    #[error("{path}: {message}")]
    UnsupportedConfig {
        /// The configuration file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A file that is not a well-formed safetensors file.
    #[error("{path}: not a readable safetensors file: {message}")]
    BadSafetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A parameter the model needs is not in the file.
    #[error("{path}: tensor `{name}` is missing")]
    MissingTensor {
        /// The file.
        path: PathBuf,
        /// The tensor's name as the model expects it.
        name: String,
    },
    /// A parameter has another shape than the configuration implies.
    #[error(
        "{path}: tensor `{name}` has shape {found:?}, but the configuration needs {expected:?}"
    )]
    TensorShape {
        /// The file.
        path: PathBuf,
        /// The tensor's name in the file.
        name: String,
        /// The shape the configuration implies.
        expected: Vec<usize>,
        /// The shape the file declares.
        found: Vec<usize>,
    },
    /// A parameter stored in a type strata does not read.
    #[error("{path}: tensor `{name}` is {found}; strata reads F32, F16 and BF16")]
    TensorDtype {
        /// The file.
        path: PathBuf,
        /// The tensor's name in the file.
        name: String,
        /// The type the file declares.
        found: String,
    },
    /// A parameter's data runs past the end of the file.
    #[error(
        "{path}: tensor `{name}` is truncated: its data ends at byte {end} of the data \
         section, which holds only {available} bytes (the file was cut short)"
    )]
    TensorTruncated {
        /// The file.
        path: PathBuf,
        /// The tensor's name in the file.
        name: String,
        /// Where its data should end, in bytes from the start of the data section.
        end: usize,
        /// How many bytes of data the file holds.
        available: usize,
    },
    /// A token file whose header does not start with llm.c's magic number.
    #[error(
        "{path}: bad magic number {found}: not an llm.c token file (magic 20240520); \
         raw text is read from files not named *.bin"
    )]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// The first little-endian int32 of the file.
        found: i32,
    },
    /// A file shorter than its header says.
    #[error("{path}: file too short: {message}")]
    FileTooShort {
        /// The file.
        path: PathBuf,
        /// What was expected and what is there.
        message: String,
    },
    /// A token id the model has no embedding for.
    #[error(
        "{origin}: token {token} at position {position} is outside the vocabulary (size {vocab})"
    )]
    TokenOutOfVocab {
        /// Where the token came from: a file, or the batch given.
        origin: String,
        /// The token's index in its file (or in the batch given).
        position: u64,
        /// The token id.
        token: u32,
        /// The model's vocabulary size.
        vocab: usize,
    },
    /// Asking for a batch past the end of the token data.
    #[error(
        "{path}: batch {step} needs tokens {start}..{end} ({batch}x{seq}+1), but the file \
         holds {available} tokens"
    )]
    NotEnoughTokens {
        /// The token file.
        path: PathBuf,
        /// The batch index asked for.
        step: usize,
        /// Batch size.
        batch: usize,
        /// Sequence length.
        seq: usize,
        /// First token index the batch reads.
        start: u64,
        /// One past the last token index the batch reads.
        end: u64,
        /// Tokens in the file.
        available: u64,
    },
    /// Inputs that do not match the model or workspace.
    #[error("{0}")]
    BadInput(String),
    /// A CUDA kernel, copy or library call failed, or CUDA cannot be used here.
    #[error(transparent)]
    Cuda(#[from] strata_kernels::cuda::CudaError),
    /// The device layer failed (opening a device, its memory, its streams).
    #[error(transparent)]
    Device(#[from] crate::error::EngineError),
    /// What supplied a block's parameters to be written failed (the executor reading
    /// them from their tier, say).
    #[error("{what}: {source}")]
    Source {
        /// What was being read.
        what: String,
        /// Its error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl ModelError {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }
}
