//! `strata bench step`: the step time of each swap policy on one model, against
//! `AllOnDevice` on the same model in the same run (DESIGN.md section 6).
//!
//! - Each policy is planned ([`Plan::build`], [`Plan::check_fits`]; a refusal is printed
//!   and the policy skipped), run by an [`Executor`] on the CPU backend for `--warmup`
//!   and then `--steps` steps over the same deterministic synthetic batches, and reported
//!   as medians: step seconds, tokens/s, the compute lane's busy and stall time, bytes
//!   per link, planned and measured peak bytes per tier, and the cost model's prediction.
//! - Overlap efficiency is compute-only time over step time, reported twice: with
//!   `AllOnDevice`'s compute-lane busy time (what the step would cost with no data
//!   movement at all) and with the policy's own compute-lane busy time (how much of the
//!   movement hides under its own compute).
//! - `--recompute all,none` runs each policy once per value (recomputing every layer's
//!   forward in the backward, keeping every layer's saved activations), and reports
//!   tokens/s of each and their ratio per policy.
//! - `--schedule horizontal,vertical` runs each policy once per order of the
//!   micro-batches through the blocks (with `--grad-accum` above 1), and reports NVMe and
//!   host<->device bytes per token (as the tier and the copies counted them) and
//!   tokens/s of each, and their ratios per policy.
//! - Policies run interleaved, one step of each per round, so that the noise of a
//!   shared machine falls on all of them alike; when holding every executor at once would
//!   not fit in the memory available, they run one after another, and the report says so.
//! - `--lora RANK` benches the LoRA model `strata train --lora` trains (the base frozen,
//!   the adapters alone trained); the report records its settings and trained
//!   parameters, and `--peers` runs peft's LoRA of the same settings against it.
//! - `--scale` runs the scale claim instead: a GPT whose training state is at least twice
//!   the host budget trains with `NvmeOffload` within that budget, and its loss falls.
//!
//! It holds no kernels and no scheduling: those are the engine's.

use std::path::{Path, PathBuf};

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use serde::Serialize;
use serde_json::{Value, json};
use strata_engine::device::{DeviceChoice, DeviceConfig, choose_target, select};
use strata_engine::exec::{ExecConfig, Executor, StepParams, StepReport};
use strata_engine::kernels::adamw::AdamW;
use strata_engine::kernels::ops::Cpu;
use strata_engine::model::lora::{ALL_LINEAR, LoraConfig};
use strata_engine::model::{ApproxBackward, BaseQuant, Llama, Model, ModelError};
use strata_engine::plan::{
    Budgets, BuiltinPolicy, CostModel, GradDtype, GradSpill, Lane, NvmeOffload, OptimizerState,
    Plan, PlanInput, Policy, Precision, Prediction, Recompute, Schedule, StepShape, Tier,
};

use super::adam::load_average;
use super::kernels::{self, ComputeProfile};
use super::peers::{self, PeerResult, PeerShape};
use crate::machine::{cpu_model, meminfo_bytes, swap_folder_refusal};
use crate::model_info::{self, LlamaShapeArgs, ModelArgs, ShapeArgs};
use crate::process_memory::{ProcessMemory, memory_limit};
use crate::report::{
    LineChart, Series, Table, format_bytes, median, median_index, peak_rss_bytes, write_json,
};
use crate::size::parse_bytes;

/// `--policies`' values: each built-in policy's name, with what it keeps where.
fn policy_values() -> impl TypedValueParser<Value = BuiltinPolicy> {
    let values = BuiltinPolicy::ALL.map(|policy| {
        PossibleValue::new(policy.name()).help(match policy {
            BuiltinPolicy::AllOnDevice => "Everything on the device: the reference",
            BuiltinPolicy::CpuOffload => {
                "ZeRO-Offload: optimizer state on the host, updated by the CPU"
            }
            BuiltinPolicy::ParamOffload => {
                "CPU offload, and parameters streamed from the host `--depth` blocks ahead"
            }
            BuiltinPolicy::NvmeOffload => "ZeRO-Infinity: parameters and optimizer state on NVMe",
        })
    });
    PossibleValuesParser::new(values).try_map(|name| name.parse::<BuiltinPolicy>())
}

/// The working dtype of the parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Dtype {
    /// Everything fp32.
    Fp32,
    /// bf16 working parameters (fp32 master copy and optimizer state).
    Bf16,
}

/// Options of `strata bench step`.
#[derive(Debug, Clone, clap::Args)]
pub struct StepArgs {
    /// A named model: tiny, small, gpt2 (124M), gpt2-medium, gpt2-large, gpt2-xl, or a
    /// shape LAYERSxWIDTH (40x2560: heads of 128 channels, GPT-2's vocabulary and
    /// context); or a Llama-family one (`strata model --help` lists them). The numbers
    /// below override its fields, for any shape. Default: gpt2, or with --family a
    /// 2-layer, 64-wide model of that family.
    #[arg(long)]
    pub model: Option<String>,
    /// The model family: gpt2, or llama, mistral, qwen2, qwen3 (implied by a named
    /// Llama-family --model).
    #[arg(long)]
    pub family: Option<String>,
    /// Overrides of the named model's fields.
    #[command(flatten)]
    pub shape: ShapeArgs,
    /// Overrides of a Llama-family model's own fields.
    #[command(flatten)]
    pub llama: LlamaShapeArgs,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub seq: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
    /// Measured steps per policy (with --scale: steps of the whole run).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Untimed steps per policy before the measured ones.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Policies to compare, comma-separated.
    #[arg(
        long,
        value_parser = policy_values(),
        value_delimiter = ',',
        default_value = BuiltinPolicy::ALL.map(BuiltinPolicy::name).join(",")
    )]
    pub policies: Vec<BuiltinPolicy>,
    /// Prefetch depth, in blocks, of the policies that stream.
    #[arg(long, visible_alias = "prefetch", default_value_t = 2)]
    pub depth: usize,
    /// Which layers' backward recomputes their forward instead of reading the
    /// activations the forward kept: auto (keep what fits the device budget; offload or
    /// recompute the rest, by the cost model), all (recompute every layer), none (keep
    /// every layer's on the device), offload (keep every layer's off the device between
    /// its forward and backward). Comma-separated values run each policy once per
    /// value, interleaved, and compare their tokens/s (all,none: the cost of
    /// recomputing).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "auto")]
    pub recompute: Vec<Recompute>,
    /// How AdamW's moments are kept: fp32, bf16 or q8 (8-bit blocks). Comma-separated
    /// values run each policy once per value, interleaved, and compare the NVMe bytes
    /// per step of each against fp32's (a policy that keeps the state on the device
    /// runs fp32 only).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "fp32")]
    pub optimizer_state: Vec<OptimizerState>,
    /// With --grad-accum above 1, the order of the micro-batches through the blocks:
    /// auto (vertical where it fits and the cost model predicts it faster), horizontal
    /// (each micro-batch through the whole model in turn), vertical (every micro-batch
    /// through a block before the next block). Comma-separated values run each policy
    /// once per value, interleaved, and compare their bytes per token and tokens/s
    /// (horizontal,vertical).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "auto")]
    pub schedule: Vec<Schedule>,
    /// Whether each step ends by fetching the next step's first parameters, so the next
    /// step's compute starts at once (where the plan can: one rank, no delayed update,
    /// a policy that streams parameters; their device buffers then stay live across
    /// the step boundary). `false` fetches them at each step's start.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub prefetch_next_step: bool,
    /// Folder for the NVMe tier's swap files (on the drive to measure; not tmpfs).
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    pub nvme: PathBuf,
    /// Device memory budget (default: unlimited).
    #[arg(long, value_parser = parse_bytes)]
    pub device_mem: Option<u64>,
    /// Host memory budget (default: unlimited; with --scale, 900MiB).
    #[arg(long, value_parser = parse_bytes)]
    pub host_mem: Option<u64>,
    /// Working dtype of the parameters.
    #[arg(long, value_enum, default_value = "fp32")]
    pub dtype: Dtype,
    /// Where the steps run: a GPU when CUDA is usable (auto), the CPU device, or a GPU
    /// or nothing.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    /// One-step delayed update: each step's AdamW runs beside the next step's compute
    /// (one step stale, as ZeRO-Offload's DPU).
    #[arg(long)]
    pub delayed_update: bool,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Largest global gradient norm; 0 disables clipping. Clipping makes every update
    /// wait for the whole backward (the global norm).
    #[arg(long, default_value_t = 0.0)]
    pub clip: f64,
    /// With clipping, whether gradients wait for the norm on NVMe instead of host
    /// memory: auto (when the host budget needs it), always, never.
    #[arg(long, value_enum, default_value_t = GradSpill::Auto)]
    pub spill_grads: GradSpill,
    /// How complete gradients are kept: fp32, or rounded to bf16 (with --dtype bf16),
    /// which halves the bytes of gradients spilled to NVMe.
    #[arg(long, value_enum, default_value_t = GradDtype::Fp32)]
    pub grad_dtype: GradDtype,
    /// Approximate gradients (as `strata train --approx-backward`): exact, or such as
    /// gelu:3,linear:0.5.
    #[arg(long, default_value_t = ApproxBackward::EXACT)]
    pub approx_backward: ApproxBackward,
    /// Benchmark a LoRA fine-tune of this rank over the frozen model, as `strata train
    /// --lora` runs it: the adapters alone get gradients, optimizer state and updates.
    /// Plans the engine refuses for a LoRA model are skipped with its reason; with
    /// --peers, peft's LoRA of the same settings over PyTorch eager is the peer.
    #[arg(long, value_name = "RANK")]
    pub lora: Option<usize>,
    /// With --lora, LoRA's alpha: the adapters' product is scaled by alpha / rank.
    #[arg(long, value_name = "ALPHA", default_value_t = 16.0)]
    pub lora_alpha: f64,
    /// With --lora, the linear layers adapted, by Hugging Face module name,
    /// comma-separated (such as q_proj,v_proj), or all-linear.
    #[arg(long, value_name = "NAMES", default_value = ALL_LINEAR)]
    pub lora_targets: String,
    /// With --lora, the base stored quantised as `strata train --quant` stores it (QLoRA:
    /// nf4 or int8), dequantised on the device as each block arrives. Not with --peers
    /// (peft over bitsandbytes' 4-bit base is not run here).
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub quant: Option<BaseQuant>,
    /// Seed of the initial parameters and of the synthetic batches.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Extent transfers each NVMe lane keeps in flight (what `strata bench nvme
    /// --in-flight` measures alone).
    #[arg(long, default_value_t = crate::engine::exec::NVME_IN_FLIGHT)]
    pub nvme_in_flight: usize,
    /// Run the scale claim: NvmeOffload trains a model whose training state is at least
    /// twice --host-mem within that budget, on one repeated batch, and its loss falls.
    #[arg(long)]
    pub scale: bool,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw every measured step's time per policy as SVG to this file.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Write each policy's median step as a Chrome trace (one process per policy; open
    /// it in Perfetto) to this file.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Also run the peers in this invocation, on the same shape and threads, from the
    /// folder `../shared/anchors/setup DIR` made: PyTorch eager against all-on-device,
    /// DeepSpeed ZeRO-Offload against cpu-offload, ZeRO-Infinity (its swap folder under
    /// --nvme) against nvme-offload; with --dtype bf16, PyTorch eager under bf16
    /// autocast against all-on-device; with --lora, peft's LoRA of the same settings over
    /// PyTorch eager against all-on-device. Prints strata / peer tokens/s.
    #[arg(long, value_name = "DIR")]
    pub peers: Option<PathBuf>,
    /// Also show where each policy's median step went, kernel by kernel (the CPU device
    /// times each kernel; a GPU's are not timed), and, for a GPT-2 model, time its
    /// matrix products alone in this run and set the step against them.
    #[arg(long)]
    pub kernels: bool,
}

