//! Hugging Face checkpoints: `config.json` and the weights, one `model.safetensors` or
//! shards listed by `model.safetensors.index.json`, read through memory maps and written
//! so that transformers' `from_pretrained` loads them.
//!
//! `config.json`'s `model_type` picks the family, which parses the rest. Reading accepts
//! tensor names with or without the family's prefix (GPT-2's `transformer.`), skips what
//! the family says is not a parameter (buffers, a tied head's copy), and converts F16 and
//! BF16 tensors to f32 straight from the mapped file into the one f32 buffer per block
//! (no second copy of the model in RAM). Every tensor's header entry is checked against
//! the model before any data is read, so a missing tensor, a wrong shape or a truncated
//! file is an error naming the tensor and its file. `pytorch_model.bin` (a pickle, which
//! runs code when loaded) is refused with the command that converts it.
//!
//! Writing uses the prefixed names and the family's layouts, in f32, bf16 or f16
//! ([`FileDtype`]; by default the dtype the model was read in), as one file or as shards
//! of at most [`SaveOptions::max_shard_bytes`] with an index as transformers writes it.
//! A model read from a folder keeps that folder's `config.json` (only its dtype entry is
//! set to what was written) and its tokenizer and generation files ([`CARRIED_FILES`]).
//! Every file goes through a temporary name renamed into place.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use safetensors::tensor::TensorInfo;
use serde_json::Value;

use super::mapped::{self, map_read_only};
use super::{BlockLayout, Gpt2, Llama, Model, ModelError, TensorSpec, llama};

/// The weights file's name in a model folder.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint: `weight_map` names each tensor's shard.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The configuration file's name in a model folder.
pub const CONFIG_FILE: &str = "config.json";
/// Files of a model folder that training does not change and a saved model keeps: the
/// tokenizer (as `tokenizers` and as the older slow tokenizers write it) and generation
/// settings.
pub const CARRIED_FILES: [&str; 7] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
];
/// transformers' default `max_shard_size` ("5GB"): a model saved from an unsharded one
/// is split into shards of this many bytes only when it is larger.
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// The type tensors are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileDtype {
    /// 32-bit floats.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    F16,
}

impl FileDtype {
    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            FileDtype::F32 => 4,
            FileDtype::Bf16 | FileDtype::F16 => 2,
        }
    }

    /// The name `config.json`'s `torch_dtype` gives it.
    pub fn torch_name(self) -> &'static str {
        match self {
            FileDtype::F32 => "float32",
            FileDtype::Bf16 => "bfloat16",
            FileDtype::F16 => "float16",
        }
    }

    fn safetensors(self) -> Dtype {
        match self {
            FileDtype::F32 => Dtype::F32,
            FileDtype::Bf16 => Dtype::BF16,
            FileDtype::F16 => Dtype::F16,
        }
    }

    fn of(dtype: Dtype) -> Option<Self> {
        match dtype {
            Dtype::F32 => Some(FileDtype::F32),
            Dtype::BF16 => Some(FileDtype::Bf16),
            Dtype::F16 => Some(FileDtype::F16),
            _ => None,
        }
    }

    /// Appends `values` in this type, little-endian (rounding to nearest even).
    fn encode(self, values: &[f32], out: &mut Vec<u8>) {
        match self {
            FileDtype::F32 => out.extend(values.iter().flat_map(|v| v.to_le_bytes())),
            FileDtype::Bf16 => out.extend(
                values
                    .iter()
                    .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()),
            ),
            FileDtype::F16 => out.extend(
                values
                    .iter()
                    .flat_map(|v| half::f16::from_f32(*v).to_le_bytes()),
            ),
        }
    }
}

/// Where a model folder's weights are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WeightsLayout {
    /// One `model.safetensors` (or the file named).
    Single(PathBuf),
    /// Shards listed by `model.safetensors.index.json` (the index file).
    Sharded(PathBuf),
}

/// The weights of `path` (a model folder, a `.safetensors` file, or an index file), or
/// an error saying what is there instead and what to do: `pytorch_model.bin` is refused
/// with the command that converts it.
pub fn weights_layout(path: &Path) -> Result<WeightsLayout, ModelError> {
    if path.is_file() {
        let name = path.file_name().map(|n| n.to_string_lossy().to_string());
        return match name.as_deref() {
            Some(n) if n.ends_with(".index.json") && n.contains("safetensors") => {
                Ok(WeightsLayout::Sharded(path.to_path_buf()))
            }
            Some(n) if n.ends_with(".bin") || n.ends_with(".pt") || n.ends_with(".pth") => {
                Err(pickle_refusal(path.parent().unwrap_or(Path::new(".")), n))
            }
            _ => Ok(WeightsLayout::Single(path.to_path_buf())),
        };
    }
    let single = path.join(WEIGHTS_FILE);
    if single.is_file() {
        return Ok(WeightsLayout::Single(single));
    }
    let index = path.join(INDEX_FILE);
    if index.is_file() {
        return Ok(WeightsLayout::Sharded(index));
    }
    for pickle in ["pytorch_model.bin", "pytorch_model.bin.index.json"] {
        if path.join(pickle).is_file() {
            return Err(pickle_refusal(path, pickle));
        }
    }
    if !path.exists() {
        return Err(ModelError::io(
            path,
            std::io::Error::from(std::io::ErrorKind::NotFound),
        ));
    }
    Err(ModelError::BadInput(missing_weights(path)))
}

