//! The plan's typed ids: operations, logical buffers and physical slots are indices into
//! the plan's tables, each with a type of its own so that one is never taken for another.
//!
//! Not here: the tables themselves (`buffers.rs`, `ops.rs`, `schedule.rs`).

use std::fmt;

/// Index of an operation in [`Plan::ops`](crate::plan::Plan::ops) (the canonical order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub u32);

/// Index of a logical buffer in [`Plan::buffers`](crate::plan::Plan::buffers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufId(pub u32);

/// Index of a physical slot in [`Plan::slots`](crate::plan::Plan::slots).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId(pub u32);

macro_rules! index_type {
    ($($t:ident),*) => {$(
        impl $t {
            /// The position in its table.
            pub fn index(self) -> usize {
                self.0 as usize
            }

            /// The id of position `i`.
            pub fn of(i: usize) -> Self {
                $t(u32::try_from(i).expect("a plan indexes fewer than 2^32 items"))
            }
        }

        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}", self.0)
            }
        }
    )*};
}
index_type!(OpId, BufId, SlotId);
