//! The fuzz targets' bodies: one function per parser of untrusted bytes, each writing
//! its input where the product reads it (a file under /dev/shm) and calling the public
//! function a user's file reaches. A parser must return an error for any input: a
//! panic, an abort or an allocation sized by a length in the input is a crash.
//!
//! Shared by the cargo-fuzz targets (`fuzz/fuzz_targets/`, nightly, coverage-guided) and
//! the stable replay test (`tests/fuzz_corpus.rs`), which runs every target over the
//! committed corpus and simple mutations of it, so CI exercises the same entry points.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use strata::engine::checkpoint::{self, Checkpoint, Shard, TrainerState};
use strata::engine::model::Model;
use strata::engine::model::data::{Batch, TokenData, mask_path};
use strata::engine::model::tokenize::TextTokenizer;
use strata::engine::model::weights::{self, PretrainedBlocks, WeightFiles};
use strata::train_config::TrainConfig;
use strata_comm::Solo;

/// A target's body: its input, as bytes.
pub type Target = fn(&[u8]);

/// A saved checkpoint folder, and the bytes of its files a target may overwrite.
type Template = (PathBuf, Vec<(String, Vec<u8>)>);

/// Every target, by name: the name of its cargo-fuzz target and corpus folder.
pub const TARGETS: [(&str, Target); 7] = [
    ("safetensors_header", safetensors_header),
    ("safetensors_index", safetensors_index),
    ("config_json", config_json),
    ("tokenizer_json", tokenizer_json),
    ("token_file", token_file),
    ("checkpoint_manifest", checkpoint_manifest),
    ("train_config_toml", train_config_toml),
];

/// The repository's root (the test data is under it).
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .find(|p| p.join("tests/data/gpt2-tiny").is_dir())
        .expect("the fuzz crate is inside the repository")
        .to_path_buf()
}

/// This process's scratch folder for `what`, created once: in /dev/shm when there is
/// one (a file write per input must not wear a disk), else the temporary folder. The
/// first call removes the scratch folders of processes that have ended (a fuzzer is
/// stopped by a signal, so it never removes its own).
fn scratch(what: &str) -> PathBuf {
    static BASE: OnceLock<PathBuf> = OnceLock::new();
    let base = BASE.get_or_init(|| {
        let base = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        for entry in fs::read_dir(&base).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name.strip_prefix("strata-fuzz-")
                && !Path::new("/proc").join(pid).exists()
            {
                let _ = fs::remove_dir_all(entry.path());
            }
        }
        base
    });
    let dir = base.join(format!("strata-fuzz-{}/{what}", std::process::id()));
    fs::create_dir_all(&dir).expect("scratch folder");
    dir
}

/// The tiny GPT-2 and Llama of tests/data, whose tensors the weight targets look up.
fn models() -> &'static [Model; 2] {
    static MODELS: OnceLock<[Model; 2]> = OnceLock::new();
    MODELS.get_or_init(|| {
        let load = |name: &str| {
            weights::load_config(&repo().join("tests/data").join(name).join("config.json"))
                .expect("tests/data config")
        };
        [load("gpt2-tiny"), load("llama-tiny")]
    })
}

/// Reads every tensor of `files` as f32, and looks up every tensor of each model.
fn read_weights(files: &WeightFiles, at: &Path) {
    for name in files.names() {
        let _ = files.read_f32(name);
    }
    for model in models() {
        if let Ok(blocks) = PretrainedBlocks::open(at, model) {
            for b in 0..model.blocks().len() {
                let _ = blocks.read_block(b);
            }
        }
        let _ = weights::load_safetensors(model, at);
    }
}

/// A `model.safetensors` as `strata train --model FILE` opens it: header, tensor
/// entries, each tensor widened to f32, and the tensors of a GPT-2 and a Llama found in
/// it.
pub fn safetensors_header(data: &[u8]) {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let path = DIR
        .get_or_init(|| scratch("header"))
        .join("model.safetensors");
    fs::write(&path, data).expect("write input");
    if let Ok(files) = WeightFiles::open(&path) {
        read_weights(&files, &path);
    }
}