/// Why a folder with no [`WEIGHTS_FILE`] or [`INDEX_FILE`] has no weights strata reads,
/// naming the weight files it does hold and what to do with them.
fn missing_weights(dir: &Path) -> String {
    let found = weights_files(dir);
    let listed = |names: &[String]| match names.len() {
        0..=3 => names.join(", "),
        n => format!("{}, ... ({n} files)", names[..2].join(", ")),
    };
    let shards: Vec<String> = found
        .iter()
        .filter(|n| n.contains("-of-") && n.ends_with(".safetensors"))
        .cloned()
        .collect();
    let dir_text = dir.display();
    if !shards.is_empty() {
        return format!(
            "{dir_text}: holds the shards {} but no {INDEX_FILE}, which says which tensor is \
             in which shard; copy the index from where the shards came from (it is published \
             beside them)",
            listed(&shards)
        );
    }
    if let Some(other) = found.iter().find(|n| n.ends_with(".safetensors")) {
        return format!(
            "{dir_text}: holds {other} but no {WEIGHTS_FILE} or {INDEX_FILE}; rename it \
             {WEIGHTS_FILE}, or give the file itself as the model"
        );
    }
    if !found.is_empty() {
        return format!(
            "{dir_text}: holds {} but no {WEIGHTS_FILE} or {INDEX_FILE}; strata reads \
             safetensors only: convert the weights with transformers' save_pretrained",
            listed(&found)
        );
    }
    format!(
        "{dir_text}: has no {WEIGHTS_FILE} or {INDEX_FILE}; save a model there with \
         save_pretrained or `strata model --init DIR`"
    )
}

/// Whether a file of this name holds a model's weights, in any format a model folder
/// is published in (safetensors and their index, PyTorch's pickles and their index,
/// GGUF, TensorFlow's and Flax's): what a folder must not hold unread.
pub fn is_weights_file(name: &str) -> bool {
    let pickle = name.ends_with(".bin")
        && ["pytorch_model", "model", "adapter_model"]
            .iter()
            .any(|p| name.starts_with(p));
    pickle
        || [
            ".safetensors",
            ".safetensors.index.json",
            ".bin.index.json",
            ".pt",
            ".pth",
            ".ckpt",
            ".gguf",
            ".h5",
            ".msgpack",
        ]
        .iter()
        .any(|ext| name.ends_with(ext))
}

/// The names of the files of `dir` that hold weights ([`is_weights_file`]), sorted;
/// none when `dir` cannot be read.
pub fn weights_files(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| is_weights_file(n))
        .collect();
    names.sort();
    names
}

/// The refusal of a pickled PyTorch checkpoint, with the one command that converts it.
fn pickle_refusal(dir: &Path, file: &str) -> ModelError {
    ModelError::BadInput(format!(
        "{}: holds {file}, a pickle (loading one runs code); strata reads safetensors only. \
         Convert it once with transformers: python -c \"from transformers import \
         AutoModelForCausalLM as M; M.from_pretrained('{dir}').save_pretrained('{dir}-safetensors')\" \
         and give that folder",
        dir.display(),
        dir = dir.display()
    ))
}

/// The configuration and weights files of `path`: a model folder, or the weights file
/// itself with `config.json` beside it. The weights file is `model.safetensors` even when
/// the folder is sharded; [`weights_layout`] says which is there.
pub fn model_files(path: &Path) -> (PathBuf, PathBuf) {
    if path.is_dir() {
        (path.join(CONFIG_FILE), path.join(WEIGHTS_FILE))
    } else {
        let dir = path.parent().unwrap_or(Path::new("."));
        (dir.join(CONFIG_FILE), path.to_path_buf())
    }
}

/// What a model folder holds besides its parameters, for writing a trained model back
/// the way it came: its folder, its `config.json` as written, the type and sharding of
/// its weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Pretrained {
    /// The folder.
    pub dir: PathBuf,
    /// `config.json`, as read.
    pub config: Value,
    /// The type most of the model's parameters are stored in.
    pub dtype: FileDtype,
    /// For sharded weights, the largest shard's tensor bytes.
    pub shard_bytes: Option<u64>,
}

impl Pretrained {
    /// The save options that write a model the way this one was read: its dtype, its
    /// sharding, its configuration and carried files.
    pub fn save_options(&self) -> SaveOptions<'_> {
        SaveOptions {
            dtype: self.dtype,
            max_shard_bytes: self.shard_bytes.unwrap_or(DEFAULT_MAX_SHARD_BYTES),
            base: Some(self),
        }
    }
}

/// Loads a model folder (or weights file): its shape from `config.json`, and one f32
/// buffer per block from its weights.
pub fn load_pretrained(path: &Path) -> Result<(Model, Vec<Vec<f32>>), ModelError> {
    let (model, params, _) = open_pretrained(path)?;
    Ok((model, params))
}

/// A model folder's weights opened for reading one block at a time, so that loading a
/// model holds one block's f32 parameters, not the model's: every tensor is found and
/// its shape checked when opened ([`PretrainedBlocks::open`]), and each
/// [`PretrainedBlocks::read_block`] widens one block's tensors from the mapped files.
pub struct PretrainedBlocks {
    model: Model,
    files: WeightFiles,
}

impl PretrainedBlocks {
    /// The weights of `path` (a model folder, a `.safetensors` file or an index) for
    /// `model`, the model its `config.json` describes ([`load_config`]). Every tensor the
    /// model needs is found and its shape checked here, so a folder that does not match
    /// fails before anything is read or allocated.
    pub fn open(path: &Path, model: &Model) -> Result<Self, ModelError> {
        let files = WeightFiles::open(path)?;
        files.check_params(model)?;
        Ok(PretrainedBlocks {
            model: model.clone(),
            files,
        })
    }

