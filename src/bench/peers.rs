//! The peers of `strata bench step --peers DIR`, run in the same invocation, on the same
//! model shape, batch and thread count, after strata's policies: PyTorch eager with fused
//! AdamW (all-on-device's peer), twice: with transformers' eager attention and with its
//! SDPA attention (`torch.nn.functional.scaled_dot_product_attention`); DeepSpeed ZeRO-3
//! with parameters and optimizer state offloaded to the CPU (ZeRO-Offload, cpu-offload's
//! peer) and to NVMe (ZeRO-Infinity, nvme-offload's peer). With `--grad-accum`, DeepSpeed
//! accumulates the same micro-batches; PyTorch eager takes them as one batch.
//!
//! With `--dtype bf16` the peer is PyTorch eager in bf16 mixed precision (autocast, fused
//! AdamW on fp32 parameters), all-on-device's.
//!
//! With `--lora` the peers are peft's LoRA of the same rank, alpha and targets (dropout
//! 0) over PyTorch eager, with eager and with SDPA attention (under bf16 autocast with
//! `--dtype bf16`), AdamW over the adapters alone; the DeepSpeed peers are not run, and
//! their rows say why.
//!
//! The bf16 peer, and for a Llama-family model (Llama, Mistral, Qwen2, Qwen3) all of
//! them, run `benches/peers/step_peer.py`, embedded here: transformers builds the model
//! from the config.json strata writes for its own shape, so both sides train the same
//! architecture at the same size.
//!
//! `DIR` is the folder `../shared/anchors/setup DIR` makes: a Python env in `DIR/venv`
//! with PyTorch, DeepSpeed and transformers, and the peer scripts beside it
//! (`gpt2_step_bench.py`, `ds_zero3_bench.py`). A peer that cannot run (no env, a script
//! missing, the script failing) is reported with its reason, never replaced by a number
//! from elsewhere: only ratios taken in one run count.

use std::path::Path;
use std::process::{Command, Output, Stdio};

use serde::{Serialize, Serializer};
use serde_json::Value;
use strata_engine::model::lora::LoraConfig;
use strata_engine::plan::BuiltinPolicy;

use crate::machine::meminfo_bytes;
use crate::report::{Table, format_bytes, process_peak_rss_bytes};

/// The shape and run length the peers are given: strata's, so that the ratios compare
/// like with like.
#[derive(Debug, Clone)]
pub struct PeerShape {
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Residual width.
    pub width: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Context length.
    pub ctx: usize,
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Micro-batches per step. A peer script that takes `--grad-accum` (the anchors'
    /// `ds_zero3_bench.py`) runs them as strata does; the others run one batch of
    /// `batch × grad_accum` sequences per step.
    pub grad_accum: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Measured steps.
    pub steps: usize,
    /// Untimed steps first.
    pub warmup: usize,
    /// Threads (strata's kernels use this many).
    pub threads: usize,
    /// AdamW learning rate.
    pub lr: f64,
    /// The model's config.json, as `save_pretrained` writes it (`Family::hf_config`):
    /// what strata's own peer script builds the model from. The anchors' GPT-2 scripts
    /// take the numbers above instead.
    pub hf_config: Value,
    /// With `--lora`: the adapter strata trains, which peft's peers train alike.
    pub lora: Option<LoraConfig>,
}

/// One peer's run, beside the strata policy it is compared with.
#[derive(Debug, Clone, Serialize)]
pub struct PeerResult {
    /// The peer (`pytorch-eager`, `deepspeed-zero-offload`, `deepspeed-zero-infinity`).
    pub peer: &'static str,
    /// The strata policy it is compared with.
    #[serde(serialize_with = "policy_name")]
    pub strata_policy: BuiltinPolicy,
    /// Whether it ran; when not, `reason` says why.
    pub ran: bool,
    /// Why it did not run.
    pub reason: Option<String>,
    /// Its median step seconds, as it timed them.
    pub step_s_median: Option<f64>,
    /// Its tokens per second at the median.
    pub tokens_per_s: Option<f64>,
    /// strata's tokens per second for `strata_policy` in this run.
    pub strata_tokens_per_s: Option<f64>,
    /// strata's tokens/s over the peer's: above 1, strata is faster.
    pub strata_over_peer: Option<f64>,
    /// The peer's last loss (on its own data: a sanity check, not a comparison).
    pub final_loss: Option<f64>,
    /// The result line the peer script wrote, whole.
    pub raw: Option<Value>,
}

/// strata's own peer script (see the module's documentation): written into the peer's
/// work folder to run, where the anchors' scripts run from beside the env.
const STEP_PEER: &str = include_str!("../../benches/peers/step_peer.py");

/// File name of [`STEP_PEER`] in a peer's work folder.
const STEP_PEER_SCRIPT: &str = "step_peer.py";

/// The peer script that runs `--grad-accum` micro-batches per step as strata does.
const GRAD_ACCUM_SCRIPT: &str = "ds_zero3_bench.py";

/// A policy in JSON: its name.
fn policy_name<S: Serializer>(policy: &BuiltinPolicy, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(policy)
}

/// A peer: its name, strata counterpart, script and extra arguments.
type Peer = (
    &'static str,
    BuiltinPolicy,
    &'static str,
    &'static [&'static str],
);

