//! Stage 1 of the planner: the step's shape and every block's homes, checked against the
//! engine's rules, with what follows from them (shard lengths, element sizes, the rules a
//! block's tiers imply). The [`Frame`] is what every later stage reads and none writes.
//!
//! Not here: any buffer or operation (stages 2 and 3), or the choice of which blocks keep
//! their activations and spill their gradients (`search.rs`, which hands its choice to
//! the frame).

use crate::model::{BlockLayout, Dtype, QuantBlock, Shape, StateLayout, Target};
use crate::plan::error::PlanError;
use crate::plan::policy::{PlanInput, Policy};
use crate::plan::shape::{GradDtype, Precision, Schedule, StepShape, shard_len};
use crate::plan::tier::{TensorClass, Tier};

/// One block's homes, resolved and checked.
pub(super) struct BlockTiers {
    pub(super) params: Tier,
    pub(super) grads: Tier,
    pub(super) state: Tier,
    /// Of the block's input checkpoint (transformer blocks only).
    pub(super) ckpt: Tier,
}

/// The step as every stage of the planner sees it.
pub(super) struct Frame<'a> {
    pub(super) input: &'a PlanInput<'a>,
    pub(super) policy: &'a dyn Policy,
    /// The policy's name.
    pub(super) name: String,
    /// The step's shape (with ranks, always with the global norm).
    pub(super) shape: StepShape,
    pub(super) dims: Shape,
    /// Prefetch depth, at least 1.
    pub(super) depth: usize,
    pub(super) blocks: &'a [BlockLayout],
    pub(super) tiers: Vec<BlockTiers>,
    /// Index of the head block.
    pub(super) head: usize,
    /// Transformer blocks.
    pub(super) layers: usize,
    /// Processes training together, and each block's shard length (elements) of its
    /// gradients and optimizer state: of the elements that train
    /// ([`BlockLayout::trained`]; all of them but a LoRA model's frozen base).
    pub(super) ranks: usize,
    pub(super) shard: Vec<u64>,
    /// Each block's shard length of its working parameters (the block's length alone).
    pub(super) param_shard: Vec<u64>,
    /// Bytes of a working parameter on the host, and of a device element.
    pub(super) pbytes: u64,
    pub(super) dbytes: u64,
    /// Per block: whether it keeps its saved activations (the search's choice).
    pub(super) kept: Vec<bool>,
    /// Per block: where its kept saved activations wait from its forward to its
    /// backward: the device, or offloaded to host memory or NVMe (the search's choice).
    pub(super) saved_tier: Vec<Tier>,
    /// Per block: whether its gradients are spilled to NVMe for the norm.
    pub(super) spill: Vec<bool>,
    /// Per block of a quantised model whose parameters are off the device: its frozen
    /// base's packed image ([`Frame::packs`]).
    pub(super) quant: Vec<Option<QuantBlock>>,
}

impl<'a> Frame<'a> {
    /// Stage 1: the step's shape and every block's homes, checked; no block keeps its
    /// activations or spills its gradients until told ([`Frame::keeping`],
    /// [`Frame::spilling`]).
    pub(super) fn new(input: &'a PlanInput<'a>, policy: &'a dyn Policy) -> Result<Self, PlanError> {
        let name = policy.name();
        let mut shape = input.shape;
        // With ranks the norm is always the global one, computed with every rank's
        // shards (the reports' norm is the step's, not a shard's).
        if shape.ranks > 1 {
            shape.needs_global_norm = true;
        }
        if shape.batch == 0 || shape.seq == 0 || shape.grad_accum == 0 {
            return Err(PlanError::Invalid(
                "batch, sequence length and gradient accumulation must be at least 1".into(),
            ));
        }
        let dims = input
            .model
            .shape(shape.batch, shape.seq)
            .map_err(|e| PlanError::Invalid(e.to_string()))?;
        let blocks = input.model.blocks();
        let nb = blocks.len();
        let tiers = (0..nb)
            .map(|b| block_tiers(input, policy, &name, b))
            .collect::<Result<Vec<_>, _>>()?;
        if shape.ranks == 0 {
            return Err(PlanError::Invalid("ranks must be at least 1".into()));
        }
        check_frozen(blocks, &shape)?;
        check_quant(input, &shape)?;
        check_grad_dtype(&shape)?;
        check_approximation(input, &shape)?;
        Ok(Frame {
            input,
            policy,
            name,
            shape,
            dims,
            depth: policy.prefetch_depth(input).max(1),
            blocks,
            head: nb - 1,
            layers: nb - 2,
            ranks: shape.ranks,
            shard: blocks
                .iter()
                .map(|b| shard_len(b.trained_len(), shape.ranks) as u64)
                .collect(),
            param_shard: blocks
                .iter()
                .map(|b| shard_len(b.len, shape.ranks) as u64)
                .collect(),
            pbytes: shape.precision.param_bytes(),
            dbytes: shape.device_dtype().size() as u64,
            kept: vec![false; nb],
            saved_tier: vec![Tier::Device; nb],
            spill: vec![false; nb],
            quant: (0..nb)
                .map(|b| {
                    let off_device = tiers[b].params != Tier::Device;
                    let dtype = shape.device_dtype();
                    off_device
                        .then(|| input.model.quant_block(b, dtype))
                        .flatten()
                })
                .collect(),
            tiers,
        })
    }

