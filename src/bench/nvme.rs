//! `strata bench nvme`: how fast the NVMe tier moves extents, against its peers in the
//! same run.
//!
//! It writes, then reads, a file of `--size` bytes as extents the way an NVMe lane of the
//! training executor does: through a [`TensorStore`], from and into leases of a pinned
//! [`HostArena`] registered with the store (so io_uring uses WriteFixed and ReadFixed),
//! writes checksumming a head of a third of each extent on its own as optimizer state's
//! master parameters are, and [`NVME_IN_FLIGHT`] extents in flight (`--in-flight`). It
//! runs with checksums off (the drive's limit) and on (what training pays), and reports
//! the median GiB/s of `--repeat` rounds with the latency percentiles of each block-size
//! chunk and of each extent. The peers run in the same rounds, interleaved with strata,
//! on the same size, block size and queue depth, O_DIRECT: fio in its fastest
//! configurations (and with huge-page buffers where huge pages are reserved), and
//! DeepSpeed's `ds_io` (`aio_handle`) when `--peers DIR` names the env
//! `../shared/anchors/setup DIR` made. It prints strata's ratio to the best fio and to
//! ds_io. `--sweep` tries block sizes and queue depths and recommends the best, as
//! DeepSpeed's `ds_nvme_tune` does.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::Instant;

use hdrhistogram::Histogram;
use serde::Serialize;

use super::{ds_io, fio};
use crate::engine::Lane;
use crate::engine::exec::NVME_IN_FLIGHT;
use crate::engine::memory::{HostArena, HostLease, HostLocking, HostRange, Pinning};
use crate::report::{Table, format_bytes, median, median_index, write_json};
use crate::size::parse_bytes;
use crate::storage::{
    BackendChoice, ExtentId, IoStats, Pending, StoreConfig, TensorStore, filesystem_type, is_tmpfs,
};

/// Whether the bench runs with extent checksums off, on, or both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Checksums {
    /// Without checksums: the drive's limit.
    Off,
    /// With crc32c written and verified per extent, as training runs.
    On,
    /// Both, off first.
    Both,
}

/// Options of `strata bench nvme`.
#[derive(Debug, Clone, clap::Args)]
pub struct NvmeArgs {
    /// Folder for the test files, on the drive to measure (repeat for several drives,
    /// which are striped). Must not be tmpfs to measure a drive.
    #[arg(long = "path", default_values_os_t = vec![std::env::temp_dir()])]
    pub paths: Vec<PathBuf>,
    /// Bytes written and read per pass.
    #[arg(long, default_value = "4GiB", value_parser = parse_bytes)]
    pub size: u64,
    /// Block size: transfers are split into chunks of this many bytes.
    #[arg(long, default_value = "1MiB", value_parser = parse_bytes)]
    pub block: u64,
    /// Queue depth: chunks in flight at once.
    #[arg(long, default_value_t = 32)]
    pub qd: usize,
    /// Size of each extent (the unit the engine swaps).
    #[arg(long, default_value = "64MiB", value_parser = parse_bytes)]
    pub extent: u64,
    /// I/O backend: auto, uring or threads.
    #[arg(long, default_value = "auto")]
    pub backend: BackendChoice,
    /// Run with checksums off, on, or both.
    #[arg(long, value_enum, default_value = "both")]
    pub checksums: Checksums,
    /// Passes per measurement; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Also try block sizes 128 KiB..4 MiB × queue depths 4..64 and print the best.
    #[arg(long)]
    pub sweep: bool,
    /// Extents in flight at once; the default is what an NVMe lane of the training
    /// executor keeps.
    #[arg(long, default_value_t = NVME_IN_FLIGHT)]
    pub in_flight: usize,
    /// Do not run fio even if it is installed.
    #[arg(long)]
    pub no_fio: bool,
    /// Also run DeepSpeed's ds_io (aio_handle) in each round, from the Python env in DIR
    /// (made by ../shared/anchors/setup DIR).
    #[arg(long, value_name = "DIR")]
    pub peers: Option<PathBuf>,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Latency percentiles, microseconds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
}

