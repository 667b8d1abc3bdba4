//! The tidy test (after TigerBeetle's `tidy.zig`): rules of this codebase that the compiler
//! does not check, over every Rust file of the workspace.
//!
//! - No function in non-test code is longer than [`MAX_FUNCTION_LINES`], but those in
//!   [`LONG_FUNCTIONS`], each at most as long as its entry says. The list only shrinks: an
//!   entry longer than its function, or whose function is now short enough, fails until
//!   it is lowered or removed.
//! - `unsafe` is written only in the files of [`UNSAFE_FILES`] (each next to the hardware
//!   or foreign API it wraps); a listed file that no longer writes it fails until removed.
//! - No string literal of non-test code outside [`POLICY_MODULE`] contains a built-in
//!   policy's name: the policy is an enum, its names written once.
//! - No two files of a crate use names from each other, directly or through others
//!   (no import cycle), but the groups of [`ALLOWED_CYCLES`].
//!
//! `cargo test --test tidy report -- --ignored --nocapture` prints the longest functions
//! and files and every cycle (`STRATA_TIDY_REEXPORTS=1`: counting re-exports as uses).

mod imports;
mod measure;
mod source;

use std::path::PathBuf;

/// The longest a function of non-test code may be, in lines from `fn` to its closing
/// brace.
const MAX_FUNCTION_LINES: usize = 150;

/// Functions allowed to be longer, with their length now (`file:Type::name`).
const LONG_FUNCTIONS: &[(&str, usize)] = &[];

/// The files that may write `unsafe`.
const UNSAFE_FILES: &[&str] = &[
    "comm/src/mpi.rs",
    "engine/src/device/cpu.rs",
    "engine/src/device/cuda.rs",
    "engine/src/exec/lent.rs",
    "engine/src/exec/workers.rs",
    "engine/src/memory/host.rs",
    "engine/src/memory/host_arena.rs",
    "engine/src/memory/pinned.rs",
    "engine/src/model/mapped.rs",
    "engine/tests/pinned_pool_locking.rs",
    "kernels/src/adamw/avx2.rs",
    "kernels/src/adamw/avx512.rs",
    "kernels/src/adamw/dispatch.rs",
    "kernels/src/adamw/portable.rs",
    "kernels/src/cuda/ops.rs",
    "kernels/src/cuda/probe.rs",
    "kernels/src/cuda/program.rs",
    "kernels/src/cuda/launch.rs",
    "kernels/src/cuda/launch/tests.rs",
    "kernels/src/kernel/attention/cpu.rs",
    "kernels/src/ops/cast.rs",
    "kernels/src/ops/gemm/mod.rs",
    "kernels/src/ops/gemm/pack.rs",
    "kernels/src/ops/gemm/tile.rs",
    "kernels/src/kernel/matmul/cpu.rs",
    "kernels/src/ops/simd.rs",
    "kernels/src/parallel.rs",
    "kernels/src/program/cpu.rs",
    "kernels/tests/cuda_ops.rs",
    "kernels/tests/llama_ops.rs",
    "python/src/io.rs",
    "python/src/optim.rs",
    "src/bench/adam.rs",
    "src/train/interrupt.rs",
    "storage/src/buffer.rs",
    "storage/src/file.rs",
    "storage/src/io/backend.rs",
    "storage/src/io/faulty.rs",
    "storage/src/io/threads.rs",
    "storage/src/io/uring.rs",
    "storage/src/store.rs",
    "storage/tests/store.rs",
    "tests/support/counting_alloc.rs",
    "tests/train_cli.rs",
];

/// The one module whose literals name the built-in policies.
const POLICY_MODULE: &str = "engine/src/plan/policy.rs";

/// The built-in policies' names.
const POLICY_NAMES: [&str; 4] = [
    "all-on-device",
    "cpu-offload",
    "param-offload",
    "nvme-offload",
];

/// Whether a `pub use` of a name counts as using it. It does not: a module that re-exports
/// its children's names (a `mod.rs` as a table of contents) is structure, not use; a
/// path through a re-export still counts as a use of the file that defines the name.
const REEXPORTS_ARE_USES: bool = false;

/// Groups of files allowed to use names from each other.
const ALLOWED_CYCLES: &[&[&str]] = &[
    // The AdamW kernels: the dispatch picks a SIMD body, and each body calls back into
    // the dispatch's shared tail and constants.
    &[
        "kernels/src/adamw/avx2.rs",
        "kernels/src/adamw/avx512.rs",
        "kernels/src/adamw/dispatch.rs",
        "kernels/src/adamw/mod.rs",
        "kernels/src/adamw/portable.rs",
    ],
];

fn workspace() -> source::Workspace {
    source::workspace()
}

fn rel(p: &std::path::Path) -> String {
    p.display().to_string().trim_start_matches("./").to_string()
}

#[test]
fn no_function_is_longer_than_the_limit_or_its_allowance() {
    let ws = workspace();
    let mut errors = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for file in ws.files.values() {
        for f in measure::functions(file) {
            let allowance = LONG_FUNCTIONS.iter().find(|(k, _)| *k == f.key);
            match allowance {
                Some(&(key, max)) => {
                    seen.insert(key);
                    if f.lines > max {
                        errors.push(format!("{key}: {} lines, its allowance is {max}", f.lines));
                    } else if f.lines <= MAX_FUNCTION_LINES {
                        errors.push(format!(
                            "{key}: {} lines, within the limit: remove it from LONG_FUNCTIONS",
                            f.lines
                        ));
                    } else if f.lines < max {
                        errors.push(format!(
                            "{key}: {} lines: lower its LONG_FUNCTIONS entry from {max}",
                            f.lines
                        ));
                    }
                }
                None if f.lines > MAX_FUNCTION_LINES => errors.push(format!(
                    "{}: {} lines, over {MAX_FUNCTION_LINES}: split it",
                    f.key, f.lines
                )),
                None => {}
            }
        }
    }
    for (key, _) in LONG_FUNCTIONS {
        if !seen.contains(key) {
            errors.push(format!(
                "{key}: no such function: remove it from LONG_FUNCTIONS"
            ));
        }
    }
    assert!(
        errors.is_empty(),
        "function lengths:\n  {}",
        errors.join("\n  ")
    );
}