    /// The same frame with the layer blocks marked in `kept` keeping their saved
    /// activations, those also marked in `offloaded` off the device between the forward
    /// and the backward: in host memory, or on NVMe where the policy puts the block's
    /// input checkpoint. A block whose backward comes within
    /// [`Frame::saved_ahead`]` + 1` computes of its forward (`apart`, of a layer block:
    /// the compute sequence's `forward_to_backward`) keeps them on the device all the
    /// same: fetched back that far ahead, they would be on the device again as soon as
    /// they had left it.
    pub(super) fn keeping(
        self,
        kept: Vec<bool>,
        offloaded: &[bool],
        apart: impl Fn(usize) -> usize,
    ) -> Self {
        let saved_tier = (0..self.nb())
            .map(|b| {
                let tier = match self.tiers[b].ckpt {
                    Tier::Nvme => Tier::Nvme,
                    _ => Tier::Host,
                };
                let off = kept[b] && offloaded[b] && apart(b) > self.saved_ahead(tier) + 1;
                if off { tier } else { Tier::Device }
            })
            .collect();
        Frame {
            kept,
            saved_tier,
            ..self
        }
    }

    /// How many computes ahead of its backward a block's saved activations offloaded to
    /// `tier` are fetched back: from host memory one (a copy, shorter than a block's
    /// backward, so that only two blocks' are on the device at once), from NVMe the
    /// prefetch depth, as parameters are.
    pub(super) fn saved_ahead(&self, tier: Tier) -> usize {
        if tier == Tier::Nvme { self.depth } else { 1 }
    }

    /// The same frame with every block that can spilling its gradients to NVMe (when
    /// `spill`).
    pub(super) fn spilling(self, spill: bool) -> Self {
        if !spill {
            return self;
        }
        let spill = (0..self.nb())
            .map(|b| self.trains(b) && self.shape.can_spill(self.tiers[b].state))
            .collect();
        Frame { spill, ..self }
    }

    /// Blocks.
    pub(super) fn nb(&self) -> usize {
        self.blocks.len()
    }

    /// Elements of block `b`.
    pub(super) fn len(&self, b: usize) -> u64 {
        self.blocks[b].len as u64
    }

    /// Bytes of a rank's shard of block `b`'s optimizer state (the most of any rank's).
    pub(super) fn state_bytes(&self, b: usize) -> u64 {
        StateLayout::shard_bytes(
            self.shape.optimizer_state,
            &self.blocks[b],
            self.shard[b] as usize,
            self.ranks,
        ) as u64
    }

    /// Elements of this rank's shard of block `b`'s gradients and optimizer state (with
    /// one rank, the elements that train).
    pub(super) fn shard(&self, b: usize) -> u64 {
        self.shard[b]
    }

    /// Elements of this rank's shard of block `b`'s working parameters (its length with
    /// one rank).
    pub(super) fn param_shard(&self, b: usize) -> u64 {
        self.param_shard[b]
    }

