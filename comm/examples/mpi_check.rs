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
//! Then every collective runs again after a warm-up under a counting global allocator:
//! the Rust side of `Mpi` must allocate nothing (MPI's own C allocations are not seen).
//!
//! `--fail-rank R` makes rank R fail while the others wait in a barrier for it, to show
//! that the job ends (non-zero) instead of hanging. `--fail-how`: `abort` (the default:
//! `Collective::abort`, what strata does), `exit` (the process exits without finalising
//! MPI, as a crash would), `return` (returns from main: `Mpi` drops, waits
//! `--exit-timeout-s` for the others, then aborts the job).

use std::process::ExitCode;
use std::sync::atomic::Ordering;

use strata_comm::{Collective, Mpi, conformance};

#[path = "../../tests/support/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::{ALLOCATIONS, COUNTING};

/// Every collective once on the caller's buffers; how many allocations they made.
fn allocations_of_every_collective(mpi: &Mpi, bytes: &mut [u8], floats: &mut [f32]) -> usize {
    let size = mpi.size();
    let (send, recv) = bytes.split_at_mut(bytes.len() / (size + 1));
    let (send_f32, acc) = floats.split_at_mut(floats.len() / (size + 1) * size);
    let acc = &mut acc[..send_f32.len() / size];
    let mut values = [0.5f64; 16];
    let before = ALLOCATIONS.load(Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    let results = [
        mpi.all_gather(send, &mut recv[..size * send.len()]),
        mpi.reduce_scatter_sum(send_f32, acc, true),
        mpi.all_reduce_sum_f64(&mut values),
        mpi.broadcast(0, send),
        mpi.barrier(),
    ];
    COUNTING.store(false, Ordering::SeqCst);
    if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
        mpi.abort(&format!("a collective failed: {e}"));
    }
    ALLOCATIONS.load(Ordering::SeqCst) - before
}

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
    let mut bytes = vec![3u8; (size + 1) * 4096];
    let mut floats = vec![0.25f32; (size + 1) * 4096];
    allocations_of_every_collective(&mpi, &mut bytes, &mut floats);
    let allocations: usize = (0..10)
        .map(|_| allocations_of_every_collective(&mpi, &mut bytes, &mut floats))
        .sum();
    if allocations != 0 {
        mpi.abort(&format!(
            "collectives after the first allocated {allocations} times"
        ));
    }
    println!(
        "mpi_check: rank {rank} of {size} (local rank {} of {}): ok, {calls} calls, {compared} results equal to the reference bit for bit, no allocation after warm-up",
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
