//! GPT-2, the first model family: its shape ([`Gpt2Config`]), its blocks and tensors with
//! Hugging Face's names (`wte.weight`, `h.3.attn.c_attn.weight`, `ln_f.weight`; linear
//! weights stored (in, out) as `Conv1D` stores them), its `config.json`, its
//! initialisation, and each block's forward and backward as programs of kernels.
//!
//! Blocks: the embedding (`wte`, `wpe`), one block per transformer layer (pre-LayerNorm,
//! causal attention, 4x MLP with tanh-approximated GELU), and the head (`ln_f`, with the
//! output projection tied to `wte`: the head reads, and its backward adds to, the
//! embedding block's `wte` and its gradient).
//!
//! Between passes a layer keeps its input (the checkpoint) and, when the planner keeps
//! the block, its saved activations ([`Pass::ForwardSave`] into [`Bind::Saved`]: every
//! intermediate its backward reads but the GELU's output, which is recomputed from its
//! input by one elementwise kernel). A kept layer's backward ([`Pass::BackwardSaved`])
//! reads them; otherwise its backward ([`Pass::Backward`]) recomputes its forward from its
//! input into the scratch, then runs the same backward kernels. The scratch is one region
//! shared by every block (they run one after another on one stream); the head's buffers
//! overlay the layers'.
//!
//! A LoRA model of GPT-2 ([`Family::lora`], in `lora.rs`) freezes every base tensor and
//! adds to each adapted product its adapter's share, whose `A` and `B` are the only
//! tensors its programs compute gradients of.
//!
//! This is the only place in the engine that knows GPT-2's operations.

mod config;
pub(super) mod init;
mod lora;

pub use config::{Gpt2Config, PRESETS};

use std::path::Path;
use std::sync::Arc;

use serde_json::{Value, json};
use strata_kernels::kernel::attention::{GqaDims, flash_scratch_bytes};
use strata_kernels::kernel::fewbit::{Bits, codes_len};
use strata_kernels::kernel::{
    CopyKernel, Encoder, EncoderBackward, FewBitGelu, FewBitGeluBackward, FlashAttention,
    FlashAttentionBackward, FlashMask, Gelu, GeluBackward, LayerNorm, LayerNormBackward,
    LayerNormGrads, Matmul, MatmulBackward, Residual, Zero,
};
use strata_kernels::ops::WeightLayout;
use strata_kernels::program::{Dtype, Kernel, Target, TensorRef};

use super::approx::{self, Activation, ApproxBackward, sketch_salt};
use super::config_keys::ConfigKeys;
use super::head::LossHead;
use super::layout::{BlockKind, BlockLayout, Carve, Slot};
use super::lora::LoraConfig;
use super::lora::adapted::saved_u;
use super::lora::kernels::AdapterKernels;
use super::lora::layout::init_adapters;
use super::{Bind, Family, ModelError, Pass, Shape};
use lora::{Gpt2Lora, LayerAdapters, LoraScratch, Product};

/// Which product of a layer a sketch belongs to (its seed's salt, with the layer).
const SALT_ATTN: u64 = 0;
const SALT_FC: u64 = 1;
const SALT_PROJ: u64 = 2;

/// The prefix Hugging Face's `GPT2LMHeadModel` puts before the body's tensor names.
pub const PREFIX: &str = "transformer.";

/// GPT-2 of one shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Gpt2 {
    config: Gpt2Config,
    /// What the layers' backward approximates ([`Family::approximate`]).
    approx: ApproxBackward,
    /// The adapters of a LoRA model ([`Family::lora`]): the base then frozen.
    lora: Option<Arc<Gpt2Lora>>,
    blocks: Vec<BlockLayout>,
    embedding: EmbeddingSlots,
    layer: Option<LayerSlots>,
    head: HeadSlots,
}

impl Gpt2 {
    /// The family member of shape `config`.
    pub fn new(config: Gpt2Config) -> Result<Self, ModelError> {
        config.validate()?;
        let blocks = block_layouts(&config);
        let last = blocks.len() - 1;
        Ok(Gpt2 {
            config,
            approx: ApproxBackward::EXACT,
            lora: None,
            embedding: EmbeddingSlots::of(&blocks[0]),
            layer: (config.layers > 0).then(|| LayerSlots::of(&blocks[1])),
            head: HeadSlots::of(&blocks[last]),
            blocks,
        })
    }

    /// The shape.
    pub fn config(&self) -> &Gpt2Config {
        &self.config
    }

    /// Reads a GPT-2 `config.json`, refusing options strata does not implement.
    pub fn from_hf_config(path: &Path, json: &Value) -> Result<Self, ModelError> {
        Gpt2::new(parse_config(path, json)?)
    }

    fn layer(&self) -> &LayerSlots {
        self.layer
            .as_ref()
            .expect("a model with layers has their slots")
    }

    /// Where each intermediate activation of a block lives in the scratch.
    fn scratch(&self, shape: Shape, target: Target, dtype: Dtype) -> Scratch {
        let lora = self.lora.as_deref().map(|l| (l.config.rank, l.any));
        Scratch::new(&self.config, (self.approx, lora), shape, target, dtype)
    }

    /// Layer `layer`'s adapters, with their rank, in a LoRA model.
    fn adapters(&self, layer: usize) -> Option<(&LayerAdapters, usize)> {
        Some(self.lora.as_deref()?.layer(layer))
    }
}

