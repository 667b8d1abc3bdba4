//! The folders of a checkpoint root: `step-N` names, the hidden folders of saves in
//! progress, replaced or being deleted (and whether their process still runs), finding
//! the complete checkpoints ([`list`], [`latest`], [`resolve`]), putting a written folder
//! in place ([`publish`]) and removing old ones ([`prune`]), with the space check and the
//! flushes that make a rename durable.
//!
//! Not here: what the folders hold (`format`) and writing or reading it (`whole`,
//! `sharded`, `verify`).

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};

use strata_storage::available_bytes;

use super::error::{CheckpointError, io_error};
use super::format::MANIFEST_FILE;

/// The folder name of the checkpoint of `step`: `step-00000123`.
pub fn dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// The step of a checkpoint folder's name, if it is one.
pub fn parse_dir_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.len() < 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Why a hidden folder of a save is there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LeftoverKind {
    /// `.tmp`: a save being written, or one interrupted.
    Unfinished,
    /// `.old`: a checkpoint of the same step that a save is replacing.
    Replaced,
    /// `.del`: an older checkpoint being removed by pruning.
    Deleting,
}

impl LeftoverKind {
    const ALL: [LeftoverKind; 3] = [Self::Unfinished, Self::Replaced, Self::Deleting];

    fn tag(self) -> &'static str {
        match self {
            Self::Unfinished => "tmp",
            Self::Replaced => "old",
            Self::Deleting => "del",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Self::Unfinished => "an unfinished save",
            Self::Replaced => "a replaced checkpoint",
            Self::Deleting => "a checkpoint being deleted",
        }
    }
}

/// The hidden folder of kind `kind` that this process uses for step `step` in `root`.
pub(super) fn leftover_path(root: &Path, step: u64, kind: LeftoverKind) -> PathBuf {
    leftover_path_of(root, step, kind, std::process::id())
}

/// The hidden folder of kind `kind` that process `pid` uses for step `step` in `root`.
pub(super) fn leftover_path_of(root: &Path, step: u64, kind: LeftoverKind, pid: u32) -> PathBuf {
    root.join(format!(".{}.{}-{pid}", dir_name(step), kind.tag()))
}

/// A hidden folder a save made: `.step-00000123.tmp-4567`.
#[derive(Debug)]
pub(super) struct Leftover {
    path: PathBuf,
    step: u64,
    kind: LeftoverKind,
    pid: u32,
}

impl Leftover {
    fn parse(root: &Path, name: &str) -> Option<Self> {
        let (dir, tail) = name.strip_prefix('.')?.split_once('.')?;
        let step = parse_dir_name(dir)?;
        let (tag, pid) = tail.split_once('-')?;
        let kind = LeftoverKind::ALL.into_iter().find(|k| k.tag() == tag)?;
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        Some(Leftover {
            path: root.join(name),
            step,
            kind,
            pid: pid.parse().ok()?,
        })
    }

    /// Whether the process that made this folder may still be using it. This process's
    /// own folders are not in use between saves; where `/proc` cannot tell, every
    /// process is taken as alive, so nothing in use is ever removed.
    fn in_use(&self) -> bool {
        self.pid != std::process::id()
            && (Path::new("/proc").join(self.pid.to_string()).exists()
                || !Path::new("/proc/self").exists())
    }
}

/// What a root holds.
#[derive(Debug, Default)]
pub(super) struct Scan {
    /// Complete checkpoints by step: `step-N` folders with a manifest, and, where a crash
    /// fell between the renames of a replacement, the folder set aside for a missing `step-N`.
    complete: BTreeMap<u64, PathBuf>,
    /// `step-N` folders without a manifest (copies in progress, damage).
    incomplete: Vec<(u64, PathBuf)>,
    /// Hidden folders of saves.
    leftovers: Vec<Leftover>,
}

