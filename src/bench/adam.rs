//! `strata bench adam`: throughput of the CPU AdamW step (`strata_kernels::adamw`), and in
//! the same run a STREAM-style triad over the same working-set size: the memory limit
//! the step is compared with.
//!
//! What is counted: the bytes each configuration must move per parameter, each array
//! read once and written once where it is updated (fp32 gradients, no copy-out, fp32
//! state: p, m, v read and written, 24 B, plus the gradient read, 4 B: 28 B). The triad
//! `a[i] = b[i] + s * c[i]` is counted as STREAM counts it, 12 B per element, without
//! the write-allocate read of `a` that a cached store also causes (so the triad's real
//! traffic is 16 B per element, and the ratio flatters neither side: AdamW updates its
//! arrays in place, so its every counted byte is real traffic).
//!
//! Arrays are first touched in parallel on the worker pool (not pinned piece by piece to
//! the thread that later updates it, which would matter only across NUMA nodes), and
//! hold non-zero pseudo-random values (no shared zero pages, no denormals). With several
//! configurations, all are allocated at once and run interleaved, step by step.

use std::mem::MaybeUninit;
use std::path::PathBuf;
use std::time::Instant;

use serde::Serialize;
use strata_kernels::adamw::{
    AdamStep, AdamW, CopyOut, Grads, Q8State, State, bf16, f16, grad_stats, q8,
};
use strata_kernels::isa::Isa;
use strata_kernels::parallel;

use crate::machine::{cpu_model, meminfo_bytes};
use crate::report::{Table, format_bytes, median};
use crate::size::parse_count;

/// Gradient dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GradDtype {
    /// fp32.
    F32,
    /// fp16.
    F16,
    /// bf16.
    Bf16,
}

/// Working-copy dtype written in the same pass, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CopyDtype {
    /// No working copy.
    None,
    /// fp16.
    F16,
    /// bf16.
    Bf16,
}

/// Optimizer state format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StateFormat {
    /// fp32 m and v.
    F32,
    /// 8-bit block-wise m and sqrt(v) (docs/adamw-8bit.md).
    Q8,
}

/// The options of `strata bench adam`.
#[derive(Debug, Clone, clap::Args)]
pub struct AdamArgs {
    /// Parameters updated per step (decimal multiples: 64M = 64,000,000).
    #[arg(long, default_value = "64M", value_parser = parse_count)]
    pub params: u64,
    /// Worker threads [default: every core].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Gradient dtype.
    #[arg(long, value_enum, default_value = "f32")]
    pub grad: GradDtype,
    /// Working copy of the updated parameters written in the same pass.
    #[arg(long = "copy-out", value_enum, default_value = "none")]
    pub copy_out: CopyDtype,
    /// Optimizer state: fp32, or 8-bit block-wise quantized.
    #[arg(long, value_enum, default_value = "f32")]
    pub state: StateFormat,
    /// Instruction set (portable, avx2, avx512) [default: the best this CPU has].
    #[arg(long, value_parser = parse_isa)]
    pub isa: Option<Isa>,
    /// Measure the standard set of configurations instead of one.
    #[arg(long)]
    pub sweep: bool,
    /// Timed steps per configuration (the median is reported).
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub(crate) fn parse_isa(text: &str) -> Result<Isa, String> {
    let isa = Isa::ALL
        .into_iter()
        .find(|isa| isa.name() == text)
        .ok_or_else(|| format!("'{text}' is not one of portable, avx2, avx512"))?;
    if isa.is_supported() {
        Ok(isa)
    } else {
        Err(format!("this CPU cannot run the {isa} kernels"))
    }
}

/// One configuration of the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AdamConfig {
    /// Gradient dtype.
    pub grad: GradDtype,
    /// Working copy written in the same pass.
    pub copy_out: CopyDtype,
    /// State format.
    pub state: StateFormat,
}

impl AdamConfig {
    /// The configurations `--sweep` measures: the ZeRO-Offload cases, fp32 and 8-bit.
    pub fn sweep() -> Vec<AdamConfig> {
        use CopyDtype as C;
        use GradDtype as G;
        use StateFormat as S;
        [
            (G::F32, C::None, S::F32),
            (G::Bf16, C::Bf16, S::F32),
            (G::F16, C::F16, S::F32),
            (G::F32, C::None, S::Q8),
            (G::Bf16, C::Bf16, S::Q8),
        ]
        .into_iter()
        .map(|(grad, copy_out, state)| AdamConfig {
            grad,
            copy_out,
            state,
        })
        .collect()
    }

