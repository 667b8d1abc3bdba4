//! The AdamW kernels against the scalar reference, element by element, for every
//! instruction set this CPU has, every gradient dtype and working-copy dtype, 8-bit and
//! fp32 state, on sizes that hit every tail (0, 1, 7, 22, 4097, 1000003) and thread
//! counts 1, 2 and 3; plus the conversions' edge cases (NaN, infinities, subnormals,
//! ties) against the `half` crate, the fused gradient pass, and the errors.
//!
//! bf16 state is held to its reference (in the kernels' order of operations) bit for bit.
//!
//! Tolerances for fp32 and 8-bit state, per element, kernel vs reference (the kernels multiply by
//! 1/sqrt(1 - beta2^t) and use fused multiply-adds where the reference follows torch):
//! - p: 1e-6 * |p| + 1e-9 (a parameter moves by about lr = 1e-3 per step);
//! - m: 1e-6 * (|m| + |m_old| + |g|), since m = beta1 m_old + (1 - beta1) g may cancel;
//! - v: 1e-6 * |v| (a sum of non-negative terms);
//! - working copies: bit-exact against `half`'s conversion of the kernel's own p;
//! - 8-bit codes: equal, or the next code where the f32 value sat on a rounding edge.

// Element-wise checks index several parallel arrays at once; an index reads best.
#![allow(clippy::needless_range_loop)]

use half::{bf16, f16};
mod adamw_support;

use adamw_support::Rng;
use strata_kernels::adamw::{
    AdamError, AdamStep, AdamW, CopyOut, GradStats, Grads, Q8State, State, grad_stats, q8,
};
use strata_kernels::isa::Isa;
use strata_kernels::reference;
use strata_kernels::reference::adamw::Arithmetic;

const SIZES: [usize; 6] = [0, 1, 7, 22, 4097, 1_000_003];

#[derive(Clone)]
struct Tensors {
    p: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
}

/// Parameters in [-2, 2), state and gradients over several decades, every 97th gradient
/// exactly zero (as in the golden data).
fn tensors(n: usize, seed: u64) -> Tensors {
    let mut rng = Rng(seed);
    let mut t = Tensors {
        p: Vec::with_capacity(n),
        m: Vec::with_capacity(n),
        v: Vec::with_capacity(n),
        g: Vec::with_capacity(n),
    };
    for i in 0..n {
        t.p.push(rng.signed() * 2.0);
        let g = if i % 97 == 0 {
            0.0
        } else {
            rng.spread(1e-1, 5.0)
        };
        t.g.push(g);
        // |m| <= sqrt(v), as Adam's moments keep it (so m / sqrt(v) stays near 1).
        let v = rng.spread(1e-3, 6.0).abs();
        t.v.push(v);
        t.m.push(rng.signed() * v.sqrt());
    }
    t
}

