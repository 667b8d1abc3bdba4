//! Stage 2b of the planner: the step's transient buffers (device parameter copies per use
//! group, checkpoints, the saved activations of the blocks the plan keeps, activation
//! gradients, tokens and losses, gradients per micro-batch, optimizer-state staging) and
//! where in the compute sequence each fetch is emitted: `depth` computes ahead of its
//! use.
//!
//! Not here: the homes that live across steps (`homes.rs`), or the operations (`emit.rs`).

use super::frame::Frame;
use super::homes::Homes;
use super::sequence::{Compute, Sequence};
use super::table::BufferTable;
use crate::plan::ir::BufId;
use crate::plan::policy::Release;
use crate::plan::tier::Tier;

/// The buffers of what a forward makes and the backward reads, a checkpoint or a
/// block's saved activations, of one micro-batch: the forward's device copy, where the
/// backward reads it, and the host copy between (when it leaves the device).
pub(super) struct Handoff {
    pub(super) fwd: BufId,
    pub(super) bwd: BufId,
    pub(super) host: Option<BufId>,
}

/// Stage 2b's buffers.
pub(super) struct StepBuffers {
    /// Device parameter buffer of block b at compute k.
    pub(super) dev_params: Vec<Vec<Option<BufId>>>,
    /// Per micro-batch, per boundary.
    pub(super) ckpts: Vec<Vec<Handoff>>,
    /// Per block: bytes of its saved activations (0 unless kept).
    pub(super) saved_bytes: Vec<u64>,
    /// Saved activations per micro-batch, per block (kept blocks only).
    pub(super) saved: Vec<Vec<Option<Handoff>>>,
    /// Activation gradients per micro-batch, per boundary.
    pub(super) dact: Vec<Vec<BufId>>,
    /// Device tokens and losses per micro-batch.
    pub(super) tokens_dev: Vec<BufId>,
    pub(super) losses_dev: Vec<BufId>,
    /// Device gradients per micro-batch, per block.
    pub(super) g_dev: Vec<Vec<BufId>>,
    /// Per block: the host staging of its NVMe optimizer state, and of the new working
    /// parameters its update writes.
    pub(super) s_stage: Vec<Option<BufId>>,
    pub(super) p_out_stage: Vec<Option<BufId>>,
}

/// What to emit before each compute of the sequence (indexed by position).
pub(super) struct Fetches {
    /// Parameter fetches: (block, device buffer, whether the parameters come from the
    /// block's state read, see [`Frame::state_feeds_backward`]).
    pub(super) params: Vec<Vec<(usize, BufId, bool)>>,
    /// Checkpoint fetches: (boundary, micro-batch).
    pub(super) ckpts: Vec<Vec<(usize, usize)>>,
    /// Offloaded saved activations' fetches: (block, micro-batch).
    pub(super) saved: Vec<Vec<(usize, usize)>>,
    /// Token copies, by micro-batch.
    pub(super) tokens: Vec<Vec<usize>>,
    /// Optimizer-state reads, by block.
    pub(super) state_reads: Vec<Vec<usize>>,
    /// The parameter fetches the step's first computes need, emitted at the end of the
    /// step before ([`StepShape::prefetch_next_step`]): (block, device buffer).
    ///
    /// [`StepShape::prefetch_next_step`]: crate::plan::StepShape::prefetch_next_step
    pub(super) next_step: Vec<(usize, BufId)>,
}

/// Stage 2b while it runs.
struct Stage<'p, 'a> {
    f: &'p Frame<'a>,
    homes: &'p Homes,
    seq: &'p Sequence,
    table: &'p mut BufferTable,
    out: StepBuffers,
    fetches: Fetches,
}

impl StepBuffers {
    /// Stage 2b: the step's transient buffers and the positions of their fetches.
    pub(super) fn plan(
        f: &Frame<'_>,
        homes: &Homes,
        seq: &Sequence,
        table: &mut BufferTable,
    ) -> (StepBuffers, Fetches) {
        let (nb, n) = (f.nb(), seq.len());
        let mut stage = Stage {
            f,
            homes,
            seq,
            table,
            out: StepBuffers {
                dev_params: vec![vec![None; nb]; n],
                ckpts: Vec::new(),
                saved_bytes: Vec::new(),
                saved: Vec::new(),
                dact: Vec::new(),
                tokens_dev: Vec::new(),
                losses_dev: Vec::new(),
                g_dev: Vec::new(),
                s_stage: vec![None; nb],
                p_out_stage: vec![None; nb],
            },
            fetches: Fetches {
                params: vec![Vec::new(); n],
                ckpts: vec![Vec::new(); n],
                saved: vec![Vec::new(); n],
                tokens: vec![Vec::new(); n],
                state_reads: vec![Vec::new(); n],
                next_step: Vec::new(),
            },
        };
        stage.param_groups();
        stage.checkpoints();
        stage.saved();
        for m in 0..f.shape.grad_accum {
            stage.micro_batch(m);
        }
        for b in 0..nb {
            stage.update_staging(b);
        }
        (stage.out, stage.fetches)
    }
}

