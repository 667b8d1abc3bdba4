//! Kernels as data: what a model's block computes, as a list of [`Kernel`]s over tensors
//! that name a bound buffer and a byte range in it ([`TensorRef`]), so that one list runs
//! on any device: [`run_cpu`] calls the CPU kernels of [`crate::ops`] and
//! [`crate::adamw`]; the CUDA kernels run the same list on a stream
//! (`crate::cuda::CudaKernels::run`).
//!
//! A program never allocates: every buffer a kernel touches, scratch included, is a
//! [`TensorRef`] into memory the caller planned ([`attention_scratch_bytes`],
//! [`gqa_attention_scratch_bytes`] and [`grad_stats_scratch_bytes`] say how much the
//! kernels that need scratch need, per [`Target`]). Values that change from step to step (the loss gradient, AdamW's step
//! constants) are not in the program but in the [`Scalars`] passed with it.
//!
//! Semantics are those of the CPU kernels: row-major tensors; forward kernels overwrite
//! their outputs; backward kernels accumulate (`+=`) into parameter gradients and
//! overwrite activation gradients, except LayerNorm's and RMSNorm's input gradients,
//! which accumulate.
//! Activations and parameters are in the target's working dtype (always f32 on the CPU),
//! parameter gradients and per-row statistics in f32, token ids in u32.
//!
//! This module knows nothing of models or of where buffers live.

use std::fmt;

use half::{bf16, f16};

use crate::adamw::{AdamError, AdamStep, CopyOut, GradStats, Grads, State, grad_stats};
use crate::ops::{self, Cpu, WeightLayout};
use crate::reference::llama::GqaDims;

/// The element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// IEEE single precision.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    F16,
    /// Token ids.
    U32,
    /// Plain bytes (statistics records, opaque scratch).
    U8,
}

impl Dtype {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Dtype::F32 | Dtype::U32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::U8 => 1,
        }
    }

    /// Whether the type holds floating-point numbers.
    pub const fn is_float(self) -> bool {
        matches!(self, Dtype::F32 | Dtype::Bf16 | Dtype::F16)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::U32 => "u32",
            Dtype::U8 => "u8",
        })
    }
}

/// Where a program runs, which decides the sizes of the scratch some kernels need.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// The CPU kernels.
    Cpu,
    /// The CUDA kernels.
    Cuda,
}

/// A tensor of a program: `len` elements of `dtype` starting `offset_bytes` into the
/// buffer bound at index `buf` when the program runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorRef {
    /// Index of the buffer in the caller's binding table.
    pub buf: u8,
    /// Where the tensor starts in that buffer.
    pub offset_bytes: usize,
    /// Elements.
    pub len: usize,
    /// Element type.
    pub dtype: Dtype,
}

impl TensorRef {
    /// `len` elements of `dtype` at `offset_bytes` into buffer `buf`.
    pub const fn new(buf: u8, offset_bytes: usize, len: usize, dtype: Dtype) -> Self {
        TensorRef {
            buf,
            offset_bytes,
            len,
            dtype,
        }
    }

    /// Bytes the tensor spans.
    pub const fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }

    /// The byte range in its buffer.
    pub fn byte_range(&self) -> std::ops::Range<usize> {
        self.offset_bytes..self.offset_bytes + self.bytes()
    }

    /// The `len` elements starting `start` elements into this tensor (same buffer and
    /// dtype).
    pub fn slice(&self, start: usize, len: usize) -> TensorRef {
        assert!(
            start + len <= self.len,
            "a slice of {len} elements at {start} of a tensor of {}",
            self.len
        );
        TensorRef {
            offset_bytes: self.offset_bytes + start * self.dtype.size(),
            len,
            ..*self
        }
    }
}

/// How a kernel uses one of its tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Only reads it.
    Read,
    /// Writes it (possibly after reading: accumulation, in-place updates).
    Write,
}

