//! `strata plan`: will this model train on this machine, and how? For the configuration
//! `strata train` would run (same flags and config file), plans one step under every
//! built-in policy and prints the bytes per tier and tensor class, each plan's peak per
//! tier against the budgets, how many layers it recomputes in the backward (as
//! `--recompute` asks), with several micro-batches the order they take through the
//! blocks (as `--schedule` asks), its predicted step time, and the policy `auto` picks. It
//! allocates nothing, so a 13B model is answered in well under a second. `--json FILE`
//! writes the same answer for scripts; the command fails (exit 1) when no policy fits.
//!
//! `--ranks N` plans the step as one of N ranks of ZeRO-3 data parallelism (`mpirun -np
//! N strata train`): the peaks are one rank's, the step time includes the collective
//! lane, and a policy the planner refuses with ranks would be listed as not available,
//! with the planner's reason (none is today: every built-in runs with ranks).
//!
//! [`report`] finds the answers (as data: the Python module returns them as a dict);
//! [`render`] prints them as the command does.

use std::collections::BTreeMap;
use std::io::Write;

use serde::Serialize;
use strata_engine::Lane;
use strata_engine::device::{DeviceChoice, choose_target};
use strata_engine::model::{ApproxBackward, Dtype, Model, Target, quant_base};
use strata_engine::plan::{
    Auto, BuiltinPolicy, CostModel, DEFAULT_SOURCE, Plan, PlanError, PlanInput, Prediction,
    TensorClass, Tier, fmt_bytes,
};

use crate::model_source::run_model;
use crate::process_memory::{ProcessMemory, Reads};
use crate::report::{Table, write_json};
use crate::run_setup::{budgets_of, prefetch_depth, shape_of};
use crate::train_config::{PlanArgs, TrainConfig};

type Error = Box<dyn std::error::Error>;

/// Everything `strata plan` answers.
#[derive(Debug, Clone, Serialize)]
pub struct PlanReport {
    /// The model as named (a preset, a shape or a directory).
    pub model: String,
    /// Its parameter count.
    pub params: u64,
    /// With `--lora`: the adapters' parameters (those that train), and the adapter's
    /// settings in words; the rest is the frozen base.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraReport>,
    /// Its shape, in words.
    pub description: String,
    /// Its layer blocks.
    pub layers: usize,
    /// Gradients and AdamW state of the parameters that train (all of them but a LoRA
    /// model's frozen base): 16 bytes per parameter with fp32 moments (4 of gradients,
    /// 12 of master parameters, m and v), fewer with compact ones.
    pub training_state_bytes: u64,
    /// Disk space of one checkpoint (`--checkpoint-dir` holds `--keep-checkpoints` of
    /// them and the one being written); saving and resuming hold a block's state at a
    /// time in RAM. A LoRA run's holds its adapters' state alone.
    pub checkpoint_bytes: u64,
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Micro-batches per step.
    pub grad_accum: usize,
    /// The working precision.
    pub precision: String,
    /// How AdamW's moments are kept: fp32, bf16 or q8.
    pub optimizer_state: String,
    /// Ranks of ZeRO-3 data parallelism the step is planned for (1: one process). Bytes
    /// are per rank; step times and tokens per second are the whole job's.
    pub ranks: usize,
    /// Which layers recompute their forward in the backward, as asked: auto, all, none,
    /// offload.
    pub recompute: String,
    /// The order of the micro-batches through the blocks, as asked: auto, horizontal,
    /// vertical.
    pub schedule: String,
    /// Budgets per tier, in bytes: device, host, NVMe.
    pub budgets: TierBytes,
    /// The folders of the NVMe tier.
    pub nvme_dirs: Vec<String>,
    /// Where the NVMe budget comes from: stated, or 90% of those folders' free space.
    pub nvme_budget_source: String,
    /// The rates the predictions use.
    pub rates: Rates,
    /// One row per built-in policy the planner accepts for this step.
    pub policies: Vec<PolicyRow>,
    /// The built-in policies the planner refuses for this step (with ranks: those that
    /// keep gradients or optimizer state on the device), with its reason.
    pub unavailable: Vec<Unavailable>,
    /// What `auto` picks (none when nothing fits).
    pub auto: Option<AutoChoice>,
    /// Why nothing fits, when nothing does.
    pub no_fit: Option<String>,
    /// What the backward approximates (`--approx-backward`): exact, or a list.
    pub approx_backward: String,
    /// With an approximate backward, the same step with the exact one, for comparison.
    pub exact_backward: Option<ExactBackward>,
}

