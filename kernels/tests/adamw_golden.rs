//! AdamW against torch.optim.AdamW: 100,003 parameters, 3 steps, golden data made by
//! PyTorch (tests/data/adamw/README.md). Every kernel the CPU supports, and the scalar
//! reference, must match params after each step and the final m and v within
//! 1e-6 relative + 1e-7 absolute per element. Prints the measured maximum errors
//! (`cargo test --test adamw_golden -- --nocapture`).

use std::path::PathBuf;

use strata_kernels::adamw::{AdamStep, AdamW, CopyOut, Grads, State};
use strata_kernels::isa::Isa;
use strata_kernels::reference;

const RTOL: f64 = 1e-6;
const ATOL: f64 = 1e-7;

fn data_path(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data/adamw")
        .join(file)
}

struct Golden {
    tensors: Vec<(String, Vec<f32>)>,
}

impl Golden {
    fn load() -> Golden {
        let path = data_path("adamw.safetensors");
        let bytes = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("cannot read golden data {}: {e}", path.display()));
        let file = safetensors::SafeTensors::deserialize(&bytes).expect("valid safetensors");
        let tensors = file
            .tensors()
            .into_iter()
            .map(|(name, view)| {
                assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
                let values = view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                (name, values)
            })
            .collect();
        Golden { tensors }
    }

    fn get(&self, name: &str) -> &[f32] {
        &self
            .tensors
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("golden data has no tensor {name}"))
            .1
    }
}

/// The hyper-parameters of tests/data/adamw/meta.json.
fn hyper_parameters() -> AdamW {
    let meta = std::fs::read_to_string(data_path("meta.json")).expect("meta.json");
    // The file is flat JSON of numbers; check the values this test states.
    for key in [
        "\"lr\": 0.001",
        "\"b1\": 0.9",
        "\"b2\": 0.999",
        "\"eps\": 1e-08",
        "\"wd\": 0.01",
        "\"steps\": 3",
    ] {
        assert!(meta.contains(key), "meta.json no longer says {key}");
    }
    AdamW {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    }
}

/// Asserts every element is within tolerance; returns the largest absolute error, the
/// largest relative error, and the largest error as a fraction of the tolerance.
fn compare(name: &str, got: &[f32], want: &[f32]) -> (f64, f64, f64) {
    assert_eq!(got.len(), want.len());
    let (mut abs_max, mut rel_max, mut worst) = (0f64, 0f64, 0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (f64::from(g), f64::from(w));
        let err = (g - w).abs();
        let ratio = err / (ATOL + RTOL * w.abs());
        assert!(
            ratio <= 1.0,
            "{name}[{i}]: got {g:e}, torch {w:e}, error {err:e} > {ATOL:e} + {RTOL:e} * |torch|"
        );
        worst = worst.max(ratio);
        abs_max = abs_max.max(err);
        if w != 0.0 {
            rel_max = rel_max.max(err / w.abs());
        }
    }
    (abs_max, rel_max, worst)
}

type StepFn<'a> = dyn Fn(&AdamStep, &mut [f32], &mut [f32], &mut [f32], &[f32]) + 'a;

fn run(label: &str, golden: &Golden, step: &StepFn<'_>) {
    let hp = hyper_parameters();
    let mut p = golden.get("p0").to_vec();
    let mut m = vec![0f32; p.len()];
    let mut v = vec![0f32; p.len()];
    let report = |name: &str, (abs, rel, worst): (f64, f64, f64)| {
        println!(
            "{label:>9} {name:>2}: max abs {abs:.3e}  max rel {rel:.3e}  worst/tol {worst:.3}"
        );
    };
    for t in 1..=3u64 {
        let k = AdamStep::new(&hp, t, 1.0).unwrap();
        step(&k, &mut p, &mut m, &mut v, golden.get(&format!("g{t}")));
        let want = golden.get(&format!("p{t}"));
        report(
            &format!("p{t}"),
            compare(&format!("{label} p{t}"), &p, want),
        );
    }
    report("m", compare(&format!("{label} m"), &m, golden.get("m")));
    report("v", compare(&format!("{label} v"), &v, golden.get("v")));
}

#[test]
fn reference_matches_torch() {
    let golden = Golden::load();
    run("reference", &golden, &|k, p, m, v, g| {
        reference::adamw::step(k, p, m, v, Grads::F32(g), CopyOut::None)
    });
}

#[test]
fn every_kernel_matches_torch() {
    let golden = Golden::load();
    for isa in Isa::supported() {
        for threads in [1, 2] {
            run(&format!("{isa}/{threads}"), &golden, &|k, p, m, v, g| {
                k.apply(
                    isa,
                    threads,
                    p,
                    State::F32 { m, v },
                    Grads::F32(g),
                    CopyOut::None,
                )
                .unwrap()
            });
        }
    }
}
