// Fused causal grouped-query attention with O(T) memory (FlashAttention-2's recurrence:
// a running maximum and sum per query, the backward recomputing each probability from
// the forward's log-sum-exp), under an optional sliding window and document boundaries.
// q, out, dout, dq: (B, T, H, D); k, v, dk, dv: (B, T, KV, D); lse, delta: (B, H, T) f32;
// doc_start: (B, T) u32, the first position of each token's document, or null.
//
// One warp per query row (forward, dq) or key row (dk, dv), each lane holding channels
// lane, lane + 32, ... of the row: plain and correct, reading k and v from global memory
// (L2) once per query rather than staging tiles in shared memory. D is at most
// FLASH_MAX_D. Every sum over keys (or queries) runs in the same order on every call, so
// results are deterministic.

#define FLASH_PER_LANE 8
#define FLASH_MAX_D (32 * FLASH_PER_LANE)

// The first key query `ti` of sequence `bi` sees: its document's start, and within the
// last `window` keys when window > 0. Never decreases along a sequence.
__device__ __forceinline__ int flash_first_key(const unsigned* doc_start, int bi, int ti, int t,
                                               int window) {
    int first = doc_start ? (int)doc_start[(long long)bi * t + ti] : 0;
    if (window > 0 && ti + 1 - window > first) {
        first = ti + 1 - window;
    }
    return first;
}

// Loads channels lane, lane + 32, ... of a row of d values into x (zero past d).
template <typename T>
__device__ __forceinline__ void flash_load(float* x, const T* row, int d, int lane) {
#pragma unroll
    for (int c = 0; c < FLASH_PER_LANE; c++) {
        int ch = lane + 32 * c;
        x[c] = ch < d ? to_float(row[ch]) : 0.0f;
    }
}

// The dot product of the warp's x with a row of d values, on every lane.
template <typename T>
__device__ __forceinline__ float flash_dot(const float* x, const T* row, int d, int lane) {
    float s = 0.0f;
#pragma unroll
    for (int c = 0; c < FLASH_PER_LANE; c++) {
        int ch = lane + 32 * c;
        if (ch < d) {
            s += x[c] * to_float(row[ch]);
        }
    }
    return warp_sum(s);
}

// x += a * row.
template <typename T>
__device__ __forceinline__ void flash_axpy(float* x, float a, const T* row, int d, int lane) {
#pragma unroll
    for (int c = 0; c < FLASH_PER_LANE; c++) {
        int ch = lane + 32 * c;
        if (ch < d) {
            x[c] += a * to_float(row[ch]);
        }
    }
}

// row = x * a.
template <typename T>
__device__ __forceinline__ void flash_store(T* row, const float* x, float a, int d, int lane) {
#pragma unroll
    for (int c = 0; c < FLASH_PER_LANE; c++) {
        int ch = lane + 32 * c;
        if (ch < d) {
            row[ch] = from_float<T>(x[c] * a);
        }
    }
}

// Query row `row` of lse, (B, H, T): its position, batch, key/value head, and its row of
// q (B, T, H, D) counted in rows of D.
struct FlashQuery {
    int ti, bi, g;
    long long qrow;
};

__device__ __forceinline__ FlashQuery flash_query(long long row, int t, int h, int kv) {
    FlashQuery r;
    r.ti = (int)(row % t);
    int hi = (int)((row / t) % h);
    r.bi = (int)(row / ((long long)t * h));
    r.g = hi / (h / kv);
    r.qrow = ((long long)r.bi * t + r.ti) * h + hi;
    return r;
}

// out and lse from q, k, v: one warp per (batch, head, query) row of lse.
template <typename T>
__device__ void flash_forward(T* out, float* lse, const T* q, const T* k, const T* v,
                              const unsigned* doc_start, int b, int t, int h, int kv, int d,
                              int window, float scale) {
    long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= (long long)b * h * t) {
        return;
    }
    FlashQuery r = flash_query(row, t, h, kv);
    int ti = r.ti, bi = r.bi, g = r.g;
    long long qrow = r.qrow;
    float x[FLASH_PER_LANE], acc[FLASH_PER_LANE];
    flash_load(x, q + qrow * d, d, lane);
#pragma unroll
    for (int c = 0; c < FLASH_PER_LANE; c++) {
        acc[c] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int j = flash_first_key(doc_start, bi, ti, t, window); j <= ti; j++) {
        long long kvrow = ((long long)bi * t + j) * kv + g;
        float s = flash_dot(x, k + kvrow * d, d, lane) * scale;
        float top = fmaxf(m, s);
        float alpha = m == NEG_INF ? 0.0f : expf(m - top);
        float p = expf(s - top);
        l = l * alpha + p;
#pragma unroll
        for (int c = 0; c < FLASH_PER_LANE; c++) {
            acc[c] *= alpha;
        }
        flash_axpy(acc, p, v + kvrow * d, d, lane);
        m = top;
    }
    flash_store(out + qrow * d, acc, 1.0f / l, d, lane);
    if (lane == 0) {
        lse[row] = m + logf(l);
    }
}

