//! `strata model`: a GPT-2 or Llama-family configuration, named or of any size, with the
//! blocks the engine swaps and what their tensor classes weigh; `--init DIR` writes a
//! randomly initialised model (config.json and model.safetensors, and with `--tokenizer`
//! a copy of a tokenizer) that
//! `strata eval` and Hugging Face's `from_pretrained` load.

use std::error::Error;
use std::io::Write;
use std::path::{Path, PathBuf};

use strata_engine::model::llama::{self, LlamaConfig, Variant};
use strata_engine::model::weights::save_pretrained;
use strata_engine::model::{BlockKind, Gpt2Config, Llama, Model, PRESETS};

use crate::report::{Table, format_bytes};

/// Arguments of `strata model`.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// A named configuration. GPT-2: tiny, small, gpt2 (124M), gpt2-medium, gpt2-large,
    /// gpt2-xl (1.5B). Llama family (published shapes, no weights): llama-3-8b,
    /// llama-3.1-8b, llama-3-70b, llama-3.2-1b, llama-3.2-3b, qwen2.5-0.5b, qwen2.5-1.5b,
    /// qwen2.5-3b, qwen2.5-7b, qwen3-8b, mistral-7b. The numbers below override its fields, for any
    /// size. Default: gpt2, or with --family a 2-layer, 64-wide model of that family.
    #[arg(long)]
    pub config: Option<String>,
    /// The model family: gpt2, or llama, mistral, qwen2, qwen3 (one family module:
    /// RMSNorm, rotary embeddings, grouped-query attention, SiLU-gated MLP). Implied by
    /// a named --config.
    #[arg(long)]
    pub family: Option<String>,
    /// Overrides of the named configuration's fields.
    #[command(flatten)]
    pub shape: ShapeArgs,
    /// Overrides of a Llama-family configuration's own fields.
    #[command(flatten)]
    pub llama: LlamaShapeArgs,
    /// Write a randomly initialised model (config.json, model.safetensors) to this folder.
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Seed of the initialisation.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// With --init: a tokenizer.json (or a folder holding one, with its
    /// tokenizer_config.json and special_tokens_map.json) to copy into the model's folder;
    /// the model's vocabulary defaults to the tokenizer's size.
    #[arg(long, value_name = "FILE|DIR", requires = "init")]
    pub tokenizer: Option<PathBuf>,
}

/// The fields only a Llama-family shape has, each overriding a named configuration's
/// (shared by every command that takes a Llama-family model).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LlamaShapeArgs {
    /// Llama family: key/value heads (dividing --heads; grouped-query attention).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Llama family: channels of the MLP (`intermediate_size`).
    #[arg(long)]
    pub intermediate: Option<usize>,
    /// Llama family: tie the output head to the token embedding (true or false).
    #[arg(long)]
    pub tied: Option<bool>,
}

/// What `strata model` describes: a GPT-2 or a Llama-family shape.
#[derive(Debug, Clone)]
pub enum ModelShape {
    /// GPT-2.
    Gpt2(Gpt2Config),
    /// Llama, Mistral, Qwen2, Qwen3.
    Llama(LlamaConfig),
}

impl ModelShape {
    /// The preset this shape is, or `custom`.
    pub fn preset_name(&self) -> &'static str {
        match self {
            ModelShape::Gpt2(config) => PRESETS
                .iter()
                .find(|(_, c)| c == config)
                .map_or("custom", |(n, _)| n),
            ModelShape::Llama(config) => llama::preset_names()
                .into_iter()
                .find(|n| LlamaConfig::preset(n).as_ref() == Some(config))
                .unwrap_or("custom"),
        }
    }
}

impl ModelArgs {
    /// The GPT-2 configuration the arguments describe, checked (an error for a
    /// Llama-family one).
    pub fn resolve(&self) -> Result<Gpt2Config, Box<dyn Error>> {
        match self.resolve_shape()? {
            ModelShape::Gpt2(c) => Ok(c),
            ModelShape::Llama(_) => Err("a Llama-family configuration is not a GPT-2 one".into()),
        }
    }

