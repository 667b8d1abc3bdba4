//! The configuration of `strata train`: every setting of a run, as one flat TOML table
//! ([`TrainConfig`]) and as command-line flags ([`TrainArgs`]), merged in that order over
//! the defaults, and checked together before anything starts.
//!
//! The defaults are the README's main job: the `small` preset on the built-in corpus,
//! under a 48 MiB device budget, 120 steps. Errors are one line that names the file or
//! flag, the key, and what to write instead.
//!
//! This module reads and checks settings; it does not resolve them against the machine
//! (where swap files go when `nvme` is empty, which device `auto` picks, whether a
//! budget fits the model): the training loop does.

use std::collections::BTreeSet;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use strata_engine::model::PRESETS;
use strata_engine::plan::{GradSpill, Recompute};

use crate::report::parse_bytes;

/// The swap policies `policy` names.
pub const POLICIES: [&str; 5] = [
    "auto",
    "all-on-device",
    "cpu-offload",
    "param-offload",
    "nvme-offload",
];

/// The devices `device` names.
pub const DEVICES: [&str; 3] = ["auto", "cpu", "cuda"];

/// The preset the default job trains, which the model module may not list yet.
const SMALL_PRESET: &str = "small";

/// How the learning rate moves over a run, after its warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    /// The peak rate until the end.
    Constant,
    /// Half a cosine from the peak rate down to `lr * min_lr_ratio` at the last step.
    #[default]
    Cosine,
}

/// The working precision of parameters and activations on the device. Master weights and
/// optimizer state stay fp32 whatever this says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 32-bit floats throughout.
    #[default]
    Fp32,
    /// bfloat16, with fp32 accumulation.
    Bf16,
    /// IEEE half precision, with dynamic loss scaling.
    Fp16,
}

/// Every setting of a `strata train` run. Serialized as one flat TOML table whose keys are
/// the field names; a key left out keeps its default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// A built-in preset name (`tiny`, `small`, `gpt2`, ...), or a directory holding
    /// `config.json` and `model.safetensors` to fine-tune. A preset name wins over a
    /// directory of the same name (write `./small` for the directory).
    pub model: String,
    /// Token data: an llm.c token file (`*.bin`), or text (`*.jsonl` lines of `text`, or
    /// of `prompt` and `completion`; any other file is one document), tokenized with the
    /// model folder's `tokenizer.json` (or read one byte per token for a vocabulary of
    /// 256). None: the built-in corpus ([`crate::corpus`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<PathBuf>,
    /// The device memory budget, as a size such as `"48MiB"` or `"20GiB"`. None (written
    /// `"all"`): what the device has.
    #[serde(with = "size_or_all")]
    pub device_mem: Option<String>,
    /// The pinned host memory budget, as a size. None (written `"all"`): no limit stated.
    #[serde(with = "size_or_all")]
    pub host_mem: Option<String>,
    /// Directories for swap files, one per drive (striped). Empty: the training loop
    /// picks one (the system temporary directory, or `target/` when that is tmpfs).
    pub nvme: Vec<PathBuf>,
    /// The NVMe budget across the `nvme` directories, as a size. None (written `"all"`):
    /// 90% of their free space.
    #[serde(with = "size_or_all")]
    pub nvme_mem: Option<String>,
    /// The swap policy: one of [`POLICIES`].
    pub policy: String,
    /// How many blocks ahead parameters are fetched. None: the policy decides.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefetch: Option<usize>,
    /// Which layers recompute their forward in the backward instead of keeping the
    /// activations it reads on the device: as the device budget allows (`auto`), every
    /// layer (`all`), or none (`none`).
    pub recompute: Recompute,
    /// Whether gradients wait for the clipping norm on NVMe instead of host memory:
    /// when the host budget needs it (`auto`), `always` where they can, or `never`.
    pub spill_grads: GradSpill,
    /// Optimizer steps in the run.
    pub steps: u64,
    /// Sequences per micro-batch (B).
    pub batch: usize,
    /// Tokens per sequence (T), at most the model's context.
    pub seq: usize,
    /// Micro-batches whose gradients add up to one optimizer step.
    pub grad_accum: usize,
    /// The peak learning rate.
    pub lr: f64,
    /// How the learning rate moves after the warmup.
    pub lr_schedule: LrSchedule,
    /// Steps over which the learning rate rises linearly from 0 to `lr`.
    pub warmup_steps: u64,
    /// The cosine schedule's final rate, as a fraction of `lr`.
    pub min_lr_ratio: f64,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f64,
    /// AdamW's first-moment decay.
    pub beta1: f64,
    /// AdamW's second-moment decay.
    pub beta2: f64,
    /// AdamW's epsilon.
    pub eps: f64,
    /// The largest global gradient norm; larger gradients are scaled down to it. 0: no
    /// clipping.
    pub clip: f64,
    /// The working precision on the device.
    pub dtype: Dtype,
    /// Seed of the initial weights and of anything else random in the run.
    pub seed: u64,
    /// After the warm-up steps, apply step t's optimizer update during step t+1's
    /// forward and backward (one step stale), so the CPU update overlaps device compute.
    pub delayed_update: bool,
    /// Where to compute: one of [`DEVICES`].
    pub device: String,
    /// Directory of checkpoints. None: no checkpoints.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Write a checkpoint every this many steps. 0: only at the end and on Ctrl-C.
    pub checkpoint_every: u64,
    /// How many checkpoints to keep; older ones are deleted.
    pub keep_checkpoints: usize,
    /// Directory to save the trained model in (`config.json` + `model.safetensors`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub out: Option<PathBuf>,
    /// The type of the tensors saved in `out`. None: the type the model was read in
    /// (fp32 for a preset).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub save_dtype: Option<Dtype>,
    /// File to append one JSON object of metrics per step to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_jsonl: Option<PathBuf>,
    /// File to write a Chrome trace of step `trace_step` to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace: Option<PathBuf>,
    /// The step (counted from 1) that `trace` records.
    pub trace_step: u64,
    /// A checkpoint directory to resume from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resume: Option<PathBuf>,
    /// Report the loss on held-out data every this many steps. 0: never.
    pub eval_every: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            model: SMALL_PRESET.to_string(),
            data: None,
            device_mem: Some("16MiB".to_string()),
            host_mem: Some("8MiB".to_string()),
            nvme: Vec::new(),
            nvme_mem: None,
            policy: "auto".to_string(),
            prefetch: None,
            recompute: Recompute::Auto,
            spill_grads: GradSpill::Auto,
            steps: 600,
            batch: 8,
            seq: 64,
            grad_accum: 1,
            lr: 3e-3,
            lr_schedule: LrSchedule::Cosine,
            warmup_steps: 10,
            min_lr_ratio: 0.1,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            clip: 1.0,
            dtype: Dtype::Fp32,
            seed: 1337,
            delayed_update: false,
            device: "auto".to_string(),
            checkpoint_dir: None,
            checkpoint_every: 0,
            keep_checkpoints: 3,
            out: None,
            save_dtype: None,
            log_jsonl: None,
            trace: None,
            // Past the first step, whose start-up costs would hide the steady state.
            trace_step: 3,
            resume: None,
            eval_every: 0,
        }
    }
}

