//! `strata bench nvme` as a user runs it: a small run end to end, its JSON, its errors.

use std::path::PathBuf;
use std::process::Command;

fn strata() -> Command {
    Command::new(env!("CARGO_BIN_EXE_strata"))
}

fn scratch() -> tempfile::TempDir {
    let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(&base).unwrap();
    tempfile::tempdir_in(base).unwrap()
}

/// Runs `strata bench nvme ARGS --path DIR --json DIR/nvme.json`, checks that it
/// succeeded, and returns its stdout, stderr and JSON report.
fn run_nvme(dir: &tempfile::TempDir, args: &[&str]) -> (String, String, serde_json::Value) {
    let json = dir.path().join("nvme.json");
    let out = strata()
        .args(["bench", "nvme"])
        .args(args)
        .arg("--path")
        .arg(dir.path())
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (stdout, stderr, report)
}

#[test]
fn small_run_writes_tables_and_json() {
    let dir = scratch();
    let (stdout, stderr, report) = run_nvme(
        &dir,
        &[
            "--size", "16MiB", "--extent", "4MiB", "--block", "256KiB", "--qd", "8", "--repeat",
            "1",
        ],
    );
    assert!(
        stdout.contains("checksums off") && stdout.contains("checksums on"),
        "{stdout}"
    );
    let strata = report["strata"].as_array().unwrap();
    assert_eq!(strata.len(), 2);
    // As an NVMe lane of the executor moves extents: two in flight, every chunk through
    // the registered host arena when io_uring runs.
    assert_eq!(report["in_flight"], 2);
    for s in strata {
        for op in ["write", "read"] {
            let rate = s[op]["median_gib_per_s"].as_f64().unwrap();
            assert!(rate > 0.0 && rate.is_finite(), "{op}: {rate}");
            assert!(s[op]["chunk_latency"]["p50_us"].as_f64().unwrap() > 0.0);
        }
        if report["backend"] == "io_uring" {
            // 16 MiB in 256 KiB chunks, written and read once.
            assert_eq!(s["fixed_chunks"], 128, "{s}");
            assert_eq!(s["plain_chunks"], 0, "{s}");
        }
    }
    // The swap files are gone afterwards; only the JSON is left.
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(left.len(), 1, "{left:?}");

    if report["fio_version"].is_null() {
        println!("skipping the fio comparison checks: fio is not installed");
        assert!(stderr.contains("fio is not on the PATH"), "{stderr}");
        return;
    }
    let fio = report["fio"].as_array().unwrap();
    assert!(!fio.is_empty(), "fio ran: {stderr}");
    // The huge-page configuration ran, or the report says why not.
    let huge = "fio io_uring fixedbufs+registerfiles, huge pages";
    let skipped = report["skipped"].as_array().unwrap();
    assert!(
        fio.iter().any(|f| f["name"] == huge) || skipped.iter().any(|s| s["name"] == huge),
        "{report}"
    );
    let ratios = report["ratios"].as_array().unwrap();
    assert_eq!(
        ratios.len(),
        4,
        "2 directions x 2 settings, against the best fio"
    );
    assert!(stdout.contains("strata/peer"), "{stdout}");
}

/// A stand-in for the peers' env whose ds_io prints the rate ds_io prints, or fails.
fn fake_peers(dir: &std::path::Path, script: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let env = dir.join("peers");
    std::fs::create_dir_all(env.join("venv/bin")).unwrap();
    let ds_io = env.join("venv/bin/ds_io");
    std::fs::write(&ds_io, script).unwrap();
    std::fs::set_permissions(&ds_io, std::fs::Permissions::from_mode(0o755)).unwrap();
    env
}