    /// Block `b`'s parameters as f32, as [`load_pretrained`] gives them; an error naming
    /// the tensor and its file when one holds a NaN or an infinity.
    ///
    /// # Panics
    /// If `b` is not a block of the model.
    pub fn read_block(&self, b: usize) -> Result<Vec<f32>, ModelError> {
        self.files.read_checked_block(&self.model, "", b, true)
    }
}

/// [`load_pretrained`], with what the folder holds besides the parameters.
pub fn open_pretrained(path: &Path) -> Result<(Model, Vec<Vec<f32>>, Pretrained), ModelError> {
    std::fs::metadata(path).map_err(|e| ModelError::io(path, e))?;
    let (config_path, _) = model_files(path);
    let model = load_config(&config_path)?;
    let files = WeightFiles::open(path)?;
    let params = files.read_params(&model)?;
    let source = files.describe(&model, &config_path)?;
    Ok((model, params, source))
}

/// What [`open_pretrained`] says of a folder besides the parameters, reading only
/// `config.json` and the weights' headers.
pub fn describe_pretrained(path: &Path) -> Result<(Model, Pretrained), ModelError> {
    let (config_path, _) = model_files(path);
    let model = load_config(&config_path)?;
    let files = WeightFiles::open(path)?;
    let source = files.describe(&model, &config_path)?;
    Ok((model, source))
}

/// Whether a model folder holds tensor `t` of `block`: every tensor, but a LoRA model's
/// adapters (its blocks' trained tails), which its base's folder does not have; reading
/// a base folder for a LoRA model leaves them zero, for
/// [`init_block_adapters`](super::lora::init_block_adapters) (or a saved adapter,
/// [`LoraAdapter::into_blocks`](super::lora::LoraAdapter::into_blocks)) to fill.
fn in_base_files(model: &Model, block: &BlockLayout, t: &TensorSpec) -> bool {
    model.lora_config().is_none() || t.slot.offset < block.frozen
}

/// Reads a `config.json` and returns the model it describes: the family its
/// `model_type` names (GPT-2 when it names none), of the shape the rest gives.
pub fn load_config(path: &Path) -> Result<Model, ModelError> {
    let json = read_config_json(path)?;
    let unsupported = |message: String| ModelError::UnsupportedConfig {
        path: path.to_path_buf(),
        message,
    };
    match json.get("model_type").and_then(Value::as_str) {
        None | Some("gpt2") => Ok(Model::of(Gpt2::from_hf_config(path, &json)?)),
        Some(kind) if llama::MODEL_TYPES.contains(&kind) => {
            Ok(Model::of(Llama::from_hf_config(path, &json)?))
        }
        Some(kind) => {
            let architectures = json
                .get("architectures")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .collect::<Vec<_>>()
                        .join(", ")
                })
                .filter(|a| !a.is_empty())
                .map_or(String::new(), |a| format!(" ({a})"));
            Err(unsupported(format!(
                "model_type is `{kind}`{architectures}; strata runs these families: gpt2, {}",
                llama::MODEL_TYPES.join(", ")
            )))
        }
    }
}

/// Refuses the weights of `path` when its `config.json` says they are stored quantised
/// (`quantization_config`: a bitsandbytes 4-bit or 8-bit folder, GPTQ, AWQ, ...): strata
/// reads weights in full precision, and quantises a frozen base itself (`--quant`).
fn refuse_quantized(path: &Path) -> Result<(), ModelError> {
    let (config, _) = model_files(path);
    let Ok(json) = read_config_json(&config) else {
        return Ok(()); // what is wrong with it is said where it is read
    };
    let Some(q) = json.get("quantization_config").filter(|q| !q.is_null()) else {
        return Ok(());
    };
    let method = q
        .get("quant_method")
        .and_then(Value::as_str)
        .unwrap_or("unnamed");
    Err(ModelError::UnsupportedConfig {
        path: config,
        message: format!(
            "its weights are stored quantised (quantization_config, quant_method \
             {method}), and strata reads weights in full precision: give the model \
             folder they were quantised from (bf16, fp16 or f32 safetensors), and \
             --lora RANK --quant nf4 to train over it quantised as bitsandbytes does"
        ),
    })
}

fn read_config_json(path: &Path) -> Result<Value, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| ModelError::UnsupportedConfig {
        path: path.to_path_buf(),
        message: format!("not valid JSON: {e}"),
    })
}

/// The parsed header of a safetensors file and its mapped bytes.
pub(crate) struct SafetensorsFile {
    path: PathBuf,
    map: memmap2::Mmap,
    header_len: usize,
    /// Every tensor's header entry, by its name in the file.
    pub(crate) tensors: HashMap<String, TensorInfo>,
}

