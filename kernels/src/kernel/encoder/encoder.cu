// Token and position embedding.

// out: (B, T, C)  tokens: (B, T)  wte: (V, C)  wpe: (maxT, C). One thread per element. A
// token outside 0..V gives NaN rather than a read outside wte.
template <typename T>
__device__ void encoder_forward(T* out, const unsigned int* tokens, const T* wte, const T* wpe,
                                int n, int t_len, int c, int v) {
    long long i = global_index();
    if (i >= (long long)n * c) {
        return;
    }
    int row = (int)(i / c);
    int col = (int)(i % c);
    long long token = tokens[row];
    int position = row % t_len;
    if (token >= v) {
        out[i] = from_float<T>(__int_as_float(0x7fc00000));
        return;
    }
    float e = to_float(wte[token * c + col]) + to_float(wpe[(long long)position * c + col]);
    out[i] = from_float<T>(e);
}

// dwte: (V, C) +=  dout: (B, T, C)  tokens: (B, T). One thread per channel, adding the
// positions in order: no atomics, the same result every run. Tokens outside 0..V are
// skipped (the forward pass made them NaN).
template <typename T>
__device__ void encoder_backward_wte(float* dwte, const T* dout, const unsigned int* tokens,
                                     int n, int c, int v) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= c) {
        return;
    }
    for (int row = 0; row < n; row++) {
        long long token = tokens[row];
        if (token < v) {
            dwte[token * c + col] += to_float(dout[(long long)row * c + col]);
        }
    }
}

// dwpe: (maxT, C) +=  dout: (B, T, C). One thread per (position, channel).
template <typename T>
__device__ void encoder_backward_wpe(float* dwpe, const T* dout, int b, int t_len, int c) {
    long long i = global_index();
    if (i >= (long long)t_len * c) {
        return;
    }
    int position = (int)(i / c);
    int col = (int)(i % c);
    float acc = 0.0f;
    for (int bi = 0; bi < b; bi++) {
        acc += to_float(dout[((long long)bi * t_len + position) * c + col]);
    }
    dwpe[i] += acc;
}

#define ENCODER_KERNELS(T, S)                                                                 \
    extern "C" __global__ void encoder_forward_##S(T* out, const unsigned int* tokens,        \
                                                   const T* wte, const T* wpe, int n,         \
                                                   int t_len, int c, int v) {                 \
        encoder_forward<T>(out, tokens, wte, wpe, n, t_len, c, v);                            \
    }                                                                                         \
    extern "C" __global__ void encoder_backward_wte_##S(float* dwte, const T* dout,           \
                                                        const unsigned int* tokens, int n,    \
                                                        int c, int v) {                       \
        encoder_backward_wte<T>(dwte, dout, tokens, n, c, v);                                 \
    }                                                                                         \
    extern "C" __global__ void encoder_backward_wpe_##S(float* dwpe, const T* dout, int b,    \
                                                        int t_len, int c) {                   \
        encoder_backward_wpe<T>(dwpe, dout, b, t_len, c);                                     \
    }
FOR_EACH_TYPE(ENCODER_KERNELS)
