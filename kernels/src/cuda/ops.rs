//! GPT-2's kernels on a CUDA stream: launches of the NVRTC-compiled kernels and cuBLAS
//! products (fp32 accumulation), in f32 or bf16.
//!
//! [`CudaKernels`] is made once per stream from cudarc types the caller owns (its
//! `Arc<CudaStream>`: the engine's device layer, or a test's), loads the program into the
//! stream's context and opens a cuBLAS handle on the stream. Every call enqueues its work
//! on that stream and returns; tensors are cudarc views, checked for length before any
//! launch. Semantics and shapes are those of the CPU kernels in [`crate::ops`]:
//! activations and parameters in `T`, parameter gradients and per-row statistics in f32
//! (gradients accumulate), LayerNorm's input gradient accumulates.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
    DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;
use half::{bf16, f16};

use super::program::{CAST_KERNELS, TYPED_KERNELS};
use super::{CudaError, program};
use crate::ops::WeightLayout;

/// A working type of the CUDA kernels: `f32` or `bf16`.
pub trait CudaFloat: DeviceRepr + ValidAsZeroBits + Copy + Send + Sync + Unpin + 'static {
    /// The suffix of the kernels' names for this type.
    const SUFFIX: &'static str;
    /// cuBLAS's name for this type.
    const DATA_TYPE: cudaDataType_t;
}

impl CudaFloat for f32 {
    const SUFFIX: &'static str = "f32";
    const DATA_TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_32F;
}

impl CudaFloat for bf16 {
    const SUFFIX: &'static str = "bf16";
    const DATA_TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_16BF;
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

/// An element count as the kernels' `int`.
fn int(n: usize) -> i32 {
    i32::try_from(n).expect("dimension beyond 2^31 - 1")
}

/// A matrix operand of a cuBLAS call: device address, type, leading dimension, and
/// whether it is used transposed.
#[derive(Clone, Copy)]
struct Operand {
    ptr: u64,
    data_type: cudaDataType_t,
    ld: usize,
    transposed: bool,
}

/// Extra scratch attention needs on the GPU, for one batch shape: the per-head Q, K, V
/// and output (and their gradients) in (B, NH, T, HS) layout, the scores or their
/// gradient in f32, and the gradient of the scaled scores.
pub struct AttentionScratch<T> {
    scores: CudaSlice<f32>,
    q: CudaSlice<T>,
    k: CudaSlice<T>,
    v: CudaSlice<T>,
    y: CudaSlice<T>,
    dq: CudaSlice<T>,
    dk: CudaSlice<T>,
    dv: CudaSlice<T>,
    datt: CudaSlice<T>,
}

impl<T: CudaFloat> AttentionScratch<T> {
    /// Scratch for batches of `b` sequences of `t` tokens, `c` channels in `nh` heads.
    pub fn new(
        stream: &Arc<CudaStream>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> Result<Self, CudaError> {
        let n = b * t * c;
        Ok(AttentionScratch {
            scores: stream.alloc_zeros(b * nh * t * t)?,
            q: stream.alloc_zeros(n)?,
            k: stream.alloc_zeros(n)?,
            v: stream.alloc_zeros(n)?,
            y: stream.alloc_zeros(n)?,
            dq: stream.alloc_zeros(n)?,
            dk: stream.alloc_zeros(n)?,
            dv: stream.alloc_zeros(n)?,
            datt: stream.alloc_zeros(b * nh * t * t)?,
        })
    }
}

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
        for name in TYPED_KERNELS {
            for suffix in [f32::SUFFIX, bf16::SUFFIX] {
                let function = module.load_function(&format!("{name}_{suffix}"))?;
                functions.insert((name, suffix), function);
            }
        }
        for name in CAST_KERNELS {
            functions.insert((name, ""), module.load_function(name)?);
        }
        let blas = CudaBlas::new(stream.clone())?;
        Ok(CudaKernels {
            stream,
            functions,
            blas,
        })
    }