/// The machine the run saw.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// The CPU's model name.
    pub cpu: String,
    /// Threads available to this process.
    pub cores: usize,
    /// `MemAvailable` at the start.
    pub mem_available_bytes: Option<u64>,
    /// `/proc/loadavg`'s 1-minute load before and after the run: above the core count,
    /// something else competed for the machine.
    pub load_average: [Option<f64>; 2],
}

impl Machine {
    fn now() -> Self {
        Machine {
            cpu: cpu_model(),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            mem_available_bytes: meminfo_bytes("MemAvailable"),
            load_average: [load_average(), None],
        }
    }
}

/// The model benchmarked.
#[derive(Debug, Clone, Serialize)]
pub struct ModelShape {
    /// Its preset name, or `custom`.
    pub name: String,
    /// Its family: gpt2, llama, mistral, qwen2, qwen3.
    pub family: String,
    /// Llama family: key/value heads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_heads: Option<usize>,
    /// Llama family: channels of the MLP.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub intermediate: Option<usize>,
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Residual width.
    pub width: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Context length.
    pub ctx: usize,
    /// Parameters (a LoRA model's: the base's and the adapters').
    pub params: u64,
}

/// The LoRA adapter a `--lora` run trains.
#[derive(Debug, Clone, Serialize)]
pub struct LoraSettings {
    /// Rank of each adapter.
    pub rank: usize,
    /// LoRA's alpha: the adapters' product is scaled by alpha / rank.
    pub alpha: f64,
    /// The module names adapted, or all-linear.
    pub targets: Vec<String>,
    /// Parameters that train: every adapter's A and B.
    pub trained_params: u64,
    /// Those over the model's parameters (the base's and the adapters').
    pub trained_fraction: f64,
    /// How the base is stored, when quantised (`--quant`).
    pub quant: Option<BaseQuant>,
}

impl LoraSettings {
    /// `model`'s adapter, when it is a LoRA model.
    fn of(model: &Model) -> Option<Self> {
        let config = model.lora_config()?;
        let trained_params = model.trained_param_count() as u64;
        Some(LoraSettings {
            rank: config.rank,
            alpha: config.alpha,
            targets: config.targets.clone(),
            trained_params,
            trained_fraction: trained_params as f64 / model.param_count() as f64,
            quant: model.base_quant(),
        })
    }

    /// "LoRA rank R, alpha A, on TARGETS: N trained parameters (P% of the model's)".
    fn line(&self) -> String {
        format!(
            "LoRA rank {}, alpha {}, on {}: {} trained parameters ({:.3}% of the model's), \
             the base frozen{}",
            self.rank,
            self.alpha,
            self.targets.join(","),
            self.trained_params,
            100.0 * self.trained_fraction,
            self.quant
                .map_or(String::new(), |q| format!(", its linear weights in {q}"))
        )
    }
}

/// The LoRA adapter `--lora` asks for, with `--lora-alpha` and `--lora-targets` (no
/// dropout, as the peers run it); `None` without `--lora`.
fn lora_config(args: &StepArgs) -> Result<Option<LoraConfig>, ModelError> {
    let Some(rank) = args.lora else {
        return Ok(None);
    };
    let targets = args
        .lora_targets
        .split(',')
        .map(|t| t.trim().to_string())
        .collect();
    LoraConfig::new(rank, args.lora_alpha, 0.0, targets).map(Some)
}

/// One step as measured.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct StepSample {
    /// Wall seconds.
    pub seconds: f64,
    /// Mean loss over the step's tokens.
    pub loss: f32,
    /// Busy seconds per lane, in `Lane::ALL` order: nvme-read, nvme-write, h2d,
    /// compute, d2h, cpu-optimizer, device-update.
    pub lane_busy_s: [f64; Lane::COUNT],
    /// Seconds the compute lane waited for other lanes.
    pub compute_stall_s: f64,
    /// Seconds the compute lane sat idle from the step's start until its first layer
    /// block's forward began (the head: waiting for the first blocks' fetches).
    pub head_s: f64,
    /// Seconds from the compute lane's last operation to the step's end (the tail: the
    /// last updates and their writes).
    pub tail_s: f64,
    /// Bytes over NVMe read, NVMe write, H2D, D2H.
    pub link_bytes: [u64; 4],
    /// NVMe chunks moved through io_uring's registered (fixed) buffers, and through
    /// plain ones.
    pub nvme_fixed_plain_chunks: [u64; 2],
}

impl From<&StepReport> for StepSample {
    fn from(r: &StepReport) -> Self {
        let compute = || r.records.iter().filter(|o| o.lane == Lane::Compute);
        let last = compute().map(|o| o.end_ns).max().unwrap_or(0);
        StepSample {
            seconds: r.seconds,
            loss: r.loss,
            lane_busy_s: r.lane_busy,
            compute_stall_s: r.compute_stall,
            head_s: head_idle_ns(r) as f64 * 1e-9,
            tail_s: (r.seconds - last as f64 * 1e-9).max(0.0),
            link_bytes: r.link_bytes,
            nvme_fixed_plain_chunks: r.fixed_chunks,
        }
    }
}

/// The compute lane's idle time from the step's start until its first layer block's
/// forward (block 1) began: the gaps before and between its operations until then (in
/// the lane's order, each operation's span once).
fn head_idle_ns(r: &StepReport) -> u64 {
    let mut covered = 0u64;
    let mut idle = 0u64;
    for o in r.records.iter().filter(|o| o.lane == Lane::Compute) {
        idle += o.start_ns.saturating_sub(covered);
        if o.label.what == "fwd" && o.label.block == Some(1) {
            break;
        }
        covered = covered.max(o.end_ns);
    }
    idle
}

/// Latency percentiles of one kind of operation over the run.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    /// The operation kind (`nvme-read`, `forward`, `adamw`...).
    pub kind: &'static str,
    /// Operations recorded.
    pub count: u64,
    /// Median, microseconds.
    pub p50_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// Longest.
    pub max_us: u64,
}

/// One policy's results.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyResult {
    /// The policy's name, with its depth.
    pub policy: String,
    /// `--recompute` as asked for this run of the policy: auto, all or none.
    pub recompute: Recompute,
    /// Layer blocks the plan recomputes in the backward, of how many ("3 of 12 blocks").
    pub recomputed: String,
    /// Bytes of saved activations the plan keeps on the device.
    pub saved_activation_bytes: u64,
    /// Median step seconds.
    pub step_s_median: f64,
    /// Fastest step.
    pub step_s_min: f64,
    /// Tokens per second at the median.
    pub tokens_per_s: f64,
    /// Median step over `AllOnDevice`'s (when it ran): how many times slower.
    pub vs_all_on_device: Option<f64>,
    /// Median busy seconds of this policy's compute lane.
    pub compute_s_median: f64,
    /// `AllOnDevice`'s median compute-lane busy time over this policy's median step.
    pub overlap_efficiency_vs_all_on_device: Option<f64>,
    /// This policy's median compute-lane busy time over its median step.
    pub overlap_efficiency_own: f64,
    /// Median compute-lane stall over the median step.
    pub stall_fraction: f64,
    /// Median seconds the compute lane sat idle before the first layer's forward
    /// ([`StepSample::head_s`]).
    pub head_s_median: f64,
    /// Median seconds after its last ([`StepSample::tail_s`]).
    pub tail_s_median: f64,
    /// How AdamW's moments were kept: fp32, bf16 or q8.
    pub optimizer_state: OptimizerState,
    /// `--schedule` as asked for this run of the policy: auto, horizontal or vertical.
    pub schedule: Schedule,
    /// The order its plan runs the micro-batches in: horizontal or vertical.
    pub micro_batch_order: Schedule,
    /// Bytes per step over NVMe read, NVMe write, H2D, D2H, as measured (median step).
    pub link_bytes_per_step: [u64; 4],
    /// The same, as planned.
    pub link_bytes_planned: [u64; 4],
    /// Bytes per token over NVMe read, NVMe write, H2D, D2H, as measured (median
    /// step's bytes over the step's tokens): what a run moves whatever the machine.
    pub link_bytes_per_token: [f64; 4],
    /// NVMe bytes read and written per parameter per step, as measured (median step).
    pub nvme_bytes_per_param: f64,
    /// Planned peak bytes per tier: device, host, NVMe.
    pub peak_planned: [u64; 3],
    /// Measured peak per tier: the arenas' high-water marks (the end of the highest
    /// range a kernel, copy or host lane used) for device and host, the most bytes that
    /// extents written to held at once for NVMe.
    pub peak_measured: [u64; 3],
    /// The cost model's prediction for the plan.
    pub predicted: Prediction,
    /// Loss of the first step (warm-up included).
    pub loss_first: f32,
    /// Loss of the last step.
    pub loss_last: f32,
    /// The warm-up steps.
    pub warmup: Vec<StepSample>,
    /// The measured steps.
    pub steps: Vec<StepSample>,
    /// Latency per operation kind, over every step.
    pub latency: Vec<Latency>,
}

