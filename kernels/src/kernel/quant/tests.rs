//! The quantised formats' tests: the codebooks against their definitions, the quantisers
//! against the reference's nearest-level search, the dequantisers (CPU op on every
//! instruction set and thread count, and the CUDA launch through the emulator) bit for bit
//! against the reference, the error bounds on normal data, and NF4 against bitsandbytes'
//! own output (`tests/data/nf4/`).

use half::bf16;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use super::format::{DYNAMIC_MIDPOINTS, NF4_MIDPOINTS, absmax_value, code_of, quantize_absmax};
use super::*;
use crate::cuda::launch::Arg;
use crate::cuda::launch::tests::{
    Emulated, Emulator, Layout, check_emulation, count_arg, ptr_arg, random_inputs,
};
use crate::isa::Isa;
use crate::kernel::Kernel;

/// `n` samples of N(0, 1) (Box-Muller), from `seed`.
fn normal(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let u: f64 = 1.0 - rng.random::<f64>();
            let v: f64 = rng.random();
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        })
        .collect()
}

/// Normal values with outliers (every 1000th times 40), a block of zeros and a block
/// holding one nonzero value: what weights look like, and the edge cases.
fn weights(n: usize, seed: u64) -> Vec<f32> {
    let mut x = normal(n, seed);
    for v in x.iter_mut().step_by(1000) {
        *v *= 40.0;
    }
    if n >= 4 * NF4_BLOCK {
        x[NF4_BLOCK..2 * NF4_BLOCK].fill(0.0);
        x[2 * NF4_BLOCK..3 * NF4_BLOCK].fill(0.0);
        x[2 * NF4_BLOCK + 5] = -3.5;
    }
    x
}

fn bits<T: Copy>(v: &[T], to_bits: fn(T) -> u32) -> Vec<u32> {
    v.iter().map(|&x| to_bits(x)).collect()
}

/// Φ(x), the standard normal distribution function, from its Taylor series
/// 1/2 + φ(x) Σ x^(2n+1) / (1·3···(2n+1)), whose terms all have x's sign: no
/// cancellation, so it is accurate to rounding where it is used (|x| ≤ 6).
fn normal_cdf(x: f64) -> f64 {
    let (mut term, mut sum, mut n) = (x, x, 0);
    while term.abs() > 1e-18 * sum.abs() {
        n += 1;
        term *= x * x / f64::from(2 * n + 1);
        sum += term;
    }
    0.5 + sum * (-x * x / 2.0).exp() / std::f64::consts::TAU.sqrt()
}

/// Φ⁻¹(p), by bisection of [`normal_cdf`] down to adjacent f64 values.
fn normal_quantile(p: f64) -> f64 {
    let (mut lo, mut hi) = (-6.0f64, 6.0f64);
    loop {
        let mid = 0.5 * (lo + hi);
        if mid == lo || mid == hi {
            return mid;
        }
        if normal_cdf(mid) < p {
            lo = mid;
        } else {
            hi = mid;
        }
    }
}

#[test]
fn the_normal_quantile_function_is_accurate() {
    assert_eq!(normal_cdf(0.0), 0.5);
    assert!((normal_cdf(1.0) - 0.841_344_746_068_542_9).abs() < 1e-15);
    // Published values of Φ⁻¹ (Abramowitz and Stegun, table 26.5).
    assert!((normal_quantile(0.975) - 1.959_963_984_540_054).abs() < 1e-12);
    assert!((normal_quantile(0.995) - 2.575_829_303_548_901).abs() < 1e-12);
    assert!((normal_quantile(0.5)).abs() < 1e-15);
}

/// The NF4 levels from their definition (`format::NF4_CODE`), in f64.
fn nf4_from_definition() -> Vec<f64> {
    // torch.linspace takes its ends as float32.
    let offset = f64::from(0.967_708_3_f32);
    let linspace = |steps: usize, k: usize| offset + (0.5 - offset) * k as f64 / (steps - 1) as f64;
    let mut v: Vec<f64> = (0..8).map(|k| normal_quantile(linspace(9, k))).collect();
    v.extend((0..7).map(|k| -normal_quantile(linspace(8, k))));
    v.push(0.0);
    v.sort_by(f64::total_cmp);
    let max = v[15];
    v.iter().map(|x| x / max).collect()
}

