//! A LoRA adapter's settings ([`LoraConfig`]) and peft's `adapter_config.json`: read
//! (refusing each peft feature strata does not apply, by name) and written with every
//! key peft 0.21 writes. Which layers the target names select is `targets.rs`'s.

use std::path::Path;

use serde_json::{Map, Value, json};

use crate::model::ModelError;

/// The adapter's settings file in a peft adapter folder.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// The peft version whose `adapter_config.json` this module writes (the golden data's).
pub const PEFT_FORMAT_VERSION: &str = "0.21.2";
/// The `target_modules` string peft expands to every linear layer but the output head.
pub const ALL_LINEAR: &str = "all-linear";

/// peft keys that switch on a feature strata does not apply: an adapter setting any of
/// them to something other than null, false, 0, "" or an empty list or map is refused,
/// with the feature's name.
const UNSUPPORTED: [(&str, &str); 15] = [
    ("use_dora", "DoRA (weight-decomposed LoRA)"),
    ("lora_bias", "LoRA biases on lora_B"),
    (
        "modules_to_save",
        "fully trained extra modules (modules_to_save)",
    ),
    ("rank_pattern", "per-layer ranks (rank_pattern)"),
    ("alpha_pattern", "per-layer alphas (alpha_pattern)"),
    (
        "layers_to_transform",
        "adapting only some layers (layers_to_transform)",
    ),
    ("exclude_modules", "excluded modules (exclude_modules)"),
    (
        "target_parameters",
        "adapted parameters (target_parameters)",
    ),
    ("layer_replication", "layer replication"),
    ("trainable_token_indices", "trainable token embeddings"),
    ("use_qalora", "QA-LoRA pooling"),
    ("alora_invocation_tokens", "activated LoRA (aLoRA)"),
    ("arrow_config", "Arrow routing"),
    ("megatron_config", "Megatron parallel layers"),
    ("use_bdlora", "block-diagonal LoRA"),
];

/// How a LoRA adapter changes its layers: each selected linear layer `W` computes
/// `W x + scale · B (A x)`, `A` being `rank × in` and `B` `out × rank`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// `r`: the rank of each update.
    pub rank: usize,
    /// `lora_alpha`.
    pub alpha: f64,
    /// `lora_dropout`: the probability that an element of the adapter's input is
    /// dropped in training (no effect on a merge).
    pub dropout: f64,
    /// `target_modules`: the Hugging Face module names selected (peft matches a name
    /// against the end of each module's path), or [`ALL_LINEAR`] alone.
    pub targets: Vec<String>,
    /// `use_rslora`: the scale is `alpha / sqrt(rank)` rather than `alpha / rank`.
    pub rslora: bool,
}

impl LoraConfig {
    /// An adapter of `rank` with `alpha` and `dropout` on `targets`, checked.
    pub fn new(
        rank: usize,
        alpha: f64,
        dropout: f64,
        targets: Vec<String>,
    ) -> Result<Self, ModelError> {
        let config = LoraConfig {
            rank,
            alpha,
            dropout,
            targets,
            rslora: false,
        };
        config.check().map_err(ModelError::InvalidConfig)?;
        Ok(config)
    }

    /// The factor on `B A`: peft's `scaling`, `alpha / rank`, or `alpha / sqrt(rank)`
    /// with rsLoRA.
    pub fn scale(&self) -> f64 {
        if self.rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    fn check(&self) -> Result<(), String> {
        if self.rank == 0 {
            return Err("the LoRA rank must be at least 1".into());
        }
        if !self.alpha.is_finite() {
            return Err(format!("the LoRA alpha must be finite, not {}", self.alpha));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!(
                "the LoRA dropout must be in [0, 1), not {}",
                self.dropout
            ));
        }
        if self.targets.is_empty() || self.targets.iter().any(String::is_empty) {
            return Err(format!(
                "the LoRA targets must be module names such as q_proj,v_proj, not {:?}",
                self.targets
            ));
        }
        Ok(())
    }

    /// Reads `adapter_config.json` at `path`.
    pub fn read(path: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        let json: Value = serde_json::from_str(&text).map_err(|e| unsupported(path, e))?;
        Self::from_json(&json).map_err(|message| unsupported(path, message))
    }

    /// The settings of a parsed `adapter_config.json`, or what is wrong with it.
    pub fn from_json(json: &Value) -> Result<Self, String> {
        let map = json
            .as_object()
            .ok_or("is not a JSON object of peft's adapter settings")?;
        match map.get("peft_type").and_then(Value::as_str) {
            Some("LORA") => {}
            other => {
                return Err(format!(
                    "peft_type is {other:?}; strata reads LORA adapters"
                ));
            }
        }
        refuse_unsupported(map)?;
        let config = LoraConfig {
            rank: rank_of(map)?,
            alpha: number(map, "lora_alpha", 8.0)?,
            dropout: number(map, "lora_dropout", 0.0)?,
            targets: targets_of(map)?,
            rslora: map.get("use_rslora").and_then(Value::as_bool) == Some(true),
        };
        config.check()?;
        Ok(config)
    }

