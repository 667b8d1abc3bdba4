//! Stage 3 of the planner, after a backward: a block's gradients out of the device (the
//! accumulation across micro-batches, the reduce-scatter among ranks, the rounding to
//! bf16 once complete, the spill to NVMe), their statistics and the global norm, and the
//! block's update with its write-backs and commit.
//!
//! Not here: the driver and the operations before and of each compute (`emit.rs`).

use super::emit::Emitter;
use crate::lane::Lane;
use crate::model::Target;
use crate::plan::ir::{Access, BufId, CommOp, GradSource, HostOp, NvmeOp, OpId, StreamOp};
use crate::plan::shape::GradDtype;
use crate::plan::tier::Tier;

impl Emitter<'_, '_> {
    /// After micro-batch `m`'s backward finished block `b`'s gradients: accumulation on
    /// the device, or the copy to the host (added to the host gradients after the first
    /// micro-batch).
    pub(super) fn gradients_out(&mut self, b: usize, m: usize) {
        let f = self.f;
        if !f.trains(b) {
            return;
        }
        let grads = &self.homes.grads;
        if let (Some(home), true) = (grads.home_dev[b], m > 0 && f.ranks == 1) {
            let from = self.step.g_dev[m][b];
            let op = StreamOp::Accumulate {
                block: b,
                from,
                to: home,
            };
            let id = self.stream(op, vec![Access::Read(from), Access::Write(home)]);
            self.ops[id.index()].flops = f.grad_len(b) as f64;
        }
        if f.device_comm(b) {
            self.reduce_over_device(b, m);
        } else if let (Some(host), true) = (grads.host[b], f.ranks > 1) {
            self.reduce_over_host(b, m, host);
        } else if let Some(host) = grads.host[b] {
            self.gradients_to_host(b, m, host);
        }
        if m + 1 == f.shape.grad_accum && !f.spill[b] {
            self.round_gradients(b);
        }
    }

    /// Block `b`'s complete gradients (ranks: 1), where they are when the last
    /// micro-batch's backward and accumulation are done, rounded to bf16 in place when
    /// the step keeps them so ([`GradDtype::Bf16`]), before anything reads them. A
    /// spilled block's are rounded on their way out (see [`Self::spill_gradients`]).
    fn round_gradients(&mut self, b: usize) {
        let f = self.f;
        if f.shape.grad_dtype != GradDtype::Bf16 {
            return;
        }
        let g = &self.homes.grads;
        let bytes = 4 * f.grad_len(b);
        let grads = g.home_dev[b]
            .or(g.host[b])
            .expect("every block's gradients are on the host or device");
        // Where they lie: the device (its own, or on the CPU device the host gradients
        // the backward left there), or host memory.
        let id = if self.table.buffers[grads.index()].tier == Tier::Device {
            self.round_on_device(b, grads)
        } else {
            let op = HostOp::RoundGrads {
                block: b,
                grads,
                out: None,
            };
            self.host(op, vec![Access::Write(grads)])
        };
        // Reads and writes each.
        self.set_bytes(id, 2 * bytes);
    }

    /// The device's rounding of block `b`'s gradients `grads` (compute stream).
    fn round_on_device(&mut self, b: usize, grads: BufId) -> OpId {
        let op = StreamOp::RoundGrads { block: b, grads };
        let id = self.stream(op, vec![Access::Write(grads)]);
        self.ops[id.index()].flops = self.f.grad_len(b) as f64;
        id
    }

    /// With ranks, over device memory: micro-batch `m`'s gradients of block `b`
    /// reduce-scattered into the shard's device gradients, then (after the last
    /// micro-batch) a host copy for the norm.
    fn reduce_over_device(&mut self, b: usize, m: usize) {
        let f = self.f;
        let grads = &self.homes.grads;
        let from = self.step.g_dev[m][b];
        let into = grads.home_dev[b].expect("device gradients");
        let host = grads.host[b];
        let full = 4 * f.ranks as u64 * f.shard(b);
        let scratch = (f.shape.target == Target::Cuda).then(|| {
            self.table
                .buffer(format!("grads[{b}]#{m}<@device"), Tier::Device, full)
        });
        self.reduce_scatter(b, m, from, into, scratch);
        if m + 1 == f.shape.grad_accum {
            let host = host.expect("a host copy of the gradients");
            self.copy_out(into, host, 4 * f.shard(b));
        }
    }

