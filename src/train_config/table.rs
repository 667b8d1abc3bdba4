//! Every setting of `strata train`, declared once: its key (the TOML key and, in kebab
//! case, the flag), its doc comment (the rustdoc, the flag's help, the comment
//! `--print-config` writes above it), its type (how the flag and the file read it), its
//! default, which commands take its flag (`Step`: `train` and `plan`; `Run`: `train`
//! only), the names other trainers give it (suggested for an unknown key), and its check.
//! The [`settings!`] table makes [`TrainConfig`], its `Default`, and [`SETTINGS`], which
//! the file, the flags and [`TrainConfig::validate`] go through.
//!
//! The defaults are the README's main job: the `small` preset on the built-in corpus,
//! under a 16 MiB device budget. This module checks values; it does not resolve them
//! against the machine (where swap files go when `nvme` is empty, which device `auto`
//! picks, whether a budget fits the model): [`crate::run_setup`] does.

use std::path::PathBuf;

use clap::{Arg, ArgMatches};
use serde::{Deserialize, Serialize};
use strata_engine::device::DeviceChoice;
use strata_engine::model::lora::{ADAPTER_CONFIG_FILE, LoraConfig};
use strata_engine::model::{ApproxBackward, BaseQuant, ModelError};
use strata_engine::plan::{
    GradDtype, GradSpill, OptimizerState, PolicyChoice, Recompute, Schedule,
};

use super::error::ConfigError;
use super::values::{Dtype, LrSchedule, OnNonFinite, SettingType};
use crate::model_source::SMALL_PRESET;
use crate::size::MemBudget;

/// Which commands take a setting's flag (every setting can come from `--config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Group {
    /// What shapes a step: `strata train` and `strata plan`.
    Step,
    /// The rest of a run: `strata train` only.
    Run,
}

/// One setting, as the table declares it.
pub(crate) struct Setting {
    /// The TOML key; the flag is `--` and the key in kebab case.
    pub key: &'static str,
    /// Which commands take its flag.
    pub group: Group,
    /// Its doc comment, a line an entry.
    pub doc: &'static [&'static str],
    /// Names other trainers' configs give it.
    pub aliases: &'static [&'static str],
    /// What `--print-config` writes as its value when unset.
    pub placeholder: &'static str,
    /// What a value must be ([`SettingType::expected`]).
    pub expected: fn() -> String,
    /// Why a word is refused, for a type written as words ([`SettingType::refusal`]).
    pub refusal: fn(&str) -> Option<String>,
    /// Its flag, without help: id and long name, value parser, and the table's extras.
    pub arg: fn(Arg) -> Arg,
    /// Writes the flag's value into a config when the flag was given; whether it was.
    pub read_flag: fn(&mut TrainConfig, &ArgMatches) -> bool,
    /// Copies its value from the second config into the first.
    pub copy: fn(&mut TrainConfig, &TrainConfig),
    /// Its check, with the others' values at hand: the problem, in words that follow the
    /// key ("must be at least 1 (found 0)").
    pub check: fn(&TrainConfig) -> Result<(), String>,
}

impl Setting {
    /// Its help: the doc comment as one line, without the closing full stop (as clap's
    /// derive writes a doc comment's help).
    pub fn help(&self) -> String {
        let words: Vec<&str> = self.doc.iter().map(|line| line.trim()).collect();
        let text = words.join(" ");
        text.strip_suffix('.').unwrap_or(&text).to_string()
    }

    /// Its flag, with help.
    pub fn flag(&self) -> Arg {
        let arg = Arg::new(self.key)
            .long(self.key.replace('_', "-"))
            .value_name(self.key.to_uppercase());
        (self.arg)(arg).help(self.help())
    }
}

/// The setting of `key`. Every key is in the table.
pub(crate) fn setting(key: &str) -> &'static Setting {
    SETTINGS
        .iter()
        .find(|s| s.key == key)
        .expect("every key is in SETTINGS")
}

