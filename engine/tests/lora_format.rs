//! LoRA adapters in peft's format (`strata_engine::model::lora`), against
//! `tests/data/lora-tiny` (a peft 0.21 adapter on a Llama base; see its README):
//!
//! 1. Reading `adapter0` gives the file's tensors on the layers its config targets.
//! 2. Writing then reading round-trips bit for bit, in f32 (bf16: the values rounded),
//!    and the written `adapter_config.json` is adapter0's but for the base's name.
//! 3. Merging `adapter0` into `base` and evaluating step 0's batch with strata's forward
//!    gives the loss peft's model had before any update (`meta.json`), within 1e-5; a
//!    merged model folder loads as the merged parameters.
//! 4. GPT-2 (Conv1D weights stored (in, out), `c_proj` in the attention and the MLP):
//!    each merged layer maps an input as `W x + scale · B (A x)` computed directly.
//! 5. The refusals: DoRA, trained biases, modules_to_save, per-layer ranks, a regular
//!    expression or unknown target, an initialisation that changed the base (PiSSA), a
//!    missing tensor, a wrong shape, an extra tensor.
//! 6. peft's step-0 gradients of every `lora_A` and `lora_B` (`grads0.safetensors`, made
//!    by the `make_lora_grads_golden.py` beside it) follow, within 1e-5, from strata's
//!    gradient of the merged weight: `W' = W + s B A`, so `dA = s Bᵀ G` and `dB = s G Aᵀ`
//!    for `G = dL/dW'`. The reference a LoRA trainer's adapter gradients will be held to.
//!
//! `STRATA_LORA_OUT=DIR` also writes, for dev/check-peft-adapter, adapter0 as strata
//! writes it (`DIR/llama-adapter`), and a GPT-2 adapter on `tests/data/gpt2-tiny` with
//! the model merged by strata (`DIR/gpt2-adapter`, `DIR/gpt2-merged`).

mod model_support;

use std::path::{Path, PathBuf};

use model_support::{data_dir, read_f32_tensors, rel_err};
use serde_json::Value;
use strata_engine::exec::Runner;
use strata_engine::model::data::{Batch, TokenData};
use strata_engine::model::lora::{
    ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, LoraAdapter, LoraConfig, WeightLayout, merge_params,
    peft_names, save_merged, select_layers,
};
use strata_engine::model::weights::{FileDtype, load_config, load_pretrained};
use strata_engine::model::{Gpt2Config, Model};

const B: usize = 2;
const T: usize = 16;
const TOLERANCE: f64 = 1e-5;

fn lora_dir() -> PathBuf {
    data_dir("lora-tiny")
}

fn base_model() -> Model {
    load_config(&lora_dir().join("base/config.json")).unwrap()
}

fn meta() -> Value {
    let text = std::fs::read_to_string(lora_dir().join("meta.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Values in [-0.1, 0.1), deterministic in `seed` (xorshift).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
        })
        .collect()
}

/// The paths of the adapter's layers, in order.
fn module_paths(adapter: &LoraAdapter) -> Vec<&str> {
    adapter
        .layers
        .iter()
        .map(|w| w.layer.module.as_str())
        .collect()
}

/// Where `STRATA_LORA_OUT` asks for the files dev/check-peft-adapter reads.
fn kept_dir(name: &str) -> Option<PathBuf> {
    std::env::var_os("STRATA_LORA_OUT").map(|d| PathBuf::from(d).join(name))
}

#[test]
fn reading_adapter0_gives_the_files_tensors_on_the_targeted_layers() {
    let model = base_model();
    let adapter = LoraAdapter::read(&lora_dir().join("adapter0"), &model).unwrap();
    assert_eq!(adapter.config.rank, 4);
    assert_eq!(adapter.config.alpha, 8.0);
    assert_eq!(adapter.config.scale(), 2.0);
    assert_eq!(adapter.config.targets, ["q_proj", "v_proj"]);
    let modules = module_paths(&adapter);
    assert_eq!(
        modules,
        [
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.v_proj",
            "model.layers.1.self_attn.q_proj",
            "model.layers.1.self_attn.v_proj",
        ]
    );
    let file = read_f32_tensors(&lora_dir().join("adapter0").join(ADAPTER_WEIGHTS_FILE));
    assert_eq!(file.len(), 2 * adapter.layers.len());
    for w in &adapter.layers {
        let (in_f, out_f) = (w.layer.in_features, w.layer.out_features);
        let want_out = if w.layer.module.ends_with("q_proj") {
            64
        } else {
            32
        };
        assert_eq!((in_f, out_f), (64, want_out), "{}", w.layer.module);
        let [a, b] = peft_names(&w.layer);
        assert_eq!(bits(&w.a), bits(&file[&a]), "{a}");
        assert_eq!(bits(&w.b), bits(&file[&b]), "{b}");
    }
}