    /// Bytes moved per parameter per step: each array read once, and written once if
    /// updated (p and the state), plus the working copy written.
    pub fn bytes_per_param(&self) -> f64 {
        2.0 * (4.0 + self.state_bytes()) + self.grad_bytes() + self.copy_bytes()
    }

    /// Bytes of the arrays the step touches, per parameter: its working set.
    pub fn footprint_per_param(&self) -> f64 {
        4.0 + self.state_bytes() + self.grad_bytes() + self.copy_bytes()
    }

    fn grad_bytes(&self) -> f64 {
        match self.grad {
            GradDtype::F32 => 4.0,
            GradDtype::F16 | GradDtype::Bf16 => 2.0,
        }
    }

    fn copy_bytes(&self) -> f64 {
        match self.copy_out {
            CopyDtype::None => 0.0,
            CopyDtype::F16 | CopyDtype::Bf16 => 2.0,
        }
    }

    /// m and v: fp32, or a code each plus two f32 scales per block.
    fn state_bytes(&self) -> f64 {
        match self.state {
            StateFormat::F32 => 8.0,
            StateFormat::Q8 => 2.0 + 8.0 / q8::BLOCK as f64,
        }
    }

    fn label(&self) -> String {
        format!("{:?}/{:?}/{:?}", self.grad, self.copy_out, self.state).to_lowercase()
    }
}

/// The measurement of one configuration.
#[derive(Debug, Clone, Serialize)]
pub struct AdamResult {
    /// What was measured.
    pub config: AdamConfig,
    /// Bytes counted per parameter.
    pub bytes_per_param: f64,
    /// Median seconds per step.
    pub step_s_median: f64,
    /// Fastest step, seconds.
    pub step_s_min: f64,
    /// Parameters per second at the median, in billions.
    pub gparams_per_s: f64,
    /// Counted bytes per second at the median, in GB/s (10^9).
    pub gb_per_s: f64,
    /// The triad over the same working set, GB/s counted at 12 B per element.
    pub triad_gb_per_s: f64,
    /// `gb_per_s / triad_gb_per_s`.
    pub ratio_to_triad: f64,
    /// The triad's real traffic, GB/s: 16 B per element, counting the read of `a` that
    /// its stores cause (write-allocate). AdamW updates in place and has no such hidden
    /// read, so this is the fairer limit to compare with.
    pub triad_with_write_allocate_gb_per_s: f64,
    /// `gb_per_s / triad_with_write_allocate_gb_per_s`.
    pub ratio_to_triad_with_write_allocate: f64,
}

/// The whole run, as written to JSON.
#[derive(Debug, Clone, Serialize)]
pub struct AdamReport {
    /// The CPU's model name.
    pub cpu: String,
    /// Instruction set of the kernels.
    pub isa: String,
    /// Worker threads.
    pub threads: usize,
    /// Parameters per step.
    pub params: u64,
    /// Timed steps (and triad runs) per configuration.
    pub steps: usize,
    /// How the triad is counted.
    pub triad_counting: &'static str,
    /// `/proc/loadavg`'s 1-minute load before and after the run: above the thread
    /// count, something else was competing for the cores and memory.
    pub load_average: [Option<f64>; 2],
    /// One entry per configuration.
    pub results: Vec<AdamResult>,
}

