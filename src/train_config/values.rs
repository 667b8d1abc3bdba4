//! The types a setting holds, and for each ([`SettingType`]) how its flag reads it, how
//! errors describe what it must be, and what `--print-config` writes when it is unset; the
//! settings' own enums ([`LrSchedule`], [`Dtype`]); and serde for the engine's enums a
//! setting holds ([`policy_text`], [`device_text`]).
//!
//! Not here: which settings there are ([`super::table`]) or where their values come from.

use std::path::PathBuf;

use clap::builder::{EnumValueParser, PossibleValuesParser, TypedValueParser};
use clap::{Arg, ArgAction, ArgMatches, ValueEnum};
use serde::{Deserialize, Serialize};
use strata_engine::device::DeviceChoice;
use strata_engine::model::approx::APPROX_BACKWARD_FORM;
use strata_engine::model::weights::FileDtype;
use strata_engine::model::{ApproxBackward, BaseQuant};
use strata_engine::plan::{
    GradDtype, GradSpill, OptimizerState, PolicyChoice, Precision, Recompute, Schedule,
};

use crate::size::MemBudget;

/// How the learning rate moves over a run, after its warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    /// The peak rate until the end.
    Constant,
    /// Half a cosine from the peak rate down to `lr * min_lr_ratio` at the last step.
    #[default]
    Cosine,
}

/// What a run does at a step whose loss or gradients are not finite (fp32 and bf16; fp16's
/// overflow always skips the step and halves the loss scale).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum OnNonFinite {
    /// Stop before the step's update is applied, keeping the state before it.
    #[default]
    Stop,
    /// Skip the step's update and go on with the next step.
    Skip,
}

/// The working precision of parameters and activations on the device. Master weights and
/// optimizer state stay fp32 whatever this says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 32-bit floats throughout.
    #[default]
    Fp32,
    /// bfloat16, with fp32 accumulation.
    Bf16,
    /// IEEE half precision, with dynamic loss scaling.
    Fp16,
}

impl Dtype {
    /// The planner's precision.
    pub const fn precision(self) -> Precision {
        match self {
            Dtype::Fp32 => Precision::Fp32,
            Dtype::Bf16 => Precision::Bf16,
            Dtype::Fp16 => Precision::Fp16,
        }
    }

    /// The type of tensors saved in it.
    pub const fn file_dtype(self) -> FileDtype {
        match self {
            Dtype::Fp32 => FileDtype::F32,
            Dtype::Bf16 => FileDtype::Bf16,
            Dtype::Fp16 => FileDtype::F16,
        }
    }
}

/// A type a setting holds: how its flag reads it, and how an error or `--print-config`
/// describes it.
pub(crate) trait SettingType: Sized {
    /// What `--print-config` writes as the value of an unset key.
    const PLACEHOLDER: &str = "...";

    /// What a value must be, after "must be": "a whole number, 0 or more".
    fn expected() -> String;

    /// Why `word`, a string that does not read as this type, is refused (the words after
    /// the key: "is not a size: ..."), for a type written as words; `None` where a string
    /// is the wrong type of value (an error then says [`SettingType::expected`]).
    fn refusal(_word: &str) -> Option<String> {
        None
    }

    /// The flag, with its value parser and how many values it takes.
    fn arg(arg: Arg) -> Arg;

    /// The flag's value in `matches`, when it was given.
    fn from_matches(matches: &ArgMatches, id: &str) -> Option<Self>;
}

/// One value of type `T` for flag `id`, when given (none for a flag the command lacks).
fn one<T: Clone + Send + Sync + 'static>(matches: &ArgMatches, id: &str) -> Option<T> {
    matches.try_get_one::<T>(id).ok().flatten().cloned()
}

/// Scalars read by clap's own value parser for their type.
macro_rules! scalar_setting {
    ($($ty:ty: $expected:literal, $placeholder:literal, |$arg:ident| $tweak:expr;)*) => {$(
        impl SettingType for $ty {
            const PLACEHOLDER: &str = $placeholder;

            fn expected() -> String {
                $expected.to_string()
            }

            fn arg($arg: Arg) -> Arg {
                $tweak.value_parser(clap::value_parser!($ty)).action(ArgAction::Set)
            }

            fn from_matches(matches: &ArgMatches, id: &str) -> Option<Self> {
                one(matches, id)
            }
        }
    )*};
}

scalar_setting! {
    String: "a string", "...", |arg| arg;
    PathBuf: "a path (a string)", "\"PATH\"", |arg| arg;
    u64: "a whole number, 0 or more", "2", |arg| arg;
    usize: "a whole number, 0 or more", "2", |arg| arg;
    f64: "a number", "...", |arg| arg.allow_negative_numbers(true);
    // `--delayed-update` alone is true; `--delayed-update=false` turns it off.
    bool: "true or false", "...", |arg| arg
        .num_args(0..=1)
        .default_missing_value("true")
        .value_name("BOOL");
}

impl SettingType for Vec<PathBuf> {
    fn expected() -> String {
        "an array of paths, such as [\"/mnt/nvme0\"]".to_string()
    }

    fn arg(arg: Arg) -> Arg {
        arg.value_parser(clap::value_parser!(PathBuf))
            .action(ArgAction::Append)
    }

    fn from_matches(matches: &ArgMatches, id: &str) -> Option<Self> {
        let values = matches.try_get_many::<PathBuf>(id).ok().flatten()?;
        Some(values.cloned().collect())
    }
}

