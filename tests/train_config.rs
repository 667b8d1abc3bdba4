//! `strata train`'s settings as a user meets them: a TOML file and flags merged over the
//! defaults, `--print-config` output read back, and the one-line errors, word for word.

use std::fs;
use std::path::{Path, PathBuf};

use clap::Parser;
use strata::engine::device::DeviceChoice;
use strata::engine::plan::{BuiltinPolicy, PolicyChoice, Recompute};
use strata::size::MemBudget;
use strata::train_config::{ConfigError, Dtype, LrSchedule, Origin, TrainArgs, TrainConfig};

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    train: TrainArgs,
}

fn args(flags: &[&str]) -> TrainArgs {
    let argv = std::iter::once("train").chain(flags.iter().copied());
    Cli::try_parse_from(argv).expect("flags parse").train
}

/// `text` as `train.toml` in a fresh directory, which the guard keeps alive.
fn config_file(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("train.toml");
    fs::write(&path, text).expect("write config");
    (dir, path)
}

/// The error resolving `flags` after `--config <file holding text>`, as displayed.
fn error(text: &str, flags: &[&str]) -> (String, PathBuf) {
    let (_dir, path) = config_file(text);
    let config = path.to_str().expect("UTF-8 path");
    let mut all = vec!["--config", config];
    all.extend_from_slice(flags);
    let e = args(&all).resolve().expect_err("refused");
    let message = e.to_string();
    assert!(!message.contains('\n'), "not one line: {message}");
    (message, path)
}

#[test]
fn defaults_then_file_then_flags() {
    let (_dir, path) =
        config_file("steps = 50\nlr = 0.01\nbatch = 4\ndtype = \"bf16\"\nrecompute = \"none\"\n");
    let nvme = tempfile::tempdir().expect("temp dir");
    let config = args(&[
        "--config",
        path.to_str().expect("UTF-8"),
        "--steps",
        "7",
        "--nvme",
        nvme.path().to_str().expect("UTF-8"),
        "--delayed-update",
        "--recompute",
        "all",
    ])
    .resolve()
    .expect("valid");
    let expected = TrainConfig {
        steps: 7,
        lr: 0.01,
        batch: 4,
        dtype: Dtype::Bf16,
        nvme: vec![nvme.path().to_path_buf()],
        delayed_update: true,
        recompute: Recompute::All,
        ..TrainConfig::default()
    };
    assert_eq!(config, expected);
    assert_eq!(config.seq, 64, "untouched by both: the default");
}

#[test]
fn no_file_no_flags_is_the_default_job() {
    let config = args(&[]).resolve().expect("valid");
    assert_eq!(config, TrainConfig::default());
    assert_eq!(config.model, "small");
    assert_eq!(config.data, None);
    assert_eq!(config.device_mem.bytes(), Some(16 << 20));
    assert_eq!(config.host_mem.bytes(), Some(8 << 20));
    assert_eq!((config.steps, config.batch, config.seq), (600, 8, 64));
    assert_eq!(config.lr_schedule, LrSchedule::Cosine);
}

#[test]
fn a_flag_fixes_a_bad_value_in_the_file() {
    let (_dir, path) = config_file("batch = 0\n");
    let config = args(&["--config", path.to_str().expect("UTF-8"), "--batch", "2"])
        .resolve()
        .expect("the flag wins before checking");
    assert_eq!(config.batch, 2);
}

#[test]
fn delayed_update_flag_forms() {
    let (_dir, path) = config_file("delayed_update = true\n");
    let file = path.to_str().expect("UTF-8");
    let on = args(&["--config", file]).resolve().expect("valid");
    assert!(on.delayed_update);
    let off = args(&["--config", file, "--delayed-update=false"])
        .resolve()
        .expect("valid");
    assert!(!off.delayed_update);
    assert!(args(&["--print-config"]).print_config);
}

fn round_trip(config: &TrainConfig) {
    let printed = config.to_toml();
    let (_dir, path) = config_file(&printed);
    let read = TrainConfig::load(&path).expect("printed config loads");
    assert_eq!(&read, config, "printed:\n{printed}");
    let resolved = args(&["--config", path.to_str().expect("UTF-8")])
        .resolve()
        .expect("resolves");
    assert_eq!(&resolved, config);
}

