//! Running the `strata` binary from a test: its output as text, a run that must succeed,
//! and the one error line of a run that must fail. Included by the CLI tests with
//! `#[path = "support/cli.rs"] mod cli;`; each uses some of these.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// `tests/data/NAME`, the repository's test data.
pub fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

/// The `strata` binary run with `args`, to its end.
pub fn strata(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .output()
        .expect("the strata binary runs")
}

/// Output bytes as text.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The stdout of `strata args`, which must succeed (else the test fails showing both
/// streams).
pub fn ok(args: &[&str]) -> String {
    let out = strata(args);
    assert!(
        out.status.success(),
        "strata {}\nstdout:\n{}\nstderr:\n{}",
        args.join(" "),
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// The one `strata: error:` line of a run that failed.
pub fn error_line(out: &Output) -> String {
    assert!(!out.status.success(), "{}", text(&out.stdout));
    let stderr = text(&out.stderr);
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("strata: error:"))
        .collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    lines[0].to_string()
}
