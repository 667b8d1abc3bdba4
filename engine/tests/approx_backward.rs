//! Approximate backward passes (`Model::approximate`, `--approx-backward`), on the CPU
//! device:
//! - models with a few-bit GELU, sketched products or both train bit for bit alike under
//!   every policy and depth, whether the plan keeps, offloads or recomputes the layers'
//!   activations, with 2 micro-batches in each order and under chaos: each micro-batch's
//!   sketch is the same in its forward and its backward whatever the plan;
//! - sketched weight gradients are unbiased: over many step seeds their mean converges
//!   to the exact gradient as fast as their own spread says it should, while every
//!   gradient the sketches do not estimate is the exact model's, bit for bit;
//! - an approximate model trains otherwise than the exact one, and each step draws its
//!   own sketches;
//! - randomized gradients are refused on a GPU training in bf16.

mod model_support;

use model_support::training::{Run, adamw_clipped, assert_same, small_gpt2, train, train_plan};
use model_support::{UNLIMITED, all_policies, cpu_runner, forward_backward, random_batch};
use strata_engine::kernels::ops::Cpu;
use strata_engine::model::{Llama, LlamaConfig, Model, Target};
use strata_engine::plan::{
    AllOnDevice, Plan, PlanInput, Precision, Recompute, Schedule, StepShape,
};

/// `model` with the backward `text` names.
fn approx(model: &Model, text: &str) -> Model {
    model.approximate(text.parse().unwrap()).unwrap()
}

fn small_llama() -> Model {
    Model::of(Llama::new(LlamaConfig::llama(2, 48, 80, 4, 2, 96, 32)).unwrap())
}

/// The steps compared, in groups that train the same batches: one micro-batch kept,
/// recomputed or offloaded; two micro-batches in each order.
fn groups() -> Vec<Vec<(&'static str, StepShape)>> {
    let one = StepShape::cpu(2, 8);
    let two = StepShape {
        grad_accum: 2,
        ..one
    };
    vec![
        vec![
            ("kept", one.recomputing(Recompute::None)),
            ("recomputed", one.recomputing(Recompute::All)),
            ("offloaded", one.recomputing(Recompute::Offload)),
        ],
        vec![
            (
                "2 horizontal, kept",
                two.scheduled(Schedule::Horizontal)
                    .recomputing(Recompute::None),
            ),
            (
                "2 horizontal, recomputed",
                two.scheduled(Schedule::Horizontal)
                    .recomputing(Recompute::All),
            ),
            (
                "2 vertical, recomputed",
                two.scheduled(Schedule::Vertical)
                    .recomputing(Recompute::All),
            ),
            (
                "2 vertical, offloaded",
                two.scheduled(Schedule::Vertical)
                    .recomputing(Recompute::Offload),
            ),
        ],
    ]
}

#[test]
fn approximate_backwards_train_bit_identically_under_every_policy() {
    let (gpt, llama) = (small_gpt2(), small_llama());
    let models = [
        (
            "GPT-2 gelu:2,linear:0.5",
            approx(&gpt, "gelu:2,linear:0.5"),
            true,
        ),
        ("GPT-2 gelu:3", approx(&gpt, "gelu:3"), false),
        ("GPT-2 attn:0.25", approx(&gpt, "attn:0.25"), false),
        ("Llama linear:0.5", approx(&llama, "linear:0.5"), false),
        (
            "Llama silu:2,mlp:0.5",
            approx(&llama, "silu:2,mlp:0.5"),
            true,
        ),
    ];
    let params = adamw_clipped(0.0);
    for (name, model, chaos) in &models {
        for group in groups() {
            let reference = train(model, group[0].1, &AllOnDevice, 3, params, None);
            for (what, shape) in &group {
                for policy in all_policies() {
                    let input = PlanInput::new(model, *shape, UNLIMITED);
                    let plan = Plan::build(&input, policy.as_ref()).unwrap();
                    let seeds: &[Option<u64>] = if *chaos { &[None, Some(1)] } else { &[None] };
                    for &seed in seeds {
                        let run = train_plan(model, plan.clone(), 3, params, seed);
                        let case = format!("{name}, {what}, {}, chaos {seed:?}", policy.name());
                        assert_same(&reference, &run, &case);
                    }
                }
            }
        }
    }
}

