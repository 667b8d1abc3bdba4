//! The view checker: which byte ranges of a memory (the CPU device's, a host arena) are
//! being read or written right now, and by which lane.
//!
//! Every access to checked memory is registered for as long as it lasts; a new access
//! that overlaps an active one, either of them a write, is refused with
//! [`EngineError::OrderingViolation`]. The accesses of one operation are registered
//! together and may overlap each other (a kernel reads and writes slices of one buffer).
//! So a schedule that forgot a dependency fails loudly, naming both lanes, instead of
//! racing. On a GPU the DMA engines and kernels are not checked; the CPU device, which
//! runs the same schedules, is.

use std::ops::Range;
use std::sync::Mutex;

use crate::error::EngineError;
use crate::lane::Lane;

/// The accesses in progress on one memory.
pub(crate) struct AccessTable {
    /// The memory's name, for messages (`cpu`, `host arena`).
    name: String,
    state: Mutex<State>,
}

struct State {
    next_id: u64,
    active: Vec<Active>,
}

struct Active {
    id: u64,
    lane: Lane,
    range: Range<usize>,
    write: bool,
}

/// Accesses the table has room for from the start: more than can be active at once (a
/// kernel names at most 16 tensors, each stream and host lane runs one operation at a
/// time, an NVMe lane a few transfers), so that registering one never allocates, however
/// the lanes' timing falls.
const ROOM: usize = 256;

impl AccessTable {
    pub(crate) fn new(name: impl Into<String>) -> Self {
        AccessTable {
            name: name.into(),
            state: Mutex::new(State {
                next_id: 0,
                active: Vec::with_capacity(ROOM),
            }),
        }
    }

    /// Registers `ranges` (each with whether it is written) for `lane`, all or none; the
    /// returned id ends them ([`AccessTable::end`]). Empty ranges are not registered.
    pub(crate) fn begin(
        &self,
        lane: Lane,
        ranges: impl Iterator<Item = (Range<usize>, bool)> + Clone,
    ) -> Result<u64, EngineError> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for (range, write) in ranges.clone() {
            if range.is_empty() {
                continue;
            }
            let conflict = state.active.iter().find(|a| {
                a.range.start < range.end && range.start < a.range.end && (write || a.write)
            });
            if let Some(other) = conflict {
                return Err(EngineError::OrderingViolation {
                    device: self.name.clone(),
                    lane,
                    access: if write { "writes" } else { "reads" },
                    start_bytes: range.start,
                    end_bytes: range.end,
                    other_lane: other.lane,
                    other_access: if other.write {
                        "is writing"
                    } else {
                        "is reading"
                    },
                });
            }
        }
        let id = state.next_id;
        state.next_id += 1;
        for (range, write) in ranges {
            if !range.is_empty() {
                state.active.push(Active {
                    id,
                    lane,
                    range,
                    write,
                });
            }
        }
        Ok(id)
    }

    /// Ends the accesses registered under `id`.
    pub(crate) fn end(&self, id: u64) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.active.retain(|a| a.id != id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_writes_are_refused_and_reads_share() {
        let table = AccessTable::new("test");
        let a = table
            .begin(Lane::Compute, [(0..100, false)].into_iter())
            .unwrap();
        let b = table
            .begin(Lane::H2d, [(50..150, false)].into_iter())
            .unwrap();
        let e = table
            .begin(Lane::D2h, [(90..95, true)].into_iter())
            .unwrap_err();
        assert!(e.to_string().contains("d2h lane writes"), "{e}");
        // One operation's own ranges may overlap.
        table.end(a);
        table.end(b);
        let c = table
            .begin(Lane::Compute, [(0..10, true), (5..8, false)].into_iter())
            .unwrap();
        table.end(c);
        table
            .begin(Lane::D2h, [(0..200, true)].into_iter())
            .unwrap();
    }
}
