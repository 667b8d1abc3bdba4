//! `strata bench nvme`: how fast the NVMe tier moves extents, against fio in the same run.
//!
//! It writes, then reads, a file of `--size` bytes as extents through a [`TensorStore`]
//! (the same path training uses), with checksums off (the drive's limit) and on (what
//! training pays), and reports the median GiB/s of `--repeat` passes with the latency
//! percentiles of each block-size chunk and of each extent. When fio is installed it runs
//! fio on a file of the same size with the same block size and queue depth, O_DIRECT, in
//! its fastest configurations, and prints strata/fio ratios. `--sweep` tries block sizes
//! and queue depths and recommends the best, as DeepSpeed's `ds_nvme_tune` does.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::Instant;

use hdrhistogram::Histogram;
use serde::Serialize;

use super::fio;
use crate::report::{Table, format_bytes, median, median_index, parse_bytes, write_json};
use crate::storage::{
    AlignedBuf, BackendChoice, ExtentId, IoBuf, IoRegion, IoStats, Pending, StoreConfig,
    TensorStore, filesystem_type, is_tmpfs,
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
    /// Do not run fio even if it is installed.
    #[arg(long)]
    pub no_fio: bool,
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

/// One direction's result: every pass's rate, their median, and latencies of the median pass.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    /// GiB/s of each pass.
    pub gib_per_s: Vec<f64>,
    /// Their median.
    pub median_gib_per_s: f64,
    /// Latency of each block-size chunk (fio's completion latency), in the median pass.
    pub chunk_latency: Percentiles,
    /// Latency of each whole extent, submission to verified result (strata only).
    pub extent_latency: Option<Percentiles>,
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
}

/// fio's result in one configuration.
#[derive(Debug, Clone, Serialize)]
pub struct FioResult {
    /// The configuration.
    pub engine: fio::FioEngine,
    /// Sequential write.
    pub write: Phase,
    /// Sequential read.
    pub read: Phase,
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
    /// Bytes per pass.
    pub size_bytes: u64,
    /// Block size.
    pub block_bytes: u64,
    /// Queue depth.
    pub queue_depth: usize,
    /// Extent size.
    pub extent_bytes: u64,
    /// Passes per measurement.
    pub repeat: usize,
    /// strata, per checksum setting.
    pub strata: Vec<StrataResult>,
    /// fio's version, if it ran.
    pub fio_version: Option<String>,
    /// fio, per configuration.
    pub fio: Vec<FioResult>,
    /// strata / best fio, by direction and checksum setting.
    pub ratios: Vec<Ratio>,
    /// The sweep, if asked for.
    pub sweep: Vec<SweepPoint>,
}

/// strata's median over the best fio configuration's median.
#[derive(Debug, Clone, Serialize)]
pub struct Ratio {
    /// "write" or "read".
    pub direction: &'static str,
    /// strata's checksum setting.
    pub checksums: bool,
    /// strata GiB/s.
    pub strata_gib_per_s: f64,
    /// Best fio GiB/s.
    pub fio_gib_per_s: f64,
    /// The fio configuration that was best.
    pub fio_engine: &'static str,
    /// strata / fio.
    pub ratio: f64,
}

const GIB: f64 = (1u64 << 30) as f64;