/// One kernel launch. Shapes are in each variant's documentation; `n` is rows (B × T),
/// `c` channels, `oc` output channels, `v` vocabulary, `nh` heads; for the Llama family's
/// kernels `h` query heads, `kv` key/value heads and `d` channels per head.
#[derive(Debug, Clone, PartialEq)]
pub enum Kernel {
    /// `t = 0`.
    Zero {
        /// Any dtype.
        t: TensorRef,
    },
    /// `dst = src` (same dtype and length).
    Copy {
        /// Destination.
        dst: TensorRef,
        /// Source.
        src: TensorRef,
    },
    /// `dst += src`, elementwise in f32 (gradient accumulation).
    AddF32 {
        /// f32, accumulated into.
        dst: TensorRef,
        /// f32, same length.
        src: TensorRef,
    },
    /// The fold of a reduce-scatter: `acc[i] = ((acc[i] + x_0[i]) + x_1[i]) + ...` over
    /// `ranks` chunks `x_p` of `acc`'s length laid one after another in `chunks` (rank
    /// order), or from `x_0[i]` itself without `accumulate`: the order every transport
    /// of `strata-comm` sums in, so a device's reduce-scatter gives their bits.
    FoldRanks {
        /// f32, the result (and, with `accumulate`, the start).
        acc: TensorRef,
        /// f32, `ranks` times `acc`'s length.
        chunks: TensorRef,
        /// How many chunks.
        ranks: usize,
        /// Whether `acc` is added to (else it is overwritten).
        accumulate: bool,
    },
    /// out: (B, T, C) = `wte[tokens]` + `wpe[position]`.
    Encoder {
        /// (B, T, C).
        out: TensorRef,
        /// (B, T) u32.
        tokens: TensorRef,
        /// (V, C).
        wte: TensorRef,
        /// (at least T, C).
        wpe: TensorRef,
        /// Batch.
        b: usize,
        /// Sequence.
        t: usize,
        /// Channels.
        c: usize,
    },
    /// dwte: (V, C) +=, dwpe: (T.., C) += the gradient of dout: (B, T, C).
    EncoderBackward {
        /// f32 (V, C), accumulated.
        dwte: TensorRef,
        /// f32 (at least T, C), accumulated.
        dwpe: TensorRef,
        /// (B, T, C).
        dout: TensorRef,
        /// (B, T) u32.
        tokens: TensorRef,
        /// Batch.
        b: usize,
        /// Sequence.
        t: usize,
        /// Channels.
        c: usize,
    },
    /// out: (N, C) = LayerNorm(inp) (eps 1e-5); mean, rstd: (N) f32.
    LayerNorm {
        /// (N, C).
        out: TensorRef,
        /// (N) f32.
        mean: TensorRef,
        /// (N) f32.
        rstd: TensorRef,
        /// (N, C).
        inp: TensorRef,
        /// (C).
        weight: TensorRef,
        /// (C).
        bias: TensorRef,
        /// Rows.
        n: usize,
        /// Channels.
        c: usize,
    },
    /// dinp: (N, C) +=, dweight, dbias: (C) f32 += the gradients given dout.
    LayerNormBackward {
        /// (N, C), accumulated.
        dinp: TensorRef,
        /// (C) f32, accumulated.
        dweight: TensorRef,
        /// (C) f32, accumulated.
        dbias: TensorRef,
        /// (N, C).
        dout: TensorRef,
        /// (N, C).
        inp: TensorRef,
        /// (C).
        weight: TensorRef,
        /// (N) f32.
        mean: TensorRef,
        /// (N) f32.
        rstd: TensorRef,
        /// Rows.
        n: usize,
        /// Channels.
        c: usize,
    },
    /// out: (N, OC) = inp: (N, C) @ W + bias; W is (C, OC) for [`WeightLayout::InOut`],
    /// (OC, C) for [`WeightLayout::OutIn`].
    Matmul {
        /// (N, OC).
        out: TensorRef,
        /// (N, C).
        inp: TensorRef,
        /// (C, OC) or (OC, C).
        weight: TensorRef,
        /// (OC), or none.
        bias: Option<TensorRef>,
        /// How the weight is stored.
        layout: WeightLayout,
        /// Rows.
        n: usize,
        /// Input channels.
        c: usize,
        /// Output channels.
        oc: usize,
    },
    /// dinp: (N, C) = (overwritten), dweight +=, dbias += (f32), given dout: (N, OC).
    MatmulBackward {
        /// (N, C), overwritten.
        dinp: TensorRef,
        /// f32, shaped as the weight, accumulated.
        dweight: TensorRef,
        /// (OC) f32, accumulated, or none.
        dbias: Option<TensorRef>,
        /// (N, OC).
        dout: TensorRef,
        /// (N, C).
        inp: TensorRef,
        /// As in [`Kernel::Matmul`].
        weight: TensorRef,
        /// How the weight is stored.
        layout: WeightLayout,
        /// Rows.
        n: usize,
        /// Input channels.
        c: usize,
        /// Output channels.
        oc: usize,
    },
    /// Causal self-attention, scaled by 1/sqrt(C/NH): out: (B, T, C), att: (B, NH, T, T)
    /// (the softmax, kept for the backward), from qkv: (B, T, 3C).
    Attention {
        /// (B, T, C).
        out: TensorRef,
        /// (B, NH, T, T).
        att: TensorRef,
        /// (B, T, 3C).
        qkv: TensorRef,
        /// [`attention_scratch_bytes`] bytes (U8).
        scratch: TensorRef,
        /// Batch.
        b: usize,
        /// Sequence.
        t: usize,
        /// Channels.
        c: usize,
        /// Heads.
        nh: usize,
    },
    /// dqkv: (B, T, 3C) = (overwritten) the gradient, given dout: (B, T, C).
    AttentionBackward {
        /// (B, T, 3C), overwritten.
        dqkv: TensorRef,
        /// (B, T, C).
        dout: TensorRef,
        /// (B, T, 3C).
        qkv: TensorRef,
        /// (B, NH, T, T), zero above the diagonal, as [`Kernel::Attention`] leaves it
        /// (the CUDA kernels read it whole).
        att: TensorRef,
        /// [`attention_scratch_bytes`] bytes (U8).
        scratch: TensorRef,
        /// Batch.
        b: usize,
        /// Sequence.
        t: usize,
        /// Channels.
        c: usize,
        /// Heads.
        nh: usize,
    },
    /// out = gelu(inp) (tanh approximation), elementwise.
    Gelu {
        /// Output.
        out: TensorRef,
        /// Input, same length.
        inp: TensorRef,
    },
    /// dinp = gelu'(inp) * dout, elementwise.
    GeluBackward {
        /// Output.
        dinp: TensorRef,
        /// The forward's input.
        inp: TensorRef,
        /// The gradient of the forward's output.
        dout: TensorRef,
    },
    /// out = a + b, elementwise.
    Residual {
        /// Output.
        out: TensorRef,
        /// First input.
        a: TensorRef,
        /// Second input.
        b: TensorRef,
    },
    /// losses: (N) f32 = cross-entropy of softmax(logits: (N, V)) against targets: (N);
    /// 0 where the target is [`IGNORE_TARGET`].
    CrossEntropy {
        /// (N) f32.
        losses: TensorRef,
        /// (N, V).
        logits: TensorRef,
        /// (N) u32.
        targets: TensorRef,
        /// Rows.
        n: usize,
        /// Vocabulary.
        v: usize,
    },
    /// logits: (N, V) replaced by `(softmax - onehot(targets)) * dloss`, with `dloss` from
    /// [`Scalars::dloss`]; a row whose target is [`IGNORE_TARGET`] is zeroed.
    CrossEntropyBackward {
        /// (N, V), in place.
        logits: TensorRef,
        /// (N) u32.
        targets: TensorRef,
        /// Rows.
        n: usize,
        /// Vocabulary.
        v: usize,
    },
    /// out: (N, C) = `inp * rstd * weight`, `rstd = 1 / sqrt(mean(inp^2) + eps)` per row
    /// (RMSNorm); rstd: (N) f32. Qwen3's per-head q/k norm is this kernel over the
    /// B × T × H rows of D channels of q or k.
    RmsNorm {
        /// (N, C).
        out: TensorRef,
        /// (N) f32.
        rstd: TensorRef,
        /// (N, C).
        inp: TensorRef,
        /// (C).
        weight: TensorRef,
        /// Added to the mean square.
        eps: f32,
        /// Rows.
        n: usize,
        /// Channels.
        c: usize,
    },
    /// dinp: (N, C) +=, dweight: (C) f32 += the gradients given dout (the input gradient
    /// accumulates, as LayerNorm's: zero it first where nothing joins there, as for
    /// Qwen3's q/k norm).
    RmsNormBackward {
        /// (N, C), accumulated.
        dinp: TensorRef,
        /// (C) f32, accumulated.
        dweight: TensorRef,
        /// (N, C).
        dout: TensorRef,
        /// (N, C).
        inp: TensorRef,
        /// (C).
        weight: TensorRef,
        /// (N) f32, from [`Kernel::RmsNorm`].
        rstd: TensorRef,
        /// Rows.
        n: usize,
        /// Channels.
        c: usize,
    },
    /// Rotary position embeddings, Hugging Face's `rotate_half` form: out: (B, T, H, D)
    /// from inp: (B, T, H, D), each row of D channels at position t, halves x1 and x2,
    /// becoming `(x1 cos - x2 sin, x2 cos + x1 sin)` with row t of the tables (built by
    /// the caller, e.g. with [`ops::rope_table`]; Llama 3's `rope_scaling` is in its
    /// inverse frequencies). D even.
    Rope {
        /// (B, T, H, D).
        out: TensorRef,
        /// (B, T, H, D).
        inp: TensorRef,
        /// (at least T, D/2).
        cos: TensorRef,
        /// (at least T, D/2).
        sin: TensorRef,
        /// Batch.
        b: usize,
        /// Sequence.
        t: usize,
        /// Heads of the tensor (query or key/value heads).
        h: usize,
        /// Channels per head.
        d: usize,
    },
    /// dinp: (B, T, H, D) = (overwritten) the gradient of [`Kernel::Rope`] given dout
    /// (the inverse rotation).
    RopeBackward {
        /// (B, T, H, D), overwritten.
        dinp: TensorRef,
        /// (B, T, H, D).
        dout: TensorRef,
        /// (at least T, D/2).
        cos: TensorRef,
        /// (at least T, D/2).
        sin: TensorRef,
        /// Batch.
        b: usize,
        /// Sequence.
        t: usize,
        /// Heads of the tensor.
        h: usize,
        /// Channels per head.
        d: usize,
    },
    /// cos, sin: (T, D/2) = the rotary table of positions 0..T for the inverse
    /// frequencies of `freqs` ([`ops::rope_table_of`]), in the working dtype: the tables
    /// [`Kernel::Rope`] reads. A family's programs build it in their scratch, so no
    /// table is uploaded or kept between programs.
    RopeTable {
        /// (T, D/2), written.
        cos: TensorRef,
        /// (T, D/2), written.
        sin: TensorRef,
        /// Positions.
        t: usize,
        /// Channels per head.
        d: usize,
        /// How the inverse frequencies are formed.
        freqs: ops::RopeFreqs,
    },
    /// out = silu(gate) * up, elementwise (the SiLU-gated MLP between its products).
    SwiGlu {
        /// Output.
        out: TensorRef,
        /// The gate projection, same length.
        gate: TensorRef,
        /// The up projection, same length.
        up: TensorRef,
    },
    /// dgate, dup = (overwritten) the gradients of [`Kernel::SwiGlu`] given dout.
    SwiGluBackward {
        /// Overwritten.
        dgate: TensorRef,
        /// Overwritten.
        dup: TensorRef,
        /// The gradient of the forward's output.
        dout: TensorRef,
        /// The forward's gate input.
        gate: TensorRef,
        /// The forward's up input.
        up: TensorRef,
    },
    /// Causal grouped-query attention scaled by 1/sqrt(D): out: (B, T, H, D) and att:
    /// (B, H, T, T) (the softmax, zero above the diagonal, kept for the backward) from
    /// q: (B, T, H, D) and k, v: (B, T, KV, D), KV dividing H; query head h reads
    /// key/value head h / (H / KV). KV = H is multi-head attention.
    GqaAttention {
        /// (B, T, H, D).
        out: TensorRef,
        /// (B, H, T, T).
        att: TensorRef,
        /// (B, T, H, D).
        q: TensorRef,
        /// (B, T, KV, D).
        k: TensorRef,
        /// (B, T, KV, D).
        v: TensorRef,
        /// [`gqa_attention_scratch_bytes`] bytes (U8).
        scratch: TensorRef,
        /// Batch.
        b: usize,
        /// Sequence.
        t: usize,
        /// Query heads.
        h: usize,
        /// Key/value heads.
        kv: usize,
        /// Channels per head.
        d: usize,
    },
    /// dq: (B, T, H, D), dk, dv: (B, T, KV, D) = (overwritten) the gradients of
    /// [`Kernel::GqaAttention`] given dout: (B, T, H, D); a key/value head's gradients
    /// add up over the query heads that share it.
    GqaAttentionBackward {
        /// (B, T, H, D), overwritten.
        dq: TensorRef,
        /// (B, T, KV, D), overwritten.
        dk: TensorRef,
        /// (B, T, KV, D), overwritten.
        dv: TensorRef,
        /// (B, T, H, D).
        dout: TensorRef,
        /// (B, T, H, D).
        q: TensorRef,
        /// (B, T, KV, D).
        k: TensorRef,
        /// (B, T, KV, D).
        v: TensorRef,
        /// (B, H, T, T), as [`Kernel::GqaAttention`] leaves it.
        att: TensorRef,
        /// [`gqa_attention_scratch_bytes`] bytes (U8).
        scratch: TensorRef,
        /// Batch.
        b: usize,
        /// Sequence.
        t: usize,
        /// Query heads.
        h: usize,
        /// Key/value heads.
        kv: usize,
        /// Channels per head.
        d: usize,
    },
    /// The sum of squares of `grads` (f32) each multiplied by [`Scalars::stats_scale`],
    /// and whether any is not finite: `out` holds two f64, the sum and 1.0 or 0.0. The
    /// sum is deterministic for a given target.
    GradStats {
        /// f32 gradients.
        grads: TensorRef,
        /// Two f64 (16 bytes, U8).
        out: TensorRef,
        /// [`grad_stats_scratch_bytes`] bytes (U8).
        scratch: TensorRef,
    },
    /// One AdamW step over one tensor (`crate::adamw`'s semantics), with the constants of
    /// [`Scalars::adam`] (`decay`) or [`Scalars::adam_no_decay`]; nothing when
    /// [`Scalars::skip_update`] is set. Optionally writes the new parameters rounded to
    /// `round` (bf16 or f16, nearest even) into `copy_out`, stored in `copy_out`'s dtype.
    AdamW {
        /// f32 master parameters, updated.
        params: TensorRef,
        /// f32 first moments, updated.
        m: TensorRef,
        /// f32 second moments, updated.
        v: TensorRef,
        /// f32 gradients.
        grads: TensorRef,
        /// The working copy to write, if any.
        copy_out: Option<TensorRef>,
        /// The precision the working copy is rounded to (its own dtype, or f32 holding
        /// bf16 or f16 values on a device that computes in f32).
        round: Dtype,
        /// With weight decay.
        decay: bool,
    },
}

