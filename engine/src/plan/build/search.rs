//! The planner's search around its stages: [`Plan::build`] plans a step once per choice
//! it weighs and keeps the best. First, with an automatic schedule and several
//! micro-batches, each order of the micro-batches (horizontal, vertical); within each,
//! where the policy allows, the plans that keep the first and last blocks' state in host
//! memory; then which layer blocks keep their saved activations on the device (all when
//! the device peak allows, else as many as fit, chosen by the FLOPs each saves per byte
//! it keeps, found by bisection) and whether the others offload theirs to host memory or
//! NVMe or recompute (by the cost model, within the budgets); then whether gradients
//! wait for the norm on NVMe (when the host budget needs it).
//!
//! Not here: the stages themselves (`frame.rs` to `assemble.rs`).

use super::assemble::{Stages, assemble};
use super::emit::Emitter;
use super::frame::Frame;
use super::homes::Homes;
use super::sequence::Sequence;
use super::step_buffers::StepBuffers;
use super::table::BufferTable;
use crate::model::Target;
use crate::plan::error::PlanError;
use crate::plan::ir::Plan;
use crate::plan::policy::{EdgesOnHost, PlanInput, Policy};
use crate::plan::shape::{GradSpill, Recompute, Schedule};
use crate::plan::tier::Tier;

impl Plan {
    /// Plans one training step of `input.model` under `policy`. Allocates nothing.
    /// Does not check the budgets: see [`Plan::check_fits`].
    ///
    /// Which layer blocks keep their saved activations follows
    /// [`StepShape::recompute`]: none ([`Recompute::All`]), all on the device
    /// ([`Recompute::None`]), all offloaded but those whose backward follows too soon
    /// ([`Recompute::Offload`]), or ([`Recompute::Auto`]) all on the device when the
    /// device peak then fits its budget, else the most that fit, in
    /// [`Plan::keep_order`]: the device peak grows with every block kept, so the count is
    /// found by bisection between keeping none and keeping all. The others then
    /// recompute, or offload their activations: all of them (with as many kept on the
    /// device as then fit), or as many as the host and NVMe budgets hold, the rest
    /// recomputing; an offloading plan is taken where it fits every budget and
    /// `input.cost` predicts it faster (or recomputing does not fit the device). When
    /// even keeping none is over the device budget, the plan keeps none (and
    /// [`Plan::check_fits`] refuses it, as a plan that recomputes everything).
    ///
    /// Then gradients spill to NVMe as [`StepShape::grad_spill`] says: with
    /// [`GradSpill::Auto`], when the plan is over the host budget and some block can
    /// spill ([`Plan::can_spill`]), the same plan is made again with every such block
    /// spilled, and kept if its host peak is lower.
    ///
    /// First of all, when the policy allows it ([`Policy::resident_edges`]), the plan
    /// keeping the first and last blocks' optimizer state in host memory and their
    /// parameters off NVMe: it is the plan if it fits every budget without spilling
    /// gradients. Of such plans, the first of these that recomputes no more blocks than
    /// the others: on the CPU device, parameters on the device (updated in place); on
    /// the host, with the first block's device copy serving the whole micro-batch (one
    /// fetch of the embedding where a tied head reads it too, not two); on the host,
    /// fetched for each use.
    ///
    /// Where the shape asks for the next step's first parameter fetches at the end of
    /// each step ([`StepShape::prefetch_next_step`]), the plan without them is taken
    /// instead when it fits where the plan with them does not, or recomputes or spills
    /// fewer blocks.
    ///
    /// All of this for the micro-batches' order [`StepShape::schedule`] names; with
    /// [`Schedule::Auto`], for both orders (one, horizontal, with a single micro-batch
    /// per step): the vertical plan where it fits every budget and the cost model
    /// (`input.cost`) predicts it faster than a horizontal plan that fits, else the
    /// horizontal plan.
    ///
    /// [`StepShape::recompute`]: crate::plan::StepShape::recompute
    /// [`StepShape::grad_spill`]: crate::plan::StepShape::grad_spill
    /// [`StepShape::schedule`]: crate::plan::StepShape::schedule
    /// [`StepShape::prefetch_next_step`]: crate::plan::StepShape::prefetch_next_step
    pub fn build(input: &PlanInput<'_>, policy: &dyn Policy) -> Result<Plan, PlanError> {
        let plan = Self::build_scheduled(input, policy)?;
        if !plan.fetches_next_step() {
            return Ok(plan);
        }
        // The next step's first fetches keep their buffers live across the boundary:
        // worth it only where that costs no fit, no recomputing and no spilling.
        let without = PlanInput {
            shape: input.shape.prefetching_next_step(false),
            ..*input
        };
        let other = Self::build_scheduled(&without, policy)?;
        let cost = |p: &Plan| (p.first_overflow().is_some(), p.recomputed(), p.spilled());
        Ok(if cost(&other) < cost(&plan) {
            other
        } else {
            plan
        })
    }