    /// With ranks, staged through the host: every micro-batch's gradients go to every
    /// rank, a shard to each, and are added there (into `host`) in rank order: the order
    /// of one process's micro-batches.
    fn reduce_over_host(&mut self, b: usize, m: usize, host: BufId) {
        let f = self.f;
        let from = self.step.g_dev[m][b];
        let full = 4 * f.ranks as u64 * f.shard(b);
        let stage = self
            .table
            .buffer(format!("grads[{b}]#{m}>@host"), Tier::Host, full);
        self.copy_out(from, stage, 4 * f.grad_len(b));
        self.reduce_scatter(b, m, stage, host, None);
        if let (Some(dev), true) = (self.homes.grads.home_dev[b], m + 1 == f.shape.grad_accum) {
            // The step's sum of this rank's shard, to the device for its AdamW.
            self.copy_in(host, dev, 4 * f.shard(b), None, false);
        }
    }

    /// Alone: micro-batch `m`'s gradients of block `b` copied to the host gradients
    /// `host` (the first), or added to them (the others). Spilled, the earlier
    /// micro-batches' sum waits on NVMe, read back to add this one's, and written out
    /// again until the last (see [`Self::spill_gradients`]).
    fn gradients_to_host(&mut self, b: usize, m: usize, host: BufId) {
        let f = self.f;
        let bytes = 4 * f.grad_len(b);
        let from = self.step.g_dev[m][b];
        // Spilled, a block's sum of the micro-batches so far waits on NVMe between its
        // backwards; vertically these follow one another, and it waits in host memory.
        let partial = self.homes.grads.partial[b];
        let last = m + 1 == f.shape.grad_accum;
        let host = match partial {
            Some(_) if !last => {
                self.table
                    .buffer(format!("grads[{b}]#{m}@host"), Tier::Host, bytes)
            }
            _ => host,
        };
        if m == 0 {
            if from != host {
                self.copy_out(from, host, bytes);
            }
        } else {
            if let Some(extent) = partial {
                self.nvme_read(Lane::NvmeRead, extent, host, bytes);
            }
            let stage = self
                .table
                .buffer(format!("grads[{b}]#{m}>@host"), Tier::Host, bytes);
            self.copy_out(from, stage, bytes);
            let op = HostOp::Accumulate {
                block: b,
                from: stage,
                to: host,
            };
            let id = self.host(op, vec![Access::Read(stage), Access::Write(host)]);
            // Reads both, writes one.
            self.set_bytes(id, 3 * bytes);
        }
        if let (Some(extent), false) = (partial, last) {
            self.nvme_write(host, extent, bytes, false);
        }
    }

    /// Micro-batch `m`'s gradients of block `b`, whole in `from` (room for every rank's
    /// chunk), reduce-scattered into this rank's shard `into` on the collective lane,
    /// added to the earlier micro-batches' after the first; `scratch` where the device
    /// needs room for the chunks it receives.
    fn reduce_scatter(
        &mut self,
        b: usize,
        m: usize,
        from: BufId,
        into: BufId,
        scratch: Option<BufId>,
    ) {
        let mut access = vec![Access::Read(from), Access::Write(into)];
        access.extend(scratch.map(Access::Write));
        let op = CommOp::ReduceScatter {
            block: b,
            from,
            into,
            scratch,
            accumulate: m > 0,
        };
        let id = self.collective(op, access);
        self.set_bytes(id, 4 * self.f.ranks as u64 * self.f.shard(b));
    }

    /// A state read of an NVMe-homed block into its host staging, `depth` blocks ahead of
    /// its update. With a delayed update nothing this step computes waits for the
    /// update's I/O, so its reads go on the write lane, behind nothing the compute lane
    /// needs.
    pub(super) fn read_state(&mut self, b: usize) {
        let Some(stage) = self.step.s_stage[b] else {
            return;
        };
        let f = self.f;
        let lane = if f.shape.delayed_update {
            Lane::NvmeWrite
        } else {
            Lane::NvmeRead
        };
        let first = self.ops.len();
        self.nvme_read(lane, self.homes.state[b].0, stage, f.state_bytes(b));
        if let Some(extent) = self.homes.grads.spill[b] {
            let into = self.homes.grads.apply_host[b].expect("host gradients");
            let bytes = f.shape.grad_dtype.bytes() * f.shard(b);
            self.nvme_read(lane, extent, into, bytes);
        }
        self.mark_update(first);
    }