/// [`STEP_PEER`]'s PyTorch eager engine with transformers' eager attention, with its
/// SDPA attention, and under bf16 autocast.
const EAGER_ATTENTION: &[&str] = &["--engine", "eager", "--attn", "eager"];
const SDPA_ATTENTION: &[&str] = &["--engine", "eager", "--attn", "sdpa"];
const BF16_AUTOCAST: &[&str] = &["--engine", "eager", "--autocast", "bf16"];

/// The bf16 peer.
const BF16_PEER: Peer = (
    "pytorch-eager-bf16-autocast",
    BuiltinPolicy::AllOnDevice,
    STEP_PEER_SCRIPT,
    BF16_AUTOCAST,
);

/// The fp32 peers.
const PEERS: [Peer; 4] = [
    (
        "pytorch-eager",
        BuiltinPolicy::AllOnDevice,
        "gpt2_step_bench.py",
        &["--attn", "eager"],
    ),
    (
        "pytorch-eager-sdpa",
        BuiltinPolicy::AllOnDevice,
        "gpt2_step_bench.py",
        &["--attn", "sdpa"],
    ),
    (
        "deepspeed-zero-offload",
        BuiltinPolicy::CpuOffload,
        GRAD_ACCUM_SCRIPT,
        &["--offload", "cpu", "--zero-init"],
    ),
    (
        "deepspeed-zero-infinity",
        BuiltinPolicy::NvmeOffload,
        GRAD_ACCUM_SCRIPT,
        &["--offload", "nvme", "--zero-init"],
    ),
];

/// The Llama-family peers: [`PEERS`]' engines, from [`STEP_PEER`].
const LLAMA_PEERS: [Peer; 4] = [
    (
        "pytorch-eager",
        BuiltinPolicy::AllOnDevice,
        STEP_PEER_SCRIPT,
        EAGER_ATTENTION,
    ),
    (
        "pytorch-eager-sdpa",
        BuiltinPolicy::AllOnDevice,
        STEP_PEER_SCRIPT,
        SDPA_ATTENTION,
    ),
    (
        "deepspeed-zero-offload",
        BuiltinPolicy::CpuOffload,
        STEP_PEER_SCRIPT,
        &["--engine", "zero", "--offload", "cpu"],
    ),
    (
        "deepspeed-zero-infinity",
        BuiltinPolicy::NvmeOffload,
        STEP_PEER_SCRIPT,
        &["--engine", "zero", "--offload", "nvme"],
    ),
];

/// The LoRA peers: peft over [`LLAMA_PEERS`]' PyTorch eager engine, for any family.
const LORA_PEERS: [Peer; 2] = [
    (
        "peft-lora-eager",
        BuiltinPolicy::AllOnDevice,
        STEP_PEER_SCRIPT,
        EAGER_ATTENTION,
    ),
    (
        "peft-lora-eager-sdpa",
        BuiltinPolicy::AllOnDevice,
        STEP_PEER_SCRIPT,
        SDPA_ATTENTION,
    ),
];

