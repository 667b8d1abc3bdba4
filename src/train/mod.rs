//! `strata train`: a fine-tuning (or from-scratch) run of a model under a swap policy,
//! with checkpoints that never lose the run and exact resume.
//!
//! The run, in phases, each a module: the settings (defaults, TOML file, flags:
//! [`crate::train_config`]); the ranks it trains in (`group`); the model's shape and the
//! data (`data`); the budgets, this machine's rates and the plan, refused before anything
//! is allocated when it does not fit (`planning`); the device, the parameters
//! (initialised, loaded, or resumed) and the executor (`start`); the steps, with the
//! learning-rate schedule, gradient accumulation, clipping and fp16 loss scaling, a
//! progress line, JSON-lines metrics, a Chrome trace of one step and checkpoints every N
//! steps and on Ctrl-C (`steps`, `interrupt`); what a run keeps when it stops early or
//! cannot write its model (`rescue`); and the trained model in Hugging Face's format with
//! the summary (`finish`), or a LoRA run's adapter as a peft folder (`adapter`). What it prints goes through writers that stop at a closed pipe
//! and train on.

mod adapter;
mod data;
mod faults;
mod finish;
mod group;
mod interrupt;
mod planning;
mod preflight;
mod rescue;
mod start;
mod steps;

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use strata_comm::Collective;
use strata_engine::device::{Device, DeviceConfig, choose_target, select};
use strata_engine::exec::ExecConfig;
use strata_engine::model::Model;
use strata_engine::plan::{Tier, fmt_bytes};

pub use group::open_group;
pub use interrupt::die_on_closed_pipe;

use self::data::RunData;
use self::group::Ranks;
use self::planning::{Planned, plan_run};
use crate::logging::{UntilClosed, stderr_line};
use crate::machine::default_scratch_dir;
use crate::model_source::run_model;
use crate::train_config::{TrainArgs, TrainConfig};

type Error = Box<dyn std::error::Error>;

/// `strata train`. Under `mpirun` (a build with `--features mpi`) each process is one
/// rank of ZeRO-3 data parallelism: see [`run_in`].
pub fn run(args: &TrainArgs) -> Result<(), Error> {
    let cfg = args.resolve()?;
    if args.print_config {
        write!(
            UntilClosed::new(std::io::stdout().lock()),
            "{}",
            cfg.to_toml()
        )?;
        return Ok(());
    }
    let group = open_group()?;
    let result = run_in(cfg, group.clone());
    if let (Err(e), Some(group)) = (&result, &group) {
        // The other ranks would wait for this one at their next collective: end the job,
        // saying why first (MPI's abort ends every process, this one included).
        stderr_line(&format!("strata: error: rank {}: {e}", group.rank()));
        group.abort(&e.to_string());
    }
    result
}

/// `strata train` in `group` (none: alone). With N ranks, every rank plans the same step
/// (one set of budgets, see `group::shared_budgets`; rank 0's measured rates), owns 1/N
/// of every block's parameters, gradients and optimizer state, and takes micro-batches r,
/// r + N, ... of each step's N × grad-accum: the same computation as one process with
/// N-fold accumulation, bit for bit. Rank 0 prints and logs; every rank writes its shard
/// of each checkpoint; rank 0 writes `--out`.
pub fn run_in(mut cfg: TrainConfig, group: Option<Arc<dyn Collective>>) -> Result<(), Error> {
    let ranks = Ranks::of(group);
    if ranks.ranks > 1 && cfg.nvme.is_empty() {
        cfg.nvme = vec![default_scratch_dir().join("strata-nvme")];
    }
    cfg.nvme = ranks.nvme_dirs(&cfg.nvme);
    let target = choose_target(cfg.device)?;
    let started = Instant::now();
    let mut out = UntilClosed::new(ranks.out());

    // The model's shape, the data, and the plan: refused here, before any parameter is
    // allocated, when it does not fit.
    let model = run_model(&cfg)?;
    let data = RunData::open(&cfg, &model, &mut out)?;
    let planned = plan_run(&cfg, &model, target, &ranks)?;
    preflight::check_space(&cfg, &model, &planned, &ranks)?;
    let device = open_device(&cfg, &planned, &ranks)?;
    print_start(&mut out, &cfg, &model, &data, &planned, &device, &ranks)?;

    // Parameters: initialised, loaded, or resumed (a checkpoint sharded by as many ranks
    // as this run's: each rank reads its own shard).
    let (initial, state) = start::starting_point(&cfg, &model, &planned.plan, &ranks)?;
    print_rates(&mut out, &planned, ranks.ranks)?;
    if let Some(r) = &cfg.resume {
        writeln!(out, "resuming {} at step {}", r.display(), state.step)?;
    }
    let mut exec_config = ExecConfig {
        nvme_dirs: planned.budgets.nvme_dirs.clone(),
        comm: ranks.group.clone(),
        ..ExecConfig::default()
    };
    // Tests: STRATA_FAULTS injects I/O faults; the guard counts them when the run ends.
    let _faults = faults::from_env(&mut exec_config)?;
    let tokens_per_step = planned.shape.tokens() * ranks.ranks as u64;
    let plan = planned.plan;
    let mut exec = start::executor(&model, plan, device, &exec_config, initial, &state)?;
    interrupt::install_handler();
    if cfg.checkpoint_dir.is_none() && cfg.out.is_none() && ranks.ranks == 1 {
        writeln!(
            out,
            "nothing of this run is saved except on Ctrl-C or a failure, to {} (give \
             --checkpoint-dir or --out to keep it)",
            rescue::default_dir().display()
        )?;
    }

    let outcome = steps::train(
        &cfg,
        &mut exec,
        &data,
        state,
        tokens_per_step,
        &ranks,
        &mut out,
    )?;
    finish::finish(&cfg, &mut exec, &outcome, &ranks, &mut out, started)
}

