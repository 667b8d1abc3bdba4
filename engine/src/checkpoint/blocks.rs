//! Saving and loading a checkpoint a block at a time: [`save_blocks`] has each block's
//! master parameters, m and v lent to its writer as it reaches the block, where their
//! source holds them (the executor: in the host arena itself, or in the buffer its read
//! of the device or of NVMe extents put them), and writes them; [`open`] verifies a
//! checkpoint and [`Opened::block`] reads one block's state back. A save holds nothing
//! of its own but a 1 MiB write buffer per file ([`SaveReport::staged_bytes_max`]), and
//! keeps the files' written pages out of the page cache as it goes; with the source's
//! read buffer at most the largest block's state beside the arenas (measured by
//! `engine/tests/checkpoint_blocks.rs`). A load holds one block's state.
//!
//! The files are those of the format (`format`): `model.safetensors` and
//! `optimizer.safetensors` hold their tensors in block order (the optimizer's m and v of
//! a block one after the other), each file's crc32c taken as it is written.
//!
//! Not here: the folders and their crash safety (`folder`), the manifest's checks
//! (`verify`), sharded saves (`sharded`).

use std::collections::BTreeMap;
use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use super::error::{CheckpointError, io_error};
use super::folder::{
    LeftoverKind, check_space, leftover_path, prune, publish, resolve, sync_dir, write_synced,
};
use super::format::{
    BlockState, BlockStateRef, DATA_FILES, EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX, FORMAT_VERSION,
    FileDigest, MANIFEST_FILE, Manifest, OPTIMIZER_FILE, ReadBlock, STATE_FILE, ShardLayout,
    TrainerState,
};
use super::sharded::{Shard, files as shard_files, shard_file, tensor_names};
use super::stream::{TensorReader, TensorWriter, WRITE_BUFFER_BYTES};
use super::verify::Dir;
use crate::model::lora::{ADAPTER_CONFIG_FILE, WeightLayout};
use crate::model::weights::{self, CONFIG_FILE, FileDtype, WEIGHTS_FILE};
use crate::model::{BlockLayout, Model, TensorSpec};

/// What a save wrote.
#[derive(Debug, Clone)]
pub struct SaveReport {
    /// The checkpoint's folder.
    pub dir: PathBuf,
    /// Bytes of every file written.
    pub bytes: u64,
    /// The most RAM the save held at once besides its source's: the files' write
    /// buffers.
    pub staged_bytes_max: u64,
}

/// The tensors of `block` a checkpoint holds: those that train (every one, but a LoRA
/// model's frozen base, which its `--model` folder holds), each with its range in the
/// block's trained elements ([`BlockLayout::trained`](crate::model::BlockLayout::trained)),
/// the buffers a checkpoint's block state is.
fn held(block: &BlockLayout) -> impl Iterator<Item = (&TensorSpec, std::ops::Range<usize>)> {
    let lo = block.frozen;
    block
        .tensors
        .iter()
        .filter(move |t| t.slot.offset >= lo)
        .map(move |t| (t, t.slot.offset - lo..t.slot.offset - lo + t.slot.len))
}

/// Panics unless every alignment gap of block `b`'s `buffer` (its trained elements) is
/// zero: the files hold tensors only, so a nonzero gap would not come back, and gaps are
/// zero by the layout's contract.
pub(super) fn assert_gaps_zero(model: &Model, b: usize, name: &str, buffer: &[f32]) {
    let block = &model.blocks()[b];
    // A gap runs from a tensor's end to the next one's start (or the block's end).
    let ends = held(block).map(|(_, r)| r.end);
    let next_starts = held(block).skip(1).map(|(_, r)| r.start);
    for (start, end) in ends.zip(next_starts.chain([block.trained_len()])) {
        assert!(
            buffer[start..end].iter().all(|x| x.to_bits() == 0),
            "{name}: block {:?} has a nonzero alignment gap at elements {start}..{end}",
            block.kind
        );
    }
}

