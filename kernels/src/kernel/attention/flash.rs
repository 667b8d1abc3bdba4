//! Fused grouped-query attention, forward and backward, with O(T) memory (and what
//! GPT-2's fused kernels, `flash_gpt2.rs`, share with it): the kernels the Llama family
//! runs (FlashAttention-2's recurrence; no (B, H, T, T) probabilities,
//! only each row's log-sum-exp kept for the backward), causal, under an optional sliding
//! window and document boundaries ([`FlashMask`]). Their CPU op is
//! [`gqa_flash_attention_forward`]/[`gqa_flash_attention_backward`] (`cpu.rs`); their
//! CUDA kernels are `flash_attention.cu`'s, one warp per row. The materialised kernels
//! ([`GqaAttention`](super::GqaAttention)) are the reference both are tested against.

use super::cpu::{
    AttnMask, GqaDims, flash_scratch_len, gqa_flash_attention_backward, gqa_flash_attention_forward,
};
use crate::cuda::launch::{Arg, CudaKernel, CudaSource, Entry, Launch, int, long, per_row_warp};
use crate::ops::Cpu;
use crate::program::{
    ByteRule, CpuKernel, CpuTensors, Dtype, DtypeRule, KernelError, LenRule, Param, Scalars,
    Signature, Target, TensorRef,
};

/// The fused kernels' CUDA source.
pub(super) const SOURCE: CudaSource = ("flash_attention.cu", include_str!("flash_attention.cu"));
/// out and lse, one warp per query row.
pub(super) const FORWARD: Entry = Entry::typed("flash_forward");
/// dq and delta, one warp per query row.
pub(super) const BACKWARD_DQ: Entry = Entry::typed("flash_backward_dq");
/// dk and dv, one warp per key row.
pub(super) const BACKWARD_DKV: Entry = Entry::typed("flash_backward_dkv");
/// The most channels per head the CUDA kernels take (`FLASH_MAX_D` of the source).
pub const FLASH_CUDA_MAX_D: usize = 256;

/// Which keys each query sees besides the causal rule: the last `window` (0: every
/// earlier key), and only its own document's when `doc_start` is given ((B, T) u32, the
/// first position of each token's document; see [`AttnMask::doc_start`]).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct FlashMask {
    /// Keys a query sees, itself included; 0: no window.
    pub window: usize,
    /// (B, T) u32 document starts, or one document per sequence.
    pub doc_start: Option<TensorRef>,
}

impl FlashMask {
    /// Every earlier key.
    pub const CAUSAL: FlashMask = FlashMask {
        window: 0,
        doc_start: None,
    };

    pub(super) fn param<'a>(&'a self, s: &GqaDims, each: &mut dyn FnMut(Param<'a>)) {
        if let Some(d) = &self.doc_start {
            let u32_ = DtypeRule::Exactly(Dtype::U32);
            each(Param::read("doc_start", d, u32_, LenRule::Len(s.b * s.t)));
        }
    }

    pub(super) fn on_cpu<'m>(&self, t: &CpuTensors<'m>) -> AttnMask<'m> {
        AttnMask {
            window: (self.window > 0).then_some(self.window),
            doc_start: self.doc_start.as_ref().map(|d| t.u32(d)),
        }
    }

    /// `doc_start`'s address (0 when none) and the window, as the `.cu` kernels take them.
    fn args(&self, q: &Launch<'_>) -> (Arg, Arg) {
        let doc = self.doc_start.as_ref().map_or(Arg::Ptr(0), |d| q.ptr(d));
        (doc, int(self.window))
    }
}

/// Bytes of scratch the fused kernels need on `target`: on the CPU [`flash_scratch_len`]
/// f32s (a tile's worth per (batch, head) pair, no more once T fills a tile); on CUDA the
/// backward's (B, H, T) f32 row sums of dout * out (the forward needs none).
pub fn flash_scratch_bytes(target: Target, dims: GqaDims) -> usize {
    match target {
        Target::Cpu => flash_scratch_len(dims) * 4,
        Target::Cuda => dims.b * dims.h * dims.t * 4,
    }
}

/// A fused kernel's `scratch` parameter: [`flash_scratch_bytes`] on the CPU; on CUDA
/// the backward's, none for the forward.
pub(super) fn scratch_param(scratch: &TensorRef, dims: GqaDims, backward: bool) -> Param<'_> {
    let cpu = flash_scratch_bytes(Target::Cpu, dims);
    let cuda = if backward {
        flash_scratch_bytes(Target::Cuda, dims)
    } else {
        0
    };
    Param::scratch("scratch", scratch, ByteRule::scratch(cpu, cuda, 4))
}

