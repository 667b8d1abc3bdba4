//! Where a block's math runs: the operations the GPT-2 blocks are written in, once, for
//! every device.
//!
//! A [`Backend`] owns no model state. It allocates buffers of its own kinds and runs one
//! kernel per call, in call order (a GPU backend enqueues them on one stream). The
//! blocks in [`super::block`] are written against this trait only; [`CpuBackend`] runs
//! the kernels of `strata_kernels::ops`, and the CUDA backend those of
//! `strata_kernels::cuda`.
//!
//! Parameters are addressed as a block's whole buffer plus a [`Slot`] in it, so a call
//! can read several tensors of one block and write their gradients, which live at the
//! same slots of the block's gradient buffer. Semantics of every operation are those of
//! the kernels (`strata_kernels::ops`): forward outputs are overwritten, parameter
//! gradients accumulate, LayerNorm's input gradient accumulates, other activation
//! gradients are overwritten.

use half::{bf16, f16};
use strata_kernels::ops::{self, Cpu, WeightLayout};

use super::{ModelError, Slot};

/// A block's parameters in host memory, in the dtype they are kept in there.
#[derive(Debug, Clone, Copy)]
pub enum HostParams<'a> {
    /// fp32 (the master copy, or fp32 training).
    F32(&'a [f32]),
    /// bf16 working copy.
    Bf16(&'a [bf16]),
    /// fp16 working copy.
    F16(&'a [f16]),
}

impl HostParams<'_> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            HostParams::F32(s) => s.len(),
            HostParams::Bf16(s) => s.len(),
            HostParams::F16(s) => s.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values as f32 in `out` (equal lengths): exact for every dtype.
    pub fn to_f32(&self, cpu: &Cpu, out: &mut [f32]) {
        assert_eq!(out.len(), self.len(), "host params length");
        match self {
            HostParams::F32(s) => out.copy_from_slice(s),
            HostParams::Bf16(s) => ops::bf16_to_f32(cpu, out, s),
            HostParams::F16(s) => ops::f16_to_f32(cpu, out, s),
        }
    }
}

/// The batch and model dimensions every call of one step shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// Batch size B.
    pub batch: usize,
    /// Sequence length T.
    pub seq: usize,
    /// Channels C.
    pub width: usize,
    /// Attention heads.
    pub heads: usize,
    /// Vocabulary size V.
    pub vocab: usize,
}

impl Dims {
    /// Positions in a batch: B × T.
    pub fn rows(&self) -> usize {
        self.batch * self.seq
    }
}

/// The operations GPT-2's blocks need, on one device.
#[allow(clippy::too_many_arguments)]
pub trait Backend {
    /// Activations and their gradients, in the working dtype.
    type Act;
    /// One block's parameter buffer, in the working dtype.
    type Params;
    /// One block's parameter gradients, in f32.
    type Grads;
    /// f32 per-row values: LayerNorm statistics, per-position losses.
    type Stats;
    /// Token ids.
    type Tokens;
    /// Extra memory attention needs (sized for one batch shape).
    type AttentionScratch;

    /// A short description for logs and reports (`cpu avx512 x2`, `cuda:0 bf16`).
    fn describe(&self) -> String;

    /// An activation buffer of `len` elements.
    fn alloc_act(&self, len: usize) -> Result<Self::Act, ModelError>;
    /// A statistics buffer of `len` elements.
    fn alloc_stats(&self, len: usize) -> Result<Self::Stats, ModelError>;
    /// A token buffer of `len` ids.
    fn alloc_tokens(&self, len: usize) -> Result<Self::Tokens, ModelError>;
    /// A zeroed gradient buffer of `len` elements.
    fn alloc_grads(&self, len: usize) -> Result<Self::Grads, ModelError>;
    /// Attention's scratch for this batch shape.
    fn alloc_attention_scratch(&self, dims: Dims) -> Result<Self::AttentionScratch, ModelError>;

