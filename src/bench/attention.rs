//! `strata bench attention`: the fused attention kernel (FlashAttention-2's algorithm,
//! `ops::gqa_flash_attention_*`, which the models run) against the materialised one
//! (`ops::gqa_attention_*`, the reference it is tested against, keeping the (B, H, T, T)
//! probabilities and a backward scratch as large), forward and backward, on a Llama-shaped attention at several
//! sequence lengths, in the same run.
//!
//! Each length: both kernels run on the same q, k, v and output gradient (one untimed
//! pass, then `--repeats` timed), alternating, so that both see the machine of the same
//! minutes; a time is the median. Reported beside the times: the bytes of the buffers
//! each needs beyond its inputs and outputs (probabilities and scratch, or log-sum-exp
//! and scratch), and the largest difference between the two outputs and between their
//! gradients, so that a fast kernel that computes something else shows. Nothing here is
//! asserted about speed.

use std::path::PathBuf;
use std::time::Instant;

use serde::Serialize;
use strata_kernels::isa::Isa;
use strata_kernels::ops::{self, AttnMask, Cpu, GqaDims};
use strata_kernels::parallel;

use super::adam::{load_average, noise, parse_isa};
use crate::machine::cpu_model;
use crate::report::{Table, median};

/// Options of `strata bench attention`.
#[derive(Debug, Clone, clap::Args)]
pub struct AttentionArgs {
    /// Sequence lengths, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "512,1024,2048,4096")]
    pub seq: Vec<usize>,
    /// Sequences per batch.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Query heads.
    #[arg(long, default_value_t = 12)]
    pub heads: usize,
    /// Key/value heads (dividing the query heads).
    #[arg(long, default_value_t = 4)]
    pub kv_heads: usize,
    /// Channels per head.
    #[arg(long, default_value_t = 64)]
    pub head_dim: usize,
    /// A sliding window (keys per query), else plain causal attention. The materialised
    /// kernel has no window: with one, only the fused kernel runs.
    #[arg(long)]
    pub window: Option<usize>,
    /// Threads (strata's worker pool).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Timed passes per kernel and length (after one untimed).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Instruction set (portable, avx2, avx512) [default: the best this CPU has].
    #[arg(long, value_parser = parse_isa)]
    pub isa: Option<Isa>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One kernel at one length.
#[derive(Debug, Clone, Serialize)]
pub struct KernelTimes {
    /// Median seconds of the forward.
    pub forward_s: f64,
    /// Median seconds of the backward.
    pub backward_s: f64,
    /// Bytes it needs beyond its inputs and outputs: probabilities and the backward's
    /// scratch (materialised), log-sum-exp and scratch (fused).
    pub extra_bytes: usize,
}

/// Both kernels at one length.
#[derive(Debug, Clone, Serialize)]
pub struct LengthResult {
    /// Sequence length.
    pub seq: usize,
    /// The fused kernel.
    pub fused: KernelTimes,
    /// The materialised kernel (absent with a window).
    pub materialised: Option<KernelTimes>,
    /// Materialised forward + backward seconds over fused.
    pub fused_speedup: Option<f64>,
    /// The largest |difference| of the outputs.
    pub max_out_difference: Option<f64>,
    /// The largest |difference| of dq, dk and dv.
    pub max_grad_difference: Option<f64>,
}

/// The whole run, as written to JSON.
#[derive(Debug, Clone, Serialize)]
pub struct AttentionReport {
    /// The CPU's model name.
    pub cpu: String,
    /// Instruction set.
    pub isa: String,
    /// Threads.
    pub threads: usize,
    /// Sequences per batch.
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// The sliding window, if any.
    pub window: Option<usize>,
    /// Timed passes per kernel and length.
    pub repeats: usize,
    /// `/proc/loadavg`'s 1-minute load before and after.
    pub load_average: [Option<f64>; 2],
    /// One entry per length.
    pub results: Vec<LengthResult>,
}

/// Inputs and outputs of one length, shared by both kernels.
struct Tensors {
    dims: GqaDims,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    dout: Vec<f32>,
    out: Vec<f32>,
    grads: [Vec<f32>; 3],
}

impl Tensors {
    fn new(dims: GqaDims) -> Self {
        let fill = |stream: u64, len: usize| (0..len).map(|i| noise(stream, i)).collect();
        Tensors {
            dims,
            q: fill(1, dims.q_len()),
            k: fill(2, dims.kv_len()),
            v: fill(3, dims.kv_len()),
            dout: fill(4, dims.q_len()),
            out: vec![0.0; dims.q_len()],
            grads: [dims.q_len(), dims.kv_len(), dims.kv_len()].map(|n| vec![0.0; n]),
        }
    }
}

/// Seconds of `f`.
fn timed(f: impl FnOnce()) -> f64 {
    let start = Instant::now();
    f();
    start.elapsed().as_secs_f64()
}

/// One kernel: a forward and a backward pass over `x`, returning their seconds.
trait Kernel {
    fn pass(&mut self, cpu: &Cpu, x: &mut Tensors, mask: AttnMask<'_>) -> (f64, f64);
    fn extra_bytes(&self) -> usize;
}

/// The fused kernel's own buffers.
struct Fused {
    lse: Vec<f32>,
    scratch: Vec<f32>,
}

impl Kernel for Fused {
    fn pass(&mut self, cpu: &Cpu, x: &mut Tensors, mask: AttnMask<'_>) -> (f64, f64) {
        let qkv = (&x.q[..], &x.k[..], &x.v[..]);
        let forward = timed(|| {
            ops::gqa_flash_attention_forward(
                cpu,
                (&mut x.out, &mut self.lse, &mut self.scratch),
                qkv,
                x.dims,
                mask,
            )
        });
        let [dq, dk, dv] = &mut x.grads;
        let backward = timed(|| {
            ops::gqa_flash_attention_backward(
                cpu,
                (dq, dk, dv),
                &mut self.scratch,
                &x.dout,
                qkv,
                (&x.out, &self.lse),
                x.dims,
                mask,
            )
        });
        (forward, backward)
    }

