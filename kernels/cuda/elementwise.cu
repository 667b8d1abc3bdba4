// Elementwise kernels: GELU (tanh approximation), the residual add, and casts between
// f32 and the 16-bit formats. One thread per element.

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

// out: (N) = a + b.
template <typename T>
__device__ void residual_forward(T* out, const T* a, const T* b, long long n) {
    long long i = global_index();
    if (i >= n) {
        return;
    }
    out[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
}

#define ELEMENTWISE_KERNELS(T, S)                                                             \
    extern "C" __global__ void gelu_forward_##S(T* out, const T* inp, long long n) {          \
        gelu_forward<T>(out, inp, n);                                                         \
    }                                                                                         \
    extern "C" __global__ void gelu_backward_##S(T* dinp, const T* inp, const T* dout,        \
                                                 long long n) {                               \
        gelu_backward<T>(dinp, inp, dout, n);                                                 \
    }                                                                                         \
    extern "C" __global__ void residual_forward_##S(T* out, const T* a, const T* b,           \
                                                    long long n) {                            \
        residual_forward<T>(out, a, b, n);                                                    \
    }
FOR_EACH_TYPE(ELEMENTWISE_KERNELS)

// out: (N) bf16  inp: (N) f32.
extern "C" __global__ void cast_f32_to_bf16(bf16* out, const float* inp, long long n) {
    long long i = global_index();
    if (i < n) {
        out[i] = from_float<bf16>(inp[i]);
    }
}

// out: (N) f32  inp: (N) bf16. Exact.
extern "C" __global__ void cast_bf16_to_f32(float* out, const bf16* inp, long long n) {
    long long i = global_index();
    if (i < n) {
        out[i] = to_float(inp[i]);
    }
}

// out: (N) fp16 bits  inp: (N) f32. The conversion instruction by PTX, so that no toolkit
// header is needed.
extern "C" __global__ void cast_f32_to_f16(unsigned short* out, const float* inp, long long n) {
    long long i = global_index();
    if (i < n) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(inp[i]));
        out[i] = h;
    }
}

// out: (N) f32  inp: (N) fp16 bits. Exact.
extern "C" __global__ void cast_f16_to_f32(float* out, const unsigned short* inp, long long n) {
    long long i = global_index();
    if (i < n) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(inp[i]));
        out[i] = f;
    }
}