    /// A zeroed parameter buffer of `len` elements (a slot an executor fills per block).
    fn alloc_params(&self, len: usize) -> Result<Self::Params, ModelError>;
    /// Copies `src` into the first `src.len()` elements of `dst`, converted to the
    /// working dtype.
    fn write_params(&self, dst: &mut Self::Params, src: HostParams<'_>) -> Result<(), ModelError>;
    /// Copies the first `dst.len()` gradients of `src` into `dst`, or adds them to it
    /// when `accumulate` (in f32, one addition per element).
    fn read_grads(
        &self,
        src: &Self::Grads,
        dst: &mut [f32],
        accumulate: bool,
    ) -> Result<(), ModelError>;
    /// `dst += src`, elementwise over `src`'s length (gradient accumulation on the
    /// device).
    fn add_grads(&self, dst: &mut Self::Grads, src: &Self::Grads) -> Result<(), ModelError>;
    /// Copies a statistics buffer's first `dst.len()` values into `dst`.
    fn read_stats(&self, src: &Self::Stats, dst: &mut [f32]) -> Result<(), ModelError>;
    /// Copies the first `dst.len()` bytes of an activation buffer (its elements in the
    /// working dtype) into `dst`.
    fn read_act(&self, src: &Self::Act, dst: &mut [u8]) -> Result<(), ModelError>;
    /// Copies `src` (elements in the working dtype) into the start of `dst`.
    fn write_act(&self, dst: &mut Self::Act, src: &[u8]) -> Result<(), ModelError>;
    /// A gradient buffer as host memory, where this backend's buffers are host memory
    /// (the CPU); `None` where they are not.
    fn host_grads<'a>(&self, _grads: &'a Self::Grads) -> Option<&'a [f32]> {
        None
    }

    /// A parameter buffer holding `host` (converted to the working dtype).
    fn upload_params(&self, host: &[f32]) -> Result<Self::Params, ModelError>;
    /// Copies token ids into `dst` (equal lengths).
    fn upload_tokens(&self, dst: &mut Self::Tokens, host: &[u32]) -> Result<(), ModelError>;
    /// An activation buffer's contents, as f32.
    fn download_act(&self, src: &Self::Act) -> Result<Vec<f32>, ModelError>;
    /// A statistics buffer's contents.
    fn download_stats(&self, src: &Self::Stats) -> Result<Vec<f32>, ModelError>;
    /// A gradient buffer's contents.
    fn download_grads(&self, src: &Self::Grads) -> Result<Vec<f32>, ModelError>;

    /// Sets every element of `dst` to zero.
    fn zero_act(&self, dst: &mut Self::Act) -> Result<(), ModelError>;
    /// Sets every element of `dst` to zero.
    fn zero_grads(&self, dst: &mut Self::Grads) -> Result<(), ModelError>;
    /// `dst = src` (equal lengths).
    fn copy_act(&self, dst: &mut Self::Act, src: &Self::Act) -> Result<(), ModelError>;

    /// out: (B, T, C)  tokens: (B, T)  `params[wte]`: (V, C)  `params[wpe]`: (ctx, C).
    fn encoder_forward(
        &self,
        out: &mut Self::Act,
        tokens: &Self::Tokens,
        params: &Self::Params,
        wte: Slot,
        wpe: Slot,
        dims: Dims,
    ) -> Result<(), ModelError>;
    /// `grads[wte]`, `grads[wpe]` +=  dout: (B, T, C)  tokens: (B, T).
    fn encoder_backward(
        &self,
        grads: &mut Self::Grads,
        wte: Slot,
        wpe: Slot,
        dout: &Self::Act,
        tokens: &Self::Tokens,
        dims: Dims,
    ) -> Result<(), ModelError>;
    /// out: (N, C)  mean, rstd: (N)  inp: (N, C)  `params[weight]`, `params[bias]`: (C).
    fn layernorm_forward(
        &self,
        out: &mut Self::Act,
        mean: &mut Self::Stats,
        rstd: &mut Self::Stats,
        inp: &Self::Act,
        params: &Self::Params,
        weight: Slot,
        bias: Slot,
        n: usize,
        c: usize,
    ) -> Result<(), ModelError>;
    /// dinp: (N, C) +=  `grads[weight]`, `grads[bias]` +=  dout, inp: (N, C).
    fn layernorm_backward(
        &self,
        dinp: &mut Self::Act,
        grads: &mut Self::Grads,
        dout: &Self::Act,
        inp: &Self::Act,
        params: &Self::Params,
        weight: Slot,
        bias: Slot,
        mean: &Self::Stats,
        rstd: &Self::Stats,
        n: usize,
        c: usize,
    ) -> Result<(), ModelError>;
    /// out: (N, OC) = inp: (N, C) @ `params[weight]` + `params[bias]`.
    fn matmul_forward(
        &self,
        out: &mut Self::Act,
        inp: &Self::Act,
        params: &Self::Params,
        weight: Slot,
        bias: Option<Slot>,
        layout: WeightLayout,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<(), ModelError>;
    /// dinp: (N, C) =  `grads[weight]`, `grads[bias]` +=  dout: (N, OC)  inp: (N, C).
    fn matmul_backward(
        &self,
        dinp: &mut Self::Act,
        grads: &mut Self::Grads,
        dout: &Self::Act,
        inp: &Self::Act,
        params: &Self::Params,
        weight: Slot,
        bias: Option<Slot>,
        layout: WeightLayout,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<(), ModelError>;
    /// out: (B, T, C)  att: (B, NH, T, T)  qkv: (B, T, 3C).
    fn attention_forward(
        &self,
        out: &mut Self::Act,
        att: &mut Self::Act,
        qkv: &Self::Act,
        scratch: &mut Self::AttentionScratch,
        dims: Dims,
    ) -> Result<(), ModelError>;
    /// dqkv: (B, T, 3C) =  dout: (B, T, C)  qkv: (B, T, 3C)  att: (B, NH, T, T).
    fn attention_backward(
        &self,
        dqkv: &mut Self::Act,
        dout: &Self::Act,
        qkv: &Self::Act,
        att: &Self::Act,
        scratch: &mut Self::AttentionScratch,
        dims: Dims,
    ) -> Result<(), ModelError>;
    /// out = gelu(inp), elementwise.
    fn gelu_forward(&self, out: &mut Self::Act, inp: &Self::Act) -> Result<(), ModelError>;
    /// dinp = gelu'(inp) * dout, elementwise.
    fn gelu_backward(
        &self,
        dinp: &mut Self::Act,
        inp: &Self::Act,
        dout: &Self::Act,
    ) -> Result<(), ModelError>;
    /// out = a + b, elementwise.
    fn residual_forward(
        &self,
        out: &mut Self::Act,
        a: &Self::Act,
        b: &Self::Act,
    ) -> Result<(), ModelError>;
    /// losses: (N)  logits: (N, V)  targets: (N).
    fn crossentropy_forward(
        &self,
        losses: &mut Self::Stats,
        logits: &Self::Act,
        targets: &Self::Tokens,
        n: usize,
        v: usize,
    ) -> Result<(), ModelError>;
    /// logits: (N, V) replaced by `(softmax - onehot(targets)) * dloss`.
    fn crossentropy_backward(
        &self,
        logits: &mut Self::Act,
        targets: &Self::Tokens,
        dloss: f32,
        n: usize,
        v: usize,
    ) -> Result<(), ModelError>;
}

/// The CPU: kernels of `strata_kernels::ops`, in f32, on the worker pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuBackend {
    /// Instruction set and thread budget of every kernel call.
    pub cpu: Cpu,
}

