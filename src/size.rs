//! Sizes and counts as people write them on a command line or in a config file:
//! [`ByteSize`] (`4GiB`, `500GB`, `4096`), [`MemBudget`] (a size, or `all`), and
//! [`parse_count`] (`64M`, `7k`). Each is parsed once, where the text enters (clap's value
//! parser, serde for TOML); everything past that edge holds the number.
//!
//! This module does not print sizes for people (`format_bytes` does, as `4.00 GiB`); the
//! [`fmt::Display`] here writes a size back in the form it reads, so that a printed config
//! reads back equal.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A number of bytes, written with a unit: `KiB`, `MiB`, `GiB`, `TiB` are powers of 1024
/// and `KB`, `MB`, `GB`, `TB` powers of 1000 (so `24GB` is 24 * 10^9 bytes, what a drive's
/// label says); a bare `K`, `M`, `G` or `T` is binary, as buffer sizes usually are; a plain
/// number is bytes. Fractions that come to whole bytes are fine (`1.5GiB`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// `n` MiB.
    pub const fn mib(n: u64) -> Self {
        ByteSize(n << 20)
    }

    /// `n` GiB.
    pub const fn gib(n: u64) -> Self {
        ByteSize(n << 30)
    }

    /// The bytes.
    pub const fn bytes(self) -> u64 {
        self.0
    }
}

/// The units [`ByteSize`]'s `Display` writes, largest first.
const UNITS: [(&str, u64); 8] = [
    ("TiB", 1 << 40),
    ("TB", 1_000_000_000_000),
    ("GiB", 1 << 30),
    ("GB", 1_000_000_000),
    ("MiB", 1 << 20),
    ("MB", 1_000_000),
    ("KiB", 1 << 10),
    ("KB", 1_000),
];

impl fmt::Display for ByteSize {
    /// The largest unit that divides the size exactly (`16MiB`, `2TB`), else bytes: what
    /// [`FromStr`] reads back to the same size.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bytes = self.0;
        match UNITS
            .iter()
            .find(|(_, unit)| bytes >= *unit && bytes.is_multiple_of(*unit))
        {
            Some((name, unit)) => write!(f, "{}{name}", bytes / unit),
            None => write!(f, "{bytes}"),
        }
    }
}

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        parse_scaled(text, 1024)
            .map(ByteSize)
            .map_err(|e| format!("{e} (examples: 4096, 64KiB, 1MiB, 4GiB, 500GB)"))
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// A memory budget: a size, or all there is (`all`, in any case), which the training
/// loop resolves against the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemBudget {
    /// No budget stated: what the device or drive has.
    All,
    /// At most this much.
    Bytes(ByteSize),
}

impl MemBudget {
    /// What `all` is written as.
    pub const ALL: &str = "all";

    /// `n` MiB.
    pub const fn mib(n: u64) -> Self {
        MemBudget::Bytes(ByteSize::mib(n))
    }

    /// The stated bytes; `None` for [`MemBudget::All`].
    pub const fn bytes(self) -> Option<u64> {
        match self {
            MemBudget::All => None,
            MemBudget::Bytes(size) => Some(size.0),
        }
    }
}

impl fmt::Display for MemBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemBudget::All => f.write_str(Self::ALL),
            MemBudget::Bytes(size) => size.fmt(f),
        }
    }
}

impl FromStr for MemBudget {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        if text.trim().eq_ignore_ascii_case(Self::ALL) {
            return Ok(MemBudget::All);
        }
        text.parse().map(MemBudget::Bytes)
    }
}

