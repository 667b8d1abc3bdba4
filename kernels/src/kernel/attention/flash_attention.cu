// Fused causal grouped-query attention with O(T) memory (FlashAttention-2's recurrence:
// a running maximum and sum per query, the backward recomputing each probability from
// the forward's log-sum-exp), under an optional sliding window and document boundaries.
// q, dq: (B, T, H, D) and k, v, dk, dv: (B, T, KV, D), or all four within GPT-2's fused
// qkv (B, T, 3C) (FlashLayout); out, dout: (B, T, H, D); lse, delta: (B, H, T) f32;
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

// Where a layout keeps q, k and v: rows of `ldq` (q) and `ldkv` (k, v) elements per token,
// k and v from `koff` and `voff` on. Grouped-query attention's separate tensors: ldq = H D,
// ldkv = KV D, offsets 0. GPT-2's fused qkv (B, T, 3C), passed as q, k and v alike:
// ldq = ldkv = 3C, koff = C, voff = 2C. The gradients dq, dk, dv are where q, k, v are.
struct FlashLayout {
    long long ldq, ldkv, koff, voff;
};

__device__ __forceinline__ FlashLayout flash_layout(long long ldq, long long ldkv, long long koff,
                                                    long long voff) {
    FlashLayout l;
    l.ldq = ldq;
    l.ldkv = ldkv;
    l.koff = koff;
    l.voff = voff;
    return l;
}

// Query row `row` of lse, (B, H, T): its position, batch, key/value head, where its q row
// starts, and where its out (and dout) row starts in (B, T, H, D).
struct FlashQuery {
    int ti, bi, g;
    long long q, o;
};

__device__ __forceinline__ FlashQuery flash_query(long long row, int t, int h, int kv, int d,
                                                  FlashLayout l) {
    FlashQuery r;
    r.ti = (int)(row % t);
    int hi = (int)((row / t) % h);
    r.bi = (int)(row / ((long long)t * h));
    r.g = hi / (h / kv);
    long long token = (long long)r.bi * t + r.ti;
    r.q = token * l.ldq + (long long)hi * d;
    r.o = (token * h + hi) * d;
    return r;
}

// Where key j of sequence bi, key/value head g, starts in k (add voff - koff for v).
__device__ __forceinline__ long long flash_key(int bi, int j, int t, int g, int d, FlashLayout l) {
    return ((long long)bi * t + j) * l.ldkv + (long long)g * d + l.koff;
}

// out and lse from q, k, v: one warp per (batch, head, query) row of lse.
template <typename T>
__device__ void flash_forward(T* out, float* lse, const T* q, const T* k, const T* v,
                              const unsigned* doc_start, int b, int t, int h, int kv, int d,
                              FlashLayout lay, int window, float scale) {
    long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= (long long)b * h * t) {
        return;
    }
    FlashQuery r = flash_query(row, t, h, kv, d, lay);
    float x[FLASH_PER_LANE], acc[FLASH_PER_LANE];
    flash_load(x, q + r.q, d, lane);
#pragma unroll
    for (int c = 0; c < FLASH_PER_LANE; c++) {
        acc[c] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int j = flash_first_key(doc_start, r.bi, r.ti, t, window); j <= r.ti; j++) {
        long long at = flash_key(r.bi, j, t, r.g, d, lay);
        float s = flash_dot(x, k + at, d, lane) * scale;
        float top = fmaxf(m, s);
        float alpha = m == NEG_INF ? 0.0f : expf(m - top);
        float p = expf(s - top);
        l = l * alpha + p;
#pragma unroll
        for (int c = 0; c < FLASH_PER_LANE; c++) {
            acc[c] *= alpha;
        }
        flash_axpy(acc, p, v + at - lay.koff + lay.voff, d, lane);
        m = top;
    }
    flash_store(out + r.o, acc, 1.0f / l, d, lane);
    if (lane == 0) {
        lse[row] = m + logf(l);
    }
}

// dq, and delta = rowsum(dout * out) for flash_backward_dkv: one warp per query row.
template <typename T>
__device__ void flash_backward_dq(T* dq, float* delta, const T* dout, const T* out, const T* q,
                                  const T* k, const T* v, const float* lse,
                                  const unsigned* doc_start, int b, int t, int h, int kv, int d,
                                  FlashLayout lay, int window, float scale) {
    long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= (long long)b * h * t) {
        return;
    }
    FlashQuery r = flash_query(row, t, h, kv, d, lay);
    float x[FLASH_PER_LANE], dy[FLASH_PER_LANE], acc[FLASH_PER_LANE];
    flash_load(x, q + r.q, d, lane);
    flash_load(dy, dout + r.o, d, lane);
