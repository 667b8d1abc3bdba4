//! A run's plan, made before anything is allocated ([`plan_run`]): the budgets (shared by
//! the ranks of one machine), this machine's rates (measured in half a second, rank 0's
//! on every rank), the plan under the configured policy or the one `auto` picks, and the
//! refusals of a run that would not fit: over a budget, over the drives' free space, or
//! over the memory the options that hold the whole model need.
//!
//! Not here: the budgets' and the plan's rules ([`crate::run_setup`], the engine's
//! planner).

use strata_engine::model::{Model, Target};
use strata_engine::plan::{CostModel, Plan, PlanInput, Prediction, StepShape, Tier, fmt_bytes};

use super::group::{Ranks, machine_id, shared_budgets};
use crate::machine::meminfo_bytes;
use crate::process_memory::{ProcessMemory, memory_limit};
use crate::run_setup::{RunBudgets, budgets_of, plan_of, shape_of};
use crate::train_config::TrainConfig;

type Error = Box<dyn std::error::Error>;

/// What planning a run found.
pub struct Planned {
    /// The budgets it plans with, and the NVMe tier's folders.
    pub budgets: RunBudgets,
    /// The step, as one of the ranks.
    pub shape: StepShape,
    /// The rates the plan was chosen and predicted by.
    pub cost: CostModel,
    /// The plan.
    pub plan: Plan,
    /// Its predicted step.
    pub predicted: Prediction,
}

/// Plans the run of `cfg` on `target`, as one of `ranks`: refused here, before any
/// parameter is allocated, when it does not fit.
pub fn plan_run(
    cfg: &TrainConfig,
    model: &Model,
    target: Target,
    ranks: &Ranks,
) -> Result<Planned, Error> {
    let budgets = run_budgets(cfg, target, ranks)?;
    let shape = shape_of(cfg, target).with_ranks(ranks.ranks);
    let input = PlanInput {
        model,
        shape,
        budgets: budgets.budgets,
    };
    // This machine's rates, measured in half a second, choose the plan and predict it.
    let mut cost = strata_engine::exec::calibrate(
        model,
        cfg.batch,
        cfg.seq,
        target,
        budgets.nvme_dirs.first().map(|d| d.as_path()),
    )?;
    let shard_bytes = strata_engine::plan::layer_shard_bytes(model, shape) as usize;
    ranks.agree_on_rates(&mut cost, shard_bytes)?;
    let plan = plan_of(cfg, &input, cost)?;
    ranks.check_same_plan(&plan)?;
    check_whole_model_memory(cfg, &plan, model, target, ranks.ranks)?;
    check_process_memory(&plan, model)?;
    budgets.check_free(&plan)?;
    let predicted = cost.predict(&plan);
    Ok(Planned {
        budgets,
        shape,
        cost,
        plan,
        predicted,
    })
}

/// Refuses, before any arena is made, a plan whose process memory (its arenas in RAM,
/// block staging and the fixed overhead) is more than this process may use: this
/// machine's available memory, or its memory cgroup's limit when lower.
fn check_process_memory(plan: &Plan, model: &Model) -> Result<(), Error> {
    let Some(limit) = memory_limit() else {
        return Ok(()); // nothing to judge by
    };
    Ok(ProcessMemory::of(plan, model).check_fits(plan, &limit)?)
}

/// The budgets of `cfg` on `target`; with ranks, every rank's (the ranks of one machine
/// share its memory and disk, and every rank must make the same plan).
fn run_budgets(cfg: &TrainConfig, target: Target, ranks: &Ranks) -> Result<RunBudgets, Error> {
    let mut budgets = budgets_of(cfg, target)?;
    if let Some(group) = &ranks.group {
        let measured = [
            target == Target::Cpu && cfg.device_mem.bytes().is_none(),
            cfg.host_mem.bytes().is_none(),
            !budgets.nvme_stated,
        ];
        shared_budgets(group.as_ref(), &mut budgets.budgets, measured, machine_id())?;
    }
    Ok(budgets)
}

