//! QLoRA through the executor: a LoRA model whose frozen base is quantised (NF4 or int8)
//! computes with each base matrix's dequantised values, whichever policy holds it: a
//! device home holds them dequantised at load, a host or NVMe home holds the block's
//! base as its packed image (written once), which each fetch copies to the device and
//! dequantises there. Every policy, recomputation and schedule trains it bit for bit
//! alike, the device's copies are the plan's, and the host and NVMe homes hold the
//! packed size, not the base's. On `tests/data/qlora-tiny`, strata's quantisation of the
//! base is bitsandbytes' and three steps give peft's losses and adapters over it.

mod model_support;

use model_support::lora_golden::{assert_golden, golden_losses, golden_start, golden_steps};
use model_support::training::{
    Run, assert_same, clipped_shapes, clipped_step, train, train_from, train_plan,
};
use model_support::{UNLIMITED, all_policies, each_policy};
use strata_engine::kernels::kernel::quant::{Int8Blocks, Nf4Blocks, reference};
use strata_engine::model::lora::{LoraAdapter, LoraConfig};
use strata_engine::model::{BaseQuant, BlockKind, Llama, LlamaConfig, Model, quant_base};
use strata_engine::plan::{
    AllOnDevice, BufId, BufKind, NvmeOffload, Plan, PlanInput, Recompute, Tier,
};

fn small_lora() -> Model {
    let base = Model::of(Llama::new(LlamaConfig::llama(2, 48, 80, 4, 2, 96, 32)).unwrap());
    let config = LoraConfig::new(4, 8.0, 0.0, vec!["q_proj".into(), "v_proj".into()]).unwrap();
    base.lora(&config).unwrap()
}

/// `params` with every matrix of a transformer block's base replaced by its values
/// quantised and dequantised by the kernels' reference: made here from the formats'
/// public parts, not by the engine's loading.
fn dequantised(model: &Model, quant: BaseQuant, params: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let mut out = params.to_vec();
    for (block, values) in model.blocks().iter().zip(&mut out) {
        if !matches!(block.kind, BlockKind::Transformer { .. }) {
            continue;
        }
        for t in &block.tensors {
            if t.shape.len() != 2 || t.name.contains("lora_") {
                continue;
            }
            let x = &mut values[t.slot.range()];
            match quant {
                BaseQuant::Nf4 => {
                    let q = Nf4Blocks::quantize(x);
                    let (codes, offset) = (&q.codes, q.absmax_offset);
                    reference::dequantize_nf4(x, codes, &q.absmax_q, &q.absmax_scale, offset);
                }
                BaseQuant::Int8 => {
                    let q = Int8Blocks::quantize(x);
                    reference::dequantize_int8(x, &q.codes, &q.scales);
                }
            }
        }
    }
    out
}

/// A GPT-2 LoRA model: its Conv1D matrices quantised as stored (in x out).
fn small_gpt2_lora() -> Model {
    let config = LoraConfig::new(4, 8.0, 0.0, vec!["c_attn".into(), "c_fc".into()]).unwrap();
    model_support::training::small_gpt2().lora(&config).unwrap()
}

#[test]
fn a_quantised_base_computes_with_its_dequantised_values() {
    let params = model_support::training::adamw_clipped(1.0);
    let models = [("llama", small_lora()), ("gpt2", small_gpt2_lora())];
    let cases = models
        .iter()
        .flat_map(|m| BaseQuant::ALL.map(|q| (m, q)))
        .filter(|((family, _), quant)| *family == "llama" || *quant == BaseQuant::Nf4);
    for ((family, lora), quant) in cases {
        let start = lora.init_params(7);
        let qlora = lora.quantized(quant).unwrap();
        let shape = clipped_step().recomputing(Recompute::None);
        // The plain LoRA model from the dequantised base, on the device: what the
        // quantised model must compute, packed on the host and on NVMe.
        let reference = {
            let plan = Plan::build(&PlanInput::new(lora, shape, UNLIMITED), &AllOnDevice);
            let dequantised = dequantised(lora, quant, &start);
            train_from(lora, plan.unwrap(), &dequantised, 3, params, None)
        };
        let plain = train(lora, shape, &AllOnDevice, 3, params, None);
        assert_ne!(
            plain.losses, reference.losses,
            "{family}, {quant}: quantising the base changes the losses"
        );
        for policy in &each_policy() {
            let run = train(&qlora, shape, policy.as_ref(), 3, params, None);
            let case = format!("{family}, {quant}, {}", policy.name());
            assert_same(&reference, &run, &case);
        }
    }
}

#[test]
fn a_quantised_lora_model_trains_bit_identically_under_every_plan() {
    // Quantisation changes what a fetch moves, not the step: bf16, one micro-batch, and
    // two vertically with offloaded activations.
    let shapes = clipped_shapes()
        .into_iter()
        .filter(|(what, _)| ["bf16, kept", "kept", "2 vertical, offloaded"].contains(what));
    let params = model_support::training::adamw_clipped(1.0);
    let mut packed = [0usize; 3];
    for quant in BaseQuant::ALL {
        let model = small_lora().quantized(quant).unwrap();
        for (what, shape) in shapes.clone() {
            let reference: Run = train(&model, shape, &AllOnDevice, 3, params, None);
            for policy in all_policies() {
                let plan = Plan::build(&PlanInput::new(&model, shape, UNLIMITED), policy.as_ref())
                    .unwrap();
                for h in plan.block_homes.iter().filter_map(|h| h.packed) {
                    packed[plan.buffer(h).tier.index()] += 1;
                }
                for chaos in [None, Some(3)] {
                    let run = train_plan(&model, plan.clone(), 3, params, chaos);
                    let case = format!("{quant}, {what}, {}, chaos {chaos:?}", policy.name());
                    for (step, moved) in run.link_bytes.iter().enumerate() {
                        let what = format!("{case}, step {step}: bytes copied each way");
                        assert_eq!(moved[2..], plan.link_bytes[2..], "{what}");
                    }
                    assert_same(&reference, &run, &case);
                }
            }
        }
    }
    assert!(
        packed[Tier::Host.index()] > 0 && packed[Tier::Nvme.index()] > 0,
        "packed bases in host memory and on NVMe: {packed:?}"
    );
}

