//! What a checkpoint holds, as data: its files' names and format version, the trainer's
//! counters ([`TrainerState`]), a whole training state ([`Checkpoint`]), and the manifest
//! that lists every file's length and crc32c (with a sharded checkpoint's layout).
//!
//! Not here: writing and reading them (`whole`, `sharded`, `verify`), and the folders
//! they live in (`folder`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::error::CheckpointError;
use crate::model::Model;
use crate::model::weights::{CONFIG_FILE, WEIGHTS_FILE};

/// The version of the layout this module writes and reads (in `manifest.json`).
pub const FORMAT_VERSION: u32 = 1;
/// The optimizer state's file name in a checkpoint.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The trainer state's file name in a checkpoint.
pub const STATE_FILE: &str = "trainer_state.json";
/// The manifest's file name in a checkpoint; a checkpoint is complete when it is there.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Prefix of AdamW's first moment's tensor names in [`OPTIMIZER_FILE`].
pub const EXP_AVG_PREFIX: &str = "exp_avg.";
/// Prefix of AdamW's second moment's tensor names in [`OPTIMIZER_FILE`].
pub const EXP_AVG_SQ_PREFIX: &str = "exp_avg_sq.";

/// The files of a checkpoint the manifest covers, in the order they are written.
pub(super) const DATA_FILES: [&str; 4] = [WEIGHTS_FILE, CONFIG_FILE, OPTIMIZER_FILE, STATE_FILE];

/// Everything besides tensors needed to continue a run bit-identically.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps completed; also the checkpoint's folder name.
    pub step: u64,
    /// Index of the next batch to read.
    pub data_position: u64,
    /// State of the trainer's random number stream.
    pub rng: u64,
    /// fp16 dynamic loss scaling: the current scale (1.0 without loss scaling). Finite.
    pub loss_scale: f32,
    /// Steps since the last overflow.
    pub good_steps: u64,
    /// Steps skipped because their gradients overflowed.
    pub skipped_steps: u64,
    /// The run's merged training configuration, for the record.
    pub config: serde_json::Value,
}

impl TrainerState {
    /// The counters after `step` steps that read `data_position` batches, without loss
    /// scaling or skipped steps.
    pub fn after(step: u64, data_position: u64, rng: u64) -> Self {
        TrainerState {
            step,
            data_position,
            rng,
            loss_scale: 1.0,
            good_steps: step,
            skipped_steps: 0,
            config: serde_json::Value::Null,
        }
    }
}

/// A whole training state: the model's shape, its fp32 master parameters, AdamW's
/// moments and the trainer's counters.
#[derive(Clone)]
pub struct Checkpoint {
    /// The model (its [`Gpt2Config`](crate::model::Gpt2Config) goes to `config.json`).
    pub model: Model,
    /// fp32 master parameters, one buffer per block in the model's layout (alignment
    /// gaps zero).
    pub params: Vec<Vec<f32>>,
    /// AdamW's first moment, same layout.
    pub m: Vec<Vec<f32>>,
    /// AdamW's second moment, same layout.
    pub v: Vec<Vec<f32>>,
    /// The trainer's counters.
    pub state: TrainerState,
}

/// The manifest: the format version, the step, and each data file's length and crc32c.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Manifest {
    pub(super) format_version: u32,
    pub(super) step: u64,
    pub(super) files: BTreeMap<String, FileDigest>,
    /// A sharded checkpoint's layout (absent in an ordinary one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) shards: Option<ShardLayout>,
}

/// A file's length and crc32c.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct FileDigest {
    pub(super) len_bytes: u64,
    pub(super) crc32c: u32,
}

/// A sharded checkpoint's layout, in its manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct ShardLayout {
    /// The ranks that wrote it, one file each.
    pub(super) ranks: usize,
    /// Per block, the elements of each rank's shard.
    pub(super) shard_len: Vec<usize>,
}

/// One block's master parameters, AdamW's m and v, in that order (each the block's
/// length, the model's layout).
pub type BlockState = [Vec<f32>; 3];

/// One block's master parameters, AdamW's m and v, lent where their source holds them
/// (each the block's length, the model's layout).
pub type BlockStateRef<'a> = [&'a [f32]; 3];

/// What the writer of a checkpoint does with one block's state: writes it to the files.
pub type PutBlock<'a> = dyn FnMut(BlockStateRef<'_>) -> Result<(), CheckpointError> + 'a;

/// What supplies each block's state to [`save_blocks`](super::save_blocks): called once per block, in order,
/// with the block and the writer to lend its state to (so that the save copies nothing
/// the source already holds); returns what the writer returned, or the source's own
/// error.
pub type ReadBlock<'a> = dyn FnMut(
        usize,
        &mut PutBlock<'_>,
    ) -> Result<Result<(), CheckpointError>, Box<dyn std::error::Error + Send + Sync>>
    + 'a;