#[test]
fn unsafe_is_written_only_in_the_files_allowed_it() {
    let ws = workspace();
    let mut errors = Vec::new();
    for file in ws.files.values() {
        let name = rel(&file.path);
        let listed = UNSAFE_FILES.contains(&name.as_str());
        match (measure::writes_unsafe(file), listed) {
            (true, false) => errors.push(format!(
                "{name} writes `unsafe`: keep it in the files that wrap the API it needs"
            )),
            (false, true) => errors.push(format!(
                "{name} no longer writes `unsafe`: remove it from UNSAFE_FILES"
            )),
            _ => {}
        }
    }
    for name in UNSAFE_FILES {
        if !ws.files.contains_key(&PathBuf::from(name)) {
            errors.push(format!("{name}: no such file: remove it from UNSAFE_FILES"));
        }
    }
    assert!(errors.is_empty(), "unsafe:\n  {}", errors.join("\n  "));
}

#[test]
fn policy_names_are_written_only_in_the_policy_module() {
    let ws = workspace();
    let mut errors = Vec::new();
    for file in ws.files.values() {
        let name = rel(&file.path);
        if name == POLICY_MODULE || file.test {
            continue;
        }
        for (line, lit) in measure::string_literals(file) {
            if let Some(p) = POLICY_NAMES.iter().find(|p| lit.contains(*p)) {
                errors.push(format!(
                    "{name}:{line}: {lit} names the policy {p}: use the policy enum"
                ));
            }
        }
    }
    assert!(
        errors.is_empty(),
        "policy names:\n  {}",
        errors.join("\n  ")
    );
}

#[test]
fn no_file_imports_from_a_file_that_imports_from_it() {
    let ws = workspace();
    let edges = imports::file_edges(&ws, REEXPORTS_ARE_USES);
    let allowed: Vec<Vec<PathBuf>> = ALLOWED_CYCLES
        .iter()
        .map(|c| c.iter().map(PathBuf::from).collect())
        .collect();
    let cycles = imports::cycles(&edges);
    let mutual = imports::mutual_pairs(&edges);
    let mut errors = Vec::new();
    for cycle in &cycles {
        if allowed.iter().any(|a| cycle.iter().all(|f| a.contains(f))) {
            continue;
        }
        let files: Vec<String> = cycle.iter().map(|p| rel(p)).collect();
        let pairs: Vec<String> = mutual
            .iter()
            .filter(|(a, b)| cycle.contains(a) && cycle.contains(b))
            .map(|(a, b)| format!("{} <-> {}", rel(a), rel(b)))
            .collect();
        errors.push(format!(
            "{} (directly: {})",
            files.join(", "),
            pairs.join("; ")
        ));
    }
    for a in &allowed {
        if !cycles.iter().any(|c| c.iter().all(|f| a.contains(f))) {
            errors.push(format!(
                "{a:?}: no longer a cycle: remove it from ALLOWED_CYCLES"
            ));
        }
    }
    assert!(
        errors.is_empty(),
        "import cycles:\n  {}",
        errors.join("\n  ")
    );
}

/// Prints the sizes the notes quote: a report, not a check, so ignored unless asked for.
#[test]
#[ignore = "a report, not a check: cargo test --test tidy report -- --ignored --nocapture"]
fn report() {
    let ws = workspace();
    let mut fns: Vec<measure::Function> = ws.files.values().flat_map(measure::functions).collect();
    fns.sort_by(|a, b| b.lines.cmp(&a.lines).then(a.key.cmp(&b.key)));
    println!("longest functions (non-test code):");
    for f in fns.iter().take(25) {
        println!("  {:5}  {}", f.lines, f.key);
    }
    let over = fns.iter().filter(|f| f.lines > MAX_FUNCTION_LINES).count();
    println!("  {over} over {MAX_FUNCTION_LINES} lines");
    let mut files: Vec<(usize, String)> = ws
        .files
        .values()
        .filter(|f| !f.test)
        .map(|f| (measure::line_count(f), rel(&f.path)))
        .collect();
    files.sort_by(|a, b| b.cmp(a));
    println!("largest files (non-test):");
    for (lines, name) in files.iter().take(15) {
        println!("  {lines:5}  {name}");
    }
    let reexports = std::env::var_os("STRATA_TIDY_REEXPORTS").is_some();
    let edges = imports::file_edges(&ws, reexports);
    println!("import cycles (re-exports counted: {reexports}):");
    for c in imports::cycles(&edges) {
        let files: Vec<String> = c.iter().map(|p| rel(p)).collect();
        println!("  {}", files.join(", "));
    }
    for (a, b) in imports::mutual_pairs(&edges) {
        println!("  pair: {} <-> {}", rel(&a), rel(&b));
    }
    let unsafe_files: Vec<String> = ws
        .files
        .values()
        .filter(|f| measure::writes_unsafe(f))
        .map(|f| rel(&f.path))
        .collect();
    println!("files writing unsafe: {unsafe_files:?}");
}
