//! Kernels over whole tensors, element by element: zeroing, copying, the residual add,
//! the elementwise product, the scaled add in the working dtype (a LoRA adapter's share),
//! f32 gradient accumulation and the fold of a reduce-scatter. Each kernel's signature,
//! CPU op and CUDA launch are here; `elementwise.cu` holds its CUDA kernels (zeroing and
//! copying are a memset and a copy), [`reference`](mod@reference) the scalar reference.

use crate::cuda::launch::{Arg, CudaKernel, CudaSource, Entry, Launch, int, long, per_element};
use crate::ops::simd::{self, on_isa};
use crate::ops::{Cpu, par_chunks};
use crate::program::{
    CpuKernel, CpuTensors, Dtype, DtypeRule, KernelError, LenRule, Param, Scalars, Signature,
    TensorRef,
};

pub mod reference;

/// The family's CUDA kernels.
const SOURCE: CudaSource = ("elementwise.cu", include_str!("elementwise.cu"));

const RESIDUAL_FORWARD: Entry = Entry::typed("residual_forward");
const MUL_FORWARD: Entry = Entry::typed("mul_forward");
const ADD_F32: Entry = Entry::untyped("add_f32");
const ADD_SCALED: Entry = Entry::typed("add_scaled");
const FOLD_RANKS: Entry = Entry::untyped("fold_ranks");

/// out: (N)  a: (N)  b: (N).  `out = a + b`. Its backward passes `dout` to both inputs,
/// which callers do by reusing or adding `dout` ([`add_inplace`]).
pub fn residual_forward(cpu: &Cpu, out: &mut [f32], a: &[f32], b: &[f32]) {
    binary_forward(cpu, out, a, b, |x, y| x + y);
}

/// out: (N)  a: (N)  b: (N).  `out = a * b`, element by element.
pub fn mul_forward(cpu: &Cpu, out: &mut [f32], a: &[f32], b: &[f32]) {
    binary_forward(cpu, out, a, b, |x, y| x * y);
}

/// `out[i] = op(a[i], b[i])`, in chunks on the worker pool, each compiled for the ISA.
#[inline(always)]
fn binary_forward(
    cpu: &Cpu,
    out: &mut [f32],
    a: &[f32],
    b: &[f32],
    op: impl Fn(f32, f32) -> f32 + Copy + Sync,
) {
    assert_eq!((a.len(), b.len()), (out.len(), out.len()));
    par_chunks(cpu, out, simd::LANES, |r, out| {
        let (a, b) = (&a[r.clone()], &b[r]);
        on_isa!(cpu.isa, {
            for i in 0..out.len() {
                out[i] = op(a[i], b[i]);
            }
        })
    });
}

/// dst: (N) +=  src: (N).
pub fn add_inplace(cpu: &Cpu, dst: &mut [f32], src: &[f32]) {
    assert_eq!(src.len(), dst.len());
    par_chunks(cpu, dst, simd::LANES, |r, dst| {
        on_isa!(cpu.isa, simd::add_assign(dst, &src[r]))
    });
}

/// dst: (N) +=  `factor * src`: (N), element by element, the product rounded before the
/// sum (no fused multiply-add, as the CUDA kernel).
pub fn add_scaled(cpu: &Cpu, dst: &mut [f32], src: &[f32], factor: f32) {
    assert_eq!(src.len(), dst.len());
    par_chunks(cpu, dst, simd::LANES, |r, dst| {
        let src = &src[r];
        on_isa!(cpu.isa, {
            for i in 0..dst.len() {
                dst[i] += factor * src[i];
            }
        })
    });
}

/// acc: (N) = `((acc + x_0) + x_1) + ...` (or from `x_0` without `accumulate`) over the
/// `chunks.len() / N` chunks of `chunks`, in order.
fn fold_ranks(acc: &mut [f32], chunks: &[f32], ranks: usize, accumulate: bool) {
    let n = acc.len();
    assert_eq!(chunks.len(), ranks * n);
    for (i, a) in acc.iter_mut().enumerate() {
        let mut sum = if accumulate {
            *a + chunks[i]
        } else {
            chunks[i]
        };
        for p in 1..ranks {
            sum += chunks[p * n + i];
        }
        *a = sum;
    }
}

/// `t = 0`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Zero {
    /// Any dtype.
    pub t: TensorRef,
}

impl Signature for Zero {
    const NAME: &'static str = "zero";
    type Shape = ();

    fn shape(&self) -> Result<(), KernelError> {
        Ok(())
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        each(Param::write("t", &self.t, DtypeRule::Any, LenRule::AnyLen));
    }

    fn flops(&self) -> f64 {
        0.0
    }
}

