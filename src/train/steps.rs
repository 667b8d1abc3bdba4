//! The training loop ([`train`]): each step's micro-batches in file order (micro-batch k
//! of rank r is the step's k × ranks + r), the learning rate by schedule, fp16 dynamic
//! loss scaling (halved on overflow and the step skipped, doubled after 200 good steps),
//! the held-out loss, a JSON line and a progress line per step, a Chrome trace of one
//! step, and checkpoints every N steps, at the end and on Ctrl-C. A step that fails is
//! retried once with the same batches (the executor applies no block's update twice); a
//! step whose loss or gradients are not finite stops the run before its update, or is
//! skipped (`--on-nonfinite`); a run that stops keeps its state ([`super::rescue`]).
//!
//! Not here: the step itself (the executor's) or what the run does after its last step.

use std::fs::File;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

use strata_engine::checkpoint::TrainerState;
use strata_engine::exec::{BlockForward, ExecError, Executor, StepParams, StepReport};
use strata_engine::kernels::adamw::AdamW;
use strata_engine::model::ModelError;
use strata_engine::model::data::Batch;
use strata_engine::plan::fmt_bytes;

use super::data::RunData;
use super::group::Ranks;
use super::interrupt::interrupted;
use super::rescue::{self, Kept, Stop};
use super::start::FreshParams;
use crate::train_config::{Dtype, OnNonFinite, TrainConfig};

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
/// steps train on `tokens_per_step` tokens together. A run that stops on an error keeps
/// its state and says where in the error.
pub fn train(
    cfg: &TrainConfig,
    exec: &mut Executor,
    data: &RunData,
    state: TrainerState,
    tokens_per_step: u64,
    ranks: &Ranks,
    out: &mut impl Write,
) -> Result<Outcome, Error> {
    let mut run = StepLoop::new(cfg, data, state, ranks)?;
    run.outcome.tokens_per_step = tokens_per_step;
    let ran = run.steps(exec, out);
    run.bar.finish_and_clear();
    match ran {
        Ok(()) => Ok(run.outcome),
        Err(stop) => Err(run.rescue(exec, stop).into()),
    }
}