/// An upper bound of the bytes a checkpoint of `model` takes: three f32 copies of every
/// parameter, the safetensors headers, and the small files (a trainer state of
/// `state_json_bytes` among them).
pub fn needed_bytes(model: &Model, state_json_bytes: usize) -> u64 {
    let params = model.trained_param_count() as u64;
    let tensors: u64 = model.blocks().iter().map(|b| held(b).count() as u64).sum();
    // A header entry: `"exp_avg_sq.transformer.<name>":{"dtype":"F32","shape":[a,b],
    // "data_offsets":[x,y]}`, at most a few hundred bytes with 20-digit numbers.
    let header_per_tensor = 256u64;
    let small_files = 64 * 1024;
    3 * 4 * params + 3 * tensors * header_per_tensor + state_json_bytes as u64 + small_files
}

/// The tensors of block `b` of `model`, named as the checkpoint's files name them after
/// `prefix`, with their shapes and ranges in the block's buffer.
fn block_tensors(
    model: &Model,
    b: usize,
    prefix: &str,
) -> impl Iterator<Item = (String, Vec<usize>, std::ops::Range<usize>)> {
    let family_prefix = model.family().hf_prefix(b);
    held(&model.blocks()[b]).map(move |(t, range)| {
        (
            format!("{prefix}{family_prefix}{}", t.name),
            t.shape.clone(),
            range,
        )
    })
}

/// The headers of the two tensor files: the parameters; m and v, block by block.
fn headers(model: &Model) -> [Vec<(String, Vec<usize>)>; 2] {
    let mut params = Vec::new();
    let mut optimizer = Vec::new();
    for b in 0..model.blocks().len() {
        params.extend(block_tensors(model, b, "").map(|(n, s, _)| (n, s)));
        for prefix in [EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX] {
            optimizer.extend(block_tensors(model, b, prefix).map(|(n, s, _)| (n, s)));
        }
    }
    [params, optimizer]
}

/// Saves the state of `model` after `state`'s step as `root/step-N`, each block's state
/// being `read(b)` (called once per block, in order, and dropped once written); then
/// keeps the newest `keep_last`, as [`save`](super::save) does. A failure of `read`
/// leaves the previous checkpoints as they were and nothing of this one.
pub fn save_blocks(
    root: &Path,
    model: &Model,
    state: &TrainerState,
    read: &mut ReadBlock<'_>,
    keep_last: usize,
) -> Result<SaveReport, CheckpointError> {
    if keep_last == 0 {
        return Err(CheckpointError::BadInput(
            "keep_last is 0; keep at least the checkpoint being saved".into(),
        ));
    }
    if !state.loss_scale.is_finite() {
        return Err(CheckpointError::BadInput(format!(
            "the loss scale is {}; a run continues only from a finite one",
            state.loss_scale
        )));
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
    let written = write_files(&tmp, model, state, &state_json, read)
        .and_then(|report| Ok((publish(root, &tmp, step)?, report)));
    let (dir, (bytes, staged_bytes_max)) = match written {
        Ok(done) => done,
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
    Ok(SaveReport {
        dir,
        bytes,
        staged_bytes_max,
    })
}

/// Writes every file of the checkpoint into `dir`, each flushed, the manifest last, and
/// flushes `dir`: the bytes written and the most RAM staged at once.
fn write_files(
    dir: &Path,
    model: &Model,
    state: &TrainerState,
    state_json: &[u8],
    read: &mut ReadBlock<'_>,
) -> Result<(u64, u64), CheckpointError> {
    let [params, optimizer] = headers(model);
    let mut files = BTreeMap::new();
    let mut weights_file = TensorWriter::create(&dir.join(WEIGHTS_FILE), params)?;
    let mut optimizer_file = TensorWriter::create(&dir.join(OPTIMIZER_FILE), optimizer)?;
    for (b, block) in model.blocks().iter().enumerate() {
        let mut put = |got: BlockStateRef<'_>| -> Result<(), CheckpointError> {
            if got.iter().any(|x| x.len() != block.trained_len()) {
                return Err(CheckpointError::BadInput(format!(
                    "block {b}'s state has {:?} values, not three of the model's {}",
                    got.map(<[f32]>::len),
                    block.trained_len()
                )));
            }
            for (name, x) in ["params", "m", "v"].iter().zip(got) {
                assert_gaps_zero(model, b, name, x);
            }
            for (name, _, range) in block_tensors(model, b, "") {
                weights_file.put(&name, &got[0][range])?;
            }
            for (prefix, x) in [(EXP_AVG_PREFIX, got[1]), (EXP_AVG_SQ_PREFIX, got[2])] {
                for (name, _, range) in block_tensors(model, b, prefix) {
                    optimizer_file.put(&name, &x[range])?;
                }
            }
            Ok(())
        };
        read(b, &mut put).map_err(|source| CheckpointError::Source {
            step: state.step,
            what: format!("reading block {b}'s state"),
            source,
        })??;
    }
    files.insert(WEIGHTS_FILE.to_string(), weights_file.finish()?);
    files.insert(OPTIMIZER_FILE.to_string(), optimizer_file.finish()?);
    let config = weights::with_dtype(model.family().hf_config(), FileDtype::F32);
    if let Some(lora) = model.lora_config() {
        // A LoRA model's: its adapters' settings, as peft writes them (the base is its
        // `--model` folder's).
        let fan_in_fan_out = WeightLayout::of(model.family()) == WeightLayout::InOut;
        let mut json = serde_json::to_vec_pretty(&lora.to_json("", fan_in_fan_out))
            .expect("JSON of a JSON value");
        json.push(b'\n');
        write_synced(&dir.join(ADAPTER_CONFIG_FILE), &json)?;
        files.insert(ADAPTER_CONFIG_FILE.to_string(), digest_of(&json));
    }
    let mut config_json = serde_json::to_vec_pretty(&config).expect("JSON of a JSON value");
    config_json.push(b'\n');
    for (file, bytes) in [(CONFIG_FILE, &config_json[..]), (STATE_FILE, state_json)] {
        write_synced(&dir.join(file), bytes)?;
        files.insert(file.to_string(), digest_of(bytes));
    }
    let bytes = files.values().map(|d| d.len_bytes).sum();
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        step: state.step,
        files,
        shards: None,
    };
    let text = serde_json::to_vec_pretty(&manifest).expect("JSON of numbers");
    write_synced(&dir.join(MANIFEST_FILE), &text)?;
    sync_dir(dir)?;
    Ok((bytes, 2 * WRITE_BUFFER_BYTES as u64))
}

