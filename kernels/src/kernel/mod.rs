//! The kernels of a program, one family per module, and their registry, [`Kernel`]:
//! one line per kernel.
//!
//! A family's folder holds its kernels' argument structs, each with its signature
//! ([`Signature`]: the tensors it reads and writes with their dtypes and lengths, its
//! FLOPs, its dimensions checked), its CPU op ([`CpuKernel`](crate::program::CpuKernel))
//! and its CUDA launch sequence (`CudaKernel`, in `crate::cuda::launch`) beside its `.cu`
//! file, and its scalar reference: `mod.rs`, `reference.rs` and `<family>.cu` (a large
//! family keeps its CPU op in `cpu.rs`, as attention and matmul do). The registry makes a
//! program's instruction set of them; the runners ([`crate::program::run_cpu`],
//! [`crate::cuda::CudaKernels::run`]), the CUDA program's sources and entry points, and
//! the tests' samples all come from it. Adding a kernel to a family is its struct and
//! impls (and tests) there, its kernel in the `.cu` file, its reference, and its line
//! here: four files; a new family is its folder's three and the lines here (see
//! [`scale`]).
//!
//! Semantics are those of the CPU kernels: row-major tensors; forward kernels overwrite
//! their outputs; backward kernels accumulate (`+=`) into parameter gradients and
//! overwrite activation gradients, except LayerNorm's and RMSNorm's input gradients,
//! which accumulate. Activations and parameters are in the target's working dtype
//! (always f32 on the CPU), parameter gradients and per-row statistics in f32, token ids
//! in u32.

use crate::cuda::launch::{CudaKernel, CudaSource, Entry, RunOnCuda, TrustedDevice};
use crate::ops::Cpu;
use crate::program::{
    Access, KernelError, Param, RunOnCpu, Scalars, Signature, Target, TensorRef, TrustedMemory,
    check,
};

pub mod attention;
pub mod crossentropy;
pub mod elementwise;
pub mod encoder;
pub mod fewbit;
pub mod gelu;
pub mod layernorm;
pub mod matmul;
pub mod optimizer;
pub mod quant;
pub mod rmsnorm;
pub mod rope;
pub mod scale;
pub mod sketch;
pub mod swiglu;

pub use attention::{
    Attention, AttentionBackward, DocStarts, FlashAttention, FlashAttentionBackward, FlashMask,
    GqaAttention, GqaAttentionBackward, GqaFlashAttention, GqaFlashAttentionBackward,
};
pub use crossentropy::{CrossEntropy, CrossEntropyBackward};
pub use elementwise::{AddF32, AddScaled, CopyKernel, FoldRanks, Mul, Residual, Zero};
pub use encoder::{Encoder, EncoderBackward};
pub use fewbit::{FewBitGelu, FewBitGeluBackward, FewBitSwiGlu, FewBitSwiGluBackward};
pub use gelu::{Gelu, GeluBackward};
pub use layernorm::{LayerNorm, LayerNormBackward, LayerNormGrads};
pub use matmul::{Matmul, MatmulBackward, WeightGrad};
pub use optimizer::{AdamWKernel, GradStatsKernel};
pub use quant::{Int8Dequantize, Nf4Dequantize};
pub use rmsnorm::{RmsNorm, RmsNormBackward};
pub use rope::{Rope, RopeBackward, RopeTable};
pub use scale::{RoundBf16, Scale};
pub use sketch::{SketchProject, SketchWeightGrad};
pub use swiglu::{SwiGlu, SwiGluBackward};

