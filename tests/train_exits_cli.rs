//! Every way out of `strata train` keeps the trained state: a non-finite loss, a write
//! that fails mid-run, an `--out` that cannot be written, Ctrl-C without
//! `--checkpoint-dir`; and a closed stdout or stderr never panics.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A run's folders: swap files, the scratch folder (TMPDIR: the built-in corpus and the
/// rescue folder) and whatever a test adds.
struct Run {
    dir: tempfile::TempDir,
}

impl Run {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("nvme")).unwrap();
        std::fs::create_dir_all(dir.path().join("tmp")).unwrap();
        Run { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `strata train` on the default job's model, small, with `extra`.
    fn command(&self, extra: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
        c.args(["train", "--batch", "2", "--seq", "32", "--nvme"])
            .arg(self.path("nvme"))
            .args(extra)
            .env("TMPDIR", self.path("tmp"))
            .env("CUDA_VISIBLE_DEVICES", "");
        c
    }

    fn train(&self, extra: &[&str]) -> Output {
        self.command(extra)
            .output()
            .expect("the strata binary runs")
    }

    fn rescue_root(&self) -> PathBuf {
        self.path("tmp").join("strata-rescue")
    }
}

/// The one `strata: error:` line of a run.
fn error_line(out: &Output) -> String {
    let stderr = text(&out.stderr);
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("strata: error:"))
        .collect();
    assert_eq!(errors.len(), 1, "one error line expected:\n{stderr}");
    errors[0].to_string()
}

/// The checkpoint an error line or a `checkpoint:` line names after "--resume ".
fn resume_path(line: &str) -> PathBuf {
    let at = line.find("--resume ").expect("a --resume path") + "--resume ".len();
    PathBuf::from(line[at..].split(')').next().unwrap())
}

/// Checks `ckpt` is a checkpoint of step `step` that a run resumes from and trains on
/// with a finite loss.
fn assert_resumes(run: &Run, ckpt: &Path, step: u64, extra: &[&str]) {
    assert!(
        ckpt.ends_with(format!("step-{step:08}")),
        "{}",
        ckpt.display()
    );
    let next = (step + 1).to_string();
    let mut args = vec!["--resume", ckpt.to_str().unwrap(), "--steps", &next];
    args.extend(extra);
    let out = run.train(&args);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(
        stdout.contains(&format!("resuming {}", ckpt.display())),
        "{stdout}"
    );
    let losses = stdout
        .lines()
        .find(|l| l.starts_with("loss first -> last"))
        .expect("a summary");
    assert!(
        !losses.contains("NaN") && !losses.contains("inf"),
        "{losses}"
    );
}

#[test]
fn a_nonfinite_loss_stops_before_its_update_and_keeps_the_state_before_it() {
    let run = Run::new();
    // A learning rate of 1e30 makes step 1's update blow the weights up: step 2's loss
    // is not finite.
    let diverge = ["--lr", "1e30", "--warmup-steps", "0"];
    let out = run.train(&[&diverge[..], &["--steps", "20"]].concat());
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let error = error_line(&out);
    assert!(
        error.contains("step 2: the loss is NaN") && error.contains("stopped before its update"),
        "{error}"
    );
    assert!(error.contains("kept the state after step 1 in"), "{error}");
    let ckpt = resume_path(&error);
    assert!(ckpt.starts_with(run.rescue_root()), "{}", ckpt.display());
    // The state before step 2's update: finite, and a run resumes from it.
    let saved = strata::engine::checkpoint::load(&ckpt).unwrap();
    assert_eq!(saved.state.step, 1);
    for buffers in [&saved.params, &saved.m, &saved.v] {
        assert!(buffers.iter().flatten().all(|x| x.is_finite()));
    }
    let out = run.train(&[
        "--resume",
        ckpt.to_str().unwrap(),
        "--steps",
        "2",
        "--on-nonfinite",
        "skip",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("resuming"),
        "{}",
        text(&out.stdout)
    );

    // Skipping goes on past the non-finite steps, saying so.
    let out = run.train(&[&diverge[..], &["--steps", "4", "--on-nonfinite", "skip"]].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr)
            .contains("step 2: the loss is NaN and the gradient norm NaN: its update is skipped"),
        "{}",
        text(&out.stderr)
    );
    // Skipping needs the clipping norm's barrier.
    let out = run.train(&["--clip", "0", "--on-nonfinite", "skip"]);
    let error = error_line(&out);
    assert!(
        error.contains("--on-nonfinite") && error.contains("give --clip 1.0"),
        "{error}"
    );
}

