//! Text to token ids: a Hugging Face `tokenizer.json` (byte-level BPE as GPT-2, Llama 3
//! and Qwen ship it, and the BPE files of Llama 2 and Mistral) through the `tokenizers`
//! crate, and text files encoded into llm.c token files.
//!
//! Inputs: `*.jsonl` files hold one JSON object per line, `{"text": ...}` (a document),
//! `{"prompt": ..., "completion": ...}` (a document whose loss counts the completion
//! only) or `{"messages": [{"role": ..., "content": ...}, ...]}` (a conversation whose
//! loss counts the assistant's turns only); the three may be mixed in one file, each line
//! its own document. Any other file is one document of UTF-8 text. Text documents and
//! pairs are encoded with the tokenizer's special tokens (a Llama BOS) and each is
//! followed by the end-of-sequence token ([`TextTokenizer::eos`]).
//!
//! A conversation is rendered with the folder's chat template ([`super::chat`]) and its
//! text encoded as transformers' `apply_chat_template(tokenize=True)` encodes it: without
//! adding special tokens (the template writes the BOS it wants) and without an EOS after
//! it. The template already ends each assistant turn with its end-of-turn token (Qwen's
//! `<|im_end|>`, Llama 3's `<|eot_id|>`, Mistral's `</s>`), which is what the model must
//! learn to write; an EOS after the whole conversation is a token inference never sees
//! there, and the next conversation's opening tokens do not count in the loss anyway.
//! The mask counts the tokens of each assistant turn, its end-of-turn token included,
//! and nothing else (where a turn lies: [`super::chat`]; tokens: [`super::chat::counted_tokens`]).
//!
//! Output: llm.c's token file ([`super::data`]: version 1 with uint16 ids; version 2,
//! uint32 ids, when the vocabulary has more than 65,536 ids), written under a temporary
//! name and renamed into place. When any document is a prompt/completion pair or a
//! conversation, a *mask* file `OUT.mask` goes beside it: one byte per token, 1 where the
//! token counts as a target of the loss (completion tokens and their EOS, assistant
//! turns), 0 where it does not (prompts, system and user turns, the template's headers).
//!
//! Long text documents are encoded in pieces (in parallel) cut after a lone line feed
//! between two non-space characters, which gives the same ids as the whole text for a
//! byte-level pre-tokenizer without a prefix space (GPT-2's, Llama 3's and Qwen's
//! patterns all split there); other tokenizers get each document whole.
//!
//! [`cached_tokens`] is the training loop's entry: the token file of a text file,
//! encoded once and kept beside it, named by the data's and the tokenizer's checksums.

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::ModelError;
use super::chat::{ChatTemplate, Conversation, counted_tokens};
pub use super::data::mask_path;
use super::data::{LLMC_HEADER_BYTES, LLMC_MAGIC};
use super::mapped::map_read_only;

/// The names end-of-sequence tokens go by, tried in order when no configuration file
/// names the tokenizer's.
const EOS_NAMES: [&str; 5] = [
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<|im_end|>",
    "<eos>",
];

/// Where [`TextTokenizer::encode_document_with`] hands ids: each group's ids and the
/// bytes of text they cover.
pub type IdSink<'a> = dyn FnMut(&[u32], usize) -> Result<(), ModelError> + 'a;

/// Bytes of text per piece a long document is encoded in.
pub const PIECE_BYTES: usize = 1 << 18;

/// A `tokenizer.json`, with the end-of-sequence id and a checksum of the file.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    eos: Option<u32>,
    checksum: u32,
    /// Whether a document may be encoded in pieces cut at lone line feeds.
    splittable: bool,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TextTokenizer({})", self.path.display())
    }
}

/// The `tokenizer.json` of `path`: the file itself, or the one in the folder.
pub fn tokenizer_file(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join("tokenizer.json")
    } else {
        path.to_path_buf()
    }
}

