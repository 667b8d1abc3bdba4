//! Hugging Face checkpoints: `config.json` and `model.safetensors`, read through a memory
//! map and written so that transformers' `from_pretrained` loads them.
//!
//! `config.json`'s `model_type` picks the family, which parses the rest. Reading accepts
//! tensor names with or without the family's prefix (GPT-2's `transformer.`), skips what
//! the family says is not a parameter (buffers, a tied head's copy), and converts F16 and
//! BF16 tensors to f32. The header is checked tensor by tensor before any data is read,
//! so a missing tensor, a wrong shape or a truncated file is an error naming the tensor.
//! Writing uses the prefixed names, f32, the family's layouts, and goes through a
//! temporary file renamed into place.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use safetensors::tensor::TensorInfo;
use serde_json::Value;

use super::{Gpt2, Llama, Model, ModelError, llama};

/// The weights file's name in a model folder.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The configuration file's name in a model folder.
pub const CONFIG_FILE: &str = "config.json";

/// The configuration and weights files of `path`: a model folder, or the weights file
/// itself with `config.json` beside it.
pub fn model_files(path: &Path) -> (PathBuf, PathBuf) {
    if path.is_dir() {
        (path.join(CONFIG_FILE), path.join(WEIGHTS_FILE))
    } else {
        let dir = path.parent().unwrap_or(Path::new("."));
        (dir.join(CONFIG_FILE), path.to_path_buf())
    }
}

/// Loads a model folder (or weights file): its shape from `config.json`, and one f32
/// buffer per block from `model.safetensors`.
pub fn load_pretrained(path: &Path) -> Result<(Model, Vec<Vec<f32>>), ModelError> {
    std::fs::metadata(path).map_err(|e| ModelError::io(path, e))?;
    let (config_path, weights_path) = model_files(path);
    let model = load_config(&config_path)?;
    let params = load_safetensors(&model, &weights_path)?;
    Ok((model, params))
}

/// Reads a `config.json` and returns the model it describes: the family its
/// `model_type` names (GPT-2 when it names none), of the shape the rest gives.
pub fn load_config(path: &Path) -> Result<Model, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    let unsupported = |message: String| ModelError::UnsupportedConfig {
        path: path.to_path_buf(),
        message,
    };
    let json: Value =
        serde_json::from_str(&text).map_err(|e| unsupported(format!("not valid JSON: {e}")))?;
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
        // SAFETY: the map is only read. If another process truncates or rewrites the
        // file while it is mapped, reads may fault or see the new bytes: the usual caveat
        // of reading a checkpoint through mmap, accepted for loading speed.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
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

    /// Finds tensor `name` under `prefix` (`{prefix}{family_prefix}{name}`, as
    /// `{prefix}transformer.{name}`, or `{prefix}{name}`) and checks its shape, dtype and byte range against `shape`;
    /// returns its dtype and bytes. Reads no tensor data.
    fn locate(
        &self,
        prefix: &str,
        family_prefix: &str,
        name: &str,
        shape: &[usize],
    ) -> Result<(Dtype, &[u8]), ModelError> {
        let prefixed = format!("{prefix}{family_prefix}{name}");
        let bare = format!("{prefix}{name}");
        let (found_name, info) = [prefixed.as_str(), bare.as_str()]
            .into_iter()
            .find_map(|n| self.tensors.get(n).map(|info| (n, info)))
            .ok_or_else(|| ModelError::MissingTensor {
                path: self.path.clone(),
                name: prefixed.clone(),
            })?;
        if info.shape != shape {
            return Err(ModelError::TensorShape {
                path: self.path.clone(),
                name: found_name.to_string(),
                expected: shape.to_vec(),
                found: info.shape.clone(),
            });
        }
        let width = match info.dtype {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            other => {
                return Err(ModelError::TensorDtype {
                    path: self.path.clone(),
                    name: found_name.to_string(),
                    found: other.to_string(),
                });
            }
        };
        let (start, end) = info.data_offsets;
        let data = self.data();
        if end > data.len() {
            return Err(ModelError::TensorTruncated {
                path: self.path.clone(),
                name: found_name.to_string(),
                end,
                available: data.len(),
            });
        }
        let elements = shape.iter().product::<usize>();
        if end < start || end - start != elements * width {
            return Err(ModelError::BadSafetensors {
                path: self.path.clone(),
                message: format!(
                    "tensor `{found_name}` has {} data bytes for {elements} elements of {}",
                    end.saturating_sub(start),
                    info.dtype
                ),
            });
        }
        Ok((info.dtype, &data[start..end]))
    }

    /// Reads tensor `name` under `prefix` into `out` (its shape's element count),
    /// widening to f32.
    fn read_into(
        &self,
        prefix: &str,
        family_prefix: &str,
        name: &str,
        shape: &[usize],
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        let (dtype, bytes) = self.locate(prefix, family_prefix, name, shape)?;
        assert_eq!(
            out.len() * if dtype == Dtype::F32 { 4 } else { 2 },
            bytes.len()
        );
        match dtype {
            Dtype::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes(b.try_into().expect("4 bytes"));
                }
            }
            Dtype::F16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::f16::from_le_bytes(b.try_into().expect("2 bytes")).to_f32();
                }
            }
            _ => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::bf16::from_le_bytes(b.try_into().expect("2 bytes")).to_f32();
                }
            }
        }
        Ok(())
    }
}

