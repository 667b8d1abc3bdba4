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
    LeftoverKind, advice, check_space, dir_name, leftover_path, leftover_path_of, prune, publish,
    resolve, sync_dir, write_synced,
};
use super::format::{
    FORMAT_VERSION, FileDigest, MANIFEST_FILE, Manifest, STATE_FILE, ShardLayout, TrainerState,
};
use super::verify::{Dir, digest};
use crate::model::Model;
use crate::model::weights::{self, CONFIG_FILE, F32View, FileDtype};

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
            let shard = self.shard_len[b];
            if shard * self.ranks < block.len {
                return Err(format!(
                    "block {b}: {} ranks of {shard} elements do not hold its {}",
                    self.ranks, block.len
                ));
            }
            for (what, x) in [("params", &self.params), ("m", &self.m), ("v", &self.v)] {
                if x.get(b).map(Vec::len) != Some(shard) {
                    return Err(format!(
                        "block {b}: the {what} shard is not {shard} elements"
                    ));
                }
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
    let step = shard.state.step;
    let (rank, ranks) = (comm.rank(), comm.size());
    let mine = if keep_last == 0 {
        Err("keep_last is 0; keep at least the checkpoint being saved".to_string())
    } else if (shard.rank, shard.ranks) != (rank, ranks) {
        Err(format!(
            "the shard is rank {}'s of {}, the group's rank {rank} of {ranks}",
            shard.rank, shard.ranks
        ))
    } else {
        shard.check()
    }
    .map_err(CheckpointError::BadInput);
    let failed = first_failed(comm, mine.is_ok())?;
    outcome(mine, failed, step, "check its shard")?;

    // Rank 0 makes the folder every rank writes into; its process id names it.
    let mut made = [0u64; 2];
    let prepared = if rank == 0 {
        let r = prepare(root, shard);
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
    let file = shard_file(rank, ranks);
    let written = write_shard(&tmp.join(&file), shard).and_then(|()| digest(&tmp.join(&file)));
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
        let r = finish(&tmp, shard, &digests).and_then(|()| publish(root, &tmp, step));
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
fn prepare(root: &Path, shard: &Shard) -> Result<PathBuf, CheckpointError> {
    let step = shard.state.step;
    if !root.exists() {
        fs::create_dir_all(root).map_err(io_error("create", root))?;
        if let Some(parent) = root.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync_dir(parent)?;
        }
    }
    // Every rank's three f32 shards of every block, their headers, the small files.
    let elements: u64 = shard.shard_len.iter().map(|&s| s as u64).sum();
    let header_per_tensor = 256u64;
    let blocks = shard.shard_len.len() as u64;
    let needed = shard.ranks as u64 * (12 * elements + 3 * blocks * header_per_tensor) + (64 << 10);
    check_space(root, step, needed)?;
    let tmp = leftover_path(root, step, LeftoverKind::Unfinished);
    if tmp.exists() {
        // An earlier save of this process failed here.
        fs::remove_dir_all(&tmp).map_err(io_error("remove", &tmp))?;
    }
    fs::create_dir(&tmp).map_err(io_error("create", &tmp))?;
    Ok(tmp)
}

/// Writes `shard`'s tensors to the safetensors file `path`, flushed.
fn write_shard(path: &Path, shard: &Shard) -> Result<(), CheckpointError> {
    let mut views = Vec::new();
    for b in 0..shard.shard_len.len() {
        let [p, m, v] = tensor_names(b);
        for (name, data) in [(p, &shard.params[b]), (m, &shard.m[b]), (v, &shard.v[b])] {
            views.push((
                name,
                F32View {
                    shape: vec![data.len()],
                    data,
                    dtype: FileDtype::F32,
                },
            ));
        }
    }
    weights::write_safetensors(views, path).map_err(|source| CheckpointError::Write {
        dir: path.parent().unwrap_or(Path::new(".")).to_path_buf(),
        source,
    })
}

/// Rank 0's last phase: `config.json`, `trainer_state.json` and the manifest (with every
/// rank's file's `digests`) in `tmp`, flushed.
fn finish(tmp: &Path, shard: &Shard, digests: &[FileDigest]) -> Result<(), CheckpointError> {
    let config = weights::with_dtype(shard.model.family().hf_config(), FileDtype::F32);
    let mut text = serde_json::to_vec_pretty(&config).expect("JSON of a JSON value");
    text.push(b'\n');
    write_synced(&tmp.join(CONFIG_FILE), &text)?;
    let state = serde_json::to_vec_pretty(&shard.state).expect("JSON of numbers and a JSON value");
    write_synced(&tmp.join(STATE_FILE), &state)?;
    let mut files = std::collections::BTreeMap::new();
    for file in [CONFIG_FILE, STATE_FILE] {
        files.insert(file.to_string(), digest(&tmp.join(file))?);
    }
    for (r, d) in digests.iter().enumerate() {
        files.insert(shard_file(r, shard.ranks), *d);
    }
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        step: shard.state.step,
        files,
        shards: Some(ShardLayout {
            ranks: shard.ranks,
            shard_len: shard.shard_len.clone(),
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

/// Rank `rank`'s master, m and v shards from its (verified) file.
fn read_shard(
    d: &Dir<'_>,
    layout: &ShardLayout,
    rank: usize,
) -> Result<[Vec<Vec<f32>>; 3], CheckpointError> {
    let file = shard_file(rank, layout.ranks);
    let st = d.f32_tensors(&file)?;
    let mut out: [Vec<Vec<f32>>; 3] = Default::default();
    for (b, &len) in layout.shard_len.iter().enumerate() {
        for (class, name) in tensor_names(b).into_iter().enumerate() {
            let (shape, data) = st.read_f32(&name).map_err(|e| d.model_error(&file, e))?;
            if shape != [len] {
                return Err(CheckpointError::Shape {
                    dir: d.0.to_path_buf(),
                    file: file.as_str().into(),
                    tensor: name.into(),
                    expected: Box::new([len]),
                    found: shape.into(),
                    advice: advice(d.0),
                });
            }
            out[class].push(data);
        }
    }
    Ok(out)
}

/// Loads rank `rank`'s shard of the sharded checkpoint `path` (a folder, or a root whose
/// latest checkpoint is taken) for a resume by `ranks` ranks, the number that wrote it.
/// Verifies the small files and this rank's file (length and crc32c), and the other
/// ranks' files' lengths.
pub fn load_shard(path: &Path, rank: usize, ranks: usize) -> Result<Shard, CheckpointError> {
    let dir = resolve(path)?;
    let d = Dir(&dir);
    let manifest = d.manifest()?;
    let Some(layout) = &manifest.shards else {
        return Err(d.invalid(format!(
            "{MANIFEST_FILE} describes an ordinary checkpoint, not one sharded by ranks; load \
             it whole"
        )));
    };
    if layout.ranks != ranks {
        return Err(CheckpointError::Ranks {
            dir,
            written: layout.ranks,
            ranks,
        });
    }
    let mine = shard_file(rank, ranks);
    let files = files(layout);
    d.verify(&manifest, files.iter().map(String::as_str), |f| {
        f == mine || f == CONFIG_FILE || f == STATE_FILE
    })?;
    let (state, model) = d.state_and_model(&manifest)?;
    check_layout(&d, &model, layout)?;
    let [params, m, v] = read_shard(&d, layout, rank)?;
    Ok(Shard {
        model,
        ranks,
        rank,
        shard_len: layout.shard_len.clone(),
        params,
        m,
        v,
        state,
    })
}