impl TextTokenizer {
    /// Reads `path` (a `tokenizer.json`, or a folder holding one). The end-of-sequence
    /// token is the one `tokenizer_config.json` (`eos_token`) or `config.json`
    /// (`eos_token_id`) beside it names, else the first of the usual names the
    /// vocabulary holds.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let file = tokenizer_file(path);
        let bytes = std::fs::read(&file).map_err(|e| ModelError::io(&file, e))?;
        let unreadable = |e: String| {
            ModelError::BadInput(format!(
                "{}: not a tokenizer.json the tokenizers library reads: {e}",
                file.display()
            ))
        };
        // JSON first: the tokenizers library panics on some syntax errors (a decoder's
        // `expect("Helper")` in 0.22), so it is given only JSON that parses.
        let json: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| unreadable(e.to_string()))?;
        // Valid JSON can still panic the library (a `Precompiled` normalizer whose
        // charsmap does not decode: `expect("Precompiled")` in 0.22): refused like any
        // other file it cannot read.
        let mut inner = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(&bytes))
            .map_err(|_| unreadable("the library panicked reading it (see above)".into()))?
            .map_err(|e| unreadable(e.to_string()))?;
        // A corpus is tokenized whole: a file's truncation would cut every document to
        // its max_length in silence (and a stride over it panics the library), and its
        // padding would add tokens that are not in the text.
        inner
            .with_truncation(None)
            .map_err(|e| unreadable(e.to_string()))?;
        inner.with_padding(None);
        // A template naming a special token the file does not define panics at every
        // encode (tokenizers 0.22, `no entry found for key`): one probe here refuses
        // the file before any text is read. (An error from the probe is left to the
        // encode that would give it.) Every later call is guarded too (`guarded`).
        let _probe = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            inner.encode_fast("a", true)
        }))
        .map_err(|_| unreadable("the library panicked encoding with it (see above)".into()))?;
        let pre = json
            .get("pre_tokenizer")
            .map(|p| p.to_string())
            .unwrap_or_default();
        let splittable = pre.contains("\"ByteLevel\"")
            && !pre.contains("\"add_prefix_space\":true")
            && json.get("normalizer").is_none_or(|n| {
                // No normalizer, or NFC alone (Qwen's), which a cut at a line feed
                // between two non-space characters does not change.
                n.is_null() || n.get("type").and_then(|t| t.as_str()) == Some("NFC")
            });
        let dir = file.parent().unwrap_or(Path::new("."));
        let eos = configured_eos(dir, &inner)
            .or_else(|| EOS_NAMES.iter().find_map(|name| inner.token_to_id(name)));
        Ok(TextTokenizer {
            inner,
            eos,
            checksum: files_checksum(&bytes, dir)?,
            path: file,
            splittable,
        })
    }

    /// The `tokenizer.json` read.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One more than the largest id the tokenizer can give (its vocabulary and added
    /// tokens; ids need not be dense): at most the model's vocabulary for the ids to be
    /// valid.
    pub fn vocab_size(&self) -> usize {
        self.inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&id| id as usize + 1)
    }

    /// The end-of-sequence id that separates documents, if the tokenizer has one.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// The crc32c of the `tokenizer.json` file followed by the files beside it that
    /// choose its EOS and its chat template (those of [`CONFIG_FILES`] there): part of a
    /// cache's name, so that editing any of them tokenizes the data again.
    pub fn checksum(&self) -> u32 {
        self.checksum
    }

    /// The chat template beside the tokenizer ([`ChatTemplate::open`]), refused with
    /// the ways on when the folder has none.
    pub fn chat_template(&self) -> Result<ChatTemplate, ModelError> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        ChatTemplate::open(dir)?.ok_or_else(|| {
            ModelError::BadInput(format!(
                "conversations (`messages` lines) are rendered with the model's chat \
                 template, and {} has none: add the model's `chat_template` to its \
                 tokenizer_config.json (or its chat_template.jinja beside it), or write the \
                 data as {{\"prompt\": ..., \"completion\": ...}} lines",
                dir.display()
            ))
        })
    }

    /// The ids of each of `texts`, no special tokens added, each with the byte range of
    /// its text every token covers (on the crate's threads).
    fn encode_with_offsets(&self, texts: Vec<&str>) -> Result<Vec<IdsAndOffsets>, ModelError> {
        let encodings = self.guarded("encoding", || self.inner.encode_batch(texts, false))?;
        Ok(encodings
            .iter()
            .map(|e| (e.get_ids().to_vec(), e.get_offsets().to_vec()))
            .collect())
    }

    /// The ids of `text`, with the tokenizer's special tokens (a Llama BOS) when
    /// `special` is set.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, ModelError> {
        self.guarded("encoding", || {
            self.inner
                .encode_fast(text, special)
                .map(|e| e.get_ids().to_vec())
        })
    }

    /// The text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String, ModelError> {
        self.guarded("decoding", || self.inner.decode(ids, false))
    }

    /// Several texts at once, on the `tokenizers` crate's threads.
    fn encode_many(&self, texts: Vec<&str>, special: bool) -> Result<Vec<Vec<u32>>, ModelError> {
        let encodings =
            self.guarded("encoding", || self.inner.encode_batch_fast(texts, special))?;
        Ok(encodings.iter().map(|e| e.get_ids().to_vec()).collect())
    }

    /// `call` into the tokenizers library, its error or its panic (the library panics
    /// on some files it reads without complaint, at some texts) an error of `what`.
    fn guarded<T>(
        &self,
        what: &str,
        call: impl FnOnce() -> tokenizers::Result<T>,
    ) -> Result<T, ModelError> {
        let error = |e: String| {
            ModelError::BadInput(format!("{}: {what} failed: {e}", self.path.display()))
        };
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(call))
            .map_err(|_| error("the tokenizers library panicked (see above)".into()))?
            .map_err(|e| error(e.to_string()))
    }

    /// The ids of one text document, encoded in pieces where that gives the same ids
    /// (see the module's notes), `piece_bytes` of text at least each.
    pub fn encode_document(&self, text: &str, piece_bytes: usize) -> Result<Vec<u32>, ModelError> {
        let mut ids = Vec::new();
        self.encode_document_with(text, piece_bytes, &mut |piece, _| {
            ids.extend_from_slice(piece);
            Ok(())
        })?;
        Ok(ids)
    }

    /// [`TextTokenizer::encode_document`], handing the ids to `sink` as they come (with
    /// the bytes of text they cover), so that a large document is never held as ids
    /// whole: at most 64 pieces are encoded (in parallel) at a time.
    pub fn encode_document_with(
        &self,
        text: &str,
        piece_bytes: usize,
        sink: &mut IdSink<'_>,
    ) -> Result<(), ModelError> {
        if !self.splittable || text.len() <= piece_bytes {
            return sink(&self.encode(text, true)?, text.len());
        }
        let pieces = split_pieces(text, piece_bytes);
        sink(&self.encode(pieces[0], true)?, pieces[0].len())?;
        for group in pieces[1..].chunks(64) {
            for (piece, ids) in group.iter().zip(self.encode_many(group.to_vec(), false)?) {
                sink(&ids, piece.len())?;
            }
        }
        Ok(())
    }
}