impl Family for Gpt2 {
    fn name(&self) -> &'static str {
        "gpt2"
    }

    fn describe(&self) -> String {
        let c = &self.config;
        format!(
            "GPT-2 ({} layers, {} wide, {} heads, vocab {}, context {})",
            c.layers, c.width, c.heads, c.vocab, c.ctx
        )
    }

    fn blocks(&self) -> &[BlockLayout] {
        &self.blocks
    }

    fn vocab(&self) -> usize {
        self.config.vocab
    }

    fn context(&self) -> usize {
        self.config.ctx
    }

    fn width(&self) -> usize {
        self.config.width
    }

    fn tied(&self, block: usize) -> Option<usize> {
        (block == self.blocks.len() - 1).then_some(0)
    }

    fn check_shape(&self, shape: Shape) -> Result<(), ModelError> {
        // The largest buffers a batch needs: logits, the MLP's activations (rows x 4C),
        // attention scores.
        let c = self.config;
        shape.check_addressable(c.vocab, 4 * c.width, c.heads)
    }

    fn scratch_bytes(&self, shape: Shape, target: Target, dtype: Dtype) -> usize {
        self.scratch(shape, target, dtype).bytes
    }

    fn saved_bytes(&self, block: usize, shape: Shape, _target: Target, dtype: Dtype) -> usize {
        match self.blocks[block].kind {
            BlockKind::Transformer { layer } => {
                let s = self.scratch(shape, Target::Cpu, dtype);
                s.kept.saved(&s.approx, self.adapters(layer)).1
            }
            BlockKind::Embedding | BlockKind::Head => 0,
        }
    }

    fn program(
        &self,
        block: usize,
        pass: Pass,
        shape: Shape,
        target: Target,
        dtype: Dtype,
    ) -> Vec<Kernel> {
        let mut s = self.scratch(shape, target, dtype);
        let kind = self.blocks[block].kind;
        let layer = match kind {
            BlockKind::Transformer { layer } => layer,
            BlockKind::Embedding | BlockKind::Head => 0,
        };
        let adapters = match kind {
            BlockKind::Transformer { layer } => self.adapters(layer),
            BlockKind::Embedding | BlockKind::Head => None,
        };
        if pass.uses_saved() && matches!(kind, BlockKind::Transformer { .. }) {
            s.kept = s.kept.saved(&s.approx, adapters).0;
            if let Some((a, _)) = adapters {
                s.lora = s.lora.with_saved(&s.kept.lora_u, a);
            }
        }
        let p = Program {
            shape,
            config: self.config,
            layer,
            dtype,
            s,
            frozen: self.blocks[block].frozen,
            trained_len: self.blocks[block].trained_len(),
            train_base: self.lora.is_none(),
            adapters: adapters.map(|(a, _)| *a),
            lora_scale: self.lora.as_deref().map_or(0.0, |l| l.scale),
            tied_len: self.blocks[0].trained_len(),
            out: Vec::new(),
        };
        match kind {
            BlockKind::Embedding => p.embedding(&self.embedding, pass),
            BlockKind::Transformer { .. } => p.layer(self.layer(), pass),
            BlockKind::Head => p.head(&self.head, self.embedding.wte, pass),
        }
    }

    fn logits(&self, shape: Shape, target: Target, dtype: Dtype) -> Option<TensorRef> {
        Some(self.scratch(shape, target, dtype).logits)
    }

    fn init_block(&self, block: usize, seed: u64) -> Vec<f32> {
        // A LoRA model's base tensors come first, so they get the base's values.
        let mut params = init::gpt2_init(&self.blocks[block], self.config.layers, seed);
        if let Some(lora) = &self.lora {
            init_adapters(
                (block, &self.blocks[block]),
                &lora.selected,
                seed,
                &mut params,
            );
        }
        params
    }

    fn hf_prefix(&self, _block: usize) -> &'static str {
        PREFIX
    }

    fn hf_ignored(&self, name: &str) -> bool {
        let name = name.strip_prefix(PREFIX).unwrap_or(name);
        name == "lm_head.weight"
            || name.ends_with(".attn.bias")
            || name.ends_with(".attn.masked_bias")
    }

    fn hf_config(&self) -> Value {
        config_json(&self.config)
    }

    fn param_count(&self) -> usize {
        self.config.param_count() + self.lora.as_deref().map_or(0, |l| l.params)
    }

    fn approximate(&self, approx: ApproxBackward) -> Result<Arc<dyn Family>, ModelError> {
        if self.lora.is_some() {
            return Err(super::lora::adapted::approximate_refused(approx));
        }
        approx.bits_for(Activation::Gelu, "GPT-2")?;
        Ok(Arc::new(Gpt2 {
            approx,
            ..self.clone()
        }))
    }

    fn approximation(&self) -> ApproxBackward {
        self.approx
    }

    fn lora(&self, config: &LoraConfig) -> Result<Arc<dyn Family>, ModelError> {
        let (blocks, lora) = lora::adapt(self, config)?;
        Ok(Arc::new(Gpt2 {
            blocks,
            lora: Some(Arc::new(lora)),
            ..self.clone()
        }))
    }

    fn lora_config(&self) -> Option<&LoraConfig> {
        self.lora.as_deref().map(|l| &l.config)
    }
}

/// The layouts of every block, in order: embedding, `layers` transformer blocks, head.
fn block_layouts(config: &Gpt2Config) -> Vec<BlockLayout> {
    let (c, v, ctx) = (config.width, config.vocab, config.ctx);
    let mut blocks = vec![BlockLayout::build(
        BlockKind::Embedding,
        "",
        &[("wte.weight", vec![v, c]), ("wpe.weight", vec![ctx, c])],
    )];
    for layer in 0..config.layers {
        blocks.push(BlockLayout::build(
            BlockKind::Transformer { layer },
            &format!("h.{layer}."),
            &[
                ("ln_1.weight", vec![c]),
                ("ln_1.bias", vec![c]),
                ("attn.c_attn.weight", vec![c, 3 * c]),
                ("attn.c_attn.bias", vec![3 * c]),
                ("attn.c_proj.weight", vec![c, c]),
                ("attn.c_proj.bias", vec![c]),
                ("ln_2.weight", vec![c]),
                ("ln_2.bias", vec![c]),
                ("mlp.c_fc.weight", vec![c, 4 * c]),
                ("mlp.c_fc.bias", vec![4 * c]),
                ("mlp.c_proj.weight", vec![4 * c, c]),
                ("mlp.c_proj.bias", vec![c]),
            ],
        ));
    }
    blocks.push(BlockLayout::build(
        BlockKind::Head,
        "",
        &[("ln_f.weight", vec![c]), ("ln_f.bias", vec![c])],
    ));
    blocks
}

/// The embedding block's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct EmbeddingSlots {
    /// Token embedding (V, C); also the output head's weight.
    wte: Slot,
    /// Position embedding (ctx, C).
    wpe: Slot,
}

