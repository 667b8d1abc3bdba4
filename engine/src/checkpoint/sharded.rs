//! Sharded checkpoints: with N ranks, each rank writes the shard of the training state it
//! owns, and no rank ever holds the whole of it.
//!
//! A sharded checkpoint is a folder `root/step-00000123/` (the same names, and the same
//! crash safety, as an ordinary one) holding
//! - `shard-0000r-of-0000N.safetensors`, one per rank (r counted from 1): per block `b`,
//!   the rank's shard of the fp32 master parameters, AdamW's m and v, as the f32 vectors
//!   `master.b`, `exp_avg.b` and `exp_avg_sq.b` of the shard's length. Rank r (from 0)
//!   owns elements `r * shard_len[b] ..` of the block's flat buffer (the model's layout);
//!   past the block's end a shard is zero.
//! - `config.json` and `trainer_state.json`, as in an ordinary checkpoint;
//! - `manifest.json`, written last by rank 0: the format version, the step, every file's
//!   length and crc32c, and `shards`: the number of ranks and each block's shard length.
//!
//! Saving is a collective: every rank of the group calls [`save_sharded`]. Rank 0 makes
//! the temporary folder, every rank writes and flushes its file in it, rank 0 then
//! writes the small files and the manifest and renames the folder into place. After
//! each phase the ranks exchange whether they succeeded, so a rank that fails makes
//! every rank return an error (naming it) and leaves the previous checkpoint as it was.
//! The checkpoint root must be one folder for every rank: one machine's filesystem, or
//! a shared one.
//!
//! Loading: [`load_shard`] reads and verifies one rank's file (and the small ones) for a
//! resume by the same number of ranks; [`open`](super::open) reads every shard's part of
//! one block at a time, for a resume by another number of ranks or an export.

use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use strata_comm::Collective;

use super::error::{CheckpointError, io_error};
use super::folder::{
    LeftoverKind, check_space, dir_name, leftover_path, leftover_path_of, prune, publish, sync_dir,
    write_synced,
};
use super::format::{
    BlockStateRef, FORMAT_VERSION, FileDigest, MANIFEST_FILE, Manifest, PutBlock, ReadBlock,
    STATE_FILE, ShardLayout, TrainerState,
};
use super::stream::TensorWriter;
use super::verify::{Dir, digest};
use crate::model::Model;
use crate::model::weights::{self, CONFIG_FILE, FileDtype};

/// The file of rank `rank` (from 0) of `ranks`: `shard-00001-of-00002.safetensors`.
pub fn shard_file(rank: usize, ranks: usize) -> String {
    format!("shard-{:05}-of-{ranks:05}.safetensors", rank + 1)
}

/// The names of block `b`'s master parameters, m and v in a shard file.
pub(super) fn tensor_names(b: usize) -> [String; 3] {
    [
        format!("master.{b}"),
        format!("exp_avg.{b}"),
        format!("exp_avg_sq.{b}"),
    ]
}

/// One rank's part of a training state.
#[derive(Debug, Clone)]
pub struct Shard {
    /// The whole model.
    pub model: Model,
    /// The ranks that share the state.
    pub ranks: usize,
    /// This rank (from 0).
    pub rank: usize,
    /// Per block, the elements of each rank's shard (the plan's `shard_len`).
    pub shard_len: Vec<usize>,
    /// Per block, this rank's shard of the fp32 master parameters (`shard_len[b]`
    /// elements, zero past the block's end).
    pub params: Vec<Vec<f32>>,
    /// AdamW's first moment, the same shards.
    pub m: Vec<Vec<f32>>,
    /// AdamW's second moment, the same shards.
    pub v: Vec<Vec<f32>>,
    /// The trainer's counters (the same on every rank).
    pub state: TrainerState,
}

impl Shard {
    /// Checks the shard's buffers against the model and the layout.
    fn check(&self) -> Result<(), String> {
        self.layout().check()?;
        for (b, &shard) in self.shard_len.iter().enumerate() {
            for (what, x) in [("params", &self.params), ("m", &self.m), ("v", &self.v)] {
                if x.get(b).map(Vec::len) != Some(shard) {
                    return Err(format!(
                        "block {b}: the {what} shard is not {shard} elements"
                    ));
                }
            }
        }
        Ok(())
    }

