//! `strata bench step --kernels`: where a step's compute time goes. The CPU device times
//! every kernel it runs ([`KernelTimes`]); this turns a policy's median step into a table
//! of kernels (calls, milliseconds, share of the step, GFLOP/s) and three classes: the
//! matrix products (`matmul`, `matmul-backward`), attention (its products and softmax
//! inside one kernel), and everything else. For a GPT-2 model it also times the model's
//! products alone in the same run (`bench gemm`'s shapes at this batch, each block's
//! once per block and the LM head's once), so that the step can be set against the
//! products' time at the GEMM rate this machine gives now: the part of a step that
//! fusing the other kernels could win back.
//!
//! A GPU's kernels are not timed one by one: its profile is empty, and says so.

use serde::Serialize;
use strata_engine::device::{KernelTime, KernelTimes};
use strata_engine::kernels::ops::Cpu;

use super::gemm::{self, Shape};
use crate::report::Table;

/// One kernel's share of a step.
#[derive(Debug, Clone, Serialize)]
pub struct KernelRow {
    /// The kernel (or class) name.
    pub name: String,
    /// Times it ran in the step.
    pub calls: u64,
    /// Seconds, summed over its calls.
    pub seconds: f64,
    /// Its seconds over the step's.
    pub share_of_step: f64,
    /// Its operations, in 10^9 (a multiply-add counted as two).
    pub gflop: f64,
    /// GFLOP over seconds, where it does any.
    pub gflop_per_s: Option<f64>,
}

impl KernelRow {
    fn of(time: &KernelTime, step_s: f64) -> Self {
        KernelRow {
            name: time.name.to_string(),
            calls: time.calls,
            seconds: time.seconds,
            share_of_step: time.seconds / step_s,
            gflop: time.flops / 1e9,
            gflop_per_s: (time.flops > 0.0 && time.seconds > 0.0)
                .then(|| time.flops / time.seconds / 1e9),
        }
    }
}

/// The model's products timed alone, in the same run.
#[derive(Debug, Clone, Serialize)]
pub struct GemmAlone {
    /// The products' operations per step, in 10^9 (each block's shapes once per block).
    pub gflop: f64,
    /// Seconds they take alone: each shape's median time, as often as a step makes it.
    pub seconds: f64,
    /// GFLOP over seconds.
    pub gflop_per_s: f64,
}

/// Where one policy's median step went, kernel by kernel.
#[derive(Debug, Clone, Serialize)]
pub struct ComputeProfile {
    /// The policy, as its table row names it.
    pub policy: String,
    /// The median step's wall seconds.
    pub step_s: f64,
    /// Its kernels' seconds, summed (kernels on the update stream run beside the compute
    /// stream's, so this can exceed the step).
    pub kernels_s: f64,
    /// Every kernel, slowest first.
    pub kernels: Vec<KernelRow>,
    /// The classes: products, attention, the rest.
    pub classes: [KernelRow; 3],
    /// The matrix products and attention's products timed alone in this run (a GPT-2
    /// model on the CPU device only).
    pub gemm_alone: Option<GemmAlone>,
    /// The step's products' operations (`matmul`, `matmul-backward` and attention's)
    /// over [`GemmAlone::gflop_per_s`]: what the step would take were it only its
    /// products at this machine's GEMM rate.
    pub products_at_gemm_rate_s: Option<f64>,
    /// The step over that: 1 when nothing but the products takes time.
    pub step_over_products: Option<f64>,
}

/// GFLOP of a step's products, from its classes: the matrix products' and attention's.
fn product_gflop(classes: &[KernelRow; 3]) -> f64 {
    classes[0].gflop + classes[1].gflop
}

/// Whether kernel `name` is a matrix product.
fn is_product(name: &str) -> bool {
    name == "matmul" || name == "matmul-backward"
}

/// Whether kernel `name` is an attention kernel (its products and softmax fused).
fn is_attention(name: &str) -> bool {
    name.contains("attention")
}

/// The profile of a step that took `step_s` and ran `times`; `gemm_alone` when measured.
pub fn profile(
    policy: String,
    step_s: f64,
    times: &KernelTimes,
    gemm_alone: Option<GemmAlone>,
) -> ComputeProfile {
    let mut kernels: Vec<KernelRow> = times
        .entries()
        .iter()
        .map(|t| KernelRow::of(t, step_s))
        .collect();
    kernels.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    let class =
        |name, pick: &dyn Fn(&str) -> bool| KernelRow::of(&times.sum_of(name, pick), step_s);
    let classes = [
        class("products", &is_product),
        class("attention", &is_attention),
        class("everything else", &|n| !is_product(n) && !is_attention(n)),
    ];
    let products_at_gemm_rate_s = gemm_alone
        .as_ref()
        .map(|g| product_gflop(&classes) / g.gflop_per_s);
    ComputeProfile {
        policy,
        step_s,
        kernels_s: times.seconds(),
        kernels,
        classes,
        step_over_products: products_at_gemm_rate_s.map(|p| step_s / p),
        products_at_gemm_rate_s,
        gemm_alone,
    }
}