/// The channels-per-head limit of the CUDA kernels, as a shape error.
fn cuda_head_dim(kernel: &'static str, d: usize) -> Result<(), KernelError> {
    if d > FLASH_CUDA_MAX_D {
        return Err(KernelError::Shape {
            kernel,
            what: "d (channels per head, at most 256 on CUDA)",
            len: d,
            expected: FLASH_CUDA_MAX_D,
        });
    }
    Ok(())
}

/// Where a layout keeps q, k and v (and their gradients), as `flash_attention.cu`'s
/// `FlashLayout`: rows of `ldq` (q) and `ldkv` (k, v) elements per token, k and v from
/// `koff` and `voff` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct QkvLayout {
    pub(super) ldq: usize,
    pub(super) ldkv: usize,
    pub(super) koff: usize,
    pub(super) voff: usize,
}

impl QkvLayout {
    /// Grouped-query attention's separate q (B, T, H, D) and k, v (B, T, KV, D).
    pub(super) fn separate(s: &GqaDims) -> Self {
        QkvLayout {
            ldq: s.h * s.d,
            ldkv: s.kv * s.d,
            koff: 0,
            voff: 0,
        }
    }

    /// GPT-2's fused qkv (B, T, 3C), handed as q, k and v alike.
    pub(super) fn fused(c: usize) -> Self {
        QkvLayout {
            ldq: 3 * c,
            ldkv: 3 * c,
            koff: c,
            voff: 2 * c,
        }
    }

    /// The `.cu` kernels' `b, t, h, kv, d, ldq, ldkv, koff, voff`.
    fn args(&self, s: &GqaDims) -> [Arg; 9] {
        [
            int(s.b),
            int(s.t),
            int(s.h),
            int(s.kv),
            int(s.d),
            long(self.ldq),
            long(self.ldkv),
            long(self.koff),
            long(self.voff),
        ]
    }
}

/// The query rows (B·H·T) a launch covers, none when there is nothing to compute;
/// refused past the CUDA kernels' channels per head.
fn launched_rows(kernel: &'static str, s: &GqaDims) -> Result<Option<usize>, KernelError> {
    cuda_head_dim(kernel, s.d)?;
    let rows = s.b * s.h * s.t;
    Ok((rows > 0 && s.d > 0).then_some(rows))
}

/// Enqueues the forward: out and lse from q, k, v at `layout`, under `mask`.
pub(super) fn launch_forward(
    kernel: &'static str,
    [out, lse, xq, xk, xv]: [&TensorRef; 5],
    (s, layout, mask): (&GqaDims, QkvLayout, &FlashMask),
    q: &mut Launch<'_>,
) -> Result<(), KernelError> {
    let Some(rows) = launched_rows(kernel, s)? else {
        return Ok(());
    };
    let (doc, window) = mask.args(q);
    // flash_forward_<T>(T* out, float* lse, const T* q, const T* k, const T* v, const
    // unsigned* doc_start, int b, int t, int h, int kv, int d, long long ldq, long long
    // ldkv, long long koff, long long voff, int window, float scale): warp `row` < B·H·T
    // writes row `row` of lse and its query's row of out.
    let mut args = vec![q.ptr(out), q.ptr(lse), q.ptr(xq), q.ptr(xk), q.ptr(xv), doc];
    args.extend(layout.args(s));
    args.extend([window, Arg::Float(1.0 / (s.d as f32).sqrt())]);
    Ok(q.launch(FORWARD, per_row_warp(rows), &args)?)
}

