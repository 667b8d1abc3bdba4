//! Loading and saving Hugging Face GPT-2 checkpoints: a bit-exact round trip, the name
//! variants found on the Hub, 16-bit files, and clear errors naming the tensor.

mod model_support;

use std::collections::HashMap;
use std::path::Path;

use model_support::{golden_dir, resident_bytes_of};
use safetensors::{Dtype, View};
use strata_engine::model::weights::{
    FileDtype, INDEX_FILE, Pretrained, PretrainedBlocks, SaveOptions, WEIGHTS_FILE, WeightFiles,
    load_config, load_pretrained, load_safetensors, open_pretrained, save_pretrained,
    save_pretrained_blocks, save_pretrained_with,
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
fn a_tensor_holding_nan_or_inf_is_refused_naming_it_and_its_file() {
    for (bad, shown) in [(f32::NAN, "NaN"), (f32::INFINITY, "inf")] {
        let mut tensors = golden_tensors();
        let t = tensors
            .get_mut("transformer.h.1.attn.c_proj.weight")
            .unwrap();
        assert_eq!(t.dtype, Dtype::F32);
        t.bytes[4 * 5..4 * 6].copy_from_slice(&bad.to_le_bytes());
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), &tensors);
        for message in [
            load_safetensors(&tiny(), &path).unwrap_err().to_string(),
            load_pretrained(dir.path()).unwrap_err().to_string(),
            PretrainedBlocks::open(dir.path(), &tiny())
                .unwrap()
                .read_block(2)
                .unwrap_err()
                .to_string(),
        ] {
            assert!(
                message.contains(&format!(
                    "model.safetensors: tensor `transformer.h.1.attn.c_proj.weight` holds 1 \
                     non-finite values of 1024 (the first, {shown}, at element 5)"
                )),
                "{message}"
            );
        }
        // The blocks before it read as before.
        let blocks = PretrainedBlocks::open(dir.path(), &tiny()).unwrap();
        assert!(blocks.read_block(1).is_ok());
    }
}

#[test]
fn config_values_of_the_wrong_type_null_or_out_of_range_are_refused_by_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.json");
    for (key, value, words) in [
        (
            "n_embd",
            serde_json::Value::Null,
            "`n_embd` is null; it must be a positive integer",
        ),
        (
            "n_layer",
            "4".into(),
            "`n_layer` is \"4\" (a string); it must be a positive integer",
        ),
        ("n_layer", 0.into(), "`n_layer` is 0"),
        ("n_head", (-4).into(), "`n_head` is -4"),
        ("vocab_size", 0.into(), "`vocab_size` is 0"),
        ("n_positions", 64.5.into(), "`n_positions` is 64.5"),
        (
            "tie_word_embeddings",
            "true".into(),
            "`tie_word_embeddings` is \"true\" (a string); it must be true or false",
        ),
        (
            "layer_norm_epsilon",
            "1e-5".into(),
            "`layer_norm_epsilon` is \"1e-5\" (a string); it must be a number",
        ),
        (
            "layer_norm_epsilon",
            serde_json::Value::Null,
            "`layer_norm_epsilon` is null",
        ),
        (
            "activation_function",
            1.into(),
            "`activation_function` is 1; it must be a string",
        ),
        ("n_inner", "128".into(), "`n_inner` is \"128\" (a string)"),
    ] {
        let mut json = gpt2::config_json(&Gpt2Config::tiny());
        json[key] = value;
        std::fs::write(&config, json.to_string()).unwrap();
        let message = load_config(&config).unwrap_err().to_string();
        assert!(message.contains(words), "{key}: {message}");
        assert!(message.contains("config.json"), "{key}: {message}");
    }
    // null where transformers derives the value reads as absent.
    let mut json = gpt2::config_json(&Gpt2Config::tiny());
    json["n_inner"] = serde_json::Value::Null;
    std::fs::write(&config, json.to_string()).unwrap();
    load_config(&config).unwrap();
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

