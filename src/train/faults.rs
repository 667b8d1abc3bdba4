//! I/O faults injected into a run's swap files, for the soak test (`tests/soak.rs`):
//! `STRATA_FAULTS="seed=N,rate=R,kinds=eio,enospc,short,bitflip,eintr"` runs the NVMe tier
//! over [`strata_storage::FaultPlan`]'s seeded faulty system calls, each listed kind
//! hitting a fraction R of the calls it can hit (`KIND=R` sets one kind's own fraction;
//! `max-delay-ms=N` bounds `delay`; `after-ms=N` lets no fault in for the first N ms after
//! the swap files are set up). The draws hang on the seed and on each call's file,
//! offset and length, so a restarted run must take another seed or it meets the same
//! faults at the same places again; and since every step asks for the same transfers, a
//! fault that must reach the caller comes at the first step after `after-ms` or never,
//! which is why the soak driver draws `after-ms` for each run.
//!
//! The run says so at its start, and at its end, whichever way it ends (a fault that
//! reached the caller, a finished run; not SIGKILL), prints one line counting the faults
//! of each kind it met: the soak driver totals these lines.
//!
//! Not here: the faults themselves (`strata_storage`'s `io::faulty`), or what the run
//! does when one reaches it (the executor's error, the training loop's way out).

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use strata_engine::exec::ExecConfig;
use strata_storage::{FaultKind, FaultPlan, InjectedFault};

/// The environment variable that turns fault injection on.
pub const FAULTS_ENV: &str = "STRATA_FAULTS";

/// Every kind, by the name `STRATA_FAULTS` gives it, in the order the count line lists them.
const KINDS: [(&str, FaultKind); 7] = [
    ("eio", FaultKind::Eio),
    ("enospc", FaultKind::Enospc),
    ("eof", FaultKind::Eof),
    ("bitflip", FaultKind::BitFlip),
    ("short", FaultKind::Short),
    ("eintr", FaultKind::Eintr),
    ("delay", FaultKind::Delay),
];

/// The longest injected delay unless `max-delay-ms` says otherwise.
const DEFAULT_MAX_DELAY: Duration = Duration::from_millis(2);

/// A run's fault injection: when dropped (the run over, whichever way), prints how many
/// faults of each kind it injected.
pub struct Injection {
    plan: FaultPlan,
}

impl Drop for Injection {
    fn drop(&mut self) {
        // Never a panic here (a closed stderr): the count is for the soak driver only.
        let _ = writeln!(
            std::io::stderr(),
            "strata: {}",
            count_line(&self.plan, &self.plan.injected())
        );
    }
}

/// Sets `config`'s faults from `STRATA_FAULTS` when it is set; the returned guard prints
/// the count when the run ends (keep it alive for the whole run).
pub fn from_env(config: &mut ExecConfig) -> Result<Option<Injection>, String> {
    let Ok(spec) = std::env::var(FAULTS_ENV) else {
        return Ok(None);
    };
    let (plan, after) = parse(&spec).map_err(|e| {
        format!("{FAULTS_ENV}={spec}: {e}; unset it to run without injected faults")
    })?;
    log::warn!(
        "{FAULTS_ENV} is set: injecting I/O faults into the swap files (seed {}, from {} ms \
         on); the run may fail on purpose",
        plan.seed,
        after.as_millis()
    );
    if !after.is_zero() {
        plan.pause(true);
        let paused = plan.clone();
        std::thread::Builder::new()
            .name("strata-faults".into())
            .spawn(move || {
                std::thread::sleep(after);
                paused.pause(false);
            })
            .map_err(|e| {
                format!("{FAULTS_ENV}: cannot start the thread that lets faults in: {e}")
            })?;
    }
    config.faults = Some(plan.clone());
    Ok(Some(Injection { plan }))
}

/// The plan `spec` describes, and how long it lets no fault in: `key=value` items
/// separated by commas, where `kinds`'s value goes on over the items after it that have
/// no `=`.
fn parse(spec: &str) -> Result<(FaultPlan, Duration), String> {
    let mut plan = FaultPlan::seeded(0);
    let mut after = Duration::ZERO;
    let mut seed = None;
    let mut rate = None;
    let mut listed = Vec::new();
    let mut own: BTreeMap<&str, f64> = BTreeMap::new();
    let mut in_kinds = false;
    plan.max_delay = DEFAULT_MAX_DELAY;
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let Some((key, value)) = item.split_once('=') else {
            if !in_kinds {
                return Err(format!("'{item}' is not key=value"));
            }
            listed.push(kind_named(item)?.0);
            continue;
        };
        in_kinds = key == "kinds";
        match key {
            "seed" => {
                let s = value.parse::<u64>();
                seed = Some(s.map_err(|_| format!("seed '{value}' is not a whole number"))?);
            }
            "rate" => rate = Some(fraction(key, value)?),
            "kinds" => listed.push(kind_named(value)?.0),
            "max-delay-ms" => plan.max_delay = millis(key, value)?,
            "after-ms" => after = millis(key, value)?,
            _ => {
                let (name, _) = kind_named(key).map_err(|_| {
                    format!(
                        "unknown key '{key}' (expected seed, rate, kinds, max-delay-ms, \
                         after-ms or a kind: {})",
                        kind_names()
                    )
                })?;
                own.insert(name, fraction(key, value)?);
            }
        }
    }
    plan.seed = seed.ok_or("no seed (add seed=N)")?;
    if !listed.is_empty() && rate.is_none() {
        return Err("kinds are listed without a rate (add rate=R)".into());
    }
    for name in listed {
        own.entry(name).or_insert(rate.unwrap_or(0.0));
    }
    if own.is_empty() {
        return Err(format!(
            "no fault kind (add kinds=... from {})",
            kind_names()
        ));
    }
    for (name, r) in own {
        *per_million(&mut plan, kind_named(name)?.1) = (r * 1e6).round() as u32;
    }
    Ok((plan, after))
}

