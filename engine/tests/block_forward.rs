//! The forward a block at a time ([`BlockForward`]) gives the whole-model runner's loss
//! bit for bit, on GPT-2 (whose head ties the embedding) and Llama with and without tied
//! embeddings, with a masked target among the batch.

use strata_engine::exec::{BlockForward, Runner};
use strata_engine::model::llama::{LlamaConfig, Variant};
use strata_engine::model::{Gpt2Config, IGNORE_TARGET, Llama, Model};

fn models() -> Vec<Model> {
    let mut untied = LlamaConfig::llama(3, 48, 80, 4, 2, 96, 32);
    untied.variant = Variant::Qwen3;
    untied.qk_norm = true;
    let mut tied = LlamaConfig::llama(2, 24, 40, 3, 1, 37, 16);
    tied.variant = Variant::Qwen2;
    tied.qkv_bias = true;
    tied.tied = true;
    vec![
        Model::new(Gpt2Config::new(3, 4, 64, 96, 32)).unwrap(),
        Model::of(Llama::new(untied).unwrap()),
        Model::of(Llama::new(tied).unwrap()),
    ]
}

#[test]
fn a_block_at_a_time_gives_the_runner_s_loss_bit_for_bit() {
    for model in models() {
        let (batch, seq) = (2, 7);
        let n = batch * seq;
        let vocab = model.vocab() as u32;
        let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 7 + 3) % vocab).collect();
        let mut targets: Vec<u32> = (0..n as u32).map(|i| (i * 5 + 1) % vocab).collect();
        targets[3] = IGNORE_TARGET;
        let params = model.init_params(5);
        let mut runner = Runner::on_cpu(model.clone(), batch, seq).unwrap();
        runner.load(&params).unwrap();
        let whole = runner.forward(&tokens, &targets).unwrap();
        let blocks = BlockForward::on_cpu(model.clone(), batch, seq).unwrap();
        let read = std::cell::Cell::new(0);
        let streamed = blocks
            .forward(&tokens, &targets, &|b| {
                read.set(read.get() + 1);
                Ok(params[b].clone())
            })
            .unwrap();
        assert_eq!(
            whole.to_bits(),
            streamed.to_bits(),
            "{}: {whole} whole, {streamed} a block at a time",
            model.describe()
        );
        let tied = (0..model.blocks().len())
            .filter(|&b| model.tied(b).is_some())
            .count();
        assert_eq!(
            read.get(),
            model.blocks().len() + tied,
            "{}",
            model.describe()
        );
    }
}
