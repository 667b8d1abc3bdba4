//! Collectives among ranks, on the collective lane: the all-gather of a block's working
//! parameters from every rank's shard, the reduce-scatter of a micro-batch's gradients
//! into each rank's shard (added in rank order), over device memory or staged through
//! the host, and the global gradient norm over every rank's shards, folded in the order
//! one process folds them so that it is the same bits.
//!
//! Not here: the group itself (`strata_comm`), or when the collectives run (`lanes.rs`).

use std::sync::atomic::Ordering;

use strata_comm::CommError;
use strata_kernels::adamw::{GradStats, Grads, STATS_PIECE, grad_stats_pieces};

use super::error::ExecError;
use super::executor::Executor;
use super::step_state::StepShared;
use crate::device::{bytes_of, bytes_of_mut, cast, cast_mut};
use crate::error::EngineError;
use crate::lane::Lane;
use crate::plan::{BufId, CommOp, OpId, Tier};

impl Executor {
    /// Collective `id` (`op`) itself, on the collective lane.
    pub(super) fn comm_op(
        &self,
        id: OpId,
        op: &CommOp,
        shared: &StepShared<'_>,
    ) -> Result<(), ExecError> {
        match *op {
            CommOp::AllGather {
                block,
                from,
                into,
                with_update,
            } => {
                if with_update && self.norms.skipped() {
                    return Ok(()); // every rank skips alike: the norm is global
                }
                self.all_gather(id, block, from, into)
            }
            CommOp::ReduceScatter {
                block,
                from,
                into,
                scratch,
                accumulate,
            } => self.reduce_scatter(id, block, (from, into, scratch), accumulate),
            CommOp::GradNorm { ref grads } => {
                let total = self.ranks_norm(grads, shared)?;
                self.set_norm(total, shared);
                Ok(())
            }
        }
    }

    /// Block `block`'s working parameters gathered from every rank's shard `from` into
    /// `into` (operation `id`): over device memory where they are there (the device's
    /// collective), else staged on the host.
    fn all_gather(
        &self,
        id: OpId,
        block: usize,
        from: BufId,
        into: BufId,
    ) -> Result<(), ExecError> {
        let label = || self.plan.op(id).kind.label().to_string();
        if self.plan.buffer(from).tier == Tier::Device {
            // Over device memory: the device's collective.
            let shard = self.plan.shard_len[block] as usize * self.plan.shape.device_dtype().size();
            let src = self.device_range(from).sub(0, shard);
            let dst = self.device_range(into).sub(0, shard * self.comm.size());
            return self
                .device
                .all_gather(self.comm.as_ref(), src, dst)
                .map_err(|e| self.device_collective_error(label(), e));
        }
        let err = |source| ExecError::Device {
            op: label(),
            source,
        };
        let bytes =
            self.plan.shard_len[block] as usize * self.plan.shape.precision.param_bytes() as usize;
        let src = self
            .host()
            .read(Lane::Comm, self.host_range(from).prefix(bytes))
            .map_err(err)?;
        let mut dst = self
            .host()
            .write(
                Lane::Comm,
                self.host_range(into).prefix(bytes * self.comm.size()),
            )
            .map_err(err)?;
        self.comm
            .all_gather(&src, &mut dst)
            .map_err(|e| self.comm_error(label(), e))
    }

