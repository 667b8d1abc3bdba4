//! `strata train --data chats.jsonl` as a user runs it on chat data: a tiny Llama whose
//! folder holds a tokenizer with Qwen2.5's chat template (`tests/data/chat`, see its
//! README) trains on the golden conversations, tokenized once through the template with
//! a mask that leaves everything but the assistant turns out of the loss; packed, it is
//! refused.

#[path = "support/cli.rs"]
mod cli;

use std::path::{Path, PathBuf};

use cli::{data, error_line, ok, strata};
use serde_json::Value;
use strata::engine::model::data::TokenData;
use strata::engine::model::llama::Llama;
use strata::engine::model::weights;
use strata::engine::model::{IGNORE_TARGET, Model};

/// A Llama of llama-tiny's shape with the vocabulary of the Qwen2.5 chat tokenizer
/// (1,002 ids), in `dir/model` with its weights (seeded), tokenizer and template.
fn chat_llama(dir: &Path) -> PathBuf {
    let folder = dir.join("model");
    let path = data("llama-tiny/config.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    config["vocab_size"] = 1002.into();
    let model = Model::of(Llama::from_hf_config(&path, &config).unwrap());
    weights::save_pretrained(&model, &model.init_params(3), &folder).unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(data("chat/qwen2.5").join(file), folder.join(file)).unwrap();
    }
    folder
}

#[test]
fn train_on_chat_data_through_the_model_chat_template() {
    let dir = tempfile::tempdir().unwrap();
    let model = chat_llama(dir.path());
    let chats = dir.path().join("chats.jsonl");
    std::fs::copy(data("chat/chats.jsonl"), &chats).unwrap();
    let nvme = dir.path().join("nvme");
    std::fs::create_dir_all(&nvme).unwrap();
    let stdout = ok(&[
        "train",
        "--model",
        model.to_str().unwrap(),
        "--data",
        chats.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "32",
        "--steps",
        "3",
        "--nvme",
        nvme.to_str().unwrap(),
        "--policy",
        "cpu-offload",
    ]);
    assert!(
        stdout.contains("tokenized with") && stdout.contains("cached as"),
        "{stdout}"
    );
    // The cache beside the data: the conversations' ids with a mask counting some
    // tokens and leaving out others (the system and user turns).
    let cache = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().ends_with(".tokens.bin"))
        .expect("the tokenized cache");
    let tokens = TokenData::open(&cache).unwrap();
    assert!(tokens.has_mask());
    let expected: Value =
        serde_json::from_slice(&std::fs::read(data("chat/expected.json")).unwrap()).unwrap();
    let want: usize = expected["templates"]["qwen2.5"]["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["ids"].as_array().unwrap().len())
        .sum();
    assert_eq!(tokens.len() as usize, want);
    let mut batch = Default::default();
    tokens.read_batch(0, 1, want - 1, 1002, &mut batch).unwrap();
    let ignored = batch
        .targets
        .iter()
        .filter(|&&t| t == IGNORE_TARGET)
        .count();
    assert!(ignored > 0 && ignored < want - 1, "{ignored} of {want}");
    // Three steps ran, the losses finite.
    assert!(
        stdout.contains("steps") && stdout.contains(" 3\n"),
        "{stdout}"
    );
    let losses: Vec<f64> = stdout
        .lines()
        .find_map(|l| l.strip_prefix("loss first -> last"))
        .expect("the losses line")
        .split("->")
        .map(|l| l.trim().parse().unwrap())
        .collect();
    assert!(
        losses.len() == 2 && losses.iter().all(|l| l.is_finite()),
        "{stdout}"
    );
}

/// Packed, every turn would be a document: refused before any work, naming why.
#[test]
fn chat_data_is_refused_packed() {
    let dir = tempfile::tempdir().unwrap();
    let model = chat_llama(dir.path());
    let chats = dir.path().join("chats.jsonl");
    std::fs::copy(data("chat/chats.jsonl"), &chats).unwrap();
    let out = strata(&[
        "train",
        "--model",
        model.to_str().unwrap(),
        "--data",
        chats.to_str().unwrap(),
        "--pack",
        "--steps",
        "1",
    ]);
    assert!(!out.status.success());
    let line = error_line(&out);
    assert!(
        line.contains("--pack cannot pack conversations") && line.contains("without --pack"),
        "{line}"
    );
    // Nothing was tokenized.
    assert!(
        std::fs::read_dir(dir.path()).unwrap().all(|e| !e
            .unwrap()
            .path()
            .to_string_lossy()
            .ends_with(".tokens.bin")),
        "a cache was written"
    );
}
