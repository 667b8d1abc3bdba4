//! Why a configuration was refused ([`ConfigError`]), and where the value at fault came
//! from ([`Origin`]): each error is one line that names the file or flag, the key, and
//! what to write instead.
//!
//! Not here: the checks that find the problems ([`super::table`], [`super::file`]).

use std::fmt;
use std::io;
use std::path::PathBuf;

/// Where a setting's value came from, so that an error names what to change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// The built-in default, or a value set in code.
    Default,
    /// A key of this config file.
    File(PathBuf),
    /// A command-line flag (or a keyword argument of `strata.plan`, which takes the
    /// flags).
    Flag,
}

/// Why a configuration was refused. Each displays as one line naming the file or flag,
/// the key, and what to do.
#[derive(Debug)]
pub enum ConfigError {
    /// The config file could not be read.
    Read {
        /// The file.
        path: PathBuf,
        /// What reading it gave.
        error: io::Error,
    },
    /// The config file is not TOML.
    Syntax {
        /// The file.
        path: PathBuf,
        /// 1-based line of the error.
        line: usize,
        /// 1-based column of the error.
        column: usize,
        /// The parser's message.
        message: String,
    },
    /// A key no setting has.
    UnknownKey {
        /// Where it was written.
        origin: Origin,
        /// The key as written.
        key: String,
        /// The key it most likely meant.
        suggestion: Option<&'static str>,
    },
    /// A key holds the wrong kind of value.
    WrongType {
        /// Where it was written.
        origin: Origin,
        /// The key.
        key: &'static str,
        /// What it should hold.
        expected: String,
        /// What it holds.
        found: String,
    },
    /// A setting has a value it cannot take.
    Invalid {
        /// Where the value came from.
        origin: Origin,
        /// The key.
        key: &'static str,
        /// What is wrong and what would be right, e.g. "must be at least 1 (found 0)".
        problem: String,
    },
}

/// What an error about `key` from `origin` begins with: the file and the key, the flag,
/// or the key alone.
fn subject(origin: &Origin, key: &str) -> String {
    match origin {
        Origin::Default => format!("`{key}`"),
        Origin::File(path) => format!("{}: `{key}`", path.display()),
        Origin::Flag => format!("--{}", key.replace('_', "-")),
    }
}

/// An unknown key and what it most likely meant, as the place it was written names keys.
fn unknown_key(
    f: &mut fmt::Formatter<'_>,
    origin: &Origin,
    key: &str,
    suggestion: Option<&str>,
) -> fmt::Result {
    const LIST: &str = "strata train --print-config lists every key";
    let place = match origin {
        Origin::File(path) => format!("{}: ", path.display()),
        Origin::Default | Origin::Flag => String::new(),
    };
    match (origin, suggestion) {
        (Origin::Flag, Some(s)) => write!(
            f,
            "unexpected argument '--{}' found; did you mean '--{}'?",
            key.replace('_', "-"),
            s.replace('_', "-")
        ),
        (Origin::Flag, None) => {
            write!(f, "unexpected argument '--{}' found", key.replace('_', "-"))
        }
        (_, Some(s)) => write!(
            f,
            "{place}unknown key `{key}`; did you mean `{s}`? ({LIST})"
        ),
        (_, None) => write!(f, "{place}unknown key `{key}` ({LIST})"),
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Read { path, error } if error.kind() == io::ErrorKind::NotFound => {
                write!(
                    f,
                    "{}: no such config file; check the --config path \
                     (strata train --print-config > train.toml writes one)",
                    path.display()
                )
            }
            ConfigError::Read { path, error } => {
                write!(
                    f,
                    "{}: cannot read the config file: {error}",
                    path.display()
                )
            }
            ConfigError::Syntax {
                path,
                line,
                column,
                message,
            } => write!(
                f,
                "{}:{line}:{column}: not valid TOML: {message}",
                path.display()
            ),
            ConfigError::UnknownKey {
                origin,
                key,
                suggestion,
            } => unknown_key(f, origin, key, *suggestion),
            ConfigError::WrongType {
                origin,
                key,
                expected,
                found,
            } => write!(
                f,
                "{} must be {expected}, not {found}",
                subject(origin, key)
            ),
            ConfigError::Invalid {
                origin,
                key,
                problem,
            } => write!(f, "{} {problem}", subject(origin, key)),
        }
    }
}

impl std::error::Error for ConfigError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConfigError::Read { error, .. } => Some(error),
            _ => None,
        }
    }
}

impl ConfigError {
    /// A value that a setting cannot take, from the default (see
    /// [`ConfigError::located`]).
    pub(crate) fn invalid(key: &'static str, problem: String) -> ConfigError {
        ConfigError::Invalid {
            origin: Origin::Default,
            key,
            problem,
        }
    }

    /// An invalid value's error with its origin, which `origin` finds from its key.
    pub(crate) fn located(self, origin: impl FnOnce(&'static str) -> Origin) -> ConfigError {
        match self {
            ConfigError::Invalid { key, problem, .. } => ConfigError::Invalid {
                origin: origin(key),
                key,
                problem,
            },
            other => other,
        }
    }
}