/// Values a program reads that change from step to step.
#[derive(Debug, Clone, Copy, Default)]
pub struct Scalars {
    /// The gradient of the loss with respect to each position's loss
    /// ([`Kernel::CrossEntropyBackward`]).
    pub dloss: f32,
    /// The factor gradients are multiplied by in [`Kernel::GradStats`].
    pub stats_scale: f32,
    /// AdamW's constants with weight decay.
    pub adam: Option<AdamStep>,
    /// AdamW's constants without weight decay.
    pub adam_no_decay: Option<AdamStep>,
    /// Skip every [`Kernel::AdamW`] (non-finite gradients).
    pub skip_update: bool,
}

/// Why a kernel could not run.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The kernel needs a dtype this target does not compute in.
    #[error("{kernel}: {dtype} is not supported on {target:?} (tensor {what})")]
    Dtype {
        /// The kernel.
        kernel: &'static str,
        /// Which tensor.
        what: &'static str,
        /// Its dtype.
        dtype: Dtype,
        /// Where it ran.
        target: Target,
    },
    /// A tensor's length does not fit the kernel's shape.
    #[error("{kernel}: tensor {what} has {len} elements, {expected} expected")]
    Shape {
        /// The kernel.
        kernel: &'static str,
        /// Which tensor.
        what: &'static str,
        /// Its length.
        len: usize,
        /// What the shape needs.
        expected: usize,
    },
    /// AdamW ran without its constants, or refused its inputs.
    #[error("{0}")]
    Adam(#[from] AdamError),
    /// AdamW ran without constants in the scalars.
    #[error("AdamW ran without its step constants")]
    NoAdamStep,
    /// A tensor's address is not a multiple of what the kernel needs.
    #[error("{kernel}: tensor {what} starts at {address:#x}, not a multiple of {align} bytes")]
    Misaligned {
        /// The kernel.
        kernel: &'static str,
        /// Which tensor.
        what: &'static str,
        /// Its address.
        address: u64,
        /// The alignment it needs, in bytes.
        align: usize,
    },
    /// A CUDA call failed.
    #[error(transparent)]
    Cuda(#[from] crate::cuda::CudaError),
}

impl Kernel {
    /// A short name for messages and traces.
    pub fn name(&self) -> &'static str {
        match self {
            Kernel::Zero { .. } => "zero",
            Kernel::Copy { .. } => "copy",
            Kernel::AddF32 { .. } => "add",
            Kernel::FoldRanks { .. } => "fold-ranks",
            Kernel::Encoder { .. } => "encoder",
            Kernel::EncoderBackward { .. } => "encoder-backward",
            Kernel::LayerNorm { .. } => "layernorm",
            Kernel::LayerNormBackward { .. } => "layernorm-backward",
            Kernel::Matmul { .. } => "matmul",
            Kernel::MatmulBackward { .. } => "matmul-backward",
            Kernel::Attention { .. } => "attention",
            Kernel::AttentionBackward { .. } => "attention-backward",
            Kernel::Gelu { .. } => "gelu",
            Kernel::GeluBackward { .. } => "gelu-backward",
            Kernel::Residual { .. } => "residual",
            Kernel::CrossEntropy { .. } => "crossentropy",
            Kernel::CrossEntropyBackward { .. } => "crossentropy-backward",
            Kernel::RmsNorm { .. } => "rmsnorm",
            Kernel::RmsNormBackward { .. } => "rmsnorm-backward",
            Kernel::Rope { .. } => "rope",
            Kernel::RopeBackward { .. } => "rope-backward",
            Kernel::RopeTable { .. } => "rope-table",
            Kernel::SwiGlu { .. } => "swiglu",
            Kernel::SwiGluBackward { .. } => "swiglu-backward",
            Kernel::GqaAttention { .. } => "gqa-attention",
            Kernel::GqaAttentionBackward { .. } => "gqa-attention-backward",
            Kernel::GradStats { .. } => "grad-stats",
            Kernel::AdamW { .. } => "adamw",
        }
    }

    /// Calls `f` with every tensor the kernel touches and how (written tensors once, as
    /// written, even when also read).
    pub fn for_each_tensor(&self, mut f: impl FnMut(&TensorRef, Access)) {
        use Access::{Read as R, Write as W};
        match self {
            Kernel::Zero { t } => f(t, W),
            Kernel::Copy { dst, src } | Kernel::AddF32 { dst, src } => {
                f(dst, W);
                f(src, R);
            }
            Kernel::FoldRanks { acc, chunks, .. } => {
                f(acc, W);
                f(chunks, R);
            }
            Kernel::Encoder {
                out,
                tokens,
                wte,
                wpe,
                ..
            } => {
                f(out, W);
                f(tokens, R);
                f(wte, R);
                f(wpe, R);
            }
            Kernel::EncoderBackward {
                dwte,
                dwpe,
                dout,
                tokens,
                ..
            } => {
                f(dwte, W);
                f(dwpe, W);
                f(dout, R);
                f(tokens, R);
            }
            Kernel::LayerNorm {
                out,
                mean,
                rstd,
                inp,
                weight,
                bias,
                ..
            } => {
                f(out, W);
                f(mean, W);
                f(rstd, W);
                f(inp, R);
                f(weight, R);
                f(bias, R);
            }
            Kernel::LayerNormBackward {
                dinp,
                dweight,
                dbias,
                dout,
                inp,
                weight,
                mean,
                rstd,
                ..
            } => {
                f(dinp, W);
                f(dweight, W);
                f(dbias, W);
                f(dout, R);
                f(inp, R);
                f(weight, R);
                f(mean, R);
                f(rstd, R);
            }
            Kernel::Matmul {
                out,
                inp,
                weight,
                bias,
                ..
            } => {
                f(out, W);
                f(inp, R);
                f(weight, R);
                if let Some(bias) = bias {
                    f(bias, R);
                }
            }
            Kernel::MatmulBackward {
                dinp,
                dweight,
                dbias,
                dout,
                inp,
                weight,
                ..
            } => {
                f(dinp, W);
                f(dweight, W);
                if let Some(dbias) = dbias {
                    f(dbias, W);
                }
                f(dout, R);
                f(inp, R);
                f(weight, R);
            }
            Kernel::Attention {
                out,
                att,
                qkv,
                scratch,
                ..
            } => {
                f(out, W);
                f(att, W);
                f(scratch, W);
                f(qkv, R);
            }
            Kernel::AttentionBackward {
                dqkv,
                dout,
                qkv,
                att,
                scratch,
                ..
            } => {
                f(dqkv, W);
                f(scratch, W);
                f(dout, R);
                f(qkv, R);
                f(att, R);
            }
            Kernel::Gelu { out, inp } => {
                f(out, W);
                f(inp, R);
            }
            Kernel::GeluBackward { dinp, inp, dout } => {
                f(dinp, W);
                f(inp, R);
                f(dout, R);
            }
            Kernel::Residual { out, a, b } => {
                f(out, W);
                f(a, R);
                f(b, R);
            }
            Kernel::CrossEntropy {
                losses,
                logits,
                targets,
                ..
            } => {
                f(losses, W);
                f(logits, R);
                f(targets, R);
            }
            Kernel::CrossEntropyBackward {
                logits, targets, ..
            } => {
                f(logits, W);
                f(targets, R);
            }
            Kernel::RmsNorm {
                out,
                rstd,
                inp,
                weight,
                ..
            } => {
                f(out, W);
                f(rstd, W);
                f(inp, R);
                f(weight, R);
            }
            Kernel::RmsNormBackward {
                dinp,
                dweight,
                dout,
                inp,
                weight,
                rstd,
                ..
            } => {
                f(dinp, W);
                f(dweight, W);
                f(dout, R);
                f(inp, R);
                f(weight, R);
                f(rstd, R);
            }
            Kernel::Rope {
                out: o,
                inp: i,
                cos,
                sin,
                ..
            }
            | Kernel::RopeBackward {
                dinp: o,
                dout: i,
                cos,
                sin,
                ..
            } => {
                f(o, W);
                f(i, R);
                f(cos, R);
                f(sin, R);
            }
            Kernel::RopeTable { cos, sin, .. } => {
                f(cos, W);
                f(sin, W);
            }
            Kernel::SwiGlu { out, gate, up } => {
                f(out, W);
                f(gate, R);
                f(up, R);
            }
            Kernel::SwiGluBackward {
                dgate,
                dup,
                dout,
                gate,
                up,
            } => {
                f(dgate, W);
                f(dup, W);
                f(dout, R);
                f(gate, R);
                f(up, R);
            }
            Kernel::GqaAttention {
                out,
                att,
                q,
                k,
                v,
                scratch,
                ..
            } => {
                f(out, W);
                f(att, W);
                f(scratch, W);
                f(q, R);
                f(k, R);
                f(v, R);
            }
            Kernel::GqaAttentionBackward {
                dq,
                dk,
                dv,
                dout,
                q,
                k,
                v,
                att,
                scratch,
                ..
            } => {
                f(dq, W);
                f(dk, W);
                f(dv, W);
                f(scratch, W);
                f(dout, R);
                f(q, R);
                f(k, R);
                f(v, R);
                f(att, R);
            }
            Kernel::GradStats {
                grads,
                out,
                scratch,
            } => {
                f(out, W);
                f(scratch, W);
                f(grads, R);
            }
            Kernel::AdamW {
                params,
                m,
                v,
                grads,
                copy_out,
                ..
            } => {
                f(params, W);
                f(m, W);
                f(v, W);
                if let Some(out) = copy_out {
                    f(out, W);
                }
                f(grads, R);
            }
        }
    }

    /// Floating-point operations, counting a multiply-add as two, for cost models and
    /// FLOP/s figures: matrix products and attention's two products per head exactly,
    /// other kernels by a few operations per element.
    pub fn flops(&self) -> f64 {
        match *self {
            Kernel::Matmul { n, c, oc, .. } => 2.0 * (n * c * oc) as f64,
            // The input gradient and the weight gradient: two products.
            Kernel::MatmulBackward { n, c, oc, .. } => 4.0 * (n * c * oc) as f64,
            // Q K^T and att V, each B × NH × T × T × HS multiply-adds (causal: computed
            // in full by the kernels).
            Kernel::Attention { b, t, c, .. } => 4.0 * (b * t * t * c) as f64,
            Kernel::AttentionBackward { b, t, c, .. } => 8.0 * (b * t * t * c) as f64,
            Kernel::CrossEntropy { n, v, .. } | Kernel::CrossEntropyBackward { n, v, .. } => {
                3.0 * (n * v) as f64
            }
            Kernel::LayerNorm { n, c, .. } => 8.0 * (n * c) as f64,
            Kernel::LayerNormBackward { n, c, .. } => 12.0 * (n * c) as f64,
            Kernel::Encoder { b, t, c, .. } | Kernel::EncoderBackward { b, t, c, .. } => {
                (b * t * c) as f64
            }
            Kernel::Gelu { out, .. } => 10.0 * out.len as f64,
            Kernel::GeluBackward { dinp, .. } => 16.0 * dinp.len as f64,
            Kernel::Residual { out, .. } => out.len as f64,
            Kernel::AddF32 { dst, .. } => dst.len as f64,
            Kernel::FoldRanks { chunks, .. } => chunks.len as f64,
            // Q K^T and att V per query head: B × H × T × T × D multiply-adds each.
            Kernel::GqaAttention { b, t, h, d, .. } => 4.0 * (b * t * t * h * d) as f64,
            Kernel::GqaAttentionBackward { b, t, h, d, .. } => 8.0 * (b * t * t * h * d) as f64,
            Kernel::RmsNorm { n, c, .. } => 4.0 * (n * c) as f64,
            Kernel::RmsNormBackward { n, c, .. } => 8.0 * (n * c) as f64,
            Kernel::Rope { out, .. } => 3.0 * out.len as f64,
            Kernel::RopeBackward { dinp, .. } => 3.0 * dinp.len as f64,
            // A cosine and a sine per entry, counted as one operation each.
            Kernel::RopeTable { cos, .. } => 2.0 * cos.len as f64,
            Kernel::SwiGlu { out, .. } => 8.0 * out.len as f64,
            Kernel::SwiGluBackward { dout, .. } => 14.0 * dout.len as f64,
            Kernel::GradStats { grads, .. } => 2.0 * grads.len as f64,
            Kernel::AdamW { params, .. } => 12.0 * params.len as f64,
            Kernel::Zero { .. } | Kernel::Copy { .. } => 0.0,
        }
    }
}