    /// The `adapter_config.json` peft writes for this adapter of a base model named
    /// `base_model` (a folder or a Hub id), with every key peft 0.21 writes, at its
    /// default where strata has no setting; `fan_in_fan_out` is true for a base whose
    /// linear weights are stored (in, out), as GPT-2's Conv1D.
    pub fn to_json(&self, base_model: &str, fan_in_fan_out: bool) -> Value {
        let targets = match self.targets.as_slice() {
            [one] if one == ALL_LINEAR => json!(ALL_LINEAR),
            targets => json!(targets),
        };
        let mut map = peft_defaults();
        let ours = json!({
            "base_model_name_or_path": base_model,
            "fan_in_fan_out": fan_in_fan_out,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "r": self.rank,
            "target_modules": targets,
            "use_rslora": self.rslora,
        });
        for (key, value) in ours.as_object().expect("an object") {
            map.insert(key.clone(), value.clone());
        }
        Value::Object(map)
    }
}

/// peft 0.21's `LoraConfig` as it writes it for a plain LoRA adapter for causal
/// language modelling, in inference mode.
fn peft_defaults() -> Map<String, Value> {
    let defaults = json!({
        "alora_invocation_tokens": null, "alpha_pattern": {}, "arrow_config": null,
        "auto_mapping": null, "base_model_name_or_path": null, "bias": "none",
        "corda_config": null, "ensure_weight_tying": false, "eva_config": null,
        "exclude_modules": null, "fan_in_fan_out": false, "inference_mode": true,
        "init_lora_weights": true, "kasa_config": null, "layer_replication": null,
        "layers_pattern": null, "layers_to_transform": null, "loftq_config": {},
        "lora_alpha": 8.0, "lora_bias": false, "lora_dropout": 0.0, "lora_ga_config": null,
        "megatron_config": null, "megatron_core": "megatron.core", "modules_to_save": null,
        "monteclora_config": null, "peft_type": "LORA", "peft_version": PEFT_FORMAT_VERSION,
        "qalora_group_size": 16, "r": 8, "rank_pattern": {}, "revision": null,
        "target_modules": null, "target_parameters": null, "task_type": "CAUSAL_LM",
        "trainable_token_indices": null, "use_bdlora": null, "use_dora": false,
        "use_qalora": false, "use_rslora": false, "velora_config": null,
    });
    match defaults {
        Value::Object(map) => map,
        _ => unreachable!("a JSON object literal"),
    }
}

fn unsupported(path: &Path, message: impl std::fmt::Display) -> ModelError {
    ModelError::UnsupportedConfig {
        path: path.to_path_buf(),
        message: message.to_string(),
    }
}

/// Whether `value` leaves a feature off: null, false, 0, "" or empty.
fn is_unset(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
    }
}

/// Refuses the first feature of [`UNSUPPORTED`] the settings switch on, an
/// initialisation that changed the base's weights, a `bias` other than "none" and a
/// `task_type` other than causal language modelling.
fn refuse_unsupported(map: &Map<String, Value>) -> Result<(), String> {
    for (key, feature) in UNSUPPORTED {
        if let Some(value) = map.get(key).filter(|v| !is_unset(v)) {
            return Err(format!(
                "{key} is {value}: strata does not apply {feature}; train or save the \
                 adapter without it"
            ));
        }
    }
    if let Some(init) = map.get("init_lora_weights").and_then(Value::as_str) {
        let lower = init.to_lowercase();
        if ["pissa", "olora", "corda", "lora_ga", "loftq"]
            .iter()
            .any(|m| lower.starts_with(m))
        {
            return Err(format!(
                "init_lora_weights is {init:?}: such an adapter belongs to a base whose \
                 weights its initialisation changed, not to the base named; save it with \
                 peft's path_initial_model_for_weight_conversion, which makes it an \
                 adapter of the original base"
            ));
        }
    }
    match map.get("bias") {
        None | Some(Value::Null) => {}
        Some(Value::String(b)) if b == "none" => {}
        Some(other) => {
            return Err(format!(
                "bias is {other}: strata applies LoRA without trained biases (bias \"none\")"
            ));
        }
    }
    match map.get("task_type") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(t)) if t == "CAUSAL_LM" => Ok(()),
        Some(other) => Err(format!(
            "task_type is {other}: strata reads adapters of causal language models \
             (CAUSAL_LM)"
        )),
    }
}

fn rank_of(map: &Map<String, Value>) -> Result<usize, String> {
    let r = map.get("r").ok_or("has no rank `r`")?;
    r.as_u64()
        .and_then(|r| usize::try_from(r).ok())
        .ok_or_else(|| format!("`r` is {r}, not a whole number"))
}

fn number(map: &Map<String, Value>, key: &str, default: f64) -> Result<f64, String> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_f64()
            .ok_or_else(|| format!("`{key}` is {v}, not a number")),
    }
}

/// `target_modules`: a list of module names, or "all-linear"; peft's other strings are
/// regular expressions, which strata does not match.
fn targets_of(map: &Map<String, Value>) -> Result<Vec<String>, String> {
    match map.get("target_modules") {
        Some(Value::Array(names)) => names
            .iter()
            .map(|n| {
                n.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| format!("target_modules holds {n}, not a module name"))
            })
            .collect(),
        Some(Value::String(s)) if s == ALL_LINEAR => Ok(vec![ALL_LINEAR.to_string()]),
        Some(Value::String(s)) => Err(format!(
            "target_modules is the regular expression {s:?}; strata matches a list of \
             module names (as [\"q_proj\", \"v_proj\"]) or \"all-linear\": list the names"
        )),
        _ => Err("has no target_modules: list the adapted modules' names".into()),
    }
}