    /// [`Plan::build`] with the next step's first fetches as the shape says.
    fn build_scheduled(input: &PlanInput<'_>, policy: &dyn Policy) -> Result<Plan, PlanError> {
        if input.shape.schedule != Schedule::Auto {
            return Self::build_ordered(input, policy);
        }
        let ordered = |schedule: Schedule| {
            let input = PlanInput {
                shape: input.shape.scheduled(schedule),
                ..*input
            };
            Self::build_ordered(&input, policy)
        };
        let horizontal = ordered(Schedule::Horizontal)?;
        if input.shape.grad_accum == 1 {
            return Ok(horizontal);
        }
        let vertical = ordered(Schedule::Vertical)?;
        let fits = |plan: &Plan| plan.first_overflow().is_none();
        let seconds = |plan: &Plan| input.cost.predict(plan).step_seconds;
        Ok(
            if fits(&vertical) && (!fits(&horizontal) || seconds(&vertical) < seconds(&horizontal))
            {
                vertical
            } else {
                horizontal
            },
        )
    }

    /// [`Plan::build`] in the micro-batches' order the step's shape names.
    fn build_ordered(input: &PlanInput<'_>, policy: &dyn Policy) -> Result<Plan, PlanError> {
        if policy.resident_edges(input) {
            // In order of preference: on the CPU device the edges' parameters on the
            // device (its optimizer writes them in place: no copy at all), then on the
            // host with one device copy of the embedding per micro-batch, then with one
            // per use. The first that fits and recomputes no more blocks than the others.
            let mut candidates = Vec::new();
            if input.shape.target == Target::Cpu {
                candidates.push((Tier::Device, false));
            }
            candidates.extend([(Tier::Host, true), (Tier::Host, false)]);
            let plans: Vec<Plan> = candidates
                .into_iter()
                .filter_map(|(params, keep_first)| {
                    let edges = EdgesOnHost {
                        policy,
                        params,
                        keep_first,
                    };
                    Self::build_spilling(input, &edges)
                        .ok()
                        .filter(|plan| plan.first_overflow().is_none() && plan.spilled() == 0)
                })
                .collect();
            let fewest = plans.iter().map(Plan::recomputed).min();
            if let Some(plan) = plans
                .into_iter()
                .find(|plan| Some(plan.recomputed()) == fewest)
            {
                return Ok(plan);
            }
        }
        Self::build_spilling(input, policy)
    }

