//! The linear layers' CPU ops: their three matrix products by strata's own
//! (`ops::gemm`), on the worker pool; bias broadcast and bias gradient here. The weight's
//! layout ([`WeightLayout`]) is the ops' own type, which the signatures (`super`) and the
//! reference take.

use crate::ops::gemm::{Operand, Product};
use crate::ops::simd::on_isa;
use crate::ops::{Cpu, RowsMut, par_rows, simd};

/// How a linear layer's weight is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightLayout {
    /// (in, out): Hugging Face's `Conv1D`, used by GPT-2's linear layers.
    InOut,
    /// (out, in): `torch.nn.Linear`, and the token embedding used as the output head.
    OutIn,
}

/// Strides (row, column), in elements, of a weight stored in `layout`, seen as the
/// (C, OC) matrix that multiplies the input.
fn weight_strides(layout: WeightLayout, c: usize, oc: usize) -> (isize, isize) {
    match layout {
        WeightLayout::InOut => (oc as isize, 1),
        WeightLayout::OutIn => (1, c as isize),
    }
}

/// out: (N, OC)  inp: (N, C)  weight: (C, OC) for [`WeightLayout::InOut`], (OC, C) for
/// [`WeightLayout::OutIn`]  bias: (OC) or none.  `out = inp @ W + bias`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward(
    cpu: &Cpu,
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    layout: WeightLayout,
    n: usize,
    c: usize,
    oc: usize,
) {
    assert_eq!(out.len(), n * oc);
    assert_eq!(inp.len(), n * c);
    assert_eq!(weight.len(), c * oc);
    if let Some(bias) = bias {
        assert_eq!(bias.len(), oc);
        par_rows(
            cpu.threads_for(n * oc),
            n,
            1,
            RowsMut::new(out, oc),
            |_, out| {
                for row in out.data.chunks_exact_mut(oc) {
                    row.copy_from_slice(bias);
                }
            },
        );
    }
    let (w_rs, w_cs) = weight_strides(layout, c, oc);
    // SAFETY: out is n × oc with row stride oc, inp n × c with row stride c, weight c × oc
    // under its layout's strides (lengths asserted above); out is a distinct &mut slice.
    unsafe {
        Product {
            m: n,
            n: oc,
            k: c,
            dst: out.as_mut_ptr(),
            dst_row_stride: oc as isize,
            accumulate: bias.is_some(),
            lhs: Operand {
                ptr: inp.as_ptr(),
                row_stride: c as isize,
                col_stride: 1,
            },
            rhs: Operand {
                ptr: weight.as_ptr(),
                row_stride: w_rs,
                col_stride: w_cs,
            },
            scale: 1.0,
        }
        .run(cpu.isa, cpu.threads)
    }
}

/// dinp: (N, C) =  dweight: shaped as weight, +=  dbias: (OC) +=  dout: (N, OC)
/// inp: (N, C)  weight: as in [`matmul_forward`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward(
    cpu: &Cpu,
    dinp: &mut [f32],
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    layout: WeightLayout,
    n: usize,
    c: usize,
    oc: usize,
) {
    input_grad(cpu, dinp, dout, weight, layout, n, c, oc);
    weight_grad_add(cpu, dweight, dout, inp, layout, n, c, oc);
    if let Some(dbias) = dbias {
        bias_grad_add(cpu, dbias, dout, n, oc);
    }
}

/// The input gradient alone: dinp (N, C) = dout (N, OC) @ W^T.
#[allow(clippy::too_many_arguments)]
pub fn input_grad(
    cpu: &Cpu,
    dinp: &mut [f32],
    dout: &[f32],
    weight: &[f32],
    layout: WeightLayout,
    n: usize,
    c: usize,
    oc: usize,
) {
    assert_eq!(dinp.len(), n * c);
    assert_eq!(dout.len(), n * oc);
    assert_eq!(weight.len(), c * oc);
    let (w_rs, w_cs) = weight_strides(layout, c, oc);
    let dout_op = Operand {
        ptr: dout.as_ptr(),
        row_stride: oc as isize,
        col_stride: 1,
    };
    // dinp (N, C) = dout (N, OC) @ W^T (OC, C).
    // SAFETY: dout is n × oc, W^T is the weight (c × oc under its strides) read
    // transposed, dinp is n × c and a distinct &mut slice.
    unsafe {
        Product {
            m: n,
            n: c,
            k: oc,
            dst: dinp.as_mut_ptr(),
            dst_row_stride: c as isize,
            accumulate: false,
            lhs: dout_op,
            rhs: Operand {
                ptr: weight.as_ptr(),
                row_stride: w_cs,
                col_stride: w_rs,
            },
            scale: 1.0,
        }
        .run(cpu.isa, cpu.threads)
    }
}

/// The weight gradient alone: dweight (shaped as the weight) += inp^T (C, N) @ dout (N, OC).
#[allow(clippy::too_many_arguments)]
pub fn weight_grad_add(
    cpu: &Cpu,
    dweight: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    layout: WeightLayout,
    n: usize,
    c: usize,
    oc: usize,
) {
    assert_eq!(dout.len(), n * oc);
    assert_eq!(inp.len(), n * c);
    assert_eq!(dweight.len(), c * oc);
    let dout_op = Operand {
        ptr: dout.as_ptr(),
        row_stride: oc as isize,
        col_stride: 1,
    };
    // dW (C, OC) += inp^T (C, N) @ dout (N, OC), written through the layout's strides.
    let inp_t = Operand {
        ptr: inp.as_ptr(),
        row_stride: 1,
        col_stride: c as isize,
    };
    match layout {
        // SAFETY: inp^T is c × n, dout n × oc, dweight c × oc with row stride oc; dweight
        // is a distinct &mut slice.
        WeightLayout::InOut => unsafe {
            Product {
                m: c,
                n: oc,
                k: n,
                dst: dweight.as_mut_ptr(),
                dst_row_stride: oc as isize,
                accumulate: true,
                lhs: inp_t,
                rhs: dout_op,
                scale: 1.0,
            }
            .run(cpu.isa, cpu.threads)
        },
        // dW (OC, C) += dout^T (OC, N) @ inp (N, C).
        // SAFETY: dout^T is oc × n, inp n × c, dweight oc × c with row stride c; dweight
        // is a distinct &mut slice.
        WeightLayout::OutIn => unsafe {
            Product {
                m: oc,
                n: c,
                k: n,
                dst: dweight.as_mut_ptr(),
                dst_row_stride: c as isize,
                accumulate: true,
                lhs: Operand {
                    ptr: dout.as_ptr(),
                    row_stride: 1,
                    col_stride: oc as isize,
                },
                rhs: Operand {
                    ptr: inp.as_ptr(),
                    row_stride: c as isize,
                    col_stride: 1,
                },
                scale: 1.0,
            }
            .run(cpu.isa, cpu.threads)
        },
    }
}

/// The bias gradient alone: dbias (OC) += the column sums of dout (N, OC).
pub fn bias_grad_add(cpu: &Cpu, dbias: &mut [f32], dout: &[f32], n: usize, oc: usize) {
    assert_eq!(dbias.len(), oc);
    // Column ranges in parallel; each column adds its rows in order.
    let threads = cpu.threads_for(n * oc);
    par_rows(
        threads,
        oc,
        simd::LANES,
        RowsMut::new(dbias, 1),
        |cols, db| {
            on_isa!(cpu.isa, {
                for row in 0..n {
                    simd::add_assign(db.data, &dout[row * oc..][cols.clone()]);
                }
            },)
        },
    );
}
