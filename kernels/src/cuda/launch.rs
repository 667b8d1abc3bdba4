//! The runner of programs' kernels on CUDA, apart from the kernels' own launch sequences
//! (each in its family, `crate::kernel::*`, beside its `.cu` file) and the CUDA calls
//! ([`super::ops`]): a kernel is checked against its signature
//! ([`crate::program::signature::check`]), its tensors' device addresses resolved and
//! checked for alignment, and its [`CudaKernel::launch`] then enqueues launches, cuBLAS
//! products, memsets and copies through a [`Launch`], which passes them to a
//! [`KernelQueue`]: [`super::CudaKernels`] on a stream, or the tests' emulator, which
//! records them and checks every argument without a GPU.
//!
//! Every check happens before the first call is enqueued, so a refused kernel enqueues
//! nothing. No kernel allocates: those that need scratch carve the scratch the program
//! hands them ([`Launch::carve`]).
//!
//! The `unsafe` of enqueueing is all here. A kernel launch's memory safety rests on its
//! `.cu` kernel and its launcher agreeing (the arguments in the parameters' order and
//! types; a grid whose accesses stay inside the tensors for the sizes given), which no
//! run-time check can see; what can be checked is, on every call: every pointer a launch
//! is given lies in one of the kernel's tensors or a region carved from its scratch, every
//! product's operands lie inside theirs at their leading dimensions and strides, and the
//! product, memset or copy writes only tensors the kernel writes. The rest is checked by
//! the emulator's tests (`launch/tests.rs`: every launch against the compiled kernels'
//! parameter lists and the `.cu` parameters' names) and on a GPU by `cuda_ops`. So the
//! launchers are safe code, and [`TrustedDevice`] carries the caller's promise about the
//! addresses to them.

use cudarc::cublas::sys::cudaDataType_t;
use cudarc::driver::{DeviceRepr, LaunchConfig};

use super::CudaError;
use crate::adamw::AdamStep;
use crate::program::{Dtype, KernelError, Param, Scalars, Signature, Target, TensorRef, check};

/// A CUDA kernel's `.cu` file: its name (for NVRTC's messages) and its text.
pub type CudaSource = (&'static str, &'static str);

/// An entry point of the compiled program: an `extern "C"` kernel of a `.cu` file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Its name, or its name's stem for a typed one.
    pub name: &'static str,
    /// Whether there is one per working type, `<name>_<suffix>` (f32, bf16, f16).
    pub typed: bool,
}

impl Entry {
    /// An entry point per working type: `<name>_f32`, `<name>_bf16`, `<name>_f16`.
    pub const fn typed(name: &'static str) -> Self {
        Entry { name, typed: true }
    }

    /// One entry point, under its own name.
    pub const fn untyped(name: &'static str) -> Self {
        Entry { name, typed: false }
    }
}

/// A working type of the CUDA kernels (activations and parameters): how its entry points
/// are suffixed and what cuBLAS calls it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Working {
    /// The program's name for it.
    pub dtype: Dtype,
    /// The suffix of its kernels' entry points.
    pub suffix: &'static str,
    /// cuBLAS's name for it.
    pub data_type: cudaDataType_t,
}

/// The working types, in the order of their entry points.
pub const WORKING_TYPES: [Working; 3] = [
    Working {
        dtype: Dtype::F32,
        suffix: "f32",
        data_type: cudaDataType_t::CUDA_R_32F,
    },
    Working {
        dtype: Dtype::Bf16,
        suffix: "bf16",
        data_type: cudaDataType_t::CUDA_R_16BF,
    },
    Working {
        dtype: Dtype::F16,
        suffix: "f16",
        data_type: cudaDataType_t::CUDA_R_16F,
    },
];

impl Working {
    /// The working type of `dtype`, if CUDA computes in it.
    pub fn of(dtype: Dtype) -> Option<Working> {
        WORKING_TYPES.into_iter().find(|w| w.dtype == dtype)
    }
}

/// A kernel argument, as the `.cu` signature declares it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// A pointer (`T*`, `float*`, `void*`, ...): a device address (0 where the kernel
    /// takes none).
    Ptr(u64),
    /// `int`.
    Int(i32),
    /// `long long`.
    Long(i64),
    /// `float`.
    Float(f32),
    /// `AdamConstants` (adamw.cu), by value.
    Adam(AdamConstants),
}

