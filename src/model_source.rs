//! What a `--model` value names: a preset (GPT-2's, or a Llama-family published shape), a
//! GPT-2 shape written `LAYERSxWIDTH`, or a folder holding `config.json` (with weights to
//! fine-tune, or alone: a shape). `train`, `plan`, `checkpoint export` and the config's
//! check read a name the same way through these functions; `train` and `plan` take the
//! model over packed batches with `--pack` ([`run_model`]).
//!
//! Not here: reading a model's weights (the engine's `model::weights`) or the training
//! loop's use of them.

use std::path::Path;

use strata_engine::model::tokenize::{TextTokenizer, config_eos};
use strata_engine::model::weights::{self, Pretrained};
use strata_engine::model::{Gpt2Config, Llama, LlamaConfig, Model, PRESETS};

use crate::train_config::TrainConfig;

type Error = Box<dyn std::error::Error>;

/// The preset the default job trains, which the model module may not list yet.
pub const SMALL_PRESET: &str = "small";

/// The preset names `--model` accepts.
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

/// A GPT-2 shape written `LAYERSxWIDTH` (`40x5120`: heads of 128 channels, GPT-2's
/// vocabulary and context), for planning sizes that have no preset.
pub fn custom_shape(name: &str) -> Option<Gpt2Config> {
    let (layers, width) = shape_spec(name)?;
    Some(Gpt2Config::new(
        layers,
        (width / 128).max(1),
        width,
        50257,
        1024,
    ))
}

/// Whether `path` is a model folder holding a `config.json` and no weights of any
/// format ([`weights::is_weights_file`]): a shape, trained from a random initialisation
/// like a preset (with its tokenizer files, only when the run says so: [`refusal`]).
pub fn has_no_weights(path: &Path) -> bool {
    path.is_dir()
        && path.join(weights::CONFIG_FILE).is_file()
        && weights::weights_files(path).is_empty()
}

/// The files of a model folder besides `config.json` that a trained model keeps (its
/// tokenizer and generation settings, [`weights::CARRIED_FILES`]) that `dir` holds.
fn carried_files(dir: &Path) -> Vec<&'static str> {
    weights::CARRIED_FILES
        .into_iter()
        .filter(|f| dir.join(f).is_file())
        .collect()
}

/// Whether `name` is a shape without weights (a preset, `LAYERSxWIDTH`, or a folder of
/// only `config.json`), initialised from the seed.
pub fn is_shape(name: &str) -> bool {
    Gpt2Config::preset(name).is_ok()
        || LlamaConfig::preset(name).is_some()
        || custom_shape(name).is_some()
        || has_no_weights(Path::new(name))
}

/// The model `name` names, without parameters: a preset, `LAYERSxWIDTH`, or a folder's
/// `config.json`.
pub fn model_shape(name: &str) -> Result<Model, Error> {
    if let Ok(config) = Gpt2Config::preset(name) {
        return Ok(Model::new(config)?);
    }
    if let Some(config) = LlamaConfig::preset(name) {
        return Ok(Model::of(Llama::new(config)?));
    }
    if let Some(config) = custom_shape(name) {
        return Ok(Model::new(config)?);
    }
    let (config, _) = weights::model_files(Path::new(name));
    Ok(weights::load_config(&config)?)
}

/// The model a run of `cfg` trains, without parameters: [`model_shape`] of its `model`,
/// with the backward its `approx_backward` names, with the LoRA adapter `--lora` asks
/// for (over a base quantised as `--quant` says), over packed batches when it asks for
/// `pack` (the documents' end being the model folder's end-of-sequence id,
/// [`document_end`]).
pub fn run_model(cfg: &TrainConfig) -> Result<Model, Error> {
    let mut model = model_shape(&cfg.model)?.approximate(cfg.approx_backward)?;
    if let Some(lora) = cfg.lora_config()? {
        model = model.lora(&lora)?;
    }
    if let Some(quant) = cfg.quant {
        model = model.quantized(quant)?;
    }
    if !cfg.pack {
        return Ok(model);
    }
    match document_end(Path::new(&cfg.model)) {
        Some(eos) => Ok(model.packed(eos)?),
        None => {
            // A family that packs nothing is refused as such, whatever its files name.
            model.packed(0)?;
            Err(format!(
                "--pack needs the id that ends a document, and {} names none: give a model \
                 folder whose tokenizer (tokenizer_config.json's eos_token, or a usual name \
                 such as <|endoftext|>) or config.json (eos_token_id) names one",
                cfg.model
            )
            .into())
        }
    }
}

