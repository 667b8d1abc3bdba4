//! `strata bench pcie`: how fast bytes cross between host and GPU on this machine.
//!
//! Host-to-device, device-to-host and both at once; from pinned pool slots and from
//! pageable memory; sizes from 64 KiB to 1 GiB. Each copy is timed with CUDA events by
//! the engine's [`CudaDevice::time_copies`]; a size reports the median GB/s and the p50
//! and p99 latency of one copy. In the same run it reads the PCIe generation and width
//! the link trained at (from sysfs, at the PCI address the driver reports), computes the
//! link's theoretical rate, and, when PyTorch is installed, times the same pinned copies
//! with PyTorch (`benches/peers/pcie_torch.py`) so the two can be compared.
//!
//! It also measures the pinned pool every transfer goes through (acquire and release,
//! alone and contended), which needs no GPU. Without a GPU it says so and measures only
//! that. Nothing here is asserted about speed; the tests check the plumbing.

use std::error::Error;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use strata_engine::device::{CudaDevice, Device, DeviceChoice, DeviceConfig, DeviceOps, select};
use strata_engine::memory::{PinnedPool, PinnedPoolConfig, Pinning};

use crate::report::{LineChart, Series, Table, format_bytes, write_json};
use crate::size::parse_bytes;

/// The PyTorch peer, run with `python3 -c`.
const TORCH_PEER: &str = include_str!("../../benches/peers/pcie_torch.py");

/// Timed copies thrown away before measuring each point (first-touch and clock ramp-up).
const WARMUP: usize = 2;

/// Options of `strata bench pcie`.
#[derive(Debug, Clone, clap::Args)]
pub struct PcieArgs {
    /// Which device: auto (a GPU when one is usable, else report that there is none),
    /// cuda (fail without a GPU), cpu (refused: it has no PCIe link).
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    /// Smallest copy size.
    #[arg(long, default_value = "64KiB", value_parser = parse_size)]
    pub min_size: usize,
    /// Largest copy size; sizes go up by 4x from the smallest.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub max_size: usize,
    /// Bytes to move per point: small sizes repeat more (at least 5, at most 1000 copies).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub bytes_per_point: usize,
    /// Do not run the PyTorch comparison.
    #[arg(long)]
    pub no_torch: bool,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw GB/s against copy size as SVG into this file.
    #[arg(long)]
    pub svg: Option<PathBuf>,
}

fn parse_size(text: &str) -> Result<usize, String> {
    let bytes = parse_bytes(text)?;
    usize::try_from(bytes).map_err(|_| format!("'{text}' does not fit in memory"))
}

/// Which way a copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// Host to device.
    H2d,
    /// Device to host.
    D2h,
    /// Both at once, on the two copy streams (bytes counted in both directions).
    Both,
}

impl Direction {
    const ALL: [Direction; 3] = [Direction::H2d, Direction::D2h, Direction::Both];

    fn label(self) -> &'static str {
        match self {
            Direction::H2d => "H2D",
            Direction::D2h => "D2H",
            Direction::Both => "both",
        }
    }
}

/// Where the host side of a copy lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HostMemory {
    /// A pinned pool slot, page-locked by the driver.
    Pinned,
    /// Ordinary (pre-faulted) heap memory: the driver stages it through its own buffers.
    Pageable,
}

/// One measured size of one kind of copy.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    /// Which way.
    pub direction: Direction,
    /// From or into what host memory.
    pub memory: HostMemory,
    /// Bytes per copy (per direction).
    pub size_bytes: usize,
    /// Timed copies (after the warm-up).
    pub repeats: usize,
    /// Bytes moved (both directions counted) over the median copy time, in 1e9 B/s.
    pub median_gb_s: f64,
    /// Median time of one copy, microseconds.
    pub p50_us: f64,
    /// 99th percentile time of one copy, microseconds.
    pub p99_us: f64,
}

impl Point {
    fn new(
        direction: Direction,
        memory: HostMemory,
        size_bytes: usize,
        samples: &mut [Duration],
    ) -> Self {
        let moved = size_bytes * if direction == Direction::Both { 2 } else { 1 };
        let median = median_seconds(samples);
        Self {
            direction,
            memory,
            size_bytes,
            repeats: samples.len(),
            median_gb_s: gb_per_s(moved, median),
            p50_us: median * 1e6,
            p99_us: percentile(samples, 0.99).as_secs_f64() * 1e6,
        }
    }
}

