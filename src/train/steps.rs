//! The training loop ([`train`]): each step's micro-batches in file order (micro-batch k
//! of rank r is the step's k × ranks + r), the learning rate by schedule, fp16 dynamic
//! loss scaling (halved on overflow and the step skipped, doubled after 200 good steps),
//! the held-out loss, a JSON line and a progress line per step, a Chrome trace of one
//! step, and checkpoints every N steps, at the end and on Ctrl-C.
//!
//! Not here: the step itself (the executor's) or what the run does after its last step.

use std::fs::File;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

use strata_engine::checkpoint::{self, Checkpoint, TrainerState};
use strata_engine::exec::{ExecError, Executor, Runner, StepParams, StepReport};
use strata_engine::kernels::adamw::AdamW;
use strata_engine::model::data::Batch;
use strata_engine::plan::fmt_bytes;

use super::data::RunData;
use super::group::Ranks;
use super::interrupt::interrupted;
use crate::train_config::{Dtype, TrainConfig};

type Error = Box<dyn std::error::Error>;

/// How many good fp16 steps double the loss scale.
const FP16_GROWTH_INTERVAL: u64 = 200;

/// What the loop leaves for the end of the run.
pub struct Outcome {
    /// The trainer state after the last step run.
    pub state: TrainerState,
    /// Every step's loss.
    pub losses: Vec<f32>,
    /// Every step's report.
    pub reports: Vec<StepReport>,
    /// The last checkpoint written.
    pub last_saved: Option<PathBuf>,
    /// The last step's parameters (a delayed update still waiting is applied with them).
    pub last_params: Option<StepParams>,
    /// Whether Ctrl-C stopped the run.
    pub interrupted: bool,
    /// Every rank's tokens per step.
    pub tokens_per_step: u64,
}

/// The loop's state between steps.
struct StepLoop<'a> {
    cfg: &'a TrainConfig,
    data: &'a RunData,
    ranks: &'a Ranks,
    /// Each block's shard length, for a sharded checkpoint.
    shard_len: Vec<usize>,
    /// The metrics file, appended to (rank 0's).
    jsonl: Option<File>,
    /// This rank's micro-batches of the step, reused.
    micro: Vec<Batch>,
    bar: indicatif::ProgressBar,
    first_step: u64,
    loop_start: Instant,
    epoch: u64,
    outcome: Outcome,
}

/// Runs the steps after `state`'s up to the configured last (or Ctrl-C); every rank's
/// steps train on `tokens_per_step` tokens together.
pub fn train(
    cfg: &TrainConfig,
    exec: &mut Executor,
    data: &RunData,
    state: TrainerState,
    tokens_per_step: u64,
    ranks: &Ranks,
    out: &mut impl Write,
) -> Result<Outcome, Error> {
    let mut run = StepLoop::new(cfg, exec, data, state, ranks)?;
    run.outcome.tokens_per_step = tokens_per_step;
    for step in run.first_step..=cfg.steps {
        run.announce_epoch(step, out)?;
        let (report, params) = run.step(exec, step)?;
        let eval_loss = match data.held_out {
            Some(k) if step.is_multiple_of(cfg.eval_every) || step == cfg.steps => {
                Some(evaluate(exec, data, k, cfg)?)
            }
            _ => None,
        };
        run.record(step, report, eval_loss)?;
        run.outcome.interrupted = interrupted();
        run.checkpoint_if_due(exec, step, &params)?;
        if run.outcome.interrupted {
            break;
        }
    }
    run.bar.finish_and_clear();
    Ok(run.outcome)
}

