//! The cost model: a plan's step time predicted from link bandwidths and compute rates.
//!
//! Every operation gets a duration from its bytes, floating-point operations or
//! parameters and the matching rate; the schedule is then simulated as it runs: each
//! lane takes its operations in order, and an operation starts when its lane is free and
//! its dependencies have finished. The step time is the last end.
//!
//! A compute operation's FLOPs are those of the program it runs, so a layer's backward
//! is charged its forward's FLOPs again only where the plan recomputes the block
//! ([`Plan::kept`]); a kept block's backward costs its backward kernels alone.
//!
//! Not here: the rates' measurement (`exec::calibrate`), or the choice among plans
//! (`auto.rs`).

use serde::{Deserialize, Serialize};

use super::ir::{CommOp, HostOp, NvmeOp, Op, OpKind, Plan, StreamOp};
use crate::lane::Lane;
use crate::model::Target;

/// A modelling factor: on the CPU device, whether the compute lane, the update lane and
/// the CPU optimizer lane are simulated on one timeline, since all run on all of the
/// machine's cores.
/// Without it an offloaded update looks free on a 2-core machine, where it is not.
pub const CPU_DEVICE_SHARES_CORES: bool = true;

/// Bytes AdamW moves per parameter (f32 gradient read; master, m and v read and
/// written): the other passes over gradients are timed at the bandwidth this implies.
pub const ADAM_BYTES_PER_PARAM: f64 = 28.0;

/// A modelling default, not a measurement: the rate at which a rank receives a
/// collective's bytes, taken as shared-memory MPI between processes of one machine (a
/// memory copy or two). A run across machines is slower by its network.
pub const COLLECTIVE_BYTES_PER_S: f64 = 4e9;

/// What [`CostModel::default`]'s rates say of where they come from.
pub const DEFAULT_SOURCE: &str = "defaults";

/// Rates of this machine's links and processors (bytes and operations per second).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Device compute, floating-point operations per second.
    pub compute_flops: f64,
    /// Host to device copies.
    pub h2d_bytes_per_s: f64,
    /// Device to host copies.
    pub d2h_bytes_per_s: f64,
    /// NVMe tier reads.
    pub nvme_read_bytes_per_s: f64,
    /// NVMe tier writes.
    pub nvme_write_bytes_per_s: f64,
    /// CPU AdamW, parameters per second.
    pub adam_params_per_s: f64,
    /// Collectives among ranks, bytes per second counted as a collective operation's
    /// bytes: an all-gather's whole gathered buffer (every rank's shard), a
    /// reduce-scatter's whole send buffer. Measured at start with ranks
    /// (`CostModel::calibrate_collective`).
    pub collective_bytes_per_s: f64,
    /// Where the figures came from (`defaults`, `measured at start`, a bench file).
    pub source: &'static str,
}

impl Default for CostModel {
    /// Modelling defaults, set by hand, not measured by strata on any machine: rates of the
    /// order of what `strata bench step` showed on GPT-2 124M on a 2-core AMD EPYC (Zen 3)
    /// in `benches/results/step-amd-epyc-2c.json`, whose measured steps give 189 GFLOP/s
    /// on the all-on-device compute lane, copies at 10.5-11 GB/s, the NVMe lanes at 1.8
    /// GB/s each way one extent at a time, and the CPU AdamW at 0.28-0.45 G params/s beside
    /// the compute (that file's own `cost_model` block is these defaults, `"source":
    /// "defaults"`, which it predicted with). They are CPU rates: a plan for a GPU is
    /// ranked with them too until a GPU's rates are recorded (`strata plan` says so). They
    /// do not model contention for cores: on a machine with few cores the predicted
    /// offload cost is low. `strata train` measures its own rates at start instead
    /// ([`CostModel::source`] then says so).
    fn default() -> Self {
        CostModel {
            compute_flops: 170e9,
            h2d_bytes_per_s: 8e9,
            d2h_bytes_per_s: 8e9,
            nvme_read_bytes_per_s: 2.0e9,
            nvme_write_bytes_per_s: 2.5e9,
            adam_params_per_s: 0.5e9,
            collective_bytes_per_s: COLLECTIVE_BYTES_PER_S,
            source: DEFAULT_SOURCE,
        }
    }
}

