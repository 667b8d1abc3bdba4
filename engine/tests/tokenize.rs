//! Tokenizers and text data: the golden byte-level BPE tokenizer gives exactly the ids
//! `tokenizers` gave (whole and in pieces), decodes them back to the text, and text and
//! JSON lines become llm.c token files whose prompt tokens a mask keeps out of the loss.

use std::path::{Path, PathBuf};

use strata_engine::model::IGNORE_TARGET;
use strata_engine::model::data::{Batch, TokenData, TokenFormat};
use strata_engine::model::tokenize::{
    TextTokenizer, cached_tokens, encode_files, mask_path, split_pieces,
};

/// `tests/data/tokenizer-bpe` (see its README).
fn golden() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/tokenizer-bpe")
}

fn golden_ids() -> Vec<u32> {
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(golden().join("ids.json")).unwrap()).unwrap();
    json["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

fn eval_text() -> String {
    std::fs::read_to_string(golden().join("eval.txt")).unwrap()
}

#[test]
fn golden_ids_and_round_trip() {
    let tokenizer = TextTokenizer::open(&golden()).unwrap();
    assert_eq!(tokenizer.vocab_size(), 1000);
    let text = eval_text();
    let ids = tokenizer.encode(&text, true).unwrap();
    assert_eq!(ids, golden_ids());
    assert_eq!(tokenizer.decode(&ids).unwrap(), text);
    // In pieces (cut at lone line feeds), on the crate's threads: the same ids.
    for piece_bytes in [1, 97, 1000, 4096] {
        assert!(split_pieces(&text, piece_bytes).len() > 1);
        assert_eq!(
            tokenizer.encode_document(&text, piece_bytes).unwrap(),
            golden_ids(),
            "pieces of {piece_bytes} bytes"
        );
    }
    // Blank lines right before text, runs of line feeds, spaces before line feeds: where
    // a cut in the wrong place would change the pre-tokens.
    let tricky = text
        .replace("\n\n ", "\n\n")
        .replace(".\n", ".\n\n\n")
        .replace(",\n", ", \n");
    let whole = tokenizer.encode(&tricky, true).unwrap();
    for piece_bytes in [1, 64, 1000] {
        assert_eq!(
            tokenizer.encode_document(&tricky, piece_bytes).unwrap(),
            whole,
            "pieces of {piece_bytes} bytes"
        );
    }
    // The golden vocabulary has no merge of two line feeds, so a piece ending in "\n\n"
    // (one pre-token) and the whole text ("\n", "\n") give the same ids there. With that
    // merge added they would not: the pieces must still give the whole text's ids.
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(golden().join("tokenizer.json")).unwrap()).unwrap();
    json["model"]["vocab"]["ĊĊ"] = 1000.into();
    json["model"]["merges"]
        .as_array_mut()
        .unwrap()
        .insert(0, serde_json::json!(["Ċ", "Ċ"]));
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
    let merging = TextTokenizer::open(dir.path()).unwrap();
    assert_eq!(merging.encode("a\n\n", true).unwrap().len(), 2);
    let whole = merging.encode(&tricky, true).unwrap();
    assert_ne!(whole, tokenizer.encode(&tricky, true).unwrap());
    for piece_bytes in [1, 64, 1000] {
        assert_eq!(
            merging.encode_document(&tricky, piece_bytes).unwrap(),
            whole,
            "pieces of {piece_bytes} bytes, with a merge of two line feeds"
        );
    }
    assert_eq!(
        tokenizer.eos(),
        Some(tokenizer.encode("<|endoftext|>", true).unwrap()[0])
    );
}

