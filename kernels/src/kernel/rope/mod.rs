//! Rotary position embeddings in Hugging Face's "rotate_half" form (Llama, Qwen,
//! Mistral), forward and backward, over a table of cosines and sines the caller builds
//! ([`rope_table`], from the inverse frequencies of [`rope_inv_freq`] or of a scaled
//! variant such as Llama 3's `rope_scaling`, which stays the caller's choice).
//!
//! Layout: x is (B, T, H, D) (q with H query heads, k with KV heads), each row of D
//! channels rotated by the angles of its position t; cos and sin are (at least T, D/2),
//! row t for position t (Hugging Face's `cat(freqs, freqs)` halves are equal, so one half
//! is kept). With packed documents (`doc_start`, (B, T) u32: the first position of each
//! token's document), positions restart at each document: the token at t is at position
//! t - doc_start, as Hugging Face's position ids of a packed batch say.
//!
//! Here: the kernels' signatures, CPU ops and CUDA launches; `rope.cu` holds the CUDA
//! kernels, [`reference`](mod@reference) the scalar reference.

use crate::cuda::launch::{Arg, CudaKernel, CudaSource, Entry, Launch, int, per_element};
use crate::ops::simd::on_isa;
use crate::ops::{Cpu, RowsMut, par_rows};
use crate::program::{
    CpuKernel, CpuTensors, Dtype, DtypeRule, KernelError, LenRule, Param, Scalars, Signature,
    TensorRef,
};

pub mod reference;

/// inv_freq: (D/2) = `theta^(-2i/D)`, Hugging Face's default (computed in f64, rounded
/// to f32 as its f32 tensor holds them).
pub fn rope_inv_freq(inv_freq: &mut [f32], theta: f64, d: usize) {
    assert_eq!(inv_freq.len(), d / 2);
    for (i, f) in inv_freq.iter_mut().enumerate() {
        *f = (1.0 / theta.powf((2 * i) as f64 / d as f64)) as f32;
    }
}

/// cos, sin: (positions.len(), D/2) with `cos[p, i] = cos(positions[p] * inv_freq[i])`,
/// likewise sin; inv_freq: (D/2). The angle is the f32 product, as Hugging Face forms it;
/// its cosine and sine are taken in f64 and rounded.
pub fn rope_table(cos: &mut [f32], sin: &mut [f32], inv_freq: &[f32], positions: &[u32]) {
    let half = inv_freq.len();
    let rows = positions.len();
    assert_eq!((cos.len(), sin.len()), (rows * half, rows * half));
    for (p, &pos) in positions.iter().enumerate() {
        for (i, &f) in inv_freq.iter().enumerate() {
            let angle = f64::from(pos as f32 * f);
            cos[p * half + i] = angle.cos() as f32;
            sin[p * half + i] = angle.sin() as f32;
        }
    }
}

/// How a model forms its rotary inverse frequencies: Hugging Face's default
/// `theta^(-2i/D)`, optionally rescaled as Llama 3.1's `rope_scaling` (`rope_type`
/// `llama3`) does. The numbers are f32: every published theta and scaling factor is an
/// integer below 2^24 or a small power of two, so f32 holds them exactly.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeFreqs {
    /// The base of the default frequencies (`rope_theta`).
    pub theta: f32,
    /// Llama 3.1's rescaling of the low frequencies, if the model uses it.
    pub llama3: Option<Llama3Scaling>,
}

/// Llama 3.1's `rope_scaling` (`rope_type: llama3`): wavelengths longer than
/// `original_context / low_freq_factor` are stretched by `factor`, shorter than
/// `original_context / high_freq_factor` kept, and those between interpolated smoothly.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    /// `factor` (8 for Llama 3.1, 32 for Llama 3.2).
    pub factor: f32,
    /// `low_freq_factor` (1).
    pub low_freq_factor: f32,
    /// `high_freq_factor` (4).
    pub high_freq_factor: f32,
    /// `original_max_position_embeddings` (8192).
    pub original_context: f32,
}

