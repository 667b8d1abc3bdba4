//! A checkpoint's safetensors files written and read a tensor at a time, so that saving
//! or loading holds one block's state, not the model's: [`TensorWriter`] writes the
//! header first (every tensor's name, shape and place, known from the model's layout),
//! then each tensor's bytes in the header's order, taking the crc32c of the bytes as they
//! go out; [`TensorReader`] parses a file's header and reads one tensor at its offset
//! with `pread` (no map of the file, whose pages would count as the process's memory).
//!
//! The files are ordinary safetensors files (f32, `__metadata__` `{"format": "pt"}`):
//! transformers and the `safetensors` crate read them, whatever order the data is in.
//!
//! Not here: which tensors a checkpoint holds and where they come from (`blocks`).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use safetensors::tensor::TensorInfo;
use serde_json::{Value, json};
use strata_storage::crc::Crc32c;
use strata_storage::write_back_and_drop;

use super::error::{CheckpointError, io_error};
use super::format::FileDigest;
use super::verify::Dir;
use crate::device::{bytes_of, bytes_of_mut};
use crate::model::ModelError;

/// Bytes the writer gathers before a `write`: the only buffer a save adds to a block's
/// state.
pub(super) const WRITE_BUFFER_BYTES: usize = 1 << 20;

/// Bytes written between two hand-backs of a file's pages: each time this many more are
/// written, they are written out and dropped from the page cache, so a save's dirty and
/// cached pages (which a memory cgroup charges to the process) stay below it.
const WRITTEN_BACK_EVERY: u64 = 64 << 20;

/// The most memory a save of two files holds of its own: each file's write buffer and
/// the pages written since it last handed them back (page cache, which a memory cgroup
/// charges to the process). The state it writes is lent by its source.
pub const SAVE_HELD_BYTES: u64 = 2 * (WRITE_BUFFER_BYTES as u64 + WRITTEN_BACK_EVERY);

/// The largest header a checkpoint's file may have (a few hundred bytes per tensor).
const MAX_HEADER_BYTES: u64 = 256 << 20;

/// A safetensors file of f32 tensors being written in the order its header lists them.
pub(super) struct TensorWriter {
    path: PathBuf,
    file: BufWriter<File>,
    crc: Crc32c,
    len_bytes: u64,
    /// Bytes already written out and dropped from the page cache.
    handed_back: u64,
    /// Each tensor's name and element count, in the order of their data.
    order: Vec<(String, usize)>,
    next: usize,
}

impl TensorWriter {
    /// Creates `path` and writes the header of `tensors` (name and shape, in the order
    /// their data will be written).
    pub(super) fn create(
        path: &Path,
        tensors: Vec<(String, Vec<usize>)>,
    ) -> Result<Self, CheckpointError> {
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), json!({"format": "pt"}));
        let mut order = Vec::with_capacity(tensors.len());
        let mut offset = 0usize;
        for (name, shape) in tensors {
            let elements: usize = shape.iter().product();
            let end = offset + 4 * elements;
            let entry = json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, end]});
            if header.insert(name.clone(), entry).is_some() {
                return Err(CheckpointError::BadInput(format!(
                    "tensor `{name}` is named twice in {}",
                    path.display()
                )));
            }
            order.push((name, elements));
            offset = end;
        }
        let mut text = serde_json::to_vec(&Value::Object(header)).expect("JSON of a JSON map");
        // The data starts 8-aligned, as the safetensors crate writes it.
        text.resize(text.len().next_multiple_of(8), b' ');
        let file = File::create(path).map_err(io_error("create", path))?;
        let mut writer = TensorWriter {
            path: path.to_path_buf(),
            file: BufWriter::with_capacity(WRITE_BUFFER_BYTES, file),
            crc: Crc32c::new(),
            len_bytes: 0,
            handed_back: 0,
            order,
            next: 0,
        };
        writer.write(&(text.len() as u64).to_le_bytes())?;
        writer.write(&text)?;
        Ok(writer)
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), CheckpointError> {
        self.crc.update(bytes);
        self.len_bytes += bytes.len() as u64;
        self.file
            .write_all(bytes)
            .map_err(io_error("write", &self.path))?;
        if self.len_bytes - self.handed_back >= WRITTEN_BACK_EVERY {
            self.hand_back()?;
        }
        Ok(())
    }

    /// Writes out what was written since the last call, waits for it, and drops it from
    /// the page cache (advice: the data is on the device, so nothing is lost if the
    /// kernel ignores it).
    fn hand_back(&mut self) -> Result<(), CheckpointError> {
        self.file.flush().map_err(io_error("write", &self.path))?;
        let (from, len) = (self.handed_back, self.len_bytes - self.handed_back);
        write_back_and_drop(self.file.get_ref(), from, len)
            .map_err(io_error("write", &self.path))?;
        self.handed_back = self.len_bytes;
        Ok(())
    }

    /// Writes tensor `name`'s `data`: the next one the header lists, of its size.
    pub(super) fn put(&mut self, name: &str, data: &[f32]) -> Result<(), CheckpointError> {
        let expected = self.order.get(self.next);
        if expected.is_none_or(|(n, len)| n != name || *len != data.len()) {
            return Err(CheckpointError::BadInput(format!(
                "{}: tensor `{name}` of {} values written where the header has {:?}",
                self.path.display(),
                data.len(),
                expected
            )));
        }
        self.next += 1;
        self.write(bytes_of(data))
    }

    /// Flushes the file to the device once every tensor is written; its length and
    /// crc32c.
    pub(super) fn finish(self) -> Result<FileDigest, CheckpointError> {
        if self.next != self.order.len() {
            return Err(CheckpointError::BadInput(format!(
                "{}: {} of {} tensors written",
                self.path.display(),
                self.next,
                self.order.len()
            )));
        }
        let path = self.path;
        let file = self
            .file
            .into_inner()
            .map_err(|e| io_error("write", &path)(e.into_error()))?;
        file.sync_all().map_err(io_error("flush", &path))?;
        Ok(FileDigest {
            len_bytes: self.len_bytes,
            crc32c: self.crc.value(),
        })
    }
}

