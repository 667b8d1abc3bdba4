//! Reading one checkpoint folder, verified: its manifest (version, step), every file's
//! length and crc32c ([`digest`]), the trainer's state and the model of `config.json`,
//! and f32 tensors; each problem an error naming the folder and file and advising the
//! earlier checkpoint.
//!
//! Not here: putting a checkpoint together from what is read (`whole`, `sharded`).

use std::fs::{self, File};
use std::io::{ErrorKind, Read};
use std::path::Path;

use super::error::{CheckpointError, io_error};
use super::folder::{advice, parse_dir_name};
use super::format::{
    FORMAT_VERSION, FileDigest, MANIFEST_FILE, Manifest, STATE_FILE, TrainerState,
};
use crate::model::lora::{ADAPTER_CONFIG_FILE, LoraConfig};
use crate::model::weights::{self, CONFIG_FILE};
use crate::model::{Model, ModelError};

/// How many ranks wrote the checkpoint folder `dir`: `None` for an ordinary checkpoint
/// (one file of each kind), `Some(n)` for a sharded one. Reads only its manifest.
pub fn written_by_ranks(dir: &Path) -> Result<Option<usize>, CheckpointError> {
    Ok(Dir(dir).manifest()?.shards.map(|l| l.ranks))
}

/// The errors of one checkpoint folder, each naming it and what to do instead.
pub(super) struct Dir<'a>(pub(super) &'a Path);

