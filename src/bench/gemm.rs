//! `strata bench gemm`: strata's f32 matrix product (`ops::gemm`) on the products one
//! training step of GPT-2 124M makes (batch 4 × 128: 512 rows), and in the same run
//! PyTorch's (`torch.mm`, `addmm_`, `bmm` on the same shapes, layouts and thread count;
//! `benches/peers/gemm_torch.py`, run with `--python`), when PyTorch can be imported.
//!
//! The shapes: each linear layer's three products (out = in @ W, dIn = dOut @ Wᵀ,
//! dW += inᵀ @ dOut, W stored (in, out) as GPT-2's Conv1D stores it) for the four
//! widths of a block (768 → 2304, 768 → 768, 768 → 3072, 3072 → 768); the attention
//! products of every (batch, head) pair, q @ kᵀ and att @ v, full 128 × 128 (each pair
//! one thread's product, the pairs split over the threads, as the attention kernel runs
//! them); and the LM head's three (the token embedding, stored (vocab, 768), read
//! transposed for the logits).
//!
//! Rounds: each runs every shape on strata (one untimed product, then `--repeats` timed)
//! and then the PyTorch peer on every shape (a fresh process, likewise), so that both
//! sides see the machine of the same minutes; a shape reports the median over all
//! rounds. GFLOP/s counts 2·m·n·k per product. Nothing here is asserted about speed.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use strata_kernels::isa::Isa;
use strata_kernels::ops::{Cpu, MatrixMut, MatrixRef, gemm};
use strata_kernels::parallel;

use super::adam::{load_average, parse_isa};
use crate::machine::cpu_model;
use crate::report::{Table, median};

/// The PyTorch peer, run with `--python -c`.
const TORCH_PEER: &str = include_str!("../../benches/peers/gemm_torch.py");

/// Options of `strata bench gemm`.
#[derive(Debug, Clone, clap::Args)]
pub struct GemmArgs {
    /// Threads of each product (strata's worker pool; torch.set_num_threads).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// The Python that runs the PyTorch peer.
    #[arg(long, default_value = "python3")]
    pub python: PathBuf,
    /// Do not run the PyTorch peer.
    #[arg(long)]
    pub no_torch: bool,
    /// Timed products per shape per round (after one untimed).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Rounds, each strata's pass then PyTorch's.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Instruction set (portable, avx2, avx512) [default: the best this CPU has].
    #[arg(long, value_parser = parse_isa)]
    pub isa: Option<Isa>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One product shape: `batch` products of dst (m × n) = [dst +] lhs (m × k) @ rhs
/// (k × n), each operand stored row-major or, when marked, stored transposed and read
/// as a transposed view.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shape {
    /// What the product is in the model.
    pub name: String,
    /// Independent products (the attention's (batch, head) pairs), else 1.
    pub batch: usize,
    /// Rows of dst.
    pub m: usize,
    /// Columns of dst.
    pub n: usize,
    /// The summed dimension.
    pub k: usize,
    /// lhs stored (k, m) and read transposed.
    pub lhs_transposed: bool,
    /// rhs stored (n, k) and read transposed.
    pub rhs_transposed: bool,
    /// dst += rather than dst =.
    pub accumulate: bool,
}

impl Shape {
    /// Floating-point operations of all `batch` products: 2·m·n·k each.
    pub fn flops(&self) -> f64 {
        2.0 * (self.batch * self.m * self.n * self.k) as f64
    }

    /// `NN`, `NT`, `TN`: whether lhs and rhs are read transposed; `+=` when accumulating.
    fn layout(&self) -> String {
        let letter = |t: bool| if t { 'T' } else { 'N' };
        let mut text: String = [letter(self.lhs_transposed), letter(self.rhs_transposed)]
            .into_iter()
            .collect();
        if self.accumulate {
            text.push_str(" +=");
        }
        text
    }
}

/// A linear layer's three products at `rows` rows, its weight stored (in, out) or, when
/// `weight_out_in`, (out, in).
fn linear(
    name: &str,
    rows: usize,
    inputs: usize,
    outputs: usize,
    weight_out_in: bool,
) -> [Shape; 3] {
    let shape = |what: &str, (m, n, k), (lhs_transposed, rhs_transposed), accumulate| Shape {
        name: format!("{name} {what}"),
        batch: 1,
        m,
        n,
        k,
        lhs_transposed,
        rhs_transposed,
        accumulate,
    };
    let (w_rows, w_cols) = if weight_out_in {
        (outputs, inputs)
    } else {
        (inputs, outputs)
    };
    [
        // out (rows, outputs) = in (rows, inputs) @ W as (inputs, outputs).
        shape(
            "out",
            (rows, outputs, inputs),
            (false, weight_out_in),
            false,
        ),
        // dIn (rows, inputs) = dOut (rows, outputs) @ W as (outputs, inputs).
        shape(
            "dIn",
            (rows, inputs, outputs),
            (false, !weight_out_in),
            false,
        ),
        // dW (as stored) += the product of in and dOut over the rows.
        shape("dW", (w_rows, w_cols, rows), (true, false), true),
    ]
}

