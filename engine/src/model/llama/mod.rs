//! The Llama family: Llama 1/2/3/3.1/3.2, Mistral (v0.3 style), Qwen2/2.5 and Qwen3, one
//! module over the shared kernels. Its shape and `config.json` are in [`LlamaConfig`];
//! the tensors keep Hugging Face's names (`model.embed_tokens.weight`,
//! `model.layers.3.self_attn.q_proj.weight`, `model.norm.weight`, `lm_head.weight`) and
//! `nn.Linear`'s (out, in) layout, which the products read as
//! [`WeightLayout::OutIn`], so loading and saving are copies and nothing is transposed
//! at run time.
//!
//! Blocks: the embedding (`embed_tokens`; no position embedding), one block per layer
//! (RMSNorm, q/k/v projections (Qwen2: with biases), Qwen3's per-head RMSNorm of q and
//! k, rotary embeddings, causal grouped-query attention scaled by 1/sqrt(head_dim), the
//! output projection, residual; RMSNorm, the SiLU-gated MLP, residual), and the head
//! (`norm`, and `lm_head` unless the head is tied to the embedding, in which case the
//! head reads, and its backward adds to, the embedding block's `embed_tokens`).
//!
//! Each layer program builds its rotary table in the scratch first
//! ([`Kernel::RopeTable`]), so the programs read nothing but their bound buffers. A
//! layer's backward recomputes its forward from its input ([`Pass::Backward`]), or, when
//! the planner keeps the block, reads the intermediates its [`Pass::ForwardSave`] left in
//! [`Bind::Saved`] ([`Pass::BackwardSaved`]): every one the backward reads but the
//! rotary table (T x D/2) and the SwiGLU's product (rows x intermediate), which it
//! recomputes, each one cheap kernel. The
//! embedding reuses GPT-2's encoder kernel with a zeroed position table (adding zero is
//! exact), and its backward's position gradient goes to a scratch region nobody reads.
//!
//! A LoRA model of the family ([`Family::lora`], in `lora.rs`) freezes every base tensor
//! and adds to each adapted product its adapter's share, whose `A` and `B` are the only
//! tensors its programs compute gradients of.
//!
//! This is the only place in the engine that knows these models' operations.

mod config;
mod lora;

pub use config::{LlamaConfig, MODEL_TYPES, Variant, preset_names};

use std::path::Path;
use std::sync::Arc;

use serde_json::Value;
use strata_kernels::kernel::attention::{GqaDims, flash_scratch_bytes};
use strata_kernels::kernel::fewbit::{Bits, codes_len};
use strata_kernels::kernel::{
    CopyKernel, DocStarts, Encoder, EncoderBackward, FewBitSwiGlu, FewBitSwiGluBackward, FlashMask,
    GqaFlashAttention, GqaFlashAttentionBackward, Matmul, MatmulBackward, Mul, Residual, RmsNorm,
    RmsNormBackward, Rope, RopeBackward, RopeTable, SwiGlu, SwiGluBackward, WeightGrad, Zero,
};
use strata_kernels::ops::WeightLayout;
use strata_kernels::program::{Dtype, Kernel, Target, TensorRef};

use super::approx::{self, Activation, ApproxBackward, sketch_salt};
use super::gpt2::init::{Init, init_block_with};
use super::head::LossHead;
use super::layout::{BlockKind, BlockLayout, Carve, Slot};
use super::lora::LoraConfig;
use super::lora::kernels::AdapterKernels;
use super::lora::layout::init_adapters;
use super::{Bind, Family, ModelError, Pass, Shape};
use lora::{LayerAdapters, LlamaLora, LoraScratch, Product};

/// A Llama-family model of one shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Llama {
    config: LlamaConfig,
    /// The id that ends a document, when batches are packed ([`Family::packed`]).
    eos: Option<u32>,
    /// What the layers' backward approximates ([`Family::approximate`]).
    approx: ApproxBackward,
    /// The adapters of a LoRA model ([`Family::lora`]): the base then frozen.
    lora: Option<Arc<LlamaLora>>,
    blocks: Vec<BlockLayout>,
    embed: Slot,
    layer: Option<LayerSlots>,
    head: HeadSlots,
}

impl Llama {
    /// The model of shape `config`.
    pub fn new(config: LlamaConfig) -> Result<Self, ModelError> {
        config.validate()?;
        let blocks = block_layouts(&config);
        let last = blocks.len() - 1;
        Ok(Llama {
            eos: None,
            approx: ApproxBackward::EXACT,
            lora: None,
            embed: blocks[0].slot_of("model.embed_tokens.weight"),
            layer: (config.layers > 0).then(|| LayerSlots::of(&blocks[1], &config)),
            head: HeadSlots {
                norm: blocks[last].slot_of("model.norm.weight"),
                lm_head: (!config.tied).then(|| blocks[last].slot_of("lm_head.weight")),
            },
            config,
            blocks,
        })
    }

    /// The shape.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Reads a `config.json` of `model_type` llama, mistral, qwen2 or qwen3.
    pub fn from_hf_config(path: &Path, json: &Value) -> Result<Self, ModelError> {
        Llama::new(LlamaConfig::from_hf(path, json)?)
    }

    fn scratch(&self, shape: Shape, target: Target, dtype: Dtype) -> Scratch {
        let a = Approx::of(self.approx, shape);
        let lora = self.lora.as_deref().map(|l| (l.config.rank, l.any));
        Scratch::new(
            &self.config,
            shape,
            (target, dtype),
            (self.eos.is_some(), a),
            lora,
        )
    }

    /// Layer `layer`'s adapters, with their rank, in a LoRA model.
    fn adapters(&self, layer: usize) -> Option<(&LayerAdapters, usize)> {
        Some(self.lora.as_deref()?.layer(layer))
    }
}