/// The files beside a `tokenizer.json` that change what text becomes: its EOS and its
/// chat template.
pub const CONFIG_FILES: [&str; 3] = [
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
];

/// A text's ids and the byte range of the text each covers.
type IdsAndOffsets = (Vec<u32>, Vec<(usize, usize)>);

/// The crc32c of `tokenizer` (a `tokenizer.json`'s bytes) followed by those of the
/// [`CONFIG_FILES`] in `dir`, each behind its name.
fn files_checksum(tokenizer: &[u8], dir: &Path) -> Result<u32, ModelError> {
    let mut crc = strata_storage::crc::crc32c(tokenizer);
    for name in CONFIG_FILES {
        let path = dir.join(name);
        match std::fs::read(&path) {
            Ok(bytes) => {
                crc = strata_storage::crc::crc32c_combine(crc, name.as_bytes());
                crc = strata_storage::crc::crc32c_combine(crc, &bytes);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(ModelError::io(&path, e)),
        }
    }
    Ok(crc)
}

/// The end-of-sequence id the files beside a tokenizer name: `tokenizer_config.json`'s
/// `eos_token` (a string or `{"content": ...}`), else `config.json`'s `eos_token_id` (a
/// number or the first of a list).
fn configured_eos(dir: &Path, tokenizer: &tokenizers::Tokenizer) -> Option<u32> {
    let read = |name: &str| -> Option<serde_json::Value> {
        serde_json::from_slice(&std::fs::read(dir.join(name)).ok()?).ok()
    };
    if let Some(config) = read("tokenizer_config.json") {
        let token = config.get("eos_token");
        let name = token.and_then(|t| t.as_str()).or_else(|| {
            token
                .and_then(|t| t.get("content"))
                .and_then(|c| c.as_str())
        });
        if let Some(id) = name.and_then(|n| tokenizer.token_to_id(n)) {
            return Some(id);
        }
    }
    config_eos(dir)
}

/// `config.json`'s `eos_token_id` in the folder `dir` (a number or the first of a list),
/// if it names one.
pub fn config_eos(dir: &Path) -> Option<u32> {
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).ok()?).ok()?;
    let id = config.get("eos_token_id")?;
    let id = id.as_u64().or_else(|| id.as_array()?.first()?.as_u64())?;
    u32::try_from(id).ok()
}