#[test]
fn the_nf4_code_is_the_normal_quantiles_it_is_defined_as() {
    let want = nf4_from_definition();
    let mut worst = 0f64;
    for (i, (&got, want)) in NF4_CODE.iter().zip(&want).enumerate() {
        let diff = (f64::from(got) - want).abs();
        // The probabilities are float32 in bitsandbytes, f64 here: Φ⁻¹'s slope (at most
        // 14 here) times half a float32 ulp of p, over 1.848, is under 3e-7.
        assert!(
            diff < 1e-6,
            "level {i}: {got} against {want} (off {diff:e})"
        );
        worst = worst.max(diff);
    }
    println!("NF4 levels against their definition: largest difference {worst:e}");
    assert!(NF4_CODE.windows(2).all(|w| w[0] < w[1]));
    assert_eq!((NF4_CODE[0], NF4_CODE[7], NF4_CODE[15]), (-1.0, 0.0, 1.0));
}

#[test]
fn the_dynamic_map_is_the_one_it_is_defined_as() {
    assert!(DYNAMIC_MAP.windows(2).all(|w| w[0] < w[1]));
    assert_eq!((DYNAMIC_MAP[127], DYNAMIC_MAP[255]), (0.0, 1.0));
    let mut k = 128;
    for decade in 0..7 {
        let count = 1usize << decade;
        for j in 0..count {
            let mean = 0.1 + 0.9 * (j as f64 + 0.5) / count as f64;
            let want = 10f64.powi(decade - 6) * mean;
            let got = f64::from(DYNAMIC_MAP[k]);
            // float32 linspace, midpoint and product: a few float32 roundings.
            assert!(
                (got - want).abs() <= 3e-7 * want,
                "entry {k}: {got} against {want}"
            );
            assert_eq!(DYNAMIC_MAP[254 - k], -DYNAMIC_MAP[k], "entry {k}'s mirror");
            k += 1;
        }
    }
    assert_eq!(k, 255);
}

/// The next f32 above `x` (finite, not -0).
fn next_up(x: f32) -> f32 {
    match x {
        0.0 => f32::from_bits(1),
        x if x > 0.0 => f32::from_bits(x.to_bits() + 1),
        x => f32::from_bits(x.to_bits() - 1),
    }
}

#[test]
fn a_value_on_a_midpoint_takes_the_lower_level() {
    for midpoints in [&NF4_MIDPOINTS[..], &DYNAMIC_MIDPOINTS[..]] {
        for (i, &m) in midpoints.iter().enumerate() {
            assert_eq!(code_of(m, midpoints), i as u8, "midpoint {i} ({m})");
            assert_eq!(
                code_of(next_up(m), midpoints),
                i as u8 + 1,
                "above midpoint {i}"
            );
        }
        assert_eq!(code_of(-1.0, midpoints), 0);
        assert_eq!(code_of(1.0, midpoints) as usize, midpoints.len());
    }
}

/// Whether `scaled` lies within a few f32 ulps of one of `midpoints`: where the format's
/// `x * (1 / a)` and the reference's exact `x / a` may fall on different sides.
fn near_a_midpoint(scaled: f64, midpoints: &[f32]) -> bool {
    midpoints
        .iter()
        .any(|&m| (scaled - f64::from(m)).abs() <= 4.0 * f64::from(f32::EPSILON) * scaled.abs())
}

