//! `strata eval`: the loss of a model on the first batches of its data (read as `strata
//! train` reads it: [`crate::tokenize::open_data`]), under the loaded parameters, on the
//! CPU or a GPU, the whole model loaded, or on the CPU read a block at a time for each
//! batch (`--blockwise`, or where the whole model would not fit beside everything else).
//!
//! Prints `step K loss X` for each batch K (0-based, in file order: batch K reads the
//! K-th window of B×T+1 tokens) with X in full f32 precision (the shortest decimal that
//! reads back as the same f32), then `mean loss X`. What device runs it goes to stderr.

use std::error::Error;
use std::io::Write;
use std::path::PathBuf;

use strata_engine::device::{DeviceChoice, DeviceConfig, select};
use strata_engine::exec::{BlockForward, Runner};
use strata_engine::kernels::program::{Dtype, Target};
use strata_engine::model::data::Batch;
use strata_engine::model::lora::{LoraAdapter, check_layers, merge_block};
use strata_engine::model::weights::{PretrainedBlocks, load_config, model_files};
use strata_engine::model::{BaseQuant, ModelError, quant_base};

use crate::process_memory::memory_limit;
use crate::tokenize::{open_data, whole_batches};

/// Arguments of `strata eval`.
#[derive(Debug, Clone, clap::Args)]
pub struct EvalArgs {
    /// The model: a folder with config.json and model.safetensors (as Hugging Face's
    /// save_pretrained writes them), or the .safetensors file with config.json beside it.
    #[arg(long)]
    pub model: PathBuf,
    /// Token data, read as `strata train` reads it: an llm.c token file (*.bin), or text
    /// or JSON lines tokenized with the model folder's tokenizer.json (cached beside the
    /// data), or read as bytes for a model of vocabulary 256 without one.
    #[arg(long)]
    pub data: PathBuf,
    /// Sequences per batch (B).
    #[arg(long)]
    pub batch: usize,
    /// Tokens per sequence (T), at most the model's context.
    #[arg(long)]
    pub seq: usize,
    /// How many batches, from the start of the file [default: every whole batch in it].
    #[arg(long)]
    pub steps: Option<usize>,
    /// Where to run: a GPU when CUDA is usable (auto), the CPU, or a GPU or nothing.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    /// Working precision on a GPU; the CPU computes in f32.
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub precision: Precision,
    /// A LoRA adapter folder as peft's save_pretrained writes it (adapter_config.json,
    /// adapter_model.safetensors), merged into the model's weights as each block is
    /// read (W + scale · B A, in f32), so that the loss is the adapted model's.
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,
    /// The base as a QLoRA run (`strata train --quant`) computes with it: each
    /// transformer layer's linear weights quantised as nf4 or int8 and dequantised, before
    /// an adapter is merged [default: the weights as stored].
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub quant: Option<BaseQuant>,
    /// On the CPU, read the model a block at a time for each batch, holding one block
    /// rather than the whole model in f32 (the same losses, bit for bit; each batch reads
    /// every weight again). Chosen by itself where the whole model would take more than
    /// half the memory this process may use.
    #[arg(long)]
    pub blockwise: bool,
}

/// The working precision of activations and parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Precision {
    /// 32-bit floats.
    F32,
    /// bfloat16, with f32 accumulation, statistics and gradients.
    Bf16,
}

/// What an evaluation found.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalReport {
    /// What it ran on.
    pub device: String,
    /// Each batch's mean cross-entropy, in order.
    pub losses: Vec<f32>,
    /// The mean of `losses`.
    pub mean: f32,
}