/// `text` cut into pieces of at least `piece_bytes` (the last may be shorter), each cut
/// right after a line feed whose neighbours are not whitespace.
pub fn split_pieces(text: &str, piece_bytes: usize) -> Vec<&str> {
    let bytes = text.as_bytes();
    let mut pieces = Vec::new();
    let mut start = 0;
    let mut at = piece_bytes.max(1);
    while at < bytes.len() {
        // A cut at `at` needs bytes[at - 1] == '\n' with non-space on both sides; the
        // bytes around are ASCII then, so the cut is a char boundary.
        let cut = (at..bytes.len()).find(|&i| {
            bytes[i - 1] == b'\n'
                && i >= 2
                && !bytes[i - 2].is_ascii_whitespace()
                && !bytes[i].is_ascii_whitespace()
        });
        let Some(cut) = cut else { break };
        pieces.push(&text[start..cut]);
        start = cut;
        at = cut + piece_bytes.max(1);
    }
    pieces.push(&text[start..]);
    pieces
}

/// What [`encode_files`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodeSummary {
    /// Tokens written.
    pub tokens: u64,
    /// Documents read.
    pub documents: u64,
    /// Tokens the mask leaves out of the loss (prompt tokens); 0 when no mask was
    /// written.
    pub masked: u64,
    /// Whether the ids are uint32 (version 2) rather than uint16.
    pub wide: bool,
}

fn partial(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".partial");
    PathBuf::from(name)
}

/// Streams tokens into an llm.c token file and its mask.
struct TokenWriter {
    path: PathBuf,
    out: BufWriter<File>,
    mask: BufWriter<File>,
    wide: bool,
    tokens: u64,
    masked: u64,
}

impl TokenWriter {
    fn create(path: &Path, wide: bool) -> Result<Self, ModelError> {
        let open = |p: &Path| {
            File::create(p)
                .map(|f| BufWriter::with_capacity(1 << 20, f))
                .map_err(|e| ModelError::io(p, e))
        };
        let mut out = open(&partial(path))?;
        out.write_all(&[0u8; LLMC_HEADER_BYTES])
            .map_err(|e| ModelError::io(partial(path), e))?;
        Ok(TokenWriter {
            path: path.to_path_buf(),
            out,
            mask: open(&partial(&mask_path(path)))?,
            wide,
            tokens: 0,
            masked: 0,
        })
    }

