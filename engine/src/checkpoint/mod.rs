//! Training checkpoints that a crash at any instant cannot lose: the fp32 master
//! parameters, AdamW's moments and the trainer's counters, written so that the previous
//! checkpoint stays loadable until the new one is complete, and verified when read.
//!
//! One checkpoint is a folder `root/step-00000123/` holding
//! - `model.safetensors` and `config.json`, exactly as [`weights::save_pretrained`] writes
//!   them (transformers' `from_pretrained` loads the folder);
//! - `optimizer.safetensors`: AdamW's `exp_avg.<name>` and `exp_avg_sq.<name>` per
//!   tensor, f32, under the same Hugging Face names;
//! - `trainer_state.json`: [`TrainerState`];
//! - `manifest.json`, written last: the format version, the step, and every other file's
//!   length and crc32c.
//!
//! Saving writes everything into `root/.step-00000123.tmp-<pid>/`, flushes each file and
//! the folder to the device, renames the folder to its name and flushes `root`. A crash
//! before the rename leaves only a temporary folder, which loading skips and the next
//! save removes; a crash after it leaves a complete checkpoint. A folder of the same step
//! from an earlier run is first renamed aside (`.step-00000123.old-<pid>`), and removed
//! once the new one is in place; should a crash fall between the two renames, the folder
//! set aside counts as the checkpoint until a later save puts it back.
//!
//! Loading checks the manifest, every file's length and crc32c, and every tensor's shape
//! and dtype against `config.json` before it returns anything; each problem is one line
//! naming the file and what to do. Given a root, loading takes the highest complete step
//! and does not fall back silently when that one is damaged: the error names the earlier
//! checkpoint one could resume from.
//!
//! Saves into one root are one at a time: a temporary folder is taken for an unfinished
//! save while the process that made it runs (`/proc/<pid>` exists), and for a dead one
//! otherwise. Not here: the training loop that decides when to save, and tensors that
//! live on the NVMe tier (they are gathered into host buffers by the caller).
//!
//! With ranks, each rank writes its own shard of the state ([`save_sharded`], in
//! `sharded`): the same folders, one shard file per rank and a manifest that describes
//! the shards; [`load_shard`] reads one rank's, [`load`] puts them together.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{ErrorKind, Read, Write};
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use serde::{Deserialize, Serialize};
use strata_storage::{available_bytes, format_bytes};

use crate::model::weights::{self, CONFIG_FILE, WEIGHTS_FILE};
use crate::model::{Model, ModelError};

mod sharded;
pub use sharded::{Shard, load_shard, save_sharded, shard_file};

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
const DATA_FILES: [&str; 4] = [WEIGHTS_FILE, CONFIG_FILE, OPTIMIZER_FILE, STATE_FILE];

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
        /// [`FORMAT_VERSION`].
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

fn io_error(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError {
    let path = path.to_path_buf();
    move |source| CheckpointError::Io {
        action,
        path,
        source,
    }
}

/// The folder name of the checkpoint of `step`: `step-00000123`.
pub fn dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// The step of a checkpoint folder's name, if it is one.
fn parse_dir_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.len() < 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Why a hidden folder of a save is there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LeftoverKind {
    /// `.tmp`: a save being written, or one interrupted.
    Unfinished,
    /// `.old`: a checkpoint of the same step that a save is replacing.
    Replaced,
    /// `.del`: an older checkpoint being removed by pruning.
    Deleting,
}

impl LeftoverKind {
    const ALL: [LeftoverKind; 3] = [Self::Unfinished, Self::Replaced, Self::Deleting];

    fn tag(self) -> &'static str {
        match self {
            Self::Unfinished => "tmp",
            Self::Replaced => "old",
            Self::Deleting => "del",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Self::Unfinished => "an unfinished save",
            Self::Replaced => "a replaced checkpoint",
            Self::Deleting => "a checkpoint being deleted",
        }
    }
}

/// The hidden folder of kind `kind` that this process uses for step `step` in `root`.
fn leftover_path(root: &Path, step: u64, kind: LeftoverKind) -> PathBuf {
    leftover_path_of(root, step, kind, std::process::id())
}

/// The hidden folder of kind `kind` that process `pid` uses for step `step` in `root`.
fn leftover_path_of(root: &Path, step: u64, kind: LeftoverKind, pid: u32) -> PathBuf {
    root.join(format!(".{}.{}-{pid}", dir_name(step), kind.tag()))
}