/// The word for "no budget stated" in `device_mem`, `host_mem` and `nvme_mem`: None in
/// the config.
pub const ALL_MEMORY: &str = "all";

/// A memory budget in TOML and on the command line: a size, or `"all"` for None, so that
/// every value `--print-config` writes reads back the same.
fn size_setting(text: &str) -> Option<String> {
    (!text.trim().eq_ignore_ascii_case(ALL_MEMORY)).then(|| text.to_string())
}

mod size_or_all {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(value.as_deref().unwrap_or(super::ALL_MEMORY))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        Ok(super::size_setting(&String::deserialize(d)?))
    }
}

/// What a key holds, for error messages and for `--print-config`'s placeholders.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Text,
    Path,
    Paths,
    Size,
    Count,
    Number,
    Switch,
    Choice(&'static str),
}

impl Kind {
    fn expected(self) -> &'static str {
        match self {
            Kind::Text => "a string",
            Kind::Path => "a path (a string)",
            Kind::Paths => "an array of paths, such as [\"/mnt/nvme0\"]",
            Kind::Size => "a size string, such as \"48MiB\", or \"all\"",
            Kind::Count => "a whole number, 0 or more",
            Kind::Number => "a number",
            Kind::Switch => "true or false",
            Kind::Choice(names) => names,
        }
    }

    fn placeholder(self) -> &'static str {
        match self {
            Kind::Path => "\"PATH\"",
            Kind::Count => "2",
            _ => "...",
        }
    }
}

/// Every key, in the order `--print-config` writes them and `validate` checks them.
const KEYS: [(&str, Kind); 37] = [
    ("model", Kind::Text),
    ("data", Kind::Path),
    ("device_mem", Kind::Size),
    ("host_mem", Kind::Size),
    ("nvme", Kind::Paths),
    ("nvme_mem", Kind::Size),
    (
        "policy",
        Kind::Choice("one of auto, all-on-device, cpu-offload, param-offload, nvme-offload"),
    ),
    ("prefetch", Kind::Count),
    (
        "recompute",
        Kind::Choice("one of \"auto\", \"all\", \"none\""),
    ),
    (
        "spill_grads",
        Kind::Choice("one of \"auto\", \"always\", \"never\""),
    ),
    ("steps", Kind::Count),
    ("batch", Kind::Count),
    ("seq", Kind::Count),
    ("grad_accum", Kind::Count),
    ("lr", Kind::Number),
    (
        "lr_schedule",
        Kind::Choice("one of \"constant\", \"cosine\""),
    ),
    ("warmup_steps", Kind::Count),
    ("min_lr_ratio", Kind::Number),
    ("weight_decay", Kind::Number),
    ("beta1", Kind::Number),
    ("beta2", Kind::Number),
    ("eps", Kind::Number),
    ("clip", Kind::Number),
    ("dtype", Kind::Choice("one of \"fp32\", \"bf16\", \"fp16\"")),
    ("seed", Kind::Count),
    ("delayed_update", Kind::Switch),
    ("device", Kind::Choice("one of auto, cpu, cuda")),
    ("checkpoint_dir", Kind::Path),
    ("checkpoint_every", Kind::Count),
    ("keep_checkpoints", Kind::Count),
    ("out", Kind::Path),
    (
        "save_dtype",
        Kind::Choice("one of \"fp32\", \"bf16\", \"fp16\""),
    ),
    ("log_jsonl", Kind::Path),
    ("trace", Kind::Path),
    ("trace_step", Kind::Count),
    ("resume", Kind::Path),
    ("eval_every", Kind::Count),
];

/// Names people write for a key, from other trainers' configs, mapped to ours.
const ALIASES: [(&str, &str); 50] = [
    ("learning_rate", "lr"),
    ("max_lr", "lr"),
    ("batch_size", "batch"),
    ("micro_batch_size", "batch"),
    ("seq_len", "seq"),
    ("sequence_length", "seq"),
    ("block_size", "seq"),
    ("context", "seq"),
    ("max_steps", "steps"),
    ("num_steps", "steps"),
    ("iterations", "steps"),
    ("max_iters", "steps"),
    ("gradient_accumulation_steps", "grad_accum"),
    ("accumulate", "grad_accum"),
    ("warmup", "warmup_steps"),
    ("warmup_iters", "warmup_steps"),
    ("schedule", "lr_schedule"),
    ("scheduler", "lr_schedule"),
    ("min_lr", "min_lr_ratio"),
    ("decay", "weight_decay"),
    ("wd", "weight_decay"),
    ("grad_clip", "clip"),
    ("max_grad_norm", "clip"),
    ("precision", "dtype"),
    ("adam_beta1", "beta1"),
    ("adam_beta2", "beta2"),
    ("adam_eps", "eps"),
    ("epsilon", "eps"),
    ("gpu_mem", "device_mem"),
    ("gpu_memory", "device_mem"),
    ("device_memory", "device_mem"),
    ("vram", "device_mem"),
    ("cpu_mem", "host_mem"),
    ("host_memory", "host_mem"),
    ("ram", "host_mem"),
    ("swap", "nvme"),
    ("nvme_paths", "nvme"),
    ("offload", "policy"),
    ("prefetch_depth", "prefetch"),
    ("random_seed", "seed"),
    ("save_dir", "checkpoint_dir"),
    ("save_every", "checkpoint_every"),
    ("checkpoint_interval", "checkpoint_every"),
    ("keep", "keep_checkpoints"),
    ("output_dir", "out"),
    ("metrics", "log_jsonl"),
    ("dataset", "data"),
    ("data_path", "data"),
    ("model_path", "model"),
    ("eval_interval", "eval_every"),
];

