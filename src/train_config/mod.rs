//! The configuration of `strata train` (and of `strata plan`, which plans the step it
//! would run): every setting of a run, as one flat TOML table ([`TrainConfig`]) and as
//! command-line flags ([`TrainArgs`], [`PlanArgs`]), merged in that order over the
//! defaults, and checked together before anything starts. Errors are one line that names
//! the file or flag, the key, and what to write instead ([`ConfigError`]).
//!
//! - `table`: the settings, each declared once (key, help, type, default, flag,
//!   aliases, check).
//! - `values`: the types settings hold, and how each is read and described.
//! - `file`: TOML files, `--print-config`, and the merge of defaults, file and flags.
//! - `flags`: the flags of `strata train` and `strata plan`.
//! - `error`: why a configuration is refused, and where the value came from.
//!
//! This module reads and checks settings; it does not resolve them against the machine
//! (where swap files go when `nvme` is empty, which device `auto` picks, whether a
//! budget fits the model): [`crate::run_setup`] does.

mod error;
mod file;
mod flags;
mod table;
mod values;

pub use error::{ConfigError, Origin};
pub use flags::{PlanArgs, SettingFlags, StepFlags, TrainArgs, TrainFlags};
pub use table::TrainConfig;
pub use values::{Dtype, LrSchedule, OnNonFinite};
