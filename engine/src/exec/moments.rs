//! A block's optimizer state as the CPU optimizer and the state's loading and export see
//! it: the bytes of its buffer ([`StateLayout`]) split into the fp32 master parameters
//! and AdamW's moments in their format, each tensor's part handed to the AdamW kernel in
//! turn, and the moments converted from and to f32 (what checkpoints hold, whatever the
//! format).
//!
//! Not here: where the buffer lives (the plan's homes) or the update's order (`host.rs`).

use half::bf16;
use strata_kernels::adamw::{Q8State, State, q8};

use super::executor::Executor;
use crate::device::{cast, cast_mut};
use crate::model::{OptimizerState, Piece, StateLayout};

impl Executor {
    /// Where the parts of this rank's shard of block `b`'s optimizer state lie in its
    /// buffer (the plan's buffer may be a few scales longer: it holds any rank's).
    pub(super) fn state_layout(&self, b: usize) -> &StateLayout {
        &self.state_layouts[b]
    }

    /// Bytes of block `b`'s optimizer state buffer as the plan sized it (any rank's
    /// shard fits), what loading writes and export reads.
    pub(super) fn state_buffer_bytes(&self, b: usize) -> usize {
        StateLayout::shard_bytes(
            self.plan.shape.optimizer_state,
            &self.model.blocks()[b],
            self.plan.shard_len[b] as usize,
            self.comm.size(),
        )
    }
}

/// AdamW's moments of a block's state, in their format (the kernel's [`State`] of the
/// whole buffer), handed out a tensor's part at a time ([`StateMoments::take`]).
pub(super) struct StateMoments<'a>(State<'a>);

/// The master parameters and the moments of a state buffer laid out as `layout` says
/// (`bytes` at least [`StateLayout::bytes`] long).
pub(super) fn split_state<'a>(
    layout: &StateLayout,
    bytes: &'a mut [u8],
) -> (&'a mut [f32], StateMoments<'a>) {
    let (head, rest) = bytes.split_at_mut(layout.master().end);
    let [m, v] = layout.moments();
    let (m_bytes, rest) = rest.split_at_mut(m.len());
    let (v_bytes, rest) = rest.split_at_mut(v.len());
    let master = cast_mut::<f32>(head);
    let moments = match layout.format {
        OptimizerState::Fp32 => State::F32 {
            m: cast_mut(m_bytes),
            v: cast_mut(v_bytes),
        },
        OptimizerState::Bf16 => State::Bf16 {
            m: cast_mut(m_bytes),
            v: cast_mut(v_bytes),
        },
        OptimizerState::Q8 => {
            let [ms, vs] = layout.scales();
            let (_, rest) = rest.split_at_mut(ms.start - v.end);
            let (ms_bytes, rest) = rest.split_at_mut(ms.len());
            let (vs_bytes, _) = rest.split_at_mut(vs.len());
            State::Q8(Q8State {
                m_codes: m_bytes,
                m_scales: cast_mut(ms_bytes),
                v_codes: v_bytes,
                v_scales: cast_mut(vs_bytes),
            })
        }
    };
    (master, StateMoments(moments))
}

/// The first `n` of `s`, leaving the rest in `s`.
fn front<'a, T>(s: &mut &'a mut [T], n: usize) -> &'a mut [T] {
    let (now, rest) = std::mem::take(s).split_at_mut(n);
    *s = rest;
    now
}

impl<'a> StateMoments<'a> {
    /// The moments of the next tensor part, `skip` elements after the end of the last
    /// part taken (an alignment gap), `take` long: the kernel's [`State`] of them.
    pub(super) fn take(&mut self, skip: usize, take: usize) -> State<'a> {
        match &mut self.0 {
            State::F32 { m, v } => {
                front(m, skip);
                front(v, skip);
                State::F32 {
                    m: front(m, take),
                    v: front(v, take),
                }
            }
            State::Bf16 { m, v } => {
                front(m, skip);
                front(v, skip);
                State::Bf16 {
                    m: front(m, take),
                    v: front(v, take),
                }
            }
            State::Q8(q) => {
                front(&mut q.m_codes, skip);
                front(&mut q.v_codes, skip);
                let scales = q8::scale_count(take);
                State::Q8(Q8State {
                    m_codes: front(&mut q.m_codes, take),
                    m_scales: front(&mut q.m_scales, scales),
                    v_codes: front(&mut q.v_codes, take),
                    v_scales: front(&mut q.v_scales, scales),
                })
            }
        }
    }
}

/// Writes the moments `m` and `v` (f32, the layout's length each, zero in gaps) into
/// the moment bytes of a state buffer laid out as `layout` says: copied, rounded to
/// bf16 (nearest even), or quantized a tensor part at a time. The master parameters are
/// not touched.
pub(super) fn encode_moments(layout: &StateLayout, m: &[f32], v: &[f32], bytes: &mut [u8]) {
    let (_, mut moments) = split_state(layout, bytes);
    match &mut moments.0 {
        State::F32 { m: mo, v: vo } => {
            mo.copy_from_slice(m);
            vo.copy_from_slice(v);
        }
        State::Bf16 { m: mo, v: vo } => {
            for (o, x) in mo.iter_mut().zip(m).chain(vo.iter_mut().zip(v)) {
                *o = bf16::from_f32(*x);
            }
        }
        State::Q8(_) => {
            let mut done = 0;
            for &Piece { at, len, .. } in &layout.pieces {
                let State::Q8(q) = moments.take(at - done, len) else {
                    unreachable!("8-bit moments hand out 8-bit state")
                };
                q8::quantize_m(&m[at..at + len], q.m_codes, q.m_scales);
                q8::quantize_v(&v[at..at + len], q.v_codes, q.v_scales);
                done = at + len;
            }
        }
    }
}

/// The moments of a state buffer laid out as `layout` says, as f32 (the layout's length
/// each; zero in gaps).
pub(super) fn decode_moments(layout: &StateLayout, bytes: &[u8]) -> [Vec<f32>; 2] {
    let [mr, vr] = layout.moments();
    let mut m = vec![0f32; layout.len];
    let mut v = vec![0f32; layout.len];
    match layout.format {
        OptimizerState::Fp32 => {
            m.copy_from_slice(cast::<f32>(&bytes[mr]));
            v.copy_from_slice(cast::<f32>(&bytes[vr]));
        }
        OptimizerState::Bf16 => {
            for (o, x) in m.iter_mut().zip(cast::<bf16>(&bytes[mr])) {
                *o = x.to_f32();
            }
            for (o, x) in v.iter_mut().zip(cast::<bf16>(&bytes[vr])) {
                *o = x.to_f32();
            }
        }
        OptimizerState::Q8 => {
            let [msr, vsr] = layout.scales();
            let (mc, vc) = (&bytes[mr], &bytes[vr]);
            let (ms, vs) = (cast::<f32>(&bytes[msr]), cast::<f32>(&bytes[vsr]));
            let mut s = 0;
            for &Piece { at, len, .. } in &layout.pieces {
                let n = q8::scale_count(len);
                let r = at..at + len;
                q8::dequantize_m(&mc[r.clone()], &ms[s..s + n], &mut m[r.clone()]);
                q8::dequantize_v(&vc[r.clone()], &vs[s..s + n], &mut v[r]);
                s += n;
            }
        }
    }
    [m, v]
}
