//! What this machine offers a run, read where every command reads it: the CPU's name,
//! /proc/meminfo's fields, the folder scratch files go to by default, and whether a folder
//! can hold swap files. `strata doctor` reports these; `train`, `plan` and the benchmarks
//! decide by them.
//!
//! Not here: the probes the engine decides by (io_uring, O_DIRECT, CUDA), which are the
//! engine's and the storage crate's.

use std::path::{Path, PathBuf};

/// The CPU's model name from /proc/cpuinfo with its family and model numbers (a
/// virtual machine's name, "AMD EPYC" say, is the same for every generation; the numbers
/// tell them apart), or the architecture where it has none.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            let field = |key: &str| {
                text.lines()
                    .find(|l| l.split(':').next().map(str::trim) == Some(key))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|s| s.trim().to_string())
            };
            let name = field("model name")?;
            Some(match (field("cpu family"), field("model")) {
                (Some(family), Some(model)) => format!("{name} (family {family}, model {model})"),
                _ => name,
            })
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// A field of /proc/meminfo (`MemTotal`, `MemAvailable`...), in bytes.
pub fn meminfo_bytes(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.split(':').next() == Some(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Where swap files and the generated corpus go by default: the system temp dir, or
/// `target/` when that is tmpfs (O_DIRECT needs a real filesystem).
pub fn default_scratch_dir() -> PathBuf {
    let tmp = std::env::temp_dir();
    if strata_engine::storage::is_tmpfs(&tmp) {
        PathBuf::from("target")
    } else {
        tmp
    }
}

/// Why a folder cannot hold the NVMe tier's swap files, if it cannot: tmpfs is RAM, not a
/// drive (swap files there take the memory the host tier needs; some kernels refuse it
/// O_DIRECT, newer ones accept it). The one answer `train`, `bench step` and `doctor`
/// give.
pub fn swap_folder_refusal(dir: &Path) -> Option<String> {
    strata_engine::storage::is_tmpfs(dir).then(|| {
        format!(
            "{} is on tmpfs, which is RAM, not a drive: swap files there would take the \
             memory the host tier needs; give a folder on a real disk (such as /var/tmp)",
            dir.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_reads_total_and_available() {
        let total = meminfo_bytes("MemTotal").expect("MemTotal");
        let available = meminfo_bytes("MemAvailable").expect("MemAvailable");
        assert!(available <= total && total > 0);
        assert_eq!(meminfo_bytes("NoSuchField"), None);
    }
}
