//! A whole checkpoint (one process's training state): [`save`] writes it into a hidden
//! folder, flushed, and publishes it; [`load`] verifies and reads one (a sharded one put
//! together from every rank's shard).
//!
//! Not here: the folders (`folder`), the format (`format`), reading a folder
//! (`verify`), sharded checkpoints (`sharded`).

use std::collections::BTreeMap;
use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use super::error::{CheckpointError, io_error};
use super::folder::{
    LeftoverKind, check_space, leftover_path, prune, publish, resolve, sync_dir, write_synced,
};
use super::format::{
    Checkpoint, DATA_FILES, EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX, FORMAT_VERSION, MANIFEST_FILE,
    Manifest, OPTIMIZER_FILE, STATE_FILE,
};
use super::sharded::load_whole;
use super::verify::{Dir, digest};
use crate::model::weights::{self, WEIGHTS_FILE};
use crate::model::{Model, ModelError};

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
pub(super) fn assert_gaps_zero(model: &Model, name: &str, buffers: &[Vec<f32>]) {
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
/// parameter, the safetensors headers, and the small files (a trainer state of
/// `state_json_bytes` among them).
pub fn needed_bytes(model: &Model, state_json_bytes: usize) -> u64 {
    let params = model.param_count() as u64;
    let tensors: u64 = model.blocks().iter().map(|b| b.tensors.len() as u64).sum();
    // A header entry: `"exp_avg_sq.transformer.<name>":{"dtype":"F32","shape":[a,b],
    // "data_offsets":[x,y]}`, at most a few hundred bytes with 20-digit numbers.
    let header_per_tensor = 256u64;
    let small_files = 64 * 1024;
    3 * 4 * params + 3 * tensors * header_per_tensor + state_json_bytes as u64 + small_files
}

/// Writes every file of `ckpt` into `dir`, each flushed to the device, the manifest last,
/// and flushes `dir`.
pub(super) fn write_files(
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

/// Loads a checkpoint: `path` is a checkpoint folder, or a root holding several, of which
/// the highest complete step is loaded. Everything is verified first (manifest, lengths,
/// crc32c, tensor shapes and dtypes). A sharded checkpoint (one written by ranks) is put
/// together from every rank's shard.
pub fn load(path: &Path) -> Result<Checkpoint, CheckpointError> {
    load_dir(&resolve(path)?)
}

/// Loads and verifies the checkpoint in folder `dir`; a sharded one is put together
/// from every rank's shard.
pub(super) fn load_dir(dir: &Path) -> Result<Checkpoint, CheckpointError> {
    let d = Dir(dir);
    let manifest = d.manifest()?;
    if let Some(layout) = &manifest.shards {
        return load_whole(dir, &manifest, layout);
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

#[cfg(test)]
mod tests {
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