impl SafetensorsFile {
    pub(crate) fn open(path: &Path) -> Result<Self, ModelError> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        let map = map_read_only(&file).map_err(|e| ModelError::io(path, e))?;
        let bad = |message: String| ModelError::BadSafetensors {
            path: path.to_path_buf(),
            message,
        };
        let Some(len_bytes) = map.get(..8) else {
            return Err(ModelError::FileTooShort {
                path: path.to_path_buf(),
                message: format!(
                    "{} bytes; a safetensors file starts with an 8-byte header length",
                    map.len()
                ),
            });
        };
        let header_len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes")) as usize;
        let header = map
            .get(8..8usize.saturating_add(header_len))
            .ok_or_else(|| ModelError::FileTooShort {
                path: path.to_path_buf(),
                message: format!(
                    "the header says it is {header_len} bytes long, but the file holds {} bytes",
                    map.len()
                ),
            })?;
        let json: BTreeMap<String, Value> =
            serde_json::from_slice(header).map_err(|e| bad(format!("header is not JSON: {e}")))?;
        let mut tensors = HashMap::new();
        for (name, value) in json {
            if name == "__metadata__" {
                continue;
            }
            let info: TensorInfo = serde_json::from_value(value)
                .map_err(|e| bad(format!("tensor `{name}` has a bad header entry: {e}")))?;
            tensors.insert(name, info);
        }
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            map,
            header_len,
            tensors,
        })
    }

    fn data(&self) -> &[u8] {
        &self.map[8 + self.header_len..]
    }

    /// Checks tensor `name` (its header entry `info`) against `shape` when given, and
    /// its dtype and byte range; returns its dtype and bytes. Reads no tensor data.
    fn checked(
        &self,
        name: &str,
        info: &TensorInfo,
        shape: Option<&[usize]>,
    ) -> Result<(FileDtype, &[u8]), ModelError> {
        if let Some(shape) = shape
            && info.shape != shape
        {
            return Err(ModelError::TensorShape {
                path: self.path.clone(),
                name: name.to_string(),
                expected: shape.to_vec(),
                found: info.shape.clone(),
            });
        }
        let dtype = FileDtype::of(info.dtype).ok_or_else(|| ModelError::TensorDtype {
            path: self.path.clone(),
            name: name.to_string(),
            found: info.dtype.to_string(),
        })?;
        let (start, end) = info.data_offsets;
        let data = self.data();
        if end > data.len() {
            return Err(ModelError::TensorTruncated {
                path: self.path.clone(),
                name: name.to_string(),
                end,
                available: data.len(),
            });
        }
        // A shape whose size overflows is damage like any other mismatch, not a panic.
        let elements = (info.shape.iter()).try_fold(1usize, |n, &d| n.checked_mul(d));
        let bytes = elements.and_then(|n| n.checked_mul(dtype.size_bytes()));
        if end < start || Some(end - start) != bytes {
            return Err(ModelError::BadSafetensors {
                path: self.path.clone(),
                message: format!(
                    "tensor `{name}` has {} data bytes for shape {:?} of {}",
                    end.saturating_sub(start),
                    info.shape,
                    info.dtype
                ),
            });
        }
        Ok((dtype, &data[start..end]))
    }
}

/// Widens `bytes` of `dtype` into `out` (as many elements).
fn widen(dtype: FileDtype, bytes: &[u8], out: &mut [f32]) {
    assert_eq!(out.len() * dtype.size_bytes(), bytes.len());
    match dtype {
        FileDtype::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes(b.try_into().expect("4 bytes"));
            }
        }
        FileDtype::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_le_bytes(b.try_into().expect("2 bytes")).to_f32();
            }
        }
        FileDtype::Bf16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes(b.try_into().expect("2 bytes")).to_f32();
            }
        }
    }
}

/// A model's weight files, memory-mapped: one safetensors file, or the shards an index
/// names. Finds each tensor in its file and reads it as f32, whatever it is stored as.
pub struct WeightFiles {
    files: Vec<SafetensorsFile>,
    /// Each tensor's file, by its name.
    index: HashMap<String, usize>,
    /// The index file, for sharded weights.
    index_path: Option<PathBuf>,
}