    /// The stream every call enqueues on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn function(&self, name: &'static str, suffix: &'static str) -> &CudaFunction {
        &self.functions[&(name, suffix)]
    }

    /// `C (m × n) = alpha op(A) op(B) + beta C`, column-major, fp32 compute, optionally
    /// batched with element strides (a, b, c).
    ///
    /// # Safety
    /// Every operand's pointer, leading dimension and (when batched) stride must address
    /// memory inside its allocation for the whole product, and C must not overlap A or B.
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
        let op = |t: bool| {
            if t {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        let handle = *self.blas.handle();
        let alpha_ptr = (&alpha) as *const f32 as *const std::ffi::c_void;
        let beta_ptr = (&beta) as *const f32 as *const std::ffi::c_void;
        let compute = cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let algo = cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
        match batch {
            // SAFETY: the caller guarantees the operands' extents; alpha and beta are f32
            // host values, as CUBLAS_COMPUTE_32F requires in host pointer mode.
            None => unsafe {
                cudarc::cublas::result::gemm_ex(
                    handle,
                    op(a.transposed),
                    op(b.transposed),
                    int(m),
                    int(n),
                    int(k),
                    alpha_ptr,
                    a.ptr as *const _,
                    a.data_type,
                    int(a.ld),
                    b.ptr as *const _,
                    b.data_type,
                    int(b.ld),
                    beta_ptr,
                    c.ptr as *mut _,
                    c.data_type,
                    int(c.ld),
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
                    int(m),
                    int(n),
                    int(k),
                    alpha_ptr,
                    a.ptr as *const _,
                    a.data_type,
                    int(a.ld),
                    stride_a as i64,
                    b.ptr as *const _,
                    b.data_type,
                    int(b.ld),
                    stride_b as i64,
                    beta_ptr,
                    c.ptr as *mut _,
                    c.data_type,
                    int(c.ld),
                    stride_c as i64,
                    int(count),
                    compute,
                    algo,
                )?
            },
        }
        Ok(())
    }

    /// out: (B, T, C)  tokens: (B, T)  wte: (V, C)  wpe: (maxT, C).
    #[allow(clippy::too_many_arguments)]
    pub fn encoder_forward<T: CudaFloat>(
        &self,
        out: &mut CudaViewMut<'_, T>,
        tokens: &CudaView<'_, u32>,
        wte: &CudaView<'_, T>,
        wpe: &CudaView<'_, T>,
        b: usize,
        t: usize,
        c: usize,
    ) -> Result<(), CudaError> {
        let n = b * t;
        assert_eq!((out.len(), tokens.len()), (n * c, n));
        assert!(wpe.len() >= t * c && wte.len() % c == 0);
        let v = wte.len() / c;
        let (n32, t32, c32, v32) = (int(n), int(t), int(c), int(v));
        let mut launch = self
            .stream
            .launch_builder(self.function("encoder_forward", T::SUFFIX));
        launch
            .arg(out)
            .arg(tokens)
            .arg(wte)
            .arg(wpe)
            .arg(&n32)
            .arg(&t32)
            .arg(&c32)
            .arg(&v32);
        // SAFETY: the arguments match encoder_forward_<T> (encoder.cu) in type and order;
        // it touches out[..n*c], tokens[..n], wpe[..t*c] and rows below v of wte (it
        // checks each token against v), all within the lengths asserted above.
        unsafe { launch.launch(per_element(n * c)) }?;
        Ok(())
    }

    /// dwte: (V, C) +=  dwpe: (maxT, C) +=  dout: (B, T, C)  tokens: (B, T).
    #[allow(clippy::too_many_arguments)]
    pub fn encoder_backward<T: CudaFloat>(
        &self,
        dwte: &mut CudaViewMut<'_, f32>,
        dwpe: &mut CudaViewMut<'_, f32>,
        dout: &CudaView<'_, T>,
        tokens: &CudaView<'_, u32>,
        b: usize,
        t: usize,
        c: usize,
    ) -> Result<(), CudaError> {
        let n = b * t;
        assert_eq!((dout.len(), tokens.len()), (n * c, n));
        assert!(dwpe.len() >= t * c && dwte.len() % c == 0);
        let v = dwte.len() / c;
        let (n32, b32, t32, c32, v32) = (int(n), int(b), int(t), int(c), int(v));
        let mut launch = self
            .stream
            .launch_builder(self.function("encoder_backward_wte", T::SUFFIX));
        launch
            .arg(dwte)
            .arg(dout)
            .arg(tokens)
            .arg(&n32)
            .arg(&c32)
            .arg(&v32);
        // SAFETY: matches encoder_backward_wte_<T>; touches dwte rows below v (checked per
        // token), dout[..n*c], tokens[..n].
        unsafe { launch.launch(per_element(c)) }?;
        let mut launch = self
            .stream
            .launch_builder(self.function("encoder_backward_wpe", T::SUFFIX));
        launch.arg(dwpe).arg(dout).arg(&b32).arg(&t32).arg(&c32);
        // SAFETY: matches encoder_backward_wpe_<T>; touches dwpe[..t*c], dout[..b*t*c].
        unsafe { launch.launch(per_element(t * c)) }?;
        Ok(())
    }

    /// out: (N, C)  mean, rstd: (N)  inp: (N, C)  weight, bias: (C).
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_forward<T: CudaFloat>(
        &self,
        out: &mut CudaViewMut<'_, T>,
        mean: &mut CudaViewMut<'_, f32>,
        rstd: &mut CudaViewMut<'_, f32>,
        inp: &CudaView<'_, T>,
        weight: &CudaView<'_, T>,
        bias: &CudaView<'_, T>,
        n: usize,
        c: usize,
    ) -> Result<(), CudaError> {
        assert_eq!((out.len(), inp.len()), (n * c, n * c));
        assert_eq!(
            (mean.len(), rstd.len(), weight.len(), bias.len()),
            (n, n, c, c)
        );
        let (n32, c32) = (int(n), int(c));
        let mut launch = self
            .stream
            .launch_builder(self.function("layernorm_forward", T::SUFFIX));
        launch
            .arg(out)
            .arg(mean)
            .arg(rstd)
            .arg(inp)
            .arg(weight)
            .arg(bias)
            .arg(&n32)
            .arg(&c32);
        // SAFETY: matches layernorm_forward_<T>; touches n rows of c elements of out and
        // inp, n of mean and rstd, c of weight and bias.
        unsafe { launch.launch(per_row_warp(n)) }?;
        Ok(())
    }

    /// dinp: (N, C) +=  dweight, dbias: (C) +=  dout, inp: (N, C)  weight: (C)
    /// mean, rstd: (N).
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_backward<T: CudaFloat>(
        &self,
        dinp: &mut CudaViewMut<'_, T>,
        dweight: &mut CudaViewMut<'_, f32>,
        dbias: &mut CudaViewMut<'_, f32>,
        dout: &CudaView<'_, T>,
        inp: &CudaView<'_, T>,
        weight: &CudaView<'_, T>,
        mean: &CudaView<'_, f32>,
        rstd: &CudaView<'_, f32>,
        n: usize,
        c: usize,
    ) -> Result<(), CudaError> {
        assert_eq!((dinp.len(), dout.len(), inp.len()), (n * c, n * c, n * c));
        assert_eq!((dweight.len(), dbias.len(), weight.len()), (c, c, c));
        assert_eq!((mean.len(), rstd.len()), (n, n));
        let (n32, c32) = (int(n), int(c));
        let f = self.function("layernorm_backward_input", T::SUFFIX);
        let mut launch = self.stream.launch_builder(f);
        launch
            .arg(dinp)
            .arg(dout)
            .arg(inp)
            .arg(weight)
            .arg(mean)
            .arg(rstd)
            .arg(&n32)
            .arg(&c32);
        // SAFETY: matches layernorm_backward_input_<T>; touches n rows of c elements of
        // dinp, dout and inp, c of weight, n of mean and rstd.
        unsafe { launch.launch(per_row_warp(n)) }?;
        let f = self.function("layernorm_backward_params", T::SUFFIX);
        let mut launch = self.stream.launch_builder(f);
        launch
            .arg(dweight)
            .arg(dbias)
            .arg(dout)
            .arg(inp)
            .arg(mean)
            .arg(rstd)
            .arg(&n32)
            .arg(&c32);
        // SAFETY: matches layernorm_backward_params_<T>; touches c of dweight and dbias,
        // n rows of c of dout and inp, n of mean and rstd.
        unsafe { launch.launch(per_column_tile(c)) }?;
        Ok(())
    }

    /// The (C, OC) weight of `layout` as a column-major cuBLAS operand whose op is the
    /// (OC, C) matrix `W^T`... transposed again when `transpose` is set.
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
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_forward<T: CudaFloat>(
        &self,
        out: &mut CudaViewMut<'_, T>,
        inp: &CudaView<'_, T>,
        weight: &CudaView<'_, T>,
        bias: Option<&CudaView<'_, T>>,
        layout: WeightLayout,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<(), CudaError> {
        assert_eq!(
            (out.len(), inp.len(), weight.len()),
            (n * oc, n * c, c * oc)
        );
        if let Some(bias) = bias {
            assert_eq!(bias.len(), oc);
            let (n32, oc32) = (int(n), int(oc));
            let mut launch = self
                .stream
                .launch_builder(self.function("bias_broadcast", T::SUFFIX));
            launch.arg(&mut *out).arg(bias).arg(&n32).arg(&oc32);
            // SAFETY: matches bias_broadcast_<T>; touches out[..n*oc] and bias[..oc].
            unsafe { launch.launch(per_element(n * oc)) }?;
        }
        let (w, _w) = weight.device_ptr(&self.stream);
        let (x, _x) = inp.device_ptr(&self.stream);
        let (y, _y) = out.device_ptr_mut(&self.stream);
        // Column-major: out^T (OC, N) = W^T (OC, C) @ inp^T (C, N).
        let a = Self::weight_operand::<T>(w, layout, c, oc, false);
        let b = Operand {
            ptr: x,
            data_type: T::DATA_TYPE,
            ld: c,
            transposed: false,
        };
        let o = Operand {
            ptr: y,
            data_type: T::DATA_TYPE,
            ld: oc,
            transposed: false,
        };
        let beta = if bias.is_some() { 1.0 } else { 0.0 };
        // SAFETY: W^T is oc × c, inp^T c × n, out^T oc × n at the leading dimensions given,
        // all within the lengths asserted above; out is a distinct mutable view.
        unsafe { self.gemm(oc, n, c, a, b, o, 1.0, beta, None) }
    }

    /// dinp: (N, C) =  dweight: shaped as the weight, +=  dbias: (OC) +=
    /// dout: (N, OC)  inp: (N, C)  weight: as in [`CudaKernels::matmul_forward`].
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_backward<T: CudaFloat>(
        &self,
        dinp: &mut CudaViewMut<'_, T>,
        dweight: &mut CudaViewMut<'_, f32>,
        dbias: Option<&mut CudaViewMut<'_, f32>>,
        dout: &CudaView<'_, T>,
        inp: &CudaView<'_, T>,
        weight: &CudaView<'_, T>,
        layout: WeightLayout,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<(), CudaError> {
        assert_eq!((dinp.len(), dout.len(), inp.len()), (n * c, n * oc, n * c));
        assert_eq!((weight.len(), dweight.len()), (c * oc, c * oc));
        {
            let (w, _w) = weight.device_ptr(&self.stream);
            let (d, _d) = dout.device_ptr(&self.stream);
            let (g, _g) = dinp.device_ptr_mut(&self.stream);
            // Column-major: dinp^T (C, N) = W (C, OC) @ dout^T (OC, N).
            let a = Self::weight_operand::<T>(w, layout, c, oc, true);
            let b = Operand {
                ptr: d,
                data_type: T::DATA_TYPE,
                ld: oc,
                transposed: false,
            };
            let o = Operand {
                ptr: g,
                data_type: T::DATA_TYPE,
                ld: c,
                transposed: false,
            };
            // SAFETY: W is c × oc, dout^T oc × n, dinp^T c × n at the leading dimensions
            // given, within the asserted lengths; dinp is a distinct mutable view.
            unsafe { self.gemm(c, n, oc, a, b, o, 1.0, 0.0, None) }?;
        }
        {
            let (x, _x) = inp.device_ptr(&self.stream);
            let (d, _d) = dout.device_ptr(&self.stream);
            let (g, _g) = dweight.device_ptr_mut(&self.stream);
            let dout_op = |transposed| Operand {
                ptr: d,
                data_type: T::DATA_TYPE,
                ld: oc,
                transposed,
            };
            let inp_op = |transposed| Operand {
                ptr: x,
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
                ptr: g,
                data_type: cudaDataType_t::CUDA_R_32F,
                ld,
                transposed: false,
            };
            // SAFETY: both products read n rows of dout and inp and write the c × oc
            // gradient at the leading dimension of its layout, within the asserted lengths.
            unsafe { self.gemm(m, nn, n, a, b, o, 1.0, 1.0, None) }?;
        }
        if let Some(dbias) = dbias {
            assert_eq!(dbias.len(), oc);
            let (n32, oc32) = (int(n), int(oc));
            let mut launch = self
                .stream
                .launch_builder(self.function("bias_backward", T::SUFFIX));
            launch.arg(dbias).arg(dout).arg(&n32).arg(&oc32);
            // SAFETY: matches bias_backward_<T>; touches dbias[..oc] and dout[..n*oc].
            unsafe { launch.launch(per_column_tile(oc)) }?;
        }
        Ok(())
    }

    /// Runs one of the attention layout kernels over B × NH × T × HS elements.
    fn heads_launch<'a, T: CudaFloat>(
        &'a self,
        name: &'static str,
        push: impl FnOnce(&mut LaunchArgs<'a>),
        elements: usize,
    ) -> Result<(), CudaError> {
        let mut launch = self.stream.launch_builder(self.function(name, T::SUFFIX));
        push(&mut launch);
        // SAFETY: every caller pushes the arguments of `name` in its order, with views of
        // at least `elements` elements, which is all the kernel touches.
        unsafe { launch.launch(per_element(elements)) }?;
        Ok(())
    }

    /// out: (B, T, C)  att: (B, NH, T, T)  qkv: (B, T, 3C).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_forward<T: CudaFloat>(
        &self,
        out: &mut CudaViewMut<'_, T>,
        att: &mut CudaViewMut<'_, T>,
        qkv: &CudaView<'_, T>,
        scratch: &mut AttentionScratch<T>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> Result<(), CudaError> {
        assert_eq!(c % nh, 0);
        let (n, hs) = (b * t * c, c / nh);
        assert_eq!(
            (out.len(), qkv.len(), att.len()),
            (n, 3 * n, b * nh * t * t)
        );
        assert!(scratch.q.len() >= n && scratch.datt.len() >= b * nh * t * t);
        assert!(scratch.scores.len() >= b * nh * t * t);
        let (b32, t32, nh32, hs32) = (int(b), int(t), int(nh), int(hs));
        let s = scratch;
        self.heads_launch::<T>(
            "attention_split",
            |l| {
                l.arg(&mut s.q).arg(&mut s.k).arg(&mut s.v).arg(qkv);
                l.arg(&b32).arg(&t32).arg(&nh32).arg(&hs32);
            },
            n,
        )?;
        let scale = 1.0 / (hs as f32).sqrt();
        let batch = b * nh;
        {
            let (q, _q) = s.q.device_ptr(&self.stream);
            let (k, _k) = s.k.device_ptr(&self.stream);
            let (x, _x) = s.scores.device_ptr_mut(&self.stream);
            let ty = T::DATA_TYPE;
            // Per head, column-major: scores^T (T, T) = k (T, HS) @ q^T (HS, T), scaled, in
            // f32.
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
                ptr: x,
                data_type: cudaDataType_t::CUDA_R_32F,
                ld: t,
                transposed: false,
            };
            // SAFETY: b·nh products of t × hs operands at stride t·hs (inside q and k) into
            // t × t blocks at stride t·t (inside scores).
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
        }
        let rows = b * nh * t;
        let (rows32, t32) = (int(rows), int(t));
        let mut launch = self
            .stream
            .launch_builder(self.function("softmax_causal_forward", T::SUFFIX));
        launch.arg(&mut *att).arg(&s.scores).arg(&rows32).arg(&t32);
        // SAFETY: matches softmax_causal_forward_<T>; touches rows × t elements of att and
        // scores.
        unsafe { launch.launch(per_row_warp(rows)) }?;
        {
            let (v, _v) = s.v.device_ptr(&self.stream);
            let (a, _a) = att.device_ptr(&self.stream);
            let (y, _y) = s.y.device_ptr_mut(&self.stream);
            let ty = T::DATA_TYPE;
            // Per head, column-major: y^T (HS, T) = v^T (HS, T) @ att^T (T, T).
            let v_op = Operand {
                ptr: v,
                data_type: ty,
                ld: hs,
                transposed: false,
            };
            let a_op = Operand {
                ptr: a,
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
            // SAFETY: b·nh products over hs × t and t × t blocks at their strides, all
            // inside v, att and y.
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
        }
        let merge = 0i32;
        self.heads_launch::<T>(
            "attention_heads",
            |l| {
                l.arg(out)
                    .arg(&s.y)
                    .arg(&b32)
                    .arg(&t32)
                    .arg(&nh32)
                    .arg(&hs32)
                    .arg(&merge);
            },
            n,
        )
    }

    /// dqkv: (B, T, 3C) =  dout: (B, T, C)  qkv: (B, T, 3C)  att: (B, NH, T, T).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward<T: CudaFloat>(
        &self,
        dqkv: &mut CudaViewMut<'_, T>,
        dout: &CudaView<'_, T>,
        qkv: &CudaView<'_, T>,
        att: &CudaView<'_, T>,
        scratch: &mut AttentionScratch<T>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> Result<(), CudaError> {
        assert_eq!(c % nh, 0);
        let (n, hs) = (b * t * c, c / nh);
        assert_eq!(
            (dout.len(), qkv.len(), dqkv.len(), att.len()),
            (n, 3 * n, 3 * n, b * nh * t * t)
        );
        assert!(scratch.q.len() >= n && scratch.datt.len() >= b * nh * t * t);
        assert!(scratch.scores.len() >= b * nh * t * t);
        let (b32, t32, nh32, hs32) = (int(b), int(t), int(nh), int(hs));
        let s = scratch;
        self.heads_launch::<T>(
            "attention_split",
            |l| {
                l.arg(&mut s.q).arg(&mut s.k).arg(&mut s.v).arg(qkv);
                l.arg(&b32).arg(&t32).arg(&nh32).arg(&hs32);
            },
            n,
        )?;
        let split = 1i32;
        self.heads_launch::<T>(
            "attention_heads",
            |l| {
                l.arg(&mut s.y)
                    .arg(dout)
                    .arg(&b32)
                    .arg(&t32)
                    .arg(&nh32)
                    .arg(&hs32)
                    .arg(&split);
            },
            n,
        )?;
        let batch = b * nh;
        let ty = T::DATA_TYPE;
        let op = |ptr, ld, transposed| Operand {
            ptr,
            data_type: ty,
            ld,
            transposed,
        };
        {
            let (v, _v) = s.v.device_ptr(&self.stream);
            let (dy, _dy) = s.y.device_ptr(&self.stream);
            let (a, _a) = att.device_ptr(&self.stream);
            let (datt, _datt) = s.scores.device_ptr_mut(&self.stream);
            let (dv, _dv) = s.dv.device_ptr_mut(&self.stream);
            let datt_op = Operand {
                ptr: datt,
                data_type: cudaDataType_t::CUDA_R_32F,
                ld: t,
                transposed: false,
            };
            // datt^T (T, T) = v (T, HS) @ dy^T (HS, T), in f32; dv^T (HS, T) = dy^T (HS, T)
            // @ att (T, T).
            // SAFETY: b·nh products over blocks at their strides, inside v, dy, att, scores
            // and dv; the outputs are distinct scratch buffers.
            unsafe {
                let strides = Some((batch, t * hs, t * hs, t * t));
                self.gemm(
                    t,
                    t,
                    hs,
                    op(v, hs, true),
                    op(dy, hs, false),
                    datt_op,
                    1.0,
                    0.0,
                    strides,
                )?;
                let strides = Some((batch, t * hs, t * t, t * hs));
                self.gemm(
                    hs,
                    t,
                    t,
                    op(dy, hs, false),
                    op(a, t, true),
                    op(dv, hs, false),
                    1.0,
                    0.0,
                    strides,
                )?;
            }
        }
        let rows = b * nh * t;
        let (rows32, scale) = (int(rows), 1.0 / (hs as f32).sqrt());
        let mut launch = self
            .stream
            .launch_builder(self.function("softmax_causal_backward", T::SUFFIX));
        launch
            .arg(&mut s.datt)
            .arg(&s.scores)
            .arg(att)
            .arg(&rows32)
            .arg(&t32)
            .arg(&scale);
        // SAFETY: matches softmax_causal_backward_<T>; touches rows × t elements of the
        // score gradients (datt, scores) and of att.
        unsafe { launch.launch(per_row_warp(rows)) }?;
        {
            let (q, _q) = s.q.device_ptr(&self.stream);
            let (k, _k) = s.k.device_ptr(&self.stream);
            let (dpre, _dpre) = s.datt.device_ptr(&self.stream);
            let (dq, _dq) = s.dq.device_ptr_mut(&self.stream);
            let (dk, _dk) = s.dk.device_ptr_mut(&self.stream);
            // dq^T (HS, T) = k^T (HS, T) @ dpre^T (T, T); dk^T (HS, T) = q^T (HS, T) @ dpre (T, T).
            // SAFETY: as above, into the distinct scratch buffers dq and dk.
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
        }
        self.heads_launch::<T>(
            "attention_join",
            |l| {
                l.arg(dqkv).arg(&s.dq).arg(&s.dk).arg(&s.dv);
                l.arg(&b32).arg(&t32).arg(&nh32).arg(&hs32);
            },
            n,
        )
    }

    /// Runs an elementwise kernel over `n` elements; `push` gives its arguments, the
    /// 64-bit count last.
    fn elementwise<'a>(
        &'a self,
        function: &'a CudaFunction,
        n: usize,
        push: impl FnOnce(&mut LaunchArgs<'a>),
    ) -> Result<(), CudaError> {
        let mut launch = self.stream.launch_builder(function);
        push(&mut launch);
        // SAFETY: every caller pushes the kernel's arguments in its order, with views of
        // exactly n elements and n as the count, which bounds what the kernel touches.
        unsafe { launch.launch(per_element(n)) }?;
        Ok(())
    }

    /// out = gelu(inp), elementwise.
    pub fn gelu_forward<T: CudaFloat>(
        &self,
        out: &mut CudaViewMut<'_, T>,
        inp: &CudaView<'_, T>,
    ) -> Result<(), CudaError> {
        let n = out.len();
        assert_eq!(inp.len(), n);
        let n64 = n as i64;
        self.elementwise(self.function("gelu_forward", T::SUFFIX), n, |l| {
            l.arg(out).arg(inp).arg(&n64);
        })
    }

    /// dinp = gelu'(inp) * dout, elementwise.
    pub fn gelu_backward<T: CudaFloat>(
        &self,
        dinp: &mut CudaViewMut<'_, T>,
        inp: &CudaView<'_, T>,
        dout: &CudaView<'_, T>,
    ) -> Result<(), CudaError> {
        let n = dinp.len();
        assert_eq!((inp.len(), dout.len()), (n, n));
        let n64 = n as i64;
        self.elementwise(self.function("gelu_backward", T::SUFFIX), n, |l| {
            l.arg(dinp).arg(inp).arg(dout).arg(&n64);
        })
    }

    /// out = a + b, elementwise.
    pub fn residual_forward<T: CudaFloat>(
        &self,
        out: &mut CudaViewMut<'_, T>,
        a: &CudaView<'_, T>,
        b: &CudaView<'_, T>,
    ) -> Result<(), CudaError> {
        let n = out.len();
        assert_eq!((a.len(), b.len()), (n, n));
        let n64 = n as i64;
        self.elementwise(self.function("residual_forward", T::SUFFIX), n, |l| {
            l.arg(out).arg(a).arg(b).arg(&n64);
        })
    }

    /// losses: (N)  logits: (N, V)  targets: (N).
    pub fn crossentropy_forward<T: CudaFloat>(
        &self,
        losses: &mut CudaViewMut<'_, f32>,
        logits: &CudaView<'_, T>,
        targets: &CudaView<'_, u32>,
        n: usize,
        v: usize,
    ) -> Result<(), CudaError> {
        assert_eq!((losses.len(), targets.len(), logits.len()), (n, n, n * v));
        if n == 0 {
            // The launch below always starts at least one block, and the kernel trusts
            // its grid to be n rows.
            return Ok(());
        }
        let v32 = int(v);
        let mut launch = self
            .stream
            .launch_builder(self.function("crossentropy_forward", T::SUFFIX));
        launch.arg(losses).arg(logits).arg(targets).arg(&v32);
        // SAFETY: matches crossentropy_forward_<T>; block r touches row r of logits (v
        // elements), losses[r] and targets[r], r < n; targets are checked against v.
        unsafe { launch.launch(per_row_block(n)) }?;
        Ok(())
    }

    /// logits: (N, V) replaced by `(softmax - onehot(targets)) * dloss`.
    pub fn crossentropy_backward<T: CudaFloat>(
        &self,
        logits: &mut CudaViewMut<'_, T>,
        targets: &CudaView<'_, u32>,
        dloss: f32,
        n: usize,
        v: usize,
    ) -> Result<(), CudaError> {
        assert_eq!((targets.len(), logits.len()), (n, n * v));
        if n == 0 {
            // As in crossentropy_forward: no block may run for no rows.
            return Ok(());
        }
        let v32 = int(v);
        let mut launch = self
            .stream
            .launch_builder(self.function("crossentropy_backward", T::SUFFIX));
        launch.arg(logits).arg(targets).arg(&dloss).arg(&v32);
        // SAFETY: matches crossentropy_backward_<T>; block r touches row r of logits and
        // targets[r], r < n.
        unsafe { launch.launch(per_row_block(n)) }?;
        Ok(())
    }

    /// One of the cast kernels over `inp.len()` elements.
    fn cast<A: DeviceRepr, B: DeviceRepr>(
        &self,
        kernel: &'static str,
        out: &mut CudaViewMut<'_, B>,
        inp: &CudaView<'_, A>,
    ) -> Result<(), CudaError> {
        assert_eq!(out.len(), inp.len());
        let n64 = inp.len() as i64;
        self.elementwise(self.function(kernel, ""), inp.len(), |l| {
            l.arg(out).arg(inp).arg(&n64);
        })
    }

    /// out: (N) bf16 = inp: (N) f32, rounded to nearest even.
    pub fn f32_to_bf16(
        &self,
        out: &mut CudaViewMut<'_, bf16>,
        inp: &CudaView<'_, f32>,
    ) -> Result<(), CudaError> {
        self.cast("cast_f32_to_bf16", out, inp)
    }

    /// out: (N) f32 = inp: (N) bf16.
    pub fn bf16_to_f32(
        &self,
        out: &mut CudaViewMut<'_, f32>,
        inp: &CudaView<'_, bf16>,
    ) -> Result<(), CudaError> {
        self.cast("cast_bf16_to_f32", out, inp)
    }

    /// out: (N) fp16 = inp: (N) f32, rounded to nearest even.
    pub fn f32_to_f16(
        &self,
        out: &mut CudaViewMut<'_, f16>,
        inp: &CudaView<'_, f32>,
    ) -> Result<(), CudaError> {
        self.cast("cast_f32_to_f16", out, inp)
    }

    /// out: (N) f32 = inp: (N) fp16.
    pub fn f16_to_f32(
        &self,
        out: &mut CudaViewMut<'_, f32>,
        inp: &CudaView<'_, f16>,
    ) -> Result<(), CudaError> {
        self.cast("cast_f16_to_f32", out, inp)
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