/// The length and crc32c of `bytes`.
fn digest_of(bytes: &[u8]) -> FileDigest {
    FileDigest {
        len_bytes: bytes.len() as u64,
        crc32c: strata_storage::crc::crc32c(bytes),
    }
}

/// Where an opened checkpoint's tensors are.
enum Files {
    /// An ordinary checkpoint's two tensor files.
    Whole {
        weights: TensorReader,
        optimizer: TensorReader,
    },
    /// Every rank's shard file of a sharded one.
    Sharded {
        layout: ShardLayout,
        shards: Vec<TensorReader>,
    },
    /// One rank's shard file of a sharded one, for a resume by as many ranks.
    OwnShard {
        layout: ShardLayout,
        file: TensorReader,
    },
}

/// A verified checkpoint, read a block at a time: whole blocks, or (opened with
/// [`open_shard`]) one rank's shards of them.
pub struct Opened {
    dir: PathBuf,
    model: Model,
    state: TrainerState,
    files: Files,
}

/// Opens the checkpoint `path` (a checkpoint folder, or a root whose highest complete
/// step is taken): verifies its manifest, every file's length and crc32c (read through
/// a 1 MiB buffer), its trainer state and `config.json`, and that every tensor of every
/// block is there with its shape and dtype, reading no tensor data. An ordinary or a
/// sharded checkpoint (its shards are put together as each block is read).
pub fn open(path: &Path) -> Result<Opened, CheckpointError> {
    let dir = resolve(path)?;
    let d = Dir(&dir);
    let manifest = d.manifest()?;
    let (state, model, files) = match &manifest.shards {
        None => {
            // A LoRA model's checkpoint also names its adapters' settings.
            let lora = manifest.files.contains_key(ADAPTER_CONFIG_FILE);
            let files = DATA_FILES
                .into_iter()
                .chain(lora.then_some(ADAPTER_CONFIG_FILE));
            d.verify(&manifest, files, |_| true)?;
            let (state, model) = d.state_and_model(&manifest)?;
            let files = Files::Whole {
                weights: TensorReader::open(&d, WEIGHTS_FILE)?,
                optimizer: TensorReader::open(&d, OPTIMIZER_FILE)?,
            };
            (state, model, files)
        }
        Some(layout) => {
            let names = shard_files(layout);
            d.verify(&manifest, names.iter().map(String::as_str), |_| true)?;
            let (state, model) = d.state_and_model(&manifest)?;
            super::sharded::check_layout(&d, &model, layout)?;
            let shards = (0..layout.ranks)
                .map(|r| TensorReader::open(&d, &shard_file(r, layout.ranks)))
                .collect::<Result<_, _>>()?;
            let files = Files::Sharded {
                layout: layout.clone(),
                shards,
            };
            (state, model, files)
        }
    };
    Opened::located(dir, model, state, files)
}

