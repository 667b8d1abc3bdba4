//! GPT-2's three kinds of block, forward and backward, written once against
//! [`Backend`].
//!
//! Backward recomputes the block's forward from its saved input (activation
//! checkpointing at block boundaries): the only activations kept between the forward and
//! the backward pass are the inputs of the blocks, and one [`BlockScratch`] holds a
//! block's intermediate activations while that block runs, for every block in turn.

use strata_kernels::ops::WeightLayout;

use super::backend::{Backend, Dims};
use super::layout::{EmbeddingSlots, HeadSlots, TransformerSlots};
use super::{ModelError, Slot};

/// Intermediate activations of the block running now, and their gradients. Sized for
/// one batch shape; shared by all blocks.
pub struct BlockScratch<B: Backend> {
    /// Shape the buffers are sized for.
    pub dims: Dims,
    ln1: B::Act,
    ln1_mean: B::Stats,
    ln1_rstd: B::Stats,
    qkv: B::Act,
    atty: B::Act,
    att: B::Act,
    proj: B::Act,
    res2: B::Act,
    ln2: B::Act,
    ln2_mean: B::Stats,
    ln2_rstd: B::Stats,
    fch: B::Act,
    fch_gelu: B::Act,
    attention: B::AttentionScratch,
    /// Final LayerNorm output (B, T, C).
    lnf: B::Act,
    lnf_mean: B::Stats,
    lnf_rstd: B::Stats,
    /// (B, T, V): logits after the head's forward; their gradient after its backward.
    pub logits: B::Act,
    /// (B, T): each position's loss after the head's forward.
    pub losses: B::Stats,
    d_c: B::Act,
    d_c2: B::Act,
    d_qkv: B::Act,
    d_fch: B::Act,
    d_fch_gelu: B::Act,
}

impl<B: Backend> BlockScratch<B> {
    /// Buffers for batches of `dims`.
    pub fn new(backend: &B, dims: Dims) -> Result<Self, ModelError> {
        let (n, c) = (dims.rows(), dims.width);
        let att = dims.batch * dims.heads * dims.seq * dims.seq;
        let act = |len| backend.alloc_act(len);
        let stats = |len| backend.alloc_stats(len);
        Ok(BlockScratch {
            dims,
            ln1: act(n * c)?,
            ln1_mean: stats(n)?,
            ln1_rstd: stats(n)?,
            qkv: act(n * 3 * c)?,
            atty: act(n * c)?,
            att: act(att)?,
            proj: act(n * c)?,
            res2: act(n * c)?,
            ln2: act(n * c)?,
            ln2_mean: stats(n)?,
            ln2_rstd: stats(n)?,
            fch: act(n * 4 * c)?,
            fch_gelu: act(n * 4 * c)?,
            attention: backend.alloc_attention_scratch(dims)?,
            lnf: act(n * c)?,
            lnf_mean: stats(n)?,
            lnf_rstd: stats(n)?,
            logits: act(n * dims.vocab)?,
            losses: stats(n)?,
            d_c: act(n * c)?,
            d_c2: act(n * c)?,
            d_qkv: act(n * 3 * c)?,
            d_fch: act(n * 4 * c)?,
            d_fch_gelu: act(n * 4 * c)?,
        })
    }
}

/// Elements a [`BlockScratch`] for `dims` holds, by kind: activations (working dtype),
/// f32 statistics, and attention's own scratch (elements of the working dtype, as the
/// CPU backend sizes it). Kept beside [`BlockScratch::new`]; a planner counts with it.
pub fn scratch_elements(dims: Dims) -> (usize, usize, usize) {
    let (n, c) = (dims.rows(), dims.width);
    let att = dims.batch * dims.heads * dims.seq * dims.seq;
    // ln1, atty, proj, res2, ln2, lnf, d_c, d_c2: n*c each; qkv, d_qkv: 3nc;
    // fch, fch_gelu, d_fch, d_fch_gelu: 4nc; att: B*H*T*T; logits: n*V.
    let act = 8 * n * c + 2 * 3 * n * c + 4 * 4 * n * c + att + n * dims.vocab;
    // ln1, ln2, lnf mean and rstd; losses.
    let stats = 7 * n;
    (act, stats, att)
}

