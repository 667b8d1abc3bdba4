//! What the CPU kernels' test files share: the CPUs to run each kernel under, random
//! inputs, and the element-by-element check against a reference. A folder module, so
//! that cargo does not build it as a test of its own.

use rand::RngExt;
use rand::rngs::StdRng;
use strata_kernels::isa::Isa;
use strata_kernels::ops::Cpu;

/// Every (instruction set, thread count) pair to run each kernel under.
pub fn cpus() -> Vec<Cpu> {
    let mut out = Vec::new();
    for isa in Isa::supported() {
        out.push(Cpu::single(isa));
        out.push(Cpu { isa, threads: 3 });
    }
    out
}

pub fn random(rng: &mut StdRng, len: usize, scale: f32) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-scale..scale)).collect()
}

pub fn wide(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// Asserts `|got - want| <= atol + rtol |want|` everywhere, naming the worst element.
#[track_caller]
pub fn check(what: &str, got: &[f32], want: &[f64], atol: f64, rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = (0.0f64, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let excess = (g as f64 - w).abs() - (atol + rtol * w.abs());
        if excess > worst.0 || g.is_nan() {
            worst = (excess.max(f64::MIN_POSITIVE), i);
        }
    }
    if worst.0 > 0.0 {
        let i = worst.1;
        panic!(
            "{what}: element {i} is {} but the reference says {}",
            got[i], want[i]
        );
    }
}
