//! Stage 3 of the planner: every operation, in one canonical order, a topological order
//! of the step. The compute sequence (forward blocks, the head's forward and backward,
//! backward blocks), with fetches placed `depth` compute operations ahead of their use,
//! and gradient copies, updates and write-backs right after the backward that completes
//! a block's gradients (after a global-norm barrier when clipping, or spread over the
//! next step's compute with a delayed update). Each lane runs its operations in this
//! order.
//!
//! This file holds the driver and the operations before and of each compute (fetches,
//! checkpoints and offloaded saved activations, the compute itself); `emit_update.rs`
//! those after a backward (gradients out, statistics, the norm, the update and its
//! write-backs).
//!
//! Not here: dependencies (derived from the accesses in stage 4, `memory.rs`).

use super::frame::Frame;
use super::homes::Homes;
use super::sequence::{Compute, Sequence};
use super::step_buffers::{Fetches, StepBuffers};
use super::table::BufferTable;
use crate::lane::Lane;
use crate::model::{Dtype, Pass, Target};
use crate::plan::ir::{Access, Binds, BufId, CommOp, HostOp, NvmeOp, Op, OpId, OpKind, StreamOp};
use crate::plan::tier::Tier;

/// Where a parameter fetch reads from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fetch {
    /// The block's home, for this step.
    Home,
    /// The head of the block's optimizer state, read for its update.
    FromState,
    /// The block's home, for the next step (at this step's end).
    NextStep,
}

/// Stage 3 while it runs: what the earlier stages made, and the operations so far.
pub(super) struct Emitter<'p, 'a> {
    pub(super) f: &'p Frame<'a>,
    pub(super) homes: &'p Homes,
    pub(super) step: &'p StepBuffers,
    pub(super) seq: &'p Sequence,
    /// Stage 3 makes buffers too (staging, gathered parameters, scratch).
    pub(super) table: &'p mut BufferTable,
    pub(super) ops: Vec<Op>,
}