/// The total FLOPs of a list of kernels (see [`Kernel::flops`]).
pub fn program_flops(kernels: &[Kernel]) -> f64 {
    kernels.iter().map(Kernel::flops).sum()
}

/// Bytes of scratch [`Kernel::Attention`] and [`Kernel::AttentionBackward`] need on
/// `target` for a batch of `b` × `t` tokens, `c` channels in `nh` heads, activations of
/// `dtype`: on the CPU the backward's softmax gradient (B, NH, T, T) in f32; on CUDA the
/// regions of [`attention_scratch_layout`].
pub fn attention_scratch_bytes(
    target: Target,
    dtype: Dtype,
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> usize {
    match target {
        Target::Cpu => b * nh * t * t * 4,
        Target::Cuda => attention_scratch_layout(dtype, b, t, c, nh).total_bytes,
    }
}

/// Where each region of the CUDA attention kernels' scratch starts, in bytes from the
/// scratch's start (see [`attention_scratch_layout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionScratchLayout {
    /// Q per head, (B, NH, T, HS) in the working dtype.
    pub q: usize,
    /// K per head, likewise.
    pub k: usize,
    /// V per head, likewise.
    pub v: usize,
    /// The output per head (forward), or its gradient (backward), likewise.
    pub y: usize,
    /// The gradient of Q per head, likewise.
    pub dq: usize,
    /// The gradient of K per head, likewise.
    pub dk: usize,
    /// The gradient of V per head, likewise.
    pub dv: usize,
    /// The scaled scores Q K^T (forward) or the gradient of the probabilities (backward),
    /// (B, NH, T, T) in f32.
    pub scores: usize,
    /// The gradient of the scaled scores, (B, NH, T, T) in the working dtype.
    pub dscores: usize,
    /// Bytes of the whole scratch.
    pub total_bytes: usize,
}

