//! Stage 4 of the planner: dependencies derived from each operation's reads and writes,
//! and the memory plan by liveness analysis.
//!
//! Every transient buffer is live from its first to its last use in the canonical order.
//! Transient buffers of one tier whose lifetimes do not overlap share a physical slot
//! (interval allocation, best fit among slots within 2x of the buffer's size, so a small
//! long-lived buffer never pins a large slot); a reuse adds dependencies from the
//! previous occupant's users to the new occupant's first use, so a slot is reused only
//! once every reader of the previous occupant has finished. Persistent buffers have slots
//! of their own. Slots are then laid out one after another in their tier's arena. Every
//! edge points backwards in the canonical order, so the lanes cannot deadlock.
//! The NVMe tier's size (extents and the spares shadow paging needs) is counted here too.
//!
//! Not here: the plan those make (`assemble.rs`), or the executor's allocation of it.

use crate::plan::ir::{
    Access, BufId, BufKind, BufferPlan, Extent, ExtentKind, NvmeOp, Op, OpId, OpKind, SlotId,
    SlotPlan,
};
use crate::plan::tier::Tier;

/// Device slots start at multiples of this (what CUDA's allocator guarantees).
pub const DEVICE_ALIGN: u64 = 256;
/// Host slots start at multiples of this (O_DIRECT).
pub const HOST_ALIGN: u64 = 4096;

/// Read-after-write, write-after-read and write-after-write edges, from the accesses.
pub(super) fn derive_dependencies(ops: &mut [Op], buffers: usize) {
    let mut last_writer: Vec<Option<OpId>> = vec![None; buffers];
    let mut readers: Vec<Vec<OpId>> = vec![Vec::new(); buffers];
    for (id, op) in ops.iter_mut().enumerate() {
        let id = OpId::of(id);
        let mut deps = std::mem::take(&mut op.deps);
        for a in op.access.iter().copied() {
            let b = a.buf().index();
            match a {
                Access::Read(_) => {
                    deps.extend(last_writer[b]);
                    readers[b].push(id);
                }
                Access::Write(_) => {
                    deps.extend(last_writer[b]);
                    deps.append(&mut readers[b]);
                    last_writer[b] = Some(id);
                }
            }
        }
        deps.retain(|&d| d != id);
        deps.sort_unstable();
        deps.dedup();
        op.deps = deps;
    }
}

/// Interval allocation of transient buffers into shared slots; persistent buffers get a
/// slot each. Adds the reuse edges and lays the slots out in their arenas, device slots
/// at multiples of [`DEVICE_ALIGN`] (of [`HOST_ALIGN`] for a slot holding a buffer the NVMe
/// tier reads into device memory), host slots at multiples of [`HOST_ALIGN`].
pub(super) fn allocate(ops: &mut [Op], buffers: &mut [BufferPlan]) -> Vec<SlotPlan> {
    let users = lifetimes(ops, buffers);
    let mut table = SlotTable::default();
    let mut order: Vec<usize> = (0..buffers.len()).collect();
    order.sort_by_key(|&b| buffers[b].live.map_or(u32::MAX, |l| l.0.0));
    for b in order {
        if matches!(buffers[b].kind, BufKind::Extent { .. } | BufKind::Flag) {
            continue;
        }
        let slot = table.place(ops, buffers, &users, b);
        buffers[b].slot = Some(SlotId::of(slot));
    }
    for op in ops.iter_mut() {
        op.deps.sort_unstable();
        op.deps.dedup();
    }
    let mut slots = table.slots;
    lay_out(ops, buffers, &mut slots);
    slots
}

/// Each buffer's users (the operations that access it, in order), with its lifetime set
/// from the first to the last; checks that every transient buffer is written first.
fn lifetimes(ops: &[Op], buffers: &mut [BufferPlan]) -> Vec<Vec<OpId>> {
    let mut users: Vec<Vec<OpId>> = vec![Vec::new(); buffers.len()];
    for (id, op) in ops.iter().enumerate() {
        let id = OpId::of(id);
        for a in &op.access {
            let b = a.buf().index();
            if users[b].last() != Some(&id) {
                users[b].push(id);
            }
        }
    }
    for (b, u) in users.iter().enumerate() {
        if let (Some(&first), Some(&last)) = (u.first(), u.last()) {
            buffers[b].live = Some((first, last));
            if !buffers[b].persistent {
                let first_access = ops[first.index()]
                    .access
                    .iter()
                    .find(|a| a.buf().index() == b);
                assert!(
                    matches!(first_access, Some(Access::Write(_))),
                    "planner bug: transient buffer {} is read before it is written",
                    buffers[b].name
                );
            }
        }
    }
    users
}

/// The slots made so far, and the buffer each holds now.
#[derive(Default)]
struct SlotTable {
    slots: Vec<SlotPlan>,
    /// Current occupant of each slot (none for a buffer's own).
    occupant: Vec<Option<BufId>>,
}

impl SlotTable {
    /// A new slot of `buf`'s tier and size.
    fn new_slot(&mut self, buf: &BufferPlan) -> usize {
        self.slots.push(SlotPlan {
            tier: buf.tier,
            bytes: buf.bytes,
            offset_bytes: 0,
        });
        self.occupant.push(None);
        self.slots.len() - 1
    }

