//! GPT-2's fused attention with O(T) memory: [`FlashAttention`] and its backward over the
//! fused qkv activation (B, T, 3C), the same recurrence as grouped-query attention's
//! fused kernels with as many key/value heads as query heads (`flash.rs`), their CPU op
//! [`flash_attention_forward`]/[`flash_attention_backward`] (`cpu.rs`, q, k and v read at
//! stride 3C), their CUDA kernels `flash_attention.cu`'s under the fused layout
//! (`QkvLayout::fused`).

use super::cpu::{GqaDims, flash_attention_backward, flash_attention_forward, flash_scratch_len};
use super::flash::{
    BACKWARD_DKV, BACKWARD_DQ, FORWARD, FlashMask, QkvLayout, SOURCE, launch_backward,
    launch_forward, scratch_param,
};
use super::shape::Heads;
use crate::cuda::launch::{CudaKernel, CudaSource, Entry, Launch};
use crate::ops::Cpu;
use crate::program::{
    CpuKernel, CpuTensors, Dtype, DtypeRule, KernelError, LenRule, Param, Scalars, Signature,
    TensorRef,
};

/// GPT-2's heads as grouped-query attention's dimensions (KV = H = NH, D = C / NH),
/// checked.
fn dims(
    kernel: &'static str,
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> Result<GqaDims, KernelError> {
    Heads::checked(kernel, b, t, c, nh)?;
    Ok(GqaDims::multi_head(b, t, c, nh))
}

/// Fused causal self-attention scaled by 1/sqrt(C/NH) under `mask`: out (B, T, C) and
/// lse (B, NH, T), the log of each row's softmax denominator, from qkv (B, T, 3C); the
/// same output as [`Attention`](super::Attention) to rounding, without its probabilities.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlashAttention {
    /// (B, T, C).
    pub out: TensorRef,
    /// (B, NH, T) f32.
    pub lse: TensorRef,
    /// (B, T, 3C).
    pub qkv: TensorRef,
    /// [`flash_scratch_bytes`](super::flash_scratch_bytes) bytes (U8) on the CPU; none on CUDA.
    pub scratch: TensorRef,
    /// Batch.
    pub b: usize,
    /// Sequence.
    pub t: usize,
    /// Channels.
    pub c: usize,
    /// Heads.
    pub nh: usize,
    /// The keys each query sees.
    pub mask: FlashMask,
}

impl Signature for FlashAttention {
    const NAME: &'static str = "flash-attention";
    type Shape = GqaDims;

    fn shape(&self) -> Result<GqaDims, KernelError> {
        dims(Self::NAME, self.b, self.t, self.c, self.nh)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, (b, t, c, nh)) = (DtypeRule::Working, (self.b, self.t, self.c, self.nh));
        let f32_ = DtypeRule::Exactly(Dtype::F32);
        let s = GqaDims::multi_head(b, t, c, nh);
        each(Param::write("out", &self.out, w, LenRule::Len(b * t * c)));
        each(Param::write(
            "lse",
            &self.lse,
            f32_,
            LenRule::Len(b * nh * t),
        ));
        each(scratch_param(&self.scratch, s, false));
        each(Param::read(
            "qkv",
            &self.qkv,
            w,
            LenRule::Len(3 * b * t * c),
        ));
        self.mask.param(&s, each);
    }

    fn flops(&self) -> f64 {
        // Q K^T and P V over the keys each query sees: about half of T x T when causal.
        2.0 * (self.b * self.t * self.t * self.c) as f64
    }
}

impl CpuKernel for FlashAttention {
    fn run_cpu(
        &self,
        s: &GqaDims,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let (out, lse) = (t.f32_mut(&self.out), t.f32_mut(&self.lse));
        let scratch = t.f32_scratch(&self.scratch, flash_scratch_len(*s));
        let dims = (self.b, self.t, self.c, self.nh);
        let mask = self.mask.on_cpu(t);
        flash_attention_forward(cpu, (out, lse, scratch), t.f32(&self.qkv), dims, mask);
        Ok(())
    }
}

