//! What a run does after its last step ([`finish`]): applies a delayed update still
//! waiting, says why it stopped and where its last checkpoint is, writes the trained
//! model to `--out` in Hugging Face's format (when it cannot, keeping the trained state
//! as a checkpoint instead), and prints the summary table (losses, step time, bytes per
//! link and peaks per tier, measured against the plan).
//!
//! Not here: the steps ([`super::steps`]) or the checkpoints they write.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use strata_engine::exec::{Executor, StepReport};
use strata_engine::model::weights::{self, SaveOptions};
use strata_engine::model::{Model, ModelError};
use strata_engine::plan::{Tier, fmt_bytes};

use super::group::Ranks;
use super::rescue;
use super::steps::Outcome;
use crate::model_source::pretrained_source;
use crate::process_memory::{ProcessMemory, Reads};
use crate::report::Table;
use crate::train_config::TrainConfig;

type Error = Box<dyn std::error::Error>;

/// Ends the run after `outcome`'s steps (rank 0 prints and writes the model).
pub fn finish(
    cfg: &TrainConfig,
    exec: &mut Executor,
    outcome: &Outcome,
    ranks: &Ranks,
    out: &mut impl Write,
    started: Instant,
) -> Result<(), Error> {
    if let Some(p) = &outcome.last_params {
        exec.flush(p)?;
    }
    if outcome.interrupted {
        writeln!(
            out,
            "interrupted at step {}: stopped after finishing it",
            outcome.state.step
        )?;
    }
    if let Some(saved) = &outcome.last_saved {
        writeln!(
            out,
            "checkpoint: {} (resume with --resume {})",
            saved.display(),
            saved.display()
        )?;
    }
    if let Some(dir) = &cfg.out {
        if let Err(e) = save_model(cfg, exec, dir, ranks, out) {
            let kept = rescue::keep(
                cfg,
                exec,
                ranks,
                &outcome.state,
                outcome.last_saved.as_deref(),
            );
            return Err(format!(
                "writing the trained model to --out {}: {e}; {kept} (strata checkpoint \
                 export writes it as a model)",
                dir.display()
            )
            .into());
        }
        if ranks.rank != 0 {
            return Ok(()); // rank 0 writes the model
        }
    }
    summary(out, exec, outcome, started, super::planning::reads_of(cfg))
}

/// Writes the trained model to `dir` a block at a time: each block's parameters are read
/// from their tier as the file reaches them, so that saving holds one block's
/// parameters, not the model's. With ranks rank 0 writes, and every rank serves its
/// shard of each block it asks for (a collective).
fn save_model(
    cfg: &TrainConfig,
    exec: &Executor,
    dir: &Path,
    ranks: &Ranks,
    out: &mut impl Write,
) -> Result<(), Error> {
    if exec.model().family().lora_config().is_some() && cfg.merge {
        super::adapter::save_merged_model(cfg, exec, dir)?;
        writeln!(
            out,
            "model: {} (the base with the adapters merged in, as Hugging Face safetensors, \
             config.json and the base's tokenizer files)",
            dir.display()
        )?;
        return Ok(());
    }
    if exec.model().family().lora_config().is_some() {
        super::adapter::save_adapter(cfg, exec, dir)?;
        writeln!(
            out,
            "adapter: {} (peft's adapter_config.json and adapter_model.safetensors; \
             load it with PeftModel.from_pretrained, or strata eval --adapter)",
            dir.display()
        )?;
        return Ok(());
    }
    let model = exec.model();
    let source = pretrained_source(&cfg.model)?;
    let mut options = source
        .as_ref()
        .map_or_else(SaveOptions::default, |s| s.save_options());
    if let Some(dtype) = cfg.save_dtype {
        options.dtype = dtype.file_dtype();
    }
    let saved = exec.with_whole_blocks(|read| {
        weights::save_pretrained_blocks(
            model,
            &|b| {
                read(b).map_err(|e| ModelError::Source {
                    what: format!("reading block {b}'s parameters to write {}", dir.display()),
                    source: Box::new(e),
                })
            },
            dir,
            &options,
        )
    })?;
    match saved {
        Some(written) => written?,
        None => return Ok(()), // rank 0 writes the model
    }
    debug_assert_eq!(ranks.rank, 0);
    writeln!(
        out,
        "model: {} (Hugging Face safetensors in {}{}, config.json{})",
        dir.display(),
        options.dtype.torch_name(),
        if sharded(model, &options) {
            ", sharded"
        } else {
            ""
        },
        if source.is_some() {
            " and the input's tokenizer files"
        } else {
            ""
        }
    )?;
    Ok(())
}