    /// Appends `ids`, counted as targets of the loss when `counted`.
    fn push(&mut self, ids: &[u32], counted: bool) -> Result<(), ModelError> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            if self.wide {
                bytes.extend_from_slice(&id.to_le_bytes());
            } else {
                let id = u16::try_from(id).map_err(|_| {
                    ModelError::BadInput(format!(
                        "token id {id} does not fit the uint16 token file {}",
                        self.path.display()
                    ))
                })?;
                bytes.extend_from_slice(&id.to_le_bytes());
            }
        }
        let err = |p: PathBuf| move |e| ModelError::io(p, e);
        self.out
            .write_all(&bytes)
            .map_err(err(partial(&self.path)))?;
        self.mask
            .write_all(&vec![u8::from(counted); ids.len()])
            .map_err(err(partial(&mask_path(&self.path))))?;
        self.tokens += ids.len() as u64;
        if !counted {
            self.masked += ids.len() as u64;
        }
        Ok(())
    }

    /// Writes the header, flushes both files to the device and renames them into place;
    /// the mask only when some token is masked (an older mask of that name is removed).
    fn finish(self) -> Result<(u64, u64), ModelError> {
        let part = partial(&self.path);
        let io = |e| ModelError::io(&part, e);
        let count = i32::try_from(self.tokens).map_err(|_| {
            ModelError::BadInput(format!(
                "{}: {} tokens is more than an llm.c token file's header can count \
                 ({}); split the input into several outputs",
                self.path.display(),
                self.tokens,
                i32::MAX
            ))
        })?;
        let mut file = self.out.into_inner().map_err(|e| io(e.into_error()))?;
        let mut header = [0u8; 12];
        header[..4].copy_from_slice(&LLMC_MAGIC.to_le_bytes());
        header[4..8].copy_from_slice(&(if self.wide { 2i32 } else { 1 }).to_le_bytes());
        header[8..].copy_from_slice(&count.to_le_bytes());
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        file.write_all(&header).map_err(io)?;
        file.sync_all().map_err(io)?;
        let mask = mask_path(&self.path);
        let mask_part = partial(&mask);
        let mask_file = self
            .mask
            .into_inner()
            .map_err(|e| ModelError::io(&mask_part, e.into_error()))?;
        if self.masked > 0 {
            mask_file
                .sync_all()
                .map_err(|e| ModelError::io(&mask_part, e))?;
            std::fs::rename(&mask_part, &mask).map_err(|e| ModelError::io(&mask, e))?;
        } else {
            drop(mask_file);
            std::fs::remove_file(&mask_part).map_err(|e| ModelError::io(&mask_part, e))?;
            if mask.exists() {
                std::fs::remove_file(&mask).map_err(|e| ModelError::io(&mask, e))?;
            }
        }
        std::fs::rename(&part, &self.path).map_err(|e| ModelError::io(&self.path, e))?;
        Ok((self.tokens, self.masked))
    }
}

/// Maps `path` read-only and checks that it is UTF-8.
fn map_text(path: &Path) -> Result<Option<memmap2::Mmap>, ModelError> {
    let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
    if file.metadata().map_err(|e| ModelError::io(path, e))?.len() == 0 {
        return Ok(None);
    }
    // A file changed under the map may give other text, which UTF-8 validation guards.
    let map = map_read_only(&file).map_err(|e| ModelError::io(path, e))?;
    if let Err(e) = std::str::from_utf8(&map) {
        return Err(ModelError::BadInput(format!(
            "{}: not UTF-8 text (invalid byte at offset {}); give text files, JSON lines, \
             or an llm.c token file (*.bin)",
            path.display(),
            e.valid_up_to()
        )));
    }
    Ok(Some(map))
}

/// Encodes `inputs` (text files, or `*.jsonl`) with `tokenizer` into the llm.c token file
/// `output` (and `OUT.mask` for prompt/completion lines), each document followed by the
/// tokenizer's EOS. `progress` is called with the input bytes and tokens done so far.
pub fn encode_files(
    tokenizer: &TextTokenizer,
    inputs: &[PathBuf],
    output: &Path,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<EncodeSummary, ModelError> {
    let eos = tokenizer.eos().ok_or_else(|| {
        ModelError::BadInput(format!(
            "{}: no end-of-sequence token to separate documents: none of {} is in its \
             vocabulary and no tokenizer_config.json or config.json beside it names one",
            tokenizer.path().display(),
            EOS_NAMES.join(", ")
        ))
    })?;
    let wide = tokenizer.vocab_size() > usize::from(u16::MAX) + 1;
    let mut writer = TokenWriter::create(output, wide)?;
    let mut documents = 0u64;
    let mut done_bytes = 0u64;
    // The chat template, read at the first conversation.
    let mut chat = None;
    for input in inputs {
        let Some(map) = map_text(input)? else {
            continue;
        };
        let text = std::str::from_utf8(&map).expect("checked by map_text");
        let jsonl = input.extension().is_some_and(|e| e == "jsonl");
        if !jsonl {
            tokenizer.encode_document_with(text, PIECE_BYTES, &mut |ids, bytes| {
                writer.push(ids, true)?;
                done_bytes += bytes as u64;
                progress(done_bytes, writer.tokens);
                Ok(())
            })?;
            writer.push(&[eos], true)?;
            documents += 1;
            continue;
        }
        // JSON lines, a group at a time: parsed here, encoded on the crate's threads.
        let lines: Vec<(usize, &str)> = text
            .lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l))
            .filter(|(_, l)| !l.trim().is_empty())
            .collect();
        for group in lines.chunks(256) {
            let docs = encode_lines(tokenizer, &mut chat, input, group, eos)?;
            for (ids, counted) in docs.iter().flatten() {
                writer.push(ids, *counted)?;
            }
            documents += docs.len() as u64;
            done_bytes += group.iter().map(|(_, l)| l.len() as u64 + 1).sum::<u64>();
            progress(done_bytes, writer.tokens);
        }
    }
    let (tokens, masked) = writer.finish()?;
    Ok(EncodeSummary {
        tokens,
        documents,
        masked,
        wide,
    })
}