/// A checkpoint's safetensors file opened for reading tensors one at a time.
pub(super) struct TensorReader {
    file: File,
    name: String,
    path: PathBuf,
    data_start: u64,
    data_len: u64,
    tensors: HashMap<String, TensorInfo>,
}

impl TensorReader {
    /// Opens `file` of checkpoint `d` and parses its header.
    pub(super) fn open(d: &Dir<'_>, file: &str) -> Result<Self, CheckpointError> {
        let path = d.0.join(file);
        let bad = |message: String| {
            d.model_error(
                file,
                ModelError::BadSafetensors {
                    path: path.clone(),
                    message,
                },
            )
        };
        let mut f = File::open(&path).map_err(io_error("open", &path))?;
        let file_len = f.metadata().map_err(io_error("inspect", &path))?.len();
        let mut len = [0u8; 8];
        f.read_exact(&mut len)
            .map_err(|_| bad(format!("{file_len} bytes, too short for a header")))?;
        let header_len = u64::from_le_bytes(len);
        if header_len > MAX_HEADER_BYTES || 8 + header_len > file_len {
            return Err(bad(format!(
                "the header says it is {header_len} bytes long, but the file holds {file_len}"
            )));
        }
        let mut header = vec![0u8; header_len as usize];
        f.read_exact(&mut header).map_err(io_error("read", &path))?;
        let json: BTreeMap<String, Value> =
            serde_json::from_slice(&header).map_err(|e| bad(format!("header is not JSON: {e}")))?;
        let mut tensors = HashMap::new();
        for (name, value) in json.into_iter().filter(|(n, _)| n != "__metadata__") {
            let info: TensorInfo = serde_json::from_value(value)
                .map_err(|e| bad(format!("tensor `{name}` has a bad header entry: {e}")))?;
            tensors.insert(name, info);
        }
        Ok(TensorReader {
            file: f,
            name: file.to_string(),
            path,
            data_start: 8 + header_len,
            data_len: file_len - 8 - header_len,
            tensors,
        })
    }

    /// Where the f32 tensor of shape `shape` stored under the first of `names` that the
    /// file holds is: its offset in the file. Reads no data.
    pub(super) fn locate(
        &self,
        d: &Dir<'_>,
        names: &[&str],
        shape: &[usize],
    ) -> Result<u64, CheckpointError> {
        let Some((name, info)) = names.iter().find_map(|n| Some((*n, self.tensors.get(*n)?)))
        else {
            return Err(d.model_error(
                &self.name,
                ModelError::MissingTensor {
                    path: self.path.clone(),
                    name: names[0].to_string(),
                },
            ));
        };
        let error = |e: ModelError| d.model_error(&self.name, e);
        if info.shape != shape {
            return Err(error(ModelError::TensorShape {
                path: self.path.clone(),
                name: name.to_string(),
                expected: shape.to_vec(),
                found: info.shape.clone(),
            }));
        }
        if info.dtype != Dtype::F32 {
            return Err(error(ModelError::TensorDtype {
                path: self.path.clone(),
                name: name.to_string(),
                found: info.dtype.to_string(),
            }));
        }
        let (start, end) = info.data_offsets;
        let bytes = 4 * shape.iter().product::<usize>();
        if end < start || end - start != bytes || end as u64 > self.data_len {
            return Err(error(ModelError::TensorTruncated {
                path: self.path.clone(),
                name: name.to_string(),
                end,
                available: self.data_len as usize,
            }));
        }
        Ok(self.data_start + start as u64)
    }

    /// Reads `out.len()` f32 values at `offset` (from [`Self::locate`]), and drops the
    /// pages read from the page cache (a resume of a checkpoint larger than memory reads
    /// each byte once).
    pub(super) fn read_into(&self, offset: u64, out: &mut [f32]) -> Result<(), CheckpointError> {
        let bytes = bytes_of_mut(out);
        self.file
            .read_exact_at(bytes, offset)
            .map_err(io_error("read", &self.path))?;
        strata_storage::drop_read_pages(&self.file, offset, bytes.len() as u64);
        for x in out.iter_mut() {
            *x = f32::from_bits(u32::from_le(x.to_bits()));
        }
        Ok(())
    }
}
