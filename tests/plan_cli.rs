//! `strata plan --ranks N` as a user runs it: per-rank peaks, the collective lane in the
//! prediction, the policies ranks rule out, and `--ranks 0`.

use std::process::{Command, Output};

fn strata(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// GPT-2 124M with stated budgets, so the answer does not depend on this machine; its
/// training state (16 B/param) dominates every tier's peak under nvme-offload.
const STEP: [&str; 12] = [
    "--model",
    "gpt2",
    "--device-mem",
    "8GiB",
    "--host-mem",
    "8GiB",
    "--nvme-mem",
    "1TB",
    "--batch",
    "1",
    "--seq",
    "256",
];

/// `strata plan STEP --ranks ranks --json ...`: its printout and its JSON.
fn plan(ranks: &str) -> (String, serde_json::Value) {
    plan_with(&["--ranks", ranks])
}

/// `strata plan STEP EXTRA --json ...`: its printout and its JSON.
fn plan_with(extra: &[&str]) -> (String, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("plan.json");
    let mut args = vec!["plan", "--json", json.to_str().unwrap()];
    args.extend(extra);
    args.extend(STEP);
    let out = strata(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let answer = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (text(&out.stdout), answer)
}

/// The row of the policy whose name starts with `name`.
fn row<'a>(answer: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    answer["policies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["policy"].as_str().unwrap().starts_with(name))
        .unwrap_or_else(|| panic!("no {name} in {answer}"))
}

#[test]
fn two_ranks_halve_the_nvme_peak_and_shard_the_device_state() {
    let (one_text, one) = plan("1");
    let (two_text, two) = plan("2");
    assert_eq!(one["ranks"], 1);
    assert_eq!(two["ranks"], 2);

    // Each rank's NVMe holds its half of the master, m and v (12 B/param), plus padding
    // and a spare extent per block size.
    let nvme = |a: &serde_json::Value| {
        row(a, "nvme-offload")["peak_bytes"]["nvme"]
            .as_u64()
            .unwrap()
    };
    let ratio = nvme(&two) as f64 / nvme(&one) as f64;
    assert!(
        (0.45..=0.6).contains(&ratio),
        "{} / {}",
        nvme(&two),
        nvme(&one)
    );
    assert_eq!(
        row(&two, "nvme-offload")["nvme_bytes_all_ranks"]
            .as_u64()
            .unwrap(),
        2 * nvme(&two)
    );

    // The collective lane is in the prediction with ranks, and empty without.
    let collective = |a: &serde_json::Value| {
        row(a, "nvme-offload")["collective_seconds"]
            .as_f64()
            .unwrap()
    };
    assert_eq!(collective(&one), 0.0);
    // At least one all-gather of every parameter and one reduce-scatter of every
    // gradient (fp32: 4 B each) at the collective rate: the norm alone is not enough.
    let comm = collective(&two);
    let rate = two["rates"]["collective_bytes_per_s"].as_f64().unwrap();
    let at_least = 2.0 * 4.0 * two["params"].as_f64().unwrap() / rate;
    assert!(comm >= at_least, "{comm} s < {at_least} s");
    assert!(row(&two, "nvme-offload")["step_seconds"].as_f64().unwrap() >= comm);
    let lanes = &two["auto"]["lane_seconds"];
    assert!(lanes["collective"].as_f64().unwrap() > 0.0, "{lanes}");
    assert!(lanes["compute"].as_f64().unwrap() > 0.0, "{lanes}");
    assert_eq!(
        one["auto"]["lane_seconds"]["collective"].as_f64(),
        Some(0.0)
    );
    let busy = two_text
        .lines()
        .find(|l| l.starts_with("busy seconds per lane:"))
        .unwrap_or_else(|| panic!("{two_text}"));
    assert!(busy.contains("collective "), "{busy}");
    assert!(two_text.contains("collectives 4.0 GB/s"), "{two_text}");

    // The printout says the figures are per rank, and what the ranks hold together.
    assert!(
        two_text.contains("Budgets and peaks are per rank; `nvme x2` is the 2 ranks' NVMe"),
        "{two_text}"
    );
    assert!(two_text.contains("nvme of all 2 ranks"), "{two_text}");
    assert!(two_text.contains("peak per rank"), "{two_text}");

    // Every policy plans with ranks; all-on-device keeps each rank's shard of the
    // optimizer state (12 B/param) and of the gradients on its device, whole parameters
    // beside them: well under one process's device peak.
    for a in [&one, &two] {
        assert_eq!(a["unavailable"].as_array().unwrap().len(), 0, "{a}");
        assert_eq!(a["policies"].as_array().unwrap().len(), 4, "{a}");
    }
    let device = |a: &serde_json::Value| {
        row(a, "all-on-device")["peak_bytes"]["device"]
            .as_u64()
            .unwrap() as f64
    };
    let ratio = device(&two) / device(&one);
    assert!(
        (0.5..0.85).contains(&ratio),
        "{} / {}",
        device(&two),
        device(&one)
    );
    assert!(!two_text.contains("not available"), "{two_text}");

    // One rank prints as it did before there were ranks.
    for ranks_only in ["ranks", "per rank", "collective", "not available"] {
        assert!(
            !one_text.contains(ranks_only),
            "{ranks_only} in\n{one_text}"
        );
    }
    let mut args = vec!["plan"];
    args.extend(STEP);
    // But for the free space it names, which other programs change between the runs.
    let steady = |t: &str| -> Vec<String> {
        t.lines()
            .filter(|l| !l.starts_with("step: "))
            .map(str::to_string)
            .collect()
    };
    assert_eq!(steady(&text(&strata(&args).stdout)), steady(&one_text));
}

#[test]
fn ranks_zero_is_refused_in_one_line() {
    let mut args = vec!["plan", "--ranks", "0"];
    args.extend(STEP);
    let out = strata(&args);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("--ranks 0: a step needs at least one rank"),
        "{stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
}

/// The rates a plan is ranked with say where they come from: the defaults are set by
/// hand for the CPU, so a plan for a GPU says it is ranked with CPU rates, and one for
/// the CPU device says only that they are defaults.
#[test]
fn a_gpu_plan_says_it_is_ranked_with_the_cpus_default_rates() {
    for (device, gpu_words) in [("cuda", true), ("cpu", false)] {
        let mut args = vec!["plan", "--device", device];
        args.extend(STEP);
        let out = strata(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let stdout = text(&out.stdout);
        let rates = stdout
            .lines()
            .find(|l| l.starts_with("rates ("))
            .unwrap_or_else(|| panic!("no rates line in {stdout}"));
        assert!(rates.starts_with("rates (defaults"), "{rates}");
        assert_eq!(
            rates.contains("no GPU's rates are recorded"),
            gpu_words,
            "--device {device}: {rates}"
        );
    }
}

/// `strata plan` states one checkpoint's disk space, and a checkpoint `strata train`
/// writes of the same job fits in it: the parameters, m and v (12 B/param) and little
/// more.
#[test]
fn plan_states_the_disk_space_a_checkpoint_takes() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("plan.json");
    let out = strata(&["plan", "--json", json.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let answer: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let stated = answer["checkpoint_bytes"].as_u64().unwrap();
    let params = answer["params"].as_u64().unwrap();
    assert!(
        text(&out.stdout).contains("checkpoint: "),
        "{}",
        text(&out.stdout)
    );

    let ck = dir.path().join("ck");
    let nvme = dir.path().join("nvme");
    std::fs::create_dir_all(&nvme).unwrap();
    let out = strata(&[
        "train",
        "--steps",
        "1",
        "--checkpoint-dir",
        ck.to_str().unwrap(),
        "--nvme",
        nvme.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let written: u64 = std::fs::read_dir(ck.join("step-00000001"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert!(
        12 * params < written && written <= stated && stated < written + (1 << 20),
        "plan states {stated} bytes, a checkpoint of {params} params took {written}"
    );
}

/// `--optimizer-state`: the NVMe tier holds the master parameters and the moments in the
/// format asked (12, 8 and 6 + 8/256 bytes per parameter by the formats' definitions, so
/// the peaks' ratios to fp32's are about 2/3 and 1/2), the NVMe traffic per parameter
/// falls, and the policy that keeps the state on the device is refused by name.
#[test]
fn compact_moments_shrink_the_nvme_state_and_rule_out_the_device() {
    let (_, fp32) = plan_with(&[]);
    let nvme = |answer: &serde_json::Value| {
        let r = row(answer, "nvme-offload");
        (
            r["peak_bytes"]["nvme"].as_f64().unwrap(),
            r["nvme_traffic_bytes_per_param"].as_f64().unwrap(),
        )
    };
    let (fp32_peak, fp32_traffic) = nvme(&fp32);
    assert_eq!(fp32["optimizer_state"], "fp32");
    for (format, ratio) in [("bf16", 8.0 / 12.0), ("q8", (6.0 + 8.0 / 256.0) / 12.0)] {
        let (text, answer) = plan_with(&["--optimizer-state", format]);
        assert_eq!(answer["optimizer_state"], format);
        assert!(text.contains(&format!("{format} moments")), "{text}");
        let (peak, traffic) = nvme(&answer);
        assert!(
            (peak / fp32_peak - ratio).abs() < 0.01,
            "{format}: NVMe peak {peak} against fp32's {fp32_peak}, not {ratio:.3} of it"
        );
        assert!(
            traffic < fp32_traffic,
            "{format}: {traffic} >= {fp32_traffic}"
        );
        let refused = answer["unavailable"]
            .as_array()
            .unwrap()
            .iter()
            .find(|u| u["policy"] == "all-on-device")
            .unwrap_or_else(|| panic!("all-on-device is not refused: {answer}"));
        assert!(
            refused["reason"]
                .as_str()
                .unwrap()
                .contains(&format!("{format} optimizer state")),
            "{refused}"
        );
    }
}

/// `--schedule`: vertically a step of 8 micro-batches reads from NVMe what a step of one
/// reads (each streamed block once per pass, its backward fed by the state read for its
/// update), so its bytes per token are an eighth of one micro-batch's, and at most a
/// quarter of the horizontal order's (which reads the blocks again for every
/// micro-batch); the printout and the JSON say which order each plan takes.
#[test]
fn the_vertical_schedule_reads_each_block_once_per_step() {
    let reads = |extra: &[&str]| {
        let mut args = vec!["--clip", "0"];
        args.extend(extra);
        let (text, answer) = plan_with(&args);
        let r = row(&answer, "nvme-offload");
        let read = r["link_bytes_per_token"][0].as_f64().unwrap();
        (text, answer.clone(), r["schedule"].clone(), read)
    };
    let (_, _, one_order, one) = reads(&["--grad-accum", "1"]);
    assert_eq!(one_order, "horizontal");
    let eight = ["--grad-accum", "8", "--schedule"];
    let (_, _, h_order, horizontal) = reads(&[&eight[..], &["horizontal"]].concat());
    let (text, answer, v_order, vertical) = reads(&[&eight[..], &["vertical"]].concat());
    assert_eq!((h_order, v_order), ("horizontal".into(), "vertical".into()));
    assert_eq!(answer["schedule"], "vertical");
    assert!(text.contains("--schedule vertical"), "{text}");
    assert!(
        (vertical * 8.0 / one - 1.0).abs() < 1e-9,
        "vertical reads {vertical} B/token with 8 micro-batches, one micro-batch {one}"
    );
    assert!(
        vertical <= horizontal / 4.0,
        "vertical {vertical} B/token against horizontal {horizontal}"
    );
    // Auto weighs both, and says which it took (here, where the default rates hide
    // horizontal's reads under the compute, horizontal: it holds fewer checkpoints).
    let (text, answer, _, _) = reads(&eight[..2]);
    let order = answer["auto"]["schedule"].as_str().unwrap().to_string();
    assert!(text.contains(&format!("{order} schedule")), "{text}");
}

/// `--approx-backward`: the plan compares what a kept layer saves with the exact
/// backward's, and the JSON holds both; an activation another family has is refused.
#[test]
fn an_approximate_backward_is_planned_beside_the_exact_one() {
    let (printout, answer) = plan_with(&["--approx-backward", "gelu:3,linear:0.5"]);
    assert_eq!(answer["approx_backward"], "gelu:3,linear:0.5");
    let saved = &answer["exact_backward"]["saved_bytes_per_layer"];
    let (exact, approx) = (saved[0].as_u64().unwrap(), saved[1].as_u64().unwrap());
    // GPT-2 124M, 256 rows: the few-bit GELU and the three sketches drop the layer's
    // fch, ln1, ln2 and the GELU's output to codes and half-row projections.
    assert!(approx < exact, "{approx} vs {exact}");
    assert!(
        printout.contains("--approx-backward gelu:3,linear:0.5: a kept layer saves")
            && printout.contains("with the exact backward, auto picks"),
        "{printout}"
    );
    let (_, exact_answer) = plan_with(&[]);
    assert_eq!(exact_answer["approx_backward"], "exact");
    assert!(exact_answer["exact_backward"].is_null());
    let mut args = vec!["plan", "--approx-backward", "silu:3"];
    args.extend(STEP);
    let out = strata(&args);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(stderr.contains("write gelu:3"), "{stderr}");
}
