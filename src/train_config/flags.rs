//! The settings as command-line flags: [`TrainArgs`] (`strata train`: every setting's
//! flag) and [`PlanArgs`] (`strata plan`: the flags that shape a step), each with
//! `--config FILE` and `--print-config`. A flag given wins over the file, which wins over
//! the default. The flags are made from the settings' table, so they are declared there
//! once; clap parses each value into its type here, at the edge.
//!
//! Not here: what the settings are ([`super::table`]) or how a file is read
//! ([`super::file`]).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::{ArgMatches, Args, Command, FromArgMatches};

use super::error::{ConfigError, Origin};
use super::table::{Group, SETTINGS, TrainConfig};

/// The flags of some settings as given: their values over the defaults, and which were
/// given.
#[derive(Debug, Clone, Default)]
pub struct SettingFlags {
    /// The defaults, with the value of every flag given.
    values: TrainConfig,
    /// The keys of the flags given.
    given: BTreeSet<&'static str>,
}

impl SettingFlags {
    /// `cmd` with the flags of the settings of `groups`, in the table's order.
    fn augment(mut cmd: Command, groups: &[Group]) -> Command {
        for group in groups {
            for setting in SETTINGS.iter().filter(|s| s.group == *group) {
                cmd = cmd.arg(setting.flag());
            }
        }
        cmd
    }

    /// Reads every flag given in `matches` (a command's, which may lack some flags).
    fn read(&mut self, matches: &ArgMatches) {
        for setting in SETTINGS {
            if (setting.read_flag)(&mut self.values, matches) {
                self.given.insert(setting.key);
            }
        }
    }

    /// Writes every flag given into `config`; returns their keys.
    pub fn apply(&self, config: &mut TrainConfig) -> BTreeSet<&'static str> {
        for setting in SETTINGS.iter().filter(|s| self.given.contains(s.key)) {
            (setting.copy)(config, &self.values);
        }
        self.given.clone()
    }
}

/// Implements clap's `Args` for a newtype of [`SettingFlags`] holding the flags of
/// `groups`.
macro_rules! setting_flags {
    ($(#[$doc:meta])* $name:ident: $($group:ident),+) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Default)]
        pub struct $name(pub SettingFlags);

        impl FromArgMatches for $name {
            fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
                let mut flags = SettingFlags::default();
                flags.read(matches);
                Ok($name(flags))
            }

            fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
                self.0.read(matches);
                Ok(())
            }
        }

        impl Args for $name {
            fn augment_args(cmd: Command) -> Command {
                SettingFlags::augment(cmd, &[$(Group::$group),+])
            }

            fn augment_args_for_update(cmd: Command) -> Command {
                Self::augment_args(cmd)
            }
        }
    };
}

setting_flags! {
    /// The flags that shape a step, shared by `strata train` and `strata plan`: the model,
    /// the budgets, the batch, the precision, the device.
    StepFlags: Step
}

setting_flags! {
    /// Every setting's flag: the step's first, then the rest of the run's.
    TrainFlags: Step, Run
}

/// Arguments of `strata train`. Every setting can come from `--config FILE` and from its
/// flag; a flag given wins over the file, which wins over the default.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TrainArgs {
    /// A TOML file of settings (keys as in --print-config); flags given override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print the merged settings as TOML, every key with its help, and exit.
    #[arg(long)]
    pub print_config: bool,
    /// Every setting's flag.
    #[command(flatten)]
    pub flags: TrainFlags,
}

impl TrainArgs {
    /// The settings of the run: the defaults, then the `--config` file, then each flag
    /// given; checked with [`TrainConfig::validate`], an error naming where the value at
    /// fault came from.
    pub fn resolve(&self) -> Result<TrainConfig, ConfigError> {
        TrainConfig::resolve(self.config.as_deref(), |config| {
            Ok(self.flags.0.apply(config))
        })
    }
}

/// Arguments of `strata plan`: the flags that shape a step (as `strata train` takes them,
/// from `--config FILE` too), how many ranks to plan for, and where to write the answer
/// as JSON.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// A TOML file of settings (keys as in --print-config); flags given override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print the merged settings as TOML, every key with its help, and exit.
    #[arg(long)]
    pub print_config: bool,
    /// The flags that shape a step.
    #[command(flatten)]
    pub step: StepFlags,
    /// Also write the answer as JSON to FILE: params, and per policy whether it fits,
    /// its peak bytes per tier and predicted step seconds, and the policy auto picks.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Plan the step as one of N ranks of ZeRO-3 data parallelism, as `mpirun -np N
    /// strata train` runs it: each rank owns 1/N of every block's parameters, gradients
    /// and optimizer state, and the figures are per rank.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub ranks: usize,
}