/// The step planned with the exact backward, beside an approximate one.
#[derive(Debug, Clone, Serialize)]
pub struct ExactBackward {
    /// Bytes a kept layer saves for its backward (one micro-batch's): exact, approximate.
    pub saved_bytes_per_layer: [u64; 2],
    /// What `auto` picks with the exact backward (none when nothing fits).
    pub auto: Option<ExactChoice>,
}

/// `auto`'s choice for the exact backward, in brief.
#[derive(Debug, Clone, Serialize)]
pub struct ExactChoice {
    /// The policy.
    pub policy: String,
    /// Layer blocks that recompute their forward ("3 of 12 blocks").
    pub recomputed: String,
    /// Predicted seconds per step.
    pub step_seconds: f64,
    /// The plan's peak per tier.
    pub peak_bytes: TierBytes,
}

/// Bytes per tier.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct TierBytes {
    /// GPU (or simulated device) memory.
    pub device: u64,
    /// Pinned host memory.
    pub host: u64,
    /// The NVMe tier.
    pub nvme: u64,
}

impl TierBytes {
    fn of(bytes: [u64; 3]) -> Self {
        TierBytes {
            device: bytes[0],
            host: bytes[1],
            nvme: bytes[2],
        }
    }
}

/// The cost model's rates.
#[derive(Debug, Clone, Serialize)]
pub struct Rates {
    /// Where they come from.
    pub source: String,
    /// Compute, FLOP/s.
    pub compute_flops: f64,
    /// NVMe reads, bytes/s.
    pub nvme_read_bytes_per_s: f64,
    /// NVMe writes, bytes/s.
    pub nvme_write_bytes_per_s: f64,
    /// Host-device copies, bytes/s.
    pub copy_bytes_per_s: f64,
    /// CPU AdamW, parameters/s.
    pub adam_params_per_s: f64,
    /// Collectives among ranks, bytes each rank's all-gather gathers (or reduce-scatter
    /// sends) per second.
    pub collective_bytes_per_s: f64,
}

/// One policy's plan.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyRow {
    /// The policy's name.
    pub policy: String,
    /// Whether the plan fits the budgets.
    pub fits: bool,
    /// The tiers whose budget it exceeds (none when it fits).
    pub short: Vec<String>,
    /// Its peak per tier.
    pub peak_bytes: TierBytes,
    /// The order of its micro-batches through the blocks: horizontal or vertical.
    pub schedule: String,
    /// Layer blocks that recompute their forward in the backward.
    pub recomputed_blocks: usize,
    /// Bytes of the saved activations the other layer blocks keep on the device.
    pub saved_activation_bytes: u64,
    /// Layer blocks whose saved activations are offloaded between their forward and
    /// backward (to host memory or NVMe).
    pub offloaded_blocks: usize,
    /// Bytes of their saved activations (one micro-batch's).
    pub offloaded_activation_bytes: u64,
    /// Blocks whose gradients wait for the clipping norm on NVMe (`--spill-grads`).
    pub spilled_blocks: usize,
    /// Whether the first and last blocks' optimizer state stays in host memory, and
    /// their parameters off NVMe, while the others' are on NVMe
    /// (`Policy::resident_edges`).
    pub edges_on_host: bool,
    /// Where those blocks' parameters and state are, in words, when they stay off NVMe.
    pub edges: Option<String>,
    /// Its NVMe peak over the parameter count.
    pub nvme_bytes_per_param: f64,
    /// Planned bytes per step over NVMe read, NVMe write, H2D and D2H, over the step's
    /// tokens (this rank's).
    pub link_bytes_per_token: [f64; 4],
    /// Planned NVMe bytes read and written per step over the parameter count.
    pub nvme_traffic_bytes_per_param: f64,
    /// The RAM a process running it is planned to hold: its arenas in RAM, block
    /// staging, and the fixed overhead.
    pub process: ProcessMemory,
    /// Its NVMe peak times the ranks: what the ranks' swap files hold together.
    pub nvme_bytes_all_ranks: u64,
    /// Predicted seconds per step.
    pub step_seconds: f64,
    /// Predicted seconds per step the collective lane is busy (0 with one rank).
    pub collective_seconds: f64,
    /// Predicted tokens per second, every rank's.
    pub tokens_per_s: f64,
}