#[test]
fn a_write_that_fails_mid_run_keeps_the_state() {
    let run = Run::new();
    // /dev/full opens, and refuses every write (ENOSPC): the first step's metrics line.
    let out = run.train(&["--steps", "5", "--log-jsonl", "/dev/full"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let error = error_line(&out);
    assert!(
        error.contains("--log-jsonl: No space left on device"),
        "{error}"
    );
    assert!(error.contains("kept the state after step 1 in"), "{error}");
    assert_resumes(&run, &resume_path(&error), 1, &[]);

    // With --checkpoint-dir, beside the schedule's checkpoints, not among them.
    let ckpt = run.path("ckpt");
    let out = run.train(&[
        "--steps",
        "5",
        "--log-jsonl",
        "/dev/full",
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
    ]);
    let error = error_line(&out);
    let rescued = resume_path(&error);
    assert_eq!(
        rescued,
        ckpt.join("rescue").join("step-00000001"),
        "{error}"
    );
    assert!(strata::engine::checkpoint::list(&ckpt).unwrap().is_empty());
    assert_resumes(&run, &rescued, 1, &[]);
}

#[test]
fn an_out_that_cannot_be_written_names_the_cause_and_keeps_the_trained_state() {
    let run = Run::new();
    std::fs::write(run.path("a-file"), b"").unwrap();
    let out_dir = run.path("a-file").join("model");
    let out = run.train(&["--steps", "3", "--out", out_dir.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let error = error_line(&out);
    assert!(
        error.contains("writing the trained model to --out") && error.contains("Not a directory"),
        "{error}"
    );
    assert!(error.contains("kept the state after step 3 in"), "{error}");
    assert_resumes(&run, &resume_path(&error), 3, &[]);

    // With --checkpoint-dir, the last step's checkpoint is the state: named, not saved
    // again.
    let ckpt = run.path("ckpt");
    let out = run.train(&[
        "--steps",
        "3",
        "--out",
        out_dir.to_str().unwrap(),
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
    ]);
    let error = error_line(&out);
    assert!(
        error.contains(&format!(
            "the state after step 3 is in the checkpoint {}",
            ckpt.join("step-00000003").display()
        )),
        "{error}"
    );
}

#[test]
fn ctrl_c_is_acknowledged_at_once_and_saves_without_a_checkpoint_dir() {
    let run = Run::new();
    // Steps of 32 micro-batches last long enough to see the acknowledgement come before
    // the step ends.
    let mut child = run
        .command(&["--steps", "100000", "--grad-accum", "32"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while stderr.read_line(&mut line).unwrap() > 0 && !line.contains("step 1/") {
        line.clear();
    }
    let sent = Instant::now();
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let mut acknowledged = None;
    let mut rest = String::new();
    line.clear();
    while stderr.read_line(&mut line).unwrap() > 0 {
        if line.contains("strata: Ctrl-C: finishing step, then saving; press again to quit now") {
            acknowledged.get_or_insert(sent.elapsed());
        }
        rest.push_str(&line);
        line.clear();
    }
    let out = child.wait_with_output().unwrap();
    let at = acknowledged.unwrap_or_else(|| panic!("no acknowledgement:\n{rest}"));
    assert!(at < Duration::from_millis(500), "acknowledged after {at:?}");
    assert!(out.status.success(), "{}\n{rest}", out.status);
    let stdout = text(&out.stdout);
    let rescue = run.rescue_root();
    assert!(
        stdout.contains(&format!(
            "nothing of this run is saved except on Ctrl-C or a failure, to {}",
            rescue.display()
        )),
        "{stdout}"
    );
    assert!(stdout.contains("interrupted at step"), "{stdout}");
    let line = stdout
        .lines()
        .find(|l| l.starts_with("checkpoint: "))
        .unwrap_or_else(|| panic!("no checkpoint named:\n{stdout}"));
    let ckpt = resume_path(line);
    assert!(ckpt.starts_with(&rescue), "{}", ckpt.display());
    let step: u64 = ckpt.file_name().unwrap().to_str().unwrap()["step-".len()..]
        .parse()
        .unwrap();
    assert_resumes(&run, &ckpt, step, &["--grad-accum", "32"]);
}

/// A pipe whose reader has gone: every write to it fails with EPIPE.
fn closed_pipe() -> std::io::PipeWriter {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    writer
}

#[test]
fn a_closed_stdout_and_stderr_never_panic_and_train_still_saves() {
    let run = Run::new();
    let ckpt = run.path("ckpt");
    let status = run
        .command(&["--steps", "20", "--checkpoint-dir", ckpt.to_str().unwrap()])
        .stdout(closed_pipe())
        .stderr(closed_pipe())
        .status()
        .unwrap();
    assert!(status.success(), "{status}");
    assert!(ckpt.join("step-00000020").is_dir(), "no checkpoint written");

    let strata = env!("CARGO_BIN_EXE_strata");
    for args in [
        &["info"][..],
        &["plan"],
        &["model"],
        &["doctor"],
        &["train", "--print-config"],
        // The benches print with println!, which panics on a closed stdout unless
        // SIGPIPE ends the process first.
        &["bench", "adam", "--params", "1000", "--threads", "1"],
    ] {
        let status = Command::new(strata)
            .args(args)
            .env("CUDA_VISIBLE_DEVICES", "")
            .stdout(closed_pipe())
            .stderr(closed_pipe())
            .status()
            .unwrap();
        assert_ne!(status.code(), Some(101), "strata {args:?} panicked");
    }
}

/// Overwrites a few bytes in every 12 KiB of each swap file `pid` holds open (they are
/// unlinked: reached through /proc), as a failing drive would.
fn corrupt_swap_files(pid: u32) {
    use std::io::{Seek, SeekFrom, Write};
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return;
    };
    for fd in fds.flatten() {
        let is_swap = std::fs::read_link(fd.path())
            .is_ok_and(|target| target.to_string_lossy().contains(".swap"));
        let Ok(mut file) = std::fs::OpenOptions::new().write(true).open(fd.path()) else {
            continue;
        };
        let len = file.metadata().map_or(0, |m| m.len());
        for offset in (0..len).step_by(3 * 4096).filter(|_| is_swap) {
            let _ = file.seek(SeekFrom::Start(offset));
            let _ = file.write_all(&[0xff; 64]);
        }
    }
}

#[test]
fn a_step_that_fails_twice_keeps_what_it_can_and_names_the_last_checkpoint() {
    let run = Run::new();
    let ckpt = run.path("ckpt");
    let mut child = run
        .command(&[
            "--steps",
            "100000",
            "--checkpoint-every",
            "3",
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while stderr.read_line(&mut line).unwrap() > 0 && !line.contains("saved checkpoint") {
        line.clear();
    }
    let reader = std::thread::spawn(move || {
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut stderr, &mut rest).unwrap();
        rest
    });
    // The swap files go bad under the run, and stay bad: the step fails, and so does its
    // retry.
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() && start.elapsed() < Duration::from_secs(60) {
        corrupt_swap_files(child.id());
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = child.kill();
    let status = child.wait().unwrap();
    let rest = reader.join().unwrap();
    assert_eq!(status.code(), Some(1), "{rest}");
    let error = rest
        .lines()
        .find(|l| l.starts_with("strata: error:"))
        .unwrap_or_else(|| panic!("no error:\n{rest}"));
    if error.starts_with("strata: error: step ") {
        assert!(error.contains("retried with the same batches"), "{error}");
    }
    // What remains is named, and whole: the checkpoint of the state before the step when
    // it was the last saved, else the last checkpoint (the state on the drive cannot be
    // read back, or its blocks hold different steps).
    let last = match error.contains("kept the state after step") {
        // Saved apart from the schedule's checkpoints.
        true => resume_path(error),
        false => {
            let named = ["is in the checkpoint ", "the last checkpoint, "]
                .iter()
                .find_map(|words| error.find(words).map(|at| &error[at + words.len()..]))
                .unwrap_or_else(|| panic!("no checkpoint named: {error}"));
            PathBuf::from(named.split([',', ' ']).next().unwrap())
        }
    };
    assert!(last.starts_with(&ckpt), "{error}");
    strata::engine::checkpoint::load(&last).unwrap();
}

#[test]
fn a_model_write_the_system_refuses_names_the_system_error() {
    let run = Run::new();
    let ckpt = run.path("ckpt");
    let out = run.train(&["--steps", "1", "--checkpoint-dir", ckpt.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // A file size limit of 1000 KiB (SIGXFSZ ignored, so the write fails with EFBIG)
    // stands for a full disk: the 3.4 MB model file cannot be written.
    let exported = run.path("exported");
    let script = format!(
        "trap '' XFSZ; ulimit -f 1000; exec {} checkpoint export {} --out {}",
        env!("CARGO_BIN_EXE_strata"),
        ckpt.join("step-00000001").display(),
        exported.display()
    );
    let out = Command::new("bash").args(["-c", &script]).output().unwrap();
    let error = error_line(&out);
    assert!(error.contains("File too large (os error 27)"), "{error}");
    assert!(
        !error.contains("not a readable safetensors file"),
        "{error}"
    );
}
