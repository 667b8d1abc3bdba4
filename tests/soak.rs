//! The soak: `strata train` under an NVMe-offload plan with I/O faults injected into its
//! swap files (`STRATA_FAULTS`, a new fault seed each run, letting faults in from a
//! drawn moment on) and SIGKILLs at drawn moments, in steps and in checkpoint saves;
//! whenever it stops (a fault that reached it, or killed) it is resumed from its
//! checkpoint folder, until it reaches its last step and exits 0. Every checkpoint it
//! wrote on the way must be the undisturbed run's of the same step (files' lengths and
//! crc32c, trainer state), and its last checkpoint and `--out` must be byte-identical to
//! the undisturbed run's.
//!
//! `cargo test --test soak` runs a short soak (20 steps); `dev/soak` runs the long one,
//! ignored here, and records it (`SOAK_RESULTS`).

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// The fault kinds that must reach the caller (the run stops); the others are absorbed.
const REACH_CALLER: [&str; 4] = ["eio", "enospc", "eof", "bitflip"];

/// What a soak does.
struct Soak {
    steps: u64,
    checkpoint_every: u64,
    /// `STRATA_FAULTS` less the seed and `after-ms`, which each run draws.
    faults: &'static str,
    /// Each run lets faults in after a drawn 0 to this many steps' time (the undisturbed
    /// run's median step): a fault that reaches the run comes at its first step after.
    after_steps_max: u64,
    /// Runs stopped by a fault wanted at least: until there are this many, each run lets
    /// faults in within a quarter of `after_steps_max`.
    fault_exits_min: usize,
    /// Kills wanted at least: until there are this many, every run is armed with one.
    kills_min: usize,
    /// Beyond those, the chance that a run is armed with a kill.
    kill_chance: f64,
    /// Seeds every draw of the driver (fault seeds, moments, kills).
    seed: u64,
    /// Runs after which the soak gives up (the run makes no progress).
    runs_max: usize,
}

/// The fault kinds and rates of both soaks: most fault seeds hold a fault that reaches
/// the run (it stops at its first step after `after-ms`); every run absorbs short
/// transfers, EINTR and delays.
const FAULTS: &str = "rate=0.03,kinds=eio,enospc,eof,bitflip,short=0.05,eintr=0.05,delay=0.02";

/// A splitmix64 stream: the driver's draws.
struct Draws(u64);

impl Draws {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }

    /// A number in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / ((1u64 << 53) as f64) < p
    }
}

/// When the driver kills a run.
#[derive(Debug, Clone, Copy)]
enum Kill {
    /// `delay` after the run logs step `step` (in the step after it, or in its save).
    AfterStep { step: u64, delay: Duration },
    /// As soon as a checkpoint save is seen under way (its temporary folder exists).
    InSave,
}

/// How one run ended.
enum End {
    Exited(ExitStatus),
    Killed { in_save: bool },
}

/// What the disturbed run went through.
#[derive(Default)]
struct Tally {
    runs: usize,
    faults: BTreeMap<String, u64>,
    kills: usize,
    kills_in_save: usize,
    /// Runs that stopped on an error (a fault that reached them).
    fault_exits: usize,
    /// Runs that met a fault that must reach the caller and still finished.
    finished_after_fault: usize,
    /// Each error line, with its run's fault seed.
    errors: Vec<Value>,
    /// Checkpoints compared with the undisturbed run's.
    checkpoints_checked: usize,
}

impl Tally {
    fn reached_caller(&self) -> u64 {
        REACH_CALLER
            .iter()
            .filter_map(|k| self.faults.get(*k))
            .sum()
    }

    fn total_faults(&self) -> u64 {
        self.faults.values().sum()
    }
}

/// The arguments of every run: relative paths, so the undisturbed run's trainer state
/// (which holds the settings) is the disturbed one's.
fn train_args(s: &Soak) -> Vec<String> {
    let (steps, every) = (s.steps.to_string(), s.checkpoint_every.to_string());
    [
        "train",
        "--policy",
        "nvme-offload",
        "--device",
        "cpu",
        "--batch",
        "2",
        "--seq",
        "32",
        "--steps",
        &steps,
        "--checkpoint-dir",
        "ck",
        "--checkpoint-every",
        &every,
        "--keep-checkpoints",
        "100000",
        "--out",
        "out",
        "--nvme",
        "nvme",
        "--log-jsonl",
        "log.jsonl",
    ]
    .map(String::from)
    .to_vec()
}