/// Whether the JSON lines file `path` (`*.jsonl`) holds a conversation (a `messages`
/// line); false for any other file. Lines are parsed as [`encode_files`] parses them, so
/// a bad line is refused with the same error.
pub fn holds_conversations(path: &Path) -> Result<bool, ModelError> {
    if path.extension().is_none_or(|e| e != "jsonl") {
        return Ok(false);
    }
    let Some(map) = map_text(path)? else {
        return Ok(false);
    };
    let text = std::str::from_utf8(&map).expect("checked by map_text");
    for (i, line) in text.lines().enumerate() {
        // Only a line that names `messages` can be one.
        if line.contains("\"messages\"") && matches!(parse_line(path, i + 1, line)?, Line::Chat(_))
        {
            return Ok(true);
        }
    }
    Ok(false)
}

/// One document of a JSON line.
enum Line {
    /// `{"text": ...}`.
    Text(String),
    /// `{"prompt": ..., "completion": ...}`.
    Pair(String, String),
    /// `{"messages": [...]}`.
    Chat(Conversation),
}

impl Line {
    /// The text encoded with the tokenizer's special tokens: a document, or a prompt.
    fn first(&self) -> Option<&str> {
        match self {
            Line::Text(text) | Line::Pair(text, _) => Some(text),
            Line::Chat(_) => None,
        }
    }

    fn completion(&self) -> Option<&str> {
        match self {
            Line::Pair(_, completion) => Some(completion),
            _ => None,
        }
    }
}

/// A document as runs of ids, each counted in the loss or not.
type Runs = Vec<(Vec<u32>, bool)>;

/// The documents of `group`, JSON lines of `input` with their numbers, each as runs:
/// a text and its EOS, counted; a prompt, not counted, then its completion and EOS,
/// counted; a conversation rendered by the chat template (read into `chat` at the
/// first), its assistant turns counted and the rest not.
fn encode_lines(
    tokenizer: &TextTokenizer,
    chat: &mut Option<ChatTemplate>,
    input: &Path,
    group: &[(usize, &str)],
    eos: u32,
) -> Result<Vec<Runs>, ModelError> {
    let at = |number: usize| {
        move |e: String| ModelError::BadInput(format!("{}:{number}: {e}", input.display()))
    };
    let mut docs = Vec::with_capacity(group.len());
    let mut rendered = Vec::new();
    for &(number, line) in group {
        let doc = parse_line(input, number, line)?;
        if let Line::Chat(conversation) = &doc {
            if chat.is_none() {
                *chat = Some(
                    tokenizer
                        .chat_template()
                        .map_err(|e| at(number)(e.to_string()))?,
                );
            }
            let template = chat.as_ref().expect("read above");
            rendered.push(template.render_chat(conversation).map_err(at(number))?);
        }
        docs.push(doc);
    }
    let mut firsts = tokenizer
        .encode_many(docs.iter().filter_map(Line::first).collect(), true)?
        .into_iter();
    let mut completions = tokenizer
        .encode_many(docs.iter().filter_map(Line::completion).collect(), false)?
        .into_iter();
    let texts = rendered.iter().map(|r| r.text.as_str()).collect();
    let mut chats = rendered
        .iter()
        .zip(tokenizer.encode_with_offsets(texts)?)
        .map(|(chat, (ids, offsets))| {
            let counted = counted_tokens(&offsets, &chat.assistant_spans);
            runs(&ids, &counted)
        });
    let with_eos = |mut ids: Vec<u32>| {
        ids.push(eos);
        ids
    };
    let mut next = |doc: &Line| match doc {
        Line::Text(_) => vec![(with_eos(firsts.next().expect("one a text")), true)],
        Line::Pair(..) => vec![
            (firsts.next().expect("one a prompt"), false),
            (with_eos(completions.next().expect("one a pair")), true),
        ],
        Line::Chat(_) => chats.next().expect("one a conversation"),
    };
    Ok(docs.iter().map(&mut next).collect())
}