impl RopeFreqs {
    /// The inverse frequency of channel pair `i` of a head of `d` channels: the default
    /// [`rope_inv_freq`]'s value (f64, rounded to f32), then, with Llama 3 scaling, its
    /// rescaling computed in f64 from that f32 value and rounded again (Hugging Face
    /// computes both in f32 tensors; the two agree to an f32 rounding).
    pub fn inv_freq(&self, i: usize, d: usize) -> f32 {
        let base = (1.0 / f64::from(self.theta).powf((2 * i) as f64 / d as f64)) as f32;
        let Some(s) = self.llama3 else {
            return base;
        };
        let inv = f64::from(base);
        let (factor, low, high, old) = (
            f64::from(s.factor),
            f64::from(s.low_freq_factor),
            f64::from(s.high_freq_factor),
            f64::from(s.original_context),
        );
        let wavelen = 2.0 * std::f64::consts::PI / inv;
        let scaled = if wavelen < old / high {
            inv
        } else if wavelen > old / low {
            inv / factor
        } else {
            let smooth = (old / wavelen - low) / (high - low);
            (1.0 - smooth) * inv / factor + smooth * inv
        };
        scaled as f32
    }
}

/// cos, sin: (T, D/2): the table of positions 0..T for the inverse frequencies of
/// `freqs` (as [`rope_table`] forms it: the f32 angle `t * inv_freq[i]`, its cosine and
/// sine taken in f64 and rounded). Fills the pairs' columns one after another, so each
/// inverse frequency is computed once.
pub fn rope_table_of(cos: &mut [f32], sin: &mut [f32], freqs: &RopeFreqs, t: usize, d: usize) {
    let half = d / 2;
    assert!(d.is_multiple_of(2), "an odd head dimension {d}");
    assert_eq!((cos.len(), sin.len()), (t * half, t * half));
    for i in 0..half {
        let f = freqs.inv_freq(i, d);
        for pos in 0..t {
            let angle = f64::from(pos as f32 * f);
            cos[pos * half + i] = angle.cos() as f32;
            sin[pos * half + i] = angle.sin() as f32;
        }
    }
}

/// out: (B, T, H, D)  inp: (B, T, H, D)  cos, sin: (at least T, D/2), D even.
/// Each row x at position t becomes `(x1 cos - x2 sin, x2 cos + x1 sin)` with x1, x2 its
/// halves and row t of the table.
#[allow(clippy::too_many_arguments)]
pub fn rope_forward(
    cpu: &Cpu,
    out: &mut [f32],
    inp: &[f32],
    cos: &[f32],
    sin: &[f32],
    doc_start: Option<&[u32]>,
    b: usize,
    t: usize,
    h: usize,
    d: usize,
) {
    rotate(cpu, out, inp, (cos, sin, doc_start), b, t, h, d, 1.0);
}

/// dinp: (B, T, H, D) =  dout: (B, T, H, D)  cos, sin: as in [`rope_forward`].
/// The transpose of the forward's rotation: `(d1 cos + d2 sin, d2 cos - d1 sin)`.
#[allow(clippy::too_many_arguments)]
pub fn rope_backward(
    cpu: &Cpu,
    dinp: &mut [f32],
    dout: &[f32],
    cos: &[f32],
    sin: &[f32],
    doc_start: Option<&[u32]>,
    b: usize,
    t: usize,
    h: usize,
    d: usize,
) {
    rotate(cpu, dinp, dout, (cos, sin, doc_start), b, t, h, d, -1.0);
}

/// The tables, and the documents' starts when the batch is packed.
type Table<'a> = (&'a [f32], &'a [f32], Option<&'a [u32]>);