fn kind(key: &str) -> Kind {
    KEYS.iter()
        .find(|(k, _)| *k == key)
        .map(|(_, kind)| *kind)
        .expect("every key is in KEYS")
}

/// The key `unknown` most likely meant: ours or an alias of ours, by edit distance.
fn suggest(unknown: &str) -> Option<&'static str> {
    let unknown = unknown.to_ascii_lowercase().replace('-', "_");
    let names = KEYS.iter().map(|(k, _)| (*k, *k));
    names
        .chain(ALIASES.iter().copied())
        .map(|(written, key)| (edit_distance(&unknown, written), written, key))
        // Within a third of the word: `lerning_rate` finds `learning_rate`, `x` finds nothing.
        .filter(|(distance, written, _)| *distance <= (written.len() / 3).max(1))
        .min_by_key(|(distance, _, _)| *distance)
        .map(|(_, _, key)| key)
}

/// Edit distance between two strings by bytes, counting a swap of neighbours as one edit
/// (optimal string alignment): `stpes` is one edit from `steps`.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    // d[i][j]: distance between a[..i] and b[..j].
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let substitution = d[i - 1][j - 1] + usize::from(a[i - 1] != b[j - 1]);
            let mut best = substitution.min(d[i - 1][j] + 1).min(d[i][j - 1] + 1);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

/// The preset names `model` accepts.
pub fn preset_names() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = PRESETS.iter().map(|(name, _)| *name).collect();
    if !names.contains(&SMALL_PRESET) {
        names.insert(1.min(names.len()), SMALL_PRESET);
    }
    // The Llama family's published shapes (no weights).
    names.extend(strata_engine::model::llama::preset_names());
    names
}

/// A model shape written `LAYERSxWIDTH` (`40x5120`): layers and channels, for sizes with
/// no preset.
pub fn shape_spec(name: &str) -> Option<(usize, usize)> {
    let (layers, width) = name.split_once('x')?;
    let (layers, width) = (layers.parse().ok()?, width.parse().ok()?);
    (layers > 0 && width > 0).then_some((layers, width))
}

/// Where a setting's value came from, so that an error names what to change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// The built-in default, or a value set in code.
    Default,
    /// A key of this config file.
    File(PathBuf),
    /// A command-line flag.
    Flag,
}

/// Why a configuration was refused. Each displays as one line naming the file or flag,
/// the key, and what to do.
#[derive(Debug)]
pub enum ConfigError {
    /// The config file could not be read.
    Read {
        /// The file.
        path: PathBuf,
        /// What reading it gave.
        error: io::Error,
    },
    /// The config file is not TOML.
    Syntax {
        /// The file.
        path: PathBuf,
        /// 1-based line of the error.
        line: usize,
        /// 1-based column of the error.
        column: usize,
        /// The parser's message.
        message: String,
    },
    /// The config file has a key no setting has.
    UnknownKey {
        /// The file.
        path: PathBuf,
        /// The key as written.
        key: String,
        /// The key it most likely meant.
        suggestion: Option<&'static str>,
    },
    /// A key of the config file holds the wrong kind of value.
    WrongType {
        /// The file.
        path: PathBuf,
        /// The key.
        key: &'static str,
        /// What it should hold.
        expected: &'static str,
        /// What it holds.
        found: String,
    },
    /// A setting has a value it cannot take.
    Invalid {
        /// Where the value came from.
        origin: Origin,
        /// The key.
        key: &'static str,
        /// What is wrong and what would be right, e.g. "must be at least 1 (found 0)".
        problem: String,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const LIST: &str = "strata train --print-config lists every key";
        match self {
            ConfigError::Read { path, error } if error.kind() == io::ErrorKind::NotFound => {
                write!(
                    f,
                    "{}: no such config file; check the --config path \
                     (strata train --print-config > train.toml writes one)",
                    path.display()
                )
            }
            ConfigError::Read { path, error } => {
                write!(
                    f,
                    "{}: cannot read the config file: {error}",
                    path.display()
                )
            }
            ConfigError::Syntax {
                path,
                line,
                column,
                message,
            } => write!(
                f,
                "{}:{line}:{column}: not valid TOML: {message}",
                path.display()
            ),
            ConfigError::UnknownKey {
                path,
                key,
                suggestion: Some(suggestion),
            } => write!(
                f,
                "{}: unknown key `{key}`; did you mean `{suggestion}`? ({LIST})",
                path.display()
            ),
            ConfigError::UnknownKey {
                path,
                key,
                suggestion: None,
            } => write!(f, "{}: unknown key `{key}` ({LIST})", path.display()),
            ConfigError::WrongType {
                path,
                key,
                expected,
                found,
            } => write!(
                f,
                "{}: `{key}` must be {expected}, not {found}",
                path.display()
            ),
            ConfigError::Invalid {
                origin,
                key,
                problem,
            } => match origin {
                Origin::Default => write!(f, "`{key}` {problem}"),
                Origin::File(path) => write!(f, "{}: `{key}` {problem}", path.display()),
                Origin::Flag => write!(f, "--{} {problem}", key.replace('_', "-")),
            },
        }
    }
}

impl std::error::Error for ConfigError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConfigError::Read { error, .. } => Some(error),
            _ => None,
        }
    }
}