/// A built-in policy the planner refuses for this step.
#[derive(Debug, Clone, Serialize)]
pub struct Unavailable {
    /// The policy's name.
    pub policy: String,
    /// Why, as the planner says it.
    pub reason: String,
}

/// The plan `auto` picks.
#[derive(Debug, Clone, Serialize)]
pub struct AutoChoice {
    /// The policy.
    pub policy: String,
    /// How many candidates were planned.
    pub candidates: usize,
    /// The order of its micro-batches through the blocks: horizontal or vertical.
    pub schedule: String,
    /// Predicted seconds per step.
    pub step_seconds: f64,
    /// All-on-device compute time over the step time.
    pub overlap_efficiency: f64,
    /// Predicted busy seconds per step of each lane, by the lane's name (`compute`,
    /// `h2d`, `collective`, ...).
    pub lane_seconds: BTreeMap<String, f64>,
    /// Bytes of each tensor class per tier.
    pub by_class: Vec<ClassRow>,
    /// The device working set (one block's activations).
    pub scratch_bytes: u64,
    /// The plan's peak per tier.
    pub peak_bytes: TierBytes,
    /// Layer blocks that recompute their forward in the backward, of how many
    /// ("3 of 12 blocks").
    pub recomputed: String,
    /// Bytes of the saved activations the other layer blocks keep on the device.
    pub saved_activation_bytes: u64,
    /// Bytes of the saved activations offloaded to host memory (one micro-batch's).
    pub offloaded_host_bytes: u64,
    /// Bytes of the saved activations offloaded to NVMe (one micro-batch's).
    pub offloaded_nvme_bytes: u64,
    /// The RAM a process running it is planned to hold (what `train`'s summary measures
    /// VmHWM against).
    pub process: ProcessMemory,
}

/// One tensor class's bytes per tier.
#[derive(Debug, Clone, Serialize)]
pub struct ClassRow {
    /// The class, in words.
    pub class: String,
    /// Bytes per tier.
    pub bytes: TierBytes,
}

/// Each lane's busy seconds in `p`, by the lane's name.
fn lane_seconds(p: &Prediction) -> BTreeMap<String, f64> {
    Lane::ALL
        .iter()
        .map(|lane| (lane.to_string(), p.lane_seconds[lane.index()]))
        .collect()
}

/// Plans the step `cfg` describes, as one of `ranks` ranks, under every built-in policy
/// and under `auto`.
pub fn report(cfg: &TrainConfig, ranks: usize) -> Result<PlanReport, Error> {
    if ranks == 0 {
        return Err(
            "--ranks 0: a step needs at least one rank; give the number of \
                    processes `mpirun -np N strata train` would start (1: one process)"
                .into(),
        );
    }
    let model = run_model(cfg)?;
    // A plan for a GPU needs no GPU here: `--device cuda` plans for CUDA's kernels.
    let target = match cfg.device {
        DeviceChoice::Cuda => Target::Cuda,
        choice => choose_target(choice)?,
    };
    let run_budgets = budgets_of(cfg, target)?;
    let budgets = run_budgets.budgets;
    let shape = shape_of(cfg, target).with_ranks(ranks);
    let cost = CostModel::default();
    let input = PlanInput::new(&model, shape, budgets).with_cost(cost);
    let params = model.param_count() as u64;
    let lora = lora_report(&model, shape.precision.dtype());
    let trained = lora.as_ref().map_or(params, |l| l.trained_params);
    // Whether the run writes the model (`--out`) is not a step's shape: counted, as a
    // run that may; evaluating is, where a `--config` file asks for it.
    let reads = Reads {
        writes: true,
        evaluates: cfg.eval_every > 0,
    };
    let (policies, unavailable) = policy_rows(&input, cost, prefetch_depth(cfg), reads)?;
    let choice = auto_choice(&input, cost, reads);
    let exact_backward = exact_backward(&input, reads)?;
    Ok(PlanReport {
        model: cfg.model.to_string(),
        params,
        description: model.describe(),
        layers: model.layers(),
        lora,
        training_state_bytes: ((4.0 + shape.optimizer_state.bytes_per_param()) * trained as f64)
            as u64,
        // A LoRA run's holds the adapters' state alone.
        checkpoint_bytes: strata_engine::checkpoint::needed_bytes(&model, 0),
        batch: shape.batch,
        seq: shape.seq,
        grad_accum: shape.grad_accum,
        precision: shape.precision.to_string(),
        optimizer_state: shape.optimizer_state.to_string(),
        ranks,
        recompute: shape.recompute.to_string(),
        schedule: shape.schedule.to_string(),
        budgets: TierBytes {
            device: budgets.device,
            host: budgets.host,
            nvme: budgets.nvme,
        },
        nvme_dirs: run_budgets
            .nvme_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect(),
        nvme_budget_source: run_budgets.nvme_source(),
        rates: Rates::of(&cost, target),
        policies,
        unavailable,
        no_fit: choice.as_ref().err().cloned(),
        auto: choice.ok(),
        approx_backward: model.approximation().to_string(),
        exact_backward,
    })
}