/// Bytes of home `id`: a buffer's, or one extent of its group's.
fn home_bytes(plan: &Plan, id: BufId) -> usize {
    let buffer = plan.buffer(id);
    match buffer.kind {
        BufKind::Extent { group, .. } => plan.extent_groups[group].bytes as usize,
        _ => buffer.bytes as usize,
    }
}

#[test]
fn a_packed_base_takes_its_formats_bytes_off_the_device() {
    let lora = small_lora();
    let shape = clipped_step();
    let policy = NvmeOffload {
        depth: 2,
        checkpoints: Tier::Host,
    };
    let plain = Plan::build(&PlanInput::new(&lora, shape, UNLIMITED), &policy).unwrap();
    for quant in BaseQuant::ALL {
        let qlora = lora.quantized(quant).unwrap();
        let plan = Plan::build(&PlanInput::new(&qlora, shape, UNLIMITED), &policy).unwrap();
        for (b, block) in lora.blocks().iter().enumerate() {
            let Some(packed) = plan.block_homes[b].packed else {
                continue;
            };
            // Each base tensor in its format's bytes (matrices) or in f32, each part of
            // it at most 15 bytes of alignment past the last, in whole 4 KiB pages.
            let (mut least, mut parts) = (0, 0);
            for t in block
                .tensors
                .iter()
                .filter(|t| t.slot.offset < block.frozen)
            {
                let quantised = t.shape.len() == 2;
                least += match (quantised, quant) {
                    (false, _) => 4 * t.slot.len,
                    (true, BaseQuant::Nf4) => Nf4Blocks::storage_bytes(t.slot.len),
                    (true, BaseQuant::Int8) => Int8Blocks::storage_bytes(t.slot.len),
                };
                parts += match (quantised, quant) {
                    (false, _) => 1,
                    (true, BaseQuant::Nf4) => 4,
                    (true, BaseQuant::Int8) => 2,
                };
            }
            let bytes = home_bytes(&plan, packed);
            assert!(
                bytes >= least && bytes <= (least + 15 * parts).next_multiple_of(4096),
                "{quant}, block {b}: {bytes} bytes for at least {least}"
            );
            // The trained tail's extent, and no extent of the base in f32.
            assert!(plan.block_homes[b].params_base.is_none(), "block {b}");
            let tail = home_bytes(&plan, plan.block_homes[b].params);
            assert_eq!(tail, 4 * block.trained_len(), "{quant}, block {b}'s tail");
            let whole = home_bytes(&plain, plain.block_homes[b].params_base.unwrap());
            assert_eq!(whole, 4 * block.frozen, "block {b}'s base in f32");
        }
        assert!(
            plan.peak[Tier::Nvme.index()] < plain.peak[Tier::Nvme.index()],
            "{quant}: NVMe holds less"
        );
    }
}

/// `tests/data/qlora-tiny` (lora-tiny's run over its base in NF4; see its README).
fn qlora_dir() -> std::path::PathBuf {
    model_support::data_dir("qlora-tiny")
}

#[test]
fn strata_quantises_the_golden_base_as_bitsandbytes_does() {
    let (base, _, start, _) = golden_start();
    let file = std::fs::read(qlora_dir().join("dequant.safetensors")).unwrap();
    let golden = safetensors::SafeTensors::deserialize(&file).unwrap();
    let (mut tensors, mut far) = (0, 0);
    for (block, params) in base.blocks().iter().zip(&start) {
        let mut values = params[..block.len].to_vec();
        quant_base::round_trip(block, BaseQuant::Nf4, &mut values);
        for t in block
            .tensors
            .iter()
            .filter(|t| quant_base::is_quantised(block, t))
        {
            let want: Vec<f32> = golden
                .tensor(&t.name)
                .unwrap_or_else(|e| panic!("{}: {e}", t.name))
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let got = &values[t.slot.range()];
            // The README: equal but for an offset one ulp off bitsandbytes' float32 mean
            // (at most 7.5e-9 apart) and one block whose absmax code bitsandbytes' CPU
            // search puts off the nearest entry (1.5e-5 apart; 2e-5 allowed).
            for (&g, &w) in got.iter().zip(&want) {
                let diff = (g - w).abs();
                assert!(diff <= 2e-5, "{}: {g} vs {w}", t.name);
                far += usize::from(diff > 1e-8);
            }
            tensors += 1;
        }
    }
    assert_eq!(tensors, 14, "every linear weight of the two layers");
    assert!(
        far <= 64,
        "{far} values farther than 1e-8: more than one block"
    );
}

#[test]
fn three_qlora_steps_give_peft_over_bitsandbytes_losses_and_adapters() {
    let (base, lora, start, _) = golden_start();
    let qlora = lora.quantized(BaseQuant::Nf4).unwrap();
    let expected = LoraAdapter::read(&qlora_dir().join("expected"), &base).unwrap();
    let want = golden_losses(&qlora_dir());
    for policy in &each_policy() {
        let nvme = tempfile::tempdir().unwrap();
        let (exec, losses) = golden_steps(&qlora, &start, policy.as_ref(), nvme.path());
        let (params, _, _) = exec.export().unwrap();
        assert_golden(&qlora, (&losses, &want), &params, &expected, &policy.name());
    }
}
