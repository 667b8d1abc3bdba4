//! The loss mask: targets set to `IGNORE_TARGET` (a prompt's tokens) do not count. The
//! loss is the mean over the positions that count, the gradient is that mean's, and the
//! executor's step agrees with the whole-model runner on both.

mod model_support;

use model_support::cpu_runner;
use strata_engine::exec::{ExecConfig, Executor, StepParams};
use strata_engine::kernels::adamw::AdamW;
use strata_engine::kernels::ops::Cpu;
use strata_engine::model::{Gpt2Config, IGNORE_TARGET, Model};
use strata_engine::plan::{Budgets, CpuOffload, Plan, PlanInput, StepShape};

const B: usize = 2;
const T: usize = 16;

fn batch(model: &Model) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let v = model.vocab() as u32;
    let inputs: Vec<u32> = (0..B * T).map(|i| (i as u32 * 7 + 3) % v).collect();
    let targets: Vec<u32> = (0..B * T).map(|i| (i as u32 * 11 + 5) % v).collect();
    // The first 5 positions of each row are a "prompt".
    let masked = targets
        .iter()
        .enumerate()
        .map(|(i, &t)| if i % T < 5 { IGNORE_TARGET } else { t })
        .collect();
    (inputs, targets, masked)
}

fn norm(grads: &[Vec<f32>]) -> f64 {
    grads
        .iter()
        .flatten()
        .map(|&g| f64::from(g) * f64::from(g))
        .sum::<f64>()
        .sqrt()
}

#[test]
fn masked_positions_do_not_count() {
    let model = Model::new(Gpt2Config::tiny()).unwrap();
    let params = model.init_params(3);
    let (inputs, targets, masked) = batch(&model);
    let mut runner = cpu_runner(&model, B, T, Cpu::default());
    runner.load(&params).unwrap();
    runner.forward(&inputs, &targets).unwrap();
    let plain = runner.losses().unwrap();
    let masked_loss = runner.forward(&inputs, &masked).unwrap();
    let losses = runner.losses().unwrap();
    let counted: Vec<usize> = (0..B * T).filter(|i| i % T >= 5).collect();
    let want = counted.iter().map(|&i| f64::from(plain[i])).sum::<f64>() / counted.len() as f64;
    assert_eq!(masked_loss, want as f32);
    for i in 0..B * T {
        if i % T < 5 {
            assert_eq!(losses[i], 0.0);
        } else {
            assert_eq!(losses[i], plain[i]);
        }
    }
    let grads = runner.backward().unwrap();
    assert!(norm(&grads) > 0.0);
    // Nothing counts: a zero loss and zero gradients, not NaNs.
    let all = vec![IGNORE_TARGET; B * T];
    assert_eq!(runner.forward(&inputs, &all).unwrap(), 0.0);
    assert_eq!(norm(&runner.backward().unwrap()), 0.0);

    // The executor's step: the same loss, and the gradient of the same mean (its norm,
    // measured before clipping, with accumulation over two micro-batches).
    let shape = StepShape {
        grad_accum: 2,
        needs_global_norm: true,
        ..StepShape::cpu(B, T)
    };
    let unlimited = u64::MAX / 4;
    let input = PlanInput {
        model: &model,
        shape,
        budgets: Budgets {
            device: unlimited,
            host: unlimited,
            nvme: unlimited,
        },
        cost: Default::default(),
    };
    let plan = Plan::build(&input, &CpuOffload).unwrap();
    let mut exec = Executor::on_cpu(model.clone(), plan, &ExecConfig::default()).unwrap();
    exec.load(&params, None).unwrap();
    let step = StepParams {
        adam: AdamW::default(),
        clip: 1e9,
        loss_scale: 1.0,
    };
    // Micro-batch 1 masked, micro-batch 2 not: the mean over 2*B*T - 10 positions.
    let report = exec
        .step(&[(&inputs, &masked), (&inputs, &targets)], &step)
        .unwrap();
    let count = (2 * B * T - 2 * 5) as f64;
    let sum = losses.iter().map(|&l| f64::from(l)).sum::<f64>()
        + plain.iter().map(|&l| f64::from(l)).sum::<f64>();
    let want_loss = sum / count;
    assert!(
        (f64::from(report.loss) - want_loss).abs() < 1e-6 * want_loss,
        "{} vs {want_loss}",
        report.loss
    );
    runner.forward(&inputs, &masked).unwrap();
    let g1 = runner.backward().unwrap();
    runner.forward(&inputs, &targets).unwrap();
    let g2 = runner.backward().unwrap();
    // The runner's gradients are of each micro-batch's own mean: weight them by the
    // positions each counts, over all the step counts.
    let (n1, n2) = ((B * T - 10) as f64, (B * T) as f64);
    let combined: Vec<Vec<f32>> = g1
        .iter()
        .zip(&g2)
        .map(|(a, b)| {
            a.iter()
                .zip(b)
                .map(|(&x, &y)| ((f64::from(x) * n1 + f64::from(y) * n2) / count) as f32)
                .collect()
        })
        .collect();
    let want_norm = norm(&combined);
    assert!(
        (report.grad_norm - want_norm).abs() < 1e-4 * want_norm,
        "{} vs {want_norm}",
        report.grad_norm
    );
}
