//! Where the plan's buffers are: one range of the device arena of the plan's device peak
//! and one pinned host arena of its host peak, allocated once, each buffer at the offset
//! the plan gave its slot ([`Arenas`]). A delayed update exchanges pairs of slots
//! between steps.
//!
//! Not here: the NVMe tier (`extents.rs`), or what the buffers hold (`state.rs`, the
//! lanes).

use super::error::ExecError;
use crate::device::{Device, DeviceRange};
use crate::lane::Lane;
use crate::memory::{DeviceBuffer, HostArena, HostRange};
use crate::plan::{BufId, Plan, SlotId, Tier};

/// The plan's device and host memory.
pub(super) struct Arenas {
    /// The pinned host arena.
    pub(super) host: HostArena,
    /// The plan's device memory (kept allocated).
    pub(super) device_mem: DeviceBuffer,
    /// Each logical buffer's physical slot; delayed updates exchange pairs of them.
    slot_of: Vec<Option<SlotId>>,
}

impl Arenas {
    /// `plan`'s memory on `device`, and its host arena pinned as the device pins; with
    /// `poison`, the host arena filled with 0xff bytes (NaN as f32), so that a read of
    /// host memory that nothing wrote shows in the results.
    pub(super) fn allocate(plan: &Plan, device: &Device, poison: bool) -> Result<Self, ExecError> {
        let setup = |source| ExecError::Device {
            op: "allocating the plan's memory".into(),
            source,
        };
        let device_mem = device
            .alloc(plan.peak[Tier::Device.index()].max(1) as usize)
            .map_err(setup)?;
        let host = HostArena::new(
            "executor",
            plan.peak[Tier::Host.index()] as usize,
            &device.pinning(),
        )
        .map_err(setup)?;
        if poison && host.len_bytes() > 0 {
            host.write(Lane::Cpu, HostRange::new(0, host.len_bytes()))
                .map_err(setup)?
                .fill(0xff);
        }
        Ok(Arenas {
            host,
            device_mem,
            slot_of: plan.buffers.iter().map(|b| b.slot).collect(),
        })
    }

    /// Where buffer `buf` of `plan` lives in the device arena.
    pub(super) fn device_range(&self, plan: &Plan, buf: BufId) -> DeviceRange {
        let b = plan.buffer(buf);
        debug_assert_eq!(b.tier, Tier::Device, "{} is not a device buffer", b.name);
        let slot = &plan.slots[self.slot_of[buf.index()].expect("memory").index()];
        DeviceRange::new(
            self.device_mem.arena_offset_bytes() + slot.offset_bytes as usize,
            b.bytes as usize,
        )
    }

    /// Where buffer `buf` of `plan` lives in the host arena.
    pub(super) fn host_range(&self, plan: &Plan, buf: BufId) -> HostRange {
        let b = plan.buffer(buf);
        debug_assert_eq!(b.tier, Tier::Host, "{} is not a host buffer", b.name);
        let slot = &plan.slots[self.slot_of[buf.index()].expect("memory").index()];
        HostRange::new(slot.offset_bytes as usize, b.bytes as usize)
    }

    /// Exchanges the memory of buffers `a` and `b` (a delayed update's pairs).
    pub(super) fn swap(&mut self, a: BufId, b: BufId) {
        self.slot_of.swap(a.index(), b.index());
    }
}
