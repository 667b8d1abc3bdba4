//! The optimizer's kernels: the gradient statistics (sum of squares, non-finite flag)
//! that clipping and fp16 loss scaling need, and one AdamW step over one tensor. Here:
//! their signatures and their two runners' dispatch. The CPU op is the SIMD AdamW of
//! [`crate::adamw`] (its scalar reference is [`crate::reference::adamw`]); `adamw.cu`
//! holds the CUDA kernels.

use half::{bf16, f16};

use crate::adamw::{
    AdamStep, CopyOut, GradStats, Grads, STATS_LANES, STATS_PIECE, State, grad_stats,
};
use crate::cuda::launch::{
    AdamConstants, Arg, CudaKernel, CudaSource, Entry, Launch, grid, int, long, per_element,
};
use crate::isa::Isa;
use crate::ops::{self, Cpu};
use crate::program::{
    ByteRule, CpuKernel, CpuTensors, Dtype, DtypeRule, KernelError, LenRule, Param, Scalars,
    Signature, Target, TensorRef,
};

/// The family's CUDA kernels.
const SOURCE: CudaSource = ("adamw.cu", include_str!("adamw.cu"));

const ADAMW_STEP: Entry = Entry::untyped("adamw_step");
const GRAD_STATS_PARTIALS: Entry = Entry::untyped("grad_stats_partials");
const GRAD_STATS_TOTAL: Entry = Entry::untyped("grad_stats_total");

/// Threads per block of the CUDA gradient statistics (`GRAD_STATS_THREADS` in
/// `adamw.cu`): [`GRAD_STATS_PIECES_PER_BLOCK`] pieces of [`STATS_LANES`] lanes.
pub const GRAD_STATS_THREADS: usize = 256;

/// Pieces of the CPU's sum ([`STATS_PIECE`] gradients each) one block of the first pass
/// of the CUDA gradient statistics sums (`PIECES_PER_BLOCK` in `adamw.cu`).
pub const GRAD_STATS_PIECES_PER_BLOCK: usize = GRAD_STATS_THREADS / STATS_LANES;

/// Pieces of the CPU's sum over `len` gradients: the first pass of the CUDA statistics
/// writes one f64 partial sum per piece, the second folds them in order, as the CPU does.
pub fn grad_stats_pieces(len: usize) -> usize {
    len.div_ceil(STATS_PIECE)
}

/// Blocks of the first pass of the CUDA gradient statistics over `len` gradients: one
/// per [`GRAD_STATS_PIECES_PER_BLOCK`] pieces, at least 1.
pub fn grad_stats_blocks(len: usize) -> usize {
    grad_stats_pieces(len)
        .div_ceil(GRAD_STATS_PIECES_PER_BLOCK)
        .max(1)
}

/// Bytes of scratch [`GradStatsKernel`] needs on `target` over `len` gradients: none on
/// the CPU; on CUDA one f64 partial sum per piece ([`grad_stats_pieces`], at least one).
/// The scratch must start at a multiple of 8 bytes.
pub fn grad_stats_scratch_bytes(target: Target, len: usize) -> usize {
    match target {
        Target::Cpu => 0,
        Target::Cuda => 8 * grad_stats_pieces(len).max(1),
    }
}

/// `out` = `values` rounded to `precision` (nearest even), held as f32; exact for f32.
pub fn round_into_f32(cpu: &Cpu, precision: Dtype, values: &[f32], out: &mut [f32]) {
    assert_eq!(values.len(), out.len(), "rounding lengths");
    // In pieces through a stack buffer: no allocation.
    const CHUNK: usize = 4096;
    match precision {
        Dtype::Bf16 => {
            let mut tmp = [bf16::ZERO; CHUNK];
            for (src, dst) in values.chunks(CHUNK).zip(out.chunks_mut(CHUNK)) {
                let tmp = &mut tmp[..src.len()];
                ops::f32_to_bf16(cpu, tmp, src);
                ops::bf16_to_f32(cpu, dst, tmp);
            }
        }
        Dtype::F16 => {
            let mut tmp = [f16::ZERO; CHUNK];
            for (src, dst) in values.chunks(CHUNK).zip(out.chunks_mut(CHUNK)) {
                let tmp = &mut tmp[..src.len()];
                ops::f32_to_f16(cpu, tmp, src);
                ops::f16_to_f32(cpu, dst, tmp);
            }
        }
        _ => out.copy_from_slice(values),
    }
}