/// Rotates every row by its position's angles, the sines multiplied by `sign`.
#[allow(clippy::too_many_arguments)]
fn rotate(
    cpu: &Cpu,
    out: &mut [f32],
    inp: &[f32],
    (cos, sin, doc_start): Table<'_>,
    b: usize,
    t: usize,
    h: usize,
    d: usize,
    sign: f32,
) {
    assert!(d.is_multiple_of(2), "an odd head dimension {d}");
    let (half, rows) = (d / 2, b * t * h);
    assert_eq!((out.len(), inp.len()), (rows * d, rows * d));
    assert!(
        cos.len() >= t * half && sin.len() >= t * half,
        "a table of fewer than {t} rows"
    );
    if let Some(starts) = doc_start {
        assert_eq!(starts.len(), b * t, "document starts for {b} × {t} tokens");
        assert!(
            starts
                .iter()
                .enumerate()
                .all(|(i, &s)| s as usize <= i % t.max(1)),
            "a document starting after its token"
        );
    }
    if d == 0 {
        return;
    }
    par_rows(
        cpu.threads_for(rows * d),
        rows,
        1,
        RowsMut::new(out, d),
        |range, out| {
            on_isa!(cpu.isa, {
                for (i, row) in range.enumerate() {
                    let token = row / h;
                    let pos = token % t - doc_start.map_or(0, |s| s[token] as usize);
                    let (c, s) = (&cos[pos * half..][..half], &sin[pos * half..][..half]);
                    let (x1, x2) = inp[row * d..][..d].split_at(half);
                    let (o1, o2) = out.data[i * d..][..d].split_at_mut(half);
                    for j in 0..half {
                        let sj = sign * s[j];
                        o1[j] = x1[j] * c[j] - x2[j] * sj;
                        o2[j] = x2[j] * c[j] + x1[j] * sj;
                    }
                }
            },)
        },
    );
}

/// The family's CUDA kernels.
const SOURCE: CudaSource = ("rope.cu", include_str!("rope.cu"));

const ROPE_FORWARD: Entry = Entry::typed("rope_forward");
const ROPE_BACKWARD: Entry = Entry::typed("rope_backward");
const ROPE_TABLE: Entry = Entry::typed("rope_table");

/// `Ok` when a head's `d` channels are even (the rotation pairs its halves).
fn even_head(kernel: &'static str, d: usize) -> Result<(), KernelError> {
    if d.is_multiple_of(2) {
        Ok(())
    } else {
        Err(KernelError::Shape {
            kernel,
            what: "d (channels per head, even)",
            len: d,
            expected: d + 1,
        })
    }
}

/// The rotation's dimensions: batch, sequence, heads of the tensor, channels per head
/// (even).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeShape {
    /// Batch.
    pub b: usize,
    /// Sequence.
    pub t: usize,
    /// Heads of the tensor.
    pub h: usize,
    /// Channels per head.
    pub d: usize,
}

impl RopeShape {
    /// Rows of D channels: B × T × H.
    pub fn rows(&self) -> usize {
        self.b * self.t * self.h
    }

