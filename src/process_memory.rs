//! The memory a strata process holds, planned before anything is allocated
//! ([`ProcessMemory`]): the plan's arenas that live in RAM (the pinned host arena, and on
//! the CPU device its device arena, which is host memory too), what loading the state a
//! block at a time holds beside them ([`staging_bytes`]), and a fixed overhead stated
//! here ([`PROCESS_OVERHEAD_BYTES`]); the independent figure it is measured against (the
//! process's resident peak, VmHWM, [`crate::report::peak_rss_bytes`]); and the memory the
//! process may use ([`memory_limit`]: this machine's available memory, or its memory
//! cgroup's limit when lower), which a run is refused by before any arena is made
//! ([`ProcessMemory::check_fits`]).
//!
//! Not here: the plan's peaks per tier (the engine's planner) or the budgets
//! ([`crate::run_setup`]).

use strata_engine::checkpoint::SAVE_HELD_BYTES;
use strata_engine::exec::{BlockForward, load_staging_bytes};
use strata_engine::model::{Model, StateLayout, Target};
use strata_engine::plan::{Plan, Tier, fmt_bytes};

use crate::machine::meminfo_bytes;

/// Bytes a strata process holds besides the plan's arenas and block staging, at most.
/// Two moments bound it. Before the arenas are made, the start-up measurement of this
/// machine's rates (`strata_engine::exec::calibrate`) holds 64 MiB copied each way
/// between a host arena and device memory, then a one-layer model at most 1024 wide
/// with its parameters, then 64 MiB of AdamW state, then a 64 MiB NVMe extent, each
/// freed before the next; with the binary and its libraries (about 12 MiB resident)
/// that peaks at 221 MiB for a model 1024 or more wide (the cap), 141 MiB for the
/// built-in job's. After it, beside the arenas: the binary, the allocator's heap (the
/// model's description, the schedule, the step's small host buffers), the threads'
/// stacks, the io_uring rings: 40 MiB for GPT-2 124M all-on-device.
///
/// Measured, not fitted, with `/usr/bin/time -v` on a 2-core Xeon: `strata train
/// --model 16x2048 --device-mem 1MiB --host-mem 1MiB` (refused after calibrating)
/// peaks at 221 MiB; this figure is that and 11 MiB for another machine's libraries.
/// The test `train_stays_within_its_planned_process_memory` holds a run to it.
pub const PROCESS_OVERHEAD_BYTES: u64 = 232 << 20;

/// What the target allows beyond the planned figure: 2% of it (allocator
/// rounding, pages touched by the kernel for the process), on top of the overhead.
pub const PROCESS_SLACK_PERCENT: u64 = 2;

/// The memory a run's process is planned to hold: the larger of two moments, stepping
/// and loading, and the overhead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ProcessMemory {
    /// While stepping: the plan's arenas that are RAM, its host peak and on the CPU
    /// device its device peak (the simulated device's memory is host memory).
    pub arena_bytes: u64,
    /// While loading the state a block at a time, before step 1 (the host arena, the
    /// CPU device's buffers loading writes, and [`staging_bytes`]), while saving it a
    /// block at a time between steps (the arenas and [`saving_bytes`]), or while
    /// writing or evaluating the model a block at a time (the arenas and
    /// [`reading_bytes`]), whichever is most.
    pub loading_bytes: u64,
    /// The larger, in whole pages: the planned figure.
    pub planned_bytes: u64,
    /// [`PROCESS_OVERHEAD_BYTES`].
    pub overhead_bytes: u64,
    /// Both: what the process may hold at most.
    pub total_bytes: u64,
}

impl ProcessMemory {
    /// The process memory of `plan` of `model` (on the target its step was planned
    /// for), for a run that neither writes the model nor evaluates (`bench step`).
    pub fn of(plan: &Plan, model: &Model) -> Self {
        Self::of_run(plan, model, Reads::NONE)
    }

    /// As [`ProcessMemory::of`], for a run that reads the model a block at a time as
    /// `reads` says.
    pub fn of_run(plan: &Plan, model: &Model, reads: Reads) -> Self {
        let host = plan.peak[Tier::Host.index()];
        let (device, device_loaded) = match plan.shape.target {
            Target::Cpu => (plan.peak[Tier::Device.index()], device_homes_bytes(plan)),
            // A GPU's memory is its own; CUDA's host-side context is not counted here.
            Target::Cuda => (0, 0),
        };
        let loading = host + device_loaded + staging_bytes(plan, model);
        let between_steps = saving_bytes(plan, model).max(reading_bytes(plan, model, reads));
        Self::new(host + device, loading.max(host + device + between_steps))
    }