/// The bf16 LoRA peer: peft over [`BF16_PEER`].
const LORA_BF16_PEER: Peer = (
    "peft-lora-eager-bf16-autocast",
    BuiltinPolicy::AllOnDevice,
    STEP_PEER_SCRIPT,
    BF16_AUTOCAST,
);

/// Why the DeepSpeed peers are not run with `--lora`.
const NO_LORA_REASON: &str = "--lora: strata's peer script wraps the model with peft \
     under PyTorch eager only, not DeepSpeed (the peft-lora-eager peers are --lora's)";

/// Whether the shape is GPT-2's, which the anchors' scripts build.
fn is_gpt2(shape: &PeerShape) -> bool {
    shape.hf_config["model_type"] == "gpt2"
}

/// Runs every peer whose strata counterpart is among `strata` (policy, tokens/s),
/// from the anchors folder `dir`, with `nvme_dir` under which ZeRO-Infinity may make its
/// swap folder (removed afterwards). Prints each peer's progress on standard error.
pub fn run(
    dir: &Path,
    shape: &PeerShape,
    strata: &[(BuiltinPolicy, f64)],
    nvme_dir: &Path,
) -> Vec<PeerResult> {
    if shape.lora.is_some() {
        let mut results = run_set(dir, shape, strata, nvme_dir, &LORA_PEERS);
        results.extend(not_with_lora(strata));
        return results;
    }
    let peers = if is_gpt2(shape) { &PEERS } else { &LLAMA_PEERS };
    run_set(dir, shape, strata, nvme_dir, peers)
}

/// The DeepSpeed peers' rows of a `--lora` run: not run, saying why.
fn not_with_lora(strata: &[(BuiltinPolicy, f64)]) -> Vec<PeerResult> {
    LLAMA_PEERS
        .iter()
        .filter(|(_, _, _, extra)| extra.contains(&"zero"))
        .map(|&(peer, policy, _, _)| PeerResult {
            reason: Some(NO_LORA_REASON.to_string()),
            ..PeerResult::not_run(peer, policy, strata)
        })
        .collect()
}

/// As [`run`], against strata in bf16: PyTorch eager under bf16 autocast.
pub fn run_bf16(
    dir: &Path,
    shape: &PeerShape,
    strata: &[(BuiltinPolicy, f64)],
    nvme_dir: &Path,
) -> Vec<PeerResult> {
    let peer = if shape.lora.is_some() {
        LORA_BF16_PEER
    } else {
        BF16_PEER
    };
    run_set(dir, shape, strata, nvme_dir, &[peer])
}

impl PeerResult {
    /// `peer`'s row against strata's `policy` (its tokens/s from `strata`, when it ran),
    /// before the peer runs.
    fn not_run(peer: &'static str, policy: BuiltinPolicy, strata: &[(BuiltinPolicy, f64)]) -> Self {
        PeerResult {
            peer,
            strata_policy: policy,
            ran: false,
            reason: None,
            step_s_median: None,
            tokens_per_s: None,
            strata_tokens_per_s: strata
                .iter()
                .find(|(builtin, _)| *builtin == policy)
                .map(|(_, tps)| *tps),
            strata_over_peer: None,
            final_loss: None,
            raw: None,
        }
    }
}

fn run_set(
    dir: &Path,
    shape: &PeerShape,
    strata: &[(BuiltinPolicy, f64)],
    nvme_dir: &Path,
    peers: &[Peer],
) -> Vec<PeerResult> {
    let mut results = Vec::new();
    for &(peer, policy, script, extra) in peers {
        let mut result = PeerResult::not_run(peer, policy, strata);
        let strata_tps = result.strata_tokens_per_s;
        if strata_tps.is_none() {
            result.reason = Some(format!("strata's {policy} did not run in this invocation"));
            results.push(result);
            continue;
        }
        eprintln!("  peer {peer} (against strata {policy}) ...");
        match run_one(dir, script, extra, shape, nvme_dir) {
            Ok(raw) => {
                let step = raw.get("median_step_s").and_then(Value::as_f64);
                let tps = raw.get("tokens_per_s").and_then(Value::as_f64);
                result.ran = step.is_some() && tps.is_some();
                if !result.ran {
                    result.reason = Some(format!(
                        "its result has no median_step_s/tokens_per_s: {raw}"
                    ));
                }
                result.step_s_median = step;
                result.tokens_per_s = tps;
                result.strata_over_peer = tps.zip(strata_tps).map(|(p, s)| s / p);
                result.final_loss = raw.get("final_loss").and_then(Value::as_f64);
                result.raw = Some(raw);
            }
            Err(reason) => {
                eprintln!("  peer {peer} did not run: {reason}");
                result.reason = Some(reason);
            }
        }
        results.push(result);
    }
    results
}