    fn layout(&self) -> Layout<'_> {
        Layout {
            model: &self.model,
            ranks: self.ranks,
            rank: self.rank,
            shard_len: &self.shard_len,
            state: &self.state,
        }
    }
}

/// What a rank's part of a sharded checkpoint is, beside its tensors.
struct Layout<'a> {
    model: &'a Model,
    ranks: usize,
    rank: usize,
    shard_len: &'a [usize],
    state: &'a TrainerState,
}

impl Layout<'_> {
    /// Checks the layout against the model, and the trainer state.
    fn check(&self) -> Result<(), String> {
        let blocks = self.model.blocks();
        if self.rank >= self.ranks || self.shard_len.len() != blocks.len() {
            return Err(format!(
                "rank {} of {} with {} shard lengths for {} blocks",
                self.rank,
                self.ranks,
                self.shard_len.len(),
                blocks.len()
            ));
        }
        for (b, block) in blocks.iter().enumerate() {
            if self.shard_len[b] * self.ranks < block.len {
                return Err(format!(
                    "block {b}: {} ranks of {} elements do not hold its {}",
                    self.ranks, self.shard_len[b], block.len
                ));
            }
        }
        if !self.state.loss_scale.is_finite() {
            return Err(format!(
                "the loss scale is {}; a run continues only from a finite one",
                self.state.loss_scale
            ));
        }
        Ok(())
    }
}

/// Every rank's `ok`, gathered: the first rank for which it is false.
fn first_failed(comm: &dyn Collective, ok: bool) -> Result<Option<usize>, CheckpointError> {
    let mut all = vec![0u8; comm.size()];
    comm.all_gather(&[u8::from(ok)], &mut all)?;
    Ok(all.iter().position(|&x| x == 0))
}

/// Rank 0's half of a failed phase: removes the temporary folder.
fn discard(tmp: &Path) {
    if let Err(e) = fs::remove_dir_all(tmp)
        && e.kind() != ErrorKind::NotFound
    {
        log::warn!("could not remove {}: {e}", tmp.display());
    }
}

/// This rank's error when `failed` (the first rank that failed a phase) is set: its own
/// when it failed, else one naming the rank.
fn outcome<T>(
    mine: Result<T, CheckpointError>,
    failed: Option<usize>,
    step: u64,
    what: &'static str,
) -> Result<T, CheckpointError> {
    match (mine, failed) {
        (Err(e), _) => Err(e),
        (Ok(_), Some(rank)) => Err(CheckpointError::Rank { step, rank, what }),
        (Ok(x), None) => Ok(x),
    }
}

/// Saves every rank's `shard` as one checkpoint `root/step-N` (the step of
/// `shard.state`) and returns that folder; then keeps the newest `keep_last`, as
/// [`save`](super::save) does. A collective: every rank of `comm` calls it with its
/// shard, and every rank returns the same outcome.
pub fn save_sharded(
    root: &Path,
    comm: &dyn Collective,
    shard: &Shard,
    keep_last: usize,
) -> Result<PathBuf, CheckpointError> {
    let mine = if (shard.rank, shard.ranks) != (comm.rank(), comm.size()) {
        Err(format!(
            "the shard is rank {}'s of {}, the group's rank {} of {}",
            shard.rank,
            shard.ranks,
            comm.rank(),
            comm.size()
        ))
    } else {
        shard.check()
    };
    let mut read = |b: usize, put: &mut PutBlock<'_>| {
        Ok(put([
            &shard.params[b][..],
            &shard.m[b][..],
            &shard.v[b][..],
        ]))
    };
    save_with(root, comm, &shard.layout(), mine, &mut read, keep_last)
}

/// As [`save_sharded`], this rank's shard of block `b` (the master parameters, m and v,
/// `shard_len[b]` values each, zero past the block's end) being lent by `read(b)`,
/// called once per block in order: a rank holds one block's shard while it saves, not
/// its shard of the model. `state` is the trainer's (the same on every rank).
pub fn save_sharded_blocks(
    root: &Path,
    comm: &dyn Collective,
    model: &Model,
    shard_len: &[usize],
    state: &TrainerState,
    read: &mut ReadBlock<'_>,
    keep_last: usize,
) -> Result<PathBuf, CheckpointError> {
    let layout = Layout {
        model,
        ranks: comm.size(),
        rank: comm.rank(),
        shard_len,
        state,
    };
    let mine = layout.check();
    save_with(root, comm, &layout, mine, read, keep_last)
}