/// A store, its extents and the buffers that cycle through them.
struct Rig {
    store: TensorStore,
    ids: Vec<ExtentId>,
    extent_lens: Vec<usize>,
    buffers: Vec<AlignedBuf>,
    regions: Vec<IoRegion>,
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
        // Enough extents in flight that the backend always has `queue_depth` chunks to
        // work on, plus one being handed back and resubmitted.
        let window = (queue_depth as u64 * block_bytes)
            .div_ceil(extent)
            .max(1)
            .saturating_add(1) as usize;
        let mut buffers = Vec::new();
        let mut regions = Vec::new();
        for i in 0..window.min(ids.len()) {
            let mut buf = AlignedBuf::zeroed(usize::try_from(extent)?);
            fill(buf.as_mut_slice(), i as u64);
            let region = IoRegion {
                ptr: buf.as_mut_ptr(),
                len_bytes: buf.capacity_bytes(),
            };
            // SAFETY: the buffers live in this Rig until after the regions are
            // unregistered in Drop, and are only moved (their memory stays put).
            unsafe { store.register_region(region)? };
            regions.push(region);
            buffers.push(buf);
        }
        Ok(Self {
            store,
            ids,
            extent_lens,
            buffers,
            regions,
        })
    }

    /// One sequential pass over every extent; returns GiB/s, the backend's chunk
    /// latencies, and the extent latencies.
    fn pass(
        &mut self,
        write: bool,
    ) -> Result<(f64, IoStats, Histogram<u64>), Box<dyn std::error::Error>> {
        self.store.reset_io_stats();
        let mut extent_ns = Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3)?;
        let mut free: Vec<AlignedBuf> = std::mem::take(&mut self.buffers);
        let mut in_flight: VecDeque<(Instant, Pending<AlignedBuf>)> = VecDeque::new();
        let mut bytes = 0u64;
        let mut first_error = None;
        let started = Instant::now();
        let mut finish = |(submitted, pending): (Instant, Pending<AlignedBuf>),
                          free: &mut Vec<AlignedBuf>| {
            let (result, buf) = pending.wait();
            extent_ns.saturating_record(submitted.elapsed().as_nanos() as u64);
            free.push(buf);
            if let Err(e) = result {
                first_error.get_or_insert(e);
            }
        };
        for (i, &id) in self.ids.iter().enumerate() {
            if free.is_empty() {
                let oldest = in_flight.pop_front().expect("a buffer is in flight");
                finish(oldest, &mut free);
            }
            let buf = free.pop().expect("a free buffer");
            let pending = if write {
                self.store.write(id, buf)
            } else {
                self.store.read(id, buf)
            };
            in_flight.push_back((Instant::now(), pending));
            bytes += self.extent_lens[i] as u64;
        }
        while let Some(oldest) = in_flight.pop_front() {
            finish(oldest, &mut free);
        }
        let seconds = started.elapsed().as_secs_f64();
        self.buffers = free;
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

