//! The Llama family against PyTorch: `tests/data/llama-tiny` (a `LlamaForCausalLM` with
//! an untied head) and `tests/data/qwen2-tiny` (a `Qwen2ForCausalLM` with a tied head and
//! q/k/v biases), and `tests/data/mistral-window-tiny` and `tests/data/qwen2-window-tiny`
//! (a sliding window shorter than the sequence: every layer's, and Qwen's from
//! `max_window_layers` on), made in float32 by transformers (see their READMEs), loaded
//! from their `config.json` and `model.safetensors`.
//!
//! 1. Step 0 on the CPU device through a whole-model runner: logits, the loss, the
//!    evaluation losses and every gradient with ‖out − ref‖ / ‖ref‖ < 1e-5, on every
//!    instruction set this CPU has, with one and two threads, recomputing each layer's
//!    forward in the backward and reading what the forward saved (bit-identical).
//! 2. Three AdamW steps through the executor (the golden data's hyper-parameters, from
//!    its `meta.json`): the global and the worst tensor's error against the float64
//!    replay (`final64.safetensors`) within 2x PyTorch fp32's own, and the final
//!    parameters bit-identical under every built-in policy, prefetch depth and chaos
//!    seed.

mod model_support;

use std::collections::HashMap;
use std::path::Path;

use model_support::{
    CHAOS, UNLIMITED, all_policies, data_dir, forward_backward_both_ways, read_f32_tensors,
    read_f64_tensors, rel_err,
};
use strata_engine::exec::{ExecConfig, Executor, Runner, StepParams};
use strata_engine::kernels::adamw::AdamW;
use strata_engine::kernels::isa::Isa;
use strata_engine::kernels::ops::Cpu;
use strata_engine::model::Model;
use strata_engine::model::data::{Batch, TokenData};
use strata_engine::model::weights::{PretrainedBlocks, load_config, load_pretrained};
use strata_engine::plan::{AllOnDevice, Plan, PlanInput, Policy, Recompute, StepShape};

const B: usize = 2;
const T: usize = 16;
const TOLERANCE: f64 = 1e-5;
const MODELS: [&str; 4] = [
    "llama-tiny",
    "qwen2-tiny",
    "mistral-window-tiny",
    "qwen2-window-tiny",
];

fn batch(model: &Model, data: &TokenData, step: usize) -> Batch {
    let mut batch = Batch::default();
    data.read_batch(step, B, T, model.vocab(), &mut batch)
        .unwrap();
    batch
}

#[test]
fn reading_a_block_at_a_time_gives_the_files_tensors() {
    for name in MODELS {
        let model = load_config(&data_dir(name).join("config.json")).unwrap();
        let blocks = PretrainedBlocks::open(&data_dir(name), &model).unwrap();
        let file = read_f32_tensors(&data_dir(name).join("model.safetensors"));
        let family = model.family();
        for (b, spec) in model.blocks().iter().enumerate() {
            let block = blocks.read_block(b).unwrap();
            assert_eq!(block.len(), spec.len, "{name}: block {b}");
            for t in &spec.tensors {
                let stored = file
                    .get(&format!("{}{}", family.hf_prefix(b), t.name))
                    .or_else(|| file.get(&t.name))
                    .unwrap_or_else(|| panic!("{name}: {} is in the file", t.name));
                assert!(
                    block[t.slot.range()]
                        .iter()
                        .zip(stored)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{name}: block {b}'s {}",
                    t.name
                );
            }
        }
        // The same as the whole load.
        let (_, params) = load_pretrained(&data_dir(name)).unwrap();
        assert!(
            params
                .iter()
                .enumerate()
                .all(|(b, p)| *p == blocks.read_block(b).unwrap())
        );
    }
    // A folder whose weights do not match its config.json fails when opened, naming
    // the tensor, before any block is read.
    let dir = tempfile::tempdir().unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(data_dir("llama-tiny").join(file), dir.path().join(file)).unwrap();
    }
    let config = dir.path().join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    json["intermediate_size"] = (json["intermediate_size"].as_u64().unwrap() * 2).into();
    std::fs::write(&config, json.to_string()).unwrap();
    let model = load_config(&config).unwrap();
    let err = PretrainedBlocks::open(dir.path(), &model)
        .err()
        .expect("a mismatch");
    assert!(err.to_string().contains("mlp"), "{err}");
}

