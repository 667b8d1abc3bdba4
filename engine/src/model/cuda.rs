//! The model on a GPU: [`CudaBackend`] runs the blocks' operations with the kernels of
//! `strata_kernels::cuda`, in f32 or bf16, on one stream, normally the compute stream of
//! the device layer's [`CudaDevice`].
//!
//! Activations and parameters are in the working type `T`; parameter gradients,
//! LayerNorm statistics and losses are f32. Every operation is enqueued on the one
//! stream, so stream order alone orders them (the device's context has cudarc's event
//! tracking off). Downloads wait for the stream.
//!
//! Buffers are cudarc allocations on that stream (`cuMemAllocAsync`), not ranges of the
//! device's arena: this backend serves whole-model passes (evaluation, tests, timing)
//! where everything is resident. Placing a block's buffers in the arena, by the swap
//! plan, is the executor's work.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaViewMut};
/// The bf16 type of the CUDA backend's bf16 path.
pub use half::bf16;
use strata_kernels::cuda::{AttentionScratch, CudaError, CudaFloat, CudaKernels};
use strata_kernels::ops::{self, Cpu, WeightLayout};

use super::backend::{Backend, Dims, HostParams};
use super::{ModelError, Slot};
use crate::device::{CudaDevice, Lane};

/// A working type of the CUDA backend, with its host conversions.
pub trait DeviceFloat: CudaFloat + crate::device::Plain {
    /// The name used in messages and on the command line.
    const NAME: &'static str;
    /// Host f32 values in this type (rounded to nearest even).
    fn from_host(host: &[f32]) -> Vec<Self>;
    /// Host values of this type as f32 (exact).
    fn to_host(values: &[Self]) -> Vec<f32>;
}

impl DeviceFloat for f32 {
    const NAME: &'static str = "f32";
    fn from_host(host: &[f32]) -> Vec<Self> {
        host.to_vec()
    }
    fn to_host(values: &[Self]) -> Vec<f32> {
        values.to_vec()
    }
}

impl DeviceFloat for bf16 {
    const NAME: &'static str = "bf16";
    fn from_host(host: &[f32]) -> Vec<Self> {
        let mut out = vec![bf16::ZERO; host.len()];
        ops::f32_to_bf16(&Cpu::default(), &mut out, host);
        out
    }
    fn to_host(values: &[Self]) -> Vec<f32> {
        let mut out = vec![0.0; values.len()];
        ops::bf16_to_f32(&Cpu::default(), &mut out, values);
        out
    }
}

/// GPT-2's operations on one CUDA stream, in working type `T`.
pub struct CudaBackend<T> {
    kernels: CudaKernels,
    name: String,
    _working: PhantomData<T>,
}

impl<T: DeviceFloat> CudaBackend<T> {
    /// The backend on `device`'s compute stream.
    pub fn on_device(device: &CudaDevice) -> Result<Self, ModelError> {
        let stream = Arc::clone(device.stream(Lane::Compute));
        let mut backend = Self::on_stream(stream)?;
        backend.name = format!("{} ({}) {}", device.name(), device.gpu_name(), T::NAME);
        Ok(backend)
    }

    /// The backend on `stream` (its kernels load into the stream's context).
    pub fn on_stream(stream: Arc<CudaStream>) -> Result<Self, ModelError> {
        let ordinal = stream.context().ordinal();
        Ok(CudaBackend {
            kernels: CudaKernels::new(stream)?,
            name: format!("cuda:{ordinal} {}", T::NAME),
            _working: PhantomData,
        })
    }

    /// The stream every operation is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.kernels.stream()
    }

    /// Waits until the stream has finished everything enqueued so far.
    pub fn synchronize(&self) -> Result<(), ModelError> {
        self.stream().synchronize().map_err(CudaError::from)?;
        Ok(())
    }
}

fn driver(e: cudarc::driver::DriverError) -> ModelError {
    ModelError::Cuda(CudaError::from(e))
}

/// Runs `f` on two disjoint slots of `buf`, mutably, in the order given.
fn with_two_slots<R>(
    buf: &mut CudaSlice<f32>,
    a: Slot,
    b: Slot,
    f: impl FnOnce(&mut CudaViewMut<'_, f32>, &mut CudaViewMut<'_, f32>) -> R,
) -> R {
    assert!(
        a.range().end <= b.offset || b.range().end <= a.offset,
        "slots overlap"
    );
    let (first, second) = if a.offset < b.offset { (a, b) } else { (b, a) };
    let (mut low, mut high) = buf.split_at_mut(second.offset);
    let mut x = low.slice_mut(first.range());
    let mut y = high.slice_mut(..second.len);
    if a.offset < b.offset {
        f(&mut x, &mut y)
    } else {
        f(&mut y, &mut x)
    }
}