/// The configured device, with the plan's device memory as its budget.
fn open_device(cfg: &TrainConfig, planned: &Planned, ranks: &Ranks) -> Result<Device, Error> {
    let (device, why) = select(
        cfg.device,
        &DeviceConfig {
            memory_budget_bytes: planned.plan.peak[Tier::Device.index()].max(1) as usize,
            // With ranks, each drives the GPU of its rank on its node.
            cuda_ordinal: ranks.cuda_ordinal(),
            cuda_needs_kernels: true,
        },
    )?;
    log::info!("device: {why}");
    Ok(device)
}

/// What is about to train: the model, the data and the device; the ranks; the plan.
fn print_start(
    out: &mut impl Write,
    cfg: &TrainConfig,
    model: &Model,
    data: &RunData,
    planned: &Planned,
    device: &Device,
    ranks: &Ranks,
) -> Result<(), Error> {
    writeln!(
        out,
        "strata train: {} ({} params: {} layers, {} wide, vocab {}) on {} ({} tokens), device {}",
        cfg.model,
        model.param_count(),
        model.layers(),
        model.width(),
        model.vocab(),
        data.path.display(),
        data.tokens.len(),
        device.name()
    )?;
    let approx = model.approximation();
    if !approx.is_exact() {
        writeln!(
            out,
            "approximate backward: {approx} (kept layers save less; the gradients it names \
             are estimates; `strata plan` compares it with the exact backward)"
        )?;
    }
    if let Some(eos) = model.packing() {
        writeln!(
            out,
            "packed: documents end with token {eos}; each token attends within its document, \
             whose positions restart at 0, and the target after each end is not counted"
        )?;
    }
    let n = ranks.ranks;
    if n > 1 {
        writeln!(
            out,
            "ranks: {n} (ZeRO-3: each owns 1/{n} of every block's parameters, gradients \
             and optimizer state, and runs {} of the step's {} micro-batches; figures below \
             are per rank)",
            cfg.grad_accum,
            cfg.grad_accum * n
        )?;
    }
    print_plan(out, planned)?;
    writeln!(
        out,
        "{}",
        crate::process_memory::ProcessMemory::of_run(&planned.plan, model, planning::reads_of(cfg))
            .line()
    )?;
    Ok(())
}

/// The plan: its peaks against the budgets, what it recomputes, its predicted step, and
/// what it keeps off NVMe or spills there.
fn print_plan(out: &mut impl Write, planned: &Planned) -> Result<(), Error> {
    let (plan, budgets) = (&planned.plan, &planned.budgets.budgets);
    writeln!(
        out,
        "plan {}: peak device {} of {}, host {} of {}, nvme {} (in {}); {}; predicted {:.3} s/step",
        plan.policy,
        fmt_bytes(plan.peak[0]),
        fmt_bytes(budgets.device),
        fmt_bytes(plan.peak[1]),
        fmt_bytes(budgets.host),
        fmt_bytes(plan.peak[2]),
        planned.budgets.dirs_text(),
        plan.recompute_summary(),
        planned.predicted.step_seconds
    )?;
    if plan.shape.grad_accum > 1 {
        writeln!(out, "{}", plan.schedule_text())?;
    }
    if let Some(edges) = plan.edges_text() {
        writeln!(out, "{edges}")?;
    }
    if plan.spilled() > 0 {
        writeln!(
            out,
            "gradients of {} blocks wait for the clipping norm on NVMe, not in host memory \
             (--spill-grads {})",
            plan.spilled(),
            plan.shape.grad_spill
        )?;
    }
    Ok(())
}

/// The rates the plan was chosen by.
fn print_rates(out: &mut impl Write, planned: &Planned, ranks: usize) -> Result<(), Error> {
    let cost = &planned.cost;
    writeln!(
        out,
        "rates ({}): {:.0} GFLOP/s compute, copies {:.1} GB/s, AdamW {:.2} G params/s, NVMe {:.1}/{:.1} GB/s read/write{}",
        cost.source,
        cost.compute_flops / 1e9,
        cost.h2d_bytes_per_s / 1e9,
        cost.adam_params_per_s / 1e9,
        cost.nvme_read_bytes_per_s / 1e9,
        cost.nvme_write_bytes_per_s / 1e9,
        match ranks {
            1 => String::new(),
            _ => format!(
                ", collectives {:.1} GB/s",
                cost.collective_bytes_per_s / 1e9
            ),
        }
    )?;
    Ok(())
}
