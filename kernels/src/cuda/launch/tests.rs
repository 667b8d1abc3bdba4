//! The CUDA runner checked without a GPU, through [`Emulator`], a [`KernelQueue`] that
//! records every call and can execute the cuBLAS products and the few kernels around them
//! (in f32, on host memory):
//!
//! - every launch's arguments against the parameter lists of the compiled kernels (the
//!   `.entry` lines of NVRTC's PTX), for every kernel in every working type, and every
//!   entry point launched by some kernel;
//! - every pointer a launch or a product gets is the start of one of the kernel's tensors
//!   (or of one region of its scratch), and every product's operands, at their leading
//!   dimensions and batch strides, stay inside them;
//! - the launch sequences of the products (matmul, attention) compute what the CPU
//!   computes, with the scratch filled with NaN beforehand;
//! - refused kernels enqueue nothing.
//!
//! What is particular to a kernel lives with it, in its family's tests ([`Emulated`]):
//! its samples at odd and empty sizes, the values its launches' sizes must have, and the
//! emulation of its `.cu` kernels where a test executes them. The registry
//! ([`crate::kernel`]) gathers them, so a new kernel is emulated once it implements
//! [`Emulated`]. What only a GPU can check (the `.cu` kernels' own arithmetic, cuBLAS
//! itself) is in `kernels/tests/cuda_ops.rs`.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};

use cudarc::cublas::sys::cudaDataType_t;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use super::*;
use crate::adamw::{AdamStep, AdamW};
use crate::cuda::program::{self, entry_points};
use crate::isa::Isa;
use crate::kernel::optimizer::CopyMode;
use crate::kernel::{
    AdamWKernel, Attention, AttentionBackward, Gelu, GqaAttention, GqaAttentionBackward,
    GradStatsKernel, Kernel, Matmul, MatmulBackward, Rope, WeightGrad,
};
use crate::ops::{Cpu, WeightLayout};
use crate::program::{
    Access, CpuMemory, GRAD_STATS_THREADS, attention_scratch_bytes, gqa_attention_scratch_bytes,
    grad_stats_scratch_bytes, run_cpu,
};

/// Buffers lie this many bytes apart, so that no access can stray from one into another.
const SPAN: u64 = 1 << 36;
/// Where each tensor starts in its buffer: not zero, so that offsets are exercised.
const OFFSET_BYTES: usize = 256;

/// The device address of a tensor: buffer `buf` starts at `SPAN * (buf + 1)`.
pub(crate) fn address(t: &TensorRef) -> u64 {
    SPAN * (u64::from(t.buf) + 1) + t.offset_bytes as u64
}

/// Tensors, one buffer each. Buffer numbers wrap around after 256 (a binding index is a
/// u8): the tensors of one kernel are made one after the other, so they never share a
/// buffer; [`Buffers`] needs at most 256.
#[derive(Default)]
pub(crate) struct Layout {
    buffer_bytes: Vec<usize>,
}

impl Layout {
    /// A tensor of `len` elements of `dtype`, in a buffer of its own.
    pub(crate) fn tensor(&mut self, len: usize, dtype: Dtype) -> TensorRef {
        let buf = (self.buffer_bytes.len() % 256) as u8;
        let t = TensorRef::new(buf, OFFSET_BYTES, len, dtype);
        self.buffer_bytes.push(OFFSET_BYTES + t.bytes());
        t
    }
}

/// Host memory of a [`Layout`]: each buffer 8-byte aligned, with its exact length.
#[derive(Clone)]
pub(crate) struct Buffers {
    words: Vec<Vec<f64>>,
    bytes: Vec<usize>,
}

impl Buffers {
    fn new(layout: &Layout) -> Self {
        assert!(
            layout.buffer_bytes.len() <= 256,
            "more buffers than bindings"
        );
        Buffers {
            words: layout
                .buffer_bytes
                .iter()
                .map(|&b| vec![0.0; b.div_ceil(8)])
                .collect(),
            bytes: layout.buffer_bytes.clone(),
        }
    }

    fn buffer_mut(&mut self, buf: usize) -> &mut [u8] {
        let words = &mut self.words[buf];
        // SAFETY: the bytes of the buffer's own f64s (any bit pattern is a valid u8),
        // borrowed mutably through `self`, cut to its exact length.
        unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), self.bytes[buf]) }
    }

    fn buffer(&self, buf: usize) -> &[u8] {
        let words = &self.words[buf];
        // SAFETY: as in buffer_mut, shared.
        unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), self.bytes[buf]) }
    }

    fn write_f32(&mut self, t: &TensorRef, values: &[f32]) {
        assert_eq!((t.dtype, t.len), (Dtype::F32, values.len()));
        let bytes = &mut self.buffer_mut(t.buf.into())[t.byte_range()];
        for (chunk, v) in bytes.chunks_exact_mut(4).zip(values) {
            chunk.copy_from_slice(&v.to_le_bytes());
        }
    }

    /// Writes the u32 tensor `t` (token ids, document starts).
    pub(crate) fn write_u32(&mut self, t: &TensorRef, values: &[u32]) {
        assert_eq!((t.dtype, t.len), (Dtype::U32, values.len()));
        let bytes = &mut self.buffer_mut(t.buf.into())[t.byte_range()];
        for (chunk, v) in bytes.chunks_exact_mut(4).zip(values) {
            chunk.copy_from_slice(&v.to_le_bytes());
        }
    }

    /// The f32 elements of `t`.
    pub(crate) fn read_f32(&self, t: &TensorRef) -> Vec<f32> {
        assert_eq!(t.dtype, Dtype::F32);
        self.buffer(t.buf.into())[t.byte_range()]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    /// A view for [`run_cpu`], borrowing the buffers mutably for its life.
    fn cpu_view(&mut self) -> CpuView<'_> {
        CpuView {
            starts: self
                .words
                .iter_mut()
                .map(|w| w.as_mut_ptr().cast::<u8>())
                .collect(),
            bytes: &self.bytes,
        }
    }
}

