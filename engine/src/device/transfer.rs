//! A copy through a pinned pool slot in flight ([`Transfer`]): the slot stays with it
//! until the copy has completed, so a slot is never reused under a copy. Both devices
//! make them (the pinned-pool benchmarks); the executor's copies go through the host
//! arena instead and need none.
//!
//! Not here: the copies themselves (each device's `copy_h2d`/`copy_d2h`).

use std::fmt;

use super::event::Event;
use crate::error::EngineError;
use crate::memory::{DeviceBuffer, SlotLease};

/// A copy in flight, holding its pinned slot until the copy has completed.
///
/// [`Transfer::wait`] returns the slot (with the data, for a device-to-host copy).
/// Dropping a Transfer also waits for the copy before the slot goes back to its pool, so
/// a slot is never reused under a copy; the executor waits explicitly, where it chooses.
#[must_use = "a Transfer holds its slot until the copy completes; dropping it blocks until then"]
pub struct Transfer {
    event: Event,
    slot: Option<SlotLease>,
    /// Keeps the device range allocated while the copy may touch it.
    _buffer: DeviceBuffer,
}

impl Transfer {
    pub(crate) fn new(event: Event, slot: SlotLease, buffer: DeviceBuffer) -> Self {
        Self {
            event,
            slot: Some(slot),
            _buffer: buffer,
        }
    }

    /// The copy's event, for ordering other lanes after it.
    pub fn event(&self) -> &Event {
        &self.event
    }

    /// Whether the copy has completed, without blocking.
    pub fn is_complete(&self) -> Result<bool, EngineError> {
        self.event.is_complete()
    }

    /// Blocks until the copy has completed and returns the slot. If the copy failed the
    /// error is returned and the slot goes back to its pool, unless the device cannot say
    /// the copy has stopped (a CUDA failure), in which case the slot is leaked instead.
    pub fn wait(mut self) -> Result<SlotLease, EngineError> {
        let slot = self
            .slot
            .take()
            .expect("the slot is taken only by wait or drop");
        settle(&self.event, slot)
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take()
            && let Err(e) = settle(&self.event, slot)
        {
            log::error!("a dropped transfer failed: {e}");
        }
    }
}

impl fmt::Debug for Transfer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transfer")
            .field("event", &self.event)
            .field("slot", &self.slot)
            .finish()
    }
}

fn settle(event: &Event, slot: SlotLease) -> Result<SlotLease, EngineError> {
    match event.wait() {
        Ok(()) => Ok(slot),
        Err(e) => {
            if event.is_cpu() {
                // A CPU event reports failure only once its operation has stopped.
                drop(slot);
            } else {
                log::error!(
                    "slot {} of pool '{}' is leaked: the GPU failed before its copy was known \
                     to be finished",
                    slot.index(),
                    slot.pool_name()
                );
                std::mem::forget(slot);
            }
            Err(e)
        }
    }
}

/// A copy moves `buffer.len_bytes()` bytes to or from the start of the slot; a buffer
/// longer than the slot is a plan bug.
pub(super) fn assert_copy_fits(buffer: &DeviceBuffer, slot: &SlotLease) {
    assert!(
        buffer.len_bytes() <= slot.len_bytes(),
        "a copy of {} bytes does not fit slot {} of pool '{}' ({} bytes)",
        buffer.len_bytes(),
        slot.index(),
        slot.pool_name(),
        slot.len_bytes()
    );
}