impl Percentiles {
    fn of(histogram: &Histogram<u64>) -> Self {
        let us = |q: f64| histogram.value_at_quantile(q) as f64 / 1000.0;
        Self {
            p50_us: us(0.5),
            p99_us: us(0.99),
            p999_us: us(0.999),
        }
    }
}

/// One direction's result: every round's rate, their median, and latencies of the median
/// round.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    /// GiB/s of each round.
    pub gib_per_s: Vec<f64>,
    /// Their median.
    pub median_gib_per_s: f64,
    /// Latency of each block-size chunk (fio's completion latency), in the median round;
    /// none for ds_io, which does not report it.
    pub chunk_latency: Option<Percentiles>,
    /// Latency of each whole extent, submission to verified result (strata only).
    pub extent_latency: Option<Percentiles>,
}

/// One round's measurement of one direction: GiB/s, chunk and extent latencies.
type Sample = (f64, Option<Percentiles>, Option<Percentiles>);

/// Each round's samples of one implementation, by direction.
#[derive(Debug, Clone, Default)]
struct Samples {
    write: Vec<Sample>,
    read: Vec<Sample>,
}

impl Samples {
    fn push(&mut self, write: bool, sample: Sample) {
        if write {
            self.write.push(sample);
        } else {
            self.read.push(sample);
        }
    }

    fn phases(&self) -> (Phase, Phase) {
        let phase = |samples: &[Sample]| {
            let rates: Vec<f64> = samples.iter().map(|s| s.0).collect();
            let m = median_index(&rates);
            Phase {
                median_gib_per_s: median(&rates),
                chunk_latency: samples[m].1,
                extent_latency: samples[m].2,
                gib_per_s: rates,
            }
        };
        (phase(&self.write), phase(&self.read))
    }
}

/// strata's result in one checksum setting.
#[derive(Debug, Clone, Serialize)]
pub struct StrataResult {
    /// Whether checksums were written and verified.
    pub checksums: bool,
    /// Sequential write.
    pub write: Phase,
    /// Sequential read.
    pub read: Phase,
    /// Chunks, over all rounds, that went through registered buffers (WriteFixed and
    /// ReadFixed), as the backend counted them.
    pub fixed_chunks: u64,
    /// Chunks that went through plain buffers.
    pub plain_chunks: u64,
}

/// A peer's result in one configuration.
#[derive(Debug, Clone, Serialize)]
pub struct PeerResult {
    /// The peer and its configuration, for tables.
    pub name: String,
    /// The options it ran with.
    pub args: Vec<String>,
    /// Sequential write.
    pub write: Phase,
    /// Sequential read.
    pub read: Phase,
}

/// A peer that did not run, and why.
#[derive(Debug, Clone, Serialize)]
pub struct Skipped {
    /// The peer.
    pub name: String,
    /// Why.
    pub reason: String,
}

/// One point of the sweep.
#[derive(Debug, Clone, Serialize)]
pub struct SweepPoint {
    /// Block size.
    pub block_bytes: u64,
    /// Queue depth.
    pub queue_depth: usize,
    /// Write GiB/s.
    pub write_gib_per_s: f64,
    /// Read GiB/s.
    pub read_gib_per_s: f64,
}