impl ConfigError {
    /// An invalid value's error with its origin, which `origin` finds from its key.
    fn located(self, origin: impl FnOnce(&'static str) -> Origin) -> ConfigError {
        match self {
            ConfigError::Invalid { key, problem, .. } => ConfigError::Invalid {
                origin: origin(key),
                key,
                problem,
            },
            other => other,
        }
    }
}

fn invalid(key: &'static str, problem: String) -> ConfigError {
    ConfigError::Invalid {
        origin: Origin::Default,
        key,
        problem,
    }
}

/// How a TOML value reads in an error: `the string "8"`, `the integer -1`.
fn describe(value: &toml::Value) -> String {
    match value {
        toml::Value::String(_) => format!("the string {value}"),
        toml::Value::Integer(i) => format!("the integer {i}"),
        toml::Value::Float(x) => format!("the number {x}"),
        toml::Value::Boolean(b) => format!("{b}"),
        toml::Value::Datetime(d) => format!("the date {d}"),
        toml::Value::Array(_) => "an array".to_string(),
        toml::Value::Table(_) => "a table".to_string(),
    }
}

/// 1-based line and column of byte `offset` in `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    (line, column)
}

impl TrainConfig {
    /// Reads a TOML file of settings over the defaults, and checks the result.
    pub fn load(path: &Path) -> Result<TrainConfig, ConfigError> {
        let (config, _) = Self::read_file(path)?;
        config
            .validate()
            .map_err(|e| e.located(|_| Origin::File(path.to_path_buf())))?;
        Ok(config)
    }

