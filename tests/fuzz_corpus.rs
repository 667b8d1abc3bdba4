//! The fuzz targets' corpus, replayed on stable: every file of `fuzz/corpus/<target>/`
//! (the seeds, and the inputs that once crashed a parser) through its target's function,
//! then simple mutations of each (truncations, bit flips, bytes set to extremes, a
//! length field made huge), a bounded number per input. A parser of untrusted bytes
//! returns an error for all of them; a panic fails the test naming the input.
//! `scripts/fuzz` runs the same functions coverage-guided under cargo-fuzz (nightly).
//! `STRATA_FUZZ_TARGET=NAME` replays one target only.

#[path = "../fuzz/src/targets.rs"]
mod targets;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

/// Mutations per corpus input: enough to reach the length and count fields of the
/// headers, few enough that the test takes seconds.
const MUTATIONS: usize = 48;

fn corpus(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("corpus entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

/// A small deterministic generator (xorshift64*), so that a failure replays.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Mutation `k` of `input`: the kinds a header parser trips on, cycled.
fn mutate(input: &[u8], k: usize, rng: &mut Rng) -> Vec<u8> {
    let mut out = input.to_vec();
    if out.is_empty() {
        return vec![rng.next() as u8; k % 8];
    }
    let at = rng.below(out.len());
    match k % 6 {
        // Truncated anywhere (a short write).
        0 => out.truncate(at),
        // One bit flipped.
        1 => out[at] ^= 1 << (rng.next() % 8),
        // A byte at an extreme.
        2 => out[at] = [0, 0xff, b'"', b'9', b'-', b'{'][rng.below(6)],
        // Eight bytes made a huge little-endian length.
        3 => {
            let end = (at + 8).min(out.len());
            let huge = (u64::MAX >> rng.below(40)).to_le_bytes();
            out[at..end].copy_from_slice(&huge[..end - at]);
        }
        // A digit run made huge (a JSON or TOML number).
        4 => {
            let digits = out.iter().position(|b| b.is_ascii_digit()).unwrap_or(at);
            out.splice(digits..digits, b"99999999999999999999".iter().copied());
        }
        // A span duplicated (a repeated key or entry).
        _ => {
            let len = rng.below(64).min(out.len() - at);
            let span = out[at..at + len].to_vec();
            out.splice(at..at, span);
        }
    }
    out
}

/// Runs `target` over its corpus and the mutations; the inputs that panicked.
fn replay(name: &str, target: targets::Target) -> Vec<String> {
    let mut failures = Vec::new();
    let files = corpus(name);
    assert!(!files.is_empty(), "fuzz/corpus/{name} holds no input");
    for file in files {
        let input = std::fs::read(&file).expect("corpus file");
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ input.len() as u64);
        for k in 0..=MUTATIONS {
            let bytes = if k == 0 {
                input.clone()
            } else {
                mutate(&input, k, &mut rng)
            };
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| target(&bytes))) {
                let message = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                failures.push(format!(
                    "{} (mutation {k} of {}): {message}",
                    name,
                    file.display()
                ));
            }
        }
    }
    failures
}

#[test]
fn every_target_survives_its_corpus_and_mutations() {
    // STRATA_FUZZ_TARGET=name replays one target's corpus (a crash that aborts the
    // process, as an allocation failure does, hides the others' results).
    let only = std::env::var("STRATA_FUZZ_TARGET").ok();
    let mut failures = Vec::new();
    for (name, target) in targets::TARGETS {
        if only.as_deref().is_none_or(|o| o == name) {
            failures.extend(replay(name, target));
        }
    }
    assert!(
        failures.is_empty(),
        "{} inputs panicked a parser:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn every_target_has_a_corpus_and_a_cargo_fuzz_target() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("fuzz/Cargo.toml");
    for (name, _) in targets::TARGETS {
        assert!(
            root.join("fuzz_targets")
                .join(format!("{name}.rs"))
                .is_file(),
            "fuzz/fuzz_targets/{name}.rs is missing"
        );
        assert!(
            manifest.contains(&format!("name = \"{name}\"")),
            "fuzz/Cargo.toml has no [[bin]] {name}"
        );
        assert!(!corpus(name).is_empty(), "fuzz/corpus/{name} is empty");
    }
}