/// Everything `strata bench nvme` measured.
#[derive(Debug, Clone, Serialize)]
pub struct NvmeReport {
    /// The swap folders.
    pub paths: Vec<PathBuf>,
    /// Their filesystems.
    pub filesystems: Vec<String>,
    /// Whether the store bypassed the page cache.
    pub direct_io: bool,
    /// The backend that ran.
    pub backend: String,
    /// How strata's host memory was locked (the executor's pinned arena).
    pub host_memory: String,
    /// Bytes per round and direction.
    pub size_bytes: u64,
    /// Block size.
    pub block_bytes: u64,
    /// Queue depth.
    pub queue_depth: usize,
    /// Extent size.
    pub extent_bytes: u64,
    /// Extents in flight at once.
    pub in_flight: usize,
    /// Rounds; in each, every implementation writes then reads once.
    pub repeat: usize,
    /// strata, per checksum setting.
    pub strata: Vec<StrataResult>,
    /// fio's version, if it ran.
    pub fio_version: Option<String>,
    /// fio, per configuration.
    pub fio: Vec<PeerResult>,
    /// DeepSpeed's ds_io, when `--peers` was given and it ran.
    pub ds_io: Option<PeerResult>,
    /// Peers that did not run.
    pub skipped: Vec<Skipped>,
    /// strata / the best fio and strata / ds_io, by direction and checksum setting.
    pub ratios: Vec<Ratio>,
    /// The sweep, if asked for.
    pub sweep: Vec<SweepPoint>,
}

/// strata's median over a peer's median.
#[derive(Debug, Clone, Serialize)]
pub struct Ratio {
    /// "write" or "read".
    pub direction: &'static str,
    /// strata's checksum setting.
    pub checksums: bool,
    /// strata GiB/s.
    pub strata_gib_per_s: f64,
    /// The peer (for fio, the configuration that was best in this direction).
    pub peer: String,
    /// The peer's GiB/s.
    pub peer_gib_per_s: f64,
    /// strata / peer.
    pub ratio: f64,
}

const GIB: f64 = (1u64 << 30) as f64;

/// A store, its extents, and a pinned host arena with one slot per extent in flight.
struct Rig {
    store: TensorStore,
    ids: Vec<ExtentId>,
    extent_lens: Vec<usize>,
    arena: HostArena,
    slots: Vec<HostRange>,
    in_flight: usize,
}

impl Rig {
    fn new(
        args: &NvmeArgs,
        block_bytes: u64,
        queue_depth: usize,
        size_bytes: u64,
        checksums: bool,
    ) -> Result<Self, Box<dyn std::error::Error>> {
        let config = StoreConfig {
            dirs: args.paths.clone(),
            block_bytes: usize::try_from(block_bytes)?,
            queue_depth,
            backend: args.backend,
            checksums,
            stripe_bytes: block_bytes.max(4 << 20),
            ..StoreConfig::new(&args.paths[0], size_bytes)
        };
        let store = TensorStore::create(config)?;
        let extent = args.extent.min(size_bytes);
        let mut ids = Vec::new();
        let mut extent_lens = Vec::new();
        let mut offset = 0;
        while offset < size_bytes {
            let len = extent.min(size_bytes - offset);
            ids.push(store.allocate(&format!("extent-{}", ids.len()), len)?);
            extent_lens.push(usize::try_from(len)?);
            offset += len;
        }
        // The executor's host memory: one pinned arena, registered with the store, each
        // transfer a lease of a range of it.
        let slot_bytes = usize::try_from(extent.next_multiple_of(4096))?;
        let window = args.in_flight.clamp(1, ids.len());
        let arena = HostArena::new("bench nvme", slot_bytes * window, &Pinning::Mlock)?;
        arena.register_with(&store)?;
        let slots: Vec<HostRange> = (0..window)
            .map(|i| HostRange::new(i * slot_bytes, slot_bytes))
            .collect();
        for (i, slot) in slots.iter().enumerate() {
            fill(&mut arena.write(Lane::Cpu, *slot)?, i as u64);
        }
        Ok(Self {
            store,
            ids,
            extent_lens,
            arena,
            slots,
            in_flight: window,
        })
    }

