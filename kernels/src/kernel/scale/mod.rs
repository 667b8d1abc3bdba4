//! Scaling a tensor in place, `x *= factor` in f32: gradient scaling (a loss scale undone,
//! a clipping factor applied). Its signature, CPU op and CUDA launch are here; `scale.cu`
//! holds the CUDA kernel, [`reference`](mod@reference) the scalar reference. Every target
//! makes the one multiply per element, so all agree bit for bit.

use crate::cuda::launch::{Arg, CudaKernel, CudaSource, Entry, Launch, long, per_element};
use crate::ops::simd::{self, on_isa};
use crate::ops::{Cpu, par_chunks};
use crate::program::{
    CpuKernel, CpuTensors, Dtype, DtypeRule, KernelError, LenRule, Param, Scalars, Signature,
    TensorRef,
};

pub mod reference;

/// The family's CUDA kernel.
const SOURCE: CudaSource = ("scale.cu", include_str!("scale.cu"));

const SCALE_F32: Entry = Entry::untyped("scale_f32");

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
}
