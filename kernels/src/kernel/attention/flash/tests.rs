//! The fused kernels' launch sequences under the emulator: what the CUDA runner needs of
//! them, the `.cu` kernels as they read (f32), and their agreement with the CPU op on odd
//! sizes, windows and document layouts, for grouped-query attention's separate q, k, v
//! and GPT-2's fused qkv.

use super::*;
use crate::cuda::launch::tests::{
    Emulated, Emulator, Layout, check_emulation, count_arg, ptr_arg, random_inputs, run_on, scalars,
};
use crate::kernel::Kernel;
use crate::kernel::attention::{FlashAttention, FlashAttentionBackward};

/// (B, T, H, KV, D) of the grouped-query samples.
const SIZES: [(usize, usize, usize, usize, usize); 4] = [
    (2, 7, 6, 2, 12),
    (1, 9, 3, 3, 5),
    (1, 1, 2, 1, 4),
    (0, 3, 4, 2, 4),
];

/// (B, T, C, NH) of GPT-2's samples.
const GPT2_SIZES: [(usize, usize, usize, usize); 3] = [(2, 7, 12, 3), (1, 1, 4, 1), (0, 3, 4, 2)];

/// The masks of the samples: none, a window, documents (a u32 tensor of `l`).
fn masks(l: &mut Layout, b: usize, t: usize) -> [FlashMask; 3] {
    let doc_start = Some(l.tensor(b * t, Dtype::U32));
    [
        FlashMask::CAUSAL,
        FlashMask {
            window: 3,
            doc_start: None,
        },
        FlashMask {
            window: 0,
            doc_start,
        },
    ]
}

/// Scratch for both runners.
fn scratch(l: &mut Layout, dims: GqaDims) -> TensorRef {
    let bytes = flash_scratch_bytes(Target::Cpu, dims).max(flash_scratch_bytes(Target::Cuda, dims));
    l.tensor(bytes, Dtype::U8)
}

fn forward(l: &mut Layout, w: Dtype, dims: GqaDims, mask: FlashMask) -> GqaFlashAttention {
    let GqaDims { b, t, h, .. } = dims;
    GqaFlashAttention {
        out: l.tensor(dims.q_len(), w),
        lse: l.tensor(b * h * t, Dtype::F32),
        q: l.tensor(dims.q_len(), w),
        k: l.tensor(dims.kv_len(), w),
        v: l.tensor(dims.kv_len(), w),
        scratch: scratch(l, dims),
        dims,
        mask,
    }
}

/// The backward of `f`, reading its inputs and outputs.
fn backward(l: &mut Layout, f: &GqaFlashAttention) -> GqaFlashAttentionBackward {
    let (w, dims) = (f.out.dtype, f.dims);
    GqaFlashAttentionBackward {
        dq: l.tensor(dims.q_len(), w),
        dk: l.tensor(dims.kv_len(), w),
        dv: l.tensor(dims.kv_len(), w),
        dout: l.tensor(dims.q_len(), w),
        q: f.q,
        k: f.k,
        v: f.v,
        out: f.out,
        lse: f.lse,
        scratch: scratch(l, dims),
        dims,
        mask: f.mask,
    }
}

fn gpt2_dims((b, t, c, nh): (usize, usize, usize, usize)) -> GqaDims {
    GqaDims::multi_head(b, t, c, nh)
}

fn gpt2_forward(
    l: &mut Layout,
    w: Dtype,
    (b, t, c, nh): (usize, usize, usize, usize),
    mask: FlashMask,
) -> FlashAttention {
    FlashAttention {
        out: l.tensor(b * t * c, w),
        lse: l.tensor(b * nh * t, Dtype::F32),
        qkv: l.tensor(3 * b * t * c, w),
        scratch: scratch(l, gpt2_dims((b, t, c, nh))),
        b,
        t,
        c,
        nh,
        mask,
    }
}