    /// Elements of block `b`'s gradients on the device, each micro-batch's: those that
    /// train ([`BlockLayout::trained_len`]; the whole block but a LoRA model's base).
    pub(super) fn grad_len(&self, b: usize) -> u64 {
        self.blocks[b].trained_len() as u64
    }

    /// Elements of block `b`'s frozen base (0 unless a LoRA model's).
    pub(super) fn frozen(&self, b: usize) -> u64 {
        self.blocks[b].frozen as u64
    }

    /// Whether block `b`'s parameters on NVMe are two extents: its frozen base, written
    /// once at load, and its trained tail, which each update rewrites (a LoRA model's
    /// adapted block; its tail starts at a multiple of 4 KiB, `TRAINED_ALIGN_ELEMENTS`).
    pub(super) fn splits_params(&self, b: usize) -> bool {
        self.tiers[b].params == Tier::Nvme
            && self.blocks[b].frozen > 0
            && self.trains(b)
            && !self.packs(b)
    }

    /// Whether block `b`'s frozen base is stored as a packed image of its own, in host
    /// memory or on NVMe, written once at load: a quantised model's adapted block whose
    /// parameters live off the device. Its fetch copies the image to the device and
    /// dequantises it there into the base's elements; its parameter home holds the
    /// trained tail alone, which goes past the base.
    pub(super) fn packs(&self, b: usize) -> bool {
        self.quant[b].is_some()
    }

    /// Bytes of block `b`'s packed base (0 unless it [`packs`](Self::packs)).
    pub(super) fn packed_bytes(&self, b: usize) -> u64 {
        self.quant[b].as_ref().map_or(0, |q| q.bytes() as u64)
    }

    /// Whether block `b`'s parameter home holds its trained tail alone (its base stored
    /// apart: split on NVMe, or packed).
    pub(super) fn tail_home(&self, b: usize) -> bool {
        self.splits_params(b) || self.packs(b)
    }

    /// Whether block `b` trains at all: a LoRA model's embedding and head, and a layer
    /// no adapter targets, do not (no gradients, optimizer state, update or norm share).
    pub(super) fn trains(&self, b: usize) -> bool {
        self.blocks[b].trains()
    }

    /// Bytes of block `b`'s saved activations of one micro-batch (0 unless it keeps
    /// them).
    pub(super) fn saved_bytes(&self, b: usize) -> u64 {
        if !self.kept[b] {
            return 0;
        }
        let (target, dtype) = (self.shape.target, self.shape.device_dtype());
        self.input.model.saved_bytes(b, self.dims, target, dtype) as u64
    }

    /// Bytes of one activation (B, T, width) on the device.
    pub(super) fn act_bytes(&self) -> u64 {
        (self.dims.rows() * self.input.model.width()) as u64 * self.dbytes
    }

    /// Whether the step waits for the global norm before its updates (then the plan has
    /// a norm flag).
    pub(super) fn has_norm(&self) -> bool {
        self.shape.needs_global_norm
    }

    /// Whether block `b`'s working parameters are its fp32 master copy, read from the
    /// head of its NVMe optimizer state (see
    /// [`Plan::shares_master`](crate::plan::Plan::shares_master)).
    pub(super) fn shares_master(&self, b: usize) -> bool {
        self.blocks[b].frozen == 0
            && self
                .shape
                .shares_master(self.tiers[b].params, self.tiers[b].state)
    }

    /// Whether block `b`'s collectives run over device memory (see
    /// [`Plan::device_comm`](crate::plan::Plan::device_comm)).
    pub(super) fn device_comm(&self, b: usize) -> bool {
        self.shape.device_comm(self.tiers[b].state)
    }

    /// How working parameters convert on their way to the device.
    pub(super) fn param_conversion(&self) -> Option<(Dtype, Dtype)> {
        let (host, device) = (self.shape.precision.dtype(), self.shape.device_dtype());
        (host != device).then_some((host, device))
    }

