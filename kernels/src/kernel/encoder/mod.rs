//! Token and position embedding, forward and backward: the kernels' signatures, CPU ops
//! and CUDA launches; `encoder.cu` holds the CUDA kernels, [`reference`](mod@reference) the scalar
//! reference.

use crate::cuda::launch::{CudaKernel, CudaSource, Entry, Launch, int, per_element};
use crate::ops::simd::on_isa;
use crate::ops::{Cpu, RowsMut, par_rows, simd};
use crate::program::{
    CpuKernel, CpuTensors, Dtype, DtypeRule, KernelError, LenRule, Param, Scalars, Signature,
    TensorRef,
};

pub mod reference;

/// out: (B, T, C)  tokens: (B, T)  wte: (V, C)  wpe: (maxT, C), maxT >= T.
/// `out[b, t] = wte[tokens[b, t]] + wpe[t]`. Panics on a token outside `0..V`.
#[allow(clippy::too_many_arguments)]
pub fn encoder_forward(
    cpu: &Cpu,
    out: &mut [f32],
    tokens: &[u32],
    wte: &[f32],
    wpe: &[f32],
    b: usize,
    t: usize,
    c: usize,
) {
    let n = b * t;
    assert_eq!(out.len(), n * c);
    assert_eq!(tokens.len(), n);
    assert!(
        wpe.len() >= t * c,
        "position embedding shorter than the sequence"
    );
    let vocab = wte.len() / c;
    par_rows(
        cpu.threads_for(n * c),
        n,
        1,
        RowsMut::new(out, c),
        |rows, out| {
            on_isa!(cpu.isa, {
                for (row, o) in rows.zip(out.data.chunks_exact_mut(c)) {
                    let token = tokens[row] as usize;
                    assert!(
                        token < vocab,
                        "token {token} at {row} outside vocabulary {vocab}"
                    );
                    let (e, p) = (&wte[token * c..][..c], &wpe[(row % t) * c..][..c]);
                    for i in 0..c {
                        o[i] = e[i] + p[i];
                    }
                }
            },)
        },
    );
}

/// dwte: (V, C) +=  dwpe: (maxT, C) +=  dout: (B, T, C)  tokens: (B, T).
/// Threads own disjoint rows of `dwte` (token ids) and of `dwpe` (positions), and add
/// positions in order, so the result does not depend on the thread count.
#[allow(clippy::too_many_arguments)]
pub fn encoder_backward(
    cpu: &Cpu,
    dwte: &mut [f32],
    dwpe: &mut [f32],
    dout: &[f32],
    tokens: &[u32],
    b: usize,
    t: usize,
    c: usize,
) {
    let n = b * t;
    assert_eq!(dout.len(), n * c);
    assert_eq!(tokens.len(), n);
    assert!(dwpe.len() >= t * c);
    let vocab = dwte.len() / c;
    assert_eq!(dwte.len(), vocab * c);
    let threads = cpu.threads_for(n * c);
    par_rows(threads, vocab, 1, RowsMut::new(dwte, c), |ids, dwte| {
        on_isa!(cpu.isa, {
            for (row, &token) in tokens.iter().enumerate() {
                let token = token as usize;
                if ids.contains(&token) {
                    let d = &mut dwte.data[(token - ids.start) * c..][..c];
                    simd::add_assign(d, &dout[row * c..][..c]);
                }
            }
        },)
    });
    par_rows(
        threads,
        t,
        1,
        RowsMut::new(&mut dwpe[..t * c], c),
        |positions, dwpe| {
            on_isa!(cpu.isa, {
                for (pos, d) in positions.zip(dwpe.data.chunks_exact_mut(c)) {
                    for bi in 0..b {
                        simd::add_assign(d, &dout[(bi * t + pos) * c..][..c]);
                    }
                }
            },)
        },
    );
}

/// The family's CUDA kernels.
const SOURCE: CudaSource = ("encoder.cu", include_str!("encoder.cu"));

const ENCODER_FORWARD: Entry = Entry::typed("encoder_forward");
const ENCODER_BACKWARD_WTE: Entry = Entry::typed("encoder_backward_wte");
const ENCODER_BACKWARD_WPE: Entry = Entry::typed("encoder_backward_wpe");