/// The products of one GPT-2 124M training step at batch × seq tokens: each block's four
/// linear layers, its attention for every (batch, head) pair, and the LM head.
pub fn gpt2_shapes(batch: usize, seq: usize) -> Vec<Shape> {
    gpt2_shapes_of(batch, seq, (768, 12, 50257))
}

/// [`gpt2_shapes`] for any GPT-2 shape: `(width, heads, vocab)`. Every shape but the LM
/// head's (named `lm head ...`) is one block's, made once per block in a step.
pub fn gpt2_shapes_of(
    batch: usize,
    seq: usize,
    (width, heads, vocab): (usize, usize, usize),
) -> Vec<Shape> {
    let rows = batch * seq;
    let mut shapes = Vec::new();
    for (name, inputs, outputs) in [
        ("qkv", width, 3 * width),
        ("attn proj", width, width),
        ("fc", width, 4 * width),
        ("fc proj", 4 * width, width),
    ] {
        shapes.extend(linear(name, rows, inputs, outputs, false));
    }
    let head_dim = width / heads;
    let pairs = |name: &str, (m, n, k), rhs_transposed| Shape {
        name: name.to_string(),
        batch: batch * heads,
        m,
        n,
        k,
        lhs_transposed: false,
        rhs_transposed,
        accumulate: false,
    };
    shapes.push(pairs("attn q@kT", (seq, seq, head_dim), true));
    shapes.push(pairs("attn att@v", (seq, head_dim, seq), false));
    shapes.extend(linear("lm head", rows, width, vocab, true));
    shapes
}

/// A pseudo-random value for index `i` of stream `stream`, uniform in [-0.5, 0.5).
fn noise(stream: u64, i: usize) -> f32 {
    let mut z = (i as u64 ^ (stream << 48)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z ^= z >> 31;
    z = z.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (z >> 40) as f32 / (1u64 << 24) as f32 - 0.5
}

/// A `rows × cols` view of `data`, which holds it row-major or, when `transposed`, its
/// transpose row-major.
fn view(data: &[f32], rows: usize, cols: usize, transposed: bool) -> MatrixRef<'_> {
    if transposed {
        MatrixRef::row_major(data, cols, rows).transposed()
    } else {
        MatrixRef::row_major(data, rows, cols)
    }
}

/// Runs `shape`'s products once on `cpu`.
fn product(shape: &Shape, cpu: &Cpu, lhs: &[f32], rhs: &[f32], dst: &mut [f32]) {
    let (m, n, k) = (shape.m, shape.n, shape.k);
    let one = |cpu: &Cpu, index: usize, dst: &mut [f32]| {
        gemm(
            cpu,
            MatrixMut::row_major(dst, m, n),
            view(&lhs[index * m * k..][..m * k], m, k, shape.lhs_transposed),
            view(&rhs[index * k * n..][..k * n], k, n, shape.rhs_transposed),
            1.0,
            shape.accumulate,
        )
    };
    if shape.batch == 1 {
        return one(cpu, 0, dst);
    }
    // Pairs split over the threads, one thread per product, as the attention runs them.
    let single = Cpu::single(cpu.isa);
    parallel::for_each_split(
        shape.batch,
        cpu.threads,
        1,
        dst,
        &|dst: &mut [f32], count| dst.split_at_mut(count * m * n),
        &|pairs, dst| {
            for (index, dst) in pairs.zip(dst.chunks_exact_mut(m * n)) {
                one(&single, index, dst);
            }
        },
    );
}

/// strata's seconds per product of `shape`: one untimed, then `repeats` timed.
fn time_strata(shape: &Shape, cpu: &Cpu, repeats: usize) -> Vec<f64> {
    let (b, m, n, k) = (shape.batch, shape.m, shape.n, shape.k);
    let lhs: Vec<f32> = (0..b * m * k).map(|i| noise(1, i)).collect();
    let rhs: Vec<f32> = (0..b * k * n).map(|i| noise(2, i)).collect();
    let mut dst: Vec<f32> = (0..b * m * n).map(|i| noise(3, i)).collect();
    product(shape, cpu, &lhs, &rhs, &mut dst);
    let times = (0..repeats)
        .map(|_| {
            let start = Instant::now();
            product(shape, cpu, &lhs, &rhs, &mut dst);
            start.elapsed().as_secs_f64()
        })
        .collect();
    assert!(
        dst.iter().all(|x| x.is_finite()),
        "{}: a product is not finite",
        shape.name
    );
    times
}