    /// The process memory of `arena_bytes` in RAM while stepping and `loading_bytes`
    /// while loading.
    pub fn new(arena_bytes: u64, loading_bytes: u64) -> Self {
        // In whole pages, as the kernel counts memory (and rounds a cgroup's limit).
        let planned_bytes = arena_bytes.max(loading_bytes).next_multiple_of(4096);
        ProcessMemory {
            arena_bytes,
            loading_bytes,
            planned_bytes,
            overhead_bytes: PROCESS_OVERHEAD_BYTES,
            total_bytes: planned_bytes + PROCESS_OVERHEAD_BYTES,
        }
    }

    /// The most a run's measured resident peak may be: the total and 2% of the planned
    /// figure.
    pub fn allowed_bytes(&self) -> u64 {
        self.total_bytes + self.planned_bytes * PROCESS_SLACK_PERCENT / 100
    }

    /// "process memory: planned X + overhead Y = Z (...)", as `plan` and `train` print
    /// it.
    pub fn line(&self) -> String {
        format!(
            "process memory: planned {} + overhead {} = {} (arenas in RAM {} while stepping, {} \
             while loading, saving or writing a block at a time)",
            fmt_bytes(self.planned_bytes),
            fmt_bytes(self.overhead_bytes),
            fmt_bytes(self.total_bytes),
            fmt_bytes(self.arena_bytes),
            fmt_bytes(self.loading_bytes)
        )
    }

    /// `measured` (VmHWM) against the planned total: "M / T (+D)" or "(-D)", with ", over
    /// the plan's allowance" past [`Self::allowed_bytes`].
    pub fn compared(&self, measured: u64) -> String {
        let (sign, diff) = if measured >= self.total_bytes {
            ("+", measured - self.total_bytes)
        } else {
            ("-", self.total_bytes - measured)
        };
        format!(
            "{} / {} ({sign}{}{})",
            fmt_bytes(measured),
            fmt_bytes(self.total_bytes),
            fmt_bytes(diff),
            if measured > self.allowed_bytes() {
                ", over the plan's allowance"
            } else {
                ""
            }
        )
    }

    /// Refuses, before any arena is made, a plan whose process memory is more than
    /// `limit` (the memory this process may use, and where that figure comes from),
    /// naming the tiers and their sizes.
    pub fn check_fits(&self, plan: &Plan, limit: &MemoryLimit) -> Result<(), String> {
        if self.total_bytes <= limit.bytes {
            return Ok(());
        }
        let host = fmt_bytes(plan.peak[Tier::Host.index()]);
        let (arenas, flags) = match plan.shape.target {
            Target::Cpu => (
                format!(
                    "device {} + host {host} while stepping, the CPU device's memory being RAM",
                    fmt_bytes(plan.peak[Tier::Device.index()])
                ),
                "--device-mem or --host-mem",
            ),
            Target::Cuda => (format!("host {host} while stepping"), "--host-mem"),
        };
        Err(format!(
            "plan {} needs {} of RAM ({arenas}; {} while loading a block at a time; + overhead \
             {}) but {} allows {}: it would be killed for memory; lower {flags}, or run where \
             there is more memory",
            plan.policy,
            fmt_bytes(self.total_bytes),
            fmt_bytes(self.loading_bytes),
            fmt_bytes(self.overhead_bytes),
            limit.source,
            fmt_bytes(limit.bytes),
        ))
    }
}

