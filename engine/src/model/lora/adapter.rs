//! A LoRA adapter's weights ([`LoraAdapter`]: per selected layer, `A` and `B` in f32)
//! and peft's adapter folder: `adapter_config.json` beside `adapter_model.safetensors`,
//! whose tensors peft 0.21 names `base_model.model.{module}.lora_A.weight` (`rank × in`)
//! and `...lora_B.weight` (`out × rank`), without the adapter's name (`default`), which
//! peft inserts when it loads them.
//!
//! Reading converts F16 and BF16 tensors to f32 and checks that every selected layer
//! has both tensors, of the model's shapes, and that the file holds nothing else (a
//! tensor strata would not apply). Writing puts each file under a temporary name,
//! flushes it and renames it into place.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::model::weights::{F32View, FileDtype, WeightFiles};
use crate::model::{Model, ModelError};

use super::config::{ADAPTER_CONFIG_FILE, LoraConfig};
use super::select_layers;
use super::targets::{LoraLayer, WeightLayout};

/// The adapter's weights file in a peft adapter folder.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// What peft's names put before a module's path: `PeftModel.base_model.model`.
const PEFT_PREFIX: &str = "base_model.model.";

/// One adapted layer's update, in f32, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraWeights {
    /// The layer.
    pub layer: LoraLayer,
    /// `lora_A`: `rank × in_features`.
    pub a: Vec<f32>,
    /// `lora_B`: `out_features × rank`.
    pub b: Vec<f32>,
}

/// A LoRA adapter for one model: its settings and each selected layer's `A` and `B`,
/// in the order of [`select_layers`].
#[derive(Debug, Clone, PartialEq)]
pub struct LoraAdapter {
    /// The settings.
    pub config: LoraConfig,
    /// Each selected layer's weights.
    pub layers: Vec<LoraWeights>,
}

/// peft's names of `layer`'s `A` and `B` in `adapter_model.safetensors`.
pub fn peft_names(layer: &LoraLayer) -> [String; 2] {
    ["A", "B"].map(|m| format!("{PEFT_PREFIX}{}.lora_{m}.weight", layer.module))
}

impl LoraAdapter {
    /// The adapter of `config` on `model`, each selected layer's `(A, B)` given by
    /// `weights`; an error when a length is not the layer's.
    pub fn new(
        model: &Model,
        config: LoraConfig,
        mut weights: impl FnMut(&LoraLayer) -> (Vec<f32>, Vec<f32>),
    ) -> Result<Self, ModelError> {
        let layers = select_layers(model, &config)?
            .into_iter()
            .map(|layer| {
                let (a, b) = weights(&layer);
                LoraWeights { layer, a, b }
            })
            .collect();
        let adapter = LoraAdapter { config, layers };
        adapter.check_lengths()?;
        Ok(adapter)
    }

    /// `A`'s and `B`'s shapes for `layer` under this adapter's rank.
    fn shapes(&self, layer: &LoraLayer) -> [Vec<usize>; 2] {
        let r = self.config.rank;
        [vec![r, layer.in_features], vec![layer.out_features, r]]
    }

    fn check_lengths(&self) -> Result<(), ModelError> {
        for w in &self.layers {
            let names = peft_names(&w.layer);
            for ((name, shape), got) in names.iter().zip(self.shapes(&w.layer)).zip([&w.a, &w.b]) {
                let want: usize = shape.iter().product();
                if got.len() != want {
                    return Err(ModelError::BadInput(format!(
                        "LoRA tensor `{name}` holds {} values, but shape {shape:?} needs {want}",
                        got.len()
                    )));
                }
            }
        }
        Ok(())
    }

    /// Reads the peft adapter folder `dir` for `model`: its settings, then each selected
    /// layer's `A` and `B` as f32.
    pub fn read(dir: &Path, model: &Model) -> Result<Self, ModelError> {
        let config = LoraConfig::read(&dir.join(ADAPTER_CONFIG_FILE))?;
        let file = dir.join(ADAPTER_WEIGHTS_FILE);
        if !file.is_file() {
            return Err(ModelError::BadInput(missing_weights(dir)));
        }
        let files = WeightFiles::open(&file)?;
        let layers = select_layers(model, &config)?;
        let mut tensors = HashMap::new();
        for layer in &layers {
            let shapes = [
                vec![config.rank, layer.in_features],
                vec![layer.out_features, config.rank],
            ];
            for (name, shape) in peft_names(layer).into_iter().zip(shapes) {
                let values = read_tensor(&files, &file, &name, &shape, layer)?;
                tensors.insert(name, values);
            }
        }
        refuse_extra(&files, &file, &tensors)?;
        let layers = layers
            .into_iter()
            .map(|layer| {
                let [a, b] = peft_names(&layer).map(|n| tensors.remove(&n).expect("read above"));
                LoraWeights { layer, a, b }
            })
            .collect();
        Ok(LoraAdapter { config, layers })
    }

