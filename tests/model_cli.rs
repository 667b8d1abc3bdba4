//! `strata model` as a user runs it: named and custom shapes, --init, and its errors.

use std::path::PathBuf;
use std::process::Command;

fn strata(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn named_configurations_have_the_published_sizes() {
    for (name, params) in [
        ("gpt2", 124_439_808u64),
        ("gpt2-medium", 354_823_168),
        ("gpt2-large", 774_030_080),
        ("gpt2-xl", 1_557_611_200),
    ] {
        let (ok, stdout, stderr) = strata(&["model", "--config", name]);
        assert!(ok, "{stderr}");
        assert!(
            stdout.contains(&format!("parameters: {params}\n")),
            "{name}: {stdout}"
        );
    }
}

#[test]
fn any_size_from_five_numbers() {
    let (ok, stdout, stderr) = strata(&[
        "model", "--layers", "80", "--heads", "32", "--width", "4096", "--vocab", "50257", "--ctx",
        "2048",
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.starts_with("model: custom (80 layers, 32 heads, width 4096"),
        "{stdout}"
    );
    // 80 blocks of 12*4096^2 + 13*4096 parameters, embeddings, final LayerNorm.
    let expected: u64 = 80 * (12 * 4096 * 4096 + 13 * 4096) + 50257 * 4096 + 2048 * 4096 + 2 * 4096;
    assert!(
        stdout.contains(&format!("parameters: {expected}\n")),
        "{stdout}"
    );
    assert!(stdout.contains("... 77 more alike"), "{stdout}");

    let (ok, _, stderr) = strata(&["model", "--width", "100", "--heads", "12"]);
    assert!(!ok);
    assert!(
        stderr.contains("width 100 is not divisible by 12 heads"),
        "{stderr}"
    );
    let (ok, _, stderr) = strata(&["model", "--config", "gpt5"]);
    assert!(!ok);
    assert!(stderr.contains("no configuration named 'gpt5'"), "{stderr}");
}

#[test]
fn init_writes_a_model_that_eval_loads() {
    let dir = tempfile::tempdir_in(PathBuf::from(env!("CARGO_TARGET_TMPDIR"))).unwrap();
    let model = dir.path().join("tiny");
    let model = model.to_str().unwrap();
    let (ok, stdout, stderr) =
        strata(&["model", "--config", "tiny", "--init", model, "--seed", "3"]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("wrote a randomly initialised model (seed 3)"),
        "{stdout}"
    );
    let data = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/gpt2-tiny/tokens.bin"
    );
    let (ok, stdout, stderr) = strata(&[
        "eval", "--model", model, "--data", data, "--batch", "2", "--seq", "16", "--steps", "2",
        "--device", "cpu",
    ]);
    assert!(ok, "{stderr}");
    let losses: Vec<f32> = stdout
        .lines()
        .filter_map(|l| {
            l.strip_prefix("step ")?
                .split(" loss ")
                .nth(1)?
                .parse()
                .ok()
        })
        .collect();
    assert_eq!(losses.len(), 2, "{stdout}");
    // A randomly initialised model predicts nearly uniformly over 64 tokens.
    for loss in losses {
        assert!((loss - 64f32.ln()).abs() < 0.3, "loss {loss}");
    }
}

#[test]
fn llama_family_presets_have_the_published_sizes() {
    for (name, params, describe) in [
        (
            "llama-3-8b",
            8_030_261_248u64,
            "Llama (32 layers, 4096 wide, 32 heads and 8 key/value heads of 128, MLP 14336, \
             vocab 128256, context 8192, untied head)",
        ),
        (
            "qwen2.5-0.5b",
            494_032_768,
            "Qwen2 (24 layers, 896 wide, 14 heads and 2 key/value heads of 64, MLP 4864, vocab \
             151936, context 32768, tied head)",
        ),
        ("qwen3-8b", 8_190_735_360, "Qwen3 (36 layers"),
        ("mistral-7b", 7_248_023_552, "Mistral (32 layers"),
    ] {
        let (ok, stdout, stderr) = strata(&["model", "--config", name]);
        assert!(ok, "{stderr}");
        assert!(
            stdout.starts_with(&format!("model: {name}: {describe}")),
            "{stdout}"
        );
        assert!(
            stdout.contains(&format!("parameters: {params}\n")),
            "{name}: {stdout}"
        );
    }
    let (ok, _, stderr) = strata(&["model", "--config", "llama-3-8b", "--family", "qwen2"]);
    assert!(!ok);
    assert!(
        stderr.contains("--config llama-3-8b is a llama model, not --family qwen2"),
        "{stderr}"
    );
    let (ok, _, stderr) = strata(&["model", "--family", "falcon"]);
    assert!(!ok);
    assert!(stderr.contains("no family named 'falcon'"), "{stderr}");
    let (ok, _, stderr) = strata(&["model", "--kv-heads", "2"]);
    assert!(!ok);
    assert!(
        stderr.contains("--kv-heads is for Llama-family models"),
        "{stderr}"
    );
}

#[test]
fn a_llama_family_init_loads_back_and_predicts_uniformly() {
    let dir = tempfile::tempdir_in(PathBuf::from(env!("CARGO_TARGET_TMPDIR"))).unwrap();
    let model = dir.path().join("llama");
    let model = model.to_str().unwrap();
    let (ok, stdout, stderr) = strata(&[
        "model",
        "--family",
        "qwen2",
        "--layers",
        "2",
        "--width",
        "64",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--intermediate",
        "96",
        "--vocab",
        "128",
        "--ctx",
        "64",
        "--tied",
        "true",
        "--init",
        model,
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("no tokenizer was written"), "{stdout}");
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("llama/config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["model_type"], "qwen2");
    assert_eq!(config["architectures"][0], "Qwen2ForCausalLM");
    assert_eq!(config["num_key_value_heads"], 2);
    assert_eq!(config["tie_word_embeddings"], true);
    let data = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/qwen2-tiny/tokens.bin"
    );
    let (ok, stdout, stderr) = strata(&[
        "eval", "--model", model, "--data", data, "--batch", "2", "--seq", "16", "--steps", "2",
        "--device", "cpu",
    ]);
    assert!(ok, "{stderr}");
    let losses: Vec<f32> = stdout
        .lines()
        .filter_map(|l| {
            l.strip_prefix("step ")?
                .split(" loss ")
                .nth(1)?
                .parse()
                .ok()
        })
        .collect();
    assert_eq!(losses.len(), 2, "{stdout}");
    // Weights of deviation 0.02 predict nearly uniformly over 128 tokens.
    for loss in losses {
        assert!((loss - 128f32.ln()).abs() < 0.3, "loss {loss}");
    }
}

#[test]
fn plan_answers_for_a_preset_up_to_its_context_with_bytes_per_parameter() {
    let (ok, stdout, stderr) = strata(&[
        "plan",
        "--model",
        "llama-3-8b",
        "--device-mem",
        "24GiB",
        "--host-mem",
        "64GiB",
        "--nvme-mem",
        "1TiB",
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.starts_with("model llama-3-8b: 8.030 B params, Llama"),
        "{stdout}"
    );
    let per_param = stdout
        .lines()
        .find(|l| l.starts_with("peak per parameter"))
        .unwrap_or_else(|| panic!("{stdout}"));
    // The NVMe tier holds the fp32 master, m and v once (12 B/param; the working
    // parameters are the master copy) of every block but the embedding and the untied
    // head, which stay in host memory with 64 GiB of it (13% of the parameters), and one
    // spare extent per block size: between 12 x 0.87 and the 14.4 B/param the per-block
    // commit issue set as its bound.
    let nvme: f64 = per_param
        .split_whitespace()
        .rev()
        .nth(1)
        .and_then(|x| x.parse().ok())
        .unwrap_or_else(|| panic!("{per_param}"));
    assert!((10.4..=14.4).contains(&nvme), "{per_param}");
    // A whole context's sequence is planned (it needs more device memory).
    let (_, stdout, _) = strata(&[
        "plan",
        "--model",
        "llama-3-8b",
        "--batch",
        "1",
        "--seq",
        "8192",
        "--nvme-mem",
        "1TiB",
    ]);
    assert!(stdout.contains("step: 1 x 8192 tokens"), "{stdout}");
    let (ok, _, stderr) = strata(&["plan", "--model", "llama-3-8b", "--seq", "8193"]);
    assert!(!ok);
    assert!(stderr.contains("8192"), "{stderr}");
}

#[test]
fn a_hugging_face_llama_folder_trains_under_every_policy_and_its_output_loads() {
    let dir = tempfile::tempdir_in(PathBuf::from(env!("CARGO_TARGET_TMPDIR"))).unwrap();
    let golden = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/qwen2-tiny");
    let data = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/qwen2-tiny/tokens.bin"
    );
    let mut evals = Vec::new();
    for policy in [
        "all-on-device",
        "cpu-offload",
        "param-offload",
        "nvme-offload",
    ] {
        let out = dir.path().join(policy);
        let out = out.to_str().unwrap();
        let nvme = dir.path().join(format!("{policy}-nvme"));
        std::fs::create_dir_all(&nvme).unwrap();
        let (ok, stdout, stderr) = strata(&[
            "train",
            "--model",
            golden,
            "--data",
            data,
            "--steps",
            "3",
            "--batch",
            "2",
            "--seq",
            "16",
            "--policy",
            policy,
            "--nvme",
            nvme.to_str().unwrap(),
            "--out",
            out,
        ]);
        assert!(ok, "{policy}: {stderr}");
        // Step 0's loss is PyTorch's (shared/golden: 4.6198864).
        let log = stdout + &stderr;
        assert!(log.contains(" 4.6199 -> "), "{policy}: {log}");
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join(policy).join("config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(config["architectures"][0], "Qwen2ForCausalLM");
        let (ok, stdout, stderr) = strata(&[
            "eval", "--model", out, "--data", data, "--batch", "2", "--seq", "16", "--steps", "3",
            "--device", "cpu",
        ]);
        assert!(ok, "{policy}: {stderr}");
        evals.push(stdout);
    }
    // The trained models are the same whatever the policy: their losses print alike.
    assert!(evals.iter().all(|e| *e == evals[0]), "{evals:?}");
}

#[test]
fn init_with_a_tokenizer_copies_it_sizes_the_vocabulary_and_trains_on_text() {
    let dir = tempfile::tempdir_in(PathBuf::from(env!("CARGO_TARGET_TMPDIR"))).unwrap();
    let model = dir.path().join("llama");
    let model = model.to_str().unwrap();
    let tokenizer = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/tokenizer-bpe");
    let shape = [
        "model",
        "--family",
        "llama",
        "--layers",
        "1",
        "--width",
        "32",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--intermediate",
        "48",
        "--ctx",
        "32",
    ];
    // A vocabulary smaller than the tokenizer's ids is refused.
    let (ok, _, stderr) = strata(
        &[
            &shape[..],
            &["--vocab", "10", "--tokenizer", tokenizer, "--init", model],
        ]
        .concat(),
    );
    assert!(
        !ok && stderr.contains("smaller than the tokenizer's 1000 ids"),
        "{stderr}"
    );
    let (ok, stdout, stderr) =
        strata(&[&shape[..], &["--tokenizer", tokenizer, "--init", model]].concat());
    assert!(ok, "{stderr}");
    assert!(stdout.contains("copied the tokenizer"), "{stdout}");
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("llama/config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["vocab_size"], 1000, "{config}");
    assert_eq!(
        std::fs::read(dir.path().join("llama/tokenizer.json")).unwrap(),
        std::fs::read(format!("{tokenizer}/tokenizer.json")).unwrap()
    );
    // The folder's tokenizer reads text data for train.
    let text = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/tokenizer-bpe/eval.txt"
    );
    let (ok, stdout, stderr) = strata(&[
        "train", "--model", model, "--data", text, "--steps", "2", "--batch", "1", "--seq", "16",
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("tokenized with"), "{stdout}");
}
