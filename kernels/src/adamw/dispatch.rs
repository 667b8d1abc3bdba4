//! How a validated call reaches the kernels: the slices are cut into one piece per thread
//! and run on the worker pool; each piece goes to the kernels of the chosen [`Isa`]
//! through the [`Kernels`] trait, monomorphised for its gradient and working-copy dtypes.
//!
//! The ISA kernels only ever see whole vectors (fp32 or bf16 state) or whole blocks (8-bit
//! state): the ragged end is staged here through zero-padded stack arrays and run as one
//! more whole vector or block, so every element gets the same arithmetic. Padding is
//! harmless: zero state and zero gradient give zero moments, and change no block scale.
//!
//! Holds no `unsafe` of its own beyond calling the [`Kernels`] methods, whose only
//! requirement is that the CPU supports their instruction set.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::{AdamStep, CopyOut, GradStats, Grads, Q8State, State, q8};
use crate::isa::Isa;
use crate::parallel;

/// Whole-cache-line pieces for each thread: 64 fp32 values are four 64-byte lines.
const F32_ALIGN: usize = 64;

/// The widest vector any kernel uses, in f32 lanes (AVX-512).
const MAX_LANES: usize = 16;

/// Runs one AdamW step, already validated, on `threads` pieces.
pub(super) fn step(
    isa: Isa,
    threads: usize,
    k: &AdamStep,
    params: &mut [f32],
    state: State<'_>,
    grads: Grads<'_>,
    copy_out: CopyOut<'_>,
) {
    let align = match state {
        State::F32 { .. } | State::Bf16 { .. } => F32_ALIGN,
        State::Q8(_) => q8::BLOCK,
    };
    let work = Work {
        k,
        params,
        state,
        grads,
        copy_out,
    };
    run_split(work, threads, align, &|w| with_kernels(isa, w), &|_, _| ());
}

/// Pieces whose statistics [`grad_stats_pieces`] computes in one round: one stack array
/// of them, so that a call allocates nothing.
const STATS_ROUND: usize = 64;

/// The statistics of each [`super::STATS_PIECE`]-element piece of `grads`, in order, to
/// `each`. Each piece is one thread's whole work (the same arithmetic whichever thread
/// runs it, and wherever the piece starts), so the pieces do not depend on `threads`.
/// The pieces of a round run on the pool; `each` runs on the calling thread.
pub(super) fn grad_stats_pieces(
    isa: Isa,
    threads: usize,
    grads: Grads<'_>,
    scale: f32,
    each: &mut dyn FnMut(GradStats),
) {
    const P: usize = super::STATS_PIECE;
    let mut rest = grads;
    while !rest.is_empty() {
        let take = rest.len().min(P * STATS_ROUND);
        let (round, next) = rest.split_at(take);
        rest = next;
        let mut out = [GradStats::default(); STATS_ROUND];
        let pieces = take.div_ceil(P);
        parallel::for_each_split(
            take,
            threads.max(1),
            P,
            (round, &mut out[..pieces]),
            &split_stats,
            &|_, (g, o): (Grads<'_>, &mut [GradStats])| {
                let mut g = g;
                for slot in o.iter_mut() {
                    let (now, later) = g.split_at(g.len().min(P));
                    *slot = with_kernels(isa, StatsPiece { g: now, scale });
                    g = later;
                }
            },
        );
        for s in &out[..pieces] {
            each(*s);
        }
    }
}

/// Gradients and their pieces' statistics, cut after `n` gradients (whole pieces).
#[allow(clippy::type_complexity)]
fn split_stats<'a, 'b>(
    (g, o): (Grads<'a>, &'b mut [GradStats]),
    n: usize,
) -> (
    (Grads<'a>, &'b mut [GradStats]),
    (Grads<'a>, &'b mut [GradStats]),
) {
    let (g0, g1) = g.split_at(n);
    let (o0, o1) = o.split_at_mut(n / super::STATS_PIECE);
    ((g0, o0), (g1, o1))
}

/// The fused gradient pass: the pieces' statistics merged in order (see
/// [`grad_stats_pieces`]), the same for any `threads`.
pub(super) fn grad_stats(isa: Isa, threads: usize, grads: Grads<'_>, scale: f32) -> GradStats {
    let mut total = GradStats::default();
    grad_stats_pieces(isa, threads, grads, scale, &mut |s| total = total.merge(s));
    total
}

/// A call generic over the kernels, made for an instruction set chosen at run time by
/// [`with_kernels`].
trait WithKernels {
    type Output;

