//! Host arithmetic on the CPU lane: gradient accumulation on the host and the rounding of
//! complete gradients to bf16, the statistics of host gradients (for the norm, before a
//! spill), the global norm of one process, and AdamW on the CPU over a block (its state
//! in host memory, or staged from NVMe; its gradients on the host, in f32 or spilled in
//! bf16, or on the CPU device where the backward left them; its new working parameters
//! into a host buffer or, on the CPU device, their device home).
//!
//! Not here: when they run (`lanes.rs`), or the norm among ranks (`comm.rs`).

use std::sync::atomic::Ordering;

use half::{bf16, f16};
use strata_kernels::adamw::{AdamError, AdamStep, CopyOut, GradStats, Grads, grad_stats};
use strata_kernels::isa::Isa;
use strata_kernels::program::{read_stats, write_stats};

use super::error::ExecError;
use super::executor::Executor;
use super::moments::{StateMoments, split_state};
use super::state::write_working;
use super::step_state::{Norm, StepShared};
use crate::device::{cast, cast_mut};
use crate::lane::Lane;
use crate::model::{Piece, TensorSpec};
use crate::plan::{BufId, GradDtype, GradSource, HostOp, OpId, Precision, Tier};

impl Executor {
    /// Host operation `id` (`op`) itself, on the CPU lane.
    pub(super) fn host_op(
        &self,
        id: OpId,
        op: &HostOp,
        shared: &StepShared<'_>,
    ) -> Result<(), ExecError> {
        match *op {
            HostOp::Accumulate { block, from, to } => self.host_accumulate(id, block, from, to),
            HostOp::RoundGrads { block, grads, out } => self.host_round(id, block, grads, out),
            HostOp::Stats {
                block,
                grads,
                stats,
            } => {
                let scale = 1.0 / shared.update_loss_scale;
                let s = self.host_stats(id, block, grads, scale)?;
                let mut out = self
                    .host()
                    .write(Lane::Cpu, self.host_range(stats).prefix(16))
                    .map_err(self.device_error(self.plan.op(id).kind.label()))?;
                write_stats(&mut out, s);
                Ok(())
            }
            HostOp::GradNorm { ref sources } => self.grad_norm(id, sources, shared),
            HostOp::Optimizer {
                block,
                grads,
                grads_dtype,
                state,
                params_out,
                params_at,
            } => {
                let out = params_out.map(|p| (p, params_at as usize));
                self.host_adamw(block, (grads, grads_dtype), state, out, shared)
            }
        }
    }

    /// Adds block `block`'s gradients `from` (a micro-batch's, copied to the host) to
    /// the host gradients `to` (operation `id`).
    fn host_accumulate(
        &self,
        id: OpId,
        block: usize,
        from: BufId,
        to: BufId,
    ) -> Result<(), ExecError> {
        let label = || self.plan.op(id).kind.label().to_string();
        let err = |source| ExecError::Device {
            op: label(),
            source,
        };
        let bytes = 4 * self.model.blocks()[block].trained_len();
        let src = self
            .host()
            .read(Lane::Cpu, self.host_range(from).prefix(bytes))
            .map_err(err)?;
        let mut dst = self
            .host()
            .write(Lane::Cpu, self.host_range(to).prefix(bytes))
            .map_err(err)?;
        strata_kernels::ops::add_inplace(&self.cpu, cast_mut::<f32>(&mut dst), cast::<f32>(&src));
        Ok(())
    }

    /// Rounds block `block`'s host gradients `grads` to bf16 in place, and writes them as
    /// bf16 into `out` if given (operation `id`).
    fn host_round(
        &self,
        id: OpId,
        block: usize,
        grads: BufId,
        out: Option<BufId>,
    ) -> Result<(), ExecError> {
        let err = || self.device_error(self.plan.op(id).kind.label());
        let (_, len, _) = self.shard(block);
        let mut g = self
            .host()
            .write(Lane::Cpu, self.host_range(grads).prefix(4 * len))
            .map_err(err())?;
        let g = cast_mut::<f32>(&mut g);
        strata_kernels::ops::round_to_bf16(&self.cpu, g);
        if let Some(out) = out {
            let mut o = self
                .host()
                .write(Lane::Cpu, self.host_range(out).prefix(2 * len))
                .map_err(err())?;
            strata_kernels::ops::f32_to_bf16(&self.cpu, cast_mut::<bf16>(&mut o), g);
        }
        Ok(())
    }

