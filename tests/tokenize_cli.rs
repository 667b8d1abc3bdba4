//! `strata tokenize` and `strata train --data` on text as a user runs them: the golden
//! tokenizer's ids in the token file, JSON lines with a prompt mask, the tokenized cache,
//! "epoch 2", a bf16 sharded model trained and written back as it came with its
//! tokenizer, and one-line errors for text without a tokenizer.

#[path = "support/cli.rs"]
mod cli;

use std::path::{Path, PathBuf};

use cli::{data, error_line, ok, strata};
use strata::engine::model::Model;
use strata::engine::model::data::TokenData;
use strata::engine::model::gpt2::Gpt2Config;
use strata::engine::model::weights::{
    self, FileDtype, INDEX_FILE, SaveOptions, WEIGHTS_FILE, WeightFiles,
};

/// The golden ids, from the golden token file (`eval.bin`).
fn golden_ids() -> Vec<u32> {
    let tokens = TokenData::open(&data("tokenizer-bpe/eval.bin")).unwrap();
    (0..tokens.len()).map(|i| tokens.token(i)).collect()
}

#[test]
fn tokenize_writes_the_golden_ids_and_says_its_rate() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("eval.bin");
    let tokenizer = data("tokenizer-bpe/tokenizer.json");
    let input = data("tokenizer-bpe/eval.txt");
    let stdout = ok(&[
        "tokenize",
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        input.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(
        stdout.contains("12076 tokens from 2 documents") && stdout.contains("tokens/s"),
        "{stdout}"
    );
    let tokens = TokenData::open(&out).unwrap();
    let got: Vec<u32> = (0..tokens.len()).map(|i| tokens.token(i)).collect();
    let mut want = golden_ids();
    want.push(got[6037]);
    let once = want.clone();
    want.extend(once);
    assert_eq!(got, want);
    let e = error_line(&strata(&[
        "tokenize",
        "--tokenizer",
        input.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]));
    assert!(e.contains("not a tokenizer.json"), "{e}");
}

/// A GPT-2 of the golden tokenizer's vocabulary in `dir/model`, saved in bf16 as
/// shards, with the tokenizer beside it.
fn bf16_sharded_model(dir: &Path) -> PathBuf {
    let model = Model::new(Gpt2Config::new(2, 2, 32, 1000, 64)).unwrap();
    let params = model.init_params(5);
    let folder = dir.join("model");
    let options = SaveOptions {
        dtype: FileDtype::Bf16,
        max_shard_bytes: 20_000,
        base: None,
    };
    weights::save_pretrained_with(&model, &params, &folder, &options).unwrap();
    std::fs::copy(
        data("tokenizer-bpe/tokenizer.json"),
        folder.join("tokenizer.json"),
    )
    .unwrap();
    folder
}

#[test]
fn train_on_text_and_json_lines_with_the_model_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let model = bf16_sharded_model(dir.path());
    let nvme = dir.path().join("nvme");
    std::fs::create_dir_all(&nvme).unwrap();
    let corpus = dir.path().join("corpus.txt");
    std::fs::copy(data("tokenizer-bpe/eval.txt"), &corpus).unwrap();
    let out = dir.path().join("out");
    let train = |data: &Path, steps: &str, extra: &[&str]| {
        let mut args = vec![
            "train",
            "--model",
            model.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--batch",
            "2",
            "--seq",
            "64",
            "--steps",
            steps,
            "--nvme",
            nvme.to_str().unwrap(),
            "--policy",
            "cpu-offload",
        ];
        args.extend(extra);
        ok(&args)
    };
    // 6038 tokens hold 47 batches of 2 x 64: 50 steps run into a second epoch, said once.
    let first = train(&corpus, "50", &["--out", out.to_str().unwrap()]);
    assert!(
        first.contains("tokenized with") && first.contains("cached as"),
        "{first}"
    );
    assert_eq!(first.matches("epoch 2").count(), 1, "{first}");
    assert!(!first.contains("epoch 3"), "{first}");
    assert!(first.contains("bfloat16, sharded"), "{first}");
    // Saved as it came: bf16, sharded, the tokenizer carried, torch_dtype set.
    let files = WeightFiles::open(&out).unwrap();
    assert!(files.file_count() > 1);
    assert!(out.join(INDEX_FILE).is_file() && !out.join(WEIGHTS_FILE).exists());
    assert_eq!(
        std::fs::read(out.join("tokenizer.json")).unwrap(),
        std::fs::read(model.join("tokenizer.json")).unwrap()
    );
    let (_, source) = weights::describe_pretrained(&out).unwrap();
    assert_eq!(source.dtype, FileDtype::Bf16);
    assert_eq!(weights::config_dtype(&source.config), Some("bfloat16"));
    // Again, over the first (--overwrite): the cache is used; --save-dtype fp32 writes
    // f32 (in shards of the input's size, so more of them).
    let second = train(
        &corpus,
        "2",
        &[
            "--out",
            out.to_str().unwrap(),
            "--overwrite",
            "--save-dtype",
            "fp32",
        ],
    );
    assert!(second.contains("from the cache"), "{second}");
    let (_, source) = weights::describe_pretrained(&out).unwrap();
    assert_eq!(source.dtype, FileDtype::F32);
    assert_eq!(weights::config_dtype(&source.config), Some("float32"));
    assert!(WeightFiles::open(&out).unwrap().file_count() > files.file_count());

    // JSON lines with prompts: the loss counts the completions only.
    let jsonl = dir.path().join("pairs.jsonl");
    let line = r#"{"prompt": "Question: what may you do with it?", "completion": " You may copy and share it, as the licence says."}"#;
    std::fs::write(&jsonl, format!("{line}\n").repeat(40)).unwrap();
    let pairs = train(&jsonl, "2", &[]);
    assert!(
        pairs.contains("the loss counts completions and assistant turns only"),
        "{pairs}"
    );
}

#[test]
fn raw_text_without_a_tokenizer_is_refused_naming_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, "some text ".repeat(500)).unwrap();
    let nvme = dir.path().join("nvme");
    std::fs::create_dir_all(&nvme).unwrap();
    let e = error_line(&strata(&[
        "train",
        "--model",
        "gpt2",
        "--data",
        corpus.to_str().unwrap(),
        "--nvme",
        nvme.to_str().unwrap(),
    ]));
    assert!(
        e.contains("vocabulary 50257 needs the model's tokenizer") && e.contains("strata tokenize"),
        "{e}"
    );
    // A model folder without tokenizer.json: the same, naming the folder.
    let model = bf16_sharded_model(dir.path());
    std::fs::remove_file(model.join("tokenizer.json")).unwrap();
    let jsonl = dir.path().join("d.jsonl");
    std::fs::write(&jsonl, "{\"text\": \"hello\"}\n").unwrap();
    let e = error_line(&strata(&[
        "train",
        "--model",
        model.to_str().unwrap(),
        "--data",
        jsonl.to_str().unwrap(),
        "--nvme",
        nvme.to_str().unwrap(),
    ]));
    assert!(
        e.contains("JSON lines") && e.contains("has no tokenizer.json"),
        "{e}"
    );
}
