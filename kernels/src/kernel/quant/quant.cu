// Dequantisation of the frozen base weights' block formats (kernel/quant; the formats are
// defined in format.rs): NF4 with double-quantised absmaxes (QLoRA's, as bitsandbytes
// stores it) and blockwise int8. Each writes the working type, just before a product reads
// the weight. Every product and sum is rounded on its own (__fmul_rn, __fadd_rn, which the
// compiler never fuses into a multiply-add), in the CPU's order, so the values are the
// CPU's bits.

#define QUANT_NF4_BLOCK 64
#define QUANT_ABSMAX_GROUP 256
#define QUANT_INT8_BLOCK 64

// The 16 NF4 levels, bitsandbytes' float32 values (format.rs: NF4_CODE).
__constant__ float QUANT_NF4_CODE[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f,
};

// The positive half of bitsandbytes' dynamic 8-bit map below 1.0 (format.rs:
// DYNAMIC_POSITIVE).
__constant__ float QUANT_DYNAMIC_POSITIVE[127] = {
    5.5000004e-07f, 3.2500002e-06f, 7.75e-06f, 2.1249998e-05f, 4.375e-05f, 6.625e-05f,
    8.875e-05f, 0.00015625001f, 0.00026875004f, 0.00038125002f, 0.00049375003f,
    0.0006062501f, 0.00071875006f, 0.00083125f, 0.0009437501f, 0.0012812499f, 0.00184375f,
    0.00240625f, 0.00296875f, 0.0035312497f, 0.00409375f, 0.0046562497f, 0.0052187503f,
    0.00578125f, 0.00634375f, 0.00690625f, 0.00746875f, 0.00803125f, 0.00859375f,
    0.009156249f, 0.00971875f, 0.01140625f, 0.01421875f, 0.01703125f, 0.019843752f,
    0.02265625f, 0.02546875f, 0.028281251f, 0.03109375f, 0.03390625f, 0.036718752f,
    0.03953125f, 0.042343747f, 0.04515625f, 0.04796875f, 0.05078125f, 0.05359375f,
    0.05640625f, 0.059218753f, 0.06203125f, 0.06484375f, 0.067656256f, 0.070468746f,
    0.07328125f, 0.07609375f, 0.07890625f, 0.08171876f, 0.08453125f, 0.08734375f,
    0.09015625f, 0.092968754f, 0.09578126f, 0.09859375f, 0.107031256f, 0.12109375f,
    0.13515624f, 0.14921875f, 0.16328125f, 0.17734376f, 0.19140625f, 0.20546874f,
    0.21953125f, 0.23359375f, 0.24765624f, 0.26171875f, 0.27578127f, 0.28984374f,
    0.30390626f, 0.31796873f, 0.33203125f, 0.34609374f, 0.36015624f, 0.37421876f,
    0.38828123f, 0.40234375f, 0.41640624f, 0.43046874f, 0.44453126f, 0.45859373f,
    0.47265625f, 0.4867187f, 0.50078124f, 0.5148437f, 0.5289062f, 0.54296875f, 0.5570313f,
    0.5710938f, 0.58515626f, 0.5992187f, 0.61328125f, 0.6273438f, 0.6414063f, 0.65546876f,
    0.6695312f, 0.68359375f, 0.6976563f, 0.7117188f, 0.72578126f, 0.7398437f, 0.75390625f,
    0.7679688f, 0.78203124f, 0.79609376f, 0.8101562f, 0.82421875f, 0.8382813f, 0.85234374f,
    0.86640626f, 0.8804687f, 0.89453125f, 0.9085938f, 0.92265624f, 0.93671876f, 0.9507812f,
    0.96484375f, 0.9789063f, 0.99296874f,
};

// x in the working type, rounded to bf16's precision first where round_bf16 (the CPU
// device's rule for a base trained in bf16; a bf16 T rounds anyway).
template <typename T>
__device__ __forceinline__ T quant_out(float x, int round_bf16) {
    return from_float<T>(round_bf16 ? to_float(from_float<bf16>(x)) : x);
}

// Entry q of the dynamic map: the negated positive half (codes 0..126, descending in
// magnitude), 0 (127), the positive half (128..254), 1 (255).
__device__ __forceinline__ float quant_dynamic_value(unsigned int q) {
    if (q == 255u) {
        return 1.0f;
    }
    if (q == 127u) {
        return 0.0f;
    }
    return q > 127u ? QUANT_DYNAMIC_POSITIVE[q - 128u] : -QUANT_DYNAMIC_POSITIVE[126u - q];
}

// out: (N)  codes: (ceil(N/2)) bytes, element 2k in byte k's high nibble, 2k+1 in its low
// absmax_q: (ceil(N/64))  absmax_scale: (ceil(N/64/256)).
// absmax_offset: (1).
// out[i] = level[code_i] * (map[absmax_q[i/64]] * absmax_scale[i/64/256] + absmax_offset[0]).
// One thread per byte (two values); a warp covers one block, so its absmax reads agree.
template <typename T>
__device__ void nf4_dequantize(T* out, const unsigned char* codes, const unsigned char* absmax_q,
                               const float* absmax_scale, const float* absmax_offset,
                               int round_bf16, long long n) {
    __shared__ float level[16];
    if (threadIdx.x < 16) {
        level[threadIdx.x] = QUANT_NF4_CODE[threadIdx.x];
    }
    __syncthreads();
    long long k = global_index();
    long long i = 2 * k;
    if (i >= n) {
        return;
    }
    long long block = i / QUANT_NF4_BLOCK;
    float scaled = __fmul_rn(quant_dynamic_value(absmax_q[block]),
                             absmax_scale[block / QUANT_ABSMAX_GROUP]);
    float absmax = __fadd_rn(scaled, absmax_offset[0]);
    unsigned int byte = codes[k];
    out[i] = quant_out<T>(__fmul_rn(level[byte >> 4], absmax), round_bf16);
    if (i + 1 < n) {
        out[i + 1] = quant_out<T>(__fmul_rn(level[byte & 15u], absmax), round_bf16);
    }
}

// out: (N)  codes: (N) int8  scales: (ceil(N/64)).  out[i] = codes[i] * scales[i/64].
// One thread per element.
template <typename T>
__device__ void int8_dequantize(T* out, const signed char* codes, const float* scales,
                                int round_bf16, long long n) {
    long long i = global_index();
    if (i < n) {
        float x = __fmul_rn((float)codes[i], scales[i / QUANT_INT8_BLOCK]);
        out[i] = quant_out<T>(x, round_bf16);
    }
}

#define QUANT_KERNELS(T, S)                                                                   \
    extern "C" __global__ void nf4_dequantize_##S(T* out, const unsigned char* codes,         \
                                                  const unsigned char* absmax_q,              \
                                                  const float* absmax_scale,                  \
                                                  const float* absmax_offset,                 \
                                                  int round_bf16, long long n) {              \
        nf4_dequantize<T>(out, codes, absmax_q, absmax_scale, absmax_offset, round_bf16, n);  \
    }                                                                                         \
    extern "C" __global__ void int8_dequantize_##S(T* out, const signed char* codes,          \
                                                   const float* scales, int round_bf16,       \
                                                   long long n) {                             \
        int8_dequantize<T>(out, codes, scales, round_bf16, n);                                \
    }
FOR_EACH_TYPE(QUANT_KERNELS)