impl PolicyResult {
    /// The policy, how many layers its plan recomputes, (unless fp32) its moments'
    /// format and (when vertical) the order of its micro-batches, for tables.
    fn label(&self) -> String {
        let order = match self.micro_batch_order {
            Schedule::Vertical => ", vertical",
            _ => "",
        };
        format!("{}{order}", self.label_any_order())
    }

    /// [`PolicyResult::label`] without the order of the micro-batches.
    fn label_any_order(&self) -> String {
        let state = match self.optimizer_state {
            OptimizerState::Fp32 => String::new(),
            other => format!(", {other} state"),
        };
        format!("{}, recompute {}{state}", self.policy, self.recomputed)
    }

    /// Every step's loss (warm-up included), as bits.
    fn loss_bits(&self) -> Vec<u32> {
        self.warmup
            .iter()
            .chain(&self.steps)
            .map(|s| s.loss.to_bits())
            .collect()
    }

    /// Whether `other` is this policy's run with the same choices but those `differ`
    /// lets differ.
    fn same_run_but(&self, other: &PolicyResult, differ: Varies) -> bool {
        self.policy == other.policy
            && (differ == Varies::Recompute || self.recompute == other.recompute)
            && (differ == Varies::State || self.optimizer_state == other.optimizer_state)
            && (differ == Varies::Schedule || self.schedule == other.schedule)
    }
}

/// Which choice two runs of a policy compared differ in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Varies {
    Recompute,
    State,
    Schedule,
}

/// A policy's runs recomputing every layer and none, compared.
#[derive(Debug, Clone, Serialize)]
pub struct RecomputeComparison {
    /// The policy's name.
    pub policy: String,
    /// Tokens/s (median step) recomputing every layer's forward in the backward.
    pub tokens_per_s_recompute_all: f64,
    /// Tokens/s keeping every layer's saved activations.
    pub tokens_per_s_recompute_none: f64,
    /// The second over the first: how much faster keeping is.
    pub none_over_all: f64,
    /// Planned device peak of each: recompute all, none.
    pub device_peak_planned: [u64; 2],
}

/// A policy the planner refused.
#[derive(Debug, Clone, Serialize)]
pub struct Refusal {
    /// The policy.
    pub policy: String,
    /// Why, with what would fit.
    pub reason: String,
}

/// Everything `strata bench step` measured.
#[derive(Debug, Clone, Serialize)]
pub struct StepBenchReport {
    /// The machine.
    pub machine: Machine,
    /// The model.
    pub model: ModelShape,
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Micro-batches per step.
    pub grad_accum: usize,
    /// Working dtype.
    pub dtype: String,
    /// One-step delayed update.
    pub delayed_update: bool,
    /// The largest global gradient norm (0: no clipping).
    pub clip: f64,
    /// How complete gradients were kept (`--grad-dtype`).
    pub grad_dtype: GradDtype,
    /// What the backward approximated (`--approx-backward`).
    pub approx_backward: String,
    /// With `--lora`: the adapter trained over the frozen model, and what trains.
    pub lora: Option<LoraSettings>,
    /// Extent transfers each NVMe lane kept in flight.
    pub nvme_in_flight: usize,
    /// Untimed steps per policy.
    pub warmup: usize,
    /// Measured steps per policy.
    pub steps: usize,
    /// `interleaved` or `sequential`.
    pub schedule: &'static str,
    /// Why that schedule.
    pub schedule_reason: String,
    /// The NVMe tier's folder.
    pub nvme_dir: PathBuf,
    /// Budgets given (`None`: unlimited).
    pub budgets: [Option<u64>; 3],
    /// The rates predictions were made with.
    pub cost_model: CostModel,
    /// Whether every policy's losses equal the first policy's bit for bit (invariant 1).
    pub losses_identical: bool,
    /// The RAM the run was planned to hold: every executor's arenas in RAM (all at once
    /// when interleaved, the largest when sequential), the initial parameters every
    /// executor loads (4 B per parameter, made once), block staging, the overhead.
    pub process: ProcessMemory,
    /// The process's measured resident peak (VmHWM), when /proc says.
    pub peak_rss_bytes: Option<u64>,
    /// Results per policy (and `--recompute` value), in the order asked.
    pub policies: Vec<PolicyResult>,
    /// Per policy run with both `--recompute all` and `none`: tokens/s of each, ratio.
    pub recompute: Vec<RecomputeComparison>,
    /// Per policy run with fp32 moments and another format: NVMe bytes of each, ratio.
    pub optimizer_state: Vec<StateComparison>,
    /// Per policy run with both `--schedule horizontal` and `vertical`: bytes per token
    /// and tokens/s of each, ratios.
    pub micro_batch_order: Vec<ScheduleComparison>,
    /// Policies whose plans did not fit or could not be built.
    pub refused: Vec<Refusal>,
    /// The peers run in this invocation (`--peers`), with strata's ratios to them.
    pub peers: Vec<PeerResult>,
    /// With `--kernels`: where each policy's median step went, kernel by kernel.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub compute_profiles: Vec<ComputeProfile>,
}

/// One policy run with fp32 moments and with another format (`--optimizer-state`).
#[derive(Debug, Clone, Serialize)]
pub struct StateComparison {
    /// The policy, and how many layers it recomputes.
    pub policy: String,
    /// The other format.
    pub state: OptimizerState,
    /// NVMe bytes read plus written in the median step: fp32 moments, the other.
    pub nvme_bytes_per_step: [u64; 2],
    /// The other's over fp32's.
    pub nvme_ratio: f64,
    /// Tokens per second: fp32 moments, the other.
    pub tokens_per_s: [f64; 2],
    /// The last step's loss: fp32 moments, the other.
    pub loss_last: [f32; 2],
}

/// One policy run with each order of the micro-batches (`--schedule`).
#[derive(Debug, Clone, Serialize)]
pub struct ScheduleComparison {
    /// The policy, how many layers it recomputes, its moments' format.
    pub policy: String,
    /// Bytes per token over NVMe read, NVMe write, H2D, D2H, as measured (median step):
    /// horizontal, vertical.
    pub link_bytes_per_token: [[f64; 4]; 2],
    /// Vertical's NVMe bytes read per token over horizontal's.
    pub nvme_read_ratio: f64,
    /// NVMe bytes read plus written in the median step: horizontal, vertical.
    pub nvme_bytes_per_step: [u64; 2],
    /// Tokens per second: horizontal, vertical.
    pub tokens_per_s: [f64; 2],
    /// Vertical's tokens/s over horizontal's.
    pub speedup: f64,
    /// Planned device peak: horizontal, vertical (every micro-batch's checkpoints live
    /// at once vertically).
    pub device_peak_planned: [u64; 2],
    /// Whether the two runs' losses were bit-identical, step by step.
    pub losses_identical: bool,
}

/// What `--scale` measured.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleReport {
    /// The machine.
    pub machine: Machine,
    /// The model.
    pub model: ModelShape,
    /// The policy.
    pub policy: String,
    /// Where its activation checkpoints live (`host`, or `nvme` when the host budget is
    /// too small for them).
    pub checkpoints: String,
    /// The largest global gradient norm (0: no clipping).
    pub clip: f64,
    /// Blocks whose gradients waited for the clipping norm on NVMe (`--spill-grads`).
    pub grads_spilled_blocks: usize,
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Working dtype.
    pub dtype: String,
    /// Training state: working parameters plus fp32 master copy, Adam m and v.
    pub state_bytes: u64,
    /// Bytes per parameter of that state.
    pub state_bytes_per_param: u64,
    /// The host budget.
    pub host_budget_bytes: u64,
    /// The device budget (`None`: unlimited).
    pub device_budget_bytes: Option<u64>,
    /// `state_bytes / host_budget_bytes`.
    pub state_over_host_budget: f64,
    /// Planned peak per tier.
    pub peak_planned: [u64; 3],
    /// Measured peak per tier: the arenas' high-water marks (the end of the highest
    /// range a kernel, copy or host lane used) for device and host, the most bytes that
    /// extents written to held at once for NVMe.
    pub peak_measured: [u64; 3],
    /// The RAM the run was planned to hold: its arenas in RAM, block staging, the
    /// overhead.
    pub process: ProcessMemory,
    /// The process's measured resident peak (VmHWM), when /proc says.
    pub peak_rss_bytes: Option<u64>,
    /// Tokens per second, median of the steps after the first `--warmup`.
    pub tokens_per_s: f64,
    /// Median step seconds, likewise.
    pub step_s_median: f64,
    /// The loss of every step, on one repeated batch.
    pub losses: Vec<f32>,
    /// Every step.
    pub steps: Vec<StepSample>,
}

/// One policy being run.
struct Rig {
    /// The built-in policy, as asked for.
    builtin: BuiltinPolicy,
    policy: Box<dyn Policy>,
    recompute: Recompute,
    /// AdamW's moments' format.
    state: OptimizerState,
    /// The order of the micro-batches, as asked.
    schedule: Schedule,
    plan: Plan,
    executor: Option<Executor>,
    warmup: Vec<StepSample>,
    steps: Vec<StepSample>,
    reports: Vec<StepReport>,
    peak_measured: [u64; 3],
    latency: Vec<Latency>,
}

impl Rig {
    /// `builtin`'s plan, not started.
    fn new(
        builtin: BuiltinPolicy,
        policy: Box<dyn Policy>,
        (recompute, state, schedule): (Recompute, OptimizerState, Schedule),
        plan: Plan,
    ) -> Self {
        Rig {
            builtin,
            policy,
            recompute,
            state,
            schedule,
            plan,
            executor: None,
            warmup: Vec::new(),
            steps: Vec::new(),
            reports: Vec::new(),
            peak_measured: [0; 3],
            latency: Vec::new(),
        }
    }

