//! The Llama family's shape: the published presets, `config.json` as transformers reads
//! and writes it for `model_type` llama, mistral, qwen2 and qwen3, and the checks that
//! refuse what strata does not compute.

use std::path::Path;

use serde_json::{Map, Value, json};
use strata_kernels::ops::{Llama3Scaling, RopeFreqs};

use crate::model::ModelError;
use crate::model::config_keys::{ConfigKeys, number_of, shown};
use crate::model::layout::MAX_LAYERS;

/// Which member of the family: they share the block structure and differ in details.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Variant {
    /// Llama 1, 2, 3, 3.1, 3.2 (`LlamaForCausalLM`).
    Llama,
    /// Mistral (`MistralForCausalLM`): Llama's blocks, within `sliding_window` when set
    /// (v0.1; v0.3 sets none).
    Mistral,
    /// Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): biases on the q, k and v projections.
    Qwen2,
    /// Qwen3 (`Qwen3ForCausalLM`): RMSNorm over each head of q and k before RoPE.
    Qwen3,
}

impl Variant {
    /// `config.json`'s `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Variant::Llama => "llama",
            Variant::Mistral => "mistral",
            Variant::Qwen2 => "qwen2",
            Variant::Qwen3 => "qwen3",
        }
    }

    /// The architecture transformers instantiates.
    pub fn architecture(self) -> &'static str {
        match self {
            Variant::Llama => "LlamaForCausalLM",
            Variant::Mistral => "MistralForCausalLM",
            Variant::Qwen2 => "Qwen2ForCausalLM",
            Variant::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    /// The variant `config.json`'s `model_type` names, if it is one of the family.
    pub fn of_model_type(model_type: &str) -> Option<Variant> {
        [
            Variant::Llama,
            Variant::Mistral,
            Variant::Qwen2,
            Variant::Qwen3,
        ]
        .into_iter()
        .find(|v| v.model_type() == model_type)
    }
}

/// The `model_type`s this family reads.
pub const MODEL_TYPES: [&str; 4] = ["llama", "mistral", "qwen2", "qwen3"];

/// The shape of a Llama-family model. Fixed for the family: pre-RMSNorm blocks,
/// rotary position embeddings (rotate_half form), grouped-query causal attention scaled
/// by 1/sqrt(head_dim), a SiLU-gated MLP, no bias except Qwen2's on q, k and v.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Which member.
    pub variant: Variant,
    /// Transformer blocks (`num_hidden_layers`).
    pub layers: usize,
    /// Channels of the residual stream (`hidden_size`).
    pub width: usize,
    /// Channels of the MLP (`intermediate_size`).
    pub intermediate: usize,
    /// Query heads (`num_attention_heads`).
    pub heads: usize,
    /// Key/value heads (`num_key_value_heads`), dividing `heads`.
    pub kv_heads: usize,
    /// Channels per head (`head_dim`; `hidden_size / num_attention_heads` by default).
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Longest sequence (`max_position_embeddings`).
    pub ctx: usize,
    /// RMSNorm's epsilon (`rms_norm_eps`).
    pub eps: f32,
    /// The rotary frequencies (`rope_theta`, `rope_scaling` or `rope_parameters`).
    pub rope: RopeFreqs,
    /// Whether the output head is the token embedding (`tie_word_embeddings`).
    pub tied: bool,
    /// Whether q, k and v projections have biases (Qwen2).
    pub qkv_bias: bool,
    /// Whether q and k are RMS-normalised per head (Qwen3).
    pub qk_norm: bool,
    /// The attention window, when the model uses one (Mistral v0.1, Qwen with
    /// `use_sliding_window`): a query sees the last `sliding_window` keys, itself
    /// included, in the layers from [`window_from`](Self::window_from) on.
    pub sliding_window: Option<usize>,
    /// The first layer the window applies to: 0 for Mistral; Qwen's `max_window_layers`
    /// (the layers before it attend to every earlier key), as transformers' `layer_types`
    /// says.
    pub window_from: usize,
    /// The `config.json` this shape was read from, written back with only what
    /// training changes replaced (none for presets and shapes built here).
    pub source: Option<Map<String, Value>>,
}

/// Llama 3.1's and 3.2's `rope_scaling`, with `factor`.
const fn llama3_scaling(factor: f32) -> Option<Llama3Scaling> {
    Some(Llama3Scaling {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_context: 8192.0,
    })
}

