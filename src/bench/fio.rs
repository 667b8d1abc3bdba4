//! fio as the peer of `strata bench nvme`: the same file size, block size and queue
//! depth, O_DIRECT, in the configurations that get the most out of a drive.
//!
//! fio is optional: where it is not on the PATH the bench says so and measures strata
//! alone.

use std::path::Path;
use std::process::Command;

use serde::Serialize;

/// One fio configuration the bench runs.
#[derive(Debug, Clone, Serialize)]
pub struct FioEngine {
    /// A short name for tables.
    pub name: &'static str,
    /// The engine options passed to fio.
    pub args: &'static [&'static str],
}

/// The configurations compared against: io_uring with registered buffers and files (its
/// fastest mode), and libaio (what DeepSpeed's NVMe path uses), each also with batched
/// submission and completion.
pub const ENGINES: [FioEngine; 4] = [
    FioEngine {
        name: "fio io_uring fixedbufs+registerfiles",
        args: &["--ioengine=io_uring", "--fixedbufs", "--registerfiles"],
    },
    FioEngine {
        name: "fio io_uring fixedbufs+registerfiles, batched",
        args: &[
            "--ioengine=io_uring",
            "--fixedbufs",
            "--registerfiles",
            "--iodepth_batch_submit=8",
            "--iodepth_batch_complete_min=1",
            "--iodepth_batch_complete_max=8",
        ],
    },
    FioEngine {
        name: "fio libaio",
        args: &["--ioengine=libaio"],
    },
    FioEngine {
        name: "fio libaio, batched",
        args: &[
            "--ioengine=libaio",
            "--iodepth_batch_submit=8",
            "--iodepth_batch_complete_min=1",
            "--iodepth_batch_complete_max=8",
        ],
    },
];

/// fio's fastest configuration with its buffers in huge pages (`--iomem=mmaphuge`), as
/// strata's pinned host memory is (transparent huge pages): run only where enough huge
/// pages are reserved ([`huge_pages_short`]).
pub const HUGE: FioEngine = FioEngine {
    name: "fio io_uring fixedbufs+registerfiles, huge pages",
    args: &[
        "--ioengine=io_uring",
        "--fixedbufs",
        "--registerfiles",
        "--iomem=mmaphuge",
    ],
};

/// Why [`HUGE`] cannot run here with buffers of `buffer_bytes` (fio maps queue depth x
/// block size), or None when enough huge pages are free.
pub fn huge_pages_short(buffer_bytes: u64) -> Option<String> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
    };
    let page_bytes = field("Hugepagesize:").unwrap_or(2048) * 1024;
    let free = field("HugePages_Free:").unwrap_or(0);
    // One page more than the buffers, for fio's alignment.
    let needed = buffer_bytes.div_ceil(page_bytes) + 1;
    (free < needed).then(|| {
        format!(
            "{free} huge pages free, {needed} needed; reserve them with \
             `echo {needed} | sudo tee /proc/sys/vm/nr_hugepages` to run it"
        )
    })
}

/// What one fio run measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct FioRun {
    /// Bytes per second.
    pub bytes_per_s: f64,
    /// Completion latency percentiles, microseconds: p50, p99, p99.9.
    pub latency_us: [f64; 3],
}

/// The fio version, when fio is on the PATH.
pub fn version() -> Option<String> {
    let out = Command::new("fio").arg("--version").output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Runs fio once: `write` or `read` of `size_bytes` at `file` in `block_bytes` blocks at
/// queue depth `queue_depth`, O_DIRECT.
pub fn run(
    engine: &FioEngine,
    write: bool,
    file: &Path,
    size_bytes: u64,
    block_bytes: u64,
    queue_depth: usize,
) -> Result<FioRun, String> {
    let rw = if write { "write" } else { "read" };
    let mut command = Command::new("fio");
    command
        .arg("--name=strata-peer")
        .arg(format!("--filename={}", file.display()))
        .arg(format!("--size={size_bytes}"))
        .arg(format!("--bs={block_bytes}"))
        .arg(format!("--iodepth={queue_depth}"))
        .arg("--direct=1")
        .arg(format!("--rw={rw}"))
        .arg("--output-format=json")
        .args(engine.args);
    let out = command
        .output()
        .map_err(|e| format!("cannot run fio: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "fio ({}) failed: {}",
            engine.name,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    parse(&stdout, rw).map_err(|e| format!("cannot read fio's output ({}): {e}", engine.name))
}

/// Reads bandwidth and completion-latency percentiles from fio's JSON output (which may
/// be preceded by warning lines).
pub fn parse(output: &str, rw: &str) -> Result<FioRun, String> {
    let start = output.find('{').ok_or("no JSON in the output")?;
    let json: serde_json::Value =
        serde_json::from_str(&output[start..]).map_err(|e| e.to_string())?;
    let job = &json["jobs"][0][rw];
    let bytes_per_s = job["bw_bytes"]
        .as_f64()
        .ok_or_else(|| format!("no jobs[0].{rw}.bw_bytes"))?;
    let percentiles = &job["clat_ns"]["percentile"];
    let mut latency_us = [0.0; 3];
    for (slot, key) in latency_us
        .iter_mut()
        .zip(["50.000000", "99.000000", "99.900000"])
    {
        *slot = percentiles[key]
            .as_f64()
            .ok_or_else(|| format!("no clat_ns percentile {key}"))?
            / 1000.0;
    }
    Ok(FioRun {
        bytes_per_s,
        latency_us,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fio_json_after_warnings() {
        let output = r#"fio: some warning
{
  "fio version" : "fio-3.33",
  "jobs" : [
    {
      "jobname" : "strata-peer",
      "read" : {
        "io_bytes" : 1073741824,
        "bw_bytes" : 4294967296,
        "clat_ns" : {
          "percentile" : {
            "50.000000" : 7208960,
            "99.000000" : 11075584,
            "99.900000" : 13828096
          }
        }
      }
    }
  ]
}"#;
        let run = parse(output, "read").unwrap();
        assert_eq!(run.bytes_per_s, 4294967296.0);
        assert_eq!(run.latency_us, [7208.96, 11075.584, 13828.096]);
        assert!(parse(output, "write").is_err());
        assert!(parse("fio: no output", "read").is_err());
    }
}