    /// Each rotation's tensors, `out` (written) and `inp` under the names given, and the
    /// tables.
    fn params<'a>(
        &self,
        [(out_name, out), (inp_name, inp)]: [(&'static str, &'a TensorRef); 2],
        [cos, sin]: [&'a TensorRef; 2],
        doc_start: Option<&'a TensorRef>,
        each: &mut dyn FnMut(Param<'a>),
    ) {
        let (w, rows) = (DtypeRule::Working, LenRule::Len(self.rows() * self.d));
        let table = LenRule::AtLeast(self.t * self.d / 2);
        each(Param::write(out_name, out, w, rows));
        each(Param::read(inp_name, inp, w, rows));
        each(Param::read("cos", cos, w, table));
        each(Param::read("sin", sin, w, table));
        if let Some(d) = doc_start {
            let u32_ = DtypeRule::Exactly(Dtype::U32);
            each(Param::read(
                "doc_start",
                d,
                u32_,
                LenRule::Len(self.b * self.t),
            ));
        }
    }

    /// Enqueues `entry`, the rotation or its transpose, from `inp` into `out`.
    fn launch(
        &self,
        entry: Entry,
        [out, inp, cos, sin]: [&TensorRef; 4],
        doc_start: Option<&TensorRef>,
        q: &mut Launch<'_>,
    ) -> Result<(), KernelError> {
        // rope_forward_<T> and rope_backward_<T>(T* out, const T* inp, const T* cos, const
        // T* sin, const unsigned* doc_start, int rows, int t, int h, int half): thread
        // i < rows·half touches pair i of row i / half of out and inp (rows·d elements
        // each), rows below t of the (at least t·half) tables, and (when not null) the
        // document start of the row's token (B·T of them).
        let args = [
            q.ptr(out),
            q.ptr(inp),
            q.ptr(cos),
            q.ptr(sin),
            doc_start.map_or(Arg::Ptr(0), |d| q.ptr(d)),
            int(self.rows()),
            int(self.t),
            int(self.h),
            int(self.d / 2),
        ];
        Ok(q.launch(entry, per_element(self.rows() * self.d / 2), &args)?)
    }
}

/// Rotary position embeddings, Hugging Face's `rotate_half` form: out: (B, T, H, D)
/// from inp: (B, T, H, D), each row of D channels at position t, halves x1 and x2,
/// becoming `(x1 cos - x2 sin, x2 cos + x1 sin)` with row t of the tables (built by
/// the caller, e.g. with [`rope_table`] or [`RopeTable`]; Llama 3's `rope_scaling` is in
/// its inverse frequencies). D even.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    /// (B, T, H, D).
    pub out: TensorRef,
    /// (B, T, H, D).
    pub inp: TensorRef,
    /// (at least T, D/2).
    pub cos: TensorRef,
    /// (at least T, D/2).
    pub sin: TensorRef,
    /// (B, T) u32, each token's document's first position, when the batch is packed.
    pub doc_start: Option<TensorRef>,
    /// Batch.
    pub b: usize,
    /// Sequence.
    pub t: usize,
    /// Heads of the tensor (query or key/value heads).
    pub h: usize,
    /// Channels per head.
    pub d: usize,
}

impl Signature for Rope {
    const NAME: &'static str = "rope";
    type Shape = RopeShape;

    fn shape(&self) -> Result<RopeShape, KernelError> {
        even_head(Self::NAME, self.d)?;
        Ok(RopeShape {
            b: self.b,
            t: self.t,
            h: self.h,
            d: self.d,
        })
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let shape = RopeShape {
            b: self.b,
            t: self.t,
            h: self.h,
            d: self.d,
        };
        let tensors = [("out", &self.out), ("inp", &self.inp)];
        shape.params(
            tensors,
            [&self.cos, &self.sin],
            self.doc_start.as_ref(),
            each,
        );
    }

    fn flops(&self) -> f64 {
        3.0 * self.out.len as f64
    }
}

impl CpuKernel for Rope {
    fn run_cpu(
        &self,
        s: &RopeShape,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let (out, inp) = (t.f32_mut(&self.out), t.f32(&self.inp));
        let (cos, sin) = (t.f32(&self.cos), t.f32(&self.sin));
        let doc_start = self.doc_start.as_ref().map(|d| t.u32(d));
        rope_forward(cpu, out, inp, cos, sin, doc_start, s.b, s.t, s.h, s.d);
        Ok(())
    }
}

impl CudaKernel for Rope {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[ROPE_FORWARD];

    fn launch(&self, s: &RopeShape, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        let tensors = [&self.out, &self.inp, &self.cos, &self.sin];
        s.launch(ROPE_FORWARD, tensors, self.doc_start.as_ref(), q)
    }
}