impl Default for CpuBackend {
    /// The best instruction set, every thread of the pool.
    fn default() -> Self {
        CpuBackend {
            cpu: Cpu::default(),
        }
    }
}

impl Backend for CpuBackend {
    type Act = Vec<f32>;
    type Params = Vec<f32>;
    type Grads = Vec<f32>;
    type Stats = Vec<f32>;
    type Tokens = Vec<u32>;
    type AttentionScratch = Vec<f32>;

    fn describe(&self) -> String {
        format!("cpu {} x{}", self.cpu.isa, self.cpu.threads)
    }

    fn alloc_act(&self, len: usize) -> Result<Vec<f32>, ModelError> {
        Ok(vec![0.0; len])
    }
    fn alloc_stats(&self, len: usize) -> Result<Vec<f32>, ModelError> {
        Ok(vec![0.0; len])
    }
    fn alloc_tokens(&self, len: usize) -> Result<Vec<u32>, ModelError> {
        Ok(vec![0; len])
    }
    fn alloc_grads(&self, len: usize) -> Result<Vec<f32>, ModelError> {
        Ok(vec![0.0; len])
    }
    fn alloc_attention_scratch(&self, d: Dims) -> Result<Vec<f32>, ModelError> {
        Ok(vec![0.0; d.batch * d.heads * d.seq * d.seq])
    }