fn hp() -> AdamW {
    AdamW {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum GradType {
    F32,
    F16,
    Bf16,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum CopyType {
    None,
    F16,
    Bf16,
}

/// Gradients in the given dtype; returns them with the f32 values they stand for.
struct GradData {
    f32s: Vec<f32>,
    f16s: Vec<f16>,
    bf16s: Vec<bf16>,
}

impl GradData {
    fn new(g: &[f32], ty: GradType) -> GradData {
        let (f16s, bf16s) = match ty {
            GradType::F32 => (vec![], vec![]),
            // Gradients of a scaled fp16 loss: large enough to use fp16's range.
            GradType::F16 => (
                g.iter().map(|&x| f16::from_f32(x * 1024.0)).collect(),
                vec![],
            ),
            GradType::Bf16 => (vec![], g.iter().map(|&x| bf16::from_f32(x)).collect()),
        };
        let f32s = match ty {
            GradType::F32 => g.to_vec(),
            GradType::F16 => f16s.iter().map(|x| x.to_f32()).collect(),
            GradType::Bf16 => bf16s.iter().map(|x| x.to_f32()).collect(),
        };
        GradData { f32s, f16s, bf16s }
    }

    fn grads(&self, ty: GradType) -> Grads<'_> {
        match ty {
            GradType::F32 => Grads::F32(&self.f32s),
            GradType::F16 => Grads::F16(&self.f16s),
            GradType::Bf16 => Grads::Bf16(&self.bf16s),
        }
    }

    /// The grad scale that undoes the fp16 loss scale.
    fn scale(ty: GradType) -> f32 {
        if ty == GradType::F16 {
            1.0 / 1024.0
        } else {
            1.0
        }
    }
}

struct CopyBuf {
    f16s: Vec<f16>,
    bf16s: Vec<bf16>,
}

impl CopyBuf {
    fn new(n: usize, ty: CopyType) -> CopyBuf {
        CopyBuf {
            f16s: vec![f16::from_f32(7.0); if ty == CopyType::F16 { n } else { 0 }],
            bf16s: vec![bf16::from_f32(7.0); if ty == CopyType::Bf16 { n } else { 0 }],
        }
    }

    fn copy_out(&mut self, ty: CopyType) -> CopyOut<'_> {
        match ty {
            CopyType::None => CopyOut::None,
            CopyType::F16 => CopyOut::F16(&mut self.f16s),
            CopyType::Bf16 => CopyOut::Bf16(&mut self.bf16s),
        }
    }

    /// Asserts the copy is `p` rounded to nearest even, bit for bit, both by `half`'s
    /// software conversion and by its default (hardware where present) one.
    fn check(&self, ty: CopyType, p: &[f32], label: &str) {
        match ty {
            CopyType::None => {}
            CopyType::F16 => {
                for (i, (&o, &x)) in self.f16s.iter().zip(p).enumerate() {
                    let want = f16::from_f32_const(x);
                    assert_eq!(
                        o.to_bits(),
                        want.to_bits(),
                        "{label}: f16 copy [{i}] of {x:e}"
                    );
                    assert_eq!(o.to_bits(), f16::from_f32(x).to_bits(), "{label}: [{i}]");
                }
            }
            CopyType::Bf16 => {
                for (i, (&o, &x)) in self.bf16s.iter().zip(p).enumerate() {
                    let want = bf16::from_f32_const(x);
                    assert_eq!(
                        o.to_bits(),
                        want.to_bits(),
                        "{label}: bf16 copy [{i}] of {x:e}"
                    );
                }
            }
        }
    }
}

fn close(got: f32, want: f32, tol: f64) -> bool {
    (f64::from(got) - f64::from(want)).abs() <= tol || (got.is_nan() && want.is_nan())
}

fn check_f32_state(label: &str, before: &Tensors, g: &[f32], got: &Tensors, want: &Tensors) {
    for i in 0..got.p.len() {
        let (p, m, v) = (got.p[i], got.m[i], got.v[i]);
        let (wp, wm, wv) = (want.p[i], want.m[i], want.v[i]);
        let tol_p = 1e-6 * f64::from(wp.abs()) + 1e-9;
        assert!(
            close(p, wp, tol_p),
            "{label}: p[{i}] {p:e} vs reference {wp:e}"
        );
        let tol_m = 1e-6 * f64::from(wm.abs() + before.m[i].abs() + g[i].abs());
        assert!(
            close(m, wm, tol_m),
            "{label}: m[{i}] {m:e} vs reference {wm:e}"
        );
        assert!(
            close(v, wv, 1e-6 * f64::from(wv)),
            "{label}: v[{i}] {v:e} vs reference {wv:e}"
        );
    }
}

fn types() -> Vec<(GradType, CopyType)> {
    let mut all = vec![];
    for g in [GradType::F32, GradType::F16, GradType::Bf16] {
        for c in [CopyType::None, CopyType::F16, CopyType::Bf16] {
            all.push((g, c));
        }
    }
    all
}

#[test]
fn f32_state_matches_reference_on_every_isa_dtype_and_size() {
    for (si, &n) in SIZES.iter().enumerate() {
        let start = tensors(n, 1 + si as u64);
        // The largest size runs the full dtype matrix on one ISA each, to keep it quick.
        for (ci, (gty, cty)) in types().into_iter().enumerate() {
            let grads = GradData::new(&start.g, gty);
            let k = AdamStep::new(&hp(), 2 + ci as u64, GradData::scale(gty)).unwrap();
            let mut want = start.clone();
            let mut want_copy = CopyBuf::new(n, cty);
            reference::adamw::step(
                &k,
                &mut want.p,
                &mut want.m,
                &mut want.v,
                grads.grads(gty),
                want_copy.copy_out(cty),
            );
            want_copy.check(cty, &want.p, "reference");
            let isas = Isa::supported();
            let isas = if n > 100_000 {
                vec![isas[ci % isas.len()]]
            } else {
                isas
            };
            for isa in isas {
                let threads = 1 + (si + ci) % 3;
                let label = format!("{isa}, {threads} threads, n {n}, grads {gty:?}, copy {cty:?}");
                let mut got = start.clone();
                let mut copy = CopyBuf::new(n, cty);
                k.apply(
                    isa,
                    threads,
                    &mut got.p,
                    State::F32 {
                        m: &mut got.m,
                        v: &mut got.v,
                    },
                    grads.grads(gty),
                    copy.copy_out(cty),
                )
                .unwrap();
                check_f32_state(&label, &start, &grads.f32s, &got, &want);
                copy.check(cty, &got.p, &label);
            }
        }
    }
}

#[test]
fn half_gradients_give_exactly_the_f32_result_of_their_values() {
    // Gradients with subnormals, infinities, NaN and signed zeros: reading fp16 or
    // bf16 must give exactly the f32 value `half` gives, so the result is bit-identical
    // to the f32-gradient run on the same ISA.
    let mut f16s = vec![];
    let mut bf16s = vec![];
    for bits in (0..=u16::MAX).step_by(7) {
        f16s.push(f16::from_bits(bits));
        bf16s.push(bf16::from_bits(bits));
    }
    let n = f16s.len();
    let start = tensors(n, 99);
    let k = AdamStep::new(&hp(), 5, 1.0).unwrap();
    for isa in Isa::supported() {
        for (name, halves, wide) in [
            (
                "f16",
                Grads::F16(&f16s),
                f16s.iter().map(|x| x.to_f32()).collect::<Vec<_>>(),
            ),
            (
                "bf16",
                Grads::Bf16(&bf16s),
                bf16s.iter().map(|x| x.to_f32()).collect::<Vec<_>>(),
            ),
        ] {
            let run = |g: Grads<'_>| {
                let mut t = start.clone();
                k.apply(
                    isa,
                    2,
                    &mut t.p,
                    State::F32 {
                        m: &mut t.m,
                        v: &mut t.v,
                    },
                    g,
                    CopyOut::None,
                )
                .unwrap();
                t
            };
            let a = run(halves);
            let b = run(Grads::F32(&wide));
            for i in 0..n {
                for (x, y, what) in [
                    (a.p[i], b.p[i], "p"),
                    (a.m[i], b.m[i], "m"),
                    (a.v[i], b.v[i], "v"),
                ] {
                    assert!(
                        x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
                        "{isa} {name} grads: {what}[{i}] {x:e} vs {y:e} (grad {:e})",
                        wide[i]
                    );
                }
            }
        }
    }
}

