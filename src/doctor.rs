//! `strata doctor`: what this machine offers strata, as DeepSpeed's `ds_report` does.
//!
//! One line a fact (CPU and the kernels' instruction set, memory and how much of it may
//! be page-locked, transparent huge pages, io_uring, each swap folder, CUDA), and where
//! something is missing or limited, what it means for strata and what to do. A missing GPU
//! is a fact, not a failure: the report is produced on any machine. `--json` writes the
//! same facts for scripts.
//!
//! The facts come from the probes the engine itself decides by (the io_uring probe, the
//! swap-file O_DIRECT checks, the CUDA library probe, the ISA choice), so the report says
//! what strata will do, not what a separate check guesses; the readers of /proc it shares
//! with the benchmarks and the training loop are [`crate::machine`]'s. It changes
//! nothing on the machine: the one file it writes per swap folder is removed again.

use std::error::Error;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;
use strata_engine::memory::MemlockLimit;
use strata_kernels::cuda::{CUBLAS_LIBRARY, NVRTC_LIBRARY, describe_driver, probe};
use strata_kernels::isa::Isa;
use strata_storage::{
    BackendKind, DIRECT_IO_ALIGN, DirectIoSupport, available_bytes, filesystem_type, is_tmpfs,
    probe_direct_io, probe_uring,
};

use crate::machine::{cpu_model, meminfo_bytes, swap_folder_refusal};
use crate::report::{format_bytes, write_json};

/// Arguments of `strata doctor`.
#[derive(Debug, Clone, clap::Args)]
pub struct DoctorArgs {
    /// A folder where swap files would go, to check (filesystem, O_DIRECT, free space);
    /// repeat for several drives. Default: the system's temporary folder.
    #[arg(long = "nvme", value_name = "PATH")]
    pub nvme: Vec<PathBuf>,
    /// Also write the facts as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// Everything `strata doctor` found, as written to JSON.
#[derive(Debug, Clone, Serialize)]
pub struct DoctorReport {
    /// The version of strata that made the report.
    pub strata_version: String,
    /// The CPU and the kernels' instruction set.
    pub cpu: CpuReport,
    /// Host memory, page-locking and huge pages.
    pub memory: MemoryReport,
    /// Whether the io_uring backend can run.
    pub io_uring: UringReport,
    /// One entry per swap folder checked.
    pub nvme: Vec<FolderReport>,
    /// The CUDA libraries and GPUs.
    pub cuda: CudaReport,
    /// What `strata train --device auto` would run on.
    pub summary: Summary,
}

/// The CPU.
#[derive(Debug, Clone, Serialize)]
pub struct CpuReport {
    /// The model name from /proc/cpuinfo (the architecture when it has none).
    pub model: String,
    /// Cores this process may run on (affinity and cgroup quota applied): the CPU
    /// optimizer's workers.
    pub cores_available: usize,
    /// Processors listed in /proc/cpuinfo, if it could be read.
    pub cores_online: Option<usize>,
    /// The instruction set the kernels use in this process.
    pub isa_active: String,
    /// The best instruction set this CPU supports.
    pub isa_best: String,
    /// Whether the CPU runs the AVX-512 kernels.
    pub avx512: bool,
    /// Whether the CPU runs the AVX2 kernels (AVX2, FMA and F16C).
    pub avx2_fma_f16c: bool,
    /// The value of `STRATA_ISA`, when set.
    pub strata_isa: Option<String>,
}

/// Host memory.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryReport {
    /// `MemTotal` of /proc/meminfo.
    pub total_bytes: Option<u64>,
    /// `MemAvailable` of /proc/meminfo.
    pub available_bytes: Option<u64>,
    /// Whether RLIMIT_MEMLOCK is unlimited.
    pub memlock_unlimited: bool,
    /// RLIMIT_MEMLOCK's soft limit when not unlimited (null also when unreadable).
    pub memlock_limit_bytes: Option<u64>,
    /// RLIMIT_MEMLOCK's hard limit, when not unlimited.
    pub memlock_hard_limit_bytes: Option<u64>,
    /// Whether the process holds CAP_IPC_LOCK, which lifts the limit.
    pub cap_ipc_lock: bool,
    /// Whether the process runs as root (effective user id 0).
    pub root: bool,
    /// The transparent-huge-page mode (`always`, `madvise`, `never`), when the kernel
    /// has them.
    pub transparent_hugepages: Option<String>,
}

