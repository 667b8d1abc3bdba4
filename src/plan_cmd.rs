//! `strata plan`: will this model train on this machine, and how? For the configuration
//! `strata train` would run (same flags and config file), plans one step under every
//! built-in policy and prints the bytes per tier and tensor class, each plan's peak per
//! tier against the budgets, how many layers it recomputes in the backward (as
//! `--recompute` asks), its predicted step time, and the policy `auto` picks. It
//! allocates nothing, so a 13B model is answered in well under a second. `--json FILE`
//! writes the same answer for scripts; the command fails (exit 1) when no policy fits.
//!
//! [`report`] finds the answers (as data: the Python module returns them as a dict);
//! [`render`] prints them as the command does.

use std::io::Write;

use serde::Serialize;
use strata_engine::device::{DeviceChoice, choose_target};
use strata_engine::model::Target;
use strata_engine::plan::{Auto, CostModel, Plan, PlanInput, Policy, TensorClass, Tier, fmt_bytes};

use crate::report::{Table, write_json};
use crate::train::{budgets_of, named_policy, shape_of};
use crate::train_config::{PlanArgs, TrainConfig};

type Error = Box<dyn std::error::Error>;

/// Everything `strata plan` answers.
#[derive(Debug, Clone, Serialize)]
pub struct PlanReport {
    /// The model as named (a preset, a shape or a directory).
    pub model: String,
    /// Its parameter count.
    pub params: u64,
    /// Its shape, in words.
    pub description: String,
    /// Its layer blocks.
    pub layers: usize,
    /// Parameters, gradients and AdamW state at 16 bytes per parameter.
    pub training_state_bytes: u64,
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Micro-batches per step.
    pub grad_accum: usize,
    /// The working precision.
    pub precision: String,
    /// Which layers recompute their forward in the backward, as asked: auto, all, none.
    pub recompute: String,
    /// Budgets per tier, in bytes: device, host, NVMe.
    pub budgets: TierBytes,
    /// The folders of the NVMe tier.
    pub nvme_dirs: Vec<String>,
    /// Where the NVMe budget comes from: stated, or 90% of those folders' free space.
    pub nvme_budget_source: String,
    /// The rates the predictions use.
    pub rates: Rates,
    /// One row per built-in policy.
    pub policies: Vec<PolicyRow>,
    /// What `auto` picks (none when nothing fits).
    pub auto: Option<AutoChoice>,
    /// Why nothing fits, when nothing does.
    pub no_fit: Option<String>,
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
    /// Layer blocks that recompute their forward in the backward.
    pub recomputed_blocks: usize,
    /// Bytes of the saved activations the other layer blocks keep on the device.
    pub saved_activation_bytes: u64,
    /// Its NVMe peak over the parameter count.
    pub nvme_bytes_per_param: f64,
    /// Predicted seconds per step.
    pub step_seconds: f64,
    /// Predicted tokens per second.
    pub tokens_per_s: f64,
}

/// The plan `auto` picks.
#[derive(Debug, Clone, Serialize)]
pub struct AutoChoice {
    /// The policy.
    pub policy: String,
    /// How many candidates were planned.
    pub candidates: usize,
    /// Predicted seconds per step.
    pub step_seconds: f64,
    /// All-on-device compute time over the step time.
    pub overlap_efficiency: f64,
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
}

/// One tensor class's bytes per tier.
#[derive(Debug, Clone, Serialize)]
pub struct ClassRow {
    /// The class, in words.
    pub class: String,
    /// Bytes per tier.
    pub bytes: TierBytes,
}

/// Plans the step `cfg` describes under every built-in policy and under `auto`.
pub fn report(cfg: &TrainConfig) -> Result<PlanReport, Error> {
    let model = crate::train::model_shape(cfg)?;
    // A plan for a GPU needs no GPU here: `--device cuda` plans for CUDA's kernels.
    let target = match crate::train::device_choice(cfg) {
        DeviceChoice::Cuda => Target::Cuda,
        choice => choose_target(choice)?,
    };
    let run_budgets = budgets_of(cfg, target)?;
    let budgets = run_budgets.budgets;
    let shape = shape_of(cfg, target);
    let input = PlanInput {
        model: &model,
        shape,
        budgets,
    };
    let cost = CostModel::default();
    let params = model.param_count() as u64;

    let mut policies: Vec<Box<dyn Policy>> = Vec::new();
    for name in strata_engine::plan::BUILTIN_POLICIES {
        policies.extend(named_policy(name, cfg.prefetch)?);
    }
    let mut rows = Vec::new();
    for policy in &policies {
        let plan = Plan::build(&input, policy.as_ref())?;
        let p = cost.predict(&plan);
        let short: Vec<String> = plan.short_tiers().map(|t| t.to_string()).collect();
        rows.push(PolicyRow {
            policy: plan.policy.clone(),
            fits: short.is_empty(),
            short,
            peak_bytes: TierBytes::of(plan.peak),
            recomputed_blocks: plan.recomputed(),
            saved_activation_bytes: plan.saved_total_bytes(),
            nvme_bytes_per_param: plan.peak[Tier::Nvme.index()] as f64 / params as f64,
            step_seconds: p.step_seconds,
            tokens_per_s: shape.tokens() as f64 / p.step_seconds,
        });
    }
    let choice = match (Auto { cost }).choose(&input) {
        Ok((_, plan, candidates)) => {
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
                step_seconds: p.step_seconds,
                overlap_efficiency: p.overlap_efficiency(),
                by_class,
                scratch_bytes: plan.buffer(plan.scratch).bytes,
                peak_bytes: TierBytes::of(plan.peak),
                recomputed: plan.recomputed_of(),
                saved_activation_bytes: plan.saved_total_bytes(),
            })
        }
        Err(e) => Err(e.to_string()),
    };
    Ok(PlanReport {
        model: cfg.model.to_string(),
        params,
        description: model.describe(),
        layers: model.layers(),
        training_state_bytes: 16 * params,
        batch: shape.batch,
        seq: shape.seq,
        grad_accum: shape.grad_accum,
        precision: shape.precision.to_string(),
        recompute: shape.recompute.to_string(),
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
        rates: Rates {
            source: cost.source.to_string(),
            compute_flops: cost.compute_flops,
            nvme_read_bytes_per_s: cost.nvme_read_bytes_per_s,
            nvme_write_bytes_per_s: cost.nvme_write_bytes_per_s,
            copy_bytes_per_s: cost.h2d_bytes_per_s,
            adam_params_per_s: cost.adam_params_per_s,
        },
        policies: rows,
        no_fit: choice.as_ref().err().cloned(),
        auto: choice.ok(),
    })
}

