//! Running kernels on the CPU: [`run_cpu`] checks a kernel against its signature
//! ([`super::signature::check`]), makes views of its tensors ([`CpuTensors`]) and calls
//! the kernel's CPU op ([`CpuKernel`]) with them.
//!
//! The `unsafe` of turning a caller's addresses into slices is all here: [`run_cpu`]'s
//! caller promises what the addresses are ([`TrustedMemory`] carries that promise to the
//! dispatch), and [`CpuTensors`] hands each written tensor out once, so the kernels' CPU
//! code, in their families, is safe Rust over slices. Not here: the kernels themselves.

use std::cell::Cell;
use std::marker::PhantomData;

use half::{bf16, f16};

use super::error::KernelError;
use super::scalars::Scalars;
use super::signature::{Param, Signature, check};
use super::tensor::{Access, Dtype, Target, TensorRef};
use crate::ops::Cpu;

/// Resolves tensors to memory for [`run_cpu`].
pub trait CpuMemory {
    /// The address of `t`'s first byte.
    fn address(&self, t: &TensorRef) -> *mut u8;
}

/// A [`CpuMemory`] whose caller promised what [`run_cpu`] requires of it, for the one
/// kernel it runs. Made only by [`run_cpu`], so the dispatch from a program's
/// [`Kernel`](crate::kernel::Kernel) to the kernel's CPU op needs no `unsafe`.
pub struct TrustedMemory<'m> {
    memory: &'m dyn CpuMemory,
}

/// A kernel's CPU op: what [`run_cpu`] calls, once the kernel is checked, with the shape
/// [`super::signature::check`] returned and views of the kernel's tensors.
pub trait CpuKernel: Signature {
    /// Runs the kernel on `cpu`'s instruction set and threads.
    fn run_cpu(
        &self,
        shape: &Self::Shape,
        cpu: &Cpu,
        scalars: &Scalars,
        tensors: &CpuTensors<'_>,
    ) -> Result<(), KernelError>;
}

/// What [`run_cpu`] runs: a program's [`Kernel`](crate::kernel::Kernel) (which dispatches
/// to its kernel), or any one kernel.
pub trait RunOnCpu {
    /// Checks the kernel and runs it with views of `memory`.
    fn run_on_cpu(
        &self,
        cpu: &Cpu,
        scalars: &Scalars,
        memory: &TrustedMemory<'_>,
    ) -> Result<(), KernelError>;
}

impl<K: CpuKernel> RunOnCpu for K {
    fn run_on_cpu(
        &self,
        cpu: &Cpu,
        scalars: &Scalars,
        memory: &TrustedMemory<'_>,
    ) -> Result<(), KernelError> {
        let checked = check(self, Target::Cpu)?;
        let tensors = CpuTensors::new(self, memory)?;
        self.run_cpu(&checked.shape, cpu, scalars, &tensors)
    }
}

/// Runs `kernel` on the CPU with `cpu`'s instruction set and threads. Dtypes and lengths
/// are checked against its signature, and addresses against their dtypes' alignment,
/// before anything is read or written.
///
/// # Safety
/// For every tensor of the kernel ([`Kernel::for_each_tensor`](crate::kernel::Kernel::for_each_tensor)),
/// `memory.address` must return a pointer valid for reads (and, for written tensors,
/// writes) of [`TensorRef::bytes`] bytes, and nothing else may read a written tensor's
/// bytes or write any tensor's bytes while this runs. Written tensors must not overlap
/// any other tensor of the kernel.
pub unsafe fn run_cpu<K: RunOnCpu + ?Sized>(
    kernel: &K,
    cpu: &Cpu,
    scalars: &Scalars,
    memory: &dyn CpuMemory,
) -> Result<(), KernelError> {
    let memory = TrustedMemory { memory };
    kernel.run_on_cpu(cpu, scalars, &memory)
}

/// The most tensors a kernel has (grouped-query attention's backward has nine).
const MAX_TENSORS: usize = 12;

/// One tensor of the kernel being run, at its address.
struct View {
    tensor: TensorRef,
    ptr: *mut u8,
    written: bool,
    /// Whether a written tensor has been handed out (each is, at most once).
    taken: Cell<bool>,
}

/// Views of one kernel's tensors as slices, for its CPU op: each read tensor as often as
/// asked, each written tensor once (as a mutable slice, or a shared one), so no two
/// views alias a written tensor. A tensor is found by its value, as the kernel's own
/// field gives it.
pub struct CpuTensors<'m> {
    views: [Option<View>; MAX_TENSORS],
    _memory: PhantomData<&'m mut [u8]>,
}