impl CpuKernel for Zero {
    fn run_cpu(&self, _: &(), _: &Cpu, _: &Scalars, t: &CpuTensors<'_>) -> Result<(), KernelError> {
        t.bytes_mut(&self.t).fill(0);
        Ok(())
    }
}

impl CudaKernel for Zero {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[];

    fn launch(&self, _: &(), _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        Ok(q.zero(q.address(&self.t), self.t.bytes())?)
    }
}

/// `dst = src` (same dtype and length). Named `CopyKernel` to leave `Copy` to the trait;
/// the program calls it [`Kernel::Copy`](crate::kernel::Kernel::Copy).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CopyKernel {
    /// Destination.
    pub dst: TensorRef,
    /// Source.
    pub src: TensorRef,
}

impl Signature for CopyKernel {
    const NAME: &'static str = "copy";
    type Shape = ();

    fn shape(&self) -> Result<(), KernelError> {
        Ok(())
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (dtype, len) = (self.dst.dtype, self.dst.len);
        each(Param::write(
            "dst",
            &self.dst,
            DtypeRule::Any,
            LenRule::AnyLen,
        ));
        each(Param::read(
            "src",
            &self.src,
            DtypeRule::Exactly(dtype),
            LenRule::Len(len),
        ));
    }

    fn flops(&self) -> f64 {
        0.0
    }
}

impl CpuKernel for CopyKernel {
    fn run_cpu(&self, _: &(), _: &Cpu, _: &Scalars, t: &CpuTensors<'_>) -> Result<(), KernelError> {
        t.bytes_mut(&self.dst).copy_from_slice(t.bytes(&self.src));
        Ok(())
    }
}

impl CudaKernel for CopyKernel {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[];

    fn launch(&self, _: &(), _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        let bytes = self.dst.bytes();
        if bytes > 0 {
            q.copy(q.address(&self.dst), q.address(&self.src), bytes)?;
        }
        Ok(())
    }
}

/// `dst += src`, elementwise in f32 (gradient accumulation).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AddF32 {
    /// f32, accumulated into.
    pub dst: TensorRef,
    /// f32, same length.
    pub src: TensorRef,
}

impl Signature for AddF32 {
    const NAME: &'static str = "add";
    /// Elements.
    type Shape = usize;

    fn shape(&self) -> Result<usize, KernelError> {
        Ok(self.dst.len)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (f32_, n) = (DtypeRule::Exactly(Dtype::F32), LenRule::Len(self.dst.len));
        each(Param::write("dst", &self.dst, f32_, n));
        each(Param::read("src", &self.src, f32_, n));
    }

    fn flops(&self) -> f64 {
        self.dst.len as f64
    }
}

impl CpuKernel for AddF32 {
    fn run_cpu(
        &self,
        _: &usize,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        add_inplace(cpu, t.f32_mut(&self.dst), t.f32(&self.src));
        Ok(())
    }
}

impl CudaKernel for AddF32 {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[ADD_F32];

    fn launch(&self, &n: &usize, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        // add_f32(float* dst, const float* src, long long n): n elements of each.
        let args = [q.ptr(&self.dst), q.ptr(&self.src), long(n)];
        Ok(q.launch(ADD_F32, per_element(n), &args)?)
    }
}

/// `dst += factor * src` over working-type tensors of one length: a LoRA adapter's
/// scaled share added to its layer's output, or its input gradient to the layer's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AddScaled {
    /// Accumulated into.
    pub dst: TensorRef,
    /// Same length.
    pub src: TensorRef,
    /// What `src` is multiplied by.
    pub factor: f32,
}

impl Signature for AddScaled {
    const NAME: &'static str = "add-scaled";
    /// Elements.
    type Shape = usize;

    fn shape(&self) -> Result<usize, KernelError> {
        Ok(self.dst.len)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (w, n) = (DtypeRule::Working, LenRule::Len(self.dst.len));
        each(Param::write("dst", &self.dst, w, n));
        each(Param::read("src", &self.src, w, n));
    }

    fn flops(&self) -> f64 {
        2.0 * self.dst.len as f64
    }
}

impl CpuKernel for AddScaled {
    fn run_cpu(
        &self,
        _: &usize,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        add_scaled(cpu, t.f32_mut(&self.dst), t.f32(&self.src), self.factor);
        Ok(())
    }
}

impl CudaKernel for AddScaled {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[ADD_SCALED];

    fn launch(&self, &n: &usize, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        // add_scaled_<T>(T* dst, const T* src, float factor, long long n): n elements of
        // each.
        let args = [
            q.ptr(&self.dst),
            q.ptr(&self.src),
            Arg::Float(self.factor),
            long(n),
        ];
        Ok(q.launch(ADD_SCALED, per_element(n), &args)?)
    }
}

