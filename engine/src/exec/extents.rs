//! How bytes move to and from the NVMe tier: the plan's extent groups in a
//! [`TensorStore`], where each group's data is now ([`ExtentTable`]: one extent, a pair
//! swapped after each update, or a shadow-paged extent with the spares its updates write
//! to), and the checksummed reads and writes of a group's side.
//!
//! Shadow paging: an update writes a block's new data to a spare extent of the same
//! length (taken when the write starts), and the block's commit makes it current, the old
//! extent becoming a spare; a step that fails gives back the spares it wrote to and never
//! committed, so every uncommitted block keeps its old extents.
//!
//! Not here: what is read or written when (the plan's operations, run by the NVMe lanes
//! in `lanes.rs`; loading and exporting state in `state.rs`).

use std::sync::Mutex;

use strata_storage::{ExtentId, IoBuf, Pending, StorageError, StoreConfig, TensorStore};

use super::config::ExecConfig;
use super::error::ExecError;
use crate::plan::{Extent, ExtentKind, ExtentSide, Plan, TensorClass, Tier};

/// Where each NVMe extent group's data is ([`ExtentKind`]), and the spares shadow paging
/// writes to.
#[derive(Debug, Default)]
struct ExtentTable {
    /// Per group: its extent (single, shadow-paged: the current one), or side A (pair).
    cur: Vec<ExtentId>,
    /// Per group: side B (pair), or the spare this step's update wrote (shadow-paged,
    /// until the block commits).
    other: Vec<Option<ExtentId>>,
    /// Free spares, per length.
    spares: Vec<(u64, Vec<ExtentId>)>,
}

impl ExtentTable {
    /// Allocates every group's extents and the plan's spares in `store`.
    fn allocate(store: &TensorStore, plan: &Plan) -> Result<Self, StorageError> {
        let mut table = ExtentTable::default();
        for g in &plan.extent_groups {
            let (a, b) = match g.kind {
                ExtentKind::Pair => (".a", Some(".b")),
                _ => ("", None),
            };
            table
                .cur
                .push(store.allocate(&format!("{}{a}", g.name), g.bytes)?);
            table.other.push(match b {
                Some(b) => Some(store.allocate(&format!("{}{b}", g.name), g.bytes)?),
                None => None,
            });
        }
        for (i, &(bytes, n)) in plan.spares.iter().enumerate() {
            let ids = (0..n)
                .map(|j| store.allocate(&format!("spare.{i}.{j}"), bytes))
                .collect::<Result<Vec<_>, _>>()?;
            table.spares.push((bytes, ids));
        }
        Ok(table)
    }

    fn take_spare(&mut self, bytes: u64) -> Option<ExtentId> {
        self.spares
            .iter_mut()
            .find(|(b, _)| *b == bytes)
            .and_then(|(_, ids)| ids.pop())
    }

    fn put_spare(&mut self, bytes: u64, id: ExtentId) {
        match self.spares.iter_mut().find(|(b, _)| *b == bytes) {
            Some((_, ids)) => ids.push(id),
            None => self.spares.push((bytes, vec![id])),
        }
    }

    /// Makes the spare block `block`'s update wrote to each of its shadow-paged groups
    /// current; the old extents become spares.
    fn commit(&mut self, groups: &[Extent], block: usize) {
        for (g, e) in groups.iter().enumerate() {
            if e.block == block
                && e.kind == ExtentKind::Shadow
                && let Some(new) = self.other[g].take()
            {
                let old = std::mem::replace(&mut self.cur[g], new);
                self.put_spare(e.bytes, old);
            }
        }
    }

    /// Gives back the spares a failed step wrote to but never committed.
    fn unstage(&mut self, groups: &[Extent]) {
        for (g, e) in groups.iter().enumerate() {
            if e.kind == ExtentKind::Shadow
                && let Some(id) = self.other[g].take()
            {
                self.put_spare(e.bytes, id);
            }
        }
    }
}

/// The plan's NVMe tier: its extent groups in a store, and where each group's data is.
pub(super) struct NvmeTier {
    store: TensorStore,
    /// The plan's extent groups.
    groups: Vec<Extent>,
    /// Per group of optimizer state: the bytes of its head, the block's (or shard's)
    /// fp32 master parameters, whatever the moments' format.
    heads: Vec<u64>,
    table: Mutex<ExtentTable>,
    /// Which side of each pair is current: A when even.
    generation: u64,
}