/// Runs one peer script of `dir`; its result is the last JSON line it appended to its
/// `--json` file.
fn run_one(
    dir: &Path,
    script: &str,
    extra: &[&str],
    shape: &PeerShape,
    nvme_dir: &Path,
) -> Result<Value, String> {
    let python = dir.join("venv/bin/python");
    if !python.is_file() {
        return Err(format!(
            "no Python env at {} (make one with ../shared/anchors/setup DIR)",
            python.display()
        ));
    }
    let work = WorkDir::new(nvme_dir)?;
    let write = |name: &str, text: &str| {
        let path = work.0.join(name);
        std::fs::write(&path, text)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))
            .map(|()| path)
    };
    // The anchors' scripts live beside the env; strata's own is written out to run.
    let embedded = script == STEP_PEER_SCRIPT;
    let script = if embedded {
        write(script, STEP_PEER)?
    } else {
        dir.join(script)
    };
    if !script.is_file() {
        return Err(format!("no peer script at {}", script.display()));
    }
    let json = work.0.join("result.jsonl");
    let mut command = env_command(dir, &python, shape.threads)?;
    command.arg(&script).args(extra);
    if embedded {
        let text = serde_json::to_string_pretty(&shape.hf_config).map_err(|e| e.to_string())?;
        command
            .arg("--config-json")
            .arg(write("config.json", &text)?);
        if let Some(lora) = &shape.lora {
            command
                .arg("--lora")
                .arg(lora.rank.to_string())
                .arg("--lora-alpha")
                .arg(lora.alpha.to_string())
                .arg("--lora-targets")
                .arg(lora.targets.join(","));
        }
    } else {
        for (flag, value) in [
            ("--layers", shape.layers),
            ("--heads", shape.heads),
            ("--embd", shape.width),
            ("--vocab", shape.vocab),
            ("--ctx", shape.ctx),
        ] {
            command.arg(flag).arg(value.to_string());
        }
    }
    // Only the anchors' DeepSpeed script accumulates micro-batches itself.
    let batch = if script.ends_with(GRAD_ACCUM_SCRIPT) {
        command
            .arg("--grad-accum")
            .arg(shape.grad_accum.to_string());
        shape.batch
    } else {
        shape.batch * shape.grad_accum
    };
    for (flag, value) in [
        ("--batch", batch.to_string()),
        ("--seq", shape.seq.to_string()),
        ("--steps", shape.steps.to_string()),
        ("--warmup", shape.warmup.to_string()),
        ("--threads", shape.threads.to_string()),
        ("--lr", shape.lr.to_string()),
    ] {
        command.arg(flag).arg(value);
    }
    if extra.contains(&"nvme") {
        command.arg("--nvme-path").arg(work.0.join("swap"));
    }
    command.arg("--json").arg(&json);
    let available = meminfo_bytes("MemAvailable");
    let (output, peak) = output_with_peak(&mut command)
        .map_err(|e| format!("could not run {}: {e}", python.display()))?;
    if !output.status.success() {
        return Err(format!(
            "{} exited with {}{}: {}",
            script.display(),
            output.status,
            killed_note(&output.status, peak, available),
            stderr_tail(&output.stderr, 6)
        ));
    }
    let text = std::fs::read_to_string(&json)
        .map_err(|e| format!("{} wrote no result ({e})", script.display()))?;
    // The peer's result is the last line it appended, as a peer's printed result is.
    crate::bench::parse_peer_output(&text)
}

