//! Stage 2a of the planner: the buffers that hold a block's state between steps (its
//! working parameters, optimizer state and gradients, in device or host memory or NVMe
//! extents), the checkpoint tiers and extents, and the step's fixed buffers (the
//! scratch, tokens, losses, the norm flag).
//!
//! Data homed on NVMe that a step rewrites (working parameters, optimizer state) is
//! shadow-paged ([`ExtentKind::Shadow`]): a block's update writes its new data to a spare
//! extent of the same size, and the block's commit flips the group to it, the old extent
//! becoming the spare; NVMe holds the state once plus a spare per size (an A/B pair only
//! for working parameters a delayed update rewrites while the step still reads them).
//!
//! Not here: the step's transient buffers (`step_buffers.rs`).

use super::frame::Frame;
use super::table::BufferTable;
use crate::model::update;
use crate::plan::ir::{BufId, ExtentKind};
use crate::plan::tier::{TensorClass, Tier};

/// A block's gradients where the step leaves them: the buffers the backward fills and
/// the ones the update reads (the same but with a delayed update, or spilled), per tier.
pub(super) struct GradHomes {
    /// Device gradients the backward fills, and the set the update reads.
    pub(super) home_dev: Vec<Option<BufId>>,
    pub(super) apply_dev: Vec<Option<BufId>>,
    /// Host gradients the backward fills, and the set the update reads.
    pub(super) host: Vec<Option<BufId>>,
    pub(super) apply_host: Vec<Option<BufId>>,
    /// Per spilled block: the extent its gradients wait in for the norm, and the host
    /// buffer their statistics wait in.
    pub(super) spill: Vec<Option<BufId>>,
    pub(super) stats_spill: Vec<Option<BufId>>,
    /// Per spilled block, horizontally with micro-batches: the extent the earlier
    /// micro-batches' sum waits in between its backwards (f32); `spill`'s, unless the
    /// complete gradients wait in bf16 (each extent is written whole).
    pub(super) partial: Vec<Option<BufId>>,
    /// Per block whose gradients the device keeps: the statistics the device computes of
    /// them, and their copy on the host.
    pub(super) stats_dev: Vec<Option<BufId>>,
    pub(super) stats_host: Vec<Option<BufId>>,
}

/// Stage 2a's output.
pub(super) struct Homes {
    /// The device scratch of the compute stream's programs, and the update stream's.
    pub(super) scratch: BufId,
    pub(super) stats_scratch: BufId,
    /// Per block: (current, next) working-parameter homes; equal unless delayed or on
    /// NVMe.
    pub(super) params: Vec<(BufId, BufId)>,
    /// Per block: (current, next) optimizer-state homes.
    pub(super) state: Vec<(BufId, BufId)>,
    /// Per LoRA block whose parameters are split on NVMe ([`Frame::splits_params`]): the
    /// extent of its frozen base (`params` being its trained tail's).
    pub(super) params_base: Vec<Option<BufId>>,
    /// Per quantised block that packs its base ([`Frame::packs`]): the home of its packed
    /// image (host memory or an extent, written once at load).
    pub(super) packed: Vec<Option<BufId>>,
    pub(super) grads: GradHomes,
    /// Tier of checkpoint i (the input of block i + 1), and per micro-batch its extent
    /// when on NVMe.
    pub(super) ckpt_tier: Vec<Tier>,
    pub(super) ckpt_extent: Vec<Vec<Option<BufId>>>,
    /// Per micro-batch, per block whose saved activations are offloaded to NVMe: their
    /// extent.
    pub(super) saved_extent: Vec<Vec<Option<BufId>>>,
    /// Orders the updates after the global norm, when the step has one.
    pub(super) norm_flag: Option<BufId>,
    /// Per micro-batch: the host buffers of the tokens and targets, and of the losses.
    pub(super) tokens_host: Vec<BufId>,
    pub(super) losses_host: Vec<BufId>,
}

