//! Causal attention, forward and backward: GPT-2's multi-head attention over its fused
//! qkv and the Llama family's grouped-query attention. Here: the kernels' signatures,
//! and their two runners' dispatch. Their shapes and the scratch they need per target are
//! in `shape.rs`, the CPU ops in [`cpu`], the CUDA launch sequences (cuBLAS's batched
//! products around `attention.cu`'s layout and softmax kernels) in `cuda.rs`;
//! [`reference`](mod@reference) holds the scalar reference. The fused kernels the Llama
//! family runs, with O(T) memory, are in `flash.rs`, GPT-2's in `flash_gpt2.rs` (their
//! CUDA kernels in `flash_attention.cu`).

use crate::cuda::launch::{CudaKernel, CudaSource, Entry, Launch};
use crate::ops::Cpu;
use crate::program::{
    ByteRule, CpuKernel, CpuTensors, DtypeRule, KernelError, LenRule, Param, Scalars, Signature,
    Target, TensorRef,
};

pub mod cpu;
mod cuda;
mod documents;
mod flash;
mod flash_gpt2;
pub mod reference;
mod shape;

pub use cpu::{
    AttnMask, GqaDims, attention_backward, attention_forward, flash_attention_backward,
    flash_attention_forward, flash_scratch_len, gqa_attention_backward, gqa_attention_forward,
    gqa_flash_attention_backward, gqa_flash_attention_forward,
};
pub use documents::{DocStarts, doc_starts};
pub use flash::{
    FLASH_CUDA_MAX_D, FlashMask, GqaFlashAttention, GqaFlashAttentionBackward, flash_scratch_bytes,
};
pub use flash_gpt2::{FlashAttention, FlashAttentionBackward};
use shape::scores;
pub use shape::{
    ATTENTION_SCRATCH_ALIGN, AttentionScratchLayout, Heads, attention_scratch_bytes,
    attention_scratch_layout, gqa_attention_scratch_bytes, gqa_attention_scratch_layout,
};

/// The family's CUDA kernels.
const SOURCE: CudaSource = ("attention.cu", include_str!("attention.cu"));

/// Causal self-attention, scaled by 1/sqrt(C/NH): out: (B, T, C), att: (B, NH, T, T)
/// (the softmax, kept for the backward), from qkv: (B, T, 3C).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Attention {
    /// (B, T, C).
    pub out: TensorRef,
    /// (B, NH, T, T).
    pub att: TensorRef,
    /// (B, T, 3C).
    pub qkv: TensorRef,
    /// [`attention_scratch_bytes`] bytes (U8).
    pub scratch: TensorRef,
    /// Batch.
    pub b: usize,
    /// Sequence.
    pub t: usize,
    /// Channels.
    pub c: usize,
    /// Heads.
    pub nh: usize,
}

impl Signature for Attention {
    const NAME: &'static str = "attention";
    type Shape = Heads;

    fn shape(&self) -> Result<Heads, KernelError> {
        Heads::checked(Self::NAME, self.b, self.t, self.c, self.nh)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, (b, t, c, nh)) = (DtypeRule::Working, (self.b, self.t, self.c, self.nh));
        let cuda = attention_scratch_bytes(Target::Cuda, self.out.dtype, b, t, c, nh);
        each(Param::write("out", &self.out, w, LenRule::Len(b * t * c)));
        each(Param::write(
            "att",
            &self.att,
            w,
            LenRule::Len(scores(b, nh, t)),
        ));
        // The CPU's forward needs no scratch.
        each(Param::scratch(
            "scratch",
            &self.scratch,
            ByteRule::scratch(0, cuda, 4),
        ));
        each(Param::read(
            "qkv",
            &self.qkv,
            w,
            LenRule::Len(3 * b * t * c),
        ));
    }

    fn flops(&self) -> f64 {
        // Q K^T and att V, each B × NH × T × T × HS multiply-adds (causal: computed in
        // full by the kernels).
        4.0 * (self.b * self.t * self.t * self.c) as f64
    }
}

impl CpuKernel for Attention {
    fn run_cpu(
        &self,
        s: &Heads,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let (out, att, qkv) = (t.f32_mut(&self.out), t.f32_mut(&self.att), t.f32(&self.qkv));
        attention_forward(cpu, out, att, qkv, s.b, s.t, s.c, s.nh);
        Ok(())
    }
}