impl Drop for Rig {
    fn drop(&mut self) {
        for region in &self.regions {
            let _ = self.store.unregister_region(*region);
        }
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

fn measure_strata(
    args: &NvmeArgs,
    checksums: bool,
) -> Result<(StrataResult, bool, String), Box<dyn std::error::Error>> {
    let mut rig = Rig::new(args, args.block, args.qd, args.size, checksums)?;
    let direct = rig.store.direct_io();
    let backend = rig.store.backend().name().to_string();
    let mut phases = Vec::new();
    for write in [true, false] {
        let mut rates = Vec::new();
        let mut runs = Vec::new();
        // Each read pass reads what the write passes left; passes alternate so both
        // directions see the same drive state.
        for _ in 0..args.repeat {
            let (rate, stats, extent_ns) = rig.pass(write)?;
            rates.push(rate);
            runs.push((stats, extent_ns));
        }
        let m = median_index(&rates);
        let (stats, extent_ns) = &runs[m];
        let chunks = if write {
            &stats.write_latency_ns
        } else {
            &stats.read_latency_ns
        };
        let phase = Phase {
            median_gib_per_s: median(&rates),
            gib_per_s: rates,
            chunk_latency: Percentiles::of(chunks),
            extent_latency: Some(Percentiles::of(extent_ns)),
        };
        eprintln!(
            "strata: {} checksums {}: {:.2} GiB/s (median of {})",
            if write { "write" } else { "read " },
            if checksums { "on " } else { "off" },
            phase.median_gib_per_s,
            args.repeat
        );
        phases.push(phase);
    }
    let read = phases.pop().expect("two phases");
    let write = phases.pop().expect("two phases");
    Ok((
        StrataResult {
            checksums,
            write,
            read,
        },
        direct,
        backend,
    ))
}

fn measure_fio(args: &NvmeArgs, engine: &fio::FioEngine) -> Result<FioResult, String> {
    let file = args.paths[0].join(format!("strata-fio-{}.dat", std::process::id()));
    let result = (|| {
        let mut phases = Vec::new();
        for write in [true, false] {
            let mut runs = Vec::new();
            for _ in 0..args.repeat {
                runs.push(fio::run(
                    engine, write, &file, args.size, args.block, args.qd,
                )?);
            }
            let rates: Vec<f64> = runs.iter().map(|r| r.bytes_per_s / GIB).collect();
            let m = runs[median_index(&rates)];
            let phase = Phase {
                median_gib_per_s: median(&rates),
                gib_per_s: rates,
                chunk_latency: Percentiles {
                    p50_us: m.latency_us[0],
                    p99_us: m.latency_us[1],
                    p999_us: m.latency_us[2],
                },
                extent_latency: None,
            };
            eprintln!(
                "strata: {} {}: {:.2} GiB/s (median of {})",
                engine.name,
                if write { "write" } else { "read" },
                phase.median_gib_per_s,
                args.repeat
            );
            phases.push(phase);
        }
        let read = phases.pop().expect("two phases");
        let write = phases.pop().expect("two phases");
        Ok(FioResult {
            engine: engine.clone(),
            write,
            read,
        })
    })();
    let _ = std::fs::remove_file(&file);
    result
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
    Ok(())
}

/// Runs the bench, prints its tables, and writes JSON if asked.
pub fn run(args: &NvmeArgs) -> Result<NvmeReport, Box<dyn std::error::Error>> {
    validate(args)?;
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

    let settings: &[bool] = match args.checksums {
        Checksums::Off => &[false],
        Checksums::On => &[true],
        Checksums::Both => &[false, true],
    };
    let mut strata = Vec::new();
    let mut direct_io = true;
    let mut backend = String::new();
    for &checksums in settings {
        let (result, direct, name) = measure_strata(args, checksums)?;
        direct_io &= direct;
        backend = name;
        strata.push(result);
    }
    if !direct_io {
        log::warn!("the store could not use O_DIRECT here: these figures include the page cache");
    }

    let fio_version = if args.no_fio { None } else { fio::version() };
    let mut fio_results = Vec::new();
    match &fio_version {
        Some(version) => {
            for engine in &fio::ENGINES {
                match measure_fio(args, engine) {
                    Ok(result) => fio_results.push(result),
                    Err(e) => log::warn!("{e}"),
                }
            }
            if fio_results.is_empty() {
                log::warn!("{version} ran no configuration successfully; no comparison");
            }
        }
        None if args.no_fio => {}
        None => log::warn!(
            "fio is not on the PATH, so there is no peer to compare with (install it: apt-get install fio)"
        ),
    }

    let mut ratios = Vec::new();
    for direction in ["write", "read"] {
        let pick = |p: &FioResult| {
            if direction == "write" {
                p.write.median_gib_per_s
            } else {
                p.read.median_gib_per_s
            }
        };
        let Some(best) = fio_results
            .iter()
            .max_by(|a, b| pick(a).total_cmp(&pick(b)))
        else {
            continue;
        };
        for s in &strata {
            let mine = if direction == "write" {
                s.write.median_gib_per_s
            } else {
                s.read.median_gib_per_s
            };
            ratios.push(Ratio {
                direction,
                checksums: s.checksums,
                strata_gib_per_s: mine,
                fio_gib_per_s: pick(best),
                fio_engine: best.engine.name,
                ratio: mine / pick(best),
            });
        }
    }

    let sweep = if args.sweep { sweep(args)? } else { Vec::new() };
    let report = NvmeReport {
        paths: args.paths.clone(),
        filesystems,
        direct_io,
        backend,
        size_bytes: args.size,
        block_bytes: args.block,
        queue_depth: args.qd,
        extent_bytes: args.extent,
        repeat: args.repeat,
        strata,
        fio_version,
        fio: fio_results,
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
        let extent = phase.extent_latency;
        table.row([
            who,
            op.to_string(),
            format!("{:.2}", phase.median_gib_per_s),
            format!("{:.0}", phase.chunk_latency.p50_us),
            format!("{:.0}", phase.chunk_latency.p99_us),
            format!("{:.0}", phase.chunk_latency.p999_us),
            extent.map_or("-".into(), |e| format!("{:.0}", e.p50_us)),
            extent.map_or("-".into(), |e| format!("{:.0}", e.p99_us)),
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
    for f in &report.fio {
        row(f.engine.name.to_string(), "write", &f.write);
        row(f.engine.name.to_string(), "read", &f.read);
    }
    let mut out = format!(
        "\nNVMe tier: {} per pass, block {}, queue depth {}, extents of {}, direct I/O {}, median of {}\n",
        format_bytes(report.size_bytes),
        format_bytes(report.block_bytes),
        report.queue_depth,
        format_bytes(report.extent_bytes),
        if report.direct_io { "on" } else { "OFF" },
        report.repeat
    );
    out.push_str(&table.render());
    if !report.ratios.is_empty() {
        let mut ratios = Table::new([
            "op",
            "strata checksums",
            "strata GiB/s",
            "best fio",
            "fio GiB/s",
            "strata/fio",
        ]);
        for r in &report.ratios {
            ratios.row([
                r.direction.to_string(),
                if r.checksums { "on" } else { "off" }.to_string(),
                format!("{:.2}", r.strata_gib_per_s),
                r.fio_engine.to_string(),
                format!("{:.2}", r.fio_gib_per_s),
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
