//! The memory behind a Python tensor: a torch tensor (through its data pointer) or a
//! numpy array (through `__array_interface__`), checked before strata touches it.
//!
//! Every check that keeps the interpreter alive lives here: the device (a CUDA tensor
//! where a CPU one is needed is a TypeError), the layout (sparse, non-contiguous or
//! read-only memory is a ValueError), the dtype (a TypeError naming what was expected),
//! the alignment of the element type. What this module does not do: keep another Python
//! thread from resizing or freeing a tensor while strata works on it (as with torch's own
//! operations that release the GIL, the caller must not do that).

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

/// The element types strata reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F16,
    Bf16,
    U8,
    /// Anything else (I/O moves bytes of any dtype).
    Other(usize),
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::U8 => 1,
            Dtype::Other(size) => size,
        }
    }

    /// The name torch gives it.
    pub fn name(self) -> String {
        match self {
            Dtype::F32 => "float32".into(),
            Dtype::F16 => "float16".into(),
            Dtype::Bf16 => "bfloat16".into(),
            Dtype::U8 => "uint8".into(),
            Dtype::Other(size) => format!("another dtype ({size} bytes per element)"),
        }
    }
}

/// A contiguous CPU buffer owned by a Python object.
#[derive(Debug, Clone, Copy)]
pub struct View {
    /// The first byte.
    pub addr: usize,
    /// How many elements.
    pub numel: usize,
    /// Their type.
    pub dtype: Dtype,
    /// Whether strata may write into it.
    pub writable: bool,
}

impl View {
    /// Bytes.
    pub fn nbytes(&self) -> usize {
        self.numel * self.dtype.size()
    }

    /// Whether the byte ranges of two views overlap.
    pub fn overlaps(&self, other: &View) -> bool {
        let (a0, a1) = (self.addr, self.addr + self.nbytes());
        let (b0, b1) = (other.addr, other.addr + other.nbytes());
        a0 < b1 && b0 < a1 && self.nbytes() > 0 && other.nbytes() > 0
    }
}