impl EmbeddingSlots {
    fn of(layout: &BlockLayout) -> Self {
        EmbeddingSlots {
            wte: layout.slot_of("wte.weight"),
            wpe: layout.slot_of("wpe.weight"),
        }
    }
}

/// A transformer block's tensors (the same offsets in every layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LayerSlots {
    ln_1_weight: Slot,
    ln_1_bias: Slot,
    /// (C, 3C)
    c_attn_weight: Slot,
    c_attn_bias: Slot,
    /// (C, C)
    attn_proj_weight: Slot,
    attn_proj_bias: Slot,
    ln_2_weight: Slot,
    ln_2_bias: Slot,
    /// (C, 4C)
    c_fc_weight: Slot,
    c_fc_bias: Slot,
    /// (4C, C)
    mlp_proj_weight: Slot,
    mlp_proj_bias: Slot,
}

impl LayerSlots {
    fn of(layout: &BlockLayout) -> Self {
        LayerSlots {
            ln_1_weight: layout.slot_of("ln_1.weight"),
            ln_1_bias: layout.slot_of("ln_1.bias"),
            c_attn_weight: layout.slot_of("attn.c_attn.weight"),
            c_attn_bias: layout.slot_of("attn.c_attn.bias"),
            attn_proj_weight: layout.slot_of("attn.c_proj.weight"),
            attn_proj_bias: layout.slot_of("attn.c_proj.bias"),
            ln_2_weight: layout.slot_of("ln_2.weight"),
            ln_2_bias: layout.slot_of("ln_2.bias"),
            c_fc_weight: layout.slot_of("mlp.c_fc.weight"),
            c_fc_bias: layout.slot_of("mlp.c_fc.bias"),
            mlp_proj_weight: layout.slot_of("mlp.c_proj.weight"),
            mlp_proj_bias: layout.slot_of("mlp.c_proj.bias"),
        }
    }
}

/// The head block's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct HeadSlots {
    ln_f_weight: Slot,
    ln_f_bias: Slot,
}

impl HeadSlots {
    fn of(layout: &BlockLayout) -> Self {
        HeadSlots {
            ln_f_weight: layout.slot_of("ln_f.weight"),
            ln_f_bias: layout.slot_of("ln_f.bias"),
        }
    }
}

/// What a layer's backward approximates, for one batch shape: the few-bit code's width
/// of the GELU, and the sketch's columns of each product whose weight gradient is
/// estimated. `c_attn` (attn) and `c_fc` (mlp) are estimated when asked; the MLP's
/// `c_proj` (mlp) only with the few-bit GELU, since otherwise its input, the GELU's
/// output, is recomputed from `fch`, which the exact GELU backward keeps anyway; the
/// attention's `c_proj` never, since its input is the attention's output, which the
/// attention's backward reads.
#[derive(Debug, Clone, Copy, Default)]
struct Approx {
    bits: Option<Bits>,
    attn: Option<usize>,
    fc: Option<usize>,
    proj: Option<usize>,
}

impl Approx {
    fn of(approx: ApproxBackward, shape: Shape) -> Approx {
        let n = shape.rows();
        let bits = approx.bits_for(Activation::Gelu, "GPT-2").ok().flatten();
        let fc = approx.mlp.map(|r| r.columns(n));
        Approx {
            bits,
            attn: approx.attn.map(|r| r.columns(n)),
            fc,
            proj: bits.and(fc),
        }
    }
}

/// The intermediates of a layer's forward that its backward reads: in the scratch when
/// the backward recomputes them, in the buffer bound at [`Bind::Saved`] when the forward
/// keeps them (a [`Pass::ForwardSave`] writes them there, a [`Pass::BackwardSaved`]
/// reads them). With the exact backward the GELU's output (rows x 4C, the largest) is not
/// among them: the saved backward recomputes it from `fch`, one elementwise pass, where
/// keeping it would add a third to the bytes. With an approximate one ([`Approx`]), a
/// sketched product keeps its input's projection instead of the input, and the few-bit
/// GELU keeps its codes and its output (or that output's projection) instead of `fch`.
#[derive(Debug, Clone, Copy)]
struct Kept {
    ln1: TensorRef,
    ln1_mean: TensorRef,
    ln1_rstd: TensorRef,
    qkv: TensorRef,
    atty: TensorRef,
    /// The attention's log-sum-exp per (batch, head, position), f32.
    lse: TensorRef,
    res2: TensorRef,
    ln2: TensorRef,
    ln2_mean: TensorRef,
    ln2_rstd: TensorRef,
    fch: TensorRef,
    /// The GELU's output.
    fch_gelu: TensorRef,
    /// The few-bit codes of `fch` (u32 words; empty with the exact GELU backward).
    codes: TensorRef,
    /// `Sᵀ ln1`, `Sᵀ ln2` and `Sᵀ fch_gelu` (empty where that product is exact).
    ln1_proj: TensorRef,
    ln2_proj: TensorRef,
    gelu_proj: TensorRef,
    /// Each adapted product's `x Aᵀ` in a LoRA model (empty otherwise).
    lora_u: [TensorRef; 4],
}

impl Kept {
    /// The next tensors of `carve`.
    fn carve(
        carve: &mut Carve,
        (config, lora): (&Gpt2Config, Option<(usize, [bool; 4])>),
        a: &Approx,
        shape: Shape,
        dtype: Dtype,
    ) -> Kept {
        let (n, c) = (shape.rows(), config.width);
        let rows = shape.batch * config.heads * shape.seq;
        let f32 = Dtype::F32;
        let mut l = |len, dt| carve.take(len, dt);
        let (ln1, ln1_mean, ln1_rstd) = (l(n * c, dtype), l(n, f32), l(n, f32));
        let (qkv, atty, lse) = (l(3 * n * c, dtype), l(n * c, dtype), l(rows, f32));
        let (res2, ln2, ln2_mean, ln2_rstd) =
            (l(n * c, dtype), l(n * c, dtype), l(n, f32), l(n, f32));
        let (fch, fch_gelu) = (l(4 * n * c, dtype), l(4 * n * c, dtype));
        let codes = l(a.bits.map_or(0, |b| codes_len(4 * n * c, b)), Dtype::U32);
        let projection = |k: Option<usize>, cols| k.map_or(0, |k| k * cols);
        let (rank, any) = lora.unwrap_or((0, [false; 4]));
        let lora_u = any.map(|adapted| l(if adapted { n * rank } else { 0 }, dtype));
        Kept {
            ln1,
            ln1_mean,
            ln1_rstd,
            qkv,
            atty,
            lse,
            res2,
            ln2,
            ln2_mean,
            ln2_rstd,
            fch,
            fch_gelu,
            codes,
            ln1_proj: l(projection(a.attn, c), dtype),
            ln2_proj: l(projection(a.fc, c), dtype),
            gelu_proj: l(projection(a.proj, 4 * c), dtype),
            lora_u,
        }
    }