/// A `model.safetensors.index.json` beside the shards of tests/data's sharded tiny Llama
/// and Qwen2: every shard it names opened, every tensor read, and the folder described
/// as `strata model` describes it.
pub fn safetensors_index(data: &[u8]) {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = scratch("index");
        for model in ["llama-tiny", "qwen2-tiny"] {
            let from = repo().join("tests/data").join(model).join("sharded-bf16");
            for entry in fs::read_dir(&from).expect("tests/data shards") {
                let entry = entry.expect("shard");
                let name = entry.file_name();
                if name.to_string_lossy().ends_with(".safetensors") {
                    fs::copy(entry.path(), dir.join(&name)).expect("copy shard");
                }
            }
        }
        fs::copy(
            repo().join("tests/data/llama-tiny/sharded-bf16/config.json"),
            dir.join("config.json"),
        )
        .expect("copy config");
        dir
    });
    let index = dir.join("model.safetensors.index.json");
    fs::write(&index, data).expect("write input");
    if let Ok(files) = WeightFiles::open(&index) {
        read_weights(&files, &index);
    }
    let _ = weights::describe_pretrained(dir);
}

/// A `config.json`: the model it describes, as every command reads it first.
pub fn config_json(data: &[u8]) {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let path = DIR.get_or_init(|| scratch("config")).join("config.json");
    fs::write(&path, data).expect("write input");
    if let Ok(model) = weights::load_config(&path) {
        let _ = (model.describe(), model.param_count(), model.layers());
        let _ = (model.vocab(), model.context(), model.width());
    }
}

/// A `tokenizer.json`, opened as `strata tokenize` opens it, then used on a short text
/// (encoded whole and in pieces, decoded back).
pub fn tokenizer_json(data: &[u8]) {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let path = DIR
        .get_or_init(|| {
            // libfuzzer-sys's panic hook aborts at the panic, before the product's
            // catch_unwind around the tokenizers library could refuse the file; with the
            // default hook, a panic the product does not catch still aborts (in
            // libfuzzer-sys's own catch_unwind), so it is still a crash.
            drop(std::panic::take_hook());
            scratch("tokenizer")
        })
        .join("tokenizer.json");
    fs::write(&path, data).expect("write input");
    let Ok(tokenizer) = TextTokenizer::open(&path) else {
        return;
    };
    let _ = (tokenizer.vocab_size(), tokenizer.eos());
    let text = "Hello, world!\nThe quick brown fox\njumps over the lazy dog. <|endoftext|> 123";
    if let Ok(ids) = tokenizer.encode(text, true) {
        let _ = tokenizer.decode(&ids);
    }
    let _ = tokenizer.encode_document(text, 16);
}

/// A token file and its mask, read as `strata train --data` reads them: the first byte
/// says whether the file is named `*.bin` (bit 0) and has a mask (bit 1), the next two
/// where the rest splits into tokens and mask; then batches of a few shapes, every token
/// checked against a vocabulary the fourth byte sets.
pub fn token_file(data: &[u8]) {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = DIR.get_or_init(|| scratch("tokens"));
    let [flags, a, b, vocab_byte, rest @ ..] = data else {
        return;
    };
    let path = dir.join(if flags & 1 != 0 { "t.bin" } else { "t.txt" });
    let _ = fs::remove_file(dir.join("t.bin.mask"));
    let _ = fs::remove_file(dir.join("t.txt.mask"));
    let split = usize::from(u16::from_le_bytes([*a, *b])).min(rest.len());
    let (tokens, mask) = rest.split_at(if flags & 2 != 0 { split } else { rest.len() });
    fs::write(&path, tokens).expect("write input");
    if flags & 2 != 0 {
        fs::write(mask_path(&path), mask).expect("write input");
    }
    let Ok(file) = TokenData::open(&path) else {
        return;
    };
    let _ = (
        file.len(),
        file.has_mask(),
        file.implied_vocab(),
        file.format(),
    );
    for i in 0..file.len().min(4096) {
        file.token(i);
    }
    let vocab = 1usize << (vocab_byte % 33);
    let mut batch = Batch::default();
    for (b, t) in [(1, 1), (1, 7), (2, 3), (4, 64), (usize::MAX, 2)] {
        let count = file.batch_count(b, t);
        for step in 0..count.min(8) {
            let _ = file.read_batch(step, b, t, vocab, &mut batch);
        }
        let _ = file.read_batch(count, b, t, vocab, &mut batch);
        let _ = file.read_batch(usize::MAX, b, t, vocab, &mut batch);
    }
}