impl Serialize for MemBudget {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for MemBudget {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// clap's value parser for a size flag held as bytes: [`ByteSize`]'s reading of it.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    text.parse::<ByteSize>().map(ByteSize::bytes)
}

/// Parses a count such as `64M`, `1.5G`, `100000` or `7k`, with decimal multiples.
pub fn parse_count(text: &str) -> Result<u64, String> {
    parse_scaled(text, 1000).map_err(|e| format!("{e} (examples: 100000, 7k, 64M, 1.5G)"))
}

/// `text` as a number with an optional unit; a bare `K`, `M`, `G`, `T` is a power of
/// `base`.
fn parse_scaled(text: &str, base: u64) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(t.len());
    let (number, suffix) = t.split_at(split);
    let number: f64 = number
        .replace('_', "")
        .parse()
        .map_err(|_| format!("'{text}' is not a number with an optional unit"))?;
    let suffix = suffix.trim().to_ascii_lowercase();
    // "KB", "MB", ... are decimal whatever the base; "KiB", ... binary.
    let (stem, base) = match suffix.strip_suffix("ib") {
        Some(stem) => (stem.to_string(), 1024),
        None => match suffix.strip_suffix('b') {
            Some(stem) if !stem.is_empty() => (stem.to_string(), 1000),
            _ => (suffix.clone(), base),
        },
    };
    let power = match stem.as_str() {
        "" | "b" if suffix.len() <= 1 => 0,
        "k" => 1,
        "m" => 2,
        "g" => 3,
        "t" => 4,
        _ => return Err(format!("unknown unit '{suffix}' in '{text}'")),
    };
    let value = number * (base as f64).powi(power);
    if !value.is_finite() || value < 0.0 || value > u64::MAX as f64 {
        return Err(format!("'{text}' is out of range"));
    }
    if value.fract() != 0.0 {
        return Err(format!("'{text}' is not a whole number"));
    }
    Ok(value as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(text: &str) -> Result<u64, String> {
        text.parse::<ByteSize>().map(ByteSize::bytes)
    }

    #[test]
    fn parses_sizes_and_counts() {
        assert_eq!(size("4096"), Ok(4096));
        assert_eq!(size("1MiB"), Ok(1 << 20));
        assert_eq!(size("4GiB"), Ok(4 << 30));
        assert_eq!(size("64k"), Ok(64 << 10));
        assert_eq!(size("1.5G"), Ok(3 << 29));
        assert_eq!(size("24GB"), Ok(24_000_000_000));
        assert_eq!(size("24gb"), Ok(24_000_000_000));
        assert_eq!(size("24GiB"), Ok(24 << 30));
        assert_eq!(size("1TB"), Ok(1_000_000_000_000));
        assert_eq!(size("512B"), Ok(512));
        assert_eq!(size("3KB"), Ok(3000));
        assert!(size("3iB").is_err());
        assert!(size("3xB").is_err());
        assert_eq!(parse_count("64M"), Ok(64_000_000));
        assert_eq!(parse_count("100_003"), Ok(100_003));
        assert!(size("4 parsecs").is_err());
        assert!(size("").is_err());
        assert!(size("0.5").is_err());
        assert_eq!(
            size("lots"),
            Err("'lots' is not a number with an optional unit \
                 (examples: 4096, 64KiB, 1MiB, 4GiB, 500GB)"
                .into())
        );
    }

    #[test]
    fn sizes_print_in_the_largest_exact_unit_and_read_back() {
        for (text, printed) in [
            ("16MiB", "16MiB"),
            ("1.5GiB", "1536MiB"),
            ("2TB", "2TB"),
            ("900GB", "900GB"),
            ("1TiB", "1TiB"),
            ("4096", "4KiB"),
            ("1000", "1KB"),
            ("1023", "1023"),
            ("0", "0"),
        ] {
            let size: ByteSize = text.parse().unwrap();
            assert_eq!(size.to_string(), printed, "{text}");
            assert_eq!(printed.parse::<ByteSize>(), Ok(size), "{text}");
        }
    }

    #[test]
    fn a_budget_is_a_size_or_all() {
        assert_eq!("all".parse::<MemBudget>(), Ok(MemBudget::All));
        assert_eq!(" ALL ".parse::<MemBudget>(), Ok(MemBudget::All));
        assert_eq!("8MiB".parse::<MemBudget>(), Ok(MemBudget::mib(8)));
        assert_eq!(MemBudget::All.to_string(), "all");
        assert_eq!(MemBudget::All.bytes(), None);
        assert_eq!(MemBudget::mib(8).bytes(), Some(8 << 20));
        assert!("some".parse::<MemBudget>().is_err());
        let json = serde_json::to_string(&MemBudget::mib(16)).unwrap();
        assert_eq!(json, "\"16MiB\"");
        assert_eq!(
            serde_json::from_str::<MemBudget>("\"all\"").unwrap(),
            MemBudget::All
        );
    }
}