    /// These tensors with the ones the backward reads moved into the buffer bound at
    /// [`Bind::Saved`] (the same for every layer and target but in a LoRA model, whose
    /// layer `adapters` keeps each adapted product's `u`, and a product's input only where
    /// its adapter's gradient reads it), and that buffer's bytes.
    fn saved(mut self, a: &Approx, adapters: Option<(&LayerAdapters, usize)>) -> (Kept, usize) {
        let reads = |p: Product| adapters.is_none_or(|(l, _)| l.has(p as usize));
        let mut carve = Carve::new(Bind::Saved);
        let mut keep = |t: &mut TensorRef| *t = carve.take(t.len, t.dtype);
        if a.attn.is_some() {
            keep(&mut self.ln1_proj);
        } else if reads(Product::Attn) {
            keep(&mut self.ln1);
        }
        for t in [
            &mut self.ln1_mean,
            &mut self.ln1_rstd,
            &mut self.qkv,
            &mut self.atty,
            &mut self.lse,
            &mut self.res2,
        ] {
            keep(t);
        }
        if a.fc.is_some() {
            keep(&mut self.ln2_proj);
        } else if reads(Product::Fc) {
            keep(&mut self.ln2);
        }
        keep(&mut self.ln2_mean);
        keep(&mut self.ln2_rstd);
        match (a.bits, a.proj) {
            (None, _) => keep(&mut self.fch),
            (Some(_), None) => {
                keep(&mut self.codes);
                keep(&mut self.fch_gelu);
            }
            (Some(_), Some(_)) => {
                keep(&mut self.codes);
                keep(&mut self.gelu_proj);
            }
        }
        let mut carve_u = carve;
        self.lora_u = saved_u(&mut carve_u, self.ln1_mean.len, adapters, self.ln1.dtype);
        (self, carve_u.next)
    }
}

/// The scratch: every intermediate activation of one block for one batch shape, at its
/// offset. A layer's buffers and the head's overlay each other (the head runs alone).
#[derive(Debug, Clone, Copy)]
struct Scratch {
    /// What the backward reads, unless a program moves it to the saved buffer.
    kept: Kept,
    /// What the layer's backward approximates.
    approx: Approx,
    proj: TensorRef,
    attention: TensorRef,
    /// The sketch `S` and `Sᵀ dY` of a randomized weight gradient (f32; empty when
    /// every product is exact).
    sketch: TensorRef,
    d_c: TensorRef,
    d_c2: TensorRef,
    d_qkv: TensorRef,
    d_fch: TensorRef,
    d_fch_gelu: TensorRef,
    lnf: TensorRef,
    lnf_mean: TensorRef,
    lnf_rstd: TensorRef,
    head_d_c: TensorRef,
    /// (B, T, V): logits after the head's forward; their gradient after its backward.
    logits: TensorRef,
    /// A LoRA model's adapters' tensors (empty otherwise; `u` also in `kept`).
    lora: LoraScratch,
    /// Bytes of the whole region.
    bytes: usize,
}

impl Scratch {
    fn new(
        config: &Gpt2Config,
        (approx, lora): (ApproxBackward, Option<(usize, [bool; 4])>),
        shape: Shape,
        target: Target,
        dtype: Dtype,
    ) -> Scratch {
        let (n, c, v) = (shape.rows(), config.width, config.vocab);
        let f32 = Dtype::F32;
        let a = Approx::of(approx, shape);
        let mut layer = Carve::new(Bind::Scratch);
        let kept = Kept::carve(&mut layer, (config, lora), &a, shape, dtype);
        // The adapters' u are the kept ones; the wide tensor is rows × 4C (c_fc's
        // output, the MLP's c_proj's input).
        let wide = lora.map(|(rank, _)| (rank, [false; 4]));
        let adapters = LoraScratch::new(&mut layer, (n, 4 * c), wide, dtype);
        let mut l = |len, dt| layer.take(len, dt);
        let proj = l(n * c, dtype);
        let dims = GqaDims::multi_head(shape.batch, shape.seq, c, config.heads);
        let attention = l(flash_scratch_bytes(target, dims), Dtype::U8);
        // The largest sketch: S (n x k) and Sᵀ dY (k x its product's outputs).
        let sketch = [(a.attn, 3 * c), (a.fc, 4 * c), (a.proj, c)]
            .into_iter()
            .map(|(k, out)| k.map_or(0, |k| n * k + k * out))
            .max()
            .unwrap_or(0);
        let sketch = l(sketch, f32);
        let (d_c, d_c2, d_qkv) = (l(n * c, dtype), l(n * c, dtype), l(3 * n * c, dtype));
        let (d_fch, d_fch_gelu) = (l(4 * n * c, dtype), l(4 * n * c, dtype));
        let mut head = Carve::new(Bind::Scratch);
        let mut h = |len, dt| head.take(len, dt);
        let (lnf, lnf_mean, lnf_rstd) = (h(n * c, dtype), h(n, f32), h(n, f32));
        let (head_d_c, logits) = (h(n * c, dtype), h(n * v, dtype));
        Scratch {
            kept,
            approx: a,
            proj,
            attention,
            sketch,
            d_c,
            d_c2,
            d_qkv,
            d_fch,
            d_fch_gelu,
            lnf,
            lnf_mean,
            lnf_rstd,
            head_d_c,
            logits,
            lora: LoraScratch {
                u: kept.lora_u,
                ..adapters
            },
            bytes: layer.next.max(head.next),
        }
    }
}

