//! The elementwise part of the SiLU-gated MLP (SwiGLU): `silu(gate) * up`, forward and
//! backward. The three projections around it are matrix products ([`super::matmul_forward`]).

use super::simd::{self, on_isa};
use super::{Cpu, RowsMut, par_chunks, par_rows};

/// out: (N) = `silu(gate) * up`, `silu(x) = x sigmoid(x)`; gate, up: (N).
pub fn swiglu_forward(cpu: &Cpu, out: &mut [f32], gate: &[f32], up: &[f32]) {
    assert_eq!((gate.len(), up.len()), (out.len(), out.len()));
    par_chunks(cpu, out, simd::LANES, |r, out| {
        let (gate, up) = (&gate[r.clone()], &up[r]);
        on_isa!(cpu.isa, {
            for i in 0..out.len() {
                let g = gate[i];
                out[i] = g * simd::sigmoid(g) * up[i];
            }
        })
    });
}

/// dgate: (N) =  dup: (N) =  dout: (N)  gate, up: (N) the forward's inputs.
/// `dup = silu(gate) dout`, `dgate = s (1 + gate (1 - s)) up dout`, `s = sigmoid(gate)`.
pub fn swiglu_backward(
    cpu: &Cpu,
    dgate: &mut [f32],
    dup: &mut [f32],
    dout: &[f32],
    gate: &[f32],
    up: &[f32],
) {
    let n = dout.len();
    assert_eq!((dgate.len(), dup.len(), gate.len(), up.len()), (n, n, n, n));
    let parts = (RowsMut::new(dgate, 1), RowsMut::new(dup, 1));
    par_rows(
        cpu.threads_for(n),
        n,
        simd::LANES,
        parts,
        |r, (dgate, dup)| {
            let (dout, gate, up) = (&dout[r.clone()], &gate[r.clone()], &up[r]);
            let (dgate, dup) = (dgate.data, dup.data);
            on_isa!(cpu.isa, {
                for i in 0..dgate.len() {
                    let g = gate[i];
                    let s = simd::sigmoid(g);
                    dup[i] = g * s * dout[i];
                    dgate[i] = s * (1.0 + g * (1.0 - s)) * up[i] * dout[i];
                }
            })
        },
    );
}
