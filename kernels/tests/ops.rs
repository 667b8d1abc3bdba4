//! Every fast CPU kernel against its scalar reference, element by element with
//! `atol + rtol * |ref|`, on fresh random inputs of odd sizes that hit every tail loop,
//! on every instruction set this CPU has and with one and several threads.
//!
//! The reference runs in f64 on the same f32 inputs, so the tolerance measures the fast
//! kernel's own rounding.

mod ops_support;

use ops_support::{check, cpus, random, wide};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use strata_kernels::ops::{self, Cpu, WeightLayout};
use strata_kernels::reference::{cast as rc, gpt2 as rk};

#[test]
fn encoder_matches_reference() {
    let mut rng = StdRng::seed_from_u64(1);
    for (b, t, c, v) in [
        (1, 1, 1, 1),
        (2, 7, 22, 13),
        (3, 33, 17, 65),
        (2, 100, 70, 300),
    ] {
        let tokens: Vec<u32> = (0..b * t).map(|_| rng.random_range(0..v as u32)).collect();
        let (wte, wpe) = (
            random(&mut rng, v * c, 1.0),
            random(&mut rng, (t + 3) * c, 1.0),
        );
        let dout = random(&mut rng, b * t * c, 1.0);
        let mut want = vec![0.0; b * t * c];
        rk::encoder_forward(&mut want, &tokens, &wide(&wte), &wide(&wpe), b, t, c);
        let (dwte0, dwpe0) = (
            random(&mut rng, v * c, 1.0),
            random(&mut rng, (t + 3) * c, 1.0),
        );
        let (mut dwte_want, mut dwpe_want) = (wide(&dwte0), wide(&dwpe0));
        rk::encoder_backward(
            &mut dwte_want,
            &mut dwpe_want,
            &wide(&dout),
            &tokens,
            b,
            t,
            c,
        );
        for cpu in cpus() {
            let mut out = vec![f32::NAN; b * t * c];
            ops::encoder_forward(&cpu, &mut out, &tokens, &wte, &wpe, b, t, c);
            check("encoder_forward", &out, &want, 0.0, 1e-7);
            let (mut dwte, mut dwpe) = (dwte0.clone(), dwpe0.clone());
            ops::encoder_backward(&cpu, &mut dwte, &mut dwpe, &dout, &tokens, b, t, c);
            check("encoder_backward dwte", &dwte, &dwte_want, 1e-6, 1e-6);
            check("encoder_backward dwpe", &dwpe, &dwpe_want, 1e-6, 1e-6);
        }
    }
}

#[test]
fn layernorm_matches_reference() {
    let mut rng = StdRng::seed_from_u64(2);
    for (n, c) in [(1, 1), (7, 22), (22, 7), (5, 4097), (130, 768)] {
        let inp: Vec<f32> = random(&mut rng, n * c, 2.0)
            .iter()
            .map(|x| x + 0.5)
            .collect();
        let (w, bias) = (random(&mut rng, c, 1.5), random(&mut rng, c, 0.5));
        let dout = random(&mut rng, n * c, 1.0);
        let dinp0 = random(&mut rng, n * c, 1.0);
        let (dw0, db0) = (random(&mut rng, c, 1.0), random(&mut rng, c, 1.0));
        let (mut out_w, mut mean_w, mut rstd_w) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        let (inp64, w64) = (wide(&inp), wide(&w));
        rk::layernorm_forward(
            &mut out_w,
            &mut mean_w,
            &mut rstd_w,
            &inp64,
            &w64,
            &wide(&bias),
            n,
            c,
        );
        let (mut dinp_w, mut dw_w, mut db_w) = (wide(&dinp0), wide(&dw0), wide(&db0));
        rk::layernorm_backward(
            &mut dinp_w,
            &mut dw_w,
            &mut db_w,
            &wide(&dout),
            &inp64,
            &w64,
            &mean_w,
            &rstd_w,
            n,
            c,
        );
        for cpu in cpus() {
            let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
            ops::layernorm_forward(&cpu, &mut out, &mut mean, &mut rstd, &inp, &w, &bias, n, c);
            check("layernorm_forward out", &out, &out_w, 1e-5, 1e-5);
            check("layernorm_forward mean", &mean, &mean_w, 1e-6, 1e-5);
            check("layernorm_forward rstd", &rstd, &rstd_w, 1e-6, 1e-5);
            let (mut dinp, mut dw, mut db) = (dinp0.clone(), dw0.clone(), db0.clone());
            ops::layernorm_backward(
                &cpu,
                &mut dinp,
                Some((&mut dw, &mut db)),
                &dout,
                &inp,
                &w,
                &mean,
                &rstd,
                n,
                c,
            );
            // Frozen parameters: the same input gradient, bit for bit, and no other.
            let mut frozen = dinp0.clone();
            ops::layernorm_backward(&cpu, &mut frozen, None, &dout, &inp, &w, &mean, &rstd, n, c);
            assert_eq!(
                frozen, dinp,
                "layernorm_backward without parameters, {n}x{c}"
            );
            check("layernorm_backward dinp", &dinp, &dinp_w, 1e-5, 1e-4);
            check("layernorm_backward dweight", &dw, &dw_w, 1e-4, 1e-5);
            check("layernorm_backward dbias", &db, &db_w, 1e-4, 1e-5);
        }
    }
}