/// Builds one block's program.
struct Program {
    shape: Shape,
    config: Gpt2Config,
    /// The transformer layer (0 for the embedding and the head): its sketches' salt.
    layer: usize,
    dtype: Dtype,
    s: Scratch,
    /// Elements of the block's frozen head (its gradients start after them).
    frozen: usize,
    /// Elements of the block's gradients.
    trained_len: usize,
    /// Whether the base's tensors train (not in a LoRA model).
    train_base: bool,
    /// The layer's adapters, in a LoRA model.
    adapters: Option<LayerAdapters>,
    /// The adapters' scale (`alpha / rank`, or rsLoRA's).
    lora_scale: f32,
    /// Elements of the tied block's (the embedding's) gradients.
    tied_len: usize,
    out: Vec<Kernel>,
}

impl Program {
    /// `slot` of the buffer bound at `bind`, in the working dtype (parameters).
    fn param(&self, bind: Bind, slot: Slot) -> TensorRef {
        slot.tensor(bind, self.dtype)
    }

    /// `slot`'s gradient in the gradient buffer bound at `bind` (f32), which holds the
    /// block's trained tail only (so `frozen` elements before `slot`; the tied
    /// embedding's gradients exist only where it trains whole).
    fn grad(&self, bind: Bind, slot: Slot) -> TensorRef {
        let frozen = if bind == Bind::Grads { self.frozen } else { 0 };
        assert!(
            slot.offset >= frozen,
            "the tensor at {} is frozen",
            slot.offset
        );
        TensorRef::new(bind as u8, (slot.offset - frozen) * 4, slot.len, Dtype::F32)
    }

    /// The gradients of a LayerNorm's `weight` and `bias`, where the base trains.
    fn norm_grads(&self, weight: Slot, bias: Slot) -> Option<LayerNormGrads> {
        self.train_base.then(|| LayerNormGrads {
            dweight: self.grad(Bind::Grads, weight),
            dbias: self.grad(Bind::Grads, bias),
        })
    }

    /// Zeroes the first `len` elements of the gradients bound at `bind` (none for a block
    /// that trains nothing).
    fn zero_grads(&mut self, bind: Bind, len: usize) {
        if len > 0 {
            self.push(Kernel::Zero(Zero {
                t: TensorRef::new(bind as u8, 0, len, Dtype::F32),
            }));
        }
    }

    /// Product `p`'s adapter's tensors, where it has one.
    fn adapter(&self, p: Product) -> Option<AdapterKernels> {
        let slots = self.adapters?.get(p as usize)?;
        Some(AdapterKernels::new(
            (p as usize, slots),
            (self.dtype, self.frozen),
            &self.s.lora,
            (self.lora_scale, self.shape.rows()),
        ))
    }

    /// Product `p`, `out = inp @ weight + bias` with the weight (C, OC) as Conv1D stores
    /// it, and, where it carries an adapter, the adapter's share added to `out`.
    fn product(
        &self,
        p: Product,
        (out, inp): (TensorRef, TensorRef),
        (weight, bias): (Slot, Slot),
    ) -> Vec<Kernel> {
        let n = self.shape.rows();
        let mut k = vec![Kernel::Matmul(Matmul {
            out,
            inp,
            weight: self.param(Bind::Params, weight),
            bias: Some(self.param(Bind::Params, bias)),
            layout: WeightLayout::InOut,
            n,
            c: inp.len / n,
            oc: out.len / n,
        })];
        if let Some(adapter) = self.adapter(p) {
            k.extend(adapter.forward(out, inp));
        }
        k
    }

    /// A whole activation buffer (B, T, C).
    fn act(&self, bind: Bind) -> TensorRef {
        TensorRef::new(
            bind as u8,
            0,
            self.shape.rows() * self.config.width,
            self.dtype,
        )
    }

    /// Token ids (B, T) bound at `bind`.
    fn ids(&self, bind: Bind) -> TensorRef {
        TensorRef::new(bind as u8, 0, self.shape.rows(), Dtype::U32)
    }

    fn push(&mut self, k: Kernel) {
        self.out.push(k);
    }

    fn embedding(mut self, e: &EmbeddingSlots, pass: Pass) -> Vec<Kernel> {
        let (b, t, c) = (self.shape.batch, self.shape.seq, self.config.width);
        match pass {
            Pass::Forward | Pass::ForwardSave => self.push(Kernel::Encoder(Encoder {
                out: self.act(Bind::Output),
                tokens: self.ids(Bind::Tokens),
                wte: self.param(Bind::Params, e.wte),
                wpe: self.param(Bind::Params, e.wpe),
                b,
                t,
                c,
            })),
            // A LoRA model's embedding is frozen: nothing to compute.
            Pass::Backward | Pass::BackwardSaved if !self.train_base => {}
            // The head zeroes this block's gradients (it adds to `wte`'s first).
            Pass::Backward | Pass::BackwardSaved => {
                self.push(Kernel::EncoderBackward(EncoderBackward {
                    dwte: self.grad(Bind::Grads, e.wte),
                    dwpe: self.grad(Bind::Grads, e.wpe),
                    dout: self.act(Bind::DOutput),
                    tokens: self.ids(Bind::Tokens),
                    b,
                    t,
                    c,
                }))
            }
        }
        self.out
    }

