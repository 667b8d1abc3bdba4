//! A `config.json`'s values read as transformers' config classes need them: a size is a
//! positive integer, a flag `true` or `false`, a number a finite number. A value of the
//! wrong type, `null` where transformers would fail on it, or out of range is an error
//! naming the key and the value found, rather than a default taken in silence. `null`
//! reads as absent only for the keys whose absence means something ([`ConfigKeys::optional_size`]:
//! `num_key_value_heads`, `head_dim`, `sliding_window`).
//!
//! Not here: what each family does with the values (its `config.json` parser).

use std::path::Path;

use serde_json::Value;

use super::ModelError;

/// One parsed `config.json` and its path, for messages.
pub(crate) struct ConfigKeys<'a> {
    path: &'a Path,
    json: &'a Value,
}

impl<'a> ConfigKeys<'a> {
    /// The keys of `json`, read from `path`.
    pub(crate) fn new(path: &'a Path, json: &'a Value) -> Self {
        ConfigKeys { path, json }
    }

    /// An error about this file.
    pub(crate) fn error(&self, message: String) -> ModelError {
        ModelError::UnsupportedConfig {
            path: self.path.to_path_buf(),
            message,
        }
    }

    /// The value of the first of `keys` present, `null` included.
    fn first(&self, keys: &[&'a str]) -> Option<(&'a str, &'a Value)> {
        keys.iter().find_map(|k| self.json.get(*k).map(|v| (*k, v)))
    }

    /// A size: a positive integer under the first of `keys` present (the others are its
    /// older names); required.
    pub(crate) fn size(&self, keys: &[&'a str]) -> Result<usize, ModelError> {
        match self.first(keys) {
            Some((key, value)) => self.positive(key, value),
            None => Err(self.error(format!(
                "has no `{}`; it must be a positive integer",
                keys[0]
            ))),
        }
    }

    /// A size that may be absent or `null` (transformers then derives it).
    pub(crate) fn optional_size(&self, key: &str) -> Result<Option<usize>, ModelError> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => self.positive(key, value).map(Some),
        }
    }

    fn positive(&self, key: &str, value: &Value) -> Result<usize, ModelError> {
        match value.as_u64() {
            Some(v) if v > 0 && v <= usize::MAX as u64 => Ok(v as usize),
            _ => Err(self.error(format!(
                "`{key}` is {}; it must be a positive integer",
                shown(value)
            ))),
        }
    }

    /// A flag: `true` or `false`; `default` when absent.
    pub(crate) fn flag(&self, key: &str, default: bool) -> Result<bool, ModelError> {
        match self.json.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(value) => Err(self.error(format!(
                "`{key}` is {}; it must be true or false",
                shown(value)
            ))),
        }
    }

    /// A finite number; `default` when absent.
    pub(crate) fn number(&self, key: &str, default: f64) -> Result<f64, ModelError> {
        match self.json.get(key) {
            None => Ok(default),
            Some(value) => number_of(value).ok_or_else(|| {
                self.error(format!("`{key}` is {}; it must be a number", shown(value)))
            }),
        }
    }

    /// A text; `None` when absent.
    pub(crate) fn text(&self, key: &str) -> Result<Option<&'a str>, ModelError> {
        match self.json.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(value) => {
                Err(self.error(format!("`{key}` is {}; it must be a string", shown(value))))
            }
        }
    }
}

/// A JSON number that is finite, as f64.
pub(crate) fn number_of(value: &Value) -> Option<f64> {
    value.as_f64().filter(|v| v.is_finite())
}

/// A value as a message shows it: JSON, with its type where the text could hide it
/// (`"4" (a string)`).
pub(crate) fn shown(value: &Value) -> String {
    match value {
        Value::String(_) => format!("{value} (a string)"),
        Value::Null => "null".to_string(),
        _ => value.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys_of(text: &str) -> Value {
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn wrong_types_null_and_out_of_range_are_named_with_their_value() {
        let json = keys_of(
            r#"{"a": null, "b": "4", "c": 0, "d": -2, "e": 64.0, "f": 8, "g": "true",
                "h": "1e-5", "i": 7}"#,
        );
        let keys = ConfigKeys::new(Path::new("config.json"), &json);
        let err = |r: Result<usize, ModelError>| r.unwrap_err().to_string();
        assert!(err(keys.size(&["a"])).contains("`a` is null; it must be a positive integer"));
        assert!(err(keys.size(&["b"])).contains("`b` is \"4\" (a string)"));
        assert!(err(keys.size(&["c"])).contains("`c` is 0"));
        assert!(err(keys.size(&["d"])).contains("`d` is -2"));
        assert!(err(keys.size(&["e"])).contains("`e` is 64.0"));
        assert!(err(keys.size(&["missing"])).contains("has no `missing`"));
        assert_eq!(keys.size(&["x", "f"]).unwrap(), 8);
        assert_eq!(keys.optional_size("a").unwrap(), None);
        assert_eq!(keys.optional_size("missing").unwrap(), None);
        assert!(keys.optional_size("b").is_err());
        let flag = keys.flag("g", false).unwrap_err().to_string();
        assert!(flag.contains("`g` is \"true\" (a string); it must be true or false"));
        assert!(keys.flag("a", true).is_err());
        assert!(keys.flag("missing", true).unwrap());
        assert!(keys.number("h", 1.0).is_err());
        assert!(keys.number("a", 1.0).is_err());
        assert_eq!(keys.number("i", 1.0).unwrap(), 7.0);
        assert_eq!(keys.number("missing", 1.5).unwrap(), 1.5);
        assert!(keys.text("i").is_err());
        assert_eq!(keys.text("missing").unwrap(), None);
    }
}