/// dinp: (B, T, H, D) = (overwritten) the gradient of [`Rope`] given dout (the inverse
/// rotation).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeBackward {
    /// (B, T, H, D), overwritten.
    pub dinp: TensorRef,
    /// (B, T, H, D).
    pub dout: TensorRef,
    /// (at least T, D/2).
    pub cos: TensorRef,
    /// (at least T, D/2).
    pub sin: TensorRef,
    /// (B, T) u32, each token's document's first position, when the batch is packed.
    pub doc_start: Option<TensorRef>,
    /// Batch.
    pub b: usize,
    /// Sequence.
    pub t: usize,
    /// Heads of the tensor.
    pub h: usize,
    /// Channels per head.
    pub d: usize,
}

impl Signature for RopeBackward {
    const NAME: &'static str = "rope-backward";
    type Shape = RopeShape;

    fn shape(&self) -> Result<RopeShape, KernelError> {
        even_head(Self::NAME, self.d)?;
        Ok(RopeShape {
            b: self.b,
            t: self.t,
            h: self.h,
            d: self.d,
        })
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let shape = RopeShape {
            b: self.b,
            t: self.t,
            h: self.h,
            d: self.d,
        };
        let tensors = [("dinp", &self.dinp), ("dout", &self.dout)];
        shape.params(
            tensors,
            [&self.cos, &self.sin],
            self.doc_start.as_ref(),
            each,
        );
    }

    fn flops(&self) -> f64 {
        3.0 * self.dinp.len as f64
    }
}

impl CpuKernel for RopeBackward {
    fn run_cpu(
        &self,
        s: &RopeShape,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let (dinp, dout) = (t.f32_mut(&self.dinp), t.f32(&self.dout));
        let (cos, sin) = (t.f32(&self.cos), t.f32(&self.sin));
        let doc_start = self.doc_start.as_ref().map(|d| t.u32(d));
        rope_backward(cpu, dinp, dout, cos, sin, doc_start, s.b, s.t, s.h, s.d);
        Ok(())
    }
}

impl CudaKernel for RopeBackward {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[ROPE_BACKWARD];

    fn launch(&self, s: &RopeShape, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        let tensors = [&self.dinp, &self.dout, &self.cos, &self.sin];
        s.launch(ROPE_BACKWARD, tensors, self.doc_start.as_ref(), q)
    }
}

/// cos, sin: (T, D/2) = the rotary table of positions 0..T for the inverse frequencies
/// of `freqs` ([`rope_table_of`]), in the working dtype: the tables [`Rope`] reads. A
/// family's programs build it in their scratch, so no table is uploaded or kept between
/// programs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeTable {
    /// (T, D/2), written.
    pub cos: TensorRef,
    /// (T, D/2), written.
    pub sin: TensorRef,
    /// Positions.
    pub t: usize,
    /// Channels per head.
    pub d: usize,
    /// How the inverse frequencies are formed.
    pub freqs: RopeFreqs,
}

impl Signature for RopeTable {
    const NAME: &'static str = "rope-table";
    /// Positions and channel pairs (D/2).
    type Shape = (usize, usize);

    fn shape(&self) -> Result<(usize, usize), KernelError> {
        even_head(Self::NAME, self.d)?;
        Ok((self.t, self.d / 2))
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, table) = (DtypeRule::Working, LenRule::Len(self.t * self.d / 2));
        each(Param::write("cos", &self.cos, w, table));
        each(Param::write("sin", &self.sin, w, table));
    }

    fn flops(&self) -> f64 {
        // A cosine and a sine per entry, counted as one operation each.
        2.0 * self.cos.len as f64
    }
}

impl CpuKernel for RopeTable {
    fn run_cpu(
        &self,
        _: &(usize, usize),
        _: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let (cos, sin) = (t.f32_mut(&self.cos), t.f32_mut(&self.sin));
        rope_table_of(cos, sin, &self.freqs, self.t, self.d);
        Ok(())
    }
}

impl CudaKernel for RopeTable {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[ROPE_TABLE];