#[test]
fn matmul_matches_reference() {
    let mut rng = StdRng::seed_from_u64(3);
    for (n, c, oc) in [
        (1, 1, 1),
        (7, 22, 13),
        (33, 17, 65),
        (130, 70, 50),
        (5, 64, 257),
    ] {
        for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
            for with_bias in [true, false] {
                let inp = random(&mut rng, n * c, 1.0);
                let w = random(&mut rng, c * oc, 1.0);
                let bias = with_bias.then(|| random(&mut rng, oc, 1.0));
                let dout = random(&mut rng, n * oc, 1.0);
                let (dw0, db0) = (random(&mut rng, c * oc, 1.0), random(&mut rng, oc, 1.0));
                let (inp64, w64, dout64) = (wide(&inp), wide(&w), wide(&dout));
                let bias64 = bias.as_deref().map(wide);
                let mut out_w = vec![0.0; n * oc];
                rk::matmul_forward(
                    &mut out_w,
                    &inp64,
                    &w64,
                    bias64.as_deref(),
                    layout,
                    n,
                    c,
                    oc,
                );
                let (mut dinp_w, mut dw_w, mut db_w) = (vec![0.0; n * c], wide(&dw0), wide(&db0));
                let db_w_opt = with_bias.then_some(db_w.as_mut_slice());
                rk::matmul_backward(
                    &mut dinp_w,
                    &mut dw_w,
                    db_w_opt,
                    &dout64,
                    &inp64,
                    &w64,
                    layout,
                    n,
                    c,
                    oc,
                );
                let tol = 2e-6 * (c.max(n) as f64).sqrt();
                for cpu in cpus() {
                    let mut out = vec![f32::NAN; n * oc];
                    ops::matmul_forward(
                        &cpu,
                        &mut out,
                        &inp,
                        &w,
                        bias.as_deref(),
                        layout,
                        n,
                        c,
                        oc,
                    );
                    check("matmul_forward", &out, &out_w, tol, 1e-5);
                    let (mut dinp, mut dw, mut db) =
                        (vec![f32::NAN; n * c], dw0.clone(), db0.clone());
                    let db_opt = with_bias.then_some(db.as_mut_slice());
                    ops::matmul_backward(
                        &cpu, &mut dinp, &mut dw, db_opt, &dout, &inp, &w, layout, n, c, oc,
                    );
                    check("matmul_backward dinp", &dinp, &dinp_w, tol, 1e-5);
                    check("matmul_backward dweight", &dw, &dw_w, tol, 1e-5);
                    check("matmul_backward dbias", &db, &db_w, tol, 1e-5);
                }
            }
        }
    }
}