/// Writes gradient statistics as [`GradStatsKernel`] lays them out: the sum of squares,
/// then 1.0 if any gradient was not finite (two little-endian f64).
pub fn write_stats(out: &mut [u8], stats: GradStats) {
    out[..8].copy_from_slice(&stats.sum_squares.to_le_bytes());
    let flag: f64 = if stats.non_finite { 1.0 } else { 0.0 };
    out[8..16].copy_from_slice(&flag.to_le_bytes());
}

/// Reads what [`write_stats`] (or the CUDA kernel) wrote.
pub fn read_stats(bytes: &[u8]) -> GradStats {
    let sum = f64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    let flag = f64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
    GradStats {
        sum_squares: sum,
        non_finite: flag != 0.0 || !sum.is_finite(),
    }
}

/// The sum of squares of `grads` (f32) each multiplied by [`Scalars::stats_scale`], and
/// whether any is not finite: `out` holds two f64, the sum and 1.0 or 0.0. The sum is
/// deterministic for a given target. (The program calls it
/// [`Kernel::GradStats`](crate::kernel::Kernel::GradStats); `GradStats` is the result,
/// [`crate::adamw::GradStats`].)
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradStatsKernel {
    /// f32 gradients.
    pub grads: TensorRef,
    /// Two f64 (16 bytes, U8).
    pub out: TensorRef,
    /// [`grad_stats_scratch_bytes`] bytes (U8).
    pub scratch: TensorRef,
}

impl Signature for GradStatsKernel {
    const NAME: &'static str = "grad-stats";
    /// Gradients.
    type Shape = usize;

    fn shape(&self) -> Result<usize, KernelError> {
        Ok(self.grads.len)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let record = ByteRule {
            cpu_bytes: 16,
            cuda_bytes: 16,
            exact: true,
            align_bytes: 8,
            label: "out (bytes)",
        };
        let u8_ = DtypeRule::Exactly(Dtype::U8);
        each(Param::write("out", &self.out, u8_, LenRule::Bytes(record)));
        let cuda = grad_stats_scratch_bytes(Target::Cuda, self.grads.len);
        each(Param::scratch(
            "scratch",
            &self.scratch,
            ByteRule::scratch(0, cuda, 8),
        ));
        let f32_ = DtypeRule::Exactly(Dtype::F32);
        each(Param::read("grads", &self.grads, f32_, LenRule::AnyLen));
    }

    fn flops(&self) -> f64 {
        2.0 * self.grads.len as f64
    }
}

impl CpuKernel for GradStatsKernel {
    fn run_cpu(
        &self,
        _: &usize,
        cpu: &Cpu,
        scalars: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let grads = Grads::F32(t.f32(&self.grads));
        let stats = grad_stats(cpu.isa, cpu.threads, grads, scalars.stats_scale)?;
        write_stats(t.bytes_mut(&self.out), stats);
        Ok(())
    }
}

impl CudaKernel for GradStatsKernel {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[GRAD_STATS_PARTIALS, GRAD_STATS_TOTAL];

    fn launch(&self, &n: &usize, scalars: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        let (blocks, pieces) = (grad_stats_blocks(n), grad_stats_pieces(n));
        // grad_stats_partials(double* partials, const float* grads, float scale, long
        // long n): `blocks` blocks of GRAD_STATS_THREADS threads read grads[..n] and write
        // partials[..pieces] (the scratch holds 8 bytes per piece).
        let partials = [
            q.ptr(&self.scratch),
            q.ptr(&self.grads),
            Arg::Float(scalars.stats_scale),
            long(n),
        ];
        let threads = GRAD_STATS_THREADS as u32;
        q.launch(GRAD_STATS_PARTIALS, grid(blocks, threads), &partials)?;
        // grad_stats_total(double* out, const double* partials, int count): one block of
        // GRAD_STATS_THREADS threads reads partials[..count] and writes out[0..2].
        let total = [q.ptr(&self.out), q.ptr(&self.scratch), int(pieces)];
        Ok(q.launch(GRAD_STATS_TOTAL, grid(1, threads), &total)?)
    }
}