/// Runs `strata` in `dir` (output to `dir/runs/<n>.{out,err}`), killing it as `kill`
/// says; the end, and its stderr.
fn run_once(
    dir: &Path,
    n: usize,
    args: &[String],
    faults: Option<&str>,
    kill: Option<Kill>,
) -> (End, String) {
    let logs = dir.join("runs");
    std::fs::create_dir_all(&logs).unwrap();
    std::fs::create_dir_all(dir.join("nvme")).unwrap();
    let err_path = logs.join(format!("{n:03}.err"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_strata"));
    cmd.current_dir(dir)
        .args(args)
        .env_remove("STRATA_FAULTS")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(logs.join(format!("{n:03}.out"))).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap());
    if let Some(f) = faults {
        cmd.env("STRATA_FAULTS", f);
    }
    let log = dir.join("log.jsonl");
    let mut log_from = std::fs::metadata(&log).map_or(0, |m| m.len());
    let mut last_step = 0;
    let mut child = Reaped(cmd.spawn().expect("the strata binary runs"));
    let child = &mut child.0;
    let started = Instant::now();
    let end = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break End::Exited(status);
        }
        let fire = match kill {
            Some(Kill::AfterStep { step, delay }) => {
                last_step = last_step.max(logged_step(&log, &mut log_from));
                if last_step >= step {
                    std::thread::sleep(delay);
                }
                last_step >= step
            }
            Some(Kill::InSave) => saving(&dir.join("ck"), child.id()),
            None => false,
        };
        if fire {
            // SIGKILL; the process may have exited meanwhile, which counts as its exit.
            if child.kill().is_ok() {
                child.wait().unwrap();
                break End::Killed {
                    in_save: saving(&dir.join("ck"), child.id()),
                };
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "run {n} still running after 5 minutes (hung?): {}",
            err_path.display()
        );
        std::thread::sleep(Duration::from_millis(2));
    };
    (end, std::fs::read_to_string(&err_path).unwrap())
}

/// A run killed when dropped, so that a failed assertion leaves no run behind.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The highest step in the lines appended to the metrics log since `from` (moved on).
fn logged_step(log: &Path, from: &mut u64) -> u64 {
    let Ok(mut f) = std::fs::File::open(log) else {
        return 0;
    };
    let len = f.metadata().unwrap().len();
    if len <= *from {
        return 0;
    }
    let mut tail = String::new();
    f.seek(SeekFrom::Start(*from)).unwrap();
    f.read_to_string(&mut tail).unwrap();
    // Only whole lines (each is one write): a partial last line is read next time.
    let whole = tail.rfind('\n').map_or(0, |i| i + 1);
    *from += whole as u64;
    tail[..whole]
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok()?["step"].as_u64())
        .max()
        .unwrap_or(0)
}

/// Whether process `pid` has a checkpoint save under way (or cut short) in `ck`: its
/// temporary folder `.step-<step>.tmp-<pid>` is there.
fn saving(ck: &Path, pid: u32) -> bool {
    let suffix = format!(".tmp-{pid}");
    std::fs::read_dir(ck).is_ok_and(|d| {
        d.filter_map(Result::ok).any(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with(".step-") && name.ends_with(&suffix)
        })
    })
}

/// The steps of the complete checkpoints in `ck`.
fn checkpoint_steps(ck: &Path) -> Vec<u64> {
    let Ok(dir) = std::fs::read_dir(ck) else {
        return Vec::new();
    };
    let mut steps: Vec<u64> = dir
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("step-")?.parse().ok())
        .collect();
    steps.sort();
    steps
}

