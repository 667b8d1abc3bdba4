//! Few-bit backward of activations (Novikov et al., "Few-Bit Backward: Quantized Gradients
//! of Activation Functions"): the forward saves, instead of an activation's input `x`, a
//! `b`-bit code (b = 1..4) of the interval of a piecewise-constant approximation of
//! `f'` that `x` falls in, and the backward multiplies the incoming gradient by that
//! interval's level. Here for GPT-2's tanh GELU and for the gate of SwiGLU (SiLU): the
//! tables ([`GELU_TABLES`], [`SILU_TABLES`], fitted by [`fit`]), the four kernels'
//! signatures, CPU ops and CUDA launches; `fewbit.cu` holds the CUDA kernels,
//! [`reference`](mod@reference) the scalar references. `docs/few-bit-backward.md` has the
//! tables' errors and what memory this saves (and, in strata's kept blocks, does not).
//!
//! **The code.** `code(x)` is the number of breakpoints `t` with `x >= t`: the index of
//! the interval `[t[k-1], t[k])` holding `x`, a value on a breakpoint belonging to the
//! interval above it; NaN compares false and gets code 0. Every target counts the same
//! f32 comparisons, so codes agree bit for bit.
//!
//! **The packing**, dense at every width, 3 bits included: elements are taken in groups
//! of 32 ([`GROUP`]); group `g` owns the `b` u32 words `codes[b g .. b g + b]`, and word
//! `j` holds bit `j` of the codes of the group's 32 elements, element `32 g + l` in bit
//! `l` (bit planes: one warp ballot per word on CUDA). A tensor of `n` elements has
//! [`codes_len`]`(n, b) = b ceil(n / 32)` words; the last group's missing elements have
//! code 0.
//!
//! **SwiGLU.** `out = silu(g) up` needs, backward, `silu'(g)` (for `dg = silu'(g) up dy`)
//! and `silu(g)` itself (for `du = silu(g) dy`). The paper approximates only
//! derivatives; a fixed table cannot stand for `silu(g)`, which is unbounded and also
//! the down projection's input. So [`FewBitSwiGlu`] approximates only `silu'(g)`: its
//! forward writes `out`, `act = silu(g)` (exact, working type) and the codes of `g`; its
//! backward reads `act`, `up` and the codes, never `g`. `dup` is exact, `dgate`
//! approximate.
//!
//! **Where the engine uses them.** The approximate backward (`--approx-backward gelu:B`
//! for GPT-2, `silu:B` for the Llama family; `strata_engine::model::approx`). strata's
//! kept blocks save an activation's input and recompute its output; the few-bit form
//! keeps the output instead (the next product's weight gradient reads it) plus the
//! codes, `b` bits per element more, so it saves memory only together with a sketched
//! next product, which keeps a projection of that output (GPT-2's MLP); in the Llama
//! family, whose SwiGLU backward reads `silu(gate)` itself, it only adds the codes
//! (`docs/few-bit-backward.md`, "Memory").

use std::ops::Range;

use crate::cuda::launch::{CudaKernel, CudaSource, Entry, Launch, int, long, per_element};
use crate::kernel::gelu::GELU_SCALE;
use crate::ops::simd::{self, on_isa};
use crate::ops::{Cpu, RowsMut, par_rows};
use crate::program::{
    CpuKernel, CpuTensors, Dtype, DtypeRule, KernelError, LenRule, Param, Scalars, Signature,
    TensorRef,
};

pub mod fit;
pub mod reference;
mod tables;
#[cfg(test)]
mod tests;

pub use tables::{GELU_TABLES, RMS_ERRORS, SILU_TABLES};

/// Elements per packing group: one warp, one bit per element in each u32 word.
pub const GROUP: usize = 32;

/// The width of a code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bits {
    /// 2 intervals.
    One = 1,
    /// 4 intervals.
    Two = 2,
    /// 8 intervals.
    Three = 3,
    /// 16 intervals.
    Four = 4,
}