    /// Step `s` of `warmup + measured = total` (a warm-up step while `s < warmup`) on
    /// `batches`.
    fn step(
        &mut self,
        batches: &[(Vec<u32>, Vec<u32>)],
        setup: &Setup,
        s: usize,
        (warmup, total): (usize, usize),
    ) -> Result<(), Box<dyn std::error::Error>> {
        let executor = self.executor.as_mut().expect("started");
        let report = executor.step(&refs(batches), &setup.step_params)?;
        eprintln!(
            "  {} ({}{}) step {}/{total}{}: {:.3} s, loss {:.4}",
            self.policy.name(),
            self.plan.recompute_summary(),
            match self.state {
                OptimizerState::Fp32 => String::new(),
                other => format!(", {other} moments"),
            },
            s + 1,
            if s < warmup { " (warm-up)" } else { "" },
            report.seconds,
            report.loss
        );
        if s < warmup {
            self.warmup.push(StepSample::from(&report));
        } else {
            self.steps.push(StepSample::from(&report));
            self.reports.push(report);
        }
        Ok(())
    }

    /// The measured step at the median time: its index in `steps` and `reports` alike.
    fn median_step(&self) -> usize {
        median_index(&self.steps.iter().map(|s| s.seconds).collect::<Vec<_>>())
    }

    /// The report of the measured step at the median time.
    fn median_report(&self) -> &StepReport {
        &self.reports[self.median_step()]
    }

    /// Ends the run: its peaks and latencies kept, its executor dropped.
    fn finish(&mut self) {
        let executor = self.executor.take().expect("started");
        self.peak_measured = executor.peak_measured();
        self.latency = latencies(&executor);
    }
}

/// What every policy of a run shares: the model, its initial parameters, the step.
struct Setup {
    model: Model,
    /// The model's shape.
    desc: ModelShape,
    /// With `--lora`, its adapter.
    lora: Option<LoraSettings>,
    /// The model's config.json (strata's peer script builds the model from it).
    hf_config: Value,
    /// Which device the executors open.
    device: DeviceChoice,
    /// The initial parameters every executor loads, made once; `None`: each executor
    /// makes them a block at a time as it loads them (a model too large to hold whole
    /// beside the executor).
    params: Option<Vec<Vec<f32>>>,
    /// Seed of the initial parameters.
    seed: u64,
    shape: StepShape,
    exec_config: ExecConfig,
    step_params: StepParams,
}

impl Setup {
    /// Without the initial parameters: each executor makes them a block at a time, until
    /// [`Setup::make_whole_params`].
    fn new(args: &StepArgs) -> Result<Self, Box<dyn std::error::Error>> {
        let shape = resolve_model(args)?;
        let mut desc = describe(&shape);
        let mut model = match shape {
            model_info::ModelShape::Gpt2(c) => Model::new(c)?,
            model_info::ModelShape::Llama(c) => Model::of(Llama::new(c)?),
        }
        .approximate(args.approx_backward)?;
        // As `strata train --lora` makes its model (`model_source::run_model`); what the
        // engine refuses (an approximate backward, a family without LoRA) is its error.
        if let Some(config) = lora_config(args)? {
            model = model.lora(&config)?;
        }
        if let Some(quant) = args.quant {
            if args.peers.is_some() {
                return Err(format!(
                    "--quant {quant} with --peers: the peers' side would be peft over \
                     bitsandbytes' 4-bit base, which this bench does not run; leave --peers \
                     out, or --quant to compare LoRA with peft's"
                )
                .into());
            }
            model = model.quantized(quant)?;
        }
        let lora = LoraSettings::of(&model);
        desc.params = model.param_count() as u64;
        // A LoRA model's config.json is its base's: the peers wrap that with peft.
        let hf_config = model.family().hf_config();
        let target = choose_target(args.device)?;
        let precision = match args.dtype {
            Dtype::Fp32 => Precision::Fp32,
            Dtype::Bf16 => Precision::Bf16,
        };
        let shape = StepShape {
            grad_accum: args.grad_accum,
            precision,
            delayed_update: args.delayed_update,
            needs_global_norm: args.clip > 0.0,
            grad_spill: args.spill_grads,
            grad_dtype: args.grad_dtype,
            // The scale run's; a comparison plans each policy with each --recompute.
            recompute: args.recompute.first().copied().unwrap_or_default(),
            optimizer_state: args.optimizer_state.first().copied().unwrap_or_default(),
            schedule: args.schedule.first().copied().unwrap_or_default(),
            prefetch_next_step: args.prefetch_next_step,
            ..StepShape::cpu(args.batch, args.seq).on(target)
        };
        Ok(Setup {
            model,
            desc,
            lora,
            hf_config,
            device: args.device,
            params: None,
            seed: args.seed,
            shape,
            exec_config: ExecConfig {
                nvme_dirs: vec![args.nvme.clone()],
                nvme_in_flight: args.nvme_in_flight,
                ..ExecConfig::default()
            },
            step_params: StepParams {
                adam: AdamW {
                    lr: args.lr,
                    weight_decay: 0.1,
                    ..AdamW::default()
                },
                clip: args.clip,
                loss_scale: 1.0,
            },
        })
    }

    /// Makes the initial parameters once, for several executors to load.
    fn make_whole_params(&mut self) {
        self.params = Some(self.model.init_params(self.seed));
    }

    fn executor(&self, plan: &Plan) -> Result<Executor, Box<dyn std::error::Error>> {
        let (device, _) = select(
            self.device,
            &DeviceConfig {
                memory_budget_bytes: plan.peak[Tier::Device.index()].max(1) as usize,
                cuda_ordinal: 0,
                cuda_needs_kernels: true,
            },
        )?;
        let mut executor =
            Executor::new(self.model.clone(), plan.clone(), device, &self.exec_config)?;
        match &self.params {
            Some(params) => executor.load(params, None)?,
            None => executor.load_blocks(&|b| Ok(self.model.init_block(b, self.seed)))?,
        }
        Ok(executor)
    }
}

/// The model `--model`, `--family` and the shape flags name, as `strata model` reads
/// them.
fn resolve_model(args: &StepArgs) -> Result<model_info::ModelShape, Box<dyn std::error::Error>> {
    ModelArgs {
        config: args.model.clone(),
        family: args.family.clone(),
        shape: args.shape.clone(),
        llama: args.llama.clone(),
        init: None,
        seed: args.seed,
        tokenizer: None,
    }
    .resolve_shape()
}

/// The report's description of `shape`.
fn describe(shape: &model_info::ModelShape) -> ModelShape {
    use model_info::ModelShape::{Gpt2, Llama};
    let (family, llama, [layers, heads, width, vocab, ctx], params) = match shape {
        Gpt2(c) => (
            "gpt2",
            None,
            [c.layers, c.heads, c.width, c.vocab, c.ctx],
            c.param_count(),
        ),
        Llama(c) => (
            c.variant.model_type(),
            Some((c.kv_heads, c.intermediate)),
            [c.layers, c.heads, c.width, c.vocab, c.ctx],
            c.param_count(),
        ),
    };
    ModelShape {
        name: shape.preset_name().into(),
        family: family.into(),
        kv_heads: llama.map(|(kv, _)| kv),
        intermediate: llama.map(|(_, i)| i),
        layers,
        heads,
        width,
        vocab,
        ctx,
        params: params as u64,
    }
}