    /// Whether the CPU optimizer writes block `b`'s new working parameters straight into
    /// their device home, with no host staging and no copy: on the CPU device, whose
    /// memory is host memory, for a device-homed block whose state the CPU updates, when
    /// the working parameters are the bytes the device computes with (no conversion) and
    /// the whole block's (alone).
    pub(super) fn update_writes_device(&self, b: usize) -> bool {
        self.shape.target == Target::Cpu
            && self.tiers[b].params == Tier::Device
            && self.tiers[b].state != Tier::Device
            && self.ranks == 1
            && self.param_conversion().is_none()
    }

    /// Whether block `b`'s update writes its new working parameters into a host stage
    /// of their own, from which they go on to their home: NVMe (unless the master copy
    /// is the working one), or the device when the CPU updates them (unless it writes
    /// the device's memory, [`Self::update_writes_device`]) or, with ranks and
    /// collectives staged through the host, to be gathered there.
    pub(super) fn stages_new_params(&self, b: usize) -> bool {
        let t = &self.tiers[b];
        ((t.params == Tier::Nvme && !self.shares_master(b))
            || (t.params == Tier::Device
                && (t.state != Tier::Device || (self.ranks > 1 && !self.shape.device_collectives))))
            && !self.update_writes_device(b)
    }

    /// Whether the CPU optimizer reads block `b`'s host-homed gradients from the device
    /// buffer the backward wrote them into, with no copy to the host: on the CPU device,
    /// whose memory is host memory, when that buffer holds the step's whole gradients
    /// (one micro-batch, alone) and the update follows the backward (no global-norm
    /// barrier, which would hold every block's gradients in device memory until the
    /// backward ends; no delayed update). The buffer then lives until the update. A
    /// GPU's are copied.
    pub(super) fn grads_stay_on_device(&self, b: usize) -> bool {
        self.shape.target == Target::Cpu
            && self.ranks == 1
            && self.shape.grad_accum == 1
            && !self.shape.needs_global_norm
            && !self.shape.delayed_update
            && !self.spill[b]
    }

    /// Whether block `b`'s parameters go from NVMe straight into the device buffer of a
    /// fetch (`from_state`: whether the fetch takes them from the state read instead),
    /// with no host staging and no host-to-device copy: on the CPU device, whose memory
    /// is host memory that the NVMe tier can read into, when the bytes on NVMe are the
    /// bytes the device computes with (no conversion) and this rank's shard is the whole
    /// block (alone). On a GPU, which the NVMe tier cannot reach, they are staged.
    pub(super) fn reads_into_device(&self, b: usize, from_state: bool) -> bool {
        !from_state
            && self.tiers[b].params == Tier::Nvme
            && self.ranks == 1
            && self.param_conversion().is_none()
            && self.shape.target == Target::Cpu
    }

    /// Whether the backward that completes block `b`'s gradients takes its parameters
    /// from the state read for the block's update instead of reading them from NVMe
    /// again: when the fp32 master copy heads the NVMe state ([`Self::shares_master`])
    /// and that read is emitted `depth` computes before that backward, as the backward's
    /// fetch is (no global-norm barrier, no delayed update). Each such block's backward
    /// then reads 12 bytes per parameter from NVMe instead of 4 + 12.
    pub(super) fn state_feeds_backward(&self, b: usize) -> bool {
        self.shares_master(b) && !self.has_norm()
    }

    /// How many micro-batches' checkpoints (and offloaded activations) wait for their
    /// backward at once: every one of the step's with the vertical schedule, else one.
    pub(super) fn micro_batches_live(&self) -> usize {
        if self.vertical() {
            self.shape.grad_accum
        } else {
            1
        }
    }

    /// Whether the step runs its micro-batches vertically: each block's computes of
    /// every micro-batch one after another.
    pub(super) fn vertical(&self) -> bool {
        self.shape.schedule == Schedule::Vertical
    }
}

/// Gradients rounded to bf16 only where the step trains in bf16, alone.
fn check_grad_dtype(shape: &StepShape) -> Result<(), PlanError> {
    if shape.grad_dtype == GradDtype::Fp32 {
        return Ok(());
    }
    if shape.precision != Precision::Bf16 {
        return Err(PlanError::Invalid(format!(
            "bf16 gradients need bf16 training (--dtype bf16); this step trains in {}: \
             use --grad-dtype fp32",
            shape.precision
        )));
    }
    if shape.ranks > 1 {
        return Err(PlanError::Invalid(
            "bf16 gradients are for one process: with ranks, gradients are reduced in f32; \
             use --grad-dtype fp32"
                .into(),
        ));
    }
    Ok(())
}