#[test]
fn text_file_becomes_the_golden_token_file_plus_eos() {
    let tokenizer = TextTokenizer::open(&golden().join("tokenizer.json")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("eval.bin");
    let mut calls = 0;
    let summary = encode_files(
        &tokenizer,
        &[golden().join("eval.txt")],
        &out,
        &mut |_, _| calls += 1,
    )
    .unwrap();
    assert!(calls >= 1);
    assert_eq!(
        (summary.documents, summary.masked, summary.wide),
        (1, 0, false)
    );
    let data = TokenData::open(&out).unwrap();
    assert_eq!(data.format(), TokenFormat::LlmcU16);
    let mut want = golden_ids();
    want.push(tokenizer.eos().unwrap());
    let got: Vec<u32> = (0..data.len()).map(|i| data.token(i)).collect();
    assert_eq!(got, want);
    // The golden token file is the same ids, without the document's EOS.
    let golden_bin = std::fs::read(golden().join("eval.bin")).unwrap();
    let written = std::fs::read(&out).unwrap();
    assert_eq!(&written[12..golden_bin.len()], &golden_bin[12..]);
    assert!(!mask_path(&out).exists());
    assert!(!dir.path().join("eval.bin.partial").exists());
}

#[test]
fn prompt_completion_lines_mask_the_prompt_out_of_the_targets() {
    let tokenizer = TextTokenizer::open(&golden()).unwrap();
    let eos = tokenizer.eos().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("data.jsonl");
    std::fs::write(
        &input,
        concat!(
            r#"{"prompt": "The licence says", "completion": " that you may copy it."}"#,
            "\n\n",
            r#"{"text": "Plain text counts whole."}"#,
            "\n",
        ),
    )
    .unwrap();
    let out = dir.path().join("data.bin");
    let summary = encode_files(
        &tokenizer,
        std::slice::from_ref(&input),
        &out,
        &mut |_, _| {},
    )
    .unwrap();
    let prompt = tokenizer.encode("The licence says", true).unwrap();
    let completion = tokenizer.encode(" that you may copy it.", false).unwrap();
    let text = tokenizer.encode("Plain text counts whole.", true).unwrap();
    let mut want = prompt.clone();
    want.extend(&completion);
    want.push(eos);
    want.extend(&text);
    want.push(eos);
    assert_eq!(summary.documents, 2);
    assert_eq!(summary.masked, prompt.len() as u64);
    let data = TokenData::open(&out).unwrap();
    assert!(data.has_mask());
    let got: Vec<u32> = (0..data.len()).map(|i| data.token(i)).collect();
    assert_eq!(got, want);
    // One batch over everything: a target counts unless it is a prompt token.
    let n = want.len() - 1;
    let mut batch = Batch::default();
    data.read_batch(0, 1, n, 1000, &mut batch).unwrap();
    for (i, &target) in batch.targets.iter().enumerate() {
        let position = i + 1;
        if position < prompt.len() {
            assert_eq!(target, IGNORE_TARGET, "target {i}");
        } else {
            assert_eq!(target, want[position], "target {i}");
        }
    }
    // A malformed line is named with its number.
    std::fs::write(
        &input,
        "{\"text\": \"ok\"}\n{\"prompt\": \"no completion\"}\n",
    )
    .unwrap();
    let e = encode_files(&tokenizer, &[input], &out, &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("data.jsonl:2:") && e.contains("\"completion\""),
        "{e}"
    );
}

#[test]
fn the_cache_is_made_once_and_follows_the_data() {
    let tokenizer = TextTokenizer::open(&golden()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("corpus.txt");
    std::fs::write(&data, eval_text()).unwrap();
    let (first, fresh) = cached_tokens(&tokenizer, &data, dir.path(), &mut |_, _| {}).unwrap();
    assert!(fresh);
    assert_eq!(first.parent(), Some(dir.path()));
    let (again, fresh) = cached_tokens(&tokenizer, &data, dir.path(), &mut |_, _| {}).unwrap();
    assert_eq!((again.clone(), fresh), (first.clone(), false));
    std::fs::write(&data, "Other text.").unwrap();
    let (other, fresh) = cached_tokens(&tokenizer, &data, dir.path(), &mut |_, _| {}).unwrap();
    assert!(fresh);
    assert_ne!(other, first);
    let want = tokenizer.encode("Other text.", true).unwrap().len() as u64 + 1;
    assert_eq!(TokenData::open(&other).unwrap().len(), want);
}

/// A vocabulary past 65536 ids writes uint32 ids (llm.c version 2), read back as they
/// were.
#[test]
fn a_large_vocabulary_writes_uint32_ids() {
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(golden().join("tokenizer.json")).unwrap()).unwrap();
    json["model"]["vocab"]["<|big|>"] = 70000.into();
    json["added_tokens"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({
            "id": 70000, "content": "<|big|>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }));
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
    let tokenizer = TextTokenizer::open(dir.path()).unwrap();
    assert_eq!(tokenizer.vocab_size(), 70001);
    let input = dir.path().join("a.txt");
    std::fs::write(&input, "The licence<|big|> ends.").unwrap();
    let out = dir.path().join("a.bin");
    let summary = encode_files(&tokenizer, &[input], &out, &mut |_, _| {}).unwrap();
    assert!(summary.wide);
    let data = TokenData::open(&out).unwrap();
    assert_eq!(data.format(), TokenFormat::LlmcU32);
    let got: Vec<u32> = (0..data.len()).map(|i| data.token(i)).collect();
    let mut want = tokenizer.encode("The licence<|big|> ends.", true).unwrap();
    want.push(tokenizer.eos().unwrap());
    assert!(want.contains(&70000));
    assert_eq!(got, want);
}

/// A tokenizer.json as Llama 2 and Mistral ship it (SentencePiece BPE: a "▁" prepended
/// and spaces replaced by the normalizer, no pre-tokenizer, byte fallback, BOS added by
/// the post-processor), made small here: it reads, adds BOS, finds `</s>`, is encoded
/// whole (never in pieces), and decodes back to the text.
#[test]
fn a_llama_2_style_tokenizer_reads_and_round_trips() {
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert(t.to_string(), i.into());
    }
    for b in 0..256 {
        vocab.insert(format!("<0x{b:02X}>"), (3 + b).into());
    }
    let pieces = ["▁", "t", "h", "e", "▁t", "he", "▁the", "c", "a", "s"];
    for (i, p) in pieces.iter().enumerate() {
        vocab.insert(p.to_string(), (259 + i).into());
    }
    let special = |id: u32, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                           "rstrip": false, "normalized": false, "special": true})
    };
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
        ]},
        "pre_tokenizer": null,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        },
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}
        ]},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": "<unk>",
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab,
            "merges": [["▁", "t"], ["h", "e"], ["▁t", "he"]]
        }
    });
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
    let tokenizer = TextTokenizer::open(dir.path()).unwrap();
    assert_eq!(tokenizer.eos(), Some(2));
    let text = "the cat sat\nthe hat: ü!\nthe end";
    let ids = tokenizer.encode(text, true).unwrap();
    assert_eq!(ids[0], 1, "BOS first");
    assert_eq!(ids[1], 265, "▁the, merged");
    assert!(ids.contains(&(3 + 0xC3)), "ü by byte fallback: {ids:?}");
    assert_eq!(tokenizer.decode(&ids[1..]).unwrap(), text);
    // Not byte-level: encoded whole, whatever the piece size.
    assert_eq!(tokenizer.encode_document(text, 1).unwrap(), ids);
}