/// `tests/data/NAME` (see its README).
fn data_dir(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data")
        .join(name)
}

/// `x` rounded to bf16 (nearest even) and back.
fn bf16_rounded(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// The sharded bf16 copies of the Llama and Qwen2 golden models (11 files and an index,
/// as transformers publishes large checkpoints) read, through the loader's file layer, to
/// exactly the fp32 model's parameters rounded to bf16, every tensor of the fp32 file
/// present. (The families themselves are another module's; this is the file layer every
/// family reads through.)
#[test]
fn sharded_bf16_golden_reads_as_the_bf16_rounded_fp32_model() {
    for family in ["llama-tiny", "qwen2-tiny"] {
        let dir = data_dir(family);
        let fp32 = WeightFiles::open(&dir).unwrap();
        let sharded = WeightFiles::open(&dir.join("sharded-bf16")).unwrap();
        let shards = std::fs::read_dir(dir.join("sharded-bf16"))
            .unwrap()
            .filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                let name = name.to_string_lossy();
                name.starts_with("model-") && name.ends_with(".safetensors")
            })
            .count();
        assert!(shards >= 10, "{family}: {shards} shards");
        assert_eq!(sharded.file_count(), shards, "{family}");
        assert_eq!(sharded.names(), fp32.names(), "{family}");
        let mut elements = 0;
        for name in fp32.names() {
            let (shape, want) = fp32.read_f32(name).unwrap();
            let (got_shape, got) = sharded.read_f32(name).unwrap();
            assert_eq!(got_shape, shape, "{family} {name}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    bf16_rounded(*w).to_bits(),
                    "{family} {name}[{i}]: {g} is not bf16({w})"
                );
            }
            elements += want.len();
        }
        let index: serde_json::Value = serde_json::from_slice(
            &std::fs::read(dir.join("sharded-bf16/model.safetensors.index.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(
            index["metadata"]["total_parameters"].as_u64(),
            Some(elements as u64),
            "{family}"
        );
    }
}

