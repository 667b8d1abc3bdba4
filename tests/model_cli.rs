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