/// What loading (or saving) the training state a block at a time holds beside the
/// arenas, as the executor does it (`Executor::load_blocks`, `export_block`): a pinned
/// staging arena through which device homes are written a piece at a time
/// ([`load_staging_bytes`]: at most 64 MiB, locked, so resident whole while any block
/// loads), and, for the block being loaded, the block as made or read (4 B per
/// parameter) and, where its state or working parameters live on NVMe, the aligned
/// buffer their extent is written from (at most 12 B per parameter); for a quantised
/// base, its values dequantised (4 B per parameter), or its packed image twice and each
/// core's tensor being quantised. Host homes are written in place. Made and freed before
/// step 1, while the arenas are there.
pub fn staging_bytes(plan: &Plan, model: &Model) -> u64 {
    let blocks = model.blocks();
    let largest = blocks.iter().map(|b| b.len).max().unwrap_or(0);
    let arena = load_staging_bytes(largest) as u64;
    let block = (0..blocks.len())
        .map(|b| {
            let homes = plan.block_homes[b];
            let on_nvme = [homes.state, homes.params]
                .iter()
                .any(|&id| plan.buffer(id).tier == Tier::Nvme);
            let per_param = 4 + if on_nvme { 12 } else { 0 };
            // A quantised base: the block's values rounded to the working dtype and
            // dequantised; or, packed, each core's tensor being quantised (a rounded copy
            // of the largest, and its codes) and the packed image with the aligned buffer
            // it is written to NVMe from.
            let quantised = match (model.base_quant(), homes.packed) {
                (None, _) => 0,
                (Some(_), None) => 4 * blocks[b].len as u64,
                (Some(_), Some(_)) => {
                    let image = model
                        .quant_block(b, plan.shape.device_dtype())
                        .map_or(0, |q| q.bytes() as u64);
                    let largest = blocks[b].tensors.iter().map(|t| t.slot.len).max();
                    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                    5 * largest.unwrap_or(0) as u64 * cores as u64 + 2 * image
                }
            };
            (per_param * blocks[b].len as u64 + quantised).next_multiple_of(4096)
        })
        .max()
        .unwrap_or(0);
    arena + block
}

/// What saving the training state a block at a time (a checkpoint, or the rescue of a
/// failing run) holds beside the arenas: for the largest block, the buffer its state is
/// read into where it does not live in the host arena (from NVMe, or copied off the
/// device: 12 B per parameter with fp32 moments, fewer with compact ones; host-homed
/// state is lent from the arena itself), compact moments decoded to f32 (8 B per
/// parameter) and [`SAVE_READ_EXTRA_BYTES`] beside them, and the save's own write
/// buffers and written pages ([`SAVE_HELD_BYTES`]).
pub fn saving_bytes(plan: &Plan, model: &Model) -> u64 {
    let format = plan.shape.optimizer_state;
    let read = (0..model.blocks().len())
        .filter_map(|b| {
            let shard = plan.shard_len[b] as usize;
            let buffer = match plan.buffer(plan.block_homes[b].state).tier {
                Tier::Host => 0,
                _ => StateLayout::shard_bytes(format, &model.blocks()[b], shard, plan.shape.ranks),
            };
            let decoded = if format.is_fp32() { 0 } else { 8 * shard };
            let held = (buffer + decoded) as u64;
            (held > 0).then(|| held.next_multiple_of(4096) + SAVE_READ_EXTRA_BYTES)
        })
        .max()
        .unwrap_or(0);
    read + SAVE_HELD_BYTES
}

/// Whether a run reads its model a block at a time between steps, beside saving
/// checkpoints: to write it (`--out`), to evaluate it (`--eval-every`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reads {
    /// It writes the model.
    pub writes: bool,
    /// It evaluates a held-out batch.
    pub evaluates: bool,
}

impl Reads {
    /// A run that neither writes the model nor evaluates.
    pub const NONE: Reads = Reads {
        writes: false,
        evaluates: false,
    };
}

/// What writing the model (`--out`) or evaluating it (`--eval-every`), as `reads` says,
/// a block at a time holds beside the arenas, at most, for the largest block: reading a
/// block's master parameters (`Executor::export_block`: this rank's shard, and the
/// buffer its home's read puts it in, 8 B per parameter of the shard; with ranks the
/// block gathered whole, 4 B per parameter of the block), or, writing, the block kept
/// while its tensors go out and one tensor converted to the file's type (8 B per
/// parameter of the block); and when evaluating, the forward's own memory beside them
/// ([`BlockForward::memory_bytes`]: a block's parameters and its tied block's, the
/// activations of one micro-batch, a block's scratch, its staging).
pub fn reading_bytes(plan: &Plan, model: &Model, reads: Reads) -> u64 {
    if !reads.writes && !reads.evaluates {
        return 0;
    }
    let ranks = plan.shape.ranks as u64;
    let block = (0..model.blocks().len())
        .map(|b| {
            let (len, shard) = (model.blocks()[b].len as u64, plan.shard_len[b]);
            let gathered = if ranks > 1 { 4 * ranks * shard } else { 0 };
            (8 * shard + gathered).max(8 * len)
        })
        .max()
        .unwrap_or(0);
    let forward = if reads.evaluates {
        // A shape the model refuses is refused before evaluating: nothing to count.
        BlockForward::memory_bytes(model, plan.shape.batch, plan.shape.seq).unwrap_or(0)
    } else {
        0
    };
    block + forward
}