impl WeightFiles {
    /// Opens the weights of `path` (a model folder, a `.safetensors` file or an index
    /// file; see [`weights_layout`]): every file mapped, every header parsed, no tensor
    /// data read.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        refuse_quantized(path)?;
        match weights_layout(path)? {
            WeightsLayout::Single(file) => Ok(WeightFiles::single(SafetensorsFile::open(&file)?)),
            WeightsLayout::Sharded(index) => WeightFiles::sharded(&index),
        }
    }

    pub(crate) fn single(file: SafetensorsFile) -> Self {
        let index = file.tensors.keys().map(|n| (n.clone(), 0)).collect();
        WeightFiles {
            files: vec![file],
            index,
            index_path: None,
        }
    }

    fn sharded(index_path: &Path) -> Result<Self, ModelError> {
        let bad = |message: String| ModelError::BadSafetensors {
            path: index_path.to_path_buf(),
            message,
        };
        let text =
            std::fs::read_to_string(index_path).map_err(|e| ModelError::io(index_path, e))?;
        let json: Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let map = json
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| bad("has no `weight_map` object (tensor name -> file)".into()))?;
        let dir = index_path.parent().unwrap_or(Path::new("."));
        let mut shard_of: BTreeMap<&str, usize> = BTreeMap::new();
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for (name, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| bad(format!("`weight_map` entry `{name}` is not a file name")))?;
            if Path::new(file).components().count() != 1 {
                return Err(bad(format!(
                    "`weight_map` entry `{name}` names {file}, which is not a file beside \
                     the index"
                )));
            }
            let next = files.len();
            let at = *shard_of.entry(file).or_insert(next);
            if at == next {
                files.push(SafetensorsFile::open(&dir.join(file))?);
            }
            if !files[at].tensors.contains_key(name) {
                return Err(bad(format!(
                    "`weight_map` puts `{name}` in {file}, which does not hold it"
                )));
            }
            index.insert(name.clone(), at);
        }
        Ok(WeightFiles {
            files,
            index,
            index_path: Some(index_path.to_path_buf()),
        })
    }

    /// Every tensor's name, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.index.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// The files mapped (one, or each shard).
    pub fn file_count(&self) -> usize {
        self.files.len()
    }

    /// Tensor `name` as it is stored: its file, header entry and checked bytes.
    fn raw(
        &self,
        name: &str,
        shape: Option<&[usize]>,
    ) -> Option<Result<(FileDtype, &[u8]), ModelError>> {
        let file = &self.files[*self.index.get(name)?];
        Some(file.checked(name, &file.tensors[name], shape))
    }

    /// Tensor `name`, converted to f32, with its shape.
    pub fn read_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
        let missing = || ModelError::MissingTensor {
            path: self.where_(),
            name: name.to_string(),
        };
        let (dtype, bytes) = self.raw(name, None).ok_or_else(missing)??;
        let shape = self.files[self.index[name]].tensors[name].shape.clone();
        let mut out = vec![0.0; bytes.len() / dtype.size_bytes()];
        widen(dtype, bytes, &mut out);
        Ok((shape, out))
    }

    /// The file a message about a missing tensor names: the index, or the one file.
    fn where_(&self) -> PathBuf {
        self.index_path
            .clone()
            .unwrap_or_else(|| self.files[0].path.clone())
    }

    /// Finds tensor `name` under `prefix` (`{prefix}{family_prefix}{name}`, as
    /// `{prefix}transformer.{name}`, or `{prefix}{name}`) and checks it against `shape`;
    /// returns its dtype and bytes. Reads no tensor data.
    fn locate(
        &self,
        prefix: &str,
        family_prefix: &str,
        name: &str,
        shape: &[usize],
    ) -> Result<(FileDtype, &[u8]), ModelError> {
        let prefixed = format!("{prefix}{family_prefix}{name}");
        let bare = format!("{prefix}{name}");
        [prefixed.as_str(), bare.as_str()]
            .into_iter()
            .find_map(|n| self.raw(n, Some(shape)))
            .unwrap_or_else(|| {
                Err(ModelError::MissingTensor {
                    path: self.where_(),
                    name: prefixed.clone(),
                })
            })
    }

    /// Every parameter of `model`: one f32 buffer per block, with a warning naming the
    /// tensors of the files the model does not use.
    fn read_params(&self, model: &Model) -> Result<Vec<Vec<f32>>, ModelError> {
        self.check_params(model)?;
        self.read_checked_blocks(model, "", true)
    }

    /// [`Self::check_blocks`] for the parameters, with a warning naming the tensors of
    /// the files the model does not use.
    fn check_params(&self, model: &Model) -> Result<(), ModelError> {
        self.check_blocks(model, "")?;
        let family = model.family();
        let expected: std::collections::HashSet<String> = model
            .blocks()
            .iter()
            .enumerate()
            .flat_map(|(b, block)| {
                block.tensors.iter().flat_map(move |t| {
                    [t.name.clone(), format!("{}{}", family.hf_prefix(b), t.name)]
                })
            })
            .collect();
        let mut extra: Vec<&str> = self
            .index
            .keys()
            .map(String::as_str)
            .filter(|n| !family.hf_ignored(n) && !expected.contains(*n))
            .collect();
        if !extra.is_empty() {
            extra.sort();
            log::warn!(
                "{}: ignoring {} tensors {} does not use: {}",
                self.where_().display(),
                extra.len(),
                family.name(),
                extra.join(", ")
            );
        }
        Ok(())
    }

    /// Every block's tensors under `prefix`, widened to f32, once [`Self::check_blocks`]
    /// has found every one of them (with `finite`, refusing NaN and infinities).
    fn read_checked_blocks(
        &self,
        model: &Model,
        prefix: &str,
        finite: bool,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        (0..model.blocks().len())
            .map(|b| self.read_checked_block(model, prefix, b, finite))
            .collect()
    }

    /// Finds every tensor of `model` under `prefix` with its shape, reading no data: a
    /// config.json that disagrees with the weights is an error naming the tensor, before
    /// anything of the size the config claims is allocated.
    fn check_blocks(&self, model: &Model, prefix: &str) -> Result<(), ModelError> {
        let family = model.family();
        for (b, block) in model.blocks().iter().enumerate() {
            for t in block
                .tensors
                .iter()
                .filter(|t| in_base_files(model, block, t))
            {
                self.locate(prefix, family.hf_prefix(b), &t.name, &t.shape)?;
            }
        }
        Ok(())
    }

    /// Block `b`'s tensors under `prefix`, widened to f32, once [`Self::check_blocks`]
    /// has found every one of them; with `finite`, an error naming the tensor and its
    /// file when one holds a NaN or an infinity (training from a model's weights that do
    /// would give a NaN loss at step 1; a checkpoint's bytes are verified by its manifest
    /// instead). Each value is looked at once, as it is widened: no second read.
    fn read_checked_block(
        &self,
        model: &Model,
        prefix: &str,
        b: usize,
        finite: bool,
    ) -> Result<Vec<f32>, ModelError> {
        let (family, block) = (model.family(), &model.blocks()[b]);
        let mut buffer = vec![0f32; block.len];
        for t in block
            .tensors
            .iter()
            .filter(|t| in_base_files(model, block, t))
        {
            let (dtype, bytes) = self
                .locate(prefix, family.hf_prefix(b), &t.name, &t.shape)
                .expect("check_blocks found every tensor of the model");
            let values = &mut buffer[t.slot.range()];
            widen(dtype, bytes, values);
            self.release(bytes);
            if let Some(first) = values.iter().position(|v| finite && !v.is_finite()) {
                let names = [
                    format!("{prefix}{}{}", family.hf_prefix(b), t.name),
                    format!("{prefix}{}", t.name),
                ];
                return Err(self.not_finite(&names, values, first));
            }
        }
        Ok(buffer)
    }

    /// Hands the pages of `bytes`, a tensor's bytes in one of the files, back to the
    /// kernel once widened: reading a block at a time then holds one block of the file,
    /// not every block read so far.
    fn release(&self, bytes: &[u8]) {
        for file in &self.files {
            mapped::release(&file.map, bytes);
        }
    }

    /// The error of a tensor (stored under one of `names`) whose `values` are not all
    /// finite, `first` being the first that is not.
    fn not_finite(&self, names: &[String; 2], values: &[f32], first: usize) -> ModelError {
        let (name, file) = names
            .iter()
            .find_map(|n| Some((n, &self.files[*self.index.get(n)?].path)))
            .expect("the tensor was located under one of its names");
        let count = values.iter().filter(|v| !v.is_finite()).count();
        ModelError::BadInput(format!(
            "{}: tensor `{name}` holds {count} non-finite values of {} (the first, {}, at \
             element {first}); training from it gives a NaN loss at step 1: load the model \
             from an intact copy of its weights",
            file.display(),
            values.len(),
            values[first]
        ))
    }

    /// The folder's description: the dtype holding most of `model`'s parameters, the
    /// largest shard, the configuration as read.
    fn describe(&self, model: &Model, config_path: &Path) -> Result<Pretrained, ModelError> {
        let family = model.family();
        let mut elements: HashMap<FileDtype, usize> = HashMap::new();
        for (b, block) in model.blocks().iter().enumerate() {
            for t in block
                .tensors
                .iter()
                .filter(|t| in_base_files(model, block, t))
            {
                let (dtype, _) = self.locate("", family.hf_prefix(b), &t.name, &t.shape)?;
                *elements.entry(dtype).or_default() += t.shape.iter().product::<usize>();
            }
        }
        let dtype = [FileDtype::F32, FileDtype::Bf16, FileDtype::F16]
            .into_iter()
            .max_by_key(|d| elements.get(d).copied().unwrap_or(0))
            .expect("three candidates");
        let shard_bytes = self.index_path.as_ref().map(|_| {
            self.files
                .iter()
                .map(|f| f.data().len() as u64)
                .max()
                .unwrap_or(0)
        });
        Ok(Pretrained {
            dir: config_path.parent().unwrap_or(Path::new(".")).to_path_buf(),
            config: read_config_json(config_path)?,
            dtype,
            shard_bytes,
        })
    }
}