impl Bits {
    /// Every width, narrowest first.
    pub const ALL: [Bits; 4] = [Bits::One, Bits::Two, Bits::Three, Bits::Four];

    /// The width for `bits`, 1 to 4.
    pub fn new(bits: usize) -> Option<Bits> {
        Bits::ALL.get(bits.wrapping_sub(1)).copied()
    }

    /// Bits per code.
    pub const fn count(self) -> usize {
        self as usize
    }
}

/// A piecewise-constant approximation of an activation's derivative: `levels[k]` on
/// `[breakpoints[k-1], breakpoints[k])`, the outer intervals open-ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Table {
    /// The code's width.
    pub bits: Bits,
    /// `2^bits - 1` breakpoints, increasing.
    pub breakpoints: &'static [f32],
    /// `2^bits` levels.
    pub levels: &'static [f32],
}

impl Table {
    /// The interval holding `x`: how many breakpoints are `<= x` (0 for NaN).
    #[inline(always)]
    pub fn code(&self, x: f32) -> u32 {
        self.breakpoints.iter().map(|&t| u32::from(x >= t)).sum()
    }
}

/// u32 words of the codes of `n` elements at width `bits`.
pub const fn codes_len(n: usize, bits: Bits) -> usize {
    bits.count() * n.div_ceil(GROUP)
}

/// The bit planes of a group's codes (fewer than 32 elements: the rest have code 0).
#[inline(always)]
fn pack_group(codes: &[u32; GROUP], planes: &mut [u32]) {
    for (j, plane) in planes.iter_mut().enumerate() {
        *plane = (0..GROUP).fold(0, |w, l| w | ((codes[l] >> j) & 1) << l);
    }
}

/// The codes of a group from its bit planes.
#[inline(always)]
fn unpack_group(planes: &[u32]) -> [u32; GROUP] {
    let mut codes = [0u32; GROUP];
    for (j, &plane) in planes.iter().enumerate() {
        for (l, c) in codes.iter_mut().enumerate() {
            *c |= ((plane >> l) & 1) << j;
        }
    }
    codes
}

/// The codes of a group of up to 32 inputs, by breakpoint then element (so that the
/// comparisons vectorise).
#[inline(always)]
fn code_group(table: &Table, x: &[f32]) -> [u32; GROUP] {
    let mut codes = [0u32; GROUP];
    for &t in table.breakpoints {
        for (c, &x) in codes.iter_mut().zip(x) {
            *c += u32::from(x >= t);
        }
    }
    codes
}

/// The elements of the groups `g` of `n` elements.
fn elements(g: &Range<usize>, n: usize) -> Range<usize> {
    g.start * GROUP..(g.end * GROUP).min(n)
}

/// Asserts that `n` elements have `codes` words at `bits`.
fn assert_codes(n: usize, codes: usize, bits: Bits) {
    let want = codes_len(n, bits);
    assert_eq!(
        codes, want,
        "{n} elements have {want} words of {bits:?}-bit codes"
    );
}

const S: f32 = GELU_SCALE as f32;
const A: f32 = 0.044715;

/// out: (N) = gelu(inp), tanh form, with the bits of [`crate::kernel::gelu::gelu_forward`];
/// codes: ([`codes_len`]) = inp's codes under `table`, packed.
pub fn fewbit_gelu_forward(
    cpu: &Cpu,
    out: &mut [f32],
    codes: &mut [u32],
    inp: &[f32],
    table: &Table,
) {
    let (n, b) = (inp.len(), table.bits.count());
    assert_eq!(out.len(), n);
    assert_codes(n, codes.len(), table.bits);
    let parts = (RowsMut::new(out, GROUP), RowsMut::new(codes, b));
    par_rows(
        cpu.threads_for(n),
        n.div_ceil(GROUP),
        1,
        parts,
        |g, (out, codes)| {
            let inp = &inp[elements(&g, n)];
            let groups = inp.chunks(GROUP).zip(out.data.chunks_mut(GROUP));
            on_isa!(cpu.isa, {
                for ((x, out), planes) in groups.zip(codes.data.chunks_mut(b)) {
                    pack_group(&code_group(table, x), planes);
                    for (o, &x) in out.iter_mut().zip(x) {
                        *o = x * simd::sigmoid(2.0 * S * (x + A * x * x * x));
                    }
                }
            })
        },
    );
}

