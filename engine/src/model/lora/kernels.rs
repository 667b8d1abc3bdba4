//! The kernels of one adapted product, for any family: `y = x Wᵀ` (the base's, which the
//! family computes) plus `s · (x Aᵀ) Bᵀ` (s the adapter's scale): `u = x Aᵀ`
//! (rows × rank), `v = u Bᵀ` into a wide scratch tensor, then `y += s · v`
//! ([`AddScaled`]). Its backward, given `dY`: `dv = s · dY` (into the wide tensor, zeroed
//! first), `du = dv B` with `dB += dvᵀ u`, then `dx' = du A` with `dA += duᵀ x`, and
//! `dx += dx'`. `A` and `B` are stored as `nn.Linear` stores them ((out, in)) in every
//! family, as peft keeps them (for GPT-2's Conv1D too: its `fan_in_fan_out` concerns the
//! base weight only).

use strata_kernels::kernel::{AddScaled, Matmul, MatmulBackward, WeightGrad, Zero};
use strata_kernels::ops::WeightLayout;
use strata_kernels::program::{Dtype, Kernel, TensorRef};

use crate::model::Bind;

use super::adapted::AdapterScratch;
use super::layout::AdapterSlots;

/// One adapted product's tensors, for its kernels.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdapterKernels {
    /// `A` (rank × in) and `B` (out × rank), in the working dtype.
    pub(crate) a: TensorRef,
    pub(crate) b: TensorRef,
    /// Their gradients (f32).
    pub(crate) da: TensorRef,
    pub(crate) db: TensorRef,
    /// `u = x Aᵀ` (rows × rank): scratch, or saved.
    pub(crate) u: TensorRef,
    /// Rows × the widest input or output of the family's adapted products (`v`, `dv`
    /// and `dx'` in turn), and `du` (rows × rank): scratch.
    pub(crate) wide: TensorRef,
    pub(crate) du: TensorRef,
    /// The adapter's scale.
    pub(crate) scale: f32,
    pub(crate) rows: usize,
}

impl AdapterKernels {
    /// The tensors of product `p`'s adapter at `slots` in a block whose parameters are
    /// `dtype` and whose gradients start at element `frozen`, with the family's adapter
    /// scratch `scratch` (its `u` of `p`: scratch or saved), for `rows` rows.
    pub(crate) fn new<const N: usize>(
        (p, slots): (usize, AdapterSlots),
        (dtype, frozen): (Dtype, usize),
        scratch: &AdapterScratch<N>,
        (scale, rows): (f32, usize),
    ) -> Self {
        let grad = |slot: crate::model::Slot| {
            let at = slot.offset - frozen;
            TensorRef::new(Bind::Grads as u8, at * 4, slot.len, Dtype::F32)
        };
        AdapterKernels {
            a: slots.a.tensor(Bind::Params, dtype),
            b: slots.b.tensor(Bind::Params, dtype),
            da: grad(slots.a),
            db: grad(slots.b),
            u: scratch.u[p],
            wide: scratch.wide,
            du: scratch.du,
            scale,
            rows,
        }
    }

    /// `u = inp Aᵀ`, `v = u Bᵀ`, `out += s · v`.
    pub(crate) fn forward(&self, out: TensorRef, inp: TensorRef) -> [Kernel; 3] {
        let v = self.wide.slice(0, out.len);
        [
            self.product(self.u, inp, self.a),
            self.product(v, self.u, self.b),
            Kernel::AddScaled(AddScaled {
                dst: out,
                src: v,
                factor: self.scale,
            }),
        ]
    }

    /// `dv = s · dout`; `du = dv B`, `dB += dvᵀ u`; `dx' = du A`, `dA += duᵀ inp`;
    /// `dinp += dx'`.
    pub(crate) fn backward(&self, dinp: TensorRef, dout: TensorRef, inp: TensorRef) -> [Kernel; 5] {
        let (wide, du) = (self.wide, self.du);
        let (dv, dx) = (wide.slice(0, dout.len), wide.slice(0, dinp.len));
        [
            Kernel::Zero(Zero { t: dv }),
            Kernel::AddScaled(AddScaled {
                dst: dv,
                src: dout,
                factor: self.scale,
            }),
            self.product_backward((du, dv), (self.u, self.b), self.db),
            self.product_backward((dx, du), (inp, self.a), self.da),
            Kernel::AddScaled(AddScaled {
                dst: dinp,
                src: dx,
                factor: 1.0,
            }),
        ]
    }

    /// `out = inp weightᵀ`, the weight (out, in) as `nn.Linear` stores it.
    fn product(&self, out: TensorRef, inp: TensorRef, weight: TensorRef) -> Kernel {
        let n = self.rows;
        Kernel::Matmul(Matmul {
            out,
            inp,
            weight,
            bias: None,
            layout: WeightLayout::OutIn,
            n,
            c: inp.len / n,
            oc: out.len / n,
        })
    }

    /// The backward of [`AdapterKernels::product`]: `dinp` overwritten, `dweight` added to.
    fn product_backward(
        &self,
        (dinp, dout): (TensorRef, TensorRef),
        (inp, weight): (TensorRef, TensorRef),
        dweight: TensorRef,
    ) -> Kernel {
        let n = self.rows;
        Kernel::MatmulBackward(MatmulBackward {
            dinp,
            weight_grad: Some(WeightGrad { dweight, inp }),
            dbias: None,
            dout,
            weight,
            layout: WeightLayout::OutIn,
            n,
            c: inp.len / n,
            oc: dout.len / n,
        })
    }
}
