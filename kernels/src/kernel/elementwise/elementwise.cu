// Elementwise kernels: the residual add, the elementwise product, the scaled add, the f32
// accumulation of gradients and the fold of a reduce-scatter. One thread per element.

// out: (N) = a + b.
template <typename T>
__device__ void residual_forward(T* out, const T* a, const T* b, long long n) {
    long long i = global_index();
    if (i >= n) {
        return;
    }
    out[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
}

// out: (N) = a * b.
template <typename T>
__device__ void mul_forward(T* out, const T* a, const T* b, long long n) {
    long long i = global_index();
    if (i >= n) {
        return;
    }
    out[i] = from_float<T>(to_float(a[i]) * to_float(b[i]));
}

// dst: (N) += factor * src: (N), the product rounded before the sum (no fused
// multiply-add), as the CPU computes it.
template <typename T>
__device__ void add_scaled(T* dst, const T* src, float factor, long long n) {
    long long i = global_index();
    if (i >= n) {
        return;
    }
    dst[i] = from_float<T>(__fadd_rn(to_float(dst[i]), __fmul_rn(factor, to_float(src[i]))));
}

#define ELEMENTWISE_KERNELS(T, S)                                                             \
    extern "C" __global__ void residual_forward_##S(T* out, const T* a, const T* b,           \
                                                    long long n) {                            \
        residual_forward<T>(out, a, b, n);                                                    \
    }                                                                                         \
    extern "C" __global__ void mul_forward_##S(T* out, const T* a, const T* b, long long n) { \
        mul_forward<T>(out, a, b, n);                                                         \
    }                                                                                         \
    extern "C" __global__ void add_scaled_##S(T* dst, const T* src, float factor,             \
                                              long long n) {                                  \
        add_scaled<T>(dst, src, factor, n);                                                   \
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