/// The report as `strata plan` prints it.
pub fn render(r: &PlanReport) -> String {
    let mut out = String::new();
    let b = &r.budgets;
    out += &format!(
        "model {}: {:.3} B params, {}; training state {} (16 B/param)\n",
        r.model,
        r.params as f64 / 1e9,
        r.description,
        fmt_bytes(r.training_state_bytes)
    );
    out += &format!(
        "step: {} x {} tokens x {} micro-batches, {}, --recompute {}; budgets: device {}, host {}, nvme {} ({})\n",
        r.batch,
        r.seq,
        r.grad_accum,
        r.precision,
        r.recompute,
        fmt_bytes(b.device),
        fmt_bytes(b.host),
        fmt_bytes(b.nvme),
        r.nvme_budget_source
    );
    let rates = &r.rates;
    out += &format!(
        "rates ({}): {:.0} GFLOP/s compute, NVMe {:.1}/{:.1} GB/s read/write, copies {:.1} GB/s, AdamW {:.2} G params/s\n\n",
        rates.source,
        rates.compute_flops / 1e9,
        rates.nvme_read_bytes_per_s / 1e9,
        rates.nvme_write_bytes_per_s / 1e9,
        rates.copy_bytes_per_s / 1e9,
        rates.adam_params_per_s / 1e9
    );
    let mut table = Table::new([
        "policy",
        "fits",
        "device",
        "host",
        "nvme",
        "recompute",
        "s/step",
        "tokens/s",
    ]);
    for row in &r.policies {
        table.row([
            row.policy.clone(),
            if row.fits {
                "yes".to_string()
            } else {
                format!("no: {}", row.short.join(", "))
            },
            fmt_bytes(row.peak_bytes.device),
            fmt_bytes(row.peak_bytes.host),
            fmt_bytes(row.peak_bytes.nvme),
            format!("{} of {}", row.recomputed_blocks, r.layers),
            format!("{:.3}", row.step_seconds),
            format!("{:.0}", row.tokens_per_s),
        ]);
    }
    out += &table.render();
    match (&r.auto, &r.no_fit) {
        (Some(auto), _) => {
            out += &format!(
                "\nauto picks {} (of {} candidates): recompute: {}; predicted {:.3} s/step, overlap efficiency {:.2}\n",
                auto.policy,
                auto.candidates,
                auto.recomputed,
                auto.step_seconds,
                auto.overlap_efficiency
            );
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
                "-".into(),
                "-".into(),
            ]);
            by_class.row([
                "peak".to_string(),
                fmt_bytes(auto.peak_bytes.device),
                fmt_bytes(auto.peak_bytes.host),
                fmt_bytes(auto.peak_bytes.nvme),
            ]);
            let per_param = |bytes: u64| format!("{:.2} B", bytes as f64 / r.params.max(1) as f64);
            by_class.row([
                "peak per parameter".to_string(),
                per_param(auto.peak_bytes.device),
                per_param(auto.peak_bytes.host),
                per_param(auto.peak_bytes.nvme),
            ]);
            out += &by_class.render();
            out += "(class rows count each class's buffers; buffers with disjoint lifetimes share \
                    memory, so the peak can be lower than their sum)\n";
        }
        (None, e) => out += &format!("\nno plan fits: {}\n", e.as_deref().unwrap_or("")),
    }
    out
}

/// `strata plan`: prints the report (and writes it as JSON when asked); an error when no
/// policy fits, after the table that shows why.
pub fn run(args: &PlanArgs, out: &mut impl Write) -> Result<(), Error> {
    let cfg = args.resolve()?;
    if args.print_config {
        write!(out, "{}", cfg.to_toml())?;
        return Ok(());
    }
    let r = report(&cfg)?;
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
