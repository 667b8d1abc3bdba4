//! AdamW's moments kept in bf16 or the 8-bit block format (`StepShape::optimizer_state`)
//! by the engine, on the CPU device:
//! - three steps equal the same AdamW kernel applied tensor by tensor to resident
//!   buffers (parameters, and the moments as their format stores them);
//! - they are bit-identical under every policy that keeps the state in host memory or
//!   on NVMe, with accumulation, clipping, chaos and a delayed update, and a policy that
//!   keeps it on the device is refused by name;
//! - loading f32 moments stores them in the format, and export gives them back as f32.

mod model_support;

use model_support::training::{Run, assert_same, bits, train};
use model_support::{CHAOS, UNLIMITED, random_batch as batch};
use strata_engine::exec::{ExecConfig, Executor, Runner, StepParams, TrainingState};
use strata_engine::kernels::adamw::{AdamStep, AdamW, CopyOut, Grads, Q8State, State, q8};
use strata_engine::kernels::isa::Isa;
use strata_engine::model::{Gpt2Config, Model, OptimizerState, TensorSpec};
use strata_engine::plan::{
    AllOnDevice, CpuOffload, NvmeOffload, ParamOffload, Plan, PlanError, PlanInput, Policy,
    Precision, StepShape, Tier,
};

const COMPACT: [OptimizerState; 2] = [OptimizerState::Bf16, OptimizerState::Q8];

fn small() -> Model {
    // Width 48: LayerNorm weights and biases of 48 values and attention biases of 144,
    // each followed by an alignment gap, and 8-bit blocks cut short at a tensor's end.
    Model::new(Gpt2Config::new(3, 4, 48, 96, 32)).unwrap()
}

fn hyper() -> StepParams {
    StepParams {
        adam: AdamW {
            lr: 1e-2,
            weight_decay: 0.1,
            ..AdamW::default()
        },
        clip: 0.0,
        loss_scale: 1.0,
    }
}

/// One tensor's moments as `format` stores them, resident.
enum Resident {
    Bf16(Vec<half::bf16>, Vec<half::bf16>),
    Q8 {
        m_codes: Vec<u8>,
        v_codes: Vec<u8>,
        m_scales: Vec<f32>,
        v_scales: Vec<f32>,
    },
}

impl Resident {
    fn zero(format: OptimizerState, n: usize) -> Self {
        match format {
            OptimizerState::Bf16 => {
                Resident::Bf16(vec![half::bf16::ZERO; n], vec![half::bf16::ZERO; n])
            }
            OptimizerState::Q8 => Resident::Q8 {
                m_codes: vec![0; n],
                v_codes: vec![0; n],
                m_scales: vec![0.0; q8::scale_count(n)],
                v_scales: vec![0.0; q8::scale_count(n)],
            },
            OptimizerState::Fp32 => unreachable!("compact formats only"),
        }
    }

    fn state(&mut self) -> State<'_> {
        match self {
            Resident::Bf16(m, v) => State::Bf16 { m, v },
            Resident::Q8 {
                m_codes,
                v_codes,
                m_scales,
                v_scales,
            } => State::Q8(Q8State {
                m_codes,
                m_scales,
                v_codes,
                v_scales,
            }),
        }
    }

    /// m and v as f32.
    fn f32s(&self) -> (Vec<f32>, Vec<f32>) {
        match self {
            Resident::Bf16(m, v) => (
                m.iter().map(|x| x.to_f32()).collect(),
                v.iter().map(|x| x.to_f32()).collect(),
            ),
            Resident::Q8 {
                m_codes,
                v_codes,
                m_scales,
                v_scales,
            } => {
                let (mut m, mut v) = (vec![0.0; m_codes.len()], vec![0.0; v_codes.len()]);
                q8::dequantize_m(m_codes, m_scales, &mut m);
                q8::dequantize_v(v_codes, v_scales, &mut v);
                (m, v)
            }
        }
    }
}