/// The id that ends a document in the folder `dir`: its tokenizer's end-of-sequence
/// token (what tokenized text puts after each document), else `config.json`'s
/// `eos_token_id` (a number or the first of a list); none for a preset or a shape.
pub fn document_end(dir: &Path) -> Option<u32> {
    let tokenizer = dir.join("tokenizer.json").is_file();
    let from_tokenizer = tokenizer.then(|| TextTokenizer::open(dir).ok()?.eos());
    from_tokenizer.flatten().or_else(|| config_eos(dir))
}

/// The folder `name` names, described (headers only), when it names one with weights
/// rather than a preset or a shape; for a shape folder that holds tokenizer or
/// generation files (trained with `--from-scratch`), the folder with its `config.json`
/// and f32 weights, so that the trained model keeps those files.
pub fn pretrained_source(name: &str) -> Result<Option<Pretrained>, Error> {
    let dir = Path::new(name);
    if !is_shape(name) {
        return Ok(Some(weights::describe_pretrained(dir)?.1));
    }
    if !has_no_weights(dir) || carried_files(dir).is_empty() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(dir.join(weights::CONFIG_FILE))?;
    Ok(Some(Pretrained {
        dir: dir.to_path_buf(),
        config: serde_json::from_str(&text)?,
        dtype: weights::FileDtype::F32,
        shard_bytes: None,
    }))
}

/// Why `name` names no model strata can train, in words that follow the setting's name:
/// not a preset, a shape or a folder; a folder without `config.json`; a family strata
/// does not run; weights in a format it does not read (with the command that converts
/// them), or weight files it cannot read as one model (shards without their index); a
/// folder that holds a tokenizer but no weights, unless `from_scratch` says to train it
/// from the seed on purpose. Looks at the file system.
pub fn refusal(name: &str, from_scratch: bool) -> Option<String> {
    let presets = preset_names();
    if presets.contains(&name) || shape_spec(name).is_some() {
        return None;
    }
    let dir = Path::new(name);
    if !dir.is_dir() {
        return Some(format!(
            "must be a preset ({}), a shape LAYERSxWIDTH (such as 40x5120), or a directory \
             holding config.json and model.safetensors, or only a config.json for a shape \
             without weights (found \"{name}\")",
            presets.join(", "),
        ));
    }
    let config = dir.join(weights::CONFIG_FILE);
    if !config.is_file() {
        return Some(format!(
            "names the directory {} but it has no config.json; save a model there with \
             save_pretrained or `strata model --init DIR`",
            dir.display()
        ));
    }
    // A family strata does not run is said first, whatever the weights' format.
    if let Err(e) = weights::load_config(&config) {
        return Some(e.to_string());
    }
    // A folder of only config.json is a shape, initialised like a preset; one that also
    // holds a model's tokenizer lost its weights (or never had them), which a run must
    // not replace with random ones unasked. Else one model.safetensors or sharded ones;
    // pytorch_model.bin refused with the command that converts it.
    if has_no_weights(dir) {
        let carried = carried_files(dir);
        if carried.is_empty() || from_scratch {
            return None;
        }
        return Some(format!(
            "names {}, which holds {} but no weights ({} or shards with {}): it would train \
             from a random initialisation; copy the weights there, or add --from-scratch to \
             initialise from --seed on purpose",
            dir.display(),
            carried.join(", "),
            weights::WEIGHTS_FILE,
            weights::INDEX_FILE
        ));
    }
    weights::weights_layout(dir).err().map(|e| e.to_string())
}
