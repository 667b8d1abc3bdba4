//! The language-model loss every family's head ends with: logits from the normalised
//! final activations and an output weight of (vocab, width) in Hugging Face's (out, in)
//! layout (a head of its own, or the tied embedding), then the per-position
//! cross-entropy; and the backward of both, down to the gradient of the normalised
//! activations. The families differ only in the norm before it.

use strata_kernels::kernel::{
    CrossEntropy, CrossEntropyBackward, Matmul, MatmulBackward, WeightGrad,
};
use strata_kernels::ops::WeightLayout;
use strata_kernels::program::{Dtype, Kernel, TensorRef};

use super::Bind;

/// The tensors of the loss.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LossHead {
    /// Normalised final activations (n, c).
    pub(crate) inp: TensorRef,
    /// Output weight (v, c) and its gradient (none for a frozen head, as a LoRA model's).
    pub(crate) weight: TensorRef,
    pub(crate) dweight: Option<TensorRef>,
    /// Logits (n, v) in the scratch; the backward overwrites them with their gradient.
    pub(crate) logits: TensorRef,
    /// Gradient of `inp` (n, c).
    pub(crate) dinp: TensorRef,
    /// Target ids (n).
    pub(crate) targets: TensorRef,
    /// Rows, width, vocabulary.
    pub(crate) n: usize,
    pub(crate) c: usize,
    pub(crate) v: usize,
}

impl LossHead {
    /// Logits, then each position's loss into the losses buffer.
    pub(crate) fn forward(&self) -> [Kernel; 2] {
        let Self {
            inp,
            weight,
            logits,
            targets,
            n,
            c,
            v,
            ..
        } = *self;
        [
            Kernel::Matmul(Matmul {
                out: logits,
                inp,
                weight,
                bias: None,
                layout: WeightLayout::OutIn,
                n,
                c,
                oc: v,
            }),
            Kernel::CrossEntropy(CrossEntropy {
                losses: TensorRef::new(Bind::Losses as u8, 0, n, Dtype::F32),
                logits,
                targets,
                n,
                v,
            }),
        ]
    }

    /// The logits' gradient (in place), then the gradients of the weight (accumulated,
    /// where it trains) and of `inp` (written).
    pub(crate) fn backward(&self) -> [Kernel; 2] {
        let Self {
            inp,
            weight,
            dweight,
            logits,
            dinp,
            targets,
            n,
            c,
            v,
        } = *self;
        [
            Kernel::CrossEntropyBackward(CrossEntropyBackward {
                logits,
                targets,
                n,
                v,
            }),
            Kernel::MatmulBackward(MatmulBackward {
                dinp,
                weight_grad: dweight.map(|dweight| WeightGrad { dweight, inp }),
                dbias: None,
                dout: logits,
                weight,
                layout: WeightLayout::OutIn,
                n,
                c,
                oc: v,
            }),
        ]
    }
}
