//! Signals of a strata process. Ctrl-C during `strata train`: the first press is
//! acknowledged at once on stderr and lets the step finish, the run save and stop; the
//! second exits at once (`_exit(130)`). The handler only counts presses and writes a
//! fixed line; the loop reads the count between steps ([`interrupted`]). A closed pipe
//! ends the other subcommands quietly ([`die_on_closed_pipe`]).
//!
//! Its `unsafe` installs the signal handlers and writes from one.

use std::sync::atomic::{AtomicU32, Ordering};

/// Ctrl-C presses seen.
static INTERRUPTS: AtomicU32 = AtomicU32::new(0);

/// What the first Ctrl-C prints, at once.
const ACKNOWLEDGED: &[u8] =
    b"\nstrata: Ctrl-C: finishing step, then saving; press again to quit now\n";

extern "C" fn on_interrupt(_: libc::c_int) {
    if INTERRUPTS.fetch_add(1, Ordering::SeqCst) >= 1 {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(130) };
    }
    // SAFETY: write is async-signal-safe; the buffer is a static of that length. A
    // failed write (stderr closed) is of no consequence.
    unsafe {
        libc::write(
            libc::STDERR_FILENO,
            ACKNOWLEDGED.as_ptr().cast(),
            ACKNOWLEDGED.len(),
        )
    };
}

/// Counts Ctrl-C presses from now on, the second ending the process.
pub fn install_handler() {
    let handler = on_interrupt as extern "C" fn(libc::c_int);
    // SAFETY: the handler only touches an atomic and calls write and _exit, all
    // async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, handler as libc::sighandler_t);
    }
}

/// Whether Ctrl-C was pressed.
pub fn interrupted() -> bool {
    INTERRUPTS.load(Ordering::SeqCst) > 0
}

/// Restores SIGPIPE's default, so that a subcommand whose output pipe closed ends quietly
/// (as `cat` does), where Rust's ignored SIGPIPE would make `println!` panic. Not for
/// `strata train`, which writes through writers that stop at a closed pipe and trains on.
pub fn die_on_closed_pipe() {
    // SAFETY: restoring a signal's default disposition has no preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