/// The phases of a sharded save (see the module's documentation), `mine` being this
/// rank's check of what it was given.
fn save_with(
    root: &Path,
    comm: &dyn Collective,
    layout: &Layout<'_>,
    mine: Result<(), String>,
    read: &mut ReadBlock<'_>,
    keep_last: usize,
) -> Result<PathBuf, CheckpointError> {
    let step = layout.state.step;
    let (rank, ranks) = (comm.rank(), comm.size());
    let mine = if keep_last == 0 {
        Err("keep_last is 0; keep at least the checkpoint being saved".to_string())
    } else {
        mine
    }
    .map_err(CheckpointError::BadInput);
    let failed = first_failed(comm, mine.is_ok())?;
    outcome(mine, failed, step, "check its shard")?;

    // Rank 0 makes the folder every rank writes into; its process id names it.
    let mut made = [0u64; 2];
    let prepared = if rank == 0 {
        let r = prepare(root, layout);
        made = [u64::from(r.is_ok()), u64::from(std::process::id())];
        r.map(|_| ())
    } else {
        Ok(())
    };
    let mut bytes: Vec<u8> = made.iter().flat_map(|x| x.to_le_bytes()).collect();
    comm.broadcast(0, &mut bytes)?;
    let ok0 = bytes[..8] != [0; 8];
    let pid = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
    outcome(
        prepared,
        (!ok0).then_some(0),
        step,
        "make the checkpoint's folder",
    )?;
    let tmp = leftover_path_of(root, step, LeftoverKind::Unfinished, pid as u32);

    // Every rank's file, flushed; its length and crc32c go to rank 0 for the manifest.
    let written = write_shard(&tmp.join(shard_file(rank, ranks)), layout, read);
    let record = match &written {
        Ok(d) => [1, d.len_bytes, u64::from(d.crc32c)],
        Err(_) => [0; 3],
    };
    let mut all = vec![0u8; 24 * ranks];
    let bytes: Vec<u8> = record.iter().flat_map(|x| x.to_le_bytes()).collect();
    comm.all_gather(&bytes, &mut all)?;
    let records: Vec<[u64; 3]> = all
        .chunks_exact(24)
        .map(|c| {
            std::array::from_fn(|i| u64::from_le_bytes(c[8 * i..8 * i + 8].try_into().unwrap()))
        })
        .collect();
    let failed = records.iter().position(|r| r[0] == 0);
    if failed.is_some() && rank == 0 {
        discard(&tmp);
    }
    outcome(written, failed, step, "write its shard")?;

    // Rank 0 finishes the folder and puts it in place.
    let published = if rank == 0 {
        let digests = records
            .iter()
            .map(|r| FileDigest {
                len_bytes: r[1],
                crc32c: r[2] as u32,
            })
            .collect::<Vec<_>>();
        let r = finish(&tmp, layout, &digests).and_then(|()| publish(root, &tmp, step));
        if r.is_err() {
            discard(&tmp);
        }
        r
    } else {
        Ok(root.join(dir_name(step)))
    };
    let mut ok = [u8::from(published.is_ok())];
    comm.broadcast(0, &mut ok)?;
    let dir = outcome(
        published,
        (ok[0] == 0).then_some(0),
        step,
        "publish the checkpoint",
    )?;
    if rank == 0 {
        log::info!("saved sharded checkpoint {} ({ranks} ranks)", dir.display());
        prune(root, step, keep_last);
    }
    Ok(dir)
}

/// Rank 0's first phase: the root, enough free space, an empty temporary folder.
fn prepare(root: &Path, layout: &Layout<'_>) -> Result<PathBuf, CheckpointError> {
    let step = layout.state.step;
    if !root.exists() {
        fs::create_dir_all(root).map_err(io_error("create", root))?;
        if let Some(parent) = root.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync_dir(parent)?;
        }
    }
    // Every rank's three f32 shards of every block, their headers, the small files.
    let elements: u64 = layout.shard_len.iter().map(|&s| s as u64).sum();
    let header_per_tensor = 256u64;
    let blocks = layout.shard_len.len() as u64;
    let needed =
        layout.ranks as u64 * (12 * elements + 3 * blocks * header_per_tensor) + (64 << 10);
    check_space(root, step, needed)?;
    let tmp = leftover_path(root, step, LeftoverKind::Unfinished);
    if tmp.exists() {
        // An earlier save of this process failed here.
        fs::remove_dir_all(&tmp).map_err(io_error("remove", &tmp))?;
    }
    fs::create_dir(&tmp).map_err(io_error("create", &tmp))?;
    Ok(tmp)
}