/// `ids` cut into runs of equal `counted`.
fn runs(ids: &[u32], counted: &[bool]) -> Runs {
    let mut out: Runs = Vec::new();
    for (&id, &count) in ids.iter().zip(counted) {
        match out.last_mut() {
            Some((run, c)) if *c == count => run.push(id),
            _ => out.push((vec![id], count)),
        }
    }
    out
}

/// One JSON line's document.
fn parse_line(path: &Path, number: usize, line: &str) -> Result<Line, ModelError> {
    let bad = |why: String| {
        ModelError::BadInput(format!(
            "{}:{number}: {why}; each line must be {{\"text\": ...}}, {{\"prompt\": ..., \
             \"completion\": ...}} or {{\"messages\": [{{\"role\": ..., \"content\": ...}}, \
             ...]}}",
            path.display()
        ))
    };
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| bad(format!("not JSON ({e})")))?;
    let field = |name: &str| -> Result<Option<String>, ModelError> {
        match value.get(name) {
            None => Ok(None),
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(bad(format!("`{name}` is {other}, not a string"))),
        }
    };
    let (text, prompt, completion) = (field("text")?, field("prompt")?, field("completion")?);
    match (value.get("messages"), text, prompt, completion) {
        (None, Some(text), None, None) => Ok(Line::Text(text)),
        (None, None, Some(prompt), Some(completion)) => Ok(Line::Pair(prompt, completion)),
        (Some(messages), None, None, None) => Conversation::from_json(messages)
            .map(Line::Chat)
            .map_err(|e| ModelError::BadInput(format!("{}:{number}: {e}", path.display()))),
        _ => Err(bad(
            "not one of `text`, both `prompt` and `completion`, or `messages`".into(),
        )),
    }
}

/// The token file of the text (or JSON lines) file `data` under `tokenizer`: encoded once
/// into `DATA.<data crc32c>-<length>-<tokenizer crc32c>.tokens.bin` beside it (or in
/// `fallback_dir` when its folder is not writable) and reused while neither changes.
/// Returns the path and whether it was encoded now.
pub fn cached_tokens(
    tokenizer: &TextTokenizer,
    data: &Path,
    fallback_dir: &Path,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<(PathBuf, bool), ModelError> {
    let bytes = map_text(data)?;
    let content: &[u8] = bytes.as_deref().unwrap_or(&[]);
    let name = format!(
        "{}.{:08x}-{}-{:08x}.tokens.bin",
        data.file_name()
            .map_or("data".into(), |n| n.to_string_lossy()),
        strata_storage::crc::crc32c(content),
        content.len(),
        tokenizer.checksum()
    );
    drop(bytes);
    let dir = data.parent().unwrap_or(Path::new("."));
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let beside = dir.join(&name);
    let fallback = fallback_dir.join(&name);
    for path in [&beside, &fallback] {
        if path.is_file() {
            return Ok((path.clone(), false));
        }
    }
    let writable = tempfile_probe(dir);
    let path = if writable { beside } else { fallback };
    if !writable {
        std::fs::create_dir_all(fallback_dir).map_err(|e| ModelError::io(fallback_dir, e))?;
    }
    encode_files(tokenizer, &[data.to_path_buf()], &path, progress)?;
    Ok((path, true))
}

/// Whether a file can be created in `dir`.
fn tempfile_probe(dir: &Path) -> bool {
    let probe = dir.join(format!(".strata-write-probe-{}", std::process::id()));
    let ok = File::create(&probe).is_ok();
    let _ = std::fs::remove_file(&probe);
    ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cut_after_a_lone_line_feed_and_cover_the_text() {
        let text = "ab\ncd\n\nef\n gh\nij";
        let pieces = split_pieces(text, 2);
        assert_eq!(pieces.concat(), text);
        assert_eq!(pieces, ["ab\n", "cd\n\nef\n gh\n", "ij"]);
        assert_eq!(split_pieces(text, 100), [text]);
    }
}