impl CudaKernel for Attention {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[cuda::SPLIT, cuda::SOFTMAX_FORWARD, cuda::HEADS];

    fn launch(&self, s: &Heads, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        cuda::attention_forward([&self.out, &self.att, &self.qkv, &self.scratch], s, q)
    }
}

/// dqkv: (B, T, 3C) = (overwritten) the gradient, given dout: (B, T, C).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionBackward {
    /// (B, T, 3C), overwritten.
    pub dqkv: TensorRef,
    /// (B, T, C).
    pub dout: TensorRef,
    /// (B, T, 3C).
    pub qkv: TensorRef,
    /// (B, NH, T, T), zero above the diagonal, as [`Attention`] leaves it (the CUDA
    /// kernels read it whole).
    pub att: TensorRef,
    /// [`attention_scratch_bytes`] bytes (U8).
    pub scratch: TensorRef,
    /// Batch.
    pub b: usize,
    /// Sequence.
    pub t: usize,
    /// Channels.
    pub c: usize,
    /// Heads.
    pub nh: usize,
}

impl Signature for AttentionBackward {
    const NAME: &'static str = "attention-backward";
    type Shape = Heads;

    fn shape(&self) -> Result<Heads, KernelError> {
        Heads::checked(Self::NAME, self.b, self.t, self.c, self.nh)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, (b, t, c, nh)) = (DtypeRule::Working, (self.b, self.t, self.c, self.nh));
        let dtype = self.dqkv.dtype;
        let (cpu, cuda) = (
            attention_scratch_bytes(Target::Cpu, dtype, b, t, c, nh),
            attention_scratch_bytes(Target::Cuda, dtype, b, t, c, nh),
        );
        each(Param::write(
            "dqkv",
            &self.dqkv,
            w,
            LenRule::Len(3 * b * t * c),
        ));
        each(Param::scratch(
            "scratch",
            &self.scratch,
            ByteRule::scratch(cpu, cuda, 4),
        ));
        each(Param::read("dout", &self.dout, w, LenRule::Len(b * t * c)));
        each(Param::read(
            "qkv",
            &self.qkv,
            w,
            LenRule::Len(3 * b * t * c),
        ));
        each(Param::read(
            "att",
            &self.att,
            w,
            LenRule::Len(scores(b, nh, t)),
        ));
    }

    fn flops(&self) -> f64 {
        8.0 * (self.b * self.t * self.t * self.c) as f64
    }
}

impl CpuKernel for AttentionBackward {
    fn run_cpu(
        &self,
        s: &Heads,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let dqkv = t.f32_mut(&self.dqkv);
        let scratch = t.f32_scratch(&self.scratch, scores(s.b, s.nh, s.t));
        let (dout, qkv, att) = (t.f32(&self.dout), t.f32(&self.qkv), t.f32(&self.att));
        attention_backward(cpu, dqkv, scratch, dout, qkv, att, s.b, s.t, s.c, s.nh);
        Ok(())
    }
}

impl CudaKernel for AttentionBackward {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] =
        &[cuda::SPLIT, cuda::HEADS, cuda::SOFTMAX_BACKWARD, cuda::JOIN];

    fn launch(&self, s: &Heads, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        let tensors = [&self.dqkv, &self.dout, &self.qkv, &self.att, &self.scratch];
        cuda::attention_backward(tensors, s, q)
    }
}

/// Causal grouped-query attention scaled by 1/sqrt(D): out: (B, T, H, D) and att:
/// (B, H, T, T) (the softmax, zero above the diagonal, kept for the backward) from
/// q: (B, T, H, D) and k, v: (B, T, KV, D), KV dividing H; query head h reads
/// key/value head h / (H / KV). KV = H is multi-head attention.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GqaAttention {
    /// (B, T, H, D).
    pub out: TensorRef,
    /// (B, H, T, T).
    pub att: TensorRef,
    /// (B, T, H, D).
    pub q: TensorRef,
    /// (B, T, KV, D).
    pub k: TensorRef,
    /// (B, T, KV, D).
    pub v: TensorRef,
    /// [`gqa_attention_scratch_bytes`] bytes (U8).
    pub scratch: TensorRef,
    /// Batch.
    pub b: usize,
    /// Sequence.
    pub t: usize,
    /// Query heads.
    pub h: usize,
    /// Key/value heads.
    pub kv: usize,
    /// Channels per head.
    pub d: usize,
}