/// Declares [`Kernel`], one variant per kernel struct, and its dispatch to the structs'
/// [`Signature`], CPU op and CUDA launch sequence.
macro_rules! registry {
    ($($(#[$doc:meta])* $variant:ident($kernel:ty),)*) => {
        /// One kernel launch: a kernel's arguments (its tensors and dimensions), as one
        /// instruction of a program. Shapes are in each kernel's documentation.
        #[derive(Debug, Clone, PartialEq)]
        pub enum Kernel {
            $($(#[$doc])* $variant($kernel),)*
        }

        $(impl From<$kernel> for Kernel {
            fn from(kernel: $kernel) -> Self {
                Kernel::$variant(kernel)
            }
        })*

        impl Kernel {
            /// A short name for messages and traces.
            pub fn name(&self) -> &'static str {
                match self {
                    $(Kernel::$variant(_) => <$kernel as Signature>::NAME,)*
                }
            }

            /// Calls `each` with every tensor of the kernel's signature, in order.
            pub fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>)) {
                match self {
                    $(Kernel::$variant(k) => k.params(each),)*
                }
            }

            /// Floating-point operations, counting a multiply-add as two
            /// ([`Signature::flops`]).
            pub fn flops(&self) -> f64 {
                match self {
                    $(Kernel::$variant(k) => k.flops(),)*
                }
            }

            /// `Ok` when the kernel's tensors fit its signature on `target`.
            pub fn check(&self, target: Target) -> Result<(), KernelError> {
                match self {
                    $(Kernel::$variant(k) => check(k, target).map(|_| ()),)*
                }
            }
        }

        impl RunOnCpu for Kernel {
            fn run_on_cpu(
                &self,
                cpu: &Cpu,
                scalars: &Scalars,
                memory: &TrustedMemory<'_>,
            ) -> Result<(), KernelError> {
                match self {
                    $(Kernel::$variant(k) => k.run_on_cpu(cpu, scalars, memory),)*
                }
            }
        }

        impl RunOnCuda for Kernel {
            fn run_on_cuda(
                &self,
                scalars: &Scalars,
                device: &TrustedDevice<'_>,
            ) -> Result<(), KernelError> {
                match self {
                    $(Kernel::$variant(k) => k.run_on_cuda(scalars, device),)*
                }
            }
        }

        /// Every kernel's `.cu` file, in the registry's order (a family's once per
        /// kernel).
        const SOURCES: &[CudaSource] = &[$(<$kernel as CudaKernel>::SOURCE,)*];

        /// Every kernel's entry points, in the registry's order.
        const ENTRIES: &[&[Entry]] = &[$(<$kernel as CudaKernel>::ENTRIES,)*];

        /// Every kernel's samples for the tests, at odd and empty sizes.
        #[cfg(test)]
        pub(crate) fn samples(
            w: crate::program::Dtype,
            l: &mut crate::cuda::launch::tests::Layout,
        ) -> Vec<Kernel> {
            use crate::cuda::launch::tests::Emulated;
            let mut out = Vec::new();
            $(out.extend(<$kernel as Emulated>::samples(w, l).into_iter().map(Kernel::$variant));)*
            out
        }

        /// Executes the f32 entry point `name` on `memory` where some kernel emulates it.
        #[cfg(test)]
        pub(crate) fn emulate(
            name: &str,
            args: &[crate::cuda::launch::Arg],
            memory: &crate::cuda::launch::tests::Emulator,
        ) -> bool {
            use crate::cuda::launch::tests::Emulated;
            false $(|| <$kernel as Emulated>::emulate(name, args, memory))*
        }

        #[cfg(test)]
        impl Kernel {
            /// [`Emulated::dimensions`](crate::cuda::launch::tests::Emulated::dimensions).
            pub(crate) fn dimensions(&self) -> Vec<(&'static str, usize)> {
                use crate::cuda::launch::tests::Emulated;
                match self {
                    $(Kernel::$variant(k) => k.dimensions(),)*
                }
            }

            /// [`Emulated::floats`](crate::cuda::launch::tests::Emulated::floats).
            pub(crate) fn floats(&self, scalars: &Scalars) -> Vec<(&'static str, f32)> {
                use crate::cuda::launch::tests::Emulated;
                match self {
                    $(Kernel::$variant(k) => k.floats(scalars),)*
                }
            }

            /// [`Emulated::scratch_regions`](crate::cuda::launch::tests::Emulated::scratch_regions).
            pub(crate) fn scratch_regions(&self) -> Vec<(&'static str, usize, usize)> {
                use crate::cuda::launch::tests::Emulated;
                match self {
                    $(Kernel::$variant(k) => k.scratch_regions(),)*
                }
            }

            /// [`Emulated::accepted`](crate::cuda::launch::tests::Emulated::accepted).
            pub(crate) fn accepted(
                &self,
                entry: &str,
                param: &str,
            ) -> Option<&'static [&'static str]> {
                use crate::cuda::launch::tests::Emulated;
                match self {
                    $(Kernel::$variant(_) => <$kernel as Emulated>::accepted(entry, param),)*
                }
            }
        }
    };
}

