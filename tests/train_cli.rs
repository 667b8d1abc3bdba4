//! `strata train` as a user runs it: the PyTorch reference after 3 steps, exact resume,
//! Ctrl-C, metrics and traces, and a one-line error for each kind of bad input.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use strata::engine::model::weights::load_pretrained;

fn golden() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gpt2-tiny")
}

fn strata(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .output()
        .expect("the strata binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A small run of the default job's model on the built-in corpus, in `dir`.
fn small_run<'a>(dir: &'a Path, extra: &[&'a str]) -> Vec<String> {
    let nvme = dir.join("nvme");
    std::fs::create_dir_all(&nvme).unwrap();
    let mut args: Vec<String> = ["train", "--batch", "2", "--seq", "32", "--nvme"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.push(nvme.to_str().unwrap().to_string());
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn run_ok(args: &[String]) -> Output {
    let refs: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let out = strata(&refs);
    assert!(
        out.status.success(),
        "strata {}\nstdout:\n{}\nstderr:\n{}",
        refs.join(" "),
        text(&out.stdout),
        text(&out.stderr)
    );
    out
}

/// Checks a failure is one line, on stderr, containing every one of `needles`.
fn assert_one_line_error(out: &Output, needles: &[&str]) {
    assert!(
        !out.status.success(),
        "expected a failure: {}",
        text(&out.stdout)
    );
    let stderr = text(&out.stderr);
    let error: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("strata: error:"))
        .collect();
    assert_eq!(error.len(), 1, "one error line expected:\n{stderr}");
    for n in needles {
        assert!(error[0].contains(n), "'{n}' missing from: {}", error[0]);
    }
}

#[test]
fn three_plain_adamw_steps_match_pytorch() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("final");
    let model = golden();
    let data = golden().join("tokens.bin");
    for policy in ["all-on-device", "nvme-offload"] {
        let args: Vec<String> = [
            "train",
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
            "--lr",
            "1e-3",
            "--weight-decay",
            "0.1",
            "--beta2",
            "0.999",
            "--lr-schedule",
            "constant",
            "--warmup-steps",
            "0",
            "--clip",
            "0",
            "--dtype",
            "fp32",
            "--device",
            "cpu",
            "--device-mem",
            "all",
            "--host-mem",
            "all",
            "--policy",
            policy,
            "--out",
            out_dir.to_str().unwrap(),
            // The second policy's model replaces the first's.
            "--overwrite",
            "--nvme",
            dir.path().to_str().unwrap(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        run_ok(&args);
        let (model, params) = load_pretrained(&out_dir).unwrap();
        let bytes = std::fs::read(golden().join("expected.safetensors")).unwrap();
        let expected = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (block, p) in model.blocks().iter().zip(&params) {
            for t in &block.tensors {
                let name = format!("final.transformer.{}", t.name);
                let view = expected.tensor(&name).unwrap();
                let want: Vec<f32> = view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                let got = &p[t.slot.range()];
                // The key third of c_attn.bias moves by AdamW-normalised rounding noise (its
                // exact gradient is zero): bounded by lr per step, not comparable.
                let parts: Vec<std::ops::Range<usize>> = if t.name.ends_with("c_attn.bias") {
                    let c = got.len() / 3;
                    vec![0..c, 2 * c..3 * c]
                } else {
                    std::iter::once(0..got.len()).collect()
                };
                for r in parts {
                    let (g, w) = (&got[r.clone()], &want[r]);
                    let diff: f64 = g.iter().zip(w).map(|(a, b)| f64::from(a - b).powi(2)).sum();
                    let norm: f64 = w.iter().map(|b| f64::from(*b).powi(2)).sum();
                    let rel = (diff / norm.max(1e-30)).sqrt();
                    assert!(rel < 1e-5, "{policy}: {name} rel err {rel}");
                }
            }
        }
    }
}

#[test]
fn ten_steps_equal_five_then_resume_five() {
    // With a delayed update a checkpoint applies the pending update first, so the
    // straight run checkpoints at step 5 as well. bf16 moments, kept so in the run and
    // as fp32 in the checkpoint, resume exactly too; so does an approximate backward,
    // whose sketches are drawn from the step's number.
    for (policy, delayed, state, approx) in [
        ("cpu-offload", "false", "fp32", "exact"),
        ("nvme-offload", "false", "fp32", "exact"),
        ("nvme-offload", "true", "fp32", "exact"),
        ("nvme-offload", "false", "bf16", "exact"),
        ("nvme-offload", "false", "fp32", "gelu:2,linear:0.5"),
        ("nvme-offload", "true", "fp32", "gelu:2,linear:0.5"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let p = |s: &str| dir.path().join(s).to_str().unwrap().to_string();
        let common = [
            "--delayed-update",
            delayed,
            "--checkpoint-every",
            "5",
            "--policy",
            policy,
            "--lr-schedule",
            "constant",
            "--warmup-steps",
            "2",
            "--device-mem",
            "all",
            "--host-mem",
            "all",
            "--optimizer-state",
            state,
            "--approx-backward",
            approx,
        ];
        let (ca, cb, oa, ob) = (p("ckpt-a"), p("ckpt-b"), p("out-a"), p("out-b"));
        let mut straight = small_run(dir.path(), &common);
        straight.extend(["--steps", "10", "--checkpoint-dir", &ca, "--out", &oa].map(String::from));
        let out = run_ok(&straight);
        assert_eq!(
            text(&out.stdout).contains(&format!("approximate backward: {approx}")),
            approx != "exact",
            "{}",
            text(&out.stdout)
        );
        let mut first = small_run(dir.path(), &common);
        first.extend(["--steps", "5", "--checkpoint-dir", &cb].map(String::from));
        run_ok(&first);
        let mut resumed = small_run(dir.path(), &common);
        resumed.extend(
            [
                "--steps",
                "10",
                "--resume",
                &cb,
                "--checkpoint-dir",
                &cb,
                "--out",
                &ob,
            ]
            .map(String::from),
        );
        let out = run_ok(&resumed);
        assert!(
            text(&out.stdout).contains("resuming"),
            "{}",
            text(&out.stdout)
        );
        let read = |d: &str, f: &str| std::fs::read(Path::new(d).join(f)).unwrap();
        assert!(
            read(&oa, "model.safetensors") == read(&ob, "model.safetensors"),
            "{policy}, {state} moments, {approx}: final models differ"
        );
        for file in ["model.safetensors", "optimizer.safetensors"] {
            let a = read(&ca, &format!("step-00000010/{file}"));
            let b = read(&cb, &format!("step-00000010/{file}"));
            assert!(
                a == b,
                "{policy}, {state} moments, {approx}: {file} of step 10 differs after resume"
            );
        }
    }
}

/// `--schedule vertical` trains the same model as `horizontal`, byte for byte, and the
/// plan and the summary say which order ran.
#[test]
fn the_vertical_schedule_trains_the_same_model() {
    let dir = tempfile::tempdir().unwrap();
    let mut models = Vec::new();
    for order in ["horizontal", "vertical"] {
        let out_dir = dir.path().join(order);
        let out_dir = out_dir.to_str().unwrap();
        let extra = [
            "--policy",
            "nvme-offload",
            "--grad-accum",
            "3",
            "--steps",
            "4",
            "--device-mem",
            "all",
            "--host-mem",
            "all",
            "--schedule",
            order,
            "--out",
            out_dir,
        ];
        let out = run_ok(&small_run(dir.path(), &extra));
        let stdout = text(&out.stdout);
        assert!(
            stdout.contains(&format!("schedule: {order} (each of 3 micro-batches")),
            "{stdout}"
        );
        models.push(std::fs::read(Path::new(out_dir).join("model.safetensors")).unwrap());
    }
    assert!(
        models[0] == models[1],
        "the two orders trained different models"
    );
}

/// A run killed (SIGKILL) while it writes a checkpoint a block at a time (its NVMe reads
/// slowed by injected delays, so that the save lasts long enough to be caught in) leaves
/// the previous checkpoint loadable and the new one ignored; resumed from it, the run
/// ends with parameters, m and v byte-identical to an uninterrupted run's.
#[test]
fn a_run_killed_mid_save_resumes_byte_identical() {
    let dir = tempfile::tempdir().unwrap();
    let p = |s: &str| dir.path().join(s).to_str().unwrap().to_string();
    let common = [
        "--policy",
        "nvme-offload",
        "--checkpoint-every",
        "2",
        "--lr-schedule",
        "constant",
        "--warmup-steps",
        "2",
        "--steps",
        "6",
    ];
    let (ca, cb) = (p("ckpt-a"), p("ckpt-b"));
    let mut straight = small_run(dir.path(), &common);
    straight.extend(["--checkpoint-dir", &ca].map(String::from));
    run_ok(&straight);

    let mut disturbed = small_run(dir.path(), &common);
    disturbed.extend(["--checkpoint-dir", &cb].map(String::from));
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(&disturbed)
        .env("STRATA_FAULTS", "seed=3,kinds=delay,rate=1,max-delay-ms=40")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let saving_4 = Path::new(&cb).join(format!(".step-00000004.tmp-{}", child.id()));
    let step_4 = Path::new(&cb).join("step-00000004");
    let started = std::time::Instant::now();
    while !saving_4.exists() && !step_4.exists() {
        assert!(
            started.elapsed().as_secs() < 120 && child.try_wait().unwrap().is_none(),
            "the run never started saving step 4"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    // Step 2's checkpoint is there and complete; step 4's, cut short, is not one.
    assert!(Path::new(&cb).join("step-00000002/manifest.json").is_file());
    assert!(
        !step_4.exists(),
        "step 4's folder is there after a kill inside its save (or the kill came after \
         the save; slow the reads more)"
    );

    let mut resumed = small_run(dir.path(), &common);
    resumed.extend(["--resume", &cb, "--checkpoint-dir", &cb].map(String::from));
    let out = run_ok(&resumed);
    assert!(
        text(&out.stdout).contains("resuming"),
        "{}",
        text(&out.stdout)
    );
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let read = |d: &str| std::fs::read(Path::new(d).join("step-00000006").join(file)).unwrap();
        assert!(
            read(&ca) == read(&cb),
            "{file} of step 6 differs after the kill"
        );
    }
    assert!(
        !saving_4.exists(),
        "the dead save's folder is removed by a later save"
    );
}

#[test]
fn the_default_job_offloads_to_nvme_and_its_loss_falls() {
    let dir = tempfile::tempdir().unwrap();
    let jsonl = dir.path().join("log.jsonl");
    let trace = dir.path().join("trace.json");
    let mut args = small_run(dir.path(), &[]);
    // The default job's budgets and model, fewer steps and a smaller batch.
    args.extend(
        [
            "--steps",
            "40",
            "--log-jsonl",
            jsonl.to_str().unwrap(),
            "--trace",
            trace.to_str().unwrap(),
            "--trace-step",
            "2",
        ]
        .map(String::from),
    );
    let out = run_ok(&args);
    let stdout = text(&out.stdout);
    assert!(stdout.contains("plan nvme-offload"), "{stdout}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&jsonl)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 40);
    let loss = |i: usize| lines[i]["loss"].as_f64().unwrap();
    assert!(loss(39) < loss(0) - 1.0, "loss {} -> {}", loss(0), loss(39));
    assert!(lines[0]["nvme_read_bytes"].as_u64().unwrap() > 0);
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    assert!(trace["traceEvents"].as_array().unwrap().len() > 50);
}

#[test]
fn ctrl_c_finishes_the_step_checkpoints_and_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let mut args = small_run(dir.path(), &["--steps", "100000"]);
    args.extend([
        "--checkpoint-dir".to_string(),
        ckpt.to_str().unwrap().to_string(),
    ]);
    let run = |signals: usize, extra: &[&str]| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(&args)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        while stderr.read_line(&mut line).unwrap() > 0 && !line.contains("step 1/") {
            line.clear();
        }
        for _ in 0..signals {
            // SAFETY: kill with a valid pid and signal number.
            unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let out = child.wait_with_output().unwrap();
        (out.status, text(&out.stdout))
    };
    let (status, stdout) = run(1, &[]);
    assert!(status.success(), "{status}: {stdout}");
    assert!(stdout.contains("interrupted at step"), "{stdout}");
    let saved = std::fs::read_dir(&ckpt)
        .unwrap()
        .filter_map(|e| e.ok())
        .any(|e| e.file_name().to_string_lossy().starts_with("step-"));
    assert!(saved, "no checkpoint after Ctrl-C");
    // A second Ctrl-C aborts at once, without finishing the step. Steps of 32
    // micro-batches last long enough that the second press (5 ms after the first, which
    // it must not merge with) lands while the step still runs.
    let (status, _) = run(2, &["--grad-accum", "32"]);
    assert_eq!(status.code(), Some(130), "{status}");
}

#[test]
fn a_killed_run_keeps_its_log_and_leaves_no_swap_files() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log.jsonl");
    let mut args = small_run(dir.path(), &["--steps", "100000"]);
    args.extend(["--log-jsonl".to_string(), log.to_str().unwrap().to_string()]);
    let lines = || -> Vec<serde_json::Value> {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("every line is whole JSON"))
            .collect()
    };
    /// Kills the run when dropped, so that a failed assertion leaves no run behind.
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Killed(
        Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let start = std::time::Instant::now();
    while lines().len() < 3 {
        assert!(
            start.elapsed().as_secs() < 120,
            "no 3 steps logged in 2 minutes"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // The swap files are open and in use now, yet have no name in the folder.
    let nvme = dir.path().join("nvme");
    let names = || -> Vec<String> {
        std::fs::read_dir(&nvme)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect()
    };
    assert!(names().is_empty(), "{:?}", names());
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    let logged = lines();
    assert!(logged.len() >= 3);
    for (i, line) in logged.iter().enumerate() {
        assert_eq!(line["step"], i as u64 + 1, "{line}");
    }
    assert!(names().is_empty(), "a killed run left {:?}", names());
    // The next run appends to the log.
    let mut again = small_run(dir.path(), &["--steps", "2"]);
    again.extend(["--log-jsonl".to_string(), log.to_str().unwrap().to_string()]);
    run_ok(&again);
    assert_eq!(lines().len(), logged.len() + 2);
}

#[test]
fn resume_under_other_batch_or_data_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ck");
    let mut first = small_run(dir.path(), &["--steps", "1"]);
    first.extend(["--checkpoint-dir".into(), ckpt.to_str().unwrap().into()]);
    run_ok(&first);
    let saved = ckpt.join("step-00000001");
    let data = dir.path().join("other.txt");
    std::fs::write(&data, "some other text ".repeat(200)).unwrap();
    let nvme = dir.path().join("nvme");
    let resume = |batch: &str, seq: &str, extra: &[&str]| {
        let mut args = vec!["train", "--steps", "2", "--batch", batch, "--seq", seq];
        args.extend(["--nvme", nvme.to_str().unwrap()]);
        args.extend(["--resume", saved.to_str().unwrap()]);
        args.extend(extra);
        strata(&args)
    };
    assert_one_line_error(&resume("4", "32", &[]), &["--batch 2 (now 4)"]);
    assert_one_line_error(
        &resume("2", "16", &["--data", data.to_str().unwrap()]),
        &["--seq 32 (now 16)", "--data the built-in corpus (now"],
    );
    // A step's micro-batches (N ranks with --grad-accum a are one process's N * a).
    assert_one_line_error(
        &resume("2", "32", &["--grad-accum", "2"]),
        &["--grad-accum x ranks 1 (now 2)"],
    );
    let same = resume("2", "32", &[]);
    assert!(same.status.success(), "{}", text(&same.stderr));
}

#[test]
fn checkpoint_export_writes_the_model_that_out_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let p = |s: &str| dir.path().join(s).to_str().unwrap().to_string();
    let (ckpt, out, export) = (p("ck"), p("out"), p("export"));
    let mut run = small_run(dir.path(), &["--steps", "2"]);
    run.extend(["--checkpoint-dir", &ckpt, "--out", &out].map(String::from));
    run_ok(&run);
    // The root: its latest checkpoint.
    let said = run_ok(&["checkpoint", "export", &ckpt, "--out", &export].map(String::from));
    let said = text(&said.stdout);
    assert!(said.contains("step 2, ordinary"), "{said}");
    let read = |d: &str| std::fs::read(Path::new(d).join("model.safetensors")).unwrap();
    assert!(
        read(&out) == read(&export),
        "the export is not the model --out wrote"
    );
    let bf16 = p("bf16");
    run_ok(
        &[
            "checkpoint",
            "export",
            &ckpt,
            "--out",
            &bf16,
            "--dtype",
            "bf16",
        ]
        .map(String::from),
    );
    let (model, params) = load_pretrained(Path::new(&bf16)).unwrap();
    assert_eq!(params.len(), model.blocks().len());
    let config = std::fs::read_to_string(Path::new(&bf16).join("config.json")).unwrap();
    assert!(config.contains("bfloat16"), "{config}");
    // Nothing there: one line naming the folder.
    let empty = p("empty");
    std::fs::create_dir(&empty).unwrap();
    assert_one_line_error(
        &strata(&["checkpoint", "export", &empty, "--out", &p("x")]),
        &["holds no complete checkpoint", &empty],
    );
}

#[test]
fn bad_input_gets_one_line_naming_what_to_fix() {
    let dir = tempfile::tempdir().unwrap();
    let d = |s: &str| dir.path().join(s).to_str().unwrap().to_string();
    let ckpt = d("ckpt");
    run_ok(&small_run(
        dir.path(),
        &["--steps", "2", "--checkpoint-dir", &ckpt],
    ));

    // A corrupted checkpoint.
    let weights = Path::new(&ckpt).join("step-00000002/model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&weights, &bytes).unwrap();
    let args = small_run(dir.path(), &["--steps", "4", "--resume", &ckpt]);
    let out = strata(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    assert_one_line_error(&out, &["step-00000002", "model.safetensors"]);

    // A truncated one.
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    let out = strata(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    assert_one_line_error(&out, &["model.safetensors"]);

    // A typo in the config file.
    let toml = d("train.toml");
    std::fs::write(&toml, "lerning_rate = 0.1\n").unwrap();
    assert_one_line_error(
        &strata(&["train", "--config", &toml]),
        &["train.toml", "lerning_rate", "did you mean"],
    );

    // A missing data file.
    let missing = d("nope.bin");
    assert_one_line_error(&strata(&["train", "--data", &missing]), &["nope.bin"]);

    // A budget too small for any plan.
    let args = small_run(dir.path(), &["--device-mem", "1MiB", "--steps", "1"]);
    let out = strata(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    assert_one_line_error(&out, &["device tier", "short"]);

    // Every layer's activations kept (--recompute none) where they do not fit, but
    // recomputing some would: the shortfall, what they take, and what fits, named.
    let args = small_run(
        dir.path(),
        &[
            "--policy",
            "all-on-device",
            "--device-mem",
            "18MiB",
            "--recompute",
            "none",
            "--steps",
            "1",
        ],
    );
    let out = strata(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    assert_one_line_error(
        &out,
        &[
            "device tier needs",
            "short",
            "keeping the activations of all 4 blocks (--recompute none) takes",
            "with --recompute auto it fits, recomputing",
        ],
    );

    // Compact moments under a policy that keeps the optimizer state on the device,
    // whose AdamW keeps fp32 moments: the format, and what to choose instead.
    let args = small_run(
        dir.path(),
        &[
            "--policy",
            "all-on-device",
            "--device-mem",
            "all",
            "--optimizer-state",
            "q8",
            "--steps",
            "1",
        ],
    );
    let out = strata(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    assert_one_line_error(
        &out,
        &[
            "q8 optimizer state",
            "host memory or on NVMe",
            "cpu-offload",
        ],
    );

    // A disk too small: a 13B model's NVMe-resident state against this disk's free space,
    // refused before a parameter is allocated.
    let args = small_run(
        dir.path(),
        &[
            "--model",
            "40x5120",
            "--policy",
            "nvme-offload",
            "--device-mem",
            "80GiB",
            "--host-mem",
            "40GiB",
            "--clip",
            "0",
        ],
    );
    let out = strata(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    assert_one_line_error(&out, &["nvme tier", "short"]);
}

#[test]
fn plan_and_train_say_how_many_layers_recompute() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("plan.json");
    // Between the device peaks of recomputing every layer (17.2 MiB) and none (18.7 MiB).
    let step = |host: &'static str| {
        [
            "--batch",
            "2",
            "--seq",
            "32",
            "--device-mem",
            "18MiB",
            "--host-mem",
            host,
        ]
    };
    // Per policy: (layers recomputed, layers whose activations are offloaded).
    let plan = |recompute: &str, host| -> Vec<(u64, u64)> {
        let mut args = vec!["plan", "--recompute", recompute, "--json"];
        args.push(json.to_str().unwrap());
        args.extend(step(host));
        let out = strata(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert!(
            text(&out.stdout).contains(&format!("--recompute {recompute};")),
            "{}",
            text(&out.stdout)
        );
        let answer: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let count = |p: &serde_json::Value, key: &str| p[key].as_u64().unwrap();
        answer["policies"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (count(p, "recomputed_blocks"), count(p, "offloaded_blocks")))
            .collect()
    };
    assert_eq!(plan("all", "all"), [(4, 0); 4]);
    assert_eq!(plan("none", "all"), [(0, 0); 4]);
    // Offload: no layer recomputes; all-on-device offloads all but the last layer's.
    assert_eq!(plan("offload", "all")[0], (0, 3));
    // Auto: all-on-device recomputes some of its 4 layers to fit the 18 MiB, with no
    // host room to offload them instead (with room, the rates would weigh the two, and
    // train measures its own at start where plan takes defaults).
    let no_host_room = "256KiB";
    let (auto, offloaded) = plan("auto", no_host_room)[0];
    assert!(
        (1..4).contains(&auto) && offloaded == 0,
        "{auto}, {offloaded}"
    );
    // Training prints the plan's choice.
    let train = |extra: &[&str]| {
        let mut args = small_run(dir.path(), &["--policy", "all-on-device", "--steps", "1"]);
        args.extend(extra.iter().map(|a| a.to_string()));
        text(&run_ok(&args).stdout)
    };
    let stdout = train(&["--device-mem", "18MiB", "--host-mem", no_host_room]);
    let line = format!("recompute: {auto} of 4 blocks");
    assert!(stdout.contains(&line), "{line} in\n{stdout}");
    let stdout = train(&[
        "--recompute",
        "offload",
        "--device-mem",
        "32MiB",
        "--host-mem",
        "all",
    ]);
    let line = "recompute: 0 of 4 blocks, 3 offloaded to host";
    assert!(stdout.contains(line), "{line} in\n{stdout}");
}

#[test]
fn print_config_shows_the_merged_settings() {
    let out = strata(&[
        "train",
        "--print-config",
        "--steps",
        "7",
        "--policy",
        "cpu-offload",
    ]);
    assert!(out.status.success());
    let s = text(&out.stdout);
    assert!(
        s.contains("steps = 7") && s.contains("policy = \"cpu-offload\""),
        "{s}"
    );
}

#[test]
fn plan_answers_for_a_13b_model_without_allocating() {
    let start = std::time::Instant::now();
    let out = strata(&[
        "plan",
        "--model",
        "40x5120",
        "--device-mem",
        "80GiB",
        "--host-mem",
        "256GiB",
        "--clip",
        "0",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    for policy in [
        "all-on-device",
        "cpu-offload",
        "param-offload",
        "nvme-offload",
    ] {
        assert!(s.contains(policy), "{s}");
    }
    assert!(s.contains("12.848 B params"), "{s}");
    assert!(s.contains("auto picks cpu-offload"), "{s}");
    assert!(
        start.elapsed().as_secs() < 20,
        "plan took {:?}",
        start.elapsed()
    );
}

#[test]
fn plan_takes_an_nvme_budget_writes_json_and_fails_when_nothing_fits() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("plan.json");
    // A budget far beyond this machine's drive: plan answers for the drive named.
    let out = strata(&[
        "plan",
        "--model",
        "gpt2-xl",
        "--device-mem",
        "24GB",
        "--host-mem",
        "8GiB",
        "--nvme-mem",
        "1TB",
        "--batch",
        "4",
        "--seq",
        "1024",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    assert!(s.contains("nvme 931.32 GiB (stated;"), "{s}");
    let answer: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(answer["params"], 1_557_611_200u64);
    assert_eq!(answer["budgets"]["device"], 24_000_000_000u64);
    assert_eq!(answer["budgets"]["host"], 8u64 << 30);
    assert_eq!(answer["budgets"]["nvme"], 1_000_000_000_000u64);
    let policies = answer["policies"].as_array().unwrap();
    assert_eq!(policies.len(), 4, "{answer}");
    for p in policies {
        let peak = &p["peak_bytes"];
        assert!(peak["device"].as_u64().unwrap() > 0 && p["step_seconds"].as_f64().unwrap() > 0.0);
        let fits = peak["device"].as_u64().unwrap() <= 24_000_000_000
            && peak["host"].as_u64().unwrap() <= 8 << 30
            && peak["nvme"].as_u64().unwrap() <= 1_000_000_000_000;
        assert_eq!(p["fits"].as_bool().unwrap(), fits, "{p}");
    }
    // With 8 GiB of host memory only NVMe offload fits, and auto picks it.
    let auto = answer["auto"]["policy"].as_str().unwrap();
    assert!(auto.starts_with("nvme-offload"), "{answer}");

    // Nothing fits: exit 1, every short tier named in one refusal.
    let out = strata(&[
        "plan",
        "--model",
        "gpt2",
        "--device-mem",
        "1MiB",
        "--host-mem",
        "1MiB",
        "--nvme-mem",
        "1MiB",
    ]);
    assert!(!out.status.success());
    assert!(text(&out.stdout).contains("nvme-offload(depth 2)"));
    assert_one_line_error(&out, &["no plan fits", "tier needs"]);
    // A policy short on two tiers says so in one refusal.
    let out = strata(&[
        "train",
        "--policy",
        "cpu-offload",
        "--device-mem",
        "64KiB",
        "--host-mem",
        "64KiB",
    ]);
    assert_one_line_error(&out, &["device tier needs", "and the host tier needs"]);

    // Plan's help lists plan's flags only; --print-config works.
    let help = text(&strata(&["plan", "--help"]).stdout);
    assert!(
        help.contains("--nvme-mem") && help.contains("--json") && help.contains("--recompute"),
        "{help}"
    );
    for train_only in [
        "--steps",
        "--lr",
        "--out",
        "--resume",
        "--log-jsonl",
        "--policy",
    ] {
        assert!(!help.contains(train_only), "{train_only} in {help}");
    }
    let out = strata(&[
        "plan",
        "--print-config",
        "--nvme-mem",
        "2TB",
        "--batch",
        "3",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    assert!(
        s.contains("nvme_mem = \"2TB\"") && s.contains("batch = 3"),
        "{s}"
    );
}

#[test]
fn device_cuda_without_a_gpu_is_one_line_naming_what_is_missing() {
    // No GPU is visible to the runs (hidden where there is one, so that every machine
    // checks this; scripts/gpu-check runs --device cuda where there is a GPU).
    let probe = strata::engine::kernels::cuda::probe();
    let dir = tempfile::tempdir().unwrap();
    let model = golden();
    let data = model.join("tokens.bin");
    let runs: [Vec<&str>; 3] = [
        vec!["train", "--device", "cuda", "--steps", "1"],
        vec![
            "bench", "step", "--device", "cuda", "--model", "tiny", "--steps", "1",
        ],
        vec![
            "eval",
            "--device",
            "cuda",
            "--model",
            model.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--batch",
            "2",
            "--seq",
            "16",
        ],
    ];
    for args in runs {
        let mut args = args;
        let nvme = dir.path().to_str().unwrap();
        if args[0] != "eval" {
            args.extend(["--nvme", nvme]);
        }
        let out = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(&args)
            .env("CUDA_VISIBLE_DEVICES", "")
            .output()
            .expect("the strata binary runs");
        // The refusal names what is missing, never an unbuilt feature.
        assert_one_line_error(&out, &["CUDA is not usable here"]);
        let stderr = text(&out.stderr);
        assert!(
            !stderr.contains("not built"),
            "{}: {stderr}",
            args.join(" ")
        );
        let missing = !probe.driver || !probe.nvrtc || !probe.cublas;
        assert!(
            !missing || stderr.contains("could not be loaded"),
            "{}: {stderr}",
            args.join(" ")
        );
    }
}
