//! The free space a run needs, checked before step 1 ([`check_space`]): the trained
//! model `--out` writes (its bytes at the dtype it is saved in), the checkpoints that
//! can exist at once (`keep_checkpoints`, and one being written), and the plan's NVMe
//! swap, added up per filesystem (several can share one drive), so that a run does not
//! train for hours and then fail to write what it trained.
//!
//! Not here: where `--out` may be ([`crate::out_paths`]), or the swap's own check against
//! its folders' free space (`RunBudgets::check_free`).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use strata_engine::checkpoint;
use strata_engine::model::Model;
use strata_engine::model::weights::{self, FileDtype};
use strata_engine::plan::{Tier, fmt_bytes};

use super::group::Ranks;
use super::planning::Planned;
use crate::model_source::pretrained_source;
use crate::out_paths::resolved;
use crate::train_config::TrainConfig;

type Error = Box<dyn std::error::Error>;

/// Bytes a saved model of `model`, trained from `source`, takes besides its tensors, at
/// most: the safetensors headers (a few hundred bytes per tensor), the files it carries
/// from `source` (its tokenizer can be megabytes), and 64 KiB for `config.json` and the
/// index.
fn saved_overhead_bytes(model: &Model, source: Option<&Path>) -> u64 {
    let tensors: u64 = model.blocks().iter().map(|b| b.tensors.len() as u64).sum();
    let carried: u64 = source.map_or(0, |dir| {
        weights::CARRIED_FILES
            .iter()
            .filter_map(|f| std::fs::metadata(dir.join(f)).ok())
            .map(|m| m.len())
            .sum()
    });
    256 * tensors + carried + (64 << 10)
}

/// What the filesystem holding a folder is: its device and its free bytes, or why they
/// cannot be known.
type Volume = Result<(u64, u64), String>;

/// Something a run writes: its setting, the folder it goes in, and its bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Need {
    /// What it is, as the message names it (`--out DIR (the model in bfloat16)`).
    pub what: String,
    /// The folder it goes in (made when missing).
    pub dir: PathBuf,
    /// Its bytes at most.
    pub bytes: u64,
}

/// Refuses a run whose `--out`, checkpoints and swap need more space than their
/// filesystems have free, naming each need and what is free.
pub fn check_space(
    cfg: &TrainConfig,
    model: &Model,
    planned: &Planned,
    ranks: &Ranks,
) -> Result<(), Error> {
    let needs = needs(cfg, model, planned, ranks)?;
    match shortfall(&needs, &|dir| volume(dir)) {
        Some(why) => Err(why.into()),
        None => Ok(()),
    }
}

/// What `cfg`'s run writes, and where.
fn needs(
    cfg: &TrainConfig,
    model: &Model,
    planned: &Planned,
    ranks: &Ranks,
) -> Result<Vec<Need>, Error> {
    let params = model.param_count() as u64;
    let mut needs = Vec::new();
    // A LoRA run's --out is its adapter, unless --merge writes the whole model.
    let lora = model.lora_config().is_some() && !cfg.merge;
    if let Some(out) = cfg.out.as_ref().filter(|_| ranks.rank == 0 && lora) {
        // A LoRA run writes its adapters (f32 unless --save-dtype), and a config.
        let dtype = cfg.save_dtype.map_or(FileDtype::F32, |d| d.file_dtype());
        needs.push(Need {
            what: format!(
                "--out {} (the adapter in {})",
                out.display(),
                dtype.torch_name()
            ),
            dir: out.clone(),
            bytes: model.trained_param_count() as u64 * dtype.size_bytes() as u64 + (1 << 20),
        });
    }
    if let Some(out) = cfg.out.as_ref().filter(|_| ranks.rank == 0 && !lora) {
        let source = pretrained_source(&cfg.model)?;
        let dtype = match (cfg.save_dtype, &source) {
            (Some(d), _) => d.file_dtype(),
            (None, Some(s)) => s.dtype,
            (None, None) => FileDtype::F32,
        };
        let overhead = saved_overhead_bytes(model, source.as_ref().map(|s| s.dir.as_path()));
        needs.push(Need {
            what: format!(
                "--out {} (the model in {})",
                out.display(),
                dtype.torch_name()
            ),
            dir: out.clone(),
            bytes: params * dtype.size_bytes() as u64 + overhead,
        });
    }
    if let Some(dir) = &cfg.checkpoint_dir {
        let count = checkpoints_at_once(cfg, dir);
        let each = checkpoint::needed_bytes(model, 0);
        needs.push(Need {
            what: format!(
                "--checkpoint-dir {} ({count} checkpoint{} of {})",
                dir.display(),
                if count == 1 { "" } else { "s" },
                fmt_bytes(each)
            ),
            dir: dir.clone(),
            bytes: count * each,
        });
    }
    let swap = planned.plan.peak[Tier::Nvme.index()];
    let dirs = &planned.budgets.nvme_dirs;
    if swap > 0 && !dirs.is_empty() {
        for dir in dirs {
            needs.push(Need {
                what: format!("--nvme {} (swap)", dir.display()),
                dir: dir.clone(),
                bytes: swap.div_ceil(dirs.len() as u64),
            });
        }
    }
    Ok(needs)
}

