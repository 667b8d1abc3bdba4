//! Gradients transformed in place in f32: scaled, `x *= factor` (a loss scale undone, a
//! clipping factor applied), and rounded to bf16's precision (a step's gradients kept in
//! bf16, [`RoundBf16`]). Their signatures, CPU ops and CUDA launches are here; `scale.cu`
//! holds the CUDA kernels, [`reference`](mod@reference) the scalar references. Every
//! target makes the same one operation per element, so all agree bit for bit.

use crate::cuda::launch::{Arg, CudaKernel, CudaSource, Entry, Launch, long, per_element};
use crate::ops::simd::{self, on_isa};
use crate::ops::{Cpu, par_chunks, round_to_bf16};
use crate::program::{
    CpuKernel, CpuTensors, Dtype, DtypeRule, KernelError, LenRule, Param, Scalars, Signature,
    TensorRef,
};

pub mod reference;

/// The family's CUDA kernel.
const SOURCE: CudaSource = ("scale.cu", include_str!("scale.cu"));

const SCALE_F32: Entry = Entry::untyped("scale_f32");
const ROUND_BF16: Entry = Entry::untyped("round_bf16_f32");

/// x: (N) *= `factor`, on the worker pool.
pub fn scale_inplace(cpu: &Cpu, x: &mut [f32], factor: f32) {
    par_chunks(cpu, x, simd::LANES, |_, x| {
        on_isa!(cpu.isa, simd::scale_in_place(x, factor))
    });
}

/// `x *= factor`, elementwise in f32 (gradient scaling).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scale {
    /// f32, scaled in place.
    pub x: TensorRef,
    /// What every element is multiplied by.
    pub factor: f32,
}

impl Signature for Scale {
    const NAME: &'static str = "scale";
    /// Elements.
    type Shape = usize;

    fn shape(&self) -> Result<usize, KernelError> {
        Ok(self.x.len)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let f32_ = DtypeRule::Exactly(Dtype::F32);
        each(Param::write("x", &self.x, f32_, LenRule::Len(self.x.len)));
    }

    fn flops(&self) -> f64 {
        self.x.len as f64
    }
}

impl CpuKernel for Scale {
    fn run_cpu(
        &self,
        _: &usize,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        scale_inplace(cpu, t.f32_mut(&self.x), self.factor);
        Ok(())
    }
}

impl CudaKernel for Scale {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[SCALE_F32];

    fn launch(&self, &n: &usize, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        // scale_f32(float* x, float factor, long long n): n elements of x.
        let args = [q.ptr(&self.x), Arg::Float(self.factor), long(n)];
        Ok(q.launch(SCALE_F32, per_element(n), &args)?)
    }
}

/// `x` rounded in place to the nearest bf16 value, ties to even, kept in f32 (a NaN stays
/// a NaN, quieted): a step's gradients held at bf16's precision, so that they can wait
/// on NVMe in 2 bytes each without changing a bit of what the update reads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoundBf16 {
    /// f32, rounded in place.
    pub x: TensorRef,
}

impl Signature for RoundBf16 {
    const NAME: &'static str = "round-bf16";
    /// Elements.
    type Shape = usize;

    fn shape(&self) -> Result<usize, KernelError> {
        Ok(self.x.len)
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let f32_ = DtypeRule::Exactly(Dtype::F32);
        each(Param::write("x", &self.x, f32_, LenRule::Len(self.x.len)));
    }

    fn flops(&self) -> f64 {
        self.x.len as f64
    }
}

impl CpuKernel for RoundBf16 {
    fn run_cpu(
        &self,
        _: &usize,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        round_to_bf16(cpu, t.f32_mut(&self.x));
        Ok(())
    }
}

impl CudaKernel for RoundBf16 {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[ROUND_BF16];