/// dinp: (N) = `levels[code] * dout`  codes: ([`codes_len`]) the forward's  dout: (N).
/// The backward of [`fewbit_gelu_forward`] (of any activation whose codes `table` made).
pub fn fewbit_backward(cpu: &Cpu, dinp: &mut [f32], codes: &[u32], dout: &[f32], table: &Table) {
    let (n, b) = (dout.len(), table.bits.count());
    assert_eq!(dinp.len(), n);
    assert_codes(n, codes.len(), table.bits);
    let parts = RowsMut::new(dinp, GROUP);
    par_rows(
        cpu.threads_for(n),
        n.div_ceil(GROUP),
        1,
        parts,
        |g, dinp| {
            let (dout, codes) = (&dout[elements(&g, n)], &codes[g.start * b..g.end * b]);
            let groups = dinp.data.chunks_mut(GROUP).zip(dout.chunks(GROUP));
            on_isa!(cpu.isa, {
                for ((dinp, dout), planes) in groups.zip(codes.chunks(b)) {
                    let codes = unpack_group(planes);
                    for ((d, &dy), &c) in dinp.iter_mut().zip(dout).zip(&codes) {
                        *d = table.levels[c as usize] * dy;
                    }
                }
            })
        },
    );
}

/// out: (N) = `act * up`, act: (N) = `silu(gate)` (the bits of
/// [`crate::kernel::swiglu::swiglu_forward`]), codes: ([`codes_len`]) = gate's codes
/// under `table` (SiLU's); gate, up: (N).
pub fn fewbit_swiglu_forward(
    cpu: &Cpu,
    [out, act]: [&mut [f32]; 2],
    codes: &mut [u32],
    [gate, up]: [&[f32]; 2],
    table: &Table,
) {
    let (n, b) = (gate.len(), table.bits.count());
    assert_eq!((out.len(), act.len(), up.len()), (n, n, n));
    assert_codes(n, codes.len(), table.bits);
    let parts = (RowsMut::new(out, GROUP), RowsMut::new(act, GROUP));
    let parts = (parts.0, parts.1, RowsMut::new(codes, b));
    par_rows(
        cpu.threads_for(n),
        n.div_ceil(GROUP),
        1,
        parts,
        |g, (out, act, codes)| {
            let (gate, up) = (&gate[elements(&g, n)], &up[elements(&g, n)]);
            let outs = out.data.chunks_mut(GROUP).zip(act.data.chunks_mut(GROUP));
            let ins = gate.chunks(GROUP).zip(up.chunks(GROUP));
            on_isa!(cpu.isa, {
                for (((out, act), (gate, up)), planes) in
                    outs.zip(ins).zip(codes.data.chunks_mut(b))
                {
                    pack_group(&code_group(table, gate), planes);
                    for l in 0..gate.len() {
                        let g = gate[l];
                        act[l] = g * simd::sigmoid(g);
                        out[l] = act[l] * up[l];
                    }
                }
            })
        },
    );
}