#[test]
fn the_quantisers_pick_the_nearest_levels() {
    let mut near = 0;
    for (len, seed) in [(1, 1), (7, 2), (65, 3), (4097, 4), (100_003, 5)] {
        let x = weights(len, seed);
        let q = Nf4Blocks::quantize(&x);
        let want = reference::quantize_nf4_codes(&x);
        for i in 0..len {
            let (got, want) = (
                reference::nf4_code_at(&q.codes, i),
                reference::nf4_code_at(&want, i),
            );
            if got != want {
                let start = i / NF4_BLOCK * NF4_BLOCK;
                let block = &x[start..(start + NF4_BLOCK).min(len)];
                let a = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                let scaled = f64::from(x[i]) / f64::from(a);
                assert!(
                    near_a_midpoint(scaled, &NF4_MIDPOINTS),
                    "len {len}, value {i}"
                );
                near += 1;
            }
        }
        if len % 2 == 1 {
            assert_eq!(
                q.codes[len / 2] & 0x0f,
                format::NF4_ZERO_CODE,
                "the padding nibble"
            );
        }
    }
    assert!(near <= 2, "{near} codes on a midpoint");
    let absmax: Vec<f32> = normal(3000, 6).iter().map(|v| v.abs() + 1.0).collect();
    let offset = 1.75;
    let (codes, scales) = quantize_absmax(&absmax, offset);
    for (i, (&a, &code)) in absmax.iter().zip(&codes).enumerate() {
        let scale = scales[i / ABSMAX_GROUP];
        if code != reference::absmax_code(a - offset, scale) {
            let scaled = f64::from(a - offset) / f64::from(scale);
            assert!(near_a_midpoint(scaled, &DYNAMIC_MIDPOINTS), "absmax {i}");
        }
    }
}

#[test]
fn a_constant_tensor_keeps_its_absmax_exactly() {
    let x = vec![0.25f32; 1000];
    let q = Nf4Blocks::quantize(&x);
    assert!(q.absmax_scale.iter().all(|&s| s == 0.0));
    let mut out = vec![0.0f32; x.len()];
    dequantize_nf4(&Cpu::single(Isa::Portable), &mut out, q.parts());
    assert_eq!(out, x);
    let zeros = Nf4Blocks::quantize(&[0.0; 130]);
    let mut out = vec![1.0f32; 130];
    dequantize_nf4(&Cpu::single(Isa::Portable), &mut out, zeros.parts());
    assert!(out.iter().all(|&v| v == 0.0));
}

/// Every CPU op configuration: each instruction set on 1 and 3 threads.
fn cpus() -> Vec<Cpu> {
    let mut out = Vec::new();
    for isa in Isa::supported() {
        for threads in [1, 3] {
            out.push(Cpu { isa, threads });
        }
    }
    out
}

#[test]
fn nf4_dequantisation_gives_the_references_bits_on_odd_sizes() {
    for (len, seed) in [
        (1, 1),
        (7, 2),
        (22, 3),
        (63, 4),
        (64, 5),
        (65, 6),
        (4097, 7),
    ]
    .into_iter()
    .chain([(70_001, 8), (1_000_003, 9)])
    {
        let q = Nf4Blocks::quantize(&weights(len, seed));
        let mut want = vec![0.0f32; len];
        let p = q.parts();
        reference::dequantize_nf4(
            &mut want,
            p.codes,
            p.absmax_q,
            p.absmax_scale,
            p.absmax_offset,
        );
        let want_bf16: Vec<bf16> = want.iter().map(|&v| bf16::from_f32(v)).collect();
        for cpu in cpus() {
            let mut got = vec![f32::NAN; len];
            dequantize_nf4(&cpu, &mut got, p);
            assert!(
                bits(&got, f32::to_bits) == bits(&want, f32::to_bits),
                "len {len}, {cpu:?}"
            );
            let mut got = vec![bf16::NAN; len];
            dequantize_nf4(&cpu, &mut got, p);
            let b16 = |v: bf16| u32::from(v.to_bits());
            assert!(
                bits(&got, b16) == bits(&want_bf16, b16),
                "bf16, len {len}, {cpu:?}"
            );
        }
    }
}