/// An optional setting: unset unless given.
impl<T: SettingType> SettingType for Option<T> {
    const PLACEHOLDER: &str = T::PLACEHOLDER;

    fn expected() -> String {
        T::expected()
    }

    fn refusal(word: &str) -> Option<String> {
        T::refusal(word)
    }

    fn arg(arg: Arg) -> Arg {
        T::arg(arg)
    }

    fn from_matches(matches: &ArgMatches, id: &str) -> Option<Self> {
        T::from_matches(matches, id).map(Some)
    }
}

impl SettingType for MemBudget {
    fn expected() -> String {
        "a size string, such as \"48MiB\", or \"all\"".to_string()
    }

    fn refusal(word: &str) -> Option<String> {
        let error = word.parse::<MemBudget>().err()?;
        Some(format!("is not a size: {error}"))
    }

    fn arg(arg: Arg) -> Arg {
        arg.value_parser(clap::value_parser!(MemBudget))
            .action(ArgAction::Set)
            .value_name("SIZE")
    }

    fn from_matches(matches: &ArgMatches, id: &str) -> Option<Self> {
        one(matches, id)
    }
}

impl SettingType for ApproxBackward {
    fn expected() -> String {
        format!("a string: {APPROX_BACKWARD_FORM}")
    }

    fn refusal(word: &str) -> Option<String> {
        let error = word.parse::<ApproxBackward>().err()?;
        Some(format!("is not an approximation: {error}"))
    }

    fn arg(arg: Arg) -> Arg {
        arg.value_parser(clap::value_parser!(ApproxBackward))
            .action(ArgAction::Set)
            .value_name("LIST")
    }

    fn from_matches(matches: &ArgMatches, id: &str) -> Option<Self> {
        one(matches, id)
    }
}

/// `one of "a", "b"`: the words of a choice, each quoted as TOML writes it.
fn quoted_choices(names: &[String]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
    format!("one of {}", quoted.join(", "))
}

/// The names clap gives the values of `T`.
fn value_names<T: ValueEnum>() -> Vec<String> {
    T::value_variants()
        .iter()
        .filter_map(|v| v.to_possible_value())
        .map(|v| v.get_name().to_string())
        .collect()
}

/// Enums whose words are their clap names; a word that names none is the wrong type of
/// value (the error lists the words).
macro_rules! choice_setting {
    ($($ty:ty),*) => {$(
        impl SettingType for $ty {
            fn expected() -> String {
                quoted_choices(&value_names::<$ty>())
            }

            fn arg(arg: Arg) -> Arg {
                arg.value_parser(EnumValueParser::<$ty>::new())
                    .action(ArgAction::Set)
            }

            fn from_matches(matches: &ArgMatches, id: &str) -> Option<Self> {
                one(matches, id)
            }
        }
    )*};
}

choice_setting!(
    BaseQuant,
    LrSchedule,
    Dtype,
    Recompute,
    GradSpill,
    GradDtype,
    OnNonFinite,
    OptimizerState,
    Schedule
);

/// "must be one of a, b (found "c")": how a word that names no policy or device is
/// refused.
fn not_one_of(names: &[impl AsRef<str>], word: &str) -> String {
    let names: Vec<&str> = names.iter().map(AsRef::as_ref).collect();
    format!("must be one of {} (found \"{word}\")", names.join(", "))
}

impl SettingType for PolicyChoice {
    fn expected() -> String {
        format!("one of {}", PolicyChoice::names().join(", "))
    }

    fn refusal(word: &str) -> Option<String> {
        let _ = word.parse::<PolicyChoice>().err()?;
        Some(not_one_of(&PolicyChoice::names(), word))
    }

    fn arg(arg: Arg) -> Arg {
        let names = PossibleValuesParser::new(PolicyChoice::names());
        arg.value_parser(names.try_map(|name| name.parse::<PolicyChoice>()))
            .action(ArgAction::Set)
    }

    fn from_matches(matches: &ArgMatches, id: &str) -> Option<Self> {
        one(matches, id)
    }
}

impl SettingType for DeviceChoice {
    fn expected() -> String {
        format!("one of {}", value_names::<DeviceChoice>().join(", "))
    }

    fn refusal(word: &str) -> Option<String> {
        let _ = DeviceChoice::from_str(word, false).err()?;
        Some(not_one_of(&value_names::<DeviceChoice>(), word))
    }

    fn arg(arg: Arg) -> Arg {
        // The names alone: the flag's help says what each does.
        let names = PossibleValuesParser::new(value_names::<DeviceChoice>());
        arg.value_parser(names.try_map(|name| DeviceChoice::from_str(&name, false)))
            .action(ArgAction::Set)
    }

    fn from_matches(matches: &ArgMatches, id: &str) -> Option<Self> {
        one(matches, id)
    }
}

/// A [`PolicyChoice`] in TOML and JSON: its name.
pub(crate) mod policy_text {
    use serde::{Deserialize, Deserializer, Serializer};
    use strata_engine::plan::PolicyChoice;

    pub fn serialize<S: Serializer>(value: &PolicyChoice, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(value)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<PolicyChoice, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// A [`DeviceChoice`] in TOML and JSON: its name.
pub(crate) mod device_text {
    use clap::ValueEnum;
    use serde::{Deserialize, Deserializer, Serializer};
    use strata_engine::device::DeviceChoice;

    pub fn serialize<S: Serializer>(value: &DeviceChoice, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(value)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DeviceChoice, D::Error> {
        let word = String::deserialize(d)?;
        DeviceChoice::from_str(&word, false).map_err(serde::de::Error::custom)
    }
}