registry! {
    /// `t = 0` ([`Zero`]).
    Zero(Zero),
    /// `dst = src` ([`CopyKernel`]).
    Copy(CopyKernel),
    /// `dst += src` in f32 ([`AddF32`]).
    AddF32(AddF32),
    /// The fold of a reduce-scatter ([`FoldRanks`]).
    FoldRanks(FoldRanks),
    /// Token and position embedding ([`Encoder`]).
    Encoder(Encoder),
    /// Its gradient ([`EncoderBackward`]).
    EncoderBackward(EncoderBackward),
    /// LayerNorm ([`LayerNorm`]).
    LayerNorm(LayerNorm),
    /// Its gradient ([`LayerNormBackward`]).
    LayerNormBackward(LayerNormBackward),
    /// A linear layer ([`Matmul`]).
    Matmul(Matmul),
    /// Its gradient ([`MatmulBackward`]).
    MatmulBackward(MatmulBackward),
    /// GPT-2's causal self-attention ([`Attention`]).
    Attention(Attention),
    /// Its gradient ([`AttentionBackward`]).
    AttentionBackward(AttentionBackward),
    /// GPT-2's fused attention, O(T) memory ([`FlashAttention`]).
    FlashAttention(FlashAttention),
    /// Its gradient ([`FlashAttentionBackward`]).
    FlashAttentionBackward(FlashAttentionBackward),
    /// GELU ([`Gelu`]).
    Gelu(Gelu),
    /// Its gradient ([`GeluBackward`]).
    GeluBackward(GeluBackward),
    /// `out = a + b` ([`Residual`]).
    Residual(Residual),
    /// `out = a * b` ([`Mul`]).
    Mul(Mul),
    /// `dst += factor * src` ([`AddScaled`]).
    AddScaled(AddScaled),
    /// Softmax cross-entropy ([`CrossEntropy`]).
    CrossEntropy(CrossEntropy),
    /// Its gradient, in place ([`CrossEntropyBackward`]).
    CrossEntropyBackward(CrossEntropyBackward),
    /// RMSNorm ([`RmsNorm`]).
    RmsNorm(RmsNorm),
    /// Its gradient ([`RmsNormBackward`]).
    RmsNormBackward(RmsNormBackward),
    /// Rotary position embeddings ([`Rope`]).
    Rope(Rope),
    /// Their gradient ([`RopeBackward`]).
    RopeBackward(RopeBackward),
    /// The rotary table ([`RopeTable`]).
    RopeTable(RopeTable),
    /// The SwiGLU gate ([`SwiGlu`]).
    SwiGlu(SwiGlu),
    /// Its gradient ([`SwiGluBackward`]).
    SwiGluBackward(SwiGluBackward),
    /// Grouped-query attention ([`GqaAttention`]).
    GqaAttention(GqaAttention),
    /// Its gradient ([`GqaAttentionBackward`]).
    GqaAttentionBackward(GqaAttentionBackward),
    /// Fused grouped-query attention, O(T) memory ([`GqaFlashAttention`]).
    GqaFlashAttention(GqaFlashAttention),
    /// Its gradient ([`GqaFlashAttentionBackward`]).
    GqaFlashAttentionBackward(GqaFlashAttentionBackward),
    /// Each token's document's first position ([`DocStarts`]).
    DocStarts(DocStarts),
    /// The gradients' sum of squares and non-finite flag ([`GradStatsKernel`]).
    GradStats(GradStatsKernel),
    /// One AdamW step over one tensor ([`AdamWKernel`]).
    AdamW(AdamWKernel),
    /// `x *= factor` in f32 ([`Scale`]).
    Scale(Scale),
    /// An NF4 weight dequantised into the working type ([`Nf4Dequantize`]).
    Nf4Dequantize(Nf4Dequantize),
    /// An int8 weight dequantised into the working type ([`Int8Dequantize`]).
    Int8Dequantize(Int8Dequantize),
    /// f32 rounded to bf16's precision in place ([`RoundBf16`]).
    RoundBf16(RoundBf16),
    /// GELU that also saves its input's few-bit codes ([`FewBitGelu`]).
    FewBitGelu(FewBitGelu),
    /// Its gradient from the codes ([`FewBitGeluBackward`]).
    FewBitGeluBackward(FewBitGeluBackward),
    /// The SwiGLU gate that also saves the gate's few-bit codes ([`FewBitSwiGlu`]).
    FewBitSwiGlu(FewBitSwiGlu),
    /// Its gradient from the codes ([`FewBitSwiGluBackward`]).
    FewBitSwiGluBackward(FewBitSwiGluBackward),
    /// The forward's projection of randomized weight gradients ([`SketchProject`]).
    SketchProject(SketchProject),
    /// Their weight gradient ([`SketchWeightGrad`]).
    SketchWeightGrad(SketchWeightGrad),
}

impl Kernel {
    /// Calls `f` with every tensor the kernel touches and how (written tensors once, as
    /// written, even when also read).
    pub fn for_each_tensor(&self, mut f: impl FnMut(&TensorRef, Access)) {
        self.params(&mut |p| f(p.tensor, p.access));
    }
}

/// The total FLOPs of a list of kernels (see [`Kernel::flops`]).
pub fn program_flops(kernels: &[Kernel]) -> f64 {
    kernels.iter().map(Kernel::flops).sum()
}

/// The `.cu` files of the registry's kernels, each once, in the registry's order.
pub(crate) fn cuda_sources() -> Vec<CudaSource> {
    let mut out: Vec<CudaSource> = Vec::new();
    for &source in SOURCES {
        if !out.iter().any(|s| s.0 == source.0) {
            out.push(source);
        }
    }
    out
}

/// The entry points the registry's kernels launch, each once, in the registry's order.
pub(crate) fn cuda_entries() -> Vec<Entry> {
    let mut out: Vec<Entry> = Vec::new();
    for &entry in ENTRIES.iter().flat_map(|e| e.iter()) {
        if !out.contains(&entry) {
            out.push(entry);
        }
    }
    out
}
