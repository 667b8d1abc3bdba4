//! Quantised frozen weights, QLoRA's base-model storage: NF4 with double-quantised
//! absmaxes (QLoRA's format, bit-compatible with bitsandbytes' `quantize_4bit(...,
//! quant_type="nf4", blocksize=64, compress_statistics=True)`, about 4.127 bits per
//! parameter) and blockwise int8 (8.5 bits per parameter). Quantisation runs once, at
//! load, on the CPU ([`Nf4Blocks::quantize`], [`Int8Blocks::quantize`]); dequantisation
//! runs on the device just before a product reads the weight: the kernels
//! [`Nf4Dequantize`] and [`Int8Dequantize`] (into the working type), with their CPU ops
//! ([`dequantize_nf4`], [`dequantize_int8`], into f32 or bf16, on the worker pool).
//!
//! The formats, their codebooks and the exact order of dequantisation's f32 operations
//! are in [`format`](mod@format); `quant.cu` holds the CUDA kernels, [`reference`](mod@reference) the
//! scalar reference. Every target makes the same roundings in the same order, so all agree
//! bit for bit (tested against the reference and, for NF4, against bitsandbytes' own
//! output, `tests/data/nf4/`). Not here: a fused dequantise-and-multiply (the product
//! reads the dequantised weight from scratch) and quantisation on the GPU.

use half::bf16;

use crate::cuda::launch::{Arg, CudaKernel, CudaSource, Entry, Launch, long, per_element};
use crate::ops::simd::on_isa;
use crate::ops::{Cpu, par_chunks};
use crate::program::{
    CpuKernel, CpuTensors, Dtype, DtypeRule, KernelError, LenRule, Param, Scalars, Signature,
    TensorRef,
};

pub mod format;
pub mod reference;
#[cfg(test)]
mod tests;

pub use format::{
    ABSMAX_GROUP, DYNAMIC_MAP, INT8_BLOCK, Int8Blocks, NF4_BLOCK, NF4_CODE, Nf4Blocks, Nf4Parts,
};
use format::{absmax_value, int8_value, nf4_value};

/// What a dequantiser writes: f32, or bf16 (the f32 value rounded to nearest, ties to
/// even, as every cast in strata).
pub trait Dequantized: Copy + Send + Sync {
    /// `x` in this type.
    fn from_f32(x: f32) -> Self;
}

impl Dequantized for f32 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Dequantized for bf16 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

/// Panics unless `q`'s parts are the lengths a tensor of `len` values has.
fn assert_nf4_lengths(len: usize, q: &Nf4Parts<'_>) {
    let want = (
        len.div_ceil(2),
        Nf4Blocks::block_count(len),
        Nf4Blocks::group_count(len),
    );
    let got = (q.codes.len(), q.absmax_q.len(), q.absmax_scale.len());
    assert_eq!(
        got, want,
        "NF4 parts (codes, absmax_q, absmax_scale) of {len} values"
    );
}

/// out: (N) = the NF4 tensor `q`'s values ([`format`](mod@format)), on the worker pool in whole
/// blocks: per block, its absmax, a table of the 16 levels times it, then a lookup per
/// value.
pub fn dequantize_nf4<T: Dequantized>(cpu: &Cpu, out: &mut [T], q: Nf4Parts<'_>) {
    dequantize_nf4_as(cpu, out, q, false);
}

/// [`dequantize_nf4`], each value rounded to bf16's precision first where `round_bf16`
/// (in the table of levels: no cost per value).
pub fn dequantize_nf4_as<T: Dequantized>(
    cpu: &Cpu,
    out: &mut [T],
    q: Nf4Parts<'_>,
    round_bf16: bool,
) {
    assert_nf4_lengths(out.len(), &q);
    par_chunks(cpu, out, NF4_BLOCK, |r, out| {
        on_isa!(
            cpu.isa,
            nf4_blocks(out, r.start / NF4_BLOCK, &q, round_bf16)
        )
    });
}

/// `x`, or where `round_bf16` the nearest bf16 value (ties to even) as f32: what a
/// dequantiser writes for the CPU device computing in f32 a base trained in bf16.
#[inline(always)]
fn rounded(x: f32, round_bf16: bool) -> f32 {
    if !round_bf16 {
        return x;
    }
    // bf16::from_f32's rounding, in integer arithmetic on the bits (a NaN, which only a
    // NaN weight could give, goes the slow way and stays a quiet NaN).
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return bf16::from_f32(x).to_f32();
    }
    f32::from_bits((u + 0x7fff + ((u >> 16) & 1)) & 0xffff_0000)
}