#[test]
fn an_approximate_backward_trains_otherwise_than_the_exact_one() {
    let gpt = small_gpt2();
    let shape = StepShape::cpu(2, 8);
    let params = adamw_clipped(0.0);
    let exact = train(&gpt, shape, &AllOnDevice, 3, params, None);
    let llama = small_llama();
    let exact_llama = train(&llama, shape, &AllOnDevice, 3, params, None);
    for (model, exact, text) in [
        (&gpt, &exact, "gelu:3"),
        (&gpt, &exact, "attn:0.5"),
        (&gpt, &exact, "mlp:0.5"),
        (&gpt, &exact, "gelu:2,linear:0.5"),
        (&llama, &exact_llama, "silu:3"),
        (&llama, &exact_llama, "linear:0.5"),
    ] {
        let run: Run = train(&approx(model, text), shape, &AllOnDevice, 3, params, None);
        assert_eq!(
            exact.losses[0], run.losses[0],
            "{text}: the forward is the exact model's"
        );
        assert_ne!(exact.losses[2], run.losses[2], "{text}: trained alike");
    }
}

#[test]
fn each_step_draws_its_own_sketches() {
    // With the learning rate 0 the parameters stay, and every step computes the same
    // batches: an exact gradient is the same each step, so AdamW's first moment after
    // two steps is (1 + beta1) times the first step's; a sketched one is not.
    let gpt = small_gpt2();
    let beta1 = 0.9;
    let mut params = adamw_clipped(0.0);
    params.adam.lr = 0.0;
    params.adam.weight_decay = 0.0;
    params.adam.beta1 = beta1;
    let mask = estimated(&gpt, &["attn.c_attn.weight"]);
    // Estimated elements whose second moment is not (1 + beta1) times the first.
    let changed = |model: &Model, shape: StepShape| -> (usize, usize) {
        let [one, two] = [1, 2].map(|steps| train(model, shape, &AllOnDevice, steps, params, None));
        let (mut differ, mut total) = (0, 0);
        for (b, (m1, m2)) in one.m.iter().zip(&two.m).enumerate() {
            for (i, (&a, &b2)) in m1.iter().zip(m2).enumerate() {
                if mask[b][i] && a != 0.0 {
                    total += 1;
                    let want = (1.0 + beta1) * f64::from(a);
                    differ += usize::from((f64::from(b2) - want).abs() > 1e-3 * want.abs());
                }
            }
        }
        (differ, total)
    };
    let one = StepShape::cpu(2, 8);
    let (differ, total) = changed(&gpt, one);
    assert!(
        total > 0 && differ == 0,
        "exact: {differ} of {total} differ"
    );
    let sketched = approx(&gpt, "attn:0.5");
    let (differ, total) = changed(&sketched, one);
    assert!(differ > total / 2, "steps: {differ} of {total} differ");
}

#[test]
fn the_sketched_product_after_a_few_bit_gelu_is_unbiased() {
    // With the few-bit GELU the MLP's c_proj is sketched too. Its input, the GELU's
    // output, is exact in the forward, and the last layer's output gradient comes from
    // the head, exact: its weight gradient's estimates average to the exact one.
    let exact_model = small_gpt2();
    let model = approx(&exact_model, "gelu:3,mlp:0.5");
    let last = exact_model.layers();
    let mask: Vec<Vec<bool>> = estimated(&model, &[&format!("h.{}.mlp.c_proj.weight", last - 1)]);
    check_unbiased(&exact_model, &model, &mask, false);
}

/// The gradient elements of `model` whose tensors' names end with one of `names`.
fn estimated(model: &Model, names: &[&str]) -> Vec<Vec<bool>> {
    model
        .blocks()
        .iter()
        .map(|b| {
            let mut mask = vec![false; b.len];
            for t in &b.tensors {
                if names.iter().any(|n| t.name.ends_with(n)) {
                    mask[t.slot.range()].fill(true);
                }
            }
            mask
        })
        .collect()
}