impl Family for Llama {
    fn name(&self) -> &'static str {
        self.config.variant.model_type()
    }

    fn describe(&self) -> String {
        let c = &self.config;
        let name = match c.variant {
            Variant::Llama => "Llama",
            Variant::Mistral => "Mistral",
            Variant::Qwen2 => "Qwen2",
            Variant::Qwen3 => "Qwen3",
        };
        let lora = self.lora.as_deref().map_or(String::new(), |l| {
            format!(
                ", LoRA rank {} alpha {} on {}",
                l.config.rank,
                l.config.alpha,
                l.config.targets.join(",")
            )
        });
        format!(
            "{name} ({} layers, {} wide, {} heads and {} key/value heads of {}, MLP {}, vocab \
             {}, context {}, {} head{lora})",
            c.layers,
            c.width,
            c.heads,
            c.kv_heads,
            c.head_dim,
            c.intermediate,
            c.vocab,
            c.ctx,
            if c.tied { "tied" } else { "untied" }
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

    fn param_count(&self) -> usize {
        self.config.param_count() + self.lora.as_deref().map_or(0, |l| l.params)
    }

    fn tied(&self, block: usize) -> Option<usize> {
        (self.config.tied && block == self.blocks.len() - 1).then_some(0)
    }

    fn check_shape(&self, shape: Shape) -> Result<(), ModelError> {
        let c = &self.config;
        shape.check_addressable(c.vocab, c.intermediate.max(c.q_dim()), c.heads)
    }

    fn scratch_bytes(&self, shape: Shape, target: Target, dtype: Dtype) -> usize {
        self.scratch(shape, target, dtype).bytes
    }

    fn saved_bytes(&self, block: usize, shape: Shape, _target: Target, dtype: Dtype) -> usize {
        match self.blocks[block].kind {
            BlockKind::Transformer { layer } => {
                let a = Approx::of(self.approx, shape);
                Saved::new(&self.config, shape, dtype, (&a, self.adapters(layer))).bytes
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
        let (window, layer) = match kind {
            BlockKind::Transformer { layer } => (self.config.window_of(layer).unwrap_or(0), layer),
            BlockKind::Embedding | BlockKind::Head => (0, 0),
        };
        let adapters = match kind {
            BlockKind::Transformer { layer } => self.adapters(layer),
            BlockKind::Embedding | BlockKind::Head => None,
        };
        if pass.uses_saved() && matches!(kind, BlockKind::Transformer { .. }) {
            let saved = Saved::new(&self.config, shape, dtype, (&s.approx, adapters));
            s = s.with_saved(&saved, adapters.map(|(a, _)| a));
        }
        let p = Program {
            shape,
            c: &self.config,
            layer,
            window,
            eos: self.eos,
            dtype,
            s,
            frozen: self.blocks[block].frozen,
            trained_len: self.blocks[block].trained_len(),
            train_base: self.lora.is_none(),
            adapters: adapters.map(|(a, _)| a),
            lora_scale: self.lora.as_deref().map_or(0.0, |l| l.scale),
            tied_len: self.blocks[0].trained_len(),
            out: Vec::new(),
        };
        match kind {
            BlockKind::Embedding => p.embedding(self.embed, pass),
            BlockKind::Transformer { .. } => p.layer(
                self.layer
                    .as_ref()
                    .expect("a model with layers has their slots"),
                pass,
            ),
            BlockKind::Head => p.head(&self.head, self.embed, pass),
        }
    }

    fn logits(&self, shape: Shape, target: Target, dtype: Dtype) -> Option<TensorRef> {
        Some(self.scratch(shape, target, dtype).logits)
    }

    fn init_block(&self, block: usize, seed: u64) -> Vec<f32> {
        // A LoRA model's base tensors come first, so they get the base's values.
        let mut params = init(&self.blocks[block], seed);
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
        // The layout's names are the files' whole names.
        ""
    }

    fn hf_ignored(&self, name: &str) -> bool {
        // Older checkpoints store the rotary inverse frequencies; a tied model's file
        // may also hold the head's copy of the embedding.
        name.ends_with("rotary_emb.inv_freq") || (self.config.tied && name == "lm_head.weight")
    }

    fn hf_config(&self) -> Value {
        self.config.to_hf()
    }

    fn packed(&self, eos: u32) -> Option<Arc<dyn Family>> {
        Some(Arc::new(Llama {
            eos: Some(eos),
            ..self.clone()
        }))
    }

    fn packing(&self) -> Option<u32> {
        self.eos
    }

    fn approximate(&self, approx: ApproxBackward) -> Result<Arc<dyn Family>, ModelError> {
        if self.lora.is_some() {
            return Err(super::lora::adapted::approximate_refused(approx));
        }
        approx.bits_for(Activation::Silu, "the Llama family")?;
        Ok(Arc::new(Llama {
            approx,
            ..self.clone()
        }))
    }

    fn approximation(&self) -> ApproxBackward {
        self.approx
    }

    fn lora(&self, config: &LoraConfig) -> Result<Arc<dyn Family>, ModelError> {
        let (blocks, lora) = lora::adapt(self, config)?;
        Ok(Arc::new(Llama {
            blocks,
            lora: Some(Arc::new(lora)),
            ..self.clone()
        }))
    }

    fn lora_config(&self) -> Option<&LoraConfig> {
        self.lora.as_deref().map(|l| &l.config)
    }
}

/// What a layer's backward approximates, for one batch shape: the few-bit code's width of
/// the SwiGLU gate's SiLU, and the sketch's columns of the q, k and v projections (attn;
/// they share their input, so one projection of it serves the three) and of the gate and
/// up projections (mlp; likewise). The output projection's input is the attention's
/// output, which the attention's backward reads, and the down projection's is recomputed
/// from what the SwiGLU's backward reads: neither could go, so both stay exact.
///
/// The few-bit SiLU keeps `silu(gate)` and the codes instead of the gate: the SwiGLU's
/// backward reads `silu(gate)` itself (the up projection's gradient), so the codes add
/// `bits` per element to what the exact backward keeps; it saves no memory here, and is
/// built so that the choice is the user's and `strata plan` shows its cost.
#[derive(Debug, Clone, Copy, Default)]
struct Approx {
    bits: Option<Bits>,
    attn: Option<usize>,
    mlp: Option<usize>,
}

impl Approx {
    fn of(approx: ApproxBackward, shape: Shape) -> Approx {
        let n = shape.rows();
        Approx {
            bits: approx.bits_for(Activation::Silu, "").ok().flatten(),
            attn: approx.attn.map(|r| r.columns(n)),
            mlp: approx.mlp.map(|r| r.columns(n)),
        }
    }
}

/// Which product of a layer a sketch belongs to (its seed's salt, with the layer).
const SALT_ATTN: u64 = 0;
const SALT_MLP: u64 = 1;

/// The layouts of every block, in order: embedding, `layers` transformer blocks, head.
fn block_layouts(c: &LlamaConfig) -> Vec<BlockLayout> {
    let (w, q, kv, i, d) = (c.width, c.q_dim(), c.kv_dim(), c.intermediate, c.head_dim);
    let mut blocks = vec![BlockLayout::build(
        BlockKind::Embedding,
        "model.",
        &[("embed_tokens.weight", vec![c.vocab, w])],
    )];
    for layer in 0..c.layers {
        let mut tensors = vec![
            ("input_layernorm.weight", vec![w]),
            ("self_attn.q_proj.weight", vec![q, w]),
            ("self_attn.k_proj.weight", vec![kv, w]),
            ("self_attn.v_proj.weight", vec![kv, w]),
        ];
        if c.qkv_bias {
            tensors.extend([
                ("self_attn.q_proj.bias", vec![q]),
                ("self_attn.k_proj.bias", vec![kv]),
                ("self_attn.v_proj.bias", vec![kv]),
            ]);
        }
        if c.qk_norm {
            tensors.extend([
                ("self_attn.q_norm.weight", vec![d]),
                ("self_attn.k_norm.weight", vec![d]),
            ]);
        }
        tensors.extend([
            ("self_attn.o_proj.weight", vec![w, q]),
            ("post_attention_layernorm.weight", vec![w]),
            ("mlp.gate_proj.weight", vec![i, w]),
            ("mlp.up_proj.weight", vec![i, w]),
            ("mlp.down_proj.weight", vec![w, i]),
        ]);
        blocks.push(BlockLayout::build(
            BlockKind::Transformer { layer },
            &format!("model.layers.{layer}."),
            &tensors,
        ));
    }
    let mut head = vec![("model.norm.weight", vec![w])];
    if !c.tied {
        head.push(("lm_head.weight", vec![c.vocab, w]));
    }
    blocks.push(BlockLayout::build(BlockKind::Head, "", &head));
    blocks
}

/// Transformers' initialisation of the family for training from scratch: linear
/// weights and the embedding normal with deviation 0.02 (`initializer_range`), biases 0,
/// RMSNorm gains 1. One random stream per block, deterministic in `seed`.
fn init(block: &BlockLayout, seed: u64) -> Vec<f32> {
    const STD: f64 = 0.02;
    init_block_with(block, seed, |t| {
        if t.name.ends_with(".bias") {
            Init::Zero
        } else if t.shape.len() == 1 {
            Init::One
        } else {
            Init::Normal(STD)
        }
    })
}

/// A transformer block's tensors (the same offsets in every layer).
#[derive(Debug, Clone, Copy, PartialEq)]
struct LayerSlots {
    input_norm: Slot,
    q: Slot,
    k: Slot,
    v: Slot,
    /// (q, k, v) biases (Qwen2).
    qkv_bias: Option<(Slot, Slot, Slot)>,
    /// (q, k) per-head norms (Qwen3).
    qk_norm: Option<(Slot, Slot)>,
    o: Slot,
    post_norm: Slot,
    gate: Slot,
    up: Slot,
    down: Slot,
}

impl LayerSlots {
    fn of(l: &BlockLayout, c: &LlamaConfig) -> Self {
        let s = |name: &str| l.slot_of(name);
        LayerSlots {
            input_norm: s("input_layernorm.weight"),
            q: s("self_attn.q_proj.weight"),
            k: s("self_attn.k_proj.weight"),
            v: s("self_attn.v_proj.weight"),
            qkv_bias: c.qkv_bias.then(|| {
                (
                    s("self_attn.q_proj.bias"),
                    s("self_attn.k_proj.bias"),
                    s("self_attn.v_proj.bias"),
                )
            }),
            qk_norm: c
                .qk_norm
                .then(|| (s("self_attn.q_norm.weight"), s("self_attn.k_norm.weight"))),
            o: s("self_attn.o_proj.weight"),
            post_norm: s("post_attention_layernorm.weight"),
            gate: s("mlp.gate_proj.weight"),
            up: s("mlp.up_proj.weight"),
            down: s("mlp.down_proj.weight"),
        }
    }
}

/// The head block's tensors.
#[derive(Debug, Clone, Copy, PartialEq)]
struct HeadSlots {
    norm: Slot,
    /// The untied output head (V, C), in the head's own block.
    lm_head: Option<Slot>,
}

/// The scratch: every intermediate tensor of one block for one batch shape. The
/// embedding's, a layer's and the head's regions overlay each other (blocks run one
/// after another on one stream).
#[derive(Debug, Clone, Copy)]
struct Scratch {
    /// What the layer's backward approximates.
    approx: Approx,
    cos: TensorRef,
    sin: TensorRef,
    xn: TensorRef,
    rstd1: TensorRef,
    /// `Sᵀ xn` and `Sᵀ xn2` (empty where the products are exact).
    xn_proj: TensorRef,
    xn2_proj: TensorRef,
    /// The sketch `S` and `Sᵀ dY` of a randomized weight gradient (f32; empty when
    /// every product is exact).
    sketch: TensorRef,
    /// The projections q (B, T, H, D), k and v (B, T, KV, D).
    q: TensorRef,
    k: TensorRef,
    v: TensorRef,
    /// Qwen3's per-head normalised q and k and their rstd.
    qn: TensorRef,
    qn_rstd: TensorRef,
    kn: TensorRef,
    kn_rstd: TensorRef,
    /// q and k after the rotary embedding.
    qr: TensorRef,
    kr: TensorRef,
    atty: TensorRef,
    /// The attention's log-sum-exp per (batch, head, position), f32, for its backward.
    lse: TensorRef,
    attention: TensorRef,
    /// (B, T) u32: each token's document's first position (packed batches; else empty).
    doc_start: TensorRef,
    res2: TensorRef,
    xn2: TensorRef,
    rstd2: TensorRef,
    gate: TensorRef,
    up: TensorRef,
    hmid: TensorRef,
    /// `silu(gate)` and its few-bit codes (u32 words; both empty with the exact SiLU
    /// backward).
    act: TensorRef,
    codes: TensorRef,
    proj: TensorRef,
    d_c: TensorRef,
    d_c2: TensorRef,
    d_c3: TensorRef,
    d_res2: TensorRef,
    d_h: TensorRef,
    d_gate: TensorRef,
    d_up: TensorRef,
    d_atty: TensorRef,
    dq: TensorRef,
    dk: TensorRef,
    dv: TensorRef,
    dq_pre: TensorRef,
    dk_pre: TensorRef,
    dq_lin: TensorRef,
    dk_lin: TensorRef,
    /// The embedding's zero position table (T, C) and its gradient's sink (T, C) f32.
    zero_pos: TensorRef,
    dpos: TensorRef,
    xf: TensorRef,
    rstdf: TensorRef,
    head_d: TensorRef,
    /// (B, T, V): logits after the head's forward; their gradient after its backward.
    logits: TensorRef,
    /// A LoRA model's adapters' tensors (empty otherwise).
    lora: LoraScratch,
    bytes: usize,
}

impl Scratch {
    fn new(
        c: &LlamaConfig,
        shape: Shape,
        (target, dtype): (Target, Dtype),
        (packed, approx): (bool, Approx),
        lora: Option<(usize, [bool; 7])>,
    ) -> Scratch {
        let (n, w, i, v) = (shape.rows(), c.width, c.intermediate, c.vocab);
        let (q, kv, h, kvh) = (c.q_dim(), c.kv_dim(), c.heads, c.kv_heads);
        let f32 = Dtype::F32;
        let mut layer = Carve::new(Bind::Scratch);
        let mut l = |len, dt| layer.take(len, dt);
        let half = shape.seq * c.head_dim / 2;
        let (cos, sin) = (l(half, dtype), l(half, dtype));
        let (xn, rstd1) = (l(n * w, dtype), l(n, f32));
        let (sq, sk, sv) = (l(n * q, dtype), l(n * kv, dtype), l(n * kv, dtype));
        // Qwen3's normalised q and k (empty otherwise).
        let norm = |len: usize| if c.qk_norm { len } else { 0 };
        let (qn, qn_rstd) = (l(norm(n * q), dtype), l(norm(n * h), f32));
        let (kn, kn_rstd) = (l(norm(n * kv), dtype), l(norm(n * kvh), f32));
        let (qr, kr) = (l(n * q, dtype), l(n * kv, dtype));
        let atty = l(n * q, dtype);
        let lse = l(shape.batch * h * shape.seq, f32);
        let attention = l(
            flash_scratch_bytes(target, attention_dims(c, shape)),
            Dtype::U8,
        );
        let doc_start = l(if packed { n } else { 0 }, Dtype::U32);
        let res2 = l(n * w, dtype);
        let (xn2, rstd2) = (l(n * w, dtype), l(n, f32));
        let (gate, up, hmid) = (l(n * i, dtype), l(n * i, dtype), l(n * i, dtype));
        let act = l(approx.bits.map_or(0, |_| n * i), dtype);
        let codes = l(approx.bits.map_or(0, |b| codes_len(n * i, b)), Dtype::U32);
        let proj = l(n * w, dtype);
        let (d_c, d_c2, d_c3, d_res2) = (
            l(n * w, dtype),
            l(n * w, dtype),
            l(n * w, dtype),
            l(n * w, dtype),
        );
        let (d_h, d_gate, d_up) = (l(n * i, dtype), l(n * i, dtype), l(n * i, dtype));
        let d_atty = l(n * q, dtype);
        let (dq, dk, dv) = (l(n * q, dtype), l(n * kv, dtype), l(n * kv, dtype));
        let (dq_pre, dk_pre) = (l(n * q, dtype), l(n * kv, dtype));
        let (dq_lin, dk_lin) = (l(norm(n * q), dtype), l(norm(n * kv), dtype));
        let xn_proj = l(approx.attn.map_or(0, |k| k * w), dtype);
        let xn2_proj = l(approx.mlp.map_or(0, |k| k * w), dtype);
        // The largest sketch: S (n x k) and Sᵀ dY (k x its product's outputs).
        let sketch = [(approx.attn, q.max(kv)), (approx.mlp, i)]
            .into_iter()
            .map(|(k, out)| k.map_or(0, |k| n * k + k * out))
            .max()
            .unwrap_or(0);
        let sketch = l(sketch, f32);
        let widest = w.max(q).max(i);
        let lora = LoraScratch::new(&mut layer, (n, widest), lora, dtype);
        let mut embedding = Carve::new(Bind::Scratch);
        let zero_pos = embedding.take(shape.seq * w, dtype);
        let dpos = embedding.take(shape.seq * w, f32);
        let mut head = Carve::new(Bind::Scratch);
        let mut hd = |len, dt| head.take(len, dt);
        let (xf, rstdf) = (hd(n * w, dtype), hd(n, f32));
        let (head_d, logits) = (hd(n * w, dtype), hd(n * v, dtype));
        Scratch {
            approx,
            cos,
            sin,
            xn,
            rstd1,
            xn_proj,
            xn2_proj,
            sketch,
            q: sq,
            k: sk,
            v: sv,
            qn,
            qn_rstd,
            kn,
            kn_rstd,
            qr,
            kr,
            atty,
            lse,
            attention,
            doc_start,
            res2,
            xn2,
            rstd2,
            gate,
            up,
            hmid,
            act,
            codes,
            proj,
            d_c,
            d_c2,
            d_c3,
            d_res2,
            d_h,
            d_gate,
            d_up,
            d_atty,
            dq,
            dk,
            dv,
            dq_pre,
            dk_pre,
            dq_lin,
            dk_lin,
            zero_pos,
            dpos,
            xf,
            rstdf,
            head_d,
            logits,
            lora,
            bytes: layer.next.max(head.next).max(embedding.next),
        }
    }
}

/// A layer's saved activations: the intermediates its backward reads, at their offsets
/// in the buffer bound at [`Bind::Saved`]. Not among them: the rotary table and the
/// SwiGLU's product `hmid`, which the saved backward recomputes (one cheap kernel each;
/// `hmid` is rows x intermediate, as large as `gate` or `up`).
#[derive(Debug, Clone, Copy)]
struct Saved {
    /// The attention's input, or its projection where q, k and v are sketched (empty in
    /// a LoRA layer without an adapter on q, k or v: nothing reads it).
    xn: TensorRef,
    rstd1: TensorRef,
    /// Qwen3's q and k before their per-head norms, and the norms' rstd (none
    /// otherwise: the backward reads them only through those norms).
    qk_norm: Option<[TensorRef; 4]>,
    qr: TensorRef,
    kr: TensorRef,
    v: TensorRef,
    lse: TensorRef,
    atty: TensorRef,
    res2: TensorRef,
    /// The MLP's input, or its projection where gate and up are sketched (empty in a
    /// LoRA layer without an adapter on gate or up).
    xn2: TensorRef,
    rstd2: TensorRef,
    /// The gate projection, or `silu(gate)` with the few-bit SiLU.
    gate: TensorRef,
    up: TensorRef,
    /// The few-bit codes of the gate (empty with the exact SiLU backward).
    codes: TensorRef,
    /// Each adapted product's `x Aᵀ` in a LoRA model (empty otherwise).
    lora_u: [TensorRef; 7],
    /// Bytes of the whole buffer.
    bytes: usize,
}

impl Saved {
    fn new(
        c: &LlamaConfig,
        shape: Shape,
        dtype: Dtype,
        (a, adapters): (&Approx, Option<(&LayerAdapters, usize)>),
    ) -> Saved {
        let (n, w, i) = (shape.rows(), c.width, c.intermediate);
        let (q, kv, h, kvh) = (c.q_dim(), c.kv_dim(), c.heads, c.kv_heads);
        let f32 = Dtype::F32;
        let mut carve = Carve::new(Bind::Saved);
        let mut l = |len, dt| carve.take(len, dt);
        // A LoRA layer keeps a product's input only where an adapter's gradient reads it.
        let (attn_in, mlp_in) = match adapters {
            Some((ad, _)) => (
                [Product::Q, Product::K, Product::V]
                    .iter()
                    .any(|p| ad.has(*p as usize)),
                [Product::Gate, Product::Up]
                    .iter()
                    .any(|p| ad.has(*p as usize)),
            ),
            None => (true, true),
        };
        let xn_rows = if attn_in { a.attn.map_or(n, |k| k) } else { 0 };
        let (xn, rstd1) = (l(xn_rows * w, dtype), l(n, f32));
        let qk_norm = c.qk_norm.then(|| {
            [
                l(n * q, dtype),
                l(n * kv, dtype),
                l(n * h, f32),
                l(n * kvh, f32),
            ]
        });
        let (qr, kr, v) = (l(n * q, dtype), l(n * kv, dtype), l(n * kv, dtype));
        let lse = l(shape.batch * h * shape.seq, f32);
        let atty = l(n * q, dtype);
        let xn2_rows = if mlp_in { a.mlp.map_or(n, |k| k) } else { 0 };
        let (res2, xn2, rstd2) = (l(n * w, dtype), l(xn2_rows * w, dtype), l(n, f32));
        let (gate, up) = (l(n * i, dtype), l(n * i, dtype));
        let codes = l(a.bits.map_or(0, |b| codes_len(n * i, b)), Dtype::U32);
        let lora_u = super::lora::adapted::saved_u(&mut carve, n, adapters, dtype);
        Saved {
            xn,
            rstd1,
            qk_norm,
            qr,
            kr,
            v,
            lse,
            atty,
            res2,
            xn2,
            rstd2,
            gate,
            up,
            codes,
            lora_u,
            bytes: carve.next,
        }
    }
}

impl Scratch {
    /// The same layout with the saved intermediates in the saved buffer instead: a
    /// [`Pass::ForwardSave`] writes them there, a [`Pass::BackwardSaved`] reads them.
    fn with_saved(self, saved: &Saved, adapters: Option<&LayerAdapters>) -> Scratch {
        let [q, k, qn_rstd, kn_rstd] =
            saved
                .qk_norm
                .unwrap_or([self.q, self.k, self.qn_rstd, self.kn_rstd]);
        let (xn, xn_proj) = match self.approx.attn {
            // Not kept (a LoRA layer whose backward does not read it): the scratch's.
            None if saved.xn.len == 0 => (self.xn, self.xn_proj),
            None => (saved.xn, self.xn_proj),
            Some(_) => (self.xn, saved.xn),
        };
        let (xn2, xn2_proj) = match self.approx.mlp {
            None if saved.xn2.len == 0 => (self.xn2, self.xn2_proj),
            None => (saved.xn2, self.xn2_proj),
            Some(_) => (self.xn2, saved.xn2),
        };
        let (gate, act, codes) = match self.approx.bits {
            None => (saved.gate, self.act, self.codes),
            Some(_) => (self.gate, saved.gate, saved.codes),
        };
        Scratch {
            xn,
            xn_proj,
            xn2,
            xn2_proj,
            gate,
            act,
            codes,
            rstd1: saved.rstd1,
            q,
            k,
            qn_rstd,
            kn_rstd,
            qr: saved.qr,
            kr: saved.kr,
            v: saved.v,
            lse: saved.lse,
            atty: saved.atty,
            res2: saved.res2,
            rstd2: saved.rstd2,
            up: saved.up,
            lora: match adapters {
                Some(a) => self.lora.with_saved(&saved.lora_u, a),
                None => self.lora,
            },
            ..self
        }
    }
}

/// Builds one block's program.
struct Program<'a> {
    shape: Shape,
    c: &'a LlamaConfig,
    /// The transformer layer (0 for the embedding and the head): its sketches' salt.
    layer: usize,
    dtype: Dtype,
    s: Scratch,
    /// The layer's sliding window (0: none).
    window: usize,
    /// The id that ends a document, when batches are packed.
    eos: Option<u32>,
    /// Elements of the block's frozen head (its gradients start after them).
    frozen: usize,
    /// Elements of the block's gradients.
    trained_len: usize,
    /// Whether the base's tensors train (not in a LoRA model).
    train_base: bool,
    /// The layer's adapters, in a LoRA model.
    adapters: Option<&'a LayerAdapters>,
    /// The adapters' scale (`alpha / rank`, or rsLoRA's).
    lora_scale: f32,
    /// Elements of the embedding's gradients (the tied block's).
    tied_len: usize,
    out: Vec<Kernel>,
}

/// The attention's dimensions for a batch of `shape`.
fn attention_dims(c: &LlamaConfig, shape: Shape) -> GqaDims {
    GqaDims {
        b: shape.batch,
        t: shape.seq,
        h: c.heads,
        kv: c.kv_heads,
        d: c.head_dim,
    }
}

impl Program<'_> {
    /// The keys each query sees: causal, within the layer's window.
    fn mask(&self) -> FlashMask {
        FlashMask {
            window: self.window,
            doc_start: self.doc_start(),
        }
    }

    /// Each token's document's first position, when batches are packed.
    fn doc_start(&self) -> Option<TensorRef> {
        self.eos.map(|_| self.s.doc_start)
    }

    /// Finds each token's document ([`Program::doc_start`]) from the token ids, first in
    /// every layer program, when batches are packed.
    fn documents(&mut self) {
        if let Some(eos) = self.eos {
            self.out.push(Kernel::DocStarts(DocStarts {
                doc_start: self.s.doc_start,
                tokens: self.ids(Bind::Tokens),
                eos,
                b: self.shape.batch,
                t: self.shape.seq,
            }));
        }
    }

    /// `slot` of the parameters bound at `bind`, in the working dtype.
    fn param(&self, bind: Bind, slot: Slot) -> TensorRef {
        slot.tensor(bind, self.dtype)
    }

    /// Product `p` (`out = inp Wᵀ (+ bias)`) and, where it carries an adapter, the
    /// adapter's share added to `out`.
    fn product(
        &self,
        p: Product,
        out: TensorRef,
        inp: TensorRef,
        (weight, bias): (Slot, Option<Slot>),
    ) -> Vec<Kernel> {
        let mut k = vec![self.linear(out, inp, weight, bias)];
        if let Some(adapter) = self.adapter(p) {
            k.extend(adapter.forward(out, inp));
        }
        k
    }

    /// The backward of [`Program::product`]: `dinp` overwritten (the base's share, then
    /// the adapter's added), the base's gradients where it trains, the adapter's.
    fn product_backward(
        &self,
        p: Product,
        (dinp, dout): (TensorRef, TensorRef),
        input: approx::Input,
        (weight, bias): (Slot, Option<Slot>),
    ) -> Vec<Kernel> {
        let mut k = self.sketched_backward(dinp, dout, input, weight, bias);
        if let Some(adapter) = self.adapter(p) {
            let approx::Input::Whole(inp) = input else {
                unreachable!("a LoRA model's backward is exact (Model::lora refuses sketches)")
            };
            k.extend(adapter.backward(dinp, dout, inp));
        }
        k
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

    /// The gradient of a base tensor, where the base trains (not in a LoRA model).
    fn base_grad(&self, bind: Bind, slot: Slot) -> Option<TensorRef> {
        self.train_base.then(|| self.grad(bind, slot))
    }

    /// A whole activation buffer (B, T, C).
    fn act(&self, bind: Bind) -> TensorRef {
        TensorRef::new(bind as u8, 0, self.shape.rows() * self.c.width, self.dtype)
    }

    /// Token ids (B, T) bound at `bind`.
    fn ids(&self, bind: Bind) -> TensorRef {
        TensorRef::new(bind as u8, 0, self.shape.rows(), Dtype::U32)
    }

    /// Zeroes the whole gradient buffer bound at `bind` of `len` elements (none for a
    /// block that trains nothing).
    fn zero_grads(&mut self, bind: Bind, len: usize) {
        if len > 0 {
            self.out.push(Kernel::Zero(Zero {
                t: TensorRef::new(bind as u8, 0, len, Dtype::F32),
            }));
        }
    }

    /// `out = inp @ W^T (+ bias)` with W (oc, c) as `nn.Linear` stores it.
    fn linear(&self, out: TensorRef, inp: TensorRef, weight: Slot, bias: Option<Slot>) -> Kernel {
        let n = self.shape.rows();
        Kernel::Matmul(Matmul {
            out,
            inp,
            weight: self.param(Bind::Params, weight),
            bias: bias.map(|b| self.param(Bind::Params, b)),
            layout: WeightLayout::OutIn,
            n,
            c: inp.len / n,
            oc: out.len / n,
        })
    }

    /// The gradients of [`Program::linear`]: `dinp` overwritten, the weight's (and
    /// bias's) gradients accumulated where the base trains.
    fn linear_backward(
        &self,
        dinp: TensorRef,
        dout: TensorRef,
        inp: TensorRef,
        weight: Slot,
        bias: Option<Slot>,
    ) -> Kernel {
        let n = self.shape.rows();
        Kernel::MatmulBackward(MatmulBackward {
            dinp,
            weight_grad: self
                .base_grad(Bind::Grads, weight)
                .map(|dweight| WeightGrad { dweight, inp }),
            dbias: bias.and_then(|b| self.base_grad(Bind::Grads, b)),
            dout,
            weight: self.param(Bind::Params, weight),
            layout: WeightLayout::OutIn,
            n,
            c: inp.len / n,
            oc: dout.len / n,
        })
    }

    /// [`Program::linear_backward`] of a product whose input may be sketched: then the
    /// weight's gradient is estimated from the input's projection and the input's
    /// gradient stays exact.
    fn sketched_backward(
        &self,
        dinp: TensorRef,
        dout: TensorRef,
        input: approx::Input,
        weight: Slot,
        bias: Option<Slot>,
    ) -> Vec<Kernel> {
        if let approx::Input::Whole(inp) = input {
            return vec![self.linear_backward(dinp, dout, inp, weight, bias)];
        }
        let (n, oc) = (self.shape.rows(), dout.len / self.shape.rows());
        let p = approx::Product {
            dims: (n, weight.len / oc, oc),
            weight: self.param(Bind::Params, weight),
            layout: WeightLayout::OutIn,
            dweight: self.grad(Bind::Grads, weight),
            dbias: bias.map(|b| self.grad(Bind::Grads, b)),
            sketch: self.s.sketch,
        };
        p.backward(dinp, dout, input)
    }

    /// `out = Sᵀ x` when `project` and the product is sketched with `k` columns.
    fn projection(
        &self,
        project: bool,
        k: Option<usize>,
        (x, out): (TensorRef, TensorRef),
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

    fn rmsnorm(&self, out: TensorRef, rstd: TensorRef, inp: TensorRef, weight: Slot) -> Kernel {
        Kernel::RmsNorm(RmsNorm {
            out,
            rstd,
            inp,
            weight: self.param(Bind::Params, weight),
            eps: self.c.eps,
            n: rstd.len,
            c: inp.len / rstd.len,
        })
    }

    fn rmsnorm_backward(
        &self,
        dinp: TensorRef,
        dout: TensorRef,
        inp: TensorRef,
        rstd: TensorRef,
        weight: Slot,
    ) -> Kernel {
        Kernel::RmsNormBackward(RmsNormBackward {
            dinp,
            dweight: self.base_grad(Bind::Grads, weight),
            dout,
            inp,
            weight: self.param(Bind::Params, weight),
            rstd,
            n: rstd.len,
            c: inp.len / rstd.len,
        })
    }

    fn rope(&self, out: TensorRef, inp: TensorRef, heads: usize, backward: bool) -> Kernel {
        let (b, t, d, s) = (self.shape.batch, self.shape.seq, self.c.head_dim, self.s);
        if backward {
            Kernel::RopeBackward(RopeBackward {
                dinp: out,
                dout: inp,
                cos: s.cos,
                sin: s.sin,
                doc_start: self.doc_start(),
                b,
                t,
                h: heads,
                d,
            })
        } else {
            Kernel::Rope(Rope {
                out,
                inp,
                cos: s.cos,
                sin: s.sin,
                doc_start: self.doc_start(),
                b,
                t,
                h: heads,
                d,
            })
        }
    }

    fn embedding(mut self, embed: Slot, pass: Pass) -> Vec<Kernel> {
        let (b, t, c, s) = (self.shape.batch, self.shape.seq, self.c.width, self.s);
        let tokens = self.ids(Bind::Tokens);
        match pass {
            Pass::Forward | Pass::ForwardSave => {
                self.out.push(Kernel::Zero(Zero { t: s.zero_pos }));
                self.out.push(Kernel::Encoder(Encoder {
                    out: self.act(Bind::Output),
                    tokens,
                    wte: self.param(Bind::Params, embed),
                    wpe: s.zero_pos,
                    b,
                    t,
                    c,
                }));
            }
            Pass::Backward | Pass::BackwardSaved if !self.train_base => {
                // A LoRA model's embedding is frozen: nothing to compute.
            }
            Pass::Backward | Pass::BackwardSaved => {
                // A tied head zeroed this block's gradients and added its own; an
                // untied model's embedding is the only writer.
                if !self.c.tied {
                    self.zero_grads(Bind::Grads, self.trained_len);
                }
                self.out.push(Kernel::Zero(Zero { t: s.dpos }));
                self.out.push(Kernel::EncoderBackward(EncoderBackward {
                    dwte: self.grad(Bind::Grads, embed),
                    dwpe: s.dpos,
                    dout: self.act(Bind::DOutput),
                    tokens,
                    b,
                    t,
                    c,
                }));
            }
        }
        self.out
    }

    /// The rotary table (cos, sin) of the sequence, into the scratch.
    fn rope_table(&self) -> Kernel {
        Kernel::RopeTable(RopeTable {
            cos: self.s.cos,
            sin: self.s.sin,
            t: self.shape.seq,
            d: self.c.head_dim,
            freqs: self.c.rope,
        })
    }

    /// The forward of a layer up to its MLP's output in `proj` (the caller adds the
    /// residual): what the backward recomputes. With `project`, also the projections of
    /// the sketched products' inputs (a forward that keeps only the layer's output skips
    /// them: its backward recomputes them).
    fn layer_body(&mut self, l: &LayerSlots, project: bool) {
        let s = self.s;
        let (c, x) = (self.c, self.act(Bind::Input));
        let (h, kvh) = (c.heads, c.kv_heads);
        let (bq, bk, bv) = match l.qkv_bias {
            Some((q, k, v)) => (Some(q), Some(k), Some(v)),
            None => (None, None, None),
        };
        let mut k = vec![
            self.rope_table(),
            self.rmsnorm(s.xn, s.rstd1, x, l.input_norm),
        ];
        let a = s.approx;
        k.extend(self.projection(project, a.attn, (s.xn, s.xn_proj), SALT_ATTN));
        k.extend(self.product(Product::Q, s.q, s.xn, (l.q, bq)));
        k.extend(self.product(Product::K, s.k, s.xn, (l.k, bk)));
        k.extend(self.product(Product::V, s.v, s.xn, (l.v, bv)));
        let (q_in, k_in) = match l.qk_norm {
            Some((qn, kn)) => {
                k.push(self.rmsnorm(s.qn, s.qn_rstd, s.q, qn));
                k.push(self.rmsnorm(s.kn, s.kn_rstd, s.k, kn));
                (s.qn, s.kn)
            }
            None => (s.q, s.k),
        };
        k.extend([
            self.rope(s.qr, q_in, h, false),
            self.rope(s.kr, k_in, kvh, false),
            Kernel::GqaFlashAttention(GqaFlashAttention {
                out: s.atty,
                lse: s.lse,
                q: s.qr,
                k: s.kr,
                v: s.v,
                scratch: s.attention,
                dims: attention_dims(c, self.shape),
                mask: self.mask(),
            }),
        ]);
        k.extend(self.product(Product::O, s.proj, s.atty, (l.o, None)));
        k.extend([
            Kernel::Residual(Residual {
                out: s.res2,
                a: x,
                b: s.proj,
            }),
            self.rmsnorm(s.xn2, s.rstd2, s.res2, l.post_norm),
        ]);
        k.extend(self.projection(project, a.mlp, (s.xn2, s.xn2_proj), SALT_MLP));
        k.extend(self.product(Product::Gate, s.gate, s.xn2, (l.gate, None)));
        k.extend(self.product(Product::Up, s.up, s.xn2, (l.up, None)));
        k.push(self.swiglu());
        k.extend(self.product(Product::Down, s.proj, s.hmid, (l.down, None)));
        self.out.extend(k);
    }

    /// The SwiGLU's product `hmid` of the gate and up projections: exact, or also writing
    /// `silu(gate)` and the gate's few-bit codes.
    fn swiglu(&self) -> Kernel {
        let s = self.s;
        match s.approx.bits {
            None => Kernel::SwiGlu(SwiGlu {
                out: s.hmid,
                gate: s.gate,
                up: s.up,
            }),
            Some(bits) => Kernel::FewBitSwiGlu(FewBitSwiGlu {
                out: s.hmid,
                act: s.act,
                codes: s.codes,
                gate: s.gate,
                up: s.up,
                bits,
            }),
        }
    }

    /// What a layer's backward recomputes before its gradients: its forward from its
    /// input ([`Pass::Backward`]), or only the rotary table and the down projection's
    /// input where its gradients read it ([`Pass::BackwardSaved`]).
    fn recompute(&mut self, l: &LayerSlots, pass: Pass) {
        let s = self.s;
        if pass == Pass::BackwardSaved {
            let table = self.rope_table();
            self.out.push(table);
            // The down projection's input, where its weight's or adapter's gradient
            // reads it.
            let down_reads =
                self.train_base || self.adapters.is_some_and(|a| a.has(Product::Down as usize));
            if s.approx.bits.is_none() && down_reads {
                let swiglu = self.swiglu();
                self.out.push(swiglu);
            }
        } else {
            self.layer_body(l, true);
        }
        if s.approx.bits.is_some() {
            // The down projection's input from the factors the few-bit backward keeps:
            // the same kernel after either forward, so both backwards read the same bits.
            self.out.push(Kernel::Mul(Mul {
                out: s.hmid,
                a: s.act,
                b: s.up,
            }));
        }
    }

    fn layer(mut self, l: &LayerSlots, pass: Pass) -> Vec<Kernel> {
        let s = self.s;
        self.documents();
        if pass.is_forward() {
            // Into the scratch, or (ForwardSave) the saved intermediates into Saved.
            self.layer_body(l, pass == Pass::ForwardSave);
            let out = self.act(Bind::Output);
            self.out.push(Kernel::Residual(Residual {
                out,
                a: s.res2,
                b: s.proj,
            }));
            return self.out;
        }
        // Backward: recompute the forward from the input (or, from saved activations, only
        // the rotary table and the SwiGLU's product), then every gradient, into zeroed
        // parameter gradients.
        self.zero_grads(Bind::Grads, self.trained_len);
        self.recompute(l, pass);
        let (x, dout, dx) = (
            self.act(Bind::Input),
            self.act(Bind::DOutput),
            self.act(Bind::DInput),
        );
        let (h, kvh) = (self.c.heads, self.c.kv_heads);
        let (bq, bk, bv) = match l.qkv_bias {
            Some((q, k, v)) => (Some(q), Some(k), Some(v)),
            None => (None, None, None),
        };
        // out = res2 + down(silu(gate(xn2)) * up(xn2)), xn2 = norm(res2).
        let mut k = self.product_backward(
            Product::Down,
            (s.d_h, dout),
            approx::Input::Whole(s.hmid),
            (l.down, None),
        );
        k.extend([match s.approx.bits {
            None => Kernel::SwiGluBackward(SwiGluBackward {
                dgate: s.d_gate,
                dup: s.d_up,
                dout: s.d_h,
                gate: s.gate,
                up: s.up,
            }),
            Some(bits) => Kernel::FewBitSwiGluBackward(FewBitSwiGluBackward {
                dgate: s.d_gate,
                dup: s.d_up,
                codes: s.codes,
                dout: s.d_h,
                act: s.act,
                up: s.up,
                bits,
            }),
        }]);
        let a = s.approx;
        let mlp_in = approx::Input::of(s.xn2, s.xn2_proj, a.mlp, (self.layer, SALT_MLP));
        let (gate, up) = ((l.gate, None), (l.up, None));
        k.extend(self.product_backward(Product::Gate, (s.d_c, s.d_gate), mlp_in, gate));
        k.extend(self.product_backward(Product::Up, (s.d_c2, s.d_up), mlp_in, up));
        k.extend([
            Kernel::Residual(Residual {
                out: s.d_c3,
                a: s.d_c,
                b: s.d_c2,
            }),
            // d_res2: dout plus what flows back through the post-attention norm.
            Kernel::Copy(CopyKernel {
                dst: s.d_res2,
                src: dout,
            }),
            self.rmsnorm_backward(s.d_res2, s.d_c3, s.res2, s.rstd2, l.post_norm),
        ]);
        // res2 = x + o(attention(rope(q), rope(k), v)).
        let o_in = approx::Input::Whole(s.atty);
        k.extend(self.product_backward(Product::O, (s.d_atty, s.d_res2), o_in, (l.o, None)));
        k.extend([
            Kernel::GqaFlashAttentionBackward(GqaFlashAttentionBackward {
                dq: s.dq,
                dk: s.dk,
                dv: s.dv,
                dout: s.d_atty,
                q: s.qr,
                k: s.kr,
                v: s.v,
                out: s.atty,
                lse: s.lse,
                scratch: s.attention,
                dims: attention_dims(self.c, self.shape),
                mask: self.mask(),
            }),
            self.rope(s.dq_pre, s.dq, h, true),
            self.rope(s.dk_pre, s.dk, kvh, true),
        ]);
        let (dq_in, dk_in) = match l.qk_norm {
            Some((qn, kn)) => {
                k.extend([
                    Kernel::Zero(Zero { t: s.dq_lin }),
                    self.rmsnorm_backward(s.dq_lin, s.dq_pre, s.q, s.qn_rstd, qn),
                    Kernel::Zero(Zero { t: s.dk_lin }),
                    self.rmsnorm_backward(s.dk_lin, s.dk_pre, s.k, s.kn_rstd, kn),
                ]);
                (s.dq_lin, s.dk_lin)
            }
            None => (s.dq_pre, s.dk_pre),
        };
        let attn_in = approx::Input::of(s.xn, s.xn_proj, a.attn, (self.layer, SALT_ATTN));
        k.extend(self.product_backward(Product::Q, (s.d_c, dq_in), attn_in, (l.q, bq)));
        k.extend(self.product_backward(Product::K, (s.d_c2, dk_in), attn_in, (l.k, bk)));
        k.push(Kernel::Residual(Residual {
            out: s.d_c3,
            a: s.d_c,
            b: s.d_c2,
        }));
        k.extend(self.product_backward(Product::V, (s.d_c, s.dv), attn_in, (l.v, bv)));
        k.extend([
            Kernel::Residual(Residual {
                out: s.d_c2,
                a: s.d_c3,
                b: s.d_c,
            }),
            Kernel::Copy(CopyKernel {
                dst: dx,
                src: s.d_res2,
            }),
            self.rmsnorm_backward(dx, s.d_c2, x, s.rstd1, l.input_norm),
        ]);
        self.out.extend(k);
        self.out
    }

    fn head(mut self, h: &HeadSlots, embed: Slot, pass: Pass) -> Vec<Kernel> {
        let s = self.s;
        let (n, c, v) = (self.shape.rows(), self.c.width, self.c.vocab);
        let x = self.act(Bind::Input);
        let targets = self.ids(Bind::Targets);
        // The output head's weight (V, C): the block's own, or the tied embedding's.
        let (weight, dweight) = match h.lm_head {
            Some(slot) => (
                self.param(Bind::Params, slot),
                self.base_grad(Bind::Grads, slot),
            ),
            None => (
                self.param(Bind::TiedParams, embed),
                self.base_grad(Bind::TiedGrads, embed),
            ),
        };
        if !pass.is_forward() {
            self.zero_grads(Bind::Grads, self.trained_len);
            if h.lm_head.is_none() {
                // The head is the first to write the tied embedding's gradients.
                self.zero_grads(Bind::TiedGrads, self.tied_len);
            }
        }
        let loss = LossHead {
            inp: s.xf,
            weight,
            dweight,
            logits: s.logits,
            dinp: s.head_d,
            targets,
            n,
            c,
            v,
        };
        let norm = self.rmsnorm(s.xf, s.rstdf, x, h.norm);
        self.out.push(norm);
        self.out.extend(loss.forward());
        if pass.is_forward() {
            return self.out;
        }
        let dx = self.act(Bind::DInput);
        self.out.extend(loss.backward());
        let backward = [
            Kernel::Zero(Zero { t: dx }),
            self.rmsnorm_backward(dx, s.head_d, x, s.rstdf, h.norm),
        ];
        self.out.extend(backward);
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::layout::TENSOR_ALIGN_ELEMENTS;

    /// Parameter counts as published for each preset (the models' cards and
    /// `num_parameters()` of their Hugging Face checkpoints).
    #[test]
    fn presets_have_the_published_parameter_counts() {
        for (name, count) in [
            ("llama-3-8b", 8_030_261_248usize),
            ("llama-3.1-8b", 8_030_261_248),
            ("llama-3-70b", 70_553_706_496),
            ("llama-3.2-1b", 1_235_814_400),
            ("llama-3.2-3b", 3_212_749_824),
            ("qwen2.5-0.5b", 494_032_768),
            ("qwen2.5-1.5b", 1_543_714_304),
            ("qwen2.5-3b", 3_085_938_688),
            ("qwen2.5-7b", 7_615_616_512),
            ("qwen3-8b", 8_190_735_360),
            ("mistral-7b", 7_248_023_552),
        ] {
            let config = LlamaConfig::preset(name).unwrap();
            let model = Llama::new(config).unwrap();
            assert_eq!(model.param_count(), count, "{name}");
            let counted: usize = model.blocks().iter().map(|b| b.param_count()).sum();
            assert_eq!(counted, count, "{name}: layouts");
        }
        assert_eq!(preset_names().len(), 11);
        assert!(LlamaConfig::preset("llama-9").is_none());
    }

    #[test]
    fn layouts_are_aligned_disjoint_and_named_as_hugging_face_names_them() {
        for name in ["llama-3.2-1b", "qwen2.5-0.5b", "qwen3-8b"] {
            let mut config = LlamaConfig::preset(name).unwrap();
            config.layers = 2;
            let model = Llama::new(config.clone()).unwrap();
            let blocks = model.blocks();
            assert_eq!(blocks.len(), 4);
            for block in blocks {
                let mut end = 0;
                for t in &block.tensors {
                    assert_eq!(t.slot.offset % TENSOR_ALIGN_ELEMENTS, 0);
                    assert!(t.slot.offset >= end);
                    end = t.slot.range().end;
                }
                assert!(end <= block.len);
            }
            let q = blocks[2]
                .tensor("model.layers.1.self_attn.q_proj.weight")
                .unwrap();
            assert_eq!(q.shape, vec![config.q_dim(), config.width]);
            assert_eq!(
                blocks[1]
                    .tensor("model.layers.0.self_attn.q_proj.bias")
                    .is_some(),
                config.qkv_bias
            );
            assert_eq!(
                blocks[1]
                    .tensor("model.layers.0.self_attn.k_norm.weight")
                    .is_some(),
                config.qk_norm
            );
            assert_eq!(blocks[3].tensor("lm_head.weight").is_some(), !config.tied);
            assert_eq!(model.tied(3), config.tied.then_some(0));
        }
    }

    #[test]
    fn programs_stay_inside_their_buffers_and_saved_backwards_read_what_was_saved() {
        for (variant, tied) in [
            (Variant::Llama, false),
            (Variant::Qwen2, true),
            (Variant::Qwen3, false),
        ] {
            let mut config = LlamaConfig::llama(2, 48, 80, 4, 2, 96, 32);
            config.head_dim = 16;
            config.variant = variant;
            config.tied = tied;
            config.qkv_bias = variant == Variant::Qwen2;
            config.qk_norm = variant == Variant::Qwen3;
            let model = Llama::new(config).unwrap();
            let shape = Shape { batch: 2, seq: 16 };
            for (target, dtype) in [(Target::Cpu, Dtype::F32), (Target::Cuda, Dtype::Bf16)] {
                crate::model::checks::check_programs(&model, shape, target, dtype);
            }
            for approx in [
                "attn:0.5",
                "mlp:0.25",
                "linear:0.5",
                "silu:3",
                "silu:1,mlp:0.5",
            ] {
                let approximate = model.approximate(approx.parse().unwrap()).unwrap();
                for target in [Target::Cpu, Target::Cuda] {
                    crate::model::checks::check_programs(&*approximate, shape, target, Dtype::F32);
                }
            }
        }
    }

    #[test]
    fn sketched_layers_keep_their_inputs_projections_and_a_few_bit_silu_its_codes_more() {
        let model = Llama::new(LlamaConfig::llama(2, 48, 80, 4, 2, 96, 32)).unwrap();
        let shape = Shape { batch: 2, seq: 16 };
        let saved = |m: &dyn Family| m.saved_bytes(1, shape, Target::Cpu, Dtype::F32);
        let exact = saved(&model);
        // 32 rows: ratio 0.25 keeps 8 of them of each sketched input (48 wide, f32).
        let rows_saved = |rows: usize| (rows * 48 * 4).next_multiple_of(256);
        let gone = rows_saved(32) - rows_saved(8);
        let attn = model.approximate("attn:0.25".parse().unwrap()).unwrap();
        assert_eq!(saved(&*attn), exact - gone);
        let both = model.approximate("linear:0.25".parse().unwrap()).unwrap();
        assert_eq!(saved(&*both), exact - 2 * gone);
        // silu:3 keeps silu(gate) where the gate was, and 3 bits per element more.
        let silu = model.approximate("silu:3".parse().unwrap()).unwrap();
        let codes = (3 * (32 * 80) / 32 * 4usize).next_multiple_of(256);
        assert_eq!(saved(&*silu), exact + codes);
        let e = model.approximate("gelu:3".parse().unwrap()).unwrap_err();
        assert!(e.to_string().contains("write silu:3"), "{e}");
    }

    #[test]
    fn each_layer_attends_within_its_window_at_any_sequence_length() {
        // Mistral's window applies to every layer; Qwen's from max_window_layers on.
        for (variant, window_from) in [(Variant::Mistral, 0), (Variant::Qwen2, 1)] {
            let mut config = LlamaConfig::preset("mistral-7b").unwrap();
            config.variant = variant;
            config.qkv_bias = variant == Variant::Qwen2;
            config.sliding_window = Some(4096);
            config.window_from = window_from;
            let llama = Llama::new(config).unwrap();
            let model = crate::model::Model::of(llama.clone());
            assert!(model.shape(1, 8192).is_ok());
            let shape = Shape {
                batch: 1,
                seq: 8192,
            };
            for (block, want) in [(1, window_from == 0), (2, true)] {
                for pass in [Pass::Forward, Pass::Backward] {
                    let windows: Vec<usize> = llama
                        .program(block, pass, shape, Target::Cpu, Dtype::F32)
                        .iter()
                        .filter_map(|k| match k {
                            Kernel::GqaFlashAttention(a) => Some(a.mask.window),
                            Kernel::GqaFlashAttentionBackward(a) => Some(a.mask.window),
                            _ => None,
                        })
                        .collect();
                    let expected = if want { 4096 } else { 0 };
                    assert!(!windows.is_empty());
                    assert!(
                        windows.iter().all(|&w| w == expected),
                        "{variant:?} {block}"
                    );
                }
            }
        }
    }
}
