//! The cost model: a plan's step time predicted from link bandwidths and compute rates.
//!
//! Every operation gets a duration from its bytes, floating-point operations or
//! parameters and the matching rate; the schedule is then simulated as it runs: each
//! lane takes its operations in order, and an operation starts when its lane is free and
//! its dependencies have finished. The step time is the last end.

use serde::{Deserialize, Serialize};

use super::build::{Lane, OpKind, Plan};

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
    /// Where the figures came from (`defaults`, `measured at start`, a bench file).
    pub source: &'static str,
}

impl Default for CostModel {
    /// Rates measured on the 2-core development machine by `strata bench step` on GPT-2
    /// 124M (benches/results/step-amd-epyc-2c.json): 170 GFLOP/s of CPU compute (the
    /// all-on-device compute lane), 8 GB/s memory copies, NVMe 2.0 GB/s read and 2.5
    /// GB/s write as the NVMe lane achieves them one extent at a time (the raw tier
    /// does 3 and 6), and AdamW at 0.5 G params/s while the compute lane shares the
    /// cores. It does not model that contention for cores: on a machine with few cores
    /// the predicted offload cost is low.
    fn default() -> Self {
        CostModel {
            compute_flops: 170e9,
            h2d_bytes_per_s: 8e9,
            d2h_bytes_per_s: 8e9,
            nvme_read_bytes_per_s: 2.0e9,
            nvme_write_bytes_per_s: 2.5e9,
            adam_params_per_s: 0.5e9,
            source: "defaults",
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
    pub lane_seconds: [f64; 6],
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
    pub fn duration(&self, op: &super::Op) -> f64 {
        match op.kind {
            OpKind::NvmeRead { .. } => op.bytes as f64 / self.nvme_read_bytes_per_s,
            OpKind::NvmeWrite { .. } => op.bytes as f64 / self.nvme_write_bytes_per_s,
            OpKind::H2dParams { .. } | OpKind::H2dAct { .. } => {
                op.bytes as f64 / self.h2d_bytes_per_s
            }
            OpKind::D2hGrads { .. } | OpKind::D2hAct { .. } => {
                op.bytes as f64 / self.d2h_bytes_per_s
            }
            OpKind::Optimizer { .. } | OpKind::GradNorm { .. } => {
                op.params as f64 / self.adam_params_per_s
            }
            _ => op.flops / self.compute_flops,
        }
    }

    /// Simulates `plan`'s step.
    pub fn predict(&self, plan: &Plan) -> Prediction {
        let mut end = vec![0.0f64; plan.ops.len()];
        let mut lane_free = [0.0f64; 6];
        let mut lane_busy = [0.0f64; 6];
        // The canonical order is a topological order consistent with every lane's order.
        for (id, op) in plan.ops.iter().enumerate() {
            let ready = op.deps.iter().map(|&d| end[d]).fold(0.0, f64::max);
            let lane = op.lane.index();
            let start = ready.max(lane_free[lane]);
            let d = self.duration(op);
            end[id] = start + d;
            lane_free[lane] = end[id];
            lane_busy[lane] += d;
        }
        Prediction {
            step_seconds: end.iter().copied().fold(0.0, f64::max),
            compute_seconds: lane_busy[Lane::Compute.index()],
            lane_seconds: lane_busy,
        }
    }
}
