//! [`Plan`]: the static schedule and memory plan of one training step, as the planner
//! leaves it and the executor, the cost model and the reports read it, with its read-only
//! queries (which blocks recompute, spill or keep their edges in host memory; the rules
//! a block's homes imply).
//!
//! Not here: how a plan is made (`plan/build/`), whether it fits its budgets
//! (`plan/fit.rs`), or what it costs (`plan/cost.rs`).

use super::buffers::{BufferPlan, Extent, SlotPlan};
use super::ids::{BufId, OpId};
use super::ops::Op;
use crate::lane::Lane;
use crate::plan::shape::{Schedule, StepShape};
use crate::plan::tier::{Budgets, Tier};

/// The persistent buffers of one block that hold its state between steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHomes {
    /// The working parameters the next step reads (an extent's current side when on
    /// NVMe).
    pub params: BufId,
    /// Master parameters, m and v (an extent's current side when on NVMe).
    pub state: BufId,
    /// A LoRA block's frozen base, when its parameters are on NVMe: an extent of its own
    /// (written once, at load), `params` holding the trained tail alone.
    pub params_base: Option<BufId>,
    /// A quantised LoRA block's frozen base as its packed image
    /// ([`QuantBlock`](crate::model::QuantBlock)), when its parameters are off the device:
    /// a host buffer or an extent of its own (written once, at load), `params` holding
    /// the trained tail alone.
    pub packed: Option<BufId>,
}

/// The static schedule and memory plan of one training step.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The policy it was built from.
    pub policy: String,
    /// Home tier of every block's classes, indexed by
    /// [`TensorClass`](crate::plan::TensorClass) order (params, grads, optimizer;
    /// checkpoints: of the block's input).
    pub homes: Vec<[Tier; 4]>,
    /// Per block: whether its forward keeps its saved activations for its backward,
    /// which then does not recompute the forward. False for the layer blocks that
    /// recompute, and for the blocks that save nothing (embedding, head).
    pub kept: Vec<bool>,
    /// Per block: where its kept saved activations wait between its forward and its
    /// backward: the device, or offloaded to host memory or NVMe (copied out after the
    /// forward, back in `depth` computes before the backward). The device where `kept`
    /// is false.
    pub saved_tier: Vec<Tier>,
    /// Per block: bytes of the saved activations it keeps, per micro-batch (0 where
    /// `kept` is false). Every block's kept on the device are live at once, around the
    /// head; micro-batches reuse the first one's memory.
    pub saved_bytes: Vec<u64>,
    /// Per block: whether its gradients wait for the global norm on NVMe
    /// ([`GradSpill`](crate::plan::GradSpill)) rather than in host memory.
    pub grads_spilled: Vec<bool>,
    /// Prefetch depth used.
    pub depth: usize,
    /// The step's shape.
    pub shape: StepShape,
    /// The budgets checked against.
    pub budgets: Budgets,
    /// Operations, in canonical order.
    pub ops: Vec<Op>,
    /// Each lane's operations, in order (indexed by [`Lane::index`]).
    pub lanes: [Vec<OpId>; Lane::COUNT],
    /// Logical buffers.
    pub buffers: Vec<BufferPlan>,
    /// Physical slots.
    pub slots: Vec<SlotPlan>,
    /// NVMe extent groups.
    pub extent_groups: Vec<Extent>,
    /// Spare extents for shadow paging: (bytes of each, how many), one entry per length
    /// of the shadow-paged groups, as many as one block's commit can hold at once.
    pub spares: Vec<(u64, usize)>,
    /// Peak bytes per tier ([`Tier::index`]): the sum of the tier's slots (and extents).
    pub peak: [u64; 3],
    /// Bytes per step over each link: NVMe read, NVMe write, H2D, D2H.
    pub link_bytes: [u64; 4],
    /// Each block's persistent state buffers.
    pub block_homes: Vec<BlockHomes>,
    /// Per block: elements of this rank's shard of its parameters, gradients and
    /// optimizer state ([`shard_len`](crate::plan::shard_len); the block's length with one rank).
    pub shard_len: Vec<u64>,
    /// Per micro-batch: the host buffer the executor writes the tokens and targets into
    /// before a step.
    pub tokens_host: Vec<BufId>,
    /// Per micro-batch: the host buffer the step leaves the per-position losses in.
    pub losses_host: Vec<BufId>,
    /// Per block: the host buffer holding the statistics of its device gradients after
    /// an update, when the device computes them.
    pub stats_host: Vec<Option<BufId>>,
    /// The device scratch every program of the compute stream runs in.
    pub scratch: BufId,
    /// The device scratch of the gradient statistics on the update stream.
    pub stats_scratch: BufId,
    /// Delayed update: pairs of persistent buffers (gradients being filled, gradients
    /// being applied) whose memory the executor exchanges after every step.
    pub swap_each_step: Vec<(BufId, BufId)>,
    /// Delayed update: pairs of persistent homes (working parameters read by this step,
    /// written by its update) exchanged after every step that applied an update.
    pub swap_on_update: Vec<(BufId, BufId)>,
}

impl Plan {
    /// Operation `id`.
    pub fn op(&self, id: OpId) -> &Op {
        &self.ops[id.index()]
    }

    /// Buffer `id`.
    pub fn buffer(&self, id: BufId) -> &BufferPlan {
        &self.buffers[id.index()]
    }