impl GqaAttention {
    /// Its dimensions, unchecked.
    fn dims(&self) -> GqaDims {
        let (b, t, h, kv, d) = (self.b, self.t, self.h, self.kv, self.d);
        GqaDims { b, t, h, kv, d }
    }
}

impl Signature for GqaAttention {
    const NAME: &'static str = "gqa-attention";
    type Shape = GqaDims;

    fn shape(&self) -> Result<GqaDims, KernelError> {
        GqaDims::checked(Self::NAME, self.b, self.t, self.h, self.kv, self.d)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, s) = (DtypeRule::Working, self.dims());
        let cuda =
            gqa_attention_scratch_bytes(Target::Cuda, self.out.dtype, s.b, s.t, s.h, s.kv, s.d);
        let (queries, keys) = (LenRule::Len(s.q_len()), LenRule::Len(s.kv_len()));
        each(Param::write("out", &self.out, w, queries));
        each(Param::write("att", &self.att, w, LenRule::Len(s.att_len())));
        each(Param::scratch(
            "scratch",
            &self.scratch,
            ByteRule::scratch(0, cuda, 4),
        ));
        each(Param::read("q", &self.q, w, queries));
        each(Param::read("k", &self.k, w, keys));
        each(Param::read("v", &self.v, w, keys));
    }

    fn flops(&self) -> f64 {
        // Q K^T and att V per query head: B × H × T × T × D multiply-adds each.
        4.0 * (self.b * self.t * self.t * self.h * self.d) as f64
    }
}

impl CpuKernel for GqaAttention {
    fn run_cpu(
        &self,
        s: &GqaDims,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let (out, att) = (t.f32_mut(&self.out), t.f32_mut(&self.att));
        let (q, k, v) = (t.f32(&self.q), t.f32(&self.k), t.f32(&self.v));
        gqa_attention_forward(cpu, out, att, q, k, v, *s);
        Ok(())
    }
}

impl CudaKernel for GqaAttention {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[cuda::HEADS, cuda::SOFTMAX_FORWARD];

    fn launch(&self, s: &GqaDims, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        let (inputs, scratch) = ([&self.q, &self.k, &self.v], &self.scratch);
        cuda::gqa_attention_forward([&self.out, &self.att], inputs, scratch, *s, q)
    }
}

/// dq: (B, T, H, D), dk, dv: (B, T, KV, D) = (overwritten) the gradients of
/// [`GqaAttention`] given dout: (B, T, H, D); a key/value head's gradients add up over
/// the query heads that share it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GqaAttentionBackward {
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
    /// (B, H, T, T), as [`GqaAttention`] leaves it.
    pub att: TensorRef,
    /// [`gqa_attention_scratch_bytes`] bytes (U8).
    pub scratch: TensorRef,
    /// Batch.
    pub b: usize,
    /// Sequence.
    pub t: usize,
    /// Query heads.
    pub h: usize,
    /// Key/value heads.
    pub kv: usize,
    /// Channels per head.
    pub d: usize,
}

impl GqaAttentionBackward {
    /// Its dimensions, unchecked.
    fn dims(&self) -> GqaDims {
        let (b, t, h, kv, d) = (self.b, self.t, self.h, self.kv, self.d);
        GqaDims { b, t, h, kv, d }
    }
}

impl Signature for GqaAttentionBackward {
    const NAME: &'static str = "gqa-attention-backward";
    type Shape = GqaDims;

    fn shape(&self) -> Result<GqaDims, KernelError> {
        GqaDims::checked(Self::NAME, self.b, self.t, self.h, self.kv, self.d)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, s, dtype) = (DtypeRule::Working, self.dims(), self.dq.dtype);
        let (cpu, cuda) = (
            gqa_attention_scratch_bytes(Target::Cpu, dtype, s.b, s.t, s.h, s.kv, s.d),
            gqa_attention_scratch_bytes(Target::Cuda, dtype, s.b, s.t, s.h, s.kv, s.d),
        );
        let (queries, keys) = (LenRule::Len(s.q_len()), LenRule::Len(s.kv_len()));
        each(Param::write("dq", &self.dq, w, queries));
        each(Param::write("dk", &self.dk, w, keys));
        each(Param::write("dv", &self.dv, w, keys));
        each(Param::scratch(
            "scratch",
            &self.scratch,
            ByteRule::scratch(cpu, cuda, 4),
        ));
        each(Param::read("dout", &self.dout, w, queries));
        each(Param::read("q", &self.q, w, queries));
        each(Param::read("k", &self.k, w, keys));
        each(Param::read("v", &self.v, w, keys));
        each(Param::read("att", &self.att, w, LenRule::Len(s.att_len())));
    }

    fn flops(&self) -> f64 {
        8.0 * (self.b * self.t * self.t * self.h * self.d) as f64
    }
}

