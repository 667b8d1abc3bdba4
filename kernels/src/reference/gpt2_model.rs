//! A whole GPT-2 forward and backward pass built from the scalar reference kernels, as
//! llm.c's `train_gpt2.c` does it: every activation kept, no recomputation, one tensor
//! per parameter. Generic over [`Real`], so tests run it in f64 to check gradients
//! against finite differences, and compare the engine's model with it.
//!
//! Parameter names are Hugging Face's, without the `transformer.` prefix; linear weights
//! are stored (in, out) as in Hugging Face's `Conv1D`.

use super::gpt2::{self as k, Real};
use crate::ops::WeightLayout;

/// The model's shape (a production type the reference takes).
pub use crate::model_shape::Gpt2Shape;

/// The parameters of one transformer block.
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub struct LayerWeights<R> {
    pub ln_1_weight: Vec<R>,
    pub ln_1_bias: Vec<R>,
    /// (C, 3C)
    pub c_attn_weight: Vec<R>,
    pub c_attn_bias: Vec<R>,
    /// (C, C)
    pub attn_c_proj_weight: Vec<R>,
    pub attn_c_proj_bias: Vec<R>,
    pub ln_2_weight: Vec<R>,
    pub ln_2_bias: Vec<R>,
    /// (C, 4C)
    pub c_fc_weight: Vec<R>,
    pub c_fc_bias: Vec<R>,
    /// (4C, C)
    pub mlp_c_proj_weight: Vec<R>,
    pub mlp_c_proj_bias: Vec<R>,
}

/// Every parameter of the model (or every gradient: same shapes).
#[derive(Debug, Clone, PartialEq)]
pub struct Weights<R> {
    /// Token embedding (V, C), also the output head.
    pub wte: Vec<R>,
    /// Position embedding (ctx, C).
    pub wpe: Vec<R>,
    /// The transformer blocks.
    pub layers: Vec<LayerWeights<R>>,
    /// Final LayerNorm weight (C).
    pub ln_f_weight: Vec<R>,
    /// Final LayerNorm bias (C).
    pub ln_f_bias: Vec<R>,
}

impl<R: Real> Weights<R> {
    /// All zeros, shaped for `shape`.
    pub fn zeros(shape: Gpt2Shape) -> Self {
        let c = shape.width;
        let z = |n: usize| vec![R::default(); n];
        Weights {
            wte: z(shape.vocab * c),
            wpe: z(shape.ctx * c),
            layers: (0..shape.layers)
                .map(|_| LayerWeights {
                    ln_1_weight: z(c),
                    ln_1_bias: z(c),
                    c_attn_weight: z(c * 3 * c),
                    c_attn_bias: z(3 * c),
                    attn_c_proj_weight: z(c * c),
                    attn_c_proj_bias: z(c),
                    ln_2_weight: z(c),
                    ln_2_bias: z(c),
                    c_fc_weight: z(c * 4 * c),
                    c_fc_bias: z(4 * c),
                    mlp_c_proj_weight: z(4 * c * c),
                    mlp_c_proj_bias: z(c),
                })
                .collect(),
            ln_f_weight: z(c),
            ln_f_bias: z(c),
        }
    }

    /// Every tensor with its Hugging Face name (without `transformer.`), mutably.
    pub fn named_mut(&mut self) -> Vec<(String, &mut Vec<R>)> {
        let mut out: Vec<(String, &mut Vec<R>)> = vec![
            ("wte.weight".into(), &mut self.wte),
            ("wpe.weight".into(), &mut self.wpe),
        ];
        for (i, l) in self.layers.iter_mut().enumerate() {
            let p = |s: &str| format!("h.{i}.{s}");
            out.push((p("ln_1.weight"), &mut l.ln_1_weight));
            out.push((p("ln_1.bias"), &mut l.ln_1_bias));
            out.push((p("attn.c_attn.weight"), &mut l.c_attn_weight));
            out.push((p("attn.c_attn.bias"), &mut l.c_attn_bias));
            out.push((p("attn.c_proj.weight"), &mut l.attn_c_proj_weight));
            out.push((p("attn.c_proj.bias"), &mut l.attn_c_proj_bias));
            out.push((p("ln_2.weight"), &mut l.ln_2_weight));
            out.push((p("ln_2.bias"), &mut l.ln_2_bias));
            out.push((p("mlp.c_fc.weight"), &mut l.c_fc_weight));
            out.push((p("mlp.c_fc.bias"), &mut l.c_fc_bias));
            out.push((p("mlp.c_proj.weight"), &mut l.mlp_c_proj_weight));
            out.push((p("mlp.c_proj.bias"), &mut l.mlp_c_proj_bias));
        }
        out.push(("ln_f.weight".into(), &mut self.ln_f_weight));
        out.push(("ln_f.bias".into(), &mut self.ln_f_bias));
        out
    }