#[test]
fn sketched_weight_gradients_are_unbiased_and_every_other_gradient_is_exact() {
    let cases = [
        (small_gpt2(), &["attn.c_attn.weight", "mlp.c_fc.weight"][..]),
        (
            small_llama(),
            &[
                "q_proj.weight",
                "k_proj.weight",
                "v_proj.weight",
                "gate_proj.weight",
                "up_proj.weight",
            ][..],
        ),
    ];
    for (exact_model, names) in cases {
        let model = approx(&exact_model, "linear:0.5");
        let mask = estimated(&model, names);
        check_unbiased(&exact_model, &model, &mask, true);
    }
}

/// Over many sketch seeds, `model`'s gradients at `mask` average to `exact_model`'s as
/// fast as their own spread says an unbiased estimate's would; with `others_exact`,
/// every other gradient is `exact_model`'s bit for bit.
fn check_unbiased(exact_model: &Model, model: &Model, mask: &[Vec<bool>], others_exact: bool) {
    let (batch, seq) = (2, 16);
    let cpu = Cpu::default();
    let params = exact_model.init_params(7);
    let (x, y) = random_batch(model.vocab(), batch * seq, 3);
    let mut runner = cpu_runner(exact_model, batch, seq, cpu);
    runner.load(&params).unwrap();
    let exact = forward_backward(&mut runner, &x, &y);
    let mut runner = cpu_runner(model, batch, seq, cpu);
    runner.load(&params).unwrap();
    let seeds = 256;
    let mut sum: Vec<Vec<f64>> = exact.grads.iter().map(|g| vec![0.0; g.len()]).collect();
    let mut squared_error = 0.0;
    for seed in 0..seeds {
        runner.set_sketch_seed(seed);
        let out = forward_backward(&mut runner, &x, &y);
        assert_eq!(out.loss.to_bits(), exact.loss.to_bits(), "the forward");
        for (b, (got, want)) in out.grads.iter().zip(&exact.grads).enumerate() {
            for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                if mask[b][i] {
                    sum[b][i] += f64::from(g);
                    squared_error += (f64::from(g) - f64::from(w)).powi(2);
                } else if others_exact {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "block {b} element {i}: {g} vs {w}"
                    );
                }
            }
        }
    }
    // One estimate's mean squared error, as measured; an unbiased estimator's mean of
    // `seeds` is off by about that over `seeds`.
    let per_estimate = squared_error / seeds as f64;
    let (mut mean_error, mut norm) = (0.0, 0.0);
    for (b, want) in exact.grads.iter().enumerate() {
        for (i, &w) in want.iter().enumerate() {
            if mask[b][i] {
                mean_error += (sum[b][i] / seeds as f64 - f64::from(w)).powi(2);
                norm += f64::from(w).powi(2);
            }
        }
    }
    let name = format!("{} {}", exact_model.describe(), model.approximation());
    // Shown with --nocapture: one estimate's mean squared error over the squared norm.
    eprintln!(
        "{name}: E‖estimate − exact‖² / ‖exact‖² = {:.3}",
        per_estimate / norm
    );
    assert!(
        norm > 0.0 && per_estimate > 0.0,
        "{name}: nothing estimated"
    );
    assert!(
        mean_error < 2.0 * per_estimate / seeds as f64,
        "{name}: the mean of {seeds} estimates is off by {mean_error:.3e} (squared); \
         unbiased, about {:.3e}; the gradient's squared norm is {norm:.3e}",
        per_estimate / seeds as f64
    );
}

#[test]
fn randomized_gradients_are_refused_on_a_gpu_training_in_bf16() {
    let model = approx(&small_gpt2(), "mlp:0.5");
    let shape = StepShape {
        precision: Precision::Bf16,
        ..StepShape::cpu(2, 8)
    }
    .on(Target::Cuda);
    let input = PlanInput::new(&model, shape, UNLIMITED);
    let err = Plan::build(&input, &AllOnDevice).unwrap_err().to_string();
    assert!(err.contains("--dtype fp32"), "{err}");
    // The few-bit GELU alone is built for every dtype.
    let fewbit = approx(&small_gpt2(), "gelu:3");
    let input = PlanInput::new(&fewbit, shape, UNLIMITED);
    Plan::build(&input, &AllOnDevice).unwrap();
}
