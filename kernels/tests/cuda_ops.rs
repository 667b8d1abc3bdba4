//! Every kernel of a program run by `CudaKernels::run` on the GPU against `run_cpu` on
//! the same inputs, at odd sizes, in each working type: f32 within ‖cuda − cpu‖ / ‖cpu‖
//! < 1e-5; bf16 and f16 (inputs representable in the type, the CPU computing in f32 on
//! those values) within 1e-2 for working-type outputs. Also: AdamW against this process's
//! CPU AdamW bit for bit (every copy-out kind, with and without decay, the skip flag) and
//! its working copies against `half` bit for bit; the gradient statistics against the
//! CPU's bit for bit (flag too, with an infinity and a NaN); and that a kernel run
//! twice gives the same bits. The Llama family's kernels (RMSNorm, RoPE, SwiGLU,
//! grouped-query attention) likewise, and the randomized weight gradients (f32 only, a
//! step's sketch seed mixed in). Bit for bit, the GPU's result being the CPU's f32 result
//! rounded once to the working type: the few-bit kernels' codes (word for word) and
//! backwards, NF4 and int8 dequantisation, rounding gradients to bf16's precision and
//! scaling them, and the elementwise product.
//!
//! Tensors lie in one device allocation per case, as in the engine's arena, at offsets
//! that are multiples of 256 bytes; each tensor's address is the allocation's plus its
//! offset. Scratch starts filled with 0xff bytes (NaN), so a read before a write shows.
//! Each test needs a GPU and the CUDA libraries, so `cargo test` lists it as ignored;
//! run with `--include-ignored` (`scripts/gpu-check` does), it fails saying what is
//! missing where they are not. `src/cuda/launch/tests.rs` checks every launch's arguments
//! and every product's operands without a GPU.

// Element-wise checks index several parallel arrays at once; an index reads best.
#![allow(clippy::needless_range_loop)]

use cudarc::driver::{CudaContext, DevicePtrMut};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use strata_kernels::adamw::{AdamStep, AdamW, CopyOut, Grads, State, grad_stats};
use strata_kernels::cuda::{CudaKernels, probe};
use strata_kernels::isa::Isa;
use strata_kernels::kernel::attention::{AttnMask, flash_scratch_bytes};
use strata_kernels::kernel::fewbit::{Bits, GELU_TABLES, SILU_TABLES, Table, codes_len};
use strata_kernels::kernel::quant::{INT8_BLOCK, Int8Blocks, NF4_BLOCK, Nf4Blocks};
use strata_kernels::kernel::sketch::{SketchProject, SketchWeightGrad};
use strata_kernels::kernel::{
    AdamWKernel, AddF32, AddScaled, Attention, AttentionBackward, CopyKernel, CrossEntropy,
    CrossEntropyBackward, Encoder, EncoderBackward, FewBitGelu, FewBitGeluBackward, FewBitSwiGlu,
    FewBitSwiGluBackward, FlashMask, FoldRanks, Gelu, GeluBackward, GqaAttention,
    GqaAttentionBackward, GqaFlashAttention, GqaFlashAttentionBackward, GradStatsKernel,
    Int8Dequantize, LayerNorm, LayerNormBackward, LayerNormGrads, Matmul, MatmulBackward, Mul,
    Nf4Dequantize, Residual, RmsNorm, RmsNormBackward, Rope, RopeBackward, RopeTable, RoundBf16,
    Scale, SwiGlu, SwiGluBackward, WeightGrad, Zero,
};
use strata_kernels::ops::{self, Cpu, Llama3Scaling, RopeFreqs, WeightLayout};
use strata_kernels::program::{
    Access, CpuMemory, Dtype, Kernel, Scalars, Target, TensorRef, attention_scratch_bytes,
    gqa_attention_scratch_bytes, grad_stats_scratch_bytes, read_stats, run_cpu,
};
use strata_kernels::reference::llama::GqaDims;

/// The kernels on GPU 0; panics, saying what is missing, where CUDA is not usable (the
/// tests that call it are ignored unless asked for: `--include-ignored` on a GPU machine).
fn gpu() -> CudaKernels {
    if let Err(e) = probe().require_all() {
        panic!("this test needs a GPU: {e}");
    }
    let context = CudaContext::new(0).expect("GPU 0");
    let stream = context.new_stream().expect("a stream");
    CudaKernels::new(stream).expect("the kernels load")
}

const WORKING: [Dtype; 3] = [Dtype::F32, Dtype::Bf16, Dtype::F16];

/// Tolerance of working-type outputs in bf16 and f16.
const LOW_PRECISION: f64 = 1e-2;

const CPU: Cpu = Cpu {
    isa: Isa::Portable,
    threads: 1,
};

/// `x` rounded to `dtype` (nearest even), as f32.
fn round(dtype: Dtype, x: f32) -> f32 {
    match dtype {
        Dtype::Bf16 => bf16::from_f32(x).to_f32(),
        Dtype::F16 => f16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// Random values in [-scale, scale), representable in `dtype`.
fn random(rng: &mut StdRng, dtype: Dtype, len: usize, scale: f32) -> Vec<f32> {
    (0..len)
        .map(|_| round(dtype, rng.random_range(-scale..scale)))
        .collect()
}

fn encode(dtype: Dtype, values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype.size());
    for &x in values {
        match dtype {
            Dtype::F32 => out.extend(x.to_le_bytes()),
            Dtype::Bf16 => out.extend(bf16::from_f32(x).to_bits().to_le_bytes()),
            Dtype::F16 => out.extend(f16::from_f32(x).to_bits().to_le_bytes()),
            other => panic!("{other} is not a float type"),
        }
    }
    out
}

/// The values of `t` in `image`, as f32.
fn decode(image: &[u8], t: &TensorRef) -> Vec<f32> {
    let bytes = &image[t.byte_range()];
    match t.dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        Dtype::Bf16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_bits(u16::from_le_bytes(b.try_into().unwrap())).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_bits(u16::from_le_bytes(b.try_into().unwrap())).to_f32())
            .collect(),
        other => panic!("{other} is not a float type"),
    }
}

