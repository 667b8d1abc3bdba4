//! Whether a plan fits its budgets, and when it does not, the refusal: which tier, by how
//! much, and what would fit instead (recomputing some blocks' activations rather than
//! keeping them all, a lower prefetch depth, a smaller micro-batch with more accumulation,
//! other built-in policies).

use super::auto::Auto;
use super::error::{PlanError, Shortfall, fmt_bytes};
use super::ir::{BufKind, ExtentKind, ExtentSide, Plan};
use super::policy::{PlanInput, Policy};
use super::shape::{GradSpill, Recompute, Schedule, StepShape};
use super::tier::{TensorClass, Tier};
use crate::model::BlockKind;

impl Plan {
    /// The tiers whose peak exceeds their budget, fastest tier first.
    pub fn short_tiers(&self) -> impl Iterator<Item = Tier> + '_ {
        Tier::ALL
            .into_iter()
            .filter(|t| self.peak[t.index()] > self.budget(*t))
    }

    /// The first tier whose peak exceeds its budget, if any.
    pub fn first_overflow(&self) -> Option<Tier> {
        self.short_tiers().next()
    }

    fn budget(&self, tier: Tier) -> u64 {
        match tier {
            Tier::Device => self.budgets.device,
            Tier::Host => self.budgets.host,
            Tier::Nvme => self.budgets.nvme,
        }
    }

    /// How many tiers are over budget.
    pub fn overflow_count(&self) -> usize {
        self.short_tiers().count()
    }

    /// Total bytes over budget, across tiers (0 when it fits).
    pub fn shortfall(&self) -> u64 {
        Tier::ALL
            .into_iter()
            .map(|t| self.peak[t.index()].saturating_sub(self.budget(t)))
            .sum()
    }

    /// Bytes a tier holds for a class, summed over blocks (what `strata plan` reports):
    /// homes and per-step buffers of that class at their largest.
    pub fn bytes_by_class(&self) -> Vec<(TensorClass, [u64; 3])> {
        let mut out: Vec<(TensorClass, [u64; 3])> =
            TensorClass::ALL.iter().map(|&c| (c, [0; 3])).collect();
        for b in &self.buffers {
            let class = if b.name.starts_with("params") {
                TensorClass::Params
            } else if b.name.starts_with("grads") {
                TensorClass::Grads
            } else if b.name.starts_with("adam") {
                TensorClass::Optimizer
            } else if b.name.starts_with("ckpt") {
                TensorClass::Checkpoints
            } else {
                continue;
            };
            let bytes = match b.kind {
                BufKind::Extent { group, side } => {
                    if side == ExtentSide::Next {
                        0
                    } else {
                        self.extent_groups[group].stored_bytes()
                    }
                }
                _ => b.bytes,
            };
            out.iter_mut().find(|(c, _)| *c == class).expect("listed").1[b.tier.index()] += bytes;
        }
        // Shadow paging's spares, with the class of the groups of their size.
        for &(bytes, n) in &self.spares {
            if let Some(g) = self
                .extent_groups
                .iter()
                .find(|g| g.kind == ExtentKind::Shadow && g.bytes == bytes)
            {
                out.iter_mut()
                    .find(|(c, _)| *c == g.class)
                    .expect("listed")
                    .1[Tier::Nvme.index()] += g.allocated_bytes() * n as u64;
            }
        }
        out
    }

    /// `Ok` when every tier's peak is within its budget; otherwise the refusal, naming
    /// the tier, the shortfall, and what would fit: a lower prefetch depth, a smaller
    /// micro-batch, or another built-in policy.
    pub fn check_fits(&self, input: &PlanInput<'_>) -> Result<(), PlanError> {
        if self.first_overflow().is_none() {
            return Ok(());
        }
        let mut suggestions: Vec<String> = [
            self.recompute_suggestion(input),
            self.schedule_suggestion(input),
            self.spill_suggestion(input),
            self.depth_suggestion(input),
            self.batch_suggestion(input),
            self.policies_suggestion(input),
        ]
        .into_iter()
        .flatten()
        .collect();
        let short: Vec<Shortfall> = self
            .short_tiers()
            .map(|t| Shortfall {
                tier: t,
                need_bytes: self.peak[t.index()],
                budget_bytes: self.budget(t),
            })
            .collect();
        if suggestions.is_empty() {
            let raise: Vec<String> = short
                .iter()
                .map(|s| {
                    format!(
                        "the {} budget to at least {}",
                        s.tier,
                        fmt_bytes(s.need_bytes)
                    )
                })
                .collect();
            suggestions.push(format!("raise {}", raise.join(" and ")));
        }
        Err(PlanError::DoesNotFit {
            policy: self.policy.clone(),
            short,
            suggestions,
        })
    }

    /// This plan's homes at its own depth, to plan again with another step shape.
    fn same_homes(&self) -> FixedDepth {
        self.at_depth(self.depth)
    }

    /// This plan's homes at prefetch depth `depth`.
    fn at_depth(&self, depth: usize) -> FixedDepth {
        FixedDepth {
            name: self.policy.clone(),
            homes: self.homes.clone(),
            depth,
        }
    }

    /// Keeping every block's activations was asked for and is what overflows the
    /// device: what they take, and whether recomputing some would fit.
    fn recompute_suggestion(&self, input: &PlanInput<'_>) -> Option<String> {
        if input.shape.recompute != Recompute::None
            || !self.short_tiers().any(|t| t == Tier::Device)
            || self.saved_total_bytes() == 0
        {
            return None;
        }
        let kept = self.kept.iter().filter(|&&k| k).count();
        let mut text = format!(
            "keeping the activations of all {kept} blocks (--recompute none) takes {} \
             of the device",
            fmt_bytes(self.saved_total_bytes())
        );
        let auto = PlanInput {
            shape: input.shape.recomputing(Recompute::Auto),
            ..*input
        };
        let device = |p: &Plan| p.peak[Tier::Device.index()] <= input.budgets.device;
        match Plan::build(&auto, &self.same_homes()).ok().filter(device) {
            Some(plan) => {
                text += &format!(
                    "; with --recompute auto {}, recomputing {}",
                    if plan.first_overflow().is_none() {
                        "it fits"
                    } else {
                        "the device fits"
                    },
                    plan.recomputed_of()
                )
            }
            None => text += "; recomputing every block does not fit the device either",
        }
        Some(text)
    }

    /// One order of the micro-batches was asked for where the other fits: vertical's
    /// checkpoints of every micro-batch live at once, horizontal's partial sums of every
    /// block's gradients.
    fn schedule_suggestion(&self, input: &PlanInput<'_>) -> Option<String> {
        let (other, why) = match input.shape.schedule {
            Schedule::Vertical => (
                Schedule::Horizontal,
                "each micro-batch through the whole model in turn, the checkpoints of one \
                 micro-batch live at a time",
            ),
            Schedule::Horizontal => (
                Schedule::Vertical,
                "every micro-batch through a block before the next, one block's sum of the \
                 micro-batches' gradients lives at a time",
            ),
            Schedule::Auto => return None,
        };
        let shape = input.shape.scheduled(other);
        (input.shape.grad_accum > 1 && fits(input, shape, &self.same_homes()))
            .then(|| format!("with --schedule {other} it fits ({why})"))
    }

    /// Gradients held for the norm on the host, where they could wait on NVMe.
    fn spill_suggestion(&self, input: &PlanInput<'_>) -> Option<String> {
        let could = input.shape.grad_spill == GradSpill::Never
            && self.short_tiers().any(|t| t == Tier::Host)
            && (0..self.homes.len()).any(|b| self.can_spill(b));
        let shape = input.shape.spilling(GradSpill::Always);
        (could && fits(input, shape, &self.same_homes())).then(|| {
            "with the gradients waiting for the norm on NVMe it fits (--spill-grads auto)"
                .to_string()
        })
    }

    /// The same policy family at a lower depth.
    fn depth_suggestion(&self, input: &PlanInput<'_>) -> Option<String> {
        (1..self.depth)
            .rev()
            .find(|&depth| fits(input, input.shape, &self.at_depth(depth)))
            .map(|depth| format!("prefetch depth {depth} fits (--prefetch {depth})"))
    }

    /// A smaller micro-batch, with more accumulation: the same tokens per step.
    fn batch_suggestion(&self, input: &PlanInput<'_>) -> Option<String> {
        let mut batch = input.shape.batch;
        while batch > 1 {
            batch /= 2;
            let shape = StepShape {
                batch,
                grad_accum: input.shape.grad_accum * (input.shape.batch / batch).max(1),
                ..input.shape
            };
            if fits(input, shape, &self.same_homes()) {
                return Some(format!(
                    "batch {batch} with --grad-accum {} fits (same tokens per step)",
                    shape.grad_accum
                ));
            }
        }
        None
    }

    /// Other built-in policies that fit, by family.
    fn policies_suggestion(&self, input: &PlanInput<'_>) -> Option<String> {
        let mut others = Vec::new();
        for policy in Auto::candidates(input) {
            if policy.name() != self.policy && fits(input, input.shape, policy.as_ref()) {
                let name = policy.name();
                let family = name.split('(').next().unwrap_or(&name).to_string();
                if !others.contains(&family) {
                    others.push(family);
                }
            }
        }
        (!others.is_empty()).then(|| format!("policies that fit: {}", others.join(", ")))
    }
}

/// Whether `policy` fits every budget of `input` in a step of `shape`.
fn fits(input: &PlanInput<'_>, shape: StepShape, policy: &dyn Policy) -> bool {
    let alt = PlanInput { shape, ..*input };
    Plan::build(&alt, policy).is_ok_and(|p| p.first_overflow().is_none())
}

/// A plan's homes with another prefetch depth (for suggestions).
#[derive(Debug)]
struct FixedDepth {
    name: String,
    homes: Vec<[Tier; 4]>,
    depth: usize,
}

impl Policy for FixedDepth {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn home(&self, input: &PlanInput<'_>, block: usize, class: TensorClass) -> Tier {
        let h = self.homes[block];
        match class {
            TensorClass::Params => h[0],
            TensorClass::Grads => h[1],
            TensorClass::Optimizer => h[2],
            TensorClass::Checkpoints => {
                if matches!(input.block_kind(block), BlockKind::Transformer { .. }) {
                    h[3]
                } else {
                    Tier::Device
                }
            }
        }
    }
    fn prefetch_depth(&self, _: &PlanInput<'_>) -> usize {
        self.depth
    }
}
