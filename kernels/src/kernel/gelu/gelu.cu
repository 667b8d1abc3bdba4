// GELU with GPT-2's tanh approximation, forward and backward. One thread per element.

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

#define GELU_KERNELS(T, S)                                                                    \
    extern "C" __global__ void gelu_forward_##S(T* out, const T* inp, long long n) {          \
        gelu_forward<T>(out, inp, n);                                                         \
    }                                                                                         \
    extern "C" __global__ void gelu_backward_##S(T* dinp, const T* inp, const T* dout,        \
                                                 long long n) {                               \
        gelu_backward<T>(dinp, inp, dout, n);                                                 \
    }
FOR_EACH_TYPE(GELU_KERNELS)