/// The CUDA attention kernels' scratch, for activations of `dtype` (f32, bf16 or f16):
/// seven (B, T, C) tensors of `dtype` (q, k, v, y, dq, dk, dv), the f32 scores
/// (B, NH, T, T), then the scores' gradient (B, NH, T, T) of `dtype`, in that order, each
/// starting at a multiple of 256 bytes from the scratch's start. The forward uses q, k,
/// v, y and the scores; the backward all of them. The scratch itself must start at a
/// multiple of 4 bytes (256 is best: cuBLAS is fastest on aligned operands).
pub fn attention_scratch_layout(
    dtype: Dtype,
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> AttentionScratchLayout {
    scratch_layout(dtype, b * t * c, b * t * c, b * nh * t * t)
}

/// The CUDA grouped-query attention kernels' scratch ([`Kernel::GqaAttention`],
/// [`Kernel::GqaAttentionBackward`]) for activations of `dtype`: the regions and order of
/// [`attention_scratch_layout`], with q, y and dq per query head (B, H, T, D), k, v, dk
/// and dv per key/value head (B, KV, T, D), the scores and their gradient (B, H, T, T).
pub fn gqa_attention_scratch_layout(
    dtype: Dtype,
    b: usize,
    t: usize,
    h: usize,
    kv: usize,
    d: usize,
) -> AttentionScratchLayout {
    scratch_layout(dtype, b * t * h * d, b * t * kv * d, b * h * t * t)
}

/// Bytes of scratch [`Kernel::GqaAttention`] and [`Kernel::GqaAttentionBackward`] need
/// on `target`: on the CPU the backward's softmax gradient (B, H, T, T) in f32; on CUDA
/// the regions of [`gqa_attention_scratch_layout`].
pub fn gqa_attention_scratch_bytes(
    target: Target,
    dtype: Dtype,
    b: usize,
    t: usize,
    h: usize,
    kv: usize,
    d: usize,
) -> usize {
    match target {
        Target::Cpu => b * h * t * t * 4,
        Target::Cuda => gqa_attention_scratch_layout(dtype, b, t, h, kv, d).total_bytes,
    }
}

/// The attention scratch's regions in order, q, y and dq of `queries` elements of
/// `dtype`, k, v, dk and dv of `keys` elements, the f32 scores and their `dtype` gradient
/// of `scores` elements, each aligned to [`ATTENTION_SCRATCH_ALIGN`].
fn scratch_layout(
    dtype: Dtype,
    queries: usize,
    keys: usize,
    scores: usize,
) -> AttentionScratchLayout {
    let align = |x: usize| x.next_multiple_of(ATTENTION_SCRATCH_ALIGN);
    let (q_bytes, k_bytes) = (align(queries * dtype.size()), align(keys * dtype.size()));
    let sizes = [
        q_bytes, k_bytes, k_bytes, q_bytes, q_bytes, k_bytes, k_bytes,
    ];
    let mut starts = [0usize; 7];
    let mut end = 0;
    for (start, size) in starts.iter_mut().zip(sizes) {
        *start = end;
        end += size;
    }
    let [q, k, v, y, dq, dk, dv] = starts;
    AttentionScratchLayout {
        q,
        k,
        v,
        y,
        dq,
        dk,
        dv,
        scores: end,
        dscores: end + align(scores * 4),
        total_bytes: end + align(scores * 4) + align(scores * dtype.size()),
    }
}

/// The alignment, in bytes, of each region of [`attention_scratch_layout`].
pub const ATTENTION_SCRATCH_ALIGN: usize = 256;

/// The target id that the loss does not count: [`Kernel::CrossEntropy`] gives its
/// position a loss of 0 and [`Kernel::CrossEntropyBackward`] a zero gradient, on every
/// device and in the reference. A prompt's tokens are masked out of a fine-tuning loss
/// this way; the caller divides by the positions that count (the mean over them).
pub const IGNORE_TARGET: u32 = u32::MAX;

/// Bytes of scratch [`Kernel::GradStats`] needs on `target` over `len` gradients: none
/// on the CPU; on CUDA one f64 partial sum per block of the first pass of the reduction
/// ([`grad_stats_blocks`]). The scratch must start at a multiple of 8 bytes.
pub fn grad_stats_scratch_bytes(target: Target, len: usize) -> usize {
    match target {
        Target::Cpu => 0,
        Target::Cuda => 8 * grad_stats_blocks(len),
    }
}

/// Threads per block of the CUDA gradient statistics (`GRAD_STATS_THREADS` in
/// `kernels/cuda/adamw.cu`).
pub const GRAD_STATS_THREADS: usize = 256;

/// The most blocks the first pass of the CUDA gradient statistics runs.
pub const GRAD_STATS_MAX_BLOCKS: usize = 1024;

/// Blocks of the first pass of the CUDA gradient statistics over `len` gradients: one per
/// [`GRAD_STATS_THREADS`] gradients, at least 1 and at most [`GRAD_STATS_MAX_BLOCKS`]
/// (each thread then visits several). Fixed by `len` alone, so the order of the sum is.
pub fn grad_stats_blocks(len: usize) -> usize {
    len.div_ceil(GRAD_STATS_THREADS)
        .clamp(1, GRAD_STATS_MAX_BLOCKS)
}

/// Resolves tensors to memory for [`run_cpu`].
pub trait CpuMemory {
    /// The address of `t`'s first byte.
    fn address(&self, t: &TensorRef) -> *mut u8;
}

/// Runs `kernel` on the CPU with `cpu`'s instruction set and threads.
///
/// # Safety
/// For every tensor of the kernel ([`Kernel::for_each_tensor`]), `memory.address` must
/// return a pointer valid for reads (and, for written tensors, writes) of
/// [`TensorRef::bytes`] bytes, aligned for its dtype, and nothing else may read a written
/// tensor's bytes or write any tensor's bytes while this runs. Written tensors must not
/// overlap any other tensor of the kernel.
pub unsafe fn run_cpu(
    kernel: &Kernel,
    cpu: &Cpu,
    scalars: &Scalars,
    memory: &dyn CpuMemory,
) -> Result<(), KernelError> {
    let name = kernel.name();
    // Views of the tensors; each helper checks the dtype first.
    let view = |t: &TensorRef, what: &'static str, dtype: Dtype| -> Result<(), KernelError> {
        if t.dtype == dtype {
            Ok(())
        } else {
            Err(KernelError::Dtype {
                kernel: name,
                what,
                dtype: t.dtype,
                target: Target::Cpu,
            })
        }
    };
    // The views below rely on the caller's promise: each tensor's address is valid and
    // aligned for its dtype for `len` elements, and written tensors are ours alone for
    // the call and overlap nothing else of the kernel.
    let f32s = |t: &TensorRef, what| -> Result<&[f32], KernelError> {
        view(t, what, Dtype::F32)?;
        // SAFETY: the caller's promise (above).
        Ok(unsafe { std::slice::from_raw_parts(memory.address(t).cast::<f32>(), t.len) })
    };
    let f32s_mut = |t: &TensorRef, what| -> Result<&mut [f32], KernelError> {
        view(t, what, Dtype::F32)?;
        // SAFETY: the caller's promise (above); only written tensors are viewed mutably.
        Ok(unsafe { std::slice::from_raw_parts_mut(memory.address(t).cast::<f32>(), t.len) })
    };
    let u32s = |t: &TensorRef, what| -> Result<&[u32], KernelError> {
        view(t, what, Dtype::U32)?;
        // SAFETY: the caller's promise (above).
        Ok(unsafe { std::slice::from_raw_parts(memory.address(t).cast::<u32>(), t.len) })
    };
    let bytes_mut = |t: &TensorRef| -> &mut [u8] {
        // SAFETY: the caller's promise (above); only written tensors are viewed mutably.
        unsafe { std::slice::from_raw_parts_mut(memory.address(t), t.bytes()) }
    };
    let bytes = |t: &TensorRef| -> &[u8] {
        // SAFETY: the caller's promise (above).
        unsafe { std::slice::from_raw_parts(memory.address(t), t.bytes()) }
    };
    let expect = |t: &TensorRef, what, expected: usize| -> Result<(), KernelError> {
        if t.len == expected {
            Ok(())
        } else {
            Err(KernelError::Shape {
                kernel: name,
                what,
                len: t.len,
                expected,
            })
        }
    };
    // The first `len` f32 of a byte scratch, which must hold them.
    let scratch_f32 = |scratch: &TensorRef, len: usize| -> Result<TensorRef, KernelError> {
        if scratch.bytes() < len * 4 {
            return Err(KernelError::Shape {
                kernel: name,
                what: "scratch (bytes)",
                len: scratch.bytes(),
                expected: len * 4,
            });
        }
        Ok(TensorRef {
            len,
            dtype: Dtype::F32,
            ..*scratch
        })
    };
    match kernel {
        Kernel::Zero { t } => bytes_mut(t).fill(0),
        Kernel::Copy { dst, src } => {
            if dst.dtype != src.dtype {
                return Err(KernelError::Dtype {
                    kernel: name,
                    what: "src",
                    dtype: src.dtype,
                    target: Target::Cpu,
                });
            }
            expect(src, "src", dst.len)?;
            bytes_mut(dst).copy_from_slice(bytes(src));
        }
        Kernel::AddF32 { dst, src } => {
            expect(src, "src", dst.len)?;
            ops::add_inplace(cpu, f32s_mut(dst, "dst")?, f32s(src, "src")?);
        }
        &Kernel::FoldRanks {
            ref acc,
            ref chunks,
            ranks,
            accumulate,
        } => {
            expect(chunks, "chunks", ranks * acc.len)?;
            let x = f32s(chunks, "chunks")?;
            let acc = f32s_mut(acc, "acc")?;
            let n = acc.len();
            for (i, a) in acc.iter_mut().enumerate() {
                let mut sum = if accumulate { *a + x[i] } else { x[i] };
                for p in 1..ranks {
                    sum += x[p * n + i];
                }
                *a = sum;
            }
        }
        &Kernel::Encoder {
            ref out,
            ref tokens,
            ref wte,
            ref wpe,
            b,
            t,
            c,
        } => ops::encoder_forward(
            cpu,
            f32s_mut(out, "out")?,
            u32s(tokens, "tokens")?,
            f32s(wte, "wte")?,
            f32s(wpe, "wpe")?,
            b,
            t,
            c,
        ),
        &Kernel::EncoderBackward {
            ref dwte,
            ref dwpe,
            ref dout,
            ref tokens,
            b,
            t,
            c,
        } => ops::encoder_backward(
            cpu,
            f32s_mut(dwte, "dwte")?,
            f32s_mut(dwpe, "dwpe")?,
            f32s(dout, "dout")?,
            u32s(tokens, "tokens")?,
            b,
            t,
            c,
        ),
        &Kernel::LayerNorm {
            ref out,
            ref mean,
            ref rstd,
            ref inp,
            ref weight,
            ref bias,
            n,
            c,
        } => ops::layernorm_forward(
            cpu,
            f32s_mut(out, "out")?,
            f32s_mut(mean, "mean")?,
            f32s_mut(rstd, "rstd")?,
            f32s(inp, "inp")?,
            f32s(weight, "weight")?,
            f32s(bias, "bias")?,
            n,
            c,
        ),
        &Kernel::LayerNormBackward {
            ref dinp,
            ref dweight,
            ref dbias,
            ref dout,
            ref inp,
            ref weight,
            ref mean,
            ref rstd,
            n,
            c,
        } => ops::layernorm_backward(
            cpu,
            f32s_mut(dinp, "dinp")?,
            f32s_mut(dweight, "dweight")?,
            f32s_mut(dbias, "dbias")?,
            f32s(dout, "dout")?,
            f32s(inp, "inp")?,
            f32s(weight, "weight")?,
            f32s(mean, "mean")?,
            f32s(rstd, "rstd")?,
            n,
            c,
        ),
        &Kernel::Matmul {
            ref out,
            ref inp,
            ref weight,
            ref bias,
            layout,
            n,
            c,
            oc,
        } => {
            let bias = match bias {
                Some(b) => Some(f32s(b, "bias")?),
                None => None,
            };
            ops::matmul_forward(
                cpu,
                f32s_mut(out, "out")?,
                f32s(inp, "inp")?,
                f32s(weight, "weight")?,
                bias,
                layout,
                n,
                c,
                oc,
            )
        }
        &Kernel::MatmulBackward {
            ref dinp,
            ref dweight,
            ref dbias,
            ref dout,
            ref inp,
            ref weight,
            layout,
            n,
            c,
            oc,
        } => {
            let dbias = match dbias {
                Some(b) => Some(f32s_mut(b, "dbias")?),
                None => None,
            };
            ops::matmul_backward(
                cpu,
                f32s_mut(dinp, "dinp")?,
                f32s_mut(dweight, "dweight")?,
                dbias,
                f32s(dout, "dout")?,
                f32s(inp, "inp")?,
                f32s(weight, "weight")?,
                layout,
                n,
                c,
                oc,
            )
        }
        &Kernel::Attention {
            ref out,
            ref att,
            ref qkv,
            b,
            t,
            c,
            nh,
            ..
        } => ops::attention_forward(
            cpu,
            f32s_mut(out, "out")?,
            f32s_mut(att, "att")?,
            f32s(qkv, "qkv")?,
            b,
            t,
            c,
            nh,
        ),
        &Kernel::AttentionBackward {
            ref dqkv,
            ref dout,
            ref qkv,
            ref att,
            ref scratch,
            b,
            t,
            c,
            nh,
        } => {
            let scratch = scratch_f32(scratch, b * nh * t * t)?;
            ops::attention_backward(
                cpu,
                f32s_mut(dqkv, "dqkv")?,
                f32s_mut(&scratch, "scratch")?,
                f32s(dout, "dout")?,
                f32s(qkv, "qkv")?,
                f32s(att, "att")?,
                b,
                t,
                c,
                nh,
            )
        }
        Kernel::Gelu { out, inp } => {
            ops::gelu_forward(cpu, f32s_mut(out, "out")?, f32s(inp, "inp")?)
        }
        Kernel::GeluBackward { dinp, inp, dout } => ops::gelu_backward(
            cpu,
            f32s_mut(dinp, "dinp")?,
            f32s(inp, "inp")?,
            f32s(dout, "dout")?,
        ),
        Kernel::Residual { out, a, b } => {
            ops::residual_forward(cpu, f32s_mut(out, "out")?, f32s(a, "a")?, f32s(b, "b")?)
        }
        &Kernel::CrossEntropy {
            ref losses,
            ref logits,
            ref targets,
            n,
            v,
        } => ops::crossentropy_forward(
            cpu,
            f32s_mut(losses, "losses")?,
            f32s(logits, "logits")?,
            u32s(targets, "targets")?,
            n,
            v,
        ),
        &Kernel::CrossEntropyBackward {
            ref logits,
            ref targets,
            n,
            v,
        } => ops::crossentropy_backward_inplace(
            cpu,
            f32s_mut(logits, "logits")?,
            u32s(targets, "targets")?,
            scalars.dloss,
            n,
            v,
        ),
        &Kernel::RmsNorm {
            ref out,
            ref rstd,
            ref inp,
            ref weight,
            eps,
            n,
            c,
        } => ops::rmsnorm_forward(
            cpu,
            f32s_mut(out, "out")?,
            f32s_mut(rstd, "rstd")?,
            f32s(inp, "inp")?,
            f32s(weight, "weight")?,
            eps,
            n,
            c,
        ),
        &Kernel::RmsNormBackward {
            ref dinp,
            ref dweight,
            ref dout,
            ref inp,
            ref weight,
            ref rstd,
            n,
            c,
        } => ops::rmsnorm_backward(
            cpu,
            f32s_mut(dinp, "dinp")?,
            f32s_mut(dweight, "dweight")?,
            f32s(dout, "dout")?,
            f32s(inp, "inp")?,
            f32s(weight, "weight")?,
            f32s(rstd, "rstd")?,
            n,
            c,
        ),
        &Kernel::Rope {
            ref out,
            ref inp,
            ref cos,
            ref sin,
            b,
            t,
            h,
            d,
        } => ops::rope_forward(
            cpu,
            f32s_mut(out, "out")?,
            f32s(inp, "inp")?,
            f32s(cos, "cos")?,
            f32s(sin, "sin")?,
            b,
            t,
            h,
            d,
        ),
        &Kernel::RopeBackward {
            ref dinp,
            ref dout,
            ref cos,
            ref sin,
            b,
            t,
            h,
            d,
        } => ops::rope_backward(
            cpu,
            f32s_mut(dinp, "dinp")?,
            f32s(dout, "dout")?,
            f32s(cos, "cos")?,
            f32s(sin, "sin")?,
            b,
            t,
            h,
            d,
        ),
        &Kernel::RopeTable {
            ref cos,
            ref sin,
            t,
            d,
            ref freqs,
        } => {
            if !d.is_multiple_of(2) {
                return Err(KernelError::Shape {
                    kernel: name,
                    what: "d (channels per head, even)",
                    len: d,
                    expected: d + 1,
                });
            }
            expect(cos, "cos", t * d / 2)?;
            expect(sin, "sin", t * d / 2)?;
            ops::rope_table_of(f32s_mut(cos, "cos")?, f32s_mut(sin, "sin")?, freqs, t, d)
        }
        Kernel::SwiGlu { out, gate, up } => ops::swiglu_forward(
            cpu,
            f32s_mut(out, "out")?,
            f32s(gate, "gate")?,
            f32s(up, "up")?,
        ),
        Kernel::SwiGluBackward {
            dgate,
            dup,
            dout,
            gate,
            up,
        } => ops::swiglu_backward(
            cpu,
            f32s_mut(dgate, "dgate")?,
            f32s_mut(dup, "dup")?,
            f32s(dout, "dout")?,
            f32s(gate, "gate")?,
            f32s(up, "up")?,
        ),
        &Kernel::GqaAttention {
            ref out,
            ref att,
            ref q,
            ref k,
            ref v,
            b,
            t,
            h,
            kv,
            d,
            ..
        } => ops::gqa_attention_forward(
            cpu,
            f32s_mut(out, "out")?,
            f32s_mut(att, "att")?,
            f32s(q, "q")?,
            f32s(k, "k")?,
            f32s(v, "v")?,
            gqa_dims(name, b, t, h, kv, d)?,
        ),
        &Kernel::GqaAttentionBackward {
            ref dq,
            ref dk,
            ref dv,
            ref dout,
            ref q,
            ref k,
            ref v,
            ref att,
            ref scratch,
            b,
            t,
            h,
            kv,
            d,
        } => {
            let dims = gqa_dims(name, b, t, h, kv, d)?;
            let scratch = scratch_f32(scratch, dims.att_len())?;
            ops::gqa_attention_backward(
                cpu,
                f32s_mut(dq, "dq")?,
                f32s_mut(dk, "dk")?,
                f32s_mut(dv, "dv")?,
                f32s_mut(&scratch, "scratch")?,
                f32s(dout, "dout")?,
                f32s(q, "q")?,
                f32s(k, "k")?,
                f32s(v, "v")?,
                f32s(att, "att")?,
                dims,
            )
        }
        Kernel::GradStats { grads, out, .. } => {
            expect(out, "out (bytes)", 16)?;
            let stats = grad_stats(
                cpu.isa,
                cpu.threads,
                Grads::F32(f32s(grads, "grads")?),
                scalars.stats_scale,
            )?;
            write_stats(bytes_mut(out), stats);
        }
        &Kernel::AdamW {
            ref params,
            ref m,
            ref v,
            ref grads,
            ref copy_out,
            round,
            decay,
        } => {
            if scalars.skip_update {
                return Ok(());
            }
            let step = if decay {
                scalars.adam
            } else {
                scalars.adam_no_decay
            }
            .ok_or(KernelError::NoAdamStep)?;
            let params = f32s_mut(params, "params")?;
            let state = State::F32 {
                m: f32s_mut(m, "m")?,
                v: f32s_mut(v, "v")?,
            };
            let grads = Grads::F32(f32s(grads, "grads")?);
            match copy_out {
                None => step.apply(cpu.isa, cpu.threads, params, state, grads, CopyOut::None)?,
                Some(out) if out.dtype == Dtype::Bf16 => {
                    // SAFETY: as for the other views: a written tensor of this kernel.
                    let out = unsafe {
                        std::slice::from_raw_parts_mut(memory.address(out).cast::<bf16>(), out.len)
                    };
                    step.apply(
                        cpu.isa,
                        cpu.threads,
                        params,
                        state,
                        grads,
                        CopyOut::Bf16(out),
                    )?
                }
                Some(out) if out.dtype == Dtype::F16 => {
                    // SAFETY: as above.
                    let out = unsafe {
                        std::slice::from_raw_parts_mut(memory.address(out).cast::<f16>(), out.len)
                    };
                    step.apply(
                        cpu.isa,
                        cpu.threads,
                        params,
                        state,
                        grads,
                        CopyOut::F16(out),
                    )?
                }
                Some(out) => {
                    // A working copy in f32 (the CPU computes in f32), rounded to `round`.
                    step.apply(cpu.isa, cpu.threads, params, state, grads, CopyOut::None)?;
                    let out = f32s_mut(out, "copy_out")?;
                    round_into_f32(cpu, round, params, out);
                }
            }
        }
    }
    Ok(())
}