/// dgate: (N) = `(levels[code] * up) * dout`, dup: (N) = `act * dout`; codes, act: the
/// forward's ([`fewbit_swiglu_forward`]); dout, up: (N).
pub fn fewbit_swiglu_backward(
    cpu: &Cpu,
    [dgate, dup]: [&mut [f32]; 2],
    codes: &[u32],
    [dout, act, up]: [&[f32]; 3],
    table: &Table,
) {
    let (n, b) = (dout.len(), table.bits.count());
    assert_eq!((dgate.len(), dup.len(), act.len(), up.len()), (n, n, n, n));
    assert_codes(n, codes.len(), table.bits);
    let parts = (RowsMut::new(dgate, GROUP), RowsMut::new(dup, GROUP));
    par_rows(
        cpu.threads_for(n),
        n.div_ceil(GROUP),
        1,
        parts,
        |g, (dgate, dup)| {
            let r = elements(&g, n);
            let (dout, act, up) = (&dout[r.clone()], &act[r.clone()], &up[r]);
            let codes = &codes[g.start * b..g.end * b];
            on_isa!(cpu.isa, {
                for (k, planes) in codes.chunks(b).enumerate() {
                    let codes = unpack_group(planes);
                    let at = k * GROUP..((k + 1) * GROUP).min(dout.len());
                    let (dgate, dup) = (&mut dgate.data[at.clone()], &mut dup.data[at.clone()]);
                    let (dout, act, up) = (&dout[at.clone()], &act[at.clone()], &up[at]);
                    for l in 0..dout.len() {
                        dup[l] = act[l] * dout[l];
                        dgate[l] = table.levels[codes[l] as usize] * up[l] * dout[l];
                    }
                }
            })
        },
    );
}

/// The family's CUDA kernels.
const SOURCE: CudaSource = ("fewbit.cu", include_str!("fewbit.cu"));

const GELU_FORWARD: Entry = Entry::typed("fewbit_gelu_forward");
const GELU_BACKWARD: Entry = Entry::typed("fewbit_gelu_backward");
const SWIGLU_FORWARD: Entry = Entry::typed("fewbit_swiglu_forward");
const SWIGLU_BACKWARD: Entry = Entry::typed("fewbit_swiglu_backward");

/// The codes' parameter: u32 words, [`codes_len`] of them.
fn codes_param<'a>(
    access: fn(&'static str, &'a TensorRef, DtypeRule, LenRule) -> Param<'a>,
    codes: &'a TensorRef,
    n: usize,
    bits: Bits,
) -> Param<'a> {
    access(
        "codes",
        codes,
        DtypeRule::Exactly(Dtype::U32),
        LenRule::Len(codes_len(n, bits)),
    )
}

/// One thread per element, in whole warps (each warp one group).
fn per_group(n: usize) -> cudarc::driver::LaunchConfig {
    per_element(n.div_ceil(GROUP) * GROUP)
}

/// out = gelu(inp) (tanh form) and codes = inp's `bits`-bit codes under
/// [`GELU_TABLES`], elementwise: [`fewbit_gelu_forward`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FewBitGelu {
    /// Output.
    pub out: TensorRef,
    /// Output: u32, [`codes_len`]`(n, bits)` words.
    pub codes: TensorRef,
    /// Input.
    pub inp: TensorRef,
    /// The codes' width.
    pub bits: Bits,
}

impl Signature for FewBitGelu {
    const NAME: &'static str = "fewbit-gelu";
    /// Elements.
    type Shape = usize;

    fn shape(&self) -> Result<usize, KernelError> {
        Ok(self.out.len)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, n) = (DtypeRule::Working, self.out.len);
        each(Param::write("out", &self.out, w, LenRule::Len(n)));
        each(codes_param(Param::write, &self.codes, n, self.bits));
        each(Param::read("inp", &self.inp, w, LenRule::Len(n)));
    }

    fn flops(&self) -> f64 {
        (10 + (1 << self.bits.count())) as f64 * self.out.len as f64
    }
}

impl CpuKernel for FewBitGelu {
    fn run_cpu(
        &self,
        _: &usize,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let table = &GELU_TABLES[self.bits.count() - 1];
        fewbit_gelu_forward(
            cpu,
            t.f32_mut(&self.out),
            t.u32_mut(&self.codes),
            t.f32(&self.inp),
            table,
        );
        Ok(())
    }
}

impl CudaKernel for FewBitGelu {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[GELU_FORWARD];

