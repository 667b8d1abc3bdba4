//! A configuration resolved against this machine, as `strata train` and `strata plan`
//! both need it: the budgets each tier plans with and the NVMe tier's folders
//! ([`budgets_of`]), the step's shape for a target's kernels ([`shape_of`]), and the plan
//! under the configured policy or the one `auto` picks ([`plan_of`]).
//!
//! Not here: reading the settings ([`crate::train_config`]), what `--model` names
//! ([`crate::model_source`]), or running anything.

use std::path::PathBuf;

use strata_engine::model::Target;
use strata_engine::plan::{
    Auto, Budgets, CostModel, Plan, PlanInput, PolicyChoice, StepShape, Tier, fmt_bytes,
};

use crate::machine::{default_scratch_dir, meminfo_bytes, swap_folder_refusal};
use crate::train_config::TrainConfig;

type Error = Box<dyn std::error::Error>;

/// The prefetch depth of a streaming built-in policy when `prefetch` is not set.
const DEFAULT_PREFETCH_DEPTH: usize = 2;

/// The budgets of a run and where they come from.
#[derive(Debug, Clone)]
pub struct RunBudgets {
    /// The budgets the plan must fit.
    pub budgets: Budgets,
    /// The folders of the NVMe tier.
    pub nvme_dirs: Vec<PathBuf>,
    /// Free bytes in those folders now.
    pub nvme_free: u64,
    /// Whether the NVMe budget was stated (`--nvme-mem`) rather than taken from the
    /// free space.
    pub nvme_stated: bool,
}

impl RunBudgets {
    /// The NVMe folders, for messages.
    pub fn dirs_text(&self) -> String {
        self.nvme_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Where the NVMe budget comes from, in words, with the folders.
    pub fn nvme_source(&self) -> String {
        let dirs = self.dirs_text();
        if self.nvme_stated {
            format!("stated; {} free in {dirs}", fmt_bytes(self.nvme_free))
        } else {
            format!("90% of free space in {dirs}")
        }
    }

    /// Refuses a plan whose NVMe peak is more than the folders' free space (a stated
    /// budget can be larger than the drive, which `strata plan` may ask about, but a
    /// run would fail part-way with "no space left").
    pub fn check_free(&self, plan: &Plan) -> Result<(), Error> {
        let need = plan.peak[Tier::Nvme.index()];
        if need > self.nvme_free {
            return Err(format!(
                "plan {} needs {} of NVMe but {} has only {} free; free space there, \
                 or give more folders with --nvme",
                plan.policy,
                fmt_bytes(need),
                self.dirs_text(),
                fmt_bytes(self.nvme_free)
            )
            .into());
        }
        Ok(())
    }
}

/// The device budget when none is stated: what the device has. The available RAM for the
/// CPU device, the GPU's memory less 1 GiB for CUDA's own (its context, cuBLAS).
fn device_default(target: Target, ram: u64) -> Result<u64, Error> {
    match target {
        Target::Cpu => Ok(ram),
        Target::Cuda => match strata_engine::kernels::cuda::describe_driver() {
            Ok(d) if !d.gpus.is_empty() => Ok(d.gpus[0].memory_bytes.saturating_sub(1 << 30)),
            Ok(_) | Err(_) => Err("--device cuda: no GPU is visible here to say its memory; \
                                   give --device-mem (such as 24GiB) to plan for one"
                .into()),
        },
    }
}

/// The NVMe tier's folders (made when missing; refused when they cannot hold swap
/// files), and their free bytes together.
fn nvme_folders(cfg: &TrainConfig) -> Result<(Vec<PathBuf>, u64), Error> {
    let dirs = if cfg.nvme.is_empty() {
        vec![default_scratch_dir().join("strata-nvme")]
    } else {
        cfg.nvme.clone()
    };
    let mut free = 0u64;
    for d in &dirs {
        std::fs::create_dir_all(d).map_err(|e| format!("--nvme {}: {e}", d.display()))?;
        if let Some(why) = swap_folder_refusal(d) {
            return Err(format!("--nvme {why}").into());
        }
        free += strata_engine::storage::available_bytes(d)?;
    }
    Ok((dirs, free))
}

/// The budgets of a configuration on `target`, and the folders of the NVMe tier. With
/// no device budget stated it is what the device has (the available RAM for the CPU
/// device, the GPU's memory less 1 GiB for CUDA's own); with no host budget, the
/// available RAM; with no NVMe budget stated, 90% of the folders' free space.
pub fn budgets_of(cfg: &TrainConfig, target: Target) -> Result<RunBudgets, Error> {
    let ram = meminfo_bytes("MemAvailable").unwrap_or(8 << 30);
    let device = match cfg.device_mem.bytes() {
        Some(bytes) => bytes,
        None => device_default(target, ram)?,
    };
    let host = cfg.host_mem.bytes().unwrap_or(ram);
    let (nvme_dirs, free) = nvme_folders(cfg)?;
    let stated = cfg.nvme_mem.bytes();
    Ok(RunBudgets {
        budgets: Budgets {
            device,
            host,
            // Leave room on the drives for checkpoints and everything else.
            nvme: stated.unwrap_or(free / 10 * 9),
        },
        nvme_dirs,
        nvme_free: free,
        nvme_stated: stated.is_some(),
    })
}

/// The step shape of a configuration, for `target`'s kernels.
pub fn shape_of(cfg: &TrainConfig, target: Target) -> StepShape {
    let precision = cfg.dtype.precision();
    StepShape {
        batch: cfg.batch,
        seq: cfg.seq,
        grad_accum: cfg.grad_accum,
        precision,
        optimizer_state: cfg.optimizer_state,
        needs_global_norm: cfg.clip > 0.0 || precision == strata_engine::plan::Precision::Fp16,
        delayed_update: cfg.delayed_update,
        target,
        recompute: cfg.recompute,
        schedule: cfg.schedule,
        grad_spill: cfg.spill_grads,
        grad_dtype: cfg.grad_dtype,
        ranks: 1,
        // The CPU device's collectives run on its memory, a GPU's through NCCL where it
        // loads (else they are staged through host memory).
        device_collectives: target == Target::Cpu || strata_engine::device::nccl_available(),
        prefetch_next_step: true,
    }
}

/// The prefetch depth a configuration gives a streaming built-in policy.
pub fn prefetch_depth(cfg: &TrainConfig) -> usize {
    cfg.prefetch.unwrap_or(DEFAULT_PREFETCH_DEPTH)
}

/// Plans a step: the configured policy, or the fastest that fits (auto), its choices
/// weighed by `cost`. Refuses a plan that does not fit, before anything is allocated.
pub fn plan_of(cfg: &TrainConfig, input: &PlanInput<'_>, cost: CostModel) -> Result<Plan, Error> {
    match cfg.policy {
        PolicyChoice::Builtin(builtin) => {
            let policy = builtin.policy(prefetch_depth(cfg));
            let plan = Plan::build(&input.with_cost(cost), policy.as_ref())?;
            plan.check_fits(input)?;
            Ok(plan)
        }
        PolicyChoice::Auto => Ok(Auto { cost }.choose(input)?.1),
    }
}