#[test]
fn int8_dequantisation_gives_the_references_bits_on_odd_sizes() {
    for (len, seed) in [
        (1, 1),
        (7, 2),
        (22, 3),
        (64, 4),
        (65, 5),
        (4097, 6),
        (1_000_003, 7),
    ] {
        let q = Int8Blocks::quantize(&weights(len, seed));
        let mut want = vec![0.0f32; len];
        reference::dequantize_int8(&mut want, &q.codes, &q.scales);
        let want_bf16: Vec<bf16> = want.iter().map(|&v| bf16::from_f32(v)).collect();
        for cpu in cpus() {
            let mut got = vec![f32::NAN; len];
            dequantize_int8(&cpu, &mut got, &q.codes, &q.scales);
            assert!(
                bits(&got, f32::to_bits) == bits(&want, f32::to_bits),
                "len {len}, {cpu:?}"
            );
            let mut got = vec![bf16::NAN; len];
            dequantize_int8(&cpu, &mut got, &q.codes, &q.scales);
            let b16 = |v: bf16| u32::from(v.to_bits());
            assert!(
                bits(&got, b16) == bits(&want_bf16, b16),
                "bf16, len {len}, {cpu:?}"
            );
        }
    }
}

/// Root mean square of `a - b`.
fn rms_error(a: &[f32], b: &[f32]) -> f64 {
    let sum: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
        .sum();
    (sum / a.len() as f64).sqrt()
}

#[test]
fn errors_on_normal_data_are_within_their_bounds() {
    let x = normal(1 << 20, 11);
    let cpu = Cpu::single(Isa::Portable);
    let q = Nf4Blocks::quantize(&x);
    let mut nf4 = vec![0.0f32; x.len()];
    dequantize_nf4(&cpu, &mut nf4, q.parts());
    let largest_gap = NF4_CODE
        .windows(2)
        .map(|w| w[1] - w[0])
        .fold(0f32, f32::max);
    let mut exact_absmax_sq = 0f64;
    for (b, block) in x.chunks(NF4_BLOCK).enumerate() {
        let a = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = q.absmax_scale[b / ABSMAX_GROUP];
        let a_dq = absmax_value(q.absmax_q[b], scale, q.absmax_offset);
        let mut worst = (0f64, 0f64);
        for (k, &v) in block.iter().enumerate() {
            let level =
                f64::from(NF4_CODE[reference::nf4_code_at(&q.codes, b * NF4_BLOCK + k) as usize]);
            let exact = (f64::from(v) - level * f64::from(a)).abs();
            exact_absmax_sq += exact * exact;
            let dq = (f64::from(v) - f64::from(nf4[b * NF4_BLOCK + k])).abs();
            worst = (worst.0.max(exact), worst.1.max(dq));
        }
        // Half the largest gap times the absmax (a hair over, for the f32 roundings);
        // with the absmax double-quantised, plus that absmax's own error.
        let bound = f64::from(largest_gap) / 2.0 * f64::from(a) * (1.0 + 1e-6);
        assert!(worst.0 <= bound, "block {b}: {} > {bound}", worst.0);
        let absmax_error = (f64::from(a) - f64::from(a_dq)).abs();
        assert!(
            worst.1 <= bound + absmax_error * 1.000_001,
            "block {b}, double-quantised"
        );
    }
    let rms_nf4 = rms_error(&x, &nf4);
    let rms_exact = (exact_absmax_sq / x.len() as f64).sqrt();
    let i8q = Int8Blocks::quantize(&x);
    let mut int8 = vec![0.0f32; x.len()];
    dequantize_int8(&cpu, &mut int8, &i8q.codes, &i8q.scales);
    let rms_int8 = rms_error(&x, &int8);
    println!(
        "N(0,1), 2^20 values: RMS error NF4 {rms_nf4:.5} (absmaxes exact: {rms_exact:.5}), \
         int8 {rms_int8:.6}"
    );
    // NF4 at block 64 on N(0, 1): about 0.093 (bitsandbytes' own output on the golden
    // data's normal tensor: 0.0928); the double quantisation adds well under 1%.
    assert!((0.088..0.098).contains(&rms_nf4), "NF4 RMS error {rms_nf4}");
    assert!((rms_nf4 - rms_exact).abs() < 0.01 * rms_exact);
    // int8 at block 64: a uniform rounding error of step absmax / 127, the absmax of 64
    // normal values about 2.6 (the largest of 128 half-normal draws, in effect):
    // 2.6 / 127 / sqrt(12) ≈ 0.0059.
    assert!(
        (0.0055..0.0063).contains(&rms_int8),
        "int8 RMS error {rms_int8}"
    );
    for (i, (&v, &d)) in x.iter().zip(&int8).enumerate() {
        let scale = i8q.scales[i / INT8_BLOCK];
        assert!(
            (v - d).abs() <= 0.5 * scale * (1.0 + 1e-5),
            "int8 value {i}"
        );
    }
}