// dq, and delta = rowsum(dout * out) for flash_backward_dkv: one warp per query row.
template <typename T>
__device__ void flash_backward_dq(T* dq, float* delta, const T* dout, const T* out, const T* q,
                                  const T* k, const T* v, const float* lse,
                                  const unsigned* doc_start, int b, int t, int h, int kv, int d,
                                  int window, float scale) {
    long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= (long long)b * h * t) {
        return;
    }
    FlashQuery r = flash_query(row, t, h, kv);
    int ti = r.ti, bi = r.bi, g = r.g;
    long long qrow = r.qrow;
    float x[FLASH_PER_LANE], dy[FLASH_PER_LANE], acc[FLASH_PER_LANE];
    flash_load(x, q + qrow * d, d, lane);
    flash_load(dy, dout + qrow * d, d, lane);
#pragma unroll
    for (int c = 0; c < FLASH_PER_LANE; c++) {
        acc[c] = 0.0f;
    }
    float di = flash_dot(dy, out + qrow * d, d, lane);
    if (lane == 0) {
        delta[row] = di;
    }
    float top = lse[row];
    for (int j = flash_first_key(doc_start, bi, ti, t, window); j <= ti; j++) {
        long long kvrow = ((long long)bi * t + j) * kv + g;
        float p = expf(flash_dot(x, k + kvrow * d, d, lane) * scale - top);
        float dp = flash_dot(dy, v + kvrow * d, d, lane);
        flash_axpy(acc, p * (dp - di), k + kvrow * d, d, lane);
    }
    flash_store(dq + qrow * d, acc, scale, d, lane);
}

// dk and dv: one warp per (batch, key/value head, key) row, summing over the query heads
// that share the key/value head, in order, and the queries that see the key.
template <typename T>
__device__ void flash_backward_dkv(T* dk, T* dv, const T* dout, const T* q, const T* k,
                                   const T* v, const float* lse, const float* delta,
                                   const unsigned* doc_start, int b, int t, int h, int kv, int d,
                                   int window, float scale) {
    long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= (long long)b * kv * t) {
        return;
    }
    int j = (int)(row % t);
    int g = (int)((row / t) % kv);
    int bi = (int)(row / ((long long)t * kv));
    int group = h / kv;
    long long kvrow = ((long long)bi * t + j) * kv + g;
    float kj[FLASH_PER_LANE], vj[FLASH_PER_LANE], gk[FLASH_PER_LANE], gv[FLASH_PER_LANE];
    flash_load(kj, k + kvrow * d, d, lane);
    flash_load(vj, v + kvrow * d, d, lane);
#pragma unroll
    for (int c = 0; c < FLASH_PER_LANE; c++) {
        gk[c] = 0.0f;
        gv[c] = 0.0f;
    }
    for (int hh = 0; hh < group; hh++) {
        int hi = g * group + hh;
        for (int i = j; i < t && flash_first_key(doc_start, bi, i, t, window) <= j; i++) {
            long long qrow = ((long long)bi * t + i) * h + hi;
            long long at = ((long long)bi * h + hi) * t + i;
            float p = expf(flash_dot(kj, q + qrow * d, d, lane) * scale - lse[at]);
            flash_axpy(gv, p, dout + qrow * d, d, lane);
            float dp = flash_dot(vj, dout + qrow * d, d, lane);
            flash_axpy(gk, p * (dp - delta[at]), q + qrow * d, d, lane);
        }
    }
    flash_store(dk + kvrow * d, gk, scale, d, lane);
    flash_store(dv + kvrow * d, gv, 1.0f, d, lane);
}

#define FLASH_ATTENTION_KERNELS(T, S)                                                         \
    extern "C" __global__ void flash_forward_##S(                                             \
        T* out, float* lse, const T* q, const T* k, const T* v, const unsigned* doc_start,    \
        int b, int t, int h, int kv, int d, int window, float scale) {                        \
        flash_forward<T>(out, lse, q, k, v, doc_start, b, t, h, kv, d, window, scale);        \
    }                                                                                         \
    extern "C" __global__ void flash_backward_dq_##S(                                         \
        T* dq, float* delta, const T* dout, const T* out, const T* q, const T* k, const T* v, \
        const float* lse, const unsigned* doc_start, int b, int t, int h, int kv, int d,      \
        int window, float scale) {                                                            \
        flash_backward_dq<T>(dq, delta, dout, out, q, k, v, lse, doc_start, b, t, h, kv, d,   \
                             window, scale);                                                  \
    }                                                                                         \
    extern "C" __global__ void flash_backward_dkv_##S(                                        \
        T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const float* lse,    \
        const float* delta, const unsigned* doc_start, int b, int t, int h, int kv, int d,    \
        int window, float scale) {                                                            \
        flash_backward_dkv<T>(dk, dv, dout, q, k, v, lse, delta, doc_start, b, t, h, kv, d,   \
                              window, scale);                                                 \
    }
FOR_EACH_TYPE(FLASH_ATTENTION_KERNELS)
