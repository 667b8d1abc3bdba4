//! The parameter layout: the model as an ordered list of blocks, each with all of its
//! parameters in one flat buffer, carved into tensors at fixed offsets.
//!
//! A block's buffer is the unit the engine moves between tiers, so its layout is the
//! same for every dtype (offsets count elements, not bytes). Each tensor starts at a
//! multiple of [`TENSOR_ALIGN_ELEMENTS`]; the gaps are zero and stay zero.
//!
//! Tensor names are Hugging Face's, without the prefix a family's files put before the
//! body (GPT-2's `transformer.`), and tensors keep the layout of its files, so loading
//! and saving are plain copies. A family builds its blocks with [`BlockLayout::build`].

use std::ops::Range;

use strata_kernels::program::{Dtype, TensorRef};

use super::Bind;

/// Tensors start at multiples of this many elements (128 bytes of f32, 64 of bf16).
pub const TENSOR_ALIGN_ELEMENTS: usize = 32;

/// A block's trained tail ([`BlockLayout::frozen`], when some of the block trains)
/// starts at a multiple of this many elements: 8 KiB of f32, 4 KiB of bf16 or f16, so
/// that a tail homed on NVMe in an extent of its own is read into the block's buffer at
/// an offset O_DIRECT accepts.
pub const TRAINED_ALIGN_ELEMENTS: usize = 2048;

/// The most transformer blocks a model may have: each has a block layout in host memory
/// from the moment its `config.json` is read, so a count past any real model's (the
/// largest have some hundreds) is refused before the layouts are built. 65,536 let a
/// fuzzed config.json of 40,080 layers take over 10 s to read (and `strata plan` of it
/// run out of memory).
pub const MAX_LAYERS: usize = 1 << 10;

/// Where one tensor lies in its block's buffer, in elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Slot {
    /// First element.
    pub offset: usize,
    /// Element count.
    pub len: usize,
}

impl Slot {
    /// The elements of the tensor in its block's buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len
    }

    /// The tensor in the block buffer bound at `bind`, whose elements are `dtype`.
    pub fn tensor(self, bind: Bind, dtype: Dtype) -> TensorRef {
        TensorRef::new(bind as u8, self.offset * dtype.size(), self.len, dtype)
    }
}

/// One tensor of a block: its name, shape and place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Hugging Face's name, without the family's prefix.
    pub name: String,
    /// Shape, row-major.
    pub shape: Vec<usize>,
    /// Place in the block's buffer.
    pub slot: Slot,
}

impl TensorSpec {
    /// Whether AdamW's weight decay applies (common practice, and the reference data's:
    /// tensors of two or more dimensions, not biases or normalisation weights).
    pub fn decays(&self) -> bool {
        self.shape.len() >= 2
    }
}

/// What a block computes, as the engine sees it: the first block turns tokens into the
/// residual stream, the last turns the stream and the targets into losses, every other
/// block maps the stream to itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockKind {
    /// The embedding: tokens in, the residual stream out.
    Embedding,
    /// Transformer block `layer` (0-based): residual stream in and out.
    Transformer {
        /// Which layer.
        layer: usize,
    },
    /// The output head: residual stream and targets in, per-position losses out. It may
    /// read another block's tensor (a tied embedding): see `Family::tied`.
    Head,
}

/// One block: what it computes and where its parameters lie.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockLayout {
    /// What the block computes.
    pub kind: BlockKind,
    /// Its parameters, in buffer order.
    pub tensors: Vec<TensorSpec>,
    /// Elements of its buffer (tensors plus alignment gaps).
    pub len: usize,
    /// Elements `0 .. frozen` are frozen (a LoRA model's base): they get no gradient, no
    /// optimizer state and no update. The block's gradients ([`Bind::Grads`]) hold
    /// elements `frozen .. len` only, so a tensor's gradient lies `frozen` elements before
    /// its slot ([`BlockLayout::grad_tensor`]). 0 for a model trained whole; `len` for a
    /// block that trains nothing.
    pub frozen: usize,
}

impl BlockLayout {
    /// A block of `kind` holding `tensors` (names after `prefix`, shapes) in this order,
    /// each starting at a multiple of [`TENSOR_ALIGN_ELEMENTS`].
    pub fn build(kind: BlockKind, prefix: &str, tensors: &[(&str, Vec<usize>)]) -> Self {
        let mut offset = 0;
        let mut specs = Vec::with_capacity(tensors.len());
        for (name, shape) in tensors {
            let len = shape.iter().product();
            specs.push(TensorSpec {
                name: format!("{prefix}{name}"),
                shape: shape.clone(),
                slot: Slot { offset, len },
            });
            offset = (offset + len).next_multiple_of(TENSOR_ALIGN_ELEMENTS);
        }
        BlockLayout {
            kind,
            tensors: specs,
            len: offset,
            frozen: 0,
        }
    }

    /// Elements that train: `frozen .. len`, the range its gradients, optimizer state and
    /// update cover.
    pub fn trained(&self) -> Range<usize> {
        self.frozen..self.len
    }

    /// Elements that train (the length of its gradients).
    pub fn trained_len(&self) -> usize {
        self.len - self.frozen
    }

    /// Whether any element trains.
    pub fn trains(&self) -> bool {
        self.frozen < self.len
    }

    /// The gradient of the tensor at `slot` in the gradients bound at `bind` (f32): `frozen`
    /// elements before its slot. Panics for a frozen tensor (a family's own bug).
    pub fn grad_tensor(&self, bind: Bind, slot: Slot) -> TensorRef {
        assert!(
            slot.offset >= self.frozen,
            "block {:?}: the tensor at {} is frozen",
            self.kind,
            slot.offset
        );
        TensorRef::new(
            bind as u8,
            (slot.offset - self.frozen) * 4,
            slot.len,
            Dtype::F32,
        )
    }

    /// The tensor called `name` (without the family's prefix), if this block has it.
    pub fn tensor(&self, name: &str) -> Option<&TensorSpec> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The slot of the tensor whose name ends with `suffix` (`ln_1.weight` finds
    /// `h.3.ln_1.weight`). Panics when there is none: a family's own layout bug.
    pub fn slot_of(&self, suffix: &str) -> Slot {
        self.tensors
            .iter()
            .find(|t| t.name == suffix || t.name.ends_with(&format!(".{suffix}")))
            .unwrap_or_else(|| panic!("block {:?} has no tensor {suffix}", self.kind))
            .slot
    }

    /// Parameters of this block (without alignment gaps).
    pub fn param_count(&self) -> usize {
        self.tensors.iter().map(|t| t.slot.len).sum()
    }
}

/// Hands out consecutive 256-byte-aligned tensors of one buffer a block program binds:
/// the scratch, or the saved activations (a family lays them out with it).
pub(crate) struct Carve {
    /// The buffer the tensors are in.
    bind: Bind,
    /// Where the next tensor starts, in bytes; after the last, the bytes used.
    pub(crate) next: usize,
}

impl Carve {
    /// Tensors of the buffer bound at `bind`, from its start.
    pub(crate) fn new(bind: Bind) -> Self {
        Carve { bind, next: 0 }
    }

    /// The next `len` elements of `dtype`.
    pub(crate) fn take(&mut self, len: usize, dtype: Dtype) -> TensorRef {
        let t = TensorRef::new(self.bind as u8, self.next, len, dtype);
        self.next = (self.next + t.bytes()).next_multiple_of(256);
        t
    }
}