#[test]
fn working_copies_round_edge_cases_like_half() {
    // With lr = 0 the step leaves p unchanged, so the copy-out sees exactly these
    // values: NaNs with payloads, infinities, zeros, subnormals of f32, fp16 and bf16,
    // fp16's overflow edge, and exact ties of both formats.
    let mut values = vec![
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001), // signalling NaN
        f32::from_bits(0xffc1_2345),
        f32::from_bits(0x7fbf_ffff),
        f32::MAX,
        f32::MIN_POSITIVE,
        f32::from_bits(1),
        f32::from_bits(0x8000_0001),
        f32::from_bits(0x007f_ffff),
        65504.0,
        65519.99,
        65520.0,
        -65520.0,
        5.960_464_5e-8,     // the smallest fp16 subnormal
        2.980_232_2e-8,     // half of it: a tie, rounds to even (zero)
        8.940_697e-8,       // 1.5 of it: a tie, rounds to even (2 units)
        6.097_555e-5,       // the largest fp16 subnormal
        1.0 + 1.0 / 2048.0, // fp16 tie between 1 and 1 + 2^-10: to even (1)
        1.0 + 3.0 / 2048.0, // tie: to even (1 + 2^-9)
        1.0 + 1.0 / 256.0,  // bf16 tie: to even (1)
        1.0 + 3.0 / 256.0,  // bf16 tie: to even (1 + 2^-6)
        3.389_531_4e38,     // rounds to bf16 infinity
    ];
    let mut rng = Rng(5);
    while values.len() < 4097 {
        // Random bit patterns cover every exponent, NaNs included.
        values.push(f32::from_bits(rng.next_u64() as u32));
    }
    let n = values.len();
    let hp = AdamW { lr: 0.0, ..hp() };
    let k = AdamStep::new(&hp, 1, 1.0).unwrap();
    for isa in Isa::supported() {
        for cty in [CopyType::F16, CopyType::Bf16] {
            let mut p = values.clone();
            let mut m = vec![0f32; n];
            let mut v = vec![0f32; n];
            let g = vec![0f32; n];
            let mut copy = CopyBuf::new(n, cty);
            k.apply(
                isa,
                1,
                &mut p,
                State::F32 {
                    m: &mut m,
                    v: &mut v,
                },
                Grads::F32(&g),
                copy.copy_out(cty),
            )
            .unwrap();
            for (i, (&a, &b)) in p.iter().zip(&values).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "{isa}: lr 0 changed p[{i}] {b:e} to {a:e}"
                );
            }
            copy.check(cty, &p, &format!("{isa} {cty:?}"));
        }
    }
}