#[test]
fn ds_io_runs_in_every_round_when_its_env_is_given() {
    let dir = scratch();
    let peers_dir = tempfile::tempdir().unwrap();
    // Checks it was called as the bench promises, then answers as ds_io does.
    let env = fake_peers(
        peers_dir.path(),
        "#!/bin/sh\n\
         case \"$*\" in *'--io_size 8388608 --block_size 262144 --queue_depth 8 --engine aio_handle'*) ;; \
         *) echo \"unexpected: $*\" >&2; exit 3;; esac\n\
         case \"$*\" in *--read*) echo 'Task Read Speed = 1.5 GB/sec';; \
         *) echo 'Task Write Speed = 2.0 GB/sec';; esac\n",
    );
    let args = [
        "--size", "8MiB", "--extent", "2MiB", "--block", "256KiB", "--qd", "8", "--repeat", "2",
        "--no-fio", "--peers",
    ];
    let mut all: Vec<&str> = args.to_vec();
    all.push(env.to_str().unwrap());
    let (stdout, _, report) = run_nvme(&dir, &all);
    let ds = &report["ds_io"];
    assert_eq!(ds["write"]["gib_per_s"], serde_json::json!([2.0, 2.0]));
    assert_eq!(ds["read"]["median_gib_per_s"], 1.5);
    let ratios = report["ratios"].as_array().unwrap();
    assert_eq!(ratios.len(), 4, "2 directions x 2 settings, against ds_io");
    for r in ratios {
        let want = if r["direction"] == "write" { 2.0 } else { 1.5 };
        assert_eq!(r["peer_gib_per_s"], want);
        let ratio = r["strata_gib_per_s"].as_f64().unwrap() / want;
        assert!((r["ratio"].as_f64().unwrap() - ratio).abs() < 1e-9, "{r}");
    }
    assert!(stdout.contains("DeepSpeed ds_io aio_handle"), "{stdout}");

    // A peer that fails is reported as not run, with its error; strata's figures stand.
    let env = fake_peers(
        peers_dir.path(),
        "#!/bin/sh\necho 'no libaio' >&2\nexit 1\n",
    );
    let mut all: Vec<&str> = args.to_vec();
    all.push(env.to_str().unwrap());
    let (stdout, _, report) = run_nvme(&dir, &all);
    assert!(report["ds_io"].is_null());
    let skipped = &report["skipped"][0];
    assert!(
        skipped["reason"].as_str().unwrap().contains("no libaio"),
        "{skipped}"
    );
    assert!(stdout.contains("not run: DeepSpeed ds_io"), "{stdout}");
}

#[test]
fn sweep_recommends_a_setting() {
    let dir = scratch();
    let (stdout, _, report) = run_nvme(
        &dir,
        &[
            "--size",
            "8MiB",
            "--extent",
            "2MiB",
            "--repeat",
            "1",
            "--checksums",
            "off",
        ],
    );
    assert!(
        !stdout.contains("sweep:"),
        "no sweep unless asked: {stdout}"
    );
    assert!(report["sweep"].as_array().unwrap().is_empty());
    let (stdout, _, report) = run_nvme(
        &dir,
        &[
            "--size",
            "8MiB",
            "--extent",
            "2MiB",
            "--repeat",
            "1",
            "--checksums",
            "off",
            "--no-fio",
            "--sweep",
        ],
    );
    assert!(stdout.contains("sweep: best write"), "{stdout}");
    let points = report["sweep"].as_array().unwrap();
    assert_eq!(points.len(), 6 * 5, "6 block sizes x 5 queue depths");
    assert!(
        points
            .iter()
            .all(|p| p["read_gib_per_s"].as_f64().unwrap() > 0.0)
    );
}

#[test]
fn bad_arguments_are_clear_errors() {
    let out = strata()
        .args(["bench", "nvme", "--path", "/no/such/folder", "--no-fio"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("/no/such/folder") && stderr.contains("not a folder"),
        "{stderr}"
    );

    let out = strata()
        .args(["bench", "nvme", "--size", "1000", "--no-fio"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--size 1000"));

    for (flag, value, says) in [
        ("--in-flight", "0", "--in-flight 0"),
        ("--peers", "/no/such/env", "/no/such/env is not a folder"),
    ] {
        let out = strata()
            .args(["bench", "nvme", "--no-fio", flag, value])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(says), "{stderr}");
    }

    let out = strata()
        .args(["bench", "nvme", "--size", "lots"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a number"));
}