    fn launch(&self, &n: &usize, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        // round_bf16_f32(float* x, long long n): n elements of x.
        let args = [q.ptr(&self.x), long(n)];
        Ok(q.launch(ROUND_BF16, per_element(n), &args)?)
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{RngExt, SeedableRng};

    use super::*;
    use crate::cuda::launch::tests::{
        Emulated, Emulator, Layout, check_emulation, count_arg, ptr_arg, random_inputs,
    };
    use crate::isa::Isa;
    use crate::kernel::Kernel;

    impl Emulated for Scale {
        fn samples(_: Dtype, l: &mut Layout) -> Vec<Self> {
            [4097, 0]
                .map(|len| Scale {
                    x: l.tensor(len, Dtype::F32),
                    factor: 0.375,
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            vec![("n", self.x.len)]
        }

        fn floats(&self, _: &Scalars) -> Vec<(&'static str, f32)> {
            vec![("factor", self.factor)]
        }

        fn emulate(name: &str, args: &[Arg], memory: &Emulator) -> bool {
            if name != "scale_f32" {
                return false;
            }
            let (x, n) = (ptr_arg(name, args, 0), count_arg(name, args, 2));
            let Arg::Float(factor) = args[1] else {
                panic!("{name}: factor is {:?}", args[1]);
            };
            for i in 0..n {
                memory.store(x, i, memory.load(x, i) * factor);
            }
            true
        }
    }

    impl Emulated for RoundBf16 {
        fn samples(_: Dtype, l: &mut Layout) -> Vec<Self> {
            [4097, 0]
                .map(|len| RoundBf16 {
                    x: l.tensor(len, Dtype::F32),
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            vec![("n", self.x.len)]
        }

        fn emulate(name: &str, args: &[Arg], memory: &Emulator) -> bool {
            if name != "round_bf16_f32" {
                return false;
            }
            let (x, n) = (ptr_arg(name, args, 0), count_arg(name, args, 1));
            for i in 0..n {
                // The .cu's bit arithmetic, written again.
                let bits = memory.load(x, i).to_bits();
                let nan = (bits & 0x7fff_ffff) > 0x7f80_0000;
                let rounded = if nan {
                    (bits | 0x0040_0000) & 0xffff_0000
                } else {
                    bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000
                };
                memory.store(x, i, f32::from_bits(rounded));
            }
            true
        }
    }

    #[test]
    fn rounding_to_bf16_gives_the_references_bits() {
        let mut rng = StdRng::seed_from_u64(11);
        let specials = [
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-45,
            // Ties: halfway between two bf16 values, to even either way.
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
        ];
        for len in [1, 7, 22, 4097, 100_003] {
            let mut x: Vec<f32> = (0..len)
                .map(|_| rng.random_range(-3.0f32..3.0) * 10f32.powi(rng.random_range(-30..30)))
                .collect();
            for (v, s) in x.iter_mut().zip(specials) {
                *v = s;
            }
            let mut want = x.clone();
            reference::round_bf16(&mut want);
            for isa in Isa::supported() {
                for threads in [1, 3] {
                    let mut got = x.clone();
                    round_to_bf16(&Cpu { isa, threads }, &mut got);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert!(
                        bits(&got) == bits(&want),
                        "len {len}, {isa} on {threads} threads"
                    );
                }
            }
        }
        // A NaN stays a NaN (the reference's conversion may choose other payload bits).
        let mut nan = [f32::NAN, -f32::NAN, f32::from_bits(0x7f80_0001)];
        round_to_bf16(&Cpu::default(), &mut nan);
        assert!(nan.iter().all(|v| v.is_nan()), "{nan:?}");
    }

    #[test]
    fn scaling_gives_the_references_bits_on_odd_sizes() {
        let mut rng = StdRng::seed_from_u64(7);
        for len in [1, 7, 22, 4097, 1_000_003] {
            let x: Vec<f32> = (0..len).map(|_| rng.random_range(-3.0..3.0)).collect();
            for factor in [0.375, -1e-3, 65536.0] {
                let mut want = x.clone();
                reference::scale(&mut want, factor);
                for isa in Isa::supported() {
                    for threads in [1, 3] {
                        let mut got = x.clone();
                        scale_inplace(&Cpu { isa, threads }, &mut got, factor);
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert!(
                            bits(&got) == bits(&want),
                            "len {len}, factor {factor}, {isa} on {threads} threads"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_cuda_launch_computes_the_cpus_bits() {
        let mut l = Layout::default();
        let kernels: Vec<Kernel> = [1, 7, 4097]
            .map(|n| {
                Kernel::Scale(Scale {
                    x: l.tensor(n, Dtype::F32),
                    factor: -0.375,
                })
            })
            .to_vec();
        let inputs = random_inputs(&l, &kernels, 5);
        // One multiply per element on both: no error at all.
        check_emulation(&kernels, inputs, f64::MIN_POSITIVE);
    }

    #[test]
    fn the_cuda_rounding_computes_the_cpus_bits() {
        let mut l = Layout::default();
        let kernels: Vec<Kernel> = [1, 7, 4097]
            .map(|n| {
                Kernel::RoundBf16(RoundBf16 {
                    x: l.tensor(n, Dtype::F32),
                })
            })
            .to_vec();
        let inputs = random_inputs(&l, &kernels, 6);
        check_emulation(&kernels, inputs, f64::MIN_POSITIVE);
    }
}