/// What `adamw_step` writes to its copy-out tensor (adamw.cu's `COPY_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub(crate) enum CopyMode {
    None = 0,
    Bf16 = 1,
    F16 = 2,
    F32 = 3,
    F32AsBf16 = 4,
    F32AsF16 = 5,
}

impl CopyMode {
    /// The mode for a copy of `dtype` rounded to `round` (a checked copy-out's dtype).
    fn of(dtype: Dtype, round: Dtype) -> Self {
        match (dtype, round) {
            (Dtype::Bf16, _) => CopyMode::Bf16,
            (Dtype::F16, _) => CopyMode::F16,
            (_, Dtype::Bf16) => CopyMode::F32AsBf16,
            (_, Dtype::F16) => CopyMode::F32AsF16,
            _ => CopyMode::F32,
        }
    }
}

/// One AdamW step over one tensor (`crate::adamw`'s semantics), with the constants of
/// [`Scalars::adam`] (`decay`) or [`Scalars::adam_no_decay`]; nothing when
/// [`Scalars::skip_update`] is set. Optionally writes the new parameters rounded to
/// `round` (bf16 or f16, nearest even) into `copy_out`, stored in `copy_out`'s dtype.
/// (The program calls it [`Kernel::AdamW`](crate::kernel::Kernel::AdamW); `AdamW` is the
/// optimizer's hyperparameters, [`crate::adamw::AdamW`].)
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWKernel {
    /// f32 master parameters, updated.
    pub params: TensorRef,
    /// f32 first moments, updated.
    pub m: TensorRef,
    /// f32 second moments, updated.
    pub v: TensorRef,
    /// f32 gradients.
    pub grads: TensorRef,
    /// The working copy to write, if any.
    pub copy_out: Option<TensorRef>,
    /// The precision the working copy is rounded to (its own dtype, or f32 holding
    /// bf16 or f16 values on a device that computes in f32).
    pub round: Dtype,
    /// With weight decay.
    pub decay: bool,
}

impl AdamWKernel {
    /// The step's constants from `scalars`, or an error when they are missing.
    fn step(&self, scalars: &Scalars) -> Result<AdamStep, KernelError> {
        if self.decay {
            scalars.adam
        } else {
            scalars.adam_no_decay
        }
        .ok_or(KernelError::NoAdamStep)
    }
}

impl Signature for AdamWKernel {
    const NAME: &'static str = "adamw";
    /// Elements.
    type Shape = usize;

    fn shape(&self) -> Result<usize, KernelError> {
        Ok(self.params.len)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (f32_, n) = (
            DtypeRule::Exactly(Dtype::F32),
            LenRule::Len(self.params.len),
        );
        each(Param::write("params", &self.params, f32_, n));
        each(Param::write("m", &self.m, f32_, n));
        each(Param::write("v", &self.v, f32_, n));
        if let Some(out) = &self.copy_out {
            let copies = DtypeRule::OneOf(&[Dtype::Bf16, Dtype::F16, Dtype::F32]);
            each(Param::write("copy_out", out, copies, n));
        }
        each(Param::read("grads", &self.grads, f32_, n));
    }

    fn flops(&self) -> f64 {
        12.0 * self.params.len as f64
    }
}

impl CpuKernel for AdamWKernel {
    fn run_cpu(
        &self,
        _: &usize,
        cpu: &Cpu,
        scalars: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        if scalars.skip_update {
            return Ok(());
        }
        let step = self.step(scalars)?;
        let params = t.f32_mut(&self.params);
        let state = State::F32 {
            m: t.f32_mut(&self.m),
            v: t.f32_mut(&self.v),
        };
        let grads = Grads::F32(t.f32(&self.grads));
        let (isa, threads) = (cpu.isa, cpu.threads);
        match &self.copy_out {
            None => step.apply(isa, threads, params, state, grads, CopyOut::None)?,
            Some(out) if out.dtype == Dtype::Bf16 => {
                let copy = CopyOut::Bf16(t.bf16_mut(out));
                step.apply(isa, threads, params, state, grads, copy)?
            }
            Some(out) if out.dtype == Dtype::F16 => {
                let copy = CopyOut::F16(t.f16_mut(out));
                step.apply(isa, threads, params, state, grads, copy)?
            }
            Some(out) => {
                // A working copy in f32 (the CPU computes in f32), rounded to `round`.
                step.apply(isa, threads, params, state, grads, CopyOut::None)?;
                round_into_f32(cpu, self.round, params, t.f32_mut(out));
            }
        }
        Ok(())
    }
}

