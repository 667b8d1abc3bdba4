//! The Llama family's LoRA model ([`Family::lora`](crate::model::Family::lora)): which
//! of a layer's seven products carry an adapter, where its `A` and `B` lie, the scratch
//! and saved tensors the adapters add, and the kernels that apply and train them.
//!
//! An adapted product `y = x Wᵀ` becomes `y = x Wᵀ + s · (x Aᵀ) Bᵀ` (s the adapter's
//! scale): `u = x Aᵀ` (rows × rank), `v = u Bᵀ` into a wide scratch tensor, then
//! `y += s · v` ([`AddScaled`]). Its backward, given `dY`: `dv = s · dY` (into the wide
//! tensor, zeroed first), `du = dv B` with `dB += dvᵀ u`, then `dx' = du A` with
//! `dA += duᵀ x`, and `dx += dx'`. `u` is what a saved forward
//! ([`Pass::ForwardSave`](crate::model::Pass::ForwardSave)) keeps for its backward (rows
//! × rank per adapted product); the rest is recomputed or scratch. The base's own
//! gradients are not computed at all (the layer's programs ask for none).

use strata_kernels::kernel::{AddScaled, Matmul, MatmulBackward, WeightGrad, Zero};
use strata_kernels::ops::WeightLayout;
use strata_kernels::program::{Dtype, Kernel, TensorRef};

use crate::model::layout::{BlockLayout, Carve};
use crate::model::lora::layout::{AdapterSlots, adapter_slots, lora_blocks};
use crate::model::lora::{LoraConfig, LoraLayer, select_layers};
use crate::model::{Model, ModelError};

/// A layer's products, in the order the forward computes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Product {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Product {
    const ALL: [Product; 7] = [
        Product::Q,
        Product::K,
        Product::V,
        Product::O,
        Product::Gate,
        Product::Up,
        Product::Down,
    ];

    /// The end of its weight's name.
    fn weight(self) -> &'static str {
        match self {
            Product::Q => "self_attn.q_proj.weight",
            Product::K => "self_attn.k_proj.weight",
            Product::V => "self_attn.v_proj.weight",
            Product::O => "self_attn.o_proj.weight",
            Product::Gate => "mlp.gate_proj.weight",
            Product::Up => "mlp.up_proj.weight",
            Product::Down => "mlp.down_proj.weight",
        }
    }
}

/// Which of one layer's products carry an adapter, and where its `A` and `B` lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct LayerAdapters([Option<AdapterSlots>; 7]);

impl LayerAdapters {
    /// Product `p`'s adapter, if it has one.
    pub(super) fn of(&self, p: Product) -> Option<AdapterSlots> {
        self.0[p as usize]
    }

    /// Whether product `p` has an adapter.
    pub(super) fn has(&self, p: Product) -> bool {
        self.of(p).is_some()
    }
}

/// A Llama-family model's adapters: their settings, their scale and each layer's.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct LlamaLora {
    pub(super) config: LoraConfig,
    pub(super) scale: f32,
    /// Per transformer layer.
    pub(super) layers: Vec<LayerAdapters>,
    /// Which products carry an adapter in some layer (their scratch is laid out).
    pub(super) any: [bool; 7],
    /// The adapters' parameters.
    pub(super) params: usize,
}

/// The blocks and the adapters of the LoRA model with `config` of `base` (a Llama model
/// without adapters, of `blocks` and `layers` transformer layers).
pub(super) fn adapt(
    base: &Model,
    (blocks, layers): (&[BlockLayout], usize),
    config: &LoraConfig,
) -> Result<(Vec<BlockLayout>, LlamaLora), ModelError> {
    let selected = select_layers(base, config)?;
    let blocks = lora_blocks(blocks, &selected, config.rank);
    let per_layer = (0..layers)
        .map(|layer| layer_adapters(&blocks[layer + 1], layer + 1, &selected))
        .collect::<Vec<_>>();
    let any = Product::ALL.map(|p| per_layer.iter().any(|a| a.has(p)));
    let params = blocks
        .iter()
        .flat_map(|b| b.tensors.iter().filter(|t| t.slot.offset >= b.frozen))
        .map(|t| t.slot.len)
        .sum();
    let lora = LlamaLora {
        config: config.clone(),
        scale: config.scale() as f32,
        layers: per_layer,
        any,
        params,
    };
    Ok((blocks, lora))
}