    /// The shape the arguments describe, checked.
    pub fn resolve_shape(&self) -> Result<ModelShape, Box<dyn Error>> {
        let preset = self.config.as_deref().and_then(LlamaConfig::preset);
        let family = match (&self.family, &preset) {
            (Some(f), _) => f.as_str(),
            (None, Some(p)) => p.variant.model_type(),
            (None, None) => "gpt2",
        };
        if family == "gpt2" {
            if preset.is_some() {
                return Err(format!(
                    "--config {} is a Llama-family model, not --family gpt2",
                    self.config.as_deref().unwrap_or_default()
                )
                .into());
            }
            let llama_only = [
                ("--kv-heads", self.llama.kv_heads.is_some()),
                ("--intermediate", self.llama.intermediate.is_some()),
                ("--tied", self.llama.tied.is_some()),
            ];
            if let Some((flag, _)) = llama_only.iter().find(|(_, set)| *set) {
                return Err(format!("{flag} is for Llama-family models (--family llama)").into());
            }
            let name = self.config.as_deref().unwrap_or("gpt2");
            return Ok(ModelShape::Gpt2(self.shape.resolve(name)?));
        }
        let variant = Variant::of_model_type(family).ok_or_else(|| {
            format!(
                "no family named '{family}'; choose gpt2 or one of {}",
                llama::MODEL_TYPES.join(", ")
            )
        })?;
        let mut c = match (&self.config, preset) {
            (_, Some(p)) => p,
            (Some(name), None) => {
                return Err(format!(
                    "no {family} configuration named '{name}'; choose one of {}, or give \
                     --layers --width --heads --kv-heads --intermediate --vocab --ctx",
                    llama::preset_names().join(", ")
                )
                .into());
            }
            // The golden test models' shape: small enough for a laptop's test run.
            (None, None) => LlamaConfig::llama(2, 64, 96, 4, 2, 128, 64),
        };
        if self.config.is_some() && c.variant != variant {
            return Err(format!(
                "--config {} is a {} model, not --family {family}",
                self.config.as_deref().unwrap_or_default(),
                c.variant.model_type()
            )
            .into());
        }
        c.variant = variant;
        c.qkv_bias = variant == Variant::Qwen2;
        c.qk_norm = variant == Variant::Qwen3;
        let s = &self.shape;
        let heads_or_width_changed = s.heads.is_some() || s.width.is_some();
        c.layers = s.layers.unwrap_or(c.layers);
        c.width = s.width.unwrap_or(c.width);
        c.heads = s.heads.unwrap_or(c.heads);
        c.vocab = s.vocab.unwrap_or(c.vocab);
        c.ctx = s.ctx.unwrap_or(c.ctx);
        c.kv_heads = self.llama.kv_heads.unwrap_or(c.kv_heads);
        c.intermediate = self.llama.intermediate.unwrap_or(c.intermediate);
        c.tied = self.llama.tied.unwrap_or(c.tied);
        if heads_or_width_changed {
            c.head_dim = c.width.checked_div(c.heads).unwrap_or(0);
            if c.head_dim * c.heads != c.width {
                return Err(
                    format!("width {} is not divisible by {} heads", c.width, c.heads).into(),
                );
            }
        }
        c.validate()?;
        Ok(ModelShape::Llama(c))
    }
}

/// The five numbers of a GPT-2 shape, each overriding a named configuration's field
/// (shared by every command that takes a model).
#[derive(Debug, Clone, clap::Args)]
pub struct ShapeArgs {
    /// Transformer blocks.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Attention heads per block (must divide --width).
    #[arg(long)]
    pub heads: Option<usize>,
    /// Channels of the residual stream.
    #[arg(long)]
    pub width: Option<usize>,
    /// Vocabulary size.
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Longest sequence.
    #[arg(long)]
    pub ctx: Option<usize>,
}

impl ShapeArgs {
    /// The configuration named `name` with these fields overridden, checked.
    pub fn resolve(&self, name: &str) -> Result<Gpt2Config, Box<dyn Error>> {
        let base = match crate::model_source::custom_shape(name) {
            Some(shape) => shape,
            None => Gpt2Config::preset(name)?,
        };
        let config = Gpt2Config::new(
            self.layers.unwrap_or(base.layers),
            self.heads.unwrap_or(base.heads),
            self.width.unwrap_or(base.width),
            self.vocab.unwrap_or(base.vocab),
            self.ctx.unwrap_or(base.ctx),
        );
        config.validate()?;
        Ok(config)
    }
}

/// Bytes per parameter of the training state under the usual mixed-precision recipe:
/// bf16 working copy (2), fp32 gradient (4), fp32 master copy, Adam m and v (12).
pub const TRAINING_BYTES_PER_PARAM: u64 = 18;