/// Reads every parameter of `model` from the weights at `path` (a safetensors file, an
/// index, or a folder): one f32 buffer per block, in block order.
pub fn load_safetensors(model: &Model, path: &Path) -> Result<Vec<Vec<f32>>, ModelError> {
    WeightFiles::open(path)?.read_params(model)
}

/// One tensor to write, converted from f32 to the file's type when written.
pub(crate) struct F32View<'a> {
    pub(crate) shape: Vec<usize>,
    pub(crate) data: &'a [f32],
    pub(crate) dtype: FileDtype,
}

impl safetensors::View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype.safetensors()
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        let mut bytes = Vec::with_capacity(self.data_len());
        self.dtype.encode(self.data, &mut bytes);
        bytes.into()
    }
    fn data_len(&self) -> usize {
        self.data.len() * self.dtype.size_bytes()
    }
}

/// How [`save_pretrained_with`] writes a model.
#[derive(Debug, Clone, Copy)]
pub struct SaveOptions<'a> {
    /// The type of the tensors written.
    pub dtype: FileDtype,
    /// The most tensor bytes per file; a larger model is written as shards with an
    /// index (a tensor larger than this gets a shard of its own).
    pub max_shard_bytes: u64,
    /// The folder the model was read from: its `config.json` is kept (but for the
    /// dtype entry) and its [`CARRIED_FILES`] are copied.
    pub base: Option<&'a Pretrained>,
}

impl Default for SaveOptions<'_> {
    /// f32, one file up to transformers' default shard size, the family's
    /// `config.json`.
    fn default() -> Self {
        SaveOptions {
            dtype: FileDtype::F32,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            base: None,
        }
    }
}

/// Writes `dir/model.safetensors` and `dir/config.json` for `model` with `params` (one
/// f32 buffer per block), in f32, creating `dir`. Each file is written under a temporary
/// name and renamed into place, so an interrupted save leaves no half-written file under
/// the real name.
pub fn save_pretrained(model: &Model, params: &[Vec<f32>], dir: &Path) -> Result<(), ModelError> {
    save_pretrained_with(model, params, dir, &SaveOptions::default())
}

/// Writes `model` with `params` into `dir` as `options` say: the weights in its dtype,
/// one file or shards `model-0000i-of-0000n.safetensors` with
/// `model.safetensors.index.json` (`metadata.total_size`, `weight_map`) as transformers
/// writes them; `config.json` (the base folder's, or the family's) with `torch_dtype`
/// set to the dtype written; the base folder's carried files. Weight files of the other
/// layout left in `dir` by an earlier save are removed once the new ones are in place.
pub fn save_pretrained_with(
    model: &Model,
    params: &[Vec<f32>],
    dir: &Path,
    options: &SaveOptions<'_>,
) -> Result<(), ModelError> {
    let mut views = block_views(model, params, "")?;
    for (_, view) in &mut views {
        view.dtype = options.dtype;
    }
    save_views(model, views, dir, options, &|| None)
}