    /// The tensor called `name` (Hugging Face name without `transformer.`), if any.
    pub fn get_mut(&mut self, name: &str) -> Option<&mut Vec<R>> {
        self.named_mut()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t)
    }
}

/// What a forward pass produces.
#[derive(Debug, Clone, PartialEq)]
pub struct Outputs<R> {
    /// (B, T, V)
    pub logits: Vec<R>,
    /// (B, T): each position's cross-entropy.
    pub losses: Vec<R>,
    /// The mean of `losses`.
    pub loss: R,
}

/// One block's saved activations.
struct LayerActs<R> {
    inp: Vec<R>,
    ln1: Vec<R>,
    ln1_mean: Vec<R>,
    ln1_rstd: Vec<R>,
    qkv: Vec<R>,
    atty: Vec<R>,
    att: Vec<R>,
    res2: Vec<R>,
    ln2: Vec<R>,
    ln2_mean: Vec<R>,
    ln2_rstd: Vec<R>,
    fch: Vec<R>,
    fch_gelu: Vec<R>,
}

struct Acts<R> {
    layers: Vec<LayerActs<R>>,
    out: Vec<R>,
    lnf: Vec<R>,
    lnf_mean: Vec<R>,
    lnf_rstd: Vec<R>,
}

fn run_forward<R: Real>(
    shape: Gpt2Shape,
    w: &Weights<R>,
    tokens: &[u32],
    targets: &[u32],
    b: usize,
    t: usize,
) -> (Outputs<R>, Acts<R>) {
    let (c, v, nh) = (shape.width, shape.vocab, shape.heads);
    let n = b * t;
    assert!(t <= shape.ctx);
    let z = |len: usize| vec![R::default(); len];
    let mut x = z(n * c);
    k::encoder_forward(&mut x, tokens, &w.wte, &w.wpe, b, t, c);
    let mut layers = Vec::new();
    for l in &w.layers {
        let mut a = LayerActs {
            inp: x.clone(),
            ln1: z(n * c),
            ln1_mean: z(n),
            ln1_rstd: z(n),
            qkv: z(n * 3 * c),
            atty: z(n * c),
            att: z(b * nh * t * t),
            res2: z(n * c),
            ln2: z(n * c),
            ln2_mean: z(n),
            ln2_rstd: z(n),
            fch: z(n * 4 * c),
            fch_gelu: z(n * 4 * c),
        };
        let io = WeightLayout::InOut;
        k::layernorm_forward(
            &mut a.ln1,
            &mut a.ln1_mean,
            &mut a.ln1_rstd,
            &a.inp,
            &l.ln_1_weight,
            &l.ln_1_bias,
            n,
            c,
        );
        let cb = Some(l.c_attn_bias.as_slice());
        k::matmul_forward(&mut a.qkv, &a.ln1, &l.c_attn_weight, cb, io, n, c, 3 * c);
        k::attention_forward(&mut a.atty, &mut a.att, &a.qkv, b, t, c, nh);
        let mut proj = z(n * c);
        let pb = Some(l.attn_c_proj_bias.as_slice());
        k::matmul_forward(&mut proj, &a.atty, &l.attn_c_proj_weight, pb, io, n, c, c);
        k::residual_forward(&mut a.res2, &a.inp, &proj);
        k::layernorm_forward(
            &mut a.ln2,
            &mut a.ln2_mean,
            &mut a.ln2_rstd,
            &a.res2,
            &l.ln_2_weight,
            &l.ln_2_bias,
            n,
            c,
        );
        let fb = Some(l.c_fc_bias.as_slice());
        k::matmul_forward(&mut a.fch, &a.ln2, &l.c_fc_weight, fb, io, n, c, 4 * c);
        k::gelu_forward(&mut a.fch_gelu, &a.fch);
        let mut fcproj = z(n * c);
        let mb = Some(l.mlp_c_proj_bias.as_slice());
        k::matmul_forward(
            &mut fcproj,
            &a.fch_gelu,
            &l.mlp_c_proj_weight,
            mb,
            io,
            n,
            4 * c,
            c,
        );
        k::residual_forward(&mut x, &a.res2, &fcproj);
        layers.push(a);
    }
    let mut lnf = z(n * c);
    let (mut lnf_mean, mut lnf_rstd) = (z(n), z(n));
    k::layernorm_forward(
        &mut lnf,
        &mut lnf_mean,
        &mut lnf_rstd,
        &x,
        &w.ln_f_weight,
        &w.ln_f_bias,
        n,
        c,
    );
    let mut logits = z(n * v);
    k::matmul_forward(
        &mut logits,
        &lnf,
        &w.wte,
        None,
        WeightLayout::OutIn,
        n,
        c,
        v,
    );
    let mut losses = z(n);
    k::crossentropy_forward(&mut losses, &logits, targets, n, v);
    let mut loss = R::default();
    for &l in &losses {
        loss += l;
    }
    loss = loss / R::from_f64(n as f64);
    let acts = Acts {
        layers,
        out: x,
        lnf,
        lnf_mean,
        lnf_rstd,
    };
    (
        Outputs {
            logits,
            losses,
            loss,
        },
        acts,
    )
}

