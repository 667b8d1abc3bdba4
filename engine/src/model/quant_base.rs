//! A frozen base stored quantised (QLoRA's, `--quant`): which of a block's tensors are
//! quantised, the packed image a block's base is stored as off the device, the program
//! that dequantises that image into the block's buffer on the device, and the values a
//! quantised base computes with.
//!
//! **What is quantised**: every matrix of a transformer block's frozen base, its linear
//! layers' weights (the q, k, v, o, gate, up and down projections; GPT-2's `c_attn`,
//! `c_proj` and `c_fc`), each tensor on its own, blocks of 64 along the tensor as it is
//! stored. This is what transformers' bitsandbytes integration turns into 4-bit layers
//! for the Llama family; GPT-2's Conv1D weights are stored transposed there, so its
//! blocks run along the other dimension than bitsandbytes' would. Not quantised: the
//! embedding, the head, norms and biases (bitsandbytes keeps them too).
//!
//! **The values**: a quantised tensor computes with its dequantised values, `deq(q(w))`,
//! of `w` as the working precision rounds it (bf16 training quantises the bf16 weights,
//! as bitsandbytes quantises a bf16 model), then rounded to the working precision again
//! (bitsandbytes dequantises into its compute dtype). [`round_trip`] gives them.
//!
//! **The packed image** of a block ([`QuantBlock`]): each tensor of its frozen base in
//! layout order, a quantised one as its parts (NF4: codes, absmax codes, absmax scales,
//! offset; int8: codes, scales), any other as its values in the device's dtype; each part
//! at a multiple of 16 bytes, the whole a multiple of 4 KiB (whole O_DIRECT pages).
//! [`QuantBlock::program`] writes the base's elements of the block's buffer from it: the
//! same values [`round_trip`] gives, whichever device and tier.
//!
//! Not here: the formats and kernels (`strata_kernels::kernel::quant`), where the image
//! lives and when it moves (the plan).

use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use half::bf16;
use strata_kernels::kernel::quant::{INT8_BLOCK, Int8Blocks, Nf4Blocks, reference};
use strata_kernels::kernel::{CopyKernel, Int8Dequantize, Nf4Dequantize};

use super::{Bind, BlockKind, BlockLayout, Dtype, Kernel, Slot, TensorRef, TensorSpec};

/// How a frozen base's matrices are stored: NF4 with double-quantised absmaxes
/// (QLoRA's, about 4.127 bits a parameter) or blockwise int8 (8.5).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum BaseQuant {
    /// NF4, bitsandbytes' `quant_type="nf4", blocksize=64, compress_statistics=True`.
    Nf4,
    /// int8, one f32 scale per 64 values.
    Int8,
}

impl BaseQuant {
    /// Every format, by its name.
    pub const ALL: [BaseQuant; 2] = [BaseQuant::Nf4, BaseQuant::Int8];

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            BaseQuant::Nf4 => "nf4",
            BaseQuant::Int8 => "int8",
        }
    }
}

impl fmt::Display for BaseQuant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether `tensor` of `block` is quantised in a quantised base: a matrix of a
/// transformer block's base (below `frozen` in a LoRA model's; any, in a base model's).
pub fn is_quantised(block: &BlockLayout, tensor: &TensorSpec) -> bool {
    matches!(block.kind, BlockKind::Transformer { .. })
        && tensor.shape.len() == 2
        && (block.frozen == 0 || tensor.slot.offset < block.frozen)
}

/// `params` (block `block`'s values, as the working precision rounds them) with each
/// quantised tensor's values replaced by its dequantised ones, in f32; the caller rounds
/// them to the working precision as it does any value.
pub fn round_trip(block: &BlockLayout, quant: BaseQuant, params: &mut [f32]) {
    let quantised: Vec<&TensorSpec> = block
        .tensors
        .iter()
        .filter(|t| is_quantised(block, t))
        .collect();
    // Each tensor's values dequantised, a tensor a thread at a time on every core.
    let values = {
        let params = &*params;
        each_in_parallel(&quantised, |t| {
            let mut x = params[t.slot.range()].to_vec();
            match quant {
                BaseQuant::Nf4 => {
                    let q = Nf4Blocks::quantize(&x);
                    let (codes, offset) = (&q.codes, q.absmax_offset);
                    reference::dequantize_nf4(&mut x, codes, &q.absmax_q, &q.absmax_scale, offset);
                }
                BaseQuant::Int8 => {
                    let q = Int8Blocks::quantize(&x);
                    reference::dequantize_int8(&mut x, &q.codes, &q.scales);
                }
            }
            x
        })
    };
    for (t, x) in quantised.iter().zip(values) {
        params[t.slot.range()].copy_from_slice(&x);
    }
}

