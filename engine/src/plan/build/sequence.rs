//! The compute sequence of a step, in canonical order: the embedding's forward, the
//! layers' forwards, the head's forward and backward, the layers' backwards in reverse,
//! the embedding's backward; per micro-batch in turn (horizontal), or with every
//! micro-batch through each of these in turn (vertical). Fetches, copies and updates are
//! placed around positions in it.
//!
//! Not here: the operations emitted at each position (`emit.rs`).

use super::frame::Frame;
use crate::plan::shape::Schedule;

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
    vertical: bool,
}

impl Sequence {
    /// The sequence of the step `f` plans, in the order its shape's
    /// [`Schedule`] names (resolved by then: auto plans each of the others).
    pub(super) fn new(f: &Frame<'_>) -> Self {
        let (layers, micros) = (f.layers, f.shape.grad_accum);
        debug_assert!(f.shape.schedule != Schedule::Auto, "a schedule chosen");
        let vertical = f.vertical();
        // One pass of one micro-batch, in order.
        let pass = |m: usize| {
            let forward = (1..=layers).map(move |b| Compute::Layer(b, m));
            let backward = (1..=layers).rev().map(move |b| Compute::LayerBack(b, m));
            std::iter::once(Compute::Embed(m))
                .chain(forward)
                .chain([Compute::Head(m)])
                .chain(backward)
                .chain([Compute::EmbedBack(m)])
        };
        let steps: Vec<Compute> = if vertical {
            // The pass's i-th compute of every micro-batch, then its next.
            let passes: Vec<Vec<Compute>> = (0..micros).map(|m| pass(m).collect()).collect();
            let len = passes.first().map_or(0, Vec::len);
            (0..len)
                .flat_map(|i| passes.iter().map(move |p| p[i]))
                .collect()
        } else {
            (0..micros).flat_map(pass).collect()
        };
        Sequence {
            steps,
            head: f.head,
            micros,
            vertical,
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
    /// micro-batch alike: in either order, each micro-batch's forward and backward of a
    /// block are the same distance apart).
    pub(super) fn forward_to_backward(&self, b: usize) -> usize {
        self.position(Compute::LayerBack(b, 0)) - self.position(Compute::Layer(b, 0))
    }

    /// The compute that completes block `b`'s gradients (its last micro-batch's
    /// backward).
    pub(super) fn completes(&self, b: usize) -> usize {
        self.position(self.backward(b, self.micros - 1))
    }

    /// Where the backward computes that end with the one completing block `b`'s
    /// gradients ([`Sequence::completes`]) and read its parameters begin: vertically,
    /// its first micro-batch's backward, the start of one use of a fetch that the
    /// block's optimizer state can feed; else that compute itself.
    pub(super) fn backward_start(&self, b: usize, tied: impl Fn(usize) -> Option<usize>) -> usize {
        let last = self.completes(b);
        let reads = self.param_blocks(self.steps[last], tied).contains(&b);
        if self.vertical && reads {
            self.position(self.backward(b, 0))
        } else {
            last
        }
    }

    /// Block `b`'s backward of micro-batch `m` (the head's forward and backward for the
    /// head).
    fn backward(&self, b: usize, m: usize) -> Compute {
        if b == self.head {
            Compute::Head(m)
        } else if b == 0 {
            Compute::EmbedBack(m)
        } else {
            Compute::LayerBack(b, m)
        }
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