#[test]
fn attention_matches_reference() {
    let mut rng = StdRng::seed_from_u64(4);
    // T above 64 crosses the block boundary of the causal products.
    for (b, t, c, nh) in [
        (1, 1, 4, 1),
        (2, 7, 12, 3),
        (1, 70, 16, 2),
        (3, 130, 8, 2),
        (1, 22, 64, 1),
    ] {
        let qkv = random(&mut rng, b * t * 3 * c, 2.0);
        let dout = random(&mut rng, b * t * c, 1.0);
        let (mut out_w, mut att_w) = (vec![0.0; b * t * c], vec![0.0; b * nh * t * t]);
        rk::attention_forward(&mut out_w, &mut att_w, &wide(&qkv), b, t, c, nh);
        let mut dqkv_w = vec![0.0; b * t * 3 * c];
        rk::attention_backward(&mut dqkv_w, &wide(&dout), &wide(&qkv), &att_w, b, t, c, nh);
        for cpu in cpus() {
            let (mut out, mut att) = (vec![f32::NAN; b * t * c], vec![f32::NAN; b * nh * t * t]);
            ops::attention_forward(&cpu, &mut out, &mut att, &qkv, b, t, c, nh);
            check("attention_forward out", &out, &out_w, 1e-5, 1e-5);
            check("attention_forward att", &att, &att_w, 1e-6, 1e-5);
            let mut dqkv = vec![f32::NAN; b * t * 3 * c];
            let mut scratch = vec![f32::NAN; b * nh * t * t];
            ops::attention_backward(
                &cpu,
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
            check("attention_backward", &dqkv, &dqkv_w, 1e-5, 1e-4);
        }
    }
}

#[test]
fn gelu_and_residual_match_reference() {
    let mut rng = StdRng::seed_from_u64(5);
    for n in [1, 7, 22, 4097, 1_000_003] {
        let inp = random(&mut rng, n, 6.0);
        let other = random(&mut rng, n, 1.0);
        let dout = random(&mut rng, n, 1.0);
        let (mut out_w, mut din_w, mut sum_w) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        let (inp64, other64) = (wide(&inp), wide(&other));
        rk::gelu_forward(&mut out_w, &inp64);
        rk::gelu_backward(&mut din_w, &inp64, &wide(&dout));
        rk::residual_forward(&mut sum_w, &inp64, &other64);
        let mut acc_w = sum_w.clone();
        for (a, o) in acc_w.iter_mut().zip(&other64) {
            *a += o;
        }
        for cpu in cpus() {
            let (mut out, mut din, mut sum) = (vec![f32::NAN; n], vec![f32::NAN; n], vec![0.0; n]);
            ops::gelu_forward(&cpu, &mut out, &inp);
            check("gelu_forward", &out, &out_w, 1e-6, 1e-6);
            ops::gelu_backward(&cpu, &mut din, &inp, &dout);
            check("gelu_backward", &din, &din_w, 1e-6, 1e-5);
            ops::residual_forward(&cpu, &mut sum, &inp, &other);
            check("residual_forward", &sum, &sum_w, 0.0, 1e-7);
            ops::add_inplace(&cpu, &mut sum, &other);
            check("add_inplace", &sum, &acc_w, 1e-6, 1e-6);
        }
    }
}

#[test]
fn crossentropy_matches_reference() {
    let mut rng = StdRng::seed_from_u64(6);
    for (n, v) in [(1, 1), (7, 22), (22, 7), (3, 4097), (40, 1000)] {
        let logits = random(&mut rng, n * v, 8.0);
        let targets: Vec<u32> = (0..n).map(|_| rng.random_range(0..v as u32)).collect();
        let dloss = 1.0 / n as f32;
        let (mut losses_w, mut dlogits_w) = (vec![0.0; n], vec![0.0; n * v]);
        let logits64 = wide(&logits);
        rk::crossentropy_forward(&mut losses_w, &logits64, &targets, n, v);
        rk::crossentropy_backward(&mut dlogits_w, &logits64, &targets, dloss as f64, n, v);
        for cpu in cpus() {
            let mut losses = vec![f32::NAN; n];
            ops::crossentropy_forward(&cpu, &mut losses, &logits, &targets, n, v);
            check("crossentropy_forward", &losses, &losses_w, 1e-5, 1e-5);
            let mut d = logits.clone();
            ops::crossentropy_backward_inplace(&cpu, &mut d, &targets, dloss, n, v);
            check("crossentropy_backward", &d, &dlogits_w, 1e-8, 1e-5);
        }
    }
}

/// Positions whose target is `IGNORE_TARGET` get a zero loss and a zero gradient row in
/// the reference and every CPU kernel; the other rows are what they are unmasked.
#[test]
fn crossentropy_skips_ignored_targets() {
    use strata_kernels::program::IGNORE_TARGET;
    let mut rng = StdRng::seed_from_u64(16);
    for (n, v) in [(1, 5), (7, 22), (22, 7), (3, 4097), (40, 1000)] {
        let logits = random(&mut rng, n * v, 8.0);
        let plain: Vec<u32> = (0..n).map(|_| rng.random_range(0..v as u32)).collect();
        let masked: Vec<u32> = plain
            .iter()
            .enumerate()
            .map(|(i, &t)| if i % 3 == 0 { IGNORE_TARGET } else { t })
            .collect();
        let dloss = 0.37;
        let logits64 = wide(&logits);
        let reference = |targets: &[u32]| {
            let (mut l, mut d) = (vec![0.0; n], vec![0.0; n * v]);
            rk::crossentropy_forward(&mut l, &logits64, targets, n, v);
            rk::crossentropy_backward(&mut d, &logits64, targets, dloss as f64, n, v);
            (l, d)
        };
        let (plain_l, plain_d) = reference(&plain);
        let (want_l, want_d) = reference(&masked);
        for row in 0..n {
            let ignored = masked[row] == IGNORE_TARGET;
            assert_eq!(want_l[row], if ignored { 0.0 } else { plain_l[row] });
            let d = &want_d[row * v..][..v];
            if ignored {
                assert!(d.iter().all(|&x| x == 0.0), "row {row}");
            } else {
                assert_eq!(d, &plain_d[row * v..][..v]);
            }
        }
        for cpu in cpus() {
            let mut losses = vec![f32::NAN; n];
            ops::crossentropy_forward(&cpu, &mut losses, &logits, &masked, n, v);
            check("crossentropy_forward masked", &losses, &want_l, 1e-5, 1e-5);
            let mut d = logits.clone();
            ops::crossentropy_backward_inplace(&cpu, &mut d, &masked, dloss, n, v);
            check("crossentropy_backward masked", &d, &want_d, 1e-8, 1e-5);
            for row in (0..n).step_by(3) {
                assert_eq!(losses[row], 0.0);
                assert!(d[row * v..][..v].iter().all(|&x| x == 0.0));
            }
        }
    }
}

#[test]
fn casts_match_reference() {
    let mut rng = StdRng::seed_from_u64(7);
    for n in [1, 7, 22, 4097, 1_000_003] {
        let mut x: Vec<f32> = (0..n)
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
        let m = x.len();
        let mut bf_w = vec![half::bf16::ZERO; m];
        rc::f32_to_bf16(&mut bf_w, &x);
        let mut bf_back_w = vec![0.0; m];
        rc::bf16_to_f32(&mut bf_back_w, &bf_w);
        let mut h_w = vec![half::f16::ZERO; m];
        rc::f32_to_f16(&mut h_w, &x);
        let mut h_back_w = vec![0.0; m];
        rc::f16_to_f32(&mut h_back_w, &h_w);
        for cpu in cpus() {
            let mut bf = vec![half::bf16::ZERO; m];
            ops::f32_to_bf16(&cpu, &mut bf, &x);
            assert!(
                bf.iter()
                    .zip(&bf_w)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "f32_to_bf16"
            );
            let mut back = vec![0.0f32; m];
            ops::bf16_to_f32(&cpu, &mut back, &bf);
            assert!(
                back.iter()
                    .zip(&bf_back_w)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            );
            let mut h = vec![half::f16::ZERO; m];
            ops::f32_to_f16(&cpu, &mut h, &x);
            assert!(
                h.iter().zip(&h_w).all(|(a, b)| a.to_bits() == b.to_bits()),
                "f32_to_f16"
            );
            ops::f16_to_f32(&cpu, &mut back, &h);
            assert!(
                back.iter()
                    .zip(&h_back_w)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            );
        }
    }
    // NaN stays NaN through both formats.
    let cpu = Cpu::default();
    let (mut bf, mut h) = ([half::bf16::ZERO; 9], [half::f16::ZERO; 9]);
    ops::f32_to_bf16(&cpu, &mut bf, &[f32::NAN; 9]);
    ops::f32_to_f16(&cpu, &mut h, &[f32::NAN; 9]);
    assert!(bf.iter().all(|v| v.is_nan()) && h.iter().all(|v| v.is_nan()));
}
