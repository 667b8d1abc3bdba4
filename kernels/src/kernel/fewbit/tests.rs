//! The few-bit family's tests: the tables against the optimiser and the `.cu`'s copy,
//! the codes against the intervals, the CPU ops against the references bit for bit, the
//! approximation's error by Monte Carlo, and the CUDA launches through the emulator.

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use super::*;
use crate::cuda::launch::Arg;
use crate::cuda::launch::tests::{
    Emulated, Emulator, Layout, check_emulation, count_arg, ptr_arg, random_inputs,
};
use crate::isa::Isa;
use crate::kernel::Kernel;
use crate::kernel::{gelu, swiglu};

/// An activation's name, tables and exact derivative.
type Family = (&'static str, &'static [Table; 4], fn(f64) -> f64);

/// `[GELU, SiLU]`.
const FAMILIES: [Family; 2] = [
    ("GELU", &GELU_TABLES, fit::gelu_derivative),
    ("SiLU", &SILU_TABLES, fit::silu_derivative),
];

fn bits_of(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn the_tables_are_what_the_optimiser_finds() {
    for (f, (name, tables, derivative)) in FAMILIES.iter().enumerate() {
        for (b, (table, fitted)) in tables.iter().zip(fit::fit(*derivative)).enumerate() {
            let what = format!("{name}, {} bits", b + 1);
            assert_eq!(table.bits.count(), b + 1, "{what}");
            assert_eq!(table.levels.len(), 1 << (b + 1), "{what}");
            assert_eq!(table.breakpoints.len(), table.levels.len() - 1, "{what}");
            assert!(table.breakpoints.is_sorted_by(|a, b| a < b), "{what}");
            let found: Vec<f32> = fitted.breakpoints.iter().map(|&t| t as f32).collect();
            assert_eq!(
                bits_of(&found),
                bits_of(table.breakpoints),
                "{what}: breakpoints"
            );
            for (k, (&level, &want)) in table.levels.iter().zip(&fitted.levels).enumerate() {
                let err = (f64::from(level) - want).abs();
                assert!(err < 1e-6, "{what}: level {k} is {level}, the fit {want}");
            }
            let documented = RMS_ERRORS[f][b];
            let gap = (fitted.rms_error - documented).abs() / documented;
            assert!(
                gap < 1e-4,
                "{what}: RMS {} documented {documented}",
                fitted.rms_error
            );
            println!("{what}: RMS error {:.5}", fitted.rms_error);
        }
    }
}

/// The numbers of the `.cu` array `name`, in order.
fn cu_array(name: &str) -> Vec<f32> {
    let source = include_str!("fewbit.cu");
    let start = source.find(&format!("float {name}[")).expect(name);
    let body = &source[start..];
    let body = &body[body.find('{').unwrap() + 1..body.find("};").unwrap()];
    body.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.trim_end_matches('f').parse().unwrap())
        .collect()
}

#[test]
fn the_cuda_tables_are_the_hosts() {
    for (name, tables, _) in FAMILIES {
        let prefix = format!("FEWBIT_{}", name.to_uppercase());
        let breaks: Vec<f32> = tables.iter().flat_map(|t| t.breakpoints).copied().collect();
        let levels: Vec<f32> = tables.iter().flat_map(|t| t.levels).copied().collect();
        let cu_breaks = cu_array(&format!("{prefix}_BREAKS"));
        let cu_levels = cu_array(&format!("{prefix}_LEVELS"));
        assert_eq!(bits_of(&cu_breaks), bits_of(&breaks), "{name}: breakpoints");
        assert_eq!(bits_of(&cu_levels), bits_of(&levels), "{name}: levels");
    }
}

/// Inputs at, just below and just above every breakpoint, and the extremes.
fn probes(table: &Table) -> Vec<f32> {
    let mut x = vec![
        f32::NEG_INFINITY,
        f32::MIN,
        -7.0,
        0.0,
        -0.0,
        7.0,
        f32::MAX,
        f32::INFINITY,
    ];
    for &t in table.breakpoints {
        x.extend([t.next_down(), t, t.next_up(), t - 1e-3, t + 1e-3]);
    }
    x
}