/// Runs the benchmark for each of `configs`.
pub fn run(
    configs: &[AdamConfig],
    params: usize,
    threads: usize,
    isa: Isa,
    steps: usize,
) -> AdamReport {
    let steps = steps.max(1);
    let load_before = load_average();
    struct Rig {
        config: AdamConfig,
        adam: AdamArrays,
        triad: Triad,
        triad_elements: usize,
        step_times: Vec<f64>,
        triad_times: Vec<f64>,
    }
    let mut rigs: Vec<Rig> = configs
        .iter()
        .map(|&config| {
            let triad_elements =
                (config.footprint_per_param() * params as f64 / 12.0).ceil() as usize;
            Rig {
                config,
                adam: AdamArrays::new(config, params, threads, isa),
                triad: Triad::new(triad_elements, threads),
                triad_elements,
                step_times: Vec::with_capacity(steps),
                triad_times: Vec::with_capacity(steps),
            }
        })
        .collect();
    // Untimed once each, then round after round: each configuration's step, then its
    // triad, then the next configuration's. On a shared machine the memory bandwidth
    // changes from second to second; interleaving makes every row, and the triad beside
    // it, see the same machine, so rows compare with one another (8-bit against fp32
    // state, say) and not only with their own triad.
    for rig in &mut rigs {
        rig.adam.step();
        rig.triad.run();
    }
    for _ in 0..steps {
        for rig in &mut rigs {
            rig.step_times.push(rig.adam.step());
            rig.triad_times.push(rig.triad.run());
        }
    }
    let results = rigs
        .into_iter()
        .map(|rig| {
            let Rig {
                config,
                adam,
                triad,
                triad_elements,
                step_times,
                triad_times,
            } = rig;
            assert!(
                adam.p.iter().all(|x| x.is_finite()),
                "parameters stay finite"
            );
            assert!(triad.a.iter().all(|x| x.is_finite()));
            let step_s = median(&step_times);
            let triad_gb_per_s = 12.0 * triad_elements as f64 / median(&triad_times) / 1e9;
            let gb_per_s = config.bytes_per_param() * params as f64 / step_s / 1e9;
            AdamResult {
                config,
                bytes_per_param: config.bytes_per_param(),
                step_s_median: step_s,
                step_s_min: step_times.iter().copied().fold(f64::INFINITY, f64::min),
                gparams_per_s: params as f64 / step_s / 1e9,
                gb_per_s,
                triad_gb_per_s,
                ratio_to_triad: gb_per_s / triad_gb_per_s,
                triad_with_write_allocate_gb_per_s: triad_gb_per_s * 16.0 / 12.0,
                ratio_to_triad_with_write_allocate: gb_per_s / (triad_gb_per_s * 16.0 / 12.0),
            }
        })
        .collect();
    AdamReport {
        cpu: cpu_model(),
        isa: isa.name().to_string(),
        threads,
        params: params as u64,
        steps,
        triad_counting: "triad GB/s: 12 B per element (a written, b and c read), as STREAM counts; triad+WA: 16 B, adding the write-allocate read of a that plain stores cause (AdamW's in-place updates cause none)",
        load_average: [load_before, load_average()],
        results,
    }
}

/// `strata bench adam`.
pub fn main(args: &AdamArgs) -> Result<(), Box<dyn std::error::Error>> {
    let threads = args.threads.unwrap_or_else(parallel::max_threads).max(1);
    let isa = args.isa.unwrap_or_else(Isa::active);
    let params = usize::try_from(args.params)?;
    if params == 0 {
        return Err("--params must be at least 1".into());
    }
    let configs = if args.sweep {
        AdamConfig::sweep()
    } else {
        vec![AdamConfig {
            grad: args.grad,
            copy_out: args.copy_out,
            state: args.state,
        }]
    };
    check_memory(&configs, params)?;
    let report = run(&configs, params, threads, isa, args.steps);
    println!(
        "AdamW step, {} params, {} ({}), {} threads, median of {} steps; triad over the same working set",
        args.params, report.isa, report.cpu, threads, report.steps
    );
    let mut table = Table::new([
        "grad/copy/state",
        "B/param",
        "working set",
        "ms/step",
        "Gparam/s",
        "GB/s",
        "triad GB/s",
        "vs triad",
        "triad+WA GB/s",
        "vs triad+WA",
    ]);
    for r in &report.results {
        table.row([
            r.config.label(),
            format!("{:.2}", r.bytes_per_param),
            format_bytes((r.config.footprint_per_param() * params as f64) as u64),
            format!("{:.2}", r.step_s_median * 1e3),
            format!("{:.3}", r.gparams_per_s),
            format!("{:.1}", r.gb_per_s),
            format!("{:.1}", r.triad_gb_per_s),
            format!("{:.2}x", r.ratio_to_triad),
            format!("{:.1}", r.triad_with_write_allocate_gb_per_s),
            format!("{:.2}x", r.ratio_to_triad_with_write_allocate),
        ]);
    }
    print!("{}", table.render());
    println!("triad: {}", report.triad_counting);
    super::finish(report.load_average, args.json.as_deref(), &report)?;
    Ok(())
}