/// What the options of `cfg` hold of the whole model in memory at once, per process, and
/// which option: `None` when none does. Training, loading a fresh run and, alone,
/// `--out`, `--checkpoint-dir`, `--resume` and `--eval-every` go a block at a time and
/// are not counted.
fn whole_model_bytes(cfg: &TrainConfig, params: u64, ranks: usize) -> Option<(String, u64)> {
    // Per process: with ranks each holds its shard of a checkpoint it writes or reads
    // as its own, but gathers whole parameters (with their moments) to evaluate or write
    // the model.
    let mut wholes: Vec<(String, u64)> = Vec::new();
    if cfg.checkpoint_dir.is_some() && ranks > 1 {
        wholes.push((
            "--checkpoint-dir: writing a checkpoint holds the parameters, m and v".into(),
            12 * params / ranks as u64,
        ));
    }
    if cfg.resume.is_some() && ranks > 1 {
        wholes.push((
            "--resume: reading the checkpoint holds its parameters, m and v".into(),
            12 * params / ranks as u64,
        ));
    }
    if cfg.eval_every > 0 && ranks > 1 {
        wholes.push((
            "--eval-every with ranks: evaluating gathers the parameters, m and v, and holds \
             the parameters in the evaluation's own model"
                .into(),
            16 * params,
        ));
    }
    if cfg.out.is_some() && ranks > 1 {
        wholes.push((
            "--out with ranks: every rank gathers the parameters, m and v".into(),
            12 * params,
        ));
    }
    wholes.into_iter().max_by_key(|(_, bytes)| *bytes)
}

/// Refuses, before anything is allocated, a run whose options make the whole model's
/// parameters (and for some, its optimizer moments) in memory beside the executor's
/// arenas when this machine's available memory cannot hold both: a run that would be
/// killed for memory at its first checkpoint or evaluation, hours in.
fn check_whole_model_memory(
    cfg: &TrainConfig,
    plan: &Plan,
    model: &Model,
    target: Target,
    ranks: usize,
) -> Result<(), Error> {
    let Some((what, whole)) = whole_model_bytes(cfg, model.param_count() as u64, ranks) else {
        return Ok(());
    };
    // The CPU device's memory is RAM too.
    let arenas = plan.peak[Tier::Host.index()]
        + if target == Target::Cpu {
            plan.peak[Tier::Device.index()]
        } else {
            0
        };
    let Some(available) = meminfo_bytes("MemAvailable") else {
        return Ok(()); // no /proc/meminfo to judge by
    };
    if arenas + whole <= available {
        return Ok(());
    }
    Err(format!(
        "{what} of the whole model in memory ({} for {} parameters{}) beside the plan's {} \
         of {}, {} in all, and this machine has {} available: it would run out of memory \
         there. With ranks strata does not do that a block at a time yet: leave the option \
         out, run alone (where it goes a block at a time), or run where there is more memory",
        fmt_bytes(whole),
        model.param_count(),
        if ranks > 1 { ", per rank" } else { "" },
        fmt_bytes(arenas),
        if target == Target::Cpu {
            "device and host arenas (the CPU device's memory is RAM)"
        } else {
            "pinned host memory"
        },
        fmt_bytes(arenas + whole),
        fmt_bytes(available)
    )
    .into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Alone, checkpoints, resumes, evaluations and `--out` go a block at a time and
    /// hold nothing of the whole model (a 2.2B model whose 26 GB of state is larger than
    /// this machine's RAM is not refused them); with ranks each still holds its shard or
    /// the gathered model, and is refused where that does not fit.
    #[test]
    fn alone_no_option_holds_the_whole_model_with_ranks_each_does() {
        let dir = std::path::PathBuf::from("/ck");
        let options = [
            TrainConfig {
                checkpoint_dir: Some(dir.clone()),
                ..TrainConfig::default()
            },
            TrainConfig {
                resume: Some(dir.clone()),
                ..TrainConfig::default()
            },
            TrainConfig {
                eval_every: 1,
                ..TrainConfig::default()
            },
            TrainConfig {
                out: Some(dir.clone()),
                ..TrainConfig::default()
            },
        ];
        let params = 2_200_000_000u64;
        for (cfg, (needle, per_rank)) in options.iter().zip([
            ("--checkpoint-dir", 12 * params / 2),
            ("--resume", 12 * params / 2),
            ("--eval-every", 16 * params),
            ("--out", 12 * params),
        ]) {
            assert_eq!(whole_model_bytes(cfg, params, 1), None, "{needle}");
            let (what, bytes) = whole_model_bytes(cfg, params, 2).expect(needle);
            assert!(what.starts_with(needle), "{what}");
            assert_eq!(bytes, per_rank, "{needle}");
        }
    }
}
