//! The Llama family's LoRA model ([`Family::lora`](crate::model::Family::lora)): which
//! of a layer's seven products carry an adapter, where its `A` and `B` lie, and the
//! scratch and saved tensors the adapters add; their kernels are
//! [`AdapterKernels`](crate::model::lora::kernels::AdapterKernels). `u = x Aᵀ` is what a
//! saved forward ([`Pass::ForwardSave`](crate::model::Pass::ForwardSave)) keeps for its
//! backward (rows × rank per adapted product); the rest is recomputed or scratch. The
//! base's own gradients are not computed at all (the layer's programs ask for none).

use crate::model::layout::BlockLayout;
use crate::model::lora::LoraConfig;
use crate::model::lora::adapted::{self, Adapted};
use crate::model::{Family, ModelError};

/// A layer's products, in the order the forward computes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Product {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Product {
    pub(super) const ALL: [Product; 7] = [
        Product::Q,
        Product::K,
        Product::V,
        Product::O,
        Product::Gate,
        Product::Up,
        Product::Down,
    ];

    /// The end of its weight's name.
    fn weight(self) -> &'static str {
        match self {
            Product::Q => "self_attn.q_proj.weight",
            Product::K => "self_attn.k_proj.weight",
            Product::V => "self_attn.v_proj.weight",
            Product::O => "self_attn.o_proj.weight",
            Product::Gate => "mlp.gate_proj.weight",
            Product::Up => "mlp.up_proj.weight",
            Product::Down => "mlp.down_proj.weight",
        }
    }
}

/// The Llama family's adapters: per layer, which of its seven products carry one.
pub(super) type LlamaLora = Adapted<7>;

/// One layer's adapters.
pub(super) type LayerAdapters = crate::model::lora::adapted::LayerAdapters<7>;

/// The blocks and the adapters of the LoRA model with `config` of `base` (a Llama model
/// without adapters).
pub(super) fn adapt(
    base: &dyn Family,
    config: &LoraConfig,
) -> Result<(Vec<BlockLayout>, LlamaLora), ModelError> {
    adapted::adapt(base, Product::ALL.map(Product::weight), config)
}

/// The adapters' scratch tensors.
pub(super) type LoraScratch = adapted::AdapterScratch<7>;

