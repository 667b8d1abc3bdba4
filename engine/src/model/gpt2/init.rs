//! GPT-2's initialisation for training from scratch, deterministic in a seed.

use crate::model::{BlockKind, BlockLayout, TensorSpec};

/// SplitMix64: a small, well-mixed generator, enough for initial weights.
pub(in crate::model) struct SplitMix64(u64);

impl SplitMix64 {
    pub(in crate::model) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// The stream of block `kind`'s values: one stream per block, so that a block's
    /// values do not depend on the others' sizes.
    pub(in crate::model) fn for_block(kind: BlockKind, seed: u64) -> Self {
        let index = match kind {
            BlockKind::Embedding => 0,
            BlockKind::Transformer { layer } => layer as u64 + 1,
            BlockKind::Head => u64::MAX,
        };
        SplitMix64(seed ^ index.wrapping_mul(0x2545_f491_4f6c_dd1d))
    }

    /// Uniform in (0, 1].
    pub(in crate::model) fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    pub(in crate::model) fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

/// GPT-2's initialisation for training from scratch (Hugging Face's rule): weights and
/// embeddings normal with deviation 0.02, the residual projections' 0.02 / sqrt(2
/// layers), biases 0, LayerNorm weights 1. Deterministic in `seed`.
pub(super) fn gpt2_init(block: &BlockLayout, layers: usize, seed: u64) -> Vec<f32> {
    const STD: f64 = 0.02;
    let layers = layers.max(1) as f64;
    init_block_with(block, seed, |t| {
        if t.name.ends_with(".bias") {
            Init::Zero
        } else if t.name.contains("ln_") {
            Init::One
        } else if t.name.ends_with("c_proj.weight") {
            Init::Normal(STD / (2.0 * layers).sqrt())
        } else {
            Init::Normal(STD)
        }
    })
}

/// How a tensor starts.
pub(in crate::model) enum Init {
    /// All zeros.
    Zero,
    /// All ones.
    One,
    /// Normal with this deviation, drawn from the block's stream.
    Normal(f64),
}

/// Block `block`'s initial parameters, each tensor as `rule` says, the normal ones drawn
/// in tensor order from the block's own stream ([`SplitMix64::for_block`]).
pub(in crate::model) fn init_block_with(
    block: &BlockLayout,
    seed: u64,
    rule: impl Fn(&TensorSpec) -> Init,
) -> Vec<f32> {
    let mut buffer = vec![0.0; block.len];
    let mut rng = SplitMix64::for_block(block.kind, seed);
    for t in &block.tensors {
        let out = &mut buffer[t.slot.range()];
        match rule(t) {
            Init::Zero => {}
            Init::One => out.fill(1.0),
            Init::Normal(std) => {
                for v in out {
                    *v = (rng.normal() * std) as f32;
                }
            }
        }
    }
    buffer
}

#[cfg(test)]
mod tests {
    use super::super::Gpt2Config;
    use crate::model::Model;

    #[test]
    fn init_is_deterministic_and_shaped_like_gpt2() {
        let model = Model::new(Gpt2Config::tiny()).unwrap();
        let a = model.init_params(7);
        assert_eq!(a, model.init_params(7));
        assert_ne!(a, model.init_params(8));
        let (block, ln) = model.find_tensor("h.1.ln_2.weight").unwrap();
        assert!(a[block][ln.slot.range()].iter().all(|&v| v == 1.0));
        let (block, wte) = model.find_tensor("wte.weight").unwrap();
        let w = &a[block][wte.slot.range()];
        let std = (w.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / w.len() as f64).sqrt();
        assert!((std - 0.02).abs() < 0.002, "std {std}");
    }
}