/// io_uring.
#[derive(Debug, Clone, Serialize)]
pub struct UringReport {
    /// Whether strata's io_uring probe passed.
    pub works: bool,
    /// Why not, and what to do.
    pub reason: Option<String>,
    /// `/proc/sys/kernel/io_uring_disabled`, where the kernel has it (6.6+).
    pub io_uring_disabled: Option<String>,
}

/// One folder for swap files.
#[derive(Debug, Clone, Serialize)]
pub struct FolderReport {
    /// The folder, as given.
    pub path: String,
    /// Whether it exists.
    pub exists: bool,
    /// Whether it is a folder.
    pub is_dir: bool,
    /// Its filesystem's type, from /proc/mounts.
    pub filesystem: Option<String>,
    /// Whether that filesystem is tmpfs (RAM).
    pub tmpfs: bool,
    /// How swap files there would do I/O, when a test file could be written.
    pub direct_io: Option<DirectIoSupport>,
    /// Why the O_DIRECT test failed, when it did.
    pub direct_io_error: Option<String>,
    /// Bytes free for this user.
    pub free_bytes: Option<u64>,
    /// Whether the tensor store can put swap files there.
    pub usable: bool,
    /// The folder in one sentence.
    pub verdict: String,
}

/// The CUDA libraries and GPUs.
#[derive(Debug, Clone, Serialize)]
pub struct CudaReport {
    /// Whether the driver library (libcuda) loads.
    pub driver: bool,
    /// Whether NVRTC loads.
    pub nvrtc: bool,
    /// Whether cuBLAS loads.
    pub cublas: bool,
    /// Whether NCCL loads (collectives over GPU memory with several ranks).
    pub nccl: bool,
    /// Why the driver failed to start, when it loaded but did.
    pub driver_error: Option<String>,
    /// The newest CUDA version the driver supports (`13.0`).
    pub driver_cuda_version: Option<String>,
    /// The GPUs the driver sees.
    pub gpus: Vec<GpuReport>,
    /// Why the GPUs could not be listed, when the driver loaded but they could not.
    pub gpu_query_error: Option<String>,
    /// Whether strata can train on a GPU here (driver, NVRTC, cuBLAS and a GPU).
    pub usable_for_training: bool,
    /// Why not.
    pub reason: Option<String>,
}

/// One GPU.
#[derive(Debug, Clone, Serialize)]
pub struct GpuReport {
    /// Its ordinal (`cuda:N`).
    pub ordinal: usize,
    /// Its product name.
    pub name: String,
    /// Its memory.
    pub memory_bytes: u64,
}

/// What strata would run on.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// The device `--device auto` picks for training (`cuda:0`, `cpu`).
    pub device: String,
    /// Why.
    pub device_reason: String,
    /// The I/O backend the tensor store picks (`io_uring`, `threads`).
    pub io_backend: String,
}

/// Collects the report, prints it, and writes it as JSON when asked.
pub fn run(args: &DoctorArgs, out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let report = examine(args);
    out.write_all(render(&report).as_bytes())?;
    if let Some(path) = &args.json {
        write_json(path, &report)
            .map_err(|e| format!("cannot write the report to {}: {e}", path.display()))?;
    }
    Ok(())
}