#[test]
fn writing_then_reading_round_trips_bit_for_bit() {
    let model = base_model();
    let adapter = LoraAdapter::read(&lora_dir().join("adapter0"), &model).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("adapter");
    adapter.write(&out, "the/base", FileDtype::F32).unwrap();
    let again = LoraAdapter::read(&out, &model).unwrap();
    assert_eq!(again.config, adapter.config);
    for (x, y) in again.layers.iter().zip(&adapter.layers) {
        assert_eq!(x.layer, y.layer);
        assert_eq!((bits(&x.a), bits(&x.b)), (bits(&y.a), bits(&y.b)));
    }
    let file = read_f32_tensors(&out.join(ADAPTER_WEIGHTS_FILE));
    let original = read_f32_tensors(&lora_dir().join("adapter0").join(ADAPTER_WEIGHTS_FILE));
    assert_eq!(file, original, "the same names and values as peft's file");
    // The settings are peft's, key for key, but for the base's name.
    let mut written = read_json(&out.join(ADAPTER_CONFIG_FILE));
    let mut peft = read_json(&lora_dir().join("adapter0").join(ADAPTER_CONFIG_FILE));
    assert_eq!(written["base_model_name_or_path"], "the/base");
    written["base_model_name_or_path"] = Value::Null;
    peft["base_model_name_or_path"] = Value::Null;
    assert_eq!(written, peft);
    if let Some(keep) = kept_dir("llama-adapter") {
        let base = lora_dir().join("base").canonicalize().unwrap();
        adapter
            .write(&keep, base.to_str().unwrap(), FileDtype::F32)
            .unwrap();
    }
}

#[test]
fn a_bf16_adapter_reads_as_its_values_rounded() {
    let model = base_model();
    let adapter = LoraAdapter::read(&lora_dir().join("adapter0"), &model).unwrap();
    let dir = tempfile::tempdir().unwrap();
    adapter.write(dir.path(), "base", FileDtype::Bf16).unwrap();
    let again = LoraAdapter::read(dir.path(), &model).unwrap();
    let round = |x: &[f32]| -> Vec<u32> {
        x.iter()
            .map(|v| half::bf16::from_f32(*v).to_f32().to_bits())
            .collect()
    };
    for (x, y) in again.layers.iter().zip(&adapter.layers) {
        assert_eq!(bits(&x.a), round(&y.a), "{}", x.layer.module);
        assert_eq!(bits(&x.b), round(&y.b), "{}", x.layer.module);
    }
}

/// Step 0's batch of the golden data.
fn step0_batch(model: &Model) -> Batch {
    let data = TokenData::open(&lora_dir().join("tokens.bin")).unwrap();
    let mut batch = Batch::default();
    data.read_batch(0, B, T, model.vocab(), &mut batch).unwrap();
    batch
}

fn loss_of(model: &Model, params: &[Vec<f32>]) -> f32 {
    let batch = step0_batch(model);
    let mut runner = Runner::on_cpu(model.clone(), B, T).unwrap();
    runner.load(params).unwrap();
    runner.forward(&batch.inputs, &batch.targets).unwrap()
}

#[test]
fn merging_adapter0_gives_peft_loss_before_training() {
    let (model, base) = load_pretrained(&lora_dir().join("base")).unwrap();
    let adapter = LoraAdapter::read(&lora_dir().join("adapter0"), &model).unwrap();
    let merged = merge_params(&model, &base, &adapter).unwrap();
    let want = meta()["losses"][0].as_f64().unwrap() as f32;
    let (loss, base_loss) = (loss_of(&model, &merged), loss_of(&model, &base));
    let err = rel_err(&[loss], &[want]);
    println!("merged {loss}, peft {want}, relative error {err:.3e}; base alone {base_loss}");
    assert!(err < TOLERANCE, "merged loss {loss} vs peft's {want}");
    // The adapter's share is far above the tolerance: a merge that dropped it fails.
    assert!(rel_err(&[base_loss], &[want]) > 10.0 * TOLERANCE);
    // Only the adapted weights change.
    for (b, block) in model.blocks().iter().enumerate() {
        for t in &block.tensors {
            let changed = merged[b][t.slot.range()] != base[b][t.slot.range()];
            let adapted = t.name.ends_with("q_proj.weight") || t.name.ends_with("v_proj.weight");
            assert_eq!(changed, adapted, "{}", t.name);
        }
    }
}

