//! Every CUDA kernel against the CPU kernel of the same name, on random inputs of odd
//! sizes: in f32, ‖cuda − cpu‖ / ‖cpu‖ < 1e-5; in bf16 (inputs rounded to bf16 for both
//! sides), < 1e-2. Each test runs where a GPU and the CUDA libraries are present and
//! prints why it skips elsewhere.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use strata_kernels::cuda::{AttentionScratch, CudaFloat, CudaKernels, probe};
use strata_kernels::ops::{self, Cpu, WeightLayout};

/// The kernels on GPU 0, or `None` (after saying why) when CUDA is not usable here.
fn gpu() -> Option<CudaKernels> {
    if let Err(e) = probe().require_all() {
        println!("skipped: {e}");
        return None;
    }
    let context = CudaContext::new(0).expect("GPU 0");
    let stream = context.new_stream().expect("a stream");
    Some(CudaKernels::new(stream).expect("the kernels load"))
}

/// Host values in and out of a device type.
trait Host: CudaFloat {
    /// Tolerance of ‖cuda − cpu‖ / ‖cpu‖ for outputs of this type.
    const TOLERANCE: f64;
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl Host for f32 {
    const TOLERANCE: f64 = 1e-5;
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl Host for bf16 {
    const TOLERANCE: f64 = 1e-2;
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// Random values, already representable in `T` (so CPU and GPU see the same inputs).
fn random<T: Host>(rng: &mut StdRng, len: usize, scale: f32) -> Vec<f32> {
    (0..len)
        .map(|_| T::from_f32(rng.random_range(-scale..scale)).to_f32())
        .collect()
}

fn up<T: Host>(stream: &Arc<CudaStream>, host: &[f32]) -> CudaSlice<T> {
    let converted: Vec<T> = host.iter().map(|&x| T::from_f32(x)).collect();
    stream.clone_htod(&converted).unwrap()
}

fn down<T: Host>(stream: &Arc<CudaStream>, dev: &CudaSlice<T>) -> Vec<f32> {
    stream
        .clone_dtoh(dev)
        .unwrap()
        .into_iter()
        .map(T::to_f32)
        .collect()
}

#[track_caller]
fn check(what: &str, got: &[f32], want: &[f32], tolerance: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        diff += (g as f64 - w as f64).powi(2);
        norm += (w as f64).powi(2);
    }
    let err = (diff / norm.max(f64::MIN_POSITIVE)).sqrt();
    println!("{what}: relative error {err:.2e}");
    assert!(
        err < tolerance,
        "{what}: relative error {err:.3e} above {tolerance:e}"
    );
}

const CPU: Cpu = Cpu {
    isa: strata_kernels::isa::Isa::Portable,
    threads: 1,
};

fn encoder<T: Host>(k: &CudaKernels) {
    let s = k.stream();
    let mut rng = StdRng::seed_from_u64(1);
    let (b, t, c, v) = (3, 37, 50, 101);
    let tokens: Vec<u32> = (0..b * t).map(|_| rng.random_range(0..v as u32)).collect();
    let (wte, wpe) = (
        random::<T>(&mut rng, v * c, 1.0),
        random::<T>(&mut rng, (t + 5) * c, 1.0),
    );
    let dout = random::<T>(&mut rng, b * t * c, 1.0);
    let (dwte0, dwpe0) = (
        random::<f32>(&mut rng, v * c, 1.0),
        random::<f32>(&mut rng, (t + 5) * c, 1.0),
    );
    let mut out = vec![0.0; b * t * c];
    ops::encoder_forward(&CPU, &mut out, &tokens, &wte, &wpe, b, t, c);
    let (mut dwte, mut dwpe) = (dwte0.clone(), dwpe0.clone());
    ops::encoder_backward(&CPU, &mut dwte, &mut dwpe, &dout, &tokens, b, t, c);

    let tok = s.clone_htod(&tokens).unwrap();
    let mut out_d = up::<T>(s, &vec![0.0; b * t * c]);
    let (wte_d, wpe_d) = (up::<T>(s, &wte), up::<T>(s, &wpe));
    k.encoder_forward(
        &mut out_d.as_view_mut(),
        &tok.as_view(),
        &wte_d.as_view(),
        &wpe_d.as_view(),
        b,
        t,
        c,
    )
    .unwrap();
    check(
        &format!("encoder_forward {}", T::SUFFIX),
        &down(s, &out_d),
        &out,
        T::TOLERANCE,
    );
    let (mut dwte_d, mut dwpe_d) = (up::<f32>(s, &dwte0), up::<f32>(s, &dwpe0));
    let dout_d = up::<T>(s, &dout);
    k.encoder_backward(
        &mut dwte_d.as_view_mut(),
        &mut dwpe_d.as_view_mut(),
        &dout_d.as_view(),
        &tok.as_view(),
        b,
        t,
        c,
    )
    .unwrap();
    check(
        &format!("encoder_backward dwte {}", T::SUFFIX),
        &down(s, &dwte_d),
        &dwte,
        1e-5,
    );
    check(
        &format!("encoder_backward dwpe {}", T::SUFFIX),
        &down(s, &dwpe_d),
        &dwpe,
        1e-5,
    );
}

fn layernorm<T: Host>(k: &CudaKernels) {
    let s = k.stream();
    let mut rng = StdRng::seed_from_u64(2);
    for (n, c) in [(1, 7), (77, 50), (130, 768)] {
        let inp = random::<T>(&mut rng, n * c, 2.0);
        let (w, bias) = (random::<T>(&mut rng, c, 1.5), random::<T>(&mut rng, c, 0.5));
        let dout = random::<T>(&mut rng, n * c, 1.0);
        let dinp0 = random::<T>(&mut rng, n * c, 1.0);
        let (dw0, db0) = (
            random::<f32>(&mut rng, c, 1.0),
            random::<f32>(&mut rng, c, 1.0),
        );
        let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        ops::layernorm_forward(&CPU, &mut out, &mut mean, &mut rstd, &inp, &w, &bias, n, c);
        let (mut dinp, mut dw, mut db) = (dinp0.clone(), dw0.clone(), db0.clone());
        ops::layernorm_backward(
            &CPU, &mut dinp, &mut dw, &mut db, &dout, &inp, &w, &mean, &rstd, n, c,
        );

        let (inp_d, w_d, b_d) = (up::<T>(s, &inp), up::<T>(s, &w), up::<T>(s, &bias));
        let mut out_d = up::<T>(s, &vec![0.0; n * c]);
        let (mut mean_d, mut rstd_d) = (up::<f32>(s, &vec![0.0; n]), up::<f32>(s, &vec![0.0; n]));
        k.layernorm_forward(
            &mut out_d.as_view_mut(),
            &mut mean_d.as_view_mut(),
            &mut rstd_d.as_view_mut(),
            &inp_d.as_view(),
            &w_d.as_view(),
            &b_d.as_view(),
            n,
            c,
        )
        .unwrap();
        let tag = format!("{} n={n} c={c}", T::SUFFIX);
        check(
            &format!("layernorm_forward out {tag}"),
            &down(s, &out_d),
            &out,
            T::TOLERANCE,
        );
        check(
            &format!("layernorm_forward mean {tag}"),
            &down(s, &mean_d),
            &mean,
            1e-5,
        );
        check(
            &format!("layernorm_forward rstd {tag}"),
            &down(s, &rstd_d),
            &rstd,
            1e-5,
        );
        let mut dinp_d = up::<T>(s, &dinp0);
        let (mut dw_d, mut db_d) = (up::<f32>(s, &dw0), up::<f32>(s, &db0));
        let dout_d = up::<T>(s, &dout);
        // Both sides use the CPU's statistics, so only the backward kernels differ.
        let (mean_h, rstd_h) = (up::<f32>(s, &mean), up::<f32>(s, &rstd));
        k.layernorm_backward(
            &mut dinp_d.as_view_mut(),
            &mut dw_d.as_view_mut(),
            &mut db_d.as_view_mut(),
            &dout_d.as_view(),
            &inp_d.as_view(),
            &w_d.as_view(),
            &mean_h.as_view(),
            &rstd_h.as_view(),
            n,
            c,
        )
        .unwrap();
        check(
            &format!("layernorm_backward dinp {tag}"),
            &down(s, &dinp_d),
            &dinp,
            T::TOLERANCE,
        );
        check(
            &format!("layernorm_backward dweight {tag}"),
            &down(s, &dw_d),
            &dw,
            1e-5,
        );
        check(
            &format!("layernorm_backward dbias {tag}"),
            &down(s, &db_d),
            &db,
            1e-5,
        );
    }
}

fn matmul<T: Host>(k: &CudaKernels) {
    let s = k.stream();
    let mut rng = StdRng::seed_from_u64(3);
    for (n, c, oc) in [(1, 1, 1), (77, 50, 150), (130, 64, 257)] {
        for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
            for with_bias in [true, false] {
                let inp = random::<T>(&mut rng, n * c, 1.0);
                let w = random::<T>(&mut rng, c * oc, 1.0);
                let bias = with_bias.then(|| random::<T>(&mut rng, oc, 1.0));
                let dout = random::<T>(&mut rng, n * oc, 1.0);
                let (dw0, db0) = (
                    random::<f32>(&mut rng, c * oc, 1.0),
                    random::<f32>(&mut rng, oc, 1.0),
                );
                let mut out = vec![0.0; n * oc];
                ops::matmul_forward(&CPU, &mut out, &inp, &w, bias.as_deref(), layout, n, c, oc);
                let (mut dinp, mut dw, mut db) = (vec![0.0; n * c], dw0.clone(), db0.clone());
                let db_opt = with_bias.then_some(db.as_mut_slice());
                ops::matmul_backward(
                    &CPU, &mut dinp, &mut dw, db_opt, &dout, &inp, &w, layout, n, c, oc,
                );

                let tag = format!("{} {layout:?} bias={with_bias} {n}x{c}x{oc}", T::SUFFIX);
                let (inp_d, w_d) = (up::<T>(s, &inp), up::<T>(s, &w));
                let bias_d = bias.as_deref().map(|b| up::<T>(s, b));
                let mut out_d = up::<T>(s, &vec![0.0; n * oc]);
                let bias_v = bias_d.as_ref().map(|b| b.as_view());
                k.matmul_forward(
                    &mut out_d.as_view_mut(),
                    &inp_d.as_view(),
                    &w_d.as_view(),
                    bias_v.as_ref(),
                    layout,
                    n,
                    c,
                    oc,
                )
                .unwrap();
                check(
                    &format!("matmul_forward {tag}"),
                    &down(s, &out_d),
                    &out,
                    T::TOLERANCE,
                );
                let mut dinp_d = up::<T>(s, &vec![0.0; n * c]);
                let (mut dw_d, mut db_d) = (up::<f32>(s, &dw0), up::<f32>(s, &db0));
                let dout_d = up::<T>(s, &dout);
                let mut db_v = db_d.as_view_mut();
                let db_opt = with_bias.then_some(&mut db_v);
                k.matmul_backward(
                    &mut dinp_d.as_view_mut(),
                    &mut dw_d.as_view_mut(),
                    db_opt,
                    &dout_d.as_view(),
                    &inp_d.as_view(),
                    &w_d.as_view(),
                    layout,
                    n,
                    c,
                    oc,
                )
                .unwrap();
                check(
                    &format!("matmul_backward dinp {tag}"),
                    &down(s, &dinp_d),
                    &dinp,
                    T::TOLERANCE,
                );
                check(
                    &format!("matmul_backward dweight {tag}"),
                    &down(s, &dw_d),
                    &dw,
                    T::TOLERANCE.min(1e-3),
                );
                check(
                    &format!("matmul_backward dbias {tag}"),
                    &down(s, &db_d),
                    &db,
                    1e-5,
                );
            }
        }
    }
}

fn attention<T: Host>(k: &CudaKernels) {
    let s = k.stream();
    let mut rng = StdRng::seed_from_u64(4);
    for (b, t, c, nh) in [(1, 1, 4, 1), (2, 37, 48, 3), (1, 130, 64, 4)] {
        let qkv = random::<T>(&mut rng, b * t * 3 * c, 2.0);
        let dout = random::<T>(&mut rng, b * t * c, 1.0);
        let (mut out, mut att) = (vec![0.0; b * t * c], vec![0.0; b * nh * t * t]);
        ops::attention_forward(&CPU, &mut out, &mut att, &qkv, b, t, c, nh);
        let (mut dqkv, mut scratch) = (vec![0.0; b * t * 3 * c], vec![0.0; b * nh * t * t]);
        ops::attention_backward(
            &CPU,
            &mut dqkv,
            &mut scratch,
            &dout,
            &qkv,
            &att,
            b,
            t,
            c,
            nh,
        );

        let tag = format!("{} b={b} t={t} c={c} nh={nh}", T::SUFFIX);
        let mut work = AttentionScratch::<T>::new(s, b, t, c, nh).unwrap();
        let qkv_d = up::<T>(s, &qkv);
        let mut out_d = up::<T>(s, &vec![0.0; b * t * c]);
        let mut att_d = up::<T>(s, &vec![0.0; b * nh * t * t]);
        k.attention_forward(
            &mut out_d.as_view_mut(),
            &mut att_d.as_view_mut(),
            &qkv_d.as_view(),
            &mut work,
            b,
            t,
            c,
            nh,
        )
        .unwrap();
        check(
            &format!("attention_forward out {tag}"),
            &down(s, &out_d),
            &out,
            T::TOLERANCE,
        );
        check(
            &format!("attention_forward att {tag}"),
            &down(s, &att_d),
            &att,
            T::TOLERANCE,
        );
        // The backward pass from the CPU's probabilities, so only the backward differs.
        let att_h = up::<T>(s, &att);
        let dout_d = up::<T>(s, &dout);
        let mut dqkv_d = up::<T>(s, &vec![0.0; b * t * 3 * c]);
        k.attention_backward(
            &mut dqkv_d.as_view_mut(),
            &dout_d.as_view(),
            &qkv_d.as_view(),
            &att_h.as_view(),
            &mut work,
            b,
            t,
            c,
            nh,
        )
        .unwrap();
        check(
            &format!("attention_backward {tag}"),
            &down(s, &dqkv_d),
            &dqkv,
            T::TOLERANCE,
        );
    }
}

fn elementwise<T: Host>(k: &CudaKernels) {
    let s = k.stream();
    let mut rng = StdRng::seed_from_u64(5);
    for n in [1, 7, 4097, 1_000_003] {
        let inp = random::<T>(&mut rng, n, 6.0);
        let other = random::<T>(&mut rng, n, 1.0);
        let (mut out, mut din, mut sum) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        ops::gelu_forward(&CPU, &mut out, &inp);
        ops::gelu_backward(&CPU, &mut din, &inp, &other);
        ops::residual_forward(&CPU, &mut sum, &inp, &other);
        let (inp_d, other_d) = (up::<T>(s, &inp), up::<T>(s, &other));
        let mut out_d = up::<T>(s, &vec![0.0; n]);
        k.gelu_forward(&mut out_d.as_view_mut(), &inp_d.as_view())
            .unwrap();
        check(
            &format!("gelu_forward {} n={n}", T::SUFFIX),
            &down(s, &out_d),
            &out,
            T::TOLERANCE,
        );
        k.gelu_backward(
            &mut out_d.as_view_mut(),
            &inp_d.as_view(),
            &other_d.as_view(),
        )
        .unwrap();
        check(
            &format!("gelu_backward {} n={n}", T::SUFFIX),
            &down(s, &out_d),
            &din,
            T::TOLERANCE,
        );
        k.residual_forward(
            &mut out_d.as_view_mut(),
            &inp_d.as_view(),
            &other_d.as_view(),
        )
        .unwrap();
        check(
            &format!("residual_forward {} n={n}", T::SUFFIX),
            &down(s, &out_d),
            &sum,
            T::TOLERANCE,
        );
    }
}

fn crossentropy<T: Host>(k: &CudaKernels) {
    let s = k.stream();
    let mut rng = StdRng::seed_from_u64(6);
    for (n, v) in [(1, 1), (37, 101), (5, 50257)] {
        let logits = random::<T>(&mut rng, n * v, 8.0);
        let targets: Vec<u32> = (0..n).map(|_| rng.random_range(0..v as u32)).collect();
        let dloss = 1.0 / n as f32;
        let mut losses = vec![0.0; n];
        ops::crossentropy_forward(&CPU, &mut losses, &logits, &targets, n, v);
        let mut dlogits = logits.clone();
        ops::crossentropy_backward_inplace(&CPU, &mut dlogits, &targets, dloss, n, v);
        let tag = format!("{} n={n} v={v}", T::SUFFIX);
        let tg = s.clone_htod(&targets).unwrap();
        let mut logits_d = up::<T>(s, &logits);
        let mut losses_d = up::<f32>(s, &vec![0.0; n]);
        k.crossentropy_forward(
            &mut losses_d.as_view_mut(),
            &logits_d.as_view(),
            &tg.as_view(),
            n,
            v,
        )
        .unwrap();
        check(
            &format!("crossentropy_forward {tag}"),
            &down(s, &losses_d),
            &losses,
            1e-5,
        );
        k.crossentropy_backward(&mut logits_d.as_view_mut(), &tg.as_view(), dloss, n, v)
            .unwrap();
        check(
            &format!("crossentropy_backward {tag}"),
            &down(s, &logits_d),
            &dlogits,
            T::TOLERANCE,
        );
    }
}

#[test]
fn encoder_matches_cpu() {
    let Some(k) = gpu() else { return };
    encoder::<f32>(&k);
    encoder::<bf16>(&k);
}

#[test]
fn layernorm_matches_cpu() {
    let Some(k) = gpu() else { return };
    layernorm::<f32>(&k);
    layernorm::<bf16>(&k);
}

#[test]
fn matmul_matches_cpu() {
    let Some(k) = gpu() else { return };
    matmul::<f32>(&k);
    matmul::<bf16>(&k);
}

#[test]
fn attention_matches_cpu() {
    let Some(k) = gpu() else { return };
    attention::<f32>(&k);
    attention::<bf16>(&k);
}

#[test]
fn gelu_and_residual_match_cpu() {
    let Some(k) = gpu() else { return };
    elementwise::<f32>(&k);
    elementwise::<bf16>(&k);
}

#[test]
fn crossentropy_matches_cpu() {
    let Some(k) = gpu() else { return };
    crossentropy::<f32>(&k);
    crossentropy::<bf16>(&k);
}

#[test]
fn casts_match_cpu_bit_for_bit() {
    let Some(k) = gpu() else { return };
    let s = k.stream();
    let mut rng = StdRng::seed_from_u64(7);
    let mut x: Vec<f32> = (0..100_003)
        .map(|_| f32::from_bits(rng.random::<u32>()))
        .filter(|v| !v.is_nan())
        .collect();
    x.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        65520.0,
        1e-8,
        f32::MAX,
    ]);
    let n = x.len();
    let cpu = Cpu::default();
    let (mut bf, mut h) = (vec![bf16::ZERO; n], vec![f16::ZERO; n]);
    ops::f32_to_bf16(&cpu, &mut bf, &x);
    ops::f32_to_f16(&cpu, &mut h, &x);
    let x_d = s.clone_htod(&x).unwrap();
    let mut bf_d = s.alloc_zeros::<bf16>(n).unwrap();
    let mut h_d = s.alloc_zeros::<f16>(n).unwrap();
    k.f32_to_bf16(&mut bf_d.as_view_mut(), &x_d.as_view())
        .unwrap();
    k.f32_to_f16(&mut h_d.as_view_mut(), &x_d.as_view())
        .unwrap();
    let (bf_got, h_got) = (s.clone_dtoh(&bf_d).unwrap(), s.clone_dtoh(&h_d).unwrap());
    assert!(
        bf_got
            .iter()
            .zip(&bf)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "f32_to_bf16"
    );
    assert!(
        h_got
            .iter()
            .zip(&h)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "f32_to_f16"
    );
    let mut back_d = s.alloc_zeros::<f32>(n).unwrap();
    k.bf16_to_f32(&mut back_d.as_view_mut(), &bf_d.as_view())
        .unwrap();
    let want: Vec<f32> = bf.iter().map(|v| v.to_f32()).collect();
    assert!(
        s.clone_dtoh(&back_d)
            .unwrap()
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
    k.f16_to_f32(&mut back_d.as_view_mut(), &h_d.as_view())
        .unwrap();
    let want: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
    assert!(
        s.clone_dtoh(&back_d)
            .unwrap()
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
    // NaN payloads may differ between the two, but NaN must stay NaN both ways.
    let nans = [
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0xffc1_2345),
    ];
    let nan_d = s.clone_htod(&nans).unwrap();
    let mut nan_bf = s.alloc_zeros::<bf16>(nans.len()).unwrap();
    let mut nan_h = s.alloc_zeros::<f16>(nans.len()).unwrap();
    k.f32_to_bf16(&mut nan_bf.as_view_mut(), &nan_d.as_view())
        .unwrap();
    k.f32_to_f16(&mut nan_h.as_view_mut(), &nan_d.as_view())
        .unwrap();
    assert!(
        s.clone_dtoh(&nan_bf).unwrap().iter().all(|v| v.is_nan()),
        "bf16 NaN"
    );
    assert!(
        s.clone_dtoh(&nan_h).unwrap().iter().all(|v| v.is_nan()),
        "f16 NaN"
    );
    let mut nan_back = s.alloc_zeros::<f32>(nans.len()).unwrap();
    k.bf16_to_f32(&mut nan_back.as_view_mut(), &nan_bf.as_view())
        .unwrap();
    assert!(s.clone_dtoh(&nan_back).unwrap().iter().all(|v| v.is_nan()));
    k.f16_to_f32(&mut nan_back.as_view_mut(), &nan_h.as_view())
        .unwrap();
    assert!(s.clone_dtoh(&nan_back).unwrap().iter().all(|v| v.is_nan()));
}