/// Where one tensor of a block's base lies in its packed image (byte offsets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Piece {
    /// NF4: codes, absmax codes, absmax scales (f32), the offset (one f32).
    Nf4 {
        slot: Slot,
        codes: usize,
        absmax_q: usize,
        absmax_scale: usize,
        offset: usize,
    },
    /// int8: codes, scales (f32).
    Int8 {
        slot: Slot,
        codes: usize,
        scales: usize,
    },
    /// Its values in the device's dtype.
    Plain { slot: Slot, at: usize },
}

impl Piece {
    /// The tensor's place in the block.
    fn slot(&self) -> Slot {
        match *self {
            Piece::Nf4 { slot, .. } | Piece::Int8 { slot, .. } | Piece::Plain { slot, .. } => slot,
        }
    }
}

/// One tensor of a base, encoded for its piece of the image.
enum Encoded {
    Nf4(Nf4Blocks),
    Int8(Int8Blocks),
    Plain(Vec<f32>),
}

/// `f` of each of `items`, in order, computed on every core (a thread per core taking
/// the next item in turn).
fn each_in_parallel<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let next = AtomicUsize::new(0);
    let done: Mutex<Vec<Option<R>>> = Mutex::new(items.iter().map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..threads.min(items.len()) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(item) = items.get(i) else { break };
                    let r = f(item);
                    done.lock().expect("no thread panicked holding it")[i] = Some(r);
                }
            });
        }
    });
    done.into_inner()
        .expect("no thread panicked holding it")
        .into_iter()
        .map(|r| r.expect("every item done"))
        .collect()
}

/// Alignment of every part of a packed image, bytes.
const PART_ALIGN: usize = 16;

/// A block's frozen base, quantised: the layout of its packed image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantBlock {
    /// The device's dtype: what plain tensors are stored in, and dequantised into.
    dtype: Dtype,
    /// Each tensor of the base, in layout order.
    pieces: Vec<Piece>,
    /// Bytes of the image.
    bytes: usize,
}

impl QuantBlock {
    /// The packed image of `block`'s frozen base in `quant`, its other tensors in `dtype`;
    /// none unless the block has a frozen base below elements that train and a matrix in
    /// it (a LoRA model's adapted transformer block).
    pub fn of(block: &BlockLayout, quant: BaseQuant, dtype: Dtype) -> Option<QuantBlock> {
        let base = || {
            block
                .tensors
                .iter()
                .filter(|t| t.slot.offset < block.frozen)
        };
        if block.frozen == 0 || !block.trains() || !base().any(|t| is_quantised(block, t)) {
            return None;
        }
        let mut end = 0;
        let mut part = |bytes: usize| {
            let at = end;
            end = (end + bytes).next_multiple_of(PART_ALIGN);
            at
        };
        let pieces = base()
            .map(|t| {
                let (slot, len) = (t.slot, t.slot.len);
                match (is_quantised(block, t), quant) {
                    (false, _) => Piece::Plain {
                        slot,
                        at: part(len * dtype.size()),
                    },
                    (true, BaseQuant::Nf4) => Piece::Nf4 {
                        slot,
                        codes: part(len.div_ceil(2)),
                        absmax_q: part(Nf4Blocks::block_count(len)),
                        absmax_scale: part(4 * Nf4Blocks::group_count(len)),
                        offset: part(4),
                    },
                    (true, BaseQuant::Int8) => Piece::Int8 {
                        slot,
                        codes: part(len),
                        scales: part(4 * len.div_ceil(INT8_BLOCK)),
                    },
                }
            })
            .collect();
        Some(QuantBlock {
            dtype,
            pieces,
            bytes: end.next_multiple_of(4096),
        })
    }