/// Reads the memory of `obj` (a torch tensor or a numpy array); `what` names it in errors.
pub fn view(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<View> {
    if obj.hasattr("data_ptr")? && obj.hasattr("is_contiguous")? && obj.hasattr("device")? {
        torch_view(obj, what)
    } else if obj.hasattr("__array_interface__")? {
        numpy_view(obj, what)
    } else {
        Err(PyTypeError::new_err(format!(
            "{what} must be a torch tensor or a numpy array, not {}",
            obj.get_type().name()?
        )))
    }
}

/// As [`view`], and checks that strata may write into it.
pub fn view_mut(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<View> {
    let v = view(obj, what)?;
    if !v.writable {
        return Err(PyValueError::new_err(format!(
            "{what} is read-only; strata writes into it"
        )));
    }
    Ok(v)
}

/// Checks the dtype of a view against those allowed.
pub fn expect_dtype(v: &View, what: &str, allowed: &[Dtype]) -> PyResult<()> {
    if allowed.contains(&v.dtype) {
        return Ok(());
    }
    let names: Vec<String> = allowed.iter().map(|d| d.name()).collect();
    Err(PyTypeError::new_err(format!(
        "{what} has dtype {}; it must be {}",
        v.dtype.name(),
        names.join(" or ")
    )))
}

/// Checks an element count.
pub fn expect_numel(v: &View, what: &str, numel: usize, of: &str) -> PyResult<()> {
    if v.numel == numel {
        Ok(())
    } else {
        Err(PyValueError::new_err(format!(
            "{what} has {} elements; {of} needs {numel}",
            v.numel
        )))
    }
}

fn torch_view(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<View> {
    let device: String = obj.getattr("device")?.getattr("type")?.extract()?;
    if device != "cpu" {
        return Err(PyTypeError::new_err(format!(
            "{what} is a {device} tensor; strata needs a CPU tensor here (move it with .cpu())"
        )));
    }
    let layout = obj.getattr("layout")?.str()?.to_string();
    if layout != "torch.strided" {
        return Err(PyValueError::new_err(format!(
            "{what} has layout {layout}; strata needs a dense (torch.strided) tensor"
        )));
    }
    if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
        let stride = obj.call_method0("stride")?.str()?.to_string();
        return Err(PyValueError::new_err(format!(
            "{what} is not contiguous (strides {stride}); pass .contiguous()"
        )));
    }
    let dtype = obj.getattr("dtype")?.str()?.to_string();
    let element_size: usize = obj.call_method0("element_size")?.extract()?;
    let dtype = match dtype.as_str() {
        "torch.float32" => Dtype::F32,
        "torch.float16" => Dtype::F16,
        "torch.bfloat16" => Dtype::Bf16,
        "torch.uint8" => Dtype::U8,
        _ => Dtype::Other(element_size),
    };
    let numel: usize = obj.call_method0("numel")?.extract()?;
    let addr: usize = obj.call_method0("data_ptr")?.extract()?;
    check_alignment(addr, numel, dtype, what)?;
    Ok(View {
        addr,
        numel,
        dtype,
        writable: true,
    })
}

fn numpy_view(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<View> {
    let interface = obj.getattr("__array_interface__")?;
    let interface = interface.cast::<PyDict>()?;
    let get = |key: &str| -> PyResult<Bound<'_, PyAny>> {
        interface.get_item(key)?.ok_or_else(|| {
            PyTypeError::new_err(format!("{what}'s __array_interface__ has no '{key}'"))
        })
    };
    let typestr: String = get("typestr")?.extract()?;
    let shape: Vec<usize> = get("shape")?.extract()?;
    let data = get("data")?;
    let data = data.cast::<PyTuple>()?;
    let addr: usize = data.get_item(0)?.extract()?;
    let readonly: bool = data.get_item(1)?.extract()?;
    let size: usize = typestr
        .get(2..)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| PyTypeError::new_err(format!("{what} has dtype '{typestr}'")))?;
    let kind = typestr.as_bytes().get(1).copied().unwrap_or(b'?');
    let dtype = match (kind, size) {
        (b'f', 4) => Dtype::F32,
        (b'f', 2) => Dtype::F16,
        (b'u', 1) => Dtype::U8,
        _ => Dtype::Other(size),
    };
    if typestr.starts_with('>') {
        return Err(PyTypeError::new_err(format!(
            "{what} is big-endian ('{typestr}'); strata needs native byte order"
        )));
    }
    let numel: usize = shape.iter().product();
    let strides = get("strides").ok().filter(|s| !s.is_none());
    if let Some(strides) = strides {
        let strides: Vec<isize> = strides.extract()?;
        // C order: the last axis has stride `size`, each earlier one the product after it.
        let mut expected = size as isize;
        let mut contiguous = true;
        for (dim, stride) in shape.iter().zip(&strides).rev() {
            if *dim > 1 && *stride != expected {
                contiguous = false;
            }
            expected *= *dim as isize;
        }
        if !contiguous && numel > 0 {
            return Err(PyValueError::new_err(format!(
                "{what} is not C-contiguous (strides {strides:?} bytes); pass \
                 numpy.ascontiguousarray(...)"
            )));
        }
    }
    check_alignment(addr, numel, dtype, what)?;
    Ok(View {
        addr,
        numel,
        dtype,
        writable: !readonly,
    })
}

fn check_alignment(addr: usize, numel: usize, dtype: Dtype, what: &str) -> PyResult<()> {
    if numel > 0 && addr == 0 {
        return Err(PyValueError::new_err(format!("{what} has no memory")));
    }
    let align = match dtype {
        Dtype::F32 => 4,
        Dtype::F16 | Dtype::Bf16 => 2,
        _ => 1,
    };
    if !addr.is_multiple_of(align) {
        return Err(PyValueError::new_err(format!(
            "{what} starts at {addr:#x}, not aligned to its {align}-byte elements"
        )));
    }
    Ok(())
}
