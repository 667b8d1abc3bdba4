//! Training checkpoints that a crash at any instant cannot lose: the fp32 master
//! parameters, AdamW's moments and the trainer's counters, written so that the previous
//! checkpoint stays loadable until the new one is complete, and verified when read.
//!
//! One checkpoint is a folder `root/step-00000123/` holding
//! - `model.safetensors` and `config.json`, exactly as
//!   [`save_pretrained`](crate::model::weights::save_pretrained) writes
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
//! otherwise. Not here: the training loop that decides when to save.
//!
//! A checkpoint is written and read a block at a time ([`save_blocks`], [`open`]): the
//! caller hands over (or takes) one block's parameters, m and v at a time, from or to
//! whichever tier the block lives on, so that a model whose state is larger than memory
//! is checkpointed in the RAM of its largest block. [`save`] and [`load`] do the same
//! from and to a whole [`Checkpoint`] in memory.
//!
//! With ranks, each rank writes its own shard of the state ([`save_sharded`], in
//! `sharded`): the same folders, one shard file per rank and a manifest that describes
//! the shards; [`load_shard`] reads one rank's, [`load`] puts them together.
//!
//! The files: `format` (what a checkpoint holds), `folder` (the root's folders),
//! `verify` (reading a folder), `stream` (a tensor file written and read a tensor at a
//! time), `blocks` (saving and loading a block at a time), `whole` and `sharded` (whole
//! states and ranks' shards), `error`.

mod blocks;
mod error;
mod folder;
mod format;
mod sharded;
mod stream;
mod verify;
mod whole;

pub use blocks::{Opened, SaveReport, load_shard, needed_bytes, open, open_shard, save_blocks};
pub use error::CheckpointError;
pub use folder::{dir_name, latest, list, parse_dir_name, resolve};
pub use format::{
    BlockState, BlockStateRef, Checkpoint, EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX, FORMAT_VERSION,
    MANIFEST_FILE, OPTIMIZER_FILE, PutBlock, ReadBlock, STATE_FILE, TrainerState,
};
pub use sharded::{Shard, save_sharded, save_sharded_blocks, shard_file};
pub use stream::SAVE_HELD_BYTES;
pub use verify::written_by_ranks;
pub use whole::{load, save};
