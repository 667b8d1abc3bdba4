//! The few-bit tables: for GPT-2's tanh GELU and for SiLU, at 1, 2, 3 and 4 bits, the
//! breakpoints and levels of the piecewise-constant approximation of the derivative
//! with the least mean squared error under N(0, 1), as [`super::fit`] found them (cells
//! of 1/128 over [-6, 6]; `fit`'s test runs it again and finds these). Each table's
//! error is the root mean square of `f'(x) - level(x)` for x ~ N(0, 1).
//!
//! Both derivatives satisfy `f'(x) + f'(-x) = 1` (`f(x) - f(-x) = x`), so the tables
//! are symmetric about 0 except where the 16-interval GELU spends a breakpoint on the
//! derivative's overshoot above 1 (its maximum, 1.129, is at x = 1.42).

use super::{Bits, Table};

/// GELU (tanh), 1 bit: RMS error 0.196.
const GELU_1: Table = Table {
    bits: Bits::One,
    breakpoints: &[0.0],
    levels: &[0.090891354, 0.90910864],
};

/// GELU (tanh), 2 bits: RMS error 0.0895.
const GELU_2: Table = Table {
    bits: Bits::Two,
    breakpoints: &[-0.5, 0.0, 0.5],
    levels: &[-0.046543688, 0.31236488, 0.6876351, 1.0465437],
};

/// GELU (tanh), 3 bits: RMS error 0.0437.
const GELU_3: Table = Table {
    bits: Bits::Three,
    breakpoints: &[
        -0.78125, -0.46875, -0.2265625, 0.0, 0.2265625, 0.46875, 0.78125,
    ],
    levels: &[
        -0.09023385,
        0.066750534,
        0.23596537,
        0.41076505,
        0.58923495,
        0.7640346,
        0.9332495,
        1.0902338,
    ],
};

/// GELU (tanh), 4 bits: RMS error 0.0243.
const GELU_4: Table = Table {
    bits: Bits::Four,
    breakpoints: &[
        -0.9296875, -0.71875, -0.5546875, -0.4140625, -0.2890625, -0.171875, -0.0546875, 0.0625,
        0.1796875, 0.296875, 0.4296875, 0.5703125, 0.7421875, 0.96875, 2.0546875,
    ],
    levels: &[
        -0.10217787,
        -0.02630964,
        0.0565358,
        0.14335966,
        0.23144013,
        0.31974697,
        0.41020682,
        0.5031096,
        0.59592724,
        0.6861372,
        0.77666324,
        0.8663195,
        0.9532894,
        1.0372932,
        1.1116339,
        1.0490028,
    ],
};

/// SiLU, 1 bit: RMS error 0.179.
const SILU_1: Table = Table {
    bits: Bits::One,
    breakpoints: &[0.0],
    levels: &[0.18788016, 0.81211984],
};

/// SiLU, 2 bits: RMS error 0.0889.
const SILU_2: Table = Table {
    bits: Bits::Two,
    breakpoints: &[-0.671875, 0.0, 0.671875],
    levels: &[0.032936506, 0.3438581, 0.65614194, 0.9670635],
};

/// SiLU, 3 bits: RMS error 0.0440.
const SILU_3: Table = Table {
    bits: Bits::Three,
    breakpoints: &[-1.125, -0.6640625, -0.3125, 0.0, 0.3125, 0.6640625, 1.125],
    levels: &[
        -0.04045363,
        0.113828495,
        0.26854983,
        0.42312816,
        0.5768719,
        0.73145014,
        0.8861715,
        1.0404537,
    ],
};

/// SiLU, 4 bits: RMS error 0.0218.
const SILU_4: Table = Table {
    bits: Bits::Four,
    breakpoints: &[
        -1.46875, -1.109375, -0.859375, -0.65625, -0.4765625, -0.3125, -0.15625, 0.0, 0.15625,
        0.3125, 0.4765625, 0.65625, 0.859375, 1.109375, 1.46875,
    ],
    levels: &[
        -0.074433714,
        0.00224176,
        0.079460986,
        0.15592705,
        0.23221347,
        0.308348,
        0.38422403,
        0.46109587,
        0.53890413,
        0.615776,
        0.691652,
        0.7677865,
        0.84407294,
        0.920539,
        0.99775827,
        1.0744337,
    ],
};

/// GPT-2's tanh GELU's tables, `GELU_TABLES[bits - 1]`.
pub const GELU_TABLES: [Table; 4] = [GELU_1, GELU_2, GELU_3, GELU_4];

/// SiLU's tables (the SwiGLU gate's), `SILU_TABLES[bits - 1]`.
pub const SILU_TABLES: [Table; 4] = [SILU_1, SILU_2, SILU_3, SILU_4];

/// The RMS errors the optimiser reported, `[GELU, SiLU][bits - 1]`, as the docs state them
/// (`docs/few-bit-backward.md`); tests hold the tables to them.
pub const RMS_ERRORS: [[f64; 4]; 2] = [
    [0.19608, 0.089497, 0.043700, 0.024273],
    [0.17906, 0.088858, 0.044007, 0.021803],
];