/// Whether `options` shard `model`'s weights over several files.
fn sharded(model: &Model, options: &SaveOptions) -> bool {
    options.max_shard_bytes < model.param_count() as u64 * options.dtype.size_bytes() as u64
}

/// The run's summary table.
fn summary(
    out: &mut impl Write,
    exec: &Executor,
    outcome: &Outcome,
    started: Instant,
    reads: Reads,
) -> Result<(), Error> {
    let (reports, losses) = (&outcome.reports, &outcome.losses);
    if reports.is_empty() {
        writeln!(out, "no steps to run: the run is already at its last step")?;
        return Ok(());
    }
    let secs: Vec<f64> = reports.iter().map(|r| r.seconds).collect();
    let median = crate::report::median(&secs);
    let stall: Vec<f64> = reports.iter().map(|r| r.stall_fraction()).collect();
    let plan = exec.plan();
    let mut t = Table::new(["", "value"]);
    t.row(["policy".to_string(), plan.policy.clone()]);
    t.row(["recompute".to_string(), plan.recomputed_of()]);
    if plan.shape.grad_accum > 1 {
        t.row(["schedule".to_string(), plan.shape.schedule.to_string()]);
    }
    t.row([
        "optimizer state".to_string(),
        format!("{} moments", plan.shape.optimizer_state),
    ]);
    t.row(["steps".to_string(), reports.len().to_string()]);
    t.row([
        "loss first -> last".to_string(),
        format!("{:.4} -> {:.4}", losses[0], losses[losses.len() - 1]),
    ]);
    t.row(["median step".to_string(), format!("{median:.3} s")]);
    t.row([
        "tokens/s (median step)".to_string(),
        format!("{:.0}", outcome.tokens_per_step as f64 / median),
    ]);
    t.row([
        "compute stall (median)".to_string(),
        format!("{:.1}%", 100.0 * crate::report::median(&stall)),
    ]);
    let median_report = &reports[crate::report::median_index(&secs)];
    // Bytes per token of this rank: its links carry its micro-batches.
    traffic_and_peaks(&mut t, exec, (median_report, plan.shape.tokens()), reads);
    t.row([
        "wall time".to_string(),
        format!("{:.1} s", started.elapsed().as_secs_f64()),
    ]);
    write!(out, "{}", t.render())?;
    Ok(())
}

/// The summary's rows of bytes per link (the median step's, against the plan), peaks per
/// tier, the process's peak memory and the operations' latencies.
fn traffic_and_peaks(
    t: &mut Table,
    exec: &Executor,
    (median_report, tokens): (&StepReport, u64),
    reads: Reads,
) {
    let plan = exec.plan();
    let live = exec.peak_measured();
    for (i, name) in ["nvme read", "nvme write", "h2d", "d2h"].iter().enumerate() {
        t.row([
            format!("{name} per step (measured / plan)"),
            format!(
                "{} / {}",
                fmt_bytes(median_report.link_bytes[i]),
                fmt_bytes(plan.link_bytes[i])
            ),
        ]);
    }
    let per_token = median_report
        .link_bytes
        .map(|b| format!("{:.0}", b as f64 / tokens.max(1) as f64));
    t.row([
        "bytes/token nvme r / w, h2d / d2h".to_string(),
        format!(
            "{} / {}, {} / {}",
            per_token[0], per_token[1], per_token[2], per_token[3]
        ),
    ]);
    for tier in Tier::ALL {
        t.row([
            format!("peak {tier} (measured / plan / budget)"),
            format!(
                "{} / {} / {}",
                fmt_bytes(live[tier.index()]),
                fmt_bytes(plan.peak[tier.index()]),
                fmt_bytes(
                    [plan.budgets.device, plan.budgets.host, plan.budgets.nvme][tier.index()]
                )
            ),
        ]);
    }
    if let Some(rss) = crate::report::peak_rss_bytes() {
        let planned = ProcessMemory::of_run(plan, exec.model(), reads);
        t.row([
            "process peak RSS (VmHWM / planned)".to_string(),
            planned.compared(rss),
        ]);
    }
    for (kind, count, p50, p99, _) in exec.latency_summary() {
        t.row([
            format!("{kind} p50 / p99"),
            format!("{p50} / {p99} µs ({count} ops)"),
        ]);
    }
}
