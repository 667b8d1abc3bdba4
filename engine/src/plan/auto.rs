//! [`Auto`]: plans every built-in policy at several depths and checkpoint tiers, and
//! picks the fastest that fits the budgets by the cost model.
//!
//! Not here: the policies themselves (`policy.rs`), the planner (`build/`) or the cost
//! model (`cost.rs`).

use super::cost::{CostModel, Prediction};
use super::error::PlanError;
use super::ir::Plan;
use super::policy::{AllOnDevice, CpuOffload, NvmeOffload, ParamOffload, PlanInput, Policy};
use super::tier::Tier;

/// The fastest of the built-in plans that fits the budgets, by the cost model.
#[derive(Debug, Clone, Default)]
pub struct Auto {
    /// The rates the choice is predicted with.
    pub cost: CostModel,
}

/// What [`Auto::choose`] picked, its plan, and every candidate it considered.
pub type Choice = (Box<dyn Policy>, Plan, Vec<Candidate>);

/// One candidate [`Auto`] considered.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The policy's name.
    pub policy: String,
    /// Peak bytes per tier.
    pub peak: [u64; 3],
    /// Whether it fits the budgets (else the first tier it overflows).
    pub fits: Result<(), Tier>,
    /// Predicted step time.
    pub predicted: Prediction,
}

impl Auto {
    /// The candidates, in order of preference when predicted equal: everything on the
    /// device first, then less and less resident.
    pub fn candidates(input: &PlanInput<'_>) -> Vec<Box<dyn Policy>> {
        let mut out: Vec<Box<dyn Policy>> = vec![Box::new(AllOnDevice), Box::new(CpuOffload)];
        let ckpt_tiers: &[Tier] = if input.budgets.nvme > 0 {
            &[Tier::Device, Tier::Host, Tier::Nvme]
        } else {
            &[Tier::Device, Tier::Host]
        };
        for depth in [2, 1, 3] {
            for &checkpoints in &ckpt_tiers[..2] {
                out.push(Box::new(ParamOffload { depth, checkpoints }));
            }
        }
        if input.budgets.nvme > 0 {
            for depth in [2, 1, 3, 4] {
                for &checkpoints in ckpt_tiers {
                    out.push(Box::new(NvmeOffload { depth, checkpoints }));
                }
            }
        }
        out
    }

    /// Plans every candidate (weighing each plan's choices by [`Auto::cost`] too), and
    /// returns the fastest that fits with every candidate's figures; the error is the
    /// best candidate's refusal (with its suggestions) when none fits.
    pub fn choose(&self, input: &PlanInput<'_>) -> Result<Choice, PlanError> {
        // The rates that choose among the policies also weigh each plan's choices.
        let input = &input.with_cost(self.cost);
        let mut best: Option<(Box<dyn Policy>, Plan, f64)> = None;
        // The refusal to report when none fits: the candidate closest to fitting, with
        // the fewest tiers over budget, and among those the most offloaded (the last).
        let mut closest: Option<Plan> = None;
        let mut seen = Vec::new();
        let mut first_error = None;
        for policy in Self::candidates(input) {
            let plan = match Plan::build(input, policy.as_ref()) {
                Ok(plan) => plan,
                Err(e) => {
                    first_error.get_or_insert(e);
                    continue;
                }
            };
            let predicted = self.cost.predict(&plan);
            let fits = plan.first_overflow();
            seen.push(Candidate {
                policy: plan.policy.clone(),
                peak: plan.peak,
                fits: fits.map_or(Ok(()), Err),
                predicted,
            });
            if fits.is_some() {
                if closest
                    .as_ref()
                    .is_none_or(|c| plan.overflow_count() <= c.overflow_count())
                {
                    closest = Some(plan);
                }
            } else if best
                .as_ref()
                .is_none_or(|(_, _, t)| predicted.step_seconds < *t * 0.999)
            {
                best = Some((policy, plan, predicted.step_seconds));
            }
        }
        match (best, closest) {
            (Some((policy, plan, _)), _) => Ok((policy, plan, seen)),
            (None, Some(plan)) => Err(plan.check_fits(input).expect_err("no candidate fits")),
            (None, None) => Err(first_error.unwrap_or(PlanError::Invalid(
                "no built-in policy can plan this model".into(),
            ))),
        }
    }
}