    /// Everything of a layer's forward except the last residual add: leaves `res2` and
    /// `proj` (the MLP's output) in the scratch. With `project`, also the projections of
    /// the sketched products' inputs (a forward that keeps only the layer's output skips
    /// them: its backward recomputes them).
    fn layer_body(&mut self, l: &LayerSlots, project: bool) {
        let s = self.s;
        let (n, c) = (self.shape.rows(), self.config.width);
        let x = self.act(Bind::Input);
        let p = |slot| self.param(Bind::Params, slot);
        let mut kernels = vec![Kernel::LayerNorm(LayerNorm {
            out: s.kept.ln1,
            mean: s.kept.ln1_mean,
            rstd: s.kept.ln1_rstd,
            inp: x,
            weight: p(l.ln_1_weight),
            bias: p(l.ln_1_bias),
            n,
            c,
        })];
        kernels.extend(self.projection(
            project,
            s.approx.attn,
            s.kept.ln1,
            s.kept.ln1_proj,
            SALT_ATTN,
        ));
        let attn = (l.c_attn_weight, l.c_attn_bias);
        kernels.extend(self.product(Product::Attn, (s.kept.qkv, s.kept.ln1), attn));
        kernels.extend([Kernel::FlashAttention(FlashAttention {
            out: s.kept.atty,
            lse: s.kept.lse,
            qkv: s.kept.qkv,
            scratch: s.attention,
            b: self.shape.batch,
            t: self.shape.seq,
            c,
            nh: self.config.heads,
            mask: FlashMask::CAUSAL,
        })]);
        let attn_proj = (l.attn_proj_weight, l.attn_proj_bias);
        kernels.extend(self.product(Product::AttnProj, (s.proj, s.kept.atty), attn_proj));
        kernels.extend([
            Kernel::Residual(Residual {
                out: s.kept.res2,
                a: x,
                b: s.proj,
            }),
            Kernel::LayerNorm(LayerNorm {
                out: s.kept.ln2,
                mean: s.kept.ln2_mean,
                rstd: s.kept.ln2_rstd,
                inp: s.kept.res2,
                weight: p(l.ln_2_weight),
                bias: p(l.ln_2_bias),
                n,
                c,
            }),
        ]);
        kernels.extend(self.projection(project, s.approx.fc, s.kept.ln2, s.kept.ln2_proj, SALT_FC));
        let fc = (l.c_fc_weight, l.c_fc_bias);
        kernels.extend(self.product(Product::Fc, (s.kept.fch, s.kept.ln2), fc));
        kernels.push(self.gelu());
        kernels.extend(self.projection(
            project,
            s.approx.proj,
            s.kept.fch_gelu,
            s.kept.gelu_proj,
            SALT_PROJ,
        ));
        let mlp_proj = (l.mlp_proj_weight, l.mlp_proj_bias);
        kernels.extend(self.product(Product::MlpProj, (s.proj, s.kept.fch_gelu), mlp_proj));
        self.out.extend(kernels);
    }

    /// The GELU of `fch`: exact, or also writing its few-bit codes.
    fn gelu(&self) -> Kernel {
        let k = self.s.kept;
        match self.s.approx.bits {
            None => Kernel::Gelu(Gelu {
                out: k.fch_gelu,
                inp: k.fch,
            }),
            Some(bits) => Kernel::FewBitGelu(FewBitGelu {
                out: k.fch_gelu,
                codes: k.codes,
                inp: k.fch,
                bits,
            }),
        }
    }

    /// `out = Sᵀ x` when `project` and the product is sketched with `k` columns.
    fn projection(
        &self,
        project: bool,
        k: Option<usize>,
        x: TensorRef,
        out: TensorRef,
        product: u64,
    ) -> Option<Kernel> {
        let k = k.filter(|_| project)?;
        let seed = sketch_salt(self.layer, product);
        Some(approx::projection(
            x,
            out,
            (self.shape.rows(), k),
            seed,
            self.s.sketch,
        ))
    }

    /// The gradients of a product of its input (N, C) by `weight` (C, OC) given `dout`:
    /// the input's and the bias's exactly, the weight's exactly from the input, or, where
    /// the product is sketched, estimated from the input's projection.
    /// Where product `p` carries an adapter, the adapter's gradients and its share added
    /// to `dinp`; the base's weight and bias get none in a LoRA model.
    fn linear_backward(
        &self,
        (dinp, dout): (TensorRef, TensorRef),
        (p, input): (Product, approx::Input),
        (weight, bias): (Slot, Slot),
        (c, oc): (usize, usize),
    ) -> Vec<Kernel> {
        let mut k = self.base_backward(dinp, dout, input, (weight, bias), (c, oc));
        if let Some(adapter) = self.adapter(p) {
            let approx::Input::Whole(inp) = input else {
                unreachable!("a LoRA model's backward is exact (Model::lora refuses sketches)")
            };
            k.extend(adapter.backward(dinp, dout, inp));
        }
        k
    }

    /// The base's share of [`Program::linear_backward`].
    fn base_backward(
        &self,
        dinp: TensorRef,
        dout: TensorRef,
        input: approx::Input,
        (weight, bias): (Slot, Slot),
        (c, oc): (usize, usize),
    ) -> Vec<Kernel> {
        if !self.train_base {
            return vec![Kernel::MatmulBackward(MatmulBackward {
                dinp,
                weight_grad: None,
                dbias: None,
                dout,
                weight: self.param(Bind::Params, weight),
                layout: WeightLayout::InOut,
                n: self.shape.rows(),
                c,
                oc,
            })];
        }
        let p = approx::Product {
            dims: (self.shape.rows(), c, oc),
            weight: self.param(Bind::Params, weight),
            layout: WeightLayout::InOut,
            dweight: self.grad(Bind::Grads, weight),
            dbias: Some(self.grad(Bind::Grads, bias)),
            sketch: self.s.sketch,
        };
        p.backward(dinp, dout, input)
    }

    /// What the backward of a product of `inp` reads: `inp`, or its projection `proj`
    /// where the product (`product`, of this layer) is sketched with `k` columns.
    fn input(
        &self,
        inp: TensorRef,
        proj: TensorRef,
        k: Option<usize>,
        product: u64,
    ) -> approx::Input {
        approx::Input::of(inp, proj, k, (self.layer, product))
    }

