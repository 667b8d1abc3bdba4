//! The `strata` command line.

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// strata trains neural networks larger than GPU memory on one machine, treating GPU
/// memory, pinned host RAM and NVMe SSDs as tiers of one memory.
#[derive(Debug, Parser)]
#[command(name = "strata", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Measure the links and kernels that decide whether offloading is fast on this machine.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Show what strata sees of this machine.
    Info,
    /// Print a model's loss on the first batches of a token file.
    Eval(strata::eval::EvalArgs),
    /// Train or fine-tune a model under a swap policy (no arguments: the built-in demo).
    Train(Box<strata::train_config::TrainArgs>),
    /// Will a model train here, and how: bytes per tier, peak per policy, predicted step
    /// time, the policy auto picks. Allocates nothing; exits 1 when no policy fits.
    Plan(Box<strata::train_config::PlanArgs>),
    /// Show a GPT-2 configuration (named, or any size) and its blocks; --init writes one.
    Model(strata::model_info::ModelArgs),
    /// Report what this machine offers strata (CPU, memory, I/O, GPUs) and what to fix.
    Doctor(strata::doctor::DoctorArgs),
    /// Encode text or JSON lines with a tokenizer.json into an llm.c token file.
    Tokenize(strata::tokenize::TokenizeArgs),
    /// Work on saved checkpoints (export one, sharded or not, as a Hugging Face model).
    #[command(subcommand)]
    Checkpoint(strata::checkpoint_cmd::CheckpointCommand),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// CPU AdamW throughput against a STREAM triad over the same working set.
    Adam(strata::bench::adam::AdamArgs),
    /// Fused attention (no T x T buffer) against the materialised kernel, forward and backward.
    Attention(strata::bench::attention::AttentionArgs),
    /// strata's f32 matrix product on a GPT-2 step's shapes, against PyTorch's.
    Gemm(strata::bench::gemm::GemmArgs),
    /// NVMe tier: write and read extents through the tensor store, against fio.
    Nvme(strata::bench::nvme::NvmeArgs),
    /// Host-to-device and device-to-host copy rates against the PCIe link and PyTorch.
    Pcie(strata::bench::pcie::PcieArgs),
    /// Step time of each swap policy on one model, against AllOnDevice (overlap efficiency).
    Step(Box<strata::bench::step::StepArgs>),
}

/// Prints what strata sees of this machine: cores and the CPU features its kernels use.
fn info(out: &mut impl Write) -> Result<(), Box<dyn std::error::Error>> {
    writeln!(out, "strata {}", env!("CARGO_PKG_VERSION"))?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    writeln!(out, "cpu: {cores} threads available")?;
    #[cfg(target_arch = "x86_64")]
    {
        let features = [
            ("avx2", std::arch::is_x86_feature_detected!("avx2")),
            ("fma", std::arch::is_x86_feature_detected!("fma")),
            ("f16c", std::arch::is_x86_feature_detected!("f16c")),
            ("avx512f", std::arch::is_x86_feature_detected!("avx512f")),
        ];
        let present: Vec<&str> = features.iter().filter(|f| f.1).map(|f| f.0).collect();
        writeln!(out, "cpu features: {}", present.join(" "))?;
    }
    Ok(())
}

fn main() -> ExitCode {
    strata::logging::init();
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Train(_)) {
        // A closed stdout ends the other subcommands quietly; `train` trains on (and
        // saves) whatever becomes of its output.
        strata::train::die_on_closed_pipe();
    }
    let result: Result<(), Box<dyn std::error::Error>> = match cli.command {
        Command::Bench(bench) => match bench {
            BenchCommand::Adam(args) => strata::bench::adam::main(&args),
            BenchCommand::Attention(args) => strata::bench::attention::main(&args),
            BenchCommand::Gemm(args) => strata::bench::gemm::main(&args),
            BenchCommand::Nvme(args) => strata::bench::nvme::run(&args).map(drop),
            BenchCommand::Pcie(args) => strata::bench::pcie::run(&args),
            BenchCommand::Step(args) => strata::bench::step::run(&args),
        },
        Command::Info => info(&mut std::io::stdout().lock()),
        Command::Eval(args) => strata::eval::run(&args, &mut std::io::stdout().lock()).map(drop),
        Command::Train(args) => strata::train::run(&args),
        Command::Plan(args) => strata::plan_cmd::run(&args, &mut std::io::stdout().lock()),
        Command::Model(args) => strata::model_info::run(&args, &mut std::io::stdout().lock()),
        Command::Doctor(args) => strata::doctor::run(&args, &mut std::io::stdout().lock()),
        Command::Tokenize(args) => strata::tokenize::run(&args, &mut std::io::stdout().lock()),
        Command::Checkpoint(command) => {
            strata::checkpoint_cmd::run(&command, &mut std::io::stdout().lock())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            strata::logging::stderr_line(&format!("strata: error: {error}"));
            ExitCode::FAILURE
        }
    }
}