/// GPT-2 saved in bf16 as shards (index as transformers writes it) loads back to the
/// bf16-rounded parameters, says it is bf16 and sharded, keeps the input's config.json
/// (but for its dtype) and carries its tokenizer and generation files; saved again with
/// the options it was read with, it keeps that layout; saved as one f32 file into the
/// same folder, the shards go.
#[test]
fn gpt2_sharded_bf16_save_and_load_round_trip() {
    let (model, params, source) = open_pretrained(&golden_dir()).unwrap();
    assert_eq!(source.dtype, FileDtype::F32);
    assert_eq!(source.shard_bytes, None);
    // A base folder whose config.json has entries the family does not write (a dropout
    // strata does not rewrite, bos/eos ids), and a tokenizer.
    let base_dir = tempfile::tempdir().unwrap();
    let mut config = source.config.clone();
    config["bos_token_id"] = 7.into();
    config["eos_token_id"] = 9.into();
    config["summary_first_dropout"] = 0.25.into();
    let base = Pretrained {
        dir: base_dir.path().to_path_buf(),
        config,
        ..source.clone()
    };
    std::fs::write(base_dir.path().join("tokenizer.json"), b"{\"t\": 1}").unwrap();
    std::fs::write(
        base_dir.path().join("generation_config.json"),
        b"{\"g\": 2}",
    )
    .unwrap();

    let out = tempfile::tempdir().unwrap();
    let total_bf16 = model.param_count() as u64 * 2;
    let options = SaveOptions {
        dtype: FileDtype::Bf16,
        max_shard_bytes: total_bf16 / 3,
        base: Some(&base),
    };
    save_pretrained_with(&model, &params, out.path(), &options).unwrap();
    assert!(!out.path().join(WEIGHTS_FILE).exists());
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.path().join(INDEX_FILE)).unwrap()).unwrap();
    let files: std::collections::BTreeSet<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(files.len() >= 3, "{files:?}");
    let n = files.len();
    for (i, f) in files.iter().enumerate() {
        assert_eq!(*f, format!("model-{:05}-of-{n:05}.safetensors", i + 1));
    }
    let (again, loaded, described) = open_pretrained(out.path()).unwrap();
    assert_eq!(again, model);
    assert_eq!(described.dtype, FileDtype::Bf16);
    assert!(described.shard_bytes.unwrap() <= total_bf16 / 3 + 4 * 32 * 32);
    for (block, (got, want)) in loaded.iter().zip(&params).enumerate() {
        for (g, w) in got.iter().zip(want) {
            assert_eq!(g.to_bits(), bf16_rounded(*w).to_bits(), "block {block}");
        }
    }
    assert_eq!(
        index["metadata"]["total_size"].as_u64(),
        Some(model.param_count() as u64 * 2)
    );
    let saved_config = &described.config;
    // The golden config.json is transformers 5's: `dtype`, no `torch_dtype` added.
    assert_eq!(saved_config["dtype"], "bfloat16");
    assert!(saved_config.get("torch_dtype").is_none());
    assert_eq!(saved_config["bos_token_id"], 7);
    assert_eq!(saved_config["eos_token_id"], 9);
    assert_eq!(saved_config["summary_first_dropout"], 0.25);
    assert_eq!(
        std::fs::read(out.path().join("tokenizer.json")).unwrap(),
        b"{\"t\": 1}"
    );
    assert_eq!(
        std::fs::read(out.path().join("generation_config.json")).unwrap(),
        b"{\"g\": 2}"
    );

    // Saved again as it was read: bf16, the same shards.
    let again_dir = tempfile::tempdir().unwrap();
    save_pretrained_with(&model, &loaded, again_dir.path(), &described.save_options()).unwrap();
    let (_, reloaded, redescribed) = open_pretrained(again_dir.path()).unwrap();
    assert_eq!(redescribed.dtype, FileDtype::Bf16);
    assert_eq!(WeightFiles::open(again_dir.path()).unwrap().file_count(), n);
    assert_eq!(reloaded, loaded);

    // One f32 file into the sharded folder: the shards and the index are removed.
    save_pretrained(&model, &params, out.path()).unwrap();
    let left: Vec<String> = std::fs::read_dir(out.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.contains("safetensors"))
        .collect();
    assert_eq!(left, [WEIGHTS_FILE]);
    assert_eq!(load_pretrained(out.path()).unwrap().1, params);
}

/// Pickled PyTorch weights are refused with the command that converts them; an index
/// that names a shard lacking the tensor is an error naming both.
#[test]
fn pickles_and_bad_indexes_are_refused_with_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        golden_dir().join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    std::fs::write(dir.path().join("pytorch_model.bin"), b"pickle").unwrap();
    let e = load_pretrained(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("pytorch_model.bin, a pickle")
            && e.contains("save_pretrained(")
            && e.contains("safetensors only"),
        "{e}"
    );
    std::fs::remove_file(dir.path().join("pytorch_model.bin")).unwrap();
    std::fs::copy(
        golden_dir().join("model.safetensors"),
        dir.path().join("model-00001-of-00001.safetensors"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join(INDEX_FILE),
        r#"{"weight_map": {"transformer.wte.weight": "model-00001-of-00001.safetensors", "transformer.nope": "model-00001-of-00001.safetensors"}}"#,
    )
    .unwrap();
    let e = load_pretrained(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("transformer.nope") && e.contains("does not hold it"),
        "{e}"
    );
}

