//! The values a program reads that change from step to step ([`Scalars`]): they are not
//! in the program, so one program serves every step.

use crate::adamw::AdamStep;

/// Values a program reads that change from step to step.
#[derive(Debug, Clone, Copy, Default)]
pub struct Scalars {
    /// The gradient of the loss with respect to each position's loss
    /// ([`Kernel::CrossEntropyBackward`](crate::kernel::Kernel::CrossEntropyBackward)).
    pub dloss: f32,
    /// The factor gradients are multiplied by in [`Kernel::GradStats`](crate::kernel::Kernel::GradStats).
    pub stats_scale: f32,
    /// AdamW's constants with weight decay.
    pub adam: Option<AdamStep>,
    /// AdamW's constants without weight decay.
    pub adam_no_decay: Option<AdamStep>,
    /// Skip every [`Kernel::AdamW`](crate::kernel::Kernel::AdamW) (non-finite gradients).
    pub skip_update: bool,
    /// The seed of this step's and micro-batch's randomized weight gradients; each sketch
    /// kernel mixes in its own `seed`
    /// ([`sketch_seed`](crate::kernel::sketch::sketch_seed)), so a micro-batch's forward
    /// and backward, run with the same scalars, share one sketch.
    pub sketch: u64,
}