impl<'m> CpuTensors<'m> {
    /// Views of `kernel`'s tensors in `memory`; an error if a tensor's address is not a
    /// multiple of its alignment ([`Param::align_bytes`]).
    fn new<K: Signature + ?Sized>(
        kernel: &K,
        memory: &TrustedMemory<'m>,
    ) -> Result<Self, KernelError> {
        let mut views: [Option<View>; MAX_TENSORS] = Default::default();
        let (mut count, mut result) = (0, Ok(()));
        kernel.params(&mut |p: Param<'_>| {
            assert!(
                count < MAX_TENSORS,
                "{}: more than {MAX_TENSORS} tensors",
                K::NAME
            );
            let ptr = memory.memory.address(p.tensor);
            let align = p.align_bytes();
            if result.is_ok() && !(ptr as usize).is_multiple_of(align) {
                result = Err(KernelError::Misaligned {
                    kernel: K::NAME,
                    what: p.name,
                    address: ptr as u64,
                    align,
                });
            }
            views[count] = Some(View {
                tensor: *p.tensor,
                ptr,
                written: p.access == Access::Write,
                taken: Cell::new(false),
            });
            count += 1;
        });
        result.map(|()| CpuTensors {
            views,
            _memory: PhantomData,
        })
    }

    /// The address of `t`, handed out: panics if `t` is not one of the kernel's tensors,
    /// if a written tensor is asked for twice, or a read one for writing.
    fn take(&self, t: &TensorRef, for_writing: bool) -> *mut u8 {
        let view = self
            .views
            .iter()
            .flatten()
            .find(|v| v.tensor == *t)
            .unwrap_or_else(|| panic!("{t:?} is not a tensor of this kernel"));
        if view.written {
            assert!(!view.taken.replace(true), "{t:?} is viewed twice");
        } else {
            assert!(!for_writing, "{t:?} is read-only for this kernel");
        }
        view.ptr
    }

    /// `len` elements of `T` at `t`'s address, checked for alignment.
    fn slice<T>(&self, t: &TensorRef, len: usize) -> &'m [T] {
        let ptr = self.take(t, false).cast::<T>();
        if len == 0 {
            return &[];
        }
        assert!(ptr.is_aligned(), "{t:?} is not aligned for its elements");
        // SAFETY: `run_cpu`'s caller promised `t`'s bytes readable for the run, and
        // written by nothing else; `len` elements of `T` lie inside them (checked by the
        // callers below) at an aligned address (checked above); a written tensor is
        // handed out once, so no mutable view of these bytes exists.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }

    /// As [`Self::slice`], mutable: `t` must be written by the kernel.
    fn slice_mut<T>(&self, t: &TensorRef, len: usize) -> &'m mut [T] {
        let ptr = self.take(t, true).cast::<T>();
        if len == 0 {
            return &mut [];
        }
        assert!(ptr.is_aligned(), "{t:?} is not aligned for its elements");
        // SAFETY: as in `slice`; `t` is written by the kernel, so it overlaps no other
        // tensor of it (`run_cpu`'s contract), and is handed out once (`take`), so this
        // is the only view of its bytes.
        unsafe { std::slice::from_raw_parts_mut(ptr, len) }
    }

    /// `t`'s elements, of `T` (dtype `dtype`).
    fn typed<T>(&self, t: &TensorRef, dtype: Dtype) -> &'m [T] {
        assert_eq!(
            t.dtype, dtype,
            "{t:?}: the kernel's check let a dtype through"
        );
        self.slice(t, t.len)
    }

    /// `t`'s elements, of `T` (dtype `dtype`), mutable.
    fn typed_mut<T>(&self, t: &TensorRef, dtype: Dtype) -> &'m mut [T] {
        assert_eq!(
            t.dtype, dtype,
            "{t:?}: the kernel's check let a dtype through"
        );
        self.slice_mut(t, t.len)
    }

    /// An f32 tensor.
    pub fn f32(&self, t: &TensorRef) -> &'m [f32] {
        self.typed(t, Dtype::F32)
    }

    /// An f32 tensor the kernel writes.
    pub fn f32_mut(&self, t: &TensorRef) -> &'m mut [f32] {
        self.typed_mut(t, Dtype::F32)
    }

    /// A u32 tensor (token ids).
    pub fn u32(&self, t: &TensorRef) -> &'m [u32] {
        self.typed(t, Dtype::U32)
    }

    /// A u32 tensor the kernel writes.
    pub fn u32_mut(&self, t: &TensorRef) -> &'m mut [u32] {
        self.typed_mut(t, Dtype::U32)
    }

    /// A bf16 tensor the kernel writes.
    pub fn bf16_mut(&self, t: &TensorRef) -> &'m mut [bf16] {
        self.typed_mut(t, Dtype::Bf16)
    }

    /// An f16 tensor the kernel writes.
    pub fn f16_mut(&self, t: &TensorRef) -> &'m mut [f16] {
        self.typed_mut(t, Dtype::F16)
    }

    /// The bytes of a tensor of any dtype.
    pub fn bytes(&self, t: &TensorRef) -> &'m [u8] {
        self.slice(t, t.bytes())
    }

    /// The bytes of a tensor of any dtype the kernel writes.
    pub fn bytes_mut(&self, t: &TensorRef) -> &'m mut [u8] {
        self.slice_mut(t, t.bytes())
    }

    /// The first `len` f32 of scratch the kernel writes (any dtype; its byte rule has
    /// checked its size and alignment).
    pub fn f32_scratch(&self, t: &TensorRef, len: usize) -> &'m mut [f32] {
        assert!(len * 4 <= t.bytes(), "{t:?} holds fewer than {len} f32");
        self.slice_mut(t, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::{FoldRanks, Gelu, Kernel, Matmul};
    use crate::ops::{self, WeightLayout};

    /// Memory for tests: one f32 vector per binding.
    struct Buffers(Vec<Vec<f32>>);

    impl CpuMemory for Buffers {
        fn address(&self, t: &TensorRef) -> *mut u8 {
            let buf = &self.0[t.buf as usize];
            assert!(t.offset_bytes + t.bytes() <= buf.len() * 4);
            // SAFETY: inside the vector (checked above).
            unsafe { buf.as_ptr().cast::<u8>().cast_mut().add(t.offset_bytes) }
        }
    }

    #[test]
    fn a_matmul_over_bound_tensors_equals_the_direct_call() {
        let (n, c, oc) = (3, 5, 4);
        let inp: Vec<f32> = (0..n * c).map(|i| i as f32 * 0.1 - 0.7).collect();
        // One buffer holding weight then bias, as a block's parameters do.
        let mut params: Vec<f32> = (0..c * oc).map(|i| (i as f32 * 0.37).sin()).collect();
        params.extend((0..oc).map(|i| i as f32));
        let mem = Buffers(vec![vec![0.0; n * oc], inp.clone(), params.clone()]);
        let k = Kernel::Matmul(Matmul {
            out: TensorRef::new(0, 0, n * oc, Dtype::F32),
            inp: TensorRef::new(1, 0, n * c, Dtype::F32),
            weight: TensorRef::new(2, 0, c * oc, Dtype::F32),
            bias: Some(TensorRef::new(2, c * oc * 4, oc, Dtype::F32)),
            layout: WeightLayout::InOut,
            n,
            c,
            oc,
        });
        let cpu = Cpu::default();
        // SAFETY: every tensor lies inside its vector; nothing else touches them.
        unsafe { run_cpu(&k, &cpu, &Scalars::default(), &mem) }.unwrap();
        let mut want = vec![0.0; n * oc];
        ops::matmul_forward(
            &cpu,
            &mut want,
            &inp,
            &params[..c * oc],
            Some(&params[c * oc..]),
            WeightLayout::InOut,
            n,
            c,
            oc,
        );
        assert_eq!(mem.0[0], want);
        assert!(k.flops() > 0.0);
        let mut written = 0;
        k.for_each_tensor(|_, a| written += usize::from(a == Access::Write));
        assert_eq!(written, 1);
    }

    #[test]
    fn fold_ranks_is_the_left_fold_in_rank_order() {
        // Values whose sum depends on the order: 1e8 + 1 + -1e8 is 0 from the left.
        let chunks = vec![1e8, -0.0, 1.0, -0.0, -1e8, -0.0];
        for (accumulate, start, want) in [
            (false, 5.0, [0.0f32, -0.0]),
            (true, 5.0, [((5.0f32 + 1e8) + 1.0) + -1e8, 5.0]),
        ] {
            let mem = Buffers(vec![vec![start; 2], chunks.clone()]);
            let k = Kernel::FoldRanks(FoldRanks {
                acc: TensorRef::new(0, 0, 2, Dtype::F32),
                chunks: TensorRef::new(1, 0, 6, Dtype::F32),
                ranks: 3,
                accumulate,
            });
            // SAFETY: inside the vectors.
            unsafe { run_cpu(&k, &Cpu::default(), &Scalars::default(), &mem) }.unwrap();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            // Without accumulate -0.0 survives (a start of +0.0 would make it +0.0).
            assert_eq!(bits(&mem.0[0]), bits(&want), "accumulate {accumulate}");
        }
    }

    #[test]
    fn a_wrong_dtype_is_an_error_naming_the_tensor() {
        let mem = Buffers(vec![vec![0.0; 8], vec![0.0; 8]]);
        let k = Kernel::Gelu(Gelu {
            out: TensorRef::new(0, 0, 8, Dtype::Bf16),
            inp: TensorRef::new(1, 0, 8, Dtype::F32),
        });
        // SAFETY: inside the vectors.
        let e = unsafe { run_cpu(&k, &Cpu::default(), &Scalars::default(), &mem) }.unwrap_err();
        assert!(e.to_string().contains("out"), "{e}");
    }
}