#[test]
fn a_merged_folder_loads_as_the_merged_parameters() {
    let (model, base) = load_pretrained(&lora_dir().join("base")).unwrap();
    let adapter = LoraAdapter::read(&lora_dir().join("expected"), &model).unwrap();
    let merged = merge_params(&model, &base, &adapter).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("merged");
    save_merged(&lora_dir().join("base"), &lora_dir().join("expected"), &out).unwrap();
    let (again, params) = load_pretrained(&out).unwrap();
    assert_eq!(again, model);
    for (x, y) in params.iter().zip(&merged) {
        assert_eq!(bits(x), bits(y));
    }
    let config = read_json(&out.join("config.json"));
    assert_eq!(config["dtype"], "float32", "the base's dtype");
}

/// A GPT-2 of 2 layers, width 32, and an adapter of rank 3 on c_attn, c_proj and c_fc
/// with random A and B, its parameters random too.
fn gpt2_with_adapter() -> (Model, Vec<Vec<f32>>, LoraAdapter) {
    let model = Model::new(Gpt2Config::new(2, 2, 32, 64, 32)).unwrap();
    let params: Vec<Vec<f32>> = (0..model.blocks().len())
        .map(|b| values(model.blocks()[b].len, 100 + b as u64))
        .collect();
    let targets = ["c_attn", "c_proj", "c_fc"].map(String::from).to_vec();
    let config = LoraConfig::new(3, 5.0, 0.05, targets).unwrap();
    let mut seed = 0;
    let adapter = LoraAdapter::new(&model, config, |layer| {
        seed += 2;
        let a = values(3 * layer.in_features, seed);
        let b = values(layer.out_features * 3, seed + 1);
        (a, b)
    })
    .unwrap();
    (model, params, adapter)
}

#[test]
fn a_merged_gpt2_conv1d_layer_maps_inputs_as_base_plus_scaled_update() {
    let (model, params, adapter) = gpt2_with_adapter();
    let modules = module_paths(&adapter);
    assert_eq!(
        &modules[..4],
        [
            "transformer.h.0.attn.c_attn",
            "transformer.h.0.attn.c_proj",
            "transformer.h.0.mlp.c_fc",
            "transformer.h.0.mlp.c_proj",
        ],
        "c_proj selects the attention's and the MLP's"
    );
    assert_eq!(adapter.layers.len(), 8);
    let merged = merge_params(&model, &params, &adapter).unwrap();
    let scale = 5.0f64 / 3.0;
    for w in &adapter.layers {
        let l = &w.layer;
        assert_eq!(l.layout, WeightLayout::InOut);
        let spec = model.blocks()[l.block].tensor(&l.weight).unwrap();
        assert_eq!(
            spec.shape,
            [l.in_features, l.out_features],
            "Conv1D: (in, out)"
        );
        let (base, new) = (
            &params[l.block][spec.slot.range()],
            &merged[l.block][spec.slot.range()],
        );
        let x: Vec<f64> = values(l.in_features, 7).iter().map(|&v| v as f64).collect();
        // y = x W (Conv1D), in f64.
        let conv = |w: &[f32], o: usize| -> f64 {
            (0..l.in_features)
                .map(|i| x[i] * w[i * l.out_features + o] as f64)
                .sum()
        };
        let ax: Vec<f64> = (0..3)
            .map(|k| {
                (0..l.in_features)
                    .map(|i| w.a[k * l.in_features + i] as f64 * x[i])
                    .sum()
            })
            .collect();
        let got: Vec<f32> = (0..l.out_features).map(|o| conv(new, o) as f32).collect();
        let want: Vec<f32> = (0..l.out_features)
            .map(|o| {
                let bax: f64 = (0..3).map(|k| w.b[o * 3 + k] as f64 * ax[k]).sum();
                (conv(base, o) + scale * bax) as f32
            })
            .collect();
        let err = rel_err(&got, &want);
        assert!(err < TOLERANCE, "{}: {err:.3e}", l.module);
    }
}