/// out: (B, T, C) = `wte[tokens]` + `wpe[position]`.
pub fn embedding_forward<B: Backend>(
    be: &B,
    s: &EmbeddingSlots,
    params: &B::Params,
    tokens: &B::Tokens,
    out: &mut B::Act,
    dims: Dims,
) -> Result<(), ModelError> {
    be.encoder_forward(out, tokens, params, s.wte, s.wpe, dims)
}

/// `grads[wte]`, `grads[wpe]` += the gradient of `dout` (B, T, C).
pub fn embedding_backward<B: Backend>(
    be: &B,
    s: &EmbeddingSlots,
    grads: &mut B::Grads,
    tokens: &B::Tokens,
    dout: &B::Act,
    dims: Dims,
) -> Result<(), ModelError> {
    be.encoder_backward(grads, s.wte, s.wpe, dout, tokens, dims)
}

/// Everything of a transformer block's forward except the last residual add:
/// leaves `res2` and `proj` (the MLP's output) in the scratch.
fn transformer_body<B: Backend>(
    be: &B,
    s: &TransformerSlots,
    p: &B::Params,
    x: &B::Act,
    w: &mut BlockScratch<B>,
) -> Result<(), ModelError> {
    let d = w.dims;
    let (n, c) = (d.rows(), d.width);
    let io = WeightLayout::InOut;
    be.layernorm_forward(
        &mut w.ln1,
        &mut w.ln1_mean,
        &mut w.ln1_rstd,
        x,
        p,
        s.ln_1_weight,
        s.ln_1_bias,
        n,
        c,
    )?;
    be.matmul_forward(
        &mut w.qkv,
        &w.ln1,
        p,
        s.c_attn_weight,
        Some(s.c_attn_bias),
        io,
        n,
        c,
        3 * c,
    )?;
    be.attention_forward(&mut w.atty, &mut w.att, &w.qkv, &mut w.attention, d)?;
    let (pw, pb) = (s.attn_proj_weight, Some(s.attn_proj_bias));
    be.matmul_forward(&mut w.proj, &w.atty, p, pw, pb, io, n, c, c)?;
    be.residual_forward(&mut w.res2, x, &w.proj)?;
    be.layernorm_forward(
        &mut w.ln2,
        &mut w.ln2_mean,
        &mut w.ln2_rstd,
        &w.res2,
        p,
        s.ln_2_weight,
        s.ln_2_bias,
        n,
        c,
    )?;
    be.matmul_forward(
        &mut w.fch,
        &w.ln2,
        p,
        s.c_fc_weight,
        Some(s.c_fc_bias),
        io,
        n,
        c,
        4 * c,
    )?;
    be.gelu_forward(&mut w.fch_gelu, &w.fch)?;
    let (mw, mb) = (s.mlp_proj_weight, Some(s.mlp_proj_bias));
    be.matmul_forward(&mut w.proj, &w.fch_gelu, p, mw, mb, io, n, 4 * c, c)
}

/// out: (B, T, C) = the block applied to x: (B, T, C).
pub fn transformer_forward<B: Backend>(
    be: &B,
    s: &TransformerSlots,
    params: &B::Params,
    x: &B::Act,
    out: &mut B::Act,
    scratch: &mut BlockScratch<B>,
) -> Result<(), ModelError> {
    transformer_body(be, s, params, x, scratch)?;
    be.residual_forward(out, &scratch.res2, &scratch.proj)
}