/// Enqueues the backward: dq, dk, dv (at `layout`, as q, k, v) from dout, q, k, v, out
/// and lse under `mask`, through the (B, H, T) f32 row sums at the start of `scratch`.
pub(super) fn launch_backward(
    kernel: &'static str,
    [dq, dk, dv]: [&TensorRef; 3],
    [dout, xq, xk, xv, out, lse, scratch]: [&TensorRef; 7],
    (s, layout, mask): (&GqaDims, QkvLayout, &FlashMask),
    q: &mut Launch<'_>,
) -> Result<(), KernelError> {
    let Some(rows) = launched_rows(kernel, s)? else {
        return Ok(());
    };
    let delta = Arg::Ptr(q.carve(scratch, 0, rows * 4));
    let (doc, window) = mask.args(q);
    let scale = Arg::Float(1.0 / (s.d as f32).sqrt());
    let [dout, xq, xk, xv, lse] = [dout, xq, xk, xv, lse].map(|x| q.ptr(x));
    // flash_backward_dq_<T>(T* dq, float* delta, const T* dout, const T* out, const T* q,
    // const T* k, const T* v, const float* lse, const unsigned* doc_start, int b, int t,
    // int h, int kv, int d, long long ldq, long long ldkv, long long koff, long long voff,
    // int window, float scale): warp `row` < B·H·T writes row `row` of delta and its
    // query's row of dq.
    let mut args = vec![q.ptr(dq), delta, dout, q.ptr(out), xq, xk, xv, lse, doc];
    args.extend(layout.args(s));
    args.extend([window, scale]);
    q.launch(BACKWARD_DQ, per_row_warp(rows), &args)?;
    // flash_backward_dkv_<T>(T* dk, T* dv, const T* dout, const T* q, const T* k, const T*
    // v, const float* lse, const float* delta, then as flash_backward_dq from doc_start
    // on): warp `row` < B·KV·T writes its key's rows of dk and dv.
    let mut args = vec![q.ptr(dk), q.ptr(dv), dout, xq, xk, xv, lse, delta, doc];
    args.extend(layout.args(s));
    args.extend([window, scale]);
    Ok(q.launch(BACKWARD_DKV, per_row_warp(s.b * s.kv * s.t), &args)?)
}

/// Fused causal grouped-query attention scaled by 1/sqrt(D) under `mask`: out
/// (B, T, H, D) and lse (B, H, T), the log of each row's softmax denominator, from q
/// (B, T, H, D) and k, v (B, T, KV, D); the same output as
/// [`GqaAttention`](super::GqaAttention) to rounding, without its probabilities.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GqaFlashAttention {
    /// (B, T, H, D).
    pub out: TensorRef,
    /// (B, H, T) f32.
    pub lse: TensorRef,
    /// (B, T, H, D).
    pub q: TensorRef,
    /// (B, T, KV, D).
    pub k: TensorRef,
    /// (B, T, KV, D).
    pub v: TensorRef,
    /// [`flash_scratch_bytes`] bytes (U8) on the CPU; none on CUDA.
    pub scratch: TensorRef,
    /// The dimensions.
    pub dims: GqaDims,
    /// The keys each query sees.
    pub mask: FlashMask,
}

impl Signature for GqaFlashAttention {
    const NAME: &'static str = "gqa-flash-attention";
    type Shape = GqaDims;

    fn shape(&self) -> Result<GqaDims, KernelError> {
        let GqaDims { b, t, h, kv, d } = self.dims;
        GqaDims::checked(Self::NAME, b, t, h, kv, d)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, s) = (DtypeRule::Working, &self.dims);
        let (queries, keys) = (LenRule::Len(s.q_len()), LenRule::Len(s.kv_len()));
        let f32_ = DtypeRule::Exactly(Dtype::F32);
        each(Param::write("out", &self.out, w, queries));
        each(Param::write(
            "lse",
            &self.lse,
            f32_,
            LenRule::Len(s.b * s.h * s.t),
        ));
        each(scratch_param(&self.scratch, *s, false));
        each(Param::read("q", &self.q, w, queries));
        each(Param::read("k", &self.k, w, keys));
        each(Param::read("v", &self.v, w, keys));
        self.mask.param(s, each);
    }

    fn flops(&self) -> f64 {
        // Q K^T and P V over the keys each query sees: about half of T x T when causal.
        2.0 * (self.dims.b * self.dims.t * self.dims.t * self.dims.h * self.dims.d) as f64
    }
}

impl CpuKernel for GqaFlashAttention {
    fn run_cpu(
        &self,
        s: &GqaDims,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let (out, lse) = (t.f32_mut(&self.out), t.f32_mut(&self.lse));
        let scratch = t.f32_scratch(&self.scratch, flash_scratch_len(*s));
        let (q, k, v) = (t.f32(&self.q), t.f32(&self.k), t.f32(&self.v));
        let mask = self.mask.on_cpu(t);
        gqa_flash_attention_forward(cpu, (out, lse, scratch), (q, k, v), *s, mask);
        Ok(())
    }
}

impl CudaKernel for GqaFlashAttention {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[FORWARD];

