// RMSNorm (Llama, Qwen, Mistral; eps the model's), forward and backward. The same
// kernels normalise Qwen3's per-head q and k (rows of B T H heads of D channels).

// out: (N, C)  rstd: (N)  inp: (N, C)  weight: (C). out = inp * rstd * weight with
// rstd = 1 / sqrt(mean(inp^2) + eps). One warp per row.
template <typename T>
__device__ void rmsnorm_forward(T* out, float* rstd, const T* inp, const T* weight, float eps,
                                int n, int c) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) {
        return;
    }
    const T* x = inp + (long long)row * c;
    float squares = 0.0f;
    for (int i = lane; i < c; i += 32) {
        float v = to_float(x[i]);
        squares += v * v;
    }
    float s = 1.0f / sqrtf(warp_sum(squares) / c + eps);
    T* o = out + (long long)row * c;
    for (int i = lane; i < c; i += 32) {
        o[i] = from_float<T>(to_float(x[i]) * s * to_float(weight[i]));
    }
    if (lane == 0) {
        rstd[row] = s;
    }
}

// dinp: (N, C) +=  dout, inp: (N, C)  weight: (C)  rstd: (N).
// dinp += rstd * (weight * dout - norm * mean(weight * dout * norm)), norm = inp * rstd.
// One warp per row.
template <typename T>
__device__ void rmsnorm_backward_input(T* dinp, const T* dout, const T* inp, const T* weight,
                                       const float* rstd, int n, int c) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) {
        return;
    }
    const T* x = inp + (long long)row * c;
    const T* d = dout + (long long)row * c;
    float s = rstd[row];
    float sum = 0.0f;
    for (int i = lane; i < c; i += 32) {
        sum += to_float(weight[i]) * to_float(d[i]) * to_float(x[i]);
    }
    float mean_gn = warp_sum(sum) * s / c;
    T* di = dinp + (long long)row * c;
    for (int i = lane; i < c; i += 32) {
        float g = to_float(weight[i]) * to_float(d[i]);
        float norm = to_float(x[i]) * s;
        di[i] = from_float<T>(to_float(di[i]) + (g - norm * mean_gn) * s);
    }
}

// dweight: (C) += the column sums of inp * rstd * dout over the N rows. blockDim (32, 32),
// one block per 32 columns, rows added in a fixed order.
template <typename T>
__device__ void rmsnorm_backward_weight(float* dweight, const T* dout, const T* inp,
                                        const float* rstd, int n, int c) {
    __shared__ float partial[32][33];
    int col = blockIdx.x * 32 + threadIdx.x;
    float acc = 0.0f;
    if (col < c) {
        for (int row = threadIdx.y; row < n; row += blockDim.y) {
            long long at = (long long)row * c + col;
            acc += to_float(inp[at]) * rstd[row] * to_float(dout[at]);
        }
    }
    partial[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && col < c) {
        float total = 0.0f;
        for (int y = 0; y < blockDim.y; y++) {
            total += partial[y][threadIdx.x];
        }
        dweight[col] += total;
    }
}

#define RMSNORM_KERNELS(T, S)                                                                 \
    extern "C" __global__ void rmsnorm_forward_##S(T* out, float* rstd, const T* inp,         \
                                                   const T* weight, float eps, int n, int c) {\
        rmsnorm_forward<T>(out, rstd, inp, weight, eps, n, c);                                \
    }                                                                                         \
    extern "C" __global__ void rmsnorm_backward_input_##S(T* dinp, const T* dout,             \
                                                          const T* inp, const T* weight,      \
                                                          const float* rstd, int n, int c) {  \
        rmsnorm_backward_input<T>(dinp, dout, inp, weight, rstd, n, c);                       \
    }                                                                                         \
    extern "C" __global__ void rmsnorm_backward_weight_##S(float* dweight, const T* dout,     \
                                                           const T* inp, const float* rstd,   \
                                                           int n, int c) {                    \
        rmsnorm_backward_weight<T>(dweight, dout, inp, rstd, n, c);                           \
    }
FOR_EACH_TYPE(RMSNORM_KERNELS)
