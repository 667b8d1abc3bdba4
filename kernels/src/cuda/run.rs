//! The runner of programs on CUDA, apart from the CUDA calls themselves: for each
//! [`Kernel`], the checks of its tensors against its shape (dtype, length, alignment) and
//! the sequence of kernel launches, cuBLAS products, memsets and copies that computes it,
//! enqueued through a [`KernelQueue`]. [`super::CudaKernels`] is the queue that runs them
//! on a stream; this module's tests use one that records them, to check every launch's
//! arguments against the compiled kernels' signatures and every product's operands
//! against the tensors, without a GPU.
//!
//! Every check happens before the first call of a kernel is enqueued, so a refused kernel
//! enqueues nothing. No kernel allocates: attention and the gradient statistics carve the
//! scratch the program hands them ([`attention_scratch_layout`],
//! [`crate::program::grad_stats_scratch_bytes`]).

use cudarc::cublas::sys::cudaDataType_t;
use cudarc::driver::{DeviceRepr, LaunchConfig};
use half::{bf16, f16};

use super::CudaError;
use crate::adamw::AdamStep;
use crate::ops::{Llama3Scaling, WeightLayout};
use crate::program::{
    AttentionScratchLayout, Dtype, GRAD_STATS_THREADS, Kernel, KernelError, Scalars, Target,
    TensorRef, attention_scratch_bytes, attention_scratch_layout, gqa_attention_scratch_bytes,
    gqa_attention_scratch_layout, gqa_dims, grad_stats_blocks, grad_stats_scratch_bytes,
};
use crate::reference::llama::GqaDims;

/// A working type of the CUDA kernels (activations and parameters): `f32`, `bf16` or
/// `f16`.
pub trait CudaFloat: Copy + Send + Sync + 'static {
    /// The suffix of the kernels' names for this type.
    const SUFFIX: &'static str;
    /// cuBLAS's name for this type.
    const DATA_TYPE: cudaDataType_t;
    /// The program's name for this type.
    const DTYPE: Dtype;
}

impl CudaFloat for f32 {
    const SUFFIX: &'static str = "f32";
    const DATA_TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_32F;
    const DTYPE: Dtype = Dtype::F32;
}

impl CudaFloat for bf16 {
    const SUFFIX: &'static str = "bf16";
    const DATA_TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_16BF;
    const DTYPE: Dtype = Dtype::Bf16;
}

impl CudaFloat for f16 {
    const SUFFIX: &'static str = "f16";
    const DATA_TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_16F;
    const DTYPE: Dtype = Dtype::F16;
}

/// A checked tensor on the device: its address and element count.
#[derive(Debug, Clone, Copy)]
pub(super) struct DevTensor {
    /// The device address (`CUdeviceptr`) of its first element.
    ptr: u64,
    /// Elements.
    len: usize,
}

/// A kernel argument, as the `.cu` signature declares it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Arg {
    /// A pointer (`T*`, `float*`, `void*`, ...): a device address.
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
pub(super) struct AdamConstants {
    grad_scale: f32,
    decay: f32,
    beta1: f32,
    beta2: f32,
    one_minus_beta1: f32,
    one_minus_beta2: f32,
    step_size: f32,
    bias_correction2_sqrt: f32,
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
            bias_correction2_sqrt: k.bias_correction2_sqrt,
            eps: k.eps,
        }
    }
}

/// What `adamw_step` writes to its copy-out tensor (adamw.cu's `COPY_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
enum CopyMode {
    None = 0,
    Bf16 = 1,
    F16 = 2,
    F32 = 3,
    F32AsBf16 = 4,
    F32AsF16 = 5,
}

/// Threads per block of the one-thread-per-element and one-warp-per-row kernels.
const BLOCK_THREADS: u32 = 256;
/// Threads per block of the one-block-per-row kernels (cross-entropy).
const ROW_BLOCK_THREADS: u32 = 512;