/// Looks at the machine. Never fails: what cannot be found out is reported as such.
pub fn examine(args: &DoctorArgs) -> DoctorReport {
    let folders = if args.nvme.is_empty() {
        vec![std::env::temp_dir()]
    } else {
        args.nvme.clone()
    };
    let io_uring = examine_uring();
    let cuda = examine_cuda();
    let summary = Summary {
        device: if cuda.usable_for_training {
            "cuda:0".into()
        } else {
            "cpu".into()
        },
        device_reason: match (&cuda.reason, cuda.gpus.first()) {
            (Some(reason), _) => format!("no usable GPU: {reason}"),
            (None, Some(gpu)) => {
                format!("{} found with the CUDA driver, NVRTC and cuBLAS", gpu.name)
            }
            (None, None) => "the CUDA probe found a GPU".into(),
        },
        // What the tensor store's `BackendChoice::Auto` resolves to.
        io_backend: if io_uring.works {
            BackendKind::Uring.name().into()
        } else {
            BackendKind::Threads.name().into()
        },
    };
    DoctorReport {
        strata_version: env!("CARGO_PKG_VERSION").to_string(),
        cpu: examine_cpu(),
        memory: examine_memory(),
        io_uring,
        nvme: folders.iter().map(|p| examine_folder(p)).collect(),
        cuda,
        summary,
    }
}

fn examine_cpu() -> CpuReport {
    let cores_online = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .map(|text| text.lines().filter(|l| l.starts_with("processor")).count());
    CpuReport {
        model: cpu_model(),
        cores_available: std::thread::available_parallelism().map_or(1, |n| n.get()),
        cores_online,
        isa_active: Isa::active().name().into(),
        isa_best: Isa::best().name().into(),
        avx512: Isa::Avx512.is_supported(),
        avx2_fma_f16c: Isa::Avx2.is_supported(),
        strata_isa: std::env::var("STRATA_ISA").ok(),
    }
}

fn examine_memory() -> MemoryReport {
    let limit = MemlockLimit::current().ok();
    let root = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let uids = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
            // Real, effective, saved, filesystem: the effective one decides.
            uids.split_whitespace().nth(1).map(|euid| euid == "0")
        })
        .unwrap_or(false);
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .ok()
        .and_then(|text| {
            let start = text.find('[')? + 1;
            let end = start + text[start..].find(']')?;
            Some(text[start..end].to_string())
        });
    MemoryReport {
        total_bytes: meminfo_bytes("MemTotal"),
        available_bytes: meminfo_bytes("MemAvailable"),
        memlock_unlimited: limit.is_some_and(|l| l.soft_bytes.is_none()),
        memlock_limit_bytes: limit.and_then(|l| l.soft_bytes),
        memlock_hard_limit_bytes: limit.and_then(|l| l.hard_bytes),
        cap_ipc_lock: limit.is_some_and(|l| l.cap_ipc_lock),
        root,
        transparent_hugepages: thp,
    }
}

fn examine_uring() -> UringReport {
    let probe = probe_uring();
    UringReport {
        works: probe.is_ok(),
        reason: probe.err(),
        io_uring_disabled: std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
            .ok()
            .map(|v| v.trim().to_string()),
    }
}

fn examine_folder(path: &Path) -> FolderReport {
    let mut report = FolderReport {
        path: path.display().to_string(),
        exists: false,
        is_dir: false,
        filesystem: None,
        tmpfs: false,
        direct_io: None,
        direct_io_error: None,
        free_bytes: None,
        usable: false,
        verdict: String::new(),
    };
    match std::fs::metadata(path) {
        Ok(meta) => {
            report.exists = true;
            report.is_dir = meta.is_dir();
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            report.verdict = format!(
                "not usable: {} does not exist; create it (mkdir -p) or pass an existing \
                 folder on the drive with --nvme",
                report.path
            );
            return report;
        }
        Err(e) => {
            report.verdict = format!("not usable: {} cannot be inspected: {e}", report.path);
            return report;
        }
    }
    report.filesystem = filesystem_type(path);
    if !report.is_dir {
        report.verdict = format!(
            "not usable: {} is not a folder; --nvme takes the folder swap files go in",
            report.path
        );
        return report;
    }
    report.tmpfs = is_tmpfs(path);
    if let Some(why) = swap_folder_refusal(path) {
        // The answer `train` gives, whatever the O_DIRECT probe would say.
        report.verdict = format!("not usable: {why}");
        return report;
    }
    report.free_bytes = available_bytes(path).ok();
    let free = report.free_bytes.map_or_else(
        || "free space unknown".into(),
        |b| format!("{} free", format_bytes(b)),
    );
    let fs = report
        .filesystem
        .as_deref()
        .unwrap_or("an unknown filesystem");
    report.verdict = match probe_direct_io(path) {
        Err(error) => {
            let verdict = "not usable: the tensor store cannot create and use swap files here \
                           (the direct I/O test says why); fix that, or pass another folder"
                .to_string();
            report.direct_io_error = Some(error.to_string());
            verdict
        }
        Ok(support) => {
            report.usable = true;
            let verdict = match &support {
                DirectIoSupport::Direct { .. } if fs == "overlay" => format!(
                    "works, with O_DIRECT, but on a container's overlay filesystem ({free}); \
                     for full speed mount a folder of the drive as a volume and use that"
                ),
                DirectIoSupport::Direct { .. } => {
                    format!("good: swap files on {fs} bypass the page cache (O_DIRECT), {free}")
                }
                DirectIoSupport::Buffered { .. } => format!(
                    "works, but buffered: {fs} refuses O_DIRECT, so swap-file I/O goes through \
                     the page cache (slower, and it takes RAM), {free}"
                ),
            };
            report.direct_io = Some(support);
            verdict
        }
    };
    report
}

