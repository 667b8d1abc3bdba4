//! `strata plan`: will this model train on this machine, and how? For the configuration
//! `strata train` would run (same flags and config file), plans one step under every
//! built-in policy and prints the bytes per tier and tensor class, each plan's peak per
//! tier against the budgets, its predicted step time, and the policy `auto` picks. It
//! allocates nothing, so a 13B model is answered in well under a second.

use std::io::Write;

use strata_engine::device::{DeviceChoice, choose_target};
use strata_engine::model::Target;
use strata_engine::plan::{Auto, CostModel, Plan, PlanInput, Policy, TensorClass, fmt_bytes};

use crate::report::Table;
use crate::train::{budgets_of, named_policy, shape_of};
use crate::train_config::TrainArgs;

type Error = Box<dyn std::error::Error>;

/// `strata plan`.
pub fn run(args: &TrainArgs, out: &mut impl Write) -> Result<(), Error> {
    let cfg = args.resolve()?;
    let model = crate::train::model_shape(&cfg)?;
    // A plan for a GPU needs no GPU here: `--device cuda` plans for CUDA's kernels.
    let target = match crate::train::device_choice(&cfg) {
        DeviceChoice::Cuda => Target::Cuda,
        choice => choose_target(choice)?,
    };
    let (budgets, dirs) = budgets_of(&cfg, target)?;
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
        "step: {} x {} tokens x {} micro-batches, {}; budgets: device {}, host {}, nvme {} (90% of \
         free space in {})",
        shape.batch,
        shape.seq,
        shape.grad_accum,
        shape.precision,
        fmt_bytes(budgets.device),
        fmt_bytes(budgets.host),
        fmt_bytes(budgets.nvme),
        dirs.iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
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
    for policy in &policies {
        let plan = Plan::build(&input, policy.as_ref())?;
        let p = cost.predict(&plan);
        let fits = match plan.first_overflow() {
            None => "yes".to_string(),
            Some(t) => format!("no: {t}"),
        };
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
    match (Auto { cost }).choose(&input) {
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
        Err(e) => writeln!(out, "\nno plan fits: {e}")?,
    }
    Ok(())
}