impl<'a> StepLoop<'a> {
    fn new(
        cfg: &'a TrainConfig,
        exec: &Executor,
        data: &'a RunData,
        state: TrainerState,
        ranks: &'a Ranks,
    ) -> Result<Self, Error> {
        // Appended to (a resumed run continues its log), a line per step, flushed as it is
        // written so that a killed run's log has every step it finished.
        let jsonl = match &cfg.log_jsonl {
            Some(p) if ranks.rank == 0 => Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .map_err(|e| format!("--log-jsonl {}: {e}", p.display()))?,
            ),
            _ => None,
        };
        let bar = if ranks.rank == 0 {
            progress_bar(cfg.steps, state.step)
        } else {
            indicatif::ProgressBar::hidden()
        };
        let train_batches = data.train_batches as u64;
        Ok(StepLoop {
            cfg,
            data,
            ranks,
            shard_len: exec.plan().shard_len.iter().map(|&s| s as usize).collect(),
            jsonl,
            micro: vec![Batch::default(); cfg.grad_accum],
            bar,
            first_step: state.step + 1,
            loop_start: Instant::now(),
            epoch: state.data_position / train_batches + 1,
            outcome: Outcome {
                tokens_per_step: 0,
                state,
                losses: Vec::new(),
                reports: Vec::new(),
                last_saved: None,
                last_params: None,
                interrupted: false,
            },
        })
    }

    /// Says so when `step` starts reading the data again from the start.
    fn announce_epoch(&mut self, step: u64, out: &mut impl Write) -> Result<(), Error> {
        let train_batches = self.data.train_batches;
        let step_epoch = self.outcome.state.data_position / train_batches as u64 + 1;
        if step_epoch > self.epoch {
            self.epoch = step_epoch;
            let line = format!(
                "epoch {step_epoch}: step {step} reads the data's {train_batches} batches again \
                 from the start"
            );
            self.bar.suspend(|| writeln!(out, "{line}"))?;
        }
        Ok(())
    }

    /// This rank's micro-batches of the step: micro-batch k of rank r is the step's
    /// k × ranks + r.
    fn read_batches(&mut self, vocab: usize) -> Result<(), Error> {
        let (rank, ranks) = (self.ranks.rank, self.ranks.ranks);
        let train_batches = self.data.train_batches as u64;
        for (k, b) in self.micro.iter_mut().enumerate() {
            let i = (k * ranks + rank) as u64;
            let index = ((self.outcome.state.data_position + i) % train_batches) as usize;
            self.data
                .tokens
                .read_batch(index, self.cfg.batch, self.cfg.seq, vocab, b)?;
        }
        Ok(())
    }

    /// Runs step `step`, and moves the trainer state past it.
    fn step(&mut self, exec: &mut Executor, step: u64) -> Result<(StepReport, StepParams), Error> {
        let cfg = self.cfg;
        self.read_batches(exec.model().vocab())?;
        let refs: Vec<(&[u32], &[u32])> = self
            .micro
            .iter()
            .map(|b| (&b.inputs[..], &b.targets[..]))
            .collect();
        let step_params = StepParams {
            adam: AdamW {
                lr: cfg.lr_at(step),
                beta1: cfg.beta1,
                beta2: cfg.beta2,
                eps: cfg.eps,
                weight_decay: cfg.weight_decay,
            },
            clip: cfg.clip,
            loss_scale: self.outcome.state.loss_scale,
        };
        let report = exec.step(&refs, &step_params).map_err(|e| match e {
            ExecError::Storage { .. } => format!(
                "step {step}: {e}; the run stops here, and what it trained after its last \
                 checkpoint is not kept (--resume from that checkpoint, or rerun)"
            ),
            e => format!("step {step}: {e}"),
        })?;
        let mut skipped = report.skipped;
        // A delayed update starts after the warm-up (as ZeRO-Offload's does): until then
        // each step's update is applied at once, as without it.
        if cfg.delayed_update && step <= cfg.warmup_steps {
            skipped |= exec.flush(&step_params)?.is_some_and(|f| f.skipped);
        }
        self.advance(step, skipped);
        Ok((report, step_params))
    }

    /// The trainer state after step `step`: its data position, and the fp16 loss scale
    /// (halved when the step overflowed and was skipped, doubled after enough good ones).
    fn advance(&mut self, step: u64, skipped: bool) {
        let state = &mut self.outcome.state;
        state.step = step;
        state.data_position += (self.cfg.grad_accum * self.ranks.ranks) as u64;
        if skipped {
            state.skipped_steps += 1;
            state.good_steps = 0;
            state.loss_scale = (state.loss_scale / 2.0).max(1.0);
        } else {
            state.good_steps += 1;
            if self.cfg.dtype == Dtype::Fp16
                && state.good_steps.is_multiple_of(FP16_GROWTH_INTERVAL)
            {
                state.loss_scale = (state.loss_scale * 2.0).min(f32::MAX / 2.0);
            }
        }
    }

    /// Logs step `step` (JSON line, trace, progress) and keeps its report.
    fn record(
        &mut self,
        step: u64,
        report: StepReport,
        eval_loss: Option<f32>,
    ) -> Result<(), Error> {
        self.outcome.losses.push(report.loss);
        self.log_jsonl(step, &report, eval_loss)?;
        let rank0 = self.ranks.rank == 0;
        if let Some(trace) = &self.cfg.trace
            && rank0
            && step == self.cfg.trace_step.max(self.first_step)
        {
            crate::report::write_json(trace, &report.chrome_trace(step))?;
        }
        if rank0 {
            progress(
                &self.bar,
                StepLine {
                    step,
                    steps: self.cfg.steps,
                    first: self.first_step,
                    tokens: self.outcome.tokens_per_step,
                    start: self.loop_start,
                },
                &report,
                eval_loss,
            );
        }
        self.outcome.reports.push(report);
        Ok(())
    }

    /// Appends step `step`'s metrics to the `--log-jsonl` file.
    fn log_jsonl(
        &mut self,
        step: u64,
        report: &StepReport,
        eval_loss: Option<f32>,
    ) -> Result<(), Error> {
        let Some(w) = self.jsonl.as_mut() else {
            return Ok(());
        };
        let line = serde_json::json!({
            "step": step, "loss": report.loss, "eval_loss": eval_loss,
            "lr": self.cfg.lr_at(step),
            "grad_norm": report.grad_norm, "skipped": report.skipped,
            "updated": report.updated,
            "loss_scale": self.outcome.state.loss_scale, "seconds": report.seconds,
            "tokens_per_s": self.outcome.tokens_per_step as f64 / report.seconds,
            "compute_stall": report.stall_fraction(),
            "nvme_read_bytes": report.link_bytes[0], "nvme_write_bytes": report.link_bytes[1],
            "h2d_bytes": report.link_bytes[2], "d2h_bytes": report.link_bytes[3],
        });
        // One write per line: with O_APPEND a line is never split by a crash.
        w.write_all(format!("{line}\n").as_bytes())
            .map_err(|e| format!("--log-jsonl: {e}"))?;
        Ok(())
    }

    /// Writes a checkpoint after step `step` when one is due: every `checkpoint_every`
    /// steps, at the last step, or on Ctrl-C.
    fn checkpoint_if_due(
        &mut self,
        exec: &mut Executor,
        step: u64,
        params: &StepParams,
    ) -> Result<(), Error> {
        let cfg = self.cfg;
        self.outcome.last_params = Some(*params);
        let due = cfg.checkpoint_every > 0 && step.is_multiple_of(cfg.checkpoint_every);
        let Some(dir) = &cfg.checkpoint_dir else {
            return Ok(());
        };
        if !(due || self.outcome.interrupted || step == cfg.steps) {
            return Ok(());
        }
        // A delayed update still waiting is applied first, so the checkpoint holds
        // every step's update (and resuming from it continues from the same state).
        if exec.flush(params)?.is_some_and(|f| f.skipped) {
            self.outcome.state.skipped_steps += 1;
        }
        let saved = match &self.ranks.group {
            // Each rank writes its own shard (a collective).
            Some(group) => {
                let (params, m, v) = exec.export_shard()?;
                let shard = checkpoint::Shard {
                    model: exec.model().clone(),
                    ranks: self.ranks.ranks,
                    rank: self.ranks.rank,
                    shard_len: self.shard_len.clone(),
                    params,
                    m,
                    v,
                    state: self.outcome.state.clone(),
                };
                checkpoint::save_sharded(dir, group.as_ref(), &shard, cfg.keep_checkpoints)?
            }
            None => {
                let (params, m, v) = exec.export()?;
                let ckpt = Checkpoint {
                    model: exec.model().clone(),
                    params,
                    m,
                    v,
                    state: self.outcome.state.clone(),
                };
                checkpoint::save(dir, &ckpt, cfg.keep_checkpoints)?
            }
        };
        self.outcome.last_saved = Some(saved);
        Ok(())
    }
}

