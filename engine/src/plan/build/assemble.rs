//! Stage 4 of the planner, assembled: the operations' dependencies and the memory plan
//! (`memory.rs`), each tier's peak, each lane's operations, the bytes per link, and what
//! the executor exchanges between steps; the [`Plan`] the earlier stages' outputs make.
//!
//! Not here: the dependency and slot algorithms themselves (`memory.rs`).

use super::frame::Frame;
use super::homes::Homes;
use super::memory;
use super::table::BufferTable;
use crate::lane::Lane;
use crate::plan::ir::{BlockHomes, BufId, Op, OpId, Plan};
use crate::plan::tier::Tier;

/// What stages 1 to 3 made.
pub(super) struct Stages<'a> {
    pub(super) frame: Frame<'a>,
    pub(super) homes: Homes,
    pub(super) saved_bytes: Vec<u64>,
    pub(super) table: BufferTable,
    pub(super) ops: Vec<Op>,
}

/// Stage 4: dependencies, the memory plan, peaks, lanes and link bytes.
pub(super) fn assemble(stages: Stages<'_>) -> Plan {
    let Stages {
        frame: f,
        homes,
        saved_bytes,
        table,
        mut ops,
    } = stages;
    let BufferTable {
        mut buffers,
        extent_groups,
    } = table;
    memory::derive_dependencies(&mut ops, buffers.len());
    let slots = memory::allocate(&mut ops, &mut buffers);
    let mut peak = [0u64; 3];
    for tier in [Tier::Device, Tier::Host] {
        peak[tier.index()] = memory::arena_bytes(&slots, tier);
    }
    let spares = memory::spare_extents(&extent_groups);
    peak[Tier::Nvme.index()] = memory::nvme_bytes(&extent_groups, &spares);
    let (lanes, link_bytes) = lanes_and_links(&ops);
    let block_homes = (0..f.nb())
        .map(|b| BlockHomes {
            params: homes.params[b].0,
            state: homes.state[b].0,
            params_base: homes.params_base[b],
            packed: homes.packed[b],
        })
        .collect();
    Plan {
        homes: tier_table(&f, &homes),
        block_homes,
        swap_each_step: swap_each_step(&f, &homes),
        swap_on_update: swap_on_update(&f, &homes),
        policy: f.name,
        grads_spilled: f.spill,
        kept: f.kept,
        saved_tier: f.saved_tier,
        saved_bytes,
        depth: f.depth,
        shape: f.shape,
        budgets: f.input.budgets,
        ops,
        lanes,
        buffers,
        slots,
        extent_groups,
        spares,
        peak,
        link_bytes,
        shard_len: f.shard,
        tokens_host: homes.tokens_host,
        losses_host: homes.losses_host,
        stats_host: homes.grads.stats_host,
        scratch: homes.scratch,
        stats_scratch: homes.stats_scratch,
    }
}

/// Each lane's operations in order, and the bytes each link moves.
fn lanes_and_links(ops: &[Op]) -> ([Vec<OpId>; Lane::COUNT], [u64; 4]) {
    let mut lanes: [Vec<OpId>; Lane::COUNT] = Default::default();
    let mut link_bytes = [0u64; 4];
    for (id, op) in ops.iter().enumerate() {
        lanes[op.lane.index()].push(OpId::of(id));
        if let Some(link) = op.kind.link() {
            link_bytes[link] += op.bytes;
        }
    }
    (lanes, link_bytes)
}

/// Every block's home tiers, in [`TensorClass`](crate::plan::TensorClass) order
/// (checkpoints: of the block's input).
fn tier_table(f: &Frame<'_>, homes: &Homes) -> Vec<[Tier; 4]> {
    (0..f.nb())
        .map(|b| {
            let t = &f.tiers[b];
            let ckpt = if b >= 1 && b <= f.layers {
                homes.ckpt_tier[b - 1]
            } else {
                Tier::Device
            };
            [t.params, t.grads, t.state, ckpt]
        })
        .collect()
}

/// Delayed update: pairs of persistent homes (working parameters read by this step,
/// written by its update) exchanged after every step that applied an update.
fn swap_on_update(f: &Frame<'_>, homes: &Homes) -> Vec<(BufId, BufId)> {
    homes
        .params
        .iter()
        .enumerate()
        .filter(|&(b, &(cur, next))| cur != next && f.tiers[b].params != Tier::Nvme)
        .map(|(_, &pair)| pair)
        .collect()
}

/// Delayed update: pairs of gradient buffers (being filled, being applied) exchanged
/// after every step.
fn swap_each_step(f: &Frame<'_>, homes: &Homes) -> Vec<(BufId, BufId)> {
    let g = &homes.grads;
    (0..f.nb())
        .flat_map(|b| {
            [
                g.host[b].zip(g.apply_host[b]),
                g.home_dev[b].zip(g.apply_dev[b]),
            ]
        })
        .flatten()
        .filter(|(fill, apply)| fill != apply)
        .collect()
}
