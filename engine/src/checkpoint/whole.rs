//! A whole checkpoint (one process's training state) in memory: [`save`] writes one
//! (through `blocks`, a block at a time from its buffers); [`load`] verifies and reads one
//! whole (a sharded one put together from every rank's shard).
//!
//! Not here: the folders (`folder`), the format (`format`), reading a folder
//! (`verify`), writing and reading a block at a time (`blocks`), sharded checkpoints
//! (`sharded`).

use std::path::{Path, PathBuf};

use super::blocks::{assert_gaps_zero, save_blocks};
use super::error::CheckpointError;
use super::format::{Checkpoint, EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX, PutBlock};
use crate::model::ModelError;
use crate::model::weights;

/// Saves `ckpt` as `root/step-NNNNNNNN` (the step of `ckpt.state`), creating `root`, and
/// returns that folder. Then keeps the newest `keep_last` (at least 1) complete
/// checkpoints up to this step, removes older ones and the temporary folders of dead
/// saves. Checkpoints of higher steps (from an earlier run) are kept, with a warning:
/// loading the root would pick them.
pub fn save(root: &Path, ckpt: &Checkpoint, keep_last: usize) -> Result<PathBuf, CheckpointError> {
    let model = &ckpt.model;
    let bad = |e: ModelError| CheckpointError::BadInput(e.to_string());
    // Checks the three buffer sets against the layout before anything is written.
    for (buffers, prefix) in [
        (&ckpt.params, ""),
        (&ckpt.m, EXP_AVG_PREFIX),
        (&ckpt.v, EXP_AVG_SQ_PREFIX),
    ] {
        weights::block_views(model, buffers, prefix).map_err(bad)?;
    }
    for (name, buffers) in [("params", &ckpt.params), ("m", &ckpt.m), ("v", &ckpt.v)] {
        for (b, buffer) in buffers.iter().enumerate() {
            assert_gaps_zero(model, b, name, buffer);
        }
    }
    let mut read = |b: usize, put: &mut PutBlock<'_>| {
        Ok(put([&ckpt.params[b][..], &ckpt.m[b][..], &ckpt.v[b][..]]))
    };
    Ok(save_blocks(root, model, &ckpt.state, &mut read, keep_last)?.dir)
}

/// Loads a checkpoint: `path` is a checkpoint folder, or a root holding several, of which
/// the highest complete step is loaded. Everything is verified first (manifest, lengths,
/// crc32c, tensor shapes and dtypes). A sharded checkpoint (one written by ranks) is put
/// together from every rank's shard. It holds the whole state: [`open`](super::open)
/// reads one block at a time.
pub fn load(path: &Path) -> Result<Checkpoint, CheckpointError> {
    super::open(path)?.read_all()
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