/// What reading a block's state off NVMe for a save holds beside its buffer, at most:
/// `engine/tests/checkpoint_blocks.rs` measured 1.9 MB beside the 2.4 MB buffer of its
/// blocks under nvme-offload, and the 0.91B run of
/// `benches/results/kill-resume-1b-intel-xeon-2c.json` rose from 7.36 GiB (no save) to
/// 7.92 GiB with saves, its largest NVMe-homed block's state being 0.56 GiB: a fixed
/// amount, not one per block. 8 MiB bounds it.
pub const SAVE_READ_EXTRA_BYTES: u64 = 8 << 20;

/// The bytes of the device buffers that hold blocks' working parameters or state (each
/// once): what loading writes to the CPU device's memory, the rest of which is first
/// touched by the steps.
fn device_homes_bytes(plan: &Plan) -> u64 {
    let mut homes: Vec<_> = plan
        .block_homes
        .iter()
        .flat_map(|h| [h.params, h.state])
        .filter(|&id| plan.buffer(id).tier == Tier::Device)
        .collect();
    homes.sort();
    homes.dedup();
    homes.iter().map(|&id| plan.buffer(id).bytes).sum()
}

/// How much memory this process may use, and where that figure comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryLimit {
    /// Bytes.
    pub bytes: u64,
    /// "this machine's available memory", or "its memory cgroup (PATH)".
    pub source: String,
}

/// The memory this process may use: the lower of this machine's available memory and
/// its memory cgroup's limit (v1 `memory.limit_in_bytes` or v2 `memory.max`), `None`
/// when neither can be read.
pub fn memory_limit() -> Option<MemoryLimit> {
    let available = meminfo_bytes("MemAvailable").map(|bytes| MemoryLimit {
        bytes,
        source: "this machine's available memory".into(),
    });
    let cgroup = cgroup_limit().map(|(bytes, path)| MemoryLimit {
        bytes,
        source: format!("its memory cgroup's limit ({path})"),
    });
    [available, cgroup]
        .into_iter()
        .flatten()
        .min_by_key(|l| l.bytes)
}

/// The memory limit of this process's cgroup and the file it is read from: v1's
/// `memory.limit_in_bytes` under /sys/fs/cgroup/memory, or v2's `memory.max` under
/// /sys/fs/cgroup (or /sys/fs/cgroup/unified, where v1 and v2 are mounted together).
/// `None` when it has none (`max`, or v1's "unlimited" of nearly 2^63) or it cannot be
/// read.
fn cgroup_limit() -> Option<(u64, String)> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut limits = Vec::new();
    for line in text.lines() {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        let files: Vec<String> = if controllers.split(',').any(|c| c == "memory") {
            vec![format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")]
        } else if controllers.is_empty() {
            ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
                .iter()
                .map(|root| format!("{root}{path}/memory.max"))
                .collect()
        } else {
            continue;
        };
        for file in files {
            if let Some(bytes) = read_limit(&file) {
                limits.push((bytes, file));
            }
        }
    }
    limits.into_iter().min_by_key(|(bytes, _)| *bytes)
}

/// A cgroup memory limit file's bytes; `None` for no limit (`max`, or v1's page-rounded
/// 2^63) or a file that cannot be read.
fn read_limit(file: &str) -> Option<u64> {
    parse_limit(&std::fs::read_to_string(file).ok()?)
}

/// The bytes of a cgroup limit file's text; `None` for no limit.
fn parse_limit(text: &str) -> Option<u64> {
    let bytes: u64 = text.trim().parse().ok()?;
    // cgroup v1 writes "no limit" as 2^63 rounded down to a page.
    (bytes < 1 << 62).then_some(bytes)
}

#[cfg(test)]
mod tests {
    use strata_engine::model::Gpt2Config;
    use strata_engine::plan::{Budgets, BuiltinPolicy, PlanInput, StepShape};

    use super::*;

    #[test]
    fn the_larger_moment_counts_in_whole_pages() {
        let stepping = ProcessMemory::new(150 << 20, 100 << 20);
        assert_eq!(stepping.planned_bytes, 150 << 20);
        assert_eq!(stepping.total_bytes, (150 << 20) + PROCESS_OVERHEAD_BYTES);
        assert_eq!(
            stepping.allowed_bytes(),
            stepping.total_bytes + 3 * (1 << 20)
        );
        let loading = ProcessMemory::new(150 << 20, (200 << 20) + 1);
        assert_eq!(loading.planned_bytes, (200 << 20) + 4096);
        assert!(
            stepping
                .line()
                .starts_with("process memory: planned 150 MiB + overhead 232 MiB = 382 MiB"),
            "{}",
            stepping.line()
        );
    }

