//! `strata eval` end to end: the golden model and tokens give PyTorch's evaluation losses,
//! and bad input gives clear errors.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn golden() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gpt2-tiny")
}

fn strata(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .output()
        .expect("the strata binary runs")
}

/// PyTorch's loss of each batch under the initial parameters (meta.json).
fn eval_losses() -> Vec<f64> {
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(golden().join("meta.json")).unwrap())
            .unwrap();
    meta["eval_losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect()
}

/// Runs eval on the golden data and checks every line against PyTorch.
fn check_golden_eval(device: &str) {
    let model = golden();
    let data = golden().join("tokens.bin");
    let out = strata(&[
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
        "3",
        "--device",
        device,
    ]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{device}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    let want = eval_losses();
    assert_eq!(lines.len(), want.len() + 1, "{stdout}");
    for (step, (line, want)) in lines.iter().zip(&want).enumerate() {
        let prefix = format!("step {step} loss ");
        let got: f32 = line
            .strip_prefix(&prefix)
            .unwrap_or_else(|| panic!("{line}"))
            .parse()
            .unwrap();
        let err = (got as f64 - want).abs() / want;
        assert!(err < 1e-5, "{device} step {step}: {got} vs PyTorch {want}");
    }
    let mean: f32 = lines[3]
        .strip_prefix("mean loss ")
        .unwrap()
        .parse()
        .unwrap();
    let want_mean = want.iter().sum::<f64>() / want.len() as f64;
    assert!(
        (mean as f64 - want_mean).abs() / want_mean < 1e-5,
        "{mean} vs {want_mean}"
    );
}

#[test]
fn eval_reproduces_pytorch_on_the_cpu_and_on_the_automatic_choice() {
    check_golden_eval("cpu");
    // auto is the CPU here, or the GPU where one is usable.
    check_golden_eval("auto");
}

#[test]
#[ignore = "needs a GPU"]
fn eval_reproduces_pytorch_on_a_gpu() {
    // Run anyway where CUDA is not usable, it fails naming what is missing.
    if let Err(e) = strata::kernels::cuda::probe().require_all() {
        panic!("this test needs a GPU: {e}");
    }
    check_golden_eval("cuda");
}

#[test]
fn eval_on_cuda_without_a_gpu_fails_naming_why() {
    // Asked for explicitly where no GPU is visible (hidden here, so that a machine with
    // one checks this too), CUDA fails with the probe's reason.
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "eval",
            "--model",
            golden().to_str().unwrap(),
            "--data",
            golden().join("tokens.bin").to_str().unwrap(),
            "--batch",
            "2",
            "--seq",
            "16",
            "--device",
            "cuda",
        ])
        .env("CUDA_VISIBLE_DEVICES", "")
        .output()
        .expect("the strata binary runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("CUDA is not usable here"), "{stderr}");
}

#[test]
fn bad_input_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let model = golden();
    let model = model.to_str().unwrap();
    // A token outside the vocabulary (64) at position 40: batch 1 of 2x16 reads it.
    let mut bytes = std::fs::read(golden().join("tokens.bin")).unwrap();
    let at = 1024 + 2 * 40;
    bytes[at..at + 2].copy_from_slice(&70u16.to_le_bytes());
    let bad = dir.path().join("bad.bin");
    std::fs::write(&bad, bytes).unwrap();
    let out = strata(&[
        "eval",
        "--model",
        model,
        "--data",
        bad.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "16",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("token 70 at position 40 (of 97) is outside the model's vocabulary of 64"),
        "{stderr}"
    );

    let data = golden().join("tokens.bin");
    let data = data.to_str().unwrap();
    let out = strata(&[
        "eval", "--model", model, "--data", data, "--batch", "2", "--seq", "16", "--steps", "4",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("97 tokens hold 3 whole batches"),
        "{stderr}"
    );

    let out = strata(&[
        "eval", "--model", model, "--data", data, "--batch", "2", "--seq", "33",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("exceeds the model's context of 32"),
        "{stderr}"
    );

    let out = strata(&[
        "eval",
        "--model",
        "/nonexistent",
        "--data",
        data,
        "--batch",
        "2",
        "--seq",
        "16",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("/nonexistent"),
        "{stderr}"
    );
}

/// `strata eval --adapter` on `tests/data/lora-tiny` (a peft 0.21 adapter over a Llama
/// base): the first batch's loss is peft's for the base with the adapter (meta.json's
/// `losses[0]`, taken before any update), and without the adapter it is another.
#[test]
fn an_adapter_is_evaluated_as_peft_evaluates_it() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/lora-tiny");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
    let want = meta["losses"][0].as_f64().unwrap();
    let base = dir.join("base");
    let data = dir.join("tokens.bin");
    let loss = |adapter: Option<&Path>| -> f64 {
        let mut args = vec![
            "eval",
            "--model",
            base.to_str().unwrap(),
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
        ];
        if let Some(a) = adapter {
            args.extend(["--adapter", a.to_str().unwrap()]);
        }
        let out = strata(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8(out.stdout).unwrap();
        stdout
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("step 0 loss "))
            .unwrap_or_else(|| panic!("{stdout}"))
            .parse()
            .unwrap()
    };
    let adapted = loss(Some(&dir.join("adapter0")));
    assert!(
        (adapted - want).abs() < 1e-4,
        "with the adapter: {adapted} vs peft's {want}"
    );
    let plain = loss(None);
    assert!((plain - want).abs() > 1e-3, "without it: {plain}");
    // An adapter for another model is refused before any batch runs.
    let gpt2 = golden();
    let out = strata(&[
        "eval",
        "--model",
        gpt2.to_str().unwrap(),
        "--data",
        gpt2.join("tokens.bin").to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "1",
        "--device",
        "cpu",
        "--adapter",
        dir.join("adapter0").to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--adapter") && stderr.contains("q_proj"),
        "{stderr}"
    );
}

/// `--blockwise` (a block at a time, for a model larger than memory) prints the same
/// lines as the whole model loaded, bit for bit: GPT-2 (whose head reads the tied
/// embedding again), and a Llama base with an adapter merged over its base quantised
/// (`--quant nf4`), whose loss is then not the unquantised one's.
#[test]
fn blockwise_evaluation_gives_the_whole_models_losses() {
    let lora = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/lora-tiny");
    let (gpt2, llama) = (golden(), lora.join("base"));
    let (adapter, gpt2_data) = (lora.join("adapter0"), gpt2.join("tokens.bin"));
    let llama_data = lora.join("tokens.bin");
    let eval = |model: &Path, data: &Path, extra: &[&str]| -> String {
        let mut args = vec!["eval", "--model", model.to_str().unwrap()];
        args.extend([
            "--data",
            data.to_str().unwrap(),
            "--batch",
            "2",
            "--seq",
            "16",
        ]);
        args.extend(["--steps", "2", "--device", "cpu"]);
        args.extend_from_slice(extra);
        let out = strata(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{extra:?}: {stderr}");
        String::from_utf8(out.stdout).unwrap()
    };
    let quantised = ["--adapter", adapter.to_str().unwrap(), "--quant", "nf4"];
    let whole = eval(&gpt2, &gpt2_data, &[]);
    assert_eq!(whole, eval(&gpt2, &gpt2_data, &["--blockwise"]));
    let whole = eval(&llama, &llama_data, &quantised);
    assert_eq!(
        whole,
        eval(
            &llama,
            &llama_data,
            &[&quantised[..], &["--blockwise"]].concat()
        )
    );
    let unquantised = eval(&llama, &llama_data, &quantised[..2]);
    assert_ne!(whole, unquantised, "the base quantised");
}