    /// [`Plan::build`] for `policy`'s homes as they are: recomputing and spilling as the
    /// step asks.
    fn build_spilling(input: &PlanInput<'_>, policy: &dyn Policy) -> Result<Plan, PlanError> {
        let always = input.shape.grad_spill == GradSpill::Always;
        let plan = Self::build_recomputing(input, policy, always)?;
        if input.shape.grad_spill != GradSpill::Auto
            || plan.peak[Tier::Host.index()] <= input.budgets.host
            || !(0..plan.homes.len()).any(|b| plan.can_spill(b))
        {
            return Ok(plan);
        }
        let offloaded: Vec<bool> = plan.saved_tier.iter().map(|&t| t != Tier::Device).collect();
        let spilled = Self::build_keeping(input, policy, plan.kept.clone(), &offloaded, true)?;
        Ok(
            if spilled.peak[Tier::Host.index()] < plan.peak[Tier::Host.index()] {
                spilled
            } else {
                plan
            },
        )
    }

    /// [`Plan::build`]'s choice of the blocks that keep their activations (and of those
    /// that offload them), with gradients spilled (where they can be) or not.
    fn build_recomputing(
        input: &PlanInput<'_>,
        policy: &dyn Policy,
        spill: bool,
    ) -> Result<Plan, PlanError> {
        let order = Self::keep_order(input);
        let len = order.len();
        // The first `count` blocks of `order` keep their activations on the device, the
        // last `offload` (the earliest layers, furthest from their backward) offload
        // them, those between recompute.
        let keeping = |count: usize, offload: usize| {
            let n = input.block_count();
            let (mut kept, mut offloaded) = (vec![false; n], vec![false; n]);
            for (i, &b) in order.iter().enumerate() {
                offloaded[b] = i >= len - offload;
                kept[b] = i < count || offloaded[b];
            }
            Self::build_keeping(input, policy, kept, &offloaded, spill)
        };
        match input.shape.recompute {
            Recompute::All => keeping(0, 0),
            Recompute::None => keeping(len, 0),
            Recompute::Offload => keeping(0, len),
            Recompute::Auto => {
                let all = keeping(len, 0)?;
                if Self::device_fits(&all, input) || order.is_empty() {
                    return Ok(all);
                }
                let (kept, recomputing) = Self::most_kept(input, len, |c| keeping(c, 0))?;
                // Offloading every block not kept, or (where the host or NVMe cannot
                // hold them all) as many as fit, the rest recomputing.
                let (_, offloading) = Self::most_kept(input, len, |c| keeping(c, len - c))?;
                let some = Self::most_offloaded(len - kept, |j| keeping(kept, j))?;
                Ok(Self::cheapest(
                    input,
                    recomputing,
                    [Some(offloading), some].into_iter().flatten(),
                ))
            }
        }
    }

    /// Whether `plan`'s device peak fits `input`'s device budget.
    fn device_fits(plan: &Plan, input: &PlanInput<'_>) -> bool {
        plan.peak[Tier::Device.index()] <= input.budgets.device
    }

    /// Of the plans `keeping(count)` makes for `count` in 0..`len`, the one keeping the
    /// most blocks on the device that fits its device budget, with that count, found by
    /// bisection (the device peak grows with each block kept): keeping none when even
    /// that does not fit.
    fn most_kept(
        input: &PlanInput<'_>,
        len: usize,
        keeping: impl Fn(usize) -> Result<Plan, PlanError>,
    ) -> Result<(usize, Plan), PlanError> {
        // Invariant: keeping `fits` blocks fits the device, keeping `over` does not.
        let mut best = keeping(0)?;
        if !Self::device_fits(&best, input) {
            return Ok((0, best));
        }
        let (mut fits, mut over) = (0, len);
        while over - fits > 1 {
            let mid = (fits + over) / 2;
            let plan = keeping(mid)?;
            if Self::device_fits(&plan, input) {
                (fits, best) = (mid, plan);
            } else {
                over = mid;
            }
        }
        Ok((fits, best))
    }