impl<'p, 'a> Emitter<'p, 'a> {
    /// Stage 3: every operation, in canonical order.
    pub(super) fn emit(
        f: &'p Frame<'a>,
        homes: &'p Homes,
        (step, fetches): (&'p StepBuffers, Fetches),
        seq: &'p Sequence,
        table: &'p mut BufferTable,
    ) -> Vec<Op> {
        let mut e = Emitter {
            f,
            homes,
            step,
            seq,
            table,
            ops: Vec::new(),
        };
        e.sequence(fetches);
        e.ops
    }

    /// The operations of every compute of the sequence, the updates between or after
    /// them.
    fn sequence(&mut self, mut fetches: Fetches) {
        let f = self.f;
        let delayed = f.shape.delayed_update;
        let last_micro = f.shape.grad_accum - 1;
        let mut pending: Vec<usize> = Vec::new();
        // A delayed update applies the last step's gradients block by block in forward
        // order, spread evenly over this step's compute sequence, which it overlaps.
        let delayed_order: Vec<usize> = if delayed {
            (0..f.nb()).collect()
        } else {
            Vec::new()
        };
        let steps = self.seq.len();
        for k in 0..steps {
            if delayed {
                self.delayed_updates(k, steps, &delayed_order);
            }
            self.fetches_before(k, &mut fetches);
            let step = self.seq.steps[k];
            self.emit_compute(k, step);
            // After the compute: checkpoint copies out, gradient copies out, updates.
            let m = step.micro();
            match step {
                Compute::Embed(_) => self.save_checkpoint(0, m),
                Compute::Layer(b, _) => {
                    self.save_checkpoint(b, m);
                    self.save_activations(b, m);
                }
                _ => {}
            }
            let Some(b) = step.finishes(f.head) else {
                continue;
            };
            self.gradients_out(b, m);
            if m == last_micro {
                self.spill_gradients(b);
                if delayed {
                    // Applied during the next step.
                } else if self.homes.norm_flag.is_some() {
                    pending.push(b);
                } else {
                    self.emit_update(b);
                }
            }
        }
        if !delayed {
            self.emit_norm();
        }
        self.read_ahead(&pending);
        self.updates_in_turn(&pending, 0..pending.len());
        self.next_step_fetches(&fetches.next_step);
    }

    /// At the step's end, the next step's first parameter fetches, each after its
    /// block's update is durable (its commit, where the update shadow-pages NVMe), in
    /// the order the updates end: each lane runs in order, so a fetch waiting for the
    /// last update would hold back those behind it.
    fn next_step_fetches(&mut self, next: &[(usize, BufId)]) {
        let mut next = next.to_vec();
        next.sort_by_key(|&(b, _)| {
            self.ops
                .iter()
                .rposition(|op| op.update && op.kind.label().block == Some(b))
        });
        for (b, to) in next {
            let commit = self.ops.iter().rposition(
                |op| matches!(op.kind, OpKind::Nvme(NvmeOp::Commit { block }) if block == b),
            );
            let first = self.ops.len();
            self.fetch_params(b, to, Fetch::NextStep);
            for op in &mut self.ops[first..] {
                op.next_step = true;
                op.deps.extend(commit.map(OpId::of));
            }
        }
    }

    /// Before compute `k` of `steps`, with a delayed update: at the start the norm and
    /// the first `depth` state reads, then the updates of the blocks `order` spreads to
    /// this compute, each with the state read `depth` blocks ahead.
    fn delayed_updates(&mut self, k: usize, steps: usize, order: &[usize]) {
        let n = order.len();
        let at = |i: usize| i * steps / n.max(1);
        let here = (0..n).filter(|&i| at(i) == k).fold(n..n, |r, i| {
            if r.is_empty() {
                i..i + 1
            } else {
                r.start..i + 1
            }
        });
        if k == 0 {
            self.emit_norm();
            self.read_ahead(order);
        }
        self.updates_in_turn(order, here);
    }

    /// The state reads of the first `depth` blocks of `order`, ahead of their updates.
    fn read_ahead(&mut self, order: &[usize]) {
        for &b in order.iter().take(self.f.depth) {
            self.read_state(b);
        }
    }

    /// The updates of `order[range]`, each followed by the state read of the block
    /// `depth` places later in `order`.
    fn updates_in_turn(&mut self, order: &[usize], range: std::ops::Range<usize>) {
        let depth = self.f.depth;
        for i in range {
            self.emit_update(order[i]);
            if let Some(&next) = order.get(i + depth) {
                self.read_state(next);
            }
        }
    }

    /// What is fetched before compute `k`: state reads, checkpoints, tokens, parameters.
    fn fetches_before(&mut self, k: usize, fetches: &mut Fetches) {
        for b in std::mem::take(&mut fetches.state_reads[k]) {
            self.read_state(b);
        }
        for (i, m) in std::mem::take(&mut fetches.ckpts[k]) {
            self.fetch_checkpoint(i, m);
        }
        for (b, m) in std::mem::take(&mut fetches.saved[k]) {
            self.fetch_activations(b, m);
        }
        for m in std::mem::take(&mut fetches.tokens[k]) {
            let (from, to) = (self.homes.tokens_host[m], self.step.tokens_dev[m]);
            let bytes = 8 * self.f.dims.rows() as u64;
            self.copy_in(from, to, bytes, None, false);
        }
        for (b, to, from_state) in std::mem::take(&mut fetches.params[k]) {
            let from = if from_state {
                Fetch::FromState
            } else {
                Fetch::Home
            };
            self.fetch_params(b, to, from);
        }
    }

    /// A new operation of `kind` on `lane`.
    fn op(&mut self, lane: Lane, kind: OpKind, access: Vec<Access>) -> OpId {
        debug_assert!(kind.runs_on(lane), "{} on the {lane} lane", kind.label());
        self.ops.push(Op {
            kind,
            lane,
            deps: Vec::new(),
            access,
            bytes: 0,
            flops: 0.0,
            params: 0,
            update: false,
            next_step: false,
        });
        OpId::of(self.ops.len() - 1)
    }

    /// Stream work, on its stream.
    pub(super) fn stream(&mut self, op: StreamOp, access: Vec<Access>) -> OpId {
        let lane = op.lane();
        self.op(lane, OpKind::Stream(op), access)
    }

    /// Host arithmetic, on the CPU lane.
    pub(super) fn host(&mut self, op: HostOp, access: Vec<Access>) -> OpId {
        self.op(Lane::Cpu, OpKind::Host(op), access)
    }

    /// A collective, on the collective lane.
    pub(super) fn collective(&mut self, op: CommOp, access: Vec<Access>) -> OpId {
        self.op(Lane::Comm, OpKind::Collective(op), access)
    }

    /// NVMe work on NVMe lane `lane`.
    pub(super) fn nvme(&mut self, lane: Lane, op: NvmeOp, access: Vec<Access>) -> OpId {
        self.op(lane, OpKind::Nvme(op), access)
    }

    /// Sets operation `id`'s bytes.
    pub(super) fn set_bytes(&mut self, id: OpId, bytes: u64) {
        self.ops[id.index()].bytes = bytes;
    }

    /// Marks the operations from `first` on as part of the update.
    pub(super) fn mark_update(&mut self, first: usize) {
        for op in &mut self.ops[first..] {
            op.update = true;
        }
    }

    /// A host-to-device copy of `bytes` from `from` into `to`.
    pub(super) fn copy_in(
        &mut self,
        from: BufId,
        to: BufId,
        bytes: u64,
        convert: Option<(Dtype, Dtype)>,
        with_update: bool,
    ) {
        self.copy_in_at(from, (to, 0), bytes, convert, with_update);
    }

    /// [`Self::copy_in`] into `to` from its element `to_at`.
    pub(super) fn copy_in_at(
        &mut self,
        from: BufId,
        (to, to_at): (BufId, u64),
        bytes: u64,
        convert: Option<(Dtype, Dtype)>,
        with_update: bool,
    ) {
        let op = StreamOp::H2d {
            from,
            to,
            to_at,
            bytes,
            convert,
            with_update,
        };
        let id = self.stream(op, vec![Access::Read(from), Access::Write(to)]);
        self.set_bytes(id, bytes);
    }

    /// A device-to-host copy of `bytes` from `from` into `to`.
    pub(super) fn copy_out(&mut self, from: BufId, to: BufId, bytes: u64) {
        let op = StreamOp::D2h { from, to, bytes };
        let id = self.stream(op, vec![Access::Read(from), Access::Write(to)]);
        self.set_bytes(id, bytes);
    }

    /// A read of `bytes` of extent `from` into `into`, on NVMe lane `lane`.
    pub(super) fn nvme_read(&mut self, lane: Lane, from: BufId, into: BufId, bytes: u64) {
        self.nvme_read_at(lane, from, into, 0, bytes);
    }

    /// [`Self::nvme_read`] into `into` from its byte `at`.
    fn nvme_read_at(&mut self, lane: Lane, from: BufId, into: BufId, at: u64, bytes: u64) {
        let op = NvmeOp::Read { from, into, at };
        let id = self.nvme(lane, op, vec![Access::Read(from), Access::Write(into)]);
        self.set_bytes(id, bytes);
    }

    /// A write of `bytes` of `from` to extent `to`, on the NVMe write lane.
    pub(super) fn nvme_write(&mut self, from: BufId, to: BufId, bytes: u64, with_update: bool) {
        let op = NvmeOp::Write {
            from,
            to,
            with_update,
        };
        let access = vec![Access::Read(from), Access::Write(to)];
        let id = self.nvme(Lane::NvmeWrite, op, access);
        self.set_bytes(id, bytes);
    }

    /// Block `b`'s working parameters from their home to the device buffer `to`, or
    /// from the head of its optimizer state, staged on the host for the update by a read
    /// emitted just before (see [`Fetch`]). With ranks, the home holds this rank's
    /// shard: the shards are gathered on the host first.
    fn fetch_params(&mut self, b: usize, to: BufId, from: Fetch) {
        let f = self.f;
        let from_state = from == Fetch::FromState;
        let (cur, next) = self.homes.params[b];
        // A delayed update's new parameters are the next step's (its home pair is
        // exchanged after the step); otherwise the home, current once committed.
        let home = if from == Fetch::NextStep && f.shape.delayed_update {
            next
        } else {
            cur
        };
        if f.packs(b) {
            self.fetch_packed(b, to);
        }
        // Where the fetched parameters go in the device buffer, and how many bytes of
        // them are copied: the whole block (gathered from every rank's shard), or a
        // packed block's trained tail past its base. A split block's stage holds it whole.
        let (at, bytes) = if f.packs(b) {
            (f.frozen(b), f.shard(b) * f.pbytes)
        } else {
            (0, f.len(b) * f.pbytes)
        };
        // Where a split or packed block's trained tail is read to in the buffer it is
        // read into: past the base, unless that buffer is a packed block's host stage.
        let tail_at = f.frozen(b) * f.pbytes;
        if f.reads_into_device(b, from_state) {
            self.read_params(b, home, (to, tail_at));
            return;
        }
        let from = match f.tiers[b].params {
            _ if from_state => self.step.s_stage[b].expect("the state's host stage"),
            Tier::Host => home,
            Tier::Nvme => {
                // Whole 4 KiB blocks: a split block's tail is read past its base.
                let (staged, tail_at) = if f.packs(b) {
                    (bytes, 0)
                } else {
                    (shard_bytes(f, b), tail_at)
                };
                let stage = self.table.buffer(
                    format!("params[{b}]<@host"),
                    Tier::Host,
                    staged.next_multiple_of(4096),
                );
                self.read_params(b, home, (stage, tail_at));
                stage
            }
            Tier::Device => unreachable!("device-resident parameters are not fetched"),
        };
        let from = self.gathered(b, from, "<", false);
        self.copy_in_at(from, (to, at), bytes, f.param_conversion(), false);
    }

    /// Block `b`'s working parameters from their NVMe home `home` into `into`: one read,
    /// or for a split LoRA block ([`Frame::splits_params`]) its base's extent and then its
    /// trained tail's past it; for a packed one ([`Frame::packs`]) its trained tail
    /// alone. `tail_at`: the byte of `into` a trained tail goes to.
    fn read_params(&mut self, b: usize, home: BufId, (into, tail_at): (BufId, u64)) {
        let f = self.f;
        let tail = f.shard(b) * f.pbytes;
        match self.homes.params_base[b] {
            Some(base) => {
                self.nvme_read(Lane::NvmeRead, base, into, f.frozen(b) * f.pbytes);
                self.nvme_read_at(Lane::NvmeRead, home, into, tail_at, tail);
            }
            None if f.packs(b) => self.nvme_read_at(Lane::NvmeRead, home, into, tail_at, tail),
            None => self.nvme_read(Lane::NvmeRead, home, into, shard_bytes(f, b)),
        }
    }

    /// Block `b`'s packed base from its home to a device buffer of its own, and its
    /// dequantisation from there into the base's elements of `to` (the block's device
    /// parameters): copied from host memory, or read from NVMe (into the device's memory
    /// on the CPU device, else staged through the host).
    fn fetch_packed(&mut self, b: usize, to: BufId) {
        let f = self.f;
        let bytes = f.packed_bytes(b);
        let home = self.homes.packed[b].expect("a packed block's home");
        let packed = self
            .table
            .buffer(format!("packed[{b}]@device"), Tier::Device, bytes);
        match f.tiers[b].params {
            Tier::Host => self.copy_in(home, packed, bytes, None, false),
            Tier::Nvme if f.shape.target == Target::Cpu => {
                self.nvme_read(Lane::NvmeRead, home, packed, bytes);
            }
            Tier::Nvme => {
                let stage = self
                    .table
                    .buffer(format!("packed[{b}]<@host"), Tier::Host, bytes);
                self.nvme_read(Lane::NvmeRead, home, stage, bytes);
                self.copy_in(stage, packed, bytes, None, false);
            }
            Tier::Device => unreachable!("a device home holds the dequantised base"),
        }
        let op = StreamOp::Dequantize {
            block: b,
            packed,
            params: to,
        };
        let id = self.stream(op, vec![Access::Read(packed), Access::Write(to)]);
        self.set_bytes(id, bytes + f.frozen(b) * f.dbytes);
        self.ops[id.index()].flops = f.frozen(b) as f64;
    }

    /// With ranks: block `b`'s working parameters gathered from every rank's shard,
    /// `shard` being this rank's, into a new host buffer (returned). Alone: `shard`.
    pub(super) fn gathered(
        &mut self,
        b: usize,
        shard: BufId,
        dir: &str,
        with_update: bool,
    ) -> BufId {
        let f = self.f;
        if f.ranks == 1 {
            return shard;
        }
        let bytes = f.ranks as u64 * f.param_shard(b) * f.pbytes;
        let into = self
            .table
            .buffer(format!("params[{b}]*{dir}@host"), Tier::Host, bytes);
        let first = self.ops.len();
        let op = CommOp::AllGather {
            block: b,
            from: shard,
            into,
            with_update,
        };
        let id = self.collective(op, vec![Access::Read(shard), Access::Write(into)]);
        self.set_bytes(id, bytes);
        if with_update {
            self.mark_update(first);
        }
        into
    }

    /// Checkpoint `i` of micro-batch `m` back to the device for the backward.
    fn fetch_checkpoint(&mut self, i: usize, m: usize) {
        let ck = &self.step.ckpts[m][i];
        let (host, bwd) = (ck.host.expect("offloaded"), ck.bwd);
        let extent = self.homes.ckpt_extent[m][i];
        self.fetch_handoff(
            format!("ckpt[{i}]#{m}"),
            (host, extent, bwd),
            self.f.act_bytes(),
        );
    }

    /// Block `b`'s offloaded saved activations of micro-batch `m` back to the device
    /// for its backward.
    fn fetch_activations(&mut self, b: usize, m: usize) {
        let saved = self.step.saved[m][b].as_ref().expect("kept");
        let (host, bwd) = (saved.host.expect("offloaded"), saved.bwd);
        let extent = self.homes.saved_extent[m][b];
        let bytes = self.step.saved_bytes[b];
        self.fetch_handoff(format!("saved[{b}]#{m}"), (host, extent, bwd), bytes);
    }

    /// `bytes` of `name` back to the device buffer `bwd`, from its host copy `host` or
    /// (read into a host stage first) its NVMe extent.
    fn fetch_handoff(
        &mut self,
        name: String,
        (host, extent, bwd): (BufId, Option<BufId>, BufId),
        bytes: u64,
    ) {
        let from = match extent {
            Some(extent) => {
                let stage = self
                    .table
                    .buffer(format!("{name}<@host"), Tier::Host, bytes);
                self.nvme_read(Lane::NvmeRead, extent, stage, bytes);
                stage
            }
            None => host,
        };
        self.copy_in(from, bwd, bytes, None, false);
    }

    /// After the forward producing checkpoint `i` of micro-batch `m`: its copy out (and
    /// on to NVMe) when it does not stay on the device.
    fn save_checkpoint(&mut self, i: usize, m: usize) {
        let ck = &self.step.ckpts[m][i];
        let (fwd, host) = (ck.fwd, ck.host);
        self.save_handoff(fwd, host, self.homes.ckpt_extent[m][i], self.f.act_bytes());
    }

    /// After block `b`'s forward of micro-batch `m`: the copy out (and on to NVMe) of
    /// its saved activations, when they are offloaded.
    fn save_activations(&mut self, b: usize, m: usize) {
        if let Some(saved) = &self.step.saved[m][b] {
            let (fwd, host) = (saved.fwd, saved.host);
            let bytes = self.step.saved_bytes[b];
            self.save_handoff(fwd, host, self.homes.saved_extent[m][b], bytes);
        }
    }

    /// `bytes` of `fwd` copied out to `host`, and on to `extent`, where they go.
    fn save_handoff(&mut self, fwd: BufId, host: Option<BufId>, extent: Option<BufId>, bytes: u64) {
        if let Some(host) = host {
            self.copy_out(fwd, host, bytes);
            if let Some(extent) = extent {
                self.nvme_write(host, extent, bytes, false);
            }
        }
    }

    /// Compute `k` of the sequence, with its buffers bound.
    fn emit_compute(&mut self, k: usize, step: Compute) {
        let f = self.f;
        let m = step.micro();
        let (block, pass, binds) = self.binds(k, step);
        // The saved forward writes the saved activations; the saved backward reads them.
        let (saved_read, saved_written) = if pass.is_forward() {
            (None, binds.saved)
        } else {
            (binds.saved, None)
        };
        let mut access: Vec<Access> = Vec::new();
        for r in [
            binds.params,
            binds.tied_params,
            binds.input,
            binds.d_output,
            binds.tokens,
            saved_read,
        ]
        .into_iter()
        .flatten()
        {
            access.push(Access::Read(r));
        }
        for w in [
            binds.grads,
            binds.tied_grads,
            binds.output,
            binds.d_input,
            binds.losses,
            saved_written,
        ]
        .into_iter()
        .flatten()
        {
            access.push(Access::Write(w));
        }
        access.push(Access::Write(self.homes.scratch));
        let op = StreamOp::Compute {
            block,
            micro: m,
            pass,
            binds,
        };
        let id = self.stream(op, access);
        self.ops[id.index()].flops = f.input.model.flops(block, pass, f.dims);
        if let Compute::Head(_) = step {
            let rows = f.dims.rows() as u64;
            self.copy_out(self.step.losses_dev[m], self.homes.losses_host[m], 4 * rows);
        }
    }

    /// Compute `k` of the sequence (`step`): its block, program and buffers.
    fn binds(&self, k: usize, step: Compute) -> (usize, Pass, Binds) {
        let (f, s) = (self.f, self.step);
        let (head, layers) = (f.head, f.layers);
        let m = step.micro();
        let params = |b: usize| s.dev_params[k][b].expect("fetched for this compute");
        let ckpt = &s.ckpts[m];
        // Packed batches: a layer finds each token's document from the ids.
        let layer_tokens = f.input.model.packing().map(|_| s.tokens_dev[m]);
        match step {
            Compute::Embed(_) => (
                0,
                Pass::Forward,
                Binds {
                    params: Some(params(0)),
                    output: Some(ckpt[0].fwd),
                    tokens: Some(s.tokens_dev[m]),
                    ..Binds::default()
                },
            ),
            Compute::Layer(b, _) => (
                b,
                if f.kept[b] {
                    Pass::ForwardSave
                } else {
                    Pass::Forward
                },
                Binds {
                    params: Some(params(b)),
                    input: Some(ckpt[b - 1].fwd),
                    output: Some(ckpt[b].fwd),
                    saved: s.saved[m][b].as_ref().map(|h| h.fwd),
                    tokens: layer_tokens,
                    ..Binds::default()
                },
            ),
            Compute::Head(_) => {
                let tied = f.input.model.tied(head);
                (
                    head,
                    Pass::Backward,
                    Binds {
                        params: Some(params(head)),
                        grads: Some(s.g_dev[m][head]),
                        tied_params: tied.map(params),
                        tied_grads: tied.map(|t| s.g_dev[m][t]),
                        input: Some(ckpt[layers].fwd),
                        d_input: Some(s.dact[m][layers]),
                        tokens: Some(s.tokens_dev[m]),
                        losses: Some(s.losses_dev[m]),
                        ..Binds::default()
                    },
                )
            }
            Compute::LayerBack(b, _) => (
                b,
                if f.kept[b] {
                    Pass::BackwardSaved
                } else {
                    Pass::Backward
                },
                Binds {
                    params: Some(params(b)),
                    grads: Some(s.g_dev[m][b]),
                    input: Some(ckpt[b - 1].bwd),
                    d_output: Some(s.dact[m][b]),
                    d_input: Some(s.dact[m][b - 1]),
                    saved: s.saved[m][b].as_ref().map(|h| h.bwd),
                    tokens: layer_tokens,
                    ..Binds::default()
                },
            ),
            Compute::EmbedBack(_) => (
                0,
                Pass::Backward,
                Binds {
                    grads: Some(s.g_dev[m][0]),
                    d_output: Some(s.dact[m][0]),
                    tokens: Some(s.tokens_dev[m]),
                    ..Binds::default()
                },
            ),
        }
    }
}

/// Bytes of this rank's shard of block `b`'s working parameters.
fn shard_bytes(f: &Frame<'_>, b: usize) -> u64 {
    f.param_shard(b) * f.pbytes
}
