// LayerNorm, eps 1e-5, biased variance.

// out: (N, C)  mean, rstd: (N)  inp: (N, C)  weight, bias: (C). One warp per row.
template <typename T>
__device__ void layernorm_forward(T* out, float* mean, float* rstd, const T* inp,
                                  const T* weight, const T* bias, int n, int c) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) {
        return;
    }
    const T* x = inp + (long long)row * c;
    float sum = 0.0f;
    for (int i = lane; i < c; i += 32) {
        sum += to_float(x[i]);
    }
    float m = warp_sum(sum) / c;
    float squares = 0.0f;
    for (int i = lane; i < c; i += 32) {
        float d = to_float(x[i]) - m;
        squares += d * d;
    }
    float s = 1.0f / sqrtf(warp_sum(squares) / c + 1e-5f);
    T* o = out + (long long)row * c;
    for (int i = lane; i < c; i += 32) {
        float norm = (to_float(x[i]) - m) * s;
        o[i] = from_float<T>(norm * to_float(weight[i]) + to_float(bias[i]));
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = s;
    }
}

// dinp: (N, C) +=  dout, inp: (N, C)  weight: (C)  mean, rstd: (N). One warp per row.
template <typename T>
__device__ void layernorm_backward_input(T* dinp, const T* dout, const T* inp, const T* weight,
                                         const float* mean, const float* rstd, int n, int c) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) {
        return;
    }
    const T* x = inp + (long long)row * c;
    const T* d = dout + (long long)row * c;
    float m = mean[row];
    float s = rstd[row];
    float sum_d = 0.0f;
    float sum_dn = 0.0f;
    for (int i = lane; i < c; i += 32) {
        float dnorm = to_float(weight[i]) * to_float(d[i]);
        sum_d += dnorm;
        sum_dn += dnorm * (to_float(x[i]) - m) * s;
    }
    float mean_d = warp_sum(sum_d) / c;
    float mean_dn = warp_sum(sum_dn) / c;
    T* di = dinp + (long long)row * c;
    for (int i = lane; i < c; i += 32) {
        float norm = (to_float(x[i]) - m) * s;
        float dnorm = to_float(weight[i]) * to_float(d[i]);
        di[i] = from_float<T>(to_float(di[i]) + (dnorm - mean_d - norm * mean_dn) * s);
    }
}

// dweight, dbias: (C) +=  dout, inp: (N, C)  mean, rstd: (N). blockDim (32, 32), one block
// per 32 columns, rows added in a fixed order.
template <typename T>
__device__ void layernorm_backward_params(float* dweight, float* dbias, const T* dout,
                                          const T* inp, const float* mean, const float* rstd,
                                          int n, int c) {
    __shared__ float partial_w[32][33];
    __shared__ float partial_b[32][33];
    int col = blockIdx.x * 32 + threadIdx.x;
    float acc_w = 0.0f;
    float acc_b = 0.0f;
    if (col < c) {
        for (int row = threadIdx.y; row < n; row += blockDim.y) {
            long long at = (long long)row * c + col;
            float d = to_float(dout[at]);
            acc_w += (to_float(inp[at]) - mean[row]) * rstd[row] * d;
            acc_b += d;
        }
    }
    partial_w[threadIdx.y][threadIdx.x] = acc_w;
    partial_b[threadIdx.y][threadIdx.x] = acc_b;
    __syncthreads();
    if (threadIdx.y == 0 && col < c) {
        float total_w = 0.0f;
        float total_b = 0.0f;
        for (int y = 0; y < blockDim.y; y++) {
            total_w += partial_w[y][threadIdx.x];
            total_b += partial_b[y][threadIdx.x];
        }
        dweight[col] += total_w;
        dbias[col] += total_b;
    }
}

#define LAYERNORM_KERNELS(T, S)                                                               \
    extern "C" __global__ void layernorm_forward_##S(T* out, float* mean, float* rstd,        \
                                                     const T* inp, const T* weight,           \
                                                     const T* bias, int n, int c) {           \
        layernorm_forward<T>(out, mean, rstd, inp, weight, bias, n, c);                       \
    }                                                                                         \
    extern "C" __global__ void layernorm_backward_input_##S(                                  \
        T* dinp, const T* dout, const T* inp, const T* weight, const float* mean,             \
        const float* rstd, int n, int c) {                                                    \
        layernorm_backward_input<T>(dinp, dout, inp, weight, mean, rstd, n, c);               \
    }                                                                                         \
    extern "C" __global__ void layernorm_backward_params_##S(                                 \
        float* dweight, float* dbias, const T* dout, const T* inp, const float* mean,         \
        const float* rstd, int n, int c) {                                                    \
        layernorm_backward_params<T>(dweight, dbias, dout, inp, mean, rstd, n, c);            \
    }
FOR_EACH_TYPE(LAYERNORM_KERNELS)
