//! `strata bench step` as a user runs it, on a tiny model: every policy's row and JSON,
//! the scale run, and its errors.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const TINY: [&str; 14] = [
    "--layers", "2", "--heads", "2", "--width", "32", "--vocab", "64", "--ctx", "32", "--batch",
    "2", "--seq", "16",
];

fn strata() -> Command {
    Command::new(env!("CARGO_BIN_EXE_strata"))
}

/// A folder on the build's filesystem, not tmpfs: the NVMe tier needs O_DIRECT.
fn scratch() -> tempfile::TempDir {
    let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(&base).unwrap();
    tempfile::tempdir_in(base).unwrap()
}

/// Runs `command` with `--json json`, asserts it succeeded, and returns its stdout and
/// the JSON it wrote.
fn run_with_json(command: &mut Command, json: &Path) -> (String, serde_json::Value) {
    let out = command.arg("--json").arg(json).output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let report = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    (stdout, report)
}

/// `strata bench step` on [`TINY`] for 2 steps without warm-up, with `extra` arguments
/// and its NVMe tier in `dir`: its stdout and JSON (written to `dir`).
fn tiny_step(dir: &Path, extra: &[&str]) -> (String, serde_json::Value) {
    run_with_json(
        strata()
            .args(["bench", "step", "--steps", "2", "--warmup", "0"])
            .args(TINY)
            .args(extra)
            .arg("--nvme")
            .arg(dir),
        &dir.join("step.json"),
    )
}

