//! Probing the CUDA libraries before any other cudarc call.

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
            missing.push("the CUDA driver library (libcuda.so)");
        }
        if !self.nvrtc {
            missing.push("NVRTC (libnvrtc.so.13)");
        }
        if !self.cublas {
            missing.push("cuBLAS (libcublas.so.13)");
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
}