/// Runs `command` to its end with its output captured, sampling its resident peak
/// (VmHWM) every 200 ms meanwhile: its output, and the last peak seen.
fn output_with_peak(command: &mut Command) -> std::io::Result<(Output, Option<u64>)> {
    let child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let pid = child.id();
    let waiter = std::thread::spawn(move || child.wait_with_output());
    let mut peak = None;
    while !waiter.is_finished() {
        peak = process_peak_rss_bytes(pid).or(peak);
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let output = waiter
        .join()
        .map_err(|_| std::io::Error::other("the peer's waiting thread panicked"))??;
    Ok((output, peak))
}

/// For a peer killed by SIGKILL, what the kernel's out-of-memory killer (which kills so)
/// would have seen: the peer's resident peak as last sampled, against the memory
/// available when it started. Empty for any other exit.
fn killed_note(
    status: &std::process::ExitStatus,
    peak: Option<u64>,
    available: Option<u64>,
) -> String {
    use std::os::unix::process::ExitStatusExt;
    if status.signal() != Some(libc::SIGKILL) {
        return String::new();
    }
    let bytes = |b: Option<u64>| b.map_or("unknown".to_string(), format_bytes);
    format!(
        " (SIGKILL, as the kernel's out-of-memory killer sends it: it had reached {} \
         resident, sampled every 200 ms, with {} available when it started)",
        bytes(peak),
        bytes(available)
    )
}

/// `program` (in the peers' env `dir`) set up as ../shared/anchors/README.md says
/// DeepSpeed runs on a CPU-only machine: the env first on the PATH, its extensions
/// folder, the CPU accelerator, a one-process group, and `threads` OpenMP threads.
pub(crate) fn env_command(dir: &Path, program: &Path, threads: usize) -> Result<Command, String> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![dir.join("venv/bin")];
    paths.extend(std::env::split_paths(&path));
    let mut command = Command::new(program);
    command
        .env(
            "PATH",
            std::env::join_paths(paths).map_err(|e| e.to_string())?,
        )
        .env("TORCH_EXTENSIONS_DIR", dir.join("torch_extensions"))
        .env("DS_ACCELERATOR", "cpu")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", "29517")
        .env("RANK", "0")
        .env("WORLD_SIZE", "1")
        .env("LOCAL_RANK", "0")
        .env("OMP_NUM_THREADS", threads.to_string());
    Ok(command)
}

