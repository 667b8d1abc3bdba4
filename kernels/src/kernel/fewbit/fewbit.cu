// Few-bit backward of GELU (tanh) and of the SwiGLU gate (SiLU): forwards that also write
// each input's b-bit code (b = 1..4) of the interval of the piecewise-constant
// approximation of the derivative that holds it, and backwards that multiply by that
// interval's level. The tables are the host's (kernel/fewbit/tables.rs; a test holds
// these lines to them), all widths of one activation in one array: breakpoints of width
// b at FEWBIT_BREAKS_AT(b), levels at FEWBIT_LEVELS_AT(b).
//
// code(x) = how many breakpoints t have x >= t (0 for NaN). Codes are packed in bit
// planes: elements in groups of 32 (one warp), group g owning the u32 words
// codes[b g .. b g + b], word j holding bit j of the group's codes, element 32 g + l in
// bit l; a group's missing elements have code 0. One thread per element; the forwards
// run whole warps (blockDim a multiple of 32), one ballot per word.

#define FEWBIT_BREAKS_AT(b) ((1 << (b)) - 1 - (b))
#define FEWBIT_LEVELS_AT(b) ((1 << (b)) - 2)

__constant__ float FEWBIT_GELU_BREAKS[26] = {
    0.0f,
    -0.5f, 0.0f, 0.5f,
    -0.78125f, -0.46875f, -0.2265625f, 0.0f, 0.2265625f, 0.46875f, 0.78125f,
    -0.9296875f, -0.71875f, -0.5546875f, -0.4140625f, -0.2890625f, -0.171875f, -0.0546875f,
    0.0625f, 0.1796875f, 0.296875f, 0.4296875f, 0.5703125f, 0.7421875f, 0.96875f, 2.0546875f,
};

__constant__ float FEWBIT_GELU_LEVELS[30] = {
    0.090891354f, 0.90910864f,
    -0.046543688f, 0.31236488f, 0.6876351f, 1.0465437f,
    -0.09023385f, 0.066750534f, 0.23596537f, 0.41076505f, 0.58923495f, 0.7640346f,
    0.9332495f, 1.0902338f,
    -0.10217787f, -0.02630964f, 0.0565358f, 0.14335966f, 0.23144013f, 0.31974697f,
    0.41020682f, 0.5031096f, 0.59592724f, 0.6861372f, 0.77666324f, 0.8663195f, 0.9532894f,
    1.0372932f, 1.1116339f, 1.0490028f,
};

__constant__ float FEWBIT_SILU_BREAKS[26] = {
    0.0f,
    -0.671875f, 0.0f, 0.671875f,
    -1.125f, -0.6640625f, -0.3125f, 0.0f, 0.3125f, 0.6640625f, 1.125f,
    -1.46875f, -1.109375f, -0.859375f, -0.65625f, -0.4765625f, -0.3125f, -0.15625f, 0.0f,
    0.15625f, 0.3125f, 0.4765625f, 0.65625f, 0.859375f, 1.109375f, 1.46875f,
};

__constant__ float FEWBIT_SILU_LEVELS[30] = {
    0.18788016f, 0.81211984f,
    0.032936506f, 0.3438581f, 0.65614194f, 0.9670635f,
    -0.04045363f, 0.113828495f, 0.26854983f, 0.42312816f, 0.5768719f, 0.73145014f,
    0.8861715f, 1.0404537f,
    -0.074433714f, 0.00224176f, 0.079460986f, 0.15592705f, 0.23221347f, 0.308348f,
    0.38422403f, 0.46109587f, 0.53890413f, 0.615776f, 0.691652f, 0.7677865f, 0.84407294f,
    0.920539f, 0.99775827f, 1.0744337f,
};

// The interval of x among the 2^bits - 1 breakpoints of width `bits` in `breaks`.
__device__ __forceinline__ unsigned int fewbit_code(const float* breaks, int bits, float x) {
    const float* t = breaks + FEWBIT_BREAKS_AT(bits);
    unsigned int code = 0;
    for (int k = 0; k < (1 << bits) - 1; k++) {
        code += x >= t[k] ? 1u : 0u;
    }
    return code;
}

// Writes the bit planes of the warp's codes: lane j writes word j of its group. Every
// lane of the warp calls it (elements past n with code 0).
__device__ __forceinline__ void fewbit_store(unsigned int* codes, unsigned int code, int bits,
                                             long long i, long long n) {
    long long group = i >> 5;
    int lane = (int)(i & 31);
    for (int j = 0; j < bits; j++) {
        unsigned int plane = __ballot_sync(0xffffffffu, (code >> j) & 1u);
        if (lane == j && group * 32 < n) {
            codes[group * bits + j] = plane;
        }
    }
}