/// Opens rank `rank`'s shard of the sharded checkpoint `path` (a folder, or a root whose
/// latest checkpoint is taken) for a resume by `ranks` ranks, the number that wrote it:
/// verifies the small files and this rank's file (length and crc32c), the other ranks'
/// files' lengths, and every tensor's place, shape and dtype in this rank's file, reading
/// no tensor data. [`Opened::block`] then reads this rank's shard of a block.
pub fn open_shard(path: &Path, rank: usize, ranks: usize) -> Result<Opened, CheckpointError> {
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
    let names = shard_files(layout);
    d.verify(&manifest, names.iter().map(String::as_str), |f| {
        f == mine || f == CONFIG_FILE || f == STATE_FILE
    })?;
    let (state, model) = d.state_and_model(&manifest)?;
    super::sharded::check_layout(&d, &model, layout)?;
    let files = Files::OwnShard {
        layout: layout.clone(),
        file: TensorReader::open(&d, &mine)?,
    };
    Opened::located(dir, model, state, files)
}

/// Loads rank `rank`'s shard of the sharded checkpoint `path` whole, as
/// [`open_shard`] opens it.
pub fn load_shard(path: &Path, rank: usize, ranks: usize) -> Result<Shard, CheckpointError> {
    let opened = open_shard(path, rank, ranks)?;
    let shard_len = opened.own_shard_len().expect("opened as a shard").to_vec();
    let mut classes: [Vec<Vec<f32>>; 3] = Default::default();
    for b in 0..shard_len.len() {
        for (class, x) in classes.iter_mut().zip(opened.block(b)?) {
            class.push(x);
        }
    }
    let [params, m, v] = classes;
    Ok(Shard {
        model: opened.model().clone(),
        ranks,
        rank,
        shard_len,
        params,
        m,
        v,
        state: opened.state().clone(),
    })
}

impl Opened {
    /// The checkpoint of `files`, once every block's tensors are found in them.
    fn located(
        dir: PathBuf,
        model: Model,
        state: TrainerState,
        files: Files,
    ) -> Result<Self, CheckpointError> {
        let opened = Opened {
            dir,
            model,
            state,
            files,
        };
        for b in 0..opened.model.blocks().len() {
            opened.places(b)?;
        }
        Ok(opened)
    }

    /// The checkpoint's folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The model of its `config.json`.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Its trainer state.
    pub fn state(&self) -> &TrainerState {
        &self.state
    }

    /// How many ranks wrote it: `None` for an ordinary checkpoint.
    pub fn ranks(&self) -> Option<usize> {
        match &self.files {
            Files::Whole { .. } => None,
            Files::Sharded { layout, .. } | Files::OwnShard { layout, .. } => Some(layout.ranks),
        }
    }

    /// Per block, the elements of a rank's shard, when opened as one rank's shard
    /// ([`open_shard`]); `None` when [`Opened::block`] reads whole blocks.
    pub fn own_shard_len(&self) -> Option<&[usize]> {
        match &self.files {
            Files::OwnShard { layout, .. } => Some(&layout.shard_len),
            _ => None,
        }
    }

    /// The values [`Opened::block`] reads of block `b`: the block's, or a rank's shard's.
    fn held_len(&self, b: usize) -> usize {
        match &self.files {
            Files::OwnShard { layout, .. } => layout.shard_len[b],
            _ => self.model.blocks()[b].trained_len(),
        }
    }