#[test]
fn thread_counts_give_identical_results() {
    let n = 100_003;
    let start = tensors(n, 7);
    let k = AdamStep::new(&hp(), 3, 1.0).unwrap();
    for isa in Isa::supported() {
        let mut results = vec![];
        for threads in [1, 2, 3, 5] {
            let mut t = start.clone();
            let mut copy = CopyBuf::new(n, CopyType::Bf16);
            k.apply(
                isa,
                threads,
                &mut t.p,
                State::F32 {
                    m: &mut t.m,
                    v: &mut t.v,
                },
                Grads::F32(&start.g),
                copy.copy_out(CopyType::Bf16),
            )
            .unwrap();
            results.push((t.p, t.m, t.v, copy.bf16s));
        }
        for r in &results[1..] {
            assert!(r == &results[0], "{isa}: thread count changed the result");
        }
    }
}

/// The reference's rounding of `isa`'s kernels: fused multiply-adds on AVX2 and AVX-512.
fn arithmetic(isa: Isa) -> Arithmetic {
    if isa.fuses_multiply_add() {
        Arithmetic::Fused
    } else {
        Arithmetic::Unfused
    }
}

fn bf16s(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// Equal bits, or both NaN.
fn same_bits(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[test]
fn bf16_state_matches_reference_bit_for_bit_on_every_isa_dtype_and_size() {
    for (si, &n) in SIZES.iter().enumerate() {
        let start = tensors(n, 41 + si as u64);
        let (m0, v0) = (bf16s(&start.m), bf16s(&start.v));
        for (ci, (gty, cty)) in types().into_iter().enumerate() {
            let grads = GradData::new(&start.g, gty);
            let isas = Isa::supported();
            let isas = if n > 100_000 {
                vec![isas[ci % isas.len()]]
            } else {
                isas
            };
            for isa in isas {
                let threads = 1 + (si + ci) % 3;
                let label = format!("{isa}, {threads} threads, n {n}, grads {gty:?}, copy {cty:?}");
                let (mut want_p, mut want_m, mut want_v) =
                    (start.p.clone(), m0.clone(), v0.clone());
                let (mut p, mut m, mut v) = (start.p.clone(), m0.clone(), v0.clone());
                // Three chained steps: bit-identical results keep both sides on one path.
                for t in 1..=3u64 {
                    let k = AdamStep::new(&hp(), t + ci as u64, GradData::scale(gty)).unwrap();
                    let mut want_copy = CopyBuf::new(n, cty);
                    reference::adamw::step_bf16(
                        &k,
                        arithmetic(isa),
                        &mut want_p,
                        &mut want_m,
                        &mut want_v,
                        grads.grads(gty),
                        want_copy.copy_out(cty),
                    );
                    let mut copy = CopyBuf::new(n, cty);
                    k.apply(
                        isa,
                        threads,
                        &mut p,
                        State::Bf16 {
                            m: &mut m,
                            v: &mut v,
                        },
                        grads.grads(gty),
                        copy.copy_out(cty),
                    )
                    .unwrap();
                    for i in 0..n {
                        assert!(
                            same_bits(p[i], want_p[i]),
                            "{label} step {t}: p[{i}] {:e} vs reference {:e}",
                            p[i],
                            want_p[i]
                        );
                        for (what, a, b) in [("m", m[i], want_m[i]), ("v", v[i], want_v[i])] {
                            assert!(
                                same_bits(a.to_f32(), b.to_f32()),
                                "{label} step {t}: {what}[{i}] {a:e} vs reference {b:e}"
                            );
                        }
                    }
                    copy.check(cty, &p, &label);
                    want_copy.check(cty, &want_p, "reference");
                }
            }
        }
    }
}

#[test]
fn bf16_moments_round_to_nearest_even() {
    // beta1 = beta2 = 0 and lr = 0: the new m is exactly the gradient (plus a zero
    // product, which turns -0 into +0) and v its square, so the stored moments are those
    // f32 values rounded to bf16: ties to even, NaN kept,
    // overflow to infinity, subnormals kept, checked against `half`'s software rounding.
    let mut g = vec![
        1.0 + 1.0 / 256.0, // a tie between 1 and 1 + 2^-7: to even (1)
        1.0 + 3.0 / 256.0, // a tie: to even (1 + 2^-6)
        -(1.0 + 1.0 / 256.0),
        1.0 + 1.0 / 256.0 + 1.0 / 65536.0, // just above the tie: up
        f32::MAX,                          // rounds to infinity
        f32::from_bits(0x0000_8000),       // a subnormal tie (to even: zero)
        f32::from_bits(0x0001_8000),       // a subnormal tie (to even: up)
        f32::NAN,
        0.0,
        -0.0,
    ];
    let mut rng = Rng(17);
    while g.len() < 4097 {
        // Random bit patterns: every exponent, NaNs and infinities included.
        g.push(f32::from_bits(rng.next_u64() as u32));
    }
    let n = g.len();
    let hp = AdamW {
        lr: 0.0,
        beta1: 0.0,
        beta2: 0.0,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    let k = AdamStep::new(&hp, 1, 1.0).unwrap();
    for isa in Isa::supported() {
        let mut p = vec![0f32; n];
        let (mut m, mut v) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
        k.apply(
            isa,
            2,
            &mut p,
            State::Bf16 {
                m: &mut m,
                v: &mut v,
            },
            Grads::F32(&g),
            CopyOut::None,
        )
        .unwrap();
        for i in 0..n {
            let want_m = bf16::from_f32_const(g[i] + 0.0);
            let want_v = bf16::from_f32_const(g[i] * g[i]);
            assert!(
                same_bits(m[i].to_f32(), want_m.to_f32()),
                "{isa}: m[{i}] of {:e} is {:e}, rounded to nearest even is {want_m:e}",
                g[i],
                m[i]
            );
            assert!(
                same_bits(v[i].to_f32(), want_v.to_f32()),
                "{isa}: v[{i}] of {:e} is {:e}, rounded to nearest even is {want_v:e}",
                g[i] * g[i],
                v[i]
            );
        }
        assert_eq!(
            m[0].to_bits(),
            bf16::ONE.to_bits(),
            "{isa}: tie not to even"
        );
        assert_eq!(m[1].to_f32(), 1.0 + 1.0 / 64.0, "{isa}: tie not to even");
        assert_eq!(
            m[3].to_f32(),
            1.0 + 1.0 / 128.0,
            "{isa}: above the tie not up"
        );
        assert!(m[4].to_f32().is_infinite(), "{isa}");
        assert_eq!(m[5].to_bits(), 0, "{isa}");
        assert_eq!(m[6].to_bits(), 2, "{isa}");
        assert!(m[7].is_nan(), "{isa}");
    }
}

#[test]
fn bf16_state_lengths_are_checked() {
    let k = AdamStep::new(&hp(), 1, 1.0).unwrap();
    let (mut p, g) = (vec![0f32; 10], vec![0f32; 10]);
    let (mut m, mut v) = (vec![bf16::ZERO; 10], vec![bf16::ZERO; 9]);
    let e = k
        .apply(
            Isa::active(),
            1,
            &mut p,
            State::Bf16 {
                m: &mut m,
                v: &mut v,
            },
            Grads::F32(&g),
            CopyOut::None,
        )
        .unwrap_err();
    assert!(e.to_string().contains("v has 9 entries"), "{e}");
}

/// Fresh 8-bit state for `n` parameters, quantized from `t`'s m and v.
#[derive(Clone)]
struct Q8Data {
    m_codes: Vec<u8>,
    m_scales: Vec<f32>,
    v_codes: Vec<u8>,
    v_scales: Vec<f32>,
}

impl Q8Data {
    fn from(t: &Tensors) -> Q8Data {
        let n = t.p.len();
        let mut q = Q8Data {
            m_codes: vec![0; n],
            m_scales: vec![0.0; q8::scale_count(n)],
            v_codes: vec![0; n],
            v_scales: vec![0.0; q8::scale_count(n)],
        };
        q8::quantize_m(&t.m, &mut q.m_codes, &mut q.m_scales);
        q8::quantize_v(&t.v, &mut q.v_codes, &mut q.v_scales);
        q
    }

    fn state(&mut self) -> Q8State<'_> {
        Q8State {
            m_codes: &mut self.m_codes,
            m_scales: &mut self.m_scales,
            v_codes: &mut self.v_codes,
            v_scales: &mut self.v_scales,
        }
    }
}

/// Codes equal, or neighbours (a value on a rounding edge): magnitudes differ by one
/// with the same sign, or one of them is the smallest magnitude of the other sign.
fn codes_close(a: u8, b: u8, signed: bool) -> bool {
    if a == b {
        return true;
    }
    if !signed {
        return a.abs_diff(b) == 1;
    }
    let (sa, ua) = (a >> 7, a & 0x7f);
    let (sb, ub) = (b >> 7, b & 0x7f);
    (sa == sb && ua.abs_diff(ub) == 1) || (ua <= 1 && ub <= 1)
}

#[test]
fn q8_state_matches_reference_on_every_isa_dtype_and_size() {
    let sizes = [0, 1, 7, 22, 255, 256, 257, 4097, 1_000_003];
    for (si, &n) in sizes.iter().enumerate() {
        let start = tensors(n, 11 + si as u64);
        for (ci, (gty, cty)) in types().into_iter().enumerate() {
            if n > 100_000 && ci % 3 != 0 {
                continue;
            }
            let grads = GradData::new(&start.g, gty);
            let isas = Isa::supported();
            for isa in isas {
                let threads = 1 + (si + ci) % 3;
                let label = format!("{isa}, {threads} threads, n {n}, grads {gty:?}, copy {cty:?}");
                let mut want_p = start.p.clone();
                let mut want_q = Q8Data::from(&start);
                let mut got_p: Vec<f32> = vec![];
                let mut got_q;
                // Two steps, each from the same inputs on both sides (the reference's
                // output): a code on a rounding edge would otherwise make them diverge.
                for t in [1u64, 2] {
                    got_p.clone_from(&want_p);
                    got_q = want_q.clone();
                    let k = AdamStep::new(&hp(), t + ci as u64, GradData::scale(gty)).unwrap();
                    let mut want_copy = CopyBuf::new(n, cty);
                    reference::adamw::step_q8(
                        &k,
                        &mut want_p,
                        want_q.state(),
                        grads.grads(gty),
                        want_copy.copy_out(cty),
                    );
                    let mut copy = CopyBuf::new(n, cty);
                    k.apply(
                        isa,
                        threads,
                        &mut got_p,
                        State::Q8(got_q.state()),
                        grads.grads(gty),
                        copy.copy_out(cty),
                    )
                    .unwrap();
                    copy.check(cty, &got_p, &label);
                    for i in 0..n {
                        let (p, wp) = (got_p[i], want_p[i]);
                        assert!(
                            close(p, wp, 1e-6 * f64::from(wp.abs()) + 1e-9),
                            "{label} step {t}: p[{i}] {p:e} vs reference {wp:e}"
                        );
                        let (a, b) = (got_q.m_codes[i], want_q.m_codes[i]);
                        assert!(
                            codes_close(a, b, true),
                            "{label}: m code [{i}] {a:#x} vs {b:#x}"
                        );
                        let (a, b) = (got_q.v_codes[i], want_q.v_codes[i]);
                        assert!(codes_close(a, b, false), "{label}: v code [{i}] {a} vs {b}");
                    }
                    for (what, got, want) in [
                        ("m", &got_q.m_scales, &want_q.m_scales),
                        ("v", &got_q.v_scales, &want_q.v_scales),
                    ] {
                        for (b, (&x, &y)) in got.iter().zip(want.iter()).enumerate() {
                            assert!(
                                close(x, y, 1e-6 * f64::from(y.abs())),
                                "{label}: {what} scale [{b}] {x:e} vs {y:e}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn q8_simd_encoding_is_the_format_definition() {
    // One step from fresh (all-zero) state, with lr = 0 so p stays, and beta1 = beta2
    // = 0 so that m = g and v = g * g exactly: the kernel's codes must then be exactly
    // q8::quantize_m / quantize_v of those values, on every ISA.
    let n = 5 * q8::BLOCK + 17;
    let mut rng = Rng(3);
    // Every block's largest magnitude is 1.5 (scale 1.5 / 1.875 = 0.8); some values are
    // far below the smallest code, some around it (where code 0 must not swallow them).
    let smallest = 0.8 * 2f32.powi(-15);
    let g: Vec<f32> = (0..n)
        .map(|i| match (i % q8::BLOCK == 3, i % 50) {
            (true, _) => -1.5,
            (_, 0) => 0.0,
            (_, 1) => rng.spread(1e-9, 1.0),
            (_, 2 | 3) => rng.signed().signum() * smallest * (0.8 + 0.35 * rng.signed()),
            _ => rng.spread(1.0, 4.0),
        })
        .collect();
    let hp = AdamW {
        lr: 0.0,
        beta1: 0.0,
        beta2: 0.0,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    let k = AdamStep::new(&hp, 1, 1.0).unwrap();
    let m_want: Vec<f32> = g.clone();
    let v_want: Vec<f32> = g.iter().map(|x| x * x).collect();
    // quantize_v encodes sqrt(v) = sqrt(g * g), as the kernel does.
    let want = Q8Data::from(&Tensors {
        p: vec![0.0; n],
        m: m_want,
        v: v_want,
        g: vec![],
    });
    for isa in Isa::supported() {
        let mut p = vec![0f32; n];
        let mut q = Q8Data {
            m_codes: vec![0; n],
            m_scales: vec![0.0; q8::scale_count(n)],
            v_codes: vec![0; n],
            v_scales: vec![0.0; q8::scale_count(n)],
        };
        k.apply(
            isa,
            2,
            &mut p,
            State::Q8(q.state()),
            Grads::F32(&g),
            CopyOut::None,
        )
        .unwrap();
        assert_eq!(q.m_codes, want.m_codes, "{isa}: m codes");
        assert_eq!(q.m_scales, want.m_scales, "{isa}: m scales");
        assert_eq!(q.v_codes, want.v_codes, "{isa}: v codes");
        assert_eq!(q.v_scales, want.v_scales, "{isa}: v scales");
        assert!(
            q.v_codes.iter().all(|&c| c >= 1),
            "{isa}: a sqrt(v) rounded to zero"
        );
    }
}

#[test]
fn q8_thread_counts_give_identical_results() {
    let n = 100_003;
    let start = tensors(n, 8);
    let k = AdamStep::new(&hp(), 4, 1.0).unwrap();
    for isa in Isa::supported() {
        let mut results = vec![];
        for threads in [1, 2, 3] {
            let mut p = start.p.clone();
            let mut q = Q8Data::from(&start);
            k.apply(
                isa,
                threads,
                &mut p,
                State::Q8(q.state()),
                Grads::F32(&start.g),
                CopyOut::None,
            )
            .unwrap();
            results.push((p, q.m_codes, q.m_scales, q.v_codes, q.v_scales));
        }
        for r in &results[1..] {
            assert!(
                r == &results[0],
                "{isa}: thread count changed the 8-bit result"
            );
        }
    }
}

/// The sum of squares is the fold of fixed pieces: the same bits for any thread count,
/// and a split at a multiple of the piece length (a rank's shard) gives the same pieces.
#[test]
fn grad_stats_are_pieces_folded_whatever_the_threads() {
    use strata_kernels::adamw::{STATS_PIECE, grad_stats_pieces};
    let n = 5 * STATS_PIECE + 1234;
    let t = tensors(n, 77);
    for isa in Isa::supported() {
        let one = grad_stats(isa, 1, Grads::F32(&t.g), 0.5).unwrap();
        for threads in [2, 3, 5] {
            let got = grad_stats(isa, threads, Grads::F32(&t.g), 0.5).unwrap();
            assert_eq!(
                got.sum_squares.to_bits(),
                one.sum_squares.to_bits(),
                "{isa} {threads}"
            );
        }
        let mut pieces = Vec::new();
        grad_stats_pieces(isa, 2, Grads::F32(&t.g), 0.5, &mut |s| pieces.push(s)).unwrap();
        assert_eq!(pieces.len(), n.div_ceil(STATS_PIECE));
        let folded = pieces.iter().fold(GradStats::default(), |a, &b| a.merge(b));
        assert_eq!(
            folded.sum_squares.to_bits(),
            one.sum_squares.to_bits(),
            "{isa}"
        );
        // Split at two pieces: each part's pieces are the whole's.
        let (a, b) = t.g.split_at(2 * STATS_PIECE);
        let mut parts = Vec::new();
        for part in [a, b] {
            grad_stats_pieces(isa, 3, Grads::F32(part), 0.5, &mut |s| parts.push(s)).unwrap();
        }
        assert_eq!(parts, pieces, "{isa}");
    }
}

/// The order every kernel sums squares in, written plainly (`STATS_PIECE`,
/// `STATS_LANES`): pieces, each the pairwise sum of lanes that add every
/// `STATS_LANES`-th square in order, folded left from zero. The CUDA kernel sums in it
/// too (kernels/tests/cuda_ops.rs holds it to the CPU's bits on a GPU).
fn sum_in_the_stated_order(g: &[f32], scale: f32) -> f64 {
    use strata_kernels::adamw::{STATS_LANES, STATS_PIECE};
    fn pairwise(x: &[f64]) -> f64 {
        match x {
            [one] => *one,
            _ => pairwise(&x[..x.len() / 2]) + pairwise(&x[x.len() / 2..]),
        }
    }
    let mut total = 0.0;
    for piece in g.chunks(STATS_PIECE) {
        let mut lanes = [0f64; STATS_LANES];
        for (i, &x) in piece.iter().enumerate() {
            let x = f64::from(x * scale);
            lanes[i % STATS_LANES] += x * x;
        }
        total += pairwise(&lanes);
    }
    total
}

/// Every instruction set's sum of squares is the stated order's, bit for bit, so the
/// clipping coefficient does not depend on the CPU (nor, on a GPU, on where the update
/// runs).
#[test]
fn grad_stats_are_the_same_bits_on_every_isa() {
    use strata_kernels::adamw::STATS_PIECE;
    for n in [1, 15, 16, 17, 100, STATS_PIECE - 1, 3 * STATS_PIECE + 77] {
        let t = tensors(n, 5 + n as u64);
        let want = sum_in_the_stated_order(&t.g, 0.5);
        for isa in Isa::supported() {
            let got = grad_stats(isa, 2, Grads::F32(&t.g), 0.5).unwrap();
            assert_eq!(
                got.sum_squares.to_bits(),
                want.to_bits(),
                "{isa}, n={n}: {} against {want}",
                got.sum_squares
            );
        }
    }
}

#[test]
fn grad_stats_match_reference_and_find_non_finite_values() {
    for (si, &n) in SIZES.iter().enumerate() {
        let t = tensors(n, 21 + si as u64);
        for gty in [GradType::F32, GradType::F16, GradType::Bf16] {
            let grads = GradData::new(&t.g, gty);
            let scale = GradData::scale(gty) * 0.5;
            let want = reference::adamw::grad_stats(grads.grads(gty), scale);
            assert!(!want.non_finite);
            for isa in Isa::supported() {
                for threads in [1, 2, 3] {
                    let got = grad_stats(isa, threads, grads.grads(gty), scale).unwrap();
                    assert!(!got.non_finite, "{isa} n {n}");
                    let tol = 1e-12 * want.sum_squares;
                    assert!(
                        (got.sum_squares - want.sum_squares).abs() <= tol,
                        "{isa}, {threads} threads, n {n}, {gty:?}: {} vs reference {}",
                        got.sum_squares,
                        want.sum_squares
                    );
                }
            }
        }
    }
    // One bad value anywhere (body, tail, last element) is found, in every dtype.
    let n = 4097;
    let t = tensors(n, 30);
    for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
        for at in [0, 1000, 4095, 4096] {
            let mut g = t.g.clone();
            g[at] = bad;
            for gty in [GradType::F32, GradType::F16, GradType::Bf16] {
                let grads = GradData::new(&g, gty);
                assert!(reference::adamw::grad_stats(grads.grads(gty), 1.0).non_finite);
                for isa in Isa::supported() {
                    for threads in [1, 3] {
                        let s = grad_stats(isa, threads, grads.grads(gty), 1.0).unwrap();
                        assert!(s.non_finite, "{isa} {gty:?}: {bad} at {at} not found");
                    }
                }
            }
        }
    }
    // A finite gradient that the scale pushes past f32's range is not finite either,
    // as the step would see it; a huge but finite one is fine in f64.
    let mut g = vec![1.0f32; 100];
    g[42] = 1e30;
    for isa in Isa::supported() {
        let s = grad_stats(isa, 1, Grads::F32(&g), 1e9).unwrap();
        assert!(s.non_finite, "{isa}");
        let s = grad_stats(isa, 1, Grads::F32(&g), 1.0).unwrap();
        let want = f64::from(1e30f32).powi(2) + 99.0;
        assert!(!s.non_finite && (s.sum_squares - want).abs() <= want * 1e-15);
    }
    let merged = GradStats::default().merge(GradStats {
        sum_squares: 4.0,
        non_finite: false,
    });
    assert_eq!(merged.norm(), 2.0);
}

#[test]
fn mismatched_lengths_are_errors_that_name_them() {
    let k = AdamStep::new(&hp(), 1, 1.0).unwrap();
    let g = vec![0f32; 10];
    // Ten parameters with fp32 state of lengths (m, v), gradients and copy-out lengths.
    let f32_error = |m: usize, v: usize, grads: usize, out: Option<usize>| {
        let (mut p, mut m, mut v) = (vec![0f32; 10], vec![0f32; m], vec![0f32; v]);
        let mut o = vec![f16::ZERO; out.unwrap_or(0)];
        let copy_out = if out.is_some() {
            CopyOut::F16(&mut o)
        } else {
            CopyOut::None
        };
        let state = State::F32 {
            m: &mut m,
            v: &mut v,
        };
        k.apply(
            Isa::Portable,
            1,
            &mut p,
            state,
            Grads::F32(&g[..grads]),
            copy_out,
        )
        .unwrap_err()
    };
    let e = f32_error(10, 9, 10, None);
    assert_eq!(
        e,
        AdamError::LengthMismatch {
            what: "v",
            params: 10,
            expected: 10,
            actual: 9
        }
    );
    assert!(e.to_string().contains("v has 9 entries"), "{e}");
    let e = f32_error(10, 10, 10, Some(11));
    assert!(e.to_string().contains("copy-out buffer has 11"), "{e}");
    let e = f32_error(10, 10, 3, None);
    assert!(e.to_string().contains("gradients has 3 entries"), "{e}");
    let mut q = Q8Data {
        m_codes: vec![0; 10],
        m_scales: vec![0.0; 2],
        v_codes: vec![0; 10],
        v_scales: vec![0.0; 1],
    };
    let mut p = vec![0f32; 10];
    let e = k
        .apply(
            Isa::Portable,
            1,
            &mut p,
            State::Q8(q.state()),
            Grads::F32(&g),
            CopyOut::None,
        )
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("m scales has 2 entries but the 10 parameters need 1"),
        "{e}"
    );
    for isa in Isa::ALL {
        if !isa.is_supported() {
            let e = grad_stats(isa, 1, Grads::F32(&g), 1.0).unwrap_err();
            assert_eq!(e, AdamError::UnsupportedIsa(isa));
        }
    }
}