#[test]
fn a_code_is_the_interval_holding_x_a_breakpoint_belonging_above() {
    for (name, tables, _) in FAMILIES {
        for table in tables {
            let x = probes(table);
            let mut words = vec![0; codes_len(x.len(), table.bits)];
            let mut out = vec![0.0; x.len()];
            fewbit_gelu_forward(&Cpu::default(), &mut out, &mut words, &x, table);
            let codes = reference::unpack(&words, x.len(), table);
            for (i, &x) in x.iter().enumerate() {
                // The interval [t[k-1], t[k]) holding x, found by bisection.
                let want = table.breakpoints.partition_point(|&t| t <= x) as u32;
                let what = format!("{name} {:?}: x = {x:e}", table.bits);
                assert_eq!(reference::code(table, x), want, "{what}: reference");
                assert_eq!(table.code(x), want, "{what}: Table::code");
                assert_eq!(codes[i], want, "{what}: the CPU op");
            }
            for (k, &t) in table.breakpoints.iter().enumerate() {
                assert_eq!(table.code(t), k as u32 + 1, "{name}: on breakpoint {k}");
                assert_eq!(table.code(t.next_down()), k as u32, "{name}: below {k}");
            }
            assert_eq!(table.code(f32::NAN), 0, "{name}: NaN");
        }
    }
}

#[test]
fn packing_round_trips_and_pads_with_zero_codes() {
    let mut rng = StdRng::seed_from_u64(3);
    for table in GELU_TABLES {
        for n in [0, 1, 31, 32, 33, 95] {
            let codes: Vec<u32> = (0..n)
                .map(|_| rng.random_range(0..1 << table.bits.count()))
                .collect();
            let words = reference::pack(&codes, &table);
            assert_eq!(reference::unpack(&words, n, &table), codes);
            let mut planes = vec![0; codes_len(n, table.bits)];
            let b = table.bits.count();
            for (g, planes) in planes.chunks_mut(b).enumerate() {
                let mut group = [0; GROUP];
                let end = (g * GROUP + GROUP).min(n);
                group[..end - g * GROUP].copy_from_slice(&codes[g * GROUP..end]);
                pack_group(&group, planes);
                assert_eq!(
                    unpack_group(planes)[..end - g * GROUP],
                    codes[g * GROUP..end]
                );
            }
            assert_eq!(planes, words, "{:?}, {n} codes", table.bits);
        }
    }
}

