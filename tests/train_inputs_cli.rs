//! `strata train` refuses, before step 1, the inputs that used to train something other
//! than what the user meant or lose work: a model folder whose weights cannot all be read
//! (shards without their index, a tokenizer without weights), an --out in the input model
//! or over a saved model, too little free space, config.json values transformers
//! refuses, and weights holding NaN.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn data_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

/// `strata` with `args`, killed (failing the test) if it runs past two minutes: a
/// refusal comes in seconds, a run that was not refused might take hours.
fn strata(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the strata binary runs");
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("strata {} ran for two minutes", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Copies the files of `from` (not its folders) into a new folder `to`, but `skip`.
fn copy_model(from: &Path, to: &Path, skip: &[&str]) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().to_string_lossy().into_owned();
        if entry.path().is_file() && !skip.contains(&name.as_str()) {
            std::fs::copy(entry.path(), to.join(&name)).unwrap();
        }
    }
}

/// `strata train` of `model` on the tiny models' tokens, 2 steps unless `extra` says,
/// with `extra`.
fn train(dir: &Path, model: &Path, extra: &[&str]) -> Output {
    let nvme = dir.join("nvme");
    std::fs::create_dir_all(&nvme).unwrap();
    let data = data_dir("gpt2-tiny").join("tokens.bin");
    let mut args = vec![
        "train",
        "--model",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "16",
        "--device",
        "cpu",
        "--device-mem",
        "all",
        "--host-mem",
        "all",
        "--nvme",
        nvme.to_str().unwrap(),
    ];
    if !extra.contains(&"--steps") {
        args.extend(["--steps", "2"]);
    }
    args.extend(extra);
    strata(&args)
}

/// A failure: one error line, on stderr, holding each of `needles`, and no step run.
fn assert_refused(out: &Output, needles: &[&str]) {
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        !out.status.success(),
        "expected a failure:\n{stdout}\n{stderr}"
    );
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("strata: error:"))
        .collect();
    assert_eq!(errors.len(), 1, "one error line expected:\n{stderr}");
    for n in needles {
        assert!(errors[0].contains(n), "'{n}' missing from: {}", errors[0]);
    }
    assert!(
        !stdout.contains("step 1/") && !stderr.contains("step 1/"),
        "a step ran:\n{stdout}\n{stderr}"
    );
}

fn assert_ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

#[test]
fn shards_without_their_index_are_refused_by_train_and_eval_alike() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    copy_model(
        &data_dir("llama-tiny/sharded-bf16"),
        &model,
        &["model.safetensors.index.json"],
    );
    let words = [
        "holds the shards model-00001-of-00011.safetensors",
        "but no model.safetensors.index.json",
        "copy the index",
    ];
    assert_refused(&train(dir.path(), &model, &[]), &words);
    let data = data_dir("llama-tiny").join("tokens.bin");
    let eval = strata(&[
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "1",
        "--device",
        "cpu",
    ]);
    assert!(!eval.status.success());
    for w in words {
        assert!(text(&eval.stderr).contains(w), "{}", text(&eval.stderr));
    }
}

#[test]
fn a_tokenizer_without_weights_trains_only_from_scratch_and_keeps_its_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    copy_model(&data_dir("gpt2-tiny"), &model, &[]);
    for f in ["model.safetensors", "expected.safetensors", "tokens.bin"] {
        std::fs::remove_file(model.join(f)).unwrap();
    }
    std::fs::copy(
        data_dir("tokenizer-bpe").join("tokenizer.json"),
        model.join("tokenizer.json"),
    )
    .unwrap();
    assert_refused(
        &train(dir.path(), &model, &[]),
        &[
            "holds tokenizer.json but no weights",
            "random initialisation",
            "--from-scratch",
        ],
    );
    let out = dir.path().join("out");
    let stdout = assert_ok(&train(
        dir.path(),
        &model,
        &["--from-scratch", "--out", out.to_str().unwrap()],
    ));
    assert!(stdout.contains("tokenizer files"), "{stdout}");
    assert_eq!(
        std::fs::read(out.join("tokenizer.json")).unwrap(),
        std::fs::read(model.join("tokenizer.json")).unwrap()
    );
    // Only config.json: a shape, as before.
    std::fs::remove_file(model.join("tokenizer.json")).unwrap();
    assert_ok(&train(dir.path(), &model, &[]));
}