impl CudaKernel for FlashAttention {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[FORWARD];

    fn launch(&self, s: &GqaDims, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        let tensors = [&self.out, &self.lse, &self.qkv, &self.qkv, &self.qkv];
        let layout = (s, QkvLayout::fused(self.c), &self.mask);
        launch_forward(Self::NAME, tensors, layout, q)
    }
}

/// dqkv: (B, T, 3C) = (overwritten) the gradient of [`FlashAttention`] given dout
/// (B, T, C), from qkv and the forward's out and lse, under the same mask.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlashAttentionBackward {
    /// (B, T, 3C), overwritten.
    pub dqkv: TensorRef,
    /// (B, T, C).
    pub dout: TensorRef,
    /// (B, T, 3C).
    pub qkv: TensorRef,
    /// (B, T, C), as the forward wrote it.
    pub out: TensorRef,
    /// (B, NH, T) f32, as the forward wrote it.
    pub lse: TensorRef,
    /// [`flash_scratch_bytes`](super::flash_scratch_bytes) bytes (U8) of the target.
    pub scratch: TensorRef,
    /// Batch.
    pub b: usize,
    /// Sequence.
    pub t: usize,
    /// Channels.
    pub c: usize,
    /// Heads.
    pub nh: usize,
    /// The keys each query sees, as in the forward.
    pub mask: FlashMask,
}

impl Signature for FlashAttentionBackward {
    const NAME: &'static str = "flash-attention-backward";
    type Shape = GqaDims;

    fn shape(&self) -> Result<GqaDims, KernelError> {
        dims(Self::NAME, self.b, self.t, self.c, self.nh)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, (b, t, c, nh)) = (DtypeRule::Working, (self.b, self.t, self.c, self.nh));
        let f32_ = DtypeRule::Exactly(Dtype::F32);
        let s = GqaDims::multi_head(b, t, c, nh);
        let rows = LenRule::Len(b * t * c);
        each(Param::write(
            "dqkv",
            &self.dqkv,
            w,
            LenRule::Len(3 * b * t * c),
        ));
        each(scratch_param(&self.scratch, s, true));
        each(Param::read("dout", &self.dout, w, rows));
        each(Param::read(
            "qkv",
            &self.qkv,
            w,
            LenRule::Len(3 * b * t * c),
        ));
        each(Param::read("out", &self.out, w, rows));
        each(Param::read(
            "lse",
            &self.lse,
            f32_,
            LenRule::Len(b * nh * t),
        ));
        self.mask.param(&s, each);
    }

    fn flops(&self) -> f64 {
        // The scores again, dP = dO V^T, dV, dQ and dK: five products of half of T x T.
        5.0 * (self.b * self.t * self.t * self.c) as f64
    }
}

impl CpuKernel for FlashAttentionBackward {
    fn run_cpu(
        &self,
        s: &GqaDims,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let dqkv = t.f32_mut(&self.dqkv);
        let scratch = t.f32_scratch(&self.scratch, flash_scratch_len(*s));
        let inputs = (t.f32(&self.dout), t.f32(&self.qkv));
        let fwd = (t.f32(&self.out), t.f32(&self.lse));
        let dims = (self.b, self.t, self.c, self.nh);
        let mask = self.mask.on_cpu(t);
        flash_attention_backward(cpu, dqkv, scratch, inputs, fwd, dims, mask);
        Ok(())
    }
}

impl CudaKernel for FlashAttentionBackward {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[BACKWARD_DQ, BACKWARD_DKV];

    fn launch(&self, s: &GqaDims, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        let grads = [&self.dqkv, &self.dqkv, &self.dqkv];
        let inputs = [
            &self.dout,
            &self.qkv,
            &self.qkv,
            &self.qkv,
            &self.out,
            &self.lse,
            &self.scratch,
        ];
        let layout = (s, QkvLayout::fused(self.c), &self.mask);
        launch_backward(Self::NAME, grads, inputs, layout, q)
    }
}
