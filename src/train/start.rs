//! Where a run's parameters and trainer state come from ([`starting_point`]): initialised
//! from the seed, read from a model folder's weights, or resumed from a checkpoint (the
//! whole of one, or this rank's shard of one sharded by as many ranks), refused when the
//! checkpoint's model or data position does not fit this run; and the executor that holds
//! them ([`executor`]).
//!
//! Not here: the checkpoint format (the engine's `checkpoint`) or the steps.

use std::cell::Cell;
use std::path::Path;
use std::time::Instant;

use strata_engine::checkpoint::{self, TrainerState};
use strata_engine::device::Device;
use strata_engine::exec::{ExecConfig, Executor};
use strata_engine::model::lora::layout::adapter_slots;
use strata_engine::model::lora::{LoraAdapter, init_block_adapters};
use strata_engine::model::weights;
use strata_engine::model::{BaseQuant, Model, ModelError};
use strata_engine::plan::{Plan, fmt_bytes};

use super::group::Ranks;
use crate::model_source::is_shape;
use crate::train_config::{Dtype, TrainConfig};

type Error = Box<dyn std::error::Error>;

/// The initial fp16 loss scale.
const FP16_INITIAL_SCALE: f32 = 65536.0;

/// Where a fresh run's parameters come from, a block at a time: initialised from the
/// seed (a preset, a shape, or a folder of only `config.json`) or read from a folder's
/// weights, with a LoRA run's adapters from `--init-adapter` when given. Neither holds
/// more than one block's parameters while the executor loads.
pub struct FreshParams {
    source: FreshSource,
    /// The adapter a LoRA run starts from, written over each block's adapters.
    adapter: Option<LoraAdapter>,
}

enum FreshSource {
    /// `Model::init_block` from the seed.
    Init(Model, u64),
    /// A folder's weights, every tensor found and checked when opened (and a LoRA
    /// model's adapters initialised from the seed).
    Pretrained(weights::PretrainedBlocks, u64),
}

impl FreshParams {
    /// `model` being the configuration's; initialised from the seed for a shape, or
    /// with `from_scratch`, whatever weights the folder holds.
    pub(super) fn of(cfg: &TrainConfig, model: &Model) -> Result<Self, Error> {
        let adapter = match &cfg.init_adapter {
            Some(dir) => Some(LoraAdapter::read(dir, model)?),
            None => None,
        };
        let source = if cfg.from_scratch || is_shape(&cfg.model) {
            FreshSource::Init(model.clone(), cfg.seed)
        } else {
            FreshSource::Pretrained(
                weights::PretrainedBlocks::open(Path::new(&cfg.model), model)?,
                cfg.seed,
            )
        };
        Ok(FreshParams { source, adapter })
    }

    /// Block `b`'s f32 parameters with `trained` over its trained elements (a LoRA
    /// model's adapters as a run left them; empty for a block that trains nothing).
    pub(super) fn block_under(
        &self,
        model: &Model,
        b: usize,
        trained: &[f32],
    ) -> Result<Vec<f32>, ModelError> {
        let mut params = self.block(model, b)?;
        params[model.blocks()[b].frozen..].copy_from_slice(trained);
        Ok(params)
    }

    /// Block `b`'s f32 parameters; an error naming the tensor and its file when a
    /// folder's weights hold a NaN or an infinity.
    pub(super) fn block(&self, model: &Model, b: usize) -> Result<Vec<f32>, ModelError> {
        let mut params = match &self.source {
            FreshSource::Init(model, seed) => model.init_block(b, *seed),
            FreshSource::Pretrained(blocks, seed) => {
                let mut params = blocks.read_block(b)?;
                if model.lora_config().is_some() {
                    // The base's folder has no adapters: peft's starting ones.
                    init_block_adapters(model, b, *seed, &mut params)?;
                }
                params
            }
        };
        if let Some(adapter) = &self.adapter {
            let block = &model.blocks()[b];
            for w in adapter.layers.iter().filter(|w| w.layer.block == b) {
                let slots = adapter_slots(block, &w.layer);
                params[slots.a.range()].copy_from_slice(&w.a);
                params[slots.b.range()].copy_from_slice(&w.b);
            }
        }
        Ok(params)
    }
}

