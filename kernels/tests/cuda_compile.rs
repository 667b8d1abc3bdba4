//! The CUDA kernels compile with NVRTC to machine code for the architectures strata's
//! GPU machines have (sm_90: H100, H200) and the oldest CUDA 13 supports (sm_75), and
//! the cubin holds every entry point the runner loads: those the kernels' registry
//! declares (each typed kernel, the Llama family's included, in f32, bf16 and f16; AdamW,
//! the gradient statistics, the f32 accumulation and the reduce-scatter's fold once),
//! which are exactly the `extern "C"` kernels of the sources. Needs NVRTC, not a GPU: it
//! runs where the build found `libnvrtc.so.13` (`kernels/build.rs`) and is ignored
//! elsewhere; forced without NVRTC, it fails saying so. CI installs NVRTC from PyPI for
//! it (see `.ci/run`).

use std::collections::BTreeSet;

use strata_kernels::cuda::{probe, program};

/// The entry points the sources define: every `extern "C" __global__` kernel, a typed
/// one (`<name>_##S`, as the macros write it) once per working type.
fn defined_entry_points() -> BTreeSet<String> {
    let source = program::program_source().replace("\\\n", " ");
    let mut out = BTreeSet::new();
    for piece in source.split("extern \"C\" __global__ void ").skip(1) {
        let (name, _) = piece.split_once('(').expect("a parameter list");
        match name.trim().strip_suffix("_##S") {
            Some(stem) => out.extend(["f32", "bf16", "f16"].map(|s| format!("{stem}_{s}"))),
            None => {
                out.insert(name.trim().to_string());
            }
        }
    }
    out
}

#[test]
#[cfg_attr(
    not(strata_nvrtc),
    ignore = "NVRTC (libnvrtc.so.13) not found when built"
)]
fn every_kernel_compiles_with_nvrtc() {
    assert!(
        probe().nvrtc,
        "NVRTC (libnvrtc.so.13) was found when this test was built but cannot be loaded now; \
         install it with `pip install nvidia-cuda-nvrtc` and add its lib folder to \
         LD_LIBRARY_PATH"
    );
    let names = program::entry_points();
    let declared: BTreeSet<String> = names.iter().cloned().collect();
    assert_eq!(declared.len(), names.len(), "an entry point declared twice");
    // The registry's entry points are the sources' kernels: none missing, none left over.
    assert_eq!(declared, defined_entry_points(), "entry points");
    for name in [
        "fold_ranks",
        "rmsnorm_forward_bf16",
        "rope_backward_f32",
        "swiglu_backward_bf16",
    ] {
        assert!(declared.contains(name), "{name} is not an entry point");
    }
    for (major, minor) in [program::OLDEST_ARCH, (9, 0)] {
        let cubin =
            program::compile(major, minor).unwrap_or_else(|e| panic!("sm_{major}{minor}: {e}"));
        assert!(
            cubin.starts_with(b"\x7fELF"),
            "sm_{major}{minor}: not an ELF image"
        );
        for name in &names {
            let symbol = [name.as_bytes(), b"\0"].concat();
            assert!(
                cubin.windows(symbol.len()).any(|w| w == symbol),
                "sm_{major}{minor}: no kernel {name}"
            );
        }
        println!(
            "sm_{major}{minor}: {} bytes of cubin, all {} entry points present",
            cubin.len(),
            names.len()
        );
        // Cached: a second call returns the same compilation.
        assert!(std::sync::Arc::ptr_eq(
            &cubin,
            &program::compile(major, minor).unwrap()
        ));
    }
}
