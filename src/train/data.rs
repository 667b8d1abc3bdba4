//! A run's tokens ([`RunData`]): the built-in corpus, an llm.c token file, or text
//! tokenized once with the model folder's `tokenizer.json` (cached beside the data); and
//! how many batches it has for training, with the last kept out for evaluation when the
//! run evaluates.
//!
//! Not here: the token file format and the tokenizer (the engine's `model::data` and
//! `model::tokenize`), or the corpus itself ([`crate::corpus`]).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use strata_engine::model::Model;
use strata_engine::model::data::{TokenData, TokenFormat};
use strata_engine::model::tokenize::{TextTokenizer, cached_tokens, tokenizer_file};

use crate::machine::default_scratch_dir;
use crate::train_config::TrainConfig;

type Error = Box<dyn std::error::Error>;

/// The tokens a run reads, and how its batches are used.
pub struct RunData {
    /// The file read (the built-in corpus's, when no `data` is set).
    pub path: PathBuf,
    /// Its tokens.
    pub tokens: TokenData,
    /// The batch kept out of training to evaluate on (the last), when the run evaluates.
    pub held_out: Option<usize>,
    /// The batches training reads, in file order, again from the start after the last.
    pub train_batches: usize,
}

impl RunData {
    /// The configuration's data for `model`, refused when it holds no batch to train on.
    pub fn open(cfg: &TrainConfig, model: &Model, out: &mut impl Write) -> Result<Self, Error> {
        let (path, tokens) = match &cfg.data {
            Some(path) => (path.clone(), open_data(path, cfg, model, out)?),
            // The built-in corpus is the default job's, bytes as tokens whatever the model
            // (a plan for a large shape is judged before a batch is read).
            None => {
                let path = crate::corpus::ensure_file(
                    &default_scratch_dir(),
                    crate::corpus::DEFAULT_BYTES,
                    1,
                )
                .map_err(|e| format!("writing the built-in corpus: {e}"))?;
                let tokens = TokenData::open(&path)?;
                (path, tokens)
            }
        };
        let available = tokens.batch_count(cfg.batch, cfg.seq);
        // With held-out evaluation the last batch is kept out of training.
        let held_out = (cfg.eval_every > 0).then(|| available.saturating_sub(1));
        let train_batches = available - usize::from(held_out.is_some());
        if train_batches == 0 {
            return Err(format!(
                "{}: {} tokens is not enough for one batch of {} x {} (+1) tokens{}",
                path.display(),
                tokens.len(),
                cfg.batch,
                cfg.seq,
                if held_out.is_some() {
                    " besides the held-out batch"
                } else {
                    ""
                }
            )
            .into());
        }
        Ok(RunData {
            path,
            tokens,
            held_out,
            train_batches,
        })
    }
}

/// The folder whose `tokenizer.json` tokenizes text for the configured model: the model
/// folder (or the folder of a model file).
fn model_dir(cfg: &TrainConfig) -> &Path {
    let model_dir = Path::new(&cfg.model);
    if model_dir.is_file() {
        model_dir.parent().unwrap_or(Path::new("."))
    } else {
        model_dir
    }
}

/// The tokens of `path` for `model`: an llm.c token file as it is; text or JSON lines
/// tokenized with the model folder's `tokenizer.json` (once, cached beside the data);
/// text read one byte per token for a model of vocabulary 256 without a tokenizer. Any
/// other model with raw text is refused, naming the fix.
fn open_data(
    path: &Path,
    cfg: &TrainConfig,
    model: &Model,
    out: &mut impl Write,
) -> Result<TokenData, Error> {
    let bytes = TokenData::open(path)?;
    if bytes.format() != TokenFormat::Bytes {
        return Ok(bytes);
    }
    let tokenizer = tokenizer_file(model_dir(cfg));
    let jsonl = path.extension().is_some_and(|e| e == "jsonl");
    if !tokenizer.is_file() {
        if model.vocab() == 256 && !jsonl {
            return Ok(bytes);
        }
        return Err(no_tokenizer(path, cfg, model, jsonl).into());
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
    tokenize(path, &tokenizer, out)
}

/// Why text at `path` cannot be read for the configured model without a tokenizer, and
/// what to do.
fn no_tokenizer(path: &Path, cfg: &TrainConfig, model: &Model, jsonl: bool) -> String {
    format!(
        "--data {}: {} for a model of vocabulary {} needs the model's tokenizer, and {} \
         has no tokenizer.json; give --model a folder holding one, or tokenize the \
         data first (strata tokenize --tokenizer TOKENIZER.json --input {} --output \
         DATA.bin) and give --data DATA.bin",
        path.display(),
        if jsonl { "JSON lines" } else { "raw text" },
        model.vocab(),
        if Path::new(&cfg.model).exists() {
            model_dir(cfg).display().to_string()
        } else {
            format!("the preset {}", cfg.model)
        },
        path.display()
    )
}

/// The tokens of the text at `path` by `tokenizer`, from the cache or tokenized now (with
/// a progress bar), saying which.
fn tokenize(
    path: &Path,
    tokenizer: &TextTokenizer,
    out: &mut impl Write,
) -> Result<TokenData, Error> {
    let bar = crate::tokenize::bytes_bar(std::fs::metadata(path)?.len(), "tokenizing ");
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
    let data = TokenData::open(&tokens)?;
    let seconds = started.elapsed().as_secs_f64();
    writeln!(
        out,
        "data: {} tokenized with {} into {} tokens{}{}, {}",
        path.display(),
        tokenizer.path().display(),
        data.len(),
        if data.has_mask() {
            " (the loss counts completions only)"
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