/// The dimensions of a grouped-query attention kernel, or an error unless `kv` divides
/// `h` (both positive).
pub fn gqa_dims(
    kernel: &'static str,
    b: usize,
    t: usize,
    h: usize,
    kv: usize,
    d: usize,
) -> Result<GqaDims, KernelError> {
    if kv == 0 || !h.is_multiple_of(kv) {
        return Err(KernelError::Shape {
            kernel,
            what: "h (query heads, a positive multiple of kv)",
            len: h,
            expected: h.next_multiple_of(kv.max(1)).max(kv.max(1)),
        });
    }
    Ok(GqaDims { b, t, h, kv, d })
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

/// Writes gradient statistics as [`Kernel::GradStats`] lays them out: the sum of
/// squares, then 1.0 if any gradient was not finite (two little-endian f64).
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Memory for tests: one f32 vector per binding.
    struct Buffers(Vec<Vec<f32>>);

    impl CpuMemory for Buffers {
        fn address(&self, t: &TensorRef) -> *mut u8 {
            let buf = &self.0[t.buf as usize];
            assert!(t.offset_bytes + t.bytes() <= buf.len() * 4);
            // SAFETY: inside the vector (checked above).
            unsafe { buf.as_ptr().cast::<u8>().cast_mut().add(t.offset_bytes) }
        }
    }

    #[test]
    fn a_matmul_over_bound_tensors_equals_the_direct_call() {
        let (n, c, oc) = (3, 5, 4);
        let inp: Vec<f32> = (0..n * c).map(|i| i as f32 * 0.1 - 0.7).collect();
        // One buffer holding weight then bias, as a block's parameters do.
        let mut params: Vec<f32> = (0..c * oc).map(|i| (i as f32 * 0.37).sin()).collect();
        params.extend((0..oc).map(|i| i as f32));
        let mem = Buffers(vec![vec![0.0; n * oc], inp.clone(), params.clone()]);
        let k = Kernel::Matmul {
            out: TensorRef::new(0, 0, n * oc, Dtype::F32),
            inp: TensorRef::new(1, 0, n * c, Dtype::F32),
            weight: TensorRef::new(2, 0, c * oc, Dtype::F32),
            bias: Some(TensorRef::new(2, c * oc * 4, oc, Dtype::F32)),
            layout: WeightLayout::InOut,
            n,
            c,
            oc,
        };
        let cpu = Cpu::default();
        // SAFETY: every tensor lies inside its vector; nothing else touches them.
        unsafe { run_cpu(&k, &cpu, &Scalars::default(), &mem) }.unwrap();
        let mut want = vec![0.0; n * oc];
        ops::matmul_forward(
            &cpu,
            &mut want,
            &inp,
            &params[..c * oc],
            Some(&params[c * oc..]),
            WeightLayout::InOut,
            n,
            c,
            oc,
        );
        assert_eq!(mem.0[0], want);
        assert!(k.flops() > 0.0);
        let mut written = 0;
        k.for_each_tensor(|_, a| written += usize::from(a == Access::Write));
        assert_eq!(written, 1);
    }

    #[test]
    fn fold_ranks_is_the_left_fold_in_rank_order() {
        // Values whose sum depends on the order: 1e8 + 1 + -1e8 is 0 from the left.
        let chunks = vec![1e8, -0.0, 1.0, -0.0, -1e8, -0.0];
        for (accumulate, start, want) in [
            (false, 5.0, [0.0f32, -0.0]),
            (true, 5.0, [((5.0f32 + 1e8) + 1.0) + -1e8, 5.0]),
        ] {
            let mem = Buffers(vec![vec![start; 2], chunks.clone()]);
            let k = Kernel::FoldRanks {
                acc: TensorRef::new(0, 0, 2, Dtype::F32),
                chunks: TensorRef::new(1, 0, 6, Dtype::F32),
                ranks: 3,
                accumulate,
            };
            // SAFETY: inside the vectors.
            unsafe { run_cpu(&k, &Cpu::default(), &Scalars::default(), &mem) }.unwrap();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            // Without accumulate -0.0 survives (a start of +0.0 would make it +0.0).
            assert_eq!(bits(&mem.0[0]), bits(&want), "accumulate {accumulate}");
        }
    }

    #[test]
    fn a_wrong_dtype_is_an_error_naming_the_tensor() {
        let mem = Buffers(vec![vec![0.0; 8], vec![0.0; 8]]);
        let k = Kernel::Gelu {
            out: TensorRef::new(0, 0, 8, Dtype::Bf16),
            inp: TensorRef::new(1, 0, 8, Dtype::F32),
        };
        // SAFETY: inside the vectors.
        let e = unsafe { run_cpu(&k, &Cpu::default(), &Scalars::default(), &mem) }.unwrap_err();
        assert!(e.to_string().contains("out"), "{e}");
    }

    /// Each (start, bytes) region aligned, after the one before, and inside `total`.
    fn check_regions(regions: &[(usize, usize)], total: usize) {
        let mut end = 0;
        for &(start, bytes) in regions {
            assert_eq!(start % ATTENTION_SCRATCH_ALIGN, 0);
            assert!(start >= end, "regions overlap");
            end = start + bytes;
        }
        assert!(end <= total);
    }

    #[test]
    fn attention_scratch_regions_are_aligned_disjoint_and_inside() {
        for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            for (b, t, c, nh) in [(1, 1, 4, 1), (2, 7, 22, 2), (3, 37, 48, 3)] {
                let l = attention_scratch_layout(dtype, b, t, c, nh);
                let (heads, scores) = (b * t * c * dtype.size(), b * nh * t * t);
                let regions = [
                    (l.q, heads),
                    (l.k, heads),
                    (l.v, heads),
                    (l.y, heads),
                    (l.dq, heads),
                    (l.dk, heads),
                    (l.dv, heads),
                    (l.scores, scores * 4),
                    (l.dscores, scores * dtype.size()),
                ];
                check_regions(&regions, l.total_bytes);
                assert_eq!(
                    attention_scratch_bytes(Target::Cuda, dtype, b, t, c, nh),
                    l.total_bytes
                );
            }
        }
        // Grouped-query attention: q, y, dq per query head, k, v, dk, dv per key/value
        // head; with as many of each, GPT-2's layout exactly.
        for dtype in [Dtype::F32, Dtype::Bf16] {
            for (b, t, h, kv, d) in [(1, 1, 1, 1, 4), (2, 13, 6, 2, 12), (3, 37, 4, 1, 16)] {
                let l = gqa_attention_scratch_layout(dtype, b, t, h, kv, d);
                let (queries, keys) = (b * t * h * d * dtype.size(), b * t * kv * d * dtype.size());
                let scores = b * h * t * t;
                let regions = [
                    (l.q, queries),
                    (l.k, keys),
                    (l.v, keys),
                    (l.y, queries),
                    (l.dq, queries),
                    (l.dk, keys),
                    (l.dv, keys),
                    (l.scores, scores * 4),
                    (l.dscores, scores * dtype.size()),
                ];
                check_regions(&regions, l.total_bytes);
                assert_eq!(
                    gqa_attention_scratch_bytes(Target::Cuda, dtype, b, t, h, kv, d),
                    l.total_bytes
                );
                assert_eq!(
                    gqa_attention_scratch_bytes(Target::Cpu, dtype, b, t, h, kv, d),
                    scores * 4
                );
                assert_eq!(
                    gqa_attention_scratch_layout(dtype, b, t, h, h, d),
                    attention_scratch_layout(dtype, b, t, h * d, h)
                );
            }
        }
        assert_eq!(grad_stats_blocks(0), 1);
        assert_eq!(grad_stats_blocks(257), 2);
        assert_eq!(grad_stats_blocks(1 << 30), GRAD_STATS_MAX_BLOCKS);
        assert_eq!(grad_stats_scratch_bytes(Target::Cuda, 257), 16);
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
