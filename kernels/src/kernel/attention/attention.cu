// Causal self-attention around cuBLAS's batched products: moving Q, K, V between the
// (B, T, 3, NH, HS) layout of the qkv activation and per-head (B, NH, T, HS) tensors, and
// the causal softmax with its backward.

// For element i of a (B, NH, T, HS) tensor: the offset of the same (batch, position,
// head, channel) in a tensor whose rows hold `parts` × NH × HS values (parts = 3 for
// qkv, 1 for the attention output), in part 0.
__device__ __forceinline__ long long row_major_offset(long long i, int t, int nh, int hs,
                                                      int parts) {
    int d = (int)(i % hs);
    long long r = i / hs;
    int ti = (int)(r % t);
    r /= t;
    int h = (int)(r % nh);
    long long bi = r / nh;
    return ((bi * t + ti) * parts * nh + h) * hs + d;
}

// q, k, v: (B, NH, T, HS)  from qkv: (B, T, 3, NH, HS). One thread per element of q.
template <typename T>
__device__ void attention_split(T* q, T* k, T* v, const T* qkv, int b, int t, int nh, int hs) {
    long long i = global_index();
    if (i >= (long long)b * nh * t * hs) {
        return;
    }
    long long src = row_major_offset(i, t, nh, hs, 3);
    long long part = (long long)nh * hs;
    q[i] = qkv[src];
    k[i] = qkv[src + part];
    v[i] = qkv[src + 2 * part];
}

// dqkv: (B, T, 3, NH, HS)  from dq, dk, dv: (B, NH, T, HS). The inverse of attention_split.
template <typename T>
__device__ void attention_join(T* dqkv, const T* dq, const T* dk, const T* dv, int b, int t,
                               int nh, int hs) {
    long long i = global_index();
    if (i >= (long long)b * nh * t * hs) {
        return;
    }
    long long dst = row_major_offset(i, t, nh, hs, 3);
    long long part = (long long)nh * hs;
    dqkv[dst] = dq[i];
    dqkv[dst + part] = dk[i];
    dqkv[dst + 2 * part] = dv[i];
}

// out: (B, T, NH, HS)  from inp: (B, NH, T, HS), or the reverse when `to_heads` is set.
template <typename T>
__device__ void attention_heads(T* out, const T* inp, int b, int t, int nh, int hs,
                                int to_heads) {
    long long i = global_index();
    if (i >= (long long)b * nh * t * hs) {
        return;
    }
    long long merged = row_major_offset(i, t, nh, hs, 1);
    if (to_heads) {
        out[i] = inp[merged];
    } else {
        out[merged] = inp[i];
    }
}

// att: (B, NH, T, T) = the causal softmax of scores: (B, NH, T, T) f32, already scaled.
// The batched product fills whole T x T score matrices; only entries j <= row are read,
// and att is written zero above the diagonal. Scores stay f32 so that bf16 rounds only
// the probabilities.
// One warp per row.
template <typename T>
__device__ void softmax_causal_forward(T* att, const float* scores, int rows, int t) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) {
        return;
    }
    int ti = row % t;
    const float* x = scores + (long long)row * t;
    T* a = att + (long long)row * t;
    float m = NEG_INF;
    for (int j = lane; j <= ti; j += 32) {
        m = fmaxf(m, x[j]);
    }
    m = warp_max(m);
    float s = 0.0f;
    for (int j = lane; j <= ti; j += 32) {
        s += expf(x[j] - m);
    }
    float inv = 1.0f / warp_sum(s);
    for (int j = lane; j < t; j += 32) {
        a[j] = from_float<T>(j <= ti ? expf(x[j] - m) * inv : 0.0f);
    }
}

// dpre: (B, NH, T, T) = the gradient of the scaled scores, att * (datt - sum(att * datt))
// * scale, zero above the diagonal; datt: (B, NH, T, T) f32, the gradient of att. One warp
// per row.
template <typename T>
__device__ void softmax_causal_backward(T* dpre, const float* datt, const T* att, int rows,
                                        int t, float scale) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) {
        return;
    }
    int ti = row % t;
    const float* d = datt + (long long)row * t;
    const T* a = att + (long long)row * t;
    T* out = dpre + (long long)row * t;
    float dot = 0.0f;
    for (int j = lane; j <= ti; j += 32) {
        dot += to_float(a[j]) * d[j];
    }
    dot = warp_sum(dot);
    for (int j = lane; j < t; j += 32) {
        float g = j <= ti ? to_float(a[j]) * (d[j] - dot) * scale : 0.0f;
        out[j] = from_float<T>(g);
    }
}

#define ATTENTION_KERNELS(T, S)                                                               \
    extern "C" __global__ void attention_split_##S(T* q, T* k, T* v, const T* qkv, int b,     \
                                                   int t, int nh, int hs) {                   \
        attention_split<T>(q, k, v, qkv, b, t, nh, hs);                                       \
    }                                                                                         \
    extern "C" __global__ void attention_join_##S(T* dqkv, const T* dq, const T* dk,          \
                                                  const T* dv, int b, int t, int nh, int hs) {\
        attention_join<T>(dqkv, dq, dk, dv, b, t, nh, hs);                                    \
    }                                                                                         \
    extern "C" __global__ void attention_heads_##S(T* out, const T* inp, int b, int t,        \
                                                   int nh, int hs, int to_heads) {            \
        attention_heads<T>(out, inp, b, t, nh, hs, to_heads);                                 \
    }                                                                                         \
    extern "C" __global__ void softmax_causal_forward_##S(T* att, const float* scores,        \
                                                          int rows, int t) {                  \
        softmax_causal_forward<T>(att, scores, rows, t);                                      \
    }                                                                                         \
    extern "C" __global__ void softmax_causal_backward_##S(T* dpre, const float* datt,        \
                                                           const T* att, int rows, int t,     \
                                                           float scale) {                     \
        softmax_causal_backward<T>(dpre, datt, att, rows, t, scale);                          \
    }
FOR_EACH_TYPE(ATTENTION_KERNELS)
