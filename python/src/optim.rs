//! The AdamW step for `strata.optim.CPUAdamW`: one call per parameter tensor, on the
//! memory of the caller's tensors (no copy), with the GIL released while the kernel runs.
//!
//! This module checks the tensors (dtypes, element counts, alignment, that no two
//! written buffers overlap) and hands them to `strata_kernels::adamw`; the optimizer's
//! bookkeeping (param groups, state, steps) is Python's, in `strata/optim.py`.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use strata_kernels::adamw::{AdamStep, AdamW, CopyOut, Grads, Q8State, State, bf16, f16, q8};
use strata_kernels::isa::Isa;

use crate::view::{Dtype, View, expect_dtype, expect_numel, view, view_mut};

/// Bytes of one view as a slice of `T`.
///
/// # Safety
/// `v` must describe live memory of `v.numel` elements of `T`, aligned for `T`, that
/// nothing else writes while the slice is used.
unsafe fn slice<'a, T>(v: &View) -> &'a [T] {
    // SAFETY: the caller's promise; an empty view may have a dangling address.
    unsafe { std::slice::from_raw_parts(nonnull::<T>(v.addr), v.numel) }
}

/// As [`slice`], writable.
///
/// # Safety
/// As [`slice`], and nothing else reads or writes the memory while the slice is used.
unsafe fn slice_mut<'a, T>(v: &View) -> &'a mut [T] {
    // SAFETY: the caller's promise.
    unsafe { std::slice::from_raw_parts_mut(nonnull::<T>(v.addr) as *mut T, v.numel) }
}

fn nonnull<T>(addr: usize) -> *const T {
    if addr == 0 {
        std::ptr::NonNull::<T>::dangling().as_ptr()
    } else {
        addr as *const T
    }
}

/// The lengths of 8-bit state for `n` parameters: (codes, scales).
#[pyfunction]
pub fn q8_sizes(n: usize) -> (usize, usize) {
    (n, q8::scale_count(n))
}

/// One tensor's AdamW step, every view checked: what [`Job::run`] updates.
struct Job {
    param: View,
    grad: View,
    /// `(m, v)` or the four tensors of 8-bit state.
    state: Vec<View>,
    copy_out: Option<View>,
    step: AdamStep,
}

/// The AdamW hyperparameters of a `(lr, beta1, beta2, eps, weight_decay)` tuple.
fn adamw_of(hyper: (f64, f64, f64, f64, f64)) -> AdamW {
    AdamW {
        lr: hyper.0,
        beta1: hyper.1,
        beta2: hyper.2,
        eps: hyper.3,
        weight_decay: hyper.4,
    }
}

/// Checks `(lr, beta1, beta2, eps, weight_decay)` by the kernel's rule (ValueError).
#[pyfunction]
pub fn adamw_check(hyper: (f64, f64, f64, f64, f64)) -> PyResult<()> {
    AdamStep::new(&adamw_of(hyper), 1, 1.0).map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(())
}

/// One AdamW step of one tensor.
///
/// `state` is `(m, v)` (both fp32 or both bf16) or `(m_codes, m_scales, v_codes,
/// v_scales)` (8-bit);
/// `hyper` is `(lr, beta1, beta2, eps, weight_decay)`; `copy_out`, if given, receives the
/// updated parameters in fp16 or bf16.
#[pyfunction]
#[pyo3(signature = (param, grad, state, hyper, step, grad_scale, threads, copy_out=None))]
#[allow(clippy::too_many_arguments)]
pub fn adamw_step(
    py: Python<'_>,
    param: &Bound<'_, PyAny>,
    grad: &Bound<'_, PyAny>,
    state: Vec<Bound<'_, PyAny>>,
    hyper: (f64, f64, f64, f64, f64),
    step: u64,
    grad_scale: f32,
    threads: usize,
    copy_out: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let job = Job::check(param, grad, &state, hyper, step, grad_scale, copy_out)?;
    let threads = threads.max(1);
    py.detach(move || job.run(threads))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// The tensors of one step: `(param, grad, state, hyper, step, copy_out)` as for
/// [`adamw_step`].
type JobArgs<'py> = (
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Vec<Bound<'py, PyAny>>,
    (f64, f64, f64, f64, f64),
    u64,
    Option<Bound<'py, PyAny>>,
);