#[test]
fn storage_costs_about_4_127_bits_per_nf4_parameter() {
    let n = NF4_BLOCK * ABSMAX_GROUP * 4;
    let bits_per = Nf4Blocks::storage_bytes(n) as f64 * 8.0 / n as f64;
    let want = 4.0 + 8.0 / 64.0 + 32.0 / (64.0 * 256.0) + 32.0 / n as f64;
    assert!((bits_per - want).abs() < 1e-12, "{bits_per}");
    assert!((bits_per - 4.127).abs() < 0.001);
    let q = Nf4Blocks::quantize(&weights(4097, 3));
    let held = q.codes.len() + q.absmax_q.len() + 4 * q.absmax_scale.len() + 4;
    assert_eq!(held, Nf4Blocks::storage_bytes(4097));
    let q = Int8Blocks::quantize(&weights(4097, 3));
    assert_eq!(
        q.codes.len() + 4 * q.scales.len(),
        Int8Blocks::storage_bytes(4097)
    );
    assert_eq!(Int8Blocks::storage_bytes(n) * 8 * 2, 17 * n);
}

/// The literals of the `__constant__ float <name>[...] = { ... };` table of quant.cu.
fn cuda_table(name: &str) -> Vec<f32> {
    let source = include_str!("quant.cu");
    let start = source
        .find(&format!("float {name}["))
        .unwrap_or_else(|| panic!("{name} is not in quant.cu"));
    let body = &source[start..];
    let (open, close) = (body.find('{').unwrap(), body.find("};").unwrap());
    body[open + 1..close]
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.trim_end_matches('f').parse().unwrap())
        .collect()
}

#[test]
fn the_cuda_tables_and_sizes_are_the_hosts() {
    let nf4 = cuda_table("QUANT_NF4_CODE");
    assert_eq!(bits(&nf4, f32::to_bits), bits(&NF4_CODE, f32::to_bits));
    let positive = cuda_table("QUANT_DYNAMIC_POSITIVE");
    assert_eq!(
        bits(&positive, f32::to_bits),
        bits(&DYNAMIC_MAP[128..255], f32::to_bits)
    );
    let source = include_str!("quant.cu");
    for (name, value) in [
        ("QUANT_NF4_BLOCK", NF4_BLOCK),
        ("QUANT_ABSMAX_GROUP", ABSMAX_GROUP),
        ("QUANT_INT8_BLOCK", INT8_BLOCK),
    ] {
        let line = format!("#define {name} {value}\n");
        assert!(source.contains(&line), "{line:?} is not in quant.cu");
    }
}

/// The PTX body of the entry point `name`.
fn ptx_body(ptx: &str, name: &str) -> String {
    let start = ptx
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("{name} is not in the PTX"));
    let rest = &ptx[start + 1..];
    rest[..rest.find(".entry ").unwrap_or(rest.len())].to_string()
}

#[test]
#[cfg_attr(
    not(strata_nvrtc),
    ignore = "NVRTC (libnvrtc.so.13) not found when built"
)]
fn the_cuda_dequantisers_round_each_operation() {
    let ptx = crate::cuda::program::ptx(9, 0).unwrap_or_else(|e| panic!("{e}"));
    for name in [
        "nf4_dequantize_f32",
        "nf4_dequantize_bf16",
        "int8_dequantize_f32",
    ] {
        let body = ptx_body(&ptx, name);
        assert!(
            !body.contains("fma."),
            "{name} fuses a multiply-add:\n{body}"
        );
        assert!(body.contains("mul.rn.f32"), "{name}: no rounded multiply");
    }
    assert!(ptx_body(&ptx, "nf4_dequantize_f32").contains("add.rn.f32"));
}