impl<T: DeviceFloat> Backend for CudaBackend<T> {
    type Act = CudaSlice<T>;
    type Params = CudaSlice<T>;
    type Grads = CudaSlice<f32>;
    type Stats = CudaSlice<f32>;
    type Tokens = CudaSlice<u32>;
    type AttentionScratch = AttentionScratch<T>;

    fn describe(&self) -> String {
        self.name.clone()
    }

    fn alloc_act(&self, len: usize) -> Result<CudaSlice<T>, ModelError> {
        self.stream().alloc_zeros(len).map_err(driver)
    }
    fn alloc_stats(&self, len: usize) -> Result<CudaSlice<f32>, ModelError> {
        self.stream().alloc_zeros(len).map_err(driver)
    }
    fn alloc_tokens(&self, len: usize) -> Result<CudaSlice<u32>, ModelError> {
        self.stream().alloc_zeros(len).map_err(driver)
    }
    fn alloc_grads(&self, len: usize) -> Result<CudaSlice<f32>, ModelError> {
        self.stream().alloc_zeros(len).map_err(driver)
    }
    fn alloc_attention_scratch(&self, d: Dims) -> Result<AttentionScratch<T>, ModelError> {
        Ok(AttentionScratch::new(
            self.stream(),
            d.batch,
            d.seq,
            d.width,
            d.heads,
        )?)
    }

    fn alloc_params(&self, len: usize) -> Result<CudaSlice<T>, ModelError> {
        self.stream().alloc_zeros(len).map_err(driver)
    }
    fn write_params(&self, dst: &mut CudaSlice<T>, src: HostParams<'_>) -> Result<(), ModelError> {
        assert!(src.len() <= dst.len(), "parameters longer than their slot");
        // Converted on the host (a staging vector per call: the executor's pinned,
        // typed staging for GPU uploads is not built yet).
        let mut f32s = vec![0.0; src.len()];
        src.to_f32(&Cpu::default(), &mut f32s);
        let values = T::from_host(&f32s);
        let mut view = dst.slice_mut(..src.len());
        self.stream()
            .memcpy_htod(&values, &mut view)
            .map_err(driver)
    }
    fn read_grads(
        &self,
        src: &CudaSlice<f32>,
        dst: &mut [f32],
        accumulate: bool,
    ) -> Result<(), ModelError> {
        let view = src.slice(..dst.len());
        if accumulate {
            let mut tmp = vec![0.0; dst.len()];
            self.stream().memcpy_dtoh(&view, &mut tmp).map_err(driver)?;
            self.synchronize()?;
            dst.iter_mut().zip(&tmp).for_each(|(d, s)| *d += s);
        } else {
            self.stream().memcpy_dtoh(&view, dst).map_err(driver)?;
            self.synchronize()?;
        }
        Ok(())
    }
    fn read_act(&self, src: &CudaSlice<T>, dst: &mut [u8]) -> Result<(), ModelError> {
        let dst = crate::device::cast_mut::<T>(dst);
        let view = src.slice(..dst.len());
        self.stream().memcpy_dtoh(&view, dst).map_err(driver)?;
        self.synchronize()
    }
    fn write_act(&self, dst: &mut CudaSlice<T>, src: &[u8]) -> Result<(), ModelError> {
        let src = crate::device::cast::<T>(src);
        let mut view = dst.slice_mut(..src.len());
        self.stream().memcpy_htod(src, &mut view).map_err(driver)
    }
    fn add_grads(
        &self,
        _dst: &mut CudaSlice<f32>,
        _src: &CudaSlice<f32>,
    ) -> Result<(), ModelError> {
        // The planner keeps gradients on a GPU only with optimizer state there, which it
        // refuses on a GPU (the optimizer runs on the CPU), so this is never planned.
        Err(ModelError::BadInput(
            "gradient accumulation in GPU memory is not built; offload gradients (cpu-offload)"
                .into(),
        ))
    }
    fn read_stats(&self, src: &CudaSlice<f32>, dst: &mut [f32]) -> Result<(), ModelError> {
        let view = src.slice(..dst.len());
        self.stream().memcpy_dtoh(&view, dst).map_err(driver)?;
        self.synchronize()
    }
    fn upload_params(&self, host: &[f32]) -> Result<CudaSlice<T>, ModelError> {
        self.stream()
            .clone_htod(&T::from_host(host))
            .map_err(driver)
    }
    fn upload_tokens(&self, dst: &mut CudaSlice<u32>, host: &[u32]) -> Result<(), ModelError> {
        assert_eq!(dst.len(), host.len());
        self.stream().memcpy_htod(host, dst).map_err(driver)
    }
    fn download_act(&self, src: &CudaSlice<T>) -> Result<Vec<f32>, ModelError> {
        Ok(T::to_host(&self.stream().clone_dtoh(src).map_err(driver)?))
    }
    fn download_stats(&self, src: &CudaSlice<f32>) -> Result<Vec<f32>, ModelError> {
        self.stream().clone_dtoh(src).map_err(driver)
    }
    fn download_grads(&self, src: &CudaSlice<f32>) -> Result<Vec<f32>, ModelError> {
        self.stream().clone_dtoh(src).map_err(driver)
    }