/// What the PyTorch peer is given.
#[derive(Serialize)]
struct TorchSpec<'a> {
    threads: usize,
    repeats: usize,
    shapes: &'a [Shape],
}

/// What the PyTorch peer printed.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TorchRun {
    /// torch.__version__.
    pub torch: String,
    /// torch.get_num_threads() during the run.
    pub threads: usize,
    /// Per shape, in the order given.
    pub results: Vec<TorchTimes>,
}

/// One shape's times in PyTorch.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TorchTimes {
    /// The shape's name.
    pub name: String,
    /// Seconds per timed product.
    pub times_s: Vec<f64>,
}

/// Parses the peer's standard output: its last non-empty line is one JSON object.
pub fn parse_torch_output(stdout: &str) -> Result<TorchRun, String> {
    super::parse_peer_output(stdout)
}

/// Runs the PyTorch peer with `python` on `shapes`.
fn run_torch(
    python: &Path,
    shapes: &[Shape],
    threads: usize,
    repeats: usize,
) -> Result<TorchRun, String> {
    let spec = TorchSpec {
        threads,
        repeats,
        shapes,
    };
    let spec = serde_json::to_string(&spec).map_err(|e| e.to_string())?;
    let run = parse_torch_output(&super::run_python_peer(python, TORCH_PEER, &spec)?)?;
    let names: Vec<&str> = run.results.iter().map(|r| r.name.as_str()).collect();
    let wanted: Vec<&str> = shapes.iter().map(|s| s.name.as_str()).collect();
    if names != wanted {
        return Err(format!(
            "the PyTorch peer answered for {names:?}, not {wanted:?}"
        ));
    }
    Ok(run)
}

/// One shape's measurement.
#[derive(Debug, Clone, Serialize)]
pub struct ShapeResult {
    /// What was measured.
    pub shape: Shape,
    /// Operations per run of the shape, in 10^9.
    pub gflop: f64,
    /// strata's median seconds.
    pub strata_s_median: f64,
    /// strata's GFLOP/s at the median.
    pub strata_gflop_per_s: f64,
    /// PyTorch's median seconds, when it ran.
    pub torch_s_median: Option<f64>,
    /// PyTorch's GFLOP/s at the median.
    pub torch_gflop_per_s: Option<f64>,
    /// strata's GFLOP/s over PyTorch's.
    pub strata_over_torch: Option<f64>,
}

/// The whole run, as written to JSON.
#[derive(Debug, Clone, Serialize)]
pub struct GemmReport {
    /// The CPU's model name.
    pub cpu: String,
    /// Instruction set of strata's tiles.
    pub isa: String,
    /// Threads per product, both sides.
    pub threads: usize,
    /// Timed products per shape per round.
    pub repeats: usize,
    /// Rounds (strata's pass, then PyTorch's).
    pub rounds: usize,
    /// PyTorch's version, when the peer ran.
    pub torch: Option<String>,
    /// Why the peer did not run, when it did not.
    pub torch_not_run: Option<String>,
    /// `/proc/loadavg`'s 1-minute load before and after: above the thread count,
    /// something else was competing for the cores.
    pub load_average: [Option<f64>; 2],
    /// One entry per shape.
    pub results: Vec<ShapeResult>,
    /// All shapes' operations over the sum of their median times, GFLOP/s: strata.
    pub total_strata_gflop_per_s: f64,
    /// The same for PyTorch.
    pub total_torch_gflop_per_s: Option<f64>,
}

