//! A matrix operand of the product: a base pointer and (row, column) strides, with the
//! two views the blocking takes of it. Its own file so that the product ([`super`]) and
//! the packing ([`super::pack`]) both use it without using each other's names.

/// A matrix operand: base pointer and (row, column) strides in elements.
#[derive(Clone, Copy)]
pub(crate) struct Operand {
    pub(crate) ptr: *const f32,
    pub(crate) row_stride: isize,
    pub(crate) col_stride: isize,
}

impl Operand {
    /// The operand read transposed.
    pub(super) fn transposed(self) -> Operand {
        Operand {
            ptr: self.ptr,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }

    /// The operand from element (row, col) on. The pointer is computed with wrapping
    /// arithmetic: only dereferencing it needs the element to exist.
    pub(super) fn at(self, row: usize, col: usize) -> Operand {
        Operand {
            ptr: self
                .ptr
                .wrapping_offset(row as isize * self.row_stride + col as isize * self.col_stride),
            ..self
        }
    }
}