#[test]
fn both_models_load_as_their_family_with_their_hugging_face_names() {
    let (llama, _) = load_pretrained(&data_dir("llama-tiny")).unwrap();
    assert_eq!(llama.family().name(), "llama");
    assert!(llama.find_tensor("lm_head.weight").is_some());
    assert_eq!(llama.tied(llama.blocks().len() - 1), None);
    let (qwen, _) = load_pretrained(&data_dir("qwen2-tiny")).unwrap();
    assert_eq!(qwen.family().name(), "qwen2");
    assert!(qwen.find_tensor("lm_head.weight").is_none());
    assert!(
        qwen.find_tensor("model.layers.1.self_attn.k_proj.bias")
            .is_some()
    );
    assert_eq!(qwen.tied(qwen.blocks().len() - 1), Some(0));
    // What training does not change is written back as it was read.
    let source: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(data_dir("qwen2-tiny").join("config.json")).unwrap(),
    )
    .unwrap();
    let written = qwen.family().hf_config();
    for key in [
        "rope_parameters",
        "layer_types",
        "bos_token_id",
        "max_window_layers",
    ] {
        assert_eq!(written[key], source[key], "{key}");
    }
}

#[test]
fn step_zero_matches_pytorch_on_every_isa_and_thread_count() {
    for name in MODELS {
        let dir = data_dir(name);
        let (model, params) = load_pretrained(&dir).unwrap();
        let expected = read_f32_tensors(&dir.join("expected.safetensors"));
        let data = TokenData::open(&dir.join("tokens.bin")).unwrap();
        let step0 = batch(&model, &data, 0);
        let mut checked = 0;
        for isa in Isa::supported() {
            for threads in [1, 2] {
                let cpu = Cpu { isa, threads };
                let what = format!("{name} {isa} x{threads}: recomputing vs saved activations");
                let (x, y) = (&step0.inputs, &step0.targets);
                let out = &forward_backward_both_ways(&model, &params, B, T, cpu, x, y, &what);
                let logits_err = rel_err(&out.logits, &expected["logits0"]);
                let loss_err = rel_err(&[out.loss], &expected["losses"][..1]);
                let mut worst = (0.0f64, String::new());
                for (block, g) in model.blocks().iter().zip(&out.grads) {
                    for t in &block.tensors {
                        let key = format!("grad0.{}", t.name);
                        let err = rel_err(&g[t.slot.range()], &expected[&key]);
                        assert!(
                            err < TOLERANCE,
                            "{name} {isa} x{threads}: {key} relative error {err:.3e}"
                        );
                        if err >= worst.0 {
                            worst = (err, t.name.clone());
                        }
                        checked += 1;
                    }
                }
                println!(
                    "{name} {isa} x{threads}: logits {logits_err:.3e}, loss {loss_err:.3e}, \
                     worst gradient {:.3e} ({})",
                    worst.0, worst.1
                );
                assert!(logits_err < TOLERANCE, "{name}: logits {logits_err:.3e}");
                assert!(loss_err < TOLERANCE, "{name}: loss {loss_err:.3e}");
            }
        }
        // Every gradient the reference holds was compared.
        let grads = expected.keys().filter(|k| k.starts_with("grad0.")).count();
        assert_eq!(checked % grads, 0, "{name}");
        assert!(checked > 0);
    }
}

#[test]
fn evaluation_losses_match_pytorch() {
    for name in MODELS {
        let dir = data_dir(name);
        let (model, params) = load_pretrained(&dir).unwrap();
        let expected = read_f32_tensors(&dir.join("expected.safetensors"));
        let data = TokenData::open(&dir.join("tokens.bin")).unwrap();
        let mut runner = Runner::on_cpu(model.clone(), B, T).unwrap();
        runner.load(&params).unwrap();
        for (step, &want) in expected["eval_losses"].iter().enumerate() {
            let b = batch(&model, &data, step);
            let loss = runner.forward(&b.inputs, &b.targets).unwrap();
            let err = rel_err(&[loss], &[want]);
            println!("{name} eval {step}: {loss} (PyTorch {want}), relative error {err:.3e}");
            assert!(err < TOLERANCE, "{name} eval {step}: {loss} vs {want}");
        }
    }
}

/// AdamW as the golden data's `meta.json` gives it.
fn golden_step_params(dir: &Path) -> StepParams {
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
    let adamw = &meta["adamw"];
    assert_eq!(adamw["bias_correction"], true);
    assert_eq!(
        adamw["weight_decay_applies_to"],
        "parameters with 2 or more dims"
    );
    StepParams {
        adam: AdamW {
            lr: meta["lr"].as_f64().unwrap(),
            beta1: adamw["betas"][0].as_f64().unwrap(),
            beta2: adamw["betas"][1].as_f64().unwrap(),
            eps: adamw["eps"].as_f64().unwrap(),
            weight_decay: adamw["weight_decay"].as_f64().unwrap(),
        },
        clip: 0.0,
        loss_scale: 1.0,
    }
}

