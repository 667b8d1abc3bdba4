//! The formats of AdamW's moments in a block's optimizer state, and where each part of
//! the state lies in the block's state buffer (its home on the device, in host memory
//! or on NVMe).
//!
//! A block's state buffer (or a rank's shard of it, `len` elements from element `lo` of
//! the block) holds, in this order:
//! - the fp32 master parameters, `len` of them (first, so that a fetch of the
//!   parameters can read the buffer's head alone);
//! - the moments m and v, in the run's [`OptimizerState`]: fp32 (4 bytes each per
//!   parameter), bf16 (2 each), or the 8-bit block format of
//!   [`strata_kernels::adamw::q8`] (1 byte each per parameter, then, 4-byte aligned, one
//!   f32 scale per block of [`q8::BLOCK`] values of each).
//!
//! 8-bit blocks start at each tensor's first element in the buffer (its
//! [`piece`](pieces)): a tensor's last block may be partial, and no block spans two
//! tensors, so alignment gaps hold no state. Elements outside every tensor (the gaps)
//! keep zero codes.
//!
//! Not here: the update that reads and writes them (the executor's CPU optimizer, and
//! [`super::update`] on the device), or converting them to and from f32 for checkpoints
//! (the executor's loading and export).

use std::fmt;
use std::ops::Range;

use strata_kernels::adamw::q8;

use super::{BlockLayout, TensorSpec};

/// How AdamW's moments m and v are stored (the master parameters are always fp32).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerState {
    /// fp32 m and v: 12 bytes of state per parameter with the master copy.
    #[default]
    Fp32,
    /// bf16 m and v, rounded to nearest even when written: 8 bytes per parameter.
    Bf16,
    /// m and sqrt(v) in 8-bit codes with a scale per 256 values (the format of
    /// docs/adamw-8bit.md): about 6.03 bytes per parameter.
    Q8,
}

impl OptimizerState {
    /// Bytes of state per parameter, master copy included, for a long tensor (8-bit
    /// scales included; a tensor's partial last block adds a scale's 8 bytes).
    pub fn bytes_per_param(self) -> f64 {
        match self {
            OptimizerState::Fp32 => 12.0,
            OptimizerState::Bf16 => 8.0,
            OptimizerState::Q8 => 6.0 + 8.0 / q8::BLOCK as f64,
        }
    }

    /// Whether the moments are fp32 (the only format the device's AdamW program keeps).
    pub fn is_fp32(self) -> bool {
        self == OptimizerState::Fp32
    }
}

impl fmt::Display for OptimizerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OptimizerState::Fp32 => "fp32",
            OptimizerState::Bf16 => "bf16",
            OptimizerState::Q8 => "q8",
        })
    }
}

/// One tensor's part of a range of a block's buffer: the tensor's index, where the part
/// starts relative to the range's start, and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Index into the block's tensors.
    pub tensor: usize,
    /// First element, relative to the range's start.
    pub at: usize,
    /// Elements.
    pub len: usize,
}

/// The parts of `tensors` that lie in elements `lo .. lo + len` of their block's buffer,
/// in buffer order (alignment gaps and elements past the block's end are in none).
pub fn pieces(tensors: &[TensorSpec], lo: usize, len: usize) -> Vec<Piece> {
    tensors
        .iter()
        .enumerate()
        .filter_map(|(tensor, t)| {
            let start = t.slot.offset.max(lo);
            let end = (t.slot.offset + t.slot.len).min(lo + len);
            (start < end).then(|| Piece {
                tensor,
                at: start - lo,
                len: end - start,
            })
        })
        .collect()
}

/// Where each part of a block's (or shard's) optimizer state lies in its buffer, in
/// bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateLayout {
    /// The moments' format.
    pub format: OptimizerState,
    /// Elements of the range (the block's length, or a rank's shard).
    pub len: usize,
    /// The tensors' parts of the range.
    pub pieces: Vec<Piece>,
    /// 8-bit scales of each moment (0 in other formats): one per block of each piece.
    scales: usize,
}

impl StateLayout {
    /// The state of elements `lo .. lo + len` of a block of `tensors`, in `format`.
    pub fn new(format: OptimizerState, tensors: &[TensorSpec], lo: usize, len: usize) -> Self {
        let pieces = pieces(tensors, lo, len);
        let scales = match format {
            OptimizerState::Q8 => pieces.iter().map(|p| q8::scale_count(p.len)).sum(),
            _ => 0,
        };
        StateLayout {
            format,
            len,
            pieces,
            scales,
        }
    }

