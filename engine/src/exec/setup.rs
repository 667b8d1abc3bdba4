//! Making an [`Executor`]: memory is allocated once, here, and never during a step. One
//! range of the device arena of the plan's device peak, one pinned host arena of its host
//! peak (registered with io_uring, so NVMe reads land with ReadFixed where the
//! host-to-device copies start), and the NVMe extents in a store; every buffer of the plan
//! is a range of one of them. The programs are built, the lane threads started.
//!
//! Not here: what the executor holds (`executor.rs`) or does (the rest of `exec`).

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use hdrhistogram::Histogram;
use strata_comm::{Collective, Solo};
use strata_kernels::adamw::STATS_PIECE;
use strata_kernels::ops::Cpu;

use super::arenas::Arenas;
use super::config::{ExecConfig, LaneLimits};
use super::error::ExecError;
use super::executor::Executor;
use super::extents::NvmeTier;
use super::programs::Programs;
use super::step_state::{NormState, Progress};
use super::workers::LaneThreads;
use crate::device::{CpuDevice, CpuDeviceConfig, Device};
use crate::model::{Model, StateLayout};
use crate::plan::{Op, OpId, OpKind, Plan, Tier};

impl Executor {
    /// Allocates every buffer of `plan` (and its NVMe extents) for `model` on `device`,
    /// whose arena must hold the plan's device peak. Parameters are zero until
    /// [`Executor::load`].
    pub fn new(
        model: Model,
        plan: Plan,
        device: Device,
        config: &ExecConfig,
    ) -> Result<Self, ExecError> {
        let shape = plan.shape;
        let dims = model.shape(shape.batch, shape.seq)?;
        let comm = group(&plan, config)?;
        if device.target() != shape.target {
            return Err(ExecError::BadInput(format!(
                "plan {} was made for the {:?} kernels, but the device is {}",
                plan.policy,
                shape.target,
                device.name()
            )));
        }
        let arenas = Arenas::allocate(&plan, &device, config.poison_host)?;
        let nvme = match NvmeTier::store_for(&plan, config)? {
            Some(store) => {
                arenas
                    .host
                    .register_with(&store)
                    .map_err(|source| ExecError::Device {
                        op: "allocating the plan's memory".into(),
                        source,
                    })?;
                Some(NvmeTier::new(store, &plan)?)
            }
            None => None,
        };
        let programs = Programs::build(&model, &plan, dims, comm.rank(), comm.size());
        let nb = model.blocks().len();
        let pieces: usize = plan
            .shard_len
            .iter()
            .map(|&s| (s as usize).div_ceil(STATS_PIECE))
            .sum();
        Ok(Executor {
            cpu: Cpu::default(),
            limits: LaneLimits::of(config),
            faults: None,
            counted_targets: 1,
            nvme,
            steps: 0,
            applied: (0..nb).map(|_| AtomicU64::new(0)).collect(),
            state_layouts: (0..nb)
                .map(|b| {
                    let shard = plan.shard_len[b] as usize;
                    StateLayout::of_shard(
                        shape.optimizer_state,
                        &model.blocks()[b],
                        comm.rank(),
                        shard,
                    )
                })
                .collect(),
            deps: [
                effective_deps(&plan, |_| true),
                effective_deps(&plan, |op| !op.update),
                effective_deps(&plan, |op| op.update),
                effective_deps(&plan, |op| op.next_step),
            ],
            head_fetched: false,
            pending: None,
            norms: NormState::new(nb, pieces, shape.ranks),
            progress: Progress::new(plan.ops.len()),
            lane_threads: LaneThreads::start()?,
            comm,
            histograms: Mutex::new(histograms()),
            programs,
            arenas,
            device,
            model,
            plan,
        })
    }

    /// A CPU device sized for `plan`, and the executor on it.
    pub fn on_cpu(model: Model, plan: Plan, config: &ExecConfig) -> Result<Self, ExecError> {
        let device = CpuDevice::new(CpuDeviceConfig {
            memory_budget_bytes: plan.peak[Tier::Device.index()].max(1) as usize,
            chaos: config.chaos,
            ..CpuDeviceConfig::default()
        })
        .map_err(|source| ExecError::Device {
            op: "opening the CPU device".into(),
            source,
        })?;
        Executor::new(model, plan, Device::Cpu(device), config)
    }
}

/// The group of ranks `config` names (this process alone when none), which must be as
/// many as `plan` is for.
fn group(plan: &Plan, config: &ExecConfig) -> Result<Arc<dyn Collective>, ExecError> {
    let comm = config
        .comm
        .clone()
        .unwrap_or_else(|| Arc::new(Solo::new()) as Arc<dyn Collective>);
    if comm.size() != plan.shape.ranks {
        return Err(ExecError::BadInput(format!(
            "plan {} is for {} rank(s), but the group has {}",
            plan.policy,
            plan.shape.ranks,
            comm.size()
        )));
    }
    Ok(comm)
}

/// An empty latency histogram per operation kind.
fn histograms() -> Vec<(&'static str, Histogram<u64>)> {
    OpKind::KIND_NAMES
        .iter()
        .map(|k| {
            (
                *k,
                Histogram::new_with_bounds(1, 3_600_000_000, 2).expect("valid bounds"),
            )
        })
        .collect()
}

/// Each operation's dependencies among the operations `kept`, a skipped dependency
/// replaced by its own (transitively). Dependencies point backwards in plan order.
fn effective_deps(plan: &Plan, kept: impl Fn(&Op) -> bool) -> Vec<Vec<OpId>> {
    let mut out: Vec<Vec<OpId>> = Vec::with_capacity(plan.ops.len());
    for op in &plan.ops {
        let mut deps = Vec::new();
        for &d in &op.deps {
            if kept(plan.op(d)) {
                deps.push(d);
            } else {
                deps.extend_from_slice(&out[d.index()]);
            }
        }
        deps.sort_unstable();
        deps.dedup();
        out.push(deps);
    }
    out
}
