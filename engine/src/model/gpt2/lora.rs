//! GPT-2's LoRA model ([`Family::lora`](crate::model::Family::lora)): which of a layer's
//! four products (`attn.c_attn`, `attn.c_proj`, `mlp.c_fc`, `mlp.c_proj`) carry an
//! adapter. The base's Conv1D weights are (in, out); the adapters are peft's, `A`
//! (rank × in) and `B` (out × rank) as `nn.Linear` stores them, whatever the base's
//! layout (peft's `fan_in_fan_out` transposes only the merged update), so their kernels
//! are every family's ([`AdapterKernels`](crate::model::lora::kernels::AdapterKernels)).

use crate::model::layout::BlockLayout;
use crate::model::lora::LoraConfig;
use crate::model::lora::adapted::{self, Adapted};
use crate::model::{Family, ModelError};

/// A layer's products, in the order the forward computes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Product {
    Attn,
    AttnProj,
    Fc,
    MlpProj,
}

impl Product {
    const ALL: [Product; 4] = [
        Product::Attn,
        Product::AttnProj,
        Product::Fc,
        Product::MlpProj,
    ];

    /// The end of its weight's name.
    fn weight(self) -> &'static str {
        match self {
            Product::Attn => "attn.c_attn.weight",
            Product::AttnProj => "attn.c_proj.weight",
            Product::Fc => "mlp.c_fc.weight",
            Product::MlpProj => "mlp.c_proj.weight",
        }
    }
}

/// GPT-2's adapters: per layer, which of its four products carry one.
pub(super) type Gpt2Lora = Adapted<4>;

/// One layer's adapters.
pub(super) type LayerAdapters = adapted::LayerAdapters<4>;

/// The adapters' scratch tensors.
pub(super) type LoraScratch = adapted::AdapterScratch<4>;

/// The blocks and the adapters of the LoRA model with `config` of `base` (GPT-2 without
/// adapters).
pub(super) fn adapt(
    base: &dyn Family,
    config: &LoraConfig,
) -> Result<(Vec<BlockLayout>, Gpt2Lora), ModelError> {
    adapted::adapt(base, Product::ALL.map(Product::weight), config)
}

/// Checks of the LoRA model, beside the family's own tests.
#[cfg(test)]
mod tests {
    use crate::model::gpt2::{Gpt2, Gpt2Config};
    use crate::model::lora::LoraConfig;
    use crate::model::{Bind, Dtype, Family, Pass, Shape, Target};

    fn config(targets: &[&str]) -> LoraConfig {
        LoraConfig::new(4, 8.0, 0.0, targets.iter().map(|t| t.to_string()).collect()).unwrap()
    }

    #[test]
    fn lora_programs_stay_inside_the_trained_tail_and_saved_backwards_read_what_was_saved() {
        let base = Gpt2::new(Gpt2Config::tiny()).unwrap();
        let shape = Shape { batch: 2, seq: 16 };
        for targets in [
            &["c_attn"][..],
            &["all-linear"],
            &["c_proj"],
            &["h.1.mlp.c_fc"],
        ] {
            let lora = base.lora(&config(targets)).unwrap();
            for (target, dtype) in [(Target::Cpu, Dtype::F32), (Target::Cuda, Dtype::Bf16)] {
                crate::model::checks::check_programs(&*lora, shape, target, dtype);
            }
            // The embedding's backward computes nothing; the head's writes no gradient.
            let head = lora.blocks().len() - 1;
            let cpu = |b, pass| lora.program(b, pass, shape, Target::Cpu, Dtype::F32);
            assert!(cpu(0, Pass::Backward).is_empty());
            let mut grads = 0;
            for k in cpu(head, Pass::Backward) {
                k.for_each_tensor(|t, _| {
                    grads +=
                        usize::from(t.buf == Bind::Grads as u8 || t.buf == Bind::TiedGrads as u8)
                });
            }
            assert_eq!(grads, 0, "{targets:?}");
        }
    }

    #[test]
    fn the_saved_forward_keeps_each_adapted_products_u_and_only_the_inputs_adapters_read() {
        let base = Gpt2::new(Gpt2Config::tiny()).unwrap();
        let c = base.config().width;
        let shape = Shape { batch: 2, seq: 16 };
        let saved = |m: &dyn Family| m.saved_bytes(1, shape, Target::Cpu, Dtype::F32);
        let u = (32 * 4 * 4usize).next_multiple_of(256);
        let input = (32 * c * 4usize).next_multiple_of(256);
        // c_proj (attention and MLP): two u, and neither ln_1's nor ln_2's output.
        let proj = base.lora(&config(&["c_proj"])).unwrap();
        assert_eq!(saved(&*proj), saved(&base) + 2 * u - 2 * input);
        let attn = base.lora(&config(&["c_attn"])).unwrap();
        assert_eq!(saved(&*attn), saved(&base) + u - input);
    }
}
