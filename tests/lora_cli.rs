//! `strata train --lora` as a user runs it, on `tests/data/lora-tiny` (a Llama base and
//! a peft 0.21 adapter trained 3 AdamW steps): started from peft's adapter with
//! `--init-adapter`, three steps print peft's losses and `--out` writes a peft adapter
//! folder holding peft's trained adapter (within 1e-5), which `strata eval --adapter`
//! evaluates as it does peft's; a fresh LoRA run starts as its base; a run resumed from
//! its checkpoint (the adapters' state alone) continues byte for byte; what is not built
//! yet is refused before any work, by name. With `--quant nf4` (QLoRA) the same three
//! steps give peft's over bitsandbytes' 4-bit base (`tests/data/qlora-tiny`), with the
//! base on the device or packed on NVMe, and resume byte for byte.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use strata_engine::model::lora::{ADAPTER_CONFIG_FILE, LoraAdapter};
use strata_engine::model::weights::load_config;

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/lora-tiny")
}

fn strata(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .output()
        .expect("the strata binary runs")
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `strata train` of the golden's three steps with `extra` flags (torch's AdamW betas,
/// no decay, no clipping, a constant rate `extra` gives).
fn train(extra: &[&str]) -> Output {
    let (base, tokens) = (data().join("base"), data().join("tokens.bin"));
    let mut args = vec![
        "train",
        "--model",
        path(&base),
        "--data",
        path(&tokens),
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "3",
        "--beta2",
        "0.999",
        "--weight-decay",
        "0",
        "--lr-schedule",
        "constant",
        "--warmup-steps",
        "0",
        "--clip",
        "0",
        "--device",
        "cpu",
        "--device-mem",
        "64MiB",
    ];
    args.extend_from_slice(extra);
    strata(&args)
}

/// The loss `strata eval` gives the first batch with `adapter` over the base.
fn eval_loss(adapter: &Path) -> f64 {
    mean_loss(
        &data().join("base"),
        Some(adapter),
        &data().join("tokens.bin"),
        1,
    )
}

/// The mean loss `strata eval` gives `model` (with `adapter` merged in, if given) over
/// the first `steps` batches of 2 x 16 of `tokens`.
fn mean_loss(model: &Path, adapter: Option<&Path>, tokens: &Path, steps: usize) -> f64 {
    mean_loss_with(model, adapter, tokens, steps, &[])
}

/// [`mean_loss`] with `extra` flags.
fn mean_loss_with(
    model: &Path,
    adapter: Option<&Path>,
    tokens: &Path,
    steps: usize,
    extra: &[&str],
) -> f64 {
    let steps = steps.to_string();
    let mut args = vec![
        "eval",
        "--model",
        path(model),
        "--data",
        path(tokens),
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        &steps,
        "--device",
        "cpu",
    ];
    if let Some(a) = adapter {
        args.extend(["--adapter", path(a)]);
    }
    args.extend_from_slice(extra);
    let out = strata(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let line = stdout
        .lines()
        .find(|l| l.starts_with("mean loss "))
        .unwrap();
    line["mean loss ".len()..].trim().parse().unwrap()
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        num += (*g as f64 - *w as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    (num / den.max(1e-300)).sqrt()
}

/// Asserts each layer's `A` and `B` of the adapter `got` within 1e-5 of `want`'s, for
/// `what`.
fn assert_adapter_near(got: &LoraAdapter, want: &LoraAdapter, what: &str) {
    for (g, w) in got.layers.iter().zip(&want.layers) {
        let (ea, eb) = (rel_err(&g.a, &w.a), rel_err(&g.b, &w.b));
        assert!(
            ea < 1e-5 && eb < 1e-5,
            "{what}, {}: A off by {ea:.2e}, B by {eb:.2e}",
            w.layer.module
        );
    }
}

/// The held-out loss of the `line`-th line (0-based) of a `--log-jsonl` file.
fn held_out_loss(log: &Path, line: usize) -> f64 {
    let text = std::fs::read_to_string(log).unwrap();
    let step: serde_json::Value = serde_json::from_str(text.lines().nth(line).unwrap()).unwrap();
    step["eval_loss"].as_f64().unwrap()
}

/// `strata train` of the golden's steps with `flags`, asserted to succeed (`what` names
/// the case): its stdout.
fn train_ok(flags: &[&str], what: &str) -> String {
    let out = train(flags);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{what}: {stderr}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Asserts that `strata train` of the golden's steps with `flags` is refused before any
/// step, naming `names`.
fn assert_refused(flags: &[&str], names: &str) {
    let out = train(flags);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{flags:?} ran");
    assert!(stderr.contains(names), "{flags:?}: {stderr}");
    assert!(!stderr.contains("step 1"), "{flags:?} stepped: {stderr}");
}

#[test]
fn three_steps_from_peft_adapter_write_peft_trained_adapter() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("adapter");
    let out = train(&[
        "--lr",
        "1e-3",
        "--init-adapter",
        path(&data().join("adapter0")),
        "--out",
        path(&out_dir),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // peft's losses: 4.888228 before the first update, 4.822094 before the third.
    assert!(stdout.contains("4.8882 -> 4.8221"), "{stdout}");
    assert!(stdout.contains("adapter: "), "{stdout}");
    let base = load_config(&data().join("base/config.json")).unwrap();
    let got = LoraAdapter::read(&out_dir, &base).unwrap();
    let want = LoraAdapter::read(&data().join("expected"), &base).unwrap();
    assert_eq!(got.config, want.config);
    assert_eq!(got.layers.len(), want.layers.len());
    assert_adapter_near(&got, &want, "peft's trained adapter");
    let (mine, peft) = (eval_loss(&out_dir), eval_loss(&data().join("expected")));
    assert!(
        ((mine - peft) / peft).abs() < 1e-5,
        "eval: {mine} with strata's adapter, {peft} with peft's"
    );
}

#[test]
fn a_fresh_adapter_starts_as_its_base_and_learns() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("adapter");
    let out = train(&[
        "--lora",
        "8",
        "--lora-alpha",
        "16",
        "--lora-targets",
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "--lr",
        "1e-2",
        "--out",
        path(&out_dir),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let base = load_config(&data().join("base/config.json")).unwrap();
    let adapter = LoraAdapter::read(&out_dir, &base).unwrap();
    assert_eq!(adapter.config.rank, 8);
    assert_eq!(adapter.layers.len(), 2 * 7);
    let config = std::fs::read_to_string(out_dir.join(ADAPTER_CONFIG_FILE)).unwrap();
    assert!(config.contains("\"peft_type\": \"LORA\""), "{config}");
    // B starts at zero, so the first loss is the base's own (eval without an adapter).
    let base_loss = mean_loss(&data().join("base"), None, &data().join("tokens.bin"), 1);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let first = format!("{base_loss:.4} -> ");
    assert!(stdout.contains(&first), "base loss {base_loss}: {stdout}");
    let trained = eval_loss(&out_dir);
    assert!(trained < base_loss, "{trained} vs the base's {base_loss}");
}

#[test]
fn what_a_lora_run_cannot_do_yet_is_refused_before_any_work() {
    let init = data().join("adapter0");
    for (flags, names) in [
        (vec!["--lora", "4", "--lora-dropout", "0.1"], "dropout"),
        (
            vec!["--init-adapter", path(&init), "--lora", "16"],
            "leave the --lora flags out",
        ),
        (
            vec!["--init-adapter", path(&data().join("base"))],
            "adapter_config.json",
        ),
    ] {
        assert_refused(&flags, names);
    }
}

/// GPT-2 too: a LoRA run on `tests/data/gpt2-tiny` writes an adapter with peft's
/// `fan_in_fan_out` for its Conv1D layers, which `strata eval --adapter` reads, and
/// which fits the data better than the base.
#[test]
fn a_gpt2_adapter_trains_and_evaluates() {
    let gpt2 = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gpt2-tiny");
    let tokens = gpt2.join("tokens.bin");
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("adapter");
    let common = [
        "--data",
        path(&tokens),
        "--batch",
        "2",
        "--seq",
        "16",
        "--device",
        "cpu",
    ];
    let mut args = vec![
        "train",
        "--model",
        path(&gpt2),
        "--lora",
        "4",
        "--lora-targets",
        "c_attn,c_proj,c_fc",
        "--steps",
        "20",
        "--lr",
        "1e-2",
        "--device-mem",
        "64MiB",
        "--out",
        path(&out_dir),
    ];
    args.extend_from_slice(&common);
    let out = strata(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let config = std::fs::read_to_string(out_dir.join(ADAPTER_CONFIG_FILE)).unwrap();
    assert!(config.contains("\"fan_in_fan_out\": true"), "{config}");
    let loss = |adapter: Option<&Path>| mean_loss(&gpt2, adapter, &tokens, 3);
    let (base, tuned) = (loss(None), loss(Some(&out_dir)));
    assert!(tuned < base, "{tuned} with the adapter, {base} without");
}

/// `--merge` writes the base with the trained adapters merged in as an ordinary model
/// folder, which evaluates as the base with peft's trained adapter does (within 1e-5);
/// without a base folder's weights it is refused before any work.
#[test]
fn merge_writes_the_base_with_the_adapters_merged_in() {
    let dir = tempfile::tempdir().unwrap();
    let merged = dir.path().join("merged");
    let out = train(&[
        "--lr",
        "1e-3",
        "--init-adapter",
        path(&data().join("adapter0")),
        "--merge",
        "--out",
        path(&merged),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(merged.join("config.json").is_file() && merged.join("model.safetensors").is_file());
    assert!(!merged.join(ADAPTER_CONFIG_FILE).exists());
    let mine = mean_loss(&merged, None, &data().join("tokens.bin"), 1);
    let peft = eval_loss(&data().join("expected"));
    assert!(
        ((mine - peft) / peft).abs() < 1e-5,
        "merged {mine}, peft's adapter {peft}"
    );
    // A preset has no weights to merge into.
    let out = strata(&[
        "train",
        "--model",
        "small",
        "--lora",
        "4",
        "--merge",
        "--out",
        path(&dir.path().join("x")),
        "--steps",
        "1",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("--merge"),
        "{stderr}"
    );
}

/// `--eval-every` on a LoRA run evaluates the base with the adapters as they stand: on
/// lora-tiny, the held-out batch (the third) after two of peft's steps has peft's loss
/// before its third update (meta.json's `losses[2]`), within 1e-5.
#[test]
fn held_out_evaluation_of_a_lora_run_gives_peft_s_loss() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log.jsonl");
    let out = train(&[
        "--lr",
        "1e-3",
        "--init-adapter",
        path(&data().join("adapter0")),
        "--eval-every",
        "2",
        "--log-jsonl",
        path(&log),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Step 2's line (the run's third step evaluates again, after an epoch's wrap).
    let got = held_out_loss(&log, 1);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data().join("meta.json")).unwrap()).unwrap();
    let want = meta["losses"][2].as_f64().unwrap();
    assert!(
        ((got - want) / want).abs() < 1e-5,
        "held-out {got}, peft's {want}"
    );
}

/// A LoRA run's checkpoint holds its adapters' state alone (with their settings), and a
/// run resumed from it continues byte for byte: three steps straight and one step then
/// two resumed write the same adapter, in host memory and with the base on NVMe; the
/// last checkpoint exported (`strata checkpoint export`) is that adapter too.
#[test]
fn a_resumed_lora_run_continues_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let nvme = dir.path().join("nvme");
    std::fs::create_dir(&nvme).unwrap();
    let init = data().join("adapter0");
    for policy in ["cpu-offload", "nvme-offload"] {
        let run = |extra: &[&str]| {
            let mut args = vec![
                "--lr",
                "1e-3",
                "--init-adapter",
                path(&init),
                "--policy",
                policy,
                "--nvme",
                path(&nvme),
            ];
            args.extend_from_slice(extra);
            train_ok(&args, policy);
        };
        let (straight, resumed) = (dir.path().join("straight"), dir.path().join("resumed"));
        let ckpts = dir.path().join(format!("ckpt-{policy}"));
        run(&["--out", path(&straight), "--overwrite"]);
        run(&["--checkpoint-every", "1", "--checkpoint-dir", path(&ckpts)]);
        let step1 = ckpts.join("step-00000001");
        assert!(step1.join(ADAPTER_CONFIG_FILE).is_file(), "{policy}");
        // The adapters' master copy, m and v: 3 x 4 bytes of 2 layers' q and v adapters.
        let held = std::fs::metadata(step1.join("model.safetensors"))
            .unwrap()
            .len();
        assert!(
            held < 16 << 10,
            "{policy}: model.safetensors of {held} bytes"
        );
        run(&[
            "--resume",
            path(&step1),
            "--out",
            path(&resumed),
            "--overwrite",
        ]);
        let bytes = |d: &Path| std::fs::read(d.join("adapter_model.safetensors")).unwrap();
        assert!(
            bytes(&straight) == bytes(&resumed),
            "{policy}: the adapters differ"
        );
        // The latest checkpoint (step 3), exported, is the straight run's adapter.
        let exported = dir.path().join(format!("exported-{policy}"));
        let out = strata(&[
            "checkpoint",
            "export",
            path(&ckpts),
            "--out",
            path(&exported),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            bytes(&straight) == bytes(&exported),
            "{policy}: the export differs"
        );
    }
}

/// `tests/data/qlora-tiny`: lora-tiny's run over its base in NF4 (peft over bitsandbytes).
fn qlora() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/qlora-tiny")
}

/// QLoRA: `--quant nf4` from peft's adapter0 gives peft's three losses over
/// bitsandbytes' 4-bit base and its trained adapter (within 1e-5), whether the base is
/// held dequantised on the device or packed on NVMe; `strata eval --quant nf4` gives
/// the trained adapter the loss it gives peft's; `--eval-every` evaluates over the
/// quantised base; a resumed QLoRA run continues byte for byte, and one resumed without
/// `--quant` is refused.
#[test]
fn qlora_steps_give_peft_over_bitsandbytes_and_resume_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let nvme = dir.path().join("nvme");
    std::fs::create_dir(&nvme).unwrap();
    let init = data().join("adapter0");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(qlora().join("meta.json")).unwrap()).unwrap();
    let base = load_config(&data().join("base/config.json")).unwrap();
    let want = LoraAdapter::read(&qlora().join("expected"), &base).unwrap();
    let quantised_loss = |adapter: &Path| {
        let tokens = data().join("tokens.bin");
        mean_loss_with(
            &data().join("base"),
            Some(adapter),
            &tokens,
            1,
            &["--quant", "nf4"],
        )
    };
    let peft = quantised_loss(&qlora().join("expected"));
    for policy in ["all-on-device", "nvme-offload"] {
        let run = |extra: &[&str]| {
            let mut args = vec![
                "--lr",
                "1e-3",
                "--init-adapter",
                path(&init),
                "--quant",
                "nf4",
                "--policy",
                policy,
                "--nvme",
                path(&nvme),
            ];
            args.extend_from_slice(extra);
            train_ok(&args, policy)
        };
        let (straight, resumed) = (dir.path().join("straight"), dir.path().join("resumed"));
        let log = dir.path().join(format!("{policy}.jsonl"));
        let stdout = run(&["--out", path(&straight), "--overwrite"]);
        // bitsandbytes' losses: 4.891380 before the first update, 4.820041 before the third.
        assert!(stdout.contains("4.8914 -> 4.8200"), "{policy}: {stdout}");
        let got = LoraAdapter::read(&straight, &base).unwrap();
        assert_adapter_near(&got, &want, policy);
        let mine = quantised_loss(&straight);
        assert!(
            ((mine - peft) / peft).abs() < 1e-5,
            "{policy}: eval {mine} vs {peft}"
        );
        // The held-out batch (the third) after two steps: peft's loss before its third.
        run(&["--eval-every", "2", "--log-jsonl", path(&log)]);
        let (held, before_third) = (held_out_loss(&log, 1), meta["losses"][2].as_f64().unwrap());
        assert!(
            ((held - before_third) / before_third).abs() < 1e-5,
            "{policy}: held-out {held}, peft's {before_third}"
        );
        let ckpts = dir.path().join(format!("ckpt-{policy}"));
        run(&["--checkpoint-every", "1", "--checkpoint-dir", path(&ckpts)]);
        let step1 = ckpts.join("step-00000001");
        run(&[
            "--resume",
            path(&step1),
            "--out",
            path(&resumed),
            "--overwrite",
        ]);
        let bytes = |d: &Path| std::fs::read(d.join("adapter_model.safetensors")).unwrap();
        assert!(
            bytes(&straight) == bytes(&resumed),
            "{policy}: the adapters differ"
        );
        // Resumed over the base unquantised: refused, naming the flag.
        let mut args = vec!["--lr", "1e-3", "--init-adapter", path(&init), "--resume"];
        args.push(path(&step1));
        let out = train(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains("--quant nf4"),
            "{stderr}"
        );
    }
}

/// A quantised base needs adapters over it, and a working dtype to dequantise into.
#[test]
fn a_quantised_base_without_adapters_or_in_fp16_is_refused_before_any_work() {
    let init = data().join("adapter0");
    for (flags, names) in [
        (vec!["--quant", "nf4"], "--lora"),
        (
            vec![
                "--quant",
                "int8",
                "--init-adapter",
                path(&init),
                "--dtype",
                "fp16",
            ],
            "bf16",
        ),
    ] {
        assert_refused(&flags, names);
    }
}
