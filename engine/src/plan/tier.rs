//! The tiers of strata's memory, the classes of tensor a block owns, and the bytes each
//! tier may hold: the words every part of the planner, the executor and the reports use
//! for where data lives.
//!
//! Not here: which tier a policy puts a class on ([`super::Policy`]), or the plan's
//! buffers on them ([`super::BufferPlan`]).

use std::fmt;

/// A tier of strata's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// The accelerator's memory (on the CPU device, host memory counted against the
    /// device budget).
    Device,
    /// Host RAM.
    Host,
    /// The NVMe tier (swap files through io_uring).
    Nvme,
}

impl Tier {
    /// Every tier, in order.
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Nvme];

    /// Position in [`Tier::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Nvme => "nvme",
        })
    }
}

/// The kinds of tensor a block owns during a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorClass {
    /// The working copy of the parameters the forward and backward read (fp32, bf16 or
    /// fp16).
    Params,
    /// Gradients, f32. They leave the device as each block's backward ends, unless the
    /// optimizer state lives on the device.
    Grads,
    /// fp32 master parameters with AdamW's m and v: 12 bytes per parameter.
    Optimizer,
    /// The block's input saved by the forward for the backward's recomputation (and,
    /// where they are offloaded to NVMe, its saved activations).
    Checkpoints,
}

impl TensorClass {
    /// Every class.
    pub const ALL: [TensorClass; 4] = [
        TensorClass::Params,
        TensorClass::Grads,
        TensorClass::Optimizer,
        TensorClass::Checkpoints,
    ];
}

impl fmt::Display for TensorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TensorClass::Params => "params",
            TensorClass::Grads => "grads",
            TensorClass::Optimizer => "optimizer",
            TensorClass::Checkpoints => "checkpoints",
        })
    }
}

/// Bytes each tier may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budgets {
    /// Device memory.
    pub device: u64,
    /// Host memory for strata's buffers (homes, staging, gradients).
    pub host: u64,
    /// Space on the NVMe tier (0: no NVMe tier).
    pub nvme: u64,
}

impl Budgets {
    /// Budgets of `device`, `host` and `nvme` bytes.
    pub fn new(device: u64, host: u64, nvme: u64) -> Self {
        Budgets { device, host, nvme }
    }
}