impl<'a> StepLoop<'a> {
    fn new(
        cfg: &'a TrainConfig,
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

    /// The steps, up to the last or Ctrl-C; why they stopped, if they did.
    fn steps(&mut self, exec: &mut Executor, out: &mut impl Write) -> Result<(), Stop> {
        let (cfg, data) = (self.cfg, self.data);
        for step in self.first_step..=cfg.steps {
            self.announce_epoch(step, out).map_err(Stop::kept)?;
            let (report, params) = self.step(exec, step)?;
            let eval_loss = match data.held_out {
                Some(k) if step.is_multiple_of(cfg.eval_every) || step == cfg.steps => {
                    Some(evaluate(exec, data, k, cfg).map_err(Stop::kept)?)
                }
                _ => None,
            };
            self.record(step, report, eval_loss).map_err(Stop::kept)?;
            self.outcome.interrupted = interrupted();
            self.checkpoint_if_due(exec, step, &params)
                .map_err(Stop::kept)?;
            if self.outcome.interrupted {
                break;
            }
        }
        Ok(())
    }

    /// After `stop`, keeps what can be kept: the error, with what was kept and where.
    fn rescue(&mut self, exec: &mut Executor, stop: Stop) -> String {
        let kept = match stop.kept {
            Kept::State => {
                // A delayed update still waiting is applied first, as before a checkpoint.
                let flushed = match &self.outcome.last_params {
                    Some(p) => exec.flush(p).map(drop),
                    None => Ok(()),
                };
                match flushed {
                    Ok(()) => rescue::keep(
                        self.cfg,
                        exec,
                        self.ranks,
                        &self.outcome.state,
                        self.outcome.last_saved.as_deref(),
                    ),
                    Err(e) => format!(
                        "applying the delayed update failed ({e}), so the state is not \
                         saved; {}",
                        rescue::last_checkpoint(self.outcome.last_saved.as_deref())
                    ),
                }
            }
            Kept::Lost(why) => format!(
                "{why}, so it is not saved; {}",
                rescue::last_checkpoint(self.outcome.last_saved.as_deref())
            ),
        };
        format!("{}; {kept}", stop.why)
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

    /// Runs step `step`, and moves the trainer state past it (or not, when it stops
    /// the run).
    fn step(&mut self, exec: &mut Executor, step: u64) -> Result<(StepReport, StepParams), Stop> {
        let cfg = self.cfg;
        self.read_batches(exec.model().vocab())
            .map_err(|e| Stop::kept(format!("step {step}: {e}")))?;
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
        let report = self.run_step(exec, step, &step_params)?;
        let mut skipped = self.check_finite(step, &report)?;
        // A delayed update starts after the warm-up (as ZeRO-Offload's does): until then
        // each step's update is applied at once, as without it.
        if cfg.delayed_update && step <= cfg.warmup_steps {
            match exec.flush(&step_params) {
                Ok(f) => skipped |= f.is_some_and(|f| f.skipped),
                Err(e) => return Err(self.after_failure(exec, step, format!("step {step}: {e}"))),
            }
        }
        self.advance(step, skipped);
        Ok((report, step_params))
    }

    /// The executor's step over the batches read, retried once when it fails (an I/O
    /// error that passes is absorbed; the retry applies no block's update twice).
    fn run_step(
        &mut self,
        exec: &mut Executor,
        step: u64,
        params: &StepParams,
    ) -> Result<StepReport, Stop> {
        let refs: Vec<(&[u32], &[u32])> = self
            .micro
            .iter()
            .map(|b| (&b.inputs[..], &b.targets[..]))
            .collect();
        let first = match exec.step(&refs, params) {
            Ok(report) => return Ok(report),
            // Refused before anything ran: a retry would be refused again.
            Err(e @ (ExecError::BadInput(_) | ExecError::Model(_))) => {
                return Err(Stop::kept(format!("step {step}: {e}")));
            }
            Err(e) => e,
        };
        match exec.step(&refs, params) {
            Ok(report) => {
                log::warn!("step {step}: {first}; retried with the same batches, it succeeded");
                Ok(report)
            }
            Err(e) => Err(self.after_failure(
                exec,
                step,
                format!("step {step}: {first}; retried with the same batches: {e}"),
            )),
        }
    }

    /// Why the run stops after step `step` failed (`why`), and whether its state is whole:
    /// every block as before the step, or (without a delayed update) every block updated
    /// by it, the trainer state then moved past it.
    fn after_failure(&mut self, exec: &Executor, step: u64, why: String) -> Stop {
        let before = exec.steps();
        let blocks = exec.block_steps();
        let delayed = self.cfg.delayed_update;
        if blocks.iter().all(|&b| b == before)
            || (delayed && blocks.iter().all(|&b| b == before + 1))
        {
            Stop {
                why: format!("{why}; every block is as before step {step}"),
                kept: Kept::State,
            }
        } else if blocks.iter().all(|&b| b == before + 1) {
            self.advance(step, false);
            Stop {
                why: format!("{why}; every block holds step {step}'s update"),
                kept: Kept::State,
            }
        } else {
            Stop {
                why,
                kept: Kept::Lost(format!(
                    "some blocks hold step {step}'s update and some do not"
                )),
            }
        }
    }

    /// Whether step `step`'s update was skipped; with fp32 or bf16, a non-finite loss or
    /// gradients stop the run (its update not applied, the state before it kept) or are
    /// skipped, as `--on-nonfinite` says. fp16's overflows are skipped as ever.
    fn check_finite(&mut self, step: u64, report: &StepReport) -> Result<bool, Stop> {
        let finite = !report.skipped && report.loss.is_finite();
        if self.cfg.dtype == Dtype::Fp16 || finite {
            return Ok(report.skipped);
        }
        let what = format!(
            "step {step}: the loss is {} and the gradient norm {}",
            report.loss, report.grad_norm
        );
        if report.updated {
            // Without clipping each update is applied as its gradients arrive.
            return Err(Stop {
                why: format!(
                    "{what}; its update was applied (--clip 0 applies each block's as its gradients arrive)"
                ),
                kept: Kept::Lost("the parameters may not be finite".to_string()),
            });
        }
        match self.cfg.on_nonfinite {
            OnNonFinite::Skip => {
                log::warn!("{what}: its update is skipped (--on-nonfinite skip)");
                Ok(true)
            }
            OnNonFinite::Stop => Err(Stop {
                why: format!(
                    "{what}: stopped before its update (--on-nonfinite stop; a lower --lr, \
                     or --on-nonfinite skip to go on)"
                ),
                kept: Kept::State,
            }),
        }
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
    /// steps, at the last step, or on Ctrl-C (without `--checkpoint-dir`, in the rescue
    /// folder).
    fn checkpoint_if_due(
        &mut self,
        exec: &mut Executor,
        step: u64,
        params: &StepParams,
    ) -> Result<(), Error> {
        let cfg = self.cfg;
        self.outcome.last_params = Some(*params);
        let due = cfg.checkpoint_every > 0 && step.is_multiple_of(cfg.checkpoint_every);
        let dir = match &cfg.checkpoint_dir {
            Some(dir) if due || self.outcome.interrupted || step == cfg.steps => dir.as_path(),
            None if self.outcome.interrupted && self.ranks.ranks == 1 => rescue::default_dir(),
            _ => return Ok(()),
        };
        // A delayed update still waiting is applied first, so the checkpoint holds
        // every step's update (and resuming from it continues from the same state).
        if exec.flush(params)?.is_some_and(|f| f.skipped) {
            self.outcome.state.skipped_steps += 1;
        }
        let saved = rescue::write_checkpoint(
            exec,
            self.ranks,
            dir,
            &self.outcome.state,
            cfg.keep_checkpoints,
        )?;
        self.outcome.last_saved = Some(saved);
        Ok(())
    }
}

/// The held-out batch's loss under the current master parameters, a block at a time:
/// each block's parameters are read from their tier as the forward reaches it, so the
/// model is never whole in memory. With ranks rank 0 evaluates, every rank serving its
/// shard of each block, and every rank gets the loss (a collective).
fn evaluate(
    exec: &Executor,
    data: &RunData,
    batch: usize,
    cfg: &TrainConfig,
) -> Result<f32, Error> {
    let model = exec.model();
    let mut b = Batch::default();
    data.tokens
        .read_batch(batch, cfg.batch, cfg.seq, model.vocab(), &mut b)?;
    let forward = BlockForward::on_cpu(model.clone(), cfg.batch, cfg.seq)?;
    // A LoRA model's master copy holds its adapters alone: its base comes from where the
    // run read it (one process: the planner refuses LoRA among ranks).
    let base = match model.lora_config() {
        Some(_) => Some(FreshParams::of(cfg, model)?),
        None => None,
    };
    let loss = exec.with_whole_blocks(|read| -> Result<f32, Error> {
        let read = |b: usize| {
            let source = |e: Box<dyn std::error::Error + Send + Sync>| ModelError::Source {
                what: format!("reading block {b}'s parameters to evaluate"),
                source: e,
            };
            match &base {
                Some(base) => {
                    let adapters = exec.export_trained(b).map_err(|e| source(Box::new(e)))?;
                    let mut params = base.block_under(model, b, &adapters)?;
                    model.dequantise_base(b, &mut params);
                    Ok(params)
                }
                None => read(b).map_err(|e| source(Box::new(e))),
            }
        };
        Ok(forward.forward(&b.inputs, &b.targets, &read)?)
    })?;
    // Rank 0's loss, or that it failed, to every rank.
    let mut word = [0u8; 5];
    if let Some(Ok(loss)) = &loss {
        word[0] = 1;
        word[1..].copy_from_slice(&loss.to_le_bytes());
    }
    exec.comm().broadcast(0, &mut word)?;
    match loss {
        Some(loss) => loss,
        None if word[0] == 1 => Ok(f32::from_le_bytes(word[1..].try_into().expect("4 bytes"))),
        None => Err("rank 0 could not evaluate the held-out batch".into()),
    }
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
            " (skipped: non-finite gradients)"
        } else {
            ""
        }
    );
    if bar.is_hidden() {
        let every = (steps / 20).max(10);
        if step == first || step == steps || step.is_multiple_of(every) || eval_loss.is_some() {
            crate::logging::stderr_line(&format!("step {step}/{steps} {msg} eta {eta:.0}s"));
        }
    } else {
        bar.set_position(step);
        bar.set_message(msg);
    }
}