    /// # Safety
    /// The CPU supports `K`'s instruction set.
    unsafe fn call<K: Kernels>(self) -> Self::Output;
}

/// Makes `call` with the kernels of `isa`, after checking the CPU supports them.
fn with_kernels<W: WithKernels>(isa: Isa, call: W) -> W::Output {
    assert!(isa.is_supported(), "{isa} kernels on a CPU without {isa}");
    match isa {
        // SAFETY: the portable kernels run on every CPU.
        Isa::Portable => unsafe { call.call::<super::portable::Portable>() },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX2, FMA and F16C (asserted above).
        Isa::Avx2 => unsafe { call.call::<super::avx2::Avx2>() },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX-512F, AVX2, FMA and F16C (asserted above).
        Isa::Avx512 => unsafe { call.call::<super::avx512::Avx512>() },
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("only the portable kernels exist on this architecture"),
    }
}

/// One thread's piece of the gradient pass.
struct StatsPiece<'a> {
    g: Grads<'a>,
    scale: f32,
}

impl WithKernels for StatsPiece<'_> {
    type Output = GradStats;

    unsafe fn call<K: Kernels>(self) -> GradStats {
        // SAFETY: the caller guarantees the instruction set.
        unsafe {
            match self.g {
                Grads::F32(g) => K::sum_squares(g, self.scale),
                Grads::F16(g) => K::sum_squares(g, self.scale),
                Grads::Bf16(g) => K::sum_squares(g, self.scale),
            }
        }
    }
}

/// Element types a kernel reads gradients as or writes the working copy as, with the
/// kind as a constant so that each combination compiles to its own loop.
pub(crate) trait Lane: Copy + Default + Send + Sync + 'static {
    const KIND: LaneKind;
    /// The value as f32 (scalar; the SIMD kernels convert whole vectors themselves).
    fn to_f32(self) -> f32;
    /// `x` rounded to this type (nearest even).
    fn from_f32(x: f32) -> Self;
    /// Widens a slice to f32 (`half`'s slice conversions use F16C or NEON where the
    /// CPU has them; element by element they cannot).
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
    }
    /// Rounds a slice from f32.
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = Self::from_f32(s);
        }
    }
}

/// See [`Lane`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LaneKind {
    F32,
    F16,
    Bf16,
    /// No working copy is written.
    Absent,
}

impl Lane for f32 {
    const KIND: LaneKind = LaneKind::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Lane for f16 {
    const KIND: LaneKind = LaneKind::F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

impl Lane for bf16 {
    const KIND: LaneKind = LaneKind::Bf16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

/// The element type of [`CopyOut::None`]: a zero-sized slot, nothing is written. A
/// slice of them of any length costs no memory.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct NoCopy;

/// The element types moments are stored in: f32, or bf16 (read exactly, written rounded
/// to nearest even by the same conversion as a bf16 working copy).
pub(crate) trait Moment: Lane {}

impl Moment for f32 {}

impl Moment for bf16 {}

impl Lane for NoCopy {
    const KIND: LaneKind = LaneKind::Absent;
    fn to_f32(self) -> f32 {
        0.0
    }
    fn from_f32(_: f32) -> Self {
        NoCopy
    }
}

/// One whole block of 8-bit state and the parameters it belongs to.
pub(crate) struct Q8Block<'a, G, O> {
    pub p: &'a mut [f32; q8::BLOCK],
    pub m_codes: &'a mut [u8; q8::BLOCK],
    pub m_scale: &'a mut f32,
    pub v_codes: &'a mut [u8; q8::BLOCK],
    pub v_scale: &'a mut f32,
    pub g: &'a [G; q8::BLOCK],
    pub out: &'a mut [O; q8::BLOCK],
}

/// Whole blocks of 8-bit state and the parameters they belong to: one scale of each kind
/// per block, [`q8::BLOCK`] of everything else.
pub(crate) struct Q8Blocks<'a, G, O> {
    pub p: &'a mut [f32],
    pub m_codes: &'a mut [u8],
    pub m_scales: &'a mut [f32],
    pub v_codes: &'a mut [u8],
    pub v_scales: &'a mut [f32],
    pub g: &'a [G],
    pub out: &'a mut [O],
}

impl<G: Lane, O: Lane> Q8Blocks<'_, G, O> {
    /// How many blocks. Panics unless every slice has the length that needs.
    pub fn count(&self) -> usize {
        let blocks = self.m_scales.len();
        let n = blocks * q8::BLOCK;
        assert!(self.v_scales.len() == blocks && self.p.len() == n && self.g.len() == n);
        assert!(self.m_codes.len() == n && self.v_codes.len() == n && self.out.len() == n);
        blocks
    }