/// The last `lines` lines of a peer's standard error, joined with " | " (why it failed).
pub(crate) fn stderr_tail(stderr: &[u8], lines: usize) -> String {
    let stderr = String::from_utf8_lossy(stderr);
    let tail: Vec<&str> = stderr.lines().rev().take(lines).collect();
    tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

/// A peer's own folder under the NVMe folder (its result, ZeRO-Infinity's swap files),
/// removed when dropped.
pub(crate) struct WorkDir(pub(crate) std::path::PathBuf);

impl WorkDir {
    pub(crate) fn new(parent: &Path) -> Result<Self, String> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path = parent.join(format!("strata-peer-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&path)
            .map_err(|e| format!("cannot make {}: {e}", path.display()))?;
        Ok(WorkDir(path))
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            log::warn!("could not remove {}: {e}", self.0.display());
        }
    }
}

/// The peers' table.
pub fn render(results: &[PeerResult]) -> String {
    let mut table = Table::new([
        "peer",
        "vs strata policy",
        "peer step s",
        "peer tokens/s",
        "strata tokens/s",
        "strata / peer",
    ]);
    let mut notes = String::new();
    for r in results {
        let number = |v: Option<f64>, decimals: usize| {
            v.map_or("-".to_string(), |v| format!("{v:.decimals$}"))
        };
        table.row([
            r.peer.to_string(),
            r.strata_policy.to_string(),
            number(r.step_s_median, 3),
            number(r.tokens_per_s, 0),
            number(r.strata_tokens_per_s, 0),
            r.strata_over_peer
                .map_or("-".to_string(), |v| format!("{v:.2}x")),
        ]);
        if let Some(reason) = &r.reason {
            notes.push_str(&format!("{}: not run: {reason}\n", r.peer));
        }
    }
    let mut out = table.render();
    out.push_str(
        "peers: run in this invocation after strata's policies, on the same shape, batch and \
         thread count (strata's dtype: fp32, or bf16 against PyTorch's bf16 autocast; \
         PyTorch eager with transformers' eager attention, and with its SDPA attention; \
         DeepSpeed built under zero.Init, no clipping; with --lora, peft's LoRA of the same \
         rank, alpha and targets over PyTorch eager, AdamW over the adapters); strata tokens/s: \
         the policy at its fastest --recompute choice of this run; strata / peer: tokens per \
         second, above 1 strata is faster.\n",
    );
    out.push_str(&notes);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_result_is_the_last_json_line() {
        let text =
            "{\"tokens_per_s\": 1.0}\n{\"tokens_per_s\": 290.5, \"median_step_s\": 1.76}\n\n";
        let v: Value = crate::bench::parse_peer_output(text).unwrap();
        assert_eq!(v["tokens_per_s"].as_f64(), Some(290.5));
        assert!(crate::bench::parse_peer_output::<Value>("\n").is_err());
        assert!(
            crate::bench::parse_peer_output::<Value>("not json")
                .unwrap_err()
                .contains("not json")
        );
    }

    #[test]
    fn a_peer_result_names_its_policy_in_json() {
        let results = run(
            Path::new("/nonexistent/strata-peers"),
            &tiny_shape(1),
            &[(BuiltinPolicy::NvmeOffload, 1.0)],
            Path::new("/nonexistent/strata-peers"),
        );
        let json = serde_json::to_value(&results[3]).unwrap();
        assert_eq!(json["strata_policy"], "nvme-offload");
        assert_eq!(results[3].strata_tokens_per_s, Some(1.0));
        assert_eq!(results[2].strata_tokens_per_s, None);
    }

    /// A tiny model's shape, one step.
    fn tiny_shape(layers: usize) -> PeerShape {
        PeerShape {
            layers,
            heads: 1,
            width: 8,
            vocab: 16,
            ctx: 8,
            batch: 1,
            grad_accum: 1,
            seq: 8,
            steps: 1,
            warmup: 0,
            threads: 1,
            lr: 1e-3,
            hf_config: strata_engine::model::gpt2::config_json(&strata_engine::model::Gpt2Config {
                layers,
                heads: 1,
                width: 8,
                vocab: 16,
                ctx: 8,
            }),
            lora: None,
        }
    }

    /// The default 2-layer Llama's shape (2 key/value heads), one step.
    fn tiny_llama_shape() -> PeerShape {
        let config = strata_engine::model::llama::LlamaConfig::llama(2, 64, 96, 4, 2, 128, 64);
        PeerShape {
            hf_config: config.to_hf(),
            ..tiny_shape(2)
        }
    }

    /// The end of a stand-in Python that answers: a result line of `$t` tokens/s
    /// appended to its `--json` file, as a peer script appends it.
    const ANSWER_T: &str = r#"while [ "$1" != --json ]; do shift; done
echo "{\"median_step_s\": 1.0, \"tokens_per_s\": $t}" >> "$2"
"#;

    /// An anchors folder whose env's Python is the shell script `python` (a stand-in
    /// that checks what it is handed and answers as a peer script does), with empty
    /// files for the anchors' `scripts`.
    fn stand_in_env(python: &str, scripts: &[&str]) -> tempfile::TempDir {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("venv/bin")).unwrap();
        for script in scripts {
            std::fs::write(dir.path().join(script), "").unwrap();
        }
        let path = dir.path().join("venv/bin/python");
        std::fs::write(&path, python).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        dir
    }

    /// Asserts each peer's name and strata / peer ratio, in order (showing the reasons
    /// when they differ).
    fn assert_ratios(results: &[PeerResult], expected: &[(&str, Option<f64>)]) {
        let ratios: Vec<_> = results
            .iter()
            .map(|r| (r.peer, r.strata_over_peer))
            .collect();
        let reasons: Vec<_> = results.iter().map(|r| &r.reason).collect();
        assert_eq!(ratios, expected, "{reasons:?}");
    }

    #[test]
    fn a_missing_env_is_a_reason_not_a_number() {
        let dir = tempfile::tempdir().unwrap();
        let shape = tiny_shape(1);
        let results = run(
            dir.path(),
            &shape,
            &[(BuiltinPolicy::AllOnDevice, 100.0)],
            dir.path(),
        );
        assert_eq!(results.len(), 4);
        // Both attention implementations of PyTorch eager are all-on-device's peers.
        for eager in &results[..2] {
            assert!(!eager.ran);
            assert!(eager.reason.as_ref().unwrap().contains("no Python env"));
            assert!(eager.tokens_per_s.is_none() && eager.strata_over_peer.is_none());
        }
        // Peers whose strata policy did not run are not run either.
        assert!(results[2].reason.as_ref().unwrap().contains("did not run"));
    }

    #[test]
    fn the_bf16_peer_runs_strata_s_own_autocast_script_with_the_env_s_python() {
        // A stand-in Python: checks it was handed the autocast script and strata's
        // shape, then appends a result line as the script does.
        let dir = stand_in_env(
            r#"#!/bin/sh
grep -q 'torch.autocast(device_type="cpu", dtype=torch.bfloat16)' "$1" || exit 5
case "$*" in *'--autocast bf16 '*'--config-json '*'--seq 8 '*) ;; *) exit 6;; esac
cfg=$(echo "$*" | sed 's/.*--config-json \([^ ]*\).*/\1/')
grep -q '"n_layer": 2' "$cfg" || exit 7
while [ "$1" != --json ]; do shift; done
echo '{"median_step_s": 0.5, "tokens_per_s": 16.0, "final_loss": 3.0}' >> "$2"
"#,
            &[],
        );
        let shape = tiny_shape(2);
        let results = run_bf16(
            dir.path(),
            &shape,
            &[(BuiltinPolicy::AllOnDevice, 24.0)],
            dir.path(),
        );
        assert_eq!(results.len(), 1);
        let r = &results[0];
        assert!(r.ran, "{:?}", r.reason);
        assert_eq!(r.peer, "pytorch-eager-bf16-autocast");
        assert_eq!(r.strata_over_peer, Some(1.5));
    }

    #[test]
    fn deepspeed_accumulates_micro_batches_and_pytorch_runs_them_as_one_batch() {
        // A stand-in Python: DeepSpeed's script must get 2 sequences x 4 micro-batches,
        // PyTorch's one batch of 8; it answers a step time per peer.
        let script = r#"#!/bin/sh
case "$1" in
  *ds_zero3_bench.py) case "$*" in *'--grad-accum 4 '*'--batch 2 '*) t=4.0;; *) exit 5;; esac;;
  *gpt2_step_bench.py) case "$*" in *--grad-accum*) exit 6;; *'--batch 8 '*) t=2.0;; *) exit 7;; esac;;
  *) exit 8;;