/// Three steps of the golden batches under `policy`: the losses and final parameters.
fn three_steps(
    model: &Model,
    params: &[Vec<f32>],
    data: &TokenData,
    step_params: &StepParams,
    (policy, recompute): (&dyn Policy, Recompute),
    chaos: Option<u64>,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let shape = StepShape::cpu(B, T).recomputing(recompute);
    let input = PlanInput::new(model, shape, UNLIMITED);
    let plan = Plan::build(&input, policy).unwrap();
    let nvme = tempfile::tempdir().unwrap();
    let config = ExecConfig {
        nvme_dirs: vec![nvme.path().into()],
        chaos,
        ..ExecConfig::default()
    };
    let mut exec = Executor::on_cpu(model.clone(), plan, &config).unwrap();
    exec.load(params, None).unwrap();
    let mut losses = Vec::new();
    for step in 0..3 {
        let b = batch(model, data, step);
        let report = exec.step(&[(&b.inputs, &b.targets)], step_params).unwrap();
        losses.push(report.loss);
    }
    (losses, exec.export().unwrap().0)
}

/// ‖got − want‖ / ‖want‖ in f64.
fn rel_err64(got: &[f64], want: &[f64]) -> f64 {
    let d: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let n: f64 = want.iter().map(|w| w * w).sum();
    (d / n.max(f64::MIN_POSITIVE)).sqrt()
}

/// Errors of final parameters against the float64 replay over the elements `kept`
/// keeps: the global error (all tensors as one vector) and the worst tensor's.
struct Errors {
    global: f64,
    worst: f64,
    worst_name: String,
}

fn errors_vs_f64<'a>(
    names: impl Iterator<Item = &'a str>,
    got: impl Fn(&str) -> Vec<f64>,
    truth: &HashMap<String, Vec<f64>>,
    kept: impl Fn(&str, usize) -> bool,
) -> Errors {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    let mut out = Errors {
        global: 0.0,
        worst: 0.0,
        worst_name: String::new(),
    };
    for name in names {
        let want = &truth[&format!("final.{name}")];
        let got = got(name);
        assert_eq!(got.len(), want.len(), "{name}");
        let (mut d_kept, mut n_kept) = (0.0f64, 0.0f64);
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            if kept(name, i) {
                d_kept += (g - w) * (g - w);
                n_kept += w * w;
            }
        }
        diff += d_kept;
        norm += n_kept;
        let err = (d_kept / n_kept.max(f64::MIN_POSITIVE)).sqrt();
        if err > out.worst {
            out.worst = err;
            out.worst_name = name.to_string();
        }
    }
    out.global = (diff / norm).sqrt();
    out
}