    fn launch(
        &self,
        &(t, half): &(usize, usize),
        _: &Scalars,
        q: &mut Launch<'_>,
    ) -> Result<(), KernelError> {
        // Without Llama 3 scaling the factor is 0 (rope.cu's rope_table reads a factor
        // above 0 as scaling on).
        let s = self.freqs.llama3.unwrap_or(Llama3Scaling {
            factor: 0.0,
            low_freq_factor: 0.0,
            high_freq_factor: 0.0,
            original_context: 0.0,
        });
        // rope_table_<T>(T* cos, T* sin, int t, int half, float theta, float factor,
        // float low_freq_factor, float high_freq_factor, float original_context): thread
        // i < t·half writes element i of cos and sin (t·half elements each).
        let args = [
            q.ptr(&self.cos),
            q.ptr(&self.sin),
            int(t),
            int(half),
            Arg::Float(self.freqs.theta),
            Arg::Float(s.factor),
            Arg::Float(s.low_freq_factor),
            Arg::Float(s.high_freq_factor),
            Arg::Float(s.original_context),
        ];
        Ok(q.launch(ROPE_TABLE, per_element(t * half), &args)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::launch::tests::{Emulated, Layout};

    /// (B, T, H, D) of the samples.
    const SIZES: [(usize, usize, usize, usize); 3] = [(2, 7, 3, 12), (1, 1, 1, 2), (0, 3, 2, 4)];

    impl Emulated for Rope {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            let mut out = Vec::new();
            for ((b, t, h, d), packed) in SIZES.into_iter().flat_map(|s| [(s, false), (s, true)]) {
                out.push(Rope {
                    out: l.tensor(b * t * h * d, w),
                    inp: l.tensor(b * t * h * d, w),
                    cos: l.tensor((t + 2) * d / 2, w),
                    sin: l.tensor((t + 2) * d / 2, w),
                    doc_start: packed.then(|| l.tensor(b * t, Dtype::U32)),
                    b,
                    t,
                    h,
                    d,
                });
            }
            out
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            let (b, t, h, d) = (self.b, self.t, self.h, self.d);
            vec![("rows", b * t * h), ("t", t), ("h", h), ("half", d / 2)]
        }
    }

    impl Emulated for RopeBackward {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            let mut out = Vec::new();
            for ((b, t, h, d), packed) in SIZES.into_iter().flat_map(|s| [(s, false), (s, true)]) {
                out.push(RopeBackward {
                    dinp: l.tensor(b * t * h * d, w),
                    dout: l.tensor(b * t * h * d, w),
                    cos: l.tensor(t * d / 2, w),
                    sin: l.tensor(t * d / 2, w),
                    doc_start: packed.then(|| l.tensor(b * t, Dtype::U32)),
                    b,
                    t,
                    h,
                    d,
                });
            }
            out
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            let (b, t, h, d) = (self.b, self.t, self.h, self.d);
            vec![("rows", b * t * h), ("t", t), ("h", h), ("half", d / 2)]
        }
    }

    impl Emulated for RopeTable {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            [(7, 12, false), (9, 16, true), (0, 4, false)]
                .map(|(t, d, llama3)| RopeTable {
                    cos: l.tensor(t * d / 2, w),
                    sin: l.tensor(t * d / 2, w),
                    t,
                    d,
                    freqs: RopeFreqs {
                        theta: 500_000.0,
                        llama3: llama3.then_some(Llama3Scaling {
                            factor: 8.0,
                            low_freq_factor: 1.0,
                            high_freq_factor: 4.0,
                            original_context: 8192.0,
                        }),
                    },
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            vec![("t", self.t), ("half", self.d / 2)]
        }

        fn floats(&self, _: &Scalars) -> Vec<(&'static str, f32)> {
            let s = self.freqs.llama3;
            vec![
                ("theta", self.freqs.theta),
                ("factor", s.map_or(0.0, |s| s.factor)),
                ("low_freq_factor", s.map_or(0.0, |s| s.low_freq_factor)),
                ("high_freq_factor", s.map_or(0.0, |s| s.high_freq_factor)),
                ("original_context", s.map_or(0.0, |s| s.original_context)),
            ]
        }
    }
}