/// A hidden folder a save made: `.step-00000123.tmp-4567`.
#[derive(Debug)]
struct Leftover {
    path: PathBuf,
    step: u64,
    kind: LeftoverKind,
    pid: u32,
}

impl Leftover {
    fn parse(root: &Path, name: &str) -> Option<Self> {
        let (dir, tail) = name.strip_prefix('.')?.split_once('.')?;
        let step = parse_dir_name(dir)?;
        let (tag, pid) = tail.split_once('-')?;
        let kind = LeftoverKind::ALL.into_iter().find(|k| k.tag() == tag)?;
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        Some(Leftover {
            path: root.join(name),
            step,
            kind,
            pid: pid.parse().ok()?,
        })
    }

    /// Whether the process that made this folder may still be using it. This process's
    /// own folders are not in use between saves; where `/proc` cannot tell, every
    /// process is taken as alive, so nothing in use is ever removed.
    fn in_use(&self) -> bool {
        self.pid != std::process::id()
            && (Path::new("/proc").join(self.pid.to_string()).exists()
                || !Path::new("/proc/self").exists())
    }
}

/// What a root holds.
#[derive(Debug, Default)]
struct Scan {
    /// Complete checkpoints by step: `step-N` folders with a manifest, and, where a crash
    /// fell between the renames of a replacement, the folder set aside for a missing `step-N`.
    complete: BTreeMap<u64, PathBuf>,
    /// `step-N` folders without a manifest (copies in progress, damage).
    incomplete: Vec<(u64, PathBuf)>,
    /// Hidden folders of saves.
    leftovers: Vec<Leftover>,
}

fn scan(root: &Path) -> Result<Scan, CheckpointError> {
    let entries = fs::read_dir(root).map_err(|e| match e.kind() {
        ErrorKind::NotFound => CheckpointError::MissingDir {
            path: root.to_path_buf(),
        },
        _ => io_error("list", root)(e),
    })?;
    let mut scan = Scan::default();
    for entry in entries {
        let entry = entry.map_err(io_error("list", root))?;
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        let path = entry.path();
        if !path.is_dir() {
            continue;
        }
        if let Some(step) = parse_dir_name(&name) {
            if path.join(MANIFEST_FILE).is_file() {
                scan.complete.insert(step, path);
            } else {
                scan.incomplete.push((step, path));
            }
        } else if let Some(leftover) = Leftover::parse(root, &name) {
            scan.leftovers.push(leftover);
        }
    }
    for l in &scan.leftovers {
        if l.kind == LeftoverKind::Replaced && !l.in_use() && l.path.join(MANIFEST_FILE).is_file() {
            scan.complete
                .entry(l.step)
                .or_insert_with(|| l.path.clone());
        }
    }
    scan.incomplete.sort();
    Ok(scan)
}

/// The complete checkpoints in `root`, by step, oldest first. Skips folders without a
/// manifest and the temporary folders of saves.
pub fn list(root: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    Ok(scan(root)?.complete.into_iter().collect())
}

/// The complete checkpoint of the highest step in `root`, if any.
pub fn latest(root: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    Ok(scan(root)?.complete.into_values().next_back())
}