    /// Calls `f` on each block in turn.
    pub fn each(self, mut f: impl FnMut(Q8Block<'_, G, O>)) {
        const B: usize = q8::BLOCK;
        self.count();
        let blocks = self
            .p
            .chunks_exact_mut(B)
            .zip(self.m_codes.chunks_exact_mut(B))
            .zip(self.m_scales.iter_mut())
            .zip(self.v_codes.chunks_exact_mut(B))
            .zip(self.v_scales.iter_mut())
            .zip(self.g.chunks_exact(B))
            .zip(self.out.chunks_exact_mut(B));
        for ((((((p, m_codes), m_scale), v_codes), v_scale), g), out) in blocks {
            // The chunks are exact: each conversion to an array succeeds.
            f(Q8Block {
                p: p.try_into().expect("a whole block"),
                m_codes: m_codes.try_into().expect("a whole block"),
                m_scale,
                v_codes: v_codes.try_into().expect("a whole block"),
                v_scale,
                g: g.try_into().expect("a whole block"),
                out: out.try_into().expect("a whole block"),
            });
        }
    }
}

/// The kernels of one instruction set.
///
/// Every method is `unsafe` for one reason only: the CPU must support the instruction
/// set. Lengths are checked by the methods themselves.
pub(crate) trait Kernels {
    /// f32 lanes per vector (at most [`MAX_LANES`]).
    const LANES: usize;

    /// AdamW with fp32 or bf16 state (`S`) over equal-length slices whose length is a
    /// multiple of [`Kernels::LANES`] (`out` is a slice of [`NoCopy`] when nothing is
    /// written).
    ///
    /// # Safety
    /// The CPU supports the kernels' instruction set.
    unsafe fn vectors<S: Moment, G: Lane, O: Lane>(
        k: &AdamStep,
        p: &mut [f32],
        m: &mut [S],
        v: &mut [S],
        g: &[G],
        out: &mut [O],
    );

    /// AdamW on one whole block of 8-bit state: decode, update, re-encode with the
    /// block's new scales.
    ///
    /// # Safety
    /// The CPU supports the kernels' instruction set.
    unsafe fn q8_block<G: Lane, O: Lane>(k: &AdamStep, block: Q8Block<'_, G, O>);

    /// [`Kernels::q8_block`] on each of a run of whole blocks, in order (which is what
    /// this default does; a kernel may overlap one block's encoding with the next one's
    /// update).
    ///
    /// # Safety
    /// The CPU supports the kernels' instruction set.
    unsafe fn q8_blocks<G: Lane, O: Lane>(k: &AdamStep, blocks: Q8Blocks<'_, G, O>) {
        // SAFETY: the caller guarantees the instruction set.
        blocks.each(|block| unsafe { Self::q8_block(k, block) });
    }

    /// Sum of squares of `g * scale` (product in f32, squares summed in f64), and
    /// whether it is finite.
    ///
    /// # Safety
    /// The CPU supports the kernels' instruction set.
    unsafe fn sum_squares<G: Lane>(g: &[G], scale: f32) -> GradStats;
}

impl WithKernels for Work<'_> {
    type Output = ();