/// The bits of the 16-bit values of `t` in `image`.
fn bits16(image: &[u8], t: &TensorRef) -> Vec<u16> {
    image[t.byte_range()]
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// One runner's memory for a case: tensors laid out in one byte image (binding 0), each
/// at a multiple of 256 bytes, activations and parameters in the runner's working type
/// (always f32 on the CPU).
struct Side {
    target: Target,
    work: Dtype,
    image: Vec<u8>,
}

impl Side {
    fn new(target: Target, work: Dtype) -> Self {
        // Nothing at offset 0: offsets are exercised.
        Side {
            target,
            work,
            image: vec![0; 256],
        }
    }

    /// The dtype of activations and parameters on this side.
    fn working(&self) -> Dtype {
        match self.target {
            Target::Cpu => Dtype::F32,
            Target::Cuda => self.work,
        }
    }

    fn place(&mut self, len: usize, dtype: Dtype, bytes: &[u8]) -> TensorRef {
        assert_eq!(bytes.len(), len * dtype.size());
        let offset = self.image.len().next_multiple_of(256);
        self.image.resize(offset, 0);
        self.image.extend_from_slice(bytes);
        TensorRef::new(0, offset, len, dtype)
    }

    /// An activation or parameter (in the working type).
    fn act(&mut self, values: &[f32]) -> TensorRef {
        let dtype = self.working();
        self.place(values.len(), dtype, &encode(dtype, values))
    }

    /// An f32 tensor (gradients, statistics).
    fn f32s(&mut self, values: &[f32]) -> TensorRef {
        self.place(values.len(), Dtype::F32, &encode(Dtype::F32, values))
    }

    fn u32s(&mut self, values: &[u32]) -> TensorRef {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.place(values.len(), Dtype::U32, &bytes)
    }

    fn u8s(&mut self, values: &[u8]) -> TensorRef {
        self.place(values.len(), Dtype::U8, values)
    }

    /// `bytes` bytes of scratch, filled with 0xff (NaN as floats).
    fn scratch(&mut self, bytes: usize) -> TensorRef {
        self.place(bytes, Dtype::U8, &vec![0xff; bytes])
    }

    /// Attention's scratch on this side.
    fn attention_scratch(&mut self, b: usize, t: usize, c: usize, nh: usize) -> TensorRef {
        let dtype = self.working();
        self.scratch(attention_scratch_bytes(self.target, dtype, b, t, c, nh))
    }
}

impl Side {
    /// Grouped-query attention's scratch on this side.
    fn gqa_scratch(&mut self, dims: GqaDims) -> TensorRef {
        let GqaDims { b, t, h, kv, d } = dims;
        let dtype = self.working();
        self.scratch(gqa_attention_scratch_bytes(
            self.target,
            dtype,
            b,
            t,
            h,
            kv,
            d,
        ))
    }
}

/// Host memory for `run_cpu`: the image in 8-byte words.
struct HostImage {
    start: *mut u8,
    len: usize,
}

impl CpuMemory for HostImage {
    fn address(&self, t: &TensorRef) -> *mut u8 {
        assert!(
            t.offset_bytes + t.bytes() <= self.len,
            "{t:?} outside the image"
        );
        // SAFETY: inside the image (checked above).
        unsafe { self.start.add(t.offset_bytes) }
    }
}

/// Runs `kernel` on the CPU over a copy of `image`, and returns the image after.
fn run_host(kernel: &Kernel, image: &[u8], scalars: &Scalars) -> Vec<u8> {
    let mut words: Vec<u64> = image
        .chunks(8)
        .map(|c| {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            u64::from_le_bytes(w)
        })
        .collect();
    let memory = HostImage {
        start: words.as_mut_ptr().cast::<u8>(),
        len: image.len(),
    };
    // SAFETY: every tensor lies inside the image (checked by `address`), at a multiple of
    // 256 bytes from an 8-byte-aligned start; the words are ours alone for the call.
    unsafe { run_cpu(kernel, &CPU, scalars, &memory) }.unwrap();
    let mut out: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    out.truncate(image.len());
    out
}

/// Runs `kernel` on the GPU over a copy of `image` in one device allocation, and returns
/// the image after.
fn run_gpu(k: &CudaKernels, kernel: &Kernel, image: &[u8], scalars: &Scalars) -> Vec<u8> {
    let s = k.stream();
    let mut memory = s.clone_htod(image).unwrap();
    {
        let (base, _written) = memory.device_ptr_mut(s);
        let address = |t: &TensorRef| {
            assert!(t.offset_bytes + t.bytes() <= image.len(), "{t:?} outside");
            base + t.offset_bytes as u64
        };
        // SAFETY: every tensor lies inside the allocation (checked above), which lives
        // until the copy back below has waited for the stream; only this stream uses it.
        unsafe { k.run(kernel, scalars, &address) }.unwrap_or_else(|e| panic!("{e}"));
    }
    s.clone_dtoh(&memory).unwrap()
}

/// ‖got − want‖ / ‖want‖.
fn relative_error(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        diff += (g as f64 - w as f64).powi(2);
        norm += (w as f64).powi(2);
    }
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// The written tensors of `kernel`, in its order.
fn written(kernel: &Kernel) -> Vec<TensorRef> {
    let mut out = Vec::new();
    kernel.for_each_tensor(|t, access| {
        if access == Access::Write {
            out.push(*t);
        }
    });
    out
}

/// One case run by both runners: each side's kernel and image after, and the GPU's image
/// before.
struct Ran {
    cpu: Kernel,
    cpu_after: Vec<u8>,
    gpu: Kernel,
    gpu_before: Vec<u8>,
    gpu_after: Vec<u8>,
}

/// Builds the case with `build` for each runner and runs both.
fn run_both(
    k: &CudaKernels,
    work: Dtype,
    scalars: &Scalars,
    mut build: impl FnMut(&mut Side) -> Kernel,
) -> Ran {
    let mut cpu = Side::new(Target::Cpu, work);
    let cpu_kernel = build(&mut cpu);
    let mut gpu = Side::new(Target::Cuda, work);
    let gpu_kernel = build(&mut gpu);
    Ran {
        cpu_after: run_host(&cpu_kernel, &cpu.image, scalars),
        gpu_after: run_gpu(k, &gpu_kernel, &gpu.image, scalars),
        cpu: cpu_kernel,
        gpu: gpu_kernel,
        gpu_before: gpu.image,
    }
}

impl Ran {
    /// Compares every written float tensor: working-type outputs within 1e-5 (f32) or
    /// [`LOW_PRECISION`], f32 outputs within `f32_tolerance`.
    fn assert_close(&self, what: &str, work: Dtype, f32_tolerance: f64) {
        let tag = format!("{what} {work}");
        for (c, g) in written(&self.cpu).iter().zip(written(&self.gpu)) {
            if !g.dtype.is_float() {
                continue; // scratch and statistics records
            }
            let tolerance = match g.dtype {
                Dtype::F32 if work == Dtype::F32 => 1e-5,
                Dtype::F32 => f32_tolerance,
                _ => LOW_PRECISION,
            };
            let err = relative_error(&decode(&self.gpu_after, &g), &decode(&self.cpu_after, c));
            println!(
                "{tag} (tensor of {} {}): relative error {err:.2e}",
                g.len, g.dtype
            );
            assert!(
                err < tolerance,
                "{tag}: tensor of {} {}: relative error {err:.3e} above {tolerance:e}",
                g.len,
                g.dtype
            );
        }
    }

    /// Asserts that each written tensor that `pick` takes (at least one) holds on the GPU
    /// exactly the CPU's result: the same bytes where both sides have its dtype (codes,
    /// f32), else the CPU's f32 values rounded to the GPU's type (nearest, ties to even,
    /// as the device's casts).
    fn assert_exact(&self, what: &str, pick: impl Fn(&TensorRef) -> bool) {
        let pairs = written(&self.cpu).into_iter().zip(written(&self.gpu));
        let mut checked = 0;
        for (i, (c, g)) in pairs.enumerate().filter(|(_, (_, g))| pick(g)) {
            let want = if c.dtype == g.dtype {
                self.cpu_after[c.byte_range()].to_vec()
            } else {
                encode(g.dtype, &decode(&self.cpu_after, &c))
            };
            let got = &self.gpu_after[g.byte_range()];
            let size = g.dtype.size();
            let first = got
                .chunks(size)
                .zip(want.chunks(size))
                .position(|(a, b)| a != b);
            if let Some(e) = first {
                let bytes = |b: &[u8]| b[e * size..][..size].to_vec();
                panic!(
                    "{what}: written tensor {i} ({} {}), element {e}: GPU bytes {:02x?}, \
                     the CPU's {:02x?}",
                    g.len,
                    g.dtype,
                    bytes(got),
                    bytes(&want)
                );
            }
            checked += 1;
        }
        assert!(checked > 0, "{what}: no written tensor picked");
    }
}

/// Builds the case with `build` for each runner, runs both, and compares every written
/// float tensor ([`Ran::assert_close`]). Returns the GPU's kernel and images (before,
/// after).
fn compare(
    k: &CudaKernels,
    what: &str,
    work: Dtype,
    scalars: &Scalars,
    f32_tolerance: f64,
    build: impl FnMut(&mut Side) -> Kernel,
) -> (Kernel, Vec<u8>, Vec<u8>) {
    let ran = run_both(k, work, scalars, build);
    ran.assert_close(what, work, f32_tolerance);
    (ran.gpu, ran.gpu_before, ran.gpu_after)
}

fn scalars() -> Scalars {
    Scalars {
        dloss: 0.125,
        stats_scale: 0.5,
        ..Scalars::default()
    }
}

#[test]
#[ignore = "needs a GPU"]
fn encoder_matches_cpu() {
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(1);
    for w in WORKING {
        for (b, t, c, v) in [(3, 37, 50, 101), (1, 1, 1, 1), (2, 7, 22, 13)] {
            let tokens: Vec<u32> = (0..b * t).map(|_| rng.random_range(0..v as u32)).collect();
            let wte = random(&mut rng, w, v * c, 1.0);
            let wpe = random(&mut rng, w, (t + 5) * c, 1.0);
            let dout = random(&mut rng, w, b * t * c, 1.0);
            let dwte = random(&mut rng, Dtype::F32, v * c, 1.0);
            let dwpe = random(&mut rng, Dtype::F32, (t + 5) * c, 1.0);
            let what = format!("encoder b={b} t={t} c={c} v={v}");
            compare(&k, &what, w, &scalars(), 1e-5, |s| {
                Kernel::Encoder(Encoder {
                    out: s.act(&vec![0.0; b * t * c]),
                    tokens: s.u32s(&tokens),
                    wte: s.act(&wte),
                    wpe: s.act(&wpe),
                    b,
                    t,
                    c,
                })
            });
            let what = format!("encoder-backward b={b} t={t} c={c} v={v}");
            compare(&k, &what, w, &scalars(), 1e-5, |s| {
                Kernel::EncoderBackward(EncoderBackward {
                    dwte: s.f32s(&dwte),
                    dwpe: s.f32s(&dwpe),
                    dout: s.act(&dout),
                    tokens: s.u32s(&tokens),
                    b,
                    t,
                    c,
                })
            });
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn layernorm_matches_cpu() {
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(2);
    for w in WORKING {
        for (n, c) in [(1, 7), (77, 50), (130, 768), (22, 1)] {
            let inp = random(&mut rng, w, n * c, 2.0);
            let weight = random(&mut rng, w, c, 1.5);
            let bias = random(&mut rng, w, c, 0.5);
            let dout = random(&mut rng, w, n * c, 1.0);
            let dinp = random(&mut rng, w, n * c, 1.0);
            let dweight = random(&mut rng, Dtype::F32, c, 1.0);
            let dbias = random(&mut rng, Dtype::F32, c, 1.0);
            let what = format!("layernorm n={n} c={c}");
            compare(&k, &what, w, &scalars(), 1e-5, |s| {
                Kernel::LayerNorm(LayerNorm {
                    out: s.act(&vec![0.0; n * c]),
                    mean: s.f32s(&vec![0.0; n]),
                    rstd: s.f32s(&vec![0.0; n]),
                    inp: s.act(&inp),
                    weight: s.act(&weight),
                    bias: s.act(&bias),
                    n,
                    c,
                })
            });
            // Both sides use the CPU's statistics, so only the backward kernels differ.
            let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
            ops::layernorm_forward(
                &CPU, &mut out, &mut mean, &mut rstd, &inp, &weight, &bias, n, c,
            );
            let what = format!("layernorm-backward n={n} c={c}");
            compare(&k, &what, w, &scalars(), 1e-5, |s| {
                Kernel::LayerNormBackward(LayerNormBackward {
                    dinp: s.act(&dinp),
                    params: Some(LayerNormGrads {
                        dweight: s.f32s(&dweight),
                        dbias: s.f32s(&dbias),
                    }),
                    dout: s.act(&dout),
                    inp: s.act(&inp),
                    weight: s.act(&weight),
                    mean: s.f32s(&mean),
                    rstd: s.f32s(&rstd),
                    n,
                    c,
                })
            });
            // Frozen parameters: the input gradient alone.
            let what = format!("layernorm-backward without parameters n={n} c={c}");
            compare(&k, &what, w, &scalars(), 1e-5, |s| {
                Kernel::LayerNormBackward(LayerNormBackward {
                    dinp: s.act(&dinp),
                    params: None,
                    dout: s.act(&dout),
                    inp: s.act(&inp),
                    weight: s.act(&weight),
                    mean: s.f32s(&mean),
                    rstd: s.f32s(&rstd),
                    n,
                    c,
                })
            });
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn matmul_matches_cpu() {
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(3);
    for w in WORKING {
        // Weight gradients from 16-bit operands: cuBLAS may accumulate tensor-core
        // products in its own order and rounding.
        let dweight_tolerance = if w == Dtype::F32 { 1e-5 } else { 1e-3 };
        for (n, c, oc) in [(1, 1, 1), (7, 22, 13), (77, 50, 150), (130, 64, 257)] {
            for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
                for with_bias in [true, false] {
                    let inp = random(&mut rng, w, n * c, 1.0);
                    let weight = random(&mut rng, w, c * oc, 1.0);
                    let bias = random(&mut rng, w, oc, 1.0);
                    let dout = random(&mut rng, w, n * oc, 1.0);
                    let dweight = random(&mut rng, Dtype::F32, c * oc, 1.0);
                    let dbias = random(&mut rng, Dtype::F32, oc, 1.0);
                    let tag = format!("{layout:?} bias={with_bias} {n}x{c}x{oc}");
                    compare(&k, &format!("matmul {tag}"), w, &scalars(), 1e-5, |s| {
                        Kernel::Matmul(Matmul {
                            out: s.act(&vec![0.0; n * oc]),
                            inp: s.act(&inp),
                            weight: s.act(&weight),
                            bias: with_bias.then(|| s.act(&bias)),
                            layout,
                            n,
                            c,
                            oc,
                        })
                    });
                    compare(
                        &k,
                        &format!("matmul-backward {tag}"),
                        w,
                        &scalars(),
                        dweight_tolerance,
                        |s| {
                            Kernel::MatmulBackward(MatmulBackward {
                                // Overwritten: NaN beforehand shows a read.
                                dinp: s.act(&vec![f32::NAN; n * c]),
                                weight_grad: Some(WeightGrad {
                                    dweight: s.f32s(&dweight),
                                    inp: s.act(&inp),
                                }),
                                dbias: with_bias.then(|| s.f32s(&dbias)),
                                dout: s.act(&dout),
                                weight: s.act(&weight),
                                layout,
                                n,
                                c,
                                oc,
                            })
                        },
                    );
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn attention_matches_cpu() {
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(4);
    for w in WORKING {
        for (b, t, c, nh) in [(1, 1, 4, 1), (2, 37, 48, 3), (1, 130, 64, 4), (3, 7, 22, 2)] {
            let qkv = random(&mut rng, w, b * t * 3 * c, 2.0);
            let dout = random(&mut rng, w, b * t * c, 1.0);
            let tag = format!("b={b} t={t} c={c} nh={nh}");
            compare(&k, &format!("attention {tag}"), w, &scalars(), 1e-5, |s| {
                Kernel::Attention(Attention {
                    out: s.act(&vec![0.0; b * t * c]),
                    att: s.act(&vec![0.0; b * nh * t * t]),
                    qkv: s.act(&qkv),
                    scratch: s.attention_scratch(b, t, c, nh),
                    b,
                    t,
                    c,
                    nh,
                })
            });
            // The backward from the CPU's probabilities (rounded to the working type),
            // so only the backward differs.
            let (mut out, mut att) = (vec![0.0; b * t * c], vec![0.0; b * nh * t * t]);
            ops::attention_forward(&CPU, &mut out, &mut att, &qkv, b, t, c, nh);
            let att: Vec<f32> = att.iter().map(|&x| round(w, x)).collect();
            compare(
                &k,
                &format!("attention-backward {tag}"),
                w,
                &scalars(),
                1e-5,
                |s| {
                    Kernel::AttentionBackward(AttentionBackward {
                        dqkv: s.act(&vec![f32::NAN; b * t * 3 * c]),
                        dout: s.act(&dout),
                        qkv: s.act(&qkv),
                        att: s.act(&att),
                        scratch: s.attention_scratch(b, t, c, nh),
                        b,
                        t,
                        c,
                        nh,
                    })
                },
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn elementwise_kernels_match_cpu() {
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(5);
    for w in WORKING {
        for n in [1, 7, 22, 4097, 1_000_003] {
            let inp = random(&mut rng, w, n, 6.0);
            let other = random(&mut rng, w, n, 1.0);
            let acc = random(&mut rng, Dtype::F32, n, 1.0);
            let what = format!("n={n}");
            compare(&k, &format!("gelu {what}"), w, &scalars(), 1e-5, |s| {
                Kernel::Gelu(Gelu {
                    out: s.act(&vec![0.0; n]),
                    inp: s.act(&inp),
                })
            });
            compare(
                &k,
                &format!("gelu-backward {what}"),
                w,
                &scalars(),
                1e-5,
                |s| {
                    Kernel::GeluBackward(GeluBackward {
                        dinp: s.act(&vec![0.0; n]),
                        inp: s.act(&inp),
                        dout: s.act(&other),
                    })
                },
            );
            compare(&k, &format!("residual {what}"), w, &scalars(), 1e-5, |s| {
                Kernel::Residual(Residual {
                    out: s.act(&vec![0.0; n]),
                    a: s.act(&inp),
                    b: s.act(&other),
                })
            });
            compare(
                &k,
                &format!("add-scaled {what}"),
                w,
                &scalars(),
                1e-5,
                |s| {
                    Kernel::AddScaled(AddScaled {
                        dst: s.act(&inp),
                        src: s.act(&other),
                        factor: -2.5,
                    })
                },
            );
            compare(&k, &format!("add {what}"), w, &scalars(), 1e-5, |s| {
                Kernel::AddF32(AddF32 {
                    dst: s.f32s(&acc),
                    src: s.f32s(&other),
                })
            });
            // A reduce-scatter's fold: the same left fold in rank order, so the same bits.
            for (ranks, accumulate) in [(1, false), (3, false), (3, true)] {
                let chunks = random(&mut rng, Dtype::F32, ranks * n, 1.0);
                let what = format!("fold-ranks {ranks} accumulate {accumulate} {what}");
                let (kernel, _, after) = compare(&k, &what, w, &scalars(), 1e-5, |s| {
                    Kernel::FoldRanks(FoldRanks {
                        acc: s.f32s(&acc),
                        chunks: s.f32s(&chunks),
                        ranks,
                        accumulate,
                    })
                });
                let want: Vec<u32> = (0..n)
                    .map(|i| {
                        let mut sum = if accumulate {
                            acc[i] + chunks[i]
                        } else {
                            chunks[i]
                        };
                        for p in 1..ranks {
                            sum += chunks[p * n + i];
                        }
                        sum.to_bits()
                    })
                    .collect();
                let got: Vec<u32> = decode(&after, &written(&kernel)[0])
                    .iter()
                    .map(|x| x.to_bits())
                    .collect();
                assert!(got == want, "{what}: not the left fold's bits");
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn rmsnorm_matches_cpu() {
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(21);
    for w in WORKING {
        // (78, 12): Qwen3's q/k norm, rows of one head.
        for (n, c) in [(1, 7), (77, 50), (130, 768), (22, 1), (78, 12)] {
            let inp = random(&mut rng, w, n * c, 2.0);
            let weight = random(&mut rng, w, c, 1.5);
            let dout = random(&mut rng, w, n * c, 1.0);
            let dinp = random(&mut rng, w, n * c, 1.0);
            let dweight = random(&mut rng, Dtype::F32, c, 1.0);
            let eps = 1e-6;
            let what = format!("rmsnorm n={n} c={c}");
            compare(&k, &what, w, &scalars(), 1e-5, |s| {
                Kernel::RmsNorm(RmsNorm {
                    out: s.act(&vec![0.0; n * c]),
                    rstd: s.f32s(&vec![0.0; n]),
                    inp: s.act(&inp),
                    weight: s.act(&weight),
                    eps,
                    n,
                    c,
                })
            });
            // Both sides use the CPU's statistics, so only the backward kernels differ.
            let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
            ops::rmsnorm_forward(&CPU, &mut out, &mut rstd, &inp, &weight, eps, n, c);
            let what = format!("rmsnorm-backward n={n} c={c}");
            compare(&k, &what, w, &scalars(), 1e-5, |s| {
                Kernel::RmsNormBackward(RmsNormBackward {
                    dinp: s.act(&dinp),
                    dweight: Some(s.f32s(&dweight)),
                    dout: s.act(&dout),
                    inp: s.act(&inp),
                    weight: s.act(&weight),
                    rstd: s.f32s(&rstd),
                    n,
                    c,
                })
            });
            // A frozen weight: the input gradient alone.
            let what = format!("rmsnorm-backward without dweight n={n} c={c}");
            compare(&k, &what, w, &scalars(), 1e-5, |s| {
                Kernel::RmsNormBackward(RmsNormBackward {
                    dinp: s.act(&dinp),
                    dweight: None,
                    dout: s.act(&dout),
                    inp: s.act(&inp),
                    weight: s.act(&weight),
                    rstd: s.f32s(&rstd),
                    n,
                    c,
                })
            });
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn rope_matches_cpu() {
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(22);
    for w in WORKING {
        for (b, t, h, d) in [
            (1, 1, 1, 2),
            (2, 13, 6, 12),
            (1, 130, 4, 64),
            (3, 7, 2, 128),
        ] {
            let half = d / 2;
            let mut inv_freq = vec![0.0; half];
            ops::rope_inv_freq(&mut inv_freq, 10_000.0, d);
            // A table longer than T, as a model's context gives.
            let positions: Vec<u32> = (0..t as u32 + 5).collect();
            let (mut cos, mut sin) = (
                vec![0.0; positions.len() * half],
                vec![0.0; positions.len() * half],
            );
            ops::rope_table(&mut cos, &mut sin, &inv_freq, &positions);
            let cos: Vec<f32> = cos.iter().map(|&x| round(w, x)).collect();
            let sin: Vec<f32> = sin.iter().map(|&x| round(w, x)).collect();
            let len = b * t * h * d;
            let x = random(&mut rng, w, len, 2.0);
            let tag = format!("b={b} t={t} h={h} d={d}");
            compare(&k, &format!("rope {tag}"), w, &scalars(), 1e-5, |s| {
                Kernel::Rope(Rope {
                    out: s.act(&vec![f32::NAN; len]),
                    inp: s.act(&x),
                    cos: s.act(&cos),
                    sin: s.act(&sin),
                    doc_start: None,
                    b,
                    t,
                    h,
                    d,
                })
            });
            compare(
                &k,
                &format!("rope-backward {tag}"),
                w,
                &scalars(),
                1e-5,
                |s| {
                    Kernel::RopeBackward(RopeBackward {
                        dinp: s.act(&vec![f32::NAN; len]),
                        dout: s.act(&x),
                        cos: s.act(&cos),
                        sin: s.act(&sin),
                        doc_start: None,
                        b,
                        t,
                        h,
                        d,
                    })
                },
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn rope_table_matches_cpu() {
    let k = gpu();
    let llama3 = Llama3Scaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_context: 8192.0,
    };
    for w in WORKING {
        for (t, d, scaling) in [(1, 2, None), (7, 12, None), (130, 64, Some(llama3))] {
            let len = t * d / 2;
            let freqs = RopeFreqs {
                theta: 500_000.0,
                llama3: scaling,
            };
            let tag = format!("rope-table t={t} d={d} llama3={}", scaling.is_some());
            compare(&k, &tag, w, &scalars(), 1e-5, |s| {
                Kernel::RopeTable(RopeTable {
                    cos: s.act(&vec![f32::NAN; len]),
                    sin: s.act(&vec![f32::NAN; len]),
                    t,
                    d,
                    freqs,
                })
            });
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn swiglu_matches_cpu() {
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(23);
    for w in WORKING {
        for n in [1, 7, 22, 4097, 1_000_003] {
            let gate = random(&mut rng, w, n, 6.0);
            let up = random(&mut rng, w, n, 2.0);
            let dout = random(&mut rng, w, n, 1.0);
            let what = format!("n={n}");
            compare(&k, &format!("swiglu {what}"), w, &scalars(), 1e-5, |s| {
                Kernel::SwiGlu(SwiGlu {
                    out: s.act(&vec![f32::NAN; n]),
                    gate: s.act(&gate),
                    up: s.act(&up),
                })
            });
            compare(
                &k,
                &format!("swiglu-backward {what}"),
                w,
                &scalars(),
                1e-5,
                |s| {
                    Kernel::SwiGluBackward(SwiGluBackward {
                        dgate: s.act(&vec![f32::NAN; n]),
                        dup: s.act(&vec![f32::NAN; n]),
                        dout: s.act(&dout),
                        gate: s.act(&gate),
                        up: s.act(&up),
                    })
                },
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn gqa_attention_matches_cpu() {
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(24);
    for w in WORKING {
        for (b, t, h, kv, d) in [
            (1, 1, 2, 1, 4),
            (2, 13, 6, 2, 12),
            (2, 13, 6, 6, 12),
            (1, 130, 8, 2, 64),
            (3, 37, 4, 1, 16),
        ] {
            let dims = GqaDims { b, t, h, kv, d };
            let q = random(&mut rng, w, dims.q_len(), 2.0);
            let kk = random(&mut rng, w, dims.kv_len(), 2.0);
            let v = random(&mut rng, w, dims.kv_len(), 2.0);
            let dout = random(&mut rng, w, dims.q_len(), 1.0);
            let tag = format!("b={b} t={t} h={h} kv={kv} d={d}");
            compare(
                &k,
                &format!("gqa-attention {tag}"),
                w,
                &scalars(),
                1e-5,
                |s| {
                    Kernel::GqaAttention(GqaAttention {
                        out: s.act(&vec![f32::NAN; dims.q_len()]),
                        att: s.act(&vec![f32::NAN; dims.att_len()]),
                        q: s.act(&q),
                        k: s.act(&kk),
                        v: s.act(&v),
                        scratch: s.gqa_scratch(dims),
                        b,
                        t,
                        h,
                        kv,
                        d,
                    })
                },
            );
            // The backward from the CPU's probabilities (rounded to the working type),
            // so only the backward differs.
            let (mut out, mut att) = (vec![0.0; dims.q_len()], vec![0.0; dims.att_len()]);
            ops::gqa_attention_forward(&CPU, &mut out, &mut att, &q, &kk, &v, dims);
            let att: Vec<f32> = att.iter().map(|&x| round(w, x)).collect();
            compare(
                &k,
                &format!("gqa-attention-backward {tag}"),
                w,
                &scalars(),
                1e-5,
                |s| {
                    Kernel::GqaAttentionBackward(GqaAttentionBackward {
                        dq: s.act(&vec![f32::NAN; dims.q_len()]),
                        dk: s.act(&vec![f32::NAN; dims.kv_len()]),
                        dv: s.act(&vec![f32::NAN; dims.kv_len()]),
                        dout: s.act(&dout),
                        q: s.act(&q),
                        k: s.act(&kk),
                        v: s.act(&v),
                        att: s.act(&att),
                        scratch: s.gqa_scratch(dims),
                        b,
                        t,
                        h,
                        kv,
                        d,
                    })
                },
            );
        }
    }
}

/// The fused kernels' masks for `b` × `t`: causal, a window of 5, and documents of 1 to
/// 7 tokens (their starts a u32 tensor of each side).
fn flash_masks(b: usize, t: usize) -> Vec<(String, usize, Option<Vec<u32>>)> {
    let mut starts = Vec::with_capacity(b * t);
    for bi in 0..b {
        let (mut start, mut len) = (0, 2 + bi);
        for i in 0..t {
            if i - start >= len {
                (start, len) = (i, len % 7 + 1);
            }
            starts.push(start as u32);
        }
    }
    vec![
        ("causal".into(), 0, None),
        ("window 5".into(), 5, None),
        ("documents".into(), 0, Some(starts)),
    ]
}

#[test]
#[ignore = "needs a GPU"]
fn flash_attention_matches_cpu() {
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(25);
    for w in WORKING {
        for (b, t, h, kv, d) in [(1, 1, 2, 1, 4), (2, 13, 6, 2, 12), (1, 130, 8, 2, 64)] {
            let dims = GqaDims { b, t, h, kv, d };
            let q = random(&mut rng, w, dims.q_len(), 2.0);
            let kk = random(&mut rng, w, dims.kv_len(), 2.0);
            let v = random(&mut rng, w, dims.kv_len(), 2.0);
            let dout = random(&mut rng, w, dims.q_len(), 1.0);
            for (name, window, starts) in flash_masks(b, t) {
                let tag = format!("b={b} t={t} h={h} kv={kv} d={d} {name}");
                let mask = |s: &mut Side| FlashMask {
                    window,
                    doc_start: starts.as_ref().map(|d| s.u32s(d)),
                };
                let scratch = |s: &mut Side| {
                    let bytes = flash_scratch_bytes(s.target, dims);
                    s.scratch(bytes)
                };
                let forward = |s: &mut Side| GqaFlashAttention {
                    out: s.act(&vec![f32::NAN; dims.q_len()]),
                    lse: s.f32s(&vec![f32::NAN; b * h * t]),
                    q: s.act(&q),
                    k: s.act(&kk),
                    v: s.act(&v),
                    scratch: scratch(s),
                    dims,
                    mask: mask(s),
                };
                let what = format!("gqa-flash-attention {tag}");
                compare(&k, &what, w, &scalars(), 1e-5, |s| {
                    Kernel::GqaFlashAttention(forward(s))
                });
                // The backward from the CPU's out and lse (out rounded to the working
                // type), so only the backward differs.
                let cpu_mask = AttnMask {
                    window: (window > 0).then_some(window),
                    doc_start: starts.as_deref(),
                };
                let (mut out, mut lse) = (vec![0.0; dims.q_len()], vec![0.0; b * h * t]);
                let mut cpu_scratch = vec![0.0; flash_scratch_bytes(Target::Cpu, dims) / 4];
                let qkv = (&q[..], &kk[..], &v[..]);
                let fwd = (&mut out[..], &mut lse[..], &mut cpu_scratch[..]);
                ops::gqa_flash_attention_forward(&CPU, fwd, qkv, dims, cpu_mask);
                let out: Vec<f32> = out.iter().map(|&x| round(w, x)).collect();
                let what = format!("gqa-flash-attention-backward {tag}");
                compare(&k, &what, w, &scalars(), 1e-5, |s| {
                    Kernel::GqaFlashAttentionBackward(GqaFlashAttentionBackward {
                        dq: s.act(&vec![f32::NAN; dims.q_len()]),
                        dk: s.act(&vec![f32::NAN; dims.kv_len()]),
                        dv: s.act(&vec![f32::NAN; dims.kv_len()]),
                        dout: s.act(&dout),
                        q: s.act(&q),
                        k: s.act(&kk),
                        v: s.act(&v),
                        out: s.act(&out),
                        lse: s.f32s(&lse),
                        scratch: scratch(s),
                        dims,
                        mask: mask(s),
                    })
                });
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn zero_and_copy_match_cpu_bit_for_bit() {
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(8);
    for w in WORKING {
        for n in [1, 7, 22, 4097] {
            let values = random(&mut rng, w, n, 3.0);
            let other = random(&mut rng, w, n, 3.0);
            for zero in [true, false] {
                let mut cpu = Side::new(Target::Cpu, w);
                let mut gpu = Side::new(Target::Cuda, w);
                let build = |s: &mut Side| {
                    let dst = s.act(&values);
                    if zero {
                        Kernel::Zero(Zero { t: dst })
                    } else {
                        Kernel::Copy(CopyKernel {
                            dst,
                            src: s.act(&other),
                        })
                    }
                };
                let (ck, gk) = (build(&mut cpu), build(&mut gpu));
                let cpu_after = run_host(&ck, &cpu.image, &scalars());
                let gpu_after = run_gpu(&k, &gk, &gpu.image, &scalars());
                let (ct, gt) = (written(&ck)[0], written(&gk)[0]);
                let (got, want) = (decode(&gpu_after, &gt), decode(&cpu_after, &ct));
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{} {w} n={n}",
                    ck.name()
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn crossentropy_matches_cpu() {
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(6);
    for w in WORKING {
        for (n, v) in [(1, 1), (7, 22), (37, 101), (5, 50257)] {
            let logits = random(&mut rng, w, n * v, 8.0);
            let targets: Vec<u32> = (0..n).map(|_| rng.random_range(0..v as u32)).collect();
            let scalars = Scalars {
                dloss: 1.0 / n as f32,
                ..scalars()
            };
            let tag = format!("n={n} v={v}");
            compare(&k, &format!("crossentropy {tag}"), w, &scalars, 1e-5, |s| {
                Kernel::CrossEntropy(CrossEntropy {
                    losses: s.f32s(&vec![0.0; n]),
                    logits: s.act(&logits),
                    targets: s.u32s(&targets),
                    n,
                    v,
                })
            });
            compare(
                &k,
                &format!("crossentropy-backward {tag}"),
                w,
                &scalars,
                1e-5,
                |s| {
                    Kernel::CrossEntropyBackward(CrossEntropyBackward {
                        logits: s.act(&logits),
                        targets: s.u32s(&targets),
                        n,
                        v,
                    })
                },
            );
        }
    }
}

/// Parameters, moments and gradients of `n` elements, over several decades.
fn adam_inputs(rng: &mut StdRng, n: usize) -> [Vec<f32>; 4] {
    let p: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0..2.0)).collect();
    let m: Vec<f32> = (0..n).map(|_| rng.random_range(-1e-2..1e-2)).collect();
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(0.0..1e-4)).collect();
    let g: Vec<f32> = (0..n)
        .map(|i| {
            if i % 97 == 0 {
                0.0
            } else {
                rng.random_range(-1.0f32..1.0) * 10f32.powi(rng.random_range(-4..2))
            }
        })
        .collect();
    [p, m, v, g]
}

/// The copy-out kinds: (copy_out dtype, round).
const COPIES: [(Option<Dtype>, Dtype); 6] = [
    (None, Dtype::F32),
    (Some(Dtype::Bf16), Dtype::Bf16),
    (Some(Dtype::F16), Dtype::F16),
    (Some(Dtype::F32), Dtype::F32),
    (Some(Dtype::F32), Dtype::Bf16),
    (Some(Dtype::F32), Dtype::F16),
];

/// An AdamW kernel over `inputs` in a fresh GPU image.
fn adam_case(
    inputs: &[Vec<f32>; 4],
    copy: Option<Dtype>,
    round_to: Dtype,
    decay: bool,
) -> (Side, Kernel) {
    let n = inputs[0].len();
    let mut s = Side::new(Target::Cuda, Dtype::F32);
    let kernel = Kernel::AdamW(AdamWKernel {
        params: s.f32s(&inputs[0]),
        m: s.f32s(&inputs[1]),
        v: s.f32s(&inputs[2]),
        grads: s.f32s(&inputs[3]),
        copy_out: copy.map(|dtype| {
            let bytes = vec![0u8; n * dtype.size()];
            s.place(n, dtype, &bytes)
        }),
        round: round_to,
        decay,
    });
    (s, kernel)
}

/// The GPU's AdamW step is this process's CPU AdamW (the instruction set `Isa::active`
/// chose, or `STRATA_ISA` names: fused multiply-adds on AVX2 and AVX-512, none on the
/// portable kernel) bit for bit, so a policy that updates on the GPU trains the same
/// model as one that updates on the CPU.
#[test]
#[ignore = "needs a GPU"]
fn adamw_is_the_cpu_optimizer_bit_for_bit() {
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(9);
    let hp = AdamW::default();
    let no_decay = AdamW {
        weight_decay: 0.0,
        ..hp
    };
    let scalars = Scalars {
        adam: Some(AdamStep::new(&hp, 7, 0.5).unwrap()),
        adam_no_decay: Some(AdamStep::new(&no_decay, 7, 0.5).unwrap()),
        ..Scalars::default()
    };
    let isa = Isa::active();
    for n in [1, 7, 22, 4097, 1_000_003] {
        let inputs = adam_inputs(&mut rng, n);
        for (copy, round_to) in COPIES {
            for decay in [true, false] {
                let tag = format!("adamw {isa} n={n} copy={copy:?} round={round_to} decay={decay}");
                let (side, kernel) = adam_case(&inputs, copy, round_to, decay);
                let after = run_gpu(&k, &kernel, &side.image, &scalars);
                let Kernel::AdamW(AdamWKernel {
                    params,
                    m,
                    v,
                    copy_out,
                    ..
                }) = kernel
                else {
                    unreachable!()
                };
                let step = if decay {
                    scalars.adam
                } else {
                    scalars.adam_no_decay
                }
                .unwrap();
                let [mut p_cpu, mut m_cpu, mut v_cpu, g] = inputs.clone();
                let state = State::F32 {
                    m: &mut m_cpu,
                    v: &mut v_cpu,
                };
                step.apply(isa, 1, &mut p_cpu, state, Grads::F32(&g), CopyOut::None)
                    .unwrap();
                let (p_got, m_got, v_got) = (
                    decode(&after, &params),
                    decode(&after, &m),
                    decode(&after, &v),
                );
                for (what, got, want) in [
                    ("p", &p_got, &p_cpu),
                    ("m", &m_got, &m_cpu),
                    ("v", &v_got, &v_cpu),
                ] {
                    if let Some(i) = (0..n).find(|&i| got[i].to_bits() != want[i].to_bits()) {
                        panic!(
                            "{tag}: {what}[{i}] {} on the GPU, {} on the CPU (p {}, m {}, v {}, g {})",
                            got[i], want[i], inputs[0][i], inputs[1][i], inputs[2][i], g[i]
                        );
                    }
                }
                println!("{tag}: {n} of {n} elements bit-exact with the CPU's");
                // The working copy is the GPU's own new parameters, rounded.
                if let Some(out) = copy_out {
                    let expected: Vec<u16> = match out.dtype {
                        Dtype::Bf16 => p_got.iter().map(|&x| bf16::from_f32(x).to_bits()).collect(),
                        Dtype::F16 => p_got.iter().map(|&x| f16::from_f32(x).to_bits()).collect(),
                        _ => Vec::new(),
                    };
                    if out.dtype == Dtype::F32 {
                        let got = decode(&after, &out);
                        for i in 0..n {
                            let want = round(round_to, p_got[i]);
                            assert_eq!(got[i].to_bits(), want.to_bits(), "{tag}: copy[{i}]");
                        }
                    } else {
                        assert_eq!(bits16(&after, &out), expected, "{tag}: copy");
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn adamw_skips_and_rounds_edge_cases_as_half_does() {
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(10);
    // With the skip flag nothing changes, constants or not.
    let inputs = adam_inputs(&mut rng, 4097);
    let (side, kernel) = adam_case(&inputs, Some(Dtype::Bf16), Dtype::Bf16, true);
    let skip = Scalars {
        skip_update: true,
        ..Scalars::default()
    };
    assert_eq!(run_gpu(&k, &kernel, &side.image, &skip), side.image);
    // With lr 0 and no decay a step leaves non-zero parameters as they are, so the
    // working copies are the conversions of arbitrary bit patterns.
    let frozen = AdamW {
        lr: 0.0,
        weight_decay: 0.0,
        ..AdamW::default()
    };
    let step = AdamStep::new(&frozen, 1, 1.0).unwrap();
    let scalars = Scalars {
        adam: Some(step),
        ..Scalars::default()
    };
    let mut p: Vec<f32> = (0..100_003)
        .map(|_| f32::from_bits(rng.random::<u32>()))
        .collect();
    p.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        65504.0,
        65520.0,
        1e-8,
        5.9604645e-8,
        f32::MAX,
        f32::MIN_POSITIVE,
        1.0 + f32::EPSILON,
        f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0xffc1_2345),
    ]);
    let n = p.len();
    let inputs = [p.clone(), vec![0.0; n], vec![0.0; n], vec![1e-3; n]];
    for dtype in [Dtype::Bf16, Dtype::F16] {
        let (side, kernel) = adam_case(&inputs, Some(dtype), dtype, true);
        let after = run_gpu(&k, &kernel, &side.image, &scalars);
        let Kernel::AdamW(AdamWKernel {
            params, copy_out, ..
        }) = kernel
        else {
            unreachable!()
        };
        let p_got = decode(&after, &params);
        let copies = bits16(&after, &copy_out.unwrap());
        for i in 0..n {
            let x = p[i];
            if x.is_nan() {
                let copy_is_nan = match dtype {
                    Dtype::Bf16 => bf16::from_bits(copies[i]).is_nan(),
                    _ => f16::from_bits(copies[i]).is_nan(),
                };
                assert!(p_got[i].is_nan() && copy_is_nan, "{dtype}: NaN at {i}");
                continue;
            }
            if x != 0.0 {
                assert_eq!(p_got[i].to_bits(), x.to_bits(), "{dtype}: p[{i}] moved");
            }
            let want = match dtype {
                Dtype::Bf16 => bf16::from_f32(p_got[i]).to_bits(),
                _ => f16::from_f32(p_got[i]).to_bits(),
            };
            assert_eq!(
                copies[i],
                want,
                "{dtype}: copy of {:e} ({:#x})",
                x,
                x.to_bits()
            );
        }
    }
}

/// The GPU's statistics are the CPU optimizer's bit for bit (the clipping coefficient,
/// and so the update, must not depend on where the update runs): sizes inside one piece,
/// at and across piece boundaries, across blocks of the first pass, and with more pieces
/// than one round of the second pass stages.
#[test]
#[ignore = "needs a GPU"]
fn grad_stats_match_cpu() {
    use strata_kernels::adamw::STATS_PIECE;
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(12);
    let scale = 0.5;
    let scalars = Scalars {
        stats_scale: scale,
        ..Scalars::default()
    };
    let sizes = [
        0,
        1,
        7,
        22,
        4097,
        STATS_PIECE,
        STATS_PIECE + 1,
        17 * STATS_PIECE + 5,
        1_000_003,
        300 * STATS_PIECE + 7,
    ];
    for n in sizes {
        let base: Vec<f32> = (0..n)
            .map(|_| rng.random_range(-1.0f32..1.0) * 10f32.powi(rng.random_range(-6..3)))
            .collect();
        let mut cases = vec![("finite", base.clone())];
        if n > 0 {
            for (name, bad) in [("inf", f32::INFINITY), ("nan", f32::NAN)] {
                let mut g = base.clone();
                g[n / 2] = bad;
                cases.push((name, g));
            }
        }
        for (name, g) in cases {
            let mut s = Side::new(Target::Cuda, Dtype::F32);
            let kernel = Kernel::GradStats(GradStatsKernel {
                grads: s.f32s(&g),
                out: s.scratch(16),
                scratch: s.scratch(grad_stats_scratch_bytes(Target::Cuda, n)),
            });
            let after = run_gpu(&k, &kernel, &s.image, &scalars);
            let Kernel::GradStats(GradStatsKernel { out, .. }) = kernel else {
                unreachable!()
            };
            let got = read_stats(&after[out.byte_range()]);
            let flag = f64::from_le_bytes(after[out.offset_bytes + 8..][..8].try_into().unwrap());
            let want = grad_stats(Isa::active(), 1, Grads::F32(&g), scale).unwrap();
            let tag = format!("grad-stats n={n} {name}");
            println!("{tag}: {} vs {}", got.sum_squares, want.sum_squares);
            assert_eq!(got.non_finite, want.non_finite, "{tag}: flag");
            assert_eq!(flag, if want.non_finite { 1.0 } else { 0.0 }, "{tag}: flag");
            if want.sum_squares.is_finite() {
                assert_eq!(
                    got.sum_squares.to_bits(),
                    want.sum_squares.to_bits(),
                    "{tag}: the sum differs from the CPU's"
                );
            } else {
                assert!(
                    !got.sum_squares.is_finite()
                        && got.sum_squares.is_nan() == want.sum_squares.is_nan(),
                    "{tag}: sum {}",
                    got.sum_squares
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn kernels_repeat_bit_for_bit() {
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(13);
    for w in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
        let (b, t, c, nh, v) = (2, 37, 48, 3, 50257);
        let (n, oc) = (b * t, 4 * c);
        let qkv = random(&mut rng, w, n * 3 * c, 2.0);
        let dout = random(&mut rng, w, n * c, 1.0);
        let att = random(&mut rng, w, b * nh * t * t, 1.0);
        let inp = random(&mut rng, w, n * c, 1.0);
        let weight = random(&mut rng, w, c * oc, 1.0);
        let dout_oc = random(&mut rng, w, n * oc, 1.0);
        let logits = random(&mut rng, w, 5 * v, 8.0);
        let targets: Vec<u32> = (0..5).map(|_| rng.random_range(0..v as u32)).collect();
        let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..101)).collect();
        let gqa = GqaDims {
            b,
            t,
            h: nh,
            kv: 1,
            d: c / nh,
        };
        let mut s = Side::new(Target::Cuda, w);
        let kernels = [
            Kernel::AttentionBackward(AttentionBackward {
                dqkv: s.act(&vec![0.0; n * 3 * c]),
                dout: s.act(&dout),
                qkv: s.act(&qkv),
                att: s.act(&att),
                scratch: s.attention_scratch(b, t, c, nh),
                b,
                t,
                c,
                nh,
            }),
            Kernel::MatmulBackward(MatmulBackward {
                dinp: s.act(&vec![0.0; n * c]),
                weight_grad: Some(WeightGrad {
                    dweight: s.f32s(&vec![0.0; c * oc]),
                    inp: s.act(&inp),
                }),
                dbias: Some(s.f32s(&vec![0.0; oc])),
                dout: s.act(&dout_oc),
                weight: s.act(&weight),
                layout: WeightLayout::InOut,
                n,
                c,
                oc,
            }),
            Kernel::LayerNormBackward(LayerNormBackward {
                dinp: s.act(&vec![0.0; n * c]),
                params: Some(LayerNormGrads {
                    dweight: s.f32s(&vec![0.0; c]),
                    dbias: s.f32s(&vec![0.0; c]),
                }),
                dout: s.act(&dout),
                inp: s.act(&inp),
                weight: s.act(&weight[..c]),
                mean: s.f32s(&vec![0.1; n]),
                rstd: s.f32s(&vec![1.5; n]),
                n,
                c,
            }),
            Kernel::EncoderBackward(EncoderBackward {
                dwte: s.f32s(&vec![0.0; 101 * c]),
                dwpe: s.f32s(&vec![0.0; t * c]),
                dout: s.act(&dout),
                tokens: s.u32s(&tokens),
                b,
                t,
                c,
            }),
            Kernel::CrossEntropyBackward(CrossEntropyBackward {
                logits: s.act(&logits),
                targets: s.u32s(&targets),
                n: 5,
                v,
            }),
            Kernel::GradStats(GradStatsKernel {
                grads: s.f32s(&random(&mut rng, Dtype::F32, 300_001, 1.0)),
                out: s.scratch(16),
                scratch: s.scratch(grad_stats_scratch_bytes(Target::Cuda, 300_001)),
            }),
            Kernel::RmsNormBackward(RmsNormBackward {
                dinp: s.act(&vec![0.0; n * c]),
                dweight: Some(s.f32s(&vec![0.0; c])),
                dout: s.act(&dout),
                inp: s.act(&inp),
                weight: s.act(&weight[..c]),
                rstd: s.f32s(&vec![1.5; n]),
                n,
                c,
            }),
            Kernel::GqaAttentionBackward(GqaAttentionBackward {
                dq: s.act(&vec![0.0; n * c]),
                dk: s.act(&vec![0.0; n * c / nh]),
                dv: s.act(&vec![0.0; n * c / nh]),
                dout: s.act(&dout),
                q: s.act(&qkv[..n * c]),
                k: s.act(&qkv[n * c..][..n * c / nh]),
                v: s.act(&qkv[2 * n * c..][..n * c / nh]),
                att: s.act(&att),
                scratch: s.gqa_scratch(gqa),
                b,
                t,
                h: nh,
                kv: 1,
                d: c / nh,
            }),
        ];
        for kernel in &kernels {
            let first = run_gpu(&k, kernel, &s.image, &scalars());
            let second = run_gpu(&k, kernel, &s.image, &scalars());
            assert_ne!(first, s.image, "{} {w} wrote nothing", kernel.name());
            assert!(first == second, "{} {w}: two runs differ", kernel.name());
        }
    }
}

/// The randomized weight gradients (f32 only): the projection, and the weight gradient
/// in each layout, overwritten (NaN beforehand shows a read) and accumulated, with a
/// step's seed mixed in on both sides. The sketch and `Sᵀ dy` in the scratch are
/// compared too.
#[test]
#[ignore = "needs a GPU"]
fn sketch_matches_cpu() {
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(14);
    let w = Dtype::F32;
    let scalars = Scalars {
        sketch: 3,
        ..scalars()
    };
    for (rows, ci, co, kk) in [
        (1, 1, 1, 1),
        (7, 22, 13, 4),
        (130, 64, 257, 32),
        (300, 77, 50, 64),
    ] {
        let x = random(&mut rng, w, rows * ci, 1.0);
        let what = format!("sketch-project {rows}x{ci} k={kk}");
        compare(&k, &what, w, &scalars, 1e-5, |s| {
            Kernel::SketchProject(SketchProject {
                out: s.f32s(&vec![f32::NAN; kk * ci]),
                x: s.f32s(&x),
                scratch: s.f32s(&vec![f32::NAN; rows * kk]),
                rows,
                cols: ci,
                k: kk,
                seed: 21,
            })
        });
        let dy = random(&mut rng, w, rows * co, 1.0);
        let x_proj = random(&mut rng, w, kk * ci, 1.0);
        let dw = random(&mut rng, w, ci * co, 1.0);
        for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
            for accumulate in [false, true] {
                let what = format!(
                    "sketch-weight-grad {layout:?} accumulate={accumulate} \
                     {rows}x{ci}x{co} k={kk}"
                );
                let dw_before = if accumulate {
                    dw.clone()
                } else {
                    vec![f32::NAN; ci * co]
                };
                compare(&k, &what, w, &scalars, 1e-5, |s| {
                    Kernel::SketchWeightGrad(SketchWeightGrad {
                        dw: s.f32s(&dw_before),
                        dy: s.f32s(&dy),
                        x_proj: s.f32s(&x_proj),
                        scratch: s.f32s(&vec![f32::NAN; rows * kk + kk * co]),
                        rows,
                        cols_in: ci,
                        cols_out: co,
                        k: kk,
                        seed: 21,
                        layout,
                        accumulate,
                    })
                });
            }
        }
    }
}

/// Inputs of a few-bit forward in `dtype`: every third element on or beside one of
/// `tables`' breakpoints (on it, one f32 step and 1e-3 either side, then rounded to
/// `dtype`; -0.0 too), the others uniform in [-4, 4).
fn fewbit_inputs(rng: &mut StdRng, dtype: Dtype, n: usize, tables: &[Table; 4]) -> Vec<f32> {
    let near: Vec<f32> = tables
        .iter()
        .flat_map(|table| table.breakpoints)
        .flat_map(|&t| [t, t.next_up(), t.next_down(), t + 1e-3, t - 1e-3])
        .chain([-0.0])
        .map(|x| round(dtype, x))
        .collect();
    (0..n)
        .map(|i| match i % 3 {
            0 => near[(i / 3) % near.len()],
            _ => round(dtype, rng.random_range(-4.0..4.0)),
        })
        .collect()
}

/// The few-bit kernels at every width, in every working type. The forwards' codes word
/// for word (both count the same f32 comparisons; inputs on and beside every breakpoint,
/// codes initially all ones so an unwritten word shows); their values within the file's
/// tolerances, since the CPU's sigmoid and the device's `expf` differ in the last bits.
/// The backwards exactly: one or two f32 products of the same values in the same order on
/// both, rounded once to the working type; their codes are random words, the last
/// group's unused bits set too, which neither side may read.
#[test]
#[ignore = "needs a GPU"]
fn fewbit_matches_cpu() {
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(15);
    let codes = |t: &TensorRef| t.dtype == Dtype::U32;
    for w in WORKING {
        for n in [1, 31, 33, 4097, 100_003] {
            let inp = fewbit_inputs(&mut rng, w, n, &GELU_TABLES);
            let gate = fewbit_inputs(&mut rng, w, n, &SILU_TABLES);
            let up = random(&mut rng, w, n, 3.0);
            let dout = random(&mut rng, w, n, 1.0);
            let act = random(&mut rng, w, n, 3.0);
            let unset = vec![f32::NAN; n];
            for bits in Bits::ALL {
                let words = codes_len(n, bits);
                let unwritten = vec![u32::MAX; words];
                let saved: Vec<u32> = (0..words).map(|_| rng.random()).collect();
                let tag = format!("{bits:?} bits, n={n}");

                let what = format!("fewbit-gelu {tag}");
                let ran = run_both(&k, w, &scalars(), |s| {
                    Kernel::FewBitGelu(FewBitGelu {
                        out: s.act(&unset),
                        codes: s.u32s(&unwritten),
                        inp: s.act(&inp),
                        bits,
                    })
                });
                ran.assert_close(&what, w, 1e-5);
                ran.assert_exact(&what, codes);

                let what = format!("fewbit-gelu-backward {tag}");
                let ran = run_both(&k, w, &scalars(), |s| {
                    Kernel::FewBitGeluBackward(FewBitGeluBackward {
                        dinp: s.act(&unset),
                        codes: s.u32s(&saved),
                        dout: s.act(&dout),
                        bits,
                    })
                });
                ran.assert_exact(&what, |_| true);

                let what = format!("fewbit-swiglu {tag}");
                let ran = run_both(&k, w, &scalars(), |s| {
                    Kernel::FewBitSwiGlu(FewBitSwiGlu {
                        out: s.act(&unset),
                        act: s.act(&unset),
                        codes: s.u32s(&unwritten),
                        gate: s.act(&gate),
                        up: s.act(&up),
                        bits,
                    })
                });
                ran.assert_close(&what, w, 1e-5);
                ran.assert_exact(&what, codes);

                let what = format!("fewbit-swiglu-backward {tag}");
                let ran = run_both(&k, w, &scalars(), |s| {
                    Kernel::FewBitSwiGluBackward(FewBitSwiGluBackward {
                        dgate: s.act(&unset),
                        dup: s.act(&unset),
                        codes: s.u32s(&saved),
                        dout: s.act(&dout),
                        act: s.act(&act),
                        up: s.act(&up),
                        bits,
                    })
                });
                ran.assert_exact(&what, |_| true);
            }
        }
    }
}

/// `n` values for quantisation: each block of 64 uniform in ±10^e for a random e in
/// -3..=1, the second block all zeros (absmax 0).
fn quant_inputs(rng: &mut StdRng, n: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(n);
    for b in 0..n.div_ceil(NF4_BLOCK) {
        let scale = 10f32.powi(rng.random_range(-3..=1));
        let len = NF4_BLOCK.min(n - b * NF4_BLOCK);
        x.extend((0..len).map(|_| match b {
            1 => 0.0,
            _ => rng.random_range(-scale..scale),
        }));
    }
    x
}

/// NF4 and int8 dequantisation bit for bit, in every working type: `quant.cu` makes the
/// CPU's f32 roundings in the CPU's order (each product and sum rounded on its own, none
/// fused), then rounds once to the working type, as the CPU's bf16 path does. Each size
/// twice: a quantised tensor (blocks of magnitudes 1e-3 to 10, a block of zeros), and
/// arbitrary parts (random nibbles, every absmax code 0..=255 in turn, random int8
/// bytes, -128 among them, which quantisation never makes); 40,001 values span three
/// absmax groups, odd sizes a half-used last byte.
#[test]
#[ignore = "needs a GPU"]
fn dequantisation_matches_cpu_bit_for_bit() {
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(16);
    for w in WORKING {
        for n in [1, 33, 4097, 40_001] {
            let x = quant_inputs(&mut rng, n);
            let mut bytes = |len: usize| -> Vec<u8> { (0..len).map(|_| rng.random()).collect() };
            let arbitrary_nf4 = Nf4Blocks {
                len: n,
                codes: bytes(n.div_ceil(2)),
                absmax_q: (0..Nf4Blocks::block_count(n)).map(|b| b as u8).collect(),
                absmax_scale: vec![0.75; Nf4Blocks::group_count(n)],
                absmax_offset: 0.3,
            };
            let arbitrary_int8 = Int8Blocks {
                codes: bytes(n),
                scales: (0..n.div_ceil(INT8_BLOCK))
                    .map(|_| rng.random_range(1e-4..1.0))
                    .collect(),
            };
            let unset = vec![f32::NAN; n];
            let sources = [
                (
                    "quantised",
                    Nf4Blocks::quantize(&x),
                    Int8Blocks::quantize(&x),
                ),
                ("arbitrary", arbitrary_nf4, arbitrary_int8),
            ];
            for (source, nf4, int8) in &sources {
                let what = format!("nf4-dequantize {source} n={n}");
                let ran = run_both(&k, w, &scalars(), |s| {
                    Kernel::Nf4Dequantize(Nf4Dequantize {
                        out: s.act(&unset),
                        codes: s.u8s(&nf4.codes),
                        absmax_q: s.u8s(&nf4.absmax_q),
                        absmax_scale: s.f32s(&nf4.absmax_scale),
                        absmax_offset: s.f32s(&[nf4.absmax_offset]),
                        round_bf16: false,
                    })
                });
                ran.assert_exact(&what, |_| true);

                let what = format!("int8-dequantize {source} n={n}");
                let ran = run_both(&k, w, &scalars(), |s| {
                    Kernel::Int8Dequantize(Int8Dequantize {
                        out: s.act(&unset),
                        codes: s.u8s(&int8.codes),
                        scales: s.f32s(&int8.scales),
                        round_bf16: false,
                    })
                });
                ran.assert_exact(&what, |_| true);
            }
        }
    }
}

/// f32 gradients rounded to bf16's precision in place, and scaled in place, bit for bit:
/// one operation per element on both sides (the rounding integer arithmetic on the bits,
/// a NaN quieted by the same rule). Values of every magnitude and random bit patterns
/// (subnormals among them), ties to even, a carry into the exponent, overflow to
/// infinity; NaNs with payloads for the rounding only (a product's NaN payload is the
/// hardware's choice).
#[test]
#[ignore = "needs a GPU"]
fn round_bf16_and_scale_match_cpu_bit_for_bit() {
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(17);
    let specials = [
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        f32::MIN_POSITIVE,
        1e-45,
        f32::from_bits(0x3f80_8000), // ties: halfway between two bf16 values
        f32::from_bits(0x3f81_8000),
        f32::from_bits(0x3f7f_ffff), // rounds up into the next binade
    ];
    let nans = [
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0xffc1_2345),
    ];
    let w = Dtype::F32;
    for n in [1, 33, 4097, 100_003] {
        let mut finite: Vec<f32> = (0..n)
            .map(|i| match i % 2 {
                0 => rng.random_range(-3.0f32..3.0) * 10f32.powi(rng.random_range(-40..38)),
                _ => f32::from_bits(rng.random::<u32>() & !0x4000_0000), // below 2 in size
            })
            .collect();
        for (v, s) in finite.iter_mut().zip(specials) {
            *v = s;
        }
        let mut with_nans = finite.clone();
        for (v, nan) in with_nans.iter_mut().rev().zip(nans) {
            *v = nan;
        }
        let what = format!("round-bf16 n={n}");
        let ran = run_both(&k, w, &scalars(), |s| {
            Kernel::RoundBf16(RoundBf16 {
                x: s.f32s(&with_nans),
            })
        });
        ran.assert_exact(&what, |_| true);
        for factor in [0.375, -1e-3, 65536.0] {
            let what = format!("scale {factor} n={n}");
            let ran = run_both(&k, w, &scalars(), |s| {
                Kernel::Scale(Scale {
                    x: s.f32s(&finite),
                    factor,
                })
            });
            ran.assert_exact(&what, |_| true);
        }
    }
}

/// The elementwise product bit for bit in every working type: one f32 product of the
/// same values on both sides, rounded once to the working type.
#[test]
#[ignore = "needs a GPU"]
fn mul_matches_cpu_bit_for_bit() {
    let k = gpu();
    let mut rng = StdRng::seed_from_u64(18);
    for w in WORKING {
        for n in [1, 33, 4097, 1_000_003] {
            let a = random(&mut rng, w, n, 6.0);
            let b = random(&mut rng, w, n, 2.0);
            let unset = vec![f32::NAN; n];
            let ran = run_both(&k, w, &scalars(), |s| {
                Kernel::Mul(Mul {
                    out: s.act(&unset),
                    a: s.act(&a),
                    b: s.act(&b),
                })
            });
            ran.assert_exact(&format!("mul n={n}"), |_| true);
        }
    }
}