impl Homes {
    /// Stage 2a: homes of parameters, optimizer state and gradients, the checkpoint
    /// tiers and extents, and the fixed buffers (scratch, tokens, losses, the norm flag).
    pub(super) fn plan(f: &Frame<'_>, table: &mut BufferTable) -> Homes {
        let nb = f.nb();
        let target = f.shape.target;
        let scratch = f
            .input
            .model
            .scratch_bytes(f.dims, target, f.shape.device_dtype());
        let scratch = table.persistent("scratch@device".into(), Tier::Device, scratch as u64);
        // The update stream's own, so that statistics do not wait for the compute stream.
        let stats = update::grad_stats_scratch(f.blocks, target).max(8);
        let stats_scratch =
            table.persistent("stats-scratch@device".into(), Tier::Device, stats as u64);
        let mut homes = Homes {
            scratch,
            stats_scratch,
            params: Vec::with_capacity(nb),
            state: Vec::with_capacity(nb),
            params_base: Vec::with_capacity(nb),
            packed: Vec::with_capacity(nb),
            grads: GradHomes {
                home_dev: vec![None; nb],
                apply_dev: vec![None; nb],
                host: vec![None; nb],
                apply_host: vec![None; nb],
                spill: vec![None; nb],
                partial: vec![None; nb],
                stats_spill: vec![None; nb],
                stats_dev: vec![None; nb],
                stats_host: vec![None; nb],
            },
            ckpt_tier: Vec::new(),
            ckpt_extent: Vec::new(),
            saved_extent: Vec::new(),
            norm_flag: None,
            tokens_host: Vec::new(),
            losses_host: Vec::new(),
        };
        for b in 0..nb {
            let state = state_home(f, table, b);
            homes.state.push(state);
            let params = if f.shares_master(b) {
                // fp32 on NVMe: the master copy at the head of the state is the working one.
                state
            } else {
                params_home(f, table, b)
            };
            homes.params.push(params);
            homes.params_base.push(f.splits_params(b).then(|| {
                let bytes = f.frozen(b) * f.pbytes;
                let kind = ExtentKind::Single;
                let name = format!("params.{b}.base");
                table.extents(name, bytes, kind, b, TensorClass::Params).0
            }));
            homes
                .packed
                .push(f.packs(b).then(|| packed_home(f, table, b)));
            homes.grads.plan_block(f, table, b);
        }
        homes.checkpoints(f, table);
        if f.has_norm() {
            homes.norm_flag = Some(table.flag("global-norm"));
        }
        let rows = f.dims.rows() as u64;
        for m in 0..f.shape.grad_accum {
            let tokens = table.persistent(format!("tokens#{m}@host"), Tier::Host, 8 * rows);
            let losses = table.persistent(format!("losses#{m}@host"), Tier::Host, 4 * rows);
            homes.tokens_host.push(tokens);
            homes.losses_host.push(losses);
        }
        homes
    }

    /// Checkpoint tiers and extents: checkpoint i is the input of block i + 1; the head's
    /// input stays on the device (its forward and backward are one operation). Also the
    /// extents of saved activations offloaded to NVMe.
    fn checkpoints(&mut self, f: &Frame<'_>, table: &mut BufferTable) {
        let layers = f.layers;
        self.ckpt_tier = (0..=layers)
            .map(|i| {
                if i == layers {
                    Tier::Device
                } else {
                    f.tiers[i + 1].ckpt
                }
            })
            .collect();
        let act = f.act_bytes();
        // Horizontally the micro-batches take each extent in turn (each one's backward
        // reads it before the next one's forward writes it); vertically every
        // micro-batch's are live at once, each in its own.
        let apart = f.micro_batches_live();
        let extent = |table: &mut BufferTable, name: &str, m: usize, bytes: u64, block: usize| {
            let name = if apart > 1 {
                format!("{name}#{m}")
            } else {
                name.to_string()
            };
            let kind = ExtentKind::Single;
            table
                .extents(name, bytes, kind, block, TensorClass::Checkpoints)
                .0
        };
        let mut ckpts: Vec<Vec<Option<BufId>>> = Vec::new();
        let mut saved: Vec<Vec<Option<BufId>>> = Vec::new();
        for m in 0..apart {
            ckpts.push(
                (0..=layers)
                    .map(|i| {
                        (self.ckpt_tier[i] == Tier::Nvme)
                            .then(|| extent(table, &format!("ckpt.{i}"), m, act, i + 1))
                    })
                    .collect(),
            );
            // Saved activations offloaded to NVMe.
            saved.push(
                (0..f.nb())
                    .map(|b| {
                        (f.saved_tier[b] == Tier::Nvme)
                            .then(|| extent(table, &format!("saved.{b}"), m, f.saved_bytes(b), b))
                    })
                    .collect(),
            );
        }
        self.ckpt_extent = (0..f.shape.grad_accum)
            .map(|m| ckpts[m % apart].clone())
            .collect();
        self.saved_extent = (0..f.shape.grad_accum)
            .map(|m| saved[m % apart].clone())
            .collect();
    }
}

/// Block `b`'s optimizer state home: (current, next).
fn state_home(f: &Frame<'_>, table: &mut BufferTable, b: usize) -> (BufId, BufId) {
    let bytes = f.state_bytes(b);
    match f.tiers[b].state {
        tier @ (Tier::Device | Tier::Host) => {
            table.home_pair(&format!("adam[{b}]"), tier, bytes, false)
        }
        Tier::Nvme => table.extents(
            format!("adam.{b}"),
            bytes,
            ExtentKind::Shadow,
            b,
            TensorClass::Optimizer,
        ),
    }
}

/// Block `b`'s packed base's home, on its parameters' tier: never rewritten, so one.
fn packed_home(f: &Frame<'_>, table: &mut BufferTable, b: usize) -> BufId {
    let bytes = f.packed_bytes(b);
    match f.tiers[b].params {
        Tier::Host => table.persistent(format!("packed[{b}]@host"), Tier::Host, bytes),
        Tier::Nvme => {
            let kind = ExtentKind::Single;
            let name = format!("packed.{b}");
            table.extents(name, bytes, kind, b, TensorClass::Params).0
        }
        Tier::Device => unreachable!("a device home holds the dequantised base"),
    }
}

