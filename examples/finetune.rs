//! `strata train`'s default job through the library API: the small GPT on the built-in
//! corpus, planned under tight budgets (auto picks NVMe offload), 50 AdamW steps, then a
//! checkpoint that resumes exactly and the model in Hugging Face's format.
//! Run: `cargo run --release --example finetune`.

use strata::engine::checkpoint::{self, Checkpoint, TrainerState};
use strata::engine::exec::{ExecConfig, Executor, StepParams};
use strata::engine::kernels::adamw::AdamW;
use strata::engine::model::data::{Batch, TokenData};
use strata::engine::model::{Gpt2Config, Model, weights};
use strata::engine::plan::{Auto, Budgets, PlanInput, StepShape};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join("strata-finetune-example");
    std::fs::create_dir_all(&dir)?;
    let model = Model::new(Gpt2Config::preset("small")?)?;
    let data = TokenData::open(&strata::corpus::ensure_file(&dir, 1 << 20, 1)?)?;

    // Plan a step of 8 x 64 tokens, clipped, under the budgets; nothing is allocated yet.
    let budgets = Budgets::new(16 << 20, 8 << 20, 1 << 30);
    let input = PlanInput::new(&model, StepShape::cpu(8, 64).clipped(), budgets);
    let (_, plan, _) = Auto::default().choose(&input)?;
    println!("plan {}: peak bytes per tier {:?}", plan.policy, plan.peak);

    let config = ExecConfig::with_nvme(vec![dir.clone()]);
    let mut exec = Executor::on_cpu(model.clone(), plan, &config)?;
    exec.load(&model.init_params(1337), None)?;
    let mut adam = AdamW::default();
    (adam.lr, adam.beta2, adam.weight_decay) = (3e-3, 0.95, 0.1);
    let hp = StepParams {
        adam,
        clip: 1.0,
        loss_scale: 1.0,
    };
    let mut batch = Batch::default();
    for step in 1..=50 {
        data.read_batch(step - 1, 8, 64, 256, &mut batch)?;
        let r = exec.step(&[(&batch.inputs, &batch.targets)], &hp)?;
        let stall = 100.0 * r.stall_fraction();
        println!(
            "step {step}: loss {:.4}, {:.1} ms, stall {stall:.0}%",
            r.loss,
            r.seconds * 1e3
        );
    }

    // A checkpoint that resumes exactly, and the model for transformers.
    let (params, m, v) = exec.export()?;
    let state = TrainerState::after(50, 50, 1337);
    let ckpt = Checkpoint {
        model: model.clone(),
        params,
        m,
        v,
        state,
    };
    let saved = checkpoint::save(&dir.join("ckpt"), &ckpt, 2)?;
    weights::save_pretrained(&model, &ckpt.params, &dir.join("model"))?;
    println!(
        "checkpoint {}; model {}",
        saved.display(),
        dir.join("model").display()
    );
    Ok(())
}