fn examine_cuda() -> CudaReport {
    let libraries = probe();
    let (driver_cuda_version, gpus, gpu_query_error) = match describe_driver() {
        Ok(driver) => (
            Some(format!(
                "{}.{}",
                driver.cuda_version.0, driver.cuda_version.1
            )),
            driver
                .gpus
                .into_iter()
                .map(|gpu| GpuReport {
                    ordinal: gpu.ordinal,
                    name: gpu.name,
                    memory_bytes: gpu.memory_bytes,
                })
                .collect(),
            None,
        ),
        // Without the driver, or with one that failed to start, the probe already says
        // why; only a failure past that point is news.
        Err(_) if !libraries.driver || libraries.driver_error.is_some() => (None, Vec::new(), None),
        Err(e) => (None, Vec::new(), Some(e.reason)),
    };
    // The check `--device auto` makes for training (strata_engine::device::select with
    // kernels needed): the driver, NVRTC, cuBLAS and a GPU.
    let usable = libraries.require_all();
    CudaReport {
        driver: libraries.driver,
        nvrtc: libraries.nvrtc,
        cublas: libraries.cublas,
        nccl: strata_engine::device::nccl_available(),
        driver_error: libraries.driver_error.clone(),
        driver_cuda_version,
        gpus,
        gpu_query_error,
        usable_for_training: usable.is_ok(),
        reason: usable.err().map(|e| e.reason),
    }
}

/// The report as text: a header per section, one fact a line.
pub fn render(report: &DoctorReport) -> String {
    let mut text = format!(
        "strata {} doctor: what this machine offers strata\n",
        report.strata_version
    );
    let mut section = |title: &str, lines: Vec<(String, String)>| {
        text.push_str(&format!("\n{title}\n"));
        for (label, fact) in lines {
            text.push_str(&format!("  {label:<12} {fact}\n"));
        }
    };
    section("cpu", render_cpu(&report.cpu));
    section("memory", render_memory(&report.memory, &report.cuda));
    section("io_uring", render_uring(&report.io_uring));
    for folder in &report.nvme {
        section(&format!("nvme {}", folder.path), render_folder(folder));
    }
    section("cuda", render_cuda(&report.cuda));
    let summary = &report.summary;
    text.push_str(&format!(
        "\nsummary: `strata train --device auto` would use {} ({}); swap-file I/O on {}\n",
        summary.device,
        summary.device_reason,
        if summary.io_backend == BackendKind::Uring.name() {
            summary.io_backend.clone()
        } else {
            format!(
                "the {} (pread/pwrite) backend, since io_uring cannot start here",
                summary.io_backend
            )
        }
    ));
    text
}