/// A checkpoint folder's files as `strata train --resume` reads them: a real checkpoint
/// of the tiny GPT-2, whose `manifest.json` is the input. The first byte's bit 3 picks
/// the checkpoint a rank group of one wrote (sharded) over an ordinary one; bit 0 sets
/// the lengths and crc32c of the files the input's manifest lists to the files' own (so
/// that the parse goes on past the checksums); bits 1 and 2 replace `trainer_state.json`
/// and `config.json` by the second and third NUL-separated parts of the rest.
pub fn checkpoint_manifest(data: &[u8]) {
    static TEMPLATES: OnceLock<[Template; 2]> = OnceLock::new();
    let templates = TEMPLATES.get_or_init(checkpoint_templates);
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let (dir, originals) = &templates[usize::from(flags & 8 != 0)];
    let mut parts = rest.splitn(3, |&b| b == 0);
    let manifest = parts.next().unwrap_or_default();
    for (name, bytes) in originals {
        fs::write(dir.join(name), bytes).expect("restore checkpoint file");
    }
    for (bit, name) in [(2, checkpoint::STATE_FILE), (4, "config.json")] {
        let part = parts.next();
        if flags & bit != 0 {
            fs::write(dir.join(name), part.unwrap_or_default()).expect("write input");
        }
    }
    let manifest = if flags & 1 != 0 {
        fix_digests(dir, manifest)
    } else {
        manifest.to_vec()
    };
    fs::write(dir.join(checkpoint::MANIFEST_FILE), manifest).expect("write input");
    let _ = checkpoint::written_by_ranks(dir);
    let _ = checkpoint::load(dir);
    for (rank, ranks) in [(0, 1), (0, 2), (1, 2)] {
        let _ = checkpoint::load_shard(dir, rank, ranks);
    }
}

/// Checkpoints of tests/data's tiny GPT-2 at step 2, saved by the product: an ordinary
/// one and one sharded by a group of one rank; with each, the bytes of its small files
/// (the ones a target may overwrite).
fn checkpoint_templates() -> [Template; 2] {
    let (model, params) =
        weights::load_pretrained(&repo().join("tests/data/gpt2-tiny")).expect("tests/data");
    let zeros: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    let state = TrainerState::after(2, 2, 7);
    let shard = Shard {
        model: model.clone(),
        ranks: 1,
        rank: 0,
        shard_len: params.iter().map(Vec::len).collect(),
        params: params.clone(),
        m: zeros.clone(),
        v: zeros.clone(),
        state: state.clone(),
    };
    let ckpt = Checkpoint {
        model,
        params,
        m: zeros.clone(),
        v: zeros,
        state,
    };
    let whole = checkpoint::save(&scratch("checkpoint"), &ckpt, 1).expect("save a checkpoint");
    let sharded = checkpoint::save_sharded(&scratch("sharded"), &Solo::new(), &shard, 1)
        .expect("save a sharded checkpoint");
    [whole, sharded].map(|dir| {
        let originals = [checkpoint::STATE_FILE, "config.json"]
            .into_iter()
            .map(|name| (name.to_string(), fs::read(dir.join(name)).expect("read")))
            .collect();
        (dir, originals)
    })
}

/// `manifest` with the length and crc32c of each file it lists that exists in `dir` set
/// to the file's; the input itself when it is not a JSON object with a `files` object.
fn fix_digests(dir: &Path, manifest: &[u8]) -> Vec<u8> {
    let Ok(mut json) = serde_json::from_slice::<serde_json::Value>(manifest) else {
        return manifest.to_vec();
    };
    let Some(files) = json.get_mut("files").and_then(|f| f.as_object_mut()) else {
        return manifest.to_vec();
    };
    for (name, digest) in files.iter_mut() {
        if Path::new(name).components().count() != 1 {
            continue;
        }
        let Ok(bytes) = fs::read(dir.join(name)) else {
            continue;
        };
        *digest = serde_json::json!({
            "len_bytes": bytes.len(),
            "crc32c": strata::storage::crc::crc32c(&bytes),
        });
    }
    serde_json::to_vec(&json).expect("JSON")
}

/// A TOML settings file as `strata train --config FILE` reads it; a file that loads is
/// written back (`--print-config`) and must read back to the same settings.
pub fn train_config_toml(data: &[u8]) {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let path = DIR.get_or_init(|| scratch("toml")).join("train.toml");
    fs::write(&path, data).expect("write input");
    let _ = TrainConfig::resolve(Some(&path), |_| Ok(BTreeSet::new()));
    if let Ok(config) = TrainConfig::load(&path) {
        let printed = config.to_toml();
        fs::write(&path, &printed).expect("write");
        let again = TrainConfig::load(&path)
            .unwrap_or_else(|e| panic!("--print-config's TOML does not load: {e}\n{printed}"));
        assert_eq!(
            again, config,
            "--print-config's TOML reads back differently"
        );
    }
}