/// What a checkpoint must match: its manifest less the trainer state's entry, and its
/// trainer state less `resume` (the one setting a resumed run adds).
fn checkpoint_identity(dir: &Path) -> Value {
    let read = |f: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join(f)).unwrap()).unwrap()
    };
    let mut manifest = read("manifest.json");
    manifest["files"]
        .as_object_mut()
        .unwrap()
        .remove("trainer_state.json");
    let mut state = read("trainer_state.json");
    state["config"].as_object_mut().unwrap().remove("resume");
    json!({ "manifest": manifest, "trainer_state": state })
}

/// The undisturbed run.
struct Reference {
    /// Each checkpoint's identity, by step.
    checkpoints: BTreeMap<u64, Value>,
    /// Its median step.
    step_ms: u64,
}

/// The undisturbed run, in `dir`.
fn reference(s: &Soak, dir: &Path) -> Reference {
    let (end, stderr) = run_once(dir, 0, &train_args(s), None, None);
    assert!(
        matches!(end, End::Exited(st) if st.success()),
        "the undisturbed run failed:\n{stderr}"
    );
    let ck = dir.join("ck");
    let steps = checkpoint_steps(&ck);
    let want: Vec<u64> = (1..=s.steps)
        .filter(|k| k % s.checkpoint_every == 0 || *k == s.steps)
        .collect();
    assert_eq!(steps, want, "the undisturbed run's checkpoints");
    let mut seconds: Vec<f64> = std::fs::read_to_string(dir.join("log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["seconds"]
                .as_f64()
                .unwrap()
        })
        .collect();
    seconds.sort_by(f64::total_cmp);
    Reference {
        checkpoints: steps
            .into_iter()
            .map(|k| (k, checkpoint_identity(&ck.join(format!("step-{k:08}")))))
            .collect(),
        step_ms: (seconds[seconds.len() / 2] * 1e3).ceil() as u64,
    }
}

/// The faults of each kind the run's stderr counts (`strata: faults injected (seed S):
/// eio 1, short 2`).
fn fault_counts(stderr: &str) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for line in stderr.lines() {
        let Some(rest) = line.strip_prefix("strata: faults injected (seed ") else {
            continue;
        };
        let (_, list) = rest.split_once("): ").expect("a count line");
        for item in list.split(", ") {
            let (kind, n) = item.split_once(' ').expect("kind and count");
            *counts.entry(kind.to_string()).or_default() += n.parse::<u64>().unwrap();
        }
    }
    counts
}

/// One disturbed run's process `n` with fault seed `seed`: resumed when there is a
/// checkpoint, armed with a kill as drawn. Tallies how it ended.
fn disturbed_run(
    s: &Soak,
    dir: &Path,
    n: usize,
    step_ms: u64,
    draws: &mut Draws,
    tally: &mut Tally,
) -> bool {
    let ck = dir.join("ck");
    let start = checkpoint_steps(&ck).last().copied().unwrap_or(0);
    let mut args = train_args(s);
    if start > 0 {
        args.extend(["--resume".to_string(), "ck".to_string()]);
    }
    // A partial --out of a run that failed while writing it is no result.
    let _ = std::fs::remove_dir_all(dir.join("out"));
    let seed = draws.next();
    let window = match tally.fault_exits < s.fault_exits_min {
        true => s.after_steps_max / 4,
        false => s.after_steps_max,
    };
    let faults = format!(
        "seed={seed},after-ms={},{}",
        draws.range(0, window * step_ms),
        s.faults
    );
    let armed = start < s.steps && (tally.kills < s.kills_min || draws.chance(s.kill_chance));
    let kill = armed.then(|| match draws.chance(0.5) {
        true => Kill::InSave,
        false => Kill::AfterStep {
            step: draws.range(start + 1, s.steps.min(start + 2 * s.checkpoint_every)),
            delay: Duration::from_millis(draws.range(0, 150)),
        },
    });
    let (end, stderr) = run_once(dir, n, &args, Some(&faults), kill);
    let counts = fault_counts(&stderr);
    let fatal: u64 = REACH_CALLER.iter().filter_map(|k| counts.get(*k)).sum();
    for (kind, c) in &counts {
        *tally.faults.entry(kind.clone()).or_default() += c;
    }
    tally.runs += 1;
    let log = dir.join(format!("runs/{n:03}.err"));
    let finished = match end {
        End::Killed { in_save } => {
            tally.kills += 1;
            tally.kills_in_save += usize::from(in_save);
            false
        }
        End::Exited(status) if status.success() => {
            tally.finished_after_fault += usize::from(fatal > 0);
            true
        }
        End::Exited(status) => {
            // A stop must come from an injected fault, as one line; a panic is a bug.
            assert_eq!(
                status.code(),
                Some(1),
                "run {n} ({faults}): {}",
                log.display()
            );
            assert!(
                fatal > 0,
                "run {n} ({faults}) failed with no fault that must reach it: {}",
                log.display()
            );
            let error = stderr.lines().find(|l| l.starts_with("strata: error:"));
            let error =
                error.unwrap_or_else(|| panic!("run {n}: no error line: {}", log.display()));
            tally.fault_exits += 1;
            tally
                .errors
                .push(json!({ "run": n, "faults": faults, "error": error }));
            false
        }
    };
    let how = match end {
        End::Killed { .. } => format!("killed ({kill:?})"),
        End::Exited(st) => st.to_string(),
    };
    eprintln!("soak: run {n} from step {start}, {faults}: {how}; {counts:?}");
    finished
}