#[test]
fn print_config_reads_back_equal() {
    round_trip(&TrainConfig::default());
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("tokens.txt");
    fs::write(&data, "hello").expect("write data");
    let resume = dir.path().join("ck");
    fs::create_dir(&resume).expect("mkdir");
    round_trip(&TrainConfig {
        data: Some(data),
        device_mem: MemBudget::All,
        host_mem: "1.5GiB".parse().expect("a size"),
        nvme: vec![dir.path().to_path_buf(), resume.clone()],
        policy: PolicyChoice::Builtin(BuiltinPolicy::NvmeOffload),
        prefetch: Some(3),
        recompute: Recompute::None,
        lr: 6e-4,
        lr_schedule: LrSchedule::Constant,
        min_lr_ratio: 0.0,
        eps: 1e-12,
        clip: 0.0,
        dtype: Dtype::Fp16,
        seed: u64::MAX >> 1,
        delayed_update: true,
        device: DeviceChoice::Cpu,
        checkpoint_dir: Some(dir.path().join("out ck")),
        out: Some("model-out".into()),
        log_jsonl: Some("log.jsonl".into()),
        trace: Some("trace.json".into()),
        trace_step: 120,
        resume: Some(resume),
        ..TrainConfig::default()
    });
}

#[test]
fn print_config_shows_every_key_with_help() {
    let printed = TrainConfig::default().to_toml();
    for key in [
        "model",
        "data",
        "device_mem",
        "host_mem",
        "nvme",
        "policy",
        "prefetch",
        "recompute",
        "steps",
        "batch",
        "seq",
        "grad_accum",
        "lr",
        "lr_schedule",
        "warmup_steps",
        "min_lr_ratio",
        "weight_decay",
        "beta1",
        "beta2",
        "eps",
        "clip",
        "dtype",
        "seed",
        "delayed_update",
        "device",
        "checkpoint_dir",
        "checkpoint_every",
        "keep_checkpoints",
        "out",
        "log_jsonl",
        "trace",
        "trace_step",
        "resume",
        "eval_every",
    ] {
        let set = format!("\n{key} = ");
        let unset = format!("\n# {key} = ");
        assert!(
            printed.contains(&set) || printed.contains(&unset),
            "`{key}` missing from:\n{printed}"
        );
    }
    assert!(printed.contains("\nmodel = \"small\"\n"));
    assert!(printed.contains("\n# data = \"PATH\"  (not set)\n"));
    assert!(printed.contains("\n# Optimizer steps [default: 600]\nsteps = 600\n"));
    assert!(printed.contains("\neps = 1e-8\n"));
    assert!(printed.contains("\nhost_mem = \"8MiB\"\n"));
    assert!(
        printed.lines().all(|l| l.len() <= 100),
        "a long line in:\n{printed}"
    );
}

#[test]
fn unknown_key_suggests_the_right_one() {
    let (message, path) = error("lerning_rate = 0.1\n", &[]);
    assert_eq!(
        message,
        format!(
            "{}: unknown key `lerning_rate`; did you mean `lr`? \
             (strata train --print-config lists every key)",
            path.display()
        )
    );
    let (message, path) = error("[optimizer]\nlr = 0.1\n", &[]);
    assert_eq!(
        message,
        format!(
            "{}: unknown key `optimizer` (strata train --print-config lists every key)",
            path.display()
        )
    );
}

#[test]
fn wrong_types_say_what_to_write() {
    let cases = [
        (
            "batch = \"8\"",
            "`batch` must be a whole number, 0 or more, not the string \"8\"",
        ),
        (
            "steps = -3",
            "`steps` must be a whole number, 0 or more, not the integer -3",
        ),
        (
            "lr = \"fast\"",
            "`lr` must be a number, not the string \"fast\"",
        ),
        (
            "lr_schedule = \"linear\"",
            "`lr_schedule` must be one of \"constant\", \"cosine\", not the string \"linear\"",
        ),
        (
            "nvme = \"/mnt/a\"",
            "`nvme` must be an array of paths, such as [\"/mnt/nvme0\"], not the string \"/mnt/a\"",
        ),
        (
            "delayed_update = 1",
            "`delayed_update` must be true or false, not the integer 1",
        ),
        (
            "device_mem = 4096",
            "`device_mem` must be a size string, such as \"48MiB\", or \"all\", not the integer 4096",
        ),
    ];
    for (text, expected) in cases {
        let (message, path) = error(text, &[]);
        assert_eq!(
            message,
            format!("{}: {expected}", path.display()),
            "for {text}"
        );
    }
}

