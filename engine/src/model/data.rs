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
//! Checked at open: an llm.c file holds exactly the tokens its header counts, and a mask
//! one byte of 0 or 1 per token, counting at least one; and once per run, before its
//! first batch, every id against the model's vocabulary ([`TokenData::check_vocab`]).
//!
//! Batching: batch `k` of B × T reads the k-th contiguous window of B×T+1 tokens,
//! `w = tokens[k*B*T .. (k+1)*B*T + 1]`; row b has inputs `w[b*T .. b*T+T]` and targets
//! `w[b*T+1 .. b*T+T+1]`.

use std::fs::File;
use std::path::{Path, PathBuf};

use super::mapped::{self, map_read_only};
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
    /// The id that ends a document, when batches are packed: the target after it (the
    /// next document's first token) is not predicted ([`TokenData::packed`]).
    eos: Option<u32>,
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
                eos: None,
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
        if bytes.len() as u64 > needed {
            // llm.c and `strata tokenize` write the tokens and nothing after them: bytes
            // past the last are a file written twice over, or ids wider than the header's
            // version says.
            return Err(ModelError::BadInput(format!(
                "{}: {} bytes past the {token_count} uint{} tokens its header counts ({needed} \
                 bytes with the header); not an llm.c token file as written (a wrong version \
                 or count in the header, or two files joined): tokenize the data again",
                path.display(),
                bytes.len() as u64 - needed,
                width * 8
            )));
        }
        let mask = open_mask(path, token_count)?;
        Ok(TokenData {
            path: path.to_path_buf(),
            format,
            token_count,
            map,
            mask,
            eos: None,
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

    /// The same tokens read as packed documents that end with `eos`: a batch's target
    /// after an `eos` input (the next document's first token, which nothing in the
    /// document predicts) is [`IGNORE_TARGET`], as each document alone would have it.
    pub fn packed(mut self, eos: u32) -> Self {
        self.eos = Some(eos);
        self
    }

    /// The vocabulary the format implies, when it does (raw bytes: 256).
    pub fn implied_vocab(&self) -> Option<usize> {
        (self.format == TokenFormat::Bytes).then_some(256)
    }

    /// Checks that every token id is below `vocab`, scanning the whole file once (before
    /// a run reads its first batch, so that a bad id at any position is refused up front,
    /// not when its batch comes). The error names the first bad id, its position, the
    /// vocabulary and what to do.
    pub fn check_vocab(&self, vocab: usize) -> Result<(), ModelError> {
        let limit = u32::try_from(vocab).unwrap_or(u32::MAX);
        let bytes = self.map.as_deref().unwrap_or(&[]);
        let count = self.token_count as usize;
        let found = match self.format {
            TokenFormat::Bytes if vocab > usize::from(u8::MAX) => None,
            TokenFormat::LlmcU16 if vocab > usize::from(u16::MAX) => None,
            TokenFormat::Bytes => first_at_or_above::<1>(&bytes[..count], limit, |t| t[0] as u32),
            TokenFormat::LlmcU16 => {
                let body = &bytes[LLMC_HEADER_BYTES..LLMC_HEADER_BYTES + 2 * count];
                first_at_or_above::<2>(body, limit, |t| u16::from_le_bytes([t[0], t[1]]) as u32)
            }
            TokenFormat::LlmcU32 => {
                let body = &bytes[LLMC_HEADER_BYTES..LLMC_HEADER_BYTES + 4 * count];
                first_at_or_above::<4>(body, limit, |t| {
                    u32::from_le_bytes([t[0], t[1], t[2], t[3]])
                })
            }
        };
        // Scanned once: the file's pages need not stay in this process (each batch reads
        // its own again).
        self.release(0, self.token_count);
        let Some((position, token)) = found else {
            return Ok(());
        };
        Err(ModelError::BadInput(format!(
            "{}: token {token} at position {position} (of {count}) is outside the model's \
             vocabulary of {vocab} ids: the data was tokenized for another model; tokenize it \
             with this model's tokenizer, or give the model it was made for",
            self.path.display()
        )))
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
            if i > start {
                let counted = self.mask.as_ref().is_none_or(|m| m[i as usize] != 0)
                    // This target's input, token i - 1, is the last one pushed.
                    && self.eos.is_none_or(|eos| out.inputs.last() != Some(&eos));
                out.targets
                    .push(if counted { token } else { IGNORE_TARGET });
            }
            if i < end - 1 {
                out.inputs.push(token);
            }
        }
        self.release(start, end);
        Ok(())
    }

    /// Hands the mapped pages of tokens `start..end` (and their mask) back to the kernel
    /// once read, so that a run reading through a large file does not hold every page
    /// it has read ([`mapped::release`]).
    fn release(&self, start: u64, end: u64) {
        let width = match self.format {
            TokenFormat::Bytes => 1,
            TokenFormat::LlmcU16 => 2,
            TokenFormat::LlmcU32 => 4,
        };
        let header = if self.format == TokenFormat::Bytes {
            0
        } else {
            LLMC_HEADER_BYTES
        };
        let (start, end) = (start as usize, end as usize);
        if let Some(map) = &self.map {
            mapped::release(map, &map[header + width * start..header + width * end]);
        }
        if let Some(mask) = &self.mask {
            mapped::release(mask, &mask[start..end]);
        }
    }
}

/// The first of the `W`-byte little-endian ids in `body` that is at least `limit`, with
/// its index. A chunk's maximum is taken first (a loop the compiler vectorizes), and only
/// a chunk holding a bad id is searched for it.
fn first_at_or_above<const W: usize>(
    body: &[u8],
    limit: u32,
    read: impl Fn(&[u8]) -> u32,
) -> Option<(u64, u32)> {
    const CHUNK_TOKENS: usize = 1 << 12;
    for (c, chunk) in body.chunks(CHUNK_TOKENS * W).enumerate() {
        let max = chunk.chunks_exact(W).map(&read).fold(0, u32::max);
        if max >= limit {
            let (i, token) = chunk
                .chunks_exact(W)
                .map(&read)
                .enumerate()
                .find(|&(_, t)| t >= limit)
                .expect("the chunk's maximum is one");
            return Some(((c * CHUNK_TOKENS + i) as u64, token));
        }
    }
    None
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
    check_mask(&mask, &map)?;
    Ok(Some(map))
}

/// Refuses a mask holding a byte other than 0 and 1 (the tokenizer writes no other; any
/// other is a file that is not a mask), or one that counts no token (a run on it would
/// train on nothing, its loss 0).
fn check_mask(mask: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    if let Some((position, value)) = first_at_or_above::<1>(bytes, 2, |b| b[0] as u32) {
        return Err(ModelError::BadInput(format!(
            "{}: byte {value} at position {position}; a mask holds 0 (not a target of the \
             loss) or 1 (a target) for each token: remove it, or tokenize again",
            mask.display()
        )));
    }
    if first_at_or_above::<1>(bytes, 1, |b| b[0] as u32).is_none() {
        return Err(ModelError::BadInput(format!(
            "{}: every byte is 0, so the loss would count no token: remove it to count \
             every token, or tokenize again with some completions",
            mask.display()
        )));
    }
    Ok(())
}
