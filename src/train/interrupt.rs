//! Ctrl-C during `strata train`: the first press lets the step finish and the run
//! checkpoint and stop; the second exits at once (`_exit(130)`). The handler only counts
//! presses; the loop reads the count between steps ([`interrupted`]).
//!
//! This is the training loop's one `unsafe`: installing a signal handler.

use std::sync::atomic::{AtomicU32, Ordering};

/// Ctrl-C presses seen.
static INTERRUPTS: AtomicU32 = AtomicU32::new(0);

extern "C" fn on_interrupt(_: libc::c_int) {
    if INTERRUPTS.fetch_add(1, Ordering::SeqCst) >= 1 {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(130) };
    }
}

/// Counts Ctrl-C presses from now on, the second ending the process.
pub fn install_handler() {
    let handler = on_interrupt as extern "C" fn(libc::c_int);
    // SAFETY: the handler only touches an atomic and calls _exit, both async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, handler as libc::sighandler_t);
    }
}

/// Whether Ctrl-C was pressed.
pub fn interrupted() -> bool {
    INTERRUPTS.load(Ordering::SeqCst) > 0
}
