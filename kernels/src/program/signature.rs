//! A kernel's signature, declared once ([`Signature`]): its name, each tensor it touches
//! with how it uses it and what the tensor must be ([`Param`]: a dtype rule and a length
//! rule), its FLOPs, and its dimensions checked among themselves. [`check`] holds a
//! kernel's tensors to its signature for a [`Target`] and returns the checked shape that
//! both runners then compute with, so neither validates on its own.
//!
//! What is runner-specific stays with the runner: the CPU's views and the CUDA runner's
//! device addresses and their alignment (`program::cpu`, `cuda::launch`).

use super::error::KernelError;
use super::tensor::{Access, Dtype, Target, TensorRef};

/// What a kernel requires of a tensor's element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DtypeRule {
    /// The kernel's working type (activations and parameters): the dtype of its first
    /// such tensor, which must be one the target computes in ([`Target::computes_in`]);
    /// every such tensor has it.
    Working,
    /// Exactly this dtype.
    Exactly(Dtype),
    /// One of these dtypes.
    OneOf(&'static [Dtype]),
    /// Any dtype (its bytes are what counts).
    Any,
}

/// What a kernel requires of a tensor's length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LenRule {
    /// Exactly this many elements.
    Len(usize),
    /// At least this many elements (a table of which a call reads the first rows).
    AtLeast(usize),
    /// A whole number of rows of this many elements (more than 0).
    Rows(usize),
    /// A number of bytes rather than elements (scratch, statistics records).
    Bytes(ByteRule),
    /// Any length.
    AnyLen,
}

/// The bytes a tensor must span, per target, and where it must start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteRule {
    /// Bytes needed on the CPU.
    pub cpu_bytes: usize,
    /// Bytes needed on CUDA.
    pub cuda_bytes: usize,
    /// Whether the tensor must span exactly that many (else at least).
    pub exact: bool,
    /// The alignment its start needs.
    pub align_bytes: usize,
    /// What errors call it (e.g. `"scratch (bytes)"`).
    pub label: &'static str,
}

impl ByteRule {
    /// Scratch of at least `cpu_bytes` or `cuda_bytes`, starting at a multiple of
    /// `align_bytes`.
    pub const fn scratch(cpu_bytes: usize, cuda_bytes: usize, align_bytes: usize) -> Self {
        ByteRule {
            cpu_bytes,
            cuda_bytes,
            exact: false,
            align_bytes,
            label: "scratch (bytes)",
        }
    }

    /// The bytes `target` needs.
    pub const fn bytes_on(&self, target: Target) -> usize {
        match target {
            Target::Cpu => self.cpu_bytes,
            Target::Cuda => self.cuda_bytes,
        }
    }
}

/// One tensor of a kernel: its name (the kernel's field), the tensor, how the kernel uses
/// it, and what it must be.
#[derive(Debug, Clone, Copy)]
pub struct Param<'a> {
    /// The field's name, as errors and the CUDA sources name it.
    pub name: &'static str,
    /// The tensor.
    pub tensor: &'a TensorRef,
    /// Whether the kernel writes it (written tensors are listed once, as written, even
    /// when also read).
    pub access: Access,
    /// Its element type.
    pub dtype: DtypeRule,
    /// Its length.
    pub len: LenRule,
}

impl<'a> Param<'a> {
    /// A tensor the kernel writes (and may read).
    pub const fn write(
        name: &'static str,
        tensor: &'a TensorRef,
        dtype: DtypeRule,
        len: LenRule,
    ) -> Self {
        Param {
            name,
            tensor,
            access: Access::Write,
            dtype,
            len,
        }
    }

    /// A tensor the kernel only reads.
    pub const fn read(
        name: &'static str,
        tensor: &'a TensorRef,
        dtype: DtypeRule,
        len: LenRule,
    ) -> Self {
        Param {
            name,
            tensor,
            access: Access::Read,
            dtype,
            len,
        }
    }

    /// Scratch the kernel writes: any dtype, `rule`'s bytes.
    pub const fn scratch(name: &'static str, tensor: &'a TensorRef, rule: ByteRule) -> Self {
        Param::write(name, tensor, DtypeRule::Any, LenRule::Bytes(rule))
    }

    /// The alignment, in bytes, the tensor's start needs: its dtype's size, or its byte
    /// rule's.
    pub const fn align_bytes(&self) -> usize {
        match self.len {
            LenRule::Bytes(rule) => rule.align_bytes,
            _ => self.tensor.dtype.size(),
        }
    }

