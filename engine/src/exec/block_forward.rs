//! A model's forward pass a block at a time, for evaluating a model larger than memory:
//! each block's parameters are read (from wherever they live, through the caller) into
//! one parameter slot just before the block runs, and dropped after it; the head's tied
//! block (GPT-2's embedding) is read again beside the head's own. Memory: a parameter
//! slot of the largest block (or of the head and the block it ties), two activations (block boundaries alternate between
//! them), the tokens, losses and scratch of one batch, and a staging buffer of one block,
//! instead of [`Runner`](super::Runner)'s whole model, its gradients and every
//! boundary's activation. The same programs run as in the runner's forward, on the same
//! inputs: the loss is the same bits.
//!
//! Not here: the backward, or working precisions other than f32 (the CPU device's).

use strata_kernels::program::{Dtype, Scalars, Target};

use crate::device::{Bindings, CpuDevice, CpuDeviceConfig, Device, DeviceRange, Program};
use crate::device::{bytes_of, cast};
use crate::lane::Lane;
use crate::memory::{ARENA_ALIGN, DeviceBuffer, HostArena};
use crate::model::{Bind, Model, ModelError, Pass, Shape};

/// A model's forward, a block's parameters resident at a time, on a CPU device of its
/// own.
pub struct BlockForward {
    model: Model,
    device: Device,
    shape: Shape,
    _memory: DeviceBuffer,
    staging: HostArena,
    /// The running block's parameters, then (at [`tied_offset`]) its tied block's.
    params: DeviceRange,
    /// Block boundaries, alternating: block b reads `acts[(b + 1) % 2]`, writes
    /// `acts[b % 2]`.
    acts: [DeviceRange; 2],
    tokens: DeviceRange,
    losses: DeviceRange,
    scratch: DeviceRange,
    forward: Vec<Program>,
}

/// What a [`BlockForward`] allocates.
struct Layout {
    shape: Shape,
    /// Its device memory's parts: parameters, two activations, tokens, losses, scratch.
    sizes: [usize; 6],
    /// Where each starts (aligned).
    offsets: [usize; 6],
    /// Their sum, each part aligned (at least 1 byte).
    device_bytes: usize,
    /// Its pinned staging.
    staging_bytes: usize,
}

impl Layout {
    fn of(model: &Model, batch: usize, seq: usize) -> Result<Self, ModelError> {
        let shape = model.shape(batch, seq)?;
        let (target, dtype) = (Target::Cpu, Dtype::F32);
        let largest = model.blocks().iter().map(|b| b.len).max().unwrap_or(0);
        // The running block's parameters, and after them its tied block's: the most any
        // block needs (the head and the embedding it ties, or the embedding alone).
        let params_bytes = (0..model.blocks().len())
            .map(|b| tied_offset(model, b) + model.tied(b).map_or(0, |t| 4 * model.blocks()[t].len))
            .max()
            .unwrap_or(0);
        let act = shape.rows() * model.width() * 4;
        let sizes = [
            params_bytes,
            act,
            act,
            8 * shape.rows(),
            4 * shape.rows(),
            model.scratch_bytes(shape, target, dtype),
        ];
        let mut offsets = [0usize; 6];
        let mut at = 0;
        for (o, &len) in offsets.iter_mut().zip(&sizes) {
            *o = at;
            at = (at + len).next_multiple_of(ARENA_ALIGN);
        }
        Ok(Layout {
            shape,
            sizes,
            offsets,
            device_bytes: at.max(1),
            staging_bytes: (4 * largest).max(8 * shape.rows()),
        })
    }
}

impl BlockForward {
    /// The forward of `model` for batches of `batch` × `seq` on a CPU device sized for
    /// it (f32).
    pub fn on_cpu(model: Model, batch: usize, seq: usize) -> Result<Self, ModelError> {
        let layout = Layout::of(&model, batch, seq)?;
        let (target, dtype) = (Target::Cpu, Dtype::F32);
        let (shape, next) = (layout.shape, layout.device_bytes);
        let device = Device::Cpu(CpuDevice::new(CpuDeviceConfig {
            memory_budget_bytes: next,
            ..Default::default()
        })?);
        let memory = device.alloc(next).map_err(ModelError::Device)?;
        let base = memory.arena_offset_bytes();
        let r = |i: usize| DeviceRange::new(base + layout.offsets[i], layout.sizes[i]);
        let staging = HostArena::new(
            "block forward staging",
            layout.staging_bytes,
            &device.pinning(),
        )
        .map_err(ModelError::Device)?;
        let forward = (0..model.blocks().len())
            .map(|b| model.program(b, Pass::Forward, shape, target, dtype).into())
            .collect();
        Ok(BlockForward {
            params: r(0),
            acts: [r(1), r(2)],
            tokens: r(3),
            losses: r(4),
            scratch: r(5),
            _memory: memory,
            staging,
            forward,
            model,
            device,
            shape,
        })
    }