pub(super) fn scan(root: &Path) -> Result<Scan, CheckpointError> {
    let entries = fs::read_dir(root).map_err(|e| match e.kind() {
        ErrorKind::NotFound => CheckpointError::MissingDir {
            path: root.to_path_buf(),
        },
        _ => io_error("list", root)(e),
    })?;
    let mut scan = Scan::default();
    for entry in entries {
        let entry = entry.map_err(io_error("list", root))?;
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        let path = entry.path();
        if !path.is_dir() {
            continue;
        }
        if let Some(step) = parse_dir_name(&name) {
            if path.join(MANIFEST_FILE).is_file() {
                scan.complete.insert(step, path);
            } else {
                scan.incomplete.push((step, path));
            }
        } else if let Some(leftover) = Leftover::parse(root, &name) {
            scan.leftovers.push(leftover);
        }
    }
    for l in &scan.leftovers {
        if l.kind == LeftoverKind::Replaced && !l.in_use() && l.path.join(MANIFEST_FILE).is_file() {
            scan.complete
                .entry(l.step)
                .or_insert_with(|| l.path.clone());
        }
    }
    scan.incomplete.sort();
    Ok(scan)
}

/// The complete checkpoints in `root`, by step, oldest first. Skips folders without a
/// manifest and the temporary folders of saves.
pub fn list(root: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    Ok(scan(root)?.complete.into_iter().collect())
}

/// The complete checkpoint of the highest step in `root`, if any.
pub fn latest(root: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    Ok(scan(root)?.complete.into_values().next_back())
}

/// The checkpoint folder `path` names: `path` itself when it is one, else the complete
/// checkpoint of the highest step in the root `path`.
pub fn resolve(path: &Path) -> Result<PathBuf, CheckpointError> {
    if !path.exists() {
        return Err(CheckpointError::MissingDir {
            path: path.to_path_buf(),
        });
    }
    let is_checkpoint = path.join(MANIFEST_FILE).exists()
        || path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| parse_dir_name(n).is_some());
    if is_checkpoint {
        return Ok(path.to_path_buf());
    }
    let found = scan(path)?;
    let Some((&step, dir)) = found.complete.last_key_value() else {
        let skipped: Vec<String> = found
            .incomplete
            .iter()
            .map(|(_, p)| format!("{} has no {MANIFEST_FILE}", p.display()))
            .chain(
                found
                    .leftovers
                    .iter()
                    .map(|l| format!("{} is {}", l.path.display(), l.kind.describe())),
            )
            .collect();
        return Err(CheckpointError::NoCheckpoint {
            root: path.to_path_buf(),
            skipped: if skipped.is_empty() {
                String::new()
            } else {
                format!(" (skipped: {})", skipped.join(", "))
            },
        });
    };
    for (_, p) in found.incomplete.iter().filter(|(s, _)| *s > step) {
        log::warn!(
            "skipping {}: it has no {MANIFEST_FILE}, so it is not a complete checkpoint",
            p.display()
        );
    }
    log::info!(
        "{} is the latest complete checkpoint in {}",
        dir.display(),
        path.display()
    );
    Ok(dir.clone())
}

pub(super) fn check_space(
    root: &Path,
    step: u64,
    needed_bytes: u64,
) -> Result<(), CheckpointError> {
    let available_bytes = available_bytes(root)?;
    if available_bytes < needed_bytes {
        return Err(CheckpointError::NoSpace {
            dir: root.to_path_buf(),
            step,
            needed_bytes,
            available_bytes,
        });
    }
    Ok(())
}

/// Renames the written folder `tmp` to `root/step-N`, setting aside and then removing a
/// folder of that name from an earlier run, and flushes `root`.
pub(super) fn publish(root: &Path, tmp: &Path, step: u64) -> Result<PathBuf, CheckpointError> {
    let dir = root.join(dir_name(step));
    let aside = leftover_path(root, step, LeftoverKind::Replaced);
    let replacing = dir.exists();
    if replacing {
        log::warn!(
            "replacing the checkpoint {} of an earlier run",
            dir.display()
        );
        fs::rename(&dir, &aside).map_err(io_error("set aside", &dir))?;
    }
    if let Err(e) = fs::rename(tmp, &dir) {
        if replacing && let Err(back) = fs::rename(&aside, &dir) {
            log::warn!(
                "could not put {} back to {}: {back}",
                aside.display(),
                dir.display()
            );
        }
        return Err(io_error("rename into place", tmp)(e));
    }
    sync_dir(root)?;
    if replacing && let Err(e) = fs::remove_dir_all(&aside) {
        log::warn!("could not remove the replaced {}: {e}", aside.display());
    }
    Ok(dir)
}