    /// One sequential pass over every extent, `in_flight` at a time, oldest finished
    /// first; returns GiB/s, the backend's chunk latencies, and the extent latencies.
    fn pass(
        &mut self,
        write: bool,
    ) -> Result<(f64, IoStats, Histogram<u64>), Box<dyn std::error::Error>> {
        self.store.reset_io_stats();
        let mut extent_ns = Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3)?;
        let mut free = self.slots.clone();
        let mut in_flight: VecDeque<(Instant, HostRange, Pending<HostLease>)> =
            VecDeque::with_capacity(self.in_flight);
        let mut bytes = 0u64;
        let mut first_error = None;
        let started = Instant::now();
        let mut finish = |(submitted, slot, pending): (Instant, HostRange, Pending<HostLease>),
                          free: &mut Vec<HostRange>| {
            let (result, lease) = pending.wait();
            drop(lease);
            extent_ns.saturating_record(submitted.elapsed().as_nanos() as u64);
            free.push(slot);
            if let Err(e) = result {
                first_error.get_or_insert(e);
            }
        };
        for (i, &id) in self.ids.iter().enumerate() {
            if free.is_empty() {
                let oldest = in_flight.pop_front().expect("a transfer is in flight");
                finish(oldest, &mut free);
            }
            let slot = free.pop().expect("a free slot");
            let len = self.extent_lens[i] as u64;
            let pending = if write {
                // As the executor writes optimizer state: the master parameters, a third
                // of the extent, checksummed on their own too.
                let lease = self.arena.lease(Lane::NvmeWrite, slot, false)?;
                self.store.write_with_head(id, lease, len / 3)
            } else {
                let lease = self.arena.lease(Lane::NvmeRead, slot, true)?;
                self.store.read(id, lease)
            };
            in_flight.push_back((Instant::now(), slot, pending));
            bytes += len;
        }
        while let Some(oldest) = in_flight.pop_front() {
            finish(oldest, &mut free);
        }
        let seconds = started.elapsed().as_secs_f64();
        if let Some(error) = first_error {
            return Err(error.into());
        }
        Ok((
            bytes as f64 / GIB / seconds,
            self.store.io_stats(),
            extent_ns,
        ))
    }
}

