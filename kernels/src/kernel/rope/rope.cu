// Rotary position embeddings in Hugging Face's rotate_half form (Llama, Qwen, Mistral),
// forward and backward, and the table of cosines and sines they read.

// out: (B, T, H, D)  inp: (B, T, H, D)  cos, sin: (at least T, D/2); doc_start: (B, T) or
// null; rows = B T H, half = D/2. Row r of token (r / h) at position (r / h) % t (less its
// document's start, when packed), halves x1 and x2, becomes
// (x1 cos - x2 sin', x2 cos + x1 sin') with sin' = sign * sin: the rotation (sign 1) or
// its transpose (sign -1). One thread per pair (x1[i], x2[i]).
template <typename T>
__device__ void rope_rotate(T* out, const T* inp, const T* cos, const T* sin,
                            const unsigned* doc_start, int rows, int t, int h, int half,
                            float sign) {
    long long i = global_index();
    if (i >= (long long)rows * half) {
        return;
    }
    long long row = i / half;
    int j = (int)(i % half);
    long long token = row / h;
    int pos = (int)(token % t) - (doc_start ? (int)doc_start[token] : 0);
    float c = to_float(cos[pos * half + j]);
    float s = sign * to_float(sin[pos * half + j]);
    long long at = row * 2 * half + j;
    float x1 = to_float(inp[at]);
    float x2 = to_float(inp[at + half]);
    out[at] = from_float<T>(x1 * c - x2 * s);
    out[at + half] = from_float<T>(x2 * c + x1 * s);
}

// cos, sin: (T, D/2), half = D/2: the rotary table of positions 0..t (the RopeTable
// kernel, mod.rs; rope_table_of on the CPU). inv_freq[i] = theta^(-2i/D) in double,
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

#define ROPE_KERNELS(T, S)                                                                    \
    extern "C" __global__ void rope_forward_##S(T* out, const T* inp, const T* cos,           \
                                                const T* sin, const unsigned* doc_start,      \
                                                int rows, int t, int h, int half) {           \
        rope_rotate<T>(out, inp, cos, sin, doc_start, rows, t, h, half, 1.0f);                \
    }                                                                                         \
    extern "C" __global__ void rope_backward_##S(T* dinp, const T* dout, const T* cos,        \
                                                 const T* sin, const unsigned* doc_start,     \
                                                 int rows, int t, int h, int half) {          \
        rope_rotate<T>(dinp, dout, cos, sin, doc_start, rows, t, h, half, -1.0f);             \
    }                                                                                         \
    extern "C" __global__ void rope_table_##S(T* cos, T* sin, int t, int half, float theta,   \
                                              float factor, float low_freq_factor,            \
                                              float high_freq_factor,                         \
                                              float original_context) {                       \
        rope_table<T>(cos, sin, t, half, theta, factor, low_freq_factor, high_freq_factor,    \
                      original_context);                                                      \
    }
FOR_EACH_TYPE(ROPE_KERNELS)
