// What linear layers need around cuBLAS's products: the bias broadcast before the
// forward product, and the bias gradient.

// out: (N, OC) = bias: (OC) in every row. One thread per element.
template <typename T>
__device__ void bias_broadcast(T* out, const T* bias, int n, int oc) {
    long long i = global_index();
    if (i >= (long long)n * oc) {
        return;
    }
    out[i] = bias[i % oc];
}

// bias_backward: dbias: (OC) += column sums of dout: (N, OC). blockDim (32, 32), one
// block per 32 columns.
#define MATMUL_KERNELS(T, S)                                                                  \
    extern "C" __global__ void bias_broadcast_##S(T* out, const T* bias, int n, int oc) {     \
        bias_broadcast<T>(out, bias, n, oc);                                                  \
    }                                                                                         \
    extern "C" __global__ void bias_backward_##S(float* dbias, const T* dout, int n, int oc) { \
        column_sums_accumulate<T>(dbias, dout, n, oc);                                        \
    }
FOR_EACH_TYPE(MATMUL_KERNELS)