/// `steps` steps of whole-model passes with AdamW applied tensor by tensor to resident
/// parameters and moments in `format` (the reference for the engine's layout).
fn reference(model: &Model, format: OptimizerState, (b, t): (usize, usize), steps: usize) -> Run {
    let hp = hyper().adam;
    let mut params = model.init_params(7);
    let mut state: Vec<Vec<Resident>> = model
        .blocks()
        .iter()
        .map(|block| {
            block
                .tensors
                .iter()
                .map(|t| Resident::zero(format, t.slot.len))
                .collect()
        })
        .collect();
    let (tokens, targets) = batch(model.vocab(), b * t, 11);
    let mut runner = Runner::on_cpu(model.clone(), b, t).unwrap();
    let mut losses = Vec::new();
    for step in 1..=steps as u64 {
        runner.load(&params).unwrap();
        losses.push(runner.forward(&tokens, &targets).unwrap());
        let grads = runner.backward().unwrap();
        for (block, ((p, g), s)) in model
            .blocks()
            .iter()
            .zip(params.iter_mut().zip(&grads).zip(&mut state))
        {
            for (tensor, s) in block.tensors.iter().zip(s) {
                let r = tensor.slot.range();
                let weight_decay = if tensor.decays() {
                    hp.weight_decay
                } else {
                    0.0
                };
                AdamStep::new(&AdamW { weight_decay, ..hp }, step, 1.0)
                    .unwrap()
                    .apply(
                        Isa::active(),
                        2,
                        &mut p[r.clone()],
                        s.state(),
                        Grads::F32(&g[r]),
                        CopyOut::None,
                    )
                    .unwrap();
            }
        }
    }
    // Block by block, moment `k` (0: m, 1: v) of every tensor, as f32.
    let whole = |k: usize| -> Vec<Vec<f32>> {
        model
            .blocks()
            .iter()
            .zip(&state)
            .map(|(block, s)| {
                let mut out = vec![0.0; block.len];
                for (tensor, s) in block.tensors.iter().zip(s) {
                    let (m, v) = s.f32s();
                    out[tensor.slot.range()].copy_from_slice(if k == 0 { &m } else { &v });
                }
                out
            })
            .collect()
    };
    Run {
        losses,
        params,
        m: whole(0),
        v: whole(1),
        // Nothing moves between tiers: there are none.
        link_bytes: Vec::new(),
        measured: [0; 3],
    }
}

#[test]
fn compact_moments_equal_adamw_on_resident_tensors() {
    let model = small();
    let (b, t) = (2, 16);
    for format in COMPACT {
        let expected = reference(&model, format, (b, t), 3);
        for policy in [
            Box::new(CpuOffload) as Box<dyn Policy>,
            Box::new(NvmeOffload::default()),
        ] {
            let shape = StepShape::cpu(b, t).with_state(format);
            let run = train(&model, shape, policy.as_ref(), 3, hyper(), None);
            assert_same(
                &expected,
                &run,
                &format!("{format} moments, {}", policy.name()),
            );
        }
    }
}

#[test]
fn compact_moments_are_policy_independent_and_refused_on_the_device() {
    let model = small();
    for format in COMPACT {
        for (precision, clip, delayed) in [
            (Precision::Fp32, false, false),
            (Precision::Bf16, true, false),
            (Precision::Fp32, false, true),
        ] {
            let mut shape = StepShape {
                grad_accum: 2,
                precision,
                needs_global_norm: clip,
                ..StepShape::cpu(2, 16)
            }
            .with_state(format);
            if delayed {
                shape = shape.delayed();
            }
            let params = StepParams {
                clip: if clip { 0.05 } else { 0.0 },
                ..hyper()
            };
            let what = format!("{format} moments, {precision}, clip {clip}, delayed {delayed}");
            let expected = train(&model, shape, &CpuOffload, 3, params, None);
            for policy in [
                Box::new(ParamOffload {
                    depth: 3,
                    checkpoints: Tier::Host,
                }) as Box<dyn Policy>,
                Box::new(NvmeOffload {
                    depth: 1,
                    checkpoints: Tier::Host,
                }),
                Box::new(NvmeOffload {
                    depth: 2,
                    checkpoints: Tier::Nvme,
                }),
            ] {
                for chaos in CHAOS {
                    let run = train(&model, shape, policy.as_ref(), 3, params, chaos);
                    assert_same(
                        &expected,
                        &run,
                        &format!("{what}, {}, chaos {chaos:?}", policy.name()),
                    );
                }
            }
        }
        let input = PlanInput::new(&model, StepShape::cpu(2, 16).with_state(format), UNLIMITED);
        match Plan::build(&input, &AllOnDevice) {
            Err(PlanError::BadPolicy { reason, .. }) => assert!(
                reason.contains(&format!("{format} optimizer state"))
                    && reason.contains("host memory or on NVMe"),
                "{reason}"
            ),
            other => panic!("{format} moments on the device: {other:?}"),
        }
    }
}

/// The moments `format` stores for `m` and `v` of a block, as f32: bf16 rounding, or the
/// 8-bit format's blocks starting at each tensor.
fn stored(format: OptimizerState, tensors: &[TensorSpec], m: &[f32], v: &[f32]) -> [Vec<f32>; 2] {
    let mut out = [vec![0.0; m.len()], vec![0.0; v.len()]];
    for t in tensors {
        let r = t.slot.range();
        let mut s = Resident::zero(format, r.len());
        match &mut s {
            Resident::Bf16(sm, sv) => {
                for (o, x) in sm.iter_mut().zip(&m[r.clone()]) {
                    *o = half::bf16::from_f32(*x);
                }
                for (o, x) in sv.iter_mut().zip(&v[r.clone()]) {
                    *o = half::bf16::from_f32(*x);
                }
            }
            Resident::Q8 {
                m_codes,
                v_codes,
                m_scales,
                v_scales,
            } => {
                q8::quantize_m(&m[r.clone()], m_codes, m_scales);
                q8::quantize_v(&v[r.clone()], v_codes, v_scales);
            }
        }
        let (sm, sv) = s.f32s();
        out[0][r.clone()].copy_from_slice(&sm);
        out[1][r].copy_from_slice(&sv);
    }
    out
}

