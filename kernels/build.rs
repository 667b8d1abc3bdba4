//! Says at build time whether NVRTC (CUDA's run-time compiler, `libnvrtc.so.13`) can be
//! found, as the `strata_nvrtc` cfg, so that the tests that compile the CUDA kernels (and
//! need NVRTC, not a GPU) run where it is and are reported as ignored where it is not,
//! rather than passing by skipping.
//!
//! It looks where the dynamic loader would: the folders of `LD_LIBRARY_PATH`, the
//! loader's cache (`ldconfig -p`), and the usual library folders. Nothing else of the
//! build depends on it; at run time cudarc loads the library itself.

use std::path::Path;
use std::process::Command;

/// The library cudarc loads (its `cuda-13000` feature; `NVRTC_LIBRARY` in `src/cuda/probe.rs`).
const NVRTC_LIBRARY: &str = "libnvrtc.so.13";

/// Folders the loader searches besides `LD_LIBRARY_PATH` and its cache.
const LIBRARY_FOLDERS: [&str; 8] = [
    "/lib",
    "/lib64",
    "/usr/lib",
    "/usr/lib64",
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/local/cuda/lib64",
];

fn main() {
    println!("cargo::rustc-check-cfg=cfg(strata_nvrtc)");
    println!("cargo::rerun-if-env-changed=LD_LIBRARY_PATH");
    println!("cargo::rerun-if-changed=build.rs");
    if nvrtc_found() {
        println!("cargo::rustc-cfg=strata_nvrtc");
    }
}

fn nvrtc_found() -> bool {
    let from_env = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let in_folder =
        |folder: &str| !folder.is_empty() && Path::new(folder).join(NVRTC_LIBRARY).exists();
    from_env.split(':').any(in_folder)
        || LIBRARY_FOLDERS.into_iter().any(in_folder)
        || in_loader_cache()
}

/// Whether the loader's cache lists the library (`ldconfig -p`, where ldconfig exists).
fn in_loader_cache() -> bool {
    ["ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"]
        .into_iter()
        .find_map(|ldconfig| Command::new(ldconfig).arg("-p").output().ok())
        .is_some_and(|out| String::from_utf8_lossy(&out.stdout).contains(NVRTC_LIBRARY))
}