/// Runs `strata eval`, writing its lines to `out`.
pub fn run(args: &EvalArgs, out: &mut dyn Write) -> Result<EvalReport, Box<dyn Error>> {
    if args.steps == Some(0) {
        return Err("--steps must be at least 1".into());
    }
    // The weights are read a block at a time as the runner loads them, never whole
    // beside its copy.
    let (config, _) = model_files(&args.model);
    std::fs::metadata(&args.model).map_err(|e| ModelError::io(&args.model, e))?;
    let model = load_config(&config)?;
    let weights = PretrainedBlocks::open(&args.model, &model)?;
    let adapter = match &args.adapter {
        Some(dir) => {
            let named = |e: ModelError| format!("--adapter {}: {e}", dir.display());
            let adapter = LoraAdapter::read(dir, &model).map_err(named)?;
            check_layers(&model, &adapter).map_err(named)?;
            Some(adapter)
        }
        None => None,
    };
    model.shape(args.batch, args.seq)?;
    // The data as `strata train` reads it (text tokenized with the model folder's
    // tokenizer, every id checked), what was done going to stderr: stdout is the losses.
    let data = open_data(&args.data, &args.model, &model, &mut std::io::stderr())?;
    let what = match args.steps {
        Some(steps) => format!("--steps {steps}"),
        None => "evaluation".into(),
    };
    let needed = args.steps.unwrap_or(1);
    let available = whole_batches(&data, args.batch, args.seq, needed, &what)?;
    let steps = args.steps.unwrap_or(available);
    let mut batch = Batch::default();
    let cuda = match args.device {
        DeviceChoice::Cpu => false,
        DeviceChoice::Cuda => true,
        DeviceChoice::Auto => strata_engine::kernels::cuda::probe().require_all().is_ok(),
    };
    if !cuda && args.precision != Precision::F32 {
        return Err("--precision bf16 needs a GPU: the CPU computes in f32".into());
    }
    let (target, dtype, precision) = match (cuda, args.precision) {
        (false, _) => (
            Target::Cpu,
            Dtype::F32,
            strata_engine::plan::Precision::Fp32,
        ),
        (true, Precision::F32) => (
            Target::Cuda,
            Dtype::F32,
            strata_engine::plan::Precision::Fp32,
        ),
        (true, Precision::Bf16) => (
            Target::Cuda,
            Dtype::Bf16,
            strata_engine::plan::Precision::Bf16,
        ),
    };
    let bytes = Runner::device_bytes(&model, args.batch, args.seq, target, dtype)?;
    // Each block as the model computes with it: quantised as a QLoRA run's base is, the
    // adapter merged in.
    let read_block = |b: usize| -> Result<Vec<f32>, ModelError> {
        let mut block = weights.read_block(b)?;
        if let Some(quant) = args.quant {
            quant_base::round_trip(&model.blocks()[b], quant, &mut block);
        }
        if let Some(adapter) = &adapter {
            merge_block(&model, b, &mut block, adapter)?;
        }
        Ok(block)
    };
    // Each batch's loss under `forward`, a line each, then their mean.
    let mut each_batch = |name: String,
                          forward: &mut dyn FnMut(&Batch) -> Result<f32, ModelError>|
     -> Result<EvalReport, Box<dyn Error>> {
        let mut losses = Vec::with_capacity(steps);
        for step in 0..steps {
            data.read_batch(step, args.batch, args.seq, model.vocab(), &mut batch)?;
            let loss = forward(&batch)?;
            writeln!(out, "step {step} loss {loss}")?;
            losses.push(loss);
        }
        let mean = (losses.iter().map(|&l| l as f64).sum::<f64>() / losses.len() as f64) as f32;
        writeln!(out, "mean loss {mean}")?;
        Ok(EvalReport {
            device: name,
            losses,
            mean,
        })
    };
    if blockwise(args, cuda, bytes)? {
        let forward = BlockForward::on_cpu(model.clone(), args.batch, args.seq)?;
        return each_batch("cpu f32, a block at a time".into(), &mut |batch| {
            forward.forward(&batch.inputs, &batch.targets, &read_block)
        });
    }
    let choice = if cuda {
        DeviceChoice::Cuda
    } else {
        DeviceChoice::Cpu
    };
    let (device, why) = select(
        choice,
        &DeviceConfig {
            memory_budget_bytes: bytes,
            cuda_ordinal: 0,
            cuda_needs_kernels: true,
        },
    )?;
    log::info!("eval: {why}");
    let name = format!("{} {dtype}", device.name());
    let (b, t) = (args.batch, args.seq);
    log::info!(
        "eval: {} parameters on {name}, {steps} batches of {b}x{t} from {}",
        model.param_count(),
        args.data.display()
    );
    let mut runner = Runner::new(model.clone(), device, b, t, precision)?;
    runner.load_blocks(&read_block)?;
    each_batch(name, &mut |batch| {
        runner.forward(&batch.inputs, &batch.targets)
    })
}

/// Whether to evaluate a block at a time ([`BlockForward`]): asked for (the CPU only), or
/// on the CPU where the whole model, `bytes` on the device, would take more than half
/// the memory this process may use.
fn blockwise(args: &EvalArgs, cuda: bool, bytes: usize) -> Result<bool, Box<dyn Error>> {
    if cuda {
        if args.blockwise {
            return Err("--blockwise evaluates on the CPU: add --device cpu".into());
        }
        return Ok(false);
    }
    if args.blockwise {
        return Ok(true);
    }
    let Some(limit) = memory_limit() else {
        return Ok(false);
    };
    let large = bytes as u64 > limit.bytes / 2;
    if large {
        log::info!(
            "eval: the whole model would take {:.2} GiB, more than half of {} ({:.2} GiB): \
             reading it a block at a time for each batch",
            bytes as f64 / (1u64 << 30) as f64,
            limit.source,
            limit.bytes as f64 / (1u64 << 30) as f64
        );
    }
    Ok(large)
}