/// The checkpoints this run adds to `dir` at most at once: each one written while the
/// `keep_checkpoints` before it are still there, less those already in `dir` (their
/// space is taken already), and no more than the run writes.
fn checkpoints_at_once(cfg: &TrainConfig, dir: &Path) -> u64 {
    let keep = cfg.keep_checkpoints as u64;
    let there = checkpoint::list(dir).map_or(0, |l| l.len() as u64);
    // Every N steps and at the end; with N = 0, at the end (or on Ctrl-C) only.
    let written = match cfg.checkpoint_every {
        0 => 1,
        every => cfg.steps / every + 1,
    };
    written.min(keep + 1 - there.min(keep))
}

/// The filesystem holding `dir` (or, when it is not made yet, its nearest folder that
/// is): its device and its free bytes.
fn volume(dir: &Path) -> Volume {
    let mut at = resolved(dir);
    while !at.exists() {
        if !at.pop() {
            break;
        }
    }
    let device = std::fs::metadata(&at)
        .map_err(|e| format!("{}: {e}", at.display()))?
        .dev();
    let free = strata_engine::storage::available_bytes(&at).map_err(|e| e.to_string())?;
    Ok((device, free))
}

/// Why `needs` do not fit: the first filesystem (in the order of `needs`) whose needs
/// add up to more than `volume` says it has free, with each need and the free bytes.
pub fn shortfall(needs: &[Need], volume: &dyn Fn(&Path) -> Volume) -> Option<String> {
    let mut volumes: Vec<(u64, u64, Vec<&Need>)> = Vec::new();
    for need in needs.iter().filter(|n| n.bytes > 0) {
        let (device, free) = match volume(&need.dir) {
            Ok(v) => v,
            Err(e) => {
                return Some(format!(
                    "cannot check the free space for {}: {e}",
                    need.what
                ));
            }
        };
        match volumes.iter_mut().find(|(d, _, _)| *d == device) {
            Some((_, _, on)) => on.push(need),
            None => volumes.push((device, free, vec![need])),
        }
    }
    let (_, free, on) = volumes
        .into_iter()
        .find(|(_, free, on)| on.iter().map(|n| n.bytes).sum::<u64>() > *free)?;
    let total: u64 = on.iter().map(|n| n.bytes).sum();
    let each: Vec<String> = on
        .iter()
        .map(|n| format!("{}: {}", n.what, fmt_bytes(n.bytes)))
        .collect();
    Some(format!(
        "not enough free space for this run: {} on one filesystem, {} in all, and it has {} \
         free; free space there, put them on other drives, or keep fewer checkpoints \
         (--keep-checkpoints)",
        each.join(", "),
        fmt_bytes(total),
        fmt_bytes(free)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn need(what: &str, dir: &str, bytes: u64) -> Need {
        Need {
            what: what.into(),
            dir: dir.into(),
            bytes,
        }
    }

    #[test]
    fn needs_on_one_filesystem_add_up_and_are_each_named() {
        // /a and /b share a drive with 10 GB free; /c has its own, with 1 GB.
        let volume = |dir: &Path| -> Volume {
            Ok(match dir.starts_with("/c") {
                true => (2, 1_000_000_000),
                false => (1, 10_000_000_000),
            })
        };
        let fits = [
            need("--out /a", "/a", 6_000_000_000),
            need("--nvme /c", "/c", 1_000_000_000),
        ];
        assert_eq!(shortfall(&fits, &volume), None);
        let over = [
            need("--out /a", "/a", 6_000_000_000),
            need("--checkpoint-dir /b", "/b", 5_000_000_000),
            need("--nvme /c", "/c", 500_000_000),
        ];
        let why = shortfall(&over, &volume).unwrap();
        assert!(
            why.contains("--out /a: 5.59 GiB, --checkpoint-dir /b: 4.66 GiB"),
            "{why}"
        );
        assert!(
            why.contains("10.24 GiB in all, and it has 9.31 GiB free"),
            "{why}"
        );
        assert!(!why.contains("--nvme"), "{why}");
    }

    #[test]
    fn checkpoints_at_once_counts_those_kept_and_the_one_being_written() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = |every: u64, steps: u64, keep: usize| TrainConfig {
            checkpoint_every: every,
            steps,
            keep_checkpoints: keep,
            ..TrainConfig::default()
        };
        assert_eq!(checkpoints_at_once(&cfg(10, 1000, 3), dir.path()), 4);
        assert_eq!(checkpoints_at_once(&cfg(10, 15, 3), dir.path()), 2);
        assert_eq!(checkpoints_at_once(&cfg(0, 1000, 3), dir.path()), 1);
    }
}