impl Stage<'_, '_> {
    /// Device parameter buffers per use group: consecutive uses of a streamed block
    /// share one fetch; with [`Release::AfterBackward`] one fetch serves a micro-batch.
    fn param_groups(&mut self) {
        let f = self.f;
        let steps = &self.seq.steps;
        for b in 0..f.nb() {
            let uses: Vec<usize> = (0..steps.len())
                .filter(|&k| {
                    self.seq
                        .param_blocks(steps[k], |own| f.input.model.tied(own))
                        .contains(&b)
                })
                .collect();
            if f.tiers[b].params == Tier::Device {
                for &k in &uses {
                    self.out.dev_params[k][b] = Some(self.homes.params[b].0);
                }
                continue;
            }
            let keep = f.policy.release(f.input, b) == Release::AfterBackward;
            let mut group: Vec<usize> = Vec::new();
            for &k in &uses {
                let joins = group.last().is_some_and(|&prev| {
                    k == prev + 1 || (keep && steps[prev].micro() == steps[k].micro())
                });
                if !joins {
                    self.param_group(b, &mut group);
                }
                group.push(k);
            }
            self.param_group(b, &mut group);
        }
    }

    fn param_group(&mut self, b: usize, group: &mut Vec<usize>) {
        if group.is_empty() {
            return;
        }
        let f = self.f;
        // The state read for the update is emitted at this same position (the start of
        // the backward completing the block's gradients, less the depth), before the
        // fetch.
        let from_state = group[0] == self.backward_start(b) && f.state_feeds_backward(b);
        let bytes = f.len(b) * f.dbytes;
        let bytes = if f.reads_into_device(b, from_state) {
            // The read moves whole 4 KiB blocks (O_DIRECT).
            bytes.next_multiple_of(4096)
        } else {
            bytes
        };
        let at = group[0].saturating_sub(f.depth);
        // A fetch at the step's start whose parameters are final when the step before
        // ends moves there: its buffer then lives across the boundary.
        let next_step = at == 0 && !from_state && f.shape.prefetches_next_head();
        let name = format!("params[{b}]@device");
        let id = if next_step {
            self.table.persistent(name, Tier::Device, bytes)
        } else {
            self.table.buffer(name, Tier::Device, bytes)
        };
        for &k in group.iter() {
            self.out.dev_params[k][b] = Some(id);
        }
        if next_step {
            self.fetches.next_step.push((b, id));
        } else {
            self.fetches.params[at].push((b, id, from_state));
        }
        group.clear();
    }

    /// [`Sequence::backward_start`] of block `b`.
    fn backward_start(&self, b: usize) -> usize {
        let model = self.f.input.model;
        self.seq.backward_start(b, |own| model.tied(own))
    }

    /// Checkpoint buffers per micro-batch, and their fetches for the backward.
    fn checkpoints(&mut self) {
        let f = self.f;
        let act = f.act_bytes();
        for m in 0..f.shape.grad_accum {
            let mut row = Vec::new();
            for i in 0..=f.layers {
                let fwd = self
                    .table
                    .buffer(format!("ckpt[{i}]#{m}@device"), Tier::Device, act);
                let tier = self.homes.ckpt_tier[i];
                row.push(self.handoff(format!("ckpt[{i}]#{m}"), fwd, tier, act));
            }
            self.out.ckpts.push(row);
        }
        // Fetched `depth` computes ahead of the backward, not before the forward that
        // produces them.
        for k in 0..self.seq.len() {
            if let Compute::LayerBack(b, m) = self.seq.steps[k] {
                let i = b - 1;
                if self.homes.ckpt_tier[i] != Tier::Device {
                    let producer = if i == 0 {
                        Compute::Embed(m)
                    } else {
                        Compute::Layer(i, m)
                    };
                    let at = self.fetch_position(k, producer, f.depth);
                    self.fetches.ckpts[at].push((i, m));
                }
            }
        }
    }

    /// Where the fetch for the backward at position `k` of what `producer` made is
    /// emitted: `ahead` computes ahead of the backward, but after the producer.
    fn fetch_position(&self, k: usize, producer: Compute, ahead: usize) -> usize {
        let made = self.seq.position(producer);
        k.saturating_sub(ahead).max(made + 1)
    }

    /// The buffers of `name`, `bytes` made into `fwd` on the device, to be read by the
    /// backward after waiting in `tier`: on the device, `fwd` itself; elsewhere a host
    /// copy and the backward's own device buffer.
    fn handoff(&mut self, name: String, fwd: BufId, tier: Tier, bytes: u64) -> Handoff {
        if tier == Tier::Device {
            return Handoff {
                fwd,
                bwd: fwd,
                host: None,
            };
        }
        Handoff {
            fwd,
            bwd: self
                .table
                .buffer(format!("{name}<@device"), Tier::Device, bytes),
            host: Some(self.table.buffer(format!("{name}@host"), Tier::Host, bytes)),
        }
    }