/// Declares the settings: a row each, in the order `--print-config` writes them and
/// `validate` checks them.
///
/// ```text
/// /// Doc comment: rustdoc, flag help, --print-config comment.
/// #[serde(...)]                              // optional, for the config's field
/// Group key: Type = default,
///     flag(value_name = "N"),                // optional: clap `Arg` methods and values
///     aliases("other_name"),                 // optional
///     check(function);                       // optional: fn(&TrainConfig) -> Result<(), String>
/// ```
macro_rules! settings {
    ($(
        $(#[doc = $doc:literal])*
        $(#[serde($($serde:tt)*)])*
        $group:ident $key:ident: $ty:ty = $default:expr
        $(, flag($($method:ident = $value:expr),* $(,)?))?
        $(, aliases($($alias:literal),* $(,)?))?
        $(, check($check:expr))?
        ;
    )*) => {
        /// Every setting of a `strata train` run. Serialized as one flat TOML table whose
        /// keys are the field names; a key left out keeps its default.
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields, default)]
        pub struct TrainConfig {
            $(
                $(#[doc = $doc])*
                $(#[serde($($serde)*)])*
                pub $key: $ty,
            )*
        }

        impl Default for TrainConfig {
            fn default() -> Self {
                TrainConfig {
                    $($key: $default,)*
                }
            }
        }

        /// Every setting, in the order `--print-config` writes them and `validate` checks
        /// them.
        pub(crate) const SETTINGS: &[Setting] = &[$(
            Setting {
                key: stringify!($key),
                group: Group::$group,
                doc: &[$($doc),*],
                aliases: &[$($($alias),*)?],
                placeholder: <$ty as SettingType>::PLACEHOLDER,
                expected: <$ty as SettingType>::expected,
                refusal: <$ty as SettingType>::refusal,
                arg: |arg| <$ty as SettingType>::arg(arg)$($(.$method($value))*)?,
                read_flag: |config, matches| {
                    match <$ty as SettingType>::from_matches(matches, stringify!($key)) {
                        Some(value) => {
                            config.$key = value;
                            true
                        }
                        None => false,
                    }
                },
                copy: |to, from| to.$key = from.$key.clone(),
                check: settings!(@check $($check)?),
            },
        )*];
    };
    (@check) => { |_| Ok(()) };
    (@check $check:expr) => { $check };
}

settings! {
    /// A preset (GPT-2: tiny, small, gpt2, gpt2-medium, gpt2-large, gpt2-xl; Llama
    /// family, published shapes without weights: llama-3-8b, llama-3.1-8b, llama-3-70b,
    /// llama-3.2-1b, llama-3.2-3b, qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-3b, qwen2.5-7b,
    /// qwen3-8b, mistral-7b), a GPT-2 shape LAYERSxWIDTH, a directory holding config.json and
    /// model.safetensors, or one holding only config.json (a shape, initialised from
    /// --seed) [default: small].
    Step model: String = SMALL_PRESET.to_string(),
        aliases("model_path"),
        check(|c| crate::model_source::refusal(&c.model, c.from_scratch).map_or(Ok(()), Err));

    /// Initialise the model from --seed in the shape of --model's config.json, reading no
    /// weights: needed to train a folder that holds a tokenizer but no weights, which is
    /// otherwise refused (its weights may have been lost) [default: false].
    Step from_scratch: bool = false,
        aliases("init_from_scratch");

    /// Token data: an llm.c token file (*.bin), or text: *.jsonl lines {"text": ...},
    /// {"prompt": ..., "completion": ...} (the loss counts completions only) or
    /// {"messages": [{"role": ..., "content": ...}, ...]} (rendered by the model folder's
    /// chat template; the loss counts assistant turns only), any other file one document; text is tokenized with the model folder's tokenizer.json,
    /// cached beside the data (bytes as tokens for a vocabulary of 256) [default: the
    /// built-in corpus].
    #[serde(skip_serializing_if = "Option::is_none")]
    Run data: Option<PathBuf> = None,
        flag(value_name = "PATH"),
        aliases("dataset", "data_path"),
        check(check_data);

    /// Pack documents into full sequences (Llama family): each token attends only
    /// within its document, whose positions restart at 0, and nothing predicts across a
    /// document's end; documents end with the model folder's end-of-sequence token (its
    /// tokenizer's, or config.json's eos_token_id), which tokenized text already puts
    /// after each document [default: false].
    Step pack: bool = false,
        aliases("packing", "sample_packing");

    /// Device memory budget, such as 48MiB or 20GiB; all: what the device has
    /// [default: 16MiB].
    Step device_mem: MemBudget = MemBudget::mib(16),
        aliases("gpu_mem", "gpu_memory", "device_memory", "vram"),
        check(|c| more_than_zero(c.device_mem));

    /// Pinned host memory budget, such as 16GiB; all: no limit stated [default: 8MiB].
    Step host_mem: MemBudget = MemBudget::mib(8),
        aliases("cpu_mem", "host_memory", "ram"),
        check(|c| more_than_zero(c.host_mem));

    /// A directory for swap files, on an NVMe drive; repeat for several drives, striped
    /// [default: the temporary directory, or target/ when that is tmpfs].
    Step nvme: Vec<PathBuf> = Vec::new(),
        flag(value_name = "PATH"),
        aliases("swap", "nvme_paths"),
        check(check_nvme);

    /// NVMe budget across the --nvme directories, such as 900GB or 1TiB; all: 90% of
    /// their free space [default: all].
    Step nvme_mem: MemBudget = MemBudget::All,
        check(|c| more_than_zero(c.nvme_mem));

    /// Swap policy: where parameters, gradients, optimizer state and activations live
    /// [default: auto].
    #[serde(with = "super::values::policy_text")]
    Run policy: PolicyChoice = PolicyChoice::Auto,
        aliases("offload");

    /// How many blocks ahead parameters are fetched [default: the policy decides].
    #[serde(skip_serializing_if = "Option::is_none")]
    Step prefetch: Option<usize> = None,
        flag(value_name = "BLOCKS"),
        aliases("prefetch_depth");

    /// Which layers' backward recomputes their forward from their input checkpoint
    /// instead of reading the activations the forward kept: auto keeps every layer's
    /// on the device when they fit the device budget, else the most that fit, and for
    /// the rest offloads them (to host memory, or NVMe where checkpoints go there) or
    /// recomputes, whichever the cost model predicts faster and the budgets allow; all
    /// recomputes every layer (least device memory), none keeps every layer's on the
    /// device (refused, naming the shortfall, when they do not fit), offload keeps
    /// every layer's off the device between its forward and backward; results are
    /// identical either way [default: auto].
    Step recompute: Recompute = Recompute::Auto;

    /// With --grad-accum above 1, the order of the micro-batches: horizontal runs each
    /// through the whole model before the next (a streamed block's parameters fetched
    /// for every micro-batch); vertical runs all of them through one block before the
    /// next block (fetched once per step for the forward and once for the backward,
    /// but every micro-batch's checkpoints live at once); auto takes vertical where it
    /// fits the budgets and the cost model predicts it faster; results are identical
    /// either way [default: auto].
    Step schedule: Schedule = Schedule::Auto,
        aliases("micro_batch_order");

    /// Whether, with clipping, gradients wait for the global norm on NVMe instead of
    /// host memory (4 bytes per parameter there, for 8 more of NVMe traffic): auto when
    /// the host budget needs it, always, or never; results are identical either way
    /// [default: auto].
    Step spill_grads: GradSpill = GradSpill::Auto;

    /// How a step's gradients are kept once summed over its micro-batches: fp32, or
    /// bf16 (rounded once, before the norm and the update read them; with --dtype bf16,
    /// alone), which halves the bytes of gradients spilled to NVMe; results are
    /// identical across policies either way [default: fp32].
    Step grad_dtype: GradDtype = GradDtype::Fp32;

    /// Approximate gradients that shrink what a kept layer saves for its backward:
    /// exact, or a comma-separated list of gelu:BITS (GPT-2) or silu:BITS (the Llama
    /// family's gate; 1 to 4: the activation's derivative from a few-bit code of its
    /// input), attn:RATIO and mlp:RATIO (weight
    /// gradients of the attention's input and the MLP's products estimated from a
    /// random projection keeping RATIO of the rows, 0 < RATIO < 1) and linear:RATIO
    /// (both), such as gelu:3,linear:0.5; `strata plan` shows what it saves and costs
    /// [default: exact].
    Step approx_backward: ApproxBackward = ApproxBackward::EXACT,
        aliases("approximate_backward");

    /// Fine-tune a LoRA adapter of this rank over the frozen model: the adapters alone
    /// get gradients, optimizer state and updates (the base's products compute input
    /// gradients only), and the trained model is written as a peft adapter folder
    /// (adapter_config.json, adapter_model.safetensors) [default: none, the whole model
    /// trains].
    #[serde(skip_serializing_if = "Option::is_none")]
    Step lora: Option<usize> = None,
        flag(value_name = "RANK"),
        aliases("lora_r", "lora_rank"),
        check(check_lora);

    /// LoRA's alpha: the adapters' product is scaled by alpha / rank (peft's
    /// lora_alpha) [default: 16].
    Step lora_alpha: f64 = 16.0,
        flag(value_name = "ALPHA");

    /// LoRA's dropout on each adapter's input (peft's lora_dropout); only 0 is built
    /// [default: 0].
    Step lora_dropout: f64 = 0.0,
        flag(value_name = "P");

    /// The linear layers LoRA adapts, by Hugging Face module name, comma-separated (such
    /// as q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj, or GPT-2's
    /// c_attn,c_proj,c_fc), or all-linear [default: all-linear].
    Step lora_targets: String = "all-linear".to_string(),
        flag(value_name = "NAMES"),
        aliases("target_modules", "lora_target_modules");

    /// A peft adapter folder to start the LoRA adapters from (its adapter_config.json
    /// sets the rank, alpha, dropout and targets, which --lora flags given with it must
    /// match) [default: none: A as peft initialises it, B zero].
    #[serde(skip_serializing_if = "Option::is_none")]
    Step init_adapter: Option<PathBuf> = None,
        flag(value_name = "DIR"),
        check(check_init_adapter);

    /// Store the frozen base quantised, QLoRA's way: nf4 (bitsandbytes' NF4, blocks of
    /// 64 with double-quantised absmaxes, about 4.1 bits a parameter) or int8 (blocks of
    /// 64, 8.5 bits). Each transformer layer's linear weights are quantised once at load
    /// and dequantised on the device just before use; the embedding, head, norms and
    /// biases stay. Needs --lora [default: none, the base in the working dtype].
    #[serde(skip_serializing_if = "Option::is_none")]
    Step quant: Option<BaseQuant> = None,
        flag(value_name = "FORMAT"),
        aliases("quantization", "base_quant"),
        check(check_quant);

    /// Optimizer steps [default: 600].
    Run steps: u64 = 600,
        aliases("max_steps", "num_steps", "iterations", "max_iters"),
        check(|c| at_least_one(c.steps));

    /// Sequences per micro-batch [default: 8].
    Step batch: usize = 8,
        aliases("batch_size", "micro_batch_size"),
        check(|c| at_least_one(c.batch as u64));

    /// Tokens per sequence, at most the model's context [default: 64].
    Step seq: usize = 64,
        aliases("seq_len", "sequence_length", "block_size", "context"),
        check(|c| at_least_one(c.seq as u64));

    /// Micro-batches accumulated into one optimizer step [default: 1].
    Step grad_accum: usize = 1,
        aliases("gradient_accumulation_steps", "accumulate"),
        check(|c| at_least_one(c.grad_accum as u64));

    /// Peak learning rate [default: 3e-3].
    Run lr: f64 = 3e-3,
        aliases("learning_rate", "max_lr"),
        check(|c| positive(c.lr, "3e-3", ""));

    /// Learning rate after the warmup: constant, or a cosine decay to lr * min-lr-ratio
    /// [default: cosine].
    Run lr_schedule: LrSchedule = LrSchedule::Cosine,
        aliases("scheduler", "lr_scheduler_type");

    /// Steps of linear learning-rate warmup from 0 [default: 10].
    Run warmup_steps: u64 = 10,
        aliases("warmup", "warmup_iters");

    /// The cosine schedule's final learning rate, as a fraction of lr [default: 0.1].
    Run min_lr_ratio: f64 = 0.1,
        aliases("min_lr"),
        check(|c| within(c.min_lr_ratio, "from 0 to 1", (0.0..=1.0).contains(&c.min_lr_ratio)));

    /// AdamW weight decay [default: 0.1].
    Run weight_decay: f64 = 0.1,
        aliases("decay", "wd"),
        check(|c| within(c.weight_decay, "0 or more", at_least_zero(c.weight_decay)));

    /// AdamW beta1 [default: 0.9].
    Run beta1: f64 = 0.9,
        aliases("adam_beta1"),
        check(|c| beta(c.beta1));

    /// AdamW beta2 [default: 0.95].
    Run beta2: f64 = 0.95,
        aliases("adam_beta2"),
        check(|c| beta(c.beta2));

    /// AdamW epsilon [default: 1e-8].
    Run eps: f64 = 1e-8,
        aliases("adam_eps", "epsilon"),
        check(|c| positive(c.eps, "1e-8", "small "));

    /// Largest global gradient norm; 0 disables clipping [default: 1.0].
    Step clip: f64 = 1.0,
        aliases("grad_clip", "max_grad_norm"),
        check(|c| within(c.clip, "0 (no clipping) or more", at_least_zero(c.clip)));

    /// At a step whose loss or gradients are not finite (fp32, bf16): stop before its
    /// update is applied, saving the state before it (in <--checkpoint-dir>/rescue, else
    /// the rescue folder the run names), or skip its update and go on; fp16 always skips and
    /// halves the loss scale. With --clip 0 updates start as gradients arrive, so such a
    /// step is found after its update: the run stops keeping its last checkpoint, and
    /// skip is refused [default: stop].
    Run on_nonfinite: OnNonFinite = OnNonFinite::Stop,
        aliases("nan_policy"),
        check(check_on_nonfinite);

    /// Working precision on the device; master weights stay fp32, and so do AdamW's
    /// moments unless --optimizer-state says otherwise [default: fp32].
    Step dtype: Dtype = Dtype::Fp32,
        aliases("precision");

    /// How AdamW's moments are kept: fp32 (12 bytes of optimizer state per parameter
    /// with the fp32 master weights), bf16 (8) or q8, 8-bit codes with a scale per 256
    /// values (about 6); bf16 and q8 are updated by the CPU, so the state lives in host
    /// memory or on NVMe; checkpoints hold fp32 moments whichever is chosen
    /// [default: fp32].
    Step optimizer_state: OptimizerState = OptimizerState::Fp32,
        aliases("optim_state", "adam_state");

    /// Seed of the initial weights and of anything else random [default: 1337].
    Run seed: u64 = 1337,
        aliases("random_seed");

    /// After the warm-up, overlap each optimizer update with the next step's compute
    /// (updates one step late); --delayed-update=false turns it off [default: false].
    Step delayed_update: bool = false;

    /// Where to compute: a GPU when CUDA is usable (auto), the CPU, or a GPU or nothing
    /// [default: auto].
    #[serde(with = "super::values::device_text")]
    Step device: DeviceChoice = DeviceChoice::Auto;

    /// Directory of checkpoints [default: none written].
    #[serde(skip_serializing_if = "Option::is_none")]
    Run checkpoint_dir: Option<PathBuf> = None,
        flag(value_name = "DIR"),
        aliases("save_dir");

    /// Checkpoint every N steps; 0 checkpoints only at the end and on Ctrl-C [default: 0].
    Run checkpoint_every: u64 = 0,
        flag(value_name = "N"),
        aliases("save_every", "checkpoint_interval");

    /// Checkpoints kept; older ones are deleted [default: 3].
    Run keep_checkpoints: usize = 3,
        flag(value_name = "N"),
        aliases("keep"),
        check(check_keep_checkpoints);

    /// Directory to save the trained model in: config.json, the weights (sharded like
    /// the input when large) and the input's tokenizer and generation files.
    #[serde(skip_serializing_if = "Option::is_none")]
    Run out: Option<PathBuf> = None,
        flag(value_name = "DIR"),
        aliases("output_dir"),
        check(check_out);

    /// With --lora: write --out as a Hugging Face model folder, the trained adapters
    /// merged into the base (in the base's dtype, or --save-dtype), instead of the peft
    /// adapter folder; needs --model to be a folder with weights [default: false].
    Run merge: bool = false,
        aliases("merge_adapter"),
        check(check_merge);

    /// Let --out replace a model already saved there (a folder holding config.json or
    /// safetensors files), which is otherwise refused [default: false].
    Run overwrite: bool = false,
        aliases("overwrite_output_dir");

    /// Type of the tensors saved in --out [default: the type the model was read in;
    /// fp32 for a preset].
    #[serde(skip_serializing_if = "Option::is_none")]
    Run save_dtype: Option<Dtype> = None;

    /// File to append one JSON line of metrics per step to (created if missing; each
    /// line written as its step ends, so a killed run's log keeps every finished step).
    #[serde(skip_serializing_if = "Option::is_none")]
    Run log_jsonl: Option<PathBuf> = None,
        flag(value_name = "FILE"),
        aliases("metrics");

    /// File to write a Chrome trace (for Perfetto) of step --trace-step to.
    #[serde(skip_serializing_if = "Option::is_none")]
    Run trace: Option<PathBuf> = None,
        flag(value_name = "FILE");

    /// The step, counted from 1, that --trace records [default: 3].
    // Past the first step, whose start-up costs would hide the steady state.
    Run trace_step: u64 = 3,
        flag(value_name = "N"),
        check(check_trace_step);

    /// A checkpoint directory to resume from, bit-identically.
    #[serde(skip_serializing_if = "Option::is_none")]
    Run resume: Option<PathBuf> = None,
        flag(value_name = "DIR"),
        check(check_resume);

    /// Report the held-out loss every N steps; 0 never [default: 0].
    Run eval_every: u64 = 0,
        flag(value_name = "N"),
        aliases("eval_interval");
}

/// Skipping a non-finite step needs every update to wait for the global gradient norm,
/// which only clipping (or fp16's overflow check) plans.
fn check_on_nonfinite(c: &TrainConfig) -> Result<(), String> {
    if c.on_nonfinite == OnNonFinite::Skip && c.clip == 0.0 && c.dtype != Dtype::Fp16 {
        return Err(
            "is skip, which needs clipping: with --clip 0 each update is applied as its \
             gradients arrive, before a non-finite one is known; give --clip 1.0 (or \
             --on-nonfinite stop)"
                .to_string(),
        );
    }
    Ok(())
}

fn at_least_one(value: u64) -> Result<(), String> {
    match value {
        0 => Err("must be at least 1 (found 0)".to_string()),
        _ => Ok(()),
    }
}

/// A positive, finite number, such as `example`; `small` for a number that is meant tiny.
fn positive(value: f64, example: &str, small: &str) -> Result<(), String> {
    match value.is_finite() && value > 0.0 {
        true => Ok(()),
        false => Err(format!(
            "must be a {small}positive number, such as {example} (found {value})"
        )),
    }
}

/// A number `in_range` says is in the range `words` describes.
fn within(value: f64, words: &str, in_range: bool) -> Result<(), String> {
    match in_range {
        true => Ok(()),
        false => Err(format!("must be a number {words} (found {value})")),
    }
}

/// Whether `value` is a finite number, 0 or more.
fn at_least_zero(value: f64) -> bool {
    (0.0..=f64::MAX).contains(&value)
}

/// An Adam moment decay: from 0 up to, not including, 1.
fn beta(value: f64) -> Result<(), String> {
    within(
        value,
        "from 0 up to, not including, 1",
        (0.0..1.0).contains(&value),
    )
}

fn more_than_zero(budget: MemBudget) -> Result<(), String> {
    match budget.bytes() {
        Some(0) => Err("must be more than 0 bytes (found 0)".to_string()),
        _ => Ok(()),
    }
}

fn check_data(c: &TrainConfig) -> Result<(), String> {
    match &c.data {
        Some(data) if !data.is_file() => Err(format!(
            "names {}, which is not a file; give a token file (llm.c *.bin), text or JSON \
             lines, or leave it unset for the built-in corpus",
            data.display()
        )),
        _ => Ok(()),
    }
}

fn check_nvme(c: &TrainConfig) -> Result<(), String> {
    // A folder naming `{rank}` is each rank's own, made when the rank starts.
    let missing = c
        .nvme
        .iter()
        .find(|d| !d.to_string_lossy().contains("{rank}") && !d.is_dir());
    match missing {
        Some(dir) => Err(format!(
            "names {}, which is not a directory; create it, or name a directory on the \
             drive that should hold the swap files",
            dir.display()
        )),
        None => Ok(()),
    }
}

fn check_keep_checkpoints(c: &TrainConfig) -> Result<(), String> {
    match c.keep_checkpoints {
        0 => Err("must be at least 1 (found 0): the newest checkpoint is always kept".into()),
        _ => Ok(()),
    }
}

fn check_out(c: &TrainConfig) -> Result<(), String> {
    let Some(out) = &c.out else {
        return Ok(());
    };
    let refusal = crate::out_paths::out_refusal(
        out,
        &c.model,
        c.checkpoint_dir.as_deref(),
        &c.nvme,
        c.overwrite,
    );
    refusal.map_or(Ok(()), Err)
}

fn check_trace_step(c: &TrainConfig) -> Result<(), String> {
    if c.trace.is_some() && !(1..=c.steps).contains(&c.trace_step) {
        return Err(format!(
            "must be a step of the run, from 1 to steps = {} (found {})",
            c.steps, c.trace_step
        ));
    }
    Ok(())
}

fn check_merge(c: &TrainConfig) -> Result<(), String> {
    if !c.merge {
        return Ok(());
    }
    if c.lora.is_none() && c.init_adapter.is_none() {
        return Err("merges a LoRA run's adapters into the base: give --lora RANK".into());
    }
    if c.out.is_none() {
        return Err("writes the merged model to --out: give --out DIR".into());
    }
    if crate::model_source::is_shape(&c.model) {
        return Err(format!(
            "writes the base's weights with the adapters merged in, and {} has none (a \
             preset or a shape); give a model folder with weights, or leave --merge out to \
             write the adapter",
            c.model
        ));
    }
    Ok(())
}

fn check_init_adapter(c: &TrainConfig) -> Result<(), String> {
    match &c.init_adapter {
        Some(dir) if !dir.join("adapter_config.json").is_file() => Err(format!(
            "names {}, which holds no adapter_config.json; give a peft adapter folder \
             (one that save_pretrained or strata train --lora --out wrote)",
            dir.display()
        )),
        _ => Ok(()),
    }
}

fn check_quant(c: &TrainConfig) -> Result<(), String> {
    match c.quant {
        Some(quant) if c.lora.is_none() && c.init_adapter.is_none() => Err(format!(
            "{quant} stores a frozen base quantised, and without --lora the whole model \
             trains: add --lora RANK (QLoRA), or leave --quant out"
        )),
        Some(quant) if c.dtype == Dtype::Fp16 => Err(format!(
            "{quant}: a quantised base trains in fp32 or bf16 (it is dequantised into the \
             working dtype); use --dtype bf16"
        )),
        _ => Ok(()),
    }
}

fn check_lora(c: &TrainConfig) -> Result<(), String> {
    if c.lora.is_none() && c.init_adapter.is_none() {
        return Ok(());
    }
    c.lora_config().map(|_| ()).map_err(|e| e.to_string())?;
    Ok(())
}

fn check_resume(c: &TrainConfig) -> Result<(), String> {
    match &c.resume {
        Some(dir) if !dir.is_dir() => Err(format!(
            "names {}, which is not a directory; give a checkpoint directory (one that \
             checkpoint_dir holds)",
            dir.display()
        )),
        _ => Ok(()),
    }
}

impl TrainConfig {
    /// The LoRA adapter `--lora` asks for, with `--lora-alpha`, `--lora-dropout` and
    /// `--lora-targets`, or `--init-adapter`'s (whose settings `--lora` must then
    /// match); `None` without either.
    pub fn lora_config(&self) -> Result<Option<LoraConfig>, ModelError> {
        let flags = match self.lora {
            Some(rank) => {
                let targets = self
                    .lora_targets
                    .split(',')
                    .map(|t| t.trim().to_string())
                    .collect();
                Some(LoraConfig::new(
                    rank,
                    self.lora_alpha,
                    self.lora_dropout,
                    targets,
                )?)
            }
            None => None,
        };
        let Some(dir) = &self.init_adapter else {
            return Ok(flags);
        };
        let adapter = LoraConfig::read(&dir.join(ADAPTER_CONFIG_FILE))?;
        match flags {
            Some(flags) if flags != adapter => Err(ModelError::InvalidConfig(format!(
                "--init-adapter {} is rank {}, alpha {}, dropout {} on {}, but the --lora \
                 flags ask for rank {}, alpha {}, dropout {} on {}: leave the --lora flags \
                 out to take the adapter's",
                dir.display(),
                adapter.rank,
                adapter.alpha,
                adapter.dropout,
                adapter.targets.join(","),
                flags.rank,
                flags.alpha,
                flags.dropout,
                flags.targets.join(",")
            ))),
            _ => Ok(Some(adapter)),
        }
    }

    /// Checks every setting, and settings together, in the order of `--print-config`;
    /// the first problem is the error. Looks at the file system for paths that must
    /// exist already (`data`, `nvme`, `resume`, a model directory).
    pub fn validate(&self) -> Result<(), ConfigError> {
        for setting in SETTINGS {
            (setting.check)(self).map_err(|problem| ConfigError::invalid(setting.key, problem))?;
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_memory_is_all_both_ways() {
        let config = TrainConfig {
            device_mem: MemBudget::All,
            host_mem: MemBudget::All,
            ..TrainConfig::default()
        };
        let text = toml::to_string(&config).expect("serializes");
        assert!(text.contains("device_mem = \"all\""), "{text}");
        assert!(text.contains("host_mem = \"all\""), "{text}");
        let back: TrainConfig = toml::from_str(&text).expect("parses");
        assert_eq!(back, config);
        assert_eq!(config.device_mem.bytes(), None);
        let spelled: TrainConfig = toml::from_str("host_mem = \"ALL\"").expect("parses");
        assert_eq!(spelled.host_mem.bytes(), None);
    }

    #[test]
    fn defaults_are_valid() {
        TrainConfig::default()
            .validate()
            .expect("the defaults pass");
    }

    #[test]
    fn every_setting_has_help_and_its_own_key() {
        let mut keys = std::collections::BTreeSet::new();
        for s in SETTINGS {
            assert!(!s.help().is_empty(), "{} has no help", s.key);
            assert!(keys.insert(s.key), "{} twice", s.key);
        }
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
}
