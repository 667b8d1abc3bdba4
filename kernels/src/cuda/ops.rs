//! The CUDA queue of programs' kernels: [`CudaKernels`] holds the kernels compiled by
//! NVRTC (each family's `.cu` file, `crate::kernel`), loaded into one stream's context, and a cuBLAS handle on
//! that stream, and [`CudaKernels::run`] enqueues one [`Kernel`] of a program there, in
//! f32, bf16 or f16 (the working type of its activations).
//!
//! It is made once per stream from the caller's `Arc<CudaStream>` (the engine's device
//! layer, or a test's). Tensors are raw device addresses the caller resolves from each
//! [`TensorRef`] (inside its one big allocation per device), never cudarc slices. What
//! each kernel checks is in [`super::launch`], what it launches in its family; this file
//! holds only the four CUDA calls they are made of: kernel launches, cuBLAS products
//! (`cublasGemmEx`, fp32 compute), and memsets and copies on the stream.
//!
//! Semantics and shapes are those of the CPU runner ([`crate::program::run_cpu`]), both
//! checked against the kernel's one signature:
//! activations and parameters in the working type, parameter gradients and per-row
//! statistics in f32 (gradients accumulate), LayerNorm's input gradient accumulates. No
//! kernel uses float atomics, so runs repeat bit for bit on one GPU. This file does not
//! know where tensors live or when they may be reused: the caller orders the stream's
//! work against its other streams.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t};
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use super::launch::{Arg, Gemm, KernelQueue, RunOnCuda, TrustedDevice};
use super::{CudaError, program};
use crate::kernel::Kernel;
use crate::program::{KernelError, Scalars, TensorRef};

/// The compiled kernels and a cuBLAS handle, bound to one stream.
pub struct CudaKernels {
    stream: Arc<CudaStream>,
    functions: HashMap<(&'static str, &'static str), CudaFunction>,
    blas: CudaBlas,
}

impl CudaKernels {
    /// Loads the kernels (compiling them on the first call in this process) into the
    /// stream's context and opens cuBLAS on the stream. Errors if CUDA is not usable.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self, CudaError> {
        super::probe().require_all()?;
        let context = stream.context();
        let (major, minor) = context.compute_capability()?;
        let cubin = program::compile(major, minor)?;
        let module = context.load_module(Ptx::from_binary(cubin.to_vec()))?;
        let mut functions = HashMap::new();
        for (name, suffix) in program::entries() {
            let function = module.load_function(&program::entry_name(name, suffix))?;
            functions.insert((name, suffix), function);
        }
        let blas = CudaBlas::new(stream.clone())?;
        Ok(CudaKernels {
            stream,
            functions,
            blas,
        })
    }

    /// The stream every kernel is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Checks `kernel`'s tensors against its shape and enqueues it on [`Self::stream`],
    /// with `address` giving each tensor's device address (`CUdeviceptr`); returns
    /// without waiting for it. The working type (f32, bf16 or f16) is that of the
    /// kernel's activations, and decides which typed kernels run; parameter gradients,
    /// statistics and optimizer state are f32, token ids u32, scratch any dtype (its
    /// bytes count). [`Kernel::CrossEntropyBackward`] takes `dloss`, and
    /// [`Kernel::GradStats`] its scale, from `scalars`; [`Kernel::AdamW`] does nothing
    /// when [`Scalars::skip_update`] is set and otherwise needs its step's constants.
    ///
    /// Errors ([`KernelError::Dtype`], [`KernelError::Shape`],
    /// [`KernelError::Misaligned`], [`KernelError::NoAdamStep`]) come before anything is
    /// enqueued; a [`KernelError::Cuda`] may come after part of the kernel was.
    ///
    /// # Safety
    /// For every tensor of the kernel ([`Kernel::for_each_tensor`]), `address` must return
    /// the address of [`TensorRef::bytes`] bytes of device memory in the stream's context
    /// that stay allocated until the enqueued work has finished, and nothing else (no
    /// other stream, no host access) may write any of the kernel's tensors, or read a
    /// tensor it writes, until then. Written tensors must not overlap any other tensor of
    /// the kernel (the in-place [`Kernel::CrossEntropyBackward`] has only its one).
    pub unsafe fn run(
        &self,
        kernel: &Kernel,
        scalars: &Scalars,
        address: &dyn Fn(&TensorRef) -> u64,
    ) -> Result<(), KernelError> {
        // Driver calls (memsets, copies, cuBLAS) run in the current context.
        self.stream
            .context()
            .bind_to_thread()
            .map_err(CudaError::from)?;
        // SAFETY: the caller's promise, passed on.
        let device = unsafe { TrustedDevice::new(self, address) };
        kernel.run_on_cuda(scalars, &device)
    }
}