    /// GPT-2 of 2 layers, 64 wide, planned under `builtin` with room everywhere.
    fn plan_of(builtin: BuiltinPolicy) -> (Plan, Model) {
        let model = Model::new(Gpt2Config::new(2, 4, 64, 256, 32)).unwrap();
        let input = PlanInput {
            model: &model,
            shape: StepShape::cpu(2, 32),
            budgets: Budgets::new(1 << 30, 1 << 30, 1 << 30),
            cost: Default::default(),
        };
        let plan = Plan::build(&input, builtin.policy(2).as_ref()).unwrap();
        (plan, model)
    }

    #[test]
    fn loading_counts_the_staging_and_the_device_homes_it_writes() {
        let (on_device, model) = plan_of(BuiltinPolicy::AllOnDevice);
        let (on_nvme, _) = plan_of(BuiltinPolicy::NvmeOffload);
        let largest = model.blocks().iter().map(|b| b.len as u64).max().unwrap();
        // The staging (64 MiB at most) and the made block (4 B) everywhere; the NVMe
        // write buffer (12 B more) only where a block's state is on NVMe.
        assert_eq!(
            staging_bytes(&on_device, &model),
            (12 * largest).clamp(4096, 64 << 20).next_multiple_of(4096)
                + (4 * largest).next_multiple_of(4096)
        );
        assert!(staging_bytes(&on_nvme, &model) > staging_bytes(&on_device, &model));
        // All on the device: loading writes every block's parameters and state there.
        let params = model.param_count() as u64;
        assert!(device_homes_bytes(&on_device) >= 16 * params);
        assert!(device_homes_bytes(&on_nvme) < device_homes_bytes(&on_device));
        let p = ProcessMemory::of(&on_device, &model);
        let host = on_device.peak[Tier::Host.index()];
        let arenas = on_device.peak[0] + on_device.peak[1];
        assert_eq!(
            p.loading_bytes,
            (host + device_homes_bytes(&on_device) + staging_bytes(&on_device, &model))
                .max(arenas + saving_bytes(&on_device, &model))
        );
        // Saving: the device-homed state of the largest block is read into a buffer
        // beside the save's own; NVMe-homed state likewise; host-homed state is lent.
        assert_eq!(
            saving_bytes(&on_device, &model),
            (12 * largest).next_multiple_of(4096) + SAVE_READ_EXTRA_BYTES + SAVE_HELD_BYTES
        );
        assert_eq!(p.arena_bytes, on_device.peak[0] + on_device.peak[1]);
    }

    /// Writing the model holds 8 B per parameter of the largest block alone (the block
    /// kept and a tensor converted, or its read and the buffer its home's read fills);
    /// evaluating adds the forward's own memory; a run that does neither holds nothing
    /// of the kind, and the larger moment counts.
    #[test]
    fn writing_and_evaluating_count_a_block_and_the_forward() {
        let (plan, model) = plan_of(BuiltinPolicy::CpuOffload);
        let largest = model.blocks().iter().map(|b| b.len as u64).max().unwrap();
        let writes = Reads {
            writes: true,
            evaluates: false,
        };
        let evaluates = Reads {
            writes: false,
            evaluates: true,
        };
        assert_eq!(reading_bytes(&plan, &model, Reads::NONE), 0);
        assert_eq!(reading_bytes(&plan, &model, writes), 8 * largest);
        let forward = BlockForward::memory_bytes(&model, plan.shape.batch, plan.shape.seq).unwrap();
        assert_eq!(
            reading_bytes(&plan, &model, evaluates),
            8 * largest + forward
        );
        let (none, both) = (
            ProcessMemory::of(&plan, &model),
            ProcessMemory::of_run(&plan, &model, evaluates),
        );
        assert_eq!(
            both.loading_bytes,
            none.loading_bytes
                .max(both.arena_bytes + 8 * largest + forward)
        );
    }

    #[test]
    fn cgroup_limits_parse_and_no_limit_is_none() {
        assert_eq!(parse_limit("1073741824\n"), Some(1 << 30));
        assert_eq!(parse_limit("max\n"), None);
        assert_eq!(parse_limit("9223372036854771712\n"), None);
    }
}
