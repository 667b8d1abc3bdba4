//! What a device operation names: a range of device memory ([`DeviceRange`]), a program
//! ([`Program`]) and the ranges its tensors are bound to ([`Bindings`], checked by
//! [`check_program`] before a device touches memory), and the conversion a copy makes
//! on the way ([`Convert`]). Shared by both devices and by the executor that calls them.
//!
//! Not here: the devices themselves (`cpu`, `cuda`) and the operations they run (`ops`).

use std::sync::Arc;

use strata_kernels::program::{Dtype, Kernel};

use crate::error::EngineError;
use crate::lane::Lane;
use crate::memory::{DeviceArena, DeviceBuffer};

/// A range of a device's memory, in bytes from the start of its arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceRange {
    /// First byte.
    pub offset_bytes: usize,
    /// Length.
    pub len_bytes: usize,
}

impl DeviceRange {
    /// `len_bytes` bytes from `offset_bytes`.
    pub const fn new(offset_bytes: usize, len_bytes: usize) -> Self {
        DeviceRange {
            offset_bytes,
            len_bytes,
        }
    }

    /// The range of `buffer`.
    pub fn of(buffer: &DeviceBuffer) -> Self {
        DeviceRange::new(buffer.arena_offset_bytes(), buffer.len_bytes())
    }

    /// The bytes as a range.
    pub fn bytes(&self) -> std::ops::Range<usize> {
        self.offset_bytes..self.offset_bytes + self.len_bytes
    }

    /// `len_bytes` bytes starting `offset_bytes` into this range.
    pub fn sub(&self, offset_bytes: usize, len_bytes: usize) -> DeviceRange {
        assert!(
            offset_bytes + len_bytes <= self.len_bytes,
            "a sub-range of {len_bytes} bytes at {offset_bytes} of a range of {}",
            self.len_bytes
        );
        DeviceRange::new(self.offset_bytes + offset_bytes, len_bytes)
    }
}

/// `Ok` when `program` may run on `lane` (a kernel stream: anything else is a caller's
/// bug, and panics), every bound range lies in `arena` (checked once for the program)
/// and every tensor of every kernel inside the range bound for it; else an error naming
/// the kernel and the tensor. Both devices check a program with this before it touches
/// memory.
pub(crate) fn check_program(
    arena: &DeviceArena,
    lane: Lane,
    program: &Program,
    bindings: &Bindings,
) -> Result<(), EngineError> {
    assert!(
        matches!(lane, Lane::Compute | Lane::Update),
        "programs run on the compute or the update stream, not {lane}"
    );
    if program.is_empty() {
        return Ok(());
    }
    for b in bindings.0.iter().flatten() {
        arena.check_range(b.bytes())?;
    }
    program
        .iter()
        .try_for_each(|kernel| check_tensors(kernel, bindings))
}

/// `Ok` when every tensor of `kernel` lies inside the range bound for it.
fn check_tensors(kernel: &Kernel, bindings: &Bindings) -> Result<(), EngineError> {
    let mut unbound = None;
    kernel.for_each_tensor(|t, _| {
        let fits = bindings.get(t.buf).is_some_and(|r| {
            t.offset_bytes
                .checked_add(t.bytes())
                .is_some_and(|end| end <= r.len_bytes)
        });
        if !fits && unbound.is_none() {
            unbound = Some(*t);
        }
    });
    match unbound {
        None => Ok(()),
        Some(t) => Err(EngineError::ProgramBinding {
            kernel: kernel.name(),
            tensor: format!("{t:?}"),
            bound: bindings.get(t.buf).map(|r| r.len_bytes),
        }),
    }
}

/// Most buffers a program may bind.
pub const MAX_BINDINGS: usize = 17;

/// The device ranges a program's tensors refer to, by binding index
/// ([`TensorRef::buf`](strata_kernels::program::TensorRef)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bindings(pub [Option<DeviceRange>; MAX_BINDINGS]);

impl Bindings {
    /// Binds `range` at `index`.
    pub fn set(&mut self, index: u8, range: DeviceRange) {
        self.0[index as usize] = Some(range);
    }

    /// The range bound at `index`.
    pub fn get(&self, index: u8) -> Option<DeviceRange> {
        self.0.get(index as usize).copied().flatten()
    }
}

/// A program: kernels run in order on the compute stream, shared cheaply.
pub type Program = Arc<[Kernel]>;

/// A conversion a host-to-device copy makes on the way (the CPU device computes in f32
/// while host working parameters may be bf16 or fp16): from the host's dtype to the
/// device's. A GPU copies bytes as they are and refuses a conversion.
pub type Convert = Option<(Dtype, Dtype)>;