/// A preset's numbers: variant, layers, width, intermediate, heads, kv heads, head
/// dim, vocab, context, eps, theta, Llama 3 scaling factor (0: none), tied.
type PresetNumbers = (
    Variant,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    f32,
    f32,
    f32,
    bool,
);

/// The published shapes, no weights: each model's `config.json` on the Hugging Face Hub
/// (context: `max_position_embeddings`; for Qwen2.5 the context length its model card
/// gives, 32K for 0.5B to 3B and 128K for 7B). Checked by the parameter counts the
/// models publish (the tests below).
#[rustfmt::skip]
const PRESETS: [(&str, PresetNumbers); 11] = [
    ("llama-3-8b", (Variant::Llama, 32, 4096, 14336, 32, 8, 128, 128_256, 8192, 1e-5, 500_000.0, 0.0, false)),
    ("llama-3.1-8b", (Variant::Llama, 32, 4096, 14336, 32, 8, 128, 128_256, 131_072, 1e-5, 500_000.0, 8.0, false)),
    ("llama-3-70b", (Variant::Llama, 80, 8192, 28672, 64, 8, 128, 128_256, 8192, 1e-5, 500_000.0, 0.0, false)),
    ("llama-3.2-1b", (Variant::Llama, 16, 2048, 8192, 32, 8, 64, 128_256, 131_072, 1e-5, 500_000.0, 32.0, true)),
    ("llama-3.2-3b", (Variant::Llama, 28, 3072, 8192, 24, 8, 128, 128_256, 131_072, 1e-5, 500_000.0, 32.0, true)),
    ("qwen2.5-0.5b", (Variant::Qwen2, 24, 896, 4864, 14, 2, 64, 151_936, 32_768, 1e-6, 1_000_000.0, 0.0, true)),
    ("qwen2.5-1.5b", (Variant::Qwen2, 28, 1536, 8960, 12, 2, 128, 151_936, 32_768, 1e-6, 1_000_000.0, 0.0, true)),
    ("qwen2.5-3b", (Variant::Qwen2, 36, 2048, 11008, 16, 2, 128, 151_936, 32_768, 1e-6, 1_000_000.0, 0.0, true)),
    ("qwen2.5-7b", (Variant::Qwen2, 28, 3584, 18944, 28, 4, 128, 152_064, 131_072, 1e-6, 1_000_000.0, 0.0, false)),
    ("qwen3-8b", (Variant::Qwen3, 36, 4096, 12288, 32, 8, 128, 151_936, 40_960, 1e-6, 1_000_000.0, 0.0, false)),
    ("mistral-7b", (Variant::Mistral, 32, 4096, 14336, 32, 8, 128, 32_768, 32_768, 1e-5, 1_000_000.0, 0.0, false)),
];

/// The names of the presets, in order.
pub fn preset_names() -> Vec<&'static str> {
    PRESETS.iter().map(|(n, _)| *n).collect()
}

impl LlamaConfig {
    /// The published shape called `name` (`llama-3-8b`, ...: [`preset_names`]), if any.
    pub fn preset(name: &str) -> Option<LlamaConfig> {
        let (_, p) = PRESETS.iter().find(|(n, _)| *n == name)?;
        let (variant, layers, width, intermediate, heads, kv_heads, head_dim) =
            (p.0, p.1, p.2, p.3, p.4, p.5, p.6);
        let (vocab, ctx, eps, theta, factor, tied) = (p.7, p.8, p.9, p.10, p.11, p.12);
        Some(LlamaConfig {
            variant,
            layers,
            width,
            intermediate,
            heads,
            kv_heads,
            head_dim,
            vocab,
            ctx,
            eps,
            rope: RopeFreqs {
                theta,
                llama3: if factor > 0.0 {
                    llama3_scaling(factor)
                } else {
                    None
                },
            },
            tied,
            qkv_bias: variant == Variant::Qwen2,
            qk_norm: variant == Variant::Qwen3,
            sliding_window: None,
            window_from: 0,
            source: None,
        })
    }

