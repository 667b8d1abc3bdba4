//! `strata eval`: the loss of a model on the first batches of a token file, under the
//! loaded parameters, on the CPU or a GPU.
//!
//! Prints `step K loss X` for each batch K (0-based, in file order: batch K reads the
//! K-th window of B×T+1 tokens) with X in full f32 precision (the shortest decimal that
//! reads back as the same f32), then `mean loss X`. What device runs it goes to stderr.

use std::error::Error;
use std::io::Write;
use std::path::PathBuf;

use strata_engine::device::{CudaDevice, CudaDeviceConfig, DeviceChoice};
use strata_engine::kernels::cuda::probe;
use strata_engine::model::cuda::{CudaBackend, DeviceFloat, bf16};
use strata_engine::model::data::{Batch, TokenData};
use strata_engine::model::weights::load_pretrained;
use strata_engine::model::{Backend, CpuBackend, Model};

/// Arguments of `strata eval`.
#[derive(Debug, Clone, clap::Args)]
pub struct EvalArgs {
    /// The model: a folder with config.json and model.safetensors (as Hugging Face's
    /// save_pretrained writes them), or the .safetensors file with config.json beside it.
    #[arg(long)]
    pub model: PathBuf,
    /// Token data: an llm.c token file (*.bin), or any other file read as bytes.
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
    let (model, params) = load_pretrained(&args.model)?;
    let data = TokenData::open(&args.data)?;
    model.dims(args.batch, args.seq)?;
    let available = data.batch_count(args.batch, args.seq);
    if args.steps == Some(0) {
        return Err("--steps must be at least 1".into());
    }
    let steps = args.steps.unwrap_or(available);
    if steps == 0 {
        return Err(format!(
            "{}: {} tokens hold no whole batch of {}x{}+1",
            args.data.display(),
            data.len(),
            args.batch,
            args.seq
        )
        .into());
    }
    // Ask for the last batch first, so a file too short fails before any work.
    let mut batch = Batch::default();
    data.read_batch(
        steps - 1,
        args.batch,
        args.seq,
        model.config().vocab,
        &mut batch,
    )?;
    let run = Run {
        model: &model,
        data: &data,
        args,
        steps,
    };
    let use_cuda = match args.device {
        DeviceChoice::Cpu => false,
        DeviceChoice::Cuda => true,
        DeviceChoice::Auto => match probe().require_all() {
            Ok(()) => true,
            Err(e) => {
                log::info!("eval: no usable GPU, running on the CPU ({})", e.reason);
                false
            }
        },
    };
    if !use_cuda {
        if args.precision != Precision::F32 {
            return Err("--precision bf16 needs a GPU: the CPU computes in f32".into());
        }
        return run.on(&CpuBackend::default(), &params, out);
    }
    let device = CudaDevice::new(CudaDeviceConfig {
        ordinal: 0,
        memory_budget_bytes: 0,
        needs_kernels: true,
    })?;
    match args.precision {
        Precision::F32 => run.on_gpu::<f32>(&device, &params, out),
        Precision::Bf16 => run.on_gpu::<bf16>(&device, &params, out),
    }
}

/// One evaluation, ready to run on a backend.
struct Run<'a> {
    model: &'a Model,
    data: &'a TokenData,
    args: &'a EvalArgs,
    steps: usize,
}

impl Run<'_> {
    fn on_gpu<T: DeviceFloat>(
        &self,
        device: &CudaDevice,
        host: &[Vec<f32>],
        out: &mut dyn Write,
    ) -> Result<EvalReport, Box<dyn Error>> {
        let be = CudaBackend::<T>::on_device(device)?;
        let params = host
            .iter()
            .map(|p| be.upload_params(p))
            .collect::<Result<Vec<_>, _>>()?;
        self.on(&be, &params, out)
    }

    fn on<Be: Backend>(
        &self,
        be: &Be,
        params: &[Be::Params],
        out: &mut dyn Write,
    ) -> Result<EvalReport, Box<dyn Error>> {
        let (b, t) = (self.args.batch, self.args.seq);
        log::info!(
            "eval: {} parameters on {}, {} batches of {b}x{t} from {}",
            self.model.config().param_count(),
            be.describe(),
            self.steps,
            self.args.data.display()
        );
        let mut ws = self.model.workspace(be, b, t)?;
        let mut batch = Batch::default();
        let mut losses = Vec::with_capacity(self.steps);
        for step in 0..self.steps {
            let vocab = self.model.config().vocab;
            self.data.read_batch(step, b, t, vocab, &mut batch)?;
            let loss = self
                .model
                .forward(be, params, &mut ws, &batch.inputs, &batch.targets)?;
            writeln!(out, "step {step} loss {loss}")?;
            losses.push(loss);
        }
        let mean = (losses.iter().map(|&l| l as f64).sum::<f64>() / losses.len() as f64) as f32;
        writeln!(out, "mean loss {mean}")?;
        Ok(EvalReport {
            device: be.describe(),
            losses,
            mean,
        })
    }
}