    fn layer(mut self, l: &LayerSlots, pass: Pass) -> Vec<Kernel> {
        let s = self.s;
        if pass.is_forward() {
            // Into the scratch, or (ForwardSave) the saved intermediates into Saved.
            self.layer_body(l, pass == Pass::ForwardSave);
            let out = self.act(Bind::Output);
            self.push(Kernel::Residual(Residual {
                out,
                a: s.kept.res2,
                b: s.proj,
            }));
            return self.out;
        }
        // Backward: recompute the forward from the input (or, from saved activations, only
        // the exact GELU's output), then every gradient, into zeroed parameter gradients.
        let (n, c) = (self.shape.rows(), self.config.width);
        self.zero_grads(Bind::Grads, self.trained_len);
        if pass == Pass::BackwardSaved {
            if s.approx.bits.is_none() {
                let gelu = self.gelu();
                self.push(gelu);
            }
        } else {
            self.layer_body(l, true);
        }
        let (x, dout, dx) = (
            self.act(Bind::Input),
            self.act(Bind::DOutput),
            self.act(Bind::DInput),
        );
        let p = |slot| self.param(Bind::Params, slot);
        let k = s.kept;
        let a = s.approx;
        // out = res2 + mlp(ln2(res2)): dout reaches the MLP's output and res2 directly.
        let gelu_in = self.input(k.fch_gelu, k.gelu_proj, a.proj, SALT_PROJ);
        let mut kernels = self.linear_backward(
            (s.d_fch_gelu, dout),
            (Product::MlpProj, gelu_in),
            (l.mlp_proj_weight, l.mlp_proj_bias),
            (4 * c, c),
        );
        kernels.push(match a.bits {
            None => Kernel::GeluBackward(GeluBackward {
                dinp: s.d_fch,
                inp: k.fch,
                dout: s.d_fch_gelu,
            }),
            Some(bits) => Kernel::FewBitGeluBackward(FewBitGeluBackward {
                dinp: s.d_fch,
                codes: k.codes,
                dout: s.d_fch_gelu,
                bits,
            }),
        });
        let fc_in = self.input(k.ln2, k.ln2_proj, a.fc, SALT_FC);
        kernels.extend(self.linear_backward(
            (s.d_c, s.d_fch),
            (Product::Fc, fc_in),
            (l.c_fc_weight, l.c_fc_bias),
            (c, 4 * c),
        ));
        kernels.extend([
            // d_c2 becomes the gradient of res2: dout plus what flows back through ln_2.
            Kernel::Copy(CopyKernel {
                dst: s.d_c2,
                src: dout,
            }),
            Kernel::LayerNormBackward(LayerNormBackward {
                dinp: s.d_c2,
                params: self.norm_grads(l.ln_2_weight, l.ln_2_bias),
                dout: s.d_c,
                inp: k.res2,
                weight: p(l.ln_2_weight),
                mean: k.ln2_mean,
                rstd: k.ln2_rstd,
                n,
                c,
            }),
        ]);
        // res2 = x + attn(ln1(x)); the attention's output projection is always exact.
        kernels.extend(self.linear_backward(
            (s.d_c, s.d_c2),
            (Product::AttnProj, approx::Input::Whole(k.atty)),
            (l.attn_proj_weight, l.attn_proj_bias),
            (c, c),
        ));
        kernels.push(Kernel::FlashAttentionBackward(FlashAttentionBackward {
            dqkv: s.d_qkv,
            dout: s.d_c,
            qkv: k.qkv,
            out: k.atty,
            lse: k.lse,
            scratch: s.attention,
            b: self.shape.batch,
            t: self.shape.seq,
            c,
            nh: self.config.heads,
            mask: FlashMask::CAUSAL,
        }));
        let attn_in = self.input(k.ln1, k.ln1_proj, a.attn, SALT_ATTN);
        kernels.extend(self.linear_backward(
            (s.d_c, s.d_qkv),
            (Product::Attn, attn_in),
            (l.c_attn_weight, l.c_attn_bias),
            (c, 3 * c),
        ));
        kernels.extend([
            Kernel::Copy(CopyKernel {
                dst: dx,
                src: s.d_c2,
            }),
            Kernel::LayerNormBackward(LayerNormBackward {
                dinp: dx,
                params: self.norm_grads(l.ln_1_weight, l.ln_1_bias),
                dout: s.d_c,
                inp: x,
                weight: p(l.ln_1_weight),
                mean: k.ln1_mean,
                rstd: k.ln1_rstd,
                n,
                c,
            }),
        ]);
        self.out.extend(kernels);
        self.out
    }

    fn head(mut self, h: &HeadSlots, wte: Slot, pass: Pass) -> Vec<Kernel> {
        let s = self.s;
        let (n, c, v) = (self.shape.rows(), self.config.width, self.config.vocab);
        let x = self.act(Bind::Input);
        let targets = self.ids(Bind::Targets);
        if !pass.is_forward() {
            // Every micro-batch's gradients start from zero; the head is the first to
            // write the tied embedding's.
            self.zero_grads(Bind::Grads, self.trained_len);
            self.zero_grads(Bind::TiedGrads, self.tied_len);
        }
        let loss = LossHead {
            inp: s.lnf,
            weight: self.param(Bind::TiedParams, wte),
            dweight: self.train_base.then(|| self.grad(Bind::TiedGrads, wte)),
            logits: s.logits,
            dinp: s.head_d_c,
            targets,
            n,
            c,
            v,
        };
        self.out.push(Kernel::LayerNorm(LayerNorm {
            out: s.lnf,
            mean: s.lnf_mean,
            rstd: s.lnf_rstd,
            inp: x,
            weight: self.param(Bind::Params, h.ln_f_weight),
            bias: self.param(Bind::Params, h.ln_f_bias),
            n,
            c,
        }));
        self.out.extend(loss.forward());
        if pass.is_forward() {
            return self.out;
        }
        let dx = self.act(Bind::DInput);
        self.out.extend(loss.backward());
        let backward = [
            Kernel::Zero(Zero { t: dx }),
            Kernel::LayerNormBackward(LayerNormBackward {
                dinp: dx,
                params: self.norm_grads(h.ln_f_weight, h.ln_f_bias),
                dout: s.head_d_c,
                inp: x,
                weight: self.param(Bind::Params, h.ln_f_weight),
                mean: s.lnf_mean,
                rstd: s.lnf_rstd,
                n,
                c,
            }),
        ];
        self.out.extend(backward);
        self.out
    }
}