#[test]
fn three_adamw_steps_are_as_accurate_as_pytorch_and_identical_under_every_policy() {
    for name in MODELS {
        let dir = data_dir(name);
        let (model, params) = load_pretrained(&dir).unwrap();
        let expected = read_f32_tensors(&dir.join("expected.safetensors"));
        let truth = read_f64_tensors(&dir.join("final64.safetensors"));
        let data = TokenData::open(&dir.join("tokens.bin")).unwrap();
        let step_params = golden_step_params(&dir);
        let (losses, reference) = three_steps(
            &model,
            &params,
            &data,
            &step_params,
            (&AllOnDevice, Recompute::Auto),
            None,
        );
        let loss_err = rel_err(&losses, &expected["losses"]);
        assert!(
            loss_err < TOLERANCE,
            "{name}: {losses:?} vs {:?}",
            expected["losses"]
        );
        // Every parameter of the model is in the float64 replay, and nothing else.
        let names: Vec<&str> = model
            .blocks()
            .iter()
            .flat_map(|b| b.tensors.iter().map(|t| t.name.as_str()))
            .collect();
        assert_eq!(names.len(), truth.len(), "{name}");
        // AdamW moves an element whose gradient is near its eps by a large fraction of
        // lr whatever the gradient's size, so there fp32 rounding noise, not the model,
        // picks the direction (see tests/data/*/README.md, from shared/golden/README.md):
        // the first update is lr g / (|g| + eps), whose sensitivity to g is
        // lr eps / (|g| + eps)^2, 1.1e4 at |g| = 2 eps (so a gradient rounded by 1e-10
        // moves by 1e-6 a step) and below 830 from 10 eps up. Both comparisons leave out
        // elements whose step-0 gradient is below 10 eps, for both sides alike, and bound
        // them by AdamW's largest move instead. Measured: one element of
        // qwen2-window-tiny's layers.0.mlp.down_proj, step-0 gradient -2.1e-8, ended
        // 1.0e-5 from float64 here and 2.7e-6 in PyTorch fp32, three times the rest of
        // the model's whole error.
        //
        // The key biases are held to a looser bound, as GPT-2's test holds its key bias:
        // softmax ignores what is constant per query, so a key bias's gradient is only
        // what the rotary embedding makes vary between key positions, small where the
        // rotation is slow over 16 positions (most of its channels: gradients of 1e-9 to
        // 1e-6 from terms of 1e-4), and each side's fp32 sum there is mostly rounding
        // that AdamW then magnifies. Measured on qwen2-tiny, layer 1: 2.0e-4 against
        // PyTorch fp32's 3.4e-5 with the materialised attention, nearly all from two
        // elements whose step-0 gradients are 1e-9 and 3e-8 (without the first, 6.7e-5
        // against 3.1e-5); 5.3e-4 with the fused one, whose sums run in another order.
        let key_bias = |n: &str| n.ends_with("self_attn.k_proj.bias");
        let eps = step_params.adam.eps as f32;
        let grad0 = |n: &str| &expected[&format!("grad0.{n}")];
        let has_grad = |n: &str| expected.contains_key(&format!("grad0.{n}"));
        let kept =
            |n: &str, i: usize| !key_bias(n) && (!has_grad(n) || grad0(n)[i].abs() >= 10.0 * eps);
        let ours_of = |n: &str| -> Vec<f64> {
            let (block, t) = model.find_tensor(n).unwrap();
            reference[block][t.slot.range()]
                .iter()
                .map(|&v| v as f64)
                .collect()
        };
        let torch_of = |n: &str| -> Vec<f64> {
            expected[&format!("final.{n}")]
                .iter()
                .map(|&v| v as f64)
                .collect()
        };
        let ours = errors_vs_f64(names.iter().copied(), ours_of, &truth, kept);
        let torch = errors_vs_f64(names.iter().copied(), torch_of, &truth, kept);
        let ours_all = errors_vs_f64(names.iter().copied(), ours_of, &truth, |_, _| true);
        let torch_all = errors_vs_f64(names.iter().copied(), torch_of, &truth, |_, _| true);
        for n in names.iter().copied().filter(|n| key_bias(n)) {
            let err = rel_err64(&ours_of(n), &truth[&format!("final.{n}")]);
            println!("{name}: {n} vs float64 {err:.2e}");
            assert!(err < 1e-3, "{name}: {n} relative error {err:.3e}");
        }
        let mut left_out = 0;
        for n in names
            .iter()
            .copied()
            .filter(|n| has_grad(n) && !key_bias(n))
        {
            let (got, want) = (ours_of(n), &truth[&format!("final.{n}")]);
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                if !kept(n, i) {
                    left_out += 1;
                    // Three steps of at most about lr each (plus the decay's share).
                    let bound = 3.0 * step_params.adam.lr * 1.01;
                    assert!((g - w).abs() <= bound, "{name}: {n}[{i}] {g} vs {w}");
                }
            }
        }
        println!(
            "{name}: after 3 steps vs float64, global {:.2e} (PyTorch fp32 {:.2e}); worst \
             tensor {:.2e} {} (PyTorch fp32 {:.2e} {}), leaving out key biases and {left_out} \
             elements whose gradient is below 10 eps; with them {:.2e} {} (PyTorch {:.2e} {})",
            ours.global,
            torch.global,
            ours.worst,
            ours.worst_name,
            torch.worst,
            torch.worst_name,
            ours_all.worst,
            ours_all.worst_name,
            torch_all.worst,
            torch_all.worst_name,
        );
        assert!(
            ours.global <= 2.0 * torch.global,
            "{name}: global error {:.3e} vs PyTorch's {:.3e}",
            ours.global,
            torch.global
        );
        assert!(
            ours.worst <= 2.0 * torch.worst,
            "{name}: worst tensor {} {:.3e} vs PyTorch's worst {:.3e}",
            ours.worst_name,
            ours.worst,
            torch.worst
        );
        // Every block keeping its activations on the device, and offloading them.
        for policy in all_policies() {
            for (recompute, chaos) in [Recompute::Auto, Recompute::Offload]
                .into_iter()
                .flat_map(|r| CHAOS.map(|c| (r, c)))
            {
                let how = (policy.as_ref(), recompute);
                let (l, p) = three_steps(&model, &params, &data, &step_params, how, chaos);
                let what = format!(
                    "{name} {} --recompute {recompute} chaos {chaos:?}",
                    policy.name()
                );
                assert_eq!(l, losses, "{what}: losses");
                for (b, (x, y)) in reference.iter().zip(&p).enumerate() {
                    assert!(
                        x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{what}: block {b}'s parameters differ from all-on-device's"
                    );
                }
            }
        }
    }
}