    /// A Llama-architecture shape built from its numbers (theta 10000 unless set
    /// after, eps 1e-5, head dim `width / heads`, untied head).
    pub fn llama(
        layers: usize,
        width: usize,
        intermediate: usize,
        heads: usize,
        kv_heads: usize,
        vocab: usize,
        ctx: usize,
    ) -> LlamaConfig {
        LlamaConfig {
            variant: Variant::Llama,
            layers,
            width,
            intermediate,
            heads,
            kv_heads,
            head_dim: width.checked_div(heads).unwrap_or(0),
            vocab,
            ctx,
            eps: 1e-5,
            rope: RopeFreqs {
                theta: 10_000.0,
                llama3: None,
            },
            tied: false,
            qkv_bias: false,
            qk_norm: false,
            sliding_window: None,
            window_from: 0,
            source: None,
        }
    }

    /// The window layer `layer` attends within, if any.
    pub fn window_of(&self, layer: usize) -> Option<usize> {
        self.sliding_window.filter(|_| layer >= self.window_from)
    }

    /// Checks that the shape can be built: every number positive, kv heads dividing
    /// heads, an even head dimension, a parameter count that fits.
    pub fn validate(&self) -> Result<(), ModelError> {
        let numbers = [
            ("layers", self.layers),
            ("hidden_size", self.width),
            ("intermediate_size", self.intermediate),
            ("num_attention_heads", self.heads),
            ("num_key_value_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab),
            ("max_position_embeddings", self.ctx),
        ];
        if let Some((name, _)) = numbers.iter().find(|(_, v)| *v == 0) {
            return Err(ModelError::InvalidConfig(format!(
                "{name} must be at least 1"
            )));
        }
        if let Some((name, value)) = numbers.iter().find(|(_, v)| *v > i32::MAX as usize) {
            return Err(ModelError::InvalidConfig(format!(
                "{name} {value} exceeds the largest supported, {}",
                i32::MAX
            )));
        }
        if self.layers > MAX_LAYERS {
            return Err(ModelError::InvalidConfig(format!(
                "num_hidden_layers {} exceeds the most strata supports, {MAX_LAYERS}",
                self.layers
            )));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(ModelError::InvalidConfig(format!(
                "{} query heads are not a multiple of {} key/value heads",
                self.heads, self.kv_heads
            )));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(ModelError::InvalidConfig(format!(
                "head_dim {} is odd; rotary embeddings rotate pairs of channels",
                self.head_dim
            )));
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(ModelError::InvalidConfig(format!(
                "rms_norm_eps {} must be positive",
                self.eps
            )));
        }
        if !(self.rope.theta.is_finite() && self.rope.theta > 1.0) {
            return Err(ModelError::InvalidConfig(format!(
                "rope_theta {} must be above 1",
                self.rope.theta
            )));
        }
        if self.vocab > u32::MAX as usize {
            return Err(ModelError::InvalidConfig(format!(
                "vocabulary {} does not fit token ids of 32 bits",
                self.vocab
            )));
        }
        if self.checked_param_count().is_none() {
            return Err(ModelError::InvalidConfig(format!(
                "{} layers of width {} with a vocabulary of {} have more parameters than \
                 this machine can address",
                self.layers, self.width, self.vocab
            )));
        }
        Ok(())
    }

    /// Channels of q (heads × head_dim).
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Channels of k and of v (kv heads × head_dim).
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Every parameter (a tied head counted once). The configuration must have passed
    /// [`LlamaConfig::validate`].
    pub fn param_count(&self) -> usize {
        self.checked_param_count()
            .expect("a validated configuration's parameter count fits in usize")
    }

    fn checked_param_count(&self) -> Option<usize> {
        let (c, q, kv, i) = (self.width, self.q_dim(), self.kv_dim(), self.intermediate);
        let bias = if self.qkv_bias {
            q.checked_add(kv.checked_mul(2)?)?
        } else {
            0
        };
        let norm = if self.qk_norm { 2 * self.head_dim } else { 0 };
        let layer = c
            .checked_mul(q.checked_mul(2)?.checked_add(kv.checked_mul(2)?)?)?
            .checked_add(c.checked_mul(i)?.checked_mul(3)?)?
            .checked_add(2 * c + bias + norm)?;
        let embedding = self.vocab.checked_mul(c)?;
        let head = if self.tied {
            c
        } else {
            embedding.checked_add(c)?
        };
        self.layers
            .checked_mul(layer)?
            .checked_add(embedding)?
            .checked_add(head)
    }

    /// Reads a `config.json` of `model_type` llama, mistral, qwen2 or qwen3, refusing
    /// options strata does not compute (each with a line saying which and why).
    pub fn from_hf(path: &Path, json: &Value) -> Result<LlamaConfig, ModelError> {
        let unsupported = |message: String| ModelError::UnsupportedConfig {
            path: path.to_path_buf(),
            message,
        };
        let model_type = json.get("model_type").and_then(Value::as_str).unwrap_or("");
        let variant = Variant::of_model_type(model_type).ok_or_else(|| {
            unsupported(format!(
                "model_type `{model_type}` is not one of {}",
                MODEL_TYPES.join(", ")
            ))
        })?;
        let keys = ConfigKeys::new(path, json);
        let width = keys.size(&["hidden_size"])?;
        let heads = keys.size(&["num_attention_heads"])?;
        let kv_heads = keys.optional_size("num_key_value_heads")?.unwrap_or(heads);
        let head_dim = match keys.optional_size("head_dim")? {
            Some(d) => d,
            None if width.is_multiple_of(heads) => width / heads,
            None => {
                return Err(unsupported(format!(
                    "hidden_size {width} is not a multiple of num_attention_heads {heads}, \
                     and no head_dim says the heads' width"
                )));
            }
        };
        let activation = keys.text("hidden_act")?.unwrap_or("silu");
        if activation != "silu" {
            return Err(unsupported(format!(
                "hidden_act `{activation}`; strata's MLP is SiLU-gated (`silu`)"
            )));
        }
        if keys.flag("mlp_bias", false)? {
            return Err(unsupported(
                "mlp_bias is true; strata's MLP has no biases".into(),
            ));
        }
        // Qwen2 always has q/k/v biases; Llama, Mistral and Qwen3 have them (and an
        // o_proj bias) only with attention_bias, which strata does not compute.
        if variant != Variant::Qwen2 && keys.flag("attention_bias", false)? {
            return Err(unsupported(format!(
                "attention_bias is true; strata computes {model_type}'s attention without \
                 biases (only Qwen2's q/k/v biases are built)"
            )));
        }
        let rope = parse_rope(json).map_err(unsupported)?;
        let sliding_window = match variant {
            // Mistral applies its window whenever one is set.
            Variant::Mistral => keys.optional_size("sliding_window")?,
            // Qwen applies it only with use_sliding_window.
            Variant::Qwen2 | Variant::Qwen3 if keys.flag("use_sliding_window", false)? => {
                keys.optional_size("sliding_window")?
            }
            _ => None,
        };
        let window_from = match variant {
            Variant::Qwen2 | Variant::Qwen3 if sliding_window.is_some() => {
                window_layers(json, &keys)?
            }
            _ => 0,
        };
        // transformers' default for all four.
        let tied = keys.flag("tie_word_embeddings", false)?;
        let config = LlamaConfig {
            variant,
            layers: keys.size(&["num_hidden_layers"])?,
            width,
            intermediate: keys.size(&["intermediate_size"])?,
            heads,
            kv_heads,
            head_dim,
            vocab: keys.size(&["vocab_size"])?,
            ctx: keys.size(&["max_position_embeddings"])?,
            eps: keys.number("rms_norm_eps", 1e-6)? as f32,
            rope,
            tied,
            qkv_bias: variant == Variant::Qwen2,
            qk_norm: variant == Variant::Qwen3,
            sliding_window,
            window_from,
            source: json.as_object().cloned(),
        };
        config.validate().map_err(|e| unsupported(e.to_string()))?;
        Ok(config)
    }

    /// The `config.json` transformers reads for this model: the one it was read from,
    /// with `torch_dtype`/`dtype` saying float32 (strata saves f32), or, for a shape
    /// built here, what transformers' config class writes (no dropout).
    pub fn to_hf(&self) -> Value {
        if let Some(source) = &self.source {
            let mut out = source.clone();
            let mut any = false;
            for key in ["torch_dtype", "dtype"] {
                if let Some(v) = out.get_mut(key) {
                    *v = json!("float32");
                    any = true;
                }
            }
            if !any {
                out.insert("torch_dtype".into(), json!("float32"));
            }
            return Value::Object(out);
        }
        let v = self.variant;
        let mut out = json!({
            "architectures": [v.architecture()],
            "model_type": v.model_type(),
            "hidden_act": "silu",
            "hidden_size": self.width,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.ctx,
            "rms_norm_eps": self.eps as f64,
            "rope_theta": self.rope.theta as f64,
            "rope_scaling": self.rope.llama3.map(|s| json!({
                "rope_type": "llama3",
                "factor": s.factor as f64,
                "low_freq_factor": s.low_freq_factor as f64,
                "high_freq_factor": s.high_freq_factor as f64,
                "original_max_position_embeddings": s.original_context as f64,
            })),
            "tie_word_embeddings": self.tied,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "torch_dtype": "float32",
            "use_cache": true,
        });
        let obj = out.as_object_mut().expect("an object");
        match v {
            Variant::Llama => {
                obj.insert("attention_bias".into(), json!(false));
                obj.insert("mlp_bias".into(), json!(false));
            }
            Variant::Mistral => {
                obj.insert("sliding_window".into(), json!(self.sliding_window));
            }
            Variant::Qwen2 | Variant::Qwen3 => {
                obj.insert(
                    "use_sliding_window".into(),
                    json!(self.sliding_window.is_some()),
                );
                obj.insert("sliding_window".into(), json!(self.sliding_window));
                if self.sliding_window.is_some() {
                    obj.insert("max_window_layers".into(), json!(self.window_from));
                }
                if v == Variant::Qwen3 {
                    obj.insert("attention_bias".into(), json!(false));
                }
            }
        }
        out
    }
}

/// The rotary frequencies of a `config.json`: transformers 5's `rope_parameters`
/// (`rope_theta`, `rope_type` and the scaling's numbers), else top-level `rope_theta` and
/// `rope_scaling` (`rope_type` or the older `type`). `default` and `llama3` are built;
/// other types are refused by name.
/// transformers' `max_window_layers` for Qwen2 and Qwen3 when the file gives none.
const QWEN_MAX_WINDOW_LAYERS: usize = 28;

/// The first layer Qwen's window applies to: where `layer_types` (newer transformers)
/// turns from `full_attention` to `sliding_attention`, else `max_window_layers`. A
/// `layer_types` that is not full layers followed by window layers is refused.
fn window_layers(json: &Value, keys: &ConfigKeys<'_>) -> Result<usize, ModelError> {
    if let Some(types) = json.get("layer_types").and_then(Value::as_array) {
        let kind = |t: &Value| match t.as_str() {
            Some("full_attention") => Ok(false),
            Some("sliding_attention") => Ok(true),
            _ => Err(keys.error(format!(
                "layer_types holds {t}; strata knows full_attention and sliding_attention"
            ))),
        };
        let sliding = types.iter().map(kind).collect::<Result<Vec<_>, _>>()?;
        let from = sliding.iter().position(|&s| s).unwrap_or(sliding.len());
        if sliding[from..].iter().any(|&s| !s) {
            return Err(keys.error(
                "layer_types mixes full and window layers after the first window layer; \
                 strata builds full layers followed by window layers"
                    .into(),
            ));
        }
        return Ok(from);
    }
    match json.get("max_window_layers") {
        None | Some(Value::Null) => Ok(QWEN_MAX_WINDOW_LAYERS),
        Some(v) => v
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| keys.error(format!("max_window_layers is {v}, not a whole number"))),
    }
}

