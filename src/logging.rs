//! A small logger for the command line: messages from every crate go to stderr as
//! `strata: warning: ...`. The level comes from `STRATA_LOG` (error, warn, info, debug,
//! trace; default info). And the writes that never panic on a closed stdout or stderr
//! ([`stderr_line`], [`UntilClosed`]): `println!` and `eprintln!` panic when the reader
//! of a pipe has gone (`strata train ... | head -1`), which would end a run and lose its
//! work.

use std::io::{ErrorKind, Write};

use log::{Level, LevelFilter, Log, Metadata, Record};

/// Writes `line` and a newline to standard error, dropping it when stderr is closed.
pub fn stderr_line(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// A writer that stops writing, without an error, once its reader has gone (a broken
/// pipe): what a run prints is not worth the run. Other errors are returned.
pub struct UntilClosed<W> {
    inner: W,
    closed: bool,
}

impl<W: Write> UntilClosed<W> {
    /// Writes to `inner` until it reports a broken pipe.
    pub fn new(inner: W) -> Self {
        UntilClosed {
            inner,
            closed: false,
        }
    }

    fn absorb<T>(&mut self, result: std::io::Result<T>, done: T) -> std::io::Result<T> {
        match result {
            Err(e) if e.kind() == ErrorKind::BrokenPipe => {
                self.closed = true;
                Ok(done)
            }
            other => other,
        }
    }
}

impl<W: Write> Write for UntilClosed<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.closed {
            return Ok(buf.len());
        }
        let result = self.inner.write(buf);
        self.absorb(result, buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.closed {
            return Ok(());
        }
        let result = self.inner.flush();
        self.absorb(result, ())
    }
}

struct StderrLogger;

impl Log for StderrLogger {
    fn enabled(&self, metadata: &Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let level = match record.level() {
            Level::Error => "error: ",
            Level::Warn => "warning: ",
            Level::Info => "",
            Level::Debug => "debug: ",
            Level::Trace => "trace: ",
        };
        stderr_line(&format!("strata: {level}{}", record.args()));
    }

    fn flush(&self) {}
}

static LOGGER: StderrLogger = StderrLogger;

/// Installs the stderr logger once; later calls do nothing.
pub fn init() {
    let level = std::env::var("STRATA_LOG")
        .ok()
        .and_then(|v| v.parse::<LevelFilter>().ok())
        .unwrap_or(LevelFilter::Info);
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(level);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer whose reader has gone after `accepts` writes, failing with `kind`.
    struct Closing {
        accepts: usize,
        calls: usize,
        kind: ErrorKind,
    }

    impl Write for Closing {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.calls += 1;
            match self.calls > self.accepts {
                true => Err(self.kind.into()),
                false => Ok(buf.len()),
            }
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_broken_pipe_stops_the_writes_and_other_errors_come_back() {
        let mut w = UntilClosed::new(Closing {
            accepts: 1,
            calls: 0,
            kind: ErrorKind::BrokenPipe,
        });
        for _ in 0..3 {
            writeln!(w, "a line").unwrap();
        }
        assert_eq!(w.inner.calls, 2, "nothing written after the pipe closed");
        let mut w = UntilClosed::new(Closing {
            accepts: 0,
            calls: 0,
            kind: ErrorKind::StorageFull,
        });
        assert!(writeln!(w, "a line").is_err());
    }
}
