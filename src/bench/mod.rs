//! The benchmarks behind `strata bench`: each measures one link or kernel and compares
//! it, in the same run, with its limit or a peer (docs/ARCHITECTURE.md, benchmarks).

use std::path::Path;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::report::write_json;

pub mod adam;
pub mod attention;
pub mod ds_io;
pub mod fio;
pub mod gemm;
pub mod kernels;
pub mod nvme;
pub mod pcie;
pub mod peers;
pub mod step;

/// Runs a peer written in Python, `python -c script arg`, and returns what it printed
/// on standard output; an error names the status and the last line it printed on
/// standard error (the peers exit 2 with one line there when PyTorch is missing).
pub(crate) fn run_python_peer(python: &Path, script: &str, arg: &str) -> Result<String, String> {
    let output = std::process::Command::new(python)
        .arg("-c")
        .arg(script)
        .arg(arg)
        .output()
        .map_err(|e| format!("could not run {}: {e}", python.display()))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let last = stderr.lines().rev().find(|l| !l.trim().is_empty());
        return Err(format!(
            "the PyTorch peer failed ({}): {}",
            output.status,
            last.unwrap_or("no message")
        ));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Parses a peer's standard output: its last non-empty line is one JSON object.
pub(crate) fn parse_peer_output<T: DeserializeOwned>(stdout: &str) -> Result<T, String> {
    let line = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .ok_or("the PyTorch peer printed nothing")?;
    serde_json::from_str(line).map_err(|e| format!("the PyTorch peer printed '{line}': {e}"))
}

/// Ends a benchmark's output: the load average before and after the run, and the report
/// written as JSON to `json` when one was asked for.
pub(crate) fn finish<T: Serialize>(
    load_average: [Option<f64>; 2],
    json: Option<&Path>,
    report: &T,
) -> std::io::Result<()> {
    if let [Some(before), Some(after)] = load_average {
        println!("load average (1 min): {before:.2} before, {after:.2} after");
    }
    if let Some(path) = json {
        write_json(path, report)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