/// Saves `ckpt` as `root/step-NNNNNNNN` (the step of `ckpt.state`), creating `root`, and
/// returns that folder. Then keeps the newest `keep_last` (at least 1) complete
/// checkpoints up to this step, removes older ones and the temporary folders of dead
/// saves. Checkpoints of higher steps (from an earlier run) are kept, with a warning:
/// loading the root would pick them.
pub fn save(root: &Path, ckpt: &Checkpoint, keep_last: usize) -> Result<PathBuf, CheckpointError> {
    if keep_last == 0 {
        return Err(CheckpointError::BadInput(
            "keep_last is 0; keep at least the checkpoint being saved".into(),
        ));
    }
    let state = &ckpt.state;
    if !state.loss_scale.is_finite() {
        return Err(CheckpointError::BadInput(format!(
            "the loss scale is {}; a run continues only from a finite one",
            state.loss_scale
        )));
    }
    let model = &ckpt.model;
    let bad = |e: ModelError| CheckpointError::BadInput(e.to_string());
    // Checks the three buffer sets against the layout before anything is written.
    let mut optimizer = weights::block_views(model, &ckpt.m, EXP_AVG_PREFIX).map_err(bad)?;
    optimizer.extend(weights::block_views(model, &ckpt.v, EXP_AVG_SQ_PREFIX).map_err(bad)?);
    weights::block_views(model, &ckpt.params, "").map_err(bad)?;
    for (name, buffers) in [("params", &ckpt.params), ("m", &ckpt.m), ("v", &ckpt.v)] {
        assert_gaps_zero(model, name, buffers);
    }
    let state_json = serde_json::to_vec_pretty(state).expect("JSON of numbers and a JSON value");

    let step = state.step;
    if !root.exists() {
        fs::create_dir_all(root).map_err(io_error("create", root))?;
        if let Some(parent) = root.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync_dir(parent)?;
        }
    }
    check_space(root, step, needed_bytes(model, state_json.len()))?;

    let tmp = leftover_path(root, step, LeftoverKind::Unfinished);
    if tmp.exists() {
        // An earlier save of this process failed here.
        fs::remove_dir_all(&tmp).map_err(io_error("remove", &tmp))?;
    }
    fs::create_dir(&tmp).map_err(io_error("create", &tmp))?;
    let written =
        write_files(&tmp, ckpt, optimizer, &state_json).and_then(|()| publish(root, &tmp, step));
    let dir = match written {
        Ok(dir) => dir,
        Err(e) => {
            // A failed save leaves nothing behind (a full disk stays as full as it was).
            if let Err(cleanup) = fs::remove_dir_all(&tmp)
                && cleanup.kind() != ErrorKind::NotFound
            {
                log::warn!("could not remove {}: {cleanup}", tmp.display());
            }
            return Err(e);
        }
    };
    log::info!("saved checkpoint {}", dir.display());
    prune(root, step, keep_last);
    Ok(dir)
}

/// Panics unless every alignment gap of `buffers` is zero: the files hold tensors only,
/// so a nonzero gap would not come back, and gaps are zero by the layout's contract.
fn assert_gaps_zero(model: &Model, name: &str, buffers: &[Vec<f32>]) {
    for (block, buffer) in model.blocks().iter().zip(buffers) {
        // A gap runs from a tensor's end to the next one's start (or the block's end).
        let ends = block.tensors.iter().map(|t| t.slot.range().end);
        let next_starts = block.tensors.iter().skip(1).map(|t| t.slot.offset);
        for (start, end) in ends.zip(next_starts.chain([block.len])) {
            assert!(
                buffer[start..end].iter().all(|x| x.to_bits() == 0),
                "{name}: block {:?} has a nonzero alignment gap at elements {start}..{end}",
                block.kind
            );
        }
    }
}

/// An upper bound of the bytes a checkpoint of `model` takes: three f32 copies of every
/// parameter, the safetensors headers, and the small files.
fn needed_bytes(model: &Model, state_json_bytes: usize) -> u64 {
    let params = model.param_count() as u64;
    let tensors: u64 = model.blocks().iter().map(|b| b.tensors.len() as u64).sum();
    // A header entry: `"exp_avg_sq.transformer.<name>":{"dtype":"F32","shape":[a,b],
    // "data_offsets":[x,y]}`, at most a few hundred bytes with 20-digit numbers.
    let header_per_tensor = 256u64;
    let small_files = 64 * 1024;
    3 * 4 * params + 3 * tensors * header_per_tensor + state_json_bytes as u64 + small_files
}

fn check_space(root: &Path, step: u64, needed_bytes: u64) -> Result<(), CheckpointError> {
    let available_bytes = available_bytes(root)?;
    if available_bytes < needed_bytes {
        return Err(CheckpointError::NoSpace {
            dir: root.to_path_buf(),
            step,
            needed_bytes,
            available_bytes,
        });
    }
    Ok(())
}

/// Writes every file of `ckpt` into `dir`, each flushed to the device, the manifest last,
/// and flushes `dir`.
fn write_files(
    dir: &Path,
    ckpt: &Checkpoint,
    optimizer: Vec<(String, weights::F32View<'_>)>,
    state_json: &[u8],
) -> Result<(), CheckpointError> {
    let write_error = |source| CheckpointError::Write {
        dir: dir.to_path_buf(),
        source,
    };
    weights::save_pretrained(&ckpt.model, &ckpt.params, dir).map_err(write_error)?;
    weights::write_safetensors(optimizer, &dir.join(OPTIMIZER_FILE)).map_err(write_error)?;
    write_synced(&dir.join(STATE_FILE), state_json)?;
    let mut files = BTreeMap::new();
    for file in DATA_FILES {
        // Digests of the bytes read back from the files: what a later load will compare.
        files.insert(file.to_string(), digest(&dir.join(file))?);
    }
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        step: ckpt.state.step,
        files,
        shards: None,
    };
    let text = serde_json::to_vec_pretty(&manifest).expect("JSON of numbers");
    write_synced(&dir.join(MANIFEST_FILE), &text)?;
    sync_dir(dir)
}