    /// The file's settings over the defaults, unchecked, and the keys the file set.
    fn read_file(path: &Path) -> Result<(TrainConfig, BTreeSet<&'static str>), ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
            path: path.to_path_buf(),
            error,
        })?;
        Self::parse(&text, path)
    }

    /// `text` (TOML, from `path`) over the defaults, unchecked, and the keys it set.
    fn parse(
        text: &str,
        path: &Path,
    ) -> Result<(TrainConfig, BTreeSet<&'static str>), ConfigError> {
        let table: toml::Table = toml::from_str(text).map_err(|e| {
            let (line, column) = line_column(text, e.span().map_or(0, |s| s.start));
            ConfigError::Syntax {
                path: path.to_path_buf(),
                line,
                column,
                message: e.message().trim().replace('\n', "; "),
            }
        })?;
        let mut set = BTreeSet::new();
        for key in table.keys() {
            match KEYS.iter().find(|(k, _)| k == key) {
                Some((k, _)) => set.insert(*k),
                None => {
                    return Err(ConfigError::UnknownKey {
                        path: path.to_path_buf(),
                        key: key.clone(),
                        suggestion: suggest(key),
                    });
                }
            };
        }
        let whole = match table.clone().try_into::<TrainConfig>() {
            Ok(config) => return Ok((config, set)),
            Err(whole) => whole,
        };
        // Deserialize key by key to find the one at fault, and describe it ourselves:
        // serde's words ("expected usize") are not the user's.
        for (key, value) in &table {
            let alone = toml::Table::from_iter([(key.clone(), value.clone())]);
            if alone.try_into::<TrainConfig>().is_err() {
                let key = *set.get(key.as_str()).expect("checked above");
                return Err(ConfigError::WrongType {
                    path: path.to_path_buf(),
                    key,
                    expected: kind(key).expected(),
                    found: describe(value),
                });
            }
        }
        Err(ConfigError::Syntax {
            path: path.to_path_buf(),
            line: 1,
            column: 1,
            message: whole.message().trim().replace('\n', "; "),
        })
    }

    /// The configuration as TOML with every key, each under a comment saying what it
    /// does; keys not set are written commented out. [`TrainConfig::load`] reads it back
    /// to an equal configuration.
    pub fn to_toml(&self) -> String {
        let table = toml::Table::try_from(self).expect("every field serializes to TOML");
        let help = flag_help();
        let mut out = String::from(
            "# strata train: the settings of this run. Use with `strata train --config FILE`;\n\
             # flags on the command line override the file.\n",
        );
        for (key, kind) in KEYS {
            out.push('\n');
            if let Some(text) = help.iter().find(|(k, _)| k == key).map(|(_, h)| h) {
                wrap_comment(&mut out, text, 88);
            }
            match table.get(key) {
                // Tiny rates read better as 1e-8 than as 0.00000001; both are TOML.
                Some(toml::Value::Float(x)) if *x != 0.0 && x.abs() < 1e-4 => {
                    out.push_str(&format!("{key} = {x:e}\n"))
                }
                Some(value) => out.push_str(&format!("{key} = {value}\n")),
                None => out.push_str(&format!("# {key} = {}  (not set)\n", kind.placeholder())),
            }
        }
        out
    }

    /// Checks every setting, and settings together, in the order of `--print-config`;
    /// the first problem is the error. Looks at the file system for paths that must
    /// exist already (`data`, `nvme`, `resume`, a model directory).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let presets = preset_names();
        if !presets.contains(&self.model.as_str()) && shape_spec(&self.model).is_none() {
            let dir = Path::new(&self.model);
            if !dir.is_dir() {
                return Err(invalid(
                    "model",
                    format!(
                        "must be a preset ({}), a shape LAYERSxWIDTH (such as 40x5120), or a \
                         directory holding config.json and model.safetensors, or only a \
                         config.json for a shape without weights (found \"{}\")",
                        presets.join(", "),
                        self.model
                    ),
                ));
            }
            let config = dir.join("config.json");
            if !config.is_file() {
                return Err(invalid(
                    "model",
                    format!(
                        "names the directory {} but it has no config.json; save a model \
                         there with save_pretrained or `strata model --init DIR`",
                        dir.display()
                    ),
                ));
            }
            // A family strata does not run is said first, whatever the weights' format.
            strata_engine::model::weights::load_config(&config)
                .map_err(|e| invalid("model", e.to_string()))?;
            // A folder of only config.json is a shape, initialised like a preset; else one
            // model.safetensors or sharded ones; pytorch_model.bin refused with the command
            // that converts it.
            if !crate::train::has_no_weights(dir) {
                strata_engine::model::weights::weights_layout(dir)
                    .map_err(|e| invalid("model", e.to_string()))?;
            }
        }
        if let Some(data) = &self.data
            && !data.is_file()
        {
            return Err(invalid(
                "data",
                format!(
                    "names {}, which is not a file; give a token file (llm.c *.bin), text \
                     or JSON lines, or leave it unset for the built-in corpus",
                    data.display()
                ),
            ));
        }
        self.device_mem_bytes()?;
        self.host_mem_bytes()?;
        self.nvme_mem_bytes()?;
        // A folder naming `{rank}` is each rank's own, made when the rank starts.
        if let Some(dir) = self
            .nvme
            .iter()
            .find(|d| !d.to_string_lossy().contains("{rank}") && !d.is_dir())
        {
            return Err(invalid(
                "nvme",
                format!(
                    "names {}, which is not a directory; create it, or name a directory \
                     on the drive that should hold the swap files",
                    dir.display()
                ),
            ));
        }
        if !POLICIES.contains(&self.policy.as_str()) {
            return Err(invalid(
                "policy",
                format!(
                    "must be one of {} (found \"{}\")",
                    POLICIES.join(", "),
                    self.policy
                ),
            ));
        }
        let at_least_one = [
            ("steps", self.steps),
            ("batch", self.batch as u64),
            ("seq", self.seq as u64),
            ("grad_accum", self.grad_accum as u64),
        ];
        for (key, value) in at_least_one {
            if value == 0 {
                return Err(invalid(key, "must be at least 1 (found 0)".to_string()));
            }
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(invalid(
                "lr",
                format!(
                    "must be a positive number, such as 3e-3 (found {})",
                    self.lr
                ),
            ));
        }
        let ranges = [
            ("min_lr_ratio", self.min_lr_ratio, "from 0 to 1", 0.0..=1.0),
            (
                "weight_decay",
                self.weight_decay,
                "0 or more",
                0.0..=f64::MAX,
            ),
            (
                "beta1",
                self.beta1,
                "from 0 up to, not including, 1",
                0.0..=1.0,
            ),
            (
                "beta2",
                self.beta2,
                "from 0 up to, not including, 1",
                0.0..=1.0,
            ),
            ("clip", self.clip, "0 (no clipping) or more", 0.0..=f64::MAX),
        ];
        for (key, value, words, range) in ranges {
            let beta = key.starts_with("beta");
            if !range.contains(&value) || (beta && value == 1.0) {
                return Err(invalid(
                    key,
                    format!("must be a number {words} (found {value})"),
                ));
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(invalid(
                "eps",
                format!(
                    "must be a small positive number, such as 1e-8 (found {})",
                    self.eps
                ),
            ));
        }
        if !DEVICES.contains(&self.device.as_str()) {
            return Err(invalid(
                "device",
                format!(
                    "must be one of {} (found \"{}\")",
                    DEVICES.join(", "),
                    self.device
                ),
            ));
        }
        if self.keep_checkpoints == 0 {
            return Err(invalid(
                "keep_checkpoints",
                "must be at least 1 (found 0): the newest checkpoint is always kept".to_string(),
            ));
        }
        if self.trace.is_some() && !(1..=self.steps).contains(&self.trace_step) {
            return Err(invalid(
                "trace_step",
                format!(
                    "must be a step of the run, from 1 to steps = {} (found {})",
                    self.steps, self.trace_step
                ),
            ));
        }
        if let Some(dir) = &self.resume
            && !dir.is_dir()
        {
            return Err(invalid(
                "resume",
                format!(
                    "names {}, which is not a directory; give a checkpoint directory \
                     (one that checkpoint_dir holds)",
                    dir.display()
                ),
            ));
        }
        Ok(())
    }

    /// `device_mem` in bytes; None when not set.
    pub fn device_mem_bytes(&self) -> Result<Option<u64>, ConfigError> {
        size_bytes("device_mem", self.device_mem.as_deref())
    }

    /// `host_mem` in bytes; None when not set.
    pub fn host_mem_bytes(&self) -> Result<Option<u64>, ConfigError> {
        size_bytes("host_mem", self.host_mem.as_deref())
    }

    /// `nvme_mem` in bytes; None when not set.
    pub fn nvme_mem_bytes(&self) -> Result<Option<u64>, ConfigError> {
        size_bytes("nvme_mem", self.nvme_mem.as_deref())
    }

    /// The learning rate of optimizer step `step`, counted from 1: a linear rise from 0
    /// over `warmup_steps` (step `warmup_steps` has the full `lr`), then `lr` (constant)
    /// or half a cosine down to `lr * min_lr_ratio` at step `steps` and after.
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.lr * step as f64 / self.warmup_steps as f64;
        }
        match self.lr_schedule {
            LrSchedule::Constant => self.lr,
            LrSchedule::Cosine => {
                let min = self.lr * self.min_lr_ratio;
                if step >= self.steps {
                    return min;
                }
                // Here warmup_steps <= step < steps, so the span is positive.
                let progress =
                    (step - self.warmup_steps) as f64 / (self.steps - self.warmup_steps) as f64;
                min + 0.5 * (self.lr - min) * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}

fn size_bytes(key: &'static str, text: Option<&str>) -> Result<Option<u64>, ConfigError> {
    let Some(text) = text.and_then(size_setting) else {
        return Ok(None);
    };
    match parse_bytes(&text) {
        Ok(0) => Err(invalid(
            key,
            "must be more than 0 bytes (found 0)".to_string(),
        )),
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) => Err(invalid(key, format!("is not a size: {e}"))),
    }
}

/// Appends `text` as `# ` comment lines of at most `width` characters where words allow,
/// never breaking a `[default: ...]`.
fn wrap_comment(out: &mut String, text: &str, width: usize) {
    let (body, default) = match text.find("[default:") {
        Some(i) => text.split_at(i),
        None => (text, ""),
    };
    let mut line = String::from("#");
    let words = body.split_whitespace();
    for word in words.chain((!default.is_empty()).then_some(default)) {
        if line.len() > 1 && line.len() + 1 + word.len() > width {
            out.push_str(&line);
            out.push('\n');
            line = String::from("#");
        }
        line.push(' ');
        line.push_str(word);
    }
    out.push_str(&line);
    out.push('\n');
}