impl KernelQueue for CudaKernels {
    unsafe fn launch(
        &self,
        name: &'static str,
        suffix: &'static str,
        config: LaunchConfig,
        args: &[Arg],
    ) -> Result<(), CudaError> {
        let function: &CudaFunction = &self.functions[&(name, suffix)];
        let mut launch = self.stream.launch_builder(function);
        // Each argument is pushed as a pointer to its value inside `args`, which outlives
        // the launch below.
        for arg in args {
            match arg {
                Arg::Ptr(ptr) => launch.arg(ptr),
                Arg::Int(x) => launch.arg(x),
                Arg::Long(x) => launch.arg(x),
                Arg::Float(x) => launch.arg(x),
                Arg::Adam(k) => launch.arg(k),
            };
        }
        // SAFETY: the caller's promise: the arguments match the kernel's parameters and
        // keep its accesses inside their tensors.
        unsafe { launch.launch(config) }?;
        Ok(())
    }

    unsafe fn gemm_raw(&self, gemm: &Gemm) -> Result<(), CudaError> {
        let op = |t: bool| {
            if t {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        let Gemm {
            m,
            n,
            k,
            a,
            b,
            c,
            alpha,
            beta,
            batch,
        } = *gemm;
        let handle = *self.blas.handle();
        let alpha_ptr = (&alpha) as *const f32 as *const std::ffi::c_void;
        let beta_ptr = (&beta) as *const f32 as *const std::ffi::c_void;
        let compute = cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let algo = cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
        let ld = |x: usize| i32::try_from(x).expect("leading dimension beyond 2^31 - 1");
        let dim = |x: usize| i32::try_from(x).expect("dimension beyond 2^31 - 1");
        match batch {
            // SAFETY: the caller guarantees the operands' extents; alpha and beta are f32
            // host values, as CUBLAS_COMPUTE_32F requires in host pointer mode.
            None => unsafe {
                cudarc::cublas::result::gemm_ex(
                    handle,
                    op(a.transposed),
                    op(b.transposed),
                    dim(m),
                    dim(n),
                    dim(k),
                    alpha_ptr,
                    a.ptr as *const _,
                    a.data_type,
                    ld(a.ld),
                    b.ptr as *const _,
                    b.data_type,
                    ld(b.ld),
                    beta_ptr,
                    c.ptr as *mut _,
                    c.data_type,
                    ld(c.ld),
                    compute,
                    algo,
                )?
            },
            // SAFETY: as above, for each of `count` products at the given strides.
            Some((count, stride_a, stride_b, stride_c)) => unsafe {
                cudarc::cublas::result::gemm_strided_batched_ex(
                    handle,
                    op(a.transposed),
                    op(b.transposed),
                    dim(m),
                    dim(n),
                    dim(k),
                    alpha_ptr,
                    a.ptr as *const _,
                    a.data_type,
                    ld(a.ld),
                    stride_a as i64,
                    b.ptr as *const _,
                    b.data_type,
                    ld(b.ld),
                    stride_b as i64,
                    beta_ptr,
                    c.ptr as *mut _,
                    c.data_type,
                    ld(c.ld),
                    stride_c as i64,
                    dim(count),
                    compute,
                    algo,
                )?
            },
        }
        Ok(())
    }

    unsafe fn zero(&self, ptr: u64, bytes: usize) -> Result<(), CudaError> {
        if bytes > 0 {
            // SAFETY: the caller's promise: `bytes` bytes of device memory at `ptr`.
            unsafe {
                cudarc::driver::result::memset_d8_async(ptr, 0, bytes, self.stream.cu_stream())
            }?;
        }
        Ok(())
    }

    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        if bytes > 0 {
            // SAFETY: the caller's promise: `bytes` bytes of device memory at each, not
            // overlapping.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream())
            }?;
        }
        Ok(())
    }
}