    /// A micro-batch's gradients of block `block`, whole in `from`, reduce-scattered into
    /// this rank's shard `into` (operation `id`), added to the earlier micro-batches' when
    /// `accumulate`: over device memory (with room for the chunks in `scratch`, where the
    /// device needs it), else staged on the host.
    fn reduce_scatter(
        &self,
        id: OpId,
        block: usize,
        (from, into, scratch): (BufId, BufId, Option<BufId>),
        accumulate: bool,
    ) -> Result<(), ExecError> {
        let label = || self.plan.op(id).kind.label().to_string();
        let shard = self.plan.shard_len[block] as usize;
        if self.plan.buffer(from).tier == Tier::Device {
            // Over device memory: the device's collective. What the backward did not
            // write (past the block's end) lands in padding no one reads.
            let full = 4 * shard * self.comm.size();
            let src = self.device_range(from).sub(0, full);
            let dst = self.device_range(into).sub(0, 4 * shard);
            let scratch = scratch.map(|s| self.device_range(s).sub(0, full));
            return self
                .device
                .reduce_scatter(self.comm.as_ref(), src, dst, scratch, accumulate)
                .map_err(|e| self.device_collective_error(label(), e));
        }
        let err = |source| ExecError::Device {
            op: label(),
            source,
        };
        // The copy from the device filled the block's elements; what is past them goes
        // as it is, and lands in padding no one reads (the optimizer and the norm read a
        // shard's elements of the block only).
        let send = self
            .host()
            .read(
                Lane::Comm,
                self.host_range(from).prefix(4 * shard * self.comm.size()),
            )
            .map_err(err)?;
        let mut acc = self
            .host()
            .write(Lane::Comm, self.host_range(into).prefix(4 * shard))
            .map_err(err)?;
        self.comm
            .reduce_scatter_sum(cast::<f32>(&send), cast_mut::<f32>(&mut acc), accumulate)
            .map_err(|e| self.comm_error(label(), e))
    }

    /// The global gradient statistics with ranks: each rank's piece sums of its shards
    /// ([`strata_kernels::adamw::STATS_PIECE`]), gathered, and folded in the order one
    /// process folds them (block by block, each block's pieces in order), so the norm
    /// is the same bits as one process's.
    fn ranks_norm(
        &self,
        grads: &[(usize, BufId)],
        shared: &StepShared<'_>,
    ) -> Result<GradStats, ExecError> {
        let label = || "grad norm".to_string();
        let scale = 1.0 / shared.update_loss_scale;
        let mut pieces = self.norms.pieces.lock().unwrap_or_else(|e| e.into_inner());
        let (mine, all) = &mut *pieces;
        mine.fill(0.0);
        let mut at = 0;
        for &(block, buf) in grads {
            let (_, shard, valid) = self.shard(block);
            let g = self
                .host()
                .read(Lane::Comm, self.host_range(buf).prefix(4 * valid))
                .map_err(|source| ExecError::Device {
                    op: label(),
                    source,
                })?;
            let mut i = at;
            grad_stats_pieces(
                self.cpu.isa,
                self.limits.optimizer_threads,
                Grads::F32(cast::<f32>(&g)),
                scale,
                &mut |s| {
                    mine[i] = s.sum_squares;
                    i += 1;
                },
            )
            .map_err(|source| ExecError::Adam {
                op: label(),
                source,
            })?;
            at += shard.div_ceil(STATS_PIECE);
        }
        self.comm
            .all_gather(bytes_of(mine), bytes_of_mut(all))
            .map_err(|e| self.comm_error(label(), e))?;
        let per_rank = mine.len();
        let mut total = GradStats::default();
        let mut at = 0;
        for &(block, _) in grads {
            let n = (self.plan.shard_len[block] as usize).div_ceil(STATS_PIECE);
            let mut sum = GradStats::default();
            for r in 0..self.comm.size() {
                for &x in &all[r * per_rank + at..r * per_rank + at + n] {
                    sum = sum.merge(GradStats {
                        sum_squares: x,
                        non_finite: !x.is_finite(),
                    });
                }
            }
            total = total.merge(sum);
            at += n;
        }
        Ok(total)
    }

    /// A device collective's error: the group's, as `comm_error` gives it, or the
    /// device's.
    fn device_collective_error(&self, op: String, e: EngineError) -> ExecError {
        match e {
            EngineError::Collective { source, .. } => self.comm_error(op, *source),
            source => ExecError::Device { op, source },
        }
    }

    /// A collective's failure: this rank's own abort (after another lane failed) is an
    /// abort, anything else names the operation.
    fn comm_error(&self, op: String, source: CommError) -> ExecError {
        if self.progress.failed.load(Ordering::SeqCst) {
            ExecError::Aborted
        } else {
            ExecError::Comm { op, source }
        }
    }
}