/// The fold of a reduce-scatter: `acc[i] = ((acc[i] + x_0[i]) + x_1[i]) + ...` over
/// `ranks` chunks `x_p` of `acc`'s length laid one after another in `chunks` (rank
/// order), or from `x_0[i]` itself without `accumulate`: the order every transport
/// of `strata-comm` sums in, so a device's reduce-scatter gives their bits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FoldRanks {
    /// f32, the result (and, with `accumulate`, the start).
    pub acc: TensorRef,
    /// f32, `ranks` times `acc`'s length.
    pub chunks: TensorRef,
    /// How many chunks.
    pub ranks: usize,
    /// Whether `acc` is added to (else it is overwritten).
    pub accumulate: bool,
}

impl Signature for FoldRanks {
    const NAME: &'static str = "fold-ranks";
    /// Elements of `acc`.
    type Shape = usize;

    fn shape(&self) -> Result<usize, KernelError> {
        Ok(self.acc.len)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (f32_, n) = (DtypeRule::Exactly(Dtype::F32), self.acc.len);
        each(Param::write("acc", &self.acc, f32_, LenRule::Len(n)));
        each(Param::read(
            "chunks",
            &self.chunks,
            f32_,
            LenRule::Len(self.ranks * n),
        ));
    }

    fn flops(&self) -> f64 {
        self.chunks.len as f64
    }
}

impl CpuKernel for FoldRanks {
    fn run_cpu(
        &self,
        _: &usize,
        _: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let acc = t.f32_mut(&self.acc);
        fold_ranks(acc, t.f32(&self.chunks), self.ranks, self.accumulate);
        Ok(())
    }
}

impl CudaKernel for FoldRanks {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[FOLD_RANKS];

    fn launch(&self, &n: &usize, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        // fold_ranks(float* acc, const float* chunks, long long n, int ranks, int
        // accumulate): n elements of acc, ranks · n of chunks.
        let args = [
            q.ptr(&self.acc),
            q.ptr(&self.chunks),
            long(n),
            int(self.ranks),
            int(usize::from(self.accumulate)),
        ];
        Ok(q.launch(FOLD_RANKS, per_element(n), &args)?)
    }
}

/// A kernel `out = a OP b` over working-type tensors of one length: the struct, its
/// signature, its CPU op and its CUDA launch (`OP_forward_<T>(T* out, const T* a, const
/// T* b, long long n)` in `elementwise.cu`).
macro_rules! binary_kernel {
    ($(#[$doc:meta])* $kernel:ident, $name:literal, $entry:ident, $cpu:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq)]
        pub struct $kernel {
            /// Output.
            pub out: TensorRef,
            /// First operand.
            pub a: TensorRef,
            /// Second operand.
            pub b: TensorRef,
        }

        impl Signature for $kernel {
            const NAME: &'static str = $name;
            /// Elements.
            type Shape = usize;

            fn shape(&self) -> Result<usize, KernelError> {
                Ok(self.out.len)
            }

            fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
                let (w, n) = (DtypeRule::Working, LenRule::Len(self.out.len));
                each(Param::write("out", &self.out, w, n));
                each(Param::read("a", &self.a, w, n));
                each(Param::read("b", &self.b, w, n));
            }

            fn flops(&self) -> f64 {
                self.out.len as f64
            }
        }

        impl CpuKernel for $kernel {
            fn run_cpu(
                &self,
                _: &usize,
                cpu: &Cpu,
                _: &Scalars,
                t: &CpuTensors<'_>,
            ) -> Result<(), KernelError> {
                $cpu(cpu, t.f32_mut(&self.out), t.f32(&self.a), t.f32(&self.b));
                Ok(())
            }
        }

        impl CudaKernel for $kernel {
            const SOURCE: CudaSource = SOURCE;
            const ENTRIES: &'static [Entry] = &[$entry];

            fn launch(
                &self,
                &n: &usize,
                _: &Scalars,
                q: &mut Launch<'_>,
            ) -> Result<(), KernelError> {
                let args = [q.ptr(&self.out), q.ptr(&self.a), q.ptr(&self.b), long(n)];
                Ok(q.launch($entry, per_element(n), &args)?)
            }
        }

        #[cfg(test)]
        impl crate::cuda::launch::tests::Emulated for $kernel {
            fn samples(w: Dtype, l: &mut crate::cuda::launch::tests::Layout) -> Vec<Self> {
                [4097, 0]
                    .map(|len| $kernel {
                        out: l.tensor(len, w),
                        a: l.tensor(len, w),
                        b: l.tensor(len, w),
                    })
                    .to_vec()
            }

            fn dimensions(&self) -> Vec<(&'static str, usize)> {
                vec![("n", self.out.len)]
            }
        }
    };
}