/// Median in seconds; the mean of the two middle samples for an even count (as Python's
/// `statistics.median`, which the PyTorch peer uses).
fn median_seconds(samples: &mut [Duration]) -> f64 {
    assert!(!samples.is_empty(), "a point needs samples");
    samples.sort_unstable();
    let seconds: Vec<f64> = samples.iter().map(Duration::as_secs_f64).collect();
    crate::report::median(&seconds)
}

/// Nearest-rank percentile of sorted samples.
fn percentile(sorted: &[Duration], q: f64) -> Duration {
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn gb_per_s(bytes: usize, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 / seconds / 1e9
    } else {
        0.0
    }
}

/// The PCIe link of the GPU, as sysfs reports it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PcieLink {
    /// The sysfs folder read.
    pub sysfs_path: String,
    /// Transfer rate per lane now, GT/s.
    pub current_gt_s: f64,
    /// Lanes now.
    pub current_width: u32,
    /// The device's maximum rate per lane, GT/s.
    pub max_gt_s: f64,
    /// The device's maximum lanes.
    pub max_width: u32,
}

impl PcieLink {
    /// The theoretical one-direction data rate of the link as it runs now, GB/s.
    pub fn theoretical_gb_s(&self) -> f64 {
        theoretical_gb_s(self.current_gt_s, self.current_width)
    }

    fn describe(&self) -> String {
        let now = format!(
            "Gen{} x{}",
            generation(self.current_gt_s),
            self.current_width
        );
        let max = format!("Gen{} x{}", generation(self.max_gt_s), self.max_width);
        format!(
            "{now} ({} GT/s per lane; the device supports {max}): theoretical {:.1} GB/s per \
             direction",
            self.current_gt_s,
            self.theoretical_gb_s()
        )
    }
}

/// The PCIe generation of a per-lane rate.
pub fn generation(gt_s: f64) -> u32 {
    match gt_s {
        r if r < 4.0 => 1,
        r if r < 7.0 => 2,
        r if r < 12.0 => 3,
        r if r < 24.0 => 4,
        r if r < 48.0 => 5,
        _ => 6,
    }
}

/// The one-direction data rate of `width` lanes at `gt_s` per lane, after line encoding
/// (8b/10b to Gen2, 128b/130b for Gen3 to Gen5, FLIT mode 242/256 for Gen6) and before
/// packet overhead, in GB/s. Gen5 x16: 32 x 16 x 128/130 / 8 = 63.0.
pub fn theoretical_gb_s(gt_s: f64, width: u32) -> f64 {
    let encoding = match generation(gt_s) {
        1 | 2 => 8.0 / 10.0,
        3..=5 => 128.0 / 130.0,
        _ => 242.0 / 256.0,
    };
    gt_s * f64::from(width) * encoding / 8.0
}

/// The sysfs name of a PCI address as the CUDA driver writes it (`0000:3B:00.0`, or with
/// an 8-digit domain): a 4-digit domain, lower case.
pub fn sysfs_pci_name(bus_id: &str) -> Option<String> {
    let mut parts = bus_id.trim().rsplitn(3, ':');
    let device_function = parts.next()?;
    let bus = parts.next()?;
    let domain = u32::from_str_radix(parts.next()?, 16).ok()?;
    Some(format!(
        "{domain:04x}:{}:{}",
        bus.to_ascii_lowercase(),
        device_function.to_ascii_lowercase()
    ))
}

/// Reads the link's speed and width from `/sys/bus/pci/devices/<address>/`.
pub fn read_link(bus_id: &str) -> Result<PcieLink, String> {
    let name = sysfs_pci_name(bus_id).ok_or_else(|| format!("'{bus_id}' is not a PCI address"))?;
    let folder = Path::new("/sys/bus/pci/devices").join(&name);
    let read = |file: &str| {
        std::fs::read_to_string(folder.join(file))
            .map(|s| s.trim().to_string())
            .map_err(|e| format!("{}: {e}", folder.join(file).display()))
    };
    let speed = |file: &str| {
        let text = read(file)?;
        parse_link_speed(&text).ok_or_else(|| format!("{file} says '{text}', not a speed"))
    };
    let width = |file: &str| {
        let text = read(file)?;
        text.parse::<u32>()
            .map_err(|_| format!("{file} says '{text}', not a width"))
    };
    Ok(PcieLink {
        sysfs_path: folder.display().to_string(),
        current_gt_s: speed("current_link_speed")?,
        current_width: width("current_link_width")?,
        max_gt_s: speed("max_link_speed")?,
        max_width: width("max_link_width")?,
    })
}