/// Renames the written folder `tmp` to `root/step-N`, setting aside and then removing a
/// folder of that name from an earlier run, and flushes `root`.
fn publish(root: &Path, tmp: &Path, step: u64) -> Result<PathBuf, CheckpointError> {
    let dir = root.join(dir_name(step));
    let aside = leftover_path(root, step, LeftoverKind::Replaced);
    let replacing = dir.exists();
    if replacing {
        log::warn!(
            "replacing the checkpoint {} of an earlier run",
            dir.display()
        );
        fs::rename(&dir, &aside).map_err(io_error("set aside", &dir))?;
    }
    if let Err(e) = fs::rename(tmp, &dir) {
        if replacing && let Err(back) = fs::rename(&aside, &dir) {
            log::warn!(
                "could not put {} back to {}: {back}",
                aside.display(),
                dir.display()
            );
        }
        return Err(io_error("rename into place", tmp)(e));
    }
    sync_dir(root)?;
    if replacing && let Err(e) = fs::remove_dir_all(&aside) {
        log::warn!("could not remove the replaced {}: {e}", aside.display());
    }
    Ok(dir)
}

/// Removes the hidden folders of dead saves (putting back a replaced checkpoint whose
/// replacement never arrived), then the complete checkpoints older than the newest
/// `keep_last` up to `step`. Failures are warnings: the new checkpoint is already safe.
fn prune(root: &Path, step: u64, keep_last: usize) {
    let pruned = scan(root).and_then(|found| {
        for l in found.leftovers.iter().filter(|l| !l.in_use()) {
            let named = root.join(dir_name(l.step));
            if l.kind == LeftoverKind::Replaced && !named.exists() {
                log::warn!(
                    "putting back {} as {}: a save replacing it was interrupted",
                    l.path.display(),
                    named.display()
                );
                fs::rename(&l.path, &named).map_err(io_error("rename", &l.path))?;
            } else {
                log::info!("removing {} ({})", l.path.display(), l.kind.describe());
                fs::remove_dir_all(&l.path).map_err(io_error("remove", &l.path))?;
            }
        }
        let found = scan(root)?;
        let newer: Vec<String> = found
            .complete
            .range(step + 1..)
            .map(|(_, p)| p.display().to_string())
            .collect();
        if !newer.is_empty() {
            log::warn!(
                "{} holds checkpoints of later steps than the {step} just saved, from an \
                 earlier run: {}; loading the folder picks the latest, so remove them to \
                 continue this run from it",
                root.display(),
                newer.join(", ")
            );
        }
        for (&old, path) in found.complete.range(..step).rev().skip(keep_last - 1) {
            // Renamed first, so an interrupted removal leaves a hidden folder the next
            // save removes, not a half-deleted checkpoint.
            let doomed = leftover_path(root, old, LeftoverKind::Deleting);
            fs::rename(path, &doomed).map_err(io_error("rename", path))?;
            fs::remove_dir_all(&doomed).map_err(io_error("remove", &doomed))?;
        }
        Ok(())
    });
    if let Err(e) = pruned {
        log::warn!("pruning old checkpoints in {}: {e}", root.display());
    }
}

/// Loads a checkpoint: `path` is a checkpoint folder, or a root holding several, of which
/// the highest complete step is loaded. Everything is verified first (manifest, lengths,
/// crc32c, tensor shapes and dtypes). A sharded checkpoint (one written by ranks) is put
/// together from every rank's shard.
pub fn load(path: &Path) -> Result<Checkpoint, CheckpointError> {
    load_dir(&resolve(path)?)
}