/// Each flag's one-line help, by key: the flags' doc comments are the keys' documentation.
fn flag_help() -> Vec<(String, String)> {
    let command = <TrainArgs as clap::Args>::augment_args(clap::Command::new("train"));
    command
        .get_arguments()
        .filter_map(|arg| {
            let help = arg.get_help()?.to_string();
            Some((arg.get_id().to_string(), help))
        })
        .collect()
}

/// The flags that shape a step, shared by `strata train` and `strata plan`: the model,
/// the budgets, the batch, the precision, the device.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct StepFlags {
    /// A preset (GPT-2: tiny, small, gpt2, gpt2-medium, gpt2-large, gpt2-xl; Llama
    /// family, published shapes without weights: llama-3-8b, llama-3.1-8b, llama-3.2-1b,
    /// llama-3.2-3b, qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-3b, qwen2.5-7b, qwen3-8b,
    /// mistral-7b), a GPT-2 shape LAYERSxWIDTH, a directory holding config.json and
    /// model.safetensors, or one holding only config.json (a shape, initialised from
    /// --seed) [default: small].
    #[arg(long)]
    pub model: Option<String>,
    /// Device memory budget, such as 48MiB or 20GiB; all: what the device has
    /// [default: 16MiB].
    #[arg(long, value_name = "SIZE")]
    pub device_mem: Option<String>,
    /// Pinned host memory budget, such as 16GiB; all: no limit stated [default: 8MiB].
    #[arg(long, value_name = "SIZE")]
    pub host_mem: Option<String>,
    /// NVMe budget across the --nvme directories, such as 900GB or 1TiB; all: 90% of
    /// their free space [default: all].
    #[arg(long, value_name = "SIZE")]
    pub nvme_mem: Option<String>,
    /// A directory for swap files, on an NVMe drive; repeat for several drives, striped
    /// [default: the temporary directory, or target/ when that is tmpfs].
    #[arg(long, value_name = "PATH")]
    pub nvme: Vec<PathBuf>,
    /// How many blocks ahead parameters are fetched [default: the policy decides].
    #[arg(long, value_name = "BLOCKS")]
    pub prefetch: Option<usize>,
    /// Which layers' backward recomputes their forward from their input checkpoint
    /// instead of reading the activations the forward kept on the device: auto keeps
    /// every layer's that fits the device budget and recomputes the rest, all recomputes
    /// every layer (least device memory), none keeps every layer's (fastest; refused,
    /// naming the shortfall, when they do not fit); results are identical either way
    /// [default: auto].
    #[arg(long, value_enum)]
    pub recompute: Option<Recompute>,
    /// Whether, with clipping, gradients wait for the global norm on NVMe instead of
    /// host memory (4 bytes per parameter there, for 8 more of NVMe traffic): auto when
    /// the host budget needs it, always, or never; results are identical either way
    /// [default: auto].
    #[arg(long, value_enum)]
    pub spill_grads: Option<GradSpill>,
    /// Sequences per micro-batch [default: 8].
    #[arg(long)]
    pub batch: Option<usize>,
    /// Tokens per sequence, at most the model's context [default: 64].
    #[arg(long)]
    pub seq: Option<usize>,
    /// Micro-batches accumulated into one optimizer step [default: 1].
    #[arg(long)]
    pub grad_accum: Option<usize>,
    /// Largest global gradient norm; 0 disables clipping [default: 1.0].
    #[arg(long, allow_negative_numbers = true)]
    pub clip: Option<f64>,
    /// Working precision on the device; master weights and Adam state stay fp32
    /// [default: fp32].
    #[arg(long, value_enum)]
    pub dtype: Option<Dtype>,
    /// After the warm-up, overlap each optimizer update with the next step's compute
    /// (updates one step late); --delayed-update=false turns it off [default: false].
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub delayed_update: Option<bool>,
    /// Where to compute: a GPU when CUDA is usable (auto), the CPU, or a GPU or nothing
    /// [default: auto].
    #[arg(long, value_parser = DEVICES)]
    pub device: Option<String>,
}

impl StepFlags {
    /// Writes every flag given into `config`; adds their keys to `set`.
    fn apply(&self, config: &mut TrainConfig, set: &mut BTreeSet<&'static str>) {
        macro_rules! take {
            ($($field:ident),*) => {$(
                if let Some(value) = &self.$field {
                    config.$field = value.clone();
                    set.insert(stringify!($field));
                }
            )*};
        }
        take!(
            model,
            recompute,
            spill_grads,
            batch,
            seq,
            grad_accum,
            clip,
            dtype,
            delayed_update,
            device
        );
        for (key, flag, setting) in [
            ("device_mem", &self.device_mem, &mut config.device_mem),
            ("host_mem", &self.host_mem, &mut config.host_mem),
            ("nvme_mem", &self.nvme_mem, &mut config.nvme_mem),
        ] {
            if let Some(text) = flag {
                *setting = size_setting(text);
                set.insert(key);
            }
        }
        if let Some(prefetch) = self.prefetch {
            config.prefetch = Some(prefetch);
            set.insert("prefetch");
        }
        if !self.nvme.is_empty() {
            config.nvme = self.nvme.clone();
            set.insert("nvme");
        }
    }
}

/// Reads `--config` (or the defaults), lets `apply` write the flags given, and validates,
/// naming where a value at fault came from.
fn resolve_with(
    config_file: Option<&Path>,
    apply: impl FnOnce(&mut TrainConfig) -> BTreeSet<&'static str>,
) -> Result<TrainConfig, ConfigError> {
    let (mut config, from_file) = match config_file {
        Some(path) => TrainConfig::read_file(path)?,
        None => (TrainConfig::default(), BTreeSet::new()),
    };
    let from_flags = apply(&mut config);
    config.validate().map_err(|e| {
        e.located(|key| match config_file {
            _ if from_flags.contains(key) => Origin::Flag,
            Some(path) if from_file.contains(key) => Origin::File(path.to_path_buf()),
            _ => Origin::Default,
        })
    })?;
    Ok(config)
}