#[test]
fn loading_stores_f32_moments_in_the_format_and_export_reads_them_back() {
    let model = small();
    let params = model.init_params(7);
    // Moments of every magnitude, zero in the alignment gaps (as AdamW leaves them).
    let moments = |seed: f32, positive: bool| -> Vec<Vec<f32>> {
        model
            .blocks()
            .iter()
            .map(|block| {
                let mut out = vec![0.0; block.len];
                for t in &block.tensors {
                    for i in t.slot.range() {
                        let x = ((i as f32 * 0.618 + seed).sin() * 1e-3).powi(1);
                        out[i] = if positive { x * x } else { x };
                    }
                }
                out
            })
            .collect()
    };
    let (m, v) = (moments(0.3, false), moments(1.7, true));
    for format in COMPACT {
        for policy in [
            Box::new(CpuOffload) as Box<dyn Policy>,
            Box::new(NvmeOffload::default()),
        ] {
            let input = PlanInput::new(&model, StepShape::cpu(2, 16).with_state(format), UNLIMITED);
            let plan = Plan::build(&input, policy.as_ref()).unwrap();
            let nvme = tempfile::tempdir().unwrap();
            let config = ExecConfig {
                nvme_dirs: vec![nvme.path().to_path_buf()],
                ..ExecConfig::default()
            };
            let mut exec = Executor::on_cpu(model.clone(), plan, &config).unwrap();
            exec.load(&params, Some((&m, &v))).unwrap();
            let (p, em, ev) = exec.export().unwrap();
            let what = format!("{format}, {}", policy.name());
            assert!(bits(&p) == bits(&params), "{what}: master parameters");
            for (b, block) in model.blocks().iter().enumerate() {
                let [sm, sv] = stored(format, &block.tensors, &m[b], &v[b]);
                assert!(bits(&[sm]) == bits(&em[b..=b]), "{what}: block {b}'s m");
                assert!(bits(&[sv]) == bits(&ev[b..=b]), "{what}: block {b}'s v");
            }
            // The block-at-a-time reader (checkpoints) gives the same.
            for b in 0..model.blocks().len() {
                let [bp, bm, bv] = exec.export_block_state(b).unwrap();
                assert!(bits(&[bp, bm, bv]) == bits(&[p[b].clone(), em[b].clone(), ev[b].clone()]));
            }
        }
    }
}

/// A run resumed from exported state (what a checkpoint holds: fp32 moments) against the
/// same run uninterrupted, bit for bit: bf16 moments round-trip through f32 exactly, and
/// 8-bit moments quantize back from their f32 values to the same codes and scales
/// (`q8`'s `decoded_blocks_quantize_back_to_the_same_codes_and_scales` says when).
#[test]
fn a_run_resumed_from_exported_compact_moments_continues_the_same_run() {
    let model = small();
    let input_of =
        |format| PlanInput::new(&model, StepShape::cpu(2, 16).with_state(format), UNLIMITED);
    let (tokens, targets) = batch(model.vocab(), 32, 11);
    let refs = [(&tokens[..], &targets[..])];
    for format in COMPACT {
        let plan = Plan::build(&input_of(format), &NvmeOffload::default()).unwrap();
        let nvme = tempfile::tempdir().unwrap();
        let config = ExecConfig {
            nvme_dirs: vec![nvme.path().to_path_buf()],
            ..ExecConfig::default()
        };
        let start = |state: Option<&TrainingState>, steps| {
            let mut exec = Executor::on_cpu(model.clone(), plan.clone(), &config).unwrap();
            match state {
                None => exec.load(&model.init_params(7), None).unwrap(),
                Some((p, m, v)) => exec.load(p, Some((m, v))).unwrap(),
            }
            exec.set_steps(steps);
            exec
        };
        let mut whole = start(None, 0);
        let mut half = start(None, 0);
        for _ in 0..2 {
            whole.step(&refs, &hyper()).unwrap();
            half.step(&refs, &hyper()).unwrap();
        }
        let saved = half.export().unwrap();
        drop(half);
        let mut resumed = start(Some(&saved), 2);
        for _ in 0..2 {
            let a = whole.step(&refs, &hyper()).unwrap().loss;
            let b = resumed.step(&refs, &hyper()).unwrap().loss;
            assert_eq!(a.to_bits(), b.to_bits(), "{format}: loss");
        }
        let (pa, pb) = (whole.export().unwrap().0, resumed.export().unwrap().0);
        for (x, y) in pa.iter().flatten().zip(pb.iter().flatten()) {
            assert_eq!(x.to_bits(), y.to_bits(), "{format}: {x} resumed as {y}");
        }
    }
}