struct CpuView<'a> {
    starts: Vec<*mut u8>,
    bytes: &'a [usize],
}

impl CpuMemory for CpuView<'_> {
    fn address(&self, t: &TensorRef) -> *mut u8 {
        let buf = usize::from(t.buf);
        assert!(t.offset_bytes + t.bytes() <= self.bytes[buf]);
        // SAFETY: inside the buffer (checked above), whose pointer came from a mutable
        // borrow that the view holds.
        unsafe { self.starts[buf].add(t.offset_bytes) }
    }
}

/// One call a kernel enqueued.
#[derive(Debug, Clone)]
enum Call {
    Launch {
        /// The entry point's full name.
        name: String,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: Vec<Arg>,
    },
    Gemm(Gemm),
    Zero {
        ptr: u64,
        bytes: usize,
    },
    Copy {
        dst: u64,
        src: u64,
        bytes: usize,
    },
}

/// A queue that records every call and, when it has memory, executes the products and
/// the kernels the families emulate ([`Emulated::emulate`]), in f32.
pub(crate) struct Emulator {
    calls: RefCell<Vec<Call>>,
    memory: Option<RefCell<Buffers>>,
}

impl Emulator {
    pub(crate) fn recording() -> Self {
        Emulator {
            calls: RefCell::default(),
            memory: None,
        }
    }

    /// Whether nothing has been enqueued.
    pub(crate) fn is_empty(&self) -> bool {
        self.calls.borrow().is_empty()
    }

    fn executing(buffers: Buffers) -> Self {
        Emulator {
            calls: RefCell::default(),
            memory: Some(RefCell::new(buffers)),
        }
    }

    /// Buffer index and byte offset of `bytes` bytes at `address`; panics outside a buffer.
    fn locate(&self, address: u64, bytes: usize) -> (usize, usize) {
        let memory = self.memory.as_ref().expect("memory").borrow();
        let buf = (address / SPAN) as usize - 1;
        let offset = (address % SPAN) as usize;
        assert!(
            buf < memory.bytes.len() && offset + bytes <= memory.bytes[buf],
            "access of {bytes} bytes at {address:#x} outside every buffer"
        );
        (buf, offset)
    }

    /// Element `i` of the f32 tensor at `ptr`.
    pub(crate) fn load(&self, ptr: u64, i: usize) -> f32 {
        let (buf, at) = self.locate(ptr + 4 * i as u64, 4);
        let memory = self.memory.as_ref().unwrap().borrow();
        f32::from_le_bytes(memory.buffer(buf)[at..at + 4].try_into().unwrap())
    }

    /// Writes element `i` of the f32 tensor at `ptr`.
    pub(crate) fn store(&self, ptr: u64, i: usize, value: f32) {
        let (buf, at) = self.locate(ptr + 4 * i as u64, 4);
        let mut memory = self.memory.as_ref().unwrap().borrow_mut();
        memory.buffer_mut(buf)[at..at + 4].copy_from_slice(&value.to_le_bytes());
    }

    /// Executes one of the emulated f32 kernels, as its family's emulation reads it.
    fn execute(&self, name: &str, args: &[Arg]) {
        assert!(
            crate::kernel::emulate(name, args, self),
            "{name} is not emulated"
        );
    }

    /// cuBLAS's product, column-major, in f64 (f32 operands only). With beta 0, C is not
    /// read, as cuBLAS promises.
    fn execute_gemm(&self, g: &Gemm) {
        for op in [g.a, g.b, g.c] {
            assert_eq!(op.data_type, cudaDataType_t::CUDA_R_32F, "emulated in f32");
        }
        let (count, sa, sb, sc) = g.batch.unwrap_or((1, 0, 0, 0));
        for p in 0..count {
            for j in 0..g.n {
                for i in 0..g.m {
                    let mut acc = 0f64;
                    for l in 0..g.k {
                        let a = if g.a.transposed {
                            p * sa + l + i * g.a.ld
                        } else {
                            p * sa + i + l * g.a.ld
                        };
                        let b = if g.b.transposed {
                            p * sb + j + l * g.b.ld
                        } else {
                            p * sb + l + j * g.b.ld
                        };
                        acc += f64::from(self.load(g.a.ptr, a)) * f64::from(self.load(g.b.ptr, b));
                    }
                    let at = p * sc + i + j * g.c.ld;
                    let mut value = f64::from(g.alpha) * acc;
                    if g.beta != 0.0 {
                        value += f64::from(g.beta) * f64::from(self.load(g.c.ptr, at));
                    }
                    self.store(g.c.ptr, at, value as f32);
                }
            }
        }
    }
}

impl KernelQueue for Emulator {
    unsafe fn launch(
        &self,
        name: &'static str,
        suffix: &'static str,
        config: LaunchConfig,
        args: &[Arg],
    ) -> Result<(), CudaError> {
        let name = if suffix.is_empty() {
            name.to_string()
        } else {
            format!("{name}_{suffix}")
        };
        if self.memory.is_some() {
            self.execute(&name, args);
        }
        self.calls.borrow_mut().push(Call::Launch {
            name,
            grid: config.grid_dim,
            block: config.block_dim,
            args: args.to_vec(),
        });
        Ok(())
    }