/// One thread per element.
fn per_element(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK_THREADS as usize).max(1);
    LaunchConfig {
        grid_dim: (u32::try_from(blocks).expect("grid too large"), 1, 1),
        block_dim: (BLOCK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per row.
fn per_row_warp(rows: usize) -> LaunchConfig {
    per_element(rows * 32)
}

/// One block of (32, 32) threads per 32 columns.
fn per_column_tile(columns: usize) -> LaunchConfig {
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
fn per_row_block(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (u32::try_from(rows.max(1)).expect("grid too large"), 1, 1),
        block_dim: (ROW_BLOCK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `blocks` blocks of [`GRAD_STATS_THREADS`] threads (the statistics kernels' size).
fn grad_stats_grid(blocks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (u32::try_from(blocks).expect("grid too large"), 1, 1),
        block_dim: (GRAD_STATS_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A dimension as the kernels' `int`.
fn int(n: usize) -> Arg {
    Arg::Int(i32::try_from(n).expect("dimension beyond 2^31 - 1"))
}

/// An element count as the kernels' `long long`.
fn long(n: usize) -> Arg {
    Arg::Long(i64::try_from(n).expect("count beyond 2^63 - 1"))
}

/// `address + bytes`.
fn offset(address: u64, bytes: usize) -> u64 {
    address + bytes as u64
}

/// A matrix operand of a cuBLAS call: device address, type, leading dimension, and
/// whether it is used transposed.
#[derive(Debug, Clone, Copy)]
pub(super) struct Operand {
    pub(super) ptr: u64,
    pub(super) data_type: cudaDataType_t,
    pub(super) ld: usize,
    pub(super) transposed: bool,
}

/// Resolves a kernel's tensors to device addresses and checks each one's dtype, length
/// and alignment, naming the kernel and tensor in the error.
pub(super) struct Resolve<'a> {
    kernel: &'static str,
    address: &'a dyn Fn(&TensorRef) -> u64,
}

impl Resolve<'_> {
    fn dtype(&self, t: &TensorRef, what: &'static str, dtype: Dtype) -> Result<(), KernelError> {
        if t.dtype == dtype {
            Ok(())
        } else {
            Err(KernelError::Dtype {
                kernel: self.kernel,
                what,
                dtype: t.dtype,
                target: Target::Cuda,
            })
        }
    }

    fn shape(&self, what: &'static str, len: usize, expected: usize) -> KernelError {
        KernelError::Shape {
            kernel: self.kernel,
            what,
            len,
            expected,
        }
    }

    /// The address of `t`, which must be a multiple of `align` bytes.
    fn address(&self, t: &TensorRef, what: &'static str, align: usize) -> Result<u64, KernelError> {
        let address = (self.address)(t);
        if address.is_multiple_of(align as u64) {
            Ok(address)
        } else {
            Err(KernelError::Misaligned {
                kernel: self.kernel,
                what,
                address,
                align,
            })
        }
    }

    /// `t`, of `dtype` and exactly `len` elements.
    fn tensor(
        &self,
        t: &TensorRef,
        what: &'static str,
        dtype: Dtype,
        len: usize,
    ) -> Result<DevTensor, KernelError> {
        self.dtype(t, what, dtype)?;
        if t.len != len {
            return Err(self.shape(what, t.len, len));
        }
        self.resolved(t, what)
    }

    /// `t`, of `dtype` and at least `len` elements.
    fn tensor_at_least(
        &self,
        t: &TensorRef,
        what: &'static str,
        dtype: Dtype,
        len: usize,
    ) -> Result<DevTensor, KernelError> {
        self.dtype(t, what, dtype)?;
        if t.len < len {
            return Err(self.shape(what, t.len, len));
        }
        self.resolved(t, what)
    }

    /// `t`, of `dtype` and a whole number of rows of `c` elements (`c` > 0).
    fn rows_of(
        &self,
        t: &TensorRef,
        what: &'static str,
        dtype: Dtype,
        c: usize,
    ) -> Result<DevTensor, KernelError> {
        self.dtype(t, what, dtype)?;
        if !t.len.is_multiple_of(c) {
            return Err(self.shape(what, t.len, t.len.next_multiple_of(c)));
        }
        self.resolved(t, what)
    }

    /// Scratch (any dtype) of at least `bytes` bytes, starting at a multiple of `align`.
    fn scratch(
        &self,
        t: &TensorRef,
        what: &'static str,
        bytes: usize,
        align: usize,
    ) -> Result<DevTensor, KernelError> {
        if t.bytes() < bytes {
            return Err(self.shape(what, t.bytes(), bytes));
        }
        Ok(DevTensor {
            ptr: self.address(t, what, align)?,
            len: t.bytes(),
        })
    }

    fn resolved(&self, t: &TensorRef, what: &'static str) -> Result<DevTensor, KernelError> {
        Ok(DevTensor {
            ptr: self.address(t, what, t.dtype.size())?,
            len: t.len,
        })
    }
}

/// The tensor whose dtype is a kernel's working type, and its name, for the kernels
/// that have one.
fn working_tensor(kernel: &Kernel) -> Option<(&TensorRef, &'static str)> {
    Some(match kernel {
        Kernel::Encoder { out, .. } => (out, "out"),
        Kernel::EncoderBackward { dout, .. } => (dout, "dout"),
        Kernel::LayerNorm { out, .. } => (out, "out"),
        Kernel::LayerNormBackward { dinp, .. } => (dinp, "dinp"),
        Kernel::Matmul { out, .. } => (out, "out"),
        Kernel::MatmulBackward { dinp, .. } => (dinp, "dinp"),
        Kernel::Attention { out, .. } => (out, "out"),
        Kernel::AttentionBackward { dqkv, .. } => (dqkv, "dqkv"),
        Kernel::Gelu { out, .. } => (out, "out"),
        Kernel::GeluBackward { dinp, .. } => (dinp, "dinp"),
        Kernel::Residual { out, .. } => (out, "out"),
        Kernel::CrossEntropy { logits, .. } => (logits, "logits"),
        Kernel::CrossEntropyBackward { logits, .. } => (logits, "logits"),
        Kernel::RmsNorm { out, .. } => (out, "out"),
        Kernel::RmsNormBackward { dinp, .. } => (dinp, "dinp"),
        Kernel::Rope { out, .. } => (out, "out"),
        Kernel::RopeBackward { dinp, .. } => (dinp, "dinp"),
        Kernel::RopeTable { cos, .. } => (cos, "cos"),
        Kernel::SwiGlu { out, .. } => (out, "out"),
        Kernel::SwiGluBackward { dgate, .. } => (dgate, "dgate"),
        Kernel::GqaAttention { out, .. } => (out, "out"),
        Kernel::GqaAttentionBackward { dq, .. } => (dq, "dq"),
        Kernel::Zero { .. }
        | Kernel::Copy { .. }
        | Kernel::AddF32 { .. }
        | Kernel::FoldRanks { .. }
        | Kernel::GradStats { .. }
        | Kernel::AdamW { .. } => return None,
    })
}

/// One cuBLAS product, `C (m × n) = alpha op(A) op(B) + beta C` (column-major, fp32
/// compute), batched over `(count, stride_a, stride_b, stride_c)` (element strides) when
/// `batch` is set.
#[derive(Debug, Clone, Copy)]
pub(super) struct Gemm {
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) a: Operand,
    pub(super) b: Operand,
    pub(super) c: Operand,
    pub(super) alpha: f32,
    pub(super) beta: f32,
    pub(super) batch: Option<(usize, usize, usize, usize)>,
}

/// Where a kernel's work is enqueued: four primitives, and on top of them (provided
/// methods) the checks and launch sequences of every [`Kernel`].
pub(super) trait KernelQueue {
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

    /// [`super::CudaKernels::run`] on this queue.
    ///
    /// # Safety
    /// As for [`super::CudaKernels::run`].
    unsafe fn run_kernel(
        &self,
        kernel: &Kernel,
        scalars: &Scalars,
        address: &dyn Fn(&TensorRef) -> u64,
    ) -> Result<(), KernelError> {
        let r = Resolve {
            kernel: kernel.name(),
            address,
        };
        match kernel {
            Kernel::Zero { t } => {
                let dev = r.resolved(t, "t")?;
                // SAFETY: the caller's promise: `t` is t.bytes() bytes of device memory.
                unsafe { self.zero(dev.ptr, t.bytes()) }?;
            }
            Kernel::Copy { dst, src } => {
                let src_d = r.tensor(src, "src", dst.dtype, dst.len)?;
                let dst_d = r.resolved(dst, "dst")?;
                if dst.bytes() > 0 {
                    // SAFETY: the caller's promise: both are dst.bytes() bytes of device
                    // memory (same dtype and length, checked), and they do not overlap.
                    unsafe { self.copy(dst_d.ptr, src_d.ptr, dst.bytes()) }?;
                }
            }
            Kernel::AddF32 { dst, src } => {
                let dst_d = r.tensor(dst, "dst", Dtype::F32, dst.len)?;
                let src_d = r.tensor(src, "src", Dtype::F32, dst.len)?;
                // SAFETY: add_f32(float* dst, const float* src, long long n) touches n
                // elements of each, the lengths checked above.
                unsafe {
                    self.launch(
                        "add_f32",
                        "",
                        per_element(dst_d.len),
                        &[Arg::Ptr(dst_d.ptr), Arg::Ptr(src_d.ptr), long(dst_d.len)],
                    )
                }?;
            }
            &Kernel::FoldRanks {
                ref acc,
                ref chunks,
                ranks,
                accumulate,
            } => {
                let acc_d = r.tensor(acc, "acc", Dtype::F32, acc.len)?;
                let chunks_d = r.tensor(chunks, "chunks", Dtype::F32, ranks * acc.len)?;
                // SAFETY: fold_ranks(float* acc, const float* chunks, long long n,
                // int ranks, int accumulate) touches n elements of acc and ranks * n of
                // chunks, the lengths checked above.
                unsafe {
                    self.launch(
                        "fold_ranks",
                        "",
                        per_element(acc_d.len),
                        &[
                            Arg::Ptr(acc_d.ptr),
                            Arg::Ptr(chunks_d.ptr),
                            long(acc_d.len),
                            int(ranks),
                            Arg::Int(i32::from(accumulate)),
                        ],
                    )
                }?;
            }
            Kernel::GradStats {
                grads,
                out,
                scratch,
            } => {
                let grads = r.tensor(grads, "grads", Dtype::F32, grads.len)?;
                r.dtype(out, "out", Dtype::U8)?;
                let out = r.scratch(out, "out (bytes)", 16, 8)?;
                if out.len != 16 {
                    return Err(r.shape("out (bytes)", out.len, 16));
                }
                let scratch = r.scratch(
                    scratch,
                    "scratch (bytes)",
                    grad_stats_scratch_bytes(Target::Cuda, grads.len),
                    8,
                )?;
                // SAFETY: grads, out and scratch checked above for dtype, size and
                // alignment; the caller's promise for the rest.
                unsafe { self.grad_stats(out, grads, scratch, scalars.stats_scale) }?;
            }
            &Kernel::AdamW {
                ref params,
                ref m,
                ref v,
                ref grads,
                ref copy_out,
                round,
                decay,
            } => {
                let n = params.len;
                let params = r.tensor(params, "params", Dtype::F32, n)?;
                let m = r.tensor(m, "m", Dtype::F32, n)?;
                let v = r.tensor(v, "v", Dtype::F32, n)?;
                let grads = r.tensor(grads, "grads", Dtype::F32, n)?;
                let (copy_out, mode) = match copy_out {
                    None => (0, CopyMode::None),
                    Some(out) => {
                        let mode = match (out.dtype, round) {
                            (Dtype::Bf16, _) => CopyMode::Bf16,
                            (Dtype::F16, _) => CopyMode::F16,
                            (Dtype::F32, Dtype::Bf16) => CopyMode::F32AsBf16,
                            (Dtype::F32, Dtype::F16) => CopyMode::F32AsF16,
                            (Dtype::F32, _) => CopyMode::F32,
                            (dtype, _) => {
                                return Err(KernelError::Dtype {
                                    kernel: r.kernel,
                                    what: "copy_out",
                                    dtype,
                                    target: Target::Cuda,
                                });
                            }
                        };
                        (r.tensor(out, "copy_out", out.dtype, n)?.ptr, mode)
                    }
                };
                if scalars.skip_update {
                    return Ok(());
                }
                let step = if decay {
                    scalars.adam
                } else {
                    scalars.adam_no_decay
                }
                .ok_or(KernelError::NoAdamStep)?;
                let constants = AdamConstants::from(&step);
                // SAFETY: adamw_step(float* params, float* m, float* v, const float*
                // grads, void* copy_out, int copy_mode, AdamConstants k, long long n)
                // touches n elements of each tensor (lengths checked above) and of
                // copy_out only in the mode its dtype was checked for.
                unsafe {
                    self.launch(
                        "adamw_step",
                        "",
                        per_element(n),
                        &[
                            Arg::Ptr(params.ptr),
                            Arg::Ptr(m.ptr),
                            Arg::Ptr(v.ptr),
                            Arg::Ptr(grads.ptr),
                            Arg::Ptr(copy_out),
                            Arg::Int(mode as i32),
                            Arg::Adam(constants),
                            long(n),
                        ],
                    )
                }?;
            }
            _ => {
                let (t, what) = working_tensor(kernel).expect("every other kernel has one");
                match t.dtype {
                    // SAFETY: the caller's promise, passed on.
                    Dtype::F32 => unsafe { self.run_typed::<f32>(kernel, scalars, &r) }?,
                    // SAFETY: the caller's promise, passed on.
                    Dtype::Bf16 => unsafe { self.run_typed::<bf16>(kernel, scalars, &r) }?,
                    // SAFETY: the caller's promise, passed on.
                    Dtype::F16 => unsafe { self.run_typed::<f16>(kernel, scalars, &r) }?,
                    dtype => {
                        return Err(KernelError::Dtype {
                            kernel: r.kernel,
                            what,
                            dtype,
                            target: Target::Cuda,
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// [`super::CudaKernels::run`] for the kernels with a working type `T`.
    ///
    /// # Safety
    /// As for [`super::CudaKernels::run`].
    unsafe fn run_typed<T: CudaFloat>(
        &self,
        kernel: &Kernel,
        scalars: &Scalars,
        r: &Resolve<'_>,
    ) -> Result<(), KernelError> {
        let w = T::DTYPE;
        match *kernel {
            Kernel::Encoder {
                ref out,
                ref tokens,
                ref wte,
                ref wpe,
                b,
                t,
                c,
            } => {
                let n = b * t;
                let out = r.tensor(out, "out", w, n * c)?;
                let tokens = r.tensor(tokens, "tokens", Dtype::U32, n)?;
                if c == 0 {
                    return Ok(());
                }
                let wte = r.rows_of(wte, "wte", w, c)?;
                let wpe = r.tensor_at_least(wpe, "wpe", w, t * c)?;
                // SAFETY: shapes checked above; the caller's promise for the rest.
                unsafe { self.encoder_forward::<T>(out, tokens, wte, wpe, b, t, c) }?;
            }
            Kernel::EncoderBackward {
                ref dwte,
                ref dwpe,
                ref dout,
                ref tokens,
                b,
                t,
                c,
            } => {
                let n = b * t;
                let dout = r.tensor(dout, "dout", w, n * c)?;
                let tokens = r.tensor(tokens, "tokens", Dtype::U32, n)?;
                if c == 0 {
                    return Ok(());
                }
                let dwte = r.rows_of(dwte, "dwte", Dtype::F32, c)?;
                let dwpe = r.tensor_at_least(dwpe, "dwpe", Dtype::F32, t * c)?;
                // SAFETY: as above.
                unsafe { self.encoder_backward::<T>(dwte, dwpe, dout, tokens, b, t, c) }?;
            }
            Kernel::LayerNorm {
                ref out,
                ref mean,
                ref rstd,
                ref inp,
                ref weight,
                ref bias,
                n,
                c,
            } => {
                let out = r.tensor(out, "out", w, n * c)?;
                let mean = r.tensor(mean, "mean", Dtype::F32, n)?;
                let rstd = r.tensor(rstd, "rstd", Dtype::F32, n)?;
                let inp = r.tensor(inp, "inp", w, n * c)?;
                let weight = r.tensor(weight, "weight", w, c)?;
                let bias = r.tensor(bias, "bias", w, c)?;
                // SAFETY: as above.
                unsafe { self.layernorm_forward::<T>(out, mean, rstd, inp, weight, bias, n, c) }?;
            }
            Kernel::LayerNormBackward {
                ref dinp,
                ref dweight,
                ref dbias,
                ref dout,
                ref inp,
                ref weight,
                ref mean,
                ref rstd,
                n,
                c,
            } => {
                let dinp = r.tensor(dinp, "dinp", w, n * c)?;
                let dweight = r.tensor(dweight, "dweight", Dtype::F32, c)?;
                let dbias = r.tensor(dbias, "dbias", Dtype::F32, c)?;
                let dout = r.tensor(dout, "dout", w, n * c)?;
                let inp = r.tensor(inp, "inp", w, n * c)?;
                let weight = r.tensor(weight, "weight", w, c)?;
                let mean = r.tensor(mean, "mean", Dtype::F32, n)?;
                let rstd = r.tensor(rstd, "rstd", Dtype::F32, n)?;
                // SAFETY: as above.
                unsafe {
                    self.layernorm_backward::<T>(
                        dinp, dweight, dbias, dout, inp, weight, mean, rstd, n, c,
                    )
                }?;
            }
            Kernel::Matmul {
                ref out,
                ref inp,
                ref weight,
                ref bias,
                layout,
                n,
                c,
                oc,
            } => {
                let out = r.tensor(out, "out", w, n * oc)?;
                let inp = r.tensor(inp, "inp", w, n * c)?;
                let weight = r.tensor(weight, "weight", w, c * oc)?;
                let bias = match bias {
                    Some(bias) => Some(r.tensor(bias, "bias", w, oc)?),
                    None => None,
                };
                // SAFETY: as above.
                unsafe { self.matmul_forward::<T>(out, inp, weight, bias, layout, n, c, oc) }?;
            }
            Kernel::MatmulBackward {
                ref dinp,
                ref dweight,
                ref dbias,
                ref dout,
                ref inp,
                ref weight,
                layout,
                n,
                c,
                oc,
            } => {
                let dinp = r.tensor(dinp, "dinp", w, n * c)?;
                let dweight = r.tensor(dweight, "dweight", Dtype::F32, c * oc)?;
                let dbias = match dbias {
                    Some(dbias) => Some(r.tensor(dbias, "dbias", Dtype::F32, oc)?),
                    None => None,
                };
                let dout = r.tensor(dout, "dout", w, n * oc)?;
                let inp = r.tensor(inp, "inp", w, n * c)?;
                let weight = r.tensor(weight, "weight", w, c * oc)?;
                // SAFETY: as above.
                unsafe {
                    self.matmul_backward::<T>(
                        dinp, dweight, dbias, dout, inp, weight, layout, n, c, oc,
                    )
                }?;
            }
            Kernel::Attention {
                ref out,
                ref att,
                ref qkv,
                ref scratch,
                b,
                t,
                c,
                nh,
            } => {
                check_heads(r, c, nh)?;
                let out = r.tensor(out, "out", w, b * t * c)?;
                let att = r.tensor(att, "att", w, b * nh * t * t)?;
                let qkv = r.tensor(qkv, "qkv", w, 3 * b * t * c)?;
                let bytes = attention_scratch_bytes(Target::Cuda, w, b, t, c, nh);
                let scratch = r.scratch(scratch, "scratch (bytes)", bytes, 4)?;
                // SAFETY: as above.
                unsafe { self.attention_forward::<T>(out, att, qkv, scratch, b, t, c, nh) }?;
            }
            Kernel::AttentionBackward {
                ref dqkv,
                ref dout,
                ref qkv,
                ref att,
                ref scratch,
                b,
                t,
                c,
                nh,
            } => {
                check_heads(r, c, nh)?;
                let dqkv = r.tensor(dqkv, "dqkv", w, 3 * b * t * c)?;
                let dout = r.tensor(dout, "dout", w, b * t * c)?;
                let qkv = r.tensor(qkv, "qkv", w, 3 * b * t * c)?;
                let att = r.tensor(att, "att", w, b * nh * t * t)?;
                let bytes = attention_scratch_bytes(Target::Cuda, w, b, t, c, nh);
                let scratch = r.scratch(scratch, "scratch (bytes)", bytes, 4)?;
                // SAFETY: as above.
                unsafe {
                    self.attention_backward::<T>(dqkv, dout, qkv, att, scratch, b, t, c, nh)
                }?;
            }
            Kernel::Gelu { ref out, ref inp } => {
                let out = r.tensor(out, "out", w, out.len)?;
                let inp = r.tensor(inp, "inp", w, out.len)?;
                // SAFETY: gelu_forward_<T>(T* out, const T* inp, long long n) touches n
                // elements of each (lengths checked above).
                unsafe {
                    self.launch(
                        "gelu_forward",
                        T::SUFFIX,
                        per_element(out.len),
                        &[Arg::Ptr(out.ptr), Arg::Ptr(inp.ptr), long(out.len)],
                    )
                }?;
            }
            Kernel::GeluBackward {
                ref dinp,
                ref inp,
                ref dout,
            } => {
                let dinp = r.tensor(dinp, "dinp", w, dinp.len)?;
                let inp = r.tensor(inp, "inp", w, dinp.len)?;
                let dout = r.tensor(dout, "dout", w, dinp.len)?;
                // SAFETY: gelu_backward_<T>(T* dinp, const T* inp, const T* dout,
                // long long n) touches n elements of each (lengths checked above).
                unsafe {
                    self.launch(
                        "gelu_backward",
                        T::SUFFIX,
                        per_element(dinp.len),
                        &[
                            Arg::Ptr(dinp.ptr),
                            Arg::Ptr(inp.ptr),
                            Arg::Ptr(dout.ptr),
                            long(dinp.len),
                        ],
                    )
                }?;
            }
            Kernel::Residual {
                ref out,
                ref a,
                ref b,
            } => {
                let out = r.tensor(out, "out", w, out.len)?;
                let a = r.tensor(a, "a", w, out.len)?;
                let b = r.tensor(b, "b", w, out.len)?;
                // SAFETY: residual_forward_<T>(T* out, const T* a, const T* b,
                // long long n) touches n elements of each (lengths checked above).
                unsafe {
                    self.launch(
                        "residual_forward",
                        T::SUFFIX,
                        per_element(out.len),
                        &[
                            Arg::Ptr(out.ptr),
                            Arg::Ptr(a.ptr),
                            Arg::Ptr(b.ptr),
                            long(out.len),
                        ],
                    )
                }?;
            }
            Kernel::CrossEntropy {
                ref losses,
                ref logits,
                ref targets,
                n,
                v,
            } => {
                let losses = r.tensor(losses, "losses", Dtype::F32, n)?;
                let logits = r.tensor(logits, "logits", w, n * v)?;
                let targets = r.tensor(targets, "targets", Dtype::U32, n)?;
                if n > 0 {
                    // SAFETY: crossentropy_forward_<T>(float* losses, const T* logits,
                    // const unsigned int* targets, int v): block r < n touches row r of
                    // logits (v elements), losses[r] and targets[r]; targets are checked
                    // against v in the kernel. The grid is exactly n blocks (n > 0).
                    unsafe {
                        self.launch(
                            "crossentropy_forward",
                            T::SUFFIX,
                            per_row_block(n),
                            &[
                                Arg::Ptr(losses.ptr),
                                Arg::Ptr(logits.ptr),
                                Arg::Ptr(targets.ptr),
                                int(v),
                            ],
                        )
                    }?;
                }
            }
            Kernel::CrossEntropyBackward {
                ref logits,
                ref targets,
                n,
                v,
            } => {
                let logits = r.tensor(logits, "logits", w, n * v)?;
                let targets = r.tensor(targets, "targets", Dtype::U32, n)?;
                if n > 0 {
                    // SAFETY: crossentropy_backward_<T>(T* logits, const unsigned int*
                    // targets, float dloss, int v): block r < n touches row r of logits
                    // and targets[r]. The grid is exactly n blocks (n > 0).
                    unsafe {
                        self.launch(
                            "crossentropy_backward",
                            T::SUFFIX,
                            per_row_block(n),
                            &[
                                Arg::Ptr(logits.ptr),
                                Arg::Ptr(targets.ptr),
                                Arg::Float(scalars.dloss),
                                int(v),
                            ],
                        )
                    }?;
                }
            }
            Kernel::RmsNorm {
                ref out,
                ref rstd,
                ref inp,
                ref weight,
                eps,
                n,
                c,
            } => {
                let out = r.tensor(out, "out", w, n * c)?;
                let rstd = r.tensor(rstd, "rstd", Dtype::F32, n)?;
                let inp = r.tensor(inp, "inp", w, n * c)?;
                let weight = r.tensor(weight, "weight", w, c)?;
                // SAFETY: rmsnorm_forward_<T>(T* out, float* rstd, const T* inp, const T*
                // weight, float eps, int n, int c): warp `row` < n touches row `row` (c
                // elements) of out and inp, rstd[row], and c of weight (lengths checked).
                unsafe {
                    self.launch(
                        "rmsnorm_forward",
                        T::SUFFIX,
                        per_row_warp(n),
                        &[
                            Arg::Ptr(out.ptr),
                            Arg::Ptr(rstd.ptr),
                            Arg::Ptr(inp.ptr),
                            Arg::Ptr(weight.ptr),
                            Arg::Float(eps),
                            int(n),
                            int(c),
                        ],
                    )
                }?;
            }
            Kernel::RmsNormBackward {
                ref dinp,
                ref dweight,
                ref dout,
                ref inp,
                ref weight,
                ref rstd,
                n,
                c,
            } => {
                let dinp = r.tensor(dinp, "dinp", w, n * c)?;
                let dweight = r.tensor(dweight, "dweight", Dtype::F32, c)?;
                let dout = r.tensor(dout, "dout", w, n * c)?;
                let inp = r.tensor(inp, "inp", w, n * c)?;
                let weight = r.tensor(weight, "weight", w, c)?;
                let rstd = r.tensor(rstd, "rstd", Dtype::F32, n)?;
                // SAFETY: rmsnorm_backward_input_<T>(T* dinp, const T* dout, const T* inp,
                // const T* weight, const float* rstd, int n, int c): warp `row` < n
                // touches row `row` of dinp, dout and inp, c of weight and rstd[row].
                unsafe {
                    self.launch(
                        "rmsnorm_backward_input",
                        T::SUFFIX,
                        per_row_warp(n),
                        &[
                            Arg::Ptr(dinp.ptr),
                            Arg::Ptr(dout.ptr),
                            Arg::Ptr(inp.ptr),
                            Arg::Ptr(weight.ptr),
                            Arg::Ptr(rstd.ptr),
                            int(n),
                            int(c),
                        ],
                    )
                }?;
                // SAFETY: rmsnorm_backward_weight_<T>(float* dweight, const T* dout,
                // const T* inp, const float* rstd, int n, int c): block (32, 32) per 32
                // columns; touches columns below c of dweight and of the n rows of dout
                // and inp, and n of rstd.
                unsafe {
                    self.launch(
                        "rmsnorm_backward_weight",
                        T::SUFFIX,
                        per_column_tile(c),
                        &[
                            Arg::Ptr(dweight.ptr),
                            Arg::Ptr(dout.ptr),
                            Arg::Ptr(inp.ptr),
                            Arg::Ptr(rstd.ptr),
                            int(n),
                            int(c),
                        ],
                    )
                }?;
            }
            Kernel::Rope {
                out: ref o,
                inp: ref i,
                ref cos,
                ref sin,
                b,
                t,
                h,
                d,
            }
            | Kernel::RopeBackward {
                dinp: ref o,
                dout: ref i,
                ref cos,
                ref sin,
                b,
                t,
                h,
                d,
            } => {
                let forward = matches!(kernel, Kernel::Rope { .. });
                let (out_name, inp_name) = if forward {
                    ("out", "inp")
                } else {
                    ("dinp", "dout")
                };
                if !d.is_multiple_of(2) {
                    return Err(r.shape("d (channels per head, even)", d, d + 1));
                }
                let rows = b * t * h;
                let o = r.tensor(o, out_name, w, rows * d)?;
                let i = r.tensor(i, inp_name, w, rows * d)?;
                let cos = r.tensor_at_least(cos, "cos", w, t * d / 2)?;
                let sin = r.tensor_at_least(sin, "sin", w, t * d / 2)?;
                let name = if forward {
                    "rope_forward"
                } else {
                    "rope_backward"
                };
                // SAFETY: rope_forward_<T> and rope_backward_<T>(T* out, const T* inp,
                // const T* cos, const T* sin, int rows, int t, int h, int half): thread
                // i < rows·half touches pair i of row i / half of out and inp (rows·d
                // elements each) and rows below t of the (at least t·half) tables.
                unsafe {
                    self.launch(
                        name,
                        T::SUFFIX,
                        per_element(rows * d / 2),
                        &[
                            Arg::Ptr(o.ptr),
                            Arg::Ptr(i.ptr),
                            Arg::Ptr(cos.ptr),
                            Arg::Ptr(sin.ptr),
                            int(rows),
                            int(t),
                            int(h),
                            int(d / 2),
                        ],
                    )
                }?;
            }
            Kernel::RopeTable {
                ref cos,
                ref sin,
                t,
                d,
                ref freqs,
            } => {
                if !d.is_multiple_of(2) {
                    return Err(r.shape("d (channels per head, even)", d, d + 1));
                }
                let half = d / 2;
                let cos = r.tensor(cos, "cos", w, t * half)?;
                let sin = r.tensor(sin, "sin", w, t * half)?;
                // Without Llama 3 scaling the factor is 0 (llama.cu's rope_table reads
                // a factor above 0 as scaling on).
                let s = freqs.llama3.unwrap_or(Llama3Scaling {
                    factor: 0.0,
                    low_freq_factor: 0.0,
                    high_freq_factor: 0.0,
                    original_context: 0.0,
                });
                // SAFETY: rope_table_<T>(T* cos, T* sin, int t, int half, float theta,
                // float factor, float low_freq_factor, float high_freq_factor, float
                // original_context): thread i < t·half writes element i of cos and sin
                // (t·half elements each, checked above).
                unsafe {
                    self.launch(
                        "rope_table",
                        T::SUFFIX,
                        per_element(t * half),
                        &[
                            Arg::Ptr(cos.ptr),
                            Arg::Ptr(sin.ptr),
                            int(t),
                            int(half),
                            Arg::Float(freqs.theta),
                            Arg::Float(s.factor),
                            Arg::Float(s.low_freq_factor),
                            Arg::Float(s.high_freq_factor),
                            Arg::Float(s.original_context),
                        ],
                    )
                }?;
            }
            Kernel::SwiGlu {
                ref out,
                ref gate,
                ref up,
            } => {
                let out = r.tensor(out, "out", w, out.len)?;
                let gate = r.tensor(gate, "gate", w, out.len)?;
                let up = r.tensor(up, "up", w, out.len)?;
                // SAFETY: swiglu_forward_<T>(T* out, const T* gate, const T* up,
                // long long n) touches n elements of each (lengths checked above).
                unsafe {
                    self.launch(
                        "swiglu_forward",
                        T::SUFFIX,
                        per_element(out.len),
                        &[
                            Arg::Ptr(out.ptr),
                            Arg::Ptr(gate.ptr),
                            Arg::Ptr(up.ptr),
                            long(out.len),
                        ],
                    )
                }?;
            }
            Kernel::SwiGluBackward {
                ref dgate,
                ref dup,
                ref dout,
                ref gate,
                ref up,
            } => {
                let n = dout.len;
                let dgate = r.tensor(dgate, "dgate", w, n)?;
                let dup = r.tensor(dup, "dup", w, n)?;
                let dout = r.tensor(dout, "dout", w, n)?;
                let gate = r.tensor(gate, "gate", w, n)?;
                let up = r.tensor(up, "up", w, n)?;
                // SAFETY: swiglu_backward_<T>(T* dgate, T* dup, const T* dout, const T*
                // gate, const T* up, long long n) touches n elements of each (checked).
                unsafe {
                    self.launch(
                        "swiglu_backward",
                        T::SUFFIX,
                        per_element(n),
                        &[
                            Arg::Ptr(dgate.ptr),
                            Arg::Ptr(dup.ptr),
                            Arg::Ptr(dout.ptr),
                            Arg::Ptr(gate.ptr),
                            Arg::Ptr(up.ptr),
                            long(n),
                        ],
                    )
                }?;
            }
            Kernel::GqaAttention {
                ref out,
                ref att,
                ref q,
                ref k,
                ref v,
                ref scratch,
                b,
                t,
                h,
                kv,
                d,
            } => {
                let dims = gqa_dims(r.kernel, b, t, h, kv, d)?;
                let out = r.tensor(out, "out", w, dims.q_len())?;
                let att = r.tensor(att, "att", w, dims.att_len())?;
                let q = r.tensor(q, "q", w, dims.q_len())?;
                let k = r.tensor(k, "k", w, dims.kv_len())?;
                let v = r.tensor(v, "v", w, dims.kv_len())?;
                let bytes = gqa_attention_scratch_bytes(Target::Cuda, w, b, t, h, kv, d);
                let scratch = r.scratch(scratch, "scratch (bytes)", bytes, 4)?;
                // SAFETY: as above.
                unsafe { self.gqa_attention_forward::<T>(out, att, [q, k, v], scratch, dims) }?;
            }
            Kernel::GqaAttentionBackward {
                ref dq,
                ref dk,
                ref dv,
                ref dout,
                ref q,
                ref k,
                ref v,
                ref att,
                ref scratch,
                b,
                t,
                h,
                kv,
                d,
            } => {
                let dims = gqa_dims(r.kernel, b, t, h, kv, d)?;
                let dq = r.tensor(dq, "dq", w, dims.q_len())?;
                let dk = r.tensor(dk, "dk", w, dims.kv_len())?;
                let dv = r.tensor(dv, "dv", w, dims.kv_len())?;
                let dout = r.tensor(dout, "dout", w, dims.q_len())?;
                let q = r.tensor(q, "q", w, dims.q_len())?;
                let k = r.tensor(k, "k", w, dims.kv_len())?;
                let v = r.tensor(v, "v", w, dims.kv_len())?;
                let att = r.tensor(att, "att", w, dims.att_len())?;
                let bytes = gqa_attention_scratch_bytes(Target::Cuda, w, b, t, h, kv, d);
                let scratch = r.scratch(scratch, "scratch (bytes)", bytes, 4)?;
                // SAFETY: as above.
                unsafe {
                    self.gqa_attention_backward::<T>(
                        [dq, dk, dv],
                        dout,
                        [q, k, v],
                        att,
                        scratch,
                        dims,
                    )
                }?;
            }
            Kernel::Zero { .. }
            | Kernel::Copy { .. }
            | Kernel::AddF32 { .. }
            | Kernel::FoldRanks { .. }
            | Kernel::GradStats { .. }
            | Kernel::AdamW { .. } => unreachable!("run handles the untyped kernels"),
        }
        Ok(())
    }

    /// `C (m × n) = alpha op(A) op(B) + beta C`, column-major, fp32 compute, optionally
    /// batched with element strides (a, b, c). Nothing when m or n is 0; `k` must not be.
    ///
    /// # Safety
    /// Every operand's pointer, leading dimension and (when batched) stride must address
    /// memory inside its tensor for the whole product, and C must not overlap A or B.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: Operand,
        b: Operand,
        c: Operand,
        alpha: f32,
        beta: f32,
        batch: Option<(usize, usize, usize, usize)>,
    ) -> Result<(), CudaError> {
        if m == 0 || n == 0 || batch.is_some_and(|(count, ..)| count == 0) {
            return Ok(());
        }
        assert!(k > 0, "a product over no terms");
        // SAFETY: the caller's promise, for a product with no empty dimension.
        unsafe {
            self.gemm_raw(&Gemm {
                m,
                n,
                k,
                a,
                b,
                c,
                alpha,
                beta,
                batch,
            })
        }
    }

    /// out: (B, T, C)  tokens: (B, T)  wte: (V, C)  wpe: (maxT, C); c > 0.
    ///
    /// # Safety
    /// The tensors have these shapes (wte a whole number of rows, wpe at least T rows)
    /// and the properties [`super::CudaKernels::run`] requires.
    #[allow(clippy::too_many_arguments)]
    unsafe fn encoder_forward<T: CudaFloat>(
        &self,
        out: DevTensor,
        tokens: DevTensor,
        wte: DevTensor,
        wpe: DevTensor,
        b: usize,
        t: usize,
        c: usize,
    ) -> Result<(), CudaError> {
        let n = b * t;
        let v = wte.len / c;
        // SAFETY: encoder_forward_<T>(T* out, const unsigned int* tokens, const T* wte,
        // const T* wpe, int n, int t_len, int c, int v): touches out[..n*c], tokens[..n],
        // wpe[..t*c] and rows below v of wte (it checks each token against v).
        unsafe {
            self.launch(
                "encoder_forward",
                T::SUFFIX,
                per_element(n * c),
                &[
                    Arg::Ptr(out.ptr),
                    Arg::Ptr(tokens.ptr),
                    Arg::Ptr(wte.ptr),
                    Arg::Ptr(wpe.ptr),
                    int(n),
                    int(t),
                    int(c),
                    int(v),
                ],
            )
        }
    }

    /// dwte: (V, C) +=  dwpe: (maxT, C) +=  dout: (B, T, C)  tokens: (B, T); c > 0.
    ///
    /// # Safety
    /// As for [`Self::encoder_forward`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn encoder_backward<T: CudaFloat>(
        &self,
        dwte: DevTensor,
        dwpe: DevTensor,
        dout: DevTensor,
        tokens: DevTensor,
        b: usize,
        t: usize,
        c: usize,
    ) -> Result<(), CudaError> {
        let n = b * t;
        let v = dwte.len / c;
        // SAFETY: encoder_backward_wte_<T>(float* dwte, const T* dout, const unsigned int*
        // tokens, int n, int c, int v): thread col < c touches dwte rows below v (checked
        // per token), dout[..n*c], tokens[..n].
        unsafe {
            self.launch(
                "encoder_backward_wte",
                T::SUFFIX,
                per_element(c),
                &[
                    Arg::Ptr(dwte.ptr),
                    Arg::Ptr(dout.ptr),
                    Arg::Ptr(tokens.ptr),
                    int(n),
                    int(c),
                    int(v),
                ],
            )
        }?;
        // SAFETY: encoder_backward_wpe_<T>(float* dwpe, const T* dout, int b, int t_len,
        // int c): touches dwpe[..t*c], dout[..b*t*c].
        unsafe {
            self.launch(
                "encoder_backward_wpe",
                T::SUFFIX,
                per_element(t * c),
                &[
                    Arg::Ptr(dwpe.ptr),
                    Arg::Ptr(dout.ptr),
                    int(b),
                    int(t),
                    int(c),
                ],
            )
        }
    }

    /// out: (N, C)  mean, rstd: (N)  inp: (N, C)  weight, bias: (C).
    ///
    /// # Safety
    /// The tensors have these shapes and the properties [`super::CudaKernels::run`] requires.
    #[allow(clippy::too_many_arguments)]
    unsafe fn layernorm_forward<T: CudaFloat>(
        &self,
        out: DevTensor,
        mean: DevTensor,
        rstd: DevTensor,
        inp: DevTensor,
        weight: DevTensor,
        bias: DevTensor,
        n: usize,
        c: usize,
    ) -> Result<(), CudaError> {
        // SAFETY: layernorm_forward_<T>(T* out, float* mean, float* rstd, const T* inp,
        // const T* weight, const T* bias, int n, int c): warp `row` < n touches row `row`
        // (c elements) of out and inp, mean[row], rstd[row], and c of weight and bias.
        unsafe {
            self.launch(
                "layernorm_forward",
                T::SUFFIX,
                per_row_warp(n),
                &[
                    Arg::Ptr(out.ptr),
                    Arg::Ptr(mean.ptr),
                    Arg::Ptr(rstd.ptr),
                    Arg::Ptr(inp.ptr),
                    Arg::Ptr(weight.ptr),
                    Arg::Ptr(bias.ptr),
                    int(n),
                    int(c),
                ],
            )
        }
    }

    /// dinp: (N, C) +=  dweight, dbias: (C) +=  dout, inp: (N, C)  weight: (C)
    /// mean, rstd: (N).
    ///
    /// # Safety
    /// The tensors have these shapes and the properties [`super::CudaKernels::run`] requires.
    #[allow(clippy::too_many_arguments)]
    unsafe fn layernorm_backward<T: CudaFloat>(
        &self,
        dinp: DevTensor,
        dweight: DevTensor,
        dbias: DevTensor,
        dout: DevTensor,
        inp: DevTensor,
        weight: DevTensor,
        mean: DevTensor,
        rstd: DevTensor,
        n: usize,
        c: usize,
    ) -> Result<(), CudaError> {
        // SAFETY: layernorm_backward_input_<T>(T* dinp, const T* dout, const T* inp,
        // const T* weight, const float* mean, const float* rstd, int n, int c): warp
        // `row` < n touches row `row` of dinp, dout and inp, c of weight, mean[row] and
        // rstd[row].
        unsafe {
            self.launch(
                "layernorm_backward_input",
                T::SUFFIX,
                per_row_warp(n),
                &[
                    Arg::Ptr(dinp.ptr),
                    Arg::Ptr(dout.ptr),
                    Arg::Ptr(inp.ptr),
                    Arg::Ptr(weight.ptr),
                    Arg::Ptr(mean.ptr),
                    Arg::Ptr(rstd.ptr),
                    int(n),
                    int(c),
                ],
            )
        }?;
        // SAFETY: layernorm_backward_params_<T>(float* dweight, float* dbias, const T*
        // dout, const T* inp, const float* mean, const float* rstd, int n, int c): block
        // (32, 32) per 32 columns; touches columns below c of dweight and dbias and of
        // the n rows of dout and inp, and n of mean and rstd.
        unsafe {
            self.launch(
                "layernorm_backward_params",
                T::SUFFIX,
                per_column_tile(c),
                &[
                    Arg::Ptr(dweight.ptr),
                    Arg::Ptr(dbias.ptr),
                    Arg::Ptr(dout.ptr),
                    Arg::Ptr(inp.ptr),
                    Arg::Ptr(mean.ptr),
                    Arg::Ptr(rstd.ptr),
                    int(n),
                    int(c),
                ],
            )
        }
    }

    /// The (C, OC) weight of `layout` as a column-major cuBLAS operand whose op is the
    /// (OC, C) matrix `W^T`, transposed again when `transpose` is set.
    fn weight_operand<T: CudaFloat>(
        ptr: u64,
        layout: WeightLayout,
        c: usize,
        oc: usize,
        transpose: bool,
    ) -> Operand {
        // Row-major (C, OC) is column-major (OC, C) = W^T; row-major (OC, C) is
        // column-major (C, OC) = W, which needs a transpose to become W^T.
        let (ld, transposed) = match layout {
            WeightLayout::InOut => (oc, false),
            WeightLayout::OutIn => (c, true),
        };
        Operand {
            ptr,
            data_type: T::DATA_TYPE,
            ld,
            transposed: transposed != transpose,
        }
    }

    /// out: (N, OC) = inp: (N, C) @ W + bias; W is (C, OC) for [`WeightLayout::InOut`],
    /// (OC, C) for [`WeightLayout::OutIn`]; bias: (OC) or none.
    ///
    /// # Safety
    /// The tensors have these shapes and the properties [`super::CudaKernels::run`] requires.
    #[allow(clippy::too_many_arguments)]
    unsafe fn matmul_forward<T: CudaFloat>(
        &self,
        out: DevTensor,
        inp: DevTensor,
        weight: DevTensor,
        bias: Option<DevTensor>,
        layout: WeightLayout,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<(), CudaError> {
        if n == 0 || oc == 0 {
            return Ok(());
        }
        if let Some(bias) = bias {
            // SAFETY: bias_broadcast_<T>(T* out, const T* bias, int n, int oc): touches
            // out[..n*oc] and bias[..oc].
            unsafe {
                self.launch(
                    "bias_broadcast",
                    T::SUFFIX,
                    per_element(n * oc),
                    &[Arg::Ptr(out.ptr), Arg::Ptr(bias.ptr), int(n), int(oc)],
                )
            }?;
        }
        if c == 0 {
            // A product over no terms: out is the bias, or zero.
            if bias.is_none() {
                // SAFETY: out is n·oc elements of T.
                unsafe { self.zero(out.ptr, n * oc * T::DTYPE.size()) }?;
            }
            return Ok(());
        }
        // Column-major: out^T (OC, N) = W^T (OC, C) @ inp^T (C, N).
        let a = Self::weight_operand::<T>(weight.ptr, layout, c, oc, false);
        let b = Operand {
            ptr: inp.ptr,
            data_type: T::DATA_TYPE,
            ld: c,
            transposed: false,
        };
        let o = Operand {
            ptr: out.ptr,
            data_type: T::DATA_TYPE,
            ld: oc,
            transposed: false,
        };
        let beta = if bias.is_some() { 1.0 } else { 0.0 };
        // SAFETY: W^T is oc × c, inp^T c × n, out^T oc × n at the leading dimensions given,
        // all within the checked lengths; out overlaps neither input (caller's promise).
        unsafe { self.gemm(oc, n, c, a, b, o, 1.0, beta, None) }
    }

    /// dinp: (N, C) =  dweight: shaped as the weight, +=  dbias: (OC) +=
    /// dout: (N, OC)  inp: (N, C)  weight: as in [`Self::matmul_forward`].
    ///
    /// # Safety
    /// The tensors have these shapes and the properties [`super::CudaKernels::run`] requires.
    #[allow(clippy::too_many_arguments)]
    unsafe fn matmul_backward<T: CudaFloat>(
        &self,
        dinp: DevTensor,
        dweight: DevTensor,
        dbias: Option<DevTensor>,
        dout: DevTensor,
        inp: DevTensor,
        weight: DevTensor,
        layout: WeightLayout,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<(), CudaError> {
        if n == 0 {
            return Ok(());
        }
        if oc == 0 {
            // No output channels: the input gradient is zero; nothing else to add.
            // SAFETY: dinp is n·c elements of T.
            return unsafe { self.zero(dinp.ptr, n * c * T::DTYPE.size()) };
        }
        if c > 0 {
            // Column-major: dinp^T (C, N) = W (C, OC) @ dout^T (OC, N).
            let a = Self::weight_operand::<T>(weight.ptr, layout, c, oc, true);
            let b = Operand {
                ptr: dout.ptr,
                data_type: T::DATA_TYPE,
                ld: oc,
                transposed: false,
            };
            let o = Operand {
                ptr: dinp.ptr,
                data_type: T::DATA_TYPE,
                ld: c,
                transposed: false,
            };
            // SAFETY: W is c × oc, dout^T oc × n, dinp^T c × n at the leading dimensions
            // given, within the checked lengths; dinp overlaps neither input.
            unsafe { self.gemm(c, n, oc, a, b, o, 1.0, 0.0, None) }?;
            let dout_op = |transposed| Operand {
                ptr: dout.ptr,
                data_type: T::DATA_TYPE,
                ld: oc,
                transposed,
            };
            let inp_op = |transposed| Operand {
                ptr: inp.ptr,
                data_type: T::DATA_TYPE,
                ld: c,
                transposed,
            };
            let (m, nn, a, b, ld) = match layout {
                // Row-major (C, OC) is column-major (OC, C) = dout^T (OC, N) @ inp (N, C).
                WeightLayout::InOut => (oc, c, dout_op(false), inp_op(true), oc),
                // Row-major (OC, C) is column-major (C, OC) = inp^T (C, N) @ dout (N, OC).
                WeightLayout::OutIn => (c, oc, inp_op(false), dout_op(true), c),
            };
            let o = Operand {
                ptr: dweight.ptr,
                data_type: cudaDataType_t::CUDA_R_32F,
                ld,
                transposed: false,
            };
            // SAFETY: both products read n rows of dout and inp and write the c × oc
            // gradient at the leading dimension of its layout, within the checked lengths.
            unsafe { self.gemm(m, nn, n, a, b, o, 1.0, 1.0, None) }?;
        }
        if let Some(dbias) = dbias {
            // SAFETY: bias_backward_<T>(float* dbias, const T* dout, int n, int oc): block
            // (32, 32) per 32 columns; touches dbias[..oc] and the n rows of dout.
            unsafe {
                self.launch(
                    "bias_backward",
                    T::SUFFIX,
                    per_column_tile(oc),
                    &[Arg::Ptr(dbias.ptr), Arg::Ptr(dout.ptr), int(n), int(oc)],
                )
            }?;
        }
        Ok(())
    }

    /// Runs one of the attention layout kernels (attention_split, attention_join,
    /// attention_heads) over B × NH × T × HS elements.
    ///
    /// # Safety
    /// `args` are the kernel's parameters in order and type, over tensors of at least
    /// `elements` elements (qkv-shaped ones: 3 × `elements`).
    unsafe fn heads_launch<T: CudaFloat>(
        &self,
        name: &'static str,
        elements: usize,
        args: &[Arg],
    ) -> Result<(), CudaError> {
        // SAFETY: the caller's promise; one thread per element.
        unsafe { self.launch(name, T::SUFFIX, per_element(elements), args) }
    }

    /// out: (B, T, C)  att: (B, NH, T, T)  qkv: (B, T, 3C)  scratch: the regions of
    /// [`attention_scratch_layout`]; c > 0, c a multiple of nh.
    ///
    /// # Safety
    /// The tensors have these shapes, scratch at least the layout's bytes, and the
    /// properties [`super::CudaKernels::run`] requires.
    #[allow(clippy::too_many_arguments)]
    unsafe fn attention_forward<T: CudaFloat>(
        &self,
        out: DevTensor,
        att: DevTensor,
        qkv: DevTensor,
        scratch: DevTensor,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> Result<(), CudaError> {
        let (n, hs) = (b * t * c, c / nh);
        if n == 0 {
            return Ok(());
        }
        let layout = attention_scratch_layout(T::DTYPE, b, t, c, nh);
        debug_assert!(scratch.len >= layout.total_bytes);
        let q = offset(scratch.ptr, layout.q);
        let k = offset(scratch.ptr, layout.k);
        let v = offset(scratch.ptr, layout.v);
        let y = offset(scratch.ptr, layout.y);
        let scores = offset(scratch.ptr, layout.scores);
        let heads = [int(b), int(t), int(nh), int(hs)];
        // SAFETY: attention_split_<T>(T* q, T* k, T* v, const T* qkv, int b, int t,
        // int nh, int hs): n elements of q, k, v (scratch regions of n elements of T) and
        // 3n of qkv.
        unsafe {
            self.heads_launch::<T>(
                "attention_split",
                n,
                &[
                    Arg::Ptr(q),
                    Arg::Ptr(k),
                    Arg::Ptr(v),
                    Arg::Ptr(qkv.ptr),
                    heads[0],
                    heads[1],
                    heads[2],
                    heads[3],
                ],
            )
        }?;
        let scale = 1.0 / (hs as f32).sqrt();
        let batch = b * nh;
        let ty = T::DATA_TYPE;
        // Per head, column-major: scores^T (T, T) = k (T, HS) @ q^T (HS, T), scaled, in f32.
        let k_op = Operand {
            ptr: k,
            data_type: ty,
            ld: hs,
            transposed: true,
        };
        let q_op = Operand {
            ptr: q,
            data_type: ty,
            ld: hs,
            transposed: false,
        };
        let x_op = Operand {
            ptr: scores,
            data_type: cudaDataType_t::CUDA_R_32F,
            ld: t,
            transposed: false,
        };
        // SAFETY: b·nh products of t × hs operands at stride t·hs (inside q and k) into
        // t × t blocks at stride t·t (inside the f32 scores region).
        unsafe {
            self.gemm(
                t,
                t,
                hs,
                k_op,
                q_op,
                x_op,
                scale,
                0.0,
                Some((batch, t * hs, t * hs, t * t)),
            )
        }?;
        let rows = b * nh * t;
        // SAFETY: softmax_causal_forward_<T>(T* att, const float* scores, int rows,
        // int t): warp `row` < rows touches row `row` (t elements) of att and scores.
        unsafe {
            self.launch(
                "softmax_causal_forward",
                T::SUFFIX,
                per_row_warp(rows),
                &[Arg::Ptr(att.ptr), Arg::Ptr(scores), int(rows), int(t)],
            )
        }?;
        // Per head, column-major: y^T (HS, T) = v^T (HS, T) @ att^T (T, T).
        let v_op = Operand {
            ptr: v,
            data_type: ty,
            ld: hs,
            transposed: false,
        };
        let a_op = Operand {
            ptr: att.ptr,
            data_type: ty,
            ld: t,
            transposed: false,
        };
        let y_op = Operand {
            ptr: y,
            data_type: ty,
            ld: hs,
            transposed: false,
        };
        // SAFETY: b·nh products over hs × t and t × t blocks at their strides, all inside
        // v, att and y.
        unsafe {
            self.gemm(
                hs,
                t,
                t,
                v_op,
                a_op,
                y_op,
                1.0,
                0.0,
                Some((batch, t * hs, t * t, t * hs)),
            )
        }?;
        // SAFETY: attention_heads_<T>(T* out, const T* inp, int b, int t, int nh, int hs,
        // int to_heads): with to_heads = 0, out (B, T, C) from inp = y (B, NH, T, HS), n
        // elements each.
        unsafe {
            self.heads_launch::<T>(
                "attention_heads",
                n,
                &[
                    Arg::Ptr(out.ptr),
                    Arg::Ptr(y),
                    heads[0],
                    heads[1],
                    heads[2],
                    heads[3],
                    Arg::Int(0),
                ],
            )
        }
    }

    /// dqkv: (B, T, 3C) =  dout: (B, T, C)  qkv: (B, T, 3C)  att: (B, NH, T, T)
    /// scratch: the regions of [`attention_scratch_layout`]; c > 0, c a multiple of nh.
    ///
    /// # Safety
    /// As for [`Self::attention_forward`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn attention_backward<T: CudaFloat>(
        &self,
        dqkv: DevTensor,
        dout: DevTensor,
        qkv: DevTensor,
        att: DevTensor,
        scratch: DevTensor,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> Result<(), CudaError> {
        let (n, hs) = (b * t * c, c / nh);
        if n == 0 {
            return Ok(());
        }
        let layout = attention_scratch_layout(T::DTYPE, b, t, c, nh);
        debug_assert!(scratch.len >= layout.total_bytes);
        let q = offset(scratch.ptr, layout.q);
        let k = offset(scratch.ptr, layout.k);
        let v = offset(scratch.ptr, layout.v);
        // The gradient of the output per head.
        let dy = offset(scratch.ptr, layout.y);
        let dq = offset(scratch.ptr, layout.dq);
        let dk = offset(scratch.ptr, layout.dk);
        let dv = offset(scratch.ptr, layout.dv);
        // The gradient of the probabilities, in f32.
        let datt = offset(scratch.ptr, layout.scores);
        // The gradient of the scaled scores, in T.
        let dpre = offset(scratch.ptr, layout.dscores);
        let heads = [int(b), int(t), int(nh), int(hs)];
        // SAFETY: as in attention_forward: n elements of q, k, v, 3n of qkv.
        unsafe {
            self.heads_launch::<T>(
                "attention_split",
                n,
                &[
                    Arg::Ptr(q),
                    Arg::Ptr(k),
                    Arg::Ptr(v),
                    Arg::Ptr(qkv.ptr),
                    heads[0],
                    heads[1],
                    heads[2],
                    heads[3],
                ],
            )
        }?;
        // SAFETY: attention_heads_<T>(T* out, const T* inp, int b, int t, int nh, int hs,
        // int to_heads): with to_heads = 1, out = dy (B, NH, T, HS) from inp = dout
        // (B, T, C), n elements each.
        unsafe {
            self.heads_launch::<T>(
                "attention_heads",
                n,
                &[
                    Arg::Ptr(dy),
                    Arg::Ptr(dout.ptr),
                    heads[0],
                    heads[1],
                    heads[2],
                    heads[3],
                    Arg::Int(1),
                ],
            )
        }?;
        let batch = b * nh;
        let ty = T::DATA_TYPE;
        let op = |ptr, ld, transposed| Operand {
            ptr,
            data_type: ty,
            ld,
            transposed,
        };
        let datt_op = Operand {
            ptr: datt,
            data_type: cudaDataType_t::CUDA_R_32F,
            ld: t,
            transposed: false,
        };
        // datt^T (T, T) = v (T, HS) @ dy^T (HS, T), in f32; dv^T (HS, T) = dy^T (HS, T)
        // @ att (T, T).
        // SAFETY: b·nh products over blocks at their strides, inside v, dy, att, the f32
        // region and dv; the outputs are scratch regions distinct from the inputs.
        unsafe {
            self.gemm(
                t,
                t,
                hs,
                op(v, hs, true),
                op(dy, hs, false),
                datt_op,
                1.0,
                0.0,
                Some((batch, t * hs, t * hs, t * t)),
            )?;
            self.gemm(
                hs,
                t,
                t,
                op(dy, hs, false),
                op(att.ptr, t, true),
                op(dv, hs, false),
                1.0,
                0.0,
                Some((batch, t * hs, t * t, t * hs)),
            )?;
        }
        let rows = b * nh * t;
        let scale = 1.0 / (hs as f32).sqrt();
        // SAFETY: softmax_causal_backward_<T>(T* dpre, const float* datt, const T* att,
        // int rows, int t, float scale): warp `row` < rows touches row `row` (t elements)
        // of dpre, datt and att.
        unsafe {
            self.launch(
                "softmax_causal_backward",
                T::SUFFIX,
                per_row_warp(rows),
                &[
                    Arg::Ptr(dpre),
                    Arg::Ptr(datt),
                    Arg::Ptr(att.ptr),
                    int(rows),
                    int(t),
                    Arg::Float(scale),
                ],
            )
        }?;
        // dq^T (HS, T) = k^T (HS, T) @ dpre^T (T, T); dk^T (HS, T) = q^T (HS, T) @ dpre (T, T).
        // SAFETY: as above, into the distinct scratch regions dq and dk.
        unsafe {
            let strides = Some((batch, t * hs, t * t, t * hs));
            self.gemm(
                hs,
                t,
                t,
                op(k, hs, false),
                op(dpre, t, false),
                op(dq, hs, false),
                1.0,
                0.0,
                strides,
            )?;
            self.gemm(
                hs,
                t,
                t,
                op(q, hs, false),
                op(dpre, t, true),
                op(dk, hs, false),
                1.0,
                0.0,
                strides,
            )?;
        }
        // SAFETY: attention_join_<T>(T* dqkv, const T* dq, const T* dk, const T* dv,
        // int b, int t, int nh, int hs): 3n elements of dqkv, n of dq, dk, dv.
        unsafe {
            self.heads_launch::<T>(
                "attention_join",
                n,
                &[
                    Arg::Ptr(dqkv.ptr),
                    Arg::Ptr(dq),
                    Arg::Ptr(dk),
                    Arg::Ptr(dv),
                    heads[0],
                    heads[1],
                    heads[2],
                    heads[3],
                ],
            )
        }
    }

    /// Moves `heads` heads of D channels between a (B, T, heads, D) tensor and a
    /// (B, heads, T, D) one: `to_heads` gathers `rows` into `heads_ptr`, otherwise
    /// scatters `heads_ptr` into `rows`.
    ///
    /// # Safety
    /// Both address B × T × heads × D elements of T, not overlapping, with the properties
    /// [`super::CudaKernels::run`] requires.
    unsafe fn move_heads<T: CudaFloat>(
        &self,
        rows: u64,
        heads_ptr: u64,
        dims: GqaDims,
        heads: usize,
        to_heads: bool,
    ) -> Result<(), CudaError> {
        let (dst, src) = if to_heads {
            (heads_ptr, rows)
        } else {
            (rows, heads_ptr)
        };
        // SAFETY: attention_heads_<T>(T* out, const T* inp, int b, int t, int nh, int hs,
        // int to_heads): B·T·heads·D elements of each, the caller's promise.
        unsafe {
            self.heads_launch::<T>(
                "attention_heads",
                dims.b * dims.t * heads * dims.d,
                &[
                    Arg::Ptr(dst),
                    Arg::Ptr(src),
                    int(dims.b),
                    int(dims.t),
                    int(heads),
                    int(dims.d),
                    Arg::Int(i32::from(to_heads)),
                ],
            )
        }
    }

    /// The start of both directions of grouped-query attention: the scratch's layout,
    /// with q, k, v (B, T, heads, D) moved into its per-head regions (B, heads, T, D);
    /// `None` when there is nothing to compute.
    ///
    /// # Safety
    /// As for [`Self::gqa_attention_forward`].
    unsafe fn gqa_heads<T: CudaFloat>(
        &self,
        [q, k, v]: [DevTensor; 3],
        scratch: DevTensor,
        dims: GqaDims,
    ) -> Result<Option<AttentionScratchLayout>, CudaError> {
        let GqaDims { b, t, h, kv, d } = dims;
        if dims.q_len() == 0 || dims.att_len() == 0 {
            return Ok(None);
        }
        let l = gqa_attention_scratch_layout(T::DTYPE, b, t, h, kv, d);
        debug_assert!(scratch.len >= l.total_bytes);
        let at = |region: usize| offset(scratch.ptr, region);
        // SAFETY: q, k, v into their scratch regions, each of its tensor's length.
        unsafe {
            self.move_heads::<T>(q.ptr, at(l.q), dims, h, true)?;
            self.move_heads::<T>(k.ptr, at(l.k), dims, kv, true)?;
            self.move_heads::<T>(v.ptr, at(l.v), dims, kv, true)?;
        }
        Ok(Some(l))
    }

    /// out: (B, T, H, D)  att: (B, H, T, T)  q: (B, T, H, D)  k, v: (B, T, KV, D)
    /// scratch: the regions of [`gqa_attention_scratch_layout`]. Per (batch, key/value
    /// head), the G = H / KV query heads that share it are one (G·T, D) matrix of the
    /// per-head q, so each product is one batched cuBLAS call over B·KV groups.
    ///
    /// # Safety
    /// The tensors have these shapes, scratch at least the layout's bytes, and the
    /// properties [`super::CudaKernels::run`] requires.
    unsafe fn gqa_attention_forward<T: CudaFloat>(
        &self,
        out: DevTensor,
        att: DevTensor,
        [q, k, v]: [DevTensor; 3],
        scratch: DevTensor,
        dims: GqaDims,
    ) -> Result<(), CudaError> {
        let GqaDims { b, t, h, kv, d } = dims;
        // SAFETY: the caller's promise, passed on.
        let Some(l) = unsafe { self.gqa_heads::<T>([q, k, v], scratch, dims) }? else {
            return Ok(());
        };
        let at = |region: usize| offset(scratch.ptr, region);
        let (g, op) = (h / kv, typed_operand::<T>);
        let scores = f32_rows(at(l.scores), t);
        // Per group, column-major: scores^T (T, G·T) = k (T, D) @ q^T (D, G·T), scaled.
        // SAFETY: b·kv products over blocks at their strides, inside the k and q regions
        // and the f32 scores region (B·H·T·T).
        unsafe {
            self.gemm(
                t,
                g * t,
                d,
                op(at(l.k), d, true),
                op(at(l.q), d, false),
                scores,
                1.0 / (d as f32).sqrt(),
                0.0,
                Some((b * kv, t * d, g * t * d, g * t * t)),
            )
        }?;
        let rows = b * h * t;
        // SAFETY: softmax_causal_forward_<T>(T* att, const float* scores, int rows,
        // int t): warp `row` < rows touches row `row` (t elements) of att and scores.
        unsafe {
            self.launch(
                "softmax_causal_forward",
                T::SUFFIX,
                per_row_warp(rows),
                &[Arg::Ptr(att.ptr), Arg::Ptr(at(l.scores)), int(rows), int(t)],
            )
        }?;
        // Per group, column-major: y^T (D, G·T) = v^T (D, T) @ att^T (T, G·T).
        // SAFETY: b·kv products inside v, att and y.
        unsafe {
            self.gemm(
                d,
                g * t,
                t,
                op(at(l.v), d, false),
                op(att.ptr, t, false),
                op(at(l.y), d, false),
                1.0,
                0.0,
                Some((b * kv, t * d, g * t * t, g * t * d)),
            )
        }?;
        // SAFETY: y (B, H, T, D) into out (B, T, H, D).
        unsafe { self.move_heads::<T>(out.ptr, at(l.y), dims, h, false) }
    }

    /// dq: (B, T, H, D) =  dk, dv: (B, T, KV, D) =  dout: (B, T, H, D)  q, k, v and att
    /// as in [`Self::gqa_attention_forward`]  scratch: the regions of
    /// [`gqa_attention_scratch_layout`]. The products over a group's G·T rows add the key
    /// and value gradients of its query heads up.
    ///
    /// # Safety
    /// As for [`Self::gqa_attention_forward`].
    unsafe fn gqa_attention_backward<T: CudaFloat>(
        &self,
        [dq, dk, dv]: [DevTensor; 3],
        dout: DevTensor,
        [q, k, v]: [DevTensor; 3],
        att: DevTensor,
        scratch: DevTensor,
        dims: GqaDims,
    ) -> Result<(), CudaError> {
        let GqaDims { b, t, h, kv, d } = dims;
        // SAFETY: the caller's promise, passed on.
        let Some(l) = unsafe { self.gqa_heads::<T>([q, k, v], scratch, dims) }? else {
            return Ok(());
        };
        let at = |region: usize| offset(scratch.ptr, region);
        // The per-head output gradient goes in the y region, the probabilities' gradient
        // (f32) in the scores region.
        // SAFETY: dout (B, T, H, D) into the y region.
        unsafe { self.move_heads::<T>(dout.ptr, at(l.y), dims, h, true) }?;
        let (g, op) = (h / kv, typed_operand::<T>);
        let datt = f32_rows(at(l.scores), t);
        // SAFETY: b·kv products over blocks at their strides inside the scratch regions
        // and att; every output is a scratch region distinct from its inputs.
        unsafe {
            // datt^T (T, G·T) = v (T, D) @ dy^T (D, G·T), in f32.
            self.gemm(
                t,
                g * t,
                d,
                op(at(l.v), d, true),
                op(at(l.y), d, false),
                datt,
                1.0,
                0.0,
                Some((b * kv, t * d, g * t * d, g * t * t)),
            )?;
            // dv^T (D, T) = dy^T (D, G·T) @ att (G·T, T): the group's heads add up.
            self.gemm(
                d,
                t,
                g * t,
                op(at(l.y), d, false),
                op(att.ptr, t, true),
                op(at(l.dv), d, false),
                1.0,
                0.0,
                Some((b * kv, g * t * d, g * t * t, t * d)),
            )?;
        }
        let rows = b * h * t;
        // SAFETY: softmax_causal_backward_<T>(T* dpre, const float* datt, const T* att,
        // int rows, int t, float scale): warp `row` < rows touches row `row` (t elements)
        // of dpre, datt and att.
        unsafe {
            self.launch(
                "softmax_causal_backward",
                T::SUFFIX,
                per_row_warp(rows),
                &[
                    Arg::Ptr(at(l.dscores)),
                    Arg::Ptr(at(l.scores)),
                    Arg::Ptr(att.ptr),
                    int(rows),
                    int(t),
                    Arg::Float(1.0 / (d as f32).sqrt()),
                ],
            )
        }?;
        // SAFETY: as above, into the distinct scratch regions dq and dk.
        unsafe {
            // dq^T (D, G·T) = k^T (D, T) @ dpre^T (T, G·T).
            self.gemm(
                d,
                g * t,
                t,
                op(at(l.k), d, false),
                op(at(l.dscores), t, false),
                op(at(l.dq), d, false),
                1.0,
                0.0,
                Some((b * kv, t * d, g * t * t, g * t * d)),
            )?;
            // dk^T (D, T) = q^T (D, G·T) @ dpre (G·T, T): the group's heads add up.
            self.gemm(
                d,
                t,
                g * t,
                op(at(l.q), d, false),
                op(at(l.dscores), t, true),
                op(at(l.dk), d, false),
                1.0,
                0.0,
                Some((b * kv, g * t * d, g * t * t, t * d)),
            )?;
        }
        // SAFETY: the per-head gradients (B, heads, T, D) into dq, dk, dv (B, T, heads, D).
        unsafe {
            self.move_heads::<T>(dq.ptr, at(l.dq), dims, h, false)?;
            self.move_heads::<T>(dk.ptr, at(l.dk), dims, kv, false)?;
            self.move_heads::<T>(dv.ptr, at(l.dv), dims, kv, false)
        }
    }

    /// out: two f64 (sum of squares of grads × scale, non-finite flag)  grads: (N) f32
    /// scratch: [`grad_stats_scratch_bytes`] bytes, 8-aligned.
    ///
    /// # Safety
    /// The tensors have these sizes and the properties [`super::CudaKernels::run`] requires.
    unsafe fn grad_stats(
        &self,
        out: DevTensor,
        grads: DevTensor,
        scratch: DevTensor,
        scale: f32,
    ) -> Result<(), CudaError> {
        let blocks = grad_stats_blocks(grads.len);
        debug_assert!(scratch.len >= 8 * blocks && out.len == 16);
        // SAFETY: grad_stats_partials(double* partials, const float* grads, float scale,
        // long long n): `blocks` blocks of GRAD_STATS_THREADS threads read grads[..n] and
        // write partials[..blocks] (the scratch holds 8 bytes per block).
        unsafe {
            self.launch(
                "grad_stats_partials",
                "",
                grad_stats_grid(blocks),
                &[
                    Arg::Ptr(scratch.ptr),
                    Arg::Ptr(grads.ptr),
                    Arg::Float(scale),
                    long(grads.len),
                ],
            )
        }?;
        // SAFETY: grad_stats_total(double* out, const double* partials, int count): one
        // block of GRAD_STATS_THREADS threads reads partials[..count] and writes out[0..2]
        // (16 bytes).
        unsafe {
            self.launch(
                "grad_stats_total",
                "",
                grad_stats_grid(1),
                &[Arg::Ptr(out.ptr), Arg::Ptr(scratch.ptr), int(blocks)],
            )
        }
    }
}

/// A cuBLAS operand of the working type `T`.
fn typed_operand<T: CudaFloat>(ptr: u64, ld: usize, transposed: bool) -> Operand {
    Operand {
        ptr,
        data_type: T::DATA_TYPE,
        ld,
        transposed,
    }
}

/// An f32 cuBLAS operand of rows of `ld` (attention's scores), not transposed.
fn f32_rows(ptr: u64, ld: usize) -> Operand {
    Operand {
        ptr,
        data_type: cudaDataType_t::CUDA_R_32F,
        ld,
        transposed: false,
    }
}

/// Attention's heads must divide its channels, and there must be channels.
fn check_heads(r: &Resolve<'_>, c: usize, nh: usize) -> Result<(), KernelError> {
    if nh == 0 || c == 0 || !c.is_multiple_of(nh) {
        return Err(r.shape(
            "c (channels, a positive multiple of nh)",
            c,
            c.next_multiple_of(nh.max(1)).max(nh.max(1)),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
