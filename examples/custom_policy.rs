//! A swap policy of your own: the embedding (which the tied head reads again) and the head
//! stay on the device, transformer blocks stream from the host two blocks ahead, optimizer
//! state lives on the host. Planned beside the built-ins, it trains 3 steps; its parameters
//! must be bit-identical to `AllOnDevice`'s (invariant 1), else it exits 1.
//! Run: `cargo run --release --example custom_policy`.

use std::process::ExitCode;

use strata::engine::exec::{ExecConfig, Executor, StepParams};
use strata::engine::kernels::adamw::AdamW;
use strata::engine::model::{BlockKind, Gpt2Config, Model};
use strata::engine::plan::{
    AllOnDevice, Budgets, BuiltinPolicy, CostModel, CpuOffload, ParamOffload, Plan, PlanInput,
    Policy, StepShape, TensorClass, Tier,
};
use strata::report::{Table, format_bytes};

/// The ends of the model resident on the device, the middle streamed from the host.
#[derive(Debug)]
struct PinnedEnds;

impl Policy for PinnedEnds {
    fn name(&self) -> String {
        "pinned-ends".into()
    }
    fn home(&self, input: &PlanInput<'_>, block: usize, class: TensorClass) -> Tier {
        let end = !matches!(input.block_kind(block), BlockKind::Transformer { .. });
        match class {
            TensorClass::Params if end => Tier::Device,
            TensorClass::Checkpoints => Tier::Device,
            TensorClass::Grads | TensorClass::Optimizer | TensorClass::Params => Tier::Host,
        }
    }
}

/// Trains 3 steps of `plan` on one batch and returns the master parameters.
fn train(model: &Model, plan: Plan) -> Result<Vec<Vec<f32>>, Box<dyn std::error::Error>> {
    let config = ExecConfig::default();
    let mut exec = Executor::on_cpu(model.clone(), plan, &config)?;
    exec.load(&model.init_params(7), None)?;
    let n = exec.plan().shape.batch * exec.plan().shape.seq;
    let tokens: Vec<u32> = (0..=n as u32).map(|i| i * 7 % 4093).collect();
    let params = StepParams {
        adam: AdamW::default(),
        clip: 0.0,
        loss_scale: 1.0,
    };
    let mut losses = Vec::new();
    for _ in 0..3 {
        losses.push(exec.step(&[(&tokens[..n], &tokens[1..])], &params)?.loss);
    }
    println!("{}: losses {losses:?}", exec.plan().policy);
    Ok(exec.export()?.0)
}

fn main() -> Result<ExitCode, Box<dyn std::error::Error>> {
    let model = Model::new(Gpt2Config::new(6, 4, 128, 4096, 64))?;
    // Too small a device for everything, or for ZeRO-Offload's resident parameters.
    let budgets = Budgets {
        device: 10 << 20,
        host: 64 << 20,
        nvme: 0,
    };
    let input = PlanInput::new(&model, StepShape::cpu(2, 32), budgets);
    let mut table = Table::new("policy,device,host,h2d/step,predicted ms,fits".split(','));
    let param_offload = ParamOffload::default();
    let policies: [&dyn Policy; 4] = [&AllOnDevice, &CpuOffload, &param_offload, &PinnedEnds];
    for policy in policies {
        let plan = Plan::build(&input, policy)?;
        let ms = CostModel::default().predict(&plan).step_seconds * 1e3;
        let fits = plan
            .check_fits(&input)
            .map_or_else(|e| format!("no: {e}"), |()| "yes".into());
        let [device, host, _] = plan.peak.map(format_bytes);
        let h2d = format_bytes(plan.link_bytes[2]);
        table.row([plan.policy, device, host, h2d, format!("{ms:.3}"), fits]);
    }
    print!("{}", table.render());

    let ours = Plan::build(&input, &PinnedEnds)?;
    ours.check_fits(&input)?;
    // The reference (all on the device) ignores the device budget: it only needs RAM.
    let mut unlimited = input;
    unlimited.budgets.device = u64::MAX / 4;
    let expected = train(&model, Plan::build(&unlimited, &AllOnDevice)?)?;
    let got = train(&model, ours)?;
    let bits = |p: &[Vec<f32>]| p.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
    if bits(&expected) == bits(&got) {
        let aod = BuiltinPolicy::AllOnDevice;
        println!("parameters after 3 steps: bit-identical to {aod}");
        Ok(ExitCode::SUCCESS)
    } else {
        let aod = BuiltinPolicy::AllOnDevice;
        eprintln!("parameters after 3 steps differ from {aod}'s");
        Ok(ExitCode::FAILURE)
    }
}
