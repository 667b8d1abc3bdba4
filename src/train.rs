//! `strata train`: a fine-tuning (or from-scratch) run of a GPT-2 under a swap policy,
//! with checkpoints that never lose the run and exact resume.
//!
//! The run: resolve the configuration (defaults, TOML file, flags); build or load the
//! model, or resume a checkpoint; plan one step under the policy and the budgets (a plan
//! that does not fit is refused before anything is allocated); build the executor; then
//! step through the batches in file order, with the learning-rate schedule, gradient
//! accumulation, clipping and fp16 loss scaling, a progress line, JSON-lines metrics, a
//! Chrome trace of one step, checkpoints every N steps and on Ctrl-C, and the final
//! model in Hugging Face's format.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use strata_comm::Collective;
use strata_engine::checkpoint::{self, Checkpoint, TrainerState};
use strata_engine::device::{DeviceChoice, DeviceConfig, choose_target, select};
use strata_engine::exec::{ExecConfig, ExecError, Executor, Runner, StepParams, StepReport};
use strata_engine::kernels::adamw::AdamW;
use strata_engine::model::data::{Batch, TokenData, TokenFormat};
use strata_engine::model::tokenize::{TextTokenizer, cached_tokens, tokenizer_file};
use strata_engine::model::weights::{self, FileDtype, Pretrained, SaveOptions};
use strata_engine::model::{Gpt2Config, Llama, LlamaConfig, Model, ModelError, Target};
use strata_engine::plan::{
    Auto, Budgets, CostModel, Plan, PlanInput, Policy, Precision, StepShape, Tier, fmt_bytes,
};

use crate::report::Table;
use crate::train_config::{Dtype, TrainArgs, TrainConfig};

type Error = Box<dyn std::error::Error>;

/// Ctrl-C presses seen: the first finishes the step and checkpoints, the second exits.
static INTERRUPTS: AtomicU32 = AtomicU32::new(0);

extern "C" fn on_interrupt(_: libc::c_int) {
    if INTERRUPTS.fetch_add(1, Ordering::SeqCst) >= 1 {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(130) };
    }
}

fn install_interrupt_handler() {
    let handler = on_interrupt as extern "C" fn(libc::c_int);
    // SAFETY: the handler only touches an atomic and calls _exit, both async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, handler as libc::sighandler_t);
    }
}

/// The initial fp16 loss scale, and how many good steps double it.
const FP16_INITIAL_SCALE: f32 = 65536.0;
const FP16_GROWTH_INTERVAL: u64 = 200;

/// The policy a configuration names, with its prefetch depth; `None` for auto.
pub fn named_policy(name: &str, depth: Option<usize>) -> Result<Option<Box<dyn Policy>>, Error> {
    if name == "auto" {
        return Ok(None);
    }
    let builtin: strata_engine::plan::BuiltinPolicy = name.parse()?;
    Ok(Some(builtin.policy(depth.unwrap_or(2))))
}

/// Where swap files and the generated corpus go by default: the system temp dir, or
/// `target/` when that is tmpfs (O_DIRECT needs a real filesystem).
pub fn default_scratch_dir() -> PathBuf {
    let tmp = std::env::temp_dir();
    if strata_engine::storage::is_tmpfs(&tmp) {
        PathBuf::from("target")
    } else {
        tmp
    }
}

/// Why a folder cannot hold the NVMe tier's swap files, if it cannot: tmpfs is RAM, not a
/// drive (swap files there take the memory the host tier needs; some kernels refuse it
/// O_DIRECT, newer ones accept it). The one answer `train`, `bench step` and `doctor`
/// give.
pub fn swap_folder_refusal(dir: &Path) -> Option<String> {
    strata_engine::storage::is_tmpfs(dir).then(|| {
        format!(
            "{} is on tmpfs, which is RAM, not a drive: swap files there would take the \
             memory the host tier needs; give a folder on a real disk (such as /var/tmp)",
            dir.display()
        )
    })
}

/// A GPT-2 shape written `LAYERSxWIDTH` (`40x5120`: heads of 128 channels, GPT-2's
/// vocabulary and context), for planning sizes that have no preset.
pub(crate) fn custom_shape(name: &str) -> Option<Gpt2Config> {
    let (layers, width) = crate::train_config::shape_spec(name)?;
    Some(Gpt2Config::new(
        layers,
        (width / 128).max(1),
        width,
        50257,
        1024,
    ))
}

/// The model a configuration names, without parameters: a preset, `LAYERSxWIDTH`, or a
/// directory's `config.json`.
pub fn model_shape(cfg: &TrainConfig) -> Result<Model, Error> {
    if let Ok(config) = Gpt2Config::preset(&cfg.model) {
        return Ok(Model::new(config)?);
    }
    if let Some(config) = LlamaConfig::preset(&cfg.model) {
        return Ok(Model::of(Llama::new(config)?));
    }
    if let Some(config) = custom_shape(&cfg.model) {
        return Ok(Model::new(config)?);
    }
    let (config, _) = weights::model_files(Path::new(&cfg.model));
    Ok(weights::load_config(&config)?)
}

/// Where a fresh run's parameters come from, a block at a time: initialised from the
/// seed (a preset, a shape, or a folder of only `config.json`) or read from a folder's
/// weights. Neither holds more than one block's parameters while the executor loads.
enum FreshParams {
    /// `Model::init_block` from the seed.
    Init(Model, u64),
    /// A folder's weights, every tensor found and checked when opened.
    Pretrained(weights::PretrainedBlocks),
}

impl FreshParams {
    /// `model` being the configuration's ([`model_shape`]).
    fn of(cfg: &TrainConfig, model: &Model) -> Result<Self, Error> {
        if is_shape(cfg) {
            return Ok(FreshParams::Init(model.clone(), cfg.seed));
        }
        let blocks = weights::PretrainedBlocks::open(Path::new(&cfg.model), model)?;
        Ok(FreshParams::Pretrained(blocks))
    }

