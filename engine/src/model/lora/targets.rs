//! Which linear layers of a model LoRA target names select, by peft's rule: a name
//! selects every module whose path is the name or ends with `.name` (so GPT-2's
//! `c_proj` selects both the attention's and the MLP's), and "all-linear" every linear
//! layer of the transformer blocks. A layer's path is its weight's Hugging Face name
//! without `.weight` (`model.layers.0.self_attn.q_proj`, `transformer.h.0.attn.c_attn`).
//! Also the names a LoRA model's layout gives each selected layer's `A` and `B`.

use crate::model::{BlockKind, Family, ModelError};

use super::config::{ALL_LINEAR, LoraConfig};

/// How a family stores a linear layer's weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightLayout {
    /// `(out, in)`: torch's `nn.Linear` (the Llama family).
    OutIn,
    /// `(in, out)`: transformers' `Conv1D` (GPT-2), peft's `fan_in_fan_out`.
    InOut,
}

impl WeightLayout {
    /// The layout of `family`'s linear weights.
    pub fn of(family: &dyn Family) -> Self {
        match family.name() {
            "gpt2" => WeightLayout::InOut,
            _ => WeightLayout::OutIn,
        }
    }

    /// `(in, out)` of a weight of `shape` (two dimensions) in this layout.
    fn features(self, shape: &[usize]) -> (usize, usize) {
        match self {
            WeightLayout::OutIn => (shape[1], shape[0]),
            WeightLayout::InOut => (shape[0], shape[1]),
        }
    }
}

/// One linear layer an adapter changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraLayer {
    /// The block holding its weight.
    pub block: usize,
    /// The weight's name in the block's layout (`model.layers.0.self_attn.q_proj.weight`).
    pub weight: String,
    /// The module's path, as peft names it (`model.layers.0.self_attn.q_proj`).
    pub module: String,
    /// Input features: `A` is `rank × in_features`.
    pub in_features: usize,
    /// Output features: `B` is `out_features × rank`.
    pub out_features: usize,
    /// How the base stores the weight.
    pub layout: WeightLayout,
}

/// A linear weight of `model`: its block, whether the block is a transformer block,
/// its name and its module's path.
struct Linear<'a> {
    block: usize,
    in_layer: bool,
    weight: &'a str,
    shape: &'a [usize],
    module: String,
}

fn linears(family: &dyn Family) -> Vec<Linear<'_>> {
    let mut out = Vec::new();
    for (b, block) in family.blocks().iter().enumerate() {
        for t in &block.tensors {
            let Some(stem) = t.name.strip_suffix(".weight") else {
                continue;
            };
            if is_adapter(&t.name) {
                // A LoRA model's own adapters are not layers to adapt.
                continue;
            }
            if t.shape.len() == 2 {
                out.push(Linear {
                    block: b,
                    in_layer: matches!(block.kind, BlockKind::Transformer { .. }),
                    weight: &t.name,
                    shape: &t.shape,
                    module: format!("{}{stem}", family.hf_prefix(b)),
                });
            }
        }
    }
    out
}

/// What a layout name of an adapter tensor ends with: `.lora_A.weight`, `.lora_B.weight`.
const ADAPTER_SUFFIXES: [&str; 2] = [".lora_A.weight", ".lora_B.weight"];

/// The layout names of `layer`'s `A` and `B` in a LoRA model: its weight's name with
/// `.weight` replaced (`model.layers.3.self_attn.q_proj.lora_A.weight`), so that the
/// family's file prefix before it gives peft's module path
/// ([`peft_names`](super::peft_names)).
pub fn adapter_names(layer: &LoraLayer) -> [String; 2] {
    let stem = layer
        .weight
        .strip_suffix(".weight")
        .unwrap_or(&layer.weight);
    ADAPTER_SUFFIXES.map(|suffix| format!("{stem}{suffix}"))
}

/// Whether `name` is an adapter tensor's layout name (a LoRA model's own adapters are
/// not layers to adapt).
pub fn is_adapter(name: &str) -> bool {
    ADAPTER_SUFFIXES.iter().any(|s| name.ends_with(s))
}

/// Whether target `name` selects the module at `path` (peft's
/// `check_target_module_exists` for a list of names).
pub fn selects(name: &str, path: &str) -> bool {
    path == name || path.strip_suffix(name).is_some_and(|p| p.ends_with('.'))
}

/// The layers of `family` that `config`'s targets select, in block and layout order; an
/// error for a target that selects nothing, or selects a layer outside the transformer
/// blocks (the embeddings, the output head), which strata does not adapt. (A model's:
/// [`select_layers`](super::select_layers).)
pub fn select_family_layers(
    family: &dyn Family,
    config: &LoraConfig,
) -> Result<Vec<LoraLayer>, ModelError> {
    let all = linears(family);
    let every = config.targets.iter().any(|t| t == ALL_LINEAR);
    for target in config.targets.iter().filter(|t| *t != ALL_LINEAR) {
        let hits: Vec<&Linear> = all.iter().filter(|l| selects(target, &l.module)).collect();
        if let Some(outside) = hits.iter().find(|l| !l.in_layer) {
            return Err(ModelError::BadInput(format!(
                "LoRA target `{target}` selects `{}`, outside the transformer blocks; \
                 strata adapts only the blocks' linear layers ({})",
                outside.module,
                layer_names(&all)
            )));
        }
        if hits.is_empty() {
            return Err(ModelError::BadInput(format!(
                "LoRA target `{target}` names no linear layer of this {} model; its \
                 layers are {}",
                family.name(),
                layer_names(&all)
            )));
        }
    }
    let layout = WeightLayout::of(family);
    Ok(all
        .iter()
        .filter(|l| l.in_layer)
        .filter(|l| every || config.targets.iter().any(|t| selects(t, &l.module)))
        .map(|l| {
            let (in_features, out_features) = layout.features(l.shape);
            LoraLayer {
                block: l.block,
                weight: l.weight.to_string(),
                module: l.module.clone(),
                in_features,
                out_features,
                layout,
            }
        })
        .collect())
}

/// The distinct last parts of the transformer blocks' linear layers' paths
/// (`self_attn.q_proj, ...`), for messages.
fn layer_names(all: &[Linear]) -> String {
    let mut names: Vec<&str> = Vec::new();
    for l in all.iter().filter(|l| l.in_layer) {
        let last = l.module.rsplit('.').next().unwrap_or(&l.module);
        if !names.contains(&last) {
            names.push(last);
        }
    }
    names.join(", ")
}