/// Byte `i` of the u8 tensor at `ptr`, through the emulator's f32 words (the tensor must
/// span whole words).
fn load_byte(m: &Emulator, ptr: u64, i: usize) -> u8 {
    m.load(ptr, i / 4).to_bits().to_le_bytes()[i % 4]
}

fn nf4_kernel(w: Dtype, l: &mut Layout, n: usize, round_bf16: bool) -> Nf4Dequantize {
    Nf4Dequantize {
        out: l.tensor(n, w),
        codes: l.tensor(n.div_ceil(2), Dtype::U8),
        absmax_q: l.tensor(Nf4Blocks::block_count(n), Dtype::U8),
        absmax_scale: l.tensor(Nf4Blocks::group_count(n), Dtype::F32),
        absmax_offset: l.tensor(1, Dtype::F32),
        round_bf16,
    }
}

fn int8_kernel(w: Dtype, l: &mut Layout, n: usize, round_bf16: bool) -> Int8Dequantize {
    Int8Dequantize {
        out: l.tensor(n, w),
        codes: l.tensor(n, Dtype::U8),
        scales: l.tensor(n.div_ceil(INT8_BLOCK), Dtype::F32),
        round_bf16,
    }
}

/// `x` as the launch's round_bf16 argument `arg` says: rounded to bf16's precision where
/// it is 1.
fn emulated_round(name: &str, arg: &Arg, x: f32) -> f32 {
    match arg {
        Arg::Int(0) => x,
        Arg::Int(1) => bf16::from_f32(x).to_f32(),
        other => panic!("{name}: round_bf16 is {other:?}"),
    }
}

impl Emulated for Nf4Dequantize {
    fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
        [4097, 0, 17_407]
            .map(|n| nf4_kernel(w, l, n, n % 2 == 1))
            .to_vec()
    }

    fn dimensions(&self) -> Vec<(&'static str, usize)> {
        vec![
            ("n", self.out.len),
            ("round_bf16", usize::from(self.round_bf16)),
        ]
    }

    fn emulate(name: &str, args: &[Arg], m: &Emulator) -> bool {
        if name != "nf4_dequantize_f32" {
            return false;
        }
        let [out, codes, absmax_q, absmax_scale, offset] =
            [0, 1, 2, 3, 4].map(|i| ptr_arg(name, args, i));
        let offset = m.load(offset, 0);
        for i in 0..count_arg(name, args, 6) {
            let block = i / NF4_BLOCK;
            let map = DYNAMIC_MAP[usize::from(load_byte(m, absmax_q, block))];
            let absmax = map * m.load(absmax_scale, block / ABSMAX_GROUP) + offset;
            let byte = load_byte(m, codes, i / 2);
            let code = if i.is_multiple_of(2) {
                byte >> 4
            } else {
                byte & 15
            };
            let x = NF4_CODE[usize::from(code)] * absmax;
            m.store(out, i, emulated_round(name, &args[5], x));
        }
        true
    }
}

impl Emulated for Int8Dequantize {
    fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
        [4097, 0, 65]
            .map(|n| int8_kernel(w, l, n, n % 2 == 1))
            .to_vec()
    }

    fn dimensions(&self) -> Vec<(&'static str, usize)> {
        vec![
            ("n", self.out.len),
            ("round_bf16", usize::from(self.round_bf16)),
        ]
    }

    fn emulate(name: &str, args: &[Arg], m: &Emulator) -> bool {
        if name != "int8_dequantize_f32" {
            return false;
        }
        let [out, codes, scales] = [0, 1, 2].map(|i| ptr_arg(name, args, i));
        for i in 0..count_arg(name, args, 4) {
            let code = load_byte(m, codes, i) as i8;
            let x = f32::from(code) * m.load(scales, i / INT8_BLOCK);
            m.store(out, i, emulated_round(name, &args[3], x));
        }
        true
    }
}