    /// The slot of buffer `b` (whose `users` are known): a slot of its own when it is
    /// persistent or unused, else a free one it can share, its previous occupant's users
    /// becoming dependencies of its first use, else a new one.
    fn place(
        &mut self,
        ops: &mut [Op],
        buffers: &[BufferPlan],
        users: &[Vec<OpId>],
        b: usize,
    ) -> usize {
        let buf = &buffers[b];
        let Some((first, _)) = buf.live.filter(|_| !buf.persistent) else {
            return self.new_slot(buf);
        };
        let slot = match self.reusable(ops, buffers, buf, first) {
            Some(s) => {
                let prev = self.occupant[s].expect("occupied");
                let first_op = &mut ops[first.index()];
                for &u in &users[prev.index()] {
                    if u < first && !first_op.deps.contains(&u) {
                        first_op.deps.push(u);
                    }
                }
                self.slots[s].bytes = self.slots[s].bytes.max(buf.bytes);
                s
            }
            None => self.new_slot(buf),
        };
        self.occupant[slot] = Some(BufId::of(b));
        slot
    }

    /// The free slot transient buffer `buf`, first used by operation `first`, takes, if
    /// any.
    fn reusable(
        &self,
        ops: &[Op],
        buffers: &[BufferPlan],
        buf: &BufferPlan,
        first: OpId,
    ) -> Option<usize> {
        let (slots, occupant) = (&self.slots, &self.occupant);
        // A device slot whose occupant a host lane used last (the CPU device's optimizer
        // reading gradients, or the NVMe tier reading into it) is taken by a stream
        // operation only if its lane has run another operation since that use: the
        // canonical order puts a block's update between its backward and the next, but
        // the two run at the same time, and taking the slot at once would make every
        // backward wait for the previous block's update.
        let first_lane = ops[first.index()].lane;
        let settled = |last: OpId| {
            !(buf.tier == Tier::Device
                && first_lane.is_stream()
                && !ops[last.index()].lane.is_stream())
                || (last.index() + 1..first.index()).any(|i| ops[i].lane == first_lane)
        };
        let free: Vec<usize> = (0..slots.len())
            .filter(|&s| {
                slots[s].tier == buf.tier
                    && occupant[s].is_some_and(|o| {
                        let last = buffers[o.index()].live.expect("live").1;
                        last < first && settled(last)
                    })
            })
            .collect();
        // Share only between buffers of similar size (within 2x), so that a small
        // long-lived buffer never pins a large slot and a large one never inflates a
        // small slot many times over.
        let similar = |s: usize| slots[s].bytes <= 2 * buf.bytes && 2 * slots[s].bytes >= buf.bytes;
        // Among slots of the size chosen, the one whose occupant was last used earliest:
        // the reuse makes this buffer's first use wait for that last use, and the later
        // that is (a state write-back at the end of the backward, say), the likelier the
        // wait is on the step's critical path. The size comes first, so the arena's size
        // is what size alone would give.
        let ended = |s: usize| {
            let o = occupant[s].expect("occupied");
            buffers[o.index()].live.expect("live").1
        };
        let fitting = free
            .iter()
            .copied()
            .filter(|&s| similar(s) && slots[s].bytes >= buf.bytes)
            .min_by_key(|&s| (slots[s].bytes, ended(s)));
        fitting.or_else(|| {
            free.iter()
                .copied()
                .filter(|&s| similar(s))
                .max_by_key(|&s| (slots[s].bytes, std::cmp::Reverse(ended(s))))
        })
    }
}

/// Lays each tier's slots out, in order, aligned; a device slot the NVMe tier reads into
/// starts on a page (O_DIRECT), as host slots do.
fn lay_out(ops: &[Op], buffers: &[BufferPlan], slots: &mut [SlotPlan]) {
    let mut page_aligned = vec![false; slots.len()];
    for op in ops {
        if let OpKind::Nvme(NvmeOp::Read { into, .. }) = op.kind
            && let Some(slot) = buffers[into.index()].slot
        {
            page_aligned[slot.index()] = true;
        }
    }
    let mut next = [0u64; 3];
    for (slot, &page) in slots.iter_mut().zip(&page_aligned) {
        let end = &mut next[slot.tier.index()];
        let align = if slot.tier == Tier::Device && !page {
            DEVICE_ALIGN
        } else {
            HOST_ALIGN
        };
        slot.offset_bytes = end.next_multiple_of(align);
        *end = slot.offset_bytes + slot.bytes;
    }
}

/// Bytes of `tier`'s arena: the end of its last slot, aligned.
pub(super) fn arena_bytes(slots: &[SlotPlan], tier: Tier) -> u64 {
    slots
        .iter()
        .filter(|s| s.tier == tier)
        .map(|s| s.offset_bytes + s.bytes)
        .max()
        .unwrap_or(0)
        .next_multiple_of(if tier == Tier::Device {
            DEVICE_ALIGN
        } else {
            HOST_ALIGN
        })
}

/// The spares shadow paging needs: for each size of the shadow-paged groups, as many as
/// one block has groups of that size (a block's commit holds them until it flips; the
/// NVMe write lane commits block by block, in order). Sizes are exact: an extent keeps
/// the length it was allocated with.
pub(super) fn spare_extents(groups: &[Extent]) -> Vec<(u64, usize)> {
    let mut per_block: std::collections::BTreeMap<(usize, u64), usize> = Default::default();
    for g in groups.iter().filter(|g| g.kind == ExtentKind::Shadow) {
        *per_block.entry((g.block, g.bytes)).or_default() += 1;
    }
    let mut spares: std::collections::BTreeMap<u64, usize> = Default::default();
    for ((_, bytes), n) in per_block {
        let most = spares.entry(bytes).or_default();
        *most = (*most).max(n);
    }
    spares.into_iter().collect()
}

/// Bytes of the NVMe tier: every group's own extents and the spares.
pub(super) fn nvme_bytes(groups: &[Extent], spares: &[(u64, usize)]) -> u64 {
    groups
        .iter()
        .map(Extent::stored_bytes)
        .chain(
            spares
                .iter()
                .map(|&(bytes, n)| bytes.next_multiple_of(4096) * n as u64),
        )
        .sum()
}
