// What every kernel file shares: the bf16 and fp16 storage types and their conversions,
// written with bit operations (bf16) and PTX instructions (fp16) so that NVRTC compiles
// them without the toolkit's headers (no cuda_bf16.h or cuda_fp16.h), and warp and block
// reductions. The kernel files are compiled as one program, after this one.
//
// Conventions: tensors are row-major; shapes are stated above each kernel; `T` is the
// working type of activations and parameters (float, bf16 or f16); parameter gradients
// and per-row statistics are always float. Every typed kernel has an extern "C" entry
// point per type, named `<kernel>_f32`, `<kernel>_bf16` and `<kernel>_f16`; the others
// (optimizer, gradient statistics, f32 accumulation) have one, under their own name.
// Every pointer argument is a raw device address inside the caller's memory; no kernel
// allocates.

struct bf16 {
    unsigned short bits;
};

// IEEE half precision, as its bits.
struct f16 {
    unsigned short bits;
};

__device__ __forceinline__ float to_float(float x) { return x; }

__device__ __forceinline__ float to_float(bf16 x) {
    return __uint_as_float(((unsigned int)x.bits) << 16);
}

// Exact: every fp16 value is a float.
__device__ __forceinline__ float to_float(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

template <typename T> __device__ __forceinline__ T from_float(float x);

template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }

// Round to nearest, ties to even; NaN stays a quiet NaN (as the CPU casts do).
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) {
    unsigned int u = __float_as_uint(x);
    bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)((u >> 16) | 0x40u);
        return r;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    r.bits = (unsigned short)(u >> 16);
    return r;
}

// Round to nearest, ties to even, by the conversion instruction: overflow gives infinity,
// subnormals are kept, NaN stays NaN (as the CPU casts do).
template <> __device__ __forceinline__ f16 from_float<f16>(float x) {
    f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    return v;
}

// The sum over a whole block (blockDim.x a multiple of 32, at most 1024), returned to
// every thread. `shared` holds 32 floats; the call begins with a barrier, so consecutive
// calls may reuse it.
__device__ float block_sum(float v, float* shared) {
    int lane = threadIdx.x % 32;
    int warp = threadIdx.x / 32;
    int warps = blockDim.x / 32;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) {
        shared[warp] = v;
    }
    __syncthreads();
    v = lane < warps ? shared[lane] : 0.0f;
    return warp_sum(v);
}

// As block_sum, for the maximum.
__device__ float block_max(float v, float* shared) {
    int lane = threadIdx.x % 32;
    int warp = threadIdx.x / 32;
    int warps = blockDim.x / 32;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) {
        shared[warp] = v;
    }
    __syncthreads();
    v = lane < warps ? shared[lane] : NEG_INF;
    return warp_max(v);
}

// The index of this thread in a one-dimensional grid.
__device__ __forceinline__ long long global_index() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}

// Column sums of inp: (N, C), added to out: (C). Launched with blockDim (32, 32) and one
// block per 32 columns: threads of a row of the block read consecutive columns; rows are
// added in a fixed order, so the result does not vary from run to run.
template <typename T>
__device__ void column_sums_accumulate(float* out, const T* inp, int n, int c) {
    __shared__ float partial[32][33];
    int col = blockIdx.x * 32 + threadIdx.x;
    float acc = 0.0f;
    if (col < c) {
        for (int row = threadIdx.y; row < n; row += blockDim.y) {
            acc += to_float(inp[(long long)row * c + col]);
        }
    }
    partial[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && col < c) {
        float total = 0.0f;
        for (int y = 0; y < blockDim.y; y++) {
            total += partial[y][threadIdx.x];
        }
        out[col] += total;
    }
}

// Instantiates `BODY` as extern "C" kernels for float, bf16 and f16. BODY(T, SUFFIX)
// expands to the kernel definitions of one type.
#define FOR_EACH_TYPE(BODY) BODY(float, f32) BODY(bf16, bf16) BODY(f16, f16)