esac
"#;
        let dir = stand_in_env(
            &format!("{script}{ANSWER_T}"),
            &["gpt2_step_bench.py", GRAD_ACCUM_SCRIPT],
        );
        let shape = PeerShape {
            batch: 2,
            grad_accum: 4,
            ..tiny_shape(1)
        };
        let strata = [
            (BuiltinPolicy::AllOnDevice, 4.0),
            (BuiltinPolicy::CpuOffload, 4.0),
        ];
        let results = run(dir.path(), &shape, &strata, dir.path());
        assert_ratios(
            &results[..3],
            &[
                ("pytorch-eager", Some(2.0)),
                ("pytorch-eager-sdpa", Some(2.0)),
                ("deepspeed-zero-offload", Some(1.0)),
            ],
        );
    }

    #[test]
    fn a_peer_killed_by_sigkill_is_reported_with_the_memory_it_had() {
        // A stand-in Python that is killed as the out-of-memory killer kills.
        let dir = stand_in_env("#!/bin/sh\nkill -9 $$\n", &["gpt2_step_bench.py"]);
        let results = run(
            dir.path(),
            &tiny_shape(1),
            &[(BuiltinPolicy::AllOnDevice, 1.0)],
            dir.path(),
        );
        let reason = results[0].reason.as_deref().unwrap();
        assert!(
            reason.contains("out-of-memory killer") && reason.contains("available when"),
            "{reason}"
        );
        assert!(!results[0].ran);
    }

    #[test]
    fn llama_peers_build_strata_s_shape_from_its_config_json_with_each_engine() {
        // A stand-in Python: checks it was handed the Llama script, the config.json of
        // strata's shape and no GPT-2 flags, and answers a step time per engine.
        let script = r#"#!/bin/sh
grep -q 'AutoModelForCausalLM.from_config' "$1" || exit 5
case "$*" in *--layers*|*--embd*) exit 6;; esac
cfg=$(echo "$*" | sed 's/.*--config-json \([^ ]*\).*/\1/')
grep -q '"model_type": "llama"' "$cfg" || exit 7
grep -q '"num_key_value_heads": 2' "$cfg" || exit 8
case "$*" in
  *'--engine eager --attn eager'*) t=2.0;;
  *'--engine eager --attn sdpa'*) t=2.5;;
  *'--engine zero --offload cpu'*) t=4.0;;
  *'--engine zero --offload nvme'*--nvme-path*) t=8.0;;
  *) exit 9;;