    fn launch(&self, s: &GqaDims, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        let tensors = [&self.out, &self.lse, &self.q, &self.k, &self.v];
        let layout = (s, QkvLayout::separate(s), &self.mask);
        launch_forward(Self::NAME, tensors, layout, q)
    }
}

/// dq (B, T, H, D), dk, dv (B, T, KV, D) = (overwritten) the gradients of
/// [`GqaFlashAttention`] given dout, from its inputs and its out and lse, under the
/// same mask. A key/value head's gradients add up over the query heads that share it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GqaFlashAttentionBackward {
    /// (B, T, H, D), overwritten.
    pub dq: TensorRef,
    /// (B, T, KV, D), overwritten.
    pub dk: TensorRef,
    /// (B, T, KV, D), overwritten.
    pub dv: TensorRef,
    /// (B, T, H, D).
    pub dout: TensorRef,
    /// (B, T, H, D).
    pub q: TensorRef,
    /// (B, T, KV, D).
    pub k: TensorRef,
    /// (B, T, KV, D).
    pub v: TensorRef,
    /// (B, T, H, D), as the forward wrote it.
    pub out: TensorRef,
    /// (B, H, T) f32, as the forward wrote it.
    pub lse: TensorRef,
    /// [`flash_scratch_bytes`] bytes (U8) on the CPU; on CUDA, (B, H, T) f32 (each
    /// row's sum of dout * out).
    pub scratch: TensorRef,
    /// The dimensions.
    pub dims: GqaDims,
    /// The keys each query sees, as in the forward.
    pub mask: FlashMask,
}

impl Signature for GqaFlashAttentionBackward {
    const NAME: &'static str = "gqa-flash-attention-backward";
    type Shape = GqaDims;

    fn shape(&self) -> Result<GqaDims, KernelError> {
        let GqaDims { b, t, h, kv, d } = self.dims;
        GqaDims::checked(Self::NAME, b, t, h, kv, d)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, s) = (DtypeRule::Working, &self.dims);
        let (queries, keys) = (LenRule::Len(s.q_len()), LenRule::Len(s.kv_len()));
        let rows = LenRule::Len(s.b * s.h * s.t);
        each(Param::write("dq", &self.dq, w, queries));
        each(Param::write("dk", &self.dk, w, keys));
        each(Param::write("dv", &self.dv, w, keys));
        each(scratch_param(&self.scratch, *s, true));
        each(Param::read("dout", &self.dout, w, queries));
        each(Param::read("q", &self.q, w, queries));
        each(Param::read("k", &self.k, w, keys));
        each(Param::read("v", &self.v, w, keys));
        each(Param::read("out", &self.out, w, queries));
        let f32_ = DtypeRule::Exactly(Dtype::F32);
        each(Param::read("lse", &self.lse, f32_, rows));
        self.mask.param(s, each);
    }

    fn flops(&self) -> f64 {
        // The scores again, dP = dO V^T, dV, dQ and dK: five products of half of T x T.
        5.0 * (self.dims.b * self.dims.t * self.dims.t * self.dims.h * self.dims.d) as f64
    }
}

impl CpuKernel for GqaFlashAttentionBackward {
    fn run_cpu(
        &self,
        s: &GqaDims,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let grads = (
            t.f32_mut(&self.dq),
            t.f32_mut(&self.dk),
            t.f32_mut(&self.dv),
        );
        let scratch = t.f32_scratch(&self.scratch, flash_scratch_len(*s));
        let (q, k, v) = (t.f32(&self.q), t.f32(&self.k), t.f32(&self.v));
        let fwd = (t.f32(&self.out), t.f32(&self.lse));
        let mask = self.mask.on_cpu(t);
        let dout = t.f32(&self.dout);
        gqa_flash_attention_backward(cpu, grads, scratch, dout, (q, k, v), fwd, *s, mask);
        Ok(())
    }
}

impl CudaKernel for GqaFlashAttentionBackward {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[BACKWARD_DQ, BACKWARD_DKV];

    fn launch(&self, s: &GqaDims, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        let grads = [&self.dq, &self.dk, &self.dv];
        let inputs = [
            &self.dout,
            &self.q,
            &self.k,
            &self.v,
            &self.out,
            &self.lse,
            &self.scratch,
        ];
        let layout = (s, QkvLayout::separate(s), &self.mask);
        launch_backward(Self::NAME, grads, inputs, layout, q)
    }
}

#[cfg(test)]
mod tests;