/// The adapters of block `b` (a transformer layer's), of `layers` (the model's).
fn layer_adapters(block: &BlockLayout, b: usize, layers: &[LoraLayer]) -> LayerAdapters {
    let mut out = LayerAdapters::default();
    for layer in layers.iter().filter(|l| l.block == b) {
        let p = Product::ALL
            .into_iter()
            .find(|p| layer.weight.ends_with(p.weight()))
            .expect("select_layers selects a layer's linear weights only");
        out.0[p as usize] = Some(adapter_slots(block, layer));
    }
    out
}

/// The scratch tensors of the adapters: each product's `u = x Aᵀ` (rows × rank; empty
/// where no layer adapts it), the wide tensor (`v`, `dv` and `dx'`, rows × the widest
/// input or output) and `du` (rows × rank).
#[derive(Debug, Clone, Copy)]
pub(super) struct LoraScratch {
    pub(super) u: [TensorRef; 7],
    pub(super) wide: TensorRef,
    pub(super) du: TensorRef,
}

impl LoraScratch {
    /// Laid out by `carve`, for `rows` rows, a product's widest side `widest`, and the
    /// model's adapters (none: every tensor empty).
    pub(super) fn new(
        carve: &mut Carve,
        rows: usize,
        widest: usize,
        lora: Option<(usize, [bool; 7])>,
        dtype: Dtype,
    ) -> LoraScratch {
        let (rank, any) = lora.unwrap_or((0, [false; 7]));
        let u = any.map(|adapted| carve.take(if adapted { rows * rank } else { 0 }, dtype));
        let wide = carve.take(if rank > 0 { rows * widest } else { 0 }, dtype);
        let du = carve.take(rows * rank, dtype);
        LoraScratch { u, wide, du }
    }

    /// The same tensors with the `u` of the products `adapters` adapt in `saved`.
    pub(super) fn with_saved(self, saved: &[TensorRef; 7], adapters: &LayerAdapters) -> Self {
        let mut u = self.u;
        for p in Product::ALL.into_iter().filter(|p| adapters.has(*p)) {
            u[p as usize] = saved[p as usize];
        }
        LoraScratch { u, ..self }
    }
}

/// The saved `u` of each product `adapters` adapts (rows × rank; empty otherwise).
pub(super) fn saved_u(
    carve: &mut Carve,
    rows: usize,
    adapters: Option<(&LayerAdapters, usize)>,
    dtype: Dtype,
) -> [TensorRef; 7] {
    Product::ALL.map(|p| {
        let len = match adapters {
            Some((a, rank)) if a.has(p) => rows * rank,
            _ => 0,
        };
        carve.take(len, dtype)
    })
}

/// One adapted product's tensors, for its kernels: `A` and `B` (rank × in, out × rank)
/// and their gradients, `u` (rows × rank), the wide scratch tensor and `du`.
#[derive(Debug, Clone, Copy)]
pub(super) struct AdapterKernels {
    pub(super) a: TensorRef,
    pub(super) b: TensorRef,
    pub(super) da: TensorRef,
    pub(super) db: TensorRef,
    pub(super) u: TensorRef,
    pub(super) scratch: LoraScratch,
    /// The adapter's scale.
    pub(super) scale: f32,
    pub(super) rows: usize,
}

impl AdapterKernels {
    /// `u = inp Aᵀ`, `v = u Bᵀ`, `out += s · v`.
    pub(super) fn forward(&self, out: TensorRef, inp: TensorRef) -> [Kernel; 3] {
        let v = self.scratch.wide.slice(0, out.len);
        [
            self.product(self.u, inp, self.a),
            self.product(v, self.u, self.b),
            Kernel::AddScaled(AddScaled {
                dst: out,
                src: v,
                factor: self.scale,
            }),
        ]
    }