fn gpt2_backward(l: &mut Layout, f: &FlashAttention) -> FlashAttentionBackward {
    let (w, (b, t, c, nh)) = (f.out.dtype, (f.b, f.t, f.c, f.nh));
    FlashAttentionBackward {
        dqkv: l.tensor(3 * b * t * c, w),
        dout: l.tensor(b * t * c, w),
        qkv: f.qkv,
        out: f.out,
        lse: f.lse,
        scratch: scratch(l, gpt2_dims((b, t, c, nh))),
        b,
        t,
        c,
        nh,
        mask: f.mask,
    }
}

fn dims_of((b, t, h, kv, d): (usize, usize, usize, usize, usize)) -> GqaDims {
    GqaDims { b, t, h, kv, d }
}

/// Every grouped-query sample size under every mask, forward and backward.
fn pairs(w: Dtype, l: &mut Layout) -> Vec<(GqaFlashAttention, GqaFlashAttentionBackward)> {
    let mut out = Vec::new();
    for size in SIZES {
        let dims = dims_of(size);
        for mask in masks(l, dims.b, dims.t) {
            let f = forward(l, w, dims, mask);
            let bw = backward(l, &f);
            out.push((f, bw));
        }
    }
    out
}

/// Every GPT-2 sample size under every mask, forward and backward.
fn gpt2_pairs(w: Dtype, l: &mut Layout) -> Vec<(FlashAttention, FlashAttentionBackward)> {
    let mut out = Vec::new();
    for size in GPT2_SIZES {
        for mask in masks(l, size.0, size.1) {
            let f = gpt2_forward(l, w, size, mask);
            let bw = gpt2_backward(l, &f);
            out.push((f, bw));
        }
    }
    out
}

fn dimensions(s: &GqaDims, layout: QkvLayout, mask: &FlashMask) -> Vec<(&'static str, usize)> {
    vec![
        ("b", s.b),
        ("t", s.t),
        ("h", s.h),
        ("kv", s.kv),
        ("d", s.d),
        ("ldq", layout.ldq),
        ("ldkv", layout.ldkv),
        ("koff", layout.koff),
        ("voff", layout.voff),
        ("window", mask.window),
    ]
}

fn scale(d: usize) -> Vec<(&'static str, f32)> {
    vec![("scale", 1.0 / (d as f32).sqrt())]
}

/// The delta region the backward carves.
fn delta(s: &GqaDims) -> Vec<(&'static str, usize, usize)> {
    vec![("delta", 0, s.b * s.h * s.t * 4)]
}

/// GPT-2's q, k, v (and their gradients) are its fused qkv (dqkv).
fn fused_names(param: &str) -> Option<&'static [&'static str]> {
    match param {
        "q" | "k" | "v" => Some(&["qkv"]),
        "dq" | "dk" | "dv" => Some(&["dqkv"]),
        _ => None,
    }
}

impl Emulated for GqaFlashAttention {
    fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
        pairs(w, l).into_iter().map(|(f, _)| f).collect()
    }

    fn dimensions(&self) -> Vec<(&'static str, usize)> {
        dimensions(&self.dims, QkvLayout::separate(&self.dims), &self.mask)
    }

    fn floats(&self, _: &Scalars) -> Vec<(&'static str, f32)> {
        scale(self.dims.d)
    }

    fn emulate(name: &str, args: &[Arg], memory: &Emulator) -> bool {
        emulate(name, args, memory)
    }
}

impl Emulated for GqaFlashAttentionBackward {
    fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
        pairs(w, l).into_iter().map(|(_, b)| b).collect()
    }

    fn dimensions(&self) -> Vec<(&'static str, usize)> {
        dimensions(&self.dims, QkvLayout::separate(&self.dims), &self.mask)
    }

    fn floats(&self, _: &Scalars) -> Vec<(&'static str, f32)> {
        scale(self.dims.d)
    }

    fn scratch_regions(&self) -> Vec<(&'static str, usize, usize)> {
        delta(&self.dims)
    }
}

