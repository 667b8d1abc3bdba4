//! Tests written once per device (after candle's `test_device!`): [`test_device!`] makes,
//! from one test body, a test on the CPU device (`<name>::cpu`) and one on GPU 0
//! (`<name>::cuda`). The CUDA test is `#[ignore = "needs a GPU"]`, so `cargo test` lists
//! it as ignored, never as passed; run anyway (`--include-ignored`, as
//! `scripts/gpu-check` does) on a machine without a GPU it fails, naming what is
//! missing ([`require_gpu`]). Nothing here prints "skipped" and passes.
//!
//! Not here: what a test checks (its body), and the model tests' shared data
//! (`model_support`).

// Each test binary uses the part of this module its tests need.
#![allow(dead_code, unused_macros, unused_imports)]

use std::time::Duration;

use strata_engine::device::{
    CpuDevice, CpuDeviceConfig, CudaDevice, CudaDeviceConfig, Device, DeviceKind,
};
use strata_engine::kernels::cuda::probe;

/// What a test's device is opened with.
#[derive(Debug, Clone, Copy)]
pub struct DeviceSpec {
    /// Device memory (the arena's budget).
    pub memory_budget_bytes: usize,
    /// Added to every copy of the CPU device, to hold copies in flight; a GPU's copies
    /// take the time they take.
    pub cpu_copy_latency: Duration,
    /// Whether strata's kernels run on the GPU (NVRTC and cuBLAS besides the driver), or
    /// only copies (the driver alone).
    pub cuda_kernels: bool,
}

impl DeviceSpec {
    /// `memory_budget_bytes` of device memory, no copy latency, kernels.
    pub const fn new(memory_budget_bytes: usize) -> Self {
        DeviceSpec {
            memory_budget_bytes,
            cpu_copy_latency: Duration::ZERO,
            cuda_kernels: true,
        }
    }

    /// The CPU device's copies each take `ms` milliseconds more.
    pub const fn cpu_copy_latency_ms(self, ms: u64) -> Self {
        DeviceSpec {
            cpu_copy_latency: Duration::from_millis(ms),
            ..self
        }
    }

    /// Copies only: on a GPU, the driver is all the test needs.
    pub const fn copies_only(self) -> Self {
        DeviceSpec {
            cuda_kernels: false,
            ..self
        }
    }
}

/// Panics, naming what is missing, unless a GPU and the CUDA libraries a test needs are
/// here (the driver; with `kernels`, NVRTC and cuBLAS too). The first line of every test
/// that needs a GPU: such a test fails without one, never passes by skipping.
pub fn require_gpu(kernels: bool) {
    let libraries = probe();
    let found = if kernels {
        libraries.require_all()
    } else {
        libraries.require_driver()
    };
    if let Err(why) = found {
        panic!("needs a GPU: {why} (this test is ignored unless asked for; run it where one is)");
    }
}

/// The device of `kind` as `spec` says; for CUDA, GPU 0, or a panic naming what is
/// missing.
pub fn open(kind: DeviceKind, spec: DeviceSpec) -> Device {
    match kind {
        DeviceKind::Cpu => Device::Cpu(
            CpuDevice::new(CpuDeviceConfig {
                memory_budget_bytes: spec.memory_budget_bytes,
                copy_latency: spec.cpu_copy_latency,
                ..CpuDeviceConfig::default()
            })
            .expect("the CPU device opens"),
        ),
        DeviceKind::Cuda => {
            require_gpu(spec.cuda_kernels);
            Device::Cuda(
                CudaDevice::new(CudaDeviceConfig {
                    ordinal: 0,
                    memory_budget_bytes: spec.memory_budget_bytes,
                    needs_kernels: spec.cuda_kernels,
                })
                .expect("the probe found a GPU, so GPU 0 must open"),
            )
        }
    }
}

/// One test body, two tests: `<body>::cpu` on the CPU device and `<body>::cuda` on GPU 0,
/// ignored unless asked for (`--include-ignored`) and failing loudly without a GPU.
///
/// - `test_device!(body, spec)`: `fn body(device: &Device)`, each device opened by
///   [`open`] with the `DeviceSpec` `spec` (evaluated in the test, in the scope of the
///   body's file).
/// - `test_device!(body)`: `fn body(kind: DeviceKind)`, for a body that opens its device
///   itself (a runner or an executor sized for its model); the CUDA test first requires
///   a GPU with the libraries strata's kernels need.
macro_rules! test_device {
    ($body:ident, $spec:expr) => {
        mod $body {
            use super::*;

            #[test]
            fn cpu() {
                let device = $crate::support::open(strata_engine::device::DeviceKind::Cpu, $spec);
                super::$body(&device);
            }

            #[test]
            #[ignore = "needs a GPU"]
            fn cuda() {
                let device = $crate::support::open(strata_engine::device::DeviceKind::Cuda, $spec);
                super::$body(&device);
            }
        }
    };
    ($body:ident) => {
        mod $body {
            #[test]
            fn cpu() {
                super::$body(strata_engine::device::DeviceKind::Cpu);
            }

            #[test]
            #[ignore = "needs a GPU"]
            fn cuda() {
                $crate::support::require_gpu(true);
                super::$body(strata_engine::device::DeviceKind::Cuda);
            }
        }
    };
}

pub(crate) use test_device;