#[test]
fn out_is_never_the_input_model_nor_over_a_saved_model_without_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    copy_model(&data_dir("gpt2-tiny"), &model, &[]);
    let before = std::fs::read(model.join("model.safetensors")).unwrap();
    let same = dir.path().join("model/../model");
    for (out, words) in [
        (same.to_str().unwrap(), "which is the model folder --model"),
        (
            model.join("trained").to_str().unwrap(),
            "inside the model folder --model",
        ),
    ] {
        assert_refused(
            &train(dir.path(), &model, &["--out", out, "--overwrite"]),
            &["--out", words],
        );
    }
    assert_eq!(
        std::fs::read(model.join("model.safetensors")).unwrap(),
        before
    );
    let out = dir.path().join("out");
    let out = out.to_str().unwrap();
    assert_ok(&train(dir.path(), &model, &["--out", out]));
    assert_refused(
        &train(dir.path(), &model, &["--out", out]),
        &["holds a model already", "--overwrite"],
    );
    assert_ok(&train(dir.path(), &model, &["--out", out, "--overwrite"]));
}

#[test]
fn too_little_free_space_for_checkpoints_is_refused_before_step_1() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let out = train(
        dir.path(),
        &data_dir("gpt2-tiny"),
        &[
            "--steps",
            "100000000000",
            "--checkpoint-every",
            "1",
            "--keep-checkpoints",
            "100000000000",
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
        ],
    );
    assert_refused(
        &out,
        &[
            "not enough free space",
            "--checkpoint-dir",
            "100000000001 checkpoints of",
            "free",
        ],
    );
}

#[test]
fn config_values_transformers_refuses_are_refused_naming_key_and_value() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    copy_model(&data_dir("llama-tiny"), &model, &[]);
    let config = model.join("config.json");
    let original: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    for (key, value, words) in [
        ("hidden_size", "null", "`hidden_size` is null"),
        (
            "num_hidden_layers",
            r#""2""#,
            r#"`num_hidden_layers` is "2" (a string)"#,
        ),
        (
            "rms_norm_eps",
            "-1e-6",
            "rms_norm_eps -0.000001 must be positive",
        ),
    ] {
        let mut json = original.clone();
        json[key] = serde_json::from_str(value).unwrap();
        std::fs::write(&config, json.to_string()).unwrap();
        assert_refused(&train(dir.path(), &model, &[]), &["config.json", words]);
    }
}

#[test]
fn weights_holding_nan_are_refused_naming_the_tensor_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    copy_model(&data_dir("gpt2-tiny"), &model, &[]);
    let path = model.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let name = "transformer.h.0.mlp.c_fc.bias";
    let view = file.tensor(name).unwrap();
    assert_eq!(view.dtype(), safetensors::Dtype::F32);
    // The tensor's data begins where its bytes are in the file.
    let start = bytes
        .windows(view.data().len())
        .position(|w| w == view.data())
        .unwrap();
    let mut poisoned = bytes.clone();
    poisoned[start + 8..start + 12].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&path, poisoned).unwrap();
    let out = dir.path().join("out");
    assert_refused(
        &train(dir.path(), &model, &["--out", out.to_str().unwrap()]),
        &[
            "model.safetensors: tensor `transformer.h.0.mlp.c_fc.bias` holds 1 non-finite",
            "NaN, at element 2",
        ],
    );
    assert!(!out.exists(), "nothing is saved from weights holding NaN");
}

#[test]
fn pack_trains_the_llama_family_and_is_refused_for_gpt2_before_any_step() {
    let dir = tempfile::tempdir().unwrap();
    // config.json's eos_token_id (2) ends each document.
    let out = assert_ok(&train(
        dir.path(),
        &data_dir("llama-packed-tiny"),
        &["--pack"],
    ));
    assert!(out.contains("packed: documents end with token 2"), "{out}");
    let gpt2 = train(dir.path(), &data_dir("gpt2-tiny"), &["--pack"]);
    assert_refused(&gpt2, &["packed batches (--pack)", "Llama family", "gpt2"]);
    // A Llama shape names no end-of-document token.
    let shape = train(
        dir.path(),
        Path::new("llama-3.2-1b"),
        &["--pack", "--steps", "1"],
    );
    assert_refused(&shape, &["--pack needs the id that ends a document"]);
    // A packed run resumes packed only.
    let ckpt = dir.path().join("ck");
    let ck = ckpt.to_str().unwrap();
    let model = data_dir("llama-packed-tiny");
    let saving = ["--pack", "--steps", "1", "--checkpoint-dir", ck];
    assert_ok(&train(dir.path(), &model, &saving));
    let saved = ckpt.join("step-00000001");
    let resume = ["--steps", "2", "--resume", saved.to_str().unwrap()];
    assert_refused(
        &train(dir.path(), &model, &resume),
        &["--pack true (now false)"],
    );
    // A GPT-2 shape names none either, and is refused for its family.
    let gpt2_shape = train(dir.path(), Path::new("small"), &["--pack", "--steps", "1"]);
    assert_refused(&gpt2_shape, &["packed batches (--pack)", "Llama family"]);
}
