//! The compute sequence of a step, in canonical order: per micro-batch, the embedding's
//! forward, the layers' forwards, the head's forward and backward, the layers' backwards
//! in reverse, the embedding's backward. Fetches, copies and updates are placed around
//! positions in it.
//!
//! Not here: the operations emitted at each position (`emit.rs`).

use super::frame::Frame;

/// One compute operation in the canonical sequence, before emission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Compute {
    /// The embedding's forward of a micro-batch.
    Embed(usize),
    /// Block `.0`'s forward.
    Layer(usize, usize),
    /// The head's forward and backward.
    Head(usize),
    /// Block `.0`'s backward.
    LayerBack(usize, usize),
    /// The embedding's backward.
    EmbedBack(usize),
}

impl Compute {
    /// The micro-batch it computes.
    pub(super) fn micro(self) -> usize {
        match self {
            Compute::Embed(m) | Compute::Head(m) | Compute::EmbedBack(m) => m,
            Compute::Layer(_, m) | Compute::LayerBack(_, m) => m,
        }
    }

    /// The block whose gradients it completes for its micro-batch, if any: the head
    /// also completes (its part of) the tied block's gradients, but the tied block
    /// finishes with its own backward.
    pub(super) fn finishes(self, head: usize) -> Option<usize> {
        match self {
            Compute::Head(_) => Some(head),
            Compute::LayerBack(b, _) => Some(b),
            Compute::EmbedBack(_) => Some(0),
            Compute::Embed(_) | Compute::Layer(..) => None,
        }
    }
}

/// The step's compute sequence.
pub(super) struct Sequence {
    pub(super) steps: Vec<Compute>,
    head: usize,
    micros: usize,
}

impl Sequence {
    /// The sequence of the step `f` plans.
    pub(super) fn new(f: &Frame<'_>) -> Self {
        let (layers, micros) = (f.layers, f.shape.grad_accum);
        let mut steps = Vec::new();
        for m in 0..micros {
            steps.push(Compute::Embed(m));
            for b in 1..=layers {
                steps.push(Compute::Layer(b, m));
            }
            steps.push(Compute::Head(m));
            for b in (1..=layers).rev() {
                steps.push(Compute::LayerBack(b, m));
            }
            steps.push(Compute::EmbedBack(m));
        }
        Sequence {
            steps,
            head: f.head,
            micros,
        }
    }

    /// Computes in the step.
    pub(super) fn len(&self) -> usize {
        self.steps.len()
    }

    /// The position of `c` in the sequence.
    pub(super) fn position(&self, c: Compute) -> usize {
        self.steps
            .iter()
            .position(|&x| x == c)
            .expect("in the sequence")
    }

    /// How many computes after layer block `b`'s forward its backward comes (of every
    /// micro-batch alike: each runs the same sequence).
    pub(super) fn forward_to_backward(&self, b: usize) -> usize {
        self.position(Compute::LayerBack(b, 0)) - self.position(Compute::Layer(b, 0))
    }

    /// The compute that completes block `b`'s gradients (its last micro-batch's
    /// backward).
    pub(super) fn completes(&self, b: usize) -> usize {
        let last = self.micros - 1;
        self.position(if b == self.head {
            Compute::Head(last)
        } else if b == 0 {
            Compute::EmbedBack(last)
        } else {
            Compute::LayerBack(b, last)
        })
    }

    /// Blocks whose parameters compute `c` reads: its own, and the one `tied` says its
    /// own is tied to.
    pub(super) fn param_blocks(
        &self,
        c: Compute,
        tied: impl Fn(usize) -> Option<usize>,
    ) -> Vec<usize> {
        let own = match c {
            Compute::Embed(_) => Some(0),
            Compute::Layer(b, _) | Compute::LayerBack(b, _) => Some(b),
            Compute::Head(_) => Some(self.head),
            // The embedding's backward reads no parameters.
            Compute::EmbedBack(_) => None,
        };
        own.into_iter().chain(own.and_then(tied)).collect()
    }
}