    /// Of the plans `offloading(count)` makes for `count` in 1..=`len`, the one
    /// offloading the most blocks that fits every budget, found by bisection (the host
    /// or NVMe peak grows with each block offloaded); none when even one does not fit.
    fn most_offloaded(
        len: usize,
        offloading: impl Fn(usize) -> Result<Plan, PlanError>,
    ) -> Result<Option<Plan>, PlanError> {
        let fits = |plan: &Plan| plan.first_overflow().is_none();
        if len == 0 {
            return Ok(None);
        }
        let mut best = offloading(1)?;
        if !fits(&best) {
            return Ok(None);
        }
        // Invariant: offloading `ok` blocks fits, offloading `over` does not.
        let (mut ok, mut over) = (1, len + 1);
        while over - ok > 1 {
            let mid = (ok + over) / 2;
            let plan = offloading(mid)?;
            if fits(&plan) {
                (ok, best) = (mid, plan);
            } else {
                over = mid;
            }
        }
        Ok(Some(best))
    }

    /// Of `recomputing` (the blocks not kept on the device recompute their forward) and
    /// `offloading` (plans in which some or all of them offload their activations to
    /// host memory or NVMe instead): the offloading plan the cost model (`input.cost`)
    /// predicts fastest of those that fit every budget, where the recomputing one does
    /// not fit the device or it is predicted faster than that; else the recomputing one.
    fn cheapest(
        input: &PlanInput<'_>,
        recomputing: Plan,
        offloading: impl Iterator<Item = Plan>,
    ) -> Plan {
        let seconds = |plan: &Plan| input.cost.predict(plan).step_seconds;
        let best = offloading
            .filter(|plan| plan.first_overflow().is_none())
            .map(|plan| (seconds(&plan), plan))
            .min_by(|(a, _), (b, _)| a.total_cmp(b));
        match best {
            Some((t, plan))
                if !Self::device_fits(&recomputing, input) || t < seconds(&recomputing) =>
            {
                plan
            }
            _ => recomputing,
        }
    }

    /// The layer blocks in the order [`Recompute::Auto`] keeps them, by the cost model's
    /// trade: keeping a block saves recomputing its forward (its backward's FLOPs less
    /// its saved backward's) and costs its saved activations' bytes on the device, so
    /// blocks that save the most FLOPs per byte come first; among equals (every layer of
    /// a family is the same), the later block first, whose saved activations live the
    /// shortest (from its forward to its backward, around the head).
    pub fn keep_order(input: &PlanInput<'_>) -> Vec<usize> {
        let model = input.model;
        let Ok(dims) = model.shape(input.shape.batch, input.shape.seq) else {
            return Vec::new();
        };
        let (target, dtype) = (input.shape.target, input.shape.device_dtype());
        let mut order: Vec<(usize, f64)> = (0..input.block_count())
            .filter_map(|b| {
                let bytes = model.saved_bytes(b, dims, target, dtype);
                (bytes > 0).then(|| (b, model.recompute_flops(b, dims) / bytes as f64))
            })
            .collect();
        order.sort_by(|(a, fa), (b, fb)| fb.total_cmp(fa).then(b.cmp(a)));
        order.into_iter().map(|(b, _)| b).collect()
    }

    /// Plans one step in which the layer blocks marked in `kept` keep their saved
    /// activations (off the device between the forward and the backward, those marked
    /// in `offloaded`) and the others recompute.
    fn build_keeping(
        input: &PlanInput<'_>,
        policy: &dyn Policy,
        kept: Vec<bool>,
        offloaded: &[bool],
        spill: bool,
    ) -> Result<Plan, PlanError> {
        let frame = Frame::new(input, policy)?;
        let seq = Sequence::new(&frame);
        let apart = |b| seq.forward_to_backward(b);
        let frame = frame.keeping(kept, offloaded, apart).spilling(spill);
        let mut table = BufferTable::default();
        let homes = Homes::plan(&frame, &mut table);
        let (step, fetches) = StepBuffers::plan(&frame, &homes, &seq, &mut table);
        let ops = Emitter::emit(&frame, &homes, (&step, fetches), &seq, &mut table);
        Ok(assemble(Stages {
            frame,
            homes,
            saved_bytes: step.saved_bytes,
            table,
            ops,
        }))
    }
}