#[test]
fn the_cuda_launches_compute_the_cpus_bits() {
    let mut l = Layout::default();
    let f = Dtype::F32;
    // The emulator reads bytes through f32 words: sizes whose byte tensors span whole
    // words, with a short last block (and for NF4 an odd count, several absmax groups).
    let mut kernels: Vec<Kernel> = [255, 4095, 17_407]
        .map(|n| Kernel::Nf4Dequantize(nf4_kernel(f, &mut l, n, false)))
        .to_vec();
    kernels.extend([255, 4095].map(|n| Kernel::Nf4Dequantize(nf4_kernel(f, &mut l, n, true))));
    for round_bf16 in [false, true] {
        kernels.extend(
            [68, 4092].map(|n| Kernel::Int8Dequantize(int8_kernel(f, &mut l, n, round_bf16))),
        );
    }
    let mut inputs = random_inputs(&l, &kernels, 13);
    let mut rng = StdRng::seed_from_u64(17);
    for kernel in &kernels {
        kernel.for_each_tensor(|t, _| {
            if t.dtype == Dtype::U8 {
                let words = TensorRef::new(t.buf, t.offset_bytes, t.len / 4, Dtype::U32);
                assert_eq!(words.bytes(), t.bytes(), "{t:?} spans whole words");
                let values: Vec<u32> = (0..words.len).map(|_| rng.random()).collect();
                inputs.write_u32(&words, &values);
            }
        });
    }
    // The same multiplies and adds in the same order on both: no error at all.
    check_emulation(&kernels, inputs, f64::MIN_POSITIVE);
}

/// The golden data's tensors (tests/data/nf4/README.md).
struct Golden {
    bytes: Vec<u8>,
}

