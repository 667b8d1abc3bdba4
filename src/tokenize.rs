//! `strata tokenize`: text files encoded with a Hugging Face `tokenizer.json` into one
//! llm.c token file (the format `strata train --data` and `strata eval` read), with a
//! progress bar and the rate reached; and [`open_data`], the one reader of `--data` that
//! `strata train` and `strata eval` share: a token file as it is, or text tokenized with
//! the model folder's tokenizer (cached), every id checked against the model's
//! vocabulary before a batch is read. The encoding itself is the engine's
//! ([`strata_engine::model::tokenize`]); this module is the commands' side of it.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use strata_engine::model::Model;
use strata_engine::model::data::{TokenData, TokenFormat};
use strata_engine::model::tokenize::{
    TextTokenizer, cached_tokens, encode_files, mask_path, tokenizer_file,
};

use crate::machine::default_scratch_dir;

type Error = Box<dyn std::error::Error>;

/// Arguments of `strata tokenize`.
#[derive(Debug, Clone, clap::Args)]
pub struct TokenizeArgs {
    /// The tokenizer: a tokenizer.json, or a model folder holding one (its
    /// tokenizer_config.json or config.json names the end-of-sequence token).
    #[arg(long, value_name = "FILE|DIR")]
    pub tokenizer: PathBuf,
    /// Input files, in order: *.jsonl lines {"text": ...} or {"prompt": ...,
    /// "completion": ...}; any other file is one document of UTF-8 text. Each document
    /// is followed by the end-of-sequence token.
    #[arg(long, value_name = "FILE", num_args = 1.., required = true)]
    pub input: Vec<PathBuf>,
    /// The llm.c token file to write: a 1024-byte header (int32 magic 20240520, version,
    /// token count), then uint16 ids (version 1) or, for a vocabulary of more than 65536
    /// ids, uint32 ids (version 2). Prompt/completion lines also write OUTPUT.mask, one
    /// byte per token, 0 where the loss does not count it.
    #[arg(long, value_name = "OUT.bin")]
    pub output: PathBuf,
}

/// `strata tokenize`.
pub fn run(args: &TokenizeArgs, out: &mut impl Write) -> Result<(), Error> {
    let tokenizer = TextTokenizer::open(&args.tokenizer)?;
    let mut total_bytes = 0u64;
    for input in &args.input {
        total_bytes += std::fs::metadata(input)
            .map_err(|e| format!("--input {}: {e}", input.display()))?
            .len();
    }
    let bar = bytes_bar(total_bytes, "");
    let started = Instant::now();
    let summary = encode_files(
        &tokenizer,
        &args.input,
        &args.output,
        &mut |done, tokens| {
            let seconds = started.elapsed().as_secs_f64().max(1e-9);
            bar.set_position(done);
            bar.set_message(format!(
                "{tokens} tokens, {:.0} tokens/s",
                tokens as f64 / seconds
            ));
        },
    )?;
    bar.finish_and_clear();
    let seconds = started.elapsed().as_secs_f64();
    writeln!(
        out,
        "{}: {} tokens from {} documents ({} input bytes) in {seconds:.2} s: {:.0} tokens/s, \
         {:.1} MB/s; uint{} ids (vocabulary {}, end of sequence {})",
        args.output.display(),
        summary.tokens,
        summary.documents,
        total_bytes,
        summary.tokens as f64 / seconds,
        total_bytes as f64 / seconds / 1e6,
        if summary.wide { 32 } else { 16 },
        tokenizer.vocab_size(),
        tokenizer.eos().expect("encode_files needs one"),
    )?;
    if summary.masked > 0 {
        writeln!(
            out,
            "{}: {} prompt tokens the loss does not count",
            mask_path(&args.output).display(),
            summary.masked
        )?;
    }
    Ok(())
}

/// A progress bar over `total_bytes` of input on a terminal's stderr (hidden otherwise),
/// its message after `prefix`.
pub fn bytes_bar(total_bytes: u64, prefix: &str) -> indicatif::ProgressBar {
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total_bytes);
    let template = format!("{prefix}{{bar:30}} {{bytes}}/{{total_bytes}} {{msg}} eta {{eta}}");
    bar.set_style(indicatif::ProgressStyle::with_template(&template).expect("a valid template"));
    bar
}

/// The tokens of `--data` at `path` for `model`, read from `model_source` (a model
/// folder, a weights file in one, or a preset's name), as `strata train` and `strata
/// eval` both read them: an llm.c token file as it is; text or JSON lines tokenized with
/// the model folder's `tokenizer.json` (once, cached beside the data; what was done goes
/// to `out`); text read one byte per token for a model of vocabulary 256 without a
/// tokenizer. Any other model with raw text is refused, naming the fix; so is an id
/// outside the model's vocabulary anywhere in the data (one scan, before any batch).
pub fn open_data(
    path: &Path,
    model_source: &Path,
    model: &Model,
    out: &mut dyn Write,
) -> Result<TokenData, Error> {
    let tokens = tokens_for(path, model_source, model, out)?;
    tokens.check_vocab(model.vocab())?;
    Ok(tokens)
}