    /// `dv = s · dout`; `du = dv B`, `dB += dvᵀ u`; `dx' = du A`, `dA += duᵀ inp`;
    /// `dinp += dx'`.
    pub(super) fn backward(&self, dinp: TensorRef, dout: TensorRef, inp: TensorRef) -> [Kernel; 5] {
        let (wide, du) = (self.scratch.wide, self.scratch.du);
        let (dv, dx) = (wide.slice(0, dout.len), wide.slice(0, dinp.len));
        [
            Kernel::Zero(Zero { t: dv }),
            Kernel::AddScaled(AddScaled {
                dst: dv,
                src: dout,
                factor: self.scale,
            }),
            self.product_backward((du, dv), (self.u, self.b), self.db),
            self.product_backward((dx, du), (inp, self.a), self.da),
            Kernel::AddScaled(AddScaled {
                dst: dinp,
                src: dx,
                factor: 1.0,
            }),
        ]
    }

    /// `out = inp weightᵀ`, the weight (out, in) as `nn.Linear` stores it.
    fn product(&self, out: TensorRef, inp: TensorRef, weight: TensorRef) -> Kernel {
        let n = self.rows;
        Kernel::Matmul(Matmul {
            out,
            inp,
            weight,
            bias: None,
            layout: WeightLayout::OutIn,
            n,
            c: inp.len / n,
            oc: out.len / n,
        })
    }

    /// The backward of [`AdapterKernels::product`]: `dinp` overwritten, `dweight` added to.
    fn product_backward(
        &self,
        (dinp, dout): (TensorRef, TensorRef),
        (inp, weight): (TensorRef, TensorRef),
        dweight: TensorRef,
    ) -> Kernel {
        let n = self.rows;
        Kernel::MatmulBackward(MatmulBackward {
            dinp,
            weight_grad: Some(WeightGrad { dweight, inp }),
            dbias: None,
            dout,
            weight,
            layout: WeightLayout::OutIn,
            n,
            c: inp.len / n,
            oc: dout.len / n,
        })
    }
}