fn random(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// Every instruction set on 1 and 3 threads.
fn cpus() -> Vec<Cpu> {
    Isa::supported()
        .into_iter()
        .flat_map(|isa| [1, 3].map(|threads| Cpu { isa, threads }))
        .collect()
}

const SIZES: [usize; 7] = [0, 1, 7, 22, 33, 4097, 100_003];

#[test]
fn the_gelu_ops_give_the_references_bits() {
    let mut rng = StdRng::seed_from_u64(5);
    for n in SIZES {
        let (x, dout) = (random(&mut rng, n, 4.0), random(&mut rng, n, 1.0));
        let mut gelu_bits = vec![0.0; n];
        gelu::gelu_forward(&Cpu::default(), &mut gelu_bits, &x);
        let mut gelu_ref = vec![0.0; n];
        gelu::reference::gelu_forward(&mut gelu_ref, &x);
        for table in &GELU_TABLES {
            let words = reference::pack(&reference::codes(table, &x), table);
            let mut want = vec![0.0; n];
            reference::fewbit_backward(&mut want, &words, &dout, table);
            for cpu in cpus() {
                let what = format!("{:?}, n {n}, {} on {}", table.bits, cpu.isa, cpu.threads);
                let (mut out, mut codes) = (vec![0.0; n], vec![!0; words.len()]);
                fewbit_gelu_forward(&cpu, &mut out, &mut codes, &x, table);
                assert!(codes == words, "{what}: codes");
                assert!(bits_of(&out) == bits_of(&gelu_bits), "{what}: gelu's bits");
                for (o, r) in out.iter().zip(&gelu_ref) {
                    assert!((o - r).abs() <= 1e-6 + 1e-5 * r.abs(), "{what}: {o} vs {r}");
                }
                let mut dinp = vec![f32::NAN; n];
                fewbit_backward(&cpu, &mut dinp, &codes, &dout, table);
                assert!(bits_of(&dinp) == bits_of(&want), "{what}: dinp");
            }
        }
    }
}

#[test]
fn the_swiglu_ops_give_the_references_bits() {
    let mut rng = StdRng::seed_from_u64(6);
    for n in SIZES {
        let (gate, up, dout) = (
            random(&mut rng, n, 4.0),
            random(&mut rng, n, 2.0),
            random(&mut rng, n, 1.0),
        );
        let mut swiglu_bits = vec![0.0; n];
        swiglu::swiglu_forward(&Cpu::default(), &mut swiglu_bits, &gate, &up);
        for table in &SILU_TABLES {
            let words = reference::pack(&reference::codes(table, &gate), table);
            for cpu in cpus() {
                let what = format!("{:?}, n {n}, {} on {}", table.bits, cpu.isa, cpu.threads);
                let (mut out, mut act, mut codes) =
                    (vec![0.0; n], vec![0.0; n], vec![!0; words.len()]);
                fewbit_swiglu_forward(&cpu, [&mut out, &mut act], &mut codes, [&gate, &up], table);
                assert!(codes == words, "{what}: codes");
                assert!(
                    bits_of(&out) == bits_of(&swiglu_bits),
                    "{what}: swiglu's bits"
                );
                let mut want = [vec![0.0; n], vec![0.0; n]];
                let [wg, wu] = &mut want;
                reference::fewbit_swiglu_backward([wg, wu], &words, [&dout, &act, &up], table);
                let (mut dgate, mut dup) = (vec![f32::NAN; n], vec![f32::NAN; n]);
                fewbit_swiglu_backward(
                    &cpu,
                    [&mut dgate, &mut dup],
                    &codes,
                    [&dout, &act, &up],
                    table,
                );
                assert!(bits_of(&dgate) == bits_of(&want[0]), "{what}: dgate");
                assert!(bits_of(&dup) == bits_of(&want[1]), "{what}: dup");
                // dup is exact: silu(gate) dout, as the exact backward computes it.
                for i in 0..n {
                    let s = gate[i] * simd::sigmoid(gate[i]);
                    assert_eq!(dup[i].to_bits(), (s * dout[i]).to_bits(), "{what}: dup {i}");
                }
            }
        }
    }
}

#[test]
fn the_backward_is_dout_times_the_level_of_the_exact_interval() {
    for (name, tables, _) in FAMILIES {
        for table in tables {
            let x = probes(table);
            let dout: Vec<f32> = (0..x.len()).map(|i| 0.5 + i as f32).collect();
            let mut words = vec![0; codes_len(x.len(), table.bits)];
            fewbit_gelu_forward(
                &Cpu::default(),
                &mut vec![0.0; x.len()],
                &mut words,
                &x,
                table,
            );
            let mut dinp = vec![0.0; x.len()];
            fewbit_backward(&Cpu::default(), &mut dinp, &words, &dout, table);
            for i in 0..x.len() {
                let k = table.breakpoints.partition_point(|&t| t <= x[i]);
                let want = table.levels[k] * dout[i];
                assert_eq!(
                    dinp[i].to_bits(),
                    want.to_bits(),
                    "{name} {:?}: x = {:e}",
                    table.bits,
                    x[i]
                );
            }
        }
    }
}

/// N(0, 1) samples, by Box and Muller's transform.
fn normal_samples(rng: &mut StdRng, n: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let (u, v): (f64, f64) = (1.0 - rng.random::<f64>(), rng.random());
        let r = (-2.0 * u.ln()).sqrt();
        let angle = 2.0 * std::f64::consts::PI * v;
        out.extend([r * angle.cos(), r * angle.sin()]);
    }
    out.truncate(n);
    out
}

#[test]
fn the_error_under_normal_inputs_is_the_documented_one() {
    let mut rng = StdRng::seed_from_u64(17);
    let x = normal_samples(&mut rng, 400_000);
    for (f, (name, tables, derivative)) in FAMILIES.iter().enumerate() {
        for (b, table) in tables.iter().enumerate() {
            let squared: f64 = x
                .iter()
                .map(|&x| {
                    let level = f64::from(table.levels[table.code(x as f32) as usize]);
                    (derivative(x) - level).powi(2)
                })
                .sum();
            let rms = (squared / x.len() as f64).sqrt();
            let documented = RMS_ERRORS[f][b];
            println!(
                "{name}, {} bits: Monte Carlo RMS {rms:.5}, documented {documented}",
                b + 1
            );
            assert!(
                (rms / documented - 1.0).abs() < 0.01,
                "{name}, {} bits: {rms} vs {documented}",
                b + 1
            );
        }
    }
}

