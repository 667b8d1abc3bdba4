//! The scalar reference of the matrix product (`ops::gemm`): a triple loop over strided
//! views, generic over the float type so that tests run it in f64 on the f32 inputs.

use super::Real;

/// A read-only strided view: element (i, j) is `data[i · row_stride + j · col_stride]`.
#[derive(Debug, Clone, Copy)]
pub struct View<'a, R> {
    /// The elements.
    pub data: &'a [R],
    /// Elements between rows.
    pub row_stride: usize,
    /// Elements between columns.
    pub col_stride: usize,
}

impl<R: Real> View<'_, R> {
    fn at(&self, i: usize, j: usize) -> R {
        self.data[i * self.row_stride + j * self.col_stride]
    }
}

/// dst: (M, N), rows `dst_row_stride` apart, = [dst +] `scale` · (lhs: (M, K) @ rhs:
/// (K, N)), each element's sum taken over k in order.
pub fn gemm<R: Real>(
    dst: &mut [R],
    dst_row_stride: usize,
    lhs: View<'_, R>,
    rhs: View<'_, R>,
    (m, n, k): (usize, usize, usize),
    scale: R,
    accumulate: bool,
) {
    for i in 0..m {
        for j in 0..n {
            let mut sum = R::default();
            for p in 0..k {
                sum += lhs.at(i, p) * rhs.at(p, j);
            }
            let out = &mut dst[i * dst_row_stride + j];
            *out = if accumulate {
                *out + scale * sum
            } else {
                scale * sum
            };
        }
    }
}