/// As [`save_pretrained_with`], each block's f32 parameters being `read(block)`, called
/// as the writer reaches the block's tensors and dropped after them: saving holds one
/// block's parameters, not the model's (the writer goes by tensor name, so a block whose
/// tensors' names are not adjacent is read again). If a read fails, the file being
/// written is not moved into place and the error is returned (the shards of a sharded
/// model written before it stay, as when a write fails).
pub fn save_pretrained_blocks(
    model: &Model,
    read: &dyn Fn(usize) -> Result<Vec<f32>, ModelError>,
    dir: &Path,
    options: &SaveOptions<'_>,
) -> Result<(), ModelError> {
    let reader = BlockReader {
        read,
        model,
        last: RefCell::new(None),
        error: RefCell::new(None),
    };
    let family = model.family();
    let views: Vec<(String, LazyView<'_>)> = model
        .blocks()
        .iter()
        .enumerate()
        .flat_map(|(b, block)| {
            let reader = &reader;
            block.tensors.iter().map(move |t| {
                let view = LazyView {
                    shape: t.shape.clone(),
                    dtype: options.dtype,
                    block: b,
                    range: t.slot.range(),
                    reader,
                };
                (format!("{}{}", family.hf_prefix(b), t.name), view)
            })
        })
        .collect();
    save_views(model, views, dir, options, &|| {
        reader.error.borrow_mut().take()
    })
}

/// Writes `views` as `model`'s weights in `dir` (one file, or shards and their index),
/// then its `config.json` and the carried files. `failed` is asked after each file is
/// written and before it is moved into place: an error there stops the save.
fn save_views<V: safetensors::View>(
    model: &Model,
    views: Vec<(String, V)>,
    dir: &Path,
    options: &SaveOptions<'_>,
    failed: &dyn Fn() -> Option<ModelError>,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let shards = split_shards(&views, options.max_shard_bytes.max(1));
    let mut written: Vec<String> = Vec::new();
    if shards.len() == 1 {
        write_safetensors_checked(views, &dir.join(WEIGHTS_FILE), failed)?;
        written.push(WEIGHTS_FILE.to_string());
    } else {
        let count = shards.len();
        let total_size: usize = views.iter().map(|(_, v)| v.data_len()).sum();
        let total_parameters: usize = views
            .iter()
            .map(|(_, v)| v.shape().iter().product::<usize>())
            .sum();
        let mut weight_map = BTreeMap::new();
        let mut views = views.into_iter();
        for (i, len) in shards.into_iter().enumerate() {
            let file = format!("model-{:05}-of-{count:05}.safetensors", i + 1);
            let shard: Vec<_> = views.by_ref().take(len).collect();
            for (name, _) in &shard {
                weight_map.insert(name.clone(), Value::String(file.clone()));
            }
            write_safetensors_checked(shard, &dir.join(&file), failed)?;
            written.push(file);
        }
        let index = serde_json::json!({
            "metadata": {"total_parameters": total_parameters, "total_size": total_size},
            "weight_map": weight_map,
        });
        write_synced(&dir.join(INDEX_FILE), &json_text(&index))?;
        written.push(INDEX_FILE.to_string());
    }
    remove_stale_weights(dir, &written)?;
    let config = match options.base {
        Some(base) => base.config.clone(),
        None => model.family().hf_config(),
    };
    let config = with_dtype(config, options.dtype);
    write_synced(&dir.join(CONFIG_FILE), &json_text(&config))?;
    if let Some(base) = options.base {
        carry_files(&base.dir, dir)?;
    }
    Ok(())
}

/// Pretty JSON with a final line feed, as transformers writes its files.
fn json_text(value: &Value) -> Vec<u8> {
    let mut text = serde_json::to_vec_pretty(value).expect("JSON of a JSON value");
    text.push(b'\n');
    text
}

/// How many of `views`, in order, go in each shard: a new shard starts when the next
/// tensor would take the current one past `max_bytes` (transformers' rule).
fn split_shards<V: safetensors::View>(views: &[(String, V)], max_bytes: u64) -> Vec<usize> {
    let mut shards = vec![0usize];
    let mut bytes = 0u64;
    for (_, view) in views {
        let len = view.data_len() as u64;
        let last = shards.last_mut().expect("one shard at least");
        if *last > 0 && bytes + len > max_bytes {
            shards.push(1);
            bytes = len;
        } else {
            *last += 1;
            bytes += len;
        }
    }
    shards
}

/// `config` with its dtype entry set to `dtype`: transformers 5's `dtype` and the older
/// `torch_dtype`, whichever the file has (`torch_dtype` when it has neither), so that
/// nothing else of the file changes.
pub fn with_dtype(mut config: Value, dtype: FileDtype) -> Value {
    if let Some(map) = config.as_object_mut() {
        let mut keys: Vec<&str> = ["dtype", "torch_dtype"]
            .into_iter()
            .filter(|k| map.contains_key(*k))
            .collect();
        if keys.is_empty() {
            keys.push("torch_dtype");
        }
        for key in keys {
            map.insert(key.into(), dtype.torch_name().into());
        }
    }
    config
}

/// The dtype `config.json` says its weights are in (`dtype`, else `torch_dtype`).
pub fn config_dtype(config: &Value) -> Option<&str> {
    config
        .get("dtype")
        .or_else(|| config.get("torch_dtype"))
        .and_then(Value::as_str)
}

/// Removes from `dir` the weight files of a model saved there before that are not among
/// `written` (a single file after a sharded save, shards and their index after a single
/// one), so that transformers does not pick up the older weights.
fn remove_stale_weights(dir: &Path, written: &[String]) -> Result<(), ModelError> {
    let entries = std::fs::read_dir(dir).map_err(|e| ModelError::io(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| ModelError::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().to_string();
        let weights = name == WEIGHTS_FILE
            || name == INDEX_FILE
            || (name.starts_with("model-") && name.ends_with(".safetensors"));
        if weights && !written.contains(&name) {
            std::fs::remove_file(entry.path()).map_err(|e| ModelError::io(entry.path(), e))?;
        }
    }
    Ok(())
}

/// Copies the [`CARRIED_FILES`] that `from` holds into `to` (unless they are one folder).
fn carry_files(from: &Path, to: &Path) -> Result<(), ModelError> {
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same(from, to) {
        return Ok(());
    }
    for name in CARRIED_FILES {
        let source = from.join(name);
        if source.is_file() {
            let bytes = std::fs::read(&source).map_err(|e| ModelError::io(&source, e))?;
            write_synced(&to.join(name), &bytes)?;
        }
    }
    Ok(())
}

/// The tensors of `buffers` (one f32 buffer per block of `model`) named as a Hugging Face
/// file names them, after `prefix`: `{prefix}transformer.h.0.ln_1.weight`. Checks that
/// the buffers fit the layout.
pub(crate) fn block_views<'a>(
    model: &Model,
    buffers: &'a [Vec<f32>],
    prefix: &str,
) -> Result<Vec<(String, F32View<'a>)>, ModelError> {
    let what = match prefix.trim_end_matches('.') {
        "" => "parameter",
        other => other,
    };
    if buffers.len() != model.blocks().len() {
        return Err(ModelError::BadInput(format!(
            "{} {what} buffers given for {} blocks",
            buffers.len(),
            model.blocks().len()
        )));
    }
    let mut views = Vec::new();
    for (b, (block, buffer)) in model.blocks().iter().zip(buffers).enumerate() {
        if buffer.len() != block.len {
            return Err(ModelError::BadInput(format!(
                "block {:?}'s {what} buffer has {} elements, its layout {}",
                block.kind,
                buffer.len(),
                block.len
            )));
        }
        for t in &block.tensors {
            let view = F32View {
                shape: t.shape.clone(),
                data: &buffer[t.slot.range()],
                dtype: FileDtype::F32,
            };
            let family_prefix = model.family().hf_prefix(b);
            views.push((format!("{prefix}{family_prefix}{}", t.name), view));
        }
    }
    Ok(views)
}

/// The path `path` is written under before it is renamed into place.
fn partial_path(path: &Path) -> PathBuf {
    let mut partial = path.as_os_str().to_owned();
    partial.push(".partial");
    PathBuf::from(partial)
}

/// Writes `views` to the safetensors file `path`: under a temporary name, flushed to the
/// device, then renamed into place; `failed` is asked once the file is written: on an
/// error the partial file is removed and nothing is moved into place.
fn write_safetensors_checked<V: safetensors::View>(
    views: Vec<(String, V)>,
    path: &Path,
    failed: &dyn Fn() -> Option<ModelError>,
) -> Result<(), ModelError> {
    let partial = partial_path(path);
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), &partial).map_err(|e| match e {
        // A full disk or a refused write: the operating system's error, not a format's.
        safetensors::SafeTensorError::IoError(source) => ModelError::io(&partial, source),
        e => ModelError::BadSafetensors {
            path: partial.clone(),
            message: format!("could not write: {e}"),
        },
    })?;
    if let Some(e) = failed() {
        let _ = std::fs::remove_file(&partial);
        return Err(e);
    }
    sync(&partial)?;
    std::fs::rename(&partial, path).map_err(|e| ModelError::io(path, e))
}