    fn launch(&self, &n: &usize, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        // fewbit_gelu_forward_<T>(T* out, unsigned int* codes, const T* inp, int bits,
        // long long n).
        let (out, codes, inp) = (q.ptr(&self.out), q.ptr(&self.codes), q.ptr(&self.inp));
        let args = [out, codes, inp, int(self.bits.count()), long(n)];
        Ok(q.launch(GELU_FORWARD, per_group(n), &args)?)
    }
}

/// dinp = `GELU_TABLES[bits - 1].levels[code] * dout`, elementwise: [`fewbit_backward`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FewBitGeluBackward {
    /// Output (overwritten).
    pub dinp: TensorRef,
    /// The forward's codes ([`FewBitGelu`]).
    pub codes: TensorRef,
    /// The gradient of the forward's output.
    pub dout: TensorRef,
    /// The codes' width.
    pub bits: Bits,
}

impl Signature for FewBitGeluBackward {
    const NAME: &'static str = "fewbit-gelu-backward";
    /// Elements.
    type Shape = usize;

    fn shape(&self) -> Result<usize, KernelError> {
        Ok(self.dinp.len)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, n) = (DtypeRule::Working, self.dinp.len);
        each(Param::write("dinp", &self.dinp, w, LenRule::Len(n)));
        each(codes_param(Param::read, &self.codes, n, self.bits));
        each(Param::read("dout", &self.dout, w, LenRule::Len(n)));
    }

    fn flops(&self) -> f64 {
        self.dinp.len as f64
    }
}

impl CpuKernel for FewBitGeluBackward {
    fn run_cpu(
        &self,
        _: &usize,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let table = &GELU_TABLES[self.bits.count() - 1];
        fewbit_backward(
            cpu,
            t.f32_mut(&self.dinp),
            t.u32(&self.codes),
            t.f32(&self.dout),
            table,
        );
        Ok(())
    }
}

impl CudaKernel for FewBitGeluBackward {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[GELU_BACKWARD];

    fn launch(&self, &n: &usize, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        // fewbit_gelu_backward_<T>(T* dinp, const unsigned int* codes, const T* dout,
        // int bits, long long n).
        let (dinp, codes, dout) = (q.ptr(&self.dinp), q.ptr(&self.codes), q.ptr(&self.dout));
        let args = [dinp, codes, dout, int(self.bits.count()), long(n)];
        Ok(q.launch(GELU_BACKWARD, per_element(n), &args)?)
    }
}

/// out = silu(gate) up, act = silu(gate) and codes = gate's `bits`-bit codes under
/// [`SILU_TABLES`], elementwise: [`fewbit_swiglu_forward`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FewBitSwiGlu {
    /// Output.
    pub out: TensorRef,
    /// Output: silu(gate), what the backward reads for `dup`.
    pub act: TensorRef,
    /// Output: u32, [`codes_len`]`(n, bits)` words.
    pub codes: TensorRef,
    /// The gate projection.
    pub gate: TensorRef,
    /// The up projection.
    pub up: TensorRef,
    /// The codes' width.
    pub bits: Bits,
}

impl Signature for FewBitSwiGlu {
    const NAME: &'static str = "fewbit-swiglu";
    /// Elements.
    type Shape = usize;

    fn shape(&self) -> Result<usize, KernelError> {
        Ok(self.out.len)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, n) = (DtypeRule::Working, self.out.len);
        each(Param::write("out", &self.out, w, LenRule::Len(n)));
        each(Param::write("act", &self.act, w, LenRule::Len(n)));
        each(codes_param(Param::write, &self.codes, n, self.bits));
        each(Param::read("gate", &self.gate, w, LenRule::Len(n)));
        each(Param::read("up", &self.up, w, LenRule::Len(n)));
    }

    fn flops(&self) -> f64 {
        (8 + (1 << self.bits.count())) as f64 * self.out.len as f64
    }
}