impl Dir<'_> {
    pub(super) fn missing(&self, file: &str) -> CheckpointError {
        CheckpointError::MissingFile {
            dir: self.0.to_path_buf(),
            file: file.into(),
            advice: advice(self.0),
        }
    }

    pub(super) fn bad_json(&self, file: &str, message: String) -> CheckpointError {
        CheckpointError::BadJson {
            dir: self.0.to_path_buf(),
            file: file.into(),
            message,
            advice: advice(self.0),
        }
    }

    pub(super) fn invalid(&self, message: String) -> CheckpointError {
        CheckpointError::Invalid {
            dir: self.0.to_path_buf(),
            message,
            advice: advice(self.0),
        }
    }

    pub(super) fn read(&self, file: &str) -> Result<Vec<u8>, CheckpointError> {
        let path = self.0.join(file);
        fs::read(&path).map_err(|e| match e.kind() {
            ErrorKind::NotFound => self.missing(file),
            _ => io_error("read", &path)(e),
        })
    }

    /// A model error reading `file`, as the checkpoint's error.
    pub(super) fn model_error(&self, file: &str, e: ModelError) -> CheckpointError {
        match e {
            ModelError::TensorShape {
                name,
                expected,
                found,
                ..
            } => CheckpointError::Shape {
                dir: self.0.to_path_buf(),
                file: file.into(),
                tensor: name.into(),
                expected: expected.into(),
                found: found.into(),
                advice: advice(self.0),
            },
            ModelError::TensorDtype { name, found, .. } => CheckpointError::Dtype {
                dir: self.0.to_path_buf(),
                file: file.into(),
                tensor: name.into(),
                found,
                advice: advice(self.0),
            },
            other => self.invalid(other.to_string()),
        }
    }

    /// The manifest: its version before its shape, so a future layout is named as such;
    /// its step against the folder's name.
    pub(super) fn manifest(&self) -> Result<Manifest, CheckpointError> {
        let text = self.read(MANIFEST_FILE)?;
        let json: serde_json::Value = serde_json::from_slice(&text)
            .map_err(|e| self.bad_json(MANIFEST_FILE, e.to_string()))?;
        let version = json
            .get("format_version")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| self.bad_json(MANIFEST_FILE, "no integer `format_version`".into()))?;
        if version != u64::from(FORMAT_VERSION) {
            return Err(CheckpointError::Version {
                dir: self.0.to_path_buf(),
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        let manifest: Manifest = serde_json::from_value(json)
            .map_err(|e| self.bad_json(MANIFEST_FILE, e.to_string()))?;
        // Each rank wrote a file the manifest lists: a rank count past that is damage, and
        // is refused before a file name is made for each rank.
        if let Some(layout) = manifest.shards.as_ref()
            && layout.ranks > manifest.files.len()
        {
            return Err(self.invalid(format!(
                "{MANIFEST_FILE} says {} ranks wrote it, but lists {} files",
                layout.ranks,
                manifest.files.len()
            )));
        }
        let named_step = self
            .0
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(parse_dir_name);
        if let Some(named) = named_step.filter(|&s| s != manifest.step) {
            return Err(self.invalid(format!(
                "{MANIFEST_FILE} says step {}, the folder's name step {named}",
                manifest.step
            )));
        }
        Ok(manifest)
    }

    /// Checks that every one of `files` is listed in `manifest` and has its length (all
    /// first, as that is cheap), then that the bytes of those `checksummed` picks have
    /// its crc32c.
    pub(super) fn verify<'f>(
        &self,
        manifest: &Manifest,
        files: impl IntoIterator<Item = &'f str>,
        checksummed: impl Fn(&str) -> bool,
    ) -> Result<(), CheckpointError> {
        let mut expected = Vec::new();
        for file in files {
            let want = *manifest
                .files
                .get(file)
                .ok_or_else(|| self.invalid(format!("{MANIFEST_FILE} lists no {file}")))?;
            let path = self.0.join(file);
            let len_bytes = match fs::metadata(&path) {
                Ok(meta) => meta.len(),
                Err(e) if e.kind() == ErrorKind::NotFound => return Err(self.missing(file)),
                Err(e) => return Err(io_error("inspect", &path)(e)),
            };
            if len_bytes != want.len_bytes {
                return Err(CheckpointError::Length {
                    dir: self.0.to_path_buf(),
                    file: file.into(),
                    len_bytes,
                    expected_bytes: want.len_bytes,
                    advice: advice(self.0),
                });
            }
            if checksummed(file) {
                expected.push((file, path, want));
            }
        }
        for (file, path, want) in expected {
            let got = digest(&path)?;
            // The length is read again: a file that changed since the check is caught too.
            if got != want {
                return Err(CheckpointError::Checksum {
                    dir: self.0.to_path_buf(),
                    file: file.into(),
                    actual: got.crc32c,
                    expected: want.crc32c,
                    advice: advice(self.0),
                });
            }
        }
        Ok(())
    }

    /// The trainer's state (checked against the manifest's step) and the model of
    /// `config.json`. Their files must have been verified.
    pub(super) fn state_and_model(
        &self,
        manifest: &Manifest,
    ) -> Result<(TrainerState, Model), CheckpointError> {
        let state: TrainerState = serde_json::from_slice(&self.read(STATE_FILE)?)
            .map_err(|e| self.bad_json(STATE_FILE, e.to_string()))?;
        if state.step != manifest.step {
            return Err(self.invalid(format!(
                "{STATE_FILE} says step {}, {MANIFEST_FILE} step {}",
                state.step, manifest.step
            )));
        }
        let model = weights::load_config(&self.0.join(CONFIG_FILE))
            .map_err(|e| self.model_error(CONFIG_FILE, e))?;
        // A LoRA model's checkpoint names its adapters' settings (and holds them alone).
        let model = if manifest.files.contains_key(ADAPTER_CONFIG_FILE) {
            LoraConfig::read(&self.0.join(ADAPTER_CONFIG_FILE))
                .and_then(|lora| model.lora(&lora))
                .map_err(|e| self.model_error(ADAPTER_CONFIG_FILE, e))?
        } else {
            model
        };
        Ok((state, model))
    }
}

/// Bytes read between two hand-backs of a verified file's pages.
const DROPPED_EVERY: u64 = 64 << 20;

/// The length and crc32c of the file at `path`, read in 1 MiB pieces; the pages read are
/// dropped from the page cache every [`DROPPED_EVERY`] bytes, so that verifying a
/// checkpoint larger than memory does not fill a memory cgroup with its cache.
pub(super) fn digest(path: &Path) -> Result<FileDigest, CheckpointError> {
    let mut file = File::open(path).map_err(io_error("open", path))?;
    let mut buffer = vec![0u8; 1 << 20];
    let (mut len_bytes, mut crc) = (0u64, strata_storage::crc::Crc32c::new());
    let mut dropped = 0;
    loop {
        let n = match file.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_error("read", path)(e)),
        };
        crc.update(&buffer[..n]);
        len_bytes += n as u64;
        if len_bytes - dropped >= DROPPED_EVERY {
            strata_storage::drop_read_pages(&file, dropped, len_bytes - dropped);
            dropped = len_bytes;
        }
    }
    strata_storage::drop_read_pages(&file, dropped, len_bytes - dropped);
    Ok(FileDigest {
        len_bytes,
        crc32c: crc.value(),
    })
}