/// One block's parameters at a time for [`save_pretrained_blocks`]: the last block
/// read, kept while the writer takes its tensors, and the first error.
struct BlockReader<'a> {
    read: &'a dyn Fn(usize) -> Result<Vec<f32>, ModelError>,
    model: &'a Model,
    last: RefCell<Option<(usize, Vec<f32>)>>,
    error: RefCell<Option<ModelError>>,
}

impl BlockReader<'_> {
    /// `f` of block `b`'s parameters, reading them unless they are the last read;
    /// `None` once a read has failed (the error is kept for the writer's caller).
    fn with<R>(&self, b: usize, f: impl FnOnce(&[f32]) -> R) -> Option<R> {
        if self.error.borrow().is_some() {
            return None;
        }
        let mut last = self.last.borrow_mut();
        if last.as_ref().is_none_or(|(at, _)| *at != b) {
            // The previous block is dropped before the next is read.
            *last = None;
            let len = self.model.blocks()[b].len;
            match (self.read)(b) {
                Ok(params) if params.len() == len => *last = Some((b, params)),
                Ok(params) => {
                    *self.error.borrow_mut() = Some(ModelError::BadInput(format!(
                        "block {b}'s parameters have {} values, not the model's {len}",
                        params.len()
                    )));
                    return None;
                }
                Err(e) => {
                    *self.error.borrow_mut() = Some(e);
                    return None;
                }
            }
        }
        last.as_ref().map(|(_, params)| f(params))
    }
}

/// A tensor of one block whose bytes are made when the writer asks for them, from
/// [`BlockReader`] (zeros after a failed read, whose error stops the save).
struct LazyView<'a> {
    shape: Vec<usize>,
    dtype: FileDtype,
    block: usize,
    range: std::ops::Range<usize>,
    reader: &'a BlockReader<'a>,
}

impl safetensors::View for LazyView<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype.safetensors()
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        let mut bytes = Vec::with_capacity(self.data_len());
        self.reader.with(self.block, |params| {
            self.dtype.encode(&params[self.range.clone()], &mut bytes);
        });
        bytes.resize(self.data_len(), 0);
        bytes.into()
    }
    fn data_len(&self) -> usize {
        self.range.len() * self.dtype.size_bytes()
    }
}

/// Writes `bytes` to `path` through a temporary name, flushed before the rename.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    let partial = partial_path(path);
    std::fs::write(&partial, bytes).map_err(|e| ModelError::io(&partial, e))?;
    sync(&partial)?;
    std::fs::rename(&partial, path).map_err(|e| ModelError::io(path, e))
}

/// Flushes a written file to its device, so a rename cannot expose a file whose data is
/// still only in the page cache.
fn sync(path: &Path) -> Result<(), ModelError> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| ModelError::io(path, e))
}