/// Runs `command`, asserts it failed, and returns its stderr.
fn failure(command: &mut Command) -> String {
    let out = command.output().unwrap();
    let (_, stderr) = text(&out);
    assert!(
        !out.status.success(),
        "expected a failure; stderr:\n{stderr}"
    );
    stderr
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn every_policy_has_a_row_and_json() {
    let dir = scratch();
    let json = dir.path().join("step.json");
    let trace = dir.path().join("trace.json");
    let svg = dir.path().join("step.svg");
    let out = strata()
        .args(["bench", "step", "--steps", "2"])
        .args(TINY)
        .arg("--nvme")
        .arg(dir.path())
        .arg("--json")
        .arg(&json)
        .arg("--trace")
        .arg(&trace)
        .arg("--svg")
        .arg(&svg)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let names = [
        "all-on-device",
        "cpu-offload",
        "param-offload(depth 2)",
        "nvme-offload(depth 2)",
    ];
    for name in names {
        assert!(
            stdout.lines().filter(|l| l.starts_with(name)).count() == 3,
            "{name}: a row in the time, the memory and the bytes-per-token tables:\n{stdout}"
        );
    }
    assert!(stdout.contains("interleaved"), "{stdout}");
    assert!(stdout.contains("(invariant 1): yes"), "{stdout}");

    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(report["machine"]["cores"].as_u64().unwrap() >= 1);
    assert!(!report["machine"]["cpu"].as_str().unwrap().is_empty());
    assert_eq!(report["losses_identical"], true);
    let policies = report["policies"].as_array().unwrap();
    let got: Vec<&str> = policies
        .iter()
        .map(|p| p["policy"].as_str().unwrap())
        .collect();
    assert_eq!(got, names);
    for p in policies {
        assert_eq!(p["steps"].as_array().unwrap().len(), 2, "{p}");
        assert_eq!(p["warmup"].as_array().unwrap().len(), 1, "{p}");
        assert!(p["step_s_median"].as_f64().unwrap() > 0.0);
        assert!(p["tokens_per_s"].as_f64().unwrap() > 0.0);
        assert!(p["overlap_efficiency_vs_all_on_device"].as_f64().unwrap() > 0.0);
        assert!(p["predicted"]["step_seconds"].as_f64().unwrap() > 0.0);
        // Invariant 2, as the bench sees it: measured peaks stay within the plan.
        for tier in 0..2 {
            let measured = p["peak_measured"][tier].as_u64().expect("peak_measured");
            assert!(measured <= p["peak_planned"][tier].as_u64().expect("peak_planned"));
        }
    }
    let nvme = &policies[3];
    assert!(
        nvme["link_bytes_per_step"][0].as_u64().unwrap() > 0,
        "nvme reads"
    );
    // Everything on the device: the host sends only the batch, 2 x 16 token ids and as
    // many targets of 4 bytes, and nothing comes back but the losses (2 x 16 x 4 bytes)
    // and the gradient statistics of the 4 blocks (16 bytes each).
    assert_eq!(
        policies[0]["link_bytes_per_step"][2],
        2 * 2 * 16 * 4,
        "only tokens and targets go to the device"
    );
    assert_eq!(
        policies[0]["link_bytes_per_step"][3],
        2 * 16 * 4 + 4 * 16,
        "only the losses and gradient statistics come back"
    );
    // Per token: the same bytes over the step's 2 x 16 tokens.
    assert_eq!(
        policies[0]["link_bytes_per_token"][2].as_f64().unwrap(),
        (2 * 2 * 16 * 4) as f64 / 32.0
    );

    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let pids: std::collections::BTreeSet<u64> =
        events.iter().map(|e| e["pid"].as_u64().unwrap()).collect();
    assert_eq!(pids.len(), 4, "a process per policy");
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert_eq!(svg.matches("<polyline").count(), 4);
    // The swap files are gone; the three outputs are left.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 3);
}

#[test]
fn recompute_all_and_none_run_side_by_side_and_compare() {
    let dir = scratch();
    let (stdout, report) = tiny_step(
        dir.path(),
        &[
            "--policies",
            "all-on-device,cpu-offload",
            "--recompute",
            "all,none",
        ],
    );
    assert!(stdout.contains("(invariant 1): yes"), "{stdout}");
    let runs: Vec<(&str, &str, &str)> = report["policies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["policy"].as_str().unwrap(),
                p["recompute"].as_str().unwrap(),
                p["recomputed"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        runs,
        [
            ("all-on-device", "all", "2 of 2 blocks"),
            ("all-on-device", "none", "0 of 2 blocks"),
            ("cpu-offload", "all", "2 of 2 blocks"),
            ("cpu-offload", "none", "0 of 2 blocks"),
        ]
    );
    let compared = report["recompute"].as_array().unwrap();
    assert_eq!(compared.len(), 2, "{report}");
    for (c, policy) in compared.iter().zip(["all-on-device", "cpu-offload"]) {
        assert_eq!(c["policy"], policy);
        let (all, none) = (
            c["tokens_per_s_recompute_all"].as_f64().unwrap(),
            c["tokens_per_s_recompute_none"].as_f64().unwrap(),
        );
        assert!(all > 0.0 && none > 0.0, "{c}");
        assert!((c["none_over_all"].as_f64().unwrap() - none / all).abs() < 1e-9);
        let peaks = &c["device_peak_planned"];
        let peak = |i: usize| {
            peaks[i]
                .as_u64()
                .unwrap_or_else(|| panic!("no peak {i}: {c}"))
        };
        assert!(peak(1) > peak(0), "{c}");
        assert!(
            stdout.contains(&format!("{policy}: keeping every layer's activations")),
            "{stdout}"
        );
    }
}

/// `--schedule horizontal,vertical`: each policy runs in both orders of its
/// micro-batches, interleaved, with the same losses; vertically nvme-offload reads less
/// from NVMe per token, as the tier counted it.
#[test]
fn both_orders_of_the_micro_batches_run_side_by_side_and_compare() {
    let dir = scratch();
    let (stdout, report) = tiny_step(
        dir.path(),
        &[
            "--grad-accum",
            "4",
            "--policies",
            "nvme-offload",
            "--schedule",
            "horizontal,vertical",
        ],
    );
    assert!(stdout.contains("(invariant 1): yes"), "{stdout}");
    let orders: Vec<(&str, &str)> = report["policies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["schedule"].as_str().unwrap(),
                p["micro_batch_order"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        orders,
        [("horizontal", "horizontal"), ("vertical", "vertical")]
    );
    let compared = report["micro_batch_order"].as_array().unwrap();
    assert_eq!(compared.len(), 1, "{report}");
    let c = &compared[0];
    assert_eq!(c["losses_identical"], true, "{c}");
    let read = |i: usize| c["link_bytes_per_token"][i][0].as_f64().unwrap();
    assert!(read(1) < read(0), "{c}");
    assert!((c["nvme_read_ratio"].as_f64().unwrap() - read(1) / read(0)).abs() < 1e-9);
    assert!(
        stdout.contains("vertical reads ") && stdout.contains("per token from NVMe"),
        "{stdout}"
    );
}

#[test]
fn kernels_shows_where_each_step_went_against_the_products_alone() {
    let dir = scratch();
    let (stdout, report) = tiny_step(
        dir.path(),
        &[
            "--policies",
            "all-on-device,cpu-offload",
            "--recompute",
            "none",
            "--kernels",
        ],
    );
    assert!(stdout.contains("kernel by kernel"), "{stdout}");
    assert!(stdout.contains("its products' time"), "{stdout}");
    // The products of one step of TINY, counted here: each linear layer's forward,
    // input gradient and weight gradient at 2 x 16 rows, 2 * rows * in * out each.
    let rows = 2.0 * 16.0;
    let linear = |inputs: f64, outputs: f64| 2.0 * rows * inputs * outputs;
    let layer = linear(32.0, 96.0) + linear(32.0, 32.0) + linear(32.0, 128.0) + linear(128.0, 32.0);
    let head = linear(32.0, 64.0);
    let expected_gflop = 3.0 * (2.0 * layer + head) / 1e9;
    let profiles = report["compute_profiles"].as_array().unwrap();
    assert_eq!(profiles.len(), 2, "{report}");
    for p in profiles {
        let products = &p["classes"][0];
        assert_eq!(products["name"], "products", "{p}");
        let gflop = products["gflop"].as_f64().unwrap();
        assert!(
            (gflop - expected_gflop).abs() < 1e-12,
            "{gflop} GFLOP of products, expected {expected_gflop}"
        );
        // Forward, input gradient and weight gradient of 4 linear layers in 2 blocks and
        // the head: 9 matmul kernels forward, 9 backward (each computes both gradients).
        let calls = |name: &str| {
            p["kernels"]
                .as_array()
                .unwrap()
                .iter()
                .find(|k| k["name"] == name)
                .map(|k| k["calls"].as_u64().unwrap())
        };
        assert_eq!(
            (calls("matmul"), calls("matmul-backward")),
            (Some(9), Some(9)),
            "{p}"
        );
        let step = p["step_s"].as_f64().unwrap();
        let classes: f64 = (0..3)
            .map(|i| p["classes"][i]["seconds"].as_f64().unwrap())
            .sum();
        assert!(
            (classes - p["kernels_s"].as_f64().unwrap()).abs() < 1e-9,
            "{p}"
        );
        assert!(
            step > 0.0 && p["step_over_products"].as_f64().unwrap() > 0.0,
            "{p}"
        );
        assert!(
            p["gemm_alone"]["gflop_per_s"].as_f64().unwrap() > 0.0,
            "{p}"
        );
    }
}

#[test]
fn a_policy_over_budget_is_skipped_with_its_refusal() {
    let dir = scratch();
    let out = strata()
        .args(["bench", "step", "--steps", "1", "--warmup", "0"])
        .args(TINY)
        .args([
            "--policies",
            "all-on-device,cpu-offload",
            "--device-mem",
            "400KiB",
        ])
        .arg("--nvme")
        .arg(dir.path())
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stdout.contains("all-on-device: skipped: plan all-on-device does not fit"),
        "{stdout}"
    );
    assert!(stdout.lines().any(|l| l.starts_with("cpu-offload")));
}

/// `bench step --scale` for 3 steps of a 16-layer model 32 wide (18 blocks), batch
/// 2 x 16: small enough for a test, with a training state of a few MiB.
const SCALE_RUN: [&str; 19] = [
    "bench", "step", "--scale", "--steps", "3", "--layers", "16", "--heads", "2", "--width", "32",
    "--vocab", "64", "--ctx", "32", "--batch", "2", "--seq", "16",
];

#[test]
fn scale_run_trains_a_model_twice_the_host_budget() {
    let dir = scratch();
    let json = dir.path().join("scale.json");
    let (_, report) = run_with_json(
        strata()
            .args(SCALE_RUN)
            .args(["--host-mem", "1.5MiB", "--nvme"])
            .arg(dir.path()),
        &json,
    );
    let host_budget = report["host_budget_bytes"].as_u64().unwrap();
    assert_eq!(host_budget, 3 << 19);
    assert!(report["state_bytes"].as_u64().unwrap() >= 2 * host_budget);
    assert!(report["peak_planned"][1].as_u64().unwrap() <= host_budget);
    assert!(report["peak_measured"][1].as_u64().unwrap() <= host_budget);
    // The process's resident peak (VmHWM), within its planned process memory and 2%.
    let process = &report["process"];
    let total = process["total_bytes"].as_u64().unwrap();
    let allowed = total + process["planned_bytes"].as_u64().unwrap() * 2 / 100;
    let rss = report["peak_rss_bytes"].as_u64().unwrap();
    assert!(
        rss > 0 && rss <= allowed,
        "VmHWM {rss} B, allowed {allowed} B"
    );
    let losses: Vec<f64> = report["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_f64().unwrap())
        .collect();
    assert_eq!(losses.len(), 3);
    assert!(losses[2] < losses[0], "{losses:?}");
    assert!(report["tokens_per_s"].as_f64().unwrap() > 0.0);
}

/// With clipping, a host budget too small to hold every gradient for the norm: they wait
/// on NVMe (`--spill-grads auto`), and the run fits; never spilling is refused, saying so.
#[test]
fn scale_run_with_clipping_spills_gradients_when_the_host_needs_it() {
    let dir = scratch();
    let json = dir.path().join("scale.json");
    let args = |c: &mut Command| {
        c.args(SCALE_RUN)
            .args(["--host-mem", "1MiB", "--clip", "1.0", "--nvme"])
            .arg(dir.path());
    };
    let mut spilled = strata();
    args(&mut spilled);
    let (stdout, report) = run_with_json(&mut spilled, &json);
    assert!(stdout.contains("waiting for the norm on NVMe"), "{stdout}");
    assert_eq!(report["clip"].as_f64(), Some(1.0));
    // Every block: 16 layers, the embedding and the head.
    assert_eq!(report["grads_spilled_blocks"].as_u64(), Some(18));
    let host_budget = report["host_budget_bytes"].as_u64().unwrap();
    assert!(report["peak_planned"][1].as_u64().unwrap() <= host_budget);
    assert!(report["peak_measured"][1].as_u64().unwrap() <= host_budget);
    let losses = report["losses"].as_array().unwrap();
    let loss = |i: usize| losses[i].as_f64().expect("a loss");
    assert!(loss(2) < loss(0), "{losses:?}");

    let mut held = strata();
    args(&mut held);
    let stderr = failure(held.args(["--spill-grads", "never"]));
    assert!(
        stderr.contains("host") && stderr.contains("--spill-grads auto"),
        "{stderr}"
    );
}

#[test]
fn a_llama_family_model_runs_every_policy_with_the_same_losses() {
    let dir = scratch();
    let (stdout, report) = run_with_json(
        strata()
            .args([
                "bench", "step", "--family", "llama", "--seq", "16", "--batch", "2",
            ])
            .args(["--steps", "1", "--warmup", "1"])
            .args(["--policies", "all-on-device,nvme-offload"])
            .arg("--nvme")
            .arg(dir.path()),
        &dir.path().join("step.json"),
    );
    assert!(
        stdout.contains("bench step: llama custom (2 layers"),
        "{stdout}"
    );
    let model = &report["model"];
    assert_eq!(model["family"], "llama");
    assert_eq!(model["kv_heads"], 2);
    assert_eq!(model["intermediate"], 96);
    assert_eq!(report["losses_identical"], true);
    let policies = report["policies"].as_array().unwrap();
    assert_eq!(policies.len(), 2);
    assert!(policies[1]["link_bytes_per_step"][0].as_u64().unwrap() > 0);

    // Llama-only flags on a GPT-2 model are refused, as `strata model` refuses them.
    let stderr = failure(
        strata()
            .args(["bench", "step", "--kv-heads", "2"])
            .args(TINY),
    );
    assert!(
        stderr.contains("--kv-heads is for Llama-family models"),
        "{stderr}"
    );
}

/// `bench step` on the default 2-layer Llama (width 64, 4 heads, 2 key/value heads of 16
/// channels, MLP 96), batch 2 x 16, one warm-up and one measured step, with `extra`.
fn llama_step(dir: &Path, extra: &[&str]) -> (String, serde_json::Value) {
    run_with_json(
        strata()
            .args([
                "bench", "step", "--family", "llama", "--seq", "16", "--batch", "2",
            ])
            .args(["--steps", "1", "--warmup", "1"])
            .args(extra)
            .arg("--nvme")
            .arg(dir),
        &dir.join("step.json"),
    )
}

#[test]
fn a_lora_fine_tune_reports_its_adapter_and_trains_the_adapters_alone() {
    let dir = scratch();
    let policies = ["--policies", "all-on-device,nvme-offload"];
    let (stdout, report) = llama_step(dir.path(), &[&policies[..], &["--lora", "4"]].concat());
    let lora = &report["lora"];
    assert_eq!(lora["rank"], 4);
    assert_eq!(lora["alpha"].as_f64(), Some(16.0), "train's default");
    assert_eq!(lora["targets"], serde_json::json!(["all-linear"]));
    // rank x (in + out) of each layer's q, k, v, o, gate, up and down, two layers.
    let per_layer = (64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 96) + (96 + 64);
    assert_eq!(lora["trained_params"].as_u64(), Some(2 * 4 * per_layer));
    assert!(
        stdout.contains("LoRA rank 4, alpha 16, on all-linear: 7424 trained parameters"),
        "{stdout}"
    );
    // The base's parameters and the adapters'.
    assert!(report["model"]["params"].as_u64().unwrap() > 7424);
    assert_eq!(report["losses_identical"], true);
    let ran: Vec<_> = report["policies"].as_array().unwrap().iter().collect();
    let refused = report["refused"].as_array().unwrap();
    assert_eq!(ran.len() + refused.len(), 2, "{report}");

    // B starts at zero: the first step is the base model's, the next one is not (the
    // adapters alone trained), and targets narrow what trains.
    let (_, whole) = llama_step(dir.path(), &["--policies", "all-on-device"]);
    let loss = |r: &serde_json::Value, at: &str| r["policies"][0][at].as_f64().unwrap();
    assert_eq!(loss(&report, "loss_first"), loss(&whole, "loss_first"));
    assert_ne!(loss(&report, "loss_last"), loss(&whole, "loss_last"));
    let (_, qv) = llama_step(
        dir.path(),
        &[
            "--policies",
            "all-on-device",
            "--lora",
            "2",
            "--lora-alpha",
            "8",
            "--lora-targets",
            "q_proj,v_proj",
        ],
    );
    assert_eq!(qv["lora"]["alpha"].as_f64(), Some(8.0));
    assert_eq!(
        qv["lora"]["trained_params"].as_u64(),
        Some(2 * 2 * ((64 + 64) + (64 + 32)))
    );

    // What the engine refuses for a LoRA model is refused with its message.
    let stderr = failure(strata().args([
        "bench",
        "step",
        "--family",
        "llama",
        "--lora",
        "4",
        "--approx-backward",
        "linear:0.5",
    ]));
    assert!(stderr.contains("does not combine with LoRA"), "{stderr}");
}

#[test]
fn a_qlora_fine_tune_trains_over_its_quantised_base_alike_under_each_policy() {
    let dir = scratch();
    let policies = ["--policies", "all-on-device,nvme-offload"];
    let lora = [&policies[..], &["--lora", "4"]].concat();
    let (_, plain) = llama_step(dir.path(), &lora);
    let (stdout, report) = llama_step(dir.path(), &[&lora[..], &["--quant", "nf4"]].concat());
    assert_eq!(report["lora"]["quant"], "nf4");
    assert!(stdout.contains("its linear weights in nf4"), "{stdout}");
    // Held dequantised on the device, packed on NVMe: the same losses, which the
    // quantisation moved from the bf16 or f32 base's.
    assert_eq!(report["policies"].as_array().unwrap().len(), 2, "{report}");
    assert_eq!(report["losses_identical"], true);
    let loss = |r: &serde_json::Value| r["policies"][0]["loss_first"].as_f64().unwrap();
    assert_ne!(loss(&report), loss(&plain));
    let stderr = failure(strata().args([
        "bench",
        "step",
        "--family",
        "llama",
        "--lora",
        "4",
        "--quant",
        "nf4",
        "--peers",
        "/nonexistent",
    ]));
    assert!(stderr.contains("--quant nf4 with --peers"), "{stderr}");
}

#[test]
fn bad_arguments_are_clear_errors() {
    // A comparison that would not fit this machine's memory is refused before it starts
    // (a 175B-parameter shape with every tensor on the CPU device: terabytes of RAM).
    let started = std::time::Instant::now();
    let stderr = failure(strata().args([
        "bench",
        "step",
        "--model",
        "96x12288",
        "--policies",
        "all-on-device",
    ]));
    assert!(
        stderr.contains("it would be killed for memory") && stderr.contains("--device-mem"),
        "{stderr}"
    );
    assert!(started.elapsed().as_secs() < 60, "refused only after work");

    // The scale claim needs a model at least twice the host budget.
    let dir = scratch();
    let stderr = failure(
        strata()
            .args(["bench", "step", "--scale", "--host-mem", "1GiB"])
            .args(TINY)
            .arg("--nvme")
            .arg(dir.path()),
    );
    assert!(stderr.contains("less than twice --host-mem"), "{stderr}");

    let stderr = failure(
        strata()
            .args(["bench", "step", "--policies", "nvme-offload"])
            .args(TINY)
            .args(["--nvme", "/no/such/folder"]),
    );
    assert!(
        stderr.contains("/no/such/folder") && stderr.contains("not a folder"),
        "{stderr}"
    );

    if std::path::Path::new("/dev/shm").is_dir() && strata::storage::is_tmpfs("/dev/shm".as_ref()) {
        let stderr = failure(
            strata()
                .args([
                    "bench",
                    "step",
                    "--policies",
                    "nvme-offload",
                    "--nvme",
                    "/dev/shm",
                ])
                .args(TINY),
        );
        assert!(
            stderr.contains("tmpfs") && stderr.contains("not a drive"),
            "{stderr}"
        );
        // doctor gives the same answer about the folder: one probe, one answer.
        let out = strata()
            .args(["doctor", "--nvme", "/dev/shm"])
            .output()
            .unwrap();
        let (stdout, _) = text(&out);
        assert!(
            stdout.contains("not usable: /dev/shm is on tmpfs, which is RAM, not a drive"),
            "{stdout}"
        );
    }

    let stderr = failure(strata().args(["bench", "step", "--policies", "everything"]));
    assert!(
        stderr.contains("nvme-offload"),
        "lists the choices: {stderr}"
    );
}