    fn extra_bytes(&self) -> usize {
        4 * (self.lse.len() + self.scratch.len())
    }
}

/// The materialised kernel's own buffers.
struct Materialised {
    att: Vec<f32>,
    scratch: Vec<f32>,
}

impl Kernel for Materialised {
    fn pass(&mut self, cpu: &Cpu, x: &mut Tensors, _: AttnMask<'_>) -> (f64, f64) {
        let forward = timed(|| {
            ops::gqa_attention_forward(cpu, &mut x.out, &mut self.att, &x.q, &x.k, &x.v, x.dims)
        });
        let [dq, dk, dv] = &mut x.grads;
        let backward = timed(|| {
            ops::gqa_attention_backward(
                cpu,
                dq,
                dk,
                dv,
                &mut self.scratch,
                &x.dout,
                &x.q,
                &x.k,
                &x.v,
                &self.att,
                x.dims,
            )
        });
        (forward, backward)
    }

    fn extra_bytes(&self) -> usize {
        4 * (self.att.len() + self.scratch.len())
    }
}

/// The largest |a - b|.
fn max_difference(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64)
        .fold(0.0, f64::max)
}

/// Times `kernels` (in turn, `repeats` rounds after an untimed one) on `x`; returns each
/// one's median forward and backward seconds and, from its last pass, its output and
/// gradients.
fn time_kernels(
    cpu: &Cpu,
    x: &mut Tensors,
    mask: AttnMask<'_>,
    kernels: &mut [&mut dyn Kernel],
    repeats: usize,
) -> Vec<(KernelTimes, Vec<f32>, [Vec<f32>; 3])> {
    let mut times = vec![(Vec::new(), Vec::new()); kernels.len()];
    let mut last = Vec::new();
    for round in 0..=repeats {
        last.clear();
        for (kernel, (fwd, bwd)) in kernels.iter_mut().zip(&mut times) {
            let (f, b) = kernel.pass(cpu, x, mask);
            if round > 0 {
                fwd.push(f);
                bwd.push(b);
            }
            last.push((x.out.clone(), x.grads.clone()));
        }
    }
    kernels
        .iter()
        .zip(times)
        .zip(last)
        .map(|((kernel, (fwd, bwd)), (out, grads))| {
            let times = KernelTimes {
                forward_s: median(&fwd),
                backward_s: median(&bwd),
                extra_bytes: kernel.extra_bytes(),
            };
            (times, out, grads)
        })
        .collect()
}

/// Measures both kernels at one length.
fn run_length(args: &AttentionArgs, cpu: &Cpu, seq: usize) -> LengthResult {
    let dims = GqaDims {
        b: args.batch,
        t: seq,
        h: args.heads,
        kv: args.kv_heads,
        d: args.head_dim,
    };
    let mask = AttnMask {
        window: args.window,
        doc_start: None,
    };
    let mut x = Tensors::new(dims);
    let mut fused = Fused {
        lse: vec![0.0; dims.b * dims.h * dims.t],
        scratch: vec![0.0; ops::flash_scratch_len(dims)],
    };
    let mut materialised = args.window.is_none().then(|| Materialised {
        att: vec![0.0; dims.att_len()],
        scratch: vec![0.0; dims.att_len()],
    });
    let mut kernels: Vec<&mut dyn Kernel> = vec![&mut fused];
    if let Some(m) = materialised.as_mut() {
        kernels.push(m);
    }
    let mut measured = time_kernels(cpu, &mut x, mask, &mut kernels, args.repeats.max(1));
    let materialised = (measured.len() > 1).then(|| measured.pop().expect("two kernels"));
    let fused = measured.pop().expect("the fused kernel");
    let total = |t: &KernelTimes| t.forward_s + t.backward_s;
    LengthResult {
        seq,
        fused_speedup: materialised.as_ref().map(|m| total(&m.0) / total(&fused.0)),
        max_out_difference: materialised
            .as_ref()
            .map(|m| max_difference(&m.1, &fused.1)),
        max_grad_difference: materialised.as_ref().map(|m| {
            (0..3)
                .map(|i| max_difference(&m.2[i], &fused.2[i]))
                .fold(0.0, f64::max)
        }),
        materialised: materialised.map(|m| m.0),
        fused: fused.0,
    }
}

/// `strata bench attention`.
pub fn main(args: &AttentionArgs) -> Result<(), Box<dyn std::error::Error>> {
    if args.threads == 0 || args.threads > parallel::max_threads() {
        return Err(format!(
            "--threads must be between 1 and {} (the worker pool's threads)",
            parallel::max_threads()
        )
        .into());
    }
    if args.kv_heads == 0 || !args.heads.is_multiple_of(args.kv_heads) || args.head_dim == 0 {
        return Err(format!(
            "--kv-heads ({}) must divide --heads ({}), and --head-dim must be positive",
            args.kv_heads, args.heads
        )
        .into());
    }
    if args.seq.contains(&0) || args.batch == 0 || args.window == Some(0) {
        return Err("--seq, --batch and --window must be positive".into());
    }
    let cpu = Cpu {
        isa: args.isa.unwrap_or_else(Isa::active),
        threads: args.threads,
    };
    let load_before = load_average();
    println!(
        "attention forward + backward, batch {} x {} query heads ({} key/value) x {} channels, \
         {}, {} threads, {} ({}), median of {}",
        args.batch,
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.window
            .map_or("causal".to_string(), |w| format!("causal, window {w}")),
        cpu.threads,
        cpu.isa.name(),
        cpu_model(),
        args.repeats.max(1)
    );
    let results: Vec<LengthResult> = args
        .seq
        .iter()
        .map(|&seq| run_length(args, &cpu, seq))
        .collect();
    print!("{}", table(&results).render());
    let report = AttentionReport {
        cpu: cpu_model(),
        isa: cpu.isa.name().to_string(),
        threads: cpu.threads,
        batch: args.batch,
        heads: args.heads,
        kv_heads: args.kv_heads,
        head_dim: args.head_dim,
        window: args.window,
        repeats: args.repeats.max(1),
        load_average: [load_before, load_average()],
        results,
    };
    super::finish(report.load_average, args.json.as_deref(), &report)?;
    Ok(())
}

/// The results as a table.
fn table(results: &[LengthResult]) -> Table {
    let mut table = Table::new([
        "T",
        "fused fwd ms",
        "fused bwd ms",
        "fused extra MiB",
        "materialised fwd ms",
        "materialised bwd ms",
        "materialised extra MiB",
        "speed-up",
        "max |diff| out / grads",
    ]);
    let ms = |s: f64| format!("{:.1}", s * 1e3);
    let mib = |b: usize| format!("{:.1}", b as f64 / (1 << 20) as f64);
    for r in results {
        let m = r.materialised.as_ref();
        table.row([
            r.seq.to_string(),
            ms(r.fused.forward_s),
            ms(r.fused.backward_s),
            mib(r.fused.extra_bytes),
            m.map_or("-".into(), |m| ms(m.forward_s)),
            m.map_or("-".into(), |m| ms(m.backward_s)),
            m.map_or("-".into(), |m| mib(m.extra_bytes)),
            r.fused_speedup.map_or("-".into(), |s| format!("{s:.2}x")),
            match (r.max_out_difference, r.max_grad_difference) {
                (Some(o), Some(g)) => format!("{o:.1e} / {g:.1e}"),
                _ => "-".into(),
            },
        ]);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_kernels_agree_and_only_the_materialised_ones_buffers_grow_as_t_squared() {
        let args = AttentionArgs {
            seq: vec![300, 600],
            batch: 1,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            window: None,
            threads: 1,
            repeats: 1,
            isa: None,
            json: None,
        };
        let cpu = Cpu::single(Isa::active());
        let [short, long] = [300, 600].map(|t| run_length(&args, &cpu, t));
        for r in [&short, &long] {
            assert!(r.max_out_difference.unwrap() < 1e-5, "{r:?}");
            assert!(r.max_grad_difference.unwrap() < 1e-4, "{r:?}");
        }
        // Materialised: probabilities and scratch, two (1, 4, T, T) f32 tensors; fused:
        // a fixed scratch (once T holds a whole tile, 256 keys) and the (1, 4, T)
        // log-sum-exp.
        let extra = |r: &LengthResult| {
            (
                r.fused.extra_bytes,
                r.materialised.as_ref().unwrap().extra_bytes,
            )
        };
        assert_eq!(extra(&short).1, 2 * 4 * 4 * 300 * 300);
        assert_eq!(extra(&long).1, 2 * 4 * 4 * 600 * 600);
        assert_eq!(extra(&long).0 - extra(&short).0, 4 * 4 * 300);
    }
}