impl Emulated for FlashAttention {
    fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
        gpt2_pairs(w, l).into_iter().map(|(f, _)| f).collect()
    }

    fn dimensions(&self) -> Vec<(&'static str, usize)> {
        let s = gpt2_dims((self.b, self.t, self.c, self.nh));
        dimensions(&s, QkvLayout::fused(self.c), &self.mask)
    }

    fn floats(&self, _: &Scalars) -> Vec<(&'static str, f32)> {
        scale(self.c / self.nh)
    }

    fn accepted(_: &str, param: &str) -> Option<&'static [&'static str]> {
        fused_names(param)
    }
}

impl Emulated for FlashAttentionBackward {
    fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
        gpt2_pairs(w, l).into_iter().map(|(_, b)| b).collect()
    }

    fn dimensions(&self) -> Vec<(&'static str, usize)> {
        let s = gpt2_dims((self.b, self.t, self.c, self.nh));
        dimensions(&s, QkvLayout::fused(self.c), &self.mask)
    }

    fn floats(&self, _: &Scalars) -> Vec<(&'static str, f32)> {
        scale(self.c / self.nh)
    }

    fn scratch_regions(&self) -> Vec<(&'static str, usize, usize)> {
        delta(&gpt2_dims((self.b, self.t, self.c, self.nh)))
    }

    fn accepted(_: &str, param: &str) -> Option<&'static [&'static str]> {
        fused_names(param)
    }
}

/// The launch's `b, t, h, kv, d` (arguments `at..at + 5`), its layout `ldq, ldkv, koff,
/// voff` (the next four), its window (the next), its doc_start (argument `at - 1`) and
/// its scale (the last).
struct Launched {
    dims: GqaDims,
    layout: QkvLayout,
    window: usize,
    doc_start: u64,
    scale: f32,
}

impl Launched {
    fn of(name: &str, args: &[Arg], at: usize) -> Self {
        let n = |i| count_arg(name, args, i);
        let scale = match args.last() {
            Some(Arg::Float(s)) => *s,
            other => panic!("{name}: scale is {other:?}"),
        };
        Launched {
            dims: dims_of((n(at), n(at + 1), n(at + 2), n(at + 3), n(at + 4))),
            layout: QkvLayout {
                ldq: n(at + 5),
                ldkv: n(at + 6),
                koff: n(at + 7),
                voff: n(at + 8),
            },
            window: n(at + 9),
            doc_start: ptr_arg(name, args, at - 1),
            scale,
        }
    }

    /// flash_first_key: the first key query `ti` of sequence `bi` sees.
    fn first_key(&self, m: &Emulator, bi: usize, ti: usize) -> usize {
        let doc = if self.doc_start == 0 {
            0
        } else {
            m.load(self.doc_start, bi * self.dims.t + ti).to_bits() as usize
        };
        let window = if self.window > 0 {
            (ti + 1).saturating_sub(self.window)
        } else {
            0
        };
        doc.max(window)
    }

    /// Where query row (bi, ti, hi) starts in q (and dq) and in out (and dout).
    fn query(&self, bi: usize, ti: usize, hi: usize) -> (usize, usize) {
        let GqaDims { t, h, d, .. } = self.dims;
        let token = bi * t + ti;
        (token * self.layout.ldq + hi * d, (token * h + hi) * d)
    }

    /// Where key j of sequence bi, key/value head g, starts in k (dk) and in v (dv).
    fn key(&self, bi: usize, j: usize, g: usize) -> (usize, usize) {
        let at = (bi * self.dims.t + j) * self.layout.ldkv + g * self.dims.d;
        (at + self.layout.koff, at + self.layout.voff)
    }

    /// The dot product of the d values from element `a` of the tensor at `x` with those
    /// from element `b` of the one at `y`.
    fn dot(&self, m: &Emulator, (x, a): (u64, usize), (y, b): (u64, usize)) -> f32 {
        (0..self.dims.d)
            .map(|c| m.load(x, a + c) * m.load(y, b + c))
            .sum()
    }
}

