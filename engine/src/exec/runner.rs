//! A whole model resident on one device, for whole-model passes: evaluation, tests that
//! compare a family's programs with reference data, and the calibration's timing.
//!
//! Every block's parameters and gradients, every block boundary's activation, the
//! activation gradients, tokens, losses and the scratch are ranges of one device
//! allocation; host data goes through a pinned staging arena. The same programs run as
//! under the executor, on the same device interface; only the schedule is the plain one
//! (every block in order, nothing streamed). A runner either recomputes every layer's
//! forward in its backward, or keeps every layer's saved activations from the forward
//! (see [`Runner::new_recomputing`]): the two give the same results bit for bit.

use strata_kernels::program::{Dtype, Scalars, Target};

use crate::device::{Bindings, Device, DeviceRange, Event, Program, cast};
use crate::lane::Lane;
use crate::memory::{ARENA_ALIGN, DeviceBuffer, HostArena, HostRange, HostRead};
use crate::model::{Bind, Model, ModelError, Pass, Shape};
use crate::plan::{Precision, Recompute};

/// A model with every buffer on one device.
pub struct Runner {
    model: Model,
    device: Device,
    shape: Shape,
    dtype: Dtype,
    precision: Precision,
    _memory: DeviceBuffer,
    staging: HostArena,
    params: Vec<DeviceRange>,
    grads: Vec<DeviceRange>,
    /// acts[i]: the input of block i + 1 (acts[0]: the embedding's output).
    acts: Vec<DeviceRange>,
    dact: [DeviceRange; 2],
    tokens: DeviceRange,
    losses: DeviceRange,
    scratch: DeviceRange,
    /// Per block, its saved activations when the runner keeps them.
    saved: Vec<Option<DeviceRange>>,
    /// Per block, the forward and the backward it runs.
    forward: Vec<Program>,
    backward: Vec<Program>,
    has_forward: bool,
    /// The positions whose loss counts in the last forward (its loss is their mean).
    counted_targets: usize,
    /// The seed of the sketches of an approximate backward ([`Scalars::sketch`]).
    sketch: u64,
}

/// Hands out consecutive aligned ranges of a size to be allocated.
struct Layout {
    next: usize,
}

impl Layout {
    fn take(&mut self, bytes: usize) -> DeviceRange {
        let r = DeviceRange::new(self.next, bytes);
        self.next = (self.next + bytes).next_multiple_of(ARENA_ALIGN);
        r
    }
}

impl Runner {
    /// Bytes of device memory a runner of `model` for batches of `batch` × `seq` needs
    /// on `target` with parameters and activations of `dtype` (recomputing every layer's
    /// forward in its backward, as [`Runner::new`] does).
    pub fn device_bytes(
        model: &Model,
        batch: usize,
        seq: usize,
        target: Target,
        dtype: Dtype,
    ) -> Result<usize, ModelError> {
        Self::device_bytes_recomputing(model, batch, seq, target, dtype, Recompute::All)
    }

    /// [`Runner::device_bytes`] of a runner that recomputes as `recompute` says (see
    /// [`Runner::new_recomputing`]).
    pub fn device_bytes_recomputing(
        model: &Model,
        batch: usize,
        seq: usize,
        target: Target,
        dtype: Dtype,
        recompute: Recompute,
    ) -> Result<usize, ModelError> {
        let shape = model.shape(batch, seq)?;
        Ok(Self::layout(model, shape, target, dtype, keeps(recompute))
            .0
            .next)
    }