    /// The global gradient norm and overflow check of one process (operation `id`), over
    /// every block's statistics from `sources`.
    fn grad_norm(
        &self,
        id: OpId,
        sources: &[(usize, GradSource)],
        shared: &StepShared<'_>,
    ) -> Result<(), ExecError> {
        let scale = 1.0 / shared.update_loss_scale;
        let mut total = GradStats::default();
        for &(block, source) in sources {
            let stats = match source {
                GradSource::Host(grads) => self.host_stats(id, block, grads, scale)?,
                GradSource::Stats(stats) => {
                    let bytes = self
                        .host()
                        .read(Lane::Cpu, self.host_range(stats).prefix(16))
                        .map_err(self.device_error(self.plan.op(id).kind.label()))?;
                    read_stats(&bytes)
                }
            };
            total = total.merge(stats);
        }
        self.set_norm(total, shared);
        Ok(())
    }

    /// The statistics of block `block`'s host gradients `grads`, scaled by `scale`
    /// (operation `id`'s work: the norm's, or a spill's).
    fn host_stats(
        &self,
        id: OpId,
        block: usize,
        grads: BufId,
        scale: f32,
    ) -> Result<GradStats, ExecError> {
        let op = self.plan.op(id);
        let label = || op.kind.label().to_string();
        let bytes = 4 * self.model.blocks()[block].trained_len();
        let g = self
            .read_grads(op.lane, grads, bytes)
            .map_err(|source| ExecError::Device {
                op: label(),
                source,
            })?;
        grad_stats(
            self.cpu.isa,
            self.limits.optimizer_threads,
            Grads::F32(cast::<f32>(&g)),
            scale,
        )
        .map_err(|source| ExecError::Adam {
            op: label(),
            source,
        })
    }

    /// Records the global norm of `total` and what it means for the update: the
    /// clipping coefficient, and whether the step is skipped (non-finite gradients).
    pub(super) fn set_norm(&self, total: GradStats, shared: &StepShared<'_>) {
        let norm = total.norm();
        let clip = shared.params.clip;
        let coef = if clip > 0.0 && norm > clip {
            (clip / (norm + 1e-6)) as f32
        } else {
            1.0
        };
        *self.norms.norm.lock().unwrap_or_else(|e| e.into_inner()) = Norm {
            norm,
            coef,
            skip: total.non_finite,
        };
    }

    /// AdamW on the CPU over block `block`: gradients, state and the new working
    /// parameters in the host arena.
    fn host_adamw(
        &self,
        block: usize,
        (grads, grads_dtype): (BufId, GradDtype),
        state: BufId,
        params_out: Option<(BufId, usize)>,
        shared: &StepShared<'_>,
    ) -> Result<(), ExecError> {
        let label = || format!("adamw {block}");
        let Norm { coef, skip, .. } = self.norms.norm();
        if skip {
            return Ok(());
        }
        // With ranks, this rank's shard: `len` elements (its padding, past the block's
        // end, is in no tensor's part and left alone).
        let (_, len, _) = self.shard(block);
        let err = |source| ExecError::Device {
            op: label(),
            source,
        };
        let adam_err = |source| ExecError::Adam {
            op: label(),
            source,
        };
        let g = self
            .read_grads(Lane::Cpu, grads, grads_dtype.bytes() as usize * len)
            .map_err(err)?;
        let gslice = match grads_dtype {
            GradDtype::Fp32 => Grads::F32(cast::<f32>(&g)),
            GradDtype::Bf16 => Grads::Bf16(cast::<bf16>(&g)),
        };
        if !self.plan.shape.needs_global_norm {
            self.record_block_stats(block, gslice, shared)
                .map_err(adam_err)?;
        }
        let steps = shared.adam_steps(coef)?;
        let layout = self.state_layout(block);
        let mut st = self
            .host()
            .write(Lane::Cpu, self.host_range(state).prefix(layout.bytes()))
            .map_err(err)?;
        let (master, moments) = split_state(layout, &mut st);
        let precision = self.plan.shape.precision;
        let pbytes = precision.param_bytes() as usize;
        // From element `at`: past a LoRA block's frozen base where `buf` is the whole
        // block's home.
        let mut out = match params_out {
            Some((buf, at)) => Some(
                self.lend_at(buf, at * pbytes, len * pbytes, Lane::Cpu, true, |r| {
                    self.host().write(Lane::Cpu, r)
                })
                .map_err(err)?,
            ),
            None => None,
        };
        if self.applied[block].load(Ordering::Acquire) >= shared.adam_step {
            // Committed before a failure of this step: the retry applies nothing again,
            // and writes the working parameters anew from the master copy.
            if let Some(out) = &mut out {
                write_working(precision, master, out);
            }
            return Ok(());
        }
        let update = BlockUpdate {
            tensors: &self.model.blocks()[block].tensors,
            pieces: &layout.pieces,
            steps: [&steps[0], &steps[1]],
            isa: self.cpu.isa,
            threads: self.limits.optimizer_threads,
            grads: gslice,
        };
        update
            .apply_in(precision, master, moments, out.as_deref_mut())
            .map_err(adam_err)?;
        if self.plan.homes[block][2] == Tier::Host {
            // Updated in place: applied now (NVMe-homed state counts at its commit).
            self.applied[block].store(shared.adam_step, Ordering::Release);
        }
        Ok(())
    }

