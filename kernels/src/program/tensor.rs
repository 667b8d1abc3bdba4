//! The tensors of a program: what a kernel names ([`TensorRef`]: a binding index, a byte
//! offset, a length and an element type), how it uses each ([`Access`]), and where a
//! program runs ([`Target`]). Nothing here knows a kernel.

use std::fmt;

/// The element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// IEEE single precision.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    F16,
    /// Token ids.
    U32,
    /// Plain bytes (statistics records, opaque scratch).
    U8,
}

impl Dtype {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Dtype::F32 | Dtype::U32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::U8 => 1,
        }
    }

    /// Whether the type holds floating-point numbers.
    pub const fn is_float(self) -> bool {
        matches!(self, Dtype::F32 | Dtype::Bf16 | Dtype::F16)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::U32 => "u32",
            Dtype::U8 => "u8",
        })
    }
}

/// Where a program runs, which decides the sizes of the scratch some kernels need.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// The CPU kernels.
    Cpu,
    /// The CUDA kernels.
    Cuda,
}

impl Target {
    /// Whether the target's kernels compute in `dtype` as their working type: f32 on the
    /// CPU; f32, bf16 or f16 on CUDA.
    pub const fn computes_in(self, dtype: Dtype) -> bool {
        match self {
            Target::Cpu => matches!(dtype, Dtype::F32),
            Target::Cuda => dtype.is_float(),
        }
    }
}

/// A tensor of a program: `len` elements of `dtype` starting `offset_bytes` into the
/// buffer bound at index `buf` when the program runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorRef {
    /// Index of the buffer in the caller's binding table.
    pub buf: u8,
    /// Where the tensor starts in that buffer.
    pub offset_bytes: usize,
    /// Elements.
    pub len: usize,
    /// Element type.
    pub dtype: Dtype,
}

impl TensorRef {
    /// `len` elements of `dtype` at `offset_bytes` into buffer `buf`.
    pub const fn new(buf: u8, offset_bytes: usize, len: usize, dtype: Dtype) -> Self {
        TensorRef {
            buf,
            offset_bytes,
            len,
            dtype,
        }
    }

    /// Bytes the tensor spans.
    pub const fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }

    /// The byte range in its buffer.
    pub fn byte_range(&self) -> std::ops::Range<usize> {
        self.offset_bytes..self.offset_bytes + self.bytes()
    }

    /// The `len` elements starting `start` elements into this tensor (same buffer and
    /// dtype).
    pub fn slice(&self, start: usize, len: usize) -> TensorRef {
        assert!(
            start + len <= self.len,
            "a slice of {len} elements at {start} of a tensor of {}",
            self.len
        );
        TensorRef {
            offset_bytes: self.offset_bytes + start * self.dtype.size(),
            len,
            ..*self
        }
    }
}

/// How a kernel uses one of its tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Only reads it.
    Read,
    /// Writes it (possibly after reading: accumulation, in-place updates).
    Write,
}