/// Non-constant bytes, so checksums do real work and nothing compresses.
fn fill(bytes: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in bytes.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

fn locking_name(locking: &HostLocking) -> String {
    match locking {
        HostLocking::CudaRegistered => "page-locked, registered with CUDA".into(),
        HostLocking::Mlocked => "page-locked (mlock)".into(),
        HostLocking::Unlocked { reason } => format!("not locked ({reason})"),
    }
}

/// A peer in the rounds: its samples so far, or why it stopped.
struct PeerRun {
    name: String,
    args: Vec<String>,
    samples: Samples,
    failed: Option<String>,
}

impl PeerRun {
    fn new(name: &str, args: Vec<String>) -> Self {
        PeerRun {
            name: name.to_string(),
            args,
            samples: Samples::default(),
            failed: None,
        }
    }

    /// Runs one round (write, then read) unless an earlier one failed.
    fn round(&mut self, mut once: impl FnMut(bool) -> Result<Sample, String>) {
        for write in [true, false] {
            if self.failed.is_some() {
                return;
            }
            match once(write) {
                Ok(sample) => {
                    eprintln!(
                        "strata: {} {}: {:.2} GiB/s",
                        self.name,
                        if write { "write" } else { "read " },
                        sample.0
                    );
                    self.samples.push(write, sample);
                }
                Err(e) => {
                    log::warn!("{e}");
                    self.failed = Some(e);
                }
            }
        }
    }

    /// Its result, or why there is none.
    fn finish(self) -> Result<PeerResult, Skipped> {
        match self.failed {
            Some(reason) => Err(Skipped {
                name: self.name,
                reason,
            }),
            None => {
                let (write, read) = self.samples.phases();
                Ok(PeerResult {
                    name: self.name,
                    args: self.args,
                    write,
                    read,
                })
            }
        }
    }
}

fn sweep(args: &NvmeArgs) -> Result<Vec<SweepPoint>, Box<dyn std::error::Error>> {
    let size = args.size.min(1 << 30);
    let mut points = Vec::new();
    eprintln!(
        "strata: sweep over {} per pass, checksums off",
        format_bytes(size)
    );
    for block_bytes in [
        128u64 << 10,
        256 << 10,
        512 << 10,
        1 << 20,
        2 << 20,
        4 << 20,
    ] {
        for queue_depth in [4usize, 8, 16, 32, 64] {
            let mut rig = Rig::new(args, block_bytes, queue_depth, size, false)?;
            let (write_gib_per_s, _, _) = rig.pass(true)?;
            let (read_gib_per_s, _, _) = rig.pass(false)?;
            eprintln!(
                "strata:   block {:>8} qd {:>3}: write {:.2} GiB/s, read {:.2} GiB/s",
                format_bytes(block_bytes),
                queue_depth,
                write_gib_per_s,
                read_gib_per_s
            );
            points.push(SweepPoint {
                block_bytes,
                queue_depth,
                write_gib_per_s,
                read_gib_per_s,
            });
        }
    }
    Ok(points)
}

fn validate(args: &NvmeArgs) -> Result<(), String> {
    if args.paths.is_empty() {
        return Err("give at least one --path".into());
    }
    for path in &args.paths {
        if !path.is_dir() {
            return Err(format!("--path {} is not a folder", path.display()));
        }
    }
    if args.size == 0 || !args.size.is_multiple_of(4096) {
        return Err(format!(
            "--size {} must be a positive multiple of 4 KiB",
            args.size
        ));
    }
    if args.block == 0 || !args.block.is_multiple_of(4096) || args.block > 256 << 20 {
        return Err(format!(
            "--block {} must be a multiple of 4 KiB, at most 256 MiB",
            args.block
        ));
    }
    if args.extent == 0 || !args.extent.is_multiple_of(4096) {
        return Err(format!(
            "--extent {} must be a positive multiple of 4 KiB",
            args.extent
        ));
    }
    if !(1..=4096).contains(&args.qd) {
        return Err(format!("--qd {} must be between 1 and 4096", args.qd));
    }
    if args.repeat == 0 {
        return Err("--repeat must be at least 1".into());
    }
    if !(1..=64).contains(&args.in_flight) {
        return Err(format!(
            "--in-flight {} must be between 1 and 64",
            args.in_flight
        ));
    }
    if let Some(env) = &args.peers
        && !env.is_dir()
    {
        return Err(format!(
            "--peers {} is not a folder (make the env with ../shared/anchors/setup DIR)",
            env.display()
        ));
    }
    Ok(())
}

/// Runs the bench, prints its tables, and writes JSON if asked.
pub fn run(args: &NvmeArgs) -> Result<NvmeReport, Box<dyn std::error::Error>> {
    validate(args)?;
    let filesystems = filesystems(args);
    let settings: &[bool] = match args.checksums {
        Checksums::Off => &[false],
        Checksums::On => &[true],
        Checksums::Both => &[false, true],
    };
    let mut rigs = Vec::new();
    for &checksums in settings {
        rigs.push(Rig::new(args, args.block, args.qd, args.size, checksums)?);
    }
    let direct_io = rigs.iter().all(|r| r.store.direct_io());
    if !direct_io {
        log::warn!("the store could not use O_DIRECT here: these figures include the page cache");
    }
    let backend = rigs[0].store.backend().name().to_string();
    let host_memory = locking_name(rigs[0].arena.locking());
    let fio_version = if args.no_fio { None } else { fio::version() };
    let mut peers = Peers::new(args, fio_version.is_some());
    let strata = run_rounds(args, &mut rigs, &mut peers)?;
    drop(rigs);
    let (fio_results, ds_io, skipped) = peers.finish();
    let ratios = ratios(&strata, &fio_results, ds_io.as_ref());
    let sweep = if args.sweep { sweep(args)? } else { Vec::new() };
    let report = NvmeReport {
        paths: args.paths.clone(),
        filesystems,
        direct_io,
        backend,
        host_memory,
        size_bytes: args.size,
        block_bytes: args.block,
        queue_depth: args.qd,
        extent_bytes: args.extent,
        in_flight: args.in_flight,
        repeat: args.repeat,
        strata,
        fio_version,
        fio: fio_results,
        ds_io,
        skipped,
        ratios,
        sweep,
    };
    print!("{}", render(&report));
    if let Some(path) = &args.json {
        write_json(path, &report)?;
        eprintln!("strata: wrote {}", path.display());
    }
    Ok(report)
}

/// Each `--path`'s filesystem (a warning for one in RAM), after saying what the bench
/// will do.
fn filesystems(args: &NvmeArgs) -> Vec<String> {
    let filesystems: Vec<String> = args
        .paths
        .iter()
        .map(|p| filesystem_type(p).unwrap_or_else(|| "unknown".into()))
        .collect();
    for (path, fs) in args.paths.iter().zip(&filesystems) {
        if is_tmpfs(path) {
            log::warn!(
                "{} is on {fs} (RAM): this measures memory, not a drive; pass --path on the drive",
                path.display()
            );
        }
    }
    eprintln!(
        "strata: bench nvme: {} per pass in {}-byte extents, block {}, queue depth {}, {} passes, in {}",
        format_bytes(args.size),
        args.extent,
        format_bytes(args.block),
        args.qd,
        args.repeat,
        args.paths
            .iter()
            .zip(&filesystems)
            .map(|(p, fs)| format!("{} ({fs})", p.display()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    filesystems
}

/// The peers in the rounds: fio in each of its configurations (when it is here), and
/// DeepSpeed's ds_io (with `--peers`); and those that cannot run, with why.
struct Peers {
    fio: Vec<(&'static fio::FioEngine, PeerRun)>,
    ds: Option<(PathBuf, PeerRun)>,
    skipped: Vec<Skipped>,
}

impl Peers {
    fn new(args: &NvmeArgs, have_fio: bool) -> Self {
        let mut peers = Peers {
            fio: Vec::new(),
            ds: None,
            skipped: Vec::new(),
        };
        if have_fio {
            let run = |engine: &'static fio::FioEngine| {
                let args_of = engine.args.iter().map(|a| a.to_string()).collect();
                (engine, PeerRun::new(engine.name, args_of))
            };
            peers.fio.extend(fio::ENGINES.iter().map(run));
            match fio::huge_pages_short(args.qd as u64 * args.block) {
                Some(reason) => peers.skipped.push(Skipped {
                    name: fio::HUGE.name.to_string(),
                    reason,
                }),
                None => peers.fio.push(run(&fio::HUGE)),
            }
        } else if !args.no_fio {
            let reason = "fio is not on the PATH (install it: apt-get install fio)".to_string();
            log::warn!("{reason}, so there is no fio to compare with");
            peers.skipped.push(Skipped {
                name: "fio".into(),
                reason,
            });
        }
        peers.ds = args.peers.as_ref().map(|env| {
            let run = PeerRun::new(
                "DeepSpeed ds_io aio_handle",
                vec!["--engine".into(), "aio_handle".into()],
            );
            (env.clone(), run)
        });
        peers
    }

    /// One round of every peer, on the same size, block size and queue depth.
    fn round(&mut self, args: &NvmeArgs, fio_file: &std::path::Path) {
        for (engine, run) in &mut self.fio {
            run.round(|write| {
                let r = fio::run(engine, write, fio_file, args.size, args.block, args.qd)?;
                let [p50_us, p99_us, p999_us] = r.latency_us;
                let latency = Percentiles {
                    p50_us,
                    p99_us,
                    p999_us,
                };
                Ok((r.bytes_per_s / GIB, Some(latency), None))
            });
        }
        if let Some((env, run)) = &mut self.ds {
            run.round(|write| {
                let rate = ds_io::run(env, &args.paths[0], write, args.size, args.block, args.qd)?;
                Ok((rate / GIB, None, None))
            });
        }
    }

    /// fio's results, ds_io's, and every peer that did not run, with why.
    fn finish(mut self) -> (Vec<PeerResult>, Option<PeerResult>, Vec<Skipped>) {
        let mut fio_results = Vec::new();
        for (_, run) in self.fio {
            match run.finish() {
                Ok(result) => fio_results.push(result),
                Err(skip) => self.skipped.push(skip),
            }
        }
        let ds_io = match self.ds.map(|(_, run)| run.finish()) {
            Some(Ok(result)) => Some(result),
            Some(Err(skip)) => {
                self.skipped.push(skip);
                None
            }
            None => None,
        };
        (fio_results, ds_io, self.skipped)
    }
}

/// `--repeat` rounds: in each, strata in every setting, then every peer, writes then
/// reads, so that all see the drive in the same state and its swings spread over all of
/// them. strata's results per setting.
fn run_rounds(
    args: &NvmeArgs,
    rigs: &mut [Rig],
    peers: &mut Peers,
) -> Result<Vec<StrataResult>, Box<dyn std::error::Error>> {
    let fio_file = args.paths[0].join(format!("strata-fio-{}.dat", std::process::id()));
    let mut strata_samples = vec![Samples::default(); rigs.len()];
    let mut chunks = vec![(0u64, 0u64); rigs.len()];
    for round in 0..args.repeat {
        eprintln!("strata: round {} of {}", round + 1, args.repeat);
        for ((rig, samples), chunks) in rigs.iter_mut().zip(&mut strata_samples).zip(&mut chunks) {
            strata_round(rig, samples, chunks)?;
        }
        peers.round(args, &fio_file);
    }
    let _ = std::fs::remove_file(&fio_file);
    Ok(rigs
        .iter()
        .zip(&strata_samples)
        .zip(&chunks)
        .map(|((rig, samples), &(fixed_chunks, plain_chunks))| {
            let (write, read) = samples.phases();
            StrataResult {
                checksums: rig.store.checksums(),
                write,
                read,
                fixed_chunks,
                plain_chunks,
            }
        })
        .collect())
}

/// One round of strata in `rig`'s setting: a write pass, then a read pass; their samples,
/// and the chunks each kind of I/O took (fixed, plain).
fn strata_round(
    rig: &mut Rig,
    samples: &mut Samples,
    chunks: &mut (u64, u64),
) -> Result<(), Box<dyn std::error::Error>> {
    for write in [true, false] {
        let (rate, stats, extent_ns) = rig.pass(write)?;
        let chunk_ns = if write {
            &stats.write_latency_ns
        } else {
            &stats.read_latency_ns
        };
        eprintln!(
            "strata: strata {} checksums {}: {rate:.2} GiB/s",
            if write { "write" } else { "read " },
            if rig.store.checksums() { "on " } else { "off" },
        );
        chunks.0 += stats.fixed_chunks;
        chunks.1 += stats.plain_chunks;
        samples.push(
            write,
            (
                rate,
                Some(Percentiles::of(chunk_ns)),
                Some(Percentiles::of(&extent_ns)),
            ),
        );
    }
    Ok(())
}

/// strata's rate over the best fio configuration's and over ds_io's, per direction and
/// checksum setting.
fn ratios(
    strata: &[StrataResult],
    fio_results: &[PeerResult],
    ds_io: Option<&PeerResult>,
) -> Vec<Ratio> {
    let mut ratios = Vec::new();
    for direction in ["write", "read"] {
        let pick = |p: &Phase, q: &Phase| {
            if direction == "write" {
                p.median_gib_per_s
            } else {
                q.median_gib_per_s
            }
        };
        let best_fio = fio_results
            .iter()
            .max_by(|a, b| pick(&a.write, &a.read).total_cmp(&pick(&b.write, &b.read)));
        for peer in best_fio.into_iter().chain(ds_io) {
            let theirs = pick(&peer.write, &peer.read);
            for s in strata {
                let mine = pick(&s.write, &s.read);
                ratios.push(Ratio {
                    direction,
                    checksums: s.checksums,
                    strata_gib_per_s: mine,
                    peer: peer.name.clone(),
                    peer_gib_per_s: theirs,
                    ratio: mine / theirs,
                });
            }
        }
    }
    ratios
}

/// The report as the tables `run` prints.
pub fn render(report: &NvmeReport) -> String {
    let mut table = Table::new([
        "who",
        "op",
        "GiB/s",
        "chunk p50 us",
        "p99 us",
        "p99.9 us",
        "extent p50 us",
        "p99 us",
    ]);
    let mut row = |who: String, op: &str, phase: &Phase| {
        let us = |p: Option<Percentiles>, f: fn(&Percentiles) -> f64| {
            p.map_or("-".into(), |p| format!("{:.0}", f(&p)))
        };
        table.row([
            who,
            op.to_string(),
            format!("{:.2}", phase.median_gib_per_s),
            us(phase.chunk_latency, |p| p.p50_us),
            us(phase.chunk_latency, |p| p.p99_us),
            us(phase.chunk_latency, |p| p.p999_us),
            us(phase.extent_latency, |p| p.p50_us),
            us(phase.extent_latency, |p| p.p99_us),
        ]);
    };
    for s in &report.strata {
        let who = format!(
            "strata {} checksums {}",
            report.backend,
            if s.checksums { "on" } else { "off" }
        );
        row(who.clone(), "write", &s.write);
        row(who, "read", &s.read);
    }
    for f in report.fio.iter().chain(&report.ds_io) {
        row(f.name.clone(), "write", &f.write);
        row(f.name.clone(), "read", &f.read);
    }
    let mut out = format!(
        "\nNVMe tier: {} per round, block {}, queue depth {}, extents of {}, {} in flight, \
         direct I/O {}, host memory {}, median of {} interleaved rounds\n",
        format_bytes(report.size_bytes),
        format_bytes(report.block_bytes),
        report.queue_depth,
        format_bytes(report.extent_bytes),
        report.in_flight,
        if report.direct_io { "on" } else { "OFF" },
        report.host_memory,
        report.repeat
    );
    out.push_str(&table.render());
    for s in &report.strata {
        out.push_str(&format!(
            "strata checksums {}: {} of {} chunks through registered buffers\n",
            if s.checksums { "on" } else { "off" },
            s.fixed_chunks,
            s.fixed_chunks + s.plain_chunks
        ));
    }
    for s in &report.skipped {
        out.push_str(&format!("not run: {}: {}\n", s.name, s.reason));
    }
    if !report.ratios.is_empty() {
        let mut ratios = Table::new([
            "op",
            "strata checksums",
            "strata GiB/s",
            "peer",
            "peer GiB/s",
            "strata/peer",
        ]);
        for r in &report.ratios {
            ratios.row([
                r.direction.to_string(),
                if r.checksums { "on" } else { "off" }.to_string(),
                format!("{:.2}", r.strata_gib_per_s),
                r.peer.clone(),
                format!("{:.2}", r.peer_gib_per_s),
                format!("{:.3}", r.ratio),
            ]);
        }
        out.push('\n');
        out.push_str(&ratios.render());
    }
    if !report.sweep.is_empty() {
        let best = |f: fn(&SweepPoint) -> f64| {
            report
                .sweep
                .iter()
                .max_by(|a, b| f(a).total_cmp(&f(b)))
                .expect("a non-empty sweep")
        };
        let w = best(|p| p.write_gib_per_s);
        let r = best(|p| p.read_gib_per_s);
        out.push_str(&format!(
            "\nsweep: best write {:.2} GiB/s at --block {} --qd {}; best read {:.2} GiB/s at --block {} --qd {}\n",
            w.write_gib_per_s,
            format_bytes(w.block_bytes).replace(' ', ""),
            w.queue_depth,
            r.read_gib_per_s,
            format_bytes(r.block_bytes).replace(' ', ""),
            r.queue_depth
        ));
    }
    out
}