    /// Block `b`'s f32 parameters.
    fn block(&self, b: usize) -> Vec<f32> {
        match self {
            FreshParams::Init(model, seed) => model.init_block(b, *seed),
            FreshParams::Pretrained(blocks) => blocks.read_block(b),
        }
    }
}

/// Whether the configured model is a shape without weights (a preset, `LAYERSxWIDTH`,
/// or a folder of only `config.json`), initialised from the seed.
fn is_shape(cfg: &TrainConfig) -> bool {
    Gpt2Config::preset(&cfg.model).is_ok()
        || LlamaConfig::preset(&cfg.model).is_some()
        || custom_shape(&cfg.model).is_some()
        || has_no_weights(Path::new(&cfg.model))
}

/// Whether `path` is a model folder holding a `config.json` and no weights of any
/// format: a shape, trained from a random initialisation like a preset.
pub fn has_no_weights(path: &Path) -> bool {
    path.is_dir()
        && path.join(weights::CONFIG_FILE).is_file()
        && ![
            weights::WEIGHTS_FILE,
            "model.safetensors.index.json",
            "pytorch_model.bin",
        ]
        .iter()
        .any(|f| path.join(f).exists())
}

/// The folder a configuration's model was read from, described (headers only), when it
/// names one rather than a preset or a shape.
fn pretrained_source(cfg: &TrainConfig) -> Result<Option<Pretrained>, Error> {
    if is_shape(cfg) {
        return Ok(None);
    }
    Ok(Some(weights::describe_pretrained(Path::new(&cfg.model))?.1))
}

/// The file type of a configured dtype.
fn file_dtype(dtype: Dtype) -> FileDtype {
    match dtype {
        Dtype::Fp32 => FileDtype::F32,
        Dtype::Bf16 => FileDtype::Bf16,
        Dtype::Fp16 => FileDtype::F16,
    }
}

/// The tokens of `path` for `model`: an llm.c token file as it is; text or JSON lines
/// tokenized with the model folder's `tokenizer.json` (once, cached beside the data);
/// text read one byte per token for a model of vocabulary 256 without a tokenizer. Any
/// other model with raw text is refused, naming the fix.
fn open_data(
    path: &Path,
    cfg: &TrainConfig,
    model: &Model,
    out: &mut impl Write,
) -> Result<TokenData, Error> {
    let bytes = TokenData::open(path)?;
    if bytes.format() != TokenFormat::Bytes {
        return Ok(bytes);
    }
    let model_dir = Path::new(&cfg.model);
    let model_dir = if model_dir.is_file() {
        model_dir.parent().unwrap_or(Path::new("."))
    } else {
        model_dir
    };
    let tokenizer = tokenizer_file(model_dir);
    let jsonl = path.extension().is_some_and(|e| e == "jsonl");
    if !tokenizer.is_file() {
        if model.vocab() == 256 && !jsonl {
            return Ok(bytes);
        }
        return Err(format!(
            "--data {}: {} for a model of vocabulary {} needs the model's tokenizer, and {} \
             has no tokenizer.json; give --model a folder holding one, or tokenize the \
             data first (strata tokenize --tokenizer TOKENIZER.json --input {} --output \
             DATA.bin) and give --data DATA.bin",
            path.display(),
            if jsonl { "JSON lines" } else { "raw text" },
            model.vocab(),
            if Path::new(&cfg.model).exists() {
                model_dir.display().to_string()
            } else {
                format!("the preset {}", cfg.model)
            },
            path.display()
        )
        .into());
    }
    let tokenizer = TextTokenizer::open(&tokenizer)?;
    if tokenizer.vocab_size() > model.vocab() {
        return Err(format!(
            "{}: the tokenizer has {} ids but the model's vocabulary is {}; give the \
             model's own tokenizer",
            tokenizer.path().display(),
            tokenizer.vocab_size(),
            model.vocab()
        )
        .into());
    }
    let bar = crate::tokenize::bytes_bar(std::fs::metadata(path)?.len(), "tokenizing ");
    let started = Instant::now();
    let (tokens, fresh) = cached_tokens(
        &tokenizer,
        path,
        &default_scratch_dir(),
        &mut |done, tokens| {
            bar.set_position(done);
            bar.set_message(format!("{tokens} tokens"));
        },
    )?;
    bar.finish_and_clear();
    let data = TokenData::open(&tokens)?;
    let seconds = started.elapsed().as_secs_f64();
    writeln!(
        out,
        "data: {} tokenized with {} into {} tokens{}{}, {}",
        path.display(),
        tokenizer.path().display(),
        data.len(),
        if data.has_mask() {
            " (the loss counts completions only)"
        } else {
            ""
        },
        if fresh {
            format!(
                " in {seconds:.1} s ({:.0} tokens/s)",
                data.len() as f64 / seconds
            )
        } else {
            String::new()
        },
        if fresh { "cached as" } else { "from the cache" },
    )?;
    writeln!(out, "  {}", tokens.display())?;
    Ok(data)
}

/// The budgets of a run and where they come from.
#[derive(Debug, Clone)]
pub struct RunBudgets {
    /// The budgets the plan must fit.
    pub budgets: Budgets,
    /// The folders of the NVMe tier.
    pub nvme_dirs: Vec<PathBuf>,
    /// Free bytes in those folders now.
    pub nvme_free: u64,
    /// Whether the NVMe budget was stated (`--nvme-mem`) rather than taken from the
    /// free space.
    pub nvme_stated: bool,
}

