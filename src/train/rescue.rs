//! What a run keeps when it cannot go on: a step that failed (a data error, an I/O error
//! of a tier), a non-finite loss, a metrics or checkpoint write that failed, or an
//! `--out` that could not be written. Its state is saved as a checkpoint (the engine's
//! format, resumable with `--resume`) in `<--checkpoint-dir>/rescue`, else (or when that
//! fails) in the run's rescue folder, `<scratch>/strata-rescue/run-<pid>`; when it cannot
//! be saved, the message names the last checkpoint that remains. Ctrl-C without
//! `--checkpoint-dir` saves in the rescue folder too. Emergency saves stay out of
//! `--checkpoint-dir` itself, which holds the schedule's checkpoints only (so that
//! `--keep-checkpoints` never drops one of those for a rescue).
//!
//! Not here: the regular checkpoints' schedule ([`super::steps`]) or the checkpoint format
//! (`strata_engine::checkpoint`).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use strata_engine::checkpoint::{self, TrainerState};
use strata_engine::exec::Executor;
use strata_engine::plan::fmt_bytes;

use super::group::Ranks;
use crate::machine::default_scratch_dir;
use crate::train_config::TrainConfig;

type Error = Box<dyn std::error::Error>;

/// Why a run stopped before its last step, and whether its state can be kept.
pub struct Stop {
    /// What happened, one line.
    pub why: String,
    /// Whether the loop's trainer state describes the executor's state.
    pub kept: Kept,
}

/// Whether the state a run stopped in is worth saving.
pub enum Kept {
    /// The trainer state describes the executor's parameters and optimizer state.
    State,
    /// Not consistent (the reason): only the last checkpoint remains.
    Lost(String),
}

impl Stop {
    /// A stop after `error`, the executor's state that of the trainer state.
    pub fn kept(error: impl Into<Error>) -> Stop {
        Stop {
            why: error.into().to_string(),
            kept: Kept::State,
        }
    }
}

/// This process's rescue folder: `<scratch>/strata-rescue/run-<pid>`.
pub fn default_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        default_scratch_dir()
            .join("strata-rescue")
            .join(format!("run-{}", std::process::id()))
    })
}

/// Writes a checkpoint of `exec` at `state` in `dir` (with ranks, each rank its shard, a
/// collective); its path.
pub fn write_checkpoint(
    exec: &Executor,
    ranks: &Ranks,
    dir: &Path,
    state: &TrainerState,
    keep: usize,
) -> Result<PathBuf, Error> {
    let started = Instant::now();
    let Some(group) = &ranks.group else {
        return save_alone(exec, dir, state, keep, started);
    };
    // Each rank its shard, a block at a time, lent from its tier as the file reaches it.
    let mut read = |b: usize, put: &mut checkpoint::PutBlock<'_>| {
        exec.with_shard_state(b, put)
            .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
    };
    let shard_len: Vec<usize> = exec.plan().shard_len.iter().map(|&s| s as usize).collect();
    let saved = checkpoint::save_sharded_blocks(
        dir,
        group.as_ref(),
        exec.model(),
        &shard_len,
        state,
        &mut read,
        keep,
    )?;
    let bytes = 12 * shard_len.iter().sum::<usize>() as u64;
    log_rate(&saved, bytes, started, "this rank's shard");
    Ok(saved)
}

/// Writes a checkpoint of `exec` (alone) at `state` in `dir` a block at a time, each
/// block's state read from its tier as the file reaches it; logs the rate.
fn save_alone(
    exec: &Executor,
    dir: &Path,
    state: &TrainerState,
    keep: usize,
    started: Instant,
) -> Result<PathBuf, Error> {
    let mut read = |b: usize, put: &mut checkpoint::PutBlock<'_>| {
        exec.with_block_state(b, put)
            .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
    };
    let saved = checkpoint::save_blocks(dir, exec.model(), state, &mut read, keep)?;
    log_rate(
        &saved.dir,
        saved.bytes,
        started,
        &format!(
            "at most {} of state in RAM at once",
            fmt_bytes(saved.staged_bytes_max)
        ),
    );
    Ok(saved.dir)
}

/// Logs a save of `bytes` into `dir` begun at `started`.
fn log_rate(dir: &Path, bytes: u64, started: Instant, what: &str) {
    let seconds = started.elapsed().as_secs_f64();
    log::info!(
        "checkpoint {}: {} in {seconds:.2} s ({:.0} MB/s), {what}",
        dir.display(),
        fmt_bytes(bytes),
        bytes as f64 / seconds.max(1e-9) / 1e6,
    );
}

/// Keeps `exec`'s state, `state` (a delayed update already applied): names
/// `last_saved` when it holds that step, else saves it in `<--checkpoint-dir>/rescue` or,
/// failing that, this process's rescue folder. What was kept, in words for the end of an error message.
pub fn keep(
    cfg: &TrainConfig,
    exec: &Executor,
    ranks: &Ranks,
    state: &TrainerState,
    last_saved: Option<&Path>,
) -> String {
    if let Some(last) = last_saved.filter(|p| checkpoint_step(p) == Some(state.step)) {
        return format!(
            "the state after step {} is in the checkpoint {} (--resume it)",
            state.step,
            last.display()
        );
    }
    if ranks.ranks > 1 {
        return format!(
            "an emergency save is not made with ranks; {}",
            last_checkpoint(last_saved)
        );
    }
    let mut failures = Vec::new();
    let dirs = cfg.checkpoint_dir.iter().map(|d| d.join("rescue"));
    for dir in dirs.chain([default_dir().to_path_buf()]) {
        match write_checkpoint(exec, ranks, &dir, state, cfg.keep_checkpoints) {
            Ok(path) => {
                return format!(
                    "kept the state after step {} in {} (resume with --resume {})",
                    state.step,
                    path.display(),
                    path.display()
                );
            }
            Err(e) => failures.push(format!("{}: {e}", dir.display())),
        }
    }
    format!(
        "the emergency save failed ({}); {}",
        failures.join("; "),
        last_checkpoint(last_saved)
    )
}

/// Which checkpoint remains, in words.
pub fn last_checkpoint(last_saved: Option<&Path>) -> String {
    match last_saved {
        Some(p) => format!(
            "the last checkpoint, {}, remains (--resume it)",
            p.display()
        ),
        None => "no checkpoint of this run remains".to_string(),
    }
}

/// The step of a checkpoint folder `step-N`.
fn checkpoint_step(path: &Path) -> Option<u64> {
    checkpoint::parse_dir_name(path.file_name()?.to_str()?)
}