/// The embedding's dimensions: batch, sequence, channels and the vocabulary (rows of
/// the token table; 0 without channels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncoderShape {
    /// Batch.
    pub b: usize,
    /// Sequence.
    pub t: usize,
    /// Channels.
    pub c: usize,
    /// Vocabulary.
    pub v: usize,
}

impl EncoderShape {
    fn of(b: usize, t: usize, c: usize, table: &TensorRef) -> Self {
        let v = table.len.checked_div(c).unwrap_or(0);
        EncoderShape { b, t, c, v }
    }
}

/// What the tables must be: (V, C) rows and at least T rows of positions; anything
/// without channels, when the kernel has nothing to do.
fn table_rules(t: usize, c: usize) -> (LenRule, LenRule) {
    if c == 0 {
        (LenRule::AnyLen, LenRule::AnyLen)
    } else {
        (LenRule::Rows(c), LenRule::AtLeast(t * c))
    }
}

/// out: (B, T, C) = `wte[tokens]` + `wpe[position]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Encoder {
    /// (B, T, C).
    pub out: TensorRef,
    /// (B, T) u32.
    pub tokens: TensorRef,
    /// (V, C).
    pub wte: TensorRef,
    /// (at least T, C).
    pub wpe: TensorRef,
    /// Batch.
    pub b: usize,
    /// Sequence.
    pub t: usize,
    /// Channels.
    pub c: usize,
}

impl Signature for Encoder {
    const NAME: &'static str = "encoder";
    type Shape = EncoderShape;

    fn shape(&self) -> Result<EncoderShape, KernelError> {
        Ok(EncoderShape::of(self.b, self.t, self.c, &self.wte))
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, n) = (DtypeRule::Working, self.b * self.t);
        let (wte, wpe) = table_rules(self.t, self.c);
        each(Param::write("out", &self.out, w, LenRule::Len(n * self.c)));
        let u32_ = DtypeRule::Exactly(Dtype::U32);
        each(Param::read("tokens", &self.tokens, u32_, LenRule::Len(n)));
        each(Param::read("wte", &self.wte, w, wte));
        each(Param::read("wpe", &self.wpe, w, wpe));
    }

    fn flops(&self) -> f64 {
        (self.b * self.t * self.c) as f64
    }
}

impl CpuKernel for Encoder {
    fn run_cpu(
        &self,
        s: &EncoderShape,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        if s.c == 0 {
            return Ok(());
        }
        let (out, tokens) = (t.f32_mut(&self.out), t.u32(&self.tokens));
        let (wte, wpe) = (t.f32(&self.wte), t.f32(&self.wpe));
        encoder_forward(cpu, out, tokens, wte, wpe, s.b, s.t, s.c);
        Ok(())
    }
}

impl CudaKernel for Encoder {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[ENCODER_FORWARD];

    fn launch(&self, s: &EncoderShape, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        if s.c == 0 {
            return Ok(());
        }
        let n = s.b * s.t;
        // encoder_forward_<T>(T* out, const unsigned int* tokens, const T* wte, const T*
        // wpe, int n, int t_len, int c, int v): out[..n·c], tokens[..n], wpe[..t·c] and
        // rows below v of wte (it checks each token against v).
        let args = [
            q.ptr(&self.out),
            q.ptr(&self.tokens),
            q.ptr(&self.wte),
            q.ptr(&self.wpe),
            int(n),
            int(s.t),
            int(s.c),
            int(s.v),
        ];
        Ok(q.launch(ENCODER_FORWARD, per_element(n * s.c), &args)?)
    }
}

/// dwte: (V, C) +=, dwpe: (T.., C) += the gradient of dout: (B, T, C).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EncoderBackward {
    /// f32 (V, C), accumulated.
    pub dwte: TensorRef,
    /// f32 (at least T, C), accumulated.
    pub dwpe: TensorRef,
    /// (B, T, C).
    pub dout: TensorRef,
    /// (B, T) u32.
    pub tokens: TensorRef,
    /// Batch.
    pub b: usize,
    /// Sequence.
    pub t: usize,
    /// Channels.
    pub c: usize,
}

