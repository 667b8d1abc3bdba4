//! Token data and the batching rule.
//!
//! Two formats, read through a memory map:
//! - llm.c's token files: 256 little-endian int32 of header (magic 20240520, version,
//!   token count), then the tokens as little-endian uint16 (version 1) or uint32
//!   (version 2; [`super::tokenize`] writes it when the vocabulary has more than 65,536
//!   ids). Files named `*.bin` must be in this format. A *mask* file `NAME.mask` beside
//!   one, when there, holds one byte per token: 0 where the token is not a target of the
//!   loss (a prompt's tokens), which a batch's targets then hold as
//!   [`super::IGNORE_TARGET`].
//! - Raw text, any other file: each byte is a token (vocabulary 256).
//!
//! Batching: batch `k` of B × T reads the k-th contiguous window of B×T+1 tokens,
//! `w = tokens[k*B*T .. (k+1)*B*T + 1]`; row b has inputs `w[b*T .. b*T+T]` and targets
//! `w[b*T+1 .. b*T+T+1]`.

use std::fs::File;
use std::path::{Path, PathBuf};

use super::mapped::map_read_only;
use super::{IGNORE_TARGET, ModelError};

/// llm.c's token file magic number.
pub const LLMC_MAGIC: i32 = 20_240_520;
/// Bytes of an llm.c token file header.
pub const LLMC_HEADER_BYTES: usize = 256 * 4;

/// How tokens are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenFormat {
    /// llm.c, uint16 tokens after the header.
    LlmcU16,
    /// llm.c version 2, uint32 tokens after the header.
    LlmcU32,
    /// Raw bytes, one token each.
    Bytes,
}

/// A token file, memory-mapped.
#[derive(Debug)]
pub struct TokenData {
    path: PathBuf,
    format: TokenFormat,
    map: Option<memmap2::Mmap>,
    token_count: u64,
    /// One byte per token, 0 where it does not count as a target.
    mask: Option<memmap2::Mmap>,
}

/// One batch: inputs and targets, each B × T, row-major.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    /// Input token ids.
    pub inputs: Vec<u32>,
    /// The token that follows each input.
    pub targets: Vec<u32>,
}

