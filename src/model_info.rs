//! `strata model`: a GPT-2 configuration, named or of any size, with the blocks the
//! engine swaps and what their tensor classes weigh; `--init DIR` writes a randomly
//! initialised model that `strata eval` and Hugging Face's `from_pretrained` load.

use std::error::Error;
use std::io::Write;
use std::path::PathBuf;

use strata_engine::model::weights::save_pretrained;
use strata_engine::model::{BlockKind, Gpt2Config, Model, PRESETS};

use crate::report::{Table, format_bytes};

/// Arguments of `strata model`.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// A named configuration: tiny, gpt2 (124M), gpt2-medium, gpt2-large, gpt2-xl (1.5B).
    /// The five numbers below override its fields, for any size.
    #[arg(long, default_value = "gpt2")]
    pub config: String,
    /// Overrides of the named configuration's fields.
    #[command(flatten)]
    pub shape: ShapeArgs,
    /// Write a randomly initialised model (config.json, model.safetensors) to this folder.
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Seed of the initialisation.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl ModelArgs {
    /// The configuration the arguments describe, checked.
    pub fn resolve(&self) -> Result<Gpt2Config, Box<dyn Error>> {
        self.shape.resolve(&self.config)
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
        let base = Gpt2Config::preset(name)?;
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
    let config = args.resolve()?;
    let model = Model::new(config)?;
    let name = PRESETS
        .iter()
        .find(|(_, c)| *c == config)
        .map_or("custom", |(n, _)| n);
    writeln!(
        out,
        "model: {name} ({} layers, {} heads, width {}, vocab {}, ctx {})",
        config.layers, config.heads, config.width, config.vocab, config.ctx
    )?;
    let params = config.param_count() as u64;
    writeln!(out, "parameters: {params}")?;
    let mut table = Table::new(["block", "tensors", "params", "fp32", "bf16"]);
    let blocks = model.blocks();
    let mut shown = 0;
    for (i, block) in blocks.iter().enumerate() {
        // A deep model's transformer blocks are all alike: show the first two and the
        // last, and say how many are left out.
        let is_middle = matches!(block.kind, BlockKind::Transformer { layer } if layer >= 2 && layer + 1 < config.layers);
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
        let label = match block.kind {
            BlockKind::Embedding => "embedding".to_string(),
            BlockKind::Transformer { layer } => format!("h.{layer}"),
            BlockKind::Head => "head (ln_f; output tied to wte)".to_string(),
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
    }
    Ok(())
}