/// One AdamW step of many tensors, all checked before any is updated (so a refused
/// tensor leaves every tensor as it was), then updated with the GIL released once. A
/// refusal names the tensor by its label in `labels`.
#[pyfunction]
pub fn adamw_steps(
    py: Python<'_>,
    jobs: Vec<JobArgs<'_>>,
    labels: Vec<String>,
    grad_scale: f32,
    threads: usize,
) -> PyResult<()> {
    if labels.len() != jobs.len() {
        return Err(PyValueError::new_err(format!(
            "{} jobs but {} labels",
            jobs.len(),
            labels.len()
        )));
    }
    let mut checked = Vec::with_capacity(jobs.len());
    for ((param, grad, state, hyper, step, copy_out), label) in jobs.iter().zip(&labels) {
        let job = Job::check(
            param,
            grad,
            state,
            *hyper,
            *step,
            grad_scale,
            copy_out.as_ref(),
        )
        .map_err(|e| {
            let message = format!("{label}: {}", e.value(py));
            PyErr::from_type(e.get_type(py), message)
        })?;
        checked.push(job);
    }
    let threads = threads.max(1);
    py.detach(move || checked.iter().try_for_each(|job| job.run(threads)))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

impl Job {
    /// Checks every tensor of one step: CPU, contiguous, writable where written, dtype,
    /// element count, alignment, no overlap between written buffers or with the
    /// gradient; and the hyperparameters.
    fn check(
        param: &Bound<'_, PyAny>,
        grad: &Bound<'_, PyAny>,
        state: &[Bound<'_, PyAny>],
        hyper: (f64, f64, f64, f64, f64),
        step: u64,
        grad_scale: f32,
        copy_out: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Job> {
        let p = view_mut(param, "the parameter")?;
        expect_dtype(&p, "the parameter (the fp32 master copy)", &[Dtype::F32])?;
        let n = p.numel;
        let g = view(grad, "the gradient")?;
        expect_dtype(&g, "the gradient", &[Dtype::F32, Dtype::F16, Dtype::Bf16])?;
        expect_numel(&g, "the gradient", n, "the parameter")?;
        let mut written = vec![(p, "the parameter")];
        let state_views = state_views(state, n, &mut written)?;
        let out = match copy_out {
            Some(obj) => {
                let o = view_mut(obj, "the working copy")?;
                expect_dtype(&o, "the working copy", &[Dtype::F16, Dtype::Bf16])?;
                expect_numel(&o, "the working copy", n, "the parameter")?;
                written.push((o, "the working copy"));
                Some(o)
            }
            None => None,
        };
        // Rust may not alias a written slice: refuse shared memory instead.
        for (i, (a, a_name)) in written.iter().enumerate() {
            if a.overlaps(&g) {
                return Err(PyValueError::new_err(format!(
                    "{a_name} and the gradient share memory"
                )));
            }
            for (b, b_name) in &written[i + 1..] {
                if a.overlaps(b) {
                    return Err(PyValueError::new_err(format!(
                        "{a_name} and {b_name} share memory"
                    )));
                }
            }
        }
        let step = AdamStep::new(&adamw_of(hyper), step, grad_scale)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Job {
            param: p,
            grad: g,
            state: state_views,
            copy_out: out,
            step,
        })
    }

    /// Runs the kernel on the checked tensors.
    fn run(&self, threads: usize) -> Result<(), strata_kernels::adamw::AdamError> {
        let (p, g, state_views) = (&self.param, &self.grad, &self.state);
        // SAFETY: every view was checked by `Job::check` (CPU, contiguous, writable where
        // written, dtype, element count, alignment, no overlap between written buffers or
        // with the gradient); the Python objects owning them are borrowed by the caller
        // for the whole call, so the memory stays alive.
        unsafe {
            let params = slice_mut::<f32>(p);
            let grads = match g.dtype {
                Dtype::F32 => Grads::F32(slice::<f32>(g)),
                Dtype::F16 => Grads::F16(slice::<f16>(g)),
                _ => Grads::Bf16(slice::<bf16>(g)),
            };
            let state = if state_views.len() == 2 && state_views[0].dtype == Dtype::Bf16 {
                State::Bf16 {
                    m: slice_mut::<bf16>(&state_views[0]),
                    v: slice_mut::<bf16>(&state_views[1]),
                }
            } else if state_views.len() == 2 {
                State::F32 {
                    m: slice_mut::<f32>(&state_views[0]),
                    v: slice_mut::<f32>(&state_views[1]),
                }
            } else {
                State::Q8(Q8State {
                    m_codes: slice_mut::<u8>(&state_views[0]),
                    m_scales: slice_mut::<f32>(&state_views[1]),
                    v_codes: slice_mut::<u8>(&state_views[2]),
                    v_scales: slice_mut::<f32>(&state_views[3]),
                })
            };
            let copy_out = match self.copy_out {
                None => CopyOut::None,
                Some(o) if o.dtype == Dtype::F16 => CopyOut::F16(slice_mut::<f16>(&o)),
                Some(o) => CopyOut::Bf16(slice_mut::<bf16>(&o)),
            };
            self.step
                .apply(Isa::active(), threads, params, state, grads, copy_out)
        }
    }
}

/// The views of a parameter's optimizer state for `n` parameters, checked, added to
/// `written`: `(m, v)` (both fp32 or both bf16) or the four tensors of 8-bit state.
fn state_views(
    state: &[Bound<'_, PyAny>],
    n: usize,
    written: &mut Vec<(View, &'static str)>,
) -> PyResult<Vec<View>> {
    match state.len() {
        2 => {
            let m = view_mut(&state[0], "exp_avg")?;
            let v = view_mut(&state[1], "exp_avg_sq")?;
            for (x, name) in [(&m, "exp_avg"), (&v, "exp_avg_sq")] {
                expect_dtype(x, name, &[Dtype::F32, Dtype::Bf16])?;
                expect_numel(x, name, n, "the parameter")?;
                written.push((*x, name));
            }
            if m.dtype != v.dtype {
                return Err(PyTypeError::new_err(format!(
                    "exp_avg is {} but exp_avg_sq is {}: both moments must be float32 or \
                     both bfloat16",
                    m.dtype.name(),
                    v.dtype.name()
                )));
            }
            Ok(vec![m, v])
        }
        4 => {
            let views = q8_views(state, n, true, "8-bit state of the parameter")?;
            let names = ["m codes", "m scales", "v codes", "v scales"];
            written.extend(views.iter().copied().zip(names));
            Ok(views)
        }
        k => Err(PyValueError::new_err(format!(
            "the state has {k} tensors: fp32 and bf16 state are (exp_avg, exp_avg_sq), \
             8-bit state (m codes, m scales, v codes, v scales)"
        ))),
    }
}

/// The four tensors of 8-bit state for `n` parameters (m codes, m scales, v codes,
/// v scales), checked for dtype and length; writable ones when `writable`.
fn q8_views(objs: &[Bound<'_, PyAny>], n: usize, writable: bool, of: &str) -> PyResult<Vec<View>> {
    let names = ["m codes", "m scales", "v codes", "v scales"];
    let mut views = Vec::new();
    for (obj, name) in objs.iter().zip(names) {
        let x = if writable {
            view_mut(obj, name)?
        } else {
            view(obj, name)?
        };
        let (dtype, count) = if name.ends_with("codes") {
            (Dtype::U8, n)
        } else {
            (Dtype::F32, q8::scale_count(n))
        };
        expect_dtype(&x, name, &[dtype])?;
        expect_numel(&x, name, count, of)?;
        views.push(x);
    }
    Ok(views)
}

/// Converts fp32 moments to 8-bit state, or back (`to_q8` false), for state dicts.
#[pyfunction]
pub fn q8_convert(
    py: Python<'_>,
    m: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    q8_state: Vec<Bound<'_, PyAny>>,
    to_q8: bool,
) -> PyResult<()> {
    let view_of = |obj, name| {
        if to_q8 {
            view(obj, name)
        } else {
            view_mut(obj, name)
        }
    };
    let mv = view_of(m, "exp_avg")?;
    let vv = view_of(v, "exp_avg_sq")?;
    expect_dtype(&mv, "exp_avg", &[Dtype::F32])?;
    expect_dtype(&vv, "exp_avg_sq", &[Dtype::F32])?;
    let n = mv.numel;
    expect_numel(&vv, "exp_avg_sq", n, "exp_avg")?;
    if q8_state.len() != 4 {
        return Err(PyValueError::new_err("8-bit state is four tensors"));
    }
    let q = q8_views(&q8_state, n, to_q8, "8-bit state of the moments")?;
    let all: Vec<&View> = [&mv, &vv].into_iter().chain(q.iter()).collect();
    for (i, a) in all.iter().enumerate() {
        if all[i + 1..].iter().any(|b| a.overlaps(b)) {
            return Err(PyValueError::new_err("state tensors share memory"));
        }
    }
    py.detach(move || {
        // SAFETY: as in adamw_step: checked views of distinct live memory.
        unsafe {
            if to_q8 {
                q8::quantize_m(slice(&mv), slice_mut(&q[0]), slice_mut(&q[1]));
                q8::quantize_v(slice(&vv), slice_mut(&q[2]), slice_mut(&q[3]));
            } else {
                q8::dequantize_m(slice(&q[0]), slice(&q[1]), slice_mut(&mv));
                q8::dequantize_v(slice(&q[2]), slice(&q[3]), slice_mut(&vv));
            }
        }
    });
    Ok(())
}

/// The threads of the kernels' worker pool (one per available core).
#[pyfunction]
pub fn max_threads() -> usize {
    strata_kernels::parallel::max_threads()
}

/// The instruction set the kernels use.
#[pyfunction]
pub fn isa() -> &'static str {
    Isa::active().name()
}