    /// The state of rank `rank`'s shard of `shard` elements of the elements of `block`
    /// that train ([`BlockLayout::trained`]): elements `frozen + rank * shard ..` of its
    /// buffer.
    pub fn of_shard(
        format: OptimizerState,
        block: &BlockLayout,
        rank: usize,
        shard: usize,
    ) -> Self {
        StateLayout::new(format, &block.tensors, block.frozen + rank * shard, shard)
    }

    /// Bytes of a buffer that holds any of `ranks` ranks' shards of `shard` elements of
    /// `block`'s trained elements (8-bit state has a scale per block of each tensor's part
    /// of the shard, so the ranks' shards may differ by a few scales): one size for the
    /// plan of every rank.
    pub fn shard_bytes(
        format: OptimizerState,
        block: &BlockLayout,
        shard: usize,
        ranks: usize,
    ) -> usize {
        (0..ranks.max(1))
            .map(|r| StateLayout::of_shard(format, block, r, shard).bytes())
            .max()
            .unwrap_or(0)
    }

    /// Bytes of this buffer's parts (a buffer may be longer: [`Self::shard_bytes`]).
    pub fn bytes(&self) -> usize {
        match self.format {
            OptimizerState::Fp32 => 12 * self.len,
            OptimizerState::Bf16 => 8 * self.len,
            OptimizerState::Q8 => self.scales_start() + 8 * self.scales,
        }
    }

    /// The master parameters' bytes.
    pub fn master(&self) -> Range<usize> {
        0..4 * self.len
    }

    /// The bytes of m, then of v (their codes, in the 8-bit format).
    pub fn moments(&self) -> [Range<usize>; 2] {
        let each = match self.format {
            OptimizerState::Fp32 => 4,
            OptimizerState::Bf16 => 2,
            OptimizerState::Q8 => 1,
        } * self.len;
        let m = 4 * self.len;
        [m..m + each, m + each..m + 2 * each]
    }

    /// The 8-bit format's scales of m, then of v (empty ranges in other formats).
    pub fn scales(&self) -> [Range<usize>; 2] {
        let at = self.scales_start();
        let each = 4 * self.scales;
        [at..at + each, at + each..at + 2 * each]
    }

    /// Scales per moment (8-bit format only).
    pub fn scale_count(&self) -> usize {
        self.scales
    }

    fn scales_start(&self) -> usize {
        self.moments()[1].end.next_multiple_of(4)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Slot;

    fn tensor(offset: usize, len: usize) -> TensorSpec {
        TensorSpec {
            name: format!("t{offset}"),
            shape: vec![len],
            slot: Slot { offset, len },
        }
    }

    #[test]
    fn parts_follow_one_another_without_overlap() {
        // Two tensors with a gap between them; a shard that cuts the second.
        let tensors = [tensor(0, 300), tensor(320, 600)];
        let l = StateLayout::new(OptimizerState::Q8, &tensors, 0, 704);
        assert_eq!(
            l.pieces,
            vec![
                Piece {
                    tensor: 0,
                    at: 0,
                    len: 300
                },
                Piece {
                    tensor: 1,
                    at: 320,
                    len: 384
                }
            ]
        );
        // 300 values: 2 blocks; 384: 2 blocks.
        assert_eq!(l.scale_count(), 4);
        assert_eq!(l.master(), 0..2816);
        assert_eq!(l.moments(), [2816..3520, 3520..4224]);
        assert_eq!(l.scales(), [4224..4240, 4240..4256]);
        assert_eq!(l.bytes(), 4256);
        let b = StateLayout::new(OptimizerState::Bf16, &tensors, 0, 704);
        assert_eq!(b.moments(), [2816..4224, 4224..5632]);
        assert_eq!(b.bytes(), 8 * 704);
        assert_eq!(
            StateLayout::new(OptimizerState::Fp32, &tensors, 0, 704).bytes(),
            12 * 704
        );
        // A shard from element 640 on: the second tensor's tail, 280 values.
        let s = StateLayout::new(OptimizerState::Q8, &tensors, 640, 704);
        assert_eq!(
            s.pieces,
            vec![Piece {
                tensor: 1,
                at: 0,
                len: 280
            }]
        );
        assert_eq!(s.scale_count(), 2);
    }
}