/// Measures `shapes` on strata and, unless `python` is `None`, on PyTorch.
pub fn run(
    shapes: &[Shape],
    cpu: Cpu,
    repeats: usize,
    rounds: usize,
    python: Option<&Path>,
) -> GemmReport {
    let (repeats, rounds) = (repeats.max(1), rounds.max(1));
    let load_before = load_average();
    let mut strata_times = vec![Vec::new(); shapes.len()];
    let mut torch_times = vec![Vec::new(); shapes.len()];
    let mut torch_version = None;
    let mut torch_not_run = python.is_none().then(|| "--no-torch".to_string());
    for _ in 0..rounds {
        for (shape, times) in shapes.iter().zip(&mut strata_times) {
            times.extend(time_strata(shape, &cpu, repeats));
        }
        let Some(python) = python.filter(|_| torch_not_run.is_none()) else {
            continue;
        };
        match run_torch(python, shapes, cpu.threads, repeats) {
            Ok(run) => {
                for (result, times) in run.results.into_iter().zip(&mut torch_times) {
                    times.extend(result.times_s);
                }
                torch_version = Some(run.torch);
            }
            Err(reason) => torch_not_run = Some(reason),
        }
    }
    // A peer that failed in a later round is not reported at all: its rounds would not
    // match strata's.
    if torch_not_run.is_some() {
        torch_version = None;
    }
    let results: Vec<ShapeResult> = shapes
        .iter()
        .zip(strata_times.iter().zip(&torch_times))
        .map(|(shape, (strata, torch))| {
            let strata_s = median(strata);
            let torch_s = torch_version.as_ref().map(|_| median(torch));
            let rate = |seconds: f64| shape.flops() / seconds / 1e9;
            ShapeResult {
                shape: shape.clone(),
                gflop: shape.flops() / 1e9,
                strata_s_median: strata_s,
                strata_gflop_per_s: rate(strata_s),
                torch_s_median: torch_s,
                torch_gflop_per_s: torch_s.map(rate),
                strata_over_torch: torch_s.map(|t| t / strata_s),
            }
        })
        .collect();
    let flops: f64 = shapes.iter().map(Shape::flops).sum();
    let total = |seconds: f64| flops / seconds / 1e9;
    let total_torch = torch_version
        .as_ref()
        .map(|_| total(results.iter().filter_map(|r| r.torch_s_median).sum()));
    GemmReport {
        cpu: cpu_model(),
        isa: cpu.isa.name().to_string(),
        threads: cpu.threads,
        repeats,
        rounds,
        torch: torch_version,
        torch_not_run,
        load_average: [load_before, load_average()],
        total_strata_gflop_per_s: total(results.iter().map(|r| r.strata_s_median).sum()),
        total_torch_gflop_per_s: total_torch,
        results,
    }
}