impl Default for PlanArgs {
    /// No flags: one rank.
    fn default() -> Self {
        PlanArgs {
            config: None,
            print_config: false,
            step: StepFlags::default(),
            json: None,
            ranks: 1,
        }
    }
}

impl PlanArgs {
    /// The settings `strata train` would run with the same flags and file.
    pub fn resolve(&self) -> Result<TrainConfig, ConfigError> {
        TrainConfig::resolve(self.config.as_deref(), |config| {
            Ok(self.step.0.apply(config))
        })
    }

    /// The settings `strata plan` plans with for its flags given as `keywords` (keys as
    /// in `--print-config`, values typed: `{"batch": 4, "host_mem": "64GiB", "nvme":
    /// ["/mnt/a"]}`, as `strata.plan(...)` takes them), over the TOML file `config_file`
    /// when given; checked, an error naming the flag at fault. A key `strata plan` has no
    /// flag for is refused, as the command line refuses the flag.
    pub fn resolve_keywords(
        config_file: Option<&Path>,
        keywords: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<TrainConfig, ConfigError> {
        TrainConfig::resolve(config_file, |config| {
            config.overlay(step_table(keywords)?, &Origin::Flag)
        })
    }
}

/// `keywords` as a TOML table of step settings: a key of no setting or of one `strata
/// plan` takes no flag for is an unexpected argument.
fn step_table(
    keywords: &serde_json::Map<String, serde_json::Value>,
) -> Result<toml::Table, ConfigError> {
    let mut table = toml::Table::new();
    for (key, value) in keywords {
        let setting = SETTINGS
            .iter()
            .find(|s| s.key == key && s.group == Group::Step);
        let Some(setting) = setting else {
            return Err(ConfigError::UnknownKey {
                origin: Origin::Flag,
                key: key.clone(),
                suggestion: None,
            });
        };
        let value = toml::Value::try_from(value).map_err(|_| ConfigError::WrongType {
            origin: Origin::Flag,
            key: setting.key,
            expected: (setting.expected)(),
            found: value.to_string(),
        })?;
        table.insert(key.clone(), value);
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train_config::table::setting;

    /// Each flag's one-line help, by key, as `strata train --help` shows it.
    fn flag_help() -> Vec<(String, String)> {
        let command = <TrainArgs as clap::Args>::augment_args(Command::new("train"));
        command
            .get_arguments()
            .filter_map(|arg| {
                let help = arg.get_help()?.to_string();
                Some((arg.get_id().to_string(), help))
            })
            .collect()
    }

    /// A config with every optional key set, so that serializing it shows every key.
    fn everything_set() -> TrainConfig {
        TrainConfig {
            data: Some("d.txt".into()),
            host_mem: crate::size::MemBudget::mib(1024),
            prefetch: Some(2),
            checkpoint_dir: Some("ck".into()),
            out: Some("out".into()),
            save_dtype: Some(crate::train_config::Dtype::Bf16),
            log_jsonl: Some("log.jsonl".into()),
            trace: Some("trace.json".into()),
            resume: Some("ck/step-10".into()),
            lora: Some(8),
            init_adapter: Some("adapter".into()),
            quant: Some(strata_engine::model::BaseQuant::Nf4),
            ..TrainConfig::default()
        }
    }

    #[test]
    fn keys_are_the_fields_and_the_flags() {
        let table = toml::Table::try_from(everything_set()).expect("serializes");
        let fields: BTreeSet<&str> = table.keys().map(String::as_str).collect();
        let keys: BTreeSet<&str> = SETTINGS.iter().map(|s| s.key).collect();
        assert_eq!(fields, keys);
        let help = flag_help();
        for key in &keys {
            let flag = help.iter().find(|(k, _)| k == key);
            assert_eq!(
                flag.map(|(_, h)| h.clone()),
                Some(setting(key).help()),
                "{key}"
            );
        }
        for s in SETTINGS {
            for alias in s.aliases {
                assert!(!keys.contains(alias), "alias {alias} is a key");
            }
        }
        let plan = <PlanArgs as clap::Args>::augment_args(Command::new("plan"));
        let step: Vec<&str> = SETTINGS
            .iter()
            .filter(|s| s.group == Group::Step)
            .map(|s| s.key)
            .collect();
        for s in SETTINGS {
            let has = plan.get_arguments().any(|a| a.get_id() == s.key);
            assert_eq!(has, step.contains(&s.key), "{}", s.key);
        }
    }

    /// The flags' help states defaults in words; they must be the defaults.
    #[test]
    fn help_states_the_true_defaults() {
        let table = toml::Table::try_from(TrainConfig::default()).expect("serializes");
        for (key, help) in flag_help() {
            let Some(start) = help.find("[default: ") else {
                continue;
            };
            let stated = help[start + "[default: ".len()..].trim_end_matches(['.', ']']);
            match table.get(&key) {
                Some(toml::Value::Integer(i)) => assert_eq!(stated.parse(), Ok(*i), "{key}"),
                Some(toml::Value::Float(x)) => assert_eq!(stated.parse(), Ok(*x), "{key}"),
                Some(toml::Value::String(s)) => assert_eq!(stated, s, "{key}"),
                Some(toml::Value::Boolean(b)) => assert_eq!(stated, b.to_string(), "{key}"),
                // Unset or a list: the help says in words what happens.
                _ => {}
            }
        }
    }

    #[test]
    fn keywords_are_plan_s_flags() {
        let keywords = |json: &str| {
            let value: serde_json::Value = serde_json::from_str(json).unwrap();
            PlanArgs::resolve_keywords(None, value.as_object().unwrap())
        };
        let config = keywords(r#"{"batch": 3, "clip": 0, "host_mem": "all"}"#).unwrap();
        assert_eq!((config.batch, config.clip), (3, 0.0));
        assert_eq!(config.host_mem, crate::size::MemBudget::All);
        let e = keywords(r#"{"steps": 3}"#).unwrap_err().to_string();
        assert_eq!(e, "unexpected argument '--steps' found");
        let e = keywords(r#"{"device": "tpu"}"#).unwrap_err().to_string();
        assert_eq!(e, "--device must be one of auto, cpu, cuda (found \"tpu\")");
        let e = keywords(r#"{"batch": 0}"#).unwrap_err().to_string();
        assert_eq!(e, "--batch must be at least 1 (found 0)");
    }

    /// Every setting's flag reaches its field: a flag whose value parser and reader
    /// disagreed on its type would be dropped without a word.
    #[test]
    fn every_flag_is_read_into_its_setting() {
        let expected = TrainConfig {
            nvme: vec!["a".into(), "b".into()],
            delayed_update: true,
            ..everything_set()
        };
        let table = toml::Table::try_from(&expected).expect("serializes");
        let mut argv = vec!["train".to_string()];
        for s in SETTINGS {
            let flag = format!("--{}", s.key.replace('_', "-"));
            match &table[s.key] {
                toml::Value::String(v) => argv.extend([flag, v.clone()]),
                toml::Value::Array(items) => {
                    for item in items {
                        argv.extend([flag.clone(), item.as_str().expect("a path").into()]);
                    }
                }
                toml::Value::Boolean(b) => argv.push(format!("{flag}={b}")),
                other => argv.extend([flag, other.to_string()]),
            }
        }
        let matches = <TrainArgs as clap::Args>::augment_args(Command::new("train"))
            .try_get_matches_from(&argv)
            .expect("flags parse");
        let args = TrainArgs::from_arg_matches(&matches).expect("read");
        let mut config = TrainConfig::default();
        let given = args.flags.0.apply(&mut config);
        assert_eq!(given.len(), SETTINGS.len(), "{given:?}");
        assert_eq!(config, expected);
    }

    #[test]
    fn a_flag_given_is_applied_and_named() {
        let matches = <TrainArgs as clap::Args>::augment_args(Command::new("train"))
            .try_get_matches_from(["train", "--batch", "3", "--host-mem", "all"])
            .expect("flags parse");
        let args = TrainArgs::from_arg_matches(&matches).expect("read");
        let mut config = TrainConfig::default();
        let given = args.flags.0.apply(&mut config);
        assert_eq!(given, BTreeSet::from(["batch", "host_mem"]));
        assert_eq!(config.batch, 3);
        assert_eq!(config.host_mem, crate::size::MemBudget::All);
        assert_eq!(config.seq, TrainConfig::default().seq);
    }
}