#pragma unroll
    for (int c = 0; c < FLASH_PER_LANE; c++) {
        acc[c] = 0.0f;
    }
    float di = flash_dot(dy, out + r.o, d, lane);
    if (lane == 0) {
        delta[row] = di;
    }
    float top = lse[row];
    for (int j = flash_first_key(doc_start, r.bi, r.ti, t, window); j <= r.ti; j++) {
        long long at = flash_key(r.bi, j, t, r.g, d, lay);
        float p = expf(flash_dot(x, k + at, d, lane) * scale - top);
        float dp = flash_dot(dy, v + at - lay.koff + lay.voff, d, lane);
        flash_axpy(acc, p * (dp - di), k + at, d, lane);
    }
    flash_store(dq + r.q, acc, scale, d, lane);
}

// dk and dv: one warp per (batch, key/value head, key) row, summing over the query heads
// that share the key/value head, in order, and the queries that see the key.
template <typename T>
__device__ void flash_backward_dkv(T* dk, T* dv, const T* dout, const T* q, const T* k,
                                   const T* v, const float* lse, const float* delta,
                                   const unsigned* doc_start, int b, int t, int h, int kv, int d,
                                   FlashLayout lay, int window, float scale) {
    long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= (long long)b * kv * t) {
        return;
    }
    int j = (int)(row % t);
    int g = (int)((row / t) % kv);
    int bi = (int)(row / ((long long)t * kv));
    int group = h / kv;
    long long at = flash_key(bi, j, t, g, d, lay);
    long long vat = at - lay.koff + lay.voff;
    float kj[FLASH_PER_LANE], vj[FLASH_PER_LANE], gk[FLASH_PER_LANE], gv[FLASH_PER_LANE];
    flash_load(kj, k + at, d, lane);
    flash_load(vj, v + vat, d, lane);
#pragma unroll
    for (int c = 0; c < FLASH_PER_LANE; c++) {
        gk[c] = 0.0f;
        gv[c] = 0.0f;
    }
    for (int hh = 0; hh < group; hh++) {
        int hi = g * group + hh;
        for (int i = j; i < t && flash_first_key(doc_start, bi, i, t, window) <= j; i++) {
            long long token = (long long)bi * t + i;
            long long qat = token * lay.ldq + (long long)hi * d;
            long long oat = (token * h + hi) * d;
            long long li = ((long long)bi * h + hi) * t + i;
            float p = expf(flash_dot(kj, q + qat, d, lane) * scale - lse[li]);
            flash_axpy(gv, p, dout + oat, d, lane);
            float dp = flash_dot(vj, dout + oat, d, lane);
            flash_axpy(gk, p * (dp - delta[li]), q + qat, d, lane);
        }
    }
    flash_store(dk + at, gk, scale, d, lane);
    flash_store(dv + vat, gv, 1.0f, d, lane);
}

#define FLASH_ATTENTION_KERNELS(T, S)                                                         \
    extern "C" __global__ void flash_forward_##S(                                             \
        T* out, float* lse, const T* q, const T* k, const T* v, const unsigned* doc_start,    \
        int b, int t, int h, int kv, int d, long long ldq, long long ldkv, long long koff,    \
        long long voff, int window, float scale) {                                            \
        flash_forward<T>(out, lse, q, k, v, doc_start, b, t, h, kv, d,                        \
                         flash_layout(ldq, ldkv, koff, voff), window, scale);                 \
    }                                                                                         \
    extern "C" __global__ void flash_backward_dq_##S(                                         \
        T* dq, float* delta, const T* dout, const T* out, const T* q, const T* k, const T* v, \
        const float* lse, const unsigned* doc_start, int b, int t, int h, int kv, int d,      \
        long long ldq, long long ldkv, long long koff, long long voff, int window,            \
        float scale) {                                                                        \
        flash_backward_dq<T>(dq, delta, dout, out, q, k, v, lse, doc_start, b, t, h, kv, d,   \
                             flash_layout(ldq, ldkv, koff, voff), window, scale);             \
    }                                                                                         \
    extern "C" __global__ void flash_backward_dkv_##S(                                        \
        T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const float* lse,    \
        const float* delta, const unsigned* doc_start, int b, int t, int h, int kv, int d,    \
        long long ldq, long long ldkv, long long koff, long long voff, int window,            \
        float scale) {                                                                        \
        flash_backward_dkv<T>(dk, dv, dout, q, k, v, lse, delta, doc_start, b, t, h, kv, d,   \
                              flash_layout(ldq, ldkv, koff, voff), window, scale);            \
    }
FOR_EACH_TYPE(FLASH_ATTENTION_KERNELS)

// doc_start: (B, T) = each token's document's first position, documents ending with the
// token `eos` (the token after it starts the next) or with the sequence; tokens: (B, T).
// One thread per sequence, in order.
extern "C" __global__ void doc_starts(unsigned* doc_start, const unsigned* tokens, int b, int t,
                                      unsigned eos) {
    long long bi = global_index();
    if (bi >= b) {
        return;
    }
    unsigned start = 0;
    for (int i = 0; i < t; i++) {
        long long at = bi * t + i;
        if (i > 0 && tokens[at - 1] == eos) {
            start = (unsigned)i;
        }
        doc_start[at] = start;
    }
}
