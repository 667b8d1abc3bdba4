//! The device streams' work: a stream operation submitted to its stream after the events
//! it waits for (host-to-device and device-to-host copies, the blocks' programs on the
//! compute stream, gradient accumulation and rounding, and on the update stream the gradient
//! statistics and AdamW of device-homed optimizer state). Submitting never waits for the
//! device; the operation's event says when it is done.
//!
//! Not here: when it is submitted (`lanes.rs`), or the programs themselves
//! (`programs.rs`, the model family).

use std::sync::atomic::Ordering;

use strata_kernels::program::{Dtype, Scalars};

use super::error::ExecError;
use super::executor::Executor;
use super::step_state::{Norm, StepShared};
use crate::device::{Bindings, Event};
use crate::error::EngineError;
use crate::lane::Lane;
use crate::model::Bind;
use crate::model::approx::sketch_step;
use crate::plan::{Binds, BufId, OpId, StreamOp};

impl Executor {
    /// Submits stream operation `id` (`op`) after `after`; its event, or none when it had
    /// nothing to do (an update's copy in a skipped step, the device update of a block
    /// that committed before a failure).
    pub(super) fn submit(
        &self,
        id: OpId,
        op: &StreamOp,
        after: &[Event],
        shared: &StepShared<'_>,
    ) -> Result<Option<Event>, ExecError> {
        let lane = self.plan.op(id).lane;
        let err = self.device_error(self.plan.op(id).kind.label());
        let event = match *op {
            StreamOp::H2d {
                from,
                to,
                to_at,
                bytes,
                convert,
                with_update,
            } => {
                if with_update && self.norms.skipped() {
                    return Ok(None);
                }
                let to = (to, to_at as usize);
                self.copy_to_device(from, to, bytes as usize, convert, after)
            }
            StreamOp::D2h { from, to, bytes } => {
                let bytes = bytes as usize;
                let src = self.device_range(from).sub(0, bytes);
                let dst = self.host_range(to).prefix(bytes);
                self.device.copy_to_host(src, self.host(), dst, after)
            }
            StreamOp::Compute {
                block,
                micro,
                pass,
                ref binds,
            } => {
                let scalars = Scalars {
                    dloss: shared.params.loss_scale / shared.counted_targets as f32,
                    sketch: sketch_step(shared.batch, micro),
                    ..Scalars::default()
                };
                let program = &self.programs.compute[block][pass.index()];
                self.device
                    .run_program(lane, program, &self.bindings(binds), &scalars, after)
            }
            StreamOp::Accumulate { block, from, to } => {
                let mut b = Bindings::default();
                b.set(Bind::Grads as u8, self.device_range(to));
                b.set(Bind::GradsIn as u8, self.device_range(from));
                let program = &self.programs.accumulate[block];
                self.device
                    .run_program(lane, program, &b, &Scalars::default(), after)
            }
            StreamOp::RoundGrads { block, grads } => {
                let mut b = Bindings::default();
                b.set(Bind::Grads as u8, self.device_range(grads));
                let program = &self.programs.round[block];
                self.device
                    .run_program(lane, program, &b, &Scalars::default(), after)
            }
            StreamOp::DeviceStats {
                block,
                grads,
                stats,
            } => self.device_stats(lane, block, (grads, stats), after, shared),
            StreamOp::Dequantize {
                block,
                packed,
                params,
            } => {
                let mut b = Bindings::default();
                b.set(Bind::Params as u8, self.device_range(params));
                b.set(Bind::Packed as u8, self.device_range(packed));
                let program = self.programs.dequantize[block]
                    .as_ref()
                    .expect("a dequantisation program for a packed block");
                self.device
                    .run_program(lane, program, &b, &Scalars::default(), after)
            }
            StreamOp::DeviceUpdate {
                block,
                grads,
                state,
                params,
            } => {
                if self.applied[block].load(Ordering::Acquire) >= shared.adam_step {
                    return Ok(None); // committed before a failure: a retry skips it
                }
                let scalars = self.update_scalars(shared)?;
                self.device_update(lane, block, (grads, state, params), &scalars, after)
            }
        };
        event.map(Some).map_err(err)
    }