/// Saving a block at a time (what `strata train --out` does alone) writes the same files,
/// byte for byte, as saving the whole parameters, single or sharded, reading each block
/// once when its tensors' names are adjacent; a failed read moves nothing into place and
/// is the error returned.
#[test]
fn saving_a_block_at_a_time_writes_the_whole_save_s_bytes() {
    let (model, params, source) = open_pretrained(&golden_dir()).unwrap();
    let total_bf16 = model.param_count() as u64 * 2;
    for (dtype, max_shard_bytes) in [
        (FileDtype::F32, u64::MAX),
        (FileDtype::Bf16, total_bf16 / 3),
    ] {
        let options = SaveOptions {
            dtype,
            max_shard_bytes,
            base: Some(&source),
        };
        let (whole, blocks) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        save_pretrained_with(&model, &params, whole.path(), &options).unwrap();
        let reads = std::cell::RefCell::new(vec![0usize; params.len()]);
        save_pretrained_blocks(
            &model,
            &|b| {
                reads.borrow_mut()[b] += 1;
                Ok(params[b].clone())
            },
            blocks.path(),
            &options,
        )
        .unwrap();
        let mut names: Vec<_> = std::fs::read_dir(whole.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        assert!(names.len() >= 2, "{names:?}");
        for name in &names {
            assert_eq!(
                std::fs::read(whole.path().join(name)).unwrap(),
                std::fs::read(blocks.path().join(name)).unwrap(),
                "{dtype:?}: {name:?}"
            );
        }
        // In one file GPT-2's names (h.N.*, ln_f, wpe, wte) keep each block's tensors
        // together: one read per block. A block split between two shards is read for
        // each.
        let most = if max_shard_bytes == u64::MAX { 1 } else { 2 };
        assert!(
            reads.borrow().iter().all(|&n| (1..=most).contains(&n)),
            "{dtype:?}: {:?}",
            reads.borrow()
        );
    }
    // A read that fails: the error, and no weights file left behind.
    let out = tempfile::tempdir().unwrap();
    let err = save_pretrained_blocks(
        &model,
        &|b| {
            if b == 2 {
                Err(ModelError::BadInput("block 2 could not be read".into()))
            } else {
                Ok(params[b].clone())
            }
        },
        out.path(),
        &SaveOptions::default(),
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("block 2 could not be read"),
        "{err}"
    );
    let left: Vec<_> = std::fs::read_dir(out.path()).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn reading_a_block_at_a_time_leaves_the_file_unresident() {
    let dir = tempfile::tempdir().unwrap();
    // An 8 MiB embedding block, a small transformer block, a head.
    let model = Model::new(Gpt2Config::new(1, 4, 256, 8192, 64)).unwrap();
    let params: Vec<Vec<f32>> = (0..model.blocks().len())
        .map(|b| model.init_block(b, 5))
        .collect();
    save_pretrained(&model, &params, dir.path()).unwrap();
    let file = dir.path().join(WEIGHTS_FILE);
    let size = std::fs::metadata(&file).unwrap().len();
    let blocks = PretrainedBlocks::open(dir.path(), &model).unwrap();
    for (b, expected) in params.iter().enumerate() {
        assert_eq!(&blocks.read_block(b).unwrap(), expected, "block {b}");
    }
    let resident = resident_bytes_of(&file);
    assert!(
        resident < size / 8,
        "{resident} B of the {size} B file still resident after every block was read"
    );
}

/// A folder whose config.json says its weights are stored quantised (a bitsandbytes
/// 4-bit folder, GPTQ, ...) is refused before any tensor is read, naming the fix.
#[test]
fn weights_stored_quantised_are_refused_naming_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let golden = golden_dir();
    std::fs::copy(
        golden.join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    let text = std::fs::read_to_string(golden.join("config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&text).unwrap();
    config["quantization_config"] =
        serde_json::json!({"quant_method": "bitsandbytes", "load_in_4bit": true});
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let message = load_pretrained(dir.path()).unwrap_err().to_string();
    assert!(
        message.contains("quant_method bitsandbytes") && message.contains("--quant nf4"),
        "{message}"
    );
    // The shape alone is still read (`strata plan` needs no weights).
    load_config(&dir.path().join("config.json")).unwrap();
}