fn render_cpu(cpu: &CpuReport) -> Vec<(String, String)> {
    let mut lines = vec![("model".to_string(), cpu.model.clone())];
    lines.push((
        "cores".into(),
        match cpu.cores_online {
            Some(online) if online > cpu.cores_available => format!(
                "{} available to strata of {online} online: CPU affinity or a cgroup quota \
                 limits this process, and the CPU optimizer's workers use only these",
                cpu.cores_available
            ),
            _ => format!("{} available to strata", cpu.cores_available),
        },
    ));
    let present = |yes: bool| if yes { "yes" } else { "no" };
    let mut isa = format!("kernels use {}", cpu.isa_active);
    match cpu.strata_isa.as_deref() {
        None => isa.push_str(", the best this CPU has"),
        Some(v) => match Isa::from_name(v) {
            Some(wanted) if wanted.name() == cpu.isa_active && cpu.isa_active != cpu.isa_best => {
                isa.push_str(&format!(
                    ", lowered from {} by STRATA_ISA={v} (for comparisons: unset it for full \
                     speed)",
                    cpu.isa_best
                ));
            }
            Some(wanted) if wanted.name() == cpu.isa_active => {
                isa.push_str(&format!(", as STRATA_ISA={v} asks (the best this CPU has)"));
            }
            Some(_) => isa.push_str(&format!(
                ": STRATA_ISA={v} asks for an instruction set this CPU lacks, so the best it \
                 has is used"
            )),
            None => isa.push_str(&format!(
                ": STRATA_ISA={v} is not one of portable, avx2, avx512 and is ignored"
            )),
        },
    }
    lines.push(("isa".into(), isa));
    if cfg!(target_arch = "x86_64") {
        let mut simd = format!(
            "AVX-512: {}, AVX2+FMA+F16C: {}",
            present(cpu.avx512),
            present(cpu.avx2_fma_f16c)
        );
        if !cpu.avx2_fma_f16c {
            simd.push_str(
                ": without AVX2+FMA+F16C the CPU optimizer and casts run the portable \
                 path, several times slower; offloading the optimizer to this CPU will be slow",
            );
        }
        lines.push(("simd".into(), simd));
    } else {
        lines.push((
            "simd".into(),
            format!(
                "strata has SIMD kernels for x86-64 only; on {} they run the portable path",
                std::env::consts::ARCH
            ),
        ));
    }
    lines
}

fn render_memory(memory: &MemoryReport, cuda: &CudaReport) -> Vec<(String, String)> {
    let bytes = |b: Option<u64>| b.map_or_else(|| "unknown".into(), format_bytes);
    let mut lines = vec![(
        "ram".to_string(),
        format!(
            "{} total, {} available",
            bytes(memory.total_bytes),
            bytes(memory.available_bytes)
        ),
    )];
    let limit = if memory.memlock_unlimited {
        "RLIMIT_MEMLOCK unlimited".to_string()
    } else {
        match memory.memlock_limit_bytes {
            Some(b) => format!(
                "RLIMIT_MEMLOCK {} ({b} bytes; hard limit {})",
                format_bytes(b),
                memory
                    .memlock_hard_limit_bytes
                    .map_or_else(|| "unlimited".into(), format_bytes)
            ),
            None => "RLIMIT_MEMLOCK unknown (getrlimit failed)".to_string(),
        }
    };
    let who = match (memory.root, memory.cap_ipc_lock) {
        (true, true) => "root, with CAP_IPC_LOCK",
        (false, true) => "not root, with CAP_IPC_LOCK",
        (true, false) => "root but without CAP_IPC_LOCK (a container may drop it)",
        (false, false) => "not root, no CAP_IPC_LOCK",
    };
    // How the pinned pool gets locked (engine/src/memory/pinned.rs): with a GPU the CUDA
    // driver registers it; without, mlock, which RLIMIT_MEMLOCK bounds unless the process
    // holds CAP_IPC_LOCK, falling back to unlocked memory with a warning. io_uring's fixed
    // buffers count against the same limit.
    let meaning = if memory.cap_ipc_lock || memory.memlock_unlimited {
        let locker = if cuda.usable_for_training {
            "by the CUDA driver"
        } else {
            "by mlock, with no GPU"
        };
        format!(
            "the limit does not bind, so the pinned pool can be page-locked ({locker}) and \
             registered with io_uring at any size"
        )
    } else {
        let cap = memory
            .memlock_limit_bytes
            .map_or_else(|| "the limit".into(), format_bytes);
        let raise = match memory.memlock_hard_limit_bytes {
            None => "`ulimit -l unlimited` in this shell".to_string(),
            Some(hard) if Some(hard) > memory.memlock_limit_bytes => {
                format!("`ulimit -l {}` (the hard limit) in this shell", hard / 1024)
            }
            Some(_) => "`memlock` in /etc/security/limits.conf".to_string(),
        };
        let pool = if cuda.usable_for_training {
            "the CUDA driver page-locks the pinned pool, but".to_string()
        } else {
            format!(
                "with no GPU the pinned pool is page-locked by mlock, which fails above \
                 {cap}: a larger pool runs unlocked (slower copies, pages may be swapped out), \
                 and"
            )
        };
        format!(
            "{pool} io_uring cannot register more than {cap} of it as fixed buffers; raise \
             the limit with {raise}, LimitMEMLOCK=infinity for a systemd service or \
             `--ulimit memlock=-1` for docker, or grant CAP_IPC_LOCK"
        )
    };
    lines.push(("memlock".into(), format!("{limit}; {who}: {meaning}")));
    let thp = match memory.transparent_hugepages.as_deref() {
        Some("always") => "transparent huge pages always: strata's buffers get huge pages".into(),
        Some("madvise") => "transparent huge pages on madvise: strata's buffers ask for them \
             (MADV_HUGEPAGE) and get them"
            .into(),
        Some("never") => "transparent huge pages never: strata's buffers get 4 KiB pages, so \
             more TLB misses when the CPU optimizer streams through them and more pages to \
             pin; allow them with `echo madvise > /sys/kernel/mm/transparent_hugepage/enabled` \
             (as root)"
            .into(),
        Some(other) => format!("transparent huge pages: {other}"),
        None => "no transparent huge pages in this kernel: strata's buffers get 4 KiB pages \
             (slower, but correct)"
            .into(),
    };
    lines.push(("huge pages".into(), thp));
    lines
}

