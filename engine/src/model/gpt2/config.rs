//! GPT-2's shape: the named configurations and any size given by its five numbers.

use strata_kernels::model_shape::Gpt2Shape;

use crate::model::ModelError;
use crate::model::layout::MAX_LAYERS;

/// The shape of a GPT-2 model. The rest of the architecture is fixed: pre-LayerNorm
/// blocks (eps 1e-5), 4x MLP with tanh-approximated GELU, learned position embedding,
/// output head tied to the token embedding, biases everywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Gpt2Config {
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads per block; divides `width`.
    pub heads: usize,
    /// Channels of the residual stream (embedding width).
    pub width: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Longest sequence (rows of the position embedding).
    pub ctx: usize,
}

/// The named configurations, smallest first.
pub const PRESETS: [(&str, Gpt2Config); 6] = [
    ("tiny", Gpt2Config::new(2, 2, 32, 64, 32)),
    ("small", Gpt2Config::new(4, 4, 128, 256, 128)),
    ("gpt2", Gpt2Config::new(12, 12, 768, 50257, 1024)),
    ("gpt2-medium", Gpt2Config::new(24, 16, 1024, 50257, 1024)),
    ("gpt2-large", Gpt2Config::new(36, 20, 1280, 50257, 1024)),
    ("gpt2-xl", Gpt2Config::new(48, 25, 1600, 50257, 1024)),
];

impl Gpt2Config {
    /// A configuration from its five numbers (not yet checked: see [`Gpt2Config::validate`]).
    pub const fn new(layers: usize, heads: usize, width: usize, vocab: usize, ctx: usize) -> Self {
        Gpt2Config {
            layers,
            heads,
            width,
            vocab,
            ctx,
        }
    }

    /// The tiny test model: 2 layers, 2 heads, 32 wide, vocabulary 64, context 32 (the
    /// shape of the reference data in `tests/data/gpt2-tiny`).
    pub const fn tiny() -> Self {
        PRESETS[0].1
    }

    /// GPT-2 "small", 124M parameters.
    pub const fn gpt2() -> Self {
        PRESETS[2].1
    }

    /// A named configuration: `tiny`, `small` (4 layers, 128 wide, bytes as tokens), `gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl`.
    pub fn preset(name: &str) -> Result<Self, ModelError> {
        PRESETS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, c)| *c)
            .ok_or_else(|| {
                let names: Vec<&str> = PRESETS.iter().map(|(n, _)| *n).collect();
                ModelError::InvalidConfig(format!(
                    "no configuration named '{name}'; choose one of {}, or give --layers \
                     --heads --width --vocab --ctx",
                    names.join(", ")
                ))
            })
    }

    /// Checks that the shape can be built: every number positive, heads dividing width.
    pub fn validate(&self) -> Result<(), ModelError> {
        let numbers = [
            ("layers", self.layers),
            ("heads", self.heads),
            ("width", self.width),
            ("vocab", self.vocab),
            ("ctx", self.ctx),
        ];
        if let Some((name, _)) = numbers.iter().find(|(_, v)| *v == 0) {
            return Err(ModelError::InvalidConfig(format!(
                "{name} must be at least 1"
            )));
        }
        if !self.width.is_multiple_of(self.heads) {
            return Err(ModelError::InvalidConfig(format!(
                "width {} is not divisible by {} heads",
                self.width, self.heads
            )));
        }
        // The GPU kernels index rows and channels with 32-bit integers.
        if let Some((name, value)) = numbers.iter().find(|(_, v)| *v > i32::MAX as usize) {
            return Err(ModelError::InvalidConfig(format!(
                "{name} {value} exceeds the largest supported, {}",
                i32::MAX
            )));
        }
        if self.layers > MAX_LAYERS {
            return Err(ModelError::InvalidConfig(format!(
                "layers {} exceeds the most strata supports, {MAX_LAYERS}",
                self.layers
            )));
        }
        if self.checked_param_count().is_none() {
            return Err(ModelError::InvalidConfig(format!(
                "{} layers of width {} with a vocabulary of {} and a context of {} have more \
                 parameters than this machine can address",
                self.layers, self.width, self.vocab, self.ctx
            )));
        }
        if self.vocab > u32::MAX as usize {
            return Err(ModelError::InvalidConfig(format!(
                "vocabulary {} does not fit token ids of 32 bits",
                self.vocab
            )));
        }
        Ok(())
    }

    /// Channels per attention head.
    pub fn head_size(&self) -> usize {
        self.width / self.heads
    }

    /// Parameters of one transformer block.
    pub fn block_param_count(&self) -> usize {
        let c = self.width;
        // ln_1, ln_2: 2C each; c_attn C*3C + 3C; attn c_proj C*C + C; c_fc C*4C + 4C;
        // mlp c_proj 4C*C + C.
        4 * c + (3 * c * c + 3 * c) + (c * c + c) + (4 * c * c + 4 * c) + (4 * c * c + c)
    }

    /// Every parameter (the tied output head counted once). The configuration must have
    /// passed [`Gpt2Config::validate`], which checks that this count fits.
    pub fn param_count(&self) -> usize {
        self.checked_param_count()
            .expect("a validated configuration's parameter count fits in usize")
    }

    /// [`Gpt2Config::param_count`], or `None` when it (or any tensor) overflows usize.
    fn checked_param_count(&self) -> Option<usize> {
        let c = self.width;
        // The largest tensor of a block is 4C x C; its whole block is 12C^2 + 13C.
        let block = c
            .checked_mul(c)?
            .checked_mul(12)?
            .checked_add(c.checked_mul(13)?)?;
        self.vocab
            .checked_mul(c)?
            .checked_add(self.ctx.checked_mul(c)?)?
            .checked_add(self.layers.checked_mul(block)?)?
            .checked_add(c.checked_mul(2)?)
    }

    /// The same shape as the reference model in `strata_kernels` takes it.
    pub fn shape(&self) -> Gpt2Shape {
        Gpt2Shape {
            layers: self.layers,
            heads: self.heads,
            width: self.width,
            vocab: self.vocab,
            ctx: self.ctx,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_published_sizes() {
        // Parameter counts as published for GPT-2 (tied head counted once).
        let expected = [
            ("gpt2", 124_439_808),
            ("gpt2-medium", 354_823_168),
            ("gpt2-large", 774_030_080),
            ("gpt2-xl", 1_557_611_200),
        ];
        for (name, count) in expected {
            let config = Gpt2Config::preset(name).unwrap();
            config.validate().unwrap();
            assert_eq!(config.param_count(), count, "{name}");
        }
        assert!(Gpt2Config::preset("gpt3").is_err());
        assert!(Gpt2Config::new(2, 3, 32, 64, 32).validate().is_err());
        assert!(Gpt2Config::new(0, 1, 32, 64, 32).validate().is_err());
    }
}
