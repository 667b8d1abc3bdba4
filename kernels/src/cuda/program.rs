//! The CUDA kernel sources, embedded in the binary, and their compilation by NVRTC: on
//! first use, once per process and GPU architecture, so that building strata needs no
//! CUDA toolkit.
//!
//! The families' `.cu` files (`crate::kernel`) are compiled as one program, `common.cuh`
//! first; `#line` directives keep NVRTC's messages pointing at the right file and line. The program is
//! compiled to machine code (a cubin) for the GPU's own architecture rather than to PTX:
//! a driver refuses PTX from a newer NVRTC than itself (CUDA's minor-version
//! compatibility covers machine code, not PTX JIT), and the NVRTC found at run time may
//! well be newer than the driver.

use std::collections::HashMap;
use std::ffi::{CString, c_char};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::{result, sys};

use super::CudaError;
use super::launch::{CudaSource, WORKING_TYPES};

/// What every kernel file includes, compiled first.
const COMMON: CudaSource = ("common.cuh", include_str!("common.cuh"));

/// The kernel sources, in compilation order: (file name, text): `common.cuh`, then each
/// family's `.cu` file in the order of the kernels' registry ([`crate::kernel::Kernel`]).
pub fn sources() -> Vec<(&'static str, &'static str)> {
    std::iter::once(COMMON)
        .chain(crate::kernel::cuda_sources())
        .collect()
}

/// Every entry point the registry's kernels launch, as (name, suffix): a typed kernel's
/// once per working type (`<name>_f32`, `_bf16`, `_f16`), the others once with no suffix.
pub(crate) fn entries() -> Vec<(&'static str, &'static str)> {
    let mut out = Vec::new();
    for entry in crate::kernel::cuda_entries() {
        if entry.typed {
            out.extend(WORKING_TYPES.map(|w| (entry.name, w.suffix)));
        } else {
            out.push((entry.name, ""));
        }
    }
    out
}

/// The compiled kernel's name of an entry point.
pub(crate) fn entry_name(name: &str, suffix: &str) -> String {
    if suffix.is_empty() {
        name.to_string()
    } else {
        format!("{name}_{suffix}")
    }
}

/// Every entry point the program must define: those the registry's kernels launch.
pub fn entry_points() -> Vec<String> {
    entries()
        .into_iter()
        .map(|(name, suffix)| entry_name(name, suffix))
        .collect()
}

/// The oldest GPU architecture CUDA 13 supports, and so the lowest `compile` accepts.
pub const OLDEST_ARCH: (i32, i32) = (7, 5);

/// The whole program: every source, each after a `#line` directive naming it.
pub fn program_source() -> String {
    let mut source = String::new();
    for (name, text) in sources() {
        source.push_str(&format!("#line 1 \"{name}\"\n"));
        source.push_str(text);
        source.push('\n');
    }
    source
}

/// The program as a cubin for compute capability `major.minor` (`sm_<major><minor>`),
/// compiled on the first call for that architecture and kept for the process (a failed
/// compilation is kept too: it would fail again). Needs NVRTC only, not a GPU.
pub fn compile(major: i32, minor: i32) -> Result<Arc<Vec<u8>>, CudaError> {
    type Cache = Mutex<HashMap<(i32, i32), Result<Arc<Vec<u8>>, String>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    cache
        .entry((major, minor))
        .or_insert_with(|| compile_uncached(major, minor, Output::Cubin).map(Arc::new))
        .clone()
        .map_err(CudaError::Compile)
}

/// What a compilation produces.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Output {
    /// Machine code for `sm_<major><minor>`.
    Cubin,
    /// PTX for `compute_<major><minor>`.
    Ptx,
}

/// The program as PTX text for compute capability `major.minor`, compiled afresh: for
/// inspection (its `.entry` lines are the kernels' parameter lists) and tests, which
/// check launches against them. Needs NVRTC only.
pub fn ptx(major: i32, minor: i32) -> Result<String, CudaError> {
    let bytes = compile_uncached(major, minor, Output::Ptx).map_err(CudaError::Compile)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

fn compile_uncached(major: i32, minor: i32, output: Output) -> Result<Vec<u8>, String> {
    if !super::probe().nvrtc {
        return Err(
            "NVRTC (libnvrtc.so.13) could not be loaded; install the CUDA 13 runtime \
                    compiler or add its folder to LD_LIBRARY_PATH"
                .to_string(),
        );
    }
    if (major, minor) < OLDEST_ARCH {
        return Err(format!(
            "compute capability {major}.{minor} is older than CUDA 13 supports"
        ));
    }
    let source = CString::new(program_source()).expect("the sources hold no NUL byte");
    let program = result::create_program(&source, Some(c"strata_kernels.cu"))
        .map_err(|e| format!("nvrtcCreateProgram: {e}"))?;
    let arch = match output {
        Output::Cubin => "sm",
        Output::Ptx => "compute",
    };
    let options = [
        format!("--gpu-architecture={arch}_{major}{minor}"),
        "--std=c++17".to_string(),
    ];
    // SAFETY: `program` was created just above and is destroyed once, at the end.
    let compiled = unsafe { result::compile_program(program, &options) };
    let out = match compiled {
        Ok(()) => match output {
            Output::Cubin => cubin(program),
            Output::Ptx => ptx_text(program),
        },
        Err(e) => {
            // SAFETY: as above; the log exists after a compilation attempt.
            let log = unsafe { result::get_program_log(program) }
                .map(|log| text(&log))
                .unwrap_or_default();
            Err(format!("{e} (options {options:?}):\n{log}"))
        }
    };
    // SAFETY: as above; nothing uses `program` after this.
    if let Err(e) = unsafe { result::destroy_program(program) } {
        log::warn!("nvrtcDestroyProgram: {e}");
    }
    out
}

/// The cubin of a successfully compiled program.
fn cubin(program: sys::nvrtcProgram) -> Result<Vec<u8>, String> {
    let mut size = 0usize;
    // SAFETY: `program` is a live, compiled program; size is a valid out-pointer.
    unsafe { sys::nvrtcGetCUBINSize(program, &mut size) }
        .result()
        .map_err(|e| format!("nvrtcGetCUBINSize: {e}"))?;
    let mut image = vec![0u8; size];
    // SAFETY: `image` holds the `size` bytes NVRTC said the cubin needs.
    unsafe { sys::nvrtcGetCUBIN(program, image.as_mut_ptr().cast::<c_char>()) }
        .result()
        .map_err(|e| format!("nvrtcGetCUBIN: {e}"))?;
    Ok(image)
}

/// The PTX of a successfully compiled program.
fn ptx_text(program: sys::nvrtcProgram) -> Result<Vec<u8>, String> {
    // SAFETY: `program` is a live, compiled program.
    let chars = unsafe { result::get_ptx(program) }.map_err(|e| format!("nvrtcGetPTX: {e}"))?;
    Ok(text(&chars).into_bytes())
}

/// A NUL-terminated C string from NVRTC, as text.
fn text(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
