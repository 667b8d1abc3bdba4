//! `strata tokenize`: text files encoded with a Hugging Face `tokenizer.json` into one
//! llm.c token file (the format `strata train --data` and `strata eval` read), with a
//! progress bar and the rate reached. The encoding itself is the engine's
//! ([`strata_engine::model::tokenize`]); this module is the command around it.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

use strata_engine::model::tokenize::{TextTokenizer, encode_files, mask_path};

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
pub fn run(args: &TokenizeArgs, out: &mut impl Write) -> Result<(), Box<dyn std::error::Error>> {
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