/// The micro-batches of step `step`: deterministic, and learnable, so that the loss
/// falls even on fresh batches. Tokens follow a skewed distribution (id = vocab × u³
/// for uniform u, so low ids are common), which a model learns within a few steps;
/// inputs and targets are one stream shifted by one, as in `model::data`.
fn synthetic_batches(
    vocab: usize,
    shape: &StepShape,
    seed: u64,
    step: usize,
) -> Vec<(Vec<u32>, Vec<u32>)> {
    let n = shape.batch * shape.seq;
    let mut x = seed ^ (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut next = || {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let u = (x >> 11) as f64 / (1u64 << 53) as f64;
        ((u * u * u * vocab as f64) as usize).min(vocab - 1) as u32
    };
    (0..shape.grad_accum)
        .map(|_| {
            let stream: Vec<u32> = (0..=n).map(|_| next()).collect();
            (stream[..n].to_vec(), stream[1..].to_vec())
        })
        .collect()
}

fn refs(batches: &[(Vec<u32>, Vec<u32>)]) -> Vec<(&[u32], &[u32])> {
    batches.iter().map(|(t, y)| (&t[..], &y[..])).collect()
}

/// Refuses an NVMe folder the tier cannot use: missing, or tmpfs (RAM rather than a
/// drive).
fn check_nvme_dir(dir: &Path) -> Result<(), String> {
    if !dir.is_dir() {
        return Err(format!(
            "--nvme {}: not a folder; pass a folder on the drive to swap to",
            dir.display()
        ));
    }
    match swap_folder_refusal(dir) {
        Some(why) => Err(format!("--nvme {why}")),
        None => Ok(()),
    }
}

fn budgets(args: &StepArgs, host_default: Option<u64>) -> Budgets {
    const UNLIMITED: u64 = u64::MAX / 4;
    Budgets {
        device: args.device_mem.unwrap_or(UNLIMITED),
        host: args.host_mem.or(host_default).unwrap_or(UNLIMITED),
        nvme: UNLIMITED,
    }
}

fn validate(args: &StepArgs) -> Result<(), String> {
    for (name, value) in [
        ("--batch", args.batch),
        ("--seq", args.seq),
        ("--grad-accum", args.grad_accum),
        ("--steps", args.steps),
        ("--depth", args.depth),
    ] {
        if value == 0 {
            return Err(format!("{name} must be at least 1"));
        }
    }
    if args.policies.is_empty() {
        return Err("--policies names no policy".into());
    }
    if args.recompute.is_empty() {
        return Err("--recompute names no choice (auto, all, none)".into());
    }
    if args.optimizer_state.is_empty() {
        return Err("--optimizer-state names no format (fp32, bf16, q8)".into());
    }
    if args.schedule.is_empty() {
        return Err("--schedule names no order (auto, horizontal, vertical)".into());
    }
    Ok(())
}

/// `strata bench step` (or its `--scale` run): runs, prints, and writes what was asked.
pub fn run(args: &StepArgs) -> Result<(), Box<dyn std::error::Error>> {
    validate(args)?;
    if args.scale {
        let report = run_scale(args)?;
        if let Some(path) = &args.json {
            write_json(path, &report)?;
            println!("wrote {}", path.display());
        }
        return Ok(());
    }
    let report = run_compare(args)?;
    if let Some(path) = &args.json {
        write_json(path, &report)?;
        println!("wrote {}", path.display());
    }
    if let Some(path) = &args.svg {
        std::fs::write(path, chart(&report).to_svg())?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Every policy's step time, interleaved, against `AllOnDevice`.
pub fn run_compare(args: &StepArgs) -> Result<StepBenchReport, Box<dyn std::error::Error>> {
    let mut machine = Machine::now();
    let mut setup = Setup::new(args)?;
    let (mut rigs, refused) = plan_rigs(args, &setup);
    if rigs.is_empty() {
        return Err("no policy could be planned within the budgets; see the refusals above".into());
    }
    if rigs.iter().any(|r| !r.plan.extent_groups.is_empty()) {
        check_nvme_dir(&args.nvme)?;
    }
    let (schedule, schedule_reason) = schedule(&rigs, &setup, &machine);
    // Several executors load one copy of the initial parameters; one makes them a block
    // at a time.
    let whole_params = rigs.len() > 1;
    let process = compare_process_memory(&rigs, &setup, schedule, whole_params);
    check_memory(&process)?;
    if whole_params {
        setup.make_whole_params();
    }
    print_compare_header(args, &setup, &machine, schedule);
    println!("schedule: {schedule_reason}");
    run_rigs(&mut rigs, args, &setup, schedule)?;
    machine.load_average[1] = load_average();

    let cost = CostModel::default();
    let policies = policy_results(&rigs, (setup.shape.tokens(), setup.desc.params), cost);
    // Every format of AdamW's moments has its own arithmetic: policies agree within one.
    let losses_identical = policies.iter().all(|p| {
        let first = policies
            .iter()
            .find(|o| o.optimizer_state == p.optimizer_state)
            .expect("p itself");
        p.loss_bits() == first.loss_bits()
    });
    let recompute = recompute_comparisons(&policies);
    let optimizer_state = state_comparisons(&policies);
    let micro_batch_order = schedule_comparisons(&policies);
    let compute_profiles = if args.kernels {
        compute_profiles(&rigs, &policies, args, &setup)
    } else {
        Vec::new()
    };
    let peers = match &args.peers {
        None => Vec::new(),
        Some(dir) => {
            // The peers run in other processes: the initial parameters (4 B per
            // parameter) are not kept from them.
            setup.params = None;
            let results = run_peers(dir, args, &setup, &rigs, &policies);
            machine.load_average[1] = load_average();
            results
        }
    };
    let report = StepBenchReport {
        machine,
        model: setup.desc.clone(),
        batch: args.batch,
        seq: args.seq,
        grad_accum: args.grad_accum,
        dtype: setup.shape.precision.to_string(),
        delayed_update: setup.shape.delayed_update,
        clip: args.clip,
        grad_dtype: setup.shape.grad_dtype,
        approx_backward: setup.model.approximation().to_string(),
        lora: setup.lora.clone(),
        nvme_in_flight: args.nvme_in_flight,
        warmup: args.warmup,
        steps: args.steps,
        schedule,
        schedule_reason,
        nvme_dir: args.nvme.clone(),
        budgets: [args.device_mem, args.host_mem, None],
        cost_model: cost,
        losses_identical,
        process,
        peak_rss_bytes: peak_rss_bytes(),
        policies,
        recompute,
        optimizer_state,
        micro_batch_order,
        refused,
        peers,
        compute_profiles,
    };
    print_compare(&report, args, &rigs)?;
    Ok(report)
}

/// The RAM a comparison is planned to hold, with the initial parameters held whole for
/// every executor (4 B per parameter): run one after another, the largest executor's;
/// interleaved, every executor's arenas at once, and while loading the last, those and
/// the largest loading figure (a bound: the others' device arenas are not all touched
/// before the steps).
fn compare_process_memory(
    rigs: &[Rig],
    setup: &Setup,
    schedule: &str,
    whole_params: bool,
) -> ProcessMemory {
    let each: Vec<ProcessMemory> = rigs
        .iter()
        .map(|r| ProcessMemory::of(&r.plan, &setup.model))
        .collect();
    let whole_params = if whole_params {
        4 * setup.desc.params
    } else {
        0
    };
    let loading = each.iter().map(|p| p.loading_bytes).max().unwrap_or(0) + whole_params;
    let arenas = each.iter().map(|p| p.arena_bytes);
    match schedule {
        "interleaved" => {
            let all: u64 = arenas.sum();
            ProcessMemory::new(all + whole_params, all + loading)
        }
        _ => ProcessMemory::new(arenas.max().unwrap_or(0) + whole_params, loading),
    }
}

/// Refuses, before any executor is made, a comparison whose planned process memory is
/// more than this process may use (the machine's available memory, or its memory
/// cgroup's limit when lower): it would be killed for memory part way.
fn check_memory(process: &ProcessMemory) -> Result<(), String> {
    match memory_limit() {
        Some(limit) if process.total_bytes > limit.bytes => Err(format!(
            "this comparison needs {} of RAM but {} allows {}: it would be killed for memory; \
             give --device-mem and --host-mem budgets (the CPU device's memory is RAM), \
             fewer --policies or a smaller model ({})",
            format_bytes(process.total_bytes),
            limit.source,
            format_bytes(limit.bytes),
            process.line()
        )),
        _ => Ok(()),
    }
}

/// "process memory: planned X + overhead Y = Z (...); peak RSS (VmHWM / planned): M / Z
/// (±D)", as both modes print it.
fn process_line(process: &ProcessMemory, peak_rss: Option<u64>) -> String {
    match peak_rss {
        Some(rss) => format!(
            "{}; peak RSS (VmHWM / planned): {}",
            process.line(),
            process.compared(rss)
        ),
        None => process.line(),
    }
}

/// Plans every policy asked for under every `--recompute`, `--optimizer-state` and
/// `--schedule` asked for: a rig for each plan that fits, a refusal (printed) for each
/// that does not.
fn plan_rigs(args: &StepArgs, setup: &Setup) -> (Vec<Rig>, Vec<Refusal>) {
    let mut rigs = Vec::new();
    let mut refused = Vec::new();
    let mut asked: Vec<(BuiltinPolicy, Recompute, OptimizerState, Schedule)> = Vec::new();
    let runs = args.policies.iter().flat_map(|&n| {
        args.recompute.iter().flat_map(move |&r| {
            args.optimizer_state
                .iter()
                .flat_map(move |&s| args.schedule.iter().map(move |&order| (n, r, s, order)))
        })
    });
    for run in runs {
        if asked.contains(&run) {
            continue;
        }
        asked.push(run);
        let (builtin, recompute, state, schedule) = run;
        let policy = builtin.policy(args.depth);
        let input = PlanInput {
            model: &setup.model,
            shape: setup
                .shape
                .recomputing(recompute)
                .with_state(state)
                .scheduled(schedule),
            budgets: budgets(args, None),
            cost: Default::default(),
        };
        match Plan::build(&input, policy.as_ref()).and_then(|plan| {
            plan.check_fits(&input)?;
            Ok(plan)
        }) {
            Ok(plan) => rigs.push(Rig::new(
                builtin,
                policy,
                (recompute, state, schedule),
                plan,
            )),
            Err(e) => {
                let mut name = policy.name();
                if args.recompute.len() > 1 {
                    name = format!("{name}, --recompute {recompute}");
                }
                if args.optimizer_state.len() > 1 {
                    name = format!("{name}, --optimizer-state {state}");
                }
                if args.schedule.len() > 1 {
                    name = format!("{name}, --schedule {schedule}");
                }
                println!("{name}: skipped: {e}");
                refused.push(Refusal {
                    policy: name,
                    reason: e.to_string(),
                });
            }
        }
    }
    (rigs, refused)
}

/// Whether the rigs run interleaved (every executor held at once) or one after another,
/// and why. Held at once, they need the sum of the plans' device and host peaks (the CPU
/// device's memory is host memory), next to the initial parameters; they run
/// sequentially when that would crowd out the page cache and others.
fn schedule(rigs: &[Rig], setup: &Setup, machine: &Machine) -> (&'static str, String) {
    if let [rig] = rigs {
        return (
            "sequential",
            format!(
                "one policy, its executor alone ({})",
                format_bytes(rig_bytes(rig))
            ),
        );
    }
    let held: u64 = rigs.iter().map(rig_bytes).sum::<u64>() + 4 * setup.desc.params;
    match machine.mem_available_bytes {
        Some(available) if held as f64 > 0.8 * available as f64 => (
            "sequential",
            format!(
                "every executor at once would hold {}, more than 80% of the {} available: \
                 policies run one after another, so machine noise may differ between them",
                format_bytes(held),
                format_bytes(available)
            ),
        ),
        _ => (
            "interleaved",
            format!(
                "every executor held at once ({}), one step of each policy per round",
                format_bytes(held)
            ),
        ),
    }
}

/// A rig's planned device and host peaks (the CPU device's memory is host memory).
fn rig_bytes(rig: &Rig) -> u64 {
    rig.plan.peak[Tier::Device.index()] + rig.plan.peak[Tier::Host.index()]
}

fn print_compare_header(args: &StepArgs, setup: &Setup, machine: &Machine, schedule: &str) {
    let config = &setup.desc;
    let tokens = setup.shape.tokens();
    println!(
        "bench step: {} {} ({} layers, {} heads, width {}, vocab {}, {} params), batch {} x seq {} \
         x accum {} = {tokens} tokens/step, {}{}, {} warm-up + {} measured steps per policy, \
         {schedule}; {} ({} cores)",
        config.family,
        config.name,
        config.layers,
        config.heads,
        config.width,
        config.vocab,
        config.params,
        args.batch,
        args.seq,
        args.grad_accum,
        setup.shape.precision,
        if args.delayed_update {
            ", delayed update"
        } else {
            ""
        },
        args.warmup,
        args.steps,
        machine.cpu,
        machine.cores
    );
    if let Some(lora) = &setup.lora {
        println!("{}", lora.line());
    }
}

/// Runs `--warmup` and then `--steps` steps of every rig on the same batches, one step of
/// each per round (`interleaved`) or each in turn.
fn run_rigs(
    rigs: &mut [Rig],
    args: &StepArgs,
    setup: &Setup,
    schedule: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let data: Vec<_> = (0..args.warmup + args.steps)
        .map(|s| synthetic_batches(setup.desc.vocab, &setup.shape, args.seed, s))
        .collect();
    let total = args.warmup + args.steps;
    if schedule == "interleaved" {
        for rig in rigs.iter_mut() {
            rig.executor = Some(setup.executor(&rig.plan)?);
        }
        for (s, batches) in data.iter().enumerate() {
            for rig in rigs.iter_mut() {
                rig.step(batches, setup, s, (args.warmup, total))?;
            }
        }
        rigs.iter_mut().for_each(Rig::finish);
    } else {
        for rig in rigs.iter_mut() {
            rig.executor = Some(setup.executor(&rig.plan)?);
            for (s, batches) in data.iter().enumerate() {
                rig.step(batches, setup, s, (args.warmup, total))?;
            }
            rig.finish();
        }
    }
    Ok(())
}

/// Each rig's results, against `AllOnDevice`'s when it ran.
fn policy_results(
    rigs: &[Rig],
    (tokens, params): (u64, u64),
    cost: CostModel,
) -> Vec<PolicyResult> {
    let reference = rigs
        .iter()
        .find(|r| r.builtin == BuiltinPolicy::AllOnDevice)
        .map(|r| {
            let step = median(&r.steps.iter().map(|s| s.seconds).collect::<Vec<_>>());
            let compute = median(&r.steps.iter().map(compute_busy).collect::<Vec<_>>());
            (step, compute)
        });
    rigs.iter()
        .map(|rig| {
            let seconds: Vec<f64> = rig.steps.iter().map(|s| s.seconds).collect();
            let step_s = median(&seconds);
            let compute_s = median(&rig.steps.iter().map(compute_busy).collect::<Vec<_>>());
            let stall_s = median(
                &rig.steps
                    .iter()
                    .map(|s| s.compute_stall_s)
                    .collect::<Vec<_>>(),
            );
            let all = rig.warmup.iter().chain(&rig.steps);
            let links = rig.steps[rig.median_step()].link_bytes;
            PolicyResult {
                policy: rig.plan.policy.clone(),
                recompute: rig.recompute,
                recomputed: rig.plan.recomputed_of(),
                saved_activation_bytes: rig.plan.saved_total_bytes(),
                step_s_median: step_s,
                step_s_min: seconds.iter().copied().fold(f64::INFINITY, f64::min),
                tokens_per_s: tokens as f64 / step_s,
                vs_all_on_device: reference.map(|(step, _)| step_s / step),
                compute_s_median: compute_s,
                overlap_efficiency_vs_all_on_device: reference.map(|(_, compute)| compute / step_s),
                overlap_efficiency_own: compute_s / step_s,
                stall_fraction: stall_s / step_s,
                head_s_median: median(&rig.steps.iter().map(|s| s.head_s).collect::<Vec<_>>()),
                tail_s_median: median(&rig.steps.iter().map(|s| s.tail_s).collect::<Vec<_>>()),
                optimizer_state: rig.state,
                schedule: rig.schedule,
                micro_batch_order: rig.plan.shape.schedule,
                link_bytes_per_step: links,
                link_bytes_planned: rig.plan.link_bytes,
                link_bytes_per_token: links.map(|b| b as f64 / tokens as f64),
                nvme_bytes_per_param: (links[0] + links[1]) as f64 / params as f64,
                peak_planned: rig.plan.peak,
                peak_measured: rig.peak_measured,
                predicted: cost.predict(&rig.plan),
                loss_first: all.clone().next().map_or(f32::NAN, |s| s.loss),
                loss_last: all.last().map_or(f32::NAN, |s| s.loss),
                warmup: rig.warmup.clone(),
                steps: rig.steps.clone(),
                latency: rig.latency.clone(),
            }
        })
        .collect()
}

/// Per policy (and recompute choice) run with fp32 moments and with another format, the
/// two compared.
fn state_comparisons(policies: &[PolicyResult]) -> Vec<StateComparison> {
    let nvme = |p: &PolicyResult| p.link_bytes_per_step[0] + p.link_bytes_per_step[1];
    policies
        .iter()
        .filter(|p| p.optimizer_state != OptimizerState::Fp32)
        .filter_map(|other| {
            let fp32 = policies.iter().find(|p| {
                p.optimizer_state == OptimizerState::Fp32 && p.same_run_but(other, Varies::State)
            })?;
            Some(StateComparison {
                policy: format!("{}, recompute {}", other.policy, other.recomputed),
                state: other.optimizer_state,
                nvme_bytes_per_step: [nvme(fp32), nvme(other)],
                nvme_ratio: nvme(other) as f64 / nvme(fp32).max(1) as f64,
                tokens_per_s: [fp32.tokens_per_s, other.tokens_per_s],
                loss_last: [fp32.loss_last, other.loss_last],
            })
        })
        .collect()
}

/// Per policy run both recomputing every layer and none, the two compared.
fn recompute_comparisons(policies: &[PolicyResult]) -> Vec<RecomputeComparison> {
    policies
        .iter()
        .filter(|p| p.recompute == Recompute::All)
        .filter_map(|all| {
            let none = policies.iter().find(|p| {
                p.recompute == Recompute::None && p.same_run_but(all, Varies::Recompute)
            })?;
            Some(RecomputeComparison {
                policy: all.policy.clone(),
                tokens_per_s_recompute_all: all.tokens_per_s,
                tokens_per_s_recompute_none: none.tokens_per_s,
                none_over_all: none.tokens_per_s / all.tokens_per_s,
                device_peak_planned: [all.peak_planned[0], none.peak_planned[0]],
            })
        })
        .collect()
}

/// Per policy (and recompute choice and format) run with both orders of the
/// micro-batches, the two compared.
fn schedule_comparisons(policies: &[PolicyResult]) -> Vec<ScheduleComparison> {
    let nvme = |p: &PolicyResult| p.link_bytes_per_step[0] + p.link_bytes_per_step[1];
    policies
        .iter()
        .filter(|p| p.schedule == Schedule::Vertical)
        .filter_map(|v| {
            let h = policies.iter().find(|p| {
                p.schedule == Schedule::Horizontal && p.same_run_but(v, Varies::Schedule)
            })?;
            Some(ScheduleComparison {
                policy: v.label_any_order(),
                link_bytes_per_token: [h.link_bytes_per_token, v.link_bytes_per_token],
                nvme_read_ratio: v.link_bytes_per_token[0] / h.link_bytes_per_token[0].max(1e-9),
                nvme_bytes_per_step: [nvme(h), nvme(v)],
                tokens_per_s: [h.tokens_per_s, v.tokens_per_s],
                speedup: v.tokens_per_s / h.tokens_per_s,
                device_peak_planned: [h.peak_planned[0], v.peak_planned[0]],
                losses_identical: h.loss_bits() == v.loss_bits(),
            })
        })
        .collect()
}

/// The peers of `--peers DIR`, each against its strata policy at that policy's fastest
/// recompute choice of this run (the peers keep every activation).
fn run_peers(
    dir: &Path,
    args: &StepArgs,
    setup: &Setup,
    rigs: &[Rig],
    policies: &[PolicyResult],
) -> Vec<PeerResult> {
    let mut strata: Vec<(BuiltinPolicy, f64)> = Vec::new();
    for (rig, p) in rigs.iter().zip(policies) {
        match strata
            .iter_mut()
            .find(|(builtin, _)| *builtin == rig.builtin)
        {
            Some(best) => best.1 = best.1.max(p.tokens_per_s),
            None => strata.push((rig.builtin, p.tokens_per_s)),
        }
    }
    let config = &setup.desc;
    let shape = PeerShape {
        layers: config.layers,
        heads: config.heads,
        width: config.width,
        vocab: config.vocab,
        ctx: config.ctx,
        batch: args.batch,
        grad_accum: args.grad_accum,
        seq: args.seq,
        steps: args.steps,
        warmup: args.warmup,
        threads: strata_engine::kernels::parallel::max_threads(),
        lr: args.lr,
        hf_config: setup.hf_config.clone(),
        lora: setup.model.lora_config().cloned(),
    };
    match args.dtype {
        Dtype::Fp32 => peers::run(dir, &shape, &strata, &args.nvme),
        Dtype::Bf16 => peers::run_bf16(dir, &shape, &strata, &args.nvme),
    }
}

/// Each policy's median step, kernel by kernel, against the model's products timed alone
/// now (a GPT-2 model whose kernels were timed: the CPU device).
fn compute_profiles(
    rigs: &[Rig],
    policies: &[PolicyResult],
    args: &StepArgs,
    setup: &Setup,
) -> Vec<ComputeProfile> {
    let timed = rigs
        .iter()
        .any(|r| !r.median_report().kernels.entries().is_empty());
    let d = &setup.desc;
    let gemm_alone = (timed && d.family == "gpt2").then(|| {
        eprintln!("timing the model's matrix products alone (--kernels)");
        kernels::time_gpt2_products(
            Cpu::default(),
            d.layers,
            (args.batch, args.seq),
            (d.width, d.heads, d.vocab),
        )
    });
    rigs.iter()
        .zip(policies)
        .map(|(rig, p)| {
            let report = rig.median_report();
            kernels::profile(
                p.label(),
                report.seconds,
                &report.kernels,
                gemm_alone.clone(),
            )
        })
        .collect()
}

/// Prints the report (and the peers'), writes the trace when asked, and refuses a run
/// whose policies' losses differ.
fn print_compare(
    report: &StepBenchReport,
    args: &StepArgs,
    rigs: &[Rig],
) -> Result<(), Box<dyn std::error::Error>> {
    print!("{}", render(report));
    println!("{}", process_line(&report.process, report.peak_rss_bytes));
    for profile in &report.compute_profiles {
        println!();
        print!("{}", kernels::render(profile));
    }
    if !report.peers.is_empty() {
        println!();
        print!("{}", peers::render(&report.peers));
    }
    if let Some(path) = &args.trace {
        write_json(path, &combined_trace(rigs))?;
        println!(
            "wrote {} (open it in https://ui.perfetto.dev)",
            path.display()
        );
    }
    if !report.losses_identical {
        return Err(
            "the policies' losses differ: offloading changed the math (invariant 1); this is \
             a bug, please report it with the JSON"
                .into(),
        );
    }
    Ok(())
}

fn compute_busy(s: &StepSample) -> f64 {
    s.lane_busy_s[Lane::Compute.index()]
}

fn latencies(executor: &Executor) -> Vec<Latency> {
    executor
        .latency_summary()
        .into_iter()
        .map(|(kind, count, p50_us, p99_us, max_us)| Latency {
            kind,
            count,
            p50_us,
            p99_us,
            max_us,
        })
        .collect()
}

/// Three significant digits (`15.3`, `0.00234`), so that one column holds a tiny test
/// model's step seconds and GPT-2's alike, and a 3B model's tokens/s (`0.414`).
fn three_digits(value: f64) -> String {
    if !(value.is_finite() && value > 0.0) {
        return format!("{value}");
    }
    let decimals = (2 - value.log10().floor() as i32).max(0) as usize;
    format!("{value:.decimals$}")
}

fn ratio(value: Option<f64>, suffix: &str) -> String {
    value.map_or("-".into(), |v| format!("{v:.2}{suffix}"))
}

/// The tables of a comparison run.
pub fn render(report: &StepBenchReport) -> String {
    let aod = BuiltinPolicy::AllOnDevice;
    let vs_aod = format!("vs {aod}");
    let mut time = Table::new([
        "policy",
        "step s",
        "tokens/s",
        vs_aod.as_str(),
        "overlap (AOD compute)",
        "overlap (own compute)",
        "stall %",
        "head ms",
        "tail ms",
        "predicted s",
        "loss first -> last",
    ]);
    let mut memory = Table::new([
        "policy",
        "plan device",
        "plan host",
        "plan nvme",
        "measured device",
        "measured host",
        "measured nvme",
        "nvme read/step",
        "nvme write/step",
        "h2d/step",
        "d2h/step",
        "nvme fixed/plain chunks",
    ]);
    for p in &report.policies {
        time.row([
            p.label(),
            three_digits(p.step_s_median),
            three_digits(p.tokens_per_s),
            ratio(p.vs_all_on_device, "x"),
            ratio(p.overlap_efficiency_vs_all_on_device, ""),
            format!("{:.2}", p.overlap_efficiency_own),
            format!("{:.1}%", 100.0 * p.stall_fraction),
            format!("{:.1}", 1e3 * p.head_s_median),
            format!("{:.1}", 1e3 * p.tail_s_median),
            three_digits(p.predicted.step_seconds),
            format!("{:.4} -> {:.4}", p.loss_first, p.loss_last),
        ]);
        let mut row = vec![p.label()];
        row.extend(p.peak_planned.iter().map(|&b| format_bytes(b)));
        row.extend(p.peak_measured.iter().map(|&b| format_bytes(b)));
        row.extend(p.link_bytes_per_step.iter().map(|&b| format_bytes(b)));
        let median_step = p.steps.iter().min_by(|a, b| {
            (a.seconds - p.step_s_median)
                .abs()
                .total_cmp(&(b.seconds - p.step_s_median).abs())
        });
        row.push(median_step.map_or("-".into(), |s| {
            let [fixed, plain] = s.nvme_fixed_plain_chunks;
            format!("{fixed}/{plain}")
        }));
        memory.row(row);
    }
    let mut out = time.render();
    out.push_str(&format!(
        "step s: median of the measured steps; vs {aod}: step time over {aod}'s;\n\
         overlap (AOD compute): {aod}'s compute-lane busy time / this step time (1 = \
         as fast as no data movement);\n\
         overlap (own compute): this policy's compute-lane busy time / its step time (1 = every \
         transfer hidden under compute);\n\
         stall: the compute lane waiting for data; head: its idle time before the first \
         layer's forward (the first blocks' fetches), tail: after its last operation (the \
         last updates and writes); \
         predicted: the cost model's defaults (engine::plan::CostModel).\n",
    ));
    out.push('\n');
    out.push_str(&memory.render());
    out.push_str(
        "plan: the plan's peak per tier; measured: the arenas' high-water marks (the highest \
         byte a kernel, copy or host lane used) and the bytes of NVMe extents written; per \
         step: bytes moved over each link in the median step, as the NVMe tier and the \
         device's copies counted them (the plan's are in the JSON); fixed: NVMe chunks \
         through io_uring's registered buffers (the pinned host arena).\n",
    );
    let mut per_token = Table::new([
        "policy",
        "nvme read B/token",
        "nvme write B/token",
        "h2d B/token",
        "d2h B/token",
        "nvme B/param/step",
    ]);
    for p in &report.policies {
        let mut row = vec![p.label()];
        row.extend(
            p.link_bytes_per_token
                .iter()
                .map(|b| format_bytes(b.round() as u64)),
        );
        row.push(format!("{:.2}", p.nvme_bytes_per_param));
        per_token.row(row);
    }
    out.push('\n');
    out.push_str(&per_token.render());
    out.push_str(
        "B/token: bytes moved over each link in the median step over the step's tokens; \
         nvme B/param/step: NVMe bytes read and written in the median step over the \
         model's parameters (both measured, machine-independent).\n",
    );
    out.push_str(&comparisons(report));
    out.push_str(&format!(
        "losses bit-identical across policies, recompute choices and orders of the \
         micro-batches, for each format of the moments (invariant 1): {}\n",
        if report.losses_identical { "yes" } else { "NO" }
    ));
    if let [Some(before), Some(after)] = report.machine.load_average {
        out.push_str(&format!(
            "load average (1 min): {before:.2} before, {after:.2} after, on {} cores\n",
            report.machine.cores
        ));
    }
    out
}

/// One line per pair of runs compared: moments' formats, orders of the micro-batches,
/// recomputing.
fn comparisons(report: &StepBenchReport) -> String {
    let mut out = String::new();
    for c in &report.optimizer_state {
        out.push_str(&format!(
            "{}: {} moments move {} over NVMe per step, fp32 moments {}: {:.3}x; {} vs {} \
             tokens/s; last loss {:.4} vs {:.4} (fp32)\n",
            c.policy,
            c.state,
            format_bytes(c.nvme_bytes_per_step[1]),
            format_bytes(c.nvme_bytes_per_step[0]),
            c.nvme_ratio,
            three_digits(c.tokens_per_s[1]),
            three_digits(c.tokens_per_s[0]),
            c.loss_last[1],
            c.loss_last[0],
        ));
    }
    for c in &report.micro_batch_order {
        let [h, v] = c
            .link_bytes_per_token
            .map(|t| t.map(|b| format_bytes(b.round() as u64)));
        out.push_str(&format!(
            "{}: vertical reads {} per token from NVMe, horizontal {}: {:.3}x (writes {} vs \
             {}, h2d {} vs {}); {} vs {} tokens/s: {:.2}x; device peak planned {} vs \
             {}; losses bit-identical: {}\n",
            c.policy,
            v[0],
            h[0],
            c.nvme_read_ratio,
            v[1],
            h[1],
            v[2],
            h[2],
            three_digits(c.tokens_per_s[1]),
            three_digits(c.tokens_per_s[0]),
            c.speedup,
            format_bytes(c.device_peak_planned[1]),
            format_bytes(c.device_peak_planned[0]),
            if c.losses_identical { "yes" } else { "NO" }
        ));
    }
    for c in &report.recompute {
        out.push_str(&format!(
            "{}: keeping every layer's activations (--recompute none) {:.0} tokens/s, \
             recomputing every layer's forward (all) {:.0} tokens/s: {:.3}x, for {} more \
             device memory planned\n",
            c.policy,
            c.tokens_per_s_recompute_none,
            c.tokens_per_s_recompute_all,
            c.none_over_all,
            format_bytes(c.device_peak_planned[1].saturating_sub(c.device_peak_planned[0]))
        ));
    }
    out
}

fn chart(report: &StepBenchReport) -> LineChart {
    LineChart {
        title: format!(
            "strata bench step: {} ({} params), batch {} x {}",
            report.model.name, report.model.params, report.batch, report.seq
        ),
        x_label: "measured step".into(),
        y_label: "seconds per step".into(),
        log2_x: false,
        x_format: |x| format!("{x:.0}"),
        series: report
            .policies
            .iter()
            .map(|p| Series {
                name: p.label(),
                points: p
                    .steps
                    .iter()
                    .enumerate()
                    .map(|(i, s)| ((i + 1) as f64, s.seconds))
                    .collect(),
            })
            .collect(),
    }
}

/// Each policy's median step in one Chrome trace, a process per policy.
fn combined_trace(rigs: &[Rig]) -> Value {
    let mut events = Vec::new();
    for (pid, rig) in rigs.iter().enumerate() {
        let index = rig.median_step();
        let step = (rig.warmup.len() + index + 1) as u64;
        let trace = rig.reports[index].chrome_trace(step);
        for mut event in trace["traceEvents"].as_array().cloned().unwrap_or_default() {
            event["pid"] = json!(pid + 1);
            if event["name"] == "process_name" {
                event["args"]["name"] = json!(format!(
                    "{}, {} (step {step})",
                    rig.plan.policy,
                    rig.plan.recompute_summary()
                ));
            }
            events.push(event);
        }
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

/// The scale claim: `NvmeOffload` trains a model whose training state is at least twice
/// the host budget, within that budget, and its loss falls on a repeated batch.
pub fn run_scale(args: &StepArgs) -> Result<ScaleReport, Box<dyn std::error::Error>> {
    // GPT-2 124M's 1.85 GiB of fp32 state is 2.1x this.
    const DEFAULT_HOST_BYTES: u64 = 900 << 20;
    let mut machine = Machine::now();
    let setup = Setup::new(args)?;
    let budgets = budgets(args, Some(DEFAULT_HOST_BYTES));
    let state_per_param = setup.shape.precision.param_bytes() + 12;
    let state_bytes = setup.desc.params * state_per_param;
    if state_bytes < 2 * budgets.host {
        return Err(format!(
            "the scale run needs a training state at least twice the host budget, but {} \
             ({} params x {state_per_param} B) is less than twice --host-mem {}; pick a \
             larger --model or a smaller --host-mem",
            format_bytes(state_bytes),
            setup.desc.params,
            format_bytes(budgets.host)
        )
        .into());
    }
    check_nvme_dir(&args.nvme)?;
    let (plan, checkpoints) = scale_plan(args, &setup, budgets)?;
    assert!(
        plan.peak[Tier::Host.index()] <= budgets.host,
        "check_fits held the budget"
    );
    print_scale_header(
        args,
        &setup,
        &plan,
        (checkpoints, budgets.host),
        state_bytes,
    );
    let (steps, peak_measured) = scale_steps(args, &setup, &plan)?;
    machine.load_average[1] = load_average();
    let timed: Vec<f64> = steps
        .iter()
        .skip(args.warmup.min(args.steps - 1))
        .map(|s| s.seconds)
        .collect();
    let step_s = median(&timed);
    let report = ScaleReport {
        machine,
        model: setup.desc.clone(),
        policy: plan.policy.clone(),
        checkpoints: checkpoints.to_string(),
        clip: args.clip,
        grads_spilled_blocks: plan.spilled(),
        batch: args.batch,
        seq: args.seq,
        dtype: setup.shape.precision.to_string(),
        state_bytes,
        state_bytes_per_param: state_per_param,
        host_budget_bytes: budgets.host,
        device_budget_bytes: args.device_mem,
        state_over_host_budget: state_bytes as f64 / budgets.host as f64,
        peak_planned: plan.peak,
        peak_measured,
        process: ProcessMemory::of(&plan, &setup.model),
        peak_rss_bytes: peak_rss_bytes(),
        tokens_per_s: setup.shape.tokens() as f64 / step_s,
        step_s_median: step_s,
        losses: steps.iter().map(|s| s.loss).collect(),
        steps,
    };
    check_scale(&report, &plan, args)?;
    Ok(report)
}

/// The first `NvmeOffload` plan that fits: checkpoints on the host if that fits, else on
/// NVMe too (ZeRO-Infinity's choice for the largest models); and where they are.
fn scale_plan(
    args: &StepArgs,
    setup: &Setup,
    budgets: Budgets,
) -> Result<(Plan, Tier), Box<dyn std::error::Error>> {
    let input = PlanInput {
        model: &setup.model,
        shape: setup.shape,
        budgets,
        cost: Default::default(),
    };
    let mut refusal = None;
    for checkpoints in [Tier::Host, Tier::Nvme] {
        let plan = Plan::build(
            &input,
            &NvmeOffload {
                depth: args.depth,
                checkpoints,
            },
        )?;
        match plan.check_fits(&input) {
            Ok(()) => return Ok((plan, checkpoints)),
            Err(e) => refusal = Some(e),
        }
    }
    Err(refusal.expect("a refusal when nothing fits").into())
}

/// What the scale run trains, and its plan: `checkpoints` where its checkpoints live,
/// `host_budget` the budget it fits.
fn print_scale_header(
    args: &StepArgs,
    setup: &Setup,
    plan: &Plan,
    (checkpoints, host_budget): (Tier, u64),
    state_bytes: u64,
) {
    let config = &setup.desc;
    println!(
        "bench step --scale: {} {} ({} params), training state {} ({} \
         B/param: working {} params, fp32 master, Adam m and v) = {:.2}x the host budget {}; \
         {} with checkpoints on {checkpoints}{}, planned peak: device {}, host {}, nvme {}",
        config.family,
        config.name,
        config.params,
        format_bytes(state_bytes),
        setup.shape.precision.param_bytes() + 12,
        setup.shape.precision,
        state_bytes as f64 / host_budget as f64,
        format_bytes(host_budget),
        plan.policy,
        match (args.clip > 0.0, plan.spilled()) {
            (false, _) => String::new(),
            (true, 0) => format!(", clipping at {}", args.clip),
            (true, n) => format!(
                ", clipping at {}, the gradients of {n} blocks waiting for the norm on NVMe",
                args.clip
            ),
        },
        format_bytes(plan.peak[Tier::Device.index()]),
        format_bytes(plan.peak[Tier::Host.index()]),
        format_bytes(plan.peak[Tier::Nvme.index()]),
    );
}

/// `--steps` steps of `plan` on one batch, every step (the loss must fall); the samples
/// and the measured peaks.
fn scale_steps(
    args: &StepArgs,
    setup: &Setup,
    plan: &Plan,
) -> Result<(Vec<StepSample>, [u64; 3]), Box<dyn std::error::Error>> {
    let mut executor = setup.executor(plan)?;
    let batch = synthetic_batches(setup.desc.vocab, &setup.shape, args.seed, 0);
    let mut steps = Vec::new();
    for s in 0..args.steps {
        let report = executor.step(&refs(&batch), &setup.step_params)?;
        eprintln!(
            "  step {}/{}: {:.3} s, loss {:.4}",
            s + 1,
            args.steps,
            report.seconds,
            report.loss
        );
        steps.push(StepSample::from(&report));
    }
    Ok((steps, executor.peak_measured()))
}

/// Prints what the scale run reached, and refuses one that broke a claim: its host peak
/// over the plan's, its resident peak over its planned process memory, or a loss that
/// did not fall.
fn check_scale(
    report: &ScaleReport,
    plan: &Plan,
    args: &StepArgs,
) -> Result<(), Box<dyn std::error::Error>> {
    let (host, device) = (Tier::Host.index(), Tier::Device.index());
    let (first, last) = (report.losses[0], report.losses[report.losses.len() - 1]);
    let peak_measured = report.peak_measured;
    println!(
        "{} steps: {:.1} tokens/s ({:.3} s/step, median after {} warm-up), loss {first:.4} -> \
         {last:.4}; measured peak: device {}, host {} (budget {})",
        report.steps.len(),
        report.tokens_per_s,
        report.step_s_median,
        args.warmup.min(args.steps - 1),
        format_bytes(peak_measured[device]),
        format_bytes(peak_measured[host]),
        format_bytes(report.host_budget_bytes)
    );
    // On the CPU device the device tier is host memory too: say what RAM the run held.
    let ram = plan.peak[device] + plan.peak[host];
    println!(
        "RAM planned for the device and host tiers together: {} (the training state is {:.2}x that)",
        format_bytes(ram),
        report.state_bytes as f64 / ram as f64
    );
    println!("{}", process_line(&report.process, report.peak_rss_bytes));
    if peak_measured[host] > plan.peak[host] {
        return Err(format!(
            "measured host peak {} exceeds the plan's {} (invariant 2): a bug",
            format_bytes(peak_measured[host]),
            format_bytes(plan.peak[host])
        )
        .into());
    }
    if let Some(rss) = report
        .peak_rss_bytes
        .filter(|&rss| rss > report.process.allowed_bytes())
    {
        return Err(format!(
            "the process's resident peak {} exceeds its planned process memory and 2% ({}): \
             memory the plan does not count, a bug",
            format_bytes(rss),
            format_bytes(report.process.allowed_bytes())
        )
        .into());
    }
    if args.steps > 1 && (last >= first || last.is_nan()) {
        return Err(format!(
            "the loss did not fall on a repeated batch ({first} -> {last}): training is broken"
        )
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_head_is_the_compute_lanes_idle_time_before_the_first_layers_forward() {
        use strata_engine::device::KernelTimes;
        use strata_engine::exec::OpRecord;
        use strata_engine::plan::OpLabel;
        let op = |what, block, lane, start_ns, end_ns| OpRecord {
            label: OpLabel { what, block },
            lane,
            start_ns,
            end_ns,
            bytes: 0,
        };
        let report = StepReport {
            loss: 0.0,
            grad_norm: 0.0,
            skipped: false,
            updated: true,
            seconds: 1e-6,
            lane_busy: [0.0; Lane::COUNT],
            compute_stall: 0.0,
            link_bytes: [0; 4],
            fixed_chunks: [0; 2],
            records: vec![
                op("h2d", None, Lane::H2d, 0, 400),
                op("fwd", Some(0), Lane::Compute, 100, 200),
                op("fwd", Some(1), Lane::Compute, 450, 600),
                op("fwd", Some(2), Lane::Compute, 700, 800),
            ],
            kernels: KernelTimes::default(),
            head_fetch: (0.0, [0; 4]),
        };
        let sample = StepSample::from(&report);
        // Idle 0-100 and 200-450; the gap before block 2 is not the head's.
        assert_eq!((sample.head_s * 1e9).round(), 350.0);
        assert_eq!((sample.tail_s * 1e9).round(), 200.0);
    }

    #[test]
    fn synthetic_batches_are_deterministic_shifted_and_in_range() {
        let shape = StepShape {
            grad_accum: 2,
            ..StepShape::cpu(2, 8)
        };
        let a = synthetic_batches(50, &shape, 3, 1);
        assert_eq!(a, synthetic_batches(50, &shape, 3, 1));
        assert_ne!(a, synthetic_batches(50, &shape, 3, 2));
        assert_eq!(a.len(), 2);
        for (t, y) in &a {
            assert_eq!(t.len(), 16);
            assert_eq!(t[1..], y[..15]);
            assert!(t.iter().chain(y).all(|&id| id < 50));
        }
    }

    #[test]
    fn policy_names_parse_and_name_their_depth() {
        use clap::ValueEnum;
        let p = BuiltinPolicy::from_str("nvme-offload", false).unwrap();
        assert_eq!(p.policy(3).name(), "nvme-offload(depth 3)");
        assert_eq!(
            BuiltinPolicy::from_str("all-on-device", false)
                .unwrap()
                .policy(2)
                .name(),
            "all-on-device"
        );
        let args = <StepArgs as clap::Args>::augment_args(clap::Command::new("step"))
            .try_get_matches_from(["step"])
            .unwrap();
        let args = <StepArgs as clap::FromArgMatches>::from_arg_matches(&args).unwrap();
        assert_eq!(
            args.policies,
            BuiltinPolicy::ALL,
            "every built-in by default"
        );
    }
}