    /// Copies the first `bytes` of host buffer `from` into device buffer `to`, converted
    /// as `convert` says, after `after`.
    fn copy_to_device(
        &self,
        from: BufId,
        (to, to_at): (BufId, usize),
        bytes: usize,
        convert: Option<(Dtype, Dtype)>,
        after: &[Event],
    ) -> Result<Event, EngineError> {
        let device_size = |n: usize| convert.map_or(n, |(a, b)| n / a.size() * b.size());
        let src = self.host_range(from).prefix(bytes);
        let elem = self.plan.shape.device_dtype().size();
        let dst = self.device_range(to).sub(to_at * elem, device_size(bytes));
        self.device
            .copy_to_device(self.host(), src, dst, convert, after)
    }

    /// The statistics of block `block`'s device gradients into a 16-byte device buffer
    /// (`(grads, stats)`), on `lane` after `after`.
    fn device_stats(
        &self,
        lane: Lane,
        block: usize,
        (grads, stats): (BufId, BufId),
        after: &[Event],
        shared: &StepShared<'_>,
    ) -> Result<Event, EngineError> {
        let mut b = Bindings::default();
        b.set(Bind::Grads as u8, self.device_range(grads));
        b.set(Bind::Stats as u8, self.device_range(stats));
        b.set(
            Bind::Scratch as u8,
            self.device_range(self.plan.stats_scratch),
        );
        let scalars = Scalars {
            stats_scale: 1.0 / shared.update_loss_scale,
            ..Scalars::default()
        };
        self.device
            .run_program(lane, &self.programs.stats[block], &b, &scalars, after)
    }

    /// The device AdamW's scalars for this step: its constants, clipped by the norm, and
    /// whether the step skips the update.
    fn update_scalars(&self, shared: &StepShared<'_>) -> Result<Scalars, ExecError> {
        let Norm { coef, skip, .. } = self.norms.norm();
        let [decayed, plain] = shared.adam_steps(coef)?;
        Ok(Scalars {
            adam: Some(decayed),
            adam_no_decay: Some(plain),
            skip_update: skip,
            ..Scalars::default()
        })
    }

    /// AdamW on block `block` on the device, `(grads, state, params)` its buffers, on
    /// `lane` after `after`.
    fn device_update(
        &self,
        lane: Lane,
        block: usize,
        (grads, state, params): (BufId, BufId, BufId),
        scalars: &Scalars,
        after: &[Event],
    ) -> Result<Event, EngineError> {
        let mut b = Bindings::default();
        b.set(Bind::Grads as u8, self.device_range(grads));
        b.set(Bind::State as u8, self.device_range(state));
        b.set(Bind::Params as u8, self.device_range(params));
        let program = self.programs.update[block]
            .as_ref()
            .expect("an update program for a block whose state is on the device");
        self.device.run_program(lane, program, &b, scalars, after)
    }

    /// Binds a compute operation's buffers.
    fn bindings(&self, binds: &Binds) -> Bindings {
        let rows = self.plan.shape.batch * self.plan.shape.seq;
        let mut out = Bindings::default();
        let mut bind = |at: Bind, buf: Option<BufId>| {
            if let Some(buf) = buf {
                out.set(at as u8, self.device_range(buf));
            }
        };
        bind(Bind::Params, binds.params);
        bind(Bind::Grads, binds.grads);
        bind(Bind::TiedParams, binds.tied_params);
        bind(Bind::TiedGrads, binds.tied_grads);
        bind(Bind::Input, binds.input);
        bind(Bind::Output, binds.output);
        bind(Bind::DOutput, binds.d_output);
        bind(Bind::DInput, binds.d_input);
        bind(Bind::Losses, binds.losses);
        bind(Bind::Saved, binds.saved);
        bind(Bind::Scratch, Some(self.plan.scratch));
        if let Some(tokens) = binds.tokens {
            let r = self.device_range(tokens);
            out.set(Bind::Tokens as u8, r.sub(0, 4 * rows));
            out.set(Bind::Targets as u8, r.sub(4 * rows, 4 * rows));
        }
        out
    }
}