    /// Spilled block `b`'s gradients, complete on the host: their statistics for the
    /// norm (CPU), then the write to their extent, which frees the host buffer.
    pub(super) fn spill_gradients(&mut self, b: usize) {
        let g = &self.homes.grads;
        let Some(extent) = g.spill[b] else {
            return;
        };
        let (grads, stats) = (
            g.host[b].expect("host gradients"),
            g.stats_spill[b].expect("a statistics buffer"),
        );
        let f = self.f;
        let bytes = 4 * f.shard(b);
        // Rounded to bf16, they are written in 2 bytes each, from a copy in bf16.
        let out = (f.shape.grad_dtype == GradDtype::Bf16).then(|| {
            let half = GradDtype::Bf16.bytes() * f.shard(b);
            let out = self
                .table
                .buffer(format!("grads[{b}]>bf16@host"), Tier::Host, half);
            let op = HostOp::RoundGrads {
                block: b,
                grads,
                out: Some(out),
            };
            let id = self.host(op, vec![Access::Write(grads), Access::Write(out)]);
            self.set_bytes(id, 2 * bytes + half);
            out
        });
        let op = HostOp::Stats {
            block: b,
            grads,
            stats,
        };
        let id = self.host(op, vec![Access::Read(grads), Access::Write(stats)]);
        self.set_bytes(id, bytes);
        match out {
            Some(out) => self.nvme_write(out, extent, bytes / 2, false),
            None => self.nvme_write(grads, extent, bytes, false),
        }
    }

    /// The statistics of device-homed block `b`'s gradients, computed on the device and
    /// copied to the host (part of the update).
    fn device_stats(&mut self, b: usize) {
        let g = &self.homes.grads;
        let (Some(stats), Some(host)) = (g.stats_dev[b], g.stats_host[b]) else {
            return;
        };
        let first = self.ops.len();
        let grads = g.apply_dev[b].expect("device gradients");
        let op = StreamOp::DeviceStats {
            block: b,
            grads,
            stats,
        };
        let access = vec![
            Access::Read(grads),
            Access::Write(stats),
            Access::Write(self.homes.stats_scratch),
        ];
        let id = self.stream(op, access);
        self.set_bytes(id, 4 * self.f.grad_len(b));
        self.copy_out(stats, host, 16);
        self.mark_update(first);
    }

    /// The global norm over every block, when the step needs it (part of the update);
    /// the device-homed blocks' statistics first. With ranks the norm is a collective
    /// (every rank's pieces, summed in order), over every block's host gradients.
    pub(super) fn emit_norm(&mut self) {
        let Some(flag) = self.homes.norm_flag else {
            return;
        };
        let f = self.f;
        let nb = f.nb();
        for b in 0..nb {
            self.device_stats(b);
        }
        let g = &self.homes.grads;
        // Blocks that train nothing have no share of the norm.
        let sources: Vec<(usize, GradSource)> = (0..nb)
            .filter(|&b| f.trains(b))
            .map(|b| match (g.apply_host[b], g.stats_host[b]) {
                _ if f.spill[b] => (b, GradSource::Stats(g.stats_spill[b].expect("spilled"))),
                (Some(grads), _) => (b, GradSource::Host(grads)),
                (None, Some(stats)) => (b, GradSource::Stats(stats)),
                (None, None) => unreachable!("every block's gradients are on the host or device"),
            })
            .collect();
        let mut access: Vec<Access> = sources
            .iter()
            .map(|&(_, s)| match s {
                GradSource::Host(g) | GradSource::Stats(g) => Access::Read(g),
            })
            .collect();
        access.push(Access::Write(flag));
        let total: u64 = (0..nb).map(|b| f.shard(b)).sum();
        let first = self.ops.len();
        let id = if f.ranks > 1 {
            let grads = (0..nb)
                .filter(|&b| f.trains(b))
                .map(|b| {
                    let grads = g.apply_host[b];
                    (
                        b,
                        grads.expect("with ranks every block's gradients are on the host"),
                    )
                })
                .collect();
            self.collective(CommOp::GradNorm { grads }, access)
        } else {
            self.host(HostOp::GradNorm { sources }, access)
        };
        self.set_bytes(id, 4 * total);
        self.mark_update(first);
    }

    /// AdamW on block `b` and the write-backs of its state and parameters.
    pub(super) fn emit_update(&mut self, b: usize) {
        if !self.f.trains(b) {
            return;
        }
        let first = self.ops.len();
        if self.f.tiers[b].state == Tier::Device {
            self.device_update(b);
        } else {
            self.host_update(b);
        }
        self.mark_update(first);
    }

