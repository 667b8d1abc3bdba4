//! The parameter layout: the model as an ordered list of blocks, each with all of its
//! parameters in one flat buffer, carved into tensors at fixed offsets.
//!
//! A block's buffer is the unit the engine moves between tiers, so its layout is the
//! same for every dtype (offsets count elements, not bytes). Each tensor starts at a
//! multiple of [`TENSOR_ALIGN_ELEMENTS`]; the gaps are zero and stay zero.
//!
//! Tensor names are Hugging Face's without the `transformer.` prefix (`h.3.ln_1.weight`),
//! and linear weights are stored (in, out) as in its `Conv1D`, so loading and saving are
//! plain copies.

use std::ops::Range;

use super::Gpt2Config;

/// Tensors start at multiples of this many elements (128 bytes of f32, 64 of bf16).
pub const TENSOR_ALIGN_ELEMENTS: usize = 32;

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
}

/// One tensor of a block: its name, shape and place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Hugging Face's name, without `transformer.`.
    pub name: String,
    /// Shape, row-major.
    pub shape: Vec<usize>,
    /// Place in the block's buffer.
    pub slot: Slot,
}

impl TensorSpec {
    /// Whether AdamW's weight decay applies (GPT-2 practice, and the reference data's:
    /// tensors of two or more dimensions, not biases or LayerNorm parameters).
    pub fn decays(&self) -> bool {
        self.shape.len() >= 2
    }
}

/// What a block computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockKind {
    /// Token and position embedding: tokens in, the residual stream out.
    Embedding,
    /// Transformer block `layer` (0-based): residual stream in and out.
    Transformer {
        /// Which layer.
        layer: usize,
    },
    /// Final LayerNorm and output head (tied to the embedding's `wte`): residual stream
    /// and targets in, losses out.
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
}

impl BlockLayout {
    fn build(kind: BlockKind, prefix: &str, tensors: &[(&str, Vec<usize>)]) -> Self {
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
        }
    }

    /// The tensor called `name` (without `transformer.`), if this block has it.
    pub fn tensor(&self, name: &str) -> Option<&TensorSpec> {
        self.tensors.iter().find(|t| t.name == name)
    }

    fn slot(&self, name: &str) -> Slot {
        let full = match self.kind {
            BlockKind::Transformer { layer } => format!("h.{layer}.{name}"),
            _ => name.to_string(),
        };
        self.tensor(&full)
            .unwrap_or_else(|| panic!("block {:?} has no tensor {full}", self.kind))
            .slot
    }

    /// Parameters of this block (without alignment gaps).
    pub fn param_count(&self) -> usize {
        self.tensors.iter().map(|t| t.slot.len).sum()
    }
}

/// The layouts of every block of a model, in order: embedding, `layers` transformer
/// blocks, head.
pub fn block_layouts(config: &Gpt2Config) -> Vec<BlockLayout> {
    let (c, v, ctx) = (config.width, config.vocab, config.ctx);
    let mut blocks = vec![BlockLayout::build(
        BlockKind::Embedding,
        "",
        &[("wte.weight", vec![v, c]), ("wpe.weight", vec![ctx, c])],
    )];
    for layer in 0..config.layers {
        blocks.push(BlockLayout::build(
            BlockKind::Transformer { layer },
            &format!("h.{layer}."),
            &[
                ("ln_1.weight", vec![c]),
                ("ln_1.bias", vec![c]),
                ("attn.c_attn.weight", vec![c, 3 * c]),
                ("attn.c_attn.bias", vec![3 * c]),
                ("attn.c_proj.weight", vec![c, c]),
                ("attn.c_proj.bias", vec![c]),
                ("ln_2.weight", vec![c]),
                ("ln_2.bias", vec![c]),
                ("mlp.c_fc.weight", vec![c, 4 * c]),
                ("mlp.c_fc.bias", vec![4 * c]),
                ("mlp.c_proj.weight", vec![4 * c, c]),
                ("mlp.c_proj.bias", vec![c]),
            ],
        ));
    }
    blocks.push(BlockLayout::build(
        BlockKind::Head,
        "",
        &[("ln_f.weight", vec![c]), ("ln_f.bias", vec![c])],
    ));
    blocks
}