// The code of element i from its group's bit planes.
__device__ __forceinline__ unsigned int fewbit_load(const unsigned int* codes, int bits,
                                                    long long i) {
    const unsigned int* planes = codes + (i >> 5) * bits;
    int lane = (int)(i & 31);
    unsigned int code = 0;
    for (int j = 0; j < bits; j++) {
        code |= ((planes[j] >> lane) & 1u) << j;
    }
    return code;
}

// out: (N) = gelu(inp), tanh form (as gelu.cu: x sigmoid(2u)); codes: (b ceil(N / 32)).
template <typename T>
__device__ void fewbit_gelu_forward(T* out, unsigned int* codes, const T* inp, int bits,
                                    long long n) {
    long long i = global_index();
    unsigned int code = 0;
    if (i < n) {
        float x = to_float(inp[i]);
        float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
        out[i] = from_float<T>(x / (1.0f + expf(-2.0f * u)));
        code = fewbit_code(FEWBIT_GELU_BREAKS, bits, x);
    }
    fewbit_store(codes, code, bits, i, n);
}

// dinp: (N) = level[code] * dout  codes: (b ceil(N / 32))  dout: (N).
template <typename T>
__device__ void fewbit_gelu_backward(T* dinp, const unsigned int* codes, const T* dout,
                                     int bits, long long n) {
    long long i = global_index();
    if (i >= n) {
        return;
    }
    float level = FEWBIT_GELU_LEVELS[FEWBIT_LEVELS_AT(bits) + fewbit_load(codes, bits, i)];
    dinp[i] = from_float<T>(level * to_float(dout[i]));
}

// out, act: (N) = silu(gate) up, silu(gate); codes: (b ceil(N / 32)) of gate; gate, up: (N).
template <typename T>
__device__ void fewbit_swiglu_forward(T* out, T* act, unsigned int* codes, const T* gate,
                                      const T* up, int bits, long long n) {
    long long i = global_index();
    unsigned int code = 0;
    if (i < n) {
        float g = to_float(gate[i]);
        float s = g / (1.0f + expf(-g));
        act[i] = from_float<T>(s);
        out[i] = from_float<T>(s * to_float(up[i]));
        code = fewbit_code(FEWBIT_SILU_BREAKS, bits, g);
    }
    fewbit_store(codes, code, bits, i, n);
}

// dgate, dup: (N) = (level[code] up) dout, act dout; codes: (b ceil(N / 32)); dout, act,
// up: (N).
template <typename T>
__device__ void fewbit_swiglu_backward(T* dgate, T* dup, const unsigned int* codes,
                                       const T* dout, const T* act, const T* up, int bits,
                                       long long n) {
    long long i = global_index();
    if (i >= n) {
        return;
    }
    float level = FEWBIT_SILU_LEVELS[FEWBIT_LEVELS_AT(bits) + fewbit_load(codes, bits, i)];
    float d = to_float(dout[i]);
    dup[i] = from_float<T>(to_float(act[i]) * d);
    dgate[i] = from_float<T>(level * to_float(up[i]) * d);
}

#define FEWBIT_KERNELS(T, S)                                                                  \
    extern "C" __global__ void fewbit_gelu_forward_##S(T* out, unsigned int* codes,           \
                                                       const T* inp, int bits, long long n) { \
        fewbit_gelu_forward<T>(out, codes, inp, bits, n);                                     \
    }                                                                                         \
    extern "C" __global__ void fewbit_gelu_backward_##S(T* dinp, const unsigned int* codes,   \
                                                        const T* dout, int bits,              \
                                                        long long n) {                        \
        fewbit_gelu_backward<T>(dinp, codes, dout, bits, n);                                  \
    }                                                                                         \
    extern "C" __global__ void fewbit_swiglu_forward_##S(T* out, T* act, unsigned int* codes, \
                                                         const T* gate, const T* up,          \
                                                         int bits, long long n) {             \
        fewbit_swiglu_forward<T>(out, act, codes, gate, up, bits, n);                         \
    }                                                                                         \
    extern "C" __global__ void fewbit_swiglu_backward_##S(                                    \
        T* dgate, T* dup, const unsigned int* codes, const T* dout, const T* act,             \
        const T* up, int bits, long long n) {                                                 \
        fewbit_swiglu_backward<T>(dgate, dup, codes, dout, act, up, bits, n);                 \
    }
FOR_EACH_TYPE(FEWBIT_KERNELS)
