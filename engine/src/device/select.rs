//! Which device a run uses: the user's choice ([`DeviceChoice`], `--device
//! auto|cpu|cuda`), what opening one needs ([`DeviceConfig`]), the kernels a plan is
//! made for before any device opens ([`choose_target`]), and opening it with a sentence
//! saying which and why ([`select`]).
//!
//! Not here: the devices (`cpu`, `cuda`) and what they do (`ops`).

use std::fmt;

use strata_kernels::cuda::probe;
use strata_kernels::program::Target;

use super::Device;
use super::cpu::{CpuDevice, CpuDeviceConfig};
use super::cuda::{CudaDevice, CudaDeviceConfig, cuda_usable};
use super::ops::DeviceOps;
use crate::error::EngineError;

/// Which device to use, as the user says it (`--device auto|cpu|cuda`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DeviceChoice {
    /// A GPU when the CUDA libraries load and one is visible, else the CPU device.
    #[default]
    Auto,
    /// The CPU: host memory and the CPU kernels (where a GPU would be, a simulated one).
    Cpu,
    /// The configured GPU (`DeviceConfig::cuda_ordinal`, 0 by default) through CUDA; an
    /// error when it cannot be used.
    Cuda,
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceChoice::Auto => "auto",
            DeviceChoice::Cpu => "cpu",
            DeviceChoice::Cuda => "cuda",
        })
    }
}

/// What [`select`] needs to open a device.
#[derive(Debug, Clone)]
pub struct DeviceConfig {
    /// Device memory allocated at start (the arena's budget).
    pub memory_budget_bytes: usize,
    /// Which GPU, when CUDA is chosen.
    pub cuda_ordinal: usize,
    /// Whether strata's kernels will run on a GPU (training: true), which needs NVRTC and
    /// cuBLAS besides the driver; a copy benchmark needs only the driver (false).
    pub cuda_needs_kernels: bool,
}

/// Which kernels a run on the device `choice` names would use, before any device is
/// opened (a plan is made for its target): `Cuda` when the CUDA driver, NVRTC, cuBLAS
/// and a GPU are all there, which `Auto` asks and `Cuda` requires (failing with one line
/// naming what is missing); else the CPU's.
pub fn choose_target(choice: DeviceChoice) -> Result<Target, EngineError> {
    match choice {
        DeviceChoice::Cpu => Ok(Target::Cpu),
        DeviceChoice::Cuda => {
            cuda_usable(true)?;
            Ok(Target::Cuda)
        }
        DeviceChoice::Auto => Ok(if cuda_usable(true).is_ok() {
            Target::Cuda
        } else {
            Target::Cpu
        }),
    }
}

/// Opens the device `choice` names and says which it is and why, in a sentence for the
/// user. `Auto` takes a GPU when the CUDA probe finds the libraries the config needs and
/// a GPU, else the CPU device with the probe's reason; `Cuda` fails with that reason
/// instead.
pub fn select(
    choice: DeviceChoice,
    config: &DeviceConfig,
) -> Result<(Device, String), EngineError> {
    let cpu = || {
        CpuDevice::new(CpuDeviceConfig {
            memory_budget_bytes: config.memory_budget_bytes,
            ..CpuDeviceConfig::default()
        })
        .map(Device::Cpu)
    };
    let cuda = || {
        CudaDevice::new(CudaDeviceConfig {
            ordinal: config.cuda_ordinal,
            memory_budget_bytes: config.memory_budget_bytes,
            needs_kernels: config.cuda_needs_kernels,
        })
    };
    const CPU: &str = "cpu (a simulated accelerator in host memory)";
    match choice {
        DeviceChoice::Cpu => Ok((cpu()?, format!("{CPU}: asked for with device 'cpu'"))),
        DeviceChoice::Cuda => {
            let device = cuda()?;
            let reason = format!(
                "{} ({}): asked for with device 'cuda'",
                device.name(),
                device.gpu_name()
            );
            Ok((Device::Cuda(device), reason))
        }
        DeviceChoice::Auto => match cuda_usable(config.cuda_needs_kernels) {
            Ok(()) => {
                let device = cuda()?;
                let libraries = if config.cuda_needs_kernels {
                    "the CUDA driver, NVRTC and cuBLAS"
                } else {
                    "the CUDA driver"
                };
                let reason = format!(
                    "{} ({}): device 'auto' found {libraries} and {} GPU(s)",
                    device.name(),
                    device.gpu_name(),
                    probe().device_count
                );
                Ok((Device::Cuda(device), reason))
            }
            Err(unavailable) => Ok((
                cpu()?,
                format!(
                    "{CPU}: device 'auto' found no usable GPU ({})",
                    unavailable.reason
                ),
            )),
        },
    }
}