impl RunBudgets {
    /// The NVMe folders, for messages.
    pub fn dirs_text(&self) -> String {
        self.nvme_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Where the NVMe budget comes from, in words, with the folders.
    pub fn nvme_source(&self) -> String {
        let dirs = self.dirs_text();
        if self.nvme_stated {
            format!("stated; {} free in {dirs}", fmt_bytes(self.nvme_free))
        } else {
            format!("90% of free space in {dirs}")
        }
    }

    /// Refuses a plan whose NVMe peak is more than the folders' free space (a stated
    /// budget can be larger than the drive, which `strata plan` may ask about, but a
    /// run would fail part-way with "no space left").
    pub fn check_free(&self, plan: &Plan) -> Result<(), Error> {
        let need = plan.peak[Tier::Nvme.index()];
        if need > self.nvme_free {
            return Err(format!(
                "plan {} needs {} of NVMe but {} has only {} free; free space there, \
                 or give more folders with --nvme",
                plan.policy,
                fmt_bytes(need),
                self.dirs_text(),
                fmt_bytes(self.nvme_free)
            )
            .into());
        }
        Ok(())
    }
}

/// The budgets of a configuration on `target`, and the folders of the NVMe tier. With
/// no device budget stated it is what the device has: the available RAM for the CPU
/// device, the GPU's memory less 1 GiB for CUDA's own (its context, cuBLAS). With no
/// NVMe budget stated it is 90% of the folders' free space.
pub fn budgets_of(cfg: &TrainConfig, target: Target) -> Result<RunBudgets, Error> {
    let ram = crate::doctor::meminfo_bytes("MemAvailable").unwrap_or(8 << 30);
    let device_default = match target {
        Target::Cpu => ram,
        Target::Cuda => match strata_engine::kernels::cuda::describe_driver() {
            Ok(d) if !d.gpus.is_empty() => d.gpus[0].memory_bytes.saturating_sub(1 << 30),
            _ if cfg.device_mem_bytes()?.is_some() => 0,
            Ok(_) | Err(_) => {
                return Err(
                    "--device cuda: no GPU is visible here to say its memory; give \
                            --device-mem (such as 24GiB) to plan for one"
                        .into(),
                );
            }
        },
    };
    let device = cfg.device_mem_bytes()?.unwrap_or(device_default);
    let host = cfg.host_mem_bytes()?.unwrap_or(ram);
    let dirs = if cfg.nvme.is_empty() {
        vec![default_scratch_dir().join("strata-nvme")]
    } else {
        cfg.nvme.clone()
    };
    let mut free = 0u64;
    for d in &dirs {
        std::fs::create_dir_all(d).map_err(|e| format!("--nvme {}: {e}", d.display()))?;
        if let Some(why) = swap_folder_refusal(d) {
            return Err(format!("--nvme {why}").into());
        }
        free += strata_engine::storage::available_bytes(d)?;
    }
    let stated = cfg.nvme_mem_bytes()?;
    Ok(RunBudgets {
        budgets: Budgets {
            device,
            host,
            // Leave room on the drives for checkpoints and everything else.
            nvme: stated.unwrap_or(free / 10 * 9),
        },
        nvme_dirs: dirs,
        nvme_free: free,
        nvme_stated: stated.is_some(),
    })
}

/// Refuses to resume a checkpoint under settings that change what its data position
/// means: the batch, the sequence length, the accumulation, or the data file.
fn check_resume_settings(
    path: &Path,
    saved: &serde_json::Value,
    cfg: &TrainConfig,
    ranks: usize,
) -> Result<(), Error> {
    let Some((saved, saved_ranks)) = recorded_config(saved) else {
        // A checkpoint from before settings were recorded: nothing to compare.
        return Ok(());
    };
    let data = |d: &Option<PathBuf>| {
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
    ] {
        if then != now {
            changed.push(format!("{name} {then} (now {now})"));
        }
    }
    if changed.is_empty() {
        return Ok(());
    }
    Err(format!(
        "--resume {}: the checkpoint was trained with {}; its data position counts batches \
         of those, so resume with the same settings",
        path.display(),
        changed.join(", ")
    )
    .into())
}

/// The configuration a checkpoint's trainer state records, and the number of ranks that
/// trained it (the `ranks` key beside the configuration's; 1 when absent). `None` for a
/// checkpoint from before settings were recorded.
pub fn recorded_config(saved: &serde_json::Value) -> Option<(TrainConfig, usize)> {
    let mut saved = saved.clone();
    let ranks = saved
        .as_object_mut()?
        .remove("ranks")
        .and_then(|r| r.as_u64())
        .unwrap_or(1);
    let cfg = serde_json::from_value::<TrainConfig>(saved).ok()?;
    Some((cfg, ranks.max(1) as usize))
}

/// The step shape of a configuration, for `target`'s kernels.
pub fn shape_of(cfg: &TrainConfig, target: Target) -> StepShape {
    let precision = match cfg.dtype {
        Dtype::Fp32 => Precision::Fp32,
        Dtype::Bf16 => Precision::Bf16,
        Dtype::Fp16 => Precision::Fp16,
    };
    StepShape {
        batch: cfg.batch,
        seq: cfg.seq,
        grad_accum: cfg.grad_accum,
        precision,
        needs_global_norm: cfg.clip > 0.0 || precision == Precision::Fp16,
        delayed_update: cfg.delayed_update,
        target,
        recompute: cfg.recompute,
        grad_spill: cfg.spill_grads,
        ranks: 1,
        // The CPU device's collectives run on its memory, a GPU's through NCCL where it
        // loads (else they are staged through host memory).
        device_collectives: target == Target::Cpu || strata_engine::device::nccl_available(),
    }
}

/// Plans a step: the named policy, or the fastest that fits (auto). Refuses a plan that
/// does not fit, before anything is allocated.
pub fn plan_of(cfg: &TrainConfig, input: &PlanInput<'_>, cost: CostModel) -> Result<Plan, Error> {
    match named_policy(&cfg.policy, cfg.prefetch)? {
        Some(policy) => {
            let plan = Plan::build(input, policy.as_ref())?;
            plan.check_fits(input)?;
            Ok(plan)
        }
        None => Ok(Auto { cost }.choose(input)?.1),
    }
}

/// The device a configuration names (`auto`, `cpu`, `cuda`).
pub fn device_choice(cfg: &TrainConfig) -> DeviceChoice {
    match cfg.device.as_str() {
        "cpu" => DeviceChoice::Cpu,
        "cuda" => DeviceChoice::Cuda,
        _ => DeviceChoice::Auto,
    }
}

/// The group this run trains in: under `mpirun`, every rank of the job (MPI, when this
/// build has it); else none, this process alone.
pub fn open_group() -> Result<Option<Arc<dyn Collective>>, Error> {
    if let Some(message) = strata_comm::mpi_missing_message() {
        return Err(message.into());
    }
    #[cfg(feature = "mpi")]
    if let Some(mpi) = strata_comm::Mpi::init()? {
        return Ok(Some(Arc::new(mpi)));
    }
    Ok(None)
}

/// `strata train`. Under `mpirun` (a build with `--features mpi`) each process is one
/// rank of ZeRO-3 data parallelism: see [`run_in`].
pub fn run(args: &TrainArgs) -> Result<(), Error> {
    let cfg = args.resolve()?;
    if args.print_config {
        print!("{}", cfg.to_toml());
        return Ok(());
    }
    let group = open_group()?;
    let result = run_in(cfg, group.clone());
    if let (Err(e), Some(group)) = (&result, &group) {
        // The other ranks would wait for this one at their next collective: end the job,
        // saying why first (MPI's abort ends every process, this one included).
        eprintln!("strata: error: rank {}: {e}", group.rank());
        group.abort(&e.to_string());
    }
    result
}

/// `--nvme` folders of rank `rank` of `ranks`: `{rank}` in a path is replaced by the
/// rank; with several ranks, a path without it gets a `rank-N` folder of its own.
fn rank_dirs(dirs: &[PathBuf], rank: usize, ranks: usize) -> Vec<PathBuf> {
    dirs.iter()
        .map(|d| {
            let text = d.to_string_lossy();
            if text.contains("{rank}") {
                PathBuf::from(text.replace("{rank}", &rank.to_string()))
            } else if ranks > 1 {
                d.join(format!("rank-{rank}"))
            } else {
                d.clone()
            }
        })
        .collect()
}

/// Rank 0's `values` on every rank (a broadcast of their bytes).
fn from_rank0(group: &dyn Collective, values: &mut [&mut f64]) -> Result<(), Error> {
    let mut bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    group.broadcast(0, &mut bytes)?;
    for (v, b) in values.iter_mut().zip(bytes.chunks_exact(8)) {
        **v = f64::from_le_bytes(b.try_into().expect("8 bytes"));
    }
    Ok(())
}

/// A number that is the same for processes of one machine and differs between machines
/// (its boot id, else its host name, hashed).
fn machine_id() -> u64 {
    use std::hash::{Hash, Hasher};
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .unwrap_or_default();
    // SipHash with fixed keys: the same in every process of this build.
    let mut h = std::hash::DefaultHasher::new();
    id.trim().hash(&mut h);
    h.finish()
}

/// With ranks, the budgets every rank plans with. A budget the user gave is per rank, as
/// stated. One taken from this machine (its free memory or disk) is shared by the ranks
/// on it: each rank's share is that divided by how many ranks run here. Every rank plans
/// with the smallest share of any rank (the same plan everywhere, fitting everywhere).
fn shared_budgets(
    group: &dyn Collective,
    budgets: &mut Budgets,
    measured: [bool; 3],
    machine: u64,
) -> Result<(), Error> {
    let mut machines = vec![0u8; 8 * group.size()];
    group.all_gather(&machine.to_le_bytes(), &mut machines)?;
    let here = machines
        .chunks_exact(8)
        .filter(|m| *m == machine.to_le_bytes())
        .count() as u64;
    let mut mine = [budgets.device, budgets.host, budgets.nvme];
    for (b, shared) in mine.iter_mut().zip(measured) {
        if shared {
            *b /= here.max(1);
        }
    }
    let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut all = vec![0u8; 24 * group.size()];
    group.all_gather(&bytes, &mut all)?;
    for (i, b) in mine.iter_mut().enumerate() {
        *b = all
            .chunks_exact(24)
            .map(|r| u64::from_le_bytes(r[8 * i..8 * i + 8].try_into().expect("8 bytes")))
            .min()
            .unwrap_or(*b);
    }
    (budgets.device, budgets.host, budgets.nvme) = (mine[0], mine[1], mine[2]);
    Ok(())
}

/// `strata train` in `group` (none: alone). With N ranks, every rank plans the same step
/// (one set of budgets, see `shared_budgets`; rank 0's measured rates), owns 1/N of
/// every block's parameters, gradients and optimizer state, and takes micro-batches r,
/// r + N, ... of each step's N × grad-accum: the same computation as one process with
/// N-fold accumulation, bit for bit. Rank 0 prints and logs; every rank writes its shard
/// of each checkpoint; rank 0 writes `--out`.
pub fn run_in(mut cfg: TrainConfig, group: Option<Arc<dyn Collective>>) -> Result<(), Error> {
    let (rank, ranks) = group.as_ref().map_or((0, 1), |g| (g.rank(), g.size()));
    if ranks > 1 && cfg.nvme.is_empty() {
        cfg.nvme = vec![default_scratch_dir().join("strata-nvme")];
    }
    cfg.nvme = rank_dirs(&cfg.nvme, rank, ranks);
    let choice = device_choice(&cfg);
    let target = choose_target(choice)?;
    let started = Instant::now();
    let mut out: Box<dyn Write> = if rank == 0 {
        Box::new(std::io::stdout().lock())
    } else {
        Box::new(std::io::sink())
    };

    // The model's shape, and the plan: refused here, before any parameter is allocated,
    // when it does not fit.
    let model = model_shape(&cfg)?;
    // Data.
    let data_path = match &cfg.data {
        Some(p) => p.clone(),
        None => crate::corpus::ensure_file(&default_scratch_dir(), crate::corpus::DEFAULT_BYTES, 1)
            .map_err(|e| format!("writing the built-in corpus: {e}"))?,
    };
    let data = match cfg.data {
        Some(_) => open_data(&data_path, &cfg, &model, &mut out)?,
        // The built-in corpus is the default job's, bytes as tokens whatever the model
        // (a plan for a large shape is judged before a batch is read).
        None => TokenData::open(&data_path)?,
    };
    let available = data.batch_count(cfg.batch, cfg.seq);
    // With held-out evaluation the last batch is kept out of training.
    let held_out = (cfg.eval_every > 0).then(|| available.saturating_sub(1));
    let train_batches = available - usize::from(held_out.is_some());
    if train_batches == 0 {
        return Err(format!(
            "{}: {} tokens is not enough for one batch of {} x {} (+1) tokens{}",
            data_path.display(),
            data.len(),
            cfg.batch,
            cfg.seq,
            if held_out.is_some() {
                " besides the held-out batch"
            } else {
                ""
            }
        )
        .into());
    }

    // Plan.
    let mut run_budgets = budgets_of(&cfg, target)?;
    if let Some(group) = &group {
        // Every rank must make the same plan, and the ranks of one machine share its
        // memory and disk.
        let measured = [
            target == Target::Cpu && cfg.device_mem_bytes()?.is_none(),
            cfg.host_mem_bytes()?.is_none(),
            !run_budgets.nvme_stated,
        ];
        shared_budgets(
            group.as_ref(),
            &mut run_budgets.budgets,
            measured,
            machine_id(),
        )?;
    }
    let (budgets, nvme_dirs) = (run_budgets.budgets, &run_budgets.nvme_dirs);
    let shape = shape_of(&cfg, target).with_ranks(ranks);
    let input = PlanInput {
        model: &model,
        shape,
        budgets,
    };
    // This machine's rates, measured in half a second, choose the plan and predict it.
    let mut cost = strata_engine::exec::calibrate(
        &model,
        cfg.batch,
        cfg.seq,
        target,
        nvme_dirs.first().map(|d| d.as_path()),
    )?;
    if let (Some(group), true) = (&group, ranks > 1) {
        // Every rank times the group's all-gather of a layer's shard together.
        let bytes = strata_engine::plan::layer_shard_bytes(&model, shape) as usize;
        cost.collective_bytes_per_s = CostModel::calibrate_collective(group.as_ref(), bytes)?;
    }
    if let Some(group) = &group {
        // And rank 0's rates, so that `auto` picks the same policy everywhere.
        from_rank0(
            group.as_ref(),
            &mut [
                &mut cost.compute_flops,
                &mut cost.h2d_bytes_per_s,
                &mut cost.d2h_bytes_per_s,
                &mut cost.nvme_read_bytes_per_s,
                &mut cost.nvme_write_bytes_per_s,
                &mut cost.adam_params_per_s,
                &mut cost.collective_bytes_per_s,
            ],
        )?;
    }
    let plan = plan_of(&cfg, &input, cost)?;
    if let Some(group) = &group {
        let mine = [
            plan.ops.len() as f64,
            plan.peak[0] as f64,
            plan.peak[1] as f64,
        ];
        let mut all = vec![0u8; 24 * ranks];
        let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
        group.all_gather(&bytes, &mut all)?;
        if all.chunks_exact(24).any(|c| c != &bytes[..]) {
            return Err(format!(
                "rank {rank}: the ranks made different plans (rank {rank}: {}); every rank \
                 must run the same configuration",
                plan.policy
            )
            .into());
        }
    }
    check_whole_model_memory(&cfg, &plan, &model, target, ranks)?;
    run_budgets.check_free(&plan)?;
    let predicted = cost.predict(&plan);
    // The device, with the plan's device memory as its budget.
    let (device, why) = select(
        choice,
        &DeviceConfig {
            memory_budget_bytes: plan.peak[Tier::Device.index()].max(1) as usize,
            // With ranks, each drives the GPU of its rank on its node.
            cuda_ordinal: if ranks > 1 {
                strata_comm::LaunchEnv::from_env()
                    .and_then(|e| e.local_rank)
                    .unwrap_or(rank)
            } else {
                0
            },
            cuda_needs_kernels: true,
        },
    )?;
    writeln!(
        out,
        "strata train: {} ({} params: {} layers, {} wide, vocab {}) on {} ({} tokens), device {}",
        cfg.model,
        model.param_count(),
        model.layers(),
        model.width(),
        model.vocab(),
        data_path.display(),
        data.len(),
        device.name()
    )?;
    log::info!("device: {why}");
    if ranks > 1 {
        writeln!(
            out,
            "ranks: {ranks} (ZeRO-3: each owns 1/{ranks} of every block's parameters, gradients \
             and optimizer state, and runs {} of the step's {} micro-batches; figures below \
             are per rank)",
            cfg.grad_accum,
            cfg.grad_accum * ranks
        )?;
    }
    writeln!(
        out,
        "plan {}: peak device {} of {}, host {} of {}, nvme {} (in {}); {}; predicted {:.3} s/step",
        plan.policy,
        fmt_bytes(plan.peak[0]),
        fmt_bytes(budgets.device),
        fmt_bytes(plan.peak[1]),
        fmt_bytes(budgets.host),
        fmt_bytes(plan.peak[2]),
        run_budgets.dirs_text(),
        plan.recompute_summary(),
        predicted.step_seconds
    )?;
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

    // Parameters: initialised, loaded, or resumed (a checkpoint sharded by as many ranks
    // as this run's: each rank reads its own shard).
    let resumed = match &cfg.resume {
        Some(path) => {
            let dir = checkpoint::resolve(path)?;
            let expected: Vec<usize> = (0..model.blocks().len())
                .map(|b| plan.shard_len[b] as usize)
                .collect();
            let shard = if ranks > 1 && checkpoint::written_by_ranks(&dir)? == Some(ranks) {
                // Shards of another length (a strata that padded them otherwise) are read
                // whole instead.
                Some(checkpoint::load_shard(&dir, rank, ranks)?).filter(|s| s.shard_len == expected)
            } else {
                None
            };
            if let Some(shard) = shard {
                check_resumed_model(path, &shard.model, &model)?;
                check_resume_settings(path, &shard.state.config, &cfg, ranks)?;
                Some((
                    Initial::Shard((shard.params, shard.m, shard.v)),
                    shard.state,
                ))
            } else {
                let ckpt = checkpoint::load(&dir)?;
                check_resumed_model(path, &ckpt.model, &model)?;
                check_resume_settings(path, &ckpt.state.config, &cfg, ranks)?;
                Some((Initial::Whole(ckpt.params, [ckpt.m, ckpt.v]), ckpt.state))
            }
        }
        None => None,
    };
    let (initial, mut state) = match resumed {
        Some(x) => x,
        None => {
            let fresh = FreshParams::of(&cfg, &model)?;
            let state = TrainerState {
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
            };
            (Initial::Fresh(fresh), state)
        }
    };
    state.config = serde_json::to_value(&cfg)?;
    if let Some(config) = state.config.as_object_mut() {
        config.insert("ranks".into(), ranks.into());
    }
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
    if let Some(r) = &cfg.resume {
        writeln!(out, "resuming {} at step {}", r.display(), state.step)?;
    }
    let exec_config = ExecConfig {
        nvme_dirs: nvme_dirs.clone(),
        comm: group.clone(),
        ..ExecConfig::default()
    };
    let shard_len: Vec<usize> = plan.shard_len.iter().map(|&s| s as usize).collect();
    let mut exec = Executor::new(model.clone(), plan, device, &exec_config)?;
    match &initial {
        Initial::Whole(params, [m, v]) => exec.load(params, Some((&m[..], &v[..])))?,
        Initial::Shard(shard) => exec.load_shard(shard)?,
        Initial::Fresh(fresh) => exec.load_blocks(&|b| fresh.block(b))?,
    }
    drop(initial);
    exec.set_steps(state.step - state.skipped_steps);
    install_interrupt_handler();

    // Appended to (a resumed run continues its log), a line per step, flushed as it is
    // written so that a killed run's log has every step it finished.
    let mut jsonl = match &cfg.log_jsonl {
        Some(p) if rank == 0 => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map_err(|e| format!("--log-jsonl {}: {e}", p.display()))?,
        ),
        _ => None,
    };
    // Every rank's tokens.
    let tokens_per_step = shape.tokens() * ranks as u64;
    let mut micro: Vec<Batch> = vec![Batch::default(); cfg.grad_accum];
    let first_step = state.step + 1;
    let mut losses: Vec<f32> = Vec::new();
    let mut reports: Vec<StepReport> = Vec::new();
    let bar = if rank == 0 {
        progress_bar(cfg.steps, state.step)
    } else {
        indicatif::ProgressBar::hidden()
    };
    let mut last_saved = None;
    let mut last_params: Option<StepParams> = None;
    let mut interrupted = false;
    let loop_start = Instant::now();
    let mut epoch = state.data_position / train_batches as u64 + 1;
    for step in first_step..=cfg.steps {
        let step_epoch = state.data_position / train_batches as u64 + 1;
        if step_epoch > epoch {
            epoch = step_epoch;
            let line = format!(
                "epoch {epoch}: step {step} reads the data's {train_batches} batches again \
                 from the start"
            );
            bar.suspend(|| writeln!(out, "{line}"))?;
        }
        // Micro-batch k of rank r is the step's k × ranks + r.
        for (k, b) in micro.iter_mut().enumerate() {
            let i = (k * ranks + rank) as u64;
            let index = ((state.data_position + i) % train_batches as u64) as usize;
            data.read_batch(index, cfg.batch, cfg.seq, model.vocab(), b)?;
        }
        let refs: Vec<(&[u32], &[u32])> = micro
            .iter()
            .map(|b| (&b.inputs[..], &b.targets[..]))
            .collect();
        let lr = cfg.lr_at(step);
        let step_params = StepParams {
            adam: AdamW {
                lr,
                beta1: cfg.beta1,
                beta2: cfg.beta2,
                eps: cfg.eps,
                weight_decay: cfg.weight_decay,
            },
            clip: cfg.clip,
            loss_scale: state.loss_scale,
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
        state.step = step;
        state.data_position += (cfg.grad_accum * ranks) as u64;
        if skipped {
            state.skipped_steps += 1;
            state.good_steps = 0;
            state.loss_scale = (state.loss_scale / 2.0).max(1.0);
        } else {
            state.good_steps += 1;
            if cfg.dtype == Dtype::Fp16 && state.good_steps.is_multiple_of(FP16_GROWTH_INTERVAL) {
                state.loss_scale = (state.loss_scale * 2.0).min(f32::MAX / 2.0);
            }
        }
        losses.push(report.loss);
        last_params = Some(step_params);
        let eval_loss = match held_out {
            Some(k) if step.is_multiple_of(cfg.eval_every) || step == cfg.steps => {
                Some(evaluate(&exec, &data, k, &cfg)?)
            }
            _ => None,
        };
        if let Some(w) = jsonl.as_mut() {
            let line = serde_json::json!({
                "step": step, "loss": report.loss, "eval_loss": eval_loss, "lr": lr,
                "grad_norm": report.grad_norm, "skipped": report.skipped,
                "updated": report.updated,
                "loss_scale": state.loss_scale, "seconds": report.seconds,
                "tokens_per_s": tokens_per_step as f64 / report.seconds,
                "compute_stall": report.stall_fraction(),
                "nvme_read_bytes": report.link_bytes[0], "nvme_write_bytes": report.link_bytes[1],
                "h2d_bytes": report.link_bytes[2], "d2h_bytes": report.link_bytes[3],
            });
            // One write per line: with O_APPEND a line is never split by a crash.
            w.write_all(format!("{line}\n").as_bytes())
                .map_err(|e| format!("--log-jsonl: {e}"))?;
        }
        if let Some(trace) = &cfg.trace
            && rank == 0
            && step == cfg.trace_step.max(first_step)
        {
            crate::report::write_json(trace, &report.chrome_trace(step))?;
        }
        if rank == 0 {
            progress(
                &bar,
                step,
                cfg.steps,
                &report,
                tokens_per_step,
                loop_start,
                first_step,
                eval_loss,
            );
        }
        reports.push(report);
        interrupted = INTERRUPTS.load(Ordering::SeqCst) > 0;
        let due = cfg.checkpoint_every > 0 && step.is_multiple_of(cfg.checkpoint_every);
        if let Some(dir) = &cfg.checkpoint_dir
            && (due || interrupted || step == cfg.steps)
        {
            // A delayed update still waiting is applied first, so the checkpoint holds
            // every step's update (and resuming from it continues from the same state).
            if exec.flush(&step_params)?.is_some_and(|f| f.skipped) {
                state.skipped_steps += 1;
            }
            if let Some(group) = &group {
                // Each rank writes its own shard (a collective).
                let (params, m, v) = exec.export_shard()?;
                let shard = checkpoint::Shard {
                    model: model.clone(),
                    ranks,
                    rank,
                    shard_len: shard_len.clone(),
                    params,
                    m,
                    v,
                    state: state.clone(),
                };
                last_saved = Some(checkpoint::save_sharded(
                    dir,
                    group.as_ref(),
                    &shard,
                    cfg.keep_checkpoints,
                )?);
            } else {
                let (params, m, v) = exec.export()?;
                let ckpt = Checkpoint {
                    model: model.clone(),
                    params,
                    m,
                    v,
                    state: state.clone(),
                };
                last_saved = Some(checkpoint::save(dir, &ckpt, cfg.keep_checkpoints)?);
            }
        }
        if interrupted {
            break;
        }
    }
    bar.finish_and_clear();
    if let Some(p) = &last_params {
        exec.flush(p)?;
    }
    if interrupted {
        writeln!(
            out,
            "interrupted at step {}: stopped after finishing it",
            state.step
        )?;
    }
    if let Some(saved) = &last_saved {
        writeln!(out, "checkpoint: {}", saved.display())?;
    }
    if let Some(dir) = &cfg.out {
        // With ranks every rank gathers the parameters (a collective) and rank 0 writes
        // them; alone, each block is read from its tier as the file reaches it, so that
        // saving holds one block's parameters, not the model's.
        let gathered = if ranks > 1 {
            Some(exec.export()?.0)
        } else {
            None
        };
        if rank != 0 {
            return Ok(()); // rank 0 writes the model
        }
        let source = pretrained_source(&cfg)?;
        let mut options = source
            .as_ref()
            .map_or_else(SaveOptions::default, |s| s.save_options());
        if let Some(dtype) = cfg.save_dtype {
            options.dtype = file_dtype(dtype);
        }
        match &gathered {
            Some(params) => weights::save_pretrained_with(&model, params, dir, &options)?,
            None => weights::save_pretrained_blocks(
                &model,
                &|b| {
                    exec.export_block(b).map_err(|e| ModelError::Source {
                        what: format!("reading block {b}'s parameters to write {}", dir.display()),
                        source: Box::new(e),
                    })
                },
                dir,
                &options,
            )?,
        }
        writeln!(
            out,
            "model: {} (Hugging Face safetensors in {}{}, config.json{})",
            dir.display(),
            options.dtype.torch_name(),
            if options.max_shard_bytes
                < model.param_count() as u64 * options.dtype.size_bytes() as u64
            {
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
    }
    summary(&mut out, &exec, &reports, &losses, tokens_per_step, started)?;
    Ok(())
}

/// Refuses, before anything is allocated, a run whose options make the whole model's
/// parameters (and for some, its optimizer moments) in memory beside the executor's
/// arenas when this machine's available memory cannot hold both: a run that would be
/// killed for memory at its first checkpoint or evaluation, hours in. Training, loading
/// a fresh run and (alone) `--out` go a block at a time and are not counted.
fn check_whole_model_memory(
    cfg: &TrainConfig,
    plan: &Plan,
    model: &Model,
    target: Target,
    ranks: usize,
) -> Result<(), Error> {
    let params = model.param_count() as u64;
    // Per process: with ranks each holds its shard of a checkpoint it writes or reads
    // as its own, but gathers whole parameters (with their moments) to evaluate or write
    // the model.
    let mut wholes: Vec<(String, u64)> = Vec::new();
    if cfg.checkpoint_dir.is_some() {
        wholes.push((
            "--checkpoint-dir: writing a checkpoint holds the parameters, m and v".into(),
            12 * params / ranks as u64,
        ));
    }
    if cfg.resume.is_some() {
        wholes.push((
            "--resume: reading the checkpoint holds its parameters, m and v".into(),
            12 * params / ranks as u64,
        ));
    }
    if cfg.eval_every > 0 {
        wholes.push((
            "--eval-every: evaluating holds the parameters twice (read back, and in the \
             evaluation's own model)"
                .into(),
            if ranks > 1 { 16 } else { 8 } * params,
        ));
    }
    if cfg.out.is_some() && ranks > 1 {
        wholes.push((
            "--out with ranks: every rank gathers the parameters, m and v".into(),
            12 * params,
        ));
    }
    let Some((what, whole)) = wholes.into_iter().max_by_key(|(_, bytes)| *bytes) else {
        return Ok(());
    };
    // The CPU device's memory is RAM too.
    let arenas = plan.peak[Tier::Host.index()]
        + if target == Target::Cpu {
            plan.peak[Tier::Device.index()]
        } else {
            0
        };
    let Some(available) = crate::doctor::meminfo_bytes("MemAvailable") else {
        return Ok(()); // no /proc/meminfo to judge by
    };
    if arenas + whole <= available {
        return Ok(());
    }
    Err(format!(
        "{what} of the whole model in memory ({} for {} parameters{}) beside the plan's {} \
         of {}, {} in all, and this machine has {} available: it would run out of memory \
         there. strata does not do that a block at a time yet: leave the option out (--out \
         writes the model a block at a time), or run where there is more memory",
        fmt_bytes(whole),
        model.param_count(),
        if ranks > 1 { ", per rank" } else { "" },
        fmt_bytes(arenas),
        if target == Target::Cpu {
            "device and host arenas (the CPU device's memory is RAM)"
        } else {
            "pinned host memory"
        },
        fmt_bytes(arenas + whole),
        fmt_bytes(available)
    )
    .into())
}

/// Where a run's parameters come from.
enum Initial {
    /// A fresh run's, made or read a block at a time as they are loaded.
    Fresh(FreshParams),
    /// Whole blocks of an ordinary checkpoint, with its moments.
    Whole(Vec<Vec<f32>>, [Vec<Vec<f32>>; 2]),
    /// This rank's shards of a sharded checkpoint.
    Shard(strata_engine::exec::TrainingState),
}

/// Refuses a checkpoint of another model than the configured one.
fn check_resumed_model(path: &Path, found: &Model, configured: &Model) -> Result<(), Error> {
    if found != configured {
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

/// The held-out batch's loss under the current master parameters.
fn evaluate(
    exec: &Executor,
    data: &TokenData,
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
    data.read_batch(batch, cfg.batch, cfg.seq, model.vocab(), &mut b)?;
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

#[allow(clippy::too_many_arguments)]
fn progress(
    bar: &indicatif::ProgressBar,
    step: u64,
    steps: u64,
    r: &StepReport,
    tokens: u64,
    start: Instant,
    first: u64,
    eval_loss: Option<f32>,
) {
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

fn summary(
    out: &mut impl Write,
    exec: &Executor,
    reports: &[StepReport],
    losses: &[f32],
    tokens_per_step: u64,
    started: Instant,
) -> Result<(), Error> {
    if reports.is_empty() {
        writeln!(out, "no steps to run: the run is already at its last step")?;
        return Ok(());
    }
    let secs: Vec<f64> = reports.iter().map(|r| r.seconds).collect();
    let median = crate::report::median(&secs);
    let stall: Vec<f64> = reports.iter().map(|r| r.stall_fraction()).collect();
    let plan = exec.plan();
    let live = exec.peak_measured();
    let median_report = &reports[crate::report::median_index(&secs)];
    let mut t = Table::new(["", "value"]);
    t.row(["policy".to_string(), plan.policy.clone()]);
    t.row(["recompute".to_string(), plan.recomputed_of()]);
    t.row(["steps".to_string(), reports.len().to_string()]);
    t.row([
        "loss first -> last".to_string(),
        format!("{:.4} -> {:.4}", losses[0], losses[losses.len() - 1]),
    ]);
    t.row(["median step".to_string(), format!("{median:.3} s")]);
    t.row([
        "tokens/s (median step)".to_string(),
        format!("{:.0}", tokens_per_step as f64 / median),
    ]);
    t.row([
        "compute stall (median)".to_string(),
        format!("{:.1}%", 100.0 * crate::report::median(&stall)),
    ]);
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
        t.row([
            "process peak RSS (all memory, VmHWM)".to_string(),
            fmt_bytes(rss),
        ]);
    }
    for (kind, count, p50, p99, _) in exec.latency_summary() {
        t.row([
            format!("{kind} p50 / p99"),
            format!("{p50} / {p99} µs ({count} ops)"),
        ]);
    }
    t.row([
        "wall time".to_string(),
        format!("{:.1} s", started.elapsed().as_secs_f64()),
    ]);
    write!(out, "{}", t.render())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ranks on one machine: what each took from the machine is halved, what was
    /// stated is not, and both plan with the smaller share; on two machines nothing is
    /// divided.
    #[test]
    fn ranks_of_one_machine_share_its_measured_budgets() {
        let run = |machines: [u64; 2]| -> Vec<Budgets> {
            let group = strata_comm::ThreadGroup::new(2, std::time::Duration::from_secs(30));
            std::thread::scope(|s| {
                let handles: Vec<_> = group
                    .into_iter()
                    .map(|g| {
                        s.spawn(move || {
                            let r = g.rank() as u64;
                            let mut b = Budgets {
                                device: 1000 + r,
                                host: 800 + 100 * r,
                                nvme: 600,
                            };
                            shared_budgets(&g, &mut b, [false, true, true], machines[r as usize])
                                .unwrap();
                            b
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            })
        };
        let same = run([7, 7]);
        for b in &same {
            assert_eq!((b.device, b.host, b.nvme), (1000, 400, 300), "{same:?}");
        }
        let apart = run([7, 8]);
        for b in &apart {
            assert_eq!((b.device, b.host, b.nvme), (1000, 800, 600), "{apart:?}");
        }
        assert_eq!(machine_id(), machine_id());
    }
}