    unsafe fn gemm_raw(&self, gemm: &Gemm) -> Result<(), CudaError> {
        if self.memory.is_some() {
            self.execute_gemm(gemm);
        }
        self.calls.borrow_mut().push(Call::Gemm(*gemm));
        Ok(())
    }

    unsafe fn zero(&self, ptr: u64, bytes: usize) -> Result<(), CudaError> {
        if self.memory.is_some() {
            for i in 0..bytes / 4 {
                self.store(ptr, i, 0.0);
            }
        }
        self.calls.borrow_mut().push(Call::Zero { ptr, bytes });
        Ok(())
    }

    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        assert!(self.memory.is_none(), "copies are not emulated");
        self.calls.borrow_mut().push(Call::Copy { dst, src, bytes });
        Ok(())
    }
}

/// What the emulator's tests need of one kernel, beyond its signature: implemented in
/// each family's tests.
pub(crate) trait Emulated: Sized {
    /// Instances at odd sizes (and some empty ones) with working type `w`, their tensors
    /// made by `l`.
    fn samples(w: Dtype, l: &mut Layout) -> Vec<Self>;

    /// The values its launches' `int` and `long long` parameters must have, by the `.cu`
    /// parameters' names (a name may have several values).
    fn dimensions(&self) -> Vec<(&'static str, usize)> {
        Vec::new()
    }

    /// The values its launches' `float` parameters must have, by name.
    fn floats(&self, _scalars: &Scalars) -> Vec<(&'static str, f32)> {
        Vec::new()
    }

    /// The regions its scratch is cut into, by name: (name, offset, bytes). Empty where
    /// the scratch (if any) is used whole.
    fn scratch_regions(&self) -> Vec<(&'static str, usize, usize)> {
        Vec::new()
    }

    /// Which of its tensors (or scratch regions) the parameter `param` of the entry point
    /// `entry` may be handed, where the `.cu` names the role differently.
    fn accepted(_entry: &str, _param: &str) -> Option<&'static [&'static str]> {
        None
    }

    /// Executes the f32 entry point `name` (full name) with `args` on `memory`, as its
    /// `.cu` source reads; false if it is not one this kernel emulates.
    fn emulate(_name: &str, _args: &[Arg], _memory: &Emulator) -> bool {
        false
    }
}

/// The pointer argument `i` of an emulated launch of `name`.
pub(crate) fn ptr_arg(name: &str, args: &[Arg], i: usize) -> u64 {
    match args[i] {
        Arg::Ptr(p) => p,
        other => panic!("{name}: argument {i} is {other:?}, not a pointer"),
    }
}

/// The count argument `i` (`int` or `long long`) of an emulated launch of `name`.
pub(crate) fn count_arg(name: &str, args: &[Arg], i: usize) -> usize {
    match args[i] {
        Arg::Int(x) => usize::try_from(x).unwrap(),
        Arg::Long(x) => usize::try_from(x).unwrap(),
        other => panic!("{name}: argument {i} is {other:?}, not a count"),
    }
}

/// The scalars every sample runs with.
pub(crate) fn scalars() -> Scalars {
    let hp = AdamW::default();
    let no_decay = AdamW {
        weight_decay: 0.0,
        ..hp
    };
    Scalars {
        dloss: 0.25,
        stats_scale: 0.5,
        adam: Some(AdamStep::new(&hp, 3, 0.5).unwrap()),
        adam_no_decay: Some(AdamStep::new(&no_decay, 3, 0.5).unwrap()),
        skip_update: false,
        // Not 0, so a launch that ignored the step's sketch seed shows.
        sketch: 6,
    }
}

/// Runs `kernel` on `queue` with the tensors at [`address`], or at `at`'s addresses.
fn run_at(
    queue: &Emulator,
    kernel: &Kernel,
    scalars: &Scalars,
    at: &dyn Fn(&TensorRef) -> u64,
) -> Result<(), KernelError> {
    // SAFETY: the emulator touches only its own host memory, through checked lookups.
    let device = unsafe { TrustedDevice::new(queue, at) };
    kernel.run_on_cuda(scalars, &device)
}

/// Runs `kernel` on `queue` with the tensors at [`address`].
pub(crate) fn run_on(
    queue: &Emulator,
    kernel: &Kernel,
    scalars: &Scalars,
) -> Result<(), KernelError> {
    run_at(queue, kernel, scalars, &address)
}

/// A byte range a kernel may be handed a pointer to: one of its tensors, or one region of
/// its scratch.
#[derive(Debug)]
struct Region {
    start: u64,
    end: u64,
    written: bool,
}

/// The regions of `kernel`'s tensors, a scratch cut into regions replaced by them.
fn regions(kernel: &Kernel) -> Vec<Region> {
    let mut out = Vec::new();
    let cut = kernel.scratch_regions();
    kernel.params(&mut |p| {
        if p.name == "scratch" && !cut.is_empty() {
            let start = address(p.tensor);
            for &(_, at, bytes) in &cut {
                out.push(Region {
                    start: start + at as u64,
                    end: start + (at + bytes) as u64,
                    written: true,
                });
            }
        } else {
            out.push(Region {
                start: address(p.tensor),
                end: address(p.tensor) + p.tensor.bytes() as u64,
                written: p.access == Access::Write,
            });
        }
    });
    out
}

/// Bytes per element of a cuBLAS data type.
fn element_bytes(data_type: cudaDataType_t) -> usize {
    match data_type {
        cudaDataType_t::CUDA_R_32F => 4,
        cudaDataType_t::CUDA_R_16BF | cudaDataType_t::CUDA_R_16F => 2,
        other => panic!("unexpected data type {other:?}"),
    }
}