/// With an approximate backward, what a kept layer saves with it and with the exact one,
/// and `auto`'s choice with the exact one; none with the exact backward.
fn exact_backward(input: &PlanInput<'_>, reads: Reads) -> Result<Option<ExactBackward>, Error> {
    let model = input.model;
    if model.approximation().is_exact() || model.layers() == 0 {
        return Ok(None);
    }
    let exact = model.approximate(ApproxBackward::EXACT)?;
    let shape = input.shape;
    let dims = model.shape(shape.batch, shape.seq)?;
    let (target, dtype) = (shape.target, shape.device_dtype());
    let saved = |m: &Model| m.family().saved_bytes(1, dims, target, dtype) as u64;
    let exact_input = PlanInput {
        model: &exact,
        ..*input
    };
    let auto = auto_choice(&exact_input, input.cost, reads)
        .ok()
        .map(|a| ExactChoice {
            policy: a.policy,
            recomputed: a.recomputed,
            step_seconds: a.step_seconds,
            peak_bytes: a.peak_bytes,
        });
    Ok(Some(ExactBackward {
        saved_bytes_per_layer: [saved(&exact), saved(model)],
        auto,
    }))
}

impl Rates {
    /// The rates `cost` ranks plans for `target` with, and where they come from: the
    /// defaults are CPU rates, which a CUDA plan is ranked with too until a GPU's rates
    /// are recorded.
    fn of(cost: &CostModel, target: Target) -> Self {
        let source = if target == Target::Cuda && cost.source == DEFAULT_SOURCE {
            format!(
                "{DEFAULT_SOURCE} for the CPU; no GPU's rates are recorded yet, so CUDA plans are ranked with them"
            )
        } else {
            cost.source.to_string()
        };
        Rates {
            source,
            compute_flops: cost.compute_flops,
            nvme_read_bytes_per_s: cost.nvme_read_bytes_per_s,
            nvme_write_bytes_per_s: cost.nvme_write_bytes_per_s,
            copy_bytes_per_s: cost.h2d_bytes_per_s,
            adam_params_per_s: cost.adam_params_per_s,
            collective_bytes_per_s: cost.collective_bytes_per_s,
        }
    }
}