    /// `Ok` when the tensor keeps the rules, on `target`, with the kernel's `working` type.
    fn check(
        &self,
        kernel: &'static str,
        working: Option<Dtype>,
        target: Target,
    ) -> Result<(), KernelError> {
        let dtype = self.tensor.dtype;
        let dtype_fits = match self.dtype {
            DtypeRule::Working => Some(dtype) == working,
            DtypeRule::Exactly(d) => dtype == d,
            DtypeRule::OneOf(ds) => ds.contains(&dtype),
            DtypeRule::Any => true,
        };
        if !dtype_fits {
            return Err(KernelError::Dtype {
                kernel,
                what: self.name,
                dtype,
                target,
            });
        }
        let len = self.tensor.len;
        let (what, len, expected) = match self.len {
            LenRule::Len(n) if len != n => (self.name, len, n),
            LenRule::AtLeast(n) if len < n => (self.name, len, n),
            LenRule::Rows(c) if !len.is_multiple_of(c) => (self.name, len, len.next_multiple_of(c)),
            LenRule::Bytes(rule) => {
                let (bytes, need) = (self.tensor.bytes(), rule.bytes_on(target));
                if bytes >= need && (!rule.exact || bytes == need) {
                    return Ok(());
                }
                (rule.label, bytes, need)
            }
            _ => return Ok(()),
        };
        Err(KernelError::Shape {
            kernel,
            what,
            len,
            expected,
        })
    }
}

/// The shape of a row-wise kernel (LayerNorm, RMSNorm): `n` rows of `c` channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rows {
    /// Rows.
    pub n: usize,
    /// Channels.
    pub c: usize,
}

/// A kernel's signature: everything about it both runners share.
pub trait Signature {
    /// A short name for messages and traces.
    const NAME: &'static str;

    /// What [`check`] returns: the dimensions both runners compute with.
    type Shape: Copy + std::fmt::Debug;

    /// The dimensions checked among themselves (heads dividing channels, an even head
    /// size...), before any tensor is.
    fn shape(&self) -> Result<Self::Shape, KernelError>;

    /// Calls `each` with every tensor, in order: how the kernel uses it and what it must
    /// be. Lengths are computed from the fields without dividing, so that a kernel whose
    /// dimensions [`Signature::shape`] refuses can still list its tensors.
    fn params<'a>(&'a self, each: &mut dyn FnMut(Param<'a>));

    /// Floating-point operations, counting a multiply-add as two, for cost models and
    /// FLOP/s figures: matrix products and attention's two products per head exactly,
    /// other kernels by a few operations per element.
    fn flops(&self) -> f64;
}

/// A kernel's shape once its tensors are checked, and its working type (`None` for
/// kernels without one: optimizer state, f32 accumulation, bytes).
#[derive(Debug, Clone, Copy)]
pub struct Checked<S> {
    /// The checked dimensions.
    pub shape: S,
    /// The working type, if the kernel has one.
    pub working: Option<Dtype>,
}

/// Holds `kernel`'s tensors to its signature on `target`: its dimensions first, then the
/// working type's tensor, then every tensor in order; the first failure is the error.
pub fn check<K: Signature + ?Sized>(
    kernel: &K,
    target: Target,
) -> Result<Checked<K::Shape>, KernelError> {
    let shape = kernel.shape()?;
    let working = working_type(kernel, target)?;
    let mut result = Ok(());
    kernel.params(&mut |p| {
        if result.is_ok() {
            result = p.check(K::NAME, working, target);
        }
    });
    result.map(|()| Checked { shape, working })
}

/// The dtype of the kernel's first working-type tensor, if it has one, when `target`
/// computes in it.
fn working_type<K: Signature + ?Sized>(
    kernel: &K,
    target: Target,
) -> Result<Option<Dtype>, KernelError> {
    let mut first = None;
    kernel.params(&mut |p| {
        if first.is_none() && p.dtype == DtypeRule::Working {
            first = Some((p.name, p.tensor.dtype));
        }
    });
    match first {
        None => Ok(None),
        Some((_, dtype)) if target.computes_in(dtype) => Ok(Some(dtype)),
        Some((what, dtype)) => Err(KernelError::Dtype {
            kernel: K::NAME,
            what,
            dtype,
            target,
        }),
    }
}
