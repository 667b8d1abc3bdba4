//! A run's tokens ([`RunData`]): the built-in corpus, or `--data` read as `strata eval`
//! reads it ([`crate::tokenize::open_data`]: an llm.c token file, or text tokenized once
//! with the model folder's `tokenizer.json`, every id checked against the vocabulary);
//! and how many batches it has for training, with the last kept out for evaluation when
//! the run evaluates. Packed (`--pack`), a target after a document's end is not counted;
//! chat data is refused packed.
//!
//! Not here: the token file format and the tokenizer (the engine's `model::data` and
//! `model::tokenize`), or the corpus itself ([`crate::corpus`]).

use std::io::Write;
use std::path::{Path, PathBuf};

use strata_engine::model::Model;
use strata_engine::model::data::TokenData;
use strata_engine::model::tokenize;

use crate::machine::default_scratch_dir;
use crate::tokenize::{open_data, whole_batches};
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
        if let (Some(path), Some(eos)) = (&cfg.data, model.packing()) {
            refuse_packed_conversations(path, eos)?;
        }
        let (path, tokens) = match &cfg.data {
            Some(path) => (
                path.clone(),
                open_data(path, Path::new(&cfg.model), model, out)?,
            ),
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
                tokens.check_vocab(model.vocab())?;
                (path, tokens)
            }
        };
        // Packed: nothing predicts the next document's first token.
        let tokens = match model.packing() {
            Some(eos) => tokens.packed(eos),
            None => tokens,
        };
        // With held-out evaluation the last batch is kept out of training.
        let evaluates = cfg.eval_every > 0;
        let needed = 1 + usize::from(evaluates);
        let what = if evaluates {
            "training besides the held-out batch"
        } else {
            "training"
        };
        let available = whole_batches(&tokens, cfg.batch, cfg.seq, needed, what)?;
        let held_out = evaluates.then(|| available - 1);
        let train_batches = available - usize::from(evaluates);
        Ok(RunData {
            path,
            tokens,
            held_out,
            train_batches,
        })
    }
}

/// Packing (`--pack`) is refused for chat data: chat templates end every turn with the
/// token that ends a packed document, so each turn would be a document of its own, and
/// an assistant turn would not see the prompt it answers.
fn refuse_packed_conversations(path: &Path, eos: u32) -> Result<(), Error> {
    if tokenize::holds_conversations(path)? {
        return Err(format!(
            "{}: --pack cannot pack conversations: a chat template ends each turn with the \
             end-of-sequence token ({eos}), which ends a packed document, so every turn \
             would be a document of its own and no assistant turn would see its prompt; \
             train chat data without --pack",
            path.display()
        )
        .into());
    }
    Ok(())
}
