//! The CUDA kernels compile with NVRTC to machine code for the architectures strata's
//! GPU machines have (sm_90: H100, H200) and the oldest CUDA 13 supports (sm_75), and
//! the cubin holds every entry point the runner loads (each typed kernel, the Llama
//! family's included, in f32, bf16 and f16; AdamW, the gradient statistics, the f32
//! accumulation and the reduce-scatter's fold once). Runs wherever
//! NVRTC can be loaded, no GPU needed, and says why it skips elsewhere. CI installs NVRTC
//! from PyPI for it (see `.ci/run`).

use strata_kernels::cuda::{probe, program};

#[test]
fn every_kernel_compiles_with_nvrtc() {
    if !probe().nvrtc {
        println!(
            "skipped: NVRTC (libnvrtc.so.13) is not loadable here; install it with \
             `pip install nvidia-cuda-nvrtc` and add its lib folder to LD_LIBRARY_PATH"
        );
        return;
    }
    for (major, minor) in [program::OLDEST_ARCH, (9, 0)] {
        let cubin =
            program::compile(major, minor).unwrap_or_else(|e| panic!("sm_{major}{minor}: {e}"));
        assert!(
            cubin.starts_with(b"\x7fELF"),
            "sm_{major}{minor}: not an ELF image"
        );
        let names = program::entry_points();
        // 25 typed kernels in three types, and five untyped ones.
        assert_eq!(names.len(), 25 * 3 + 5, "entry points");
        for name in [
            "fold_ranks",
            "rmsnorm_forward_bf16",
            "rope_backward_f32",
            "swiglu_backward_bf16",
        ] {
            assert!(
                names.iter().any(|n| n == name),
                "{name} is not an entry point"
            );
        }
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