/// flash_forward, as it reads.
fn emulate_forward(l: &Launched, p: &dyn Fn(usize) -> u64, m: &Emulator) {
    let GqaDims { b, t, h, kv, d } = l.dims;
    let (out, lse, q, k, v) = (p(0), p(1), p(2), p(3), p(4));
    for row in 0..b * h * t {
        let (ti, hi, bi) = (row % t, (row / t) % h, row / (t * h));
        let (g, (qat, oat)) = (hi / (h / kv), l.query(bi, ti, hi));
        let (mut top, mut sum, mut acc) = (f32::NEG_INFINITY, 0f32, vec![0f32; d]);
        for j in l.first_key(m, bi, ti)..=ti {
            let (kat, vat) = l.key(bi, j, g);
            let s = l.dot(m, (q, qat), (k, kat)) * l.scale;
            let next = top.max(s);
            let alpha = if top == f32::NEG_INFINITY {
                0.0
            } else {
                (top - next).exp()
            };
            let e = (s - next).exp();
            sum = sum * alpha + e;
            for (c, a) in acc.iter_mut().enumerate() {
                *a = *a * alpha + e * m.load(v, vat + c);
            }
            top = next;
        }
        for (c, a) in acc.iter().enumerate() {
            m.store(out, oat + c, a / sum);
        }
        m.store(lse, row, top + sum.ln());
    }
}

/// flash_backward_dq, as it reads.
fn emulate_dq(l: &Launched, p: &dyn Fn(usize) -> u64, m: &Emulator) {
    let GqaDims { b, t, h, kv, d } = l.dims;
    let (dq, delta, dout, out, q, k, v, lse) = (p(0), p(1), p(2), p(3), p(4), p(5), p(6), p(7));
    for row in 0..b * h * t {
        let (ti, hi, bi) = (row % t, (row / t) % h, row / (t * h));
        let (g, (qat, oat)) = (hi / (h / kv), l.query(bi, ti, hi));
        let di = l.dot(m, (dout, oat), (out, oat));
        m.store(delta, row, di);
        let mut acc = vec![0f32; d];
        for j in l.first_key(m, bi, ti)..=ti {
            let (kat, vat) = l.key(bi, j, g);
            let pr = (l.dot(m, (q, qat), (k, kat)) * l.scale - m.load(lse, row)).exp();
            let dp = l.dot(m, (dout, oat), (v, vat));
            for (c, a) in acc.iter_mut().enumerate() {
                *a += pr * (dp - di) * m.load(k, kat + c);
            }
        }
        for (c, a) in acc.iter().enumerate() {
            m.store(dq, qat + c, a * l.scale);
        }
    }
}

/// flash_backward_dkv, as it reads.
fn emulate_dkv(l: &Launched, p: &dyn Fn(usize) -> u64, m: &Emulator) {
    let GqaDims { b, t, h, kv, d } = l.dims;
    let (dk, dv, dout, q, k, v, lse, delta) = (p(0), p(1), p(2), p(3), p(4), p(5), p(6), p(7));
    let group = h / kv;
    for row in 0..b * kv * t {
        let (j, g, bi) = (row % t, (row / t) % kv, row / (t * kv));
        let (kat, vat) = l.key(bi, j, g);
        let (mut gk, mut gv) = (vec![0f32; d], vec![0f32; d]);
        for hi in g * group..(g + 1) * group {
            for i in (j..t).take_while(|&i| l.first_key(m, bi, i) <= j) {
                let (qat, oat) = l.query(bi, i, hi);
                let at = (bi * h + hi) * t + i;
                let s = l.dot(m, (k, kat), (q, qat)) * l.scale;
                let pr = (s - m.load(lse, at)).exp();
                let dp = l.dot(m, (v, vat), (dout, oat));
                let ds = pr * (dp - m.load(delta, at));
                for c in 0..d {
                    gv[c] += pr * m.load(dout, oat + c);
                    gk[c] += ds * m.load(q, qat + c);
                }
            }
        }
        for c in 0..d {
            m.store(dk, kat + c, gk[c] * l.scale);
            m.store(dv, vat + c, gv[c]);
        }
    }
}