    /// Whether block `b`'s working parameters are its fp32 master copy, kept once at the
    /// head of its NVMe optimizer state (master, m, v) and fetched from there: with
    /// both on NVMe in fp32 and no delayed update. Every write of NVMe optimizer state
    /// also checksums that head, so it can be read and verified alone.
    pub fn shares_master(&self, b: usize) -> bool {
        self.shape.shares_master(self.homes[b][0], self.homes[b][2])
    }

    /// Whether block `b`'s collectives run over device memory
    /// ([`StepShape::device_collectives`]): then its device update writes its shard of
    /// the new parameters in the device's dtype, gathered there.
    pub fn device_comm(&self, b: usize) -> bool {
        self.shape.device_comm(self.homes[b][2])
    }

    /// Whether the first and last blocks' optimizer state is in host memory and their
    /// parameters off NVMe while some other block's state is on NVMe
    /// ([`Policy::resident_edges`](crate::plan::Policy::resident_edges)).
    pub fn edges_on_host(&self) -> bool {
        let nb = self.homes.len();
        let off = |b: usize| self.homes[b][0] != Tier::Nvme && self.homes[b][2] == Tier::Host;
        off(0) && off(nb - 1) && self.homes.iter().any(|h| h[2] == Tier::Nvme)
    }

    /// What [`Plan::edges_on_host`] means for this plan, in words (none when it is not).
    pub fn edges_text(&self) -> Option<String> {
        self.edges_on_host().then(|| {
            let on_device = self.homes[0][0] == Tier::Device;
            let last = self.homes.len() - 1;
            if self.shard_len[0] == 0 && self.shard_len[last] == 0 {
                // They train nothing (a LoRA model's): their parameters alone stay.
                let tier = if on_device {
                    "on the device"
                } else {
                    "in host memory"
                };
                return format!(
                    "the embedding's and the head's parameters stay {tier} (their NVMe \
                     traffic could not hide under compute)"
                );
            }
            let params = if on_device {
                "their parameters on the device"
            } else {
                "their parameters too"
            };
            format!(
                "the embedding's and the head's optimizer state stay in host memory, \
                 {params} (their NVMe traffic could not hide under compute)"
            )
        })
    }

    /// Whether block `b`'s gradients can wait for the norm on NVMe
    /// ([`GradSpill`](crate::plan::GradSpill)): its optimizer state is there, and the step
    /// has the norm barrier, one rank and no delayed update.
    pub fn can_spill(&self, b: usize) -> bool {
        self.shape.can_spill(self.homes[b][2])
    }

    /// Whether each step ends by fetching the next step's first parameters
    /// ([`StepShape::prefetch_next_step`](crate::plan::StepShape::prefetch_next_step)):
    /// some operation does.
    pub fn fetches_next_step(&self) -> bool {
        self.ops.iter().any(|op| op.next_step)
    }

    /// Blocks whose gradients wait for the norm on NVMe.
    pub fn spilled(&self) -> usize {
        self.grads_spilled.iter().filter(|&&s| s).count()
    }

    /// Layer blocks that recompute their forward in the backward.
    pub fn recomputed(&self) -> usize {
        (1..self.kept.len().saturating_sub(1))
            .filter(|&b| !self.kept[b])
            .count()
    }

    /// Bytes of saved activations the plan keeps on the device at once: every block's
    /// kept there, of one micro-batch.
    pub fn saved_total_bytes(&self) -> u64 {
        self.saved_in(Tier::Device)
    }

    /// Bytes of one micro-batch's saved activations that wait in `tier`.
    pub fn saved_in(&self, tier: Tier) -> u64 {
        (0..self.saved_bytes.len())
            .filter(|&b| self.saved_tier[b] == tier)
            .map(|b| self.saved_bytes[b])
            .sum()
    }

    /// Layer blocks whose saved activations are offloaded (to host memory or NVMe).
    pub fn offloaded(&self) -> usize {
        self.offloaded_to(Tier::Host) + self.offloaded_to(Tier::Nvme)
    }

    /// Layer blocks whose saved activations are offloaded to `tier` (host memory or
    /// NVMe).
    fn offloaded_to(&self, tier: Tier) -> usize {
        self.saved_tier.iter().filter(|&&t| t == tier).count()
    }

    /// "3 of 12 blocks": how many layer blocks recompute their forward, of how many;
    /// and where any offload their saved activations, how many ("3 of 12 blocks, 6
    /// offloaded to host").
    pub fn recomputed_of(&self) -> String {
        let mut text = format!(
            "{} of {} blocks",
            self.recomputed(),
            self.kept.len().saturating_sub(2)
        );
        for tier in [Tier::Host, Tier::Nvme] {
            let n = self.offloaded_to(tier);
            if n > 0 {
                text += &format!(", {n} offloaded to {tier}");
            }
        }
        text
    }

    /// The order of the micro-batches, in words: "schedule: vertical (each of 8
    /// micro-batches through a block before the next block)".
    pub fn schedule_text(&self) -> String {
        let k = self.shape.grad_accum;
        match self.shape.schedule {
            Schedule::Vertical => format!(
                "schedule: vertical (each of {k} micro-batches through a block before the next block)"
            ),
            _ => format!(
                "schedule: horizontal (each of {k} micro-batches through the whole model in turn)"
            ),
        }
    }

    /// "recompute: 3 of 12 blocks" (see [`Plan::recomputed_of`]).
    pub fn recompute_summary(&self) -> String {
        format!("recompute: {}", self.recomputed_of())
    }
}