/// Checks of the LoRA model, beside the family's own tests.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::llama::{Llama, LlamaConfig, Variant};
    use crate::model::{Bind, Pass, Shape};
    use crate::model::{BlockKind, Family, Target};

    fn config(targets: &[&str]) -> LoraConfig {
        LoraConfig::new(4, 8.0, 0.0, targets.iter().map(|t| t.to_string()).collect()).unwrap()
    }

    fn tiny(variant: Variant, tied: bool) -> Llama {
        let mut c = LlamaConfig::llama(2, 48, 80, 4, 2, 96, 32);
        c.head_dim = 16;
        c.variant = variant;
        c.tied = tied;
        c.qkv_bias = variant == Variant::Qwen2;
        c.qk_norm = variant == Variant::Qwen3;
        Llama::new(c).unwrap()
    }

    #[test]
    fn lora_programs_stay_inside_the_trained_tail_and_saved_backwards_read_what_was_saved() {
        let shape = Shape { batch: 2, seq: 16 };
        for (variant, tied) in [
            (Variant::Llama, false),
            (Variant::Qwen2, true),
            (Variant::Qwen3, false),
        ] {
            let base = tiny(variant, tied);
            for targets in [
                &["q_proj", "v_proj"][..],
                &["all-linear"],
                &["o_proj", "down_proj"],
                &["layers.1.mlp.gate_proj"],
            ] {
                let lora = base.lora(&config(targets)).unwrap();
                for (target, dtype) in [(Target::Cpu, Dtype::F32), (Target::Cuda, Dtype::Bf16)] {
                    crate::model::checks::check_programs(&*lora, shape, target, dtype);
                }
                let packed = lora.packed(0).unwrap();
                crate::model::checks::check_programs(&*packed, shape, Target::Cpu, Dtype::F32);
            }
        }
    }

    #[test]
    fn frozen_blocks_train_nothing_and_adapted_ones_only_their_adapters() {
        let base = tiny(Variant::Llama, false);
        let lora = base.lora(&config(&["layers.1.self_attn.v_proj"])).unwrap();
        let blocks = lora.blocks();
        // The embedding, the head and layer 0 train nothing; layer 1 its v_proj's A and B.
        for b in [0, 1, 3] {
            assert_eq!(blocks[b], {
                let mut frozen = base.blocks()[b].clone();
                frozen.frozen = frozen.len;
                frozen
            });
        }
        let layer = &blocks[2];
        assert_eq!(layer.frozen, base.blocks()[2].len);
        assert_eq!(
            layer.tensors[..base.blocks()[2].tensors.len()],
            base.blocks()[2].tensors
        );
        let tail: Vec<_> = layer.tensors[base.blocks()[2].tensors.len()..]
            .iter()
            .map(|t| (t.name.as_str(), t.shape.clone()))
            .collect();
        assert_eq!(
            tail,
            [
                ("model.layers.1.self_attn.v_proj.lora_A.weight", vec![4, 48]),
                ("model.layers.1.self_attn.v_proj.lora_B.weight", vec![32, 4]),
            ]
        );
        assert_eq!(lora.param_count(), base.param_count() + 4 * 48 + 32 * 4);
        // The embedding's backward computes nothing; the frozen layer's writes no gradient.
        let shape = Shape { batch: 1, seq: 8 };
        assert!(
            lora.program(0, Pass::Backward, shape, Target::Cpu, Dtype::F32)
                .is_empty()
        );
        for pass in [Pass::Backward, Pass::BackwardSaved] {
            for b in [1, 3] {
                let program = lora.program(b, pass, shape, Target::Cpu, Dtype::F32);
                let mut grads = 0;
                for k in &program {
                    k.for_each_tensor(|t, _| grads += usize::from(t.buf == Bind::Grads as u8));
                }
                assert_eq!(grads, 0, "block {b} {pass:?}");
            }
        }
    }

    #[test]
    fn lora_is_refused_twice_with_sketches_and_for_targets_outside_the_layers() {
        let base = Model::of(tiny(Variant::Llama, false));
        let lora = base.lora(&config(&["q_proj"])).unwrap();
        let e = lora.lora(&config(&["q_proj"])).unwrap_err().to_string();
        assert!(e.contains("already has LoRA adapters"), "{e}");
        let e = lora
            .approximate("attn:0.5".parse().unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("LoRA"), "{e}");
        let sketched = base.approximate("mlp:0.5".parse().unwrap()).unwrap();
        let e = sketched.lora(&config(&["q_proj"])).unwrap_err().to_string();
        assert!(e.contains("drop --approx-backward"), "{e}");
        let mut dropout = config(&["q_proj"]);
        dropout.dropout = 0.1;
        let e = base.lora(&dropout).unwrap_err().to_string();
        assert!(e.contains("--lora-dropout 0"), "{e}");
        let e = base.lora(&config(&["lm_head"])).unwrap_err().to_string();
        assert!(e.contains("outside the transformer blocks"), "{e}");
        assert_ne!(lora, base);
        assert_eq!(lora.lora_config(), Some(&config(&["q_proj"])));
    }

    #[test]
    fn the_saved_forward_keeps_each_adapted_products_u_and_only_the_inputs_adapters_read() {
        let base = tiny(Variant::Llama, false);
        let lora = base.lora(&config(&["q_proj", "down_proj"])).unwrap();
        let shape = Shape { batch: 2, seq: 16 };
        let saved = |m: &dyn Family, b| m.saved_bytes(b, shape, Target::Cpu, Dtype::F32);
        // 32 rows × rank 4 in f32 per adapted product, each carved to 256 bytes; not the
        // MLP's input (32 × 48), which only gate's and up's gradients read.
        let u = (32 * 4 * 4usize).next_multiple_of(256);
        let xn2 = 32 * 48 * 4;
        assert_eq!(saved(&*lora, 1), saved(&base, 1) + 2 * u - xn2);
        // Adapters on the MLP's input keep it; none keeps neither input.
        let mlp = base.lora(&config(&["up_proj"])).unwrap();
        assert_eq!(saved(&*mlp, 1), saved(&base, 1) + u - xn2);
        let other_layer = base.lora(&config(&["layers.1.self_attn.q_proj"])).unwrap();
        assert_eq!(saved(&*other_layer, 1), saved(&base, 1) - 2 * xn2);
        assert!(matches!(
            lora.blocks()[1].kind,
            BlockKind::Transformer { layer: 0 }
        ));
    }
}