/// tokens, targets: (B, T).  Logits, per-position losses and their mean.
pub fn forward<R: Real>(
    shape: Gpt2Shape,
    w: &Weights<R>,
    tokens: &[u32],
    targets: &[u32],
    b: usize,
    t: usize,
) -> Outputs<R> {
    run_forward(shape, w, tokens, targets, b, t).0
}

/// tokens, targets: (B, T).  The forward outputs and the gradient of the mean loss with
/// respect to every parameter (the tied embedding's includes the output head's).
pub fn backward<R: Real>(
    shape: Gpt2Shape,
    w: &Weights<R>,
    tokens: &[u32],
    targets: &[u32],
    b: usize,
    t: usize,
) -> (Outputs<R>, Weights<R>) {
    let (outputs, acts) = run_forward(shape, w, tokens, targets, b, t);
    let (c, v, nh) = (shape.width, shape.vocab, shape.heads);
    let n = b * t;
    let z = |len: usize| vec![R::default(); len];
    let mut g = Weights::zeros(shape);
    let io = WeightLayout::InOut;

    let mut dlogits = z(n * v);
    let dloss = R::from_f64(1.0 / n as f64);
    k::crossentropy_backward(&mut dlogits, &outputs.logits, targets, dloss, n, v);
    let mut dlnf = z(n * c);
    let oi = WeightLayout::OutIn;
    k::matmul_backward(
        &mut dlnf, &mut g.wte, None, &dlogits, &acts.lnf, &w.wte, oi, n, c, v,
    );
    let mut dx = z(n * c);
    k::layernorm_backward(
        &mut dx,
        &mut g.ln_f_weight,
        &mut g.ln_f_bias,
        &dlnf,
        &acts.out,
        &w.ln_f_weight,
        &acts.lnf_mean,
        &acts.lnf_rstd,
        n,
        c,
    );
    for (li, l) in w.layers.iter().enumerate().rev() {
        let a = &acts.layers[li];
        let gl = &mut g.layers[li];
        // out = res2 + fcproj: dx flows to both.
        let mut dres2 = dx.clone();
        let mut dfch_gelu = z(n * 4 * c);
        k::matmul_backward(
            &mut dfch_gelu,
            &mut gl.mlp_c_proj_weight,
            Some(&mut gl.mlp_c_proj_bias),
            &dx,
            &a.fch_gelu,
            &l.mlp_c_proj_weight,
            io,
            n,
            4 * c,
            c,
        );
        let mut dfch = z(n * 4 * c);
        k::gelu_backward(&mut dfch, &a.fch, &dfch_gelu);
        let mut dln2 = z(n * c);
        k::matmul_backward(
            &mut dln2,
            &mut gl.c_fc_weight,
            Some(&mut gl.c_fc_bias),
            &dfch,
            &a.ln2,
            &l.c_fc_weight,
            io,
            n,
            c,
            4 * c,
        );
        k::layernorm_backward(
            &mut dres2,
            &mut gl.ln_2_weight,
            &mut gl.ln_2_bias,
            &dln2,
            &a.res2,
            &l.ln_2_weight,
            &a.ln2_mean,
            &a.ln2_rstd,
            n,
            c,
        );
        // res2 = inp + proj: dres2 flows to both.
        let mut dinp = dres2.clone();
        let mut datty = z(n * c);
        k::matmul_backward(
            &mut datty,
            &mut gl.attn_c_proj_weight,
            Some(&mut gl.attn_c_proj_bias),
            &dres2,
            &a.atty,
            &l.attn_c_proj_weight,
            io,
            n,
            c,
            c,
        );
        let mut dqkv = z(n * 3 * c);
        k::attention_backward(&mut dqkv, &datty, &a.qkv, &a.att, b, t, c, nh);
        let mut dln1 = z(n * c);
        k::matmul_backward(
            &mut dln1,
            &mut gl.c_attn_weight,
            Some(&mut gl.c_attn_bias),
            &dqkv,
            &a.ln1,
            &l.c_attn_weight,
            io,
            n,
            c,
            3 * c,
        );
        k::layernorm_backward(
            &mut dinp,
            &mut gl.ln_1_weight,
            &mut gl.ln_1_bias,
            &dln1,
            &a.inp,
            &l.ln_1_weight,
            &a.ln1_mean,
            &a.ln1_rstd,
            n,
            c,
        );
        dx = dinp;
    }
    k::encoder_backward(&mut g.wte, &mut g.wpe, &dx, tokens, b, t, c);
    (outputs, g)
}