/// Reads a GPT-2 `config.json` (already parsed), refusing options strata does not
/// implement.
fn parse_config(path: &Path, json: &Value) -> Result<Gpt2Config, ModelError> {
    let keys = ConfigKeys::new(path, json);
    let config = Gpt2Config {
        layers: keys.size(&["n_layer"])?,
        heads: keys.size(&["n_head"])?,
        width: keys.size(&["n_embd"])?,
        vocab: keys.size(&["vocab_size"])?,
        ctx: keys.size(&["n_positions", "n_ctx"])?,
    };
    let activation = keys.text("activation_function")?.unwrap_or("gelu_new");
    if !matches!(activation, "gelu_new" | "gelu_pytorch_tanh") {
        return Err(keys.error(format!(
            "activation_function `{activation}`; strata implements GELU's tanh approximation \
             (`gelu_new`)"
        )));
    }
    let eps = keys.number("layer_norm_epsilon", 1e-5)?;
    if (eps - 1e-5).abs() > 1e-12 {
        return Err(keys.error(format!("layer_norm_epsilon {eps}; strata uses 1e-5")));
    }
    match keys.optional_size("n_inner")? {
        None => {}
        Some(n) if n == 4 * config.width => {}
        Some(n) => return Err(keys.error(format!("n_inner {n}; strata uses 4 × n_embd"))),
    }
    for (key, default, wanted) in [
        ("tie_word_embeddings", true, true),
        ("scale_attn_weights", true, true),
        ("scale_attn_by_inverse_layer_idx", false, false),
        ("add_cross_attention", false, false),
    ] {
        if keys.flag(key, default)? != wanted {
            return Err(keys.error(format!("{key} is {}; strata needs {wanted}", !wanted)));
        }
    }
    config.validate()?;
    Ok(config)
}

/// `config.json` for `config`, as transformers' `GPT2Config` writes it (no dropout: strata
/// trains without).
pub fn config_json(config: &Gpt2Config) -> Value {
    json!({
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-5,
        "model_type": "gpt2",
        "n_embd": config.width,
        "n_head": config.heads,
        "n_inner": null,
        "n_layer": config.layers,
        "n_positions": config.ctx,
        "vocab_size": config.vocab,
        "scale_attn_weights": true,
        "scale_attn_by_inverse_layer_idx": false,
        "reorder_and_upcast_attn": false,
        "tie_word_embeddings": true,
        "torch_dtype": "float32",
        "use_cache": true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::layout::TENSOR_ALIGN_ELEMENTS;

    #[test]
    fn layouts_cover_every_parameter_once_aligned_and_disjoint() {
        for config in [
            Gpt2Config::tiny(),
            Gpt2Config::gpt2(),
            Gpt2Config::new(3, 3, 9, 7, 5),
        ] {
            let blocks = block_layouts(&config);
            assert_eq!(blocks.len(), config.layers + 2);
            let total: usize = blocks.iter().map(|b| b.param_count()).sum();
            assert_eq!(total, config.param_count());
            for block in &blocks {
                let mut end = 0;
                for t in &block.tensors {
                    assert_eq!(t.slot.offset % TENSOR_ALIGN_ELEMENTS, 0);
                    assert!(t.slot.offset >= end);
                    assert_eq!(t.slot.len, t.shape.iter().product::<usize>());
                    end = t.slot.range().end;
                }
                assert!(end <= block.len && block.len % TENSOR_ALIGN_ELEMENTS == 0);
            }
            let a = LayerSlots::of(&blocks[1]);
            let b = LayerSlots::of(&blocks[config.layers]);
            assert_eq!(a.mlp_proj_weight, b.mlp_proj_weight);
            assert_eq!(
                blocks[1].tensor("h.0.ln_1.bias").unwrap().shape,
                vec![config.width]
            );
        }
    }

    #[test]
    fn programs_stay_inside_their_buffers_and_saved_backwards_read_what_was_saved() {
        let gpt = Gpt2::new(Gpt2Config::new(2, 4, 64, 96, 32)).unwrap();
        let shape = Shape { batch: 2, seq: 16 };
        for (target, dtype) in [(Target::Cpu, Dtype::F32), (Target::Cuda, Dtype::Bf16)] {
            crate::model::checks::check_programs(&gpt, shape, target, dtype);
        }
        for approx in [
            "gelu:3",
            "attn:0.5",
            "mlp:0.25",
            "gelu:1,mlp:0.5",
            "gelu:2,linear:0.5",
        ] {
            let approximate = gpt.approximate(approx.parse().unwrap()).unwrap();
            for target in [Target::Cpu, Target::Cuda] {
                crate::model::checks::check_programs(&*approximate, shape, target, Dtype::F32);
            }
        }
    }

    #[test]
    fn approximate_layers_keep_codes_and_projections_instead_of_what_they_replace() {
        let gpt = Gpt2::new(Gpt2Config::new(2, 4, 64, 96, 32)).unwrap();
        let shape = Shape { batch: 2, seq: 16 };
        let saved = |m: &dyn Family| m.saved_bytes(1, shape, Target::Cpu, Dtype::F32);
        let exact = saved(&gpt);
        // Each tensor of Saved starts at a multiple of 256 bytes; 32 rows, width 64.
        let bytes = |elements: usize| (elements * 4).next_multiple_of(256);
        let (n, c) = (32, 64);
        let with = |approx: &str| saved(&*gpt.approximate(approx.parse().unwrap()).unwrap());
        // attn:0.25 keeps 8 rows of ln1 instead of 32.
        assert_eq!(with("attn:0.25"), exact - bytes(n * c) + bytes(8 * c));
        // mlp alone: ln2 projected; the MLP's c_proj stays exact (fch is kept anyway).
        assert_eq!(with("mlp:0.5"), exact - bytes(n * c) + bytes(16 * c));
        // gelu:3 keeps the GELU's output (as large as fch) and 3 bits per element more.
        let codes = bytes(3 * (4 * n * c) / 32);
        assert_eq!(with("gelu:3"), exact + codes);
        // Both: ln1, ln2 and the GELU's output projected, fch replaced by its codes.
        let both = exact - 2 * bytes(n * c) + 2 * bytes(16 * c) - bytes(4 * n * c)
            + codes
            + bytes(16 * 4 * c);
        assert_eq!(with("gelu:3,linear:0.5"), both);
        let e = gpt.approximate("silu:3".parse().unwrap()).unwrap_err();
        assert!(e.to_string().contains("write gelu:3"), "{e}");
    }
}