/// Checks of the LoRA model, beside the family's own tests.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::llama::{Llama, LlamaConfig, Variant};
    use crate::model::{Bind, Pass, Shape};
    use crate::model::{BlockKind, Dtype, Family, Model, Target};

    fn config(targets: &[&str]) -> LoraConfig {
        LoraConfig::new(4, 8.0, 0.0, targets.iter().map(|t| t.to_string()).collect()).unwrap()
    }

    fn tiny(variant: Variant, tied: bool) -> Llama {
        let mut c = LlamaConfig::llama(2, 48, 80, 4, 2, 96, 32);
        c.head_dim = 16;
        c.variant = variant;
        c.tied = tied;
        c.qkv_bias = variant == Variant::Qwen2;
        c.qk_norm = variant == Variant::Qwen3;
        Llama::new(c).unwrap()
    }

    #[test]
    fn lora_programs_stay_inside_the_trained_tail_and_saved_backwards_read_what_was_saved() {
        let shape = Shape { batch: 2, seq: 16 };
        for (variant, tied) in [
            (Variant::Llama, false),
            (Variant::Qwen2, true),
            (Variant::Qwen3, false),
        ] {
            let base = tiny(variant, tied);
            for targets in [
                &["q_proj", "v_proj"][..],
                &["all-linear"],
                &["o_proj", "down_proj"],
                &["layers.1.mlp.gate_proj"],
            ] {
                let lora = base.lora(&config(targets)).unwrap();
                for (target, dtype) in [(Target::Cpu, Dtype::F32), (Target::Cuda, Dtype::Bf16)] {
                    crate::model::checks::check_programs(&*lora, shape, target, dtype);
                }
                let packed = lora.packed(0).unwrap();
                crate::model::checks::check_programs(&*packed, shape, Target::Cpu, Dtype::F32);
            }
        }
    }

    #[test]
    fn frozen_blocks_train_nothing_and_adapted_ones_only_their_adapters() {
        let base = tiny(Variant::Llama, false);
        let lora = base.lora(&config(&["layers.1.self_attn.v_proj"])).unwrap();
        let blocks = lora.blocks();
        // The embedding, the head and layer 0 train nothing; layer 1 its v_proj's A and B.
        for b in [0, 1, 3] {
            assert_eq!(blocks[b], {
                let mut frozen = base.blocks()[b].clone();
                frozen.frozen = frozen.len;
                frozen
            });
        }
        let layer = &blocks[2];
        let aligned = crate::model::layout::TRAINED_ALIGN_ELEMENTS;
        assert_eq!(layer.frozen, base.blocks()[2].len.next_multiple_of(aligned));
        assert_eq!(
            layer.tensors[..base.blocks()[2].tensors.len()],
            base.blocks()[2].tensors
        );
        let tail: Vec<_> = layer.tensors[base.blocks()[2].tensors.len()..]
            .iter()
            .map(|t| (t.name.as_str(), t.shape.clone()))
            .collect();
        assert_eq!(
            tail,
            [
                ("model.layers.1.self_attn.v_proj.lora_A.weight", vec![4, 48]),
                ("model.layers.1.self_attn.v_proj.lora_B.weight", vec![32, 4]),
            ]
        );
        assert_eq!(lora.param_count(), base.param_count() + 4 * 48 + 32 * 4);
        // The embedding's backward computes nothing; the frozen layer's writes no gradient.
        let shape = Shape { batch: 1, seq: 8 };
        assert!(
            lora.program(0, Pass::Backward, shape, Target::Cpu, Dtype::F32)
                .is_empty()
        );
        for pass in [Pass::Backward, Pass::BackwardSaved] {
            for b in [1, 3] {
                let program = lora.program(b, pass, shape, Target::Cpu, Dtype::F32);
                let mut grads = 0;
                for k in &program {
                    k.for_each_tensor(|t, _| grads += usize::from(t.buf == Bind::Grads as u8));
                }
                assert_eq!(grads, 0, "block {b} {pass:?}");
            }
        }
    }

    #[test]
    fn lora_is_refused_twice_with_sketches_and_for_targets_outside_the_layers() {
        let base = Model::of(tiny(Variant::Llama, false));
        let lora = base.lora(&config(&["q_proj"])).unwrap();
        let e = lora.lora(&config(&["q_proj"])).unwrap_err().to_string();
        assert!(e.contains("already has LoRA adapters"), "{e}");
        let e = lora
            .approximate("attn:0.5".parse().unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("LoRA"), "{e}");
        let sketched = base.approximate("mlp:0.5".parse().unwrap()).unwrap();
        let e = sketched.lora(&config(&["q_proj"])).unwrap_err().to_string();
        assert!(e.contains("drop --approx-backward"), "{e}");
        let mut dropout = config(&["q_proj"]);
        dropout.dropout = 0.1;
        let e = base.lora(&dropout).unwrap_err().to_string();
        assert!(e.contains("--lora-dropout 0"), "{e}");
        let e = base.lora(&config(&["lm_head"])).unwrap_err().to_string();
        assert!(e.contains("outside the transformer blocks"), "{e}");
        assert_ne!(lora, base);
        assert_eq!(lora.lora_config(), Some(&config(&["q_proj"])));
    }

    #[test]
    fn the_saved_forward_keeps_each_adapted_products_u_and_only_the_inputs_adapters_read() {
        let base = tiny(Variant::Llama, false);
        let lora = base.lora(&config(&["q_proj", "down_proj"])).unwrap();
        let shape = Shape { batch: 2, seq: 16 };
        let saved = |m: &dyn Family, b| m.saved_bytes(b, shape, Target::Cpu, Dtype::F32);
        // 32 rows × rank 4 in f32 per adapted product, each carved to 256 bytes; not the
        // MLP's input (32 × 48), which only gate's and up's gradients read.
        let u = (32 * 4 * 4usize).next_multiple_of(256);
        let xn2 = 32 * 48 * 4;
        assert_eq!(saved(&*lora, 1), saved(&base, 1) + 2 * u - xn2);
        // Adapters on the MLP's input keep it; none keeps neither input.
        let mlp = base.lora(&config(&["up_proj"])).unwrap();
        assert_eq!(saved(&*mlp, 1), saved(&base, 1) + u - xn2);
        let other_layer = base.lora(&config(&["layers.1.self_attn.q_proj"])).unwrap();
        assert_eq!(saved(&*other_layer, 1), saved(&base, 1) - 2 * xn2);
        assert!(matches!(
            lora.blocks()[1].kind,
            BlockKind::Transformer { layer: 0 }
        ));
    }
}