/// The embedding block's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddingSlots {
    /// Token embedding (V, C); also the output head's weight.
    pub wte: Slot,
    /// Position embedding (ctx, C).
    pub wpe: Slot,
}

impl EmbeddingSlots {
    /// The slots of an embedding block's layout.
    pub fn of(layout: &BlockLayout) -> Self {
        assert_eq!(layout.kind, BlockKind::Embedding);
        EmbeddingSlots {
            wte: layout.slot("wte.weight"),
            wpe: layout.slot("wpe.weight"),
        }
    }
}

/// A transformer block's tensors (the same offsets in every layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct TransformerSlots {
    pub ln_1_weight: Slot,
    pub ln_1_bias: Slot,
    /// (C, 3C)
    pub c_attn_weight: Slot,
    pub c_attn_bias: Slot,
    /// (C, C)
    pub attn_proj_weight: Slot,
    pub attn_proj_bias: Slot,
    pub ln_2_weight: Slot,
    pub ln_2_bias: Slot,
    /// (C, 4C)
    pub c_fc_weight: Slot,
    pub c_fc_bias: Slot,
    /// (4C, C)
    pub mlp_proj_weight: Slot,
    pub mlp_proj_bias: Slot,
}

impl TransformerSlots {
    /// The slots of a transformer block's layout.
    pub fn of(layout: &BlockLayout) -> Self {
        assert!(matches!(layout.kind, BlockKind::Transformer { .. }));
        TransformerSlots {
            ln_1_weight: layout.slot("ln_1.weight"),
            ln_1_bias: layout.slot("ln_1.bias"),
            c_attn_weight: layout.slot("attn.c_attn.weight"),
            c_attn_bias: layout.slot("attn.c_attn.bias"),
            attn_proj_weight: layout.slot("attn.c_proj.weight"),
            attn_proj_bias: layout.slot("attn.c_proj.bias"),
            ln_2_weight: layout.slot("ln_2.weight"),
            ln_2_bias: layout.slot("ln_2.bias"),
            c_fc_weight: layout.slot("mlp.c_fc.weight"),
            c_fc_bias: layout.slot("mlp.c_fc.bias"),
            mlp_proj_weight: layout.slot("mlp.c_proj.weight"),
            mlp_proj_bias: layout.slot("mlp.c_proj.bias"),
        }
    }
}

/// The head block's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadSlots {
    /// Final LayerNorm weight (C).
    pub ln_f_weight: Slot,
    /// Final LayerNorm bias (C).
    pub ln_f_bias: Slot,
}

impl HeadSlots {
    /// The slots of a head block's layout.
    pub fn of(layout: &BlockLayout) -> Self {
        assert_eq!(layout.kind, BlockKind::Head);
        HeadSlots {
            ln_f_weight: layout.slot("ln_f.weight"),
            ln_f_bias: layout.slot("ln_f.bias"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_cover_every_parameter_once_aligned_and_disjoint() {
        for config in [
            Gpt2Config::tiny(),
            Gpt2Config::gpt2(),
            Gpt2Config::new(3, 3, 9, 7, 5),
        ] {
            let blocks = block_layouts(&config);
            assert_eq!(blocks.len(), config.layers + 2);
            let total: usize = blocks.iter().map(|b| b.param_count()).sum();
            assert_eq!(total, config.param_count());
            for block in &blocks {
                let mut end = 0;
                for t in &block.tensors {
                    assert_eq!(t.slot.offset % TENSOR_ALIGN_ELEMENTS, 0);
                    assert!(t.slot.offset >= end);
                    assert_eq!(t.slot.len, t.shape.iter().product::<usize>());
                    end = t.slot.range().end;
                }
                assert!(end <= block.len && block.len % TENSOR_ALIGN_ELEMENTS == 0);
            }
            let a = TransformerSlots::of(&blocks[1]);
            let b = TransformerSlots::of(&blocks[config.layers]);
            assert_eq!(a.mlp_proj_weight, b.mlp_proj_weight);
            assert_eq!(
                blocks[1].tensor("h.0.ln_1.bias").unwrap().shape,
                vec![config.width]
            );
        }
    }
}
