//! Token files and batching: llm.c's format, raw bytes, and clear errors.

mod model_support;

use std::path::Path;

use model_support::golden_dir;
use strata_engine::model::ModelError;
use strata_engine::model::data::{Batch, LLMC_MAGIC, TokenData, TokenFormat};

fn llmc_file(
    dir: &Path,
    name: &str,
    magic: i32,
    version: i32,
    tokens: &[u16],
    declared: i32,
) -> std::path::PathBuf {
    let mut bytes = Vec::new();
    let mut header = [0i32; 256];
    (header[0], header[1], header[2]) = (magic, version, declared);
    for v in header {
        bytes.extend(v.to_le_bytes());
    }
    for t in tokens {
        bytes.extend(t.to_le_bytes());
    }
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn golden_tokens_batch_as_the_reference_data_says() {
    let data = TokenData::open(&golden_dir().join("tokens.bin")).unwrap();
    assert_eq!((data.len(), data.format()), (97, TokenFormat::LlmcU16));
    assert_eq!(data.batch_count(2, 16), 3);
    let mut batch = Batch::default();
    data.read_batch(2, 2, 16, 64, &mut batch).unwrap();
    // Step k reads tokens[k*B*T .. (k+1)*B*T + 1]; targets are inputs shifted by one.
    let window: Vec<u32> = (64..97).map(|i| data.token(i)).collect();
    assert_eq!(batch.inputs, window[..32]);
    assert_eq!(batch.targets, window[1..]);
    let err = data.read_batch(3, 2, 16, 64, &mut batch).unwrap_err();
    assert!(matches!(err, ModelError::NotEnoughTokens { .. }), "{err}");
    assert!(err.to_string().contains("needs tokens 96..129"), "{err}");
}

#[test]
fn a_token_outside_the_vocabulary_is_named_by_position() {
    let dir = tempfile::tempdir().unwrap();
    let mut tokens: Vec<u16> = (0..40).map(|i| i % 50).collect();
    tokens[23] = 50;
    let path = llmc_file(dir.path(), "t.bin", LLMC_MAGIC, 1, &tokens, 40);
    let data = TokenData::open(&path).unwrap();
    let mut batch = Batch::default();
    data.read_batch(0, 2, 8, 50, &mut batch).unwrap(); // tokens 0..17
    let err = data.read_batch(1, 2, 8, 50, &mut batch).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("token 50 at position 23"), "{message}");
    assert!(message.contains("t.bin"), "{message}");
}

#[test]
fn bad_token_files_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let bad_magic = llmc_file(dir.path(), "magic.bin", 1234, 1, &[1, 2, 3], 3);
    let err = TokenData::open(&bad_magic).unwrap_err();
    assert!(
        matches!(err, ModelError::BadMagic { found: 1234, .. }),
        "{err}"
    );
    let short_body = llmc_file(dir.path(), "short.bin", LLMC_MAGIC, 1, &[1, 2, 3], 10);
    let message = TokenData::open(&short_body).unwrap_err().to_string();
    assert!(
        message.contains("file too short") && message.contains("10 tokens"),
        "{message}"
    );
    let short_header = dir.path().join("header.bin");
    std::fs::write(&short_header, LLMC_MAGIC.to_le_bytes()).unwrap();
    let message = TokenData::open(&short_header).unwrap_err().to_string();
    assert!(message.contains("file too short"), "{message}");
    let message = TokenData::open(&dir.path().join("absent.bin"))
        .unwrap_err()
        .to_string();
    assert!(message.contains("absent.bin"), "{message}");
}

#[test]
fn raw_text_is_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("corpus.txt");
    std::fs::write(&path, "hello, world\n").unwrap();
    let data = TokenData::open(&path).unwrap();
    assert_eq!(
        (data.format(), data.len(), data.implied_vocab()),
        (TokenFormat::Bytes, 13, Some(256))
    );
    let mut batch = Batch::default();
    data.read_batch(1, 2, 3, 256, &mut batch).unwrap();
    let ids = |s: &[u8]| s.iter().map(|&b| b as u32).collect::<Vec<_>>();
    assert_eq!(
        (batch.inputs, batch.targets),
        (ids(b" world"), ids(b"world\n"))
    );
}

#[test]
fn batch_sizes_past_what_a_file_could_hold_are_errors_not_overflows() {
    let data = TokenData::open(&golden_dir().join("tokens.bin")).unwrap();
    let huge = usize::MAX / 4;
    assert_eq!(data.batch_count(huge, 8), 0);
    assert_eq!(data.batch_count(usize::MAX, usize::MAX), 0);
    let mut batch = Batch::default();
    for (step, b, t) in [(0, huge, 8), (usize::MAX, 2, 16), (huge, huge, huge)] {
        let error = data.read_batch(step, b, t, 64, &mut batch).unwrap_err();
        assert!(
            matches!(error, ModelError::NotEnoughTokens { .. }),
            "{error}"
        );
    }
}
