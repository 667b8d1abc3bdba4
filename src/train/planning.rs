//! A run's plan, made before anything is allocated ([`plan_run`]): the budgets (shared by
//! the ranks of one machine), this machine's rates (measured in half a second, rank 0's
//! on every rank), the plan under the configured policy or the one `auto` picks, and the
//! refusals of a run that would not fit: over a budget, over the drives' free space, or
//! over the memory this process may use.
//!
//! Not here: the budgets' and the plan's rules ([`crate::run_setup`], the engine's
//! planner).

use strata_engine::model::{Model, Target};
use strata_engine::plan::{CostModel, Plan, PlanInput, Prediction, StepShape};

use super::group::{Ranks, machine_id, shared_budgets};
use crate::process_memory::{ProcessMemory, Reads, memory_limit};
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
    let input = PlanInput::new(model, shape, budgets.budgets).with_cost(cost);
    let plan = plan_of(cfg, &input, cost)?;
    ranks.check_same_plan(&plan)?;
    check_process_memory(&plan, model, reads_of(cfg))?;
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
fn check_process_memory(plan: &Plan, model: &Model, reads: Reads) -> Result<(), Error> {
    let Some(limit) = memory_limit() else {
        return Ok(()); // nothing to judge by
    };
    Ok(ProcessMemory::of_run(plan, model, reads).check_fits(plan, &limit)?)
}

/// How a run of `cfg` reads its model between steps: to write it, to evaluate it.
pub fn reads_of(cfg: &TrainConfig) -> Reads {
    Reads {
        writes: cfg.out.is_some(),
        evaluates: cfg.eval_every > 0,
    }
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