    /// Bytes of the packed image (a multiple of 4096).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Writes the packed image of `params` (the block's values, f32, each tensor of its
    /// base first rounded to the working precision by `round`) into `out`
    /// ([`QuantBlock::bytes`] long): quantised once, at load, a tensor a thread at a time
    /// on every core, holding a rounded copy of each tensor in flight alone.
    pub fn pack(&self, params: &[f32], round: &(dyn Fn(&mut [f32]) + Sync), out: &mut [u8]) {
        assert_eq!(out.len(), self.bytes, "a packed image's length");
        let encoded = each_in_parallel(&self.pieces, |piece| {
            let mut x = params[piece.slot().range()].to_vec();
            round(&mut x);
            match piece {
                Piece::Nf4 { .. } => Encoded::Nf4(Nf4Blocks::quantize(&x)),
                Piece::Int8 { .. } => Encoded::Int8(Int8Blocks::quantize(&x)),
                Piece::Plain { .. } => Encoded::Plain(x),
            }
        });
        out.fill(0);
        for (piece, encoded) in self.pieces.iter().zip(encoded) {
            match (*piece, encoded) {
                (
                    Piece::Nf4 {
                        codes,
                        absmax_q,
                        absmax_scale,
                        offset,
                        ..
                    },
                    Encoded::Nf4(q),
                ) => {
                    put(out, codes, &q.codes);
                    put(out, absmax_q, &q.absmax_q);
                    put_f32(out, absmax_scale, &q.absmax_scale);
                    put_f32(out, offset, &[q.absmax_offset]);
                }
                (Piece::Int8 { codes, scales, .. }, Encoded::Int8(q)) => {
                    put(out, codes, &q.codes);
                    put_f32(out, scales, &q.scales);
                }
                (Piece::Plain { at, .. }, Encoded::Plain(x)) => put_values(out, at, &x, self.dtype),
                _ => unreachable!("each piece encoded as its kind"),
            }
        }
    }

    /// The program that writes the base's elements of the block's buffer
    /// ([`Bind::Params`], the device's dtype) from its packed image ([`Bind::Packed`]):
    /// each quantised tensor dequantised (each value rounded to bf16's precision where
    /// `round_bf16`: the CPU device computing in f32 a base trained in bf16), each other
    /// tensor copied.
    pub fn program(&self, round_bf16: bool) -> Vec<Kernel> {
        let bytes = |at: usize, len: usize| TensorRef::new(Bind::Packed as u8, at, len, Dtype::U8);
        let f32s = |at: usize, len: usize| TensorRef::new(Bind::Packed as u8, at, len, Dtype::F32);
        self.pieces
            .iter()
            .map(|piece| match *piece {
                Piece::Nf4 {
                    slot,
                    codes,
                    absmax_q,
                    absmax_scale,
                    offset,
                } => Kernel::Nf4Dequantize(Nf4Dequantize {
                    out: slot.tensor(Bind::Params, self.dtype),
                    codes: bytes(codes, slot.len.div_ceil(2)),
                    absmax_q: bytes(absmax_q, Nf4Blocks::block_count(slot.len)),
                    absmax_scale: f32s(absmax_scale, Nf4Blocks::group_count(slot.len)),
                    absmax_offset: f32s(offset, 1),
                    round_bf16,
                }),
                Piece::Int8 {
                    slot,
                    codes,
                    scales,
                } => Kernel::Int8Dequantize(Int8Dequantize {
                    out: slot.tensor(Bind::Params, self.dtype),
                    codes: bytes(codes, slot.len),
                    scales: f32s(scales, slot.len.div_ceil(INT8_BLOCK)),
                    round_bf16,
                }),
                Piece::Plain { slot, at } => Kernel::Copy(CopyKernel {
                    dst: slot.tensor(Bind::Params, self.dtype),
                    src: TensorRef::new(Bind::Packed as u8, at, slot.len, self.dtype),
                }),
            })
            .collect()
    }
}

/// `src` into `out` at byte `at`.
fn put(out: &mut [u8], at: usize, src: &[u8]) {
    out[at..at + src.len()].copy_from_slice(src);
}

/// `values` into `out` at byte `at`, little-endian f32.
fn put_f32(out: &mut [u8], at: usize, values: &[f32]) {
    for (k, v) in values.iter().enumerate() {
        put(out, at + 4 * k, &v.to_le_bytes());
    }
}

/// `values` into `out` at byte `at` in `dtype` (f32, or bf16 rounded to nearest even).
fn put_values(out: &mut [u8], at: usize, values: &[f32], dtype: Dtype) {
    match dtype {
        Dtype::F32 => put_f32(out, at, values),
        Dtype::Bf16 => {
            for (k, v) in values.iter().enumerate() {
                put(out, at + 2 * k, &bf16::from_f32(*v).to_le_bytes());
            }
        }
        other => panic!("a packed base stores plain tensors in f32 or bf16, not {other}"),
    }
}
