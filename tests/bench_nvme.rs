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
    for s in strata {
        for op in ["write", "read"] {
            let rate = s[op]["median_gib_per_s"].as_f64().unwrap();
            assert!(rate > 0.0 && rate.is_finite(), "{op}: {rate}");
            assert!(s[op]["chunk_latency"]["p50_us"].as_f64().unwrap() > 0.0);
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
    let ratios = report["ratios"].as_array().unwrap();
    assert_eq!(ratios.len(), 4, "2 directions x 2 settings");
    assert!(stdout.contains("strata/fio"), "{stdout}");
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

    let out = strata()
        .args(["bench", "nvme", "--size", "lots"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a number"));
}