    /// The saved activations of the kept blocks, per micro-batch, and the fetches of the
    /// offloaded ones for their backward.
    fn saved(&mut self) {
        let f = self.f;
        self.out.saved_bytes = (0..f.nb()).map(|b| f.saved_bytes(b)).collect();
        for m in 0..f.shape.grad_accum {
            let mut row = Vec::with_capacity(f.nb());
            for b in 0..f.nb() {
                let bytes = self.out.saved_bytes[b];
                row.push(f.kept[b].then(|| {
                    let fwd =
                        self.table
                            .buffer(format!("saved[{b}]#{m}@device"), Tier::Device, bytes);
                    self.handoff(format!("saved[{b}]#{m}"), fwd, f.saved_tier[b], bytes)
                }));
            }
            self.out.saved.push(row);
        }
        for k in 0..self.seq.len() {
            if let Compute::LayerBack(b, m) = self.seq.steps[k]
                && f.kept[b]
                && f.saved_tier[b] != Tier::Device
            {
                let ahead = f.saved_ahead(f.saved_tier[b]);
                let at = self.fetch_position(k, Compute::Layer(b, m), ahead);
                self.fetches.saved[at].push((b, m));
            }
        }
    }

    /// Micro-batch `m`'s activation gradients, tokens and losses on the device (with the
    /// tokens' copy), and its device gradients.
    fn micro_batch(&mut self, m: usize) {
        let f = self.f;
        let act = f.act_bytes();
        let rows = f.dims.rows() as u64;
        let dact: Vec<BufId> = (0..=f.layers)
            .map(|i| {
                self.table
                    .buffer(format!("dact[{i}]#{m}@device"), Tier::Device, act)
            })
            .collect();
        self.out.dact.push(dact);
        let tokens = self
            .table
            .buffer(format!("tokens#{m}@device"), Tier::Device, 8 * rows);
        self.out.tokens_dev.push(tokens);
        let embed = self.seq.position(Compute::Embed(m));
        self.fetches.tokens[embed.saturating_sub(f.depth)].push(m);
        let losses = self
            .table
            .buffer(format!("losses#{m}@device"), Tier::Device, 4 * rows);
        self.out.losses_dev.push(losses);
        let grads: Vec<BufId> = (0..f.nb()).map(|b| self.device_grads(b, m)).collect();
        self.out.g_dev.push(grads);
    }

    /// Block `b`'s gradients of micro-batch `m` on the device: a buffer per micro-batch
    /// (or the device home).
    fn device_grads(&mut self, b: usize, m: usize) -> BufId {
        let f = self.f;
        let grads = &self.homes.grads;
        if !f.trains(b) {
            // Bound to its backward, which writes no gradient.
            return self
                .table
                .buffer(format!("grads[{b}]#{m}@device"), Tier::Device, 0);
        }
        match grads.home_dev[b] {
            Some(id) if m == 0 && f.ranks == 1 => id,
            None if f.tiers[b].grads == Tier::Host && f.grads_stay_on_device(b) => {
                grads.host[b].expect("gradients the update reads on the device")
            }
            // Reduce-scattered over device memory: a chunk for every rank.
            _ => self.table.buffer(
                format!("grads[{b}]#{m}@device"),
                Tier::Device,
                4 * if f.device_comm(b) {
                    f.ranks as u64 * f.shard(b)
                } else {
                    f.grad_len(b)
                },
            ),
        }
    }

    /// Block `b`'s host staging for its update: its NVMe optimizer state (read `depth`
    /// computes before the backward that completes its gradients), and the new working
    /// parameters where they go on elsewhere.
    fn update_staging(&mut self, b: usize) {
        let f = self.f;
        if !f.trains(b) {
            return;
        }
        let len = f.shard(b);
        let t = &f.tiers[b];
        if t.state == Tier::Nvme {
            // With a global-norm barrier the reads are emitted with the updates, after
            // the norm, so that only `depth` blocks are staged at once.
            if !f.has_norm() && !f.shape.delayed_update {
                // Where the state feeds the backward's parameters, ahead of the first
                // compute that reads them; else ahead of the last.
                let before = if f.state_feeds_backward(b) {
                    self.backward_start(b)
                } else {
                    self.seq.completes(b)
                };
                let at = before.saturating_sub(f.depth);
                self.fetches.state_reads[at].push(b);
            }
            self.out.s_stage[b] = Some(self.table.buffer(
                format!("adam[{b}]@host"),
                Tier::Host,
                f.state_bytes(b),
            ));
        }
        if f.stages_new_params(b) {
            self.out.p_out_stage[b] = Some(self.table.buffer(
                format!("params[{b}]>@host"),
                Tier::Host,
                len * f.pbytes,
            ));
        }
    }
}