impl NvmeTier {
    /// The store for `plan`'s extents, as `config` sets it up: none when the plan keeps
    /// nothing on NVMe.
    pub(super) fn store_for(
        plan: &Plan,
        config: &ExecConfig,
    ) -> Result<Option<TensorStore>, ExecError> {
        if plan.extent_groups.is_empty() {
            return Ok(None);
        }
        if config.nvme_dirs.is_empty() {
            return Err(ExecError::BadInput(format!(
                "plan {} keeps data on NVMe, but no folder for swap files was given",
                plan.policy
            )));
        }
        let capacity = plan.peak[Tier::Nvme.index()] + (1 << 20);
        let mut cfg = StoreConfig::new(config.nvme_dirs[0].clone(), capacity);
        cfg.dirs = config.nvme_dirs.clone();
        cfg.backend = config.io;
        cfg.faults = config.faults.clone();
        TensorStore::create(cfg).map(Some).map_err(ExecError::Tier)
    }

    /// `plan`'s extents and spares, allocated in `store`.
    pub(super) fn new(store: TensorStore, plan: &Plan) -> Result<Self, ExecError> {
        let table = ExtentTable::allocate(&store, plan).map_err(ExecError::Tier)?;
        Ok(NvmeTier {
            store,
            groups: plan.extent_groups.clone(),
            heads: plan
                .extent_groups
                .iter()
                .map(|g| 4 * plan.shard_len[g.block])
                .collect(),
            table: Mutex::new(table),
            generation: 0,
        })
    }

    /// The store.
    pub(super) fn store(&self) -> &TensorStore {
        &self.store
    }

    /// The extent `side` of group `group` is now. The `Next` side of a shadow-paged
    /// group takes a spare (kept until the block commits or the next step starts).
    fn extent(&self, group: usize, side: ExtentSide) -> Result<ExtentId, ExecError> {
        let g = &self.groups[group];
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let current_is_a = self.generation.is_multiple_of(2);
        let (cur, other) = (table.cur[group], table.other[group]);
        Ok(match (g.kind, side) {
            (ExtentKind::Pair, ExtentSide::Current) if !current_is_a => other.expect("pair"),
            (ExtentKind::Pair, ExtentSide::Next) if current_is_a => other.expect("pair"),
            (ExtentKind::Shadow, ExtentSide::Next) => match other {
                Some(staged) => staged,
                None => {
                    let spare = table.take_spare(g.bytes).ok_or_else(|| {
                        ExecError::BadInput(format!(
                            "no spare extent of {} bytes for {}: the plan's spares are all \
                             held (a planning error)",
                            g.bytes, g.name
                        ))
                    })?;
                    table.other[group] = Some(spare);
                    spare
                }
            },
            _ => cur,
        })
    }

    /// Starts writing `buf` to side `side` of group `group`. Optimizer state (master, m,
    /// v) is written with its head, the master parameters, checksummed on its own, so
    /// that a block whose working parameters are the master copy can fetch them alone.
    pub(super) fn write<B: IoBuf>(
        &self,
        group: usize,
        side: ExtentSide,
        buf: B,
    ) -> Result<Pending<B>, ExecError> {
        let extent = self.extent(group, side)?;
        let g = &self.groups[group];
        Ok(if g.class == TensorClass::Optimizer {
            self.store.write_with_head(extent, buf, self.heads[group])
        } else {
            self.store.write(extent, buf)
        })
    }

    /// Starts reading the first `bytes` of side `side` of group `group` into `buf`: the
    /// whole extent, or the head of optimizer state (its master parameters).
    pub(super) fn read<B: IoBuf>(
        &self,
        group: usize,
        side: ExtentSide,
        buf: B,
        bytes: u64,
    ) -> Result<Pending<B>, ExecError> {
        let extent = self.extent(group, side)?;
        Ok(if bytes < self.groups[group].bytes {
            self.store.read_head(extent, buf, bytes)
        } else {
            self.store.read(extent, buf)
        })
    }

    /// Makes block `block`'s update durable: the spares it wrote become current.
    pub(super) fn commit(&self, block: usize) {
        self.table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .commit(&self.groups, block);
    }

    /// Gives back the spares a failed step wrote to but never committed.
    pub(super) fn unstage(&self) {
        self.table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .unstage(&self.groups);
    }

    /// After an applied update: each pair's other side becomes current.
    pub(super) fn swap_pairs(&mut self) {
        self.generation += 1;
    }
}