/// Block `b`'s working-parameter home, when not its master copy: (current, next).
fn params_home(f: &Frame<'_>, table: &mut BufferTable, b: usize) -> (BufId, BufId) {
    let (len, shard) = (f.len(b), f.param_shard(b));
    let delayed = f.shape.delayed_update;
    match f.tiers[b].params {
        // Every rank's shard is gathered into it over device memory: room for their
        // padding too.
        Tier::Device => table.home_pair(
            &format!("params[{b}]"),
            Tier::Device,
            if f.device_comm(b) {
                f.ranks as u64 * shard
            } else {
                len
            } * f.dbytes,
            delayed,
        ),
        // A LoRA block's trained tail alone where its base is stored apart (an extent of
        // its own, or packed).
        Tier::Host => table.home_pair(
            &format!("params[{b}]"),
            Tier::Host,
            if f.tail_home(b) { f.shard(b) } else { shard } * f.pbytes,
            delayed,
        ),
        Tier::Nvme => table.extents(
            format!("params.{b}"),
            if f.tail_home(b) { f.shard(b) } else { shard } * f.pbytes,
            if delayed {
                ExtentKind::Pair
            } else {
                ExtentKind::Shadow
            },
            b,
            TensorClass::Params,
        ),
    }
}

impl GradHomes {
    /// Block `b`'s gradient homes on the tier its policy names.
    fn plan_block(&mut self, f: &Frame<'_>, table: &mut BufferTable, b: usize) {
        if !f.trains(b) {
            return; // no gradients
        }
        let (len, shard) = (f.grad_len(b), f.shard(b));
        let delayed = f.shape.delayed_update;
        match f.tiers[b].grads {
            Tier::Device if f.ranks > 1 => {
                // This rank's shard of the step's gradients on the device (reduced there,
                // or on the host and copied in), and a host copy the norm reads.
                let (fill, apply) =
                    table.home_pair(&format!("grads[{b}]"), Tier::Device, 4 * shard, delayed);
                self.home_dev[b] = Some(fill);
                self.apply_dev[b] = Some(apply);
                self.plan_host(f, table, b);
            }
            Tier::Device => {
                let (fill, apply) =
                    table.home_pair(&format!("grads[{b}]"), Tier::Device, 4 * len, delayed);
                self.home_dev[b] = Some(fill);
                self.apply_dev[b] = Some(apply);
                self.stats_dev[b] =
                    Some(table.buffer(format!("stats[{b}]@device"), Tier::Device, 16));
                self.stats_host[b] =
                    Some(table.persistent(format!("stats[{b}]@host"), Tier::Host, 16));
            }
            Tier::Host => self.plan_host(f, table, b),
            Tier::Nvme => unreachable!("refused in stage 1"),
        }
    }

    /// Block `b`'s host gradients (this rank's shard): transient, or (delayed) two
    /// persistent sets, one filled by this step's backward while the update applies the
    /// other.
    fn plan_host(&mut self, f: &Frame<'_>, table: &mut BufferTable, b: usize) {
        let bytes = 4 * f.shard(b);
        let (fill, apply) = if f.shape.delayed_update {
            table.home_pair(&format!("grads[{b}]"), Tier::Host, bytes, true)
        } else if f.spill[b] {
            // Filled by the backward and written out; read back for the update. Rounded
            // to bf16, the complete gradients wait in 2 bytes each, and the earlier
            // micro-batches' sums (horizontally) in 4, in an extent of their own.
            let spilled = f.shape.grad_dtype.bytes() * f.shard(b);
            let extent = |table: &mut BufferTable, name: String, bytes| {
                let kind = ExtentKind::Single;
                table.extents(name, bytes, kind, b, TensorClass::Grads).0
            };
            let spill = extent(table, format!("grads.{b}"), spilled);
            let sums = f.shape.grad_accum > 1 && !f.vertical();
            self.spill[b] = Some(spill);
            self.partial[b] = match (sums, spilled == bytes) {
                (false, _) => None,
                (true, true) => Some(spill),
                (true, false) => Some(extent(table, format!("grads.{b}.sum"), bytes)),
            };
            self.stats_spill[b] = Some(table.buffer(format!("stats[{b}]@host"), Tier::Host, 16));
            (
                table.buffer(format!("grads[{b}]@host"), Tier::Host, bytes),
                table.buffer(format!("grads[{b}]<@host"), Tier::Host, spilled),
            )
        } else if f.grads_stay_on_device(b) {
            // The backward's own buffer, which the update reads where it is.
            let id = table.buffer(format!("grads[{b}]#0@device"), Tier::Device, bytes);
            (id, id)
        } else {
            let id = table.buffer(format!("grads[{b}]@host"), Tier::Host, bytes);
            (id, id)
        };
        self.host[b] = Some(fill);
        self.apply_host[b] = Some(apply);
    }
}
