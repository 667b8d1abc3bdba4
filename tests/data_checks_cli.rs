//! `--data` checked before step 1, and read by `strata eval` exactly as `strata train`
//! reads it: an id outside the vocabulary anywhere in the file, a bad mask and bytes
//! past the counted tokens are refused up front by both; text is tokenized with the
//! model folder's tokenizer by both; data too short for the batches asked is refused in
//! the same words by both.

#[path = "support/cli.rs"]
mod cli;

use std::path::{Path, PathBuf};

use cli::{data, error_line, ok, strata, text};
use serde_json::Value;
use strata::engine::model::Model;
use strata::engine::model::data::LLMC_MAGIC;
use strata::engine::model::llama::Llama;
use strata::engine::model::weights;

/// The one error line of a failed run, which must not have trained or evaluated a step.
fn refused(args: &[&str]) -> String {
    let out = strata(args);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        !stdout.contains("step ") && !stderr.contains("step "),
        "refused only after steps ran:\n{stdout}\n{stderr}"
    );
    error_line(&out)
}

/// An llm.c token file (uint16 ids) holding `tokens`, with `extra` bytes after them.
fn token_file(path: &Path, tokens: &[u16], extra: &[u8]) {
    let mut header = [0i32; 256];
    (header[0], header[1], header[2]) = (LLMC_MAGIC, 1, tokens.len() as i32);
    let mut bytes: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
    bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    bytes.extend(extra);
    std::fs::write(path, bytes).unwrap();
}

/// A temporary folder with an empty `nvme` folder in it, and that folder's path.
fn scratch() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let nvme = dir.path().join("nvme");
    std::fs::create_dir_all(&nvme).unwrap();
    let nvme = nvme.to_str().unwrap().to_string();
    (dir, nvme)
}

/// The golden GPT-2 (vocabulary 64).
fn gpt2_tiny() -> String {
    data("gpt2-tiny").to_str().unwrap().to_string()
}

/// `strata train` of `model` on `data`, 2 x 16 tokens a step.
fn train_args<'a>(model: &'a str, data: &'a str, nvme: &'a str, steps: &'a str) -> Vec<&'a str> {
    vec![
        "train", "--model", model, "--data", data, "--batch", "2", "--seq", "16", "--steps", steps,
        "--nvme", nvme,
    ]
}

/// `strata eval` of `model` on `data`, 2 x 16 tokens a batch.
fn eval_args<'a>(model: &'a str, data: &'a str) -> Vec<&'a str> {
    vec![
        "eval", "--model", model, "--data", data, "--batch", "2", "--seq", "16", "--device", "cpu",
    ]
}

#[test]
fn an_id_outside_the_vocabulary_anywhere_is_refused_before_step_1() {
    let g = gpt2_tiny();
    let (dir, nvme) = scratch();
    // 10,000 ids below the golden model's vocabulary of 64 but one at position 5,000,
    // which step 157 of 2 x 16 would read first (and which eval --steps 1 never reads).
    let mut tokens: Vec<u16> = (0..10_000).map(|i| (i * 7 % 64) as u16).collect();
    tokens[5000] = 64;
    let path = dir.path().join("tokens.bin");
    token_file(&path, &tokens, &[]);
    let path = path.to_str().unwrap();
    let e = refused(&train_args(&g, path, &nvme, "200"));
    assert!(
        e.contains("token 64 at position 5000 (of 10000) is outside the model's vocabulary of 64")
            && e.contains("tokenize it with this model's tokenizer"),
        "{e}"
    );
    let mut eval = eval_args(&g, path);
    eval.extend(["--steps", "1"]);
    let e2 = refused(&eval);
    assert_eq!(e, e2, "train and eval refuse the data alike");
}

#[test]
fn a_bad_mask_or_bytes_past_the_tokens_are_refused_before_step_1() {
    let g = gpt2_tiny();
    let (dir, nvme) = scratch();
    let tokens: Vec<u16> = (0..200).map(|i| (i % 64) as u16).collect();
    let path = dir.path().join("tokens.bin");
    token_file(&path, &tokens, &[]);
    let mask = dir.path().join("tokens.bin.mask");
    let mut bytes = vec![1u8; 200];
    bytes[150] = 2;
    std::fs::write(&mask, &bytes).unwrap();
    let p = path.to_str().unwrap();
    let e = refused(&train_args(&g, p, &nvme, "2"));
    assert!(
        e.contains("tokens.bin.mask: byte 2 at position 150; a mask holds 0"),
        "{e}"
    );
    std::fs::write(&mask, vec![0u8; 200]).unwrap();
    let e = refused(&eval_args(&g, p));
    assert!(e.contains("the loss would count no token"), "{e}");
    std::fs::remove_file(&mask).unwrap();
    // Two bytes past the 200 counted ids: a 201st id the header does not count.
    token_file(&path, &tokens, &[5, 0]);
    for args in [train_args(&g, p, &nvme, "2"), eval_args(&g, p)] {
        let e = refused(&args);
        assert!(
            e.contains("tokens.bin: 2 bytes past the 200 uint16 tokens its header counts"),
            "{e}"
        );
    }
}