#[test]
fn a_gpt2_adapter_is_written_with_fan_in_fan_out() {
    let (model, _, adapter) = gpt2_with_adapter();
    let dir = tempfile::tempdir().unwrap();
    adapter.write(dir.path(), "gpt2", FileDtype::F32).unwrap();
    let config = read_json(&dir.path().join(ADAPTER_CONFIG_FILE));
    assert_eq!(config["fan_in_fan_out"], true);
    assert_eq!(
        config["target_modules"],
        serde_json::json!(["c_attn", "c_proj", "c_fc"])
    );
    let again = LoraAdapter::read(dir.path(), &model).unwrap();
    assert!(again == adapter, "the GPT-2 adapter read back differs");
    if let Some(keep) = kept_dir("gpt2-adapter") {
        // The same adapter on the golden GPT-2, with the model strata merges from it.
        let gpt2 = data_dir("gpt2-tiny").canonicalize().unwrap();
        let (model, _) = load_pretrained(&gpt2).unwrap();
        let config = adapter.config.clone();
        let mut seed = 0;
        let on_golden = LoraAdapter::new(&model, config, |layer| {
            seed += 2;
            (
                values(3 * layer.in_features, seed),
                values(layer.out_features * 3, seed + 1),
            )
        })
        .unwrap();
        on_golden
            .write(&keep, gpt2.to_str().unwrap(), FileDtype::F32)
            .unwrap();
        save_merged(&gpt2, &keep, &keep.with_file_name("gpt2-merged")).unwrap();
    }
}

#[test]
fn rslora_scales_by_the_square_root_of_the_rank() {
    let mut json = read_json(&lora_dir().join("adapter0").join(ADAPTER_CONFIG_FILE));
    json["use_rslora"] = Value::Bool(true);
    let config = LoraConfig::from_json(&json).unwrap();
    assert!(config.rslora);
    assert_eq!(config.scale(), 8.0 / 2.0);
}

/// adapter0 with `edit` applied to its settings, in a folder of its own.
fn edited_adapter(edit: impl FnOnce(&mut Value)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let from = lora_dir().join("adapter0");
    let mut json = read_json(&from.join(ADAPTER_CONFIG_FILE));
    edit(&mut json);
    std::fs::write(dir.path().join(ADAPTER_CONFIG_FILE), json.to_string()).unwrap();
    std::fs::copy(
        from.join(ADAPTER_WEIGHTS_FILE),
        dir.path().join(ADAPTER_WEIGHTS_FILE),
    )
    .unwrap();
    dir
}

fn read_error(dir: &Path) -> String {
    LoraAdapter::read(dir, &base_model())
        .unwrap_err()
        .to_string()
}

#[test]
fn peft_features_strata_does_not_apply_are_refused_by_name() {
    let cases: [(&str, Value, &str); 7] = [
        ("use_dora", Value::Bool(true), "DoRA"),
        ("bias", "lora_only".into(), "bias"),
        (
            "modules_to_save",
            serde_json::json!(["lm_head"]),
            "modules_to_save",
        ),
        (
            "rank_pattern",
            serde_json::json!({"q_proj": 8}),
            "rank_pattern",
        ),
        (
            "alpha_pattern",
            serde_json::json!({"q_proj": 8}),
            "alpha_pattern",
        ),
        ("target_modules", ".*q_proj".into(), "regular expression"),
        (
            "init_lora_weights",
            "pissa_niter_4".into(),
            "path_initial_model",
        ),
    ];
    for (key, value, named) in cases {
        let dir = edited_adapter(|j| j[key] = value.clone());
        let message = read_error(dir.path());
        assert!(message.contains(named), "{key}: {message}");
    }
}

#[test]
fn targets_outside_the_blocks_or_nowhere_are_refused() {
    let model = base_model();
    for (target, named) in [
        ("lm_head", "outside the transformer blocks"),
        ("qproj", "no linear layer"),
    ] {
        let config = LoraConfig::new(4, 8.0, 0.0, vec![target.into()]).unwrap();
        let message = select_layers(&model, &config).unwrap_err().to_string();
        assert!(
            message.contains(named) && message.contains(target),
            "{message}"
        );
    }
}