    #[allow(clippy::type_complexity)]
    fn layout(
        model: &Model,
        shape: Shape,
        target: Target,
        dtype: Dtype,
        keep: bool,
    ) -> (
        Layout,
        Vec<DeviceRange>,
        Vec<DeviceRange>,
        Vec<DeviceRange>,
        [DeviceRange; 2],
        DeviceRange,
        DeviceRange,
        DeviceRange,
        Vec<Option<DeviceRange>>,
    ) {
        let mut l = Layout { next: 0 };
        let blocks = model.blocks();
        let params = blocks
            .iter()
            .map(|b| l.take(b.len * dtype.size()))
            .collect();
        // Each block's trained tail only (all of it, but in a LoRA model).
        let grads = blocks.iter().map(|b| l.take(b.trained_len() * 4)).collect();
        let act = shape.rows() * model.width() * dtype.size();
        let acts = (0..=model.layers()).map(|_| l.take(act)).collect();
        let dact = [l.take(act), l.take(act)];
        let tokens = l.take(8 * shape.rows());
        let losses = l.take(4 * shape.rows());
        let stats = crate::model::update::grad_stats_scratch(blocks, target);
        let scratch = l.take(model.scratch_bytes(shape, target, dtype).max(stats));
        let saved = (0..blocks.len())
            .map(|b| {
                let bytes = model.saved_bytes(b, shape, target, dtype);
                (keep && bytes > 0).then(|| l.take(bytes))
            })
            .collect();
        (l, params, grads, acts, dact, tokens, losses, scratch, saved)
    }

    /// `model` on `device` for batches of `batch` × `seq`, with working parameters in
    /// `precision` (the CPU device computes in f32 whatever it is; a GPU in its dtype).
    /// Each layer's backward recomputes its forward.
    pub fn new(
        model: Model,
        device: Device,
        batch: usize,
        seq: usize,
        precision: Precision,
    ) -> Result<Self, ModelError> {
        Self::new_recomputing(model, device, batch, seq, precision, Recompute::All)
    }

    /// [`Runner::new`], recomputing as `recompute` says: every layer's forward in its
    /// backward ([`Recompute::All`]), or none, every layer keeping its saved activations
    /// from the forward to the backward ([`Recompute::None`]; also what
    /// [`Recompute::Auto`] does here, where the memory is sized for it).
    pub fn new_recomputing(
        model: Model,
        device: Device,
        batch: usize,
        seq: usize,
        precision: Precision,
        recompute: Recompute,
    ) -> Result<Self, ModelError> {
        let shape = model.shape(batch, seq)?;
        let target = device.target();
        let dtype = match target {
            Target::Cpu => Dtype::F32,
            Target::Cuda => precision.dtype(),
        };
        let keep = keeps(recompute);
        let (l, params, grads, acts, dact, tokens, losses, scratch, saved) =
            Self::layout(&model, shape, target, dtype, keep);
        let memory = device.alloc(l.next.max(1)).map_err(ModelError::Device)?;
        let base = memory.arena_offset_bytes();
        let shift = |r: DeviceRange| DeviceRange::new(base + r.offset_bytes, r.len_bytes);
        let largest = model.blocks().iter().map(|b| b.len).max().unwrap_or(0);
        let staging_bytes = (4 * largest)
            .max(8 * shape.rows())
            .max(shape.rows() * model.vocab() * 4)
            .max(acts_bytes(&acts));
        let staging = HostArena::new("runner staging", staging_bytes, &device.pinning())
            .map_err(ModelError::Device)?;
        let nb = model.blocks().len();
        let program = |b, pass| -> Program { model.program(b, pass, shape, target, dtype).into() };
        let (forward, backward) = if keep {
            (Pass::ForwardSave, Pass::BackwardSaved)
        } else {
            (Pass::Forward, Pass::Backward)
        };
        Ok(Runner {
            forward: (0..nb).map(|b| program(b, forward)).collect(),
            backward: (0..nb).map(|b| program(b, backward)).collect(),
            saved: saved.into_iter().map(|r| r.map(shift)).collect(),
            params: params.into_iter().map(shift).collect(),
            grads: grads.into_iter().map(shift).collect(),
            acts: acts.into_iter().map(shift).collect(),
            dact: dact.map(shift),
            tokens: shift(tokens),
            losses: shift(losses),
            scratch: shift(scratch),
            _memory: memory,
            staging,
            model,
            device,
            shape,
            dtype,
            precision,
            has_forward: false,
            counted_targets: 1,
            sketch: 0,
        })
    }

    /// The model on a CPU device sized for it.
    pub fn on_cpu(model: Model, batch: usize, seq: usize) -> Result<Self, ModelError> {
        Self::on_cpu_recomputing(model, batch, seq, Recompute::All)
    }