    /// Calls `K`'s kernel for this piece's dtypes.
    unsafe fn call<K: Kernels>(self) {
        let Work {
            k,
            params,
            state,
            grads,
            copy_out,
        } = self;
        // SAFETY: the caller guarantees the instruction set.
        unsafe {
            match grads {
                Grads::F32(g) => run_typed::<K, f32>(k, params, state, g, copy_out),
                Grads::F16(g) => run_typed::<K, f16>(k, params, state, g, copy_out),
                Grads::Bf16(g) => run_typed::<K, bf16>(k, params, state, g, copy_out),
            }
        }
    }
}

/// # Safety
/// The CPU supports `K`'s instruction set.
unsafe fn run_typed<K: Kernels, G: Lane>(
    k: &AdamStep,
    params: &mut [f32],
    state: State<'_>,
    g: &[G],
    copy_out: CopyOut<'_>,
) {
    // A zero-sized slice stands for "no copy": no allocation, no branch in the kernels.
    let mut none = vec![NoCopy; params.len()];
    // SAFETY: the caller guarantees the instruction set.
    unsafe {
        match copy_out {
            CopyOut::None => run_state::<K, G, NoCopy>(k, params, state, g, &mut none),
            CopyOut::F16(o) => run_state::<K, G, f16>(k, params, state, g, o),
            CopyOut::Bf16(o) => run_state::<K, G, bf16>(k, params, state, g, o),
        }
    }
}

/// # Safety
/// The CPU supports `K`'s instruction set.
unsafe fn run_state<K: Kernels, G: Lane, O: Lane>(
    k: &AdamStep,
    params: &mut [f32],
    state: State<'_>,
    g: &[G],
    out: &mut [O],
) {
    // SAFETY: the caller guarantees the instruction set.
    unsafe {
        match state {
            State::F32 { m, v } => moments::<K, f32, G, O>(k, params, m, v, g, out),
            State::Bf16 { m, v } => moments::<K, bf16, G, O>(k, params, m, v, g, out),
            State::Q8(q) => q8_state::<K, G, O>(k, params, q, g, out),
        }
    }
}

/// fp32 or bf16 state: whole vectors in place, then the ragged end through padded arrays.
///
/// # Safety
/// The CPU supports `K`'s instruction set.
unsafe fn moments<K: Kernels, S: Moment, G: Lane, O: Lane>(
    k: &AdamStep,
    p: &mut [f32],
    m: &mut [S],
    v: &mut [S],
    g: &[G],
    out: &mut [O],
) {
    let n = p.len();
    assert!(m.len() == n && v.len() == n && g.len() == n && out.len() == n);
    assert!(K::LANES <= MAX_LANES);
    let body = n - n % K::LANES;
    // SAFETY: the caller guarantees the instruction set.
    unsafe {
        K::vectors(
            k,
            &mut p[..body],
            &mut m[..body],
            &mut v[..body],
            &g[..body],
            &mut out[..body],
        )
    };
    let rem = n - body;
    if rem == 0 {
        return;
    }
    let mut tp = [0f32; MAX_LANES];
    let mut tm = [S::default(); MAX_LANES];
    let mut tv = [S::default(); MAX_LANES];
    let mut tg = [G::default(); MAX_LANES];
    let mut to = [O::default(); MAX_LANES];
    tp[..rem].copy_from_slice(&p[body..]);
    tm[..rem].copy_from_slice(&m[body..]);
    tv[..rem].copy_from_slice(&v[body..]);
    tg[..rem].copy_from_slice(&g[body..]);
    let lanes = K::LANES;
    // SAFETY: the caller guarantees the instruction set.
    unsafe {
        K::vectors(
            k,
            &mut tp[..lanes],
            &mut tm[..lanes],
            &mut tv[..lanes],
            &tg[..lanes],
            &mut to[..lanes],
        )
    };
    p[body..].copy_from_slice(&tp[..rem]);
    m[body..].copy_from_slice(&tm[..rem]);
    v[body..].copy_from_slice(&tv[..rem]);
    out[body..].copy_from_slice(&to[..rem]);
}

/// 8-bit state: whole blocks in place, in one run, then a partial last block through
/// padded arrays.
///
/// # Safety
/// The CPU supports `K`'s instruction set.
unsafe fn q8_state<K: Kernels, G: Lane, O: Lane>(
    k: &AdamStep,
    p: &mut [f32],
    q: Q8State<'_>,
    g: &[G],
    out: &mut [O],
) {
    const B: usize = q8::BLOCK;
    let n = p.len();
    assert!(q.check(n).is_ok() && g.len() == n && out.len() == n);
    let whole = n - n % B;
    let (p, p_rest) = p.split_at_mut(whole);
    let (m_codes, m_codes_rest) = q.m_codes.split_at_mut(whole);
    let (m_scales, m_scale_rest) = q.m_scales.split_at_mut(whole / B);
    let (v_codes, v_codes_rest) = q.v_codes.split_at_mut(whole);
    let (v_scales, v_scale_rest) = q.v_scales.split_at_mut(whole / B);
    let (g, g_rest) = g.split_at(whole);
    let (out, out_rest) = out.split_at_mut(whole);
    let blocks = Q8Blocks {
        p,
        m_codes,
        m_scales,
        v_codes,
        v_scales,
        g,
        out,
    };
    // SAFETY: the caller guarantees the instruction set.
    unsafe { K::q8_blocks(k, blocks) };
    let len = n - whole;
    let ([m_scale], [v_scale]) = (m_scale_rest, v_scale_rest) else {
        return;
    };
    // The last, partial block: padding has zero state and gradient.
    let mut tp = [0f32; B];
    let mut tmc = [0u8; B];
    let mut tvc = [0u8; B];
    let mut tg = [G::default(); B];
    let mut to = [O::default(); B];
    tp[..len].copy_from_slice(p_rest);
    tmc[..len].copy_from_slice(m_codes_rest);
    tvc[..len].copy_from_slice(v_codes_rest);
    tg[..len].copy_from_slice(g_rest);
    let block = Q8Block {
        p: &mut tp,
        m_codes: &mut tmc,
        m_scale,
        v_codes: &mut tvc,
        v_scale,
        g: &tg,
        out: &mut to,
    };
    // SAFETY: the caller guarantees the instruction set.
    unsafe { K::q8_block(k, block) };
    p_rest.copy_from_slice(&tp[..len]);
    m_codes_rest.copy_from_slice(&tmc[..len]);
    v_codes_rest.copy_from_slice(&tvc[..len]);
    out_rest.copy_from_slice(&to[..len]);
}

/// What can be cut into pieces for threads.
trait Splittable: Sized + Send {
    fn split_len(&self) -> usize;
    fn split_at(self, mid: usize) -> (Self, Self);
}

impl Splittable for Grads<'_> {
    fn split_len(&self) -> usize {
        self.len()
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        Grads::split_at(self, mid)
    }
}