/// adapter0's tensors as `edit` leaves them, written beside adapter0's settings.
fn edited_tensors(edit: impl FnOnce(&mut Vec<(String, Vec<usize>, Vec<u8>)>)) -> tempfile::TempDir {
    let dir = edited_adapter(|_| {});
    let path = dir.path().join(ADAPTER_WEIGHTS_FILE);
    let bytes = std::fs::read(&path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = file
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.shape().to_vec(), v.data().to_vec()))
        .collect();
    tensors.sort();
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, s, d)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d);
            (n.clone(), view.unwrap())
        })
        .collect();
    std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
    dir
}

#[test]
fn a_missing_or_misshapen_or_extra_tensor_is_refused_by_name() {
    let name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight";
    let missing = edited_tensors(|t| t.retain(|(n, _, _)| n != name));
    let message = read_error(missing.path());
    assert!(
        message.contains(name) && message.contains("missing"),
        "{message}"
    );
    // B of v_proj given q_proj's 64 rows.
    let misshapen = edited_tensors(|t| {
        let at = t.iter().position(|(n, _, _)| n == name).unwrap();
        t[at].1 = vec![64, 4];
        t[at].2 = vec![0; 64 * 4 * 4];
    });
    let message = read_error(misshapen.path());
    assert!(
        message.contains(name) && message.contains("[64, 4]"),
        "{message}"
    );
    let extra = edited_tensors(|t| {
        let renamed = name.replace("lora_B.weight", "lora_B.default.weight");
        let copy = (renamed, t[0].1.clone(), t[0].2.clone());
        t.push(copy);
    });
    let message = read_error(extra.path());
    assert!(message.contains("lora_B.default.weight"), "{message}");
    // A rank the tensors do not have.
    let rank = edited_adapter(|j| j["r"] = 2.into());
    let message = read_error(rank.path());
    assert!(
        message.contains("lora_A.weight") && message.contains("[2, 64]"),
        "{message}"
    );
}

#[test]
fn peft_adapter_gradients_follow_from_the_merged_weights_gradient() {
    let (model, base) = load_pretrained(&lora_dir().join("base")).unwrap();
    let adapter = LoraAdapter::read(&lora_dir().join("adapter0"), &model).unwrap();
    let merged = merge_params(&model, &base, &adapter).unwrap();
    let batch = step0_batch(&model);
    let mut runner = Runner::on_cpu(model.clone(), B, T).unwrap();
    runner.load(&merged).unwrap();
    let loss = runner.forward(&batch.inputs, &batch.targets).unwrap();
    let want_loss = meta()["grads0_loss"].as_f64().unwrap() as f32;
    assert!(
        rel_err(&[loss], &[want_loss]) < TOLERANCE,
        "{loss} vs {want_loss}"
    );
    let grads = runner.backward().unwrap();
    let want = read_f32_tensors(&lora_dir().join("grads0.safetensors"));
    assert_eq!(want.len(), 2 * adapter.layers.len(), "the golden's tensors");
    let (scale, rank) = (adapter.config.scale(), adapter.config.rank);
    for w in &adapter.layers {
        let spec = model.blocks()[w.layer.block]
            .tensor(&w.layer.weight)
            .unwrap();
        // The Llama family's weights are (out, in), as nn.Linear stores them.
        assert_eq!(w.layer.layout, WeightLayout::OutIn);
        let g = &grads[w.layer.block][spec.slot.range()];
        let (n_in, n_out) = (w.layer.in_features, w.layer.out_features);
        let mut da = vec![0f32; rank * n_in];
        for k in 0..rank {
            for i in 0..n_in {
                let sum: f64 = (0..n_out)
                    .map(|o| w.b[o * rank + k] as f64 * g[o * n_in + i] as f64)
                    .sum();
                da[k * n_in + i] = (scale * sum) as f32;
            }
        }
        let mut db = vec![0f32; n_out * rank];
        for o in 0..n_out {
            for k in 0..rank {
                let sum: f64 = (0..n_in)
                    .map(|i| g[o * n_in + i] as f64 * w.a[k * n_in + i] as f64)
                    .sum();
                db[o * rank + k] = (scale * sum) as f32;
            }
        }
        let [name_a, name_b] = peft_names(&w.layer);
        for (name, got) in [(name_a, da), (name_b, db)] {
            let err = rel_err(&got, &want[&name]);
            println!("{name}: relative error {err:.3e}");
            assert!(err < TOLERANCE, "{name}: relative error {err:.3e}");
        }
    }
}
