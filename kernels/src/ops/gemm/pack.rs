//! Packing: copying a block of an operand into the order its tiles read it.
//!
//! One routine serves both operands. A block of the right operand (kc rows of k, nc
//! columns) is cut into panels of NR columns; a block of the left operand (mc rows, kc
//! columns), seen transposed, into panels of MR rows. Panel q holds, for each step p of
//! k in order, its NR (or MR) values side by side, so a tile reads both its panels
//! front to back.
//! Past the block's last column a panel is filled with zeros, so edge tiles compute
//! with the same instructions as inner ones.

use super::Operand;

/// Steps of k a transposing copy moves per round: one 32-byte read from each column.
const STEPS: usize = 8;

/// Packs the `kc × cols` block at `src` (element (p, j) at `src.ptr + p · src.row_stride
/// + j · src.col_stride`) into `cols.div_ceil(W)` panels of `W` columns, one after
/// another in `dst`: panel q's step p is `dst[q·W·kc + p·W ..][..W]`.
///
/// # Safety
/// Every element (p, j) of the block, p < kc and j < cols, lies in readable memory that
/// nothing writes during the call.
#[inline(always)]
pub(super) unsafe fn panels<const W: usize>(dst: &mut [f32], src: Operand, kc: usize, cols: usize) {
    let (rs, cs) = (src.row_stride, src.col_stride);
    let panel_count = cols.div_ceil(W);
    assert!(
        dst.len() >= panel_count * W * kc,
        "packing scratch too small"
    );
    for (q, panel) in dst.chunks_exact_mut(W * kc).take(panel_count).enumerate() {
        let j0 = q * W;
        let width = W.min(cols - j0);
        // SAFETY: columns j0..j0 + width and rows 0..kc are inside the block the caller
        // vouches for.
        let base = unsafe { src.ptr.offset(j0 as isize * cs) };
        if width == W && cs == 1 {
            // Each step's W values are contiguous in the source: copy them as a row.
            for (p, step) in panel.chunks_exact_mut(W).enumerate() {
                // SAFETY: row p, columns j0..j0 + W of the block (see above).
                let row = unsafe { std::slice::from_raw_parts(base.offset(p as isize * rs), W) };
                step.copy_from_slice(row);
            }
        } else if width == W && rs == 1 {
            // Each column is contiguous along k: a transpose. Read STEPS values down
            // every column, then write them across, so that the reads run along all W
            // columns at once and the writes fill whole steps in order.
            let body = kc - kc % STEPS;
            for (p0, steps) in panel[..body * W].chunks_exact_mut(STEPS * W).enumerate() {
                let p0 = p0 * STEPS;
                let mut block = [[0.0f32; STEPS]; W];
                for (j, column) in block.iter_mut().enumerate() {
                    // SAFETY: column j0 + j, rows p0..p0 + STEPS of the block (see above).
                    *column = unsafe {
                        base.offset(j as isize * cs + p0 as isize)
                            .cast::<[f32; STEPS]>()
                            .read_unaligned()
                    };
                }
                for (p, step) in steps.chunks_exact_mut(W).enumerate() {
                    for (j, slot) in step.iter_mut().enumerate() {
                        *slot = block[j][p];
                    }
                }
            }
            for p in body..kc {
                for j in 0..W {
                    // SAFETY: element (p, j0 + j) of the block (see above).
                    panel[p * W + j] = unsafe { *base.offset(p as isize + j as isize * cs) };
                }
            }
        } else {
            // Any strides, or the last panel, short of W columns: element by element,
            // zeros past the block's last column.
            for (p, step) in panel.chunks_exact_mut(W).enumerate() {
                for (j, slot) in step.iter_mut().enumerate() {
                    *slot = if j < width {
                        // SAFETY: element (p, j0 + j) of the block (see above).
                        unsafe { *base.offset(p as isize * rs + j as isize * cs) }
                    } else {
                        0.0
                    };
                }
            }
        }
    }
}