/// Writes this rank's tensors to the safetensors file `path` a block at a time, each
/// block's shard lent by `read`, and flushes it: its length and crc32c, taken as the
/// bytes went out.
fn write_shard(
    path: &Path,
    layout: &Layout<'_>,
    read: &mut ReadBlock<'_>,
) -> Result<FileDigest, CheckpointError> {
    let header = (0..layout.shard_len.len())
        .flat_map(|b| tensor_names(b).map(|name| (name, vec![layout.shard_len[b]])))
        .collect();
    let mut file = TensorWriter::create(path, header)?;
    for (b, &shard) in layout.shard_len.iter().enumerate() {
        let mut put = |got: BlockStateRef<'_>| -> Result<(), CheckpointError> {
            if got.iter().any(|x| x.len() != shard) {
                return Err(CheckpointError::BadInput(format!(
                    "block {b}'s shard has {:?} values, not three of {shard}",
                    got.map(<[f32]>::len)
                )));
            }
            for (name, x) in tensor_names(b).iter().zip(got) {
                file.put(name, x)?;
            }
            Ok(())
        };
        read(b, &mut put).map_err(|source| CheckpointError::Source {
            step: layout.state.step,
            what: format!("reading block {b}'s shard"),
            source,
        })??;
    }
    file.finish()
}

/// Rank 0's last phase: `config.json`, `trainer_state.json` and the manifest (with every
/// rank's file's `digests`) in `tmp`, flushed.
fn finish(tmp: &Path, layout: &Layout<'_>, digests: &[FileDigest]) -> Result<(), CheckpointError> {
    let config = weights::with_dtype(layout.model.family().hf_config(), FileDtype::F32);
    let mut text = serde_json::to_vec_pretty(&config).expect("JSON of a JSON value");
    text.push(b'\n');
    write_synced(&tmp.join(CONFIG_FILE), &text)?;
    let state = serde_json::to_vec_pretty(layout.state).expect("JSON of numbers and a JSON value");
    write_synced(&tmp.join(STATE_FILE), &state)?;
    let mut files = std::collections::BTreeMap::new();
    for file in [CONFIG_FILE, STATE_FILE] {
        files.insert(file.to_string(), digest(&tmp.join(file))?);
    }
    for (r, d) in digests.iter().enumerate() {
        files.insert(shard_file(r, layout.ranks), *d);
    }
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        step: layout.state.step,
        files,
        shards: Some(ShardLayout {
            ranks: layout.ranks,
            shard_len: layout.shard_len.to_vec(),
        }),
    };
    let text = serde_json::to_vec_pretty(&manifest).expect("JSON of numbers");
    write_synced(&tmp.join(MANIFEST_FILE), &text)?;
    sync_dir(tmp)
}

/// Every file of a sharded checkpoint: the small ones, then each rank's.
pub(super) fn files(layout: &ShardLayout) -> Vec<String> {
    let mut files = vec![CONFIG_FILE.to_string(), STATE_FILE.to_string()];
    files.extend((0..layout.ranks).map(|r| shard_file(r, layout.ranks)));
    files
}

/// Checks the layout against the model.
pub(super) fn check_layout(
    d: &Dir<'_>,
    model: &Model,
    layout: &ShardLayout,
) -> Result<(), CheckpointError> {
    let blocks = model.blocks();
    let fits = layout.ranks > 0
        && layout.shard_len.len() == blocks.len()
        && blocks
            .iter()
            .zip(&layout.shard_len)
            .all(|(b, &s)| s.checked_mul(layout.ranks).is_some_and(|n| n >= b.len));
    if fits {
        Ok(())
    } else {
        Err(d.invalid(format!(
            "{MANIFEST_FILE}'s shards ({} ranks, {} shard lengths) do not cover {CONFIG_FILE}'s \
             {} blocks",
            layout.ranks,
            layout.shard_len.len(),
            blocks.len()
        )))
    }
}
