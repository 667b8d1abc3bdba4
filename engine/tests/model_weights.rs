//! Loading and saving Hugging Face GPT-2 checkpoints: a bit-exact round trip, the name
//! variants found on the Hub, 16-bit files, and clear errors naming the tensor.

mod model_support;

use std::collections::HashMap;
use std::path::Path;

use model_support::golden_dir;
use safetensors::{Dtype, View};
use strata_engine::model::weights::{
    load_config, load_pretrained, load_safetensors, save_pretrained,
};
use strata_engine::model::{Gpt2Config, Model, ModelError, gpt2};

/// A tensor to write into a test file.
struct Raw {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &Raw {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        (&self.bytes[..]).into()
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// The golden model's tensors under their names in the file.
fn golden_tensors() -> HashMap<String, Raw> {
    let bytes = std::fs::read(golden_dir().join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, v)| {
            let raw = Raw {
                dtype: v.dtype(),
                shape: v.shape().to_vec(),
                bytes: v.data().to_vec(),
            };
            (name, raw)
        })
        .collect()
}

fn write(dir: &Path, tensors: &HashMap<String, Raw>) -> std::path::PathBuf {
    std::fs::write(
        dir.join("config.json"),
        std::fs::read(golden_dir().join("config.json")).unwrap(),
    )
    .unwrap();
    let path = dir.join("model.safetensors");
    safetensors::serialize_to_file(tensors.iter().map(|(n, r)| (n.clone(), r)), None, &path)
        .unwrap();
    path
}

fn tiny() -> Model {
    Model::new(Gpt2Config::tiny()).unwrap()
}

#[test]
fn load_save_load_is_bit_exact_and_looks_like_save_pretrained() {
    let (model, params) = load_pretrained(&golden_dir()).unwrap();
    assert_eq!(model, Model::new(Gpt2Config::tiny()).unwrap());
    let dir = tempfile::tempdir().unwrap();
    save_pretrained(&model, &params, dir.path()).unwrap();
    let (again, reloaded) = load_pretrained(dir.path()).unwrap();
    assert_eq!(again, model);
    for (a, b) in params.iter().zip(&reloaded) {
        assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
    }
    // What transformers' from_pretrained expects: transformer.* names, f32, Conv1D (in,
    // out) shapes, no lm_head.weight, format "pt"; the same tensors as the golden file.
    let saved = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let (_, metadata) = safetensors::SafeTensors::read_metadata(&saved).unwrap();
    assert_eq!(metadata.metadata().as_ref().unwrap()["format"], "pt");
    let saved = safetensors::SafeTensors::deserialize(&saved).unwrap();
    let golden = golden_tensors();
    assert_eq!(saved.len(), golden.len());
    for (name, view) in saved.tensors() {
        let raw = &golden[&name];
        assert_eq!(
            (view.dtype(), view.shape()),
            (Dtype::F32, &raw.shape[..]),
            "{name}"
        );
        assert_eq!(view.data(), &raw.bytes[..], "{name}");
    }
    assert_eq!(
        load_config(&dir.path().join("config.json")).unwrap(),
        Model::new(Gpt2Config::tiny()).unwrap()
    );
    assert!(!dir.path().join("model.safetensors.partial").exists());
}

#[test]
fn hub_name_variants_and_buffers_are_accepted() {
    let (_, golden_params) = load_pretrained(&golden_dir()).unwrap();
    let mut tensors: HashMap<String, Raw> = golden_tensors()
        .into_iter()
        .map(|(n, r)| (n.strip_prefix(gpt2::PREFIX).unwrap().to_string(), r))
        .collect();
    // Older checkpoints carry the causal mask and a masked-bias constant per layer, and
    // some the tied head.
    for layer in 0..2 {
        let mask = Raw {
            dtype: Dtype::F32,
            shape: vec![1, 1, 32, 32],
            bytes: vec![0; 32 * 32 * 4],
        };
        tensors.insert(format!("h.{layer}.attn.bias"), mask);
        let masked = Raw {
            dtype: Dtype::F32,
            shape: vec![],
            bytes: vec![0; 4],
        };
        tensors.insert(format!("h.{layer}.attn.masked_bias"), masked);
    }
    let wte = &tensors["wte.weight"];
    let head = Raw {
        dtype: wte.dtype,
        shape: wte.shape.clone(),
        bytes: wte.bytes.clone(),
    };
    tensors.insert("lm_head.weight".into(), head);
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), &tensors);
    assert_eq!(load_safetensors(&tiny(), &path).unwrap(), golden_params);
}

#[test]
fn sixteen_bit_files_are_widened() {
    let (_, golden_params) = load_pretrained(&golden_dir()).unwrap();
    for dtype in [Dtype::BF16, Dtype::F16] {
        let tensors: HashMap<String, Raw> = golden_tensors()
            .into_iter()
            .map(|(n, r)| {
                let bytes = r
                    .bytes
                    .chunks_exact(4)
                    .flat_map(|b| {
                        let v = f32::from_le_bytes(b.try_into().unwrap());
                        match dtype {
                            Dtype::BF16 => half::bf16::from_f32(v).to_le_bytes(),
                            _ => half::f16::from_f32(v).to_le_bytes(),
                        }
                    })
                    .collect();
                (
                    n,
                    Raw {
                        dtype,
                        shape: r.shape,
                        bytes,
                    },
                )
            })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let params = load_safetensors(&tiny(), &write(dir.path(), &tensors)).unwrap();
        let tolerance = if dtype == Dtype::BF16 {
            1.0 / 128.0
        } else {
            1.0 / 1024.0
        };
        for (a, b) in params.iter().flatten().zip(golden_params.iter().flatten()) {
            assert!(
                (a - b).abs() <= tolerance * b.abs() + 1e-7,
                "{dtype}: {a} vs {b}"
            );
        }
    }
}

