//! Probing the CUDA libraries before any other cudarc call, and describing the GPUs the
//! driver sees.

use std::sync::OnceLock;

/// Which CUDA libraries could be loaded, and how many GPUs the driver sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaLibraries {
    /// The driver library (libcuda) loaded.
    pub driver: bool,
    /// The run-time compiler (libnvrtc) loaded.
    pub nvrtc: bool,
    /// cuBLAS (libcublas) loaded.
    pub cublas: bool,
    /// GPUs the driver reports (0 when the driver is absent or fails to start).
    pub device_count: usize,
    /// Why the driver could not be used, if it loaded but failed to start.
    pub driver_error: Option<String>,
}

/// The file name of the NVRTC library cudarc looks for (set by its `cuda-13000` feature).
pub const NVRTC_LIBRARY: &str = "libnvrtc.so.13";

/// The file name of the cuBLAS library cudarc looks for (set by its `cuda-13000` feature).
pub const CUBLAS_LIBRARY: &str = "libcublas.so.13";

/// Why CUDA cannot be used on this machine, worded for the user.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CUDA is not usable here: {reason}")]
pub struct CudaUnavailable {
    /// What is missing and what to do about it.
    pub reason: String,
}

impl CudaLibraries {
    /// `Ok` when the driver, NVRTC and cuBLAS are all present and at least one GPU is
    /// visible; otherwise says what is missing.
    pub fn require_all(&self) -> Result<(), CudaUnavailable> {
        let mut missing = Vec::new();
        if !self.driver {
            missing.push("the CUDA driver library (libcuda.so)".to_string());
        }
        if !self.nvrtc {
            missing.push(format!("NVRTC ({NVRTC_LIBRARY})"));
        }
        if !self.cublas {
            missing.push(format!("cuBLAS ({CUBLAS_LIBRARY})"));
        }
        if !missing.is_empty() {
            return Err(CudaUnavailable {
                reason: format!(
                    "{} could not be loaded; install the NVIDIA driver and the CUDA 13 runtime \
                     libraries, or add their folder to LD_LIBRARY_PATH",
                    missing.join(", ")
                ),
            });
        }
        self.require_driver()
    }

    /// `Ok` when the driver loads, starts and sees at least one GPU: enough for device
    /// memory, streams, events and copies. Running strata's kernels also needs NVRTC and
    /// cuBLAS ([`CudaLibraries::require_all`]).
    pub fn require_driver(&self) -> Result<(), CudaUnavailable> {
        if !self.driver {
            return Err(CudaUnavailable {
                reason: "the CUDA driver library (libcuda.so) could not be loaded; install the \
                         NVIDIA driver, or add its folder to LD_LIBRARY_PATH"
                    .into(),
            });
        }
        if let Some(error) = &self.driver_error {
            return Err(CudaUnavailable {
                reason: format!("the CUDA driver failed to start: {error}"),
            });
        }
        if self.device_count == 0 {
            return Err(CudaUnavailable {
                reason: "the CUDA driver reports no GPU".into(),
            });
        }
        Ok(())
    }
}

/// Probes the CUDA libraries once per process (later calls return the first answer).
/// Only when this reports a library present may cudarc be called into it.
pub fn probe() -> &'static CudaLibraries {
    static PROBE: OnceLock<CudaLibraries> = OnceLock::new();
    PROBE.get_or_init(|| {
        // SAFETY: these only try to dlopen each library's candidate names and close it;
        // they call nothing inside the library.
        let (driver, nvrtc, cublas) = unsafe {
            (
                cudarc::driver::sys::is_culib_present(),
                cudarc::nvrtc::sys::is_culib_present(),
                cudarc::cublas::sys::is_culib_present(),
            )
        };
        let mut device_count = 0;
        let mut driver_error = None;
        if driver {
            match cudarc::driver::result::init()
                .and_then(|()| cudarc::driver::result::device::get_count())
            {
                Ok(n) => device_count = usize::try_from(n).unwrap_or(0),
                Err(e) => driver_error = Some(e.to_string()),
            }
        }
        CudaLibraries {
            driver,
            nvrtc,
            cublas,
            device_count,
            driver_error,
        }
    })
}

/// One GPU as the driver describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// The driver's ordinal (what `cuda:N` names).
    pub ordinal: usize,
    /// The product name.
    pub name: String,
    /// Total device memory.
    pub memory_bytes: u64,
}

/// What the CUDA driver reports about itself and its GPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverReport {
    /// The newest CUDA version the driver supports, as (major, minor).
    pub cuda_version: (u32, u32),
    /// Every GPU the driver sees, in ordinal order.
    pub gpus: Vec<GpuInfo>,
}

/// Asks the driver for its CUDA version and each GPU's name and memory, without creating a
/// context. Fails with [`probe`]'s reason when the driver is absent or did not start; a
/// driver that sees no GPU gives an empty list.
pub fn describe_driver() -> Result<DriverReport, CudaUnavailable> {
    let libraries = probe();
    if !libraries.driver || libraries.driver_error.is_some() {
        // Not "no GPU" (that is an answer here), so require_driver fails, saying why.
        return Err(libraries
            .require_driver()
            .expect_err("an absent or failed driver is refused"));
    }
    let failed = |what: &str, e: cudarc::driver::DriverError| CudaUnavailable {
        reason: format!("the CUDA driver could not {what}: {e}"),
    };
    let mut version: std::ffi::c_int = 0;
    // SAFETY: the probe found the driver library loaded and initialised; the call writes
    // one int into `version`.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| failed("report its version", e))?;
    let version = u32::try_from(version).unwrap_or(0);
    let mut gpus = Vec::with_capacity(libraries.device_count);
    for ordinal in 0..libraries.device_count {
        let describe = || {
            let device = cudarc::driver::result::device::get(ordinal as std::ffi::c_int)?;
            let name = cudarc::driver::result::device::get_name(device)?;
            // SAFETY: `device` came from cuDeviceGet just above.
            let memory_bytes = unsafe { cudarc::driver::result::device::total_mem(device) }?;
            Ok(GpuInfo {
                ordinal,
                name,
                memory_bytes: memory_bytes as u64,
            })
        };
        gpus.push(describe().map_err(|e| failed(&format!("describe GPU {ordinal}"), e))?);
    }
    Ok(DriverReport {
        cuda_version: (version / 1000, version % 1000 / 10),
        gpus,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_answers_without_panicking_and_is_consistent() {
        let first = probe();
        assert_eq!(first, probe());
        if !first.driver {
            assert_eq!(first.device_count, 0);
            assert!(first.require_all().is_err());
            assert!(first.require_driver().is_err());
        }
        if first.require_all().is_ok() {
            assert!(first.require_driver().is_ok());
        }
        match first.require_all() {
            Ok(()) => println!("CUDA present: {} GPU(s)", first.device_count),
            Err(e) => println!("{e}"),
        }
    }

    #[test]
    fn driver_report_matches_the_probe() {
        let libraries = probe();
        match describe_driver() {
            Ok(report) => {
                assert!(libraries.driver);
                assert_eq!(report.gpus.len(), libraries.device_count);
                for (i, gpu) in report.gpus.iter().enumerate() {
                    assert_eq!(gpu.ordinal, i);
                    assert!(gpu.memory_bytes > 0, "{gpu:?}");
                }
                println!("{report:?}");
            }
            Err(e) => {
                assert!(libraries.require_driver().is_err());
                println!("{e}");
            }
        }
    }
}