/// Recomputes the block's forward from its input `x`, then: `grads` += the gradient of
/// its parameters, `dx` = the gradient of `x`, given `dout`, the gradient of its output.
#[allow(clippy::too_many_arguments)]
pub fn transformer_backward<B: Backend>(
    be: &B,
    s: &TransformerSlots,
    p: &B::Params,
    grads: &mut B::Grads,
    x: &B::Act,
    dout: &B::Act,
    dx: &mut B::Act,
    w: &mut BlockScratch<B>,
) -> Result<(), ModelError> {
    transformer_body(be, s, p, x, w)?;
    let d = w.dims;
    let (n, c) = (d.rows(), d.width);
    let io = WeightLayout::InOut;
    let g = grads;
    // out = res2 + mlp(ln2(res2)): dout reaches the MLP's output and res2 directly.
    let (mw, mb) = (s.mlp_proj_weight, Some(s.mlp_proj_bias));
    be.matmul_backward(
        &mut w.d_fch_gelu,
        g,
        dout,
        &w.fch_gelu,
        p,
        mw,
        mb,
        io,
        n,
        4 * c,
        c,
    )?;
    be.gelu_backward(&mut w.d_fch, &w.fch, &w.d_fch_gelu)?;
    let (fw, fb) = (s.c_fc_weight, Some(s.c_fc_bias));
    be.matmul_backward(&mut w.d_c, g, &w.d_fch, &w.ln2, p, fw, fb, io, n, c, 4 * c)?;
    // d_c2 becomes the gradient of res2: dout plus what flows back through ln_2.
    be.copy_act(&mut w.d_c2, dout)?;
    be.layernorm_backward(
        &mut w.d_c2,
        g,
        &w.d_c,
        &w.res2,
        p,
        s.ln_2_weight,
        s.ln_2_bias,
        &w.ln2_mean,
        &w.ln2_rstd,
        n,
        c,
    )?;
    // res2 = x + attn(ln1(x)).
    let (pw, pb) = (s.attn_proj_weight, Some(s.attn_proj_bias));
    be.matmul_backward(&mut w.d_c, g, &w.d_c2, &w.atty, p, pw, pb, io, n, c, c)?;
    be.attention_backward(&mut w.d_qkv, &w.d_c, &w.qkv, &w.att, &mut w.attention, d)?;
    let (aw, ab) = (s.c_attn_weight, Some(s.c_attn_bias));
    be.matmul_backward(&mut w.d_c, g, &w.d_qkv, &w.ln1, p, aw, ab, io, n, c, 3 * c)?;
    be.copy_act(dx, &w.d_c2)?;
    be.layernorm_backward(
        dx,
        g,
        &w.d_c,
        x,
        p,
        s.ln_1_weight,
        s.ln_1_bias,
        &w.ln1_mean,
        &w.ln1_rstd,
        n,
        c,
    )
}

/// The head's forward: final LayerNorm of `x` (B, T, C), logits against the tied token
/// embedding (`wte` in the embedding block's `emb_params`), and each position's
/// cross-entropy against `targets`, left in `scratch.logits` and `scratch.losses`.
#[allow(clippy::too_many_arguments)]
pub fn head_forward<B: Backend>(
    be: &B,
    s: &HeadSlots,
    params: &B::Params,
    emb_params: &B::Params,
    wte: Slot,
    x: &B::Act,
    targets: &B::Tokens,
    w: &mut BlockScratch<B>,
) -> Result<(), ModelError> {
    let d = w.dims;
    let (n, c, v) = (d.rows(), d.width, d.vocab);
    be.layernorm_forward(
        &mut w.lnf,
        &mut w.lnf_mean,
        &mut w.lnf_rstd,
        x,
        params,
        s.ln_f_weight,
        s.ln_f_bias,
        n,
        c,
    )?;
    be.matmul_forward(
        &mut w.logits,
        &w.lnf,
        emb_params,
        wte,
        None,
        WeightLayout::OutIn,
        n,
        c,
        v,
    )?;
    be.crossentropy_forward(&mut w.losses, &w.logits, targets, n, v)
}

/// Recomputes the head's forward, then: `grads` += the final LayerNorm's gradients,
/// `emb_grads[wte]` += the output head's, `dx` = the gradient of `x`, for the loss
/// `dloss * sum(losses)` (`dloss` = 1/(B T) for the mean).
#[allow(clippy::too_many_arguments)]
pub fn head_backward<B: Backend>(
    be: &B,
    s: &HeadSlots,
    params: &B::Params,
    grads: &mut B::Grads,
    emb_params: &B::Params,
    emb_grads: &mut B::Grads,
    wte: Slot,
    x: &B::Act,
    targets: &B::Tokens,
    dloss: f32,
    dx: &mut B::Act,
    w: &mut BlockScratch<B>,
) -> Result<(), ModelError> {
    head_forward(be, s, params, emb_params, wte, x, targets, w)?;
    let d = w.dims;
    let (n, c, v) = (d.rows(), d.width, d.vocab);
    be.crossentropy_backward(&mut w.logits, targets, dloss, n, v)?;
    let oi = WeightLayout::OutIn;
    be.matmul_backward(
        &mut w.d_c, emb_grads, &w.logits, &w.lnf, emb_params, wte, None, oi, n, c, v,
    )?;
    be.zero_act(dx)?;
    be.layernorm_backward(
        dx,
        grads,
        &w.d_c,
        x,
        params,
        s.ln_f_weight,
        s.ln_f_bias,
        &w.lnf_mean,
        &w.lnf_rstd,
        n,
        c,
    )
}
