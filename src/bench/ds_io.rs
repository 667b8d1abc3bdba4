//! DeepSpeed's `ds_io` (DeepNVMe's `aio_handle`, libaio) as a peer of `strata bench
//! nvme`, from the env `../shared/anchors/setup DIR` makes: the same bytes, block size
//! and queue depth, into a folder of its own on the same drive.

use std::path::Path;

use super::peers::{WorkDir, env_command, stderr_tail};

/// Runs `ds_io` once (one warm-up pass, one timed) writing or reading `size_bytes` in
/// `folder`; returns bytes per second.
pub fn run(
    env: &Path,
    folder: &Path,
    write: bool,
    size_bytes: u64,
    block_bytes: u64,
    queue_depth: usize,
) -> Result<f64, String> {
    let program = env.join("venv/bin/ds_io");
    if !program.is_file() {
        return Err(format!(
            "no ds_io at {} (make the env with ../shared/anchors/setup DIR)",
            program.display()
        ));
    }
    let work = WorkDir::new(folder)?;
    let mut command = env_command(env, &program, 1)?;
    command
        .arg("--folder")
        .arg(&work.0)
        .args(["--io_size", &size_bytes.to_string()])
        .args(["--block_size", &block_bytes.to_string()])
        .args(["--queue_depth", &queue_depth.to_string()])
        .args([
            "--engine",
            "aio_handle",
            "--loops",
            "1",
            "--warmup_loops",
            "1",
        ]);
    if !write {
        command.arg("--read");
    }
    let out = command
        .output()
        .map_err(|e| format!("cannot run {}: {e}", program.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "ds_io exited with {}: {}",
            out.status,
            stderr_tail(&out.stderr, 4)
        ));
    }
    parse(&stdout, write)
}

/// The rate from ds_io's output: its "Task Write Speed = X GB/sec" line (or Read), the
/// timed passes without the warm-up. Its "GB" is 2^30 bytes (it divides by 1024^3).
pub fn parse(output: &str, write: bool) -> Result<f64, String> {
    let key = if write {
        "Task Write Speed ="
    } else {
        "Task Read Speed ="
    };
    let line = output
        .lines()
        .find_map(|l| l.trim().strip_prefix(key))
        .ok_or_else(|| format!("no '{key}' line in ds_io's output"))?;
    let value: f64 = line
        .trim()
        .trim_end_matches("GB/sec")
        .trim()
        .parse()
        .map_err(|e| format!("cannot read ds_io's rate '{}': {e}", line.trim()))?;
    Ok(value * (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_task_speed_in_binary_gigabytes() {
        let out = "tid 0: running post-task\nTask Write Latency = 0.78 sec\n\
                   Task Write Speed = 3.5 GB/sec\nE2E Write Speed = 3.4 GB/sec\n";
        assert_eq!(parse(out, true).unwrap(), 3.5 * 1073741824.0);
        assert!(parse(out, false).is_err());
        assert!(parse("Task Read Speed = fast GB/sec", false).is_err());
    }
}