    fn zero_act(&self, dst: &mut CudaSlice<T>) -> Result<(), ModelError> {
        self.stream().memset_zeros(dst).map_err(driver)
    }
    fn zero_grads(&self, dst: &mut CudaSlice<f32>) -> Result<(), ModelError> {
        self.stream().memset_zeros(dst).map_err(driver)
    }
    fn copy_act(&self, dst: &mut CudaSlice<T>, src: &CudaSlice<T>) -> Result<(), ModelError> {
        assert_eq!(dst.len(), src.len());
        self.stream().memcpy_dtod(src, dst).map_err(driver)
    }

    fn encoder_forward(
        &self,
        out: &mut CudaSlice<T>,
        tokens: &CudaSlice<u32>,
        params: &CudaSlice<T>,
        wte: Slot,
        wpe: Slot,
        d: Dims,
    ) -> Result<(), ModelError> {
        let (wte, wpe) = (params.slice(wte.range()), params.slice(wpe.range()));
        let (b, t, c) = (d.batch, d.seq, d.width);
        let tokens = tokens.as_view();
        Ok(self
            .kernels
            .encoder_forward(&mut out.as_view_mut(), &tokens, &wte, &wpe, b, t, c)?)
    }
    fn encoder_backward(
        &self,
        grads: &mut CudaSlice<f32>,
        wte: Slot,
        wpe: Slot,
        dout: &CudaSlice<T>,
        tokens: &CudaSlice<u32>,
        d: Dims,
    ) -> Result<(), ModelError> {
        let (dout, tokens) = (dout.as_view(), tokens.as_view());
        with_two_slots(grads, wte, wpe, |dwte, dwpe| {
            let (b, t, c) = (d.batch, d.seq, d.width);
            Ok(self
                .kernels
                .encoder_backward(dwte, dwpe, &dout, &tokens, b, t, c)?)
        })
    }
    fn layernorm_forward(
        &self,
        out: &mut CudaSlice<T>,
        mean: &mut CudaSlice<f32>,
        rstd: &mut CudaSlice<f32>,
        inp: &CudaSlice<T>,
        params: &CudaSlice<T>,
        weight: Slot,
        bias: Slot,
        n: usize,
        c: usize,
    ) -> Result<(), ModelError> {
        let (w, b) = (params.slice(weight.range()), params.slice(bias.range()));
        Ok(self.kernels.layernorm_forward(
            &mut out.as_view_mut(),
            &mut mean.as_view_mut(),
            &mut rstd.as_view_mut(),
            &inp.as_view(),
            &w,
            &b,
            n,
            c,
        )?)
    }
    fn layernorm_backward(
        &self,
        dinp: &mut CudaSlice<T>,
        grads: &mut CudaSlice<f32>,
        dout: &CudaSlice<T>,
        inp: &CudaSlice<T>,
        params: &CudaSlice<T>,
        weight: Slot,
        bias: Slot,
        mean: &CudaSlice<f32>,
        rstd: &CudaSlice<f32>,
        n: usize,
        c: usize,
    ) -> Result<(), ModelError> {
        let w = params.slice(weight.range());
        let (dout, inp, mean, rstd) = (
            dout.as_view(),
            inp.as_view(),
            mean.as_view(),
            rstd.as_view(),
        );
        with_two_slots(grads, weight, bias, |dw, db| {
            let mut dinp = dinp.as_view_mut();
            Ok(self
                .kernels
                .layernorm_backward(&mut dinp, dw, db, &dout, &inp, &w, &mean, &rstd, n, c)?)
        })
    }
    fn matmul_forward(
        &self,
        out: &mut CudaSlice<T>,
        inp: &CudaSlice<T>,
        params: &CudaSlice<T>,
        weight: Slot,
        bias: Option<Slot>,
        layout: WeightLayout,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<(), ModelError> {
        let w = params.slice(weight.range());
        let b = bias.map(|b| params.slice(b.range()));
        let mut out = out.as_view_mut();
        Ok(self.kernels.matmul_forward(
            &mut out,
            &inp.as_view(),
            &w,
            b.as_ref(),
            layout,
            n,
            c,
            oc,
        )?)
    }
    fn matmul_backward(
        &self,
        dinp: &mut CudaSlice<T>,
        grads: &mut CudaSlice<f32>,
        dout: &CudaSlice<T>,
        inp: &CudaSlice<T>,
        params: &CudaSlice<T>,
        weight: Slot,
        bias: Option<Slot>,
        layout: WeightLayout,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<(), ModelError> {
        let w = params.slice(weight.range());
        let (dout, inp) = (dout.as_view(), inp.as_view());
        let k = &self.kernels;
        match bias {
            Some(bias) => with_two_slots(grads, weight, bias, |dw, db| {
                let mut dinp = dinp.as_view_mut();
                Ok(k.matmul_backward(&mut dinp, dw, Some(db), &dout, &inp, &w, layout, n, c, oc)?)
            }),
            None => {
                let mut dw = grads.slice_mut(weight.range());
                let mut dinp = dinp.as_view_mut();
                Ok(k.matmul_backward(&mut dinp, &mut dw, None, &dout, &inp, &w, layout, n, c, oc)?)
            }
        }
    }
    fn attention_forward(
        &self,
        out: &mut CudaSlice<T>,
        att: &mut CudaSlice<T>,
        qkv: &CudaSlice<T>,
        scratch: &mut AttentionScratch<T>,
        d: Dims,
    ) -> Result<(), ModelError> {
        let (mut out, mut att) = (out.as_view_mut(), att.as_view_mut());
        let (b, t, c, nh) = (d.batch, d.seq, d.width, d.heads);
        Ok(self.kernels.attention_forward(
            &mut out,
            &mut att,
            &qkv.as_view(),
            scratch,
            b,
            t,
            c,
            nh,
        )?)
    }
    fn attention_backward(
        &self,
        dqkv: &mut CudaSlice<T>,
        dout: &CudaSlice<T>,
        qkv: &CudaSlice<T>,
        att: &CudaSlice<T>,
        scratch: &mut AttentionScratch<T>,
        d: Dims,
    ) -> Result<(), ModelError> {
        let mut dqkv = dqkv.as_view_mut();
        let (dout, qkv, att) = (dout.as_view(), qkv.as_view(), att.as_view());
        let (b, t, c, nh) = (d.batch, d.seq, d.width, d.heads);
        Ok(self
            .kernels
            .attention_backward(&mut dqkv, &dout, &qkv, &att, scratch, b, t, c, nh)?)
    }
    fn gelu_forward(&self, out: &mut CudaSlice<T>, inp: &CudaSlice<T>) -> Result<(), ModelError> {
        Ok(self
            .kernels
            .gelu_forward(&mut out.as_view_mut(), &inp.as_view())?)
    }
    fn gelu_backward(
        &self,
        dinp: &mut CudaSlice<T>,
        inp: &CudaSlice<T>,
        dout: &CudaSlice<T>,
    ) -> Result<(), ModelError> {
        Ok(self
            .kernels
            .gelu_backward(&mut dinp.as_view_mut(), &inp.as_view(), &dout.as_view())?)
    }
    fn residual_forward(
        &self,
        out: &mut CudaSlice<T>,
        a: &CudaSlice<T>,
        b: &CudaSlice<T>,
    ) -> Result<(), ModelError> {
        Ok(self
            .kernels
            .residual_forward(&mut out.as_view_mut(), &a.as_view(), &b.as_view())?)
    }
    fn crossentropy_forward(
        &self,
        losses: &mut CudaSlice<f32>,
        logits: &CudaSlice<T>,
        targets: &CudaSlice<u32>,
        n: usize,
        v: usize,
    ) -> Result<(), ModelError> {
        let (logits, targets) = (logits.as_view(), targets.as_view());
        Ok(self
            .kernels
            .crossentropy_forward(&mut losses.as_view_mut(), &logits, &targets, n, v)?)
    }
    fn crossentropy_backward(
        &self,
        logits: &mut CudaSlice<T>,
        targets: &CudaSlice<u32>,
        dloss: f32,
        n: usize,
        v: usize,
    ) -> Result<(), ModelError> {
        let mut logits = logits.as_view_mut();
        Ok(self
            .kernels
            .crossentropy_backward(&mut logits, &targets.as_view(), dloss, n, v)?)
    }
}