/// Times a GPT-2 model's products alone on `cpu`: `layers` blocks of
/// `(width, heads, vocab)` at `batch × seq` tokens, each shape's median of 3 rounds of 5
/// timed products (`bench gemm`'s defaults).
pub fn time_gpt2_products(
    cpu: Cpu,
    layers: usize,
    (batch, seq): (usize, usize),
    dims: (usize, usize, usize),
) -> GemmAlone {
    let shapes = gemm::gpt2_shapes_of(batch, seq, dims);
    let report = gemm::run(&shapes, cpu, 5, 3, None);
    let per_step = |s: &Shape| {
        if s.name.starts_with("lm head") {
            1.0
        } else {
            layers as f64
        }
    };
    let (flops, seconds) = report.results.iter().fold((0.0, 0.0), |(f, t), r| {
        let n = per_step(&r.shape);
        (f + n * r.shape.flops(), t + n * r.strata_s_median)
    });
    GemmAlone {
        gflop: flops / 1e9,
        seconds,
        gflop_per_s: flops / seconds / 1e9,
    }
}

/// The profile as text: the classes, the step against its products, every kernel.
pub fn render(p: &ComputeProfile) -> String {
    if p.kernels.is_empty() {
        return format!(
            "{}: kernels not timed (a GPU's kernels run asynchronously on its streams and \
             are not timed one by one)\n",
            p.policy
        );
    }
    let mut out = format!(
        "where {}'s median step ({:.3} s) went, kernel by kernel (the CPU device's timing):\n",
        p.policy, p.step_s
    );
    let mut table = Table::new(["kernel", "calls", "ms", "% of step", "GFLOP", "GFLOP/s"]);
    let row = |table: &mut Table, r: &KernelRow| {
        table.row([
            r.name.clone(),
            r.calls.to_string(),
            format!("{:.1}", r.seconds * 1e3),
            format!("{:.1}%", r.share_of_step * 100.0),
            format!("{:.2}", r.gflop),
            r.gflop_per_s.map_or("-".into(), |g| format!("{g:.1}")),
        ]);
    };
    for r in p.classes.iter().chain(&p.kernels) {
        row(&mut table, r);
    }
    out.push_str(&table.render());
    out.push_str(&format!(
        "kernels: {:.3} s of the step's {:.3} s; the first three rows are classes of the \
         rows below them\n",
        p.kernels_s, p.step_s
    ));
    match (
        &p.gemm_alone,
        p.products_at_gemm_rate_s,
        p.step_over_products,
    ) {
        (Some(g), Some(at_rate), Some(ratio)) => out.push_str(&format!(
            "products alone, this run: {:.1} GFLOP in {:.3} s ({:.1} GFLOP/s); the step's \
             {:.1} GFLOP of products (matmul and attention) at that rate take {:.3} s: \
             the step is {:.2}x its products' time\n",
            g.gflop,
            g.seconds,
            g.gflop_per_s,
            product_gflop(&p.classes),
            at_rate,
            ratio
        )),
        _ => out.push_str("products alone: not timed (a GPT-2 model on the CPU device only)\n"),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_split_every_kernel_once() {
        let mut times = KernelTimes::default();
        times.add("matmul", 2.0, 4e9);
        times.add("matmul-backward", 1.0, 2e9);
        times.add("flash-attention", 0.5, 1e9);
        times.add("gelu", 0.25, 0.0);
        let gemm = GemmAlone {
            gflop: 7.0,
            seconds: 3.5,
            gflop_per_s: 2.0,
        };
        let p = profile("p".into(), 5.0, &times, Some(gemm));
        let seconds: Vec<f64> = p.classes.iter().map(|c| c.seconds).collect();
        assert_eq!(seconds, [3.0, 0.5, 0.25]);
        assert_eq!(p.kernels[0].name, "matmul");
        assert_eq!(p.kernels[3].gflop_per_s, None);
        // 7 GFLOP of products at 2 GFLOP/s: 3.5 s, against a step of 5 s.
        assert_eq!(p.products_at_gemm_rate_s, Some(3.5));
        assert!((p.step_over_products.unwrap() - 5.0 / 3.5).abs() < 1e-12);
        assert!(render(&p).contains("the step is 1.43x its products' time"));
        // A GPU's steps carry no kernel times: said, not shown as zeros.
        let untimed = profile("g".into(), 1.0, &KernelTimes::default(), None);
        assert!(render(&untimed).contains("kernels not timed"));
    }
}