fn render_uring(uring: &UringReport) -> Vec<(String, String)> {
    let status = match &uring.reason {
        None => "works: ring setup, the READ, WRITE, READ_FIXED and WRITE_FIXED opcodes and a \
                 trial buffer registration passed"
            .to_string(),
        Some(reason) => format!(
            "unavailable: {reason}. strata falls back to its threaded pread/pwrite backend, \
             which works everywhere but spends a thread per I/O in flight"
        ),
    };
    let mut lines = vec![("status".to_string(), status)];
    let sysctl = match uring.io_uring_disabled.as_deref() {
        None => "kernel.io_uring_disabled is absent (kernels before 6.6 have no such switch)"
            .to_string(),
        Some("0") => "kernel.io_uring_disabled = 0: allowed for every process".to_string(),
        Some("1") => "kernel.io_uring_disabled = 1: allowed only for members of \
             kernel.io_uring_group and CAP_SYS_ADMIN; `sysctl kernel.io_uring_disabled=0` \
             allows it for all"
            .to_string(),
        Some("2") => "kernel.io_uring_disabled = 2: disabled for every process; \
             `sysctl kernel.io_uring_disabled=0` enables it"
            .to_string(),
        Some(other) => format!("kernel.io_uring_disabled = {other}"),
    };
    lines.push(("sysctl".into(), sysctl));
    lines
}