/// Removes the hidden folders of dead saves (putting back a replaced checkpoint whose
/// replacement never arrived), then the complete checkpoints older than the newest
/// `keep_last` up to `step`. Failures are warnings: the new checkpoint is already safe.
pub(super) fn prune(root: &Path, step: u64, keep_last: usize) {
    let pruned = scan(root).and_then(|found| {
        for l in found.leftovers.iter().filter(|l| !l.in_use()) {
            let named = root.join(dir_name(l.step));
            if l.kind == LeftoverKind::Replaced && !named.exists() {
                log::warn!(
                    "putting back {} as {}: a save replacing it was interrupted",
                    l.path.display(),
                    named.display()
                );
                fs::rename(&l.path, &named).map_err(io_error("rename", &l.path))?;
            } else {
                log::info!("removing {} ({})", l.path.display(), l.kind.describe());
                fs::remove_dir_all(&l.path).map_err(io_error("remove", &l.path))?;
            }
        }
        let found = scan(root)?;
        let newer: Vec<String> = found
            .complete
            .range(step + 1..)
            .map(|(_, p)| p.display().to_string())
            .collect();
        if !newer.is_empty() {
            log::warn!(
                "{} holds checkpoints of later steps than the {step} just saved, from an \
                 earlier run: {}; loading the folder picks the latest, so remove them to \
                 continue this run from it",
                root.display(),
                newer.join(", ")
            );
        }
        for (&old, path) in found.complete.range(..step).rev().skip(keep_last - 1) {
            // Renamed first, so an interrupted removal leaves a hidden folder the next
            // save removes, not a half-deleted checkpoint.
            let doomed = leftover_path(root, old, LeftoverKind::Deleting);
            fs::rename(path, &doomed).map_err(io_error("rename", path))?;
            fs::remove_dir_all(&doomed).map_err(io_error("remove", &doomed))?;
        }
        Ok(())
    });
    if let Err(e) = pruned {
        log::warn!("pruning old checkpoints in {}: {e}", root.display());
    }
}

/// What to do when the checkpoint `dir` cannot be used: the earlier checkpoint beside it,
/// if there is one.
pub(super) fn advice(dir: &Path) -> String {
    let step = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(parse_dir_name);
    let root = dir.parent().unwrap_or(Path::new("."));
    let earlier = step.and_then(|step| {
        scan(root)
            .ok()?
            .complete
            .range(..step)
            .next_back()
            .map(|(_, p)| p.clone())
    });
    match earlier {
        Some(p) => format!(
            "resume from the earlier checkpoint {} instead, or start without --resume",
            p.display()
        ),
        None => format!(
            "there is no earlier checkpoint in {}: start without --resume",
            root.display()
        ),
    }
}

/// Writes `bytes` to a new file at `path` and flushes it to the device.
pub(super) fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut file = File::create(path).map_err(io_error("create", path))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(io_error("write", path))
}

/// Flushes folder `dir` to the device, so the names created or renamed in it persist.
pub(super) fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error("flush", dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        assert_eq!(dir_name(123), "step-00000123");
        assert_eq!(parse_dir_name(&dir_name(123)), Some(123));
        assert_eq!(
            parse_dir_name(&dir_name(123_456_789_012)),
            Some(123_456_789_012)
        );
        for name in [
            "step-123",
            "step-+0000123",
            "step-0000012a",
            "xstep-00000001",
        ] {
            assert_eq!(parse_dir_name(name), None, "{name}");
        }
        let root = Path::new("/r");
        for kind in LeftoverKind::ALL {
            let path = leftover_path(root, 7, kind);
            let name = path.file_name().unwrap().to_str().unwrap();
            let l = Leftover::parse(root, name).unwrap();
            assert_eq!((l.step, l.kind, l.pid), (7, kind, std::process::id()));
            assert_eq!(l.path, path);
            assert!(!l.in_use(), "this process's own folders are not in use");
        }
        assert!(Leftover::parse(root, ".step-00000007.tmp-x1").is_none());
        assert!(Leftover::parse(root, ".step-00000007.new-1").is_none());
        assert!(Leftover::parse(root, "step-00000007.tmp-1").is_none());
    }

    #[test]
    fn too_little_space_names_the_folder_and_both_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let needed = u64::MAX / 2;
        let text = check_space(dir.path(), 9, needed).unwrap_err().to_string();
        assert!(text.contains(&dir.path().display().to_string()), "{text}");
        assert!(text.contains(&format!("needs {needed} bytes")), "{text}");
        assert!(text.contains(") are available"), "{text}");
        assert!(!text.contains('\n'), "{text}");
        check_space(dir.path(), 9, 4096).unwrap();
    }
}
