//! Checks strata-comm's `Mpi` transport under `mpirun`: every rank runs the conformance
//! check (every collective on odd lengths, bit for bit against the scalar references,
//! then the mismatches every rank must see as errors) and exits non-zero on any
//! difference. `.ci/mpi` runs it with 2 and 3 ranks.
//!
//! ```text
//! cargo build -p strata-comm --features mpi --example mpi_check
//! mpirun -np 3 target/debug/examples/mpi_check [--seed N] [--exit-timeout-s S]
//!     [--fail-rank R [--fail-how abort|exit|return]]
//! ```
//!
//! `--fail-rank R` makes rank R fail while the others wait in a barrier for it, to show
//! that the job ends (non-zero) instead of hanging. `--fail-how`: `abort` (the default:
//! `Collective::abort`, what strata does), `exit` (the process exits without finalising
//! MPI, as a crash would), `return` (returns from main: `Mpi` drops, waits
//! `--exit-timeout-s` for the others, then aborts the job).

use std::process::ExitCode;

use strata_comm::{Collective, Mpi, conformance};

fn main() -> ExitCode {
    let args = match Args::parse() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("mpi_check: {e}");
            return ExitCode::from(2);
        }
    };
    let mut mpi = match Mpi::init() {
        Ok(Some(mpi)) => mpi,
        Ok(None) => {
            eprintln!(
                "mpi_check: not started by an MPI launcher; run it as `mpirun -np 2 {}`",
                std::env::args().next().unwrap_or_default()
            );
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("mpi_check: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(timeout) = args.exit_timeout {
        mpi.set_exit_timeout(timeout);
    }
    let (rank, size) = (mpi.rank(), mpi.size());

    if let Some(fail_rank) = args.fail_rank {
        if rank == fail_rank {
            eprintln!(
                "mpi_check: rank {rank} fails on purpose ({})",
                args.fail_how
            );
            match args.fail_how.as_str() {
                "exit" => std::process::exit(3),
                "return" => return ExitCode::from(3),
                _ => mpi.abort("--fail-rank asked this rank to fail"),
            }
        }
        // Wait for the failed rank forever: only the launcher can end this.
        let result = mpi.barrier();
        eprintln!("mpi_check: rank {rank}: the barrier with a failed rank returned {result:?}");
        return ExitCode::FAILURE;
    }

    let mut calls = 0;
    let mut compared = 0;
    for seed in args.seed..args.seed + 3 {
        match conformance::check(&mpi, seed) {
            Ok(report) => {
                calls += report.call_count;
                compared += report.compared_count;
            }
            // One rank's mismatch ends the job, so the others do not wait for it.
            Err(e) => mpi.abort(&format!("conformance check failed: {e}")),
        }
    }
    // Any thread may call: one more check from a thread other than main.
    let from_thread = std::thread::scope(|s| s.spawn(|| conformance::check(&mpi, 99)).join());
    match from_thread {
        Ok(Ok(report)) => {
            calls += report.call_count;
            compared += report.compared_count;
        }
        Ok(Err(e)) => mpi.abort(&format!(
            "conformance check from a second thread failed: {e}"
        )),
        Err(_) => mpi.abort("the second thread panicked"),
    }
    println!(
        "mpi_check: rank {rank} of {size} (local rank {} of {}): ok, {calls} calls, {compared} results equal to the reference bit for bit",
        mpi.local_rank(),
        mpi.local_size()
    );
    ExitCode::SUCCESS
}

struct Args {
    seed: u64,
    fail_rank: Option<usize>,
    fail_how: String,
    exit_timeout: Option<std::time::Duration>,
}

impl Args {
    fn parse() -> Result<Args, String> {
        let mut args = Args {
            seed: 1,
            fail_rank: None,
            fail_how: "abort".into(),
            exit_timeout: None,
        };
        let mut it = std::env::args().skip(1);
        while let Some(flag) = it.next() {
            let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
            match flag.as_str() {
                "--seed" => args.seed = value()?.parse().map_err(|e| format!("--seed: {e}"))?,
                "--fail-rank" => {
                    args.fail_rank =
                        Some(value()?.parse().map_err(|e| format!("--fail-rank: {e}"))?)
                }
                "--fail-how" => {
                    args.fail_how = value()?;
                    if !["abort", "exit", "return"].contains(&args.fail_how.as_str()) {
                        return Err(format!(
                            "--fail-how must be abort, exit or return, not {}",
                            args.fail_how
                        ));
                    }
                }
                "--exit-timeout-s" => {
                    let seconds: f64 = value()?
                        .parse()
                        .map_err(|e| format!("--exit-timeout-s: {e}"))?;
                    args.exit_timeout = Some(std::time::Duration::from_secs_f64(seconds));
                }
                other => return Err(format!("unknown argument {other}")),
            }
        }
        Ok(args)
    }
}
