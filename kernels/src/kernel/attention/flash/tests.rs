//! The fused kernels' launch sequences under the emulator: what the CUDA runner needs of
//! them, the `.cu` kernels as they read (f32), and their agreement with the CPU op on odd
//! sizes, windows and document layouts.

use super::*;
use crate::cuda::launch::tests::{
    Emulated, Emulator, Layout, check_emulation, count_arg, ptr_arg, random_inputs, run_on, scalars,
};
use crate::kernel::Kernel;

/// (B, T, H, KV, D) of the samples.
const SIZES: [(usize, usize, usize, usize, usize); 4] = [
    (2, 7, 6, 2, 12),
    (1, 9, 3, 3, 5),
    (1, 1, 2, 1, 4),
    (0, 3, 4, 2, 4),
];

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

fn forward(l: &mut Layout, w: Dtype, dims: GqaDims, mask: FlashMask) -> GqaFlashAttention {
    let GqaDims { b, t, h, .. } = dims;
    GqaFlashAttention {
        out: l.tensor(dims.q_len(), w),
        lse: l.tensor(b * h * t, Dtype::F32),
        q: l.tensor(dims.q_len(), w),
        k: l.tensor(dims.kv_len(), w),
        v: l.tensor(dims.kv_len(), w),
        scratch: l.tensor(
            flash_scratch_bytes(Target::Cpu, dims).max(flash_scratch_bytes(Target::Cuda, dims)),
            Dtype::U8,
        ),
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
        scratch: l.tensor(
            flash_scratch_bytes(Target::Cpu, dims).max(flash_scratch_bytes(Target::Cuda, dims)),
            Dtype::U8,
        ),
        dims,
        mask: f.mask,
    }
}

fn dims_of((b, t, h, kv, d): (usize, usize, usize, usize, usize)) -> GqaDims {
    GqaDims { b, t, h, kv, d }
}

/// Every sample size under every mask, forward and backward.
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

fn dimensions(s: &GqaDims, mask: &FlashMask) -> Vec<(&'static str, usize)> {
    vec![
        ("b", s.b),
        ("t", s.t),
        ("h", s.h),
        ("kv", s.kv),
        ("d", s.d),
        ("window", mask.window),
    ]
}

impl Emulated for GqaFlashAttention {
    fn samples(w: Dtype, l: &mut Layout) -> Vec<Self> {
        pairs(w, l).into_iter().map(|(f, _)| f).collect()
    }

    fn dimensions(&self) -> Vec<(&'static str, usize)> {
        dimensions(&self.dims, &self.mask)
    }

    fn floats(&self, _: &Scalars) -> Vec<(&'static str, f32)> {
        vec![("scale", 1.0 / (self.dims.d as f32).sqrt())]
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
        dimensions(&self.dims, &self.mask)
    }

    fn floats(&self, _: &Scalars) -> Vec<(&'static str, f32)> {
        vec![("scale", 1.0 / (self.dims.d as f32).sqrt())]
    }

    fn scratch_regions(&self) -> Vec<(&'static str, usize, usize)> {
        let GqaDims { b, t, h, .. } = self.dims;
        vec![("delta", 0, b * h * t * 4)]
    }
}

/// The launch's `b, t, h, kv, d, window` (arguments `at..at + 6`), its doc_start
/// (argument `at - 1`) and its scale (the last).
struct Launched {
    dims: GqaDims,
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
            window: n(at + 5),
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

    /// The dot product of row `a` of the tensor at `x` with row `b` of the one at `y`.
    fn dot(&self, m: &Emulator, (x, a): (u64, usize), (y, b): (u64, usize)) -> f32 {
        let d = self.dims.d;
        (0..d)
            .map(|c| m.load(x, a * d + c) * m.load(y, b * d + c))
            .sum()
    }
}