    /// Writes this adapter as a peft adapter folder `dir` (created if need be) that
    /// `PeftModel.from_pretrained` loads onto the base model `base_model` (its folder
    /// or Hub id, written as `base_model_name_or_path`), the tensors in `dtype`.
    pub fn write(&self, dir: &Path, base_model: &str, dtype: FileDtype) -> Result<(), ModelError> {
        self.check_lengths()?;
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        let mut views = Vec::with_capacity(2 * self.layers.len());
        for w in &self.layers {
            let [a, b] = self.shapes(&w.layer);
            let [name_a, name_b] = peft_names(&w.layer);
            views.push((
                name_a,
                F32View {
                    shape: a,
                    data: &w.a,
                    dtype,
                },
            ));
            views.push((
                name_b,
                F32View {
                    shape: b,
                    data: &w.b,
                    dtype,
                },
            ));
        }
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        let file = dir.join(ADAPTER_WEIGHTS_FILE);
        let bytes = safetensors::serialize(views, Some(metadata)).map_err(|e| {
            ModelError::BadSafetensors {
                path: file.clone(),
                message: format!("could not write: {e}"),
            }
        })?;
        replace_file(&file, &bytes)?;
        let conv1d = self
            .layers
            .first()
            .is_some_and(|w| w.layer.layout == WeightLayout::InOut);
        let config = self.config.to_json(base_model, conv1d);
        let mut text = serde_json::to_vec_pretty(&config).expect("JSON of a JSON value");
        text.push(b'\n');
        replace_file(&dir.join(ADAPTER_CONFIG_FILE), &text)
    }
}

/// Tensor `name` of the adapter `file`, of `shape`, as f32; errors say which layer
/// needs it and what to do.
fn read_tensor(
    files: &WeightFiles,
    file: &Path,
    name: &str,
    shape: &[usize],
    layer: &LoraLayer,
) -> Result<Vec<f32>, ModelError> {
    if !files.names().contains(&name) {
        return Err(ModelError::BadInput(format!(
            "{}: tensor `{name}` is missing, but the adapter's target_modules select \
             `{}`: save the adapter with peft's save_pretrained from a model whose \
             adapted layers include it, or remove the target",
            file.display(),
            layer.module
        )));
    }
    let (found, values) = files.read_f32(name)?;
    if found != shape {
        return Err(ModelError::BadInput(format!(
            "{}: tensor `{name}` has shape {found:?}, but `{}` ({} in, {} out) with the \
             adapter's rank needs {shape:?}: the adapter was made for another base model \
             or its adapter_config.json's `r` is wrong",
            file.display(),
            layer.module,
            layer.in_features,
            layer.out_features
        )));
    }
    Ok(values)
}

/// Refuses tensors of the adapter file that no selected layer reads: strata would not
/// apply them, so the merged model would not be the adapter's.
fn refuse_extra(
    files: &WeightFiles,
    file: &Path,
    read: &HashMap<String, Vec<f32>>,
) -> Result<(), ModelError> {
    let extra: Vec<&str> = files
        .names()
        .into_iter()
        .filter(|n| !read.contains_key(*n))
        .collect();
    let Some(first) = extra.first() else {
        return Ok(());
    };
    let hint = if first.contains(".default.") {
        "; names with the adapter's name (`lora_A.default.weight`) are what peft holds in \
         memory, not what it saves: save the adapter with peft's save_pretrained"
    } else {
        ": strata applies only lora_A and lora_B of the layers target_modules select"
    };
    Err(ModelError::BadInput(format!(
        "{}: holds {} tensors no selected layer reads, as `{first}`{hint}",
        file.display(),
        extra.len()
    )))
}

fn missing_weights(dir: &Path) -> String {
    let pickle = dir.join("adapter_model.bin");
    if pickle.is_file() {
        format!(
            "{}: holds adapter_model.bin (a pickle, which runs code when loaded) but no \
             {ADAPTER_WEIGHTS_FILE}; load it in peft and save it again with \
             save_pretrained(..., safe_serialization=True)",
            dir.display()
        )
    } else {
        format!(
            "{}: has no {ADAPTER_WEIGHTS_FILE}: give the folder peft's save_pretrained wrote",
            dir.display()
        )
    }
}

/// Writes `bytes` to `path` through a temporary name beside it, flushed to the device
/// before the rename, so that `path` is never a half-written file.
fn replace_file(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".partial");
    let temporary = PathBuf::from(temporary);
    let written = std::fs::File::create(&temporary).and_then(|mut f| {
        std::io::Write::write_all(&mut f, bytes)?;
        f.sync_all()
    });
    written.map_err(|e| ModelError::io(&temporary, e))?;
    std::fs::rename(&temporary, path).map_err(|e| ModelError::io(path, e))
}