/// A predicted step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Prediction {
    /// Seconds per optimizer step.
    pub step_seconds: f64,
    /// Seconds the compute lane is busy.
    pub compute_seconds: f64,
    /// Busy seconds per lane ([`Lane::index`]).
    pub lane_seconds: [f64; Lane::COUNT],
}

impl Prediction {
    /// Compute-only time over step time: 1 when every transfer hides under compute.
    pub fn overlap_efficiency(&self) -> f64 {
        if self.step_seconds > 0.0 {
            self.compute_seconds / self.step_seconds
        } else {
            1.0
        }
    }
}

impl CostModel {
    /// Seconds `op` takes alone.
    pub fn duration(&self, op: &Op) -> f64 {
        match op.kind {
            OpKind::Nvme(NvmeOp::Read { .. }) => op.bytes as f64 / self.nvme_read_bytes_per_s,
            OpKind::Nvme(NvmeOp::Write { .. }) => op.bytes as f64 / self.nvme_write_bytes_per_s,
            // Bookkeeping: no bytes move.
            OpKind::Nvme(NvmeOp::Commit { .. }) => 0.0,
            OpKind::Stream(StreamOp::H2d { .. }) => op.bytes as f64 / self.h2d_bytes_per_s,
            OpKind::Stream(StreamOp::D2h { .. }) => op.bytes as f64 / self.d2h_bytes_per_s,
            OpKind::Host(HostOp::Optimizer { .. })
            | OpKind::Stream(StreamOp::DeviceUpdate { .. }) => {
                op.params as f64 / self.adam_params_per_s
                    + op.bytes as f64 / (self.adam_params_per_s * ADAM_BYTES_PER_PARAM)
            }
            // Other memory-bound passes over gradients, on the CPU or the device: at the
            // bandwidth AdamW reaches.
            OpKind::Host(
                HostOp::GradNorm { .. }
                | HostOp::Stats { .. }
                | HostOp::Accumulate { .. }
                | HostOp::RoundGrads { .. },
            )
            | OpKind::Collective(CommOp::GradNorm { .. })
            | OpKind::Stream(
                StreamOp::DeviceStats { .. }
                | StreamOp::RoundGrads { .. }
                | StreamOp::Dequantize { .. },
            ) => op.bytes as f64 / (self.adam_params_per_s * ADAM_BYTES_PER_PARAM),
            OpKind::Stream(StreamOp::Compute { .. } | StreamOp::Accumulate { .. }) => {
                op.flops / self.compute_flops
            }
            OpKind::Collective(CommOp::AllGather { .. } | CommOp::ReduceScatter { .. }) => {
                op.bytes as f64 / self.collective_bytes_per_s
            }
        }
    }

    /// Simulates `plan`'s step.
    ///
    /// On the CPU device the compute stream's kernels, the update stream's and the CPU
    /// optimizer's run on the same cores, each using all of them: the simulation gives
    /// the three lanes one timeline there (`CPU_DEVICE_SHARES_CORES`).
    pub fn predict(&self, plan: &Plan) -> Prediction {
        let mut end = vec![0.0f64; plan.ops.len()];
        let mut lane_free = [0.0f64; Lane::COUNT];
        let mut lane_busy = [0.0f64; Lane::COUNT];
        let shared = CPU_DEVICE_SHARES_CORES && plan.shape.target == Target::Cpu;
        let timeline = |lane: Lane| {
            if shared && matches!(lane, Lane::Cpu | Lane::Update) {
                Lane::Compute.index()
            } else {
                lane.index()
            }
        };
        // The canonical order is a topological order consistent with every lane's order.
        for (id, op) in plan.ops.iter().enumerate() {
            let ready = op.deps.iter().map(|&d| end[d.index()]).fold(0.0, f64::max);
            let line = timeline(op.lane);
            let start = ready.max(lane_free[line]);
            let d = self.duration(op);
            end[id] = start + d;
            lane_free[line] = end[id];
            lane_busy[op.lane.index()] += d;
        }
        Prediction {
            step_seconds: end.iter().copied().fold(0.0, f64::max),
            compute_seconds: lane_busy[Lane::Compute.index()],
            lane_seconds: lane_busy,
        }
    }
}
