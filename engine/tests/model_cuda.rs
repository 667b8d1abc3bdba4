//! The model on a GPU, through the device layer's CUDA device: the reference data from
//! PyTorch in f32 (‖out − ref‖ / ‖ref‖ < 1e-5, as on the CPU), bf16 against the CPU's
//! f32, and repeatability. Runs where a GPU and the CUDA libraries are present, and says
//! why it skips elsewhere.

mod model_support;

use half::bf16;
use model_support::{golden_dir, read_f32_tensors, rel_err};
use strata_engine::device::{CudaDevice, CudaDeviceConfig};
use strata_engine::kernels::cuda::probe;
use strata_engine::model::cuda::{CudaBackend, DeviceFloat};
use strata_engine::model::data::{Batch, TokenData};
use strata_engine::model::weights::{self, load_pretrained};
use strata_engine::model::{Backend, CpuBackend, Model};

const B: usize = 2;
const T: usize = 16;

fn device() -> Option<CudaDevice> {
    if let Err(e) = probe().require_all() {
        println!("skipped: {e}");
        return None;
    }
    let config = CudaDeviceConfig {
        ordinal: 0,
        memory_budget_bytes: 0,
        needs_kernels: true,
    };
    Some(CudaDevice::new(config).expect("GPU 0 opens"))
}

/// Loss, logits and per-block gradients of one forward and backward pass on `be`.
fn pass<Be: Backend>(
    be: &Be,
    model: &Model,
    host_params: &[Vec<f32>],
    batch: &Batch,
) -> (f32, Vec<f32>, Vec<Vec<f32>>) {
    let params: Vec<Be::Params> = host_params
        .iter()
        .map(|p| be.upload_params(p).unwrap())
        .collect();
    let mut ws = model.workspace(be, B, T).unwrap();
    let loss = model
        .forward(be, &params, &mut ws, &batch.inputs, &batch.targets)
        .unwrap();
    let logits = be.download_act(&ws.scratch.logits).unwrap();
    let mut grads = model.alloc_grads(be).unwrap();
    model.backward(be, &params, &mut grads, &mut ws).unwrap();
    let grads = grads
        .iter()
        .map(|g| be.download_grads(g).unwrap())
        .collect();
    (loss, logits, grads)
}

fn golden() -> (Model, Vec<Vec<f32>>, Batch) {
    let dir = golden_dir();
    let (model, params) = load_pretrained(&dir).unwrap();
    let data = TokenData::open(&dir.join("tokens.bin")).unwrap();
    let mut batch = Batch::default();
    data.read_batch(0, B, T, model.config().vocab, &mut batch)
        .unwrap();
    (model, params, batch)
}

/// The largest per-tensor relative error of `got` against `want`, and its tensor.
fn worst_tensor(model: &Model, got: &[Vec<f32>], want: impl Fn(&str) -> Vec<f32>) -> (f64, String) {
    let mut worst = (0.0, String::new());
    for (block, g) in model.blocks().iter().zip(got) {
        for t in &block.tensors {
            let err = rel_err(&g[t.slot.range()], &want(&t.name));
            if err > worst.0 {
                worst = (err, t.name.clone());
            }
        }
    }
    worst
}

#[test]
fn f32_on_the_gpu_matches_pytorch() {
    let Some(device) = device() else { return };
    let be = CudaBackend::<f32>::on_device(&device).unwrap();
    let (model, params, batch) = golden();
    let expected = read_f32_tensors(&golden_dir().join("expected.safetensors"));
    let (loss, logits, grads) = pass(&be, &model, &params, &batch);
    let logits_err = rel_err(&logits, &expected["logits0"]);
    let loss_err = rel_err(&[loss], &expected["losses"][..1]);
    let (grad_err, tensor) = worst_tensor(&model, &grads, |name| {
        expected[&format!("grad0.{}{name}", weights::PREFIX)].clone()
    });
    println!(
        "{}: logits {logits_err:.3e}, loss {loss_err:.3e}, worst gradient {grad_err:.3e} ({tensor})",
        be.describe()
    );
    assert!(logits_err < 1e-5 && loss_err < 1e-5 && grad_err < 1e-5);
    // The same pass again gives the same bits: no float atomics anywhere.
    let (again_loss, again_logits, again_grads) = pass(&be, &model, &params, &batch);
    assert_eq!(loss.to_bits(), again_loss.to_bits());
    assert!(
        logits
            .iter()
            .zip(&again_logits)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
    assert!(
        grads
            .iter()
            .flatten()
            .zip(again_grads.iter().flatten())
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
}

#[test]
fn bf16_on_the_gpu_stays_close_to_the_cpu() {
    let Some(device) = device() else { return };
    let be = CudaBackend::<bf16>::on_device(&device).unwrap();
    let (model, params, batch) = golden();
    // Both sides start from the bf16-rounded parameters, so only the arithmetic differs.
    let rounded: Vec<Vec<f32>> = params
        .iter()
        .map(|p| bf16::to_host(&bf16::from_host(p)))
        .collect();
    let (cpu_loss, cpu_logits, cpu_grads) = pass(&CpuBackend::default(), &model, &rounded, &batch);
    let (loss, logits, grads) = pass(&be, &model, &rounded, &batch);
    let loss_err = rel_err(&[loss], &[cpu_loss]);
    let logits_err = rel_err(&logits, &cpu_logits);
    let (grad_err, tensor) = worst_tensor(&model, &grads, |name| {
        let (block, spec) = model.find_tensor(name).unwrap();
        cpu_grads[block][spec.slot.range()].to_vec()
    });
    println!(
        "{}: loss {loss} (cpu {cpu_loss}, {loss_err:.2e}), logits {logits_err:.2e}, worst \
         gradient {grad_err:.2e} ({tensor})",
        be.describe()
    );
    assert!(
        loss_err < 1e-2 && logits_err < 2e-2,
        "bf16 forward too far from f32"
    );
    assert!(grad_err < 1e-1, "bf16 gradients too far from f32");
}