impl Signature for EncoderBackward {
    const NAME: &'static str = "encoder-backward";
    type Shape = EncoderShape;

    fn shape(&self) -> Result<EncoderShape, KernelError> {
        Ok(EncoderShape::of(self.b, self.t, self.c, &self.dwte))
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (f32_, n) = (DtypeRule::Exactly(Dtype::F32), self.b * self.t);
        let (wte, wpe) = table_rules(self.t, self.c);
        each(Param::write("dwte", &self.dwte, f32_, wte));
        each(Param::write("dwpe", &self.dwpe, f32_, wpe));
        let w = DtypeRule::Working;
        each(Param::read("dout", &self.dout, w, LenRule::Len(n * self.c)));
        let u32_ = DtypeRule::Exactly(Dtype::U32);
        each(Param::read("tokens", &self.tokens, u32_, LenRule::Len(n)));
    }

    fn flops(&self) -> f64 {
        (self.b * self.t * self.c) as f64
    }
}

impl CpuKernel for EncoderBackward {
    fn run_cpu(
        &self,
        s: &EncoderShape,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        if s.c == 0 {
            return Ok(());
        }
        let (dwte, dwpe) = (t.f32_mut(&self.dwte), t.f32_mut(&self.dwpe));
        let (dout, tokens) = (t.f32(&self.dout), t.u32(&self.tokens));
        encoder_backward(cpu, dwte, dwpe, dout, tokens, s.b, s.t, s.c);
        Ok(())
    }
}

impl CudaKernel for EncoderBackward {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[ENCODER_BACKWARD_WTE, ENCODER_BACKWARD_WPE];

    fn launch(&self, s: &EncoderShape, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        if s.c == 0 {
            return Ok(());
        }
        let n = s.b * s.t;
        // encoder_backward_wte_<T>(float* dwte, const T* dout, const unsigned int* tokens,
        // int n, int c, int v): thread col < c, dwte rows below v (checked per token).
        let wte = [
            q.ptr(&self.dwte),
            q.ptr(&self.dout),
            q.ptr(&self.tokens),
            int(n),
            int(s.c),
            int(s.v),
        ];
        q.launch(ENCODER_BACKWARD_WTE, per_element(s.c), &wte)?;
        // encoder_backward_wpe_<T>(float* dwpe, const T* dout, int b, int t_len, int c):
        // dwpe[..t·c], dout[..b·t·c].
        let wpe = [
            q.ptr(&self.dwpe),
            q.ptr(&self.dout),
            int(s.b),
            int(s.t),
            int(s.c),
        ];
        Ok(q.launch(ENCODER_BACKWARD_WPE, per_element(s.t * s.c), &wpe)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::launch::tests::{Emulated, Layout};

    /// (B, T, C, V) of the samples.
    const SIZES: [(usize, usize, usize, usize); 2] = [(2, 7, 22, 13), (1, 1, 1, 1)];

    impl Emulated for Encoder {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            SIZES
                .map(|(b, t, c, v)| Encoder {
                    out: l.tensor(b * t * c, w),
                    tokens: l.tensor(b * t, Dtype::U32),
                    wte: l.tensor(v * c, w),
                    wpe: l.tensor((t + 3) * c, w),
                    b,
                    t,
                    c,
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            let (b, t, c) = (self.b, self.t, self.c);
            vec![
                ("n", b * t),
                ("t_len", t),
                ("c", c),
                ("v", self.wte.len / c.max(1)),
            ]
        }
    }

    impl Emulated for EncoderBackward {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            SIZES
                .map(|(b, t, c, v)| EncoderBackward {
                    dwte: l.tensor(v * c, Dtype::F32),
                    dwpe: l.tensor((t + 3) * c, Dtype::F32),
                    dout: l.tensor(b * t * c, w),
                    tokens: l.tensor(b * t, Dtype::U32),
                    b,
                    t,
                    c,
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            let (b, t, c) = (self.b, self.t, self.c);
            vec![
                ("n", b * t),
                ("b", b),
                ("t_len", t),
                ("c", c),
                ("v", self.dwte.len / c.max(1)),
            ]
        }
    }
}