    /// The memory [`BlockForward::on_cpu`] holds for `model` and batches of `batch` ×
    /// `seq`: its CPU device's memory (a block's parameters and its tied block's, two
    /// blocks' boundary activations, the tokens, the losses, a block's scratch) and its
    /// pinned staging, all RAM.
    pub fn memory_bytes(model: &Model, batch: usize, seq: usize) -> Result<u64, ModelError> {
        let layout = Layout::of(model, batch, seq)?;
        Ok((layout.device_bytes + layout.staging_bytes) as u64)
    }

    /// Copies `bytes` to the front of `dst` and waits.
    fn upload(&self, bytes: &[u8], dst: DeviceRange) -> Result<(), ModelError> {
        let dst = DeviceRange::new(dst.offset_bytes, bytes.len());
        super::runner::upload_staged(&self.device, &self.staging, bytes, dst, None)
    }

    /// Block `b`'s parameters, `read(b)`, into `slot`.
    fn load(
        &self,
        b: usize,
        slot: DeviceRange,
        read: &dyn Fn(usize) -> Result<Vec<f32>, ModelError>,
    ) -> Result<(), ModelError> {
        let params = read(b)?;
        let len = self.model.blocks()[b].len;
        if params.len() != len {
            return Err(ModelError::BadInput(format!(
                "block {b}'s parameters have {} values, not the model's {len}",
                params.len()
            )));
        }
        self.upload(bytes_of(&params), slot)
    }

    /// Runs every block forward on `tokens` (B × T, row-major), block `b`'s parameters
    /// being `read(b)` (the tied block's read again for the block that ties it), and
    /// returns the mean cross-entropy against `targets`, as
    /// [`Runner::forward`](super::Runner::forward) does.
    pub fn forward(
        &self,
        tokens: &[u32],
        targets: &[u32],
        read: &dyn Fn(usize) -> Result<Vec<f32>, ModelError>,
    ) -> Result<f32, ModelError> {
        let ids = super::runner::batch_ids(&self.model, self.shape, tokens, targets)?;
        self.upload(bytes_of(&ids), self.tokens)?;
        for b in 0..self.model.blocks().len() {
            self.load(b, self.params, read)?;
            if let Some(t) = self.model.tied(b) {
                self.load(t, self.tied_params(b), read)?;
            }
            let program = &self.forward[b];
            self.device
                .run_program(
                    Lane::Compute,
                    program,
                    &self.bindings(b),
                    &Scalars::default(),
                    &[],
                )
                .and_then(|e| e.wait())
                .map_err(ModelError::Device)?;
        }
        let bytes = super::runner::download_staged(&self.device, &self.staging, self.losses)?;
        let sum: f64 = cast::<f32>(&bytes).iter().map(|&l| f64::from(l)).sum();
        Ok((sum / super::runner::counted_targets(targets) as f64) as f32)
    }

    /// Where block `b`'s tied block's parameters go, after its own.
    fn tied_params(&self, b: usize) -> DeviceRange {
        let t = self.model.tied(b).expect("a block that ties another");
        let len = 4 * self.model.blocks()[t].len;
        self.params.sub(tied_offset(&self.model, b), len)
    }

    /// Bindings of block `b`'s forward.
    fn bindings(&self, b: usize) -> Bindings {
        let rows = self.shape.rows();
        let mut out = Bindings::default();
        let len = self.model.blocks()[b].len;
        out.set(Bind::Params as u8, self.params.sub(0, 4 * len));
        if self.model.tied(b).is_some() {
            out.set(Bind::TiedParams as u8, self.tied_params(b));
        }
        out.set(Bind::Scratch as u8, self.scratch);
        out.set(Bind::Tokens as u8, self.tokens.sub(0, 4 * rows));
        out.set(Bind::Targets as u8, self.tokens.sub(4 * rows, 4 * rows));
        out.set(Bind::Losses as u8, self.losses);
        if b > 0 {
            out.set(Bind::Input as u8, self.acts[(b + 1) % 2]);
        }
        if b <= self.model.layers() {
            out.set(Bind::Output as u8, self.acts[b % 2]);
        }
        out
    }
}

/// The offset of block `b`'s tied block's parameters in the parameter slot: after its
/// own, aligned.
fn tied_offset(model: &Model, b: usize) -> usize {
    (4 * model.blocks()[b].len).next_multiple_of(ARENA_ALIGN)
}

impl Drop for BlockForward {
    fn drop(&mut self) {
        if let Err(e) = self.device.synchronize() {
            log::error!("draining the device before dropping a block forward failed: {e}");
        }
    }
}