#[test]
fn bad_sizes_from_file_and_flag() {
    let (message, path) = error("device_mem = \"48 parsecs\"\n", &[]);
    assert_eq!(
        message,
        format!(
            "{}: `device_mem` is not a size: unknown unit 'parsecs' in '48 parsecs' \
             (examples: 4096, 64KiB, 1MiB, 4GiB, 500GB)",
            path.display()
        )
    );
    // A flag's size is read where clap reads the flag: its error names the flag and says
    // the same about the value.
    let e = Cli::try_parse_from(["train", "--host-mem", "lots"]).expect_err("refused");
    let message = e.to_string();
    assert!(
        message.contains(
            "invalid value 'lots' for '--host-mem <SIZE>': 'lots' is not a number with an \
             optional unit (examples: 4096, 64KiB, 1MiB, 4GiB, 500GB)"
        ),
        "{message}"
    );
    let unlimited = args(&["--device-mem", "all"]).resolve().expect("valid");
    assert_eq!(unlimited.device_mem, MemBudget::All);
    let e = args(&["--device-mem", "0"]).resolve().expect_err("refused");
    assert_eq!(
        e.to_string(),
        "--device-mem must be more than 0 bytes (found 0)"
    );
}

#[test]
fn invalid_values_name_their_origin() {
    let e = args(&["--batch", "0"]).resolve().expect_err("refused");
    assert_eq!(e.to_string(), "--batch must be at least 1 (found 0)");
    let e = args(&["--lr", "-0.5"]).resolve().expect_err("refused");
    assert_eq!(
        e.to_string(),
        "--lr must be a positive number, such as 3e-3 (found -0.5)"
    );
    let e = args(&["--grad-accum", "0"]).resolve().expect_err("refused");
    assert_eq!(e.to_string(), "--grad-accum must be at least 1 (found 0)");
    let e = args(&["--beta2", "1"]).resolve().expect_err("refused");
    assert_eq!(
        e.to_string(),
        "--beta2 must be a number from 0 up to, not including, 1 (found 1)"
    );

    let (message, path) = error("seq = 0\n", &[]);
    assert_eq!(
        message,
        format!("{}: `seq` must be at least 1 (found 0)", path.display())
    );
    let (message, path) = error("policy = \"fast\"\n", &[]);
    assert_eq!(
        message,
        format!(
            "{}: `policy` must be one of auto, all-on-device, cpu-offload, param-offload, \
             nvme-offload (found \"fast\")",
            path.display()
        )
    );
    let (message, path) = error("min_lr_ratio = nan\n", &[]);
    assert_eq!(
        message,
        format!(
            "{}: `min_lr_ratio` must be a number from 0 to 1 (found NaN)",
            path.display()
        )
    );
    let (message, path) = error("model = \"smal\"\n", &[]);
    assert_eq!(
        message,
        format!(
            "{}: `model` must be a preset (tiny, small, gpt2, gpt2-medium, gpt2-large, \
             gpt2-xl, llama-3-8b, llama-3.1-8b, llama-3-70b, llama-3.2-1b, llama-3.2-3b, qwen2.5-0.5b, \
             qwen2.5-1.5b, qwen2.5-3b, qwen2.5-7b, qwen3-8b, mistral-7b), a shape \
             LAYERSxWIDTH (such as 40x5120), or a directory holding config.json and \
             model.safetensors, or only a config.json for a shape without weights (found \
             \"smal\")",
            path.display()
        )
    );
    // A cross-key check blames the key it names, from wherever that came.
    let (message, path) = error("trace_step = 700\n", &["--trace", "t.json"]);
    assert_eq!(
        message,
        format!(
            "{}: `trace_step` must be a step of the run, from 1 to steps = 600 (found 700)",
            path.display()
        )
    );
    let config = TrainConfig {
        keep_checkpoints: 0,
        ..TrainConfig::default()
    };
    match config.validate() {
        Err(ConfigError::Invalid {
            origin: Origin::Default,
            key: "keep_checkpoints",
            ..
        }) => {}
        other => panic!("expected keep_checkpoints refused, got {other:?}"),
    }
}

