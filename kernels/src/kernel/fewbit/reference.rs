//! The scalar references of the few-bit kernels (`super`): each element's code found by
//! walking the breakpoints up, packed and unpacked bit by bit, and the backwards as one
//! product per element in the order the kernels state. In f32 only: codes are defined by
//! f32 comparisons. The forwards' activations are the GELU and SwiGLU references'
//! ([`crate::kernel::gelu::reference`], [`crate::kernel::swiglu::reference`]).
#![allow(clippy::needless_range_loop)]

use super::{GROUP, Table, codes_len};

/// The interval of `x`: the first breakpoint above `x` (`x >= t` steps past `t`), or the
/// last interval; NaN steps past none.
pub fn code(table: &Table, x: f32) -> u32 {
    let mut k = 0;
    while k < table.breakpoints.len() && x >= table.breakpoints[k] {
        k += 1;
    }
    k as u32
}

/// The codes of `x`, one per element.
pub fn codes(table: &Table, x: &[f32]) -> Vec<u32> {
    x.iter().map(|&x| code(table, x)).collect()
}

/// `codes` (each below `2^bits`) packed as the kernels pack them: bit `j` of element `i`'s
/// code at bit `i % 32` of word `bits * (i / 32) + j`.
pub fn pack(codes: &[u32], table: &Table) -> Vec<u32> {
    let bits = table.bits.count();
    let mut words = vec![0u32; codes_len(codes.len(), table.bits)];
    for i in 0..codes.len() {
        assert!(codes[i] < 1 << bits, "code {} of {bits} bits", codes[i]);
        for j in 0..bits {
            words[bits * (i / GROUP) + j] |= ((codes[i] >> j) & 1) << (i % GROUP);
        }
    }
    words
}

/// The codes of `n` elements from their packed words.
pub fn unpack(words: &[u32], n: usize, table: &Table) -> Vec<u32> {
    let bits = table.bits.count();
    assert_eq!(words.len(), codes_len(n, table.bits));
    (0..n)
        .map(|i| {
            (0..bits)
                .map(|j| ((words[bits * (i / GROUP) + j] >> (i % GROUP)) & 1) << j)
                .sum()
        })
        .collect()
}

/// The approximate derivative at each of `codes`.
pub fn levels(codes: &[u32], table: &Table) -> Vec<f32> {
    codes.iter().map(|&c| table.levels[c as usize]).collect()
}

/// dinp: (N) = `levels[code] * dout`; words: the forward's packed codes.
pub fn fewbit_backward(dinp: &mut [f32], words: &[u32], dout: &[f32], table: &Table) {
    let level = levels(&unpack(words, dout.len(), table), table);
    for i in 0..dout.len() {
        dinp[i] = level[i] * dout[i];
    }
}

/// dgate: (N) = `(levels[code] * up) * dout`, dup: (N) = `act * dout`.
pub fn fewbit_swiglu_backward(
    [dgate, dup]: [&mut [f32]; 2],
    words: &[u32],
    [dout, act, up]: [&[f32]; 3],
    table: &Table,
) {
    let level = levels(&unpack(words, dout.len(), table), table);
    for i in 0..dout.len() {
        dup[i] = act[i] * dout[i];
        dgate[i] = level[i] * up[i] * dout[i];
    }
}
