//! Settings as text: a TOML file (or a table of keyword values, as `strata.plan` takes
//! them) over a configuration ([`TrainConfig::overlay`]), the merge of defaults, file and
//! flags ([`TrainConfig::resolve`]), `--print-config`'s TOML ([`TrainConfig::to_toml`]),
//! the configuration a checkpoint recorded, and the key an unknown one most likely meant.
//!
//! Not here: the settings themselves ([`super::table`]) or the flags ([`super::flags`]).

use std::collections::BTreeSet;
use std::path::Path;

use super::error::{ConfigError, Origin};
use super::table::{SETTINGS, TrainConfig, setting};

/// How a TOML value reads in an error: `the string "8"`, `the integer -1`.
fn describe(value: &toml::Value) -> String {
    match value {
        toml::Value::String(_) => format!("the string {value}"),
        toml::Value::Integer(i) => format!("the integer {i}"),
        toml::Value::Float(x) => format!("the number {x}"),
        toml::Value::Boolean(b) => format!("{b}"),
        toml::Value::Datetime(d) => format!("the date {d}"),
        toml::Value::Array(_) => "an array".to_string(),
        toml::Value::Table(_) => "a table".to_string(),
    }
}

/// 1-based line and column of byte `offset` in `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    (line, column)
}

/// The key `unknown` most likely meant: ours or an alias of ours, by edit distance.
fn suggest(unknown: &str) -> Option<&'static str> {
    let unknown = unknown.to_ascii_lowercase().replace('-', "_");
    let names = SETTINGS.iter().flat_map(|s| {
        std::iter::once((s.key, s.key)).chain(s.aliases.iter().map(|alias| (*alias, s.key)))
    });
    names
        .map(|(written, key)| (edit_distance(&unknown, written), written, key))
        // Within a third of the word: `lerning_rate` finds `learning_rate`, `x` finds nothing.
        .filter(|(distance, written, _)| *distance <= (written.len() / 3).max(1))
        .min_by_key(|(distance, _, _)| *distance)
        .map(|(_, _, key)| key)
}

/// Edit distance between two strings by bytes, counting a swap of neighbours as one edit
/// (optimal string alignment): `stpes` is one edit from `steps`.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    // d[i][j]: distance between a[..i] and b[..j].
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let substitution = d[i - 1][j - 1] + usize::from(a[i - 1] != b[j - 1]);
            let mut best = substitution.min(d[i - 1][j] + 1).min(d[i][j - 1] + 1);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

/// Appends `text` as `# ` comment lines of at most `width` characters where words allow,
/// never breaking a `[default: ...]`.
fn wrap_comment(out: &mut String, text: &str, width: usize) {
    let (body, default) = match text.find("[default:") {
        Some(i) => text.split_at(i),
        None => (text, ""),
    };
    let mut line = String::from("#");
    let words = body.split_whitespace();
    for word in words.chain((!default.is_empty()).then_some(default)) {
        if line.len() > 1 && line.len() + 1 + word.len() > width {
            out.push_str(&line);
            out.push('\n');
            line = String::from("#");
        }
        line.push(' ');
        line.push_str(word);
    }
    out.push_str(&line);
    out.push('\n');
}

impl TrainConfig {
    /// Reads a TOML file of settings over the defaults, and checks the result.
    pub fn load(path: &Path) -> Result<TrainConfig, ConfigError> {
        let (config, _) = Self::read_file(path)?;
        config
            .validate()
            .map_err(|e| e.located(|_| Origin::File(path.to_path_buf())))?;
        Ok(config)
    }

    /// The settings of a run: the defaults, then `config_file`, then what `flags` writes
    /// (returning the keys it set); checked with [`TrainConfig::validate`], an error
    /// naming where the value at fault came from.
    pub fn resolve(
        config_file: Option<&Path>,
        flags: impl FnOnce(&mut TrainConfig) -> Result<BTreeSet<&'static str>, ConfigError>,
    ) -> Result<TrainConfig, ConfigError> {
        let (mut config, from_file) = match config_file {
            Some(path) => TrainConfig::read_file(path)?,
            None => (TrainConfig::default(), BTreeSet::new()),
        };
        let from_flags = flags(&mut config)?;
        config.validate().map_err(|e| {
            e.located(|key| match config_file {
                _ if from_flags.contains(key) => Origin::Flag,
                Some(path) if from_file.contains(key) => Origin::File(path.to_path_buf()),
                _ => Origin::Default,
            })
        })?;
        Ok(config)
    }