/// Checks that the product's operands start at regions and stay inside them, at their
/// leading dimensions and batch strides, and that C is written.
fn check_gemm(what: &str, g: &Gemm, regions: &[Region], w: Dtype) {
    assert!(g.m > 0 && g.n > 0 && g.k > 0, "{what}: empty product {g:?}");
    let working = match w {
        Dtype::F32 => cudaDataType_t::CUDA_R_32F,
        Dtype::Bf16 => cudaDataType_t::CUDA_R_16BF,
        _ => cudaDataType_t::CUDA_R_16F,
    };
    let (count, sa, sb, sc) = g.batch.unwrap_or((1, 0, 0, 0));
    // (operand, rows and columns as stored, batch stride, whether written)
    let stored = |transposed: bool, rows: usize, cols: usize| {
        if transposed {
            (cols, rows)
        } else {
            (rows, cols)
        }
    };
    let operands = [
        ("A", g.a, stored(g.a.transposed, g.m, g.k), sa, false),
        ("B", g.b, stored(g.b.transposed, g.k, g.n), sb, false),
        ("C", g.c, (g.m, g.n), sc, true),
    ];
    for (name, op, (rows, cols), stride, written) in operands {
        let ctx = format!("{what}: operand {name} of {g:?}");
        if name == "C" {
            assert!(!op.transposed, "{ctx}: C transposed");
            assert!(
                op.data_type == working || op.data_type == cudaDataType_t::CUDA_R_32F,
                "{ctx}: C's type"
            );
        } else {
            assert_eq!(op.data_type, working, "{ctx}: input type");
        }
        assert!(
            op.ld >= rows.max(1),
            "{ctx}: leading dimension below {rows} rows"
        );
        let elements = (count - 1) * stride + (cols - 1) * op.ld + rows;
        let end = op.ptr + (elements * element_bytes(op.data_type)) as u64;
        let region = regions
            .iter()
            .find(|r| r.start == op.ptr)
            .unwrap_or_else(|| panic!("{ctx}: starts at no tensor"));
        assert!(
            end <= region.end,
            "{ctx}: ends {} bytes past its tensor",
            end - region.end
        );
        assert!(
            !written || region.written,
            "{ctx}: writes a tensor the kernel reads"
        );
    }
}

/// Whether the pointer parameter `param` of the `.cu` kernel `kernel` may be 0:
/// adamw_step's copy_out when there is none, the fused attention's and the rotary
/// embedding's doc_start when the batch is not packed.
fn optional_pointer(kernel: &str, param: &str) -> bool {
    matches!(
        (kernel, param),
        ("adamw_step", "copy_out")
            | ("flash_forward", "doc_start")
            | ("flash_backward_dq", "doc_start")
            | ("flash_backward_dkv", "doc_start")
            | ("rope_forward", "doc_start")
            | ("rope_backward", "doc_start")
    )
}

/// The `.cu` kernel the entry point `name` launches, as [`source_signatures`] keys it
/// (a typed one without its type's suffix), with its parameters' names in order and
/// whether each is a pointer.
fn signature_of<'a>(
    signatures: &'a HashMap<String, Vec<(String, bool)>>,
    name: &str,
) -> (String, &'a [(String, bool)]) {
    let base = ["_f32", "_bf16", "_f16"]
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix))
        .filter(|base| signatures.contains_key(&format!("{base}_##S")));
    match base {
        Some(base) => (base.to_string(), &signatures[&format!("{base}_##S")]),
        None => (name.to_string(), &signatures[name]),
    }
}

/// Checks every call `kernel` enqueued against its regions (`signatures`: the sources'
/// kernels, for the names of their parameters).
fn check_calls(
    kernel: &Kernel,
    calls: &[Call],
    w: Dtype,
    signatures: &HashMap<String, Vec<(String, bool)>>,
) {
    let regions = regions(kernel);
    let what = format!("{} ({w})", kernel.name());
    let region_at = |ptr: u64| regions.iter().find(|r| r.start == ptr);
    for call in calls {
        match call {
            Call::Launch {
                name,
                grid,
                block,
                args,
            } => {
                assert!(
                    entry_points().contains(name),
                    "{what}: {name} is not among the registry's entry points"
                );
                let threads = block.0 * block.1 * block.2;
                assert!(
                    (1..=1024).contains(&threads),
                    "{what}: {name}: block {block:?}"
                );
                assert!(
                    grid.0 >= 1 && grid.1 >= 1 && grid.2 >= 1,
                    "{what}: {name}: grid"
                );
                let (kernel_name, params) = signature_of(signatures, name);
                assert_eq!(args.len(), params.len(), "{what}: {name}: argument count");
                for (i, (arg, (param, _))) in args.iter().zip(params).enumerate() {
                    if let Arg::Ptr(ptr) = *arg {
                        let optional = ptr == 0 && optional_pointer(&kernel_name, param);
                        assert!(
                            optional || region_at(ptr).is_some(),
                            "{what}: {name}: pointer argument {i} ({ptr:#x}) starts no tensor"
                        );
                    }
                }
            }
            Call::Gemm(g) => check_gemm(&what, g, &regions, w),
            Call::Zero { ptr, bytes } => {
                let r = region_at(*ptr).unwrap_or_else(|| panic!("{what}: zero"));
                assert!(r.written && ptr + *bytes as u64 <= r.end, "{what}: zero");
            }
            Call::Copy { dst, src, bytes } => {
                let d = region_at(*dst).unwrap_or_else(|| panic!("{what}: copy dst"));
                let s = region_at(*src).unwrap_or_else(|| panic!("{what}: copy src"));
                assert!(
                    d.written && dst + *bytes as u64 <= d.end,
                    "{what}: copy dst"
                );
                assert!(src + *bytes as u64 <= s.end, "{what}: copy src");
            }
        }
    }
}