/// The checkpoint folder `path` names: `path` itself when it is one, else the complete
/// checkpoint of the highest step in the root `path`.
pub fn resolve(path: &Path) -> Result<PathBuf, CheckpointError> {
    if !path.exists() {
        return Err(CheckpointError::MissingDir {
            path: path.to_path_buf(),
        });
    }
    let is_checkpoint = path.join(MANIFEST_FILE).exists()
        || path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| parse_dir_name(n).is_some());
    if is_checkpoint {
        return Ok(path.to_path_buf());
    }
    let found = scan(path)?;
    let Some((&step, dir)) = found.complete.last_key_value() else {
        let skipped: Vec<String> = found
            .incomplete
            .iter()
            .map(|(_, p)| format!("{} has no {MANIFEST_FILE}", p.display()))
            .chain(
                found
                    .leftovers
                    .iter()
                    .map(|l| format!("{} is {}", l.path.display(), l.kind.describe())),
            )
            .collect();
        return Err(CheckpointError::NoCheckpoint {
            root: path.to_path_buf(),
            skipped: if skipped.is_empty() {
                String::new()
            } else {
                format!(" (skipped: {})", skipped.join(", "))
            },
        });
    };
    for (_, p) in found.incomplete.iter().filter(|(s, _)| *s > step) {
        log::warn!(
            "skipping {}: it has no {MANIFEST_FILE}, so it is not a complete checkpoint",
            p.display()
        );
    }
    log::info!(
        "{} is the latest complete checkpoint in {}",
        dir.display(),
        path.display()
    );
    Ok(dir.clone())
}

/// How many ranks wrote the checkpoint folder `dir`: `None` for an ordinary checkpoint
/// (one file of each kind), `Some(n)` for a sharded one. Reads only its manifest.
pub fn written_by_ranks(dir: &Path) -> Result<Option<usize>, CheckpointError> {
    Ok(Dir(dir).manifest()?.shards.map(|l| l.ranks))
}

/// The manifest: the format version, the step, and each data file's length and crc32c.
#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    format_version: u32,
    step: u64,
    files: BTreeMap<String, FileDigest>,
    /// A sharded checkpoint's layout (absent in an ordinary one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    shards: Option<sharded::Layout>,
}

/// A file's length and crc32c.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct FileDigest {
    len_bytes: u64,
    crc32c: u32,
}

/// What to do when the checkpoint `dir` cannot be used: the earlier checkpoint beside it,
/// if there is one.
fn advice(dir: &Path) -> String {
    let step = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(parse_dir_name);
    let root = dir.parent().unwrap_or(Path::new("."));
    let earlier = step.and_then(|step| {
        scan(root)
            .ok()?
            .complete
            .range(..step)
            .next_back()
            .map(|(_, p)| p.clone())
    });
    match earlier {
        Some(p) => format!(
            "resume from the earlier checkpoint {} instead, or start without --resume",
            p.display()
        ),
        None => format!(
            "there is no earlier checkpoint in {}: start without --resume",
            root.display()
        ),
    }
}

/// The errors of one checkpoint folder, each naming it and what to do instead.
struct Dir<'a>(&'a Path);