/// A model with frozen parameters (LoRA) trains alone, for now: its frozen base is not
/// sharded among ranks.
fn check_frozen(blocks: &[BlockLayout], shape: &StepShape) -> Result<(), PlanError> {
    if shape.ranks > 1 && blocks.iter().any(|b| b.frozen > 0) {
        return Err(PlanError::Invalid(
            "a LoRA model trains in one process: training its adapters among ranks is not \
             built yet; run strata train alone (not under mpirun -np N)"
                .into(),
        ));
    }
    Ok(())
}

/// A quantised base only where its dequantised values have a working dtype to go to:
/// fp32 or bf16 training (not fp16's).
fn check_quant(input: &PlanInput<'_>, shape: &StepShape) -> Result<(), PlanError> {
    match input.model.base_quant() {
        Some(quant) if shape.precision == Precision::Fp16 => Err(PlanError::Invalid(format!(
            "--quant {quant}: a quantised base trains in fp32 or bf16 (its values are \
             dequantised into the working dtype as bitsandbytes' are into its compute \
             dtype); use --dtype bf16"
        ))),
        _ => Ok(()),
    }
}

/// Randomized weight gradients only where activations are f32: their kernels take f32
/// alone (the CPU device computes in f32 whatever the working dtype; a GPU in it).
fn check_approximation(input: &PlanInput<'_>, shape: &StepShape) -> Result<(), PlanError> {
    let approx = input.model.approximation();
    if approx.sketches() && shape.target == Target::Cuda && shape.precision != Precision::Fp32 {
        return Err(PlanError::Invalid(format!(
            "--approx-backward {approx}: randomized weight gradients are built for f32 \
             activations, and a GPU training in {} computes in it; train with --dtype fp32, \
             or leave attn, mlp and linear out",
            shape.precision
        )));
    }
    Ok(())
}

/// Block `b`'s homes as `policy` names them, checked: gradients never on NVMe, and on
/// the device exactly when the optimizer state is, whose parameters are there too.
fn block_tiers(
    input: &PlanInput<'_>,
    policy: &dyn Policy,
    name: &str,
    b: usize,
) -> Result<BlockTiers, PlanError> {
    let bad = |reason: String| PlanError::BadPolicy {
        policy: name.to_string(),
        reason,
    };
    let mut t = BlockTiers {
        params: policy.home(input, b, TensorClass::Params),
        grads: policy.home(input, b, TensorClass::Grads),
        state: policy.home(input, b, TensorClass::Optimizer),
        ckpt: policy.home(input, b, TensorClass::Checkpoints),
    };
    let block = &input.model.blocks()[b];
    if !block.trains() {
        // Nothing to hold: an empty host home, and no gradients at all.
        (t.grads, t.state) = (Tier::Host, Tier::Host);
    }
    if t.grads == Tier::Nvme {
        return Err(bad(format!("block {b}: gradients cannot live on NVMe")));
    }
    if (t.state == Tier::Device) != (t.grads == Tier::Device) {
        return Err(bad(format!(
            "block {b}: gradients must live with the optimizer state's tier when that \
             is the device, and on the host otherwise (got gradients on {}, state on {})",
            t.grads, t.state
        )));
    }
    if t.state == Tier::Device && t.params != Tier::Device {
        return Err(bad(format!(
            "block {b}: optimizer state on the device needs the parameters there too"
        )));
    }
    let format = input.shape.optimizer_state;
    if t.state == Tier::Device && !format.is_fp32() {
        use crate::plan::policy::BuiltinPolicy::{CpuOffload, NvmeOffload, ParamOffload};
        return Err(bad(format!(
            "block {b}: {format} optimizer state is updated by the CPU, and this policy \
             keeps it on the device, where AdamW keeps fp32 moments; choose a policy that \
             keeps it in host memory or on NVMe ({CpuOffload}, {ParamOffload}, \
             {NvmeOffload}, or auto)"
        )));
    }
    Ok(t)
}
