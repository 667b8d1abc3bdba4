//! Token and position embedding, forward and backward.

use super::simd::on_isa;
use super::{Cpu, RowsMut, par_rows, simd};

/// out: (B, T, C)  tokens: (B, T)  wte: (V, C)  wpe: (maxT, C), maxT >= T.
/// `out[b, t] = wte[tokens[b, t]] + wpe[t]`. Panics on a token outside `0..V`.
#[allow(clippy::too_many_arguments)]
pub fn encoder_forward(
    cpu: &Cpu,
    out: &mut [f32],
    tokens: &[u32],
    wte: &[f32],
    wpe: &[f32],
    b: usize,
    t: usize,
    c: usize,
) {
    let n = b * t;
    assert_eq!(out.len(), n * c);
    assert_eq!(tokens.len(), n);
    assert!(
        wpe.len() >= t * c,
        "position embedding shorter than the sequence"
    );
    let vocab = wte.len() / c;
    par_rows(
        cpu.threads_for(n * c),
        n,
        1,
        RowsMut::new(out, c),
        |rows, out| {
            on_isa!(cpu.isa, {
                for (row, o) in rows.zip(out.data.chunks_exact_mut(c)) {
                    let token = tokens[row] as usize;
                    assert!(
                        token < vocab,
                        "token {token} at {row} outside vocabulary {vocab}"
                    );
                    let (e, p) = (&wte[token * c..][..c], &wpe[(row % t) * c..][..c]);
                    for i in 0..c {
                        o[i] = e[i] + p[i];
                    }
                }
            },)
        },
    );
}

/// dwte: (V, C) +=  dwpe: (maxT, C) +=  dout: (B, T, C)  tokens: (B, T).
/// Threads own disjoint rows of `dwte` (token ids) and of `dwpe` (positions), and add
/// positions in order, so the result does not depend on the thread count.
#[allow(clippy::too_many_arguments)]
pub fn encoder_backward(
    cpu: &Cpu,
    dwte: &mut [f32],
    dwpe: &mut [f32],
    dout: &[f32],
    tokens: &[u32],
    b: usize,
    t: usize,
    c: usize,
) {
    let n = b * t;
    assert_eq!(dout.len(), n * c);
    assert_eq!(tokens.len(), n);
    assert!(dwpe.len() >= t * c);
    let vocab = dwte.len() / c;
    assert_eq!(dwte.len(), vocab * c);
    let threads = cpu.threads_for(n * c);
    par_rows(threads, vocab, 1, RowsMut::new(dwte, c), |ids, dwte| {
        on_isa!(cpu.isa, {
            for (row, &token) in tokens.iter().enumerate() {
                let token = token as usize;
                if ids.contains(&token) {
                    let d = &mut dwte.data[(token - ids.start) * c..][..c];
                    simd::add_assign(d, &dout[row * c..][..c]);
                }
            }
        },)
    });
    par_rows(
        threads,
        t,
        1,
        RowsMut::new(&mut dwpe[..t * c], c),
        |positions, dwpe| {
            on_isa!(cpu.isa, {
                for (pos, d) in positions.zip(dwpe.data.chunks_exact_mut(c)) {
                    for bi in 0..b {
                        simd::add_assign(d, &dout[(bi * t + pos) * c..][..c]);
                    }
                }
            },)
        },
    );
}
