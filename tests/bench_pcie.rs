//! `strata bench pcie` as a user runs it: without a GPU it says so and exits 0 under
//! `--device auto`, and fails with the probe's reason under `--device cuda`; with a GPU
//! both measure (small sizes here, to stay quick) and write their JSON.

use std::process::Command;

fn strata(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .output()
        .expect("run strata")
}

#[test]
fn bench_pcie_says_plainly_whether_there_is_a_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("pcie.json");
    let svg = dir.path().join("pcie.svg");
    // The bench needs only the driver.
    let gpu = strata::kernels::cuda::probe().require_driver();
    let quick = [
        "--max-size",
        "256KiB",
        "--bytes-per-point",
        "1MiB",
        "--no-torch",
    ];
    let mut args = vec!["bench", "pcie", "--json", json.to_str().unwrap()];
    args.extend(["--svg", svg.to_str().unwrap()]);
    args.extend(quick);
    let auto = strata(&args);
    let stdout = String::from_utf8_lossy(&auto.stdout);
    println!("{stdout}");
    assert!(
        auto.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&auto.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"));
    assert_eq!(report["pool"]["runs"].as_array().unwrap().len(), 3);
    assert!(stdout.contains("pinned pool"));

    let mut cuda_args = vec!["bench", "pcie", "--device", "cuda"];
    cuda_args.extend(quick);
    let cuda = strata(&cuda_args);
    match gpu {
        Err(why) => {
            assert!(stdout.contains("no GPU here"), "{stdout}");
            assert!(stdout.contains(&why.reason), "{stdout}");
            assert!(report["points"].as_array().unwrap().is_empty());
            assert!(!cuda.status.success());
            let stderr = String::from_utf8_lossy(&cuda.stderr);
            assert!(stderr.contains(&why.reason), "{stderr}");
        }
        Ok(()) => {
            // Two sizes, pinned and pageable, three directions each.
            assert_eq!(report["points"].as_array().unwrap().len(), 12);
            assert!(report["gpu"]["name"].is_string());
            assert!(cuda.status.success());
        }
    }
    let cpu = strata(&["bench", "pcie", "--device", "cpu"]);
    assert!(!cpu.status.success());
    assert!(String::from_utf8_lossy(&cpu.stderr).contains("no PCIe link"));
}
