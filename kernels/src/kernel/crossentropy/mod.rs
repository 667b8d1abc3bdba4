//! Softmax cross-entropy over the vocabulary, per position, and its gradient: the
//! kernels' signatures, CPU ops and CUDA launches; `crossentropy.cu` holds the CUDA
//! kernels, [`reference`](mod@reference) the scalar reference.

use crate::cuda::launch::Arg;
use crate::cuda::launch::{CudaKernel, CudaSource, Entry, Launch, int, per_row_block};
use crate::ops::simd::on_isa;
use crate::ops::{Cpu, RowsMut, par_rows, simd};
use crate::program::{
    CpuKernel, CpuTensors, Dtype, DtypeRule, KernelError, LenRule, Param, Scalars, Signature,
    TensorRef,
};

pub mod reference;

/// The target id that the loss does not count: [`CrossEntropy`] gives its position a
/// loss of 0 and [`CrossEntropyBackward`] a zero gradient, on every device and in the
/// reference. A prompt's tokens are masked out of a fine-tuning loss this way; the caller
/// divides by the positions that count (the mean over them).
pub const IGNORE_TARGET: u32 = u32::MAX;

/// losses: (N)  logits: (N, V)  targets: (N).
/// `losses[n] = log(sum(exp(logits[n]))) - logits[n, targets[n]]`, 0 where `targets[n]`
/// is [`IGNORE_TARGET`]. Panics on another target outside `0..V`.
pub fn crossentropy_forward(
    cpu: &Cpu,
    losses: &mut [f32],
    logits: &[f32],
    targets: &[u32],
    n: usize,
    v: usize,
) {
    assert_eq!(logits.len(), n * v);
    assert_eq!((losses.len(), targets.len()), (n, n));
    par_rows(
        cpu.threads_for(n * v),
        n,
        1,
        RowsMut::new(losses, 1),
        |rows, losses| {
            on_isa!(cpu.isa, {
                for (i, row) in rows.enumerate() {
                    let l = &logits[row * v..][..v];
                    if targets[row] == IGNORE_TARGET {
                        losses.data[i] = 0.0;
                        continue;
                    }
                    let target = targets[row] as usize;
                    assert!(
                        target < v,
                        "target {target} at {row} outside vocabulary {v}"
                    );
                    let max = simd::max(l);
                    let sum = simd::exp_shifted_sum(l, max);
                    losses.data[i] = sum.ln() + max - l[target];
                }
            },)
        },
    );
}

/// logits: (N, V), replaced by dlogits  targets: (N)  dloss: the gradient of the final
/// loss with respect to each position's loss (1/N for the mean).
/// `dlogits[n] = (softmax(logits[n]) - onehot(targets[n])) * dloss`, in place, so the
/// largest activation of the model is not held twice; zero where `targets[n]` is
/// [`IGNORE_TARGET`].
pub fn crossentropy_backward_inplace(
    cpu: &Cpu,
    logits: &mut [f32],
    targets: &[u32],
    dloss: f32,
    n: usize,
    v: usize,
) {
    assert_eq!(logits.len(), n * v);
    assert_eq!(targets.len(), n);
    par_rows(
        cpu.threads_for(n * v),
        n,
        1,
        RowsMut::new(logits, v),
        |rows, logits| {
            on_isa!(cpu.isa, {
                for (row, l) in rows.zip(logits.data.chunks_exact_mut(v)) {
                    if targets[row] == IGNORE_TARGET {
                        l.fill(0.0);
                        continue;
                    }
                    let target = targets[row] as usize;
                    assert!(
                        target < v,
                        "target {target} at {row} outside vocabulary {v}"
                    );
                    let max = simd::max(l);
                    let sum = simd::exp_shifted_in_place(l, max);
                    simd::scale_in_place(l, dloss / sum);
                    l[target] -= dloss;
                }
            },)
        },
    );
}

/// The family's CUDA kernels.
const SOURCE: CudaSource = ("crossentropy.cu", include_str!("crossentropy.cu"));

const CROSSENTROPY_FORWARD: Entry = Entry::typed("crossentropy_forward");
const CROSSENTROPY_BACKWARD: Entry = Entry::typed("crossentropy_backward");

/// The logits' shape: `n` positions of `v` logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Logits {
    /// Positions.
    pub n: usize,
    /// Vocabulary.
    pub v: usize,
}

/// losses: (N) f32 = cross-entropy of softmax(logits: (N, V)) against targets: (N);
/// 0 where the target is [`IGNORE_TARGET`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CrossEntropy {
    /// (N) f32.
    pub losses: TensorRef,
    /// (N, V).
    pub logits: TensorRef,
    /// (N) u32.
    pub targets: TensorRef,
    /// Rows.
    pub n: usize,
    /// Vocabulary.
    pub v: usize,
}

impl Signature for CrossEntropy {
    const NAME: &'static str = "crossentropy";
    type Shape = Logits;