/// The constants of one AdamW step as `adamw_step` (adamw.cu) takes them: nine f32 in the
/// order of its `struct AdamConstants`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConstants {
    grad_scale: f32,
    decay: f32,
    beta1: f32,
    beta2: f32,
    one_minus_beta1: f32,
    one_minus_beta2: f32,
    step_size: f32,
    inv_bias_correction2_sqrt: f32,
    eps: f32,
}

// SAFETY: plain old data, `#[repr(C)]`, laid out exactly as adamw.cu's AdamConstants
// (nine consecutive floats, 4-byte aligned, no padding).
unsafe impl DeviceRepr for AdamConstants {}

impl From<&AdamStep> for AdamConstants {
    fn from(k: &AdamStep) -> Self {
        AdamConstants {
            grad_scale: k.grad_scale,
            decay: k.decay,
            beta1: k.beta1,
            beta2: k.beta2,
            one_minus_beta1: k.one_minus_beta1,
            one_minus_beta2: k.one_minus_beta2,
            step_size: k.step_size,
            inv_bias_correction2_sqrt: k.inv_bias_correction2_sqrt,
            eps: k.eps,
        }
    }
}

/// Threads per block of the one-thread-per-element and one-warp-per-row kernels.
const BLOCK_THREADS: u32 = 256;
/// Threads per block of the one-block-per-row kernels (cross-entropy).
const ROW_BLOCK_THREADS: u32 = 512;