    fn alloc_params(&self, len: usize) -> Result<Vec<f32>, ModelError> {
        Ok(vec![0.0; len])
    }
    fn write_params(&self, dst: &mut Vec<f32>, src: HostParams<'_>) -> Result<(), ModelError> {
        assert!(src.len() <= dst.len(), "parameters longer than their slot");
        src.to_f32(&self.cpu, &mut dst[..src.len()]);
        Ok(())
    }
    fn read_grads(
        &self,
        src: &Vec<f32>,
        dst: &mut [f32],
        accumulate: bool,
    ) -> Result<(), ModelError> {
        let src = &src[..dst.len()];
        if accumulate {
            dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
        } else {
            dst.copy_from_slice(src);
        }
        Ok(())
    }
    fn add_grads(&self, dst: &mut Vec<f32>, src: &Vec<f32>) -> Result<(), ModelError> {
        dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
        Ok(())
    }
    fn read_stats(&self, src: &Vec<f32>, dst: &mut [f32]) -> Result<(), ModelError> {
        dst.copy_from_slice(&src[..dst.len()]);
        Ok(())
    }
    fn read_act(&self, src: &Vec<f32>, dst: &mut [u8]) -> Result<(), ModelError> {
        let bytes = crate::device::bytes_of(src);
        dst.copy_from_slice(&bytes[..dst.len()]);
        Ok(())
    }
    fn write_act(&self, dst: &mut Vec<f32>, src: &[u8]) -> Result<(), ModelError> {
        crate::device::bytes_of_mut(dst)[..src.len()].copy_from_slice(src);
        Ok(())
    }
    fn host_grads<'a>(&self, grads: &'a Vec<f32>) -> Option<&'a [f32]> {
        Some(grads)
    }
    fn upload_params(&self, host: &[f32]) -> Result<Vec<f32>, ModelError> {
        Ok(host.to_vec())
    }
    fn upload_tokens(&self, dst: &mut Vec<u32>, host: &[u32]) -> Result<(), ModelError> {
        dst.copy_from_slice(host);
        Ok(())
    }
    fn download_act(&self, src: &Vec<f32>) -> Result<Vec<f32>, ModelError> {
        Ok(src.clone())
    }
    fn download_stats(&self, src: &Vec<f32>) -> Result<Vec<f32>, ModelError> {
        Ok(src.clone())
    }
    fn download_grads(&self, src: &Vec<f32>) -> Result<Vec<f32>, ModelError> {
        Ok(src.clone())
    }

    fn zero_act(&self, dst: &mut Vec<f32>) -> Result<(), ModelError> {
        dst.fill(0.0);
        Ok(())
    }
    fn zero_grads(&self, dst: &mut Vec<f32>) -> Result<(), ModelError> {
        dst.fill(0.0);
        Ok(())
    }
    fn copy_act(&self, dst: &mut Vec<f32>, src: &Vec<f32>) -> Result<(), ModelError> {
        dst.copy_from_slice(src);
        Ok(())
    }

    fn encoder_forward(
        &self,
        out: &mut Vec<f32>,
        tokens: &Vec<u32>,
        params: &Vec<f32>,
        wte: Slot,
        wpe: Slot,
        d: Dims,
    ) -> Result<(), ModelError> {
        let (wte, wpe) = (&params[wte.range()], &params[wpe.range()]);
        ops::encoder_forward(&self.cpu, out, tokens, wte, wpe, d.batch, d.seq, d.width);
        Ok(())
    }
    fn encoder_backward(
        &self,
        grads: &mut Vec<f32>,
        wte: Slot,
        wpe: Slot,
        dout: &Vec<f32>,
        tokens: &Vec<u32>,
        d: Dims,
    ) -> Result<(), ModelError> {
        let (dwte, dwpe) = two_slots_mut(grads, wte, wpe);
        ops::encoder_backward(&self.cpu, dwte, dwpe, dout, tokens, d.batch, d.seq, d.width);
        Ok(())
    }
    fn layernorm_forward(
        &self,
        out: &mut Vec<f32>,
        mean: &mut Vec<f32>,
        rstd: &mut Vec<f32>,
        inp: &Vec<f32>,
        params: &Vec<f32>,
        weight: Slot,
        bias: Slot,
        n: usize,
        c: usize,
    ) -> Result<(), ModelError> {
        let (w, b) = (&params[weight.range()], &params[bias.range()]);
        ops::layernorm_forward(&self.cpu, out, mean, rstd, inp, w, b, n, c);
        Ok(())
    }
    fn layernorm_backward(
        &self,
        dinp: &mut Vec<f32>,
        grads: &mut Vec<f32>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        params: &Vec<f32>,
        weight: Slot,
        bias: Slot,
        mean: &Vec<f32>,
        rstd: &Vec<f32>,
        n: usize,
        c: usize,
    ) -> Result<(), ModelError> {
        let (dw, db) = two_slots_mut(grads, weight, bias);
        let w = &params[weight.range()];
        ops::layernorm_backward(&self.cpu, dinp, dw, db, dout, inp, w, mean, rstd, n, c);
        Ok(())
    }
    fn matmul_forward(
        &self,
        out: &mut Vec<f32>,
        inp: &Vec<f32>,
        params: &Vec<f32>,
        weight: Slot,
        bias: Option<Slot>,
        layout: WeightLayout,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<(), ModelError> {
        let w = &params[weight.range()];
        let b = bias.map(|b| &params[b.range()]);
        ops::matmul_forward(&self.cpu, out, inp, w, b, layout, n, c, oc);
        Ok(())
    }
    fn matmul_backward(
        &self,
        dinp: &mut Vec<f32>,
        grads: &mut Vec<f32>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        params: &Vec<f32>,
        weight: Slot,
        bias: Option<Slot>,
        layout: WeightLayout,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<(), ModelError> {
        let w = &params[weight.range()];
        let (dw, db) = match bias {
            Some(bias) => {
                let (dw, db) = two_slots_mut(grads, weight, bias);
                (dw, Some(db))
            }
            None => (&mut grads[weight.range()], None),
        };
        ops::matmul_backward(&self.cpu, dinp, dw, db, dout, inp, w, layout, n, c, oc);
        Ok(())
    }
    fn attention_forward(
        &self,
        out: &mut Vec<f32>,
        att: &mut Vec<f32>,
        qkv: &Vec<f32>,
        _scratch: &mut Vec<f32>,
        d: Dims,
    ) -> Result<(), ModelError> {
        ops::attention_forward(&self.cpu, out, att, qkv, d.batch, d.seq, d.width, d.heads);
        Ok(())
    }
    fn attention_backward(
        &self,
        dqkv: &mut Vec<f32>,
        dout: &Vec<f32>,
        qkv: &Vec<f32>,
        att: &Vec<f32>,
        scratch: &mut Vec<f32>,
        d: Dims,
    ) -> Result<(), ModelError> {
        let (b, t, c, nh) = (d.batch, d.seq, d.width, d.heads);
        ops::attention_backward(&self.cpu, dqkv, scratch, dout, qkv, att, b, t, c, nh);
        Ok(())
    }
    fn gelu_forward(&self, out: &mut Vec<f32>, inp: &Vec<f32>) -> Result<(), ModelError> {
        ops::gelu_forward(&self.cpu, out, inp);
        Ok(())
    }
    fn gelu_backward(
        &self,
        dinp: &mut Vec<f32>,
        inp: &Vec<f32>,
        dout: &Vec<f32>,
    ) -> Result<(), ModelError> {
        ops::gelu_backward(&self.cpu, dinp, inp, dout);
        Ok(())
    }
    fn residual_forward(
        &self,
        out: &mut Vec<f32>,
        a: &Vec<f32>,
        b: &Vec<f32>,
    ) -> Result<(), ModelError> {
        ops::residual_forward(&self.cpu, out, a, b);
        Ok(())
    }
    fn crossentropy_forward(
        &self,
        losses: &mut Vec<f32>,
        logits: &Vec<f32>,
        targets: &Vec<u32>,
        n: usize,
        v: usize,
    ) -> Result<(), ModelError> {
        ops::crossentropy_forward(&self.cpu, losses, logits, targets, n, v);
        Ok(())
    }
    fn crossentropy_backward(
        &self,
        logits: &mut Vec<f32>,
        targets: &Vec<u32>,
        dloss: f32,
        n: usize,
        v: usize,
    ) -> Result<(), ModelError> {
        ops::crossentropy_backward_inplace(&self.cpu, logits, targets, dloss, n, v);
        Ok(())
    }
}

/// Two disjoint slots of one buffer, mutably.
fn two_slots_mut(buf: &mut [f32], a: Slot, b: Slot) -> (&mut [f32], &mut [f32]) {
    assert!(
        a.range().end <= b.offset || b.range().end <= a.offset,
        "slots overlap"
    );
    if a.offset < b.offset {
        let (lo, hi) = buf.split_at_mut(b.offset);
        (&mut lo[a.range()], &mut hi[..b.len])
    } else {
        let (lo, hi) = buf.split_at_mut(a.offset);
        (&mut hi[..a.len], &mut lo[b.range()])
    }
}