/// Arguments of `strata train`. Every setting can come from `--config FILE` and from its
/// flag; a flag given wins over the file, which wins over the default.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TrainArgs {
    /// A TOML file of settings (keys as in --print-config); flags given override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print the merged settings as TOML, every key with its help, and exit.
    #[arg(long)]
    pub print_config: bool,
    /// The flags that shape a step.
    #[command(flatten)]
    pub step: StepFlags,
    /// Token data: an llm.c token file (*.bin), or text: *.jsonl lines {"text": ...} or
    /// {"prompt": ..., "completion": ...} (the loss counts completions only), any other
    /// file one document; text is tokenized with the model folder's tokenizer.json,
    /// cached beside the data (bytes as tokens for a vocabulary of 256) [default: the
    /// built-in corpus].
    #[arg(long, value_name = "PATH")]
    pub data: Option<PathBuf>,
    /// Swap policy: where parameters, gradients, optimizer state and activations live
    /// [default: auto].
    #[arg(long, value_parser = POLICIES)]
    pub policy: Option<String>,
    /// Optimizer steps [default: 600].
    #[arg(long)]
    pub steps: Option<u64>,
    /// Peak learning rate [default: 3e-3].
    #[arg(long, allow_negative_numbers = true)]
    pub lr: Option<f64>,
    /// Learning rate after the warmup: constant, or a cosine decay to lr * min-lr-ratio
    /// [default: cosine].
    #[arg(long, value_enum)]
    pub lr_schedule: Option<LrSchedule>,
    /// Steps of linear learning-rate warmup from 0 [default: 10].
    #[arg(long)]
    pub warmup_steps: Option<u64>,
    /// The cosine schedule's final learning rate, as a fraction of lr [default: 0.1].
    #[arg(long, allow_negative_numbers = true)]
    pub min_lr_ratio: Option<f64>,
    /// AdamW weight decay [default: 0.1].
    #[arg(long, allow_negative_numbers = true)]
    pub weight_decay: Option<f64>,
    /// AdamW beta1 [default: 0.9].
    #[arg(long, allow_negative_numbers = true)]
    pub beta1: Option<f64>,
    /// AdamW beta2 [default: 0.95].
    #[arg(long, allow_negative_numbers = true)]
    pub beta2: Option<f64>,
    /// AdamW epsilon [default: 1e-8].
    #[arg(long, allow_negative_numbers = true)]
    pub eps: Option<f64>,
    /// Seed of the initial weights and of anything else random [default: 1337].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Directory of checkpoints [default: none written].
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every N steps; 0 checkpoints only at the end and on Ctrl-C [default: 0].
    #[arg(long, value_name = "N")]
    pub checkpoint_every: Option<u64>,
    /// Checkpoints kept; older ones are deleted [default: 3].
    #[arg(long, value_name = "N")]
    pub keep_checkpoints: Option<usize>,
    /// Directory to save the trained model in: config.json, the weights (sharded like
    /// the input when large) and the input's tokenizer and generation files.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Type of the tensors saved in --out [default: the type the model was read in;
    /// fp32 for a preset].
    #[arg(long, value_enum)]
    pub save_dtype: Option<Dtype>,
    /// File to append one JSON line of metrics per step to (created if missing; each
    /// line written as its step ends, so a killed run's log keeps every finished step).
    #[arg(long, value_name = "FILE")]
    pub log_jsonl: Option<PathBuf>,
    /// File to write a Chrome trace (for Perfetto) of step --trace-step to.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// The step, counted from 1, that --trace records [default: 3].
    #[arg(long, value_name = "N")]
    pub trace_step: Option<u64>,
    /// A checkpoint directory to resume from, bit-identically.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Report the held-out loss every N steps; 0 never [default: 0].
    #[arg(long, value_name = "N")]
    pub eval_every: Option<u64>,
}

impl TrainArgs {
    /// The settings of the run: the defaults, then the `--config` file, then each flag
    /// given; checked with [`TrainConfig::validate`], an error naming where the value at
    /// fault came from.
    pub fn resolve(&self) -> Result<TrainConfig, ConfigError> {
        resolve_with(self.config.as_deref(), |config| self.apply(config))
    }

    /// Writes every flag given into `config`; returns their keys.
    fn apply(&self, config: &mut TrainConfig) -> BTreeSet<&'static str> {
        let mut set = BTreeSet::new();
        self.step.apply(config, &mut set);
        macro_rules! take {
            ($($field:ident),*) => {$(
                if let Some(value) = &self.$field {
                    config.$field = value.clone();
                    set.insert(stringify!($field));
                }
            )*};
        }
        macro_rules! take_some {
            ($($field:ident),*) => {$(
                if let Some(value) = &self.$field {
                    config.$field = Some(value.clone());
                    set.insert(stringify!($field));
                }
            )*};
        }
        take!(
            policy,
            steps,
            lr,
            lr_schedule,
            warmup_steps,
            min_lr_ratio,
            weight_decay,
            beta1,
            beta2,
            eps,
            seed,
            checkpoint_every,
            keep_checkpoints,
            trace_step,
            eval_every
        );
        take_some!(
            data,
            checkpoint_dir,
            out,
            save_dtype,
            log_jsonl,
            trace,
            resume
        );
        set
    }
}

/// Arguments of `strata plan`: the flags that shape a step (as `strata train` takes them,
/// from `--config FILE` too), how many ranks to plan for, and where to write the answer
/// as JSON.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// A TOML file of settings (keys as in --print-config); flags given override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print the merged settings as TOML, every key with its help, and exit.
    #[arg(long)]
    pub print_config: bool,
    /// The flags that shape a step.
    #[command(flatten)]
    pub step: StepFlags,
    /// Also write the answer as JSON to FILE: params, and per policy whether it fits,
    /// its peak bytes per tier and predicted step seconds, and the policy auto picks.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Plan the step as one of N ranks of ZeRO-3 data parallelism, as `mpirun -np N
    /// strata train` runs it: each rank owns 1/N of every block's parameters, gradients
    /// and optimizer state, and the figures are per rank.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub ranks: usize,
}