esac
"#;
        let dir = stand_in_env(&format!("{script}{ANSWER_T}"), &[]);
        let shape = tiny_llama_shape();
        let strata = [
            (BuiltinPolicy::AllOnDevice, 4.0),
            (BuiltinPolicy::CpuOffload, 4.0),
            (BuiltinPolicy::NvmeOffload, 4.0),
        ];
        let results = run(dir.path(), &shape, &strata, dir.path());
        assert_ratios(
            &results,
            &[
                ("pytorch-eager", Some(2.0)),
                ("pytorch-eager-sdpa", Some(1.6)),
                ("deepspeed-zero-offload", Some(1.0)),
                ("deepspeed-zero-infinity", Some(0.5)),
            ],
        );
    }

    #[test]
    fn lora_peers_wrap_strata_s_shape_with_peft_of_the_same_adapter() {
        // A stand-in Python: checks it was handed the script that wraps the model with
        // peft, the adapter's rank, alpha and targets after the eager engine, and answers
        // a step time per attention; the DeepSpeed engines must not run.
        let script = r#"#!/bin/sh
grep -q 'get_peft_model' "$1" || exit 5
case "$*" in *'--engine zero'*) exit 6;; esac
case "$*" in *'--lora 4 --lora-alpha 8 --lora-targets q_proj,v_proj '*) ;; *) exit 7;; esac
case "$*" in
  *'--engine eager --attn eager '*) t=2.0;;
  *'--engine eager --attn sdpa '*) t=4.0;;
  *'--engine eager --autocast bf16 '*) t=1.0;;
  *) exit 8;;
esac
"#;
        let dir = stand_in_env(&format!("{script}{ANSWER_T}"), &[]);
        let targets = vec!["q_proj".to_string(), "v_proj".to_string()];
        let shape = PeerShape {
            lora: Some(LoraConfig::new(4, 8.0, 0.0, targets).unwrap()),
            ..tiny_llama_shape()
        };
        let strata = [
            (BuiltinPolicy::AllOnDevice, 4.0),
            (BuiltinPolicy::CpuOffload, 4.0),
        ];
        let results = run(dir.path(), &shape, &strata, dir.path());
        assert_ratios(
            &results,
            &[
                ("peft-lora-eager", Some(2.0)),
                ("peft-lora-eager-sdpa", Some(1.0)),
                ("deepspeed-zero-offload", None),
                ("deepspeed-zero-infinity", None),
            ],
        );
        // The DeepSpeed rows say why they did not run, beside strata's number.
        assert!(results[2].reason.as_deref().unwrap().contains("--lora"));
        assert_eq!(results[2].strata_tokens_per_s, Some(4.0));
        let bf16 = run_bf16(dir.path(), &shape, &strata, dir.path());
        assert_eq!(bf16[0].peer, "peft-lora-eager-bf16-autocast");
        assert_eq!(bf16[0].strata_over_peer, Some(4.0), "{:?}", bf16[0].reason);
    }
}