    /// Without a global norm, nothing else takes the gradients' statistics: block
    /// `block`'s, of `grads`, for the step's report.
    fn record_block_stats(
        &self,
        block: usize,
        grads: Grads<'_>,
        shared: &StepShared<'_>,
    ) -> Result<(), AdamError> {
        let s = grad_stats(
            self.cpu.isa,
            self.limits.optimizer_threads,
            grads,
            1.0 / shared.update_loss_scale,
        )?;
        self.norms
            .block_stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())[block] = Some(s);
        Ok(())
    }
}

/// Where the optimizer writes a block's new working parameters, if anywhere.
enum WorkingOut<'a> {
    None,
    Bf16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

/// AdamW over a range of one block (the whole block, or a rank's shard of it, whose
/// slices start at the range's start), tensor part by tensor part: `steps[0]` (with
/// weight decay) for tensors that decay, `steps[1]` for the others. Alignment gaps and a
/// shard's padding are left alone (zero). AdamW is elementwise, so a shard's update is
/// the same bits as those elements' in the whole block's (with 8-bit moments, whose
/// blocks start at each part's start, where the shard cuts a tensor at a multiple of
/// 256 of its elements).
struct BlockUpdate<'a> {
    /// The block's tensors.
    tensors: &'a [TensorSpec],
    /// The tensors' parts of the range.
    pieces: &'a [Piece],
    steps: [&'a AdamStep; 2],
    isa: Isa,
    threads: usize,
    /// The gradients of the range.
    grads: Grads<'a>,
}

impl BlockUpdate<'_> {
    /// Updates `master` and the `moments`, and writes the new working parameters into
    /// `out` in `precision` (none where the fp32 master copy is the working one).
    fn apply_in(
        &self,
        precision: Precision,
        master: &mut [f32],
        moments: StateMoments<'_>,
        out: Option<&mut [u8]>,
    ) -> Result<(), AdamError> {
        match (precision, out) {
            (Precision::Fp32, out) => {
                self.apply(WorkingOut::None, master, moments)?;
                if let Some(out) = out {
                    cast_mut::<f32>(out).copy_from_slice(master);
                }
            }
            (Precision::Bf16, Some(out)) => {
                self.apply(WorkingOut::Bf16(cast_mut::<bf16>(out)), master, moments)?
            }
            (Precision::Fp16, Some(out)) => {
                self.apply(WorkingOut::F16(cast_mut::<f16>(out)), master, moments)?
            }
            (_, None) => unreachable!("only fp32 working parameters share the master copy"),
        }
        Ok(())
    }

    /// The update itself, tensor part by tensor part, copying out the working
    /// parameters as `out` says.
    fn apply(
        &self,
        mut out: WorkingOut<'_>,
        mut master: &mut [f32],
        mut moments: StateMoments<'_>,
    ) -> Result<(), AdamError> {
        fn cut<'a, T>(s: &mut &'a mut [T], skip: usize, take: usize) -> &'a mut [T] {
            let (_, rest) = std::mem::take(s).split_at_mut(skip);
            let (now, rest) = rest.split_at_mut(take);
            *s = rest;
            now
        }
        let mut grads = self.grads;
        let mut done = 0;
        for p in self.pieces {
            let (skip, take) = (p.at - done, p.len);
            done = p.at + p.len;
            let (_, g) = grads.split_at(skip);
            let (g_now, g_rest) = g.split_at(take);
            grads = g_rest;
            let copy = match &mut out {
                WorkingOut::None => CopyOut::None,
                WorkingOut::Bf16(o) => CopyOut::Bf16(cut(o, skip, take)),
                WorkingOut::F16(o) => CopyOut::F16(cut(o, skip, take)),
            };
            let step = if self.tensors[p.tensor].decays() {
                self.steps[0]
            } else {
                self.steps[1]
            };
            step.apply(
                self.isa,
                self.threads,
                cut(&mut master, skip, take),
                moments.take(skip, take),
                g_now,
                copy,
            )?;
        }
        Ok(())
    }
}
