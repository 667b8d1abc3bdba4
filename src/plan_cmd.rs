//! `strata plan`: will this model train on this machine, and how? For the configuration
//! `strata train` would run (same flags and config file), plans one step under every
//! built-in policy and prints the bytes per tier and tensor class, each plan's peak per
//! tier against the budgets, its predicted step time, and the policy `auto` picks. It
//! allocates nothing, so a 13B model is answered in well under a second. `--json FILE`
//! writes the same answer for scripts; the command fails (exit 1) when no policy fits.

use std::io::Write;

use strata_engine::device::{DeviceChoice, choose_target};
use strata_engine::model::Target;
use strata_engine::plan::{Auto, CostModel, Plan, PlanInput, Policy, TensorClass, Tier, fmt_bytes};

use serde::Serialize;

use crate::report::{Table, write_json};
use crate::train::{budgets_of, named_policy, shape_of};
use crate::train_config::PlanArgs;

type Error = Box<dyn std::error::Error>;

/// `strata plan --json`: the answer for scripts.
#[derive(Debug, Serialize)]
pub struct PlanAnswer {
    /// The model as named.
    pub model: String,
    /// Its parameter count.
    pub params: u64,
    /// The budgets planned against, in bytes.
    pub budgets: TierBytes,
    /// Every built-in policy's plan.
    pub policies: Vec<PolicyAnswer>,
    /// The policy `auto` picks; None when none fits.
    pub auto: Option<String>,
}

/// One policy's plan.
#[derive(Debug, Serialize)]
pub struct PolicyAnswer {
    /// The policy's name, with its prefetch depth.
    pub policy: String,
    /// Whether every tier's peak is within its budget.
    pub fits: bool,
    /// The tiers over budget.
    pub short: Vec<String>,
    /// The planned peak bytes per tier.
    pub peak_bytes: TierBytes,
    /// NVMe bytes per parameter (the planned NVMe peak over the parameter count).
    pub nvme_bytes_per_param: f64,
    /// The predicted seconds of one step.
    pub step_seconds: f64,
}

/// Bytes per tier.
#[derive(Debug, Serialize)]
pub struct TierBytes {
    /// Device memory.
    pub device: u64,
    /// Pinned host memory.
    pub host: u64,
    /// NVMe.
    pub nvme: u64,
}

impl From<[u64; 3]> for TierBytes {
    fn from(b: [u64; 3]) -> Self {
        TierBytes {
            device: b[0],
            host: b[1],
            nvme: b[2],
        }
    }
}