/// `blocks` blocks of `threads` threads.
pub fn grid(blocks: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (u32::try_from(blocks).expect("grid too large"), 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One thread per element.
pub fn per_element(n: usize) -> LaunchConfig {
    grid(n.div_ceil(BLOCK_THREADS as usize).max(1), BLOCK_THREADS)
}

/// One warp per row.
pub fn per_row_warp(rows: usize) -> LaunchConfig {
    per_element(rows * 32)
}

/// One block of (32, 32) threads per 32 columns.
pub fn per_column_tile(columns: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            u32::try_from(columns.div_ceil(32).max(1)).expect("grid too large"),
            1,
            1,
        ),
        block_dim: (32, 32, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row.
pub fn per_row_block(rows: usize) -> LaunchConfig {
    grid(rows.max(1), ROW_BLOCK_THREADS)
}

/// A dimension as the kernels' `int`.
pub fn int(n: usize) -> Arg {
    Arg::Int(i32::try_from(n).expect("dimension beyond 2^31 - 1"))
}

/// An element count as the kernels' `long long`.
pub fn long(n: usize) -> Arg {
    Arg::Long(i64::try_from(n).expect("count beyond 2^63 - 1"))
}

/// A matrix operand of a cuBLAS call: device address, type, leading dimension, and
/// whether it is used transposed.
#[derive(Debug, Clone, Copy)]
pub struct Operand {
    /// Its first element's device address.
    pub ptr: u64,
    /// Its element type.
    pub data_type: cudaDataType_t,
    /// Its leading dimension, in elements.
    pub ld: usize,
    /// Whether the product reads it transposed.
    pub transposed: bool,
}

impl Operand {
    /// An operand of the working type `w`.
    pub fn of(w: Working, ptr: u64, ld: usize, transposed: bool) -> Self {
        Operand {
            ptr,
            data_type: w.data_type,
            ld,
            transposed,
        }
    }

    /// An f32 operand (attention's scores, parameter gradients).
    pub fn f32(ptr: u64, ld: usize, transposed: bool) -> Self {
        Operand {
            ptr,
            data_type: cudaDataType_t::CUDA_R_32F,
            ld,
            transposed,
        }
    }

    /// Bytes of its elements.
    fn element_bytes(&self) -> usize {
        match self.data_type {
            cudaDataType_t::CUDA_R_16BF | cudaDataType_t::CUDA_R_16F => 2,
            _ => 4,
        }
    }

    /// The byte range it spans as a `rows × cols` matrix as stored (before any
    /// transpose), `count` times at `stride` elements apart.
    fn span(&self, rows: usize, cols: usize, count: usize, stride: usize) -> (u64, u64) {
        let (rows, cols) = if self.transposed {
            (cols, rows)
        } else {
            (rows, cols)
        };
        assert!(
            self.ld >= rows.max(1),
            "leading dimension {} below {rows} rows",
            self.ld
        );
        let elements = (count - 1) * stride + (cols - 1) * self.ld + rows;
        (
            self.ptr,
            self.ptr + (elements * self.element_bytes()) as u64,
        )
    }
}

/// One cuBLAS product, `C (m × n) = alpha op(A) op(B) + beta C` (column-major, fp32
/// compute), batched over `(count, stride_a, stride_b, stride_c)` (element strides) when
/// `batch` is set.
#[derive(Debug, Clone, Copy)]
pub struct Gemm {
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// Terms of each sum.
    pub k: usize,
    /// The left operand, m × k after its op.
    pub a: Operand,
    /// The right operand, k × n after its op.
    pub b: Operand,
    /// The result, m × n, never transposed.
    pub c: Operand,
    /// The product's factor.
    pub alpha: f32,
    /// C's factor (0: C is not read).
    pub beta: f32,
    /// `(count, stride_a, stride_b, stride_c)`, element strides, for a batched product.
    pub batch: Option<(usize, usize, usize, usize)>,
}

/// Where a kernel's work is enqueued: four primitives.
pub trait KernelQueue {
    /// Enqueues the kernel `<name>_<suffix>` (`name` alone when `suffix` is empty) with
    /// `args`.
    ///
    /// # Safety
    /// `args` are the kernel's parameters in order and type (`Ptr` for pointers, `Int`
    /// for `int`, `Long` for `long long`, `Float` for `float`, `Adam` for
    /// `AdamConstants`), and with `config` every access the kernel makes stays inside
    /// the tensors they address.
    unsafe fn launch(
        &self,
        name: &'static str,
        suffix: &'static str,
        config: LaunchConfig,
        args: &[Arg],
    ) -> Result<(), CudaError>;

    /// Enqueues one cuBLAS product; every dimension is at least 1.
    ///
    /// # Safety
    /// Every operand's pointer, leading dimension and (when batched) stride address
    /// memory inside its tensor for the whole product, and C overlaps neither A nor B.
    unsafe fn gemm_raw(&self, gemm: &Gemm) -> Result<(), CudaError>;

    /// Enqueues setting `bytes` bytes at `ptr` to zero.
    ///
    /// # Safety
    /// `ptr` addresses at least `bytes` bytes of device memory in the queue's context.
    unsafe fn zero(&self, ptr: u64, bytes: usize) -> Result<(), CudaError>;

    /// Enqueues copying `bytes` bytes from `src` to `dst`.
    ///
    /// # Safety
    /// Both address at least `bytes` bytes of device memory in the queue's context, and
    /// the ranges do not overlap.
    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError>;
}

/// A queue and the device addresses of a kernel's tensors, with the promise
/// [`super::CudaKernels::run`] asks of its caller: made only through [`TrustedDevice::new`],
/// so that the dispatch from a program's kernel to its launcher needs no `unsafe`.
pub struct TrustedDevice<'a> {
    queue: &'a dyn KernelQueue,
    address: &'a dyn Fn(&TensorRef) -> u64,
}

impl<'a> TrustedDevice<'a> {
    /// `queue`, with `address` giving each tensor's device address.
    ///
    /// # Safety
    /// As for [`super::CudaKernels::run`], for every kernel run with it: `address` gives
    /// each tensor of the kernel [`TensorRef::bytes`] bytes of device memory in the
    /// queue's context that stay allocated until the enqueued work has finished, that
    /// nothing else reads (if written) or writes until then, and written tensors overlap
    /// no other tensor of the kernel.
    pub unsafe fn new(queue: &'a dyn KernelQueue, address: &'a dyn Fn(&TensorRef) -> u64) -> Self {
        TrustedDevice { queue, address }
    }
}

/// A kernel's CUDA launch sequence, in its family beside its `.cu` file.
pub trait CudaKernel: Signature {
    /// Its family's `.cu` file.
    const SOURCE: CudaSource;

    /// The entry points it launches (from [`Self::SOURCE`]).
    const ENTRIES: &'static [Entry];

    /// Enqueues the kernel's work through `q`, the kernel checked to `shape` (its
    /// tensors' dtypes, lengths and alignment).
    fn launch(
        &self,
        shape: &Self::Shape,
        scalars: &Scalars,
        q: &mut Launch<'_>,
    ) -> Result<(), KernelError>;
}

/// What the CUDA runner runs: a program's [`Kernel`](crate::kernel::Kernel) (which
/// dispatches to its kernel), or any one kernel.
pub trait RunOnCuda {
    /// Checks the kernel and enqueues its work on `device`'s queue.
    fn run_on_cuda(&self, scalars: &Scalars, device: &TrustedDevice<'_>)
    -> Result<(), KernelError>;
}

impl<K: CudaKernel> RunOnCuda for K {
    fn run_on_cuda(
        &self,
        scalars: &Scalars,
        device: &TrustedDevice<'_>,
    ) -> Result<(), KernelError> {
        let checked = check(self, Target::Cuda)?;
        let working = checked.working.and_then(Working::of);
        let mut q = Launch::new(self, working, device)?;
        self.launch(&checked.shape, scalars, &mut q)
    }
}

/// The most regions a kernel's calls may address: its tensors and its scratch's regions
/// (attention's scratch has nine).
const MAX_REGIONS: usize = 24;

/// A byte range of device memory a kernel's calls may address.
#[derive(Debug, Clone, Copy, Default)]
struct Region {
    start: u64,
    end: u64,
    written: bool,
}

impl Region {
    /// Whether `start..end` lies inside.
    fn holds(&self, start: u64, end: u64) -> bool {
        self.start <= start && end <= self.end
    }
}

/// One kernel's enqueueing: its tensors' device addresses (checked for alignment), the
/// regions carved from its scratch, its working type, and the queue. Each call checks
/// what it addresses against those regions before it is enqueued.
pub struct Launch<'a> {
    kernel: &'static str,
    device: &'a TrustedDevice<'a>,
    working: Option<Working>,
    regions: [Region; MAX_REGIONS],
    count: usize,
}

impl<'a> Launch<'a> {
    /// `kernel`'s tensors at their addresses on `device`; an error if one is not a
    /// multiple of its alignment ([`Param::align_bytes`]).
    fn new<K: Signature + ?Sized>(
        kernel: &K,
        working: Option<Working>,
        device: &'a TrustedDevice<'a>,
    ) -> Result<Self, KernelError> {
        let mut q = Launch {
            kernel: K::NAME,
            device,
            working,
            regions: [Region::default(); MAX_REGIONS],
            count: 0,
        };
        let mut result = Ok(());
        kernel.params(&mut |p: Param<'_>| {
            let start = (device.address)(p.tensor);
            let align = p.align_bytes();
            if result.is_ok() && !start.is_multiple_of(align as u64) {
                result = Err(KernelError::Misaligned {
                    kernel: K::NAME,
                    what: p.name,
                    address: start,
                    align,
                });
            }
            let end = start + p.tensor.bytes() as u64;
            q.add(Region {
                start,
                end,
                written: p.access == crate::program::Access::Write,
            });
        });
        result.map(|()| q)
    }

    fn add(&mut self, region: Region) {
        assert!(
            self.count < MAX_REGIONS,
            "{}: too many regions",
            self.kernel
        );
        self.regions[self.count] = region;
        self.count += 1;
    }

    fn regions(&self) -> &[Region] {
        &self.regions[..self.count]
    }

    /// Whether `start..end` lies in one region (a written one, with `written`).
    fn inside(&self, start: u64, end: u64, written: bool) -> bool {
        self.regions()
            .iter()
            .any(|r| r.holds(start, end) && (r.written || !written))
    }

    /// The kernel's working type; panics for a kernel without one.
    pub fn working(&self) -> Working {
        self.working
            .unwrap_or_else(|| panic!("{} has no working type", self.kernel))
    }

    /// The device address of `t`, a tensor of the kernel.
    pub fn address(&self, t: &TensorRef) -> u64 {
        (self.device.address)(t)
    }

    /// `t`'s address as a pointer argument.
    pub fn ptr(&self, t: &TensorRef) -> Arg {
        Arg::Ptr(self.address(t))
    }

    /// The address `offset_bytes` into `scratch` (a tensor the kernel writes), where a
    /// region of `len_bytes` starts that the kernel's calls may then address.
    pub fn carve(&mut self, scratch: &TensorRef, offset_bytes: usize, len_bytes: usize) -> u64 {
        let start = self.address(scratch) + offset_bytes as u64;
        let end = start + len_bytes as u64;
        assert!(
            self.inside(start, end, true),
            "{}: a region of {len_bytes} bytes at {offset_bytes} outside its scratch",
            self.kernel
        );
        self.add(Region {
            start,
            end,
            written: true,
        });
        start
    }

    /// Enqueues `entry` (in the kernel's working type when typed) with `args`, each
    /// pointer checked to lie in one of the kernel's regions (or to be 0).
    pub fn launch(
        &self,
        entry: Entry,
        config: LaunchConfig,
        args: &[Arg],
    ) -> Result<(), CudaError> {
        for arg in args {
            if let Arg::Ptr(ptr) = *arg {
                assert!(
                    ptr == 0 || self.inside(ptr, ptr, false),
                    "{}: {} is given {ptr:#x}, outside the kernel's tensors",
                    self.kernel,
                    entry.name
                );
            }
        }
        let suffix = if entry.typed {
            self.working().suffix
        } else {
            ""
        };
        // SAFETY: the pointers lie in the kernel's tensors, which `TrustedDevice`'s maker
        // promised are device memory this queue may use; that the arguments are the
        // entry's parameters and its accesses stay inside them for these sizes is the
        // contract of the kernel's launcher and `.cu` file (see the module's comment).
        unsafe { self.device.queue.launch(entry.name, suffix, config, args) }
    }

    /// `C (m × n) = alpha op(A) op(B) + beta C`, column-major, fp32 compute, optionally
    /// batched with element strides (a, b, c). Nothing when m or n (or the batch) is 0;
    /// `k` must not be. Each operand is checked to lie inside one of the kernel's regions,
    /// C inside a written one.
    pub fn gemm(&self, g: Gemm) -> Result<(), CudaError> {
        let (count, sa, sb, sc) = g.batch.unwrap_or((1, 0, 0, 0));
        if g.m == 0 || g.n == 0 || count == 0 {
            return Ok(());
        }
        assert!(g.k > 0, "{}: a product over no terms", self.kernel);
        assert!(!g.c.transposed, "{}: C transposed", self.kernel);
        let a = g.a.span(g.m, g.k, count, sa);
        let b = g.b.span(g.k, g.n, count, sb);
        let c = g.c.span(g.m, g.n, count, sc);
        for (name, (start, end), written) in [("A", a, false), ("B", b, false), ("C", c, true)] {
            assert!(
                self.inside(start, end, written),
                "{}: operand {name} of {g:?} outside the kernel's tensors",
                self.kernel
            );
        }
        let apart = |x: (u64, u64), y: (u64, u64)| x.1 <= y.0 || y.1 <= x.0;
        assert!(
            apart(c, a) && apart(c, b),
            "{}: C overlaps an input of {g:?}",
            self.kernel
        );
        // SAFETY: every operand lies inside the kernel's tensors (checked above), C in a
        // written one and apart from A and B; `TrustedDevice`'s maker promised them.
        unsafe { self.device.queue.gemm_raw(&g) }
    }

    /// Enqueues zeroing `bytes` bytes at `ptr`, inside a tensor the kernel writes.
    pub fn zero(&self, ptr: u64, bytes: usize) -> Result<(), CudaError> {
        let end = ptr + bytes as u64;
        assert!(
            self.inside(ptr, end, true),
            "{}: zeroing outside",
            self.kernel
        );
        // SAFETY: inside a written tensor of the kernel (checked above).
        unsafe { self.device.queue.zero(ptr, bytes) }
    }

    /// Enqueues copying `bytes` bytes from `src` to `dst`, inside tensors of the kernel
    /// (`dst` a written one).
    pub fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        let (dst_end, src_end) = (dst + bytes as u64, src + bytes as u64);
        assert!(
            self.inside(dst, dst_end, true) && self.inside(src, src_end, false),
            "{}: copying outside",
            self.kernel
        );
        assert!(
            dst_end <= src || src_end <= dst,
            "{}: overlapping copy",
            self.kernel
        );
        // SAFETY: both inside tensors of the kernel, not overlapping (checked above).
        unsafe { self.device.queue.copy(dst, src, bytes) }
    }
}

#[cfg(test)]
pub(crate) mod tests;