impl CpuKernel for FewBitSwiGlu {
    fn run_cpu(
        &self,
        _: &usize,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let table = &SILU_TABLES[self.bits.count() - 1];
        let outs = [t.f32_mut(&self.out), t.f32_mut(&self.act)];
        let ins = [t.f32(&self.gate), t.f32(&self.up)];
        fewbit_swiglu_forward(cpu, outs, t.u32_mut(&self.codes), ins, table);
        Ok(())
    }
}

impl CudaKernel for FewBitSwiGlu {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[SWIGLU_FORWARD];

    fn launch(&self, &n: &usize, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        // fewbit_swiglu_forward_<T>(T* out, T* act, unsigned int* codes, const T* gate,
        // const T* up, int bits, long long n).
        let (out, act, codes) = (q.ptr(&self.out), q.ptr(&self.act), q.ptr(&self.codes));
        let (gate, up) = (q.ptr(&self.gate), q.ptr(&self.up));
        let args = [out, act, codes, gate, up, int(self.bits.count()), long(n)];
        Ok(q.launch(SWIGLU_FORWARD, per_group(n), &args)?)
    }
}

/// dgate = `(SILU_TABLES[bits - 1].levels[code] * up) * dout` and dup = `act * dout`,
/// elementwise (overwritten): [`fewbit_swiglu_backward`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FewBitSwiGluBackward {
    /// Output (overwritten).
    pub dgate: TensorRef,
    /// Output (overwritten).
    pub dup: TensorRef,
    /// The forward's codes ([`FewBitSwiGlu`]).
    pub codes: TensorRef,
    /// The gradient of the forward's output.
    pub dout: TensorRef,
    /// The forward's `act`, silu(gate).
    pub act: TensorRef,
    /// The forward's up input.
    pub up: TensorRef,
    /// The codes' width.
    pub bits: Bits,
}

impl Signature for FewBitSwiGluBackward {
    const NAME: &'static str = "fewbit-swiglu-backward";
    /// Elements.
    type Shape = usize;

    fn shape(&self) -> Result<usize, KernelError> {
        Ok(self.dout.len)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, n) = (DtypeRule::Working, self.dout.len);
        each(Param::write("dgate", &self.dgate, w, LenRule::Len(n)));
        each(Param::write("dup", &self.dup, w, LenRule::Len(n)));
        each(codes_param(Param::read, &self.codes, n, self.bits));
        each(Param::read("dout", &self.dout, w, LenRule::Len(n)));
        each(Param::read("act", &self.act, w, LenRule::Len(n)));
        each(Param::read("up", &self.up, w, LenRule::Len(n)));
    }

    fn flops(&self) -> f64 {
        3.0 * self.dout.len as f64
    }
}

impl CpuKernel for FewBitSwiGluBackward {
    fn run_cpu(
        &self,
        _: &usize,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let table = &SILU_TABLES[self.bits.count() - 1];
        let outs = [t.f32_mut(&self.dgate), t.f32_mut(&self.dup)];
        let ins = [t.f32(&self.dout), t.f32(&self.act), t.f32(&self.up)];
        fewbit_swiglu_backward(cpu, outs, t.u32(&self.codes), ins, table);
        Ok(())
    }
}

impl CudaKernel for FewBitSwiGluBackward {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[SWIGLU_BACKWARD];

    fn launch(&self, &n: &usize, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        // fewbit_swiglu_backward_<T>(T* dgate, T* dup, const unsigned int* codes,
        // const T* dout, const T* act, const T* up, int bits, long long n).
        let (dgate, dup, codes) = (q.ptr(&self.dgate), q.ptr(&self.dup), q.ptr(&self.codes));
        let (dout, act, up) = (q.ptr(&self.dout), q.ptr(&self.act), q.ptr(&self.up));
        let args = [
            dgate,
            dup,
            codes,
            dout,
            act,
            up,
            int(self.bits.count()),
            long(n),
        ];
        Ok(q.launch(SWIGLU_BACKWARD, per_element(n), &args)?)
    }
}