fn render_folder(folder: &FolderReport) -> Vec<(String, String)> {
    let mut lines = Vec::new();
    if !folder.exists || !folder.is_dir {
        let what = if folder.exists {
            "exists, but is not a folder"
        } else {
            "does not exist"
        };
        lines.push(("path".into(), what.into()));
        lines.push(("verdict".into(), folder.verdict.clone()));
        return lines;
    }
    let fs = folder
        .filesystem
        .clone()
        .unwrap_or_else(|| "unknown".into());
    lines.push((
        "filesystem".into(),
        if folder.tmpfs {
            format!("{fs} (RAM, not a drive)")
        } else {
            fs
        },
    ));
    let align = |a: Option<u32>| a.map_or_else(|| "?".into(), |a| format!("{a} B"));
    let direct = match (&folder.direct_io, &folder.direct_io_error) {
        (
            Some(DirectIoSupport::Direct {
                memory_align_bytes: None,
                ..
            }),
            _,
        ) => "works: a 4 KiB O_DIRECT write and read-back passed (statx reports no \
             alignment needs here)"
            .to_string(),
        (
            Some(DirectIoSupport::Direct {
                memory_align_bytes,
                offset_align_bytes,
            }),
            _,
        ) => format!(
            "works: a 4 KiB O_DIRECT write and read-back passed; statx asks for {} memory \
             and {} file-offset alignment, within strata's {DIRECT_IO_ALIGN}",
            align(*memory_align_bytes),
            align(*offset_align_bytes)
        ),
        (Some(DirectIoSupport::Buffered { reason }), _) => {
            format!("refused: {reason}; swap files here use buffered I/O")
        }
        (None, Some(error)) => format!("failed: {error}"),
        (None, None) => "not tested".into(),
    };
    lines.push(("direct I/O".into(), direct));
    lines.push((
        "free".into(),
        folder
            .free_bytes
            .map_or_else(|| "unknown (statvfs failed)".into(), format_bytes),
    ));
    lines.push(("verdict".into(), folder.verdict.clone()));
    lines
}

fn render_cuda(cuda: &CudaReport) -> Vec<(String, String)> {
    let mut lines = Vec::new();
    let driver = match (&cuda.driver_error, &cuda.driver_cuda_version) {
        _ if !cuda.driver => "not found: libcuda.so could not be loaded, so no GPU can be used; \
             install the NVIDIA driver, or add its folder to LD_LIBRARY_PATH"
            .to_string(),
        (Some(error), _) => format!(
            "loaded, but failed to start: {error}; check `nvidia-smi`, and that this \
             container was given the GPU"
        ),
        (None, Some(version)) => match version
            .split('.')
            .next()
            .and_then(|m| m.parse::<u32>().ok())
        {
            Some(major) if major < 13 => format!(
                "loaded, supports CUDA {version}: strata loads the CUDA 13 libraries, which \
                 need a driver for CUDA 13 or newer; update the NVIDIA driver"
            ),
            _ => format!("loaded, supports CUDA {version}"),
        },
        (None, None) => "loaded".to_string(),
    };
    lines.push(("driver".into(), driver));
    let library = |found: bool, name: &str, role: &str| {
        if found {
            format!("found ({name})")
        } else {
            format!(
                "not found ({name}): {role}; install the CUDA 13 runtime libraries, or add \
                 their folder to LD_LIBRARY_PATH"
            )
        }
    };
    lines.push((
        "nvrtc".into(),
        library(
            cuda.nvrtc,
            NVRTC_LIBRARY,
            "it compiles strata's GPU kernels at run time, so training cannot use a GPU",
        ),
    ));
    lines.push((
        "cublas".into(),
        library(
            cuda.cublas,
            CUBLAS_LIBRARY,
            "it runs the matrix products, so training cannot use a GPU",
        ),
    ));
    lines.push((
        "nccl".into(),
        if cuda.nccl {
            "found (libnccl.so.2)".to_string()
        } else {
            "not found (libnccl.so.2): with several ranks (mpirun) GPUs exchange \
             gradients and parameters through host memory instead; install NCCL for \
             collectives over GPU memory"
                .to_string()
        },
    ));
    if cuda.gpus.is_empty() {
        let why = if !cuda.driver {
            "none: without the CUDA driver no GPU can be seen".to_string()
        } else if cuda.driver_error.is_some() {
            "none: the CUDA driver did not start".to_string()
        } else if let Some(error) = &cuda.gpu_query_error {
            format!("unknown: {error}")
        } else {
            "none: the CUDA driver reports no GPU (`nvidia-smi` shows what it sees; a \
             container needs the GPU passed in)"
                .to_string()
        };
        lines.push(("gpus".into(), why));
    }
    for gpu in &cuda.gpus {
        lines.push((
            format!("gpu {}", gpu.ordinal),
            format!("{}, {}", gpu.name, format_bytes(gpu.memory_bytes)),
        ));
    }
    lines
}