    /// [`Runner::on_cpu`], recomputing as `recompute` says (see
    /// [`Runner::new_recomputing`]).
    pub fn on_cpu_recomputing(
        model: Model,
        batch: usize,
        seq: usize,
        recompute: Recompute,
    ) -> Result<Self, ModelError> {
        let bytes =
            Self::device_bytes_recomputing(&model, batch, seq, Target::Cpu, Dtype::F32, recompute)?;
        let device = crate::device::CpuDevice::new(crate::device::CpuDeviceConfig {
            memory_budget_bytes: bytes.max(1),
            ..Default::default()
        })?;
        Runner::new_recomputing(
            model,
            Device::Cpu(device),
            batch,
            seq,
            Precision::Fp32,
            recompute,
        )
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Copies host bytes to a device range and waits.
    fn upload(
        &self,
        bytes: &[u8],
        dst: DeviceRange,
        convert: crate::device::Convert,
    ) -> Result<(), ModelError> {
        upload_staged(&self.device, &self.staging, bytes, dst, convert)
    }

    /// A device range's bytes, as f32 (converted from `dtype`).
    fn download(&self, src: DeviceRange, dtype: Dtype) -> Result<Vec<f32>, ModelError> {
        let bytes = download_staged(&self.device, &self.staging, src)?;
        Ok(match dtype {
            Dtype::Bf16 => cast::<half::bf16>(&bytes)
                .iter()
                .map(|x| x.to_f32())
                .collect(),
            Dtype::F16 => cast::<half::f16>(&bytes)
                .iter()
                .map(|x| x.to_f32())
                .collect(),
            _ => cast::<f32>(&bytes).to_vec(),
        })
    }

    /// Loads `params` (one f32 buffer per block), rounded to the working precision.
    pub fn load(&mut self, params: &[Vec<f32>]) -> Result<(), ModelError> {
        if params.len() != self.model.blocks().len() {
            return Err(ModelError::BadInput(format!(
                "parameters do not match the model's {} blocks",
                self.model.blocks().len()
            )));
        }
        self.load_blocks(&|b| Ok(params[b].clone()))
    }

    /// Loads each block's f32 parameters as `make` gives them, one block at a time
    /// (rounded to the working precision), so that loading holds one block's parameters
    /// beside the device's copy, not the model's.
    pub fn load_blocks(
        &mut self,
        make: &dyn Fn(usize) -> Result<Vec<f32>, ModelError>,
    ) -> Result<(), ModelError> {
        let cpu = strata_kernels::ops::Cpu::default();
        for b in 0..self.model.blocks().len() {
            let raw = make(b)?;
            if raw.len() != self.model.blocks()[b].len {
                return Err(ModelError::BadInput(format!(
                    "block {b}'s parameters have {} values, not the model's {}",
                    raw.len(),
                    self.model.blocks()[b].len
                )));
            }
            let dst = self.params[b];
            let mut p = vec![0.0f32; raw.len()];
            strata_kernels::program::round_into_f32(&cpu, self.precision.dtype(), &raw, &mut p);
            drop(raw);
            match self.dtype {
                Dtype::Bf16 => {
                    let v: Vec<half::bf16> = p.iter().map(|&x| half::bf16::from_f32(x)).collect();
                    self.upload(crate::device::bytes_of(&v), dst, None)?;
                }
                Dtype::F16 => {
                    let v: Vec<half::f16> = p.iter().map(|&x| half::f16::from_f32(x)).collect();
                    self.upload(crate::device::bytes_of(&v), dst, None)?;
                }
                _ => self.upload(crate::device::bytes_of(&p), dst, None)?,
            }
        }
        self.has_forward = false;
        Ok(())
    }

    /// Bindings of block `b`'s program.
    fn bindings(&self, b: usize, pass: Pass) -> Bindings {
        let layers = self.model.layers();
        let rows = self.shape.rows();
        let mut out = Bindings::default();
        out.set(Bind::Params as u8, self.params[b]);
        out.set(Bind::Grads as u8, self.grads[b]);
        if let Some(t) = self.model.tied(b) {
            out.set(Bind::TiedParams as u8, self.params[t]);
            out.set(Bind::TiedGrads as u8, self.grads[t]);
        }
        out.set(Bind::Scratch as u8, self.scratch);
        out.set(Bind::Tokens as u8, self.tokens.sub(0, 4 * rows));
        out.set(Bind::Targets as u8, self.tokens.sub(4 * rows, 4 * rows));
        out.set(Bind::Losses as u8, self.losses);
        if b > 0 {
            out.set(Bind::Input as u8, self.acts[b - 1]);
        }
        if b <= layers {
            out.set(Bind::Output as u8, self.acts[b]);
        }
        if let Some(saved) = self.saved[b] {
            out.set(Bind::Saved as u8, saved);
        }
        if !pass.is_forward() {
            // The gradient of the head's input is dact[layers % 2]; block b reads
            // dact[b % 2] (its output's) and writes dact[(b - 1) % 2].
            if b <= layers {
                out.set(Bind::DOutput as u8, self.dact[b % 2]);
            }
            if b > 0 {
                out.set(Bind::DInput as u8, self.dact[(b - 1) % 2]);
            }
        }
        out
    }

    /// Runs block `b`'s forward (`pass` [`Pass::Forward`]) or backward
    /// ([`Pass::Backward`]): the variants this runner was built with.
    fn run(&self, b: usize, pass: Pass, scalars: &Scalars) -> Result<Event, ModelError> {
        let program = if pass.is_forward() {
            &self.forward[b]
        } else {
            &self.backward[b]
        };
        self.device
            .run_program(
                Lane::Compute,
                program,
                &self.bindings(b, pass),
                scalars,
                &[],
            )
            .map_err(ModelError::Device)
    }

    /// Runs every block forward on `tokens` (B × T, row-major) and returns the mean
    /// cross-entropy against `targets`; leaves the per-position losses (and, where the
    /// family keeps them, the logits) for [`Runner::losses`] and [`Runner::logits`].
    pub fn forward(&mut self, tokens: &[u32], targets: &[u32]) -> Result<f32, ModelError> {
        self.has_forward = false;
        let ids = batch_ids(&self.model, self.shape, tokens, targets)?;
        self.counted_targets = counted_targets(targets);
        self.upload(crate::device::bytes_of(&ids), self.tokens, None)?;
        let mut last = None;
        for b in 0..self.model.blocks().len() {
            last = Some(self.run(b, Pass::Forward, &self.sketch_scalars())?);
        }
        if let Some(e) = last {
            e.wait().map_err(ModelError::Device)?;
        }
        self.has_forward = true;
        let losses = self.losses()?;
        let sum: f64 = losses.iter().map(|&l| f64::from(l)).sum();
        Ok((sum / self.counted_targets as f64) as f32)
    }

    /// Each position's loss after [`Runner::forward`].
    pub fn losses(&self) -> Result<Vec<f32>, ModelError> {
        self.download(self.losses, Dtype::F32)
    }

    /// The logits (B × T × vocab) after [`Runner::forward`], where the family keeps them.
    pub fn logits(&self) -> Result<Option<Vec<f32>>, ModelError> {
        let Some(t) = self
            .model
            .family()
            .logits(self.shape, self.device.target(), self.dtype)
        else {
            return Ok(None);
        };
        self.download(self.scratch.sub(t.offset_bytes, t.bytes()), t.dtype)
            .map(Some)
    }

    /// The seed of the sketches of the next forward and backward, where the model's
    /// backward estimates weight gradients from sketches ([`Model::approximate`]); 0
    /// until set.
    pub fn set_sketch_seed(&mut self, seed: u64) {
        self.sketch = seed;
    }

    /// Scalars with this runner's sketch seed.
    fn sketch_scalars(&self) -> Scalars {
        Scalars {
            sketch: self.sketch,
            ..Scalars::default()
        }
    }

    /// After [`Runner::forward`], the gradient of the mean loss with respect to every
    /// parameter that trains: one f32 buffer per block, of its trained tail
    /// ([`BlockLayout::trained`](crate::model::BlockLayout::trained): the whole block but
    /// in a LoRA model, whose frozen blocks give empty ones). Each block recomputes its
    /// forward from its input, or reads the activations its forward saved.
    pub fn backward(&mut self) -> Result<Vec<Vec<f32>>, ModelError> {
        if !self.has_forward {
            return Err(ModelError::BadInput(
                "backward needs a forward pass first".into(),
            ));
        }
        let scalars = Scalars {
            dloss: 1.0 / self.counted_targets as f32,
            ..self.sketch_scalars()
        };
        let nb = self.model.blocks().len();
        let mut last = None;
        for b in (0..nb).rev() {
            last = Some(self.run(b, Pass::Backward, &scalars)?);
        }
        if let Some(e) = last {
            e.wait().map_err(ModelError::Device)?;
        }
        // The head's backward overwrote the logits with their gradient.
        self.has_forward = false;
        self.grads
            .iter()
            .map(|&g| match g.len_bytes {
                0 => Ok(Vec::new()),
                _ => self.download(g, Dtype::F32),
            })
            .collect()
    }
}

/// Whether a runner recomputing as `recompute` says keeps saved activations (on the
/// device: the runner has no other tier, so [`Recompute::Offload`] keeps them there).
fn keeps(recompute: Recompute) -> bool {
    recompute != Recompute::All
}

fn acts_bytes(acts: &[DeviceRange]) -> usize {
    acts.first().map_or(0, |a| a.len_bytes)
}

impl Drop for Runner {
    fn drop(&mut self) {
        if let Err(e) = self.device.synchronize() {
            log::error!("draining the device before dropping a runner failed: {e}");
        }
    }
}

/// A batch's `tokens` then its `targets`, as a forward uploads them, once both are
/// checked against `model` and a batch of `shape`.
pub(super) fn batch_ids(
    model: &Model,
    shape: Shape,
    tokens: &[u32],
    targets: &[u32],
) -> Result<Vec<u32>, ModelError> {
    let n = shape.rows();
    if tokens.len() != n || targets.len() != n {
        return Err(ModelError::BadInput(format!(
            "{} tokens and {} targets given for a batch of {n}",
            tokens.len(),
            targets.len()
        )));
    }
    model.check_tokens(tokens)?;
    model.check_targets(targets)?;
    let mut ids = tokens.to_vec();
    ids.extend_from_slice(targets);
    Ok(ids)
}

/// The positions of `targets` whose loss counts (not [`IGNORE_TARGET`]), at least one so
/// that an all-masked batch has a zero mean rather than a NaN.
pub(super) fn counted_targets(targets: &[u32]) -> usize {
    targets
        .iter()
        .filter(|&&t| t != crate::model::IGNORE_TARGET)
        .count()
        .max(1)
}

/// Copies `bytes` through `staging` to `dst` on `device` (`convert`: from one dtype to
/// another as it goes) and waits: how the runner and the block forward upload.
pub(super) fn upload_staged(
    device: &Device,
    staging: &HostArena,
    bytes: &[u8],
    dst: DeviceRange,
    convert: crate::device::Convert,
) -> Result<(), ModelError> {
    let range = HostRange::new(0, bytes.len());
    staging
        .write(Lane::Cpu, range)
        .map_err(ModelError::Device)?
        .copy_from_slice(bytes);
    device
        .copy_to_device(staging, range, dst, convert, &[])
        .and_then(|e| e.wait())
        .map_err(ModelError::Device)
}

/// `src`'s bytes copied through `staging` from `device` (waited for), lent for reading:
/// how the runner and the block forward download.
pub(super) fn download_staged<'a>(
    device: &Device,
    staging: &'a HostArena,
    src: DeviceRange,
) -> Result<HostRead<'a>, ModelError> {
    let range = HostRange::new(0, src.len_bytes);
    device
        .copy_to_host(src, staging, range, &[])
        .and_then(|e| e.wait())
        .map_err(ModelError::Device)?;
    staging.read(Lane::Cpu, range).map_err(ModelError::Device)
}
