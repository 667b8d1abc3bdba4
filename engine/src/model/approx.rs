//! Approximate backward passes (the lecture notes' approximate gradients): what a model's
//! layers keep for their backward, and so how much memory a kept block takes, traded for
//! gradients that are estimates. [`ApproxBackward`] is the choice, `--approx-backward`'s
//! value; a family reads it when it builds its programs (`Family::approximate`).
//!
//! - **Few-bit activation backward** (`gelu:B` for GPT-2, `silu:B` for the SwiGLU gate of
//!   the Llama family, B = 1..4): the forward keeps a B-bit code of the activation's
//!   input, the backward multiplies by the code's level of a piecewise-constant
//!   derivative (`strata_kernels::kernel::fewbit`).
//! - **Randomized weight gradients** (`attn:R`, `mlp:R`, `linear:R` for both; R in
//!   (0, 1)): a product whose input the backward reads only for its weight gradient
//!   keeps `Sᵀ X` (R × rows of them) instead of `X`, and the backward estimates
//!   `dW ≈ (Sᵀ X)ᵀ (Sᵀ dY)`, S regenerated from a seed (`strata_kernels::kernel::sketch`).
//!   Only products whose input can then go are estimated: an input another kernel's
//!   backward reads anyway (the attention's output, which its own backward reads) is
//!   kept and its product's gradient stays exact. Each family documents which products
//!   that leaves.
//!
//! The exact backward ([`ApproxBackward::EXACT`], the default) builds the same programs
//! as before these options existed.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use strata_kernels::kernel::fewbit::Bits;
use strata_kernels::kernel::{MatmulBackward, SketchProject, SketchWeightGrad, WeightGrad};
use strata_kernels::ops::WeightLayout;
use strata_kernels::program::{Kernel, TensorRef};

use super::ModelError;

/// Which activation a few-bit code stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Activation {
    /// GPT-2's tanh-approximated GELU.
    Gelu,
    /// The SiLU of the Llama family's gated MLP.
    Silu,
}

impl Activation {
    /// Its word in `--approx-backward`.
    pub fn word(self) -> &'static str {
        match self {
            Activation::Gelu => "gelu",
            Activation::Silu => "silu",
        }
    }
}

/// A projection ratio: the sketch keeps `ratio × rows` rows of a product's input.
#[derive(Debug, Clone, Copy)]
pub struct Ratio(f32);

impl Ratio {
    /// `ratio`, refused unless 0 < ratio < 1.
    pub fn new(ratio: f32) -> Result<Ratio, String> {
        if ratio > 0.0 && ratio < 1.0 {
            Ok(Ratio(ratio))
        } else {
            Err(format!(
                "a projection ratio must be above 0 and below 1 (found {ratio}); leave a \
                 layer out to keep its gradient exact"
            ))
        }
    }

    /// The value.
    pub fn get(self) -> f32 {
        self.0
    }

    /// The sketch's columns for `rows` rows: the ratio's share, rounded, at least 1.
    pub fn columns(self, rows: usize) -> usize {
        ((self.0 as f64 * rows as f64).round() as usize).clamp(1, rows.max(1))
    }
}

impl PartialEq for Ratio {
    fn eq(&self, other: &Ratio) -> bool {
        // Always finite and positive: the bits compare as the values do.
        self.0.to_bits() == other.0.to_bits()
    }
}

impl Eq for Ratio {}

impl std::hash::Hash for Ratio {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.0.to_bits().hash(h);
    }
}

/// The approximations a model's backward makes: none ([`ApproxBackward::EXACT`]), or
/// any of a few-bit activation backward and randomized weight gradients of the
/// attention's and the MLP's products.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ApproxBackward {
    /// The activation whose derivative is a few-bit code, and the code's width.
    pub act: Option<(Activation, Bits)>,
    /// The projection ratio of the attention's input products (GPT-2's `c_attn`; the
    /// Llama family's q, k and v projections).
    pub attn: Option<Ratio>,
    /// The projection ratio of the MLP's products.
    pub mlp: Option<Ratio>,
}

impl ApproxBackward {
    /// The exact backward.
    pub const EXACT: ApproxBackward = ApproxBackward {
        act: None,
        attn: None,
        mlp: None,
    };

    /// Whether nothing is approximated.
    pub fn is_exact(&self) -> bool {
        *self == ApproxBackward::EXACT
    }

    /// Whether any weight gradient is a sketch's estimate.
    pub fn sketches(&self) -> bool {
        self.attn.is_some() || self.mlp.is_some()
    }