fn load_error(tensors: &HashMap<String, Raw>) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), tensors);
    load_safetensors(&tiny(), &path).unwrap_err().to_string()
}

#[test]
fn a_missing_tensor_is_named() {
    let mut tensors = golden_tensors();
    tensors.remove("transformer.h.1.mlp.c_fc.bias");
    let message = load_error(&tensors);
    assert!(
        message.contains("`transformer.h.1.mlp.c_fc.bias` is missing"),
        "{message}"
    );
}

#[test]
fn a_wrong_shape_is_named() {
    let mut tensors = golden_tensors();
    let t = tensors
        .get_mut("transformer.h.0.attn.c_attn.weight")
        .unwrap();
    t.shape = vec![96, 32]; // (out, in): a Linear layout rather than Conv1D's
    let message = load_error(&tensors);
    assert!(
        message.contains("`transformer.h.0.attn.c_attn.weight` has shape [96, 32]"),
        "{message}"
    );
    assert!(message.contains("[32, 96]"), "{message}");
}

#[test]
fn a_truncated_body_names_the_tensor_cut_off() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(golden_dir().join("model.safetensors")).unwrap();
    // The last tensor in the file (names are sorted) is transformer.wte.weight.
    let path = dir.path().join("model.safetensors");
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let err = load_safetensors(&tiny(), &path).unwrap_err();
    assert!(matches!(err, ModelError::TensorTruncated { .. }), "{err}");
    let message = err.to_string();
    assert!(
        message.contains("`transformer.wte.weight` is truncated"),
        "{message}"
    );
    // A file cut inside its header, and one too short for a header.
    std::fs::write(&path, &bytes[..100]).unwrap();
    let message = load_safetensors(&tiny(), &path).unwrap_err().to_string();
    assert!(message.contains("file too short"), "{message}");
    std::fs::write(&path, &bytes[..5]).unwrap();
    let message = load_safetensors(&tiny(), &path).unwrap_err().to_string();
    assert!(message.contains("file too short"), "{message}");
}

#[test]
fn bad_paths_and_configs_are_clear() {
    let message = load_pretrained(Path::new("/nonexistent/model"))
        .unwrap_err()
        .to_string();
    assert!(
        message.starts_with("/nonexistent/model: No such file"),
        "{message}"
    );
    let empty = tempfile::tempdir().unwrap();
    let message = load_pretrained(empty.path()).unwrap_err().to_string();
    assert!(message.contains("config.json: No such file"), "{message}");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.json");
    let mut json = gpt2::config_json(&Gpt2Config::tiny());
    json["activation_function"] = "relu".into();
    std::fs::write(&config, json.to_string()).unwrap();
    let message = load_config(&config).unwrap_err().to_string();
    assert!(message.contains("activation_function `relu`"), "{message}");
    let mut json = gpt2::config_json(&Gpt2Config::tiny());
    json["n_head"] = 3.into();
    std::fs::write(&config, json.to_string()).unwrap();
    let message = load_config(&config).unwrap_err().to_string();
    assert!(message.contains("not divisible by 3 heads"), "{message}");
}

#[test]
fn a_config_that_disagrees_with_the_weights_names_the_tensor_before_allocating() {
    // 320000 wide would ask for terabytes if buffers were allocated from the config
    // before the file's tensors were checked against it.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        golden_dir().join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    let config = std::fs::read_to_string(golden_dir().join("config.json")).unwrap();
    let config = config.replace("\"n_embd\": 32", "\"n_embd\": 320000");
    assert!(config.contains("320000"));
    std::fs::write(dir.path().join("config.json"), config).unwrap();
    match load_pretrained(dir.path()) {
        Err(ModelError::TensorShape { name, .. }) => assert!(
            name.ends_with("wte.weight") || name.contains(".h.0."),
            "{name}"
        ),
        other => panic!("expected a shape error, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn shapes_too_large_to_address_are_config_errors() {
    for config in [
        Gpt2Config::new(1, 1, 1 << 32, 1, 1),
        Gpt2Config::new(i32::MAX as usize, 1, 1 << 30, 1, 1),
        Gpt2Config::new(1, 1, 8, usize::MAX / 2, 1),
    ] {
        let error = config.validate().unwrap_err();
        assert!(matches!(error, ModelError::InvalidConfig(_)), "{error}");
        assert!(Model::new(config).is_err());
    }
}

#[test]
fn batches_too_large_to_address_are_input_errors() {
    let model = Model::new(Gpt2Config::tiny()).unwrap();
    for (batch, seq) in [(usize::MAX / 4, 8), (usize::MAX, 1), (1 << 62, 2)] {
        let error = model.shape(batch, seq).unwrap_err();
        assert!(
            matches!(error, ModelError::BadInput(_)),
            "{batch} x {seq}: {error}"
        );
    }
    model.shape(2, 16).unwrap();
}
