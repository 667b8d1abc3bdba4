// The SwiGLU gate of the Llama family's MLP, forward and backward. One thread per
// element.

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

#define SWIGLU_KERNELS(T, S)                                                                  \
    extern "C" __global__ void swiglu_forward_##S(T* out, const T* gate, const T* up,         \
                                                  long long n) {                              \
        swiglu_forward<T>(out, gate, up, n);                                                  \
    }                                                                                         \
    extern "C" __global__ void swiglu_backward_##S(T* dgate, T* dup, const T* dout,           \
                                                   const T* gate, const T* up, long long n) { \
        swiglu_backward<T>(dgate, dup, dout, gate, up, n);                                    \
    }
FOR_EACH_TYPE(SWIGLU_KERNELS)