/// The `.cu` kernels' loops, in f32, as they read.
fn emulate(name: &str, args: &[Arg], m: &Emulator) -> bool {
    let p = |i| ptr_arg(name, args, i);
    match name {
        "flash_forward_f32" => {
            let l = Launched::of(name, args, 6);
            let GqaDims { b, t, h, kv, d } = l.dims;
            let (out, lse, q, k, v) = (p(0), p(1), p(2), p(3), p(4));
            for row in 0..b * h * t {
                let (ti, hi, bi) = (row % t, (row / t) % h, row / (t * h));
                let (g, qrow) = (hi / (h / kv), (bi * t + ti) * h + hi);
                let (mut top, mut sum, mut acc) = (f32::NEG_INFINITY, 0f32, vec![0f32; d]);
                for j in l.first_key(m, bi, ti)..=ti {
                    let kvrow = (bi * t + j) * kv + g;
                    let s = l.dot(m, (q, qrow), (k, kvrow)) * l.scale;
                    let next = top.max(s);
                    let alpha = if top == f32::NEG_INFINITY {
                        0.0
                    } else {
                        (top - next).exp()
                    };
                    let e = (s - next).exp();
                    sum = sum * alpha + e;
                    for (c, a) in acc.iter_mut().enumerate() {
                        *a = *a * alpha + e * m.load(v, kvrow * d + c);
                    }
                    top = next;
                }
                for (c, a) in acc.iter().enumerate() {
                    m.store(out, qrow * d + c, a / sum);
                }
                m.store(lse, row, top + sum.ln());
            }
        }
        "flash_backward_dq_f32" => {
            let l = Launched::of(name, args, 9);
            let GqaDims { b, t, h, kv, d } = l.dims;
            let (dq, delta, dout, out, q, k, v, lse) =
                (p(0), p(1), p(2), p(3), p(4), p(5), p(6), p(7));
            for row in 0..b * h * t {
                let (ti, hi, bi) = (row % t, (row / t) % h, row / (t * h));
                let (g, qrow) = (hi / (h / kv), (bi * t + ti) * h + hi);
                let di = l.dot(m, (dout, qrow), (out, qrow));
                m.store(delta, row, di);
                let mut acc = vec![0f32; d];
                for j in l.first_key(m, bi, ti)..=ti {
                    let kvrow = (bi * t + j) * kv + g;
                    let pr = (l.dot(m, (q, qrow), (k, kvrow)) * l.scale - m.load(lse, row)).exp();
                    let dp = l.dot(m, (dout, qrow), (v, kvrow));
                    for (c, a) in acc.iter_mut().enumerate() {
                        *a += pr * (dp - di) * m.load(k, kvrow * d + c);
                    }
                }
                for (c, a) in acc.iter().enumerate() {
                    m.store(dq, qrow * d + c, a * l.scale);
                }
            }
        }
        "flash_backward_dkv_f32" => {
            let l = Launched::of(name, args, 9);
            let GqaDims { b, t, h, kv, d } = l.dims;
            let (dk, dv, dout, q, k, v, lse, delta) =
                (p(0), p(1), p(2), p(3), p(4), p(5), p(6), p(7));
            let group = h / kv;
            for row in 0..b * kv * t {
                let (j, g, bi) = (row % t, (row / t) % kv, row / (t * kv));
                let kvrow = (bi * t + j) * kv + g;
                let (mut gk, mut gv) = (vec![0f32; d], vec![0f32; d]);
                for hi in g * group..(g + 1) * group {
                    for i in (j..t).take_while(|&i| l.first_key(m, bi, i) <= j) {
                        let qrow = (bi * t + i) * h + hi;
                        let at = (bi * h + hi) * t + i;
                        let s = l.dot(m, (k, kvrow), (q, qrow)) * l.scale;
                        let pr = (s - m.load(lse, at)).exp();
                        let dp = l.dot(m, (v, kvrow), (dout, qrow));
                        let ds = pr * (dp - m.load(delta, at));
                        for c in 0..d {
                            gv[c] += pr * m.load(dout, qrow * d + c);
                            gk[c] += ds * m.load(q, qrow * d + c);
                        }
                    }
                }
                for c in 0..d {
                    m.store(dk, kvrow * d + c, gk[c] * l.scale);
                    m.store(dv, kvrow * d + c, gv[c]);
                }
            }
        }
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
    let mut inputs = random_inputs(&l, &kernels, 7);
    for kernel in &kernels {
        if let Kernel::GqaFlashAttention(GqaFlashAttention {
            mask: FlashMask {
                doc_start: Some(d), ..
            },
            dims,
            ..
        }) = kernel
        {
            inputs.write_u32(d, &documents(dims.b, dims.t));
        }
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