/// The constants and slices of one AdamW step (or a thread's piece of it).
struct Work<'a> {
    k: &'a AdamStep,
    params: &'a mut [f32],
    state: State<'a>,
    grads: Grads<'a>,
    copy_out: CopyOut<'a>,
}

impl Splittable for Work<'_> {
    fn split_len(&self) -> usize {
        self.params.len()
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        let (p0, p1) = self.params.split_at_mut(mid);
        let (s0, s1) = self.state.split_at(mid);
        let (g0, g1) = self.grads.split_at(mid);
        let (o0, o1) = self.copy_out.split_at(mid);
        (
            Work {
                k: self.k,
                params: p0,
                state: s0,
                grads: g0,
                copy_out: o0,
            },
            Work {
                k: self.k,
                params: p1,
                state: s1,
                grads: g1,
                copy_out: o1,
            },
        )
    }
}

/// Splits `work` into the pieces [`parallel::split_ranges`] gives for `threads` and
/// `align`, runs `f` on each in the worker pool, and combines the results pairwise in a
/// fixed tree (so the result does not depend on which thread ran what). Uses
/// [`parallel::join`], whose jobs live on the stack, so a call allocates nothing.
fn run_split<W, R, F, C>(work: W, threads: usize, align: usize, f: &F, combine: &C) -> R
where
    W: Splittable,
    R: Send,
    F: Fn(W) -> R + Sync,
    C: Fn(R, R) -> R + Sync,
{
    let len = work.split_len();
    let mut ranges = parallel::split_ranges(len, threads.max(1), align);
    let Some(first) = ranges.next() else {
        return f(work);
    };
    let pieces = 1 + ranges.count();
    if pieces == 1 {
        return f(work);
    }
    let piece_len = first.len();
    split_join(work, pieces, piece_len, f, combine)
}

fn split_join<W, R, F, C>(work: W, pieces: usize, piece_len: usize, f: &F, combine: &C) -> R
where
    W: Splittable,
    R: Send,
    F: Fn(W) -> R + Sync,
    C: Fn(R, R) -> R + Sync,
{
    if pieces == 1 {
        return f(work);
    }
    let left_pieces = pieces / 2;
    let (left, right) = work.split_at(left_pieces * piece_len);
    let (a, b) = parallel::join(
        || split_join(left, left_pieces, piece_len, f, combine),
        || split_join(right, pieces - left_pieces, piece_len, f, combine),
    );
    combine(a, b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_join_visits_every_piece_in_order() {
        struct Span(std::ops::Range<usize>);
        impl Splittable for Span {
            fn split_len(&self) -> usize {
                self.0.len()
            }
            fn split_at(self, mid: usize) -> (Self, Self) {
                let m = self.0.start + mid;
                (Span(self.0.start..m), Span(m..self.0.end))
            }
        }
        for len in [0, 1, 63, 64, 65, 1000] {
            for threads in 1..6 {
                let pieces: Vec<std::ops::Range<usize>> = run_split(
                    Span(0..len),
                    threads,
                    64,
                    &|s: Span| vec![s.0],
                    &|mut a: Vec<_>, b: Vec<_>| {
                        a.extend(b);
                        a
                    },
                );
                let expected: Vec<_> = parallel::split_ranges(len, threads, 64).collect();
                if len == 0 {
                    assert_eq!(pieces, vec![0..0]);
                } else {
                    assert_eq!(pieces, expected);
                }
            }
        }
    }
}