/// `32.0 GT/s PCIe` (or the older `8 GT/s`) -> 32.0.
pub fn parse_link_speed(text: &str) -> Option<f64> {
    let number = text.split_whitespace().next()?;
    if !text.contains("GT/s") {
        return None;
    }
    number.parse().ok().filter(|v: &f64| *v > 0.0)
}

/// What the PyTorch peer printed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TorchRun {
    /// torch's version.
    pub torch: String,
    /// The GPU torch used.
    pub device: String,
    /// One point per size and direction.
    pub points: Vec<TorchPoint>,
}

/// One size and direction measured by PyTorch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TorchPoint {
    /// `h2d` or `d2h`.
    pub direction: Direction,
    /// Bytes per copy.
    pub size_bytes: usize,
    /// Timed copies.
    pub repeats: usize,
    /// Median time of one copy, seconds.
    pub median_s: f64,
}

impl TorchRun {
    /// The median GB/s PyTorch reached for one size and direction.
    pub fn gb_s(&self, direction: Direction, size_bytes: usize) -> Option<f64> {
        self.points
            .iter()
            .find(|p| p.direction == direction && p.size_bytes == size_bytes)
            .map(|p| gb_per_s(p.size_bytes, p.median_s))
    }
}

/// Parses the peer's standard output: its last non-empty line is one JSON object.
pub fn parse_torch_output(stdout: &str) -> Result<TorchRun, String> {
    super::parse_peer_output(stdout)
}

/// Runs the PyTorch peer on `plan` (size, repeats) pairs.
fn run_torch(plan: &[(usize, usize)]) -> Result<TorchRun, String> {
    let arg: Vec<String> = plan.iter().map(|(s, r)| format!("{s}:{r}")).collect();
    let stdout = super::run_python_peer(Path::new("python3"), TORCH_PEER, &arg.join(","))?;
    parse_torch_output(&stdout)
}

/// Acquire-plus-release figures of one pool configuration.
#[derive(Debug, Clone, Serialize)]
pub struct PoolRun {
    /// Threads acquiring and releasing at once.
    pub threads: usize,
    /// Slots in the pool.
    pub slots: usize,
    /// Acquire-release pairs per thread.
    pub ops_per_thread: usize,
    /// Wall time per pair, per thread (total wall time / pairs per thread), ns.
    pub mean_ns: f64,
    /// Median of pairs timed one by one (includes one clock read), ns; single thread only.
    pub p50_ns: Option<f64>,
    /// 99th percentile of pairs timed one by one, ns; single thread only.
    pub p99_ns: Option<f64>,
    /// Acquires that found the pool empty and waited.
    pub waits: u64,
    /// Median wait of those, ns.
    pub wait_p50_ns: f64,
    /// 99th percentile wait, ns.
    pub wait_p99_ns: f64,
}

/// The pinned pool's own costs, host side only.
#[derive(Debug, Clone, Serialize)]
pub struct PoolFigures {
    /// How the pool's memory was locked.
    pub locking: String,
    /// Bytes per slot.
    pub slot_bytes: usize,
    /// Alone, contended with enough slots, and oversubscribed (threads wait for slots).
    pub runs: Vec<PoolRun>,
}

/// Measures acquire-plus-release on pools locked as `pinning` says: one thread; one
/// thread per core with two slots each; two threads per core sharing one slot per core.
pub fn measure_pool(pinning: &Pinning) -> Result<PoolFigures, Box<dyn Error>> {
    const SLOT_BYTES: usize = 64 << 10;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let make = |slots: usize| {
        PinnedPool::new(
            PinnedPoolConfig {
                name: "bench".into(),
                budget_bytes: slots * SLOT_BYTES,
                slot_bytes: SLOT_BYTES,
                acquire_timeout: Duration::from_secs(10),
            },
            pinning,
        )
    };
    let single = make(8)?;
    let locking = single.locking().to_string();
    let mut runs = vec![measure_single(&single, 200_000)?];
    runs.push(measure_threads(&make(2 * cores)?, cores, 100_000)?);
    runs.push(measure_threads(&make(cores)?, 2 * cores, 20_000)?);
    Ok(PoolFigures {
        locking,
        slot_bytes: SLOT_BYTES,
        runs,
    })
}

