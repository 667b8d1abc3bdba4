//! A LoRA model's blocks, for any family: each block is its base's tensors at their
//! offsets, then, for each adapted layer in it, `lora_A` (rank × in) and `lora_B`
//! (out × rank), the block's trained tail ([`BlockLayout::frozen`] is the first
//! adapter's offset; a block without one trains nothing). Also the adapters' starting
//! values (peft's: `A` kaiming-uniform, `B` zero).
//!
//! Not here: the programs that apply and train the adapters (each family's), and an
//! adapter put into or read from a model's blocks (`blocks.rs`).

use crate::model::gpt2::init::SplitMix64;
use crate::model::layout::{
    BlockLayout, Slot, TENSOR_ALIGN_ELEMENTS, TRAINED_ALIGN_ELEMENTS, TensorSpec,
};

use super::targets::{LoraLayer, adapter_names};

/// Mixed into the seed of the adapters' random stream, so that it is not the base's.
const ADAPTER_STREAM: u64 = 0x4c6f_5241_4164_6170;

/// Where one adapted layer's `A` and `B` lie in its block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdapterSlots {
    /// `lora_A`: rank × in.
    pub a: Slot,
    /// `lora_B`: out × rank.
    pub b: Slot,
}

/// The blocks of the LoRA model over `base` with `layers` (from
/// [`select_layers`](super::select_layers) on the base) of `rank`: each base block
/// unchanged, then (from a multiple of [`TRAINED_ALIGN_ELEMENTS`]) its layers' `A` and
/// `B` in order, each aligned; `frozen` is the first adapter's offset, or the block's
/// length where it has none.
pub fn lora_blocks(base: &[BlockLayout], layers: &[LoraLayer], rank: usize) -> Vec<BlockLayout> {
    base.iter()
        .enumerate()
        .map(|(b, block)| {
            let mut out = block.clone();
            let adapted = layers.iter().any(|l| l.block == b);
            if adapted {
                out.len = block.len.next_multiple_of(TRAINED_ALIGN_ELEMENTS);
            }
            out.frozen = out.len;
            for layer in layers.iter().filter(|l| l.block == b) {
                let shapes = [
                    vec![rank, layer.in_features],
                    vec![layer.out_features, rank],
                ];
                for (name, shape) in adapter_names(layer).into_iter().zip(shapes) {
                    let len = shape.iter().product();
                    let offset = out.len;
                    out.tensors.push(TensorSpec {
                        name,
                        shape,
                        slot: Slot { offset, len },
                    });
                    out.len = (offset + len).next_multiple_of(TENSOR_ALIGN_ELEMENTS);
                }
            }
            out
        })
        .collect()
}

/// Where `layer`'s `A` and `B` lie in `block` (a LoRA model's). Panics when the block has
/// no adapter of that layer: a family's own bug.
pub fn adapter_slots(block: &BlockLayout, layer: &LoraLayer) -> AdapterSlots {
    let [a, b] = adapter_names(layer).map(|name| {
        block
            .tensor(&name)
            .unwrap_or_else(|| panic!("block {:?} has no adapter {name}", block.kind))
            .slot
    });
    AdapterSlots { a, b }
}

/// peft's starting adapters of block `b`, `block` (a LoRA model's), written into
/// `params` (the block's whole buffer): each `A` kaiming-uniform with a = sqrt(5), which
/// is uniform in ±1/sqrt(in), drawn in layout order from the block's own stream of
/// `seed`; each `B` zero, so the model starts as its base. `layers` are the model's.
pub fn init_adapters(
    (b, block): (usize, &BlockLayout),
    layers: &[LoraLayer],
    seed: u64,
    params: &mut [f32],
) {
    let mut rng = SplitMix64::for_block(block.kind, seed ^ ADAPTER_STREAM);
    for layer in layers.iter().filter(|l| l.block == b) {
        let slots = adapter_slots(block, layer);
        let bound = 1.0 / (layer.in_features as f64).sqrt();
        for v in &mut params[slots.a.range()] {
            *v = ((2.0 * rng.uniform() - 1.0) * bound) as f32;
        }
        params[slots.b.range()].fill(0.0);
    }
}
