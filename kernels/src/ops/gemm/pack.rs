//! Packing: copying a block of an operand into the order its tiles read it.
//!
//! One routine serves both operands. A block of the right operand (kc rows of k, nc
//! columns) is cut into panels of NR columns; a block of the left operand (mc rows, kc
//! columns), seen transposed, into panels of MR rows. Panel q holds, for each step p of
//! k in order, its NR (or MR) values side by side, so a tile reads both its panels
//! front to back.
//! Past the block's last column a panel is filled with zeros, so edge tiles compute
//! with the same instructions as inner ones.
//!
//! Rows contiguous in the source are copied row by row across all panels (the source
//! read front to back); columns contiguous in the source are transposed, 8 × 8 at a
//! time in registers where the panel width allows; other strides go element by
//! element.

use super::operand::Operand;
use super::tile::Lanes;

/// Steps of k a transposing copy moves per round: one 32-byte read from each column.
const STEPS: usize = 8;

/// Packs the `kc × cols` block at `src` (element (p, j) at `src.ptr + p · src.row_stride
/// + j · src.col_stride`) into `cols.div_ceil(W)` panels of `W` columns, one after
/// another in `dst`: panel q's step p is `dst[q·W·kc + p·W ..][..W]`.
///
/// `V` is the instruction set's register type, whose 8 × 8 transposes serve columns
/// contiguous along k.
///
/// # Safety
/// Every element (p, j) of the block, p < kc and j < cols, lies in readable memory that
/// nothing writes during the call; the CPU supports `V`'s instruction set.
#[inline(always)]
pub(super) unsafe fn panels<V: Lanes, const W: usize>(
    dst: &mut [f32],
    src: Operand,
    kc: usize,
    cols: usize,
) {
    let (rs, cs) = (src.row_stride, src.col_stride);
    let panel_count = cols.div_ceil(W);
    assert!(
        dst.len() >= panel_count * W * kc,
        "packing scratch too small"
    );
    let full_panels = if cs == 1 { cols / W } else { 0 };
    if full_panels > 0 {
        // Rows contiguous in the source: read each row of the block front to back (one
        // stream the prefetcher follows, where panel by panel each step would be a new
        // page), handing every panel its W values of the step.
        for p in 0..kc {
            // SAFETY: row p, columns 0..full_panels · W <= cols of the block.
            let row = unsafe {
                std::slice::from_raw_parts(src.ptr.offset(p as isize * rs), full_panels * W)
            };
            for (q, values) in row.chunks_exact(W).enumerate() {
                dst[q * W * kc + p * W..][..W].copy_from_slice(values);
            }
        }
    }
    let panels = dst.chunks_exact_mut(W * kc).take(panel_count).enumerate();
    for (q, panel) in panels.skip(full_panels) {
        let j0 = q * W;
        let width = W.min(cols - j0);
        // SAFETY: columns j0..j0 + width and rows 0..kc are inside the block the caller
        // vouches for.
        let base = unsafe { src.ptr.offset(j0 as isize * cs) };
        if width == W && rs == 1 {
            // Each column is contiguous along k: a transpose, in blocks of 8 steps by 8
            // columns where W allows (the right operand's panels), else by reading
            // STEPS values down every column and writing them across, so that the
            // reads run along all W columns at once and the writes fill whole steps.
            let body = kc - kc % STEPS;
            for p0 in (0..body).step_by(STEPS) {
                if W.is_multiple_of(8) {
                    for j8 in (0..W).step_by(8) {
                        // SAFETY: columns j0 + j8..j0 + j8 + 8, rows p0..p0 + 8 of the
                        // block; the destination is 8 steps of this panel.
                        unsafe {
                            let columns = std::array::from_fn(|j| {
                                base.offset((j8 + j) as isize * cs + p0 as isize)
                            });
                            V::transpose8(columns, panel[p0 * W + j8..].as_mut_ptr(), W);
                        }
                    }
                    continue;
                }
                let mut block = [[0.0f32; STEPS]; W];
                for (j, column) in block.iter_mut().enumerate() {
                    // SAFETY: column j0 + j, rows p0..p0 + STEPS of the block (see above).
                    *column = unsafe {
                        base.offset(j as isize * cs + p0 as isize)
                            .cast::<[f32; STEPS]>()
                            .read_unaligned()
                    };
                }
                let steps = &mut panel[p0 * W..(p0 + STEPS) * W];
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