/// Dequantises the whole blocks `out` (the last may be short), block `first_block` first.
#[inline(always)]
fn nf4_blocks<T: Dequantized>(
    out: &mut [T],
    first_block: usize,
    q: &Nf4Parts<'_>,
    round_bf16: bool,
) {
    for (k, values) in out.chunks_mut(NF4_BLOCK).enumerate() {
        let b = first_block + k;
        let scale = q.absmax_scale[b / ABSMAX_GROUP];
        let absmax = absmax_value(q.absmax_q[b], scale, q.absmax_offset);
        let level: [T; 16] =
            std::array::from_fn(|c| T::from_f32(rounded(nf4_value(c as u8, absmax), round_bf16)));
        let bytes = &q.codes[b * NF4_BLOCK / 2..];
        let last_byte = values.len() / 2;
        let mut pairs = values.chunks_exact_mut(2);
        for (pair, &byte) in (&mut pairs).zip(bytes) {
            pair[0] = level[usize::from(byte >> 4)];
            pair[1] = level[usize::from(byte & 0x0f)];
        }
        if let [last] = pairs.into_remainder() {
            *last = level[usize::from(bytes[last_byte] >> 4)];
        }
    }
}

/// out: (N) = the int8 tensor's values, `codes` (N) two's complement, `scales` one per
/// block of [`INT8_BLOCK`]; on the worker pool in whole blocks.
pub fn dequantize_int8<T: Dequantized>(cpu: &Cpu, out: &mut [T], codes: &[u8], scales: &[f32]) {
    dequantize_int8_as(cpu, out, (codes, scales), false);
}

/// [`dequantize_int8`], each value rounded to bf16's precision first where `round_bf16`.
pub fn dequantize_int8_as<T: Dequantized>(
    cpu: &Cpu,
    out: &mut [T],
    (codes, scales): (&[u8], &[f32]),
    round_bf16: bool,
) {
    assert_eq!(
        (codes.len(), scales.len()),
        (out.len(), out.len().div_ceil(INT8_BLOCK)),
        "int8 parts (codes, scales) of {} values",
        out.len()
    );
    par_chunks(cpu, out, INT8_BLOCK, |r, out| {
        let scales = &scales[r.start / INT8_BLOCK..];
        on_isa!(cpu.isa, int8_blocks(out, &codes[r], scales, round_bf16))
    });
}

#[inline(always)]
fn int8_blocks<T: Dequantized>(out: &mut [T], codes: &[u8], scales: &[f32], round_bf16: bool) {
    let blocks = out.chunks_mut(INT8_BLOCK).zip(codes.chunks(INT8_BLOCK));
    for ((values, codes), &scale) in blocks.zip(scales) {
        for (o, &c) in values.iter_mut().zip(codes) {
            *o = T::from_f32(rounded(int8_value(c, scale), round_bf16));
        }
    }
}

/// The family's CUDA kernels.
const SOURCE: CudaSource = ("quant.cu", include_str!("quant.cu"));

const NF4_DEQUANTIZE: Entry = Entry::typed("nf4_dequantize");
const INT8_DEQUANTIZE: Entry = Entry::typed("int8_dequantize");

/// out = the NF4 tensor's values ([`format`](mod@format)), in the working type.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Nf4Dequantize {
    /// Output, N values.
    pub out: TensorRef,
    /// u8, `N.div_ceil(2)`: two codes a byte, the first element in the high nibble.
    pub codes: TensorRef,
    /// u8, one per block of 64 values ([`Nf4Blocks::block_count`]).
    pub absmax_q: TensorRef,
    /// f32, one per 256 blocks ([`Nf4Blocks::group_count`]).
    pub absmax_scale: TensorRef,
    /// f32, one: the mean of the blocks' absmaxes ([`Nf4Blocks::absmax_offset`]), read
    /// from memory so that a program built before the weights are quantised can
    /// dequantise them.
    pub absmax_offset: TensorRef,
    /// Each value rounded to bf16's precision, kept in the working type: for the CPU
    /// device computing in f32 a base trained in bf16 (a bf16 working type rounds
    /// anyway).
    pub round_bf16: bool,
}

impl Signature for Nf4Dequantize {
    const NAME: &'static str = "nf4-dequantize";
    /// Values.
    type Shape = usize;