impl Golden {
    fn load() -> Golden {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/data/nf4/nf4.safetensors");
        let bytes = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("cannot read the golden data {}: {e}", path.display()));
        Golden { bytes }
    }

    fn raw(&self, name: &str, dtype: safetensors::Dtype) -> Vec<u8> {
        let file = safetensors::SafeTensors::deserialize(&self.bytes).expect("valid safetensors");
        let view = file
            .tensor(name)
            .unwrap_or_else(|e| panic!("golden tensor {name}: {e}"));
        assert_eq!(view.dtype(), dtype, "{name}");
        view.data().to_vec()
    }

    fn u8s(&self, name: &str) -> Vec<u8> {
        self.raw(name, safetensors::Dtype::U8)
    }

    fn f32s(&self, name: &str) -> Vec<f32> {
        let raw = self.raw(name, safetensors::Dtype::F32);
        raw.chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    fn bf16s(&self, name: &str) -> Vec<bf16> {
        let raw = self.raw(name, safetensors::Dtype::BF16);
        raw.chunks_exact(2)
            .map(|b| bf16::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }
}

const GOLDEN_TENSORS: [&str; 4] = ["normal", "outliers", "tail_even", "tail_odd"];

#[test]
fn the_codebooks_are_bitsandbytes_bits() {
    let g = Golden::load();
    assert_eq!(
        bits(&g.f32s("nf4_code"), f32::to_bits),
        bits(&NF4_CODE, f32::to_bits)
    );
    assert_eq!(
        bits(&g.f32s("dynamic_map"), f32::to_bits),
        bits(&DYNAMIC_MAP, f32::to_bits)
    );
    for name in GOLDEN_TENSORS {
        let code = g.f32s(&format!("{name}.absmax_code"));
        assert_eq!(
            bits(&code, f32::to_bits),
            bits(&DYNAMIC_MAP, f32::to_bits),
            "{name}"
        );
    }
}

#[test]
fn quantisation_gives_bitsandbytes_codes() {
    let g = Golden::load();
    let mut farther = 0;
    for name in GOLDEN_TENSORS {
        let t = |part: &str| format!("{name}.{part}");
        let x = g.f32s(&t("input"));
        let ours = Nf4Blocks::quantize(&x);
        assert!(ours.codes == g.u8s(&t("packed")), "{name}: packed codes");
        let absmax: Vec<f32> = x
            .chunks(NF4_BLOCK)
            .map(|b| b.iter().fold(0f32, |m, v| m.max(v.abs())))
            .collect();
        assert_eq!(
            bits(&absmax, f32::to_bits),
            bits(&g.f32s(&t("absmax")), f32::to_bits)
        );
        // bitsandbytes' offset is a float32 mean, ours an f64 one rounded once.
        let offset = g.f32s(&t("absmax_offset"))[0];
        let ulps = (ours.absmax_offset.to_bits() as i64 - offset.to_bits() as i64).abs();
        assert!(
            ulps <= 1,
            "{name}: offset {} against {offset}",
            ours.absmax_offset
        );
        let ours = Nf4Blocks::quantize_with_offset(&x, offset);
        let scales = g.f32s(&t("absmax_scale"));
        assert_eq!(
            bits(&ours.absmax_scale, f32::to_bits),
            bits(&scales, f32::to_bits)
        );
        for (b, (&got, &theirs)) in ours.absmax_q.iter().zip(&g.u8s(&t("absmax_q"))).enumerate() {
            if got != theirs {
                // bitsandbytes' CPU search is not always nearest: ours must be nearer.
                let scaled = f64::from(absmax[b] - offset) / f64::from(scales[b / ABSMAX_GROUP]);
                let distance = |c: u8| (scaled - f64::from(DYNAMIC_MAP[usize::from(c)])).abs();
                assert!(distance(got) < distance(theirs), "{name}: absmax code {b}");
                farther += 1;
            }
        }
    }
    println!("absmax codes where bitsandbytes' CPU search is farther than nearest: {farther}");
    assert!(farther <= 4, "{farther}");
}

#[test]
fn dequantisation_gives_bitsandbytes_values() {
    let g = Golden::load();
    for name in GOLDEN_TENSORS {
        let t = |part: &str| format!("{name}.{part}");
        let (codes, absmax_q) = (g.u8s(&t("packed")), g.u8s(&t("absmax_q")));
        let absmax_scale = g.f32s(&t("absmax_scale"));
        let parts = Nf4Parts {
            codes: &codes,
            absmax_q: &absmax_q,
            absmax_scale: &absmax_scale,
            absmax_offset: g.f32s(&t("absmax_offset"))[0],
        };
        let absmax: Vec<f32> = absmax_q
            .iter()
            .enumerate()
            .map(|(b, &q)| absmax_value(q, absmax_scale[b / ABSMAX_GROUP], parts.absmax_offset))
            .collect();
        let want = g.f32s(&t("absmax_dequantized"));
        assert_eq!(
            bits(&absmax, f32::to_bits),
            bits(&want, f32::to_bits),
            "{name}"
        );
        let want = g.f32s(&t("dequantized"));
        let mut got = vec![f32::NAN; want.len()];
        reference::dequantize_nf4(
            &mut got,
            &codes,
            &absmax_q,
            &absmax_scale,
            parts.absmax_offset,
        );
        assert!(
            bits(&got, f32::to_bits) == bits(&want, f32::to_bits),
            "{name}: reference"
        );
        let want_bf16 = g.bf16s(&t("dequantized_bf16"));
        let b16 = |v: bf16| u32::from(v.to_bits());
        for cpu in cpus() {
            let mut got = vec![f32::NAN; want.len()];
            dequantize_nf4(&cpu, &mut got, parts);
            assert!(
                bits(&got, f32::to_bits) == bits(&want, f32::to_bits),
                "{name}: {cpu:?}"
            );
            let mut got = vec![bf16::NAN; want.len()];
            dequantize_nf4(&cpu, &mut got, parts);
            assert!(
                bits(&got, b16) == bits(&want_bf16, b16),
                "{name}: bf16, {cpu:?}"
            );
        }
    }
}