    /// The code width of a few-bit `activation`, if this asks for it; a refusal if it
    /// asks for another activation than the family's.
    pub fn bits_for(
        &self,
        activation: Activation,
        family: &str,
    ) -> Result<Option<Bits>, ModelError> {
        match self.act {
            None => Ok(None),
            Some((a, bits)) if a == activation => Ok(Some(bits)),
            Some((a, bits)) => Err(ModelError::BadInput(format!(
                "--approx-backward {}:{}: {family}'s activation is {}; write {}:{}",
                a.word(),
                bits.count(),
                activation.word(),
                activation.word(),
                bits.count()
            ))),
        }
    }
}

impl fmt::Display for ApproxBackward {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some((a, bits)) = self.act {
            parts.push(format!("{}:{}", a.word(), bits.count()));
        }
        match (self.attn, self.mlp) {
            (Some(a), Some(m)) if a == m => parts.push(format!("linear:{}", a.get())),
            (attn, mlp) => {
                if let Some(a) = attn {
                    parts.push(format!("attn:{}", a.get()));
                }
                if let Some(m) = mlp {
                    parts.push(format!("mlp:{}", m.get()));
                }
            }
        }
        if parts.is_empty() {
            f.write_str("exact")
        } else {
            f.write_str(&parts.join(","))
        }
    }
}

/// What `--approx-backward` takes, for messages.
pub const APPROX_BACKWARD_FORM: &str = "exact, or a comma-separated list of gelu:BITS or \
     silu:BITS (1 to 4), attn:RATIO, mlp:RATIO and linear:RATIO (both; 0 < RATIO < 1), such \
     as gelu:3,linear:0.5";

impl FromStr for ApproxBackward {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let mut approx = ApproxBackward::EXACT;
        if text == "exact" || text.is_empty() {
            return Ok(approx);
        }
        for part in text.split(',').map(str::trim) {
            let (key, value) = part.split_once(':').ok_or_else(|| {
                format!("`{part}` is not KEY:VALUE; --approx-backward takes {APPROX_BACKWARD_FORM}")
            })?;
            let ratio = || {
                value
                    .parse::<f32>()
                    .map_err(|_| format!("`{part}`: {value} is not a number"))
                    .and_then(Ratio::new)
            };
            let mut set_act = |activation| {
                let bits = value
                    .parse::<usize>()
                    .ok()
                    .and_then(Bits::new)
                    .ok_or_else(|| format!("`{part}`: a few-bit code has 1 to 4 bits"))?;
                replace(&mut approx.act, (activation, bits), "an activation", part)
            };
            match key {
                "gelu" => set_act(Activation::Gelu)?,
                "silu" => set_act(Activation::Silu)?,
                "attn" => replace(&mut approx.attn, ratio()?, "attn", part)?,
                "mlp" => replace(&mut approx.mlp, ratio()?, "mlp", part)?,
                "linear" => {
                    let r = ratio()?;
                    replace(&mut approx.attn, r, "attn", part)?;
                    replace(&mut approx.mlp, r, "mlp", part)?;
                }
                _ => {
                    return Err(format!(
                        "`{key}` is not an approximation; --approx-backward takes \
                         {APPROX_BACKWARD_FORM}"
                    ));
                }
            }
        }
        Ok(approx)
    }
}

/// Sets `slot` to `value`, refusing a second value for it.
fn replace<T>(slot: &mut Option<T>, value: T, what: &str, part: &str) -> Result<(), String> {
    if slot.is_some() {
        return Err(format!("`{part}`: {what} is named twice"));
    }
    *slot = Some(value);
    Ok(())
}

impl Serialize for ApproxBackward {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ApproxBackward {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// A product `out = inp W (+ b)` whose input a family's program may keep only as a
/// sketch, as the kernels of its backward see it: `(N, C)` by `(C, OC)` (`weight` laid
/// out as `layout` says), its gradients' tensors, and where the sketch lives.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Product {
    /// Rows, input channels, output channels.
    pub(crate) dims: (usize, usize, usize),
    pub(crate) weight: TensorRef,
    pub(crate) layout: WeightLayout,
    pub(crate) dweight: TensorRef,
    pub(crate) dbias: Option<TensorRef>,
    /// The scratch region of the sketch and `Sᵀ dY` (f32).
    pub(crate) sketch: TensorRef,
}

/// What a product's backward reads of its input: the input itself, or its projection
/// `Sᵀ inp` of `k` rows, made with the sketch of seed `seed`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Input {
    Whole(TensorRef),
    Sketched {
        proj: TensorRef,
        k: usize,
        seed: u64,
    },
}

impl Input {
    /// `inp` itself, or, where its product is sketched with `k` columns, `proj`, the
    /// projection made with the sketch of that layer's product ([`sketch_salt`]).
    pub(crate) fn of(
        inp: TensorRef,
        proj: TensorRef,
        k: Option<usize>,
        (layer, product): (usize, u64),
    ) -> Input {
        match k {
            None => Input::Whole(inp),
            Some(k) => Input::Sketched {
                proj,
                k,
                seed: sketch_salt(layer, product),
            },
        }
    }
}