binary_kernel!(
    /// out = a + b, elementwise.
    Residual,
    "residual",
    RESIDUAL_FORWARD,
    residual_forward
);

binary_kernel!(
    /// out = a * b, elementwise (the SwiGLU's product recomputed from its two factors,
    /// where the few-bit backward keeps `silu(gate)` rather than the gate).
    Mul,
    "mul",
    MUL_FORWARD,
    mul_forward
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::launch::tests::{
        Emulated, Emulator, Layout, check_emulation, count_arg, ptr_arg, random_inputs,
    };
    use crate::kernel::Kernel;

    #[test]
    fn the_product_is_the_references_on_every_isa() {
        use crate::isa::Isa;
        let n = 1031;
        let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() - 0.2).collect();
        let mut want = vec![0f32; n];
        reference::mul_forward(&mut want, &a, &b);
        for isa in Isa::supported() {
            for threads in [1, 3] {
                let mut got = vec![0f32; n];
                mul_forward(&Cpu { isa, threads }, &mut got, &a, &b);
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{isa} on {threads} threads");
            }
        }
    }

    impl Emulated for Zero {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            vec![Zero { t: l.tensor(7, w) }]
        }
    }

    impl Emulated for CopyKernel {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            vec![CopyKernel {
                dst: l.tensor(7, w),
                src: l.tensor(7, w),
            }]
        }
    }

    impl Emulated for AddF32 {
        fn samples(_: Dtype, l: &mut Layout) -> Vec<Self> {
            vec![AddF32 {
                dst: l.tensor(4097, Dtype::F32),
                src: l.tensor(4097, Dtype::F32),
            }]
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            vec![("n", self.dst.len)]
        }
    }

    impl Emulated for AddScaled {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            [4097, 0]
                .map(|len| AddScaled {
                    dst: l.tensor(len, w),
                    src: l.tensor(len, w),
                    factor: -0.375,
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            vec![("n", self.dst.len)]
        }

        fn floats(&self, _: &Scalars) -> Vec<(&'static str, f32)> {
            vec![("factor", self.factor)]
        }

        fn emulate(name: &str, args: &[Arg], memory: &Emulator) -> bool {
            if name != "add_scaled_f32" {
                return false;
            }
            let (dst, src) = (ptr_arg(name, args, 0), ptr_arg(name, args, 1));
            let Arg::Float(factor) = args[2] else {
                panic!("{name}: factor is {:?}", args[2]);
            };
            for i in 0..count_arg(name, args, 3) {
                memory.store(dst, i, memory.load(dst, i) + factor * memory.load(src, i));
            }
            true
        }
    }

    #[test]
    fn the_scaled_add_is_the_references_on_every_isa_and_odd_sizes() {
        use crate::isa::Isa;
        for n in [1, 7, 22, 4097, 1_000_003] {
            let src: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
            let dst: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() - 0.2).collect();
            for factor in [2.0, -0.375, 1.0] {
                let mut want = dst.clone();
                reference::add_scaled(&mut want, &src, factor);
                for isa in Isa::supported() {
                    for threads in [1, 3] {
                        let mut got = dst.clone();
                        add_scaled(&Cpu { isa, threads }, &mut got, &src, factor);
                        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&got), bits(&want), "{n}, {isa} on {threads} threads");
                    }
                }
            }
        }
    }

    #[test]
    fn the_cuda_scaled_add_computes_the_cpus_bits() {
        let mut l = Layout::default();
        let kernels: Vec<Kernel> = [1, 7, 4097]
            .map(|n| {
                Kernel::AddScaled(AddScaled {
                    dst: l.tensor(n, Dtype::F32),
                    src: l.tensor(n, Dtype::F32),
                    factor: 2.5,
                })
            })
            .to_vec();
        let inputs = random_inputs(&l, &kernels, 9);
        // A product then a sum per element on both, each rounded: no error at all.
        check_emulation(&kernels, inputs, f64::MIN_POSITIVE);
    }

    impl Emulated for FoldRanks {
        fn samples(_: Dtype, l: &mut Layout) -> Vec<Self> {
            [(1, false), (3, true)]
                .map(|(ranks, accumulate)| FoldRanks {
                    acc: l.tensor(4097, Dtype::F32),
                    chunks: l.tensor(ranks * 4097, Dtype::F32),
                    ranks,
                    accumulate,
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            vec![
                ("n", self.acc.len),
                ("ranks", self.ranks),
                ("accumulate", usize::from(self.accumulate)),
            ]
        }
    }
}