impl Dir<'_> {
    fn missing(&self, file: &str) -> CheckpointError {
        CheckpointError::MissingFile {
            dir: self.0.to_path_buf(),
            file: file.into(),
            advice: advice(self.0),
        }
    }

    fn bad_json(&self, file: &str, message: String) -> CheckpointError {
        CheckpointError::BadJson {
            dir: self.0.to_path_buf(),
            file: file.into(),
            message,
            advice: advice(self.0),
        }
    }

    fn invalid(&self, message: String) -> CheckpointError {
        CheckpointError::Invalid {
            dir: self.0.to_path_buf(),
            message,
            advice: advice(self.0),
        }
    }

    fn read(&self, file: &str) -> Result<Vec<u8>, CheckpointError> {
        let path = self.0.join(file);
        fs::read(&path).map_err(|e| match e.kind() {
            ErrorKind::NotFound => self.missing(file),
            _ => io_error("read", &path)(e),
        })
    }

    /// A model error reading `file`, as the checkpoint's error.
    fn model_error(&self, file: &str, e: ModelError) -> CheckpointError {
        match e {
            ModelError::TensorShape {
                name,
                expected,
                found,
                ..
            } => CheckpointError::Shape {
                dir: self.0.to_path_buf(),
                file: file.into(),
                tensor: name.into(),
                expected: expected.into(),
                found: found.into(),
                advice: advice(self.0),
            },
            ModelError::TensorDtype { name, found, .. } => CheckpointError::Dtype {
                dir: self.0.to_path_buf(),
                file: file.into(),
                tensor: name.into(),
                found,
                advice: advice(self.0),
            },
            other => self.invalid(other.to_string()),
        }
    }

    /// The manifest: its version before its shape, so a future layout is named as such;
    /// its step against the folder's name.
    fn manifest(&self) -> Result<Manifest, CheckpointError> {
        let text = self.read(MANIFEST_FILE)?;
        let json: serde_json::Value = serde_json::from_slice(&text)
            .map_err(|e| self.bad_json(MANIFEST_FILE, e.to_string()))?;
        let version = json
            .get("format_version")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| self.bad_json(MANIFEST_FILE, "no integer `format_version`".into()))?;
        if version != u64::from(FORMAT_VERSION) {
            return Err(CheckpointError::Version {
                dir: self.0.to_path_buf(),
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        let manifest: Manifest = serde_json::from_value(json)
            .map_err(|e| self.bad_json(MANIFEST_FILE, e.to_string()))?;
        let named_step = self
            .0
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(parse_dir_name);
        if let Some(named) = named_step.filter(|&s| s != manifest.step) {
            return Err(self.invalid(format!(
                "{MANIFEST_FILE} says step {}, the folder's name step {named}",
                manifest.step
            )));
        }
        Ok(manifest)
    }

    /// Checks that every one of `files` is listed in `manifest` and has its length (all
    /// first, as that is cheap), then that the bytes of those `checksummed` picks have
    /// its crc32c.
    fn verify<'f>(
        &self,
        manifest: &Manifest,
        files: impl IntoIterator<Item = &'f str>,
        checksummed: impl Fn(&str) -> bool,
    ) -> Result<(), CheckpointError> {
        let mut expected = Vec::new();
        for file in files {
            let want = *manifest
                .files
                .get(file)
                .ok_or_else(|| self.invalid(format!("{MANIFEST_FILE} lists no {file}")))?;
            let path = self.0.join(file);
            let len_bytes = match fs::metadata(&path) {
                Ok(meta) => meta.len(),
                Err(e) if e.kind() == ErrorKind::NotFound => return Err(self.missing(file)),
                Err(e) => return Err(io_error("inspect", &path)(e)),
            };
            if len_bytes != want.len_bytes {
                return Err(CheckpointError::Length {
                    dir: self.0.to_path_buf(),
                    file: file.into(),
                    len_bytes,
                    expected_bytes: want.len_bytes,
                    advice: advice(self.0),
                });
            }
            if checksummed(file) {
                expected.push((file, path, want));
            }
        }
        for (file, path, want) in expected {
            let got = digest(&path)?;
            // The length is read again: a file that changed since the check is caught too.
            if got != want {
                return Err(CheckpointError::Checksum {
                    dir: self.0.to_path_buf(),
                    file: file.into(),
                    actual: got.crc32c,
                    expected: want.crc32c,
                    advice: advice(self.0),
                });
            }
        }
        Ok(())
    }

    /// The trainer's state (checked against the manifest's step) and the model of
    /// `config.json`. Their files must have been verified.
    fn state_and_model(
        &self,
        manifest: &Manifest,
    ) -> Result<(TrainerState, Model), CheckpointError> {
        let state: TrainerState = serde_json::from_slice(&self.read(STATE_FILE)?)
            .map_err(|e| self.bad_json(STATE_FILE, e.to_string()))?;
        if state.step != manifest.step {
            return Err(self.invalid(format!(
                "{STATE_FILE} says step {}, {MANIFEST_FILE} step {}",
                state.step, manifest.step
            )));
        }
        let model = weights::load_config(&self.0.join(CONFIG_FILE))
            .map_err(|e| self.model_error(CONFIG_FILE, e))?;
        Ok((state, model))
    }

    /// The tensors of `file`, which must all be f32.
    fn f32_tensors(&self, file: &str) -> Result<weights::WeightFiles, CheckpointError> {
        let st = weights::SafetensorsFile::open(&self.0.join(file))
            .map_err(|e| self.model_error(file, e))?;
        if let Some((name, info)) = st.tensors.iter().find(|(_, i)| i.dtype != Dtype::F32) {
            return Err(self.model_error(
                file,
                ModelError::TensorDtype {
                    path: self.0.join(file),
                    name: name.clone(),
                    found: info.dtype.to_string(),
                },
            ));
        }
        Ok(weights::WeightFiles::single(st))
    }
}