impl Product {
    /// The backward given `dout`: `dinp` overwritten and the bias's gradient
    /// accumulated exactly; the weight's accumulated exactly from the input, or
    /// estimated from its projection.
    pub(crate) fn backward(&self, dinp: TensorRef, dout: TensorRef, input: Input) -> Vec<Kernel> {
        let (n, c, oc) = self.dims;
        let exact = |weight_grad| {
            Kernel::MatmulBackward(MatmulBackward {
                dinp,
                weight_grad,
                dbias: self.dbias,
                dout,
                weight: self.weight,
                layout: self.layout,
                n,
                c,
                oc,
            })
        };
        match input {
            Input::Whole(inp) => vec![exact(Some(WeightGrad {
                dweight: self.dweight,
                inp,
            }))],
            Input::Sketched { proj, k, seed } => vec![
                exact(None),
                Kernel::SketchWeightGrad(SketchWeightGrad {
                    dw: self.dweight,
                    dy: dout,
                    x_proj: proj,
                    scratch: self.sketch.slice(0, n * k + k * oc),
                    rows: n,
                    cols_in: c,
                    cols_out: oc,
                    k,
                    seed,
                    layout: self.layout,
                    accumulate: true,
                }),
            ],
        }
    }
}

/// `out = Sᵀ x` (k × cols) for `x` (rows × cols), the sketch of `seed` made in `scratch`.
pub(crate) fn projection(
    x: TensorRef,
    out: TensorRef,
    (rows, k): (usize, usize),
    seed: u64,
    scratch: TensorRef,
) -> Kernel {
    Kernel::SketchProject(SketchProject {
        out,
        x,
        scratch: scratch.slice(0, rows * k),
        rows,
        cols: x.len / rows,
        k,
        seed,
    })
}

/// The salt of a sketch: which layer and which of its products, mixed by the kernels
/// with the step's seed (`Scalars::sketch`), so that every product of every layer draws
/// its own `S`, the same in a micro-batch's forward and backward.
pub(crate) fn sketch_salt(layer: usize, product: u64) -> u64 {
    ((layer as u64) << 8) | product
}

/// The seed of micro-batch `micro`'s sketches in the step that computes batch `batch`
/// (`Scalars::sketch`): different for every micro-batch of every step, the same for its
/// forward and backward, whichever blocks the plan keeps or recomputes, and the same
/// again when a run resumes at that step.
pub fn sketch_step(batch: u64, micro: usize) -> u64 {
    batch.wrapping_mul(1 << 20).wrapping_add(micro as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_form_reads_and_writes_back() {
        for (text, shown) in [
            ("exact", "exact"),
            ("", "exact"),
            ("gelu:3", "gelu:3"),
            ("silu:1,mlp:0.25", "silu:1,mlp:0.25"),
            ("linear:0.5", "linear:0.5"),
            ("attn:0.5, mlp:0.5", "linear:0.5"),
            ("gelu:4,attn:0.125", "gelu:4,attn:0.125"),
        ] {
            let a: ApproxBackward = text.parse().unwrap();
            assert_eq!(a.to_string(), shown, "{text}");
            assert_eq!(shown.parse::<ApproxBackward>().unwrap(), a);
        }
        let a: ApproxBackward = "gelu:2,linear:0.5".parse().unwrap();
        assert_eq!(a.act, Some((Activation::Gelu, Bits::Two)));
        assert_eq!(a.attn.map(Ratio::get), Some(0.5));
        assert!(a.sketches() && !a.is_exact());
    }

    #[test]
    fn malformed_values_are_refused_with_the_form() {
        for (text, says) in [
            ("gelu:5", "1 to 4 bits"),
            ("gelu:0", "1 to 4 bits"),
            ("attn:1", "below 1"),
            ("mlp:0", "above 0"),
            ("mlp:x", "not a number"),
            ("relu:2", "not an approximation"),
            ("gelu", "KEY:VALUE"),
            ("linear:0.5,mlp:0.25", "mlp is named twice"),
            ("gelu:2,silu:2", "an activation is named twice"),
        ] {
            let e = text.parse::<ApproxBackward>().unwrap_err();
            assert!(e.contains(says), "{text}: {e}");
        }
    }

    #[test]
    fn every_micro_batch_of_every_step_has_its_own_seed() {
        let mut seen = std::collections::HashSet::new();
        for batch in 1..200 {
            for micro in 0..64 {
                assert!(seen.insert(sketch_step(batch, micro)), "{batch} {micro}");
            }
        }
    }

    #[test]
    fn a_ratio_keeps_at_least_one_row() {
        let r = Ratio::new(0.5).unwrap();
        assert_eq!(r.columns(128), 64);
        assert_eq!(r.columns(3), 2);
        assert_eq!(Ratio::new(0.01).unwrap().columns(10), 1);
    }
}