impl CpuKernel for GqaAttentionBackward {
    fn run_cpu(
        &self,
        s: &GqaDims,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let grads = [
            t.f32_mut(&self.dq),
            t.f32_mut(&self.dk),
            t.f32_mut(&self.dv),
        ];
        let [dq, dk, dv] = grads;
        let scratch = t.f32_scratch(&self.scratch, s.att_len());
        let (dout, att) = (t.f32(&self.dout), t.f32(&self.att));
        let (q, k, v) = (t.f32(&self.q), t.f32(&self.k), t.f32(&self.v));
        gqa_attention_backward(cpu, dq, dk, dv, scratch, dout, q, k, v, att, *s);
        Ok(())
    }
}

impl CudaKernel for GqaAttentionBackward {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[cuda::HEADS, cuda::SOFTMAX_BACKWARD];

    fn launch(&self, s: &GqaDims, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        let grads = [&self.dq, &self.dk, &self.dv];
        let inputs = [&self.q, &self.k, &self.v];
        cuda::gqa_attention_backward(grads, [&self.dout, &self.att], inputs, &self.scratch, *s, q)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::launch::Arg;
    use crate::cuda::launch::tests::{Emulated, Emulator, Layout, count_arg, ptr_arg};
    use crate::program::Dtype;

    /// The regions of `l` by name: (name, offset, bytes), for `queries` and `keys`
    /// elements of `dtype` per head tensor and `scores` probabilities.
    fn regions(
        l: AttentionScratchLayout,
        dtype: Dtype,
        [queries, keys, scores]: [usize; 3],
    ) -> Vec<(&'static str, usize, usize)> {
        let (q, k) = (queries * dtype.size(), keys * dtype.size());
        vec![
            ("q", l.q, q),
            ("k", l.k, k),
            ("v", l.v, k),
            ("y", l.y, q),
            ("dq", l.dq, q),
            ("dk", l.dk, k),
            ("dv", l.dv, k),
            ("scores", l.scores, scores * 4),
            ("dscores", l.dscores, scores * dtype.size()),
        ]
    }

    /// GPT-2's scratch regions for a kernel of working type `dtype`.
    fn gpt2_regions(
        dtype: Dtype,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> Vec<(&'static str, usize, usize)> {
        let l = attention_scratch_layout(dtype, b, t, c, nh);
        regions(l, dtype, [b * t * c, b * t * c, b * nh * t * t])
    }

    /// Grouped-query attention's scratch regions for a kernel of working type `dtype`.
    fn gqa_regions(dtype: Dtype, s: GqaDims) -> Vec<(&'static str, usize, usize)> {
        let l = gqa_attention_scratch_layout(dtype, s.b, s.t, s.h, s.kv, s.d);
        regions(l, dtype, [s.q_len(), s.kv_len(), s.att_len()])
    }

    /// What the `.cu` parameters may be handed, where their names differ from the roles:
    /// GPT-2's attention merges y into out and splits dout into y; grouped-query attention
    /// also moves q, k, v (tensors to regions of those names) and dq, dk, dv (regions to
    /// tensors of those names).
    fn accepted(entry: &str, param: &str) -> Option<&'static [&'static str]> {
        Some(match (entry, param) {
            ("attention_heads", "out") => &["out", "y", "q", "k", "v", "dq", "dk", "dv"],
            ("attention_heads", "inp") => &["y", "dout", "q", "k", "v", "dq", "dk", "dv"],
            ("softmax_causal_backward", "dpre") => &["dscores"],
            ("softmax_causal_backward", "datt") => &["scores"],
            _ => return None,
        })
    }

    /// The layout kernels' sizes, and both directions of moving heads.
    fn heads_dimensions(
        b: usize,
        t: usize,
        heads: &[usize],
        hs: usize,
    ) -> Vec<(&'static str, usize)> {
        let mut out = vec![("b", b), ("t", t), ("hs", hs), ("rows", b * heads[0] * t)];
        out.extend(heads.iter().map(|&h| ("nh", h)));
        out.extend([("to_heads", 0), ("to_heads", 1)]);
        out
    }

    /// (B, T, C, NH) of GPT-2's samples.
    const GPT2_SIZES: [(usize, usize, usize, usize); 3] =
        [(2, 7, 12, 3), (1, 1, 4, 1), (0, 3, 4, 2)];

    /// (B, T, H, KV, D) of grouped-query attention's samples.
    const GQA_SIZES: [(usize, usize, usize, usize, usize); 4] = [
        (2, 7, 6, 2, 12),
        (2, 5, 3, 3, 4),
        (1, 1, 2, 1, 4),
        (0, 3, 4, 2, 4),
    ];

    impl Emulated for Attention {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            GPT2_SIZES
                .map(|(b, t, c, nh)| Attention {
                    out: l.tensor(b * t * c, w),
                    att: l.tensor(b * nh * t * t, w),
                    qkv: l.tensor(3 * b * t * c, w),
                    scratch: l.tensor(
                        attention_scratch_bytes(Target::Cuda, w, b, t, c, nh),
                        Dtype::U8,
                    ),
                    b,
                    t,
                    c,
                    nh,
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            heads_dimensions(self.b, self.t, &[self.nh], self.c / self.nh)
        }

        fn scratch_regions(&self) -> Vec<(&'static str, usize, usize)> {
            gpt2_regions(self.out.dtype, self.b, self.t, self.c, self.nh)
        }

        fn accepted(entry: &str, param: &str) -> Option<&'static [&'static str]> {
            accepted(entry, param)
        }

        fn emulate(name: &str, args: &[Arg], memory: &Emulator) -> bool {
            emulate(name, args, memory)
        }
    }

    impl Emulated for AttentionBackward {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            GPT2_SIZES
                .map(|(b, t, c, nh)| AttentionBackward {
                    dqkv: l.tensor(3 * b * t * c, w),
                    dout: l.tensor(b * t * c, w),
                    qkv: l.tensor(3 * b * t * c, w),
                    att: l.tensor(b * nh * t * t, w),
                    scratch: l.tensor(
                        attention_scratch_bytes(Target::Cuda, w, b, t, c, nh),
                        Dtype::U8,
                    ),
                    b,
                    t,
                    c,
                    nh,
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            heads_dimensions(self.b, self.t, &[self.nh], self.c / self.nh)
        }

        fn floats(&self, _: &Scalars) -> Vec<(&'static str, f32)> {
            vec![("scale", 1.0 / ((self.c / self.nh) as f32).sqrt())]
        }

        fn scratch_regions(&self) -> Vec<(&'static str, usize, usize)> {
            gpt2_regions(self.dqkv.dtype, self.b, self.t, self.c, self.nh)
        }

        fn accepted(entry: &str, param: &str) -> Option<&'static [&'static str]> {
            accepted(entry, param)
        }
    }

    impl Emulated for GqaAttention {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            GQA_SIZES
                .map(|(b, t, h, kv, d)| GqaAttention {
                    out: l.tensor(b * t * h * d, w),
                    att: l.tensor(b * h * t * t, w),
                    q: l.tensor(b * t * h * d, w),
                    k: l.tensor(b * t * kv * d, w),
                    v: l.tensor(b * t * kv * d, w),
                    scratch: l.tensor(
                        gqa_attention_scratch_bytes(Target::Cuda, w, b, t, h, kv, d),
                        Dtype::U8,
                    ),
                    b,
                    t,
                    h,
                    kv,
                    d,
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            heads_dimensions(self.b, self.t, &[self.h, self.kv], self.d)
        }

        fn scratch_regions(&self) -> Vec<(&'static str, usize, usize)> {
            gqa_regions(self.out.dtype, self.dims())
        }

        fn accepted(entry: &str, param: &str) -> Option<&'static [&'static str]> {
            accepted(entry, param)
        }
    }

    impl Emulated for GqaAttentionBackward {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            GQA_SIZES
                .map(|(b, t, h, kv, d)| GqaAttentionBackward {
                    dq: l.tensor(b * t * h * d, w),
                    dk: l.tensor(b * t * kv * d, w),
                    dv: l.tensor(b * t * kv * d, w),
                    dout: l.tensor(b * t * h * d, w),
                    q: l.tensor(b * t * h * d, w),
                    k: l.tensor(b * t * kv * d, w),
                    v: l.tensor(b * t * kv * d, w),
                    att: l.tensor(b * h * t * t, w),
                    scratch: l.tensor(
                        gqa_attention_scratch_bytes(Target::Cuda, w, b, t, h, kv, d),
                        Dtype::U8,
                    ),
                    b,
                    t,
                    h,
                    kv,
                    d,
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            heads_dimensions(self.b, self.t, &[self.h, self.kv], self.d)
        }

        fn floats(&self, _: &Scalars) -> Vec<(&'static str, f32)> {
            vec![("scale", 1.0 / (self.d as f32).sqrt())]
        }

        fn scratch_regions(&self) -> Vec<(&'static str, usize, usize)> {
            gqa_regions(self.dq.dtype, self.dims())
        }

        fn accepted(entry: &str, param: &str) -> Option<&'static [&'static str]> {
            accepted(entry, param)
        }
    }

    /// For element i of a (B, NH, T, HS) tensor: the offset of the same (batch, position,
    /// head, channel) in a tensor whose rows hold `parts` × NH × HS values, in part 0
    /// (attention.cu's row_major_offset).
    fn row_major(i: usize, t: usize, nh: usize, hs: usize, parts: usize) -> usize {
        let d = i % hs;
        let r = i / hs;
        let ti = r % t;
        let r = r / t;
        let h = r % nh;
        let bi = r / nh;
        ((bi * t + ti) * parts * nh + h) * hs + d
    }

    /// The f32 layout and softmax kernels of `attention.cu`, as it reads them.
    fn emulate(name: &str, args: &[Arg], m: &Emulator) -> bool {
        let (p, n) = (|i| ptr_arg(name, args, i), |i| count_arg(name, args, i));
        match name {
            "attention_split_f32" | "attention_join_f32" => {
                let (b, t, nh, hs) = (n(4), n(5), n(6), n(7));
                let part = nh * hs;
                for i in 0..b * nh * t * hs {
                    let at = row_major(i, t, nh, hs, 3);
                    if name == "attention_split_f32" {
                        let (q, k, v, qkv) = (p(0), p(1), p(2), p(3));
                        m.store(q, i, m.load(qkv, at));
                        m.store(k, i, m.load(qkv, at + part));
                        m.store(v, i, m.load(qkv, at + 2 * part));
                    } else {
                        let (dqkv, dq, dk, dv) = (p(0), p(1), p(2), p(3));
                        m.store(dqkv, at, m.load(dq, i));
                        m.store(dqkv, at + part, m.load(dk, i));
                        m.store(dqkv, at + 2 * part, m.load(dv, i));
                    }
                }
            }
            "attention_heads_f32" => {
                let (out, inp, b, t, nh, hs, to_heads) = (p(0), p(1), n(2), n(3), n(4), n(5), n(6));
                for i in 0..b * nh * t * hs {
                    let merged = row_major(i, t, nh, hs, 1);
                    if to_heads != 0 {
                        m.store(out, i, m.load(inp, merged));
                    } else {
                        m.store(out, merged, m.load(inp, i));
                    }
                }
            }
            "softmax_causal_forward_f32" => {
                let (att, scores, rows, t) = (p(0), p(1), n(2), n(3));
                for row in 0..rows {
                    let ti = row % t;
                    let x = |j: usize| m.load(scores, row * t + j);
                    let max = (0..=ti).map(x).fold(f32::NEG_INFINITY, f32::max);
                    let s: f32 = (0..=ti).map(|j| (x(j) - max).exp()).sum();
                    for j in 0..t {
                        let a = if j <= ti { (x(j) - max).exp() / s } else { 0.0 };
                        m.store(att, row * t + j, a);
                    }
                }
            }
            "softmax_causal_backward_f32" => {
                let (dpre, datt, att, rows, t) = (p(0), p(1), p(2), n(3), n(4));
                let scale = match args[5] {
                    Arg::Float(s) => s,
                    other => panic!("{name}: scale is {other:?}"),
                };
                for row in 0..rows {
                    let ti = row % t;
                    let a = |j: usize| m.load(att, row * t + j);
                    let d = |j: usize| m.load(datt, row * t + j);
                    let dot: f32 = (0..=ti).map(|j| a(j) * d(j)).sum();
                    for j in 0..t {
                        let g = if j <= ti {
                            a(j) * (d(j) - dot) * scale
                        } else {
                            0.0
                        };
                        m.store(dpre, row * t + j, g);
                    }
                }
            }
            _ => return false,
        }
        true
    }
}