/// A row per built-in policy (prefetching `depth` blocks ahead where it streams), and the
/// policies the planner refuses for this step with ranks.
fn policy_rows(
    input: &PlanInput<'_>,
    cost: CostModel,
    depth: usize,
    reads: Reads,
) -> Result<(Vec<PolicyRow>, Vec<Unavailable>), Error> {
    let ranks = input.shape.ranks;
    let mut rows = Vec::new();
    let mut unavailable = Vec::new();
    for builtin in BuiltinPolicy::ALL {
        let policy = builtin.policy(depth);
        match Plan::build(input, policy.as_ref()) {
            Ok(plan) => rows.push(policy_row(input, cost, &plan, reads)),
            // With ranks the planner refuses gradients and optimizer state on the
            // device: an answer about this policy, not a failure of the command.
            // So does compact optimizer state, which the device's AdamW does not keep.
            Err(PlanError::BadPolicy { policy, reason })
                if ranks > 1
                    || !input.shape.optimizer_state.is_fp32()
                    || input.model.lora_config().is_some() =>
            {
                unavailable.push(Unavailable { policy, reason });
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok((rows, unavailable))
}

/// A LoRA model's adapter, as the plan reports it.
#[derive(Debug, Clone, Serialize)]
pub struct LoraReport {
    /// Parameters that train: the adapters'.
    pub trained_params: u64,
    /// Rank, alpha and targets, as `--lora` flags name them.
    pub settings: String,
    /// With `--quant`: how the frozen base is stored.
    pub base: Option<QuantReport>,
}

/// A quantised base (`--quant`), as the plan reports it.
#[derive(Debug, Clone, Serialize)]
pub struct QuantReport {
    /// The format (`nf4`, `int8`).
    pub format: String,
    /// Parameters quantised: the transformer layers' linear weights.
    pub quantised_params: u64,
    /// Bytes of the frozen base as a home off the device holds it: each adapted layer's
    /// packed image, the rest of the base in the working dtype (planned).
    pub stored_bytes: u64,
    /// Bytes of the same base unquantised, in the working dtype.
    pub plain_bytes: u64,
}

/// `model`'s quantised base, stored off the device in working parameters of `dtype`.
fn quant_report(model: &Model, dtype: Dtype) -> Option<QuantReport> {
    let quant = model.base_quant()?;
    let (mut quantised, mut stored, mut plain) = (0, 0, 0);
    for (b, block) in model.blocks().iter().enumerate() {
        let frozen = block.frozen as u64 * dtype.size() as u64;
        plain += frozen;
        stored += model
            .quant_block(b, dtype)
            .map_or(frozen, |q| q.bytes() as u64);
        quantised += block
            .tensors
            .iter()
            .filter(|t| quant_base::is_quantised(block, t))
            .map(|t| t.slot.len as u64)
            .sum::<u64>();
    }
    Some(QuantReport {
        format: quant.to_string(),
        quantised_params: quantised,
        stored_bytes: stored,
        plain_bytes: plain,
    })
}

/// `model`'s adapter, when it is a LoRA model (its base stored off the device in working
/// parameters of `dtype`).
fn lora_report(model: &Model, dtype: Dtype) -> Option<LoraReport> {
    let config = model.family().lora_config()?;
    Some(LoraReport {
        base: quant_report(model, dtype),
        trained_params: model.trained_param_count() as u64,
        settings: format!(
            "rank {}, alpha {}, on {}",
            config.rank,
            config.alpha,
            config.targets.join(",")
        ),
    })
}

/// `plan`'s row: whether it fits, its peaks, and what the cost model predicts.
fn policy_row(input: &PlanInput<'_>, cost: CostModel, plan: &Plan, reads: Reads) -> PolicyRow {
    let ranks = input.shape.ranks as u64;
    let params = input.model.param_count() as f64;
    let nvme = plan.peak[Tier::Nvme.index()];
    let p = cost.predict(plan);
    let short: Vec<String> = plan.short_tiers().map(|t| t.to_string()).collect();
    PolicyRow {
        policy: plan.policy.clone(),
        fits: short.is_empty(),
        short,
        peak_bytes: TierBytes::of(plan.peak),
        schedule: plan.shape.schedule.to_string(),
        recomputed_blocks: plan.recomputed(),
        saved_activation_bytes: plan.saved_total_bytes(),
        offloaded_blocks: plan.offloaded(),
        offloaded_activation_bytes: offloaded_bytes(plan),
        spilled_blocks: plan.spilled(),
        edges_on_host: plan.edges_on_host(),
        edges: plan.edges_text(),
        nvme_bytes_per_param: nvme as f64 / params,
        link_bytes_per_token: plan
            .link_bytes
            .map(|b| b as f64 / input.shape.tokens() as f64),
        nvme_traffic_bytes_per_param: (plan.link_bytes[0] + plan.link_bytes[1]) as f64 / params,
        process: ProcessMemory::of_run(plan, input.model, reads),
        nvme_bytes_all_ranks: nvme * ranks,
        step_seconds: p.step_seconds,
        collective_seconds: p.lane_seconds[Lane::Comm.index()],
        tokens_per_s: (input.shape.tokens() * ranks) as f64 / p.step_seconds,
    }
}

/// The plan `auto` picks, or why none fits.
fn auto_choice(input: &PlanInput<'_>, cost: CostModel, reads: Reads) -> Result<AutoChoice, String> {
    let (_, plan, candidates) = (Auto { cost }).choose(input).map_err(|e| e.to_string())?;
    let p = cost.predict(&plan);
    let by_class = plan
        .bytes_by_class()
        .into_iter()
        .map(|(class, bytes)| ClassRow {
            class: match class {
                TensorClass::Params => "working params",
                TensorClass::Grads => "gradients",
                TensorClass::Optimizer => "master params + Adam m, v",
                TensorClass::Checkpoints => "activation checkpoints",
            }
            .to_string(),
            bytes: TierBytes::of(bytes),
        })
        .collect();
    Ok(AutoChoice {
        policy: plan.policy.clone(),
        candidates: candidates.len(),
        schedule: plan.shape.schedule.to_string(),
        step_seconds: p.step_seconds,
        overlap_efficiency: p.overlap_efficiency(),
        lane_seconds: lane_seconds(&p),
        by_class,
        scratch_bytes: plan.buffer(plan.scratch).bytes,
        peak_bytes: TierBytes::of(plan.peak),
        recomputed: plan.recomputed_of(),
        saved_activation_bytes: plan.saved_total_bytes(),
        offloaded_host_bytes: plan.saved_in(Tier::Host),
        offloaded_nvme_bytes: plan.saved_in(Tier::Nvme),
        process: ProcessMemory::of_run(&plan, input.model, reads),
    })
}

/// The report as `strata plan` prints it.
pub fn render(r: &PlanReport) -> String {
    let mut out = render_header(r);
    out += &render_policies(r);
    match (&r.auto, &r.no_fit) {
        (Some(auto), _) => out += &render_auto(r, auto),
        (None, e) => out += &format!("\nno plan fits: {}\n", e.as_deref().unwrap_or("")),
    }
    out
}

/// The model, the step, the ranks and the rates.
fn render_header(r: &PlanReport) -> String {
    let mut out = String::new();
    let b = &r.budgets;
    out += &format!(
        "model {}: {:.3} B params, {}; training state {} ({} B/param)\n",
        r.model,
        r.params as f64 / 1e9,
        r.description,
        fmt_bytes(r.training_state_bytes),
        format!(
            "{:.2}",
            r.training_state_bytes as f64
                / r.lora.as_ref().map_or(r.params, |l| l.trained_params) as f64
        )
        .trim_end_matches('0')
        .trim_end_matches('.')
    );
    if let Some(l) = &r.lora {
        out += &format!(
            "LoRA ({}): {} trained parameters ({:.3}% of the model), the training state \
             theirs; the base is frozen (no gradients, no optimizer state, no write-back)\n",
            l.settings,
            l.trained_params,
            100.0 * l.trained_params as f64 / r.params as f64
        );
        if let Some(q) = &l.base {
            out += &format!(
                "base stored as {}: {:.3} B parameters quantised (the layers' linear weights), \
                 {} off the device instead of {} (planned), dequantised on the device before \
                 use; a device home holds it dequantised\n",
                q.format,
                q.quantised_params as f64 / 1e9,
                fmt_bytes(q.stored_bytes),
                fmt_bytes(q.plain_bytes)
            );
        }
    }
    out += &format!(
        "checkpoint: {} on disk each (parameters, m, v); --checkpoint-dir holds \
         --keep-checkpoints of them and the one being written, checked against free space \
         before step 1\n",
        fmt_bytes(r.checkpoint_bytes)
    );
    out += &format!(
        "step: {} x {} tokens x {} micro-batches, {}, {} moments, --recompute {}{}; budgets: device {}, host {}, nvme {} ({})\n",
        r.batch,
        r.seq,
        r.grad_accum,
        r.precision,
        r.optimizer_state,
        r.recompute,
        if r.grad_accum > 1 {
            format!(", --schedule {}", r.schedule)
        } else {
            String::new()
        },
        fmt_bytes(b.device),
        fmt_bytes(b.host),
        fmt_bytes(b.nvme),
        r.nvme_budget_source
    );
    let n = r.ranks;
    let ranked = n > 1;
    if ranked {
        out += &format!(
            "ranks: {n}, ZeRO-3 as `mpirun -np {n} strata train` runs it: each rank owns 1/{n} of \
             every block's parameters, gradients and optimizer state and runs {} of the step's \
             {} micro-batches. Budgets and peaks are per rank; `nvme x{n}` is the {n} ranks' \
             NVMe together; s/step and tokens/s are the job's\n",
            r.grad_accum,
            r.grad_accum * n
        );
    }
    let rates = &r.rates;
    out += &format!(
        "rates ({}): {:.0} GFLOP/s compute, NVMe {:.1}/{:.1} GB/s read/write, copies {:.1} GB/s, AdamW {:.2} G params/s{}\n\n",
        rates.source,
        rates.compute_flops / 1e9,
        rates.nvme_read_bytes_per_s / 1e9,
        rates.nvme_write_bytes_per_s / 1e9,
        rates.copy_bytes_per_s / 1e9,
        rates.adam_params_per_s / 1e9,
        if ranked {
            format!(
                ", collectives {:.1} GB/s",
                rates.collective_bytes_per_s / 1e9
            )
        } else {
            String::new()
        }
    );
    out
}

/// The table of policies, then what each keeps off NVMe, spills, or cannot do.
fn render_policies(r: &PlanReport) -> String {
    let mut out = policies_table(r);
    for row in r.policies.iter() {
        if let Some(edges) = &row.edges {
            out += &format!("{}: {edges}\n", row.policy);
        }
    }
    for row in r.policies.iter().filter(|row| row.spilled_blocks > 0) {
        out += &format!(
            "{}: the gradients of {} blocks wait for the clipping norm on NVMe, not in host \
             memory (--spill-grads)\n",
            row.policy, row.spilled_blocks
        );
    }
    for u in &r.unavailable {
        out += &format!(
            "{} is not available for this step: {}\n",
            u.policy, u.reason
        );
    }
    out
}

/// A row per policy; with ranks, two more columns: the ranks' NVMe together, and the
/// collective lane; with several micro-batches, the order they take.
fn policies_table(r: &PlanReport) -> String {
    let n = r.ranks;
    let ranked = n > 1;
    let accumulates = r.grad_accum > 1;
    let mut headers = vec!["policy", "fits", "device", "host", "nvme"];
    let nvme_all = format!("nvme x{n}");
    if ranked {
        headers.push(&nvme_all);
    }
    if accumulates {
        headers.push("schedule");
    }
    headers.extend([
        "recompute",
        "nvme r+w B/param",
        "B/token nvme r/w, h2d/d2h",
        "s/step",
    ]);
    if ranked {
        headers.push("collective s");
    }
    headers.push("tokens/s");
    let columns = headers.len();
    let mut table = Table::new(headers);
    for row in &r.policies {
        let mut cells = vec![
            row.policy.clone(),
            if row.fits {
                "yes".to_string()
            } else {
                format!("no: {}", row.short.join(", "))
            },
            fmt_bytes(row.peak_bytes.device),
            fmt_bytes(row.peak_bytes.host),
            fmt_bytes(row.peak_bytes.nvme),
        ];
        if ranked {
            cells.push(fmt_bytes(row.nvme_bytes_all_ranks));
        }
        if accumulates {
            cells.push(row.schedule.clone());
        }
        cells.extend([
            match row.offloaded_blocks {
                0 => format!("{} of {}", row.recomputed_blocks, r.layers),
                n => format!("{} of {}, {n} offloaded", row.recomputed_blocks, r.layers),
            },
            format!("{:.2}", row.nvme_traffic_bytes_per_param),
            {
                let t = row
                    .link_bytes_per_token
                    .map(|b| fmt_bytes(b.round() as u64));
                format!("{}/{}, {}/{}", t[0], t[1], t[2], t[3])
            },
            format!("{:.3}", row.step_seconds),
        ]);
        if ranked {
            cells.push(format!("{:.3}", row.collective_seconds));
        }
        cells.push(format!("{:.0}", row.tokens_per_s));
        table.row(cells);
    }
    for u in &r.unavailable {
        let mut cells = vec![u.policy.clone(), "no: not available".to_string()];
        cells.resize(columns, "-".to_string());
        table.row(cells);
    }
    table.render()
}

/// What `auto` picks: its prediction, and (with ranks) each lane's busy time, then its
/// bytes per tensor class and tier.
fn render_auto(r: &PlanReport, auto: &AutoChoice) -> String {
    let schedule = if r.grad_accum > 1 {
        format!("{} schedule, ", auto.schedule)
    } else {
        String::new()
    };
    let mut out = format!(
        "\nauto picks {} (of {} candidates): {schedule}recompute: {}; predicted {:.3} s/step, overlap efficiency {:.2}\n",
        auto.policy, auto.candidates, auto.recomputed, auto.step_seconds, auto.overlap_efficiency
    );
    if r.ranks > 1 {
        // The lanes overlap: their busy times add up to more than the step.
        let busy: Vec<String> = Lane::ALL
            .iter()
            .map(|lane| lane.to_string())
            .filter_map(|lane| {
                let s = auto.lane_seconds.get(&lane).copied().unwrap_or(0.0);
                (s > 0.0).then(|| format!("{lane} {s:.3}"))
            })
            .collect();
        out += &format!("busy seconds per lane: {}\n", busy.join(", "));
    }
    out += &by_class_table(r, auto);
    out += "(class rows count each class's buffers; buffers with disjoint lifetimes share \
            memory, so the peak can be lower than their sum)\n";
    out += &format!("{}\n", auto.process.line());
    out += &render_exact_backward(r, auto);
    out
}

/// With an approximate backward: what it saves per kept layer, and the exact backward's
/// plan beside this one.
fn render_exact_backward(r: &PlanReport, auto: &AutoChoice) -> String {
    let Some(exact) = &r.exact_backward else {
        return String::new();
    };
    let [e, a] = exact.saved_bytes_per_layer;
    let mut out = format!(
        "--approx-backward {}: a kept layer saves {} for its backward (exact: {}, {:+.1}%)\n",
        r.approx_backward,
        fmt_bytes(a),
        fmt_bytes(e),
        100.0 * (a as f64 / e as f64 - 1.0)
    );
    out += &match &exact.auto {
        Some(x) => format!(
            "with the exact backward, auto picks {}: recompute: {}; predicted {:.3} s/step \
             (this: {:.3}); device peak {} (this: {})\n",
            x.policy,
            x.recomputed,
            x.step_seconds,
            auto.step_seconds,
            fmt_bytes(x.peak_bytes.device),
            fmt_bytes(auto.peak_bytes.device)
        ),
        None => "with the exact backward, no plan fits these budgets\n".to_string(),
    };
    out
}

/// `auto`'s plan: bytes per tensor class and tier, the working set, the peak.
fn by_class_table(r: &PlanReport, auto: &AutoChoice) -> String {
    let n = r.ranks;
    let ranked = n > 1;
    let mut by_class = Table::new(["tensor class", "device", "host", "nvme"]);
    for row in &auto.by_class {
        by_class.row([
            row.class.clone(),
            fmt_bytes(row.bytes.device),
            fmt_bytes(row.bytes.host),
            fmt_bytes(row.bytes.nvme),
        ]);
    }
    by_class.row([
        "device working set (one block's activations)".to_string(),
        fmt_bytes(auto.scratch_bytes),
        "-".into(),
        "-".into(),
    ]);
    by_class.row([
        "saved activations (layers not recomputed)".to_string(),
        fmt_bytes(auto.saved_activation_bytes),
        fmt_bytes(auto.offloaded_host_bytes),
        fmt_bytes(auto.offloaded_nvme_bytes),
    ]);
    by_class.row([
        if ranked { "peak per rank" } else { "peak" }.to_string(),
        fmt_bytes(auto.peak_bytes.device),
        fmt_bytes(auto.peak_bytes.host),
        fmt_bytes(auto.peak_bytes.nvme),
    ]);
    if ranked {
        by_class.row([
            format!("nvme of all {n} ranks"),
            "-".into(),
            "-".into(),
            fmt_bytes(auto.peak_bytes.nvme * n as u64),
        ]);
    }
    let per_param = |bytes: u64| format!("{:.2} B", bytes as f64 / r.params.max(1) as f64);
    by_class.row([
        "peak per parameter".to_string(),
        per_param(auto.peak_bytes.device),
        per_param(auto.peak_bytes.host),
        per_param(auto.peak_bytes.nvme),
    ]);
    by_class.render()
}

/// `strata plan`: prints the report (and writes it as JSON when asked); an error when no
/// policy fits, after the table that shows why.
pub fn run(args: &PlanArgs, out: &mut impl Write) -> Result<(), Error> {
    let cfg = args.resolve()?;
    if args.print_config {
        write!(out, "{}", cfg.to_toml())?;
        return Ok(());
    }
    let r = report(&cfg, args.ranks)?;
    if let Some(path) = &args.json {
        write_json(path, &r).map_err(|e| format!("--json {}: {e}", path.display()))?;
    }
    match &r.no_fit {
        None => {
            write!(out, "{}", render(&r))?;
            Ok(())
        }
        Some(why) => {
            // The table says which tiers each policy is short of; the error says why.
            let text = render(&r);
            let table = text.split("\nno plan fits:").next().unwrap_or(&text);
            writeln!(out, "{table}")?;
            Err(format!("no plan fits: {why}").into())
        }
    }
}

/// Bytes of `plan`'s saved activations offloaded to host memory or NVMe.
fn offloaded_bytes(plan: &Plan) -> u64 {
    plan.saved_in(Tier::Host) + plan.saved_in(Tier::Nvme)
}