/// `strata bench gemm`.
pub fn main(args: &GemmArgs) -> Result<(), Box<dyn std::error::Error>> {
    if args.threads == 0 || args.threads > parallel::max_threads() {
        return Err(format!(
            "--threads must be between 1 and {} (the worker pool's threads)",
            parallel::max_threads()
        )
        .into());
    }
    let cpu = Cpu {
        isa: args.isa.unwrap_or_else(Isa::active),
        threads: args.threads,
    };
    let shapes = gpt2_shapes(4, 128);
    let python = (!args.no_torch).then_some(args.python.as_path());
    let report = run(&shapes, cpu, args.repeats, args.rounds, python);
    println!(
        "f32 matrix products of a GPT-2 124M step (batch 4 x 128), {} threads, {} ({}), \
         median of {} rounds x {} products",
        report.threads, report.isa, report.cpu, report.rounds, report.repeats
    );
    match (&report.torch, &report.torch_not_run) {
        (Some(version), _) => println!("peer: PyTorch {version} ({})", args.python.display()),
        (None, Some(reason)) => println!("peer: PyTorch was not run: {reason}"),
        (None, None) => {}
    }
    let mut table = Table::new([
        "product",
        "batch x m x n x k",
        "layout",
        "GFLOP",
        "strata GFLOP/s",
        "torch GFLOP/s",
        "strata/torch",
    ]);
    let optional =
        |x: Option<f64>, unit: &str| x.map_or("-".to_string(), |x| format!("{x:.2}{unit}"));
    for r in &report.results {
        let s = &r.shape;
        table.row([
            s.name.clone(),
            format!("{} x {} x {} x {}", s.batch, s.m, s.n, s.k),
            s.layout(),
            format!("{:.3}", r.gflop),
            format!("{:.1}", r.strata_gflop_per_s),
            optional(r.torch_gflop_per_s, ""),
            optional(r.strata_over_torch, "x"),
        ]);
    }
    let total_gflop: f64 = report.results.iter().map(|r| r.gflop).sum();
    table.row([
        "all (sum of medians)".to_string(),
        String::new(),
        String::new(),
        format!("{total_gflop:.3}"),
        format!("{:.1}", report.total_strata_gflop_per_s),
        optional(report.total_torch_gflop_per_s, ""),
        optional(
            report
                .total_torch_gflop_per_s
                .map(|t| report.total_strata_gflop_per_s / t),
            "x",
        ),
    ]);
    print!("{}", table.render());
    super::finish(report.load_average, args.json.as_deref(), &report)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_shapes_are_the_steps_products() {
        let shapes = gpt2_shapes(4, 128);
        assert_eq!(shapes.len(), 4 * 3 + 2 + 3);
        let qkv = &shapes[0];
        assert_eq!((qkv.m, qkv.n, qkv.k), (512, 2304, 768));
        assert_eq!(qkv.layout(), "NN");
        let d_in = &shapes[1];
        assert_eq!(
            (d_in.m, d_in.n, d_in.k, d_in.layout().as_str()),
            (512, 768, 2304, "NT")
        );
        let d_w = &shapes[2];
        assert_eq!(
            (d_w.m, d_w.n, d_w.k, d_w.layout().as_str()),
            (768, 2304, 512, "TN +=")
        );
        let attention = shapes.iter().find(|s| s.name == "attn q@kT").unwrap();
        assert_eq!(
            (attention.batch, attention.m, attention.n, attention.k),
            (48, 128, 128, 64)
        );
        let logits = shapes.iter().find(|s| s.name == "lm head out").unwrap();
        assert_eq!(
            (logits.m, logits.n, logits.k, logits.layout().as_str()),
            (512, 50257, 768, "NT")
        );
        let head_dw = shapes.iter().find(|s| s.name == "lm head dW").unwrap();
        assert_eq!((head_dw.m, head_dw.n, head_dw.k), (50257, 768, 512));
        // A block's linear layers: three products of 2 · rows · in · out each.
        let linear: f64 = shapes[..12].iter().map(Shape::flops).sum();
        assert_eq!(
            linear,
            3.0 * 2.0 * 512.0 * (768.0 * (2304.0 + 768.0 + 3072.0) + 3072.0 * 768.0)
        );
    }

    #[test]
    fn a_small_run_reports_every_shape_and_a_missing_peer() {
        let shapes: Vec<Shape> = linear("tiny", 33, 17, 40, false)
            .into_iter()
            .chain(linear("tiny head", 33, 17, 40, true))
            .chain([Shape {
                name: "pairs".into(),
                batch: 5,
                m: 9,
                n: 7,
                k: 6,
                lhs_transposed: false,
                rhs_transposed: true,
                accumulate: false,
            }])
            .collect();
        let cpu = Cpu {
            isa: Isa::active(),
            threads: 2,
        };
        let missing = Path::new("/nonexistent/python-for-strata-test");
        let report = run(&shapes, cpu, 2, 2, Some(missing));
        assert_eq!(report.results.len(), shapes.len());
        assert!(report.results.iter().all(|r| r.strata_gflop_per_s > 0.0));
        assert!(report.results.iter().all(|r| r.torch_gflop_per_s.is_none()));
        assert!(report.torch.is_none());
        assert!(
            report
                .torch_not_run
                .as_deref()
                .unwrap()
                .contains("could not run")
        );
        let text = serde_json::to_string(&report).unwrap();
        assert!(text.contains("\"lhs_transposed\":true"));
    }

    #[test]
    fn batched_products_match_one_by_one() {
        let shape = Shape {
            name: "pairs".into(),
            batch: 3,
            m: 5,
            n: 4,
            k: 7,
            lhs_transposed: false,
            rhs_transposed: true,
            accumulate: false,
        };
        let lhs: Vec<f32> = (0..3 * 5 * 7).map(|i| noise(1, i)).collect();
        let rhs: Vec<f32> = (0..3 * 7 * 4).map(|i| noise(2, i)).collect();
        let mut dst = vec![0.0; 3 * 5 * 4];
        let cpu = Cpu {
            isa: Isa::Portable,
            threads: 2,
        };
        product(&shape, &cpu, &lhs, &rhs, &mut dst);
        for b in 0..3 {
            for i in 0..5 {
                for j in 0..4 {
                    // rhs pair b is stored (n, k): element (p, j) at j · k + p.
                    let want: f32 = (0..7)
                        .map(|p| lhs[b * 35 + i * 7 + p] * rhs[b * 28 + j * 7 + p])
                        .sum();
                    let got = dst[b * 20 + i * 4 + j];
                    assert!(
                        (got - want).abs() < 1e-5,
                        "pair {b} ({i}, {j}): {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn torch_output_is_parsed_from_its_last_line() {
        let stdout = "warming up\n{\"torch\": \"2.5.0\", \"threads\": 2, \"results\": \
                      [{\"name\": \"qkv out\", \"times_s\": [0.01, 0.02]}]}\n\n";
        let run = parse_torch_output(stdout).unwrap();
        assert_eq!(run.torch, "2.5.0");
        assert_eq!(run.results[0].times_s, vec![0.01, 0.02]);
        assert!(parse_torch_output("").is_err());
        assert!(parse_torch_output("not json").is_err());
    }
}