fn measure_single(pool: &PinnedPool, ops: usize) -> Result<PoolRun, Box<dyn Error>> {
    // Whole-loop time, without a clock read per pair.
    let started = Instant::now();
    for _ in 0..ops {
        drop(std::hint::black_box(pool.acquire()?));
    }
    let mean_ns = started.elapsed().as_nanos() as f64 / ops as f64;
    let mut each: Vec<Duration> = Vec::with_capacity(ops);
    for _ in 0..ops {
        let t = Instant::now();
        drop(std::hint::black_box(pool.acquire()?));
        each.push(t.elapsed());
    }
    each.sort_unstable();
    let ns = |d: Duration| d.as_secs_f64() * 1e9;
    Ok(PoolRun {
        p50_ns: Some(ns(percentile(&each, 0.5))),
        p99_ns: Some(ns(percentile(&each, 0.99))),
        ..pool_run(pool, 1, ops, mean_ns)
    })
}

fn measure_threads(
    pool: &PinnedPool,
    threads: usize,
    ops: usize,
) -> Result<PoolRun, Box<dyn Error>> {
    // Each worker times its own loop: a clock read by this thread after the barrier
    // could come after the workers finished (with more threads than cores, this thread
    // may not run again until they have), and would then time only the joins.
    let start = Arc::new(Barrier::new(threads));
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            let pool = pool.clone();
            let start = Arc::clone(&start);
            std::thread::spawn(move || -> Result<Duration, String> {
                start.wait();
                let started = Instant::now();
                for _ in 0..ops {
                    drop(std::hint::black_box(
                        pool.acquire().map_err(|e| e.to_string())?,
                    ));
                }
                Ok(started.elapsed())
            })
        })
        .collect();
    let mut wall = Duration::ZERO;
    for worker in workers {
        let elapsed = worker
            .join()
            .map_err(|_| "a pool benchmark thread panicked")??;
        wall = wall.max(elapsed);
    }
    let mean_ns = wall.as_nanos() as f64 / ops as f64;
    Ok(pool_run(pool, threads, ops, mean_ns))
}

fn pool_run(pool: &PinnedPool, threads: usize, ops: usize, mean_ns: f64) -> PoolRun {
    let stats = pool.stats();
    PoolRun {
        threads,
        slots: pool.slot_count(),
        ops_per_thread: ops,
        mean_ns,
        p50_ns: None,
        p99_ns: None,
        waits: stats.waits,
        wait_p50_ns: stats.wait_p50.as_secs_f64() * 1e9,
        wait_p99_ns: stats.wait_p99.as_secs_f64() * 1e9,
    }
}

/// What the GPU is and how its link runs.
#[derive(Debug, Clone, Serialize)]
pub struct GpuInfo {
    /// The product name.
    pub name: String,
    /// The PCI address the driver reports.
    pub pci_bus_id: Option<String>,
    /// The link, read right after the measurements (links slow down when idle).
    pub link: Option<PcieLink>,
    /// Why the link could not be read.
    pub link_unavailable: Option<String>,
}

/// Everything `strata bench pcie` measured, as written by `--json`.
#[derive(Debug, Clone, Serialize)]
pub struct PcieReport {
    /// strata's version.
    pub strata_version: String,
    /// Which device was used, and why.
    pub device: String,
    /// Why the link was not measured (no GPU), if it was not.
    pub not_measured: Option<String>,
    /// The GPU, when there is one.
    pub gpu: Option<GpuInfo>,
    /// The link's theoretical one-direction rate, GB/s.
    pub theoretical_gb_s: Option<f64>,
    /// One point per size, host memory and direction.
    pub points: Vec<Point>,
    /// PyTorch's pinned copies of the same sizes.
    pub torch: Option<TorchRun>,
    /// Why PyTorch was not compared.
    pub torch_not_run: Option<String>,
    /// The pinned pool's own costs.
    pub pool: PoolFigures,
}

/// Copy sizes from `min` to `max`, growing 4x, `max` always last.
pub fn sizes(min: usize, max: usize) -> Result<Vec<usize>, String> {
    if min == 0 || min > max {
        return Err(format!(
            "sizes must satisfy 0 < --min-size <= --max-size (got {min} and {max})"
        ));
    }
    let mut sizes = Vec::new();
    let mut size = min;
    while size < max {
        sizes.push(size);
        size = size.saturating_mul(4);
    }
    sizes.push(max);
    Ok(sizes)
}

/// How many timed copies a size gets: about `bytes_per_point` bytes, 5 to 1000 copies.
pub fn repeats_for(size: usize, bytes_per_point: usize) -> usize {
    (bytes_per_point / size.max(1)).clamp(5, 1000)
}