impl CudaKernel for AdamWKernel {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[ADAMW_STEP];

    fn launch(&self, &n: &usize, scalars: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        let (copy_out, mode) = match &self.copy_out {
            None => (Arg::Ptr(0), CopyMode::None),
            Some(out) => (q.ptr(out), CopyMode::of(out.dtype, self.round)),
        };
        if scalars.skip_update {
            return Ok(());
        }
        let constants = AdamConstants::from(&self.step(scalars)?);
        // adamw_step(float* params, float* m, float* v, const float* grads, void*
        // copy_out, int copy_mode, int fused, AdamConstants k, long long n): n elements
        // of each tensor, and of copy_out only in the mode its dtype was checked for;
        // fused as this process's CPU AdamW rounds, so both compute the same bits.
        let fused = Isa::active().fuses_multiply_add();
        let args = [
            q.ptr(&self.params),
            q.ptr(&self.m),
            q.ptr(&self.v),
            q.ptr(&self.grads),
            copy_out,
            Arg::Int(mode as i32),
            Arg::Int(i32::from(fused)),
            Arg::Adam(constants),
            long(n),
        ];
        Ok(q.launch(ADAMW_STEP, per_element(n), &args)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::launch::tests::{Emulated, Layout};

    impl Emulated for GradStatsKernel {
        fn samples(_: Dtype, l: &mut Layout) -> Vec<Self> {
            [0, 1, 4097, 300_001]
                .map(|len| GradStatsKernel {
                    grads: l.tensor(len, Dtype::F32),
                    out: l.tensor(16, Dtype::U8),
                    scratch: l.tensor(grad_stats_scratch_bytes(Target::Cuda, len), Dtype::U8),
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            let n = self.grads.len;
            vec![("n", n), ("count", grad_stats_pieces(n))]
        }

        fn floats(&self, scalars: &Scalars) -> Vec<(&'static str, f32)> {
            vec![("scale", scalars.stats_scale)]
        }

        fn accepted(entry: &str, param: &str) -> Option<&'static [&'static str]> {
            let pass = matches!(entry, "grad_stats_partials" | "grad_stats_total");
            (pass && param == "partials").then_some(&["scratch"])
        }
    }

    impl Emulated for AdamWKernel {
        fn samples(_: Dtype, l: &mut Layout) -> Vec<Self> {
            let copies = [
                (None, Dtype::F32),
                (Some(Dtype::Bf16), Dtype::Bf16),
                (Some(Dtype::F16), Dtype::F16),
                (Some(Dtype::F32), Dtype::F32),
                (Some(Dtype::F32), Dtype::Bf16),
                (Some(Dtype::F32), Dtype::F16),
            ];
            let mut out = Vec::new();
            for (copy, round) in copies {
                for decay in [true, false] {
                    out.push(AdamWKernel {
                        params: l.tensor(22, Dtype::F32),
                        m: l.tensor(22, Dtype::F32),
                        v: l.tensor(22, Dtype::F32),
                        grads: l.tensor(22, Dtype::F32),
                        copy_out: copy.map(|dtype| l.tensor(22, dtype)),
                        round,
                        decay,
                    });
                }
            }
            out
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            // adamw.cu's COPY_* for the copy's dtype and rounding.
            let mode = match (self.copy_out.map(|c| c.dtype), self.round) {
                (None, _) => 0,
                (Some(Dtype::Bf16), _) => 1,
                (Some(Dtype::F16), _) => 2,
                (Some(_), Dtype::Bf16) => 4,
                (Some(_), Dtype::F16) => 5,
                (Some(_), _) => 3,
            };
            // adamw.cu's rounding: this process's CPU AdamW's.
            let fused = usize::from(Isa::active().fuses_multiply_add());
            vec![
                ("n", self.params.len),
                ("copy_mode", mode),
                ("fused", fused),
            ]
        }
    }

    #[test]
    fn grad_stats_round_trip_through_their_bytes() {
        let stats = GradStats {
            sum_squares: 12.5,
            non_finite: true,
        };
        let mut bytes = [0u8; 16];
        write_stats(&mut bytes, stats);
        assert_eq!(read_stats(&bytes), stats);
    }
}