    /// The file's settings over the defaults, unchecked, and the keys the file set.
    pub(crate) fn read_file(
        path: &Path,
    ) -> Result<(TrainConfig, BTreeSet<&'static str>), ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
            path: path.to_path_buf(),
            error,
        })?;
        let table: toml::Table = toml::from_str(&text).map_err(|e| {
            let (line, column) = line_column(&text, e.span().map_or(0, |s| s.start));
            ConfigError::Syntax {
                path: path.to_path_buf(),
                line,
                column,
                message: e.message().trim().replace('\n', "; "),
            }
        })?;
        let mut config = TrainConfig::default();
        let set = config.overlay(table, &Origin::File(path.to_path_buf()))?;
        Ok((config, set))
    }

    /// `table`'s settings (TOML keys and values, from `origin`) over these, unchecked;
    /// the keys it set. A key no setting has, or a value of the wrong type for its key,
    /// is refused, naming `origin`.
    pub fn overlay(
        &mut self,
        table: toml::Table,
        origin: &Origin,
    ) -> Result<BTreeSet<&'static str>, ConfigError> {
        let mut set = BTreeSet::new();
        for key in table.keys() {
            match SETTINGS.iter().find(|s| s.key == key) {
                Some(s) => set.insert(s.key),
                None => {
                    return Err(ConfigError::UnknownKey {
                        origin: origin.clone(),
                        key: key.clone(),
                        suggestion: suggest(key),
                    });
                }
            };
        }
        // A key at a time, so that a value at fault is named by its key, and described
        // in our words (serde's, "expected usize", are not the user's).
        for (key, value) in table {
            let mut merged = toml::Table::try_from(&*self).expect("every setting is TOML");
            merged.insert(key.clone(), value.clone());
            match merged.try_into::<TrainConfig>() {
                Ok(config) => *self = config,
                Err(_) => return Err(refused(origin, setting(&key).key, &value)),
            }
        }
        Ok(set)
    }

    /// The configuration as TOML with every key, each under a comment saying what it
    /// does; keys not set are written commented out. [`TrainConfig::load`] reads it back
    /// to an equal configuration.
    pub fn to_toml(&self) -> String {
        let table = toml::Table::try_from(self).expect("every field serializes to TOML");
        let mut out = String::from(
            "# strata train: the settings of this run. Use with `strata train --config FILE`;\n\
             # flags on the command line override the file.\n",
        );
        for setting in SETTINGS {
            let key = setting.key;
            out.push('\n');
            wrap_comment(&mut out, &setting.help(), 88);
            match table.get(key) {
                // Tiny rates read better as 1e-8 than as 0.00000001; both are TOML.
                Some(toml::Value::Float(x)) if *x != 0.0 && x.abs() < 1e-4 => {
                    out.push_str(&format!("{key} = {x:e}\n"))
                }
                Some(value) => out.push_str(&format!("{key} = {value}\n")),
                None => out.push_str(&format!("# {key} = {}  (not set)\n", setting.placeholder)),
            }
        }
        out
    }

    /// The configuration a checkpoint's trainer state records, and the number of ranks
    /// that trained it (the `ranks` key beside the configuration's; 1 when absent).
    /// `None` for a checkpoint from before settings were recorded.
    pub fn recorded(saved: &serde_json::Value) -> Option<(TrainConfig, usize)> {
        let mut saved = saved.clone();
        let ranks = saved
            .as_object_mut()?
            .remove("ranks")
            .and_then(|r| r.as_u64())
            .unwrap_or(1);
        let cfg = serde_json::from_value::<TrainConfig>(saved).ok()?;
        Some((cfg, ranks.max(1) as usize))
    }
}

/// Why `value` cannot be `key`'s: a word its type does not read (an invalid value), or a
/// value of another type.
fn refused(origin: &Origin, key: &'static str, value: &toml::Value) -> ConfigError {
    let setting = setting(key);
    let word_refusal = match value {
        toml::Value::String(word) => (setting.refusal)(word),
        _ => None,
    };
    match word_refusal {
        Some(problem) => ConfigError::Invalid {
            origin: origin.clone(),
            key,
            problem,
        },
        None => ConfigError::WrongType {
            origin: origin.clone(),
            key,
            expected: (setting.expected)(),
            found: describe(value),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggestions() {
        assert_eq!(suggest("lerning_rate"), Some("lr"));
        assert_eq!(suggest("learning-rate"), Some("lr"));
        assert_eq!(suggest("batch_size"), Some("batch"));
        assert_eq!(suggest("stpes"), Some("steps"));
        assert_eq!(suggest("device-mem"), Some("device_mem"));
        assert_eq!(suggest("warmup"), Some("warmup_steps"));
        assert_eq!(suggest("zzzzzz"), None);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("stpes", "steps"), 1);
    }

    #[test]
    fn line_and_column() {
        assert_eq!(line_column("ab\ncd", 0), (1, 1));
        assert_eq!(line_column("ab\ncd", 4), (2, 2));
    }

    #[test]
    fn comments_wrap() {
        let mut out = String::new();
        wrap_comment(&mut out, "one two three four", 10);
        assert_eq!(out, "# one two\n# three\n# four\n");
    }

    #[test]
    fn keywords_are_flags_in_errors() {
        let mut config = TrainConfig::default();
        let table: toml::Table = toml::from_str("colour = \"blue\"").unwrap();
        let e = config.overlay(table, &Origin::Flag).unwrap_err();
        assert!(
            e.to_string().starts_with("unexpected argument '--colour'"),
            "{e}"
        );
        let table: toml::Table = toml::from_str("batch = \"4\"").unwrap();
        let e = config.overlay(table, &Origin::Flag).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--batch must be a whole number, 0 or more, not the string \"4\""
        );
        let table: toml::Table = toml::from_str("batch = 4\nhost_mem = \"1GiB\"").unwrap();
        let set = config.overlay(table, &Origin::Flag).unwrap();
        assert_eq!(set, BTreeSet::from(["batch", "host_mem"]));
        assert_eq!((config.batch, config.host_mem.bytes()), (4, Some(1 << 30)));
    }
}