/// Runs the benchmark, prints its tables, and writes JSON and SVG when asked.
pub fn run(args: &PcieArgs) -> Result<(), Box<dyn Error>> {
    let sizes = sizes(args.min_size, args.max_size)?;
    if args.device == DeviceChoice::Cpu {
        return Err("the cpu device has no PCIe link to measure; use --device auto or cuda".into());
    }
    let config = DeviceConfig {
        memory_budget_bytes: 2 * args.max_size.next_multiple_of(4096),
        cuda_ordinal: 0,
        // Copies need only the driver: a GPU without NVRTC or cuBLAS is still measured.
        cuda_needs_kernels: false,
    };
    let (device, reason) = select(args.device, &config)?;
    println!("strata bench pcie");
    println!("device: {reason}");
    let mut report = PcieReport {
        strata_version: env!("CARGO_PKG_VERSION").to_string(),
        device: reason,
        not_measured: None,
        gpu: None,
        theoretical_gb_s: None,
        points: Vec::new(),
        torch: None,
        torch_not_run: None,
        pool: measure_pool(&device.pinning())?,
    };
    match &device {
        Device::Cpu(_) => {
            let why = "no GPU here, so there is no PCIe link to measure: host-to-device and \
                       device-to-host rates were not measured";
            println!("{why}.");
            report.not_measured = Some(why.into());
        }
        Device::Cuda(cuda) => measure_gpu(cuda, &sizes, args, &mut report)?,
    }
    print!("{}", pool_table(&report.pool));
    if let Some(path) = &args.json {
        write_json(path, &report)?;
        println!("wrote {}", path.display());
    }
    if let Some(path) = &args.svg {
        std::fs::write(path, chart(&report).to_svg())?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn measure_gpu(
    cuda: &CudaDevice,
    sizes: &[usize],
    args: &PcieArgs,
    report: &mut PcieReport,
) -> Result<(), Box<dyn Error>> {
    let max = *sizes.last().expect("at least one size");
    let bus_id = cuda.pci_bus_id().ok();
    println!(
        "GPU: {} at PCI {}",
        cuda.gpu_name(),
        bus_id.as_deref().unwrap_or("(unknown)")
    );
    let pool = PinnedPool::new(
        PinnedPoolConfig {
            name: "pcie".into(),
            budget_bytes: 2 * max.next_multiple_of(4096),
            slot_bytes: max,
            acquire_timeout: Duration::from_secs(1),
        },
        &cuda.pinning(),
    )?;
    let mut up = pool.acquire()?;
    for (i, b) in up.as_mut_slice().iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let mut down = pool.acquire()?;
    let pageable_up = up.as_slice()[..max].to_vec();
    // Written, so its pages are resident like any working buffer's.
    let mut pageable_down = vec![0x5Au8; max];
    let to_device = cuda.arena().alloc(max)?;
    let from_device = cuda.arena().alloc(max)?;
    let mut plan = Vec::new();
    for &size in sizes {
        let repeats = repeats_for(size, args.bytes_per_point);
        plan.push((size, repeats));
        let to_device = to_device.slice(0..size);
        let from_device = from_device.slice(0..size);
        for memory in [HostMemory::Pinned, HostMemory::Pageable] {
            let (src, dst): (&[u8], &mut [u8]) = match memory {
                HostMemory::Pinned => (&up.as_slice()[..size], &mut down.as_mut_slice()[..size]),
                HostMemory::Pageable => (&pageable_up[..size], &mut pageable_down[..size]),
            };
            for direction in Direction::ALL {
                let mut samples = Vec::with_capacity(repeats);
                for i in 0..WARMUP + repeats {
                    let h2d = (direction != Direction::D2h).then_some((src, &to_device));
                    let d2h = (direction != Direction::H2d).then_some((&from_device, &mut *dst));
                    let time = cuda.time_copies(h2d, d2h)?;
                    if i >= WARMUP {
                        samples.push(time);
                    }
                }
                report
                    .points
                    .push(Point::new(direction, memory, size, &mut samples));
            }
        }
    }
    // The copies must be real: the largest upload, brought back down, is what went up.
    down.as_mut_slice().fill(0);
    cuda.time_copies(Some((&up.as_slice()[..max], &to_device)), None)?;
    cuda.time_copies(None, Some((&to_device, &mut down.as_mut_slice()[..max])))?;
    if up.as_slice()[..max] != down.as_slice()[..max] {
        return Err("a copied buffer came back different: the copies are broken".into());
    }
    let (link, link_unavailable) = match bus_id.as_deref().map(read_link) {
        Some(Ok(link)) => (Some(link), None),
        Some(Err(why)) => (None, Some(why)),
        None => (None, Some("the driver did not report a PCI address".into())),
    };
    report.theoretical_gb_s = link.as_ref().map(PcieLink::theoretical_gb_s);
    match (&link, &link_unavailable) {
        (Some(link), _) => println!("PCIe link: {}", link.describe()),
        (None, Some(why)) => println!("PCIe link: not reported ({why})"),
        (None, None) => {}
    }
    report.gpu = Some(GpuInfo {
        name: cuda.gpu_name().to_string(),
        pci_bus_id: bus_id,
        link,
        link_unavailable,
    });
    if args.no_torch {
        report.torch_not_run = Some("--no-torch".into());
    } else {
        match run_torch(&plan) {
            Ok(torch) => report.torch = Some(torch),
            Err(why) => report.torch_not_run = Some(why),
        }
    }
    print!("{}", points_table(&report.points));
    print!("{}", comparison_table(report));
    println!("{}", summary(report));
    Ok(())
}

fn find(points: &[Point], direction: Direction, memory: HostMemory, size: usize) -> Option<&Point> {
    points
        .iter()
        .find(|p| p.direction == direction && p.memory == memory && p.size_bytes == size)
}

fn distinct_sizes(points: &[Point]) -> Vec<usize> {
    let mut sizes: Vec<usize> = points.iter().map(|p| p.size_bytes).collect();
    sizes.dedup();
    sizes
}

/// One row per size and host memory: GB/s and latency for each direction.
fn points_table(points: &[Point]) -> String {
    let mut headers = vec!["size".to_string(), "memory".to_string()];
    for d in Direction::ALL {
        headers.push(format!("{} GB/s", d.label()));
    }
    for d in Direction::ALL {
        headers.push(format!("{} p50 us", d.label()));
        headers.push(format!("{} p99 us", d.label()));
    }
    let mut table = Table::new(headers);
    for size in distinct_sizes(points) {
        for memory in [HostMemory::Pinned, HostMemory::Pageable] {
            let at = |d| find(points, d, memory, size);
            let mut row = vec![
                format_bytes(size as u64),
                format!("{memory:?}").to_lowercase(),
            ];
            for d in Direction::ALL {
                row.push(at(d).map_or("-".into(), |p| format!("{:.2}", p.median_gb_s)));
            }
            for d in Direction::ALL {
                row.push(at(d).map_or("-".into(), |p| format!("{:.1}", p.p50_us)));
                row.push(at(d).map_or("-".into(), |p| format!("{:.1}", p.p99_us)));
            }
            table.row(row);
        }
    }
    table.render()
}

/// Pinned copies against PyTorch's and against the link.
fn comparison_table(report: &PcieReport) -> String {
    let Some(torch) = &report.torch else {
        return format!(
            "PyTorch comparison: not run ({})\n",
            report.torch_not_run.as_deref().unwrap_or("unknown reason")
        );
    };
    let mut table = Table::new([
        "size",
        "strata H2D",
        "torch H2D",
        "H2D ratio",
        "strata D2H",
        "torch D2H",
        "D2H ratio",
        "H2D of link",
    ]);
    for size in distinct_sizes(&report.points) {
        let mut row = vec![format_bytes(size as u64)];
        for direction in [Direction::H2d, Direction::D2h] {
            let ours =
                find(&report.points, direction, HostMemory::Pinned, size).map(|p| p.median_gb_s);
            let theirs = torch.gb_s(direction, size);
            row.push(ours.map_or("-".into(), |v| format!("{v:.2}")));
            row.push(theirs.map_or("-".into(), |v| format!("{v:.2}")));
            row.push(match (ours, theirs) {
                (Some(a), Some(b)) if b > 0.0 => format!("{:.3}x", a / b),
                _ => "-".into(),
            });
        }
        let h2d = find(&report.points, Direction::H2d, HostMemory::Pinned, size);
        row.push(match (h2d, report.theoretical_gb_s) {
            (Some(p), Some(link)) => format!("{:.0}%", 100.0 * p.median_gb_s / link),
            _ => "-".into(),
        });
        table.row(row);
    }
    format!(
        "pinned copies against PyTorch {} on {} (GB/s, medians):\n{}",
        torch.torch,
        torch.device,
        table.render()
    )
}

/// The headline: the largest pinned size in each direction, and whether both at once
/// beat either alone.
fn summary(report: &PcieReport) -> String {
    let Some(&size) = distinct_sizes(&report.points).last() else {
        return String::new();
    };
    let rate = |d| find(&report.points, d, HostMemory::Pinned, size).map_or(0.0, |p| p.median_gb_s);
    let (h2d, d2h, both) = (
        rate(Direction::H2d),
        rate(Direction::D2h),
        rate(Direction::Both),
    );
    let link = report
        .theoretical_gb_s
        .map_or(String::new(), |l| format!(" of a {l:.1} GB/s link"));
    format!(
        "pinned {}: H2D {h2d:.2} GB/s, D2H {d2h:.2} GB/s, both at once {both:.2} GB/s{link}; \
         both at once {} the faster direction alone ({:.2}x)",
        format_bytes(size as u64),
        if both > h2d.max(d2h) {
            "beats"
        } else {
            "does not beat"
        },
        if h2d.max(d2h) > 0.0 {
            both / h2d.max(d2h)
        } else {
            0.0
        }
    )
}

fn pool_table(pool: &PoolFigures) -> String {
    let mut table = Table::new([
        "threads",
        "slots",
        "pairs/thread",
        "mean ns",
        "p50 ns",
        "p99 ns",
        "waits",
        "wait p50 us",
        "wait p99 us",
    ]);
    let opt = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.0}"));
    for run in &pool.runs {
        table.row([
            run.threads.to_string(),
            run.slots.to_string(),
            run.ops_per_thread.to_string(),
            format!("{:.0}", run.mean_ns),
            opt(run.p50_ns),
            opt(run.p99_ns),
            run.waits.to_string(),
            format!("{:.1}", run.wait_p50_ns / 1e3),
            format!("{:.1}", run.wait_p99_ns / 1e3),
        ]);
    }
    format!(
        "pinned pool, acquire + release of a {} slot ({}):\n{}",
        format_bytes(pool.slot_bytes as u64),
        pool.locking,
        table.render()
    )
}

fn chart(report: &PcieReport) -> LineChart {
    let mut series = Vec::new();
    for memory in [HostMemory::Pinned, HostMemory::Pageable] {
        for direction in Direction::ALL {
            let points: Vec<(f64, f64)> = report
                .points
                .iter()
                .filter(|p| p.memory == memory && p.direction == direction)
                .map(|p| (p.size_bytes as f64, p.median_gb_s))
                .collect();
            if !points.is_empty() {
                series.push(Series {
                    name: format!("{memory:?} {}", direction.label()).to_lowercase(),
                    points,
                });
            }
        }
    }
    if let Some(torch) = &report.torch {
        for direction in [Direction::H2d, Direction::D2h] {
            series.push(Series {
                name: format!("torch {}", direction.label()),
                points: torch
                    .points
                    .iter()
                    .filter(|p| p.direction == direction)
                    .map(|p| (p.size_bytes as f64, gb_per_s(p.size_bytes, p.median_s)))
                    .collect(),
            });
        }
    }
    let title = match &report.gpu {
        Some(gpu) => format!("PCIe copies, {}", gpu.name),
        None => "PCIe copies (no GPU: nothing measured)".into(),
    };
    LineChart {
        title,
        x_label: "bytes per copy".into(),
        y_label: "GB/s (1e9 B/s)".into(),
        log2_x: true,
        x_format: |x| format_bytes(x as u64),
        series,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_grow_by_four_and_end_at_the_maximum() {
        assert_eq!(
            sizes(64 << 10, 1 << 30).unwrap(),
            vec![
                64 << 10,
                256 << 10,
                1 << 20,
                4 << 20,
                16 << 20,
                64 << 20,
                256 << 20,
                1 << 30
            ]
        );
        assert_eq!(sizes(4096, 10_000).unwrap(), vec![4096, 10_000]);
        assert!(sizes(0, 1).is_err());
        assert!(sizes(2, 1).is_err());
        assert_eq!(repeats_for(64 << 10, 1 << 30), 1000);
        assert_eq!(repeats_for(16 << 20, 1 << 30), 64);
        assert_eq!(repeats_for(1 << 30, 1 << 30), 5);
    }

    #[test]
    fn statistics_of_a_point() {
        let mut samples: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        samples.reverse();
        let point = Point::new(Direction::Both, HostMemory::Pinned, 1_000_000, &mut samples);
        // Median of 1..=100 us is 50.5 us; both directions move 2 MB.
        assert!((point.p50_us - 50.5).abs() < 1e-9);
        assert!((point.p99_us - 99.0).abs() < 1e-9);
        assert!((point.median_gb_s - 2e6 / 50.5e-6 / 1e9).abs() < 1e-9);
        assert_eq!(point.repeats, 100);
    }

    #[test]
    fn link_speed_generation_and_theoretical_rate() {
        assert_eq!(parse_link_speed("32.0 GT/s PCIe"), Some(32.0));
        assert_eq!(parse_link_speed("8 GT/s"), Some(8.0));
        assert_eq!(parse_link_speed("Unknown"), None);
        assert_eq!(parse_link_speed("2.5 GT/s PCIe"), Some(2.5));
        assert_eq!(generation(2.5), 1);
        assert_eq!(generation(16.0), 4);
        assert_eq!(generation(32.0), 5);
        assert!((theoretical_gb_s(32.0, 16) - 63.015).abs() < 0.01);
        assert!((theoretical_gb_s(16.0, 16) - 31.508).abs() < 0.01);
        assert!((theoretical_gb_s(5.0, 8) - 4.0).abs() < 1e-9);
    }

    #[test]
    fn pci_addresses_map_to_sysfs_names() {
        assert_eq!(
            sysfs_pci_name("0000:3B:00.0").as_deref(),
            Some("0000:3b:00.0")
        );
        assert_eq!(
            sysfs_pci_name("00000000:9A:00.0").as_deref(),
            Some("0000:9a:00.0")
        );
        assert_eq!(sysfs_pci_name("garbage"), None);
        assert!(read_link("not an address").is_err());
    }

    #[test]
    fn parses_what_the_torch_peer_prints() {
        // Captured from the peer's format: a warning line, then the JSON object.
        let stdout = "some torch warning\n{\"torch\": \"2.5.1+cu124\", \"device\": \"NVIDIA H100 80GB HBM3\", \"points\": [{\"direction\": \"h2d\", \"size_bytes\": 65536, \"repeats\": 1000, \"median_s\": 6.5e-06}, {\"direction\": \"d2h\", \"size_bytes\": 65536, \"repeats\": 1000, \"median_s\": 7.0e-06}]}\n\n";
        let run = parse_torch_output(stdout).unwrap();
        assert_eq!(run.torch, "2.5.1+cu124");
        assert_eq!(run.points.len(), 2);
        assert_eq!(run.points[1].direction, Direction::D2h);
        let h2d = run.gb_s(Direction::H2d, 65536).unwrap();
        assert!((h2d - 65536.0 / 6.5e-6 / 1e9).abs() < 1e-9);
        assert_eq!(run.gb_s(Direction::H2d, 4096), None);
        assert!(parse_torch_output("").is_err());
        assert!(parse_torch_output("Traceback (most recent call last)").is_err());
    }

    #[test]
    fn the_torch_peer_script_is_embedded() {
        assert!(TORCH_PEER.contains("non_blocking=True"));
        assert!(TORCH_PEER.contains("pin_memory=True"));
        assert!(TORCH_PEER.contains("enable_timing=True"));
    }

    #[test]
    fn pool_figures_are_measured() {
        let figures = measure_pool(&Pinning::Mlock).unwrap();
        assert_eq!(figures.runs.len(), 3);
        assert!(figures.runs[0].p50_ns.is_some() && figures.runs[0].mean_ns > 0.0);
        let oversubscribed = &figures.runs[2];
        assert_eq!(oversubscribed.threads, 2 * oversubscribed.slots);
        let text = pool_table(&figures);
        assert_eq!(text.lines().count(), 2 + 1 + 3);
    }

    #[test]
    fn tables_and_chart_from_a_report() {
        let mut points = Vec::new();
        for (i, memory) in [HostMemory::Pinned, HostMemory::Pageable]
            .into_iter()
            .enumerate()
        {
            for direction in Direction::ALL {
                let mut samples = vec![Duration::from_micros(10 + i as u64); 5];
                points.push(Point::new(direction, memory, 65536, &mut samples));
            }
        }
        let report = PcieReport {
            strata_version: "test".into(),
            device: "cuda:0".into(),
            not_measured: None,
            gpu: None,
            theoretical_gb_s: Some(63.0),
            points,
            torch: Some(TorchRun {
                torch: "2.5".into(),
                device: "gpu".into(),
                points: vec![TorchPoint {
                    direction: Direction::H2d,
                    size_bytes: 65536,
                    repeats: 5,
                    median_s: 20e-6,
                }],
            }),
            torch_not_run: None,
            pool: PoolFigures {
                locking: "test".into(),
                slot_bytes: 65536,
                runs: Vec::new(),
            },
        };
        let table = points_table(&report.points);
        assert_eq!(table.lines().count(), 4);
        assert!(table.contains("6.55"), "{table}");
        let comparison = comparison_table(&report);
        // strata 6.55 GB/s against torch 3.28 GB/s.
        assert!(comparison.contains("2.000x"), "{comparison}");
        assert!(comparison.contains("10%"), "{comparison}");
        assert!(summary(&report).contains("beats"));
        let svg = chart(&report).to_svg();
        assert_eq!(svg.matches("<polyline").count(), 6 + 2);
    }
}
