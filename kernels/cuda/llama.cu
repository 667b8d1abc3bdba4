// The Llama family's kernels (Llama, Qwen2, Qwen3, Mistral): RMSNorm, rotary position
// embeddings in Hugging Face's rotate_half form, and the SwiGLU gate of the MLP.
// Grouped-query attention runs attention.cu's kernels around cuBLAS.

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

// out: (B, T, H, D)  inp: (B, T, H, D)  cos, sin: (at least T, D/2); rows = B T H,
// half = D/2. Row r at position (r / h) % t, halves x1 and x2, becomes
// (x1 cos - x2 sin', x2 cos + x1 sin') with sin' = sign * sin: the rotation (sign 1) or
// its transpose (sign -1). One thread per pair (x1[i], x2[i]).
template <typename T>
__device__ void rope_rotate(T* out, const T* inp, const T* cos, const T* sin, int rows, int t,
                            int h, int half, float sign) {
    long long i = global_index();
    if (i >= (long long)rows * half) {
        return;
    }
    long long row = i / half;
    int j = (int)(i % half);
    int pos = (int)((row / h) % t);
    float c = to_float(cos[pos * half + j]);
    float s = sign * to_float(sin[pos * half + j]);
    long long at = row * 2 * half + j;
    float x1 = to_float(inp[at]);
    float x2 = to_float(inp[at + half]);
    out[at] = from_float<T>(x1 * c - x2 * s);
    out[at + half] = from_float<T>(x2 * c + x1 * s);
}

// cos, sin: (T, D/2), half = D/2: the rotary table of positions 0..t (program.rs's
// Kernel::RopeTable, ops::rope_table_of on the CPU). inv_freq[i] = theta^(-2i/D) in double,
// rounded to float; with Llama 3 scaling (factor > 0) rescaled in double from that float
// and rounded again; the angle is the float product pos * inv_freq[i], its cosine and sine
// taken in double. One thread per entry.
template <typename T>
__device__ void rope_table(T* cos_out, T* sin_out, int t, int half, float theta, float factor,
                           float low_freq_factor, float high_freq_factor,
                           float original_context) {
    long long idx = global_index();
    if (idx >= (long long)t * half) {
        return;
    }
    int pos = (int)(idx / half);
    int i = (int)(idx % half);
    float inv = (float)(1.0 / pow((double)theta, (double)(2 * i) / (double)(2 * half)));
    if (factor > 0.0f) {
        double f = (double)inv;
        double wavelen = 2.0 * 3.141592653589793 / f;
        double old = (double)original_context;
        double low = (double)low_freq_factor;
        double high = (double)high_freq_factor;
        double scaled;
        if (wavelen < old / high) {
            scaled = f;
        } else if (wavelen > old / low) {
            scaled = f / (double)factor;
        } else {
            double smooth = (old / wavelen - low) / (high - low);
            scaled = (1.0 - smooth) * f / (double)factor + smooth * f;
        }
        inv = (float)scaled;
    }
    double angle = (double)((float)pos * inv);
    cos_out[idx] = from_float<T>((float)cos(angle));
    sin_out[idx] = from_float<T>((float)sin(angle));
}

// out: (N) = silu(gate) * up, silu(x) = x / (1 + e^-x).
template <typename T>
__device__ void swiglu_forward(T* out, const T* gate, const T* up, long long n) {
    long long i = global_index();
    if (i >= n) {
        return;
    }
    float g = to_float(gate[i]);
    out[i] = from_float<T>(g / (1.0f + expf(-g)) * to_float(up[i]));
}

// dgate, dup: (N) =  dout, gate, up: (N). dup = silu(gate) dout;
// dgate = s (1 + gate (1 - s)) up dout, s = sigmoid(gate).
template <typename T>
__device__ void swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up,
                                long long n) {
    long long i = global_index();
    if (i >= n) {
        return;
    }
    float g = to_float(gate[i]);
    float d = to_float(dout[i]);
    float s = 1.0f / (1.0f + expf(-g));
    dup[i] = from_float<T>(g * s * d);
    dgate[i] = from_float<T>(s * (1.0f + g * (1.0f - s)) * to_float(up[i]) * d);
}

#define LLAMA_KERNELS(T, S)                                                                   \
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
    }                                                                                         \
    extern "C" __global__ void rope_forward_##S(T* out, const T* inp, const T* cos,           \
                                                const T* sin, int rows, int t, int h,         \
                                                int half) {                                   \
        rope_rotate<T>(out, inp, cos, sin, rows, t, h, half, 1.0f);                           \
    }                                                                                         \
    extern "C" __global__ void rope_backward_##S(T* dinp, const T* dout, const T* cos,        \
                                                 const T* sin, int rows, int t, int h,        \
                                                 int half) {                                  \
        rope_rotate<T>(dinp, dout, cos, sin, rows, t, h, half, -1.0f);                        \
    }                                                                                         \
    extern "C" __global__ void rope_table_##S(T* cos, T* sin, int t, int half, float theta,   \
                                              float factor, float low_freq_factor,            \
                                              float high_freq_factor,                         \
                                              float original_context) {                       \
        rope_table<T>(cos, sin, t, half, theta, factor, low_freq_factor, high_freq_factor,    \
                      original_context);                                                      \
    }                                                                                         \
    extern "C" __global__ void swiglu_forward_##S(T* out, const T* gate, const T* up,         \
                                                  long long n) {                              \
        swiglu_forward<T>(out, gate, up, n);                                                  \
    }                                                                                         \
    extern "C" __global__ void swiglu_backward_##S(T* dgate, T* dup, const T* dout,           \
                                                   const T* gate, const T* up, long long n) { \
        swiglu_backward<T>(dgate, dup, dout, gate, up, n);                                    \
    }
FOR_EACH_TYPE(LLAMA_KERNELS)