    /// Where block `b`'s tensors are: per class (params, m, v), each piece's file,
    /// offset, length and place in the block's buffer.
    #[allow(clippy::type_complexity)]
    fn places(
        &self,
        b: usize,
    ) -> Result<[Vec<(&TensorReader, u64, std::ops::Range<usize>)>; 3], CheckpointError> {
        let d = Dir(&self.dir);
        let mut out: [Vec<_>; 3] = Default::default();
        match &self.files {
            Files::Whole { weights, optimizer } => {
                let classes = [
                    ("", weights),
                    (EXP_AVG_PREFIX, optimizer),
                    (EXP_AVG_SQ_PREFIX, optimizer),
                ];
                for ((prefix, file), places) in classes.into_iter().zip(&mut out) {
                    let block = &self.model.blocks()[b];
                    for (t, range) in held(block) {
                        // As written, or without the family's prefix (as `weights` reads).
                        let prefixed =
                            format!("{prefix}{}{}", self.model.family().hf_prefix(b), t.name);
                        let bare = format!("{prefix}{}", t.name);
                        let at = file.locate(&d, &[&prefixed, &bare], &t.shape)?;
                        places.push((file, at, range));
                    }
                }
            }
            Files::Sharded { layout, shards } => {
                let (len, shard) = (self.model.blocks()[b].len, layout.shard_len[b]);
                for (r, file) in shards.iter().enumerate() {
                    let lo = (r * shard).min(len);
                    let hi = (lo + shard).min(len);
                    for (name, places) in tensor_names(b).iter().zip(&mut out) {
                        let at = file.locate(&d, &[name], &[shard])?;
                        places.push((file, at, lo..hi));
                    }
                }
            }
            Files::OwnShard { layout, file } => {
                let shard = layout.shard_len[b];
                for (name, places) in tensor_names(b).iter().zip(&mut out) {
                    let at = file.locate(&d, &[name], &[shard])?;
                    places.push((file, at, 0..shard));
                }
            }
        }
        Ok(out)
    }

    /// Block `b`'s master parameters, m and v (the length of its trained elements each:
    /// the block's, but a LoRA model's adapters alone; alignment gaps zero; opened as one
    /// rank's shard, that rank's shard of them, zero past the block's end), read from the
    /// files.
    pub fn block(&self, b: usize) -> Result<BlockState, CheckpointError> {
        let mut out: BlockState = Default::default();
        self.read_classes(b, &mut out)?;
        Ok(out)
    }

    /// Block `b`'s master parameters alone (for writing the model), read from the file.
    pub fn block_params(&self, b: usize) -> Result<Vec<f32>, CheckpointError> {
        let mut out = [Vec::new()];
        self.read_classes(b, &mut out)?;
        let [params] = out;
        Ok(params)
    }

    /// The first `out.len()` classes of block `b` (params, m, v) into `out`.
    fn read_classes(&self, b: usize, out: &mut [Vec<f32>]) -> Result<(), CheckpointError> {
        if b >= self.model.blocks().len() {
            return Err(CheckpointError::BadInput(format!(
                "block {b} is not one of the model's {}",
                self.model.blocks().len()
            )));
        }
        for (x, places) in out.iter_mut().zip(self.places(b)?) {
            *x = vec![0f32; self.held_len(b)];
            for (file, at, range) in places {
                file.read_into(at, &mut x[range])?;
            }
        }
        Ok(())
    }

    /// The whole checkpoint, every block read.
    pub fn read_all(self) -> Result<super::Checkpoint, CheckpointError> {
        if self.own_shard_len().is_some() {
            return Err(CheckpointError::BadInput(format!(
                "{} was opened as one rank's shard; open it whole to read it all",
                self.dir.display()
            )));
        }
        let mut classes: [Vec<Vec<f32>>; 3] = Default::default();
        for b in 0..self.model.blocks().len() {
            for (class, x) in classes.iter_mut().zip(self.block(b)?) {
                class.push(x);
            }
        }
        let [params, m, v] = classes;
        Ok(super::Checkpoint {
            model: self.model,
            params,
            m,
            v,
            state: self.state,
        })
    }
}