/// The held-out batch's loss under the current master parameters.
fn evaluate(
    exec: &Executor,
    data: &RunData,
    batch: usize,
    cfg: &TrainConfig,
) -> Result<f32, Error> {
    let model = exec.model();
    // Alone, the parameters only, a block at a time; with ranks, gathered (a collective).
    let params = if exec.comm().size() == 1 {
        (0..model.blocks().len())
            .map(|b| exec.export_block(b))
            .collect::<Result<Vec<_>, _>>()?
    } else {
        exec.export()?.0
    };
    let mut b = Batch::default();
    data.tokens
        .read_batch(batch, cfg.batch, cfg.seq, model.vocab(), &mut b)?;
    let mut runner = Runner::on_cpu(model.clone(), cfg.batch, cfg.seq)?;
    runner.load(&params)?;
    Ok(runner.forward(&b.inputs, &b.targets)?)
}

fn progress_bar(steps: u64, done: u64) -> indicatif::ProgressBar {
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(steps);
    bar.set_position(done);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} eta {eta}")
            .expect("a valid template"),
    );
    bar
}

/// Where a step stands in the run, for its progress line.
struct StepLine {
    step: u64,
    steps: u64,
    /// The run's first step (after a resume, not 1).
    first: u64,
    /// Tokens per step.
    tokens: u64,
    /// When the first step started.
    start: Instant,
}

