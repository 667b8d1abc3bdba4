//! `strata checkpoint`: work on saved checkpoints. `export` writes a checkpoint (an
//! ordinary one, or one sharded by ranks) as one Hugging Face model folder.

use std::error::Error;
use std::io::Write;
use std::path::PathBuf;

use strata_engine::checkpoint;
use strata_engine::model::ModelError;
use strata_engine::model::lora::LoraAdapter;
use strata_engine::model::weights::{self, SaveOptions};

use crate::train_config::{Dtype, TrainConfig};

/// What `strata checkpoint` does.
#[derive(Debug, clap::Subcommand)]
pub enum CheckpointCommand {
    /// Write a checkpoint's model as one Hugging Face folder (model.safetensors or
    /// shards with an index, config.json, and the tokenizer files of the model it was
    /// trained from when that folder is still there). A checkpoint sharded by ranks is
    /// put together; every file is verified first. Written a block at a time: the model
    /// is never whole in memory. A LoRA run's checkpoint is written as its adapter, a
    /// peft adapter folder.
    Export(ExportArgs),
}

/// `strata checkpoint export`.
#[derive(Debug, Clone, clap::Args)]
pub struct ExportArgs {
    /// A checkpoint folder (`step-NNNNNNNN`), or a --checkpoint-dir, whose latest
    /// complete checkpoint is taken.
    pub checkpoint: PathBuf,
    /// The folder to write (created; weight files of an earlier model there are
    /// replaced).
    #[arg(long)]
    pub out: PathBuf,
    /// Type of the tensors written [default: fp32, the master parameters exactly].
    #[arg(long, value_enum)]
    pub dtype: Option<Dtype>,
}

/// Runs `strata checkpoint`.
pub fn run(command: &CheckpointCommand, out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    match command {
        CheckpointCommand::Export(args) => export(args, out),
    }
}

/// The model folder a checkpoint's run trained from, when its recorded configuration
/// names one that is still there (its config.json and tokenizer files are carried).
fn trained_from(config: &serde_json::Value) -> Option<weights::Pretrained> {
    let (cfg, _) = TrainConfig::recorded(config)?;
    crate::model_source::pretrained_source(&cfg.model)
        .ok()
        .flatten()
}

fn export(args: &ExportArgs, out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let opened = checkpoint::open(&args.checkpoint)?;
    if opened.model().lora_config().is_some() {
        return export_adapter(&opened, args, out);
    }
    let base = trained_from(&opened.state().config);
    let mut options = base
        .as_ref()
        .map_or_else(SaveOptions::default, |b| SaveOptions {
            base: Some(b),
            ..SaveOptions::default()
        });
    options.dtype = args.dtype.unwrap_or(Dtype::Fp32).file_dtype();
    // A block at a time: the model is never whole in memory.
    let read = |b: usize| {
        opened.block_params(b).map_err(|e| ModelError::Source {
            what: format!("reading block {b} of {}", opened.dir().display()),
            source: Box::new(e),
        })
    };
    weights::save_pretrained_blocks(opened.model(), &read, &args.out, &options)?;
    writeln!(
        out,
        "exported {} (step {}, {}; {} params) to {} as {}{}",
        opened.dir().display(),
        opened.state().step,
        match opened.ranks() {
            Some(n) => format!("sharded by {n} ranks"),
            None => "ordinary".to_string(),
        },
        opened.model().param_count(),
        args.out.display(),
        options.dtype.torch_name(),
        match &base {
            Some(b) => format!(", with {}'s config and tokenizer files", b.dir.display()),
            None => String::new(),
        }
    )?;
    Ok(())
}

/// A LoRA run's checkpoint (its adapters' state alone) written as a peft adapter folder:
/// each adapted layer's `A` and `B` from the checkpoint's master copy, named for the base
/// the run trained (`base_model_name_or_path`: its `--model`).
fn export_adapter(
    opened: &checkpoint::Opened,
    args: &ExportArgs,
    out: &mut dyn Write,
) -> Result<(), Box<dyn Error>> {
    let model = opened.model();
    let trained = (0..model.blocks().len())
        .map(|b| opened.block_params(b))
        .collect::<Result<Vec<_>, _>>()?;
    let adapter = LoraAdapter::from_trained(model, &trained)?;
    let base = TrainConfig::recorded(&opened.state().config)
        .map(|(cfg, _)| cfg.model)
        .unwrap_or_default();
    let dtype = args.dtype.unwrap_or(Dtype::Fp32).file_dtype();
    adapter.write(&args.out, &base, dtype)?;
    writeln!(
        out,
        "adapter: {} (peft's adapter_config.json and adapter_model.safetensors, {}) from {}, \
         for the base {}",
        args.out.display(),
        dtype.torch_name(),
        opened.dir().display(),
        if base.is_empty() {
            "the run trained"
        } else {
            &base
        }
    )?;
    Ok(())
}