/// Every checkpoint in `ck` not checked yet must be the undisturbed run's of its step.
fn check_checkpoints(
    ck: &Path,
    reference: &BTreeMap<u64, Value>,
    checked: &mut Vec<u64>,
    last_run: &str,
) {
    for step in checkpoint_steps(ck) {
        if checked.contains(&step) {
            continue;
        }
        let want = reference.get(&step).unwrap_or_else(|| {
            panic!("a checkpoint of step {step}, which the undisturbed run has not")
        });
        let got = checkpoint_identity(&ck.join(format!("step-{step:08}")));
        assert!(
            &got == want,
            "checkpoint step {step} differs from the undisturbed run's (written by {last_run}):\n\
             got {got}\nwant {want}"
        );
        checked.push(step);
    }
}

/// Files of `a` and `b` that must hold the same bytes.
fn assert_same_bytes(a: &Path, b: &Path, files: &[&str]) {
    for f in files {
        let (x, y) = (std::fs::read(a.join(f)), std::fs::read(b.join(f)));
        let (x, y) = (
            x.unwrap(),
            y.unwrap_or_else(|e| panic!("{}: {e}", b.join(f).display())),
        );
        assert!(x == y, "{f} differs: {} and {}", a.display(), b.display());
    }
}

/// Runs the soak in `root`: the undisturbed run, then the disturbed one until it
/// finishes; checks every checkpoint and the end. What the disturbed run went through.
fn soak(s: &Soak, root: &Path) -> Tally {
    let (calm, rough) = (root.join("undisturbed"), root.join("disturbed"));
    let reference = reference(s, &calm);
    let mut draws = Draws(s.seed);
    let mut tally = Tally::default();
    let mut checked = Vec::new();
    for n in 1..=s.runs_max {
        let finished = disturbed_run(s, &rough, n, reference.step_ms, &mut draws, &mut tally);
        let last = format!(
            "run {n}, {}",
            rough.join(format!("runs/{n:03}.err")).display()
        );
        check_checkpoints(
            &rough.join("ck"),
            &reference.checkpoints,
            &mut checked,
            &last,
        );
        if finished {
            break;
        }
    }
    assert_eq!(
        checkpoint_steps(&rough.join("ck")).last(),
        Some(&s.steps),
        "no finished run in {} runs",
        s.runs_max
    );
    let last = format!("ck/step-{:08}", s.steps);
    let files = ["model.safetensors", "optimizer.safetensors", "config.json"];
    assert_same_bytes(&calm.join(&last), &rough.join(&last), &files);
    let out: Vec<String> = std::fs::read_dir(calm.join("out"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let out: Vec<&str> = out.iter().map(String::as_str).collect();
    assert!(out.contains(&"model.safetensors"), "{out:?}");
    assert_same_bytes(&calm.join("out"), &rough.join("out"), &out);
    tally.checkpoints_checked = checked.len();
    tally
}

#[test]
fn a_short_soak_with_faults_and_a_kill_ends_byte_identical() {
    let root = tempfile::tempdir().unwrap();
    let s = Soak {
        steps: 20,
        checkpoint_every: 5,
        faults: FAULTS,
        after_steps_max: 20,
        fault_exits_min: 3,
        kills_min: 1,
        kill_chance: 0.2,
        seed: 28,
        runs_max: 60,
    };
    let t = soak(&s, root.path());
    assert!(t.kills >= 1, "kills: {}", t.kills);
    assert!(t.total_faults() >= 5, "faults: {:?}", t.faults);
    assert!(
        t.fault_exits >= 1,
        "no run stopped on a fault: {:?}",
        t.faults
    );
    assert!(t.checkpoints_checked >= 4);
}

/// The long soak, recorded by `dev/soak`: `SOAK_STEPS` (default 240) steps, `SOAK_SEED`,
/// results to `SOAK_RESULTS` when set.
#[test]
#[ignore = "minutes long: dev/soak runs it"]
fn the_long_soak_ends_byte_identical() {
    let env = |k: &str, d: u64| std::env::var(k).map_or(d, |v| v.parse().unwrap());
    let s = Soak {
        steps: env("SOAK_STEPS", 240),
        checkpoint_every: 5,
        faults: FAULTS,
        after_steps_max: 20,
        fault_exits_min: 20,
        kills_min: 8,
        kill_chance: 0.3,
        seed: env("SOAK_SEED", 28),
        runs_max: 400,
    };
    let root = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let t = soak(&s, root.path());
    let wall_s = started.elapsed().as_secs_f64();
    let record = record(&s, &t, wall_s);
    eprintln!("{}", serde_json::to_string_pretty(&record).unwrap());
    if let Ok(path) = std::env::var("SOAK_RESULTS") {
        let text = serde_json::to_string_pretty(&record).unwrap() + "\n";
        std::fs::write(&path, text).unwrap();
    }
    assert!(s.steps >= 200 || std::env::var("SOAK_STEPS").is_ok());
    assert!(t.total_faults() >= 50, "faults: {:?}", t.faults);
    assert!(t.kills >= 5, "kills: {}", t.kills);
}

/// The results file's record of a finished soak.
fn record(s: &Soak, t: &Tally, wall_s: f64) -> Value {
    let sh = |cmd: &str, args: &[&str]| {
        Command::new(cmd)
            .args(args)
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|c| {
        c.lines()
            .find(|l| l.starts_with("model name"))
            .map(|l| l.split_once(':').unwrap().1.trim().to_string())
    });
    let command: Vec<String> = ["strata".to_string()]
        .into_iter()
        .chain(train_args(s))
        .collect();
    json!({
        "what": "the soak (tests/soak.rs, dev/soak): strata train under nvme-offload with I/O \
                 faults injected into its swap files and SIGKILLs, resumed from its checkpoint \
                 folder each time it stopped, against an undisturbed run",
        "command": command,
        "faults_env": format!(
            "STRATA_FAULTS=seed=<drawn>,after-ms=<drawn, 0 to {} steps' time>,{}",
            s.after_steps_max, s.faults
        ),
        "driver_seed": s.seed,
        "machine": {
            "cpu": cpu,
            "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        },
        "commit": sh("git", &["rev-parse", "HEAD"]),
        "date_utc": sh("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]),
        "steps": s.steps,
        "checkpoint_every": s.checkpoint_every,
        "faults_by_kind": t.faults,
        "faults_total": t.total_faults(),
        "faults_reaching_the_caller": t.reached_caller(),
        "faults_absorbed": t.total_faults() - t.reached_caller(),
        "runs": t.runs,
        "restarts": t.runs - 1,
        "stopped_by_a_fault": t.fault_exits,
        "finished_after_a_fault_that_reached_it": t.finished_after_fault,
        "kills": t.kills,
        "kills_during_a_checkpoint_save": t.kills_in_save,
        "checkpoints_compared": t.checkpoints_checked,
        "errors": t.errors,
        "wall_s": (wall_s * 10.0).round() / 10.0,
        "result": "byte-identical: the last checkpoint's model.safetensors, \
                   optimizer.safetensors and config.json, and every file of --out; every \
                   checkpoint on the way the same as the undisturbed run's",
    })
}