/// [`open_data`] before the vocabulary check.
fn tokens_for(
    path: &Path,
    model_source: &Path,
    model: &Model,
    out: &mut dyn Write,
) -> Result<TokenData, Error> {
    let bytes = TokenData::open(path)?;
    if bytes.format() != TokenFormat::Bytes {
        return Ok(bytes);
    }
    let tokenizer = tokenizer_file(model_dir(model_source));
    let jsonl = path.extension().is_some_and(|e| e == "jsonl");
    if !tokenizer.is_file() {
        if model.vocab() == 256 && !jsonl {
            return Ok(bytes);
        }
        return Err(no_tokenizer(path, model_source, model, jsonl).into());
    }
    let tokenizer = TextTokenizer::open(&tokenizer)?;
    if tokenizer.vocab_size() > model.vocab() {
        return Err(format!(
            "{}: the tokenizer has {} ids but the model's vocabulary is {}; give the \
             model's own tokenizer",
            tokenizer.path().display(),
            tokenizer.vocab_size(),
            model.vocab()
        )
        .into());
    }
    tokenize_cached(path, &tokenizer, out)
}

/// How many whole batches of `batch` × `seq` (+1) `tokens` holds, refused when fewer than
/// `needed`, which `what` (the use, as "training") needs.
pub fn whole_batches(
    tokens: &TokenData,
    batch: usize,
    seq: usize,
    needed: usize,
    what: &str,
) -> Result<usize, Error> {
    let available = tokens.batch_count(batch, seq);
    if available >= needed {
        return Ok(available);
    }
    Err(format!(
        "{}: {} tokens hold {available} whole batch{} of {batch} x {seq} (+1) tokens, and \
         {what} needs {needed}; give more data, or a smaller --batch or --seq",
        tokens.path().display(),
        tokens.len(),
        if available == 1 { "" } else { "es" },
    )
    .into())
}

/// The folder whose `tokenizer.json` tokenizes text for the model from `model_source`:
/// the model folder (or the folder of a model file).
fn model_dir(model_source: &Path) -> &Path {
    if model_source.is_file() {
        model_source.parent().unwrap_or(Path::new("."))
    } else {
        model_source
    }
}

/// Why text at `path` cannot be read for the model from `model_source` without a
/// tokenizer, and what to do.
fn no_tokenizer(path: &Path, model_source: &Path, model: &Model, jsonl: bool) -> String {
    format!(
        "--data {}: {} for a model of vocabulary {} needs the model's tokenizer, and {} \
         has no tokenizer.json; give --model a folder holding one, or tokenize the \
         data first (strata tokenize --tokenizer TOKENIZER.json --input {} --output \
         DATA.bin) and give --data DATA.bin",
        path.display(),
        if jsonl { "JSON lines" } else { "raw text" },
        model.vocab(),
        if model_source.exists() {
            model_dir(model_source).display().to_string()
        } else {
            format!("the preset {}", model_source.display())
        },
        path.display()
    )
}

/// The tokens of the text at `path` by `tokenizer`, from the cache or tokenized now (with
/// a progress bar), saying which.
fn tokenize_cached(
    path: &Path,
    tokenizer: &TextTokenizer,
    out: &mut dyn Write,
) -> Result<TokenData, Error> {
    let bar = bytes_bar(std::fs::metadata(path)?.len(), "tokenizing ");
    let started = Instant::now();
    let (tokens, fresh) = cached_tokens(
        tokenizer,
        path,
        &default_scratch_dir(),
        &mut |done, tokens| {
            bar.set_position(done);
            bar.set_message(format!("{tokens} tokens"));
        },
    )?;
    bar.finish_and_clear();
    // The cache is derived data: a damaged one (a full disk, a copy cut short) is named
    // with the way to have it made again.
    let data = TokenData::open(&tokens).map_err(|e| {
        format!(
            "{e}; this is strata's cache of {} tokenized: remove it, and the next run \
             tokenizes the text again",
            path.display()
        )
    })?;
    let seconds = started.elapsed().as_secs_f64();
    writeln!(
        out,
        "data: {} tokenized with {} into {} tokens{}{}, {}",
        path.display(),
        tokenizer.path().display(),
        data.len(),
        if data.has_mask() {
            " (the loss counts completions and assistant turns only)"
        } else {
            ""
        },
        if fresh {
            format!(
                " in {seconds:.1} s ({:.0} tokens/s)",
                data.len() as f64 / seconds
            )
        } else {
            String::new()
        },
        if fresh { "cached as" } else { "from the cache" },
    )?;
    writeln!(out, "  {}", tokens.display())?;
    Ok(data)
}