impl TokenData {
    /// Opens a token file: llm.c's format when it starts with its magic number or is
    /// named `*.bin`, raw bytes otherwise.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        let len = file.metadata().map_err(|e| ModelError::io(path, e))?.len();
        let map = if len == 0 {
            None // mmap refuses empty files; an empty file holds no tokens.
        } else {
            // A file changed under the map may give other tokens, which the vocabulary
            // check still guards.
            Some(map_read_only(&file).map_err(|e| ModelError::io(path, e))?)
        };
        let bytes: &[u8] = map.as_deref().unwrap_or(&[]);
        let header_int = |i: usize| {
            bytes
                .get(i * 4..i * 4 + 4)
                .map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")))
        };
        let named_bin = path.extension().is_some_and(|e| e == "bin");
        let magic = header_int(0);
        if magic != Some(LLMC_MAGIC) && !named_bin {
            return Ok(TokenData {
                path: path.to_path_buf(),
                format: TokenFormat::Bytes,
                token_count: bytes.len() as u64,
                map,
                mask: None,
            });
        }
        let too_short = |message: String| ModelError::FileTooShort {
            path: path.to_path_buf(),
            message,
        };
        if bytes.len() < LLMC_HEADER_BYTES {
            return Err(too_short(format!(
                "{} bytes, less than the {LLMC_HEADER_BYTES}-byte header of an llm.c token file",
                bytes.len()
            )));
        }
        if magic != Some(LLMC_MAGIC) {
            return Err(ModelError::BadMagic {
                path: path.to_path_buf(),
                found: magic.unwrap_or(0),
            });
        }
        let (format, width) = match header_int(1) {
            Some(1) => (TokenFormat::LlmcU16, 2),
            Some(2) => (TokenFormat::LlmcU32, 4),
            other => {
                return Err(ModelError::BadInput(format!(
                    "{}: llm.c token file version {} is not 1 (uint16) or 2 (uint32)",
                    path.display(),
                    other.unwrap_or(0)
                )));
            }
        };
        let count = header_int(2).unwrap_or(0);
        let token_count = u64::try_from(count).map_err(|_| {
            ModelError::BadInput(format!("{}: negative token count {count}", path.display()))
        })?;
        let needed = LLMC_HEADER_BYTES as u64 + token_count * width;
        if (bytes.len() as u64) < needed {
            return Err(too_short(format!(
                "the header says {token_count} tokens ({needed} bytes with the header), but the \
                 file holds {} bytes",
                bytes.len()
            )));
        }
        let mask = open_mask(path, token_count)?;
        Ok(TokenData {
            path: path.to_path_buf(),
            format,
            token_count,
            map,
            mask,
        })
    }

    /// Whether a mask leaves some tokens out of the loss.
    pub fn has_mask(&self) -> bool {
        self.mask.is_some()
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How its tokens are stored.
    pub fn format(&self) -> TokenFormat {
        self.format
    }

    /// Tokens in the file.
    pub fn len(&self) -> u64 {
        self.token_count
    }

    /// Whether the file holds no token.
    pub fn is_empty(&self) -> bool {
        self.token_count == 0
    }

    /// The vocabulary the format implies, when it does (raw bytes: 256).
    pub fn implied_vocab(&self) -> Option<usize> {
        (self.format == TokenFormat::Bytes).then_some(256)
    }

    /// Token `index` (below [`TokenData::len`]).
    pub fn token(&self, index: u64) -> u32 {
        assert!(
            index < self.token_count,
            "token {index} of {}",
            self.token_count
        );
        let bytes = self.map.as_deref().unwrap_or(&[]);
        let i = index as usize;
        match self.format {
            TokenFormat::Bytes => bytes[i] as u32,
            TokenFormat::LlmcU16 => {
                let at = LLMC_HEADER_BYTES + 2 * i;
                u16::from_le_bytes([bytes[at], bytes[at + 1]]) as u32
            }
            TokenFormat::LlmcU32 => {
                let at = LLMC_HEADER_BYTES + 4 * i;
                u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
            }
        }
    }

    /// How many whole batches of `batch` × `seq` the file holds.
    pub fn batch_count(&self, batch: usize, seq: usize) -> usize {
        let Some(step) = batch.checked_mul(seq).map(|n| n as u64) else {
            return 0;
        };
        if step == 0 || self.token_count < step.saturating_add(1) {
            0
        } else {
            ((self.token_count - 1) / step) as usize
        }
    }

    /// Batch `step` of `batch` × `seq` into `out`, checking every token against `vocab`.
    pub fn read_batch(
        &self,
        step: usize,
        batch: usize,
        seq: usize,
        vocab: usize,
        out: &mut Batch,
    ) -> Result<(), ModelError> {
        // Sizes past what the file could hold saturate and fail the check below.
        let n = batch.saturating_mul(seq) as u64;
        let start = (step as u64).saturating_mul(n);
        let end = start.saturating_add(n).saturating_add(1);
        if end > self.token_count {
            return Err(ModelError::NotEnoughTokens {
                path: self.path.clone(),
                step,
                batch,
                seq,
                start,
                end,
                available: self.token_count,
            });
        }
        out.inputs.clear();
        out.targets.clear();
        for i in start..end {
            let token = self.token(i);
            if token as usize >= vocab {
                return Err(ModelError::TokenOutOfVocab {
                    origin: self.path.display().to_string(),
                    position: i,
                    token,
                    vocab,
                });
            }
            if i < end - 1 {
                out.inputs.push(token);
            }
            if i > start {
                let counted = self.mask.as_ref().is_none_or(|m| m[i as usize] != 0);
                out.targets
                    .push(if counted { token } else { IGNORE_TARGET });
            }
        }
        Ok(())
    }
}

/// The mask file of a token file: `OUT.mask` beside `OUT` (the tokenizer writes it).
pub fn mask_path(tokens: &Path) -> PathBuf {
    let mut name = tokens.as_os_str().to_owned();
    name.push(".mask");
    PathBuf::from(name)
}

/// The mask beside the token file `path`, if there is one, checked to hold one byte per
/// token.
fn open_mask(path: &Path, token_count: u64) -> Result<Option<memmap2::Mmap>, ModelError> {
    let mask = mask_path(path);
    let file = match File::open(&mask) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(ModelError::io(&mask, e)),
    };
    let len = file.metadata().map_err(|e| ModelError::io(&mask, e))?.len();
    if len != token_count {
        return Err(ModelError::BadInput(format!(
            "{}: {len} bytes, but {} holds {token_count} tokens; a mask has one byte per \
             token (remove it, or tokenize again)",
            mask.display(),
            path.display()
        )));
    }
    if len == 0 {
        return Ok(None);
    }
    let map = map_read_only(&file).map_err(|e| ModelError::io(&mask, e))?;
    Ok(Some(map))
}
