// Elementwise kernels: GELU (tanh approximation), the residual add, and the f32
// accumulation of gradients. One thread per element.

#define GELU_SCALE 0.7978845608028654f

// out: (N) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): the same as
// 0.5 x (1 + tanh(u)), without the cancellation of 1 + tanh(u) for large negative x.
template <typename T>
__device__ void gelu_forward(T* out, const T* inp, long long n) {
    long long i = global_index();
    if (i >= n) {
        return;
    }
    float x = to_float(inp[i]);
    float u = GELU_SCALE * (x + 0.044715f * x * x * x);
    out[i] = from_float<T>(x / (1.0f + expf(-2.0f * u)));
}

// dinp: (N) = gelu'(inp) * dout.
template <typename T>
__device__ void gelu_backward(T* dinp, const T* inp, const T* dout, long long n) {
    long long i = global_index();
    if (i >= n) {
        return;
    }
    float x = to_float(inp[i]);
    float u = GELU_SCALE * (x + 0.044715f * x * x * x);
    float s = 1.0f / (1.0f + expf(-2.0f * u));
    float grad = s + 2.0f * x * s * (1.0f - s) * GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] = from_float<T>(grad * to_float(dout[i]));
}

// out: (N) = a + b.
template <typename T>
__device__ void residual_forward(T* out, const T* a, const T* b, long long n) {
    long long i = global_index();
    if (i >= n) {
        return;
    }
    out[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
}

#define ELEMENTWISE_KERNELS(T, S)                                                             \
    extern "C" __global__ void gelu_forward_##S(T* out, const T* inp, long long n) {          \
        gelu_forward<T>(out, inp, n);                                                         \
    }                                                                                         \
    extern "C" __global__ void gelu_backward_##S(T* dinp, const T* inp, const T* dout,        \
                                                 long long n) {                               \
        gelu_backward<T>(dinp, inp, dout, n);                                                 \
    }                                                                                         \
    extern "C" __global__ void residual_forward_##S(T* out, const T* a, const T* b,           \
                                                    long long n) {                            \
        residual_forward<T>(out, a, b, n);                                                    \
    }
FOR_EACH_TYPE(ELEMENTWISE_KERNELS)

// dst: (N) f32 += src: (N) f32 (gradient accumulation).
extern "C" __global__ void add_f32(float* dst, const float* src, long long n) {
    long long i = global_index();
    if (i < n) {
        dst[i] = dst[i] + src[i];
    }
}

// The fold of a reduce-scatter: acc[i] = ((acc[i] + x_0[i]) + x_1[i]) + ... over `ranks`
// chunks of n laid one after another (rank order), or from x_0[i] without `accumulate`:
// strata-comm's order, so NCCL's exchange followed by this fold gives MPI's bits.
extern "C" __global__ void fold_ranks(float* acc, const float* chunks, long long n, int ranks,
                                      int accumulate) {
    long long i = global_index();
    if (i < n) {
        float sum = accumulate ? acc[i] + chunks[i] : chunks[i];
        for (int p = 1; p < ranks; ++p) {
            sum = sum + chunks[(long long)p * n + i];
        }
        acc[i] = sum;
    }
}