/// Each sample in each working type, with its calls.
fn recorded() -> Vec<(Dtype, Kernel, Vec<Call>)> {
    let mut out = Vec::new();
    for w in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
        let mut layout = Layout::default();
        for kernel in crate::kernel::samples(w, &mut layout) {
            let queue = Emulator::recording();
            run_on(&queue, &kernel, &scalars())
                .unwrap_or_else(|e| panic!("{} ({w}): {e}", kernel.name()));
            out.push((w, kernel, queue.calls.into_inner()));
        }
    }
    out
}

#[test]
fn every_launch_and_product_stays_inside_the_kernels_tensors() {
    let (mut calls, signatures) = (0, source_signatures());
    for (w, kernel, recorded) in recorded() {
        check_calls(&kernel, &recorded, w, &signatures);
        calls += recorded.len();
    }
    assert!(calls > 100, "{calls} calls");
}

/// The parameter types of every entry point of the PTX: `.u64`, `.u32`, `.f32`,
/// `.b8[<bytes>]` (a structure by value).
fn entry_parameters(ptx: &str) -> HashMap<String, Vec<String>> {
    let mut entries = HashMap::new();
    let mut current: Option<(String, Vec<String>)> = None;
    for line in ptx.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix(".visible .entry ") {
            let name = rest.trim_end_matches('(').trim_end_matches("()");
            current = Some((name.to_string(), Vec::new()));
            if rest.ends_with("()") {
                let (name, params) = current.take().unwrap();
                entries.insert(name, params);
            }
        } else if let Some((_, params)) = current.as_mut() {
            if let Some(param) = line.strip_prefix(".param ") {
                let kind = if param.starts_with(".align") {
                    let size = param
                        .split_once('[')
                        .and_then(|(_, s)| s.split_once(']'))
                        .map(|(s, _)| s)
                        .expect("an array parameter");
                    format!(".b8[{size}]")
                } else {
                    param.split_whitespace().next().unwrap().to_string()
                };
                params.push(kind);
            } else if line.starts_with(')') {
                let (name, params) = current.take().unwrap();
                entries.insert(name, params);
            }
        }
    }
    entries
}

#[test]
#[cfg_attr(
    not(strata_nvrtc),
    ignore = "NVRTC (libnvrtc.so.13) not found when built"
)]
fn every_launch_matches_the_parameters_of_the_compiled_kernel() {
    let ptx = program::ptx(9, 0).unwrap_or_else(|e| panic!("{e}"));
    let entries = entry_parameters(&ptx);
    let adam_bytes = format!(".b8[{}]", std::mem::size_of::<AdamConstants>());
    assert_eq!(adam_bytes, ".b8[36]");
    let mut launched = HashSet::new();
    for (w, kernel, calls) in recorded() {
        for call in calls {
            let Call::Launch { name, args, .. } = call else {
                continue;
            };
            let what = format!("{} ({w}) launching {name}", kernel.name());
            let params = entries
                .get(&name)
                .unwrap_or_else(|| panic!("{what}: no such entry point"));
            assert_eq!(args.len(), params.len(), "{what}: argument count");
            for (i, (arg, param)) in args.iter().zip(params).enumerate() {
                let fits = match arg {
                    Arg::Ptr(_) | Arg::Long(_) => {
                        matches!(param.as_str(), ".u64" | ".s64" | ".b64")
                    }
                    Arg::Int(_) => matches!(param.as_str(), ".u32" | ".s32" | ".b32"),
                    Arg::Float(_) => param == ".f32",
                    Arg::Adam(_) => *param == adam_bytes,
                };
                assert!(
                    fits,
                    "{what}: argument {i} is {arg:?}, the parameter {param}"
                );
            }
            launched.insert(name);
        }
    }
    for name in entry_points() {
        assert!(entries.contains_key(&name), "{name} is not in the PTX");
        assert!(launched.contains(&name), "no kernel launches {name}");
    }
}

/// The `extern "C"` kernels of the sources, each with its parameters' names in order and
/// whether each is a pointer. Typed kernels are keyed `<name>_##S`, as the macros write
/// them.
fn source_signatures() -> HashMap<String, Vec<(String, bool)>> {
    let source = program::program_source().replace("\\\n", " ");
    let mut out = HashMap::new();
    for piece in source.split("extern \"C\" __global__ void ").skip(1) {
        let (name, rest) = piece.split_once('(').expect("a parameter list");
        let (list, _) = rest.split_once(')').expect("a closed parameter list");
        let params = list
            .split(',')
            .map(|p| {
                let p = p.trim();
                let name = p
                    .rsplit(|ch: char| !(ch.is_alphanumeric() || ch == '_'))
                    .next()
                    .unwrap();
                (name.to_string(), p.contains('*'))
            })
            .collect();
        out.insert(name.trim().to_string(), params);
    }
    out
}

/// The kernel's tensors by the names of its fields, and its scratch's regions by theirs.
fn named_tensors(kernel: &Kernel) -> Vec<(&'static str, u64)> {
    let mut out = Vec::new();
    kernel.params(&mut |p| out.push((p.name, address(p.tensor))));
    let scratch = out.iter().find(|(n, _)| *n == "scratch").map(|&(_, at)| at);
    for (name, at, _) in kernel.scratch_regions() {
        out.push((name, scratch.expect("a scratch to cut") + at as u64));
    }
    out
}