/// The `.cu` kernels' loops, in f32, as they read.
fn emulate(name: &str, args: &[Arg], m: &Emulator) -> bool {
    let p = |i| ptr_arg(name, args, i);
    match name {
        "flash_forward_f32" => emulate_forward(&Launched::of(name, args, 6), &p, m),
        "flash_backward_dq_f32" => emulate_dq(&Launched::of(name, args, 9), &p, m),
        "flash_backward_dkv_f32" => emulate_dkv(&Launched::of(name, args, 9), &p, m),
        _ => return false,
    }
    true
}

/// Document starts for `b` sequences of `t`: documents of 1, 3, 2, 4, ... positions,
/// staggered per sequence.
fn documents(b: usize, t: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(b * t);
    for bi in 0..b {
        let (mut start, mut len) = (0, 1 + bi);
        for i in 0..t {
            if i - start >= len {
                start = i;
                len = len % 4 + 1;
            }
            out.push(start as u32);
        }
    }
    out
}

/// The document starts a kernel reads, if any, and its batch and sequence.
fn doc_tensor(kernel: &Kernel) -> Option<(TensorRef, usize, usize)> {
    let (mask, b, t) = match kernel {
        Kernel::GqaFlashAttention(k) => (k.mask, k.dims.b, k.dims.t),
        Kernel::FlashAttention(k) => (k.mask, k.b, k.t),
        _ => return None,
    };
    mask.doc_start.map(|d| (d, b, t))
}

#[test]
fn the_fused_launch_sequences_compute_what_the_cpu_computes() {
    let mut l = Layout::default();
    let mut kernels = Vec::new();
    for size in [
        (1, 1, 2, 1, 4),
        (2, 7, 6, 2, 12),
        (1, 22, 4, 1, 8),
        (2, 13, 3, 3, 5),
    ] {
        let dims = dims_of(size);
        for mask in masks(&mut l, dims.b, dims.t) {
            let f = forward(&mut l, Dtype::F32, dims, mask);
            let b = backward(&mut l, &f);
            kernels.extend([
                Kernel::GqaFlashAttention(f),
                Kernel::GqaFlashAttentionBackward(b),
            ]);
        }
    }
    for size in [(1, 1, 4, 1), (2, 7, 12, 3), (1, 22, 16, 2)] {
        for mask in masks(&mut l, size.0, size.1) {
            let f = gpt2_forward(&mut l, Dtype::F32, size, mask);
            let b = gpt2_backward(&mut l, &f);
            kernels.extend([Kernel::FlashAttention(f), Kernel::FlashAttentionBackward(b)]);
        }
    }
    let mut inputs = random_inputs(&l, &kernels, 7);
    for (d, b, t) in kernels.iter().filter_map(doc_tensor) {
        inputs.write_u32(&d, &documents(b, t));
    }
    check_emulation(&kernels, inputs, 1e-5);
}

#[test]
fn the_cuda_kernels_refuse_more_channels_per_head_than_they_hold() {
    let mut l = Layout::default();
    let dims = dims_of((1, 2, 1, 1, FLASH_CUDA_MAX_D + 1));
    let f = forward(&mut l, Dtype::F32, dims, FlashMask::CAUSAL);
    let queue = Emulator::recording();
    let kernel = Kernel::GqaFlashAttention(f);
    let e = run_on(&queue, &kernel, &scalars()).unwrap_err();
    assert!(e.to_string().contains("at most 256"), "{e}");
    assert!(queue.is_empty());
}