/// A Llama of llama-tiny's shape but the golden tokenizer's vocabulary of 1,000, in
/// `dir/model` with its weights (seeded) and, when `tokenizer`, tokenizer.json.
fn llama_folder(dir: &Path, tokenizer: bool) -> PathBuf {
    let folder = dir.join("model");
    let path = data("llama-tiny/config.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    config["vocab_size"] = 1000.into();
    let model = Model::of(Llama::from_hf_config(&path, &config).unwrap());
    weights::save_pretrained(&model, &model.init_params(3), &folder).unwrap();
    if tokenizer {
        std::fs::copy(
            data("tokenizer-bpe/tokenizer.json"),
            folder.join("tokenizer.json"),
        )
        .unwrap();
    }
    folder
}

fn losses(stdout: &str) -> Vec<String> {
    let lines: Vec<String> = stdout.lines().map(str::to_string).collect();
    assert!(lines.last().unwrap().starts_with("mean loss "), "{stdout}");
    lines
}

#[test]
fn eval_tokenizes_text_with_the_model_tokenizer_as_train_does() {
    let dir = tempfile::tempdir().unwrap();
    let model = llama_folder(dir.path(), true);
    let corpus = dir.path().join("corpus.txt");
    std::fs::copy(data("tokenizer-bpe/eval.txt"), &corpus).unwrap();
    let tokens = dir.path().join("corpus.bin");
    let (m, c, t) = (
        model.to_str().unwrap(),
        corpus.to_str().unwrap(),
        tokens.to_str().unwrap(),
    );
    ok(&["tokenize", "--tokenizer", m, "--input", c, "--output", t]);
    let mut on_text = eval_args(m, c);
    on_text.extend(["--steps", "3"]);
    let mut on_tokens = eval_args(m, t);
    on_tokens.extend(["--steps", "3"]);
    let out = strata(&on_text);
    let stderr = text(&out.stderr);
    assert!(
        out.status.success() && stderr.contains("tokenized with"),
        "{stderr}"
    );
    let want = losses(&ok(&on_tokens));
    assert_eq!(losses(&text(&out.stdout)), want);
    // From the cache the second time, the same.
    assert_eq!(losses(&ok(&on_text)), want);
    // A damaged cache is named, with the way to have it made again.
    let cache = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_str().unwrap().ends_with(".tokens.bin"))
        .unwrap();
    let bytes = std::fs::read(&cache).unwrap();
    std::fs::write(&cache, &bytes[..bytes.len() - 1]).unwrap();
    let e = refused(&on_text);
    assert!(
        e.contains("file too short") && e.contains("remove it, and the next run tokenizes"),
        "{e}"
    );
    std::fs::remove_file(&cache).unwrap();
    assert_eq!(losses(&ok(&on_text)), want);
}

#[test]
fn text_for_a_model_without_a_tokenizer_is_refused_by_eval_as_by_train() {
    let (dir, nvme) = scratch();
    let model = llama_folder(dir.path(), false);
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, "some text ".repeat(500)).unwrap();
    let (m, c) = (model.to_str().unwrap(), corpus.to_str().unwrap());
    let e = refused(&eval_args(m, c));
    assert!(
        e.contains("raw text for a model of vocabulary 1000 needs the model's tokenizer")
            && e.contains("strata tokenize"),
        "{e}"
    );
    let train = ["train", "--model", m, "--data", c, "--nvme", &nvme];
    assert_eq!(refused(&train), e);
}

#[test]
fn data_short_of_the_batches_asked_is_refused_alike_by_eval_and_train() {
    let g = gpt2_tiny();
    let (dir, nvme) = scratch();
    let short = dir.path().join("short.bin");
    token_file(&short, &[1; 32], &[]); // 2 x 16 + 1 tokens are one batch
    let s = short.to_str().unwrap();
    let want = "short.bin: 32 tokens hold 0 whole batches of 2 x 16 (+1) tokens";
    let e = refused(&eval_args(&g, s));
    assert!(
        e.contains(want) && e.contains("evaluation needs 1; give more data"),
        "{e}"
    );
    let e = refused(&train_args(&g, s, &nvme, "2"));
    assert!(e.contains(want) && e.contains("training needs 1"), "{e}");
    // One batch, and training with held-out evaluation needs two.
    token_file(&short, &[1; 33], &[]);
    let mut train = train_args(&g, s, &nvme, "2");
    train.extend(["--eval-every", "1"]);
    let e = refused(&train);
    assert!(
        e.contains(
            "33 tokens hold 1 whole batch of 2 x 16 (+1) tokens, and training besides \
             the held-out batch needs 2"
        ),
        "{e}"
    );
    // The golden 97 tokens hold 3 batches: --steps 4 is refused before the first.
    let golden = data("gpt2-tiny/tokens.bin");
    let mut eval = eval_args(&g, golden.to_str().unwrap());
    eval.extend(["--steps", "4"]);
    let e = refused(&eval);
    assert!(
        e.contains("97 tokens hold 3 whole batches of 2 x 16 (+1) tokens, and --steps 4 needs 4"),
        "{e}"
    );
}