    fn shape(&self) -> Result<Logits, KernelError> {
        Ok(Logits {
            n: self.n,
            v: self.v,
        })
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let (f32_, u32_) = (
            DtypeRule::Exactly(Dtype::F32),
            DtypeRule::Exactly(Dtype::U32),
        );
        let logits = LenRule::Len(self.n * self.v);
        each(Param::write(
            "losses",
            &self.losses,
            f32_,
            LenRule::Len(self.n),
        ));
        each(Param::read(
            "logits",
            &self.logits,
            DtypeRule::Working,
            logits,
        ));
        each(Param::read(
            "targets",
            &self.targets,
            u32_,
            LenRule::Len(self.n),
        ));
    }

    fn flops(&self) -> f64 {
        3.0 * (self.n * self.v) as f64
    }
}

impl CpuKernel for CrossEntropy {
    fn run_cpu(
        &self,
        s: &Logits,
        cpu: &Cpu,
        _: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let (losses, logits) = (t.f32_mut(&self.losses), t.f32(&self.logits));
        crossentropy_forward(cpu, losses, logits, t.u32(&self.targets), s.n, s.v);
        Ok(())
    }
}

impl CudaKernel for CrossEntropy {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[CROSSENTROPY_FORWARD];

    fn launch(&self, s: &Logits, _: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        if s.n == 0 {
            return Ok(());
        }
        // crossentropy_forward_<T>(float* losses, const T* logits, const unsigned int*
        // targets, int v): block r < n touches row r of logits (v elements), losses[r]
        // and targets[r]; targets are checked against v in the kernel. The grid is
        // exactly n blocks (n > 0).
        let args = [
            q.ptr(&self.losses),
            q.ptr(&self.logits),
            q.ptr(&self.targets),
            int(s.v),
        ];
        Ok(q.launch(CROSSENTROPY_FORWARD, per_row_block(s.n), &args)?)
    }
}

/// logits: (N, V) replaced by `(softmax - onehot(targets)) * dloss`, with `dloss` from
/// [`Scalars::dloss`]; a row whose target is [`IGNORE_TARGET`] is zeroed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CrossEntropyBackward {
    /// (N, V), in place.
    pub logits: TensorRef,
    /// (N) u32.
    pub targets: TensorRef,
    /// Rows.
    pub n: usize,
    /// Vocabulary.
    pub v: usize,
}

impl Signature for CrossEntropyBackward {
    const NAME: &'static str = "crossentropy-backward";
    type Shape = Logits;

    fn shape(&self) -> Result<Logits, KernelError> {
        Ok(Logits {
            n: self.n,
            v: self.v,
        })
    }

    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
        let logits = LenRule::Len(self.n * self.v);
        each(Param::write(
            "logits",
            &self.logits,
            DtypeRule::Working,
            logits,
        ));
        let u32_ = DtypeRule::Exactly(Dtype::U32);
        each(Param::read(
            "targets",
            &self.targets,
            u32_,
            LenRule::Len(self.n),
        ));
    }

    fn flops(&self) -> f64 {
        3.0 * (self.n * self.v) as f64
    }
}

impl CpuKernel for CrossEntropyBackward {
    fn run_cpu(
        &self,
        s: &Logits,
        cpu: &Cpu,
        scalars: &Scalars,
        t: &CpuTensors<'_>,
    ) -> Result<(), KernelError> {
        let (logits, targets) = (t.f32_mut(&self.logits), t.u32(&self.targets));
        crossentropy_backward_inplace(cpu, logits, targets, scalars.dloss, s.n, s.v);
        Ok(())
    }
}

impl CudaKernel for CrossEntropyBackward {
    const SOURCE: CudaSource = SOURCE;
    const ENTRIES: &'static [Entry] = &[CROSSENTROPY_BACKWARD];

    fn launch(&self, s: &Logits, scalars: &Scalars, q: &mut Launch<'_>) -> Result<(), KernelError> {
        if s.n == 0 {
            return Ok(());
        }
        // crossentropy_backward_<T>(T* logits, const unsigned int* targets, float dloss,
        // int v): block r < n touches row r of logits and targets[r]. The grid is exactly
        // n blocks (n > 0).
        let args = [
            q.ptr(&self.logits),
            q.ptr(&self.targets),
            Arg::Float(scalars.dloss),
            int(s.v),
        ];
        Ok(q.launch(CROSSENTROPY_BACKWARD, per_row_block(s.n), &args)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::launch::tests::{Emulated, Layout};

    /// (N, V) of the samples.
    const SIZES: [(usize, usize); 2] = [(7, 22), (0, 3)];

    impl Emulated for CrossEntropy {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            SIZES
                .map(|(n, v)| CrossEntropy {
                    losses: l.tensor(n, Dtype::F32),
                    logits: l.tensor(n * v, w),
                    targets: l.tensor(n, Dtype::U32),
                    n,
                    v,
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            vec![("v", self.v)]
        }
    }

    impl Emulated for CrossEntropyBackward {
        fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
            SIZES
                .map(|(n, v)| CrossEntropyBackward {
                    logits: l.tensor(n * v, w),
                    targets: l.tensor(n, Dtype::U32),
                    n,
                    v,
                })
                .to_vec()
        }

        fn dimensions(&self) -> Vec<(&'static str, usize)> {
            vec![("v", self.v)]
        }

        fn floats(&self, scalars: &Scalars) -> Vec<(&'static str, f32)> {
            vec![("dloss", scalars.dloss)]
        }
    }
}
