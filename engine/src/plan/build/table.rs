//! The planner's table of logical buffers and NVMe extent groups, which stages 2 and 3
//! add to: a buffer is made where the stage that needs it decides its tier and size.
//!
//! Not here: where a buffer's bytes go (its slot, `memory.rs`).

use crate::plan::ir::{BufId, BufKind, BufferPlan, Extent, ExtentKind, ExtentSide};
use crate::plan::tier::{TensorClass, Tier};

/// Bytes rounded up to the 4096 O_DIRECT needs.
fn host_bytes(bytes: u64) -> u64 {
    bytes.max(1).next_multiple_of(4096)
}

/// The plan's buffers and extent groups so far, in the order they were made.
#[derive(Default)]
pub(super) struct BufferTable {
    pub(super) buffers: Vec<BufferPlan>,
    pub(super) extent_groups: Vec<Extent>,
}

impl BufferTable {
    /// A transient buffer of `bytes` on `tier` (device or host; host buffers rounded up
    /// to whole pages).
    pub(super) fn buffer(&mut self, name: String, tier: Tier, bytes: u64) -> BufId {
        let kind = match tier {
            Tier::Device => BufKind::Device,
            Tier::Host => BufKind::Host,
            Tier::Nvme => unreachable!("NVMe data lives in extents"),
        };
        let bytes = if tier == Tier::Host {
            host_bytes(bytes)
        } else {
            bytes
        };
        self.buffers.push(BufferPlan {
            name,
            tier,
            kind,
            bytes,
            persistent: false,
            slot: None,
            live: None,
        });
        BufId::of(self.buffers.len() - 1)
    }

    /// A buffer that lives across steps (it never shares memory).
    pub(super) fn persistent(&mut self, name: String, tier: Tier, bytes: u64) -> BufId {
        let id = self.buffer(name, tier, bytes);
        self.buffers[id.index()].persistent = true;
        id
    }

    /// A home on `tier` (device or host), with a second one for the next step's copy
    /// when `pair`.
    pub(super) fn home_pair(
        &mut self,
        name: &str,
        tier: Tier,
        bytes: u64,
        pair: bool,
    ) -> (BufId, BufId) {
        let cur = self.persistent(format!("{name}@{tier}"), tier, bytes);
        let next = if pair {
            self.persistent(format!("{name}@{tier}'"), tier, bytes)
        } else {
            cur
        };
        (cur, next)
    }

    /// An extent group: one buffer per side.
    pub(super) fn extents(
        &mut self,
        name: String,
        bytes: u64,
        kind: ExtentKind,
        block: usize,
        class: TensorClass,
    ) -> (BufId, BufId) {
        self.extent_groups.push(Extent {
            name: name.clone(),
            bytes,
            kind,
            block,
            class,
        });
        let group = self.extent_groups.len() - 1;
        let mut side = |side, label: &str| {
            self.buffers.push(BufferPlan {
                name: format!("{name}{label}@nvme"),
                tier: Tier::Nvme,
                kind: BufKind::Extent { group, side },
                bytes: 0,
                persistent: true,
                slot: None,
                live: None,
            });
            BufId::of(self.buffers.len() - 1)
        };
        if kind == ExtentKind::Single {
            let id = side(ExtentSide::Single, "");
            (id, id)
        } else {
            (
                side(ExtentSide::Current, ".cur"),
                side(ExtentSide::Next, ".next"),
            )
        }
    }

    /// A flag: no memory, a buffer that orders operations (the updates after the global
    /// norm).
    pub(super) fn flag(&mut self, name: &str) -> BufId {
        self.buffers.push(BufferPlan {
            name: name.into(),
            tier: Tier::Host,
            kind: BufKind::Flag,
            bytes: 0,
            persistent: true,
            slot: None,
            live: None,
        });
        BufId::of(self.buffers.len() - 1)
    }
}