/// The widths and sizes the emulator's samples take.
const SAMPLES: [(usize, Bits); 4] = [
    (4097, Bits::Three),
    (33, Bits::One),
    (70, Bits::Two),
    (0, Bits::Four),
];

impl Emulated for FewBitGelu {
    fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
        SAMPLES
            .map(|(n, bits)| FewBitGelu {
                out: l.tensor(n, w),
                codes: l.tensor(codes_len(n, bits), Dtype::U32),
                inp: l.tensor(n, w),
                bits,
            })
            .to_vec()
    }

    fn dimensions(&self) -> Vec<(&'static str, usize)> {
        vec![("n", self.out.len), ("bits", self.bits.count())]
    }

    fn emulate(name: &str, args: &[Arg], memory: &Emulator) -> bool {
        if name != "fewbit_gelu_forward_f32" {
            return false;
        }
        let [out, codes, inp] = [0, 1, 2].map(|i| ptr_arg(name, args, i));
        let table = &GELU_TABLES[count_arg(name, args, 3) - 1];
        emulate_forward(memory, codes, count_arg(name, args, 4), table, |i| {
            let x = memory.load(inp, i);
            let u = GELU_SCALE as f32 * (x + 0.044715 * x * x * x);
            memory.store(out, i, x / (1.0 + (-2.0 * u).exp()));
            x
        });
        true
    }
}

/// The `.cu`'s forwards, warp by warp: `element(i)` writes element i's outputs and gives
/// the input it codes; each warp's bit planes are written after.
fn emulate_forward(
    memory: &Emulator,
    codes: u64,
    n: usize,
    table: &Table,
    element: impl Fn(usize) -> f32,
) {
    let b = table.bits.count();
    for g in 0..n.div_ceil(GROUP) {
        let lanes: Vec<u32> = (0..GROUP)
            .map(|l| {
                let i = g * GROUP + l;
                if i < n { table.code(element(i)) } else { 0 }
            })
            .collect();
        for j in 0..b {
            let plane = lanes
                .iter()
                .enumerate()
                .fold(0u32, |w, (l, c)| w | ((c >> j) & 1) << l);
            memory.store(codes, g * b + j, f32::from_bits(plane));
        }
    }
}

/// The `.cu`'s code of element i.
fn emulate_load(memory: &Emulator, codes: u64, bits: usize, i: usize) -> usize {
    (0..bits)
        .map(|j| {
            (((memory.load(codes, (i / GROUP) * bits + j).to_bits() >> (i % GROUP)) & 1) << j)
                as usize
        })
        .sum()
}

impl Emulated for FewBitGeluBackward {
    fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
        SAMPLES
            .map(|(n, bits)| FewBitGeluBackward {
                dinp: l.tensor(n, w),
                codes: l.tensor(codes_len(n, bits), Dtype::U32),
                dout: l.tensor(n, w),
                bits,
            })
            .to_vec()
    }

    fn dimensions(&self) -> Vec<(&'static str, usize)> {
        vec![("n", self.dinp.len), ("bits", self.bits.count())]
    }

    fn emulate(name: &str, args: &[Arg], memory: &Emulator) -> bool {
        if name != "fewbit_gelu_backward_f32" {
            return false;
        }
        let [dinp, codes, dout] = [0, 1, 2].map(|i| ptr_arg(name, args, i));
        let (bits, n) = (count_arg(name, args, 3), count_arg(name, args, 4));
        let table = &GELU_TABLES[bits - 1];
        for i in 0..n {
            let level = table.levels[emulate_load(memory, codes, bits, i)];
            memory.store(dinp, i, level * memory.load(dout, i));
        }
        true
    }
}