/// A pseudo-random value for index `i` of stream `stream`, uniform in [-1, 1).
pub(crate) fn noise(stream: u64, i: usize) -> f32 {
    let mut z = (i as u64 ^ (stream << 48)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// A vector of `len` values `value(i)`, each page first written by the pool thread
/// that owns its piece (the pieces the kernels use with the same thread count).
fn filled<T: Send>(len: usize, threads: usize, value: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let mut data: Vec<T> = Vec::with_capacity(len);
    let value = &value;
    parallel::for_each_split(
        len,
        threads,
        q8::BLOCK,
        &mut data.spare_capacity_mut()[..len],
        &|rest: &mut [MaybeUninit<T>], n| rest.split_at_mut(n),
        &|range, piece: &mut [MaybeUninit<T>]| {
            for (j, slot) in piece.iter_mut().enumerate() {
                slot.write(value(range.start + j));
            }
        },
    );
    // SAFETY: the pieces of `for_each_split` cover 0..len exactly, every one wrote every
    // slot of its piece, and all have finished when it returns.
    unsafe { data.set_len(len) };
    data
}

/// The arrays of one AdamW configuration, ready to step.
struct AdamArrays {
    config: AdamConfig,
    isa: Isa,
    threads: usize,
    grad_scale: f32,
    step: u64,
    p: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    m_codes: Vec<u8>,
    m_scales: Vec<f32>,
    v_codes: Vec<u8>,
    v_scales: Vec<f32>,
    g32: Vec<f32>,
    g16: Vec<f16>,
    gb16: Vec<bf16>,
    out16: Vec<f16>,
    outb16: Vec<bf16>,
}

impl AdamArrays {
    fn new(config: AdamConfig, n: usize, threads: usize, isa: Isa) -> AdamArrays {
        // Moments as a model would have them: |m| <= sqrt(v), v spread over decades.
        let v_value = |i: usize| 1e-6 * (1.0 + noise(2, i)).powi(4) + 1e-12;
        let m_value = |i: usize| noise(3, i) * v_value(i).sqrt();
        let g_value = |i: usize| 1e-3 * noise(4, i);
        let f32_state = config.state == StateFormat::F32;
        let q8_len = if f32_state { 0 } else { n };
        let mut arrays = AdamArrays {
            config,
            isa,
            threads,
            grad_scale: if config.grad == GradDtype::F16 {
                1.0 / 1024.0
            } else {
                1.0
            },
            step: 1000,
            p: filled(n, threads, |i| noise(1, i)),
            m: filled(if f32_state { n } else { 0 }, threads, m_value),
            v: filled(if f32_state { n } else { 0 }, threads, v_value),
            m_codes: filled(q8_len, threads, |_| 0u8),
            m_scales: vec![0f32; q8::scale_count(q8_len)],
            v_codes: filled(q8_len, threads, |_| 0u8),
            v_scales: vec![0f32; q8::scale_count(q8_len)],
            g32: filled(
                if config.grad == GradDtype::F32 { n } else { 0 },
                threads,
                g_value,
            ),
            g16: filled(
                if config.grad == GradDtype::F16 { n } else { 0 },
                threads,
                |i| f16::from_f32(g_value(i) * 1024.0),
            ),
            gb16: filled(
                if config.grad == GradDtype::Bf16 { n } else { 0 },
                threads,
                |i| bf16::from_f32(g_value(i)),
            ),
            out16: filled(
                if config.copy_out == CopyDtype::F16 {
                    n
                } else {
                    0
                },
                threads,
                |_| f16::ONE,
            ),
            outb16: filled(
                if config.copy_out == CopyDtype::Bf16 {
                    n
                } else {
                    0
                },
                threads,
                |_| bf16::ONE,
            ),
        };
        // 8-bit state: the codes of the same moments, block by block.
        let mut block = vec![0f32; q8::BLOCK];
        for b in 0..arrays.m_scales.len() {
            let range = b * q8::BLOCK..((b + 1) * q8::BLOCK).min(n);
            let len = range.len();
            for (x, i) in block.iter_mut().zip(range.clone()) {
                *x = m_value(i);
            }
            let (codes, scales) = (&mut arrays.m_codes, &mut arrays.m_scales);
            q8::quantize_m(
                &block[..len],
                &mut codes[range.clone()],
                &mut scales[b..b + 1],
            );
            for (x, i) in block.iter_mut().zip(range.clone()) {
                *x = v_value(i);
            }
            let (codes, scales) = (&mut arrays.v_codes, &mut arrays.v_scales);
            q8::quantize_v(&block[..len], &mut codes[range], &mut scales[b..b + 1]);
        }
        let stats = grad_stats(isa, threads, arrays.grads(), arrays.grad_scale)
            .expect("the ISA was checked");
        assert!(!stats.non_finite, "the bench's gradients are finite");
        arrays
    }

    fn grads(&self) -> Grads<'_> {
        grads_of(self.config.grad, &self.g32, &self.g16, &self.gb16)
    }

    /// One step; returns its seconds.
    fn step(&mut self) -> f64 {
        self.step += 1;
        let k =
            AdamStep::new(&AdamW::default(), self.step, self.grad_scale).expect("valid constants");
        let grads = grads_of(self.config.grad, &self.g32, &self.g16, &self.gb16);
        let state = match self.config.state {
            StateFormat::F32 => State::F32 {
                m: &mut self.m,
                v: &mut self.v,
            },
            StateFormat::Q8 => State::Q8(Q8State {
                m_codes: &mut self.m_codes,
                m_scales: &mut self.m_scales,
                v_codes: &mut self.v_codes,
                v_scales: &mut self.v_scales,
            }),
        };
        let copy_out = match self.config.copy_out {
            CopyDtype::None => CopyOut::None,
            CopyDtype::F16 => CopyOut::F16(&mut self.out16),
            CopyDtype::Bf16 => CopyOut::Bf16(&mut self.outb16),
        };
        let start = Instant::now();
        k.apply(self.isa, self.threads, &mut self.p, state, grads, copy_out)
            .expect("the bench's arrays fit together");
        start.elapsed().as_secs_f64()
    }
}

fn grads_of<'a>(dtype: GradDtype, g32: &'a [f32], g16: &'a [f16], gb16: &'a [bf16]) -> Grads<'a> {
    match dtype {
        GradDtype::F32 => Grads::F32(g32),
        GradDtype::F16 => Grads::F16(g16),
        GradDtype::Bf16 => Grads::Bf16(gb16),
    }
}

