//! Which products of each transformer layer carry an adapter, for a family's programs:
//! [`Adapted`], made by [`adapt`] from the family's list of its layers' products (each
//! named by the end of its weight's name), with the LoRA model's blocks.
//!
//! Not here: the kernels of an adapted product (`kernels.rs`), the layout rules
//! ([`super::layout`]).

use strata_kernels::program::{Dtype, TensorRef};

use crate::model::approx::ApproxBackward;
use crate::model::layout::{BlockKind, BlockLayout, Carve};
use crate::model::{Family, ModelError};

use super::config::LoraConfig;
use super::layout::{AdapterSlots, adapter_slots, lora_blocks};
use super::targets::{LoraLayer, select_family_layers};

/// One layer's adapters: where product `i`'s `A` and `B` lie, for each of the family's
/// `N` products that carries one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LayerAdapters<const N: usize>([Option<AdapterSlots>; N]);

impl<const N: usize> LayerAdapters<N> {
    /// Product `i`'s adapter, if it has one.
    pub(crate) fn get(&self, i: usize) -> Option<AdapterSlots> {
        self.0[i]
    }

    /// Whether product `i` has an adapter.
    pub(crate) fn has(&self, i: usize) -> bool {
        self.0[i].is_some()
    }
}

/// A LoRA model's adapters as its family's programs read them.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Adapted<const N: usize> {
    /// The settings.
    pub(crate) config: LoraConfig,
    /// `scale()` in f32, the factor of the adapters' kernels.
    pub(crate) scale: f32,
    /// Per transformer layer.
    pub(crate) layers: Vec<LayerAdapters<N>>,
    /// Which products carry an adapter in some layer (their scratch is laid out).
    pub(crate) any: [bool; N],
    /// The adapters' parameters.
    pub(crate) params: usize,
    /// The adapted layers ([`select_family_layers`] of the base).
    pub(crate) selected: Vec<LoraLayer>,
}

impl<const N: usize> Adapted<N> {
    /// Layer `layer`'s adapters, with the rank.
    pub(crate) fn layer(&self, layer: usize) -> (&LayerAdapters<N>, usize) {
        (&self.layers[layer], self.config.rank)
    }
}

/// The blocks and the adapters of the LoRA model with `config` of `base` (a family
/// without adapters), whose layers' products are `products` (the ends of their weights'
/// names, in the family's order).
pub(crate) fn adapt<const N: usize>(
    base: &dyn Family,
    products: [&str; N],
    config: &LoraConfig,
) -> Result<(Vec<BlockLayout>, Adapted<N>), ModelError> {
    let selected = select_family_layers(base, config)?;
    let blocks = lora_blocks(base.blocks(), &selected, config.rank);
    let mut layers = Vec::new();
    for (b, block) in blocks.iter().enumerate() {
        let BlockKind::Transformer { .. } = block.kind else {
            continue;
        };
        let mut adapters = [None; N];
        for layer in selected.iter().filter(|l| l.block == b) {
            let i = products
                .iter()
                .position(|p| layer.weight.ends_with(p))
                .expect("select_layers selects the family's products' weights only");
            adapters[i] = Some(adapter_slots(block, layer));
        }
        layers.push(LayerAdapters(adapters));
    }
    let any = std::array::from_fn(|i| layers.iter().any(|a: &LayerAdapters<N>| a.has(i)));
    let params = blocks
        .iter()
        .flat_map(|b| b.tensors.iter().filter(|t| t.slot.offset >= b.frozen))
        .map(|t| t.slot.len)
        .sum();
    let adapted = Adapted {
        config: config.clone(),
        scale: config.scale() as f32,
        layers,
        any,
        params,
        selected,
    };
    Ok((blocks, adapted))
}

/// The refusal of a LoRA model with the backward `approx` (not exact): its sketches
/// estimate weight gradients, and a LoRA model computes none of its base's.
pub(crate) fn approximate_refused(approx: ApproxBackward) -> ModelError {
    ModelError::BadInput(format!(
        "--approx-backward {approx} does not combine with LoRA training: its sketches \
         estimate the frozen base's weight gradients, which LoRA does not compute; drop \
         --approx-backward"
    ))
}

/// The scratch tensors of a family's adapters: each product's `u = x Aᵀ` (rows × rank;
/// empty where no layer adapts it), the wide tensor (`v`, `dv` and `dx'`, rows × the
/// widest input or output) and `du` (rows × rank).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdapterScratch<const N: usize> {
    pub(crate) u: [TensorRef; N],
    pub(crate) wide: TensorRef,
    pub(crate) du: TensorRef,
}

impl<const N: usize> AdapterScratch<N> {
    /// Laid out by `carve`, for `rows` rows, a product's widest side `widest`, and the
    /// model's adapters' rank and products (none: every tensor empty).
    pub(crate) fn new(
        carve: &mut Carve,
        (rows, widest): (usize, usize),
        lora: Option<(usize, [bool; N])>,
        dtype: Dtype,
    ) -> Self {
        let (rank, any) = lora.unwrap_or((0, [false; N]));
        let u = any.map(|adapted| carve.take(if adapted { rows * rank } else { 0 }, dtype));
        let wide = carve.take(if rank > 0 { rows * widest } else { 0 }, dtype);
        let du = carve.take(rows * rank, dtype);
        AdapterScratch { u, wide, du }
    }

    /// The same tensors with the `u` of the products `adapters` adapt in `saved`.
    pub(crate) fn with_saved(self, saved: &[TensorRef; N], adapters: &LayerAdapters<N>) -> Self {
        let u = std::array::from_fn(|i| if adapters.has(i) { saved[i] } else { self.u[i] });
        AdapterScratch { u, ..self }
    }
}

/// The saved `u` of each product `adapters` adapts, of rank `rank` (rows × rank; empty
/// otherwise, and for a model without adapters).
pub(crate) fn saved_u<const N: usize>(
    carve: &mut Carve,
    rows: usize,
    adapters: Option<(&LayerAdapters<N>, usize)>,
    dtype: Dtype,
) -> [TensorRef; N] {
    std::array::from_fn(|i| {
        let len = match adapters {
            Some((a, rank)) if a.has(i) => rows * rank,
            _ => 0,
        };
        carve.take(len, dtype)
    })
}