#[test]
fn paths_that_must_exist() {
    let missing = Path::new("/nonexistent/strata/tokens.bin");
    let e = args(&["--data", missing.to_str().expect("UTF-8")])
        .resolve()
        .expect_err("refused");
    assert_eq!(
        e.to_string(),
        "--data names /nonexistent/strata/tokens.bin, which is not a file; give a token \
         file (llm.c *.bin), text or JSON lines, or leave it unset for the built-in corpus"
    );
    let e = args(&["--nvme", "/nonexistent/nvme"])
        .resolve()
        .expect_err("refused");
    assert!(
        e.to_string()
            .starts_with("--nvme names /nonexistent/nvme, which is not a directory")
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let e = args(&["--model", dir.path().to_str().expect("UTF-8")])
        .resolve()
        .expect_err("refused");
    assert!(e.to_string().contains("but it has no config.json"), "{e}");

    // What a Hugging Face folder holds decides the message: an unsupported family first,
    // then pickled or sharded weights, each with what to do.
    let model = |dir: &Path| {
        args(&["--model", dir.to_str().expect("UTF-8")])
            .resolve()
            .expect_err("refused")
            .to_string()
    };
    let falcon = tempfile::tempdir().expect("temp dir");
    fs::write(
        falcon.path().join("config.json"),
        r#"{"model_type": "falcon", "architectures": ["FalconForCausalLM"]}"#,
    )
    .expect("write");
    let e = model(falcon.path());
    assert!(
        e.contains(
            "model_type is `falcon` (FalconForCausalLM); strata runs these families: gpt2, \
             llama, mistral, qwen2, qwen3"
        ),
        "{e}"
    );
    // A Llama config.json that lacks a number says which.
    let llama = tempfile::tempdir().expect("temp dir");
    fs::write(
        llama.path().join("config.json"),
        r#"{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}"#,
    )
    .expect("write");
    let e = model(llama.path());
    assert!(e.contains("has no `hidden_size`"), "{e}");
    // A folder of only a (complete) config.json is a shape without weights.
    fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/llama-tiny/config.json"),
        llama.path().join("config.json"),
    )
    .expect("copy");
    args(&["--model", llama.path().to_str().expect("UTF-8")])
        .resolve()
        .expect("a config.json alone is a shape");
    let gpt2 = tempfile::tempdir().expect("temp dir");
    fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gpt2-tiny/config.json"),
        gpt2.path().join("config.json"),
    )
    .expect("copy");
    fs::write(gpt2.path().join("pytorch_model.bin"), b"pickle").expect("write");
    let e = model(gpt2.path());
    assert!(
        e.contains("pytorch_model.bin, a pickle") && e.contains("save_pretrained"),
        "{e}"
    );
}

#[test]
fn missing_file_and_bad_toml() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("nope.toml");
    let e = args(&["--config", path.to_str().expect("UTF-8")])
        .resolve()
        .expect_err("refused");
    assert_eq!(
        e.to_string(),
        format!(
            "{}: no such config file; check the --config path \
             (strata train --print-config > train.toml writes one)",
            path.display()
        )
    );
    let (message, path) = error("steps = 10\nbatch = = 3\n", &[]);
    let prefix = format!("{}:2:", path.display());
    assert!(message.starts_with(&prefix), "{message}");
    assert!(message.contains("not valid TOML"), "{message}");
    let (message, _) = error("steps = 10\nsteps = 11\n", &[]);
    assert!(message.contains(":2:"), "{message}");
}

#[test]
fn clap_refuses_unknown_names() {
    let e = Cli::try_parse_from(["train", "--policy", "fast"]).expect_err("refused");
    assert!(e.to_string().contains("nvme-offload"), "{e}");
    let e = Cli::try_parse_from(["train", "--dtype", "fp8"]).expect_err("refused");
    assert!(e.to_string().contains("bf16"), "{e}");
}

#[test]
fn warmup_longer_than_the_run_is_fine() {
    let config = args(&["--steps", "5", "--warmup-steps", "10"])
        .resolve()
        .expect("valid");
    assert!((config.lr_at(5) - config.lr * 0.5).abs() < 1e-15);
}

#[test]
fn lr_schedule_values() {
    let constant = TrainConfig {
        lr: 0.01,
        lr_schedule: LrSchedule::Constant,
        warmup_steps: 0,
        ..TrainConfig::default()
    };
    for step in [0, 1, 2, 60, 120, 1000] {
        assert_eq!(constant.lr_at(step), 0.01, "step {step}");
    }
    let cosine = TrainConfig {
        lr: 0.01,
        steps: 100,
        warmup_steps: 0,
        min_lr_ratio: 0.0,
        ..TrainConfig::default()
    };
    assert_eq!(cosine.lr_at(0), 0.01);
    assert!((cosine.lr_at(50) - 0.005).abs() < 1e-15);
    assert!((cosine.lr_at(25) - 0.01 * (0.5 + 0.5 * 0.5f64.sqrt())).abs() < 1e-15);
    assert_eq!(cosine.lr_at(100), 0.0);
    // The default job: warmup of 10 to the peak, then down to a tenth at step 600.
    let job = TrainConfig::default();
    assert!((job.lr_at(1) - job.lr / 10.0).abs() < 1e-15);
    assert_eq!(job.lr_at(10), job.lr);
    assert!((job.lr_at(600) - job.lr * 0.1).abs() < 1e-15);
}