/// The STREAM triad `a = b + s * c` over three arrays, split over threads as the step is.
struct Triad {
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
    threads: usize,
    runs: u32,
}

impl Triad {
    fn new(n: usize, threads: usize) -> Triad {
        Triad {
            a: filled(n, threads, |i| noise(5, i)),
            b: filled(n, threads, |i| noise(6, i)),
            c: filled(n, threads, |i| noise(7, i)),
            threads,
            runs: 0,
        }
    }

    /// One pass; returns its seconds.
    fn run(&mut self) -> f64 {
        self.runs += 1;
        let s = 0.5 + self.runs as f32 * 1e-3;
        let (b, c) = (&self.b[..], &self.c[..]);
        let start = Instant::now();
        parallel::for_each_split(
            self.a.len(),
            self.threads,
            64,
            &mut self.a[..],
            &|rest: &mut [f32], n| rest.split_at_mut(n),
            &|range, piece: &mut [f32]| {
                for ((a, &b), &c) in piece.iter_mut().zip(&b[range.clone()]).zip(&c[range]) {
                    *a = b + s * c;
                }
            },
        );
        start.elapsed().as_secs_f64()
    }
}

/// Every configuration's arrays and triad are held at once (they run interleaved):
/// refuses a run that would not fit in the memory available, saying how much it needs.
fn check_memory(configs: &[AdamConfig], params: usize) -> Result<(), String> {
    let needed: f64 = configs
        .iter()
        .map(|c| 2.0 * c.footprint_per_param() * params as f64)
        .sum();
    let Some(available) = meminfo_bytes("MemAvailable") else {
        return Ok(());
    };
    if needed > 0.9 * available as f64 {
        return Err(format!(
            "this run holds {} at once (each configuration's arrays and a triad of the same \
             size, interleaved), but {} of memory is available; use fewer --params or \
             compare fewer configurations",
            format_bytes(needed as u64),
            format_bytes(available)
        ));
    }
    Ok(())
}

/// `/proc/loadavg`'s 1-minute load average.
pub(crate) fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_per_param_count_each_array_once_per_direction() {
        let base = AdamConfig {
            grad: GradDtype::F32,
            copy_out: CopyDtype::None,
            state: StateFormat::F32,
        };
        assert_eq!(base.bytes_per_param(), 28.0);
        assert_eq!(base.footprint_per_param(), 16.0);
        let half = AdamConfig {
            grad: GradDtype::Bf16,
            copy_out: CopyDtype::Bf16,
            ..base
        };
        assert_eq!(half.bytes_per_param(), 28.0);
        let q8 = AdamConfig {
            state: StateFormat::Q8,
            ..base
        };
        assert!((q8.bytes_per_param() - (8.0 + 4.0 + 4.0 + 16.0 / 256.0)).abs() < 1e-12);
        assert!((q8.footprint_per_param() - (4.0 + 2.0 + 8.0 / 256.0 + 4.0)).abs() < 1e-12);
    }

    #[test]
    fn a_small_run_reports_every_configuration() {
        let configs = AdamConfig::sweep();
        let report = run(&configs, 10_007, 2, Isa::active(), 2);
        assert_eq!(report.results.len(), configs.len());
        for r in &report.results {
            assert!(r.step_s_median > 0.0 && r.gparams_per_s > 0.0 && r.triad_gb_per_s > 0.0);
        }
        let text = serde_json::to_string(&report).unwrap();
        assert!(text.contains("\"state\":\"q8\""));
    }

    #[test]
    fn filled_writes_every_element() {
        let v = filled(100_003, 3, |i| i as u32);
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u32));
    }
}