fn millis(key: &str, value: &str) -> Result<Duration, String> {
    let ms = value.parse::<u64>();
    let ms = ms.map_err(|_| format!("{key} '{value}' is not a whole number of milliseconds"))?;
    Ok(Duration::from_millis(ms))
}

/// A rate: a fraction of the calls, at least one in a million and at most all.
fn fraction(key: &str, value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(r) if (1e-6..=1.0).contains(&r) => Ok(r),
        _ => Err(format!(
            "{key} '{value}' is not a fraction of the calls between 0.000001 and 1"
        )),
    }
}

fn kind_named(name: &str) -> Result<(&'static str, FaultKind), String> {
    KINDS
        .iter()
        .find(|(n, _)| *n == name)
        .copied()
        .ok_or_else(|| format!("unknown fault kind '{name}' (expected {})", kind_names()))
}

fn kind_names() -> String {
    KINDS.map(|(n, _)| n).join(", ")
}

/// `plan`'s rate of `kind`, per million calls.
fn per_million(plan: &mut FaultPlan, kind: FaultKind) -> &mut u32 {
    match kind {
        FaultKind::Eio => &mut plan.eio_per_million,
        FaultKind::Enospc => &mut plan.enospc_per_million,
        FaultKind::Eof => &mut plan.eof_per_million,
        FaultKind::BitFlip => &mut plan.bitflip_per_million,
        FaultKind::Short => &mut plan.short_per_million,
        FaultKind::Eintr => &mut plan.eintr_per_million,
        FaultKind::Delay => &mut plan.delay_per_million,
    }
}

/// `faults injected (seed N): eio 1, short 7, ...`: every kind `plan` injects, with
/// its count in `log`.
fn count_line(plan: &FaultPlan, log: &[InjectedFault]) -> String {
    let mut plan = plan.clone();
    let counts: Vec<String> = KINDS
        .iter()
        .filter(|(_, kind)| *per_million(&mut plan, *kind) > 0)
        .map(|(name, kind)| {
            let n = log.iter().filter(|f| f.kind == *kind).count();
            format!("{name} {n}")
        })
        .collect();
    format!(
        "faults injected (seed {}): {}",
        plan.seed,
        counts.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_storage::OpKind;

    #[test]
    fn the_soak_spec_sets_each_listed_kind_and_nothing_else() {
        let (p, after) =
            parse("seed=7,rate=0.001,kinds=eio,enospc,short,bitflip,eintr,short=0.05").unwrap();
        assert_eq!(after, Duration::ZERO);
        assert_eq!(p.seed, 7);
        assert_eq!(
            [
                p.eio_per_million,
                p.enospc_per_million,
                p.bitflip_per_million,
                p.eintr_per_million
            ],
            [1000; 4]
        );
        assert_eq!(p.short_per_million, 50_000, "a kind's own rate wins");
        assert_eq!((p.eof_per_million, p.delay_per_million), (0, 0));
        assert_eq!(p.max_delay, DEFAULT_MAX_DELAY);
        let (p, after) = parse("seed=1, delay=1, max-delay-ms=5, after-ms=300").unwrap();
        assert_eq!(
            (p.delay_per_million, p.max_delay),
            (1_000_000, Duration::from_millis(5))
        );
        assert_eq!(after, Duration::from_millis(300));
    }

    #[test]
    fn a_bad_spec_names_what_is_wrong() {
        for (spec, needle) in [
            ("rate=0.1,kinds=eio", "no seed"),
            ("seed=x,eio=0.1", "seed 'x'"),
            ("seed=1,kinds=eio", "without a rate"),
            (
                "seed=1,rate=0.1,kinds=eio,typo",
                "unknown fault kind 'typo'",
            ),
            ("seed=1,speed=2", "unknown key 'speed'"),
            ("seed=1,eio=2", "eio '2' is not a fraction"),
            ("seed=1,eio=0", "eio '0' is not a fraction"),
            ("seed=1", "no fault kind"),
            ("eio", "'eio' is not key=value"),
            (
                "seed=1,eio=0.1,after-ms=1.5",
                "after-ms '1.5' is not a whole number",
            ),
        ] {
            let e = parse(spec).unwrap_err();
            assert!(e.contains(needle), "{spec}: {e}");
        }
    }

    #[test]
    fn the_count_line_counts_each_kind_the_plan_injects() {
        let (p, _) = parse("seed=3,rate=0.01,kinds=eio,short,eintr").unwrap();
        let fault = |kind| InjectedFault {
            kind,
            op: OpKind::Read,
            fd: 3,
            offset_bytes: 0,
            len_bytes: 4096,
        };
        let log = [
            fault(FaultKind::Short),
            fault(FaultKind::Eio),
            fault(FaultKind::Short),
        ];
        assert_eq!(
            count_line(&p, &log),
            "faults injected (seed 3): eio 1, short 2, eintr 0"
        );
    }
}