/// Reads every parameter of `model` from the safetensors file at `path`: one f32 buffer
/// per block, in block order.
pub fn load_safetensors(model: &Model, path: &Path) -> Result<Vec<Vec<f32>>, ModelError> {
    let file = SafetensorsFile::open(path)?;
    let params = read_blocks(&file, model, "")?;
    let family = model.family();
    let expected: std::collections::HashSet<String> = model
        .blocks()
        .iter()
        .enumerate()
        .flat_map(|(b, block)| {
            block
                .tensors
                .iter()
                .flat_map(move |t| [t.name.clone(), format!("{}{}", family.hf_prefix(b), t.name)])
        })
        .collect();
    let mut extra: Vec<&str> = file
        .tensors
        .keys()
        .map(String::as_str)
        .filter(|n| !family.hf_ignored(n) && !expected.contains(*n))
        .collect();
    if !extra.is_empty() {
        extra.sort();
        log::warn!(
            "{}: ignoring {} tensors {} does not use: {}",
            path.display(),
            extra.len(),
            family.name(),
            extra.join(", ")
        );
    }
    Ok(params)
}

/// Reads one f32 buffer per block of `model` from `file`, each tensor found under
/// `prefix` (`""` for the parameters; the optimizer's moments use their own).
pub(crate) fn read_blocks(
    file: &SafetensorsFile,
    model: &Model,
    prefix: &str,
) -> Result<Vec<Vec<f32>>, ModelError> {
    // Every tensor is checked against the model before anything is allocated: a
    // config.json that disagrees with the weights is an error naming the tensor, not an
    // allocation of the size the config claims.
    let family = model.family();
    for (b, block) in model.blocks().iter().enumerate() {
        for t in &block.tensors {
            file.locate(prefix, family.hf_prefix(b), &t.name, &t.shape)?;
        }
    }
    let mut buffers = model.zero_params();
    for (b, (block, buffer)) in model.blocks().iter().zip(&mut buffers).enumerate() {
        for t in &block.tensors {
            let out = &mut buffer[t.slot.range()];
            file.read_into(prefix, family.hf_prefix(b), &t.name, &t.shape, out)?;
        }
    }
    Ok(buffers)
}

/// One f32 tensor to write.
pub(crate) struct F32View<'a> {
    shape: Vec<usize>,
    data: &'a [f32],
}

impl safetensors::View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        self.data
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>()
            .into()
    }
    fn data_len(&self) -> usize {
        self.data.len() * 4
    }
}

/// Writes `dir/model.safetensors` and `dir/config.json` for `model` with `params` (one
/// f32 buffer per block), creating `dir`. Each file is written under a temporary name and
/// renamed into place, so an interrupted save leaves no half-written file under the real
/// name.
pub fn save_pretrained(model: &Model, params: &[Vec<f32>], dir: &Path) -> Result<(), ModelError> {
    let views = block_views(model, params, "")?;
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    write_safetensors(views, &dir.join(WEIGHTS_FILE))?;
    let config = dir.join(CONFIG_FILE);
    let partial = dir.join(format!("{CONFIG_FILE}.partial"));
    let text = serde_json::to_string_pretty(&model.family().hf_config()).expect("JSON");
    std::fs::write(&partial, text + "\n").map_err(|e| ModelError::io(&partial, e))?;
    sync(&partial)?;
    std::fs::rename(&partial, &config).map_err(|e| ModelError::io(&config, e))?;
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
            };
            let family_prefix = model.family().hf_prefix(b);
            views.push((format!("{prefix}{family_prefix}{}", t.name), view));
        }
    }
    Ok(views)
}

/// Writes `views` to the safetensors file `path`: under a temporary name, flushed to the
/// device, then renamed into place.
pub(crate) fn write_safetensors(
    views: Vec<(String, F32View<'_>)>,
    path: &Path,
) -> Result<(), ModelError> {
    let mut partial = path.as_os_str().to_owned();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), &partial).map_err(|e| {
        ModelError::BadSafetensors {
            path: partial.clone(),
            message: format!("could not write: {e}"),
        }
    })?;
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