    /// AdamW on device-homed block `b`, on the device's update stream; with ranks, the
    /// gather of every rank's new parameters.
    fn device_update(&mut self, b: usize) {
        let f = self.f;
        let len = f.shard(b);
        let flag = self.homes.norm_flag;
        if flag.is_none() {
            self.device_stats(b);
        }
        let grads = self.homes.grads.apply_dev[b].expect("device gradients");
        let state = self.homes.state[b].0;
        let next = self.homes.params[b].1;
        // With ranks the update writes this rank's shard of the new parameters, which
        // every rank's are gathered with: over device memory (in the device's dtype),
        // or on the host (in the host's precision).
        let device_comm = f.device_comm(b);
        let out = (f.ranks > 1).then(|| {
            let bytes = len * if device_comm { f.dbytes } else { f.pbytes };
            self.table
                .buffer(format!("params[{b}]>@device"), Tier::Device, bytes)
        });
        let params = out.unwrap_or(next);
        let mut access = vec![
            Access::Read(grads),
            Access::Write(state),
            Access::Write(params),
        ];
        access.extend(flag.map(Access::Read));
        let op = StreamOp::DeviceUpdate {
            block: b,
            grads,
            state,
            params,
        };
        let id = self.stream(op, access);
        self.ops[id.index()].params = len;
        if let (Some(out), true) = (out, device_comm) {
            let op = CommOp::AllGather {
                block: b,
                from: out,
                into: next,
                with_update: true,
            };
            let id = self.collective(op, vec![Access::Read(out), Access::Write(next)]);
            self.set_bytes(id, f.ranks as u64 * len * f.dbytes);
        } else if let Some(out) = out {
            let stage = self.step.p_out_stage[b].expect("a host stage for the new shard");
            self.copy_out(out, stage, len * f.pbytes);
            let from = self.gathered(b, stage, ">", true);
            self.copy_in(from, next, f.len(b) * f.pbytes, f.param_conversion(), true);
        }
    }

    /// AdamW on block `b` on the CPU, the write-backs of its state and parameters, and
    /// the commit of what went to NVMe.
    fn host_update(&mut self, b: usize) {
        let f = self.f;
        let len = f.shard(b);
        let flag = self.homes.norm_flag;
        let (s_home, p_home) = (self.homes.state[b], self.homes.params[b]);
        let grads = self.homes.grads.apply_host[b].expect("host gradients");
        let state = self.step.s_stage[b].unwrap_or(s_home.0);
        let params_out = if f.shares_master(b) {
            None
        } else {
            Some(self.step.p_out_stage[b].unwrap_or(p_home.1))
        };
        let mut access = vec![Access::Read(grads), Access::Write(state)];
        access.extend(params_out.map(Access::Write));
        access.extend(flag.map(Access::Read));
        // Spilled gradients come back in the dtype they were written in.
        let grads_dtype = if f.spill[b] {
            f.shape.grad_dtype
        } else {
            GradDtype::Fp32
        };
        // The home itself holds the whole block, but a packed block's holds its trained
        // tail alone, as a stage holds the new parameters.
        let in_home = !f.packs(b) && params_out.is_some_and(|p| p == p_home.0 || p == p_home.1);
        let op = HostOp::Optimizer {
            block: b,
            grads,
            grads_dtype,
            state,
            params_out,
            params_at: if in_home { f.frozen(b) } else { 0 },
        };
        let id = self.host(op, access);
        self.ops[id.index()].params = len;
        if flag.is_none() {
            // With no norm it also takes the gradients' statistics, a pass over them (as
            // a device-homed block's `DeviceStats` does).
            self.set_bytes(id, 4 * len);
        }
        let mut commit = Vec::new();
        if f.tiers[b].state == Tier::Nvme {
            self.nvme_write(state, s_home.1, f.state_bytes(b), true);
            commit.push(s_home.1);
        }
        match (f.tiers[b].params, params_out) {
            (_, None) => {} // written with the state
            (Tier::Nvme, Some(params_out)) => {
                self.nvme_write(params_out, p_home.1, len * f.pbytes, true);
                if !f.shape.delayed_update {
                    commit.push(p_home.1);
                }
            }
            (Tier::Device, Some(params_out)) if params_out == p_home.1 => {
                // Written in place by the optimizer (`update_writes_device`).
            }
            (Tier::Device, Some(params_out)) => {
                // The stage holds the trained elements: the whole block, or a LoRA
                // block's adapters, copied past its base.
                let from = self.gathered(b, params_out, ">", true);
                self.copy_in_at(
                    from,
                    (p_home.1, f.frozen(b)),
                    f.grad_len(b) * f.pbytes,
                    f.param_conversion(),
                    true,
                );
            }
            (Tier::Host, _) => {}
        }
        if !commit.is_empty() {
            // After the block's writes (write after write on their extents).
            let access = commit.into_iter().map(Access::Write).collect();
            self.nvme(Lane::NvmeWrite, NvmeOp::Commit { block: b }, access);
        }
    }
}