/// Loads and verifies the checkpoint in folder `dir`; a sharded one is put together
/// from every rank's shard.
fn load_dir(dir: &Path) -> Result<Checkpoint, CheckpointError> {
    let d = Dir(dir);
    let manifest = d.manifest()?;
    if let Some(layout) = &manifest.shards {
        return sharded::load_whole(dir, &manifest, layout);
    }
    d.verify(&manifest, DATA_FILES, |_| true)?;
    let (state, model) = d.state_and_model(&manifest)?;
    let tensors = |file: &str, prefixes: &[&str]| {
        let st = d.f32_tensors(file)?;
        prefixes
            .iter()
            .map(|p| {
                st.read_blocks(&model, p)
                    .map_err(|e| d.model_error(file, e))
            })
            .collect::<Result<Vec<_>, _>>()
    };
    let params = tensors(WEIGHTS_FILE, &[""])?.remove(0);
    let [m, v]: [Vec<Vec<f32>>; 2] = tensors(OPTIMIZER_FILE, &[EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX])?
        .try_into()
        .expect("two prefixes, two buffer sets");
    Ok(Checkpoint {
        model,
        params,
        m,
        v,
        state,
    })
}

/// The length and crc32c of the file at `path`, read in 1 MiB pieces.
fn digest(path: &Path) -> Result<FileDigest, CheckpointError> {
    let mut file = File::open(path).map_err(io_error("open", path))?;
    let mut buffer = vec![0u8; 1 << 20];
    let (mut len_bytes, mut crc) = (0u64, strata_storage::crc::Crc32c::new());
    loop {
        let n = match file.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_error("read", path)(e)),
        };
        crc.update(&buffer[..n]);
        len_bytes += n as u64;
    }
    Ok(FileDigest {
        len_bytes,
        crc32c: crc.value(),
    })
}

/// Writes `bytes` to a new file at `path` and flushes it to the device.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut file = File::create(path).map_err(io_error("create", path))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(io_error("write", path))
}

/// Flushes folder `dir` to the device, so the names created or renamed in it persist.
fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error("flush", dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        assert_eq!(dir_name(123), "step-00000123");
        assert_eq!(parse_dir_name(&dir_name(123)), Some(123));
        assert_eq!(
            parse_dir_name(&dir_name(123_456_789_012)),
            Some(123_456_789_012)
        );
        for name in [
            "step-123",
            "step-+0000123",
            "step-0000012a",
            "xstep-00000001",
        ] {
            assert_eq!(parse_dir_name(name), None, "{name}");
        }
        let root = Path::new("/r");
        for kind in LeftoverKind::ALL {
            let path = leftover_path(root, 7, kind);
            let name = path.file_name().unwrap().to_str().unwrap();
            let l = Leftover::parse(root, name).unwrap();
            assert_eq!((l.step, l.kind, l.pid), (7, kind, std::process::id()));
            assert_eq!(l.path, path);
            assert!(!l.in_use(), "this process's own folders are not in use");
        }
        assert!(Leftover::parse(root, ".step-00000007.tmp-x1").is_none());
        assert!(Leftover::parse(root, ".step-00000007.new-1").is_none());
        assert!(Leftover::parse(root, "step-00000007.tmp-1").is_none());
    }

    #[test]
    fn too_little_space_names_the_folder_and_both_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let needed = u64::MAX / 2;
        let text = check_space(dir.path(), 9, needed).unwrap_err().to_string();
        assert!(text.contains(&dir.path().display().to_string()), "{text}");
        assert!(text.contains(&format!("needs {needed} bytes")), "{text}");
        assert!(text.contains(") are available"), "{text}");
        assert!(!text.contains('\n'), "{text}");
        check_space(dir.path(), 9, 4096).unwrap();
    }

    #[test]
    fn loss_scales_survive_json_exactly() {
        // serde_json writes an f32 as its shortest decimal and reads it back through f64;
        // a run continues bit-identically only if that is exact.
        let mut bits = 0x3f80_0000u32;
        for _ in 0..100_000 {
            bits = bits.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let x = f32::from_bits(bits);
            if !x.is_finite() {
                continue;
            }
            let text = serde_json::to_string(&x).unwrap();
            let back: f32 = serde_json::from_str(&text).unwrap();
            assert_eq!(back.to_bits(), x.to_bits(), "{x:e} as {text}");
        }
    }
}