fn parse_rope(json: &Value) -> Result<RopeFreqs, String> {
    let params = json.get("rope_parameters").filter(|v| v.is_object());
    let scaling = params.or_else(|| json.get("rope_scaling").filter(|v| v.is_object()));
    let theta = match params
        .and_then(|p| p.get("rope_theta"))
        .or_else(|| json.get("rope_theta"))
    {
        None => 10_000.0,
        Some(value) => number_of(value)
            .ok_or_else(|| format!("`rope_theta` is {}; it must be a number", shown(value)))?,
    };
    let kind = scaling
        .and_then(|s| s.get("rope_type").or_else(|| s.get("type")))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let number = |key: &str| -> Result<f32, String> {
        scaling
            .and_then(|s| s.get(key))
            .and_then(Value::as_f64)
            .map(|v| v as f32)
            .ok_or_else(|| format!("rope type llama3 without a number `{key}`"))
    };
    let llama3 = match kind {
        "default" => None,
        "llama3" => Some(Llama3Scaling {
            factor: number("factor")?,
            low_freq_factor: number("low_freq_factor")?,
            high_freq_factor: number("high_freq_factor")?,
            original_context: number("original_max_position_embeddings")?,
        }),
        other => {
            return Err(format!(
                "rope type `{other}`; strata builds rotary embeddings of type `default` and \
                 `llama3`"
            ));
        }
    };
    if theta as f32 as f64 != theta {
        return Err(format!(
            "rope_theta {theta} is not exactly an f32; strata's rotary tables take theta as \
             an f32"
        ));
    }
    Ok(RopeFreqs {
        theta: theta as f32,
        llama3,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<LlamaConfig, ModelError> {
        LlamaConfig::from_hf(
            Path::new("config.json"),
            &serde_json::from_str(text).unwrap(),
        )
    }

    const SHAPE: &str = r#""hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "max_position_embeddings": 64"#;

    #[test]
    fn llama_31_rope_scaling_reads_from_top_level_keys_and_rope_parameters() {
        let scaling = r#"{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#;
        let old = parse(&format!(
            r#"{{"model_type": "llama", {SHAPE}, "rope_theta": 500000.0,
                "rope_scaling": {scaling}}}"#
        ))
        .unwrap();
        let new = parse(&format!(
            r#"{{"model_type": "llama", {SHAPE}, "rope_parameters": {{"rope_theta": 500000.0,
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}}}"#
        ))
        .unwrap();
        let want = RopeFreqs {
            theta: 500_000.0,
            llama3: llama3_scaling(8.0),
        };
        assert_eq!(old.rope, want);
        assert_eq!(new.rope, want);
        assert_eq!(old.head_dim, 16);
        assert!(!old.tied && !old.qkv_bias && !old.qk_norm);
        // Without any rope key: transformers' default theta.
        let plain = parse(&format!(r#"{{"model_type": "qwen3", {SHAPE}}}"#)).unwrap();
        assert_eq!(plain.rope.theta, 10_000.0);
        assert!(plain.qk_norm && plain.rope.llama3.is_none());
    }

    #[test]
    fn what_strata_does_not_compute_is_refused_by_name() {
        for (extra, words) in [
            (
                r#""rope_scaling": {"rope_type": "yarn", "factor": 4.0}"#,
                "rope type `yarn`",
            ),
            (
                r#""rope_scaling": {"type": "linear", "factor": 2.0}"#,
                "rope type `linear`",
            ),
            (r#""attention_bias": true"#, "attention_bias is true"),
            (r#""mlp_bias": true"#, "mlp_bias is true"),
            (r#""hidden_act": "gelu""#, "hidden_act `gelu`"),
            (r#""rope_theta": 0.1"#, "rope_theta 0.1"),
        ] {
            let e = parse(&format!(r#"{{"model_type": "llama", {SHAPE}, {extra}}}"#))
                .unwrap_err()
                .to_string();
            assert!(e.contains(words), "{extra}: {e}");
        }
        let e = parse(r#"{"model_type": "mistral", "hidden_size": 64}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("has no `num_attention_heads`"), "{e}");
        let e = parse(&format!(
            r#"{{"model_type": "llama", {SHAPE}, "num_key_value_heads": 3}}"#
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("not a multiple of 3 key/value heads"), "{e}");
    }

    #[test]
    fn values_of_the_wrong_type_null_or_out_of_range_are_refused_by_key() {
        let shape: Value = serde_json::from_str(&format!("{{{SHAPE}}}")).unwrap();
        for (key, value, words) in [
            (
                "hidden_size",
                "null",
                "`hidden_size` is null; it must be a positive integer",
            ),
            (
                "num_hidden_layers",
                r#""4""#,
                r#"`num_hidden_layers` is "4" (a string)"#,
            ),
            ("num_hidden_layers", "0", "`num_hidden_layers` is 0"),
            ("intermediate_size", "-96", "`intermediate_size` is -96"),
            ("vocab_size", "0", "`vocab_size` is 0"),
            (
                "num_key_value_heads",
                r#""2""#,
                r#"`num_key_value_heads` is "2" (a string)"#,
            ),
            ("head_dim", "0", "`head_dim` is 0"),
            (
                "num_attention_heads",
                "3",
                "hidden_size 64 is not a multiple of num_attention_heads 3",
            ),
            ("rms_norm_eps", "0", "rms_norm_eps 0 must be positive"),
            (
                "rms_norm_eps",
                "-1e-5",
                "rms_norm_eps -0.00001 must be positive",
            ),
            (
                "rms_norm_eps",
                "null",
                "`rms_norm_eps` is null; it must be a number",
            ),
            (
                "rms_norm_eps",
                r#""1e-5""#,
                r#"`rms_norm_eps` is "1e-5" (a string)"#,
            ),
            ("rope_theta", "0", "rope_theta 0 must be above 1"),
            (
                "rope_theta",
                r#""10000""#,
                r#"`rope_theta` is "10000" (a string)"#,
            ),
            (
                "tie_word_embeddings",
                "1",
                "`tie_word_embeddings` is 1; it must be true or false",
            ),
            (
                "hidden_act",
                "null",
                "`hidden_act` is null; it must be a string",
            ),
        ] {
            let mut json = shape.clone();
            json["model_type"] = "llama".into();
            json[key] = serde_json::from_str(value).unwrap();
            let e = LlamaConfig::from_hf(Path::new("config.json"), &json)
                .unwrap_err()
                .to_string();
            assert!(e.contains(words), "{key} = {value}: {e}");
        }
        // null where transformers derives the value reads as absent.
        let mut json = shape;
        json["model_type"] = "qwen2".into();
        for key in ["num_key_value_heads", "head_dim", "sliding_window"] {
            json[key] = Value::Null;
        }
        let config = LlamaConfig::from_hf(Path::new("config.json"), &json).unwrap();
        assert_eq!((config.kv_heads, config.head_dim), (4, 16));
    }

    #[test]
    fn sliding_windows_apply_as_each_model_type_applies_them() {
        let mistral = parse(&format!(
            r#"{{"model_type": "mistral", {SHAPE}, "sliding_window": 4096}}"#
        ))
        .unwrap();
        assert_eq!(mistral.sliding_window, Some(4096));
        let v03 = parse(&format!(
            r#"{{"model_type": "mistral", {SHAPE}, "sliding_window": null}}"#
        ))
        .unwrap();
        assert_eq!(v03.sliding_window, None);
        // Qwen's window applies only with use_sliding_window.
        let off = parse(&format!(
            r#"{{"model_type": "qwen2", {SHAPE}, "sliding_window": 32, "use_sliding_window": false}}"#
        ))
        .unwrap();
        assert_eq!(off.sliding_window, None);
        assert!(off.qkv_bias);
        let on = parse(&format!(
            r#"{{"model_type": "qwen2", {SHAPE}, "sliding_window": 32, "use_sliding_window": true}}"#
        ))
        .unwrap();
        assert_eq!(on.sliding_window, Some(32));
        // From max_window_layers on (transformers' default 28), or where layer_types
        // says.
        assert_eq!(
            (on.window_from, on.window_of(27), on.window_of(28)),
            (28, None, Some(32))
        );
        let from_1 = parse(&format!(
            r#"{{"model_type": "qwen2", {SHAPE}, "sliding_window": 32, "use_sliding_window": true, "max_window_layers": 1}}"#
        ))
        .unwrap();
        assert_eq!((from_1.window_of(0), from_1.window_of(1)), (None, Some(32)));
        let types = parse(&format!(
            r#"{{"model_type": "qwen3", {SHAPE}, "sliding_window": 8, "use_sliding_window": true, "max_window_layers": 1, "layer_types": ["sliding_attention", "sliding_attention"]}}"#
        ))
        .unwrap();
        assert_eq!(types.window_from, 0);
        let mixed = parse(&format!(
            r#"{{"model_type": "qwen3", {SHAPE}, "sliding_window": 8, "use_sliding_window": true, "layer_types": ["sliding_attention", "full_attention"]}}"#
        ))
        .unwrap_err()
        .to_string();
        assert!(mixed.contains("mixes full and window layers"), "{mixed}");
        assert_eq!(mistral.window_of(0), Some(4096));
    }

    #[test]
    fn a_built_shape_writes_a_config_that_reads_back_as_itself() {
        for name in preset_names() {
            let c = LlamaConfig::preset(name).unwrap();
            let json = c.to_hf();
            let back = LlamaConfig::from_hf(Path::new("config.json"), &json).unwrap();
            assert_eq!(
                LlamaConfig {
                    source: None,
                    ..back
                },
                c,
                "{name}"
            );
        }
    }
}