#[test]
fn every_launch_hands_each_parameter_the_tensor_or_size_of_its_name() {
    let signatures = source_signatures();
    let s = scalars();
    let mut checked = 0;
    for (w, kernel, calls) in recorded() {
        let tensors = named_tensors(&kernel);
        let dims = kernel.dimensions();
        for call in calls {
            let Call::Launch { name, args, .. } = call else {
                continue;
            };
            let (kernel_name, params) = signature_of(&signatures, &name);
            let what = format!("{} ({w}) launching {name}", kernel.name());
            assert_eq!(params.len(), args.len(), "{what}: argument count");
            for ((param, pointer), arg) in params.iter().zip(&args) {
                let ctx = format!("{what}: parameter {param} = {arg:?}");
                match *arg {
                    Arg::Ptr(ptr) => {
                        assert!(pointer, "{ctx}: a pointer for a value");
                        if ptr == 0 && optional_pointer(&kernel_name, param) {
                            continue;
                        }
                        let names: Vec<&str> = tensors
                            .iter()
                            .filter(|(_, at)| *at == ptr)
                            .map(|(n, _)| *n)
                            .collect();
                        let accepted = kernel
                            .accepted(&kernel_name, param)
                            .map_or_else(|| vec![param.as_str()], |a| a.to_vec());
                        assert!(
                            names.iter().any(|n| accepted.contains(n)),
                            "{ctx}: points at {names:?}, not {accepted:?}"
                        );
                    }
                    Arg::Int(_) | Arg::Long(_) => {
                        assert!(!pointer, "{ctx}: a value for a pointer");
                        let value = match *arg {
                            Arg::Int(x) => x as i64,
                            Arg::Long(x) => x,
                            _ => unreachable!(),
                        };
                        // A name may have several values (grouped-query attention's head
                        // counts, the direction of moving heads); the argument must be one.
                        let wants: Vec<i64> = dims
                            .iter()
                            .filter(|(n, _)| n == param)
                            .map(|&(_, v)| v as i64)
                            .collect();
                        assert!(!wants.is_empty(), "{ctx}: no dimension so named");
                        assert!(wants.contains(&value), "{ctx}: not one of {wants:?}");
                    }
                    Arg::Float(x) => {
                        let want = kernel
                            .floats(&s)
                            .into_iter()
                            .find(|(n, _)| n == param)
                            .unwrap_or_else(|| panic!("{ctx}: an unexpected float"));
                        assert_eq!(x, want.1, "{ctx}");
                    }
                    Arg::Adam(k) => {
                        let step = match kernel {
                            Kernel::AdamW(AdamWKernel { decay: true, .. }) => s.adam,
                            _ => s.adam_no_decay,
                        };
                        assert_eq!(k, AdamConstants::from(&step.unwrap()), "{ctx}");
                    }
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 1000, "{checked} arguments");
}

#[test]
fn the_hosts_constants_are_the_sources() {
    let source = program::program_source();
    for (name, mode) in [
        ("COPY_NONE", CopyMode::None),
        ("COPY_BF16", CopyMode::Bf16),
        ("COPY_F16", CopyMode::F16),
        ("COPY_F32", CopyMode::F32),
        ("COPY_F32_AS_BF16", CopyMode::F32AsBf16),
        ("COPY_F32_AS_F16", CopyMode::F32AsF16),
    ] {
        let line = format!("#define {name} {}\n", mode as i32);
        assert!(source.contains(&line), "{line:?} is not in adamw.cu");
    }
    for (name, value) in [
        ("GRAD_STATS_THREADS", GRAD_STATS_THREADS),
        ("STATS_PIECE", crate::adamw::STATS_PIECE),
        ("STATS_LANES", crate::adamw::STATS_LANES),
    ] {
        let line = format!("#define {name} {value}\n");
        assert!(source.contains(&line), "{line:?} is not in adamw.cu");
    }
    // Nine floats, as adamw.cu's struct AdamConstants.
    assert_eq!(std::mem::size_of::<AdamConstants>(), 36);
    assert_eq!(std::mem::align_of::<AdamConstants>(), 4);
}

/// Relative error of `got` against `want` (norms).
fn relative_error(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut diff, mut norm) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        diff += (f64::from(g) - f64::from(w)).powi(2);
        norm += f64::from(w).powi(2);
    }
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

#[test]
fn the_products_launch_sequences_compute_what_the_cpu_computes() {
    let mut l = Layout::default();
    let f = Dtype::F32;
    let mut kernels = Vec::new();
    for (n, c, oc) in [(1, 1, 1), (7, 5, 3), (22, 13, 9)] {
        for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
            for with_bias in [true, false] {
                kernels.push(Kernel::Matmul(Matmul {
                    out: l.tensor(n * oc, f),
                    inp: l.tensor(n * c, f),
                    weight: l.tensor(c * oc, f),
                    bias: with_bias.then(|| l.tensor(oc, f)),
                    layout,
                    n,
                    c,
                    oc,
                }));
                kernels.push(Kernel::MatmulBackward(MatmulBackward {
                    dinp: l.tensor(n * c, f),
                    weight_grad: Some(WeightGrad {
                        dweight: l.tensor(c * oc, f),
                        inp: l.tensor(n * c, f),
                    }),
                    dbias: with_bias.then(|| l.tensor(oc, f)),
                    dout: l.tensor(n * oc, f),
                    weight: l.tensor(c * oc, f),
                    layout,
                    n,
                    c,
                    oc,
                }));
            }
        }
    }
    for (b, t, c, nh) in [(1, 1, 4, 1), (2, 7, 12, 3), (1, 22, 8, 2)] {
        // One scratch serves both runners: the larger of their needs.
        let bytes = attention_scratch_bytes(Target::Cuda, f, b, t, c, nh)
            .max(attention_scratch_bytes(Target::Cpu, f, b, t, c, nh));
        kernels.push(Kernel::Attention(Attention {
            out: l.tensor(b * t * c, f),
            att: l.tensor(b * nh * t * t, f),
            qkv: l.tensor(3 * b * t * c, f),
            scratch: l.tensor(bytes, Dtype::U8),
            b,
            t,
            c,
            nh,
        }));
        kernels.push(Kernel::AttentionBackward(AttentionBackward {
            dqkv: l.tensor(3 * b * t * c, f),
            dout: l.tensor(b * t * c, f),
            qkv: l.tensor(3 * b * t * c, f),
            att: l.tensor(b * nh * t * t, f),
            scratch: l.tensor(bytes, Dtype::U8),
            b,
            t,
            c,
            nh,
        }));
    }
    for (b, t, h, kv, d) in [
        (1, 1, 2, 1, 4),
        (2, 7, 6, 2, 12),
        (1, 9, 3, 3, 5),
        (1, 22, 4, 1, 8),
    ] {
        let bytes = gqa_attention_scratch_bytes(Target::Cuda, f, b, t, h, kv, d)
            .max(gqa_attention_scratch_bytes(Target::Cpu, f, b, t, h, kv, d));
        let (q_len, kv_len) = (b * t * h * d, b * t * kv * d);
        kernels.push(Kernel::GqaAttention(GqaAttention {
            out: l.tensor(q_len, f),
            att: l.tensor(b * h * t * t, f),
            q: l.tensor(q_len, f),
            k: l.tensor(kv_len, f),
            v: l.tensor(kv_len, f),
            scratch: l.tensor(bytes, Dtype::U8),
            b,
            t,
            h,
            kv,
            d,
        }));
        kernels.push(Kernel::GqaAttentionBackward(GqaAttentionBackward {
            dq: l.tensor(q_len, f),
            dk: l.tensor(kv_len, f),
            dv: l.tensor(kv_len, f),
            dout: l.tensor(q_len, f),
            q: l.tensor(q_len, f),
            k: l.tensor(kv_len, f),
            v: l.tensor(kv_len, f),
            att: l.tensor(b * h * t * t, f),
            scratch: l.tensor(bytes, Dtype::U8),
            b,
            t,
            h,
            kv,
            d,
        }));
    }
    let mut inputs = random_inputs(&l, &kernels, 11);
    // The backward's probabilities are zero above the diagonal, as the forward leaves
    // them.
    for kernel in &kernels {
        if let &Kernel::AttentionBackward(AttentionBackward { ref att, t, .. })
        | &Kernel::GqaAttentionBackward(GqaAttentionBackward { ref att, t, .. }) = kernel
        {
            let mut a = inputs.read_f32(att);
            for (i, x) in a.iter_mut().enumerate() {
                if i % t > (i / t) % t {
                    *x = 0.0;
                }
            }
            inputs.write_f32(att, &a);
        }
    }
    check_emulation(&kernels, inputs, 1e-5);
}

/// Memory for `kernels`' tensors (made by `l`): random values in [-1, 1) in every f32
/// tensor (from `seed`, in the kernels' and their tensors' order), and 0xff bytes (NaN)
/// in every scratch, so that reading it before writing shows; zeros in every u32 tensor.
pub(crate) fn random_inputs(l: &Layout, kernels: &[Kernel], seed: u64) -> Buffers {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut inputs = Buffers::new(l);
    for kernel in kernels {
        kernel.for_each_tensor(|t, _| {
            if t.dtype == Dtype::U8 {
                let at = t.byte_range();
                inputs.buffer_mut(t.buf.into())[at].fill(0xff);
            } else if t.dtype == Dtype::U32 {
                // Ids and document starts: zero is valid for each (one document).
                inputs.write_u32(t, &vec![0; t.len]);
            } else {
                let values: Vec<f32> = (0..t.len).map(|_| rng.random_range(-1.0..1.0)).collect();
                inputs.write_f32(t, &values);
            }
        });
    }
    inputs
}

/// Runs `kernel` with `scalars` on the CPU (portable, one thread) over `memory`, which
/// holds its tensors (made by the [`Layout`] it was built with).
pub(crate) fn run_cpu_with(
    memory: &mut Buffers,
    kernel: &Kernel,
    scalars: &Scalars,
) -> Result<(), KernelError> {
    let cpu = Cpu {
        isa: Isa::Portable,
        threads: 1,
    };
    let view = memory.cpu_view();
    // SAFETY: every tensor lies inside its own buffer of the view (the layout made both).
    unsafe { run_cpu(kernel, &cpu, scalars, &view) }
}

/// Runs `kernels` (f32) one after another on the CPU (portable, one thread) and on the
/// executing emulator, both from `inputs`, and asserts after each that every f32 tensor
/// it writes agrees, ‖emulated − cpu‖ / ‖cpu‖ below `tolerance`, and every u32 one is
/// equal.
pub(crate) fn check_emulation(kernels: &[Kernel], inputs: Buffers, tolerance: f64) {
    let mut cpu_memory = inputs.clone();
    let cpu = Cpu {
        isa: Isa::Portable,
        threads: 1,
    };
    let queue = Emulator::executing(inputs);
    for kernel in kernels {
        {
            let view = cpu_memory.cpu_view();
            // SAFETY: every tensor lies inside its own buffer of the view.
            unsafe { run_cpu(kernel, &cpu, &scalars(), &view) }.unwrap();
        }
        run_on(&queue, kernel, &scalars()).unwrap();
        let emulated = queue.memory.as_ref().unwrap().borrow();
        kernel.for_each_tensor(|t, access| {
            if access == Access::Write && t.dtype == Dtype::F32 {
                let err = relative_error(&emulated.read_f32(t), &cpu_memory.read_f32(t));
                assert!(
                    err < tolerance,
                    "{}: {t:?}: relative error {err:e}",
                    kernel.name()
                );
            }
            if access == Access::Write && t.dtype == Dtype::U32 {
                let bytes = |b: &Buffers| b.buffer(t.buf.into())[t.byte_range()].to_vec();
                assert_eq!(
                    bytes(&emulated),
                    bytes(&cpu_memory),
                    "{}: {t:?}",
                    kernel.name()
                );
            }
        });
    }
}

#[test]
fn refused_kernels_enqueue_nothing_and_say_why() {
    let mut l = Layout::default();
    let f = Dtype::F32;
    let gelu = |out: TensorRef, inp: TensorRef| Kernel::Gelu(Gelu { out, inp });
    let refuse = |kernel: Kernel, scalars: Scalars, address: &dyn Fn(&TensorRef) -> u64| {
        let queue = Emulator::recording();
        let e = run_at(&queue, &kernel, &scalars, address).unwrap_err();
        assert!(queue.calls.borrow().is_empty(), "{e}");
        e
    };
    let e = refuse(
        gelu(l.tensor(8, Dtype::Bf16), l.tensor(8, f)),
        scalars(),
        &address,
    );
    assert!(matches!(e, KernelError::Dtype { what: "inp", .. }), "{e}");
    let e = refuse(
        gelu(l.tensor(8, Dtype::U32), l.tensor(8, f)),
        scalars(),
        &address,
    );
    assert!(matches!(e, KernelError::Dtype { what: "out", .. }), "{e}");
    let e = refuse(gelu(l.tensor(8, f), l.tensor(7, f)), scalars(), &address);
    assert!(
        matches!(
            e,
            KernelError::Shape {
                what: "inp",
                len: 7,
                expected: 8,
                ..
            }
        ),
        "{e}"
    );
    let e = refuse(gelu(l.tensor(8, f), l.tensor(8, f)), scalars(), &|t| {
        address(t) + 2
    });
    assert!(matches!(e, KernelError::Misaligned { align: 4, .. }), "{e}");
    let adam = || {
        Kernel::AdamW(AdamWKernel {
            params: TensorRef::new(0, 0, 5, f),
            m: TensorRef::new(1, 0, 5, f),
            v: TensorRef::new(2, 0, 5, f),
            grads: TensorRef::new(3, 0, 5, f),
            copy_out: None,
            round: f,
            decay: true,
        })
    };
    let no_constants = Scalars {
        adam: None,
        ..scalars()
    };
    let e = refuse(adam(), no_constants, &address);
    assert!(matches!(e, KernelError::NoAdamStep), "{e}");
    // Skipping needs no constants and enqueues nothing.
    let queue = Emulator::recording();
    let skip = Scalars {
        skip_update: true,
        ..no_constants
    };
    run_on(&queue, &adam(), &skip).unwrap();
    assert!(queue.calls.borrow().is_empty());
    let scratch_short = Kernel::GradStats(GradStatsKernel {
        grads: l.tensor(4097, f),
        out: l.tensor(16, Dtype::U8),
        scratch: l.tensor(grad_stats_scratch_bytes(Target::Cuda, 4097) - 1, Dtype::U8),
    });
    let e = refuse(scratch_short, scalars(), &address);
    assert!(
        matches!(
            e,
            KernelError::Shape {
                what: "scratch (bytes)",
                ..
            }
        ),
        "{e}"
    );
    let heads = Kernel::Attention(Attention {
        out: l.tensor(2 * 5, f),
        att: l.tensor(3 * 4, f),
        qkv: l.tensor(3 * 2 * 5, f),
        scratch: l.tensor(1 << 12, Dtype::U8),
        b: 1,
        t: 2,
        c: 5,
        nh: 3,
    });
    let e = refuse(heads, scalars(), &address);
    assert!(matches!(e, KernelError::Shape { len: 5, .. }), "{e}");
    // Key/value heads that do not divide the query heads; an odd head for RoPE.
    let (b, t, h, kv, d) = (1, 2, 6, 4, 8);
    let groups = Kernel::GqaAttention(GqaAttention {
        out: l.tensor(b * t * h * d, f),
        att: l.tensor(b * h * t * t, f),
        q: l.tensor(b * t * h * d, f),
        k: l.tensor(b * t * kv * d, f),
        v: l.tensor(b * t * kv * d, f),
        scratch: l.tensor(1 << 16, Dtype::U8),
        b,
        t,
        h,
        kv,
        d,
    });
    let e = refuse(groups, scalars(), &address);
    assert!(matches!(e, KernelError::Shape { len: 6, .. }), "{e}");
    let odd = Kernel::Rope(Rope {
        out: l.tensor(2 * 3, f),
        inp: l.tensor(2 * 3, f),
        cos: l.tensor(2 * 3, f),
        sin: l.tensor(2 * 3, f),
        doc_start: None,
        b: 1,
        t: 2,
        h: 1,
        d: 3,
    });
    let e = refuse(odd, scalars(), &address);
    assert!(matches!(e, KernelError::Shape { len: 3, .. }), "{e}");
}