/// Step `at.step`'s line: on the bar, or (without a terminal) on standard error every
/// few steps.
fn progress(bar: &indicatif::ProgressBar, at: StepLine, r: &StepReport, eval_loss: Option<f32>) {
    let StepLine {
        step,
        steps,
        first,
        tokens,
        start,
    } = at;
    let done = step - first + 1;
    let elapsed = start.elapsed().as_secs_f64();
    let tps = (done * tokens) as f64 / elapsed;
    let eta = elapsed / done as f64 * (steps - step) as f64;
    let links = format!(
        "nvme r/w {}/{} h2d {} d2h {}",
        fmt_bytes(r.link_bytes[0]),
        fmt_bytes(r.link_bytes[1]),
        fmt_bytes(r.link_bytes[2]),
        fmt_bytes(r.link_bytes[3])
    );
    let eval = eval_loss
        .map(|l| format!(" eval {l:.4}"))
        .unwrap_or_default();
    let msg = format!(
        "loss {:.4}{eval} {tps:.0} tok/s stall {:.0}% {links}{}",
        r.loss,
        100.0 * r.stall_fraction(),
        if r.skipped {
            " (skipped: overflow)"
        } else {
            ""
        }
    );
    if bar.is_hidden() {
        let every = (steps / 20).max(10);
        if step == first || step == steps || step.is_multiple_of(every) || eval_loss.is_some() {
            eprintln!("step {step}/{steps} {msg} eta {eta:.0}s");
        }
    } else {
        bar.set_position(step);
        bar.set_message(msg);
    }
}