/// Runs `strata model`, writing its report to `out`.
pub fn run(args: &ModelArgs, out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let tokenizer = match &args.tokenizer {
        Some(path) => Some(strata_engine::model::tokenize::TextTokenizer::open(path)?),
        None => None,
    };
    let mut args = args.clone();
    if let Some(t) = &tokenizer {
        match args.shape.vocab {
            None => args.shape.vocab = Some(t.vocab_size()),
            Some(v) if v < t.vocab_size() => {
                return Err(format!(
                    "--vocab {v} is smaller than the tokenizer's {} ids ({})",
                    t.vocab_size(),
                    t.path().display()
                )
                .into());
            }
            Some(_) => {}
        }
    }
    let args = &args;
    let shape = args.resolve_shape()?;
    let name = shape.preset_name();
    let (model, layers) = match shape {
        ModelShape::Gpt2(config) => {
            writeln!(
                out,
                "model: {name} ({} layers, {} heads, width {}, vocab {}, ctx {})",
                config.layers, config.heads, config.width, config.vocab, config.ctx
            )?;
            (Model::new(config)?, config.layers)
        }
        ModelShape::Llama(config) => {
            let layers = config.layers;
            let model = Model::of(Llama::new(config)?);
            writeln!(out, "model: {name}: {}", model.describe())?;
            (model, layers)
        }
    };
    let params = model.param_count() as u64;
    writeln!(out, "parameters: {params}")?;
    let mut table = Table::new(["block", "tensors", "params", "fp32", "bf16"]);
    let blocks = model.blocks();
    let gpt2 = model.family().name() == "gpt2";
    let mut shown = 0;
    for (i, block) in blocks.iter().enumerate() {
        // A deep model's transformer blocks are all alike: show the first two and the
        // last, and say how many are left out.
        let is_middle = matches!(block.kind, BlockKind::Transformer { layer } if layer >= 2 && layer + 1 < layers);
        if is_middle {
            continue;
        }
        if i > 0 && shown + 1 < i && matches!(block.kind, BlockKind::Transformer { .. }) {
            table.row([
                format!("... {} more alike", i - shown - 1),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
            ]);
        }
        shown = i;
        let tied = model.tied(i).is_some();
        let label = match block.kind {
            BlockKind::Embedding => "embedding".to_string(),
            BlockKind::Transformer { layer } if gpt2 => format!("h.{layer}"),
            BlockKind::Transformer { layer } => format!("model.layers.{layer}"),
            BlockKind::Head if gpt2 => "head (ln_f; output tied to wte)".to_string(),
            BlockKind::Head if tied => "head (norm; output tied to embed_tokens)".to_string(),
            BlockKind::Head => "head (norm, lm_head)".to_string(),
        };
        let count: usize = block.tensors.iter().map(|t| t.slot.len).sum();
        table.row([
            label,
            block.tensors.len().to_string(),
            count.to_string(),
            format_bytes(block.len as u64 * 4),
            format_bytes(block.len as u64 * 2),
        ]);
    }
    write!(out, "{}", table.render())?;
    writeln!(
        out,
        "weights: {} in fp32, {} in bf16; training state at {TRAINING_BYTES_PER_PARAM} B/param \
         (bf16 working copy, fp32 gradient, fp32 master, Adam m and v): {}",
        format_bytes(params * 4),
        format_bytes(params * 2),
        format_bytes(params * TRAINING_BYTES_PER_PARAM)
    )?;
    if let Some(dir) = &args.init {
        std::fs::create_dir_all(dir)?;
        let weights = model.init_params(args.seed);
        save_pretrained(&model, &weights, dir)?;
        writeln!(
            out,
            "wrote a randomly initialised model (seed {}) to {}",
            args.seed,
            dir.display()
        )?;
        if let Some(t) = &tokenizer {
            let from = t.path().parent().unwrap_or(Path::new("."));
            for name in [
                "tokenizer.json",
                "tokenizer_config.json",
                "special_tokens_map.json",
            ] {
                let src = if name == "tokenizer.json" {
                    t.path().to_path_buf()
                } else {
                    from.join(name)
                };
                if src.is_file() {
                    std::fs::copy(&src, dir.join(name))?;
                }
            }
            writeln!(
                out,
                "copied the tokenizer {} ({} ids, end of text {})",
                t.path().display(),
                t.vocab_size(),
                t.eos().map_or("none".to_string(), |id| id.to_string())
            )?;
        } else if !gpt2 {
            writeln!(
                out,
                "no tokenizer was written: give the folder the tokenizer.json of the model \
                 whose vocabulary ({}) it uses (--tokenizer FILE copies one)",
                model.vocab()
            )?;
        }
    }
    Ok(())
}