/// Block `b`'s whole state from a LoRA checkpoint's `state` of its trained elements:
/// the base's parameters from `base` with the adapters' over them, the moments zero but
/// the adapters'.
fn over_base(
    model: &Model,
    b: usize,
    base: &FreshParams,
    state: [Vec<f32>; 3],
) -> Result<[Vec<f32>; 3], ModelError> {
    let block = &model.blocks()[b];
    let [master, m, v] = state;
    let params = base.block_under(model, b, &master)?;
    let [m, v] = [m, v].map(|x| {
        let mut whole = vec![0f32; block.len];
        whole[block.frozen..].copy_from_slice(&x);
        whole
    });
    Ok([params, m, v])
}

/// Where a run's parameters come from.
pub enum Initial {
    /// A fresh run's, made or read a block at a time as they are loaded.
    Fresh(FreshParams),
    /// A checkpoint, verified and read a block at a time as it is loaded: whole blocks
    /// (an ordinary one, or one sharded by another number of ranks), or this rank's
    /// shards of them (one sharded by as many ranks).
    /// A LoRA model's checkpoint holds its adapters' state alone: its base is read as a
    /// fresh run reads it, the adapters put over it.
    Checkpoint(Box<checkpoint::Opened>, Option<FreshParams>),
}

/// The run's parameters and trainer state: resumed from `cfg.resume` (this rank's
/// shard of a checkpoint sharded by as many ranks as this run's, else the whole), or a
/// fresh run's. The state records the configuration and the ranks.
pub fn starting_point(
    cfg: &TrainConfig,
    model: &Model,
    plan: &Plan,
    ranks: &Ranks,
) -> Result<(Initial, TrainerState), Error> {
    let (initial, mut state) = match &cfg.resume {
        Some(path) => resumed(path, cfg, model, plan, ranks)?,
        None => (
            Initial::Fresh(FreshParams::of(cfg, model)?),
            fresh_state(cfg),
        ),
    };
    state.config = serde_json::to_value(cfg)?;
    if let Some(config) = state.config.as_object_mut() {
        config.insert("ranks".into(), ranks.ranks.into());
    }
    Ok((initial, state))
}

/// A fresh run's trainer state: step 0, at the start of the data.
fn fresh_state(cfg: &TrainConfig) -> TrainerState {
    TrainerState {
        step: 0,
        data_position: 0,
        rng: cfg.seed,
        loss_scale: if cfg.dtype == Dtype::Fp16 {
            FP16_INITIAL_SCALE
        } else {
            1.0
        },
        good_steps: 0,
        skipped_steps: 0,
        config: serde_json::Value::Null,
    }
}

/// The checkpoint at `path`: this rank's shard when it was sharded by as many ranks and
/// of this plan's shard lengths (shards of another length, from a strata that padded
/// them otherwise, are read whole instead), else the whole.
fn resumed(
    path: &Path,
    cfg: &TrainConfig,
    model: &Model,
    plan: &Plan,
    ranks: &Ranks,
) -> Result<(Initial, TrainerState), Error> {
    let dir = checkpoint::resolve(path)?;
    let expected: Vec<usize> = (0..model.blocks().len())
        .map(|b| plan.shard_len[b] as usize)
        .collect();
    let sharded = ranks.ranks > 1 && checkpoint::written_by_ranks(&dir)? == Some(ranks.ranks);
    let started = Instant::now();
    let shard = if sharded {
        Some(checkpoint::open_shard(&dir, ranks.rank, ranks.ranks)?)
            .filter(|s| s.own_shard_len() == Some(&expected[..]))
    } else {
        None
    };
    let opened = match shard {
        Some(shard) => shard,
        None => checkpoint::open(&dir)?,
    };
    log::info!(
        "verified {} (crc32c of {}) in {:.2} s",
        opened.dir().display(),
        if opened.own_shard_len().is_some() {
            "this rank's shard and the small files"
        } else {
            "every file"
        },
        started.elapsed().as_secs_f64()
    );
    check_resumed_model(path, opened.model(), model)?;
    check_resume_settings(path, &opened.state().config, cfg, ranks.ranks)?;
    let state = opened.state().clone();
    let base = match model.lora_config() {
        Some(_) => Some(FreshParams::of(cfg, model)?),
        None => None,
    };
    Ok((Initial::Checkpoint(Box::new(opened), base), state))
}

/// Refuses a checkpoint of another model than the configured one. A LoRA checkpoint
/// holds its adapters alone: the base is `--model`'s, stored as `--quant` says (which
/// [`check_resume_settings`] compares with the run's that wrote it).
fn check_resumed_model(path: &Path, found: &Model, configured: &Model) -> Result<(), Error> {
    let found = match configured.base_quant() {
        Some(quant) if found.lora_config().is_some() => found.quantized(quant)?,
        _ => found.clone(),
    };
    if found != *configured {
        return Err(format!(
            "--resume {}: the checkpoint's model, {}, is not the configured one, {}; resume \
             with the same --model",
            path.display(),
            found.describe(),
            configured.describe()
        )
        .into());
    }
    Ok(())
}