    fn shape(&self) -> Result<usize, KernelError> {
        Ok(self.out.len)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let n = self.out.len;
        let (bytes, f32_) = (
            DtypeRule::Exactly(Dtype::U8),
            DtypeRule::Exactly(Dtype::F32),
        );
        each(Param::write(
            "out",
            &self.out,
            DtypeRule::Working,
            LenRule::Len(n),
        ));
        each(Param::read(
            "codes",
            &self.codes,
            bytes,
            LenRule::Len(n.div_ceil(2)),
        ));
        let blocks = LenRule::Len(Nf4Blocks::block_count(n));
        each(Param::read("absmax_q", &self.absmax_q, bytes, blocks));
        let groups = LenRule::Len(Nf4Blocks::group_count(n));
        each(Param::read(
            "absmax_scale",
            &self.absmax_scale,
            f32_,
            groups,
        ));
        each(Param::read(
            "absmax_offset",
            &self.absmax_offset,
            f32_,
            LenRule::Len(1),
        ));
    }

    fn flops(&self) -> f64 {
        self.out.len as f64
    }
}

impl CpuKernel for Nf4Dequantize {
    fn run_cpu(
        &self,
        _: &usize,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let parts = Nf4Parts {
            codes: t.bytes(&self.codes),
            absmax_q: t.bytes(&self.absmax_q),
            absmax_scale: t.f32(&self.absmax_scale),
            absmax_offset: t.f32(&self.absmax_offset)[0],
        };
        dequantize_nf4_as(cpu, t.f32_mut(&self.out), parts, self.round_bf16);
        Ok(())
    }
}

impl CudaKernel for Nf4Dequantize {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[NF4_DEQUANTIZE];

    fn launch(&self, &n: &usize, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        // nf4_dequantize_<T>(T* out, const unsigned char* codes, const unsigned char*
        // absmax_q, const float* absmax_scale, const float* absmax_offset, int round_bf16,
        // long long n): one thread per byte of codes.
        let args = [
            q.ptr(&self.out),
            q.ptr(&self.codes),
            q.ptr(&self.absmax_q),
            q.ptr(&self.absmax_scale),
            q.ptr(&self.absmax_offset),
            Arg::Int(i32::from(self.round_bf16)),
            long(n),
        ];
        Ok(q.launch(NF4_DEQUANTIZE, per_element(n.div_ceil(2)), &args)?)
    }
}

/// out = the int8 tensor's values ([`format`](mod@format)), in the working type.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Int8Dequantize {
    /// Output, N values.
    pub out: TensorRef,
    /// u8, N: each value's code, two's complement.
    pub codes: TensorRef,
    /// f32, one per block of 64 values.
    pub scales: TensorRef,
    /// Each value rounded to bf16's precision, kept in the working type (as
    /// [`Nf4Dequantize::round_bf16`]).
    pub round_bf16: bool,
}

impl Signature for Int8Dequantize {
    const NAME: &'static str = "int8-dequantize";
    /// Values.
    type Shape = usize;

    fn shape(&self) -> Result<usize, KernelError> {
        Ok(self.out.len)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let n = self.out.len;
        each(Param::write(
            "out",
            &self.out,
            DtypeRule::Working,
            LenRule::Len(n),
        ));
        let bytes = DtypeRule::Exactly(Dtype::U8);
        each(Param::read("codes", &self.codes, bytes, LenRule::Len(n)));
        let blocks = LenRule::Len(n.div_ceil(INT8_BLOCK));
        each(Param::read(
            "scales",
            &self.scales,
            DtypeRule::Exactly(Dtype::F32),
            blocks,
        ));
    }

    fn flops(&self) -> f64 {
        self.out.len as f64
    }
}

impl CpuKernel for Int8Dequantize {
    fn run_cpu(
        &self,
        _: &usize,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let (codes, scales) = (t.bytes(&self.codes), t.f32(&self.scales));
        dequantize_int8_as(cpu, t.f32_mut(&self.out), (codes, scales), self.round_bf16);
        Ok(())
    }
}

impl CudaKernel for Int8Dequantize {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[INT8_DEQUANTIZE];

    fn launch(&self, &n: &usize, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        // int8_dequantize_<T>(T* out, const signed char* codes, const float* scales, int
        // round_bf16, long long n): one thread per value.
        let args = [
            q.ptr(&self.out),
            q.ptr(&self.codes),
            q.ptr(&self.scales),
            Arg::Int(i32::from(self.round_bf16)),
            long(n),
        ];
        Ok(q.launch(INT8_DEQUANTIZE, per_element(n), &args)?)
    }
}