impl Default for PlanArgs {
    /// No flags: one rank.
    fn default() -> Self {
        PlanArgs {
            config: None,
            print_config: false,
            step: StepFlags::default(),
            json: None,
            ranks: 1,
        }
    }
}

impl PlanArgs {
    /// The settings `strata train` would run with the same flags and file.
    pub fn resolve(&self) -> Result<TrainConfig, ConfigError> {
        resolve_with(self.config.as_deref(), |config| {
            let mut set = BTreeSet::new();
            self.step.apply(config, &mut set);
            set
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config with every optional key set, so that serializing it shows every key.
    fn everything_set() -> TrainConfig {
        TrainConfig {
            data: Some("d.txt".into()),
            host_mem: Some("1GiB".into()),
            prefetch: Some(2),
            checkpoint_dir: Some("ck".into()),
            out: Some("out".into()),
            save_dtype: Some(Dtype::Bf16),
            log_jsonl: Some("log.jsonl".into()),
            trace: Some("trace.json".into()),
            resume: Some("ck/step-10".into()),
            ..TrainConfig::default()
        }
    }

    #[test]
    fn keys_are_the_fields_and_the_flags() {
        let table = toml::Table::try_from(everything_set()).expect("serializes");
        let fields: BTreeSet<&str> = table.keys().map(String::as_str).collect();
        let keys: BTreeSet<&str> = KEYS.iter().map(|(k, _)| *k).collect();
        assert_eq!(fields, keys);
        let help = flag_help();
        for key in &keys {
            assert!(help.iter().any(|(k, _)| k == key), "no flag for `{key}`");
        }
        let choices = |key| match kind(key) {
            Kind::Choice(words) => words,
            _ => panic!("{key} is a choice"),
        };
        assert!(POLICIES.iter().all(|p| choices("policy").contains(p)));
        assert!(DEVICES.iter().all(|d| choices("device").contains(d)));
        for (alias, key) in ALIASES {
            assert!(keys.contains(key), "alias {alias} of unknown key {key}");
            assert!(!keys.contains(alias), "alias {alias} is a key");
        }
    }

    /// The flags' help states defaults in words; they must be the defaults.
    #[test]
    fn help_states_the_true_defaults() {
        let table = toml::Table::try_from(TrainConfig::default()).expect("serializes");
        for (key, help) in flag_help() {
            let Some(start) = help.find("[default: ") else {
                continue;
            };
            let stated = help[start + "[default: ".len()..].trim_end_matches(['.', ']']);
            match table.get(&key) {
                Some(toml::Value::Integer(i)) => assert_eq!(stated.parse(), Ok(*i), "{key}"),
                Some(toml::Value::Float(x)) => assert_eq!(stated.parse(), Ok(*x), "{key}"),
                Some(toml::Value::String(s)) => assert_eq!(stated, s, "{key}"),
                Some(toml::Value::Boolean(b)) => assert_eq!(stated, b.to_string(), "{key}"),
                // Unset or a list: the help says in words what happens.
                _ => {}
            }
        }
    }

    #[test]
    fn all_memory_is_none_both_ways() {
        let config = TrainConfig {
            device_mem: None,
            host_mem: None,
            ..TrainConfig::default()
        };
        let text = toml::to_string(&config).expect("serializes");
        assert!(text.contains("device_mem = \"all\""), "{text}");
        assert!(text.contains("host_mem = \"all\""), "{text}");
        let back: TrainConfig = toml::from_str(&text).expect("parses");
        assert_eq!(back, config);
        assert_eq!(config.device_mem_bytes().expect("valid"), None);
        let spelled = TrainConfig {
            host_mem: Some("ALL".into()),
            ..TrainConfig::default()
        };
        assert_eq!(spelled.host_mem_bytes().expect("valid"), None);
    }

    #[test]
    fn defaults_are_valid() {
        TrainConfig::default()
            .validate()
            .expect("the defaults pass");
    }

    #[test]
    fn suggestions() {
        assert_eq!(suggest("lerning_rate"), Some("lr"));
        assert_eq!(suggest("learning-rate"), Some("lr"));
        assert_eq!(suggest("batch_size"), Some("batch"));
        assert_eq!(suggest("stpes"), Some("steps"));
        assert_eq!(suggest("device-mem"), Some("device_mem"));
        assert_eq!(suggest("warmup"), Some("warmup_steps"));
        assert_eq!(suggest("zzzzzz"), None);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("stpes", "steps"), 1);
    }

    #[test]
    fn lr_warmup_then_cosine() {
        let c = TrainConfig {
            lr: 1.0,
            steps: 110,
            warmup_steps: 10,
            min_lr_ratio: 0.1,
            ..TrainConfig::default()
        };
        assert_eq!(c.lr_at(0), 0.0);
        assert!((c.lr_at(1) - 0.1).abs() < 1e-12);
        assert!((c.lr_at(5) - 0.5).abs() < 1e-12);
        assert_eq!(c.lr_at(10), 1.0);
        // Halfway through the decay: halfway between peak and floor.
        assert!((c.lr_at(60) - 0.55).abs() < 1e-12);
        assert!((c.lr_at(110) - 0.1).abs() < 1e-12);
        assert!((c.lr_at(500) - 0.1).abs() < 1e-12);
        for step in 10..110 {
            assert!(c.lr_at(step + 1) <= c.lr_at(step), "rises at step {step}");
        }
    }

    #[test]
    fn line_and_column() {
        assert_eq!(line_column("ab\ncd", 0), (1, 1));
        assert_eq!(line_column("ab\ncd", 4), (2, 2));
    }

    #[test]
    fn comments_wrap() {
        let mut out = String::new();
        wrap_comment(&mut out, "one two three four", 10);
        assert_eq!(out, "# one two\n# three\n# four\n");
    }
}