/// Refuses to resume a checkpoint under settings that change what its data position
/// means: the batch, the sequence length, the accumulation, or the data file; or what a
/// batch trains: packing.
fn check_resume_settings(
    path: &Path,
    saved: &serde_json::Value,
    cfg: &TrainConfig,
    ranks: usize,
) -> Result<(), Error> {
    let Some((saved, saved_ranks)) = TrainConfig::recorded(saved) else {
        // A checkpoint from before settings were recorded: nothing to compare.
        return Ok(());
    };
    let data = |d: &Option<std::path::PathBuf>| {
        d.as_ref().map_or("the built-in corpus".to_string(), |p| {
            p.display().to_string()
        })
    };
    let mut changed = Vec::new();
    for (name, then, now) in [
        ("--batch", saved.batch.to_string(), cfg.batch.to_string()),
        ("--seq", saved.seq.to_string(), cfg.seq.to_string()),
        (
            // A step's micro-batches: N ranks' --grad-accum a are one process's N * a.
            "--grad-accum x ranks",
            (saved.grad_accum * saved_ranks).to_string(),
            (cfg.grad_accum * ranks).to_string(),
        ),
        ("--data", data(&saved.data), data(&cfg.data)),
        ("--pack", saved.pack.to_string(), cfg.pack.to_string()),
    ] {
        if then != now {
            changed.push(format!("{name} {then} (now {now})"));
        }
    }
    if saved.quant != cfg.quant {
        let name = |q: Option<BaseQuant>| q.map_or("none".to_string(), |q| q.to_string());
        return Err(format!(
            "--resume {}: the checkpoint's adapters were trained over a base stored as \
             --quant {}, and this run stores it as {}: resume with --quant {} (adapters \
             fitted to one base's values do not carry over to another's)",
            path.display(),
            name(saved.quant),
            name(cfg.quant),
            name(saved.quant)
        )
        .into());
    }
    if changed.is_empty() {
        return Ok(());
    }
    Err(format!(
        "--resume {}: the checkpoint was trained with {}; its data position counts batches \
         of those (and packing changes what a batch trains), so resume with the same \
         settings",
        path.display(),
        changed.join(", ")
    )
    .into())
}

/// Loads the checkpoint `opened` into `exec` a block at a time (whole blocks, or this
/// rank's shards of them; a LoRA model's adapters over its base, read from `base`); logs
/// the rate.
fn load_checkpoint(
    exec: &mut Executor,
    opened: &checkpoint::Opened,
    base: Option<&FreshParams>,
) -> Result<(), Error> {
    let started = Instant::now();
    let read_bytes = Cell::new(0u64);
    let model = exec.model().clone();
    let read = |b: usize| {
        let state = opened.block(b).map_err(|e| ModelError::Source {
            what: format!("reading block {b} of {}", opened.dir().display()),
            source: Box::new(e),
        })?;
        read_bytes.set(read_bytes.get() + 12 * state[0].len() as u64);
        match base {
            Some(base) => over_base(&model, b, base, state),
            None => Ok(state),
        }
    };
    if opened.own_shard_len().is_some() {
        exec.load_shard_blocks(&read)?;
    } else {
        exec.load_state_blocks(&read)?;
    }
    let seconds = started.elapsed().as_secs_f64();
    log::info!(
        "resumed from {}: {} of state in {seconds:.2} s ({:.0} MB/s)",
        opened.dir().display(),
        fmt_bytes(read_bytes.get()),
        read_bytes.get() as f64 / seconds.max(1e-9) / 1e6
    );
    Ok(())
}

/// The executor of `plan` on `device`, holding `initial`, at step `state`'s (less its
/// skipped steps, which AdamW did not count).
pub fn executor(
    model: &Model,
    plan: Plan,
    device: Device,
    exec_config: &ExecConfig,
    initial: Initial,
    state: &TrainerState,
) -> Result<Executor, Error> {
    let mut exec = Executor::new(model.clone(), plan, device, exec_config)?;
    match &initial {
        Initial::Checkpoint(opened, base) => load_checkpoint(&mut exec, opened, base.as_ref())?,
        Initial::Fresh(fresh) => {
            let model = exec.model().clone();
            exec.load_blocks(&|b| fresh.block(&model, b))?
        }
    }
    drop(initial);
    exec.set_steps(state.step - state.skipped_steps);
    Ok(exec)
}