/// `strata plan`. An error when no policy fits, after the table that shows why.
pub fn run(args: &PlanArgs, out: &mut impl Write) -> Result<(), Error> {
    let cfg = args.resolve()?;
    if args.print_config {
        write!(out, "{}", cfg.to_toml())?;
        return Ok(());
    }
    let model = crate::train::model_shape(&cfg)?;
    // A plan for a GPU needs no GPU here: `--device cuda` plans for CUDA's kernels.
    let target = match crate::train::device_choice(&cfg) {
        DeviceChoice::Cuda => Target::Cuda,
        choice => choose_target(choice)?,
    };
    let run_budgets = budgets_of(&cfg, target)?;
    let budgets = run_budgets.budgets;
    let shape = shape_of(&cfg, target);
    let input = PlanInput {
        model: &model,
        shape,
        budgets,
    };
    let cost = CostModel::default();
    let params = model.param_count() as u64;
    writeln!(
        out,
        "model {}: {:.3} B params, {}; training state {} (16 B/param)",
        cfg.model,
        params as f64 / 1e9,
        model.describe(),
        fmt_bytes(16 * params)
    )?;
    writeln!(
        out,
        "step: {} x {} tokens x {} micro-batches, {}; budgets: device {}, host {}, nvme {} ({})",
        shape.batch,
        shape.seq,
        shape.grad_accum,
        shape.precision,
        fmt_bytes(budgets.device),
        fmt_bytes(budgets.host),
        fmt_bytes(budgets.nvme),
        run_budgets.nvme_source()
    )?;
    writeln!(
        out,
        "rates ({}): {:.0} GFLOP/s compute, NVMe {:.1}/{:.1} GB/s read/write, copies {:.1} GB/s, AdamW {:.2} G params/s\n",
        cost.source,
        cost.compute_flops / 1e9,
        cost.nvme_read_bytes_per_s / 1e9,
        cost.nvme_write_bytes_per_s / 1e9,
        cost.h2d_bytes_per_s / 1e9,
        cost.adam_params_per_s / 1e9
    )?;

    let mut policies: Vec<Box<dyn Policy>> = Vec::new();
    for name in strata_engine::plan::BUILTIN_POLICIES {
        policies.extend(named_policy(name, cfg.prefetch)?);
    }
    let mut table = Table::new([
        "policy", "fits", "device", "host", "nvme", "s/step", "tokens/s",
    ]);
    let mut answers = Vec::new();
    for policy in &policies {
        let plan = Plan::build(&input, policy.as_ref())?;
        let p = cost.predict(&plan);
        let short: Vec<String> = Tier::ALL
            .into_iter()
            .filter(|t| {
                plan.peak[t.index()] > [budgets.device, budgets.host, budgets.nvme][t.index()]
            })
            .map(|t| t.to_string())
            .collect();
        let fits = if short.is_empty() {
            "yes".to_string()
        } else {
            format!("no: {}", short.join(", "))
        };
        answers.push(PolicyAnswer {
            policy: plan.policy.clone(),
            fits: short.is_empty(),
            short,
            peak_bytes: plan.peak.into(),
            nvme_bytes_per_param: plan.peak[Tier::Nvme.index()] as f64 / params as f64,
            step_seconds: p.step_seconds,
        });
        table.row([
            plan.policy.clone(),
            fits,
            fmt_bytes(plan.peak[0]),
            fmt_bytes(plan.peak[1]),
            fmt_bytes(plan.peak[2]),
            format!("{:.3}", p.step_seconds),
            format!("{:.0}", shape.tokens() as f64 / p.step_seconds),
        ]);
    }
    write!(out, "{}", table.render())?;
    let chosen = (Auto { cost }).choose(&input);
    if let Some(path) = &args.json {
        let answer = PlanAnswer {
            model: cfg.model.clone(),
            params,
            budgets: [budgets.device, budgets.host, budgets.nvme].into(),
            policies: answers,
            auto: chosen.as_ref().ok().map(|(_, plan, _)| plan.policy.clone()),
        };
        write_json(path, &answer).map_err(|e| format!("--json {}: {e}", path.display()))?;
    }
    match chosen {
        Ok((_, plan, candidates)) => {
            let p = cost.predict(&plan);
            writeln!(
                out,
                "\nauto picks {} (of {} candidates): predicted {:.3} s/step, overlap efficiency {:.2}",
                plan.policy,
                candidates.len(),
                p.step_seconds,
                p.overlap_efficiency()
            )?;
            let mut by_class = Table::new(["tensor class", "device", "host", "nvme"]);
            for (class, bytes) in plan.bytes_by_class() {
                let name = match class {
                    TensorClass::Params => "working params",
                    TensorClass::Grads => "gradients",
                    TensorClass::Optimizer => "master params + Adam m, v",
                    TensorClass::Checkpoints => "activation checkpoints",
                };
                by_class.row([
                    name.to_string(),
                    fmt_bytes(bytes[0]),
                    fmt_bytes(bytes[1]),
                    fmt_bytes(bytes[2]),
                ]);
            }
            let scratch = plan.buffer(plan.scratch).bytes;
            by_class.row([
                "device working set (one block's activations)".to_string(),
                fmt_bytes(scratch),
                "-".into(),
                "-".into(),
            ]);
            by_class.row([
                "peak".to_string(),
                fmt_bytes(plan.peak[0]),
                fmt_bytes(plan.peak[1]),
                fmt_bytes(plan.peak[2]),
            ]);
            write!(out, "{}", by_class.render())?;
            writeln!(
                out,
                "(class rows count each class's buffers; buffers with disjoint lifetimes share \
                 memory, so the peak can be lower than their sum)"
            )?;
        }
        Err(e) => {
            writeln!(out)?;
            return Err(format!("no plan fits: {e}").into());
        }
    }
    Ok(())
}