impl Emulated for FewBitSwiGlu {
    fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
        SAMPLES
            .map(|(n, bits)| FewBitSwiGlu {
                out: l.tensor(n, w),
                act: l.tensor(n, w),
                codes: l.tensor(codes_len(n, bits), Dtype::U32),
                gate: l.tensor(n, w),
                up: l.tensor(n, w),
                bits,
            })
            .to_vec()
    }

    fn dimensions(&self) -> Vec<(&'static str, usize)> {
        vec![("n", self.out.len), ("bits", self.bits.count())]
    }

    fn emulate(name: &str, args: &[Arg], memory: &Emulator) -> bool {
        if name != "fewbit_swiglu_forward_f32" {
            return false;
        }
        let [out, act, codes, gate, up] = [0, 1, 2, 3, 4].map(|i| ptr_arg(name, args, i));
        let table = &SILU_TABLES[count_arg(name, args, 5) - 1];
        emulate_forward(memory, codes, count_arg(name, args, 6), table, |i| {
            let g = memory.load(gate, i);
            let s = g / (1.0 + (-g).exp());
            memory.store(act, i, s);
            memory.store(out, i, s * memory.load(up, i));
            g
        });
        true
    }
}

impl Emulated for FewBitSwiGluBackward {
    fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
        SAMPLES
            .map(|(n, bits)| FewBitSwiGluBackward {
                dgate: l.tensor(n, w),
                dup: l.tensor(n, w),
                codes: l.tensor(codes_len(n, bits), Dtype::U32),
                dout: l.tensor(n, w),
                act: l.tensor(n, w),
                up: l.tensor(n, w),
                bits,
            })
            .to_vec()
    }

    fn dimensions(&self) -> Vec<(&'static str, usize)> {
        vec![("n", self.dout.len), ("bits", self.bits.count())]
    }

    fn emulate(name: &str, args: &[Arg], memory: &Emulator) -> bool {
        if name != "fewbit_swiglu_backward_f32" {
            return false;
        }
        let [dgate, dup, codes, dout, act, up] = [0, 1, 2, 3, 4, 5].map(|i| ptr_arg(name, args, i));
        let (bits, n) = (count_arg(name, args, 6), count_arg(name, args, 7));
        let table = &SILU_TABLES[bits - 1];
        for i in 0..n {
            let level = table.levels[emulate_load(memory, codes, bits, i)];
            let d = memory.load(dout, i);
            memory.store(dup, i, memory.load(act, i) * d);
            memory.store(dgate, i, level * memory.load(up, i) * d);
        }
        true
    }
}

/// Each width's forward then backward, the backward reading the forward's codes.
fn chained(l: &mut Layout, n: usize) -> Vec<Kernel> {
    let f = Dtype::F32;
    let mut kernels = Vec::new();
    for bits in Bits::ALL {
        let (gelu_codes, silu_codes) = (
            l.tensor(codes_len(n, bits), Dtype::U32),
            l.tensor(codes_len(n, bits), Dtype::U32),
        );
        let act = l.tensor(n, f);
        let up = l.tensor(n, f);
        kernels.extend([
            Kernel::FewBitGelu(FewBitGelu {
                out: l.tensor(n, f),
                codes: gelu_codes,
                inp: l.tensor(n, f),
                bits,
            }),
            Kernel::FewBitGeluBackward(FewBitGeluBackward {
                dinp: l.tensor(n, f),
                codes: gelu_codes,
                dout: l.tensor(n, f),
                bits,
            }),
            Kernel::FewBitSwiGlu(FewBitSwiGlu {
                out: l.tensor(n, f),
                act,
                codes: silu_codes,
                gate: l.tensor(n, f),
                up,
                bits,
            }),
            Kernel::FewBitSwiGluBackward(FewBitSwiGluBackward {
                dgate: l.tensor(n, f),
                dup: l.tensor(n, f),
                codes: silu_codes,
                dout: l.tensor(n, f),
                act,
                up,
                bits,
            }),
        ]);
    }
    kernels
}

#[test]
fn the_cuda_launches_compute_the_cpus_codes_and_values() {
    let mut l = Layout::default();
    let kernels: Vec<Kernel> = [1, 31, 33, 4097]
        .into_iter()
        .flat_map(|n| chained(&mut l, n))
        .collect();
    let inputs = random_inputs(&l, &kernels, 9);
    // Codes equal word for word (check_emulation's rule for u32); the values differ by
    // the CPU's exp against the emulation's.
    check_emulation(&kernels, inputs, 1e-6);
}
